"""The causal-LM forward: the loss on liger_lab's kernels, from the hidden states and the ``lm_head``'s weight.

The forward computes the loss with :func:`liger_lab.fused_linear_cross_entropy` when labels are given in training:
the (tokens x vocabulary) logits are never materialised, so ``logits`` is None in that output. It shifts the labels
like transformers (position t predicts label t+1, ``-100`` ignored), honours ``num_items_in_batch`` (the Trainer's
gradient-accumulation normaliser: sum over tokens divided by it), ``shift_labels``, ``ignore_index``,
``logits_to_keep`` and ``return_dict``, and applies Gemma 2's ``final_logit_softcapping`` inside the fused loss.
Without labels, in eval mode, or with ``skip_logits=False``, the model returns logits as transformers does (with
``cross_entropy=True`` the loss then comes from :func:`liger_lab.cross_entropy`). The output is of the class the
forward's annotation names, with the base model's fields carried over (a vision-language model's ``image_outputs``);
with ``return_dict=False`` the tuple has transformers' layout, the logits' slot included (None when the fused loss
ran). A vision-language model's ``...ForConditionalGeneration`` is wrapped alike: its base model runs with the
images, and the loss is its ``lm_head``'s.

The fused loss reads the ``lm_head``'s weight and bias: an ``nn.Linear``'s, or a PEFT LoRA layer's, whose active
adapter's term joins the same product (a concatenation of the weight with LoRA's B, see :class:`_LoraTerm`); with its
adapters disabled or merged, the base layer's. A head PEFT trains as a copy (``modules_to_save=["lm_head"]``) is read
as the copy its forward calls. Any other head (DoRA or another LoRA variant, several active adapters,
a quantized layer) gets its logits materialised, with a warning that says why, as does the report. A head that is an
FSDP2 unit or under accelerate's hooks is read inside its own call (:func:`as_forward_of`), so the hooks gather,
load or move what the loss reads.

``patch(model_type)`` wraps the family's ``...ForCausalLM.forward``; ``patch(model)`` gives the model a forward of its
own, a :class:`_BoundForward`, which pickles as its options (a model built while its family was patched keeps its
fused modules when loaded, but its loss is its class's: transformers' own in a process where the family is not
patched). A forward that another library set on the instance (TRL's ``add_fused_lm_head``) keeps every call the fused
loss does not take, and accelerate's hooks stay around the forward and the loss.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import typing
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from liger_lab.hf.families import FAMILIES, causal_lm_modeling, family_row
from liger_lab.hf.registry import original_of
from liger_lab.nn.mlp import outputs_observed
from liger_lab.ops import cross_entropy as ce_ops
from liger_lab.ops import fused_linear_cross_entropy as flce_ops

# ---------------------------------------------------------------------------------------------------
# The wrapper of transformers' forward: which calls the fused loss takes.


_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _causal_lm_forward(
    original: Callable[..., Any], *, fused: bool, cross_entropy: bool, chunk_tokens: int | None
) -> Callable[..., Any]:
    """Wrap a transformers ``...ForCausalLM.forward`` so the loss runs on liger_lab's kernels (the fused loss
    ``chunk_tokens`` at a time; None: :func:`~liger_lab.ops.fused_linear_cross_entropy.chunk_tokens_in_model`).

    ``skip_logits`` (keyword only, not in transformers) chooses explicitly: True computes the fused loss
    without logits, False returns logits; by default the fused loss runs when training with labels.
    """
    signature = inspect.signature(original)  # follows __wrapped__ through transformers' decorators
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    first, *rest = signature.parameters.values()  # self, then the forward's own parameters
    keywords = frozenset(p.name for p in rest if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    output = _output_of(signature)

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``signature.bind(self, *args, **kwargs).arguments``. A call by keywords alone (a training loop's, the
        Trainer's) is sorted by name without ``inspect``, whose binding costs the host more than the rest of this
        wrapper; anything else, and every call that ``bind`` would refuse, goes through ``inspect``."""
        if args or first.name in kwargs or (var_keyword is None and not keywords.issuperset(kwargs)):
            return signature.bind(self, *args, **kwargs).arguments
        arguments = {name: value for name, value in kwargs.items() if name in keywords}
        if len(arguments) < len(kwargs):
            arguments[var_keyword] = {name: value for name, value in kwargs.items() if name not in keywords}
        return arguments

    def run(self, fallback: Callable[..., Any] | None, args: tuple, kwargs: dict[str, Any]):
        """This forward on one call, where every call the loss does not take goes to ``fallback`` (a forward that
        another library set on the instance before patch) or, when it is None, to transformers' ``original``."""
        skip_logits = kwargs.pop("skip_logits", None)
        bound_arguments = bind(self, args, kwargs)
        has_labels = bound_arguments.get("labels") is not None
        if skip_logits and not has_labels:
            raise ValueError("skip_logits=True computes the loss without logits: expected labels")
        use_fused = fused and (self.training if skip_logits is None else skip_logits)
        takes = has_labels and (use_fused or cross_entropy)
        router_logits = bound_arguments.get("output_router_logits")
        if takes and (router_logits or (router_logits is None and getattr(self.config, "output_router_logits", False))):
            # A mixture of experts adding its router's load-balancing loss: transformers' forward, said aloud.
            _report_fallback(type(self).__name__, "output_router_logits adds the router's load-balancing loss")
            takes = False
        if not takes:
            return original(self, *args, **kwargs) if fallback is None else fallback(*args, **kwargs)
        arguments = dict(bound_arguments)
        arguments.pop(first.name, None)  # self, when inspect bound it
        extra = arguments.pop(var_keyword, {}) if var_keyword else {}
        return _loss_forward(self, arguments, extra, fused=use_fused, chunk_tokens=chunk_tokens, output=output)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        return run(self, None, args, kwargs)

    forward.liger_lab_run = run
    forward.liger_lab_patched = True
    forward.liger_lab_fused = fused
    return forward


@dataclass(frozen=True)
class _Output:
    """The output class of a transformers forward and its fields besides ``loss`` and ``logits``, which the fused
    loss's output carries over from the base model's output (or leaves None: a mixture's ``aux_loss``)."""

    cls: type
    carried: tuple[str, ...]


def _output_of(signature: inspect.Signature) -> _Output:
    """The ``ModelOutput`` class that a forward's return annotation names (``CausalLMOutputWithPast``, a mixture's
    ``MoeCausalLMOutputWithPast``, a vision-language model's ``tuple | MultimodalCausalLMOutputWithPast`` with its
    ``image_outputs``), ``CausalLMOutputWithPast`` where it names none. Read when the forward is wrapped, not per
    call: torch.compile cannot trace ``dataclasses.fields`` without a graph break."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    annotation = signature.return_annotation
    named = (annotation, *typing.get_args(annotation))
    cls = next((c for c in named if isinstance(c, type) and issubclass(c, ModelOutput)), CausalLMOutputWithPast)
    return _Output(cls, tuple(name for name in cls.__dataclass_fields__ if name not in ("loss", "logits")))


_LOSS_FORWARDS: dict[tuple[str, bool, bool, int | None], Callable[..., Any]] = {}


def loss_forward_of(model_type: str, fused: bool, cross_entropy: bool, chunk_tokens: int | None) -> Callable[..., Any]:
    """The family's ``...ForCausalLM.forward`` wrapped by :func:`_causal_lm_forward` (one per choice). A
    plain dict, not ``functools.cache``: torch.compile traces a dict lookup, but warns on a cache wrapper."""
    key = (model_type, fused, cross_entropy, chunk_tokens)
    if key not in _LOSS_FORWARDS:
        original = original_of(causal_lm_class(model_type), "forward")
        _LOSS_FORWARDS[key] = _causal_lm_forward(
            original, fused=fused, cross_entropy=cross_entropy, chunk_tokens=chunk_tokens
        )
    return _LOSS_FORWARDS[key]


def causal_lm_class(model_type: str) -> type:
    """The family's causal LM class (a vision-language model's ``...ForConditionalGeneration``)."""
    return getattr(causal_lm_modeling(model_type), family_row(model_type).name("ForCausalLM"))


_REPORTED_FALLBACKS: set[tuple[str, str]] = set()


def _report_fallback(model_class: str, reason: str) -> None:
    """Warn, once per model class and reason, that the fused loss does not run: never a silent fallback."""
    if (model_class, reason) not in _REPORTED_FALLBACKS:
        _REPORTED_FALLBACKS.add((model_class, reason))
        message = f"liger_lab: {model_class}'s loss materialises the logits, the fused loss cannot run: {reason}"
        warnings.warn(message, stacklevel=4)


# ---------------------------------------------------------------------------------------------------
# The loss.


def _keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """transformers' ``logits_to_keep`` selection: last n positions (0: all), or given positions or a mask."""
    if isinstance(logits_to_keep, int):
        return hidden[:, slice(-logits_to_keep, None), :]
    if logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    return hidden[:, logits_to_keep, :]


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _final_norm(base: nn.Module) -> tuple[nn.Module, ...]:
    """The norm whose output is the base model's last hidden state (``norm`` in every text family here, a
    vision-language model's ``language_model.norm``, SmolVLM's ``text_model.norm``), if any."""
    for owner in (base, getattr(base, "language_model", None), getattr(base, "text_model", None)):
        norm = getattr(owner, "norm", None)
        if isinstance(norm, nn.Module):
            return (norm,)
    return ()


def _loss_forward(
    self: nn.Module,
    arguments: dict[str, Any],
    extra: dict[str, Any],
    *,
    fused: bool,
    chunk_tokens: int | None,
    output: _Output,
):
    """transformers' causal-LM forward with the loss computed by liger_lab's kernels, returning ``output``'s class."""
    labels = arguments.pop("labels")
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    return_dict = extra.pop("return_dict", None)
    loss_kwargs = {name: extra.pop(name) for name in _LOSS_KWARGS if name in extra}
    base = getattr(self, self.base_model_prefix, None)
    if base is None:  # Llama 4's causal LM holds its base model as .model under its multimodal prefix, language_model
        base = self.model
    outputs = base(**arguments, **extra)

    kept = _keep_positions(outputs[0], logits_to_keep)
    hidden = kept.reshape(-1, kept.shape[-1])
    ignore_index = loss_kwargs.get("ignore_index", -100)
    shift_labels = loss_kwargs.get("shift_labels")
    if shift_labels is None:  # position t predicts token t + 1; the last position predicts nothing
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden.device)
    if target.numel() != hidden.shape[0]:
        raise ValueError(
            f"labels give {target.numel()} targets but the model kept {hidden.shape[0]} positions: expected one "
            "label per kept position (logits_to_keep must keep every position when labels are given)"
        )
    num_items = loss_kwargs.get("num_items_in_batch")
    reduction = "mean" if num_items is None else "sum"
    # Read from the model's own config, as transformers' forward does: a vision-language model's has neither (its text
    # config may, and its ForConditionalGeneration applies neither).
    softcap = getattr(self.config, "final_logit_softcapping", None)
    family = FAMILIES.get(getattr(self.config, "model_type", None))
    if family is not None and family.text_softcap:  # Gemma 4's conditional generation applies its text config's
        softcap = self.config.get_text_config().final_logit_softcapping
    logits_scaling = getattr(self.config, "logits_scaling", None)  # Granite: logits = lm_head(h) / scaling
    if logits_scaling is not None and logits_scaling != 1:
        kept, hidden = kept / logits_scaling, hidden / logits_scaling  # the same logits, by linearity
    multiplier = getattr(self.config, "lm_head_multiplier", None)  # Falcon-H1: logits = lm_head(h) * multiplier
    if family is not None and family.text_softcap:  # MuseGlimmer: its text config's output_multiplier, then the softcap
        multiplier = getattr(self.config.get_text_config(), "output_multiplier", multiplier)
    if multiplier is not None and multiplier != 1:
        kept, hidden = kept * multiplier, hidden * multiplier

    head, logits = self.lm_head, None
    parts = fused_head(head) if fused else None
    if isinstance(parts, str):
        _report_fallback(type(self).__name__, parts)
    if isinstance(parts, _Head):
        linear, lora = parts.linear, parts.lora

        def fused_loss(hidden: torch.Tensor) -> torch.Tensor:
            weight, bias, lora_input = linear.weight, linear.bias, hidden
            dtype = _autocast_dtype(hidden.device)
            if dtype is not None:  # what autocast would have done to the lm_head's matmul
                hidden, weight = hidden.to(dtype), weight.to(dtype)
                bias = None if bias is None else bias.to(dtype)
            # The loss's chunk sits on top of every activation of the step: bounded by the hidden states.
            chunk = chunk_tokens or flce_ops.chunk_tokens_in_model(*hidden.shape, weight.shape[0], hidden.dtype)
            if lora is not None:
                hidden, weight = lora.widen(lora_input, hidden, weight)
            return flce_ops.fused_linear_cross_entropy(
                hidden,
                weight,
                target.to(hidden.device),  # the head's hook (accelerate's) may have moved hidden to the head's GPU
                bias,
                ignore_index=ignore_index,
                reduction=reduction,
                softcap=softcap,
                chunk_tokens=chunk,
                loss_dtype=torch.float32,
                # The final norm's output is read by this loss alone, unless the caller asked for the hidden
                # states (they include it) or a hook may have kept it: then it must stay intact. A LoRA head's
                # concatenation is the loss's own (the adapter reads the norm's output, which stays intact).
                in_place_backward=lora is not None
                or (
                    not isinstance(outputs, tuple)
                    and getattr(outputs, "hidden_states", None) is None
                    and not outputs_observed(base, *_final_norm(base))
                ),
            )

        loss = as_forward_of(head, fused_loss, hidden)
    else:
        logits = head(kept)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        # An fp32 copy of the logits (what transformers' loss makes too) belongs to the loss alone: its
        # gradient may go over it, and the logits returned stay logits.
        loss = ce_ops.cross_entropy(
            logits.to(torch.float32, copy=True).reshape(-1, logits.shape[-1]), target, ignore_index=ignore_index,
            reduction=reduction, in_place_backward=True,
        )  # fmt: skip
    loss = loss.float()  # fp32 like transformers' loss (the kernels return the logits' or hidden's dtype)
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)

    carried = {name: getattr(outputs, name, None) for name in output.carried}
    result = output.cls(**carried, loss=loss, logits=logits)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if return_dict:
        return result
    # to_tuple() drops the None entries, and transformers' model always has logits here: keep their slot, so
    # the tuple reads (loss, logits or None, cache, ...) like the unpatched model's.
    return (loss, logits, *(value for name, value in result.items() if name not in ("loss", "logits")))


# ---------------------------------------------------------------------------------------------------
# The head: what the fused loss computes the logits from (an nn.Linear, PEFT's LoRA on one, or PEFT's copy of one).


@dataclass(frozen=True)
class _LoraTerm:
    """The active adapter of a PEFT LoRA ``lm_head``, whose forward adds ``s * B(A(dropout(x)))`` to the base
    layer's logits ``x W^T + b`` (A: r x H, B: V x r, s the adapter's scaling).

    The fused loss computes those logits as one product, ``[x, u] @ [W, B]^T + b`` with ``u = s * A(dropout(x))``
    (N x r): ``widen`` makes both concatenations and autograd takes the gradients of x, A and B back through
    them. The price is the V x (H + r) concatenated weight and, when B is trained, its gradient, which the fused
    loss makes whole (W's columns too, dropped when W is frozen: 2 N H V FLOPs that LoRA training does not
    need): 2 V (H + r) elements, 4 V (H + r) bytes in bf16. For V = 128256, H = 4096, r = 16 that is
    1,054,777,344 bytes each, 2,109,554,688 bytes (1.96 GiB) in all (no fp32 dW accumulator at that size).
    transformers' loss holds at least the bf16 logits and an fp32 copy of them, 6 N V bytes: the concatenation
    costs less from N = 2 (H + r) / 3 = 2741 tokens on, and a third of those 6.3 GB at N = 8192.
    """

    a: nn.Linear
    b: nn.Linear
    dropout: nn.Module
    scaling: float

    def widen(self, x: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([hidden, u], [weight, B]) in hidden's and weight's dtypes, for the adapter's input ``x`` (``hidden``
        is ``x`` itself or its copy in the autocast dtype; ``u`` is made under the same autocast as PEFT's)."""
        u = self.a(self.dropout(x.to(self.a.weight.dtype))) * self.scaling  # PEFT casts x to the adapter's dtype
        return torch.cat([hidden, u.to(hidden.dtype)], dim=-1), torch.cat([weight, self.b.weight.to(weight.dtype)], 1)


@dataclass(frozen=True)
class _Head:
    """What the fused loss computes an ``lm_head``'s logits from: a linear layer and the LoRA term, if any."""

    linear: nn.Linear
    lora: _LoraTerm | None = None


def _linear_fallback(layer: nn.Module, name: str) -> str | None:
    """Why the fused loss cannot read ``layer``'s weight and bias as an ``nn.Linear`` (or a subclass that keeps
    its forward: FSDP2's ``FSDPLinear``), or None when it can."""
    if not isinstance(layer, nn.Linear):
        return f"{name} is a {type(layer).__name__}, not an nn.Linear (an adapter or a quantized layer on it?)"
    if type(layer).forward is not nn.Linear.forward:
        return f"{name}'s class {type(layer).__name__} overrides nn.Linear.forward"
    return None


def _is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer, recognised by its attributes: peft is optional and not imported here."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and all(
        isinstance(getattr(module, name, None), nn.ModuleDict) for name in ("lora_A", "lora_B", "lora_dropout")
    )


def _lora_head(head: nn.Module) -> _Head | str:
    """What PEFT's LoRA ``Linear.forward`` computes, as a :class:`_Head`: the base layer alone while adapters are
    disabled or merged into it, with the LoRA term for one active plain adapter. Or why the fused loss cannot
    compute it: a LoRA variant (DoRA, ...), a LoRA bias, several active adapters, a forward pre-hook (PEFT's
    ``adapter_names``, a batch of mixed adapters, comes in through one)."""
    fallback = _linear_fallback(head.base_layer, "lm_head's base layer")
    if fallback is not None:
        return fallback
    if head._forward_pre_hooks:
        return "the LoRA lm_head has a forward pre-hook (PEFT's adapter_names, a batch of mixed adapters?)"
    if head.disable_adapters and head.merged:
        return "the LoRA lm_head's adapters are disabled but merged (its forward unmerges them)"
    adapters = [] if head.disable_adapters or head.merged else [a for a in head.active_adapters if a in head.lora_A]
    if len(adapters) > 1:
        return f"{len(adapters)} LoRA adapters are active on lm_head ({', '.join(adapters)}): at most one is fused"
    if not adapters:
        return _Head(head.base_layer)
    name = adapters[0]
    variant = getattr(head, "lora_variant", {}).get(name)
    if variant is not None or getattr(head, "use_dora", {}).get(name):
        kind = "DoRA (use_dora)" if variant is None else type(variant).__name__
        return f"lm_head's LoRA adapter {name!r} is a {kind}, not plain LoRA"
    a, b = head.lora_A[name], head.lora_B[name]
    for layer, which in ((a, "A"), (b, "B")):
        fallback = _linear_fallback(layer, f"lm_head's LoRA {which}")
        if fallback is None and layer.bias is not None:
            fallback = f"lm_head's LoRA {which} has a bias (lora_bias)"
        if fallback is not None:
            return fallback
    return _Head(head.base_layer, _LoraTerm(a, b, head.lora_dropout[name], head.scaling[name]))


def _is_modules_to_save(module: nn.Module) -> bool:
    """PEFT's ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``: a trained copy of the head per adapter
    beside the frozen original), recognised by its attributes like the LoRA layer."""
    return isinstance(getattr(module, "original_module", None), nn.Module) and isinstance(
        getattr(module, "modules_to_save", None), nn.ModuleDict
    )


def _saved_module(wrapper: nn.Module) -> nn.Module | str:
    """The module PEFT's ``ModulesToSaveWrapper.forward`` calls: the active adapter's copy, or the original while
    adapters are disabled or an active adapter has no copy here. Or why the fused loss cannot tell: a forward
    pre-hook (PEFT's ``adapter_names``, a batch of mixed adapters, comes in through one)."""
    if wrapper._forward_pre_hooks:
        return "lm_head (PEFT's modules_to_save) has a forward pre-hook (adapter_names, a batch of mixed adapters?)"
    active = list(wrapper.active_adapters)
    if wrapper.disable_adapters or not active or any(name not in wrapper.modules_to_save for name in active):
        return wrapper.original_module
    return wrapper.modules_to_save[active[0]]


def fused_head(head: nn.Module) -> _Head | str:
    """What the fused loss computes this ``lm_head``'s logits from, or why it cannot (then the logits are
    materialised): an ``nn.Linear``, a PEFT LoRA layer on one, or PEFT's ``modules_to_save`` copy of one."""
    if _is_modules_to_save(head):
        head = _saved_module(head)
        if isinstance(head, str):
            return head
    if _is_lora_layer(head):
        return _lora_head(head)
    fallback = _linear_fallback(head, "lm_head")
    return _Head(head) if fallback is None else fallback


# ---------------------------------------------------------------------------------------------------
# Inside the head's call: FSDP2 and accelerate's hooks.


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit. Never imports FSDP (a lookup per call instead of an import statement):
    no module is an ``FSDPModule`` before that is imported, and a torch built without distributed support has none."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def _has_accelerate_hook(module: nn.Module) -> bool:
    """Whether accelerate's hooks wrap ``module`` (``add_hook_to_module``, which ``dispatch_model`` and
    ``cpu_offload`` use): the instance's ``forward`` is then accelerate's, which calls the forward it wrapped, kept
    in ``_old_forward``, between the hook's ``pre_forward`` (inputs to the execution device, offloaded weights
    loaded) and ``post_forward``."""
    return "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__


def forward_slot(module: nn.Module) -> str:
    """The instance attribute holding the forward that a call of ``module`` ends in: ``_old_forward`` under
    accelerate's hooks, so that they keep running around whatever is put there; ``forward`` otherwise."""
    return "_old_forward" if _has_accelerate_hook(module) else "forward"


def as_forward_of(module: nn.Module, compute: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
    """``compute(x)`` run as ``module``'s forward when ``module`` is an FSDP2 unit or wrapped by accelerate's
    hooks, else directly.

    A sharded ``lm_head`` (FSDP2's ``fully_shard(model.lm_head)``) holds a shard of its weight outside its
    call: the hooks FSDP2 registers gather the full weight before the forward and reshard it after, and
    again around the backward, where they also reduce-scatter its gradient. An ``lm_head`` under accelerate's
    hooks (``dispatch_model``, ``cpu_offload``) gets its input moved to its device, and an offloaded weight
    loaded, by the hook around its call. The fused loss reads the weight without calling the module, so it borrows
    the call: the forward the call ends in (:func:`forward_slot`) is ``compute`` for the duration, and the hooks
    run around it as around the matmul they expected (casting ``x`` too, under a mixed-precision policy). Then the
    instance gets back exactly what it held. Any other module is not touched: a hook of its own (one that logs the
    logits, say) expects logits, not a loss, so it does not run, as when the fused loss reads the weight directly."""
    if not (is_fsdp_unit(module) or _has_accelerate_hook(module)):
        return compute(x)
    slot = forward_slot(module)
    held = module.__dict__.get(slot)  # accelerate's wrapped forward, or None: the class's forward
    setattr(module, slot, compute)
    try:
        return module(x)
    finally:
        if held is None:
            delattr(module, slot)
        else:
            setattr(module, slot, held)


# ---------------------------------------------------------------------------------------------------
# A patched model's own forward.


def is_class_forward(module: nn.Module, forward: object) -> bool:
    """Whether ``forward`` is the module's class forward bound to it (what accelerate keeps of a module it hooks)."""
    bound = isinstance(forward, types.MethodType) and forward.__self__ is module
    return bound and forward.__func__ is type(module).forward


def _own_keywords(forward: Callable[..., Any], class_forward: Callable[..., Any]) -> frozenset[str]:
    """The keywords that ``forward`` (another library's, set on the instance) names and transformers' forward does
    not, nor the fused loss (TRL's ``fused_lm_head``): a call that passes one is that library's own call."""
    try:  # its own parameters, not those of the forward it says it wraps (functools.wraps)
        theirs = inspect.signature(forward, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):  # no signature to read: every call is treated as transformers'
        return frozenset()
    named = {p.name for p in theirs if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return frozenset(named - set(inspect.signature(class_forward).parameters) - {*_LOSS_KWARGS, "skip_logits"})


class _BoundForward:
    """A patched model's own ``forward``: its family's fused-loss forward bound to it, like a method (it has
    ``__self__``, ``__func__`` and the wrapped forward's signature, which the Trainer reads to pick the
    dataset columns). Unlike a bound method of a function made at patch time, it pickles and deep-copies:
    as the model and the options that choose the function.

    It stands in the model's forward slot (:func:`forward_slot`) in place of ``displaced``, what the instance held
    there (None: nothing), which :meth:`put_back` restores. A ``displaced`` forward other than the class's own is
    another library's (TRL's ``add_fused_lm_head``): it is ``kept`` and gets every call the fused loss does not take,
    and every call passing one of the keywords only it names. After unpatch the object may still be called, by a
    forward another library set after patch around it (TRL's keeps the one it wrapped): it is then inactive and
    passes every call to what it displaced, so the model computes what it did before patch."""

    # Class-level defaults: a patched model pickled before these existed loads as one patched on a bare forward.
    displaced: Callable[..., Any] | None = None
    kept: Callable[..., Any] | None = None
    kept_keywords: frozenset[str] = frozenset()
    active: bool = True

    def __init__(
        self, model: nn.Module, model_type: str, *, fused: bool, cross_entropy: bool, chunk_tokens: int | None
    ) -> None:
        self.__self__ = model
        self.model_type = model_type
        self.fused = fused
        self.cross_entropy = cross_entropy
        self.chunk_tokens = chunk_tokens
        self.displaced = model.__dict__.get(forward_slot(model))
        if self.displaced is not None and not is_class_forward(model, self.displaced):
            self.kept = self.displaced
            self.kept_keywords = _own_keywords(self.kept, self.__func__)
        self._make_function()

    def __setstate__(self, state: dict[str, Any]) -> None:  # unpickled or deep-copied
        self.__dict__.update(state)
        self._make_function()

    def _make_function(self) -> None:
        # Made here, outside any call: torch.compile then traces only the lookup of a function that exists
        # (tracing its first construction, which reads the swap registry, has failed inside Dynamo).
        loss_forward_of(self.model_type, self.fused, self.cross_entropy, self.chunk_tokens)

    @property
    def __func__(self) -> Callable[..., Any]:
        return loss_forward_of(self.model_type, self.fused, self.cross_entropy, self.chunk_tokens)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __call__(self, *args, **kwargs):
        if not self.active:
            return self._before_patch()(*args, **kwargs)
        if self.kept is not None and not self.kept_keywords.isdisjoint(kwargs):
            return self.kept(*args, **kwargs)
        return self.__func__.liger_lab_run(self.__self__, self.kept, args, kwargs)

    def _before_patch(self) -> Callable[..., Any]:
        """What the forward slot held before patch: the displaced forward, else the class's own bound to the model."""
        model = self.__self__
        return self.displaced if self.displaced is not None else types.MethodType(type(model).forward, model)

    def put_back(self, slot: str) -> None:
        """Deactivate, and give ``slot`` of the model (where this object is now: accelerate may have moved it from
        ``forward`` to ``_old_forward`` by hooking the model after patch) what it held before patch."""
        self.active = False
        if slot == "forward" and self.displaced is None:
            delattr(self.__self__, "forward")
        else:
            setattr(self.__self__, slot, self._before_patch())

    def __repr__(self) -> str:
        return f"<liger_lab forward of {type(self.__self__).__name__}>"


# Each patched model's _BoundForward (weakly): found here after another library set its own forward around it.
_PATCHED_FORWARDS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[_BoundForward]] = weakref.WeakKeyDictionary()


def set_patched_forward(
    model: nn.Module, model_type: str, *, fused: bool, cross_entropy: bool, chunk_tokens: int | None
) -> None:
    """Give a model its own fused-loss forward (a :class:`_BoundForward` with these options) in its forward slot,
    remembered so that :func:`remove_patched_forward` finds it also inside a forward set around it later."""
    forward = _BoundForward(model, model_type, fused=fused, cross_entropy=cross_entropy, chunk_tokens=chunk_tokens)
    setattr(model, forward_slot(model), forward)
    _PATCHED_FORWARDS[model] = weakref.ref(forward)


def remove_patched_forward(model: nn.Module) -> None:
    """Undo :func:`set_patched_forward`: each forward slot gets back what it held before, and a fused forward that
    another library's forward still calls (set around it after patch) passes every call on from now on."""
    for slot in ("forward", "_old_forward"):
        forward = model.__dict__.get(slot)
        if isinstance(forward, _BoundForward) and forward.__self__ is model:
            forward.put_back(slot)
    reference = _PATCHED_FORWARDS.pop(model, None)
    buried = reference() if reference is not None else None
    if buried is not None:  # inside a forward another library set after patch, which still calls it
        buried.active = False


def patched_forward(model: nn.Module) -> _BoundForward | None:
    """The model's active :class:`_BoundForward`, wherever it is: in a forward slot of the instance (a copy or an
    unpickled model finds its own there), or inside a forward another library set around it after patch."""
    for slot in ("forward", "_old_forward"):
        forward = model.__dict__.get(slot)
        if isinstance(forward, _BoundForward) and forward.__self__ is model and forward.active:
            return forward
    reference = _PATCHED_FORWARDS.get(model)
    forward = reference() if reference is not None else None
    return forward if forward is not None and forward.active else None
