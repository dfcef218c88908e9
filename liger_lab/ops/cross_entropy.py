r"""Cross-entropy over a vocabulary, with the gradient written over the logits during the forward.

For one row of logits :math:`z \in \mathbb{R}^V` (after the optional softcap
:math:`z \leftarrow c \tanh(z / c)`) and target class :math:`t`, with smoothing :math:`\varepsilon` and z-loss
scale :math:`\zeta`::

    lse  = log(sum_j exp(z_j))                    # online: running max and rescaled sum, fp32
    loss = (1 - eps) * (lse - z_t) + eps * (lse - mean_j z_j) + zeta * lse**2

Gradient (derivation in solutions/05_cross_entropy.ipynb), with p = softmax(z)::

    dloss/dz_j = p_j * (1 + 2 * zeta * lse) - eps / V - (1 - eps) * [j == t]
    softcap:  multiply by 1 - (z_j / c)**2         # d(c tanh(x / c))/dx, z_j the capped value

Rows whose target is ``ignore_index`` have loss 0 and gradient 0 (their logits are not even read); the
mean divides by the number of other rows, and is 0 when there are none.

Bytes: the gradient has the logits' shape, and a (tokens x 128k) bf16 logits tensor is 2 GiB. One
program per row reads the row once for the statistics (pass 1), then reads it again and writes the
gradient *over it* (pass 2): no logits-sized buffer is ever allocated. Pass 2 walks the row backwards,
so the blocks pass 1 read last, the likeliest to still be in L2, are read first, and eviction hints keep
pass 1's blocks in L2 ahead of the gradient being written: on an H200 the kernel goes from three HBM
passes' time (1.65 ms at 8192 x 128k) to 1.42 ms. The backward only multiplies the buffer by the
upstream gradient, and skips even that when it is exactly 1 (a plain ``loss.backward()``).

Targets are checked (count of kept rows, any class index out of range) by a small kernel whose result
the host reads only after the big kernel is queued, so the GPU never waits for the host in between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from liger_lab import runtime
from liger_lab.ops.common import as_rows, check_float, rows_to_overwrite

REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _cross_entropy_kernel(
    z_ptr, z_row_stride, target_ptr, loss_ptr, row_scale_ptr, count_ptr,
    n_rows, n_cols, ignore_index, label_smoothing, softcap, z_loss_scale, grad_scale,
    SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
    ROW_SCALE: tl.constexpr, DIVIDE_BY_COUNT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    # An out-of-range target raises a ValueError on the host once the count kernel's result arrives,
    # which may be after this kernel started: such a row is skipped here, never read out of bounds.
    valid = row_mask & (target != ignore_index) & (target >= 0) & (target < n_cols)
    row_ptr = z_ptr + rows.to(tl.int64) * z_row_stride  # int64: 16k rows x 128k columns passes 2**31
    cols = tl.arange(0, BLOCK_N)

    # Pass 1: running max m and sum s of exp(z - m) over blocks of the row, in fp32. Ignored rows
    # load nothing (masked), so they cost no bandwidth.
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    z_sum = tl.zeros([ROWS], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = valid[:, None] & ((start + cols) < n_cols)[None, :]
        # evict_last: pass 2 reads this block again, so it should outlive the traffic of other rows in L2.
        ptrs = row_ptr[:, None] + (start + cols)[None, :]
        z = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if SOFTCAP:  # softcap * tanh(z / softcap), tanh through the sigmoid (no libdevice in the interpreter)
            z = softcap * (2 * tl.sigmoid(2 * z / softcap) - 1)
        if SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=1)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        # A row that has seen nothing yet still has m = -inf: shift by 0 there, not by -inf - -inf = nan.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift[:, None]), axis=1)
        m = m_new
    lse = tl.where(valid, m + tl.log(tl.where(valid, s, 1.0)), 0.0)

    z_target = tl.load(row_ptr + target, mask=valid, other=0.0).to(tl.float32)
    if SOFTCAP:
        z_target = softcap * (2 * tl.sigmoid(2 * z_target / softcap) - 1)
    loss = lse - z_target
    if SMOOTHING:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - z_sum / n_cols)
    if Z_LOSS:
        loss += z_loss_scale * lse * lse
    tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_mask)

    if WRITE_GRAD:
        # Pass 2: the gradient, written over the logits it was computed from (this program has read
        # everything it needs from this row already). Ignored rows get exact zeros.
        coef = tl.where(valid, grad_scale, 0.0)
        if DIVIDE_BY_COUNT:  # a mean's 1 / (rows kept), counted on the GPU
            coef /= tl.maximum(tl.load(count_ptr), 1).to(tl.float32)
        if ROW_SCALE:
            coef *= tl.load(row_scale_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        p_scale = 1.0
        if Z_LOSS:
            p_scale = 1 + 2 * z_loss_scale * lse[:, None]
        # Last block first: pass 1 read it most recently, so it is the likeliest to still be in L2.
        n_blocks = tl.cdiv(n_cols, BLOCK_N)
        for back in range(0, n_blocks):
            start = (n_blocks - 1 - back) * BLOCK_N
            in_row = ((start + cols) < n_cols)[None, :]
            ptrs = row_ptr[:, None] + (start + cols)[None, :]
            # evict_first on this last read and on the store: neither is read again, so they should not
            # push blocks that pass 1 of other rows will need out of L2.
            z = tl.load(ptrs, mask=valid[:, None] & in_row, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if SOFTCAP:
                z = softcap * (2 * tl.sigmoid(2 * z / softcap) - 1)
            grad = tl.exp(z - lse[:, None]) * p_scale
            if SMOOTHING:
                grad -= label_smoothing / n_cols
            grad = tl.where((start + cols)[None, :] == target[:, None], grad - (1 - label_smoothing), grad)
            if SOFTCAP:
                tanh = z / softcap
                grad *= 1 - tanh * tanh
            grad *= coef[:, None]
            tl.store(
                ptrs, grad.to(z_ptr.dtype.element_ty), mask=row_mask[:, None] & in_row, eviction_policy="evict_first"
            )


@triton.jit
def _scale_rows_kernel(
    x_ptr, x_row_stride, out_ptr, out_row_stride, scale_ptr, scale_stride, n_rows, n_cols,
    IN_PLACE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[r, :] = x[r, :] * scale[r * scale_stride] (scale_stride 0: one scalar for every row)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    scale = tl.load(scale_ptr + rows * scale_stride, mask=row_mask, other=1.0).to(tl.float32)
    # Scaling in place by exactly 1 (a plain loss.backward()) changes nothing: skip the whole pass,
    # decided on the GPU so the host never waits to read the upstream gradient.
    work = tl.sum((scale != 1.0).to(tl.int32), axis=0)
    if not IN_PLACE:
        work += 1
    if work > 0:
        rows64 = rows.to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK_N)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_mask[:, None] & ((start + cols) < n_cols)[None, :]
            x = tl.load(x_ptr + rows64 * x_row_stride + (start + cols)[None, :], mask=mask, other=0.0)
            y = x.to(tl.float32) * scale[:, None]
            out_ptrs = out_ptr + rows64 * out_row_stride + (start + cols)[None, :]
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _count_targets_kernel(target_ptr, n, ignore_index, n_classes, counts_ptr, BLOCK: tl.constexpr):
    """counts = [targets not ignored, how many of those are out of [0, n_classes), smallest, largest]."""
    offsets = tl.arange(0, BLOCK)
    kept_count = tl.zeros([BLOCK], tl.int64)
    bad_count = tl.zeros([BLOCK], tl.int64)
    smallest = tl.full([BLOCK], 2**62, tl.int64)
    largest = tl.full([BLOCK], -(2**62), tl.int64)
    for start in range(0, n, BLOCK):
        in_range = start + offsets < n
        t = tl.load(target_ptr + start + offsets, mask=in_range, other=ignore_index).to(tl.int64)
        kept = in_range & (t != ignore_index)
        kept_count += kept.to(tl.int64)
        bad_count += (kept & ((t < 0) | (t >= n_classes))).to(tl.int64)
        smallest = tl.minimum(smallest, tl.where(kept, t, 2**62))
        largest = tl.maximum(largest, tl.where(kept, t, -(2**62)))
    tl.store(counts_ptr + 0, tl.sum(kept_count, axis=0))
    tl.store(counts_ptr + 1, tl.sum(bad_count, axis=0))
    tl.store(counts_ptr + 2, tl.min(smallest, axis=0))
    tl.store(counts_ptr + 3, tl.max(largest, axis=0))


@dataclass(frozen=True)
class LossOptions:
    """The options every cross-entropy kernel call shares (validated by :func:`check_loss_options`)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    reduction: str = "mean"
    softcap: float | None = None
    z_loss_scale: float = 0.0


def check_loss_options(options: LossOptions) -> None:
    if isinstance(options.ignore_index, bool) or not isinstance(options.ignore_index, int):
        raise ValueError(f"ignore_index is {options.ignore_index!r}: expected an int")
    if not 0.0 <= options.label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing is {options.label_smoothing}: expected a number in [0, 1]")
    if options.reduction not in REDUCTIONS:
        raise ValueError(f"reduction is {options.reduction!r}: expected one of {REDUCTIONS}")
    if options.softcap is not None and not (options.softcap > 0 and math.isfinite(options.softcap)):
        raise ValueError(f"softcap is {options.softcap}: expected None or a positive finite number")
    if not (options.z_loss_scale >= 0 and math.isfinite(options.z_loss_scale)):
        raise ValueError(f"z_loss_scale is {options.z_loss_scale}: expected a non-negative finite number")


def check_target_tensor(target: torch.Tensor, expected_shape: torch.Size) -> None:
    """Type, device and shape of a tensor of class indices (nothing read from the GPU)."""
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise ValueError(f"target has dtype {target.dtype}: expected an integer tensor of class indices (torch.int64)")
    runtime.check_device(target=target)
    if target.shape != expected_shape:
        raise ValueError(f"target has shape {tuple(target.shape)}: expected {tuple(expected_shape)}")


def count_targets(flat_target: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor:
    """One small kernel: int64 [kept, out of range, smallest kept, largest kept] on the target's device."""
    counts = torch.empty(4, dtype=torch.int64, device=flat_target.device)
    block = runtime.pick(cpu=2**16, gpu=4096)
    _count_targets_kernel[(1,)](flat_target, flat_target.numel(), ignore_index, n_classes, counts, BLOCK=block)
    return counts


def kept_count(counts: list[int], n_classes: int, ignore_index: int) -> int:
    """The number of kept targets from :func:`count_targets`' values; ValueError if any is out of range."""
    n_kept, n_bad, smallest, largest = counts
    if n_bad:
        example = largest if largest >= n_classes else smallest
        raise ValueError(
            f"target holds {n_bad} class index(es) out of range (e.g. {example}): expected values in "
            f"[0, {n_classes}) or ignore_index={ignore_index}"
        )
    return n_kept


def check_target(target: torch.Tensor, expected_shape: torch.Size, n_classes: int, ignore_index: int) -> int:
    """Validate class indices, waiting for the GPU's count; return how many are not ignored."""
    check_target_tensor(target, expected_shape)
    counts = count_targets(target.reshape(-1).contiguous(), n_classes, ignore_index)
    return kept_count(counts.tolist(), n_classes, ignore_index)


def cross_entropy_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss: torch.Tensor,
    options: LossOptions,
    *,
    write_grad: bool,
    grad_scale: float = 1.0,
    row_scale: torch.Tensor | None = None,
    divide_by: torch.Tensor | None = None,
) -> None:
    """Launch the kernel on a (rows, V) view with unit column stride: per-row fp32 losses into ``loss``;
    with ``write_grad``, the gradient times ``grad_scale`` (times ``row_scale[r]`` when given, divided by
    ``max(divide_by[0], 1)`` when given: a count on the GPU) over ``logits``."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    launch = runtime.streaming_row_launch(n_rows, n_cols)
    _cross_entropy_kernel[(launch.grid,)](
        logits, logits.stride(0), target, loss, row_scale if row_scale is not None else loss,
        divide_by if divide_by is not None else loss, n_rows, n_cols, options.ignore_index,
        options.label_smoothing, options.softcap or 1.0, options.z_loss_scale, grad_scale,
        SOFTCAP=options.softcap is not None, SMOOTHING=options.label_smoothing > 0, Z_LOSS=options.z_loss_scale > 0,
        WRITE_GRAD=write_grad, ROW_SCALE=row_scale is not None, DIVIDE_BY_COUNT=divide_by is not None,
        ROWS=launch.rows, BLOCK_N=launch.block_n, num_warps=launch.num_warps,
    )  # fmt: skip


def scale_rows(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x * scale`` for a 2-D ``x`` (unit column stride) and a scalar or per-row ``scale``, into ``out``
    (default: in place, skipped on the GPU when the scale is exactly 1). ``out`` may have another dtype."""
    n_rows, n_cols = x.shape
    out = x if out is None else out
    if x.numel() == 0:
        return out
    scale_stride = 0 if scale.numel() == 1 else 1
    scale = scale.reshape(-1).contiguous()
    launch = runtime.streaming_row_launch(n_rows, n_cols)
    _scale_rows_kernel[(launch.grid,)](
        x, x.stride(0), out, out.stride(0), scale, scale_stride, n_rows, n_cols,
        IN_PLACE=out is x, ROWS=launch.rows, BLOCK_N=launch.block_n, num_warps=launch.num_warps,
    )  # fmt: skip
    return out


def reduce_loss(loss: torch.Tensor, reduction: str, n_valid: int, dtype: torch.dtype, shape: torch.Size):
    """Per-row fp32 losses -> the returned loss, in ``dtype`` (the logits' dtype, like torch)."""
    if reduction == "none":
        return loss.to(dtype).view(shape)
    total = loss.sum()
    if reduction == "mean":
        total = total / max(n_valid, 1)
    return total.to(dtype)


def _writable_rows(logits: torch.Tensor) -> torch.Tensor:
    """A (rows, V) view the kernel may overwrite: the caller's own buffer whenever it can be
    (:func:`rows_to_overwrite`; the point of the in-place gradient), else one contiguous copy."""
    rows = rows_to_overwrite(logits)
    if rows is None:
        rows = logits.clone(memory_format=torch.contiguous_format).view(logits.shape[:-1].numel(), logits.shape[-1])
    return rows


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, options, write_grad):
        rows = _writable_rows(logits) if write_grad else as_rows(logits)
        n_classes = rows.shape[1]
        loss = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        flat_target = target.reshape(-1).contiguous()
        counts = count_targets(flat_target, n_classes, options.ignore_index)
        read_counts = runtime.read_later(counts)
        mean = options.reduction == "mean"
        # The 1/n of a mean goes into the stored gradient (so a plain backward has nothing left to do),
        # except in fp16: p / n ~ 1e-9 for 8192 tokens over a 128k vocabulary underflows (fp16 stops at
        # 6e-8), so fp16 stores softmax - onehot and the backward applies 1/n with the upstream gradient.
        mean_in_kernel = mean and logits.dtype != torch.float16
        cross_entropy_rows(
            rows, flat_target, loss, options, write_grad=write_grad, divide_by=counts if mean_in_kernel else None
        )
        if write_grad and rows.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr():
            # The logits now hold their gradient: a node that saved them for its own backward gets autograd's
            # "modified by an inplace operation" error instead of computing with a gradient.
            torch.autograd.graph.increment_version(logits)
        n_valid = kept_count(read_counts(), n_classes, options.ignore_index)
        ctx.grad_rows, ctx.logits_shape = (rows if write_grad else None), logits.shape
        ctx.backward_scale = 1.0 / max(n_valid, 1) if mean and not mean_in_kernel else 1.0
        return reduce_loss(loss, options.reduction, n_valid, logits.dtype, target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        rows, ctx.grad_rows = ctx.grad_rows, None
        if rows is None:
            raise RuntimeError(
                "liger_lab.cross_entropy: backward ran twice through one forward; its gradient is computed in "
                "the forward and handed over once (no retain_graph)"
            )
        scale_rows(rows, grad_loss if ctx.backward_scale == 1.0 else grad_loss.float() * ctx.backward_scale)
        return rows.view(ctx.logits_shape), None, None, None


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
    """Cross-entropy of ``logits`` (..., V) against class indices ``target`` (...), with the options of
    ``torch.nn.functional.cross_entropy`` (class dimension last) plus a tanh ``softcap`` of the logits
    (Gemma 2) and a ``z_loss_scale * lse**2`` penalty (PaLM). Returns the logits' dtype.

    .. warning:: **The logits are overwritten.** When ``logits`` requires grad (and grad mode is on), the
       forward writes the gradient over the logits buffer, so no second logits-sized tensor is ever
       allocated. After the call the tensor you passed holds ``dloss/dlogits``, not logits: compute
       anything else you need from the logits (accuracy, a second loss) *before*, or pass
       ``logits.clone()``. The exceptions, which are copied first: an ``nn.Parameter``, and a layout the
       kernel cannot write row by row (non-unit column stride, overlapping rows). Logits that do not
       require grad are only read. If another autograd node saved these logits for its own backward,
       that backward raises PyTorch's "modified by an inplace operation" error instead of going wrong.
       Because the gradient is made once in the forward, the graph can be backpropagated once. Targets
       are range-checked while the kernel runs: when that raises a ValueError, the logits may already
       have been overwritten.
    """
    options = LossOptions(ignore_index, float(label_smoothing), reduction, softcap, float(z_loss_scale))
    check_loss_options(options)
    check_float("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: expected (..., V) with V >= 1 classes")
    check_target_tensor(target, logits.shape[:-1])
    write_grad = logits.requires_grad and torch.is_grad_enabled()
    return CrossEntropyFunction.apply(logits, target, options, write_grad)
