"""liger_lab.patch / unpatch on tiny random transformers models (built from configs, nothing downloaded).

Every check compares a patched model with an unpatched copy holding the same weights: the loss and
the gradient of every parameter, in fp32. Shapes are tiny because every kernel runs in Triton's
interpreter on CPU.
"""

import copy
import gc
import warnings

import pytest
import torch
from tiny_vlms import CONFIGS as VLM_CONFIGS
from tiny_vlms import tiny_vlm

import liger_lab
from liger_lab import hf, runtime
from liger_lab.hf.families import modeling_of
from liger_lab.hf.loss import _REPORTED_FALLBACKS
from liger_lab.hf.registry import original_of
from liger_lab.ops import fused_linear_cross_entropy as flce_ops
from liger_lab.ops import rope as rope_ops
from liger_lab.workbook.checks import relative_l2_error

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 101, 2, 8
LOSS_TOL = 1e-4
GRAD_TOL = 1e-3

# Qwen3.5's linear-attention layers at the tiny width.
LINEAR_ATTENTION = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                    "linear_value_head_dim": 8}  # fmt: skip

# Per family: what makes its tiny config exercise the family's peculiarities.
FAMILY_CONFIG = {
    "llama": {},
    "mistral": {"sliding_window": 4},
    "qwen2": {},
    "qwen3": {},  # q_norm / k_norm over head_dim before the rotary embedding
    "gemma": {},  # (1 + w) RMSNorm, GeGLU, tied embeddings
    "gemma2": {"final_logit_softcapping": 2.0, "query_pre_attn_scalar": 8, "sliding_window": 4},
    "phi3": {"partial_rotary_factor": 0.5},  # fused gate_up_proj, half the head dims rotate
    "gemma3_text": {"query_pre_attn_scalar": 8, "sliding_window": 4, "final_logit_softcapping": 2.0},
    # A mixture-of-experts layer, then a dense one (Qwen3MoeMLP). The experts run transformers' loop, which is what
    # gets the fused SwiGLU (its default grouped_mm kernel is left alone); the router stays transformers'.
    "qwen3_moe": {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                  "mlp_only_layers": [1], "experts_implementation": "eager"},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "experts_implementation": "eager"},  # no dense MLP
    "olmo2": {},  # norms after attention and MLP; q_norm / k_norm over all heads
    "granite": {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3,
                "logits_scaling": 4.0},
    "smollm3": {"num_hidden_layers": 2, "no_rope_layers": [1, 0]},  # the second layer has no RoPE
    "glm4": {"partial_rotary_factor": 0.5},  # interleaved RoPE on half of each head; fused gate_up_proj, post norms
    # A linear-attention (Gated DeltaNet) layer, which never calls apply_rotary_pos_emb, then a full-attention one.
    "qwen3_5_text": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                     "partial_rotary_factor": 0.5, **LINEAR_ATTENTION},
    "qwen3_5_moe_text": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                         "partial_rotary_factor": 0.5, **LINEAR_ATTENTION, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 24, "shared_expert_intermediate_size": 24,
                         "experts_implementation": "eager"},
    # Sliding and global layers (the global one with its own head_dim and partial RoPE), per-layer inputs, and the
    # MLP beside a mixture of experts in every layer (26B-A4B's layout).
    "gemma4_text": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
                    "global_head_dim": 16, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
                    "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24,
                    "experts_implementation": "eager", "final_logit_softcapping": 2.0},
    # Sliding and full layers; every layer a mixture of experts (left to transformers: clamped SwiGLU).
    "gpt_oss": {"num_hidden_layers": 2, "sliding_window": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
    # A dense layer with RoPE and chunked attention, then a mixture of experts without RoPE (temperature tuning).
    "llama4_text": {"num_hidden_layers": 2, "interleave_moe_layer_step": 2, "intermediate_size": 24,
                    "intermediate_size_mlp": 48, "num_local_experts": 4, "no_rope_layers": [1, 0],
                    "attention_chunk_size": 4, "floor_scale": 4},
    "olmo3": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    # Llama 4's query scaling starts at position original_max_position_embeddings: 4, inside the test's sequences.
    "ministral3": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                       "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}},
    # MLA (low-rank q and kv, one shared rope key head) over every head; a dense layer, then shared and routed
    # experts under group-limited routing.
    "deepseek_v3": {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_group": 2, "topk_group": 1, "moe_intermediate_size": 24, "kv_lora_rank": 16, "q_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4,
                    "experts_implementation": "eager"},
    "glm4_moe": {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 24, "use_qk_norm": True, "partial_rotary_factor": 0.5,
                 "experts_implementation": "eager"},
    "ministral": {"sliding_window": 4},
    "exaone4": {"num_hidden_layers": 2, "sliding_window": 4, "sliding_window_pattern": 2},  # a sliding layer, a global
    "hunyuan_v1_dense": {},  # q and k norms
    # Top-k routed experts, heavily compressed attention whose compressor fills windows within the test's sequences,
    # hyper-connections of 2 streams. (The sparse layers' indexer takes no gradient, and a hash-routed layer's router
    # one of rounding size: the tests compare every gradient.)
    "deepseek_v4": {"num_hidden_layers": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 24, "q_lora_rank": 16, "head_dim": 16, "num_key_value_heads": 1,
                    "o_groups": 2, "o_lora_rank": 8,
                    "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4, "sliding_window": 4, "hc_mult": 2,
                    "hc_sinkhorn_iters": 2, "num_nextn_predict_layers": 0, "experts_implementation": "eager",
                    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                    "mlp_layer_types": ["moe", "moe"]},
    # A small Mamba-2 mixer (its gated norm on) beside attention; muP multipliers that differ from 1, the logits' too.
    "falcon_h1": {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8, "mamba_chunk_size": 4,
                  "mamba_rms_norm": True, "mlp_multipliers": [1.5, 0.5], "lm_head_multiplier": 0.5,
                  "key_multiplier": 0.7, "attention_out_multiplier": 0.8, "embedding_multiplier": 1.3},
    "hunyuan_v1_moe": {"num_experts": 4, "moe_topk": 2, "experts_implementation": "eager"},
    "qwen3_next": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                   "partial_rotary_factor": 0.5, **LINEAR_ATTENTION, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 24, "shared_expert_intermediate_size": 24,
                   "experts_implementation": "eager"},
    "deepseek_v2": {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 24, "kv_lora_rank": 16,
                    "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                    "num_key_value_heads": 4, "experts_implementation": "eager"},
    # LayerNorm1P (1 + w, with bias), an MLP of squared ReLU without gate, RoPE on half of each head (its default).
    "nemotron": {},
}  # fmt: skip


@pytest.fixture(autouse=True)
def _no_patched_models_left_over():
    """Models patched by other tests in this process let go of shared swaps once collected."""
    gc.collect()
    yield


def tiny_config(model_type: str, **overrides):
    # initializer_range 0.2 (not 0.02) gives logits of order one, so a softcap or a wrong shift shows.
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, initializer_range=0.2,
    )  # fmt: skip
    return transformers.AutoConfig.for_model(model_type, **{**settings, **FAMILY_CONFIG[model_type], **overrides})


def tiny_model(model_type: str, **overrides):
    """A random causal LM whose norm weights are random too, so a wrong offset or casting shows."""
    if model_type in VLM_CONFIGS:  # a vision-language family (tests/tiny_vlms.py), run on text here
        model = tiny_vlm(model_type, text_only=True, **overrides)
    else:
        config = tiny_config(model_type, **overrides)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(runtime.DEVICE)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if hf.FAMILIES[model_type].norm == "gemma" else 1.0, 0.3)  # w or 1 + w
    return model.train()


def batch(vocab: int = VOCAB, batch_size: int = BATCH, seq: int = SEQ):
    input_ids = torch.randint(0, vocab, (batch_size, seq), device=runtime.DEVICE)
    labels = input_ids.clone()
    labels[0, :3] = -100  # a prompt whose tokens are not trained on
    return input_ids, labels


def loss_and_grads(model, input_ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def assert_same_training_step(patched, reference, input_ids, labels, **kwargs):
    ours, our_grads = loss_and_grads(patched, input_ids, labels, **kwargs)
    theirs, their_grads = loss_and_grads(reference, input_ids, labels, **kwargs)
    assert relative_l2_error(ours.loss, theirs.loss) < LOSS_TOL, (ours.loss.item(), theirs.loss.item())
    assert our_grads.keys() == their_grads.keys()
    for name, grad in our_grads.items():
        err = relative_l2_error(grad, their_grads[name])
        assert err < GRAD_TOL, f"grad {name}: rel L2 {err:.2e}"
    return ours, theirs


def fused_class_names(model) -> set[str]:
    return {type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused")}


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIG))
def test_every_family_trains_like_transformers(model_type):
    reference = tiny_model(model_type)
    model = liger_lab.patch(copy.deepcopy(reference))
    family = hf.FAMILIES[model_type]
    assert fused_class_names(model) == {f"Fused{family.name(piece)}" for piece in family.pieces}
    assert "forward" in model.__dict__
    ours, _ = assert_same_training_step(model, reference, *batch())
    assert ours.logits is None  # the fused loss never built them
    liger_lab.unpatch(model)


def test_router_load_balancing_loss_runs_transformers_forward_and_says_so():
    """Mixtral with output_router_logits adds the router's auxiliary loss, which the fused loss does not
    compute: the patched model runs transformers' loss (the same numbers) and warns, once."""
    reference = tiny_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.1)
    model = liger_lab.patch(copy.deepcopy(reference))
    _REPORTED_FALLBACKS.clear()
    with pytest.warns(UserWarning, match="materialises the logits.*load-balancing"):
        ours, _ = assert_same_training_step(model, reference, *batch())
    assert ours.aux_loss is not None and ours.logits is not None


def test_eval_mode_returns_logits_and_transformers_loss():
    reference = tiny_model("llama").eval()
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    with torch.no_grad():
        ours, theirs = model(input_ids=input_ids, labels=labels), reference(input_ids=input_ids, labels=labels)
    assert relative_l2_error(ours.logits, theirs.logits) < 1e-5
    assert relative_l2_error(ours.loss, theirs.loss) < LOSS_TOL
    liger_lab.unpatch(model)


def test_gradient_accumulation_normaliser_and_tuple_output():
    reference = tiny_model("gemma2")
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    # The Trainer passes the number of target tokens of the whole accumulated batch: sum / that count.
    num_items = torch.tensor(23)
    assert_same_training_step(model, reference, input_ids, labels, num_items_in_batch=num_items)
    out = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items, return_dict=False)
    assert isinstance(out, tuple) and out[0].ndim == 0
    liger_lab.unpatch(model)


def test_logits_on_request_and_logits_to_keep():
    reference = tiny_model("llama")
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    ours, theirs = assert_same_training_step(model, reference, input_ids, labels, skip_logits=False)
    assert relative_l2_error(ours.logits, theirs.logits) < 1e-5
    kept = model(input_ids=input_ids, logits_to_keep=3).logits
    assert kept.shape == (BATCH, 3, VOCAB)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=input_ids, labels=labels, logits_to_keep=3)
    with pytest.raises(ValueError, match="expected labels"):
        model(input_ids=input_ids, skip_logits=True)
    liger_lab.unpatch(model)


def test_shift_labels_and_ignore_index_are_honoured():
    reference = tiny_model("qwen2")
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, _ = batch()
    shift_labels = torch.roll(input_ids, -1, dims=1)
    shift_labels[:, -1] = 7  # 7 plays the ignored label here
    assert_same_training_step(model, reference, input_ids, input_ids, shift_labels=shift_labels, ignore_index=7)
    liger_lab.unpatch(model)


def test_cross_entropy_instead_of_the_fused_linear_loss():
    reference = tiny_model("gemma2")
    model = liger_lab.patch(copy.deepcopy(reference), cross_entropy=True, fused_linear_cross_entropy=False)
    ours, theirs = assert_same_training_step(model, reference, *batch())
    assert relative_l2_error(ours.logits, theirs.logits) < 1e-5  # softcapped like transformers'
    liger_lab.unpatch(model)


def test_options_choose_what_is_patched():
    model = liger_lab.patch(tiny_model("llama"), rms_norm=False, rope=False, swiglu=True,
                            fused_linear_cross_entropy=False)  # fmt: skip
    assert fused_class_names(model) == {"FusedLlamaMLP"}
    assert "forward" not in model.__dict__
    modeling = modeling_of("llama")
    assert modeling.apply_rotary_pos_emb is original_of(modeling, "apply_rotary_pos_emb")
    liger_lab.unpatch(model)


def test_unpatch_restores_the_model_exactly():
    model = tiny_model("qwen3").eval()
    modeling = modeling_of("qwen3")
    rope_before = modeling.apply_rotary_pos_emb
    classes = {name: type(m) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    input_ids, _ = batch()
    with torch.no_grad():
        before = model(input_ids=input_ids).logits

    liger_lab.patch(model)
    assert modeling.apply_rotary_pos_emb is not rope_before
    assert model.state_dict().keys() == state.keys()
    liger_lab.unpatch(model)

    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert "forward" not in model.__dict__ and not any("in_place_backward" in vars(m) for m in model.modules())
    assert modeling.apply_rotary_pos_emb is rope_before
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key])
    with torch.no_grad():
        assert torch.equal(model(input_ids=input_ids).logits, before)


def test_a_collected_patched_model_lets_go_of_the_rope_swap():
    modeling = modeling_of("llama")
    original = modeling.apply_rotary_pos_emb
    model = liger_lab.patch(tiny_model("llama"))
    assert modeling.apply_rotary_pos_emb is not original
    del model
    gc.collect()
    assert modeling.apply_rotary_pos_emb is original


def test_rope_stays_swapped_while_any_patched_model_holds_it():
    modeling = modeling_of("llama")
    original = modeling.apply_rotary_pos_emb
    first, second = liger_lab.patch(tiny_model("llama")), liger_lab.patch(tiny_model("llama"))
    liger_lab.unpatch(first)
    assert modeling.apply_rotary_pos_emb is not original
    liger_lab.unpatch(second)
    assert modeling.apply_rotary_pos_emb is original


def test_only_patched_models_run_the_fused_rope(monkeypatch):
    calls = []
    fused = rope_ops.apply_rotary_pos_emb
    monkeypatch.setattr(rope_ops, "apply_rotary_pos_emb", lambda *a, **k: calls.append(1) or fused(*a, **k))
    reference = tiny_model("llama", num_hidden_layers=2)
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, _ = batch()
    with torch.no_grad():
        reference(input_ids=input_ids)
        assert not calls  # the family's function is swapped, but this model's attention is transformers'
        model(input_ids=input_ids)
        assert len(calls) == 2  # one per layer
    liger_lab.unpatch(model)


def test_patching_by_model_type_patches_the_classes():
    modeling = modeling_of("llama")
    names = ("LlamaRMSNorm", "LlamaMLP", "LlamaAttention", "LlamaDecoderLayer", "apply_rotary_pos_emb")
    originals = {name: getattr(modeling, name) for name in names}
    forward = modeling.LlamaForCausalLM.forward
    reference = tiny_model("llama")
    liger_lab.patch("llama")
    try:
        assert modeling.LlamaRMSNorm.__name__ == "FusedLlamaRMSNorm"
        assert issubclass(modeling.LlamaMLP, originals["LlamaMLP"])
        assert modeling.LlamaForCausalLM.forward is not forward
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(reference.config).to(runtime.DEVICE).train()
        model.load_state_dict(reference.state_dict())
        assert fused_class_names(model) == {f"FusedLlama{piece}" for piece in hf.FAMILIES["llama"].pieces}
        assert "forward" not in model.__dict__  # the class forward already is the fused one
        ours, _ = assert_same_training_step(model, reference, *batch())
        assert ours.logits is None
    finally:
        liger_lab.unpatch("llama")
    assert all(getattr(modeling, name) is original for name, original in originals.items())
    assert modeling.LlamaForCausalLM.forward is forward


def test_peft_wrapped_model():
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], init_lora_weights=False
    )  # fmt: skip  (random B too, so every LoRA gradient is non-zero)
    reference = peft.get_peft_model(tiny_model("mistral"), lora)
    model = copy.deepcopy(reference)
    assert liger_lab.patch(model) is model
    assert fused_class_names(model) == {f"FusedMistral{piece}" for piece in hf.FAMILIES["mistral"].pieces}
    ours, _ = assert_same_training_step(model, reference, *batch())
    assert ours.logits is None
    liger_lab.unpatch(model)
    assert not fused_class_names(model)


def test_gradient_checkpointing():
    reference = tiny_model("llama")
    reference.gradient_checkpointing_enable()
    model = liger_lab.patch(copy.deepcopy(reference))
    assert_same_training_step(model, reference, *batch())
    liger_lab.unpatch(model)


def test_gemma2_norms_added_to_the_residual_never_reuse_their_gradient():
    model = liger_lab.patch(tiny_model("gemma2"))
    layer = model.model.layers[0]
    assert layer.input_layernorm.in_place_backward and layer.pre_feedforward_layernorm.in_place_backward
    assert not layer.post_attention_layernorm.in_place_backward
    assert not layer.post_feedforward_layernorm.in_place_backward
    assert not model.model.norm.in_place_backward
    liger_lab.unpatch(model)


def test_mlp_with_an_activation_without_kernel_is_left_alone():
    reference = tiny_model("llama", hidden_act="relu")
    model = copy.deepcopy(reference)
    with pytest.warns(UserWarning, match="relu"):
        liger_lab.patch(model)
    assert fused_class_names(model) == {"FusedLlamaRMSNorm", "FusedLlamaAttention", "FusedLlamaDecoderLayer"}
    assert_same_training_step(model, reference, *batch())
    liger_lab.unpatch(model)


def test_unsupported_models_raise():
    with pytest.raises(ValueError, match="expected one of .*'llama'"):
        liger_lab.patch("bert")
    with pytest.raises(ValueError, match="expected one of"):
        liger_lab.unpatch("gpt2")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        liger_lab.patch(gpt2)
    with pytest.raises(ValueError, match="PreTrainedModel"):
        liger_lab.patch(torch.nn.Linear(2, 2))
    # A model type with no row for a known reason says the reason and what to patch instead.
    with pytest.raises(ValueError, match="'llama4' is not supported: .*'llama4_text'"):
        liger_lab.patch("llama4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        liger_lab.unpatch(tiny_model("llama"))  # unpatching an unpatched model changes nothing


def test_patch_report_counts_what_was_fused_and_says_what_was_left_alone():
    model = tiny_model("llama")
    assert liger_lab.patch_report(model).left_alone["the whole model"].startswith("not patched")
    report = liger_lab.patch_report(liger_lab.patch(model))
    assert report.replaced == {
        "residual add into RMSNorm": 1, "attention (RoPE)": 1, "gated MLP (SwiGLU/GeGLU)": 1, "RMSNorm": 3,
        "loss (fused linear cross-entropy)": 1,
    }  # fmt: skip
    assert report.left_alone == {} and "RMSNorm" in str(report)
    glm = liger_lab.patch_report(liger_lab.patch(tiny_model("glm4")))
    assert "RoPE" not in glm.left_alone and glm.replaced["attention (RoPE)"] == 1  # interleaved, partial
    mixtral = liger_lab.patch_report(liger_lab.patch(tiny_model("mixtral")))
    assert mixtral.replaced["MoE experts (SwiGLU)"] == 1 and "mixture of experts" in mixtral.left_alone["MLP"]
    assert "routing" in mixtral.left_alone["router"]
    model.lm_head = torch.nn.Sequential(model.lm_head)  # what the fused loss cannot take is named
    assert "lm_head is a Sequential" in liger_lab.patch_report(model).left_alone["loss"]


def test_fused_residual_add_steps_aside_for_a_watched_norm():
    """The decoder layer runs the add before the MLP's norm in the norm's kernel; a forward hook on that norm
    (a recorder, FSDP2 gathering its weight) gets transformers' forward, and sees the norm's output."""
    reference = tiny_model("llama")
    model = liger_lab.patch(copy.deepcopy(reference))
    assert type(model.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"
    seen = []
    model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda *_: seen.append(1))
    assert_same_training_step(model, reference, *batch())
    assert seen == [1]


# ---------------------------------------------------------------------------------------------------
# A PEFT LoRA lm_head: its adapter's term joins the fused loss's product.

LORA_LOSS_TOL = 1e-5
LORA_GRAD_TOL = 1e-4


def lora_model(model_type: str = "llama", *, target_modules=("q_proj", "v_proj", "lm_head"), model=None, **lora):
    """A PEFT LoRA model around a tiny one, with random B (init_lora_weights=False), so that every LoRA gradient
    is non-zero and a LoRA term left out of the loss shows."""
    peft = pytest.importorskip("peft")
    settings = dict(r=4, lora_alpha=8, target_modules=list(target_modules), init_lora_weights=False)
    return peft.get_peft_model(model or tiny_model(model_type), peft.LoraConfig(**{**settings, **lora}))


@pytest.fixture
def fused_calls(monkeypatch):
    """The calls of the fused linear cross-entropy, each recorded as the ``chunk_tokens`` it was given (the list's
    length counts them)."""
    calls = []
    fused = flce_ops.fused_linear_cross_entropy
    monkeypatch.setattr(
        flce_ops,
        "fused_linear_cross_entropy",
        lambda *a, **k: calls.append(k.get("chunk_tokens")) or fused(*a, **k),
    )
    return calls


def train_step_loss(model) -> torch.Tensor:
    torch.manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 48), device=runtime.DEVICE)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach()


def test_the_models_loss_chunk_is_bounded_by_its_hidden_states(fused_calls, monkeypatch):
    # Without the work floor, which gives a model this small all its tokens in one chunk.
    monkeypatch.setattr(flce_ops, "MODEL_CHUNK_MIN_FLOPS", 0)
    model = liger_lab.patch(tiny_model("llama"))
    train_step_loss(model)
    dtype, vocab = model.lm_head.weight.dtype, model.config.vocab_size
    expected = flce_ops.chunk_tokens_in_model(2 * 48, model.config.hidden_size, vocab, dtype)
    assert fused_calls == [expected]
    assert expected < flce_ops.chunk_tokens_for(2 * 48, vocab, dtype)  # the model's bound is the smaller


def test_loss_chunk_tokens_sets_the_chunk_and_keeps_the_loss(fused_calls):
    reference = tiny_model("llama")
    default = train_step_loss(liger_lab.patch(copy.deepcopy(reference)))
    chunked = liger_lab.patch(copy.deepcopy(reference), loss_chunk_tokens=16)
    assert torch.allclose(train_step_loss(chunked), default, rtol=1e-5)
    assert train_step_loss(copy.deepcopy(chunked)) is not None  # a copy keeps its options
    assert fused_calls[1:] == [16, 16]
    try:  # the same option when the family is patched
        liger_lab.patch("llama", loss_chunk_tokens=24)
        train_step_loss(tiny_model("llama"))
        assert fused_calls[-1] == 24
    finally:
        liger_lab.unpatch("llama")


@pytest.mark.parametrize("bad", [0, -64, 1.5, True, "64"])
def test_loss_chunk_tokens_must_be_a_positive_count(bad):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        liger_lab.patch(model, loss_chunk_tokens=bad)
    assert hf.patch_report(model).replaced == {}  # nothing was patched


def fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "materialises the logits" in str(w.message)]


def assert_lora_head_fused(model, reference, fused_calls, *args, seed=None, head_weight="lm_head.lora_B", **kwargs):
    """One training step of the patched model matches the unpatched PEFT model's (each run after
    ``torch.manual_seed(seed)`` when given), with the fused loss run once, no fallback and a gradient for the head's
    trained weight (named by ``head_weight``); returns our gradients."""
    _REPORTED_FALLBACKS.clear()  # a warning given once per process shows here too
    fused_calls.clear()
    if seed is not None:
        torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours, our_grads = loss_and_grads(model, *args, **kwargs)
    assert len(fused_calls) == 1 and ours.logits is None
    assert not fallback_warnings(record)
    if seed is not None:
        torch.manual_seed(seed)
    theirs, their_grads = loss_and_grads(reference, *args, **kwargs)
    assert relative_l2_error(ours.loss, theirs.loss) < LORA_LOSS_TOL, (ours.loss.item(), theirs.loss.item())
    assert our_grads.keys() == their_grads.keys()
    for name, grad in our_grads.items():
        err = relative_l2_error(grad, their_grads[name])
        assert err < LORA_GRAD_TOL, f"grad {name}: rel L2 {err:.2e}"
    trained = next(name for name in our_grads if head_weight in name)
    assert their_grads[trained].norm() > 0  # the head's trained weight reaches the loss
    return our_grads


def test_lora_lm_head_runs_the_fused_loss(fused_calls):
    reference = lora_model()
    model = liger_lab.patch(copy.deepcopy(reference))
    assert liger_lab.patch_report(model).replaced["loss (fused linear cross-entropy)"] == 1
    input_ids, labels = batch()
    assert_lora_head_fused(model, reference, fused_calls, input_ids, labels)
    liger_lab.unpatch(model)


def test_lm_head_trained_as_a_peft_copy_runs_the_fused_loss(fused_calls):
    """``modules_to_save=["lm_head"]``: PEFT trains a copy of the head. The fused loss reads the copy PEFT's forward
    calls (the frozen original while adapters are disabled), and the report says the loss is fused."""
    reference = lora_model(target_modules=("q_proj",), modules_to_save=["lm_head"])
    model = liger_lab.patch(copy.deepcopy(reference))
    assert liger_lab.patch_report(model).replaced["loss (fused linear cross-entropy)"] == 1
    input_ids, labels = batch()
    assert_lora_head_fused(model, reference, fused_calls, input_ids, labels, head_weight="lm_head.modules_to_save")
    with torch.no_grad():  # the copy now differs from the original, so reading the wrong one shows
        for peft_model in (model, reference):
            peft_model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    assert_lora_head_fused(model, reference, fused_calls, input_ids, labels, head_weight="lm_head.modules_to_save")
    with model.disable_adapter(), reference.disable_adapter(), torch.no_grad():
        ours = model(input_ids=input_ids, labels=labels).loss
        theirs = reference(input_ids=input_ids, labels=labels).loss
    assert len(fused_calls) == 2 and relative_l2_error(ours, theirs) < LORA_LOSS_TOL
    liger_lab.unpatch(model)


def test_lora_lm_head_with_dropout(fused_calls):
    """The head's dropout draws its mask at the same point of the forward as PEFT's: seeded alike, the training
    steps match. In eval mode (the fused loss asked for with skip_logits) dropout is the identity."""
    reference = lora_model(lora_dropout=0.5)
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    grads = assert_lora_head_fused(model, reference, fused_calls, input_ids, labels, seed=1)
    other_grads = assert_lora_head_fused(model, reference, fused_calls, input_ids, labels, seed=2)
    head_a = "base_model.model.lm_head.lora_A.default.weight"
    assert relative_l2_error(other_grads[head_a], grads[head_a]) > 1e-2  # another seed, another mask
    model.eval(), reference.eval()
    assert_lora_head_fused(model, reference, fused_calls, input_ids, labels, skip_logits=True)
    liger_lab.unpatch(model)


def test_lora_lm_head_under_autocast(fused_calls):
    """Under bf16 autocast the fused loss runs on bf16 copies of [x, u] and [W, B], as PEFT's matmuls would."""
    reference = lora_model()
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    losses, head_grads = [], []
    for peft_model in (model, reference):
        peft_model.zero_grad(set_to_none=True)
        with torch.autocast(runtime.DEVICE.type, torch.bfloat16):
            loss = peft_model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        head_grads.append(peft_model.base_model.model.lm_head.lora_B.default.weight.grad)
    assert len(fused_calls) == 1
    assert relative_l2_error(*losses) < 1e-2 and relative_l2_error(*head_grads) < 5e-2
    liger_lab.unpatch(model)


def test_lora_lm_head_with_adapters_disabled_or_merged_is_its_base_layer(fused_calls):
    reference = lora_model()
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    _REPORTED_FALLBACKS.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with model.disable_adapter():
            ours = model(input_ids=input_ids, labels=labels).loss
        model.merge_adapter()
        merged = model(input_ids=input_ids, labels=labels).loss
    assert len(fused_calls) == 2 and not fallback_warnings(record)
    with reference.disable_adapter():
        theirs = reference(input_ids=input_ids, labels=labels).loss
    assert relative_l2_error(ours, theirs) < LORA_LOSS_TOL
    reference.merge_adapter()
    assert relative_l2_error(merged, reference(input_ids=input_ids, labels=labels).loss) < LORA_LOSS_TOL
    liger_lab.unpatch(model)


def two_active_adapters():
    model = lora_model()
    model.add_adapter("second", model.peft_config["default"])
    model.base_model.set_adapter(["default", "second"])
    return model


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: lora_model(use_dora=True), "adapter 'default' is a DoraLinearVariant, not plain LoRA"),
        (lambda: lora_model(lora_bias=True), "LoRA B has a bias"),
        (two_active_adapters, "2 LoRA adapters are active on lm_head"),
    ],
    ids=["dora", "lora_bias", "two_adapters"],
)
def test_a_lora_lm_head_the_fused_loss_cannot_take_materialises_the_logits_and_says_why(make, reason, fused_calls):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's own (a LoRA bias on a layer without one)
        reference = make()
    model = liger_lab.patch(copy.deepcopy(reference))
    assert reason in liger_lab.patch_report(model).left_alone["loss"]
    _REPORTED_FALLBACKS.clear()
    with pytest.warns(UserWarning, match="materialises the logits") as record:
        ours, _ = assert_same_training_step(model, reference, *batch())
    assert any(reason in message for message in fallback_warnings(record))
    assert not fused_calls and ours.logits is not None
    liger_lab.unpatch(model)


def test_a_batch_of_mixed_adapters_materialises_the_logits():
    """PEFT passes adapter_names (one adapter per sequence) to its layers through a forward pre-hook."""
    reference = lora_model()
    reference.add_adapter("second", reference.peft_config["default"])
    model = liger_lab.patch(copy.deepcopy(reference)).eval()
    input_ids, labels = batch()
    _REPORTED_FALLBACKS.clear()
    with torch.no_grad(), pytest.warns(UserWarning, match="forward pre-hook"):
        ours = model(input_ids=input_ids, labels=labels, adapter_names=["default", "second"], skip_logits=True)
    with torch.no_grad():
        theirs = reference.eval()(input_ids=input_ids, labels=labels, adapter_names=["default", "second"])
    assert relative_l2_error(ours.loss, theirs.loss) < LORA_LOSS_TOL
    liger_lab.unpatch(model)


# Per family: the projections that LoRA adapts besides lm_head (attention only where the MLP is a mixture of
# experts, whose fused 3-D expert weights are no modules).
LORA_TARGETS = {
    "gemma3_text": ("q_proj", "v_proj", "down_proj"),
    "qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "olmo2": ("q_proj", "v_proj", "down_proj"),
    "granite": ("q_proj", "v_proj", "down_proj"),
    "smollm3": ("q_proj", "v_proj", "down_proj"),
    "glm4": ("q_proj", "v_proj", "gate_up_proj", "down_proj"),
}


@pytest.mark.parametrize("model_type", sorted(LORA_TARGETS))
def test_lora_parity_of_the_newer_families(model_type, fused_calls):
    reference = lora_model(model_type, target_modules=(*LORA_TARGETS[model_type], "lm_head"))
    model = liger_lab.patch(copy.deepcopy(reference))
    grads = assert_lora_head_fused(model, reference, fused_calls, *batch())
    assert all(any(f".{target}.lora_B." in name for name in grads) for target in LORA_TARGETS[model_type])
    liger_lab.unpatch(model)


@pytest.mark.cuda
def test_lora_lm_head_fused_loss_peaks_lower_than_the_logits():
    """bf16 model, fp32 adapters (PEFT's default), a 32768-word vocabulary, 8192 tokens: the unpatched step holds
    the N x V logits (512 MiB in bf16) and fp32 copies of them; the fused one a V x (H + r) weight copy and its
    gradient (7 MiB) and one chunk of logits (at most the 256 MiB budget)."""
    vocab = 32768
    base = tiny_model("llama", vocab_size=vocab, max_position_embeddings=1024).to(torch.bfloat16)
    reference = lora_model(model=base)
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch(vocab, batch_size=8, seq=1024)

    def peak_bytes(peft_model) -> tuple[int, torch.Tensor]:
        peft_model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss = peft_model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, loss.detach()

    peak_bytes(model)  # the first call compiles the kernels
    ours, our_loss = peak_bytes(model)
    theirs, their_loss = peak_bytes(reference)
    assert relative_l2_error(our_loss, their_loss) < 2e-2
    assert ours < theirs / 2, (ours, theirs)
    liger_lab.unpatch(model)


@pytest.mark.parametrize("by_type", [True, False])
def test_a_patched_model_is_placed_by_accelerate_with_its_layers_whole(by_type):
    """What ``from_pretrained(..., device_map="auto")`` does on a machine of several GPUs (and TRL's own loading):
    accelerate's balanced-memory pass and device map keep every class of ``_no_split_modules`` on one device, found by
    class name. The fused layers are named there too; before, a model built while its family was patched listed none
    of its modules, and the balanced-memory pass failed ("max() iterable argument is empty"). Reproduced on CPU with a
    max_memory that names two GPUs."""
    accelerate_utils = pytest.importorskip("accelerate.utils")
    if by_type:
        liger_lab.patch("llama")
    try:
        model = tiny_model("llama")
        model = model if by_type else liger_lab.patch(model)
        assert type(model.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"
        no_split = sorted(model._no_split_modules)
        assert "FusedLlamaDecoderLayer" in no_split, no_split
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        budget = {0: size // 2, 1: size // 2, "cpu": 10 * size}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # accelerate's word that the GPUs named are not here
            memory = accelerate_utils.get_balanced_memory(model, max_memory=budget, no_split_module_classes=no_split)
            device_map = accelerate_utils.infer_auto_device_map(
                model, max_memory=memory, no_split_module_classes=no_split
            )
        layers = [name for name in device_map if name.startswith("model.layers.")]
        assert layers and all(name.count(".") == 2 for name in layers), device_map  # whole layers, never their parts
        assert len(set(device_map.values())) > 1, device_map  # split over devices, between layers
    finally:
        if by_type:
            liger_lab.unpatch("llama")
    liger_lab.unpatch(model)
    assert "FusedLlamaDecoderLayer" not in model._no_split_modules


def test_the_report_of_a_model_never_patched_says_so():
    report = liger_lab.patch_report(tiny_model("llama"))
    assert report.replaced == {} and list(report.left_alone) == ["the whole model"]
    assert "not patched: liger_lab.patch(model)" in str(report)
