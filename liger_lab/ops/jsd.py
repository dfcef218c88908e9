r"""Generalized Jensen-Shannon divergence between a student's and a teacher's logits (on-policy distillation).

The divergence of TRL's GKD trainer (``generalized_jsd_loss``). For one row, with temperature :math:`T`,
``s = student / T`` and ``t = teacher / T``::

    Q = softmax(s)   (student)        P = softmax(t)   (teacher)
    beta == 0:   d = KL(P || Q)                                     forward KL
    beta == 1:   d = KL(Q || P)                                     reverse KL
    otherwise:   d = beta * KL(P || M) + (1 - beta) * KL(Q || M),  M = beta * P + (1 - beta) * Q
    loss = mean of d over the kept rows (target != ignore_index; every row when there is no target),
           or their sum / num_items_in_batch when that is given (TRL's normalizer over a whole accumulated batch)

No ``T**2`` factor: like TRL's ``generalized_jsd_loss`` (and unlike Hinton-style distillation), the loss is
the divergence of the tempered distributions as it stands. Multiply by ``T**2`` yourself if you want the
gradient's scale to stay put as T changes. Every row ignored: the loss is 0 and the gradient is 0 (TRL
would divide 0 by 0).

Gradient. The teacher is a constant. With g_i = dd/dQ_i, the softmax chain rule gives
dd/ds_j = Q_j (g_j - sum_i Q_i g_i) (a constant added to every g_i drops out), and dd/dz_j = (1/T) dd/ds_j
for the student logits z::

    beta == 0:   g_i = -P_i / Q_i                   ->  dd/ds_j = Q_j - P_j
    beta == 1:   g_i = log Q_i - log P_i + 1        ->  dd/ds_j = Q_j (log Q_j - log P_j - d)
    otherwise:   g_i = (1 - beta) (log Q_i - log M_i)
                                                    ->  dd/ds_j = (1 - beta) Q_j (log Q_j - log M_j - KL(Q || M))

(the mixture: d = beta sum P log P + (1 - beta) sum Q log Q - sum M log M, and dM_i/dQ_i = 1 - beta). The
mean multiplies each kept row's gradient by 1 / (kept rows), or 1 / num_items_in_batch.

Kernel: one program per tile of rows, looping over the vocabulary in blocks, all math in fp32.
Pass 1 keeps an online log-sum-exp (running max, rescaled sum) of z / T and of the teacher's y / T; for
beta in {0, 1} it also keeps the P- (or Q-) weighted running sum of y - z (or z - y), rescaled with the
same max, so KL = E[t - s] - lse_t + lse_s is known at the end of pass 1. The mixture needs log M_i, which
depends on both final log-sum-exps, so for 0 < beta < 1 pass 2 reads the row again for KL(P || M) and
KL(Q || M). The last pass writes dd/dz of every element into a new buffer of the student's shape (the
caller's tensors are never written), walking the row backwards so the blocks read last are read first,
while in L2. Bytes: the loss alone reads student and teacher once (beta in {0, 1}) or twice; loss and
gradient read them two (three) times and write the gradient once. The backward only multiplies that
buffer by the upstream gradient, and skips even that when it is exactly 1 (a plain ``loss.backward()``).
In fp16 the buffer holds dd/dz without the mean's 1 / n (which would push it below fp16's range) and the
backward applies it, as in liger_lab.cross_entropy.

Cost. With loads of 2 bytes, 128k columns and 8192 rows, the three passes move about 15 GB. Exponentials and
logarithms run on the GPU's special-function units, a few per element per pass at most, or they and not memory
set the time: the mixture's per-element algebra (:func:`_mixture`) takes three exponentials, one logarithm and
one quotient per pass. The measurements are in benchmarks/notes/distillation_and_preference.md.

Numerics. Logits enter as (z - max z) / T, never as z / T - lse, so logits of 1e4 keep their digits. The
reverse KL's gradient is Q_j ((z_j - y_j) - E_Q[z - y]) / T: the log-sum-exps cancel exactly, and a
saturated softmax gets the zero gradient it has instead of rounding noise. The mixture's logs log(M / Q)
and log(M / P) are constants plus two softplus terms of v = log(beta P / ((1 - beta) Q)) (:func:`_mixture`),
never a difference of two large logarithms. The loss adds those constants back, so a divergence far below
fp32's resolution of them (about 1e-7) is not resolved, as in any fp32 evaluation.

**Operator** (:func:`liger_lab.ops.operators.define`): ``liger_lab::jsd`` writes the per-row divergences and the
student's gradient; the mean and the factor the gradient still owes are plain torch code around it, and
:class:`JSDFunction` is its autograd.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from liger_lab import runtime
from liger_lab.formulas import JSDOptions
from liger_lab.ops import operators
from liger_lab.ops.common import as_rows, check_float, row_count, row_gradients, row_losses
from liger_lab.ops.forward_grad import refuse_second_derivative, save_gradient, scaled_gradient
from liger_lab.ops.logsumexp import online_lse_step

FORWARD_KL, REVERSE_KL, MIXTURE = 0, 1, 2

GPU_TILE = 2048
"""Elements of a row per program step on the GPU (4 warps): the fastest of 1024-8192 columns under 4-16 warps
for every divergence, 8192 x 128256 bf16 on an H200, ahead of the cross-entropy's 8192 columns under 16 warps
(benchmarks/notes/distillation_and_preference.md, rows in benchmarks/results/h200-sweep-jsd.json)."""


@triton.jit
def _log_softmax(x, m, log_total, inv_temperature):
    """log softmax(x / T) of a block from its row's max m and log-sum: x - m is taken before scaling by 1/T, so
    logits of 1e4 keep the digits that x / T - lse would round away."""
    return (x - m[:, None]) * inv_temperature - log_total[:, None]


@triton.jit
def _log1p(u):
    """log(1 + u) for 0 <= u <= 1 to full precision without libdevice: log(w) u / (w - 1) with w = 1 + u rounded
    (the rounding of w cancels between the log and the quotient)."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * tl.fdiv(u, tl.where(w == 1.0, 1.0, w - 1.0)))


@triton.jit
def _mixture(z, y, m_z, m_y, log_sum_z, log_sum_y, inv_temperature, log_odds):
    """For a block of the mixture M = beta P + (1 - beta) Q: (Q, P, S_q, S_p) with S_q = softplus(v) and
    S_p = softplus(-v), v = log(beta P / ((1 - beta) Q)), so that log(M / Q) = log(1 - beta) + S_q and
    log(M / P) = log(beta) + S_p. Three exponentials, one logarithm and one quotient per element.

    S_q and S_p share log(1 + exp(-|v|)), computed exactly (:func:`_log1p`), and differ by max(+-v, 0): neither
    is a difference of large numbers, so saturated softmaxes (|v| of 1e4) stay exact, and the gradient's
    E_Q[S_q] - S_q keeps its digits where Q dominates (S_q near 0, where log(M / Q) is near log(1 - beta))."""
    log_q = _log_softmax(z, m_z, log_sum_z, inv_temperature)
    log_p = _log_softmax(y, m_y, log_sum_y, inv_temperature)
    v = log_p - log_q + log_odds
    shared = _log1p(tl.exp(-tl.abs(v)))
    return tl.exp(log_q), tl.exp(log_p), tl.maximum(v, 0.0) + shared, tl.maximum(-v, 0.0) + shared


@triton.jit
def _load_logits(z_row, y_row, offsets, mask, EVICTION: tl.constexpr):
    """One block of the student's and the teacher's logits (rows' base pointers plus column ``offsets``) in fp32,
    0 where masked. ``EVICTION``: the L2 policy, "evict_last" for a pass that a later one reads again."""
    z = tl.load(z_row[:, None] + offsets, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    y = tl.load(y_row[:, None] + offsets, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    return z, y


@triton.jit
def _jsd_kernel(
    z_ptr, z_row_stride, y_ptr, y_row_stride, target_ptr, loss_ptr, grad_ptr, grad_row_stride, grad_scale_ptr,
    entropy_ptr, n_rows, n_cols, ignore_index, beta, log_beta, log_1m_beta, inv_temperature,
    MODE: tl.constexpr, HAS_TARGET: tl.constexpr, WRITE_GRAD: tl.constexpr, WRITE_ENTROPY: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """z: student logits, y: teacher logits, both (n_rows, n_cols) with unit column stride. ``WRITE_ENTROPY``: also
    the student's entropy per row, H(Q) = lse_s - E_Q[s], from one more running sum in pass 1 (a metric: no
    gradient)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    keep = row_mask
    if HAS_TARGET:
        target = tl.load(target_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        keep = row_mask & (target != ignore_index)
    z_row = z_ptr + rows.to(tl.int64) * z_row_stride  # int64: 16k rows x 128k columns passes 2**31
    y_row = y_ptr + rows.to(tl.int64) * y_row_stride
    cols = tl.arange(0, BLOCK_N)

    # Pass 1: online log-sum-exp of z / T and of y / T. Ignored rows load nothing (masked). For beta in
    # {0, 1} also the running sum of exp((y - m_y) / T) (y - z), or of exp((z - m_z) / T) (z - y).
    m_z = tl.full([ROWS], float("-inf"), tl.float32)
    m_y = tl.full([ROWS], float("-inf"), tl.float32)
    sum_z = tl.zeros([ROWS], tl.float32)
    sum_y = tl.zeros([ROWS], tl.float32)
    weighted = tl.zeros([ROWS], tl.float32)
    moment_z = tl.zeros([ROWS], tl.float32)  # running sum of exp((z - m_z) / T) z, for the entropy
    for start in range(0, n_cols, BLOCK_N):
        mask = keep[:, None] & ((start + cols) < n_cols)[None, :]
        offsets = (start + cols)[None, :]
        # evict_last: the next pass reads this block again, so it should outlive other rows' traffic in L2.
        z, y = _load_logits(z_row, y_row, offsets, mask, "evict_last")
        m_z, sum_z, rescale_z, e_z = online_lse_step(m_z, sum_z, tl.where(mask, z, float("-inf")), inv_temperature)
        m_y, sum_y, rescale_y, e_y = online_lse_step(m_y, sum_y, tl.where(mask, y, float("-inf")), inv_temperature)
        if MODE == 0:
            weighted = weighted * rescale_y + tl.sum(e_y * (y - z), axis=1)
        if MODE == 1:
            weighted = weighted * rescale_z + tl.sum(e_z * (z - y), axis=1)
        if WRITE_ENTROPY:
            moment_z = moment_z * rescale_z + tl.sum(e_z * z, axis=1)
    # Ignored rows: max 0 and sum 1, so the later passes compute finite values there (then multiplied by 0).
    m_z = tl.where(keep, m_z, 0.0)
    m_y = tl.where(keep, m_y, 0.0)
    sum_z = tl.where(keep, sum_z, 1.0)
    sum_y = tl.where(keep, sum_y, 1.0)
    log_sum_z = tl.log(sum_z)
    log_sum_y = tl.log(sum_y)
    if WRITE_ENTROPY:  # lse_s - E_Q[s] = log sum_z - (E_Q[z] - m_z) / T: 0 on an ignored row
        entropy = log_sum_z - (moment_z / sum_z - m_z) * inv_temperature
        tl.store(entropy_ptr + rows, tl.where(keep, entropy, 0.0), mask=row_mask)

    mean_zy = weighted / sum_z  # reverse KL: E_Q[z - y]
    mean_q_s = tl.zeros([ROWS], tl.float32)
    if MODE == 0:  # KL(P || Q) = E_P[t - s] - lse_t + lse_s, with lse_t = m_y / T + log sum_y
        d = (weighted / sum_y - (m_y - m_z)) * inv_temperature - log_sum_y + log_sum_z
    elif MODE == 1:  # KL(Q || P) = E_Q[s - t] - lse_s + lse_t
        d = (mean_zy - (m_z - m_y)) * inv_temperature - log_sum_z + log_sum_y
    else:
        # Pass 2 (mixture only), needing both final log-sum-exps: KL(Q || M) = -E_Q[log(M / Q)] and
        # KL(P || M) = -E_P[log(M / P)], with the logs as constants plus S_q and S_p (see _mixture).
        mean_p_s = tl.zeros([ROWS], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = keep[:, None] & ((start + cols) < n_cols)[None, :]
            offsets = (start + cols)[None, :]
            z, y = _load_logits(z_row, y_row, offsets, mask, "evict_last")
            q, p, s_q, s_p = _mixture(z, y, m_z, m_y, log_sum_z, log_sum_y, inv_temperature, log_beta - log_1m_beta)
            mean_q_s += tl.sum(tl.where(mask, q * s_q, 0.0), axis=1)
            mean_p_s += tl.sum(tl.where(mask, p * s_p, 0.0), axis=1)
        d = -beta * (log_beta + mean_p_s) - (1.0 - beta) * (log_1m_beta + mean_q_s)
    tl.store(loss_ptr + rows, tl.where(keep, d, 0.0), mask=row_mask)

    if WRITE_GRAD:
        # Last pass: dd/dz into the new buffer, times 1/T and the mean's factor; ignored rows get exact zeros.
        coef = tl.where(keep, inv_temperature * tl.load(grad_scale_ptr), 0.0)
        grad_row = grad_ptr + rows.to(tl.int64) * grad_row_stride
        n_blocks = tl.cdiv(n_cols, BLOCK_N)
        for back in range(0, n_blocks):
            start = (n_blocks - 1 - back) * BLOCK_N  # last block first: the likeliest to still be in L2
            in_row = ((start + cols) < n_cols)[None, :]
            mask = keep[:, None] & in_row
            offsets = (start + cols)[None, :]
            # evict_first on this last read and on the store: neither is needed again.
            z, y = _load_logits(z_row, y_row, offsets, mask, "evict_first")
            if MODE == 0:
                grad = tl.exp(_log_softmax(z, m_z, log_sum_z, inv_temperature))
                grad -= tl.exp(_log_softmax(y, m_y, log_sum_y, inv_temperature))
            elif MODE == 1:
                # log Q_j - log P_j - d = ((z_j - y_j) - E_Q[z - y]) / T: the log-sum-exps cancel exactly, so a
                # saturated softmax (Q one-hot) gets the zero gradient it has, not rounding noise.
                q = tl.exp(_log_softmax(z, m_z, log_sum_z, inv_temperature))
                grad = q * ((z - y) - mean_zy[:, None]) * inv_temperature
            else:
                # log Q_j - log M_j - KL(Q || M) = E_Q[S_q] - S_q,j: log(1 - beta) cancels exactly.
                q, _, s_q, _ = _mixture(z, y, m_z, m_y, log_sum_z, log_sum_y, inv_temperature, log_beta - log_1m_beta)
                grad = (1.0 - beta) * q * (mean_q_s[:, None] - s_q)
            grad *= coef[:, None]
            tl.store(
                grad_row[:, None] + offsets,
                grad.to(grad_ptr.dtype.element_ty),
                mask=row_mask[:, None] & in_row,
                eviction_policy="evict_first",
            )


def mode_of(beta: float) -> int:
    """Which divergence the kernel computes: forward KL, reverse KL or the mixture (exactly as TRL branches)."""
    return FORWARD_KL if beta == 0 else REVERSE_KL if beta == 1 else MIXTURE


def jsd_rows(
    student: torch.Tensor,
    teacher: torch.Tensor,
    target: torch.Tensor | None,
    loss: torch.Tensor,
    options: JSDOptions,
    *,
    grad: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    launch: runtime.RowLaunch | None = None,
) -> None:
    """Launch the kernel on (rows, V) views with unit column stride: each row's divergence under ``options`` (checked
    by the caller; fp32, 0 for an ignored row) into ``loss`` (rows,); when ``grad`` (rows, V) is given, dd/dz times
    ``grad_scale`` (an fp32 scalar tensor on the device) into it; when ``entropy`` (rows,) fp32 is given, the entropy
    of the student's softmax(z / T) per row into it (0 for an ignored row). ``target``: flat (rows,) integers, or None
    to keep every row.
    ``launch``: the tiling, :func:`liger_lab.runtime.streaming_row_launch` by default (a sweep passes its own)."""
    n_rows, n_cols = student.shape
    if n_rows == 0:
        return
    beta, temperature, ignore_index = options.beta, options.temperature, options.ignore_index
    mode = mode_of(beta)
    log_beta, log_1m_beta = (math.log(beta), math.log1p(-beta)) if mode == MIXTURE else (0.0, 0.0)
    launch = launch or runtime.streaming_row_launch(n_rows, n_cols, gpu_tile=GPU_TILE)
    runtime.launch_kernel(_jsd_kernel, (launch.grid,),
        student, student.stride(0), teacher, teacher.stride(0), target if target is not None else loss, loss,
        grad if grad is not None else loss, grad.stride(0) if grad is not None else 0,
        grad_scale if grad_scale is not None else loss, entropy if entropy is not None else loss,
        n_rows, n_cols, ignore_index, beta, log_beta, log_1m_beta, 1.0 / temperature,
        MODE=mode, HAS_TARGET=target is not None, WRITE_GRAD=grad is not None, WRITE_ENTROPY=entropy is not None,
        ROWS=launch.rows, BLOCK_N=launch.block_n, num_warps=launch.num_warps,
    )  # fmt: skip


def kept_rows(
    flat_target: torch.Tensor | None, n_rows: int, ignore_index: int, num_items: torch.Tensor | None, device
) -> torch.Tensor:
    """The loss's divisor, an fp32 scalar on the device: ``num_items`` when given (used as it is: TRL divides by
    num_items_in_batch unclamped, and a per-process share of it may be below 1), else the kept rows, at least 1."""
    if num_items is not None:
        return num_items.to(torch.float32).reshape(())
    if flat_target is None:
        return torch.full((), torch.sym_max(n_rows, 1), dtype=torch.float32, device=device)
    return (flat_target != ignore_index).sum().clamp(min=1).to(torch.float32)


def _jsd_into(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None,
    grad_scale: torch.Tensor,
    beta: float,
    temperature: float,
    ignore_index: int,
    compute_grad: bool,
    loss: torch.Tensor,
    grad: torch.Tensor,
) -> None:
    """Each row's divergence (fp32, 0 for an ignored row) and, when ``compute_grad``, the student's gradient (rows, V)
    times ``grad_scale`` (an fp32 scalar on the device: the kept count is never read by the host)."""
    rows = as_rows(student_logits)
    flat_target = None if target is None else target.reshape(-1).contiguous()
    jsd_rows(rows, as_rows(teacher_logits), flat_target, loss, JSDOptions(beta, temperature, ignore_index),
             grad=grad.view(rows.shape) if compute_grad else None, grad_scale=grad_scale)  # fmt: skip


JSD = operators.define(
    "jsd",
    _jsd_into,
    outputs={
        "loss": operators.reads(row_losses, "student_logits"),
        "grad": operators.reads(row_gradients, "student_logits", "compute_grad"),
    },
)


def _jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None,
    num_items: torch.Tensor | None,
    beta: float,
    temperature: float,
    ignore_index: int,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 loss: the mean over kept rows, or their sum over ``num_items``; gradient of the student's rows or an
    empty tensor; fp32 factor the backward still owes the gradient). Everything stays on the device."""
    n_rows = row_count(student_logits)
    flat_target = None if target is None else target.reshape(-1)
    inv_kept = 1.0 / kept_rows(flat_target, n_rows, ignore_index, num_items, student_logits.device)
    # The mean's 1/n goes into the stored gradient (a plain backward then has nothing left to do), except in
    # fp16: (Q - P) / n for many tokens underflows fp16 (it stops at 6e-8), so fp16 stores dd/dz and the
    # backward applies 1/n with the upstream gradient (as liger_lab.cross_entropy does).
    ones = inv_kept.new_ones(())
    fp16 = student_logits.dtype == torch.float16
    loss, grad = JSD(student_logits, teacher_logits, target, ones if fp16 else inv_kept, beta, temperature,
                     ignore_index, compute_grad)  # fmt: skip
    return loss.sum() * inv_kept, grad, inv_kept if fp16 else ones


class JSDFunction(torch.autograd.Function):
    """Autograd of ``liger_lab::jsd``: the gradient is made in the forward, the backward scales it in place
    by the upstream gradient (an ``autograd.Function`` for the reason given in CrossEntropyFunction: a
    registered formula may not modify the operator's outputs, and a scaled copy would cost a second
    logits-sized buffer). Only the student gets a gradient."""

    @staticmethod
    def forward(ctx, student_logits, teacher_logits, target, num_items, beta, temperature, ignore_index):
        loss, grad, owed = _jsd(student_logits, teacher_logits, target, num_items, beta, temperature, ignore_index,
                                True)  # fmt: skip
        save_gradient(ctx, grad, owed, student_logits.shape)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        refuse_second_derivative("jsd")
        return scaled_gradient(ctx, grad_loss), *(None,) * 6


def check_num_items(num_items_in_batch: object, device: torch.device) -> torch.Tensor | None:
    """TRL's ``num_items_in_batch`` as an fp32 scalar on ``device``, or None: a positive finite number (filled on the
    device, no copy that would wait for it) or a one-element real tensor there (its value is not read: on the GPU
    that would make the host wait)."""
    if num_items_in_batch is None:
        return None
    if isinstance(num_items_in_batch, torch.Tensor):
        dtype = num_items_in_batch.dtype
        if num_items_in_batch.numel() != 1 or dtype.is_complex or dtype == torch.bool:
            raise ValueError(
                f"num_items_in_batch has shape {tuple(num_items_in_batch.shape)} and dtype {dtype}: expected one real "
                f"number (the kept rows of the whole batch)"
            )
        runtime.check_device(num_items_in_batch=num_items_in_batch)
        return num_items_in_batch.detach().to(torch.float32).reshape(())
    value = num_items_in_batch
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"num_items_in_batch is {value!r}: expected None, a positive finite number or a tensor")
    return torch.full((), float(value), dtype=torch.float32, device=device)


def check_target(target: object, rows: torch.Tensor, name: str) -> None:
    """A mask of ``rows``' rows (its leading shape; ``name`` says which argument it is): integers on its device.
    The values are never read as classes here, only compared with ``ignore_index``."""
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a torch.Tensor or None, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise ValueError(f"target has dtype {target.dtype}: expected an integer tensor (torch.int64), as labels are")
    if target.shape != rows.shape[:-1]:
        raise ValueError(
            f"target has shape {tuple(target.shape)}: expected {tuple(rows.shape[:-1])}, one value per row "
            f"of {name} {tuple(rows.shape)}"
        )
    if target.device != rows.device:
        raise ValueError(f"target is on {target.device}: expected {rows.device}, {name}'s")


def jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Generalized JSD of on-policy distillation, as TRL's GKD trainer defines it (``generalized_jsd_loss``).

    ``student_logits`` and ``teacher_logits``: (..., V) of one shape, typically (N, V) or (B, T, V), in fp32,
    fp16 or bf16 (the two may differ). With P = softmax(teacher / T) and Q = softmax(student / T), each row's
    divergence is KL(P || Q) for ``beta == 0`` (forward KL), KL(Q || P) for ``beta == 1`` (reverse KL), and
    beta * KL(P || M) + (1 - beta) * KL(Q || M) with M = beta * P + (1 - beta) * Q otherwise.

    Returns a float32 scalar: the mean over the rows whose ``target`` (shape (...), integers) is not
    ``ignore_index``, or over every row when ``target`` is None; the target's values are not class indices
    here, only a mask. Every row ignored gives 0 with a zero gradient (TRL's formula would give 0/0).
    There is no ``T**2`` factor, as in TRL's ``generalized_jsd_loss``: scale the loss yourself if wanted.
    ``num_items_in_batch`` (a positive number or a one-element tensor), when given, replaces the kept count: the loss
    is the sum over the kept rows divided by it, unclamped, as TRL's GKD and distillation losses divide (the kept
    rows of a whole accumulated batch, so that the micro-batches' losses add up to its mean).

    Gradients reach the student only; the teacher is treated as a constant (it gets no ``.grad`` even if it
    requires grad). The gradient is made in the forward into a new buffer of the student's size; the
    caller's tensors are never modified, and the graph can be backpropagated once.
    """
    o = JSDOptions(beta, temperature, ignore_index).checked()
    beta, temperature = o.beta, o.temperature
    check_float("student_logits", student_logits)
    check_float("teacher_logits", teacher_logits)
    if student_logits.dim() == 0 or student_logits.shape[-1] == 0:
        raise ValueError(
            f"student_logits has shape {tuple(student_logits.shape)}: expected (..., V) with a vocabulary V >= 1"
        )
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"teacher_logits has shape {tuple(teacher_logits.shape)}: expected the student's shape "
            f"{tuple(student_logits.shape)} (the same rows over the same vocabulary)"
        )
    if teacher_logits.device != student_logits.device:
        raise ValueError(
            f"teacher_logits is on {teacher_logits.device}: expected {student_logits.device}, the student's"
        )
    if target is not None:
        check_target(target, student_logits, "student_logits")
    num_items = check_num_items(num_items_in_batch, student_logits.device)
    teacher = teacher_logits.detach()
    if student_logits.requires_grad and torch.is_grad_enabled():
        return JSDFunction.apply(student_logits, teacher, target, num_items, beta, temperature, ignore_index)
    return _jsd(student_logits, teacher, target, num_items, beta, temperature, ignore_index, False)[0]
