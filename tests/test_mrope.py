"""Multimodal RoPE (liger_lab.mrope): against the float64 reference, against what transformers' Qwen2.5-VL and
Qwen3-VL compute, and bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import non_contiguous, randn
from test_host_sync import HostReads
from torch._dynamo.testing import CompileCounterWithBackend

import liger_lab
from liger_lab import reference, runtime
from liger_lab.ops.rope import rope_rotate, rope_tile
from liger_lab.workbook.checks import check_against_reference, relative_l2_error

LAYOUTS = {"sections": False, "interleaved": True}


def sections(head_dim: int, interleaved: bool) -> list[int]:
    """The models' sections scaled to head_dim / 2 pairs: Qwen2-VL's (16, 24, 24) of 64 one after another, Qwen3-VL's
    (24, 20, 20) interleaved."""
    pairs = head_dim // 2
    spatial = 5 * pairs // 16 if interleaved else 3 * pairs // 8
    return [pairs - 2 * spatial, spatial, spatial]


def position_streams(batch: int, seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's RoPE table of each position stream, (3, B, T, D): temporal, height and width positions that
    differ from one another and from one sequence of the batch to the next."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=runtime.DEVICE).float() / head_dim))
    token = torch.arange(seq_len, device=runtime.DEVICE)
    sequence = torch.arange(batch, device=runtime.DEVICE)
    positions = torch.stack([token, 2 * token // 3, token % 5])[:, None] + 3 * sequence[:, None]  # (3, B, T)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def random_streams(batch: int, seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables whose halves differ: the backward must then be the true transpose, not just the rotation by -angle."""
    return randn(3, batch, seq_len, head_dim), randn(3, batch, seq_len, head_dim)


def check_qk(q, k, cos, sin, section, interleaved, layout=lambda x: x):
    """Output and dq, dk against float64; ``layout`` turns the leaves into the views the op is called with."""
    return check_against_reference(
        "mrope",
        lambda q, k: liger_lab.mrope(layout(q), layout(k), cos, sin, section, interleaved=interleaved),
        lambda q, k: reference.mrope(
            layout(q), layout(k), cos.double(), sin.double(), section, interleaved=interleaved
        ),
        [q, k],
        input_names=["q", "k"],
    )


# (batch, q heads, k heads, seq_len, head_dim, batch of cos/sin)
SHAPES = [
    (1, 3, 1, 7, 32, 1),  # batch 1, odd head count, grouped-query heads
    (2, 5, 5, 9, 32, 2),  # odd heads, per-sequence tables
    (2, 6, 2, 1, 64, 1),  # one token, tables shared by the batch
    (2, 3, 1, 13, 48, 2),  # 24 pairs: no power of 2
    (1, 2, 3, 5, 8, 1),  # more k heads than q heads, four pairs
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tables", ["hf", "random"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_float64_fp32(shape, tables, layout):
    batch, q_heads, k_heads, seq_len, head_dim, cos_batch = shape
    q, k = randn(batch, q_heads, seq_len, head_dim), randn(batch, k_heads, seq_len, head_dim)
    make = position_streams if tables == "hf" else random_streams
    cos, sin = make(cos_batch, seq_len, head_dim)
    assert check_qk(q, k, cos, sin, sections(head_dim, LAYOUTS[layout]), LAYOUTS[layout])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp16(layout):
    q, k = randn(2, 5, 11, 64, dtype=torch.float16), randn(2, 1, 11, 64, dtype=torch.float16)
    cos, sin = (t.half() for t in position_streams(2, 11, 64))
    section = sections(64, LAYOUTS[layout])
    q_rot, k_rot = liger_lab.mrope(q, k, cos, sin, section, interleaved=LAYOUTS[layout])
    assert q_rot.dtype == k_rot.dtype == torch.float16
    assert check_qk(q, k, cos, sin, section, LAYOUTS[layout])


def test_mixed_precision_promotes_like_the_reference():
    # Under autocast q and k are half precision while the tables stay fp32: the sum is fp32, the gradients fp16.
    q, k = randn(1, 2, 4, 16, dtype=torch.float16), randn(1, 2, 4, 16, dtype=torch.float16)
    cos, sin = position_streams(1, 4, 16)
    q_rot, k_rot = liger_lab.mrope(q.requires_grad_(), k.requires_grad_(), cos, sin, [4, 2, 2])
    assert q_rot.dtype == k_rot.dtype == reference.mrope(q, k, cos, sin, [4, 2, 2])[0].dtype == torch.float32
    expected = reference.mrope(q.double(), k.double(), cos.double(), sin.double(), [4, 2, 2])
    assert relative_l2_error(q_rot, expected[0]) < 1e-6 and relative_l2_error(k_rot, expected[1]) < 1e-6
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (torch.ones_like(q_rot), torch.ones_like(k_rot)))
    assert dq.dtype == dk.dtype == torch.float16


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hugging_face_layout_transposed_views(layout):
    # The VLMs' attention: q_proj(h).view(B, T, H, D).transpose(1, 2), a non-contiguous (B, H, T, D) view.
    q, k = randn(2, 9, 5, 32), randn(2, 9, 1, 32)
    cos, sin = position_streams(2, 9, 32)
    section, transpose = sections(32, LAYOUTS[layout]), lambda x: x.transpose(1, 2)
    assert not transpose(q).is_contiguous()
    assert check_qk(q, k, cos, sin, section, LAYOUTS[layout], layout=transpose)
    q_rot, k_rot = liger_lab.mrope(transpose(q), transpose(k), cos, sin, section, interleaved=LAYOUTS[layout])
    # the outputs keep the (B, T, H, D) memory layout, so attention reads them without a copy either
    assert q_rot.stride() == transpose(q).stride() and k_rot.stride() == transpose(k).stride()


def test_strided_and_expanded_tables():
    q, k = randn(3, 2, 6, 16), randn(3, 1, 6, 16)
    cos, sin = random_streams(1, 6, 16)
    wide_cos = non_contiguous(cos).expand(3, 3, -1, -1)  # stride 0 over the batch, stride 2 over features
    assert check_qk(q, k, wide_cos, sin.expand(3, 3, -1, -1), [4, 2, 2], False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_text_tokens_are_plain_rope(layout):
    # A text token has one position in all three streams: whatever the sections, the op is RoPE with that table.
    q, k = randn(2, 3, 7, 32), randn(2, 1, 7, 32)
    cos, sin = random_streams(2, 7, 32)
    same = lambda table: table[:1].expand(3, -1, -1, -1)
    ours = liger_lab.mrope(q, k, same(cos), same(sin), sections(32, LAYOUTS[layout]), interleaved=LAYOUTS[layout])
    for a, b in zip(ours, liger_lab.rope(q, k, cos[0], sin[0]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_pair_reads_its_sections_stream(layout):
    # Tables of stream s hold angle s + 1 on every pair: each output pair then says which stream rotated it.
    half = 8
    angles = torch.arange(1.0, 4.0, device=runtime.DEVICE).view(3, 1, 1, 1).expand(3, 1, 1, 2 * half)
    q = torch.cat([torch.ones(1, 1, 1, half), torch.zeros(1, 1, 1, half)], dim=-1).to(runtime.DEVICE)
    section = [3, 3, 2]  # height and width differ: a swap of the two shows
    q_rot, _ = liger_lab.mrope(q, q, angles.cos(), angles.sin(), section, interleaved=LAYOUTS[layout])
    streams = torch.atan2(q_rot[0, 0, 0, half:], q_rot[0, 0, 0, :half]).round().long() - 1
    expected = [0, 1, 2, 0, 1, 2, 0, 1] if LAYOUTS[layout] else [0, 0, 0, 1, 1, 1, 2, 2]
    assert streams.tolist() == expected


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cos_and_sin_gradients(layout):
    # Hugging Face's tables never require grad, but learned ones may: each stream's gradient only where it is read.
    q, k = randn(2, 3, 5, 16), randn(2, 1, 5, 16)
    for cos_batch in (1, 2):
        cos, sin = random_streams(cos_batch, 5, 16)
        assert check_against_reference(
            "mrope",
            lambda q, k, cos, sin: liger_lab.mrope(q, k, cos, sin, [5, 2, 1], interleaved=LAYOUTS[layout]),
            lambda q, k, cos, sin: reference.mrope(q, k, cos, sin, [5, 2, 1], interleaved=LAYOUTS[layout]),
            [q, k, cos, sin],
            input_names=["q", "k", "cos", "sin"],
        )


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("heads_inner", [False, True], ids=["BHTD-memory", "BTHD-memory"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_tiles_give_the_same_result(layout, heads_inner, backward):
    # The GPU's tiles (few rows a program, a partial last one for q and for k) rather than the interpreter's one
    # program for all rows, forced here so that the CPU run covers them, in both row orders.
    if heads_inner:
        q, k = randn(2, 5, 3, 16).transpose(1, 2), randn(2, 5, 1, 16).transpose(1, 2)
    else:
        q, k = randn(2, 3, 5, 16), randn(2, 1, 5, 16)
    cos, sin = random_streams(2, 5, 16)
    section, interleaved = sections(16, LAYOUTS[layout]), LAYOUTS[layout]
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    rope_rotate(q, k, cos, sin, q_out, k_out, backward=backward, tile=rope_tile(16, block_r=4),
                mrope_section=tuple(section), interleaved=interleaved)  # fmt: skip
    mrope64 = lambda q, k: reference.mrope(q, k, cos.double(), sin.double(), section, interleaved=interleaved)
    if backward:  # the transposed rotation applied to (q, k): what autograd of the reference computes
        leaves = [torch.zeros_like(x, dtype=torch.float64, requires_grad=True) for x in (q, k)]
        expected = torch.autograd.grad(mrope64(*leaves), leaves, (q.double(), k.double()))
    else:
        expected = mrope64(q.double(), k.double())
    assert relative_l2_error(q_out, expected[0]) < 1e-6 and relative_l2_error(k_out, expected[1]) < 1e-6


def test_interleaved_compiles_once_for_every_length():
    # The op table's compile test runs the default layout; the interleaved one's section checks are other guards.
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(liger_lab.mrope, backend=counter, fullgraph=True, dynamic=True)
    for seq_len in (5, 7):
        q, k = randn(2, 3, seq_len, 32).requires_grad_(), randn(2, 1, seq_len, 32).requires_grad_()
        cos, sin = position_streams(2, seq_len, 32)
        ours = compiled(q, k, cos, sin, [6, 5, 5], interleaved=True)
        for a, b in zip(ours, liger_lab.mrope(q, k, cos, sin, [6, 5, 5], interleaved=True), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        (ours[0].sum() + ours[1].sum()).backward()
    assert counter.frame_count == 1


def test_forward_and_backward_read_nothing_back(monkeypatch):
    """No value reaches the host on the GPU's path (the sections are Python ints, the checks are of shapes)."""
    monkeypatch.setattr(runtime, "HOST_READS_WAIT", True)
    q, k = randn(2, 3, 5, 16).requires_grad_(), randn(2, 1, 5, 16).requires_grad_()
    cos, sin = position_streams(2, 5, 16)
    with HostReads(monkeypatch) as reads:
        q_rot, k_rot = liger_lab.mrope(q, k, cos, sin, [4, 2, 2])
        (q_rot.sum() + k_rot.sum()).backward()
    assert reads.calls == []


# What transformers 5.24 computes: the text rotary embedding picks each pair's stream once per forward
# (``recomposition_frequencies``), then every attention layer calls plain ``apply_rotary_pos_emb``.


def _transformers_case(family: str, dtype: torch.dtype):
    """(transformers' rotation of q and k, ours, the leaves) with the family's own rotary embedding."""
    if family == "qwen2_5_vl":
        modeling = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig as Config

        rotary_class, section, interleaved = modeling.Qwen2_5_VLRotaryEmbedding, [4, 6, 6], False
    else:
        modeling = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig as Config

        rotary_class, section, interleaved = modeling.Qwen3VLTextRotaryEmbedding, [6, 5, 5], True
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    config = Config(
        hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=32, rope_parameters=rope_parameters
    )
    rotary = rotary_class(config).to(runtime.DEVICE)
    token, sequence = torch.arange(7, device=runtime.DEVICE), torch.arange(2, device=runtime.DEVICE)
    position_ids = torch.stack([token, token // 2, token % 3])[:, None] + sequence[:, None]  # (3, B, T)
    hidden = randn(2, 7, 96, dtype=dtype)
    cos, sin = rotary(hidden, position_ids)  # (B, T, D): the streams already picked
    # The three streams' tables as the rotary embedding computes them before it picks.
    freqs = position_ids[..., None].float() * rotary.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    streams = [(f(emb) * rotary.attention_scaling).to(dtype) for f in (torch.cos, torch.sin)]
    q = randn(2, 7, 3, 32, dtype=dtype).transpose(1, 2).requires_grad_()
    k = randn(2, 7, 1, 32, dtype=dtype).transpose(1, 2).requires_grad_()
    theirs = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    ours = liger_lab.mrope(q, k, *streams, section, interleaved=interleaved)
    return theirs, ours, (q, k)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_transformers(family, dtype):
    theirs, ours, leaves = _transformers_case(family, dtype)
    # fp16: transformers rounds q * cos, rotate_half(q) * sin and their sum to fp16, the kernel only the result.
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **tolerance)
    upstream = tuple(randn(*t.shape, dtype=dtype) for t in ours)
    for a, b in zip(torch.autograd.grad(ours, leaves, upstream), torch.autograd.grad(theirs, leaves, upstream),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, **tolerance)


def _inputs(q_shape=(2, 4, 5, 16), k_shape=(2, 2, 5, 16), cos_shape=(3, 1, 5, 16), sin_shape=None):
    return (randn(*q_shape), randn(*k_shape), randn(*cos_shape), randn(*(sin_shape or cos_shape)))


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: (*_inputs(), [4, 2, 1]), r"sums to 7: expected head_dim / 2 = 8"),
        (lambda: (*_inputs(), [4, 4]), "expected three non-negative ints"),
        (lambda: (*_inputs(), [4, -2, 6]), "expected three non-negative ints"),
        (lambda: (*_inputs(), [4.0, 2, 2]), "expected three non-negative ints"),
        (lambda: (*_inputs(), [True, 5, 2]), "expected three non-negative ints"),
        (lambda: (*_inputs(), torch.tensor([4, 2, 2])), "expected three non-negative ints"),
        (lambda: (*_inputs(cos_shape=(1, 5, 16)), [4, 2, 2]), r"one table per position stream"),
        (lambda: (*_inputs(cos_shape=(2, 1, 5, 16)), [4, 2, 2]), r"expected \(3, 2 or 1, 5, 16\)"),
        (lambda: (*_inputs(cos_shape=(3, 3, 5, 16)), [4, 2, 2]), r"expected \(3, 2 or 1, 5, 16\)"),
        (lambda: (*_inputs(cos_shape=(3, 1, 6, 16)), [4, 2, 2]), r"expected \(3, 2 or 1, 5, 16\)"),
        (lambda: (*_inputs(cos_shape=(3, 1, 5, 8)), [4, 2, 2]), r"expected \(3, 2 or 1, 5, 16\)"),
        (lambda: (*_inputs(sin_shape=(3, 2, 5, 16)), [4, 2, 2]), "one shape"),
        (lambda: (*_inputs((2, 4, 5, 15), (2, 2, 5, 15), (3, 1, 5, 15)), [4, 2, 1]), "even"),
        (lambda: (*_inputs(k_shape=(2, 2, 6, 16)), [4, 2, 2]), "same batch, seq_len and head_dim"),
        (lambda: (*_inputs(q_shape=(4, 5, 16)), [4, 2, 2]), "4-D"),
        (lambda: (randn(2, 4, 5, 16).double(), *_inputs()[1:], [4, 2, 2]), "torch.float64"),
        (lambda: (_inputs()[0], randn(2, 2, 5, 16).half(), *_inputs()[2:], [4, 2, 2]), "expected one dtype"),
        (lambda: (*_inputs()[:2], torch.ones(3, 1, 5, 16, dtype=torch.int32), *_inputs()[3:], [4, 2, 2]), "cos has"),
    ],
)
def test_bad_input_is_a_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        liger_lab.mrope(*make())


def test_options_it_does_not_support_are_value_errors():
    q, k, cos, sin = _inputs()
    with pytest.raises(ValueError, match="unsqueeze_dim is 2"):
        liger_lab.mrope(q, k, cos, sin, [4, 2, 2], unsqueeze_dim=2)
    with pytest.raises(ValueError, match="interleaved is 1"):
        liger_lab.mrope(q, k, cos, sin, [4, 2, 2], interleaved=1)
    # Interleaved, the width pairs 2, 5, 8 of 8 pairs run past the last one: the sections cannot hold.
    with pytest.raises(ValueError, match=r"3 \* 3 <= 8"):
        liger_lab.mrope(q, k, cos, sin, [3, 2, 3], interleaved=True)
    assert liger_lab.mrope(q, k, cos, sin, [3, 2, 3])[0].shape == q.shape  # one after another, they do


@pytest.mark.skipif(not runtime.INTERPRET, reason="only in the interpreter are CUDA tensors the wrong device")
def test_interpreter_rejects_non_cpu_tensors():
    q, k, cos, sin = _inputs()
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        liger_lab.mrope(q, k, cos.to("meta"), sin, [4, 2, 2])


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(2, 28, 4, 1024, 128), (1, 12, 2, 77, 128), (3, 16, 8, 1, 64)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_on_gpu(shape, layout):
    batch, q_heads, k_heads, seq_len, head_dim = shape
    cos, sin = (t.bfloat16() for t in position_streams(batch, seq_len, head_dim))
    q = randn(batch, seq_len, q_heads, head_dim, dtype=torch.bfloat16)
    k = randn(batch, seq_len, k_heads, head_dim, dtype=torch.bfloat16)
    section, transpose = sections(head_dim, LAYOUTS[layout]), lambda x: x.transpose(1, 2)
    assert check_qk(q, k, cos, sin, section, LAYOUTS[layout], layout=transpose)
