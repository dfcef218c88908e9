import pytest
import torch
from helpers import OpCalls, check_op, non_contiguous, randn, row_strided
from torch.utils.checkpoint import checkpoint

import liger_lab
from liger_lab import reference, runtime
from liger_lab.nn import GeGLUMLP, SwiGLUMLP

# The interpreter evaluates exp with numpy, which warns when a saturated sigmoid's exp overflows to inf.
saturating = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

OPS = {"swiglu": (liger_lab.swiglu, reference.swiglu), "geglu": (liger_lab.geglu, reference.geglu)}


def _grads(fn, gate, up, upstream, **kwargs):
    """(out, d_gate, d_up) of fn on fresh leaf copies of gate and up."""
    gate, up = gate.detach().clone().requires_grad_(), up.detach().clone().requires_grad_()
    out = fn(gate, up, **kwargs)
    out.backward(upstream)
    return out.detach(), gate.grad, up.grad


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(8, 64), (1,), (1, 1), (5, 1000), (3, 7, 96), (130, 33), (4099,), (2, 3, 5, 7)])
def test_matches_float64_fp32(op, shape):
    assert check_op(op, randn(*shape), randn(*shape))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(33, 257), (3, 5, 41)])
def test_fp16(op, shape):
    gate, up = randn(*shape, dtype=torch.float16), randn(*shape, dtype=torch.float16)
    assert check_op(op, gate, up)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("layout", [non_contiguous, row_strided, lambda x: x.transpose(0, 1)])
def test_non_contiguous_inputs(op, in_place, layout):
    gate, up = layout(randn(24, 48)), layout(randn(24, 48))
    assert not gate.is_contiguous() and not up.is_contiguous()
    assert check_op(op, gate, up, in_place_backward=in_place)
    # One contiguous and one strided input.
    assert check_op(op, randn(*gate.shape), up, in_place_backward=in_place)


@pytest.mark.parametrize("op", OPS)
def test_broadcast_upstream_gradient(op):
    """``out.sum().backward()`` hands the backward an expanded (stride 0) gradient."""
    ours, theirs = OPS[op]
    gate, up = randn(6, 50), randn(6, 50)
    one = torch.ones((), device=runtime.DEVICE)
    _, d_gate, d_up = _grads(lambda g, u: ours(g, u).sum(), gate, up, one)
    _, ref_gate, ref_up = _grads(lambda g, u: theirs(g, u).sum(), gate.double(), up.double(), one.double())
    torch.testing.assert_close(d_gate, ref_gate.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_up, ref_up.float(), rtol=1e-5, atol=1e-6)


@saturating
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_saturated_gate_is_finite_and_exact(op, dtype):
    """|gate| of 30 saturates the sigmoid (and tanh): exp overflows to inf inside, results stay exact."""
    ours, _ = OPS[op]
    signs = torch.where(torch.arange(64, device=runtime.DEVICE) % 2 == 0, 1.0, -1.0)
    gate = (signs * 30.0 + 0.1 * randn(64)).repeat(4, 1).to(dtype)
    up = randn(4, 64, dtype=dtype)
    assert check_op(op, gate, up)
    out, d_gate, d_up = _grads(ours, gate, up, torch.ones_like(up))
    assert torch.isfinite(out).all() and torch.isfinite(d_gate).all() and torch.isfinite(d_up).all()


@saturating
@pytest.mark.parametrize("op", OPS)
def test_huge_gate_in_fp32(op):
    """exp inside the sigmoid overflows fp32 to inf (for silu past |x| = 88, for gelu's cubic much sooner)."""
    ours, theirs = OPS[op]
    gate = torch.tensor([-1e4, -500.0, -89.0, -20.0, 0.0, 20.0, 89.0, 500.0, 1e4], device=runtime.DEVICE)
    up = torch.full_like(gate, 0.5)
    out, d_gate, d_up = _grads(ours, gate, up, torch.ones_like(gate))
    ref_out, ref_gate, ref_up = _grads(theirs, gate.double(), up.double(), torch.ones_like(gate).double())
    torch.testing.assert_close(out, ref_out.float(), rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(d_gate, ref_gate.float(), rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(d_up, ref_up.float(), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("op", OPS)
def test_empty_input(op):
    ours, _ = OPS[op]
    gate, up = randn(0, 16).requires_grad_(), randn(0, 16).requires_grad_()
    out = ours(gate, up)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert gate.grad.shape == up.grad.shape == (0, 16)


@pytest.mark.parametrize("op", OPS)
def test_output_dtype_and_shape_follow_the_inputs(op):
    ours, theirs = OPS[op]
    for dtype in (torch.float32, torch.float16):
        gate, up = randn(2, 3, 17, dtype=dtype), randn(2, 3, 17, dtype=dtype)
        out = ours(gate, up)
        assert out.dtype == theirs(gate, up).dtype == dtype and out.shape == gate.shape


# In-place backward: gradients written over the saved gate and up buffers.


@pytest.mark.parametrize("op", OPS)
def test_default_backward_leaves_inputs_untouched(op):
    ours, _ = OPS[op]
    gate, up = randn(16, 80).requires_grad_(), randn(16, 80).requires_grad_()
    before = gate.detach().clone(), up.detach().clone()
    ours(gate, up).backward(randn(16, 80))
    assert torch.equal(gate.detach(), before[0]) and torch.equal(up.detach(), before[1])
    assert gate.grad.data_ptr() != gate.data_ptr()


@pytest.mark.parametrize("op", OPS)
def test_in_place_backward_reuses_the_buffers_and_gives_the_same_gradients(op):
    ours, _ = OPS[op]
    gate, up, upstream = randn(16, 80), randn(16, 80), randn(16, 80)
    fresh = _grads(ours, gate, up, upstream)
    gate_leaf, up_leaf = gate.clone().requires_grad_(), up.clone().requires_grad_()
    # Intermediates, like a projection's outputs (a leaf is the caller's and never written): their buffers end up
    # holding their gradients.
    g, u = gate_leaf * 1.0, up_leaf * 1.0
    ours(g, u, in_place_backward=True).backward(upstream)
    torch.testing.assert_close(g.detach(), fresh[1], rtol=0, atol=0)
    torch.testing.assert_close(u.detach(), fresh[2], rtol=0, atol=0)
    torch.testing.assert_close(gate_leaf.grad, fresh[1], rtol=0, atol=0)
    torch.testing.assert_close(up_leaf.grad, fresh[2], rtol=0, atol=0)


@pytest.mark.parametrize("op", OPS)
def test_in_place_backward_keeps_a_strided_caller_tensor_intact(op):
    """A strided input is copied in the forward; the in-place backward writes over the copy only."""
    ours, _ = OPS[op]
    gate, up = non_contiguous(randn(8, 40)).requires_grad_(), randn(8, 40).requires_grad_()
    before = gate.detach().clone()
    ours(gate, up, in_place_backward=True).sum().backward()
    assert torch.equal(gate.detach(), before)


@pytest.mark.parametrize("op", OPS)
def test_in_place_backward_with_one_buffer_for_gate_and_up(op):
    """swiglu(x, x): writing d_gate and d_up over one buffer would race, so fresh outputs are used."""
    ours, theirs = OPS[op]
    x = randn(12, 40)
    x_ours, x_ref = x.clone().requires_grad_(), x.double().requires_grad_()
    ours(x_ours, x_ours, in_place_backward=True).sum().backward()
    theirs(x_ref, x_ref).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_ours.detach(), x)


@pytest.mark.parametrize("op", OPS)
def test_in_place_backward_spares_an_input_that_needs_no_gradient(op):
    ours, _ = OPS[op]
    gate, up = randn(8, 40).requires_grad_(), randn(8, 40)
    before = up.clone()
    ours(gate, up, in_place_backward=True).sum().backward()
    assert torch.equal(up, before)


@pytest.mark.parametrize("op", OPS)
def test_in_place_backward_refuses_a_second_backward(op):
    ours, _ = OPS[op]
    gate, up = randn(8, 40).requires_grad_(), randn(8, 40).requires_grad_()
    out = ours(gate * 1.0, up * 1.0, in_place_backward=True)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("op", OPS)
def test_in_place_backward_refuses_a_producer_that_saved_its_output(op):
    """exp saves its output for its own backward; overwriting it must fail loudly, not silently."""
    ours, _ = OPS[op]
    x, up = randn(8, 40).requires_grad_(), randn(8, 40).requires_grad_()
    out = ours(torch.exp(x), up * 1.0, in_place_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_double_backward_is_refused():
    """The backward is a kernel, not differentiable again: a second derivative must raise, not be zero."""
    gate, up = randn(4, 8).requires_grad_(), randn(4, 8).requires_grad_()
    upstream = randn(4, 8).requires_grad_()
    (d_gate,) = torch.autograd.grad(liger_lab.swiglu(gate, up), gate, upstream, create_graph=True)
    with pytest.raises(RuntimeError, match=r"liger_lab\.glu has no second derivative"):
        d_gate.sum().backward()


# Modules: drop-ins for Hugging Face's LlamaMLP and GemmaMLP.


def _tiny_hf_mlp(kind, **config_kwargs):
    pytest.importorskip("transformers")
    config_kwargs = {"hidden_size": 48, "intermediate_size": 136, "num_attention_heads": 4, **config_kwargs}
    if kind == "llama":
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        config = LlamaConfig(**config_kwargs)
        return config, LlamaMLP(config), SwiGLUMLP
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = GemmaConfig(**config_kwargs)
    return config, GemmaMLP(config), GeGLUMLP


@pytest.mark.parametrize("kind,config_kwargs", [("llama", {}), ("llama", {"mlp_bias": True}), ("gemma", {})])
@pytest.mark.parametrize("in_place", [True, False])
def test_module_is_a_drop_in_for_hugging_face(kind, config_kwargs, in_place):
    config, theirs, cls = _tiny_hf_mlp(kind, **config_kwargs)
    theirs = theirs.to(runtime.DEVICE)
    ours = cls.from_config(config, in_place_backward=in_place).to(runtime.DEVICE)
    assert ours.in_place_backward is in_place
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    ours.load_state_dict(theirs.state_dict())

    x = randn(2, 5, 48)
    upstream = randn(2, 5, 48)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_theirs = ours(x_ours), theirs(x_theirs)
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-5)
    out_ours.backward(upstream)
    out_theirs.backward(upstream)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-5)
    their_params = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, their_params[name].grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("in_place", [True, False])
def test_module_writes_gradients_over_its_own_activations_only_when_asked(in_place):
    """The in-place backward operator runs only when asked (a hooked projection keeps its output either way:
    tests/test_patching_composition.py)."""
    mlp = SwiGLUMLP(16, 40, in_place_backward=in_place, device=runtime.DEVICE)
    with OpCalls() as calls:
        mlp(randn(3, 16)).sum().backward()
    assert calls.counts["liger_lab::glu_backward_"] == int(in_place)
    assert calls.counts["liger_lab::glu_backward"] == int(not in_place)


def test_module_constructor_without_config():
    mlp = SwiGLUMLP(32, 88, device=runtime.DEVICE)
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert mlp.gate_proj.weight.shape == (88, 32) and mlp.down_proj.weight.shape == (32, 88)
    assert set(GeGLUMLP(32, 88, bias=True).state_dict()) >= {"gate_proj.bias", "up_proj.bias", "down_proj.bias"}
    x = randn(3, 32)
    expected = mlp.down_proj(reference.swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_module_under_activation_checkpointing(use_reentrant):
    """Recomputed gate and up are overwritten by the in-place backward; the gradients stay right."""
    mlp = GeGLUMLP(24, 72, device=runtime.DEVICE)
    x = randn(4, 24)
    x_ckpt, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    checkpoint(mlp, x_ckpt, use_reentrant=use_reentrant).pow(2).sum().backward()
    ckpt_grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    mlp.down_proj(reference.geglu(mlp.gate_proj(x_plain), mlp.up_proj(x_plain))).pow(2).sum().backward()
    torch.testing.assert_close(x_ckpt.grad, x_plain.grad, rtol=1e-5, atol=1e-6)
    for ours, expected in zip(ckpt_grads, (p.grad for p in mlp.parameters()), strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,activation", [("llama", "gelu_pytorch_tanh"), ("gemma", "silu")])
def test_from_config_rejects_another_activation(kind, activation):
    config, _, cls = _tiny_hf_mlp(kind, hidden_act=activation)
    with pytest.raises(ValueError, match="activation"):
        cls.from_config(config)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "gate,up,message",
    [
        (lambda: randn(4, 64), lambda: randn(4, 63), "one shape"),
        (lambda: randn(4, 64), lambda: randn(64), "one shape"),
        (lambda: randn(4, 64), lambda: randn(4, 64, dtype=torch.float16), "one dtype"),
        (lambda: randn(4, 64).double(), lambda: randn(4, 64).double(), "torch.float64"),
        (lambda: torch.arange(8).reshape(2, 4), lambda: torch.arange(8).reshape(2, 4), "dtype"),
        (lambda: [1.0, 2.0], lambda: randn(2), "torch.Tensor"),
    ],
)
def test_bad_input_is_a_value_error(op, gate, up, message):
    ours, _ = OPS[op]
    with pytest.raises(ValueError, match=message):
        ours(gate(), up())


@pytest.mark.skipif(not runtime.INTERPRET, reason="only in the interpreter are non-CPU tensors the wrong device")
def test_interpreter_rejects_non_cpu_tensors():
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        liger_lab.swiglu(meta, meta)


@pytest.mark.skipif(runtime.INTERPRET, reason="on a GPU run, CPU tensors are the wrong device")
def test_cpu_tensor_on_gpu_run_is_a_value_error():
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        liger_lab.swiglu(torch.randn(4, 8), torch.randn(4, 8, device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(4096, 14336), (3, 77, 2048), (1, 1), (513, 5121)])
@pytest.mark.parametrize("in_place", [False, True])
def test_bf16_on_gpu(op, shape, in_place):
    gate, up = randn(*shape, dtype=torch.bfloat16), randn(*shape, dtype=torch.bfloat16)
    assert check_op(op, gate, up, in_place_backward=in_place)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_bf16_module_on_gpu(kind):
    config, theirs, cls = _tiny_hf_mlp(kind)
    theirs = theirs.to(runtime.DEVICE, torch.bfloat16)
    ours = cls.from_config(config).to(runtime.DEVICE, torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    x = randn(4, 33, 48, dtype=torch.bfloat16)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(x_ours).float().pow(2).sum().backward()
    theirs(x_theirs).float().pow(2).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=2e-2, atol=2e-2)
