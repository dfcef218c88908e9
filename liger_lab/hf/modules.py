"""The fused modules: a subclass of each transformers class that gets fused, which overrides ``forward`` only.

``isinstance`` checks, weight initialisation, state dicts and ``save_pretrained`` see the transformers classes the
fused ones derive from. Per kind of piece (``registry.PIECE_KINDS``):

* RMSNorm: the fused norm, rounding where the family's norm rounds (``Family.norm``);
* LayerNorm1P: Nemotron's LayerNorm, scaling by 1 + w, on the fused LayerNorm;
* MLP: ``down(act(gate) * up)`` with ``act(gate) * up`` fused (SwiGLU, GeGLU);
* Experts: transformers' eager loop over the experts of a mixture, with the same fused product;
* DecoderLayer: Llama's layer with the add before the MLP's norm fused into the norm (``add_rms_norm``);
* Attention: transformers' attention, inside which ``apply_rotary_pos_emb`` runs the fused kernel.

RoPE is the one piece that is not a module: the modeling module's ``apply_rotary_pos_emb`` is replaced (while any
patched model or family holds the swap) by a dispatcher that runs the fused kernel inside the forward of a fused
attention and transformers' own function everywhere else. A fused attention that is unpickled or deep-copied holds
that swap itself, so it keeps running the fused kernel. The file ends with the piece table, :data:`_BUILDERS`, and the
lookup that finds a fused class by name.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from liger_lab.hf.families import FAMILIES, Family, Options, modeling_of
from liger_lab.hf.registry import (
    FUSED_NAMES,
    PIECE_KINDS,
    UNFUSED,
    PieceKind,
    fused_subclass,
    hold,
    original_of,
)
from liger_lab.nn.mlp import GeGLUMLP, SwiGLUMLP, outputs_observed
from liger_lab.ops import glu as glu_ops
from liger_lab.ops import layer_norm as layer_norm_ops
from liger_lab.ops import partial_rope as partial_rope_ops
from liger_lab.ops import rms_norm as rms_norm_ops
from liger_lab.ops import rope as rope_ops


def _eps(norm: nn.Module) -> float:
    """A norm's epsilon: ``variance_epsilon`` in Llama's norm and most others, ``eps`` in Llama 4's and Gemma 4's."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


def _llama_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm_ops.rms_norm(hidden_states, self.weight, _eps(self), in_place_backward=self.in_place_backward)


def _fp32_weight_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if getattr(self, "weight", None) is None:  # Gemma 4's with_scale=False: nothing for the kernel to scale by
        return UNFUSED[type(self)].forward(self, hidden_states)
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


def _norm_class(family: Family, modeling: types.ModuleType, original: type) -> type:
    forward = _NORM_FORWARDS[family.norm]
    # A class-level default; patch(model) turns it on per module where the gradient may be reused.
    return fused_subclass(original, forward, in_place_backward=False)


def _layer_norm_1p_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Nemotron's LayerNorm1P. Under autocast transformers runs it in autocast's dtype (input, ``weight + 1`` and bias
    cast), where autocast alone would run a LayerNorm in fp32: so does this."""
    weight, bias = self.weight, self.bias
    device = hidden_states.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden_states, weight, bias = (tensor.to(dtype) for tensor in (hidden_states, weight, bias))
    return layer_norm_ops.layer_norm(hidden_states, weight, bias, self.eps, offset=1.0)


def _layer_norm_1p_class(family: Family, modeling: types.ModuleType, original: type) -> type:
    return fused_subclass(original, _layer_norm_1p_forward)


def gated_kernel(activation: object) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The fused ``act(gate) * up`` for a transformers activation name, None when there is none."""
    if activation in SwiGLUMLP.hf_activations:
        return glu_ops.swiglu
    if activation in GeGLUMLP.hf_activations:
        return glu_ops.geglu
    return None


def _mlp_class(family: Family, modeling: types.ModuleType, original: type) -> type:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = gated_kernel(getattr(self.config, family.act_attr, None))
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

    return fused_subclass(original, forward)


def experts_fallback(family: Family, experts: nn.Module) -> str | None:
    """Why an experts module runs transformers' forward rather than the fused loop, or None when it runs the loop.

    transformers 5 dispatches an experts module's forward on ``config._experts_implementation``: ``"eager"`` (or
    None, a module built outside a model) is its Python loop over the experts, the one fused here; any other name
    (``"grouped_mm"``, the default wherever it can run, ``"batched_mm"``, ...) is an integration's kernel, which
    is left as it is."""
    config = getattr(experts, "config", None)
    activation = getattr(config, family.act_attr, None)
    if gated_kernel(activation) is None:
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


def _experts_class(family: Family, modeling: types.ModuleType, original: type) -> type:
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # Decided per call: set_experts_implementation can switch a built model between the loop and a kernel.
        if experts_fallback(family, self) is not None:
            return original.forward(self, hidden_states, top_k_index, top_k_weights)
        glu = gated_kernel(getattr(self.config, family.act_attr))
        return _gated_experts(self, hidden_states, top_k_index, top_k_weights, glu)

    return fused_subclass(original, forward)


def _decoder_layer_class(family: Family, modeling: types.ModuleType, original: type) -> type:
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

    return fused_subclass(original, forward)


def _fused_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` on the fused kernel, partial rotary included (Phi-3 with
    ``partial_rotary_factor < 1``, Qwen3.5, GLM-4.5: only the first ``cos.shape[-1]`` features of each head rotate,
    and the kernel copies the others in the same pass, where transformers slices and concatenates).

    Pixtral's tables are (positions, head_dim), shared by the batch, and its call unsqueezes them in front
    (``unsqueeze_dim=0``): (1, positions, head_dim), which broadcast over batch and heads as the kernel's tables do."""
    if unsqueeze_dim == 0 and cos.dim() == 2:
        cos, sin, unsqueeze_dim = cos.unsqueeze(0), sin.unsqueeze(0), 1
    if cos.shape[-1] == q.shape[-1]:
        q_rot, k_rot = rope_ops.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    else:
        _check_heads_first(unsqueeze_dim)
        q_rot, k_rot = partial_rope_ops.partial_rope(q, k, cos, sin)
    # OLMo 2 keeps cos and sin in fp32 and rounds the rotated q and k back to their dtype (the kernel returns the
    # promoted dtype, fp32): without this a bf16 model's attention would get fp32 queries and bf16 values.
    return q_rot.to(q.dtype), k_rot.to(k.dtype)


def _check_heads_first(unsqueeze_dim: int) -> None:
    if unsqueeze_dim != 1:
        raise ValueError(
            f"unsqueeze_dim is {unsqueeze_dim}: expected 1, q and k laid out as (batch, heads, seq_len, head_dim)"
        )


def _fused_interleaved_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM's and GLM-4's ``apply_rotary_pos_emb`` on the fused kernel: features (2i, 2i + 1) rotate together, by the
    angle of entry i of the first half of cos and sin (repeated for both neighbours, as transformers does: a
    (positions x rotary_dim) table), over the first half-table-width features; the rest are copied in the same pass."""
    _check_heads_first(unsqueeze_dim)
    cos, sin = (table[..., : table.shape[-1] // 2].repeat_interleave(2, dim=-1) for table in (cos, sin))
    q_rot, k_rot = partial_rope_ops.partial_rope(q, k, cos, sin, interleaved=True)
    return q_rot.to(q.dtype), k_rot.to(k.dtype)


def _fused_interleaved_tables_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4V's ``apply_rotary_pos_emb``: GLM's neighbour pairs over the first ``cos.shape[-1]`` features, with tables
    that already hold each pair's angle twice in a row (its rotary embedding repeats them)."""
    _check_heads_first(unsqueeze_dim)
    q_rot, k_rot = partial_rope_ops.partial_rope(q, k, cos, sin, interleaved=True)
    return q_rot.to(q.dtype), k_rot.to(k.dtype)


def _fused_complex_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's ``apply_rotary_emb`` on the fused kernel: q and k (B, T, H, D), each pair of neighbours a complex
    number multiplied by its ``freqs_cis`` (B, T, D/2), in fp32, rounded back to q's dtype. The kernel reads q and k
    through their strides (no complex copies) with the real and imaginary parts as the interleaved layout's tables."""
    cos, sin = partial_rope_ops.tables_from_complex(freqs_cis)
    q_rot, k_rot = partial_rope_ops.partial_rope(xq.transpose(1, 2), xk.transpose(1, 2), cos, sin, interleaved=True)
    return q_rot.transpose(1, 2).to(xq.dtype), k_rot.transpose(1, 2).to(xk.dtype)


def _fused_half_table_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's ``apply_rotary_pos_emb`` on the fused kernel. Its cos and sin hold each of a head's D/2 angles once,
    and it maps the halves (x1, x2) to (x1 cos - x2 sin, x2 cos + x1 sin): rotate_half's rotation, whose tables
    hold every angle twice. The repeated tables are (positions x D) elements, against q's and k's heads x that."""
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return _fused_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def _fused_complex_heads_first_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's ``apply_rotary_emb``: Llama 4's complex pairs on q and k laid out (B, H, T, D) (MLA's rope parts
    of the query heads and its one shared key head), ``freqs_cis`` (B, T, D/2)."""
    cos, sin = partial_rope_ops.tables_from_complex(freqs_cis)
    q_rot, k_rot = partial_rope_ops.partial_rope(xq, xk, cos, sin, interleaved=True)
    return q_rot.to(xq.dtype), k_rot.to(xk.dtype)


_FUSED_ROPE: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "rotate_half": _fused_rotary_pos_emb,
    "interleaved": _fused_interleaved_rotary_pos_emb,
    "interleaved_tables": _fused_interleaved_tables_rotary_pos_emb,
    "complex": _fused_complex_rotary_emb,
    "complex_heads_first": _fused_complex_heads_first_rotary_emb,
}


class _FusedRopeDepth(threading.local):
    """How many forwards of fused attentions are running in this thread: the rope dispatcher's switch. Per thread,
    because the swapped function is shared: a model of the family that another thread runs at the same time (an
    unpatched reference, an evaluation thread) is not inside this thread's fused attention. An instance, not a
    class attribute: torch.compile traces a change to an object's attribute (guarding on it, per thread) but not
    to a class's."""

    def __init__(self) -> None:
        self.depth = 0


_FusedRope = _FusedRopeDepth()


def _attention_class(family: Family, modeling: types.ModuleType, original: type) -> type:
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
        hold(modeling, family.rope_function, rope_dispatcher(family, modeling), self)

    return fused_subclass(original, forward, __setstate__=__setstate__)


_DISPATCHERS: dict[types.ModuleType, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}


def rope_dispatcher(family: Family, modeling: types.ModuleType) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """What replaces ``modeling.apply_rotary_pos_emb``: the fused kernel inside a fused attention's
    forward, transformers' function in every other model of the family.

    Where transformers' Hub-kernels integration is on, its ``apply_rotary_pos_emb`` is not a function but an
    instance of a one-function ``nn.Module`` class from the ``kernels`` package, and every attention keeps a private
    instance of that class, which unpickles as ``type(modeling.apply_rotary_pos_emb)()``. The dispatcher is then an
    instance of the same class with its ``forward`` replaced, so a model pickled or loaded while the swap is held
    gets private instances of transformers' class, as it would unpatched."""
    if modeling not in _DISPATCHERS:
        original = original_of(modeling, family.rope_function)
        fused = _FUSED_ROPE[family.rope_layout]
        if family.rope_half_tables:
            fused = _fused_half_table_rotary_pos_emb

        def apply_rotary_pos_emb(*args, **kwargs):
            return (fused if _FusedRope.depth else original)(*args, **kwargs)

        if isinstance(original, nn.Module):
            dispatcher = type(original)()
            dispatcher.forward = apply_rotary_pos_emb
        else:
            dispatcher = functools.wraps(original)(apply_rotary_pos_emb)
        _DISPATCHERS[modeling] = dispatcher
    return _DISPATCHERS[modeling]


# ---------------------------------------------------------------------------------------------------
# The piece table: how each kind of registry.PIECE_KINDS is built, from its family, the family's modeling module
# and the transformers class.

_BUILDERS: dict[str, Callable[[Family, types.ModuleType, type], type]] = {
    "RMSNorm": _norm_class,
    "LayerNorm1P": _layer_norm_1p_class,
    "MLP": _mlp_class,
    "Attention": _attention_class,
    "DecoderLayer": _decoder_layer_class,
    "Experts": _experts_class,
}


class _FusedPiece(NamedTuple):
    """One piece of one family: its kind, the transformers class and the subclass that replaces it."""

    kind: PieceKind
    original: type
    fused: type


def _fused_name(module: str, name: str) -> str:
    """The name of the fused class of the class ``name`` of ``transformers.models.<module>``'s modeling module, under
    which pickle records it: ``Fused`` + ``name``, unless an earlier row of :data:`FAMILIES` has a piece of that name
    in another module (Qwen2's Qwen2MLP before Qwen2.5-VL's): then the module follows, ``FusedQwen2MLP_qwen2_5_vl``."""
    first = next(
        family.module or model_type
        for model_type, family in FAMILIES.items()
        if any(family.name(suffix) == name for suffix in family.pieces)
    )
    return f"Fused{name}" if first == module else f"Fused{name}_{module}"


def _fused_piece(family: Family, modeling: types.ModuleType, kind: PieceKind) -> _FusedPiece:
    name = family.name(kind.suffix)
    original = original_of(modeling, name)
    FUSED_NAMES.setdefault(original, _fused_name(modeling.__name__.rpartition(".modeling_")[2], name))
    return _FusedPiece(kind, original, _BUILDERS[kind.suffix](family, modeling, original))


def fused_classes(family: Family, modeling: types.ModuleType, options: Options) -> dict[str, _FusedPiece]:
    """Name in the modeling module -> the piece, for the pieces of the family that ``options`` ask for."""
    kinds = [PIECE_KINDS[suffix] for suffix in family.pieces]
    return {family.name(k.suffix): _fused_piece(family, modeling, k) for k in kinds if getattr(options, k.option)}


def find_fused_class(name: str, home: str) -> type:
    """The fused class called ``name`` (``FusedLlamaRMSNorm``, ...), made on demand: pickle looks up the class of a
    patched module in ``home`` (``liger_lab.hf``, or ``liger_lab.patching`` for a model saved before the split),
    also in a process that has patched nothing yet. Anything else is an ``AttributeError`` of ``home``."""
    for model_type, family in FAMILIES.items():
        for suffix in family.pieces:
            if name == _fused_name(family.module or model_type, family.name(suffix)):
                try:
                    modeling = modeling_of(model_type)
                except ImportError as error:  # a transformers without this family
                    raise AttributeError(f"module {home!r} has no attribute {name!r}: {error}") from error
                return _fused_piece(family, modeling, PIECE_KINDS[suffix]).fused
    raise AttributeError(f"module {home!r} has no attribute {name!r}")
