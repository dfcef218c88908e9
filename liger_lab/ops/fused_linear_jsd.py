r"""Fused linear JSD: ``jsd(h_s @ W_s.T, h_t @ W_t.T, target)`` without either model's logits.

On-policy distillation compares a student's next-token distribution with a teacher's on the same N tokens.
Both come out of a language-model head: student logits z = h_s W_s^T (N x V, hidden size H_s) and teacher
logits y = h_t W_t^T (N x V, hidden size H_t, which need not equal H_s). Written plainly, the loss holds two
N x V tensors at once, plus the student's gradient: at N = 8192 and V = 128256 that is 2 GiB each in bf16.
Here both are made one chunk of C rows at a time by the shared loop of :mod:`liger_lab.ops.chunked`, whose
per-chunk step for this loss is::

    z      = h_s[c] @ W_s.T         # C x V, the loop's chunk buffer
    y      = h_t[c] @ W_t.T         # C x V, a second chunk buffer (no gradient: the teacher is a constant)
    d, dz  = jsd_rows(z, y)         # per-row divergences, and dd/dz written over z
    # the loop then: dW_s += dz.T @ h_s[c],  dh_s[c] = dz @ W_s   (the mean's 1 / kept: see below)

**The loss.** P = softmax(y / T) (teacher) and Q = softmax(z / T) (student). Per row, d = KL(P || Q) for
beta = 0, KL(Q || P) for beta = 1, and beta KL(P || M) + (1 - beta) KL(Q || M) with M = beta P + (1 - beta) Q
otherwise; the loss is the mean of d over the kept rows (target != ignore_index, every row when there is no
target), or their sum over ``num_items_in_batch`` when that is given, exactly :func:`liger_lab.jsd` of the two
products (no T**2 factor; 0 when every row is ignored).

**The gradient.** The row kernel gives g = dd/dz for each kept row (derived in :mod:`liger_lab.ops.jsd`;
for the forward KL it is (Q - P) / T) and zeros for an ignored row. The mean divides by the kept count n,
and z = h_s W_s^T is linear, so with G the C x V block of g::

    dL/dh_s[c] = (1/n) G @ W_s          dL/dW_s = (1/n) sum over chunks of G^T @ h_s[c]

n is counted on the device and never read by the host (that would wait for the GPU every step): in fp32 the
kernel multiplies G by 1/n before rounding it; in fp16 and bf16 G stays unscaled (fp16 would underflow, bf16
would round a confident teacher's -1/n alike for every row), the matmuls take 1/N and the backward multiplies
the gradients by N/n with the upstream gradient (:func:`liger_lab.ops.fused_linear_cross_entropy.mean_over_kept`).
Nothing flows into y: the teacher's hidden states and weight get no gradient. As in the fused linear
cross-entropy, the gradients are made in the forward, so the backward only multiplies them by the incoming
scalar gradient (skipped when it is exactly 1). FLOPs: 2 N H_t V for the teacher's logits plus 6 N H_s V for
the student's logits and both gradients.

**Memory.** Two chunk buffers of C x V (student and teacher, each in its own dtype), the student's N x H_s
hidden gradient, and dW_s (fp32 when ``accumulation`` allows, see
:mod:`liger_lab.ops.fused_linear_cross_entropy`). :data:`CHUNK_BUDGET_BYTES` bounds the first two and the
hidden gradient together: C is the largest multiple of 64 rows that fits (at least 64, at most N). At N = 8192,
H = 4096, V = 128256, bf16, the default 832 MiB budget less the 64 MiB hidden gradient gives C = 1536 (6
chunks, each buffer 376 MiB; dW in bf16 there: 2 GiB of fp32 does not fit). That is larger than the
cross-entropy's chunk because the JSD kernel gives each row one program: a chunk of a few hundred rows is a
wave and a half of programs on 132 SMs, and the half-empty last wave costs more than the smaller chunks save.
Measured on an H200 (benchmarks/results/h200-sweep-fljsd-chunks.json, forward+backward): 832 rows per chunk
65.4 ms at 1473 MiB, 1320 to 2112 rows 59.4 to 59.9 ms at 1712 to 2099 MiB.
"""

from __future__ import annotations

import torch

from liger_lab.ops.chunked import ChunkGrads, chunked_linear_loss
from liger_lab.ops.common import check_float, row_count
from liger_lab.ops.cross_entropy import refuse_second_derivative  # (also registers liger_lab::scale_rows_)
from liger_lab.ops.fused_linear_cross_entropy import (
    CHUNK_ALIGN,
    MIB,
    accumulation_dtype,
    check_chunk_options,
    finish_grads,
    mean_over_kept,
)
from liger_lab.ops.jsd import check_jsd_options, check_num_items, check_target, jsd_rows, kept_rows

CHUNK_BUDGET_BYTES = 832 * MIB
"""Bytes of temporaries per call: the student's and the teacher's chunk of logits, plus the student's hidden
gradient when it is asked for (see the module docstring for the choice)."""


def chunk_rows_for(
    n_rows: int,
    vocab: int,
    student_dtype: torch.dtype,
    teacher_dtype: torch.dtype,
    budget: int | None = None,
    *,
    other_bytes: int = 0,
) -> int:
    """Rows per chunk: the largest multiple of 64 whose two C x V chunks (student's and teacher's logits,
    each in its dtype) fit in ``budget`` bytes (default :data:`CHUNK_BUDGET_BYTES`) less ``other_bytes``
    (the hidden gradient's buffer, when there is one); at least 64, at most ``n_rows``."""
    budget = (CHUNK_BUDGET_BYTES if budget is None else budget) - other_bytes
    row_bytes = vocab * sum(torch.empty((), dtype=dtype).element_size() for dtype in (student_dtype, teacher_dtype))
    fitting = max(budget, 0) // row_bytes
    chunk = max(CHUNK_ALIGN, fitting // CHUNK_ALIGN * CHUNK_ALIGN)
    return max(1, min(chunk, n_rows))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(rows, H) view (or copy) of hidden states (..., H)."""
    return x.reshape(x.shape[:-1].numel(), x.shape[-1])


def _forward(
    student_hidden, student_weight, teacher_hidden, teacher_weight, target, beta, temperature, ignore_index,
    chunk_tokens, accumulation, needs, num_items=None,
):  # fmt: skip
    """(fp32 loss: the mean over kept rows, or their sum over ``num_items``; dh_s (rows, H_s) or None, dW_s
    accumulator or None, the fp32 factor the gradients still owe besides the upstream gradient). The kept count
    stays on the device (see mean_over_kept)."""
    student, teacher = _rows(student_hidden), _rows(teacher_hidden)
    n_rows, vocab, device = student.shape[0], student_weight.shape[0], student.device
    flat_target = None if target is None else target.reshape(-1).contiguous()
    kept = kept_rows(flat_target, n_rows, ignore_index, num_items, device)
    divide, grad_scale, owed = mean_over_kept(kept, n_rows, student.dtype)
    if num_items is not None and not divide:  # mean_over_kept clamps a count at 1; a normalizer may be below it
        owed = max(n_rows, 1) / kept
    need_h, need_w = bool(needs[0]), bool(needs[1])
    if chunk_tokens is None:
        other = student.numel() * student.element_size() if need_h else 0
        chunk_tokens = chunk_rows_for(n_rows, vocab, student.dtype, teacher.dtype, other_bytes=other)
    loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    teacher_logits = torch.empty(min(chunk_tokens, n_rows), vocab, dtype=teacher.dtype, device=device)
    # dd/dz times 1 / kept in the kernel's fp32 registers (fp32), or unscaled (see mean_over_kept).
    dz_scale = 1.0 / kept if divide else torch.ones((), dtype=torch.float32, device=device)

    def jsd_step(z: torch.Tensor, rows: slice, write_grad: bool) -> None:
        y = teacher_logits[: z.shape[0]]
        torch.mm(teacher[rows], teacher_weight.t(), out=y)
        rows_target = None if flat_target is None else flat_target[rows]
        jsd_rows(
            z, y, rows_target, loss[rows], beta, temperature, ignore_index,
            grad=z if write_grad else None, grad_scale=dz_scale,
        )  # fmt: skip

    grads = None
    if need_h or need_w:
        grads = ChunkGrads(
            hidden=need_h, weight=need_w, weight_grad_dtype=accumulation_dtype(student_weight, accumulation)
        )
    grad_h, grad_w, _ = chunked_linear_loss(
        student, student_weight, jsd_step, chunk=chunk_tokens, grads=grads, grad_scale=grad_scale
    )
    return loss.sum() / kept, grad_h, grad_w, owed


# --------------------------------------------------------------------------------------------------
# PyTorch operator (see liger_lab/ops/fused_linear_cross_entropy.py, whose pattern this follows): the
# gradients are made in the forward and returned; FusedLinearJSDFunction below scales them in the backward.


@torch.library.custom_op("liger_lab::fused_linear_jsd", mutates_args=())
def fused_linear_jsd_op(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None,
    num_items: torch.Tensor | None,
    beta: float,
    temperature: float,
    ignore_index: int,
    chunk_tokens: int | None,
    accumulation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 loss, dh_s (rows, H_s), dW_s accumulator, the fp32 factor they still owe); a gradient not in
    ``needs`` (student hidden, student weight) is an empty tensor."""
    loss, grad_h, grad_w, owed = _forward(
        student_hidden, student_weight, teacher_hidden, teacher_weight, target, beta, temperature, ignore_index,
        chunk_tokens, accumulation, needs, num_items,
    )  # fmt: skip
    # Operators return tensors, never None (and never one tensor twice: outputs may not alias each other).
    grad_h = student_hidden.new_empty(0) if grad_h is None else grad_h
    return loss, grad_h, student_hidden.new_empty(0) if grad_w is None else grad_w, owed


@fused_linear_jsd_op.register_fake
def _(student_hidden, student_weight, teacher_hidden, teacher_weight, target, num_items, beta, temperature,
      ignore_index, chunk_tokens, accumulation, needs):  # fmt: skip
    rows = row_count(student_hidden)
    grad_h = student_hidden.new_empty((rows, student_hidden.shape[-1]) if needs[0] else (0,))
    dtype = accumulation_dtype(student_weight, accumulation)
    grad_w = student_weight.new_empty(student_weight.shape, dtype=dtype) if needs[1] else student_hidden.new_empty(0)
    loss, owed = (student_hidden.new_empty((), dtype=torch.float32) for _ in range(2))
    return loss, grad_h, grad_w, owed


class FusedLinearJSDFunction(torch.autograd.Function):
    """Autograd of ``liger_lab::fused_linear_jsd``: the gradients are made in the forward and the backward
    scales them in place by the upstream gradient (an ``autograd.Function`` for the reason given in
    FusedLinearCrossEntropyFunction). Only the student's hidden states and weight get gradients."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, teacher_hidden, teacher_weight, target, num_items, arguments):
        loss, grad_h, grad_w, owed = torch.ops.liger_lab.fused_linear_jsd(
            student_hidden, student_weight, teacher_hidden, teacher_weight, target, num_items, *arguments
        )
        needs = arguments[-1]
        # The attributes finish_grads reads (it serves the fused cross-entropy too, which also has a bias).
        ctx.needs, ctx.hidden_shape, ctx.weight_dtype = (
            (needs[0], needs[1], False),
            student_hidden.shape,
            student_weight.dtype,
        )
        # Scaling in place bumps the gradients' versions: a second backward through the same graph fails with
        # "modified by an inplace operation" instead of scaling them twice.
        ctx.save_for_backward(grad_h, grad_w, owed)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_second_derivative("fused_linear_jsd")
        grad_h, grad_w, owed = ctx.saved_tensors
        grad_h, grad_w, _ = finish_grads(grad_h, grad_w, None, grad_loss, ctx, owed)
        # detach(): a fresh tensor object, so a leaf's .grad is never the buffer the backward scaled
        return None if grad_h is None else grad_h.detach(), grad_w, *(None,) * 5


def _check_head(name: str, weight: torch.Tensor, hidden_name: str, hidden: torch.Tensor) -> None:
    """A head weight (V, H) with V >= 1 and H the last dimension of its hidden states, in their dtype."""
    check_float(name, weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{name} has shape {tuple(weight.shape)}: expected (V, {hidden.shape[-1]}) with V >= 1, the hidden size "
            f"being the last dimension of {hidden_name} {tuple(hidden.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"{name} has dtype {weight.dtype}: expected {hidden_name}'s dtype {hidden.dtype} (one dtype per head, "
            f"as torch.nn.functional.linear requires)"
        )


def _check_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight, target) -> None:
    check_float("student_hidden", student_hidden)
    check_float("teacher_hidden", teacher_hidden)
    for name, hidden in (("student_hidden", student_hidden), ("teacher_hidden", teacher_hidden)):
        if hidden.dim() == 0:
            raise ValueError(f"{name} must have at least one dimension (the hidden size): expected (..., H)")
    if teacher_hidden.shape[:-1] != student_hidden.shape[:-1]:
        raise ValueError(
            f"teacher_hidden has shape {tuple(teacher_hidden.shape)}: expected {tuple(student_hidden.shape[:-1])} "
            f"rows like student_hidden {tuple(student_hidden.shape)} (the same tokens; the hidden sizes may differ)"
        )
    _check_head("student_weight", student_weight, "student_hidden", student_hidden)
    _check_head("teacher_weight", teacher_weight, "teacher_hidden", teacher_hidden)
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"teacher_weight has shape {tuple(teacher_weight.shape)}: expected the student's vocabulary "
            f"V = {student_weight.shape[0]} rows (student_weight {tuple(student_weight.shape)})"
        )
    for name, tensor in (("student_weight", student_weight), ("teacher_hidden", teacher_hidden),
                         ("teacher_weight", teacher_weight)):  # fmt: skip
        if tensor.device != student_hidden.device:
            raise ValueError(f"{name} is on {tensor.device}: expected {student_hidden.device}, student_hidden's")
    if target is not None:
        check_target(target, student_hidden, "student_hidden")


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    accumulation: str | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``liger_lab.jsd(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T, target)`` without
    ever holding the N x V logits of either model.

    ``student_hidden`` (..., H_s) and ``student_weight`` (V, H_s) (the student's ``lm_head`` weight) of one
    dtype; ``teacher_hidden`` (..., H_t) and ``teacher_weight`` (V, H_t) of one dtype (possibly another than
    the student's), with the same leading shape and vocabulary V; H_t may differ from H_s. ``target`` (...)
    integers or None: only a mask here (rows whose value is ``ignore_index`` do not count). ``beta``,
    ``temperature`` and ``ignore_index`` as in :func:`liger_lab.jsd`: P = softmax(teacher / T),
    Q = softmax(student / T), per row KL(P || Q) (beta = 0), KL(Q || P) (beta = 1) or the generalized JSD,
    averaged over the kept rows; no T**2 factor; 0 with zero gradients when every row is ignored.
    ``num_items_in_batch`` as in :func:`liger_lab.jsd`: the sum over the kept rows divided by it (TRL's normalizer).

    Returns a float32 scalar. Gradients reach ``student_hidden`` and ``student_weight``; the teacher's tensors
    are constants (no ``.grad`` even if they require grad). The gradients are computed in the forward, so the
    graph can be backpropagated once; the caller's tensors are never modified. ``chunk_tokens`` overrides the
    rows per chunk derived from :data:`CHUNK_BUDGET_BYTES`; ``accumulation`` ("auto", "fp32", "weight_dtype";
    default that of :func:`liger_lab.fused_linear_cross_entropy`) picks how the student's dW is summed over chunks.
    """
    beta, temperature = check_jsd_options(beta, temperature, ignore_index)
    _check_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight, target)
    accumulation = check_chunk_options("chunk_tokens", chunk_tokens, accumulation)
    num_items = check_num_items(num_items_in_batch, student_hidden.device)
    grad_on = torch.is_grad_enabled()
    needs = [grad_on and student_hidden.requires_grad, grad_on and student_weight.requires_grad]
    arguments = (beta, temperature, ignore_index, chunk_tokens, accumulation, needs)
    teacher_hidden, teacher_weight = teacher_hidden.detach(), teacher_weight.detach()
    if any(needs):
        return FusedLinearJSDFunction.apply(
            student_hidden, student_weight, teacher_hidden, teacher_weight, target, num_items, arguments
        )
    return torch.ops.liger_lab.fused_linear_jsd(
        student_hidden, student_weight, teacher_hidden, teacher_weight, target, num_items, *arguments
    )[0]
