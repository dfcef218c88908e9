"""Import result files into the results store: each file's rows appended under its name, with its provenance.

    python -m benchmarks.import_results benchmarks/results/h200-ops-round7.json   # one new run
    python -m benchmarks.import_results                 # every file of benchmarks/results/ not in the store yet
    python -m benchmarks.import_results --rebuild       # the store again from every file of benchmarks/results/

A benchmark writes its rows to a JSON file (``--json``, :func:`liger_lab.workbook.results.write_rows`: each row with
the GPU, versions, date, clock and the commit measured); importing it appends them to
:data:`liger_lab.workbook.results.STORE`, from which the chapters, the README and the notes read. A file holding one
object is one row. A file whose rows record no commit (those written before rows carried one) gets the last commit
that changed it. Files are imported in the order git committed them, then by name, so that a later line of the store
is a later measurement; a file git does not know yet comes last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from liger_lab.workbook import results


def last_change(path: Path) -> tuple[int, str] | None:
    """(commit time, short hash) of the last commit that changed ``path``; None when git does not know the file."""
    done = subprocess.run(
        ["git", "-C", str(path.parent), "log", "-1", "--abbrev=12", "--format=%ct %h", "--", path.name],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0 or not done.stdout.strip():
        return None
    time, commit = done.stdout.split()
    return int(time), commit


def file_rows(path: Path) -> list[dict]:
    """The rows of a result file: its list, or its one object."""
    data = json.loads(path.read_text())
    return data if isinstance(data, list) else [data]


def import_files(paths: Sequence[Path], store: Path = results.STORE) -> list[str]:
    """Append each file's rows to ``store`` under its name (oldest commit first); returns the names imported."""
    changes = {path: last_change(path) for path in paths}
    ordered = sorted(paths, key=lambda p: (changes[p] is None, changes[p] or (0, ""), p.name))
    for path in ordered:
        change = changes[path]
        results.append(file_rows(path), path.name, commit=change[1] if change else None, store=store)
    return [path.name for path in ordered]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="result files (default: those not in the store yet)")
    parser.add_argument("--rebuild", action="store_true", help="write the store anew from every committed file")
    parser.add_argument("--store", type=Path, default=results.STORE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    committed = sorted(results.RESULTS_DIR.glob("*.json"))
    if args.rebuild:
        args.store.unlink(missing_ok=True)
    known = set(results.names(args.store))
    paths = args.files or [path for path in committed if path.name not in known]
    for name in import_files(paths, args.store):
        print(f"imported {name}")


if __name__ == "__main__":
    main()
