"""A patched model behaves like a transformers model beyond training steps: it pickles whole
(``torch.save(model)``) and loads in this process or a new one, and ``return_dict=False`` gives the
unpatched model's tuple layout.
"""

import copy
import dataclasses
import gc
import importlib
import inspect
import io
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import OpCalls
from test_patching import LOSS_TOL, batch, fused_class_names, loss_and_grads, tiny_model

import liger_lab
from liger_lab import hf, runtime
from liger_lab.hf import loss as hf_loss
from liger_lab.hf import modules, registry
from liger_lab.hf.families import Family, Options, modeling_of
from liger_lab.hf.registry import original_of
from liger_lab.workbook.checks import relative_l2_error

transformers = pytest.importorskip("transformers")

FUSED_LLAMA = {f"FusedLlama{piece}" for piece in hf.FAMILIES["llama"].pieces}

patching = importlib.import_module("liger_lab.patching")  # the old path, kept for old pickles: tested here


@pytest.fixture(autouse=True)
def _no_patched_models_left_over():
    gc.collect()
    yield


def pickled(model) -> bytes:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    return buffer.getvalue()


def unpickled(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def loss_of(model, input_ids, labels):
    with torch.no_grad():
        return model(input_ids=input_ids, labels=labels)


def rope_is_swapped(modeling) -> bool:
    return modeling.apply_rotary_pos_emb is not original_of(modeling, "apply_rotary_pos_emb")


def test_fused_classes_are_found_by_name():
    """What pickle does with the class of a patched module, for every family and piece: in ``liger_lab.hf``, where
    new pickles name them, and in ``liger_lab.patching``, where pickles made before the split do."""
    everything = Options(True, True, True, False, True, None)
    for model_type, family in hf.FAMILIES.items():
        classes = modules.fused_classes(family, modeling_of(model_type), everything)
        assert len(classes) == len(family.pieces)
        for name, piece in classes.items():
            fused = piece.fused
            assert fused.__name__ == fused.__qualname__ and fused.__name__.startswith(f"Fused{name}")
            assert fused.__module__ == "liger_lab.hf"
            assert getattr(hf, fused.__name__) is fused and getattr(patching, fused.__name__) is fused
    for home in (hf, patching):
        with pytest.raises(AttributeError, match=f"module '{home.__name__}' has no attribute 'FusedBertMLP'"):
            home.FusedBertMLP  # noqa: B018


def test_every_piece_kind_has_a_builder_an_option_and_a_family_flag():
    """A piece kind is one entry of the registry: what builds it, the option that turns it on and the flag that says
    a family has it must exist, or the kind would fail only when a family first asks for it."""
    options = {field.name for field in dataclasses.fields(Options)}
    flags = {field.name for field in dataclasses.fields(Family) if field.type in ("bool", bool)}
    assert set(modules._BUILDERS) == set(registry.PIECE_KINDS)
    for suffix, kind in registry.PIECE_KINDS.items():
        assert kind.suffix == suffix and kind.option in options and kind.flag in flags, kind


def test_the_pre_split_module_finds_every_name_in_its_new_home():
    """``liger_lab.patching`` was the whole layer: its public names, and the private ones that notebooks and old
    pickles name, are the objects of liger_lab.hf (one registry of fallbacks, not a copy)."""
    assert (patching.patch, patching.unpatch, patching.report) == (hf.patch, hf.unpatch, hf.patch_report)
    assert patching.FAMILIES is hf.FAMILIES and patching.PatchReport is hf.PatchReport
    assert patching._REPORTED_FALLBACKS is hf_loss._REPORTED_FALLBACKS and patching._UNFUSED is registry.UNFUSED
    assert patching._BoundForward is hf_loss._BoundForward and patching._mlp_class is modules._mlp_class
    for name in ("_loss_forward", "_as_forward_of", "_is_fsdp_unit", "_llama_rms_norm_forward", "_Options"):
        assert callable(getattr(patching, name)), name
    with pytest.raises(AttributeError, match="module 'liger_lab.patching' has no attribute '_no_such_name'"):
        patching._no_such_name  # noqa: B018


def test_a_model_pickled_under_the_pre_split_names_loads(monkeypatch):
    """A model saved before the split names its fused classes and its forward in ``liger_lab.patching``: made here
    by saving one while those classes say they live there, it loads as the same patched model. New pickles name
    ``liger_lab.hf`` alone."""
    model = liger_lab.patch(tiny_model("llama"))
    input_ids, labels = batch()
    before = loss_of(model, input_ids, labels)
    assert b"liger_lab.hf" in pickled(model) and b"liger_lab.patching" not in pickled(model)
    with monkeypatch.context() as old_names:
        for cls in {type(m) for m in model.modules() if type(m) in registry.UNFUSED} | {hf_loss._BoundForward}:
            old_names.setattr(cls, "__module__", "liger_lab.patching")
        data = pickled(model)
    assert b"liger_lab.patching" in data and b"liger_lab.hf" not in data
    loaded = unpickled(data)
    assert fused_class_names(loaded) == FUSED_LLAMA and type(loaded.forward) is hf_loss._BoundForward
    after = loss_of(loaded, input_ids, labels)
    assert after.logits is None  # the fused loss still runs
    assert relative_l2_error(after.loss, before.loss) < LOSS_TOL
    liger_lab.unpatch(model)
    liger_lab.unpatch(loaded)


def test_instance_patched_model_pickles_and_computes_the_same_loss():
    model = liger_lab.patch(tiny_model("llama"))
    input_ids, labels = batch()
    before = loss_of(model, input_ids, labels)
    loaded = unpickled(pickled(model))

    assert fused_class_names(loaded) == FUSED_LLAMA
    assert loaded.forward.__self__ is loaded  # bound to the loaded model, not to the one saved
    assert inspect.signature(loaded.forward) == inspect.signature(tiny_model("llama").forward)
    after = loss_of(loaded, input_ids, labels)
    assert after.logits is None  # the fused loss still runs
    assert relative_l2_error(after.loss, before.loss) < LOSS_TOL
    liger_lab.unpatch(model)
    liger_lab.unpatch(loaded)


def test_family_patched_model_pickles_and_computes_the_same_loss():
    liger_lab.patch("llama")
    try:
        model = tiny_model("llama")
        input_ids, labels = batch()
        before = loss_of(model, input_ids, labels)
        loaded = unpickled(pickled(model))
        assert fused_class_names(loaded) == FUSED_LLAMA
        after = loss_of(loaded, input_ids, labels)
        assert after.logits is None
        assert relative_l2_error(after.loss, before.loss) < LOSS_TOL
    finally:
        liger_lab.unpatch("llama")


def test_a_loaded_model_holds_the_rope_swap_until_unpatched():
    modeling = modeling_of("llama")
    model = liger_lab.patch(tiny_model("llama"))
    input_ids, labels = batch()
    before = loss_of(model, input_ids, labels)
    loaded = unpickled(pickled(model))
    del model
    gc.collect()
    assert rope_is_swapped(modeling)  # the loaded model's attention runs the fused kernel still

    liger_lab.unpatch(loaded)
    assert not fused_class_names(loaded) and "forward" not in vars(loaded)
    assert not rope_is_swapped(modeling)
    after = loss_of(loaded, input_ids, labels)
    assert after.logits is not None  # transformers' forward again
    assert relative_l2_error(after.loss, before.loss) < LOSS_TOL


FRESH_PROCESS = textwrap.dedent(
    """
    import json, sys
    import torch
    import liger_lab  # before the pickle names liger_lab.hf: picks the interpreter on CPU
    from liger_lab.hf.families import modeling_of
    from liger_lab.hf.registry import original_of

    modeling = modeling_of("llama")
    swapped = lambda: modeling.apply_rotary_pos_emb is not original_of(modeling, "apply_rotary_pos_emb")
    fused = lambda model: sorted(type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Fused"))
    reports = {}
    for how, path in zip(sys.argv[1::2], sys.argv[2::2]):  # one model after the other: each holds the rope
        saved = torch.load(path, weights_only=False)
        model, input_ids, labels = saved["model"], saved["input_ids"], saved["labels"]
        report = reports[how] = {"fused": fused(model), "rope_swapped": swapped()}
        report["own_forward"] = "forward" in vars(model)
        with torch.no_grad():
            out = model(input_ids=input_ids, labels=labels)
        report.update(loss=out.loss.item(), logits=out.logits is not None)
        liger_lab.unpatch(model)
        report.update(fused_after_unpatch=fused(model), rope_swapped_after_unpatch=swapped())
        with torch.no_grad():
            report["loss_after_unpatch"] = model(input_ids=input_ids, labels=labels).loss.item()
    print(json.dumps(reports))
    """
)


def save_patched_model(how: str, path) -> float:
    """Save a model patched one way, with a batch; return its loss on that batch."""
    if how == "family":
        liger_lab.patch("llama")
    model = tiny_model("llama") if how == "family" else liger_lab.patch(tiny_model("llama"))
    try:
        input_ids, labels = batch()
        torch.save({"model": model, "input_ids": input_ids, "labels": labels}, path)
        return loss_of(model, input_ids, labels).loss.item()
    finally:
        liger_lab.unpatch("llama" if how == "family" else model)


def test_patched_models_load_in_a_fresh_process(tmp_path):
    ways = ("instance", "family")
    expected = {how: save_patched_model(how, tmp_path / f"{how}.pt") for how in ways}
    arguments = [str(item) for how in ways for item in (how, tmp_path / f"{how}.pt")]
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, *arguments], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(result.stdout.strip().splitlines()[-1])
    for how in ways:
        report = reports[how]
        assert set(report["fused"]) == FUSED_LLAMA, how
        assert report["rope_swapped"], how  # the fused attention holds the rope swap again
        # An instance patch travels with the model; a family patch stays in the process that made it, so
        # there the loss is transformers' own (the same value, from logits).
        assert report["own_forward"] == (how == "instance")
        assert report["logits"] == (how == "family")
        for loss in (report["loss"], report["loss_after_unpatch"]):
            assert abs(loss - expected[how]) <= LOSS_TOL * abs(expected[how]), (how, loss, expected[how])
        assert report["fused_after_unpatch"] == [] and not report["rope_swapped_after_unpatch"], how


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("output_hidden_states", [False, True])
def test_tuple_output_has_the_unpatched_layout(use_cache, output_hidden_states):
    reference = tiny_model("llama")
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    kwargs = dict(labels=labels, return_dict=False, use_cache=use_cache, output_hidden_states=output_hidden_states)
    with torch.no_grad():
        theirs = reference(input_ids=input_ids, **kwargs)
        ours = model(input_ids=input_ids, **kwargs)  # training: the fused loss, without logits
        ours_with_logits = model(input_ids=input_ids, skip_logits=False, **kwargs)
    layout = [type(value).__name__ for value in theirs]
    assert [type(value).__name__ for value in ours_with_logits] == layout
    assert [type(value).__name__ for value in ours] == ["Tensor", "NoneType", *layout[2:]]
    for out in (ours, ours_with_logits):
        assert relative_l2_error(out[0], theirs[0]) < LOSS_TOL
    assert relative_l2_error(ours_with_logits[1], theirs[1]) < 1e-5
    if output_hidden_states:
        assert relative_l2_error(ours[-1][-1], theirs[-1][-1]) < 1e-5
    liger_lab.unpatch(model)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "nemotron"])
def test_autocast_step_matches_transformers(model_type):
    """Under autocast the attention's output is bf16 while the residual stream stays fp32: the patched decoder
    layer must add them as transformers does (the sum promoted to fp32), not fail on add_rms_norm's one dtype.
    Nemotron's LayerNorm1P runs in bf16 there, as transformers casts it."""
    reference = tiny_model(model_type)
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    losses, grads = [], []
    for each in (model, reference):
        with torch.autocast(input_ids.device.type, torch.bfloat16):
            loss = each(input_ids=input_ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad for name, p in each.named_parameters()})
    # bf16 matmuls on both sides, rounded at different points: a bf16-sized tolerance.
    assert relative_l2_error(*losses) < 2e-2, [loss.item() for loss in losses]
    for name, grad in grads[0].items():
        assert relative_l2_error(grad, grads[1][name]) < 5e-2, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("model_type", sorted(hf.FAMILIES))
def test_fused_norms_round_where_transformers_does(model_type, dtype):
    """Each family's RMSNorm rounds at its own point (Llama: xhat to the input dtype, then times w; OLMo 2: w times
    xhat in fp32, rounded once; Gemma: (1 + w) in fp32; Nemotron's LayerNorm: 1 + w rounded to w's dtype). In half
    precision a wrong choice changes about a quarter of the outputs by one step; the right one matches to the last bit
    but for rare ties. bf16 too: the interpreter rounds fp32 -> bf16 stores to nearest even, as the GPU does
    (``runtime``)."""
    reference = tiny_model(model_type).to(dtype)
    model = liger_lab.patch(copy.deepcopy(reference))
    generator = torch.Generator().manual_seed(0)
    pairs = [
        (ours, theirs)
        for ours, theirs in zip(model.modules(), reference.modules(), strict=True)
        if type(theirs).__name__.endswith(("RMSNorm", "LayerNorm1P"))
        and type(ours).__name__ == f"Fused{type(theirs).__name__}"
    ]
    assert pairs
    for ours, theirs in pairs:
        size = ours.weight.shape[-1]
        weight = (1 + torch.randn(size, generator=generator)).to(dtype).to(ours.weight.device)
        x = (3 * torch.randn(256, size, generator=generator)).to(dtype).to(ours.weight.device)
        with torch.no_grad():
            ours.weight.copy_(weight)
            theirs.weight.copy_(weight)
            differ = (ours(x) != theirs(x)).float().mean().item()
        assert differ < 0.01, f"{type(theirs).__name__}: {differ:.1%} of the outputs differ"


@pytest.mark.parametrize("model_type", sorted(hf.FAMILIES))
def test_half_precision_step_matches_transformers(model_type):
    """A whole training step in half precision: every fused piece returns the dtype transformers' does (OLMo 2's
    RoPE takes fp32 cos and sin and rounds q and k back to their dtype) and rounds close to it."""
    reference = tiny_model(model_type).half()
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, labels = batch()
    ours, our_grads = loss_and_grads(model, input_ids, labels)
    theirs, their_grads = loss_and_grads(reference, input_ids, labels)
    assert relative_l2_error(ours.loss, theirs.loss) < 5e-3, (ours.loss.item(), theirs.loss.item())
    for name, grad in our_grads.items():
        assert relative_l2_error(grad, their_grads[name]) < 3e-2, name


@pytest.mark.parametrize("model_type", sorted(hf.FAMILIES))
def test_every_fused_piece_runs_its_kernel(model_type):
    """A patched model's step runs the kernel of every piece its family fuses, here and on the GPU (in bf16
    there): a swap that matched no module, or a transformers path that goes around it, would otherwise only
    show as a model that trains like the unpatched one."""
    family = hf.FAMILIES[model_type]
    model = liger_lab.patch(tiny_model(model_type).to(runtime.pick(cpu=torch.float32, gpu=torch.bfloat16)))
    input_ids, labels = batch()
    with OpCalls() as calls:
        model(input_ids=input_ids, labels=labels).loss.backward()
    expected = {"fused_linear_cross_entropy"}
    expected |= {"rms_norm", "rms_norm_backward"} if family.rms_norm else set()
    expected |= {"layer_norm", "layer_norm_backward"} if family.layer_norm_1p else set()
    expected |= {"glu"} if family.mlp or family.experts else set()
    expected |= {"add_rms_norm", "add_rms_norm_backward"} if family.add_norm else set()
    # liger_lab's operators, in-place variants (ending in _) under their plain names
    ran = {name.removeprefix("liger_lab::").rstrip("_") for name in calls.counts if name.startswith("liger_lab::")}
    # RoPE: of the whole head, or partial and interleaved RoPE's operators (GLM-4, Llama 4, a partial_rotary_factor)
    rope = {"rope", "rope_backward"} if {"rope", "rope_backward"} <= ran else {"partial_rope", "partial_rope_backward"}
    expected |= rope if family.rope else set()
    assert expected <= ran, f"{model_type}: not run: {sorted(expected - ran)}; ran {sorted(ran)}"
