"""Where a training step's GPU time goes, by kind of kernel, for each patching mode.

``python benchmarks/profile_e2e.py [--modes liger_lab,liger] [--batch 8 --seq 2048] [--json FILE]``

Each mode runs in a fresh process (patching changes transformers module-wide): two warm-up steps, then
three steps under ``torch.profiler``. Kernel times are summed from the trace into matmuls, attention,
the optimizer, fused (Triton) kernels, other PyTorch kernels and copies. The fused kernels are the only
part the patching modes differ in, so their share bounds the speedup any kernel library can give:
removing them entirely would make a step ``step / (step - fused)`` times faster.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict

import per_mode
import torch

from liger_lab import e2e

STEPS = 3
CATEGORIES = (  # first match wins; names are lower-cased kernel names
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("attention", ("flash", "fmha", "attention", "attn", "cudnn")),
    ("optimizer", ("multi_tensor", "adam")),
    ("other PyTorch", ("at::native", "at_cuda_detail", "aten")),
)


def category(kernel_name: str) -> str:
    name = kernel_name.lower()
    for label, needles in CATEGORIES:
        if any(needle in name for needle in needles):
            return label
    return "fused (Triton)"


def profile_mode(mode: str, batch: int, seq: int) -> dict:
    # The same model, optimizer, batch and step as `liger-lab bench e2e`.
    config = e2e.llama_config("1.5b")
    model = e2e.build_model(config)
    e2e.apply_mode(model, mode)
    optimizer = e2e._optimizer(model, lr=1e-4)
    tokens = e2e._batch(config, batch, seq, seed=0)
    for _ in range(2):
        e2e._step(model, optimizer, tokens)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(STEPS):
            e2e._step(model, optimizer, tokens)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / STEPS
    with tempfile.NamedTemporaryFile(suffix=".json") as trace_file:
        prof.export_chrome_trace(trace_file.name)
        trace = json.load(open(trace_file.name))
    per_category: dict[str, float] = defaultdict(float)
    per_fused_kernel: dict[str, float] = defaultdict(float)
    for event in trace["traceEvents"]:
        if event.get("ph") != "X" or event.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = event["dur"] / 1e3 / STEPS
        label = "copies" if event["cat"] != "kernel" else category(event["name"])
        per_category[label] += ms
        if label == "fused (Triton)":
            per_fused_kernel[event["name"]] += ms
    busy = sum(per_category.values())
    return {
        "mode": mode, "batch": batch, "seq": seq, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "step_ms_profiled": round(wall_ms, 2), "kernel_ms": round(busy, 2),
        "by_category_ms": {k: round(v, 2) for k, v in sorted(per_category.items(), key=lambda kv: -kv[1])},
        "fused_kernels_ms": {k: round(v, 3) for k, v in sorted(per_fused_kernel.items(), key=lambda kv: -kv[1])},
    }  # fmt: skip


def main() -> None:
    args = per_mode.parse_arguments(__doc__.split("\n\n")[0], "liger_lab,liger")
    if args.child:
        print(json.dumps(profile_mode(args.child, args.batch, args.seq)))
        return
    rows = []
    for row in per_mode.rows_of_children(__file__, args, label="mode"):
        fused = row.get("by_category_ms", {}).get("fused (Triton)", 0.0)
        if "kernel_ms" in row:
            row["bound_if_fused_took_zero"] = round(row["kernel_ms"] / (row["kernel_ms"] - fused), 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    per_mode.write_rows(rows, args.json)


if __name__ == "__main__":
    main()
