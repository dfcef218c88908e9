"""One measurement per fresh Python process: ``python -m liger_lab.e2e TASK``, and the parent's side of it.

Patching replaces module-level functions, and a peak-memory figure means nothing if an earlier run left tensors or a
fragmented cache behind, so every measurement runs in a process of its own. :func:`run_isolated` starts ``python -m
liger_lab.e2e`` (:func:`main`) for one task and mode and reads the one JSON line it prints back; :func:`child_row`
does that for any command that prints its row. The parent never touches the GPU (a CUDA context there would take
memory from every child's measurement): :func:`environment_of` takes the GPU and versions from the children's rows.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from liger_lab.e2e.presets import DTYPES, MODEL_SIZES, model_config
from liger_lab.e2e.training import (
    MODES,
    largest_fit,
    memory_timeline,
    profile_step,
    timer_label,
    train,
    train_lengths,
)

TASKS = {"train": "e2e", "fit": "e2e_fit", "timeline": "e2e_timeline", "profile": "e2e_profile",
         "lengths": "e2e_lengths"}  # fmt: skip
"""The tasks of ``python -m liger_lab.e2e``, each with the op its rows carry."""
ENVIRONMENT = ("date", "gpu", "torch", "triton", "transformers", "liger_lab", "liger_kernel")


def run_isolated(
    task: str = "train",
    *,
    mode: str,
    model: str = "1.5b",
    layers: int | None = None,
    batch: int = 8,
    seq: int = 2048,
    steps: int = 5,
    warmup: int = 2,
    dtype: str | None = None,
    lr: float = 1e-4,
    shapes: Sequence[tuple[int, int]] = (),
    compile_backend: str | None = None,
    compile_mode: str | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run :func:`liger_lab.e2e.train` (task "train"), :func:`~liger_lab.e2e.training.train_lengths` ("lengths"),
    :func:`~liger_lab.e2e.largest_fit` ("fit", over ``shapes``), :func:`~liger_lab.e2e.memory_timeline`
    ("timeline") or :func:`~liger_lab.e2e.profile_step` ("profile") in a fresh ``python -m liger_lab.e2e`` process
    and return its JSON row, which names the preset (``"model"``).

    A child that dies without a row (a CUDA crash, a missing package) gives the row it was asked for with its
    "error"; one still running after ``timeout_s`` seconds is killed (see :func:`child_row`).
    """
    args = [sys.executable, "-m", "liger_lab.e2e", task, "--mode", mode, "--model", model, "--batch", str(batch),
            "--seq", str(seq), "--steps", str(steps), "--warmup", str(warmup), "--lr", str(lr)]  # fmt: skip
    if layers is not None:
        args += ["--layers", str(layers)]
    if dtype is not None:
        args += ["--dtype", dtype]
    if shapes:
        args += ["--shapes", ",".join(f"{b}x{t}" for b, t in shapes)]
    if compile_backend is not None:
        args += ["--compile-backend", compile_backend]
    if compile_mode is not None:
        args += ["--compile-mode", compile_mode]
    sizes = {"shapes": [list(shape) for shape in shapes]} if task == "fit" else {"batch": batch, "seq": seq}
    failed = {"op": TASKS.get(task, f"e2e_{task}"), "impl": mode, "model": model, **sizes}
    return child_row(args, failed, timeout_s=timeout_s)


def child_row(command: Sequence[str], failed: dict[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``command``, a Python process that prints its result as a JSON line, and return the last such row.
    A child that fails or prints no row (a CUDA crash, a missing package) gives ``failed`` plus its "error";
    one still running after ``timeout_s`` seconds is killed and gives ``failed`` with "timeout": True too. With no
    time left (``timeout_s`` <= 0) nothing starts: ``failed`` with "skipped": True."""
    if timeout_s is not None and timeout_s <= 0:
        return {**failed, "error": "not run: no time left", "skipped": True}
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"killed after the timeout of {timeout_s:g} s", "timeout": True}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {**failed, "error": (done.stderr or done.stdout).strip()[-2000:] or f"exit code {done.returncode}"}
    return json.loads(lines[-1])


def environment_of(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The GPU, versions and date of the first row that has them (a child that failed has none), and this run's
    clock: what every row of a run shares, for the rows that lack it."""
    known = next((row for row in rows if row.get("gpu")), {})
    return {**{key: known[key] for key in ENVIRONMENT if key in known}, "timer": timer_label()}


def parse_sizes(text: str, expected: str = "sizes joined by x, e.g. 8192x4096") -> tuple[int, ...]:
    """``"8192x4096"`` -> (8192, 4096): positive sizes joined by x."""
    try:
        sizes = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r}: expected {expected}") from None
    if any(size < 1 for size in sizes):
        raise ValueError(f"shape {text!r}: expected positive sizes")
    return sizes


def parse_shape(text: str) -> tuple[int, int]:
    """``"8x2048"`` -> (8, 2048): a batch x sequence-length pair."""
    sizes = parse_sizes(text, expected="BATCHxSEQ, e.g. 8x2048")
    if len(sizes) != 2:
        raise ValueError(f"shape {text!r}: expected BATCHxSEQ, e.g. 8x2048")
    return sizes


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m liger_lab.e2e TASK --mode MODE ...``: one task of :data:`TASKS` in this process; prints its row
    as one JSON line."""
    parser = argparse.ArgumentParser(
        prog="python -m liger_lab.e2e", description="One end-to-end measurement of a preset in one mode."
    )
    parser.add_argument("task", choices=list(TASKS))
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="1.5b")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--shapes", default="", help="comma-separated BATCHxSEQ sizes for the fit task")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the +compile modes")
    parser.add_argument("--compile-mode", help="torch.compile mode of the +compile modes (reduce-overhead)")
    args = parser.parse_args(argv)
    config = model_config(args.model, layers=args.layers)
    common = dict(dtype=DTYPES[args.dtype] if args.dtype else None, lr=args.lr, compile_backend=args.compile_backend,
                  compile_mode=args.compile_mode)  # fmt: skip
    if args.task == "train":
        row = train(args.mode, config, args.batch, args.seq, steps=args.steps, warmup=args.warmup, **common)
    elif args.task == "fit":
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s] or [(args.batch, args.seq)]
        row = largest_fit(args.mode, config, shapes, **common)
    elif args.task == "lengths":
        row = train_lengths(args.mode, config, args.batch, **common)
    elif args.task == "timeline":
        row = memory_timeline(args.mode, config, args.batch, args.seq, **common)
    else:
        row = profile_step(args.mode, config, args.batch, args.seq, steps=args.steps, **common)
    print(json.dumps({**row, "model": args.model}))
