r"""The RL head: per-token log-probabilities (and entropies) of ``hidden @ weight.T`` without the logits.

Rollout scoring, reference log-probabilities and every policy-gradient loss (GRPO and its family,
:mod:`liger_lab.ops.grpo`) need, for each token, the log-probability of the token that was sampled, often with
the entropy of the distribution it was sampled from, under a temperature T::

    z    = (h @ W.T + b) / T                       # one row of logits (V of them), never held for all N rows
    logp = log_softmax(z)[target] = z_t - lse(z)
    H    = -sum_j p_j log p_j,  p = softmax(z)     # both 0 where target == ignore_index

This is what TRL's fused LM head computes (``trl.trainer.utils.add_fused_lm_head``, ``trl/kernels/chunked_logprob.py``),
and it gives every other per-token output that head has, from the same pass over the vocabulary (``outputs``)::

    L    = log sum_j p_j**2                        # log_sum_sq_probs: how peaked the distribution is
    mean = (1 / V) sum_j z_j                       # mean_logits
    top1 = z_t is z's first maximum                # is_top1: the token accuracy SFT logs

with z soft-capped and scaled as Gemma 2, Cohere and Granite do before the softmax: z = c / T,
c = softcap * tanh(raw * logit_scale / softcap) (c = raw * logit_scale without a cap). The kernels read the raw
logits and transform each block as they load it.

**Forward.** The chunk loop of :mod:`liger_lab.ops.chunked` makes C rows of raw logits at a time; one program per
tile of rows walks each row once in blocks, with the online log-sum-exp (as in :mod:`liger_lab.ops.logsumexp`) on
z = c / T: a running max m of the logits c and a running sum s of e_j = exp(y_j), y_j = (c_j - m) / T. The entropy
needs one more running sum, u = sum_j e_j y_j; when a block raises the max from m to m', every old y moves by
d = (m - m') / T and every old e is scaled by exp(d), so ``u <- exp(d) (u + d s)``. At the end, with
log p_j = y_j - log s::

    logp = (c_t - m) / T - log s          H = log s - u / s

Both are differences of numbers of order log V, never of the raw logits (which may be in the thousands). One more
care: s is kept as ``ties + rest``, the count of logits equal to the max (each adds exactly 1) and the sum over
the others, and ``log s = log(ties) + log1p(rest / ties)``. A near-certain row has s = 1 + rest with rest below
fp32's resolution of 1 (2**-24), where a plain ``log s`` is 0 and H = rest (1 + Delta) (Delta the gap to the
runner-up logit) would keep only the u term: a relative error of 1 / (1 + Delta), 5% at H = 1e-8 (seen on the
GPU). Split, logp and H keep their relative precision however confident the row. The kernel keeps (m, log s) per
row, 8 bytes, for the backward.

The other outputs are running sums of the same pass: sum e_j**2, rescaled by exp(d)**2 when the max moves (so
L = log(sum e**2) - 2 log s; each max logit adds exactly 1, so the sum never underflows to 0), the sum of c, and the
max of c over the columns before the target (the target is the first maximum when it reaches m and beats them).

**Backward.** logp, H and L may carry any upstream gradients g, k and q per token: a loss may weigh the
log-probabilities by advantages and add an entropy bonus. With respect to the head's z = c / T::

    d logp / d z_j = [j == t] - p_j
    d H / d z_j    = -sum_i (d p_i / d z_j)(log p_i + 1) = -p_j (log p_j + 1) + p_j sum_i p_i (log p_i + 1)
                   = -p_j (log p_j + H)
    d L / d z_j    = 2 (p_j**2 / e**L - p_j)
    d loss / d z_j = g ([j == t] - p_j) - k p_j (log p_j + H) + 2 q (p_j**2 / e**L - p_j)

times d z_j / d raw_j = logit_scale (1 - tanh**2) / T (logit_scale / T without a cap). mean_logits and is_top1 carry
no gradient (as in TRL). A second kernel writes that d loss / d raw over recomputed logits, from the saved
(m, log s), H and L. The gradient depends on g, k and q *inside* the sums over tokens of dW = dz^T h and
db = sum dz, so nothing can be made before the upstream gradients exist: the forward is one matmul per chunk (the
logits), the backward three (the logits again, dW, dh): 4 matmuls in all, 8 N H V FLOPs, as the fused
cross-entropy's ``reduction="none"``. Ignored rows read nothing and get exact zeros. The saved statistics are the
whole row's, so the backward need not see a whole row at once: it runs over tiles of 4096 tokens by a slice of the
vocabulary (:func:`backward_tiles`, :func:`liger_lab.ops.chunked.tiled_linear_grads`), and each slice of dW is one
product over the tile's tokens, summed over token tiles as :mod:`liger_lab.ops.fused_linear_cross_entropy` sums over
chunks (``accumulation``).

**Memory.** In the forward one chunk of C x V logits (the fused cross-entropy's rule:
:func:`liger_lab.ops.fused_linear_cross_entropy.chunk_rows`, whose budget benchmarks/notes/fused_linear_cross_entropy.md
measures), the outputs and 8 bytes per token of statistics; in the backward the N x H hidden gradient, dW, and within
the same budget one tile of logits and the tile's dh in fp32 (summed over the vocabulary's slices).

**Nothing is read back.** No ``.item()`` or ``.tolist()`` on the GPU path: the host never waits for the GPU, and
counts stay device tensors. The targets are range-checked by a small kernel
(:func:`liger_lab.ops.cross_entropy.check_target`): a ValueError in the interpreter, where reading its count costs
nothing; on the GPU the forward kernel reads the count itself and a target out of range makes every output NaN, and
so every gradient, through the NaN statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
import triton
import triton.language as tl

from liger_lab import runtime
from liger_lab.formulas import HEAD_OUTPUTS, check_ignore_index, check_number, head_outputs
from liger_lab.ops import chunked, fused_linear_cross_entropy
from liger_lab.ops.cross_entropy import check_target, check_target_tensor
from liger_lab.ops.fused_linear_cross_entropy import chunk_rows
from liger_lab.ops.operators import define


@triton.jit
def _log1p(x):
    """log(1 + x) to a few ulps for x >= 0 with ``tl.log`` alone (no libdevice): log(w) x / (w - 1), w = 1 + x,
    divides out the rounding of w (Goldberg's trick); x itself where w rounds to 1."""
    w = 1.0 + x
    return tl.where(w == 1.0, x, tl.log(w) * (x / tl.where(w == 1.0, 1.0, w - 1.0)))


@triton.jit
def _head_logits(z, logit_scale, softcap, SOFTCAP: tl.constexpr):
    """The head's logits before the temperature: z * logit_scale, soft-capped to softcap * tanh(. / softcap) when
    SOFTCAP (tanh as 2 sigmoid(2x) - 1: no libdevice). Returns them with tanh's value (1 without a cap), whose
    derivative 1 - t**2 the backward needs."""
    z = z * logit_scale
    t = tl.full(z.shape, 1.0, tl.float32)
    if SOFTCAP:
        t = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0
        z = softcap * t
    return z, t


@triton.jit
def _logprobs_kernel(
    z_ptr,  # the chunk's raw logits, rows z_row_stride apart (unit stride along a row)
    z_row_stride,
    target_ptr,  # one class index per row
    logp_ptr,  # fp32 outputs, one per row: log p of the target...
    entropy_ptr,  # ...the entropy (ENTROPY)...
    lssp_ptr,  # ...log sum p**2 (LSSP)...
    mean_ptr,  # ...the mean logit over the vocabulary (MEAN)...
    top1_ptr,  # ...and whether the target is the first argmax (TOP1, bool)
    stats_ptr,  # fp32 (rows, 2): (m, log s) per row for the backward
    counts_ptr,  # check_target's counts: counts[1] > 0 poisons every output with NaN
    n_rows,
    n_cols,
    ignore_index,
    inv_temperature,
    logit_scale,
    softcap,
    SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    LSSP: tl.constexpr,
    MEAN: tl.constexpr,
    TOP1: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Per row: logp of the target, the outputs asked for, and the statistics (m, log s) at stats[2 r], stats[2 r + 1];
    all NaN when check_target's counts (counts[1]) found a target out of range anywhere. m is the max of the capped
    and scaled logits c (the logits before the temperature), s the sum of exp((c - m) / T)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    # A row whose target is out of range is skipped (never read out of bounds); the NaN below reports it.
    valid = row_mask & (target != ignore_index) & (target >= 0) & (target < n_cols)
    row_ptr = z_ptr + rows.to(tl.int64) * z_row_stride  # int64: 16k rows x 128k columns passes 2**31
    cols = tl.arange(0, BLOCK_N)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    ties = tl.zeros([ROWS], tl.float32)  # how many logits equal the running max m (each adds exactly 1 to s)
    rest = tl.zeros([ROWS], tl.float32)  # s - ties: the sum of exp((c - m) / T) over the logits below m
    u = tl.zeros([ROWS], tl.float32)  # sum e y (entropy)
    sq = tl.zeros([ROWS], tl.float32)  # sum e**2 (log sum p**2), scaled with s
    c_sum = tl.zeros([ROWS], tl.float32)  # sum of c (the mean logit)
    before = tl.full([ROWS], float("-inf"), tl.float32)  # the max of c over the columns before the target (top-1)
    for start in range(0, n_cols, BLOCK_N):
        mask = valid[:, None] & ((start + cols) < n_cols)[None, :]
        raw = tl.load(row_ptr[:, None] + (start + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
        c, _ = _head_logits(raw, logit_scale, softcap, SOFTCAP)
        if MEAN:
            c_sum += tl.sum(tl.where(mask, c, 0.0), axis=1)
        c = tl.where(mask, c, float("-inf"))
        if TOP1:
            earlier = (start + cols)[None, :] < target[:, None]
            before = tl.maximum(before, tl.max(tl.where(earlier, c, float("-inf")), axis=1))
        m_new = tl.maximum(m, tl.max(c, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet: no -inf - -inf
        rescale = tl.exp((m - shift) * inv_temperature)
        y = tl.where(mask, (c - shift[:, None]) * inv_temperature, 0.0)
        e = tl.where(mask, tl.exp(y), 0.0)
        at_max = mask & (c == m_new[:, None])
        if ENTROPY:  # before ties and rest move: s_old = ties + rest, and the old y move by (m - m_new) / T
            moved = tl.where(m == float("-inf"), 0.0, (m - shift) * inv_temperature)
            u = rescale * (u + moved * (ties + rest)) + tl.sum(e * y, axis=1)
        if LSSP:
            sq = rescale * rescale * sq + tl.sum(e * e, axis=1)
        raised = m_new > m  # the old max logits fall below the new one: they join the rest, scaled
        rest = tl.where(raised, rescale * (rest + ties), rest) + tl.sum(tl.where(at_max, 0.0, e), axis=1)
        ties = tl.where(raised, 0.0, ties) + tl.sum(at_max.to(tl.float32), axis=1)
        m = m_new
    m = tl.where(valid, m, 0.0)
    ties = tl.where(valid, ties, 1.0)
    rest = tl.where(valid, rest, 0.0)
    log_s = tl.log(ties) + _log1p(rest / ties)
    c_target, _ = _head_logits(
        tl.load(row_ptr + target, mask=valid, other=0.0).to(tl.float32), logit_scale, softcap, SOFTCAP
    )
    poison = tl.where(tl.load(counts_ptr + 1) > 0, float("nan"), 0.0)  # added to everything stored
    logp = tl.where(valid, (c_target - m) * inv_temperature - log_s, 0.0)
    tl.store(logp_ptr + rows, logp + poison, mask=row_mask)
    if ENTROPY:
        tl.store(entropy_ptr + rows, tl.where(valid, log_s - u / (ties + rest), 0.0) + poison, mask=row_mask)
    if LSSP:
        # sum p**2 = sq / s**2; sq >= ties >= 1 (each max logit adds exactly 1), so its log never meets a zero.
        lssp = tl.log(tl.where(valid, sq, 1.0)) - 2.0 * log_s
        tl.store(lssp_ptr + rows, tl.where(valid, lssp, 0.0) + poison, mask=row_mask)
    if MEAN:
        tl.store(mean_ptr + rows, tl.where(valid, c_sum * inv_temperature / n_cols, 0.0) + poison, mask=row_mask)
    if TOP1:
        tl.store(top1_ptr + rows, valid & (c_target >= m) & (c_target > before), mask=row_mask)
    tl.store(stats_ptr + 2 * rows, m + poison, mask=row_mask)
    tl.store(stats_ptr + 2 * rows + 1, log_s + poison, mask=row_mask)


@triton.jit
def _logprobs_grad_kernel(
    z_ptr,  # a tile's raw logits, recomputed; overwritten with d(loss)/d(raw logits)
    z_row_stride,
    target_ptr,  # one class index per row, counted in the whole vocabulary
    stats_ptr,  # the forward's (m, log s) per row
    entropy_ptr,  # the forward's entropy per row (ENTROPY)
    lssp_ptr,  # the forward's log sum p**2 per row (LSSP)
    grad_logp_ptr,  # upstream gradients per row: of logp...
    grad_entropy_ptr,  # ...of the entropy (ENTROPY)...
    grad_lssp_ptr,  # ...of log sum p**2 (LSSP)
    n_rows,
    n_cols,  # the tile's columns...
    first_col,  # ...are the vocabulary's first_col .. first_col + n_cols - 1...
    vocab,  # ...of this many
    ignore_index,
    inv_temperature,
    logit_scale,
    softcap,
    SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    LSSP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """With x = c / T and g, k, q the upstream gradients of logp, H and L = log sum p**2:
    d loss / d x_j = g ([j == t] - p_j) - k p_j (log p_j + H) + 2 q (p_j**2 / exp(L) - p_j), then times
    d x / d raw = logit_scale (1 - t**2) / T (1 - t**2 only with a soft cap). The statistics are the whole row's, so a
    tile of a row's columns needs nothing from the others. Ignored rows get exact zeros."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    valid = row_mask & (target != ignore_index) & (target >= 0) & (target < vocab)
    target -= first_col  # the target's column in this tile (outside 0 .. n_cols - 1 when another tile has it)
    row_ptr = z_ptr + rows.to(tl.int64) * z_row_stride
    cols = tl.arange(0, BLOCK_N)
    # Every row's statistics, ignored ones too: they are all NaN when a target is out of range (the forward's poison).
    m = tl.load(stats_ptr + 2 * rows, mask=row_mask, other=0.0)
    log_s = tl.load(stats_ptr + 2 * rows + 1, mask=row_mask, other=0.0)
    poison = log_s * 0.0  # 0, or NaN for every row when a target is out of range
    g = tl.load(grad_logp_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    if ENTROPY:
        entropy = tl.load(entropy_ptr + rows, mask=valid, other=0.0)
        k = tl.load(grad_entropy_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    if LSSP:
        lssp = tl.load(lssp_ptr + rows, mask=valid, other=0.0)
        q = tl.load(grad_lssp_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    # Last block first: in the loss's chunk step the forward kernel has just read it, so it may still be in L2.
    n_blocks = tl.cdiv(n_cols, BLOCK_N)
    for back in range(0, n_blocks):
        start = (n_blocks - 1 - back) * BLOCK_N
        in_row = ((start + cols) < n_cols)[None, :]
        ptrs = row_ptr[:, None] + (start + cols)[None, :]
        raw = tl.load(ptrs, mask=valid[:, None] & in_row, other=0.0).to(tl.float32)
        c, t = _head_logits(raw, logit_scale, softcap, SOFTCAP)
        log_p = (c - m[:, None]) * inv_temperature - log_s[:, None]
        p = tl.exp(log_p)
        grad = tl.where((start + cols)[None, :] == target[:, None], g[:, None], 0.0) - g[:, None] * p
        if ENTROPY:
            grad -= k[:, None] * p * (log_p + entropy[:, None])
        if LSSP:
            grad += 2.0 * q[:, None] * (tl.exp(2.0 * log_p - lssp[:, None]) - p)
        grad *= inv_temperature * logit_scale
        if SOFTCAP:
            grad *= 1.0 - t * t
        grad = tl.where(valid[:, None], grad, 0.0) + poison[:, None]
        tl.store(ptrs, grad.to(z_ptr.dtype.element_ty), mask=row_mask[:, None] & in_row)


# --------------------------------------------------------------------------------------------------
# Host launchers: a chunk of logits (rows, V) with unit column stride, the rows' targets, fp32 per-row buffers.


@dataclass(frozen=True)
class HeadTransform:
    """What turns a raw logit into the head's z: ``softcap * tanh(raw * logit_scale / softcap) / temperature`` (no
    tanh when ``softcap`` is None)."""

    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0

    def kernel_arguments(self) -> dict[str, object]:
        softcap = 1.0 if self.softcap is None else self.softcap
        return {"inv_temperature": 1.0 / self.temperature, "logit_scale": self.logit_scale, "softcap": softcap,
                "SOFTCAP": self.softcap is not None}  # fmt: skip


@dataclass(frozen=True)
class HeadOutputs:
    """Where a forward writes the per-row outputs beside logp: each None when not asked for (fp32; is_top1 bool)."""

    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The four buffers in :data:`liger_lab.HEAD_OUTPUTS`' order (themselves: ``astuple`` would copy)."""
        return tuple(getattr(self, field.name) for field in fields(self))

    def rows(self, chunk: slice) -> HeadOutputs:
        return HeadOutputs(*(None if t is None else t[chunk] for t in self.tensors()))


def logprob_rows(
    z: torch.Tensor,
    target: torch.Tensor,
    logp: torch.Tensor,
    stats: torch.Tensor,
    counts: torch.Tensor,
    temperature: float,
    ignore_index: int,
    entropy: torch.Tensor | None = None,
    *,
    extras: HeadOutputs | None = None,
    transform: HeadTransform | None = None,
) -> None:
    """logp (rows,) of the targets under softmax(z / T), the entropies into ``entropy`` when given (or
    ``extras.entropy``), the other outputs ``extras`` holds, and each row's (m, log s) into ``stats`` (rows, 2) for
    :func:`logprob_grad_rows`. ``counts``: the call's :func:`liger_lab.ops.cross_entropy.check_target` counts (every
    output NaN if a target is out of range). ``transform``: a soft cap and a logit scale (the temperature is
    ``temperature``'s)."""
    n_rows, n_cols = z.shape
    if n_rows == 0:
        return
    extras = extras or HeadOutputs(entropy=entropy)
    transform = replace(transform or HeadTransform(), temperature=temperature)
    launch = runtime.streaming_row_launch(n_rows, n_cols)
    runtime.launch_kernel(_logprobs_kernel, (launch.grid,),
        z, z.stride(0), target, logp, *(logp if t is None else t for t in extras.tensors()), stats, counts, n_rows,
        n_cols, ignore_index, **transform.kernel_arguments(), ENTROPY=extras.entropy is not None,
        LSSP=extras.log_sum_sq_probs is not None, MEAN=extras.mean_logits is not None, TOP1=extras.is_top1 is not None,
        ROWS=launch.rows, BLOCK_N=launch.block_n, num_warps=launch.num_warps,
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
    *,
    lssp: torch.Tensor | None = None,
    grad_lssp: torch.Tensor | None = None,
    transform: HeadTransform | None = None,
    columns: slice | None = None,
    vocab: int | None = None,
) -> None:
    """Overwrite the logits ``z`` with d(loss)/dz for per-row upstream gradients ``grad_logp`` (and ``grad_entropy``
    with the forward's ``entropy``, ``grad_lssp`` with its log sum p**2 ``lssp``, when both of a pair are given),
    from the forward's ``stats``. ``z`` holds whole rows, or the ``columns`` of a ``vocab`` entries wide one."""
    n_rows, n_cols = z.shape
    first_col = 0 if columns is None else columns.start
    vocab = n_cols if vocab is None else vocab
    if n_rows == 0:
        return
    with_entropy = entropy is not None and grad_entropy is not None
    with_lssp = lssp is not None and grad_lssp is not None
    transform = replace(transform or HeadTransform(), temperature=temperature)
    launch = runtime.streaming_row_launch(n_rows, n_cols)
    runtime.launch_kernel(_logprobs_grad_kernel, (launch.grid,),
        z, z.stride(0), target, stats, entropy if with_entropy else stats, lssp if with_lssp else stats, grad_logp,
        grad_entropy if with_entropy else grad_logp, grad_lssp if with_lssp else grad_logp, n_rows, n_cols, first_col,
        vocab, ignore_index, **transform.kernel_arguments(), ENTROPY=with_entropy, LSSP=with_lssp, ROWS=launch.rows,
        BLOCK_N=launch.block_n, num_warps=launch.num_warps,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# PyTorch operators: the forward (logp, the outputs asked for, statistics) and the backward (the logits again, tile
# by tile, upstream gradients folded into dz). The forward operator carries its autograd formula: nothing is written
# over an output, so no autograd.Function is needed. ``wanted`` flags the outputs of HEAD_OUTPUTS, in that order.


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None, temperature: float,
    ignore_index: int, wanted: list[bool], softcap: float | None, logit_scale: float, chunk_tokens: int | None,
    accumulation: str, logp: torch.Tensor, entropies: torch.Tensor, lssp: torch.Tensor, means: torch.Tensor,
    top1: torch.Tensor, stats: torch.Tensor,
) -> None:  # fmt: skip
    """logp and the outputs ``wanted`` asks for (fp32, is_top1 bool, of target's shape), and each token's statistics
    (m, log s) for the backward: one matmul per chunk, no gradient."""
    counts = check_target(target, hidden.shape[:-1], weight.shape[0], ignore_index)  # before any work
    rows, flat_target = chunked.token_rows(hidden, target)
    flat_logp = logp.view(-1)
    extras = HeadOutputs(*(t.view(-1) if asked else None for t, asked in zip((entropies, lssp, means, top1), wanted,
                                                                             strict=True)))  # fmt: skip
    transform = HeadTransform(temperature, softcap, logit_scale)

    def step(z: torch.Tensor, chunk: slice, write_grad: bool) -> None:
        logprob_rows(z, flat_target[chunk], flat_logp[chunk], stats[chunk], counts, temperature, ignore_index,
                     extras=extras.rows(chunk), transform=transform)  # fmt: skip

    chunked.chunked_linear_loss(rows, weight, step, chunk=chunk_rows(rows, weight, chunk_tokens, False), bias=bias)


def _backward_rows(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None, stats: torch.Tensor,
    entropy: torch.Tensor | None, lssp: torch.Tensor | None, grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None, grad_lssp: torch.Tensor | None, temperature: float, ignore_index: int,
    softcap: float | None, logit_scale: float, chunk_tokens: int | None, accumulation: str, needs: list[bool],
    grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor,
) -> None:  # fmt: skip
    """The gradients ``needs`` asks for, over tiles of tokens by vocabulary columns (:func:`backward_tiles`): each
    tile's logits recomputed and overwritten with dz for the upstream gradients of logp (and of the entropy and
    log sum p**2, with the forward's values)."""
    rows, flat_target = chunked.token_rows(hidden, target)

    def per_row(values: torch.Tensor | None) -> torch.Tensor | None:
        # contiguous(): the kernel reads one value per row, and a sum's backward hands over an expanded gradient.
        return None if values is None else values.reshape(-1).float().contiguous()

    g_logp = per_row(grad_logp)
    g_entropy, g_lssp = per_row(grad_entropy if entropy is not None else None), per_row(grad_lssp if lssp is not None
                                                                                        else None)  # fmt: skip
    flat_entropy, flat_lssp = per_row(entropy), per_row(lssp)
    transform = HeadTransform(temperature, softcap, logit_scale)

    def tile_grad(z: torch.Tensor, rows: slice, columns: slice) -> None:
        def rows_of(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[rows]

        logprob_grad_rows(z, flat_target[rows], stats[rows], g_logp[rows], temperature, ignore_index,
                          rows_of(flat_entropy), rows_of(g_entropy), lssp=rows_of(flat_lssp), grad_lssp=rows_of(g_lssp),
                          transform=transform, columns=columns, vocab=weight.shape[0])  # fmt: skip

    grads = chunked.ChunkGrads.asked(needs, grad_hidden, grad_weight, grad_bias)
    tokens, columns = backward_tiles(rows, weight, chunk_tokens, needs[0])
    chunked.tiled_linear_grads(rows, weight, tile_grad, tokens=tokens, columns=columns, grads=grads, bias=bias)


BACKWARD_TOKENS = 4096
"""Tokens per tile of the head's backward (TRL's head tiles by as many)."""


def backward_tiles(
    rows: torch.Tensor, weight: torch.Tensor, chunk_tokens: int | None, with_grad_h: bool
) -> tuple[int, int]:
    """(tokens, columns) per tile of the backward (:func:`liger_lab.ops.chunked.tiled_linear_grads`): ``chunk_tokens``
    or :data:`BACKWARD_TOKENS` tokens, and as many of the vocabulary's columns as fit the fused cross-entropy's
    budget (``CHUNK_BUDGET_BYTES``, read at each call) less the hidden gradient's buffer and, when the vocabulary
    is split, the tile's fp32 accumulator of dh; whole rows when they fit."""
    n_rows, hidden_size = rows.shape
    size, vocab = rows.element_size(), weight.shape[0]
    budget = fused_linear_cross_entropy.CHUNK_BUDGET_BYTES
    tokens = max(1, min(n_rows, BACKWARD_TOKENS if chunk_tokens is None else chunk_tokens))
    other = n_rows * hidden_size * size if with_grad_h else 0
    if tokens * vocab * size + other <= budget:
        return tokens, vocab
    accumulator = tokens * hidden_size * 4 if with_grad_h else 0
    columns = chunked.rows_per_chunk(vocab, tokens * size, budget, other_bytes=other + accumulator,
                                     align=fused_linear_cross_entropy.MATMUL_ALIGN)  # fmt: skip
    return tokens, columns


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, temperature, ignore_index, wanted, softcap, logit_scale, *chunking = inputs
    _, entropies, lssp, _, _, stats = output
    ctx.save_for_backward(hidden, weight, target, bias, stats, entropies if wanted[0] else None,
                          lssp if wanted[1] else None)  # fmt: skip
    ctx.options = (temperature, ignore_index, softcap, logit_scale, *chunking)
    # An output the loss does not use gets None, not zeros to read: logp alone skips the entropy term.
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[3:])  # mean_logits, is_top1 and the statistics


def _backward(ctx, grad_logp, grad_entropy, grad_lssp, *_not_differentiable):
    hidden, weight, target, bias, stats, entropies, lssp = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3]]
    none = (None,) * 11
    if all(g is None for g in (grad_logp, grad_entropy, grad_lssp)) or not any(needs):
        return none
    if grad_logp is None:  # only the other outputs are used
        grad_logp = torch.zeros_like(stats[:, 0])
    grads = FUSED_LINEAR_LOGPROBS_BACKWARD(
        hidden, weight, target, bias, stats, entropies, lssp, grad_logp, grad_entropy, grad_lssp, *ctx.options, needs
    )
    head = chunked.Head(hidden.shape, weight.dtype, tuple(needs))
    grad_h, grad_w, grad_b = chunked.finish_grads(chunked.Grads(*grads), head, None)
    return grad_h, grad_w, None, grad_b, *none[4:]


def _per_token(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty(target.shape, dtype=torch.float32)


def wanted_output(index: int, dtype: torch.dtype = torch.float32):
    """The allocator of the output ``HEAD_OUTPUTS[index]`` of an operator whose argument ``wanted`` flags them:
    target's shape when asked for, else empty."""

    def allocate(hidden: torch.Tensor, target: torch.Tensor, wanted: list[bool]) -> torch.Tensor:
        return hidden.new_empty(target.shape if wanted[index] else (0,), dtype=dtype)

    return allocate


def _stats(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty(target.numel(), 2, dtype=torch.float32)


FUSED_LINEAR_LOGPROBS = define(
    "fused_linear_logprobs", _forward,
    outputs={"logp": _per_token, "entropies": wanted_output(0), "lssp": wanted_output(1),
             "means": wanted_output(2), "top1": wanted_output(3, torch.bool), "stats": _stats},
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
    outputs: Sequence[str] = (),
    softcap: float | None = None,
    logit_scale: float = 1.0,
    chunk_tokens: int | None = None,
    accumulation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Per-token ``log_softmax(z)[target]`` for z = softcap * tanh((hidden @ weight.T + bias) * logit_scale / softcap)
    / temperature (without the tanh when ``softcap`` is None), and any of the outputs TRL's fused head has, all from
    one pass over the vocabulary, without ever holding the N x V logits.

    hidden (..., H), weight (V, H) (an ``lm_head`` weight), target (...) class indices, bias (V,) or None, one dtype.
    ``outputs``: any of "entropy" (-(softmax(z) * log_softmax(z)).sum(-1)), "log_sum_sq_probs" (log(sum softmax(z)**2)),
    "mean_logits" (z's mean over the vocabulary) and "is_top1" (the target is z's first argmax), in any order.
    Returns logp alone when ``entropy`` is False and ``outputs`` empty; else ``(logp, *extras)``: the entropy first
    when ``entropy=True`` (its round-3 meaning), then the names of ``outputs`` in the order given. float32 tensors of
    target's shape (is_top1: bool), 0 where target is ``ignore_index``. logp, the entropy and log_sum_sq_probs are
    differentiable w.r.t. hidden, weight and bias with any upstream gradients (the backward recomputes the logits
    tile by tile; see the module docstring); mean_logits and is_top1 are not, as in TRL. ``chunk_tokens`` (the
    tokens of a forward chunk and of a backward tile) and ``accumulation`` ("auto", "fp32", "weight_dtype") as in
    :func:`liger_lab.fused_linear_cross_entropy`. Bad input
    (shapes, dtypes, a temperature or soft cap that is not a positive number, an unknown or repeated output) raises
    ValueError; so does a target out of range in the interpreter, while on the GPU, which checks it without making
    the host wait, it makes every output and the gradients NaN. The caller's tensors are never modified.
    """
    check_ignore_index(ignore_index)
    temperature = check_number("temperature", temperature, positive=True)
    names = head_outputs(entropy, outputs)
    softcap = None if softcap is None else check_number("softcap", softcap, positive=True)
    logit_scale = check_number("logit_scale", logit_scale)
    chunked.check_head(hidden, weight, bias)
    check_target_tensor(target, hidden.shape[:-1])
    accumulation = chunked.check_chunk_options("chunk_tokens", chunk_tokens, accumulation)
    wanted = [name in names for name in HEAD_OUTPUTS]
    logp, *made, _ = FUSED_LINEAR_LOGPROBS(
        hidden, weight, target, bias, temperature, ignore_index, wanted, softcap, logit_scale, chunk_tokens,
        accumulation,
    )  # fmt: skip
    by_name = dict(zip(HEAD_OUTPUTS, made, strict=True))
    return (logp, *(by_name[name] for name in names)) if names else logp
