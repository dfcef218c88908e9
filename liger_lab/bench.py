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
    flops: Callable[[tuple[int, ...]], float] | None = None
    # CUDA-graph timing for short ops; ops that read a value back to the host (a target range check)
    # cannot be captured, and a failed capture leaves the CUDA RNG unusable, so they never try.
    graph_timing: bool = True

    def available(self) -> dict[str, Callable[..., object]]:
        """Implementations that run here, built on demand (torch.compile only on the GPU)."""
        made = {}
        for impl, build in self.impls.items():
            if impl == "torch_compile" and runtime.INTERPRET:
                continue
            if impl == "liger" and (runtime.INTERPRET or not liger_kernel_installed()):
                continue
            if impl == "cce" and (runtime.INTERPRET or importlib.util.find_spec("cut_cross_entropy") is None):
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
                    self.name,
                    impl,
                    fn,
                    lambda: self.make_inputs(shape, dtype),
                    fwd_bytes=profiling.bytes_moved(n, self.fwd_passes, dtype),
                    full_bytes=profiling.bytes_moved(n, self.full_passes, dtype) if self.full_passes else None,
                    full_flops=self.flops(shape) if self.flops else None,
                    graph=self.graph_timing,
                )  # fmt: skip
            )
            torch.cuda.empty_cache() if not runtime.INTERPRET else None
        return results

    def floor_ms(self, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.bfloat16) -> float | None:
        """Forward+backward time at the measured ceiling: minimum bytes at copy bandwidth, or FLOPs at the
        bf16 matmul rate for matmul-bound ops."""
        if self.flops is not None:
            rate = profiling.matmul_tflops()
            return None if rate is None else self.flops(shape or self.shape) / (rate * 1e12) * 1e3
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


def _rope_inputs(shape, dtype):
    batch, q_heads, k_heads, seq, head_dim = shape
    q = _randn((batch, q_heads, seq, head_dim), dtype)
    k = _randn((batch, k_heads, seq, head_dim), dtype)
    angles = torch.arange(seq, device=runtime.DEVICE)[:, None] * torch.rand(head_dim // 2, device=runtime.DEVICE)
    angles = torch.cat([angles, angles], dim=-1)[None]
    return [q, k, angles.cos().to(dtype), angles.sin().to(dtype)]


def _glu_inputs(shape, dtype):
    return [_randn(shape, dtype), _randn(shape, dtype)]


def _ce_inputs(shape, dtype):
    n_tokens, vocab = shape
    return [_randn(shape, dtype), torch.randint(0, vocab, (n_tokens,), device=runtime.DEVICE)]


def _flce_inputs(shape, dtype):
    n_tokens, hidden, vocab = shape
    return [
        _randn((n_tokens, hidden), dtype),
        (torch.randn(vocab, hidden, device=runtime.DEVICE) / hidden**0.5).to(dtype).requires_grad_(),
        torch.randint(0, vocab, (n_tokens,), device=runtime.DEVICE),
    ]


def _liger(name: str, **kwargs):
    """A Liger-Kernel functional op, imported only when asked for."""

    def build():
        from liger_kernel.transformers import functional

        fn = getattr(functional, name)
        return lambda *args: fn(*args, **kwargs)

    return build


def _cut_cross_entropy():
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy


def _peers(op: str, ours: Callable[..., object], liger: Callable[[], Callable[..., object]] | None):
    impls = {"liger_lab": lambda: ours}
    if liger is not None:
        impls["liger"] = liger
    specification = getattr(reference, op)
    impls["torch_compile"] = lambda: torch.compile(specification)
    impls["eager"] = lambda: specification
    return impls


OPS: dict[str, OpBench] = {
    "rms_norm": OpBench(
        "rms_norm", (16384, 4096), _norm_inputs, fwd_passes=2, full_passes=5,
        impls=_peers("rms_norm", lambda x, w: liger_lab.rms_norm(x, w, 1e-6, in_place_backward=True),
                     _liger("liger_rms_norm", eps=1e-6)),
    ),
    "layer_norm": OpBench(
        "layer_norm", (16384, 4096),
        lambda shape, dtype: _norm_inputs(shape, dtype) + [_randn(shape[-1], dtype)],
        fwd_passes=2, full_passes=5,
        impls=_peers("layer_norm", lambda x, w, b: liger_lab.layer_norm(x, w, b, 1e-5),
                     _liger("liger_layer_norm", eps=1e-5)),
    ),
    "rope": OpBench(
        "rope", (4, 32, 8, 4096, 128), _rope_inputs, fwd_passes=2, full_passes=4,
        impls=_peers("rope", lambda q, k, cos, sin: liger_lab.rope(q, k, cos, sin), _liger("liger_rope")),
        elements=lambda s: s[0] * (s[1] + s[2]) * s[3] * s[4],
    ),
    "swiglu": OpBench(
        "swiglu", (16384, 14336), _glu_inputs, fwd_passes=3, full_passes=8,
        impls=_peers("swiglu", lambda g, u: liger_lab.swiglu(g, u, in_place_backward=True), _liger("liger_swiglu")),
    ),
    "geglu": OpBench(
        "geglu", (16384, 14336), _glu_inputs, fwd_passes=3, full_passes=8,
        impls=_peers("geglu", lambda g, u: liger_lab.geglu(g, u, in_place_backward=True), _liger("liger_geglu")),
    ),
    "cross_entropy": OpBench(
        "cross_entropy", (8192, 128256), _ce_inputs, fwd_passes=1, full_passes=3,
        impls=_peers("cross_entropy", lambda z, t: liger_lab.cross_entropy(z, t), _liger("liger_cross_entropy")),
        graph_timing=False,
    ),
    "flce": OpBench(
        "flce", (8192, 4096, 128256), _flce_inputs, fwd_passes=0, full_passes=0,
        impls={
            **_peers("fused_linear_cross_entropy",
                     lambda h, w, t: liger_lab.fused_linear_cross_entropy(h, w, t, in_place_backward=True),
                     _liger("liger_fused_linear_cross_entropy")),
            "cce": _cut_cross_entropy,
        },
        elements=lambda s: s[0] * s[2],
        flops=lambda s: 6.0 * s[0] * s[1] * s[2],
        graph_timing=False,
    ),
}  # fmt: skip


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
