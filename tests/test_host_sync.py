"""The losses never make the host wait for the GPU: their forward and backward read no value back (the kept count
and the target range check stay on the device), so a training step runs ahead of the GPU and a CUDA graph can
capture it.

On CPU the interpreter's tensors are host memory, and there the target check reads its counts to raise a
ValueError before any work (``runtime.HOST_READS_WAIT`` is false). The tests below switch that flag to the GPU's
value, so the very code a GPU runs is run here, and count every read of a tensor's value by the host."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import HostReads, randn

import liger_lab
from liger_lab import runtime
from liger_lab.op_table import OPS

N, H, V = 24, 16, 96
CHUNK = 10  # 24 tokens: chunks of 10, 10 and 4
PAIRS, POSITIONS = 2, 5


def _targets(shape: tuple[int, ...], bad: bool) -> torch.Tensor:
    """Class indices with every fourth ignored; ``bad``: one of them is V, out of range."""
    target = torch.randint(0, V, shape, device=runtime.DEVICE)
    target.view(-1)[::4] = -100
    if bad:
        target.view(-1)[1] = V
    return target


def _head(*lead: int, hidden: int = H, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [
        randn(*lead, hidden, dtype=dtype).requires_grad_(),
        randn(V, hidden, dtype=dtype, scale=hidden**-0.5).requires_grad_(),
    ]


Case = tuple[Callable[[], torch.Tensor], list[torch.Tensor]]


def _flce(bad: bool, dtype: torch.dtype = torch.float32, **options: object) -> Case:
    hidden, weight = _head(N, dtype=dtype)
    bias = randn(V, dtype=dtype, scale=0.1).requires_grad_()
    target = _targets((N,), bad)

    def run() -> torch.Tensor:  # hidden * 1.0: an intermediate, which in_place_backward may overwrite
        return liger_lab.fused_linear_cross_entropy(hidden * 1.0, weight, target, bias, chunk_tokens=CHUNK, **options)

    return run, [hidden, weight, bias]


def _fljsd(bad: bool, dtype: torch.dtype = torch.float32, with_target: bool = True) -> Case:
    student, teacher = _head(N, dtype=dtype), [t.detach() for t in _head(N, hidden=H + 4, dtype=dtype)]
    target = _targets((N,), bad) if with_target else None

    def run() -> torch.Tensor:
        return liger_lab.fused_linear_jsd(*student, *teacher, target, chunk_tokens=CHUNK)

    return run, student


def _preference(loss: str, bad: bool, dtype: torch.dtype = torch.float32) -> Case:
    policy = _head(2 * PAIRS, POSITIONS, dtype=dtype)
    reference = [t.detach() for t in _head(2 * PAIRS, POSITIONS, hidden=H + 4, dtype=dtype)] if loss == "dpo" else []
    target = _targets((2 * PAIRS, POSITIONS), bad)
    function = getattr(liger_lab, f"fused_linear_{loss}")
    return (lambda: function(*policy, target, *reference, chunk_pairs=1)), policy


def _cross_entropy(bad: bool, dtype: torch.dtype = torch.float32, **options: object) -> Case:
    logits, target = randn(N, V, dtype=dtype).requires_grad_(), _targets((N,), bad)
    return (lambda: liger_lab.cross_entropy(logits * 1.0, target, **options)), [logits]


def _jsd(bad: bool) -> Case:
    student, teacher, target = randn(N, V).requires_grad_(), randn(N, V), _targets((N,), bad)
    return (lambda: liger_lab.jsd(student, teacher, target)), [student]


CASES: dict[str, Callable[[bool], Case]] = {
    "ce-mean": _cross_entropy,
    "ce-mean-fp16": lambda bad: _cross_entropy(bad, torch.float16),
    "ce-none": lambda bad: _cross_entropy(bad, reduction="none"),
    "ce-in-place": lambda bad: _cross_entropy(bad, in_place_backward=True),
    "jsd": _jsd,
    "flce-mean": _flce,
    "flce-mean-fp16": lambda bad: _flce(bad, torch.float16),
    "flce-sum": lambda bad: _flce(bad, reduction="sum"),
    "flce-none": lambda bad: _flce(bad, reduction="none"),
    "flce-in-place": lambda bad: _flce(bad, in_place_backward=True),
    "fljsd": _fljsd,
    "fljsd-fp16": lambda bad: _fljsd(bad, torch.float16),
    "fljsd-no-target": lambda bad: _fljsd(bad, with_target=False),
    "dpo": lambda bad: _preference("dpo", bad),
    "orpo": lambda bad: _preference("orpo", bad),
    "simpo": lambda bad: _preference("simpo", bad),
}
RANGE_CHECKED = [case for case in CASES if "jsd" not in case]  # the JSD's target is only a mask


def _step(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Forward and backward (a per-token loss summed); returns the loss."""
    loss = run()
    loss.sum().backward()
    return loss


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU's logic on the interpreter's tensors: values may not be read on the host."""
    monkeypatch.setattr(runtime, "HOST_READS_WAIT", True)


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_read_nothing_back(case, gpu_path, monkeypatch):
    run, leaves = CASES[case](False)
    with HostReads(monkeypatch) as reads:
        _step(run)
    assert reads.calls == []
    assert all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in leaves)


LOSSES = [name for name, spec in OPS.items() if not spec.registered_autograd or name == "fused_linear_logprobs"]
"""Every loss of the table (those that make their gradient in the forward) and the RL head."""


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_and_the_head_of_the_table_read_nothing_back(name, gpu_path, monkeypatch):
    """The table's row, at its check shape, on the GPU's logic: forward and backward (every output that has a
    gradient summed) read no value back; each differentiable input gets a finite gradient."""
    spec = OPS[name]
    inputs = spec.make_inputs(spec.check_shapes[0], torch.float32)
    leaves = [inputs[spec.input_names.index(input_name)] for input_name in spec.differentiable]
    with HostReads(monkeypatch) as reads:
        out = spec.function(*inputs)
        outputs = out if isinstance(out, tuple) else (out,)
        sum(o.float().sum() for o in outputs if o.requires_grad).backward()
    assert reads.calls == []
    assert all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in leaves)


@pytest.mark.parametrize("case", ["ce-mean", "flce-mean", "orpo"])
def test_the_counter_sees_the_interpreter_path_read_its_range_check(case, monkeypatch):
    """The control: where reading is free the range check reads its counts (inside the operator) to raise a
    ValueError before any work, and the counter above sees that read."""
    monkeypatch.setattr(runtime, "HOST_READS_WAIT", False)
    run, _ = CASES[case](False)
    with HostReads(monkeypatch) as reads:
        _step(run)
    assert reads.calls == ["Tensor.tolist"]


@pytest.mark.parametrize("case", ["ce-mean", "ce-mean-fp16", "ce-in-place", "flce-mean", "flce-none", "flce-in-place",
                                  "dpo"])  # fmt: skip
def test_a_target_out_of_range_on_the_gpu_path_gives_nan_loss_and_gradients(case, gpu_path):
    """Not checked on the host, a bad target still never yields a plausible number: loss and every gradient NaN."""
    run, leaves = CASES[case](True)
    loss = _step(run)
    assert torch.isnan(loss).all()
    assert all(torch.isnan(leaf.grad).all() for leaf in leaves)


@pytest.mark.parametrize("case", ["ce-mean", "ce-in-place", "flce-mean", "dpo"])
def test_a_target_out_of_range_where_reads_are_free_is_a_value_error(case, monkeypatch):
    monkeypatch.setattr(runtime, "HOST_READS_WAIT", False)  # the interpreter's value (on a GPU too, for the test)
    run, _ = CASES[case](True)
    with pytest.raises(ValueError, match="out of range"):
        run()


# On the GPU: no synchronisation at all, and a CUDA graph captures the whole step.


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_no_synchronisation_on_the_gpu(case):
    run, leaves = CASES[case](False)
    _step(run)  # compiles the kernels and warms cuBLAS first: those may synchronise once
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(run)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(leaf.grad).all() for leaf in leaves)


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_a_cuda_graph_captures_forward_and_backward(case):
    run, leaves = CASES[case](False)
    expected = [_step(run).detach().clone(), *(leaf.grad.clone() for leaf in leaves)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as CUDA graph capture asks
        _step(run)
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = _step(run)
    graph.replay()
    torch.cuda.synchronize()
    for actual, wanted in zip([loss, *(leaf.grad for leaf in leaves)], expected, strict=True):
        torch.testing.assert_close(actual, wanted)
