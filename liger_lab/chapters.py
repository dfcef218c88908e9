"""Generate the exercise notebooks in ``chapters/`` from the complete ones in ``solutions/``.

In a solution's code cell, the lines between ``# BEGIN SOLUTION`` and ``# END SOLUTION`` are the
exercise. An optional hint follows the opening marker: ``# BEGIN SOLUTION hint: divide by n_cols``.
The generated chapter keeps everything else, replaces each region by a stub at the marker's
indentation, and drops all outputs so the learner starts clean.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?:\s+hint:\s*(?P<hint>.*))?$")
_END = re.compile(r"^\s*# END SOLUTION\s*$")


def stub_source(source: str) -> str:
    """Replace every marked solution region of one cell's source by a stub."""
    out: list[str] = []
    inside = False
    for line in source.splitlines(keepends=True):
        begin = _BEGIN.match(line.rstrip("\n"))
        if begin and not inside:
            inside = True
            indent, hint = begin["indent"], begin["hint"] or "see the text above"
            out.append(f"{indent}# EXERCISE: {hint}\n")
            out.append(f'{indent}raise NotImplementedError("exercise: {hint.replace(chr(34), chr(39))}")\n')
        elif _END.match(line.rstrip("\n")):
            if not inside:
                raise ValueError("# END SOLUTION without a matching # BEGIN SOLUTION")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("# BEGIN SOLUTION without a matching # END SOLUTION")
    return "".join(out)


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


def generate(solutions: Path = Path("solutions"), chapters: Path = Path("chapters")) -> list[Path]:
    """Write ``chapters/X.ipynb`` for every ``solutions/X.ipynb``; return the paths written."""
    chapters.mkdir(exist_ok=True)
    written = []
    for source in sorted(solutions.glob("*.ipynb")):
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


if __name__ == "__main__":
    import sys

    if "--check" in sys.argv:
        stale = out_of_date()
        if stale:
            sys.exit(f"chapters/ is out of date for {', '.join(stale)}: run `python -m liger_lab.chapters`")
        print("chapters/ is in sync with solutions/")
    else:
        for path in generate():
            print(f"wrote {path}")
