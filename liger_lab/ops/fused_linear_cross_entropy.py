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
(:func:`mean_over_kept` says why). So the host never waits for the GPU in forward or backward, and a CUDA graph
captures the whole step. A target out of range is a ValueError in the interpreter, where reading the count
costs nothing; on the GPU it makes the loss and every gradient NaN. The gradient is not differentiable again:
a backward with ``create_graph=True`` raises.

**Chunk size.** The chunk's logits cost ``C * V * itemsize`` bytes (bf16: 2 bytes; the kernel works in
fp32 registers, never an fp32 copy). :data:`CHUNK_BUDGET_BYTES` bounds the op's temporaries: the chunk
of logits, plus the N x H hidden gradient unless ``in_place_backward`` writes it over ``hidden``. ``C``
is the largest multiple of 64 tokens that fits (at least 64 tokens, at most N). Bigger chunks keep the
three matmuls near peak; smaller chunks cost less memory. At N = 8192, H = 4096, V = 128256, bf16, dW
itself is 1002 MiB and the default 240 MiB budget gives C = 960 with ``in_place_backward`` (235 MiB of
logits, 9 chunks) and C = 704 without (172 MiB, plus 64 MiB for dh): about 1.21 GiB above the inputs
either way. Measured on an H200 (benchmarks/notes/fused_linear_cross_entropy.md), 960 tokens per chunk
take 39.5 ms where 768 take 41.8. A patched model's loss bounds its chunk further, by the size of its hidden
states (:func:`chunk_tokens_in_model`): in a training step the chunk adds to every activation alive.

**Accumulating dW.** ``accumulation`` picks the dtype of the running dW sum (module default
:data:`ACCUMULATION`):

- ``"weight_dtype"``: dW is accumulated in the weight's dtype with ``addmm_``. cuBLAS sums each chunk's
  C tokens in fp32 and adds the running sum in fp32, then rounds once: one bf16 rounding per chunk
  (9 to 12 at the shape above; a single unchunked GEMM rounds once). No memory beyond dW itself.
- ``"fp32"``: a separate fp32 accumulator (4 V H bytes: 2.0 GiB at the shape above), rounded to the
  weight's dtype once, in the backward. Exact fp32 accumulation whatever the number of chunks.
- ``"auto"`` (default): ``"fp32"`` when the accumulator costs nothing (fp32 weights) or at most
  :data:`FP32_ACCUMULATOR_BUDGET_BYTES`, else ``"weight_dtype"`` with chunks as large as the budget
  allows, which bounds the number of roundings. The notebook measures the error of each.
"""

from __future__ import annotations

import torch

from liger_lab.ops.chunked import ChunkGrads, ChunkLoss, check_head, chunked_linear_loss
from liger_lab.ops.common import in_place_requested, row_count, rows_to_overwrite
from liger_lab.ops.cross_entropy import (
    LossOptions,
    check_loss_options,
    check_target,
    check_target_tensor,
    count_targets,
    cross_entropy_rows,
    nan_if_out_of_range,
    reduce_loss,
    refuse_second_derivative,
    scale_rows,
)

MIB = 2**20
CHUNK_BUDGET_BYTES = 240 * MIB
"""Bytes of temporaries per call: one chunk of logits, plus the hidden gradient's buffer when it is not
written over ``hidden``. The chunk size in tokens follows from it (see the module docstring)."""
FP32_ACCUMULATOR_BUDGET_BYTES = 512 * MIB
"""Largest fp32 dW accumulator (4 V H bytes) that ``accumulation="auto"`` allocates."""
ACCUMULATION = "auto"
"""Default ``accumulation`` of :func:`fused_linear_cross_entropy`: "auto", "fp32" or "weight_dtype"."""
ACCUMULATIONS = ("auto", "fp32", "weight_dtype")
CHUNK_ALIGN = 64


def chunk_tokens_for(
    n_tokens: int, vocab: int, dtype: torch.dtype, budget: int | None = None, *, other_bytes: int = 0
) -> int:
    """Tokens per chunk: the largest multiple of 64 whose ``C x V`` logits fit in ``budget`` bytes
    (default :data:`CHUNK_BUDGET_BYTES`) less ``other_bytes`` (the hidden gradient's buffer, when there
    is one), at least 64 (smaller matmuls waste the GPU), at most N."""
    budget = (CHUNK_BUDGET_BYTES if budget is None else budget) - other_bytes
    fitting = max(budget, 0) // (vocab * torch.empty((), dtype=dtype).element_size())
    chunk = max(CHUNK_ALIGN, fitting // CHUNK_ALIGN * CHUNK_ALIGN)
    return max(1, min(chunk, n_tokens))


MODEL_CHUNK_HIDDEN_STATES = 2
"""In a patched model's loss, the chunk of logits holds at most this many hidden states' bytes (N x H each)."""


def chunk_tokens_in_model(n_tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype) -> int:
    """Tokens per chunk for the loss of a patched model's training step: :func:`chunk_tokens_for` with the budget
    also capped at :data:`MODEL_CHUNK_HIDDEN_STATES` hidden states.

    The op's own budget is set for the op alone, where bigger chunks are faster. In a training step the loss's
    forward runs while every layer's activations are alive, so its chunk of logits lands on top of the step's
    largest allocation. Bounded by the hidden states, the chunk grows with the batch like the activations do
    (Liger-Kernel's rule gives between one and two hidden states). At 8 x 2048 tokens of a Qwen3-style model
    (H = 2048, V = 151936, bf16) that is 384 tokens (111 MiB) instead of 768 (223 MiB)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    budget = min(CHUNK_BUDGET_BYTES, MODEL_CHUNK_HIDDEN_STATES * n_tokens * hidden_size * itemsize)
    return chunk_tokens_for(n_tokens, vocab, dtype, budget)


def check_chunk_options(name: str, chunk: int | None, accumulation: str | None) -> str:
    """Validate a fused loss's chunk-size keyword ``name`` (None or a positive int) and its ``accumulation``;
    return the accumulation to use (None: :data:`ACCUMULATION`)."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"{name} is {chunk!r}: expected None or a positive int")
    accumulation = ACCUMULATION if accumulation is None else accumulation
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation is {accumulation!r}: expected one of {ACCUMULATIONS}")
    return accumulation


def accumulation_dtype(weight: torch.Tensor, accumulation: str) -> torch.dtype:
    """The dtype dW is summed in over chunks (see the module docstring)."""
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation is {accumulation!r}: expected one of {ACCUMULATIONS}")
    if accumulation == "auto":
        fits = 4 * weight.numel() <= FP32_ACCUMULATOR_BUDGET_BYTES
        accumulation = "fp32" if weight.dtype == torch.float32 or fits else "weight_dtype"
    return torch.float32 if accumulation == "fp32" else weight.dtype


def _cross_entropy_chunk(
    target: torch.Tensor, loss: torch.Tensor, options: LossOptions, row_scale=None, counts=None, divide=False
) -> ChunkLoss:
    """The chunk step of :func:`liger_lab.ops.chunked.chunked_linear_loss` for cross-entropy: the row kernel
    writes each token's fp32 loss into ``loss`` and, when asked, dz over the chunk's logits (times
    ``row_scale``, one upstream gradient per token, for reduction="none"; divided by the kept count of
    ``counts`` on the device when ``divide``: see :func:`mean_over_kept`)."""

    def step(z: torch.Tensor, rows: slice, write_grad: bool) -> None:
        scale = None if row_scale is None else row_scale[rows]
        grad = z if write_grad else None  # dz over z
        cross_entropy_rows(
            z, target[rows], loss[rows], options, grad=grad, row_scale=scale, counts=counts, divide_by_count=divide
        )

    return step


def mean_over_kept(kept: torch.Tensor, n_rows: int, dtype: torch.dtype) -> tuple[bool, float, torch.Tensor]:
    """A mean's 1 / kept when only the device knows ``kept`` (a count it made: reading it back would make the host
    wait for the GPU every step, and no CUDA graph could hold the step). Returns (whether the row kernel divides dz
    by the count, in fp32 before rounding dz to ``dtype``; the matmuls' ``grad_scale``; the fp32 factor on the
    device that the gradients still owe, which the backward multiplies in with the upstream gradient: one pass,
    skipped on the GPU when the product is exactly 1).

    fp32 divides in the kernel and owes nothing. The half types cannot: fp16 because p / kept ~ 1e-9 for 8192
    tokens over a 128k vocabulary underflows (fp16 stops at 6e-8); bf16 because the large entries of dz share one
    value, -1 / kept at each target of a cross-entropy (and at a confident teacher's token in a distillation
    loss), rounded alike to 8 bits for every token, which scales that part of the gradient by up to 1 +- 2**-9
    (dividing in the kernel made |dW| 0.19% larger on the H200, 2048 x 4096 x 128256 with 1536 tokens kept),
    where -1 itself is exact. Their dz stays unscaled, the matmuls take 1 / n_rows (known from the shapes; it
    keeps the dW sum as small as before) and the gradients owe n_rows / kept, exactly 1 when no row is ignored:
    then the backward's pass is skipped as before, otherwise it costs one in-place pass over dW and dh unless
    the upstream gradient needed one anyway."""
    if dtype == torch.float32:
        return True, 1.0, torch.ones((), dtype=torch.float32, device=kept.device)
    return False, 1.0 / max(n_rows, 1), n_rows / kept.clamp(min=1).to(torch.float32)


def _token_rows(hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, H) hidden states and (tokens,) contiguous targets."""
    return hidden.reshape(hidden.shape[:-1].numel(), hidden.shape[-1]), target.reshape(-1).contiguous()


def _forward(
    hidden, weight, target, bias, options, chunk_tokens, accumulation, needs, *, grad_h_over_hidden=False
):  # fmt: skip
    """The op's work: (fp32 loss reduced as asked, dh or None, dW accumulator or None, db fp32 or None, the fp32
    factor the gradients still owe). Gradients are made here except for reduction="none", whose backward runs
    the loop again."""
    rows, flat_target = _token_rows(hidden, target)
    # Every target is counted and range-checked before anything is written: a ValueError in the interpreter
    # (hidden left intact), NaN loss and gradients on the GPU, where the counts stay on the device (check_target).
    counts = check_target(target, hidden.shape[:-1], weight.shape[0], options.ignore_index)
    valid = nan_if_out_of_range(counts)
    loss = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    precompute = any(needs) and options.reduction != "none"
    divide, grad_scale, owed = False, 1.0, valid
    if options.reduction == "mean":
        divide, grad_scale, owed = mean_over_kept(counts[0], rows.shape[0], rows.dtype)
        owed = owed * valid
    chunk = _chunk(rows, weight, chunk_tokens, needs[0] and precompute and not grad_h_over_hidden)
    grads = ChunkGrads(*needs, accumulation_dtype(weight, accumulation), hidden_over_input=grad_h_over_hidden)
    grads = chunked_linear_loss(
        rows, weight, _cross_entropy_chunk(flat_target, loss, options, counts=counts, divide=divide), chunk=chunk,
        grads=grads if precompute else None, bias=bias, grad_scale=grad_scale,
    )  # fmt: skip
    return reduce_loss(loss, options.reduction, counts[0], target.shape) * valid, *grads, owed


def _chunk(rows: torch.Tensor, weight: torch.Tensor, chunk_tokens: int | None, separate_grad_h: bool) -> int:
    """The caller's chunk size, or the one the budget allows (less the hidden gradient's own buffer)."""
    if chunk_tokens is not None:
        return chunk_tokens
    other = rows.numel() * rows.element_size() if separate_grad_h else 0
    return chunk_tokens_for(rows.shape[0], weight.shape[0], rows.dtype, other_bytes=other)


def _or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Operators return tensors, never None: a gradient nobody asked for is an empty tensor."""
    return like.new_empty(0) if grad is None else grad


def _empty_grads_like(hidden, weight, bias, accumulation, needs, *, with_hidden=True):
    """The fake (shape-only) gradients of :func:`_forward`, as the operators return them."""
    grad_h = hidden.new_empty(row_count(hidden), hidden.shape[-1]) if needs[0] else hidden.new_empty(0)
    grad_w = weight.new_empty(weight.shape, dtype=accumulation_dtype(weight, accumulation)) if needs[1] else None
    grad_b = weight.new_empty(weight.shape[0], dtype=torch.float32) if needs[2] else None
    grads = (grad_h,) if with_hidden else ()
    return (*grads, _or_empty(grad_w, weight), _or_empty(grad_b, weight))


def _loss_like(hidden: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
    return hidden.new_empty(target.shape if reduction == "none" else (), dtype=torch.float32)


def _owed_like(hidden: torch.Tensor) -> torch.Tensor:
    """The fake of the fp32 factor the gradients still owe (see :func:`mean_over_kept`)."""
    return hidden.new_empty((), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# PyTorch operators (see liger_lab/ops/rms_norm.py). The default op returns the gradients it made in
# the forward; the in-place variant, which writes dh over hidden, is a mutating op. Their autograd is
# FusedLinearCrossEntropyFunction below.


@torch.library.custom_op("liger_lab::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    chunk_tokens: int | None,
    accumulation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 loss, dh (tokens, H), dW accumulator, db fp32, the fp32 factor the gradients still owe); a gradient
    not in ``needs`` (hidden, weight, bias), or every gradient for reduction="none", is an empty tensor."""
    options = LossOptions(ignore_index, label_smoothing, reduction, softcap, 0.0)
    loss, grad_h, grad_w, grad_b, owed = _forward(
        hidden, weight, target, bias, options, chunk_tokens, accumulation, needs
    )
    return loss, _or_empty(grad_h, hidden), _or_empty(grad_w, weight), _or_empty(grad_b, weight), owed


@fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, chunk_tokens, accumulation,
      needs):  # fmt: skip
    needs = needs if reduction != "none" else [False] * 3
    grads = _empty_grads_like(hidden, weight, bias, accumulation, needs)
    return _loss_like(hidden, target, reduction), *grads, _owed_like(hidden)


@torch.library.custom_op("liger_lab::fused_linear_cross_entropy_", mutates_args=("hidden",))
def fused_linear_cross_entropy_in_place_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    chunk_tokens: int | None,
    accumulation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 loss, dW accumulator, db fp32, owed factor), dh written over ``hidden`` (needs[0] must be set,
    reduction "mean" or "sum", hidden overwritable row by row)."""
    options = LossOptions(ignore_index, label_smoothing, reduction, softcap, 0.0)
    loss, _, grad_w, grad_b, owed = _forward(
        rows_to_overwrite(hidden),
        weight,
        target.reshape(-1),
        bias,
        options,
        chunk_tokens,
        accumulation,
        needs,
        grad_h_over_hidden=True,
    )
    return loss, _or_empty(grad_w, weight), _or_empty(grad_b, weight), owed


@fused_linear_cross_entropy_in_place_op.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, chunk_tokens, accumulation,
      needs):  # fmt: skip
    grads = _empty_grads_like(hidden, weight, bias, accumulation, needs, with_hidden=False)
    return _loss_like(hidden, target, reduction), *grads, _owed_like(hidden)


@torch.library.custom_op("liger_lab::fused_linear_cross_entropy_backward", mutates_args=())
def fused_linear_cross_entropy_backward_op(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    chunk_tokens: int | None,
    accumulation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none": the chunk loop again with one upstream gradient per token folded into dz (dW
    needs it inside the sum over tokens). Returns (dh, dW accumulator, db fp32), empty where not needed."""
    options = LossOptions(ignore_index, label_smoothing, "none", softcap, 0.0)
    rows, flat_target = _token_rows(hidden, target)
    loss = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    # contiguous(): the kernel reads one scale per row, and loss.sum().backward() hands over an
    # expanded (stride 0) gradient.
    row_scale = grad_loss.reshape(-1).float().contiguous()
    grad_h, grad_w, grad_b = chunked_linear_loss(
        rows, weight, _cross_entropy_chunk(flat_target, loss, options, row_scale),
        chunk=_chunk(rows, weight, chunk_tokens, needs[0]),
        grads=ChunkGrads(*needs, accumulation_dtype(weight, accumulation)), bias=bias,
    )  # fmt: skip
    # The forward's range check again, on the device: a target out of range makes every gradient NaN, as it made
    # the forward's losses (the interpreter raised there already). In place, skipped on the GPU when valid is 1.
    valid = nan_if_out_of_range(count_targets(flat_target, weight.shape[0], ignore_index))
    for grad in (grad_h, grad_w):
        if grad is not None:
            scale_rows(grad, valid)
    if grad_b is not None:
        grad_b.mul_(valid)
    return _or_empty(grad_h, hidden), _or_empty(grad_w, weight), _or_empty(grad_b, weight)


@fused_linear_cross_entropy_backward_op.register_fake
def _(grad_loss, hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_tokens, accumulation,
      needs):  # fmt: skip
    return _empty_grads_like(hidden, weight, bias, accumulation, needs)


@torch.library.custom_op("liger_lab::scale_rows", mutates_args=())
def scale_rows_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale, rounded to ``dtype`` in the same pass (the fp32 dW accumulator to the weight's dtype)."""
    return scale_rows(x, scale, out=torch.empty_like(x, dtype=dtype))


scale_rows_op.register_fake(lambda x, scale, dtype: torch.empty_like(x, dtype=dtype))


def finish_grads(grad_h, grad_w, grad_b, grad_loss, ctx, owed=None):
    """Gradients made in the forward, times the upstream gradient and the factor they still ``owed`` (an fp32
    scalar on the device, or None: :func:`mean_over_kept`), in the inputs' dtypes and shapes. Scaling happens in
    place, one pass skipped on the GPU when the product is exactly 1 (a plain ``loss.backward()``, nothing owed)."""
    needs_h, needs_w, needs_b = ctx.needs
    scale = grad_loss.float() if owed is None else grad_loss.float() * owed
    if needs_h:
        torch.ops.liger_lab.scale_rows_(grad_h, scale)
        grad_h = grad_h.view(ctx.hidden_shape)
    if needs_w and grad_w.dtype == ctx.weight_dtype:
        torch.ops.liger_lab.scale_rows_(grad_w, scale)
    elif needs_w:  # the fp32 accumulator: scale and round in one pass
        grad_w = torch.ops.liger_lab.scale_rows(grad_w, scale, ctx.weight_dtype)
    if needs_b:
        grad_b = (grad_b * scale).to(ctx.weight_dtype)
    return (grad_h if needs_h else None), (grad_w if needs_w else None), (grad_b if needs_b else None)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd of the three operators. The gradients are made in the forward and the backward scales them
    in place by the upstream gradient, which is why this is an ``autograd.Function`` (traced by
    torch.compile like any other code) and not a formula registered on the operator: PyTorch's registered
    formulas may not modify an operator's outputs. reduction="none" runs the chunk loop in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, arguments, in_place):
        *_, reduction, _, _, _, needs = arguments
        ctx.needs, ctx.hidden_shape, ctx.weight_dtype, ctx.reduction = (
            tuple(needs),
            hidden.shape,
            weight.dtype,
            reduction,
        )
        if in_place:
            loss, grad_w, grad_b, owed = torch.ops.liger_lab.fused_linear_cross_entropy_(
                hidden, weight, target, bias, *arguments
            )
            # hidden now holds its gradient (the op bumped its version: a node that saved it for its own
            # backward gets "modified by an inplace operation" instead of using a gradient). Saved
            # detached: the gradient is data now, not a node of the graph that made hidden.
            grads = (hidden.detach(), grad_w, grad_b)
        else:
            loss, *grads, owed = torch.ops.liger_lab.fused_linear_cross_entropy(
                hidden, weight, target, bias, *arguments
            )
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target, bias)
            ctx.arguments = tuple(a for i, a in enumerate(arguments) if i != 2)  # all but the reduction
        else:
            # Scaling in place bumps the gradients' versions: a second backward through the same graph
            # fails with "modified by an inplace operation" instead of scaling them twice.
            ctx.save_for_backward(*grads, owed)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_second_derivative("fused_linear_cross_entropy")
        if ctx.reduction == "none":
            hidden, weight, target, bias = ctx.saved_tensors
            grad_h, grad_w, grad_b = torch.ops.liger_lab.fused_linear_cross_entropy_backward(
                grad_loss, hidden, weight, target, bias, *ctx.arguments
            )
            grad_h = grad_h.view(ctx.hidden_shape) if ctx.needs[0] else None
            grad_w = grad_w.to(ctx.weight_dtype) if ctx.needs[1] else None
            grad_b = grad_b.to(ctx.weight_dtype) if ctx.needs[2] else None
        else:
            *grads, owed = ctx.saved_tensors
            grad_h, grad_w, grad_b = finish_grads(*grads, grad_loss, ctx, owed)
        # detach(): a fresh tensor object, so a leaf's .grad is never the leaf itself (in place: its memory)
        return None if grad_h is None else grad_h.detach(), grad_w, None, grad_b, None, None


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
    :data:`ACCUMULATION`) picks how dW is summed over chunks. Gradients are computed in the forward (see
    the module docstring), so the graph can be backpropagated once; with ``reduction="none"`` the
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
    check_head(hidden, weight, bias)
    accumulation = check_chunk_options("chunk_tokens", chunk_tokens, accumulation)
    if not isinstance(loss_dtype, torch.dtype) or not loss_dtype.is_floating_point:
        raise ValueError(f"loss_dtype is {loss_dtype!r}: expected a floating torch.dtype such as torch.float32")
    check_target_tensor(target, hidden.shape[:-1])
    grad_on = torch.is_grad_enabled()
    needs = [
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    ]
    softcap = None if softcap is None else float(softcap)
    arguments = (ignore_index, options.label_smoothing, reduction, softcap, chunk_tokens, accumulation, needs)
    if any(needs):
        in_place = (
            in_place_requested(in_place_backward)
            and needs[0]
            and reduction != "none"
            and rows_to_overwrite(hidden) is not None
        )
        loss = FusedLinearCrossEntropyFunction.apply(hidden, weight, target, bias, arguments, bool(in_place))
    else:
        loss = torch.ops.liger_lab.fused_linear_cross_entropy(hidden, weight, target, bias, *arguments)[0]
    return loss.to(loss_dtype)
