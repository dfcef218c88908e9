"""The benchmark protocol in one process: every op, every implementation, the ceilings, a norm sweep.

    python -m benchmarks.run                 # protocol shapes on the GPU (minutes)
    python -m benchmarks.run --quick         # smaller shapes, a short sweep
    python -m benchmarks.run --short-sweep   # protocol shapes, a short sweep
    python -m benchmarks.run --op rms_norm   # some ops only
    python -m benchmarks.run --op jsd --impl liger_lab --impl liger   # some implementations only

Writes ``benchmarks/results/<name>.json`` (one row per measurement, each with the GPU name, the versions of torch,
triton, liger_lab and Liger-Kernel and the commit, :func:`liger_lab.workbook.results.write_rows`; ``python -m
benchmarks.import_results`` adds it to the results store) and two plots next to it: ``<name>-ops.png``
(forward+backward time per op and implementation) and ``<name>-norms.png`` (achieved bandwidth of the
norms against hidden size, one panel per token count, with the copy ceiling). The default name is the
GPU's, e.g. ``nvidia-h200``.

Without a GPU everything runs in Triton's interpreter at tiny sizes: the numbers time Python, not a
kernel, and the run only shows that the script works.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # a script that writes files: never open a window
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

import liger_lab  # noqa: E402, F401  (chooses GPU or interpreter before triton is imported)
from liger_lab import bench, profiling, runtime  # noqa: E402
from liger_lab.op_table import OPS as TABLE  # noqa: E402
from liger_lab.workbook.results import write_rows  # noqa: E402

NORMS = ("rms_norm", "layer_norm")


def op_shapes(quick: bool) -> dict[str, tuple[int, ...]]:
    """Protocol shapes (or the quick ones) on the GPU; tiny ones (every dimension at most 16) on CPU, where
    each program instance of a kernel costs milliseconds."""
    tiny = {name: tuple(min(s, 16) for s in op.shape) for name, op in bench.OPS.items()}
    protocol = {name: spec.quick_shape if quick else spec.bench_shape for name, spec in TABLE.items()}
    return runtime.pick(cpu=tiny, gpu=protocol)


def sweep_sizes(quick: bool) -> tuple[list[int], list[int]]:
    """(hidden sizes, token counts) of the norm sweep."""
    full = ([1024, 2048, 4096, 8192, 16384], [1024, 4096, 16384])
    return runtime.pick(cpu=([16, 48], [4, 8]), gpu=([1024, 4096, 16384], [4096]) if quick else full)


def ceiling_rows() -> list[dict]:
    """Copy bandwidth and bf16 matmul rate of this device (null in the interpreter)."""
    return [
        {"op": "ceiling_copy", "impl": "torch", "gbs": profiling.copy_bandwidth_gbs()},
        {"op": "ceiling_matmul_bf16", "impl": "torch", "tflops": profiling.matmul_tflops()},
    ]


def norm_sweep(
    norms: Sequence[str], hiddens: Sequence[int], token_counts: Sequence[int]
) -> tuple[list[dict], list[str]]:
    """Every available implementation of each norm at every (tokens, hidden); rows carry tokens and hidden."""
    rows, failures = [], []
    for name in tqdm(norms, desc="norm sweep", unit="op", disable=None):
        for tokens in token_counts:
            for hidden in hiddens:
                results, failed = bench.run_op_benchmarks([name], shapes={name: (tokens, hidden)})
                failures += failed
                rows += [{**r.as_row(), "sweep": "norms", "tokens": tokens, "hidden": hidden} for r in results]
    return rows, failures


def winners(rows: Sequence[dict]) -> list[str]:
    """One line per (norm, tokens, hidden): the fastest implementation and liger_lab's time against it."""
    lines = []
    keys = sorted({(r["op"], r["tokens"], r["hidden"]) for r in rows})
    for op, tokens, hidden in keys:
        group = {r["impl"]: r["full_ms"] for r in rows if (r["op"], r["tokens"], r["hidden"]) == (op, tokens, hidden)}
        best = min(group, key=group.get)
        ours = group.get("liger_lab")
        note = "" if ours is None else f"  liger_lab at {group[best] / ours:.0%} of the best speed"
        lines.append(f"{op:<11} {tokens:>6} x {hidden:<6} fastest: {best:<14}{note}")
    return lines


def plot_sweep(rows: Sequence[dict], copy_gbs: float | None):
    """Achieved GB/s (minimum bytes over forward+backward time) against hidden size, per norm and token count."""
    ops = sorted({r["op"] for r in rows})
    token_counts = sorted({r["tokens"] for r in rows})
    fig, axes = plt.subplots(
        len(ops), len(token_counts), figsize=(4.2 * len(token_counts), 3.2 * len(ops)), squeeze=False
    )
    for i, op in enumerate(ops):
        for j, tokens in enumerate(token_counts):
            ax = axes[i][j]
            for impl in sorted({r["impl"] for r in rows if r["op"] == op}):
                points = sorted(
                    (r["hidden"], r["full_gbs"])
                    for r in rows
                    if (r["op"], r["tokens"], r["impl"]) == (op, tokens, impl)
                )
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
            if copy_gbs:
                ax.axhline(copy_gbs, color="k", ls="--", lw=1, label="copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}, {tokens} tokens")
            ax.set_xlabel("hidden size")
            ax.set_ylabel("GB/s, fwd+bwd" + (" (CPU interpreter)" if runtime.INTERPRET else ""))
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def default_name(quick: bool) -> str:
    gpu = profiling.environment()["gpu"]
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().split("(")[0]).strip("-") or "device"
    return slug + ("-quick" if quick else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes and a short sweep")
    parser.add_argument("--short-sweep", action="store_true", help="protocol shapes, but the short norm sweep")
    parser.add_argument("--op", action="append", choices=list(bench.OPS), help="op to run (repeatable; default all)")
    parser.add_argument("--impl", action="append", help="implementation to run (repeatable; default all)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the norm sweep over hidden size and tokens")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="output folder")
    parser.add_argument("--name", help="file name stem (default: the GPU name)")
    args = parser.parse_args(argv)

    print(runtime.describe())
    print(f"timer: {runtime.timer_label()}")
    ops = args.op or list(bench.OPS)

    rows = ceiling_rows()
    copy_gbs = rows[0]["gbs"]
    if copy_gbs is not None:
        print(f"copy ceiling {copy_gbs:.0f} GB/s, bf16 matmul {rows[1]['tflops']:.0f} TFLOP/s")

    shapes = op_shapes(args.quick)
    results, failures = bench.run_op_benchmarks(ops, shapes=shapes, impls=args.impl)
    profiling.print_table(results)
    rows += [{**r.as_row(), "shape": list(shapes[r.op])} for r in results]

    sweep: list[dict] = []
    norms = [n for n in NORMS if n in ops]
    if norms and not args.no_sweep:
        hiddens, token_counts = sweep_sizes(args.quick or args.short_sweep)
        sweep, sweep_failures = norm_sweep(norms, hiddens, token_counts)
        failures += sweep_failures
        print("\n".join(winners(sweep)))
    rows += sweep

    name = args.name or default_name(args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{name}.json"
    write_rows(rows, json_path)
    print(f"wrote {json_path}")
    if results:
        bench.plot_ops(results).savefig(args.out / f"{name}-ops.png", dpi=120, bbox_inches="tight")
        print(f"wrote {args.out / f'{name}-ops.png'}")
    if sweep:
        plot_sweep(sweep, copy_gbs).savefig(args.out / f"{name}-norms.png", dpi=120, bbox_inches="tight")
        print(f"wrote {args.out / f'{name}-norms.png'}")
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
