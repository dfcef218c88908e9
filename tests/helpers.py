"""Shared test inputs: fresh random tensors where the kernels run, odd layouts on request."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from liger_lab import runtime


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device=runtime.DEVICE)).to(dtype)


def non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Same values, but every other column of a twice-as-wide buffer (stride(-1) == 2)."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return wide[..., ::2]


def row_strided(x: torch.Tensor) -> torch.Tensor:
    """Same values, rows padded (unit stride along the row, row stride larger than the row)."""
    wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 7, dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


class LargestNewTensor(TorchDispatchMode):
    """The most elements of any tensor an aten op makes: views hold no memory of their own, and ops that write
    into their arguments (``out=``, ``copy_``, the interpreter's storage copies) allocate nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out


class OpCalls(TorchDispatchMode):
    """How often each operator ran, by name (``liger_lab::glu``, ``liger_lab::glu_backward_``, ...): custom
    operators pass through dispatch modes like aten's."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))
