"""The benchmark protocol (`benchmarks/notes/README.md`): every op, every implementation, one process.

Each :class:`OpBench` knows its shape on the GPU (the protocol shape) and a small one for the CPU
interpreter, how to make fresh random inputs, the fewest bytes the op must move, and which
implementations exist here: ``liger_lab`` (the public call with no options), ``liger_lab:<variant>``
(an opt-in such as ``in_place_backward=True``, a row of its own), ``eager`` (the plain PyTorch reference),
``torch_compile`` (the same reference through ``torch.compile``, GPU only) and ``liger`` (Liger-Kernel, when
installed). The ops, shapes and peers come from the one table, :data:`liger_lab.op_table.OPS`.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from liger_lab import profiling, runtime
from liger_lab.op_table import OPS as TABLE
from liger_lab.op_table import OpSpec
from liger_lab.profiling import environment, liger_kernel_installed


@dataclass
class OpBench:
    name: str
    shape: tuple[int, ...]
    make_inputs: Callable[[tuple[int, ...], torch.dtype], list[object]]
    fwd_passes: float
    full_passes: float
    impls: dict[str, Callable[[], Callable[..., object]]] = field(default_factory=dict)
    elements: Callable[[tuple[int, ...]], int] = math.prod
    flops: Callable[[tuple[int, ...]], float] | None = None
    # CUDA-graph timing for short ops; ops that read a value back to the host (a target range check)
    # cannot be captured, and a failed capture leaves the CUDA RNG unusable, so they never try.
    graph_timing: bool = True

    def unavailable_reason(self, impl: str) -> str | None:
        """Why ``impl`` cannot run here (None when it can): the peers need a GPU, and a package for theirs."""
        if impl not in self.impls:
            return f"{self.name} has no implementation {impl!r}"
        peer = impl.split(":")[0]
        if peer in ("torch_compile", "liger", "cce") and runtime.INTERPRET:
            return "runs on a CUDA GPU only (Triton's interpreter runs liger_lab's kernels, not the peers')"
        if peer == "liger" and not liger_kernel_installed():
            return "Liger-Kernel is not installed (pip install liger-kernel)"
        if peer == "trl" and importlib.util.find_spec("trl") is None:
            return "TRL is not installed (pip install 'trl>=1.16')"
        if peer == "cce" and importlib.util.find_spec("cut_cross_entropy") is None:
            return "cut-cross-entropy is not installed (pip install cut-cross-entropy)"
        return None

    def available(self) -> dict[str, Callable[..., object]]:
        """Implementations that run here, built on demand (torch.compile only on the GPU)."""
        return {impl: build() for impl, build in self.impls.items() if self.unavailable_reason(impl) is None}

    def run(self, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.bfloat16,
            impls: Iterable[str] | None = None) -> list[profiling.Result]:  # fmt: skip
        shape = shape or self.shape
        n = self.elements(shape)
        results = []
        for impl, fn in self.available().items():
            if impls is not None and impl not in impls:
                continue
            if impl == "torch_compile":
                # Compile for this shape alone, as a fixed-shape training run does. Code compiled for earlier
                # shapes would make this one a dynamic-shape graph, and past Dynamo's recompile limit the
                # "compiled" row would run eager (Dynamo only warns).
                torch.compiler.reset()
            try:
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
            finally:  # an implementation that ran out of memory must not leave its blocks to the next one
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


def _impls(spec: OpSpec) -> dict[str, Callable[[], Callable[..., object]]]:
    """``liger_lab`` is the public call with no options; each opt-in variant is a row of its own."""
    impls = {"liger_lab": spec.call}
    for label, options in spec.variants.items():
        impls[f"liger_lab:{label}"] = lambda options=options: spec.call(**options)
    if spec.liger is not None:
        impls["liger"] = _liger(spec.liger[0], **spec.liger[1])
    impls.update(spec.liger_modules)
    impls["torch_compile"] = lambda: torch.compile(spec.reference)
    impls["eager"] = lambda: spec.reference
    if spec.name == "fused_linear_cross_entropy":
        impls["cce"] = _cut_cross_entropy
    return impls


OPS: dict[str, OpBench] = {
    name: OpBench(
        name, spec.bench_shape, spec.make_inputs, spec.fwd_passes, spec.full_passes, _impls(spec),
        elements=spec.elements, flops=spec.flops, graph_timing=spec.graph_timing,
    )
    for name, spec in TABLE.items()
}  # fmt: skip
"""The benchmark of every op of :data:`liger_lab.op_table.OPS`, by name."""


def small_shape(op: OpBench) -> tuple[int, ...]:
    """A shape the CPU interpreter runs in about a second."""
    return tuple(max(1, min(s, 256)) for s in op.shape)


def op_shape(op: OpBench, small: bool = False) -> tuple[int, ...]:
    """The benchmark-protocol shape on the GPU, a small one in the interpreter (or when asked)."""
    return small_shape(op) if small or runtime.INTERPRET else op.shape


def run_op_benchmarks(
    ops: Sequence[str],
    *,
    impls: Sequence[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    shapes: dict[str, tuple[int, ...]] | None = None,
    small: bool = False,
    report: Callable[[profiling.Result], None] | None = None,
) -> tuple[list[profiling.Result], list[str]]:
    """Measure every available implementation of each op; returns (results, failures).

    An implementation that raises is listed in ``failures`` and the others still run; so is one asked for in
    ``impls`` that cannot run here, with the reason. ``report``, when given, gets each result as soon as it is
    measured (and replaces the progress bar).
    """
    jobs, failures = [], []
    for name in ops:
        for impl in [impl for impl in impls or OPS[name].impls if impl in OPS[name].impls]:
            reason = OPS[name].unavailable_reason(impl)
            if reason is None:
                jobs.append((name, impl))
            elif impls:
                failures.append(f"{name} {impl}: not measured: {reason}")
    results = []
    for name, impl in tqdm(jobs, desc="benchmarking", unit="impl", disable=True if report else None, leave=False):
        shape = (shapes or {}).get(name) or op_shape(OPS[name], small)
        try:
            measured = OPS[name].run(shape, dtype, impls=[impl])
        except Exception as error:  # one failing implementation must not hide the others' numbers
            failures.append(f"{name} {impl} {shape}: {type(error).__name__}: {error}")
            continue
        results += measured
        if report is not None:
            for result in measured:
                report(result)
    return results, failures


def plot_ops(results: Sequence[profiling.Result], title: str = ""):
    """One panel per op: forward+backward time of each implementation, with its speed-up over eager."""
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in results))
    if len(ops) == 1:
        return profiling.plot_results(results, title=title or ops[0])
    cols = min(3, len(ops))
    fig, axes = plt.subplots(
        math.ceil(len(ops) / cols), cols, figsize=(4.2 * cols, 3.2 * math.ceil(len(ops) / cols)), squeeze=False
    )
    for ax, op in zip(axes.flat, ops, strict=False):
        rows = [r for r in results if r.op == op]
        eager = next((r.full_ms for r in rows if r.impl == "eager"), None)
        bars = ax.bar([r.impl for r in rows], [r.full_ms for r in rows])
        if eager:
            ax.bar_label(bars, [f"{eager / r.full_ms:.2f}x" for r in rows], fontsize=8)
        ax.set_title(op)
        ax.set_ylabel("fwd+bwd ms" if not runtime.INTERPRET else "fwd+bwd ms (CPU interpreter)")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    fig.suptitle(title or "forward+backward time (labels: speed-up over eager)")
    fig.tight_layout()
    return fig


def plot_shape_sweep(rows: Sequence[dict], ours: str = "liger_lab"):
    """One small panel per op: the time of ``ours`` over each peer's at the same shape, against the shape's
    elements (log scale), with a line at 1: a point above it is a shape where ``ours`` is slower.

    ``rows`` are those of ``benchmarks/sweep_shapes.py`` (``liger_lab.workbook.results.load`` reads a committed file):
    op, impl, shape, series (the line a shape belongs to, e.g. "hidden 4096"), elements, gpu_ms and clock. A point whose
    two rows were timed by different clocks is drawn as a cross.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    timed = [r for r in rows if r.get("gpu_ms")]
    by_key = {(r["op"], r["impl"], tuple(r["shape"])): r for r in timed}
    ops = [name for name in OPS if any(r["op"] == name for r in timed)]
    peers = [impl for impl in dict.fromkeys(r["impl"] for r in timed) if impl != ours]
    cols = max(1, min(4, len(ops)))
    grid_rows = max(1, math.ceil(len(ops) / cols))
    fig, axes = plt.subplots(grid_rows, cols, figsize=(3.8 * cols, 3.0 * grid_rows), squeeze=False)
    styles = {peer: ("-", "--", ":", "-.")[index % 4] for index, peer in enumerate(peers)}
    for ax, op in zip(axes.flat, ops, strict=False):
        ax.axhline(1.0, color="k", lw=0.8)
        series = list(dict.fromkeys(r["series"] for r in timed if r["op"] == op))
        for index, (name, peer) in enumerate((name, peer) for name in series for peer in peers):
            points = []  # (elements, time ratio, whether the two rows used different clocks)
            for r in timed:
                theirs = by_key.get((op, peer, tuple(r["shape"])))
                if (r["op"], r["impl"], r["series"]) == (op, ours, name) and theirs:
                    points.append((r["elements"], r["gpu_ms"] / theirs["gpu_ms"], r["clock"] != theirs["clock"]))
            points.sort()
            color = f"C{index % 10}"
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], styles[peer], color=color,
                        label=f"{name}, vs {peer}")  # fmt: skip
            for x, ratio, mixed in points:
                ax.plot(x, ratio, "x" if mixed else "o", color=color, ms=4)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks of a short log axis overlap
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("elements", fontsize=8)
        ax.set_ylabel(f"time {ours} / peer", fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.lines[1:]:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    clocks = {r["clock"] for r in timed}
    where = ", ".join(dict.fromkeys(r.get("gpu", "?") for r in timed))
    clock = "the interpreter's wall clock, not GPU speed" if clocks == {"wall_clock"} else "GPU time"
    fig.suptitle(f"forward+backward time of {ours} over each peer's, {where} ({clock}); above 1: {ours} slower",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    return fig


def write_json(results: list[profiling.Result], path: Path, extra: dict | None = None) -> None:
    write_rows([{**r.as_row(), **(extra or {})} for r in results], path)


def write_rows(rows: list[dict], path: Path) -> None:
    """Result rows as a JSON list, each with the GPU, the versions and the date (:func:`environment`)."""
    env = environment()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{**row, **env} for row in rows], indent=1) + "\n")
