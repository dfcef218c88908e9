"""Exercise and test checks: compare a kernel with its float64 reference and print one clear line each.

A line reads ``PASS rms_norm: grad x  rel L2 2.1e-08  max |err| 3.0e-07  (tol 1e-05)``; a FAIL line adds
which test failed, by how much and where. The error figures
vary between machines; notebooks keep only the PASS/FAIL words and names under nbval (the figures are
masked by ``tests/nbval_sanitize.cfg``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
"""Relative L2 error allowed against a float64 reference, by the dtype the kernel computed in."""


def relative_l2_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64 (the error itself when the reference is zero)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale > 0 else diff


def _compare(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> tuple[bool, str]:
    """Whether ``actual`` is within ``tol`` of ``expected``, and the figures that say so (or say why not)."""
    if actual.shape != expected.shape:
        return False, f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    finite = bool(torch.isfinite(actual).all())
    rel = relative_l2_error(actual, expected)
    max_abs = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    figures = f"rel L2 {rel:.1e}  max |err| {max_abs:.1e}  (tol {tol:.0e})"
    if not finite:
        bad = int((~torch.isfinite(actual)).sum())
        return False, f"{figures}  <- {bad} non-finite value(s)"
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
) -> bool:
    """Print a PASS/FAIL line comparing ``actual`` with ``expected``; return whether it passed.

    The test is the relative L2 error against ``tol`` (by default from :data:`TOLERANCE` for the dtype of
    ``actual``), and every value must be finite. A FAIL line says which of the two failed and by how much,
    and where the largest error is. ``errors``, when given, receives the relative error measured."""
    tol = TOLERANCE.get(actual.dtype, 1e-5) if tol is None else tol
    ok, figures = _compare(actual, expected, tol)
    if errors is not None and actual.shape == expected.shape:
        errors.append(relative_l2_error(actual, expected))
    print(f"{'PASS' if ok else 'FAIL'} {name}  {figures}")
    return ok


def show_bug(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float | None = None) -> bool:
    """For a deliberately buggy kernel: print ``BUG SHOWN`` when the check catches it, with the figures.

    Returns whether the bug is visible. A bug that this input does not reveal prints ``BUG HIDDEN``: the
    input is not adversarial enough."""
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
    tol: float | None = None,
    errors: list[float] | None = None,
) -> bool:
    """Check ``fn(*inputs)`` and the gradient of every floating input against ``reference`` in float64.

    Floating tensors in ``inputs`` are copied with their strides (kernels may reuse their buffers) and given
    ``requires_grad``; the reference gets float64 copies. Each output receives the same random upstream
    gradient in both runs (see :func:`_upstream_gradient_like`). Prints one line per output and per
    gradient; returns True when all pass.
    ``errors``, when given, receives every relative error measured.
    """
    names = list(input_names) if input_names is not None else [f"input {i}" for i in range(len(inputs))]

    def prepare(dtype: torch.dtype | None) -> list[object]:
        prepared = []
        for value in inputs:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                # Keep the caller's strides: a strided view must reach the kernel as a strided view.
                copy = torch.empty_strided(value.shape, value.stride(), dtype=dtype or value.dtype, device=value.device)
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
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        label = "output" if len(outputs) == 1 else f"output {i}"
        out_tol = tol
        if tol is None:
            out_tol = max(TOLERANCE.get(dtype, 1e-5) for dtype in [out.dtype, *input_dtypes])
        ok &= check_close(f"{name}: {label}", out.detach(), ref.detach(), out_tol, errors=errors)
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
                ok = False
                continue
            grad_tol = tol if tol is not None else TOLERANCE.get(a.dtype, 1e-5)
            ok &= check_close(f"{name}: grad {input_name}", grad, ref_grad, grad_tol, errors=errors)
    return bool(ok)
