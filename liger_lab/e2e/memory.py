"""Where the bytes of a training step go: the analytic breakdown, and the caching allocator's trace of a real step.

:func:`memory_breakdown` is the analytic side. The estimate of the peak is weights + optimizer states +
activations + the loss buffers: with ``zero_grad(set_to_none=True)`` gradients do not exist at the start of the
backward, and they are created while activations are freed, so they mostly do not add to the peak.
:func:`allocated_timeline` and :func:`live_at_peak` read a trace that :func:`liger_lab.e2e.memory_timeline`
records on the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import triton

from liger_lab.e2e.presets import family_of, head_dim, kv_dim

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GIB = 2**30


def count_parameters(config: PretrainedConfig) -> int:
    """Parameters of the causal LM of a config of :data:`~liger_lab.e2e.BENCHMARK_FAMILIES`, counted from the config.

    Per layer: q and o projections h*q each (q = heads * head_dim, h for Llama), k and v h*kv each, the gated
    MLP 3*h*I, the family's hidden-sized norm weights (two for Llama and Qwen3, four for Gemma 3) and, in
    Qwen3 and Gemma 3, a norm of head_dim weights on the queries and one on the keys. Plus the embedding
    (V*h), the output layer (V*h more unless it is tied to the embedding) and the final norm (h).
    """
    family = family_of(config)
    h, ffn, vocab, head = config.hidden_size, config.intermediate_size, config.vocab_size, head_dim(config)
    q_dim = config.num_attention_heads * head
    norms = family.layer_norms * h + (2 * head if family.qk_norm else 0)
    per_layer = 2 * h * q_dim + 2 * h * kv_dim(config) + 3 * h * ffn + norms
    embeddings = vocab * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * per_layer + embeddings + h


def activation_elements_per_token(config: PretrainedConfig, *, fused: bool) -> int:
    """Elements one Llama decoder layer saves for the backward, per token (compute dtype units); for the
    other families an estimate that leaves out their extra norms.

    With fused kernels (SDPA attention, which keeps q, k, v and its output):
    the two norm inputs (2h), the two norm outputs the projections keep (2h), q, k, v (h + 2kv),
    the attention output (h), the SwiGLU inputs gate and up and its output (3I): 6h + 2kv + 3I.
    Eager Hugging Face adds, per RMSNorm, an fp32 copy of its input in place of the bf16 one plus the
    normalised row (+2h each) and, in the MLP, silu(gate) kept separately (+I): 10h + 2kv + 4I.
    """
    h, ffn, kv = config.hidden_size, config.intermediate_size, kv_dim(config)
    return (6 * h + 2 * kv + 3 * ffn) if fused else (10 * h + 2 * kv + 4 * ffn)


def memory_breakdown(
    config: PretrainedConfig,
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


def allocated_timeline(trace: Sequence[dict[str, Any]], start_bytes: int = 0) -> tuple[list[float], list[int]]:
    """Allocated bytes after each event of a CUDA caching-allocator trace (one device's
    ``torch.cuda.memory._snapshot()["device_traces"]`` list): +size on "alloc", -size on
    "free_completed". Returns (times in ms from the first event, or event numbers where the trace has no
    times; allocated bytes)."""
    times: list[float] = []
    allocated: list[int] = []
    for index, event, current in _allocations(trace, start_bytes):
        times.append(event["time_us"] / 1e3 if "time_us" in event else float(index))
        allocated.append(current)
    if times and "time_us" in trace[0]:
        times = [t - times[0] for t in times]
    return times, allocated


def _allocations(trace: Sequence[dict[str, Any]], start_bytes: int = 0) -> Iterator[tuple[int, dict[str, Any], int]]:
    """(index, event, allocated bytes after it) for each allocation and completed free of the trace."""
    current = start_bytes
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            current += event["size"]
        elif event["action"] == "free_completed":
            current -= event["size"]
        else:
            continue
        yield index, event, current


def live_at_peak(trace: Sequence[dict[str, Any]], top: int = 12) -> list[dict[str, Any]]:
    """What holds the memory at the peak of a caching-allocator trace (as :func:`allocated_timeline` reads it): the
    blocks allocated and not yet freed at the moment the allocated bytes were highest, grouped by where they were
    allocated (the innermost frames outside torch's own modules, but for its optimizers, from a trace recorded with
    ``stacks="python"``), the ``top`` largest groups first. Each gives its MiB in all, its number of blocks and
    its largest block: a layer's activation shows as one group of as many blocks as layers. Blocks allocated before
    the trace began are not in it: compare two traces of the same step, not totals."""
    peak_index = max(_allocations(trace), key=lambda allocation: allocation[2], default=(-1, None, 0))[0]
    live: dict[int, dict[str, Any]] = {}
    for _, event, _ in _allocations(trace[: peak_index + 1]):
        if event["action"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)
    groups: dict[str, list[int]] = {}
    for event in live.values():
        groups.setdefault(_allocation_site(event), []).append(event["size"])
    largest = sorted(groups.items(), key=lambda group: sum(group[1]), reverse=True)[:top]
    return [{"mib": round(sum(sizes) / 2**20, 1), "blocks": len(sizes), "largest_mib": round(max(sizes) / 2**20, 1),
             "where": where} for where, sizes in largest]  # fmt: skip


def _allocation_site(event: dict[str, Any], depth: int = 3) -> str:
    frames = [
        f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"
        for frame in event.get("frames", [])
        if "/torch/" not in frame["filename"] or "/torch/optim/" in frame["filename"]
    ]
    return " < ".join(frames[:depth]) or "?"


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
