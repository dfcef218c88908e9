r"""The RL head: per-token log-probabilities (and entropies) of ``hidden @ weight.T`` without the logits.

Rollout scoring, reference log-probabilities and every policy-gradient loss (GRPO and its family,
:mod:`liger_lab.ops.grpo`) need, for each token, the log-probability of the token that was sampled, often with
the entropy of the distribution it was sampled from, under a temperature T::

    z    = (h @ W.T + b) / T                       # one row of logits (V of them), never held for all N rows
    logp = log_softmax(z)[target] = z_t - lse(z)
    H    = -sum_j p_j log p_j,  p = softmax(z)     # both 0 where target == ignore_index

This is what TRL's fused LM head computes (``trl.trainer.utils.add_fused_lm_head``, ``trl/kernels/chunked_logprob.py``).

**Forward.** The chunk loop of :mod:`liger_lab.ops.chunked` makes C rows of raw logits at a time; one program per
tile of rows walks each row once in blocks, with the online log-sum-exp (as in :mod:`liger_lab.ops.logsumexp`) on
x = z / T: a running max m of the raw logits and a running sum s of e_j = exp(y_j), y_j = (z_j - m) / T. The entropy
needs one more running sum, u = sum_j e_j y_j; when a block raises the max from m to m', every old y moves by
d = (m - m') / T and every old e is scaled by exp(d), so ``u <- exp(d) (u + d s)``. At the end, with
log p_j = y_j - log s::

    logp = (z_t - m) / T - log s          H = log s - u / s

Both are differences of numbers of order log V, never of the raw logits (which may be in the thousands). One more
care: s is kept as ``ties + rest``, the count of logits equal to the max (each adds exactly 1) and the sum over
the others, and ``log s = log(ties) + log1p(rest / ties)``. A near-certain row has s = 1 + rest with rest below
fp32's resolution of 1 (2**-24), where a plain ``log s`` is 0 and H = rest (1 + Delta) (Delta the gap to the
runner-up logit) would keep only the u term: a relative error of 1 / (1 + Delta), 5% at H = 1e-8 (seen on the
GPU). Split, logp and H keep their relative precision however confident the row. The kernel keeps (m, log s) per
row, 8 bytes, for the backward.

**Backward.** Both outputs may carry any upstream gradients g (for logp) and k (for H), per token: a loss may weigh
the log-probabilities by advantages and add an entropy bonus. With x = z / T::

    d logp / d x_j = [j == t] - p_j
    d H / d x_j    = -sum_i (d p_i / d x_j)(log p_i + 1) = -p_j (log p_j + 1) + p_j sum_i p_i (log p_i + 1)
                   = -p_j (log p_j + H)
    d loss / d z_j = (g ([j == t] - p_j) - k p_j (log p_j + H)) / T

which a second kernel writes over the chunk's recomputed logits, from the saved (m, log s) and H. The gradient
depends on g and k *inside* the sums over tokens of dW = dz^T h and db = sum dz, so nothing can be made before the
upstream gradients exist: the forward is one matmul per chunk (the logits), the backward three (the logits again,
dW, dh): 4 matmuls in all, 8 N H V FLOPs, as the fused cross-entropy's ``reduction="none"``. Ignored rows read
nothing and get exact zeros. dW is summed over chunks as in :mod:`liger_lab.ops.fused_linear_cross_entropy`
(``accumulation``).

**Memory.** One chunk of C x V logits (the fused cross-entropy's rule: :func:`liger_lab.ops.fused_linear_cross_entropy
.chunk_rows`, whose budget benchmarks/notes/fused_linear_cross_entropy.md measures), the outputs and 8 bytes per token
of statistics; the backward adds the N x H hidden gradient and dW.

**Nothing is read back.** No ``.item()`` or ``.tolist()`` on the GPU path: the host never waits for the GPU, and
counts stay device tensors. The targets are range-checked by a small kernel
(:func:`liger_lab.ops.cross_entropy.check_target`): a ValueError in the interpreter, where reading its count costs
nothing; on the GPU the forward kernel reads the count itself and a target out of range makes every output NaN, and
so every gradient, through the NaN statistics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from liger_lab import runtime
from liger_lab.ops import chunked
from liger_lab.ops.cross_entropy import LossOptions, check_loss_options, check_target, check_target_tensor
from liger_lab.ops.fused_linear_cross_entropy import chunk_rows
from liger_lab.ops.operators import define


@triton.jit
def _log1p(x):
    """log(1 + x) to a few ulps for x >= 0 with ``tl.log`` alone (no libdevice): log(w) x / (w - 1), w = 1 + x,
    divides out the rounding of w (Goldberg's trick); x itself where w rounds to 1."""
    w = 1.0 + x
    return tl.where(w == 1.0, x, tl.log(w) * (x / tl.where(w == 1.0, 1.0, w - 1.0)))


@triton.jit
def _logprobs_kernel(
    z_ptr, z_row_stride, target_ptr, logp_ptr, entropy_ptr, stats_ptr, counts_ptr, n_rows, n_cols, ignore_index,
    inv_temperature, ENTROPY: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Per row: logp of the target, H when ENTROPY, and the statistics (m, log s) at stats[2 r], stats[2 r + 1];
    all NaN when check_target's counts (counts[1]) found a target out of range anywhere."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    # A row whose target is out of range is skipped (never read out of bounds); the NaN below reports it.
    valid = row_mask & (target != ignore_index) & (target >= 0) & (target < n_cols)
    row_ptr = z_ptr + rows.to(tl.int64) * z_row_stride  # int64: 16k rows x 128k columns passes 2**31
    cols = tl.arange(0, BLOCK_N)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    ties = tl.zeros([ROWS], tl.float32)  # how many logits equal the running max m (each adds exactly 1 to s)
    rest = tl.zeros([ROWS], tl.float32)  # s - ties: the sum of exp((z - m) / T) over the logits below m
    u = tl.zeros([ROWS], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = valid[:, None] & ((start + cols) < n_cols)[None, :]
        z = tl.load(row_ptr[:, None] + (start + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: no -inf - -inf
        rescale = tl.exp((m - shift) * inv_temperature)
        y = tl.where(mask, (z - shift[:, None]) * inv_temperature, 0.0)
        e = tl.where(mask, tl.exp(y), 0.0)
        at_max = mask & (z == m_new[:, None])
        if ENTROPY:  # before ties and rest move: s_old = ties + rest, and the old y move by (m - m_new) / T
            moved = tl.where(m == float("-inf"), 0.0, (m - shift) * inv_temperature)
            u = rescale * (u + moved * (ties + rest)) + tl.sum(e * y, axis=1)
        raised = m_new > m  # the old max logits fall below the new one: they join the rest, scaled
        rest = tl.where(raised, rescale * (rest + ties), rest) + tl.sum(tl.where(at_max, 0.0, e), axis=1)
        ties = tl.where(raised, 0.0, ties) + tl.sum(at_max.to(tl.float32), axis=1)
        m = m_new
    m = tl.where(valid, m, 0.0)
    ties = tl.where(valid, ties, 1.0)
    rest = tl.where(valid, rest, 0.0)
    log_s = tl.log(ties) + _log1p(rest / ties)
    z_target = tl.load(row_ptr + target, mask=valid, other=0.0).to(tl.float32)
    poison = tl.where(tl.load(counts_ptr + 1) > 0, float("nan"), 0.0)  # added to everything stored
    logp = tl.where(valid, (z_target - m) * inv_temperature - log_s, 0.0)
    tl.store(logp_ptr + rows, logp + poison, mask=row_mask)
    if ENTROPY:
        tl.store(entropy_ptr + rows, tl.where(valid, log_s - u / (ties + rest), 0.0) + poison, mask=row_mask)
    tl.store(stats_ptr + 2 * rows, m + poison, mask=row_mask)
    tl.store(stats_ptr + 2 * rows + 1, log_s + poison, mask=row_mask)


@triton.jit
def _logprobs_grad_kernel(
    z_ptr, z_row_stride, target_ptr, stats_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, n_rows, n_cols,
    ignore_index, inv_temperature, ENTROPY: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dz = (g ([j == t] - p) - k p (log p + H)) / T written over the logits z (g, k: the upstream gradients of
    logp and H; k only when ENTROPY). Ignored rows get exact zeros."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    valid = row_mask & (target != ignore_index) & (target >= 0) & (target < n_cols)
    row_ptr = z_ptr + rows.to(tl.int64) * z_row_stride
    cols = tl.arange(0, BLOCK_N)
    # Every row's statistics, ignored ones too: they are all NaN when a target is out of range (the forward's poison).
    m = tl.load(stats_ptr + 2 * rows, mask=row_mask, other=0.0)
    log_s = tl.load(stats_ptr + 2 * rows + 1, mask=row_mask, other=0.0)
    poison = log_s * 0.0  # 0, or NaN for every row when a target is out of range
    g = tl.load(grad_logp_ptr + rows, mask=valid, other=0.0).to(tl.float32) * inv_temperature
    if ENTROPY:
        entropy = tl.load(entropy_ptr + rows, mask=valid, other=0.0)
        k = tl.load(grad_entropy_ptr + rows, mask=valid, other=0.0).to(tl.float32) * inv_temperature
    # Last block first: in the loss's chunk step the forward kernel has just read it, so it may still be in L2.
    n_blocks = tl.cdiv(n_cols, BLOCK_N)
    for back in range(0, n_blocks):
        start = (n_blocks - 1 - back) * BLOCK_N
        in_row = ((start + cols) < n_cols)[None, :]
        ptrs = row_ptr[:, None] + (start + cols)[None, :]
        z = tl.load(ptrs, mask=valid[:, None] & in_row, other=0.0).to(tl.float32)
        log_p = (z - m[:, None]) * inv_temperature - log_s[:, None]
        p = tl.exp(log_p)
        grad = tl.where((start + cols)[None, :] == target[:, None], g[:, None], 0.0) - g[:, None] * p
        if ENTROPY:
            grad -= k[:, None] * p * (log_p + entropy[:, None])
        grad = tl.where(valid[:, None], grad, 0.0) + poison[:, None]
        tl.store(ptrs, grad.to(z_ptr.dtype.element_ty), mask=row_mask[:, None] & in_row)


# --------------------------------------------------------------------------------------------------
# Host launchers: a chunk of logits (rows, V) with unit column stride, the rows' targets, fp32 per-row buffers.


def logprob_rows(
    z: torch.Tensor,
    target: torch.Tensor,
    logp: torch.Tensor,
    stats: torch.Tensor,
    counts: torch.Tensor,
    temperature: float,
    ignore_index: int,
    entropy: torch.Tensor | None = None,
) -> None:
    """logp (rows,) of the targets under softmax(z / T), the entropies into ``entropy`` when given, and each row's
    (m, log s) into ``stats`` (rows, 2) for :func:`logprob_grad_rows`. ``counts``: the call's
    :func:`liger_lab.ops.cross_entropy.check_target` counts (every output NaN if a target is out of range)."""
    n_rows, n_cols = z.shape
    if n_rows == 0:
        return
    launch = runtime.streaming_row_launch(n_rows, n_cols)
    runtime.launch_kernel(_logprobs_kernel, (launch.grid,),
        z, z.stride(0), target, logp, entropy if entropy is not None else logp, stats, counts, n_rows, n_cols,
        ignore_index, 1.0 / temperature, ENTROPY=entropy is not None, ROWS=launch.rows, BLOCK_N=launch.block_n,
        num_warps=launch.num_warps,
    )  # fmt: skip


def logprob_grad_rows(
    z: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    grad_logp: torch.Tensor,
    temperature: float,
    ignore_index: int,
    entropy: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> None:
    """Overwrite the logits ``z`` with d(loss)/dz for per-row upstream gradients ``grad_logp`` (and ``grad_entropy``
    with the forward's ``entropy``, when both are given), from the forward's ``stats``."""
    n_rows, n_cols = z.shape
    if n_rows == 0:
        return
    with_entropy = entropy is not None and grad_entropy is not None
    launch = runtime.streaming_row_launch(n_rows, n_cols)
    runtime.launch_kernel(_logprobs_grad_kernel, (launch.grid,),
        z, z.stride(0), target, stats, entropy if with_entropy else stats, grad_logp,
        grad_entropy if with_entropy else grad_logp, n_rows, n_cols, ignore_index, 1.0 / temperature,
        ENTROPY=with_entropy, ROWS=launch.rows, BLOCK_N=launch.block_n, num_warps=launch.num_warps,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# PyTorch operators: the forward (logp, entropy, statistics) and the backward (the chunk loop again, upstream
# gradients folded into dz). The forward operator carries its autograd formula: nothing is written over an output,
# so no autograd.Function is needed.


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None, temperature: float,
    ignore_index: int, entropy: bool, chunk_tokens: int | None, accumulation: str, logp: torch.Tensor,
    entropies: torch.Tensor, stats: torch.Tensor,
) -> None:  # fmt: skip
    """logp, and the entropies when asked for (both fp32 of target's shape), and each token's statistics (m, log s)
    for the backward: one matmul per chunk, no gradient."""
    counts = check_target(target, hidden.shape[:-1], weight.shape[0], ignore_index)  # before any work
    rows, flat_target = chunked.token_rows(hidden, target)
    flat_logp, flat_entropy = logp.view(-1), entropies.view(-1) if entropy else None

    def step(z: torch.Tensor, chunk: slice, write_grad: bool) -> None:
        ent = None if flat_entropy is None else flat_entropy[chunk]
        logprob_rows(z, flat_target[chunk], flat_logp[chunk], stats[chunk], counts, temperature, ignore_index, ent)

    chunked.chunked_linear_loss(rows, weight, step, chunk=chunk_rows(rows, weight, chunk_tokens, False), bias=bias)


def _backward_rows(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None, stats: torch.Tensor,
    entropy: torch.Tensor | None, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None, temperature: float,
    ignore_index: int, chunk_tokens: int | None, accumulation: str, needs: list[bool], grad_hidden: torch.Tensor,
    grad_weight: torch.Tensor, grad_bias: torch.Tensor,
) -> None:  # fmt: skip
    """The gradients ``needs`` asks for: the chunk loop again, each chunk's logits recomputed and overwritten with
    dz for the upstream gradients of logp (and of the entropy, with the forward's entropies)."""
    rows, flat_target = chunked.token_rows(hidden, target)
    # contiguous(): the kernel reads one value per row, and a sum's backward hands over an expanded gradient.
    g_logp = grad_logp.reshape(-1).float().contiguous()
    g_entropy = None if grad_entropy is None or entropy is None else grad_entropy.reshape(-1).float().contiguous()
    flat_entropy = None if g_entropy is None else entropy.reshape(-1)

    def step(z: torch.Tensor, chunk: slice, write_grad: bool) -> None:
        ent, g_ent = (None, None) if g_entropy is None else (flat_entropy[chunk], g_entropy[chunk])
        logprob_grad_rows(z, flat_target[chunk], stats[chunk], g_logp[chunk], temperature, ignore_index, ent, g_ent)

    grads = chunked.ChunkGrads.asked(needs, grad_hidden, grad_weight, grad_bias)
    chunk = chunk_rows(rows, weight, chunk_tokens, needs[0])
    chunked.chunked_linear_loss(rows, weight, step, chunk=chunk, grads=grads, bias=bias)


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, temperature, ignore_index, entropy, chunk_tokens, accumulation = inputs
    _, entropies, stats = output
    ctx.save_for_backward(hidden, weight, target, bias, stats, entropies if entropy else None)
    ctx.options = (temperature, ignore_index, chunk_tokens, accumulation)
    # An output the loss does not use gets None, not zeros to read: logp alone skips the entropy term.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy, _grad_stats):
    hidden, weight, target, bias, stats, entropies = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3]]
    if (grad_logp is None and grad_entropy is None) or not any(needs):
        return (None,) * 9
    if grad_logp is None:  # only the entropy is used
        grad_logp = torch.zeros_like(stats[:, 0])
    grads = FUSED_LINEAR_LOGPROBS_BACKWARD(
        hidden, weight, target, bias, stats, entropies, grad_logp, grad_entropy, *ctx.options, needs
    )
    head = chunked.Head(hidden.shape, weight.dtype, tuple(needs))
    grad_h, grad_w, grad_b = chunked.finish_grads(chunked.Grads(*grads), head, None)
    return grad_h, grad_w, None, grad_b, *(None,) * 5


def _per_token(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *rest: object) -> torch.Tensor:
    return hidden.new_empty(target.shape, dtype=torch.float32)


def _entropies(hidden, weight, target, bias, temperature, ignore_index, entropy: bool, *rest) -> torch.Tensor:
    return hidden.new_empty(target.shape if entropy else (0,), dtype=torch.float32)


def _stats(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *rest: object) -> torch.Tensor:
    return hidden.new_empty(target.numel(), 2, dtype=torch.float32)


FUSED_LINEAR_LOGPROBS = define(
    "fused_linear_logprobs", _forward, outputs={"logp": _per_token, "entropies": _entropies, "stats": _stats},
    setup_context=_setup_context, backward=_backward,
)  # fmt: skip
FUSED_LINEAR_LOGPROBS_BACKWARD = define(
    "fused_linear_logprobs_backward", _backward_rows, outputs=chunked.grad_outputs(owed=False)
)


# --------------------------------------------------------------------------------------------------
# The public function.


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    entropy: bool = False,
    chunk_tokens: int | None = None,
    accumulation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log_softmax(z)[target]`` (and with ``entropy=True`` also ``-(softmax(z) * log_softmax(z)).sum(-1)``)
    for z = (hidden @ weight.T + bias) / temperature, without ever holding the N x V logits.

    hidden (..., H), weight (V, H) (an ``lm_head`` weight), target (...) class indices, bias (V,) or None, one dtype.
    Returns logp, or (logp, entropy) with ``entropy=True``: float32 tensors of target's shape, 0 where target is
    ``ignore_index``. Both are differentiable w.r.t. hidden, weight and bias with any upstream gradients (the
    backward recomputes the logits chunk by chunk; see the module docstring). ``chunk_tokens`` and ``accumulation``
    ("auto", "fp32", "weight_dtype") as in :func:`liger_lab.fused_linear_cross_entropy`. Bad input (shapes, dtypes,
    a temperature that is not a positive number) raises ValueError; so does a target out of range in the interpreter,
    while on the GPU, which checks it without making the host wait, it makes both outputs and the gradients NaN. The
    caller's tensors are never modified.
    """
    check_loss_options(LossOptions(ignore_index=ignore_index))
    temperature = chunked.check_number("temperature", temperature, positive=True)
    chunked.check_head(hidden, weight, bias)
    check_target_tensor(target, hidden.shape[:-1])
    accumulation = chunked.check_chunk_options("chunk_tokens", chunk_tokens, accumulation)
    if not isinstance(entropy, bool):
        raise ValueError(f"entropy is {entropy!r}: expected True or False")
    logp, entropies, _ = FUSED_LINEAR_LOGPROBS(
        hidden, weight, target, bias, temperature, ignore_index, entropy, chunk_tokens, accumulation
    )
    return (logp, entropies) if entropy else logp
