"""Every op of the table is a PyTorch custom operator: opcheck'ed, and traced by torch.compile without graph
breaks (fullgraph=True), with the same outputs and gradients as eager, in its default call and its variants."""

from __future__ import annotations

import pytest
import torch
from helpers import OpCalls

from liger_lab import runtime
from liger_lab.op_table import OPS, OpSpec
from liger_lab.ops.operators import LOWERED_UNDER_COMPILE, kernels_under_compile

CASES = [(name, label) for name, spec in OPS.items() for label in ("default", *spec.variants)]
IDS = [f"{name}-{label}" for name, label in CASES]


def _options(spec: OpSpec, label: str) -> dict[str, object]:
    return {} if label == "default" else dict(spec.variants[label])


def _inputs(spec: OpSpec, seed: int = 0) -> list[object]:
    torch.manual_seed(seed)
    inputs = spec.make_inputs(spec.check_shapes[0], torch.float32)
    named = dict(zip(spec.input_names, inputs, strict=True))
    if "target" in named:
        named["target"][::5] = -100
    # Intermediate results, as in a model: an in-place variant may write over them, never over a leaf.
    return [v * 1.0 if isinstance(v, torch.Tensor) and v.requires_grad else v for v in inputs]


def _leaves(inputs: list[object]) -> list[torch.Tensor]:
    return [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad]


def _loss(outputs: object) -> torch.Tensor:
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    # A fixed, non-uniform upstream gradient: every output element gets its own weight.
    weights = [torch.linspace(-1, 2, out.numel(), device=out.device).view(out.shape) for out in outputs]
    return sum((out.float() * weight).sum() for out, weight in zip(outputs, weights, strict=True))


@pytest.mark.parametrize("name,label", CASES, ids=IDS)
def test_every_operator_behind_the_op_passes_opcheck(name, label):
    spec = OPS[name]
    inputs = _inputs(spec)
    with OpCalls(keep_args=True) as calls:
        _loss(spec.call(**_options(spec, label))(*inputs)).backward()
    assert calls.ran() and calls.ran() <= set(spec.operators), (calls.ran(), spec.operators)
    for name, func, args, kwargs in calls.recorded:
        if name == spec.operators[0] and spec.registered_autograd:  # opcheck tests the formula too
            args = tuple(
                a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
            )
        torch.library.opcheck(func, args, kwargs)


def test_the_table_lists_every_registered_operator():
    listed = {op for spec in OPS.values() for op in spec.operators}
    registered = {
        name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("liger_lab::")
    }
    assert registered == listed


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name,label", CASES, ids=IDS)
def test_compiled_fullgraph_matches_eager(name, label, backend):
    """The operators themselves under torch.compile (the row ops too, which lower to Inductor by default)."""
    spec = OPS[name]
    fn = spec.call(**_options(spec, label))
    torch._dynamo.reset()
    with kernels_under_compile():
        _assert_compiled_matches_eager(spec, fn, torch.compile(fn, fullgraph=True, backend=backend))


def _assert_compiled_matches_eager(spec: OpSpec, fn, compiled) -> None:
    results = []
    for run in (fn, compiled):
        inputs = _inputs(spec)
        outputs = run(*inputs)
        leaves = [v for v in inputs if isinstance(v, torch.Tensor) and v.grad_fn is not None]
        grads = torch.autograd.grad(_loss(outputs), leaves)
        results.append((outputs if isinstance(outputs, tuple) else (outputs,), grads))
    (eager_out, eager_grads), (compiled_out, compiled_grads) = results
    for ours, expected in zip(compiled_out + compiled_grads, eager_out + eager_grads, strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(LOWERED_UNDER_COMPILE))
def test_row_ops_trace_their_formula_under_compile_and_match_the_kernels(name):
    """By default a compiled row op is its PyTorch formula, which Inductor fuses with its neighbours: no operator
    call in the graph, and the kernels' values."""
    spec = OPS[name]
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return torch._dynamo.backends.debugging.aot_eager(graph_module, example_inputs)

    torch._dynamo.reset()
    _assert_compiled_matches_eager(spec, spec.function, torch.compile(spec.function, fullgraph=True, backend=backend))
    assert len(graphs) == 1 and "liger_lab" not in graphs[0], graphs
    with kernels_under_compile():
        torch._dynamo.reset()
        torch.compile(spec.function, fullgraph=True, backend=backend)(*_inputs(spec))
    assert "liger_lab" in graphs[-1], graphs[-1]


@pytest.mark.parametrize("name", list(OPS))
def test_no_graph_break(name):
    spec = OPS[name]
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(spec.function)(*_inputs(spec))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def test_runs_where_kernels_run():
    assert runtime.DEVICE.type == ("cpu" if runtime.INTERPRET else "cuda")


@pytest.mark.parametrize("name,label", CASES, ids=IDS)
def test_empty_inputs_forward_and_backward(name, label):
    spec = OPS[name]
    inputs = [v * 1.0 if isinstance(v, torch.Tensor) and v.requires_grad else v
              for v in spec.make_inputs((0, *spec.check_shapes[0][1:]), torch.float32)]  # fmt: skip
    leaves = [v for v in inputs if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    outputs = spec.call(**_options(spec, label))(*inputs)
    grads = torch.autograd.grad(_loss(outputs), leaves, allow_unused=True)
    for leaf, grad in zip(leaves, grads, strict=True):
        assert grad is None or (grad.shape == leaf.shape and torch.isfinite(grad).all())


@pytest.mark.parametrize("name", list(OPS))
def test_the_default_call_never_writes_a_caller_tensor(name):
    """Forward and backward of the default call leave every input as it was, values and versions: only an opt-in
    in-place variant writes over a caller's tensor."""
    spec = OPS[name]
    inputs = _inputs(spec)
    tensors = [v for v in inputs if isinstance(v, torch.Tensor)]
    before = [(t.detach().clone(), t._version) for t in tensors]
    _loss(spec.function(*inputs)).backward()
    for tensor, (values, version) in zip(tensors, before, strict=True):
        assert torch.equal(tensor.detach(), values) and tensor._version == version
