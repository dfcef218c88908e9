"""Run Hugging Face transformers models on liger_lab's kernels, without touching their weights.

A transformers decoder is assembled from a handful of classes in one modeling module per family
(``transformers.models.llama.modeling_llama`` and so on): an RMSNorm class, a gated MLP class, an
attention class that calls the module's free function ``apply_rotary_pos_emb`` by name, and a
``...ForCausalLM`` whose forward computes every logit and then the loss. :func:`patch` swaps in fused
versions of those pieces, in one of two ways:

* ``patch("llama")`` patches the *family*: ``LlamaRMSNorm``, ``LlamaMLP`` and ``LlamaAttention`` in the
  modeling module become fused subclasses, so every model built afterwards is made of them, and
  ``LlamaForCausalLM.forward`` is wrapped (which reaches models already built too);
* ``patch(model)`` patches one *instance* in place (a PEFT wrapper is looked through): each of those
  modules gets the fused subclass as its ``__class__`` and the model gets its own ``forward``. Its
  parameters, buffers and state dict stay exactly as they were, and other models are not affected.

A mixture of experts (Qwen3-MoE, Mixtral) keeps every expert's weights in one ``...Experts`` module of two 3-D
tensors, run by transformers' Python loop over the experts or by one of its kernels (``experts_implementation``,
``"grouped_mm"`` by default where it runs): the loop gets the fused SwiGLU, the kernels and the router stay
transformers', and :func:`report` says which runs.

The fused subclasses override ``forward`` only, so ``isinstance`` checks, weight initialisation, state
dicts and ``save_pretrained`` see the transformers classes they derive from. RoPE is the one piece that
is not a module: the modeling module's ``apply_rotary_pos_emb`` is replaced (while any patched model or
family needs it) by a dispatcher that runs the fused kernel inside the forward of a fused attention and
transformers' own function everywhere else. :func:`unpatch` puts back exactly the objects it replaced:
every swap is kept in a registry with the original it displaced.

The causal-LM forward computes the loss with :func:`liger_lab.fused_linear_cross_entropy` when labels
are given in training: the (tokens x vocabulary) logits are never materialised, so ``logits`` is None in
that output. It shifts the labels like transformers (position t predicts label t+1, ``-100`` ignored),
honours ``num_items_in_batch`` (the Trainer's gradient-accumulation normaliser: sum over tokens divided
by it), ``shift_labels``, ``ignore_index``, ``logits_to_keep`` and ``return_dict``, and applies Gemma 2's
``final_logit_softcapping`` inside the fused loss. Without labels, in eval mode, or with
``skip_logits=False``, the model returns logits as transformers does (with ``cross_entropy=True`` the loss
then comes from :func:`liger_lab.cross_entropy`). With ``return_dict=False`` the tuple has transformers'
layout, the logits' slot included (None when the fused loss ran).

The fused loss reads the ``lm_head``'s weight and bias: an ``nn.Linear``'s, or a PEFT LoRA layer's, whose
active adapter's term joins the same product (a concatenation of the weight with LoRA's B, see
:class:`_LoraTerm`); with its adapters disabled or merged, the base layer's. Any other head (DoRA or another
LoRA variant, several active adapters, a quantized layer) gets its logits materialised, with a warning that
says why, as does :func:`report`.

A patched model pickles (``torch.save(model)``) and loads in any process: the fused classes are found by
name in this module (:func:`__getattr__` rebuilds them), a patched model's own ``forward`` pickles as its
options, and a fused attention that is unpickled or deep-copied holds the rope swap itself, so it keeps
running the fused kernel. A model built while its family was patched keeps its fused modules when loaded,
but its loss is its class's: transformers' own in a process where the family is not patched.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from liger_lab.nn.mlp import GeGLUMLP, SwiGLUMLP
from liger_lab.ops import cross_entropy as ce_ops
from liger_lab.ops import fused_linear_cross_entropy as flce_ops
from liger_lab.ops import rms_norm as rms_norm_ops
from liger_lab.ops import rope as rope_ops
from liger_lab.ops import swiglu as glu_ops

_M = TypeVar("_M")


@dataclass(frozen=True)
class _Family:
    """How one transformers family names and wires the pieces that get fused."""

    prefix: str  # class-name prefix in the modeling module: "Llama" -> LlamaRMSNorm, LlamaMLP, LlamaAttention, ...
    # How its RMSNorm rounds: "llama" rounds xhat to the input dtype, then multiplies by w; "fp32_weight"
    # multiplies by w in fp32 and rounds once (OLMo 2); "gemma" scales by (1 + w) in fp32, eps in "eps".
    norm: str = "llama"
    act_attr: str = "hidden_act"  # config attribute naming the MLP activation
    fused_gate_up: bool = False  # one gate_up_proj whose output is [gate | up] (Phi-3)
    # Norms whose output feeds only linear projections: their backward may overwrite the incoming
    # gradient. Never a norm whose output is added to the residual stream (Gemma 2's post-norms): the
    # residual branch reads that same gradient tensor.
    in_place_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    mlp: bool = True  # a dense gated MLP class (a mixture of experts alone has none: Mixtral)
    # An experts class holding every expert's weights as 3-D tensors (transformers 5's ...Experts: gate_up_proj
    # (E, 2I, H), down_proj (E, H, I)), whose loop over the experts gets the fused SwiGLU; the router stays as it is.
    experts: bool = False
    rope: bool = True  # rotate_half RoPE, the fused kernel's (GLM-4 rotates interleaved pairs instead)
    module: str | None = None  # the modeling module, when its name is not the model type (gemma3_text)
    # A decoder layer written exactly as Llama's (norm, attention, add, norm, MLP, add): the add before the MLP's
    # norm is fused into it (add_rms_norm).
    add_norm: bool = False

    @property
    def pieces(self) -> tuple[str, ...]:
        """Class-name suffixes of the pieces this family has fused versions of."""
        has = {"RMSNorm": True, "MLP": self.mlp, "Attention": self.rope, "DecoderLayer": self.add_norm,
               "Experts": self.experts}  # fmt: skip
        return tuple(suffix for suffix, present in has.items() if present)


FAMILIES: dict[str, _Family] = {
    "llama": _Family("Llama", add_norm=True),
    "mistral": _Family("Mistral", add_norm=True),
    "qwen2": _Family("Qwen2", add_norm=True),
    "qwen3": _Family("Qwen3", add_norm=True),
    "gemma": _Family("Gemma", norm="gemma"),
    "gemma2": _Family(
        "Gemma2", norm="gemma", act_attr="hidden_activation",
        in_place_norms=("input_layernorm", "pre_feedforward_layernorm"),
    ),
    "phi3": _Family("Phi3", fused_gate_up=True),
    "gemma3_text": _Family(
        "Gemma3", norm="gemma", act_attr="hidden_activation", module="gemma3",
        in_place_norms=("input_layernorm", "pre_feedforward_layernorm"),
    ),
    "qwen3_moe": _Family("Qwen3Moe", experts=True),  # dense layers (mlp_only_layers) have a Qwen3MoeMLP
    "mixtral": _Family("Mixtral", mlp=False, experts=True),
    # Norms after attention and after the MLP, each output added to the residual: none may reuse its gradient.
    "olmo2": _Family("Olmo2", norm="fp32_weight", in_place_norms=()),
    "granite": _Family("Granite"),  # its logits are divided by config.logits_scaling, in the loss too
    "smollm3": _Family("SmolLM3", add_norm=True),  # some layers skip RoPE: they never call apply_rotary_pos_emb
    "glm4": _Family("Glm4", fused_gate_up=True, rope=False),
}  # fmt: skip
"""Model types (``config.model_type``) that :func:`patch` supports."""


def _family(model_type: object) -> _Family:
    if model_type not in FAMILIES:
        raise ValueError(f"model type {model_type!r} is not supported: expected one of {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def _modeling(model_type: str) -> types.ModuleType:
    module = FAMILIES[model_type].module or model_type if model_type in FAMILIES else model_type
    return importlib.import_module(f"transformers.models.{module}.modeling_{module}")


# ---------------------------------------------------------------------------------------------------
# The registry: every attribute replaced on a module or class, with the original it displaced.


class _Swap:
    """``owner.name`` replaced for as long as at least one holder (a patched model or a patched family) needs
    it; the original comes back when the last holder lets go."""

    def __init__(self, original: object) -> None:
        self.original = original
        self.holders: weakref.WeakSet = weakref.WeakSet()


_SWAPS: dict[tuple[object, str], _Swap] = {}


def _original(owner: object, name: str) -> Any:
    """``owner.name`` as transformers defined it, whether or not it is swapped now."""
    swap = _SWAPS.get((owner, name))
    return swap.original if swap is not None else vars(owner)[name]


def _hold(owner: object, name: str, replacement: object, holder: object) -> None:
    swap = _SWAPS.get((owner, name))
    if swap is None:
        swap = _SWAPS[(owner, name)] = _Swap(vars(owner)[name])
        setattr(owner, name, replacement)
    if holder not in swap.holders:
        # A patched model that is garbage-collected without unpatch lets go too.
        weakref.finalize(holder, _release, owner, name, None).atexit = False
    swap.holders.add(holder)


def _release(owner: object, name: str, holder: object | None) -> None:
    swap = _SWAPS.get((owner, name))
    if swap is None:
        return
    if holder is not None:
        swap.holders.discard(holder)
    # Iterating a WeakSet skips holders that are being collected right now.
    if not any(True for _ in swap.holders):
        setattr(owner, name, swap.original)
        del _SWAPS[(owner, name)]


class _FamilyPatch:
    """What ``patch(model_type)`` holds, so ``unpatch(model_type)`` lets go of exactly that."""

    def __init__(self) -> None:
        self.held: list[tuple[object, str]] = []


_FAMILY_PATCHES: dict[str, _FamilyPatch] = {}

# Fused subclass of each transformers class, and the way back.
_FUSED: dict[type, type] = {}
_UNFUSED: dict[type, type] = {}


def _fused_subclass(original: type, forward: Callable[..., torch.Tensor], **attributes: object) -> type:
    """A subclass of ``original`` that only overrides ``forward`` (made once per class). Its ``__qualname__`` is
    its name, ``Fused`` + the original's, under which :func:`__getattr__` finds it for pickle."""
    if original not in _FUSED:
        namespace = {"forward": forward, "__module__": __name__, "__doc__": f"{original.__name__} on liger_lab kernels"}
        fused = type(f"Fused{original.__name__}", (original,), {**namespace, **attributes})
        _FUSED[original], _UNFUSED[fused] = fused, original
    return _FUSED[original]


# ---------------------------------------------------------------------------------------------------
# Fused forwards of the modules.


def _llama_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm_ops.rms_norm(
        hidden_states, self.weight, self.variance_epsilon, in_place_backward=self.in_place_backward
    )


def _fp32_weight_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    # (w * xhat).to(dtype) with both in fp32: the kernel's "gemma" casting, without Gemma's offset.
    return rms_norm_ops.rms_norm(
        hidden_states,
        self.weight,
        self.variance_epsilon,
        casting_mode="gemma",
        in_place_backward=self.in_place_backward,
    )


def _gemma_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_norm_ops.rms_norm(
        x, self.weight, self.eps, offset=1.0, casting_mode="gemma", in_place_backward=self.in_place_backward
    )


_NORM_FORWARDS = {
    "llama": _llama_rms_norm_forward,
    "fp32_weight": _fp32_weight_rms_norm_forward,
    "gemma": _gemma_rms_norm_forward,
}


def _norm_class(family: _Family, original: type) -> type:
    forward = _NORM_FORWARDS[family.norm]
    # A class-level default; patch(model) turns it on per module where the gradient may be reused.
    return _fused_subclass(original, forward, in_place_backward=False)


def _gated_kernel(activation: object) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The fused ``act(gate) * up`` for a transformers activation name, None when there is none."""
    if activation in SwiGLUMLP.hf_activations:
        return glu_ops.swiglu
    if activation in GeGLUMLP.hf_activations:
        return glu_ops.geglu
    return None


def _mlp_class(family: _Family, original: type) -> type:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = _gated_kernel(getattr(self.config, family.act_attr, None))
        if kernel is None:  # an activation with no fused kernel: keep transformers' computation
            return original.forward(self, x)
        if family.fused_gate_up:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # gate and up are fresh projection outputs read by nothing else: the backward may overwrite them.
        return self.down_proj(kernel(gate, up, in_place_backward=True))

    return _fused_subclass(original, forward)


def _experts_fallback(family: _Family, experts: nn.Module) -> str | None:
    """Why an experts module runs transformers' forward rather than the fused loop, or None when it runs the loop.

    transformers 5 dispatches an experts module's forward on ``config._experts_implementation``: ``"eager"`` (or
    None, a module built outside a model) is its Python loop over the experts, the one fused here; any other name
    (``"grouped_mm"``, the default wherever it can run, ``"batched_mm"``, ...) is an integration's kernel, which
    is left as it is."""
    config = getattr(experts, "config", None)
    activation = getattr(config, family.act_attr, None)
    if activation not in SwiGLUMLP.hf_activations:
        return f"activation {activation!r} is not SiLU, the one fused for experts"
    implementation = getattr(config, "_experts_implementation", None)
    if implementation not in (None, "eager"):
        return f"experts_implementation={implementation!r}: transformers' kernel runs (the fused loop is 'eager')"
    return None


def _swiglu_experts(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' eager loop over the experts that got tokens (each computes ``down(silu(gate) * up)`` for its
    tokens, scales it by their routing weights and adds it into their rows), with ``silu(gate) * up`` fused.

    Two things differ from transformers' loop, both measured on the H200 (``benchmarks/moe_experts.py``):

    - The 3-D weights are split into per-expert views once, by ``unbind``, rather than indexed per expert. The
      backward of ``weight[e]`` is a zero-filled gradient of the whole 3-D weight, added into the total: for
      Qwen3-MoE's 128 experts that filling and adding was 159 of the loop's 186 ms. ``unbind``'s backward
      stacks the experts' gradients into one buffer once.
    - The matmuls keep transformers' layout, ``x @ W.T`` (tokens x 2I). Computing ``W @ x.T`` instead would
      make gate and up contiguous halves, but an expert's token count is any number, so those rows (and the
      down projection's operand) are not 16-byte aligned and cuBLAS falls back to kernels several times
      slower. The op copies the strided halves instead (in the forward and again in the backward, whose
      gradients chunk's backward then joins): at Qwen3-MoE's shape about 2.4 GB of traffic, some 0.6 ms of the
      block's 34 ms.
    """
    final = torch.zeros_like(hidden_states)
    num_experts = experts.num_experts
    with torch.no_grad():
        # One class more than experts: under expert parallelism a slot routed to another rank holds num_experts.
        mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)[:num_experts]
        hit = mask.sum(dim=(-1, -2)).nonzero().flatten().tolist()
    gate_up_weights = experts.gate_up_proj.unbind(0)
    down_weights = experts.down_proj.unbind(0)
    for expert in hit:
        top_k_pos, token_idx = torch.where(mask[expert])
        gate, up = F.linear(hidden_states[token_idx], gate_up_weights[expert]).chunk(2, dim=-1)
        out = F.linear(glu_ops.swiglu(gate, up), down_weights[expert]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def _experts_class(family: _Family, original: type) -> type:
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # Decided per call: set_experts_implementation can switch a built model between the loop and a kernel.
        if _experts_fallback(family, self) is not None:
            return original.forward(self, hidden_states, top_k_index, top_k_weights)
        return _swiglu_experts(self, hidden_states, top_k_index, top_k_weights)

    return _fused_subclass(original, forward)


def _decoder_layer_class(original: type) -> type:
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        post_norm = self.post_attention_layernorm
        # Not the layout fused here, or a norm whose call something watches (a forward hook that records its
        # output, FSDP2 gathering its weight): the norm must run as a module of its own.
        watched = post_norm._forward_hooks or post_norm._forward_pre_hooks
        if args or watched or type(post_norm).forward is not _llama_rms_norm_forward:
            return original.forward(self, hidden_states, *args, **kwargs)
        attention, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        if attention.dtype != hidden_states.dtype:
            # Under autocast the attention's output is bf16 and the residual stream fp32: transformers' add
            # promotes the sum to fp32, while add_rms_norm takes and returns one dtype.
            hidden_states = hidden_states + attention
            return hidden_states + self.mlp(post_norm(hidden_states))
        # residual + attention and the MLP's norm of it in one pass (each read once, both written once).
        normed, hidden_states = rms_norm_ops.add_rms_norm(
            attention, hidden_states, post_norm.weight, post_norm.variance_epsilon
        )
        return hidden_states + self.mlp(normed)

    return _fused_subclass(original, forward)


def _fused_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` on the fused kernel, partial rotary included (Phi-3 with
    ``partial_rotary_factor < 1``: only the first ``cos.shape[-1]`` features of each head rotate)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        q_rot, k_rot = rope_ops.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    else:
        q_rot, k_rot = rope_ops.apply_rotary_pos_emb(
            q[..., :rotary_dim], k[..., :rotary_dim], cos, sin, unsqueeze_dim=unsqueeze_dim
        )
        q_rot, k_rot = torch.cat([q_rot, q[..., rotary_dim:]], dim=-1), torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)
    # OLMo 2 keeps cos and sin in fp32 and rounds the rotated q and k back to their dtype (the kernel returns the
    # promoted dtype, fp32): without this a bf16 model's attention would get fp32 queries and bf16 values.
    return q_rot.to(q.dtype), k_rot.to(k.dtype)


class _FusedRopeDepth:
    """How many forwards of fused attentions are running: the rope dispatcher's switch. An instance, not a
    class attribute: torch.compile traces a change to an object's attribute but not to a class's."""

    def __init__(self) -> None:
        self.depth = 0


_FusedRope = _FusedRopeDepth()


def _attention_class(modeling: types.ModuleType, original: type) -> type:
    def forward(self, *args, **kwargs):
        _FusedRope.depth += 1
        try:
            return original.forward(self, *args, **kwargs)
        finally:
            _FusedRope.depth -= 1

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled (torch.load, possibly in another process) or deep-copied: nothing else may hold the rope
        # swap for this module, so it holds it itself, until it is collected or its model unpatched.
        original.__setstate__(self, state)
        _hold(modeling, "apply_rotary_pos_emb", _rope_dispatcher(modeling), self)

    return _fused_subclass(original, forward, __setstate__=__setstate__)


_DISPATCHERS: dict[types.ModuleType, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def _rope_dispatcher(modeling: types.ModuleType) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """What replaces ``modeling.apply_rotary_pos_emb``: the fused kernel inside a fused attention's
    forward, transformers' function in every other model of the family."""
    if modeling not in _DISPATCHERS:
        original = _original(modeling, "apply_rotary_pos_emb")

        @functools.wraps(original)
        def apply_rotary_pos_emb(*args, **kwargs):
            return (_fused_rotary_pos_emb if _FusedRope.depth else original)(*args, **kwargs)

        _DISPATCHERS[modeling] = apply_rotary_pos_emb
    return _DISPATCHERS[modeling]


# ---------------------------------------------------------------------------------------------------
# The causal-LM forward.

_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


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

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        skip_logits = kwargs.pop("skip_logits", None)
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("labels") is None:
            if skip_logits:
                raise ValueError("skip_logits=True computes the loss without logits: expected labels")
            return original(self, *args, **kwargs)
        use_fused = fused and (self.training if skip_logits is None else skip_logits)
        if not use_fused and not cross_entropy:
            return original(self, *args, **kwargs)
        router_logits = bound.arguments.get("output_router_logits")
        if router_logits or (router_logits is None and getattr(self.config, "output_router_logits", False)):
            # A mixture of experts adding its router's load-balancing loss: transformers' forward, said aloud.
            _report_fallback(type(self).__name__, "output_router_logits adds the router's load-balancing loss")
            return original(self, *args, **kwargs)
        arguments = dict(bound.arguments)
        del arguments[next(iter(signature.parameters))]  # self
        extra = arguments.pop(var_keyword, {}) if var_keyword else {}
        return _loss_forward(self, arguments, extra, fused=use_fused, chunk_tokens=chunk_tokens)

    forward.liger_lab_patched = True
    forward.liger_lab_fused = fused
    return forward


_LOSS_FORWARDS: dict[tuple[str, bool, bool, int | None], Callable[..., Any]] = {}


def _loss_forward_of(model_type: str, fused: bool, cross_entropy: bool, chunk_tokens: int | None) -> Callable[..., Any]:
    """The family's ``...ForCausalLM.forward`` wrapped by :func:`_causal_lm_forward` (one per choice). A
    plain dict, not ``functools.cache``: torch.compile traces a dict lookup, but warns on a cache wrapper."""
    key = (model_type, fused, cross_entropy, chunk_tokens)
    if key not in _LOSS_FORWARDS:
        family, modeling = _family(model_type), _modeling(model_type)
        original = _original(_causal_lm(family, modeling), "forward")
        _LOSS_FORWARDS[key] = _causal_lm_forward(
            original, fused=fused, cross_entropy=cross_entropy, chunk_tokens=chunk_tokens
        )
    return _LOSS_FORWARDS[key]


def _causal_lm(family: _Family, modeling: types.ModuleType) -> type:
    return getattr(modeling, f"{family.prefix}ForCausalLM")


class _BoundForward:
    """A patched model's own ``forward``: its family's fused-loss forward bound to it, like a method (it has
    ``__self__``, ``__func__`` and the wrapped forward's signature, which the Trainer reads to pick the
    dataset columns). Unlike a bound method of a function made at patch time, it pickles and deep-copies:
    as the model and the options that choose the function."""

    def __init__(
        self, model: nn.Module, model_type: str, *, fused: bool, cross_entropy: bool, chunk_tokens: int | None
    ) -> None:
        self.__self__ = model
        self.model_type = model_type
        self.fused = fused
        self.cross_entropy = cross_entropy
        self.chunk_tokens = chunk_tokens
        self._make_function()

    def __setstate__(self, state: dict[str, Any]) -> None:  # unpickled or deep-copied
        self.__dict__.update(state)
        self._make_function()

    def _make_function(self) -> None:
        # Made here, outside any call: torch.compile then traces only the lookup of a function that exists
        # (tracing its first construction, which reads the swap registry, has failed inside Dynamo).
        _loss_forward_of(self.model_type, self.fused, self.cross_entropy, self.chunk_tokens)

    @property
    def __func__(self) -> Callable[..., Any]:
        return _loss_forward_of(self.model_type, self.fused, self.cross_entropy, self.chunk_tokens)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<liger_lab forward of {type(self.__self__).__name__}>"


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


def _fused_head(head: nn.Module) -> _Head | str:
    """What the fused loss computes this ``lm_head``'s logits from, or why it cannot (then the logits are
    materialised): an ``nn.Linear``, or a PEFT LoRA layer on one."""
    if _is_lora_layer(head):
        return _lora_head(head)
    fallback = _linear_fallback(head, "lm_head")
    return _Head(head) if fallback is None else fallback


_REPORTED_FALLBACKS: set[tuple[str, str]] = set()


def _report_fallback(model_class: str, reason: str) -> None:
    """Warn, once per model class and reason, that the fused loss does not run: never a silent fallback."""
    if (model_class, reason) not in _REPORTED_FALLBACKS:
        _REPORTED_FALLBACKS.add((model_class, reason))
        message = f"liger_lab: {model_class}'s loss materialises the logits, the fused loss cannot run: {reason}"
        warnings.warn(message, stacklevel=4)


def _is_fsdp_unit(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(module, FSDPModule)


def _as_forward_of(module: nn.Module, compute: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
    """``compute(x)`` run as ``module``'s forward when ``module`` is an FSDP2 unit, else directly.

    A sharded ``lm_head`` (FSDP2's ``fully_shard(model.lm_head)``) holds a shard of its weight outside its
    call: the hooks FSDP2 registers gather the full weight before the forward and reshard it after, and
    again around the backward, where they also reduce-scatter its gradient. The fused loss reads the weight
    without calling the module, so it borrows the call: the module's ``forward`` is ``compute`` for the
    duration, and the hooks run around it as around the matmul they expected (casting ``x`` too, under a
    mixed-precision policy). Any other module is not touched: a hook of its own (one that logs the logits, say)
    expects logits, not a loss, so it does not run, as when the fused loss reads the weight directly."""
    if not _is_fsdp_unit(module):
        return compute(x)
    module.forward = compute
    try:
        return module(x)
    finally:
        del module.forward


def _loss_forward(
    self: nn.Module, arguments: dict[str, Any], extra: dict[str, Any], *, fused: bool, chunk_tokens: int | None
):
    """transformers' causal-LM forward with the loss computed by liger_lab's kernels."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    labels = arguments.pop("labels")
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    return_dict = extra.pop("return_dict", None)
    loss_kwargs = {name: extra.pop(name) for name in _LOSS_KWARGS if name in extra}
    outputs = getattr(self, self.base_model_prefix)(**arguments, **extra)

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
    softcap = getattr(self.config, "final_logit_softcapping", None)
    logits_scaling = getattr(self.config, "logits_scaling", None)  # Granite: logits = lm_head(h) / scaling
    if logits_scaling is not None and logits_scaling != 1:
        kept, hidden = kept / logits_scaling, hidden / logits_scaling  # the same logits, by linearity

    head, logits = self.lm_head, None
    parts = _fused_head(head) if fused else None
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
                target,
                bias,
                ignore_index=ignore_index,
                reduction=reduction,
                softcap=softcap,
                chunk_tokens=chunk,
                loss_dtype=torch.float32,
                # The final norm's output is read by this loss alone, unless the caller asked for the hidden
                # states (they include it): then it must stay intact. A LoRA head's concatenation is the loss's
                # own (the adapter reads the norm's output, which stays intact).
                in_place_backward=lora is not None
                or (not isinstance(outputs, tuple) and getattr(outputs, "hidden_states", None) is None),
            )

        loss = _as_forward_of(head, fused_loss, hidden)
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

    # The fields of CausalLMOutputWithPast besides loss and logits, named (torch.compile cannot trace
    # dataclasses.fields of it without a graph break).
    carried = {name: getattr(outputs, name, None) for name in ("past_key_values", "hidden_states", "attentions")}
    output = CausalLMOutputWithPast(**carried, loss=loss, logits=logits)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if return_dict:
        return output
    # to_tuple() drops the None entries, and transformers' model always has logits here: keep their slot, so
    # the tuple reads (loss, logits or None, cache, ...) like the unpatched model's.
    return (loss, logits, *(value for name, value in output.items() if name not in ("loss", "logits")))


# ---------------------------------------------------------------------------------------------------
# Public API.


@dataclass(frozen=True)
class _Options:
    rms_norm: bool
    rope: bool
    swiglu: bool
    cross_entropy: bool
    fused_linear_cross_entropy: bool
    loss_chunk_tokens: int | None

    @property
    def loss(self) -> bool:
        return self.cross_entropy or self.fused_linear_cross_entropy


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

    ``model_or_model_type`` is a model type string (``"llama"``, one of :data:`FAMILIES`), which patches
    the family's classes, or a model instance (a PEFT wrapper is looked through), patched in place with
    its parameters and state dict unchanged. ``swiglu`` covers the gated MLP of every family (GeGLU for
    Gemma) and the SiLU experts of a mixture of experts run by transformers' eager loop.
    ``fused_linear_cross_entropy`` computes the training loss without logits;
    ``cross_entropy`` computes the loss from logits with the fused cross-entropy kernel whenever logits
    are returned with labels. ``loss_chunk_tokens`` sets the fused loss's chunk in tokens; by default it is
    bounded by two hidden states' bytes of logits, because in a training step the chunk adds to every activation
    alive (:func:`liger_lab.ops.fused_linear_cross_entropy.chunk_tokens_in_model`): a larger chunk trades
    memory for the loss's speed. Patching again replaces the previous patch. Returns its argument.
    """
    flce_ops.check_chunk_options("loss_chunk_tokens", loss_chunk_tokens, accumulation=None)
    options = _Options(rms_norm, rope, swiglu, cross_entropy, fused_linear_cross_entropy, loss_chunk_tokens)
    if isinstance(model_or_model_type, str):
        _unpatch_family(model_or_model_type)
        _patch_family(model_or_model_type, options)
    else:
        model = _unwrap(model_or_model_type)
        _unpatch_model(model)
        _patch_model(model, options)
    return model_or_model_type


def unpatch(model_or_model_type: _M) -> _M:
    """Undo :func:`patch`: the transformers classes, functions and forwards come back exactly. Returns its
    argument. A model built while its family was patched gets its modules' transformers classes back too."""
    if isinstance(model_or_model_type, str):
        _unpatch_family(model_or_model_type)
    else:
        _unpatch_model(_unwrap(model_or_model_type))
    return model_or_model_type


@dataclass(frozen=True)
class PatchReport:
    """What :func:`patch` did to one model: the modules now fused, counted per kind, and what it left alone
    and why. ``str()`` prints it as a table."""

    model_type: str
    replaced: dict[str, int]
    left_alone: dict[str, str]

    def __str__(self) -> str:
        lines = [f"liger_lab patch of a {self.model_type} model"]
        lines += [f"  fused      {kind:<34}{count:>3}" for kind, count in self.replaced.items()]
        lines += [f"  left alone {kind:<34}{why}" for kind, why in self.left_alone.items()]
        return "\n".join(lines)


def report(model: nn.Module) -> PatchReport:
    """The :class:`PatchReport` of a model (a PEFT wrapper is looked through), patched or not."""
    model = _unwrap(model)
    model_type = getattr(model.config, "model_type", None)
    family = _family(model_type)
    replaced: dict[str, int] = {}
    experts: list[nn.Module] = []
    for module in model.modules():
        name = type(module).__name__
        if name.removeprefix("Fused") == f"{family.prefix}Experts":
            experts.append(module)  # counted below, where the fused loop is what its forward runs
        elif name.startswith(f"Fused{family.prefix}"):
            kind = name.removeprefix(f"Fused{family.prefix}")
            kind = {"RMSNorm": "RMSNorm", "MLP": "gated MLP (SwiGLU/GeGLU)", "Attention": "attention (RoPE)",
                    "DecoderLayer": "residual add into RMSNorm"}[kind]  # fmt: skip
            replaced[kind] = replaced.get(kind, 0) + 1
    left_alone: dict[str, str] = {}
    fused_experts = [m for m in experts if type(m) in _UNFUSED and _experts_fallback(family, m) is None]
    if fused_experts:
        replaced["MoE experts (SwiGLU)"] = len(fused_experts)
    elif experts:
        left_alone["experts"] = _experts_fallback(family, experts[0]) or "not patched (swiglu=False?)"
    if experts:
        left_alone["router"] = "transformers' own: top-k routing and its load-balancing loss are not fused"
    mlp_names = (f"{family.prefix}MLP", f"Fused{family.prefix}MLP")
    if not any(type(module).__name__ in mlp_names for module in model.modules()):
        left_alone["MLP"] = "no dense MLP: every layer is a mixture of experts"
    elif not replaced.get("gated MLP (SwiGLU/GeGLU)"):
        activation = getattr(model.config, family.act_attr, None)
        no_kernel = f"activation {activation!r} has no fused kernel"
        left_alone["MLP"] = no_kernel if _gated_kernel(activation) is None else "not patched (swiglu=False?)"
    if not family.rope:
        left_alone["RoPE"] = "interleaved pairs, which the fused kernel does not rotate"
    forward = model.__dict__.get("forward")
    loss_forward = forward.__func__ if isinstance(forward, _BoundForward) else type(model).forward
    fused = getattr(loss_forward, "liger_lab_fused", None)  # None: transformers' own forward
    head = _fused_head(model.lm_head) if isinstance(getattr(model, "lm_head", None), nn.Module) else (
        "the model has no lm_head module")  # fmt: skip
    fallback = head if isinstance(head, str) else None
    if fused and fallback is None:
        replaced["loss (fused linear cross-entropy)"] = 1
    elif fused:
        left_alone["loss"] = f"logits materialised: {fallback}"
    else:
        left_alone["loss"] = "transformers' own" if fused is None else "from logits (fused_linear_cross_entropy=False)"
    return PatchReport(model_type, replaced, left_alone)


def _unwrap(model: object) -> nn.Module:
    """The transformers model inside ``model`` (itself, or the model a PEFT wrapper holds)."""
    from transformers import PreTrainedModel

    seen = model
    for _ in range(4):  # PeftModel -> LoraModel -> the transformers model
        if isinstance(model, PreTrainedModel):
            return model
        get_base_model = getattr(model, "get_base_model", None)
        if callable(get_base_model):
            inner = get_base_model()
        else:
            inner = getattr(getattr(model, "base_model", None), "model", None)
        if inner is None or inner is model:
            break
        model = inner
    raise ValueError(
        f"cannot patch a {type(seen).__name__}: expected a model type string or a transformers PreTrainedModel "
        "(possibly wrapped by PEFT)"
    )


# Class-name suffix of each fused piece in a modeling module -> the option of patch() that fuses it.
_PIECES = {"RMSNorm": "rms_norm", "MLP": "swiglu", "Attention": "rope", "DecoderLayer": "rms_norm", "Experts": "swiglu"}


def _fused_piece(family: _Family, modeling: types.ModuleType, suffix: str) -> tuple[type, type]:
    """(transformers class, its fused subclass) for one piece of a family."""
    original = _original(modeling, family.prefix + suffix)
    if suffix == "RMSNorm":
        return original, _norm_class(family, original)
    if suffix == "MLP":
        return original, _mlp_class(family, original)
    if suffix == "DecoderLayer":
        return original, _decoder_layer_class(original)
    if suffix == "Experts":
        return original, _experts_class(family, original)
    return original, _attention_class(modeling, original)


def _fused_classes(family: _Family, modeling: types.ModuleType, options: _Options) -> dict[str, tuple[type, type]]:
    """Name in the modeling module -> (transformers class, its fused subclass), for the pieces asked for."""
    return {
        family.prefix + suffix: _fused_piece(family, modeling, suffix)
        for suffix, option in _PIECES.items()
        if getattr(options, option) and suffix in family.pieces
    }


def _patch_family(model_type: str, options: _Options) -> None:
    family, modeling = _family(model_type), _modeling(model_type)
    record = _FAMILY_PATCHES[model_type] = _FamilyPatch()
    replacements = [(modeling, name, fused) for name, (_, fused) in _fused_classes(family, modeling, options).items()]
    if options.rope and family.rope:
        replacements.append((modeling, "apply_rotary_pos_emb", _rope_dispatcher(modeling)))
    if options.loss:
        forward = _loss_forward_of(
            model_type, options.fused_linear_cross_entropy, options.cross_entropy, options.loss_chunk_tokens
        )
        replacements.append((_causal_lm(family, modeling), "forward", forward))
    for owner, name, replacement in replacements:
        _hold(owner, name, replacement, record)
        record.held.append((owner, name))


def _unpatch_family(model_type: str) -> None:
    _family(model_type)
    record = _FAMILY_PATCHES.pop(model_type, None)
    for owner, name in record.held if record is not None else ():
        _release(owner, name, record)


def _patch_model(model: nn.Module, options: _Options) -> None:
    model_type = getattr(model.config, "model_type", None)
    family, modeling = _family(model_type), _modeling(model_type)
    classes = _fused_classes(family, modeling, options)
    activation = getattr(model.config, family.act_attr, None)
    # The dense MLP has SwiGLU and GeGLU kernels; the experts, the SwiGLU one.
    no_kernel = {"MLP": _gated_kernel(activation) is None, "Experts": activation not in SwiGLUMLP.hf_activations}
    for piece, missing in no_kernel.items():
        name = f"{family.prefix}{piece}"
        if missing and name in classes:
            message = f"no fused kernel for the {piece} activation {activation!r}: {name} stays as it is"
            warnings.warn(message, stacklevel=3)
            del classes[name]
    fused_of = dict(classes.values())
    for name, module in model.named_modules():
        fused = fused_of.get(type(module))
        if fused is None:
            continue
        module.__class__ = fused
        if fused.__name__.endswith("RMSNorm") and name.rpartition(".")[2] in family.in_place_norms:
            module.in_place_backward = True
    if options.rope and family.rope:
        _hold(modeling, "apply_rotary_pos_emb", _rope_dispatcher(modeling), model)
    causal_lm = _causal_lm(family, modeling)
    # A subclass with its own forward, or a family patched at class level, keeps the forward it has.
    if options.loss and isinstance(model, causal_lm) and type(model).forward is _original(causal_lm, "forward"):
        model.forward = _BoundForward(
            model, model_type, fused=options.fused_linear_cross_entropy, cross_entropy=options.cross_entropy,
            chunk_tokens=options.loss_chunk_tokens,
        )  # fmt: skip


def _unpatch_model(model: nn.Module) -> None:
    model_type = getattr(model.config, "model_type", None)
    _family(model_type)
    modeling = _modeling(model_type)
    for module in model.modules():
        original = _UNFUSED.get(type(module))
        if original is not None:
            module.__class__ = original
            module.__dict__.pop("in_place_backward", None)
            _release(modeling, "apply_rotary_pos_emb", module)  # held by an unpickled fused attention
    if isinstance(model.__dict__.get("forward"), _BoundForward):
        del model.forward
    _release(modeling, "apply_rotary_pos_emb", model)


def __getattr__(name: str) -> type:
    """The fused classes by name (``FusedLlamaRMSNorm``, ...), made on demand: pickle looks up the class of a
    patched module here, also in a process that has patched nothing yet."""
    for model_type, family in FAMILIES.items():
        for suffix in family.pieces:
            if name == f"Fused{family.prefix}{suffix}":
                try:
                    modeling = _modeling(model_type)
                except ImportError as error:  # a transformers without this family
                    raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {error}") from error
                return _fused_piece(family, modeling, suffix)[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
