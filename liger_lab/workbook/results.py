"""Committed measurements: one store of result rows, for prose that quotes a number its own run cannot produce.

A chapter run on a laptop measures the interpreter, not a GPU; when its text needs an H200 figure (a peer's time, a
peak memory) it reads it here and prints it with where it came from: GPU, versions, date and the clock that timed
it. A number printed this way cannot drift from the measurement. The README's and the notes' tables are generated
from the same rows (``python -m benchmarks.readme_table``).

The store is one JSON-lines file, :data:`STORE`, shipped inside the package (it reads the same from any install,
editable or not). Each line is one row as its benchmark wrote it (op, impl, shape, dtype, the measured fields, the
GPU, the versions, the date and the clock in ``timer`` or ``clock``) plus ``file``, the run it belongs to: the name
of the result file it was imported from (``benchmarks/results/<file>`` in a clone), which :func:`load`, :func:`row`
and :func:`source` take. ``commit`` is the commit the measured code was at (:func:`write_rows` records it) or, for a
file written before rows carried it, the last commit that changed the file. A file holding one object, not a list,
is one row. Rows are only ever appended (:func:`append`, through ``python -m benchmarks.import_results``), so a later
line is a later measurement.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

STORE = Path(__file__).resolve().parent / "data" / "results.jsonl"
"""Every committed row, one JSON object per line."""
SOURCE_TREE = Path(__file__).resolve().parents[2]
RESULTS_DIR = SOURCE_TREE / "benchmarks" / "results"
"""Where a clone keeps the raw result files a benchmark wrote, and the plots the README and the notes show."""
STORE_FIELDS = ("file",)
"""Fields the store adds to a row: :func:`load` gives the rows without them."""

TIMERS = {
    "cuda_graph": "GPU time, CUDA-graph replay",
    "profiler": "GPU time, kernel sum under torch.profiler",
    "do_bench": "CUDA events around each call (host time included)",
    "wall_clock": "wall clock of the interpreter",
    "synchronized_loop": "wall clock of a loop of calls or steps, the GPU synchronised once at its end",
}


@functools.lru_cache(maxsize=4)
def _read(path: Path, modified_ns: int, size: int) -> tuple[dict[str, Any], ...]:
    # Keyed by the file's modification time and size too, so that rows appended in this process are read again.
    with path.open() as lines:
        return tuple(json.loads(line) for line in lines if line.strip())


def _cached_rows(store: Path) -> tuple[dict[str, Any], ...]:
    if not store.exists():
        return ()
    stat = store.stat()
    return _read(store, stat.st_mtime_ns, stat.st_size)


def stored_rows(store: Path = STORE) -> list[dict[str, Any]]:
    """Every row of the store, ``file`` included, in the order they were appended (the file is read once per
    change; each call gets rows of its own)."""
    return [dict(r) for r in _cached_rows(store)]


def names(store: Path = STORE) -> list[str]:
    """The runs of the store (the ``file`` of its rows), in the order they were appended."""
    return list(dict.fromkeys(r["file"] for r in _cached_rows(store)))


def load(name: str, store: Path = STORE) -> list[dict]:
    """The rows of the run ``name`` (a committed result file, e.g. ``"h200-ops-round6.json"``) as its file holds
    them, with their ``commit`` (``file``, the store's own field, left out)."""
    found = [{k: v for k, v in r.items() if k not in STORE_FIELDS} for r in _cached_rows(store) if r["file"] == name]
    if not found:
        raise ValueError(f"no committed results named {name!r}; available: {', '.join(names(store))}")
    return found


def row(name: str, **match: object) -> dict:
    """The one row of ``name`` whose fields equal ``match`` (e.g. ``op="rms_norm", impl="liger"``)."""
    found = [r for r in load(name) if all(r.get(key) == value for key, value in match.items())]
    if len(found) != 1:
        raise ValueError(f"{name}: expected one row with {match}, found {len(found)}")
    return found[0]


def source(name: str, timer: str | None = None) -> str:
    """Where the numbers of ``name`` come from, in one line: GPU, versions, date, commit, clock and file."""
    rows = load(name)
    first = rows[0]
    # A CPU measurement (benchmarks/host_time.py) names its machine, versions and runs in one record.
    machine = first.get("machine", {})
    described = {**machine, **first}
    versions = ", ".join(
        f"{label} {described[key]}"
        for key, label in (("torch", "torch"), ("triton", "Triton"), ("liger_kernel", "Liger-Kernel"))
        if key in described
    )
    clock = timer or next((row["timer"] for row in rows if row.get("timer")), None)  # ceiling rows have none
    where = first.get("gpu") or (f"{machine['cpu']} ({machine['cores']} cores, CPU)" if "cpu" in machine else None)
    dates = [run["date"] for run in first.get("runs", {}).values() if "date" in run]
    # The commit measured: one run of one commit is the rule; a file merged from several runs names each.
    commits = ", ".join(dict.fromkeys(row["commit"] for row in rows if row.get("commit")))
    parts = [where or "unknown GPU", versions, first.get("date") or max(dates, default="undated"),
             commits and f"commit {commits}"]  # fmt: skip
    clock_text = f"; {TIMERS.get(clock, clock)}" if clock else ""
    return f"{', '.join(part for part in parts if part)}{clock_text} ({name})"


def latest(op: str, impl: str | None = None, *, store: Path = STORE, **match: object) -> dict:
    """The most recent stored measurement of ``op`` (by ``impl`` too when given) whose fields equal ``match``
    (``shape=[16384, 4096]``, ``gpu="NVIDIA H200"``, ``file=...``): the latest date, and of one date the row
    appended last. A row that records a failure (an ``error``) is not a measurement. The row comes whole, with its
    ``file`` and ``commit``."""
    wanted = {"op": op, **({"impl": impl} if impl is not None else {}), **match}
    found = [
        (r.get("date") or "", position, r)
        for position, r in enumerate(_cached_rows(store))
        if "error" not in r and all(r.get(key) == value for key, value in wanted.items())
    ]
    if not found:
        described = ", ".join(f"{key}={value!r}" for key, value in wanted.items())
        raise ValueError(f"no stored measurement with {described}")
    return dict(max(found, key=lambda item: item[:2])[2])


def append(rows: Sequence[dict], name: str, *, commit: str | None = None, store: Path = STORE) -> None:
    """Add the rows of one run to the store under ``name``, each with ``commit`` where it records none. A name
    already in the store is an error: a run is imported once."""
    if not rows:
        raise ValueError(f"{name}: no rows to store")
    if name in names(store):
        raise ValueError(f"{name} is in the store already: a run is imported once")
    store.parent.mkdir(parents=True, exist_ok=True)
    with store.open("a") as out:
        for measured in rows:
            stamped = {"file": name, **({"commit": commit} if commit else {}), **measured}
            out.write(json.dumps(stamped, separators=(",", ":")) + "\n")


@functools.lru_cache(maxsize=1)
def commit() -> str | None:
    """The commit of the source tree this package runs from, ``-dirty`` after it when tracked files have changed;
    None outside a git clone (an installed package). ``LIGER_LAB_COMMIT`` in the environment overrides it: a copy of
    the tree without its history (a lent GPU machine's) names the commit it was copied from."""
    named = os.environ.get("LIGER_LAB_COMMIT")
    if named:
        return named
    if not (SOURCE_TREE / ".git").exists():
        return None

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(SOURCE_TREE), *args], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    try:
        head, changed = git("rev-parse", "--short=12", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if changed else "")


def write_rows(rows: Iterable[dict], path: Path, *, environment: dict | None = None) -> None:
    """Write a benchmark's rows to ``path`` as a JSON list: the one writer of every benchmark script and command.

    Each row gets the fields of ``environment`` it lacks (default: this process's GPU, versions and date,
    :func:`liger_lab.profiling.environment`; a parent that must not touch the GPU passes its children's) and the
    ``commit`` measured (:func:`commit`). The file is written aside and then renamed, so a run stopped midway leaves
    the previous complete file, never half of one."""
    if environment is None:
        from liger_lab import profiling  # imports torch: only a writer needs it

        environment = profiling.environment()
    shared = {**environment, "commit": commit()}
    stamped = [{**row, **{key: value for key, value in shared.items() if key not in row}} for row in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(stamped, indent=1) + "\n")
    partial.replace(path)
