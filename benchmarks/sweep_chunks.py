"""Time and peak memory of a fused loss at several chunk sizes, each passed in as the op's keyword.

    python benchmarks/sweep_chunks.py fused_linear_jsd chunk_tokens 528 832 1056 1584 [--json FILE]
    python benchmarks/sweep_chunks.py fused_linear_dpo chunk_pairs 1 2 4

The op runs at its protocol shape in bf16 (forward+backward; the profiler's kernel sum, wall time beside it);
the default call is measured first as the yardstick. GPU only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import liger_lab  # noqa: F401  (chooses GPU or interpreter before triton is imported)
from liger_lab import bench, profiling, runtime
from liger_lab.ops.table import OPS as TABLE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=list(bench.OPS))
    parser.add_argument("keyword", help="the op's chunk-size keyword, e.g. chunk_tokens")
    parser.add_argument("values", nargs="+", type=int)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if runtime.INTERPRET:
        raise SystemExit("sweep_chunks.py needs a GPU")
    op, spec = bench.OPS[args.op], TABLE[args.op]
    impls = {"liger_lab": spec.call()}
    impls.update({f"liger_lab:{args.keyword}={value}": spec.call(**{args.keyword: value}) for value in args.values})
    results = []
    for label, fn in impls.items():
        result = profiling.measure(
            args.op, label, fn, lambda: op.make_inputs(op.shape, torch.bfloat16), full_flops=op.flops(op.shape),
            graph=op.graph_timing,
        )  # fmt: skip
        results.append(result)
        print(f"{label:<36} {result.full_ms:8.2f} ms (wall {result.wall_ms or result.full_ms:.2f})"
              f" {result.peak_mib:8.0f} MiB", flush=True)  # fmt: skip
    if args.json:
        rows = [{**r.as_row(), "shape": list(op.shape), **bench.environment()} for r in results]
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
