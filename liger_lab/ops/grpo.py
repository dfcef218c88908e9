r"""The GRPO family (grpo, bnpo, dr_grpo, dapo, cispo; sapo, luspo, vespo) on ``hidden @ weight.T``, without the logits.

grpo, bnpo, dr_grpo, dapo and cispo, without TRL's newer options, are the fused loss below: its gradient is made in
the forward (three matmuls). The newer loss types and options (sapo, luspo, vespo; the KL's bias correction, the
vLLM importance-sampling ratio, the off-policy mask, the high-entropy mask, the entropy bonus) run on the RL head
and :func:`~liger_lab.formulas.loss_from_logps`, TRL's formula on its log-probabilities (four matmuls;
:func:`fused_linear_grpo` says which).

**The loss**, exactly TRL 1.16's ``GRPOTrainer._compute_loss`` on one micro-batch (gradient accumulation and the
process count are the caller's). B completions of T positions: hidden (B, T, H), target (B, T) the completion
tokens with ignore_index at padding, m = target != ignore_index, advantages A (B,) or (B, T), old and ref (B, T)
constants or None. Per token, logp from the RL head (:mod:`liger_lab.ops.logprobs`, at the temperature), then::

    old   = logp.detach() if old is None                  w = logp - old                 ("token")
                                                          w_b = sum_t m (logp - old) / max(n_b, 1)   ("sequence")
    r     = exp(w)                                        n_b = kept tokens of sequence b
    clipped (grpo, bnpo, dr_grpo, dapo):  c2 = clamp(r, 1 - eps_low, 1 + eps_high);  c1 = min(r, delta) if delta
                                          l = -min(c1 A, c2 A)
    cispo:                                l = -min(r, eps_high).detach() A logp
    beta != 0:                            l += beta (exp(ref - logp) - (ref - logp) - 1)
    loss  = sum_{b,t} c_bt l_bt,  c = m / (B max(n_b, 1)) (grpo), m / max(sum m, 1) (bnpo),
            m / (B max_completion_length) (dr_grpo), m / max(num_items_in_batch, 1) (dapo, cispo; default sum m)

So the loss is a weighted sum over tokens, with weights c that the targets alone fix (counts stay on the device).

**The gradient.** The logits enter only through logp, and d logp / dz = (onehot - softmax(z)) / T, so each row's
gradient is the RL head's with one upstream number per token, g = dloss/dlogp (:func:`liger_lab.ops.logprobs
.logprob_grad_rows`). Per token, with x = ref - logp::

    clipped   dl/dr = -A * (dc1 if c1 A < c2 A, dc2 if c2 A < c1 A, (dc1 + dc2) / 2 on a tie)
              dc1 = [r <= delta] (1 without delta),  dc2 = [1 - eps_low <= r <= 1 + eps_high]
    cispo     dl/dlogp = -min(r, eps_high) A          (the ratio is detached)
    KL        dl/dlogp += beta (1 - exp(x)) = -beta expm1(x)

(the tie rule and the closed bounds are PyTorch's ``torch.minimum`` and ``torch.clamp`` backward: a token inside
the clip range is a tie, and gets the full gradient). With token-level weights dr/dlogp = r, so
``g = c (dl/dlogp + r dl/dr)`` is known from the token's own logp, old, ref and A. At sequence level
dr_b/dlogp_t = r_b m_t / max(n_b, 1), so a sequence's tokens share ``r_b S_b / max(n_b, 1)`` with
``S_b = sum_t c_bt dl/dr_bt``, which needs r_b, i.e. every logp of the sequence.

**Chunking and matmul count.** Where g is known from the chunk's own rows, the chunk loop of :mod:`liger_lab.ops
.chunked` makes the gradient in the forward, as the fused cross-entropy does: per chunk the logits (1 matmul), the
RL head's forward kernel (logp), g in a few elementwise torch ops on the chunk's tokens, the head's gradient kernel
over the same logits (dz), then dW += dz^T h and dh = dz W: **3 matmuls** (6 N H V FLOPs), for token-level
weights, and for sequence-level weights without old_logps (then r_b = exp(0) = 1 whatever logp is, and S_b
depends on A and c alone). Sequence-level weights *with* old_logps need every sequence's mean log-ratio first:
a first pass of the loop without gradients computes logp for every token (the forward kernel only), then the
second pass is the one above: **4 matmuls** (8 N H V FLOPs). Chunks of whole sequences would avoid that pass,
but a single long completion's logits can exceed any budget (T = 16384, V = 151936 in bf16: 4.6 GiB), so the
loop keeps chunks of any size, by the fused cross-entropy's rule (:func:`liger_lab.ops.fused_linear_cross_entropy
.chunk_rows`) with a budget of its own, :data:`CHUNK_BUDGET_BYTES`. The backward only multiplies the gradients
by the incoming scalar (the skeleton's autograd, :class:`liger_lab.ops.chunked.GradsMadeInForward`).

**Precision.** dz is written in the logits' dtype; its global factor 1 / (B T) (a bound on the token count,
known on the host) rides on the matmuls' alpha, and the per-token scale is g B T, of order |A| r, so an fp16 dz
does not underflow where a 1 / tokens factor inside it would. The KL term is computed as expm1(x) - x (TRL's
exp(x) - x - 1 loses its digits as ref approaches logp: about x**2 / 2 left of an O(1) sum). The loss is summed
in float64.

**Nothing is read back.** No ``.item()`` / ``.tolist()`` of a device tensor on the GPU path: token counts, n_b and
the normalizers stay device tensors (a Python-number ``num_items_in_batch`` and dr_grpo's B max_completion_length
are host numbers already), so the host never waits for the GPU. A target out of range is a ValueError in the
interpreter; on the GPU the RL head's kernel makes every logp NaN, and so the loss and the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_lab.formulas import (  # noqa: F401  (chapter 14 reads them here)
    FUSED_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    GRPOOptions,
    check_ignore_index,
    check_number,
    grpo_options,
    loss_from_logps,
)
from liger_lab.ops import chunked
from liger_lab.ops.common import row_count
from liger_lab.ops.cross_entropy import check_target, check_target_tensor
from liger_lab.ops.fused_linear_cross_entropy import chunk_rows
from liger_lab.ops.logprobs import fused_linear_logprobs, logprob_grad_rows, logprob_rows
from liger_lab.ops.operators import define

COMPLETIONS = "B completions of T tokens"
CHUNK_BUDGET_BYTES = 320 * chunked.MIB
"""Bytes of one chunk of logits plus the hidden gradient's buffer. GRPO makes its gradient in the forward, so
every chunk ends with a dW product over the chunk's tokens alone, reading and writing all of dW: above the fused
cross-entropy's 256 MiB, it gives 1024-token chunks (8 at 8192 x 128256, 1.29 GiB above the inputs) instead of 768,
the faster of the two in the H200 sweep of benchmarks/notes/fused_linear_cross_entropy.md."""


def policy_terms(ratio, adv, logp, o: GRPOOptions):
    """Per token: (the policy term l, dl/dlogp through logp itself or None, dl/dratio or None), all fp32."""
    if o.loss_type == "cispo":
        clipped = ratio.clamp(max=o.epsilon_high)
        return -clipped * adv * logp, -clipped * adv, None
    c2 = ratio.clamp(1 - o.epsilon_low, 1 + o.epsilon_high)
    c1 = ratio if o.delta is None else ratio.clamp(max=o.delta)
    a1, a2 = c1 * adv, c2 * adv
    dc1 = 1.0 if o.delta is None else (ratio <= o.delta).float()
    dc2 = ((ratio >= 1 - o.epsilon_low) & (ratio <= 1 + o.epsilon_high)).float()
    picked = torch.where(a1 < a2, dc1, torch.where(a2 < a1, dc2, (dc1 + dc2) / 2))
    return -torch.minimum(a1, a2), None, -adv * picked


@dataclass
class _Tokens:
    """Per-token constants of one call, flat (B T,) fp32 (``mask`` bool)."""

    mask: torch.Tensor
    weight: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    ratio: torch.Tensor | None = None
    """Sequence level: each token's sequence ratio r_b (None at token level)."""
    ratio_grad: torch.Tensor | None = None
    """Sequence level, clipped losses: each kept token's share r_b S_b / max(n_b, 1) of dloss/dlogp."""


def token_terms(logp: torch.Tensor, t: _Tokens, rows: slice, o: GRPOOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(c l, dloss/dlogp) of the tokens ``rows``, zero where masked (whatever old and ref hold there)."""
    mask = t.mask[rows]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    ratio = t.ratio[rows] if t.ratio is not None else None
    if ratio is None:  # token level; without old_logps, old = logp.detach(): w = 0, r = 1
        ratio = torch.ones_like(logp) if t.old is None else torch.where(mask, logp - t.old[rows], zero).exp()
    value, grad, d_ratio = policy_terms(ratio, t.advantages[rows], logp, o)
    if t.ratio is None and d_ratio is not None:
        grad = d_ratio * ratio
    if o.beta != 0:
        x = torch.where(mask, t.ref[rows] - logp, zero)
        expm1 = torch.expm1(x)
        value = value + o.beta * (expm1 - x)
        grad = grad - o.beta * expm1 if grad is not None else -o.beta * expm1
    weight = t.weight[rows]
    value = torch.where(mask, value * weight, zero)
    grad = torch.zeros_like(logp) if grad is None else torch.where(mask, grad * weight, zero)
    if t.ratio_grad is not None:
        grad = grad + t.ratio_grad[rows]
    return value, grad


def _token_weights(mask, n_seq, loss_type, max_completion_length, num_items, num_items_value):
    """c (B T,): the mask over the loss type's normalizer (a device tensor, or a host number where it is one)."""
    n_sequences, seq_len = mask.shape
    kept = mask.float()
    if loss_type == "grpo":
        return (kept / (n_seq.clamp(min=1)[:, None] * max(n_sequences, 1))).reshape(-1)
    if loss_type == "dr_grpo":  # B * max_completion_length; 1 rather than 0 / 0 for an empty batch
        return kept.reshape(-1) / max(n_sequences * (max_completion_length or seq_len), 1)
    if loss_type != "bnpo" and num_items_value is not None:
        return kept.reshape(-1) / max(num_items_value, 1.0)
    total = num_items.float() if loss_type != "bnpo" and num_items is not None else kept.sum()
    return kept.reshape(-1) / total.reshape(()).clamp(min=1)


def _forward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
    old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None, num_items: torch.Tensor | None, loss_type: str,
    importance_sampling_level: str, beta: float, epsilon_low: float, epsilon_high: float, delta: float | None,
    temperature: float, ignore_index: int, max_completion_length: int | None, num_items_value: float | None,
    chunk_tokens: int | None, accumulation: str, per_token: bool, needs: list[bool], loss: torch.Tensor,
    logps: torch.Tensor, entropies: torch.Tensor, grad_hidden: torch.Tensor, grad_weight: torch.Tensor,
    grad_bias: torch.Tensor, owed: torch.Tensor,
) -> None:  # fmt: skip
    """The operator's work, into its outputs: the fp32 loss, with ``per_token`` each token's logp and entropy (else
    both empty), and the gradients ``needs`` asks for, which owe only the upstream gradient. dapo's and cispo's
    num_items_in_batch is ``num_items`` (a device tensor) or ``num_items_value`` (a host number)."""
    o = GRPOOptions(loss_type, importance_sampling_level, beta, epsilon_low, epsilon_high, delta)
    n_sequences, seq_len, _ = hidden.shape
    counts = check_target(target, hidden.shape[:-1], weight.shape[0], ignore_index)  # before any work
    rows, flat_target = chunked.token_rows(hidden, target)
    n_tokens, device = rows.shape[0], rows.device
    mask = (target != ignore_index).reshape(n_sequences, seq_len)
    n_seq = mask.sum(-1)
    flat = lambda x: None if x is None else x.float().expand(n_sequences, seq_len).reshape(-1)  # noqa: E731
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    weights = _token_weights(mask, n_seq, o.loss_type, max_completion_length, num_items, num_items_value)
    ref = flat(ref_logps) if o.beta != 0 else None
    tokens = _Tokens(mask.reshape(-1), weights, flat(adv), flat(old_logps), ref)
    chunk = chunk_rows(rows, weight, chunk_tokens, needs[0], budget=CHUNK_BUDGET_BYTES)
    logp = logps if per_token else torch.empty(n_tokens, dtype=torch.float32, device=device)
    stats = torch.empty(min(chunk, n_tokens), 2, dtype=torch.float32, device=device)

    def logp_step(z: torch.Tensor, chunk_: slice, write_grad: bool, entropy: torch.Tensor | None = None) -> None:
        stats_ = stats[: z.shape[0]]
        logprob_rows(z, flat_target[chunk_], logp[chunk_], stats_, counts, temperature, ignore_index, entropy)

    if o.level == "sequence":
        seq_log_ratio = torch.zeros(n_sequences, dtype=torch.float32, device=device)
        if old_logps is not None:  # the first pass: every logp, for each sequence's mean log-ratio
            chunked.chunked_linear_loss(rows, weight, logp_step, chunk=chunk)
            log_ratio = torch.where(tokens.mask, logp - tokens.old, 0.0).view(n_sequences, seq_len)
            seq_log_ratio = log_ratio.sum(-1) / n_seq.clamp(min=1)
        tokens.ratio = flat(seq_log_ratio.exp()[:, None])
        if o.loss_type != "cispo":  # cispo's ratio is detached: no share of the sequence's gradient
            _, _, d_ratio = policy_terms(tokens.ratio, tokens.advantages, None, o)
            s = torch.where(tokens.mask, d_ratio * tokens.weight, 0.0).view(n_sequences, seq_len).sum(-1)
            share = flat((seq_log_ratio.exp() * s / n_seq.clamp(min=1))[:, None])
            tokens.ratio_grad = torch.where(tokens.mask, share, 0.0)

    values = torch.empty(n_tokens, dtype=torch.float32, device=device)
    scale = float(max(n_tokens, 1))  # the row scale g B T; its 1 / (B T) goes on the matmuls' alpha

    def step(z: torch.Tensor, chunk_: slice, write_grad: bool) -> None:
        logp_step(z, chunk_, write_grad, entropies[chunk_] if per_token else None)
        values[chunk_], grad = token_terms(logp[chunk_], tokens, chunk_, o)
        if write_grad:
            stats_ = stats[: z.shape[0]]
            logprob_grad_rows(z, flat_target[chunk_], stats_, grad * scale, temperature, ignore_index)

    grads = chunked.ChunkGrads.asked(needs, grad_hidden, grad_weight, grad_bias)
    chunked.chunked_linear_loss(rows, weight, step, chunk=chunk, grads=grads, grad_scale=1.0 / scale)
    loss.copy_(values.sum(dtype=torch.float64))
    owed.fill_(1.0)


def _per_token_output(hidden: torch.Tensor, per_token: bool) -> torch.Tensor:
    return hidden.new_empty(row_count(hidden) if per_token else 0, dtype=torch.float32)


FUSED_LINEAR_GRPO = define(
    "fused_linear_grpo", _forward,
    outputs={"loss": lambda hidden: hidden.new_empty((), dtype=torch.float32),
             "logps": _per_token_output, "entropies": _per_token_output, **chunked.grad_outputs()},
)  # fmt: skip
_LOSS = chunked.FusedLoss("fused_linear_grpo", FUSED_LINEAR_GRPO, metrics=2)


# --------------------------------------------------------------------------------------------------
# The public function.


def _check_num_items(num_items_in_batch) -> tuple[float | None, torch.Tensor | None]:
    """(a host number, a device tensor): TRL's num_items_in_batch either way, or (None, None)."""
    if num_items_in_batch is None:
        return None, None
    if isinstance(num_items_in_batch, torch.Tensor):
        chunked.check_one_number("num_items_in_batch", num_items_in_batch, "the tokens of the whole batch")
        return None, num_items_in_batch.detach()
    return check_number("num_items_in_batch", num_items_in_batch, low=0), None


def fused_linear_grpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    ignore_index: int = -100,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    use_bias_correction_kl: bool = False,
    importance_sampling_ratio: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    top_entropy_quantile: float = 1.0,
    off_policy_mask_threshold: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    chunk_tokens: int | None = None,
    accumulation: str | None = None,
    per_token: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL 1.16's ``GRPOTrainer._compute_loss`` for one micro-batch, fused with the LM head (no N x V logits).

    hidden (B, T, H) at the completion positions and weight (V, H) of one dtype; target (B, T) the completion tokens,
    ``ignore_index`` at padding; advantages (B,) or (B, T); old_logps and ref_logps (B, T) or None (floating,
    used in fp32). These and the keywords are TRL's (``GRPOConfig``): ``loss_type`` one of grpo, bnpo, dr_grpo,
    dapo, cispo; ``importance_sampling_level`` "token" or "sequence"; ``epsilon_high`` defaults to
    ``epsilon_low``; ``delta`` the upper clamp of the ratio in the clipped losses; ``beta`` the weight of the k3 KL
    term against ``ref_logps``; ``max_completion_length`` dr_grpo's length (default T); ``num_items_in_batch``
    dapo's and cispo's normalizer (a number or a one-element tensor; default the kept tokens), clamped at 1.
    The formulas are in the module docstring; padding positions contribute nothing whatever old_logps and
    ref_logps hold there, and a batch without sequences gives 0.

    The rest of TRL 1.16's loss math, with ``GRPOConfig``'s names and defaults: ``loss_type`` "sapo"
    (``sapo_temperature_pos``, ``sapo_temperature_neg``), "luspo" and "vespo" (``vespo_k_pos``,
    ``vespo_lambda_pos``, ``vespo_k_neg``, ``vespo_lambda_neg``); ``use_bias_correction_kl`` (the KL term times the
    importance weight; TRL's config defaults it to True, this function to False: pass the config's value);
    ``importance_sampling_ratio`` (B, T) or (B, 1), the vLLM correction TRL multiplies into the per-token loss (into
    VESPO's weights for vespo), computed by the caller as TRL does; ``off_policy_mask_threshold`` (drops a
    sequence of negative advantage whose mean of old_logps - logp exceeds it; needs ``old_logps``, TRL's sampling
    log-probs); ``top_entropy_quantile`` (the policy loss on the tokens of highest entropy only) and
    ``entropy_coef`` (minus that times the mean entropy of those tokens). With any of them, the loss runs on the RL
    head (:func:`liger_lab.fused_linear_logprobs`, with the entropy where needed) and
    :func:`~liger_lab.formulas.loss_from_logps`, TRL's formula on its log-probabilities: four matmuls instead of
    three, exactly TRL's values.

    Returns a float32 scalar; with ``per_token=True`` also each token's logp and entropy (B, T), float32, 0 at
    padding, without gradient: what TRL logs besides the loss (its clip ratios, KL and entropy metrics), from the same
    pass over the vocabulary (the entropy costs the head's forward kernel one more running sum, no matmul). Gradients
    reach hidden and weight only (the rest are constants, as in TRL); they are
    made in the forward, so the graph can be backpropagated once. ``chunk_tokens`` and ``accumulation`` as in
    :func:`liger_lab.fused_linear_cross_entropy`. Bad input (shapes, dtypes, an unknown loss_type or level,
    beta != 0 without ref_logps, options out of their range) raises ValueError; so does a target out of range in the
    interpreter, while on the GPU, which checks it without making the host wait, it makes the loss and the gradients
    NaN. The caller's tensors are never modified.
    """
    o, t = grpo_options(
        loss_type, importance_sampling_level, beta, epsilon_low, epsilon_high, delta,
        use_bias_correction_kl=use_bias_correction_kl, entropy_coef=entropy_coef,
        top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=off_policy_mask_threshold,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos,
        vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
    )  # fmt: skip
    check_ignore_index(ignore_index)
    temperature = check_number("temperature", temperature, positive=True)
    chunked.check_head(hidden, weight, layout=f"(B, T, H), {COMPLETIONS}")
    check_target_tensor(target, hidden.shape[:-1])
    chunked.check_values("advantages", advantages, target.shape, COMPLETIONS, alternative=target.shape[:1])
    for name, logps in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if logps is not None:
            chunked.check_values(name, logps, target.shape, COMPLETIONS)
    if o.beta != 0 and ref_logps is None:
        raise ValueError(f"beta is {beta}: the KL term needs ref_logps, the reference model's (B, T) log-probabilities")
    length = max_completion_length
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise ValueError(f"max_completion_length is {max_completion_length!r}: expected None or a positive int")
    num_items_value, num_items = _check_num_items(num_items_in_batch)
    accumulation = chunked.check_chunk_options("chunk_tokens", chunk_tokens, accumulation)
    if not isinstance(per_token, bool):
        raise ValueError(f"per_token is {per_token!r}: expected True or False")
    if importance_sampling_ratio is not None:
        chunked.check_values(
            "importance_sampling_ratio",
            importance_sampling_ratio,
            target.shape,
            COMPLETIONS,
            alternative=(target.shape[0], 1),
        )
    constants = (
        ("advantages", advantages),
        ("old_logps", old_logps),
        ("ref_logps", ref_logps),
        ("importance_sampling_ratio", importance_sampling_ratio),
    )
    for name, value in constants:
        if value is not None and value.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad, but it is a constant of the loss (as in TRL, no gradient flows to it): pass "
                f"{name}.detach()"
            )
    if t.off_policy_mask_threshold is not None and old_logps is None:
        raise ValueError("off_policy_mask_threshold compares with the sampling policy: it needs old_logps")
    if o.loss_type not in FUSED_LOSS_TYPES or not t.fused or importance_sampling_ratio is not None:
        with_entropy = t.needs_entropy or per_token
        out = fused_linear_logprobs(
            hidden, weight, target, temperature=temperature, ignore_index=ignore_index, entropy=with_entropy,
            chunk_tokens=chunk_tokens, accumulation=accumulation,
        )  # fmt: skip
        logps, entropies = out if with_entropy else (out, None)
        loss = loss_from_logps(
            logps, target != ignore_index, advantages, o, t, entropies=entropies, old_logps=old_logps,
            ref_logps=ref_logps if o.beta else None, importance_sampling_ratio=importance_sampling_ratio,
            max_completion_length=max_completion_length,
            num_items_in_batch=num_items if num_items is not None else num_items_value,
        )  # fmt: skip
        return (loss, logps.detach(), entropies.detach()) if per_token else loss
    needs = chunked.needed_grads(hidden, weight)
    constants = [None if t is None else t.detach() for t in (advantages, old_logps, ref_logps if o.beta else None)]
    arguments = (*o.arguments(), temperature, ignore_index, max_completion_length, num_items_value, chunk_tokens,
                 accumulation, per_token, needs)  # fmt: skip
    loss, logps, entropies = chunked.run_loss(_LOSS, (hidden, weight, target, *constants, num_items), arguments)
    return (loss, logps.view(target.shape), entropies.view(target.shape)) if per_token else loss
