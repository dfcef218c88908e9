"""What the size of a patched model's chunk of logits costs and saves end to end.

    python -m benchmarks.experiments.e2e_chunk_budget [--model qwen3-1.5b] [--chunk-tokens default,768,512,384]
        [--json FILE]

A patched model's fused loss holds one chunk of logits at a time, on top of every activation of the step. By
default :func:`liger_lab.patch` bounds it by two hidden states' bytes
(:func:`liger_lab.ops.fused_linear_cross_entropy.chunk_tokens_in_model`: 384 tokens of Qwen3's 151936 logits at
8 x 2048 in bf16); its ``loss_chunk_tokens`` option sets it, and each value here is passed in that way. Each
runs in a fresh process (:func:`liger_lab.e2e.child_row`), since patching reaches beyond the model: tokens/s
and peak memory of the patched model at 8 x 2048, as ``python -m liger_lab.e2e train`` measures them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from liger_lab.e2e.isolation import child_row, environment_of
from liger_lab.e2e.presets import default_dtype, model_config
from liger_lab.e2e.training import train
from liger_lab.ops import fused_linear_cross_entropy as flce_ops
from liger_lab.workbook import results

BATCH, SEQ = 8, 2048
DEFAULT = "default"


def run_one(model: str, chunk_tokens: int | None) -> dict:
    config = model_config(model)
    row = train("liger_lab", config, BATCH, SEQ, steps=5, warmup=2, loss_chunk_tokens=chunk_tokens)
    dtype = default_dtype()
    used = chunk_tokens or flce_ops.chunk_tokens_in_model(BATCH * SEQ, config.hidden_size, config.vocab_size, dtype)
    return {**row, "model": model, "loss_chunk_tokens": chunk_tokens, "chunk_tokens": used}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1.5b")
    parser.add_argument("--chunk-tokens", default=f"{DEFAULT},768,512,384", help="values of loss_chunk_tokens")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one value
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.model, None if args.one == DEFAULT else int(args.one))))
        return
    rows = []
    for value in args.chunk_tokens.split(","):
        command = [sys.executable, "-m", __spec__.name, "--model", args.model, "--one", value]
        row = child_row(command, {"op": "e2e", "impl": "liger_lab", "loss_chunk_tokens": value})
        rows.append(row)
        speed, peak = f"{row.get('tokens_per_s', 0):,.0f} tokens/s", f"peak {row.get('peak_gib')} GiB"
        print(
            f"loss_chunk_tokens {value}: chunk {row.get('chunk_tokens')} tokens, {speed}, {peak} {row.get('error', '')}"
        )
    if args.json:
        results.write_rows(rows, args.json, environment=environment_of(rows))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
