"""torch.compile over varying sizes: one graph serves every length, with ``dynamic=True`` and with the default.

Fine-tuning batches have a new sequence length every step. Under the default automatic dynamic shapes Dynamo
compiles a static graph for the first size and a symbolic one at the first change, which then serves every size;
with ``dynamic=True`` the first graph is already symbolic. An input check or a fake implementation that pins a
symbolic size to its value (hashing it, ``Size.numel()``) makes every new size a new graph, and past Dynamo's
recompile limit the frame silently runs eagerly. Here the limit is 2 and reaching it is an error.

Every op of the table is compiled with ``dynamic=True`` (every size, integer and float argument symbolic: what
the default makes symbolic after a change is a subset of it) through aot_eager, so that the backward's fake
implementations see symbolic sizes too. A patched Llama is compiled in both modes through the eager backend
(Dynamo alone; the ops' own compile is covered per op, and AOT tracing a model is slow on CPU).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from test_patching import tiny_model
from torch._dynamo.testing import CompileCounterWithBackend

import liger_lab
from liger_lab import runtime
from liger_lab.hf.families import modeling_of
from liger_lab.hf.registry import original_of
from liger_lab.op_table import OPS, OpSpec
from liger_lab.ops.operators import kernels_under_compile

MODES = {"dynamic": True, "automatic": None}
"""``torch.compile``'s ``dynamic``: symbolic sizes from the first call, or the default (from the first change)."""
LENGTHS = (5, 7, 12)
"""Three: under the default the third length is the first that a graph compiled earlier must serve."""
# The dimension of each op's shape that is a length (of tokens, or of the positions of sequences); 0 if not listed.
LENGTH_DIM = {
    "rope": 3,
    "partial_rope": 3,
    **dict.fromkeys(("rms_norm", "add_rms_norm", "layer_norm", "swiglu", "geglu"), 1),
    **dict.fromkeys(("fused_linear_dpo", "fused_linear_orpo", "fused_linear_simpo", "fused_linear_grpo"), 1),
}


class CompileCounter(CompileCounterWithBackend):
    """Counts frame compiles, the graphs Dynamo keeps. ``frame_count`` counts backend calls, and Dynamo calls the
    backend a second time within one compile when it restarts a trace to specialize a float argument (an ``eps``, a
    ``beta``, transformers' dropout ``p``): one graph either way."""

    def __init__(self, backend: str) -> None:
        super().__init__(backend)
        self.compiles: set[tuple[int | None, int | None]] = set()

    def __call__(self, gm, example_inputs):
        compile_id = torch._guards.CompileContext.current_compile_id()
        self.compiles.add((compile_id.frame_id, compile_id.frame_compile_id))
        return super().__call__(gm, example_inputs)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    gc.collect()  # patched models of earlier tests let go of the rope swap before anything compiles
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        yield


def _shape(spec: OpSpec, length: int) -> tuple[int, ...]:
    """The op's interpreter check shape with ``length`` along its length."""
    shape = list(spec.check_shapes[0])
    shape[LENGTH_DIM.get(spec.name, 0)] = length
    return tuple(shape)


def _outputs_and_grads(fn, inputs: list[object]) -> list[torch.Tensor]:
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    leaves = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad]
    # A fixed non-uniform upstream gradient, so that every output element's gradient counts.
    loss = sum((out.float() * torch.linspace(-1, 2, out.numel()).view(out.shape)).sum() for out in outputs)
    return [*outputs, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("name", list(OPS))
def test_every_op_compiles_once_for_every_length(name):
    spec = OPS[name]
    counter = CompileCounter("aot_eager")
    compiled = torch.compile(spec.function, backend=counter, fullgraph=True, dynamic=True)
    for length in LENGTHS[:2]:
        inputs = spec.make_inputs(_shape(spec, length), torch.float32)
        with kernels_under_compile():  # the operators' fakes, which see the symbolic sizes
            ours = _outputs_and_grads(compiled, inputs)
    assert len(counter.compiles) == 1, counter.compiles
    # The graph traced at the first length, run at the second, computes what eager does.
    for our, expected in zip(ours, _outputs_and_grads(spec.function, inputs), strict=True):
        torch.testing.assert_close(our, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_a_patched_llama_compiles_at_most_twice_for_every_sequence_length(mode):
    model = liger_lab.patch(tiny_model("llama"))
    twin = copy.deepcopy(model)  # patched too: the same kernels, eager
    counter = CompileCounter("eager")
    compiled = torch.compile(model, backend=counter, dynamic=MODES[mode])
    for seq in LENGTHS if MODES[mode] is None else LENGTHS[:2]:
        input_ids = torch.randint(0, model.config.vocab_size, (2, seq), device=runtime.DEVICE)
        results = []
        for run, module in ((compiled, model), (twin, twin)):
            module.zero_grad(set_to_none=True)
            loss = run(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in module.named_parameters()}))
        (loss, grads), (eager_loss, eager_grads) = results
        torch.testing.assert_close(loss, eager_loss, rtol=1e-4, atol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], rtol=1e-3, atol=1e-5, msg=name)
    assert len(counter.compiles) == (1 if MODES[mode] else 2), counter.compiles


@pytest.mark.parametrize("mode", MODES)
def test_rope_accepts_under_compile_what_it_accepts_eagerly(mode):
    """cos and sin of q's batch (tables of batch 1 are the op sweep's and the model's), the batch and the length
    changing together."""
    spec = OPS["rope"]
    compiled = torch.compile(liger_lab.rope, backend="eager", fullgraph=True, dynamic=MODES[mode])
    for batch, seq in ((3, 7), (4, 9), (5, 11)):
        q, k, cos, sin = spec.make_inputs((batch, 2, 1, seq, 16), torch.float32)
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
        for ours, expected in zip(compiled(q, k, cos, sin), liger_lab.rope(q, k, cos, sin), strict=True):
            torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize(
    "angle_shape,message",
    [((2, 7, 16), r"expected \(3 or 1, 7, 16\)"), ((1, 6, 16), r"expected \(3 or 1, 7, 16\)"), ((7, 16), "cos")],
)
def test_rope_still_rejects_tables_of_another_shape(angle_shape, message):
    q, k = torch.randn(3, 2, 7, 16), torch.randn(3, 1, 7, 16)
    cos = sin = torch.randn(angle_shape)
    with pytest.raises(ValueError, match=message):
        liger_lab.rope(q, k, cos, sin)


def test_rope_rejects_a_table_of_another_batch_under_compile_too():
    q, k, cos = torch.randn(3, 2, 7, 16), torch.randn(3, 1, 7, 16), torch.randn(2, 7, 16)
    with pytest.raises(ValueError, match=r"expected \(3 or 1, 7, 16\)"):  # the graph break leaves the raise to Python
        torch.compile(liger_lab.rope, backend="eager", dynamic=True)(q, k, cos, cos)


def test_tensors_of_another_shape_are_still_rejected():
    for up in (torch.randn(3, 2), torch.randn(2, 3, 1), torch.randn(6)):
        with pytest.raises(ValueError, match="expected tensors of one shape"):
            liger_lab.swiglu(torch.randn(2, 3), up)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -0.5])
def test_preference_losses_still_reject_a_bad_beta(value):
    hidden, weight, target = OPS["fused_linear_simpo"].make_inputs(OPS["fused_linear_simpo"].check_shapes[0],
                                                                   torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="beta is"):
        liger_lab.fused_linear_simpo(hidden, weight, target, beta=value)


def test_a_patched_model_collected_during_a_compile_keeps_the_rope_swap_until_it_ends():
    """A patched model kept alive only by a reference cycle (what ``torch._dynamo.reset()`` leaves of a model whose
    compiled code it drops) is collected while another model of the family compiles: here, deterministically, by a
    backend that collects. Putting transformers' ``apply_rotary_pos_emb`` back at that moment would change the
    function the frame calls between tracing it and building its guards (an internal Dynamo error on the guard of
    the dispatcher's ``__closure__``)."""
    modeling = modeling_of("llama")
    original = original_of(modeling, "apply_rotary_pos_emb")
    model = tiny_model("llama")
    input_ids = torch.randint(0, model.config.vocab_size, (2, 6), device=runtime.DEVICE)
    compiled = torch.compile(model, backend=collecting_backend)
    gc.disable()  # the backend's collection is the only one
    try:
        cycle = [liger_lab.patch(tiny_model("llama"))]
        cycle.append(cycle)  # only the cyclic collector frees it
        del cycle
        assert modeling.apply_rotary_pos_emb is not original
        loss = compiled(input_ids=input_ids, labels=input_ids).loss
    finally:
        gc.enable()
    assert modeling.apply_rotary_pos_emb is original  # let go of once the compile ended
    torch.testing.assert_close(loss, model(input_ids=input_ids, labels=input_ids).loss)
    liger_lab.patch(model)  # a model compiled before, patched: its frame recompiles on the fused kernels
    torch.testing.assert_close(compiled(input_ids=input_ids, labels=input_ids).loss, loss, rtol=1e-4, atol=1e-5)


def collecting_backend(gm, example_inputs):
    gc.collect()
    return gm.forward
