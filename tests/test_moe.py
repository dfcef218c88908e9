"""The experts of a mixture of experts on the fused SwiGLU (transformers 5's ``Qwen3MoeExperts`` and
``MixtralExperts``: every expert's weights in two 3-D tensors, a loop over the experts that got tokens).

A patched model trains like transformers' (fp32: the loss and every gradient), with the kernel run once per expert
that got tokens and its backward writing over gate and up; an expert that gets no token is skipped as transformers
skips it. transformers' own experts kernels (grouped_mm, its default) and activations other than SiLU are left
alone, and ``patch_report`` says so. The benchmark script runs in its small form.
"""

import copy
import gc
import json

import pytest
import torch
from helpers import OpCalls
from test_patching import VOCAB, assert_same_training_step, batch, tiny_model

import liger_lab
from liger_lab import runtime
from liger_lab.hf.families import modeling_of

transformers = pytest.importorskip("transformers")

MOE = ["qwen3_moe", "mixtral"]
NUM_EXPERTS = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}  # the config's name for it
FUSED = "MoE experts (SwiGLU)"


@pytest.fixture(autouse=True)
def _no_patched_models_left_over():
    gc.collect()
    yield


def experts_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


def record_routing(model) -> list[torch.Tensor]:
    """The top-k expert indices each experts module of ``model`` is given, call by call, from now on."""
    seen: list[torch.Tensor] = []
    for module in experts_modules(model):
        module.register_forward_pre_hook(lambda _, args: seen.append(args[1].detach().clone()))
    return seen


def dense_mlps(model) -> int:
    return sum(type(m).__name__.endswith("MLP") for m in model.modules())


@pytest.mark.parametrize("model_type", MOE)
@pytest.mark.parametrize("routing", ["every expert", "idle experts"])
def test_experts_train_like_transformers_on_the_fused_kernel(model_type, routing):
    if routing == "every expert":  # 16 tokens, top 2 of 4 experts
        reference = tiny_model(model_type)
        input_ids, labels = batch()
    else:  # 3 tokens, top 2 of 8 experts: at most 6 experts get a token
        reference = tiny_model(model_type, **{NUM_EXPERTS[model_type]: 8})
        input_ids = torch.randint(0, VOCAB, (1, 3), device=runtime.DEVICE)
        labels = input_ids.clone()
    model = liger_lab.patch(copy.deepcopy(reference))
    routed = record_routing(model)
    with OpCalls() as calls:
        assert_same_training_step(model, reference, input_ids, labels)

    [index] = routed  # one mixture-of-experts layer
    experts = getattr(reference.config, NUM_EXPERTS[model_type])
    hit = index.unique().numel()
    assert hit == experts if routing == "every expert" else 2 <= hit < experts, (hit, experts)
    # Once per expert that got tokens, each backward into fresh buffers (gate and up are strided halves of one
    # matmul's output), and once for Qwen3-MoE's dense layer, whose backward writes over gate and up.
    assert calls.counts["liger_lab::glu"] == hit + dense_mlps(model)
    assert calls.counts["liger_lab::glu_backward"] == hit
    assert calls.counts["liger_lab::glu_backward_"] == dense_mlps(model)
    liger_lab.unpatch(model)


def test_experts_left_to_transformers_kernel_and_back_to_the_loop():
    """grouped_mm (transformers' default wherever it runs) is left alone; a model switched to the eager loop after
    patching runs the fused kernel from its next call."""
    reference = tiny_model("mixtral", experts_implementation="grouped_mm")
    model = liger_lab.patch(copy.deepcopy(reference))
    with OpCalls() as calls:
        assert_same_training_step(model, reference, *batch())
    assert calls.counts["liger_lab::glu"] == 0
    report = liger_lab.patch_report(model)
    assert FUSED not in report.replaced and "'grouped_mm'" in report.left_alone["experts"]

    model.set_experts_implementation("eager")
    reference.set_experts_implementation("eager")
    with OpCalls() as calls:
        assert_same_training_step(model, reference, *batch())
    assert calls.counts["liger_lab::glu"] > 0
    assert liger_lab.patch_report(model).replaced[FUSED] == 1


def test_experts_with_another_activation_are_left_alone():
    reference = tiny_model("mixtral", hidden_act="gelu")
    model = copy.deepcopy(reference)
    with pytest.warns(UserWarning, match="Experts activation 'gelu'"):
        liger_lab.patch(model)
    assert type(model.model.layers[0].mlp.experts) is type(reference.model.layers[0].mlp.experts)
    with OpCalls() as calls:
        assert_same_training_step(model, reference, *batch())
    assert calls.counts["liger_lab::glu"] == 0
    assert "not SiLU" in liger_lab.patch_report(model).left_alone["experts"]


def test_unpatch_restores_the_experts_and_the_report_follows():
    model = tiny_model("qwen3_moe")
    modeling = modeling_of("qwen3_moe")
    report = liger_lab.patch_report(liger_lab.patch(model))
    assert report.replaced[FUSED] == 1 and report.replaced["gated MLP (SwiGLU/GeGLU)"] == 1
    assert set(report.left_alone) == {"router"} and f"fused      {FUSED}" in str(report)
    liger_lab.unpatch(model)
    [experts] = experts_modules(model)
    assert type(experts) is modeling.Qwen3MoeExperts
    left_alone = liger_lab.patch_report(model).left_alone
    assert list(left_alone) == ["the whole model"] and left_alone["the whole model"].startswith("not patched")
    liger_lab.patch(model, swiglu=False)
    assert type(experts) is modeling.Qwen3MoeExperts
    liger_lab.unpatch(model)


def test_patching_the_family_builds_fused_experts():
    modeling = modeling_of("mixtral")
    original = modeling.MixtralExperts
    liger_lab.patch("mixtral")
    try:
        model = tiny_model("mixtral")
        [experts] = experts_modules(model)
        assert type(experts).__name__ == "FusedMixtralExperts" and isinstance(experts, original)
        assert liger_lab.patch_report(model).replaced[FUSED] == 1
    finally:
        liger_lab.unpatch("mixtral")
    assert modeling.MixtralExperts is original


def test_moe_benchmark_runs_quick(monkeypatch, tmp_path, capsys):
    from benchmarks import moe_experts as benchmark

    path = tmp_path / "moe.json"
    assert benchmark.main(["--quick", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert {(r["op"], r["impl"]) for r in rows} == {
        (block, impl) for block in ("qwen3-moe", "mixtral") for impl in benchmark.IMPLS
    }  # fmt: skip
    # The same products summed in another order: fp32 on CPU agrees to 1e-5; bf16 on a GPU to about an ulp
    # (transformers' own grouped_mm differs from its loop by 4e-3 on an H200, h200-moe-experts.json).
    tolerance = {"float32": 1e-5, "bfloat16": 2e-2}
    assert all(r["full_ms"] > 0 and r["rel_err_vs_transformers"] < tolerance[r["dtype"]] and r["transformers"]
               for r in rows)  # fmt: skip
    assert "liger_lab" in capsys.readouterr().out
