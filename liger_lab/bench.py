"""The benchmark protocol of DESIGN.md: every op, every implementation, one process.

Each :class:`OpBench` knows its shape on the GPU (the DESIGN.md shape) and a small one for the CPU
interpreter, how to make fresh random inputs, the fewest bytes the op must move, and which
implementations exist here: ``liger_lab``, ``eager`` (the plain PyTorch reference), ``torch_compile``
(the same reference through ``torch.compile``, GPU only) and ``liger`` (Liger-Kernel, when installed).
"""

from __future__ import annotations

import importlib.util
import json
import platform
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

import liger_lab
from liger_lab import profiling, reference, runtime


def liger_kernel_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


@dataclass
class OpBench:
    name: str
    shape: tuple[int, ...]
    make_inputs: Callable[[tuple[int, ...], torch.dtype], list[object]]
    fwd_passes: float
    full_passes: float
    impls: dict[str, Callable[[], Callable[..., object]]] = field(default_factory=dict)
    elements: Callable[[tuple[int, ...]], int] = lambda shape: _prod(shape)  # noqa: E731

    def available(self) -> dict[str, Callable[..., object]]:
        """Implementations that run here, built on demand (torch.compile only on the GPU)."""
        made = {}
        for impl, build in self.impls.items():
            if impl == "torch_compile" and runtime.INTERPRET:
                continue
            if impl == "liger" and (runtime.INTERPRET or not liger_kernel_installed()):
                continue
            made[impl] = build()
        return made

    def run(self, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.bfloat16,
            impls: Iterable[str] | None = None) -> list[profiling.Result]:  # fmt: skip
        shape = shape or self.shape
        n = self.elements(shape)
        results = []
        for impl, fn in self.available().items():
            if impls is not None and impl not in impls:
                continue
            results.append(
                profiling.measure(
                    self.name, impl, fn, lambda: self.make_inputs(shape, dtype),
                    fwd_bytes=profiling.bytes_moved(n, self.fwd_passes, dtype),
                    full_bytes=profiling.bytes_moved(n, self.full_passes, dtype),
                )  # fmt: skip
            )
            torch.cuda.empty_cache() if not runtime.INTERPRET else None
        return results

    def floor_ms(self, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.bfloat16) -> float | None:
        """Forward+backward time if the minimum bytes moved at the measured copy bandwidth."""
        ceiling = profiling.copy_bandwidth_gbs()
        if ceiling is None:
            return None
        n_bytes = profiling.bytes_moved(self.elements(shape or self.shape), self.full_passes, dtype)
        return n_bytes / (ceiling * 1e9) * 1e3


def _prod(shape: Iterable[int]) -> int:
    total = 1
    for s in shape:
        total *= s
    return total


def _randn(shape, dtype, requires_grad=True):
    return torch.randn(shape, dtype=dtype, device=runtime.DEVICE, requires_grad=requires_grad)


def _norm_inputs(shape, dtype):
    return [_randn(shape, dtype), (1 + 0.1 * torch.randn(shape[-1], device=runtime.DEVICE)).to(dtype).requires_grad_()]


def _liger_rms_norm():
    from liger_kernel.transformers.functional import liger_rms_norm

    return lambda x, w: liger_rms_norm(x, w, 1e-6)


OPS: dict[str, OpBench] = {
    "rms_norm": OpBench(
        "rms_norm", (16384, 4096), _norm_inputs, fwd_passes=2, full_passes=5,
        impls={
            "liger_lab": lambda: lambda x, w: liger_lab.rms_norm(x, w, 1e-6, in_place_backward=True),
            "liger": _liger_rms_norm,
            "torch_compile": lambda: torch.compile(reference.rms_norm),
            "eager": lambda: reference.rms_norm,
        },
    ),  # fmt: skip
}


def small_shape(op: OpBench) -> tuple[int, ...]:
    """A shape the CPU interpreter runs in about a second."""
    return tuple(max(1, min(s, 256)) for s in op.shape)


def environment() -> dict:
    """GPU name and versions, recorded with every result row."""
    info = {
        "gpu": torch.cuda.get_device_name() if not runtime.INTERPRET else f"cpu ({platform.processor() or 'unknown'})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "liger_lab": liger_lab.__version__,
    }
    if liger_kernel_installed():
        from importlib.metadata import version

        info["liger_kernel"] = version("liger-kernel")
    return info


def write_json(results: list[profiling.Result], path: Path, extra: dict | None = None) -> None:
    env = environment()
    rows = [{**r.as_row(), **env, **(extra or {})} for r in results]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
