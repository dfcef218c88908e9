"""Plain-PyTorch references: the specification every kernel is tested against.

Each function is the textbook formula written with torch operations, with the same dtype behaviour
as the Hugging Face / PyTorch code it stands for. Tests call them on float64 copies of the inputs to
get a reference that rounding does not blur.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm decoder's residual add and the norm after it: ``s = x + residual`` in the inputs' dtype (the
    residual stream, ``hidden = residual + hidden``), then ``(rms_norm(s), s)``."""
    s = x + residual
    return rms_norm(s, weight, eps, offset=offset, casting_mode=casting_mode), s


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb``: q, k (B, heads, T, D); cos, sin (B or 1, T, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
) -> torch.Tensor:
    """Token-level cross-entropy with optional tanh softcap of the logits and z-loss on log-sum-exp.

    logits (..., V), target (...). Math in fp32 (or fp64 for fp64 input); the mean is over
    non-ignored tokens and is 0 when every token is ignored. The loss dtype is the logits' dtype
    (like ``torch.nn.functional.cross_entropy``).
    """
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.reshape(-1, logits.shape[-1]).to(compute_dtype)
    t = target.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    keep = t != ignore_index
    safe_t = torch.where(keep, t, torch.zeros_like(t))
    lse = torch.logsumexp(z, dim=-1)
    nll = lse - z.gather(1, safe_t[:, None]).squeeze(1)
    if label_smoothing > 0:
        smooth = lse - z.mean(dim=-1)
        nll = (1 - label_smoothing) * nll + label_smoothing * smooth
    loss = nll + z_loss_scale * lse.pow(2)
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape).to(logits.dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / keep.sum().clamp(min=1)
    return total.to(logits.dtype)


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
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)``: what the fused kernel never materialises."""
    logits = F.linear(hidden, weight, bias)
    return cross_entropy(
        logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
        softcap=softcap,
    )  # fmt: skip


def jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence of TRL's GKD trainer (``generalized_jsd_loss``).

    P = softmax(teacher / T), Q = softmax(student / T); per row KL(P || Q) for beta == 0, KL(Q || P) for
    beta == 1, else beta * KL(P || M) + (1 - beta) * KL(Q || M) with M = beta * P + (1 - beta) * Q. The mean
    over rows whose target is not ``ignore_index`` (every row when ``target`` is None); no T**2 factor.
    Every row ignored gives 0, with a zero gradient. The teacher is a constant (detached). Math in fp32, or
    fp64 when either input is fp64; the loss has that dtype (float32 for fp32/fp16/bf16 logits).
    """
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
    return d.sum() / keep.sum().clamp(min=1)


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
) -> torch.Tensor:
    """:func:`jsd` of the two heads' logits, ``student_hidden @ student_weight.T`` and
    ``teacher_hidden @ teacher_weight.T`` (hidden sizes may differ): what the fused kernel never materialises.
    The teacher's head is a constant."""
    student_logits = F.linear(student_hidden, student_weight)
    teacher_logits = F.linear(teacher_hidden.detach(), teacher_weight.detach())
    return jsd(student_logits, teacher_logits, target, beta=beta, temperature=temperature, ignore_index=ignore_index)


# Preference losses: hidden (2B, T, H), rows [0, B) chosen and [B, 2B) rejected responses to the same prompts.

ORPO_MAX_AVG_LOGP = -1e-6
"""ORPO's cap on a sequence's mean token log-probability (its odds are infinite at 0)."""


def sequence_logps(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, kept count) per sequence: the sum over positions whose target is not ``ignore_index`` of
    log_softmax(hidden @ weight.T)[target] (0 when none is kept), and the number of those positions."""
    logits = F.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    keep = target != ignore_index
    picked = logits.log_softmax(-1).gather(-1, torch.where(keep, target, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, picked, torch.zeros_like(picked)).sum(-1), keep.sum(-1)


def _mean_over_pairs(terms: torch.Tensor) -> torch.Tensor:
    return terms.sum() / max(terms.shape[0], 1)


def fused_linear_dpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ref_hidden: torch.Tensor,
    ref_weight: torch.Tensor,
    *,
    beta: float = 0.1,
    ignore_index: int = -100,
) -> torch.Tensor:
    """DPO (sigmoid loss): mean over pairs of -logsigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r))), the
    reference's logps from ``ref_hidden @ ref_weight.T`` without gradient."""
    n_pairs = hidden.shape[0] // 2
    logp, _ = sequence_logps(hidden, weight, target, ignore_index)
    with torch.no_grad():
        ref, _ = sequence_logps(ref_hidden.detach(), ref_weight.detach(), target, ignore_index)
    margin = (logp[:n_pairs] - ref[:n_pairs]) - (logp[n_pairs:] - ref[n_pairs:])
    return _mean_over_pairs(-F.logsigmoid(beta * margin))


def fused_linear_orpo(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, beta: float = 0.1, ignore_index: int = -100
) -> torch.Tensor:
    """ORPO: the chosen sequences' NLL averaged over their kept tokens, minus beta * mean over pairs of
    logsigmoid(odds_c - odds_r), odds = avg - log(1 - exp(avg)) with avg = logp / max(count, 1) capped at
    :data:`ORPO_MAX_AVG_LOGP`."""
    n_pairs = hidden.shape[0] // 2
    logp, count = sequence_logps(hidden, weight, target, ignore_index)
    nll = -logp[:n_pairs].sum() / count[:n_pairs].sum().clamp(min=1)
    avg = (logp / count.clamp(min=1)).clamp(max=ORPO_MAX_AVG_LOGP)
    log_1m_p = torch.where(avg > -0.6931471805599453, torch.log(-torch.expm1(avg)), torch.log1p(-torch.exp(avg)))
    odds = avg - log_1m_p
    return nll - beta * _mean_over_pairs(F.logsigmoid(odds[:n_pairs] - odds[n_pairs:]))


def fused_linear_simpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    ignore_index: int = -100,
) -> torch.Tensor:
    """SimPO: mean over pairs of -logsigmoid(beta * (avg_c - avg_r) - gamma), avg = logp / max(count, 1)."""
    n_pairs = hidden.shape[0] // 2
    logp, count = sequence_logps(hidden, weight, target, ignore_index)
    avg = logp / count.clamp(min=1)
    return _mean_over_pairs(-F.logsigmoid(beta * (avg[:n_pairs] - avg[n_pairs:]) - gamma))
