import pytest
import torch
from helpers import check_op, non_contiguous, randn, row_strided

import liger_lab
from liger_lab import reference, runtime
from liger_lab.nn import LayerNorm
from liger_lab.workbook.checks import check_against_reference, check_close


def _params(n, dtype=torch.float32):
    return randn(n, dtype=dtype), randn(n, dtype=dtype)


@pytest.mark.parametrize("shape", [(8, 64), (1, 37), (5, 1000), (3, 7, 96), (130, 33), (2, 1, 4099)])
def test_matches_float64_fp32(shape):
    assert check_op("layer_norm", randn(*shape), *_params(shape[-1]))


@pytest.mark.parametrize("shape", [(33, 257), (2, 5, 96)])
def test_fp16(shape):
    assert check_op("layer_norm", randn(*shape, dtype=torch.float16), *_params(shape[-1], torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_offset_scales_by_one_plus_the_weight(dtype):
    # Nemotron's LayerNorm1P: the stored weight sits near 0 and the row is scaled by 1 + w.
    x, w, b = randn(33, 96, dtype=dtype), randn(96, dtype=dtype, scale=0.1), randn(96, dtype=dtype)
    assert check_op("layer_norm", x, w, b, offset=1.0)


def _check_layouts(x, w, b, x_layout, param_layout=lambda p: p):
    """Like _check, but the kernel sees the inputs in the given memory layouts (made inside the function,
    because check_against_reference clones its inputs and a clone of a strided view is contiguous)."""
    seen = []

    def ours(x, w, b):
        x, w, b = x_layout(x), param_layout(w), param_layout(b)
        seen.append((x.is_contiguous(), w.is_contiguous(), b.is_contiguous()))
        return liger_lab.layer_norm(x, w, b)

    def theirs(x, w, b):
        return reference.layer_norm(x_layout(x), param_layout(w), param_layout(b))

    ok = check_against_reference("layer_norm", ours, theirs, [x, w, b], input_names=["x", "weight", "bias"])
    return ok, seen


@pytest.mark.parametrize(
    "layout",
    [non_contiguous, row_strided, lambda x: x.transpose(0, 1), lambda x: x.transpose(0, 1)[:, 3:17]],
    ids=["every-other-column", "padded-rows", "transposed", "transposed-slice"],
)
def test_non_contiguous_input(layout):
    x = randn(24, 48)
    ok, seen = _check_layouts(x, *_params(layout(x).shape[-1]), layout)
    assert ok and seen == [(False, True, True)]


def test_transposed_heads_keep_their_memory_layout():
    # Rows dense in another order (a (B, T, H, D) -> (B, H, T, D) view) are normalised where they lie, without a
    # copy, and the output has their layout (PyTorch's layer_norm copies them and returns a contiguous output).
    x = randn(2, 5, 3, 16).transpose(1, 2)
    assert liger_lab.layer_norm(x, *_params(16)).stride() == x.stride()
    ok, seen = _check_layouts(randn(2, 5, 3, 16), *_params(16), lambda x: x.transpose(1, 2))
    assert ok and seen == [(False, True, True)]


def test_non_contiguous_parameters():
    ok, seen = _check_layouts(randn(6, 80), *_params(80), lambda x: x, non_contiguous)
    assert ok and seen == [(True, False, False)]


def test_broadcast_upstream_gradient():
    # y.sum(0) hands the backward an expanded gradient: unit stride along the row, row stride 0.
    x, (w, b), upstream = randn(7, 3, 40), _params(40), randn(40)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    grads = torch.autograd.grad(liger_lab.layer_norm(*leaves).sum((0, 1)), leaves, upstream)
    leaves64 = [t.double().requires_grad_() for t in (x, w, b)]
    expected = torch.autograd.grad(reference.layer_norm(*leaves64).sum((0, 1)), leaves64, upstream.double())
    for name, grad, ref in zip(["x", "weight", "bias"], grads, expected, strict=True):
        assert check_close(f"layer_norm broadcast dy: grad {name}", grad, ref)


def test_large_mean_is_centred_before_squaring():
    # mean(x**2) - mean(x)**2 in fp32 loses most digits of a variance of 1 under a mean of 300 (errors of
    # several percent); centring first keeps the error near fp32 rounding of the mean.
    x = 300 + randn(16, 256)
    assert check_op("layer_norm", x, *_params(256), tol=1e-4)


def test_constant_rows_normalise_to_the_bias():
    x = torch.full((4, 96), 0.75, device=runtime.DEVICE, requires_grad=True)
    w, b = _params(96)
    y = liger_lab.layer_norm(x, w, b)
    torch.testing.assert_close(y, b.expand(4, 96), rtol=0, atol=0)
    y.backward(randn(4, 96))
    assert torch.isfinite(x.grad).all()
    assert check_op("layer_norm", x, w, b)


def test_hidden_size_one():
    # Each row is its own mean: xhat == 0, so y == bias and only the bias gets a gradient. (The float64
    # reference is rounding noise around 0 here, so a relative error against it means nothing.)
    eps = 1e-5
    x, upstream = randn(5, 1).requires_grad_(), randn(5, 1)
    w, b = (p.requires_grad_() for p in _params(1))
    y = liger_lab.layer_norm(x, w, b, eps)
    y.backward(upstream)
    torch.testing.assert_close(y, b.expand(5, 1), rtol=0, atol=0)
    assert torch.all(w.grad == 0)
    torch.testing.assert_close(b.grad, upstream.sum(0))
    # dx = r * (g - mean(g)) is 0 for one element, but a GPU contracts g - mean(g) into a fused multiply-add of
    # dy * w, which leaves the rounding error of g (at most half an ulp) times r = 1 / sqrt(eps).
    g = (upstream * w).detach()
    assert torch.all(x.grad.abs() <= g.abs() * 2.0**-23 / eps**0.5)


def test_eps_is_applied():
    # A tiny variance makes eps dominate: a kernel that drops or misplaces eps fails here.
    x = 1e-3 * randn(8, 64)
    assert check_op("layer_norm", x, *_params(64), eps=1e-4)


def test_empty_inputs():
    for shape in [(0, 16), (4, 0), (2, 0, 5)]:
        x = randn(*shape).requires_grad_()
        w, b = (p.requires_grad_() for p in _params(shape[-1]))
        y = liger_lab.layer_norm(x, w, b)
        assert y.shape == shape
        y.sum().backward()
        assert x.grad.shape == shape
        assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_module_is_a_drop_in_for_torch_layer_norm():
    theirs = torch.nn.LayerNorm(96, eps=1e-6, device=runtime.DEVICE)
    ours = LayerNorm(96, eps=1e-6, device=runtime.DEVICE)
    assert ours.normalized_shape == theirs.normalized_shape == (96,)
    assert ours.eps == theirs.eps and ours.elementwise_affine == theirs.elementwise_affine
    assert repr(ours) == repr(theirs)
    assert set(ours.state_dict()) == set(theirs.state_dict()) == {"weight", "bias"}
    # Same initial parameters, then trained-looking ones loaded both ways.
    torch.testing.assert_close(ours.state_dict(), theirs.state_dict())
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())

    x = randn(2, 5, 96)
    upstream = randn(2, 5, 96)
    results = []
    for module in (ours, theirs):
        xi = x.clone().requires_grad_()
        module.zero_grad()
        y = module(xi)
        y.backward(upstream)
        results.append((y, xi.grad, module.weight.grad, module.bias.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_module_accepts_a_one_element_shape_and_dtype():
    norm = LayerNorm([32], device=runtime.DEVICE, dtype=torch.float16)
    assert norm.normalized_shape == (32,) and norm.weight.dtype == torch.float16
    assert norm(randn(3, 32, dtype=torch.float16)).dtype == torch.float16


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"normalized_shape": (4, 8)}, "one dimension"),
        ({"normalized_shape": 8, "elementwise_affine": False}, "elementwise_affine=True"),
        ({"normalized_shape": 8, "bias": False}, "bias=True"),
    ],
)
def test_module_rejects_what_the_kernel_does_not_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerNorm(**kwargs)


@pytest.mark.parametrize(
    "x,w,b,kwargs,message",
    [
        (lambda: randn(4, 64), lambda: randn(63), lambda: randn(64), {}, "weight has shape"),
        (lambda: randn(4, 64), lambda: randn(64), lambda: randn(65), {}, "bias has shape"),
        (lambda: randn(4, 64), lambda: randn(64), lambda: randn(1, 64), {}, "bias has shape"),
        (lambda: randn(4, 64), lambda: randn(4, 64), lambda: randn(64), {}, "weight has shape"),
        (lambda: randn(4, 64, dtype=torch.float16), lambda: randn(64), lambda: randn(64), {}, "one dtype"),
        (lambda: randn(4, 64), lambda: randn(64), lambda: randn(64, dtype=torch.float16), {}, "one dtype"),
        (lambda: randn(4, 64).double(), lambda: randn(64), lambda: randn(64), {}, "torch.float64"),
        (lambda: torch.arange(8).reshape(2, 4), lambda: randn(4), lambda: randn(4), {}, "dtype"),
        (lambda: randn(4, 64), lambda: randn(64), lambda: None, {}, "bias must be a torch.Tensor"),
        (lambda: randn(()), lambda: randn(1), lambda: randn(1), {}, "at least one dimension"),
        (lambda: randn(4, 64), lambda: randn(64), lambda: randn(64), {"eps": -1.0}, "eps"),
        (lambda: randn(4, 64), lambda: randn(64), lambda: randn(64), {"eps": float("nan")}, "eps"),
        (lambda: randn(4, 64), lambda: randn(64), lambda: randn(64), {"offset": float("nan")}, "offset"),
        (lambda: randn(4, 64), lambda: randn(64), lambda: randn(64), {"offset": float("inf")}, "offset"),
        (lambda: randn(2, 100_000), lambda: randn(100_000), lambda: randn(100_000), {}, "at most"),
    ],
)
def test_bad_input_is_a_value_error(x, w, b, kwargs, message):
    with pytest.raises(ValueError, match=message):
        liger_lab.layer_norm(x(), w(), b(), **kwargs)


@pytest.mark.skipif(runtime.INTERPRET, reason="on a GPU run, CPU tensors are the wrong device")
def test_cpu_tensor_on_gpu_run_is_a_value_error():
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        liger_lab.layer_norm(torch.randn(4, 8), torch.ones(8, device="cuda"), torch.zeros(8, device="cuda"))


@pytest.mark.skipif(not runtime.INTERPRET, reason="only in the interpreter are CUDA tensors the wrong device")
def test_interpreter_rejects_non_cpu_tensors():
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        liger_lab.layer_norm(torch.randn(4, 8), torch.ones(8), torch.zeros(8, device="meta"))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(16384, 4096), (3, 77, 2048), (1, 128), (513, 5120), (1000, 768)])
def test_bf16_on_gpu(shape):
    x = randn(*shape, dtype=torch.bfloat16)
    w = (1 + 0.1 * randn(shape[-1])).to(torch.bfloat16)
    assert check_op("layer_norm", x, w, randn(shape[-1], dtype=torch.bfloat16))


@pytest.mark.cuda
def test_fp32_on_gpu_large():
    assert check_op("layer_norm", randn(4096, 4096), *_params(4096))
