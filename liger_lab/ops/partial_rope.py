r"""Partial and interleaved RoPE: only the first R features of a head rotate, paired half-and-half or neighbour
with neighbour, by RoPE's kernel in one pass over q and k.

Three layouts of rotary position embedding that transformers' families use besides Llama's:

- **Partial** (Phi-3 and Phi-4 with ``partial_rotary_factor < 1``, Qwen3-Next, Qwen3.5, StableLM, GLM): cos and sin
  hold R < D features; the first R features of each head rotate as RoPE does (pairs (i, i + R/2)) and the last
  D - R pass through unchanged.
- **Interleaved** (GLM and GLM-4, whose ``rotate_half`` pairs neighbours): pairs (2i, 2i + 1), each feature with
  its own table entry, ``y = x * cos + rotate_pairs(x) * sin`` with ``rotate_pairs(x)[2i] = -x[2i+1]`` and
  ``rotate_pairs(x)[2i+1] = x[2i]``; partial too (GLM-4 rotates half of each head).
- **Llama 4's complex pairs**: Llama 4 views features (2i, 2i + 1) as one complex number and multiplies it by the
  pair's ``freqs_cis``: the interleaved layout with cos and sin the real and imaginary parts, each repeated for
  both features of its pair (:func:`tables_from_complex`).

For one pair (x_lo, x_hi) with table entries (c_lo, s_lo) and (c_hi, s_hi)::

    y_lo = x_lo * c_lo - x_hi * s_lo
    y_hi = x_hi * c_hi + x_lo * s_hi

RoPE's 2x2 map, whose backward is its transpose (the forward with (s_lo, s_hi) replaced by (-s_hi, -s_lo), see
liger_lab/ops/rope.py); the passed features have the identity as forward and backward.

The kernel is RoPE's (``_rope_kernel``) under two more constexprs: ``ADJACENT`` picks the pairing, ``PASS`` the
number of features copied after the rotated ones. Bytes: every q/k element is read once and written once, forward
and backward, as RoPE's. transformers' partial RoPE slices q and k, rotates the slices (a pass of its own per
multiply and add) and concatenates the untouched features back (``torch.cat``: another read and write of q and k);
the interleaved layout first builds ``repeat_interleave`` copies of the tables, and Llama 4's goes through complex
fp32 copies of q and k.

**Operators** (:func:`liger_lab.ops.operators.define`): ``liger_lab::partial_rope`` carries the autograd formula,
``liger_lab::partial_rope_backward`` rotates the gradients back (and copies the passed ones). Launch settings are
RoPE's (:func:`liger_lab.ops.rope.rope_tile` of R features).
"""

from __future__ import annotations

import torch

from liger_lab import reference
from liger_lab.ops import operators
from liger_lab.ops.rope import ROTATED, ROTATED_GRADS, check_rotation_inputs, rope_rotate


def _angle_grads(
    dq: torch.Tensor, dk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rotary_dim: int, interleaved: bool,
    angle_batch: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """d cos = sum over heads of dy * x, d sin = sum over heads of dy * rotate(x), over the rotated features
    (plain torch, fp32). Only for learned tables; Hugging Face's never require grad."""
    rotate = reference.rotate_adjacent_pairs if interleaved else reference.rotate_half
    dcos = dsin = 0
    for dy, x in ((dq, q), (dk, k)):
        dy, x = dy[..., :rotary_dim].float(), x[..., :rotary_dim].float()
        dcos = dcos + (dy * x).sum(1)
        dsin = dsin + (dy * rotate(x)).sum(1)
    if angle_batch == 1:
        dcos, dsin = dcos.sum(0, keepdim=True), dsin.sum(0, keepdim=True)
    return dcos, dsin


# --------------------------------------------------------------------------------------------------
# PyTorch operators, declared as RoPE's (liger_lab.ops.operators, see liger_lab/ops/rope.py).


def _partial_rope_into(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
    q_out: torch.Tensor, k_out: torch.Tensor,
) -> None:  # fmt: skip
    """q and k, their first cos.shape[-1] features rotated, in the promoted dtype of q and cos, in their layouts."""
    rope_rotate(q, k, cos, sin, q_out, k_out, backward=False, rotary_dim=cos.shape[-1], adjacent_pairs=interleaved)


def _partial_rope_backward_into(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
    qk_dtype: torch.dtype, dq: torch.Tensor, dk: torch.Tensor,
) -> None:  # fmt: skip
    """dq and dk: the transposed rotation of the output gradients (the passed features copied), in q's dtype."""
    rope_rotate(dq_out, dk_out, cos, sin, dq, dk, backward=True, rotary_dim=cos.shape[-1], adjacent_pairs=interleaved)


PARTIAL_ROPE_BACKWARD = operators.define(
    "partial_rope_backward",
    _partial_rope_backward_into,
    outputs=ROTATED_GRADS,
)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, interleaved = inputs
    ctx.angle_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, *((q, k) if ctx.angle_grad else ()))
    ctx.qk_dtype, ctx.interleaved = q.dtype, interleaved


def _backward(ctx, dq_out, dk_out):
    cos, sin, *qk = ctx.saved_tensors
    dq, dk = PARTIAL_ROPE_BACKWARD(dq_out, dk_out, cos, sin, ctx.interleaved, ctx.qk_dtype)
    if not ctx.angle_grad:
        return dq, dk, None, None, None
    dcos, dsin = _angle_grads(dq_out, dk_out, *qk, cos.shape[-1], ctx.interleaved, cos.shape[0])
    return dq, dk, dcos.to(cos.dtype), dsin.to(sin.dtype), None


PARTIAL_ROPE = operators.define(
    "partial_rope",
    _partial_rope_into,
    outputs=ROTATED,
    setup_context=_setup_context,
    backward=_backward,
)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: object) -> None:
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved is {interleaved!r}: expected True or False")
    head_dim = check_rotation_inputs(q, k, cos, sin, whole_head=False)
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2 == 1 or rotary_dim < 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos and sin have {rotary_dim} features: expected an even rotary_dim from 2 to head_dim = {head_dim} "
            "(RoPE rotates pairs of the first rotary_dim features)"
        )


def partial_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of the first ``R = cos.shape[-1]`` features of each head; the rest pass through.

    q (B, Hq, T, D) and k (B, Hk, T, D) with any strides; cos, sin (B or 1, T, R), R even and at most D, one entry
    per rotated feature. ``interleaved=False`` pairs features (i, i + R/2) as Hugging Face's ``rotate_half``
    (Phi-3's and Qwen3-Next's partial RoPE); ``interleaved=True`` pairs (2i, 2i + 1) (GLM-4; Llama 4 with the
    tables of :func:`tables_from_complex`). Returns ``cat(x[..., :R] * cos + rotate(x[..., :R]) * sin,
    x[..., R:])`` for x = q and k, in the dtype that expression gives and in q's and k's memory layout, from one
    kernel launch forward and one backward.
    """
    _check_inputs(q, k, cos, sin, interleaved)
    return PARTIAL_ROPE(q, k, cos, sin, interleaved)


def tables_from_complex(freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's ``freqs_cis`` (B or 1, T, D/2), complex, as the interleaved layout's cos and sin (B or 1, T, D):
    each pair's real and imaginary part, once for each of its two features."""
    return freqs_cis.real.repeat_interleave(2, dim=-1), freqs_cis.imag.repeat_interleave(2, dim=-1)
