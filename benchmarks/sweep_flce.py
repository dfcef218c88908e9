"""Sweep the fused linear cross-entropy's chunk budget on the GPU (time and peak memory per setting).

``python benchmarks/sweep_flce.py [--json FILE]``; the winner becomes ``CHUNK_BUDGET_BYTES``.
"""

from __future__ import annotations

import argparse
import json

import torch

from liger_lab import bench
from liger_lab.ops import fused_linear_cross_entropy as flce_module
from liger_lab.profiling import MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    original = flce_module.CHUNK_BUDGET_BYTES
    rows = []
    for budget_mib in (96, 192, 384, 768):
        flce_module.CHUNK_BUDGET_BYTES = budget_mib * MIB
        (result,) = bench.OPS["flce"].run(impls=["liger_lab"])
        row = {"budget_mib": budget_mib, **result.as_row()}
        print(row, flush=True)
        rows.append(row)
    flce_module.CHUNK_BUDGET_BYTES = original
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
