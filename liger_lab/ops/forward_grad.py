"""The gradient a loss makes in its forward pass: kept, scaled in the backward, never differentiated again.

Cross-entropy, JSD and every fused linear loss write d(loss)/d(input) while computing the loss, because the
logits they would need again in the backward are gone (or overwritten by it). The backward then only multiplies
that gradient by the upstream one: :func:`save_gradient` keeps it, :func:`scaled_gradient` scales it in place
through ``liger_lab::scale_rows_`` (one streaming pass, skipped on the GPU when the scale is exactly 1), and
``liger_lab::scale_rows`` scales a float32 accumulator into the weight's dtype. A saved gradient is a constant to
autograd, so :func:`refuse_second_derivative` makes a second derivative a clear error instead of a silent zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from liger_lab import runtime
from liger_lab.ops import operators
from liger_lab.ops.common import rows_to_overwrite


@triton.jit
def _scale_rows_kernel(
    x_ptr, x_row_stride, out_ptr, out_row_stride, scale_ptr, scale_stride, n_rows, n_cols,
    IN_PLACE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[r, :] = x[r, :] * scale[r * scale_stride] (scale_stride 0: one scalar for every row)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    scale = tl.load(scale_ptr + rows * scale_stride, mask=row_mask, other=1.0).to(tl.float32)
    # Scaling in place by exactly 1 (a plain loss.backward()) changes nothing: skip the whole pass,
    # decided on the GPU so the host never waits to read the upstream gradient.
    work = tl.sum((scale != 1.0).to(tl.int32), axis=0)
    if not IN_PLACE:
        work += 1
    if work > 0:
        rows64 = rows.to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK_N)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_mask[:, None] & ((start + cols) < n_cols)[None, :]
            x = tl.load(x_ptr + rows64 * x_row_stride + (start + cols)[None, :], mask=mask, other=0.0)
            y = x.to(tl.float32) * scale[:, None]
            out_ptrs = out_ptr + rows64 * out_row_stride + (start + cols)[None, :]
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def scale_rows(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x * scale`` for a 2-D ``x`` (unit column stride) and a scalar or per-row ``scale``, into ``out``
    (default: in place, skipped on the GPU when the scale is exactly 1). ``out`` may have another dtype."""
    n_rows, n_cols = x.shape
    out = x if out is None else out
    if x.numel() == 0:
        return out
    scale_stride = 0 if scale.numel() == 1 else 1
    scale = scale.reshape(-1).contiguous()
    launch = runtime.streaming_row_launch(n_rows, n_cols)
    runtime.launch_kernel(_scale_rows_kernel, (launch.grid,),
        x, x.stride(0), out, out.stride(0), scale, scale_stride, n_rows, n_cols,
        IN_PLACE=out is x, ROWS=launch.rows, BLOCK_N=launch.block_n, num_warps=launch.num_warps,
    )  # fmt: skip
    return out


def _scale_rows_into(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """out = x * scale, rounded to ``dtype`` in the same pass (the fused linear losses' fp32 dW accumulator to the
    weight's dtype)."""
    scale_rows(x, scale, out=out)


def _scale_rows_in_place(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x *= scale, for ``x`` (..., n) with unit column stride and a scalar or per-row ``scale``; skipped on
    the GPU when the scale is exactly 1."""
    # A gradient buffer the loss made is rows already; anything else is viewed as rows (no copy: it is written).
    scale_rows(x if x.dim() == 2 and x.is_contiguous() else rows_to_overwrite(x), scale)


@dataclass(frozen=True)
class _ScaleRows:
    """``liger_lab::scale_rows`` (out of place, into another dtype) and ``liger_lab::scale_rows_`` (in place), the two
    operators over one kernel with which every loss that makes its gradient in the forward scales it in the backward.
    Their signatures differ (the in-place one keeps the dtype), so they are two declarations, kept here together."""

    default: operators.Operator
    in_place: operators.Operator


SCALE_ROWS = _ScaleRows(
    default=operators.define(
        "scale_rows", _scale_rows_into, outputs={"out": lambda x, scale, dtype: operators.dense_like(x, dtype)}
    ),
    in_place=operators.define("scale_rows_", _scale_rows_in_place, outputs={}, mutates=("x",)),
)


def refuse_second_derivative(name: str) -> None:
    """Called first in the backward of every loss that makes its gradient in the forward (cross-entropy, JSD and
    the fused linear losses): their backward only scales a saved gradient, which is a constant to autograd, so a
    backward with ``create_graph=True`` (double backward, a gradient penalty) would differentiate it to a silent
    zero. It raises instead, naming the op, as the norms' and GLUs' backward operators do when differentiated
    (they have no autograd formula); a first-order backward never builds a graph, so this costs it nothing."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"liger_lab.{name} has no second derivative: its gradient is made in the forward pass and the backward "
            "only scales it, so a backward with create_graph=True (double backward, a gradient penalty) cannot "
            f"differentiate it. Compute such a term with the plain PyTorch loss, liger_lab.reference.{name}."
        )


def save_gradient(ctx, grad: torch.Tensor, owed: torch.Tensor, shape: torch.Size) -> None:
    """Keep a gradient made in the forward (rows of ``grad``, ``owed`` the scale each row still owes) for
    :func:`scaled_gradient`. Scaling it in place in the backward bumps its version: a second backward through
    the same graph (retain_graph) then fails with "modified by an inplace operation" instead of scaling twice."""
    ctx.save_for_backward(grad, owed)
    ctx.grad_shape = shape


def scaled_gradient(ctx, grad_loss: torch.Tensor) -> torch.Tensor:
    """The saved gradient times the upstream gradient, scaled in place, in the input's shape."""
    grad, owed = ctx.saved_tensors
    SCALE_ROWS.in_place(grad, grad_loss.float() * owed)
    # detach(): a fresh tensor object, so a leaf's .grad is never the leaf itself (in place: its memory)
    return grad.view(ctx.grad_shape).detach()
