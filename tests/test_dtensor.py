"""The ops on DTensors, two processes, the gloo backend (CPU): sharded activations run shard by shard.

One spawn runs every case. A case calls an op on DTensors (x replicated, sharded on the batch, sharded on the
sequence as under ``SequenceParallel``; norm weights replicated) and the same op on the full plain tensors; the
output and every gradient (gathered with ``full_tensor()``, which reduces a ``Partial`` weight gradient) must match
to 1e-5 relative in fp32, with the placements the sharding strategies promise and, where every operand is already
placed as a strategy wants, no collective at all.
"""

from __future__ import annotations

import copy
import datetime
import json
import socket
from collections.abc import Callable

import pytest
import torch

import liger_lab
from liger_lab import runtime

pytest.importorskip("torch.distributed.tensor", reason="a torch built without distributed support")

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402

pytestmark = pytest.mark.skipif(not runtime.INTERPRET, reason="the gloo tests run on CPU; GPUs use NCCL")

WORLD = 2
B, S, H = 3, 5, 16  # odd batch and sequence: the two ranks' shards differ in size
PLACEMENTS = {"replicate": Replicate(), "batch": Shard(0), "sequence": Shard(1)}
TOLERANCE = 1e-5


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _norm_inputs(names: tuple[str, ...], placement: object) -> dict[str, tuple[torch.Tensor, object]]:
    """(full tensor, placement) per argument: activations (B, S, H) placed as asked, parameters (H,) replicated."""
    return {name: (_randn(B, S, H), placement) if name in ("x", "residual") else (_randn(H), Replicate())
            for name in names}  # fmt: skip


def _rope_inputs(placement: str) -> dict[str, tuple[torch.Tensor, object]]:
    """q (B, 4, S, 8), k (B, 2, S, 8) (grouped-query heads); cos, sin per batch element, or (1, S, 8) shared."""
    qk, angle, angle_batch = {
        "replicate": (Replicate(), Replicate(), B),
        "batch": (Shard(0), Shard(0), B),
        "batch_shared_table": (Shard(0), Replicate(), 1),
        "heads": (Shard(1), Replicate(), B),
        "sequence": (Shard(2), Shard(1), B),
    }[placement]
    return {
        "q": (_randn(B, 4, S, 8), qk),
        "k": (_randn(B, 2, S, 8), qk),
        "cos": (_randn(angle_batch, S, 8), angle),
        "sin": (_randn(angle_batch, S, 8), angle),
    }


def _cases() -> dict[str, tuple[Callable[..., object], dict[str, tuple[torch.Tensor, object]], tuple[str, ...]]]:
    """name -> (op taking keyword tensors, inputs, the inputs whose gradients are compared)."""
    cases = {}
    for label, placement in PLACEMENTS.items():
        cases[f"rms_norm-{label}"] = (liger_lab.rms_norm, _norm_inputs(("x", "weight"), placement), ("x", "weight"))
        cases[f"add_rms_norm-{label}"] = (
            liger_lab.add_rms_norm, _norm_inputs(("x", "residual", "weight"), placement), ("x", "residual", "weight")
        )  # fmt: skip
        cases[f"layer_norm-{label}"] = (
            liger_lab.layer_norm, _norm_inputs(("x", "weight", "bias"), placement), ("x", "weight", "bias")
        )  # fmt: skip
    gemma = lambda x, weight: liger_lab.rms_norm(x, weight, offset=1.0, casting_mode="gemma")  # noqa: E731
    cases["rms_norm_gemma-sequence"] = (gemma, _norm_inputs(("x", "weight"), Shard(1)), ("x", "weight"))
    in_place = lambda x, weight: liger_lab.rms_norm(x * 1.0, weight, in_place_backward=True)  # noqa: E731
    cases["rms_norm_in_place_backward-sequence"] = (in_place, _norm_inputs(("x", "weight"), Shard(1)), ("x", "weight"))
    # The loss reads y only: the sum's gradient arrives as None.
    y_only = lambda x, residual, weight: liger_lab.add_rms_norm(x, residual, weight)[0]  # noqa: E731
    cases["add_rms_norm_y_only-sequence"] = (
        y_only, _norm_inputs(("x", "residual", "weight"), Shard(1)), ("x", "residual", "weight")
    )  # fmt: skip
    for label, placement in {**PLACEMENTS, "hidden": Shard(2)}.items():
        for name in ("swiglu", "geglu"):
            inputs = {"gate": (_randn(B, S, H), placement), "up": (_randn(B, S, H), placement)}
            cases[f"{name}-{label}"] = (getattr(liger_lab, name), inputs, ("gate", "up"))
    swiglu_in_place = lambda gate, up: liger_lab.swiglu(gate * 1.0, up * 1.0, in_place_backward=True)  # noqa: E731
    inputs = {"gate": (_randn(B, S, H), Shard(1)), "up": (_randn(B, S, H), Shard(1))}
    cases["swiglu_in_place_backward-sequence"] = (swiglu_in_place, inputs, ("gate", "up"))
    for label in ("replicate", "batch", "batch_shared_table", "heads", "sequence"):
        cases[f"rope-{label}"] = (liger_lab.rope, _rope_inputs(label), ("q", "k"))
        # Learned tables: their gradients, sums over heads (and over the batch for a shared table), come from
        # plain torch ops, which DTensor runs itself.
        cases[f"rope_learned_tables-{label}"] = (liger_lab.rope, _rope_inputs(label), ("q", "k", "cos", "sin"))
    return cases


def _relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    ours = ours.full_tensor() if isinstance(ours, DTensor) else ours
    return ((ours.double() - expected.double()).norm() / expected.double().norm()).item()


def _as_tuple(outputs: object) -> tuple[torch.Tensor, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _run_case(mesh, op, inputs, differentiable) -> dict[str, object]:
    from torch.distributed.tensor.debug import CommDebugMode

    plain = {name: t.clone().requires_grad_(name in differentiable) for name, (t, _) in inputs.items()}
    expected = _as_tuple(op(**plain))
    upstream = [torch.randn_like(out) for out in expected]
    torch.autograd.backward(expected, [u.clone() for u in upstream])  # an in-place backward writes over its copy

    placed = {name: distribute_tensor(t, mesh, [p]).requires_grad_(name in differentiable)
              for name, (t, p) in inputs.items()}  # fmt: skip
    with CommDebugMode() as forward_comm:
        outputs = _as_tuple(op(**placed))
    upstream = [distribute_tensor(u, mesh, out.placements) for u, out in zip(upstream, outputs, strict=True)]
    with CommDebugMode() as backward_comm:
        torch.autograd.backward(outputs, upstream)
    errors = {f"out{i}": _relative_error(out, ref) for i, (out, ref) in enumerate(zip(outputs, expected, strict=True))}
    errors.update({f"d{name}": _relative_error(placed[name].grad, plain[name].grad) for name in differentiable})
    return {
        "errors": errors,
        "placements": {
            **{f"out{i}": str(out.placements[0]) for i, out in enumerate(outputs)},
            **{f"d{name}": str(placed[name].grad.placements[0]) for name in differentiable},
        },
        "collectives": forward_comm.get_total_counts() + backward_comm.get_total_counts(),
    }


def _sharded_weight(mesh) -> dict[str, object]:
    """A weight sharded on its only dimension, x on the sequence: DTensor gathers the (H,) weight for the op."""
    x, weight, upstream = _randn(B, S, H), _randn(H), _randn(B, S, H)
    plain_x, plain_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    expected = liger_lab.rms_norm(plain_x, plain_w)
    expected.backward(upstream)
    placed_x = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    placed_w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    y = liger_lab.rms_norm(placed_x, placed_w)
    y.backward(distribute_tensor(upstream, mesh, [Shard(1)]))
    return {
        "errors": {
            "out0": _relative_error(y, expected),
            "dx": _relative_error(placed_x.grad, plain_x.grad),
            "dweight": _relative_error(placed_w.grad, plain_w.grad),
        },
        "placements": {"out0": str(y.placements[0])},
    }


def _sequence_parallel_module(mesh, rank: int) -> dict[str, object]:
    """``liger_lab.nn.RMSNorm`` under ``parallelize_module(..., SequenceParallel())``: each rank passes its own
    slice of the sequence (an even length: SequenceParallel infers the global shape from equal shards)."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    seq = 6
    reference_module = liger_lab.nn.RMSNorm(H)
    with torch.no_grad():
        reference_module.weight.copy_(_randn(H))
    module = parallelize_module(copy.deepcopy(reference_module), mesh, SequenceParallel())
    x, upstream = _randn(B, seq, H), _randn(B, seq, H)
    plain_x = x.clone().requires_grad_()
    expected = reference_module(plain_x)
    expected.backward(upstream)
    rows = slice(rank * seq // WORLD, (rank + 1) * seq // WORLD)
    local_x = x[:, rows].clone().requires_grad_()
    y = module(local_x)
    y.backward(distribute_tensor(upstream, mesh, [Shard(1)]))
    return {
        "errors": {
            "out0": _relative_error(y, expected),
            "dx": _relative_error(local_x.grad, plain_x.grad[:, rows]),
            "dweight": _relative_error(module.weight.grad, reference_module.weight.grad),
        },
        "placements": {"out0": str(y.placements[0]), "weight": str(module.weight.placements[0])},
    }


def _statistics(mesh) -> dict[str, object]:
    """The saved statistics of x (B, S, H) sharded on the sequence: shaped (B, S), sharded the same way."""
    x, weight, bias = _randn(B, S, H), _randn(H), _randn(H)
    placed_x = distribute_tensor(x, mesh, [Shard(1)])
    placed_w, placed_b = (distribute_tensor(t, mesh, [Replicate()]) for t in (weight, bias))
    stats = {
        "rms_norm.rstd": (
            torch.ops.liger_lab.rms_norm(placed_x, placed_w, 1e-6, 0.0, "llama", False)[1],
            torch.ops.liger_lab.rms_norm(x, weight, 1e-6, 0.0, "llama", False)[1],
        ),
        "add_rms_norm.rstd": (
            torch.ops.liger_lab.add_rms_norm(placed_x, placed_x, placed_w, 1e-6, 0.0, "llama")[2],
            torch.ops.liger_lab.add_rms_norm(x, x, weight, 1e-6, 0.0, "llama")[2],
        ),
        "layer_norm.mean": (
            torch.ops.liger_lab.layer_norm(placed_x, placed_w, placed_b, 1e-5, 0.0)[1],
            torch.ops.liger_lab.layer_norm(x, weight, bias, 1e-5, 0.0)[1],
        ),
        "layer_norm.rstd": (
            torch.ops.liger_lab.layer_norm(placed_x, placed_w, placed_b, 1e-5, 0.0)[2],
            torch.ops.liger_lab.layer_norm(x, weight, bias, 1e-5, 0.0)[2],
        ),
    }
    return {
        "errors": {name: _relative_error(ours, expected) for name, (ours, expected) in stats.items()},
        "placements": {name: str(ours.placements[0]) for name, (ours, _) in stats.items()},
        "shapes": {name: list(ours.shape) for name, (ours, _) in stats.items()},
    }


def _recorded_dtypes(mesh) -> list[list[str]]:
    """fp16 x, fp32 weight: llama casting returns fp32, gemma fp16. [dtype, dtype DTensor recorded] per call."""
    x = distribute_tensor(_randn(B, S, H).half(), mesh, [Shard(1)])
    weight = distribute_tensor(_randn(H), mesh, [Replicate()])
    calls = [liger_lab.rms_norm(x, weight, casting_mode=mode) for mode in ("llama", "gemma", "llama")]
    return [[str(y.dtype), str(y._spec.tensor_meta.dtype)] for y in calls]


def _worker(rank: int, port: int, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),  # a failing peer ends the run, not a 30-minute wait
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)  # every rank builds the same full tensors
    report = {name: _run_case(mesh, *case) for name, case in _cases().items()}
    report["sharded_weight"] = _sharded_weight(mesh)
    report["sequence_parallel_module"] = _sequence_parallel_module(mesh, rank)
    report["statistics"] = _statistics(mesh)
    report["recorded_dtypes"] = _recorded_dtypes(mesh)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out_path = tmp_path_factory.mktemp("dtensor") / "report.json"
    torch.multiprocessing.spawn(_worker, args=(_free_port(), str(out_path)), nprocs=WORLD)
    return json.loads(out_path.read_text())


CASE_NAMES = list(_cases())
ROPE_PLACEMENTS = {"replicate": Replicate(), "batch": Shard(0), "batch_shared_table": Shard(0), "heads": Shard(1),
                   "sequence": Shard(2)}  # fmt: skip
# A learned table's gradient sums over heads, and over the batch when the table is shared: Partial where those are
# sharded, else the table's own placement.
TABLE_GRADIENT = {"replicate": Replicate(), "batch": Shard(0), "batch_shared_table": Partial(), "heads": Partial(),
                  "sequence": Shard(1)}  # fmt: skip


def _expected_placements(case: str, names: list[str]) -> dict[str, str]:
    """Outputs and activation gradients keep the activations' placement (nothing is gathered); a weight or bias
    gradient is each rank's sum over its rows (Partial) when the rows are sharded."""
    op, label = case.split("-")
    if op.startswith("rope"):
        placement, special = ROPE_PLACEMENTS[label], {"dcos": TABLE_GRADIENT[label], "dsin": TABLE_GRADIENT[label]}
    else:
        placement = {**PLACEMENTS, "hidden": Shard(2)}[label]
        row_sum = Replicate() if placement == Replicate() else Partial()
        special = {"dweight": row_sum, "dbias": row_sum}
    return {name: str(special.get(name, placement)) for name in names}


@pytest.mark.parametrize("case", CASE_NAMES)
def test_op_on_dtensors_matches_plain_tensors(report, case):
    result = report[case]
    assert max(result["errors"].values()) <= TOLERANCE, result
    assert result["placements"] == _expected_placements(case, list(result["placements"])), result
    # rope.py's plain-torch gradient of learned tables starts from 0 + a sum over heads: with the heads sharded,
    # DTensor reduces that Partial sum first (one all-reduce for cos, one for sin).
    assert result["collectives"] == (2 if case == "rope_learned_tables-heads" else 0), result


def test_weight_sharded_on_its_only_dimension_is_gathered(report):
    result = report["sharded_weight"]
    assert max(result["errors"].values()) <= TOLERANCE, result
    assert result["placements"]["out0"] == str(Shard(1)), result


def test_rms_norm_module_under_sequence_parallel(report):
    result = report["sequence_parallel_module"]
    assert max(result["errors"].values()) <= TOLERANCE, result
    assert result["placements"] == {"out0": str(Shard(1)), "weight": str(Replicate())}, result


def test_saved_statistics_follow_the_rows_sharding(report):
    result = report["statistics"]
    assert max(result["errors"].values()) <= TOLERANCE, result
    assert set(result["placements"].values()) == {str(Shard(1))}, result
    assert all(shape == [B, S] for shape in result["shapes"].values()), result


def test_dtensor_records_the_dtype_each_casting_mode_returns(report):
    assert report["recorded_dtypes"] == [["torch.float32"] * 2, ["torch.float16"] * 2, ["torch.float32"] * 2]
