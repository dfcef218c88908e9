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

import json

import per_mode

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
    args = per_mode.parse_arguments(__doc__.split("\n\n")[0], "hf+compile,liger_lab,liger_lab+compile")
    if args.child:
        child(args.child, args.batch, args.seq)
        return
    from liger_lab import bench, e2e

    rows = []
    for row in per_mode.rows_of_children(__file__, args, label="impl"):
        rows.append({**row, **bench.environment()})
        print(e2e.format_run(row) if "error" not in row else f"{row['impl']}: {row['error']}", flush=True)
    per_mode.write_rows(rows, args.json)


if __name__ == "__main__":
    main()
