"""Where an eager call's host time goes on a GPU machine: cProfile of forward+backward loops, by own time.

    python -m benchmarks.experiments.host_profile [fused_linear_cross_entropy cross_entropy swiglu step:MODE]

The fused linear cross-entropy runs at the small preset's loss (4096 tokens, hidden 768, vocabulary 32000) with the
chunk a patched model gives it there (192 tokens), where the training step showed about 0.6 ms of host time per
chunk. ``step:MODE`` profiles a whole eager training step of the small preset at 4 x 1024 in that mode (one mode
per process: patching is module-wide), sorted by own time and then by cumulative time.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

import liger_lab

CASES = {
    "fused_linear_cross_entropy": lambda: (
        lambda h, w, t: liger_lab.fused_linear_cross_entropy(h, w, t, chunk_tokens=192),
        [torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True),
         torch.randn(32000, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True),
         torch.randint(0, 32000, (4096,), device="cuda")],
    ),
    "cross_entropy": lambda: (
        liger_lab.cross_entropy,
        [torch.randn(4096, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True),
         torch.randint(0, 32000, (4096,), device="cuda")],
    ),
    "swiglu": lambda: (
        liger_lab.swiglu,
        [torch.randn(4096, 3072, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)],
    ),
}  # fmt: skip


def profile_step(mode: str) -> None:
    from liger_lab.e2e.presets import model_config
    from liger_lab.e2e.training import apply_mode, build_model, make_optimizer, random_batch, train_step

    config = model_config("small")
    model = build_model(config)
    apply_mode(model, mode)
    optimizer = make_optimizer(model, 1e-4)
    tokens = random_batch(config, 4, 1024, 0)
    for _ in range(5):
        train_step(model, optimizer, tokens)
    torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(20):
        train_step(model, optimizer, tokens)
    cpu = time.process_time() - cpu
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 20 * 1e3
    print(f"=== step {mode}: {wall:.2f} ms per step, host CPU {cpu / 20 * 1e3:.2f} ms (no profiler)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(10):
        train_step(model, optimizer, tokens)
    torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        if name.startswith("step:"):
            profile_step(name.removeprefix("step:"))
            continue
        fn, inputs = CASES[name]()
        leaves = [t for t in inputs if t.requires_grad]

        def call(fn=fn, inputs=inputs, leaves=leaves) -> None:
            out = fn(*inputs)
            torch.autograd.grad(out, leaves, torch.ones_like(out))

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        print(f"=== {name}: {(time.perf_counter() - start) / 20 * 1e3:.3f} ms per fwd+bwd call (no profiler)")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main(sys.argv[1:])
