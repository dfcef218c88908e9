"""The benchmark's models: presets of config fields, keyed by the families of the Hugging Face layer's table.

A preset is a model type of :data:`liger_lab.hf.FAMILIES` (the one family table) and its sizes. What the
benchmark needs beyond that table lives in :data:`BENCHMARK_FAMILIES`, keyed by the same model types: Liger-Kernel's
entry point for the family, the norm counts the parameter count needs, and the config fields every preset of the
family shares. The config class comes from ``transformers.AutoConfig`` and the causal LM class from the family
table, so neither is written down twice.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from liger_lab import runtime
from liger_lab.hf import FAMILIES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class BenchmarkFamily:
    """What the benchmark needs of one family of :data:`liger_lab.hf.FAMILIES` that the table does not hold."""

    model_type: str  # a key of liger_lab.hf.FAMILIES: "qwen3"
    liger_patch: str  # Liger-Kernel's apply_liger_kernel_to_* for the family's causal LM
    gated_mlp: str  # that function's keyword for the fused gated MLP: "swiglu" or "geglu"
    layer_norms: int  # hidden-sized RMSNorm weights per decoder layer
    qk_norm: bool = False  # an RMSNorm over each query and key head (head_dim weights each)
    defaults: dict[str, Any] = field(default_factory=dict)  # config fields every preset of the family shares

    @property
    def model_class(self) -> str:
        """The family's causal LM class in transformers, as the family table names it: ``"Qwen3ForCausalLM"``."""
        return FAMILIES[self.model_type].name("ForCausalLM")


BENCHMARK_FAMILIES: dict[str, BenchmarkFamily] = {
    family.model_type: family
    for family in (
        BenchmarkFamily(
            "llama", "apply_liger_kernel_to_llama", "swiglu", layer_norms=2,
            defaults=dict(tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5),
        ),
        BenchmarkFamily(
            "qwen3", "apply_liger_kernel_to_qwen3", "swiglu", layer_norms=2, qk_norm=True,
            defaults=dict(tie_word_embeddings=True),
        ),
        # Gemma 3 dropped Gemma 2's final logit soft-cap; the benchmark keeps it so that the fused losses are
        # measured with the cap they must apply.
        BenchmarkFamily(
            "gemma3_text", "apply_liger_kernel_to_gemma3_text", "geglu", layer_norms=4, qk_norm=True,
            defaults=dict(tie_word_embeddings=True, final_logit_softcapping=30.0, sliding_window=512),
        ),
    )
}  # fmt: skip
"""The families a preset can be, by ``config.model_type``: each one of :data:`liger_lab.hf.FAMILIES`."""


@dataclass(frozen=True)
class Preset:
    family: str  # a key of BENCHMARK_FAMILIES
    fields: dict[str, Any]  # config fields, over the family's defaults


_TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1000)  # fmt: skip

MODEL_SIZES: dict[str, Preset] = {
    # 1498M parameters, output layer untied (525M in the embedding and output layer): the model of the
    # end-to-end benchmark.
    "1.5b": Preset("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                 num_key_value_heads=8, vocab_size=128256)),
    # 125M parameters (8 layers; 49M of them in the untied embedding and output layer): DESIGN's "small"
    # preset, a model whose eager training step waits on the host, where per-call host time decides tokens/s.
    "small": Preset("llama", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=12,
                                  num_key_value_heads=12, vocab_size=32000)),
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
"""Model presets by name: a family of :data:`BENCHMARK_FAMILIES` and its config fields (random weights)."""


def default_dtype() -> torch.dtype:
    """bf16 on the GPU; fp32 in the interpreter, where bf16 buys nothing (the kernels compute in fp32) and torch's
    CPU matmuls are slower in bf16."""
    return runtime.pick(cpu=torch.float32, gpu=torch.bfloat16)


def import_transformers() -> types.ModuleType:
    """``transformers``, or an ImportError that says which extra installs it."""
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
    fields = {**BENCHMARK_FAMILIES[preset.family].defaults, **preset.fields, "use_cache": False}
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return import_transformers().AutoConfig.for_model(preset.family, **fields)


def llama_config(model: str = "1.5b", *, layers: int | None = None) -> PretrainedConfig:
    """:func:`model_config` of a Llama preset ("1.5b", "8b", "tiny"): a ``transformers.LlamaConfig``."""
    config = model_config(model, layers=layers)
    if config.model_type != "llama":
        raise ValueError(f"model {model!r} is a {config.model_type} preset: model_config builds it")
    return config


def family_of(config: PretrainedConfig) -> BenchmarkFamily:
    """The :data:`BENCHMARK_FAMILIES` entry of a config (by its ``model_type``)."""
    if config.model_type not in BENCHMARK_FAMILIES:
        raise ValueError(f"model type {config.model_type!r}: expected one of {sorted(BENCHMARK_FAMILIES)}")
    return BENCHMARK_FAMILIES[config.model_type]


def head_dim(config: PretrainedConfig) -> int:
    """Channels per attention head: the config's ``head_dim``, else hidden size over query heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_dim(config: PretrainedConfig) -> int:
    """Channels of the key (and of the value) projection: key/value heads times the head size."""
    return config.num_key_value_heads * head_dim(config)
