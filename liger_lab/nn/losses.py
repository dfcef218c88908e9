"""Loss modules: ``torch.nn.CrossEntropyLoss`` on liger_lab's kernel, the fused linear cross-entropy, the
generalized JSD of distillation and the fused linear preference losses.

Each is its loss function as a module: it holds only the function's keyword options (:class:`LossModule`) and
takes the tensors in ``forward``, in the argument order of its Liger-Kernel counterpart where it has one."""

from __future__ import annotations

import torch
from torch import nn

from liger_lab.ops.cross_entropy import cross_entropy
from liger_lab.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from liger_lab.ops.fused_linear_jsd import fused_linear_jsd
from liger_lab.ops.jsd import jsd
from liger_lab.ops.preference import fused_linear_dpo, fused_linear_orpo, fused_linear_simpo


class LossModule(nn.Module):
    """A loss function as a module. Its options are module attributes (a trainer may change one after
    construction), passed to the function as keywords (:attr:`options`) and listed by ``repr``. It holds no
    parameters: the weights are the caller's (tied to an embedding or not), passed to ``forward``."""

    def __init__(self, **options: object) -> None:
        super().__init__()
        self._option_names = tuple(options)
        for name, value in options.items():
            setattr(self, name, value)

    @property
    def options(self) -> dict[str, object]:
        """The function's keyword options, as the attributes hold them now."""
        return {name: getattr(self, name) for name in self._option_names}

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())


class CrossEntropyLoss(LossModule):
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
        super().__init__(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                         softcap=softcap, z_loss_scale=z_loss_scale, in_place_backward=in_place_backward)  # fmt: skip

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(input, target, **self.options)


class FusedLinearCrossEntropyLoss(LossModule):
    """The loss of an ``lm_head`` without its logits: ``forward(lin_weight, _input, target, bias=None)``.

    The argument order is Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (weight first), so code
    written for it works unchanged: ``loss = lce(model.lm_head.weight, hidden_states, labels)``. See
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
        super().__init__(ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
                         softcap=softcap, chunk_tokens=chunk_tokens, accumulation=accumulation,
                         in_place_backward=in_place_backward)  # fmt: skip

    def forward(
        self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return fused_linear_cross_entropy(_input, lin_weight, target, bias, **self.options)


class JSD(LossModule):
    """The generalized JSD of on-policy distillation (TRL's GKD), :func:`liger_lab.jsd` as a module:
    ``loss = JSD(beta=0.5, temperature=1.0)(student_logits, teacher_logits, target=None)``.

    Logits (..., V), not log-probabilities (Liger-Kernel's ``LigerJSD`` takes log-probabilities); the
    loss is a float32 scalar, the mean over rows whose target is not ``ignore_index``, with no ``T**2``
    factor. Only the student gets a gradient.
    """

    def __init__(self, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100) -> None:
        super().__init__(beta=beta, temperature=temperature, ignore_index=ignore_index)

    def forward(
        self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor | None = None
    ) -> torch.Tensor:
        return jsd(student_logits, teacher_logits, target, **self.options)


class FusedLinearJSD(LossModule):
    """:func:`liger_lab.fused_linear_jsd` as a module: the JSD of a student's and a teacher's ``lm_head``
    outputs without their logits, ``loss = FusedLinearJSD(beta=0.5, temperature=1.0)(student_hidden,
    student_weight, teacher_hidden, teacher_weight, target=None)``.

    Both heads are passed to ``forward`` (the teacher's head is often frozen or tied elsewhere); the argument order
    is that of Liger-Kernel's ``LigerFusedLinearJSD`` (whose ``jsd_beta`` is ``beta`` here). Hidden states (..., H_s)
    and (..., H_t), weights (V, H_s) and (V, H_t); gradients reach the student's hidden states and weight only. See
    the function for ``chunk_tokens`` and ``accumulation``.
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
        super().__init__(beta=beta, temperature=temperature, ignore_index=ignore_index, chunk_tokens=chunk_tokens,
                         accumulation=accumulation)  # fmt: skip

    def forward(self, student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                teacher_weight: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return fused_linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, target, **self.options)


class FusedLinearDPOLoss(LossModule):
    """:func:`liger_lab.fused_linear_dpo` as a module: ``loss = dpo(lin_weight, _input, target, ref_input,
    ref_weight)``, the weight first as in :class:`FusedLinearCrossEntropyLoss`. ``_input`` (2B, T, H) holds the
    chosen sequences in rows [0, B) and the rejected ones in [B, 2B); the reference model gets no gradient."""

    def __init__(self, beta: float = 0.1, ignore_index: int = -100, *, chunk_pairs: int | None = None) -> None:
        super().__init__(beta=beta, ignore_index=ignore_index, chunk_pairs=chunk_pairs)

    def forward(self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor, ref_input: torch.Tensor,
                ref_weight: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return fused_linear_dpo(_input, lin_weight, target, ref_input, ref_weight, **self.options)


class FusedLinearORPOLoss(LossModule):
    """:func:`liger_lab.fused_linear_orpo` as a module: ``loss = orpo(lin_weight, _input, target)`` (chosen NLL
    plus the odds-ratio term)."""

    def __init__(self, beta: float = 0.1, ignore_index: int = -100, *, chunk_pairs: int | None = None) -> None:
        super().__init__(beta=beta, ignore_index=ignore_index, chunk_pairs=chunk_pairs)

    def forward(self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fused_linear_orpo(_input, lin_weight, target, **self.options)


class FusedLinearSimPOLoss(LossModule):
    """:func:`liger_lab.fused_linear_simpo` as a module: ``loss = simpo(lin_weight, _input, target)`` (no
    reference model, no NLL term)."""

    def __init__(
        self, beta: float = 2.0, gamma: float = 0.5, ignore_index: int = -100, *, chunk_pairs: int | None = None
    ) -> None:
        super().__init__(beta=beta, gamma=gamma, ignore_index=ignore_index, chunk_pairs=chunk_pairs)

    def forward(self, lin_weight: torch.Tensor, _input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fused_linear_simpo(_input, lin_weight, target, **self.options)
