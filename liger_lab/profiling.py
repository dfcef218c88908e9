"""Measuring kernels honestly: time, peak memory, bytes moved, bandwidth fraction, and the plots.

Every figure here is measured the same way for every implementation, in the same process:

* time: the median of many calls. On the GPU, forward and forward+backward are captured in a CUDA graph
  and replayed (``triton.testing.do_bench_cudagraph``), so the figure is GPU time, not the Python and
  launch overhead that dominates a 0.1 ms op; where capture is impossible (an op that reads a value back
  to the host), the sum of its kernels' durations under ``torch.profiler``. The row's ``timer`` says which
  (:func:`gpu_time_ms` chooses), and the wall time of a call (``triton.testing.do_bench``) stands next to it.
  On CPU a wall clock that times the interpreter, labelled as such, never to be read as GPU speed;
* peak memory: ``torch.cuda.max_memory_allocated`` during one forward+backward, above what was already
  allocated (the inputs and the upstream gradient); not measurable on CPU;
* bytes moved: the fewest bytes the op must read and write (each input once, each output once) — the
  floor no kernel beats; achieved bandwidth is that count over the measured time, and the fraction is
  against a copy measured on the same GPU.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import platform
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import triton
from tqdm import TqdmWarning

import liger_lab
from liger_lab import runtime

MIB = 2**20


def _import_tqdm_auto_quietly() -> None:
    """Import ``tqdm.auto`` once, without its warning that ipywidgets is missing.

    transformers, huggingface_hub and accelerate import ``tqdm.auto``. In a Jupyter kernel without ipywidgets it
    warns (``TqdmWarning: IProgress not found``) and falls back to tqdm's text bars, which is what the workbook
    wants: it installs no ipywidgets. The warning says nothing a learner can act on, so it is silenced here, that
    one warning only. Every chapter imports this module (directly, or through ``bench`` and ``e2e``) before
    transformers, and a module is imported once: the later imports find it and do not warn."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        import tqdm.auto  # noqa: F401


_import_tqdm_auto_quietly()


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn()`` (see :func:`liger_lab.runtime.measure_ms` for how)."""
    return runtime.measure_ms(fn)


def gpu_time_ms(fn: Callable[[], object], *, graph: bool = True) -> tuple[float, str]:
    """Median time of ``fn()`` on the benchmark protocol's clock, and the clock's name (a row's ``timer``).

    ``"cuda_graph"``: replayed from a CUDA graph, GPU time without Python and launch overhead; tried only when
    ``graph`` is set, since a failed capture (an op that reads a value back to the host) leaves the CUDA RNG
    unusable. ``"profiler"``: the sum of its kernels' durations under ``torch.profiler``, for what no graph
    captures. ``"wall_clock"``: the interpreter's host time, which says nothing about GPU speed.
    """
    if graph:
        ms = runtime.measure_graph_ms(fn)
        if ms is not None:
            return ms, "cuda_graph"
    with warnings.catch_warnings():
        # torch.profiler warns, once per process, that a profile keeps only its last cycle's events: a kernel sum
        # profiles a single cycle, so there is nothing to lose. Other warnings of the measured calls still show.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
        ms = runtime.measure_kernel_sum_ms(fn)
    if ms:  # None in the interpreter
        return ms, "profiler"
    return time_ms(fn), "wall_clock"


def peak_memory_mib(fn: Callable[[], object]) -> float | None:
    """Peak MiB that ``fn()`` allocates above what was allocated before it; None where not measurable."""
    peak = runtime.peak_memory_bytes(fn)
    return None if peak is None else peak / MIB


def bytes_moved(n_elements: int, passes: float, dtype: torch.dtype = torch.bfloat16) -> int:
    """Minimum bytes of ``passes`` full passes over ``n_elements`` values of ``dtype``.

    RMSNorm forward reads x and writes y: 2 passes; forward+backward adds x, dy read and dx written: 5.
    """
    return int(n_elements * passes * torch.empty((), dtype=dtype).element_size())


def achieved_gbs(n_bytes: int, ms: float) -> float:
    return n_bytes / (ms * 1e-3) / 1e9


_copy_ceiling: dict[str, float] = {}


def copy_bandwidth_gbs(n_bytes: int = 2**31) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written per second, in GB/s); None on CPU."""
    if runtime.INTERPRET:
        return None
    if "gbs" not in _copy_ceiling:
        src = torch.empty(n_bytes // 2, dtype=torch.uint8, device=runtime.DEVICE).random_()
        dst = torch.empty_like(src)
        _copy_ceiling["gbs"] = achieved_gbs(n_bytes, time_ms(lambda: dst.copy_(src)))
    return _copy_ceiling["gbs"]


def matmul_tflops(n: int = 8192) -> float | None:
    """bf16 matrix-product rate of this GPU on random data (TFLOP/s); None on CPU."""
    if runtime.INTERPRET:
        return None
    a = torch.randn(n, n, device=runtime.DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=runtime.DEVICE, dtype=torch.bfloat16)
    return 2 * n**3 / (time_ms(lambda: a @ b) * 1e-3) / 1e12


@dataclass
class Result:
    """One implementation of one op, measured."""

    op: str
    impl: str
    fwd_ms: float
    full_ms: float
    peak_mib: float | None
    fwd_gbs: float | None = None
    full_gbs: float | None = None
    full_tflops: float | None = None
    bandwidth_fraction: float | None = None
    timer: str = "do_bench"
    """The clock of ``full_ms`` (see :func:`gpu_time_ms`)."""
    wall_ms: float | None = None
    """Forward+backward per call as a user without CUDA graphs sees it (CUDA events around each call), on the
    GPU whatever the clock of ``full_ms``."""

    def as_row(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def forward_backward_of(fn: Callable[..., object], inputs: list) -> Callable[[], None]:
    """A call of ``fn(*inputs)`` and the gradients of every input that requires grad: each differentiable output
    gets an upstream gradient made once here (1 for a scalar loss, what ``loss.backward()`` passes; random for
    anything else, such as per-token outputs)."""
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    outputs = _tensors(fn(*inputs))
    upstream = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outputs]
    del outputs

    def forward_backward() -> None:
        torch.autograd.grad(_tensors(fn(*inputs)), leaves, upstream)

    return forward_backward


def _tensors(value) -> list[torch.Tensor]:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]


def measure(
    op: str,
    impl: str,
    fn: Callable[..., object],
    make_inputs: Callable[[], Sequence[object]],
    *,
    fwd_bytes: int | None = None,
    full_bytes: int | None = None,
    full_flops: float | None = None,
    graph: bool = True,
) -> Result:
    """Time ``fn`` forward and forward+backward on fresh inputs, and its peak memory.

    ``make_inputs()`` returns the positional arguments; tensors that require grad get gradients.
    ``graph=False`` skips CUDA-graph capture (for ops that cannot be captured). The upstream gradient
    is random (1 for a scalar loss, as in training) and allocated before the
    measurement starts, so peak memory counts only what the implementation itself allocates.
    """
    inputs = list(make_inputs())
    forward_backward = forward_backward_of(fn, inputs)

    def forward():
        return fn(*inputs)

    peak = peak_memory_mib(forward_backward)
    full_ms, timer = gpu_time_ms(forward_backward, graph=graph)
    fwd_ms, _ = gpu_time_ms(forward, graph=timer == "cuda_graph")
    # In the interpreter full_ms already is a wall clock.
    wall_ms = None if runtime.INTERPRET else time_ms(forward_backward)
    result = Result(op, impl, fwd_ms, full_ms, peak, timer=timer, wall_ms=wall_ms)
    if fwd_bytes is not None:
        result.fwd_gbs = achieved_gbs(fwd_bytes, fwd_ms)
    if full_bytes is not None:
        result.full_gbs = achieved_gbs(full_bytes, full_ms)
        ceiling = copy_bandwidth_gbs()
        if ceiling:
            result.bandwidth_fraction = result.full_gbs / ceiling
    if full_flops is not None:
        result.full_tflops = full_flops / (full_ms * 1e-3) / 1e12
    return result


def result_line(r: Result) -> str:
    """One measured implementation in a line (op, implementation, time and clock, peak memory): what a long run
    prints as each measurement finishes."""
    wall = "" if r.wall_ms is None else f", wall {r.wall_ms:.3f} ms"
    peak = "n/a" if r.peak_mib is None else f"{r.peak_mib:.0f} MiB"
    return f"{r.op:<28}{r.impl:<28}fwd+bwd {r.full_ms:9.3f} ms ({r.timer}{wall})  peak {peak}"


def print_table(results: Sequence[Result]) -> None:
    """A fixed-width table of results, fastest forward+backward first within each op."""
    print(f"timer: {runtime.timer_label()}")
    width = max([14, *(len(r.op) + 2 for r in results)])
    header = f"{'op':<{width}}{'impl':<24}{'fwd ms':>10}{'fwd+bwd ms':>12}{'wall ms':>9}{'peak MiB':>10}"
    print(f"{header}{'GB/s':>9}{'of copy':>9}  timer")
    for r in sorted(results, key=lambda r: (r.op, r.full_ms)):
        peak = "n/a" if r.peak_mib is None else f"{r.peak_mib:.0f}"
        wall = "" if r.wall_ms is None else f"{r.wall_ms:.3f}"
        gbs = "" if r.full_gbs is None else f"{r.full_gbs:.3g}"
        frac = "" if r.bandwidth_fraction is None else f"{r.bandwidth_fraction:.0%}"
        row = f"{r.op:<{width}}{r.impl:<24}{r.fwd_ms:>10.3f}{r.full_ms:>12.3f}{wall:>9}{peak:>10}"
        print(f"{row}{gbs:>9}{frac:>9}  {r.timer}")


def plot_results(results: Sequence[Result], title: str = "", floor_ms: float | None = None):
    """Bar charts of forward and forward+backward time and of peak memory, one bar per implementation."""
    import matplotlib.pyplot as plt

    impls = [r.impl for r in results]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 3.6))
    xs = range(len(results))
    width = 0.38
    ax_time.bar([x - width / 2 for x in xs], [r.fwd_ms for r in results], width, label="forward")
    ax_time.bar([x + width / 2 for x in xs], [r.full_ms for r in results], width, label="forward+backward")
    if floor_ms is not None:
        # A matmul-bound op's results carry TFLOP/s, and its floor is its FLOPs at the measured matmul rate.
        flops = any(r.full_tflops is not None for r in results)
        label = "FLOPs / matmul rate" if flops else "bytes / copy bandwidth"
        ax_time.axhline(floor_ms, color="k", ls="--", lw=1, label=label)
    ax_time.set_xticks(list(xs), impls, rotation=15)
    ax_time.set_ylabel("ms" if not runtime.INTERPRET else "ms (CPU interpreter wall clock)")
    ax_time.legend(fontsize=8)
    ax_time.set_title("time (lower is better)")
    peaks = [r.peak_mib if r.peak_mib is not None else math.nan for r in results]
    ax_mem.bar(list(xs), peaks, color="tab:green")
    ax_mem.set_xticks(list(xs), impls, rotation=15)
    ax_mem.set_ylabel("MiB above inputs")
    ax_mem.set_title("peak memory, forward+backward" + (" (GPU only)" if runtime.INTERPRET else ""))
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def liger_kernel_installed() -> bool:
    """Whether Liger-Kernel, the peer every benchmark row compares with, is importable here."""
    return importlib.util.find_spec("liger_kernel") is not None


def environment() -> dict:
    """GPU name, versions and the date (UTC), recorded with every result row."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "gpu": torch.cuda.get_device_name() if not runtime.INTERPRET else f"cpu ({platform.processor() or 'unknown'})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "liger_lab": liger_lab.__version__,
    }
    if liger_kernel_installed():
        from importlib.metadata import version

        info["liger_kernel"] = version("liger-kernel")
    return info
