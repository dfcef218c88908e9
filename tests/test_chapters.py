import json
from pathlib import Path

import pytest

from liger_lab.chapters import exercise_notebook, out_of_date, stub_source

ROOT = Path(__file__).resolve().parent.parent


def test_chapters_are_generated_from_solutions():
    stale = out_of_date(ROOT / "solutions", ROOT / "chapters")
    assert not stale, f"run `python -m liger_lab.chapters`: out of date: {stale}"


def test_every_solution_has_a_chapter_and_exercises():
    solutions = sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))
    assert solutions, "no solution notebooks"
    assert solutions == sorted(p.name for p in (ROOT / "chapters").glob("*.ipynb"))


def test_committed_chapters_carry_no_outputs():
    for path in (ROOT / "chapters").glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            assert not cell.get("outputs"), f"{path.name} has outputs"


def test_stub_replaces_only_the_marked_region_and_keeps_indentation():
    source = (
        "def f(x):\n    y = 1\n    # BEGIN SOLUTION hint: return x plus one\n    return x + y\n    # END SOLUTION\n"
    )
    stubbed = stub_source(source)
    assert "return x + y" not in stubbed
    assert "    # EXERCISE: return x plus one\n" in stubbed
    assert '    raise NotImplementedError("exercise: return x plus one")\n' in stubbed
    assert stubbed.startswith("def f(x):\n    y = 1\n")


@pytest.mark.parametrize("source", ["# BEGIN SOLUTION\nx = 1\n", "x = 1\n# END SOLUTION\n"])
def test_unbalanced_markers_are_errors(source):
    with pytest.raises(ValueError, match="SOLUTION"):
        stub_source(source)


def test_exercise_notebook_drops_outputs():
    notebook = {
        "cells": [{"cell_type": "code", "source": ["x = 1\n"], "outputs": [{"output_type": "stream"}],
                   "execution_count": 3, "metadata": {}}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
    }  # fmt: skip
    cell = exercise_notebook(notebook)["cells"][0]
    assert cell["outputs"] == [] and cell["execution_count"] is None
