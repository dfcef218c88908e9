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
pass 1's blocks in L2 ahead of the gradient being written: on an H200 that brought the kernel below three HBM
passes' time (benchmarks/notes/cross_entropy.md). The backward only multiplies the buffer by the upstream
gradient, and skips even that when it is exactly 1 (a plain ``loss.backward()``).

Targets are counted on the device (kept rows, any class index out of range) by a small kernel. Where reading
its counts costs the host nothing (``runtime.HOST_READS_WAIT`` false: the interpreter) an index out of range is a
ValueError before the loss kernel writes anything. On the GPU the host never reads them: that would wait for the
GPU every step and keep the step out of CUDA graphs. There the loss kernel writes NaN losses and a NaN gradient
when a target is out of range, as the fused losses give.

**Operators** (:func:`liger_lab.ops.operators.define`): ``liger_lab::cross_entropy`` (per-row losses, the gradient
into a fresh buffer, the counts) and its twin ``cross_entropy_`` (the gradient over the logits) come from one
declaration; ``liger_lab::scale_rows_`` (:mod:`liger_lab.ops.forward_grad`) scales the gradient in place in the
backward. The reduction and the factor
the gradient still owes are plain torch code around them (:func:`finish_loss`). Launch settings:
:func:`liger_lab.runtime.streaming_row_launch`, measured in benchmarks/notes/cross_entropy.md.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from liger_lab import runtime
from liger_lab.formulas import LossOptions, check_loss_options
from liger_lab.ops import operators
from liger_lab.ops.common import (
    as_rows,
    check_float,
    in_place_requested,
    row_gradients,
    row_losses,
    rows_to_overwrite,
)
from liger_lab.ops.forward_grad import (
    _scale_rows_kernel,  # noqa: F401  (chapter 5 shows it as this module's)
    refuse_second_derivative,
    save_gradient,
    scaled_gradient,
)
from liger_lab.ops.logsumexp import online_lse_step


@triton.jit
def _cross_entropy_kernel(
    z_ptr, z_row_stride, grad_ptr, grad_row_stride, target_ptr, loss_ptr, row_scale_ptr, count_ptr,
    n_rows, n_cols, ignore_index, label_smoothing, softcap, z_loss_scale, grad_scale,
    SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr, Z_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
    ROW_SCALE: tl.constexpr, COUNTS: tl.constexpr, DIVIDE_BY_COUNT: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index).to(tl.int64)
    # An out-of-range target (a ValueError on the host where reading the counts is free, NaN on the GPU) is
    # skipped here, never read out of bounds.
    valid = row_mask & (target != ignore_index) & (target >= 0) & (target < n_cols)
    row_ptr = z_ptr + rows.to(tl.int64) * z_row_stride  # int64: 16k rows x 128k columns passes 2**31
    grad_row_ptr = grad_ptr + rows.to(tl.int64) * grad_row_stride
    cols = tl.arange(0, BLOCK_N)

    # Pass 1: running max m and sum s of exp(z - m) over blocks of the row (liger_lab.ops.logsumexp), in
    # fp32. Ignored rows load nothing (masked), so they cost no bandwidth.
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
        m, s, _, _ = online_lse_step(m, s, tl.where(mask, z, float("-inf")), 1.0)
    m = tl.where(valid, m, 0.0)
    log_s = tl.log(tl.where(valid, s, 1.0))
    lse = m + log_s

    z_target = tl.load(row_ptr + target, mask=valid, other=0.0).to(tl.float32)
    if SOFTCAP:
        z_target = softcap * (2 * tl.sigmoid(2 * z_target / softcap) - 1)
    # (m - z_target) + log s, not lse - z_target: with logits of 100 lse rounds to 1e-5, more than the loss of a
    # confident token; m - z_target is exact when the target is the row's max, and log s is at most log V.
    loss = (m - z_target) + log_s
    if SMOOTHING:
        loss = (1 - label_smoothing) * loss + label_smoothing * ((m - z_sum / n_cols) + log_s)
    if Z_LOSS:
        loss += z_loss_scale * lse * lse
    # A target out of range anywhere (counted by the small kernel that ran before this one, where the host did not
    # check them: the GPU): every loss and every gradient element is NaN, never a plausible number.
    no_bad_target = True
    if COUNTS:
        no_bad_target = tl.load(count_ptr + 1) == 0
    tl.store(loss_ptr + rows, tl.where(no_bad_target, tl.where(valid, loss, 0.0), float("nan")), mask=row_mask)

    if WRITE_GRAD:
        # Pass 2: the gradient, into grad (which may be the logits themselves: this program has read
        # everything it needs from this row already). Ignored rows get exact zeros.
        coef = tl.where(no_bad_target, tl.where(valid, grad_scale, 0.0), float("nan"))
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
            grad_ptrs = grad_row_ptr[:, None] + (start + cols)[None, :]
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
                grad_ptrs,
                grad.to(grad_ptr.dtype.element_ty),
                mask=row_mask[:, None] & in_row,
                eviction_policy="evict_first",
            )


@triton.jit
def _count_targets_kernel(
    target_ptr,  # (n,) class indices
    n,
    ignore_index,
    n_classes,
    counts_ptr,  # int64 (4,): [targets not ignored, how many of those are out of [0, n_classes), smallest, largest]
    factors_ptr,  # with FACTORS, fp32 (2,): [1 or NaN (a target out of range), max(kept, 1) or NaN: a mean's divisor]
    BLOCK: tl.constexpr,
    FACTORS: tl.constexpr,
):
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
    kept_total = tl.sum(kept_count, axis=0)
    bad_total = tl.sum(bad_count, axis=0)
    tl.store(counts_ptr + 0, kept_total)
    tl.store(counts_ptr + 1, bad_total)
    tl.store(counts_ptr + 2, tl.min(smallest, axis=0))
    tl.store(counts_ptr + 3, tl.max(largest, axis=0))
    if FACTORS:  # what a fused loss multiplies and divides by, made here rather than by a few more ops on the host
        valid = tl.where(bad_total > 0, float("nan"), 1.0)
        tl.store(factors_ptr + 0, valid)
        tl.store(factors_ptr + 1, valid * tl.maximum(kept_total, 1).to(tl.float32))


def check_target_tensor(target: torch.Tensor, expected_shape: torch.Size) -> None:
    """Type, device and shape of a tensor of class indices (nothing read from the GPU)."""
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise ValueError(f"target has dtype {target.dtype}: expected an integer tensor of class indices (torch.int64)")
    runtime.check_device(target=target)
    if target.shape != expected_shape:
        raise ValueError(f"target has shape {tuple(target.shape)}: expected {tuple(expected_shape)}")


_COUNT_BLOCK = runtime.pick(cpu=2**16, gpu=4096)
"""Targets the count kernel's one program reads per step: the interpreter pays per step, the GPU per register."""


def _count_targets_into(
    flat_target: torch.Tensor,
    n_classes: int,
    ignore_index: int,
    counts: torch.Tensor,
    factors: torch.Tensor | None = None,
) -> None:
    runtime.launch_kernel(_count_targets_kernel, (1,),
        flat_target, flat_target.numel(), ignore_index, n_classes, counts, counts if factors is None else factors,
        BLOCK=_COUNT_BLOCK, FACTORS=factors is not None,
    )  # fmt: skip


def count_targets(
    flat_target: torch.Tensor, n_classes: int, ignore_index: int, *, factors: torch.Tensor | None = None
) -> torch.Tensor:
    """One small kernel: int64 [kept, out of range, smallest kept, largest kept] on the target's device. With
    ``factors`` (fp32, two elements) it also writes there what a fused loss scales by: 1, or NaN when a target is out
    of range (:func:`nan_if_out_of_range`'s value), and a mean's divisor max(kept, 1), NaN likewise."""
    counts = flat_target.new_empty(4, dtype=torch.int64)
    _count_targets_into(flat_target, n_classes, ignore_index, counts, factors)
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


def check_target(
    target: torch.Tensor,
    expected_shape: torch.Size,
    n_classes: int,
    ignore_index: int,
    *,
    factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Validate class indices; return :func:`count_targets`' counts (and write its ``factors``), left on the device.

    Where a read costs the host nothing (``runtime.HOST_READS_WAIT`` false: the interpreter's tensors are host
    memory), an index out of range is a ValueError here, before any work. On the GPU the host never reads the
    counts: that would wait for the GPU every step and keep the step out of CUDA graphs. There the kernels skip
    such rows and the fused losses come out NaN, loss and gradients (:func:`nan_if_out_of_range`)."""
    check_target_tensor(target, expected_shape)
    counts = count_targets(target.reshape(-1).contiguous(), n_classes, ignore_index, factors=factors)
    if not runtime.HOST_READS_WAIT:
        kept_count(counts.tolist(), n_classes, ignore_index)
    return counts


def nan_if_out_of_range(counts: torch.Tensor) -> torch.Tensor:
    """An fp32 scalar on the device from :func:`count_targets`' counts: 1, or NaN when a target is out of range.
    A fused loss multiplies its loss and gradients by it: on the GPU, where the range is not checked on the host,
    a bad target then gives a NaN loss and NaN gradients (which a NaN guard or a GradScaler catches) rather than
    a plausible loss that silently left those tokens out."""
    return torch.where(counts[1] > 0, math.nan, 1.0).to(torch.float32)


def cross_entropy_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    loss: torch.Tensor,
    options: LossOptions,
    *,
    grad: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    row_scale: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    divide_by_count: bool = False,
    launch: runtime.RowLaunch | None = None,
) -> None:
    """Launch the kernel on a (rows, V) view with unit column stride: per-row fp32 losses into ``loss``;
    when ``grad`` (rows, V) is given (it may be ``logits`` itself), the gradient times ``grad_scale``
    (times ``row_scale[r]`` when given) into it. ``counts`` from :func:`count_targets`, when given: every loss
    and gradient element is NaN if any target is out of range (checked nowhere else on the GPU), and
    ``divide_by_count`` divides the gradient by the kept count (a mean's 1/n, read on the GPU). ``launch``: the
    tiling, :func:`liger_lab.runtime.streaming_row_launch`'s by default (a sweep passes its own)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    launch = launch or runtime.streaming_row_launch(n_rows, n_cols)
    runtime.launch_kernel(_cross_entropy_kernel, (launch.grid,),
        logits, logits.stride(0), grad if grad is not None else logits, grad.stride(0) if grad is not None else 0,
        target, loss, row_scale if row_scale is not None else loss, counts if counts is not None else loss,
        n_rows, n_cols, options.ignore_index,
        options.label_smoothing, options.softcap or 1.0, options.z_loss_scale, grad_scale,
        SOFTCAP=options.softcap is not None, SMOOTHING=options.label_smoothing > 0, Z_LOSS=options.z_loss_scale > 0,
        WRITE_GRAD=grad is not None, ROW_SCALE=row_scale is not None, COUNTS=counts is not None,
        DIVIDE_BY_COUNT=divide_by_count, ROWS=launch.rows, BLOCK_N=launch.block_n, num_warps=launch.num_warps,
    )  # fmt: skip


def reduce_loss(loss: torch.Tensor, reduction: str, n_valid: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Per-row fp32 losses -> the fp32 loss the operators return (the public functions cast it). ``n_valid``:
    the kept count as a tensor on the device (a mean divides by it there, the host never reads it)."""
    if reduction == "none":
        return loss.view(shape)
    total = loss.sum()
    return total / n_valid.clamp(min=1) if reduction == "mean" else total


def finish_loss(
    loss: torch.Tensor, counts: torch.Tensor, options: LossOptions, dtype: torch.dtype, shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp32 losses and :func:`count_targets`' counts -> (the fp32 loss, reduced as asked; the fp32 factor
    the gradient still owes besides the upstream gradient). A mean's 1/n is in the stored gradient (so a plain
    backward has nothing left to do) except in fp16: p / n ~ 1e-9 for 8192 tokens over a 128k vocabulary
    underflows (fp16 stops at 6e-8), so fp16 stores softmax - onehot and owes 1/n. (A target out of range on the
    GPU: the kernel already made the losses and the gradient NaN.)"""
    total = reduce_loss(loss, options.reduction, counts[0], shape)
    if options.reduction == "mean" and dtype == torch.float16:
        return total, 1.0 / counts[0].clamp(min=1).to(torch.float32)
    # Made on the device, not copied from a host float: a copy from pageable host memory waits for the kernels.
    return total, loss.new_ones(())


# --------------------------------------------------------------------------------------------------
# PyTorch operators (liger_lab.ops.operators). The default writes the gradient into a fresh buffer; its twin,
# which writes it over the caller's logits, comes from the same declaration. Neither has a registered autograd
# formula: CrossEntropyFunction below is their autograd.


def _cross_entropy_into(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    softcap: float | None,
    z_loss_scale: float,
    compute_grad: bool,
    loss: torch.Tensor,
    grad: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Per-row fp32 losses, the gradient (rows, V) when ``compute_grad`` (the twin: over the logits, which then have
    unit column stride and rows apart) and the target counts. A target out of range is a ValueError before the loss
    kernel where reading the counts is free (:func:`check_target`); on the GPU the kernel makes everything NaN."""
    options = LossOptions(ignore_index, label_smoothing, reduction, softcap, z_loss_scale)
    rows = as_rows(logits)
    n_classes = rows.shape[1]
    flat_target = target.reshape(-1).contiguous()
    _count_targets_into(flat_target, n_classes, ignore_index, counts)
    if not runtime.HOST_READS_WAIT:
        kept_count(counts.tolist(), n_classes, ignore_index)
    cross_entropy_rows(
        rows, flat_target, loss, options, grad=grad.view(rows.shape) if compute_grad else None, counts=counts,
        divide_by_count=reduction == "mean" and logits.dtype != torch.float16,
    )  # fmt: skip


CROSS_ENTROPY = operators.define(
    "cross_entropy",
    _cross_entropy_into,
    outputs={
        "loss": row_losses,
        "grad": row_gradients,
        "counts": lambda logits: logits.new_empty(4, dtype=torch.int64),
    },
    in_place={"grad": "logits"},
)


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd of both operators. The gradient is made in the forward; the backward scales it in place by
    the upstream gradient. That is why this is an ``autograd.Function`` (which torch.compile traces like
    any other code) rather than a formula registered on the operator: PyTorch's registered formulas may
    not modify an operator's outputs, and a fresh scaled copy would cost a second logits-sized buffer."""

    @staticmethod
    def forward(ctx, logits, target, options, in_place):
        if in_place:
            loss, counts = CROSS_ENTROPY.call_in_place(logits, target, *options.fields(), True)
            # The logits now hold their gradient (the op bumped their version: a node that saved them for
            # its own backward gets autograd's "modified by an inplace operation" error instead).
            grad = logits.detach()
        else:
            loss, grad, counts = CROSS_ENTROPY(logits, target, *options.fields(), True)
        total, owed = finish_loss(loss, counts, options, logits.dtype, target.shape)
        save_gradient(ctx, grad, owed, logits.shape)
        return total

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_second_derivative("cross_entropy")
        return scaled_gradient(ctx, grad_loss), None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    z_loss_scale: float = 0.0,
    in_place_backward: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V) against class indices ``target`` (...), with the options of
    ``torch.nn.functional.cross_entropy`` (class dimension last) plus a tanh ``softcap`` of the logits
    (Gemma 2) and a ``z_loss_scale * lse**2`` penalty (PaLM). Returns the logits' dtype.

    The gradient is computed in the forward, in the same two passes over each row as the loss, into a
    buffer of the logits' size (what PyTorch's backward allocates too); the backward only scales it.
    The caller's tensors are never modified, and the graph can be backpropagated once.

    ``in_place_backward=True`` writes the gradient **over the logits** instead, so no second
    logits-sized buffer exists (2 GiB for 8192 x 128k bf16). After the call the tensor you passed holds
    ``dloss/dlogits``, not logits: compute anything else you need from them (accuracy, a z-loss, a second
    loss) *before*. An ``nn.Parameter`` and a layout the kernel cannot write row by row (non-unit column
    stride, overlapping rows) take the default path instead. A node that saved these logits for its own
    backward then raises PyTorch's "modified by an inplace operation" error instead of going wrong.
    Under ``torch.compile`` the option changes nothing: the compiler plans the buffers itself. A target
    out of range raises ValueError in either mode with every caller tensor left untouched where the check costs
    nothing (Triton's interpreter); on the GPU, where it would make the host wait for the device, the loss and the
    gradient come out NaN instead.
    """
    options = LossOptions(ignore_index, float(label_smoothing), reduction, softcap, float(z_loss_scale))
    check_loss_options(options)
    check_float("logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: expected (..., V) with V >= 1 classes")
    check_target_tensor(target, logits.shape[:-1])
    options = replace(options, softcap=None if softcap is None else float(softcap))
    if logits.requires_grad and torch.is_grad_enabled():
        in_place = in_place_requested(in_place_backward) and rows_to_overwrite(logits) is not None
        loss = CrossEntropyFunction.apply(logits, target, options, in_place)
    else:
        loss, _, counts = CROSS_ENTROPY(logits, target, *options.fields(), False)
        loss = finish_loss(loss, counts, options, logits.dtype, target.shape)[0]
    return loss.to(logits.dtype)
