r"""Preference losses (DPO, ORPO, SimPO, KTO, CPO) on ``hidden @ weight.T`` without the batch's logits.

**The data.** A paired batch holds B prompts, each with a chosen and a rejected response: ``hidden`` is (2B, T, H),
rows [0, B) the chosen sequences and rows [B, 2B) the rejected ones of the same prompts, ``target`` (2B, T) the token
each position predicts (already shifted), ``ignore_index`` on prompt and padding positions. KTO's batch is unpaired:
``hidden`` (B, T, H) holds B completions, each desirable or undesirable (``label`` (B,)). With z = hidden @ weight.T,
a sequence's score is built from its token log-probabilities::

    logp = sum over kept positions t of log_softmax(z_t)[target_t]     (0 for a sequence with none kept)
    avg  = logp / max(n, 1),  n = its number of kept positions

and the loss is a mean over the units b of the batch (pairs: chosen c, rejected r; KTO: completions), with sigma the
logistic function and ref a sequence's logp under a frozen reference model (ref_hidden @ ref_weight.T, or given)::

    DPO    TRL 1.16's DPOTrainer, d = (logp_c - ref_c) - (logp_r - ref_r), m = beta d, eps = label_smoothing:
             sigmoid  -log sigma(m)
             hinge    relu(1 - m)
             ipo      ((logp_c - ref_c) / n_c - (logp_r - ref_r) / n_r - 1 / (2 beta))^2
             robust   (-(1 - eps) log sigma(m) + eps log sigma(-m)) / (1 - 2 eps)
    SimPO  -log sigma(beta * (avg_c - avg_r) - gamma)
    ORPO   -beta * log sigma(odds(avg_c) - odds(avg_r)),  odds(a) = a - log(1 - exp(a)),  plus the NLL term
    CPO    TRL 1.16's CPOTrainer, u = avg (ipo, simpo) or logp (sigmoid, hinge), the reward
           r(u) = (1 - exp(-alpha u)) / alpha (AlphaPO; r = u for alpha = 0), x = r(u_c) - r(u_r):
             sigmoid  -(1 - eps) log sigma(beta x) - eps log sigma(-beta x)
             simpo    the same with x - gamma / beta in place of x
             hinge    relu(1 - beta x)
             ipo      (x - 1 / (2 beta))^2
           plus cpo_alpha times the NLL term
    KTO    TRL 1.16's KTOTrainer, per completion with lr = logp - ref, s = +1 (desirable) or -1 (undesirable) and w
           desirable_weight or undesirable_weight:  w * (1 - sigma(s beta (lr - z0))),  z0 the KL estimate
           (loss_type="kto") or 0 ("apo_zero_unpaired")

The NLL term (ORPO, CPO) is the chosen sequences' NLL per kept token, -sum_b logp_c / (kept chosen tokens): TRL's
cross-entropy over the chosen labels. ORPO may take it over more positions than the odds (``nll_target``: TRL's
ORPOTrainer takes it over prompt and response, the odds over the response only).

``log(1 - exp(a))`` is evaluated as ``log(-expm1(a))`` near 0 and ``log1p(-exp(a))`` further out, each accurate
on its side (1 - exp(a) itself loses every digit as a approaches 0). It is -inf at a = 0 (a sequence that is
certain, or one with no kept position), so ORPO caps ``avg`` at :data:`ORPO_MAX_AVG_LOGP` before taking the
odds (no gradient flows through the cap). A sequence whose positions are all ignored has logp = 0 and avg = 0:
no evidence, and a finite value for every loss.

**The gradient.** Write L = (1/U) sum_b l_b over the U units, each l_b a function of its unit's logp (the NLL term
is shared out as -U logp_c / (kept chosen tokens) per pair). Only the sequence scores couple the rows, and
d log_softmax(z)[y] / dz = onehot(y) - softmax(z), so for a position t of sequence s::

    dL/dz_t = (1/U) * dl/dlogp_s * dlogp_s/dz_t = (1/U) * (-dl/dlogp_s) * (softmax(z_t) - onehot(target_t))

which is the cross-entropy gradient of the position, scaled by one number per sequence. Per loss, with
l'(m) the derivative of the margin loss (-sigma(-m) for -log sigma(m); -[m < 1] for relu(1 - m), as
``torch.relu``'s backward; (-(1 - eps) sigma(-m) - eps sigma(m)) / (1 - 2 eps) for the robust loss)::

    DPO    dl/dlogp_c = beta l'(m) = -dl/dlogp_r;   ipo: dl/dlogp_c = 2 q / n_c, dl/dlogp_r = -2 q / n_r, q the bracket
    SimPO  dl/dlogp_c = -beta sigma(-m) / n_c,  dl/dlogp_r = +beta sigma(-m) / n_r
    ORPO   dl/dlogp_c = -beta sigma(-x) odds'(avg_c) / n_c,  dl/dlogp_r = +beta sigma(-x) odds'(avg_r) / n_r,
           odds'(a) = 1 / (1 - exp(a)), x = odds_c - odds_r
    CPO    dl/dlogp_c = dl/dx * exp(-alpha u_c) * du_c/dlogp_c,  the rejected side with the opposite sign
           (du/dlogp = 1 / n or 1; dl/dx = beta l'(beta x), -beta [beta x < 1] or 2 (x - 1 / (2 beta)))
    KTO    dl/dlogp = -w s beta sigma(m) sigma(-m),  m = s beta (lr - z0)
    NLL    -weight * U / (kept chosen tokens) at each of the chosen sequences' NLL positions

Each loss is a small function from the per-sequence (logp, n, ref, ...) of some units to their terms l_b and
dl/dlogp (:data:`UNIT_LOSSES`); everything else is shared. The reference's scores, the KTO flags and its KL estimate
are constants: no gradient reaches them.

**Chunking over units.** The scale of a sequence's rows is known only once the whole sequence, and its
partner, have been scored. So the chunk loop (:func:`liger_lab.ops.chunked.chunked_linear_loss`) runs over
*complete units*: the hidden rows of a paired batch are gathered into pair order (chosen of prompt 0, rejected of
prompt 0, chosen of prompt 1, ...; an N x H copy, small next to N x V logits, and none at all for B = 1; KTO's rows
are units as they stand) and each chunk holds the kT rows of k units. The chunk's step:

1. the cross-entropy kernel (:func:`liger_lab.ops.cross_entropy.cross_entropy_rows`) reads the chunk's logits
   once and writes each position's -log p(target) (ignored positions: 0);
2. the positions are summed per sequence (logp), and the unit function gives the chunk's terms and
   dl/dlogp for each sequence;
3. the kernel runs again over the same logits with the per-row scale -dl/dlogp of each row's sequence and
   writes (softmax - onehot) * scale over z, in fp32 registers, rounded once to the logits' dtype.

The loop then makes dW += dz.T @ h and dh = dz @ W for the chunk, with the 1/U of the mean (and beta, where it is a
factor of every row's scale and no NLL term is added) on the matmuls' ``alpha`` rather than in the fp16/bf16 dz.
Running the kernel twice reads the logits three times and writes them once; computing the unscaled gradient
and rescaling it afterwards (``scale_rows``) would read three times and write twice, and would round the
gradient to fp16/bf16 before scaling it. Finally dh is put back into the caller's row order.

With ``nll_target`` a chosen position may count for the NLL and not for the odds (a prompt token). The kernel takes
one target per position, so the two must agree where both keep a position (a ValueError in the interpreter; NaN
loss and gradients on the GPU, which checks without making the host wait), and the row scale is then set per
position: -dl/dlogp where the odds count it, plus the NLL's weight where the NLL does.

The reference's scores come first, from the same chunk loop over ``ref_hidden @ ref_weight.T`` with no gradient:
only per-position log-probabilities are kept (N floats), never the reference's logits beyond one chunk. Or the
caller gives them (``ref_logps``, as TRL's ``precompute_ref_log_probs`` does).

**Sequence scores for the metrics.** The operator also returns each sequence's score in float32, the
``chosen_logps`` / ``rejected_logps`` a TRL trainer logs (logp, or avg for the length-normalised losses: ORPO, SimPO,
CPO's ipo and simpo), and the reference's logp when there is a reference. They are by-products of step 2, so cost
nothing, and are not differentiable: a gradient through them would need the logits again.

**Per-token values for the metrics** (``token_outputs``). TRL's DPO and KTO trainers also log statistics of every
completion token (the entropy, the mean logit, whether the target is the argmax), which their fused head computes
beside the log-probabilities. Asked for them, the operator scores the tokens with the RL head's kernels
(:mod:`liger_lab.ops.logprobs`) in place of the cross-entropy's: in step 1 its forward kernel writes each position's
logp and the statistics asked for, and keeps (m, log s) per row (8 bytes); in step 3 its gradient kernel writes
dz = (-dl/dlogp) (softmax - onehot) from them, the same per-row scale. The matmuls are the same three; the
values (N floats each, put back in the caller's order) are metrics, not differentiable. This is what
:func:`liger_lab.patch_trl` serves those trainers' losses with.

**Memory.** One chunk of logits (kT x V), the N x H unit-ordered copy of hidden and the N x H gradient (put
back in the caller's order by one more N x H copy when B > 1). :data:`CHUNK_BUDGET_BYTES` sets how many units a
chunk holds (at least one: with T = 1024, V = 128256 in bf16 a single pair's logits are 501 MiB). dW is accumulated
over chunks as in the fused linear cross-entropy (``accumulation``). Gradients are made in the forward; the backward
multiplies them by the upstream gradient. benchmarks/notes/distillation_and_preference.md holds the H200 run at the
default budget.

**Operators.** One, ``liger_lab::fused_linear_preference``, for every loss: its ``loss`` argument picks the unit
loss. Its gradients, their autograd and the validation of the head are the skeleton's (:mod:`liger_lab.ops.chunked`);
each loss's options are checked once, by a function the float64 references share (:func:`dpo_options`,
:func:`orpo_options`, :func:`simpo_options`, :func:`cpo_options`, :func:`kto_options`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from liger_lab import runtime
from liger_lab.formulas import (
    HEAD_OUTPUTS,
    ORPO_MAX_AVG_LOGP,
    TOKEN_OUTPUTS,
    LossOptions,
    PreferenceOptions,
    averages,
    check_ignore_index,
    check_number,
    check_output_names,
    cpo_options,
    dpo_options,
    kl_estimate,
    kto_options,
    log1mexp,
    orpo_options,
    simpo_options,
)
from liger_lab.ops import chunked
from liger_lab.ops.cross_entropy import (
    check_target,
    check_target_tensor,
    nan_if_out_of_range,
)
from liger_lab.ops.cross_entropy import cross_entropy_rows as _token_losses
from liger_lab.ops.logprobs import HeadOutputs, logprob_grad_rows, logprob_rows, wanted_output
from liger_lab.ops.operators import define

CHUNK_BUDGET_BYTES = 240 * chunked.MIB
"""Bytes of one chunk of logits; a chunk holds as many complete units (pairs, KTO's completions) as fit, at least
one."""
LOSSES = ("dpo", "orpo", "simpo", "kto", "cpo")


def group_size(loss: str) -> int:
    """Sequences per unit: KTO's completions stand alone, every other loss scores pairs."""
    return 1 if loss == "kto" else 2


# --------------------------------------------------------------------------------------------------
# The per-unit losses: the scores of k units, each (k, g) float64 (g sequences per unit: [chosen, rejected] for a
# pair), to the units' terms l_b (k,) and dl/dlogp (k, g). The NLL term is added by the caller.


@dataclass
class Scores:
    """Per-sequence inputs of the loss for k units, float64 (k, g); the flags (k, 1) bool, the KL estimate ()."""

    logp: torch.Tensor
    n: torch.Tensor
    ref: torch.Tensor | None = None
    desirable: torch.Tensor | None = None
    kl: torch.Tensor | None = None


UnitLoss = Callable[[Scores, PreferenceOptions], tuple[torch.Tensor, torch.Tensor]]


def _sides(d_margin: torch.Tensor) -> torch.Tensor:
    """(k, 2) derivative of a term in (chosen - rejected): +d for the chosen, -d for the rejected."""
    return torch.stack([d_margin, -d_margin], dim=1)


def _sigmoid_loss(m: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-(1 - eps) log sigma(m) - eps log sigma(-m) and its derivative in m (eps = 0: -log sigma(m) exactly)."""
    value = -(1 - eps) * F.logsigmoid(m) - eps * F.logsigmoid(-m)
    return value, -(1 - eps) * torch.sigmoid(-m) + eps * torch.sigmoid(m)


def _robust_loss(m: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Robust DPO's unbiased estimate under a label flipped with probability eps, and its derivative in m."""
    value = (-(1 - eps) * F.logsigmoid(m) + eps * F.logsigmoid(-m)) / (1 - 2 * eps)
    return value, (-(1 - eps) * torch.sigmoid(-m) - eps * torch.sigmoid(m)) / (1 - 2 * eps)


def _hinge_loss(m: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """relu(1 - m) and its derivative in m: -1 where 1 - m > 0, else 0 (``torch.relu``'s backward: 0 at the kink)."""
    return torch.relu(1 - m), -(m < 1).to(m.dtype)


MARGIN_LOSSES = {"sigmoid": _sigmoid_loss, "simpo": _sigmoid_loss, "robust": _robust_loss, "hinge": _hinge_loss}


def dpo_pairs(s: Scores, o: PreferenceOptions) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = s.logp - s.ref
    if o.loss_type == "ipo":  # TRL normalises IPO's log-ratios by the completion lengths
        n = s.n.clamp(min=1)
        q = (ratio[:, 0] / n[:, 0] - ratio[:, 1] / n[:, 1]) - 1 / (2 * o.beta)
        return q * q, _sides(2 * q) / n
    margin = o.beta * (ratio[:, 0] - ratio[:, 1])
    value, d_margin = MARGIN_LOSSES[o.loss_type](margin, o.label_smoothing)
    return value, _sides(o.beta * d_margin)


def simpo_pairs(s: Scores, o: PreferenceOptions) -> tuple[torch.Tensor, torch.Tensor]:
    n = s.n.clamp(min=1)
    avg = s.logp / n
    margin = o.beta * (avg[:, 0] - avg[:, 1]) - o.gamma
    return -F.logsigmoid(margin), _sides(-o.beta * torch.sigmoid(-margin)) / n


def orpo_pairs(s: Scores, o: PreferenceOptions) -> tuple[torch.Tensor, torch.Tensor]:
    n = s.n.clamp(min=1)
    avg = s.logp / n
    capped = avg.clamp(max=ORPO_MAX_AVG_LOGP)
    odds = capped - log1mexp(capped)
    x = odds[:, 0] - odds[:, 1]
    d_odds = torch.where(avg <= ORPO_MAX_AVG_LOGP, 1 / -torch.expm1(capped), 0.0)  # 1 / (1 - exp(a))
    return -o.beta * F.logsigmoid(x), _sides(-o.beta * torch.sigmoid(-x)) * d_odds / n


def cpo_pairs(s: Scores, o: PreferenceOptions) -> tuple[torch.Tensor, torch.Tensor]:
    n = s.n.clamp(min=1) if averages(o) else torch.ones_like(s.n)
    u = s.logp / n
    reward, d_reward = u, torch.ones_like(u)
    if o.alpha != 0:  # AlphaPO: (1 - p^-alpha) / alpha with p = exp(u), without forming p^-alpha - 1 by subtraction
        reward, d_reward = -torch.expm1(-o.alpha * u) / o.alpha, torch.exp(-o.alpha * u)
    x = reward[:, 0] - reward[:, 1]
    if o.loss_type == "ipo":
        q = x - 1 / (2 * o.beta)
        value, d_x = q * q, 2 * q
    else:
        if o.loss_type == "simpo":
            x = x - o.gamma / o.beta
        value, d_margin = MARGIN_LOSSES[o.loss_type](o.beta * x, o.label_smoothing)
        d_x = o.beta * d_margin
    return value, _sides(d_x) * d_reward / n


def kto_singles(s: Scores, o: PreferenceOptions) -> tuple[torch.Tensor, torch.Tensor]:
    sign = torch.where(s.desirable, 1.0, -1.0).to(s.logp.dtype)
    shift = s.kl if o.loss_type == "kto" and s.kl is not None else 0.0
    m = sign * o.beta * ((s.logp - s.ref) - shift)
    weight = torch.where(s.desirable, o.desirable_weight, o.undesirable_weight).to(s.logp.dtype)
    low, high = torch.sigmoid(-m), torch.sigmoid(m)  # 1 - sigma(m) as sigma(-m): exact where sigma(m) rounds to 1
    return (weight * low)[:, 0], -weight * sign * o.beta * high * low


UNIT_LOSSES: dict[str, UnitLoss] = {
    "dpo": dpo_pairs, "orpo": orpo_pairs, "simpo": simpo_pairs, "kto": kto_singles, "cpo": cpo_pairs,
}  # fmt: skip


def beta_factor(o: PreferenceOptions) -> float:
    """The factor every row's scale shares, which rides on the matmuls' alpha: beta where dl/dlogp is beta times a
    number of order 1 and no NLL term adds to it, so that a small beta does not push the fp16 gradient written over
    the logits below fp16's range; else 1."""
    factored = o.loss_type != "ipo" and o.loss in ("dpo", "simpo", "kto", "cpo")
    return o.beta if factored and o.beta > 0 and o.nll_weight == 0 else 1.0


# --------------------------------------------------------------------------------------------------
# The chunk loop over units.


def chunk_pairs_for(
    n_pairs: int, seq_len: int, vocab: int, dtype: torch.dtype, budget: int | None = None, *, group: int = 2
) -> int:
    """Units per chunk: as many as have their ``group`` T x V logits (a pair's two, by default) in ``budget`` bytes
    (default :data:`CHUNK_BUDGET_BYTES`), at least one, at most ``n_pairs``."""
    budget = CHUNK_BUDGET_BYTES if budget is None else budget
    return chunked.rows_per_chunk(n_pairs, group * seq_len * vocab * dtype.itemsize, budget, align=1)


def _unit_order(x: torch.Tensor, n_units: int, group: int) -> torch.Tensor:
    """(g U, T, ...) in caller order -> (g U T, ...) rows in unit order (a copy unless U <= 1 or g = 1)."""
    return x.reshape(group, n_units, *x.shape[1:]).transpose(0, 1).reshape(-1, *x.shape[2:])


def _by_unit(per_sequence: torch.Tensor, n_units: int, group: int) -> torch.Tensor:
    """(g U,) values in caller order -> (U, g): [chosen, rejected] of each pair, or KTO's (U, 1)."""
    return per_sequence.view(group, n_units).t()


def _sequence_logps(token_losses: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per-position -log p (fp32), sequence after sequence -> per-sequence log p (float64)."""
    return -token_losses.view(-1, seq_len).sum(dim=1, dtype=torch.float64)


def _reference_logps(ref_hidden, ref_weight, target, options, chunk_rows):
    """(N,) float64 log-probabilities of the targets under the reference model, in caller order, no gradient."""
    rows = ref_hidden.reshape(-1, ref_hidden.shape[-1])
    flat_target = target.reshape(-1).contiguous()
    token_losses = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)

    def step(z, chunk, write_grad):
        _token_losses(z, flat_target[chunk], token_losses[chunk], options)

    if rows.shape[0] == 0:  # no positions: every sequence scores 0
        return torch.zeros(target.shape[0], dtype=torch.float64, device=rows.device)
    chunked.chunked_linear_loss(rows, ref_weight, step, chunk=chunk_rows)
    return _sequence_logps(token_losses, target.shape[1])


def _nan_if_disagreeing(target: torch.Tensor, nll_target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """An fp32 scalar on the device: 1, or NaN where a position kept by both targets names two tokens (ValueError
    where a read costs the host nothing, as :func:`liger_lab.ops.cross_entropy.check_target` does)."""
    both = (target != ignore_index) & (nll_target != ignore_index)
    disagreeing = (both & (target != nll_target)).sum()
    if not runtime.HOST_READS_WAIT and disagreeing.tolist():
        raise ValueError(
            f"nll_target differs from target at {disagreeing.tolist()} position(s) that both keep: expected the "
            f"same token wherever both are not ignore_index={ignore_index} (nll_target may only add positions)"
        )
    return torch.where(disagreeing > 0, math.nan, 1.0).to(torch.float32)


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ref_hidden: torch.Tensor | None,
    ref_weight: torch.Tensor | None, ref_logps: torch.Tensor | None, label: torch.Tensor | None,
    kl: torch.Tensor | None, nll_target: torch.Tensor | None, loss: str, loss_type: str, beta: float, gamma: float,
    label_smoothing: float, alpha: float, nll_weight: float, desirable_weight: float, undesirable_weight: float,
    ignore_index: int, chunk_units: int | None, per_token: bool, wanted: list[bool], accumulation: str,
    needs: list[bool], total: torch.Tensor, sequence_scores: torch.Tensor, reference_scores: torch.Tensor,
    token_logps: torch.Tensor, entropies: torch.Tensor, lssp: torch.Tensor, means: torch.Tensor, top1: torch.Tensor,
    grad_hidden: torch.Tensor, grad_weight: torch.Tensor, grad_bias: torch.Tensor, owed: torch.Tensor,
) -> None:  # fmt: skip
    """The operator's work, into its outputs: the fp32 loss; each sequence's fp32 score in caller order (logp, or
    avg for the length-normalised losses) and the reference's logp (empty without a reference); with ``per_token``
    each position's logp and the outputs of :data:`~liger_lab.formulas.HEAD_OUTPUTS` that ``wanted`` flags, in
    caller order (each empty when not asked for); the gradients ``needs`` asks for, dh in caller order; the fp32
    factor they still owe: 1, or NaN for a bad target."""
    o = PreferenceOptions(loss, loss_type, beta, gamma, label_smoothing, alpha, nll_weight, desirable_weight,
                          undesirable_weight)  # fmt: skip
    n_sequences, seq_len, width = hidden.shape
    group = group_size(o.loss)
    n_units, vocab, device = n_sequences // group, weight.shape[0], hidden.device
    kept_positions = target != ignore_index
    token_target = target
    if nll_target is not None:  # one target per position: the chosen rows' NLL positions join the odds' ones
        chosen = torch.where(kept_positions[:n_units], target[:n_units], nll_target)
        token_target = torch.cat([chosen, target[n_units:]])
    # Before anything is computed: a ValueError in the interpreter; on the GPU, where the counts stay on the
    # device, a target out of range makes the loss and the gradients NaN (check_target).
    counts = check_target(token_target, hidden.shape[:-1], vocab, ignore_index)
    valid = nan_if_out_of_range(counts)
    if nll_target is not None:
        valid = valid * _nan_if_disagreeing(target[:n_units], nll_target, ignore_index)
    options = LossOptions(ignore_index=ignore_index)
    kept = kept_positions.sum(dim=1, dtype=torch.float64)  # (N,)
    n = _by_unit(kept, n_units, group)
    nll_positions = None
    if o.nll_weight:  # the NLL's weight per kept position: nll_weight * U / (kept chosen tokens)
        nll_positions = kept_positions[:n_units] if nll_target is None else nll_target != ignore_index
        nll_scale = o.nll_weight * n_units / nll_positions.sum(dtype=torch.float64).clamp(min=1)
    units = chunk_units or chunk_pairs_for(n_units, seq_len, vocab, hidden.dtype, group=group)
    unit_rows = group * seq_len
    chunk_rows = unit_rows * units
    ref_sequences = None
    if ref_hidden is not None:
        ref_sequences = _reference_logps(ref_hidden, ref_weight, target, options, chunk_rows)
    elif ref_logps is not None:
        ref_sequences = ref_logps.to(torch.float64)
    ref = None if ref_sequences is None else _by_unit(ref_sequences, n_units, group)
    desirable = None if label is None else (label != 0).view(-1, 1)
    kl = None if kl is None else kl.to(torch.float64).reshape(())
    unit_loss = UNIT_LOSSES[o.loss]
    common_factor = beta_factor(o)
    terms = torch.zeros(n_units, dtype=torch.float64, device=device)
    scores = torch.zeros(n_units, group, dtype=torch.float64, device=device)
    rows = _unit_order(hidden, n_units, group)
    flat_target = _unit_order(token_target, n_units, group).contiguous()
    # With nll_target, which positions the odds score and which the NLL does, in unit order (the NLL's: chosen only).
    scored = nll_mask = None
    if nll_target is not None:
        scored = _unit_order(kept_positions, n_units, group).reshape(-1)
        nll_mask = _unit_order(torch.cat([nll_positions, torch.zeros_like(nll_positions)]), n_units, group)
        nll_mask = nll_mask.reshape(-1)
    token_losses = torch.zeros(rows.shape[0], dtype=torch.float32, device=device)
    row_scale = torch.empty(min(chunk_rows, rows.shape[0]), dtype=torch.float32, device=device)
    # Buffers written in unit order: the caller's own, viewed so, where the two orders agree (one unit, or units of
    # one sequence), else new ones put back in the caller's order after the loop.
    same_order = n_units <= 1 or group == 1

    def unit_buffer(out: torch.Tensor) -> torch.Tensor:
        if same_order:
            return _unit_order(out, n_units, group)
        return out.new_empty((out.shape[0] * out.shape[1], *out.shape[2:]))

    def put_back(buffer: torch.Tensor, out: torch.Tensor) -> None:
        if not same_order:
            shape = out.shape[1:]
            out.view(group, n_units, *shape).copy_(buffer.view(n_units, group, *shape).transpose(0, 1))

    # With per_token the RL head's kernels score the tokens: their pass also gives the other outputs, and they keep
    # (m, log s) per row for dz.
    caller_extras = HeadOutputs(*(out if asked else None for out, asked in zip((entropies, lssp, means, top1), wanted,
                                                                                strict=True)))  # fmt: skip
    extras = HeadOutputs(*(None if out is None else unit_buffer(out) for out in caller_extras.tensors()))
    logp_rows = unit_buffer(token_logps) if per_token else None
    stats = torch.empty(row_scale.shape[0], 2, dtype=torch.float32, device=device) if per_token else None

    def score(z: torch.Tensor, chunk: slice) -> None:
        """-log p of the chunk's targets into token_losses (with ``per_token``, the rest of the outputs too)."""
        if not per_token:
            _token_losses(z, flat_target[chunk], token_losses[chunk], options)
            return
        logprob_rows(z, flat_target[chunk], logp_rows[chunk], stats[: z.shape[0]], counts, 1.0, ignore_index,
                     extras=extras.rows(chunk))  # fmt: skip
        torch.neg(logp_rows[chunk], out=token_losses[chunk])

    def write_dz(z: torch.Tensor, chunk: slice, scale: torch.Tensor) -> None:
        """(softmax - onehot) * scale over z, ``scale`` = -dl/dlogp of each row."""
        if per_token:
            logprob_grad_rows(z, flat_target[chunk], stats[: z.shape[0]], -scale, 1.0, ignore_index)
        else:
            _token_losses(z, flat_target[chunk], token_losses[chunk], options, grad=z, row_scale=scale)

    def unit_terms(first, last, logp, nll_logp):
        s = Scores(logp, n[first:last], None if ref is None else ref[first:last],
                   None if desirable is None else desirable[first:last], kl)  # fmt: skip
        value, d_logp = unit_loss(s, o)
        if o.loss == "kto":  # TRL's nanmean: a completion whose loss is NaN drops out, its gradient too
            d_logp = torch.where(value.isnan().view(-1, 1), 0.0, d_logp)
        if nll_positions is not None:
            value = value - nll_scale * nll_logp
            if nll_mask is None:  # the NLL's positions are the chosen sequence's own: one scale per sequence
                d_logp[:, 0] -= nll_scale
        return value, d_logp

    def step(z, chunk, write_grad):
        first, last = chunk.start // unit_rows, chunk.stop // unit_rows
        score(z, chunk)
        losses = token_losses[chunk]
        odds_losses = losses if scored is None else torch.where(scored[chunk], losses, 0.0)
        logp = _sequence_logps(odds_losses, seq_len).view(-1, group)
        nll_logp = logp[:, 0]
        if nll_mask is not None:
            nll_logp = _sequence_logps(torch.where(nll_mask[chunk], losses, 0.0), seq_len).view(-1, group)[:, 0]
        scores[first:last] = logp
        terms[first:last], d_logp = unit_terms(first, last, logp, nll_logp)
        if write_grad:  # dz = (1/U) (-dl/dlogp) (softmax - onehot), with common_factor / U on the matmuls
            scale = row_scale[: z.shape[0]].view(-1, seq_len)
            per_sequence = (-d_logp / common_factor).reshape(-1, 1)
            if nll_mask is None:
                scale.copy_(per_sequence.expand(-1, seq_len))
            else:  # per position: the odds' scale where they count it, the NLL's weight where it does
                odds_part = torch.where(scored[chunk].view(-1, seq_len), per_sequence, 0.0)
                scale.copy_(odds_part + nll_mask[chunk].view(-1, seq_len) * (nll_scale / common_factor))
            write_dz(z, chunk, scale.view(-1))

    grad_rows = None
    if needs[0]:  # dh is made in unit order
        caller_rows = grad_hidden.view(n_sequences, seq_len, width)
        grad_rows = unit_buffer(caller_rows)
    grads = chunked.ChunkGrads.asked(needs, grad_rows, grad_weight, grad_bias)
    chunked.chunked_linear_loss(rows, weight, step, chunk=max(chunk_rows, 1), grads=grads,
                                grad_scale=common_factor / max(n_units, 1))  # fmt: skip
    if not rows.shape[0]:  # no positions at all (T = 0 or B = 0): every sequence scores 0, nothing depends on weights
        terms = unit_terms(0, n_units, scores, scores[:, 0])[0]
    if grad_rows is not None:
        put_back(grad_rows, caller_rows)
    if per_token:
        for buffer, out in zip((logp_rows, *extras.tensors()), (token_logps, *caller_extras.tensors()), strict=True):
            if out is not None:
                put_back(buffer, out)
    if o.loss == "kto" and n_units:
        # The mean over the completions whose loss is a number (NaN when none is, as TRL's nanmean); the gradients
        # were made with 1 / U and owe U / counted, counted on the device.
        counted = (~terms.isnan()).sum(dtype=torch.float64)
        torch.mul((terms.nansum() / counted).to(torch.float32), valid, out=total)
        torch.mul(valid, (n_units / counted.clamp(min=1)).to(torch.float32), out=owed)
    else:
        torch.mul((terms.sum() / max(n_units, 1)).to(torch.float32), valid, out=total)
        owed.copy_(valid)
    if averages(o):
        scores = scores / n.clamp(min=1)
    sequence_scores.copy_(scores.t().reshape(-1))
    if ref_sequences is not None:
        reference_scores.copy_(ref_sequences)


def _reference_scores(
    hidden: torch.Tensor, ref_hidden: torch.Tensor | None, ref_logps: torch.Tensor | None
) -> torch.Tensor:
    with_reference = ref_hidden is not None or ref_logps is not None
    return hidden.new_empty(hidden.shape[0] if with_reference else 0, dtype=torch.float32)


def _token_logps(hidden: torch.Tensor, target: torch.Tensor, per_token: bool) -> torch.Tensor:
    return hidden.new_empty(target.shape if per_token else (0,), dtype=torch.float32)


FUSED_LINEAR_PREFERENCE_OUTPUTS = {
    "total": lambda hidden: hidden.new_empty((), dtype=torch.float32),
    "sequence_scores": lambda hidden: hidden.new_empty(hidden.shape[0], dtype=torch.float32),
    "reference_scores": _reference_scores,
    "token_logps": _token_logps,
    "entropies": wanted_output(0),
    "lssp": wanted_output(1),
    "means": wanted_output(2),
    "top1": wanted_output(3, torch.bool),
    **chunked.grad_outputs(),
}
FUSED_LINEAR_PREFERENCE = define("fused_linear_preference", _forward, outputs=FUSED_LINEAR_PREFERENCE_OUTPUTS)
"""One operator for every preference loss (its ``loss`` argument picks the unit loss): (loss, sequence scores,
reference logp, per-token logp and the head's other outputs, dh, dW, db, owed factor). The scores and per-token
values are metrics: :func:`run_loss` marks them non-differentiable."""
_LOSSES = {loss: chunked.FusedLoss(f"fused_linear_{loss}", FUSED_LINEAR_PREFERENCE, metrics=7) for loss in LOSSES}


# --------------------------------------------------------------------------------------------------
# Validation: what every loss's tensors must be (each loss's options are checked in liger_lab.formulas, for the
# kernel path and the float64 reference alike).


PAIRED_LAYOUT = "(2B, T, H), rows [0, B) the chosen and [B, 2B) the rejected sequences"
UNPAIRED_LAYOUT = "(B, T, H), B completions each flagged by label"


def _check_reference(ref_hidden, ref_weight, ref_logps, hidden, weight, who, layout):
    """A frozen reference: its head (ref_hidden, ref_weight) or its per-sequence logp (ref_logps), exactly one."""
    if ref_logps is not None:
        if ref_hidden is not None or ref_weight is not None:
            raise ValueError(f"{who} takes the reference as ref_hidden and ref_weight or as ref_logps, not both")
        what = "the reference's log-probability of each sequence, in hidden's row order"
        chunked.check_values("ref_logps", ref_logps, hidden.shape[:1], what)
        return
    if ref_hidden is None or ref_weight is None:
        raise ValueError(
            f"{who} needs a reference model: ref_hidden and ref_weight (its hidden states and lm_head weight), or "
            f"ref_logps (its log-probability of each sequence, precomputed)"
        )
    names = ("hidden", "weight", "ref_hidden", "ref_weight")
    chunked.check_second_head(hidden, weight, ref_hidden, ref_weight, names=names, layout=layout)


def _check_kl(kl, kl_logps, ref_kl_logps, device: torch.device) -> torch.Tensor | None:
    """KTO's KL estimate z0 as a device tensor: given (a number or a one-element tensor), or
    :func:`kl_estimate` of the KL completions' log-probabilities; None for none (0)."""
    if kl is not None and (kl_logps is not None or ref_kl_logps is not None):
        raise ValueError("fused_linear_kto takes the KL estimate as kl or as kl_logps and ref_kl_logps, not both")
    if (kl_logps is None) != (ref_kl_logps is None):
        raise ValueError(
            "kl_logps and ref_kl_logps come together: the policy's and the reference's log-probabilities "
            "of the same KL completions"
        )
    if kl_logps is not None:
        for name, values in (("kl_logps", kl_logps), ("ref_kl_logps", ref_kl_logps)):
            if not isinstance(values, torch.Tensor) or values.dim() != 1:
                raise ValueError(f"{name} must be a 1-D tensor, one log-probability per KL completion")
        chunked.check_values("kl_logps", kl_logps, kl_logps.shape, "the policy's log-probability of each KL completion")
        what = "the reference's log-probabilities of the KL completions of kl_logps"
        chunked.check_values("ref_kl_logps", ref_kl_logps, kl_logps.shape, what)
        return kl_estimate(kl_logps, ref_kl_logps)
    if kl is None:
        return None
    if isinstance(kl, torch.Tensor):
        chunked.check_one_number("kl", kl, "the KL estimate")
        return kl.reshape(())
    # A host number: a fill on the device (no copy that would wait for the GPU)
    return torch.full((), check_number("kl", kl), dtype=torch.float64, device=device)


def _preference(o, hidden, weight, target, *, ref=(None, None, None), label=None, kl=None, nll_target=None,
                ignore_index, chunk_units, accumulation, return_logps, token_outputs):  # fmt: skip
    """Validate what every loss shares (ValueError before any work), then run the operator under autograd. Returns
    the loss, or with ``return_logps`` (loss, the sequences' scores (N,), the reference's logp (N,)) for an unpaired
    loss, (loss, chosen scores, rejected scores[, reference chosen, reference rejected for DPO]) for a paired one;
    then the per-token values ``token_outputs`` names, in that order."""
    check_ignore_index(ignore_index)
    token_outputs = check_output_names("token_outputs", token_outputs, TOKEN_OUTPUTS)
    paired = group_size(o.loss) == 2
    layout = PAIRED_LAYOUT if paired else UNPAIRED_LAYOUT
    chunked.check_head(hidden, weight, layout=layout)
    if paired and hidden.shape[0] % 2:
        raise ValueError(
            f"hidden has {hidden.shape[0]} sequences: expected an even number 2B, rows [0, B) chosen and [B, 2B) "
            f"rejected responses to the same B prompts"
        )
    ref_hidden, ref_weight, ref_logps = ref
    if o.loss in ("dpo", "kto"):
        _check_reference(ref_hidden, ref_weight, ref_logps, hidden, weight, f"fused_linear_{o.loss}", layout)
    check_target_tensor(target, hidden.shape[:-1])
    if nll_target is not None:
        chunked.check_values(
            "nll_target",
            nll_target,
            (hidden.shape[0] // 2, hidden.shape[1]),
            "(B, T): the chosen rows' targets of the NLL term",
            "index",
        )
    chunk_name = "chunk_pairs" if paired else "chunk_completions"
    accumulation = chunked.check_chunk_options(chunk_name, chunk_units, accumulation)
    if ref_hidden is not None:  # a frozen model: constants of the call
        ref_hidden, ref_weight = ref_hidden.detach(), ref_weight.detach()
    constants = [None if t is None else t.detach() for t in (ref_logps, label, kl)]
    wanted = [name in token_outputs for name in HEAD_OUTPUTS]
    arguments = (*o.arguments(), ignore_index, chunk_units, bool(token_outputs), wanted, accumulation,
                 chunked.needed_grads(hidden, weight))  # fmt: skip
    tensors = (hidden, weight, target, ref_hidden, ref_weight, *constants, nll_target)
    total, scores, ref_scores, *per_token = chunked.run_loss(_LOSSES[o.loss], tensors, arguments)
    by_name = dict(zip(TOKEN_OUTPUTS, per_token, strict=True))
    tokens = tuple(by_name[name] for name in token_outputs)
    if not return_logps:
        return (total, *tokens) if tokens else total
    if not paired:
        return total, scores, ref_scores, *tokens
    # A paired loss returns its scores per side: (loss, chosen, rejected), with DPO's reference scores after them.
    n_pairs = hidden.shape[0] // 2
    sides = (scores[:n_pairs], scores[n_pairs:])
    references = (ref_scores[:n_pairs], ref_scores[n_pairs:]) if o.loss == "dpo" else ()
    return total, *sides, *references, *tokens


_COMMON_DOC = """
    hidden (2B, T, H): rows [0, B) the chosen responses, rows [B, 2B) the rejected responses to the same
    prompts; weight (V, H) the policy's ``lm_head`` weight; target (2B, T) the token each position predicts
    (already shifted), ``ignore_index`` on prompt and padding positions. Returns a float32 scalar; gradients
    reach ``hidden`` and ``weight``. The logits are never held for the whole batch: the loop runs over
    chunks of complete pairs (``chunk_pairs`` of them; default from :data:`CHUNK_BUDGET_BYTES`), and
    ``accumulation`` sums dW over chunks as in :func:`liger_lab.fused_linear_cross_entropy`. A sequence with
    every position ignored scores logp = 0, avg = 0. Odd 2B, mismatched shapes or dtypes raise ValueError, and so
    does a target out of range in the interpreter; on the GPU, which checks it without making the host wait, such
    a target makes the loss and the gradients NaN. The caller's tensors are never modified.

    ``return_logps=True`` returns ``(loss, chosen_logps, rejected_logps)`` instead, each (B,) float32: the sequence
    scores the loss is built from and the TRL trainer logs as ``logps/chosen`` and ``logps/rejected`` (see each
    loss for sum or mean). They come free with the loss and are not differentiable (metrics: no gradient flows
    back through them).

    ``token_outputs``: per-token values from the loss's own pass over the vocabulary, returned after the rest, in
    the order named, each (2B, T) in hidden's row order, 0 at ignored positions, without gradient: any of
    "log_probs" (log softmax(z)[target]) and the head outputs of :func:`liger_lab.fused_linear_logprobs`
    ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1", bool). What a TRL trainer logs beside its loss
    (``liger_lab.patch_trl``), at the cost of no matmul: the tokens are then scored by the RL head's kernels.
"""


def fused_linear_dpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_pairs: int | None = None,
    accumulation: str | None = None,
    return_logps: bool = False,
    token_outputs: Sequence[str] = (),
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return _preference(
        dpo_options(beta, loss_type, label_smoothing), hidden, weight, target, ref=(ref_hidden, ref_weight, ref_logps),
        ignore_index=ignore_index, chunk_units=chunk_pairs, accumulation=accumulation, return_logps=return_logps,
        token_outputs=token_outputs,
    )  # fmt: skip


fused_linear_dpo.__doc__ = (
    """DPO, TRL 1.16's ``DPOTrainer`` loss on one micro-batch: the mean over pairs of, with
    d = (logp_c - ref_c) - (logp_r - ref_r) (logp the summed log-probability of a sequence's kept targets, ref the
    same under the reference model) and m = beta * d, by ``loss_type``: "sigmoid" -log sigmoid(m); "hinge"
    relu(1 - m); "ipo" ((logp_c - ref_c) / n_c - (logp_r - ref_r) / n_r - 1 / (2 beta))^2 (n: kept positions, at
    least 1; beta > 0); "robust" (-(1 - eps) log sigmoid(m) + eps log sigmoid(-m)) / (1 - 2 eps) with
    eps = ``label_smoothing`` in [0, 0.5). As in TRL 1.16, ``label_smoothing`` is read by "robust" alone; any other
    loss type with a nonzero value is a ValueError (TRL would silently ignore it).

    The reference is either ``ref_hidden`` (2B, T, H_ref) @ ``ref_weight.T`` (V, H_ref), a frozen model whose
    logits are never held beyond a chunk, or ``ref_logps`` (2B,): its log-probability of each sequence, chosen
    rows then rejected (TRL's ``ref_chosen_logps`` and ``ref_rejected_logps`` concatenated, as
    ``precompute_ref_log_probs`` gives them). Exactly one of the two; neither gets a gradient.
    With ``return_logps=True``: ``(loss, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)``, the
    summed log-probabilities (TRL's ``logps/chosen``; its rewards are beta * (logps - ref_logps)).
"""
    + _COMMON_DOC
)


def fused_linear_orpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    beta: float = 0.1,
    nll_target: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_pairs: int | None = None,
    accumulation: str | None = None,
    return_logps: bool = False,
    token_outputs: Sequence[str] = (),
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return _preference(
        orpo_options(beta), hidden, weight, target, nll_target=nll_target, ignore_index=ignore_index,
        chunk_units=chunk_pairs, accumulation=accumulation, return_logps=return_logps,
        token_outputs=token_outputs,
    )  # fmt: skip


fused_linear_orpo.__doc__ = (
    """ORPO: the chosen sequences' token-mean NLL minus beta * mean over pairs of log sigmoid(odds_c - odds_r),
    odds = avg - log(1 - exp(avg)), avg a sequence's mean token log-probability, capped at
    :data:`ORPO_MAX_AVG_LOGP` (its odds are infinite at 0).

    The NLL is over the chosen rows' kept targets by default. ``nll_target`` (B, T), when given, is the chosen rows'
    target for the NLL alone: TRL 1.16's ORPOTrainer takes its NLL over prompt and response (the chosen input ids,
    shifted, ``ignore_index`` at padding only), the odds over the response. It must name the same token as
    ``target`` wherever both keep a position (it may only add positions, such as the prompt's): a ValueError in the
    interpreter, NaN loss and gradients on the GPU otherwise. ``return_logps`` gives the mean token
    log-probabilities (TRL's ORPO ``logps/chosen``).
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
    return_logps: bool = False,
    token_outputs: Sequence[str] = (),
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return _preference(
        simpo_options(beta, gamma), hidden, weight, target, ignore_index=ignore_index, chunk_units=chunk_pairs,
        accumulation=accumulation, return_logps=return_logps,
        token_outputs=token_outputs,
    )  # fmt: skip


fused_linear_simpo.__doc__ = (
    """SimPO: mean over pairs of -log sigmoid(beta * (avg_c - avg_r) - gamma), avg a sequence's mean token
    log-probability (no reference model, no NLL term; ``return_logps`` gives the avg).
"""
    + _COMMON_DOC
)


def fused_linear_cpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    ignore_index: int = -100,
    chunk_pairs: int | None = None,
    accumulation: str | None = None,
    return_logps: bool = False,
    token_outputs: Sequence[str] = (),
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return _preference(
        cpo_options(beta, loss_type, label_smoothing, cpo_alpha, simpo_gamma, alpha), hidden, weight, target,
        ignore_index=ignore_index, chunk_units=chunk_pairs, accumulation=accumulation, return_logps=return_logps,
        token_outputs=token_outputs,
    )  # fmt: skip


fused_linear_cpo.__doc__ = (
    """CPO, TRL 1.16's ``trl.experimental.cpo.CPOTrainer`` loss on one micro-batch (keywords as ``CPOConfig``'s
    fields): mean over pairs of the preference term plus ``cpo_alpha`` times the chosen sequences' token-mean NLL.
    With u a sequence's score (its mean token log-probability for ``loss_type`` "ipo" and "simpo", the sum for
    "sigmoid" and "hinge"), r = u, or (1 - exp(-alpha u)) / alpha = (1 - p^-alpha) / alpha for ``alpha`` != 0
    (AlphaPO), and x = r_c - r_r, the term is: "sigmoid" -(1 - eps) log sigmoid(beta x) - eps log sigmoid(-beta x)
    with eps = ``label_smoothing``; "simpo" the same with x - ``simpo_gamma`` / beta; "hinge" relu(1 - beta x);
    "ipo" (x - 1 / (2 beta))^2. "alphapo" is CPOConfig's shorthand for "simpo" with cpo_alpha = 0 (set ``alpha``).
    ``label_smoothing`` is read by "sigmoid" and "simpo" only (TRL ignores it, with a warning, for "hinge" and
    "ipo": a ValueError here); "ipo" and "simpo" need beta > 0. ``return_logps`` gives the scores u (TRL's
    ``logps/chosen``; its rewards are beta * r).
"""
    + _COMMON_DOC
)


def fused_linear_kto(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    label: torch.Tensor,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    kl: torch.Tensor | float | None = None,
    kl_logps: torch.Tensor | None = None,
    ref_kl_logps: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    ignore_index: int = -100,
    chunk_completions: int | None = None,
    accumulation: str | None = None,
    return_logps: bool = False,
    token_outputs: Sequence[str] = (),
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """KTO, TRL 1.16's ``KTOTrainer`` loss on one micro-batch (keywords as ``KTOConfig``'s fields).

    hidden (B, T, H): B completions, unpaired; weight (V, H) the policy's ``lm_head`` weight; target (B, T) the
    token each position predicts (already shifted), ``ignore_index`` on prompt and padding positions; ``label`` (B,)
    bool or integer, TRL's ``label`` column: nonzero for a desirable completion. With logp a completion's summed
    log-probability of its kept targets, ref the same under the reference model and lr = logp - ref, the loss is
    the mean over the B completions of

        desirable:    desirable_weight   * (1 - sigmoid(beta * (lr - z0)))
        undesirable:  undesirable_weight * (1 - sigmoid(beta * (z0 - lr)))

    z0 = the KL estimate for ``loss_type="kto"``; 0 for "apo_zero_unpaired" (TRL's unpaired APO: the undesirable
    term is then sigmoid(beta * lr)), which ignores the estimate. The estimate is a constant (TRL computes it under
    no_grad): give it as ``kl`` (a number or a one-element tensor, used as it is: what TRL has after gathering it
    over processes and clamping at 0), or as ``kl_logps`` and ``ref_kl_logps`` (1-D, the policy's and the reference's
    log-probabilities of the KL completions, TRL's mismatched prompt/completion pairs: z0 = their mean difference
    clamped at 0, TRL's estimate on one process). With neither, z0 = 0: TRL's KTOTrainer always estimates it for
    "kto", so pass one to match it.

    The reference is ``ref_hidden`` (B, T, H_ref) @ ``ref_weight.T`` (V, H_ref), a frozen model whose logits are
    never held beyond a chunk, or ``ref_logps`` (B,), its log-probability of each completion (TRL's
    ``precompute_ref_log_probs``): exactly one. The reference, the labels and the KL terms get no gradient.
    The mean is TRL 1.16's ``nanmean``: a completion whose loss is NaN (a NaN reference log-probability, say)
    drops out of the mean and of the gradients' scale, and gets no gradient. Returns a float32 scalar (0 for B = 0,
    where TRL's mean of nothing is NaN); gradients reach ``hidden`` and ``weight``. With ``return_logps=True``:
    ``(loss, logps, ref_logps)``, each (B,) float32 in the rows' order (the
    summed log-probabilities: TRL's ``logps/chosen`` and ``logps/rejected`` are their means over the desirable and
    the undesirable rows, its rewards beta * (logps - ref_logps)); they are metrics, not differentiable.
    ``token_outputs`` as for the paired losses (each (B, T)), returned last.

    The logits are never held for the whole batch: the loop runs over chunks of ``chunk_completions`` completions
    (default from :data:`CHUNK_BUDGET_BYTES`); ``accumulation`` as in :func:`liger_lab.fused_linear_cross_entropy`. A
    completion with every position ignored scores logp = 0. Mismatched shapes or dtypes raise ValueError, and so does
    a target out of range in the interpreter; on the GPU it makes the loss and the gradients NaN. No host read, no
    caller's tensor modified.
    """
    o = kto_options(beta, loss_type, desirable_weight, undesirable_weight)
    chunked.check_head(hidden, weight, layout=UNPAIRED_LAYOUT)  # first: label and kl need its shape
    chunked.check_values("label", label, hidden.shape[:1], "TRL's label: nonzero for a desirable completion", "flag")
    kl = _check_kl(kl, kl_logps, ref_kl_logps, hidden.device)
    return _preference(
        o, hidden, weight, target, ref=(ref_hidden, ref_weight, ref_logps), label=label, kl=kl,
        ignore_index=ignore_index, chunk_units=chunk_completions, accumulation=accumulation, return_logps=return_logps,
        token_outputs=token_outputs,
    )  # fmt: skip
