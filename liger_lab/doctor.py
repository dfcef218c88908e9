"""Before a full run: profile, patch, check and train *your* model at *your* shapes (``liger-lab doctor``).

What to do before trusting a kernel library with a training run, in one command, on a local model directory
(its weights are loaded when it has any, else random weights from its ``config.json``) or a ``config.json``
(random weights), at the batch, sequence length and dtype of the run. Nothing is downloaded; the data are random
tokens of the config's vocabulary, the same for both models. Five stages, each printed as it finishes:

1. **The unpatched training step, profiled** (``torch.profiler``): time per category, the share of the step
   each op that :func:`liger_lab.patch` replaces holds (the most patching can gain: Amdahl's bound), and the
   peak memory of the forward, the backward and the optimizer step.
2. **What patch replaces** and what it leaves alone, and why (:func:`liger_lab.patch_report`).
3. **Every replaced module against its original**, on the inputs it received in one forward of the model
   (captured by forward pre-hooks): the output and the gradient of every input that carried one in the model and
   of every parameter, each against the original module run in float64. The tolerance is the dtype's
   (:data:`liger_lab.workbook.checks.TOLERANCE`), raised to twice transformers' own error at that dtype where
   transformers' module is less exact than that (a bf16 decoder layer can be). The loss is checked the same way: the
   patched model's fused loss and transformers' (``lm_head`` and cross-entropy) on the final hidden states.
4. **The patched training step**: tokens/s, peak memory and the phase it is in, its profile beside the unpatched
   one (where the time went, and whether the host now holds it), the loss of every step against the unpatched
   model's (same weights, seed and data; :func:`liger_lab.e2e.compare_losses`, relative tolerance the dtype's
   machine epsilon but at least 1e-4), and every fallback that fired (liger_lab's warnings while patching and
   training: a loss that materialises the logits, an activation with no kernel).
5. **A verdict**: the gain, the memory saved, on a GPU whether the step waits on the host (and what removes the
   wait), every check that failed, and (``max_batch``, on a GPU) the largest
   batch each model trains without running out of memory.

Each model trains ``steps`` steps: the first is a warm-up (AdamW creates its states, Triton compiles its kernels)
and is not timed; tokens/s (of the median step, each timed alone), the host's CPU time per step and the peaks by
phase come from the others. Then each model takes one more step under the profiler and, on a GPU with a plot
asked for, one more that records its memory timeline.

**How profiler time is put into categories.** Module hooks open a ``record_function`` range while a module runs,
named by its class: ``...RMSNorm``/``LayerNorm`` -> norms, ``...MLP``/``...Experts`` -> activations,
``...Attention`` -> attention, ``...RotaryEmbedding`` -> RoPE, the causal LM itself -> loss (the ops it runs
outside its base model and ``lm_head``: transformers' loss), the base model -> other; the modeling module's
``apply_rotary_pos_emb`` gets a RoPE range too while the step is profiled. Each operator then gets, first match
wins: optimizer (inside ``Optimizer.step``/``zero_grad``), attention (it or an operator around it is a
scaled-dot-product attention: SDPA's own matmuls are attention), matmuls (it or an operator around it is a matrix
product: ``aten::mm``, ``addmm``, ``bmm``, ``linear``, ...), liger_lab's own operator around it by its name
(``liger_lab::add_rms_norm`` runs in a fused decoder layer, outside any norm module), the innermost module range
around it, and in the backward the category of the forward operator that created its autograd node (matched by
sequence number), else other. Op names alone cannot tell a norm's ``mul`` from an activation's; module ranges alone
would put every projection into attention or activations; together they need no list of model-specific names. On a
GPU each operator's own kernels' time is counted (``self_device_time_total``, not again for CUPTI's records of its
launches; kernels no operator launched count as other) and **host idle** is the step's wall time with no kernel
running (the GPU waiting on Python and launches); in Triton's interpreter (CPU) each operator's own CPU time, and
host idle is the time with no operator running (Python between them): host-bound figures that say nothing about a
GPU.

The benchmark's model-independent pieces come from :mod:`liger_lab.e2e` (``import_transformers``, ``random_batch``,
``make_optimizer``, ``reset_peak_memory``, ``peak_memory_gib``, ``environment``). Private helpers used:
``hf.registry.UNFUSED`` (a fused class's transformers class) and ``hf.loss._REPORTED_FALLBACKS`` (emptied for
the run so that a fallback warned earlier in the process is warned, and seen, again).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import math
import os
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, record_function
from torch.utils import _pytree as pytree

import liger_lab
from liger_lab import hf, runtime
from liger_lab.e2e import training
from liger_lab.e2e.memory import GIB, allocated_timeline, downsample_max, live_at_peak
from liger_lab.e2e.presets import DTYPES, default_dtype, import_transformers
from liger_lab.e2e.reports import compare_losses, format_comparison, plot_timelines
from liger_lab.e2e.training import make_optimizer, peak_memory_gib, random_batch, reset_peak_memory, timer_label
from liger_lab.op_checks import CheckCase, run_case
from liger_lab.workbook import checks

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SEED = 0
LR = 1e-4
STAGES = 5
PHASES = ("forward", "backward", "optimizer")
CATEGORIES = ("matmuls", "attention", "norms", "activations", "RoPE", "loss", "optimizer", "other", "host idle")
REPLACEABLE = ("norms", "activations", "RoPE", "loss")
"""The categories whose ops :func:`liger_lab.patch` replaces."""
HOST_BOUND_SHARE = 0.3
"""A patched step whose GPU runs no kernel for this share of its wall clock or more waits on the host: the verdict
says so, and names what takes the host out of a step (CUDA graphs)."""
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
_RANGE = "liger_lab.doctor: "
_MATMULS = frozenset(
    f"aten::{name}"
    for name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot", "_scaled_mm", "_grouped_mm")
)
_BACKWARD = "autograd::engine::evaluate_function: "
# liger_lab's own operators by a part of their name (a fused decoder layer calls add_rms_norm outside any norm module).
_LIGER_LAB_OPS = (("norm", "norms"), ("glu", "activations"), ("rope", "RoPE"), ("cross_entropy", "loss"))


# --------------------------------------------------------------------------------------------------
# The run's arguments


@dataclass(frozen=True)
class Plan:
    """The checked arguments of one run: where the model comes from and the sizes it trains at."""

    source: Path
    config: PretrainedConfig
    weights: Path | None  # the directory whose weights are loaded; None: random weights from the config
    batch: int
    seq: int
    dtype: torch.dtype
    steps: int
    max_batch: int | None = None
    json_path: Path | None = None
    plot_path: Path | None = None


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return default_dtype()
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype is {dtype!r}: expected one of {sorted(DTYPES)}")


def prepare(
    model: str | os.PathLike,
    *,
    batch: int | None = None,
    seq: int | None = None,
    dtype: str | torch.dtype | None = None,
    steps: int | None = None,
    max_batch: int | None = None,
    json_path: str | os.PathLike | None = None,
    plot_path: str | os.PathLike | None = None,
) -> Plan:
    """Check the arguments of :func:`doctor` and read the model's config; ``ValueError`` says what is wrong.

    Defaults: batch 8 x seq 2048 in bf16 over 6 steps on a GPU; batch 1 x seq 16 in fp32 over 3 steps in
    Triton's interpreter, which refuses bf16 (its bf16 stores truncate, so every check would measure the
    interpreter) and ``max_batch`` (a CPU has no memory limit to find)."""
    source = Path(model)
    if source.is_dir():
        config_file = source / "config.json"
        weights = source if any(any(source.glob(pattern)) for pattern in WEIGHT_FILES) else None
    elif source.is_file() and source.suffix == ".json":
        config_file, weights = source, None
    else:
        raise ValueError(f"model {str(source)!r}: expected a local model directory or a config.json file")
    if not config_file.is_file():
        raise ValueError(f"model directory {str(source)!r} has no config.json")
    sizes = {"batch": batch, "seq": seq, "steps": steps, "max_batch": max_batch}
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or value < (2 if name == "steps" else 1)):
            least = "at least 2 (the first step is an untimed warm-up)" if name == "steps" else "a positive integer"
            raise ValueError(f"{name} is {value!r}: expected {least}")
    dtype = _dtype(dtype)
    if runtime.INTERPRET and dtype == torch.bfloat16:
        raise ValueError(
            "dtype bf16 in Triton's interpreter: its bf16 stores truncate instead of rounding, so the checks would "
            "measure the interpreter: use fp32 or fp16 on CPU (bf16 on a GPU)"
        )
    batch = batch or runtime.pick(cpu=1, gpu=8)
    if max_batch is not None and runtime.INTERPRET:
        raise ValueError("max_batch needs a CUDA GPU: on CPU there is no memory limit to find")
    if max_batch is not None and max_batch < batch:
        raise ValueError(f"max_batch is {max_batch}: expected at least the batch, {batch}")
    try:
        config = import_transformers().AutoConfig.from_pretrained(config_file)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {config_file}: {error}") from None
    if config.model_type not in hf.FAMILIES:
        raise ValueError(
            f"{config_file} is a {config.model_type!r} model: liger_lab.patch supports {sorted(hf.FAMILIES)}"
        )
    config.use_cache = False
    return Plan(
        source,
        config,
        weights,
        batch,
        seq or runtime.pick(cpu=16, gpu=2048),
        dtype,
        steps or runtime.pick(cpu=3, gpu=6),
        max_batch,
        Path(json_path) if json_path else None,
        Path(plot_path) if plot_path else None,
    )


def _build(plan: Plan) -> nn.Module:
    """The model of ``plan`` on :data:`runtime.DEVICE`, in train mode: its weights, or random ones (seeded, so two
    builds are the same model)."""
    auto = import_transformers().AutoModelForCausalLM
    torch.manual_seed(SEED)
    common = dict(config=plan.config, dtype=plan.dtype, attn_implementation="sdpa")
    if plan.weights is not None:
        model = auto.from_pretrained(plan.weights, local_files_only=True, **common).to(runtime.DEVICE)
    else:
        with torch.device(runtime.DEVICE):
            model = auto.from_config(common.pop("config"), **common)
    return model.train()


# --------------------------------------------------------------------------------------------------
# Training steps: phases, timing, memory


@contextlib.contextmanager
def _phase(name: str, peaks: dict[str, int] | None) -> Iterator[None]:
    """Record the peak allocated bytes of one phase of a step into ``peaks`` (GPU; nothing on CPU)."""
    if peaks is None or runtime.INTERPRET:
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    yield
    peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated())


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, peaks=None) -> torch.Tensor:
    """:func:`liger_lab.e2e.train_step`, with the peak memory of each phase recorded when ``peaks`` is given."""
    with _phase("forward", peaks):
        loss = model(input_ids=tokens, labels=tokens).loss
    with _phase("backward", peaks):
        loss.backward()
    with _phase("optimizer", peaks):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@dataclass
class TrainRun:
    """One model trained ``len(losses)`` steps on the same batch."""

    label: str
    losses: list[float]
    tokens_per_s: float
    step_ms: float
    peak_gib: float | None  # the largest phase peak: weights and optimizer states included; None on CPU
    phase_peak_gib: dict[str, float] | None
    host_ms: float | None = None  # the host's CPU time per step (median), every thread of the process

    @property
    def peak_phase(self) -> str | None:
        """The phase the step's peak memory is in."""
        return max(self.phase_peak_gib, key=self.phase_peak_gib.get) if self.phase_peak_gib else None

    def row(self, plan: Plan) -> dict[str, Any]:
        """This run as a row of :func:`liger_lab.e2e.compare_losses`."""
        return {"op": "e2e", "impl": self.label, "batch": plan.batch, "seq": plan.seq, "losses": self.losses}


def _train(label: str, model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, steps: int):
    """Train ``steps`` steps; the first is untimed, the others give tokens/s and the peak of each phase.

    Each timed step is timed on its own (the device synchronised after it) and the median counts: a step that
    still warms something up (a cache, an allocator's first blocks, a late compile) moves a mean of a few steps
    far more than their median. The host's CPU time per step (every thread: the autograd engine's too) is
    measured beside it, for a model whose step waits on the host."""
    torch.manual_seed(SEED)
    losses = [_step(model, optimizer, tokens)]
    runtime.synchronize()
    reset_peak_memory()
    peaks: dict[str, int] = {}
    walls, hosts = [], []
    for _ in range(steps - 1):
        start, cpu = time.perf_counter(), time.process_time()
        losses.append(_step(model, optimizer, tokens, peaks))
        hosts.append(time.process_time() - cpu)
        runtime.synchronize()
        walls.append(time.perf_counter() - start)
    step_s, host_s = statistics.median(walls), statistics.median(hosts)
    phase_peaks = {name: round(peaks[name] / GIB, 3) for name in PHASES if name in peaks} or None
    return TrainRun(
        label,
        [round(v, 5) for v in torch.stack(losses).float().tolist()],
        round(tokens.numel() / step_s, 1),
        round(step_s * 1e3, 3),
        max(phase_peaks.values()) if phase_peaks else None,
        phase_peaks,
        round(host_s * 1e3, 3),
    )


def _memory_timeline(label: str, model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> dict:
    """Allocated memory through one more step and what holds it at the peak: :func:`liger_lab.e2e.memory_timeline`
    for this model (that function builds a preset's model itself). GPU only."""
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        _step(model, optimizer, tokens)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    times, allocated = downsample_max(*allocated_timeline(trace, start))
    return {
        "impl": label,
        "t_ms": [round(t, 3) for t in times],
        "allocated_gib": [round(a / GIB, 4) for a in allocated],
        "live_at_peak": live_at_peak(trace),
    }


def _largest_batch(model: nn.Module, plan: Plan) -> dict[str, Any]:
    """One step at each batch from ``plan.batch`` up to ``plan.max_batch`` (doubling, then the maximum itself)
    until one runs out of memory; one model and optimizer serve every size, as in
    :func:`liger_lab.e2e.largest_fit` (which builds a preset's model itself)."""
    batches = [plan.batch]
    while batches[-1] * 2 < plan.max_batch:
        batches.append(batches[-1] * 2)
    batches = sorted({*batches, plan.max_batch})
    optimizer = make_optimizer(model, LR)
    fits: list[dict[str, Any]] = []
    oom_at = None
    for index, batch in enumerate([batches[0], *batches]):  # the first step creates AdamW's states, unrecorded
        reset_peak_memory()
        try:
            _step(model, optimizer, random_batch(plan.config, batch, plan.seq, SEED))
            runtime.synchronize()
        except torch.cuda.OutOfMemoryError:
            oom_at = batch
            break
        if index:
            fits.append({"batch": batch, "peak_gib": peak_memory_gib()})
    optimizer.zero_grad(set_to_none=True)
    del optimizer
    torch.cuda.empty_cache()
    return {"fits": fits, "oom_at": oom_at, "largest": fits[-1]["batch"] if fits else None}


# --------------------------------------------------------------------------------------------------
# Stage 1: the profile


@dataclass
class StepProfile:
    """One training step under ``torch.profiler``, by category (see the module docstring)."""

    wall_ms: float  # the profiled step's wall time (the profiler's overhead included)
    clock: str
    by_category_ms: dict[str, float]

    def share(self, category: str) -> float:
        return self.by_category_ms.get(category, 0.0) / self.wall_ms if self.wall_ms else 0.0

    @property
    def replaceable_share(self) -> float:
        return sum(self.share(category) for category in REPLACEABLE)

    @property
    def bound(self) -> float:
        """How many times faster the step would be if every op patch replaces took no time at all."""
        return 1 / (1 - self.replaceable_share) if self.replaceable_share < 1 else math.inf


def host_row(run: TrainRun, profile: StepProfile) -> tuple[str, str, str]:
    """The verdict's row on the host (GPU only): the GPU's kernel time in a step against the step's wall clock and
    the host's CPU time; where the GPU idles :data:`HOST_BOUND_SHARE` of the step or more, what removes the wait.
    Kernel time is the profiled step's (every category but host idle), the step's wall clock the timed median."""
    kernels_ms = profile.wall_ms - profile.by_category_ms.get("host idle", 0.0)
    idle = max(0.0, 1 - kernels_ms / run.step_ms) if run.step_ms else 0.0
    host = "not measured" if run.host_ms is None else f"{run.host_ms:.1f} ms"
    figures = f"GPU kernels {kernels_ms:.1f} ms of a {run.step_ms:.1f} ms step, host CPU {host}"
    if idle >= HOST_BOUND_SHARE:
        figures += (
            f': the GPU waits on the host {idle:.0%} of the step. torch.compile(model, mode="reduce-overhead") '
            "replays the compiled step as CUDA graphs, without the host's per-op work "
            "(liger-lab bench e2e --compile-mode reduce-overhead measures it)"
        )
    return ("host", "", figures)


def _range_category(module: nn.Module, model: nn.Module) -> str | None:
    """The category of the ops a module runs itself, by its class name (see the module docstring)."""
    if module is model:
        return "loss"
    if module is getattr(model, model.base_model_prefix, None):
        return "other"
    name = type(module).__name__
    if name.endswith(("RMSNorm", "LayerNorm")) or isinstance(module, nn.LayerNorm):
        return "norms"
    if name.endswith("RotaryEmbedding"):
        return "RoPE"
    if name.endswith(("MLP", "Experts")):
        return "activations"
    if name.endswith("Attention"):
        return "attention"
    return None


@contextlib.contextmanager
def _category_ranges(model: nn.Module) -> Iterator[None]:
    """While profiling: a ``record_function`` range around each module of a category, and around the modeling
    module's ``apply_rotary_pos_emb``."""
    open_ranges: list[record_function] = []

    def enter(category: str) -> Callable[..., None]:
        def hook(*_: object) -> None:
            open_ranges.append(record_function(_RANGE + category))
            open_ranges[-1].__enter__()

        return hook

    def leave(*_: object) -> None:
        open_ranges.pop().__exit__(None, None, None)

    handles = []
    for module in model.modules():
        category = _range_category(module, model)
        if category is not None:
            handles.append(module.register_forward_pre_hook(enter(category)))
            handles.append(module.register_forward_hook(leave, always_call=True))
    modeling = sys.modules[type(model).__module__]
    rope = getattr(modeling, "apply_rotary_pos_emb", None)
    if callable(rope):

        @functools.wraps(rope)
        def labelled_rope(*args, **kwargs):
            with record_function(_RANGE + "RoPE"):
                return rope(*args, **kwargs)

        modeling.apply_rotary_pos_emb = labelled_rope
    try:
        yield
    finally:
        if callable(rope):
            modeling.apply_rotary_pos_emb = rope
        for handle in handles:
            handle.remove()


def _ancestry(event) -> Iterator[Any]:
    while event is not None:
        yield event
        event = event.cpu_parent


def _liger_lab_category(name: str) -> str | None:
    if name.startswith("liger_lab::"):
        return next((label for part, label in _LIGER_LAB_OPS if part in name), None)
    return None


def time_by_category(events: Sequence[Any], wall_ms: float, *, device: bool) -> dict[str, float]:
    """Milliseconds per category of :data:`CATEGORIES` of the events of a profiled step (``prof.events()``):
    each CPU event's own kernels' time (``device=True``) or its own CPU time, by the rules of the module docstring;
    kernels no CPU event launched count as other, and host idle is ``wall_ms`` minus all of it."""
    cpu = torch.autograd.DeviceType.CPU
    kernels_ms = sum(e.self_device_time_total for e in events if e.device_type != cpu and not e.is_user_annotation)
    events = sorted((e for e in events if e.device_type == cpu), key=lambda e: e.time_range.start)
    creators = {}  # (thread, sequence number) -> the last forward event with it: the op that made that autograd node
    for event in events:
        if event.sequence_nr >= 0 and not any(e.name.startswith(_BACKWARD) for e in _ancestry(event)):
            creators[(event.thread, event.sequence_nr)] = event
    memo: dict[int, str] = {}  # by the event object: the profiler's ids are not unique (CUPTI's records reuse them)

    def category(event) -> str:
        if id(event) in memo:
            return memo[id(event)]
        chain = list(_ancestry(event))
        ops = [e for e in chain if not e.is_user_annotation]
        ours = [label for e in ops if (label := _liger_lab_category(e.name))]
        label = "other"
        if any(e.name.startswith("Optimizer.") for e in chain):
            label = "optimizer"
        elif any("attention" in e.name.lower() for e in ops):
            label = "attention"
        elif any(e.name in _MATMULS for e in ops):
            label = "matmuls"
        elif ours:
            label = ours[0]
        elif ranges := [e.name.removeprefix(_RANGE) for e in chain if e.name.startswith(_RANGE)]:
            label = ranges[0]
        elif node := next((e for e in chain if e.name.startswith(_BACKWARD)), None):
            creator = creators.get((node.fwd_thread, node.sequence_nr))
            label = category(creator) if creator is not None else "other"
        memo[id(event)] = label
        return label

    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if not device:
            totals[category(event)] += event.self_cpu_time_total / 1e3
        elif event.kernels and not any(e.kernels == event.kernels for e in _ancestry(event.cpu_parent)):
            # An event inside an operator that carries exactly its kernels is CUPTI's record of that operator's
            # launches ("Command Buffer Full" under cudaLaunchKernel when the launch queue is full), not work.
            totals[category(event)] += event.self_device_time_total / 1e3
    if device:
        totals["other"] += max(0.0, kernels_ms / 1e3 - sum(totals.values()))
    totals["host idle"] = max(0.0, wall_ms - sum(totals.values()))
    return {name: round(ms, 4) for name, ms in totals.items()}


def profile_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> StepProfile:
    """One training step under ``torch.profiler``, its time by category (:func:`time_by_category`)."""
    activities = [ProfilerActivity.CPU] + ([] if runtime.INTERPRET else [ProfilerActivity.CUDA])
    with _category_ranges(model), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with runtime.profile(activities=activities) as prof:
            runtime.synchronize()
            start = time.perf_counter()
            _step(model, optimizer, tokens)
            runtime.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3
    by_category = time_by_category(prof.events(), wall_ms, device=not runtime.INTERPRET)
    clock = runtime.pick(
        cpu="CPU time of each operator in Triton's interpreter (host-bound, not GPU figures)",
        gpu="GPU time of each operator's kernels",
    )
    return StepProfile(round(wall_ms, 3), clock, by_category)


# --------------------------------------------------------------------------------------------------
# Stage 3: every replaced module against its original


@dataclass
class ModuleCheck:
    """One replaced module (or the loss) against transformers' in float64, and transformers' own error."""

    module: str
    kind: str
    shape: str  # of its first differentiable input
    status: str  # PASS or FAIL
    worst: str  # which output or gradient has the largest error (or the exception raised)
    rel_error: float | None  # that largest relative L2 error
    original_rel_error: float | None  # the transformers module's own largest error at this dtype
    tol: float
    detail: str = ""


@dataclass
class _Call:
    """The arguments one module received in the model's forward, flattened: the leaves that required grad vary."""

    leaves: list[Any]
    spec: Any
    varying: list[int]
    names: list[str]


def _detached(value: object) -> object:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _capture(modules: dict[str, nn.Module]) -> tuple[dict[str, _Call], Callable[[], None]]:
    """Forward pre-hooks that record each module's first call; returns the records and a function removing them."""
    calls: dict[str, _Call] = {}

    def hook(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if name in calls:
            return
        flat, spec = pytree.tree_flatten_with_path((args, kwargs))
        positional = [p.name for p in inspect.signature(module.forward).parameters.values()]
        leaves, varying, names = [], [], []
        for path, value in flat:
            if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
                varying.append(len(leaves))
                names.append(_argument_name(path, positional))
            leaves.append(_detached(value))
        calls[name] = _Call(leaves, spec, varying, names)

    handles = [m.register_forward_pre_hook(functools.partial(hook, n), with_kwargs=True) for n, m in modules.items()]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return calls, remove


def _argument_name(path: tuple, positional: list[str]) -> str:
    """``hidden_states`` for the first positional argument of ``forward(self, hidden_states)`` or a keyword of that
    name; an index follows for a tensor inside a tuple (``position_embeddings[0]``)."""
    _, key, *inner = path  # (args or kwargs, the argument, where in it)
    name = (
        key.key
        if isinstance(key, pytree.MappingKey)
        else (positional[key.idx] if key.idx < len(positional) else f"argument {key.idx}")
    )
    return name + "".join(f"[{getattr(k, 'idx', getattr(k, 'key', '?'))}]" for k in inner)


class _OwnGradient(torch.autograd.Function):
    """The identity, whose backward hands on a copy of the incoming gradient. In the model a fused norm's backward
    writes its input's gradient over the gradient it receives, which nothing else reads; in a check, the harness
    reads that gradient again for the reference."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


def _floating_outputs(value: object) -> tuple[torch.Tensor, ...]:
    leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return tuple(_OwnGradient.apply(v) if v.requires_grad else v for v in leaves)


def _unfused_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of a patched module with transformers' classes back (its children's too), in ``dtype``."""
    clone = copy.deepcopy(module)
    for part in clone.modules():
        if type(part) in hf.registry.UNFUSED:
            part.__class__ = hf.registry.UNFUSED[type(part)]
            part.__dict__.pop("in_place_backward", None)
    return clone.to(dtype)


def _module_caller(module: nn.Module, call: _Call, params: list[str], dtype: torch.dtype | None = None):
    """``fn(*varying inputs, *params)`` running ``module`` on the recorded call; ``dtype`` casts the recorded
    floating constants (RoPE's cos and sin, a float mask) for a float64 reference."""
    leaves = [
        v.to(dtype) if dtype and isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in call.leaves
    ]

    def fn(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(leaves)
        for index, tensor in zip(call.varying, tensors, strict=False):
            values[index] = tensor
        args, kwargs = pytree.tree_unflatten(values, call.spec)
        weights = dict(zip(params, tensors[len(call.varying) :], strict=True))
        return _floating_outputs(torch.func.functional_call(module, weights, args, kwargs))

    return fn


def _tolerance(dtype: torch.dtype, original: float | None) -> float:
    tol = checks.TOLERANCE[dtype]
    return max(tol, 2 * original) if original is not None and math.isfinite(original) else tol


def _worst(detail: str) -> tuple[str, float | None]:
    """The comparison with the largest relative error among a check's printed lines, and that error."""
    figures = []
    for line in detail.splitlines():
        if " rel L2 " in line:
            value = float(line.split(" rel L2 ")[1].split()[0])
            figures.append((math.inf if math.isnan(value) else value, line.split(": ", 1)[1].split("  rel L2")[0]))
    if not figures:
        return (detail.splitlines() or ["?"])[-1], None
    value, label = max(figures)
    return label, value


def _compare(name: str, kind: str, fn, original_fn, reference, inputs, input_names, dtype) -> ModuleCheck:
    """transformers' module at ``dtype`` against float64 first (its error sets the tolerance), then ours."""
    shape = str(tuple(inputs[0].shape)) if inputs else "()"
    case = CheckCase(name, dtype, shape, original_fn, reference, inputs, input_names)
    original = run_case(case)
    tol = _tolerance(dtype, original.worst_rel_error)
    ours = run_case(dataclasses.replace(case, fn=fn, tol=tol))
    worst, _ = _worst(ours.detail)
    return ModuleCheck(
        name, kind, shape, ours.status, worst, ours.worst_rel_error, original.worst_rel_error, tol, ours.detail
    )


def _check_module(name: str, module: nn.Module, call: _Call, dtype: torch.dtype) -> ModuleCheck:
    params = [n for n, p in module.named_parameters() if p.requires_grad]
    inputs = [call.leaves[i] for i in call.varying] + [module.get_parameter(n).detach() for n in params]
    original = _unfused_copy(module, dtype)
    reference = _unfused_copy(module, torch.float64)
    return _compare(
        name,
        type(original).__name__,
        _module_caller(module, call, params),
        _module_caller(original, call, params),
        _module_caller(reference, call, params, torch.float64),
        inputs,
        call.names + params,
        dtype,
    )


class _Replay(nn.Module):
    """Stands in for a causal LM's base model: returns its recorded output with the hidden states it is handed, so
    that the model's forward runs only its loss (``lm_head`` and cross-entropy, or the fused loss; a mixture of
    experts adds the load-balancing loss of the recorded router logits)."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output
        self.hidden: torch.Tensor | None = None

    def forward(self, *args: object, **kwargs: object):
        return dataclasses.replace(self.output, last_hidden_state=self.hidden)


def _check_loss(model: nn.Module, output: Any, tokens: torch.Tensor, dtype: torch.dtype) -> ModuleCheck:
    """The patched model's loss (``skip_logits=True``: the fused loss) and transformers' (``skip_logits=False``, the
    forward transformers wrote) on the base model's recorded ``output`` (the final hidden states vary), with
    ``lm_head``'s weights."""
    params = [f"lm_head.{n}" for n, p in model.lm_head.named_parameters() if p.requires_grad]
    base = model.base_model_prefix
    replay = _Replay(output)

    def caller(skip_logits: bool):
        def fn(hidden: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
            replay.hidden = hidden
            kwargs = dict(input_ids=tokens, labels=tokens, skip_logits=skip_logits)
            return torch.func.functional_call(model, dict(zip(params, weights, strict=True)), (), kwargs).loss

        return fn

    inputs = [output.last_hidden_state] + [model.get_parameter(n).detach() for n in params]
    original_base = getattr(model, base)
    setattr(model, base, replay)
    try:
        return _compare(
            "loss",
            "lm_head + cross-entropy",
            caller(True),
            caller(False),
            caller(False),
            inputs,
            ["hidden_states"] + params,
            dtype,
        )
    finally:
        setattr(model, base, original_base)


def replaced_modules(model: nn.Module) -> tuple[list[str], hf.PatchReport, list[str]]:
    """Patch ``model``, note which modules patch replaced, its report and the warnings it gave (an activation
    without a kernel), and unpatch it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        liger_lab.patch(model)
    report = hf.patch_report(model)
    # An experts module of fused class runs transformers' own kernel unless the report counts its fused loop.
    loop = any(kind.startswith("MoE experts") for kind in report.replaced)  # (SwiGLU) or (GeGLU)
    fused = [
        name
        for name, module in model.named_modules()
        if type(module) in hf.registry.UNFUSED and (loop or not type(module).__name__.endswith("Experts"))
    ]
    liger_lab.unpatch(model)
    return fused, report, [str(w.message) for w in caught]


def check_modules(
    model: nn.Module, fused: Sequence[str], loss: bool, tokens: torch.Tensor, dtype: torch.dtype
) -> list[ModuleCheck]:
    """Check each module named in ``fused`` (and the loss when ``loss``) of the unpatched ``model`` against its
    patched version, on the inputs each received in one forward of ``model``; leaves ``model`` patched."""
    calls, remove = _capture({name: model.get_submodule(name) for name in fused})
    outputs: list[Any] = []
    base = getattr(model, model.base_model_prefix)
    handle = base.register_forward_hook(lambda _m, _a, out: outputs.append(pytree.tree_map(_detached, out)))
    try:
        model(input_ids=tokens, labels=tokens)
    finally:
        remove()
        handle.remove()
    with warnings.catch_warnings():  # what patch warns of was heard by replaced_modules
        warnings.simplefilter("ignore")
        liger_lab.patch(model)
    results = [_check_module(name, model.get_submodule(name), calls[name], dtype) for name in fused]
    if loss:
        results.append(_check_loss(model, outputs[0], tokens, dtype))
    return results


# --------------------------------------------------------------------------------------------------
# The result


@dataclass
class DoctorResult:
    """Everything one run found; ``str()`` is the report, :meth:`as_dict` the JSON."""

    model: str
    model_type: str
    parameters: int
    weights: str
    dtype: str
    batch: int
    seq: int
    steps: int
    device: str
    timer: str
    profile: StepProfile  # of the unpatched step
    patch: hf.PatchReport
    checks: list[ModuleCheck]
    unpatched: TrainRun
    patched: TrainRun
    losses: dict[str, Any]
    fallbacks: list[str]
    patched_profile: StepProfile
    largest_batch: dict[str, dict[str, Any]] | None = None
    timelines: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> list[str]:
        """What failed: each module check and the loss curve."""
        failed = [f"check of {c.module}" for c in self.checks if c.status != "PASS"]
        return failed + ([] if self.losses["agree"] else ["loss curve"])

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def gain(self) -> float:
        return self.patched.tokens_per_s / self.unpatched.tokens_per_s

    def verdict(self) -> list[tuple[str, str, str]]:
        """(what, PASS/FAIL or "", figures) rows of the verdict table."""
        host = " (CPU interpreter wall clock: not GPU speed)" if self.unpatched.peak_gib is None else ""
        rows = [
            (
                "speed",
                "",
                f"{self.gain:.2f}x tokens/s: {self.patched.tokens_per_s:,.1f} against "
                f"{self.unpatched.tokens_per_s:,.1f}{host}",
            )
        ]
        if self.unpatched.peak_gib is None:
            rows.append(("peak memory", "", "not measured: no CUDA memory on CPU"))
        else:
            saved = self.unpatched.peak_gib - self.patched.peak_gib
            rows.append(
                (
                    "peak memory",
                    "",
                    f"{saved:.2f} GiB saved: {self.patched.peak_gib:.2f} GiB (in the "
                    f"{self.patched.peak_phase}) against {self.unpatched.peak_gib:.2f} (in the "
                    f"{self.unpatched.peak_phase})",
                )
            )
            rows.append(host_row(self.patched, self.patched_profile))
        failed = [c for c in self.checks if c.status != "PASS"]
        figures = f"{len(self.checks) - len(failed)} of {len(self.checks)} passed"
        measured = [c for c in self.checks if c.rel_error is not None]
        if measured:
            worst = max(measured, key=lambda c: c.rel_error / c.tol)
            figures += f"; largest error: {worst.worst} of {worst.module}, {worst.rel_error:.1e} (tol {worst.tol:.0e})"
        if failed:
            figures += "; failed: " + ", ".join(f"{c.module} ({c.worst})" for c in failed)
        rows.append(("module checks", "FAIL" if failed else "PASS", figures))
        rows.append(("loss curve", "PASS" if self.losses["agree"] else "FAIL", self.losses["detail"]))
        rows.append(("fallbacks", "", f"{len(self.fallbacks)} fired (above)" if self.fallbacks else "none fired"))
        if self.largest_batch:
            fits = ", ".join(f"{label} {fit['largest'] or 'none'}" for label, fit in self.largest_batch.items())
            rows.append((f"largest batch (seq {self.seq})", "", fits))
        return rows

    def as_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready, with the shares of the profile, the peaks' phases, the verdict and ``ok``."""
        data = dataclasses.asdict(self)
        for name in ("profile", "patched_profile"):
            data[name]["share"] = {c: round(getattr(self, name).share(c), 4) for c in CATEGORIES}
        data["profile"]["bound_if_replaced_took_zero"] = round(self.profile.bound, 4)
        for run in ("unpatched", "patched"):
            data[run]["peak_phase"] = getattr(self, run).peak_phase
        verdict = [dict(zip(("what", "result", "figures"), row, strict=True)) for row in self.verdict()]
        # The environment at the top level as well, as every row of benchmarks/results/ carries it
        # (liger_lab.workbook.results).
        return {**self.environment, **data, "verdict": verdict, "ok": self.ok}

    def __str__(self) -> str:
        return "\n\n".join(
            [
                format_header(
                    self.model,
                    self.model_type,
                    self.parameters,
                    self.weights,
                    self.batch,
                    self.seq,
                    self.dtype,
                    self.steps,
                ),
                format_profile(self.profile, self.unpatched),
                format_patch(self.patch),
                format_checks(self.checks, self.dtype),
                format_training(
                    self.unpatched,
                    self.patched,
                    self.profile,
                    self.patched_profile,
                    self.losses,
                    self.fallbacks,
                    self.timer,
                ),
                format_verdict(self),
            ]
        )


def format_header(
    model: str, model_type: str, parameters: int, weights: str, batch: int, seq: int, dtype: str, steps: int
) -> str:
    lines = [
        f"liger-lab doctor {model}: {model_type}, {parameters / 1e6:,.2f}M parameters, {weights}; batch "
        f"{batch} x seq {seq}, {dtype}, {steps} steps per model",
        runtime.describe(),
    ]
    if runtime.INTERPRET:
        lines.append("Every time below is host-bound wall clock of Triton's interpreter on CPU, not a GPU figure.")
    return "\n".join(lines)


def _category_table(profiles: dict[str, StepProfile]) -> list[str]:
    lines = [f"  {'category':<14}" + "".join(f"{label + ' ms':>16}{'share':>7}" for label in profiles)]
    for name in CATEGORIES:
        figures = "".join(f"{p.by_category_ms[name]:>16.3f}{p.share(name):>7.1%}" for p in profiles.values())
        lines.append(f"  {name:<14}{figures}")
    return lines


def format_profile(prof: StepProfile, run: TrainRun) -> str:
    lines = [
        f"[1/{STAGES}] the unpatched training step: {run.step_ms:.1f} ms ({prof.wall_ms:.1f} ms under the "
        f"profiler); by category, {prof.clock}:",
        *_category_table({"unpatched": prof}),
    ]
    shares = ", ".join(f"{c} {prof.share(c):.1%}" for c in REPLACEABLE)
    lines.append(
        f"  ops patch replaces: {shares}; {prof.replaceable_share:.1%} of the step, so at most "
        f"{prof.bound:.2f}x faster if they took no time"
    )
    return "\n".join([*lines, "  " + _phases(run)])


def _phases(run: TrainRun) -> str:
    if run.phase_peak_gib is None:
        return "peak memory by phase: not measured (CUDA memory only)"
    phases = ", ".join(f"{name} {gib:.2f} GiB" for name, gib in run.phase_peak_gib.items())
    return f"peak memory by phase: {phases} (peak in the {run.peak_phase})"


def format_patch(report: hf.PatchReport) -> str:
    return f"[2/{STAGES}] what patch replaces\n" + "\n".join("  " + line for line in str(report).splitlines())


def format_checks(results: Sequence[ModuleCheck], dtype: str) -> str:
    def width(values: Sequence[str], least: int) -> int:
        return max([least, *(len(v) + 2 for v in values)])

    module, kind = width([c.module for c in results], 8), width([c.kind for c in results], 6)
    shape, worst = width([c.shape for c in results], 7), width([c.worst[:40] for c in results], 18)
    lines = [
        f"[3/{STAGES}] each replaced module against transformers' in float64, on its inputs of one forward "
        f"({dtype}; errors are relative L2)",
        f"  {'module':<{module}}{'kind':<{kind}}{'input':<{shape}}{'largest error of':<{worst}}{'liger_lab':>10}"
        f"{'transformers':>13}{'tol':>7}  result",
    ]
    for c in results:
        ours = "" if c.rel_error is None else f"{c.rel_error:.1e}"
        theirs = "" if c.original_rel_error is None else f"{c.original_rel_error:.1e}"
        lines.append(
            f"  {c.module:<{module}}{c.kind:<{kind}}{c.shape:<{shape}}{c.worst[:40]:<{worst}}{ours:>10}"
            f"{theirs:>13}{c.tol:>7.0e}  {c.status}"
        )
    for c in results:
        if c.status != "PASS":
            lines.append(f"  {c.module}:\n" + "\n".join("    " + line for line in c.detail.splitlines()))
    return "\n".join(lines)


def format_training(
    unpatched: TrainRun,
    patched: TrainRun,
    profile: StepProfile,
    patched_profile: StepProfile,
    losses: dict[str, Any],
    fallbacks: Sequence[str],
    timer: str,
) -> str:
    header = f"  {'model':<11}{'tokens/s':>11}{'step ms':>10}{'host ms':>10}{'peak GiB':>10}  loss per step"
    lines = [f"[4/{STAGES}] the patched training step [{timer}]", header]
    for run in (unpatched, patched):
        peak = "n/a" if run.peak_gib is None else f"{run.peak_gib:.2f}"
        host = "n/a" if run.host_ms is None else f"{run.host_ms:.1f}"
        losses_text = " ".join(f"{v:.5f}" for v in run.losses)
        lines.append(
            f"  {run.label:<11}{run.tokens_per_s:>11,.1f}{run.step_ms:>10.1f}{host:>10}{peak:>10}  {losses_text}"
        )
    lines += ["  patched " + _phases(patched), "  " + format_comparison(losses)]
    lines.append(
        f"  one step of each under the profiler ({profile.wall_ms:.1f} and {patched_profile.wall_ms:.1f} ms), "
        f"{profile.clock}:"
    )
    lines += _category_table({"unpatched": profile, "patched": patched_profile})
    lines.append("  fallbacks: " + ("none fired" if not fallbacks else f"{len(fallbacks)} fired"))
    return "\n".join(lines + [f"    {message}" for message in fallbacks])


def format_verdict(result: DoctorResult) -> str:
    rows = result.verdict()
    width = max(len(what) for what, _, _ in rows) + 2
    lines = [f"[5/{STAGES}] verdict"]
    lines += [f"  {what:<{width}}{status + '  ' if status else ''}{figures}" for what, status, figures in rows]
    return "\n".join(lines + ["  " + ("PASS: no check failed" if result.ok else "FAIL: " + ", ".join(result.failed))])


# --------------------------------------------------------------------------------------------------
# The run


@contextlib.contextmanager
def _fallbacks_seen(found: list[str]) -> Iterator[None]:
    """Collect the fallbacks liger_lab warns of while a patched model runs (its messages start with "liger_lab:"),
    every one: the record of those already warned of in this process is emptied for the while, then merged back.
    Other warnings are warned again, each once."""
    warned = set(hf.loss._REPORTED_FALLBACKS)
    hf.loss._REPORTED_FALLBACKS.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        hf.loss._REPORTED_FALLBACKS.update(warned)
    others = {}
    for warning in caught:
        if str(warning.message).startswith("liger_lab"):
            found.append(str(warning.message))
        else:
            others.setdefault((str(warning.message), warning.category), warning)
    for warning in others.values():  # someone else's warnings, each once
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def _release_memory() -> None:
    if not runtime.INTERPRET:
        torch.cuda.empty_cache()


def run(plan: Plan, progress: Callable[[str], None] | None = print) -> DoctorResult:
    """The five stages of :func:`doctor` for a checked :class:`Plan`, each printed through ``progress`` as it
    finishes."""
    say = progress or (lambda _: None)
    tokens = random_batch(plan.config, plan.batch, plan.seq, SEED)
    dtype = next(name for name, value in DTYPES.items() if value == plan.dtype)
    weights = f"weights from {plan.weights}" if plan.weights else "random weights from its config"
    model = _build(plan)
    parameters = sum(p.numel() for p in model.parameters())
    say(
        format_header(
            str(plan.source), plan.config.model_type, parameters, weights, plan.batch, plan.seq, dtype, plan.steps
        )
    )
    say(f"\ntraining the unpatched model {plan.steps} steps, then profiling one ...")
    optimizer = make_optimizer(model, LR)
    unpatched = _train("unpatched", model, optimizer, tokens, plan.steps)
    step_profile = profile_step(model, optimizer, tokens)
    record_timelines = bool(plan.plot_path) and not runtime.INTERPRET
    timelines = [_memory_timeline("unpatched", model, optimizer, tokens)] if record_timelines else []
    say(format_profile(step_profile, unpatched))
    del model, optimizer
    _release_memory()

    model = _build(plan)  # the same weights again
    fused, report, fallbacks = replaced_modules(model)
    say("\n" + format_patch(report))
    loss = "loss (fused linear cross-entropy)" in report.replaced
    say(f"\nchecking {len(fused)} replaced modules{' and the loss' if loss else ''} against transformers' ...")
    with _fallbacks_seen(fallbacks):
        module_checks = check_modules(model, fused, loss, tokens, plan.dtype)
        say(format_checks(module_checks, dtype))
        _release_memory()
        say(f"\ntraining the patched model {plan.steps} steps, then profiling one ...")
        optimizer = make_optimizer(model, LR)
        patched = _train("patched", model, optimizer, tokens, plan.steps)
        patched_profile = profile_step(model, optimizer, tokens)
        if record_timelines:
            timelines.append(_memory_timeline("patched", model, optimizer, tokens))
    fallbacks = list(dict.fromkeys(fallbacks))
    rows = [unpatched.row(plan), patched.row(plan)]
    losses = compare_losses(rows, "unpatched", "patched", rtol=max(torch.finfo(plan.dtype).eps, 1e-4))
    say(format_training(unpatched, patched, step_profile, patched_profile, losses, fallbacks, timer_label()))
    del optimizer
    _release_memory()
    largest = None
    if plan.max_batch:
        say(f"\nthe largest batch up to {plan.max_batch} at seq {plan.seq}, patched and unpatched ...")
        patched_fit = _largest_batch(model, plan)
        liger_lab.unpatch(model)
        largest = {"unpatched": _largest_batch(model, plan), "patched": patched_fit}
    liger_lab.unpatch(model)  # lets go of transformers' RoPE function now, not when a collection finds the model
    result = DoctorResult(
        str(plan.source),
        plan.config.model_type,
        parameters,
        weights,
        dtype,
        plan.batch,
        plan.seq,
        plan.steps,
        runtime.describe(),
        timer_label(),
        step_profile,
        report,
        module_checks,
        unpatched,
        patched,
        losses,
        fallbacks,
        patched_profile,
        largest,
        timelines,
        training.environment(),
    )
    say("\n" + format_verdict(result))
    _write(result, plan, say)
    return result


def _write(result: DoctorResult, plan: Plan, say: Callable[[str], None]) -> None:
    if plan.json_path:
        plan.json_path.parent.mkdir(parents=True, exist_ok=True)
        plan.json_path.write_text(json.dumps(result.as_dict(), indent=1) + "\n")
        say(f"wrote {plan.json_path}")
    if plan.plot_path and runtime.INTERPRET:
        say(f"no plot written to {plan.plot_path}: there is no CUDA memory timeline on CPU")
    elif plan.plot_path:
        plan.plot_path.parent.mkdir(parents=True, exist_ok=True)
        plot_timelines(result.timelines).savefig(plan.plot_path, dpi=120, bbox_inches="tight")
        say(f"wrote {plan.plot_path}")


def doctor(
    model: str | os.PathLike, *, progress: Callable[[str], None] | None = print, **settings: Any
) -> DoctorResult:
    """Profile, patch, check and train ``model`` (a local model directory or a ``config.json``): the five stages of the
    module docstring, each printed through ``progress`` as it finishes (None: silent). ``settings`` are the keywords
    of :func:`prepare`, which checks them: ``batch`` x ``seq`` in ``dtype`` ("fp32", "fp16", "bf16" or a torch
    dtype) over ``steps``; ``max_batch`` (GPU) also finds the largest batch up to it that each model trains;
    ``json_path`` writes :meth:`DoctorResult.as_dict`, ``plot_path`` the two memory timelines (GPU). Bad arguments
    raise ``ValueError`` before anything runs. The result's ``ok`` is False when a module check failed or the loss
    curves disagree."""
    return run(prepare(model, **settings), progress)


class _CallableModule(types.ModuleType):
    """This module, callable: after ``import liger_lab.doctor``, ``liger_lab.doctor(model, ...)`` is :func:`doctor`."""

    def __call__(self, *args: Any, **kwargs: Any) -> DoctorResult:
        return doctor(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
