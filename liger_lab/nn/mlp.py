"""Gated MLPs: drop-ins for Hugging Face's ``LlamaMLP`` (SwiGLU) and ``GemmaMLP`` (GeGLU).

``down_proj(act(gate_proj(x)) * up_proj(x))`` with the activation and the product fused into one
kernel each way. Parameter names and shapes are those of the Hugging Face modules, so a state dict
loads either way.

The backward writes its gradients over the gate and up activations (``in_place_backward=True``, the
default here). That is safe inside this module: both are fresh outputs of its own projections, never
returned, and ``nn.Linear`` saves its input and weight, not its output, so nothing reads them after
the fused op's backward. If a replacement projection did save its output, autograd reports the
overwrite as an error (see :func:`liger_lab.swiglu`); pass ``in_place_backward=False`` for such setups.
A projection that other code watches (:func:`outputs_observed`: a forward hook may keep its output, which
autograd cannot see) gets fresh gradients on every call it is watched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

from liger_lab.ops.glu import geglu, swiglu

_MLP = TypeVar("_MLP", bound="_GatedMLP")


def outputs_observed(*modules: nn.Module) -> bool:
    """Whether code other than the caller may see these modules' calls and outputs: then no backward may write over
    their outputs, nor may a fused path skip their calls.

    True for a forward hook or a forward pre-hook on any of them, a global module hook
    (``torch.nn.modules.module.register_module_forward_hook`` and its pre-hook twin), or a ``forward`` set on the
    instance (accelerate's hooks wrap the module's call that way). A forward hook may keep the output, and autograd
    cannot tell: an overwrite would change what it kept with no error. A pre-hook cannot see the output, but it
    marks a module another library takes part in (FSDP2, PEFT's adapter_names, a profiler), which may see it
    afterwards; the price of a wrong guess is one fresh buffer, against wrong values. Checked per call: hooks come
    and go on a built model."""
    if _module_hooks._global_forward_hooks or _module_hooks._global_forward_pre_hooks:
        return True
    return any(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__ for module in modules)


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
        in_place = self.in_place_backward and not outputs_observed(self.gate_proj, self.up_proj)
        return self.down_proj(self._glu(self.gate_proj(x), self.up_proj(x), in_place_backward=in_place))

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
