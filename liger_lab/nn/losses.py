"""Loss modules: ``torch.nn.CrossEntropyLoss`` on liger_lab's kernel, the fused linear cross-entropy, and the
generalized JSD of distillation."""

from __future__ import annotations

import torch
from torch import nn

from liger_lab.ops.cross_entropy import cross_entropy
from liger_lab.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from liger_lab.ops.fused_linear_jsd import fused_linear_jsd
from liger_lab.ops.jsd import jsd
from liger_lab.ops.preference import fused_linear_dpo, fused_linear_orpo, fused_linear_simpo


class CrossEntropyLoss(nn.Module):
    """``torch.nn.CrossEntropyLoss`` for class indices, plus ``softcap`` and ``z_loss_scale``.

    Logits are (..., V) with the classes *last* (the layout of language-model logits; torch's
    (N, C, d1, ...) layout is not accepted beyond N x C), targets (...). Per-class ``weight`` and soft
    (probability) targets are not supported. ``in_place_backward=True`` (off by default, as in
    :func:`liger_lab.cross_entropy`) writes the gradient over the logits: then do not read them after the loss.
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        softcap: float | None = None,
        z_loss_scale: float = 0.0,
        in_place_backward: bool = False,
    ) -> None:
        super().__init__()
        self.in_place_backward = in_place_backward
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.softcap = softcap
        self.z_loss_scale = z_loss_scale

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(
            input, target, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            reduction=self.reduction, softcap=self.softcap, z_loss_scale=self.z_loss_scale,
            in_place_backward=self.in_place_backward,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"softcap={self.softcap}, z_loss_scale={self.z_loss_scale}"
        )


class FusedLinearCrossEntropyLoss(nn.Module):
    """The loss of an ``lm_head`` without its logits: ``forward(lin_weight, _input, target, bias=None)``.

    The argument order is Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (weight first), so code
    written for it works unchanged: ``loss = lce(model.lm_head.weight, hidden_states, labels)``. The
    module holds no parameters; the weight is the caller's (tied to the embedding or not). See
    :func:`liger_lab.fused_linear_cross_entropy` for ``chunk_tokens``, ``accumulation`` and
    ``in_place_backward`` (off by default: it overwrites the hidden states passed in).
    """

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        *,
        chunk_tokens: int | None = None,
        accumulation: str | None = None,
        in_place_backward: bool = False,
    ) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.chunk_tokens = chunk_tokens
        self.accumulation = accumulation
        self.in_place_backward = in_place_backward

    def forward(
        self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return fused_linear_cross_entropy(
            _input, lin_weight, target, bias, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            reduction=self.reduction, softcap=self.softcap, chunk_tokens=self.chunk_tokens,
            accumulation=self.accumulation, in_place_backward=self.in_place_backward,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, reduction={self.reduction!r}, "
            f"softcap={self.softcap}, accumulation={self.accumulation}, in_place_backward={self.in_place_backward}"
        )


class JSD(nn.Module):
    """The generalized JSD of on-policy distillation (TRL's GKD), :func:`liger_lab.jsd` as a module:
    ``loss = JSD(beta=0.5, temperature=1.0)(student_logits, teacher_logits, target=None)``.

    Logits (..., V), not log-probabilities (Liger-Kernel's ``LigerJSD`` takes log-probabilities); the
    loss is a float32 scalar, the mean over rows whose target is not ``ignore_index``, with no ``T**2``
    factor. Only the student gets a gradient. The module holds no parameters.
    """

    def __init__(self, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100) -> None:
        super().__init__()
        self.beta = beta
        self.temperature = temperature
        self.ignore_index = ignore_index

    def forward(
        self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor | None = None
    ) -> torch.Tensor:
        return jsd(
            student_logits, teacher_logits, target, beta=self.beta, temperature=self.temperature,
            ignore_index=self.ignore_index,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"beta={self.beta}, temperature={self.temperature}, ignore_index={self.ignore_index}"


class FusedLinearJSD(nn.Module):
    """:func:`liger_lab.fused_linear_jsd` as a module: the JSD of a student's and a teacher's ``lm_head``
    outputs without their logits, ``loss = FusedLinearJSD(beta=0.5, temperature=1.0)(student_hidden,
    student_weight, teacher_hidden, teacher_weight, target=None)``.

    Both heads are passed to ``forward`` (the module holds no parameters, and the teacher's head is often
    frozen or tied elsewhere); the argument order is that of Liger-Kernel's ``LigerFusedLinearJSD``
    (whose ``jsd_beta`` is ``beta`` here). Hidden states (..., H_s) and (..., H_t), weights (V, H_s) and
    (V, H_t); gradients reach the student's hidden states and weight only. See the function for
    ``chunk_tokens`` and ``accumulation``.
    """

    def __init__(
        self,
        beta: float = 0.5,
        temperature: float = 1.0,
        ignore_index: int = -100,
        *,
        chunk_tokens: int | None = None,
        accumulation: str | None = None,
    ) -> None:
        super().__init__()
        self.beta = beta
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.chunk_tokens = chunk_tokens
        self.accumulation = accumulation

    def forward(
        self,
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        target: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return fused_linear_jsd(
            student_hidden, student_weight, teacher_hidden, teacher_weight, target, beta=self.beta,
            temperature=self.temperature, ignore_index=self.ignore_index, chunk_tokens=self.chunk_tokens,
            accumulation=self.accumulation,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"beta={self.beta}, temperature={self.temperature}, ignore_index={self.ignore_index}, "
            f"chunk_tokens={self.chunk_tokens}, accumulation={self.accumulation}"
        )


class FusedLinearDPOLoss(nn.Module):
    """:func:`liger_lab.fused_linear_dpo` as a module: ``loss = dpo(lin_weight, _input, target, ref_input,
    ref_weight)``, the weight first as in :class:`FusedLinearCrossEntropyLoss`. ``_input`` (2B, T, H) holds the
    chosen sequences in rows [0, B) and the rejected ones in [B, 2B); the reference model gets no gradient.
    The module holds no parameters."""

    def __init__(self, beta: float = 0.1, ignore_index: int = -100, *, chunk_pairs: int | None = None) -> None:
        super().__init__()
        self.beta = beta
        self.ignore_index = ignore_index
        self.chunk_pairs = chunk_pairs

    def forward(
        self,
        lin_weight: torch.Tensor,
        _input: torch.Tensor,
        target: torch.Tensor,
        ref_input: torch.Tensor,
        ref_weight: torch.Tensor,
    ) -> torch.Tensor:
        return fused_linear_dpo(
            _input, lin_weight, target, ref_input, ref_weight, beta=self.beta, ignore_index=self.ignore_index,
            chunk_pairs=self.chunk_pairs,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}"


class FusedLinearORPOLoss(nn.Module):
    """:func:`liger_lab.fused_linear_orpo` as a module: ``loss = orpo(lin_weight, _input, target)`` (chosen NLL
    plus the odds-ratio term). The module holds no parameters."""

    def __init__(self, beta: float = 0.1, ignore_index: int = -100, *, chunk_pairs: int | None = None) -> None:
        super().__init__()
        self.beta = beta
        self.ignore_index = ignore_index
        self.chunk_pairs = chunk_pairs

    def forward(self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fused_linear_orpo(
            _input, lin_weight, target, beta=self.beta, ignore_index=self.ignore_index, chunk_pairs=self.chunk_pairs
        )

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}"


class FusedLinearSimPOLoss(nn.Module):
    """:func:`liger_lab.fused_linear_simpo` as a module: ``loss = simpo(lin_weight, _input, target)`` (no
    reference model, no NLL term). The module holds no parameters."""

    def __init__(
        self, beta: float = 2.0, gamma: float = 0.5, ignore_index: int = -100, *, chunk_pairs: int | None = None
    ) -> None:
        super().__init__()
        self.beta = beta
        self.gamma = gamma
        self.ignore_index = ignore_index
        self.chunk_pairs = chunk_pairs

    def forward(self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fused_linear_simpo(
            _input, lin_weight, target, beta=self.beta, gamma=self.gamma, ignore_index=self.ignore_index,
            chunk_pairs=self.chunk_pairs,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"beta={self.beta}, gamma={self.gamma}, ignore_index={self.ignore_index}"
