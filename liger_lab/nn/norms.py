"""Normalisation modules: drop-ins for Hugging Face's RMSNorm classes and ``torch.nn.LayerNorm``."""

from __future__ import annotations

import torch
from torch import nn

from liger_lab.ops.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """Drop-in for ``LlamaRMSNorm`` (default) and ``GemmaRMSNorm`` (``offset=1.0, casting_mode="gemma"``).

    The weight starts at ones, or at zeros when an offset is given (Gemma stores ``w`` and scales by
    ``1 + w``). ``in_place_backward`` is for norms whose output feeds a projection only (see
    :func:`liger_lab.rms_norm`).
    """

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
        super().__init__()
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.in_place_backward = in_place_backward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            hidden_states, self.weight, self.variance_epsilon, offset=self.offset, casting_mode=self.casting_mode,
            in_place_backward=self.in_place_backward,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, offset={self.offset}, casting={self.casting_mode}"
