"""Every generated chapter, run unsolved: only the exercises fail, each with its own message.

A learner opens a chapter and runs it top to bottom before writing anything. Each exercise must then say
which exercise it is and what to write (``ExerciseNotDone``), in the interpreter as on a GPU, and every
other cell must still run: a stub may not leave a name undefined that a later cell needs.
"""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from liger_lab.workbook.chapters import exercises_in

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.name for p in (ROOT / "chapters").glob("*.ipynb"))


def _exercises(solution: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for cell in json.loads(solution.read_text())["cells"]:
        if cell["cell_type"] == "code":
            found.update(exercises_in("".join(cell["source"])))
    return found


@pytest.mark.parametrize("name", CHAPTERS)
def test_unsolved_chapter_fails_only_in_its_exercises(name):
    notebook = nbformat.read(ROOT / "chapters" / name, as_version=4)
    NotebookClient(
        notebook, timeout=900, allow_errors=True, resources={"metadata": {"path": str(ROOT / "chapters")}}
    ).execute()
    failures = [
        (index, output["ename"], output["evalue"])
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    others = [f"cell {index}: {ename}: {evalue}" for index, ename, evalue in failures if ename != "ExerciseNotDone"]
    assert not others, "cells that are not exercises failed:\n" + "\n".join(others)
    expected = _exercises(ROOT / "solutions" / name)
    assert len(expected) >= 2, f"{name} has {len(expected)} exercise(s); every chapter needs at least 2"
    reported = {evalue.split()[1] for _, _, evalue in failures}
    assert reported == set(expected), f"exercises reported {sorted(reported)}, expected {sorted(expected)}"
    for _, _, evalue in failures:
        number = evalue.split()[1]
        assert evalue == f"Exercise {number} is not done yet: {expected[number]}"
