"""Train a preset for a few steps in one mode: tokens/s, peak memory, the loss of every step; fit, timeline, profile.

Modes:

* ``"hf"``: the model as Hugging Face writes it (eager PyTorch, SDPA attention);
* ``"liger_lab"``: after :func:`liger_lab.patch` (fused RMSNorm, RoPE, SwiGLU or GeGLU, linear + cross-entropy);
* ``"liger"``: after Liger-Kernel's ``apply_liger_kernel_to_llama`` (``_qwen3``, ``_gemma3_text``: the
  family's) with the same kernels (when installed);
* ``"hf+compile"`` and ``"liger_lab+compile"``: the same two models, then ``model.compile()`` (the
  forward and, through AOTAutograd, the backward; the AdamW step stays eager). The first warm-up step
  compiles; it is timed on its own (``compile_s``) and never counted in tokens/s.

Patching replaces module-level functions of transformers, so every function here that patches (any mode but
``"hf"``) belongs in a fresh process: :func:`liger_lab.e2e.run_isolated`. The pieces of a step
(:func:`build_model`, :func:`apply_mode`, :func:`make_optimizer`, :func:`random_batch`, :func:`train_step`,
:func:`reset_peak_memory`, :func:`peak_memory_gib`, :func:`environment`, :func:`result_row`) are public so that
other benchmarks (FSDP2, the doctor, profiles) train exactly as this one does.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

import liger_lab
from liger_lab import profiling, runtime
from liger_lab.e2e.memory import GIB, allocated_timeline, count_parameters, downsample_max, live_at_peak
from liger_lab.e2e.presets import default_dtype, family_of, import_transformers

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODES = ("hf", "liger_lab", "liger", "hf+compile", "liger_lab+compile")
COMPILE_SUFFIX = "+compile"


def base_mode(mode: str) -> str:
    """``"liger_lab+compile"`` -> ``"liger_lab"``: the eager mode a compile mode starts from."""
    return mode.removesuffix(COMPILE_SUFFIX)


def is_compiled(mode: str) -> bool:
    return mode.endswith(COMPILE_SUFFIX)


def compile_available() -> bool:
    """Whether ``torch.compile`` with its default backend (inductor) can run here: Dynamo supports this
    Python and platform, and, on CPU, where inductor writes C++, a C++ compiler is found."""
    try:
        import torch._dynamo

        if not torch._dynamo.is_dynamo_supported():
            return False
    except Exception:
        return False
    if not runtime.INTERPRET:
        return True
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:
        return any(shutil.which(cxx) for cxx in ("g++", "clang++", "c++"))


def available_modes() -> list[str]:
    """The modes that can run in this install: eager ones first, then their compiled versions."""
    modes = ["hf"]
    if hasattr(liger_lab, "patch"):
        modes.append("liger_lab")
    if profiling.liger_kernel_installed() and not runtime.INTERPRET:
        modes.append("liger")
    if compile_available():
        modes += [m + COMPILE_SUFFIX for m in ("hf", "liger_lab") if m in modes]
    return modes


def build_model(config: PretrainedConfig, *, dtype: torch.dtype | None = None, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised causal LM of ``config``'s family (``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
    ``Gemma3ForCausalLM``) on :data:`runtime.DEVICE`, in ``dtype``, in train mode."""
    model_class = getattr(import_transformers(), family_of(config).model_class)
    torch.manual_seed(seed)
    with torch.device(runtime.DEVICE):
        model = model_class._from_config(config, dtype=dtype or default_dtype(), attn_implementation="sdpa")
    return model.train()


# The kernels both patched modes swap in, so that "liger" and "liger_lab" are measured doing the same work, under the
# keywords liger_lab.patch and Liger-Kernel's apply_liger_kernel_to_* share. The gated MLP's keyword differs:
# swiglu in liger_lab (GeGLU for Gemma too), the family's gated_mlp in Liger-Kernel.
FUSED = dict(rope=True, rms_norm=True, fused_linear_cross_entropy=True, cross_entropy=False)


def apply_mode(
    model: torch.nn.Module,
    mode: str,
    *,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    loss_chunk_tokens: int | None = None,
) -> torch.nn.Module:
    """Swap in the kernels of ``mode`` (this changes module-level functions of transformers: one mode
    per process); for a ``+compile`` mode, then compile the model in place (``model.compile``, so
    ``model(...)`` runs the compiled forward and the optimizer keeps the same parameters) with torch.compile's
    backend ``compile_backend`` and mode ``compile_mode`` (None: its default; ``"reduce-overhead"``: the compiled
    graphs replayed as CUDA graphs on a GPU); an eager mode ignores both. Returns the model. ``loss_chunk_tokens``:
    :func:`liger_lab.patch`'s, for the liger_lab modes."""
    if mode not in MODES:
        raise ValueError(f"mode is {mode!r}: expected one of {MODES}")
    base = base_mode(mode)
    if loss_chunk_tokens is not None and base != "liger_lab":
        raise ValueError(f"loss_chunk_tokens is liger_lab's option: expected None in mode {mode!r}")
    if base == "liger_lab":
        liger_lab.patch(model, **FUSED, swiglu=True, loss_chunk_tokens=loss_chunk_tokens)
    elif base == "liger":
        import liger_kernel.transformers

        family = family_of(model.config)
        getattr(liger_kernel.transformers, family.liger_patch)(model=model, **FUSED, **{family.gated_mlp: True})
    if is_compiled(mode):
        model.compile(backend=compile_backend, mode=compile_mode)
    return model


def random_batch(config: PretrainedConfig, batch: int, seq: int, seed: int) -> torch.Tensor:
    """One fixed batch of random tokens on :data:`runtime.DEVICE`. Training on it over a few steps shows the model
    still learns (it memorises the batch), and every mode sees the same data."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(runtime.DEVICE)


def reset_peak_memory() -> None:
    """Start a peak-memory measurement: the caching allocator's free blocks returned, its peak reset (GPU only)."""
    if not runtime.INTERPRET:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float | None:
    """``max_memory_allocated`` since :func:`reset_peak_memory`, in GiB; None on CPU."""
    return None if runtime.INTERPRET else round(torch.cuda.max_memory_allocated() / GIB, 2)


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the model's parameters: the fused CUDA implementation (no list-sized temporaries) on the GPU, the
    default one on CPU."""
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=not runtime.INTERPRET)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    """One training step on ``tokens`` (its own labels): forward, backward, optimizer step, gradients set to None.
    Returns a detached copy of the loss (no host read). A copy, because a model compiled with
    ``mode="reduce-overhead"`` returns outputs that live in its CUDA graphs' memory, which the next step overwrites
    (and reading one afterwards raises)."""
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().clone()


def _compile_counts() -> dict[str, int]:
    # Dynamo's counters: graphs compiled so far and graph breaks met while tracing.
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def environment() -> dict[str, Any]:
    """What every end-to-end row records of where it ran: :func:`liger_lab.profiling.environment` and transformers'
    version."""
    from importlib.metadata import version

    return {**profiling.environment(), "transformers": version("transformers")}


def result_row(mode: str, config: PretrainedConfig, batch: int, seq: int, **fields: Any) -> dict[str, Any]:
    """A training row: op "e2e", the mode as impl, the size, the model's family, vocabulary, layers and parameters,
    ``fields``, then :func:`environment`."""
    return {
        "op": "e2e", "impl": mode, "batch": batch, "seq": seq, "family": config.model_type,
        "vocab": config.vocab_size, "layers": config.num_hidden_layers,
        "params_M": round(count_parameters(config) / 1e6, 2), **fields, **environment(),
    }  # fmt: skip


def train(
    mode: str,
    config: PretrainedConfig,
    batch: int,
    seq: int,
    *,
    steps: int = 5,
    warmup: int = 2,
    dtype: torch.dtype | None = None,
    lr: float = 1e-4,
    seed: int = 0,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    loss_chunk_tokens: int | None = None,
) -> dict[str, Any]:
    """Train ``steps`` timed steps after ``warmup`` untimed ones; return one result row.

    The row has tokens_per_s (over the timed steps), peak_gib (``max_memory_allocated`` over the whole
    run, weights and optimizer states included; None on CPU), losses (every step, warm-up ones first,
    5 digits), loss0 (first step) and loss_last, compile_s (wall time of the first warm-up step: where
    torch.compile traces and generates code in a ``+compile`` mode, and Triton compiles the kernels it
    launches; None without warm-up), ms_per_step and host_ms_per_step (the process's CPU time, every thread, over
    the timed steps), gpu_ms_per_step (the kernel sum of two more steps under the profiler, after the timed ones;
    None on CPU), or ``"oom": True`` when the GPU ran out of memory.

    A ``+compile`` mode always has at least one warm-up step, so compilation is never timed; its row
    also says how many graphs were compiled (``graphs``), how many of them during the timed steps
    (``timed_compiles``: a recompile there would make tokens/s wrong) and the graph breaks.
    ``compile_backend`` and ``compile_mode`` are torch.compile's backend (``"aot_eager"`` skips code generation)
    and mode (``"reduce-overhead"``: CUDA graphs);
    ``loss_chunk_tokens`` is :func:`liger_lab.patch`'s (liger_lab modes).

    Patching reaches beyond the model (RoPE is a module-level function of transformers): for any mode
    but ``"hf"``, call this in a fresh process (:func:`liger_lab.e2e.run_isolated`).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps {steps}, warmup {warmup}: expected steps >= 1 and warmup >= 0")
    if mode not in MODES:
        raise ValueError(f"mode is {mode!r}: expected one of {MODES}")
    compiled = is_compiled(mode)
    if compiled:
        warmup = max(warmup, 1)
    dtype = dtype or default_dtype()
    info: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "steps": steps, "warmup": warmup,
                            "timer": timer_label()}  # fmt: skip
    if compiled:
        info["compile_backend"] = compile_backend
        if compile_mode is not None:
            info["compile_mode"] = compile_mode
    compile_s = None
    try:
        model = build_model(config, dtype=dtype, seed=seed)
        apply_mode(
            model, mode, compile_backend=compile_backend, compile_mode=compile_mode, loss_chunk_tokens=loss_chunk_tokens
        )
        optimizer = make_optimizer(model, lr)
        tokens = random_batch(config, batch, seq, seed)
        reset_peak_memory()
        losses = []
        for index in range(warmup):
            start = time.perf_counter()
            losses.append(train_step(model, optimizer, tokens))
            runtime.synchronize()
            if index == 0:
                compile_s = time.perf_counter() - start
        before = _compile_counts() if compiled else {}
        runtime.synchronize()
        start, host_start = time.perf_counter(), time.process_time()
        losses += [train_step(model, optimizer, tokens) for _ in range(steps)]
        runtime.synchronize()
        elapsed, host = time.perf_counter() - start, time.process_time() - host_start
        # Profiled apart from the timed steps (the profiler slows the host): what the GPU did in a step.
        gpu_ms = runtime.measure_kernel_sum_ms(lambda: train_step(model, optimizer, tokens), calls=2)
    except torch.cuda.OutOfMemoryError:
        return result_row(mode, config, batch, seq, oom=True, **info)
    if compiled:
        after = _compile_counts()
        info.update(graphs=after["graphs"], timed_compiles=after["graphs"] - before["graphs"],
                    graph_breaks=after["graph_breaks"])  # fmt: skip
    curve = [round(loss, 5) for loss in torch.stack(losses).float().tolist()]
    return result_row(
        mode, config, batch, seq, tokens_per_s=round(batch * seq * steps / elapsed, 1), peak_gib=peak_memory_gib(),
        loss0=round(curve[0], 4), loss_last=round(curve[-1], 4), losses=curve,
        compile_s=None if compile_s is None else round(compile_s, 3), ms_per_step=round(1e3 * elapsed / steps, 2),
        host_ms_per_step=round(1e3 * host / steps, 2), gpu_ms_per_step=None if gpu_ms is None else round(gpu_ms, 2),
        **info,
    )  # fmt: skip


def varying_lengths() -> tuple[int, ...]:
    """DESIGN's round-4 lengths: 10 new sequence lengths, 384..1536 on a GPU (short ones on CPU)."""
    return runtime.pick(cpu=tuple(range(8, 27, 2)), gpu=tuple(range(384, 1537, 128)))


def train_lengths(
    mode: str, config: PretrainedConfig, batch: int, *, dtype: torch.dtype | None = None, lr: float = 1e-4,
    seed: int = 0, compile_backend: str = "inductor", compile_mode: str | None = None,
    loss_chunk_tokens: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One step at each of :func:`varying_lengths`, then the same lengths again, timed: whether a compiled model
    meets a new length without recompiling each time, and what a step costs then. The row has ms_per_step (the
    second pass's mean), first_pass_s (the first pass, compiles included), graphs (compiled in the whole run) and
    host_ms_per_step. Call it in a fresh process, as :func:`train`."""
    lengths = varying_lengths()
    dtype = dtype or default_dtype()
    model = build_model(config, dtype=dtype, seed=seed)
    apply_mode(
        model, mode, compile_backend=compile_backend, compile_mode=compile_mode, loss_chunk_tokens=loss_chunk_tokens
    )
    optimizer = make_optimizer(model, lr)
    batches = [random_batch(config, batch, length, seed + length) for length in lengths]
    start = time.perf_counter()
    for tokens in batches:
        train_step(model, optimizer, tokens)
    runtime.synchronize()
    first_pass = time.perf_counter() - start
    start, host_start = time.perf_counter(), time.process_time()
    losses = [train_step(model, optimizer, tokens) for tokens in batches]
    runtime.synchronize()
    elapsed, host = time.perf_counter() - start, time.process_time() - host_start
    return {
        **result_row(mode, config, batch, 0, loss_last=round(losses[-1].item(), 4), dtype=str(dtype)[6:]),
        "op": "e2e_lengths", "lengths": list(lengths), "first_pass_s": round(first_pass, 2),
        "ms_per_step": round(1e3 * elapsed / len(lengths), 2), "host_ms_per_step": round(1e3 * host / len(lengths), 2),
        "graphs": _compile_counts()["graphs"] if is_compiled(mode) else None, "timer": timer_label(),
        **({"compile_mode": compile_mode} if compile_mode is not None and is_compiled(mode) else {}),
    }  # fmt: skip


def timer_label() -> str:
    """How tokens/s is timed here."""
    return "CUDA synchronised wall clock" if not runtime.INTERPRET else "CPU wall clock (interpreter, not GPU speed)"


def largest_fit(
    mode: str,
    config: PretrainedConfig,
    shapes: Sequence[tuple[int, int]],
    *,
    dtype: torch.dtype | None = None,
    lr: float = 1e-4,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
) -> dict[str, Any]:
    """Try one training step at each (batch, seq), smallest token count first, until one runs out of
    memory. Returns {"fits": [...], "oom_at": [batch, seq] or None, "largest": [batch, seq] or None}.

    One model and optimizer serve every size (as in a real run, the AdamW states stay allocated). On
    CPU there is no memory limit to find: every size "fits", so pass small sizes there.
    """
    model = build_model(config, dtype=dtype or default_dtype())
    apply_mode(model, mode, compile_backend=compile_backend, compile_mode=compile_mode)
    optimizer = make_optimizer(model, lr)
    fits: list[dict[str, Any]] = []
    oom_at = None
    for batch, seq in sorted(shapes, key=lambda s: (s[0] * s[1], s[1])):
        reset_peak_memory()
        try:
            train_step(model, optimizer, random_batch(config, batch, seq, 0))
            runtime.synchronize()
        except torch.cuda.OutOfMemoryError:
            oom_at = [batch, seq]
            break
        fits.append({"batch": batch, "seq": seq, "peak_gib": peak_memory_gib()})
    largest = [fits[-1]["batch"], fits[-1]["seq"]] if fits else None
    return {"op": "e2e_fit", "impl": mode, "family": config.model_type, "fits": fits, "oom_at": oom_at,
            "largest": largest, **environment()}  # fmt: skip


def memory_timeline(
    mode: str,
    config: PretrainedConfig,
    batch: int,
    seq: int,
    *,
    dtype: torch.dtype | None = None,
    lr: float = 1e-4,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
) -> dict[str, Any]:
    """Allocated GPU memory through one training step (after a warm-up step made the optimizer states),
    from the caching allocator's history, and the largest blocks allocated in that step that are alive at its peak
    (:func:`liger_lab.e2e.live_at_peak`). On CPU there is no allocator history: returns an empty timeline with a
    note."""
    if runtime.INTERPRET:
        return {"op": "e2e_timeline", "impl": mode, "t_ms": [], "allocated_gib": [],
                "note": "memory timelines need a CUDA GPU"}  # fmt: skip
    model = build_model(config, dtype=dtype or default_dtype())
    apply_mode(model, mode, compile_backend=compile_backend, compile_mode=compile_mode)
    optimizer = make_optimizer(model, lr)
    tokens = random_batch(config, batch, seq, 0)
    try:
        train_step(model, optimizer, tokens)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        train_step(model, optimizer, tokens)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    except torch.cuda.OutOfMemoryError:
        return {"op": "e2e_timeline", "impl": mode, "oom": True, "t_ms": [], "allocated_gib": []}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    times, allocated = downsample_max(*allocated_timeline(trace, start))
    return {"op": "e2e_timeline", "impl": mode, "batch": batch, "seq": seq, "t_ms": [round(t, 3) for t in times],
            "allocated_gib": [round(a / GIB, 4) for a in allocated], "live_at_peak": live_at_peak(trace),
            **environment()}  # fmt: skip


FUSED_KERNELS = "fused (Triton)"
KERNEL_CATEGORIES = (  # first match wins; needles are matched in lower-cased kernel names
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")),
    ("attention", ("flash", "fmha", "attention", "attn", "cudnn")),
    ("optimizer", ("multi_tensor", "adam")),
    ("other PyTorch", ("at::native", "at_cuda_detail", "aten")),
)
"""Kinds of kernel in a training step, by what their names contain. Copies and fills are "copies"; a kernel no
needle matches is one of the patched modes' Triton kernels (norms, RoPE, SwiGLU, the loss)."""


def kernel_category(name: str) -> str:
    """The kind of a kernel (a key of :data:`KERNEL_CATEGORIES`, "copies" or :data:`FUSED_KERNELS`) by its name as
    ``torch.profiler`` records it."""
    if name.startswith(("Memcpy", "Memset")):
        return "copies"
    lowered = name.lower()
    return next((label for label, needles in KERNEL_CATEGORIES if any(n in lowered for n in needles)), FUSED_KERNELS)


def kernels_by_category(kernel_ms: dict[str, float]) -> dict[str, Any]:
    """Kernel times per step (name -> ms, as :func:`liger_lab.runtime.kernel_times_ms` gives them) summed by
    :func:`kernel_category`: "kernel_ms" (all of them), "by_category_ms" and "fused_kernels_ms" (largest first),
    and "bound_if_fused_took_zero": how many times faster the step's kernels would be if the fused ones took no
    time. Only the fused kernels differ between the patched modes, so that bounds what any kernel library gives."""
    by_category: dict[str, float] = {}
    fused: dict[str, float] = {}
    for name, ms in kernel_ms.items():
        label = kernel_category(name)
        by_category[label] = by_category.get(label, 0.0) + ms
        if label == FUSED_KERNELS:
            fused[name] = fused.get(name, 0.0) + ms
    total = sum(by_category.values())
    rest = total - by_category.get(FUSED_KERNELS, 0.0)
    return {
        "kernel_ms": round(total, 2),
        "by_category_ms": {k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "fused_kernels_ms": {k: round(v, 3) for k, v in sorted(fused.items(), key=lambda kv: -kv[1])},
        "bound_if_fused_took_zero": round(total / rest, 4) if rest else None,
    }


def profile_step(
    mode: str,
    config: PretrainedConfig,
    batch: int,
    seq: int,
    *,
    steps: int = 3,
    dtype: torch.dtype | None = None,
    lr: float = 1e-4,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
) -> dict[str, Any]:
    """Where a training step's GPU time goes: after two warm-up steps, ``steps`` steps under ``torch.profiler``
    (:func:`liger_lab.runtime.kernel_times_ms`), their kernels summed per step by kind
    (:func:`kernels_by_category`), then the wall time of ``steps`` more steps without the profiler ("step_ms").
    On CPU the interpreter runs no GPU kernels: returns the row with a note and no times."""
    row = {"op": "e2e_profile", "impl": mode, "batch": batch, "seq": seq}
    if runtime.INTERPRET:
        return {**row, "note": "kernel profiles need a CUDA GPU"}
    model = build_model(config, dtype=dtype or default_dtype())
    apply_mode(model, mode, compile_backend=compile_backend, compile_mode=compile_mode)
    optimizer = make_optimizer(model, lr)
    tokens = random_batch(config, batch, seq, 0)
    train_step(model, optimizer, tokens)  # the optimizer's states; kernel_times_ms runs one more step before it
    kernel_ms = runtime.kernel_times_ms(lambda: train_step(model, optimizer, tokens), calls=steps)
    runtime.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, tokens)
    runtime.synchronize()
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    return {**row, "step_ms": round(step_ms, 2), **kernels_by_category(kernel_ms), **environment()}
