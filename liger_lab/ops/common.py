"""Pieces every op shares: input checks that raise clear errors, row views, partial-sum reductions.

The checks run on every eager call, so they stay cheap: plain attribute tests, no tensor operation and no read of a
value on the GPU (a check that needs values runs where ``runtime.HOST_READS_WAIT`` is false)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from liger_lab import runtime

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, tensor: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``tensor`` is a fp32, fp16 or bf16 tensor where the kernels run."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {tensor.dtype}: expected torch.float32, torch.float16 or torch.bfloat16")
    if tensor.device.type != runtime.DEVICE.type:
        runtime.check_device(**{name: tensor})


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise ValueError(f"expected one dtype, got {listed}")


def same_shape(shape: Sequence[int], expected: Sequence[int]) -> bool:
    """Whether two shapes are equal, compared size by size with ``==``.

    Under ``torch.compile`` with dynamic shapes a size is a ``SymInt``. ``==`` between two of them records a relation
    (``s0 == s1``), which holds for every length, so one graph serves them all. Hashing a size (a set of shapes, a
    dict key) pins it to its current value instead: a new graph for every length. A pinned size next to a symbolic
    one also made Dynamo (2.13) answer a membership test wrongly (RoPE's ``cos.shape[0] not in (1, batch)`` was True
    for cos of q's batch, a false ValueError), so checks spell such tests out with ``==`` as well."""
    if len(shape) != len(expected):
        return False
    for size, other in zip(shape, expected, strict=True):
        if size != other:
            return False
    return True


def is_finite(value: float) -> bool:
    """Whether a Python number is finite (neither infinite nor NaN). Comparisons rather than ``math.isfinite``:
    ``torch.compile(dynamic=True)`` traces a float argument as a ``SymFloat``, which comparisons accept (Dynamo
    then specializes the float) and ``math.isfinite`` does not (a graph break, an error under ``fullgraph=True``)."""
    return -math.inf < value < math.inf


def check_same_shape(**tensors: torch.Tensor) -> None:
    first, *others = tensors.values()
    for tensor in others:
        if not same_shape(tensor.shape, first.shape):
            listed = ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors.items())
            raise ValueError(f"expected tensors of one shape, got {listed}")


def row_count(x: torch.Tensor) -> int:
    """The number of rows of ``x`` viewed as (rows, last dim): the product of its leading sizes. ``math.prod``
    rather than ``x.shape[:-1].numel()``: under ``torch.compile`` the latter pins a symbolic size to its value,
    so a fake implementation that used it would compile one graph per row count."""
    return math.prod(x.shape[:-1])


def row_losses(logits: torch.Tensor) -> torch.Tensor:
    """An operator's output of one fp32 loss per row of ``logits`` (..., V): an allocator for
    :func:`liger_lab.ops.operators.define` (wrap it in ``operators.reads`` where the argument has another name)."""
    return logits.new_empty(row_count(logits), dtype=torch.float32)


def row_gradients(logits: torch.Tensor, compute_grad: bool) -> torch.Tensor:
    """An operator's output of the gradient of ``logits`` (..., V) as (rows, V) when ``compute_grad``, else an empty
    placeholder: an allocator, as :func:`row_losses`."""
    return logits.new_empty((row_count(logits), logits.shape[-1]) if compute_grad else (0,))


def check_feature_vector(name: str, vector: torch.Tensor, x: torch.Tensor) -> None:
    """A per-feature parameter (weight, bias): 1-D with x's last dimension."""
    check_float(name, vector)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden size)")
    if vector.dim() != 1 or vector.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{name} has shape {tuple(vector.shape)}: expected ({x.shape[-1]},) to match the last dimension of x "
            f"{tuple(x.shape)}"
        )


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as (rows, last dim) with unit stride along the row; copies only when it must."""
    rows = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # not -1: that is ambiguous for a last dim of 0
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


class Rows(NamedTuple):
    """A tensor as the row kernels walk it: ``data`` (its first element is row 0's first), ``n_rows`` rows of
    ``n_cols`` elements, ``stride`` elements from one row to the next, unit stride along a row."""

    data: torch.Tensor
    n_rows: int
    n_cols: int
    stride: int


def rows_of(x: torch.Tensor) -> Rows:
    """``x`` as (rows, last dim) for a kernel. A contiguous ``x`` is such rows as it stands, whatever its rank: no
    view is made, which spares an operator call on every eager call. Otherwise :func:`as_rows`' view (or copy)."""
    n_cols = x.shape[-1]
    if x.is_contiguous():  # rows n_cols apart by definition (not stride(-2): a size-1 dim may have any stride)
        return Rows(x, math.prod(x.shape[:-1]), n_cols, n_cols)
    rows = as_rows(x)
    return Rows(rows, rows.shape[0], n_cols, rows.stride(0))


def row_op_in_layout(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``op(x)`` for a row-wise op (one output row per row of x's last dimension), returned in x's memory layout.

    A permuted dense tensor, such as the ``(B, T, H, D) -> (B, H, T, D)`` transposed view Gemma 3 hands its
    per-head q/k norms, is not a stack of rows as it stands: :func:`as_rows` would copy it. Permuted back into
    memory order it is one, so ``op`` runs on that view without a copy and its output is permuted back, in
    the layout PyTorch's elementwise ops would give. A contiguous output in the transposed order would cost a
    copy later instead (the attention output then needs one before ``o_proj``, saved for backward: one activation
    per layer).
    """
    leading = range(x.dim() - 1)
    if x.is_contiguous() or x.stride(-1) != 1:
        return op(x)
    order = sorted(leading, key=lambda dim: -x.stride(dim))
    in_memory_order = x.permute(*order, x.dim() - 1)
    if not in_memory_order.is_contiguous():  # overlapping or gapped: nothing to keep
        return op(x)
    undo = sorted(leading, key=order.__getitem__)
    return op(in_memory_order).permute(*undo, x.dim() - 1)


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``. Never imports that module: no DTensor exists
    before it is imported, and a torch built without distributed support has none."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def in_place_requested(in_place_backward: bool, *tensors: torch.Tensor) -> bool:
    """Whether an op's opt-in ``in_place_backward`` takes effect: eagerly, yes; under ``torch.compile``, no.
    The compiler plans buffers itself, and its functionalization would turn writes over a caller's tensor
    back into copies (or, for a tensor the traced code still reads, refuse the graph), so every op takes
    its default path there. Nor when any of ``tensors`` is a DTensor: DTensor runs a mutating operator as an
    in-place op of its first argument and returns that argument, not what the operator returned."""
    return bool(in_place_backward) and not torch.compiler.is_compiling() and not any(map(is_dtensor, tensors))


def may_overwrite(x: torch.Tensor) -> bool:
    """Whether an in-place backward may write over ``x``'s memory. Never over memory that an ``nn.Parameter`` or any
    other leaf that requires grad owns (``x`` itself, or the base of a view ``x`` is): such a tensor is the caller's
    state (model weights, an input whose ``.grad`` the caller reads), and writing its gradient over it would leave
    the values gone and ``.grad`` aliasing them. Only intermediates (an autograd node's output) are written."""
    owner = x if x._base is None else x._base
    return not isinstance(owner, nn.Parameter) and not (owner.is_leaf and owner.requires_grad)


def rows_to_overwrite(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as (rows, last dim) over its own memory when a kernel may write results over it row by row;
    None for the caller's state (:func:`may_overwrite`), a layout that cannot be viewed as rows without a copy,
    a column stride other than 1, or rows that overlap (an expanded tensor)."""
    if not may_overwrite(x):
        return None
    try:
        rows = x.view(x.shape[:-1].numel(), x.shape[-1])
    except RuntimeError:  # only reshape, with a copy, could make rows of it
        return None
    overlapping = rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]
    return None if rows.stride(-1) != 1 or overlapping else rows


@triton.jit
def _sum_partials_kernel(
    partials_ptr,  # fp32 (n_programs, n_cols or 2 * n_cols), one row per program of the norm's backward
    n_programs,
    n_cols,
    out_ptr,  # (n_cols,) the sum of the first n_cols columns...
    second_out_ptr,  # ...and, with TWO_OUTPUTS, of the next n_cols (LayerNorm's db)
    BLOCK_P: tl.constexpr,  # partial rows summed per step
    BLOCK_N: tl.constexpr,  # columns per program
    TWO_OUTPUTS: tl.constexpr,
):
    # Each program sums a strip of columns down all the partial rows; with two outputs a row holds both vectors
    # side by side, and the strips past the first n_cols columns go to the second output.
    width = 2 * n_cols if TWO_OUTPUTS else n_cols
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < width
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for first in range(0, n_programs, BLOCK_P):
        rows = first + tl.arange(0, BLOCK_P)
        mask = (rows < n_programs)[:, None] & col_mask[None, :]
        tile = tl.load(partials_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :], mask=mask, other=0.0)
        total += tl.sum(tile, axis=0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cols < n_cols)
    if TWO_OUTPUTS:
        second = second_out_ptr + cols - n_cols
        tl.store(second, total.to(second_out_ptr.dtype.element_ty), mask=col_mask & (cols >= n_cols))


def sum_partials(
    partials: torch.Tensor, dtype: torch.dtype, outputs: int = 1, *, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """Finish a cross-program reduction: (programs, outputs * n) fp32 partial sums, one contiguous row per
    program holding ``outputs`` vectors of n side by side (1 or 2: LayerNorm's dw and db) -> that many (n,)
    tensors in ``dtype``, summed in fp32 and rounded once, into ``out`` when given (contiguous (n,) buffers).

    One launch: this runs after every norm's backward, where its work (a few MiB, from L2) is small beside the
    fixed cost of a kernel; two torch calls per vector (a sum, then a cast) measured slower on an H200 under
    CUDA-graph replay (benchmarks/notes/layer_norm.md)."""
    if outputs not in (1, 2) or partials.dim() != 2 or partials.shape[1] % outputs or not partials.is_contiguous():
        raise ValueError(
            f"expected contiguous (programs, outputs * n) partials with 1 or 2 outputs, got {tuple(partials.shape)} "
            f"and {outputs}"
        )
    n_programs, width = partials.shape
    n_cols = width // outputs
    sums = out or tuple(partials.new_empty(n_cols, dtype=dtype) for _ in range(outputs))
    if n_programs == 0 or n_cols == 0:
        return tuple(s.zero_() for s in sums)
    launch = runtime.column_sum_launch(n_programs, width)
    runtime.launch_kernel(_sum_partials_kernel, (launch.grid,),
        partials, n_programs, n_cols, sums[0], sums[-1],
        BLOCK_P=launch.rows, BLOCK_N=launch.block_n, TWO_OUTPUTS=outputs == 2, num_warps=launch.num_warps,
    )  # fmt: skip
    return sums
