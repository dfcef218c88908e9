"""``patch`` and ``unpatch``: a family's classes, or one model in place.

* ``patch("llama")`` patches the *family*: ``LlamaRMSNorm``, ``LlamaMLP`` and ``LlamaAttention`` in the modeling
  module become fused subclasses, so every model built afterwards is made of them, and ``LlamaForCausalLM.forward``
  is wrapped (which reaches models already built too);
* ``patch(model)`` patches one *instance* in place (a PEFT wrapper is looked through): each of those modules gets the
  fused subclass as its ``__class__`` and the model gets its own ``forward``. Its parameters, buffers and state dict
  stay exactly as they were, and other models are not affected.

Every replacement is a swap of the registry, held by the family or the model, so :func:`unpatch` puts back exactly
the objects it replaced. A patched model composes with what other code puts on it, whichever comes first, and
:func:`unpatch` gives back what the model held before :func:`patch`: accelerate's hooks (``dispatch_model``,
``cpu_offload``, a ``device_map``) stay around the fused modules and the loss, which runs inside the ``lm_head``'s
hook; a forward that another library set on the instance (TRL's ``add_fused_lm_head``) keeps every call the fused
loss does not take; a module that a hook watches keeps its outputs (no in-place backward writes over them); the
wrapper of ``torch.compile(model)`` is looked through. The fused-RoPE switch is per thread.
"""

from __future__ import annotations

import dataclasses
import types
import warnings
import weakref
from typing import TypeVar

import torch
from torch import nn

from liger_lab.hf.families import FAMILIES, Options, family_row, modeling_of
from liger_lab.hf.loss import (
    causal_lm_class,
    is_class_forward,
    loss_forward_of,
    remove_patched_forward,
    set_patched_forward,
)
from liger_lab.hf.modules import fused_classes, gated_kernel, rope_dispatcher
from liger_lab.hf.registry import UNFUSED, hold, original_of, release
from liger_lab.ops import fused_linear_cross_entropy as flce_ops

_M = TypeVar("_M")


def patch(
    model_or_model_type: _M,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
    loss_chunk_tokens: int | None = None,
) -> _M:
    """Run a transformers model (or every model of a family built from now on) on liger_lab's kernels.

    ``model_or_model_type`` is a model type string (``"llama"``, one of :data:`~liger_lab.hf.FAMILIES`), which patches
    the family's classes, or a model instance (a PEFT wrapper is looked through), patched in place with
    its parameters and state dict unchanged; a vision encoder inside it that has a row of its own (a LLaVA's Pixtral
    tower) is fused by that row. ``rms_norm`` covers a family's norms (Nemotron's are LayerNorms that
    scale by 1 + w). ``swiglu`` covers the gated MLP of every family (GeGLU for
    Gemma) and the SiLU (Gemma 4: tanh-GELU) experts of a mixture of experts run by transformers' eager loop.
    ``fused_linear_cross_entropy`` computes the training loss without logits;
    ``cross_entropy`` computes the loss from logits with the fused cross-entropy kernel whenever logits
    are returned with labels. ``loss_chunk_tokens`` sets the fused loss's chunk in tokens; by default it is
    bounded by two hidden states' bytes of logits, because in a training step the chunk adds to every activation
    alive (:func:`liger_lab.ops.fused_linear_cross_entropy.chunk_tokens_in_model`): a larger chunk trades
    memory for the loss's speed. Patching again replaces the previous patch. Returns its argument.
    """
    flce_ops.check_chunk_options("loss_chunk_tokens", loss_chunk_tokens, accumulation=None)
    options = Options(rms_norm, rope, swiglu, cross_entropy, fused_linear_cross_entropy, loss_chunk_tokens)
    if isinstance(model_or_model_type, str):
        _unpatch_family(model_or_model_type)
        _patch_family(model_or_model_type, options)
    else:
        model = unwrap(model_or_model_type)
        _unpatch_model(model)
        _patch_model(model, options)
    return model_or_model_type


def unpatch(model_or_model_type: _M) -> _M:
    """Undo :func:`patch`: the transformers classes, functions and forwards come back exactly. Returns its
    argument. A model built while its family was patched gets its modules' transformers classes back too."""
    if isinstance(model_or_model_type, str):
        _unpatch_family(model_or_model_type)
    else:
        _unpatch_model(unwrap(model_or_model_type))
    return model_or_model_type


def patch_options(model: object) -> dict[str, object] | None:
    """The keywords of the :func:`patch` that patched this model in place (a wrapper is looked through), or None
    when it was not patched by instance: what another model must be given to compute exactly as it does."""
    options = _INSTANCE_OPTIONS.get(unwrap(model))
    return None if options is None else dataclasses.asdict(options)


_INSTANCE_OPTIONS: weakref.WeakKeyDictionary[nn.Module, Options] = weakref.WeakKeyDictionary()


def unwrap(model: object) -> nn.Module:
    """The transformers model inside ``model`` (itself, or the model a PEFT wrapper holds)."""
    from transformers import PreTrainedModel

    seen = model
    for _ in range(5):  # torch.compile's OptimizedModule -> PeftModel -> LoraModel -> the transformers model
        if isinstance(model, PreTrainedModel):
            return model
        get_base_model = getattr(model, "get_base_model", None)
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            inner = model._orig_mod  # its forward calls this module: patched in place, it runs patched
        elif callable(get_base_model):
            inner = get_base_model()
        else:
            inner = getattr(getattr(model, "base_model", None), "model", None)
        if inner is None or inner is model:
            break
        model = inner
    raise ValueError(
        f"cannot patch a {type(seen).__name__}: expected a model type string or a transformers PreTrainedModel "
        "(possibly wrapped by PEFT or torch.compile)"
    )


class _FamilyPatch:
    """What ``patch(model_type)`` holds, so ``unpatch(model_type)`` lets go of exactly that."""

    def __init__(self) -> None:
        self.held: list[tuple[object, str]] = []


_FAMILY_PATCHES: dict[str, _FamilyPatch] = {}


def _patch_family(model_type: str, options: Options) -> None:
    family, modeling = family_row(model_type), modeling_of(model_type)
    record = _FAMILY_PATCHES[model_type] = _FamilyPatch()
    pieces = fused_classes(family, modeling, options)
    replacements = [(modeling, name, piece.fused) for name, piece in pieces.items()]
    if options.rope and family.rope:
        replacements.append((modeling, family.rope_function, rope_dispatcher(family, modeling)))
    if options.loss and not family.vision_encoder:  # a vision encoder has no loss
        forward = loss_forward_of(
            model_type, options.fused_linear_cross_entropy, options.cross_entropy, options.loss_chunk_tokens
        )
        replacements.append((causal_lm_class(model_type), "forward", forward))
    fused_names = {piece.original.__name__: piece.fused.__name__ for piece in pieces.values()}
    for cls in vars(modeling).values():  # the model classes' _no_split_modules, which models built now start from
        kept = isinstance(cls, type) and cls.__dict__.get("_no_split_modules")
        if kept and any(name in fused_names for name in kept):
            replacements.append((cls, "_no_split_modules", _with_fused_names(kept, fused_names)))
    for owner, name, replacement in replacements:
        hold(owner, name, replacement, record)
        record.held.append((owner, name))


def _unpatch_family(model_type: str) -> None:
    family_row(model_type)
    record = _FAMILY_PATCHES.pop(model_type, None)
    for owner, name in record.held if record is not None else ():
        release(owner, name, record)


def _with_fused_names(no_split: object, fused_names: dict[str, str]) -> list[str] | set[str]:
    """A model's ``_no_split_modules`` (the classes accelerate keeps on one device when it places a model:
    ``from_pretrained(..., device_map="auto")``, TRL's own loading) with the fused class of each listed class beside it.
    accelerate finds those modules by class name; a model whose layers are all ``FusedLlamaDecoderLayer`` while the
    list names only ``LlamaDecoderLayer`` would have its layers split across devices, or fail to load
    (``get_balanced_memory``: "max() iterable argument is empty")."""
    added = [fused_names[name] for name in no_split if name in fused_names]
    return {*no_split, *added} if isinstance(no_split, set) else [*no_split, *added]


def _set_class(module: nn.Module, cls: type) -> None:
    """``module.__class__ = cls``, and a forward of the old class bound to the instance follows: accelerate's hooks
    keep the forward they wrapped in ``_old_forward`` (and ``remove_hook_from_module`` puts it in ``forward``), a
    bound method that would go on running the class the module had when it was hooked."""
    bound = [slot for slot in ("forward", "_old_forward") if is_class_forward(module, module.__dict__.get(slot))]
    module.__class__ = cls
    for slot in bound:
        setattr(module, slot, types.MethodType(cls.forward, module))


def _check_language_model(model_type: str, config: object) -> None:
    """A family whose language model is another family's classes (``causal_lm_module``: LLaVA's) fuses those classes
    only: a model whose text config is of another family would run unfused, so it is refused."""
    family = family_row(model_type)
    text_type = config.get_text_config().model_type
    if family.causal_lm_module is not None and text_type != family.module:
        raise ValueError(
            f"the language model of this {model_type!r} model is a {text_type!r} model: liger_lab patches "
            f"{model_type!r} with a {family.module!r} text config"
        )


def family_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The parts of a model that rows of :data:`~liger_lab.hf.FAMILIES` fuse, as (model type, module): the model
    under its own type, then each vision encoder inside it that has a row of its own (``Family.vision_encoder``: a
    LLaVA's Pixtral ``vision_tower``), under that encoder's config's type."""
    from transformers import PreTrainedModel

    parts = [(getattr(model.config, "model_type", None), model)]
    for module in model.modules():
        row = FAMILIES.get(getattr(getattr(module, "config", None), "model_type", None))
        if module is not model and isinstance(module, PreTrainedModel) and row is not None and row.vision_encoder:
            parts.append((module.config.model_type, module))
    return parts


def _patch_model(model: nn.Module, options: Options) -> None:
    model_type = getattr(model.config, "model_type", None)
    family = family_row(model_type)
    _check_language_model(model_type, model.config)
    for part_type, part in family_parts(model):
        _fuse_part(part_type, part, options, holder=model)
    if options.loss and not family.vision_encoder:  # a vision encoder has no loss
        causal_lm = causal_lm_class(model_type)
        # A subclass with its own forward, or a family patched at class level, keeps the forward it has.
        if isinstance(model, causal_lm) and type(model).forward is original_of(causal_lm, "forward"):
            set_patched_forward(
                model, model_type, fused=options.fused_linear_cross_entropy, cross_entropy=options.cross_entropy,
                chunk_tokens=options.loss_chunk_tokens,
            )  # fmt: skip
    _INSTANCE_OPTIONS[model] = options


def _fuse_part(model_type: str, part: nn.Module, options: Options, *, holder: nn.Module) -> None:
    """Give the modules of ``part`` that are pieces of ``model_type``'s row their fused classes, and hold the row's
    RoPE swap for ``holder``, the patched model."""
    family, modeling = family_row(model_type), modeling_of(model_type)
    pieces = fused_classes(family, modeling, options)
    # The part's activation (a vision-language model's config holds its language model's in its text config).
    activation = getattr(part.config.get_text_config(), family.act_attr, None)
    if gated_kernel(activation) is None:  # the gated pieces (dense MLP, experts) have SwiGLU and GeGLU kernels
        for name, piece in list(pieces.items()):
            if piece.kind.gated:
                kind = piece.kind.suffix
                warnings.warn(
                    f"no fused kernel for the {kind} activation {activation!r}: {name} stays as it is", stacklevel=4
                )
                del pieces[name]
    piece_of = {piece.original: piece for piece in pieces.values()}
    fused_names = {piece.original.__name__: piece.fused.__name__ for piece in pieces.values()}
    for name, module in part.named_modules():
        no_split = module.__dict__.get("_no_split_modules")  # each PreTrainedModel's own (transformers' post_init)
        if no_split and any(kept in fused_names for kept in no_split):
            module._no_split_modules = _with_fused_names(no_split, fused_names)
        piece = piece_of.get(type(module))
        if piece is None or (piece.kind.needs_weight and getattr(module, "weight", None) is None):
            continue  # a norm without weight (Gemma 4's with_scale=False) keeps transformers' class
        _set_class(module, piece.fused)
        if name.rpartition(".")[2] in family.in_place_norms:
            module.in_place_backward = True
    if options.rope and family.rope:
        hold(modeling, family.rope_function, rope_dispatcher(family, modeling), holder)


def _unpatch_model(model: nn.Module) -> None:
    # The RoPE swap of each part's row: held by the model, or by an unpickled fused attention of that part.
    swaps = [(modeling_of(part_type), family_row(part_type).rope_function) for part_type, _ in family_parts(model)]
    fused_names = {fused.__name__ for fused in UNFUSED}
    for module in model.modules():
        no_split = module.__dict__.get("_no_split_modules")
        if no_split and fused_names.intersection(no_split):
            kept = [name for name in no_split if name not in fused_names]
            module._no_split_modules = set(kept) if isinstance(no_split, set) else kept
        original = UNFUSED.get(type(module))
        if original is not None:
            _set_class(module, original)
            module.__dict__.pop("in_place_backward", None)
            for modeling, rope_function in swaps:
                release(modeling, rope_function, module)
    remove_patched_forward(model)
    _INSTANCE_OPTIONS.pop(model, None)
    for modeling, rope_function in swaps:
        release(modeling, rope_function, model)
