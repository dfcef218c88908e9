"""Plain-PyTorch references: the specification every kernel is tested against.

Each function is the textbook formula written with torch operations, with the same dtype behaviour
as the Hugging Face / PyTorch code it stands for. Tests call them on float64 copies of the inputs to
get a reference that rounding does not blur.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0, casting_mode: str = "llama"
) -> torch.Tensor:
    """Llama's ``LlamaRMSNorm`` (casting_mode="llama") or Gemma's ``GemmaRMSNorm`` (casting_mode="gemma")."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute_dtype)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "gemma":
        return (h * (offset + weight.to(compute_dtype))).to(x.dtype)
    return (offset + weight) * h.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb``: q, k (B, heads, T, D); cos, sin (B or 1, T, D)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
) -> torch.Tensor:
    """Token-level cross-entropy with optional tanh softcap of the logits and z-loss on log-sum-exp.

    logits (..., V), target (...). Math in fp32 (or fp64 for fp64 input); the mean is over
    non-ignored tokens and is 0 when every token is ignored. The loss dtype is the logits' dtype
    (like ``torch.nn.functional.cross_entropy``).
    """
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.reshape(-1, logits.shape[-1]).to(compute_dtype)
    t = target.reshape(-1)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    keep = t != ignore_index
    safe_t = torch.where(keep, t, torch.zeros_like(t))
    lse = torch.logsumexp(z, dim=-1)
    nll = lse - z.gather(1, safe_t[:, None]).squeeze(1)
    if label_smoothing > 0:
        smooth = lse - z.mean(dim=-1)
        nll = (1 - label_smoothing) * nll + label_smoothing * smooth
    loss = nll + z_loss_scale * lse.pow(2)
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss.reshape(target.shape).to(logits.dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / keep.sum().clamp(min=1)
    return total.to(logits.dtype)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)``: what the fused kernel never materialises."""
    logits = F.linear(hidden, weight, bias)
    return cross_entropy(
        logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
        softcap=softcap,
    )  # fmt: skip
