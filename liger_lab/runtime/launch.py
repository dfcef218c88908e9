"""Launch settings: how the shared kinds of kernel tile a problem, from its sizes and the hardware's facts.

Each function is a pure function of integers and :class:`~liger_lab.runtime.device.Hardware`, cached: an eager call
asks for its settings every time, and the same few shapes come back every step. An op whose kernel wants other
settings than these shared rules give says so next to its kernel (its own frozen config and the function that
picks it), passing its figures in; the decisions and their measurements are in ``benchmarks/notes/``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from liger_lab.runtime.device import Hardware, hardware

_INTERPRETER_MAX_PROGRAMS = 64
"""The interpreter costs about a millisecond per program instance: keep CPU grids small and tiles big."""
_GPU_MAX_TILE = 16384
"""Largest tile (elements) one program holds in registers on the GPU before spilling hurts."""
MAX_ROW_SIZE = 65536
"""Largest row (hidden size) the row-wise kernels hold in one tile."""
_CACHED = 4096
"""Shapes whose settings each function keeps (a run of varying sequence lengths meets a few hundred)."""


def next_power_of_2(n: int) -> int:
    """The least power of 2 at least ``n`` (1 for n <= 1): ``triton.next_power_of_2`` without its constexpr
    wrapper, which costs microseconds a call on the host."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RowLaunch:
    """How a row-wise kernel tiles an (n_rows, n_cols) matrix: rows x block_n elements per program."""

    block_n: int
    rows: int
    num_warps: int
    grid: int
    num_stages: int = 1
    """Tiles of a persistent loop in flight at once: above 1, Triton loads the next tiles while this one computes."""


class ElementwiseLaunch(NamedTuple):
    """How a flat elementwise kernel splits n elements: blocks of ``block``, one per program. A tuple, so
    ``block, num_warps, grid = elementwise_launch(n)`` unpacks it."""

    block: int
    num_warps: int
    grid: int


def _check_row_size(n_cols: int) -> None:
    if n_cols > MAX_ROW_SIZE:
        raise ValueError(f"rows of {n_cols} elements are too long: expected at most {MAX_ROW_SIZE}")


def row_launch(
    n_rows: int,
    n_cols: int,
    *,
    gpu_tile: int = _GPU_MAX_TILE // 4,
    warp_elements: int = 512,
    hardware: Hardware | None = None,
) -> RowLaunch:
    """Tile for kernels where each program normalises whole rows (one program per tile of rows): on the GPU,
    whole rows up to ``gpu_tile`` elements a program, a warp per ``warp_elements``. The defaults measured fastest
    for RMSNorm's forward at 4096 columns on an H200 (one row under 8 warps); LayerNorm's, which holds more per
    element, passes its own (benchmarks/notes/layer_norm.md). ``hardware``: the current device's by default."""
    _check_row_size(n_cols)
    return _row_launch(n_rows, n_cols, gpu_tile, warp_elements, hardware or _current())


@functools.lru_cache(maxsize=_CACHED)
def _row_launch(n_rows: int, n_cols: int, gpu_tile: int, warp_elements: int, facts: Hardware) -> RowLaunch:
    block_n = next_power_of_2(max(n_cols, 1))
    if facts.interpreter:
        # Cost is per program and per statement, not per element: a few programs with tiles of up to
        # 64 rows (or 64k elements), so a small model's norms take 4 programs instead of one per row.
        rows = min(next_power_of_2(cdiv(n_rows, 4)), max(_INTERPRETER_MAX_PROGRAMS, 2**16 // block_n))
        return RowLaunch(block_n, rows, 1, cdiv(n_rows, rows))
    # Several short rows per program keep enough bytes in flight; long rows get more warps instead.
    rows = max(1, min(gpu_tile // block_n, 16))
    num_warps = max(1, min(16, rows * block_n // warp_elements))
    return RowLaunch(block_n, rows, num_warps, cdiv(n_rows, rows))


def persistent_row_launch(
    n_rows: int, n_cols: int, *, stream_bytes: int = 4, hardware: Hardware | None = None
) -> RowLaunch:
    """Tile for persistent kernels: a fixed grid whose programs loop over row tiles (backward of norms).
    ``stream_bytes``: the bytes per column of one row that the loop loads (x and dy in bf16: 4).

    Measured on an H200 (benchmarks/notes/rms_norm.md): one program per SM, which keeps the dW partials to one
    row per SM. Each takes 2 rows of 4096 under 8 warps with three tiles in flight (Triton loads the next two
    while it computes one), faster for RMSNorm's backward and for the fused add's than one tile of 4 rows under
    16 warps. Where three tiles do not fit in shared memory (fp32, very long rows) it keeps that one tile of 4
    rows: the pipelined small tile alone measured slower.
    """
    _check_row_size(n_cols)
    return _persistent_row_launch(n_rows, n_cols, stream_bytes, hardware or _current())


@functools.lru_cache(maxsize=_CACHED)
def _persistent_row_launch(n_rows: int, n_cols: int, stream_bytes: int, facts: Hardware) -> RowLaunch:
    if facts.interpreter:
        return _row_launch(n_rows, n_cols, _GPU_MAX_TILE // 4, 512, facts)
    block_n = next_power_of_2(max(n_cols, 1))

    def launch(rows: int, num_stages: int) -> RowLaunch:
        num_warps = max(4, min(16, rows * block_n // 1024))
        return RowLaunch(block_n, rows, num_warps, max(1, min(cdiv(n_rows, rows), facts.sm_count)), num_stages)

    pipelined_rows = max(1, min(_GPU_MAX_TILE // 2 // block_n, 16))
    # A quarter of shared memory left for the compiler's own use (the reductions' scratch).
    if 3 * pipelined_rows * block_n * stream_bytes <= facts.shared_memory_bytes * 3 // 4:
        return launch(pipelined_rows, 3)
    return launch(max(1, min(_GPU_MAX_TILE // block_n, 16)), 1)


@functools.lru_cache(maxsize=_CACHED)
def _streaming_row_launch(n_rows: int, n_cols: int, gpu_tile: int, facts: Hardware) -> RowLaunch:
    if facts.interpreter:
        # The interpreter's cost is per program and per statement, not per element: few programs, big tiles.
        block_n = min(next_power_of_2(max(n_cols, 1)), 16384)
        rows = min(next_power_of_2(cdiv(n_rows, 2)), max(1, 2**20 // block_n))
        return RowLaunch(block_n, rows, 1, max(1, cdiv(n_rows, rows)))
    block_n = min(next_power_of_2(max(n_cols, 1)), gpu_tile)
    rows = max(1, min(gpu_tile // block_n, 16))
    num_warps = max(4, min(16, rows * block_n // 512))
    return RowLaunch(block_n, rows, num_warps, max(1, cdiv(n_rows, rows)))


def streaming_row_launch(
    n_rows: int, n_cols: int, *, gpu_tile: int = _GPU_MAX_TILE // 2, hardware: Hardware | None = None
) -> RowLaunch:
    """Tile for kernels that stream rows too long for registers (a vocabulary) in steps of block_n columns.

    Each program takes ``rows`` whole rows and loops over their columns, ``gpu_tile`` elements at a time on the
    GPU, with a warp per 512 of them (4 to 16). The default, a long row in 8192-column blocks under 16 warps,
    measured fastest for the cross-entropy with 8192 rows of 128k (bf16) on an H200 once its second pass ran
    backwards to reuse L2 (benchmarks/notes/cross_entropy.md). A kernel with more arithmetic per element
    (the JSD) holds more registers per element and passes a smaller tile.
    """
    return _streaming_row_launch(n_rows, n_cols, gpu_tile, hardware or _current())


@functools.lru_cache(maxsize=_CACHED)
def _column_sum_launch(n_rows: int, n_cols: int, facts: Hardware) -> RowLaunch:
    if facts.interpreter:
        block_n = min(next_power_of_2(max(n_cols, 1)), 2**16)
        rows = min(next_power_of_2(max(n_rows, 1)), max(1, 2**18 // block_n))
        return RowLaunch(block_n, rows, 1, cdiv(n_cols, block_n))
    return RowLaunch(16, min(next_power_of_2(max(n_rows, 1)), 256), 4, cdiv(n_cols, 16))


def column_sum_launch(n_rows: int, n_cols: int, *, hardware: Hardware | None = None) -> RowLaunch:
    """Tile for summing a few hundred rows of fp32 partials down their columns (the norms' dw, db): ``rows`` rows
    by ``block_n`` columns a step, one program per strip of columns. On the GPU a strip of 16 columns under 4
    warps takes all of an SM count's rows in one step, so each program waits on memory once: that measured
    fastest on an H200 (benchmarks/notes/layer_norm.md)."""
    return _column_sum_launch(n_rows, n_cols, hardware or _current())


@functools.lru_cache(maxsize=_CACHED)
def _elementwise_launch(n_elements: int, facts: Hardware) -> ElementwiseLaunch:
    if facts.interpreter:
        # The interpreter pays per program, not per element: about four big programs, at most 2**20 each.
        block = min(max(1024, next_power_of_2(cdiv(n_elements, 4))), 2**20)
        return ElementwiseLaunch(block, 1, cdiv(n_elements, block))
    return ElementwiseLaunch(1024, 4, cdiv(n_elements, 1024))


def elementwise_launch(n_elements: int, *, hardware: Hardware | None = None) -> ElementwiseLaunch:
    """Blocks for a flat elementwise kernel: on the GPU 1024 elements a program under 4 warps, the tile
    torch.compile's generated kernels take; for SwiGLU and GeGLU it measured level with torch.compile's kernels on
    an H200, and faster than 4096 under 8 (benchmarks/notes/swiglu.md)."""
    return _elementwise_launch(n_elements, hardware or _current())


def _current() -> Hardware:
    return hardware()
