"""What :func:`~liger_lab.hf.patch` did to one model, and what it left alone and why: :func:`report`, which
``liger_lab.patch_report`` is.

It reads the model as it is (its modules' classes, its forward, its head and its config), so it says the same of a
model patched here, one loaded from a pickle, or one that was never patched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from liger_lab.hf.api import family_parts, unwrap
from liger_lab.hf.families import family_row
from liger_lab.hf.loss import fused_head, patched_forward
from liger_lab.hf.modules import experts_fallback, gated_kernel
from liger_lab.hf.registry import PIECE_KINDS, UNFUSED
from liger_lab.ops import glu as glu_ops


@dataclass(frozen=True)
class PatchReport:
    """What :func:`~liger_lab.hf.patch` did to one model: the modules now fused, counted per kind, and what it left
    alone and why. ``str()`` prints it as a table."""

    model_type: str
    replaced: dict[str, int]
    left_alone: dict[str, str]

    def __str__(self) -> str:
        width = max([34, *(len(kind) + 1 for kind in (*self.replaced, *self.left_alone))])  # a vision tower's are long
        lines = [f"liger_lab patch of a {self.model_type} model"]
        lines += [f"  fused      {kind:<{width}}{count:>3}" for kind, count in self.replaced.items()]
        lines += [f"  left alone {kind:<{width}}{why}" for kind, why in self.left_alone.items()]
        return "\n".join(lines)


def report(model: nn.Module) -> PatchReport:
    """The :class:`PatchReport` of a model (a PEFT wrapper is looked through), patched or not."""
    model = unwrap(model)
    model_type = getattr(model.config, "model_type", None)
    family = family_row(model_type)
    parts = family_parts(model)
    replaced: dict[str, int] = {}
    experts: list[nn.Module] = []
    # By the transformers class each module is or derives from (the fused classes' names may say more than Fused +
    # that name: registry.FUSED_NAMES), over the rows of every part (a Pixtral vision tower's too).
    kind_of = {family_row(t).name(suffix): kind for t, _ in parts[::-1] for suffix, kind in PIECE_KINDS.items()}
    vision_side = _vision_side(model)
    for module in model.modules():
        name = _transformers_class(module).__name__
        kind = kind_of.get(name) if type(module) in UNFUSED else None
        if name == family.name("Experts"):
            experts.append(module)  # counted below, where the fused loop is what its forward runs
        elif kind is not None and not (kind.needs_weight and getattr(module, "weight", None) is None):
            # (a norm without weight runs transformers')
            label = f"{kind.label} {_VISION_SIDE}" if id(module) in vision_side else kind.label
            replaced[label] = replaced.get(label, 0) + 1
    left_alone: dict[str, str] = dict(family.left_alone)
    activation = getattr(model.config.get_text_config(), family.act_attr, None)  # a vision-language model's text config
    fused_experts = [m for m in experts if type(m) in UNFUSED and experts_fallback(family, m) is None]
    if fused_experts:
        glu = "GeGLU" if gated_kernel(activation) is glu_ops.geglu else "SwiGLU"
        replaced[f"{PIECE_KINDS['Experts'].label} ({glu})"] = len(fused_experts)
    elif experts and family.experts:
        left_alone["experts"] = experts_fallback(family, experts[0]) or "not patched (swiglu=False?)"
    if experts:
        left_alone["router"] = "transformers' own: top-k routing and its load-balancing loss are not fused"
    mlp = family.name("MLP")
    if not family.mlp or not any(_transformers_class(module).__name__ == mlp for module in model.modules()):
        left_alone.setdefault("MLP", "no dense MLP: every layer is a mixture of experts")  # unless the row says why
    elif not replaced.get(PIECE_KINDS["MLP"].label):
        left_alone["MLP"] = _why_not_fused(activation)
    for part_type, part in parts[1:]:  # a vision encoder's row says what of it stays transformers'
        encoder = family_row(part_type)
        if not any(type(module) in UNFUSED for module in part.modules()):  # patch("llava") alone, say
            left_alone["vision tower"] = f"{encoder.prefix}, not patched: patch(model) or patch({part_type!r}) fuses it"
            continue
        left_alone.update(encoder.left_alone)
        mlp = encoder.name("MLP")
        fused_mlps = [type(m) in UNFUSED for m in part.modules() if _transformers_class(m).__name__ == mlp]
        if encoder.mlp and fused_mlps and not any(fused_mlps):
            left_alone["vision tower MLP"] = _why_not_fused(getattr(part.config, encoder.act_attr, None))
    # A vision encoder by itself computes no loss.
    loss_patched = False if family.vision_encoder else _loss_lines(model, replaced, left_alone)
    if not replaced and not loss_patched:  # patch never touched it: say that, not what each piece lacks
        replaced, left_alone = {}, {"the whole model": _NOT_PATCHED}
    for section in _SECTIONS:  # after that decision: what a layer above serves (TRL's head) is not the model's patch
        section(model, replaced, left_alone)
    return PatchReport(model_type, replaced, left_alone)


def _why_not_fused(activation: object) -> str:
    """Why a gated MLP runs transformers' forward."""
    return f"activation {activation!r} has no fused kernel" if gated_kernel(activation) is None else (
        "not patched (swiglu=False?)")  # fmt: skip


def _loss_lines(model: nn.Module, replaced: dict[str, int], left_alone: dict[str, str]) -> bool:
    """The report's lines on the loss, added to ``replaced`` or ``left_alone``; whether patch gave the model its
    forward (False: transformers' own runs)."""
    forward = patched_forward(model)
    loss_forward = forward.__func__ if forward is not None else type(model).forward
    fused = getattr(loss_forward, "liger_lab_fused", None)  # None: transformers' own forward
    if forward is not None and forward.kept is not None:
        kept = _written_as(forward.kept)
        left_alone["forward"] = f"{kept}, set on the model before patch, runs the calls the fused loss does not take"
    head = fused_head(model.lm_head) if isinstance(getattr(model, "lm_head", None), nn.Module) else (
        "the model has no lm_head module")  # fmt: skip
    fallback = head if isinstance(head, str) else None
    if fused and fallback is None:
        replaced["loss (fused linear cross-entropy)"] = 1
    elif fused:
        left_alone["loss"] = f"logits materialised: {fallback}"
    else:
        left_alone["loss"] = "transformers' own" if fused is None else "from logits (fused_linear_cross_entropy=False)"
    return fused is not None


_Section = Callable[[nn.Module, dict[str, int], dict[str, str]], None]
_SECTIONS: list[_Section] = []


def add_section(section: _Section) -> None:
    """Let a layer above this one add its lines to every report: ``section(model, replaced, left_alone)`` edits the
    two tables in place (``liger_lab.trl_head`` says whose head a model's training calls reach under TRL)."""
    if section not in _SECTIONS:
        _SECTIONS.append(section)


_NOT_PATCHED = "not patched: liger_lab.patch(model), or patch(model_type) before building it, fuses it"


def _transformers_class(module: nn.Module) -> type:
    """The module's class, or the transformers class its fused class derives from."""
    return UNFUSED.get(type(module), type(module))


_VISION_SIDE = "(vision tower, projector)"
"""How :func:`report` labels the fused modules of a vision-language model outside its language model: the norms of
the language model's class in the vision blocks or the projector (Qwen2.5-VL's, Gemma 3's)."""


def _vision_side(model: nn.Module) -> set[int]:
    """The ids of a vision-language model's modules outside its language model (the base model's ``language_model``,
    under which transformers 5 puts every one of them; SmolVLM's ``text_model``); none for a text model."""
    base = getattr(model, "model", None)
    language_model = getattr(base, "language_model", None) or getattr(base, "text_model", None)
    if not isinstance(language_model, nn.Module):
        return set()
    inside = {id(module) for module in language_model.modules()}
    return {id(module) for module in base.modules() if id(module) not in inside}


def _written_as(function: Callable[..., Any]) -> str:
    """Where a function was defined, as ``name (file)``: a wrapper's ``__qualname__`` is often the wrapped one's
    (functools.wraps copies it), which would name transformers' forward for TRL's."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    if code is None:
        return type(function).__name__
    return f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename.rpartition('site-packages/')[2]})"
