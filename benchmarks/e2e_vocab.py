"""End to end on three vocabularies: Llama 3's (128256), Qwen3's (151936) and Gemma 3's (262144, soft-capped).

``python benchmarks/e2e_vocab.py [--presets 1.5b,qwen3-1.5b,gemma3-1.5b] [--modes hf,liger,liger_lab]
[--batch 8 --seq 2048] [--fit-seq 4096 --fit-batches 1,2,4,8,12,16,24,32] [--timeout-s 240] [--budget-s S]
[--json FILE]``

Per preset of :data:`liger_lab.e2e.MODEL_SIZES` and mode, two fresh processes (:func:`liger_lab.e2e.run_isolated`):
``train`` (tokens/s, peak memory and the loss of every step at batch x seq) and ``fit`` (one step at each batch
of --fit-batches at --fit-seq, smallest first, until one runs out of memory: the largest batch that trains).
Each row is printed as its process ends, with the seconds it took and the time the rest will take at the pace
so far; the JSON (one row per process, each with GPU, versions, date and clock) is rewritten after every row,
so a run cut short keeps what it measured. Then, per preset, every mode against Liger-Kernel and the targets of
liger_lab: peak memory <= Liger-Kernel's, tokens/s >= Liger-Kernel's, largest batch at --fit-seq >= Liger-Kernel's;
and whether each patched mode's losses agree with Hugging Face's.

Time, per process on an H200 (an estimate; each row prints what it took): about 10 s to start (imports, a 1.5B
model built on the GPU), the compilation of the Triton kernels its first step launches (tens of seconds in the
first process of a mode on a machine with an empty Triton cache, little after), then 7 steps of 16k tokens (a
few seconds) or the fit's one step per batch (about 300k tokens up to 24 x 4096: 5-10 s): 15-45 s each, 6
processes per preset, 18 for the defaults (5-13 minutes). One GPU command may run at most 10 minutes: run one
preset per command, each with its own --json, and keep --budget-s under the command's limit (a process that
would start past it is not run, and the one running when it runs out is killed): ``--presets qwen3-1.5b
--budget-s 540 --json qwen3.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from liger_lab import e2e

TASKS = ("train", "fit")
# Fields of a child's row that say where and with what it ran; a row of a child that failed takes them from
# one that ran.
ENVIRONMENT = ("date", "gpu", "torch", "triton", "transformers", "liger_lab", "liger_kernel")
OURS = "liger_lab"
# Seconds per process on an H200 at the default sizes, the estimate of the module docstring.
H200_CHILD_S = (15, 45)


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="1.5b,qwen3-1.5b,gemma3-1.5b", help="comma-separated model presets")
    parser.add_argument("--modes", default="hf,liger,liger_lab")
    parser.add_argument("--reference", default="liger", help="the mode liger_lab's targets are measured against")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--fit-seq", type=int, default=4096)
    parser.add_argument("--fit-batches", default="1,2,4,8,12,16,24,32", help="comma-separated; empty: no fit")
    parser.add_argument("--timeout-s", type=float, default=240, help="a child still running after this is killed")
    parser.add_argument("--budget-s", type=float, help="seconds for the whole run; later children are not run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.presets = [p for p in args.presets.split(",") if p]
    args.modes = [m for m in args.modes.split(",") if m]
    args.fit_batches = sorted(int(b) for b in args.fit_batches.split(",") if b)
    unknown = [m for m in args.modes if m not in e2e.MODES]
    if unknown:
        parser.error(f"--modes: {', '.join(unknown)} not in {', '.join(e2e.MODES)}")
    for preset in args.presets:
        try:
            e2e.model_config(preset)
        except ValueError as error:
            parser.error(f"--presets: {error}")
    return args


def run_child(args: argparse.Namespace, preset: str, mode: str, task: str, timeout_s: float) -> dict[str, Any]:
    """One ``python -m liger_lab.e2e`` process, killed after ``timeout_s`` (not started when it is not
    positive): its row, with the preset, the task and the sizes asked for (a fit row has "batches", no "batch")."""
    if task == "train":
        sizes = {"op": "e2e", "batch": args.batch, "seq": args.seq}
    else:
        sizes = {"op": "e2e_fit", "batches": args.fit_batches, "seq": args.fit_seq}
    planned = {"model": preset, "task": task, "impl": mode, **sizes}
    if timeout_s <= 0:
        return {**planned, "error": "not run: --budget-s spent", "skipped": True}
    if task == "train":
        row = e2e.run_isolated("train", mode=mode, model=preset, batch=args.batch, seq=args.seq, steps=args.steps,
                               warmup=args.warmup, timeout_s=timeout_s)  # fmt: skip
    else:
        shapes = [(batch, args.fit_seq) for batch in args.fit_batches]
        row = e2e.run_isolated("fit", mode=mode, model=preset, shapes=shapes, timeout_s=timeout_s)
        row.pop("batch", None)  # a failed child's row names run_isolated's default size
    return {**row, **planned}


def largest_batch(fit: dict[str, Any] | None) -> int | None:
    """The largest batch a fit row trained (0 when even the first ran out of memory); None when it did not run."""
    if not fit or fit.get("error"):
        return None
    return fit["largest"][0] if fit.get("largest") else 0


def format_fit(row: dict[str, Any]) -> str:
    """One line of a fit row: the largest batch that trains at its length, and the first that did not."""
    label = f"{row['impl']:<18}{'fit x ' + str(row['seq']):>12}"
    if row.get("error"):
        return f"{label}  error: {e2e.error_summary(row['error'])}"
    oom = f"batch {row['oom_at'][0]} runs out of memory" if row.get("oom_at") else "the largest tried"
    if not row["fits"]:
        return f"{label}  {oom}"
    largest = row["fits"][-1]
    peak = "" if largest["peak_gib"] is None else f" (peak {largest['peak_gib']:.1f} GiB)"
    return f"{label}  batch {largest['batch']} trains{peak}, {oom}"


def format_row(row: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """A child's row as :func:`liger_lab.e2e.format_run` (ratio to hf of the same preset) or :func:`format_fit`."""
    same = list(by_mode(rows, row["model"], "train").values())
    return f"{row['model']:<14}" + (e2e.format_run(row, same) if row["task"] == "train" else format_fit(row))


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else ""


def _number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def by_mode(rows: Sequence[dict[str, Any]], preset: str, task: str) -> dict[str, dict[str, Any]]:
    """The rows of one preset and task, by mode."""
    return {r["impl"]: r for r in rows if r["model"] == preset and r["task"] == task}


def preset_targets(rows: Sequence[dict[str, Any]], preset: str, reference: str) -> list[dict[str, Any]]:
    """liger_lab's targets against ``reference`` in one preset (:func:`liger_lab.e2e.target` dicts)."""
    train, fit = by_mode(rows, preset, "train"), by_mode(rows, preset, "fit")
    ours, theirs = train.get(OURS, {}), train.get(reference, {})
    return [
        e2e.target(f"peak GiB <= {reference}", ours.get("peak_gib"), "<=", theirs.get("peak_gib")),
        e2e.target(f"tokens/s >= {reference}", ours.get("tokens_per_s"), ">=", theirs.get("tokens_per_s")),
        e2e.target(f"largest batch >= {reference}", largest_batch(fit.get(OURS)), ">=",
                   largest_batch(fit.get(reference))),
    ]  # fmt: skip


SUMMARY_HEADER = (
    f"{'mode':<18}{'tokens/s':>11}{'vs ref':>8}{'peak GiB':>10}{'vs ref':>8}{'largest batch':>15}{'vs ref':>8}"
)


def format_summary(preset: str, rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    """A preset's table (each mode against ``args.reference``), liger_lab's targets and the loss checks."""
    config = e2e.model_config(preset)
    train, fit = by_mode(rows, preset, "train"), by_mode(rows, preset, "fit")
    ref_train, ref_batch = train.get(args.reference, {}), largest_batch(fit.get(args.reference))
    lines = [
        f"{preset}: {config.model_type}, {e2e.count_parameters(config):,} parameters, vocabulary "
        f"{config.vocab_size}; train {args.batch}x{args.seq}, fit at seq {args.fit_seq}; ratios to {args.reference}",
        SUMMARY_HEADER,
    ]
    for mode in args.modes:
        speed, peak = train.get(mode, {}).get("tokens_per_s"), train.get(mode, {}).get("peak_gib")
        batch = largest_batch(fit.get(mode))
        lines.append(
            f"{mode:<18}{_number(speed, '.0f'):>11}{_ratio(speed, ref_train.get('tokens_per_s')):>8}"
            f"{_number(peak, '.1f'):>10}{_ratio(peak, ref_train.get('peak_gib')):>8}"
            f"{_number(batch, 'd'):>15}{_ratio(batch, ref_batch):>8}"
        )
    if OURS in args.modes:
        lines.append(f"targets of {OURS} [{e2e.timer_label()}]:")
        lines.append(e2e.format_targets(preset_targets(rows, preset, args.reference)))
    for mode in args.modes:
        if mode != "hf" and "hf" in args.modes:
            verdict = e2e.compare_losses(list(train.values()), "hf", mode, batch=args.batch, seq=args.seq)
            lines.append(e2e.format_comparison(verdict))
    return "\n".join(lines)


def fill_environment(rows: list[dict[str, Any]]) -> None:
    """Give every row the GPU, versions and date of the first row that has them (a failed child has none)
    and the clock of the run. They come from the children because this process must not touch the GPU: a
    CUDA context here would take memory from the fit of every child."""
    known = next((r for r in rows if r.get("gpu")), {})
    for row in rows:
        row.update({key: known[key] for key in ENVIRONMENT if key in known and key not in row})
        row.setdefault("timer", e2e.timer_label())


def main(argv: Sequence[str] | None = None) -> int:
    """Run every child, print and save its row, then the summaries. Exit status 1 when a child failed (an error
    other than running out of memory)."""
    args = parse_arguments(argv)
    tasks = TASKS if args.fit_batches else ("train",)
    plan = [(preset, mode, task) for preset in args.presets for mode in args.modes for task in tasks]
    budget = f", --budget-s {args.budget_s:g} for all" if args.budget_s is not None else ""
    low, high = (len(plan) * s / 60 for s in H200_CHILD_S)
    print(f"{len(plan)} processes, each killed after --timeout-s {args.timeout_s:g}{budget} [{e2e.timer_label()}]; "
          f"on an H200 at the default sizes about {H200_CHILD_S[0]}-{H200_CHILD_S[1]} s each, "
          f"{low:.0f}-{high:.0f} min in all", flush=True)  # fmt: skip
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for index, (preset, mode, task) in enumerate(plan):
        timeout_s = args.timeout_s
        if args.budget_s is not None:
            timeout_s = min(timeout_s, args.budget_s - (time.perf_counter() - start))
        child_start = time.perf_counter()
        row = run_child(args, preset, mode, task, timeout_s)
        row["child_s"] = round(time.perf_counter() - child_start, 1)
        rows.append(row)
        elapsed = time.perf_counter() - start
        to_go = elapsed / len(rows) * (len(plan) - len(rows))
        print(f"{format_row(row, rows)}   [{row['child_s']:.0f} s; {index + 1}/{len(plan)} done, "
              f"about {to_go:.0f} s to go]", flush=True)  # fmt: skip
        if args.json:
            fill_environment(rows)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{len(rows)} processes in {time.perf_counter() - start:.0f} s")
    for preset in args.presets:
        print("\n" + format_summary(preset, rows, args))
    if args.json:
        print(f"\nwrote {args.json}")
    failed = [r for r in rows if r.get("error") and not r.get("oom")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
