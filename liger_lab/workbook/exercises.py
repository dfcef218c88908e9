"""What an unsolved exercise does: say which exercise is still a stub, on the GPU and in the interpreter.

The chapters in ``chapters/`` are generated from the solutions (:mod:`liger_lab.workbook.chapters`); each solved
region becomes a stub that names its exercise, between a ``# EXERCISE <n>: <task>`` line and a
``# END EXERCISE <n>`` line. Python code gets a call to :func:`todo`, which raises :class:`ExerciseNotDone`. A
Triton kernel cannot raise (the GPU compiler rejects ``raise``), so a stubbed kernel body becomes ``pass`` under a
marker comment and its decorator becomes :func:`jit`: ``triton.jit`` that, while the marker is still in the
source, refuses to launch and raises :class:`ExerciseNotDone` on the host instead of compiling an empty kernel.
Delete the marker line, write the body, run the cell again: it is a plain ``triton.jit`` kernel.

A learner who writes the code but leaves the stub's line in (the ``todo`` call, or the kernel's marker) is told
which line to delete: the code between the two comment lines is theirs, and anything there besides the stub line
and comments means the exercise is written.
"""

from __future__ import annotations

import inspect
import linecache
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # triton is imported only once liger_lab.runtime has chosen GPU or interpreter
    import triton

STUB_MARKER = "pass  # your code here"
"""The line a stubbed kernel body is left with; while it is in the source the kernel does not launch."""


def begin_line(exercise: str, task: str) -> str:
    """The comment that opens exercise ``exercise``'s stub in a generated chapter."""
    return f"# EXERCISE {exercise}: {task}"


def end_line(exercise: str) -> str:
    """The comment that closes exercise ``exercise``'s stub: the learner's code goes above it."""
    return f"# END EXERCISE {exercise}"


class OneLineInJupyter(Exception):
    """An exception that Jupyter (IPython) shows as its one-line message, without a traceback: the learner's cell
    is where it happened, and the frames inside liger_lab say nothing to them. Elsewhere it is a plain exception
    with its usual traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class ExerciseNotDone(OneLineInJupyter, NotImplementedError):
    """An exercise of the workbook is still a stub."""


def _not_done(exercise: str, task: str) -> str:
    return f"Exercise {exercise} is not done yet: {task}"


def _left_in(exercise: str, lines: list[str], stub_index: int, first_line: int, owner: str) -> str | None:
    """The message for a stub line left in written code, or None when the region holds nothing but its stub.

    ``lines`` is the source around the stub, ``stub_index`` the index of the stub line in it, ``first_line``
    the line number of ``lines[0]`` in its cell (or file) and ``owner`` the function the stub is in ("<module>"
    for a cell's own code)."""
    begin = end = None
    for index in range(stub_index, -1, -1):
        if lines[index].strip().startswith(begin_line(exercise, "")):
            begin = index
            break
    for index in range(stub_index, len(lines)):
        if lines[index].strip() == end_line(exercise):
            end = index
            break
    if begin is None or end is None:
        return None
    written = [
        line for index, line in enumerate(lines[begin + 1 : end], begin + 1)
        if index != stub_index and line.strip() and not line.strip().startswith("#")
    ]  # fmt: skip
    if not written:
        return None
    place = "the cell" if owner == "<module>" else f"`{owner}`"
    return (
        f"Exercise {exercise}: your code is written, but the stub line is still in {place}: delete line "
        f"{first_line + stub_index} of its cell, `{lines[stub_index].strip()}`, and run that cell again"
    )


def todo(exercise: str, task: str) -> NoReturn:
    """Stand-in for the code of exercise ``exercise`` (e.g. ``"1.2"``): raise with its task, or, when the learner
    has written code around this call, with the line to delete."""
    caller = sys._getframe(1)
    lines = linecache.getlines(caller.f_code.co_filename, caller.f_globals)
    message = _left_in(exercise, lines, caller.f_lineno - 1, 1, caller.f_code.co_name) if lines else None
    raise ExerciseNotDone(message or _not_done(exercise, task))


class UnsolvedKernel:
    """A kernel whose body is still the stub: indexing it with a grid gives a launcher that raises."""

    def __init__(self, kernel: triton.runtime.JITFunction, exercise: str, message: str):
        self.kernel, self.exercise, self.message = kernel, exercise, message

    def __getitem__(self, grid) -> Callable[..., NoReturn]:
        def launch(*args, **kwargs) -> NoReturn:
            raise ExerciseNotDone(self.message)

        return launch

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)


def jit(exercise: str, task: str) -> Callable[[Callable], triton.runtime.JITFunction | UnsolvedKernel]:
    """``triton.jit`` for a kernel that is exercise ``exercise``: unsolved while it holds the stub marker."""

    def decorate(fn: Callable) -> triton.runtime.JITFunction | UnsolvedKernel:
        import triton

        kernel = triton.jit(fn)
        lines, first_line = inspect.getsourcelines(fn)
        markers = [index for index, line in enumerate(lines) if line.strip() == STUB_MARKER]
        if not markers:
            return kernel
        message = _left_in(exercise, lines, markers[0], first_line, fn.__name__) or _not_done(exercise, task)
        return UnsolvedKernel(kernel, exercise, message)

    return decorate
