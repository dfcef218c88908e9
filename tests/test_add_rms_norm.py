"""The residual add fused into RMSNorm: ``add_rms_norm(x, residual, w) -> (rms_norm(x + residual), x + residual)``."""

import pytest
import torch
from helpers import OpCalls, check_op, non_contiguous, randn, row_strided

import liger_lab
from liger_lab import reference, runtime
from liger_lab.nn import AddRMSNorm, RMSNorm
from liger_lab.workbook.checks import relative_l2_error

MODES = [("llama", 0.0), ("gemma", 1.0), ("llama", 1.0)]


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("shape", [(8, 64), (1, 37), (3, 7, 96), (130, 33), (2, 1, 4099)])
@pytest.mark.parametrize("casting_mode,offset", MODES)
def test_matches_float64_fp32(shape, casting_mode, offset):
    x, r, w = randn(*shape), randn(*shape), randn(shape[-1], scale=0.5)
    assert check_op("add_rms_norm", x, r, w, casting_mode=casting_mode, offset=offset)


@pytest.mark.parametrize("casting_mode,offset", MODES)
def test_fp16(casting_mode, offset):
    x, r = randn(33, 257, dtype=torch.float16), randn(33, 257, dtype=torch.float16)
    w = (1 + 0.1 * randn(257)).half()
    assert check_op("add_rms_norm", x, r, w, casting_mode=casting_mode, offset=offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("casting_mode,offset", MODES)
def test_sum_is_the_add_and_y_is_rms_norm_of_it(dtype, casting_mode, offset):
    # Residual an order of magnitude larger than x, as in a deep model: in fp16 the sum loses x's low bits, and the
    # norm must read that rounded sum (the one returned), not the exact one.
    x, r, w = randn(19, 3, 200, dtype=dtype), randn(19, 3, 200, dtype=dtype, scale=30.0), randn(200, dtype=dtype)
    y, s = liger_lab.add_rms_norm(x, r, w, offset=offset, casting_mode=casting_mode)
    assert s.dtype == dtype and s.shape == x.shape and torch.equal(s, x + r)
    expected = liger_lab.rms_norm(x + r, w, offset=offset, casting_mode=casting_mode)
    assert y.dtype == expected.dtype and torch.equal(y, expected)


@pytest.mark.parametrize("casting_mode,offset", MODES[:2])
def test_loss_of_y_alone(casting_mode, offset):
    """No gradient reaches the sum: its read is skipped, and the gradients are the norm's alone."""
    x, r, w = randn(6, 5, 48), randn(6, 5, 48), randn(48)
    dy = randn(6, 5, 48)
    xs, rs, ws = _leaves(x, r, w)
    with OpCalls(keep_args=True) as calls:
        y, _ = liger_lab.add_rms_norm(xs, rs, ws, offset=offset, casting_mode=casting_mode)
        grads = torch.autograd.grad(y, [xs, rs, ws], dy)
    (backward_args,) = [call.args for call in calls.recorded if call.name == "add_rms_norm_backward"]
    assert backward_args[1] is None  # ds
    xd, rd, wd = _leaves(x.double(), r.double(), w.double())
    y_ref, _ = reference.add_rms_norm(xd, rd, wd, offset=offset, casting_mode=casting_mode)
    expected = torch.autograd.grad(y_ref, [xd, rd, wd], dy.double())
    for name, grad, ref in zip(("x", "residual", "weight"), grads, expected, strict=True):
        assert relative_l2_error(grad, ref) < 1e-5, name


def test_loss_of_the_sum_alone():
    x, r, w, ds = randn(4, 32), randn(4, 32), randn(32), randn(4, 32)
    xs, rs, ws = _leaves(x, r, w)
    _, s = liger_lab.add_rms_norm(xs, rs, ws)
    dx, dr, dw = torch.autograd.grad(s, [xs, rs, ws], ds)
    assert torch.equal(dx, ds) and torch.equal(dr, ds) and torch.equal(dw, torch.zeros_like(w))


def test_two_layers_of_a_residual_stream():
    """Each norm's sum is the next one's residual: the gradient along the stream flows through both ops."""
    h, a, b, w1, w2, proj = randn(3, 9, 40), randn(3, 9, 40), randn(3, 9, 40), randn(40), randn(40), randn(40, 40)
    upstream = randn(3, 9, 40)

    def stack(add_rms_norm, h, a, b, w1, w2, proj):
        y1, s1 = add_rms_norm(a, h, w1)
        y2, s2 = add_rms_norm(y1 @ proj + b, s1, w2)
        return (y2 * upstream.to(y2.dtype)).sum() + (s2 * s2).sum()

    ours = _leaves(h, a, b, w1, w2, proj)
    grads = torch.autograd.grad(stack(liger_lab.add_rms_norm, *ours), ours)
    theirs = _leaves(*(t.double() for t in (h, a, b, w1, w2, proj)))
    expected = torch.autograd.grad(stack(reference.add_rms_norm, *theirs), theirs)
    for i, (grad, ref) in enumerate(zip(grads, expected, strict=True)):
        assert relative_l2_error(grad, ref) < 1e-5, i


@pytest.mark.parametrize("layout", [non_contiguous, row_strided, lambda t: t.transpose(0, 1)])
def test_non_contiguous_inputs(layout):
    x, r = layout(randn(24, 48)), layout(randn(24, 48))
    assert not x.is_contiguous() and not r.is_contiguous()
    hidden = x.shape[-1]
    assert check_op("add_rms_norm", x, r, randn(hidden))
    assert check_op("add_rms_norm", randn(*x.shape), r, non_contiguous(randn(hidden)))  # one strided, one dense


def test_mixed_precision_promotes_like_rms_norm():
    x, r, w = randn(4, 64, dtype=torch.float16), randn(4, 64, dtype=torch.float16), randn(64)
    y, s = liger_lab.add_rms_norm(x, r, w)
    assert (y.dtype, s.dtype) == (torch.float32, torch.float16)
    assert torch.equal(y, liger_lab.rms_norm(x + r, w))
    y, s = liger_lab.add_rms_norm(x, r, w.half(), casting_mode="gemma")
    assert (y.dtype, s.dtype) == (torch.float16, torch.float16)
    assert check_op("add_rms_norm", x, r, w, tol=5e-3)  # fp16 inputs: every result carries their rounding


def test_inputs_and_upstream_gradients_are_never_modified():
    x, r, w, dy, ds = randn(10, 3, 72), randn(10, 3, 72), randn(72), randn(10, 3, 72), randn(10, 3, 72)
    saved = [t.clone() for t in (x, r, w, dy, ds)]
    xs, rs, ws = (t.requires_grad_() for t in (x * 1.0, r * 1.0, w))  # intermediates, as in a model
    y, s = liger_lab.add_rms_norm(xs, rs, ws)
    torch.autograd.grad((y, s), [xs, rs, ws], (dy, ds))
    for before, after in zip(saved, (x, r, w, dy, ds), strict=True):
        assert torch.equal(before, after)


def test_leaf_gradients_are_separate_tensors():
    x, r, w = _leaves(randn(5, 16), randn(5, 16), randn(16))
    y, s = liger_lab.add_rms_norm(x, r, w)
    (y.sum() + s.sum()).backward()
    assert torch.equal(x.grad, r.grad) and x.grad.data_ptr() != r.grad.data_ptr()


def test_zero_rows_and_zero_sum():
    x, r, w = _leaves(randn(0, 3, 16), randn(0, 3, 16), randn(16))
    y, s = liger_lab.add_rms_norm(x, r, w)
    assert y.shape == s.shape == (0, 3, 16)
    dx, dr, dw = torch.autograd.grad((y.sum() + s.sum()), [x, r, w])
    assert dx.shape == dr.shape == x.shape and torch.equal(dw, torch.zeros_like(w))
    x = randn(3, 16).requires_grad_()
    y, s = liger_lab.add_rms_norm(x, -x.detach(), randn(16))  # s == 0: rstd is 1 / sqrt(eps), not inf
    (y.sum() + s.sum()).backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()


def test_compiled_loss_of_y_alone_matches_eager():
    def loss(x, r, w):
        return liger_lab.add_rms_norm(x * 1.0, r * 1.0, w)[0].pow(2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    inputs = _leaves(randn(3, 5, 24), randn(3, 5, 24), randn(24))
    for ours, expected in zip(
        torch.autograd.grad(compiled(*inputs), inputs), torch.autograd.grad(loss(*inputs), inputs), strict=True
    ):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_module_matches_an_add_then_rms_norm():
    norm = RMSNorm(96, eps=1e-5, device=runtime.DEVICE)
    fused = AddRMSNorm(96, eps=1e-5, device=runtime.DEVICE)
    with torch.no_grad():
        norm.weight.normal_()
    fused.load_state_dict(norm.state_dict())
    assert set(fused.state_dict()) == {"weight"}
    x, r = randn(2, 5, 96), randn(2, 5, 96)
    y, s = fused(x, r)
    assert torch.equal(s, x + r) and torch.equal(y, norm(x + r))
    gemma = AddRMSNorm(32, offset=1.0, casting_mode="gemma", device=runtime.DEVICE)
    assert torch.equal(gemma.weight, torch.zeros(32, device=runtime.DEVICE))
    assert not isinstance(fused, RMSNorm)


def test_module_refuses_an_in_place_backward():
    # The sum's gradient flows on along the residual stream, so dx cannot overwrite dy.
    with pytest.raises(ValueError, match="AddRMSNorm has no in-place backward"):
        AddRMSNorm(8, in_place_backward=True)
    assert RMSNorm(8, in_place_backward=True).in_place_backward


@pytest.mark.parametrize(
    "x,r,w,kwargs,message",
    [
        (lambda: randn(4, 64), lambda: randn(4, 63), lambda: randn(64), {}, "one shape"),
        (lambda: randn(4, 64), lambda: randn(2, 4, 64), lambda: randn(64), {}, "one shape"),
        (lambda: randn(4, 64), lambda: randn(4, 64, dtype=torch.float16), lambda: randn(64), {}, "one dtype"),
        (lambda: randn(4, 64), lambda: randn(4, 64), lambda: randn(63), {}, "weight has shape"),
        (lambda: randn(4, 64), lambda: randn(4, 64).double(), lambda: randn(64), {}, "torch.float64"),
        (lambda: randn(4, 64), lambda: torch.ones(4, 64, dtype=torch.int64), lambda: randn(64), {}, "residual"),
        (lambda: randn(4, 64), lambda: randn(4, 64), lambda: randn(64), {"casting_mode": "none"}, "casting_mode"),
        (lambda: randn(4, 64), lambda: randn(4, 64), lambda: randn(64), {"eps": -1.0}, "eps"),
        (lambda: randn(2, 100_000), lambda: randn(2, 100_000), lambda: randn(100_000), {}, "at most"),
    ],
)
def test_bad_input_is_a_value_error(x, r, w, kwargs, message):
    x, r, w = x(), r(), w()
    saved = [t.clone() for t in (x, r, w)]
    with pytest.raises(ValueError, match=message):
        liger_lab.add_rms_norm(x, r, w, **kwargs)
    for before, after in zip(saved, (x, r, w), strict=True):
        assert torch.equal(before, after)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(4096, 4096), (3, 77, 2048), (1, 128), (513, 5120)])
@pytest.mark.parametrize("casting_mode,offset", MODES[:2])
def test_bf16_on_gpu(shape, casting_mode, offset):
    x, r = randn(*shape, dtype=torch.bfloat16), randn(*shape, dtype=torch.bfloat16, scale=4.0)
    w = (1 + 0.1 * randn(shape[-1])).to(torch.bfloat16)
    assert check_op("add_rms_norm", x, r, w, casting_mode=casting_mode, offset=offset)
    y, s = liger_lab.add_rms_norm(x, r, w, casting_mode=casting_mode, offset=offset)
    assert torch.equal(s, x + r)
    assert torch.equal(y, liger_lab.rms_norm(s, w, casting_mode=casting_mode, offset=offset))
