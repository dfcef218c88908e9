r"""The chunk loop behind every fused linear loss: a loss of ``hidden @ weight.T`` without the N x V logits.

A language model's head turns N hidden states (N x H) into N x V logits, and a loss reads them once. The
loop below never holds more than one chunk of C rows of logits::

    z      = h_c @ W.T (+ b)          # C x V, the only logits-sized buffer (reused by every chunk)
    chunk_loss(z, rows)               # the loss's own step: per-row losses kept by the loss, dz over z
    dW    += dz.T @ h_c               # accumulated over chunks, in ``weight_grad_dtype``
    db    += sum over rows of dz
    dh_c   = dz @ W                   # rows c of the hidden gradient, final

What differs between losses is only ``chunk_loss``: cross-entropy runs its row kernel on z, a distillation
loss also computes the teacher's logits for the same rows and runs a divergence kernel, a preference loss
turns token log-probabilities into sequence scores. Each writes its losses wherever it keeps them and, when
asked, overwrites z with d(loss)/dz. A global factor shared by every row rides on the matmuls' ``alpha``
(``grad_scale``) rather than on dz, where fp16 would underflow, when the host knows it (the 1 / B of a mean
over pairs). One that only the device knows (a mean's 1 / kept, kept counted on the device: reading it back
would make the host wait for the GPU every step) is left to the loss's backward, which multiplies the
gradients by the upstream gradient anyway (see
:func:`liger_lab.ops.fused_linear_cross_entropy.mean_over_kept`).

The gradients are computed in the forward pass (6 N H V FLOPs in all, as many as an unfused forward and
backward), so the backward only multiplies them by the incoming scalar gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from liger_lab.ops.common import check_float

ChunkLoss = Callable[[torch.Tensor, slice, bool], None]
"""``chunk_loss(z, rows, write_grad)``: the loss's step for the logits ``z`` of ``hidden[rows]``. It records
the chunk's losses itself and, when ``write_grad``, writes d(loss)/dz over ``z`` (before ``grad_scale``)."""


@dataclass(frozen=True)
class ChunkGrads:
    """Which gradients the loop makes, and the dtype of the dW accumulator."""

    hidden: bool
    weight: bool
    bias: bool = False
    weight_grad_dtype: torch.dtype | None = None
    """fp32 for exact accumulation over chunks, or the weight's dtype (one rounding per chunk, no copy)."""
    hidden_over_input: bool = False
    """Write dh over ``hidden`` itself, each chunk's rows once that chunk has done reading them (an opt-in
    in-place backward: no N x H buffer)."""


@functools.cache
def _fused_fp32_addmm(device_type: str) -> bool:
    """Whether this torch can add a bf16 x bf16 product into an fp32 matrix in one cuBLAS call
    (``addmm(..., out_dtype=torch.float32)``: CUDA, recent torch)."""
    acc = torch.zeros(1, 1, device=device_type)
    half = torch.zeros(1, 1, dtype=torch.bfloat16, device=device_type)
    try:
        torch.addmm(acc, half, half, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def accumulate_weight_grad(acc: torch.Tensor, dz_t: torch.Tensor, h: torch.Tensor, scale: float, first: bool) -> None:
    """acc (+)= scale * dz_t @ h in acc's dtype. The first chunk writes (beta = 0: no zero-fill of a
    V x H buffer), later ones add (beta = 1, summed with the product in fp32 inside cuBLAS)."""
    beta = 0 if first else 1
    if acc.dtype == dz_t.dtype:
        torch.addmm(acc, dz_t, h, beta=beta, alpha=scale, out=acc)
    elif _fused_fp32_addmm(acc.device.type):
        torch.addmm(acc, dz_t, h, beta=beta, alpha=scale, out_dtype=torch.float32, out=acc)
    else:
        # Fallback (CPU, older torch): an fp32 product; costs a chunk-sized fp32 copy of dz.
        torch.addmm(acc, dz_t.float(), h.float(), beta=beta, alpha=scale, out=acc)


def chunked_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk_loss: ChunkLoss,
    *,
    chunk: int,
    grads: ChunkGrads | None = None,
    bias: torch.Tensor | None = None,
    grad_scale: float = 1.0,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Run ``chunk_loss`` over the logits of ``hidden`` (N x H) and ``weight`` (V x H), ``chunk`` rows at a
    time; with ``grads``, return (dh, dW accumulator, db in fp32) scaled by ``grad_scale``, None for the
    gradients not asked for (all None without ``grads``)."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of rows, got {chunk}")
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    grads = grads or ChunkGrads(hidden=False, weight=False)
    write_grad = grads.hidden or grads.weight or grads.bias
    logits = torch.empty(min(chunk, n_rows), vocab, dtype=hidden.dtype, device=hidden.device)
    grad_h = None
    if grads.hidden:
        grad_h = hidden if grads.hidden_over_input else hidden.new_empty(hidden.shape)
    grad_w = None
    if grads.weight:  # the first chunk overwrites dW; with no rows at all nothing does, so start from zero
        dtype = grads.weight_grad_dtype or weight.dtype
        grad_w = (torch.zeros if n_rows == 0 else torch.empty)(weight.shape, dtype=dtype, device=weight.device)
    grad_b = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if grads.bias else None
    for start in range(0, n_rows, chunk):
        rows = slice(start, min(start + chunk, n_rows))
        h, z = hidden[rows], logits[: rows.stop - start]
        if bias is None:
            torch.mm(h, weight.t(), out=z)
        else:
            torch.addmm(bias, h, weight.t(), out=z)
        chunk_loss(z, rows, write_grad)
        if grad_w is not None:
            accumulate_weight_grad(grad_w, z.t(), h, grad_scale, first=start == 0)
        if grad_b is not None:
            grad_b.add_(z.sum(dim=0, dtype=torch.float32), alpha=grad_scale)
        if grad_h is not None:  # last: over the input it overwrites h, which the dW product has just read
            torch.addmm(grad_h[rows], z, weight, beta=0, alpha=grad_scale, out=grad_h[rows])
    return grad_h, grad_w, grad_b


def check_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Validate a linear head, as every fused linear loss takes it: hidden (..., H), weight (V, H) with V >= 1, bias
    (V,) or None, all of one dtype."""
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.dim() == 0:
        raise ValueError("hidden must have at least one dimension (the hidden size)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}: expected (V, {hidden.shape[-1]}) with V >= 1, the hidden size "
            f"being the last dimension of hidden {tuple(hidden.shape)}"
        )
    tensors = {"hidden": hidden, "weight": weight}
    if bias is not None:
        check_float("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias has shape {tuple(bias.shape)}: expected ({weight.shape[0]},)")
        tensors["bias"] = bias
    if len({t.dtype for t in tensors.values()}) > 1:
        listed = ", ".join(f"{name} {t.dtype}" for name, t in tensors.items())
        raise ValueError(f"expected one dtype (as torch.nn.functional.linear does), got {listed}")
