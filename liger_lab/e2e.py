"""End to end: train a decoder model for a few steps, eager Hugging Face against patched kernels.

The model is built from a preset of :data:`MODEL_SIZES` (random weights, nothing downloaded): a family of
:data:`MODEL_FAMILIES` (Llama, Qwen3 or Gemma 3, whose transformers config and causal LM classes it names) and
its sizes. The benchmark model is Llama-3.2-1B-shaped with an untied output layer: hidden 2048, 16 layers, 32
query and 8 key/value heads, MLP 8192, vocabulary 128256, 1498M parameters, trained in bf16 with AdamW on a
batch of 8 x 2048 tokens. "qwen3-1.5b" and "gemma3-1.5b" put about as many parameters behind larger
vocabularies (151936; 262144 with soft-capped logits), where the loss takes more of the step and the memory.

Modes:

* ``"hf"``: the model as Hugging Face writes it (eager PyTorch, SDPA attention);
* ``"liger_lab"``: after :func:`liger_lab.patch` (fused RMSNorm, RoPE, SwiGLU or GeGLU, linear + cross-entropy);
* ``"liger"``: after Liger-Kernel's ``apply_liger_kernel_to_llama`` (``_qwen3``, ``_gemma3_text``: the
  family's) with the same kernels (when installed);
* ``"hf+compile"`` and ``"liger_lab+compile"``: the same two models, then ``model.compile()`` (the
  forward and, through AOTAutograd, the backward; the AdamW step stays eager). The first warm-up step
  compiles; it is timed on its own (``compile_s``) and never counted in tokens/s.

Every row keeps the loss of every step (``losses``), so two modes can be checked to train the same way
(:func:`compare_losses`): same seed, same weights, same batch, so step i of one run is step i of the
other. :func:`check_targets` holds the throughput and memory targets of the compiled patched model.

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
import re
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import triton

import liger_lab
from liger_lab import bench, runtime

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GIB = 2**30
MODES = ("hf", "liger_lab", "liger", "hf+compile", "liger_lab+compile")
COMPILE_SUFFIX = "+compile"
# Two bf16 losses that differ by less than one bf16 step (2**-7 relative) are the same loss.
BF16_RTOL = 2.0**-7


@dataclass(frozen=True)
class Family:
    """How the benchmark builds one transformers family and patches it with Liger-Kernel."""

    config_class: str  # a class of transformers: "Qwen3Config"
    model_class: str  # "Qwen3ForCausalLM"
    liger_patch: str  # Liger-Kernel's apply_liger_kernel_to_* for an instance of model_class
    gated_mlp: str  # that function's keyword for the fused gated MLP: "swiglu" or "geglu"
    layer_norms: int  # hidden-sized RMSNorm weights per decoder layer
    qk_norm: bool = False  # an RMSNorm over each query and key head (head_dim weights each)
    defaults: dict[str, Any] = field(default_factory=dict)  # config fields every preset of the family shares


MODEL_FAMILIES: dict[str, Family] = {
    "llama": Family(
        "LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama", "swiglu", layer_norms=2,
        defaults=dict(tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5),
    ),
    "qwen3": Family(
        "Qwen3Config", "Qwen3ForCausalLM", "apply_liger_kernel_to_qwen3", "swiglu", layer_norms=2, qk_norm=True,
        defaults=dict(tie_word_embeddings=True),
    ),
    # Gemma 3 dropped Gemma 2's final logit soft-cap; the benchmark keeps it so that the fused losses are
    # measured with the cap they must apply.
    "gemma3_text": Family(
        "Gemma3TextConfig", "Gemma3ForCausalLM", "apply_liger_kernel_to_gemma3_text", "geglu", layer_norms=4,
        qk_norm=True, defaults=dict(tie_word_embeddings=True, final_logit_softcapping=30.0, sliding_window=512),
    ),
}  # fmt: skip
"""The families a preset can be (``config.model_type``), each one that :data:`liger_lab.patching.FAMILIES` patches."""


@dataclass(frozen=True)
class Preset:
    family: str  # a key of MODEL_FAMILIES
    fields: dict[str, Any]  # config fields, over the family's defaults


_TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1000)  # fmt: skip

MODEL_SIZES: dict[str, Preset] = {
    # 1498M parameters, output layer untied (525M in the embedding and output layer): the model of the
    # end-to-end benchmark.
    "1.5b": Preset("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                 num_key_value_heads=8, vocab_size=128256)),
    # 8.0B parameters, Llama-3-8B's shape: the multi-GPU (FSDP2) benchmark.
    "8b": Preset("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=128256)),
    # 1519M parameters: Qwen3-1.7B's layer (16 query and 8 key/value heads of 128, MLP 6144) with 24 of its 28
    # layers; the output layer is the embedding (tied, as in Qwen3-1.7B): 311M parameters, counted once.
    "qwen3-1.5b": Preset("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936)),
    # 1544M parameters: the width and depth of "1.5b" with Gemma 3's layer (8 query and 4 key/value heads of 256,
    # four norms, GeGLU, a 512-token sliding window on five layers of six) and vocabulary; the output layer is the
    # embedding (tied, as in every Gemma): 537M parameters, counted once. Logits soft-capped at 30 (Gemma 2's).
    "gemma3-1.5b": Preset("gemma3_text", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                              num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                              vocab_size=262144)),
    # 0.16-0.22M parameters with odd sizes, one per family: small enough to train in Triton's interpreter. The
    # window of tiny-gemma3 is shorter than the CPU tests' sequences, so its sliding layers mask.
    "tiny": Preset("llama", _TINY),
    "tiny-qwen3": Preset("qwen3", dict(_TINY, head_dim=16)),
    "tiny-gemma3": Preset("gemma3_text", dict(_TINY, head_dim=16, sliding_window=8)),
}  # fmt: skip
"""Model presets by name: a family of :data:`MODEL_FAMILIES` and its config fields (random weights)."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def default_dtype() -> torch.dtype:
    """bf16 on the GPU; fp32 in the interpreter, where bf16 buys nothing (the kernels compute in fp32) and torch's
    CPU matmuls are slower in bf16."""
    return runtime.pick(cpu=torch.float32, gpu=torch.bfloat16)


def _transformers() -> types.ModuleType:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("the end-to-end benchmark needs transformers: pip install 'liger-lab[hf]'") from error
    return transformers


def model_config(model: str = "1.5b", *, layers: int | None = None) -> PretrainedConfig:
    """The transformers config of a preset of :data:`MODEL_SIZES` (``LlamaConfig``, ``Qwen3Config``,
    ``Gemma3TextConfig``), optionally with fewer layers."""
    if model not in MODEL_SIZES:
        raise ValueError(f"model is {model!r}: expected one of {sorted(MODEL_SIZES)}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers is {layers}: expected at least 1")
    preset = MODEL_SIZES[model]
    family = MODEL_FAMILIES[preset.family]
    fields = {**family.defaults, **preset.fields, "use_cache": False}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return getattr(_transformers(), family.config_class)(**fields)


def llama_config(model: str = "1.5b", *, layers: int | None = None) -> PretrainedConfig:
    """:func:`model_config` of a Llama preset ("1.5b", "8b", "tiny"): a ``transformers.LlamaConfig``."""
    config = model_config(model, layers=layers)
    if config.model_type != "llama":
        raise ValueError(f"model {model!r} is a {config.model_type} preset: model_config builds it")
    return config


def family_of(config: PretrainedConfig) -> Family:
    """The :data:`MODEL_FAMILIES` entry of a config (by its ``model_type``)."""
    if config.model_type not in MODEL_FAMILIES:
        raise ValueError(f"model type {config.model_type!r}: expected one of {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[config.model_type]


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _kv_dim(config: PretrainedConfig) -> int:
    return config.num_key_value_heads * _head_dim(config)


def count_parameters(config: PretrainedConfig) -> int:
    """Parameters of the causal LM of a config of :data:`MODEL_FAMILIES`, counted from the config.

    Per layer: q and o projections h*q each (q = heads * head_dim, h for Llama), k and v h*kv each, the gated
    MLP 3*h*I, the family's hidden-sized norm weights (two for Llama and Qwen3, four for Gemma 3) and, in
    Qwen3 and Gemma 3, a norm of head_dim weights on the queries and one on the keys. Plus the embedding
    (V*h), the output layer (V*h more unless it is tied to the embedding) and the final norm (h).
    """
    family = family_of(config)
    h, ffn, vocab, head_dim = config.hidden_size, config.intermediate_size, config.vocab_size, _head_dim(config)
    q_dim = config.num_attention_heads * head_dim
    norms = family.layer_norms * h + (2 * head_dim if family.qk_norm else 0)
    per_layer = 2 * h * q_dim + 2 * h * _kv_dim(config) + 3 * h * ffn + norms
    embeddings = vocab * h * (1 if config.tie_word_embeddings else 2)
    return config.num_hidden_layers * per_layer + embeddings + h


def activation_elements_per_token(config, *, fused: bool) -> int:
    """Elements one Llama decoder layer saves for the backward, per token (compute dtype units); for the
    other families an estimate that leaves out their extra norms.

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
    if bench.liger_kernel_installed() and not runtime.INTERPRET:
        modes.append("liger")
    if compile_available():
        modes += [m + COMPILE_SUFFIX for m in ("hf", "liger_lab") if m in modes]
    return modes


def build_model(config: PretrainedConfig, *, dtype: torch.dtype | None = None, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised causal LM of ``config``'s family (``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
    ``Gemma3ForCausalLM``) on :data:`runtime.DEVICE`, in ``dtype``, in train mode."""
    model_class = getattr(_transformers(), family_of(config).model_class)
    torch.manual_seed(seed)
    with torch.device(runtime.DEVICE):
        model = model_class._from_config(config, dtype=dtype or default_dtype(), attn_implementation="sdpa")
    return model.train()


# The kernels both patched modes swap in, so that "liger" and "liger_lab" are measured doing the same work, under the
# keywords liger_lab.patch and Liger-Kernel's apply_liger_kernel_to_* share. The gated MLP's keyword differs:
# swiglu in liger_lab (GeGLU for Gemma too), the family's gated_mlp in Liger-Kernel.
FUSED = dict(rope=True, rms_norm=True, fused_linear_cross_entropy=True, cross_entropy=False)


def apply_mode(
    model: torch.nn.Module, mode: str, *, compile_backend: str = "inductor", loss_chunk_tokens: int | None = None
) -> torch.nn.Module:
    """Swap in the kernels of ``mode`` (this changes module-level functions of transformers: one mode
    per process); for a ``+compile`` mode, then compile the model in place (``model.compile``, so
    ``model(...)`` runs the compiled forward and the optimizer keeps the same parameters). Returns the
    model. ``loss_chunk_tokens``: :func:`liger_lab.patch`'s, for the liger_lab modes."""
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
        model.compile(backend=compile_backend)
    return model


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


def _compile_counts() -> dict[str, int]:
    # Dynamo's counters: graphs compiled so far and graph breaks met while tracing.
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def _environment() -> dict[str, Any]:
    from importlib.metadata import version

    return {**bench.environment(), "transformers": version("transformers")}


def _row(mode: str, config: PretrainedConfig, batch: int, seq: int, **fields: Any) -> dict[str, Any]:
    return {
        "op": "e2e", "impl": mode, "batch": batch, "seq": seq, "family": config.model_type,
        "vocab": config.vocab_size, "layers": config.num_hidden_layers,
        "params_M": round(count_parameters(config) / 1e6, 2), **fields, **_environment(),
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
    compile_backend: str = "inductor",
    loss_chunk_tokens: int | None = None,
) -> dict[str, Any]:
    """Train ``steps`` timed steps after ``warmup`` untimed ones; return one result row.

    The row has tokens_per_s (over the timed steps), peak_gib (``max_memory_allocated`` over the whole
    run, weights and optimizer states included; None on CPU), losses (every step, warm-up ones first,
    5 digits), loss0 (first step) and loss_last, compile_s (wall time of the first warm-up step: where
    torch.compile traces and generates code in a ``+compile`` mode, and Triton compiles the kernels it
    launches; None without warm-up), or ``"oom": True`` when the GPU ran out of memory.

    A ``+compile`` mode always has at least one warm-up step, so compilation is never timed; its row
    also says how many graphs were compiled (``graphs``), how many of them during the timed steps
    (``timed_compiles``: a recompile there would make tokens/s wrong) and the graph breaks.
    ``compile_backend`` is torch.compile's backend (``"aot_eager"`` skips code generation);
    ``loss_chunk_tokens`` is :func:`liger_lab.patch`'s (liger_lab modes).

    Patching reaches beyond the model (RoPE is a module-level function of transformers): for any mode
    but ``"hf"``, call this in a fresh process (:func:`run_isolated`).
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
    compile_s = None
    try:
        model = build_model(config, dtype=dtype, seed=seed)
        apply_mode(model, mode, compile_backend=compile_backend, loss_chunk_tokens=loss_chunk_tokens)
        optimizer = _optimizer(model, lr)
        tokens = _batch(config, batch, seq, seed)
        _reset_peak()
        losses = []
        for index in range(warmup):
            start = time.perf_counter()
            losses.append(_step(model, optimizer, tokens))
            runtime.synchronize()
            if index == 0:
                compile_s = time.perf_counter() - start
        before = _compile_counts() if compiled else {}
        runtime.synchronize()
        start = time.perf_counter()
        losses += [_step(model, optimizer, tokens) for _ in range(steps)]
        runtime.synchronize()
        elapsed = time.perf_counter() - start
    except torch.cuda.OutOfMemoryError:
        return _row(mode, config, batch, seq, oom=True, **info)
    if compiled:
        after = _compile_counts()
        info.update(graphs=after["graphs"], timed_compiles=after["graphs"] - before["graphs"],
                    graph_breaks=after["graph_breaks"])  # fmt: skip
    curve = [round(loss, 5) for loss in torch.stack(losses).float().tolist()]
    return _row(
        mode, config, batch, seq, tokens_per_s=round(batch * seq * steps / elapsed, 1), peak_gib=_peak_gib(),
        loss0=round(curve[0], 4), loss_last=round(curve[-1], 4), losses=curve,
        compile_s=None if compile_s is None else round(compile_s, 3), **info,
    )  # fmt: skip


def timer_label() -> str:
    """How tokens/s is timed here."""
    return "CUDA synchronised wall clock" if not runtime.INTERPRET else "CPU wall clock (interpreter, not GPU speed)"


def largest_fit(
    mode: str,
    config,
    shapes: Sequence[tuple[int, int]],
    *,
    dtype: torch.dtype | None = None,
    lr: float = 1e-4,
    compile_backend: str = "inductor",
) -> dict[str, Any]:
    """Try one training step at each (batch, seq), smallest token count first, until one runs out of
    memory. Returns {"fits": [...], "oom_at": [batch, seq] or None, "largest": [batch, seq] or None}.

    One model and optimizer serve every size (as in a real run, the AdamW states stay allocated). On
    CPU there is no memory limit to find: every size "fits", so pass small sizes there.
    """
    model = build_model(config, dtype=dtype or default_dtype())
    apply_mode(model, mode, compile_backend=compile_backend)
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
    return {"op": "e2e_fit", "impl": mode, "family": config.model_type, "fits": fits, "oom_at": oom_at,
            "largest": largest, **_environment()}  # fmt: skip


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


def memory_timeline(
    mode: str,
    config,
    batch: int,
    seq: int,
    *,
    dtype: torch.dtype | None = None,
    lr: float = 1e-4,
    compile_backend: str = "inductor",
) -> dict[str, Any]:
    """Allocated GPU memory through one training step (after a warm-up step made the optimizer states),
    from the caching allocator's history, and the largest blocks allocated in that step that are alive at its peak
    (:func:`live_at_peak`). On CPU there is no allocator history: returns an empty timeline with a note."""
    if runtime.INTERPRET:
        return {"op": "e2e_timeline", "impl": mode, "t_ms": [], "allocated_gib": [],
                "note": "memory timelines need a CUDA GPU"}  # fmt: skip
    model = build_model(config, dtype=dtype or default_dtype())
    apply_mode(model, mode, compile_backend=compile_backend)
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
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    times, allocated = downsample_max(*allocated_timeline(trace, start))
    return {"op": "e2e_timeline", "impl": mode, "batch": batch, "seq": seq, "t_ms": [round(t, 3) for t in times],
            "allocated_gib": [round(a / GIB, 4) for a in allocated], "live_at_peak": live_at_peak(trace),
            **_environment()}  # fmt: skip


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
    compile_backend: str | None = None,
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
    if compile_backend is not None:
        args += ["--compile-backend", compile_backend]
    return child_row(args, {"op": f"e2e_{task}", "impl": mode, "batch": batch, "seq": seq}, timeout_s=timeout_s)


def child_row(command: Sequence[str], failed: dict[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``command``, a Python process that prints its result as a JSON line, and return the last such row.
    A child that fails or prints no row (a CUDA crash, a missing package) gives ``failed`` plus its "error";
    one still running after ``timeout_s`` seconds is killed and gives ``failed`` with "timeout": True too."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**failed, "error": f"killed after the timeout of {timeout_s:g} s", "timeout": True}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {**failed, "error": (done.stderr or done.stdout).strip()[-2000:] or f"exit code {done.returncode}"}
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


RUN_HEADER = (
    f"{'mode':<18}{'batch x seq':>12}{'tokens/s':>11}{'vs hf':>7}{'peak GiB':>10}{'1st step s':>12}{'loss0':>9}"
    f"{'loss last':>11}"
)


def error_summary(error: str) -> str:
    """The line of a child's traceback that names the exception (the last line may be advice, as after a
    torch.compile failure), at most 80 characters."""
    lines = [line.strip() for line in error.splitlines() if line.strip()] or ["?"]
    named = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt)\b", line)]
    return (named or lines)[-1][:80]


def format_run(row: dict[str, Any], rows: Sequence[dict[str, Any]] = ()) -> str:
    """One line of :func:`format_runs`; the ratio to "hf" comes from the "hf" row of the same size in
    ``rows`` (none when it is not there yet)."""
    shape = f"{row['batch']}x{row['seq']}"
    if row.get("oom") or row.get("error"):
        problem = "out of memory" if row.get("oom") else "error: " + error_summary(row["error"])
        return f"{row['impl']:<18}{shape:>12}  {problem}"
    size = (row["batch"], row["seq"])
    hf = next((h for h in rows if h.get("impl") == "hf" and (h.get("batch"), h.get("seq")) == size), {})
    ratio = f"{row['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf.get("tokens_per_s") else ""
    peak = "n/a" if row.get("peak_gib") is None else f"{row['peak_gib']:.1f}"
    first = "" if row.get("compile_s") is None else f"{row['compile_s']:.2f}"
    return (
        f"{row['impl']:<18}{shape:>12}{row['tokens_per_s']:>11.0f}{ratio:>7}{peak:>10}{first:>12}"
        f"{row['loss0']:>9.4f}{row['loss_last']:>11.4f}"
    )


def format_runs(rows: Sequence[dict[str, Any]]) -> str:
    """A table of training rows: tokens/s (and the ratio to "hf" at the same size), peak GiB, the first
    step's wall time (torch.compile and Triton compile there), first and last loss."""
    return "\n".join([RUN_HEADER] + [format_run(r, rows) for r in rows])


def format_losses(row: dict[str, Any]) -> str:
    """The loss curve of one row on one line: warm-up steps, then ``|``, then the timed steps."""
    label = f"{row.get('impl', '?'):<18}{row.get('batch')}x{row.get('seq')}"
    losses = row.get("losses")
    if not losses:
        why = "out of memory" if row.get("oom") else "the run failed" if row.get("error") else "not recorded"
        return f"{label}  no losses ({why})"
    warmup = row.get("warmup", 0)
    text = " ".join(f"{v:.5f}" for v in losses[:warmup])
    timed = " ".join(f"{v:.5f}" for v in losses[warmup:])
    return f"{label}  " + (f"{text} | {timed}" if text else timed)


def _find_row(rows: Sequence[dict[str, Any]], mode: str, batch: int | None, seq: int | None) -> dict | None:
    return next(
        (r for r in rows if r.get("op") in (None, "e2e") and r.get("impl") == mode
         and (batch is None or r.get("batch") == batch) and (seq is None or r.get("seq") == seq)),
        None,
    )  # fmt: skip


def compare_losses(
    rows: Sequence[dict[str, Any]],
    reference: str = "liger_lab",
    other: str = "liger_lab+compile",
    *,
    rtol: float = BF16_RTOL,
    atol: float = 0.0,
    batch: int | None = None,
    seq: int | None = None,
) -> dict[str, Any]:
    """Whether the loss curves of two modes agree: at every step both ran, ``|other - reference| <= atol +
    rtol * |reference|``. The default rtol is one bf16 step (2**-7): two bf16 runs whose kernels round
    differently stay well inside it for a few steps (the reference runs differ by about 1e-4 relative),
    while a loss that does not move, or moves the wrong way, leaves it within a few steps. For fp32 runs
    pass a tighter rtol.

    Runs of the same seed see the same weights and batch, so step i of one is step i of the other
    whatever their warm-up split; steps only one ran are not compared. ``batch``/``seq`` pick the size
    (default: the first row of each mode). Returns {"reference", "other", "batch", "seq", "agree" (None
    when a curve is missing), "steps" compared, "max_diff", "worst_step", "rtol", "atol", "detail"}.
    """
    ref_row, other_row = _find_row(rows, reference, batch, seq), _find_row(rows, other, batch, seq)
    result: dict[str, Any] = {"reference": reference, "other": other, "batch": batch, "seq": seq, "agree": None,
                              "steps": 0, "max_diff": None, "worst_step": None, "rtol": rtol, "atol": atol}  # fmt: skip
    missing = [m for m, r in ((reference, ref_row), (other, other_row)) if not (r and r.get("losses"))]
    if missing:
        result["detail"] = "no loss curve for " + " and ".join(missing)
        return result
    result["batch"], result["seq"] = ref_row["batch"], ref_row["seq"]
    ref, oth = ref_row["losses"], other_row["losses"]
    steps = min(len(ref), len(oth))
    diffs = [abs(o - r) for r, o in zip(ref[:steps], oth[:steps], strict=True)]
    worst = max(range(steps), key=lambda i: diffs[i] - (atol + rtol * abs(ref[i])))
    bad = [i for i in range(steps) if not diffs[i] <= atol + rtol * abs(ref[i])]
    result.update(agree=not bad, steps=steps, max_diff=round(max(diffs), 6), worst_step=worst)
    if bad:
        first = bad[0]
        result["detail"] = (f"differ from step {first}: {oth[first]:.5f} against {ref[first]:.5f} (allowed "
                            f"{atol + rtol * abs(ref[first]):.2g}); {len(bad)} of {steps} steps outside")  # fmt: skip
    else:
        result["detail"] = (f"{steps} steps within rtol {rtol:.2g}: largest difference {max(diffs):.2g} "
                            f"(step {worst})")  # fmt: skip
    return result


def format_comparison(result: dict[str, Any]) -> str:
    """One line: the verdict of :func:`compare_losses`."""
    verdict = {True: "agree", False: "DISAGREE", None: "not compared"}[result["agree"]]
    size = f" at {result['batch']}x{result['seq']}" if result.get("batch") is not None else ""
    return f"losses {result['other']} vs {result['reference']}{size}: {verdict} ({result['detail']})"


# The targets of the compiled patched model, each (metric, comparison, reference mode, factor):
# compiled liger_lab at least as fast as eager liger_lab, 1.12x compiled Hugging Face, no more memory.
TARGET_MODE = "liger_lab+compile"
TARGETS = (
    ("tokens_per_s", ">=", "liger_lab", 1.0),
    ("tokens_per_s", ">=", "hf+compile", 1.12),
    ("peak_gib", "<=", "liger_lab", 1.0),
)


def check_targets(
    rows: Sequence[dict[str, Any]], *, batch: int | None = None, seq: int | None = None, rtol: float = BF16_RTOL
) -> list[dict[str, Any]]:
    """The targets of ``liger_lab+compile``: its loss curve agrees with eager liger_lab's (a fast run
    that does not train counts for nothing), its tokens/s are >= eager liger_lab's and >= 1.12x
    hf+compile's, and its peak memory is <= eager liger_lab's. One dict per target: {"target", "value",
    "bound", "met"}; met is None when a row or a number is missing (peak memory on CPU, a failed run).
    """
    losses = compare_losses(rows, "liger_lab", TARGET_MODE, rtol=rtol, batch=batch, seq=seq)
    results = [{"target": "loss curve agrees with liger_lab", "value": losses["max_diff"], "bound": None,
                "met": losses["agree"], "detail": losses["detail"]}]  # fmt: skip
    ours = _find_row(rows, TARGET_MODE, batch, seq) or {}
    for metric, comparison, reference, factor in TARGETS:
        base = (_find_row(rows, reference, batch, seq) or {}).get(metric)
        name = "tokens/s" if metric == "tokens_per_s" else "peak GiB"
        scale = f"{factor:g}x " if factor != 1 else ""
        bound = None if base is None else base * factor
        results.append(target(f"{name} {comparison} {scale}{reference}", ours.get(metric), comparison, bound))
    return results


def target(name: str, value: float | None, comparison: str, bound: float | None) -> dict[str, Any]:
    """One target for :func:`format_targets`: {"target": name, "value", "bound", "met"}, met when ``value
    comparison bound`` (">=" or "<="), None when either number is missing."""
    met = None if value is None or bound is None else (value >= bound if comparison == ">=" else value <= bound)
    return {"target": name, "value": value, "bound": bound, "met": met}


def format_targets(results: Sequence[dict[str, Any]]) -> str:
    """The targets of :func:`check_targets`, one line each: value, bound, met / MISSED / n/a."""
    lines = []
    for r in results:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[r["met"]]
        if r["value"] is None or r["bound"] is None:
            numbers = r.get("detail") or "(no number to compare)"
        else:
            numbers = f"{r['value']:,.1f} against {r['bound']:,.1f}"
        lines.append(f"  {r['target']:<34}{verdict:>7}   {numbers}")
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
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the +compile modes")
    args = parser.parse_args(argv)
    config = model_config(args.model, layers=args.layers)
    common = dict(dtype=DTYPES[args.dtype] if args.dtype else None, lr=args.lr, compile_backend=args.compile_backend)
    if args.task == "train":
        row = train(args.mode, config, args.batch, args.seq, steps=args.steps, warmup=args.warmup, **common)
    elif args.task == "fit":
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s] or [(args.batch, args.seq)]
        row = largest_fit(args.mode, config, shapes, **common)
    else:
        row = memory_timeline(args.mode, config, args.batch, args.seq, **common)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
