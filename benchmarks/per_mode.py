"""One fresh process per patching mode, for the end-to-end benchmark scripts.

Patching changes transformers module-wide, so a script measures each mode in a child process of its own:
``python script.py --child MODE`` prints the mode's row as a JSON line, and the parent gathers the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence

from liger_lab import e2e


def parse_arguments(description: str, default_modes: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """--modes (comma-separated), --batch, --seq, --json FILE; --child MODE is how a script calls itself."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--modes", default=default_modes)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def rows_of_children(script: str, args: argparse.Namespace, label: str) -> Iterator[dict]:
    """The row of each mode of ``args.modes``, each from ``script --child MODE`` in a fresh process; a child
    that fails gives ``{label: mode, "error": ...}``."""
    for mode in args.modes.split(","):
        command = [sys.executable, script, "--child", mode, "--batch", str(args.batch), "--seq", str(args.seq)]
        yield e2e.child_row(command, {label: mode})


def write_rows(rows: list[dict], path: str | None) -> None:
    if path:
        with open(path, "w") as out:
            json.dump(rows, out, indent=1)
            out.write("\n")
