"""Plain-PyTorch references: the specification every kernel is tested against.

Each function is the textbook formula written with torch operations, with the same dtype behaviour
as the Hugging Face / PyTorch code it stands for. Tests call them on float64 copies of the inputs to
get a reference that rounding does not blur.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from liger_lab import formulas
from liger_lab.formulas import ORPO_MAX_AVG_LOGP, head_outputs, rotate_half


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0, casting_mode: str = "llama"
) -> torch.Tensor:
    """Llama's ``LlamaRMSNorm`` (casting_mode="llama") or Gemma's ``GemmaRMSNorm`` (casting_mode="gemma")."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute_dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "gemma":
        return (h * (offset + weight.to(compute_dtype))).to(x.dtype)
    return (offset + weight) * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, **options: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm decoder's residual add and the norm after it: ``s = x + residual`` in the inputs' dtype (the
    residual stream, ``hidden = residual + hidden``), then ``(rms_norm(s), s)`` with :func:`rms_norm`'s keyword
    ``options``."""
    s = x + residual
    return rms_norm(s, weight, eps, **options), s


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, *, offset: float = 0.0
) -> torch.Tensor:
    """``torch.nn.LayerNorm`` (offset 0) or Nemotron's ``NemotronLayerNorm1P`` (offset 1: ``weight + 1`` in the
    weight's dtype scales)."""
    return F.layer_norm(x, (x.shape[-1],), weight + offset, bias, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb``: q, k (B, heads, T, D); cos, sin (B or 1, T, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_adjacent_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM's ``rotate_half``: features (2i, 2i + 1) become (-x[2i + 1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def partial_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' partial RoPE (Phi-3, Qwen3-Next; GLM-4's with ``interleaved``): the first R = cos.shape[-1]
    features rotate, paired (i, i + R/2) or, interleaved, (2i, 2i + 1); the rest are concatenated back unchanged
    (``torch.cat`` promotes them to the rotated features' dtype). q, k (B, heads, T, D); cos, sin (B or 1, T, R)."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotate = rotate_adjacent_pairs if interleaved else rotate_half

    def embed(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat([x_rot * cos + rotate(x_rot) * sin, x_pass], dim=-1)

    return embed(q), embed(k)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, **options: object) -> torch.Tensor:
    """Token-level cross-entropy with optional tanh softcap of the logits and z-loss on log-sum-exp.

    logits (..., V), target (...). Math in fp32 (or fp64 for fp64 input); the mean is over
    non-ignored tokens and is 0 when every token is ignored. The loss dtype is the logits' dtype
    (like ``torch.nn.functional.cross_entropy``). The keyword ``options`` are :class:`liger_lab.formulas.LossOptions`'
    fields (``ignore_index``, ``label_smoothing``, ``reduction``, ``softcap``, ``z_loss_scale``), with the kernel's
    defaults and checked as the kernel checks them.
    """
    o = formulas.LossOptions(**options)
    formulas.check_loss_options(o)
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.reshape(-1, logits.shape[-1]).to(compute_dtype)
    t = target.reshape(-1)
    if o.softcap is not None:
        z = o.softcap * torch.tanh(z / o.softcap)
    keep = t != o.ignore_index
    safe_t = torch.where(keep, t, torch.zeros_like(t))
    lse = torch.logsumexp(z, dim=-1)
    nll = lse - z.gather(1, safe_t[:, None]).squeeze(1)
    if o.label_smoothing > 0:
        smooth = lse - z.mean(dim=-1)
        nll = (1 - o.label_smoothing) * nll + o.label_smoothing * smooth
    loss = nll + o.z_loss_scale * lse.pow(2)
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    if o.reduction == "none":
        return loss.reshape(target.shape).to(logits.dtype)
    total = loss.sum()
    if o.reduction == "mean":
        total = total / keep.sum().clamp(min=1)
    return total.to(logits.dtype)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    **options: object,
) -> torch.Tensor:
    """:func:`cross_entropy` (its keyword ``options``) of ``hidden @ weight.T + bias``: the logits that the fused
    kernel never materialises."""
    return cross_entropy(F.linear(hidden, weight, bias), target, **options)


def jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    num_items_in_batch: torch.Tensor | float | None = None,
    **options: object,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence of TRL's GKD trainer (``generalized_jsd_loss``).

    P = softmax(teacher / T), Q = softmax(student / T); per row KL(P || Q) for beta == 0, KL(Q || P) for
    beta == 1, else beta * KL(P || M) + (1 - beta) * KL(Q || M) with M = beta * P + (1 - beta) * Q. The mean
    over rows whose target is not ``ignore_index`` (every row when ``target`` is None); no T**2 factor.
    Every row ignored gives 0, with a zero gradient. ``num_items_in_batch``: the sum over the kept rows divided by
    it instead, unclamped (TRL's ``jsd_sum / num_items_in_batch``). The teacher is a constant (detached). Math in
    fp32, or fp64 when either input is fp64; the loss has that dtype (float32 for fp32/fp16/bf16 logits). The keyword
    ``options`` are :class:`liger_lab.formulas.JSDOptions`' fields (``beta``, ``temperature``, ``ignore_index``), with
    the kernel's defaults and checked as the kernel checks them.
    """
    o = formulas.JSDOptions(**options).checked()
    beta, temperature, ignore_index = o.beta, o.temperature, o.ignore_index
    compute_dtype = torch.promote_types(torch.promote_types(student_logits.dtype, teacher_logits.dtype), torch.float32)
    vocab = student_logits.shape[-1]
    s = student_logits.reshape(-1, vocab).to(compute_dtype) / temperature
    t = teacher_logits.detach().reshape(-1, vocab).to(compute_dtype) / temperature
    log_q, log_p = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    if beta == 0:
        d = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif beta == 1:
        d = (log_q.exp() * (log_q - log_p)).sum(-1)
    else:
        weight = torch.tensor(beta, dtype=compute_dtype, device=s.device)
        log_m = torch.logaddexp(log_p + weight.log(), log_q + (1 - weight).log())  # log M, never log 0
        d = beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)
    if target is None:
        keep = torch.ones_like(d, dtype=torch.bool)
    else:
        keep = target.reshape(-1) != ignore_index
    d = torch.where(keep, d, torch.zeros_like(d))
    if num_items_in_batch is not None:
        return d.sum() / torch.as_tensor(num_items_in_batch, device=d.device).to(compute_dtype).reshape(())
    return d.sum() / keep.sum().clamp(min=1)


def fused_linear_jsd(
    student_hidden: torch.Tensor, student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None, **options: object,
) -> torch.Tensor:  # fmt: skip
    """:func:`jsd` (its keyword ``options``) of the two heads' logits, ``student_hidden @ student_weight.T`` and
    ``teacher_hidden @ teacher_weight.T`` (hidden sizes may differ): what the fused kernel never materialises.
    The teacher's head is a constant."""
    student_logits = F.linear(student_hidden, student_weight)
    teacher_logits = F.linear(teacher_hidden.detach(), teacher_weight.detach())
    return jsd(student_logits, teacher_logits, target, **options)


# Preference losses: hidden (2B, T, H), rows [0, B) chosen and [B, 2B) rejected responses to the same prompts.


def sequence_logps(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, kept count) per sequence: the sum of :func:`fused_linear_logprobs` over the positions whose target is
    not ``ignore_index`` (0 when none is kept), and the number of those positions."""
    logp = fused_linear_logprobs(hidden, weight, target, ignore_index=ignore_index)
    return logp.sum(-1), (target != ignore_index).sum(-1)


def _mean_over_pairs(terms: torch.Tensor) -> torch.Tensor:
    return terms.sum() / max(terms.shape[0], 1)


def _reference_sequence_logps(
    ref_hidden: torch.Tensor | None,
    ref_weight: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A frozen reference's per-sequence logp: from its head without gradient, or the precomputed ``ref_logps``."""
    if ref_logps is not None:
        return ref_logps.detach().to(dtype)
    with torch.no_grad():
        return sequence_logps(ref_hidden.detach(), ref_weight.detach(), target, ignore_index)[0].to(dtype)


def fused_linear_dpo(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    ref_hidden: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None, *,
    ref_logps: torch.Tensor | None = None, ignore_index: int = -100, **options: object,
) -> torch.Tensor:  # fmt: skip
    """TRL 1.16's ``DPOTrainer`` loss (``f_divergence_type="reverse_kl"``, one loss type, no weighting): with the
    log-ratios chosen - ref_chosen and rejected - ref_rejected and delta their difference, the mean over pairs of
    sigmoid -logsigmoid(beta delta); hinge relu(1 - beta delta); ipo (the log-ratios over the completion lengths,
    clamped at 1, their difference - 1 / (2 beta))**2; robust (-(1 - ls) logsigmoid(beta delta)
    + ls logsigmoid(-beta delta)) / (1 - 2 ls). The reference's logps from ``ref_hidden @ ref_weight.T`` without
    gradient, or ``ref_logps`` (2B,), chosen then rejected. The keyword ``options`` (``beta``, ``loss_type``,
    ``label_smoothing``) with the kernel's defaults, checked as the kernel's
    (:func:`liger_lab.formulas.dpo_options`)."""
    o = formulas.dpo_options(**options)
    beta, loss_type, label_smoothing = o.beta, o.loss_type, o.label_smoothing
    n_pairs = hidden.shape[0] // 2
    logp, count = sequence_logps(hidden, weight, target, ignore_index)
    ref = _reference_sequence_logps(ref_hidden, ref_weight, ref_logps, target, ignore_index, logp.dtype)
    chosen_logratios = logp[:n_pairs] - ref[:n_pairs]
    rejected_logratios = logp[n_pairs:] - ref[n_pairs:]
    delta_score = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        per_sequence_loss = -F.logsigmoid(beta * delta_score)
    elif loss_type == "hinge":
        per_sequence_loss = torch.relu(1 - beta * delta_score)
    elif loss_type == "ipo":
        lengths = count.clamp(min=1)
        ipo_delta = chosen_logratios / lengths[:n_pairs] - rejected_logratios / lengths[n_pairs:]
        per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
    else:  # robust
        clean_loss_term = -(1 - label_smoothing) * F.logsigmoid(beta * delta_score)
        flipped_loss_term = -label_smoothing * F.logsigmoid(-beta * delta_score)
        per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * label_smoothing)
    return _mean_over_pairs(per_sequence_loss)


def fused_linear_orpo(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
    nll_target: torch.Tensor | None = None, ignore_index: int = -100, **options: object,
) -> torch.Tensor:  # fmt: skip
    """ORPO: the chosen sequences' NLL averaged over their kept tokens (of ``nll_target`` (B, T) when given: TRL's
    ORPOTrainer takes it over prompt and response), minus beta * mean over pairs of logsigmoid(odds_c - odds_r),
    odds = avg - log(1 - exp(avg)) with avg = logp / max(count, 1) capped at :data:`ORPO_MAX_AVG_LOGP` (the
    kernel's), log(1 - exp(avg)) as the kernel's :func:`liger_lab.formulas.log1mexp` takes it (exact on both
    sides of -log 2). ``options``: ``beta``, as the kernel's (:func:`liger_lab.formulas.orpo_options`)."""
    beta = formulas.orpo_options(**options).beta
    n_pairs = hidden.shape[0] // 2
    logp, count = sequence_logps(hidden, weight, target, ignore_index)
    nll_logp, nll_count = logp[:n_pairs], count[:n_pairs]
    if nll_target is not None:
        nll_logp, nll_count = sequence_logps(hidden[:n_pairs], weight, nll_target, ignore_index)
    nll = -nll_logp.sum() / nll_count.sum().clamp(min=1)
    avg = (logp / count.clamp(min=1)).clamp(max=ORPO_MAX_AVG_LOGP)
    odds = avg - formulas.log1mexp(avg)
    return nll - beta * _mean_over_pairs(F.logsigmoid(odds[:n_pairs] - odds[n_pairs:]))


def fused_linear_simpo(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, **options: object
) -> torch.Tensor:
    """SimPO: mean over pairs of -logsigmoid(beta * (avg_c - avg_r) - gamma), avg = logp / max(count, 1); ``beta``
    and ``gamma`` from the keyword ``options``, as the kernel's (:func:`liger_lab.formulas.simpo_options`)."""
    o = formulas.simpo_options(**options)
    beta, gamma = o.beta, o.gamma
    n_pairs = hidden.shape[0] // 2
    logp, count = sequence_logps(hidden, weight, target, ignore_index)
    avg = logp / count.clamp(min=1)
    return _mean_over_pairs(-F.logsigmoid(beta * (avg[:n_pairs] - avg[n_pairs:]) - gamma))


# The RL head and the GRPO family (TRL 1.16's GRPOTrainer._compute_loss on one micro-batch).


def head_logits(logits: torch.Tensor, *, temperature: float = 1.0, softcap: float | None = None,
                logit_scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """The head's z: ``softcap * tanh(logits * logit_scale / softcap) / temperature`` (without the tanh when
    ``softcap`` is None), in fp32 (fp64 for fp64 input)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def logprobs(
    logits: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0, ignore_index: int = -100,
    entropy: bool = False, outputs: Sequence[str] = (), softcap: float | None = None, logit_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, ...]:  # fmt: skip
    """Per-token log_softmax(z)[target] for z = :func:`head_logits`, and the outputs :func:`head_outputs` names:
    entropy -(softmax(z) * log_softmax(z)).sum(-1), log_sum_sq_probs log(sum softmax(z)**2), mean_logits z.mean(-1)
    and is_top1 (the target is z's argmax, its first one: a tie with an earlier token does not count, as in TRL).
    All 0 (False) where target is ``ignore_index``; mean_logits and is_top1 carry no gradient."""
    names = head_outputs(entropy, outputs)
    z = head_logits(logits, temperature=temperature, softcap=softcap, logit_scale=logit_scale)
    log_p = z.log_softmax(-1)
    keep = target != ignore_index
    safe = torch.where(keep, target, 0)
    zero = log_p.new_zeros(())
    logp = torch.where(keep, log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1), zero)
    per_token = {
        "entropy": lambda: -(log_p.exp() * log_p).sum(-1),
        "log_sum_sq_probs": lambda: torch.logsumexp(2 * log_p, -1),
        "mean_logits": lambda: z.detach().mean(-1),
    }
    extras = [
        keep & (z.detach().argmax(-1) == safe) if name == "is_top1" else torch.where(keep, per_token[name](), zero)
        for name in names
    ]
    return (logp, *extras) if names else logp


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    **options: object,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`logprobs` (its keyword ``options``) of ``hidden @ weight.T + bias``: the RL head."""
    return logprobs(F.linear(hidden, weight, bias), target, **options)


def fused_linear_grpo(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor, *,
    old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None, max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None, temperature: float = 1.0, ignore_index: int = -100,
    **options: object,
) -> torch.Tensor:  # fmt: skip
    """TRL 1.16's ``GRPOTrainer._compute_loss`` (every loss type: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo,
    vespo; token or sequence importance sampling; the delta clamp; the k3 KL term and its bias correction; the vLLM
    importance-sampling ratio; the off-policy mask; the high-entropy mask and the entropy bonus) on the plain logits
    of ``hidden @ weight.T / temperature``: the log-probabilities (and entropies) of :func:`fused_linear_logprobs`,
    then :func:`liger_lab.formulas.loss_from_logps`, TRL's text on them, which the tests hold against TRL's own
    method.

    hidden (B, T, H) at completion positions, target (B, T) the completion tokens with ``ignore_index`` at padding
    (TRL's completion_mask), advantages (B,) or (B, T), old_logps and ref_logps (B, T) or None: constants, like the
    advantages. The keyword ``options`` are the loss's (``GRPOConfig``'s names: ``loss_type``, ``beta``,
    ``epsilon_low``, ...), with the kernel's defaults, checked, and epsilon_high defaulted, as the kernel's
    (:func:`liger_lab.formulas.grpo_options`)."""
    o, t = formulas.grpo_options(**options)
    out = fused_linear_logprobs(
        hidden, weight, target, temperature=temperature, ignore_index=ignore_index, entropy=t.needs_entropy
    )
    logps, entropies = out if t.needs_entropy else (out, None)
    return formulas.loss_from_logps(
        logps, target != ignore_index, advantages, o, t, entropies=entropies, old_logps=old_logps,
        ref_logps=ref_logps, importance_sampling_ratio=importance_sampling_ratio,
        max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch,
    )  # fmt: skip


# KTO and CPO (TRL 1.16's KTOTrainer and trl.experimental.cpo.CPOTrainer on one micro-batch).


def fused_linear_kto(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, label: torch.Tensor,
    ref_hidden: torch.Tensor | None = None, ref_weight: torch.Tensor | None = None, *,
    ref_logps: torch.Tensor | None = None, kl: torch.Tensor | float | None = None,
    kl_logps: torch.Tensor | None = None, ref_kl_logps: torch.Tensor | None = None, ignore_index: int = -100,
    **options: object,
) -> torch.Tensor:  # fmt: skip
    """TRL 1.16's ``KTOTrainer`` loss, its text: hidden (B, T, H) completions, ``label`` (B,) nonzero for the
    desirable ones; the KL estimate ``kl`` as given, or (kl_logps - ref_kl_logps).mean().clamp(min=0), or 0; the
    weighted per-completion losses concatenated (desirable first) and averaged as TRL 1.16 does, by ``nanmean`` (a
    completion whose loss is NaN drops out; 0 for no completion at all, where TRL's nanmean is NaN). The
    reference's logps from its head without gradient, or ``ref_logps`` (B,). The keyword ``options`` (``beta``,
    ``loss_type``, ``desirable_weight``, ``undesirable_weight``) with the kernel's defaults, checked, and the estimate
    taken, as the kernel's (:func:`liger_lab.formulas.kto_options`, :func:`~liger_lab.formulas.kl_estimate`)."""
    o = formulas.kto_options(**options)
    beta, desirable_weight, undesirable_weight = o.beta, o.desirable_weight, o.undesirable_weight
    logps, _ = sequence_logps(hidden, weight, target, ignore_index)
    ref = _reference_sequence_logps(ref_hidden, ref_weight, ref_logps, target, ignore_index, logps.dtype)
    if kl is None and kl_logps is not None:
        kl = formulas.kl_estimate(kl_logps, ref_kl_logps)
    kl = torch.as_tensor(0.0 if kl is None else kl, device=logps.device).detach().to(logps.dtype)
    desirable = label != 0
    chosen_logratios = logps[desirable] - ref[desirable]
    rejected_logratios = logps[~desirable] - ref[~desirable]
    if o.loss_type == "kto":
        chosen_losses = 1 - torch.sigmoid(beta * (chosen_logratios - kl))
        rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_logratios))
    else:  # apo_zero_unpaired
        chosen_losses = 1 - torch.sigmoid(beta * chosen_logratios)
        rejected_losses = torch.sigmoid(beta * rejected_logratios)
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses.nanmean() if losses.numel() else losses.sum()


def fused_linear_cpo(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, **options: object
) -> torch.Tensor:
    """TRL 1.16's ``CPOTrainer`` loss, its text: ``losses.mean() + cpo_alpha * nll_loss``, the sequence scores the
    mean token log-probability for ipo and simpo (over max(count, 1) kept tokens, where TRL's 0 / 0 is NaN) and the
    sum otherwise, AlphaPO's reward (1 - p^-alpha) / alpha when alpha != 0, and the NLL the chosen rows'
    cross-entropy (0 when no chosen token is kept). "alphapo" is simpo with cpo_alpha = 0, as CPOConfig makes it:
    the keyword ``options`` (``beta``, ``loss_type``, ``label_smoothing``, ``cpo_alpha``, ``simpo_gamma``, ``alpha``),
    with the kernel's defaults, are checked and resolved as the kernel's (:func:`liger_lab.formulas.cpo_options`)."""
    o = formulas.cpo_options(**options)
    loss_type, beta, label_smoothing, cpo_alpha, alpha = o.loss_type, o.beta, o.label_smoothing, o.nll_weight, o.alpha
    n_pairs = hidden.shape[0] // 2
    logp, count = sequence_logps(hidden, weight, target, ignore_index)
    if formulas.averages(o):
        logp = logp / count.clamp(min=1)
    policy_chosen_logps, policy_rejected_logps = logp[:n_pairs], logp[n_pairs:]
    if alpha != 0.0:
        chosen_rewards = (1 - torch.exp(policy_chosen_logps).pow(-alpha)) / alpha
        rejected_rewards = (1 - torch.exp(policy_rejected_logps).pow(-alpha)) / alpha
        logits = chosen_rewards - rejected_rewards
    else:
        logits = policy_chosen_logps - policy_rejected_logps
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            logits = logits - o.gamma / beta
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:  # ipo
        losses = (logits - 1 / (2 * beta)) ** 2
    loss = _mean_over_pairs(losses)
    if cpo_alpha != 0:
        chosen_logp, chosen_count = sequence_logps(hidden[:n_pairs], weight, target[:n_pairs], ignore_index)
        loss = loss + cpo_alpha * (-chosen_logp.sum() / chosen_count.sum().clamp(min=1))
    return loss


def mrope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: list[int], *,
    unsqueeze_dim: int = 1, interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Multimodal RoPE: cos, sin (3, B or 1, T, D) hold one table per position stream (temporal, height, width).
    Feature pair i (features i and i + D/2) takes its cos and sin from one stream: the first mrope_section[0] pairs
    from the temporal one, the next mrope_section[1] from height, the rest from width; ``interleaved`` (Qwen3-VL):
    height where i % 3 == 1 and i < 3 * mrope_section[1], width where i % 3 == 2 and i < 3 * mrope_section[2],
    temporal elsewhere. Then RoPE with the picked (B or 1, T, D) tables, unsqueezed at ``unsqueeze_dim``."""
    pairs = torch.arange(q.shape[-1] // 2, device=cos.device)
    if interleaved:
        height = (pairs % 3 == 1) & (pairs < 3 * mrope_section[1])
        width = (pairs % 3 == 2) & (pairs < 3 * mrope_section[2])
        stream = torch.where(height, 1, torch.where(width, 2, 0))
    else:
        stream = torch.repeat_interleave(torch.arange(3, device=cos.device), torch.tensor(mrope_section).to(cos.device))
    index = torch.cat([stream, stream]).expand(1, *cos.shape[1:])
    cos, sin = (table.gather(0, index).squeeze(0).unsqueeze(unsqueeze_dim) for table in (cos, sin))
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
