"""Shared test inputs and recorders: fresh random tensors where the kernels run, odd layouts on request, the check of
an op against its float64 reference as the op table names it, and one recorder of what ran (operators, host reads,
kernel launches)."""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

import liger_lab
from liger_lab import reference, runtime
from liger_lab.op_table import OPS
from liger_lab.runtime import device
from liger_lab.workbook.checks import check_against_reference


def randn(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device=runtime.DEVICE)).to(dtype)


def non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Same values, but every other column of a twice-as-wide buffer (stride(-1) == 2)."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return wide[..., ::2]


def row_strided(x: torch.Tensor) -> torch.Tensor:
    """Same values, rows padded (unit stride along the row, row stride larger than the row)."""
    wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 7, dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


KERNEL_ONLY = frozenset({"chunk_tokens", "chunk_pairs", "chunk_completions", "accumulation", "in_place_backward"})
"""Options of liger_lab's functions that choose how, not what, they compute: the references take none of them."""


def check_op(
    name: str,
    *inputs: object,
    tol: float | None = None,
    prepare: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    errors: list[float] | None = None,
    **options: object,
) -> bool:
    """``liger_lab.<name>(*inputs, **options)`` and the gradient of each of its differentiable inputs against
    ``liger_lab.reference.<name>`` in float64 (:func:`liger_lab.workbook.checks.check_against_reference`), the inputs in
    the order and under the names of the op's table row (``liger_lab.op_table.OPS``). The inputs the row does not list
    as differentiable (targets, a teacher's logits, RoPE tables) are constants of the call, given to the reference in
    float64 as they are; inputs after the row's (a bias) are checked too, named as the reference names them.
    ``prepare`` turns each checked input into what both calls receive (a layout, a non-leaf).
    Options the reference does not take (``in_place_backward``, a chunk size) go to liger_lab's call alone. ``errors``
    receives every relative error measured."""
    spec = OPS[name]
    ours, theirs = getattr(liger_lab, name), getattr(reference, name)
    parameters = inspect.signature(theirs).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    accepted = {key for key in options if key in parameters or (takes_any and key not in KERNEL_ONLY)}
    positional = [p.name for p in parameters.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if not len(spec.input_names) <= len(inputs) <= len(positional):
        raise TypeError(f"{name} takes {spec.input_names} and then at most {positional[len(spec.input_names) :]}")
    names = [*spec.input_names, *positional[len(spec.input_names) : len(inputs)]]
    checked = [i for i, input_name in enumerate(spec.input_names) if input_name in spec.differentiable]
    checked += [i for i in range(len(spec.input_names), len(inputs)) if torch.is_tensor(inputs[i])]

    def bind(fn: Callable[..., object], float64: bool) -> Callable[..., object]:
        given = {key: value for key, value in options.items() if not float64 or key in accepted}

        def call(*leaves: torch.Tensor) -> object:
            arguments = [v.double() if float64 and torch.is_tensor(v) and v.is_floating_point() else v for v in inputs]
            for index, leaf in zip(checked, leaves, strict=True):
                arguments[index] = prepare(leaf)
            return fn(*arguments, **given)

        return call

    return check_against_reference(
        name,
        bind(ours, False),
        bind(theirs, True),
        [inputs[i] for i in checked],
        input_names=[names[i] for i in checked],
        tol=tol,
        errors=errors,
    )


class LargestNewTensor(TorchDispatchMode):
    """The most elements of any tensor an aten op makes: views hold no memory of their own, and ops that write
    into their arguments (``out=``, ``copy_``, the interpreter's storage copies) allocate nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out


class Call(NamedTuple):
    """One liger_lab operator call: its short name (``rms_norm_backward_``), the operator, and copies of its
    arguments taken before it ran."""

    name: str
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict


def _copy(value: object) -> object:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class OpCalls(TorchDispatchMode):
    """What ran below autograd: how often each operator ran, by name (``liger_lab::glu``, ``aten::mm``, ...), in
    :attr:`counts`; with ``keep_args``, every liger_lab operator with copies of its arguments, in :attr:`recorded`.

    A dispatch mode sees a custom operator as one call and runs its kernel with the mode off. ``look_inside`` runs a
    liger_lab operator's kernel under this mode again, so what the kernel calls (reads of values, torch ops) is
    recorded too."""

    def __init__(self, *, keep_args: bool = False, look_inside: bool = False) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.recorded: list[Call] = []
        self.keep_args, self.look_inside = keep_args, look_inside

    def ran(self) -> set[str]:
        """The short names of the liger_lab operators that ran."""
        return {name.removeprefix("liger_lab::") for name in self.counts if name.startswith("liger_lab::")}

    def record(self, name: str) -> None:
        """Called with every operator's full name before it runs."""
        self.counts[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.record(func._schema.name)
        if func.namespace != "liger_lab":
            return func(*args, **kwargs)
        if self.keep_args:
            copies = {key: _copy(value) for key, value in kwargs.items()}
            self.recorded.append(Call(func._schema.name.split("::")[1], func, tuple(map(_copy, args)), copies))
        if self.look_inside:
            key = runtime.DEVICE.type.upper()
            with self:
                return torch.library.get_kernel(func, key).call_boxed(torch._C.DispatchKeySet(key), *args, **kwargs)
        return func(*args, **kwargs)


READS = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero"}
"""Operators whose CUDA kernels copy a value to the host and wait for it."""


class HostReads(OpCalls):
    """Every read of a tensor's value by the host, in :attr:`calls`: the reading operators (``.item()``, ``int(t)``,
    ``bool(t)``, ``nonzero``...) and ``Tensor.tolist``, which is no operator, inside liger_lab's operators too."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(look_inside=True)
        self.calls: list[str] = []
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor: torch.Tensor) -> list:
            self.calls.append("Tensor.tolist")
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def record(self, name: str) -> None:
        super().record(name)
        if name in READS:
            self.calls.append(name)


class Launch(NamedTuple):
    """One kernel launch: the kernel's name, the device context it ran in (None: outside
    ``runtime.device_context``), the devices of its tensor arguments, and the stream Triton launched it on (the
    current stream of the current device; None on CPU)."""

    kernel: str
    context: torch.device | None
    devices: set[torch.device]
    stream: object


@contextlib.contextmanager
def recorded_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Launch]]:
    """Every Triton launch in the block, in order (:class:`Launch`): what launches a kernel is the interpreter's
    function on CPU, Triton's JIT function on the GPU, and the device context is the one ``runtime.launch_kernel``
    enters (``runtime.device.device_context``, the one place that sets it)."""
    from triton.runtime import interpreter

    kernel_class = interpreter.InterpretedFunction if runtime.INTERPRET else triton.runtime.jit.JITFunction
    contexts: list[torch.device] = []
    launches: list[Launch] = []
    device_context = device.device_context

    @contextlib.contextmanager
    def recording_context(where: torch.device) -> Iterator[None]:
        contexts.append(where)
        try:
            with device_context(where):
                yield
        finally:
            contexts.pop()

    run = kernel_class.run

    def recording_run(self, *args, **kwargs):
        devices = {arg.device for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor)}
        stream = None if runtime.INTERPRET else torch.cuda.current_stream()
        launches.append(Launch(self.__name__, contexts[-1] if contexts else None, devices, stream))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(device, "device_context", recording_context)
    monkeypatch.setattr(kernel_class, "run", recording_run)
    yield launches
