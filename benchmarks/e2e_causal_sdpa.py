"""The end-to-end benchmark with SDPA's causal fast path kept under torch.compile.

``python benchmarks/e2e_causal_sdpa.py [--modes hf+compile,liger_lab,liger_lab+compile] [--json FILE]``

With torch older than 2.14, transformers cannot tell under ``torch.compile`` that a batch has no padding
(its check for "exporting" is folded to True by Dynamo), so it builds an explicit causal mask and SDPA
leaves its flash kernel for a masked one: on an H200 attention takes about 67 ms of a 1.5B model's step
compiled, against 27 ms eager (``benchmarks/results/h200-e2e-profile-compile.json``). Every mode of
``liger-lab bench e2e`` pays that, patched or not. This script registers, for its own processes only, a
mask function that returns no mask when the batch has no attention mask (the benchmark's batches have no
padding), exactly what transformers does eagerly, then runs :func:`liger_lab.e2e.train` per mode in a
fresh process. Rows carry ``"attention": "sdpa, causal (no mask built)"``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ATTENTION = "sdpa, causal (no mask built)"


def keep_causal_fast_path() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def mask(*args, attention_mask=None, **kwargs):
        # No attention mask: no padding, so SDPA's is_causal=True path is exact (as transformers decides eagerly).
        return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)

    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", mask)


def child(mode: str, batch: int, seq: int) -> None:
    keep_causal_fast_path()
    from liger_lab import e2e

    row = e2e.train(mode, e2e.llama_config("1.5b"), batch, seq)
    print(json.dumps({**row, "attention": ATTENTION}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="hf+compile,liger_lab,liger_lab+compile")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch, args.seq)
        return
    from liger_lab import bench, e2e

    rows = []
    for mode in args.modes.split(","):
        command = [sys.executable, __file__, "--child", mode, "--batch", str(args.batch), "--seq", str(args.seq)]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"impl": mode, "error": done.stderr[-2000:]}
        rows.append({**row, **bench.environment()})
        print(e2e.format_run(row) if "error" not in row else f"{mode}: {row['error']}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
            out.write("\n")


if __name__ == "__main__":
    main()
