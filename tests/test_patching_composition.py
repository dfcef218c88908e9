"""liger_lab.patch composed with what else touches a model: forward hooks, other libraries' forwards (TRL's fused LM
head, accelerate's hooks), torch.compile's wrapper, and a second thread running the same family.

Shapes are the tiny models of tests/test_patching.py.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from helpers import OpCalls, randn
from test_patching import LOSS_TOL, batch, loss_and_grads, tiny_model

import liger_lab
from liger_lab import runtime
from liger_lab.hf.loss import _BoundForward
from liger_lab.nn import SwiGLUMLP
from liger_lab.ops import rope as rope_ops
from liger_lab.workbook.checks import relative_l2_error


def _kernels_run(model, input_ids, labels) -> set[str]:
    """liger_lab's operators that one training step of ``model`` ran, in-place ones under their plain names."""
    with OpCalls() as calls:
        model(input_ids=input_ids, labels=labels).loss.backward()
    return {name.removeprefix("liger_lab::").rstrip("_") for name in calls.counts if name.startswith("liger_lab::")}


# ---------------------------------------------------------------------------------------------------
# Forward hooks and the caller's tensors: an in-place backward writes only over what nothing else can see.


def _keep_output(kept):
    return lambda module, args, output: kept.append((output, output.detach().clone()))


def _hook(projection, kind, kept):
    """A hook that keeps ``projection``'s output: its own forward hook, or a global one narrowed to it."""
    if kind == "forward_hook":
        return projection.register_forward_hook(_keep_output(kept))
    keep = _keep_output(kept)
    return torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: keep(module, args, output) if module is projection else None
    )


@pytest.mark.parametrize("kind", ["forward_hook", "global_hook"])
def test_a_hooked_projection_keeps_its_output(kind):
    """A hook that keeps gate_proj's output sees it intact after the backward, in a patched model (whose step stays
    transformers') and in SwiGLUMLP."""
    reference = tiny_model("llama")
    model = liger_lab.patch(copy.deepcopy(reference))
    mlp = SwiGLUMLP(16, 40, device=runtime.DEVICE)
    input_ids, labels = batch()
    kept = []
    handles = [_hook(projection, kind, kept) for projection in (model.model.layers[0].mlp.gate_proj, mlp.gate_proj)]
    try:
        ours, _ = loss_and_grads(model, input_ids, labels)
        mlp(randn(3, 16)).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    theirs, _ = loss_and_grads(reference, input_ids, labels)
    assert relative_l2_error(ours.loss, theirs.loss) < LOSS_TOL
    assert len(kept) == 2
    for output, copied in kept:
        assert torch.equal(output.detach(), copied)


def test_a_pre_hook_on_a_projection_turns_the_in_place_backward_off():
    model = liger_lab.patch(tiny_model("llama"))
    input_ids, labels = batch()
    for hooked in (False, True):
        if hooked:
            model.model.layers[0].mlp.up_proj.register_forward_pre_hook(lambda *_: None)
        with OpCalls() as calls:
            model(input_ids=input_ids, labels=labels).loss.backward()
        assert calls.counts["liger_lab::glu_backward_"] == int(not hooked)


@pytest.mark.parametrize("op", [liger_lab.swiglu, liger_lab.geglu])
def test_in_place_backward_never_writes_a_leaf_or_a_view_of_one(op):
    """Parameters and other leaves that require grad (and views of them) keep their values; their gradients are
    right and are not their own buffers."""
    gate, up = torch.nn.Parameter(randn(6, 40)), randn(6, 40).requires_grad_()
    before = gate.detach().clone(), up.detach().clone()
    op(gate, up, in_place_backward=True).sum().backward()
    expected_gate, expected_up = gate.grad.clone(), up.grad.clone()
    assert torch.equal(gate.detach(), before[0]) and torch.equal(up.detach(), before[1])
    gate.grad = up.grad = None
    op(gate.view(6, 40), up[:, :], in_place_backward=True).sum().backward()
    assert torch.equal(gate.detach(), before[0]) and torch.equal(up.detach(), before[1])
    torch.testing.assert_close(gate.grad, expected_gate, rtol=0, atol=0)
    torch.testing.assert_close(up.grad, expected_up, rtol=0, atol=0)


def test_cross_entropy_in_place_never_writes_a_leaf():
    logits, target = randn(5, 30).requires_grad_(), torch.randint(0, 30, (5,), device=runtime.DEVICE)
    before = logits.detach().clone()
    liger_lab.cross_entropy(logits, target, in_place_backward=True).backward()
    assert torch.equal(logits.detach(), before) and logits.grad.data_ptr() != logits.data_ptr()


# ---------------------------------------------------------------------------------------------------
# Another library's forward on the instance: TRL's fused LM head.


@pytest.fixture
def add_fused_lm_head():
    return pytest.importorskip("trl.trainer.utils").add_fused_lm_head


def test_a_trl_forward_set_before_patch_is_kept(add_fused_lm_head):
    """TRL's trainers set model.forward (add_fused_lm_head) before a patch of trainer.model: its own calls
    (fused_lm_head=True) still return its log-probabilities, a plain training call gets the fused loss, and unpatch
    gives back TRL's forward itself."""
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    add_fused_lm_head(reference)
    add_fused_lm_head(model)
    trl_forward = model.__dict__["forward"]
    liger_lab.patch(model)
    input_ids, labels = batch()
    ours = model(input_ids=input_ids, labels=labels, fused_lm_head=True)
    theirs = reference(input_ids=input_ids, labels=labels, fused_lm_head=True)
    torch.testing.assert_close(ours.log_probs, theirs.log_probs, rtol=1e-5, atol=1e-5)
    plain = model(input_ids=input_ids, labels=labels)
    assert plain.logits is None  # the fused loss
    assert relative_l2_error(plain.loss, reference(input_ids=input_ids, labels=labels).loss) < LOSS_TOL
    report = liger_lab.patch_report(model)
    # Under TRL's head the fused loss serves only the calls without fused_lm_head=True; TRL's kernel (patch_trl is
    # off here) serves the others, and the report says both.
    assert report.left_alone["loss"].startswith("fused linear cross-entropy only without fused_lm_head=True")
    assert "patch_trl()" in report.left_alone["LM head under TRL"]
    assert "add_fused_lm_head" in report.left_alone["forward"]
    liger_lab.unpatch(model)
    assert model.__dict__["forward"] is trl_forward


def test_unpatch_after_trl_wrapped_the_patched_model(add_fused_lm_head):
    """TRL wraps the patched forward (it keeps the one it found): patch_report sees the fused loss inside, and after
    unpatch the model computes transformers' loss through TRL's forward, as patch_report says."""
    model = liger_lab.patch(tiny_model("llama"))
    add_fused_lm_head(model)
    input_ids, labels = batch()
    assert model(input_ids=input_ids, labels=labels).logits is None
    assert liger_lab.patch_report(model).left_alone["loss"].startswith("fused linear cross-entropy only without")
    liger_lab.unpatch(model)
    assert "not patched" in liger_lab.patch_report(model).left_alone["the whole model"]
    assert model(input_ids=input_ids, labels=labels).logits is not None
    assert model(input_ids=input_ids, labels=labels, fused_lm_head=True).log_probs.shape == labels[:, 1:].shape


# ---------------------------------------------------------------------------------------------------
# accelerate's hooks: they wrap the forward on the instance and keep the one they wrapped.


def _cpu_offload(model):
    from accelerate import cpu_offload

    return cpu_offload(model, execution_device=torch.device("cpu"))


def _dispatch(model):
    from accelerate import dispatch_model

    return dispatch_model(model, device_map={"": "cpu"}, force_hooks=True)


def _forwards(model) -> dict[str, dict[str, object]]:
    """Every module's instance forwards (accelerate's and the ones it keeps), by module name."""
    slots = ("forward", "_old_forward")
    return {name: {s: m.__dict__[s] for s in slots if s in m.__dict__} for name, m in model.named_modules()}


@pytest.mark.skipif(runtime.DEVICE.type != "cpu", reason="accelerate's hooks are placed on CPU here")
@pytest.mark.parametrize("hook", [_cpu_offload, _dispatch], ids=["cpu_offload", "dispatch_model"])
def test_accelerate_hooks_before_or_after_patch(hook):
    pytest.importorskip("accelerate")
    reference = tiny_model("llama")
    input_ids, labels = batch()
    expected = reference(input_ids=input_ids, labels=labels).loss
    # Not add_rms_norm: a hooked norm runs as a module of its own (its hook may load its weight).
    fused = {"rms_norm", "glu", "rope", "fused_linear_cross_entropy"}

    # Hooked first: every fused piece runs inside accelerate's hooks (the lm_head's loads its offloaded weight
    # around the fused loss), and unpatch gives back each module's forwards exactly.
    model = hook(copy.deepcopy(reference))
    forwards = _forwards(model)
    liger_lab.patch(model)
    assert model.__dict__["forward"] is forwards[""]["forward"]  # accelerate's, still around the patched forward
    assert fused <= _kernels_run(model, input_ids, labels)
    assert relative_l2_error(model(input_ids=input_ids, labels=labels).loss, expected) < LOSS_TOL
    assert _forwards(model)["lm_head"]["forward"] is forwards["lm_head"]["forward"]
    liger_lab.unpatch(model)
    assert _forwards(model) == forwards

    # Patched first, then hooked: the same; after unpatch accelerate's hooks run transformers' modules.
    model = hook(liger_lab.patch(copy.deepcopy(reference)))
    assert fused <= _kernels_run(model, input_ids, labels)
    liger_lab.unpatch(model)
    with OpCalls() as calls:
        out = model(input_ids=input_ids, labels=labels)
    assert out.logits is not None and not any(name.startswith("liger_lab::") for name in calls.counts)
    assert "not patched" in liger_lab.patch_report(model).left_alone["the whole model"]


# ---------------------------------------------------------------------------------------------------
# torch.compile's wrapper, and threads.


def test_patch_of_a_compiled_model_patches_the_module_it_compiles():
    model = tiny_model("llama")
    compiled = torch.compile(model, backend="eager")
    assert liger_lab.patch(compiled) is compiled
    assert isinstance(model.__dict__["forward"], _BoundForward)
    assert "loss (fused linear cross-entropy)" in liger_lab.patch_report(compiled).replaced
    assert liger_lab.unpatch(compiled) is compiled
    assert "forward" not in model.__dict__ and type(model.model.norm).__name__ == "LlamaRMSNorm"


def test_fused_rope_is_per_thread(monkeypatch):
    """While a patched model's attention runs in one thread, an unpatched model of the same family run by another
    thread gets transformers' RoPE (the dispatcher's switch is per thread)."""
    fused_by_thread = []
    fused = rope_ops.apply_rotary_pos_emb
    monkeypatch.setattr(
        rope_ops,
        "apply_rotary_pos_emb",
        lambda *a, **k: fused_by_thread.append(threading.get_ident()) or fused(*a, **k),
    )
    reference = tiny_model("llama")
    model = liger_lab.patch(copy.deepcopy(reference))
    input_ids, _ = batch()
    inside, release = threading.Event(), threading.Event()

    def pause(*_):  # the patched model waits here, inside its fused attention, before the rotary embedding
        inside.set()
        release.wait(60)

    def run_patched():
        with torch.no_grad():
            model(input_ids=input_ids)

    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(pause)
    worker = threading.Thread(target=run_patched)
    with torch.no_grad():
        worker.start()
        try:
            assert inside.wait(60)
            reference(input_ids=input_ids)
        finally:
            release.set()
            worker.join(60)
    assert fused_by_thread == [worker.ident]  # one layer, in the patched model's thread only
