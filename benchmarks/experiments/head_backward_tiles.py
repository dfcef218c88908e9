"""How many tokens a tile of the RL head's backward should hold, against TRL's head, in one process.

    python -m benchmarks.experiments.head_backward_tiles [--tokens 2048 4096 8192] [--rounds 3] [--json FILE]

The head's backward recomputes its logits over tiles of T tokens by as many vocabulary columns as the budget
leaves (:func:`liger_lab.ops.logprobs.backward_tiles`): a larger T makes fewer, deeper dW products (K = T) but a
larger fp32 accumulator of dh and so narrower tiles. Each T is set as ``logprobs.BACKWARD_TOKENS`` (the default call,
every output asked for, at the rl_head benchmark's two shapes); the sizes and TRL's head take turns round by round,
so that a GPU warming up or drifting falls on all of them. Rows: GPU time (kernel sum), wall time and peak above the
inputs, as ``benchmarks.rl_head`` measures them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.rl_head import head_rows, head_shapes, measure
from liger_lab import runtime
from liger_lab.formulas import HEAD_OUTPUTS
from liger_lab.ops import logprobs
from liger_lab.workbook.results import write_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(runtime.describe())
    dtype = runtime.pick(cpu=torch.float32, gpu=torch.bfloat16)
    default = logprobs.BACKWARD_TOKENS
    rows = []
    for label, (n, h, v) in head_shapes().items():
        calls = head_rows(n=n, h=h, v=v, dtype=dtype, outputs=HEAD_OUTPUTS)
        name, flops = f"fused_linear_logprobs:all_outputs{label}", 8.0 * n * h * v
        for round_ in range(args.rounds):
            for tokens in args.tokens:
                logprobs.BACKWARD_TOKENS = tokens
                impl = {f"liger_lab:backward_tokens={tokens}": calls["liger_lab"]}
                for row in measure(name=name, rows=impl, flops=flops, passes=4):
                    rows.append({**row, "round": round_, "backward_tokens": tokens})
            logprobs.BACKWARD_TOKENS = default
            for row in measure(name=name, rows={"trl": calls["trl"]}, flops=flops, passes=4):
                rows.append({**row, "round": round_})
    if args.json:
        write_rows(rows, args.json)


if __name__ == "__main__":
    main()
