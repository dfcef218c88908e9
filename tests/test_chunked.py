"""The skeleton every fused linear loss runs on: the chunk loop (with cross-entropy as its per-chunk loss), the
chunk rule, the validation and gradients every public function shares, and the backward that finishes them."""

import pytest
import torch

from liger_lab import runtime
from liger_lab.formulas import LossOptions
from liger_lab.ops import chunked, operators
from liger_lab.ops.chunked import ChunkGrads, Grads, Head, chunked_linear_loss, finish_grads
from liger_lab.ops.cross_entropy import cross_entropy_rows

OPTIONS = LossOptions(ignore_index=-100, label_smoothing=0.0, reduction="mean", softcap=None, z_loss_scale=0.0)


def _cross_entropy_case(n_rows, chunk, with_bias, *, grad_h_over_hidden=False):
    """The loop's losses and gradients for mean cross-entropy on fp32 copies of float64 inputs, and autograd's."""
    generator = torch.Generator().manual_seed(n_rows + chunk)
    hidden = torch.randn(n_rows, 16, generator=generator, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=generator, dtype=torch.float64)
    bias = torch.randn(50, generator=generator, dtype=torch.float64) if with_bias else None
    target = torch.randint(0, 50, (n_rows,), generator=generator)
    target[::3] = OPTIONS.ignore_index
    kept = max(int((target != OPTIONS.ignore_index).sum()), 1)
    losses = torch.empty(n_rows, dtype=torch.float32, device=runtime.DEVICE)
    device_target = target.to(runtime.DEVICE)

    def cross_entropy_step(z, rows, write_grad):
        cross_entropy_rows(z, device_target[rows], losses[rows], OPTIONS, grad=z if write_grad else None)

    as_fp32 = {"dtype": torch.float32, "device": runtime.DEVICE}
    rows = hidden.to(**as_fp32)
    # Garbage in every buffer: the loop must overwrite dh and dW and zero db itself.
    grads = ChunkGrads(
        hidden=rows if grad_h_over_hidden else torch.full_like(rows, float("nan")),
        weight=torch.full((50, 16), float("nan"), **as_fp32),
        bias=torch.full((50,), float("nan"), **as_fp32) if with_bias else None,
    )
    chunked_linear_loss(
        rows, weight.to(**as_fp32), cross_entropy_step, chunk=chunk, grads=grads,
        bias=None if bias is None else bias.to(**as_fp32), grad_scale=1.0 / kept,
    )  # fmt: skip

    leaves = [t.requires_grad_() for t in (hidden, weight, bias) if t is not None]
    logits = hidden @ weight.t() + (0 if bias is None else bias)
    expected = torch.nn.functional.cross_entropy(logits, target, reduction="sum") / kept
    expected_grads = torch.autograd.grad(expected, leaves) if n_rows else [torch.zeros_like(t) for t in leaves]
    assert torch.allclose(losses.sum().double().cpu() / kept, expected, atol=1e-5)
    return [g for g in (grads.hidden, grads.weight, grads.bias) if g is not None], expected_grads


@pytest.mark.parametrize(
    ("n_rows", "chunk", "with_bias"), [(37, 8, False), (37, 64, True), (1, 1, False), (0, 4, True)]
)
def test_chunked_cross_entropy_matches_float64(n_rows, chunk, with_bias):
    ours, expected = _cross_entropy_case(n_rows, chunk, with_bias)
    for got, theirs in zip(ours, expected, strict=True):
        assert torch.allclose(got.double().cpu(), theirs, atol=1e-5)


def test_the_hidden_gradient_may_go_over_the_hidden_states():
    """dh written over the loop's input, each chunk's rows after that chunk's dW product has read them."""
    ours, expected = _cross_entropy_case(37, 8, False, grad_h_over_hidden=True)
    for got, theirs in zip(ours, expected, strict=True):
        assert torch.allclose(got.double().cpu(), theirs, atol=1e-5)


def test_without_grads_only_the_losses_are_computed():
    hidden, weight = torch.randn(5, 4, device=runtime.DEVICE), torch.randn(7, 4, device=runtime.DEVICE)
    seen = []
    chunked_linear_loss(hidden, weight, lambda z, rows, write: seen.append((rows, write)), chunk=2)
    assert seen == [(slice(0, 2), False), (slice(2, 4), False), (slice(4, 5), False)]
    with pytest.raises(ValueError, match="chunk"):
        chunked_linear_loss(hidden, weight, lambda z, rows, write: None, chunk=0)


@pytest.mark.parametrize(
    ("n_rows", "row_bytes", "budget", "other", "align", "expected"),
    [
        (8192, 256512, 256 * 2**20, 64 * 2**20, 64, 768),  # the fused cross-entropy's design shape, dh beside it
        (8192, 256512, 256 * 2**20, 0, 64, 1024),  # dh over hidden: the whole budget for logits
        (8192, 256512, 2**20, 0, 64, 64),  # never below one aligned chunk
        (100, 256512, 256 * 2**20, 0, 64, 100),  # never above the rows there are
        (3, 10, 5, 0, 1, 1),  # units (align 1): at least one, even over the budget
        (0, 10, 100, 0, 1, 1),  # no rows: still a valid chunk
    ],
)
def test_one_chunk_rule(n_rows, row_bytes, budget, other, align, expected):
    assert chunked.rows_per_chunk(n_rows, row_bytes, budget, other_bytes=other, align=align) == expected


def test_needed_grads_follow_grad_mode_and_requires_grad():
    hidden = torch.zeros(2, 3, requires_grad=True)
    weight, bias = torch.zeros(4, 3), torch.zeros(4, requires_grad=True)
    assert chunked.needed_grads(hidden, weight, bias) == [True, False, True]
    assert chunked.needed_grads(hidden, weight) == [True, False, False]
    with torch.no_grad():
        assert chunked.needed_grads(hidden, weight, bias) == [False, False, False]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda h, w: (h, w[:, :2], None, ("teacher_hidden", "teacher_weight")), r"teacher_weight has shape \(5, 2\)"),
        (lambda h, w: (h, w.half(), None, ("hidden", "weight")), "weight has dtype torch.float16: expected one dtype"),
        (lambda h, w: (h[0, 0], w, None, ("hidden", "weight")), "at least one dimension"),
        (lambda h, w: (h, w, torch.zeros(5, 3, device=h.device), ("hidden", "weight")), "bias has shape"),
    ],
)
def test_one_head_check_names_the_head(make, message):
    hidden, weight = torch.zeros(4, 3, device=runtime.DEVICE), torch.zeros(5, 3, device=runtime.DEVICE)
    checked, head_weight, bias, names = make(hidden, weight)
    with pytest.raises(ValueError, match=message):
        chunked.check_head(checked, head_weight, bias, names=names)
    with pytest.raises(ValueError, match=r"hidden has shape \(4, 3\): expected \(B, T, H\)"):
        chunked.check_head(hidden, weight, layout="(B, T, H)")


def test_finish_scales_what_the_forward_made_and_rounds_the_fp32_accumulator_once():
    head = Head(torch.Size([2, 3, 4]), torch.float16, (True, True, True))
    grads = Grads(
        torch.ones(6, 4, device=runtime.DEVICE), torch.full((5, 4), 1 / 3, device=runtime.DEVICE),
        torch.ones(5, device=runtime.DEVICE), owed=torch.tensor(0.5, device=runtime.DEVICE),
    )  # fmt: skip
    grad_h, grad_w, grad_b = finish_grads(grads, head, torch.tensor(3.0, device=runtime.DEVICE))
    assert grad_h.shape == head.hidden_shape and torch.all(grad_h == 1.5)
    assert grad_w.dtype == torch.float16 and torch.allclose(grad_w.float(), torch.full((5, 4), 0.5))
    assert grad_b.dtype == torch.float16 and torch.all(grad_b == 1.5)
    assert grads.hidden.data_ptr() == grad_h.data_ptr() and grad_h is not grads.hidden  # scaled in place, detached


def test_finish_without_upstream_gradient_only_shapes_and_casts():
    """A backward operator made the gradients from the upstream gradients already (the recomputing losses)."""
    head = Head(torch.Size([6, 4]), torch.float16, (False, True, False))
    grads = Grads(torch.empty(0), torch.full((5, 4), 2.0), torch.empty(0))
    grad_h, grad_w, grad_b = finish_grads(grads, head, None)
    assert grad_h is None and grad_b is None
    assert grad_w.dtype == torch.float16 and torch.all(grad_w == 2.0)


def test_grad_outputs_are_empty_unless_asked_for():
    hidden = torch.zeros(2, 3, 4)
    weight = torch.zeros(5, 4, dtype=torch.float16)
    outputs = chunked.grad_outputs()

    def launcher(hidden, weight, accumulation, needs, grad_hidden, grad_weight, grad_bias, owed): ...

    made = operators.allocate_outputs(launcher, outputs, (hidden, weight, "fp32", [True, True, False]))
    asked = dict(zip(outputs, made, strict=True))
    assert asked["grad_hidden"].shape == (6, 4) and asked["grad_bias"].numel() == 0
    assert asked["grad_weight"].shape == (5, 4) and asked["grad_weight"].dtype == torch.float32
    assert asked["owed"].shape == () and "owed" not in chunked.grad_outputs(owed=False)
