"""Where kernels run: the one module that knows GPU from Triton's interpreter.

On a machine with CUDA, kernels compile for the GPU and take CUDA tensors. Without CUDA, this module
sets ``TRITON_INTERPRET=1`` *before* Triton is first imported, so the very same ``@triton.jit``
functions run (slowly) on CPU tensors through Triton's interpreter. Everything else in liger_lab asks
this module instead of checking ``torch.cuda`` itself: the device to allocate on, how many programs
to launch, how many warps, how to time a callable and how to read peak memory.

Setting ``TRITON_INTERPRET=1`` yourself forces the interpreter even on a GPU machine (useful to debug a
kernel with ``print``).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

_T = TypeVar("_T")


def _choose_interpreter() -> bool:
    requested = os.environ.get("TRITON_INTERPRET")
    if requested is not None:
        return requested == "1"
    if torch.cuda.is_available():
        return False
    if "triton" in sys.modules:
        raise RuntimeError(
            "liger_lab: this machine has no CUDA GPU, so Triton kernels must run in Triton's interpreter, "
            "but Triton was imported before liger_lab without TRITON_INTERPRET=1 and can no longer switch. "
            "Fix: restart the Python process (Jupyter: Kernel > Restart) and `import liger_lab` before "
            "anything that imports triton, or set the variable first: "
            "`import os; os.environ['TRITON_INTERPRET'] = '1'`."
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return True


INTERPRET: bool = _choose_interpreter()
"""True when kernels run in Triton's interpreter on CPU tensors."""

import triton  # noqa: E402  (must follow the TRITON_INTERPRET decision above)


def _round_bf16_casts_in_interpreter() -> None:
    """Make the interpreter round fp32 -> bf16 casts to nearest even, as the GPU (and torch) do.

    Triton's interpreter keeps the top 16 bits of an fp32 value, which truncates: a bf16 result computed on CPU
    then differs from the GPU's and from PyTorch's by up to one bf16 ulp (0.0078 relative). Every kernel casts
    with ``.to(ptr.dtype.element_ty)`` before a store, and all those casts go through the interpreter's
    ``cast_impl``, so rounding there makes every bf16 store round like the GPU. Other casts are left to it."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "rounds_bf16", False):
        return
    truncating_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncating_cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # ties to even
        nan = np.isnan(src.data)
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)  # stays a (quiet) NaN of the same sign
        return interpreter.TensorHandle(rounded.reshape(np.shape(src.data)), dst_type.scalar)

    cast_impl.rounds_bf16 = True
    builder.cast_impl = cast_impl
    builder.create_fp_trunc = cast_impl


if INTERPRET:
    _round_bf16_casts_in_interpreter()

DEVICE: torch.device = torch.device("cpu") if INTERPRET else torch.device("cuda")
"""The device liger_lab's kernels expect their tensors on."""

HOST_READS_WAIT: bool = not INTERPRET
"""Whether reading a tensor's values on the host (``.tolist()``, ``.item()``) waits for the device. On the GPU it
does, every step, and a CUDA graph cannot capture it: the fused losses keep their counts and checks on the device
there. In the interpreter tensors are host memory, so input checks may read values before any work."""

BACKEND: str = "triton-interpreter (CPU)" if INTERPRET else "cuda"

# The interpreter costs about a millisecond per program instance: keep CPU grids small and tiles big.
_INTERPRETER_MAX_PROGRAMS = 64
# Largest tile (elements) one program holds in registers on the GPU before spilling hurts.
_GPU_MAX_TILE = 16384
MAX_ROW_SIZE = 65536
"""Largest row (hidden size) the row-wise kernels hold in one tile."""


def pick(*, cpu: _T, gpu: _T) -> _T:
    """Choose a value by where kernels run, e.g. a problem size: ``pick(cpu=256, gpu=16384)``."""
    return cpu if INTERPRET else gpu


def describe() -> str:
    """One line naming where kernels run, for notebook headers and the CLI."""
    if INTERPRET:
        return f"Triton {triton.__version__} interpreter on CPU (no CUDA GPU): kernels are exact but slow"
    name = torch.cuda.get_device_name()
    return f"{name}, {sm_count()} SMs, Triton {triton.__version__}, torch {torch.__version__}"


def shared_memory_bytes() -> int:
    """Shared memory one program may use on the current GPU (the interpreter has no limit; a nominal 228 KiB)."""
    if INTERPRET:
        return 228 * 1024
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    # An older torch lacks the field: 99 KiB, the opt-in limit of Ampere's and Ada's consumer parts, the least of
    # the GPUs whose loads Triton pipelines.
    return getattr(properties, "shared_memory_per_block_optin", 99 * 1024)


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (a nominal 4 in the interpreter)."""
    if INTERPRET:
        return 4
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def check_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor lives where the kernels run."""
    for name, tensor in tensors.items():
        if INTERPRET and tensor.device.type != "cpu":
            raise ValueError(
                f"{name} is on {tensor.device}, but kernels run in Triton's interpreter here: expected a CPU tensor"
            )
        if not INTERPRET and tensor.device.type != "cuda":
            raise ValueError(f"{name} is on {tensor.device}, but kernels run on the GPU here: expected a CUDA tensor")


_NO_CONTEXT = contextlib.nullcontext()


def device_context(device: torch.device) -> contextlib.AbstractContextManager:
    """What a kernel launch for tensors on ``device`` runs in: that GPU made the current device, so Triton, which
    launches on the current device and on torch's current stream of it, launches where the tensors are and after
    the work queued to make them. Nothing on CPU (the interpreter), nor when that GPU is already current: the
    common case, where a ``torch.cuda.device`` guard alone would add its Python to every launch."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _NO_CONTEXT
    return torch.cuda.device(device)


def launch_kernel(kernel: Callable[..., object], grid: tuple[int, ...], *args: object, **kwargs: object) -> object:
    """``kernel[grid](*args, **kwargs)`` on the device of its first tensor argument (:func:`device_context`).

    Every launch in liger_lab goes through here. Triton itself launches on the current device whatever its
    arguments' device: in a model split over GPUs in one process (``device_map="auto"``, layers placed by hand),
    a layer on GPU 1 called while GPU 0 is current would launch on GPU 0 with pointers into GPU 1's memory, on
    a stream unordered with the work that made its inputs."""
    device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
    with device_context(device):
        return kernel[grid](*args, **kwargs)


@dataclass(frozen=True)
class RowLaunch:
    """How a row-wise kernel tiles an (n_rows, n_cols) matrix: rows x block_n elements per program."""

    block_n: int
    rows: int
    num_warps: int
    grid: int
    num_stages: int = 1
    """Tiles of a persistent loop in flight at once: above 1, Triton loads the next tiles while this one computes."""


def row_launch(n_rows: int, n_cols: int, *, gpu_tile: int = _GPU_MAX_TILE // 4, warp_elements: int = 512) -> RowLaunch:
    """Tile for kernels where each program normalises whole rows (one program per tile of rows): on the GPU,
    whole rows up to ``gpu_tile`` elements a program, a warp per ``warp_elements``. The defaults measured fastest
    for RMSNorm's forward at 4096 columns on an H200 (one row under 8 warps); LayerNorm's, which holds more per
    element, passes its own (benchmarks/notes/layer_norm.md)."""
    if n_cols > MAX_ROW_SIZE:
        raise ValueError(f"rows of {n_cols} elements are too long: expected at most {MAX_ROW_SIZE}")
    block_n = triton.next_power_of_2(max(n_cols, 1))
    if INTERPRET:
        # Cost is per program and per statement, not per element: a few programs with tiles of up to
        # 64 rows (or 64k elements), so a small model's norms take 4 programs instead of one per row.
        rows = min(triton.next_power_of_2(triton.cdiv(n_rows, 4)), max(64, 2**16 // block_n))
        return RowLaunch(block_n, rows, 1, triton.cdiv(n_rows, rows))
    # Several short rows per program keep enough bytes in flight; long rows get more warps instead.
    rows = max(1, min(gpu_tile // block_n, 16))
    num_warps = max(1, min(16, rows * block_n // warp_elements))
    return RowLaunch(block_n, rows, num_warps, triton.cdiv(n_rows, rows))


def persistent_row_launch(n_rows: int, n_cols: int, *, stream_bytes: int = 4) -> RowLaunch:
    """Tile for persistent kernels: a fixed grid whose programs loop over row tiles (backward of norms).
    ``stream_bytes``: the bytes per column of one row that the loop loads (x and dy in bf16: 4).

    Measured on an H200 (benchmarks/notes/rms_norm.md): one program per SM, which keeps the dW partials to one
    row per SM. Each takes 2 rows of 4096 under 8 warps with three tiles in flight (Triton loads the next two
    while it computes one): 0.92x RMSNorm's backward time and 0.82x the fused add's against one tile of 4 rows
    under 16 warps. Where three tiles do not fit in shared memory (fp32, very long rows) it keeps that one
    tile of 4 rows: the pipelined small tile alone measured slower.
    """
    if n_cols > MAX_ROW_SIZE:
        raise ValueError(f"rows of {n_cols} elements are too long: expected at most {MAX_ROW_SIZE}")
    if INTERPRET:
        return row_launch(n_rows, n_cols)
    block_n = triton.next_power_of_2(max(n_cols, 1))

    def launch(rows: int, num_stages: int) -> RowLaunch:
        num_warps = max(4, min(16, rows * block_n // 1024))
        return RowLaunch(block_n, rows, num_warps, max(1, min(triton.cdiv(n_rows, rows), sm_count())), num_stages)

    pipelined_rows = max(1, min(_GPU_MAX_TILE // 2 // block_n, 16))
    # A quarter of shared memory left for the compiler's own use (the reductions' scratch).
    if 3 * pipelined_rows * block_n * stream_bytes <= shared_memory_bytes() * 3 // 4:
        return launch(pipelined_rows, 3)
    return launch(max(1, min(_GPU_MAX_TILE // block_n, 16)), 1)


def streaming_row_launch(n_rows: int, n_cols: int, *, gpu_tile: int = _GPU_MAX_TILE // 2) -> RowLaunch:
    """Tile for kernels that stream rows too long for registers (a vocabulary) in steps of block_n columns.

    Each program takes ``rows`` whole rows and loops over their columns, ``gpu_tile`` elements at a time on the
    GPU, with a warp per 512 of them (4 to 16). The default, a long row in 8192-column blocks under 16 warps,
    measured fastest for the cross-entropy with 8192 rows of 128k (bf16) on an H200 once its second pass ran
    backwards to reuse L2 (benchmarks/notes/cross_entropy.md). A kernel with more arithmetic per element
    (the JSD) holds more registers per element and passes a smaller tile.
    """
    if INTERPRET:
        # The interpreter's cost is per program and per statement, not per element: few programs, big tiles.
        block_n = min(triton.next_power_of_2(max(n_cols, 1)), 16384)
        rows = min(triton.next_power_of_2(triton.cdiv(n_rows, 2)), max(1, 2**20 // block_n))
        return RowLaunch(block_n, rows, 1, max(1, triton.cdiv(n_rows, rows)))
    block_n = min(triton.next_power_of_2(max(n_cols, 1)), gpu_tile)
    rows = max(1, min(gpu_tile // block_n, 16))
    num_warps = max(4, min(16, rows * block_n // 512))
    return RowLaunch(block_n, rows, num_warps, max(1, triton.cdiv(n_rows, rows)))


def column_sum_launch(n_rows: int, n_cols: int) -> RowLaunch:
    """Tile for summing a few hundred rows of fp32 partials down their columns (the norms' dw, db): ``rows`` rows
    by ``block_n`` columns a step, one program per strip of columns. On the GPU a strip of 16 columns under 4
    warps takes all of an SM count's rows in one step, so each program waits on memory once: that measured
    fastest on an H200 (2 us for 132 x 8192; benchmarks/notes/layer_norm.md)."""
    if INTERPRET:
        block_n = min(triton.next_power_of_2(max(n_cols, 1)), 2**16)
        rows = min(triton.next_power_of_2(max(n_rows, 1)), max(1, 2**18 // block_n))
        return RowLaunch(block_n, rows, 1, triton.cdiv(n_cols, block_n))
    return RowLaunch(16, min(triton.next_power_of_2(max(n_rows, 1)), 256), 4, triton.cdiv(n_cols, 16))


class ElementwiseLaunch(NamedTuple):
    """How a flat elementwise kernel splits n elements: blocks of ``block``, one per program. A tuple, so
    ``block, num_warps, grid = elementwise_launch(n)`` unpacks it."""

    block: int
    num_warps: int
    grid: int


def elementwise_launch(n_elements: int) -> ElementwiseLaunch:
    """Blocks for a flat elementwise kernel: on the GPU 1024 elements a program under 4 warps, the tile
    torch.compile's generated kernels take. For SwiGLU at 16384 x 14336 on an H200 it brought the forward from
    0.3229 to 0.3211 ms against 4096 under 8, and forward+backward to 0.8643 ms (0.8661 with the backward still at
    4096 under 8), level with torch.compile's 0.8639 (benchmarks/notes/swiglu.md)."""
    if INTERPRET:
        # The interpreter pays per program, not per element: about four big programs, at most 2**20 each.
        block = min(max(1024, triton.next_power_of_2(triton.cdiv(n_elements, 4))), 2**20)
        return ElementwiseLaunch(block, 1, triton.cdiv(n_elements, block))
    return ElementwiseLaunch(1024, 4, triton.cdiv(n_elements, 1024))


def read_later(values: torch.Tensor) -> Callable[[], list]:
    """Start copying a small tensor to the host without waiting for it; the returned function waits for
    that copy alone (not for kernels launched after this call) and returns the values as a list.

    A plain ``.tolist()`` stops the host until the GPU has drained its queue, and the GPU then idles
    until the host launches the next kernel. Reading later lets a big kernel be queued first.
    """
    if INTERPRET:
        return values.tolist
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(values.device))  # the copy's stream, on the values' GPU

    def wait() -> list:
        copied.synchronize()
        return host.tolist()

    return wait


def synchronize() -> None:
    if not INTERPRET:
        torch.cuda.synchronize()


def measure_ms(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100, min_calls: int = 20) -> float:
    """Median time of ``fn()`` in milliseconds.

    On the GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls) over ``rep_ms``, or
    over ``min_calls`` calls when those take longer: a 45 ms op would get only two calls in 100 ms, and
    the median of two is noise. In the interpreter ``do_bench`` does not work, so this is a host wall
    clock over a few calls: it times Python and the interpreter, not a kernel, and says nothing about
    GPU speed.
    """
    if not INTERPRET:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        rep_ms = max(rep_ms, min_calls * (time.perf_counter() - start) * 1e3)
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def measure_graph_ms(fn: Callable[[], object], *, rep_ms: float = 100) -> float | None:
    """Median GPU time of ``fn()`` replayed from a CUDA graph, without Python and launch overhead.

    Small ops (a norm takes ~0.1 ms) finish faster than Python can launch their forward and backward,
    so host-timed calls measure the CPU. Replaying a captured graph times the GPU work alone. Returns
    None in the interpreter, or when ``fn`` cannot be captured (e.g. it reads a value back to the host).
    """
    if INTERPRET:
        return None
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    except Exception:  # capture is impossible for this fn: the caller falls back to measure_ms
        torch.cuda.synchronize()
        return None


def kernel_times_ms(fn: Callable[[], object], *, calls: int = 5) -> dict[str, float]:
    """Milliseconds per call of each kernel, copy and fill that ``fn()`` runs on the GPU, by name (largest
    first), from a ``torch.profiler`` trace of ``calls`` calls. Empty in the interpreter."""
    if INTERPRET:
        return {}
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace_path = Path(folder) / "trace.json"
        profile.export_chrome_trace(str(trace_path))
        events = json.loads(trace_path.read_text())["traceEvents"]
    per_name: dict[str, float] = {}
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            per_name[event["name"]] = per_name.get(event["name"], 0.0) + event["dur"] / 1e3 / calls
    return dict(sorted(per_name.items(), key=lambda item: -item[1]))


def measure_kernel_sum_ms(fn: Callable[[], object], *, calls: int = 5) -> float | None:
    """GPU time of ``fn()``: the durations of its kernels, copies and fills under ``torch.profiler``, summed and
    averaged over ``calls`` calls. For ops that a CUDA graph cannot capture; gaps between kernels (the host
    launching, a value read back) are not counted, so this is what the GPU spent, not what a user waits.
    None in the interpreter."""
    return None if INTERPRET else sum(kernel_times_ms(fn, calls=calls).values())


def timer_label() -> str:
    if INTERPRET:
        return "CPU wall clock (interpreter, not GPU speed)"
    return (
        "median GPU time: CUDA graph replay (cuda_graph), or the kernel sum under torch.profiler (profiler) "
        "with CUDA events around each call as wall time"
    )


def peak_memory_bytes(fn: Callable[[], object]) -> int | None:
    """Bytes allocated by ``fn()`` at its peak, above what was allocated before it; None on CPU."""
    if INTERPRET:
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
