"""TRL's trainers on liger_lab's LM head: ``liger_lab.patch_trl()``.

TRL 1.16's trainers (SFT, DPO, KTO, GRPO, RLOO and the others built on ``add_fused_lm_head``) never ask the model
for logits while training. ``trl.trainer.utils.add_fused_lm_head`` gives the model a second forward,
``model(..., fused_lm_head=True)``, that runs the backbone and returns per-token log-probs (and, on request, the
entropy and three statistics) from a chunked head that never holds the N x V logits. Every trainer's loss is built
from those log-probs, and every such call goes through one function: ``trl.trainer.utils._ChunkedLogProbFunction``.

:func:`patch_trl` puts liger_lab's RL head (:func:`liger_lab.fused_linear_logprobs`) in that function's place, so
log-probs, every statistic TRL asks for (entropy, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``: SFT logs the
token accuracy, KTO the mean logit) and the gradient of every loss built on them come from liger_lab's kernels, in
one pass over the vocabulary, soft-capped and scaled logits included (``final_logit_softcapping``, ``logit_scale``:
Gemma 2, Cohere, Granite). TRL's own head runs 0 times. TRL looks the function up on each call, so the patch works
whether the trainer was built before or after it. What stays TRL's: the losses themselves (RLOO's, SFT's...), TRL's
own code on our log-probs, except GRPO's, DPO's and KTO's (below). As in TRL, ``log_sum_sq_probs``, ``mean_logits`` and
``is_top1`` carry no gradient here.

``liger_lab.patch(model)`` patches the backbone (norms, RoPE, MLP) as usual; the two compose in either order.

Six more things happen while TRL is patched:

* **The reference model computes as the policy does.** DPO, KTO, GRPO and RLOO load their reference model from the
  policy's path. When the policy was patched as an object (``liger_lab.patch(model)``), that fresh copy would run
  transformers' layers while the policy runs ours, and in bf16 the two disagree by a few hundredths of a nat per
  sequence (DPO's first loss is then not log 2). The reference model gets the policy's patch, with its options.
* **Distillation runs on** :func:`liger_lab.fused_linear_jsd`. ``DistillationTrainer`` computes its divergence in
  ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (TRL's ``ChunkedDivergenceFunction``, which projects
  both heads twice for the mixture and once more in the backward); the experimental ``GKDTrainer`` computes the
  student's and the teacher's full logits and ``generalized_jsd_loss`` on them. Under the patch both call liger_lab's
  fused JSD on the two heads instead (the teacher's logits once, the student's gradient made in the forward), with
  TRL's beta, temperature, mask and ``num_items_in_batch``, and the student's entropy DistillationTrainer logs from
  the same kernel. TRL's path stays where liger_lab's would not compute the same thing: a head with a bias or
  soft-capped logits (``final_logit_softcapping``); for GKD also scaled logits, a LoRA adapter on the head, a
  vision-language model or a prompt-learning adapter; and GKD's evaluation, which asks for the logits.
* **GRPO's loss runs on** :func:`liger_lab.fused_linear_grpo`. ``GRPOTrainer._compute_loss`` asks the model for
  the policy's log-probs and entropies, builds its loss from them and logs its metrics (clip ratios, KL, entropy).
  Under the patch, the policy's head call in it is served by the fused loss instead: the hidden states and head
  weight TRL's fused forward hands the head, with TRL's options (``GRPOConfig`` and the micro-batch: loss type,
  importance-sampling level, clipping, the KL term and its bias correction, vLLM's importance-sampling ratio, the
  entropy mask and bonus), make the loss and its gradient (three matmuls, not the head's four), and the same pass
  gives the log-probs and entropies, without gradient, that TRL's own code then reads for its metrics. The loss
  TRL returns keeps its value (its terms outside the policy loss included) and takes the fused loss's gradient,
  scaled as TRL scales its loss for gradient accumulation. The reference's and the old policy's log-probs still
  come from the RL head. TRL's loss, on liger_lab's head, stays where the fused loss would not compute the same
  thing: a head with a bias or soft-capped logits, ``off_policy_mask_threshold`` (TRL compares with vLLM's sampling
  log-probs), ``top_entropy_quantile`` < 1 on several processes (TRL's quantile spans them), and a subclass with
  its own ``_compute_loss`` or ``_get_per_token_logps_and_entropies``.
* **DPO's and KTO's losses run on** :func:`liger_lab.fused_linear_dpo` **and** :func:`liger_lab.fused_linear_kto`,
  the same way: the policy's head call in their ``_compute_loss`` is served by the fused loss (TRL's beta, loss type,
  label smoothing and loss weight; KTO's desirable and undesirable weights and its KL estimate), whose pass also
  gives the log-probs and the statistics TRL's code then reads (entropy, mean logits, DPO's token accuracy). The
  fused loss needs the reference's log-probs before it makes its gradient, where TRL computes them after the
  policy's forward: they are computed first, by TRL's own ``compute_ref_log_probs`` (the reference model, or a PEFT
  policy with its adapter off), and TRL's code reads them as it reads precomputed ones. KTO's KL estimate is TRL's,
  from the log-probs of the KL completions TRL's code scores on the RL head before the policy's forward. TRL's
  loss, on liger_lab's head, stays for DPO's loss types other than sigmoid, hinge and robust (ipo: TRL divides by
  completion counts taken before the shift), several loss types at once, an f-divergence other than reverse KL,
  ``ld_alpha`` and ``use_weighting``; for KTO's vision datasets (``compute_ref_log_probs`` passes no images);
  for both with ``disable_dropout=False`` and a reference computed in the loop (its forward, moved first, would
  draw other dropout masks), a head with a bias or soft-capped logits, and a subclass with its own
  ``_compute_loss``, ``compute_ref_log_probs`` or (KTO) ``_compute_kl_logps``.
* **The experimental CPO's loss runs on** :func:`liger_lab.fused_linear_cpo`. ``CPOTrainer`` asks the model for the
  logits of the chosen and rejected sequences (``concatenated_forward``); under the patch the backbone's last
  hidden states and the head weight make the loss, its NLL term and their gradient instead (TRL's beta, loss type,
  label smoothing, ``cpo_alpha``, ``simpo_gamma``, AlphaPO's ``alpha``), the logits never made, and TRL's code
  computes its metrics from the scores of the same pass (the logits' mean it logs from the hidden states and the
  weight's mean row, the same number for a linear head). TRL's path stays for an encoder-decoder model, a
  Mixture-of-Experts router loss, the heads GKD's path does not serve (scaled or soft-capped logits, a bias, a LoRA
  adapter on the head, a vision-language model), and a subclass with its own loss computation.
* **What is not served is said.** Such a trainer or option, and the experimental ORPO trainer (its loss comes from
  full logits), warn once, count a fallback, and :func:`liger_lab.patch_report` of the model names them; a trainer
  served here shows there as served.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from liger_lab.formulas import HEAD_OUTPUTS
from liger_lab.hf import api as hf_api
from liger_lab.hf import loss as hf_loss
from liger_lab.hf import report as hf_report
from liger_lab.ops.fused_linear_jsd import fused_linear_jsd
from liger_lab.ops.grpo import fused_linear_grpo
from liger_lab.ops.logprobs import fused_linear_logprobs
from liger_lab.ops.preference import fused_linear_cpo, fused_linear_dpo, fused_linear_kto


class LigerLabHead:
    """Stands in for ``trl.kernels.ChunkedLogProbFunction``: the same ``apply`` call and the same five outputs
    (log-probs, entropy, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``; None for those not asked for).

    ``calls`` counts the calls liger_lab served (head calls, the fused losses of GRPO, DPO, KTO and CPO, divergences
    of the distillation trainers);
    ``fallbacks`` counts the trainers built while patched whose loss, or one of whose options, liger_lab does not
    serve (the module docstring names them); TRL's head itself serves none, since the RL head computes every output
    and transform TRL's has."""

    def __init__(self, trl_function: type[torch.autograd.Function]) -> None:
        self.trl_function = trl_function
        self.calls = 0
        self.fallbacks = 0
        self.served: _ServedCall | None = None
        """Set while a served trainer's loss is computed (GRPO's, DPO's): the policy's head call is served by its
        fused loss."""

    def apply(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: Sequence[str] = ("log_probs", *HEAD_OUTPUTS),
    ) -> tuple[torch.Tensor | None, ...]:
        # TRL's head computes in the autocast dtype when autocast is on (and the weight is cast chunk by chunk); the
        # RL head takes one dtype for hidden and weight, so both are cast once, outside autocast.
        dtype = _compute_dtype(hidden)
        if self.served is not None and bias is None and final_logit_softcapping is None:
            with torch.autocast(hidden.device.type, enabled=False):
                return self.served.serve(hidden.to(dtype), weight.to(dtype), temperature, logit_scale)
        wanted = tuple(name for name in HEAD_OUTPUTS if name in outputs)
        with torch.autocast(hidden.device.type, enabled=False):
            cast_bias = None if bias is None else bias.to(dtype)
            result = fused_linear_logprobs(
                hidden.to(dtype), weight.to(dtype), targets, cast_bias, temperature=temperature, outputs=wanted,
                softcap=final_logit_softcapping, logit_scale=logit_scale,
            )  # fmt: skip
        log_probs, *made = result if wanted else (result,)
        by_name = dict(zip(wanted, made, strict=True))
        if "log_sum_sq_probs" in by_name:  # a statistic in TRL: no gradient flows through it there
            by_name["log_sum_sq_probs"] = by_name["log_sum_sq_probs"].detach()
        self.calls += 1
        return log_probs, *(by_name.get(name) for name in HEAD_OUTPUTS)

    def jsd(
        self,
        student: tuple[torch.Tensor, torch.Tensor],
        teacher: tuple[torch.Tensor, torch.Tensor],
        target: torch.Tensor | None,
        **options: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`liger_lab.fused_linear_jsd` of two heads, each given as (hidden, weight), with ``options`` and the
        student's entropy per row: each head in its autocast dtype (as TRL's divergence computes them), a sharded
        weight gathered whole first (as TRL does), outside autocast."""
        heads = []
        for hidden, weight in (student, teacher):
            if isinstance(weight, torch.distributed.tensor.DTensor):
                weight = weight.full_tensor()
            dtype = _compute_dtype(hidden)
            heads += [hidden.to(dtype), weight.to(dtype)]
        with torch.autocast(heads[0].device.type, enabled=False):
            loss, entropy = fused_linear_jsd(*heads, target, entropy=True, **options)
        self.calls += 1
        return loss, entropy


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype TRL's kernels compute a head in: autocast's when it is on, else the hidden states'."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


def _trl_utils():
    if importlib.util.find_spec("trl") is None:
        raise ImportError("liger_lab.patch_trl needs TRL: pip install 'trl>=1.16'")
    from trl.trainer import utils

    if not hasattr(utils, "_ChunkedLogProbFunction"):
        raise ImportError(
            "this TRL has no fused LM head (trl.trainer.utils._ChunkedLogProbFunction, TRL 1.16): liger_lab.patch_trl "
            "supports TRL 1.16"
        )
    return utils


# Trainers that load a reference model from the policy's path, and those whose loss stays TRL's, with why.
_WITH_REFERENCE = ("trl.DPOTrainer", "trl.KTOTrainer", "trl.GRPOTrainer", "trl.RLOOTrainer")
_NOT_SERVED = {"trl.experimental.orpo.ORPOTrainer": "its loss is computed from the full logits"}
_DISTILLATION = "trl.DistillationTrainer"
_GKD = "trl.experimental.gkd.GKDTrainer"
# What a trainer's model is trained with under the patch -> patch_report's line for it: the loss liger_lab serves,
# or why it stays TRL's.
_SERVED_MODELS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
_UNSERVED_MODELS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _trainer_class(path: str) -> type | None:
    module_name, _, name = path.rpartition(".")
    with warnings.catch_warnings():  # TRL's experimental modules warn on import
        warnings.simplefilter("ignore")
        try:
            return getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            return None


_NOT_ITS_OWN = object()  # what a class or module held under a name before the patch: nothing of its own


def _replace(owner: object, name: str, make: Callable[[Callable], Callable]) -> None:
    """Put ``make(original)`` in ``owner.<name>`` (a class's method, a module's function), keeping what ``owner``
    itself held there (for a class, possibly nothing: the method was inherited) for :func:`_restore`."""
    replacement = make(getattr(owner, name))
    replacement.liger_lab_kept = vars(owner).get(name, _NOT_ITS_OWN)
    setattr(owner, name, replacement)


def _restore(owner: object, name: str) -> None:
    kept = getattr(vars(owner).get(name), "liger_lab_kept", None)
    if kept is _NOT_ITS_OWN:
        delattr(owner, name)
    elif kept is not None:
        setattr(owner, name, kept)


def _after_init(after: Callable[[object], None]) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            after(self)

        return __init__

    return make


def _patch_reference_like_policy(trainer: object) -> None:
    """Give the trainer's reference model the policy's instance patch (see the module docstring)."""
    reference = getattr(trainer, "ref_model", None)
    if reference is None:
        return
    try:
        options = hf_api.patch_options(trainer.model)
        patched_already = hf_api.patch_options(reference) is not None
    except ValueError:  # not a transformers model (or one wrapped for several processes): left as TRL built it
        return
    if options is not None and not patched_already:
        hf_api.patch(reference, **options)


def _name_unserved(trainer: object, why: str) -> None:
    """One warning, one fallback counted and patch_report's line for a trainer whose loss stays TRL's."""
    name = type(trainer).__name__
    head = _trl_utils()._ChunkedLogProbFunction
    if isinstance(head, LigerLabHead):
        head.fallbacks += 1
    model = getattr(trainer, "model", None)
    if isinstance(model, nn.Module):
        _UNSERVED_MODELS[model] = f"{name}: {why} (not served by liger_lab; the backbone's patch still runs)"
    warnings.warn(f"liger_lab.patch_trl: {name}'s loss stays TRL's: {why}", stacklevel=4)


_NAMED_TRAINERS: weakref.WeakSet[object] = weakref.WeakSet()
"""Trainers :func:`_name_served_or_not` has named: once each, whether built under the patch or before it."""


def _name_served_or_not(unserved: Callable[[object], str | None], served: str) -> Callable[[object], None]:
    """After a trainer whose loss liger_lab serves is built (or when it first computes its loss, if it was built
    before the patch): name what stays TRL's (``unserved(trainer)`` says why, or None), or record ``served`` for
    patch_report. Once per trainer."""

    def after(trainer: object) -> None:
        if trainer in _NAMED_TRAINERS:
            return
        _NAMED_TRAINERS.add(trainer)
        why = unserved(trainer)
        if why is not None:
            _name_unserved(trainer, why)
        elif isinstance(getattr(trainer, "model", None), nn.Module):
            _SERVED_MODELS[trainer.model] = served

    return after


# ---------------------------------------------------------------------------------------------------
# DistillationTrainer: TRL's _chunked_divergence_loss on fused_linear_jsd.


def _distillation_unserved(trainer: object) -> str | None:
    """Why DistillationTrainer's divergence stays TRL's (the inputs :func:`_divergence_loss` hands back), or None."""
    models = (("student", trainer.model), ("teacher", getattr(trainer, "teacher_model", None)))
    for role, model in models:
        if model is None:  # a teacher served another way (a subclass's remote teacher): no divergence of two heads
            continue
        model = trainer.accelerator.unwrap_model(model)
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            return f"the {role}'s lm_head has a bias, which fused_linear_jsd does not take"
        if getattr(model.config.get_text_config(), "final_logit_softcapping", None) is not None:
            return f"the {role}'s logits are soft-capped (final_logit_softcapping), which fused_linear_jsd does not do"
    return None


def _served_divergence(trl_loss: Callable) -> Callable:
    """``trl.trainer.distillation_trainer._chunked_divergence_loss`` as :func:`_divergence_loss`, called as TRL
    calls it (its arguments bound by TRL's own signature)."""
    signature = inspect.signature(trl_loss)

    def divergence_loss(*args, **kwargs):
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        return _divergence_loss(trl_loss, **given.arguments)

    return divergence_loss


def _divergence_loss(
    trl_loss: Callable,
    *,
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    completion_mask: torch.Tensor,
    beta: float,
    num_items_in_batch: torch.Tensor | int | None,
    student_lm_head_bias: torch.Tensor | None,
    teacher_lm_head_bias: torch.Tensor | None,
    student_logit_scale: float,
    teacher_logit_scale: float,
    student_final_logit_softcapping: float | None,
    teacher_final_logit_softcapping: float | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What TRL's ``_chunked_divergence_loss`` returns (the loss, the student's entropy summed over the completion
    tokens, their count), from :func:`liger_lab.fused_linear_jsd` on the completion tokens alone. A logit scale is
    applied to the hidden states (the same logits: the head is linear). A bias or a soft cap goes to TRL's own
    function, as named when the trainer was built (:func:`_distillation_unserved`)."""
    if (student_lm_head_bias, teacher_lm_head_bias, student_final_logit_softcapping,
            teacher_final_logit_softcapping) != (None,) * 4:  # fmt: skip
        return trl_loss(
            student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
            completion_mask, beta, num_items_in_batch=num_items_in_batch, student_lm_head_bias=student_lm_head_bias,
            teacher_lm_head_bias=teacher_lm_head_bias, student_logit_scale=student_logit_scale,
            teacher_logit_scale=teacher_logit_scale, temperature=temperature,
            student_final_logit_softcapping=student_final_logit_softcapping,
            teacher_final_logit_softcapping=teacher_final_logit_softcapping,
        )  # fmt: skip
    valid = completion_mask.reshape(-1) != 0
    student = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])[valid]
    teacher = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])[valid]
    if student_logit_scale != 1:
        student = student * student_logit_scale
    if teacher_logit_scale != 1:
        teacher = teacher * teacher_logit_scale
    loss, entropy = _trl_utils()._ChunkedLogProbFunction.jsd(
        (student, student_lm_head_weight), (teacher, teacher_lm_head_weight), None, beta=beta,
        temperature=temperature, num_items_in_batch=num_items_in_batch,
    )  # fmt: skip
    return loss, entropy.sum(), valid.sum()


# ---------------------------------------------------------------------------------------------------
# GKDTrainer: its generalized JSD of the full logits, on fused_linear_jsd from the last hidden states.

_LOGIT_SCALES = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")
"""Config fields by which transformers' causal LMs scale their logits (Cohere, Granite, Falcon-H1, Muse Glimmer)."""


def _plain_head(model: nn.Module) -> nn.Linear | str:
    """The linear layer whose product with the backbone's last hidden states is exactly ``model``'s logits (a PEFT
    wrapper looked through, its copy of a head trained with ``modules_to_save`` read), or why there is none."""
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return "a prompt-learning PEFT adapter adds virtual tokens the backbone alone does not see"
    try:
        inner = hf_api.unwrap(model)
    except ValueError:
        return f"{type(model).__name__} is not a transformers model"
    config = inner.config.get_text_config()
    if config is not inner.config:
        return "a vision-language model's logits come from its own forward"
    if getattr(config, "final_logit_softcapping", None) is not None:
        return "its logits are soft-capped (final_logit_softcapping)"
    scaled = [name for name in _LOGIT_SCALES if getattr(config, name, None) not in (None, 1)]
    if scaled:
        return f"its logits are scaled ({scaled[0]})"
    head = hf_loss.fused_head(inner.get_output_embeddings())
    if isinstance(head, str):
        return head
    if head.lora is not None:
        return "its lm_head carries a LoRA adapter"
    if head.linear.bias is not None:
        return "its lm_head has a bias"
    return head.linear


def _gkd_unserved(trainer: object) -> str | None:
    """Why GKDTrainer's loss stays TRL's, or None."""
    for role, model in (("student", trainer.model), ("teacher", trainer.teacher_model)):
        head = _plain_head(trainer.accelerator.unwrap_model(model))
        if isinstance(head, str):
            return f"the {role}: {head}"
    return None


def _served_gkd_loss(trl_compute_loss: Callable) -> Callable:
    """``GKDTrainer.compute_loss`` on :func:`_gkd_loss` in training, TRL's own where it asks for the outputs
    (evaluation) or where :func:`_gkd_unserved` finds the models not served."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or _gkd_unserved(self) is not None:
            return trl_compute_loss(
                self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        return _gkd_loss(self, model, inputs, num_items_in_batch)

    return compute_loss


def _through(wrapper: nn.Module, inner: nn.Module, method: Callable, *args: object) -> object:
    """``method(*args)`` run inside ``wrapper``'s forward when a wrapper for several processes (DDP, FSDP,
    DeepSpeed) holds ``inner``, so that it gathers, and later reduces, what ``method`` reads, as TRL's own
    distillation does; directly otherwise."""
    if wrapper is inner:
        return method(*args)
    from trl.models.utils import _ForwardRedirection

    return _ForwardRedirection()(wrapper, inner, method, *args)


def _last_hidden_state(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The backbone's last hidden states of a model :func:`_plain_head` accepts, at every position (those before the
    last predict a next token)."""
    backbone = hf_api.unwrap(model).base_model
    batch = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "use_cache": False}
    return backbone(**batch).last_hidden_state


def _gkd_loss(trainer: object, model: nn.Module, inputs: dict[str, torch.Tensor], num_items_in_batch) -> torch.Tensor:
    """GKDTrainer's training loss, ``generalized_jsd_loss`` of the shifted logits with its beta (and temperature 1,
    as ``compute_loss`` calls it), from the two models' last hidden states and heads through fused_linear_jsd: neither
    model's logits are made. Under the trainer's autocast, as the models' own forwards run."""
    accelerator = trainer.accelerator
    student, teacher = accelerator.unwrap_model(model), accelerator.unwrap_model(trainer.teacher_model)
    trainer.teacher_model.eval()
    with torch.no_grad(), accelerator.autocast():
        teacher_hidden = _through(trainer.teacher_model, teacher, _last_hidden_state, teacher, inputs)[:, :-1]

    def student_loss(student: nn.Module) -> torch.Tensor:
        with accelerator.autocast():
            student_hidden = _last_hidden_state(student, inputs)[:, :-1]  # GKD shifts its logits
        loss, _ = _trl_utils()._ChunkedLogProbFunction.jsd(
            (student_hidden, _plain_head(student).weight), (teacher_hidden, _plain_head(teacher).weight),
            inputs["labels"][:, 1:], beta=trainer.beta, num_items_in_batch=num_items_in_batch,
        )  # fmt: skip
        return loss

    return _through(model, student, student_loss, student)


# ---------------------------------------------------------------------------------------------------
# Losses served where TRL computes them. GRPOTrainer's, DPOTrainer's and KTOTrainer's ``_compute_loss`` ask the model
# for the policy's per-token log-probs (and the statistics their metrics read) and build the loss from them. Under
# the patch that head call is served by the trainer's fused loss, given the hidden states and head weight TRL's fused
# forward hands the head: the loss and its gradient are made there, and the same pass gives the per-token values,
# without gradient, that TRL's own code then reads (CPOTrainer, whose TRL asks for logits, at the end). The loss TRL
# returns keeps its value (its terms outside the policy loss, the MoE load balancing, included) and takes the fused
# loss's gradient, scaled as TRL scales its loss.


def _completion_rows(hidden: torch.Tensor, scored: torch.Tensor, scale: float) -> tuple[torch.Tensor, bool]:
    """The hidden rows TRL's fused forward hands its head, as (B, T, H) at the B x T positions of ``scored`` (the
    shifted labels' mask over the last T positions of each sequence), times ``scale`` (a logit scale: the same
    logits, the head being linear), and whether TRL gave them compact. TRL scores, after the shift, on Triton's
    devices only the labelled positions (compact), elsewhere every one (B x P rows, P >= T: a prompt-learning
    adapter's virtual tokens come first)."""
    n_sequences, width = scored.shape
    compact = _trl_utils()._use_triton(hidden.device)
    if compact:
        rows = hidden.new_zeros(n_sequences, width, hidden.shape[-1]).masked_scatter(scored[..., None], hidden)
    else:
        rows = hidden.reshape(n_sequences, -1, hidden.shape[-1])[:, -width:]
    return (rows if scale == 1 else rows * scale), compact


def _head_layout(
    values: dict[str, torch.Tensor], scored: torch.Tensor, compact: bool, n_rows: int
) -> tuple[torch.Tensor | None, ...]:
    """TRL's head's five outputs (log-probs, then :data:`~liger_lab.formulas.HEAD_OUTPUTS`; None for those not in
    ``values``) for the ``n_rows`` rows of :func:`_completion_rows`, from per-token ``values`` (B, T) by name: the
    scored positions' alone, or every position's (0 before the last T)."""

    def laid_out(per_token: torch.Tensor | None) -> torch.Tensor | None:
        if per_token is None:
            return None
        if compact:
            return per_token[scored]
        every = per_token.new_zeros(scored.shape[0], n_rows // scored.shape[0])
        every[:, -scored.shape[1] :] = per_token
        return every.reshape(-1)

    return tuple(laid_out(values.get(name)) for name in ("log_probs", *HEAD_OUTPUTS))


@dataclass
class _ServedCall:
    """One call of the loss method (:attr:`loss_method`) of a trainer whose loss a fused loss serves, under the patch:
    what the fused loss needs of the trainer and the micro-batch, and the loss it made (None until then). One
    subclass per trainer."""

    trainer: object
    inputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None

    trainer_path: ClassVar[str]
    """The trainer, as :func:`_trainer_class` finds it."""
    fused_loss: ClassVar[str]
    """The liger_lab function that serves it."""
    own_methods: ClassVar[tuple[str, ...]]
    """TRL's methods whose work :meth:`serve` does: a subclass with its own is not served."""
    loss_method: ClassVar[str] = "_compute_loss"
    """The trainer's method that computes the loss of a micro-batch, which :func:`_served_loss` wraps."""

    @classmethod
    def served_as(cls) -> str:
        """patch_report's line for a trainer served."""
        return f"{cls.trainer_path.rpartition('.')[2]}'s loss ({cls.fused_loss})"

    @classmethod
    def unserved(cls, trainer: object) -> str | None:
        """Why the trainer's loss stays TRL's (liger_lab's head, TRL's loss on its values), or None."""
        for name in cls.own_methods:
            if getattr(type(trainer), name) is not getattr(_trainer_class(cls.trainer_path), name):
                return f"{type(trainer).__name__} has its own {name}"
        model = trainer.accelerator.unwrap_model(trainer.model)
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            return f"its lm_head has a bias, which {cls.fused_loss} does not take"
        if getattr(model.config.get_text_config(), "final_logit_softcapping", None) is not None:
            return f"its logits are soft-capped (final_logit_softcapping), which {cls.fused_loss} does not do"
        return cls.options_unserved(trainer)

    @staticmethod
    def options_unserved(trainer: object) -> str | None:
        """Why the trainer's options are not the fused loss's, or None."""
        return None

    @classmethod
    def start(cls, trainer: object, inputs: dict[str, torch.Tensor]) -> _ServedCall:
        """The call for one micro-batch, made before TRL's loss method runs and before the head serves it."""
        return cls(trainer, inputs)

    @contextlib.contextmanager
    def around_trl(self) -> Iterator[None]:
        """Held while TRL's loss method runs on :attr:`inputs`."""
        yield

    @property
    def scale(self) -> float:
        """What TRL's loss is to the fused loss."""
        return 1.0

    def keep(self, loss: torch.Tensor) -> None:
        """Keep the fused loss of the micro-batch, a call the head counts."""
        if self.loss is not None:  # the micro-batch's rows came in two calls: the loss of one would be wrong
            name = type(self.trainer).__name__
            raise RuntimeError(f"liger_lab.patch_trl: {name}'s policy head was called twice in one {self.loss_method}")
        self.loss = loss
        _trl_utils()._ChunkedLogProbFunction.calls += 1

    def serve(
        self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, logit_scale: float
    ) -> tuple[torch.Tensor | None, ...]:
        """The policy's head call (``hidden`` the rows TRL's fused forward scores, of one dtype with ``weight``):
        :meth:`keep` the fused loss and return TRL's head's five outputs for those rows, without gradient (None for
        those the trainer does not read)."""
        raise NotImplementedError


def _served_loss(call_type: type[_ServedCall]) -> tuple[Callable[[object], None], Callable[[Callable], Callable]]:
    """(what names the trainer served or not, once; the maker of its loss method, ``call_type.loss_method``): TRL's
    own, run with ``call_type``'s work in place (the policy's head call served), or TRL's own alone where
    ``call_type.unserved`` finds a reason."""
    named = _name_served_or_not(call_type.unserved, call_type.served_as())

    def make(trl_compute_loss: Callable) -> Callable:
        def loss_method(self, model, inputs, *args, **kwargs):
            named(self)
            head = _trl_utils()._ChunkedLogProbFunction
            if not isinstance(head, LigerLabHead) or call_type.unserved(self) is not None:
                return trl_compute_loss(self, model, inputs, *args, **kwargs)
            call = call_type.start(self, inputs)
            head.served = call
            try:
                with call.around_trl():
                    result = trl_compute_loss(self, model, call.inputs, *args, **kwargs)
            finally:
                head.served = None
            if call.loss is None:  # the head was given a bias or a soft cap after all: TRL's loss on our head's values
                return result
            loss, *outputs = result if isinstance(result, tuple) else (result,)
            loss = loss + call.scale * (call.loss - call.loss.detach())
            return (loss, *outputs) if outputs else loss

        return loss_method

    return named, make


# ---------------------------------------------------------------------------------------------------
# GRPOTrainer: its loss on fused_linear_grpo.

_NORMALIZED_BY_ITEMS = ("cispo", "dapo", "vespo")
"""GRPO's loss types whose loss TRL divides by ``num_items_in_batch`` (the others: by their own counts)."""


@dataclass
class _GRPOCall(_ServedCall):
    """One ``GRPOTrainer._compute_loss``: the policy's log-probs and entropies from :func:`fused_linear_grpo`, with
    TRL's options (``GRPOConfig`` and the micro-batch). Served except for ``off_policy_mask_threshold`` (TRL
    compares with vLLM's sampling log-probs) and ``top_entropy_quantile`` < 1 on several processes."""

    trainer_path = "trl.GRPOTrainer"
    fused_loss = "fused_linear_grpo"
    own_methods = ("_compute_loss", "_get_per_token_logps_and_entropies")

    @staticmethod
    def options_unserved(trainer: object) -> str | None:
        if trainer.off_policy_mask_threshold is not None:
            return (
                "off_policy_mask_threshold: TRL's mask compares the policy with vLLM's sampling log-probs, or with "
                "itself without old log-probs, where fused_linear_grpo compares it with old_logps"
            )
        if trainer.top_entropy_quantile < 1 and trainer.accelerator.num_processes > 1:
            return "top_entropy_quantile < 1 on several processes: TRL's quantile is over the tokens of every process"
        return None

    @property
    def training(self) -> bool:
        return self.trainer.model.training  # TRL's own test for its "train" and "eval" modes

    @property
    def scale(self) -> float:
        """1 / the gradient accumulation steps (training), and for the loss types over ``num_items_in_batch`` (a
        count over the generation batch of every process) the processes times the generation's steps over the
        accumulation's."""
        trainer = self.trainer
        accumulation = trainer.current_gradient_accumulation_steps if self.training else 1
        if trainer.loss_type not in _NORMALIZED_BY_ITEMS:
            return 1.0 / accumulation
        processes = trainer.accelerator.num_processes
        return processes * trainer.args.steps_per_generation / accumulation if self.training else float(processes)

    def options(self) -> dict[str, object]:
        """TRL's loss options, by fused_linear_grpo's names, from the trainer and the micro-batch."""
        trainer, args, inputs = self.trainer, self.trainer.args, self.inputs
        vespo = trainer.loss_type == "vespo"
        vllm_ratio = trainer.use_vllm and trainer.vllm_importance_sampling_correction
        entropy_coef = 0.0
        if trainer._entropy_bonus_enabled:  # TRL's bonus is a mean over tokens, over the accumulation steps only
            adaptive_off = trainer.use_adaptive_entropy and trainer._last_world_entropy > args.entropy_target
            accumulation = trainer.current_gradient_accumulation_steps if self.training else 1
            entropy_coef = 0.0 if adaptive_off else trainer.entropy_coef / (accumulation * self.scale)
        return dict(
            old_logps=inputs.get("old_per_token_logps"),
            ref_logps=inputs["ref_per_token_logps"] if trainer.beta != 0 else None,
            beta=trainer.beta, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high, delta=args.delta,
            loss_type=trainer.loss_type, importance_sampling_level=trainer.importance_sampling_level,
            max_completion_length=trainer.max_completion_length,
            num_items_in_batch=inputs["num_items_in_batch"] if trainer.loss_type in _NORMALIZED_BY_ITEMS else None,
            use_bias_correction_kl=args.use_bias_correction_kl,
            importance_sampling_ratio=inputs.get("importance_sampling_ratio") if vespo or vllm_ratio else None,
            entropy_coef=entropy_coef, top_entropy_quantile=trainer.top_entropy_quantile,
            sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
        )  # fmt: skip

    def serve(
        self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, logit_scale: float
    ) -> tuple[torch.Tensor | None, ...]:
        inputs = self.inputs
        completion = inputs["completion_mask"].bool()
        keep = completion if "tool_mask" not in inputs else completion & inputs["tool_mask"].bool()
        rows, compact = _completion_rows(hidden, completion, logit_scale)
        target = inputs["completion_ids"].masked_fill(~keep, -100)
        loss, log_probs, entropy = fused_linear_grpo(
            rows, weight, target, inputs["advantages"], temperature=temperature, per_token=True, **self.options()
        )
        self.keep(loss)
        return _head_layout({"log_probs": log_probs, "entropy": entropy}, completion, compact, hidden.shape[0])


# ---------------------------------------------------------------------------------------------------
# DPOTrainer and KTOTrainer: their losses on fused_linear_dpo and fused_linear_kto.


@dataclass
class _PreferenceCall(_ServedCall):
    """A ``_compute_loss`` of DPOTrainer or KTOTrainer: the policy's log-probs and the statistics the trainer logs
    from the fused loss, over the completion tokens of each sequence.

    The fused loss makes its gradient in the forward, so it needs the reference's log-probs before the policy's head
    is called, where TRL computes them after. :meth:`start` computes them first, with TRL's own
    ``compute_ref_log_probs`` (the reference model, or a PEFT policy with its adapter off; what TRL's precomputation
    calls), and TRL's ``_compute_loss`` reads them as it reads precomputed ones (``precompute_ref_log_probs``): the
    same numbers, in another order. Not served where that order shows: with dropout on (``disable_dropout=False``),
    the reference's forward moved first would draw other masks."""

    own_methods = ("_compute_loss", "compute_ref_log_probs")
    token_outputs: ClassVar[tuple[str, ...]]
    """What the trainer reads of its policy's head call: the log-probs, and the statistics it logs."""

    @classmethod
    def options_unserved(cls, trainer: object) -> str | None:
        why = cls.loss_options_unserved(trainer)
        if why is None and not trainer.precompute_ref_logps and not trainer.args.disable_dropout:
            why = ("disable_dropout=False: the reference's log-probs are computed before the policy's forward here "
                   "(after it in TRL), so dropout would draw other masks")  # fmt: skip
        return why

    @staticmethod
    def loss_options_unserved(trainer: object) -> str | None:
        """Why the trainer's loss options are not the fused loss's, or None."""
        return None

    @staticmethod
    def reference_inputs(computed: tuple[torch.Tensor | None, ...]) -> dict[str, torch.Tensor]:
        """What ``compute_ref_log_probs`` returned, under the keys of the micro-batch TRL reads precomputed
        reference log-probs from."""
        raise NotImplementedError

    @classmethod
    def start(cls, trainer: object, inputs: dict[str, torch.Tensor]) -> _PreferenceCall:
        if trainer.precompute_ref_logps:
            return cls(trainer, inputs)
        # A PEFT policy is its own reference, its adapter off (compute_ref_log_probs switches it, as TRL's loss does)
        reference = trainer.ref_model if trainer.ref_model is not None else trainer.model
        return cls(trainer, {**inputs, **cls.reference_inputs(trainer.compute_ref_log_probs(reference, inputs))})

    @contextlib.contextmanager
    def around_trl(self) -> Iterator[None]:
        """TRL reads the reference's log-probs from the micro-batch, where :meth:`start` put them."""
        trainer, precomputed = self.trainer, self.trainer.precompute_ref_logps
        trainer.precompute_ref_logps = True
        try:
            yield
        finally:
            trainer.precompute_ref_logps = precomputed

    def fused(
        self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, logit_scale: float,
        loss: Callable[..., tuple[torch.Tensor, ...]], **options: object,
    ) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
        """:meth:`serve` by the fused ``loss`` with ``options``, on the completion tokens of the micro-batch's
        sequences (the labels TRL's forward scores: the input ids after the shift, where the completion mask is)."""
        scored = self.inputs["completion_mask"][:, 1:].bool()
        rows, compact = _completion_rows(hidden, scored, logit_scale / temperature)
        target = self.inputs["input_ids"][:, 1:].masked_fill(~scored, -100)
        value, *per_token = loss(rows, weight, target, token_outputs=self.token_outputs, **options)
        self.keep(value)
        return _head_layout(dict(zip(self.token_outputs, per_token, strict=True)), scored, compact, hidden.shape[0])


_DPO_LOSS_TYPES = ("sigmoid", "hinge", "robust")
"""DPO's loss types fused_linear_dpo computes as TRL does (its "ipo" divides by counts of other positions)."""


@dataclass
class _DPOCall(_PreferenceCall):
    """One ``DPOTrainer._compute_loss`` on :func:`fused_linear_dpo`, with TRL's beta, loss type, label smoothing and
    loss weight; the entropy, mean logit and token accuracy DPO logs from the same pass."""

    trainer_path = "trl.DPOTrainer"
    fused_loss = "fused_linear_dpo"
    token_outputs = ("log_probs", "entropy", "mean_logits", "is_top1")

    @staticmethod
    def loss_options_unserved(trainer: object) -> str | None:
        loss_types = tuple(trainer.loss_types)
        if len(loss_types) != 1:
            return f"loss_type {list(loss_types)}: fused_linear_dpo computes one loss type"
        if loss_types[0] == "ipo":
            return ("loss_type 'ipo': TRL divides IPO's log-ratios by the completion mask's counts before the shift, "
                    "which fused_linear_dpo does not take")  # fmt: skip
        if loss_types[0] not in _DPO_LOSS_TYPES:
            return f"loss_type {loss_types[0]!r}: fused_linear_dpo computes {', '.join(_DPO_LOSS_TYPES)} and ipo"
        if trainer.f_divergence_type != "reverse_kl":
            return f"f_divergence_type {trainer.f_divergence_type!r}: fused_linear_dpo scores log-ratios (reverse_kl)"
        if trainer.ld_alpha is not None:
            return "ld_alpha: fused_linear_dpo sums every completion token's log-probability alike"
        if trainer.use_weighting:
            return "use_weighting: fused_linear_dpo weighs every pair alike"
        return None

    @staticmethod
    def reference_inputs(computed: tuple[torch.Tensor | None, ...]) -> dict[str, torch.Tensor]:
        chosen, rejected = computed
        return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

    @property
    def scale(self) -> float:
        return self.trainer.loss_weights[0]  # TRL's loss: the mean over pairs times the loss type's weight

    def serve(
        self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, logit_scale: float
    ) -> tuple[torch.Tensor | None, ...]:
        trainer, inputs = self.trainer, self.inputs
        loss_type = trainer.loss_types[0]
        return self.fused(
            hidden, weight, temperature, logit_scale, fused_linear_dpo, beta=trainer.beta, loss_type=loss_type,
            ref_logps=torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]),
            label_smoothing=trainer.label_smoothing if loss_type == "robust" else 0.0,  # read by "robust" alone
        )  # fmt: skip


@dataclass
class _KTOCall(_PreferenceCall):
    """One ``KTOTrainer._compute_loss`` on :func:`fused_linear_kto`, with TRL's beta, loss type, desirable and
    undesirable weights, and its KL estimate; the entropy and mean logit KTO logs from the same pass.

    TRL scores the KL completions with the policy before its main forward (``_compute_kl_logps``, without gradient,
    on liger_lab's RL head here): :meth:`around_trl` keeps what that returns, and :meth:`serve` makes TRL's estimate
    from it and the reference's, as TRL's ``_compute_loss`` then does (their mean difference, over every process,
    clamped at 0)."""

    trainer_path = "trl.KTOTrainer"
    fused_loss = "fused_linear_kto"
    own_methods = ("_compute_loss", "compute_ref_log_probs", "_compute_kl_logps")
    token_outputs = ("log_probs", "entropy", "mean_logits")
    kl_logps: torch.Tensor | None = None
    """The policy's log-probability of each KL completion (with ``calculate_KL``)."""

    @staticmethod
    def loss_options_unserved(trainer: object) -> str | None:
        if trainer._is_vision_dataset:
            return ("a vision dataset: TRL's compute_ref_log_probs, which computes the reference's log-probs first "
                    "here, does not pass the images")  # fmt: skip
        return None

    @staticmethod
    def reference_inputs(computed: tuple[torch.Tensor | None, ...]) -> dict[str, torch.Tensor]:
        completions, kl_completions = computed
        return {"ref_logps": completions, **({} if kl_completions is None else {"ref_KL_logps": kl_completions})}

    @contextlib.contextmanager
    def around_trl(self) -> Iterator[None]:
        trainer, head = self.trainer, _trl_utils()._ChunkedLogProbFunction
        kl_logps = trainer._compute_kl_logps

        def kept(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
            head.served = None  # a head call for the KL completions: the RL head's, as TRL's head's
            try:
                self.kl_logps = kl_logps(model, batch)
            finally:
                head.served = self
            return self.kl_logps

        trainer._compute_kl_logps = kept
        try:
            with super().around_trl():
                yield
        finally:
            del trainer._compute_kl_logps

    def serve(
        self, hidden: torch.Tensor, weight: torch.Tensor, temperature: float, logit_scale: float
    ) -> tuple[torch.Tensor | None, ...]:
        trainer, inputs = self.trainer, self.inputs
        kl = None
        if trainer.calculate_KL:
            kl = (self.kl_logps - inputs["ref_KL_logps"].to(self.kl_logps.device)).mean().detach()
            kl = trainer.accelerator.gather_for_metrics(kl).mean().clamp(min=0)
        label = torch.as_tensor(inputs["label"], dtype=torch.bool, device=hidden.device)
        return self.fused(
            hidden, weight, temperature, logit_scale, fused_linear_kto, label=label,
            ref_logps=inputs["ref_logps"].to(hidden.device), kl=kl, beta=trainer.beta, loss_type=trainer.loss_type,
            desirable_weight=trainer.desirable_weight, undesirable_weight=trainer.undesirable_weight,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# The experimental CPOTrainer: its loss, from the full logits, on fused_linear_cpo from the last hidden states.


@dataclass
class _CPOCall(_ServedCall):
    """One ``CPOTrainer.get_batch_loss_metrics`` on :func:`fused_linear_cpo`, with TRL's beta, loss type, label
    smoothing, ``cpo_alpha``, ``simpo_gamma`` and AlphaPO's ``alpha``.

    TRL's ``concatenated_forward`` asks the model for the logits of the chosen and rejected sequences and returns
    their scores, the logits themselves and the NLL; TRL's code builds the loss and its metrics from them. While
    the call runs, :meth:`concatenated_forward` stands in for it: the backbone's last hidden states and the head
    weight make the loss and its gradient (three matmuls, the logits never held), with the scores and the chosen
    tokens' log-probs (for the NLL) from the same pass. TRL reads the logits only for their mean (its
    ``logits/chosen`` and ``logits/rejected``): a linear head's mean logit at a position is its hidden state times
    the weight's mean row, so that mean, over every position as TRL takes it, stands in for them (a one-element
    tensor). Not served: an encoder-decoder model, a Mixture-of-Experts model's router loss (from the model's own
    forward), and heads whose product with the last hidden states is not the logits (:func:`_plain_head`)."""

    trainer_path = "trl.experimental.cpo.CPOTrainer"
    fused_loss = "fused_linear_cpo"
    own_methods = ("get_batch_loss_metrics", "concatenated_forward", "concatenated_inputs", "cpo_loss")
    loss_method = "get_batch_loss_metrics"

    @staticmethod
    def options_unserved(trainer: object) -> str | None:
        if trainer.is_encoder_decoder:
            return "an encoder-decoder model"
        if trainer.aux_loss_enabled:
            return "output_router_logits: the router's loss comes from the model's own forward"
        head = _plain_head(trainer.accelerator.unwrap_model(trainer.model))
        return head if isinstance(head, str) else None

    @contextlib.contextmanager
    def around_trl(self) -> Iterator[None]:
        self.trainer.concatenated_forward = self.concatenated_forward
        try:
            yield
        finally:
            del self.trainer.concatenated_forward

    def concatenated_forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What TRL's ``concatenated_forward`` returns (chosen and rejected scores, the logits' stand-ins, the NLL),
        without gradient, the fused loss kept."""
        trainer = self.trainer
        sequences = trainer.concatenated_inputs(batch, padding_value=trainer.pad_token_id,
                                                device=trainer.accelerator.device)  # fmt: skip
        inputs = {"input_ids": sequences["concatenated_input_ids"],
                  "attention_mask": sequences["concatenated_attention_mask"]}  # fmt: skip
        policy = trainer.accelerator.unwrap_model(model)
        return _through(model, policy, self.fused, policy, inputs, sequences["concatenated_labels"])

    def fused(
        self, policy: nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        trainer = self.trainer
        with trainer.accelerator.autocast():
            hidden = _last_hidden_state(policy, inputs)
            dtype = _compute_dtype(hidden)
        weight = _plain_head(policy).weight.to(dtype)
        loss_type, with_nll = trainer.loss_type, trainer.cpo_alpha != 0
        with torch.autocast(hidden.device.type, enabled=False):
            loss, chosen, rejected, *logps = fused_linear_cpo(
                hidden[:, :-1].to(dtype), weight, labels[:, 1:], beta=trainer.beta, loss_type=loss_type,
                label_smoothing=trainer.label_smoothing if loss_type in ("sigmoid", "simpo") else 0.0,
                cpo_alpha=trainer.cpo_alpha, simpo_gamma=trainer.args.simpo_gamma, alpha=trainer.alpha,
                return_logps=True, token_outputs=("log_probs",) if with_nll else (),
            )  # fmt: skip
            self.keep(loss)
            n_chosen = chosen.shape[0]
            nll = torch.zeros((), device=hidden.device)
            if with_nll:  # TRL's cross-entropy: the mean over the chosen sequences' kept tokens (logp 0 elsewhere)
                nll = -logps[0][:n_chosen].sum() / (labels[:n_chosen, 1:] != -100).sum()
            mean_row = weight.detach().float().mean(0)  # TRL's mean of the logits, over every position
            means = [(part.detach().float() @ mean_row).mean().view(1) for part in hidden.split(n_chosen)]
        return chosen, rejected, *means, nll


_SERVED_LOSSES = {call_type: _served_loss(call_type) for call_type in (_GRPOCall, _DPOCall, _KTOCall, _CPOCall)}
"""Each served trainer's call -> (what names it served or not, the maker of its loss method)."""


# ---------------------------------------------------------------------------------------------------
# patch_report's lines, and the patch itself.


def _trl_section(model: nn.Module, replaced: dict[str, int], left_alone: dict[str, str]) -> None:
    """patch_report's lines for a model under TRL: whose head its training calls reach, and what stays TRL's."""
    unserved, served = _UNSERVED_MODELS.get(model), _SERVED_MODELS.get(model)
    if unserved is not None:
        left_alone["TRL trainer"] = unserved
    elif served is not None:
        replaced[served] = 1
    if not _has_trl_head(model):
        return
    if importlib.util.find_spec("trl") is not None and isinstance(_trl_utils()._ChunkedLogProbFunction, LigerLabHead):
        replaced["LM head under TRL (fused_linear_logprobs)"] = 1
    else:
        left_alone["LM head under TRL"] = "TRL's own kernel: liger_lab.patch_trl() puts liger_lab's head in its place"
    if replaced.pop("loss (fused linear cross-entropy)", None):
        left_alone["loss"] = "fused linear cross-entropy only without fused_lm_head=True (TRL trains through its head)"


def _has_trl_head(model: nn.Module) -> bool:
    """Whether TRL's ``add_fused_lm_head`` set its forward on the model (possibly under liger_lab's loss forward)."""
    forward = model.__dict__.get("forward")
    for _ in range(3):
        function = getattr(forward, "__func__", forward)
        code = getattr(function, "__code__", None)  # functools.wraps gave it the model's name and module
        module = getattr(function, "__globals__", {}).get("__name__", "")
        if code is not None and code.co_name == "_fused_forward" and module.startswith("trl."):
            return True
        forward = getattr(forward, "kept", None)
    return False


hf_report.add_section(_trl_section)


def _replacements() -> list[tuple[object, str, Callable[[Callable], Callable]]]:
    """Every (class or module, name, maker of its replacement) the patch puts in place, for those TRL has."""
    made = []
    for path in _WITH_REFERENCE:
        made.append((_trainer_class(path), "__init__", _after_init(_patch_reference_like_policy)))
    for path, why in _NOT_SERVED.items():
        made.append(
            (_trainer_class(path), "__init__", _after_init(lambda trainer, why=why: _name_unserved(trainer, why)))
        )
    distillation = _name_served_or_not(_distillation_unserved, "DistillationTrainer's divergence (fused_linear_jsd)")
    made.append((_trainer_class(_DISTILLATION), "__init__", _after_init(distillation)))
    if _trainer_class(_DISTILLATION) is not None:
        made.append((importlib.import_module("trl.trainer.distillation_trainer"), "_chunked_divergence_loss",
                     _served_divergence))  # fmt: skip
    for call_type, (named, served) in _SERVED_LOSSES.items():
        trainer = _trainer_class(call_type.trainer_path)
        made += [(trainer, "__init__", _after_init(named)), (trainer, call_type.loss_method, served)]
    gkd = _name_served_or_not(_gkd_unserved, "GKDTrainer's generalized JSD (fused_linear_jsd)")
    made += [
        (_trainer_class(_GKD), "__init__", _after_init(gkd)),
        (_trainer_class(_GKD), "compute_loss", _served_gkd_loss),
    ]
    return [(owner, name, make) for owner, name, make in made if owner is not None]


def patch_trl() -> LigerLabHead:
    """Route TRL's fused LM head, in every trainer that uses it, through liger_lab's RL head and the distillation
    trainers' divergence through liger_lab's fused JSD; give reference models the policy's patch; name what is not
    served (see the module docstring). Returns the head now in place, whose ``calls`` and ``fallbacks`` count what
    it served and what it did not. Calling it twice changes nothing; :func:`unpatch_trl` puts TRL's own code back."""
    utils = _trl_utils()
    current = utils._ChunkedLogProbFunction
    if isinstance(current, LigerLabHead):
        return current
    for owner, name, make in _replacements():
        _replace(owner, name, make)
    utils._ChunkedLogProbFunction = LigerLabHead(current)
    return utils._ChunkedLogProbFunction


def unpatch_trl() -> None:
    """Put TRL's own fused LM head, divergence and trainers back (nothing happens when :func:`patch_trl` was not
    called)."""
    utils = _trl_utils()
    current = utils._ChunkedLogProbFunction
    if isinstance(current, LigerLabHead):
        utils._ChunkedLogProbFunction = current.trl_function
        for owner, name, _ in _replacements():
            _restore(owner, name)
