"""``liger-lab check`` and the doctor's kernel check: every op of :data:`liger_lab.op_table.OPS` against its float64
reference, on fresh inputs from the table, one :class:`CheckResult` per op and dtype.

The command line (:mod:`liger_lab.cli`) and the doctor (:mod:`liger_lab.doctor`) both run these cases; neither
imports the other for them.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from liger_lab import runtime
from liger_lab.e2e.presets import DTYPES
from liger_lab.op_table import OPS as TABLE
from liger_lab.workbook import checks

DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass
class CheckCase:
    """One op checked in one dtype: fresh inputs, our function and its float64 reference."""

    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fn: Callable[..., object]
    reference: Callable[..., object]
    inputs: list[object]
    input_names: list[str]
    tol: float | None = None
    """The op's own tolerance in this dtype, None for :data:`liger_lab.workbook.checks.TOLERANCE`'s."""


@dataclass
class CheckResult:
    op: str
    dtype: str
    shape: str
    worst_rel_error: float | None
    status: str  # PASS or FAIL
    detail: str = ""


CHECK_OPS = tuple(TABLE)


def case_for(op: str, dtype: torch.dtype) -> CheckCase:
    """Fresh inputs for ``op`` from the table: small shapes for the interpreter, larger ones on the GPU.
    Inputs that are constants of the call (targets, RoPE's cos and sin) are bound, not differentiated;
    every 7th target is ignored, as padding gives in real batches."""
    spec = TABLE[op]
    shape = spec.check_shape()
    inputs = [v.detach() if isinstance(v, torch.Tensor) else v for v in spec.make_inputs(shape, dtype)]
    named = dict(zip(spec.input_names, inputs, strict=True))
    if "target" in named:
        named["target"][::7] = -100
    varying = list(spec.differentiable)

    def bind(fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object) -> object:
            given = {**named, **dict(zip(varying, args, strict=True))}
            return fn(*(given[name] for name in spec.input_names))

        return call

    checked, tol = [named[n] for n in varying], spec.check_tolerances.get(dtype)
    return CheckCase(op, dtype, shape, bind(spec.function), bind(spec.reference), checked, varying, tol)


def check_dtypes() -> tuple[torch.dtype, ...]:
    """fp32 and fp16 in the interpreter, fp32 and bf16 on the GPU (bf16 on CPU: the tests' bf16 cases)."""
    return runtime.pick(cpu=(torch.float32, torch.float16), gpu=(torch.float32, torch.bfloat16))


def run_case(case: CheckCase) -> CheckResult:
    """Run one check; its printed lines (see :mod:`liger_lab.workbook.checks`) become the result's detail."""
    printed, errors = io.StringIO(), []
    try:
        with contextlib.redirect_stdout(printed):
            ok = checks.check_against_reference(
                case.op,
                case.fn,
                case.reference,
                case.inputs,
                input_names=case.input_names,
                tol=case.tol,
                errors=errors,
            )
    except Exception as error:  # a kernel that raises is a failed check, not a crashed command
        return CheckResult(
            case.op, DTYPE_NAMES[case.dtype], str(case.shape), None, "FAIL", f"{type(error).__name__}: {error}"
        )
    worst = max(errors) if errors else None
    status = "PASS" if ok else "FAIL"
    return CheckResult(case.op, DTYPE_NAMES[case.dtype], str(case.shape), worst, status, printed.getvalue().strip())


def run_checks(ops: Sequence[str] = CHECK_OPS, dtypes: Sequence[torch.dtype] | None = None) -> list[CheckResult]:
    """Check every op in every dtype against its float64 reference."""
    dtypes = check_dtypes() if dtypes is None else dtypes
    todo = [(op, dtype) for op in ops for dtype in dtypes]
    results = []
    for op, dtype in tqdm(todo, desc="checking", unit="check", disable=None, leave=False):
        results.append(run_case(case_for(op, dtype)))
    return results


def format_checks(results: Sequence[CheckResult]) -> str:
    lines = [f"{'op':<28}{'dtype':<7}{'shape':<24}{'worst rel err':>14}  result"]
    for r in results:
        err = "" if r.worst_rel_error is None else f"{r.worst_rel_error:.1e}"
        lines.append(f"{r.op:<28}{r.dtype:<7}{r.shape:<24}{err:>14}  {r.status}")
    return "\n".join(lines)
