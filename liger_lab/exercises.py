"""What an unsolved exercise does: say which exercise is still a stub, on the GPU and in the interpreter.

The chapters in ``chapters/`` are generated from the solutions (:mod:`liger_lab.chapters`); each solved
region becomes a stub that names its exercise. Python code gets a call to :func:`todo`, which raises
:class:`ExerciseNotDone`. A Triton kernel cannot raise (the GPU compiler rejects ``raise``), so a stubbed
kernel body becomes ``pass`` under a marker comment and its decorator becomes :func:`jit`: ``triton.jit``
that, while the marker is still in the source, refuses to launch and raises :class:`ExerciseNotDone` on the
host instead of compiling an empty kernel. Delete the marker line, write the body, run the cell again: it
is a plain ``triton.jit`` kernel.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # triton is imported only once liger_lab.runtime has chosen GPU or interpreter
    import triton

STUB_MARKER = "pass  # your code here"
"""The line a stubbed kernel body is left with; while it is in the source the kernel does not launch."""


class ExerciseNotDone(NotImplementedError):
    """An exercise of the workbook is still a stub."""


def todo(exercise: str, task: str) -> NoReturn:
    """Stand-in for the code of exercise ``exercise`` (e.g. ``"1.2"``): raise with its task."""
    raise ExerciseNotDone(f"Exercise {exercise} is not done yet: {task}")


class UnsolvedKernel:
    """A kernel whose body is still the stub: indexing it with a grid gives a launcher that raises."""

    def __init__(self, kernel: triton.runtime.JITFunction, exercise: str, task: str):
        self.kernel, self.exercise, self.task = kernel, exercise, task

    def __getitem__(self, grid) -> Callable[..., NoReturn]:
        def launch(*args, **kwargs) -> NoReturn:
            todo(self.exercise, self.task)

        return launch

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)


def jit(exercise: str, task: str) -> Callable[[Callable], triton.runtime.JITFunction | UnsolvedKernel]:
    """``triton.jit`` for a kernel that is exercise ``exercise``: unsolved while it holds the stub marker."""

    def decorate(fn: Callable) -> triton.runtime.JITFunction | UnsolvedKernel:
        import triton

        kernel = triton.jit(fn)
        if STUB_MARKER in inspect.getsource(fn):
            return UnsolvedKernel(kernel, exercise, task)
        return kernel

    return decorate
