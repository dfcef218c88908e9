"""Patched models under PyTorch's distributed engines: DDP and FSDP2, two processes, the gloo backend (CPU).

Each process builds the same tiny Llama from the same seed, patches it, and trains one step on its half of a
batch under DDP or ``fully_shard``; the loss (averaged over the processes) and every gradient (gathered in
full) must equal those of the same patched model stepping on the whole batch in one process. The fused loss
must run in every case, the ``lm_head`` being a unit of its own included (FSDP2 then swaps its class and
shards its weight), and under ``torch.compile``; no fallback to materialised logits may happen.
"""

from __future__ import annotations

import copy
import json
import socket
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import liger_lab  # noqa: E402
from liger_lab import runtime  # noqa: E402

pytestmark = pytest.mark.skipif(not runtime.INTERPRET, reason="the gloo tests run on CPU; GPUs use NCCL")

WORLD, BATCH, SEQ, VOCAB = 2, 4, 12, 96
CASES = {
    "ddp": "DistributedDataParallel",
    "fsdp2": "fully_shard on each decoder layer and the root (lm_head with the root)",
    "fsdp2_head_unit": "fully_shard on lm_head too: a unit of its own, its weight sharded between calls",
    "fsdp2_checkpointing": "lm_head its own unit, activation checkpointing of the decoder layers",
    "fsdp2_mixed_precision": "bf16 parameters, fp32 gradient reduction, lm_head its own unit",
    "fsdp2_compile": "lm_head its own unit, the whole model through torch.compile (FSDP2's hooks break the graph)",
}


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    liger_lab.patch(model)
    return model


def _batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return input_ids, input_ids.clone()  # every sequence keeps the same number of targets on each process


def _step(model, input_ids, labels):
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def _wrap(model, case):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if case == "ddp":
        return DistributedDataParallel(model)
    if case == "fsdp2_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = {"mp_policy": policy} if case == "fsdp2_mixed_precision" else {}
    for layer in model.model.layers:
        fully_shard(layer, **options)
    if case != "fsdp2":
        fully_shard(model.lm_head, **options)
    fully_shard(model, **options)
    if case == "fsdp2_compile":
        model.compile(backend="aot_eager")
    return model


def _worker(rank: int, port: int, out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from liger_lab.ops import fused_linear_cross_entropy as flce_ops

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    fused_calls = [0]
    fused = flce_ops.fused_linear_cross_entropy

    def counting(*args, **kwargs):
        fused_calls[0] += 1
        return fused(*args, **kwargs)

    flce_ops.fused_linear_cross_entropy = counting
    input_ids, labels = _batch()
    reference = _model()
    expected_loss = _step(reference, input_ids, labels)
    expected = {name: p.grad for name, p in reference.named_parameters()}
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    report = {}
    for case in CASES:
        model = _wrap(copy.deepcopy(_model()), case)
        fused_calls[0] = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = _step(model, input_ids[rows], labels[rows])
        dist.all_reduce(loss)
        errors = {}
        for name, param in (model.module if case == "ddp" else model).named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            reference_grad = expected[name]
            errors[name] = ((grad.float() - reference_grad).norm() / reference_grad.norm()).item()
        report[case] = {
            "loss": (loss / WORLD).item(),
            "expected_loss": expected_loss.item(),
            "worst_grad": max(errors.items(), key=lambda item: item[1]),
            "fused_calls": fused_calls[0],
            "fallbacks": [str(w.message) for w in caught if "materialises the logits" in str(w.message)],
        }
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
    out_path = tmp_path_factory.mktemp("distributed") / "report.json"
    torch.multiprocessing.spawn(_worker, args=(_free_port(), str(out_path)), nprocs=WORLD)
    return json.loads(out_path.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_patched_model_trains_like_one_process(report, case):
    """``CASES[case]``: the loss and every gradient of the single-process step; the fused loss ran, no fallback."""
    result = report[case]
    mixed = case == "fsdp2_mixed_precision"  # bf16 parameters against the fp32 single-process step
    loss_tol, grad_tol = (2e-2, 5e-2) if mixed else (1e-5, 1e-4)
    assert abs(result["loss"] - result["expected_loss"]) <= loss_tol * abs(result["expected_loss"]), result
    assert result["worst_grad"][1] <= grad_tol, result
    assert result["fused_calls"] == 1 and not result["fallbacks"], result


def test_a_head_the_fused_loss_cannot_take_is_reported():
    """A fallback to materialised logits warns, once per model class and reason, with the reason."""
    from liger_lab import patching

    model = _model()
    model.lm_head = torch.nn.Sequential(model.lm_head)  # e.g. an adapter around the head
    input_ids, labels = _batch()
    patching._REPORTED_FALLBACKS.clear()
    with pytest.warns(UserWarning, match="materialises the logits.*lm_head is a Sequential"):
        model(input_ids=input_ids, labels=labels).loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=input_ids, labels=labels)  # reported already: no second warning
    assert not [w for w in caught if "materialises the logits" in str(w.message)]
