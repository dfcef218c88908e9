"""Where kernels run: the one module that knows GPU from Triton's interpreter, and the facts of that hardware.

On a machine with CUDA, kernels compile for the GPU and take CUDA tensors. Without CUDA, this module sets
``TRITON_INTERPRET=1`` *before* Triton is first imported, so the very same ``@triton.jit`` functions run (slowly) on
CPU tensors through Triton's interpreter. Everything else in liger_lab asks here instead of checking ``torch.cuda``
itself: the device to allocate on, the facts of a GPU that launch settings depend on (:func:`hardware`, read once
per device), and :func:`launch_kernel`, through which every launch goes.

Setting ``TRITON_INTERPRET=1`` yourself forces the interpreter even on a GPU machine (useful to debug a kernel with
``print``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

_T = TypeVar("_T")


def _choose_interpreter() -> bool:
    requested = os.environ.get("TRITON_INTERPRET")
    if requested is not None:
        return requested == "1"
    if torch.cuda.is_available():
        return False
    if "triton" in sys.modules:
        raise RuntimeError(
            "liger_lab: this machine has no CUDA GPU, so Triton kernels must run in Triton's interpreter, "
            "but Triton was imported before liger_lab without TRITON_INTERPRET=1 and can no longer switch. "
            "Fix: restart the Python process (Jupyter: Kernel > Restart) and `import liger_lab` before "
            "anything that imports triton, or set the variable first: "
            "`import os; os.environ['TRITON_INTERPRET'] = '1'`."
        )
    os.environ["TRITON_INTERPRET"] = "1"
    return True


INTERPRET: bool = _choose_interpreter()
"""True when kernels run in Triton's interpreter on CPU tensors."""

import triton  # noqa: E402  (must follow the TRITON_INTERPRET decision above)


def _round_bf16_casts_in_interpreter() -> None:
    """Make the interpreter round fp32 -> bf16 casts to nearest even, as the GPU (and torch) do.

    Triton's interpreter keeps the top 16 bits of an fp32 value, which truncates: a bf16 result computed on CPU
    then differs from the GPU's and from PyTorch's by up to one bf16 ulp (0.0078 relative). Every kernel casts
    with ``.to(ptr.dtype.element_ty)`` before a store, and all those casts go through the interpreter's
    ``cast_impl``, so rounding there makes every bf16 store round like the GPU. Other casts are left to it."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "rounds_bf16", False):
        return
    truncating_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncating_cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # ties to even
        nan = np.isnan(src.data)
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)  # stays a (quiet) NaN of the same sign
        return interpreter.TensorHandle(rounded.reshape(np.shape(src.data)), dst_type.scalar)

    cast_impl.rounds_bf16 = True
    builder.cast_impl = cast_impl
    builder.create_fp_trunc = cast_impl


def _index_scalars_in_interpreter() -> None:
    """Let a kernel's runtime scalars bound its loops (``range(0, n_cols, BLOCK_N)``) in Triton 3.6's interpreter.

    That interpreter holds every scalar as a one-element array and turns it into a Python int with ``int(array)``,
    which NumPy 2.4 refuses for an array of one dimension. Triton 3.9's interpreter squeezes the array first; this
    does the same where the installed Triton does not (its ``__index__`` is set again at every launch)."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET:
    _round_bf16_casts_in_interpreter()
    _index_scalars_in_interpreter()

DEVICE: torch.device = torch.device("cpu") if INTERPRET else torch.device("cuda")
"""The device liger_lab's kernels expect their tensors on."""

HOST_READS_WAIT: bool = not INTERPRET
"""Whether reading a tensor's values on the host (``.tolist()``, ``.item()``) waits for the device. On the GPU it
does, every step, and a CUDA graph cannot capture it: the losses keep their counts and checks on the device there.
In the interpreter tensors are host memory, so input checks may read values before any work. Read it as
``liger_lab.runtime.HOST_READS_WAIT`` (tests set it there to run the GPU's path on CPU)."""

BACKEND: str = "triton-interpreter (CPU)" if INTERPRET else "cuda"


def pick(*, cpu: _T, gpu: _T) -> _T:
    """Choose a value by where kernels run, e.g. a problem size: ``pick(cpu=256, gpu=16384)``."""
    return cpu if INTERPRET else gpu


@dataclass(frozen=True)
class Hardware:
    """What launch settings depend on, for one device: whether it is the interpreter, its SM count (a nominal 4 in
    the interpreter) and the shared memory one program may use (no limit in the interpreter: a nominal 228 KiB)."""

    interpreter: bool
    sm_count: int
    shared_memory_bytes: int


_INTERPRETER_HARDWARE = Hardware(interpreter=True, sm_count=4, shared_memory_bytes=228 * 1024)
_GPU_HARDWARE: dict[int, Hardware] = {}


def hardware(device: torch.device | None = None) -> Hardware:
    """The facts of ``device`` (default: the current GPU), read from the driver once per GPU and kept: a launch
    asks for them every call, and ``torch.cuda.get_device_properties`` is a driver query each time."""
    if INTERPRET:
        return _INTERPRETER_HARDWARE
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    known = _GPU_HARDWARE.get(index)
    if known is None:
        properties = torch.cuda.get_device_properties(index)
        # An older torch lacks the shared-memory field: 99 KiB, the opt-in limit of Ampere's and Ada's consumer
        # parts, the least of the GPUs whose loads Triton pipelines.
        shared = getattr(properties, "shared_memory_per_block_optin", 99 * 1024)
        known = _GPU_HARDWARE[index] = Hardware(False, properties.multi_processor_count, shared)
    return known


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (a nominal 4 in the interpreter)."""
    return hardware().sm_count


def shared_memory_bytes() -> int:
    """Shared memory one program may use on the current GPU (the interpreter has no limit; a nominal 228 KiB)."""
    return hardware().shared_memory_bytes


def describe() -> str:
    """One line naming where kernels run, for notebook headers and the CLI."""
    if INTERPRET:
        return f"Triton {triton.__version__} interpreter on CPU (no CUDA GPU): kernels are exact but slow"
    name = torch.cuda.get_device_name()
    return f"{name}, {sm_count()} SMs, Triton {triton.__version__}, torch {torch.__version__}"


def check_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor lives where the kernels run."""
    expected = DEVICE.type
    for name, tensor in tensors.items():
        if tensor.device.type != expected:
            where = "in Triton's interpreter" if INTERPRET else "on the GPU"
            kind = "CPU" if INTERPRET else "CUDA"
            raise ValueError(f"{name} is on {tensor.device}, but kernels run {where} here: expected a {kind} tensor")


_NO_CONTEXT = contextlib.nullcontext()


def device_context(device: torch.device) -> contextlib.AbstractContextManager:
    """What a kernel launch for tensors on ``device`` runs in: that GPU made the current device, so Triton, which
    launches on the current device and on torch's current stream of it, launches where the tensors are and after
    the work queued to make them. Nothing on CPU (the interpreter), nor when that GPU is already current: the
    common case, where a ``torch.cuda.device`` guard alone would add its Python to every launch."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _NO_CONTEXT
    return torch.cuda.device(device)


_skipping_launches = False


def launch_kernel(kernel: Callable[..., object], grid: tuple[int, ...], *args: object, **kwargs: object) -> None:
    """``kernel[grid](*args, **kwargs)`` on the device of its first tensor argument (:func:`device_context`).

    Every launch in liger_lab goes through here. Triton itself launches on the current device whatever its
    arguments' device: in a model split over GPUs in one process (``device_map="auto"``, layers placed by hand),
    a layer on GPU 1 called while GPU 0 is current would launch on GPU 0 with pointers into GPU 1's memory, on
    a stream unordered with the work that made its inputs. Under :func:`skip_launches` it returns at once.
    On the GPU a launch whose specialization was launched before skips Triton's own launch path
    (:func:`_launch_compiled`)."""
    if _skipping_launches:
        return
    device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
    with device_context(device):
        if INTERPRET or not _launch_compiled(kernel, grid, device, args, kwargs):
            kernel[grid](*args, **kwargs)


# --------------------------------------------------------------------------------------------------
# The GPU's launch path without Triton's per-call work.
#
# ``kernel[grid](...)`` binds the arguments, works out the specialization Triton compiles for (each tensor's dtype and
# 16-byte alignment, each integer's width, whether it is 1 and whether 16 divides it, every constexpr), turns it
# into a string key, looks the compiled kernel up, and only then calls its launcher. On a GPU host that is tens of
# microseconds per launch, more than a small kernel's GPU time and more than an eager PyTorch op costs the host.
# Here the first launch of a specialization goes through Triton, which compiles the kernel and returns it; later
# launches whose arguments have the same key (one at least as fine as Triton's own, so that two calls with one key
# always get the same compiled kernel) call that kernel's launcher directly. While a launch hook is installed (a
# Triton profiler's) every launch goes through Triton, which calls the hooks.

_COMPILED: dict[tuple, tuple[Callable[..., object], object, object, tuple[tuple[str, object], ...]]] = {}
"""Specialization key -> the compiled kernel's launcher, its function handle and metadata, and the parameters after
the positional ones with their defaults."""
_DIRECT_LAUNCHES = not INTERPRET and os.environ.get("LIGER_LAB_TRITON_LAUNCHER") != "1"
"""False: every launch goes through ``kernel[grid]`` (set ``LIGER_LAB_TRITON_LAUNCHER=1`` to compare)."""


def _specialization(value: object) -> object:
    """What Triton specializes a (non-constexpr) kernel argument on, or finer: a tensor by dtype and 16-byte
    alignment, an integer by whether it is 1, whether 16 divides it and its width, a float by its type."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63
    if isinstance(value, float):
        return float
    return value


_CONSTEXPRS: dict[object, tuple[tuple[bool, ...], dict[str, bool]]] = {}


def launch_key(kernel, device_index: int, args: tuple, kwargs: dict) -> tuple:
    """The cache key of a launch: the kernel, the device, and per argument what Triton compiles for, at least as
    finely as Triton itself tells its compiled kernels apart. A constexpr, or a keyword that is no parameter (a
    launch option such as ``num_warps``), is a compile-time value: its value itself is in the key. Any other
    argument is in it by :func:`_specialization` (a tensor by dtype and alignment, never by its address)."""
    known = _CONSTEXPRS.get(kernel)
    if known is None:
        flags = tuple(bool(p.is_constexpr) for p in kernel.params)
        known = _CONSTEXPRS[kernel] = flags, dict(zip(kernel.arg_names, flags, strict=True))
    positional, by_name = known
    key = [kernel, device_index, len(args)]
    append = key.append
    for value, constant in zip(args, positional, strict=False):
        # The two common kinds inline (a launch has dozens of arguments; a call each would cost microseconds).
        kind = type(value)
        if constant:
            append(value)
        elif kind is torch.Tensor:
            append((value.dtype, value.data_ptr() % 16 == 0))
        elif kind is int:
            append((value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63))
        else:
            append(_specialization(value))
    for name, value in kwargs.items():
        append(name)
        append(_specialization(value) if by_name.get(name) is False else value)
    return tuple(key)


def _launch_compiled(kernel, grid: tuple[int, ...], device: torch.device, args: tuple, kwargs: dict) -> bool:
    """Launch ``kernel`` straight through its compiled launcher if this specialization was launched before (then
    return True); otherwise launch it through Triton once, keep what it compiled, and return True, or return False
    where this Triton's launch path is not the one this function knows (the caller then launches it)."""
    if not _DIRECT_LAUNCHES or type(kernel) is not triton.runtime.JITFunction:  # an autotuner picks its own
        return False
    hooks = triton.knobs.runtime
    if hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = launch_key(kernel, index, args, kwargs)
    known = _COMPILED.get(key)
    if known is None:
        compiled = kernel[grid](*args, **kwargs)
        names = tuple(getattr(kernel, "arg_names", ()))
        if not all(hasattr(compiled, field) for field in ("run", "function", "packed_metadata")) or not names:
            return True  # launched; an unknown Triton: every later launch takes the same path as this one
        # The parameters after the positional ones (the key fixes how many), with their defaults.
        defaults = [p.default for p in kernel.signature.parameters.values()][len(args) :]
        rest = tuple(zip(names[len(args) :], defaults, strict=True))
        _COMPILED[key] = (compiled.run, compiled.function, compiled.packed_metadata, rest)
        return True
    run, function, metadata, rest = known
    # Every parameter in the kernel's order, constexprs and defaults included, as Triton's launcher takes them.
    values = [*args, *(kwargs.get(name, default) for name, default in rest)]
    x, y, z = (*grid, 1, 1)[:3]
    run(x, y, z, torch._C._cuda_getCurrentRawStream(index), function, metadata, None, None, None, *values)
    return True


@contextlib.contextmanager
def skip_launches() -> Iterator[None]:
    """Within the block, :func:`launch_kernel` launches nothing: every output a kernel would write keeps whatever
    its allocation held. For measuring the host's share of a call (``benchmarks/host_time.py``): everything else a
    call does, checks, allocations, the dispatcher, autograd, launch settings, still runs."""
    global _skipping_launches
    previous, _skipping_launches = _skipping_launches, True
    try:
        yield
    finally:
        _skipping_launches = previous


def read_later(values: torch.Tensor) -> Callable[[], list]:
    """Start copying a small tensor to the host without waiting for it; the returned function waits for
    that copy alone (not for kernels launched after this call) and returns the values as a list.

    A plain ``.tolist()`` stops the host until the GPU has drained its queue, and the GPU then idles
    until the host launches the next kernel. Reading later lets a big kernel be queued first.
    """
    if INTERPRET:
        return values.tolist
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(values.device))  # the copy's stream, on the values' GPU

    def wait() -> list:
        copied.synchronize()
        return host.tolist()

    return wait


def synchronize() -> None:
    if not INTERPRET:
        torch.cuda.synchronize()
