"""What the float64 specification (:mod:`liger_lab.reference`) and the kernels (:mod:`liger_lab.ops`) share.

The options of the losses, checked and resolved once as TRL's trainers take them (a ValueError naming the option),
with the public functions' defaults (``tests/test_formulas.py`` holds them to the signatures), so that a kernel and its
reference, which takes the options as keywords, read the same call the same way; the few formulas both evaluate on
the same numbers (:func:`rotate_half`, :func:`log1mexp`, TRL's GRPO loss on per-token log-probabilities,
:func:`loss_from_logps`); and the names of the RL head's outputs. No kernel and no operator here: this module
imports neither :mod:`liger_lab.ops`' kernel modules nor the reference, and both import it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from liger_lab.ops.common import is_finite

# --------------------------------------------------------------------------------------------------
# Option checks


def check_number(name: str, value: float, *, low: float | None = None, positive: bool = False) -> float:
    """A loss option: a finite real number (not a bool), at least ``low`` and > 0 if ``positive``; as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite(value):
        raise ValueError(f"{name} is {value!r}: expected a finite number")
    if positive and value <= 0:
        raise ValueError(f"{name} is {value}: expected a number > 0")
    if low is not None and value < low:
        raise ValueError(f"{name} is {value}: expected a number >= {low}")
    return float(value)


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    """A loss option that names one of ``choices`` (a TRL loss type, an importance-sampling level)."""
    if value not in choices:
        raise ValueError(f"{name} is {value!r}: expected one of {choices}")
    return value


# --------------------------------------------------------------------------------------------------
# Cross-entropy and the JSD: their options, with the public functions' defaults


def check_ignore_index(ignore_index: int) -> int:
    """The target value of the rows a loss skips: an int in the int64 range (the kernels compare it as one)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int) or not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index is {ignore_index!r}: expected an int in the int64 range")
    return ignore_index


REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class LossOptions:
    """Cross-entropy's options with :func:`liger_lab.cross_entropy`'s defaults: every cross-entropy kernel call and
    the float64 reference (:func:`liger_lab.reference.cross_entropy`) read a call through this, validated by
    :func:`check_loss_options`."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    reduction: str = "mean"
    softcap: float | None = None
    z_loss_scale: float = 0.0

    def fields(self) -> tuple[int, float, str, float | None, float]:
        """The fields in the operators' order (spelled out: ``dataclasses.astuple`` copies deeply, on every call)."""
        return self.ignore_index, self.label_smoothing, self.reduction, self.softcap, self.z_loss_scale


def check_loss_options(options: LossOptions) -> None:
    """A ValueError naming the first option out of its range."""
    check_ignore_index(options.ignore_index)
    if not 0.0 <= options.label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing is {options.label_smoothing}: expected a number in [0, 1]")
    if options.reduction not in REDUCTIONS:
        raise ValueError(f"reduction is {options.reduction!r}: expected one of {REDUCTIONS}")
    if options.softcap is not None and not 0 < options.softcap < math.inf:
        raise ValueError(f"softcap is {options.softcap}: expected None or a positive finite number")
    if not 0 <= options.z_loss_scale < math.inf:
        raise ValueError(f"z_loss_scale is {options.z_loss_scale}: expected a non-negative finite number")


@dataclass(frozen=True)
class JSDOptions:
    """The generalized JSD's options (``beta`` and ``temperature`` as TRL's GKD trainer names them) with
    :func:`liger_lab.jsd`'s defaults: the kernels and the float64 reference (:func:`liger_lab.reference.jsd`) read a
    call through :meth:`checked`."""

    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100

    def checked(self) -> JSDOptions:
        """Validated (ValueError naming the option): ``beta`` in [0, 1], ``temperature`` positive and finite,
        ``ignore_index`` an int64; the numbers as floats."""
        for name, value in (("beta", self.beta), ("temperature", self.temperature)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} is {value!r}: expected a number")
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta is {self.beta}: expected a number in [0, 1] (0: forward KL, 1: reverse KL)")
        if not 0.0 < self.temperature < math.inf:
            raise ValueError(f"temperature is {self.temperature}: expected a positive finite number")
        return JSDOptions(float(self.beta), float(self.temperature), check_ignore_index(self.ignore_index))


# --------------------------------------------------------------------------------------------------
# Formulas the kernels and the reference both evaluate


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a < 0, exact on both sides of -log 2."""
    near_zero = a > -math.log(2)
    return torch.where(near_zero, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


# --------------------------------------------------------------------------------------------------
# Preference losses (DPO, ORPO, SimPO, KTO, CPO): the options as TRL 1.16's trainers take them, each builder with its
# public function's defaults


ORPO_MAX_AVG_LOGP = -1e-6
"""ORPO's cap on a sequence's mean token log-probability before the odds (see the module docstring)."""
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
"""TRL 1.16's DPOTrainer loss types implemented here (``DPOConfig.loss_type``)."""
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
"""TRL 1.16's KTOTrainer loss types (``KTOConfig.loss_type``)."""
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")
"""TRL 1.16's CPOTrainer loss types (``CPOConfig.loss_type``); "alphapo" is CPOConfig's shorthand for "simpo" with
cpo_alpha = 0."""
SMOOTHED = {"dpo": ("robust",), "cpo": ("sigmoid", "simpo")}
"""The loss types that read ``label_smoothing``; any other takes none (TRL 1.16 ignores it there, so a value would
be silently dropped: a ValueError here)."""


@dataclass(frozen=True)
class PreferenceOptions:
    """The scalars of one call, validated by the public functions (named as TRL's config fields where TRL has one)."""

    loss: str
    loss_type: str = "sigmoid"
    beta: float = 0.1
    gamma: float = 0.0
    """SimPO's gamma, CPO's simpo_gamma."""
    label_smoothing: float = 0.0
    alpha: float = 0.0
    """CPO's AlphaPO reward shape (0: the log-probability itself)."""
    nll_weight: float = 0.0
    """The weight of the chosen sequences' NLL: 1 for ORPO, cpo_alpha for CPO, 0 otherwise."""
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def arguments(self) -> tuple[str, str, float, float, float, float, float, float, float]:
        """The fields in the operator's order (spelled out: ``dataclasses.astuple`` would break a compiled graph)."""
        return (
            self.loss,
            self.loss_type,
            self.beta,
            self.gamma,
            self.label_smoothing,
            self.alpha,
            self.nll_weight,
            self.desirable_weight,
            self.undesirable_weight,
        )


def averages(o: PreferenceOptions) -> bool:
    """Whether the loss scores a sequence by its mean token log-probability (else by the sum)."""
    return o.loss in ("orpo", "simpo") or (o.loss == "cpo" and o.loss_type in ("ipo", "simpo"))


def _check_smoothing(loss: str, loss_type: str, label_smoothing: float) -> float:
    """label_smoothing in [0, 1], and 0 for a loss type that does not read it (see :data:`SMOOTHED`)."""
    label_smoothing = check_number("label_smoothing", label_smoothing, low=0)
    if label_smoothing > 1:
        raise ValueError(f"label_smoothing is {label_smoothing}: expected a number in [0, 1]")
    if label_smoothing and loss_type not in SMOOTHED[loss]:
        raise ValueError(
            f"label_smoothing is {label_smoothing}: loss_type={loss_type!r} takes none (TRL 1.16 reads it for "
            f"loss_type in {SMOOTHED[loss]} only)"
        )
    return label_smoothing


def dpo_options(beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0) -> PreferenceOptions:
    """DPO's options as TRL 1.16's ``DPOConfig`` takes them, validated (ValueError naming the option)."""
    loss_type = check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    beta = check_number("beta", beta, low=0)
    if loss_type == "ipo" and beta == 0:
        raise ValueError("beta is 0: loss_type='ipo' needs beta > 0 (its target margin is 1 / (2 beta))")
    label_smoothing = _check_smoothing("dpo", loss_type, label_smoothing)
    if loss_type == "robust" and label_smoothing >= 0.5:
        raise ValueError(f"label_smoothing is {label_smoothing}: loss_type='robust' needs it in [0, 0.5)")
    return PreferenceOptions("dpo", loss_type, beta, label_smoothing=label_smoothing)


def orpo_options(beta: float = 0.1) -> PreferenceOptions:
    """ORPO's options, validated: the odds term's beta; the chosen NLL's weight is 1."""
    return PreferenceOptions("orpo", beta=check_number("beta", beta, low=0), nll_weight=1.0)


def simpo_options(beta: float = 2.0, gamma: float = 0.5) -> PreferenceOptions:
    """SimPO's options, validated (gamma, the target margin, may have either sign)."""
    beta, gamma = check_number("beta", beta, low=0), check_number("gamma", gamma)
    return PreferenceOptions("simpo", beta=beta, gamma=gamma)


def cpo_options(
    beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0, cpo_alpha: float = 1.0,
    simpo_gamma: float = 0.5, alpha: float = 0.0,
) -> PreferenceOptions:  # fmt: skip
    """CPO's options as TRL 1.16's ``CPOConfig`` takes them, validated; "alphapo" resolved as its
    ``__post_init__`` resolves it (simpo with cpo_alpha = 0)."""
    loss_type = check_choice("loss_type", loss_type, CPO_LOSS_TYPES)
    if loss_type == "alphapo":
        loss_type, cpo_alpha = "simpo", 0.0
    beta = check_number("beta", beta, low=0)
    if loss_type in ("ipo", "simpo") and beta == 0:
        raise ValueError(f"beta is 0: loss_type={loss_type!r} needs beta > 0 (it divides by beta)")
    cpo_alpha = check_number("cpo_alpha", cpo_alpha, low=0)
    simpo_gamma, alpha = check_number("simpo_gamma", simpo_gamma), check_number("alpha", alpha)
    label_smoothing = _check_smoothing("cpo", loss_type, label_smoothing)
    return PreferenceOptions("cpo", loss_type, beta, simpo_gamma, label_smoothing, alpha, cpo_alpha)


def kto_options(
    beta: float = 0.1, loss_type: str = "kto", desirable_weight: float = 1.0, undesirable_weight: float = 1.0
) -> PreferenceOptions:
    """KTO's options as TRL 1.16's ``KTOConfig`` takes them, validated."""
    loss_type = check_choice("loss_type", loss_type, KTO_LOSS_TYPES)
    return PreferenceOptions(
        "kto",
        loss_type,
        check_number("beta", beta, low=0),
        desirable_weight=check_number("desirable_weight", desirable_weight, low=0),
        undesirable_weight=check_number("undesirable_weight", undesirable_weight, low=0),
    )


def kl_estimate(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """TRL's KL estimate z0 from the KL completions' log-probabilities: their mean difference, clamped at 0 (a
    constant: no gradient)."""
    return (kl_logps.detach().to(torch.float64) - ref_kl_logps.detach().to(torch.float64)).mean().clamp(min=0)


# --------------------------------------------------------------------------------------------------
# GRPO: the options of TRL 1.16's GRPOConfig and its loss on per-token log-probabilities


FUSED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
"""The loss types whose gradient the fused loss makes in its forward (three matmuls)."""
LOSS_TYPES = (*FUSED_LOSS_TYPES, "sapo", "luspo", "vespo")
"""Every loss type of TRL 1.16's GRPO; the others run on the RL head and :func:`loss_from_logps` (four matmuls)."""
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOOptions:
    """The policy loss's scalars of one call (TRL's ``GRPOConfig`` fields), as :meth:`checked` makes them for the
    kernel path and for the float64 reference (:func:`liger_lab.reference.fused_linear_grpo`) alike."""

    loss_type: str
    level: str
    beta: float
    epsilon_low: float
    epsilon_high: float
    delta: float | None

    @classmethod
    def checked(
        cls,
        loss_type: str,
        level: str,  # GRPOConfig's importance_sampling_level
        beta: float,
        epsilon_low: float,
        epsilon_high: float | None,  # None: epsilon_low, as in TRL
        delta: float | None,
    ) -> GRPOOptions:
        """Validated (ValueError naming the option), ``epsilon_high`` defaulting to ``epsilon_low`` as in TRL."""
        epsilon_low = check_number("epsilon_low", epsilon_low, low=0.0)
        return cls(
            check_choice("loss_type", loss_type, LOSS_TYPES),
            check_choice("importance_sampling_level", level, IMPORTANCE_SAMPLING_LEVELS),
            check_number("beta", beta, low=0.0),
            epsilon_low,
            epsilon_low if epsilon_high is None else check_number("epsilon_high", epsilon_high, low=0.0),
            None if delta is None else check_number("delta", delta, positive=True),
        )

    def arguments(self) -> tuple[str, str, float, float, float, float | None]:
        """The fields in the operator's order (spelled out: ``dataclasses.astuple`` would break a compiled graph)."""
        return self.loss_type, self.level, self.beta, self.epsilon_low, self.epsilon_high, self.delta


@dataclass(frozen=True)
class TRLOptions:
    """The options of TRL 1.16's GRPO that the fused loss does not serve: with any of them set (or a loss type
    outside :data:`FUSED_LOSS_TYPES`), :func:`liger_lab.fused_linear_grpo` runs the RL head and :func:`loss_from_logps`.
    Names and defaults are ``GRPOConfig``'s, except ``use_bias_correction_kl``, whose default the caller passes."""

    use_bias_correction_kl: bool = False
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @classmethod
    def checked(
        cls,
        *,
        use_bias_correction_kl: bool = False,
        off_policy_mask_threshold: float | None = None,  # needs old_logps
        **numbers: float,  # every other field, each a finite number
    ) -> TRLOptions:
        """Validated (ValueError naming the option); an option not given takes its default. (No ``dataclasses``
        introspection here: torch.compile traces this.)"""
        if not isinstance(use_bias_correction_kl, bool):
            raise ValueError(f"use_bias_correction_kl is {use_bias_correction_kl!r}: expected True or False")
        checked = {name: check_number(name, value) for name, value in numbers.items()}
        if not 0 <= checked.get("top_entropy_quantile", 1.0) <= 1:
            raise ValueError(f"top_entropy_quantile is {checked['top_entropy_quantile']}: expected a number in [0, 1]")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if checked.get(name) == 0:
                raise ValueError(f"{name} is 0: expected a nonzero temperature")
        if off_policy_mask_threshold is not None:
            off_policy_mask_threshold = check_number("off_policy_mask_threshold", off_policy_mask_threshold)
        return cls(
            use_bias_correction_kl=use_bias_correction_kl,
            off_policy_mask_threshold=off_policy_mask_threshold,
            **checked,
        )

    @property
    def fused(self) -> bool:
        """Whether the fused loss serves these options (each at its neutral value)."""
        return (
            not self.use_bias_correction_kl
            and self.entropy_coef == 0
            and self.top_entropy_quantile == 1
            and self.off_policy_mask_threshold is None
        )

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0 or self.top_entropy_quantile < 1


def grpo_options(
    loss_type: str = "dapo", importance_sampling_level: str = "token", beta: float = 0.0, epsilon_low: float = 0.2,
    epsilon_high: float | None = None, delta: float | None = None, **trl_options: object,
) -> tuple[GRPOOptions, TRLOptions]:  # fmt: skip
    """Every loss option of :func:`liger_lab.fused_linear_grpo`, with its defaults, checked (ValueError naming the
    option): the policy loss's (:meth:`GRPOOptions.checked`) and the rest, ``TRLOptions``' fields
    (:meth:`TRLOptions.checked`). The kernel path and the float64 reference read a call through this."""
    o = GRPOOptions.checked(loss_type, importance_sampling_level, beta, epsilon_low, epsilon_high, delta)
    return o, TRLOptions.checked(**trl_options)


def loss_from_logps(
    logps: torch.Tensor,
    keep: torch.Tensor,
    advantages: torch.Tensor,
    o: GRPOOptions,
    t: TRLOptions,
    *,
    entropies: torch.Tensor | None = None,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on per-token log-probabilities (B, T), its text, for one micro-batch of
    one process: every loss type and option (the KL's bias correction, the vLLM importance-sampling ratio, the
    off-policy sequence mask against ``old_logps``, the high-entropy token mask and the entropy bonus with
    ``entropies``). ``keep`` (B, T) bool is TRL's completion mask. A masked product ``x * mask`` is written
    ``where(keep, x, 0)``, equal wherever x is finite, so that padding (logp 0 here) contributes 0 whatever the
    constants hold there; the loss over no sequence is 0 (TRL's mean gives nan). Computes in ``logps``' dtype."""
    dtype, device = logps.dtype, logps.device
    zero = torch.zeros((), dtype=dtype, device=device)
    mask = keep.to(dtype)

    def masked(x: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, x, zero)

    advantages = advantages.detach().to(dtype)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = logps.detach() if old_logps is None else old_logps.detach().to(dtype)
    entropy_mask = None
    if t.top_entropy_quantile < 1.0:
        kept = entropies.detach()[keep]
        if kept.numel() == 0:
            entropy_mask = torch.zeros_like(keep)
        else:
            threshold = torch.quantile(kept.float(), 1 - t.top_entropy_quantile).to(dtype)
            entropy_mask = (masked(entropies.detach()) >= threshold) & keep
    if t.off_policy_mask_threshold is not None:
        kl = torch.nan_to_num(old - logps.detach(), nan=0.0)
        average = masked(kl).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((advantages >= 0) | (average <= t.off_policy_mask_threshold)).to(dtype)
    log_ratio = logps - old
    if o.level == "token":
        log_weights = log_ratio
    else:
        log_weights = (masked(log_ratio).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    if o.beta != 0.0:
        ref = ref_logps.detach().to(dtype)
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if t.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if o.loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=o.epsilon_high).detach() * advantages * logps
    elif o.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, t.sapo_temperature_pos, t.sapo_temperature_neg).to(dtype)
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    elif o.loss_type == "vespo":
        per_token_loss = -_gamma_weights(advantages, log_ratio.detach(), keep, importance_sampling_ratio, t) * (
            advantages * logps
        )
    else:  # grpo, bnpo, dr_grpo, dapo, luspo: the clipped ratio
        coef_2 = torch.clamp(coef_1, 1 - o.epsilon_low, 1 + o.epsilon_high)
        if o.delta is not None:
            coef_1 = torch.clamp(coef_1, max=o.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if t.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_sampling_ratio is not None and o.loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio.detach().to(dtype)
    if o.beta != 0.0:
        per_token_loss = per_token_loss + o.beta * per_token_kl
    per_token_loss = masked(per_token_loss.expand_as(logps))
    if o.loss_type in ("grpo", "sapo"):
        per_sequence = per_token_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = per_sequence.sum() / max(per_sequence.shape[0], 1)
    elif o.loss_type == "bnpo":
        loss = per_token_loss.sum() / mask.sum().clamp(min=1.0)
    elif o.loss_type == "dr_grpo":
        length = logps.shape[1] if max_completion_length is None else max_completion_length
        loss = per_token_loss.sum() / max(per_token_loss.shape[0] * length, 1)
    elif o.loss_type == "luspo":
        loss = per_token_loss.sum(-1).sum() / max(per_token_loss.shape[0], 1)
    else:  # dapo, cispo, vespo
        normalizer = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=device)
        loss = per_token_loss.sum() / normalizer.to(dtype).clamp(min=1.0)
    if t.entropy_coef != 0:
        effective = keep if entropy_mask is None else keep & entropy_mask
        bonus = torch.where(effective, entropies, zero).sum() / effective.to(dtype).sum().clamp(min=1.0)
        loss = loss - t.entropy_coef * bonus
    return loss


def _gamma_weights(advantages, log_ratio, keep, importance_sampling_ratio, t: TRLOptions) -> torch.Tensor:
    """VESPO's weights phi(w) = e^lambda w^k e^(-lambda w) of the sequence's ratio w (TRL's ``get_gamma_weights``, in
    log space, without gradient)."""
    lower = math.log(1e-8)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    sequence = torch.where(keep, torch.clamp(log_ratio, -20.0, 20.0), zero).sum(-1, keepdim=True)
    if importance_sampling_ratio is not None:
        ratio = importance_sampling_ratio.detach().to(log_ratio.dtype)
        sequence = sequence + torch.clamp(torch.log(ratio), lower, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(sequence, lower, 20.0)
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, t.vespo_k_pos, t.vespo_k_neg).to(log_ratio.dtype)
    lam = torch.where(nonnegative, t.vespo_lambda_pos, t.vespo_lambda_neg).to(log_ratio.dtype).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


# --------------------------------------------------------------------------------------------------
# The RL head's outputs


HEAD_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""The per-token outputs the RL head gives besides logp, as TRL's fused head names them."""


def head_outputs(entropy: bool, outputs: Sequence[str]) -> tuple[str, ...]:
    """The outputs a head call returns after logp, in order: "entropy" first when ``entropy``, then ``outputs`` in the
    order given. Raises ValueError for a name that is not one of :data:`HEAD_OUTPUTS` or one asked for twice."""
    if not isinstance(entropy, bool):
        raise ValueError(f"entropy is {entropy!r}: expected True or False")
    check_output_names("outputs", outputs, HEAD_OUTPUTS)
    names = (("entropy",) if entropy else ()) + tuple(outputs)
    if len(set(names)) != len(names):
        raise ValueError(f"outputs {names} names one output twice (entropy=True already returns the entropy)")
    return names


TOKEN_OUTPUTS = ("log_probs", *HEAD_OUTPUTS)
"""The per-token values a preference loss returns beside its loss on request (``token_outputs``), named as TRL's
fused head names them: what TRL's DPO and KTO trainers log, from the loss's own pass over the vocabulary."""


def check_output_names(argument: str, names: Sequence[str], allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` as a tuple, or ValueError naming ``argument``: a name not in ``allowed``, or one given twice."""
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"{argument} is {names!r}: expected a tuple of names from {allowed}")
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(f"{argument} names {unknown[0]!r}: expected names from {allowed}")
    if len(set(names)) != len(names):
        raise ValueError(f"{argument} {tuple(names)} names one output twice")
    return tuple(names)
