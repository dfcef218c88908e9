"""How far bf16 training curves run from the fp32 one, patched and unpatched, over several seeds.

    python -m benchmarks.experiments.bf16_convergence_seeds --json OUT.json exaone4 qwen3_next ...

The GPU convergence test (``tests/test_convergence.py``) compares a patched bf16 curve with transformers' bf16
curve step by step, or, for families whose curves cross a step-wise bound on some seeds and not others, each bf16
curve's mean distance from the exact (fp32, unpatched) curve. This runs the test's own procedure for each model
type, mode and seed and records both distances and the largest step-wise difference, so the test's choice of
criterion per family rests on measured rows rather than one seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the test's own training procedure

from test_convergence import loss_curves  # noqa: E402

from liger_lab import runtime  # noqa: E402
from liger_lab.workbook import results  # noqa: E402


def measure(model_type: str, *, mode: str, seed: int, steps: int) -> dict:
    dtype = torch.bfloat16 if mode == "bf16_weights" else torch.float32
    torch.manual_seed(seed)
    ours, theirs = loss_curves(model_type, dtype=dtype, autocast=mode == "autocast", steps=steps)
    torch.manual_seed(seed)
    exact = loss_curves(model_type, steps=steps)[1]

    def mean_gap(curve: list[float]) -> float:
        return sum(abs(a - b) for a, b in zip(curve, exact, strict=True)) / len(exact)

    return {
        "model_type": model_type,
        "mode": mode,
        "seed": seed,
        "steps": steps,
        "gap_patched": mean_gap(ours),
        "gap_transformers": mean_gap(theirs),
        "max_step_difference": max(abs(a - b) for a, b in zip(ours, theirs, strict=True)),
        "final_patched": ours[-1],
        "final_transformers": theirs[-1],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="+")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    rows = []
    for model_type in args.model_types:
        for mode in ("bf16_weights", "autocast"):
            for seed in range(args.seeds):
                row = measure(model_type, mode=mode, seed=seed, steps=args.steps)
                row.update(device=runtime.describe(), commit=results.commit())
                rows.append(row)
                print(json.dumps(row), flush=True)
                args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
