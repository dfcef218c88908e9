"""Regenerate the README's and the notes' tables from the results store.

    python -m benchmarks.readme_table           # rewrite every generated table
    python -m benchmarks.readme_table --check   # exit status 1 when a table differs from what the store gives

Each table lies between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in its file and is made from named runs of
the store (:mod:`liger_lab.workbook.results`), as :data:`TABLES` lists them: the op table and the end-to-end table
of the README's benchmark section, its distillation and preference losses, the other vocabularies, and the
end-to-end tables of ``benchmarks/notes/end_to_end.md``. To quote a newer run, import it into the store
(``python -m benchmarks.import_results``), name it in :data:`TABLES` and run this.

In the op tables a row of a later run replaces the row of the same op and implementation in an earlier one. The
``liger_lab`` column is the public call with no options; an opt-in variant (``liger_lab:in_place_backward``) is a
row of its own under its op.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from liger_lab.workbook import results

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ["liger_lab", "liger", "liger:chunked", "torch_compile", "eager", "cce"]
HEADERS = {"liger_lab": "liger_lab", "liger": "Liger-Kernel", "liger:chunked": "Liger-Kernel (chunked loss)",
           "torch_compile": "torch.compile", "eager": "eager", "cce": "cut-cross-entropy",
           "liger_lab:triton_launch": "liger_lab, launches through Triton's launcher"}  # fmt: skip
CLOCKS = {
    "cuda_graph": "CUDA-graph replay, the wall time of a call in brackets",
    "do_bench": "`do_bench` (CUDA events around each call)",
    "profiler": "the kernel sum under `torch.profiler`, the wall time of a call in brackets",
}
MODE_LABELS = {"hf": "Hugging Face eager", "liger": "Liger-Kernel", "hf+compile": "Hugging Face + torch.compile"}
"""How the end-to-end tables name a mode (the others by their own name)."""


def _cell(row: dict | None) -> str:
    if row is None:
        return "–"
    peak, wall = row.get("peak_mib"), row.get("wall_ms")
    time = f"{row['full_ms']:.3f} ms" + (f" ({wall:.1f})" if wall is not None else "")
    return time + (f", {peak:.0f} MiB" if peak is not None else "")


def ops_rows(names: Sequence[str], ops: Sequence[str] | None = None) -> list[dict]:
    """The rows of the runs ``names``, a later run's row replacing an earlier one's of the same op and implementation
    (and sweep point), only ``ops`` (and the ceilings) when given."""
    rows: dict[tuple, dict] = {}
    for name in names:
        for row in results.load(name):
            if ops and row["op"] not in ops and not row["op"].startswith("ceiling"):
                continue
            key = (row["op"], row.get("impl"), row.get("sweep"), row.get("tokens"), row.get("hidden"), row.get("run"))
            rows[key] = row
    return list(rows.values())


def ops_table(all_rows: list[dict]) -> str:
    """Forward+backward time (wall time in brackets) and peak of each op and implementation, liger_lab against
    Liger-Kernel, the ceilings of each run, then the GPU, versions and the clock of each op."""
    rows = [r for r in all_rows if "full_ms" in r and "sweep" not in r]  # the protocol shapes only
    ops = list(dict.fromkeys(r["op"] for r in rows))
    impls = [i for i in IMPLS if any(r.get("impl") == i for r in rows)]
    lines = ["| op (fwd+bwd) | " + " | ".join(HEADERS[i] for i in impls) + " | liger_lab vs Liger |"]
    lines.append("|---" * (len(impls) + 2) + "|")
    for op in ops:
        by_impl = {r["impl"]: r for r in rows if r["op"] == op}
        liger = by_impl.get("liger")
        for ours in ["liger_lab", *sorted(i for i in by_impl if i.startswith("liger_lab:"))]:
            if ours not in by_impl:
                continue
            ratio = f"{by_impl[ours]['full_ms'] / liger['full_ms']:.2f}x time" if liger else ""
            if ours == "liger_lab":
                cells = [_cell(by_impl.get(i)) for i in impls]
                lines.append(f"| {op} | " + " | ".join(cells) + f" | {ratio} |")
            else:  # a variant: its own row, in the liger_lab column
                variant = ours.split(":", 1)[1]
                cells = [_cell(by_impl[ours])] + [""] * (len(impls) - 1)
                lines.append(f"| {op}, `{variant}=True` | " + " | ".join(cells) + f" | {ratio} |")
    runs = list(dict.fromkeys(r.get("run") for r in all_rows if r["op"].startswith("ceiling")))
    for run in runs:  # one run, or several (a file's "run" field), each with the ceilings of its own process
        ceilings = {r["op"]: r for r in all_rows if r["op"].startswith("ceiling") and r.get("run") == run}
        copy, matmul = ceilings.get("ceiling_copy", {}), ceilings.get("ceiling_matmul_bf16", {})
        which = "the same run" if run is None else f"the {run} run"
        lines.append("")
        lines.append(
            f"Ceilings measured in {which}: copy {copy.get('gbs', 0):.0f} GB/s, bf16 matmul "
            f"{matmul.get('tflops', 0):.0f} TFLOP/s."
        )
    first = rows[0]
    versions = ", ".join(f"{k} {first[k]}" for k in ("torch", "triton", "liger_kernel") if k in first)
    by_clock: dict[str, list[str]] = {}
    for row in rows:  # an op whose rows used different clocks is named with its implementation
        mixed = len({r.get("timer") for r in rows if r["op"] == row["op"]}) > 1
        name = f"{row['op']} ({row['impl']})" if mixed else row["op"]
        ops_of_clock = by_clock.setdefault(row.get("timer", "do_bench"), [])
        ops_of_clock += [] if name in ops_of_clock else [name]
    clocks = "; ".join(f"{CLOCKS.get(timer, timer)} for {', '.join(ops)}" for timer, ops in by_clock.items())
    lines.append("")
    lines.append(
        f"{first.get('gpu', '?')}; {versions}. Median GPU time: {clocks}. Peak memory: MiB allocated above the "
        "inputs during one forward+backward."
    )
    return "\n".join(lines)


def raw_rows(names: Sequence[str]) -> str:
    return "Raw rows: " + ", ".join(f"`{(results.RESULTS_DIR / name).relative_to(ROOT)}`" for name in names) + "."


def sources(names: Sequence[str]) -> str:
    """Each run's provenance line (the lease machine too, where a run names it), then the raw rows' files."""
    lines = []
    for name in names:
        machine = results.load(name)[0].get("lease_machine")
        lines.append(results.source(name) + (f", {machine}" if machine else "") + ".")
    return "\n".join([*lines, raw_rows(names)])


def sweep_table(rows: list[dict]) -> str:
    """Chunk sweeps of the fused-linear losses (``benchmarks/sweep_chunks.py``, and the head's backward tiles of
    ``benchmarks/experiments/head_backward_tiles.py``): per op and call, the GPU time (kernel sum), the wall time
    of a call and the peak above the inputs; a peer measured before and after the sweep, or in every round, says
    how far the GPU drifted during it."""
    lines = ["| op | call | GPU ms | wall ms | peak MiB |", "|---|---|---|---|---|"]
    for r in rows:
        position = r.get("position") or (f"round {r['round'] + 1}" if "round" in r else None)
        call = r["impl"] + (f" ({position})" if position else "")
        gpu_ms = r.get("full_ms", r.get("gpu_ms"))  # sweep_chunks' rows, or benchmarks.rl_head's
        lines.append(f"| {r['op']} | {call} | {gpu_ms:.2f} | {r['wall_ms']:.2f} | {r['peak_mib']:,.0f} |")
    return "\n".join(lines)


def e2e_table(rows: list[dict]) -> str:
    """One line per training run: mode, size, tokens/s and peak."""
    lines = ["| impl | batch x seq | tokens/s | peak GiB |", "|---|---|---|---|"]
    for r in rows:
        shape = f"{r.get('batch')} x {r.get('seq')}"
        if r.get("oom"):
            lines.append(f"| {r['impl']} | {shape} | out of memory | – |")
        else:
            lines.append(f"| {r['impl']} | {shape} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.1f} |")
    return "\n".join(lines)


def sizes_table(rows: list[dict]) -> str:
    """One line per mode, two columns (tokens/s, peak GiB) per size, in the order the run had them."""
    sizes = list(dict.fromkeys((r["batch"], r["seq"]) for r in rows))
    header = "".join(f" {batch} x {seq} tokens/s | peak GiB |" for batch, seq in sizes)
    lines = [f"| mode |{header}", "|---" * (1 + 2 * len(sizes)) + "|"]
    for mode in dict.fromkeys(r["impl"] for r in rows):
        cells = []
        for size in sizes:
            row = next((r for r in rows if r["impl"] == mode and (r["batch"], r["seq"]) == size), None)
            if row is None or row.get("oom"):
                cells += ["out of memory" if row else "–", "–"]
            else:
                cells += [f"{row['tokens_per_s']:,.0f}", f"{row['peak_gib']:.1f}"]
        lines.append(f"| {MODE_LABELS.get(mode, mode)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def vocab_table(rows: list[dict], presets: Sequence[str], modes: Sequence[str], ratio_to: str | None = None) -> str:
    """Per preset and mode of a run of ``liger-lab bench e2e --fit``: tokens/s (over ``ratio_to``'s when given),
    peak GiB and the largest batch that trains."""
    train = {(r["model"], r["impl"]): r for r in rows if r["op"] == "e2e"}
    fits = {(r["model"], r["impl"]): r for r in rows if r["op"] == "e2e_fit"}
    some_train, some_fit = next(iter(train.values())), next(iter(fits.values()))
    lines = [
        f"| preset | mode | tokens/s at {some_train['batch']} x {some_train['seq']} | peak GiB | largest batch at seq "
        f"{some_fit['seq']} |",
        "|---|---|---|---|---|",
    ]
    for preset in presets:
        for mode in modes:
            row = train[preset, mode]
            speed, base = row["tokens_per_s"], train[preset, ratio_to]["tokens_per_s"] if ratio_to else None
            ratio = f" ({speed / base:.2f}x)" if base and mode != ratio_to else ""
            largest = fits[preset, mode]["largest"]
            lines.append(f"| {preset} | {MODE_LABELS.get(mode, mode)} | {speed:,.0f}{ratio} | {row['peak_gib']:.2f} | "
                         f"{largest[0] if largest else 0} |")  # fmt: skip
    return "\n".join(lines)


def step_table(rows: list[dict], lengths: list[dict]) -> str:
    """The small preset's training step per mode (``benchmarks/wall_clock.py``): per shape ms per step, tokens/s,
    peak, host and GPU time per step; then the compiled modes over varying lengths."""
    steps = [r for r in rows if r["op"] == "e2e"]
    lines = ["| mode | batch x seq | ms/step | tokens/s | peak GiB | host ms/step | GPU ms/step |", "|---" * 7 + "|"]
    for r in sorted(steps, key=lambda r: (-r["seq"], r["impl"].split(":")[0] not in MODE_ORDER, r["impl"])):
        mode = MODE_LABELS.get(r["impl"], r["impl"])
        lines.append(f"| {mode} | {r['batch']} x {r['seq']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['peak_gib']:.2f} | {r['host_ms_per_step']:.1f} | {r['gpu_ms_per_step']:.1f} |")  # fmt: skip
    if lengths:
        lines += ["", "| mode, 10 new lengths 384..1536, batch 4 | ms/step (second pass) | graphs | first pass s |",
                  "|---|---|---|---|"]  # fmt: skip
    for r in lengths:
        lines.append(f"| {r['impl']} | {r['ms_per_step']:.2f} | {r['graphs']} | {r['first_pass_s']:.1f} |")
    return "\n".join(lines)


MODE_ORDER = ("hf", "hf+compile", "liger", "liger_lab", "liger_lab+compile")
WALL_IMPLS = ("liger_lab", "liger", "eager", "liger_lab:triton_launch")


def op_wall_table(rows: list[dict]) -> str:
    """Per op and shape (``benchmarks/wall_clock.py ops``): each implementation's wall time per forward+backward call
    in a loop with one synchronisation, its host CPU time per call and its GPU time in brackets."""
    header = " | ".join(HEADERS.get(impl, impl) for impl in WALL_IMPLS)
    lines = [f"| op | shape | {header} |", "|---" * (2 + len(WALL_IMPLS)) + "|"]
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if "wall_ms" in r:
            cells.setdefault((r["of"], r["shape_kind"], tuple(r["shape"])), {})[r["impl"]] = r
    for (op, kind, shape), by_impl in cells.items():
        values = [by_impl.get(impl) for impl in WALL_IMPLS]
        text = [f"{v['wall_ms']:.3f} ({v['host_us'] / 1e3:.3f}, {v['gpu_ms']:.3f})" if v else "–" for v in values]
        lines.append(f"| {op} | {kind} {'x'.join(map(str, shape))} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def trl_step_table(rows: list[dict]) -> str:
    """TRL 1.16's training steps (``benchmarks/trl_steps.py``): per trainer, TRL alone and TRL on liger_lab patched
    both ways: ms per step, tokens/s and its ratio to TRL alone, peak, and DPO's first loss minus log 2."""
    lines = ["| TRL trainer | way | ms/step | tokens/s | vs TRL alone | peak GiB | head calls |", "|---" * 7 + "|"]
    alone = {r["trainer"]: r for r in rows if r.get("impl") == "trl" and "tokens_per_s" in r}
    ways = {"trl": "TRL alone", "liger_lab": "patch('llama') before TRL loads it", "liger_lab_obj": "patch(model)"}
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        base = alone.get(r["trainer"])
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "–"
        calls = "–" if r["head_calls"] is None else r["head_calls"]
        lines.append(f"| {r['trainer'].upper()} | {ways.get(r['impl'], r['impl'])} | {r['ms_per_step']:.1f} | "
                     f"{r['tokens_per_s']:,} | {ratio} | {r['peak_gib']:.2f} | {calls} |")  # fmt: skip
    return "\n".join(lines)


def head_table(rows: list[dict]) -> str:
    """The RL head and GRPO against TRL's head and Liger-Kernel (``benchmarks/rl_head.py``): GPU and wall time per
    forward+backward call, peak above the inputs, and the matmul floor at the rate measured in the same run."""
    lines = ["| op | impl | GPU ms | wall ms | peak MiB | floor ms (matmuls) |", "|---" * 6 + "|"]
    for r in rows:
        if r.get("gpu_ms") is None:
            continue
        lines.append(f"| {r['op']} | {r['impl']} | {r['gpu_ms']:.2f} | {r['wall_ms']:.2f} | {r['peak_mib']:,.0f} | "
                     f"{r['floor_ms']:.2f} ({r['matmuls']}) |")  # fmt: skip
    return "\n".join(lines)


@dataclass(frozen=True)
class Table:
    """A generated table: where it lies (a file of the clone and the name of its markers) and how it is made."""

    path: str
    marker: str
    make: Callable[[], str]


BENCH_OPS, BENCH_E2E = ("h200-ops-round6.json",), "h200-e2e-compile.json"
LOSSES, LOSS_OPS = ("h200-ops-round2.json",), ("jsd", "fused_linear_jsd", "fused_linear_dpo", "fused_linear_orpo",
                                                 "fused_linear_simpo")  # fmt: skip
VOCAB, NOTES_E2E = "h200-e2e-vocab.json", "h200-e2e.json"
SMALL_STEP, SMALL_LENGTHS = "h200-wall-clock-e2e.json", "h200-wall-clock-lengths.json"
SMALL_STEP_NOW = ("h200-wall-clock-e2e-47042b1.json",)
SMALL_LENGTHS_NOW, OP_WALL = "h200-wall-clock-lengths-47042b1.json", "h200-wall-clock-ops-47042b1.json"
COMPILE_1_5B = "h200-e2e-1.5b-47042b1.json"
TRL_STEPS, RL_HEAD = "h200-trl-steps-78aa984.json", "h200-rl-head-4d7b479.json"
CHUNK_SWEEPS = ("h200-sweep-grpo-align-caa115f.json", "h200-sweep-flce-align-caa115f.json",
                "h200-sweep-flce-default-78aa984.json", "h200-head-backward-tiles-caa115f.json")  # fmt: skip
TABLES = (
    Table("README.md", "bench", lambda: f"{ops_table(ops_rows(BENCH_OPS))}\n\n{raw_rows(BENCH_OPS)}\n\n"
          f"End to end (Llama-style 1.5B, AdamW, bf16):\n\n{e2e_table(results.load(BENCH_E2E))}"),
    Table("README.md", "losses", lambda: f"{ops_table(ops_rows(LOSSES, LOSS_OPS))}\n\n{raw_rows(LOSSES)}"),
    Table("README.md", "e2e-vocab", lambda: vocab_table(results.load(VOCAB), ("qwen3-1.5b", "gemma3-1.5b"),
                                                       ("hf", "liger", "liger_lab"))),
    Table("benchmarks/notes/end_to_end.md", "e2e", lambda: sizes_table(results.load(NOTES_E2E))),
    Table("benchmarks/notes/host_time.md", "small-step", lambda: (
        f"{step_table(results.load(SMALL_STEP), results.load(SMALL_LENGTHS))}\n\n{results.source(SMALL_STEP)}. "
        f"{raw_rows((SMALL_STEP, SMALL_LENGTHS))}")),
    Table("benchmarks/notes/host_time.md", "small-step-now", lambda: (
        f"{step_table([r for name in SMALL_STEP_NOW for r in results.load(name)], results.load(SMALL_LENGTHS_NOW))}"
        f"\n\n{sources((*SMALL_STEP_NOW, SMALL_LENGTHS_NOW))}")),
    Table("benchmarks/notes/host_time.md", "compile-1.5b", lambda: (
        f"{step_table(results.load(COMPILE_1_5B), [])}\n\n{sources((COMPILE_1_5B,))}")),
    Table("benchmarks/notes/fused_linear_cross_entropy.md", "chunk-floor", lambda: (
        f"{sweep_table([r for name in CHUNK_SWEEPS for r in results.load(name)])}\n\n{sources(CHUNK_SWEEPS)}")),
    Table("benchmarks/notes/host_time.md", "op-wall", lambda: (
        f"{op_wall_table(results.load(OP_WALL))}\n\n{sources((OP_WALL,))}")),
    Table("README.md", "trl-steps", lambda: (
        f"{trl_step_table(results.load(TRL_STEPS))}\n\n{sources((TRL_STEPS,))}")),
    Table("README.md", "rl-head", lambda: (
        f"{head_table(results.load(RL_HEAD))}\n\n{sources((RL_HEAD,))}")),
    Table("benchmarks/notes/end_to_end.md", "e2e-vocab", lambda: vocab_table(
        results.load(VOCAB), ("gemma3-1.5b", "qwen3-1.5b"), ("liger", "liger_lab"), ratio_to="liger")),
)  # fmt: skip
"""Every generated table, with the runs of the store it quotes."""


def regenerated(text: str, marker: str, table: str) -> str:
    """``text`` with the part between the markers of ``marker`` replaced by ``table``."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    if start not in text or end not in text:
        raise ValueError(f"no {start} ... {end} section")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}\n{end}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path in dict.fromkeys(table.path for table in TABLES):
        file = ROOT / path
        old = new = file.read_text()
        for table in (t for t in TABLES if t.path == path):
            new = regenerated(new, table.marker, table.make())
        if new != old:
            stale.append(path)
            if not args.check:
                file.write_text(new)
    verb = "out of date" if args.check else "rewritten"
    for path in stale:
        print(f"{path}: {verb}", file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
