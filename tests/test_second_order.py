"""Second derivatives (a gradient penalty, double backward): every op either differentiates its gradient like its
float64 reference or raises an error that names it, never a silent zero.

The norms', RoPE's and GLUs' backward operators have no autograd formula: differentiating their output raises
PyTorch's error naming that operator. The losses make their gradient in the forward, a constant to autograd, so
they refuse a backward with ``create_graph=True`` at once, naming the public op."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from helpers import randn

import liger_lab
from liger_lab import reference, runtime
from liger_lab.op_table import OPS
from liger_lab.workbook.checks import check_close

CASES = [(name, label) for name, spec in OPS.items() for label in ("default", *spec.variants)]
IDS = [f"{name}-{label}" for name, label in CASES]


def _loss(outputs: object) -> torch.Tensor:
    """A fixed, non-uniform weighting of every output element (of the floating outputs: a flag such as the RL head's
    is_top1 has no derivative)."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return sum(
        (out * torch.linspace(-1, 2, out.numel(), dtype=out.dtype, device=out.device).view(out.shape)).sum()
        for out in outputs
        if out.is_floating_point()
    )


def _second_derivative(fn: Callable[..., object], inputs: list[object]) -> list[torch.Tensor] | RuntimeError:
    """d/dx of the penalty sum over x of ||dL/dx||^2, for every input x that requires grad (L: :func:`_loss` of
    ``fn``'s outputs); or the RuntimeError raised on the way. The inputs reach ``fn`` as intermediates, which an
    in-place backward may overwrite."""
    leaves = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad]
    args = [v * 1.0 if isinstance(v, torch.Tensor) and v.requires_grad else v for v in inputs]
    try:
        grads = torch.autograd.grad(_loss(fn(*args)), leaves, create_graph=True)
        # A gradient without a graph is a constant of the inputs: its penalty's derivative is zero, which the
        # comparison with the reference below then checks.
        terms = [g.pow(2).sum() for g in grads if g.requires_grad]
        if not terms:
            return [torch.zeros_like(leaf) for leaf in leaves]
        second = torch.autograd.grad(sum(terms), leaves, allow_unused=True)
    except RuntimeError as error:
        return error
    return [torch.zeros_like(leaf) if s is None else s for leaf, s in zip(leaves, second, strict=True)]


@pytest.mark.parametrize("name,label", CASES, ids=IDS)
def test_second_derivative_matches_the_reference_or_raises_naming_the_op(name, label):
    spec = OPS[name]
    torch.manual_seed(0)
    inputs = spec.make_inputs(spec.check_shapes[0], torch.float32)
    ours = _second_derivative(spec.call(**({} if label == "default" else spec.variants[label])), inputs)
    if isinstance(ours, RuntimeError):
        named = "|".join(map(re.escape, (name, *spec.operators)))
        assert re.search(rf"liger_lab\.({named})\b", str(ours)), str(ours)
        return
    references = [v.detach().double().requires_grad_(v.requires_grad) if torch.is_tensor(v) and v.is_floating_point()
                  else v for v in inputs]  # fmt: skip
    expected = _second_derivative(spec.reference, references)
    assert not isinstance(expected, RuntimeError), expected
    for i, (actual, wanted) in enumerate(zip(ours, expected, strict=True)):
        assert check_close(f"{name} {label}: second derivative {i}", actual, wanted, 1e-4)


def _flce_inputs() -> list[torch.Tensor]:
    target = torch.randint(0, 50, (12,), device=runtime.DEVICE)
    target[::4] = -100
    return [randn(12, 8).requires_grad_(), randn(50, 8, scale=8**-0.5).requires_grad_(), target]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("in_place_backward", [False, True])
def test_the_fused_loss_refuses_create_graph_in_every_mode(reduction, in_place_backward):
    hidden, weight, target = _flce_inputs()
    loss = liger_lab.fused_linear_cross_entropy(
        hidden * 1.0, weight, target, reduction=reduction, in_place_backward=in_place_backward
    )
    with pytest.raises(RuntimeError, match=r"liger_lab\.fused_linear_cross_entropy has no second derivative"):
        loss.sum().backward(create_graph=True)


def test_a_gradient_penalty_is_refused_and_the_first_order_gradient_survives():
    """The penalty ||dL/dh||^2 once moved h.grad by nothing (0.18 off PyTorch's). Now the call that would have
    returned a gradient without a graph raises before touching the saved gradient: the same graph still gives
    the right first-order gradient."""
    hidden, weight, target = _flce_inputs()
    loss = liger_lab.fused_linear_cross_entropy(hidden, weight, target)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, hidden, create_graph=True)
    (grad,) = torch.autograd.grad(loss, hidden)
    h64 = hidden.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(reference.fused_linear_cross_entropy(h64, weight.double(), target), h64)
    assert check_close("fused_linear_cross_entropy: grad hidden after the refusal", grad, expected, 1e-5)
