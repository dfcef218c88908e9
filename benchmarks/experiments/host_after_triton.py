"""Does a process that compiled and launched Triton kernels itself pay more host time for every later ATen call?

    python -m benchmarks.experiments.host_after_triton [--control]

Times a loop of small CUDA matmuls (host-bound: each a few microseconds of GPU work) in thread CPU time, then
compiles and launches liger_lab's RMSNorm (a Triton kernel compiled in this process), then times the same loop again.
With ``--control`` the middle step runs eager PyTorch instead. Prints the threads of the process before and after.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import liger_lab


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def loop_us(a: torch.Tensor, b: torch.Tensor, calls: int = 2000, rounds: int = 7) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.thread_time()
        for _ in range(calls):
            torch.mm(a, b)
        best = min(best, (time.thread_time() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main(control: bool) -> None:
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    print(f"before: {loop_us(a, b):.2f} us per mm, {threads()} threads", flush=True)
    x = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(20):
        if control:
            y = torch.nn.functional.rms_norm(x, (768,), w, 1e-6)
        else:
            y = liger_lab.rms_norm(x, w)
        y.sum().backward()
    torch.cuda.synchronize()
    print(f"after {'eager rms_norm' if control else 'liger_lab.rms_norm'}: {loop_us(a, b):.2f} us per mm, "
          f"{threads()} threads", flush=True)  # fmt: skip
    time.sleep(2)
    print(f"2 s later: {loop_us(a, b):.2f} us per mm, {threads()} threads", flush=True)


if __name__ == "__main__":
    main("--control" in sys.argv[1:])
