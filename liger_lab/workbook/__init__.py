"""The teaching layer of liger_lab: what the chapters in ``chapters/`` use besides the library itself.

* :mod:`~liger_lab.workbook.checks`: exercise and test checks against float64, PASS/FAIL lines, guard bands;
* :mod:`~liger_lab.workbook.exercises`: what an unsolved exercise does (``ExerciseNotDone``, ``exercises.jit``);
* :mod:`~liger_lab.workbook.chapters`: generates ``chapters/`` from ``solutions/``;
* :mod:`~liger_lab.workbook.diagrams`: the figures, drawn by code from the library's own constants;
* :mod:`~liger_lab.workbook.results`: committed measurements, quoted with where they come from.
"""

from __future__ import annotations

import importlib
import runpy
import sys


def alias(old_name: str, new_name: str) -> None:
    """Each old path of a moved module (``liger_lab.checks``, ``liger_lab.chapters``, ...) is a module that only
    calls this, so that importing it gives the moved module itself and ``python -m`` on it runs the moved one."""
    if old_name == "__main__":
        runpy.run_module(new_name, run_name="__main__", alter_sys=True)
    else:
        sys.modules[old_name] = importlib.import_module(new_name)
