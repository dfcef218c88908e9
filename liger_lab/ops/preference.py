r"""Preference losses (DPO, ORPO, SimPO) on ``hidden @ weight.T`` without the batch's logits.

**The data.** A batch holds B prompts, each with a chosen and a rejected response: ``hidden`` is (2B, T, H),
rows [0, B) the chosen sequences and rows [B, 2B) the rejected ones of the same prompts, ``target`` (2B, T)
the token each position predicts (already shifted), ``ignore_index`` on prompt and padding positions. With
z = hidden @ weight.T, a sequence's score is built from its token log-probabilities::

    logp = sum over kept positions t of log_softmax(z_t)[target_t]     (0 for a sequence with none kept)
    avg  = logp / max(n, 1),  n = its number of kept positions

and the loss is a mean over the pairs b (chosen c, rejected r; sigma is the logistic function)::

    DPO    mean_b -log sigma(beta * ((logp_c - ref_c) - (logp_r - ref_r)))    ref: the same logp under a frozen
                                                                            reference model (ref_hidden, ref_weight)
    SimPO  mean_b -log sigma(beta * (avg_c - avg_r) - gamma)
    ORPO   mean_b -beta * log sigma(odds(avg_c) - odds(avg_r)),  odds(a) = a - log(1 - exp(a)),
           plus the SFT term: the chosen sequences' NLL per kept token, -sum_b logp_c / (kept chosen tokens).

``log(1 - exp(a))`` is evaluated as ``log(-expm1(a))`` near 0 and ``log1p(-exp(a))`` further out, each accurate
on its side (1 - exp(a) itself loses every digit as a approaches 0). It is -inf at a = 0 (a sequence that is
certain, or one with no kept position), so ORPO caps ``avg`` at :data:`ORPO_MAX_AVG_LOGP` before taking the
odds (no gradient flows through the cap). A sequence whose positions are all ignored has logp = 0 and avg = 0:
no evidence, and a finite value for every loss.

**The gradient.** Write L = (1/B) sum_b l_b, each l_b a function of its pair's two logp (ORPO's NLL is
shared out as -B logp_c / (kept chosen tokens) per pair). Only the sequence scores couple the rows, and
d log_softmax(z)[y] / dz = onehot(y) - softmax(z), so for a position t of sequence s::

    dL/dz_t = (1/B) * dl/dlogp_s * dlogp_s/dz_t = (1/B) * (-dl/dlogp_s) * (softmax(z_t) - onehot(target_t))

which is the cross-entropy gradient of the position, scaled by one number per sequence. Per loss, with
m the argument of log sigma and d(-log sigma(m))/dm = -sigma(-m)::

    DPO    dl/dlogp_c = -beta * sigma(-m),  dl/dlogp_r = +beta * sigma(-m)
    SimPO  the same with beta / n_c and beta / n_r        (avg = logp / n)
    ORPO   dl/dlogp_c = -beta * sigma(-x) * odds'(avg_c) / n_c - B / (kept chosen tokens),
           dl/dlogp_r = +beta * sigma(-x) * odds'(avg_r) / n_r,   odds'(a) = 1 / (1 - exp(a)), x = odds_c - odds_r

Each loss is a small function from the per-sequence (logp, n[, ref]) of some pairs to their terms l_b and
dl/dlogp (:data:`PAIR_LOSSES`); everything else is shared.

**Chunking over pairs.** The scale of a sequence's rows is known only once the whole sequence, and its
partner, have been scored. So the chunk loop (:func:`liger_lab.ops.chunked.chunked_linear_loss`) runs over
*complete pairs*: the hidden rows are gathered into pair order (chosen of prompt 0, rejected of prompt 0,
chosen of prompt 1, ...; an N x H copy, small next to N x V logits, and none at all for B = 1) and each chunk
holds the 2kT rows of k pairs. The chunk's step:

1. the cross-entropy kernel (:func:`liger_lab.ops.cross_entropy.cross_entropy_rows`) reads the chunk's logits
   once and writes each position's -log p(target) (ignored positions: 0);
2. the positions are summed per sequence (logp), and the pair function gives the chunk's terms and
   dl/dlogp for each sequence;
3. the kernel runs again over the same logits with the per-row scale -dl/dlogp of each row's sequence and
   writes (softmax - onehot) * scale over z, in fp32 registers, rounded once to the logits' dtype.

The loop then makes dW += dz.T @ h and dh = dz @ W for the chunk, with the 1/B of the mean (and DPO's and
SimPO's beta, a factor of every row's scale) on the matmuls' ``alpha`` rather than in the fp16/bf16 dz.
Running the kernel twice reads the logits three times and writes them once; computing the unscaled gradient
and rescaling it afterwards (``scale_rows``) would read three times and write twice, and would round the
gradient to fp16/bf16 before scaling it. Finally dh is put back into the caller's row order.

DPO's reference scores come first, from the same chunk loop over ``ref_hidden @ ref_weight.T`` with no gradient:
only per-position log-probabilities are kept (N floats), never the reference's logits beyond one chunk.

**Memory.** One chunk of logits (2kT x V), the N x H pair-ordered copy of hidden and the N x H gradient (put
back in the caller's order by one more N x H copy when B > 1).
:data:`CHUNK_BUDGET_BYTES` sets how many pairs a chunk holds (at least one: with T = 1024, V = 128256 in
bf16 a single pair's logits are 501 MiB). dW is accumulated over chunks as in the fused linear cross-entropy
(``accumulation``). Gradients are made in the forward; the backward multiplies them by the upstream gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from liger_lab.ops.chunked import ChunkGrads, chunked_linear_loss
from liger_lab.ops.common import check_float
from liger_lab.ops.cross_entropy import LossOptions, check_loss_options, check_target, check_target_tensor
from liger_lab.ops.cross_entropy import cross_entropy_rows as _token_losses
from liger_lab.ops.fused_linear_cross_entropy import MIB, accumulation_dtype, check_chunk_options, finish_grads

CHUNK_BUDGET_BYTES = 240 * MIB
"""Bytes of one chunk of logits; a chunk holds as many complete pairs as fit, at least one."""
ORPO_MAX_AVG_LOGP = -1e-6
"""ORPO's cap on a sequence's mean token log-probability before the odds (see the module docstring)."""
LOSSES = ("dpo", "orpo", "simpo")


# --------------------------------------------------------------------------------------------------
# The per-pair losses: (logp, n, ref) of k pairs, each (k, 2) float64 [chosen, rejected], to the pairs'
# terms l_b (k,) and dl/dlogp (k, 2). ``nll_scale`` is B / (kept chosen tokens), ORPO's NLL weight.

PairLoss = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a < 0, exact on both sides of -log 2."""
    near_zero = a > -math.log(2)
    return torch.where(near_zero, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def _sides(d_margin: torch.Tensor) -> torch.Tensor:
    """(k, 2) derivative of a term in (chosen - rejected): +d for the chosen, -d for the rejected."""
    return torch.stack([d_margin, -d_margin], dim=1)


def dpo_pairs(logp, n, ref, *, beta, gamma, nll_scale):
    margin = beta * ((logp[:, 0] - ref[:, 0]) - (logp[:, 1] - ref[:, 1]))
    return -F.logsigmoid(margin), _sides(-beta * torch.sigmoid(-margin))


def simpo_pairs(logp, n, ref, *, beta, gamma, nll_scale):
    n = n.clamp(min=1)
    avg = logp / n
    margin = beta * (avg[:, 0] - avg[:, 1]) - gamma
    return -F.logsigmoid(margin), _sides(-beta * torch.sigmoid(-margin)) / n


def orpo_pairs(logp, n, ref, *, beta, gamma, nll_scale):
    n = n.clamp(min=1)
    avg = logp / n
    capped = avg.clamp(max=ORPO_MAX_AVG_LOGP)
    odds = capped - log1mexp(capped)
    x = odds[:, 0] - odds[:, 1]
    d_odds = torch.where(avg <= ORPO_MAX_AVG_LOGP, 1 / -torch.expm1(capped), 0.0)  # 1 / (1 - exp(a))
    d_logp = _sides(-beta * torch.sigmoid(-x)) * d_odds / n
    d_logp[:, 0] -= nll_scale
    return -beta * F.logsigmoid(x) - nll_scale * logp[:, 0], d_logp


PAIR_LOSSES: dict[str, PairLoss] = {"dpo": dpo_pairs, "orpo": orpo_pairs, "simpo": simpo_pairs}


# --------------------------------------------------------------------------------------------------
# The chunk loop over pairs.


def chunk_pairs_for(n_pairs: int, seq_len: int, vocab: int, dtype: torch.dtype, budget: int | None = None) -> int:
    """Pairs per chunk: as many as have their 2 T x V logits in ``budget`` bytes (default
    :data:`CHUNK_BUDGET_BYTES`), at least one, at most B."""
    budget = CHUNK_BUDGET_BYTES if budget is None else budget
    per_pair = 2 * seq_len * vocab * torch.empty((), dtype=dtype).element_size()
    return max(1, min(n_pairs, budget // max(per_pair, 1)))


def _pair_order(x: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """(2B, T, ...) in caller order -> (2B * T, ...) rows in pair order (a copy unless B <= 1)."""
    return x.reshape(2, n_pairs, *x.shape[1:]).transpose(0, 1).reshape(-1, *x.shape[2:])


def _by_pair(per_sequence: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """(2B,) values in caller order -> (B, 2) [chosen, rejected]."""
    return per_sequence.view(2, n_pairs).t()


def _sequence_logps(token_losses: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per-position -log p (fp32), sequence after sequence -> per-sequence log p (float64)."""
    return -token_losses.view(-1, seq_len).sum(dim=1, dtype=torch.float64)


def _reference_logps(ref_hidden, ref_weight, target, options, chunk_rows):
    """(2B,) float64 log-probabilities of the targets under the reference model, in caller order, no gradient."""
    rows = ref_hidden.reshape(-1, ref_hidden.shape[-1])
    flat_target = target.reshape(-1).contiguous()
    token_losses = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)

    def step(z, chunk, write_grad):
        _token_losses(z, flat_target[chunk], token_losses[chunk], options)

    if rows.shape[0] == 0:  # no positions: every sequence scores 0
        return torch.zeros(target.shape[0], dtype=torch.float64, device=rows.device)
    chunked_linear_loss(rows, ref_weight, step, chunk=chunk_rows)
    return _sequence_logps(token_losses, target.shape[1])


def _forward(hidden, weight, target, ref_hidden, ref_weight, loss, beta, gamma, ignore_index, chunk_pairs,
             accumulation, needs):  # fmt: skip
    """(fp32 loss, dh (2B T, H) in caller order or None, dW accumulator or None)."""
    n_sequences, seq_len, width = hidden.shape
    n_pairs, vocab = n_sequences // 2, weight.shape[0]
    check_target(target, hidden.shape[:-1], vocab, ignore_index)  # before anything is computed
    options = LossOptions(ignore_index=ignore_index)
    kept = (target != ignore_index).sum(dim=1, dtype=torch.float64)  # (2B,)
    n = _by_pair(kept, n_pairs)
    nll_scale = n_pairs / kept[:n_pairs].sum().clamp(min=1)
    pairs = chunk_pairs or chunk_pairs_for(n_pairs, seq_len, vocab, hidden.dtype)
    chunk_rows = 2 * seq_len * pairs
    ref = None
    if ref_hidden is not None:
        ref = _by_pair(_reference_logps(ref_hidden, ref_weight, target, options, chunk_rows), n_pairs)
    pair_loss = PAIR_LOSSES[loss]
    # DPO's and SimPO's dl/dlogp are beta times a number of order 1: beta goes on the matmuls with the 1/B, so
    # that a small beta does not push the fp16 gradient written over the logits below fp16's range.
    common_factor = beta if loss in ("dpo", "simpo") and beta > 0 else 1.0
    terms = torch.zeros(n_pairs, dtype=torch.float64, device=hidden.device)
    rows = _pair_order(hidden, n_pairs)
    flat_target = _pair_order(target, n_pairs).contiguous()
    token_losses = torch.zeros(rows.shape[0], dtype=torch.float32, device=hidden.device)
    row_scale = torch.empty(min(chunk_rows, rows.shape[0]), dtype=torch.float32, device=hidden.device)

    def step(z, chunk, write_grad):
        first, last = chunk.start // (2 * seq_len), chunk.stop // (2 * seq_len)
        _token_losses(z, flat_target[chunk], token_losses[chunk], options)
        logp = _sequence_logps(token_losses[chunk], seq_len).view(-1, 2)
        ref_k = None if ref is None else ref[first:last]
        terms[first:last], d_logp = pair_loss(logp, n[first:last], ref_k, beta=beta, gamma=gamma, nll_scale=nll_scale)
        if write_grad:  # dz = (1/B) (-dl/dlogp) (softmax - onehot), with common_factor / B on the matmuls
            scale = row_scale[: z.shape[0]].view(-1, seq_len)
            scale.copy_((-d_logp / common_factor).reshape(-1, 1).expand(-1, seq_len))
            _token_losses(z, flat_target[chunk], token_losses[chunk], options, grad=z, row_scale=scale.view(-1))

    grads = ChunkGrads(hidden=needs[0], weight=needs[1], weight_grad_dtype=accumulation_dtype(weight, accumulation))
    grad_h = grad_w = None
    if rows.shape[0]:
        grad_h, grad_w, _ = chunked_linear_loss(rows, weight, step, chunk=chunk_rows, grads=grads,
                                                grad_scale=common_factor / n_pairs)  # fmt: skip
    else:  # no positions at all (T = 0 or B = 0): every sequence scores 0, nothing depends on the weights
        empty = torch.zeros(n_pairs, 2, dtype=torch.float64, device=hidden.device)
        terms = pair_loss(empty, n, ref, beta=beta, gamma=gamma, nll_scale=nll_scale)[0]
        grad_h = torch.zeros(rows.shape, dtype=hidden.dtype, device=hidden.device) if needs[0] else None
        if needs[1]:
            grad_w = torch.zeros(weight.shape, dtype=grads.weight_grad_dtype, device=weight.device)
    if grad_h is not None:  # back to the caller's row order
        grad_h = grad_h.view(n_pairs, 2, seq_len, width).transpose(0, 1).reshape(n_sequences * seq_len, width)
    total = (terms.sum() / max(n_pairs, 1)).to(torch.float32)
    return total, grad_h, grad_w


def _or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Operators return tensors, never None: a gradient nobody asked for is an empty tensor."""
    return like.new_empty(0) if grad is None else grad


# --------------------------------------------------------------------------------------------------
# The PyTorch operator (one for the three losses) and its autograd (an autograd.Function, as for the fused
# linear cross-entropy: the backward scales the operator's outputs in place).


@torch.library.custom_op("liger_lab::fused_linear_preference", mutates_args=())
def fused_linear_preference_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ref_hidden: torch.Tensor | None,
    ref_weight: torch.Tensor | None,
    loss: str,
    beta: float,
    gamma: float,
    ignore_index: int,
    chunk_pairs: int | None,
    accumulation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 loss, dh (2B T, H), dW accumulator); a gradient not in ``needs`` (hidden, weight) is empty."""
    total, grad_h, grad_w = _forward(
        hidden, weight, target, ref_hidden, ref_weight, loss, beta, gamma, ignore_index, chunk_pairs, accumulation,
        needs,
    )  # fmt: skip
    return total, _or_empty(grad_h, hidden), _or_empty(grad_w, weight)


@fused_linear_preference_op.register_fake
def _(hidden, weight, target, ref_hidden, ref_weight, loss, beta, gamma, ignore_index, chunk_pairs, accumulation,
      needs):  # fmt: skip
    grad_h = hidden.new_empty(hidden.shape[:-1].numel(), hidden.shape[-1]) if needs[0] else hidden.new_empty(0)
    grad_w = weight.new_empty(weight.shape, dtype=accumulation_dtype(weight, accumulation)) if needs[1] else None
    return hidden.new_empty((), dtype=torch.float32), grad_h, _or_empty(grad_w, weight)


class FusedLinearPreferenceFunction(torch.autograd.Function):
    """Gradients made in the forward; the backward scales them by the upstream gradient. The reference
    model's tensors and the target get none."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ref_hidden, ref_weight, arguments):
        needs = arguments[-1]
        ctx.needs, ctx.hidden_shape, ctx.weight_dtype = (needs[0], needs[1], False), hidden.shape, weight.dtype
        total, grad_h, grad_w = torch.ops.liger_lab.fused_linear_preference(
            hidden, weight, target, ref_hidden, ref_weight, *arguments
        )
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, _ = finish_grads(*ctx.saved_tensors, None, grad_loss, ctx)
        return None if grad_h is None else grad_h.detach(), grad_w, None, None, None, None


# --------------------------------------------------------------------------------------------------
# Public functions.


def _check_number(name: str, value: float, *, non_negative: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} is {value!r}: expected a finite number")
    if non_negative and value < 0:
        raise ValueError(f"{name} is {value}: expected a number >= 0")
    return float(value)


def _check_head(hidden_name, hidden, weight_name, weight, n_sequences_like=None):
    check_float(hidden_name, hidden)
    check_float(weight_name, weight)
    if hidden.dim() != 3:
        raise ValueError(
            f"{hidden_name} has shape {tuple(hidden.shape)}: expected (2B, T, H), rows [0, B) the chosen and "
            f"[B, 2B) the rejected sequences"
        )
    if n_sequences_like is not None and hidden.shape[:2] != n_sequences_like:
        raise ValueError(
            f"{hidden_name} has shape {tuple(hidden.shape)}: expected ({n_sequences_like[0]}, {n_sequences_like[1]}, "
            f"H_ref), the sequences of hidden"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{weight_name} has shape {tuple(weight.shape)}: expected (V, {hidden.shape[-1]}) with V >= 1, the "
            f"hidden size being the last dimension of {hidden_name} {tuple(hidden.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"expected one dtype for {hidden_name} and {weight_name}, got {hidden.dtype} and {weight.dtype}"
        )


def _preference(loss, hidden, weight, target, ref_hidden, ref_weight, *, beta, gamma, ignore_index, chunk_pairs,
                accumulation):  # fmt: skip
    """Validate everything (ValueError before any work), then run the operator under autograd."""
    check_loss_options(LossOptions(ignore_index=ignore_index))
    beta = _check_number("beta", beta, non_negative=True)
    gamma = _check_number("gamma", gamma, non_negative=False)
    _check_head("hidden", hidden, "weight", weight)
    if hidden.shape[0] % 2:
        raise ValueError(
            f"hidden has {hidden.shape[0]} sequences: expected an even number 2B, rows [0, B) chosen and [B, 2B) "
            f"rejected responses to the same B prompts"
        )
    if loss == "dpo":
        _check_head("ref_hidden", ref_hidden, "ref_weight", ref_weight, hidden.shape[:2])
        if ref_weight.shape[0] != weight.shape[0]:
            raise ValueError(
                f"ref_weight has {ref_weight.shape[0]} rows: expected the policy's vocabulary size {weight.shape[0]}"
            )
    check_target_tensor(target, hidden.shape[:-1])
    accumulation = check_chunk_options("chunk_pairs", chunk_pairs, accumulation)
    if ref_hidden is not None:  # a frozen model: constants of the call
        ref_hidden, ref_weight = ref_hidden.detach(), ref_weight.detach()
    grad_on = torch.is_grad_enabled()
    needs = [grad_on and hidden.requires_grad, grad_on and weight.requires_grad]
    arguments = (loss, beta, gamma, ignore_index, chunk_pairs, accumulation, needs)
    if any(needs):
        return FusedLinearPreferenceFunction.apply(hidden, weight, target, ref_hidden, ref_weight, arguments)
    return torch.ops.liger_lab.fused_linear_preference(hidden, weight, target, ref_hidden, ref_weight, *arguments)[0]


_COMMON_DOC = """
    hidden (2B, T, H): rows [0, B) the chosen responses, rows [B, 2B) the rejected responses to the same
    prompts; weight (V, H) the policy's ``lm_head`` weight; target (2B, T) the token each position predicts
    (already shifted), ``ignore_index`` on prompt and padding positions. Returns a float32 scalar; gradients
    reach ``hidden`` and ``weight``. The logits are never held for the whole batch: the loop runs over
    chunks of complete pairs (``chunk_pairs`` of them; default from :data:`CHUNK_BUDGET_BYTES`), and
    ``accumulation`` sums dW over chunks as in :func:`liger_lab.fused_linear_cross_entropy`. A sequence with
    every position ignored scores logp = 0, avg = 0. Odd 2B, mismatched shapes or dtypes, or a target out of
    range raise ValueError. The caller's tensors are never modified.
"""


def fused_linear_dpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    *,
    beta: float = 0.1,
    ignore_index: int = -100,
    chunk_pairs: int | None = None,
    accumulation: str | None = None,
) -> torch.Tensor:
    return _preference(
        "dpo", hidden, weight, target, ref_hidden, ref_weight, beta=beta, gamma=0.0, ignore_index=ignore_index,
        chunk_pairs=chunk_pairs, accumulation=accumulation,
    )  # fmt: skip


fused_linear_dpo.__doc__ = (
    """DPO: mean over pairs of -log sigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r))), logp the summed
    log-probability of a sequence's kept targets; ref the same under ``ref_hidden`` (2B, T, H_ref) @
    ``ref_weight.T`` (V, H_ref), a frozen reference model (no gradient, its logits never held beyond a chunk).
"""
    + _COMMON_DOC
)


def fused_linear_orpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    beta: float = 0.1,
    ignore_index: int = -100,
    chunk_pairs: int | None = None,
    accumulation: str | None = None,
) -> torch.Tensor:
    return _preference(
        "orpo", hidden, weight, target, None, None, beta=beta, gamma=0.0, ignore_index=ignore_index,
        chunk_pairs=chunk_pairs, accumulation=accumulation,
    )  # fmt: skip


fused_linear_orpo.__doc__ = (
    """ORPO: the chosen sequences' token-mean NLL minus beta * mean over pairs of log sigmoid(odds_c - odds_r),
    odds = avg - log(1 - exp(avg)), avg a sequence's mean token log-probability, capped at
    :data:`ORPO_MAX_AVG_LOGP` (its odds are infinite at 0).
"""
    + _COMMON_DOC
)


def fused_linear_simpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    ignore_index: int = -100,
    chunk_pairs: int | None = None,
    accumulation: str | None = None,
) -> torch.Tensor:
    return _preference(
        "simpo", hidden, weight, target, None, None, beta=beta, gamma=gamma, ignore_index=ignore_index,
        chunk_pairs=chunk_pairs, accumulation=accumulation,
    )  # fmt: skip


fused_linear_simpo.__doc__ = (
    """SimPO: mean over pairs of -log sigmoid(beta * (avg_c - avg_r) - gamma), avg a sequence's mean token
    log-probability (no reference model, no NLL term).
"""
    + _COMMON_DOC
)
