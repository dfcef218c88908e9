"""Timing and memory: how long a callable takes on the device where kernels run, and how much it allocates.

On the GPU these are the clocks of the benchmark protocol (CUDA-graph replay, the kernel sum under
``torch.profiler``, ``do_bench``); in the interpreter the host's wall clock, labelled as such, or None where a
GPU-only clock has no meaning.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton

from liger_lab.runtime.device import INTERPRET


def measure_ms(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100, min_calls: int = 20) -> float:
    """Median time of ``fn()`` in milliseconds.

    On the GPU: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls) over ``rep_ms``, or
    over ``min_calls`` calls when those take longer: an op taking nearly half of ``rep_ms`` would get only two
    calls, and the median of two is noise. In the interpreter ``do_bench`` does not work, so this is a host wall
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

    Small ops (a norm at the benchmark shape) finish faster than Python can launch their forward and backward,
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


def _without_stderr(call: Callable[[], object]) -> None:
    """``call()`` with the process's standard error (file descriptor 2, where C++ writes) sent nowhere."""
    sys.stderr.flush()
    saved, nowhere = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, 2)
    try:
        call()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(nowhere)


@contextlib.contextmanager
def profile(**options: object) -> Iterator[torch.profiler.profile]:
    """``torch.profiler.profile(**options)`` around the block, without the two log lines its C++ profiler (Kineto,
    as PyTorch 2.13 ships it) prints on standard error as it starts and stops, whatever the log level: a notebook
    would show them as an error stream. Only the start and the stop are quieted, never the block."""
    profiler = torch.profiler.profile(**options)
    _without_stderr(profiler.start)
    try:
        yield profiler
    finally:
        _without_stderr(profiler.stop)


def kernel_times_ms(fn: Callable[[], object], *, calls: int = 5) -> dict[str, float]:
    """Milliseconds per call of each kernel, copy and fill that ``fn()`` runs on the GPU, by name (largest
    first), from a ``torch.profiler`` trace of ``calls`` calls. Empty in the interpreter."""
    if INTERPRET:
        return {}
    fn()
    torch.cuda.synchronize()
    with profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace_path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace_path))
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
