"""Training with the patched kernels follows the same loss curve as training without them.

Two copies of one tiny model, one patched with liger_lab.patch, take the same AdamW steps on the same
batches. In fp32 the curves agree to rounding; bf16 (GPU only) is looser because each kernel rounds at
different points than PyTorch does.
"""

import contextlib
import copy

import pytest
import torch
from test_patching import tiny_model

import liger_lab
from liger_lab import hf, runtime

STEPS = 20


def train(model, batches, *, autocast: bool = False) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for input_ids in batches:
        context = torch.autocast(runtime.DEVICE.type, torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def loss_curves(model_type: str, *, dtype: torch.dtype = torch.float32, autocast: bool = False, steps: int = STEPS):
    reference = tiny_model(model_type).to(dtype)
    patched = liger_lab.patch(copy.deepcopy(reference))
    # Four fixed sequences, cycled two at a time: a task the model can learn within a few steps.
    pool = torch.randint(0, reference.config.get_text_config().vocab_size, (4, 8), device=runtime.DEVICE)
    batches = [pool[2 * (step % 2) : 2 * (step % 2) + 2] for step in range(steps)]
    return train(patched, batches, autocast=autocast), train(reference, batches, autocast=autocast)


def assert_curves_match(ours: list[float], theirs: list[float], rtol: float, atol: float) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= rtol * abs(b) + atol, f"step {step}: patched loss {a:.5f}, transformers {b:.5f}"
    assert_learned(theirs)


def assert_learned(losses: list[float]) -> None:
    assert losses[-1] < 0.5 * losses[0], "the reference did not learn: the comparison would prove nothing"


@pytest.mark.parametrize("model_type", runtime.pick(cpu=["llama"], gpu=["llama", "qwen3", "gemma2", "phi3"]))
def test_fp32_loss_curves_match(model_type):
    ours, theirs = loss_curves(model_type)
    assert_curves_match(ours, theirs, rtol=1e-3, atol=1e-5)


# Families whose bf16 curves cross a step-wise tolerance on some seeds and not others though no expert of theirs is
# fused: GPT-OSS and Llama 4 route tokens too; Qwen3.5's linear-attention recurrence amplifies a rounding difference
# as a flipped expert choice does. On the H200 (2026-12-01, 3 seeds x 2 modes each) every patched bf16 curve stayed
# within the bound below of the fp32 curve, at 0.46x to 3.3x transformers' own gap (within 2x + 0.01 in all 18).
# DeepSeek-V4, EXAONE 4, Nemotron and the multimodal Qwen3.5 crossed the step-wise bound on the H200 (2026-12-03,
# ff3b723, one seed, benchmarks/results/h200-cuda-tests-ff3b723.txt) while tracking the fp32 curve, in bf16 through
# Triton's interpreter on CPU (2 seeds x 2 modes each, benchmarks/results/cpu-bf16-convergence-ff3b723.json), at
# 0.37x to 2.25x transformers' own gap: rounding sensitivity of the same kind, not a wrong gradient.
STEPWISE_SEED_DEPENDENT = {"gpt_oss", "llama4_text", "qwen3_5_text", "qwen3_5", "deepseek_v4", "exaone4", "nemotron"}


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", sorted(hf.FAMILIES))
@pytest.mark.parametrize("mode", ["bf16_weights", "autocast"])
def test_bf16_loss_curves_match(model_type, mode):
    dtype = torch.bfloat16 if mode == "bf16_weights" else torch.float32
    if hf.FAMILIES[model_type].experts or model_type in STEPWISE_SEED_DEPENDENT:
        assert_moe_tracks_fp32_as_well(model_type, dtype=dtype, autocast=mode == "autocast")
        return
    ours, theirs = loss_curves(model_type, dtype=dtype, autocast=mode == "autocast", steps=50)
    # atol: once the batches are memorised the loss is small and its relative error meaningless.
    assert_curves_match(ours, theirs, rtol=3e-2, atol=2e-2)


def assert_moe_tracks_fp32_as_well(model_type: str, *, dtype: torch.dtype, autocast: bool) -> None:
    """A mixture of experts sends each token to its top-k experts, so a rounding difference that flips one token's
    choice moves that step's loss by several percent, and later steps pull it back: two bf16 curves, each
    rounding validly, cross a step-wise tolerance on some seeds and not others (on the H200, over five seeds of
    both families and modes, 10 of 20 runs had at least one step off). What stays put is how far each bf16 curve
    runs from the exact one, the fp32 training of the same model on the same batches: there the patched model
    measured 0.17x to 2.4x transformers' mean gap (0.82x over all 20 runs;
    benchmarks/results/h200-moe-convergence-seeds.json). A wrong gradient would drift by tenths."""
    torch.manual_seed(0)  # the same model and batches for both calls
    ours, theirs = loss_curves(model_type, dtype=dtype, autocast=autocast, steps=50)
    torch.manual_seed(0)
    exact = loss_curves(model_type, steps=50)[1]  # transformers in fp32

    def mean_gap(curve: list[float]) -> float:
        return sum(abs(a - b) for a, b in zip(curve, exact, strict=True)) / len(exact)

    assert mean_gap(ours) <= 2 * mean_gap(theirs) + 1e-2, (mean_gap(ours), mean_gap(theirs))
    assert_learned(theirs)
