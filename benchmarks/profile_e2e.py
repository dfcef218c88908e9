"""Where a training step's GPU time goes, by kind of kernel, for each patching mode.

    python -m benchmarks.profile_e2e [--modes liger_lab,liger] [--model 1.5b] [--batch 8 --seq 2048] [--json FILE]

Each mode runs :func:`liger_lab.e2e.profile_step` in a fresh process (patching changes transformers module-wide,
:func:`liger_lab.e2e.run_isolated`): two warm-up steps, then three steps under ``torch.profiler``, their kernel
times summed into matmuls, attention, the optimizer, fused (Triton) kernels, other PyTorch kernels and copies. The
fused kernels are the only part the patching modes differ in, so their share bounds the speedup any kernel library
can give: removing them entirely would make a step ``step / (step - fused)`` times faster
(``bound_if_fused_took_zero``). GPU only: on CPU each row says so.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from liger_lab.e2e.isolation import environment_of, run_isolated
from liger_lab.e2e.presets import MODEL_SIZES
from liger_lab.e2e.reports import error_summary
from liger_lab.workbook import results


def format_profile(row: dict) -> str:
    """One mode's profile: the step, its kernel time by kind, and the bound."""
    if "by_category_ms" not in row:
        return f"{row['impl']}: {row.get('note') or error_summary(row.get('error', 'no profile'))}"
    kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in row["by_category_ms"].items())
    return (f"{row['impl']}: step {row['step_ms']:.1f} ms, kernels {row['kernel_ms']:.1f} ms ({kinds}); "
            f"{row['bound_if_fused_took_zero']:.3f}x if the fused kernels took no time")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="liger_lab,liger")
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="1.5b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for mode in args.modes.split(","):
        rows.append(run_isolated("profile", mode=mode, model=args.model, batch=args.batch, seq=args.seq, steps=3))
        print(format_profile(rows[-1]), flush=True)
    if args.json:
        results.write_rows(rows, args.json, environment=environment_of(rows))


if __name__ == "__main__":
    main()
