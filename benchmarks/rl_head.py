"""The RL head and GRPO against their peers, forward+backward, one process (the GPU issue's rows).

    python -m benchmarks.rl_head --json out.json        # H200: 8192 tokens, H 4096, V 128256, bf16

Rows: liger_lab's ``fused_linear_logprobs`` (log-probs and entropy, upstream gradients on both) against TRL 1.16's
fused head (``trl.kernels.ChunkedLogProbFunction``, the same two outputs); ``fused_linear_grpo`` (dapo, beta 0.04,
reference log-probs) against Liger-Kernel's ``LigerFusedLinearGRPOLoss`` at the same settings and TRL's head plus
the same loss formula on its log-probs. GPU time is the kernel sum under torch.profiler (none of these can be
captured in a CUDA graph without syncs on every side); wall time is CUDA events around each call; peak is
``max_memory_allocated`` above the inputs. Floors: 8 N H V FLOPs for a head whose loss is unknown in its forward
(four matmuls), 6 N H V for a loss that makes its gradient in the forward (three), at the measured matmul rate.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

import liger_lab
from liger_lab import profiling, runtime
from liger_lab.formulas import HEAD_OUTPUTS
from liger_lab.workbook.results import write_rows


def head_shapes() -> dict[str, tuple[int, int, int]]:
    """Row label suffix -> (N, H, V) of the head rows: the protocol's shape and a wide one (a small pair on CPU)."""
    return {"": runtime.pick(cpu=(64, 32, 200), gpu=(8192, 4096, 128256)),
            ":wide": runtime.pick(cpu=(96, 16, 300), gpu=(16384, 2048, 151936))}  # fmt: skip


def _inputs(n: int, h: int, v: int, dtype: torch.dtype):
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=runtime.DEVICE).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, device=runtime.DEVICE) * h**-0.5).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), device=runtime.DEVICE)
    return hidden, weight, target


def head_rows(n: int, h: int, v: int, dtype: torch.dtype, outputs: tuple[str, ...]) -> dict[str, Callable]:
    """liger_lab's head and TRL's asked for log-probs and ``outputs``; upstream gradients on every differentiable
    output (logp, entropy, log_sum_sq_probs)."""
    hidden, weight, target = _inputs(n, h, v, dtype)
    upstream = torch.randn(3, n, device=runtime.DEVICE)
    graded = [name for name in outputs if name in ("entropy", "log_sum_sq_probs")]

    def backward(logp: torch.Tensor, by_name: dict[str, torch.Tensor]) -> None:
        loss = (logp * upstream[0]).sum()
        for i, name in enumerate(graded, 1):
            loss = loss + (by_name[name] * upstream[i]).sum()
        loss.backward()

    def ours():
        logp, *made = liger_lab.fused_linear_logprobs(hidden, weight, target, outputs=outputs)
        backward(logp, dict(zip(outputs, made, strict=True)))

    def trl():
        from trl.kernels import ChunkedLogProbFunction

        made = ChunkedLogProbFunction.apply(hidden, weight, None, target, 1.0, 32768, None, 1.0, outputs)
        backward(made[0], dict(zip(HEAD_OUTPUTS, made[1:], strict=True)))

    return {"liger_lab": ours, "trl": trl}


def _grpo_rows(b: int, t: int, h: int, v: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    hidden, weight, target = _inputs(b * t, h, v, dtype)
    hidden3, target2 = hidden.detach().view(b, t, h).requires_grad_(), target.view(b, t)
    advantages = torch.randn(b, device=runtime.DEVICE)
    ref = (-torch.rand(b, t, device=runtime.DEVICE) * 10).float()
    mask = torch.ones(b, t, device=runtime.DEVICE)
    beta = 0.04

    def ours():
        liger_lab.fused_linear_grpo(hidden3, weight, target2, advantages, ref_logps=ref, beta=beta).backward()

    def liger():
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        module = LigerFusedLinearGRPOLoss(beta=beta, loss_type="dapo", use_ref_model=True)
        loss = module(hidden3, weight, target2, mask.long(), advantages, ref_per_token_logps=ref)[0]
        loss.backward()

    def trl():
        from trl.kernels import ChunkedLogProbFunction

        logp = ChunkedLogProbFunction.apply(hidden, weight, None, target, 1.0, 32768, None, 1.0, ())[0].view(b, t)
        coef = torch.exp(logp - logp.detach())
        per_token = -torch.min(coef * advantages[:, None], coef.clamp(0.8, 1.2) * advantages[:, None])
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
        (per_token.sum() / mask.sum()).backward()

    return {"liger_lab": ours, "liger": liger, "trl": trl}


def measure(name: str, rows: dict[str, Callable[[], object]], flops: float, passes: int) -> list[dict]:
    """One row per implementation of ``rows``: GPU time (kernel sum), wall time, peak above the inputs, and the
    floor of ``passes`` matmuls (``flops`` in all) at the matmul rate measured here."""
    rate = profiling.matmul_tflops()
    floor = None if rate is None else flops / (rate * 1e12) * 1e3
    results = []
    for impl, fn in rows.items():
        try:
            gpu = runtime.measure_kernel_sum_ms(fn)
            wall = runtime.measure_ms(fn)
            peak = runtime.peak_memory_bytes(fn)
        except Exception as error:  # a peer that fails must not hide the others
            results.append({"op": name, "impl": impl, "error": f"{type(error).__name__}: {error}"})
            continue
        row = {"op": name, "impl": impl, "gpu_ms": gpu, "wall_ms": wall, "peak_mib": peak and peak / 2**20,
               "floor_ms": floor, "matmuls": passes, "matmul_tflops": rate}  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache() if not runtime.INTERPRET else None
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(runtime.describe())
    b, t = runtime.pick(cpu=(4, 16), gpu=(8, 1024))
    dtype = runtime.pick(cpu=torch.float32, gpu=torch.bfloat16)
    rows = []
    for label, (n, h, v) in head_shapes().items():
        for outputs in (("entropy",), HEAD_OUTPUTS):
            name = "fused_linear_logprobs" + ("" if len(outputs) == 1 else ":all_outputs") + label
            rows += measure(name, head_rows(n, h, v, dtype, outputs), 8.0 * n * h * v, 4)
        torch.cuda.empty_cache() if not runtime.INTERPRET else None
    h, v = head_shapes()[""][1:]
    rows += measure("fused_linear_grpo", _grpo_rows(b, t, h, v, dtype), 6.0 * b * t * h * v, 3)
    if args.json:
        write_rows(rows, Path(args.json))


if __name__ == "__main__":
    main()
