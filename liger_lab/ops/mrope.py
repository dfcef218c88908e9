r"""Multimodal RoPE (M-RoPE) of Qwen2-VL, Qwen2.5-VL and Qwen3-VL: RoPE whose angles come from three position streams.

A vision-language model gives every token three positions: temporal, height and width (an image patch's frame,
row and column; a text token has the same value in all three). The D/2 feature pairs of a head, pair i being
features i and i + D/2 with frequency theta_i, are shared out among the streams by ``mrope_section = (S_t, S_h,
S_w)``, S_t + S_h + S_w = D/2 (Qwen2-VL's (16, 24, 24) for D = 128): pair i rotates by ``p[s(i)] * theta_i``,
the position of its stream s(i) times its frequency. Two layouts of s::

    one section after another (Qwen2-VL, Qwen2.5-VL):  s(i) = t for i < S_t, h for i < S_t + S_h, w after
    interleaved (Qwen3-VL):  s(i) = h if i % 3 == 1 and i < 3 S_h, w if i % 3 == 2 and i < 3 S_w, else t

cos and sin arrive as (3, B or 1, T, D): one Hugging Face RoPE table per stream (angles repeated over both
halves). With every pair's c = cos[s(i)] and s = sin[s(i)] picked that way, the op is RoPE (liger_lab/ops/rope.py)
on the halves x1 = x[:D/2], x2 = x[D/2:]::

    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2

and its backward the transpose of each pair's 2x2 map, ``dx1 = dy1 * c1 + dy2 * s2``, ``dx2 = dy2 * c2 - dy1 * s1``:
with Hugging Face's tables (equal halves) the rotation by -theta.

The kernel is RoPE's, generalised rather than copied: under its constexpr ``MROPE`` (1: one section after another,
2: interleaved) each feature's table address moves by ``s(i) * cos.stride(0)``. The stream is a function of the
feature index alone, a few integer operations per column; no load is added, and q, k and the launch settings are
handled exactly as RoPE's (any strides, q and k in one launch, forward and backward).

Bytes: as RoPE's, every q/k element is read once and written once (forward 4 bytes an element in bf16, forward +
backward 8), and each row reads D entries of each table, from the streams its pairs pick, after the first use
from L2. Picking the streams first, as transformers 4.x's ``apply_multimodal_rotary_pos_emb`` does in every layer
(each table split into six chunks and the picked ones concatenated), writes and reads again a (B, T, D) copy of
both tables before the rotation's own passes over q and k.

Where it applies: in transformers 5.24 the text rotary embedding of these families picks the streams itself, once
per forward (``recomposition_frequencies``), and every attention layer calls plain ``apply_rotary_pos_emb`` with
(B, T, D) tables, which :func:`liger_lab.rope` computes as it stands. This op serves code that hands the three
streams to every layer, as 4.x's ``apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section,
unsqueeze_dim=1)`` did; it takes that signature.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from liger_lab.ops import operators
from liger_lab.ops.common import check_float, check_same_shape, same_shape
from liger_lab.ops.rope import ROTATED, ROTATED_GRADS, _angle_grads, rope_rotate
from liger_lab.ops.rope import _check_inputs as _check_rope_inputs

# The forward and backward kernels and their launcher are RoPE's: ``_rope_kernel`` under ``MROPE``, launched by
# ``rope_rotate(..., mrope_section=..., interleaved=...)``.


def _pair_streams(mrope_section: Sequence[int], interleaved: bool, device: torch.device) -> torch.Tensor:
    """The position stream (0 temporal, 1 height, 2 width) of every feature pair, as the kernel picks it."""
    _, height, width = mrope_section
    pairs = sum(mrope_section)
    pair = torch.arange(pairs, device=device)
    if interleaved:
        return ((pair % 3 == 1) & (pair < 3 * height)).long() + 2 * ((pair % 3 == 2) & (pair < 3 * width)).long()
    return (pair >= pairs - height - width).long() + (pair >= pairs - width).long()


# --------------------------------------------------------------------------------------------------
# PyTorch operators, declared as RoPE's (liger_lab.ops.operators, see liger_lab/ops/rope.py): what torch.compile sees
# instead of the launcher.


def _mrope_into(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: list[int],
    interleaved: bool, q_out: torch.Tensor, k_out: torch.Tensor,
) -> None:  # fmt: skip
    """q and k rotated, in the promoted dtype of q and cos, in q's and k's memory layouts."""
    rope_rotate(q, k, cos, sin, q_out, k_out, backward=False, mrope_section=tuple(mrope_section),
                interleaved=interleaved)  # fmt: skip


def _mrope_backward_into(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: list[int],
    interleaved: bool, qk_dtype: torch.dtype, dq: torch.Tensor, dk: torch.Tensor,
) -> None:  # fmt: skip
    """dq and dk: the transposed rotation of the output gradients, in q's dtype."""
    rope_rotate(dq_out, dk_out, cos, sin, dq, dk, backward=True, mrope_section=tuple(mrope_section),
                interleaved=interleaved)  # fmt: skip


MROPE_BACKWARD = operators.define(
    "mrope_backward",
    _mrope_backward_into,
    outputs=ROTATED_GRADS,
)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, mrope_section, interleaved = inputs
    ctx.angle_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.angle_grad else ()))
    ctx.qk_dtype, ctx.mrope_section, ctx.interleaved = q.dtype, mrope_section, interleaved


def _backward(ctx, dq_out, dk_out):
    cos, sin, *qk = ctx.saved_tensors
    dq, dk = MROPE_BACKWARD(dq_out, dk_out, cos, sin, ctx.mrope_section, ctx.interleaved, ctx.qk_dtype)
    if not ctx.angle_grad:
        return dq, dk, None, None, None, None
    # Learned tables (Hugging Face's never require grad): RoPE's table gradient, each feature's sent to the stream
    # that feature read, zero in the other two.
    streams = _pair_streams(ctx.mrope_section, ctx.interleaved, cos.device).repeat(2)
    read = streams == torch.arange(3, device=cos.device)[:, None, None, None]
    dcos, dsin = (torch.where(read, grad, 0) for grad in _angle_grads(dq_out, dk_out, *qk, cos.shape[1]))
    return dq, dk, dcos.to(cos.dtype), dsin.to(sin.dtype), None, None


MROPE = operators.define(
    "mrope",
    _mrope_into,
    outputs=ROTATED,
    setup_context=_setup_context,
    backward=_backward,
)


def _check_sections(mrope_section: object, head_dim: int, interleaved: object) -> None:
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved is {interleaved!r}: expected True or False")
    # SymInt: under torch.compile(dynamic=True) the sections are symbolic, and stay so (no value is formatted).
    is_count = lambda s: isinstance(s, (int, torch.SymInt)) and not isinstance(s, bool) and s >= 0
    if not isinstance(mrope_section, (list, tuple)) or len(mrope_section) != 3 or not all(map(is_count, mrope_section)):
        raise ValueError(
            f"mrope_section is {mrope_section!r}: expected three non-negative ints, the feature pairs of the "
            "temporal, height and width position streams"
        )
    pairs = head_dim // 2
    if sum(mrope_section) != pairs:
        raise ValueError(
            f"mrope_section {list(mrope_section)} sums to {sum(mrope_section)}: expected head_dim / 2 = {pairs}, "
            "every feature pair in one section"
        )
    _, height, width = mrope_section
    if interleaved and (3 * height > pairs + 1 or 3 * width > pairs):
        raise ValueError(
            f"mrope_section {list(mrope_section)} with interleaved=True: the height pairs (1, 4, 7, ...) and the "
            f"width pairs (2, 5, 8, ...) must fit in head_dim / 2 = {pairs} pairs, i.e. 3 * {height} <= {pairs + 1} "
            f"and 3 * {width} <= {pairs}"
        )


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: object, interleaved: object
) -> None:
    for name, tensor in (("q", q), ("cos", cos), ("sin", sin)):
        check_float(name, tensor)
    check_same_shape(cos=cos, sin=sin)
    tables_ok = cos.dim() == 4 and cos.shape[0] == 3
    if tables_ok and q.dim() == 4:  # a q of another rank is named by RoPE's check below
        batch, _, seq_len, head_dim = q.shape
        # Sizes compared with ==, no membership test (see common.same_shape): under torch.compile they are symbolic.
        tables_ok = (cos.shape[1] == 1 or cos.shape[1] == batch) and same_shape(cos.shape[2:], (seq_len, head_dim))
    if not tables_ok:  # only here are sizes formatted: that pins a symbolic size to its value (a graph per size)
        expected = "(3, batch or 1, seq_len, head_dim)"
        if q.dim() == 4:
            batch, _, seq_len, head_dim = q.shape
            expected = f"(3, {batch} or 1, {seq_len}, {head_dim}) = {expected} to match q"
        raise ValueError(
            f"cos and sin have shape {tuple(cos.shape)}: expected {expected}, one table per position stream "
            "(temporal, height, width)"
        )
    _check_rope_inputs(q, k, cos[0], sin[0])  # q and k, dtypes and devices, as RoPE's
    _check_sections(mrope_section, q.shape[-1], interleaved)


def mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int],
    *,
    unsqueeze_dim: int = 1,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary position embedding of queries and keys (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

    q (B, Hq, T, D) and k (B, Hk, T, D) with any strides (Hq != Hk for grouped-query attention); cos, sin
    (3, B or 1, T, D), one Hugging Face RoPE table per position stream (temporal, height, width); ``mrope_section``
    the number of feature pairs each stream rotates, summing to D/2: one section after another (Qwen2-VL,
    Qwen2.5-VL), or with ``interleaved=True`` every third pair (Qwen3-VL's layout). Returns what transformers 4.x's
    ``apply_multimodal_rotary_pos_emb(q, k, cos, sin, mrope_section)`` returns, in the dtype the PyTorch
    expression gives and in q's and k's memory layout, from one kernel launch forward and one backward. Only
    ``unsqueeze_dim=1`` (heads before positions) is supported, as in :func:`liger_lab.ops.rope.apply_rotary_pos_emb`.
    """
    if unsqueeze_dim != 1:
        raise ValueError(
            f"unsqueeze_dim is {unsqueeze_dim}: expected 1, q and k laid out as (batch, heads, seq_len, head_dim)"
        )
    _check_inputs(q, k, cos, sin, mrope_section, interleaved)
    return MROPE(q, k, cos, sin, list(mrope_section), interleaved)
