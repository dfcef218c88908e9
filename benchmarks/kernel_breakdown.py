"""Where an op's forward+backward spends its GPU time: its kernels, summed by name under torch.profiler.

    python benchmarks/kernel_breakdown.py fused_linear_jsd fused_linear_dpo [--impl liger] [--json out.json]

For each op of the table (protocol shape, bf16), one forward+backward is profiled ``--calls`` times and every
kernel, copy and fill is summed by name; the largest are printed with their share, and the matmul floor
(FLOPs at the measured bf16 rate) when the op has one. GPU only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import liger_lab  # noqa: F401  (chooses GPU or interpreter before triton is imported)
from liger_lab import bench, profiling, runtime


def op_kernel_times(op: bench.OpBench, impl: str, calls: int) -> dict[str, float]:
    """Kernel times of one forward+backward of ``impl`` at the protocol shape, in bf16."""
    fn = op.available()[impl]
    inputs = op.make_inputs(op.shape, torch.bfloat16)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    return runtime.kernel_times_ms(lambda: torch.autograd.grad(fn(*inputs), leaves), calls=calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="+", choices=list(bench.OPS))
    parser.add_argument("--impl", default="liger_lab")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if runtime.INTERPRET:
        raise SystemExit("kernel_breakdown.py needs a GPU: the interpreter runs no kernels to profile")
    rate = profiling.matmul_tflops()
    rows = []
    for name in args.ops:
        op = bench.OPS[name]
        times = op_kernel_times(op, args.impl, args.calls)
        total = sum(times.values())
        floor = op.flops(op.shape) / (rate * 1e12) * 1e3 if op.flops else None
        floor_text = f", matmul floor {floor:.2f} ms" if floor else ""
        print(f"\n{name} {args.impl} {op.shape}: kernels {total:.2f} ms{floor_text}")
        for kernel, ms in list(times.items())[: args.top]:
            print(f"  {ms:8.3f} ms  {ms / total:5.1%}  {kernel[:90]}")
        rows.append({"op": name, "impl": args.impl, "shape": list(op.shape), "kernel_ms": round(total, 3),
                     "floor_ms": floor, "kernels_ms": {k: round(v, 3) for k, v in times.items()},
                     **bench.environment()})  # fmt: skip
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
