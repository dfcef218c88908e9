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

A mixture of experts (Qwen3-MoE, Mixtral, Qwen3.5-MoE, Gemma 4, DeepSeek-V3, GLM-4.5) keeps every expert's weights
in one ``...Experts`` module of two 3-D tensors, run by transformers' Python loop over the experts or by one of its
kernels (``experts_implementation``, ``"grouped_mm"`` by default where it runs): the loop gets the fused SwiGLU (GeGLU
for Gemma 4), the kernels and the router stay transformers', and :func:`report` says which runs. What a family
computes differently from the fused pieces (GPT-OSS's clamped experts, interleaved or one-tensor RoPE) stays
transformers', and :data:`FAMILIES` records why for :func:`report` to say.

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

A patched model composes with what other code puts on it, whichever comes first, and :func:`unpatch` gives back
what the model held before :func:`patch`: accelerate's hooks (``dispatch_model``, ``cpu_offload``, a
``device_map``) stay around the fused modules and the loss, which runs inside the ``lm_head``'s hook; a forward
that another library set on the instance (TRL's ``add_fused_lm_head``) keeps every call the fused loss does not
take; a module that a hook watches keeps its outputs (no in-place backward writes over them); the wrapper of
``torch.compile(model)`` is looked through. The fused-RoPE switch is per thread.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from liger_lab.nn.mlp import GeGLUMLP, SwiGLUMLP, outputs_observed
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
    # (E, 2I, H), down_proj (E, H, I)), whose loop over the experts gets the fused SwiGLU (GeGLU for a tanh-GELU
    # activation); the router stays as it is.
    experts: bool = False
    rope: bool = True  # apply_rotary_pos_emb(q, k, cos, sin) in rotate_half's convention, the fused kernel's
    # GPT-OSS's cos and sin hold each of the D/2 angles once, where rotate_half's hold them twice (D columns): the
    # same rotation, which the kernel runs on the tables repeated.
    rope_half_tables: bool = False
    module: str | None = None  # the modeling module, when its name is not the model type (gemma3_text)
    # A decoder layer written exactly as Llama's (norm, attention, add, norm, MLP, add): the add before the MLP's
    # norm is fused into it (add_rms_norm).
    add_norm: bool = False
    # Class names that are not prefix + suffix, as (suffix, name) pairs: Gemma 4's text classes are Gemma4Text...,
    # but its norm and causal LM are the multimodal model's Gemma4RMSNorm and Gemma4ForCausalLM.
    names: tuple[tuple[str, str], ...] = ()
    # What of this family stays transformers' and why, as (piece, reason) pairs that report() states; what report()
    # finds on a model by itself (an activation without a kernel, transformers' experts kernel) is not listed here.
    left_alone: tuple[tuple[str, str], ...] = ()

    @property
    def pieces(self) -> tuple[str, ...]:
        """Class-name suffixes of the pieces this family has fused versions of."""
        has = {"RMSNorm": True, "MLP": self.mlp, "Attention": self.rope, "DecoderLayer": self.add_norm,
               "Experts": self.experts}  # fmt: skip
        return tuple(suffix for suffix, present in has.items() if present)

    def name(self, suffix: str) -> str:
        """The class name of a piece (a suffix of :attr:`pieces`, ``"Experts"`` or ``"ForCausalLM"``)."""
        return dict(self.names).get(suffix, self.prefix + suffix)


# Qwen3.5's linear-attention (Gated DeltaNet) layers end in a norm of another formula.
_GATED_NORM = ("gated RMSNorm", "RMSNormGated, norm(x) * w * silu(z) in the linear-attention layers: no fused kernel")

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
    "glm4": _Family(
        "Glm4", fused_gate_up=True, rope=False,
        left_alone=(("RoPE", "interleaved pairs, which the fused kernel does not rotate"),),
    ),
    # Qwen3.5 (the text model): (1 + w) norms, q_norm and k_norm too; partial RoPE on the full-attention layers (its
    # multimodal position tables are plain cos and sin by then). The decoder's add is not fused: add_norm is written
    # for Llama's norm.
    "qwen3_5_text": _Family("Qwen3_5", norm="gemma", module="qwen3_5", left_alone=(_GATED_NORM,)),
    # Qwen3.5's layers with a mixture of experts: its shared expert is a Qwen3_5MoeMLP (its sigmoid gate stays).
    "qwen3_5_moe_text": _Family(
        "Qwen3_5Moe", norm="gemma", module="qwen3_5_moe", experts=True, left_alone=(_GATED_NORM,)
    ),
    # Gemma 4 (text): w, not 1 + w, multiplied in fp32 and rounded once (OLMo 2's rounding); GeGLU in the MLP and in
    # the experts (26B-A4B's layers run both and add them). Sandwich norms, per-layer inputs, layer scalars: no fused
    # add.
    "gemma4_text": _Family(
        "Gemma4Text", norm="fp32_weight", act_attr="hidden_activation", module="gemma4", experts=True, rope=False,
        in_place_norms=("input_layernorm", "pre_feedforward_layernorm"),
        names=(("RMSNorm", "Gemma4RMSNorm"), ("ForCausalLM", "Gemma4ForCausalLM")),
        left_alone=(
            ("RoPE", "apply_rotary_pos_emb(x, cos, sin) rotates q and k one at a time, each after its norm; the fused "
                     "kernel takes both"),
            ("RMSNorm without weight", "v_norm and the router's norm (with_scale=False): no weight for the kernel"),
        ),
    ),
    # GPT-OSS: its norm rounds as OLMo 2's; RoPE is rotate_half's on half tables. The attention sinks join
    # transformers' attention, which no family fuses. Every layer is a mixture of experts (GptOssMLP is that block).
    "gpt_oss": _Family(
        "GptOss", norm="fp32_weight", mlp=False, rope_half_tables=True,
        left_alone=(
            ("experts", "clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, "
                        "limit), on interleaved gate and up columns with biases: not the fused silu(gate) * up"),
        ),
    ),
    # Llama 4 (text): Llama's norm (its eps named eps), SwiGLU MLPs (the dense layers and each MoE layer's shared
    # expert). The decoder layer calls its MLP feed_forward and unpacks the MoE's tuple: no fused add.
    "llama4_text": _Family(
        "Llama4Text", module="llama4", rope=False, names=(("ForCausalLM", "Llama4ForCausalLM"),),
        left_alone=(
            ("RoPE", "complex multiplication of interleaved pairs (apply_rotary_emb), not rotate_half"),
            ("experts", "every expert runs on every token, its input scaled by the router (batched matmuls): not the "
                        "top-k experts interface of the fused loop"),
            ("qk_norm", "Llama4TextL2Norm has no weight for the kernel to scale by"),
        ),
    ),
    # OLMo 3: OLMo 2's layer, with sliding-window layers.
    "olmo3": _Family("Olmo3", norm="fp32_weight", in_place_norms=()),
    # Ministral 3: Mistral's layer; its queries are scaled by Llama 4's position-dependent factor after RoPE.
    "ministral3": _Family("Ministral3", add_norm=True),
    # DeepSeek-V3: MLA attention, whose low-rank q and kv norms (q_a_layernorm, kv_a_layernorm) are fused too; dense
    # first layers and each MoE layer's shared experts are a DeepseekV3MLP; the routed experts are 3-D.
    "deepseek_v3": _Family(
        "DeepseekV3", experts=True, rope=False, add_norm=True,
        left_alone=(
            ("RoPE", "MLA's decoupled RoPE, on a qk_rope_head_dim slice of q and one key head shared by all heads, "
                     "rotates interleaved pairs (apply_rotary_pos_emb_interleave: rope_interleave=True, the "
                     "checkpoints' layout), which the fused kernel does not"),
        ),
    ),
    # GLM-4.5 (MoE): unlike GLM-4, rotate_half RoPE on part of each head; Llama's layer, optional q and k norms.
    "glm4_moe": _Family("Glm4Moe", experts=True, add_norm=True),
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
        weakref.finalize(holder, _release_collected, owner, name).atexit = False
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


_RELEASE_AFTER_COMPILE: list[tuple[object, str]] = []


def _release_collected(owner: object, name: str) -> None:
    """What the collection of a holder does: :func:`_release`, except in the middle of a ``torch.compile``, where
    it waits for the compile to end. The collector runs whenever Python allocates, so also while Dynamo traces a
    frame of the same family (after ``torch._dynamo.reset()`` drops the compiled code that kept a patched model
    alive, say). Putting transformers' ``apply_rotary_pos_emb`` back then changes the function the frame calls
    between two passes over it: Dynamo's restarted trace diverges from the first (``SpeculationLogDivergence``), or
    its guards are built on the dispatcher it traced but read the function now there (an internal error on
    ``apply_rotary_pos_emb.__closure__``). Both fail the compile. Once it ends, the swap goes as usual: the
    compiled frame's guards then fail on the next call and it recompiles against the original."""
    if not torch.compiler.is_compiling():  # True for the whole compile, also in code that Dynamo does not trace
        _release(owner, name, None)
        return
    _RELEASE_AFTER_COMPILE.append((owner, name))
    callbacks = torch._dynamo.callback_handler  # cleared by torch._dynamo.reset(): registered again when needed
    if _release_deferred not in callbacks.end_callbacks:
        callbacks.register_end_callback(_release_deferred)


def _release_deferred(_: object) -> None:
    """Dynamo's end-of-compile callback: the releases that :func:`_release_collected` held back. (A compile that
    runs no such callbacks, ``torch.export``'s, leaves them to the next one: the dispatcher meanwhile runs
    transformers' function for every model but a patched one, as it does while installed.)"""
    while _RELEASE_AFTER_COMPILE:
        _release(*_RELEASE_AFTER_COMPILE.pop(), None)


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


def _eps(norm: nn.Module) -> float:
    """A norm's epsilon: ``variance_epsilon`` in Llama's norm and most others, ``eps`` in Llama 4's and Gemma 4's."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def _llama_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm_ops.rms_norm(hidden_states, self.weight, _eps(self), in_place_backward=self.in_place_backward)


def _fp32_weight_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if getattr(self, "weight", None) is None:  # Gemma 4's with_scale=False: nothing for the kernel to scale by
        return _UNFUSED[type(self)].forward(self, hidden_states)
    # (w * xhat).to(dtype) with both in fp32: the kernel's "gemma" casting, without Gemma's offset.
    return rms_norm_ops.rms_norm(
        hidden_states, self.weight, _eps(self), casting_mode="gemma", in_place_backward=self.in_place_backward
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
        projections = (self.gate_up_proj,) if family.fused_gate_up else (self.gate_proj, self.up_proj)
        # Fresh projection outputs, read by nothing else unless a hook saw them: the backward may overwrite them.
        in_place = not outputs_observed(*projections)
        if family.fused_gate_up:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(kernel(gate, up, in_place_backward=in_place))

    return _fused_subclass(original, forward)


def _experts_fallback(family: _Family, experts: nn.Module) -> str | None:
    """Why an experts module runs transformers' forward rather than the fused loop, or None when it runs the loop.

    transformers 5 dispatches an experts module's forward on ``config._experts_implementation``: ``"eager"`` (or
    None, a module built outside a model) is its Python loop over the experts, the one fused here; any other name
    (``"grouped_mm"``, the default wherever it can run, ``"batched_mm"``, ...) is an integration's kernel, which
    is left as it is."""
    config = getattr(experts, "config", None)
    activation = getattr(config, family.act_attr, None)
    if _gated_kernel(activation) is None:
        return f"activation {activation!r} is not SiLU or tanh GELU, the ones fused for experts"
    implementation = getattr(config, "_experts_implementation", None)
    if implementation not in (None, "eager"):
        return f"experts_implementation={implementation!r}: transformers' kernel runs (the fused loop is 'eager')"
    return None


def _gated_experts(
    experts: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    glu: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """transformers' eager loop over the experts that got tokens (each computes ``down(act(gate) * up)`` for its
    tokens, scales it by their routing weights and adds it into their rows), with ``act(gate) * up`` fused by ``glu``
    (SwiGLU, or GeGLU for Gemma 4's tanh-GELU experts).

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
        out = F.linear(glu(gate, up), down_weights[expert]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def _experts_class(family: _Family, original: type) -> type:
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # Decided per call: set_experts_implementation can switch a built model between the loop and a kernel.
        if _experts_fallback(family, self) is not None:
            return original.forward(self, hidden_states, top_k_index, top_k_weights)
        glu = _gated_kernel(getattr(self.config, family.act_attr))
        return _gated_experts(self, hidden_states, top_k_index, top_k_weights, glu)

    return _fused_subclass(original, forward)


def _decoder_layer_class(original: type) -> type:
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        post_norm = self.post_attention_layernorm
        # Not the layout fused here, or a norm whose call something watches (a forward hook that records its
        # output, FSDP2 gathering its weight, accelerate loading an offloaded weight): the norm must run as a
        # module of its own.
        if args or outputs_observed(post_norm) or type(post_norm).forward is not _llama_rms_norm_forward:
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


def _fused_half_table_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's ``apply_rotary_pos_emb`` on the fused kernel. Its cos and sin hold each of a head's D/2 angles once,
    and it maps the halves (x1, x2) to (x1 cos - x2 sin, x2 cos + x1 sin): rotate_half's rotation, whose tables
    hold every angle twice. The repeated tables are (positions x D) elements, against q's and k's heads x that."""
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return _fused_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


class _FusedRopeDepth(threading.local):
    """How many forwards of fused attentions are running in this thread: the rope dispatcher's switch. Per thread,
    because the swapped function is shared: a model of the family that another thread runs at the same time (an
    unpatched reference, an evaluation thread) is not inside this thread's fused attention. An instance, not a
    class attribute: torch.compile traces a change to an object's attribute (guarding on it, per thread) but not
    to a class's."""

    def __init__(self) -> None:
        self.depth = 0


_FusedRope = _FusedRopeDepth()


def _attention_class(family: _Family, modeling: types.ModuleType, original: type) -> type:
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
        _hold(modeling, "apply_rotary_pos_emb", _rope_dispatcher(family, modeling), self)

    return _fused_subclass(original, forward, __setstate__=__setstate__)


_DISPATCHERS: dict[types.ModuleType, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def _rope_dispatcher(family: _Family, modeling: types.ModuleType) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """What replaces ``modeling.apply_rotary_pos_emb``: the fused kernel inside a fused attention's
    forward, transformers' function in every other model of the family."""
    if modeling not in _DISPATCHERS:
        original = _original(modeling, "apply_rotary_pos_emb")
        fused = _fused_half_table_rotary_pos_emb if family.rope_half_tables else _fused_rotary_pos_emb

        @functools.wraps(original)
        def apply_rotary_pos_emb(*args, **kwargs):
            return (fused if _FusedRope.depth else original)(*args, **kwargs)

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

    def run(self, fallback: Callable[..., Any] | None, args: tuple, kwargs: dict[str, Any]):
        """This forward on one call, where every call the loss does not take goes to ``fallback`` (a forward that
        another library set on the instance before patch) or, when it is None, to transformers' ``original``."""
        skip_logits = kwargs.pop("skip_logits", None)
        bound = signature.bind(self, *args, **kwargs)
        has_labels = bound.arguments.get("labels") is not None
        if skip_logits and not has_labels:
            raise ValueError("skip_logits=True computes the loss without logits: expected labels")
        use_fused = fused and (self.training if skip_logits is None else skip_logits)
        takes = has_labels and (use_fused or cross_entropy)
        router_logits = bound.arguments.get("output_router_logits")
        if takes and (router_logits or (router_logits is None and getattr(self.config, "output_router_logits", False))):
            # A mixture of experts adding its router's load-balancing loss: transformers' forward, said aloud.
            _report_fallback(type(self).__name__, "output_router_logits adds the router's load-balancing loss")
            takes = False
        if not takes:
            return original(self, *args, **kwargs) if fallback is None else fallback(*args, **kwargs)
        arguments = dict(bound.arguments)
        del arguments[next(iter(signature.parameters))]  # self
        extra = arguments.pop(var_keyword, {}) if var_keyword else {}
        return _loss_forward(self, arguments, extra, fused=use_fused, chunk_tokens=chunk_tokens)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        return run(self, None, args, kwargs)

    forward.liger_lab_run = run
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
    return getattr(modeling, family.name("ForCausalLM"))


def _has_accelerate_hook(module: nn.Module) -> bool:
    """Whether accelerate's hooks wrap ``module`` (``add_hook_to_module``, which ``dispatch_model`` and
    ``cpu_offload`` use): the instance's ``forward`` is then accelerate's, which calls the forward it wrapped, kept
    in ``_old_forward``, between the hook's ``pre_forward`` (inputs to the execution device, offloaded weights
    loaded) and ``post_forward``."""
    return "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__


def _forward_slot(module: nn.Module) -> str:
    """The instance attribute holding the forward that a call of ``module`` ends in: ``_old_forward`` under
    accelerate's hooks, so that they keep running around whatever is put there; ``forward`` otherwise."""
    return "_old_forward" if _has_accelerate_hook(module) else "forward"


def _is_class_forward(module: nn.Module, forward: object) -> bool:
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

    It stands in the model's forward slot (:func:`_forward_slot`) in place of ``displaced``, what the instance held
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
        self.displaced = model.__dict__.get(_forward_slot(model))
        if self.displaced is not None and not _is_class_forward(model, self.displaced):
            self.kept = self.displaced
            self.kept_keywords = _own_keywords(self.kept, self.__func__)
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


def _patched_forward(model: nn.Module) -> _BoundForward | None:
    """The model's active :class:`_BoundForward`, wherever it is: in a forward slot of the instance (a copy or an
    unpickled model finds its own there), or inside a forward another library set around it after patch."""
    for slot in ("forward", "_old_forward"):
        forward = model.__dict__.get(slot)
        if isinstance(forward, _BoundForward) and forward.__self__ is model and forward.active:
            return forward
    reference = _PATCHED_FORWARDS.get(model)
    forward = reference() if reference is not None else None
    return forward if forward is not None and forward.active else None


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
    """``compute(x)`` run as ``module``'s forward when ``module`` is an FSDP2 unit or wrapped by accelerate's
    hooks, else directly.

    A sharded ``lm_head`` (FSDP2's ``fully_shard(model.lm_head)``) holds a shard of its weight outside its
    call: the hooks FSDP2 registers gather the full weight before the forward and reshard it after, and
    again around the backward, where they also reduce-scatter its gradient. An ``lm_head`` under accelerate's
    hooks (``dispatch_model``, ``cpu_offload``) gets its input moved to its device, and an offloaded weight
    loaded, by the hook around its call. The fused loss reads the weight without calling the module, so it borrows
    the call: the forward the call ends in (:func:`_forward_slot`) is ``compute`` for the duration, and the hooks
    run around it as around the matmul they expected (casting ``x`` too, under a mixed-precision policy). Then the
    instance gets back exactly what it held. Any other module is not touched: a hook of its own (one that logs the
    logits, say) expects logits, not a loss, so it does not run, as when the fused loss reads the weight directly."""
    if not (_is_fsdp_unit(module) or _has_accelerate_hook(module)):
        return compute(x)
    slot = _forward_slot(module)
    held = module.__dict__.get(slot)  # accelerate's wrapped forward, or None: the class's forward
    setattr(module, slot, compute)
    try:
        return module(x)
    finally:
        if held is None:
            delattr(module, slot)
        else:
            setattr(module, slot, held)


def _final_norm(base: nn.Module) -> tuple[nn.Module, ...]:
    """The norm whose output is the base model's last hidden state (``norm`` in every family here), if any."""
    norm = getattr(base, "norm", None)
    return (norm,) if isinstance(norm, nn.Module) else ()


def _loss_forward(
    self: nn.Module, arguments: dict[str, Any], extra: dict[str, Any], *, fused: bool, chunk_tokens: int | None
):
    """transformers' causal-LM forward with the loss computed by liger_lab's kernels."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

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
    # The cache is ``cache`` in newer transformers, where reading ``past_key_values`` logs a deprecation.
    cache = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    carried = {name: getattr(outputs, name, None) for name in (cache, "hidden_states", "attentions")}
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
    Gemma) and the SiLU (Gemma 4: tanh-GELU) experts of a mixture of experts run by transformers' eager loop.
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
    kinds = {"RMSNorm": "RMSNorm", "MLP": "gated MLP (SwiGLU/GeGLU)", "Attention": "attention (RoPE)",
             "DecoderLayer": "residual add into RMSNorm"}  # fmt: skip
    kind_of = {f"Fused{family.name(suffix)}": kind for suffix, kind in kinds.items()}
    for module in model.modules():
        name = type(module).__name__
        if name.removeprefix("Fused") == family.name("Experts"):
            experts.append(module)  # counted below, where the fused loop is what its forward runs
        elif name in kind_of and not (kind_of[name] == "RMSNorm" and getattr(module, "weight", None) is None):
            replaced[kind_of[name]] = replaced.get(kind_of[name], 0) + 1  # (a norm without weight runs transformers')
    left_alone: dict[str, str] = dict(family.left_alone)
    activation = getattr(model.config, family.act_attr, None)
    fused_experts = [m for m in experts if type(m) in _UNFUSED and _experts_fallback(family, m) is None]
    if fused_experts:
        replaced[f"MoE experts ({'GeGLU' if _gated_kernel(activation) is glu_ops.geglu else 'SwiGLU'})"] = len(
            fused_experts
        )
    elif experts and family.experts:
        left_alone["experts"] = _experts_fallback(family, experts[0]) or "not patched (swiglu=False?)"
    if experts:
        left_alone["router"] = "transformers' own: top-k routing and its load-balancing loss are not fused"
    mlp_names = (family.name("MLP"), f"Fused{family.name('MLP')}")
    if not family.mlp or not any(type(module).__name__ in mlp_names for module in model.modules()):
        left_alone["MLP"] = "no dense MLP: every layer is a mixture of experts"
    elif not replaced.get("gated MLP (SwiGLU/GeGLU)"):
        no_kernel = f"activation {activation!r} has no fused kernel"
        left_alone["MLP"] = no_kernel if _gated_kernel(activation) is None else "not patched (swiglu=False?)"
    forward = _patched_forward(model)
    loss_forward = forward.__func__ if forward is not None else type(model).forward
    fused = getattr(loss_forward, "liger_lab_fused", None)  # None: transformers' own forward
    if forward is not None and forward.kept is not None:
        kept = _written_as(forward.kept)
        left_alone["forward"] = f"{kept}, set on the model before patch, runs the calls the fused loss does not take"
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


def _written_as(function: Callable[..., Any]) -> str:
    """Where a function was defined, as ``name (file)``: a wrapper's ``__qualname__`` is often the wrapped one's
    (functools.wraps copies it), which would name transformers' forward for TRL's."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    if code is None:
        return type(function).__name__
    return f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename.rpartition('site-packages/')[2]})"


def _unwrap(model: object) -> nn.Module:
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


# Class-name suffix of each fused piece in a modeling module -> the option of patch() that fuses it.
_PIECES = {"RMSNorm": "rms_norm", "MLP": "swiglu", "Attention": "rope", "DecoderLayer": "rms_norm", "Experts": "swiglu"}


def _fused_piece(family: _Family, modeling: types.ModuleType, suffix: str) -> tuple[type, type]:
    """(transformers class, its fused subclass) for one piece of a family."""
    original = _original(modeling, family.name(suffix))
    if suffix == "RMSNorm":
        return original, _norm_class(family, original)
    if suffix == "MLP":
        return original, _mlp_class(family, original)
    if suffix == "DecoderLayer":
        return original, _decoder_layer_class(original)
    if suffix == "Experts":
        return original, _experts_class(family, original)
    return original, _attention_class(family, modeling, original)


def _fused_classes(family: _Family, modeling: types.ModuleType, options: _Options) -> dict[str, tuple[type, type]]:
    """Name in the modeling module -> (transformers class, its fused subclass), for the pieces asked for."""
    return {
        family.name(suffix): _fused_piece(family, modeling, suffix)
        for suffix, option in _PIECES.items()
        if getattr(options, option) and suffix in family.pieces
    }


def _patch_family(model_type: str, options: _Options) -> None:
    family, modeling = _family(model_type), _modeling(model_type)
    record = _FAMILY_PATCHES[model_type] = _FamilyPatch()
    replacements = [(modeling, name, fused) for name, (_, fused) in _fused_classes(family, modeling, options).items()]
    if options.rope and family.rope:
        replacements.append((modeling, "apply_rotary_pos_emb", _rope_dispatcher(family, modeling)))
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


def _set_class(module: nn.Module, cls: type) -> None:
    """``module.__class__ = cls``, and a forward of the old class bound to the instance follows: accelerate's hooks
    keep the forward they wrapped in ``_old_forward`` (and ``remove_hook_from_module`` puts it in ``forward``), a
    bound method that would go on running the class the module had when it was hooked."""
    bound = [slot for slot in ("forward", "_old_forward") if _is_class_forward(module, module.__dict__.get(slot))]
    module.__class__ = cls
    for slot in bound:
        setattr(module, slot, types.MethodType(cls.forward, module))


def _patch_model(model: nn.Module, options: _Options) -> None:
    model_type = getattr(model.config, "model_type", None)
    family, modeling = _family(model_type), _modeling(model_type)
    classes = _fused_classes(family, modeling, options)
    activation = getattr(model.config, family.act_attr, None)
    # The dense MLP and the experts have SwiGLU and GeGLU kernels.
    for piece in ("MLP", "Experts"):
        name = family.name(piece)
        if _gated_kernel(activation) is None and name in classes:
            message = f"no fused kernel for the {piece} activation {activation!r}: {name} stays as it is"
            warnings.warn(message, stacklevel=3)
            del classes[name]
    fused_of = dict(classes.values())
    for name, module in model.named_modules():
        fused = fused_of.get(type(module))
        if fused is None or (fused.__name__.endswith("RMSNorm") and getattr(module, "weight", None) is None):
            continue  # a norm without weight (Gemma 4's with_scale=False) keeps transformers' class
        _set_class(module, fused)
        if fused.__name__.endswith("RMSNorm") and name.rpartition(".")[2] in family.in_place_norms:
            module.in_place_backward = True
    if options.rope and family.rope:
        _hold(modeling, "apply_rotary_pos_emb", _rope_dispatcher(family, modeling), model)
    causal_lm = _causal_lm(family, modeling)
    # A subclass with its own forward, or a family patched at class level, keeps the forward it has.
    if options.loss and isinstance(model, causal_lm) and type(model).forward is _original(causal_lm, "forward"):
        forward = _BoundForward(
            model, model_type, fused=options.fused_linear_cross_entropy, cross_entropy=options.cross_entropy,
            chunk_tokens=options.loss_chunk_tokens,
        )  # fmt: skip
        setattr(model, _forward_slot(model), forward)
        _PATCHED_FORWARDS[model] = weakref.ref(forward)


def _unpatch_model(model: nn.Module) -> None:
    model_type = getattr(model.config, "model_type", None)
    _family(model_type)
    modeling = _modeling(model_type)
    for module in model.modules():
        original = _UNFUSED.get(type(module))
        if original is not None:
            _set_class(module, original)
            module.__dict__.pop("in_place_backward", None)
            _release(modeling, "apply_rotary_pos_emb", module)  # held by an unpickled fused attention
    for slot in ("forward", "_old_forward"):
        forward = model.__dict__.get(slot)
        if isinstance(forward, _BoundForward) and forward.__self__ is model:
            forward.put_back(slot)
    reference = _PATCHED_FORWARDS.pop(model, None)
    buried = reference() if reference is not None else None
    if buried is not None:  # inside a forward another library set after patch, which still calls it
        buried.active = False
    _release(modeling, "apply_rotary_pos_emb", model)


def __getattr__(name: str) -> type:
    """The fused classes by name (``FusedLlamaRMSNorm``, ...), made on demand: pickle looks up the class of a
    patched module here, also in a process that has patched nothing yet."""
    for model_type, family in FAMILIES.items():
        for suffix in family.pieces:
            if name == f"Fused{family.name(suffix)}":
                try:
                    modeling = _modeling(model_type)
                except ImportError as error:  # a transformers without this family
                    raise AttributeError(f"module {__name__!r} has no attribute {name!r}: {error}") from error
                return _fused_piece(family, modeling, suffix)[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
