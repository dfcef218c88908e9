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
whether the trainer was built before or after it. What stays TRL's: the losses themselves (DPO's sigmoid, GRPO's
clipping, KTO's KL estimate...), TRL's own code on our log-probs. As in TRL, ``log_sum_sq_probs``, ``mean_logits``
and ``is_top1`` carry no gradient here.

``liger_lab.patch(model)`` patches the backbone (norms, RoPE, MLP) as usual; the two compose in either order.

Two more things happen while TRL is patched:

* **The reference model computes as the policy does.** DPO, KTO, GRPO and RLOO load their reference model from the
  policy's path. When the policy was patched as an object (``liger_lab.patch(model)``), that fresh copy would run
  transformers' layers while the policy runs ours, and in bf16 the two disagree by a few hundredths of a nat per
  sequence (DPO's first loss is then not log 2). The reference model gets the policy's patch, with its options.
* **What is not served is said.** ``DistillationTrainer`` (TRL's ``ChunkedDivergenceFunction``) and the experimental
  GKD, CPO and ORPO trainers compute their losses from TRL's own code or from full logits: building one warns once,
  counts a fallback, and :func:`liger_lab.patch_report` of its model names it.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from liger_lab.formulas import HEAD_OUTPUTS
from liger_lab.hf import api as hf_api
from liger_lab.hf import report as hf_report
from liger_lab.ops.logprobs import fused_linear_logprobs


class LigerLabHead:
    """Stands in for ``trl.kernels.ChunkedLogProbFunction``: the same ``apply`` call and the same five outputs
    (log-probs, entropy, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``; None for those not asked for).

    ``calls`` counts the calls liger_lab's head served; ``fallbacks`` counts the trainers built while patched whose
    loss liger_lab does not serve (the module docstring names them); TRL's head itself serves none, since the RL
    head computes every output and transform TRL's has."""

    def __init__(self, trl_function: type[torch.autograd.Function]) -> None:
        self.trl_function = trl_function
        self.calls = 0
        self.fallbacks = 0

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
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
        wanted = tuple(name for name in HEAD_OUTPUTS if name in outputs)
        with torch.autocast(device_type, enabled=False):
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
_NOT_SERVED = {
    "trl.DistillationTrainer": "its divergence runs TRL's ChunkedDivergenceFunction",
    "trl.experimental.gkd.GKDTrainer": "its generalized JSD is computed from the full logits",
    "trl.experimental.cpo.CPOTrainer": "its loss is computed from the full logits",
    "trl.experimental.orpo.ORPOTrainer": "its loss is computed from the full logits",
}
# A model whose trainer's loss liger_lab does not serve -> the line patch_report shows for it.
_UNSERVED_MODELS: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _trainer_class(path: str) -> type | None:
    module_name, _, name = path.rpartition(".")
    with warnings.catch_warnings():  # TRL's experimental modules warn on import
        warnings.simplefilter("ignore")
        try:
            return getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            return None


def _wrap_init(cls: type, after: Callable[[object], None]) -> None:
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        after(self)

    __init__.liger_lab_original = original
    cls.__init__ = __init__


def _unwrap_init(cls: type) -> None:
    original = getattr(cls.__dict__.get("__init__"), "liger_lab_original", None)
    if original is not None:
        cls.__init__ = original


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


def _name_unserved(path: str, why: str) -> Callable[[object], None]:
    def after(trainer: object) -> None:
        name = path.rpartition(".")[2]
        head = _trl_utils()._ChunkedLogProbFunction
        if isinstance(head, LigerLabHead):
            head.fallbacks += 1
        model = getattr(trainer, "model", None)
        if isinstance(model, nn.Module):
            _UNSERVED_MODELS[model] = f"{name}: {why} (not served by liger_lab; the backbone's patch still runs)"
        warnings.warn(f"liger_lab.patch_trl: {name}'s loss stays TRL's: {why}", stacklevel=3)

    return after


def _trl_section(model: nn.Module, replaced: dict[str, int], left_alone: dict[str, str]) -> None:
    """patch_report's lines for a model under TRL: whose head its training calls reach, and what stays TRL's."""
    unserved = _UNSERVED_MODELS.get(model)
    if unserved is not None:
        left_alone["TRL trainer"] = unserved
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


def patch_trl() -> LigerLabHead:
    """Route TRL's fused LM head, in every trainer that uses it, through liger_lab's RL head; give reference models
    the policy's patch; name the trainers whose loss is not served (see the module docstring). Returns the head now
    in place, whose ``calls`` and ``fallbacks`` count what it served and what it did not. Calling it twice changes
    nothing; :func:`unpatch_trl` puts TRL's own head back."""
    utils = _trl_utils()
    current = utils._ChunkedLogProbFunction
    if isinstance(current, LigerLabHead):
        return current
    for path in _WITH_REFERENCE:
        cls = _trainer_class(path)
        if cls is not None:
            _wrap_init(cls, _patch_reference_like_policy)
    for path, why in _NOT_SERVED.items():
        cls = _trainer_class(path)
        if cls is not None:
            _wrap_init(cls, _name_unserved(path, why))
    utils._ChunkedLogProbFunction = LigerLabHead(current)
    return utils._ChunkedLogProbFunction


def unpatch_trl() -> None:
    """Put TRL's own fused LM head and trainers back (nothing happens when :func:`patch_trl` was not called)."""
    utils = _trl_utils()
    current = utils._ChunkedLogProbFunction
    if isinstance(current, LigerLabHead):
        utils._ChunkedLogProbFunction = current.trl_function
        for path in (*_WITH_REFERENCE, *_NOT_SERVED):
            cls = _trainer_class(path)
            if cls is not None:
                _unwrap_init(cls)
