"""End to end: train a Llama-style model for a few steps, eager Hugging Face against patched kernels.

The model is built from a ``LlamaConfig`` (random weights, nothing downloaded). The benchmark model is
Llama-3.2-1B-shaped with an untied output layer: hidden 2048, 16 layers, 32 query and 8 key/value heads,
MLP 8192, vocabulary 128256, 1498M parameters, trained in bf16 with AdamW on a batch of 8 x 2048 tokens.

Modes:

* ``"hf"``: the model as Hugging Face writes it (eager PyTorch, SDPA attention);
* ``"liger_lab"``: after :func:`liger_lab.patch` (fused RMSNorm, RoPE, SwiGLU, linear + cross-entropy);
* ``"liger"``: after Liger-Kernel's ``apply_liger_kernel_to_llama`` (when installed).

Patching replaces module-level functions, and a peak-memory figure means nothing if an earlier run left
tensors or a fragmented cache behind, so every measurement runs in a fresh Python process
(:func:`run_isolated`, which calls ``python -m liger_lab.e2e`` and reads one JSON line back).

:func:`memory_breakdown` is the analytic side: where the bytes of one training step go. The estimate
of the peak is weights + optimizer states + activations + the loss buffers: with
``zero_grad(set_to_none=True)`` gradients do not exist at the start of the backward, and they are
created while activations are freed, so they mostly do not add to the peak.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import triton

import liger_lab
from liger_lab import bench, runtime

GIB = 2**30
MODES = ("hf", "liger_lab", "liger")

MODEL_SIZES: dict[str, dict[str, int]] = {
    # 1498M parameters: the model of the end-to-end benchmark.
    "1.5b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256),
    # 0.2M parameters with odd sizes: small enough to train in Triton's interpreter.
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
}  # fmt: skip

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def default_dtype() -> torch.dtype:
    """bf16 on the GPU; fp32 in the interpreter, whose bf16 stores truncate instead of rounding."""
    return runtime.pick(cpu=torch.float32, gpu=torch.bfloat16)


def llama_config(model: str = "1.5b", *, layers: int | None = None):
    """A ``transformers.LlamaConfig`` for a preset of :data:`MODEL_SIZES`, optionally with fewer layers."""
    if model not in MODEL_SIZES:
        raise ValueError(f"model is {model!r}: expected one of {sorted(MODEL_SIZES)}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers is {layers}: expected at least 1")
    try:
        from transformers import LlamaConfig
    except ImportError as error:
        raise ImportError("the end-to-end benchmark needs transformers: pip install 'liger-lab[hf]'") from error
    sizes = dict(MODEL_SIZES[model])
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    return LlamaConfig(
        **sizes, tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5, use_cache=False,
    )  # fmt: skip


def _kv_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads * head_dim


def count_parameters(config) -> int:
    """Parameters of a ``LlamaForCausalLM`` with an untied output layer, counted from its config.

    Per layer: q and o projections h*h each, k and v h*kv each, the MLP 3*h*I, two norm weights h.
    Plus the embedding and the output layer (V*h each) and the final norm (h).
    """
    h, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_attention_heads * (getattr(config, "head_dim", None) or h // config.num_attention_heads)
    per_layer = 2 * h * q_dim + 2 * h * _kv_dim(config) + 3 * h * ffn + 2 * h
    embeddings = vocab * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * per_layer + embeddings + h


def activation_elements_per_token(config, *, fused: bool) -> int:
    """Elements one decoder layer saves for the backward, per token (compute dtype units).

    With fused kernels (SDPA attention, which keeps q, k, v and its output):
    the two norm inputs (2h), the two norm outputs the projections keep (2h), q, k, v (h + 2kv),
    the attention output (h), the SwiGLU inputs gate and up and its output (3I): 6h + 2kv + 3I.
    Eager Hugging Face adds, per RMSNorm, an fp32 copy of its input in place of the bf16 one plus the
    normalised row (+2h each) and, in the MLP, silu(gate) kept separately (+I): 10h + 2kv + 4I.
    """
    h, ffn, kv = config.hidden_size, config.intermediate_size, _kv_dim(config)
    return (6 * h + 2 * kv + 3 * ffn) if fused else (10 * h + 2 * kv + 4 * ffn)


def memory_breakdown(
    config,
    batch: int,
    seq: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    optimizer_dtype: torch.dtype | None = None,
    fused: bool = False,
    loss_chunk_tokens: int | None = None,
) -> dict[str, int]:
    """Bytes of one training step with AdamW, by where they go.

    ``dtype`` is the parameter (and activation) dtype; AdamW keeps two states per parameter in
    ``optimizer_dtype`` (default: the parameter dtype, as ``torch.optim.AdamW`` does; pass
    ``torch.float32`` for fp32 states). ``fused=False`` is eager Hugging Face: the output layer writes
    bf16 logits, the loss upcasts them to fp32, log-softmax keeps an fp32 copy and the backward makes
    an fp32 gradient of it and then of the logits: 2 + 4 + 4 + 4 = 14 bytes per logit.
    ``fused=True`` is a chunked linear + cross-entropy: no logits, only the output layer's weight
    gradient and the hidden-state gradient (made during the forward) and one fp32 chunk of
    ``loss_chunk_tokens`` rows of logits with its gradient. By default a chunk holds about as many
    logits as the batch has hidden-state elements (tokens * h / V rows, a power of 2), the usual choice.
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"batch {batch} and seq {seq}: expected positive sizes")
    size = torch.empty((), dtype=dtype).element_size()
    state_size = torch.empty((), dtype=optimizer_dtype or dtype).element_size()
    n_params, tokens = count_parameters(config), batch * seq
    h, vocab = config.hidden_size, config.vocab_size
    per_token = activation_elements_per_token(config, fused=fused) * config.num_hidden_layers
    # The final norm and the output layer's input; eager's final norm keeps an fp32 copy too.
    per_token += 2 * h if fused else 4 * h
    if fused:
        chunk = loss_chunk_tokens or triton.next_power_of_2(math.ceil(tokens * h / vocab))
        chunk = min(chunk, tokens)
        loss = vocab * h * size + tokens * h * size + 2 * chunk * vocab * 4
    else:
        loss = tokens * vocab * (size + 4 + 4 + 4)
    return {
        "weights": n_params * size,
        "gradients": n_params * size,
        "AdamW states": 2 * n_params * state_size,
        "activations": tokens * per_token * size,
        "logits and loss": loss,
    }


def estimated_peak(breakdown: dict[str, int]) -> int:
    """Peak bytes of a step: everything but the gradients (see the module docstring for why)."""
    return sum(v for k, v in breakdown.items() if k != "gradients")


def format_breakdown(columns: dict[str, dict[str, int]]) -> str:
    """A table with one column per breakdown (e.g. eager and fused) and the estimated peak, in GiB (MiB
    when the largest peak is under 1 GiB)."""
    names = list(columns)
    unit, scale = ("GiB", GIB) if max(estimated_peak(c) for c in columns.values()) >= GIB else ("MiB", 2**20)
    lines = [f"{unit:<18}" + "".join(f"{n:>14}" for n in names)]
    for key in next(iter(columns.values())):
        lines.append(f"{key:<18}" + "".join(f"{columns[n][key] / scale:>14.2f}" for n in names))
    lines.append(f"{'estimated peak':<18}" + "".join(f"{estimated_peak(columns[n]) / scale:>14.2f}" for n in names))
    return "\n".join(lines)


def available_modes() -> list[str]:
    """The modes that can run in this install."""
    modes = ["hf"]
    if hasattr(liger_lab, "patch"):
        modes.append("liger_lab")
    if bench.liger_kernel_installed() and not runtime.INTERPRET:
        modes.append("liger")
    return modes


def build_model(config, *, dtype: torch.dtype | None = None, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` on :data:`runtime.DEVICE`, in ``dtype``, in train mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(runtime.DEVICE):
        model = LlamaForCausalLM._from_config(config, dtype=dtype or default_dtype(), attn_implementation="sdpa")
    return model.train()


def apply_mode(model: torch.nn.Module, mode: str) -> None:
    """Swap in the kernels of ``mode`` (this changes module-level functions of transformers: one mode
    per process)."""
    if mode == "hf":
        return
    if mode == "liger_lab":
        liger_lab.patch(model)
    elif mode == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    else:
        raise ValueError(f"mode is {mode!r}: expected one of {MODES}")


def _batch(config, batch: int, seq: int, seed: int) -> torch.Tensor:
    # One fixed batch of random tokens: the loss falling over a few steps shows the model still learns
    # (it memorises the batch), and every mode sees the same data.
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=generator).to(runtime.DEVICE)


def _reset_peak() -> None:
    if not runtime.INTERPRET:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return None if runtime.INTERPRET else round(torch.cuda.max_memory_allocated() / GIB, 2)


def _optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    # The fused CUDA AdamW makes no list-sized temporaries; on CPU the default implementation.
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=not runtime.INTERPRET)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _row(mode: str, config, batch: int, seq: int, **fields: Any) -> dict[str, Any]:
    from importlib.metadata import version

    return {
        "op": "e2e", "impl": mode, "batch": batch, "seq": seq, "layers": config.num_hidden_layers,
        "params_M": round(count_parameters(config) / 1e6, 2), **fields, **bench.environment(),
        "transformers": version("transformers"),
    }  # fmt: skip


def train(
    mode: str,
    config,
    batch: int,
    seq: int,
    *,
    steps: int = 5,
    warmup: int = 2,
    dtype: torch.dtype | None = None,
    lr: float = 1e-4,
    seed: int = 0,
) -> dict[str, Any]:
    """Train ``steps`` timed steps after ``warmup`` untimed ones; return one result row.

    The row has tokens_per_s (over the timed steps), peak_gib (``max_memory_allocated`` over the whole
    run, weights and optimizer states included; None on CPU), loss0 (first step) and loss_last, or
    ``"oom": True`` when the GPU ran out of memory. Patching reaches beyond the model (RoPE is a
    module-level function of transformers): for any mode but ``"hf"``, call this in a fresh process
    (:func:`run_isolated`).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps {steps}, warmup {warmup}: expected steps >= 1 and warmup >= 0")
    dtype = dtype or default_dtype()
    info = {"dtype": str(dtype).removeprefix("torch."), "steps": steps, "timer": timer_label()}
    try:
        model = build_model(config, dtype=dtype, seed=seed)
        apply_mode(model, mode)
        optimizer = _optimizer(model, lr)
        tokens = _batch(config, batch, seq, seed)
        _reset_peak()
        losses = [_step(model, optimizer, tokens) for _ in range(warmup)]
        runtime.synchronize()
        start = time.perf_counter()
        losses += [_step(model, optimizer, tokens) for _ in range(steps)]
        runtime.synchronize()
        elapsed = time.perf_counter() - start
    except torch.cuda.OutOfMemoryError:
        return _row(mode, config, batch, seq, oom=True, **info)
    return _row(
        mode, config, batch, seq, tokens_per_s=round(batch * seq * steps / elapsed, 1), peak_gib=_peak_gib(),
        loss0=round(losses[0].item(), 4), loss_last=round(losses[-1].item(), 4), **info,
    )  # fmt: skip


def timer_label() -> str:
    """How tokens/s is timed here."""
    return "CUDA synchronised wall clock" if not runtime.INTERPRET else "CPU wall clock (interpreter, not GPU speed)"


def largest_fit(
    mode: str, config, shapes: Sequence[tuple[int, int]], *, dtype: torch.dtype | None = None, lr: float = 1e-4
) -> dict[str, Any]:
    """Try one training step at each (batch, seq), smallest token count first, until one runs out of
    memory. Returns {"fits": [...], "oom_at": [batch, seq] or None, "largest": [batch, seq] or None}.

    One model and optimizer serve every size (as in a real run, the AdamW states stay allocated). On
    CPU there is no memory limit to find: every size "fits", so pass small sizes there.
    """
    model = build_model(config, dtype=dtype or default_dtype())
    apply_mode(model, mode)
    optimizer = _optimizer(model, lr)
    fits: list[dict[str, Any]] = []
    oom_at = None
    for batch, seq in sorted(shapes, key=lambda s: (s[0] * s[1], s[1])):
        _reset_peak()
        try:
            _step(model, optimizer, _batch(config, batch, seq, 0))
            runtime.synchronize()
        except torch.cuda.OutOfMemoryError:
            oom_at = [batch, seq]
            break
        fits.append({"batch": batch, "seq": seq, "peak_gib": _peak_gib()})
    largest = [fits[-1]["batch"], fits[-1]["seq"]] if fits else None
    return {"op": "e2e_fit", "impl": mode, "fits": fits, "oom_at": oom_at, "largest": largest,
            **bench.environment()}  # fmt: skip


def allocated_timeline(trace: Sequence[dict[str, Any]], start_bytes: int = 0) -> tuple[list[float], list[int]]:
    """Allocated bytes after each event of a CUDA caching-allocator trace (one device's
    ``torch.cuda.memory._snapshot()["device_traces"]`` list): +size on "alloc", -size on
    "free_completed". Returns (times in ms from the first event, or event numbers where the trace has no
    times; allocated bytes)."""
    times: list[float] = []
    allocated: list[int] = []
    current = start_bytes
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            current += event["size"]
        elif event["action"] == "free_completed":
            current -= event["size"]
        else:
            continue
        times.append(event["time_us"] / 1e3 if "time_us" in event else float(index))
        allocated.append(current)
    if times and "time_us" in trace[0]:
        times = [t - times[0] for t in times]
    return times, allocated


def downsample_max(times: list[float], values: list[int], points: int = 2000) -> tuple[list[float], list[int]]:
    """At most ``points`` samples, keeping the largest value of each bucket so peaks survive."""
    if len(values) <= points:
        return times, values
    size = math.ceil(len(values) / points)
    kept_t, kept_v = [], []
    for start in range(0, len(values), size):
        bucket = values[start : start + size]
        best = max(range(len(bucket)), key=bucket.__getitem__)
        kept_t.append(times[start + best])
        kept_v.append(bucket[best])
    return kept_t, kept_v


def memory_timeline(
    mode: str, config, batch: int, seq: int, *, dtype: torch.dtype | None = None, lr: float = 1e-4
) -> dict[str, Any]:
    """Allocated GPU memory through one training step (after a warm-up step made the optimizer states),
    from the caching allocator's history. On CPU there is no allocator history: returns an empty
    timeline with a note."""
    if runtime.INTERPRET:
        return {"op": "e2e_timeline", "impl": mode, "t_ms": [], "allocated_gib": [],
                "note": "memory timelines need a CUDA GPU"}  # fmt: skip
    model = build_model(config, dtype=dtype or default_dtype())
    apply_mode(model, mode)
    optimizer = _optimizer(model, lr)
    tokens = _batch(config, batch, seq, 0)
    try:
        _step(model, optimizer, tokens)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        _step(model, optimizer, tokens)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    except torch.cuda.OutOfMemoryError:
        return {"op": "e2e_timeline", "impl": mode, "oom": True, "t_ms": [], "allocated_gib": []}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    times, allocated = allocated_timeline(snapshot["device_traces"][torch.cuda.current_device()], start)
    times, allocated = downsample_max(times, allocated)
    return {"op": "e2e_timeline", "impl": mode, "batch": batch, "seq": seq, "t_ms": [round(t, 3) for t in times],
            "allocated_gib": [round(a / GIB, 4) for a in allocated]}  # fmt: skip


def run_isolated(
    task: str = "train",
    *,
    mode: str,
    model: str = "1.5b",
    layers: int | None = None,
    batch: int = 8,
    seq: int = 2048,
    steps: int = 5,
    warmup: int = 2,
    dtype: str | None = None,
    lr: float = 1e-4,
    shapes: Sequence[tuple[int, int]] = (),
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run :func:`train` (task "train"), :func:`largest_fit` ("fit") or :func:`memory_timeline`
    ("timeline") in a fresh ``python -m liger_lab.e2e`` process and return its JSON row.

    A child that dies without a row (a CUDA crash, a missing package) gives {"error": ...}.
    """
    args = [sys.executable, "-m", "liger_lab.e2e", task, "--mode", mode, "--model", model, "--batch", str(batch),
            "--seq", str(seq), "--steps", str(steps), "--warmup", str(warmup), "--lr", str(lr)]  # fmt: skip
    if layers is not None:
        args += ["--layers", str(layers)]
    if dtype is not None:
        args += ["--dtype", dtype]
    if shapes:
        args += ["--shapes", ",".join(f"{b}x{t}" for b, t in shapes)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"op": f"e2e_{task}", "impl": mode, "batch": batch, "seq": seq,
                "error": (done.stderr or done.stdout).strip()[-2000:] or f"exit code {done.returncode}"}  # fmt: skip
    return json.loads(lines[-1])


def parse_sizes(text: str, expected: str = "sizes joined by x, e.g. 8192x4096") -> tuple[int, ...]:
    """``"8192x4096"`` -> (8192, 4096): positive sizes joined by x."""
    try:
        sizes = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r}: expected {expected}") from None
    if any(size < 1 for size in sizes):
        raise ValueError(f"shape {text!r}: expected positive sizes")
    return sizes


def parse_shape(text: str) -> tuple[int, int]:
    """``"8x2048"`` -> (8, 2048): a batch x sequence-length pair."""
    sizes = parse_sizes(text, expected="BATCHxSEQ, e.g. 8x2048")
    if len(sizes) != 2:
        raise ValueError(f"shape {text!r}: expected BATCHxSEQ, e.g. 8x2048")
    return sizes


def format_runs(rows: Sequence[dict[str, Any]]) -> str:
    """A table of training rows: tokens/s (and the ratio to "hf" at the same size), peak GiB, losses."""
    header = f"{'mode':<11}{'batch x seq':>12}{'tokens/s':>11}{'vs hf':>7}{'peak GiB':>10}{'loss0':>9}{'loss last':>11}"
    lines = [header]
    for r in rows:
        shape = f"{r['batch']}x{r['seq']}"
        if r.get("oom") or r.get("error"):
            problem = "out of memory" if r.get("oom") else "error: " + r["error"].splitlines()[-1][:80]
            lines.append(f"{r['impl']:<11}{shape:>12}  {problem}")
            continue
        hf = next((h for h in rows if h["impl"] == "hf" and (h["batch"], h["seq"]) == (r["batch"], r["seq"])), {})
        ratio = f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf.get("tokens_per_s") else ""
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(
            f"{r['impl']:<11}{shape:>12}{r['tokens_per_s']:>11.0f}{ratio:>7}{peak:>10}{r['loss0']:>9.4f}"
            f"{r['loss_last']:>11.4f}"
        )
    return "\n".join(lines)


def plot_runs(rows: Sequence[dict[str, Any]]):
    """Bars of tokens/s and peak GiB, one per (mode, batch x seq); OOM runs are marked."""
    import matplotlib.pyplot as plt

    labels = [f"{r['impl']}\n{r['batch']}x{r['seq']}" for r in rows]
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 3.6))
    xs = list(range(len(rows)))
    speed = ax_speed.bar(xs, [r.get("tokens_per_s") or 0 for r in rows], color="tab:blue")
    ax_speed.bar_label(speed, [f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "" for r in rows], fontsize=8)
    peaks = [r.get("peak_gib") for r in rows]
    memory = ax_mem.bar(xs, [p or 0 for p in peaks], color="tab:green")
    ax_mem.bar_label(memory, [f"{p:.1f}" if p else "" for p in peaks], fontsize=8)
    for x, r in zip(xs, rows, strict=True):
        if r.get("oom") or r.get("error"):
            for ax in (ax_speed, ax_mem):
                ax.annotate("OOM" if r.get("oom") else "error", (x, 0), ha="center", va="bottom", color="red")
    if not any(peaks):
        ax_mem.text(0.5, 0.5, "peak memory is measured on a CUDA GPU", ha="center", transform=ax_mem.transAxes)
        ax_mem.set_yticks([])
    ax_speed.set_ylabel("tokens/s" + (" (CPU interpreter wall clock)" if runtime.INTERPRET else ""))
    ax_speed.set_title("training throughput (higher is better)")
    ax_mem.set_ylabel("GiB, weights and optimizer included")
    ax_mem.set_title("peak memory (lower is better)")
    for ax in (ax_speed, ax_mem):
        ax.set_xticks(xs, labels, fontsize=8)
    fig.tight_layout()
    return fig


def plot_timelines(timelines: Sequence[dict[str, Any]]):
    """Allocated memory over one training step, one line per mode."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    drawn = [t for t in timelines if t.get("t_ms")]
    for timeline in drawn:
        ax.plot(timeline["t_ms"], timeline["allocated_gib"], label=timeline["impl"], lw=1)
    if drawn:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "memory timelines need a CUDA GPU", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_xlabel("time in one training step (ms)")
    ax.set_ylabel("allocated GiB")
    ax.set_title("forward (rising), backward (falling), optimizer step")
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m liger_lab.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=("train", "fit", "timeline"))
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="1.5b")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--shapes", default="", help="comma-separated BATCHxSEQ sizes for the fit task")
    args = parser.parse_args(argv)
    config = llama_config(args.model, layers=args.layers)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.task == "train":
        row = train(args.mode, config, args.batch, args.seq, steps=args.steps, warmup=args.warmup, dtype=dtype,
                    lr=args.lr)  # fmt: skip
    elif args.task == "fit":
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s] or [(args.batch, args.seq)]
        row = largest_fit(args.mode, config, shapes, dtype=dtype, lr=args.lr)
    else:
        row = memory_timeline(args.mode, config, args.batch, args.seq, dtype=dtype, lr=args.lr)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
