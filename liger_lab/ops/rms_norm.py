r"""RMSNorm, fused forward and backward.

For one row :math:`x \in \mathbb{R}^n` with weight :math:`w` and offset :math:`o` (0 for Llama, 1 for Gemma)::

    r    = 1 / sqrt(mean(x**2) + eps)          # one fp32 statistic per row, saved for the backward
    xhat = x * r
    y    = xhat * (o + w)

Backward, with g = dy * (o + w) (derivation in solutions/01_rmsnorm.ipynb)::

    dx = r * (g - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat

Casting modes follow Hugging Face: ``"llama"`` rounds xhat to the input dtype before multiplying by the
weight (output dtype: the promotion of x's and w's dtypes); ``"gemma"`` does everything in fp32 and
returns x's dtype. Statistics are always fp32.

The forward reads x and writes y: 2 passes of n elements per row. The backward reads x and dy and
writes dx; dw needs a sum over *all rows*, so each program of a persistent grid keeps a running fp32
partial sum of its rows in registers and writes one row of partials at the end; one small Triton kernel sums the
programs' rows and rounds once (:func:`liger_lab.ops.common.sum_partials`; no atomics, no bf16 accumulation).

**The residual add fused in** (:func:`add_rms_norm`). A pre-norm decoder adds each sublayer's output x to the
residual stream and normalises the sum::

    s = x + residual                       # rounded to the inputs' dtype: it *is* the new residual stream
    y = rms_norm(s)                        # of that rounded s, so y equals rms_norm of the returned s

Both s and y leave the op, and s goes on down the stream, so two gradients come back: dy, and ds from the
layers that read s later. The Jacobians of s = x + residual with respect to x and to residual are identities,
so the chain rule gives one gradient for both, with r, xhat and g above computed from s::

    dx = dresidual = ds + r * (g - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat

The same two kernels do it, behind constexpr flags: the forward with HAS_RESIDUAL reads x and residual, stores
s and normalises it (4 passes); the backward with HAS_DS reads dy, s and ds and writes that one gradient
(4 passes), or skips the ds read when the loss does not use s. Unfused, ``s = x + residual`` then
:func:`rms_norm` moves 3 + 2 passes forward (s written, then read back) and 3 + 3 backward (the norm writes its
dx, then autograd reads it and ds and writes their sum): 11 passes against 8. At 16384 x 4096 in bf16 (128 MiB a
pass) that is 384 MiB less traffic per call, and no buffer for the norm's own dx.

**Operators** (:func:`liger_lab.ops.operators.define`): ``liger_lab::rms_norm`` and ``liger_lab::add_rms_norm``
carry the autograd formulas; ``liger_lab::rms_norm_backward`` and its twin ``rms_norm_backward_`` (dx over dy) come
from one declaration, as does ``liger_lab::add_rms_norm_backward``. Launch settings: the forward takes
:func:`liger_lab.runtime.row_launch`'s rows, the backward a persistent grid (:func:`backward_launch`); the
measurements behind both are in benchmarks/notes/rms_norm.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from liger_lab import reference, runtime
from liger_lab.ops import operators
from liger_lab.ops.common import (
    Rows,
    check_feature_vector,
    check_float,
    check_same_dtype,
    check_same_shape,
    in_place_requested,
    row_op_in_layout,
    rows_of,
    sum_partials,
)
from liger_lab.ops.operators import dense_like

CASTING_MODES = ("llama", "gemma")


@triton.jit
def _rms_norm_forward_kernel(
    x_ptr, x_row_stride, w_ptr, y_ptr, y_row_stride, rstd_ptr,
    n_rows, n_cols, eps, offset,
    GEMMA_CASTING: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    r_ptr=None, r_row_stride=0, s_ptr=None, s_row_stride=0, HAS_RESIDUAL: tl.constexpr = False,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)

    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The fused residual add: s = x + r, rounded to the inputs' dtype. That rounded s is what the residual
        # stream carries on, and what gets normalised, so y is exactly the norm of the returned s.
        r = tl.load(r_ptr + rows64[:, None] * r_row_stride + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + rows64[:, None] * s_row_stride + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    xhat = x * rstd[:, None]
    if not GEMMA_CASTING:
        # Llama: the normalised row is rounded to the input dtype before the weight multiplies it.
        xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = xhat * w[None, :]

    tl.store(y_ptr + rows64[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_backward_kernel(
    dy_ptr, dy_row_stride, x_ptr, x_row_stride, w_ptr, rstd_ptr, dx_ptr, dx_row_stride, dw_partial_ptr,
    n_rows, n_cols, offset,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    ds_ptr=None, ds_row_stride=0, HAS_DS: tl.constexpr = False,
):  # fmt: skip
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)

    # Persistent loop: this program takes tiles program, program + grid, ... so dw stays in registers. With
    # NUM_STAGES > 1 Triton loads the next tiles into shared memory while this one computes: a program alone on
    # its SM has no other program to hide its loads' latency behind.
    for tile in tl.range(program, tl.cdiv(n_rows, ROWS), tl.num_programs(0), num_stages=NUM_STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        dot = tl.sum(g * xhat, axis=1) / n_cols
        dx = rstd[:, None] * (g - xhat * dot[:, None])
        if HAS_DS:
            # x is the fused add's sum s, which also left the op: its own gradient joins the norm's.
            dx += tl.load(ds_ptr + rows64 * ds_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)

    tl.store(dw_partial_ptr + program * n_cols + cols, dw_acc, mask=col_mask)


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, casting_mode: str) -> torch.dtype:
    return x.dtype if casting_mode == "gemma" else torch.promote_types(x.dtype, weight.dtype)


def _launch_forward(
    x: Rows,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    casting_mode: str,
    y: torch.Tensor,
    rstd: torch.Tensor,
    residual: Rows | None = None,
    s: torch.Tensor | None = None,
    launch: runtime.RowLaunch | None = None,
) -> None:
    """The forward over the rows of x, into dense y and s (x's rows, n_cols apart) and rstd (one per row); with
    ``residual``, s = x + residual into ``s`` and the norm of s into y. ``launch``: the tiling,
    :func:`liger_lab.runtime.row_launch`'s by default."""
    if x.n_rows == 0:
        return
    launch = launch or runtime.row_launch(x.n_rows, x.n_cols)
    # Every argument is passed, None where unused: torch.compile's analysis of a traced launch wants them all.
    runtime.launch_kernel(_rms_norm_forward_kernel, (launch.grid,),
        x.data, x.stride, weight, y, x.n_cols, rstd, x.n_rows, x.n_cols, eps, offset,
        GEMMA_CASTING=casting_mode == "gemma", ROWS=launch.rows, BLOCK_N=launch.block_n,
        r_ptr=None if residual is None else residual.data, r_row_stride=0 if residual is None else residual.stride,
        s_ptr=s, s_row_stride=x.n_cols, HAS_RESIDUAL=residual is not None, num_warps=launch.num_warps,
    )  # fmt: skip


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    casting_mode: str,
    *,
    residual: torch.Tensor | None = None,
    launch: runtime.RowLaunch | None = None,
) -> tuple[torch.Tensor, ...]:
    """Launch the forward on a 2-D row view. Returns (y, rstd); with ``residual`` (x's shape and dtype) the fused
    add, (y, s, rstd) with s = x + residual. ``launch``: the tiling (a sweep passes its own)."""
    y = x.new_empty(x.shape, dtype=_output_dtype(x, weight, casting_mode))
    rstd = x.new_empty(x.shape[0], dtype=torch.float32)
    if residual is None:
        _launch_forward(rows_of(x), weight, eps, offset, casting_mode, y, rstd, launch=launch)
        return y, rstd
    s = x.new_empty(x.shape)
    _launch_forward(rows_of(x), weight, eps, offset, casting_mode, y, rstd, rows_of(residual), s, launch=launch)
    return y, s, rstd


def _persistent_launch(n_rows: int, n_cols: int, *streamed: torch.Tensor | None) -> runtime.RowLaunch:
    """The persistent grid, told the bytes per column its loop loads (of each tensor ``streamed``) so that it keeps
    as many tiles in flight as shared memory holds."""
    stream_bytes = sum(t.element_size() for t in streamed if t is not None)
    return runtime.persistent_row_launch(n_rows, n_cols, stream_bytes=stream_bytes)


def backward_launch(dy: torch.Tensor, x: torch.Tensor, ds: torch.Tensor | None = None) -> runtime.RowLaunch:
    """The backward's default tiling on 2-D row views of dy, x and, for the fused add, ds."""
    return _persistent_launch(x.shape[0], x.shape[1], dy, x, ds)


def _launch_backward(
    dy: Rows,
    x: Rows,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    dx: torch.Tensor,
    dw: torch.Tensor,
    ds: Rows | None = None,
    launch: runtime.RowLaunch | None = None,
) -> None:
    """The backward over the rows of x (rstd: one contiguous statistic per row), into dense dx (x's rows; it may be
    ``dy`` itself: each program reads a tile before it writes it) and dw. ``ds``, when given, is a gradient that
    reached x directly (x is then the fused add's sum, an output of its own) and is added into dx. ``launch``: the
    persistent grid, :func:`backward_launch`'s by default."""
    n_rows, n_cols = x.n_rows, x.n_cols
    if n_rows == 0:  # no rows: no launch (a persistent grid of 0 programs), and dw sums nothing
        dw.zero_()
        return
    launch = launch or _persistent_launch(n_rows, n_cols, dy.data, x.data, None if ds is None else ds.data)
    dw_partial = x.data.new_empty((launch.grid, n_cols), dtype=torch.float32)
    runtime.launch_kernel(_rms_norm_backward_kernel, (launch.grid,),
        dy.data, dy.stride, x.data, x.stride, weight, rstd, dx, n_cols, dw_partial, n_rows, n_cols, offset,
        ROWS=launch.rows, BLOCK_N=launch.block_n, NUM_STAGES=launch.num_stages,
        ds_ptr=None if ds is None else ds.data, ds_row_stride=0 if ds is None else ds.stride, HAS_DS=ds is not None,
        num_warps=launch.num_warps,
    )  # fmt: skip
    sum_partials(dw_partial, dw.dtype, out=(dw,))


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    dx: torch.Tensor | None = None,
    ds: torch.Tensor | None = None,
    *,
    launch: runtime.RowLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward on 2-D row views. Returns (dx, dw); dx goes into ``dx`` when given (dense; it may be
    ``dy`` itself). ``ds`` and ``launch`` as in the operators' launcher."""
    dx = x.new_empty(x.shape) if dx is None else dx
    dw = torch.empty_like(weight)
    _launch_backward(rows_of(dy), rows_of(x), weight, rstd.contiguous(), offset, dx, dw,
                     None if ds is None else rows_of(ds), launch)  # fmt: skip
    return dx, dw


# --------------------------------------------------------------------------------------------------
# PyTorch operators (liger_lab.ops.operators): torch.compile sees one opaque call with a known output instead of
# tracing into Triton's launcher. Each launcher below writes into the buffers the declaration allocates.


def _rms_norm_into(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    casting_mode: str,
    in_place_backward: bool,
    y: torch.Tensor,
    rstd: torch.Tensor,
) -> None:
    """y of x's shape, one fp32 rstd per row, shaped x.shape[:-1] (so a DTensor shards it as it shards x).
    ``in_place_backward`` only steers the backward (the formula reads it from the call)."""
    _launch_forward(rows_of(x), weight.contiguous(), eps, offset, casting_mode, y, rstd)


def _rms_norm_backward_into(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float, dx: torch.Tensor,
    dw: torch.Tensor,
) -> None:  # fmt: skip
    """dx and dw; the twin passes dy as dx (contiguous, in x's dtype)."""
    _launch_backward(rows_of(dy), rows_of(x), weight.contiguous(), rstd.contiguous(), offset, dx, dw)


RMS_NORM_BACKWARD = operators.define(
    "rms_norm_backward",
    _rms_norm_backward_into,
    outputs={"dx": lambda x: dense_like(x), "dw": lambda weight: torch.empty_like(weight)},
    in_place={"dx": "dy"},
)


def _setup_context(ctx, inputs, output):
    x, weight, _, offset, _, in_place_backward = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.in_place = offset, in_place_backward
    # rstd's gradient arrives as None rather than as zeros autograd would allocate and fill for every call.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _drstd):
    if dy is None:  # only rstd was used (a direct call of the operator): it is a constant of x's values here
        return None, None, None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    # Writing dx over dy saves a buffer, but only when nobody else reads dy (see rms_norm's docstring):
    # an opt-in, and only for a dense dy of x's dtype that the kernel can overwrite row by row.
    if ctx.in_place and dy.dtype == x.dtype and dy.is_contiguous():
        return dy, RMS_NORM_BACKWARD.call_in_place(dy, x, weight, rstd, ctx.offset), None, None, None, None
    return *RMS_NORM_BACKWARD(dy, x, weight, rstd, ctx.offset), None, None, None, None


RMS_NORM = operators.define(
    "rms_norm",
    _rms_norm_into,
    outputs={
        "y": lambda x, weight, casting_mode: dense_like(x, _output_dtype(x, weight, casting_mode)),
        "rstd": lambda x: x.new_empty(x.shape[:-1], dtype=torch.float32),
    },
    setup_context=_setup_context,
    backward=_backward,
)


def _check_arguments(x: torch.Tensor, weight: torch.Tensor, eps: float, casting_mode: str) -> None:
    check_feature_vector("weight", weight, x)
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode is {casting_mode!r}: expected one of {CASTING_MODES}")
    if not eps >= 0:
        raise ValueError(f"eps is {eps}: expected a non-negative number")


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "llama",
    in_place_backward: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` with Hugging Face Llama (``offset=0``) or Gemma
    (``offset=1.0, casting_mode="gemma"``) semantics.

    ``in_place_backward=True`` writes the input gradient over the incoming output gradient, saving one
    activation-sized buffer; use it only where the norm's output feeds a layer whose backward makes a
    fresh gradient (a linear projection), never where the output is added to a residual. Under ``torch.compile``
    the option changes nothing: the compiler plans the buffers itself.
    """
    check_float("x", x)
    _check_arguments(x, weight, eps, casting_mode)
    if operators.lowered("rms_norm"):
        return reference.rms_norm(x, weight, eps, offset=offset, casting_mode=casting_mode)
    in_place = in_place_requested(in_place_backward, x)
    return row_op_in_layout(
        lambda rows: RMS_NORM(rows, weight, float(eps), float(offset), casting_mode, in_place)[0], x
    )


# --------------------------------------------------------------------------------------------------
# The residual add fused into the norm (math in the module docstring): the same two kernels, with HAS_RESIDUAL
# in the forward and HAS_DS in the backward.


def _add_rms_norm_into(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    casting_mode: str,
    y: torch.Tensor,
    s: torch.Tensor,
    rstd: torch.Tensor,
) -> None:
    """y and s = x + residual of x's shape, one fp32 rstd per row (shaped x.shape[:-1])."""
    _launch_forward(rows_of(x), weight.contiguous(), eps, offset, casting_mode, y, rstd, rows_of(residual), s)


def _add_rms_norm_backward_into(
    dy: torch.Tensor, ds: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    offset: float, dx: torch.Tensor, dw: torch.Tensor,
) -> None:  # fmt: skip
    """The gradient of s (ds, None: zero, plus the norm's backward of dy), which is the gradient of x and of
    residual alike, and dw."""
    _launch_backward(rows_of(dy), rows_of(s), weight.contiguous(), rstd.contiguous(), offset, dx, dw,
                     None if ds is None else rows_of(ds))  # fmt: skip


ADD_RMS_NORM_BACKWARD = operators.define(
    "add_rms_norm_backward",
    _add_rms_norm_backward_into,
    outputs={"dx": lambda s: dense_like(s), "dw": lambda weight: torch.empty_like(weight)},
)


def _add_setup_context(ctx, inputs, output):
    _, _, weight, _, offset, _ = inputs
    # The norm's backward reads the sum (already an output: saving it costs no memory), not x and residual.
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.offset = offset
    # The gradient of an output the loss does not use arrives as None, not as an activation of zeros for the
    # kernel to read: a loss of y alone skips the ds read.
    ctx.set_materialize_grads(False)


def _add_backward(ctx, dy, ds, _drstd):
    s, weight, rstd = ctx.saved_tensors
    if dy is None:  # only the sum was used: its gradient goes to both addends, as in x + residual
        return ds, ds, None if ds is None else torch.zeros_like(weight), None, None, None
    dx, dw = ADD_RMS_NORM_BACKWARD(dy, ds, s, weight, rstd, ctx.offset)
    # One tensor for both addends, as autograd's own x + residual does (a leaf's .grad gets a copy).
    return dx, dx, dw, None, None, None


ADD_RMS_NORM = operators.define(
    "add_rms_norm",
    _add_rms_norm_into,
    outputs={
        "y": lambda x, weight, casting_mode: dense_like(x, _output_dtype(x, weight, casting_mode)),
        "s": lambda x: dense_like(x),
        "rstd": lambda x: x.new_empty(x.shape[:-1], dtype=torch.float32),
    },
    setup_context=_add_setup_context,
    backward=_add_backward,
)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm decoder's residual add fused into its norm: ``(rms_norm(x + residual), x + residual)``.

    The sum is returned in the inputs' dtype (the residual stream, as in ``hidden = residual + hidden``) and is
    the very value normalised, so ``y`` equals ``rms_norm(s, weight, eps, offset=offset, casting_mode=casting_mode)``.
    ``x`` and ``residual`` must have one shape and one dtype; ``weight`` and the options are those of
    :func:`rms_norm`. Gradients reach x, residual (the same values) and weight, from either output or both.
    """
    check_float("x", x)
    check_float("residual", residual)
    check_same_shape(x=x, residual=residual)
    check_same_dtype(x=x, residual=residual)
    _check_arguments(x, weight, eps, casting_mode)
    if operators.lowered("add_rms_norm"):
        return reference.add_rms_norm(x, residual, weight, eps, offset=offset, casting_mode=casting_mode)
    y, s, _ = ADD_RMS_NORM(x, residual, weight, float(eps), float(offset), casting_mode)
    return y, s
