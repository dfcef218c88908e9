"""Gated MLPs: drop-ins for Hugging Face's ``LlamaMLP`` (SwiGLU) and ``GemmaMLP`` (GeGLU).

``down_proj(act(gate_proj(x)) * up_proj(x))`` with the activation and the product fused into one
kernel each way. Parameter names and shapes are those of the Hugging Face modules, so a state dict
loads either way.

The backward writes its gradients over the gate and up activations (``in_place_backward=True``, the
default here). That is safe inside this module: both are fresh outputs of its own projections, never
returned, and ``nn.Linear`` saves its input and weight, not its output, so nothing reads them after
the fused op's backward. If a replacement projection did save its output, autograd reports the
overwrite as an error (see :func:`liger_lab.swiglu`); pass ``in_place_backward=False`` for such setups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from liger_lab.ops.swiglu import geglu, swiglu

_MLP = TypeVar("_MLP", bound="_GatedMLP")


class _GatedMLP(nn.Module):
    _glu: ClassVar[Callable[..., torch.Tensor]]
    # Values of the config's activation name that mean this module's activation.
    hf_activations: ClassVar[tuple[str, ...]]

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        in_place_backward: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.in_place_backward = in_place_backward
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_config(cls: type[_MLP], config: Any, **kwargs: Any) -> _MLP:
        """Build from a Hugging Face config (``hidden_size``, ``intermediate_size``, the activation name in
        ``hidden_activation`` (Gemma 2/3) or ``hidden_act``, and ``mlp_bias`` where the config has it)."""
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if activation not in cls.hf_activations:
            raise ValueError(
                f"config's activation is {activation!r}: {cls.__name__} computes one of {cls.hf_activations}"
            )
        bias = bool(getattr(config, "mlp_bias", False))
        return cls(config.hidden_size, config.intermediate_size, bias, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self._glu(self.gate_proj(x), self.up_proj(x), in_place_backward=self.in_place_backward)
        return self.down_proj(gated)

    def extra_repr(self) -> str:
        return f"in_place_backward={self.in_place_backward}"


class SwiGLUMLP(_GatedMLP):
    """Drop-in for ``LlamaMLP`` (and Mistral's, Qwen's, ... of the same shape): ``silu`` gate."""

    _glu = staticmethod(swiglu)
    hf_activations = ("silu", "swish")


class GeGLUMLP(_GatedMLP):
    """Drop-in for ``GemmaMLP`` (and Gemma 2/3's): tanh-approximated ``gelu`` gate."""

    _glu = staticmethod(geglu)
    # Three Hugging Face names for the same tanh approximation of gelu.
    hf_activations = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
