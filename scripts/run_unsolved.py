"""Run generated chapters unsolved and print what a learner sees: each failing cell and its error.

``python scripts/run_unsolved.py chapters/01_rmsnorm.ipynb ...`` (default: every chapter). The test suite
asserts the same on CPU (tests/test_unsolved_chapters.py); this prints it, e.g. on a GPU machine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main(paths: list[str]) -> int:
    for path in [Path(p) for p in paths] or sorted(Path("chapters").glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        folder = {"metadata": {"path": str(path.parent)}}
        NotebookClient(notebook, timeout=900, kernel_name="python3", allow_errors=True, resources=folder).execute()
        print(f"{path} ({time.perf_counter() - start:.0f} s):")
        for index, cell in enumerate(notebook.cells):
            for output in cell.get("outputs", []):
                if output.output_type == "error":
                    print(f"  cell {index}: {output.ename}: {output.evalue}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
