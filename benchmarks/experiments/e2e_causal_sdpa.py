"""The end-to-end benchmark with SDPA's causal fast path kept under torch.compile.

    python -m benchmarks.experiments.e2e_causal_sdpa [--modes hf+compile,liger_lab,liger_lab+compile] [--json FILE]

With torch older than 2.14, transformers cannot tell under ``torch.compile`` that a batch has no padding
(its check for "exporting" is folded to True by Dynamo), so it builds an explicit causal mask and SDPA
leaves its flash kernel for a masked one, in every mode of ``liger-lab bench e2e``, patched or not
(``benchmarks/results/h200-e2e-profile-compile.json`` has the attention time of both). This script registers, for
its own processes only, a mask function that returns no mask when the batch has no attention mask (the benchmark's
batches have no padding), exactly what transformers does eagerly, then runs :func:`liger_lab.e2e.train` per mode in
a fresh process. Rows carry ``"attention": "sdpa, causal (no mask built)"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from liger_lab.e2e.isolation import child_row, environment_of
from liger_lab.e2e.presets import model_config
from liger_lab.e2e.reports import format_run
from liger_lab.e2e.training import MODES, train
from liger_lab.workbook import results

ATTENTION = "sdpa, causal (no mask built)"


def keep_causal_fast_path() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def mask(*args, attention_mask=None, **kwargs):
        # No attention mask: no padding, so SDPA's is_causal=True path is exact (as transformers decides eagerly).
        return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)

    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", mask)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="hf+compile,liger_lab,liger_lab+compile")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # how the script runs one mode
    args = parser.parse_args(argv)
    if args.child:
        keep_causal_fast_path()
        row = train(args.child, model_config("1.5b"), args.batch, args.seq)
        print(json.dumps({**row, "attention": ATTENTION}))
        return
    rows = []
    for mode in args.modes.split(","):
        command = [sys.executable, "-m", __spec__.name, "--child", mode, "--batch", str(args.batch),
                   "--seq", str(args.seq)]  # fmt: skip
        rows.append(child_row(command, {"op": "e2e", "impl": mode, "batch": args.batch, "seq": args.seq}))
        print(format_run(rows[-1], rows), flush=True)
    if args.json:
        results.write_rows(rows, args.json, environment=environment_of(rows))


if __name__ == "__main__":
    main()
