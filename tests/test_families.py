"""The newer families (Qwen3.5, Qwen3.5-MoE, Gemma 4, GPT-OSS, Llama 4, OLMo 3, Ministral 3, DeepSeek-V3, GLM-4.5)
beyond the training step that tests/test_patching.py and tests/test_patching_safety.py check for every family: greedy
``generate`` with the cache gives transformers' tokens and logits; the patch report says what each family fuses and
what it leaves to transformers; Gemma 4 patched by model type (its classes are named two ways, and some of its norms
have no weight); LoRA on a mixture of experts' 3-D expert weights reaches the fused SwiGLU."""

import copy
import gc

import pytest
import torch
from helpers import OpCalls
from test_patching import (  # noqa: F401  (fused_calls: a fixture)
    LOSS_TOL,
    VOCAB,
    assert_lora_head_fused,
    batch,
    fused_calls,
    lora_model,
    tiny_model,
)

import liger_lab
from liger_lab import hf, runtime
from liger_lab.hf.families import modeling_of
from liger_lab.workbook.checks import relative_l2_error

transformers = pytest.importorskip("transformers")

NEW_FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "gemma4_text", "gpt_oss", "llama4_text", "olmo3", "ministral3",
                "deepseek_v3", "glm4_moe", "ministral", "exaone4", "hunyuan_v1_dense", "hunyuan_v1_moe", "qwen3_next",
                "deepseek_v2", "deepseek_v4", "falcon_h1", "nemotron"]  # fmt: skip

RMSNORM, MLP, ROPE, ADD = "RMSNorm", "gated MLP (SwiGLU/GeGLU)", "attention (RoPE)", "residual add into RMSNorm"
LOSS = "loss (fused linear cross-entropy)"
# Per family, on its tiny model: the kinds fused, and the pieces left alone (each with a reason in the report).
REPORTS = {
    "qwen3_5_text": ({RMSNORM, MLP, ROPE, LOSS}, {"gated RMSNorm"}),
    "qwen3_5_moe_text": ({RMSNORM, MLP, ROPE, "MoE experts (SwiGLU)", LOSS}, {"gated RMSNorm", "router"}),
    "gemma4_text": ({RMSNORM, MLP, "MoE experts (GeGLU)", LOSS}, {"RoPE", "RMSNorm without weight", "router"}),
    "gpt_oss": ({RMSNORM, ROPE, LOSS}, {"experts", "router", "MLP"}),
    "llama4_text": ({RMSNORM, MLP, ROPE, LOSS}, {"experts", "qk_norm", "router"}),
    "olmo3": ({RMSNORM, MLP, ROPE, LOSS}, set()),
    "ministral3": ({RMSNORM, MLP, ROPE, ADD, LOSS}, set()),
    "deepseek_v3": ({RMSNORM, MLP, ADD, "MoE experts (SwiGLU)", LOSS}, {"RoPE", "router"}),
    "glm4_moe": ({RMSNORM, MLP, ROPE, ADD, "MoE experts (SwiGLU)", LOSS}, {"router"}),
    "ministral": ({RMSNORM, MLP, ROPE, ADD, LOSS}, set()),
    "exaone4": ({RMSNORM, MLP, ROPE, LOSS}, set()),
    "hunyuan_v1_dense": ({RMSNORM, MLP, ROPE, ADD, LOSS}, set()),
    "hunyuan_v1_moe": ({RMSNORM, MLP, ROPE, ADD, "MoE experts (SwiGLU)", LOSS}, {"router"}),
    "qwen3_next": ({RMSNORM, MLP, ROPE, "MoE experts (SwiGLU)", LOSS}, {"gated RMSNorm", "router"}),
    "deepseek_v2": ({RMSNORM, MLP, ROPE, ADD, "MoE experts (SwiGLU)", LOSS}, {"router"}),
    "deepseek_v4": ({RMSNORM, LOSS}, {"MLP", "experts", "RoPE", "unweighted RMSNorm", "router"}),
    "falcon_h1": ({RMSNORM, ROPE, LOSS}, {"MLP", "Mamba mixer"}),
    "nemotron": ({"LayerNorm (1 + w)", ROPE, LOSS}, {"MLP"}),
}


@pytest.fixture(autouse=True)
def _no_patched_models_left_over():
    gc.collect()
    yield


@pytest.mark.parametrize("model_type", NEW_FAMILIES)
def test_greedy_generation_with_the_cache_matches_transformers(model_type):
    """Two greedy tokens in eval mode: the prompt's forward, then one token decoded from the cache (RoPE at an offset
    position, Qwen3.5's recurrent states, Gemma 4's per-layer inputs). The same tokens, and the same logits at both
    steps."""
    reference = tiny_model(model_type).eval()
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids = torch.randint(3, VOCAB, (2, 6), device=runtime.DEVICE)  # no pad, bos or eos token
    settings = dict(max_new_tokens=2, do_sample=False, use_cache=True, return_dict_in_generate=True,
                    output_logits=True, pad_token_id=0, eos_token_id=None)  # fmt: skip
    with torch.no_grad():
        ours, theirs = model.generate(input_ids, **settings), reference.generate(input_ids, **settings)
    assert torch.equal(ours.sequences, theirs.sequences)
    for step, (a, b) in enumerate(zip(ours.logits, theirs.logits, strict=True)):
        assert relative_l2_error(a, b) < 1e-5, f"step {step}"
    liger_lab.unpatch(model)


def test_patch_report_says_what_each_new_family_fuses_and_leaves_alone():
    assert set(REPORTS) == set(NEW_FAMILIES) and set(NEW_FAMILIES) <= set(hf.FAMILIES)
    for model_type, (replaced, left_alone) in REPORTS.items():
        report = liger_lab.patch_report(liger_lab.patch(tiny_model(model_type)))
        assert set(report.replaced) == replaced, model_type
        assert set(report.left_alone) == left_alone and all(report.left_alone.values()), model_type


def test_a_family_s_own_reason_for_its_mlp_is_the_report_s():
    """Falcon-H1's, DeepSeek-V4's and Nemotron's MLPs are dense, but compute otherwise: the report gives their rows'
    reasons."""
    for model_type in ("falcon_h1", "deepseek_v4", "nemotron"):
        report = liger_lab.patch_report(liger_lab.patch(tiny_model(model_type)))
        assert report.left_alone["MLP"] == dict(hf.FAMILIES[model_type].left_alone)["MLP"]


def test_gemma4_patched_by_model_type():
    """Patching the family swaps Gemma4RMSNorm and Gemma4ForCausalLM beside the Gemma4Text... classes; its norms
    without a weight (v_norm, the router's) are of the fused class then, and run transformers' forward."""
    modeling = modeling_of("gemma4_text")
    names = ("Gemma4RMSNorm", "Gemma4TextMLP", "Gemma4TextExperts")
    originals = {name: getattr(modeling, name) for name in names}
    forward = modeling.Gemma4ForCausalLM.forward
    reference = tiny_model("gemma4_text").eval()
    instance_report = liger_lab.patch_report(liger_lab.patch(copy.deepcopy(reference)))
    liger_lab.patch("gemma4_text")
    try:
        assert all(getattr(modeling, name).__name__ == f"Fused{name}" for name in names)
        assert modeling.Gemma4ForCausalLM.forward is not forward
        model = transformers.AutoModelForCausalLM.from_config(reference.config, attn_implementation="eager")
        model = model.to(runtime.DEVICE).eval()
        model.load_state_dict(reference.state_dict())
        v_norm = model.model.layers[0].self_attn.v_norm
        assert type(v_norm).__name__ == "FusedGemma4RMSNorm" and not hasattr(v_norm, "weight")
        input_ids, labels = batch()
        with torch.no_grad():
            ours = model(input_ids=input_ids, labels=labels, skip_logits=True)
            theirs = reference(input_ids=input_ids, labels=labels)
        assert ours.logits is None and relative_l2_error(ours.loss, theirs.loss) < LOSS_TOL
        # The norms without weight count as left alone, patched either way.
        assert liger_lab.patch_report(model).replaced == instance_report.replaced
    finally:
        liger_lab.unpatch("gemma4_text")
    assert all(getattr(modeling, name) is original for name, original in originals.items())
    assert modeling.Gemma4ForCausalLM.forward is forward


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")  # PEFT's own
def test_lora_on_the_experts_3d_weights_reaches_the_fused_swiglu(fused_calls):  # noqa: F811
    """GLM-4.5 under PEFT LoRA on every projection (the dense layer's MLP and the shared experts included), on the
    routed experts' 3-D gate_up_proj and down_proj (target_parameters), and on lm_head: the fused experts loop reads
    the adapted weights, and the step matches the unpatched PEFT model's."""
    reference = lora_model(
        "glm4_moe",
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"),
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = liger_lab.patch(copy.deepcopy(reference))
    assert liger_lab.patch_report(model).replaced["MoE experts (SwiGLU)"] == 1
    with OpCalls() as calls:
        grads = assert_lora_head_fused(model, reference, fused_calls, *batch())
    experts_lora = [name for name in grads if ".experts." in name and ".lora_" in name]
    assert len(experts_lora) == 4 and all(grads[name].norm() > 0 for name in experts_lora)
    # The dense layer's MLP, the shared experts, and the routed experts that got tokens.
    assert calls.counts["liger_lab::glu"] > 2
    liger_lab.unpatch(model)
