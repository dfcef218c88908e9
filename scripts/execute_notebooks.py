"""Execute solution notebooks in place so their committed outputs come from a real run.

``python scripts/execute_notebooks.py solutions/01_rmsnorm.ipynb ...`` (default: every solution). Run it on
the GPU machine; a notebook that fails keeps its previous outputs and the script exits non-zero.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def main(paths: list[str]) -> int:
    notebooks = [Path(p) for p in paths] or sorted(Path("solutions").glob("*.ipynb"))
    failed = []
    for path in notebooks:
        notebook = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        try:
            folder = {"metadata": {"path": str(path.parent)}}
            client = NotebookClient(notebook, timeout=900, kernel_name="python3", resources=folder)
            client.execute()
        except Exception as error:  # report and go on with the next notebook
            print(f"FAILED {path}: {type(error).__name__}: {str(error)[-2000:]}", flush=True)
            failed.append(path)
            continue
        nbformat.write(notebook, path)
        print(f"ran {path} in {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
