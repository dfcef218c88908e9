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
products (no T**2 factor; 0 when every row is ignored). On request (``entropy=True``) the kernel's first pass also
keeps the running sum of exp((z - max) / T) z, which gives the student's entropy per row,
H(Q) = lse(z / T) - E_Q[z / T]: the metric TRL's distillation logs, at no cost of another product.

**The gradient.** The row kernel gives g = dd/dz for each kept row (derived in :mod:`liger_lab.ops.jsd`;
for the forward KL it is (Q - P) / T) and zeros for an ignored row. The mean divides by the kept count n,
and z = h_s W_s^T is linear, so with G the C x V block of g::

    dL/dh_s[c] = (1/n) G @ W_s          dL/dW_s = (1/n) sum over chunks of G^T @ h_s[c]

n is counted on the device and never read by the host (that would wait for the GPU every step): in fp32 the
kernel multiplies G by 1/n before rounding it; in fp16 and bf16 G stays unscaled (fp16 would underflow, bf16
would round a confident teacher's -1/n alike for every row), the matmuls take 1/N and the backward multiplies
the gradients by N/n with the upstream gradient (:func:`liger_lab.ops.chunked.mean_over_kept`).
Nothing flows into y: the teacher's hidden states and weight get no gradient. As in the fused linear
cross-entropy, the gradients are made in the forward, so the backward only multiplies them by the incoming
scalar gradient (skipped when it is exactly 1). FLOPs: 2 N H_t V for the teacher's logits plus 6 N H_s V for
the student's logits and both gradients.

**Memory.** Two chunk buffers of C x V (student and teacher, each in its own dtype), the student's N x H_s
hidden gradient, and dW_s (fp32 when ``accumulation`` allows, see
:func:`liger_lab.ops.chunked.accumulation_dtype`). :data:`CHUNK_BUDGET_BYTES` bounds the first two and the
hidden gradient together: C is the largest multiple of 64 rows that fits (at least 64, at most N). At N = 8192,
H = 4096, V = 128256, bf16, the default 832 MiB budget less the 64 MiB hidden gradient gives C = 1536 (6
chunks, each buffer 376 MiB; dW in bf16 there: 2 GiB of fp32 does not fit). That is larger than the
cross-entropy's chunk because the JSD kernel gives each row one program: a chunk of a few hundred rows is a
wave and a half of programs on 132 SMs, and the half-empty last wave costs more than the smaller chunks save
(benchmarks/notes/distillation_and_preference.md holds the H200 sweep of chunk sizes behind the budget). The
operator, its gradients and their backward are the skeleton's (:mod:`liger_lab.ops.chunked`): this module is the
chunk step (the teacher's logits and the divergence kernel), its chunk rule and its validation.
"""

from __future__ import annotations

import torch

from liger_lab.formulas import JSDOptions
from liger_lab.ops import chunked
from liger_lab.ops.common import row_count
from liger_lab.ops.jsd import check_num_items, check_target, jsd_rows, kept_rows
from liger_lab.ops.operators import define

CHUNK_BUDGET_BYTES = 832 * chunked.MIB
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
    budget = CHUNK_BUDGET_BYTES if budget is None else budget
    row_bytes = vocab * (student_dtype.itemsize + teacher_dtype.itemsize)
    return chunked.rows_per_chunk(n_rows, row_bytes, budget, other_bytes=other_bytes)


def _forward(
    student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor, target: torch.Tensor | None, num_items: torch.Tensor | None, beta: float,
    temperature: float, ignore_index: int, chunk_tokens: int | None, accumulation: str, with_entropy: bool,
    needs: list[bool], loss: torch.Tensor, entropy: torch.Tensor, grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor, grad_bias: torch.Tensor, owed: torch.Tensor,
) -> None:  # fmt: skip
    """The operator's work, into its outputs: the fp32 loss (the mean over kept rows, or their sum over
    ``num_items``), the student's entropy per row when ``with_entropy`` (else ``entropy`` is empty), the student's
    gradients ``needs`` asks for, and the fp32 factor they still owe besides the upstream gradient. The kept count
    stays on the device (see mean_over_kept)."""
    student, flat_target = chunked.token_rows(student_hidden, target)
    teacher, _ = chunked.token_rows(teacher_hidden)
    n_rows, vocab, device = student.shape[0], student_weight.shape[0], student.device
    kept = kept_rows(flat_target, n_rows, ignore_index, num_items, device)
    divide, grad_scale, kept_factor = chunked.mean_over_kept(kept, n_rows, student.dtype)
    if num_items is not None and not divide:  # mean_over_kept clamps a count at 1; a normalizer may be below it
        kept_factor = max(n_rows, 1) / kept
    if kept_factor is None:
        owed.fill_(1.0)
    else:
        owed.copy_(kept_factor)
    if chunk_tokens is None:
        other = student.numel() * student.element_size() if needs[0] else 0
        chunk_tokens = chunk_rows_for(n_rows, vocab, student.dtype, teacher.dtype, other_bytes=other)
    losses = torch.empty(n_rows, dtype=torch.float32, device=device)
    teacher_logits = torch.empty(min(chunk_tokens, n_rows), vocab, dtype=teacher.dtype, device=device)
    # dd/dz times 1 / kept in the kernel's fp32 registers (fp32), or unscaled (see mean_over_kept).
    dz_scale = 1.0 / kept if divide else torch.ones((), dtype=torch.float32, device=device)
    options = JSDOptions(beta, temperature, ignore_index)

    def jsd_step(z: torch.Tensor, rows: slice, write_grad: bool) -> None:
        y = teacher_logits[: z.shape[0]]
        torch.mm(teacher[rows], teacher_weight.t(), out=y)
        rows_target = None if flat_target is None else flat_target[rows]
        jsd_rows(
            z, y, rows_target, losses[rows], options,
            grad=z if write_grad else None, grad_scale=dz_scale, entropy=entropy[rows] if with_entropy else None,
        )  # fmt: skip

    grads = chunked.ChunkGrads.asked(needs, grad_hidden, grad_weight, grad_bias)
    chunked.chunked_linear_loss(
        student, student_weight, jsd_step, chunk=chunk_tokens, grads=grads, grad_scale=grad_scale
    )
    torch.div(losses.sum(), kept, out=loss)


FUSED_LINEAR_JSD = define(
    "fused_linear_jsd", _forward,
    outputs={"loss": lambda student_hidden: student_hidden.new_empty((), dtype=torch.float32),
             "entropy": lambda student_hidden, with_entropy: student_hidden.new_empty(
                 row_count(student_hidden) if with_entropy else 0, dtype=torch.float32),
             **chunked.grad_outputs(hidden="student_hidden", weight="student_weight")},
)  # fmt: skip
_LOSS = chunked.FusedLoss("fused_linear_jsd", FUSED_LINEAR_JSD, metrics=1)


def _check_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight, target) -> None:
    """Two heads over the same tokens and vocabulary, each of one dtype (they may differ), on one device."""
    names = ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight")
    chunked.check_head(student_hidden, student_weight, names=names[:2])
    chunked.check_second_head(student_hidden, student_weight, teacher_hidden, teacher_weight, names=names)
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
    entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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

    Returns a float32 scalar; with ``entropy=True`` also the entropy of the student's softmax(z / T) per row, float32
    of the target's shape (0 on an ignored row), made in the divergence's first pass (no further product) and carrying
    no gradient: what TRL's distillation logs. Gradients reach ``student_hidden`` and ``student_weight``; the
    teacher's tensors are constants (no ``.grad`` even if they require grad). The gradients are computed in the
    forward, so the graph can be backpropagated once; the caller's tensors are never modified. ``chunk_tokens``
    overrides the rows per chunk derived from :data:`CHUNK_BUDGET_BYTES`; ``accumulation`` ("auto", "fp32",
    "weight_dtype"; default that of :func:`liger_lab.fused_linear_cross_entropy`) picks how the student's dW is summed
    over chunks.
    """
    o = JSDOptions(beta, temperature, ignore_index).checked()
    beta, temperature = o.beta, o.temperature
    _check_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight, target)
    accumulation = chunked.check_chunk_options("chunk_tokens", chunk_tokens, accumulation)
    num_items = check_num_items(num_items_in_batch, student_hidden.device)
    needs = chunked.needed_grads(student_hidden, student_weight)
    if not isinstance(entropy, bool):
        raise ValueError(f"entropy is {entropy!r}: expected True or False")
    tensors = (student_hidden, student_weight, teacher_hidden.detach(), teacher_weight.detach(), target, num_items)
    options = (beta, temperature, ignore_index, chunk_tokens, accumulation, entropy, needs)
    loss, row_entropy = chunked.run_loss(_LOSS, tensors, options)
    return (loss, row_entropy.reshape(student_hidden.shape[:-1])) if entropy else loss
