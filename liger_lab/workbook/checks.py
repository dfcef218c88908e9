"""Exercise and test checks: compare a kernel with its float64 reference and print one clear line each.

A line reads ``PASS rms_norm: grad x  rel L2 2.1e-08 (tol 1e-05)  context: max |err| 3.0e-07``: the relative L2
error is what the tolerance applies to; the largest absolute error is printed beside it as context only. A FAIL
line adds by how much the tolerance was exceeded and where the largest error is. The figures vary between
machines; notebooks keep only the PASS/FAIL words, names and tolerances under nbval (the figures are masked by
``tests/nbval_sanitize.cfg``).

Exercise checks run inside :func:`guarded`: there the first failing check raises :class:`CheckFailed`, so Run All
stops at the exercise that needs work, and every kernel launched runs inside guard bands. In Triton's interpreter
each load and store of a kernel is checked against the tensors it was launched with: a lane outside them is
reported (``program 3 wrote 5 elements past the end of `out```) and never reaches memory, so an unmasked store
cannot corrupt the Python process. Inputs copied with :meth:`Guard.band` sit between bands of NaN (or of an
integer sentinel), so on the GPU too a write past a tensor is caught and a read past it poisons the result.

The interpreter runs a launch's programs one after another, where a GPU runs them at the same time. Inside a guard
it runs them in a shuffled order (seeded: the same order on every run), and it looks for what only the order hides:
a program that loads elements and stores them back while another program of the same launch stores them too. On a
GPU the two read the same old value and one sum overwrites the other; the check fails with
``race: program 1 loaded and stored back 8 elements of `dw` that program 0 stored too: lost updates: use
tl.atomic_add``. Atomic operations are never such a race.
"""

from __future__ import annotations

import contextlib
import random
import re
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from liger_lab import runtime
from liger_lab.workbook.exercises import OneLineInJupyter

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
"""Relative L2 error allowed against a float64 reference, by the dtype the kernel computed in."""

_REPORTED_ACCESSES = 2  # out-of-bounds accesses a FAIL line spells out; the first one is what to fix

GUARD_ELEMENTS = 1 << 16
"""Elements of guard band on each side of a tensor copied by :meth:`Guard.band`: more than any block of the
workbook's kernels reaches past the end of a row or an array."""


class CheckFailed(OneLineInJupyter, AssertionError):
    """An exercise check failed; the FAIL line printed just before says which one and by how much."""


def relative_l2_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (the error itself when the reference is zero)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale > 0 else diff


def _compare(
    actual: torch.Tensor, expected: torch.Tensor, tol: float, dtype: torch.dtype | None = None
) -> tuple[bool, str]:
    """Whether ``actual`` is within ``tol`` of ``expected`` (and of ``dtype`` when given), and the figures that say so
    (or say why not)."""
    if actual.shape != expected.shape:
        return False, f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if dtype is not None and actual.dtype != dtype:
        return False, f"dtype {str(actual.dtype).removeprefix('torch.')}, expected {str(dtype).removeprefix('torch.')}"
    finite = bool(torch.isfinite(actual).all())
    rel = relative_l2_error(actual, expected)
    max_abs = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    figures = f"rel L2 {rel:.1e} (tol {tol:.0e})  context: max |err| {max_abs:.1e}"
    if not finite:
        bad = int((~torch.isfinite(actual)).sum())
        return False, f"{figures}  <- {bad} non-finite value(s){_nan_hint()}"
    if rel > tol and _below_the_dtype(actual, expected, max_abs):
        return True, f"{figures}  (the reference is below the smallest normal {actual.dtype} number: zeros there)"
    if rel > tol:
        worst = tuple(
            int(i) for i in torch.unravel_index((actual.double() - expected.double()).abs().argmax(), actual.shape)
        )
        times = f"{rel / tol:.1e} x the tolerance" if tol > 0 else "above a zero tolerance"
        return False, f"{figures}  <- rel L2 is {times}; worst element at {worst}"
    return True, figures


def _below_the_dtype(actual: torch.Tensor, expected: torch.Tensor, max_abs: float) -> bool:
    """Whether the whole reference lies below the smallest normal number of ``actual``'s dtype and the error does
    too: gradients of 1e-86 beside a one-hot softmax are zeros in float32, and a relative error against them says
    nothing about the kernel."""
    if not actual.is_floating_point() or actual.numel() == 0:
        return False
    tiny = torch.finfo(actual.dtype).tiny
    return expected.double().abs().max().item() < tiny and max_abs <= tiny


def check_close(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: float | None = None,
    *,
    errors: list[float] | None = None,
    dtype: torch.dtype | None = None,
) -> bool:
    """Print a PASS/FAIL line comparing ``actual`` with ``expected``; return whether it passed.

    The test is the relative L2 error against ``tol`` (by default from :data:`TOLERANCE` for the dtype of
    ``actual``), and every value must be finite. A FAIL line says which of the two failed and by how much,
    and where the largest error is. With ``dtype``, ``actual`` must also be of that dtype (an output a kernel
    should return in its input's dtype, or in fp32 whatever the input). ``errors``, when given, receives the
    relative error measured. Inside :func:`guarded`, a kernel's access outside its tensors fails the check first,
    and a failed check raises :class:`CheckFailed`."""
    if _ACTIVE is not None:
        _ACTIVE.fail_on_accesses(name)
    tol = TOLERANCE.get(actual.dtype, 1e-5) if tol is None else tol
    ok, figures = _compare(actual, expected, tol, dtype)
    if errors is not None and actual.shape == expected.shape:
        errors.append(relative_l2_error(actual, expected))
    print(f"{'PASS' if ok else 'FAIL'} {name}  {figures}")
    if not ok and _ACTIVE is not None:
        _ACTIVE.stop(name)
    return ok


def show_bug(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float | None = None) -> bool:
    """For a deliberately buggy kernel: print ``BUG SHOWN`` when the check catches it, with the figures.

    Returns whether the bug is visible. A bug that this input does not reveal prints ``BUG HIDDEN``: the
    input is not adversarial enough. It never stops a notebook, inside :func:`guarded` or not."""
    tol = TOLERANCE.get(actual.dtype, 1e-5) if tol is None else tol
    ok, figures = _compare(actual, expected, tol)
    print(f"{'BUG HIDDEN' if ok else 'BUG SHOWN'} {name}  {figures}")
    return not ok


def _upstream_gradient_like(output: torch.Tensor) -> torch.Tensor:
    """A random upstream gradient of ordinary size: magnitudes in [1.25, 2] with random signs.

    Never 1 (not even after rounding to bfloat16), so a backward that ignores its upstream gradient fails. Not a
    normal draw either: its rare tiny values (|g| < 0.03 one time in forty) push a half-precision gradient
    below its dtype's normal numbers, and the check would then measure underflow instead of the kernel."""
    magnitude = torch.empty_like(output).uniform_(1.25, 2.0)
    sign = torch.randint_like(output, 2) * 2 - 1
    return magnitude * sign


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def check_against_reference(
    name: str,
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    reference: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    inputs: Sequence[object],
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    output_dtypes: Sequence[torch.dtype] | None = None,
    tol: float | None = None,
    errors: list[float] | None = None,
) -> bool:
    """Check ``fn(*inputs)`` and the gradient of every floating input against ``reference`` in float64.

    Floating tensors in ``inputs`` are copied with their strides (kernels may reuse their buffers) and given
    ``requires_grad``; inside :func:`guarded` the copies sit in guard bands. The reference gets float64 copies.
    Each output receives the same random upstream gradient in both runs (see :func:`_upstream_gradient_like`).
    Prints one line per output (named by ``output_names``, else ``output`` or ``output 0``, ``output 1``...) and
    per gradient; returns True when all pass. ``output_dtypes`` are the dtypes the outputs must have (a float32
    log-prob of fp16 logits, say): an output of another dtype fails, and each is held to its dtype's tolerance,
    since the reference computes from the same input values. ``errors``, when given, receives every relative error
    measured.
    """
    names = list(input_names) if input_names is not None else [f"input {i}" for i in range(len(inputs))]

    def prepare(dtype: torch.dtype | None) -> list[object]:
        prepared = []
        for input_name, value in zip(names, inputs, strict=True):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                if dtype is None and _ACTIVE is not None:
                    value = _ACTIVE.band(value, input_name).requires_grad_()
                else:  # keep the caller's strides: a strided view must reach the kernel as a strided view
                    dtype_here = dtype or value.dtype
                    copy = torch.empty_strided(value.shape, value.stride(), dtype=dtype_here, device=value.device)
                    value = copy.copy_(value.detach()).requires_grad_()
            prepared.append(value)
        return prepared

    ours, theirs = prepare(None), prepare(torch.float64)
    outputs, expected = _as_tuple(fn(*ours)), _as_tuple(reference(*theirs))
    upstream = [_upstream_gradient_like(out) for out in outputs]
    ok = True
    # An output is as exact as the least precise of the inputs it was computed from (an fp32 loss of
    # fp16 logits carries the fp16 rounding of those logits).
    input_dtypes = [v.dtype for v in ours if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if output_names is not None and len(output_names) != len(outputs):
        raise ValueError(f"{len(output_names)} output names for {len(outputs)} outputs")
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        label = "output" if len(outputs) == 1 else f"output {i}"
        label = output_names[i] if output_names is not None else label
        dtype = output_dtypes[i] if output_dtypes is not None else None
        out_tol = tol
        if tol is None and dtype is not None:
            out_tol = TOLERANCE.get(dtype, 1e-5)
        elif tol is None:
            out_tol = max(TOLERANCE.get(dtype, 1e-5) for dtype in [out.dtype, *input_dtypes])
        ok &= check_close(f"{name}: {label}", out.detach(), ref.detach(), out_tol, errors=errors, dtype=dtype)
    differentiable = [
        (n, a, b)
        for n, a, b in zip(names, ours, theirs, strict=True)
        if isinstance(a, torch.Tensor) and a.requires_grad
    ]
    if differentiable:
        grads = torch.autograd.grad(outputs, [a for _, a, _ in differentiable], upstream, allow_unused=True)
        ref_grads = torch.autograd.grad(
            expected, [b for _, _, b in differentiable], [u.double() for u in upstream], allow_unused=True
        )
        for (input_name, a, _), grad, ref_grad in zip(differentiable, grads, ref_grads, strict=True):
            if ref_grad is None:
                continue
            if grad is None:
                print(f"FAIL {name}: grad {input_name} is missing")
                if _ACTIVE is not None:
                    _ACTIVE.stop(f"{name}: grad {input_name}")
                ok = False
                continue
            grad_tol = tol if tol is not None else TOLERANCE.get(a.dtype, 1e-5)
            ok &= check_close(f"{name}: grad {input_name}", grad, ref_grad, grad_tol, errors=errors)
    return bool(ok)


# --------------------------------------------------------------------------------------------------
# Guarded exercise checks: guard bands, and in the interpreter every load and store checked.

_ACTIVE: Guard | None = None


def _nan_hint() -> str:
    """Where NaN may come from inside a guard that relies on its bands alone (no interpreter watching accesses)."""
    if _ACTIVE is None or _ACTIVE.watch is not None or not _ACTIVE.bands:
        return ""
    return " (a load past the end of a tensor reads its guard band, which holds NaN)"


def _span(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first element to one past its last, through its strides."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))


def _element_offsets(tensor: torch.Tensor) -> torch.Tensor:
    """The offset of every element of ``tensor`` from its first, through its strides."""
    index = torch.arange(max(_span(tensor), 1), dtype=torch.int64)
    return index.as_strided(tensor.shape, tensor.stride(), 0).reshape(-1)


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width, so that NaN compares equal to itself."""
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.is_floating_point():
        return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
    return tensor


def _fill_sentinel(buffer: torch.Tensor) -> None:
    """NaN for floats (a read of it poisons whatever it reaches), the most negative value for integers."""
    if buffer.is_floating_point():
        buffer.fill_(float("nan"))
    elif buffer.dtype == torch.bool:
        buffer.fill_(False)
    else:
        buffer.fill_(torch.iinfo(buffer.dtype).min)


def _where(before: bool, after: bool) -> str:
    return "before the start of" if before else "past the end of" if after else "between the elements of"


@dataclass
class _Band:
    """A tensor copied into the middle of a bigger buffer whose other elements hold a sentinel."""

    name: str
    buffer: torch.Tensor
    view: torch.Tensor
    outside: torch.Tensor  # positions of ``buffer`` that are not elements of ``view``
    sentinel_bits: torch.Tensor

    def writes(self) -> list[str]:
        """What was written outside the view since it was made, as ``wrote N elements past the end of `x```."""
        changed = (_as_bits(self.buffer) != self.sentinel_bits) & self.outside
        if not bool(changed.any()):
            return []
        positions = changed.nonzero().reshape(-1) - GUARD_ELEMENTS
        span = _span(self.view)
        found = []
        for before, after in ((True, False), (False, True), (False, False)):
            inside = (
                (positions < 0) if before else (positions >= span) if after else (positions >= 0) & (positions < span)
            )
            count = int(inside.sum())
            if count:
                found.append(f"wrote {count} element{'s' if count > 1 else ''} {_where(before, after)} `{self.name}`")
        return found


@dataclass
class _Extent:
    """The memory of one tensor a kernel was launched with, to tell the lanes of a load or store inside it."""

    name: str
    start: int
    element_size: int
    span: int
    valid: np.ndarray | None  # which offsets of the span are elements; None when they all are

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> _Extent:
        span = _span(tensor)
        valid = None
        if span != tensor.numel():  # strided: the span has holes, or elements repeat (stride 0)
            valid = np.zeros(span, dtype=bool)
            valid[_element_offsets(tensor).numpy()] = True
        return cls(name, tensor.data_ptr(), tensor.element_size(), span, valid)

    def offsets(self, addresses: np.ndarray) -> np.ndarray:
        return (addresses.astype(np.int64) - self.start) // self.element_size

    def contains(self, addresses: np.ndarray) -> np.ndarray:
        offsets = self.offsets(addresses)
        inside = (offsets >= 0) & (offsets < self.span)
        if self.valid is not None:
            inside[inside] = self.valid[offsets[inside]]
        return inside

    def distance(self, address: int) -> int:
        """Elements between ``address`` and this tensor's span (0 inside it)."""
        offset = int(self.offsets(np.array([address], dtype=np.uint64))[0])
        return max(-offset, offset - self.span + 1, 0)


@dataclass
class _Access:
    """Lanes of one kind of access by one program, outside one tensor (or outside all of them: ``name`` None)."""

    kind: str
    program: tuple[int, int, int]
    grid: tuple[int, int, int]
    name: str | None
    where: str
    addresses: set[int] = field(default_factory=set)

    def describe(self) -> str:
        dims = max((axis + 1 for axis, size in enumerate(self.grid) if size > 1), default=1)  # of the launch
        program = self.program[0] if dims == 1 else self.program[:dims]
        count = len(self.addresses)
        target = (
            f"{self.where} `{self.name}`"
            if self.name
            else "far outside every tensor of the launch (as a 32-bit offset past 2**31 does: it wraps around)"
        )
        return f"program {program} {self.kind} {count} element{'s' if count > 1 else ''} {target}"


class _InterpreterWatch:
    """Checks every load, store and atomic of the kernels the interpreter runs against the launch's tensors.

    Triton's interpreter hands each memory access to its builder as a block of raw addresses and a mask; the watch
    wraps those builder methods for as long as the guard is active. A live lane outside the tensors is recorded
    and masked off, so it neither reads nor writes: an unmasked store lands nowhere instead of in memory that
    belongs to someone else. The tensor a block belongs to is the one holding its first live lane (for a
    ``base + offsets`` block, ``base``'s tensor); lanes outside that tensor are out of bounds even where they
    happen to hit another one.
    """

    _BUILDER_METHODS = (
        "create_masked_load", "create_masked_store", "create_atomic_rmw", "create_get_program_id", "create_addptr",
        "set_grid_idx",
    )  # fmt: skip

    def __init__(self, guard: Guard):
        from triton.runtime import interpreter

        self.guard, self.interpreter = guard, interpreter
        self.extents: list[_Extent] = []
        self.found: dict[tuple, _Access] = {}
        self.tail: tuple[int, int] | None = None  # (elements before, first program) inside Guard.tail
        self.saved: dict[tuple[type, str], Callable] = {}
        self.order: list[tuple[int, int, int]] | None = []  # the launch's programs in the order they run
        self.grid: tuple[int, int, int] = (1, 1, 1)
        self.launches = 0
        self.loads: list[tuple[tuple[int, int, int], np.ndarray]] = []  # (program, addresses) of the launch's loads
        self.stores: list[tuple[tuple[int, int, int], np.ndarray]] = []
        self.races: list[str] = []

    def __enter__(self) -> _InterpreterWatch:
        builder, executor = self.interpreter.InterpreterBuilder, self.interpreter.GridExecutor
        watch = self
        originals = {name: getattr(builder, name) for name in self._BUILDER_METHODS}
        original_call = executor.__call__
        self.saved = {(builder, name): method for name, method in originals.items()}
        self.saved[(executor, "__call__")] = original_call

        def load(self, ptrs, mask, other, cache_policy, is_volatile):
            mask = watch.allowed(self, "read", ptrs, mask)
            watch.note(watch.loads, self, ptrs, mask)
            return originals["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

        def store(self, ptrs, value, mask, cache_policy):
            mask = watch.allowed(self, "wrote", ptrs, mask)
            watch.note(watch.stores, self, ptrs, mask)
            return originals["create_masked_store"](self, ptrs, value, mask, cache_policy)

        def grid_idx(self, x, y, z):  # the launch's loop asks for programs in order; run them in watch.order
            if watch.order is None and watch.extents:
                watch.grid = grid = tuple(int(size) for size in self.grid_dim)
                watch.order = [(i, j, k) for i in range(grid[0]) for j in range(grid[1]) for k in range(grid[2])]
                random.Random(watch.launches).shuffle(watch.order)
            if watch.order:
                x, y, z = watch.order[(x * watch.grid[1] + y) * watch.grid[2] + z]
            return originals["set_grid_idx"](self, x, y, z)

        def atomic(self, op, ptr, val, mask, sem, scope):
            return originals["create_atomic_rmw"](
                self, op, ptr, val, watch.allowed(self, "updated", ptr, mask), sem, scope
            )

        def program_id(self, axis):
            pid = originals["create_get_program_id"](self, axis)
            if watch.tail is not None and axis == 0:
                pid = watch.interpreter.TensorHandle(pid.data + watch.tail[1], pid.dtype)
            return pid

        def addptr(self, ptr, offset):
            if watch.tail is not None:  # an offset into the tail is an offset into the tensor, elements_before less
                before = watch.tail[0]
                wide = offset.data.astype(np.int64)
                wide = np.where(wide >= before, wide - before, wide)
                offset = watch.interpreter.TensorHandle(wide.astype(offset.data.dtype), offset.dtype)
            return originals["create_addptr"](self, ptr, offset)

        def call(executor_self, *args, **kwargs):
            # Arguments left to their defaults are not passed: fewer values than names.
            named = [*zip(executor_self.arg_names, args, strict=False), *kwargs.items()]
            watch.extents = [watch.extent(name, value) for name, value in named if isinstance(value, torch.Tensor)]
            watch.loads, watch.stores = [], []
            watch.launches += 1
            watch.order = None  # made by the launch's first program, once the grid is known
            try:
                result = original_call(executor_self, *args, **kwargs)
                watch.find_lost_updates()
                return result
            finally:
                watch.extents, watch.order, watch.loads, watch.stores = [], [], [], []

        for name, method in (
            ("create_masked_load", load), ("create_masked_store", store), ("create_atomic_rmw", atomic),
            ("create_get_program_id", program_id), ("create_addptr", addptr), ("set_grid_idx", grid_idx),
        ):  # fmt: skip
            setattr(builder, name, method)
        executor.__call__ = call
        return self

    def __exit__(self, *exc_info: object) -> None:
        for (owner, name), method in self.saved.items():
            setattr(owner, name, method)

    def note(self, accesses: list, builder, ptrs, mask) -> None:
        """Keep the addresses of the live lanes of one load or store, with the program that made it."""
        if not self.extents:
            return
        live = np.broadcast_to(mask.data, ptrs.data.shape).reshape(-1).astype(bool)
        if live.any():
            program = tuple(int(i) for i in builder.grid_idx)
            accesses.append((program, np.ascontiguousarray(ptrs.data).reshape(-1)[live].astype(np.int64)))

    def find_lost_updates(self) -> None:
        """After a launch: record a program that loaded elements and stored them back while another program of the
        launch stored them too (on a GPU both read the old value: one update is lost)."""
        if len({program for program, _ in self.stores}) < 2:
            return
        programs = sorted({program for program, _ in self.stores} | {program for program, _ in self.loads})
        number = {program: index for index, program in enumerate(programs)}
        pairs = np.unique(
            np.stack([
                np.concatenate([addresses for _, addresses in self.stores]),
                np.concatenate([np.full(len(addresses), number[p]) for p, addresses in self.stores]),
            ]),
            axis=1,
        )  # fmt: skip
        addresses, writers = np.unique(pairs[0], return_counts=True)
        shared = addresses[writers > 1]  # stored by two programs or more
        if not len(shared):
            return
        for program, loaded in sorted(self.loads, key=lambda load: load[0]):  # the first program that lost one
            suspects = np.intersect1d(np.intersect1d(loaded, shared), pairs[0][pairs[1] == number[program]])
            if not len(suspects):
                continue
            others = pairs[1][np.isin(pairs[0], suspects) & (pairs[1] != number[program])]
            other = programs[int(others.min())]
            extent = next((e for e in self.extents if e.contains(suspects[:1].astype(np.uint64))[0]), None)
            name = extent.name if extent is not None else "a tensor of the launch"
            dims = max((axis + 1 for axis, size in enumerate(self.grid) if size > 1), default=1)
            shown = [p[0] if dims == 1 else p[:dims] for p in (program, other)]
            count = len(suspects)
            self.races.append(
                f"program {shown[0]} loaded and stored back {count} element{'s' if count > 1 else ''} of `{name}` "
                f"that program {shown[1]} stored too: lost updates: use tl.atomic_add"
            )
            return

    def extent(self, argument: str, tensor: torch.Tensor) -> _Extent:
        """The extent of a launch argument, named after the band it lives in, else after the argument."""
        storage = tensor.untyped_storage().data_ptr()
        name = next((b.name for b in self.guard.bands if b.buffer.untyped_storage().data_ptr() == storage), None)
        return _Extent.of(name or argument.removesuffix("_ptr"), tensor)

    def allowed(self, builder, kind: str, ptrs, mask):
        """``mask`` with the live lanes outside the launch's tensors switched off, and those lanes recorded."""
        if not self.extents:
            return mask
        addresses = np.ascontiguousarray(ptrs.data).reshape(-1)
        live = np.broadcast_to(mask.data, ptrs.data.shape).reshape(-1).astype(bool)
        if not live.any():
            return mask
        lanes = addresses[live]
        outside = self.outside(kind, builder, lanes)
        if outside is None:
            return mask
        keep = live.copy()
        keep[np.flatnonzero(live)[outside]] = False
        return self.interpreter.TensorHandle(keep.reshape(ptrs.data.shape), mask.dtype)

    def outside(self, kind: str, builder, lanes: np.ndarray) -> np.ndarray | None:
        """Which of ``lanes`` (live addresses of one access) are out of bounds, recorded; None when none are."""
        first = lanes[:1]
        holders = [extent for extent in self.extents if extent.contains(first)[0]]
        best, best_inside = None, None
        for extent in holders:
            inside = extent.contains(lanes)
            if inside.all():
                return None
            if best_inside is None or inside.sum() > best_inside.sum():
                best, best_inside = extent, inside
        if best is None:  # the first lane is in no tensor: judge the block against the nearest one, if near
            nearest = min(self.extents, key=lambda extent: extent.distance(int(first[0])))
            if nearest.distance(int(first[0])) <= max(nearest.span, GUARD_ELEMENTS):
                best, best_inside = nearest, nearest.contains(lanes)
            else:
                best_inside = np.zeros(len(lanes), dtype=bool)
        grid = tuple(builder.grid_dim)
        program = tuple(int(i) for i in builder.grid_idx)
        if self.tail is not None:
            program = (program[0] + self.tail[1], *program[1:])
        bad = lanes[~best_inside]
        if best is None:
            self.record(kind, program, grid, None, "", bad)
        else:
            offsets = best.offsets(bad)
            before, after = offsets < 0, offsets >= best.span
            for where, chosen in (
                (_where(True, False), before), (_where(False, True), after), (_where(False, False), ~before & ~after),
            ):  # fmt: skip
                if chosen.any():
                    self.record(kind, program, grid, best.name, where, bad[chosen])
        return ~best_inside

    def record(self, kind, program, grid, name, where, addresses: np.ndarray) -> None:
        key = (kind, program, name, where)
        access = self.found.setdefault(key, _Access(kind, program, grid, name, where))
        access.addresses.update(addresses.tolist())

    def report(self) -> list[str]:
        """The out-of-bounds accesses seen since the last report (the first few, by program: programs run in a
        shuffled order), and forget them."""
        found = [access.describe() for access in sorted(self.found.values(), key=lambda access: access.program)]
        self.found = {}
        if len(found) > _REPORTED_ACCESSES:
            found = [*found[:_REPORTED_ACCESSES], f"and {len(found) - _REPORTED_ACCESSES} more"]
        return found

    def report_races(self) -> list[str]:
        """The lost updates seen since the last report (the first launch's), and forget them."""
        races, self.races = self.races[:1], []
        return races


class Guard:
    """The checks of one exercise (see :func:`guarded`): :meth:`band` copies a check's tensors into guard bands,
    :meth:`tail` runs launches as the last programs of one past 2**31 elements, :meth:`require` stops on a check
    that prints its own line."""

    def __init__(self, name: str, bug: bool):
        self.name, self.bug = name, bug
        self.bands: list[_Band] = []
        # Only the interpreter lets a check see each access; on a GPU the guard bands alone report.
        self.watch = _InterpreterWatch(self) if runtime.INTERPRET else None
        self.shown: list[str] = []

    def band(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """A copy of ``tensor`` (same shape, strides, dtype, device and values) between guard bands of
        :data:`GUARD_ELEMENTS`; the skipped elements of a strided view hold the sentinel too. ``name`` is what
        the messages call it. The copy requires grad when ``tensor`` does."""
        span = _span(tensor)
        buffer = torch.empty(span + 2 * GUARD_ELEMENTS, dtype=tensor.dtype, device=tensor.device)
        _fill_sentinel(buffer)
        view = buffer.as_strided(tensor.shape, tensor.stride(), GUARD_ELEMENTS)
        with torch.no_grad():
            view.copy_(tensor)
        outside = torch.ones(buffer.numel(), dtype=torch.bool, device=buffer.device)
        outside[(_element_offsets(tensor) + GUARD_ELEMENTS).to(buffer.device)] = False
        self.bands.append(_Band(name, buffer, view, outside, _as_bits(buffer).clone()))
        return view.requires_grad_(tensor.requires_grad)

    @contextlib.contextmanager
    def tail(self, elements_before: int, block: int) -> Iterator[None]:
        """Launches inside run as the last programs of a launch over ``elements_before`` more elements.

        For a kernel whose program ``p`` handles elements ``p * block`` to ``(p + 1) * block``: ``tl.program_id(0)``
        returns ``elements_before // block + p``, and a pointer offset of ``elements_before`` or more is taken as an
        offset into the tensor ``elements_before`` lower. The kernel then computes the offsets of elements past
        ``elements_before`` (past 2**31, where 32-bit offsets wrap around) while it touches only the small tensors
        it was given; pass it the total size (``elements_before + n``) where it expects its ``n``. Only in
        Triton's interpreter, which runs every access through the watch."""
        if self.watch is None:
            raise ValueError("Guard.tail needs Triton's interpreter: on a GPU, check with a tensor that big")
        if elements_before % block:
            raise ValueError(f"elements_before = {elements_before} must be a multiple of the block, {block}")
        self.watch.tail = (elements_before, elements_before // block)
        try:
            yield
        finally:
            self.watch.tail = None

    def violations(self) -> list[str]:
        """Every access outside the tensors seen since the last call: from the interpreter's watch, and what the
        guard bands show was written (the only source on a GPU)."""
        found = self.watch.report() if self.watch is not None else []
        for band in self.bands:
            writes = band.writes()
            if writes:  # refill the band; only then, as a write would bump the version autograd checks
                _as_bits(band.buffer).masked_scatter_(band.outside, band.sentinel_bits[band.outside])
            found += writes
        return found

    def fail_on_accesses(self, name: str) -> None:
        """Before check ``name``: fail it when a kernel accessed memory outside its tensors, or when two of its
        programs raced to update the same elements."""
        found = self.violations()
        races = self.watch.report_races() if self.watch is not None else []
        parts = ([f"out of bounds: {'; '.join(found)}"] if found else []) + [f"race: {race}" for race in races]
        if parts:
            print(f"{'BUG SHOWN' if self.bug else 'FAIL'} {name}  {'; '.join(parts)}")
            self.shown += found + races
            self.stop(name)

    def require(self, ok: bool, name: str) -> bool:
        """For a check that prints its own PASS/FAIL line: stop, as a failed :func:`check_close` does, when not
        ``ok``. Returns ``ok``."""
        if not ok:
            self.stop(name)
        return ok

    def stop(self, name: str) -> None:
        if not self.bug:
            raise CheckFailed(
                f"{self.name}: `{name}` failed (see the line above); fix the code and run this cell again"
            )


_OUT_OF_BOUNDS_INDEX = re.compile(r"index (-?\d+) is out of bounds")


def _index_error(name: str, error: BaseException) -> str | None:
    """One line for an index out of range in the learner's code (``torch.gather`` at a target of -100, say): where it
    happened and what to do, instead of a traceback through PyTorch; None for any other error."""
    found = _OUT_OF_BOUNDS_INDEX.search(str(error))
    if found is None:
        return None
    library = (str(Path(torch.__file__).parent), str(Path(__file__).parent.parent))
    steps = list(traceback.walk_tb(error.__traceback__))  # (frame, the line it was at), outermost first
    theirs = [(frame, line) for frame, line in steps if not frame.f_code.co_filename.startswith(library)]
    where = ""
    if theirs:
        frame, line = theirs[-1]
        owner = "the cell" if frame.f_code.co_name == "<module>" else f"`{frame.f_code.co_name}`"
        where = f" at line {line} of {owner}"
    hint = ""
    if int(found.group(1)) < 0:
        hint = (
            f": {found.group(1)} is the target of an ignored position (ignore_index): index with a valid target in its"
            " place, e.g. torch.where(target == ignore_index, 0, target), and zero the result there"
        )
    first_line = str(error).strip().splitlines()[0]
    return f"{name}: {type(error).__name__}{where}: {first_line}{hint}"


@contextlib.contextmanager
def guarded(name: str, *, bug: bool = False) -> Iterator[Guard]:
    """Run one exercise's checks: the first that fails raises :class:`CheckFailed`, and every kernel launched stays
    inside the tensors it was given (see the module's docstring).

    ``name`` (``"exercise 0.1"``) is what a failure names. With ``bug=True`` the guard shows a deliberate bug
    instead, as :func:`show_bug` does: nothing raises, and on leaving it prints ``BUG SHOWN`` with the accesses
    outside the tensors, or ``BUG HIDDEN`` when there were none."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise ValueError(f"guarded({name!r}) inside guarded({_ACTIVE.name!r}): one guard at a time")
    guard = Guard(name, bug)
    # The interpreter computes every lane of a block in NumPy, the masked ones too, whose results no store keeps:
    # their overflows (exp of a padding value) would print NumPy warnings that a GPU, computing the same lanes, never
    # shows. A wrong value still fails the check.
    quiet_lanes = np.errstate(over="ignore", invalid="ignore", divide="ignore")
    with guard.watch if guard.watch is not None else contextlib.nullcontext(), quiet_lanes:
        _ACTIVE = guard
        try:
            try:
                yield guard
            except (IndexError, RuntimeError) as error:
                message = _index_error(name, error)
                if message is None:
                    raise
                raise CheckFailed(message) from None
            guard.fail_on_accesses(name)
            if bug and not guard.shown:
                print(f"BUG HIDDEN {name}  every access stayed inside the tensors")
        finally:
            _ACTIVE = None
