"""Several processes, one model: what FSDP2 keeps on each GPU, and patched models checked against one process.

FSDP2 (``torch.distributed.fsdp.fully_shard``) makes each parameter of a unit a DTensor split along dim 0, one
shard per process. Before a unit's forward its hooks all-gather the full parameters, after it they free them
again (``reshard_after_forward``); the backward gathers them once more and reduce-scatters the gradients, so
each process keeps the gradient and the AdamW states of its shard only. :func:`memory_per_gpu` counts the bytes
of one GPU that way (from :func:`liger_lab.e2e.memory_breakdown`, the one-GPU count).

:func:`launch` runs this module (``python -m liger_lab.distributed``) in ``nproc`` processes started by
``torch.distributed.run``: NCCL on GPUs when there is a GPU per process, otherwise gloo on CPU, with the kernels
in Triton's interpreter. Every process builds the same models from the same seeds and steps on its share of one
batch; the loss (averaged over the processes) and every gradient (gathered whole) are compared with one process
stepping on the whole batch. Two kinds of run:

* ``cases`` (:data:`CASES`): a tiny patched Llama under DDP or FSDP2, and what ``lm_head.weight`` is at each
  point of the step (a shard, or the full weight);
* ``head_losses``: functions ``loss(head, hidden, target)`` from the hidden states to the loss, each run by a small
  model whose ``lm_head`` (with a bias) is an FSDP2 unit of its own. They travel to the processes as source (a function
  defined in a notebook cannot be pickled), and may use ``torch``, ``liger_lab``, ``hf`` (``liger_lab.hf``) and
  ``DTensor``. Each is first run here, on the model
  unsharded, so a function that fails does so with its traceback in this process.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

import liger_lab
from liger_lab import hf, runtime
from liger_lab.e2e.memory import count_parameters, memory_breakdown
from liger_lab.e2e.training import train_step

WORLD = 2
BATCH, SEQ, VOCAB = 4, 12, 96
"""The tiny Llama's batch (split between the processes), sequence length and vocabulary."""

CASES = {
    "ddp": "DistributedDataParallel",
    "fsdp2": "fully_shard on each decoder layer and the root (lm_head with the root)",
    "fsdp2_head_unit": "fully_shard on lm_head too: a unit of its own, its weight sharded between calls",
    "fsdp2_checkpointing": "lm_head its own unit, activation checkpointing of the decoder layers",
    "fsdp2_mixed_precision": "bf16 parameters, fp32 gradient reduction, lm_head its own unit",
    "fsdp2_compile": "lm_head its own unit, the whole model through torch.compile (FSDP2's hooks break the graph)",
}

HEAD_HIDDEN, HEAD_VOCAB, HEAD_TOKENS = 32, 97, 24
"""The head-loss model: hidden size, vocabulary (odd, so the two shards differ: 49 and 48 rows), tokens."""


# ---------------------------------------------------------------------------------------------------------------
# Bytes per GPU


def unit_parameters(config) -> dict[str, int]:
    """Parameters of each FSDP2 unit of a Llama (untied output layer) sharded as ``benchmarks/dist.py`` shards
    it: one unit per decoder layer, one for ``lm_head``, and the root, which keeps the embedding and the final
    norm."""
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings is True: expected an untied lm_head (a unit of its own)")
    embedding = config.vocab_size * config.hidden_size
    layers = count_parameters(config) - 2 * embedding - config.hidden_size
    return {
        "decoder layer": layers // config.num_hidden_layers,
        "lm_head": embedding,
        "root (embedding, final norm)": embedding + config.hidden_size,
    }


def memory_per_gpu(
    config, gpus: int, batch: int, seq: int, *, fused: bool, dtype: torch.dtype = torch.bfloat16
) -> dict[str, float]:
    """Bytes one GPU holds in a training step with AdamW under FSDP2 on ``gpus`` GPUs, ``batch`` sequences of
    ``seq`` tokens per GPU (``fused``: liger_lab's patched model, else eager Hugging Face).

    Parameters, gradients and AdamW states are sharded: a GPU holds 1/gpus of each. Activations and the loss's
    buffers belong to the GPU's own batch and do not shrink. On several GPUs, FSDP2 also holds the full
    parameters of the unit it computes: ``gathered unit`` counts the largest unit's, less the shard already
    counted (one unit at a time; prefetching the next one holds a second).
    """
    if gpus < 1:
        raise ValueError(f"gpus is {gpus}: expected at least 1")
    one_gpu = memory_breakdown(config, batch, seq, dtype=dtype, fused=fused)
    size = torch.empty((), dtype=dtype).element_size()
    largest_unit = max(unit_parameters(config).values()) * size
    return {
        "parameters": one_gpu["weights"] / gpus,
        "gradients": one_gpu["gradients"] / gpus,
        "AdamW states": one_gpu["AdamW states"] / gpus,
        "activations": one_gpu["activations"],
        "logits and loss": one_gpu["logits and loss"],
        "gathered unit": largest_unit * (1 - 1 / gpus),
    }


def traffic_per_gpu(config, gpus: int, *, dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes each GPU receives per step under FSDP2: every parameter all-gathered twice (forward, backward)
    and every gradient reduce-scattered once, each moving (gpus - 1) / gpus of the full tensor."""
    size = torch.empty((), dtype=dtype).element_size()
    return 3 * count_parameters(config) * size * (gpus - 1) / gpus


# ---------------------------------------------------------------------------------------------------------------
# The models, batches and setups every process builds


def tiny_llama() -> nn.Module:
    """A patched tiny Llama on CPU, the same in every process (seeded)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).train()
    liger_lab.patch(model)
    return model


def llama_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of the whole batch: every sequence keeps the same number of targets on each process."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return input_ids, input_ids.clone()


def wrap(model: nn.Module, case: str) -> nn.Module:
    """``model`` set up for one of :data:`CASES` (in place for FSDP2)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if case not in CASES:
        raise ValueError(f"case is {case!r}: expected one of {list(CASES)}")
    if case == "ddp":
        return DistributedDataParallel(model)
    if case == "fsdp2_checkpointing":
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.25's name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
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


class HeadModel(nn.Module):
    """hidden = tanh(body(x)), then ``loss(lm_head, hidden, target)``: the last layer, a head and a loss."""

    def __init__(self, loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the same weights in every process, the caller's seed untouched
            torch.manual_seed(0)
            self.body = nn.Linear(HEAD_HIDDEN, HEAD_HIDDEN)
            self.lm_head = nn.Linear(HEAD_HIDDEN, HEAD_VOCAB)
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(self.lm_head, torch.tanh(self.body(x)), target)


def head_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(x, target) of the whole batch of the head-loss model."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(HEAD_TOKENS, HEAD_HIDDEN, generator=generator)
    return x, torch.randint(0, HEAD_VOCAB, (HEAD_TOKENS,), generator=generator)


def fused_head_loss(head: nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The one-process reference: the fused loss on the head's weight and bias as they are."""
    return liger_lab.fused_linear_cross_entropy(hidden, head.weight, target, head.bias)


# ---------------------------------------------------------------------------------------------------------------
# One process of a launch


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    """What a parameter or gradient is here: its type and shape, and for a DTensor this process's shard."""
    from torch.distributed.tensor import DTensor

    view = {"type": type(tensor).__name__, "shape": list(tensor.shape)}
    if isinstance(tensor, DTensor):
        view["local_shape"] = list(tensor.to_local().shape)
        view["placements"] = ", ".join(repr(p) for p in tensor.placements)
    return view


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().float()


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (a collective for sharded ones: every process calls it), on CPU."""
    return {name: _full(p.grad).cpu() for name, p in model.named_parameters()}


def _relative_errors(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: ((grads[name] - ref).norm() / ref.norm()).item() for name, ref in expected.items()}


def _mean_loss(loss: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return (loss / dist.get_world_size()).cpu()


def _count_fused_calls(seen: list[dict[str, Any]]) -> Callable[[], None]:
    """Route the patched models' fused loss through a wrapper that records the weight it receives; returns the
    function that puts the original back."""
    from liger_lab.ops import fused_linear_cross_entropy as flce_ops

    fused = flce_ops.fused_linear_cross_entropy

    @torch.compiler.disable  # an observation: run as it is where the model is compiled, never traced
    def note(weight: torch.Tensor) -> None:
        seen.append(describe(weight))

    def recording(hidden, weight, *args, **kwargs):
        note(weight)
        return fused(hidden, weight, *args, **kwargs)

    flce_ops.fused_linear_cross_entropy = recording

    def restore() -> None:
        flce_ops.fused_linear_cross_entropy = fused

    return restore


def _run_case(case: str, device: torch.device, rows: slice, reference: dict[str, Any]) -> dict[str, Any]:
    model = wrap(copy.deepcopy(tiny_llama()).to(device), case)
    inner = model.module if case == "ddp" else model
    head = inner.lm_head
    before, in_forward = describe(head.weight), {}

    @torch.compiler.disable  # after the decoder, inside the model's forward, before the loss; never traced
    def record_in_forward(module, args, output):
        in_forward["view"] = describe(head.weight)

    handle = inner.model.register_forward_hook(record_in_forward)
    seen: list[dict[str, Any]] = []
    restore = _count_fused_calls(seen)
    input_ids, labels = (t[rows].to(device) for t in llama_batch())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(input_ids=input_ids, labels=labels).loss
            after_forward = describe(head.weight)
            loss.backward()
    finally:
        restore()
        handle.remove()
    grads = _gradients(inner)
    errors = _relative_errors(grads, reference["grads"])
    return {
        "loss": _mean_loss(loss),
        "expected_loss": reference["loss"],
        "grads": grads,
        "expected_grads": reference["grads"],
        "worst_grad": max(errors.items(), key=lambda item: item[1]),
        "fused_calls": len(seen),
        "fallbacks": [str(w.message) for w in caught if "materialises the logits" in str(w.message)],
        "views": {  # lm_head.weight along the step, in order
            "between calls": before,
            "in the model's forward, outside lm_head's call": in_forward["view"],
            "received by the fused loss": seen[0] if seen else None,
            "after the forward": after_forward,
            "its gradient after the backward": describe(head.weight.grad),
        },
    }


def _small_llama(device: torch.device) -> nn.Module:
    """A patched Llama large enough to learn for a few steps (hidden 256, 4 layers, vocabulary 4096), seeded."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    return liger_lab.patch(transformers.LlamaForCausalLM(config).to(device).train())


def _curve(device: torch.device, rank: int, world: int, steps: int) -> dict[str, list[float]]:
    """The losses of ``steps`` AdamW steps of :func:`_small_llama` with bf16 parameters: on one process, and sharded
    by FSDP2 (lm_head a unit of its own) with each process stepping on its rows of the same batches. The same
    recipe on both sides, so the curves differ only by where the sums round (the gradients are averaged over the
    processes); a one-GPU run under autocast would keep an fp32 residual stream and drift further."""
    pool = torch.randint(0, 4096, (8, 128), generator=torch.Generator().manual_seed(2)).to(device)
    batches = [pool[4 * (step % 2) : 4 * (step % 2) + 4] for step in range(steps)]  # two batches, cycled
    reference = _small_llama(device).to(torch.bfloat16)
    sharded = wrap(_small_llama(device).to(torch.bfloat16), "fsdp2_head_unit")
    curves: dict[str, list[float]] = {"one process": [], f"FSDP2, {world} processes": []}
    per_rank = batches[0].shape[0] // world
    for model, label in ((reference, "one process"), (sharded, f"FSDP2, {world} processes")):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for input_ids in batches:
            if model is reference:
                loss = train_step(model, optimizer, input_ids)
            else:  # this process's rows; the loss averaged over the processes
                loss = _mean_loss(train_step(model, optimizer, input_ids[rank * per_rank : (rank + 1) * per_rank]))
            curves[label].append(loss.item())
    return curves


def _llama_reference(rank_device: torch.device) -> dict[str, Any]:
    model = tiny_llama().to(rank_device)
    input_ids, labels = (t.to(rank_device) for t in llama_batch())
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    return {"loss": loss.detach().cpu(), "grads": {name: p.grad.cpu() for name, p in model.named_parameters()}}


def _load_function(name: str, source: str) -> Callable:
    from torch.distributed.tensor import DTensor

    namespace = {"torch": torch, "liger_lab": liger_lab, "hf": hf, "DTensor": DTensor}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # the source of a function the caller wrote
    return namespace[name]


def _run_head_loss(fn: Callable, device: torch.device, rows: slice) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = HeadModel(fn).to(device)
    fully_shard(model.lm_head)
    fully_shard(model)
    x, target = (t[rows].to(device) for t in head_batch())
    error = None
    try:
        loss = model(x, target)
    except Exception as raised:  # reported to the caller; every process must agree before the backward
        error = f"{type(raised).__name__}: {raised}"
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(failed)
    if failed.item():
        return {"error": error or "it raised in another process"}
    loss.backward()
    return {"loss": _mean_loss(loss), "grads": _gradients(model)}


def _head_reference(device: torch.device) -> dict[str, Any]:
    model = HeadModel(fused_head_loss).to(device)
    x, target = (t.to(device) for t in head_batch())
    loss = model(x, target)
    loss.backward()
    return {"loss": loss.detach().cpu(), "grads": {name: p.grad.cpu() for name, p in model.named_parameters()}}


def join_processes(timeout_s: float) -> tuple[torch.device, str]:
    """Join the process group of a ``torchrun`` launch: NCCL with this process's GPU (``LOCAL_RANK``) as its
    device, or gloo on CPU. A collective that waits longer than ``timeout_s`` fails (a peer that died, or ran out
    of memory, must not leave the others waiting). Returns (device, backend)."""
    import torch.distributed as dist

    device = runtime.pick(cpu=runtime.DEVICE, gpu=torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = runtime.pick(cpu="gloo", gpu="nccl")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return device, backend


def worker(plan: dict[str, Any], out_path: str) -> None:
    """One process of :func:`launch`: the runs of ``plan``; process 0 writes the report to ``out_path``."""
    import torch.distributed as dist

    device, backend = join_processes(timeout_s=300)
    rank, world = dist.get_rank(), dist.get_world_size()
    where = runtime.pick(cpu="CPU (kernels in Triton's interpreter)", gpu=f"{world} GPUs")
    report: dict[str, Any] = {"launch": f"{world} processes, {backend} on {where}", "cases": {}, "head_losses": {}}
    if plan["cases"]:
        reference = _llama_reference(device)
        per_rank = BATCH // world
        for case in plan["cases"]:
            report["cases"][case] = _run_case(case, device, slice(rank * per_rank, (rank + 1) * per_rank), reference)
    if plan["head_losses"]:
        report["head_reference"] = _head_reference(device)
        per_rank = HEAD_TOKENS // world
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        for label, function in plan["head_losses"].items():
            fn = _load_function(function["name"], function["source"])
            report["head_losses"][label] = _run_head_loss(fn, device, rows)
    if plan.get("curve_steps"):
        report["curves"] = _curve(device, rank, world, plan["curve_steps"])
    if rank == 0:
        torch.save(report, out_path)
    # Leave together: one process tearing the group down while its peer still holds it open is a teardown race
    # (a loaded CPU machine once saw a gloo process abort there, failing a launch whose work had succeeded).
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# The launch, from a notebook, a test or a script


def head_loss_problem(fn: Callable) -> str | None:
    """Run the head loss ``fn`` here, on the model unsharded, and say in one line what makes it not the fused loss
    that trains like one process, or None: ``lm_head`` returned logits (the loss was not its forward), the fused
    loss never ran, or a parameter got no gradient (``lm_head.bias got no gradient``). An error raised by ``fn``
    itself propagates, with its traceback."""
    from liger_lab.ops import fused_linear_cross_entropy as flce_ops

    model = HeadModel(fn).to(runtime.DEVICE)
    logits: list[tuple[int, ...]] = []

    def watch_output(module, args, output):
        if isinstance(output, torch.Tensor) and output.dim() and output.shape[-1] == module.out_features:
            logits.append(tuple(output.shape))

    calls = []
    fused = liger_lab.fused_linear_cross_entropy

    def counting(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    handle = model.lm_head.register_forward_hook(watch_output)
    liger_lab.fused_linear_cross_entropy = flce_ops.fused_linear_cross_entropy = counting
    try:
        x, target = (t.to(runtime.DEVICE) for t in head_batch())
        model(x, target).backward()
    finally:
        liger_lab.fused_linear_cross_entropy = flce_ops.fused_linear_cross_entropy = fused
        handle.remove()
    if logits:
        return (
            f"lm_head returned logits of shape {logits[0]}: the loss must run as lm_head's forward, with the fused "
            "loss in place of its matmul"
        )
    if not calls:
        return "liger_lab.fused_linear_cross_entropy never ran: the loss is not the fused one"
    missing = [name for name, parameter in model.named_parameters() if parameter.grad is None]
    if missing:
        return f"{missing[0]} got no gradient" + (f" (nor {', '.join(missing[1:])})" if missing[1:] else "")
    return None


def _source(fn: Callable) -> str:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as error:
        raise ValueError(f"the source of {fn!r} cannot be read: expected a function defined with def") from error


def launch(
    cases: Sequence[str] = (),
    head_losses: dict[str, Callable] | None = None,
    *,
    curve_steps: int = 0,
    nproc: int = WORLD,
    timeout_s: float = 600,
) -> dict[str, Any]:
    """Run ``cases`` (names of :data:`CASES`) and ``head_losses`` in ``nproc`` processes; return process 0's
    report: ``launch`` (backend and devices), then per case or head loss the loss, the gradients and the
    one-process reference (``cases``: also the worst gradient, the fused loss's calls, any fallback, and what
    ``lm_head.weight`` was along the step; a head loss that raised, or that :func:`head_loss_problem` finds is not
    the fused loss training like one process, has ``error`` instead, a line that says why). ``curve_steps``: also
    ``curves``, the losses of that many training steps of a small Llama in one process and under FSDP2."""
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}: expected names from {list(CASES)}")
    if BATCH % nproc or HEAD_TOKENS % nproc:
        raise ValueError(f"nproc is {nproc}: expected a divisor of {BATCH} (the batches are split evenly)")
    sources, problems = {}, {}
    for label, fn in (head_losses or {}).items():
        source = {"name": fn.__name__, "source": _source(fn)}
        problem = head_loss_problem(fn)  # here first, unsharded: errors come with a traceback
        if problem is None:
            sources[label] = source
        else:
            problems[label] = {"error": problem}
    if not cases and not sources and not curve_steps:  # nothing left for the processes to run
        return {"launch": "not launched", "cases": {}, "head_losses": problems}
    env = dict(os.environ)
    gpus = runtime.pick(cpu=0, gpu=torch.cuda.device_count())
    if gpus < nproc:  # not one GPU per process: every process runs on CPU, in Triton's interpreter
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as folder:
        plan_path, out_path = Path(folder) / "plan.json", Path(folder) / "report.pt"
        plan_path.write_text(json.dumps({"cases": list(cases), "head_losses": sources, "curve_steps": curve_steps}))
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "liger_lab.distributed", str(plan_path), str(out_path),
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"the {nproc} processes failed (exit code {done.returncode}):\n{done.stderr[-4000:]}")
        report = torch.load(out_path, weights_only=True)
    report["head_losses"].update(problems)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One process of liger_lab.distributed.launch (under torchrun).")
    parser.add_argument("plan", help="JSON: the cases and the head losses' sources")
    parser.add_argument("out", help="where process 0 writes the report (torch.save)")
    args = parser.parse_args(argv)
    worker(json.loads(Path(args.plan).read_text()), args.out)


if __name__ == "__main__":
    main()
