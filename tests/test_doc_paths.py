"""What the chapters and the contributor docs point a reader to is there: every file of the tree they name exists,
and the chapters take committed measurements from the results store, never from a clone's raw result files.

A chapter runs from any install of the package, where ``benchmarks/results/`` is absent: the store is package data
(``liger_lab.results``), so its numbers read the same everywhere. A path in prose or in a printed source
(``benchmarks/experiments/attention_layout.py``) is one the reader can open; a module that moved must not leave its
old path behind. The benchmark notes are left out: they keep the history of scripts that are gone."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
# A file named from the clone's root, under one of its top-level folders; a glob (h200x2-dist*.json) names a set.
TREE_PATH = re.compile(
    r"(?<![\w./-])(?:liger_lab|benchmarks|tests|solutions|chapters)/[\w./*-]*\.(?:py|md|json|ipynb)\b"
)


def _sources(path: Path) -> list[tuple[str, str]]:
    """(where, text) of each markdown and code cell of a notebook, or the whole of a markdown file."""
    if path.suffix != ".ipynb":
        return [(path.name, path.read_text())]
    cells = json.loads(path.read_text())["cells"]
    return [(f"{path.name} cell {index}", "".join(cell["source"])) for index, cell in enumerate(cells)]


def missing_paths(sources: list[tuple[str, str]]) -> list[str]:
    """The paths of the tree that the texts name and that match no file, each with where it was named."""
    named = [(where, path) for where, text in sources for path in TREE_PATH.findall(text)]
    return [f"{where}: {path}" for where, path in named if not any(ROOT.glob(path))]


@pytest.mark.parametrize("path", SOLUTIONS + DOCS, ids=lambda p: p.name)
def test_every_path_named_exists(path):
    missing = missing_paths(_sources(path))
    assert not missing, "name where the file is now:\n" + "\n".join(missing)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_chapters_read_committed_measurements_from_the_store(path):
    readers = [where for where, text in _sources(path) if "RESULTS_DIR" in text]
    assert not readers, "read the run with results.row / results.load / results.latest:\n" + "\n".join(readers)


def test_a_path_that_moved_is_reported():
    """The check itself: a script that moved is caught, the glob of a committed run and a live path are not."""
    text = "`benchmarks/e2e_vocab.py`, `benchmarks/results/h200x2-dist*.json` and `liger_lab/hf/loss.py`"
    assert missing_paths([("a cell", text)]) == ["a cell: benchmarks/e2e_vocab.py"]
