"""What the bound on a patched model's chunk of logits costs and saves end to end.

    python benchmarks/e2e_chunk_budget.py [--model qwen3-1.5b] [--hidden-states 4,3,2,1] [--json FILE]

A patched model's fused loss holds at most ``MODEL_CHUNK_HIDDEN_STATES`` hidden states' bytes of logits at once
(:func:`liger_lab.ops.fused_linear_cross_entropy.chunk_tokens_in_model`; 2 by default: 384 tokens of Qwen3's 151936
logits at 8 x 2048 in bf16), and never more than the op's own 240 MiB budget. It is the process-wide default that
:func:`liger_lab.patch`'s loss reads, so each value runs in a fresh process (:func:`liger_lab.e2e.child_row`):
tokens/s and peak memory of the patched model at 8 x 2048, as ``python -m liger_lab.e2e train`` measures them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from liger_lab import bench, e2e
from liger_lab.ops import fused_linear_cross_entropy as flce_ops

BATCH, SEQ = 8, 2048


def run_one(model: str, hidden_states: int) -> dict:
    flce_ops.MODEL_CHUNK_HIDDEN_STATES = hidden_states
    config = e2e.model_config(model)
    row = e2e.train("liger_lab", config, BATCH, SEQ, steps=5, warmup=2)
    tokens = flce_ops.chunk_tokens_in_model(BATCH * SEQ, config.hidden_size, config.vocab_size, e2e.default_dtype())
    return {**row, "model": model, "chunk_hidden_states": hidden_states, "chunk_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1.5b")
    parser.add_argument("--hidden-states", default="4,3,2,1", help="values of MODEL_CHUNK_HIDDEN_STATES")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process: one value
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.model, args.one)))
        return
    rows = []
    for hidden_states in (int(value) for value in args.hidden_states.split(",")):
        command = [sys.executable, __file__, "--model", args.model, "--one", str(hidden_states)]
        row = e2e.child_row(command, {"op": "e2e", "impl": "liger_lab", "chunk_hidden_states": hidden_states})
        rows.append(row)
        speed, peak = f"{row.get('tokens_per_s', 0):,.0f} tokens/s", f"peak {row.get('peak_gib')} GiB"
        chunk = f"chunk {row.get('chunk_tokens')} tokens"
        print(f"{hidden_states} hidden states: {chunk}, {speed}, {peak} {row.get('error', '')}", flush=True)
    if args.json:
        bench.write_rows(rows, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
