"""One MoE experts block, forward+backward: transformers' loop over the experts against the same loop patched by
liger_lab (each expert's ``silu(gate) * up`` on the fused SwiGLU), with transformers' grouped_mm kernel beside them.

    python -m benchmarks.moe_experts            # Qwen3-MoE- and Mixtral-shaped blocks in bf16 (a few minutes)
    python -m benchmarks.moe_experts --quick    # a quarter of the tokens; on CPU, tiny shapes in Triton's interpreter

transformers 5 keeps a mixture of experts' weights as two 3-D tensors per layer (``gate_up_proj`` (E, 2I, H) and
``down_proj`` (E, H, I)) in one ``...Experts`` module, whose forward is a Python loop over the experts that got
tokens (``experts_implementation="eager"``) or one of its kernels (``"grouped_mm"``, its default wherever it runs).
``liger_lab.patch`` fuses the loop and leaves the kernels alone, so the rows are:

- ``transformers``: the eager loop, unpatched;
- ``liger_lab``: the eager loop patched (the call ``liger_lab.patch`` makes of it);
- ``transformers grouped_mm``: transformers' default kernel, unpatched (what a patched model runs too when it is not
  set to the eager loop).

The router is not timed: every row of a block gets the same top-k routing, drawn once (softmax of random logits,
top-k, renormalised). The backward computes what training needs: the gradients of the hidden states, the routing
weights and both expert weights. The loop reads
values back to the host (which experts got tokens, and which tokens), so no CUDA graph captures it: every row is
GPU time from the kernel sum under ``torch.profiler`` (:func:`liger_lab.profiling.gpu_time_ms`), with the wall time
of a call beside it and the peak memory above the inputs. Each row also lists its longest kernels. Before timing,
liger_lab's output is compared with transformers' loop.

Rows print as they finish and the JSON (one row per block and implementation, with the GPU name and the versions
of torch, triton, transformers and liger_lab) is rewritten after each block, by default to
``benchmarks/results/<gpu>-moe-experts.json``.
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

import liger_lab
from benchmarks.run import default_name
from liger_lab import hf, profiling, runtime
from liger_lab.workbook import results
from liger_lab.workbook.checks import relative_l2_error

IMPLS = {"transformers": "eager", "liger_lab": "eager", "transformers grouped_mm": "grouped_mm"}
"""Each row's implementation -> the experts_implementation it runs with."""
CALLS_PER_ROW = 45  # forward+backward passes one row makes: peak, kernel sums, wall-clock bench, kernel list
ASSUMED_TFLOPS, ASSUMED_GBS = 400.0, 3000.0  # what the estimate assumes the loop reaches on an H200
OVERHEAD_S_PER_ROW = 15.0  # profiler traces of thousands of kernels, allocation, warm-up


@dataclass(frozen=True)
class Block:
    """One experts block and the tokens it is given."""

    name: str
    model_type: str
    hidden: int
    experts: int
    intermediate: int
    top_k: int
    tokens: int

    def config(self) -> transformers.PretrainedConfig:
        experts, intermediate = {"qwen3_moe": ("num_experts", "moe_intermediate_size"),
                                 "mixtral": ("num_local_experts", "intermediate_size")}[self.model_type]  # fmt: skip
        sizes = {experts: self.experts, intermediate: self.intermediate, "num_experts_per_tok": self.top_k}
        return transformers.AutoConfig.for_model(self.model_type, hidden_size=self.hidden, **sizes)

    def flops(self) -> float:
        """Matmul FLOPs of a forward+backward: three products of each routed token's (H x 2I) and (I x H), forward,
        and two of each backward."""
        return 3 * 2 * self.tokens * self.top_k * self.hidden * 3 * self.intermediate

    def estimate_s(self) -> float:
        """Seconds this block's rows take on an H200, roughly. Every row runs the matmuls; the two loop rows also
        give each expert's slice ``gate_up_proj[e]`` (and ``down_proj[e]``) a zero-filled gradient the size of the
        whole 3-D weight, summed over the experts: about four passes over both weights per expert."""
        matmul_s = self.flops() / (ASSUMED_TFLOPS * 1e12)
        weight_bytes = 3 * self.experts * self.hidden * self.intermediate * 2
        loop_s = matmul_s + 4 * self.experts * weight_bytes / (ASSUMED_GBS * 1e9)
        return CALLS_PER_ROW * (2 * loop_s + matmul_s) + OVERHEAD_S_PER_ROW * len(IMPLS)


def blocks(quick: bool) -> list[Block]:
    """Qwen3-30B-A3B's and Mixtral-8x7B's experts (a quarter of the tokens with ``quick``); tiny blocks on CPU."""
    if runtime.INTERPRET:
        return [Block("qwen3-moe", "qwen3_moe", 16, 8, 8, 2, 16), Block("mixtral", "mixtral", 16, 4, 24, 2, 16)]
    scale = 4 if quick else 1
    return [
        Block("qwen3-moe", "qwen3_moe", 2048, 128, 768, 8, 16384 // scale),
        Block("mixtral", "mixtral", 4096, 8, 14336, 2, 8192 // scale),
    ]


def build(block: Block, dtype: torch.dtype) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """The block's experts module, built while its family is patched (so it is the fused class), and transformers'
    own forward, which the unpatched rows call on the same module and weights."""
    modeling = importlib.import_module(f"transformers.models.{block.model_type}.modeling_{block.model_type}")
    name = f"{hf.FAMILIES[block.model_type].prefix}Experts"
    original = getattr(modeling, name)
    liger_lab.patch(block.model_type)
    try:
        experts = getattr(modeling, name)(block.config()).to(runtime.DEVICE, dtype)
    finally:
        liger_lab.unpatch(block.model_type)
    with torch.no_grad():
        for weight in experts.parameters():
            weight.normal_(0.0, 0.02)
    return experts, original.forward


def routed_inputs(block: Block, experts: nn.Module, dtype: torch.dtype) -> list[torch.Tensor]:
    """(hidden states, top-k expert indices, their weights, gate_up_proj, down_proj): the weights are listed so that
    the backward computes their gradients as training does."""
    device = runtime.DEVICE
    hidden = torch.randn(block.tokens, block.hidden, device=device, dtype=dtype, requires_grad=True)
    weights, index = torch.randn(block.tokens, block.experts, device=device).softmax(-1).topk(block.top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    return [hidden, index, weights, experts.gate_up_proj, experts.down_proj]


def longest_kernels(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], count: int = 5) -> dict:
    """Milliseconds per forward+backward of the ``count`` longest kernels (empty in the interpreter)."""
    leaves = [x for x in inputs if x.requires_grad]

    def step() -> None:
        out = fn(*inputs)
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    times = runtime.kernel_times_ms(step, calls=3)
    return {name[:80]: round(ms, 3) for name, ms in list(times.items())[:count]}


def measure_block(block: Block, dtype: torch.dtype) -> list[dict]:
    experts, transformers_forward = build(block, dtype)
    forwards = {"transformers": transformers_forward, "liger_lab": type(experts).forward,
                "transformers grouped_mm": transformers_forward}  # fmt: skip
    inputs = routed_inputs(block, experts, dtype)
    config = experts.config
    outputs, rows = {}, []
    for impl, implementation in IMPLS.items():
        config._experts_implementation = implementation
        forward = forwards[impl]

        def fn(hidden, index, weights, *_weights, forward=forward) -> torch.Tensor:
            return forward(experts, hidden, index, weights)

        with torch.no_grad():
            outputs[impl] = fn(*inputs)
        error = relative_l2_error(outputs[impl], outputs["transformers"])
        result = profiling.measure(block.name, impl, fn, lambda: inputs, full_flops=block.flops(), graph=False)
        row = {**result.as_row(), "rel_err_vs_transformers": error, "experts_implementation": implementation,
               "model_type": block.model_type, "hidden": block.hidden, "experts": block.experts,
               "intermediate": block.intermediate, "top_k": block.top_k, "tokens": block.tokens,
               "dtype": str(dtype).removeprefix("torch."), "longest_kernels": longest_kernels(fn, inputs)}  # fmt: skip
        print(f"{profiling.result_line(result)}  rel err {error:.1e}", flush=True)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the tokens (tiny shapes on CPU anyway)")
    parser.add_argument("--json", type=Path, help="output file (default: benchmarks/results/<gpu>-moe-experts.json)")
    args = parser.parse_args(argv)
    path = args.json or Path(__file__).parent / "results" / f"{default_name(args.quick)}-moe-experts.json"
    dtype = runtime.pick(cpu=torch.float32, gpu=torch.bfloat16)  # bf16 on the GPU; fp32 on CPU, quicker

    print(runtime.describe())
    print(f"timer: {runtime.timer_label()}")
    todo = blocks(args.quick)
    if not runtime.INTERPRET:
        estimate = sum(block.estimate_s() for block in todo)
        print(f"estimated {estimate / 60:.1f} min on an H200 (startup aside)", flush=True)
    environment = {**profiling.environment(), "transformers": transformers.__version__}
    rows: list[dict] = []
    start = time.perf_counter()
    for block in todo:
        rows += [{**row, **environment} for row in measure_block(block, dtype)]
        results.write_rows(rows, path)
        print(f"{block.name}: done after {time.perf_counter() - start:.0f} s, rows in {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
