"""The shared chunk loop of the fused linear losses, with cross-entropy as its per-chunk loss."""

import pytest
import torch

from liger_lab import runtime
from liger_lab.ops.chunked import ChunkGrads, chunked_linear_loss
from liger_lab.ops.cross_entropy import LossOptions, cross_entropy_rows

OPTIONS = LossOptions(ignore_index=-100, label_smoothing=0.0, reduction="mean", softcap=None, z_loss_scale=0.0)


@pytest.mark.parametrize(
    ("n_rows", "chunk", "with_bias"), [(37, 8, False), (37, 64, True), (1, 1, False), (0, 4, True)]
)
def test_chunked_cross_entropy_matches_float64(n_rows, chunk, with_bias):
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
    grad_h, grad_w, grad_b = chunked_linear_loss(
        hidden.to(**as_fp32), weight.to(**as_fp32), cross_entropy_step, chunk=chunk,
        grads=ChunkGrads(hidden=True, weight=True, bias=with_bias, weight_grad_dtype=torch.float32),
        bias=None if bias is None else bias.to(**as_fp32), grad_scale=1.0 / kept,
    )  # fmt: skip

    leaves = [t.requires_grad_() for t in (hidden, weight, bias) if t is not None]
    logits = hidden @ weight.t() + (0 if bias is None else bias)
    expected = torch.nn.functional.cross_entropy(logits, target, reduction="sum") / kept
    expected_grads = torch.autograd.grad(expected, leaves) if n_rows else [torch.zeros_like(t) for t in leaves]
    assert torch.allclose(losses.sum().double().cpu() / kept, expected, atol=1e-5)
    for ours, theirs in zip((grad_h, grad_w, grad_b), expected_grads, strict=False):
        assert torch.allclose(ours.double().cpu(), theirs, atol=1e-5)


def test_without_grads_only_the_losses_are_computed():
    hidden, weight = torch.randn(5, 4, device=runtime.DEVICE), torch.randn(7, 4, device=runtime.DEVICE)
    seen = []
    assert chunked_linear_loss(hidden, weight, lambda z, rows, write: seen.append((rows, write)), chunk=2) == (
        None,
        None,
        None,
    )
    assert seen == [(slice(0, 2), False), (slice(2, 4), False), (slice(4, 5), False)]
    with pytest.raises(ValueError, match="chunk"):
        chunked_linear_loss(hidden, weight, lambda z, rows, write: None, chunk=0)
