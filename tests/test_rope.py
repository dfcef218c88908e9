import inspect

import pytest
import torch
from helpers import check_op, non_contiguous, randn

import liger_lab
from liger_lab import reference, runtime
from liger_lab.ops.rope import apply_rotary_pos_emb, rope_rotate, rope_tile
from liger_lab.workbook.checks import check_against_reference, relative_l2_error


def angles(batch: int, seq_len: int, head_dim: int, *, offset_per_batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's tables: angle t * theta_i repeated over both halves, positions shifted per batch row."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=runtime.DEVICE).float() / head_dim))
    positions = (
        torch.arange(seq_len, device=runtime.DEVICE)[None]
        + offset_per_batch * torch.arange(batch, device=runtime.DEVICE)[:, None]
    )
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def random_tables(batch: int, seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin whose two halves differ: the backward must then be the true transpose, not just -sin."""
    return randn(batch, seq_len, head_dim), randn(batch, seq_len, head_dim)


# (batch, q heads, k heads, seq_len, head_dim, batch of cos/sin)
SHAPES = [
    (1, 2, 2, 8, 64, 1),
    (2, 6, 2, 13, 64, 2),  # grouped-query heads, odd T, per-batch cos
    (2, 6, 2, 7, 80, 1),  # non-power-of-2 head_dim, cos broadcast over the batch
    (3, 4, 1, 5, 96, 3),
    (1, 3, 5, 1, 2, 1),  # one position, one pair, more k heads than q heads
    (2, 5, 5, 33, 128, 2),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tables", ["hf", "random"])
def test_matches_float64_fp32(shape, tables):
    batch, q_heads, k_heads, seq_len, head_dim, cos_batch = shape
    q, k = randn(batch, q_heads, seq_len, head_dim), randn(batch, k_heads, seq_len, head_dim)
    if tables == "hf":
        cos, sin = angles(cos_batch, seq_len, head_dim, offset_per_batch=3)
    else:
        cos, sin = random_tables(cos_batch, seq_len, head_dim)
    assert check_op("rope", q, k, cos, sin)


@pytest.mark.parametrize("head_dim", [64, 96])
def test_fp16(head_dim):
    q = randn(2, 6, 11, head_dim, dtype=torch.float16)
    k = randn(2, 2, 11, head_dim, dtype=torch.float16)
    cos, sin = (t.half() for t in angles(2, 11, head_dim, offset_per_batch=5))
    q_rot, k_rot = liger_lab.rope(q, k, cos, sin)
    assert q_rot.dtype == k_rot.dtype == torch.float16
    assert check_op("rope", q, k, cos, sin)


def test_hugging_face_layout_transposed_views():
    # Llama: q_proj(h).view(B, T, H, D).transpose(1, 2): a non-contiguous (B, H, T, D) view.
    q, k = randn(2, 9, 6, 64), randn(2, 9, 2, 64)
    cos, sin = angles(2, 9, 64, offset_per_batch=4)
    transpose = lambda x: x.transpose(1, 2)
    assert not transpose(q).is_contiguous()
    assert check_op("rope", q, k, cos, sin, prepare=transpose)
    q_rot, k_rot = liger_lab.rope(transpose(q), transpose(k), cos, sin)
    # the outputs keep the (B, T, H, D) memory layout, so attention reads them without a copy either
    assert q_rot.stride() == transpose(q).stride() and k_rot.stride() == transpose(k).stride()


@pytest.mark.parametrize(
    "layout",
    [non_contiguous, lambda x: x.transpose(0, 2).contiguous().transpose(0, 2), lambda x: x[:, :, ::2]],
    ids=["strided-features", "heads-outermost", "every-other-position"],
)
def test_other_strides(layout):
    # Non-dense views cannot be leaves of check_against_reference (it clones them dense), so the checked
    # function builds them from dense leaves.
    q, k = randn(2, 3, 12, 64), randn(2, 1, 12, 64)
    cos, sin = random_tables(2, layout(q).shape[2], 64)
    assert not layout(q).is_contiguous()
    assert check_op("rope", q, k, cos, sin, prepare=layout)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("heads_inner", [False, True], ids=["BHTD-memory", "BTHD-memory"])
@pytest.mark.parametrize("block_r,num_warps", [(1, 1), (4, 1), (16, 2), (64, 4)])
def test_every_tiling_gives_the_same_result(block_r, num_warps, heads_inner, backward):
    # The GPU's tiles (a few rows a program, so many programs and a partial last one for q and for k) differ from
    # the interpreter's default (one program for all rows): force them here so the CPU run covers those paths,
    # in both row orders.
    if heads_inner:
        q, k = randn(2, 11, 7, 48).transpose(1, 2), randn(2, 11, 3, 48).transpose(1, 2)
    else:
        q, k = randn(2, 7, 11, 48), randn(2, 3, 11, 48)
    cos, sin = random_tables(2, 11, 48)
    tile = rope_tile(48, block_r=block_r, num_warps=num_warps)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    rope_rotate(q, k, cos, sin, q_out, k_out, backward=backward, tile=tile)
    if backward:  # the transposed rotation applied to (q, k): what autograd of the reference computes
        leaves = [torch.zeros_like(q, dtype=torch.float64, requires_grad=True),
                  torch.zeros_like(k, dtype=torch.float64, requires_grad=True)]  # fmt: skip
        expected = torch.autograd.grad(reference.rope(*leaves, cos.double(), sin.double()), leaves,
                                       (q.double(), k.double()))  # fmt: skip
    else:
        expected = reference.rope(q.double(), k.double(), cos.double(), sin.double())
    assert relative_l2_error(q_out, expected[0]) < 1e-6 and relative_l2_error(k_out, expected[1]) < 1e-6


def test_strided_and_expanded_tables():
    q, k = randn(3, 4, 10, 64), randn(3, 2, 10, 64)
    cos, sin = random_tables(1, 10, 64)
    wide_cos = non_contiguous(cos).expand(3, -1, -1)  # stride 0 over the batch, stride 2 over features
    assert check_op("rope", q, k, wide_cos, sin.expand(3, -1, -1))


def test_cos_and_sin_gradients():
    # Hugging Face's tables never require grad, but learned ones may: every gradient is checked.
    q, k = randn(2, 4, 7, 32), randn(2, 2, 7, 32)
    for cos_batch in (1, 2):
        cos, sin = random_tables(cos_batch, 7, 32)
        assert check_against_reference("rope", liger_lab.rope, reference.rope, [q, k, cos, sin],
                                       input_names=["q", "k", "cos", "sin"])  # fmt: skip


def test_expanded_upstream_gradient():
    # x.sum().backward() hands the backward a stride-0 gradient.
    q = randn(2, 4, 5, 64).requires_grad_()
    k = randn(2, 2, 5, 64).requires_grad_()
    cos, sin = random_tables(2, 5, 64)
    q_rot, k_rot = liger_lab.rope(q, k, cos, sin)
    (q_rot.sum() + 2 * k_rot.sum()).backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    q_ref, k_ref = reference.rope(q64, k64, cos.double(), sin.double())
    (q_ref.sum() + 2 * k_ref.sum()).backward()
    assert relative_l2_error(q.grad, q64.grad) < 1e-6 and relative_l2_error(k.grad, k64.grad) < 1e-6


def test_mixed_precision_promotes_like_the_reference():
    # Under autocast, Hugging Face's q and k are bf16/fp16 while the tables stay fp32: the sum is fp32.
    q = randn(1, 2, 4, 16, dtype=torch.float16).requires_grad_()
    k = randn(1, 2, 4, 16, dtype=torch.float16).requires_grad_()
    cos, sin = angles(1, 4, 16)
    q_rot, k_rot = liger_lab.rope(q, k, cos, sin)
    assert q_rot.dtype == k_rot.dtype == reference.rope(q, k, cos, sin)[0].dtype == torch.float32
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    expected = reference.rope(q64, k64, cos.double(), sin.double())
    assert relative_l2_error(q_rot, expected[0]) < 1e-6 and relative_l2_error(k_rot, expected[1]) < 1e-6
    upstream = (randn(*q_rot.shape), randn(*k_rot.shape))
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), upstream)
    dq64, dk64 = torch.autograd.grad(expected, (q64, k64), tuple(u.double() for u in upstream))
    assert dq.dtype == dk.dtype == torch.float16
    assert relative_l2_error(dq, dq64) < 1e-3 and relative_l2_error(dk, dk64) < 1e-3


def test_empty_inputs():
    cos, sin = angles(1, 0, 16)
    q = randn(2, 4, 0, 16).requires_grad_()
    q_rot, k_rot = liger_lab.rope(q, randn(2, 2, 0, 16), cos, sin)
    assert q_rot.shape == (2, 4, 0, 16) and k_rot.shape == (2, 2, 0, 16)
    q_rot.sum().backward()
    assert q.grad.shape == q.shape


def test_drop_in_matches_transformers_function():
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    theirs = modeling_llama.apply_rotary_pos_emb
    # every parameter of the installed transformers' function exists here, with its default (where its Hub-kernels
    # integration is on, the function is a one-function module whose forward carries the signature)
    ours_params = inspect.signature(apply_rotary_pos_emb).parameters
    for name, param in inspect.signature(getattr(theirs, "forward", theirs)).parameters.items():
        assert name in ours_params and ours_params[name].default == param.default
    q, k = randn(2, 6, 9, 64).requires_grad_(), randn(2, 2, 9, 64).requires_grad_()
    cos, sin = angles(2, 9, 64, offset_per_batch=2)
    ours, expected = apply_rotary_pos_emb(q, k, cos, sin), theirs(q, k, cos, sin)
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(ours, (q, k), (ours[0], ours[1]))
    expected_grads = torch.autograd.grad(expected, (q, k), (ours[0].detach(), ours[1].detach()))
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_drop_in_inside_llama_attention(monkeypatch):
    # What Llama's attention really passes: transposed views and the rotary module's (B, T, D) tables.
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         attn_implementation="eager")  # fmt: skip
    attention = modeling_llama.LlamaAttention(config, layer_idx=0).to(runtime.DEVICE)
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(runtime.DEVICE)
    hidden = randn(2, 7, 64)
    position_ids = torch.stack([torch.arange(7), torch.arange(3, 10)]).to(runtime.DEVICE)
    cos, sin = rotary(hidden, position_ids)

    def run():
        h = hidden.clone().requires_grad_()
        out, _ = attention(h, position_embeddings=(cos, sin), attention_mask=None)
        out.square().sum().backward()
        return out.detach(), h.grad, attention.q_proj.weight.grad.clone()

    expected = run()
    attention.zero_grad()
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    got = run()
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _inputs(q_shape=(2, 4, 5, 16), k_shape=(2, 2, 5, 16), cos_shape=(1, 5, 16), sin_shape=None):
    return (randn(*q_shape), randn(*k_shape), randn(*cos_shape), randn(*(sin_shape or cos_shape)))


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: _inputs((2, 4, 5, 15), (2, 2, 5, 15), (1, 5, 15)), "even"),
        (lambda: _inputs(cos_shape=(1, 6, 16)), r"expected \(2 or 1, 5, 16\)"),
        (lambda: _inputs(cos_shape=(1, 5, 8)), "cos and sin have shape"),
        (lambda: _inputs(cos_shape=(3, 5, 16)), "cos and sin have shape"),
        (lambda: _inputs(cos_shape=(5, 16)), "cos and sin have shape"),
        (lambda: _inputs(sin_shape=(2, 5, 16)), "one shape"),
        (lambda: _inputs(k_shape=(1, 2, 5, 16)), "same batch, seq_len and head_dim"),
        (lambda: _inputs(k_shape=(2, 2, 6, 16)), "same batch, seq_len and head_dim"),
        (lambda: _inputs(k_shape=(2, 2, 5, 32)), "same batch, seq_len and head_dim"),
        (lambda: _inputs(q_shape=(4, 5, 16)), "4-D"),
        (lambda: (randn(2, 4, 5, 16).double(), *_inputs()[1:]), "torch.float64"),
        (lambda: (_inputs()[0], randn(2, 2, 5, 16).half(), *_inputs()[2:]), "expected one dtype"),
        (lambda: (*_inputs()[:2], torch.ones(1, 5, 16, dtype=torch.int32), _inputs()[3]), "cos has dtype"),
    ],
)
def test_bad_input_is_a_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        liger_lab.rope(*make())


def test_drop_in_rejects_what_it_does_not_support():
    q, k, cos, sin = _inputs(cos_shape=(2, 5, 16))
    with pytest.raises(ValueError, match="unsqueeze_dim is 2"):
        apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    with pytest.raises(ValueError, match="pass unsqueeze_dim by keyword"):
        apply_rotary_pos_emb(q, k, cos, sin, 1)
    q_rot, _ = apply_rotary_pos_emb(q, k, cos, sin, position_ids=torch.arange(5)[None])
    assert relative_l2_error(q_rot, reference.rope(q, k, cos, sin)[0]) < 1e-6


@pytest.mark.skipif(runtime.INTERPRET, reason="on a GPU run, CPU tensors are the wrong device")
def test_cpu_tensor_on_gpu_run_is_a_value_error():
    q, k, cos, sin = _inputs()
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        liger_lab.rope(q.cpu(), k, cos, sin)


@pytest.mark.skipif(not runtime.INTERPRET, reason="only in the interpreter are CUDA tensors the wrong device")
def test_interpreter_rejects_non_cpu_tensors():
    q, k, cos, sin = _inputs()
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        liger_lab.rope(q, k.to("meta"), cos, sin)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "shape", [(2, 32, 8, 1024, 128), (1, 6, 2, 77, 80), (3, 12, 4, 33, 96), (1, 32, 8, 1, 128), (4, 8, 8, 256, 64)]
)
@pytest.mark.parametrize("hf_layout", [False, True])
def test_bf16_on_gpu(shape, hf_layout):
    batch, q_heads, k_heads, seq_len, head_dim = shape
    cos, sin = (t.bfloat16() for t in angles(batch, seq_len, head_dim, offset_per_batch=7))
    if hf_layout:
        q = randn(batch, seq_len, q_heads, head_dim, dtype=torch.bfloat16)
        k = randn(batch, seq_len, k_heads, head_dim, dtype=torch.bfloat16)
        assert check_op("rope", q, k, cos, sin, prepare=lambda x: x.transpose(1, 2))
    else:
        q = randn(batch, q_heads, seq_len, head_dim, dtype=torch.bfloat16)
        k = randn(batch, k_heads, seq_len, head_dim, dtype=torch.bfloat16)
        assert check_op("rope", q, k, cos[:1], sin[:1])


@pytest.mark.cuda
def test_bf16_on_gpu_matches_hugging_face_rounding_closely():
    # Hugging Face rounds q*cos, rotate_half(q)*sin and their sum to bf16; the kernel rounds once, so it
    # is at least as close to float64.
    q, k = randn(2, 32, 512, 128, dtype=torch.bfloat16), randn(2, 8, 512, 128, dtype=torch.bfloat16)
    cos, sin = (t.bfloat16() for t in angles(1, 512, 128))
    exact = reference.rope(q.double(), k.double(), cos.double(), sin.double())
    ours, theirs = liger_lab.rope(q, k, cos, sin), reference.rope(q, k, cos, sin)
    for a, b, e in zip(ours, theirs, exact, strict=True):
        assert relative_l2_error(a, e) <= relative_l2_error(b, e) * 1.01
