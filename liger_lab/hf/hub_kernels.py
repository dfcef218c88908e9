"""liger_lab's layers for the Hub-kernels route: ``use_kernels=True`` in transformers and TRL, offline.

transformers marks layers with ``use_kernel_forward_from_hub("RMSNorm")`` (every family's RMSNorm class; the name is
the class's ``kernel_layer_name``), and ``from_pretrained(..., use_kernels=True)`` (TRL: ``model_init_kwargs={
"use_kernels": True}``) asks the ``kernels`` package to *kernelize* the model: each marked module's ``forward`` is
replaced by the ``forward`` of the layer that the kernel mapping names for its layer name, device and mode
(training, inference, ``torch.compile``). The mapping usually points at Hub repositories, downloaded on first use.

This module is a repository of its own, already installed: :class:`InstalledLayer` loads a layer class from
:data:`layers` with no download, and :func:`kernel_mapping` maps the layer names to them, for CUDA and CPU (where the
kernels run in Triton's interpreter), in every mode. :func:`register` puts the mapping in the ``kernels`` package's
global mapping and, where transformers' integration is active, in transformers' default mapping, which
``use_kernels=True`` registers again at every load: after it, ``use_kernels=True`` gives liger_lab's layers.
:func:`unregister` puts back what was there.

A layer here is what the ``kernels`` package accepts: no constructor and no state of its own (it runs on the
replaced module's weights), ``forward`` with the signature of the forward it replaces, ``has_backward`` and
``can_torch_compile`` flags. The RMSNorm layer computes with the rounding of the module's family (Llama's, OLMo's
fp32 weight, Gemma's 1 + w: the family rows of :data:`liger_lab.hf.FAMILIES`); a norm of a class no row names, or
without weight, runs its own forward. The route reaches what transformers marks, the norms; the gated MLP, RoPE, the
residual add and the loss that never holds the logits are :func:`liger_lab.patch`'s, which a model kernelized this
way may take as well.

``TrainingArguments(use_liger_kernel=True)`` (and TRL's configs, which pass it on) makes transformers' Trainer call
Liger-Kernel, and raise ImportError where it is not installed: :func:`serve_use_liger_kernel` has the Trainer call
:func:`liger_lab.patch` instead.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from liger_lab.hf.api import patch
from liger_lab.hf.families import FAMILIES
from liger_lab.ops import glu as glu_ops
from liger_lab.ops import rms_norm as rms_norm_ops

# How each family's norm rounds (the rows' ``norm``), as rms_norm's keywords.
_NORM_KEYWORDS: dict[str, dict[str, Any]] = {
    "llama": {},
    "fp32_weight": {"casting_mode": "gemma"},
    "gemma": {"offset": 1.0, "casting_mode": "gemma"},
}


_NORMS: dict[type, str | None] = {}


def _norm_of(cls: type) -> str | None:
    """The rounding of a transformers RMSNorm class, from the family row that names it; None for another class."""
    if cls not in _NORMS:
        module = cls.__module__.rpartition(".modeling_")[2]
        rows = (f for t, f in FAMILIES.items() if (f.module or t) == module and f.name("RMSNorm") == cls.__name__)
        _NORMS[cls] = next((family.norm for family in rows), None)
    return _NORMS[cls]


def _rms_norm(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    norm = _norm_of(type(module))
    weight = getattr(module, "weight", None)
    if norm is None or weight is None:  # a norm of another formula, or without weight: its own forward
        return type(module).forward(module, hidden_states)
    eps = getattr(module, "variance_epsilon", None)
    eps = module.eps if eps is None else eps
    return rms_norm_ops.rms_norm(hidden_states, weight, eps, **_NORM_KEYWORDS[norm])


def _gated_mlp(module: nn.Module, x: torch.Tensor, glu: Any) -> torch.Tensor:
    return module.down_proj(glu(module.gate_proj(x), module.up_proj(x)))


class _Layers:
    """The layers, by the names the kernel mapping uses (a namespace, as a kernel repository's ``layers``)."""

    class RMSNorm(nn.Module):
        """Any family's RMSNorm on liger_lab's kernel, with the family's rounding."""

        has_backward = True
        can_torch_compile = True

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return _rms_norm(self, hidden_states)

    class SwiGLUMLP(nn.Module):
        """``down_proj(silu(gate_proj(x)) * up_proj(x))``, the product fused."""

        has_backward = True
        can_torch_compile = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _gated_mlp(self, x, glu_ops.swiglu)

    class GeGLUMLP(nn.Module):
        """``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``, the product fused."""

        has_backward = True
        can_torch_compile = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _gated_mlp(self, x, glu_ops.geglu)


layers = types.SimpleNamespace(RMSNorm=_Layers.RMSNorm, SwiGLUMLP=_Layers.SwiGLUMLP, GeGLUMLP=_Layers.GeGLUMLP)
"""liger_lab's kernel layers, by layer name."""

DEVICES = ("cuda", "cpu")
"""The device types mapped: the GPU, and the CPU (Triton's interpreter)."""


class InstalledLayer:
    """A ``kernels`` repository (``load()`` returns the layer class) served from the installed liger_lab: nothing is
    downloaded, nothing is read from the Hub, the same layer in every mode."""

    def __init__(self, layer_name: str) -> None:
        if not hasattr(layers, layer_name):
            raise ValueError(f"layer {layer_name!r}: expected one of {sorted(vars(layers))}")
        self.layer_name = layer_name

    def load(self) -> type[nn.Module]:
        return getattr(layers, self.layer_name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InstalledLayer) and other.layer_name == self.layer_name

    def __hash__(self) -> int:
        return hash(("liger_lab", self.layer_name))

    def __str__(self) -> str:
        return f"liger_lab (installed), layer `{self.layer_name}`"


def kernel_mapping(devices: tuple[str, ...] = DEVICES) -> dict[str, dict[str, Any]]:
    """The kernel mapping to liger_lab's layers, for ``kernels.register_kernel_mapping`` or ``use_kernel_mapping``:
    layer name -> device type -> mode -> repository, for every mode (training and inference, compiled or not)."""
    from kernels import Mode

    modes = (Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE, Mode.INFERENCE | Mode.TORCH_COMPILE)
    return {
        name: {device: {mode: InstalledLayer(name) for mode in modes} for device in devices} for name in vars(layers)
    }


_DISPLACED: dict[str, object] = {}


def _transformers_mapping() -> dict[str, Any] | None:
    """transformers' default kernel mapping (what ``use_kernels=True`` registers), None where its integration is off
    (no ``kernels`` package of the versions it supports)."""
    try:
        from transformers.integrations import hub_kernels
    except ImportError:
        return None
    get = getattr(hub_kernels, "get_kernel_mapping_transformers", None)
    return get() if get is not None else None


def register(devices: tuple[str, ...] = DEVICES) -> dict[str, dict[str, Any]]:
    """Make ``kernelize`` and ``use_kernels=True`` use liger_lab's layers for the layer names of :data:`layers`.

    Registers :func:`kernel_mapping` with the ``kernels`` package and writes it over the same names of transformers'
    default mapping (which ``use_kernels=True`` registers again when it loads a model). Returns the mapping. Raises
    ImportError naming the package when ``kernels`` is not installed."""
    try:
        from kernels import register_kernel_mapping
    except ImportError as error:
        raise ImportError(
            "liger_lab.hf.hub_kernels.register() needs the `kernels` package (pip install kernels); without it, "
            "liger_lab.patch(model) fuses the same layers and more"
        ) from error
    mapping = kernel_mapping(devices)
    register_kernel_mapping(mapping)
    defaults = _transformers_mapping()
    if defaults is not None:
        for name, entry in mapping.items():
            _DISPLACED.setdefault(name, defaults.get(name))
            defaults[name] = entry
    return mapping


def unregister() -> None:
    """Undo :func:`register` in transformers' default mapping and drop liger_lab's layers from the ``kernels``
    package's mapping (a model kernelized meanwhile keeps the forwards it got)."""
    defaults = _transformers_mapping()
    for name, displaced in _DISPLACED.items():
        if defaults is not None:
            if displaced is None:
                defaults.pop(name, None)
            else:
                defaults[name] = displaced
    _DISPLACED.clear()
    try:
        import kernels
    except ImportError:
        return
    # The package keeps its global mapping beside ``kernelize`` and offers no call that removes an entry; the module
    # that defines kernelize has moved between releases (kernels.layer.kernelize, then kernels._internals...).
    mapping = getattr(inspect.getmodule(kernels.kernelize), "_KERNEL_MAPPING", None)
    if mapping is None:
        raise RuntimeError(
            f"liger_lab.hf.hub_kernels.unregister(): kernels {getattr(kernels, '__version__', '?')} keeps its layer "
            "mapping where liger_lab does not find it; liger_lab's layers stay registered in this process"
        )
    current = mapping.get()
    for name in vars(layers):
        current.pop(name, None)
        if defaults is not None and name in defaults:  # transformers' own entry, as use_kernels=True registers it
            kernels.register_kernel_mapping({name: defaults[name]})


# Liger-Kernel's keywords (``liger_kernel_config``) that liger_lab.patch takes under the same name; the others
# (geglu and layer_norm, which patch decides per family, and model-specific ones) are accepted and have no effect.
_PATCH_KEYWORDS = ("rope", "swiglu", "rms_norm", "cross_entropy", "fused_linear_cross_entropy")


def _apply_liger_lab(model: nn.Module, kernel_config: dict[str, Any] | None) -> None:
    """What the Trainer calls for ``use_liger_kernel=True`` once :func:`serve_use_liger_kernel` ran: liger_lab.patch
    on the model (the one PEFT wraps), with the keywords of ``liger_kernel_config`` that patch shares."""
    from transformers.trainer_utils import unwrap_peft_model

    options = {key: bool(value) for key, value in (kernel_config or {}).items() if key in _PATCH_KEYWORDS}
    patch(unwrap_peft_model(model), **options)


def serve_use_liger_kernel() -> None:
    """``TrainingArguments(use_liger_kernel=True)`` (TRL's ``SFTConfig``, ``DPOConfig``, ... too) patches the model
    with liger_lab instead of importing Liger-Kernel: the Trainer's call is replaced for this process."""
    import transformers.trainer

    transformers.trainer.apply_liger_kernel = _apply_liger_lab
