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


def launch_kernel(kernel: Callable[..., object], grid: tuple[int, ...], *args: object, **kwargs: object) -> object:
    """``kernel[grid](*args, **kwargs)`` on the device of its first tensor argument (:func:`device_context`).

    Every launch in liger_lab goes through here. Triton itself launches on the current device whatever its
    arguments' device: in a model split over GPUs in one process (``device_map="auto"``, layers placed by hand),
    a layer on GPU 1 called while GPU 0 is current would launch on GPU 0 with pointers into GPU 1's memory, on
    a stream unordered with the work that made its inputs. Under :func:`skip_launches` it returns at once."""
    if _skipping_launches:
        return None
    device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
    with device_context(device):
        return kernel[grid](*args, **kwargs)


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
