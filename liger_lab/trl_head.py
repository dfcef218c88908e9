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
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from liger_lab.formulas import HEAD_OUTPUTS
from liger_lab.ops.logprobs import fused_linear_logprobs


class LigerLabHead:
    """Stands in for ``trl.kernels.ChunkedLogProbFunction``: the same ``apply`` call and the same five outputs
    (log-probs, entropy, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``; None for those not asked for).

    ``calls`` counts the calls liger_lab's head served; ``fallbacks`` counts those TRL's head served whole (none
    since the RL head computes every output and transform TRL's has; kept for callers that read it)."""

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


def patch_trl() -> LigerLabHead:
    """Route TRL's fused LM head, in every trainer that uses it, through liger_lab's RL head (see the module
    docstring). Returns the head now in place, whose ``calls`` count what it served. Calling it twice changes
    nothing; :func:`unpatch_trl` puts TRL's own head back."""
    utils = _trl_utils()
    current = utils._ChunkedLogProbFunction
    if isinstance(current, LigerLabHead):
        return current
    utils._ChunkedLogProbFunction = LigerLabHead(current)
    return utils._ChunkedLogProbFunction


def unpatch_trl() -> None:
    """Put TRL's own fused LM head back (nothing happens when :func:`patch_trl` was not called)."""
    utils = _trl_utils()
    current = utils._ChunkedLogProbFunction
    if isinstance(current, LigerLabHead):
        utils._ChunkedLogProbFunction = current.trl_function
