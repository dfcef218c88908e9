"""Committed measurements, for prose that quotes a number the notebook's own run cannot produce.

A chapter run on a laptop measures the interpreter, not a GPU; when its text needs an H200 figure (a peer's
time, a peak memory) it reads it here from a JSON in ``benchmarks/results/`` and prints it with where it came
from: GPU, versions, date and the clock that timed it. A number printed this way cannot drift from the file.
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"

TIMERS = {
    "cuda_graph": "GPU time, CUDA-graph replay",
    "profiler": "GPU time, kernel sum under torch.profiler",
    "do_bench": "CUDA events around each call (host time included)",
    "wall_clock": "wall clock of the interpreter",
}


def load(name: str) -> list[dict]:
    """The rows of ``benchmarks/results/<name>`` (a file holding one object gives one row)."""
    path = RESULTS_DIR / name
    if not path.exists():
        available = ", ".join(sorted(p.name for p in RESULTS_DIR.glob("*.json")))
        raise ValueError(f"no committed results named {name!r}; available: {available}")
    data = json.loads(path.read_text())
    return data if isinstance(data, list) else [data]


def row(name: str, **match: object) -> dict:
    """The one row of ``name`` whose fields equal ``match`` (e.g. ``op="rms_norm", impl="liger"``)."""
    found = [r for r in load(name) if all(r.get(key) == value for key, value in match.items())]
    if len(found) != 1:
        raise ValueError(f"{name}: expected one row with {match}, found {len(found)}")
    return found[0]


def source(name: str, timer: str | None = None) -> str:
    """Where the numbers of ``name`` come from, in one line: GPU, versions, date, clock and file."""
    rows = load(name)
    first = rows[0]
    versions = ", ".join(
        f"{label} {first[key]}"
        for key, label in (("torch", "torch"), ("triton", "Triton"), ("liger_kernel", "Liger-Kernel"))
        if key in first
    )
    clock = timer or next((row["timer"] for row in rows if row.get("timer")), None)  # ceiling rows have none
    parts = [first.get("gpu", "unknown GPU"), versions, first.get("date", "undated")]
    clock_text = f"; {TIMERS.get(clock, clock)}" if clock else ""
    return f"{', '.join(part for part in parts if part)}{clock_text} ({name})"
