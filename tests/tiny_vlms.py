"""Tiny random vision-language models (built from configs, nothing downloaded) and batches with images for them.

Each batch is made by hand as the model's processor would make it: the image's placeholder tokens in the text (with
the markers around them that the model's chat format puts there), the pixel values in the layout the vision tower
reads, and the extra ids the model needs (Qwen's image grid and modality ids, Gemma 3's token types). Every tiny
vision tower turns an image into :data:`IMAGE_TOKENS` tokens of the language model.

The special tokens sit above the first :data:`TEXT_TOKENS` ids, from which the text of a batch is drawn, also the
text-only batches of ``tests/test_patching.py``: there the models run their language model alone.
"""

import torch
import transformers

from liger_lab import runtime

TEXT_TOKENS = 101
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
IMAGE_TOKENS = 4

# The language model: the size of tests/test_patching.py's tiny text models, with room for the special tokens.
TEXT = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    initializer_range=0.2,
)  # fmt: skip
# A 4 x 4 grid of 2 x 2 patches, merged 2 x 2 into four tokens (one frame: temporal_patch_size 1).
QWEN_VISION = dict(
    hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2, spatial_merge_size=2, temporal_patch_size=1,
    out_hidden_size=32,
)  # fmt: skip
QWEN_GRID = (1, 4, 4)
QWEN_TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
                   vision_end_token_id=VISION_END)  # fmt: skip
IMAGE_SIZE = 8  # Gemma 3's and LLaVA's square images, in pixels


def _qwen2_5_vl(text: dict) -> transformers.PreTrainedConfig:
    # Multimodal RoPE over head_dim / 2 = 4 pairs: two temporal, one height, one width. A windowed vision block and a
    # full-attention one.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    vision = dict(QWEN_VISION, depth=2, window_size=4, fullatt_block_indexes=[1])
    return transformers.Qwen2_5_VLConfig(text_config={"rope_parameters": rope, **text}, vision_config=vision,
                                         **QWEN_TOKENS)  # fmt: skip


def _qwen3_vl(text: dict) -> transformers.PreTrainedConfig:
    # Interleaved multimodal RoPE (t h w t); learned vision positions for the 4 x 4 grid; one DeepStack merger, whose
    # features are added to the first layer's output.
    # Two text layers: the DeepStack features join the image's positions after the first, and only a later layer
    # carries them to the text positions that the loss counts.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    vision = dict(QWEN_VISION, depth=1, num_position_embeddings=16, deepstack_visual_indexes=[0])
    text = {"rope_parameters": rope, **text, "num_hidden_layers": max(2, text["num_hidden_layers"])}
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **QWEN_TOKENS)


def _qwen2_vl(text: dict) -> transformers.PreTrainedConfig:
    # Qwen2.5-VL's sections; a vision block of LayerNorms and an ungated MLP.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    vision = dict(depth=1, embed_dim=16, hidden_size=32, mlp_ratio=2, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=1)  # fmt: skip
    return transformers.Qwen2VLConfig(text_config={"rope_parameters": rope, **text}, vision_config=vision,
                                      **QWEN_TOKENS)  # fmt: skip


def _qwen3_vl_moe(text: dict) -> transformers.PreTrainedConfig:
    # Qwen3-VL's tiny model with a dense first layer and a mixture of experts after it (transformers' loop).
    config = _qwen3_vl(text)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[0])
    text = {**config.text_config.to_dict(), **moe}
    return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=config.vision_config.to_dict(),
                                         **QWEN_TOKENS)  # fmt: skip


# Qwen3.5's language model as tests/test_patching.py's qwen3_5_text: a linear-attention layer, then a full-attention
# one with partial RoPE (head_dim 8, half rotated: two pairs, temporal and height, interleaved).
_QWEN3_5_TEXT = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], partial_rotary_factor=0.5,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0],
                                      "mrope_interleaved": True})  # fmt: skip
_QWEN3_5_VISION = dict(QWEN_VISION, depth=1, num_position_embeddings=16)


def _qwen3_5(text: dict) -> transformers.PreTrainedConfig:
    return transformers.Qwen3_5Config(text_config={**text, **_QWEN3_5_TEXT}, vision_config=_QWEN3_5_VISION,
                                      **QWEN_TOKENS)  # fmt: skip


def _qwen3_5_moe(text: dict) -> transformers.PreTrainedConfig:
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24)
    return transformers.Qwen3_5MoeConfig(text_config={**text, **_QWEN3_5_TEXT, **moe}, vision_config=_QWEN3_5_VISION,
                                         **QWEN_TOKENS)  # fmt: skip


def _gemma4(text: dict) -> transformers.PreTrainedConfig:
    # Gemma 4's language model as tests/test_patching.py's gemma4_text (sliding and global layers, per-layer inputs,
    # experts beside the MLP); its vision encoder on a 4 x 4 grid of 2 x 2 patches, pooled 2 x 2 into four tokens.
    text = {**text, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
            "global_head_dim": 16, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": text["vocab_size"],
            "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24,
            "final_logit_softcapping": 2.0}  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, pooling_kernel_size=2, patch_size=2,
                  position_embedding_size=16)  # fmt: skip
    return transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=IMAGE,
                                     video_token_id=VIDEO, boi_token_id=VISION_START, eoi_token_id=VISION_END,
                                     audio_token_id=124, boa_token_id=125, eoa_token_index=126)  # fmt: skip


# SigLIP-like towers on 8 x 8 images of 2 x 2 patches (PaliGemma's of 4 x 4), each image four tokens of the language
# model once the projector has merged them.
_SIGLIP = dict(image_size=IMAGE_SIZE, patch_size=2, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
               num_attention_heads=2)  # fmt: skip


def _paligemma(text: dict) -> transformers.PreTrainedConfig:
    # PaliGemma with a Gemma text config: SigLIP, then one linear projection.
    return transformers.PaliGemmaConfig(text_config={"model_type": "gemma", **text}, vision_config=dict(_SIGLIP,
                                        patch_size=4), image_token_index=IMAGE, projection_dim=32)  # fmt: skip


def _internvl(text: dict) -> transformers.PreTrainedConfig:
    # InternVL with a Qwen2 text config: InternViT, pixel shuffle by 0.5 (16 patches -> 4 tokens), a GELU MLP.
    return transformers.InternVLConfig(text_config={"model_type": "qwen2", **text}, vision_config=_SIGLIP,
                                       image_token_id=IMAGE, image_seq_length=IMAGE_TOKENS)  # fmt: skip


def _smolvlm(text: dict) -> transformers.PreTrainedConfig:
    # SmolVLM with a Llama text config: SigLIP, pixel shuffle by 2 (16 patches -> 4 tokens), a linear projection.
    return transformers.SmolVLMConfig(text_config={"model_type": "llama", **text}, vision_config=_SIGLIP,
                                      image_token_id=IMAGE, scale_factor=2)  # fmt: skip


def _glm4v(text: dict) -> transformers.PreTrainedConfig:
    # Half of each head rotated (two pairs: one temporal, one height); Qwen's grid of patches, merged 2 x 2.
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0], "partial_rotary_factor": 0.5}
    vision = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=1, out_hidden_size=32, image_size=8)  # fmt: skip
    return transformers.Glm4vConfig(text_config={"rope_parameters": rope, **text}, vision_config=vision,
                                    image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=VISION_START,
                                    image_end_token_id=VISION_END)  # fmt: skip


def _glm4v_moe(text: dict) -> transformers.PreTrainedConfig:
    # GLM-4V's tiny model with GLM-4.5's layers: a dense first layer, then shared and routed experts.
    config = _glm4v(text)
    moe = dict(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=24, n_shared_experts=1)  # fmt: skip
    return transformers.Glm4vMoeConfig(text_config={**config.text_config.to_dict(), **moe},
                                       vision_config=config.vision_config.to_dict(), image_token_id=IMAGE,
                                       video_token_id=VIDEO, image_start_token_id=VISION_START,
                                       image_end_token_id=VISION_END)  # fmt: skip


def _mllama(text: dict) -> transformers.PreTrainedConfig:
    # A self-attention layer, then a cross-attention one reading the image; a tiled ViT of up to two 8 x 8 tiles.
    text = {**text, "num_hidden_layers": 2, "cross_attention_layers": [1]}
    vision = dict(hidden_size=16, num_hidden_layers=1, num_global_layers=1, attention_heads=2, intermediate_size=24,
                  vision_output_dim=32, image_size=IMAGE_SIZE, patch_size=4, max_num_tiles=2,
                  intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1], [1, 2]])  # fmt: skip
    return transformers.MllamaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE)


def _muse_glimmer(text: dict) -> transformers.PreTrainedConfig:
    # Qwen's grid of 2 x 2 patches merged 2 x 2; a sliding and a global layer; logits scaled by 0.5, then capped at 2.
    text = {
        **text,
        "num_hidden_layers": 2,
        "sliding_window": 4,
        "final_logit_softcapping": 2.0,
        "output_multiplier": 0.5,
    }
    vision = dict(patch_size=2, patch_temporal=1, merge_size=2, hidden_size=16, num_attention_heads=2,
                  num_hidden_layers=1, intermediate_size=24, pos_emb_height=4, pos_emb_width=4,
                  max_position_embeddings=16)  # fmt: skip
    return transformers.MuseGlimmerConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                          video_token_id=VIDEO, out_hidden_size=64,
                                          projector_hidden_size=16)  # fmt: skip


def _gemma3(text: dict) -> transformers.PreTrainedConfig:
    # SigLIP on 4 x 4 patches, pooled to 2 x 2 tokens. The text config's final_logit_softcapping is one that
    # Gemma3ForConditionalGeneration does not apply: the fused loss must not either.
    vision = dict(image_size=IMAGE_SIZE, patch_size=2, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                  num_attention_heads=2)  # fmt: skip
    text = {"query_pre_attn_scalar": 8, "sliding_window": 4, "final_logit_softcapping": 2.0, **text}
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
                                     image_token_index=IMAGE, boi_token_index=VISION_START,
                                     eoi_token_index=VISION_END)  # fmt: skip


def _llava(text: dict) -> transformers.PreTrainedConfig:
    # CLIP on 2 x 2 patches of 4 pixels; the default feature strategy drops the class token: four image tokens.
    vision = dict(model_type="clip_vision_model", image_size=IMAGE_SIZE, patch_size=4, hidden_size=16,
                  intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, projection_dim=16)  # fmt: skip
    return transformers.LlavaConfig(text_config={"model_type": "llama", **text}, vision_config=vision,
                                    image_token_index=IMAGE, image_seq_length=IMAGE_TOKENS)  # fmt: skip


# Pixtral on 2 x 2 patches of 4 pixels (each image's four patches are its four tokens: LLaVA's projector merges none),
# head_dim 8 for its 2-D RoPE (two height and two width angles). Its features are every patch of the last layer, as
# Pixtral-12B's config asks. SiLU, the checkpoints' activation (the config's default is erf-GELU, with no fused kernel).
PIXTRAL = dict(model_type="pixtral", image_size=IMAGE_SIZE, patch_size=4, hidden_size=16, intermediate_size=24,
               num_hidden_layers=2, num_attention_heads=2, hidden_act="silu")  # fmt: skip


def _pixtral(text: dict, **vision) -> transformers.PreTrainedConfig:
    # LLaVA with a Llama text config and a Pixtral vision tower: the pixtral row's tiny model (the tower's own model
    # type is Pixtral's; the model's is LLaVA's).
    return transformers.LlavaConfig(text_config={"model_type": "llama", **text}, vision_config={**PIXTRAL, **vision},
                                    image_token_index=IMAGE, vision_feature_layer=-1,
                                    vision_feature_select_strategy="full")  # fmt: skip


CONFIGS = {
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "gemma3": _gemma3,
    "llava": _llava,
    "qwen2_vl": _qwen2_vl,
    "qwen3_vl_moe": _qwen3_vl_moe,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "gemma4": _gemma4,
    "paligemma": _paligemma,
    "internvl": _internvl,
    "smolvlm": _smolvlm,
    "glm4v": _glm4v,
    "glm4v_moe": _glm4v_moe,
    "mllama": _mllama,
    "muse_glimmer": _muse_glimmer,
    "pixtral": _pixtral,
}
"""The tiny config of each vision-language family, from the language model's settings."""
MIXTURES_OF_EXPERTS = ("qwen3_vl_moe", "qwen3_5_moe", "gemma4", "glm4v_moe")


def tiny_vlm(model_type: str, /, *, text_only: bool = False, **text_overrides) -> transformers.PreTrainedModel:
    """A random ``...ForConditionalGeneration`` of the family, its language model changed by ``text_overrides``.
    ``text_only`` freezes what a batch without images leaves without gradients, all but the language model and the
    head: for tests that compare the gradient of every parameter that requires one on text alone."""
    config = CONFIGS[model_type]({**TEXT, **text_overrides})
    # A mixture of experts runs transformers' loop over the experts, the one fused (its kernels stay as they are).
    experts = {"experts_implementation": "eager"} if model_type in MIXTURES_OF_EXPERTS else {}
    model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager", **experts)
    if model_type == "gemma3":
        # Gemma 3 starts its projection at zero (a checkpoint overwrites it), which would leave the vision tower
        # without gradients.
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, TEXT["initializer_range"])
    if model_type == "mllama":
        # Mllama's gates start shut (tanh(0) = 0: a checkpoint opens them): the cross-attention layers', the vision
        # encoder's global layers' and its tile and position embeddings'. Shut, they keep parts of the image's path
        # without gradients.
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "gate" in name.rpartition(".")[2]:
                    parameter.fill_(0.5)
    if text_only:
        model.requires_grad_(False)
        language_model = getattr(model.model, "language_model", None) or model.model.text_model  # SmolVLM's name
        language_model.requires_grad_(True)
        for layer in getattr(config.get_text_config(), "cross_attention_layers", None) or ():
            language_model.layers[layer].requires_grad_(False)  # Mllama's: without an image they are skipped
        model.lm_head.requires_grad_(True)
    return model.to(runtime.DEVICE)


def image_batch(model: transformers.PreTrainedModel, batch_size: int = 2, seq: int = 12) -> dict[str, torch.Tensor]:
    """``seq`` tokens per sequence, one image in each (its tokens from position 3 on), and the inputs the model reads
    for it: ``input_ids``, ``labels`` (the ids, with the image's tokens, its markers and the first sequence's prompt
    not trained on), ``pixel_values`` and the family's own."""
    model_type = model.config.model_type
    input_ids = torch.randint(3, TEXT_TOKENS, (batch_size, seq))
    image = slice(3, 3 + IMAGE_TOKENS)
    input_ids[:, image] = IMAGE
    if model_type != "llava":  # LLaVA's prompt holds the image tokens alone
        input_ids[:, image.start - 1], input_ids[:, image.stop] = VISION_START, VISION_END
    batch = {"input_ids": input_ids}
    if model_type in (
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen2_vl",
        "qwen3_vl_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "glm4v",
        "glm4v_moe",
    ):
        # The processor's flattened patches: one row of channels x temporal x patch x patch values per patch.
        patches = QWEN_GRID[0] * QWEN_GRID[1] * QWEN_GRID[2]
        batch["pixel_values"] = torch.randn(batch_size * patches, 3 * QWEN_VISION["patch_size"] ** 2)
        batch["image_grid_thw"] = torch.tensor([QWEN_GRID] * batch_size)
        batch["mm_token_type_ids"] = (input_ids == IMAGE).int()  # 1: image, for the 3-D positions
    elif model_type == "gemma4":
        # The processor's patches (channels x patch x patch values each) and each patch's (x, y) in the grid.
        side = torch.arange(4)
        grid = torch.stack(torch.meshgrid(side, side, indexing="xy"), dim=-1).reshape(16, 2)
        batch["pixel_values"] = torch.randn(batch_size, 16, 3 * 2 * 2)
        batch["image_position_ids"] = grid.expand(batch_size, -1, -1)
        batch["mm_token_type_ids"] = (input_ids == IMAGE).long()
    elif model_type == "muse_glimmer":  # Qwen's flattened patches and grid, without modality ids
        batch["pixel_values"] = torch.randn(batch_size * 16, 3 * 2 * 2)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * batch_size)
    elif model_type == "mllama":
        # One image of one tile in the first sequence, of two in the second; every text position sees the image.
        batch["pixel_values"] = torch.randn(batch_size, 1, 2, 3, IMAGE_SIZE, IMAGE_SIZE)
        batch["aspect_ratio_ids"] = torch.tensor([[1 + i % 2] for i in range(batch_size)])
        batch["aspect_ratio_mask"] = torch.tensor([[[1, i % 2]] for i in range(batch_size)])
        batch["cross_attention_mask"] = torch.ones(batch_size, seq, 1, 2, dtype=torch.long)
    elif model_type == "smolvlm":  # one image per sequence: (batch, images, channels, height, width)
        batch["pixel_values"] = torch.randn(batch_size, 1, 3, IMAGE_SIZE, IMAGE_SIZE)
    else:
        batch["pixel_values"] = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)
    if model.config.vision_config.model_type == "pixtral":  # each image's height and width, as its processor gives
        batch["image_sizes"] = torch.tensor([[IMAGE_SIZE, IMAGE_SIZE]] * batch_size)
    if model_type in ("gemma3", "paligemma"):
        batch["token_type_ids"] = (input_ids == IMAGE).long()  # 1: image, attended bidirectionally
    labels = input_ids.masked_fill(input_ids >= TEXT_TOKENS, -100)
    labels[0, :2] = -100
    batch["labels"] = labels
    return {name: value.to(runtime.DEVICE) for name, value in batch.items()}
