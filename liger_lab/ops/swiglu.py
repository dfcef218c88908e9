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
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from liger_lab import runtime
from liger_lab.ops.common import check_float, check_same_dtype, check_same_shape, in_place_requested, may_overwrite

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


def glu_forward(
    gate: torch.Tensor, up: torch.Tensor, activation: str, *, launch: runtime.ElementwiseLaunch | None = None
) -> torch.Tensor:
    """Launch the forward on contiguous tensors of one shape and dtype. Returns act(gate) * up. ``launch``: the
    blocks, :func:`liger_lab.runtime.elementwise_launch`'s by default (a sweep passes its own)."""
    out = torch.empty_like(gate)
    n = gate.numel()
    if n == 0:
        return out
    block, num_warps, grid = launch or runtime.elementwise_launch(n)
    runtime.launch_kernel(
        _glu_forward_kernel, (grid,), gate, up, out, n, ACTIVATION=activation, BLOCK=block, num_warps=num_warps
    )
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
    n = gate.numel()
    if n == 0:
        return dgate, dup
    block, num_warps, grid = launch or runtime.elementwise_launch(n)
    runtime.launch_kernel(_glu_backward_kernel, (grid,),
        dout, gate, up, dgate, dup, n, ACTIVATION=activation, BLOCK=block, num_warps=num_warps
    )  # fmt: skip
    return dgate, dup


# --------------------------------------------------------------------------------------------------
# PyTorch operators (see liger_lab/ops/rms_norm.py): what torch.compile sees instead of the launchers.


@torch.library.custom_op("liger_lab::glu", mutates_args=())
def glu_op(gate: torch.Tensor, up: torch.Tensor, activation: str, in_place_backward: bool) -> torch.Tensor:
    """act(gate) * up; ``in_place_backward`` only steers the backward."""
    return glu_forward(gate.contiguous(), up.contiguous(), activation)


@glu_op.register_fake
def _(gate, up, activation, in_place_backward):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("liger_lab::glu_backward", mutates_args=())
def glu_backward_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) into fresh buffers."""
    return glu_backward(dout.contiguous(), gate.contiguous(), up.contiguous(), activation, in_place=False)


@glu_backward_op.register_fake
def _(dout, gate, up, activation):
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))  # fmt: skip


@torch.library.custom_op("liger_lab::glu_backward_", mutates_args=("gate", "up"))
def glu_backward_in_place_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str) -> None:
    """d_gate over gate and d_up over up (both contiguous)."""
    if gate.data_ptr() == up.data_ptr():  # two views of one buffer: the two stores would race
        dgate, dup = glu_backward(dout.contiguous(), gate.clone(), up.clone(), activation, in_place=True)
        gate.copy_(dgate)
        up.copy_(dup)
    else:
        glu_backward(dout.contiguous(), gate, up, activation, in_place=True)


@glu_backward_in_place_op.register_fake
def _(dout, gate, up, activation):
    return None


def _setup_context(ctx, inputs, output):
    gate, up, activation, in_place_backward = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation, ctx.in_place = activation, in_place_backward


def _backward(ctx, dout):
    gate, up = ctx.saved_tensors
    # Write over gate and up only when both get a gradient (a tensor that needs none is someone else's
    # constant) and both are dense buffers of their own (the public function rules out gate is up). Not under
    # create_graph=True: gradients written over detached buffers have no graph, so a second derivative would be
    # a silent zero; the out-of-place operator's output raises when differentiated instead.
    in_place = ctx.in_place and not torch.is_grad_enabled()
    if in_place and all(ctx.needs_input_grad[:2]) and gate.is_contiguous() and up.is_contiguous():
        # gate and up now hold gradients; the op bumps their versions, so a later reader that saved them
        # (a second backward with retain_graph, a producer that saved its output) gets autograd's
        # "modified by an inplace operation" error instead of computing with gradients as activations.
        torch.ops.liger_lab.glu_backward_(dout, gate, up, ctx.activation)
        # Fresh tensor objects over the same memory, so a leaf's .grad is never the leaf itself.
        return gate.detach(), up.detach(), None, None
    dgate, dup = torch.ops.liger_lab.glu_backward(dout, gate, up, ctx.activation)
    return dgate, dup, None, None


glu_op.register_autograd(_backward, setup_context=_setup_context)


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: str, in_place_backward: bool) -> torch.Tensor:
    check_float("gate", gate)
    check_float("up", up)
    check_same_shape(gate=gate, up=up)
    check_same_dtype(gate=gate, up=up)
    # gate and up as one tensor: the in-place backward's two stores would race over the same memory. A parameter
    # or another leaf that requires grad is the caller's: its values must survive the backward.
    in_place = (
        in_place_requested(in_place_backward, gate, up) and gate is not up and may_overwrite(gate) and may_overwrite(up)
    )
    return torch.ops.liger_lab.glu(gate, up, activation, in_place)


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
