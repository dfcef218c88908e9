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

**Chunk size.** The chunk's logits cost ``C * V * itemsize`` bytes (bf16: 2 bytes; the kernel works in
fp32 registers, never an fp32 copy). :data:`CHUNK_BUDGET_BYTES` bounds the op's temporaries: the chunk
of logits, plus the N x H hidden gradient unless ``in_place_backward`` writes it over ``hidden``. ``C``
is the largest multiple of 64 tokens that fits (at least 64 tokens, at most N). Bigger chunks keep the
three matmuls near peak; smaller chunks cost less memory. At N = 8192, H = 4096, V = 128256, bf16, dW
itself is 1002 MiB and the default 240 MiB budget gives C = 960 with ``in_place_backward`` (235 MiB of
logits, 9 chunks) and C = 704 without (172 MiB, plus 64 MiB for dh): about 1.21 GiB above the inputs
either way. Measured on an H200 (benchmarks/notes/fused_linear_cross_entropy.md), 960 tokens per chunk
take 39.5 ms where 768 take 41.8.

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

import functools

import torch

from liger_lab.ops.common import check_float, rows_to_overwrite
from liger_lab.ops.cross_entropy import (
    LossOptions,
    check_loss_options,
    check_target,
    cross_entropy_rows,
    reduce_loss,
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


def accumulation_dtype(weight: torch.Tensor, accumulation: str) -> torch.dtype:
    """The dtype dW is summed in over chunks (see the module docstring)."""
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation is {accumulation!r}: expected one of {ACCUMULATIONS}")
    if accumulation == "auto":
        fits = 4 * weight.numel() <= FP32_ACCUMULATOR_BUDGET_BYTES
        accumulation = "fp32" if weight.dtype == torch.float32 or fits else "weight_dtype"
    return torch.float32 if accumulation == "fp32" else weight.dtype


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


def _accumulate_weight_grad(acc: torch.Tensor, dz_t: torch.Tensor, h: torch.Tensor, scale: float, first: bool) -> None:
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


def _chunk_loop(
    hidden, weight, bias, target, loss, options, *,
    chunk, grads, grad_scale=1.0, row_scale=None, grad_h_over_hidden=False,
):  # fmt: skip
    """Run every chunk: per-token fp32 losses into ``loss``; when ``grads`` (need_h, need_w, need_b,
    acc_dtype) is given, also the gradients, scaled by ``grad_scale`` (and ``row_scale`` per token).
    Returns (dh, dW accumulator, db fp32), None where not needed. ``grad_h_over_hidden`` writes dh
    into ``hidden`` itself, each chunk's rows once that chunk has done reading them.

    The kernel writes the unscaled dz; ``grad_scale`` (1 / tokens for a mean) rides on the matmuls'
    alpha for free. Folding it into dz instead would underflow fp16 (p / n ~ 1e-9 for n = 8192 tokens
    and a 128k vocabulary; fp16 stops at 6e-8)."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    need_h, need_w, need_b, acc_dtype = grads or (False, False, False, None)
    write_grad = need_h or need_w or need_b
    logits = torch.empty(min(chunk, n_tokens), vocab, dtype=hidden.dtype, device=hidden.device)
    grad_h = None
    if need_h:
        grad_h = hidden if grad_h_over_hidden else torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    grad_w = None
    if need_w:  # the first chunk overwrites dW; with no tokens at all nothing does, so start from zero
        grad_w = (torch.zeros if n_tokens == 0 else torch.empty)(weight.shape, dtype=acc_dtype, device=weight.device)
    grad_b = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if need_b else None
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        h, z = hidden[start:end], logits[: end - start]
        if bias is None:
            torch.mm(h, weight.t(), out=z)
        else:
            torch.addmm(bias, h, weight.t(), out=z)
        scale = None if row_scale is None else row_scale[start:end]
        cross_entropy_rows(z, target[start:end], loss[start:end], options, write_grad=write_grad, row_scale=scale)
        if need_w:
            _accumulate_weight_grad(grad_w, z.t(), h, grad_scale, first=start == 0)
        if need_b:
            grad_b.add_(z.sum(dim=0, dtype=torch.float32), alpha=grad_scale)
        if need_h:  # last: with grad_h_over_hidden it overwrites h, which the dW product has just read
            torch.addmm(grad_h[start:end], z, weight, beta=0, alpha=grad_scale, out=grad_h[start:end])
    return grad_h, grad_w, grad_b


def _can_write_over(hidden: torch.Tensor, needs: tuple[bool, bool, bool], reduction: str) -> bool:
    """Whether dh may go over ``hidden``: only for gradients made in the forward (reduction="none" reads
    hidden again in the backward), and only where :func:`rows_to_overwrite` allows."""
    return needs[0] and reduction != "none" and rows_to_overwrite(hidden) is not None


def _token_rows(hidden: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, H) hidden states and (tokens,) contiguous targets."""
    return hidden.reshape(hidden.shape[:-1].numel(), hidden.shape[-1]), target.reshape(-1).contiguous()


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, options, n_valid, needs, chunk, acc_dtype, loss_dtype, in_place):
        rows, flat_target = _token_rows(hidden, target)
        loss = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        precompute = any(needs) and options.reduction != "none"
        grads = (*needs, acc_dtype) if precompute else None
        grad_scale = 1.0 / max(n_valid, 1) if options.reduction == "mean" else 1.0
        ctx.grads = _chunk_loop(
            rows, weight, bias, flat_target, loss, options, chunk=chunk, grads=grads, grad_scale=grad_scale,
            grad_h_over_hidden=in_place,
        )  # fmt: skip
        if in_place:
            # hidden now holds its gradient: a later reader that saved it gets autograd's "modified by an
            # inplace operation" error instead of computing with a gradient as if it were an activation.
            torch.autograd.graph.increment_version(hidden)
        ctx.options, ctx.needs, ctx.chunk, ctx.acc_dtype = options, needs, chunk, acc_dtype
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        if any(needs) and not precompute:  # reduction="none": the backward runs the loop again
            ctx.save_for_backward(hidden, weight, bias, target)
        return reduce_loss(loss, options.reduction, n_valid, loss_dtype, target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.options.reduction == "none":
            hidden, weight, bias, target = ctx.saved_tensors
            rows, flat_target = _token_rows(hidden, target)
            loss = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
            # contiguous(): the kernel reads one scale per row, and loss.sum().backward() hands over an
            # expanded (stride 0) gradient.
            row_scale = grad_loss.reshape(-1).float().contiguous()
            grad_h, grad_w, grad_b = _chunk_loop(
                rows, weight, bias, flat_target, loss, ctx.options, chunk=ctx.chunk,
                grads=(*ctx.needs, ctx.acc_dtype), row_scale=row_scale,
            )  # fmt: skip
        else:
            if ctx.grads is None:
                raise RuntimeError(
                    "liger_lab.fused_linear_cross_entropy: backward ran twice through one forward; its gradients "
                    "are computed in the forward and handed over once (no retain_graph)"
                )
            (grad_h, grad_w, grad_b), ctx.grads = ctx.grads, None
            if grad_h is not None:
                scale_rows(grad_h, grad_loss)
            if grad_w is not None and grad_w.dtype == ctx.weight_dtype:
                scale_rows(grad_w, grad_loss)
            elif grad_w is not None:  # the fp32 accumulator: scale and round in one pass
                grad_w = scale_rows(grad_w, grad_loss, out=torch.empty_like(grad_w, dtype=ctx.weight_dtype))
            if grad_b is not None:
                grad_b = grad_b * grad_loss.float()
        grad_w = None if grad_w is None else grad_w.to(ctx.weight_dtype)
        grad_b = None if grad_b is None else grad_b.to(ctx.weight_dtype)
        # detach(): a fresh tensor object over hidden's memory, so a leaf's .grad is never the leaf itself
        grad_h = None if grad_h is None else grad_h.view(ctx.hidden_shape).detach()
        return grad_h, grad_w, None, grad_b, None, None, None, None, None, None, None


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
    loss_dtype: torch.dtype | None = None,
    in_place_backward: bool = False,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without ever holding the N x V logits.

    hidden (..., H), weight (V, H) (an ``lm_head`` weight, possibly tied to the input embedding: its
    gradient is returned like any other and autograd adds the embedding's), target (...) class
    indices, bias (V,) or None. Options as :func:`liger_lab.cross_entropy`. Returns hidden's dtype.

    ``chunk_tokens`` overrides the chunk size derived from :data:`CHUNK_BUDGET_BYTES`;
    ``accumulation`` ("auto", "fp32", "weight_dtype"; default :data:`ACCUMULATION`) picks how dW is
    summed over chunks. ``loss_dtype`` (default: hidden's dtype, like the reference) is the dtype of the
    returned loss, which is computed in fp32 either way: training code that logs the loss, as Hugging
    Face's does in fp32, passes ``torch.float32`` to skip a rounding to bf16 (12.16 becomes 12.19).
    Gradients are computed in the forward (see the module docstring), so the graph
    can be backpropagated once; with ``reduction="none"`` the backward recomputes the logits instead.

    ``in_place_backward=True`` writes the gradient of ``hidden`` over ``hidden`` during the forward, each
    chunk's rows once that chunk has read them for the last time: no N x H gradient buffer (64 MiB at
    8192 x 4096 bf16). For a ``hidden`` that nothing else reads afterwards, such as a causal LM's final
    norm output (``liger_lab.patch`` passes it so). After the call ``hidden`` holds ``dloss/dhidden``; an
    ``nn.Parameter`` is never overwritten, and a node that saved ``hidden`` for its own backward raises
    autograd's "modified by an inplace operation" error instead of going wrong.
    """
    options = LossOptions(ignore_index, float(label_smoothing), reduction, softcap, 0.0)
    check_loss_options(options)
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
    bad_chunk = isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
    if chunk_tokens is not None and bad_chunk:
        raise ValueError(f"chunk_tokens is {chunk_tokens!r}: expected None or a positive int")
    acc_dtype = accumulation_dtype(weight, ACCUMULATION if accumulation is None else accumulation)
    n_valid = check_target(target, hidden.shape[:-1], weight.shape[0], ignore_index)
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    n_tokens = hidden.shape[:-1].numel()
    in_place = bool(in_place_backward) and _can_write_over(hidden, needs, reduction)
    # Without in_place the hidden gradient is a buffer of its own, paid from the same budget.
    hidden_grad_bytes = 0 if in_place or not needs[0] else hidden.numel() * hidden.element_size()
    chunk = chunk_tokens or chunk_tokens_for(n_tokens, weight.shape[0], hidden.dtype, other_bytes=hidden_grad_bytes)
    return FusedLinearCrossEntropyFunction.apply(
        hidden, weight, target, bias, options, n_valid, needs, chunk, acc_dtype, loss_dtype or hidden.dtype, in_place
    )
