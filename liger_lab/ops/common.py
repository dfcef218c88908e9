"""Pieces every op shares: input checks that raise clear errors, row views, partial-sum reductions."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from liger_lab import runtime

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, tensor: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``tensor`` is a fp32, fp16 or bf16 tensor where the kernels run."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {tensor.dtype}: expected torch.float32, torch.float16 or torch.bfloat16")
    runtime.check_device(**{name: tensor})


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise ValueError(f"expected one dtype, got {listed}")


def check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"expected tensors of one shape, got {listed}")


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


def rows_to_overwrite(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as (rows, last dim) over its own memory when a kernel may write results over it row by row;
    None for an ``nn.Parameter`` (model state is never clobbered), a layout that cannot be viewed as rows
    without a copy, a column stride other than 1, or rows that overlap (an expanded tensor)."""
    if isinstance(x, nn.Parameter):
        return None
    try:
        rows = x.view(x.shape[:-1].numel(), x.shape[-1])
    except RuntimeError:  # only reshape, with a copy, could make rows of it
        return None
    overlapping = rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]
    return None if rows.stride(-1) != 1 or overlapping else rows


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Finish a cross-program reduction: (programs, n) fp32 partial sums -> (n,) in ``dtype``."""
    return partials.sum(dim=0).to(dtype)
