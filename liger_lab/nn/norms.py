"""Normalisation modules: drop-ins for Hugging Face's RMSNorm classes and ``torch.nn.LayerNorm``, and the
residual add fused into an RMSNorm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from liger_lab.ops.layer_norm import layer_norm
from liger_lab.ops.rms_norm import add_rms_norm, rms_norm


class _RMSNormWeight(nn.Module):
    """The parameter and settings an RMSNorm holds, as ``LlamaRMSNorm`` names them (``weight``,
    ``variance_epsilon``), so a model's norm weights load unchanged. One constructor for both modules, so their
    parameters cannot drift apart; ``in_place_backward=True`` raises ``ValueError`` in a module that has none."""

    has_in_place_backward: ClassVar[bool]

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting_mode: str = "llama",
        in_place_backward: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if in_place_backward and not self.has_in_place_backward:
            raise ValueError(f"in_place_backward=True: {type(self).__name__} has no in-place backward")
        super().__init__()
        self.in_place_backward = in_place_backward
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, offset={self.offset}, casting={self.casting_mode}"


class RMSNorm(_RMSNormWeight):
    """Drop-in for ``LlamaRMSNorm`` (default) and ``GemmaRMSNorm`` (``offset=1.0, casting_mode="gemma"``).

    The weight starts at ones, or at zeros when an offset is given (Gemma stores ``w`` and scales by
    ``1 + w``). ``in_place_backward`` is for norms whose output feeds a projection only (see
    :func:`liger_lab.rms_norm`).
    """

    has_in_place_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            hidden_states, self.weight, self.variance_epsilon, offset=self.offset, casting_mode=self.casting_mode,
            in_place_backward=self.in_place_backward,
        )  # fmt: skip


class AddRMSNorm(_RMSNormWeight):
    """A pre-norm decoder's residual add and the RMSNorm after it, one kernel each way: ``module(x, residual)``
    returns ``(norm(x + residual), x + residual)``, the next sublayer's input and the new residual stream.

    Parameters, defaults and state dict are :class:`RMSNorm`'s (and so ``LlamaRMSNorm``'s, or ``GemmaRMSNorm``'s
    with ``offset=1.0, casting_mode="gemma"``): a model's norm weights load unchanged. It is not an RMSNorm
    drop-in (it takes two inputs and returns two), and it has no in-place backward: the sum's gradient also
    flows on along the residual stream (``in_place_backward=True`` raises ``ValueError``).
    """

    has_in_place_backward = False

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(
            hidden_states, residual, self.weight, self.variance_epsilon, offset=self.offset,
            casting_mode=self.casting_mode,
        )  # fmt: skip


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` over the last dimension, with a learnable weight and bias.

    Same constructor, attributes (``normalized_shape``, ``eps``, ``elementwise_affine``, ``weight``,
    ``bias``) and state dict as PyTorch's module, so either loads the other's weights. The kernel
    normalises one dimension and needs both parameters: a longer ``normalized_shape``,
    ``elementwise_affine=False`` or ``bias=False`` raise ``ValueError``.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"normalized_shape is {shape}: expected one dimension (the hidden size)")
        if not (elementwise_affine and bias):
            raise ValueError("expected elementwise_affine=True and bias=True: the kernel applies a weight and a bias")
        self.normalized_shape = shape
        self.eps = eps
        self.elementwise_affine = True
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        # torch.nn.LayerNorm's own words, in whichever torch is installed (newer ones add "bias=True").
        return nn.LayerNorm.extra_repr(self)
