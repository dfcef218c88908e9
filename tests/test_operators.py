"""liger_lab.ops.operators: one declaration gives an op's functional operator, its in-place twin, their fakes and the
autograd formula; the public calls reach each operator once."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import OpCalls, randn
from torch._subclasses.fake_tensor import FakeTensorMode

import liger_lab
from liger_lab.op_table import OPS
from liger_lab.ops import cross_entropy, glu, rms_norm


def _backward_args() -> tuple[torch.Tensor, ...]:
    x, weight = randn(3, 5, 32), randn(32)
    return randn(3, 5, 32), x, weight, torch.rand(3, 5) + 0.5, 0.0


def test_the_twin_is_the_same_operator_with_the_output_over_its_argument():
    default, twin = rms_norm.RMS_NORM_BACKWARD.default, rms_norm.RMS_NORM_BACKWARD.in_place
    assert [a.name for a in twin._schema.arguments] == [a.name for a in default._schema.arguments]
    assert [a.alias_info is not None and a.alias_info.is_write for a in twin._schema.arguments] == [True] + [False] * 4
    assert (len(default._schema.returns), len(twin._schema.returns)) == (2, 1)  # (dx, dw), then dw alone
    dy, *rest = _backward_args()
    dx, dw = default(dy, *rest)
    written, version = dy.clone(), dy._version
    assert torch.equal(dy, written) and dy._version == version  # the default wrote nothing of the caller's
    dw_twin = twin(written, *rest)
    torch.testing.assert_close((written, dw_twin), (dx, dw), rtol=0, atol=0)
    assert written._version == version + 1  # bumped: a node that saved dy now refuses to use it


def test_a_twin_writing_two_outputs_returns_nothing():
    """glu_backward_ writes d_gate over gate and d_up over up."""
    assert len(glu.GLU_BACKWARD.in_place._schema.returns) == 0
    dout, gate, up = randn(4, 6), randn(4, 6), randn(4, 6)
    expected = glu.GLU_BACKWARD(dout, gate, up, "silu")
    assert glu.GLU_BACKWARD.in_place(dout, gate, up, "silu") is None
    torch.testing.assert_close((gate, up), expected, rtol=0, atol=0)


@pytest.mark.parametrize("compute_grad", [True, False])
def test_the_fake_is_the_allocation_of_the_real_outputs(compute_grad):
    """Shapes, dtypes and strides of the fake's outputs are those the kernel's buffers have, for either variant."""
    logits, target = randn(2, 3, 50, dtype=torch.float16), torch.randint(0, 50, (2, 3))
    options = (-100, 0.0, "mean", None, 0.0, compute_grad)
    real = cross_entropy.CROSS_ENTROPY(logits, target, *options)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = cross_entropy.CROSS_ENTROPY(mode.from_tensor(logits), mode.from_tensor(target), *options)
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]


def test_each_public_call_reaches_each_of_its_operators_once():
    """No extra dispatch: the forward operator once, the backward operator once, nothing else of liger_lab's."""
    x, weight = randn(4, 32).requires_grad_(), randn(32).requires_grad_()
    with OpCalls() as calls:
        liger_lab.rms_norm(x, weight).sum().backward()
    assert {name: n for name, n in calls.counts.items() if name.startswith("liger_lab::")} == {
        "liger_lab::rms_norm": 1,
        "liger_lab::rms_norm_backward": 1,
    }


def test_create_graph_gives_the_first_order_gradient_and_refuses_the_second():
    """The formula runs under create_graph=True as it does without; only differentiating its result raises."""
    x, weight = randn(4, 32).requires_grad_(), randn(32).requires_grad_()
    upstream = randn(4, 32)
    expected = torch.autograd.grad(liger_lab.rms_norm(x, weight), (x, weight), upstream)
    grads = torch.autograd.grad(liger_lab.rms_norm(x, weight), (x, weight), upstream, create_graph=True)
    torch.testing.assert_close(grads, expected, rtol=0, atol=0)
    assert all(g.requires_grad for g in grads)
    with pytest.raises(RuntimeError, match=r"liger_lab\.rms_norm has no second derivative"):
        grads[0].sum().backward()


def test_the_operator_alone_is_differentiable():
    """The formula is registered on the operator, not only on the public function: a direct call has autograd."""
    x, weight = randn(4, 32).requires_grad_(), randn(32).requires_grad_()
    y, _ = torch.ops.liger_lab.rms_norm(x, weight, 1e-6, 0.0, "llama", False)
    torch.testing.assert_close(
        torch.autograd.grad(y.sum(), x), torch.autograd.grad(liger_lab.rms_norm(x, weight).sum(), x)
    )


@pytest.mark.parametrize("name", list(OPS))
def test_an_eager_call_without_the_dispatcher_gives_what_the_dispatcher_gives(name):
    """Eagerly an Operator skips the dispatcher (operators._eager); under a dispatch mode it goes through the
    registered operators. The same kernels run either way: outputs and gradients are equal bit for bit."""
    spec = OPS[name]
    results = []
    for observed in (False, True):
        torch.manual_seed(0)
        inputs = spec.make_inputs(spec.check_shapes[0], torch.float32)
        leaves = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad]
        with OpCalls() if observed else contextlib.nullcontext() as calls:
            outputs = spec.function(*inputs)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            floating = [o for o in outputs if o.is_floating_point() and o.requires_grad]
            grads = torch.autograd.grad(sum(o.sum() for o in floating), leaves, allow_unused=True)
        results.append([*outputs, *grads])
        if observed:
            assert calls.ran(), "the dispatch mode saw no liger_lab operator"
    for eager, dispatched in zip(*results, strict=True):
        assert (eager is None and dispatched is None) or torch.equal(eager, dispatched)
