"""Where kernels run, how they are launched, and how they are timed: ``liger_lab.runtime``.

Three modules, one concern each, all of whose public names are here:

* :mod:`~liger_lab.runtime.device`: the one place that knows GPU from Triton's interpreter (it sets
  ``TRITON_INTERPRET=1`` before Triton is imported on a machine without CUDA), the facts of each GPU that launch
  settings depend on, read once per device, and :func:`launch_kernel`, through which every launch goes;
* :mod:`~liger_lab.runtime.launch`: the shared tiling rules (rows, persistent rows, streamed rows, column sums,
  flat blocks), cached per shape and device;
* :mod:`~liger_lab.runtime.timing`: the clocks of the benchmarks and peak memory.
"""

from __future__ import annotations

from liger_lab.runtime.device import (
    BACKEND,
    DEVICE,
    HOST_READS_WAIT,
    INTERPRET,
    Hardware,
    check_device,
    describe,
    device_context,
    hardware,
    launch_kernel,
    pick,
    read_later,
    shared_memory_bytes,
    skip_launches,
    sm_count,
    synchronize,
    triton,  # noqa: F401  (the module, imported once the choice was made)
)
from liger_lab.runtime.launch import (
    MAX_ROW_SIZE,
    ElementwiseLaunch,
    RowLaunch,
    cdiv,
    column_sum_launch,
    elementwise_launch,
    next_power_of_2,
    persistent_row_launch,
    row_launch,
    streaming_row_launch,
)
from liger_lab.runtime.timing import (
    kernel_times_ms,
    measure_graph_ms,
    measure_kernel_sum_ms,
    measure_ms,
    peak_memory_bytes,
    profile,
    timer_label,
)

__all__ = [
    "BACKEND",
    "DEVICE",
    "HOST_READS_WAIT",
    "INTERPRET",
    "MAX_ROW_SIZE",
    "ElementwiseLaunch",
    "Hardware",
    "RowLaunch",
    "cdiv",
    "check_device",
    "column_sum_launch",
    "describe",
    "device_context",
    "elementwise_launch",
    "hardware",
    "kernel_times_ms",
    "launch_kernel",
    "measure_graph_ms",
    "measure_kernel_sum_ms",
    "measure_ms",
    "next_power_of_2",
    "peak_memory_bytes",
    "profile",
    "persistent_row_launch",
    "pick",
    "read_later",
    "row_launch",
    "shared_memory_bytes",
    "skip_launches",
    "sm_count",
    "streaming_row_launch",
    "synchronize",
    "timer_label",
]
