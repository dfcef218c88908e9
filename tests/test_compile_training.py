"""A patched model trains under torch.compile exactly as it trains eagerly.

For tiny Llama, Qwen3 and Gemma 2 models: the compiled patched model (inductor and aot_eager) takes the
same AdamW steps as an eager copy of itself, with the same losses and gradients, and the loss falls. A
patched decoder layer traces into one graph, with no graph break; activation checkpointing composes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_patching import batch, tiny_model

import liger_lab
from liger_lab import runtime

STEPS = 4
FAMILIES = ["llama", "qwen3", "gemma2"]


def _steps(model, input_ids, labels, steps=STEPS):
    """Losses and, at the first step, the gradients of every parameter."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, first_grads = [], None
    for _ in range(steps):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        if first_grads is None:
            named = model.named_parameters()
            first_grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in named if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first_grads


def _assert_same_training(compiled, eager):
    (c_losses, c_grads), (e_losses, e_grads) = compiled, eager
    torch.testing.assert_close(torch.tensor(c_losses), torch.tensor(e_losses), rtol=1e-4, atol=1e-5)
    assert c_grads.keys() == e_grads.keys() and len(c_grads) > 0
    for name, grad in c_grads.items():
        torch.testing.assert_close(grad, e_grads[name], rtol=1e-3, atol=1e-5, msg=name)
    assert e_losses[-1] < e_losses[0], "the loss did not fall: the comparison would prove nothing"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_compiled_patched_model_trains_like_the_eager_one(model_type, backend):
    torch.manual_seed(0)
    model = liger_lab.patch(tiny_model(model_type))
    twin = copy.deepcopy(model)  # patched too: same kernels, eager
    input_ids, labels = batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    _assert_same_training(_steps(compiled, input_ids, labels), _steps(twin, input_ids, labels))


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", FAMILIES)
def test_reduce_overhead_replays_the_patched_model_as_cuda_graphs(model_type):
    """``mode="reduce-overhead"``: the same steps as eagerly, with every compiled graph kept in CUDA graphs (a graph
    Inductor skips runs without one, correct but as slow as the default mode: ``TORCH_LOGS=perf_hints`` says why)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = liger_lab.patch(tiny_model(model_type))
    twin = copy.deepcopy(model)
    input_ids, labels = batch()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead")
    _assert_same_training(_steps(compiled, input_ids, labels), _steps(twin, input_ids, labels))
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_patched_decoder_layer_is_one_graph(model_type):
    torch.manual_seed(0)
    model = liger_lab.patch(tiny_model(model_type))
    layer = model.model.layers[0]
    hidden = torch.randn(2, 8, model.config.hidden_size, device=runtime.DEVICE, requires_grad=True)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(8, device=runtime.DEVICE)[None])
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(layer)(hidden, position_embeddings=position_embeddings, attention_mask=None)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    fused = {type(m).__name__ for m in layer.modules() if type(m).__name__.startswith("Fused")}
    assert len(fused) >= 3, fused  # norm, MLP and attention (RoPE) all run liger_lab's operators


def test_activation_checkpointing_with_compile():
    torch.manual_seed(0)
    model = liger_lab.patch(tiny_model("llama"))
    twin = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    input_ids, labels = batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    _assert_same_training(_steps(compiled, input_ids, labels), _steps(twin, input_ids, labels))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_patched_model_with_its_fused_loss_is_one_graph(model_type):
    torch.manual_seed(0)
    model = liger_lab.patch(tiny_model(model_type))
    input_ids, labels = batch()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(input_ids=input_ids, labels=labels)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    assert not explanation.break_reasons
