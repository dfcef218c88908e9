"""Tile sweep of the JSD kernel: loss and gradient of 8192 x 128256 bf16 logits, for each divergence.

    python benchmarks/sweep_jsd.py [--json benchmarks/results/h200-sweep-jsd.json]

Each (block of columns, warps) tiling is passed to ``jsd_rows`` as a :class:`liger_lab.runtime.RowLaunch` and
timed by CUDA-graph replay (GPU time); the default tiling is marked. GPU only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

import liger_lab  # noqa: F401  (chooses GPU or interpreter before triton is imported)
from liger_lab import bench, profiling, runtime
from liger_lab.ops.jsd import jsd_rows

ROWS, VOCAB = 8192, 128256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rows", type=int, default=ROWS)
    args = parser.parse_args()
    if runtime.INTERPRET:
        raise SystemExit("sweep_jsd.py needs a GPU")
    student = torch.randn(args.rows, VOCAB, device="cuda").mul_(2).bfloat16()
    teacher = torch.randn(args.rows, VOCAB, device="cuda").mul_(2).bfloat16()
    target = torch.randint(0, VOCAB, (args.rows,), device="cuda")
    loss = torch.empty(args.rows, device="cuda")
    grad = torch.empty_like(student)
    scale = torch.ones((), device="cuda")
    default = runtime.streaming_row_launch(args.rows, VOCAB)
    minimum_bytes = {0.0: 3, 1.0: 3, 0.5: 5}  # passes over 2-byte elements: reads of both inputs, the write
    rows = []
    for beta in (0.5, 0.0, 1.0):
        for block_n in (1024, 2048, 4096, 8192):
            for num_warps in (4, 8, 16):
                launch = runtime.RowLaunch(block_n, 1, num_warps, args.rows)

                def call(launch=launch, beta=beta):
                    options = dict(grad=grad, grad_scale=scale, launch=launch)
                    jsd_rows(student, teacher, target, loss, beta, 1.0, -100, **options)

                ms = float(triton.testing.do_bench_cudagraph(call, rep=200, return_mode="median"))
                gbs = profiling.achieved_gbs(minimum_bytes[beta] * student.numel() * 2, ms)
                is_default = (block_n, num_warps) == (default.block_n, default.num_warps) and default.rows == 1
                rows.append({"beta": beta, "block_n": block_n, "num_warps": num_warps, "ms": round(ms, 3),
                             "gbs": round(gbs), "default": is_default, "timer": "cuda_graph"})  # fmt: skip
                print(f"beta {beta:<4} block {block_n:>5} warps {num_warps:>2}: {ms:7.3f} ms {gbs:6.0f} GB/s"
                      + ("  (default)" if is_default else ""), flush=True)  # fmt: skip
    for beta in (0.5, 0.0, 1.0):
        best = min((r for r in rows if r["beta"] == beta), key=lambda r: r["ms"])
        print(f"fastest for beta {beta}: block {best['block_n']}, {best['num_warps']} warps, {best['ms']} ms")
    if args.json:
        environment = bench.environment()
        args.json.write_text(json.dumps([{**r, "shape": [args.rows, VOCAB], **environment} for r in rows], indent=1))


if __name__ == "__main__":
    main()
