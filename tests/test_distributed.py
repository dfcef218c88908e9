"""Patched models under PyTorch's distributed engines: DDP and FSDP2, two processes: gloo on CPU, NCCL on two GPUs.

Each process builds the same tiny Llama from the same seed, patches it, and trains one step on its half of a
batch under DDP or ``fully_shard``; the loss (averaged over the processes) and every gradient (gathered in
full) must equal those of the same patched model stepping on the whole batch in one process. The fused loss
must run in every case, the ``lm_head`` being a unit of its own included (FSDP2 then swaps its class and
shards its weight), and under ``torch.compile``; no fallback to materialised logits may happen. The processes
are those of ``liger_lab.distributed.launch``, which chapter 12 runs too. On two GPUs the same cases run on NCCL,
and a small model trains 20 steps under FSDP2 with bf16 parameters: its loss curve must follow one GPU's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

import liger_lab  # noqa: E402
from liger_lab import distributed, hf, runtime  # noqa: E402

on_cpu = pytest.mark.skipif(not runtime.INTERPRET, reason="the gloo tests run on CPU; GPUs use NCCL")
on_two_gpus = pytest.mark.skipif(
    runtime.INTERPRET or torch.cuda.device_count() < 2, reason="needs two GPUs, one per process (NCCL)"
)

CASES = distributed.CASES
CURVE_STEPS = 20


@pytest.fixture(scope="module")
def report():
    return distributed.launch(list(CASES))


@pytest.fixture(scope="module")
def gpu_report():
    return distributed.launch(list(CASES), curve_steps=CURVE_STEPS)


def check_case(result: dict, case: str) -> None:
    """``CASES[case]``: the loss and every gradient of the single-process step; the fused loss ran, no fallback."""
    mixed = case == "fsdp2_mixed_precision"  # bf16 parameters against the fp32 single-process step
    loss_tol, grad_tol = (2e-2, 5e-2) if mixed else (1e-5, 1e-4)
    loss, expected_loss = result["loss"].item(), result["expected_loss"].item()
    summary = {key: result[key] for key in ("worst_grad", "fused_calls", "fallbacks")}
    assert abs(loss - expected_loss) <= loss_tol * abs(expected_loss), (loss, expected_loss, summary)
    assert result["worst_grad"][1] <= grad_tol, summary
    assert result["fused_calls"] == 1 and not result["fallbacks"], summary


@on_cpu
@pytest.mark.parametrize("case", list(CASES))
def test_patched_model_trains_like_one_process(report, case):
    check_case(report["cases"][case], case)


@pytest.mark.cuda
@on_two_gpus
@pytest.mark.parametrize("case", list(CASES))
def test_patched_model_trains_like_one_gpu_on_two_gpus(gpu_report, case):
    check_case(gpu_report["cases"][case], case)


@pytest.mark.cuda
@on_two_gpus
def test_fsdp2_loss_curve_follows_one_gpu(gpu_report):
    """20 steps of a patched model with bf16 parameters: FSDP2 on two GPUs against one GPU, equal within bf16 noise
    at every step, and the loss falls (a flat curve would prove nothing)."""
    one, sharded = gpu_report["curves"].values()
    assert len(one) == len(sharded) == CURVE_STEPS
    for step, (ours, theirs) in enumerate(zip(sharded, one, strict=True)):
        assert abs(ours - theirs) <= 3e-2 * abs(theirs) + 2e-2, f"step {step}: FSDP2 {ours:.4f}, one GPU {theirs:.4f}"
    assert one[-1] < one[0] - 2, f"the model did not learn: {one[0]:.3f} -> {one[-1]:.3f}"


@on_cpu
def test_a_head_the_fused_loss_cannot_take_is_reported():
    """A fallback to materialised logits warns, once per model class and reason, with the reason."""
    from liger_lab.hf import loss as hf_loss

    model = distributed.tiny_llama()
    model.lm_head = torch.nn.Sequential(model.lm_head)  # e.g. an adapter around the head
    input_ids, labels = distributed.llama_batch()
    hf_loss._REPORTED_FALLBACKS.clear()
    with pytest.warns(UserWarning, match="materialises the logits.*lm_head is a Sequential"):
        model(input_ids=input_ids, labels=labels).loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=input_ids, labels=labels)  # reported already: no second warning
    assert not [w for w in caught if "materialises the logits" in str(w.message)]


def _fused_head_loss(head, hidden, target):
    def loss_of(h):
        return liger_lab.fused_linear_cross_entropy(h, head.weight, target, head.bias)

    return hf.loss.as_forward_of(head, loss_of, hidden)


def _bias_dropped(head, hidden, target):
    def loss_of(h):
        return liger_lab.fused_linear_cross_entropy(h, head.weight, target)

    return hf.loss.as_forward_of(head, loss_of, hidden)


def _unfused(head, hidden, target):
    return torch.nn.functional.cross_entropy(head(hidden), target)


def _by_hand(head, hidden, target):
    return torch.nn.functional.cross_entropy(hidden @ head.weight.T + head.bias, target)


@pytest.mark.parametrize(
    "fn, problem",
    [
        (_fused_head_loss, None),
        (_bias_dropped, "lm_head.bias got no gradient"),
        (_unfused, "lm_head returned logits of shape"),
        (_by_hand, "liger_lab.fused_linear_cross_entropy never ran"),
    ],
)
def test_a_head_loss_that_is_not_the_fused_one_is_named_in_one_line(fn, problem):
    # Exercise 12.3's wrong solutions: each gets its line here, before any process starts, instead of a traceback.
    found = distributed.head_loss_problem(fn)
    if problem is None:
        assert found is None
    else:
        assert found.startswith(problem) and "\n" not in found
        assert distributed.launch(head_losses={"12.3": fn}) == {
            "launch": "not launched",
            "cases": {},
            "head_losses": {"12.3": {"error": found}},
        }
    assert liger_lab.fused_linear_cross_entropy is liger_lab.ops.fused_linear_cross_entropy.fused_linear_cross_entropy
