r"""LayerNorm, fused forward and backward.

For one row :math:`x \in \mathbb{R}^n` with weight :math:`w`, bias :math:`b` and offset :math:`o` (0 for
``torch.nn.LayerNorm``, 1 for Nemotron's ``NemotronLayerNorm1P``, which stores w and scales by 1 + w)::

    mu   = mean(x)                              # two fp32 statistics per row,
    r    = 1 / sqrt(mean((x - mu)**2) + eps)    # saved for the backward
    xhat = (x - mu) * r
    y    = xhat * (o + w) + b

Backward, with g = dy * (o + w) (derivation in solutions/02_layernorm.ipynb; the offset is a constant, so dw is
the same sum)::

    dx = r * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat
    db = sum over rows of dy

Same semantics as ``torch.nn.functional.layer_norm(x, (n,), o + w, b, eps)``: the math is fp32, the output
has x's dtype, and x, w and b share one dtype (as PyTorch requires on the GPU). ``o + w`` is rounded to w's dtype
before it scales, as Nemotron's ``self.weight + 1.0`` is (Gemma's RMSNorm instead adds its offset in fp32:
:mod:`liger_lab.ops.rms_norm`).

Bytes per element in bf16: the forward reads x and writes y (4 bytes; the 8 bytes of statistics per
row are noise). The backward reads x and dy and writes dx (6 bytes), recomputing xhat from the saved
statistics instead of storing it. dw and db need sums over *all rows*: each program of a persistent grid
keeps both running fp32 sums in registers over the rows it handles and writes them once at the end, and
one small Triton kernel sums the programs' rows for both and rounds once
(:func:`liger_lab.ops.common.sum_partials`; no second pass over x and dy, no atomics). PyTorch's native kernels
read x and dy twice in the backward (once for dx, once for dw and db): 14 bytes, not 10.

**Operators** (:func:`liger_lab.ops.operators.define`): ``liger_lab::layer_norm`` carries the autograd formula,
``liger_lab::layer_norm_backward`` makes (dx, dw, db). Launch settings: :func:`forward_launch` and
:func:`backward_launch`; what they were measured against is in benchmarks/notes/layer_norm.md.
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
    is_finite,
    row_op_in_layout,
    rows_of,
    sum_partials,
)
from liger_lab.ops.operators import dense_like


@triton.jit
def _offset_weight(w_ptr, cols, col_mask, offset):
    """offset + w, rounded to w's dtype (a no-op for offset 0), in fp32."""
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    return w.to(w_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _layer_norm_forward_kernel(
    x_ptr, x_row_stride, w_ptr, b_ptr, y_ptr, y_row_stride, mean_ptr, rstd_ptr,
    n_rows, n_cols, eps, offset,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]

    x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = _offset_weight(w_ptr, cols, col_mask, offset)
    b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    # The row is already in registers, so centring before squaring costs a reduction, not a pass over
    # memory; mean(x**2) - mean**2 would cancel catastrophically when |mean| >> std. The padding must be
    # zeroed again after centring, or it would add mean**2 per padded column.
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]

    tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _add_pairs(a_sum, b_sum, a, b):
    return a_sum + a, b_sum + b


@triton.jit
def _layer_norm_backward_kernel(
    dy_ptr, dy_row_stride, x_ptr, x_row_stride, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dx_row_stride, partial_ptr,
    n_rows, n_cols, offset,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = _offset_weight(w_ptr, cols, col_mask, offset)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)

    # Persistent loop: this program takes tiles program, program + grid, ... so dw and db stay in registers,
    # NUM_STAGES of them in flight (see liger_lab/ops/rms_norm.py).
    for tile in tl.range(program, tl.cdiv(n_rows, ROWS), tl.num_programs(0), num_stages=NUM_STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        # Padding has dy == 0 (so g == 0): it drops out of every sum below without a tl.where.
        xhat = (x - mean[:, None]) * rstd[:, None]
        g = dy * w[None, :]
        # Both row sums in one reduction: the warps of a row meet in shared memory once, not twice.
        sum_g, sum_gx = tl.reduce((g, g * xhat), 1, _add_pairs)
        mean_g, mean_gx = sum_g / n_cols, sum_gx / n_cols
        dx = rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
        tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
        db_acc += tl.sum(dy, axis=0)

    # One row of partials per program: dw in the first n_cols columns, db in the next n_cols.
    partial_row = partial_ptr + program.to(tl.int64) * 2 * n_cols
    tl.store(partial_row + cols, dw_acc, mask=col_mask)
    tl.store(partial_row + n_cols + cols, db_acc, mask=col_mask)


FORWARD_GPU_TILE = 8192
"""Elements of rows per program in the forward on the GPU, a warp per :data:`FORWARD_WARP_ELEMENTS`: LayerNorm holds
x - mean as well as x, and 2 rows of 4096 under 8 warps measured fastest on an H200, ahead of RMSNorm's tile of one
row (benchmarks/notes/layer_norm.md)."""
FORWARD_WARP_ELEMENTS = 1024


def forward_launch(n_rows: int, n_cols: int) -> runtime.RowLaunch:
    """The forward's tiling: :func:`liger_lab.runtime.row_launch` with :data:`FORWARD_GPU_TILE`."""
    return runtime.row_launch(n_rows, n_cols, gpu_tile=FORWARD_GPU_TILE, warp_elements=FORWARD_WARP_ELEMENTS)


def _launch_forward(
    x: Rows,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    offset: float,
    y: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    launch: runtime.RowLaunch | None = None,
) -> None:
    """The forward over the rows of x, into dense y (x's rows, n_cols apart), mean and rstd (one per row)."""
    if x.n_rows == 0 or x.n_cols == 0:
        return
    launch = launch or forward_launch(x.n_rows, x.n_cols)
    runtime.launch_kernel(_layer_norm_forward_kernel, (launch.grid,),
        x.data, x.stride, weight, bias, y, x.n_cols, mean, rstd, x.n_rows, x.n_cols, eps, offset,
        ROWS=launch.rows, BLOCK_N=launch.block_n, num_warps=launch.num_warps,
    )  # fmt: skip


def layer_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    launch: runtime.RowLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward on a 2-D row view. Returns (y, mean, rstd). ``launch``: the tiling,
    :func:`forward_launch`'s by default (a sweep passes its own)."""
    y = x.new_empty(x.shape)
    mean, rstd = (x.new_empty(x.shape[0], dtype=torch.float32) for _ in range(2))
    _launch_forward(rows_of(x), weight, bias, eps, offset, y, mean, rstd, launch)
    return y, mean, rstd


def backward_launch(dy: torch.Tensor, x: torch.Tensor) -> runtime.RowLaunch:
    """The backward's default tiling on 2-D row views: the persistent grid, told the bytes per column its loop loads
    (dy and x)."""
    return runtime.persistent_row_launch(x.shape[0], x.shape[1], stream_bytes=dy.element_size() + x.element_size())


def _launch_backward(
    dy: Rows,
    x: Rows,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    dx: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor,
    launch: runtime.RowLaunch | None = None,
) -> None:
    """The backward over the rows of x (mean and rstd: one contiguous statistic per row), into dense dx, dw and
    db."""
    n_rows, n_cols = x.n_rows, x.n_cols
    if n_rows == 0 or n_cols == 0:
        dw.zero_()
        db.zero_()
        return
    stream_bytes = dy.data.element_size() + x.data.element_size()
    launch = launch or runtime.persistent_row_launch(n_rows, n_cols, stream_bytes=stream_bytes)
    partials = x.data.new_empty((launch.grid, 2 * n_cols), dtype=torch.float32)
    runtime.launch_kernel(_layer_norm_backward_kernel, (launch.grid,),
        dy.data, dy.stride, x.data, x.stride, weight, mean, rstd, dx, n_cols, partials, n_rows, n_cols, offset,
        ROWS=launch.rows, BLOCK_N=launch.block_n, NUM_STAGES=launch.num_stages, num_warps=launch.num_warps,
    )  # fmt: skip
    sum_partials(partials, dw.dtype, outputs=2, out=(dw, db))


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    *,
    offset: float = 0.0,
    launch: runtime.RowLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward on 2-D row views. Returns (dx, dw, db). ``launch``: the persistent grid,
    :func:`backward_launch`'s by default."""
    dx, dw, db = x.new_empty(x.shape), torch.empty_like(weight), torch.empty_like(weight)
    _launch_backward(rows_of(dy), rows_of(x), weight, mean.contiguous(), rstd.contiguous(), offset, dx, dw, db, launch)
    return dx, dw, db


# --------------------------------------------------------------------------------------------------
# PyTorch operators (liger_lab.ops.operators, as in liger_lab/ops/rms_norm.py): what torch.compile sees instead of
# the launchers.


def _layer_norm_into(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, offset: float, y: torch.Tensor,
    mean: torch.Tensor, rstd: torch.Tensor,
) -> None:  # fmt: skip
    """y of x's shape, two fp32 statistics per row, each shaped x.shape[:-1] (so a DTensor shards them as it shards
    x)."""
    _launch_forward(rows_of(x), weight.contiguous(), bias.contiguous(), eps, offset, y, mean, rstd)


def _layer_norm_backward_into(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, offset: float,
    dx: torch.Tensor, dw: torch.Tensor, db: torch.Tensor,
) -> None:  # fmt: skip
    _launch_backward(
        rows_of(dy), rows_of(x), weight.contiguous(), mean.contiguous(), rstd.contiguous(), offset, dx, dw, db
    )


def _parameter_grad(weight: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(weight)


LAYER_NORM_BACKWARD = operators.define(
    "layer_norm_backward",
    _layer_norm_backward_into,
    outputs={"dx": lambda x: dense_like(x), "dw": _parameter_grad, "db": _parameter_grad},
)


def _setup_context(ctx, inputs, output):
    x, weight, _, _, offset = inputs
    # The bias is not needed for the gradients: its own gradient is the column sum of dy.
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.offset = offset
    # The statistics' gradients arrive as None rather than as zeros autograd would allocate and fill every call.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dmean, _drstd):
    if dy is None:  # only the statistics were used (a direct call of the operator)
        return None, None, None, None, None
    return *LAYER_NORM_BACKWARD(dy, *ctx.saved_tensors, ctx.offset), None, None


def _statistic(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1], dtype=torch.float32)


LAYER_NORM = operators.define(
    "layer_norm",
    _layer_norm_into,
    outputs={"y": lambda x: dense_like(x), "mean": _statistic, "rstd": _statistic},
    setup_context=_setup_context,
    backward=_backward,
)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, *, offset: float = 0.0
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x``: ``torch.nn.functional.layer_norm(x, (n,), weight, bias, eps)``,
    or with ``offset=1.0`` Nemotron's ``NemotronLayerNorm1P``, whose weight scales as ``weight + 1`` (rounded to
    the weight's dtype, as transformers computes it).

    ``weight`` and ``bias`` are 1-D of ``x``'s last dimension and share ``x``'s dtype (fp32, fp16 or bf16);
    the output has that dtype too.
    """
    check_float("x", x)
    check_feature_vector("weight", weight, x)
    check_feature_vector("bias", bias, x)
    # PyTorch on CUDA reads the parameters with x's element type (a mismatch is a RuntimeError there; on CPU
    # it also takes fp32 parameters with a half x). One rule on every device: one dtype.
    check_same_dtype(x=x, weight=weight, bias=bias)
    if not eps >= 0:
        raise ValueError(f"eps is {eps}: expected a non-negative number")
    if not is_finite(offset):
        raise ValueError(f"offset is {offset}: expected a finite number")
    if operators.lowered("layer_norm"):
        return reference.layer_norm(x, weight, bias, eps, offset=offset)
    return row_op_in_layout(lambda rows: LAYER_NORM(rows, weight, bias, float(eps), float(offset))[0], x)
