"""Every kernel launch runs on its tensors' device (``runtime.launch_kernel``), whatever device is current.

Triton launches on the current device and its current stream; a model split over GPUs in one process calls each
layer's kernels with that layer's tensors while another GPU may be current. Here every op of the table runs forward
and backward while each Triton launch records the device context it was made in (``runtime.device_context``, the
one place that sets it: ``helpers.recorded_launches``); the context must be there for every launch and name the
launch's tensors' device. On CPU the context is a no-op, so this checks that no launch goes around it; on a machine
with two GPUs the ops also run on the second one while the first is current.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import recorded_launches

from liger_lab import runtime
from liger_lab.op_table import OPS
from liger_lab.runtime import device as runtime_device


@pytest.fixture
def launches(monkeypatch):
    """Every launch of the test (``helpers.Launch``)."""
    with recorded_launches(monkeypatch) as seen:
        yield seen


def _outputs(out: object) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", list(OPS))
def test_every_launch_runs_in_its_tensors_device_context(name, launches):
    spec = OPS[name]
    outs = _outputs(spec.function(*spec.make_inputs(spec.check_shape(), torch.float32)))
    sum(o.float().sum() for o in outs).backward()
    assert launches, f"{name} launched no kernel"
    for kernel, context, devices, _ in launches:
        assert context is not None, f"{name}: {kernel} launched outside runtime.device_context"
        assert devices == {context}, f"{name}: {kernel} ran in the context of {context} with tensors on {devices}"


def test_launch_kernel_asks_for_the_first_tensor_arguments_device(monkeypatch):
    """The device comes from the first tensor argument (the scalars before it are skipped); nothing launches
    outside the context."""
    events = []

    @contextlib.contextmanager
    def recording_context(device):
        events.append(("enter", device))
        yield
        events.append(("exit", device))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: events.append(("launch", grid, len(args), sorted(kwargs)))

    monkeypatch.setattr(runtime_device, "device_context", recording_context)
    meta = torch.device("meta")
    runtime.launch_kernel(Kernel(), (3,), 7, torch.empty(2, device=meta), torch.empty(2), BLOCK=16)
    assert events == [("enter", meta), ("launch", (3,), 3, ["BLOCK"]), ("exit", meta)]


def test_the_device_context_of_a_cpu_tensor_changes_nothing():
    with runtime.device_context(torch.device("cpu")) as entered:
        assert entered is None


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", list(OPS))
def test_ops_on_the_second_gpu_while_the_first_is_current(name, launches):
    """Forward and backward on cuda:1 with a side stream current there, while cuda:0 is the current device: the
    same outputs and gradients as on cuda:0, every launch on cuda:1 and on that stream."""
    spec = OPS[name]
    torch.manual_seed(0)
    inputs = spec.make_inputs(spec.check_shape(), torch.float32)
    results = []
    for device in (torch.device("cuda", 0), torch.device("cuda", 1)):
        copies = [x.detach().to(device).requires_grad_(x.requires_grad) if torch.is_tensor(x) else x for x in inputs]
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.cuda.device(0):  # entering a stream makes its device current
            outs = _outputs(spec.function(*copies))
            sum(o.float().sum() for o in outs).backward()
        torch.cuda.current_stream(device).wait_stream(stream)
        grads = [x.grad for x in copies if torch.is_tensor(x) and x.requires_grad]
        results.append([t.detach().cpu() for t in (*outs, *grads)])
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    second = torch.device("cuda", 1)
    assert any(context == second for _, context, _, _ in launches)
    for kernel, context, devices, launch_stream in launches:
        assert context is not None and devices == {context}, f"{name}: {kernel} in {context}, tensors on {devices}"
        assert launch_stream.device == context, f"{name}: {kernel} on a stream of {launch_stream.device}"
        if context == second:
            assert launch_stream == stream, f"{name}: {kernel} not on the current stream of {second}"
