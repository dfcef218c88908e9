import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl

from liger_lab import runtime
from liger_lab.workbook import exercises
from liger_lab.workbook.chapters import exercise_notebook, out_of_date, stub_source
from liger_lab.workbook.exercises import STUB_MARKER

ROOT = Path(__file__).resolve().parent.parent


def test_chapters_are_generated_from_solutions():
    stale = out_of_date(ROOT / "solutions", ROOT / "chapters")
    assert not stale, f"run `python -m liger_lab.workbook.chapters`: out of date: {stale}"


def test_every_solution_has_a_chapter_and_exercises():
    solutions = sorted(p.name for p in (ROOT / "solutions").glob("*.ipynb"))
    assert solutions, "no solution notebooks"
    assert solutions == sorted(p.name for p in (ROOT / "chapters").glob("*.ipynb"))


def test_committed_chapters_carry_no_outputs():
    for path in (ROOT / "chapters").glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            assert not cell.get("outputs"), f"{path.name} has outputs"


def test_stub_replaces_only_the_marked_region_and_keeps_indentation():
    source = "def f(x):\n    y = 1\n    # BEGIN SOLUTION 3.1: return x plus one\n    return x + y\n    # END SOLUTION\n"
    stubbed = stub_source(source)
    assert "return x + y" not in stubbed
    assert stubbed == (
        "def f(x):\n    y = 1\n"
        "    # EXERCISE 3.1: return x plus one\n"
        '    liger_lab.workbook.exercises.todo("3.1", "return x plus one")\n'
        "    # END EXERCISE 3.1\n"
    )


def test_a_stub_inside_a_triton_kernel_compiles_and_names_its_exercise():
    source = (
        "@triton.jit\ndef k(x_ptr):\n    i = tl.program_id(0)\n"
        '    # BEGIN SOLUTION 2.3: store "one"\n    tl.store(x_ptr + i, 1.0)\n    # END SOLUTION\n'
    )
    stubbed = stub_source(source)
    assert stubbed.startswith('@liger_lab.workbook.exercises.jit("2.3", "store \\"one\\"")\ndef k(x_ptr):\n')
    assert "raise" not in stubbed and "tl.store" not in stubbed
    assert stubbed.endswith(f"    {STUB_MARKER}\n    # END EXERCISE 2.3\n")


def test_python_regions_after_a_kernel_are_not_kernel_stubs():
    source = (
        "@triton.jit\ndef k(x_ptr):\n    pass\n\n\ndef launch(x):\n"
        "    # BEGIN SOLUTION 2.4: launch k\n    k[(1,)](x)\n    # END SOLUTION\n"
    )
    stubbed = stub_source(source)
    assert stubbed.startswith("@triton.jit\n") and 'liger_lab.workbook.exercises.todo("2.4", "launch k")' in stubbed


@pytest.mark.parametrize(
    "source",
    [
        "# BEGIN SOLUTION 1.1: x\nx = 1\n",
        "x = 1\n# END SOLUTION\n",
        "# BEGIN SOLUTION hint: no exercise number\nx = 1\n# END SOLUTION\n",
    ],
)
def test_unbalanced_or_unnumbered_markers_are_errors(source):
    with pytest.raises(ValueError, match="SOLUTION"):
        stub_source(source)


def test_unsolved_kernel_raises_on_launch_and_solved_kernel_runs():
    @exercises.jit("9.9", "write the body")
    def unsolved(x_ptr):
        pass  # your code here

    @exercises.jit("9.9", "write the body")
    def solved(x_ptr):
        tl.store(x_ptr + tl.program_id(0), 1.0)

    x = torch.zeros(4, device=runtime.DEVICE)
    with pytest.raises(exercises.ExerciseNotDone, match=r"^Exercise 9\.9 is not done yet: write the body$"):
        unsolved[(4,)](x)
    solved[(4,)](x)
    assert x.tolist() == [1.0] * 4


def test_exercise_notebook_drops_outputs():
    notebook = {
        "cells": [{"cell_type": "code", "source": ["x = 1\n"], "outputs": [{"output_type": "stream"}],
                   "execution_count": 3, "metadata": {}}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5,
    }  # fmt: skip
    cell = exercise_notebook(notebook)["cells"][0]
    assert cell["outputs"] == [] and cell["execution_count"] is None


@pytest.mark.filterwarnings("ignore:'liger_lab.workbook.chapters' found in sys.modules")  # imported above
@pytest.mark.parametrize("module", ["liger_lab.workbook.chapters", "liger_lab.chapters"])
def test_the_module_runs_the_generator(module, monkeypatch, capsys):
    # `python -m liger_lab.workbook.chapters --check`, as the Makefile and CI run it, and its old name.
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [module, "--check"])
    monkeypatch.delitem(sys.modules, module, raising=False)  # as in a fresh `python -m`
    runpy.run_module(module, run_name="__main__")
    assert capsys.readouterr().out == "chapters/ is in sync with solutions/\n"
