"""What the fused loss's chunk budget costs and saves end to end.

    python benchmarks/e2e_chunk_budget.py [--model qwen3-1.5b] [--budgets-mib 240,176,150] [--json FILE]

``liger_lab.ops.fused_linear_cross_entropy.CHUNK_BUDGET_BYTES`` bounds the chunk of logits the fused loss holds at
once (240 MiB by default: 768 tokens of Qwen3's 151936 logits in bf16). It is the process-wide default that
:func:`liger_lab.patch`'s loss reads, so each budget runs in a fresh process (:func:`liger_lab.e2e.child_row`):
tokens/s and peak memory of the patched model at 8 x 2048, as ``python -m liger_lab.e2e train`` measures them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from liger_lab import bench, e2e
from liger_lab.ops import fused_linear_cross_entropy as flce_ops

MIB = 2**20
BATCH, SEQ = 8, 2048


def run_one(model: str, budget_mib: int) -> dict:
    flce_ops.CHUNK_BUDGET_BYTES = budget_mib * MIB
    config = e2e.model_config(model)
    row = e2e.train("liger_lab", config, BATCH, SEQ, steps=5, warmup=2)
    tokens = flce_ops.chunk_tokens_for(BATCH * SEQ, config.vocab_size, e2e.default_dtype())
    return {**row, "model": model, "chunk_budget_mib": budget_mib, "chunk_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1.5b")
    parser.add_argument("--budgets-mib", default="240,176,150")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process: one budget
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.model, args.one)))
        return
    rows = []
    for budget in (int(b) for b in args.budgets_mib.split(",")):
        command = [sys.executable, __file__, "--model", args.model, "--one", str(budget)]
        row = e2e.child_row(command, {"op": "e2e", "impl": "liger_lab", "chunk_budget_mib": budget})
        rows.append(row)
        print(f"budget {budget:>4} MiB: chunk {row.get('chunk_tokens')} tokens, {row.get('tokens_per_s', 0):,.0f} "
              f"tokens/s, peak {row.get('peak_gib')} GiB {row.get('error', '')}", flush=True)  # fmt: skip
    if args.json:
        bench.write_rows(rows, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
