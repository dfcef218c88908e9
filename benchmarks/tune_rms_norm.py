"""Sweep RMSNorm launch settings on the GPU (rows per program, warps, programs per SM).

Run on a GPU: ``python benchmarks/tune_rms_norm.py [--json out.json]``. It times the forward and backward
kernels directly for each setting at the DESIGN.md shape and prints the best; the chosen defaults live in
``liger_lab.runtime`` and the reasoning in ``benchmarks/notes/rms_norm.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from liger_lab import profiling, runtime
from liger_lab.ops.rms_norm import _rms_norm_backward_kernel, _rms_norm_forward_kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    n_rows, n_cols = args.rows, args.cols
    dtype = torch.bfloat16
    x = torch.randn(n_rows, n_cols, device=runtime.DEVICE, dtype=dtype)
    w = torch.randn(n_cols, device=runtime.DEVICE, dtype=dtype)
    dy = torch.randn_like(x)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    rstd = torch.empty(n_rows, device=runtime.DEVICE, dtype=torch.float32)
    block_n = triton.next_power_of_2(n_cols)
    element = x.element_size()
    rows_out = []

    for rows, warps in itertools.product([1, 2, 4, 8], [4, 8, 16]):

        def forward(rows=rows, warps=warps):
            _rms_norm_forward_kernel[(triton.cdiv(n_rows, rows),)](
                x, x.stride(0), w, y, y.stride(0), rstd, n_rows, n_cols, 1e-6, 0.0,
                GEMMA_CASTING=False, ROWS=rows, BLOCK_N=block_n, num_warps=warps,
            )  # fmt: skip

        ms = profiling.time_ms(forward)
        rows_out.append({"kernel": "fwd", "rows": rows, "warps": warps, "ms": ms,
                         "gbs": profiling.achieved_gbs(2 * x.numel() * element, ms)})  # fmt: skip

    sms = runtime.sm_count()
    for rows, warps, per_sm in itertools.product([1, 2, 4], [4, 8, 16], [1, 2, 4, 8]):
        n_programs = min(sms * per_sm, triton.cdiv(n_rows, rows))
        partial = torch.empty(n_programs, n_cols, device=runtime.DEVICE, dtype=torch.float32)

        def fn(rows=rows, warps=warps, n_programs=n_programs, partial=partial):
            _rms_norm_backward_kernel[(n_programs,)](
                dy, dy.stride(0), x, x.stride(0), w, rstd, dx, dx.stride(0), partial, n_rows, n_cols, 0.0,
                ROWS=rows, BLOCK_N=block_n, num_warps=warps,
            )  # fmt: skip
            partial.sum(0)

        ms = profiling.time_ms(fn)
        rows_out.append({"kernel": "bwd", "rows": rows, "warps": warps, "per_sm": per_sm, "ms": ms,
                         "gbs": profiling.achieved_gbs(3 * x.numel() * element, ms)})  # fmt: skip

    for kernel in ("fwd", "bwd"):
        ranked = sorted((r for r in rows_out if r["kernel"] == kernel), key=lambda r: r["ms"])
        for r in ranked[:5]:
            print(kernel, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "shape": [n_rows, n_cols], "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
