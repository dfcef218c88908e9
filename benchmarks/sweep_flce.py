"""Sweep the fused linear cross-entropy's chunk size on the GPU (time and peak memory per setting).

``python benchmarks/sweep_flce.py [--json FILE]``. Runs the benchmark op's ``liger_lab:in_place_backward``
row with the chunk set through ``CHUNK_ALIGN`` and ``CHUNK_BUDGET_BYTES``, and
Liger-Kernel before and after as a yardstick. The winner that fits the memory target becomes
``CHUNK_BUDGET_BYTES``.
"""

from __future__ import annotations

import argparse
import json

import torch

from liger_lab import bench
from liger_lab.ops import fused_linear_cross_entropy as flce_module

CHUNKS = (768, 896, 960, 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    original = flce_module.CHUNK_ALIGN, flce_module.CHUNK_BUDGET_BYTES
    n_tokens, _, vocab = bench.OPS["fused_linear_cross_entropy"].shape
    rows = []

    def record(row: dict) -> None:
        print(row, flush=True)
        rows.append(row)

    record(bench.OPS["fused_linear_cross_entropy"].run(impls=["liger"])[0].as_row())
    for chunk in CHUNKS:
        flce_module.CHUNK_ALIGN = 64 if chunk % 128 else 128
        flce_module.CHUNK_BUDGET_BYTES = chunk * vocab * 2
        (result,) = bench.OPS["fused_linear_cross_entropy"].run(impls=["liger_lab:in_place_backward"])
        record({"chunk": flce_module.chunk_tokens_for(n_tokens, vocab, torch.bfloat16), **result.as_row()})
    flce_module.CHUNK_ALIGN, flce_module.CHUNK_BUDGET_BYTES = original
    record(bench.OPS["fused_linear_cross_entropy"].run(impls=["liger"])[0].as_row())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
