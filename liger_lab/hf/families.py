"""The families that :func:`~liger_lab.hf.patch` supports: one row of :data:`FAMILIES` per ``config.model_type``.

A transformers decoder is assembled from a handful of classes in one modeling module per family
(``transformers.models.llama.modeling_llama`` and so on): an RMSNorm class, a gated MLP class, an attention class
that calls the module's free function ``apply_rotary_pos_emb`` by name, a decoder layer, and a ``...ForCausalLM``
whose forward computes every logit and then the loss. A mixture of experts (Qwen3-MoE, Mixtral, Qwen3.5-MoE, Gemma 4,
DeepSeek-V3, GLM-4.5) keeps every expert's weights in one ``...Experts`` module of two 3-D tensors, run by
transformers' Python loop over the experts or by one of its kernels (``experts_implementation``, ``"grouped_mm"`` by
default where it runs): the loop gets the fused SwiGLU (GeGLU for Gemma 4), the kernels and the router stay
transformers', and the report says which runs. A row (:class:`Family`) is all that patching knows of a family: how
it names those classes, which of them it has, and how they compute where families differ. What a family computes
differently from the fused pieces (GPT-OSS's clamped experts, interleaved or one-tensor RoPE) stays transformers',
and its row records why for the report to say.

Adding a family is adding a row, keyed by its model type:

* ``prefix`` names its classes: ``"Llama"`` gives ``LlamaRMSNorm``, ``LlamaMLP``, ``LlamaAttention``,
  ``LlamaDecoderLayer``, ``LlamaExperts`` and ``LlamaForCausalLM``. ``names`` gives those that are not prefix +
  suffix (Gemma 4's norm and causal LM; a multimodal model's ``...ForConditionalGeneration`` goes under
  ``"ForCausalLM"``: the loss forward reads its ``lm_head`` and the base model under its ``base_model_prefix``), and
  ``module`` the modeling module when it is not named after the model type (``gemma3_text`` is in ``gemma3``).
* Flags say which pieces it has, each a kind of :data:`~liger_lab.hf.registry.PIECE_KINDS` (whose ``flag`` names
  the field): ``rms_norm`` an RMSNorm (every family but Nemotron, whose ``layer_norm_1p`` is a LayerNorm scaling by
  1 + w); ``mlp`` a dense gated MLP, ``rope`` an attention whose RoPE is rotate_half's, ``add_norm`` a decoder layer
  written as Llama's, ``experts`` 3-D experts.
* How they compute, where families differ: ``norm`` (where the RMSNorm rounds), ``act_attr`` (the config attribute
  naming the activation), ``fused_gate_up``, ``rope_half_tables``, ``rope_layout``, ``in_place_norms``.
* ``left_alone``: what stays transformers' and why, in the report's words.

Then the family gets a tiny config in ``tests/test_patching.py`` (``FAMILY_CONFIG``), and every test that runs over
:data:`FAMILIES` runs on it: a training step against transformers, the kernel of every piece, the rounding of its
norms, pickling. A kind of piece that no family had yet (a vision tower's MLP, say) is one entry of ``PIECE_KINDS``,
a flag here, and its builder in :mod:`liger_lab.hf.modules`.

A vision-language model (``...ForConditionalGeneration``) is a row like any other, under its ``model_type``: its
pieces are its language model's, its loss forward is the conditional generation's (``names``' ``"ForCausalLM"``),
and ``left_alone`` says what of the vision tower and the projector stays transformers'. A language model that
transformers builds from another family's classes (LLaVA's ``LlamaModel``) takes that family's row with
``causal_lm_module`` naming the module of the conditional generation (see :data:`FAMILIES`). Its tiny model, with a
tiny vision tower, is in ``tests/tiny_vlms.py``, which ``tests/test_patching.py`` builds for the runs over every
family (on text) and ``tests/test_vlm_families.py`` runs on images.

A vision encoder that transformers builds as a model of its own type (Pixtral's ``PixtralVisionModel``, a LLaVA's
``vision_tower`` when its ``vision_config`` is Pixtral's) is a row too, flagged ``vision_encoder``: it has no causal LM
and no loss. ``patch(model)`` fuses it wherever a model holds one (the model's own row fuses the rest), and the report
says what of it stays transformers' in place of the holding row's ``"vision tower"`` entry. Its tiny model is the
vision-language model that holds it.
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, replace

from liger_lab.hf.registry import PIECE_KINDS


@dataclass(frozen=True)
class Family:
    """How one transformers family names and wires the pieces that get fused: one row of :data:`FAMILIES`."""

    prefix: str  # class-name prefix in the modeling module: "Llama" -> LlamaRMSNorm, LlamaMLP, LlamaAttention, ...
    # How its RMSNorm rounds: "llama" rounds xhat to the input dtype, then multiplies by w; "fp32_weight"
    # multiplies by w in fp32 and rounds once (OLMo 2); "gemma" scales by (1 + w) in fp32, eps in "eps".
    norm: str = "llama"
    act_attr: str = "hidden_act"  # config attribute naming the MLP activation
    fused_gate_up: bool = False  # one gate_up_proj whose output is [gate | up] (Phi-3)
    rms_norm: bool = True  # an RMSNorm class
    # A LayerNorm with bias whose stored weight w scales as 1 + w (Nemotron's LayerNorm1P), instead of an RMSNorm.
    layer_norm_1p: bool = False
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
    # How the attention's RoPE pairs features, when ``rope``: "rotate_half" (Llama's apply_rotary_pos_emb, partial
    # RoPE included), "interleaved" (GLM's: neighbours paired, each pair's angle from the first half of the tables),
    # "interleaved_tables" (GLM-4V's: neighbours paired, tables already repeating each pair's angle),
    # "complex" (Llama 4's apply_rotary_emb(xq, xk, freqs_cis), complex pairs of neighbours, q and k (B, T, H, D)),
    # "complex_heads_first" (DeepSeek-V2's apply_rotary_emb: the same on q and k (B, H, T, D)).
    rope_layout: str = "rotate_half"
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
    # The modeling module of the causal LM (names' "ForCausalLM") when it is not ``module``: LLaVA's language model is a
    # LlamaModel, whose pieces are in llama, while LlavaForConditionalGeneration is in llava. patch(model) then checks
    # that the model's text config is of ``module``'s family.
    causal_lm_module: str | None = None
    # A conditional generation that applies its text config's final_logit_softcapping (Gemma 4's; Gemma 3's does not),
    # after its output_multiplier where it has one (MuseGlimmer's): the fused loss applies them too.
    text_softcap: bool = False
    # A vision encoder of its own model type (Pixtral): no causal LM and no loss; patch(model) fuses it inside any model
    # that holds one, and its left_alone replaces the holding row's entries of the same name (its "vision tower").
    vision_encoder: bool = False

    @property
    def pieces(self) -> tuple[str, ...]:
        """Class-name suffixes of the pieces this family has fused versions of (kinds of ``PIECE_KINDS``)."""
        return tuple(suffix for suffix, kind in PIECE_KINDS.items() if getattr(self, kind.flag))

    @property
    def rope_function(self) -> str:
        """The modeling module's function that the attention calls to rotate q and k, which patch swaps."""
        return "apply_rotary_emb" if self.rope_layout.startswith("complex") else "apply_rotary_pos_emb"

    def name(self, suffix: str) -> str:
        """The class name of a piece (a suffix of :attr:`pieces`, ``"Experts"`` or ``"ForCausalLM"``)."""
        return dict(self.names).get(suffix, self.prefix + suffix)


# Text families whose rows a vision-language family's row reuses (its language model is theirs).
_LLAMA = Family("Llama", add_norm=True)
_GEMMA3_TEXT = Family(
    "Gemma3", norm="gemma", act_attr="hidden_activation", module="gemma3",
    in_place_norms=("input_layernorm", "pre_feedforward_layernorm"),
)  # fmt: skip

# Multimodal RoPE in transformers 5 (Qwen2.5-VL, Qwen3-VL): the text rotary embedding picks each feature pair's position
# stream (temporal, height, width) once per forward (recomposition_frequencies), and every attention layer then calls
# the module's plain apply_rotary_pos_emb(q, k, cos, sin) on those (B, T, D) tables: the per-layer rotation is
# liger_lab.rope's, swapped in as for a text family (liger_lab.mrope, which takes the three streams, has no call to
# replace there). The vision attention's apply_rotary_pos_emb_vision (2-D positions over packed patches, in fp32) is
# another function, left as it is.
_QWEN_VISION_TOWER = (
    "the vision blocks' attention (its 2-D RoPE, apply_rotary_pos_emb_vision, in fp32) and MLP run transformers' code: "
    "patch fuses the language model"
)

# Qwen3.5's linear-attention (Gated DeltaNet) layers end in a norm of another formula.
_GATED_NORM = ("gated RMSNorm", "RMSNormGated, norm(x) * w * silu(z) in the linear-attention layers: no fused kernel")

# The vision side of Qwen3-VL's kind (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 with images), as the report states it.
_QWEN3_VISION_SIDE = (
    ("vision tower", f"{_QWEN_VISION_TOWER}; its norms are LayerNorms and its MLP has no gate"),
    ("projector", "the patch mergers (the DeepStack ones too): LayerNorm and a GELU MLP, transformers' code"),
)

FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": Family("Mistral", add_norm=True),
    "qwen2": Family("Qwen2", add_norm=True),
    "qwen3": Family("Qwen3", add_norm=True),
    "gemma": Family("Gemma", norm="gemma"),
    "gemma2": Family(
        "Gemma2", norm="gemma", act_attr="hidden_activation",
        in_place_norms=("input_layernorm", "pre_feedforward_layernorm"),
    ),
    "phi3": Family("Phi3", fused_gate_up=True),
    "gemma3_text": _GEMMA3_TEXT,
    "qwen3_moe": Family("Qwen3Moe", experts=True),  # dense layers (mlp_only_layers) have a Qwen3MoeMLP
    "mixtral": Family("Mixtral", mlp=False, experts=True),
    # Norms after attention and after the MLP, each output added to the residual: none may reuse its gradient.
    "olmo2": Family("Olmo2", norm="fp32_weight", in_place_norms=()),
    "granite": Family("Granite"),  # its logits are divided by config.logits_scaling, in the loss too
    "smollm3": Family("SmolLM3", add_norm=True),  # some layers skip RoPE: they never call apply_rotary_pos_emb
    "glm4": Family("Glm4", fused_gate_up=True, rope_layout="interleaved"),
    # Qwen3.5 (the text model): (1 + w) norms, q_norm and k_norm too; partial RoPE on the full-attention layers (its
    # multimodal position tables are plain cos and sin by then). The decoder's add is not fused: add_norm is written
    # for Llama's norm.
    "qwen3_5_text": Family("Qwen3_5", norm="gemma", module="qwen3_5", left_alone=(_GATED_NORM,)),
    # Qwen3.5's layers with a mixture of experts: its shared expert is a Qwen3_5MoeMLP (its sigmoid gate stays).
    "qwen3_5_moe_text": Family(
        "Qwen3_5Moe", norm="gemma", module="qwen3_5_moe", experts=True, left_alone=(_GATED_NORM,)
    ),
    # Gemma 4 (text): w, not 1 + w, multiplied in fp32 and rounded once (OLMo 2's rounding); GeGLU in the MLP and in
    # the experts (26B-A4B's layers run both and add them). Sandwich norms, per-layer inputs, layer scalars: no fused
    # add.
    "gemma4_text": Family(
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
    "gpt_oss": Family(
        "GptOss", norm="fp32_weight", mlp=False, rope_half_tables=True,
        left_alone=(
            ("experts", "clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, "
                        "limit), on interleaved gate and up columns with biases: not the fused silu(gate) * up"),
        ),
    ),
    # Llama 4 (text): Llama's norm (its eps named eps), SwiGLU MLPs (the dense layers and each MoE layer's shared
    # expert). The decoder layer calls its MLP feed_forward and unpacks the MoE's tuple: no fused add.
    "llama4_text": Family(
        "Llama4Text", module="llama4", rope_layout="complex", names=(("ForCausalLM", "Llama4ForCausalLM"),),
        left_alone=(
            ("experts", "every expert runs on every token, its input scaled by the router (batched matmuls): not the "
                        "top-k experts interface of the fused loop"),
            ("qk_norm", "Llama4TextL2Norm has no weight for the kernel to scale by"),
        ),
    ),
    # OLMo 3: OLMo 2's layer, with sliding-window layers.
    "olmo3": Family("Olmo3", norm="fp32_weight", in_place_norms=()),
    # Ministral 3: Mistral's layer; its queries are scaled by Llama 4's position-dependent factor after RoPE.
    "ministral3": Family("Ministral3", add_norm=True),
    # DeepSeek-V3: MLA attention, whose low-rank q and kv norms (q_a_layernorm, kv_a_layernorm) are fused too; dense
    # first layers and each MoE layer's shared experts are a DeepseekV3MLP; the routed experts are 3-D.
    "deepseek_v3": Family(
        "DeepseekV3", experts=True, rope=False, add_norm=True,
        left_alone=(
            ("RoPE", "MLA's decoupled RoPE, on a qk_rope_head_dim slice of q and one key head shared by all heads, "
                     "rotates interleaved pairs (apply_rotary_pos_emb_interleave: rope_interleave=True, the "
                     "checkpoints' layout), which the fused kernel does not"),
        ),
    ),
    # GLM-4.5 (MoE): unlike GLM-4, rotate_half RoPE on part of each head; Llama's layer, optional q and k norms.
    "glm4_moe": Family("Glm4Moe", experts=True, add_norm=True),
    # Ministral (the first, 8B): Mistral's layer.
    "ministral": Family("Ministral", add_norm=True),
    # EXAONE 4: OLMo 2's layout (norms after attention and after the MLP, each output added to the residual, q and k
    # norms over head_dim), Llama's norm rounding; sliding and global layers.
    "exaone4": Family("Exaone4", in_place_norms=()),
    # Hunyuan dense: Llama's layer, with q and k norms (query_layernorm, key_layernorm) after RoPE.
    "hunyuan_v1_dense": Family("HunYuanDenseV1", add_norm=True),
    # Hunyuan MoE: Hunyuan dense's layer, every MLP a mixture of 3-D experts beside a shared expert (a gated MLP).
    "hunyuan_v1_moe": Family("HunYuanMoEV1", experts=True, add_norm=True),
    # Qwen3-Next: Qwen3.5-MoE's text model before it, (1 + w) norms, Gated DeltaNet layers ending in a gated norm,
    # partial RoPE on the full-attention layers, experts beside a gated shared expert.
    "qwen3_next": Family("Qwen3Next", norm="gemma", experts=True, left_alone=(_GATED_NORM,)),
    # DeepSeek-V2: DeepSeek-V3's layer (MLA, shared and routed experts); its MLA RoPE multiplies complex pairs of
    # neighbours (apply_rotary_emb) on the query heads' rope part and the one shared key head.
    "deepseek_v2": Family("DeepseekV2", experts=True, add_norm=True, rope_layout="complex_heads_first"),
    # DeepSeek-V4: norms with fp32 weights multiplied in fp32 and rounded once (OLMo 2's rounding); everything else
    # computes otherwise: clamped SwiGLU in the MLP and the experts, RoPE on a trailing slice of one tensor at a time
    # (and backwards on the attention's output), hyper-connections around each sublayer instead of a residual add.
    "deepseek_v4": Family(
        "DeepseekV4", norm="fp32_weight", mlp=False, rope=False, in_place_norms=(),
        left_alone=(
            ("MLP", "clamped SwiGLU, silu(min(gate, limit)) * clamp(up, -limit, limit): not the fused silu(gate) * up"),
            ("experts", "the same clamped SwiGLU (with transformers' loop or kernels)"),
            ("RoPE", "applied to one tensor at a time, on the trailing rope slice of each head, and inverted on the "
                     "attention's output: not the fused kernel's q and k together"),
            ("unweighted RMSNorm", "the query and hyper-connection norms have no weight for the kernel to scale by"),
        ),
    ),
    # Falcon-H1: attention and a Mamba-2 mixer side by side in every layer, muP multipliers throughout (the logits'
    # lm_head_multiplier is applied in the fused loss too); Llama's norm rounding, rotate_half RoPE.
    "falcon_h1": Family(
        "FalconH1", mlp=False, in_place_norms=(),
        left_alone=(
            ("MLP", "down(up(x) * silu(gate(x) * m_gate)) * m_down, muP multipliers inside and after the gated "
                    "product: not the fused MLP's computation"),
            ("Mamba mixer", "the Mamba-2 scan and its gated norm (FalconH1RMSNormGated, norm(x * silu(z)) * w): no "
                            "fused kernel"),
        ),
    ),
    # Nemotron: LayerNorm1P (a LayerNorm with bias, scaling by 1 + w, which has no in-place backward), partial
    # rotate_half RoPE (partial_rotary_factor 0.5 by default), Llama's layer around an MLP without gate.
    "nemotron": Family(
        "Nemotron", rms_norm=False, layer_norm_1p=True, mlp=False, in_place_norms=(),
        left_alone=(
            ("MLP", "down(relu(up(x)) ** 2), squared ReLU without a gate: not the fused act(gate) * up, and no "
                    "kernel of its own"),
        ),
    ),
    # Vision-language models: the language model is fused, the loss runs on the conditional generation's lm_head (the
    # labels shifted, num_items_in_batch and logits_to_keep honoured, as its ForCausalLMLoss does), and the vision
    # tower and the projector stay transformers' but for a norm of the language model's class.
    # Qwen2.5-VL: Qwen2's decoder layer (its MLP class is still called Qwen2MLP; Qwen2_5_VLMLP is the vision blocks'),
    # multimodal RoPE as above. Its vision blocks and patch merger normalise with Qwen2_5_VLRMSNorm, the language
    # model's class, so those norms are fused too: the same formula.
    "qwen2_5_vl": Family(
        "Qwen2_5_VL", add_norm=True,
        names=(("MLP", "Qwen2MLP"), ("ForCausalLM", "Qwen2_5_VLForConditionalGeneration")),
        left_alone=(
            ("vision tower", f"{_QWEN_VISION_TOWER}; only its RMSNorms, the language model's class, run fused"),
            ("projector", "the patch merger's merge and GELU MLP are transformers' (its RMSNorm, ln_q, is fused)"),
        ),
    ),
    # Qwen3-VL: Qwen3's layer (q and k norms) under Qwen3VLText names. Its multimodal RoPE interleaves the streams (t h
    # w t h w ...), and that too is built into cos and sin once per forward: the attention's rotation is plain.
    "qwen3_vl": Family(
        "Qwen3VLText", add_norm=True, names=(("ForCausalLM", "Qwen3VLForConditionalGeneration"),),
        left_alone=(
            ("vision tower", f"{_QWEN_VISION_TOWER}; its norms are LayerNorms and its MLP has no gate"),
            ("projector", "the patch mergers (the DeepStack ones too): LayerNorm and a GELU MLP, transformers' code"),
        ),
    ),
    # Qwen2-VL: Qwen2.5-VL's language model before it (Qwen2MLP, multimodal RoPE built into cos and sin); its vision
    # blocks normalise with LayerNorm and their MLP has no gate.
    "qwen2_vl": Family(
        "Qwen2VL", add_norm=True, names=(("MLP", "Qwen2MLP"), ("ForCausalLM", "Qwen2VLForConditionalGeneration")),
        left_alone=(
            ("vision tower", f"{_QWEN_VISION_TOWER}; its norms are LayerNorms and its MLP has no gate"),
            ("projector", "the patch merger: LayerNorm and a GELU MLP, transformers' code"),
        ),
    ),
    # Qwen3-VL-MoE: Qwen3-VL with Qwen3-MoE's layers (3-D experts; mlp_only_layers keep a dense MLP).
    "qwen3_vl_moe": Family(
        "Qwen3VLMoeText", add_norm=True, experts=True, names=(("ForCausalLM", "Qwen3VLMoeForConditionalGeneration"),),
        left_alone=(
            ("vision tower", f"{_QWEN_VISION_TOWER}; its norms are LayerNorms and its MLP has no gate"),
            ("projector", "the patch mergers (the DeepStack ones too): LayerNorm and a GELU MLP, transformers' code"),
        ),
    ),
    # Qwen3.5 and Qwen3.5-MoE with images: their language models are the text rows' classes (multimodal RoPE built
    # into cos and sin once per forward, as Qwen3-VL's); the vision tower is Qwen3-VL's kind.
    "qwen3_5": Family(
        "Qwen3_5", norm="gemma", names=(("ForCausalLM", "Qwen3_5ForConditionalGeneration"),),
        left_alone=(_GATED_NORM, *_QWEN3_VISION_SIDE),
    ),
    "qwen3_5_moe": Family(
        "Qwen3_5Moe", norm="gemma", experts=True, names=(("ForCausalLM", "Qwen3_5MoeForConditionalGeneration"),),
        left_alone=(_GATED_NORM, *_QWEN3_VISION_SIDE),
    ),
    # Gemma 4 with images: gemma4_text's language model under the conditional generation; the vision encoder's norms
    # are Gemma4RMSNorm, the language model's class, fused too (those without weight run transformers' forward).
    "gemma4": Family(
        "Gemma4Text", norm="fp32_weight", act_attr="hidden_activation", experts=True, rope=False, text_softcap=True,
        in_place_norms=("input_layernorm", "pre_feedforward_layernorm"),
        names=(("RMSNorm", "Gemma4RMSNorm"), ("ForCausalLM", "Gemma4ForConditionalGeneration")),
        left_alone=(
            ("RoPE", "apply_rotary_pos_emb(x, cos, sin) rotates q and k one at a time, each after its norm (the vision "
                     "encoder's 2-D RoPE too); the fused kernel takes both"),
            ("RMSNorm without weight", "v_norm, the router's and the projector's pre-projection norm "
                                       "(with_scale=False): no weight for the kernel to scale by"),
            ("vision tower", "its attention and its GeGLU MLP (clippable linears) run transformers' code; its norms, "
                             "the language model's class, run fused"),
            ("projector", "the multimodal embedder's projection is transformers' (its norm has no weight)"),
        ),
    ),
    # GLM-4V: GLM-4's sandwich layer (norms after attention and after the MLP too), one gate_up_proj; multimodal RoPE
    # built into cos and sin once per forward, rotating neighbour pairs on half of each head. Its vision blocks and
    # merger normalise with Glm4vRMSNorm, the language model's class, fused too.
    "glm4v": Family(
        "Glm4vText", fused_gate_up=True, rope_layout="interleaved_tables",
        names=(("RMSNorm", "Glm4vRMSNorm"), ("ForCausalLM", "Glm4vForConditionalGeneration")),
        left_alone=(
            ("vision tower", "the vision blocks' attention (2-D RoPE, apply_rotary_pos_emb_vision) and SwiGLU MLP with "
                             "biases run transformers' code; only their RMSNorms, the language model's class, are "
                             "fused"),
            ("projector", "the patch merger's convolution and MLP are transformers'"),
        ),
    ),
    # GLM-4.5V (glm4v_moe): GLM-4.5's layer (Llama's layout, rotate_half partial RoPE, shared and routed experts) under
    # GLM-4V's vision side, whose norms are a class of their own (Glm4vMoeRMSNorm, also the text model's final norm).
    "glm4v_moe": Family(
        "Glm4vMoeText", experts=True, add_norm=True, names=(("ForCausalLM", "Glm4vMoeForConditionalGeneration"),),
        left_alone=(
            ("vision tower", "the vision blocks (2-D RoPE, SwiGLU MLP with biases, Glm4vMoeRMSNorm) run transformers' "
                             "code: patch fuses the language model"),
            ("projector", "the patch merger's convolution and MLP are transformers'"),
        ),
    ),
    # Llama 3.2 Vision (mllama): Llama's self-attention layers with cross-attention layers between them, whose norms
    # (q and k norms too) and MLPs are the same classes, fused too; the decoder layers take the cross-attention's
    # inputs, so the add before the MLP's norm stays transformers'.
    "mllama": Family(
        "MllamaText",
        names=(("Attention", "MllamaTextSelfAttention"), ("ForCausalLM", "MllamaForConditionalGeneration")),
        left_alone=(
            ("vision tower", "its tiled ViT: LayerNorms, a GELU MLP without gate and no RoPE, which no fused piece "
                             "computes"),
            ("projector", "the multimodal projector: one linear layer"),
        ),
    ),
    # MuseGlimmer: Gemma-style sandwich layers ((1 + w) norms in fp32, MuseGlimmerTextCenteredRMSNorm), SwiGLU, RoPE;
    # its logits are scaled by the text config's output_multiplier, then soft-capped, in the fused loss too.
    "muse_glimmer": Family(
        "MuseGlimmerText", norm="gemma", act_attr="hidden_activation", text_softcap=True,
        in_place_norms=("input_layernorm", "pre_feedforward_layernorm"),
        names=(("RMSNorm", "MuseGlimmerTextCenteredRMSNorm"), ("ForCausalLM", "MuseGlimmerForConditionalGeneration")),
        left_alone=(
            ("MuseGlimmerRMSNorm", "the final norm (w in fp32) and the weightless q/k, embedding and perception norms "
                                   "are another class, left as they are"),
            ("vision tower", "its blocks (LayerNorms, GELU MLP, 2-D RoPE) run transformers' code"),
            ("projector", "the vision adapter's GELU MLP and projection are transformers'"),
        ),
    ),
    # Gemma 3 with images: its language model is Gemma3TextModel, gemma3_text's classes. Gemma3ForConditionalGeneration
    # applies no final_logit_softcapping (Gemma3ForCausalLM does), and neither does its fused loss.
    "gemma3": replace(
        _GEMMA3_TEXT, names=(("ForCausalLM", "Gemma3ForConditionalGeneration"),),
        left_alone=(
            ("vision tower", "SigLIP: LayerNorms, a GELU MLP without gate and no RoPE, which no fused piece computes"),
            ("projector", "Gemma3MultiModalProjector's pooling and projection are transformers' (its mm_soft_emb_norm, "
                          "a Gemma3RMSNorm, is fused)"),
        ),
    ),
    # PaliGemma with a Gemma text config (PaliGemma 1; PaliGemma 2's Gemma 2 text is refused, as LLaVA's of another
    # family), InternVL with a Qwen2 text config, SmolVLM with a Llama one: as LLaVA, the language model is built from
    # that text family's classes, which patching the vision-language type swaps for that family's models too.
    "paligemma": Family(
        "Gemma", norm="gemma", module="gemma", causal_lm_module="paligemma",
        names=(("ForCausalLM", "PaliGemmaForConditionalGeneration"),),
        left_alone=(
            ("vision tower", "SigLIP: LayerNorms, a GELU MLP without gate and no RoPE, which no fused piece computes"),
            ("projector", "PaliGemmaMultiModalProjector: one linear layer"),
        ),
    ),
    "internvl": Family(
        "Qwen2", add_norm=True, module="qwen2", causal_lm_module="internvl",
        names=(("ForCausalLM", "InternVLForConditionalGeneration"),),
        left_alone=(
            ("vision tower", "InternViT: LayerNorms (or its own RMSNorm), a GELU MLP without gate and no RoPE, which "
                             "no fused piece computes"),
            ("projector", "pixel shuffle, LayerNorm and a GELU MLP: no gated product to fuse"),
        ),
    ),
    "smolvlm": replace(
        _LLAMA, module="llama", causal_lm_module="smolvlm", names=(("ForCausalLM", "SmolVLMForConditionalGeneration"),),
        left_alone=(
            ("vision tower", "SigLIP: LayerNorms, a GELU MLP without gate and no RoPE, which no fused piece computes"),
            ("projector", "pixel shuffle and one linear layer"),
        ),
    ),
    # LLaVA with a Llama text config (LLaVA 1.5): its language model is a LlamaModel, built from llama's classes, which
    # patch("llava") therefore swaps for every Llama model built afterwards, as patch("llama") does. Its left_alone
    # describes CLIP's tower; a Pixtral tower has a row of its own, below, whose entry the report gives instead.
    "llava": replace(
        _LLAMA, module="llama", causal_lm_module="llava", names=(("ForCausalLM", "LlavaForConditionalGeneration"),),
        left_alone=(
            ("vision tower", "CLIP: LayerNorms, a quick-GELU MLP without gate and no RoPE, which no fused piece "
                             "computes"),
            ("projector", "LlavaMultiModalProjector: two linear layers around a GELU, no gated product to fuse"),
        ),
    ),
    # Pixtral's vision encoder (PixtralVisionModel: a LLaVA's vision_tower with a Pixtral vision_config, or a model by
    # itself). Llama's norm; a gated MLP on config.hidden_act (silu in the checkpoints, erf-GELU by the config's
    # default, which keeps transformers' MLP); a 2-D RoPE whose tables (patches, head_dim) hold each patch's height
    # and width angles in rotate_half's layout, applied with unsqueeze_dim=0: the fused kernel's (1, patches,
    # head_dim) tables, shared by the batch (the images are packed into one sequence). The layer names its norms
    # attention_norm and ffn_norm, each feeding projections only; ln_pre's output is the residual stream.
    "pixtral": Family(
        "Pixtral", vision_encoder=True, in_place_norms=("attention_norm", "ffn_norm"),
        left_alone=(
            ("vision tower", "Pixtral (its RMSNorms, gated MLP and 2-D RoPE fused): the patch convolution and the "
                             "residual adds (its layer is not written as Llama's) run transformers' code"),
        ),
    ),
}  # fmt: skip
"""Model types (``config.model_type``) that :func:`~liger_lab.hf.patch` supports."""


WITHOUT_ROW = {
    "llama4": "transformers' Llama4ForConditionalGeneration cannot run a forward in the version installed (it reads "
    "image_outputs from its language model's output, which has none: AttributeError on every call), so there is no "
    "reference to hold a fused model to; its language model is a Llama4ForCausalLM: patch that one "
    "(liger_lab.patch(model.language_model)) or the model type 'llama4_text'",
}
"""Model types of Liger-Kernel's list that have no row here, and why: :func:`family_row` says so instead of a bare
"not supported"."""


def family_row(model_type: object) -> Family:
    if model_type in WITHOUT_ROW:
        raise ValueError(f"model type {model_type!r} is not supported: {WITHOUT_ROW[model_type]}")
    if model_type not in FAMILIES:
        raise ValueError(f"model type {model_type!r} is not supported: expected one of {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def _import_modeling(module: str) -> types.ModuleType:
    return importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def modeling_of(model_type: str) -> types.ModuleType:
    """The modeling module that holds a family's pieces."""
    return _import_modeling(FAMILIES[model_type].module or model_type if model_type in FAMILIES else model_type)


def causal_lm_modeling(model_type: str) -> types.ModuleType:
    """The modeling module that holds a family's causal LM: the pieces' (:func:`modeling_of`) or
    ``causal_lm_module``."""
    module = FAMILIES[model_type].causal_lm_module
    return modeling_of(model_type) if module is None else _import_modeling(module)


@dataclass(frozen=True)
class Options:
    """The options of one :func:`~liger_lab.hf.patch` call: its keywords, which the piece kinds name."""

    rms_norm: bool
    rope: bool
    swiglu: bool
    cross_entropy: bool
    fused_linear_cross_entropy: bool
    loss_chunk_tokens: int | None

    @property
    def loss(self) -> bool:
        return self.cross_entropy or self.fused_linear_cross_entropy
