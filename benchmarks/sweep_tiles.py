"""Sweep the launch settings of the norm and RoPE kernels on the GPU, timing the whole op fwd+bwd.

``python benchmarks/sweep_tiles.py [--json FILE]``. Each variant temporarily replaces one launch-settings
function (``runtime.persistent_row_launch``, ``runtime.row_launch``, ``runtime.streaming_row_launch`` or
``ops.rope.rope_tile``), then measures
``bench.OPS[op]`` for liger_lab at the DESIGN.md shape. The winners become the defaults; the notes in
``benchmarks/notes/`` say what was measured.
"""

from __future__ import annotations

import argparse
import functools
import json
from contextlib import contextmanager

import torch

from liger_lab import bench, runtime
from liger_lab.ops import rope as rope_module


@contextmanager
def replaced(owner, name, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def fixed_persistent(rows: int, warps: int, per_sm: int):
    def launch(n_rows: int, n_cols: int) -> runtime.RowLaunch:
        block_n = runtime.triton.next_power_of_2(n_cols)
        grid = max(1, min(runtime.triton.cdiv(n_rows, rows), per_sm * runtime.sm_count()))
        return runtime.RowLaunch(block_n, rows, warps, grid)

    return launch


def fixed_rows(rows: int, warps: int):
    def launch(n_rows: int, n_cols: int) -> runtime.RowLaunch:
        block_n = runtime.triton.next_power_of_2(n_cols)
        return runtime.RowLaunch(block_n, rows, warps, runtime.triton.cdiv(n_rows, rows))

    return launch


def fixed_streaming(block_n: int, warps: int):
    def launch(n_rows: int, n_cols: int) -> runtime.RowLaunch:
        return runtime.RowLaunch(min(block_n, runtime.triton.next_power_of_2(n_cols)), 1, warps, n_rows)

    return launch


def measure(op: str) -> dict:
    (result,) = bench.OPS[op].run(impls=["liger_lab"])
    return {"fwd_ms": round(result.fwd_ms, 4), "full_ms": round(result.full_ms, 4), "peak_mib": result.peak_mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", choices=["norms", "rope", "cross_entropy"], action="append")
    args = parser.parse_args()
    groups = args.only or ["norms", "rope", "cross_entropy"]
    rows_out = []
    for op in ("rms_norm", "layer_norm") if "norms" in groups else ():
        rows_out.append({"op": op, "variant": "default", **measure(op)})
        for rows, warps, per_sm in [(2, 8, 1), (2, 8, 2), (4, 16, 1), (4, 16, 2), (8, 16, 1), (2, 16, 1)]:
            with replaced(runtime, "persistent_row_launch", fixed_persistent(rows, warps, per_sm)):
                variant = f"bwd rows={rows} warps={warps} per_sm={per_sm}"
                rows_out.append({"op": op, "variant": variant, **measure(op)})
        for rows, warps in [(1, 4), (1, 8), (2, 8), (4, 16)]:
            with replaced(runtime, "row_launch", fixed_rows(rows, warps)):
                rows_out.append({"op": op, "variant": f"fwd rows={rows} warps={warps}", **measure(op)})
    for block_n, warps in [(4096, 8), (4096, 16), (8192, 8), (8192, 16), (8192, 32), (16384, 16), (16384, 32),
                           (32768, 32)] if "cross_entropy" in groups else ():  # fmt: skip
        with replaced(runtime, "streaming_row_launch", fixed_streaming(block_n, warps)):
            variant = f"block_n={block_n} warps={warps}"
            rows_out.append({"op": "cross_entropy", "variant": variant, **measure("cross_entropy")})
    if "rope" not in groups:
        return _report(rows_out, args.json)
    rows_out.append({"op": "rope", "variant": "default", **measure("rope")})
    for block_h, block_t, n_groups in [(4, 16, 1), (8, 8, 1), (2, 32, 1), (4, 16, 2), (8, 16, 1), (4, 8, 1)]:
        tile = functools.partial(rope_module.rope_tile, block_h=block_h, block_t=block_t, n_groups=n_groups)
        with replaced(rope_module, "rope_tile", tile):
            variant = f"block_h={block_h} block_t={block_t} groups={n_groups}"
            rows_out.append({"op": "rope", "variant": variant, **measure("rope")})
    _report(rows_out, args.json)


def _report(rows_out: list[dict], path: str | None) -> None:
    for row in rows_out:
        print(row)
    if path:
        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
