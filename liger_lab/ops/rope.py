r"""Rotary position embedding (RoPE), Hugging Face ``rotate_half`` convention, q and k in one launch.

For one head vector :math:`x \in \mathbb{R}^D` at position t, split into halves ``x1 = x[:D/2]``,
``x2 = x[D/2:]`` (and cos, sin likewise into c1, c2, s1, s2)::

    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2          # i.e. y = x * cos + rotate_half(x) * sin

Each pair (x1[i], x2[i]) is a 2x2 linear map ``[[c1, -s1], [s2, c2]]``; the backward applies its transpose
``[[c1, s2], [-s1, c2]]`` (derivation in solutions/03_rope.ipynb)::

    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1

which is the forward with (s1, s2) replaced by (-s2, -s1): with Hugging Face's cos/sin (equal halves) it is
the rotation by -angle. One kernel serves both directions.

Bytes: every q/k element is read once and written once (forward 4 bytes per element in bf16, forward +
backward 8). The kernel sees q and k as rows, one head of one position each (head_dim elements), and each
program rotates a run of consecutive rows in the order they lie in memory: (batch, head, position) for a
contiguous (B, H, T, D) tensor, (batch, position, head) for the transposed ``(B, T, H, D) -> (B, H, T, D)`` views
Hugging Face hands over. So a program streams one contiguous stretch of q or k, as a copy would, and reads the
cos/sin row of each position it meets; the tables are a few MiB, read from L2 after their first use, so they cost
L2 traffic, not HBM bytes. That holds while a batch row's tables fit in L2 (50 MiB on an H200; T * D * 4 bytes in
bf16, 64 MiB at 131072 positions of 128): past that, a contiguous (B, H, T, D) q, whose rows walk all positions
of one head before the next, would fetch the tables from HBM again for every head. Hugging Face's transposed
views walk the heads of one position together and reuse each table row at once. q and k are read through their
strides (copying a transposed view to contiguous memory first would double the bytes), and outputs keep the
memory layout of their inputs.

**Operators** (:func:`liger_lab.ops.operators.define`): ``liger_lab::rope`` carries the autograd formula,
``liger_lab::rope_backward`` rotates the gradients back; multimodal RoPE (liger_lab/ops/mrope.py) declares its own
two the same way around the same kernel. Launch settings: :func:`rope_tile`, whose defaults and their measurement
are in benchmarks/notes/rope.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from liger_lab import reference, runtime
from liger_lab.formulas import rotate_half
from liger_lab.ops import operators
from liger_lab.ops.common import check_float, check_same_dtype, check_same_shape, same_shape

# Half-row elements (rows x head_dim / 2) per program on the GPU, and a warp per _GPU_WARP_ELEMENTS of them:
# 16 rows of head_dim 128 under 2 warps measured fastest on an H200, at the speed of torch's copy of the same
# bytes (benchmarks/notes/rope.md). The interpreter pays per program, not per element: few big programs.
_GPU_PROGRAM_ELEMENTS = 1024
_GPU_WARP_ELEMENTS = 512
_CPU_PROGRAM_ELEMENTS = 65536


@triton.jit
def _position_stream(cols, section_h, section_w, HALF: tl.constexpr, MROPE: tl.constexpr):
    """Multimodal RoPE: the position stream (0 temporal, 1 height, 2 width) that rotates each feature pair."""
    if MROPE == 1:  # sections one after another (Qwen2-VL): temporal pairs, then height, then width
        stream = (cols >= HALF - section_h - section_w).to(tl.int64) + (cols >= HALF - section_w).to(tl.int64)
    else:  # interleaved (Qwen3-VL): t h w t h w ..., temporal wherever the height or width pairs have run out
        height = (cols % 3 == 1) & (cols < 3 * section_h)
        width = (cols % 3 == 2) & (cols < 3 * section_w)
        stream = height.to(tl.int64) + 2 * width.to(tl.int64)
    return stream


@triton.jit
def _rotate_rows(
    x_ptr, x_batch_stride, x_head_stride, x_seq_stride, x_dim_stride,
    y_ptr, y_batch_stride, y_head_stride, y_seq_stride, y_dim_stride,
    cos_ptr, cos_stream_stride, cos_batch_stride, cos_seq_stride, cos_dim_stride,
    sin_ptr, sin_stream_stride, sin_batch_stride, sin_seq_stride, sin_dim_stride,
    first_row, n_rows, n_heads, seq_len, section_h, section_w,
    BACKWARD: tl.constexpr, HEADS_INNER: tl.constexpr, HALF: tl.constexpr, MROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, ADJACENT: tl.constexpr, PASS: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Rotate rows [first_row, first_row + BLOCK_R) of one tensor (q or k), rows counted in memory order.

    HALF pairs rotate: features (i, i + HALF) (``rotate_half``), or (2i, 2i + 1) under ``ADJACENT``; the PASS
    features after the 2 * HALF rotated ones (partial RoPE) are copied through, in the same pass."""
    rows = first_row + tl.arange(0, BLOCK_R)
    if HEADS_INNER:  # (B, T, H, D) memory: the heads of a position are neighbours
        head, pos = rows % n_heads, (rows // n_heads) % seq_len
    else:  # (B, H, T, D) memory: the positions of a head are neighbours
        head, pos = (rows // seq_len) % n_heads, rows % seq_len
    batch = (rows // (n_heads * seq_len)).to(tl.int64)[:, None]
    head, pos = head.to(tl.int64)[:, None], pos.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < n_rows)[:, None] & (cols < HALF)

    if ADJACENT:  # pairs (2i, 2i + 1): GLM-4's interleaved RoPE, Llama 4's complex numbers
        lo = 2 * cols
        partner = 1
    else:  # pairs (i, i + HALF): rotate_half
        lo = cols
        partner = HALF

    cos_lo = cos_ptr + batch * cos_batch_stride + pos * cos_seq_stride + lo * cos_dim_stride
    sin_lo = sin_ptr + batch * sin_batch_stride + pos * sin_seq_stride + lo * sin_dim_stride
    if MROPE != 0:  # multimodal RoPE: each feature pair takes its angle from its section's position stream
        stream = _position_stream(cols, section_h, section_w, HALF, MROPE)
        cos_lo += stream * cos_stream_stride
        sin_lo += stream * sin_stream_stride
    c1 = tl.load(cos_lo, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_lo + partner * cos_dim_stride, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_lo, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_lo + partner * sin_dim_stride, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # The transpose of [[c1, -s1], [s2, c2]] is [[c1, s2], [-s1, c2]]: the forward with (-s2, -s1).
        s1, s2 = -s2, -s1

    x_row = x_ptr + batch * x_batch_stride + head * x_head_stride + pos * x_seq_stride
    y_row = y_ptr + batch * y_batch_stride + head * y_head_stride + pos * y_seq_stride
    x_lo, y_lo = x_row + lo * x_dim_stride, y_row + lo * y_dim_stride
    x1 = tl.load(x_lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_lo + partner * x_dim_stride, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_lo, (x1 * c1 - x2 * s1).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_lo + partner * y_dim_stride, (x2 * c2 + x1 * s2).to(y_ptr.dtype.element_ty), mask=mask)
    if PASS > 0:  # partial RoPE: the features after the rotated ones are the identity (forward and backward)
        rest = 2 * HALF + tl.arange(0, BLOCK_P)[None, :]
        rest_mask = (rows < n_rows)[:, None] & (rest < 2 * HALF + PASS)
        kept = tl.load(x_row + rest * x_dim_stride, mask=rest_mask, other=0.0).to(tl.float32)
        tl.store(y_row + rest * y_dim_stride, kept.to(y_ptr.dtype.element_ty), mask=rest_mask)


@triton.jit
def _rope_kernel(
    q_ptr,  # the inputs, (B, H, T, D) through their strides
    q_batch_stride,
    q_head_stride,
    q_seq_stride,
    q_dim_stride,
    k_ptr,
    k_batch_stride,
    k_head_stride,
    k_seq_stride,
    k_dim_stride,
    qo_ptr,  # the outputs, likewise
    qo_batch_stride,
    qo_head_stride,
    qo_seq_stride,
    qo_dim_stride,
    ko_ptr,
    ko_batch_stride,
    ko_head_stride,
    ko_seq_stride,
    ko_dim_stride,
    cos_ptr,  # the tables (stream 0 unless MROPE)
    cos_stream_stride,
    cos_batch_stride,
    cos_seq_stride,
    cos_dim_stride,
    sin_ptr,
    sin_stream_stride,
    sin_batch_stride,
    sin_seq_stride,
    sin_dim_stride,
    batch,  # q's and k's sizes
    seq_len,
    n_q_heads,
    n_k_heads,
    section_h,  # multimodal RoPE's height and width pairs
    section_w,
    BACKWARD: tl.constexpr,  # rotate by the transpose (the backward)
    HEADS_INNER: tl.constexpr,  # rows in (B, T, H, D) memory order
    HALF: tl.constexpr,  # rotated pairs per row
    MROPE: tl.constexpr,  # 0 RoPE, 1 mRoPE sections in a row, 2 interleaved
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # HALF padded to a power of 2
    ADJACENT: tl.constexpr,  # pairs (2i, 2i + 1) instead of (i, i + HALF)
    PASS: tl.constexpr,  # features copied through after the rotated ones
    BLOCK_P: tl.constexpr,  # PASS padded to a power of 2
):
    # The first programs take q's rows, the rest k's: one launch for both.
    program = tl.program_id(0)
    n_q_rows, n_k_rows = batch * n_q_heads * seq_len, batch * n_k_heads * seq_len
    q_programs = tl.cdiv(n_q_rows, BLOCK_R)
    if program < q_programs:
        _rotate_rows(
            q_ptr, q_batch_stride, q_head_stride, q_seq_stride, q_dim_stride,
            qo_ptr, qo_batch_stride, qo_head_stride, qo_seq_stride, qo_dim_stride,
            cos_ptr, cos_stream_stride, cos_batch_stride, cos_seq_stride, cos_dim_stride,
            sin_ptr, sin_stream_stride, sin_batch_stride, sin_seq_stride, sin_dim_stride,
            program * BLOCK_R, n_q_rows, n_q_heads, seq_len, section_h, section_w, BACKWARD, HEADS_INNER, HALF, MROPE,
            BLOCK_R, BLOCK_D, ADJACENT, PASS, BLOCK_P,
        )  # fmt: skip
    else:
        _rotate_rows(
            k_ptr, k_batch_stride, k_head_stride, k_seq_stride, k_dim_stride,
            ko_ptr, ko_batch_stride, ko_head_stride, ko_seq_stride, ko_dim_stride,
            cos_ptr, cos_stream_stride, cos_batch_stride, cos_seq_stride, cos_dim_stride,
            sin_ptr, sin_stream_stride, sin_batch_stride, sin_seq_stride, sin_dim_stride,
            (program - q_programs) * BLOCK_R, n_k_rows, n_k_heads, seq_len, section_h, section_w, BACKWARD,
            HEADS_INNER, HALF, MROPE, BLOCK_R, BLOCK_D, ADJACENT, PASS, BLOCK_P,
        )  # fmt: skip


@dataclass(frozen=True)
class RopeTile:
    """How the RoPE kernel splits q and k: ``block_r`` rows (one head of one position each) a program, each half-row
    padded to ``block_d``, under ``num_warps``."""

    block_r: int
    block_d: int
    num_warps: int


@functools.lru_cache(maxsize=256)
def rope_tile(head_dim: int, *, block_r: int | None = None, num_warps: int | None = None) -> RopeTile:
    """Launch settings for rows of ``head_dim`` (kept per head size: every call asks); the keyword arguments override
    the defaults (tuning sweeps, tests)."""
    block_d = runtime.next_power_of_2(max(head_dim // 2, 1))
    if block_r is None:
        block_r = max(1, runtime.pick(cpu=_CPU_PROGRAM_ELEMENTS, gpu=_GPU_PROGRAM_ELEMENTS) // block_d)
    block_r = runtime.next_power_of_2(block_r)
    if num_warps is None:
        num_warps = runtime.pick(cpu=1, gpu=max(1, min(8, block_r * block_d // _GPU_WARP_ELEMENTS)))
    return RopeTile(block_r, block_d, num_warps)


def _strides4(x: torch.Tensor) -> tuple[int, int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2), x.stride(3)


def _angle_strides(angle: torch.Tensor) -> tuple[int, int, int, int]:
    # (stream, batch, position, feature): a (B or 1, T, D) table is one stream, multimodal RoPE's (3, B or 1, T, D)
    # three. A table of batch 1 is shared by the whole batch: stride 0 along batch broadcasts it.
    stream_stride, table = (angle.stride(0), angle[0]) if angle.dim() == 4 else (0, angle)
    return stream_stride, (table.stride(0) if table.shape[0] > 1 else 0), table.stride(1), table.stride(2)


def rope_rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    *,
    backward: bool,
    tile: RopeTile | None = None,
    mrope_section: tuple[int, int, int] | None = None,
    interleaved: bool = False,
    rotary_dim: int | None = None,
    adjacent_pairs: bool = False,
) -> None:
    """One launch: q_out, k_out = rotation of q, k (``backward=True``: its transpose). Any strides.

    With ``mrope_section`` (temporal, height, width feature pairs), cos and sin are multimodal RoPE's three position
    streams, (3, B or 1, T, D), and the sections pick the stream of each pair: one after another, or ``interleaved``
    (see liger_lab/ops/mrope.py). With ``rotary_dim`` R < D (partial RoPE, liger_lab/ops/partial_rope.py) the first R
    features rotate, by tables of R features, and the others are copied; ``adjacent_pairs`` pairs features (2i, 2i+1)
    instead of (i, i + R/2).
    """
    batch, q_heads, seq_len, head_dim = q.shape
    k_heads = k.shape[1]
    if batch == 0 or seq_len == 0 or q_heads + k_heads == 0:
        return
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    kept = head_dim - rotary_dim
    tile = tile or rope_tile(rotary_dim)
    # One row order for both tensors, q's memory order (any order is correct; memory order streams).
    heads_inner = q.stride(1) < q.stride(2)
    mrope = 0 if mrope_section is None else 2 if interleaved else 1
    _, section_h, section_w = mrope_section or (0, 0, 0)
    grid = runtime.cdiv(batch * q_heads * seq_len, tile.block_r) + runtime.cdiv(batch * k_heads * seq_len, tile.block_r)
    runtime.launch_kernel(_rope_kernel, (grid,),
        q, *_strides4(q), k, *_strides4(k), q_out, *_strides4(q_out), k_out, *_strides4(k_out),
        cos, *_angle_strides(cos), sin, *_angle_strides(sin), batch, seq_len, q_heads, k_heads, section_h, section_w,
        BACKWARD=backward, HEADS_INNER=heads_inner, HALF=rotary_dim // 2, MROPE=mrope, BLOCK_R=tile.block_r,
        BLOCK_D=tile.block_d, ADJACENT=adjacent_pairs, PASS=kept, BLOCK_P=runtime.next_power_of_2(max(kept, 1)),
        num_warps=tile.num_warps,
    )  # fmt: skip


def _angle_grads(
    dq: torch.Tensor, dk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, angle_batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """d cos = sum over heads of dy * x; d sin = sum over heads of dy * rotate_half(x) (plain torch, fp32).

    Only for the rare cos/sin that require grad (learned frequencies); Hugging Face's never do.
    """
    dcos = dsin = 0
    for dy, x in ((dq, q), (dk, k)):
        dy, x = dy.float(), x.float()
        dcos = dcos + (dy * x).sum(1)
        dsin = dsin + (dy * rotate_half(x)).sum(1)
    if angle_batch == 1:
        dcos, dsin = dcos.sum(0, keepdim=True), dsin.sum(0, keepdim=True)
    return dcos, dsin


# --------------------------------------------------------------------------------------------------
# PyTorch operators (liger_lab.ops.operators, as in liger_lab/ops/rms_norm.py): what torch.compile sees instead of
# the launcher.


def rotated_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The buffer a rotation of ``x`` is written into: ``empty_like`` keeps a dense input's strides, so a transposed
    (B, T, H, D) view stays that layout."""
    return torch.empty_like(x, dtype=dtype)


ROTATED = {
    "q_out": lambda q, cos: rotated_like(q, torch.promote_types(q.dtype, cos.dtype)),
    "k_out": lambda q, k, cos: rotated_like(k, torch.promote_types(q.dtype, cos.dtype)),
}
"""The outputs of every rotation operator (this one, mRoPE's, partial RoPE's), read by name from their arguments
``q``, ``k``, ``cos``: q and k rotated, in the dtype q and the tables promote to."""
ROTATED_GRADS = {
    "dq": lambda dq_out, qk_dtype: rotated_like(dq_out, qk_dtype),
    "dk": lambda dk_out, qk_dtype: rotated_like(dk_out, qk_dtype),
}
"""The outputs of every rotation's backward operator: dq and dk in q's dtype (``qk_dtype``)."""


def _rope_into(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor
) -> None:
    """q and k rotated, in the promoted dtype of q and cos, in q's and k's memory layouts."""
    rope_rotate(q, k, cos, sin, q_out, k_out, backward=False)


def _rope_backward_into(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_dtype: torch.dtype,
    dq: torch.Tensor, dk: torch.Tensor,
) -> None:  # fmt: skip
    """dq and dk: the transposed rotation of the output gradients, in q's dtype."""
    rope_rotate(dq_out, dk_out, cos, sin, dq, dk, backward=True)


ROPE_BACKWARD = operators.define(
    "rope_backward",
    _rope_backward_into,
    outputs=ROTATED_GRADS,
)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin = inputs
    ctx.angle_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.angle_grad else ()))
    ctx.qk_dtype = q.dtype


def _backward(ctx, dq_out, dk_out):
    cos, sin, *qk = ctx.saved_tensors
    dq, dk = ROPE_BACKWARD(dq_out, dk_out, cos, sin, ctx.qk_dtype)
    if not ctx.angle_grad:
        return dq, dk, None, None
    dcos, dsin = _angle_grads(dq_out, dk_out, *qk, cos.shape[0])
    return dq, dk, dcos.to(cos.dtype), dsin.to(sin.dtype)


ROPE = operators.define(
    "rope",
    _rope_into,
    outputs=ROTATED,
    setup_context=_setup_context,
    backward=_backward,
)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    head_dim = check_rotation_inputs(q, k, cos, sin, whole_head=True)
    if head_dim % 2:
        raise ValueError(f"head_dim is {head_dim}: expected an even number (RoPE rotates pairs of features)")


def check_rotation_inputs(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, whole_head: bool
) -> int:
    """What every rotation (RoPE, partial RoPE) asks of its inputs, a ``ValueError`` otherwise: float q and k of
    shape (batch, heads, seq_len, head_dim) that differ only in heads, one dtype each for q and k and for the
    tables, cos and sin of one shape (batch or 1, seq_len, features), one device. ``whole_head``: the tables have
    head_dim features (RoPE); otherwise how many (partial RoPE's rotary_dim) is the caller's to check. Returns
    head_dim."""
    for name, tensor in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, tensor)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q has shape {tuple(q.shape)} and k {tuple(k.shape)}: expected 4-D (batch, heads, seq_len, head_dim)"
        )
    batch, _, seq_len, head_dim = q.shape
    if k.shape[0] != batch or not same_shape(k.shape[2:], q.shape[2:]):
        raise ValueError(
            f"q has shape {tuple(q.shape)} and k {tuple(k.shape)}: expected the same batch, seq_len and head_dim "
            "(only the number of heads may differ)"
        )
    if head_dim > runtime.MAX_ROW_SIZE:
        raise ValueError(f"head_dim is {head_dim}: expected at most {runtime.MAX_ROW_SIZE}")
    check_same_dtype(q=q, k=k)
    check_same_dtype(cos=cos, sin=sin)
    check_same_shape(cos=cos, sin=sin)
    # Sizes compared with ==, no membership test (see common.same_shape): under torch.compile they are symbolic.
    angle_batch_ok = cos.dim() == 3 and (cos.shape[0] == 1 or cos.shape[0] == batch)
    features, name = (head_dim, "head_dim") if whole_head else (None, "rotary_dim")
    expected = (seq_len,) if features is None else (seq_len, features)
    if not angle_batch_ok or not same_shape(cos.shape[1 : 1 + len(expected)], expected):
        raise ValueError(
            f"cos and sin have shape {tuple(cos.shape)}: expected ({batch} or 1, {seq_len}, {features or name}) = "
            f"(batch or 1, seq_len, {name}) to match q"
        )
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) > 1:
        raise ValueError(f"q, k, cos and sin are on {sorted(map(str, devices))}: expected one device")
    return head_dim


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of queries and keys, Hugging Face ``rotate_half`` convention.

    q (B, Hq, T, D) and k (B, Hk, T, D) with any strides (Hq != Hk for grouped-query attention); cos, sin
    (B or 1, T, D), shared by all heads. Returns ``(q * cos + rotate_half(q) * sin, k * cos + ...)`` in the
    dtype the PyTorch expression returns (q's dtype when cos has it too) and in q's and k's memory layout.
    q and k are rotated in one kernel launch, forward and backward.
    """
    _check_inputs(q, k, cos, sin)
    if operators.lowered("rope"):
        return reference.rope(q, k, cos, sin)
    return ROPE(q, k, cos, sin)


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb``.

    Llama's attention calls it as ``apply_rotary_pos_emb(q, k, cos, sin)`` with q, k (B, H, T, D) and
    cos, sin (B, T, D) already gathered at the token positions; ``position_ids`` is accepted for older
    callers and unused, as in transformers 4.x. Only ``unsqueeze_dim=1`` (heads before positions) is
    supported.
    """
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise ValueError(f"position_ids is {position_ids!r}: expected a tensor or None (pass unsqueeze_dim by keyword)")
    if unsqueeze_dim != 1:
        raise ValueError(
            f"unsqueeze_dim is {unsqueeze_dim}: expected 1, q and k laid out as (batch, heads, seq_len, head_dim)"
        )
    return rope(q, k, cos, sin)
