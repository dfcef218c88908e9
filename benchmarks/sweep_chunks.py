"""Time and peak memory of a fused loss at several chunk sizes, each passed in as the op's keyword.

    python -m benchmarks.sweep_chunks fused_linear_jsd chunk_tokens 528 832 1056 1584 [--json FILE]
    python -m benchmarks.sweep_chunks fused_linear_dpo chunk_pairs 1 2 4
    python -m benchmarks.sweep_chunks fused_linear_cross_entropy chunk_tokens 768 896 960 1024 \\
        --variant in_place_backward --peer liger
    python -m benchmarks.sweep_chunks fused_linear_cross_entropy chunk_tokens 16 32 --quick --peer eager

The op runs at its protocol shape in bf16 (forward+backward; the profiler's kernel sum, wall time beside it);
the default call is measured first as the yardstick. ``--variant`` adds one of the op's opt-in keyword sets (its
table row's variants, e.g. ``in_place_backward``) to every call, the default chunk's included. ``--peer`` measures
another implementation (``liger``: Liger-Kernel) before and after the chunk sizes, so that a GPU whose speed drifts
during the run shows it. ``--quick`` runs the op's small check shape, in the interpreter too. ``--rounds N`` times
every chunk size N times, the sizes taking turns round by round, so that a GPU warming up or drifting falls on all
of them (a default timed first, alone, can read slow).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

import liger_lab  # noqa: F401  (chooses GPU or interpreter before triton is imported)
from liger_lab import bench, profiling, runtime
from liger_lab.op_table import OPS as TABLE
from liger_lab.workbook import results

VARIANTS = sorted({variant for spec in TABLE.values() for variant in spec.variants})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=list(bench.OPS))
    parser.add_argument("keyword", help="the op's chunk-size keyword, e.g. chunk_tokens")
    parser.add_argument("values", nargs="+", type=int)
    parser.add_argument("--variant", choices=VARIANTS, help="an opt-in of the op, added to every call")
    parser.add_argument("--peer", action="append", default=[], help="implementation measured before and after")
    parser.add_argument("--quick", action="store_true", help="the op's small check shape (runs in the interpreter)")
    parser.add_argument("--rounds", type=int, default=1, help="time every chunk size this many times, in turn")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if runtime.INTERPRET and not args.quick:
        raise SystemExit("sweep_chunks times the protocol shape on a GPU; --quick runs a small one here")
    op, spec = bench.OPS[args.op], TABLE[args.op]
    if args.variant and args.variant not in spec.variants:
        raise SystemExit(f"{args.op} has no variant {args.variant!r}; it has {sorted(spec.variants) or 'none'}")
    available = op.available()
    missing = [peer for peer in args.peer if peer not in available]
    if missing:
        raise SystemExit(f"not available here: {', '.join(missing)}; available: {', '.join(available)}")

    options = spec.variants[args.variant] if args.variant else {}
    label = f"liger_lab:{args.variant}" if args.variant else "liger_lab"
    ours = {label: spec.call(**options)}
    separator = "," if args.variant else ":"
    for value in args.values:
        ours[f"{label}{separator}{args.keyword}={value}"] = spec.call(**options, **{args.keyword: value})
    peers = [(peer, available[peer]) for peer in args.peer]
    shape = spec.check_shapes[0] if args.quick else op.shape
    dtype = runtime.pick(cpu=torch.float32, gpu=torch.bfloat16)  # bf16 on the GPU; fp32 on CPU, quicker
    flops = op.flops(shape) if op.flops else None
    print(runtime.describe(), flush=True)
    rows = []
    rounds = [(f"round {r + 1}" if args.rounds > 1 else None, list(ours.items())) for r in range(args.rounds)]
    for position, plan in (("before", peers), *rounds, ("after", peers)):
        for impl, fn in plan:
            inputs = lambda: op.make_inputs(shape, dtype)
            result = profiling.measure(args.op, impl, fn, inputs, full_flops=flops, graph=op.graph_timing)
            print(profiling.result_line(result) + (f"  [{position}]" if position else ""), flush=True)
            rows.append({**result.as_row(), "shape": list(shape), **({"position": position} if position else {})})
    if args.json:
        results.write_rows(rows, args.json)


if __name__ == "__main__":
    main()
