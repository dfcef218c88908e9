"""Generate the exercise notebooks in ``chapters/`` from the complete ones in ``solutions/``.

In a solution's code cell, the lines between ``# BEGIN SOLUTION <exercise>: <task>`` and ``# END SOLUTION``
are (part of) an exercise, for instance ``# BEGIN SOLUTION 1.2: the backward kernel's dx``. The task says
what to write, never how: hints live in the markdown, collapsed. The generated chapter keeps everything
else, drops all outputs so the learner starts clean, and replaces each region by a stub at the marker's
indentation that names its exercise, between ``# EXERCISE <n>: <task>`` and ``# END EXERCISE <n>`` (see
:mod:`liger_lab.workbook.exercises`):

* in Python code, a call to ``liger_lab.workbook.exercises.todo``, which raises ``ExerciseNotDone``;
* inside a ``@triton.jit`` kernel, which cannot raise, ``pass`` under the stub marker, and the kernel's
  decorator becomes ``@liger_lab.workbook.exercises.jit(...)``, which refuses to launch while the marker is there.

Run as ``python -m liger_lab.workbook.chapters`` (or ``liger-lab exercises``) it writes
``chapters/``; with ``--check`` it only says whether ``chapters/`` is up to date.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from liger_lab.workbook.exercises import STUB_MARKER, begin_line, end_line

_BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?P<rest>.*)$")
_EXERCISE = re.compile(r"^\s+(?P<exercise>\d+\.\d+):\s*(?P<task>\S.*)$")
_END = re.compile(r"^\s*# END SOLUTION\s*$")
_DEF = re.compile(r"^(?P<indent>\s*)def ")
_TRITON_JIT = re.compile(r"^(?P<indent>\s*)@triton\.jit\s*$")
_KERNEL_STUB_NOTE = "# Your code replaces the next line: while that line is there, the kernel does not launch."


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def stub_source(source: str) -> str:
    """Replace every marked solution region of one cell's source by a stub."""
    out: list[str] = []
    inside = False
    last_def: tuple[int, int] | None = None  # (indent, index in out) of the latest ``def``
    for line in source.splitlines(keepends=True):
        text = line.rstrip("\n")
        begin = _BEGIN.match(text)
        if begin:
            if inside:
                raise ValueError("# BEGIN SOLUTION inside another solution region")
            exercise = _EXERCISE.match(begin["rest"])
            if not exercise:
                raise ValueError(f"expected '# BEGIN SOLUTION <chapter>.<n>: <task>', got {text.strip()!r}")
            inside = True
            indent, number, task = begin["indent"], exercise["exercise"], exercise["task"].strip()
            decorator = _enclosing_triton_jit(out, last_def, len(indent))
            if decorator is not None:
                jit_indent = _TRITON_JIT.match(out[decorator].rstrip("\n"))["indent"]
                out[decorator] = f"{jit_indent}@liger_lab.workbook.exercises.jit({_quoted(number)}, {_quoted(task)})\n"
                out.append(f"{indent}{begin_line(number, task)}\n")
                out.append(f"{indent}{_KERNEL_STUB_NOTE}\n")
                out.append(f"{indent}{STUB_MARKER}\n")
            else:
                out.append(f"{indent}{begin_line(number, task)}\n")
                out.append(f"{indent}liger_lab.workbook.exercises.todo({_quoted(number)}, {_quoted(task)})\n")
            out.append(f"{indent}{end_line(number)}\n")
        elif _END.match(text):
            if not inside:
                raise ValueError("# END SOLUTION without a matching # BEGIN SOLUTION")
            inside = False
        elif not inside:
            definition = _DEF.match(text)
            if definition:
                last_def = (len(definition["indent"]), len(out))
            out.append(line)
    if inside:
        raise ValueError("# BEGIN SOLUTION without a matching # END SOLUTION")
    return "".join(out)


def _enclosing_triton_jit(out: list[str], last_def: tuple[int, int] | None, indent: int) -> int | None:
    """Index in ``out`` of the ``@triton.jit`` line decorating the function a region at ``indent`` is in."""
    if last_def is None or last_def[0] >= indent:
        return None
    index = last_def[1] - 1
    while index >= 0 and out[index].lstrip().startswith("@"):
        if _TRITON_JIT.match(out[index].rstrip("\n")):
            return index
        index -= 1
    return None


def exercises_in(source: str) -> dict[str, str]:
    """``{exercise: task}`` for every solution region of a cell's source, in order."""
    found: dict[str, str] = {}
    for line in source.splitlines():
        begin = _BEGIN.match(line)
        exercise = begin and _EXERCISE.match(begin["rest"])
        if exercise:
            found.setdefault(exercise["exercise"], exercise["task"].strip())
    return found


def exercise_notebook(solution: dict) -> dict:
    """The exercise version of a solution notebook (as parsed JSON)."""
    notebook = json.loads(json.dumps(solution))
    for cell in notebook["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        cell["source"] = stub_source(source).splitlines(keepends=True)
        cell["outputs"] = []
        cell["execution_count"] = None
    return notebook


def render(notebook: dict) -> str:
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def generate(
    solutions: Path = Path("solutions"), chapters: Path = Path("chapters"), names: list[str] | None = None
) -> list[Path]:
    """Write ``chapters/X.ipynb`` for every ``solutions/X.ipynb`` (or only the ``names`` given)."""
    chapters.mkdir(exist_ok=True)
    written = []
    for source in sorted(solutions.glob("*.ipynb")):
        if names and source.name not in names:
            continue
        target = chapters / source.name
        target.write_text(render(exercise_notebook(json.loads(source.read_text()))))
        written.append(target)
    return written


def out_of_date(solutions: Path = Path("solutions"), chapters: Path = Path("chapters")) -> list[str]:
    """Names of chapters that differ from what :func:`generate` would write (missing or stale)."""
    stale = []
    for source in sorted(solutions.glob("*.ipynb")):
        target = chapters / source.name
        expected = render(exercise_notebook(json.loads(source.read_text())))
        if not target.exists() or target.read_text() != expected:
            stale.append(source.name)
    extra = {p.name for p in chapters.glob("*.ipynb")} - {p.name for p in solutions.glob("*.ipynb")}
    return stale + sorted(extra)


def main(arguments: list[str]) -> None:
    """``--check``: exit with a message when ``chapters/`` is stale; otherwise regenerate the chapters named in
    ``arguments`` (all when there are none)."""
    if "--check" in arguments:
        stale = out_of_date()
        if stale:
            sys.exit(f"chapters/ is out of date for {', '.join(stale)}: run `python -m liger_lab.workbook.chapters`")
        print("chapters/ is in sync with solutions/")
    else:
        for path in generate(names=[Path(a).name for a in arguments] or None):
            print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
