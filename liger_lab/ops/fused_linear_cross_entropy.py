r"""Fused linear cross-entropy: ``cross_entropy(hidden @ weight.T + bias, target)`` without the logits.

With N tokens, hidden size H and vocabulary V, the logits are N x V: for N = 8192, V = 128256 that is
2 GiB in bf16 and 4 GiB in fp32, plus as much again for their gradient: the largest activation of a
language model, used once. Here the tokens are processed in chunks of C rows::

    z      = h_c @ W.T (+ b)                 # C x V, cuBLAS, the only logits-sized buffer (reused)
    dz     = d loss / d z                    # the cross-entropy kernel, written over z in place
    dW    += dz.T @ h_c                      # accumulated over chunks
    db    += sum over rows of dz
    dh_c   = dz @ W                          # rows c of the hidden gradient, final (written over h_c
                                             # with in_place_backward: this chunk has done reading it)

Everything is computed **in the forward** (6 N H V FLOPs in all, the same as an unfused forward and
backward), so the backward only multiplies by the incoming scalar gradient, and skips even that when
it is exactly 1. For ``reduction="none"`` the incoming gradient is one number per token and dW needs
it *inside* the sum over tokens, so nothing is precomputed: the forward computes only the loss and the
backward runs the chunk loop again with the per-token gradient folded into dz (8 N H V FLOPs).

**Nothing is read back.** A mean's kept count and the target range check come from one small kernel
(:func:`liger_lab.ops.cross_entropy.count_targets`) whose result stays on the device: in fp32 the cross-entropy
kernel divides dz by the count itself; in fp16 and bf16 the backward applies it with the upstream gradient
(:func:`liger_lab.ops.chunked.mean_over_kept` says why). So the host never waits for the GPU in forward or backward,
and a CUDA graph captures the whole step. A target out of range is a ValueError in the interpreter, where reading
the count costs nothing; on the GPU it makes the loss and every gradient NaN. The gradient is not differentiable
again: a backward with ``create_graph=True`` raises.

**Chunk size.** The chunk's logits cost ``C * V * itemsize`` bytes (bf16: 2 bytes; the kernel works in
fp32 registers, never an fp32 copy). :data:`CHUNK_BUDGET_BYTES` bounds the op's temporaries: the chunk
of logits, plus the N x H hidden gradient unless ``in_place_backward`` writes it over ``hidden``. ``C``
is the largest multiple of 64 tokens that fits (at least 64 tokens, at most N; from 512 on, of 256).
Bigger chunks keep the three matmuls near peak; smaller chunks cost less memory. At N = 8192, H = 4096,
V = 128256, bf16, dW itself is 1002 MiB and the default 256 MiB budget gives C = 1024 with
``in_place_backward`` (251 MiB of logits, 8 chunks) and C = 768 without (188 MiB, plus 64 MiB for dh): about
1.22 GiB above the inputs either way. Both are multiples of 256 tokens, whose products the H200 runs faster than
their neighbours' (:data:`MATMUL_ALIGN`); benchmarks/notes/fused_linear_cross_entropy.md holds the sweeps of chunk
sizes behind the budget. A patched model's loss bounds its chunk further, by the size of its
hidden states (:func:`chunk_tokens_in_model`): in a training step the chunk adds to every activation alive. The
rule itself (:func:`liger_lab.ops.chunked.rows_per_chunk`) is every fused linear loss's; each sets its own budget.

**Accumulating dW.** ``accumulation`` picks the dtype of the running dW sum, for every fused linear loss
(:func:`liger_lab.ops.chunked.accumulation_dtype`; the default, :data:`liger_lab.ops.chunked.ACCUMULATION`, for a
whole program):

- ``"weight_dtype"``: dW is accumulated in the weight's dtype with ``addmm_``. cuBLAS sums each chunk's
  C tokens in fp32 and adds the running sum in fp32, then rounds once: one bf16 rounding per chunk
  (9 to 12 at the shape above; a single unchunked GEMM rounds once). No memory beyond dW itself.
- ``"fp32"``: a separate fp32 accumulator (4 V H bytes: 2.0 GiB at the shape above), rounded to the
  weight's dtype once, in the backward. Exact fp32 accumulation whatever the number of chunks.
- ``"auto"`` (default): ``"fp32"`` when the accumulator costs nothing (fp32 weights) or at most
  :data:`FP32_ACCUMULATOR_BUDGET_BYTES`, else ``"weight_dtype"`` with chunks as large as the budget
  allows, which bounds the number of roundings. The notebook measures the error of each.

**Operators.** ``liger_lab::fused_linear_cross_entropy`` returns (loss, dh, dW accumulator, db, owed factor), the
chunk loop's skeleton (:mod:`liger_lab.ops.chunked`) doing the rest; its twin ``fused_linear_cross_entropy_``
(declared with it) writes dh over ``hidden``; ``fused_linear_cross_entropy_backward`` is the loop again for
``reduction="none"``.
"""

from __future__ import annotations

import torch

from liger_lab.formulas import LossOptions, check_loss_options
from liger_lab.ops import chunked

# Chapter 6 teaches the dW accumulation as this op's, and the HF layer checks its chunk options here.
from liger_lab.ops.chunked import (
    ACCUMULATION as ACCUMULATION,
)
from liger_lab.ops.chunked import (
    FP32_ACCUMULATOR_BUDGET_BYTES as FP32_ACCUMULATOR_BUDGET_BYTES,
)
from liger_lab.ops.chunked import (
    accumulation_dtype as accumulation_dtype,
)
from liger_lab.ops.chunked import check_chunk_options
from liger_lab.ops.common import in_place_requested, rows_to_overwrite
from liger_lab.ops.cross_entropy import (
    check_target,
    check_target_tensor,
    count_targets,
    cross_entropy_rows,
    nan_if_out_of_range,
)
from liger_lab.ops.forward_grad import refuse_second_derivative, scale_rows
from liger_lab.ops.operators import define

CHUNK_BUDGET_BYTES = 256 * chunked.MIB
"""Bytes of temporaries per call: one chunk of logits, plus the hidden gradient's buffer when it is not
written over ``hidden``. The chunk size in tokens follows from it (see the module docstring)."""


MATMUL_ALIGN = 256
"""A chunk of at least twice this many tokens is a multiple of it: in the H200 sweep of
benchmarks/notes/fused_linear_cross_entropy.md, chunks of 768 and 1024 tokens ran faster than chunks of 640, 704
or 896 (cuBLAS tiles a chunk's rows by 128 or 256)."""


def chunk_tokens_for(
    n_tokens: int, vocab: int, dtype: torch.dtype, budget: int | None = None, *, other_bytes: int = 0
) -> int:
    """Tokens per chunk: the largest multiple of 64 whose ``C x V`` logits fit in ``budget`` bytes
    (default :data:`CHUNK_BUDGET_BYTES`) less ``other_bytes`` (the hidden gradient's buffer, when there
    is one), at least 64 (smaller matmuls waste the GPU), at most N; from 512 tokens on, a multiple of
    :data:`MATMUL_ALIGN` (unless it is all N)."""
    budget = CHUNK_BUDGET_BYTES if budget is None else budget
    tokens = chunked.rows_per_chunk(n_tokens, vocab * dtype.itemsize, budget, other_bytes=other_bytes)
    if 2 * MATMUL_ALIGN <= tokens < n_tokens:
        tokens -= tokens % MATMUL_ALIGN
    return tokens


MODEL_CHUNK_HIDDEN_STATES = 2
"""In a patched model's loss, the chunk of logits holds at most this many hidden states' bytes (N x H each)..."""
MODEL_CHUNK_MIN_FLOPS = 160 * 10**9
"""...unless that leaves a chunk less matmul work than this (6 C H V FLOPs: about a quarter of a millisecond on an
H200); then the chunk is the one that does this much, within :data:`CHUNK_BUDGET_BYTES`."""


def chunk_tokens_in_model(n_tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype) -> int:
    """Tokens per chunk for the loss of a patched model's training step: :func:`chunk_tokens_for` with the budget
    also capped at :data:`MODEL_CHUNK_HIDDEN_STATES` hidden states, but never below the chunk that does
    :data:`MODEL_CHUNK_MIN_FLOPS` of matmul work.

    The op's own budget is set for the op alone, where bigger chunks are faster. In a training step the loss's
    forward runs while every layer's activations are alive, so its chunk of logits lands on top of the step's
    largest allocation. Bounded by the hidden states, the chunk grows with the batch like the activations do
    (Liger-Kernel's rule gives between one and two hidden states). At 8 x 2048 tokens of a Qwen3-style model
    (H = 2048, V = 151936, bf16) that is 384 tokens (111 MiB) instead of 768 (223 MiB).

    Each chunk also costs the host a few launches (two matmuls and an addmm, the loss kernel), whatever its size. A
    small model's chunk of two hidden states is a few microseconds of GPU work, so a step of many such chunks waits
    on the host: at the ``small`` preset (H = 768, V = 32000, 4 x 1024 tokens) two hidden states are 192 tokens,
    21 chunks a step, where the work floor gives 1024 tokens (64 MiB), 4 chunks. Large models keep the hidden-state
    rule (the floor is 86 tokens of Qwen3's). The measurement is in benchmarks/notes/host_time.md."""
    hidden_states = MODEL_CHUNK_HIDDEN_STATES * n_tokens * hidden_size * dtype.itemsize
    working_chunk = -(-MODEL_CHUNK_MIN_FLOPS // (6 * hidden_size * vocab)) * vocab * dtype.itemsize
    budget = min(CHUNK_BUDGET_BYTES, max(hidden_states, working_chunk))
    return chunk_tokens_for(n_tokens, vocab, dtype, budget)


def chunk_rows(
    rows: torch.Tensor, weight: torch.Tensor, chunk_tokens: int | None, with_grad_h: bool, *, budget: int | None = None
) -> int:
    """The caller's chunk size, or the one ``budget`` (default :data:`CHUNK_BUDGET_BYTES`) allows less the hidden
    gradient's buffer when there is one (``with_grad_h``): the rule of every loss whose chunks are tokens of one
    head (this one, the RL head and the GRPO family)."""
    if chunk_tokens is not None:
        return chunk_tokens
    other = rows.numel() * rows.element_size() if with_grad_h else 0
    return chunk_tokens_for(rows.shape[0], weight.shape[0], rows.dtype, budget, other_bytes=other)


def _cross_entropy_chunk(
    target: torch.Tensor, loss: torch.Tensor, options: LossOptions, row_scale=None, counts=None, divide=False
) -> chunked.ChunkLoss:
    """The chunk step of :func:`liger_lab.ops.chunked.chunked_linear_loss` for cross-entropy: the row kernel
    writes each token's fp32 loss into ``loss`` and, when asked, dz over the chunk's logits (times
    ``row_scale``, one upstream gradient per token, for reduction="none"; divided by the kept count of
    ``counts`` on the device when ``divide``: see :func:`~liger_lab.ops.chunked.mean_over_kept`)."""

    def step(z: torch.Tensor, rows: slice, write_grad: bool) -> None:
        scale = None if row_scale is None else row_scale[rows]
        grad = z if write_grad else None  # dz over z
        cross_entropy_rows(
            z, target[rows], loss[rows], options, grad=grad, row_scale=scale, counts=counts, divide_by_count=divide
        )

    return step


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None, ignore_index: int,
    label_smoothing: float, reduction: str, softcap: float | None, chunk_tokens: int | None, accumulation: str,
    needs: list[bool], loss: torch.Tensor, grad_hidden: torch.Tensor, grad_weight: torch.Tensor,
    grad_bias: torch.Tensor, owed: torch.Tensor,
) -> None:  # fmt: skip
    """The operator's work, into its outputs: the fp32 loss reduced as asked, the gradients ``needs`` asks for
    (none for reduction="none", whose backward runs the loop again) and the fp32 factor they still owe. In the
    in-place twin ``grad_hidden`` is ``hidden`` itself: each chunk's rows of dh go over the rows it has just read."""
    options = LossOptions(ignore_index, label_smoothing, reduction, softcap, 0.0)
    rows, flat_target = chunked.token_rows(hidden, target)
    # Every target is counted and range-checked before anything is written: a ValueError in the interpreter
    # (hidden left intact), NaN loss and gradients on the GPU, where the counts stay on the device (check_target).
    # The count kernel also writes valid (1, NaN for a target out of range) and the mean's divisor, max(kept, 1)
    # (NaN likewise): each a view of one small buffer rather than a few more ops per call.
    factors = torch.empty(2, dtype=torch.float32, device=rows.device)
    counts = check_target(target, hidden.shape[:-1], weight.shape[0], ignore_index, factors=factors)
    valid, divisor = factors.unbind()
    per_token = reduction == "none"
    losses = loss.view(-1) if per_token else torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    divide, grad_scale, kept_factor = False, 1.0, None
    if reduction == "mean":
        divide, grad_scale, kept_factor = chunked.mean_over_kept(divisor, rows.shape[0], rows.dtype)
    owed.copy_(valid if kept_factor is None else kept_factor)  # the divisor carries valid's NaN into kept_factor
    grads = chunked.ChunkGrads.asked(needs, grad_hidden.view(rows.shape) if needs[0] else None, grad_weight, grad_bias)
    chunk = chunk_rows(rows, weight, chunk_tokens, needs[0] and grad_hidden is not hidden)
    step = _cross_entropy_chunk(flat_target, losses, options, counts=counts, divide=divide)
    chunked.chunked_linear_loss(rows, weight, step, chunk=chunk, grads=grads, bias=bias, grad_scale=grad_scale)
    if per_token:
        losses.mul_(valid)
    elif reduction == "mean":
        torch.div(losses.sum(), divisor, out=loss)
    else:
        torch.mul(losses.sum(), valid, out=loss)


def _backward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    grad_loss: torch.Tensor, ignore_index: int, label_smoothing: float, softcap: float | None,
    chunk_tokens: int | None, accumulation: str, needs: list[bool], grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor, grad_bias: torch.Tensor,
) -> None:  # fmt: skip
    """reduction="none": the chunk loop again with one upstream gradient per token folded into dz (dW needs it
    inside the sum over tokens), into the gradient buffers ``needs`` asks for."""
    options = LossOptions(ignore_index, label_smoothing, "none", softcap, 0.0)
    rows, flat_target = chunked.token_rows(hidden, target)
    losses = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    # contiguous(): the kernel reads one scale per row, and loss.sum().backward() hands over an
    # expanded (stride 0) gradient.
    row_scale = grad_loss.reshape(-1).float().contiguous()
    grads = chunked.ChunkGrads.asked(needs, grad_hidden, grad_weight, grad_bias)
    chunked.chunked_linear_loss(
        rows, weight, _cross_entropy_chunk(flat_target, losses, options, row_scale),
        chunk=chunk_rows(rows, weight, chunk_tokens, needs[0]), grads=grads, bias=bias,
    )  # fmt: skip
    # The forward's range check again, on the device: a target out of range makes every gradient NaN, as it made
    # the forward's losses (the interpreter raised there already). In place, skipped on the GPU when valid is 1.
    valid = nan_if_out_of_range(count_targets(flat_target, weight.shape[0], ignore_index))
    for grad in (grads.hidden, grads.weight):
        if grad is not None:
            scale_rows(grad, valid)
    if grads.bias is not None:
        grads.bias.mul_(valid)


def _loss_like(hidden: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
    return hidden.new_empty(target.shape if reduction == "none" else (), dtype=torch.float32)


FUSED_LINEAR_CROSS_ENTROPY = define(
    "fused_linear_cross_entropy", _forward, outputs={"loss": _loss_like, **chunked.grad_outputs()},
    in_place={"grad_hidden": "hidden"},
)  # fmt: skip
FUSED_LINEAR_CROSS_ENTROPY_BACKWARD = define(
    "fused_linear_cross_entropy_backward", _backward, outputs=chunked.grad_outputs(owed=False)
)
_LOSS = chunked.FusedLoss("fused_linear_cross_entropy", FUSED_LINEAR_CROSS_ENTROPY, bias_at=3)


class PerTokenLossFunction(torch.autograd.Function):
    """Autograd of reduction="none": the upstream gradient is one number per token, which dW needs inside the sum
    over tokens, so the forward computes only the losses and the backward runs the chunk loop again with the
    upstream gradients folded into dz (``liger_lab::fused_linear_cross_entropy_backward``)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, arguments):
        *options, needs = arguments
        ctx.save_for_backward(hidden, weight, target, bias)
        ctx.options, ctx.head = options, chunked.Head(hidden.shape, weight.dtype, tuple(needs))
        return FUSED_LINEAR_CROSS_ENTROPY(hidden, weight, target, bias, *options, [False] * 3)[0]

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_second_derivative("fused_linear_cross_entropy")
        hidden, weight, target, bias = ctx.saved_tensors
        ignore_index, label_smoothing, _, softcap, chunk_tokens, accumulation = ctx.options
        grads = FUSED_LINEAR_CROSS_ENTROPY_BACKWARD(
            hidden, weight, target, bias, grad_loss, ignore_index, label_smoothing, softcap, chunk_tokens,
            accumulation, list(ctx.head.needs),
        )  # fmt: skip
        grad_h, grad_w, grad_b = chunked.finish_grads(chunked.Grads(*grads), ctx.head, None)
        return grad_h, grad_w, None, grad_b, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    chunk_tokens: int | None = None,
    accumulation: str | None = None,
    loss_dtype: torch.dtype = torch.float32,
    in_place_backward: bool = False,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without ever holding the N x V logits.

    hidden (..., H), weight (V, H) (an ``lm_head`` weight, possibly tied to the input embedding: its
    gradient is returned like any other and autograd adds the embedding's), target (...) class
    indices, bias (V,) or None. Options as :func:`liger_lab.cross_entropy`.

    The loss is computed in fp32 and returned as ``loss_dtype`` (default float32, like Hugging Face's
    upcast loss: a bf16 loss would round 12.16 to 12.19). ``chunk_tokens`` overrides the chunk size derived
    from :data:`CHUNK_BUDGET_BYTES`; ``accumulation`` ("auto", "fp32", "weight_dtype"; default
    :data:`liger_lab.ops.chunked.ACCUMULATION`) picks how dW is summed over chunks. Gradients are computed in the
    forward (see the module docstring), so the graph can be backpropagated once; with ``reduction="none"`` the
    backward recomputes the logits instead. The caller's tensors are never modified by default. A target out of
    range raises ValueError in the interpreter; on the GPU, which checks it without making the host wait, the loss
    and the gradients come out NaN.

    ``in_place_backward=True`` writes the gradient of ``hidden`` over ``hidden`` during the forward, each
    chunk's rows once that chunk has read them for the last time: no N x H gradient buffer (64 MiB at
    8192 x 4096 bf16). For a ``hidden`` that nothing else reads afterwards, such as a causal LM's final
    norm output (``liger_lab.patch`` passes it so). After the call ``hidden`` holds ``dloss/dhidden``; an
    ``nn.Parameter`` is never overwritten, and a node that saved ``hidden`` for its own backward raises
    autograd's "modified by an inplace operation" error instead of going wrong. Under ``torch.compile``
    the option changes nothing: the compiler plans the buffers itself.
    """
    options = LossOptions(ignore_index, float(label_smoothing), reduction, softcap, 0.0)
    check_loss_options(options)
    chunked.check_head(hidden, weight, bias)
    accumulation = check_chunk_options("chunk_tokens", chunk_tokens, accumulation)
    if not isinstance(loss_dtype, torch.dtype) or not loss_dtype.is_floating_point:
        raise ValueError(f"loss_dtype is {loss_dtype!r}: expected a floating torch.dtype such as torch.float32")
    check_target_tensor(target, hidden.shape[:-1])
    needs = chunked.needed_grads(hidden, weight, bias)
    softcap = None if softcap is None else float(softcap)
    arguments = (ignore_index, options.label_smoothing, reduction, softcap, chunk_tokens, accumulation, needs)
    if reduction == "none" and any(needs):
        loss = PerTokenLossFunction.apply(hidden, weight, target, bias, arguments)
    else:
        in_place = in_place_requested(in_place_backward) and needs[0] and rows_to_overwrite(hidden) is not None
        loss = chunked.run_loss(_LOSS, (hidden, weight, target, bias), arguments, in_place=bool(in_place))
    return loss.to(loss_dtype)
