r"""SwiGLU and GeGLU: the gated activations of Llama's and Gemma's MLPs, fused forward and backward.

Both compute ``out = act(gate) * up`` elementwise, and both activations have the form
``act(x) = x * sigmoid(z(x))``::

    silu:       z(x) = x                                   z'(x) = 1
    gelu_tanh:  z(x) = 2k (x + a x**3)                      z'(x) = 2k (1 + 3a x**2)
                (k = sqrt(2/pi), a = 0.044715, because (1 + tanh(v)) / 2 = sigmoid(2v))

so with s = sigmoid(z(gate)) one formula serves both (derivation in solutions/04_swiglu_geglu.ipynb)::

    act'(x) = s + x s (1 - s) z'(x)
    d_up    = dout * act(gate)
    d_gate  = dout * up * act'(gate)

Bytes per element (bf16): the forward reads gate and up and writes out (6); the backward reads dout,
gate and up and writes d_gate and d_up (10). The backward *recomputes* s from gate rather than reading
a stored activation: storing it would add a write in the forward, a read in the backward (20 bytes
instead of 16) and keep one more activation-sized tensor alive from forward to backward. The math is a
few fp32 operations per element, free next to the memory traffic.

Memory: by default the backward allocates d_gate and d_up. With ``in_place_backward=True`` it writes
them over the saved gate and up instead (no allocation at all in the backward), which is safe only when
nobody reads gate or up after the backward; see :func:`swiglu` for the contract and the checks that
turn misuse into an autograd error instead of wrong numbers.

**Operators** (:func:`liger_lab.ops.operators.define`): ``liger_lab::glu`` carries the autograd formula;
``liger_lab::glu_backward`` and its twin ``glu_backward_`` (the gradients over gate and up) come from one
declaration. Launch settings: :func:`liger_lab.runtime.elementwise_launch`, torch.compile's tile, chosen by the
measurements in benchmarks/notes/swiglu.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from liger_lab import reference, runtime
from liger_lab.ops import operators
from liger_lab.ops.common import check_float, check_same_dtype, check_same_shape, in_place_requested, may_overwrite
from liger_lab.ops.operators import dense_like

# Globals a kernel reads must be constexpr.
_K = tl.constexpr(math.sqrt(2.0 / math.pi))
_A = tl.constexpr(0.044715)


@triton.jit
def _sigmoid_argument(x, ACTIVATION: tl.constexpr):
    """z(x) and z'(x) such that act(x) = x * sigmoid(z(x)); fp32 in, fp32 out."""
    if ACTIVATION == "gelu_tanh":
        x2 = x * x
        z = (2.0 * _K) * x * (1.0 + _A * x2)
        dz = (2.0 * _K) * (1.0 + (3.0 * _A) * x2)
    else:
        z = x
        dz = tl.full(x.shape, 1.0, tl.float32)
    return z, dz


@triton.jit
def _glu_forward_kernel(gate_ptr, up_ptr, out_ptr, n_elements, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    # Flat offsets over contiguous buffers: each thread owns runs of adjacent elements, so loads and
    # stores become 16-byte vector accesses. int64 because activations can pass 2**31 elements.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    z, _ = _sigmoid_argument(gate, ACTIVATION)
    out = gate * tl.sigmoid(z) * up
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_elements, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    z, dz = _sigmoid_argument(gate, ACTIVATION)
    s = tl.sigmoid(z)
    act = gate * s
    dact = s + act * (1.0 - s) * dz
    # d_gate and d_up may be the gate and up buffers themselves (in-place backward): every element is
    # loaded above before it is overwritten here, by the same thread.
    tl.store(dgate_ptr + offsets, (dout * up * dact).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offsets, (dout * act).to(dup_ptr.dtype.element_ty), mask=mask)


def _launch(kernel: object, n: int, launch: runtime.ElementwiseLaunch | None, *args: object, activation: str) -> None:
    if n == 0:
        return
    block, num_warps, grid = launch or runtime.elementwise_launch(n)
    runtime.launch_kernel(kernel, (grid,), *args, n, ACTIVATION=activation, BLOCK=block, num_warps=num_warps)


def glu_forward(
    gate: torch.Tensor, up: torch.Tensor, activation: str, *, launch: runtime.ElementwiseLaunch | None = None
) -> torch.Tensor:
    """Launch the forward on contiguous tensors of one shape and dtype. Returns act(gate) * up. ``launch``: the
    blocks, :func:`liger_lab.runtime.elementwise_launch`'s by default (a sweep passes its own)."""
    out = torch.empty_like(gate)
    _launch(_glu_forward_kernel, gate.numel(), launch, gate, up, out, activation=activation)
    return out


def glu_backward(
    dout: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    in_place: bool,
    *,
    launch: runtime.ElementwiseLaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward on contiguous tensors. Returns (d_gate, d_up), written over (gate, up) when
    ``in_place``. ``launch`` as in :func:`glu_forward`."""
    dgate, dup = (gate, up) if in_place else (torch.empty_like(gate), torch.empty_like(up))
    _launch(_glu_backward_kernel, gate.numel(), launch, dout, gate, up, dgate, dup, activation=activation)
    return dgate, dup


# --------------------------------------------------------------------------------------------------
# PyTorch operators (liger_lab.ops.operators, as in liger_lab/ops/rms_norm.py): what torch.compile sees instead of
# the launchers.


def _glu_into(
    gate: torch.Tensor, up: torch.Tensor, activation: str, in_place_backward: bool, out: torch.Tensor
) -> None:
    """act(gate) * up; ``in_place_backward`` only steers the backward (the formula reads it from the call)."""
    _launch(_glu_forward_kernel, gate.numel(), None, gate.contiguous(), up.contiguous(), out, activation=activation)


def _glu_backward_into(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, dgate: torch.Tensor, dup: torch.Tensor
) -> None:
    """d_gate and d_up; the twin passes gate and up themselves (both contiguous) as the buffers."""
    # The twin given two views of one buffer: the two stores would race, so the gradients go through copies.
    racing = dgate.data_ptr() == dup.data_ptr() and dgate.numel() > 0
    into = (torch.empty_like(dgate), torch.empty_like(dup)) if racing else (dgate, dup)
    _launch(_glu_backward_kernel, gate.numel(), None, dout.contiguous(), gate.contiguous(), up.contiguous(), *into,
            activation=activation)  # fmt: skip
    if racing:
        dgate.copy_(into[0])
        dup.copy_(into[1])


GLU_BACKWARD = operators.define(
    "glu_backward",
    _glu_backward_into,
    outputs={"dgate": lambda gate: dense_like(gate), "dup": lambda up: dense_like(up)},
    in_place={"dgate": "gate", "dup": "up"},
)


def _setup_context(ctx, inputs, output):
    gate, up, activation, in_place_backward = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation, ctx.in_place = activation, in_place_backward


def _backward(ctx, dout):
    gate, up = ctx.saved_tensors
    # Write over gate and up only when both get a gradient (a tensor that needs none is someone else's
    # constant) and both are dense buffers of their own (the public function rules out gate is up). Under
    # create_graph=True the backward is refused first (liger_lab.ops.operators).
    if ctx.in_place and all(ctx.needs_input_grad[:2]) and gate.is_contiguous() and up.is_contiguous():
        # gate and up now hold gradients; the op bumps their versions, so a later reader that saved them
        # (a second backward with retain_graph, a producer that saved its output) gets autograd's
        # "modified by an inplace operation" error instead of computing with gradients as activations.
        GLU_BACKWARD.call_in_place(dout, gate, up, ctx.activation)
        # Fresh tensor objects over the same memory, so a leaf's .grad is never the leaf itself.
        return gate.detach(), up.detach(), None, None
    return *GLU_BACKWARD(dout, gate, up, ctx.activation), None, None


GLU = operators.define(
    "glu",
    _glu_into,
    outputs={"out": lambda gate: dense_like(gate)},
    setup_context=_setup_context,
    backward=_backward,
)


_PUBLIC_NAMES = {"silu": "swiglu", "gelu_tanh": "geglu"}
_FORMULAS = {"silu": reference.swiglu, "gelu_tanh": reference.geglu}
"""What :func:`swiglu` and :func:`geglu` trace under ``torch.compile`` (:func:`liger_lab.ops.operators.lowered`)."""


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: str, in_place_backward: bool) -> torch.Tensor:
    check_float("gate", gate)
    check_float("up", up)
    check_same_shape(gate=gate, up=up)
    check_same_dtype(gate=gate, up=up)
    if operators.lowered(_PUBLIC_NAMES[activation]):
        return _FORMULAS[activation](gate, up)
    # gate and up as one tensor: the in-place backward's two stores would race over the same memory. A parameter
    # or another leaf that requires grad is the caller's: its values must survive the backward.
    in_place = (
        in_place_requested(in_place_backward, gate, up) and gate is not up and may_overwrite(gate) and may_overwrite(up)
    )
    return GLU(gate, up, activation, in_place)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, in_place_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` (Llama's MLP), any shape; gate and up of one shape and dtype.

    ``in_place_backward=True`` writes the gradients over the buffers of gate and up during the
    backward, so the backward allocates nothing (Liger-Kernel always does this). It is safe when
    gate and up are read by nothing but this op after the forward, as in a gated MLP where they are
    fresh outputs of the gate and up projections (``nn.Linear`` saves its input, never its output).
    After the backward those buffers hold the gradients; an autograd node that saved them (a second
    backward of a retained graph, a producer that saved its own output) then fails with autograd's
    "modified by an inplace operation" error rather than using them. A strided (non-contiguous) input,
    gate and up being one tensor, either of them needing no gradient, or either of them being the caller's
    state (an ``nn.Parameter`` or another leaf that requires grad, or a view of one, whose values the caller
    keeps) fall back to fresh gradients. Whether anything else saw gate and up (a forward hook that kept a
    projection's output) the op cannot tell: :class:`liger_lab.nn.SwiGLUMLP` and the patched MLPs check that.
    Under ``torch.compile`` the compiler plans the buffers itself: the option then changes nothing.
    """
    return _glu(gate, up, "silu", in_place_backward)


def geglu(gate: torch.Tensor, up: torch.Tensor, *, in_place_backward: bool = False) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (Gemma's MLP); same contract as :func:`swiglu`."""
    return _glu(gate, up, "gelu_tanh", in_place_backward)
