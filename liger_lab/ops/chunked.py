r"""The skeleton of every fused linear loss: a loss of ``hidden @ weight.T`` without the N x V logits.

A language model's head turns N hidden states (N x H) into N x V logits, and a loss reads them once. The
loop below never holds more than one chunk of C rows of logits::

    z      = h_c @ W.T (+ b)          # C x V, the only logits-sized buffer (reused by every chunk)
    chunk_loss(z, rows)               # the loss's own step: per-row losses kept by the loss, dz over z
    dW    += dz.T @ h_c               # accumulated over chunks, in the accumulator's dtype
    db    += sum over rows of dz
    dh_c   = dz @ W                   # rows c of the hidden gradient, final

What differs between losses is only ``chunk_loss``: cross-entropy runs its row kernel on z, a distillation
loss also computes the teacher's logits for the same rows and runs a divergence kernel, a preference loss
turns token log-probabilities into sequence scores. Each writes its losses wherever it keeps them and, when
asked, overwrites z with d(loss)/dz. A global factor shared by every row rides on the matmuls' ``alpha``
(``grad_scale``) rather than on dz, where fp16 would underflow, when the host knows it (the 1 / B of a mean
over pairs). One that only the device knows (a mean's 1 / kept, kept counted on the device: reading it back
would make the host wait for the GPU every step) is owed by the gradients to the backward, which multiplies
them by the upstream gradient anyway (:func:`mean_over_kept`).

The gradients are computed in the forward (6 N H V FLOPs in all, as many as an unfused forward and
backward), so the backward only multiplies them by the incoming scalar gradient (:func:`finish_grads`).

**What a new loss provides.** Three things; the rest is here, written once: the validation every public function
shares (:func:`check_head`, :func:`check_second_head`, :func:`check_chunk_options`, :func:`check_values`; the
options' :func:`~liger_lab.formulas.check_number` and :func:`~liger_lab.formulas.check_choice`), the gradients
autograd will ask for (:func:`needed_grads`), the chunk rule (:func:`rows_per_chunk`), the dW accumulator's dtype
(:func:`accumulation_dtype`), the gradient outputs and their fake (:func:`grad_outputs`), the autograd
(:class:`GradsMadeInForward`) and the backward that finishes the gradients (:func:`finish_grads`, with
``liger_lab::scale_rows`` and ``scale_rows_``, declared beside their kernel in :mod:`liger_lab.ops.forward_grad`).

1. *A chunk step*, a :data:`ChunkLoss`: ``step(z, rows, write_grad)`` gets the logits ``z`` of ``hidden[rows]``,
   records the chunk's losses where the loss keeps them and, when ``write_grad``, writes d(loss)/dz over ``z``.
2. *An operator body*, the launcher that :func:`liger_lab.ops.operators.define` declares (destination passing: the
   operator's arguments, then one buffer per output). Its arguments are ``(hidden, weight, ...its tensors, ...its
   options, accumulation, needs)``; its outputs are its loss (then any metrics, such as sequence scores) followed
   by ``**grad_outputs()``, and ``in_place={"grad_hidden": "hidden"}`` adds the twin that writes dh over hidden.
   It runs :func:`chunked_linear_loss` with its step over ``rows_per_chunk`` rows and the buffers
   ``ChunkGrads.asked(needs, ...)``, and writes its loss and the factor the gradients still owe. Beside it a
   :class:`FusedLoss` names the operator for :func:`run_loss`, which the public function calls after its
   validation: ``run_loss(loss, tensors, (*options, accumulation, needs))``.
3. *A row* of :data:`liger_lab.op_table.OPS`: its inputs, shapes, FLOPs and operators (its own, then
   ``scale_rows`` and ``scale_rows_``), which the generic tests (opcheck, torch.compile, host reads, launch
   devices, second derivatives) and the benchmarks read.

A loss whose gradient needs the upstream gradient inside the sum over tokens (the RL head, the fused
cross-entropy's ``reduction="none"``) makes none in the forward: its backward operator runs the loop again, with
``grad_outputs(owed=False)``, and :func:`finish_grads` (without an upstream gradient) only shapes and casts them.
The RL head, whose forward keeps each row's normalizer, runs it over tiles of the vocabulary as well
(:func:`tiled_linear_grads`): fewer, larger dW products.

The measurements behind the chunk sizes and the dW accumulation are in benchmarks/notes/fused_linear_cross_entropy.md
and benchmarks/notes/distillation_and_preference.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from liger_lab import runtime
from liger_lab.ops.common import check_float, row_count, same_shape
from liger_lab.ops.forward_grad import SCALE_ROWS, refuse_second_derivative
from liger_lab.ops.operators import Allocator, Operator, reads

MIB = 2**20
CHUNK_ALIGN = 64
"""Chunks of tokens are multiples of this many rows: smaller matmuls waste the GPU."""
ACCUMULATION = "auto"
"""Default ``accumulation`` of every fused linear loss, for a whole program: "auto", "fp32" or "weight_dtype"
(:func:`accumulation_dtype`)."""
ACCUMULATIONS = ("auto", "fp32", "weight_dtype")
FP32_ACCUMULATOR_BUDGET_BYTES = 512 * MIB
"""Largest fp32 dW accumulator (4 V H bytes) that ``accumulation="auto"`` allocates."""

ChunkLoss = Callable[[torch.Tensor, slice, bool], None]
"""``chunk_loss(z, rows, write_grad)``: the loss's step for the logits ``z`` of ``hidden[rows]``. It records
the chunk's losses itself and, when ``write_grad``, writes d(loss)/dz over ``z`` (before ``grad_scale``)."""


@dataclass(frozen=True)
class ChunkGrads:
    """Where the loop writes the gradients it makes (None: not made). ``hidden`` (N, H) may be the loop's input
    itself: each chunk's rows are overwritten once that chunk has done reading them (an opt-in in-place backward,
    no N x H buffer). ``weight`` is the dW accumulator: fp32 for exact accumulation over chunks, or the weight's
    dtype (one rounding per chunk, no copy). ``bias`` is fp32."""

    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @classmethod
    def asked(cls, needs: Sequence[bool], hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> ChunkGrads:
        """The buffers of an operator's :func:`grad_outputs` that ``needs`` (hidden, weight, bias) asks for."""
        return cls(*(buffer if need else None for need, buffer in zip(needs, (hidden, weight, bias), strict=True)))

    def any(self) -> bool:
        return self.hidden is not None or self.weight is not None or self.bias is not None


@functools.cache
def _fused_fp32_addmm(device_type: str) -> bool:
    """Whether this torch can add a bf16 x bf16 product into an fp32 matrix in one cuBLAS call
    (``addmm(..., out_dtype=torch.float32)``: CUDA, recent torch)."""
    acc = torch.zeros(1, 1, device=device_type)
    half = torch.zeros(1, 1, dtype=torch.bfloat16, device=device_type)
    try:
        torch.addmm(acc, half, half, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, first: bool) -> None:
    """acc (+)= scale * a @ b in acc's dtype (a gradient summed over chunks or tiles). The first writes (beta = 0:
    no zero-fill of the buffer), later ones add (beta = 1, summed with the product in fp32 inside cuBLAS)."""
    beta = 0 if first else 1
    if acc.dtype == a.dtype:
        torch.addmm(acc, a, b, beta=beta, alpha=scale, out=acc)
    elif _fused_fp32_addmm(acc.device.type):
        torch.addmm(acc, a, b, beta=beta, alpha=scale, out_dtype=torch.float32, out=acc)
    else:
        # Fallback (CPU, older torch): an fp32 product; costs a chunk-sized fp32 copy of a.
        torch.addmm(acc, a.float(), b.float(), beta=beta, alpha=scale, out=acc)


def chunked_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    chunk_loss: ChunkLoss,
    *,
    chunk: int,
    grads: ChunkGrads | None = None,
    bias: torch.Tensor | None = None,
    grad_scale: float = 1.0,
) -> None:
    """Run ``chunk_loss`` over the logits of ``hidden`` (N x H) and ``weight`` (V x H), ``chunk`` rows at a
    time; with ``grads``, write the gradients it names, scaled by ``grad_scale``, into its buffers."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of rows, got {chunk}")
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    grads = grads or ChunkGrads()
    write_grad = grads.any()
    if n_rows == 0 and grads.weight is not None:  # the first chunk overwrites dW: with no rows, nothing does
        grads.weight.zero_()
    if grads.bias is not None:
        grads.bias.zero_()
    logits = torch.empty(min(chunk, n_rows), vocab, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, chunk):
        rows = slice(start, min(start + chunk, n_rows))
        h, z = hidden[rows], logits[: rows.stop - start]
        if bias is None:
            torch.mm(h, weight.t(), out=z)
        else:
            torch.addmm(bias, h, weight.t(), out=z)
        chunk_loss(z, rows, write_grad)
        if grads.weight is not None:
            accumulate_product(grads.weight, z.t(), h, grad_scale, first=start == 0)
        if grads.bias is not None:
            grads.bias.add_(z.sum(dim=0, dtype=torch.float32), alpha=grad_scale)
        if grads.hidden is not None:  # last: over the input it overwrites h, which the dW product has just read
            dh = grads.hidden[rows]
            torch.addmm(dh, z, weight, beta=0, alpha=grad_scale, out=dh)


TileGrad = Callable[[torch.Tensor, slice, slice], None]
"""``tile_grad(z, rows, columns)``: overwrite the logits ``z`` of ``hidden[rows]`` against ``weight[columns]`` with
d(loss)/dz. A tile holds part of each row, so the loss reads each row's normalizer from what its forward kept."""


def tiled_linear_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tile_grad: TileGrad,
    *,
    tokens: int,
    columns: int,
    grads: ChunkGrads,
    bias: torch.Tensor | None = None,
) -> None:
    """The backward of a loss that recomputes its logits (the RL head): the gradients ``grads`` names, over tiles
    of ``tokens`` rows by ``columns`` vocabulary entries (``columns`` >= V: whole rows, as the chunk loop's)::

        for each tile of T tokens:               dh_T = 0 (fp32 when V is split)
            for each slice of V' columns:        z = h_T @ W_V'.T;  tile_grad(z)
                                                 dW_V' (+)= z.T @ h_T     # K = T
                                                 dh_T  += z @ W_V'        # summed over slices in fp32

    Why tile the vocabulary: the chunk loop's dW product has K = C, the rows of logits that fit the budget (768 at
    V = 128k), a thin product that reads and writes all of dW once per chunk. Here a tile of T = 4096 tokens by V'
    columns fits the same budget, so dW is read and written N / T times, each product has K = T, and with N <= T
    each slice of dW is one product, summed in fp32 inside cuBLAS and rounded once. dh pays instead: an fp32 T x H
    accumulator (64 MiB at T = 4096, H = 4096), read and written once per slice of columns."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    if tokens < 1 or columns < 1:
        raise ValueError(f"tiles must have at least one row and one column, got {tokens} x {columns}")
    if grads.weight is not None and n_rows == 0:  # the first tile overwrites dW: with no rows, nothing does
        grads.weight.zero_()
    if grads.bias is not None:
        grads.bias.zero_()
    if n_rows == 0 or not grads.any():
        return
    tokens, columns = min(tokens, n_rows), min(columns, vocab)
    logits = torch.empty(tokens * columns, dtype=hidden.dtype, device=hidden.device)
    split = columns < vocab and grads.hidden is not None and grads.hidden.dtype != torch.float32
    dh_acc = torch.empty(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device) if split else None
    for start in range(0, n_rows, tokens):
        rows = slice(start, min(start + tokens, n_rows))
        h = hidden[rows]
        dh = None if grads.hidden is None else grads.hidden[rows]
        acc = dh if dh_acc is None else dh_acc[: h.shape[0]]
        for first_column in range(0, vocab, columns):
            cols = slice(first_column, min(first_column + columns, vocab))
            w = weight[cols]
            z = logits[: h.shape[0] * w.shape[0]].view(h.shape[0], w.shape[0])  # contiguous, whatever the tile
            if bias is None:
                torch.mm(h, w.t(), out=z)
            else:
                torch.addmm(bias[cols], h, w.t(), out=z)
            tile_grad(z, rows, cols)
            if grads.weight is not None:
                accumulate_product(grads.weight[cols], z.t(), h, 1.0, first=start == 0)
            if grads.bias is not None:
                grads.bias[cols].add_(z.sum(dim=0, dtype=torch.float32))
            if acc is not None:
                accumulate_product(acc, z, w, 1.0, first=first_column == 0)
        if acc is not dh:
            dh.copy_(acc)


# --------------------------------------------------------------------------------------------------
# What every public function checks and decides before the operator runs.


def check_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    names: tuple[str, str] = ("hidden", "weight"),
    layout: str | None = None,
) -> None:
    """Validate a linear head, as every fused linear loss takes it: hidden (..., H), or 3-D as ``layout`` describes
    it (a batch of sequences); weight (V, H) with V >= 1 on hidden's device, bias (V,) or None, all of one
    fp32/fp16/bf16 dtype where the kernels run. ``names`` name hidden and weight in the errors."""
    hidden_name, weight_name = names
    check_float(hidden_name, hidden)
    check_float(weight_name, weight)
    if layout is not None and hidden.dim() != 3:
        raise ValueError(f"{hidden_name} has shape {tuple(hidden.shape)}: expected {layout}")
    if hidden.dim() == 0:
        raise ValueError(f"{hidden_name} must have at least one dimension (the hidden size): expected (..., H)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{weight_name} has shape {tuple(weight.shape)}: expected (V, {hidden.shape[-1]}) with V >= 1, the hidden "
            f"size being the last dimension of {hidden_name} {tuple(hidden.shape)}"
        )
    others = {weight_name: weight}
    if bias is not None:
        check_float("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias has shape {tuple(bias.shape)}: expected ({weight.shape[0]},)")
        others["bias"] = bias
    for name, tensor in others.items():
        if tensor.dtype != hidden.dtype:
            raise ValueError(
                f"{name} has dtype {tensor.dtype}: expected one dtype, {hidden_name}'s {hidden.dtype} (as "
                f"torch.nn.functional.linear requires)"
            )
        _check_same_device(name, tensor, hidden_name, hidden)


def check_second_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    other_hidden: torch.Tensor,
    other_weight: torch.Tensor,
    *,
    names: tuple[str, str, str, str],
    layout: str | None = None,
) -> None:
    """Validate a second head over the tokens and vocabulary of (``hidden``, ``weight``), such as a teacher's or a
    reference model's: a head of its own (:func:`check_head`; its hidden size and dtype may differ), with hidden's
    leading shape, weight's vocabulary and their device. ``names``: (hidden, weight, other hidden, other weight)."""
    hidden_name, weight_name, other_hidden_name, other_weight_name = names
    check_head(other_hidden, other_weight, names=(other_hidden_name, other_weight_name), layout=layout)
    if other_hidden.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(
            f"{other_hidden_name} has shape {tuple(other_hidden.shape)}: expected {tuple(hidden.shape[:-1])} rows like "
            f"{hidden_name} {tuple(hidden.shape)} (the same tokens; the hidden sizes may differ)"
        )
    if other_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"{other_weight_name} has shape {tuple(other_weight.shape)}: expected the vocabulary V = {weight.shape[0]} "
            f"of {weight_name} {tuple(weight.shape)}"
        )
    _check_same_device(other_hidden_name, other_hidden, hidden_name, hidden)


def _check_same_device(name: str, tensor: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if tensor.device != other.device:
        raise ValueError(f"{name} is on {tensor.device}: expected {other.device}, {other_name}'s")


def check_chunk_options(name: str, chunk: int | None, accumulation: str | None) -> str:
    """Validate a fused loss's chunk-size keyword ``name`` (None or a positive int) and its ``accumulation``;
    return the accumulation to use (None: :data:`ACCUMULATION`)."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"{name} is {chunk!r}: expected None or a positive int")
    accumulation = ACCUMULATION if accumulation is None else accumulation
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation is {accumulation!r}: expected one of {ACCUMULATIONS}")
    return accumulation


KINDS = {"floating": "a floating-point", "flag": "a bool or integer", "index": "an integer (torch.int64)"}
"""The dtypes :func:`check_values` accepts, by kind."""


def check_values(
    name: str,
    values: object,
    shape: Sequence[int],
    what: str,
    kind: str = "floating",
    *,
    alternative: Sequence[int] | None = None,
) -> None:
    """A tensor of a loss's call other than the head: of ``shape`` (or ``alternative``), where the kernels run, of the
    dtype ``kind`` (:data:`KINDS`); ``what`` says what it holds (one value per sequence, per token...)."""
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    dtype = values.dtype
    fits = {"floating": dtype.is_floating_point, "flag": not dtype.is_floating_point,
            "index": not dtype.is_floating_point and dtype != torch.bool}[kind]  # fmt: skip
    if dtype.is_complex or not fits:
        raise ValueError(f"{name} has dtype {dtype}: expected {KINDS[kind]} tensor ({what})")
    runtime.check_device(**{name: values})
    shapes = [shape] if alternative is None else [shape, alternative]
    # same_shape, not `in`: under torch.compile with dynamic shapes, membership pins the sizes (see same_shape).
    if not any(same_shape(values.shape, expected) for expected in shapes):
        expected = " or ".join(str(tuple(s)) for s in shapes)
        raise ValueError(f"{name} has shape {tuple(values.shape)}: expected {expected} ({what})")


def check_one_number(name: str, value: torch.Tensor, what: str) -> None:
    """A one-element real tensor where the kernels run (a normalizer, an estimate), its value not read: on the GPU
    that would make the host wait."""
    if value.numel() != 1 or value.dtype.is_complex:
        raise ValueError(f"{name} has shape {tuple(value.shape)} and dtype {value.dtype}: expected one real number "
                         f"({what})")  # fmt: skip
    runtime.check_device(**{name: value})


def needed_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> list[bool]:
    """[hidden, weight, bias]: the gradients autograd will ask of this call (grad mode on, the tensor requiring
    grad). All False (no_grad, an evaluation, frozen inputs): the operator makes none and no autograd node is made."""
    grad_on = torch.is_grad_enabled()
    return [grad_on and tensor is not None and tensor.requires_grad for tensor in (hidden, weight, bias)]


def token_rows(hidden: torch.Tensor, target: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden`` (..., H) as the loop's (tokens, H) rows (a view where the layout allows), and ``target`` (...) as
    (tokens,) contiguous, one class index per row for the row kernels (None stays None)."""
    rows = hidden.reshape(row_count(hidden), hidden.shape[-1])
    return rows, None if target is None else target.reshape(-1).contiguous()


def rows_per_chunk(n_rows: int, row_bytes: int, budget: int, *, other_bytes: int = 0, align: int = CHUNK_ALIGN) -> int:
    """The chunk rule of every fused linear loss: as many rows as have their logits (``row_bytes`` each) in
    ``budget`` bytes less ``other_bytes`` (the hidden gradient's buffer, when there is one), rounded down to a
    multiple of ``align``, at least ``align`` (smaller matmuls waste the GPU) and 1, at most ``n_rows``. Bigger
    chunks keep the matmuls near peak, smaller ones cost less memory: each loss sets its own budget (a unit of
    rows, align 1, for a loss whose rows come in sequences)."""
    fitting = max(budget - other_bytes, 0) // max(row_bytes, 1)
    return max(1, min(n_rows, max(align, fitting // align * align)))


def accumulation_dtype(weight: torch.Tensor, accumulation: str) -> torch.dtype:
    """The dtype dW is summed in over chunks. ``"weight_dtype"``: the weight's, with ``addmm_`` (cuBLAS sums
    each chunk in fp32 and rounds once per chunk; no memory beyond dW). ``"fp32"``: a separate accumulator
    (4 V H bytes), rounded to the weight's dtype once, in the backward: exact whatever the number of chunks.
    ``"auto"``: fp32 when it costs nothing (fp32 weights) or at most :data:`FP32_ACCUMULATOR_BUDGET_BYTES`."""
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation is {accumulation!r}: expected one of {ACCUMULATIONS}")
    if accumulation == "auto":
        fits = 4 * weight.numel() <= FP32_ACCUMULATOR_BUDGET_BYTES
        accumulation = "fp32" if weight.dtype == torch.float32 or fits else "weight_dtype"
    return torch.float32 if accumulation == "fp32" else weight.dtype


def mean_over_kept(kept: torch.Tensor, n_rows: int, dtype: torch.dtype) -> tuple[bool, float, torch.Tensor | None]:
    """A mean's 1 / kept when only the device knows ``kept`` (a count it made: reading it back would make the host
    wait for the GPU every step, and no CUDA graph could hold the step). Returns (whether the row kernel divides dz
    by the count, in fp32 before rounding dz to ``dtype``; the matmuls' ``grad_scale``; the fp32 factor on the
    device that the gradients still owe, which the backward multiplies in with the upstream gradient: one pass,
    skipped on the GPU when the product is exactly 1; None when they owe nothing).

    fp32 divides in the kernel and owes nothing. The half types cannot: fp16 because p / kept ~ 1e-9 for 8192
    tokens over a 128k vocabulary underflows (fp16 stops at 6e-8); bf16 because the large entries of dz share one
    value, -1 / kept at each target of a cross-entropy (and at a confident teacher's token in a distillation
    loss), rounded alike to 8 bits for every token, which scales that part of the gradient by up to 1 +- 2**-9
    (benchmarks/notes/fused_linear_cross_entropy.md has the H200 measurement), where -1 itself is exact. Their dz
    stays unscaled, the matmuls take 1 / n_rows (known from the shapes; it keeps the dW sum as small as before) and
    the gradients owe n_rows / kept, exactly 1 when no row is ignored: then the backward's pass is skipped as
    before, otherwise it costs one in-place pass over dW and dh unless the upstream gradient needed one anyway."""
    if dtype == torch.float32:
        return True, 1.0, None
    return False, 1.0 / max(n_rows, 1), n_rows / kept.clamp(min=1).to(torch.float32)


# --------------------------------------------------------------------------------------------------
# The gradients: the operators' last outputs, and the backward that finishes them.


def _grad_hidden(hidden: torch.Tensor, needs: list[bool]) -> torch.Tensor:
    return hidden.new_empty((row_count(hidden), hidden.shape[-1]) if needs[0] else (0,))


def _grad_weight(weight: torch.Tensor, accumulation: str, needs: list[bool]) -> torch.Tensor:
    return weight.new_empty(weight.shape if needs[1] else (0,), dtype=accumulation_dtype(weight, accumulation))


def _grad_bias(weight: torch.Tensor, needs: list[bool]) -> torch.Tensor:
    return weight.new_empty(weight.shape[0] if needs[2] else 0, dtype=torch.float32)


def _owed(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty((), dtype=torch.float32)


def grad_outputs(*, owed: bool = True, hidden: str = "hidden", weight: str = "weight") -> dict[str, Allocator]:
    """The outputs a fused linear loss's operator ends with, as :func:`liger_lab.ops.operators.define` takes them:
    ``grad_hidden`` (rows, H), ``grad_weight`` (the dW accumulator in :func:`accumulation_dtype`), ``grad_bias``
    (V,) fp32, each empty unless ``needs`` asks for it, then with ``owed`` the fp32 factor the three still owe
    besides the upstream gradient (1 when nothing is owed; a backward operator, which has the upstream gradient
    already, owes nothing). They read the operator's arguments by name: the head's hidden states and weight (named
    ``hidden`` and ``weight`` unless the operator names them otherwise), ``accumulation`` and ``needs``."""
    outputs = {
        "grad_hidden": reads(_grad_hidden, hidden, "needs"),
        "grad_weight": reads(_grad_weight, weight, "accumulation", "needs"),
        "grad_bias": reads(_grad_bias, weight, "needs"),
    }
    return {**outputs, "owed": reads(_owed, hidden)} if owed else outputs


class Grads(NamedTuple):
    """The gradients of a call as its operator returns them (:func:`grad_outputs`)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    owed: torch.Tensor | None = None
    """What they still owe besides the upstream gradient (:func:`mean_over_kept`); None for nothing."""


class Head(NamedTuple):
    """What the backward knows of a call's head: the shape of hidden (dh's), the dtype of the weight (dW's and
    db's), and which of the gradients of (hidden, weight, bias) autograd asked for."""

    hidden_shape: torch.Size
    weight_dtype: torch.dtype
    needs: tuple[bool, bool, bool]


def finish_grads(grads: Grads, head: Head, grad_loss: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """(dh, dW, db) in the inputs' shapes and dtypes, None where not asked for.

    With ``grad_loss``, the gradients were made in the forward: they are multiplied by the upstream gradient and
    what they still owe, in place (one pass, skipped on the GPU when the product is exactly 1: a plain
    ``loss.backward()`` with nothing owed), the fp32 dW accumulator scaled and rounded to the weight's dtype in the
    same pass. Scaling in place bumps their versions: a second backward through the same graph fails with
    "modified by an inplace operation" instead of scaling them twice. Without it (None), a backward operator made
    them from the upstream gradients already: only the shape and dtype are left."""
    needs_h, needs_w, needs_b = head.needs
    grad_h, grad_w, grad_b, owed = grads
    if grad_loss is not None:
        scale = grad_loss.float() if owed is None else grad_loss.float() * owed
        if needs_h:
            SCALE_ROWS.in_place(grad_h, scale)
        if needs_w and grad_w.dtype == head.weight_dtype:
            SCALE_ROWS.in_place(grad_w, scale)
        elif needs_w:
            grad_w = SCALE_ROWS.default(grad_w, scale, head.weight_dtype)
        if needs_b:
            grad_b = grad_b * scale
    # detach(): a fresh tensor object, so a leaf's .grad is never the buffer the backward scaled (in place: its memory)
    return (
        grad_h.view(head.hidden_shape).detach() if needs_h else None,
        grad_w.to(head.weight_dtype) if needs_w else None,
        grad_b.to(head.weight_dtype) if needs_b else None,
    )


# --------------------------------------------------------------------------------------------------
# Autograd, the same for every loss that makes its gradients in the forward.


@dataclass(frozen=True)
class FusedLoss:
    """A fused linear loss as :func:`run_loss` calls it."""

    name: str
    """The public function, ``liger_lab.<name>``: a refused second derivative names it."""
    operator: Operator
    """Its operators: ``(hidden, weight, ...tensors, ...options, accumulation, needs)`` to ``(loss, ...metrics,
    *grad_outputs())``, and the in-place twin that writes dh over hidden, if it has one."""
    bias_at: int | None = None
    """Where the bias is among the operator's tensors (None: a head without one)."""
    metrics: int = 0
    """Outputs between the loss and the gradients (sequence scores and the like): by-products, not differentiable."""


class GradsMadeInForward(torch.autograd.Function):
    """Autograd of every fused linear loss that makes its gradients in the forward: the operator returns them, the
    backward scales them in place by the upstream gradient (:func:`finish_grads`). That is why this is an
    ``autograd.Function`` (traced by torch.compile like any other code) and not a formula registered on the
    operator: the backward writes over the operator's outputs. Only hidden, weight and bias get gradients; the
    other tensors are constants of the call."""

    @staticmethod
    def forward(ctx, loss: FusedLoss, in_place: bool, arguments: tuple, *tensors: torch.Tensor | None):
        hidden, weight = tensors[:2]
        if in_place:
            *results, grad_w, grad_b, owed = loss.operator.call_in_place(*tensors, *arguments)
            # hidden now holds its gradient (the operator bumped its version: a node that saved it for its own
            # backward gets "modified by an inplace operation" instead of using a gradient). Saved detached: the
            # gradient is data now, not a node of the graph that made hidden.
            grads = Grads(hidden.detach(), grad_w, grad_b, owed)
        else:
            *results, grad_h, grad_w, grad_b, owed = loss.operator(*tensors, *arguments)
            grads = Grads(grad_h, grad_w, grad_b, owed)
        ctx.loss, ctx.n_tensors = loss, len(tensors)
        ctx.head = Head(hidden.shape, weight.dtype, tuple(arguments[-1]))
        ctx.save_for_backward(*grads)
        if not loss.metrics:
            return results[0]
        ctx.mark_non_differentiable(*results[1:])
        return tuple(results)

    @staticmethod
    def backward(ctx, grad_loss, *grad_metrics):
        refuse_second_derivative(ctx.loss.name)
        grad_h, grad_w, grad_b = finish_grads(Grads(*ctx.saved_tensors), ctx.head, grad_loss)
        grads = [grad_h, grad_w, *(None,) * (ctx.n_tensors - 2)]
        if ctx.loss.bias_at is not None:
            grads[ctx.loss.bias_at] = grad_b
        return None, None, None, *grads


def run_loss(
    loss: FusedLoss, tensors: Sequence[torch.Tensor | None], arguments: Sequence[object], *, in_place: bool = False
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``loss``'s operator on ``(*tensors, *arguments)`` (``arguments`` ending with ``needs``): the loss, or the loss
    and its metrics. Under :class:`GradsMadeInForward` when a gradient is needed (``in_place``: its twin, dh over
    hidden); otherwise the operator alone, which makes no gradient. Under a ``torch.func`` transform it raises,
    naming the loss: its gradient is made by Triton kernels in its forward, which functorch cannot transform."""
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            f"liger_lab.{loss.name} does not run under torch.func transforms (grad, vjp, vmap, jacrev): its gradient "
            "is made in its forward by Triton kernels, which functorch cannot transform. Use torch.autograd.grad or "
            f"loss.backward(), or the plain PyTorch loss liger_lab.reference.{loss.name}."
        )
    if any(arguments[-1]):
        return GradsMadeInForward.apply(loss, in_place, tuple(arguments), *tensors)
    outputs = loss.operator(*tensors, *arguments)
    return tuple(outputs[: 1 + loss.metrics]) if loss.metrics else outputs[0]
