import pytest
import torch
from helpers import HostReads, check_op, non_contiguous, randn

import liger_lab
from liger_lab import reference, runtime
from liger_lab.ops.partial_rope import tables_from_complex
from liger_lab.ops.rope import rope_rotate, rope_tile
from liger_lab.workbook.checks import check_against_reference, relative_l2_error


def tables(batch: int, seq_len: int, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin whose entries all differ: the backward must be the true transpose of each pair's map."""
    return randn(batch, seq_len, rotary_dim), randn(batch, seq_len, rotary_dim)


# (batch, q heads, k heads, seq_len, head_dim, rotary_dim, batch of cos/sin)
SHAPES = [
    (1, 2, 2, 8, 64, 32, 1),  # GLM-4, Phi-3 with partial_rotary_factor 0.5
    (2, 6, 2, 13, 64, 16, 2),  # a quarter of each head (Qwen3-Next), grouped-query heads, per-batch tables
    (2, 3, 1, 7, 80, 20, 1),  # non-power-of-2 rotated and passed parts
    (1, 3, 5, 1, 10, 4, 1),  # one position, more k heads than q heads
    (2, 4, 2, 9, 48, 48, 2),  # every feature rotates (Llama 4's complex pairs when interleaved)
    (1, 2, 1, 5, 12, 2, 1),  # one pair rotates
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_matches_float64_fp32(shape, interleaved):
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim, cos_batch = shape
    q, k = randn(batch, q_heads, seq_len, head_dim), randn(batch, k_heads, seq_len, head_dim)
    cos, sin = tables(cos_batch, seq_len, rotary_dim)
    assert check_op("partial_rope", q, k, cos, sin, interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_fp16_and_mixed_precision(interleaved):
    q, k = randn(2, 4, 11, 64, dtype=torch.float16), randn(2, 2, 11, 64, dtype=torch.float16)
    cos, sin = tables(1, 11, 32)
    assert check_op("partial_rope", q, k, cos.half(), sin.half(), interleaved=interleaved)
    q_rot, k_rot = liger_lab.partial_rope(q, k, cos.half(), sin.half(), interleaved=interleaved)
    assert q_rot.dtype == k_rot.dtype == torch.float16
    # fp32 tables (OLMo-style, autocast): the passed features are promoted with the rotated ones, as torch.cat does
    q_rot, _ = liger_lab.partial_rope(q, k, cos, sin, interleaved=interleaved)
    expected = reference.partial_rope(q, k, cos, sin, interleaved=interleaved)[0]
    assert q_rot.dtype == expected.dtype == torch.float32
    assert relative_l2_error(q_rot, expected) < 1e-6


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_hugging_face_layout_transposed_views(interleaved):
    # q_proj(h).view(B, T, H, D).transpose(1, 2): a (B, H, T, D) view of (B, T, H, D) memory, kept by the output
    q, k = randn(2, 9, 6, 32), randn(2, 9, 2, 32)
    cos, sin = tables(2, 9, 16)
    transpose = lambda x: x.transpose(1, 2)
    assert check_op("partial_rope", q, k, cos, sin, prepare=transpose, interleaved=interleaved)
    q_rot, k_rot = liger_lab.partial_rope(transpose(q), transpose(k), cos, sin, interleaved=interleaved)
    assert q_rot.stride() == transpose(q).stride() and k_rot.stride() == transpose(k).stride()


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize(
    "layout", [non_contiguous, lambda x: x[:, :, ::2]], ids=["strided-features", "every-other-position"]
)
def test_other_strides(layout, interleaved):
    q, k = randn(2, 3, 12, 32), randn(2, 1, 12, 32)
    cos, sin = tables(2, layout(q).shape[2], 16)
    assert not layout(q).is_contiguous()
    assert check_op("partial_rope", q, k, non_contiguous(cos), sin, prepare=layout, interleaved=interleaved)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("heads_inner", [False, True], ids=["BHTD-memory", "BTHD-memory"])
@pytest.mark.parametrize("block_r,num_warps", [(1, 1), (16, 2)])
def test_gpu_tiles_give_the_same_result(block_r, num_warps, heads_inner, backward, interleaved):
    # Many programs, a partial last one for q and for k, in both row orders: the GPU's tiles, on the CPU.
    if heads_inner:
        q, k = randn(2, 11, 7, 40).transpose(1, 2), randn(2, 11, 3, 40).transpose(1, 2)
    else:
        q, k = randn(2, 7, 11, 40), randn(2, 3, 11, 40)
    cos, sin = tables(2, 11, 24)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    rope_rotate(q, k, cos, sin, q_out, k_out, backward=backward, tile=rope_tile(24, block_r=block_r,
                num_warps=num_warps), rotary_dim=24, adjacent_pairs=interleaved)  # fmt: skip
    ref = lambda q, k: reference.partial_rope(q, k, cos.double(), sin.double(), interleaved=interleaved)
    if backward:
        leaves = [torch.zeros_like(x, dtype=torch.float64, requires_grad=True) for x in (q, k)]
        expected = torch.autograd.grad(ref(*leaves), leaves, (q.double(), k.double()))
    else:
        expected = ref(q.double(), k.double())
    assert relative_l2_error(q_out, expected[0]) < 1e-6 and relative_l2_error(k_out, expected[1]) < 1e-6


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_cos_and_sin_gradients(interleaved):
    q, k = randn(2, 4, 7, 32), randn(2, 2, 7, 32)
    for cos_batch in (1, 2):
        cos, sin = tables(cos_batch, 7, 12)
        assert check_against_reference(
            "partial_rope",
            lambda *x: liger_lab.partial_rope(*x, interleaved=interleaved),
            lambda *x: reference.partial_rope(*x, interleaved=interleaved),
            [q, k, cos, sin], input_names=["q", "k", "cos", "sin"],
        )  # fmt: skip


def test_full_rotation_in_halves_is_rope():
    q, k = randn(2, 4, 9, 32), randn(2, 2, 9, 32)
    cos, sin = tables(1, 9, 32)
    for ours, theirs in zip(liger_lab.partial_rope(q, k, cos, sin), liger_lab.rope(q, k, cos, sin), strict=True):
        assert torch.equal(ours, theirs)


def test_matches_transformers_partial_glm4_and_llama4():
    pytest.importorskip("transformers")
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as glm4_rope
    from transformers.models.llama4.modeling_llama4 import apply_rotary_emb as llama4_rope
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    q, k = randn(2, 4, 7, 64), randn(2, 2, 7, 64)
    angle = randn(2, 7, 16)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # Hugging Face's (B, T, 32)
    for ours, theirs in zip(liger_lab.partial_rope(q, k, cos, sin), phi3_rope(q, k, cos, sin), strict=True):
        assert relative_l2_error(ours, theirs) < 1e-6
    # GLM-4 hands over the same tables and repeats each pair's angle for its two neighbours
    pair_cos, pair_sin = (t[..., :16].repeat_interleave(2, -1) for t in (cos, sin))
    rotated = liger_lab.partial_rope(q, k, pair_cos, pair_sin, interleaved=True)
    for ours, theirs in zip(rotated, glm4_rope(q, k, cos, sin), strict=True):
        assert relative_l2_error(ours, theirs) < 1e-6
    # Llama 4: (B, T, H, D) inputs, complex frequencies (scaled: not of modulus 1)
    xq, xk = randn(2, 7, 4, 64), randn(2, 7, 2, 64)
    freqs_cis = torch.polar(0.5 + torch.rand(2, 7, 32), randn(2, 7, 32))
    rotated = liger_lab.partial_rope(xq.transpose(1, 2), xk.transpose(1, 2), *tables_from_complex(freqs_cis),
                                     interleaved=True)  # fmt: skip
    for ours, theirs in zip(rotated, llama4_rope(xq, xk, freqs_cis), strict=True):
        assert relative_l2_error(ours.transpose(1, 2), theirs) < 1e-6


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_forward_and_backward_read_nothing_back(monkeypatch, interleaved):
    """No value reaches the host on the GPU's path: the rotated width is a size, the checks are of shapes."""
    monkeypatch.setattr(runtime, "HOST_READS_WAIT", True)
    q, k = randn(2, 3, 5, 16).requires_grad_(), randn(2, 1, 5, 16).requires_grad_()
    cos, sin = tables(2, 5, 8)
    with HostReads(monkeypatch) as reads:
        q_rot, k_rot = liger_lab.partial_rope(q, k, cos, sin, interleaved=interleaved)
        (q_rot.sum() + k_rot.sum()).backward()
    assert reads.calls == []


def test_empty_inputs():
    q = randn(2, 4, 0, 16).requires_grad_()
    q_rot, k_rot = liger_lab.partial_rope(q, randn(2, 2, 0, 16), *tables(1, 0, 8))
    assert q_rot.shape == (2, 4, 0, 16) and k_rot.shape == (2, 2, 0, 16)
    q_rot.sum().backward()
    assert q.grad.shape == q.shape


def _inputs(q_shape=(2, 4, 5, 16), k_shape=(2, 2, 5, 16), cos_shape=(1, 5, 8), sin_shape=None):
    return randn(*q_shape), randn(*k_shape), randn(*cos_shape), randn(*(sin_shape or cos_shape))


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: _inputs(cos_shape=(1, 5, 7)), "even rotary_dim from 2 to head_dim = 16"),
        (lambda: _inputs(cos_shape=(1, 5, 18)), "even rotary_dim from 2 to head_dim = 16"),
        (lambda: _inputs(cos_shape=(1, 5, 0)), "even rotary_dim"),
        (lambda: _inputs(cos_shape=(1, 6, 8)), "cos and sin have shape"),
        (lambda: _inputs(cos_shape=(5, 8)), "cos and sin have shape"),
        (lambda: _inputs(cos_shape=(3, 5, 8)), "cos and sin have shape"),
        (lambda: _inputs(sin_shape=(1, 5, 10)), "one shape"),
        (lambda: _inputs(k_shape=(2, 2, 5, 32)), "same batch, seq_len and head_dim"),
        (lambda: _inputs(q_shape=(4, 5, 16)), "4-D"),
        (lambda: (randn(2, 4, 5, 16).double(), *_inputs()[1:]), "torch.float64"),
    ],
)
def test_bad_input_is_a_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        liger_lab.partial_rope(*make())


def test_interleaved_must_be_a_bool():
    with pytest.raises(ValueError, match="interleaved is 1"):
        liger_lab.partial_rope(*_inputs(), interleaved=1)


@pytest.mark.skipif(not runtime.INTERPRET, reason="only in the interpreter are CUDA tensors the wrong device")
def test_interpreter_rejects_non_cpu_tensors():
    q, k, cos, sin = _inputs()
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        liger_lab.partial_rope(q, k.to("meta"), cos, sin)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 32, 2, 1024, 128, 64), (1, 6, 2, 77, 80, 20), (3, 16, 4, 33, 256, 64)])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_bf16_on_gpu(shape, interleaved):
    batch, q_heads, k_heads, seq_len, head_dim, rotary_dim = shape
    q = randn(batch, seq_len, q_heads, head_dim, dtype=torch.bfloat16)
    k = randn(batch, seq_len, k_heads, head_dim, dtype=torch.bfloat16)
    cos, sin = (t.bfloat16() for t in tables(batch, seq_len, rotary_dim))
    assert check_op("partial_rope", q, k, cos, sin, prepare=lambda x: x.transpose(1, 2), interleaved=interleaved)
