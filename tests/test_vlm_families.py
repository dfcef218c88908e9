"""The vision-language families (every row of tests/tiny_vlms.py's CONFIGS) on batches with images:
a training step gives transformers' loss and every gradient, the vision tower's and the projector's included;
greedy ``generate`` with the cache gives its tokens; the patch report says what of the language model runs fused and
what of the vision side is left alone; the per-layer RoPE of Qwen's multimodal models is liger_lab.rope's; PEFT
LoRA on the language model reaches the fused pieces; ``unpatch`` gives the model back exactly. The runs over every
family on text alone (norm rounding, half precision, every piece's kernel) are tests/test_patching_safety.py's."""

import copy
import gc
import io

import pytest
import torch
from helpers import OpCalls
from test_patching import (  # noqa: F401  (fused_calls: a fixture)
    GRAD_TOL,
    LOSS_TOL,
    assert_lora_head_fused,
    fused_calls,
    lora_model,
    tiny_model,
)
from tiny_vlms import CONFIGS, MIXTURES_OF_EXPERTS, PIXTRAL, TEXT, image_batch, tiny_vlm

import liger_lab
from liger_lab import hf, runtime
from liger_lab.hf.families import modeling_of
from liger_lab.hf.registry import original_of
from liger_lab.ops import rope as rope_ops
from liger_lab.workbook.checks import relative_l2_error

transformers = pytest.importorskip("transformers")

VLMS = sorted(CONFIGS)

RMSNORM, MLP, ROPE, ADD = "RMSNorm", "gated MLP (SwiGLU/GeGLU)", "attention (RoPE)", "residual add into RMSNorm"
LOSS, VISION = "loss (fused linear cross-entropy)", "(vision tower, projector)"
VISION_RMSNORM, VISION_MLP, VISION_ROPE = (f"{kind} {VISION}" for kind in (RMSNORM, MLP, ROPE))
# Per family: the kinds fused. Qwen2.5-VL's vision blocks and patch merger, and Gemma 3's projector, normalise with the
# language model's RMSNorm class; a Pixtral tower (the pixtral row's, in a LLaVA) is fused by a row of its own; every
# other module of the vision side is transformers'.
REPORTS = {
    "qwen2_5_vl": {RMSNORM, MLP, ROPE, ADD, LOSS, VISION_RMSNORM},
    "qwen3_vl": {RMSNORM, MLP, ROPE, ADD, LOSS},
    "gemma3": {RMSNORM, MLP, ROPE, LOSS, VISION_RMSNORM},
    "llava": {RMSNORM, MLP, ROPE, ADD, LOSS},
    "qwen2_vl": {RMSNORM, MLP, ROPE, ADD, LOSS},
    "qwen3_vl_moe": {RMSNORM, MLP, ROPE, ADD, LOSS, "MoE experts (SwiGLU)"},
    "qwen3_5": {RMSNORM, MLP, ROPE, LOSS},
    "qwen3_5_moe": {RMSNORM, MLP, ROPE, LOSS, "MoE experts (SwiGLU)"},
    "gemma4": {RMSNORM, MLP, LOSS, "MoE experts (GeGLU)", VISION_RMSNORM},
    "paligemma": {RMSNORM, MLP, ROPE, LOSS},
    "internvl": {RMSNORM, MLP, ROPE, ADD, LOSS},
    "smolvlm": {RMSNORM, MLP, ROPE, ADD, LOSS},
    "glm4v": {RMSNORM, MLP, ROPE, LOSS, VISION_RMSNORM},
    "glm4v_moe": {RMSNORM, MLP, ROPE, ADD, LOSS, "MoE experts (SwiGLU)"},
    "mllama": {RMSNORM, MLP, ROPE, LOSS},
    "muse_glimmer": {RMSNORM, MLP, ROPE, LOSS},
    "pixtral": {RMSNORM, MLP, ROPE, ADD, LOSS, VISION_RMSNORM, VISION_MLP, VISION_ROPE},
}
# The fused classes of the vision side: the language model's norm class, or a vision encoder's own row's pieces.
VISION_SIDE_FUSED = {"FusedQwen2_5_VLRMSNorm", "FusedGemma3RMSNorm", "FusedGemma4RMSNorm", "FusedGlm4vRMSNorm",
                     "FusedPixtralRMSNorm", "FusedPixtralMLP", "FusedPixtralAttention"}  # fmt: skip


@pytest.fixture(autouse=True)
def _no_patched_models_left_over():
    gc.collect()
    yield


def vlm(model_type: str, **text_overrides) -> transformers.PreTrainedModel:
    """The family's tiny model with random norm weights (tests/test_patching.py's), every parameter trained: with
    images the vision tower and the projector get gradients too."""
    return tiny_model(model_type, **text_overrides).requires_grad_(True)


def training_step(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


def assert_same_gradients(ours: dict, theirs: dict) -> None:
    """Every gradient as transformers' (the parameters without one, the same: LLaVA's last CLIP layer, whose output
    no feature reads, and SigLIP's pooling head, which Gemma 3 does not use)."""
    assert ours.keys() == theirs.keys()
    assert {name for name, grad in ours.items() if grad is None} == {name for name, g in theirs.items() if g is None}
    for name, grad in ours.items():
        # An absolute floor for the gradients that are zero but for rounding (CLIP's key bias: softmax ignores it).
        if grad is not None:
            assert (grad - theirs[name]).norm() <= GRAD_TOL * theirs[name].norm() + 1e-6, name


@pytest.mark.parametrize("model_type", VLMS)
def test_training_step_with_images_matches_transformers(model_type):
    """The loss (normalised by the Trainer's num_items_in_batch), every gradient, and the output of the conditional
    generation's own class with its image features; in eval mode the logits."""
    reference = vlm(model_type)
    model = liger_lab.patch(copy.deepcopy(reference))
    batch = image_batch(reference)
    num_items = (batch["labels"][:, 1:] != -100).sum()
    ours, our_grads = training_step(model, batch, num_items_in_batch=num_items)
    theirs, their_grads = training_step(reference, batch, num_items_in_batch=num_items)
    assert ours.logits is None and type(ours) is type(theirs) and ours.image_outputs is not None
    assert relative_l2_error(ours.loss, theirs.loss) < LOSS_TOL, (ours.loss.item(), theirs.loss.item())
    assert_same_gradients(our_grads, their_grads)
    vision = [g for name, g in their_grads.items() if g is not None and "vis" in name and name.endswith("weight")]
    assert vision and all(grad.norm() > 0 for grad in vision)  # the images reach the loss
    with torch.no_grad():
        logits = [each.eval()(**batch).logits for each in (model, reference)]
    assert relative_l2_error(*logits) < 1e-5
    liger_lab.unpatch(model)


@pytest.mark.parametrize("model_type", VLMS)
def test_greedy_generation_with_images_matches_transformers(model_type):
    """Three greedy tokens from a prompt with an image, decoded from the cache (Qwen's 3-D positions continue from
    the image's rope deltas): the same tokens and the same logits at every step."""
    reference = vlm(model_type).eval()
    model = liger_lab.patch(copy.deepcopy(reference))
    batch = image_batch(reference)
    del batch["labels"]
    settings = dict(max_new_tokens=3, do_sample=False, use_cache=True, return_dict_in_generate=True,
                    output_logits=True, pad_token_id=0, eos_token_id=None)  # fmt: skip
    with torch.no_grad():
        ours, theirs = model.generate(**batch, **settings), reference.generate(**batch, **settings)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits, strict=True)):
        assert relative_l2_error(a, b) < 1e-5, f"step {step}"
    liger_lab.unpatch(model)


@pytest.mark.parametrize("model_type", VLMS)
def test_patch_report_names_the_vision_tower_and_projector_left_alone(model_type):
    model = liger_lab.patch(tiny_vlm(model_type))
    report = liger_lab.patch_report(model)
    assert set(report.replaced) == REPORTS[model_type]
    # besides the vision side, what the language model leaves alone (tests/test_families.py's reports say why)
    text = (
        ({"router"} if model_type in MIXTURES_OF_EXPERTS else set())
        | ({"gated RMSNorm"} if model_type.startswith("qwen3_5") else set())
        | ({"RoPE", "RMSNorm without weight"} if model_type == "gemma4" else set())
        | ({"MuseGlimmerRMSNorm"} if model_type == "muse_glimmer" else set())
    )
    assert set(report.left_alone) == {"vision tower", "projector", *text} and all(report.left_alone.values())
    assert "vision tower" in str(report)
    vision_side = [module for name, module in model.named_modules() if name.startswith("model.") and
                   not name.startswith(("model.language_model", "model.text_model"))]  # fmt: skip
    fused = {type(module).__name__ for module in vision_side if type(module).__name__.startswith("Fused")}
    assert fused <= VISION_SIDE_FUSED
    counted = sum(count for kind, count in report.replaced.items() if kind.endswith(VISION))
    assert counted == len([m for m in vision_side if type(m).__name__ in fused])


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "qwen2_vl", "qwen3_vl_moe"])
def test_multimodal_rope_of_the_text_layers_runs_the_fused_rope(monkeypatch, model_type):
    """transformers picks each feature pair's position stream (temporal, height, width) once per forward and hands
    every text attention layer (B, T, D) tables for the module's plain apply_rotary_pos_emb: the fused rope runs in
    each of them. The vision attention's apply_rotary_pos_emb_vision is never swapped."""
    tables = []
    fused = rope_ops.apply_rotary_pos_emb
    monkeypatch.setattr(rope_ops, "apply_rotary_pos_emb", lambda q, k, cos, sin, **kw: tables.append(cos.shape) or
                        fused(q, k, cos, sin, **kw))  # fmt: skip
    modeling = modeling_of(model_type)
    vision_rope = modeling.apply_rotary_pos_emb_vision
    model = liger_lab.patch(vlm(model_type, num_hidden_layers=2))
    batch = image_batch(model)
    with OpCalls() as calls:
        training_step(model, batch)
    batch_size, seq = batch["input_ids"].shape
    assert tables == [(batch_size, seq, model.config.text_config.head_dim)] * 2  # one per text layer
    assert {"rope", "rope_backward"} <= calls.ran() and "mrope" not in calls.ran()
    assert modeling.apply_rotary_pos_emb_vision is vision_rope
    liger_lab.unpatch(model)
    assert modeling.apply_rotary_pos_emb is original_of(modeling, "apply_rotary_pos_emb")


def test_lora_on_the_language_model_reaches_the_fused_pieces(fused_calls):  # noqa: F811
    """PEFT LoRA on Qwen2.5-VL's language model (q, v, gate, up, down; the vision blocks' MLP, whose projections have
    the same names, is not adapted) and on lm_head: the fused norms, RoPE, SwiGLU and head run on the adapted
    projections, and the step matches the unpatched PEFT model's."""
    layer = "language_model.layers.0"
    targets = [f"{layer}.self_attn.{name}" for name in ("q_proj", "v_proj")]
    targets += [f"{layer}.mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")]
    reference = lora_model(model=vlm("qwen2_5_vl"), target_modules=(*targets, "lm_head"))
    model = liger_lab.patch(copy.deepcopy(reference))
    batch = image_batch(reference.get_base_model())
    input_ids, labels = batch.pop("input_ids"), batch.pop("labels")
    with OpCalls() as calls:
        grads = assert_lora_head_fused(model, reference, fused_calls, input_ids, labels, **batch)
    assert {"rms_norm", "rope", "glu"} <= calls.ran()
    for target in targets:
        adapted = [grad for name, grad in grads.items() if f"{target}.lora_B." in name]
        assert len(adapted) == 1 and adapted[0].norm() > 0, target
    assert not any("visual" in name for name in grads)
    liger_lab.unpatch(model)


@pytest.mark.parametrize("model_type", VLMS)
def test_unpatch_restores_the_model_exactly(model_type):
    model = vlm(model_type).eval()
    modeling, family = modeling_of(model_type), hf.FAMILIES[model_type]
    rope_before = getattr(modeling, family.rope_function)
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = image_batch(model)
    with torch.no_grad():
        before = model(**batch).logits
    liger_lab.patch(model)
    assert (getattr(modeling, family.rope_function) is not rope_before) == family.rope and "forward" in model.__dict__
    liger_lab.unpatch(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert "forward" not in model.__dict__ and not any("in_place_backward" in vars(m) for m in model.modules())
    assert getattr(modeling, family.rope_function) is rope_before
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)


def test_a_hooked_final_norm_keeps_its_output():
    """The fused loss may write its backward over the hidden states it reads, the language model's final norm's
    output, unless something may have kept that output: a hook on the norm (under the base model's language_model in
    a vision-language model) sees it intact after the backward."""
    reference = vlm("llava")
    model = liger_lab.patch(copy.deepcopy(reference))
    batch = image_batch(reference)
    kept = []
    for each in (model, reference):
        each.model.language_model.norm.register_forward_hook(lambda module, args, output: kept.append(output))
        training_step(each, batch)
    assert relative_l2_error(*kept) < 1e-5
    liger_lab.unpatch(model)


def test_llava_patched_by_model_type():
    """LLaVA's pieces are Llama's classes (modeling_llama), its loss LlavaForConditionalGeneration's forward
    (modeling_llava): patching the family swaps both, and unpatching it puts both back."""
    llama, llava = modeling_of("llava"), transformers.models.llava.modeling_llava
    originals = {name: getattr(llama, name) for name in ("LlamaRMSNorm", "LlamaMLP", "LlamaAttention")}
    forward = llava.LlavaForConditionalGeneration.forward
    liger_lab.patch("llava")
    try:
        assert all(getattr(llama, name).__name__ == f"Fused{name}" for name in originals)
        assert llava.LlavaForConditionalGeneration.forward is not forward
        model = tiny_vlm("llava").train()
        assert liger_lab.patch_report(model).replaced.keys() == REPORTS["llava"]
        assert model(**image_batch(model)).logits is None  # the fused loss
    finally:
        liger_lab.unpatch("llava")
    assert all(getattr(llama, name) is original for name, original in originals.items())
    assert llava.LlavaForConditionalGeneration.forward is forward


def test_llava_with_a_language_model_of_another_family_is_refused():
    """LLaVA's row fuses Llama's classes: a LLaVA whose text config is Mistral's would run unfused, so patch says so."""
    model = tiny_vlm("llava", model_type="mistral")
    with pytest.raises(ValueError, match="language model of this 'llava' model is a 'mistral' model"):
        liger_lab.patch(model)
    assert hf.patch_report(model).replaced == {}


def test_a_patched_qwen2_5_vl_pickles_with_its_own_mlp_class():
    """Qwen2.5-VL's text MLP class is called Qwen2MLP, as Qwen2's is (another class, in modeling_qwen2): its fused
    class has a name of its own, which a pickle finds again."""
    model = liger_lab.patch(vlm("qwen2_5_vl"))
    mlp = type(model.model.language_model.layers[0].mlp)
    assert mlp.__name__ == "FusedQwen2MLP_qwen2_5_vl" and mlp.__bases__ == (modeling_of("qwen2_5_vl").Qwen2MLP,)
    assert hf.FusedQwen2MLP.__bases__ == (modeling_of("qwen2").Qwen2MLP,)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert type(loaded.model.language_model.layers[0].mlp) is mlp
    batch = image_batch(model)
    with torch.no_grad():
        assert relative_l2_error(loaded(**batch).loss, model(**batch).loss) < LOSS_TOL
    liger_lab.unpatch(loaded)
    assert type(loaded.model.language_model.layers[0].mlp) is modeling_of("qwen2_5_vl").Qwen2MLP
    liger_lab.unpatch(model)


# Pixtral's vision encoder: a row of its own (its model type is the tower's), fused inside a LLaVA (the runs over every
# family above) and by itself, here.


def tiny_pixtral(**overrides) -> transformers.PreTrainedModel:
    """A bare PixtralVisionModel of the pixtral row's tiny tower, its norm weights random as tiny_model's."""
    vision = {key: value for key, value in {**PIXTRAL, **overrides}.items() if key != "model_type"}
    model = transformers.PixtralVisionModel(transformers.PixtralVisionConfig(**vision, attn_implementation="eager"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.3)
    return model.to(runtime.DEVICE).train()


def encode(model, pixel_values, probe):
    """The tower's output on one image, and every gradient of a fixed projection of it."""
    model.zero_grad(set_to_none=True)
    out = model(pixel_values).last_hidden_state
    (out * probe).sum().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_a_bare_pixtral_vision_model_runs_its_pieces_on_the_fused_kernels():
    """patch(PixtralVisionModel): its norms, gated MLP and 2-D RoPE (tables of (patches, head_dim), unsqueezed in
    front by its attention: the kernel's tables shared by the batch) run the fused kernels, on one image of 2 x 3
    patches (height and width angles differ); the output and every gradient are transformers'; the report says what
    is fused and left alone (no loss: a vision encoder has none); unpatch gives back the classes and the RoPE."""
    reference = tiny_pixtral()
    model = liger_lab.patch(copy.deepcopy(reference))
    pixel_values = torch.randn(1, 3, 8, 12, device=runtime.DEVICE)
    probe = torch.randn(1, 6, PIXTRAL["hidden_size"], device=runtime.DEVICE)
    with OpCalls() as calls:
        ours, our_grads = encode(model, pixel_values, probe)
    theirs, their_grads = encode(reference, pixel_values, probe)
    ran = {name.rstrip("_") for name in calls.ran()}
    assert {"rms_norm", "rms_norm_backward", "glu", "rope", "rope_backward"} <= ran, ran
    assert relative_l2_error(ours, theirs) < 1e-5
    assert_same_gradients(our_grads, their_grads)
    report = liger_lab.patch_report(model)
    assert report.replaced == {RMSNORM: 5, MLP: 2, ROPE: 2} and set(report.left_alone) == {"vision tower"}
    modeling = modeling_of("pixtral")
    liger_lab.unpatch(model)
    assert {type(m) for m in model.modules()} == {type(m) for m in reference.modules()}
    assert modeling.apply_rotary_pos_emb is original_of(modeling, "apply_rotary_pos_emb")


def test_pixtral_patched_by_model_type():
    """patch("pixtral") swaps its norm, MLP and attention classes and its apply_rotary_pos_emb (there is no forward
    to wrap): a tower built then is fused; unpatch("pixtral") puts them back. patch("llava") leaves a Pixtral tower
    alone, and the report says so."""
    modeling = modeling_of("pixtral")
    originals = {name: getattr(modeling, name) for name in ("PixtralRMSNorm", "PixtralMLP", "PixtralAttention")}
    rope, forward = modeling.apply_rotary_pos_emb, modeling.PixtralVisionModel.forward
    liger_lab.patch("pixtral")
    try:
        assert all(getattr(modeling, name).__name__ == f"Fused{name}" for name in originals)
        assert modeling.apply_rotary_pos_emb is not rope and modeling.PixtralVisionModel.forward is forward
        assert liger_lab.patch_report(tiny_pixtral()).replaced == {RMSNORM: 5, MLP: 2, ROPE: 2}
    finally:
        liger_lab.unpatch("pixtral")
    assert all(getattr(modeling, name) is original for name, original in originals.items())
    assert modeling.apply_rotary_pos_emb is rope
    liger_lab.patch("llava")  # Llama's classes and LLaVA's loss: the report says the tower was not patched
    try:
        report = liger_lab.patch_report(tiny_vlm("pixtral"))
        assert report.left_alone["vision tower"].startswith("Pixtral, not patched")
        assert VISION_MLP not in report.replaced and MLP in report.replaced
    finally:
        liger_lab.unpatch("llava")


def test_a_pixtral_tower_of_erf_gelu_keeps_transformers_mlp_and_says_so():
    """Pixtral's config defaults to erf-GELU, which no fused kernel computes: the tower's MLP stays transformers'
    (with a warning, and a line of the report), its norms and RoPE are fused, and the step is transformers'."""
    config = CONFIGS["pixtral"](TEXT, hidden_act="gelu")
    reference = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
    reference = reference.to(runtime.DEVICE).train()
    with pytest.warns(UserWarning, match="activation 'gelu': PixtralMLP stays as it is"):
        model = liger_lab.patch(copy.deepcopy(reference))
    report = liger_lab.patch_report(model)
    assert report.left_alone["vision tower MLP"] == "activation 'gelu' has no fused kernel"
    assert VISION_MLP not in report.replaced and {VISION_RMSNORM, VISION_ROPE} <= set(report.replaced)
    assert all(type(layer.feed_forward) is modeling_of("pixtral").PixtralMLP
               for layer in model.model.vision_tower.transformer.layers)  # fmt: skip
    batch = image_batch(reference)
    ours, our_grads = training_step(model, batch)
    theirs, their_grads = training_step(reference, batch)
    assert relative_l2_error(ours.loss, theirs.loss) < LOSS_TOL
    assert_same_gradients(our_grads, their_grads)
    liger_lab.unpatch(model)
