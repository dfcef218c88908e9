"""The one table of liger_lab's ops: what each public op is, and everything that tests, checks or
measures it reads from here.

A row (:class:`OpSpec`) names the public function and its float64 reference, makes fresh inputs for a
shape, gives the shapes used by checks and benchmarks, the bytes (or FLOPs) the op must move, the
``liger_lab::`` PyTorch operators behind it, its opt-in variants, and its Liger-Kernel peer. The
``liger-lab check`` command, the benchmarks (:mod:`liger_lab.bench`), the ``opcheck`` and
``torch.compile`` tests all iterate over :data:`OPS`: a new op is one more row.

It names the peers the benchmarks measure against (Liger-Kernel, TRL), so it sits with the tools that read it,
above the package root, and not in :mod:`liger_lab.ops`, whose kernels know nothing of benchmarks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import liger_lab
from liger_lab import reference, runtime
from liger_lab.formulas import HEAD_OUTPUTS

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OpSpec:
    """One public op of liger_lab (see the module docstring)."""

    name: str
    """The public function, ``liger_lab.<name>``, and its reference, ``liger_lab.reference.<name>``."""
    make_inputs: Callable[[Shape, torch.dtype], list[object]]
    """Fresh random inputs for a shape, floating ones requiring grad."""
    input_names: tuple[str, ...]
    differentiable: tuple[str, ...]
    """Inputs whose gradients are checked; the others are constants of the call (targets, RoPE tables)."""
    bench_shape: Shape
    """The benchmark-protocol shape (GPU; `benchmarks/notes/README.md`)."""
    quick_shape: Shape
    """A quarter or less of the protocol shape: quick GPU runs."""
    check_shapes: tuple[Shape, Shape]
    """(interpreter, GPU) shapes of ``liger-lab check``."""
    operators: tuple[str, ...]
    """The ``liger_lab::`` operators this op is built from: the forward first, then backward and in-place ones."""
    registered_autograd: bool = True
    """Whether the forward operator carries its autograd formula (``liger_lab.ops.operators.define``'s
    ``setup_context`` and ``backward``). The losses that make their gradient in the forward and scale it in place in
    the backward use an ``autograd.Function`` instead: their backward writes over the operator's outputs."""
    fwd_passes: float = 0.0
    """Passes over ``elements(shape)`` elements that the forward must move (0: matmul-bound)."""
    full_passes: float = 0.0
    """The same for forward+backward."""
    elements: Callable[[Shape], int] = math.prod
    flops: Callable[[Shape], float] | None = None
    """Forward+backward FLOPs, for the matmul-bound ops."""
    variants: dict[str, dict[str, object]] = field(default_factory=dict)
    """Opt-in keyword sets that get their own labelled benchmark row, e.g. ``{"in_place": {...}}``."""
    liger: tuple[str, dict[str, object]] | None = None
    """Liger-Kernel's functional op and the keywords that match our defaults."""
    liger_modules: dict[str, Callable[[], Callable[..., object]]] = field(default_factory=dict)
    """Peers that are modules with their own argument order (Liger-Kernel's chunked losses, TRL's fused head): row
    label -> a builder of a function taking this op's inputs (imported only when the row runs)."""
    graph_timing: bool = True
    """Whether a CUDA graph can capture the op (not when it reads a value back to the host)."""
    check_tolerances: dict[torch.dtype, float] = field(default_factory=dict)
    """Relative L2 tolerances of ``liger-lab check`` by dtype, where the op's GPU check shape needs more than
    :data:`liger_lab.workbook.checks.TOLERANCE` (each with the reason where it is set)."""

    @property
    def function(self) -> Callable[..., object]:
        return getattr(liger_lab, self.name)

    @property
    def reference(self) -> Callable[..., object]:
        return getattr(reference, self.name)

    def call(self, **options: object) -> Callable[..., object]:
        """The public function with keyword ``options`` bound (a variant's)."""
        function = self.function
        return (lambda *args: function(*args, **options)) if options else function

    def check_shape(self) -> Shape:
        return runtime.pick(cpu=self.check_shapes[0], gpu=self.check_shapes[1])


def _randn(shape: Shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, device=runtime.DEVICE)).to(dtype).requires_grad_()


def _norm_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    weight = (1 + 0.1 * torch.randn(shape[-1], device=runtime.DEVICE)).to(dtype).requires_grad_()
    return [_randn(shape, dtype), weight]


def _add_norm_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    """The sublayer output x, the residual stream and the norm weight."""
    x, weight = _norm_inputs(shape, dtype)
    return [x, _randn(shape, dtype), weight]


def _layer_norm_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    return [*_norm_inputs(shape, dtype), _randn(shape[-1:], dtype, scale=0.1)]


def _rope_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    batch, q_heads, k_heads, seq, head_dim = shape
    angles = torch.arange(seq, device=runtime.DEVICE)[:, None] * torch.rand(head_dim // 2, device=runtime.DEVICE)
    angles = torch.cat([angles, angles], dim=-1)[None]
    return [
        _randn((batch, q_heads, seq, head_dim), dtype),
        _randn((batch, k_heads, seq, head_dim), dtype),
        angles.cos().to(dtype),
        angles.sin().to(dtype),
    ]


def _mrope_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    """RoPE's q and k, multimodal RoPE's three tables (3, B, T, D) and Qwen2-VL's sections ((16, 24, 24) of 64 pairs)
    scaled to head_dim / 2. The temporal, height and width positions differ from token to token and from one
    sequence of the batch to the next, as an image's patches make them."""
    batch, _, _, seq, head_dim = shape
    q, k, *_ = _rope_inputs(shape, dtype)
    token, sequence = torch.arange(seq, device=runtime.DEVICE), torch.arange(batch, device=runtime.DEVICE)
    positions = torch.stack([token, token // 4, token % 4])[:, None] + sequence[:, None]  # (3, B, T)
    angles = positions[..., None] * torch.rand(head_dim // 2, device=runtime.DEVICE)
    angles = torch.cat([angles, angles], dim=-1)
    spatial = 3 * (head_dim // 2) // 8
    return [q, k, angles.cos().to(dtype), angles.sin().to(dtype), [head_dim // 2 - 2 * spatial, spatial, spatial]]


def _partial_rope_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    """RoPE's q and k with tables of the first rotary_dim features only (Phi-3's and GLM-4's half of a head)."""
    batch, q_heads, k_heads, seq, head_dim, rotary_dim = shape
    q, k, _, _ = _rope_inputs((batch, q_heads, k_heads, seq, head_dim), dtype)
    _, _, cos, sin = _rope_inputs((1, 0, 0, seq, rotary_dim), dtype)
    return [q, k, cos, sin]


def _glu_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    return [_randn(shape, dtype), _randn(shape, dtype)]


def _targets(n_tokens: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n_tokens,), device=runtime.DEVICE)


def _ce_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    n_tokens, vocab = shape
    return [_randn(shape, dtype), _targets(n_tokens, vocab)]


def _flce_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    n_tokens, hidden, vocab = shape
    return [_randn((n_tokens, hidden), dtype), _randn((vocab, hidden), dtype, hidden**-0.5), _targets(n_tokens, vocab)]


def _jsd_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    """Student logits (requiring grad), teacher logits (a constant: it gets no gradient), labels."""
    n_tokens, vocab = shape
    teacher = (2.0 * torch.randn(shape, device=runtime.DEVICE)).to(dtype)
    return [_randn(shape, dtype, scale=2.0), teacher, _targets(n_tokens, vocab)]


def _fljsd_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    """Student hidden states and head (requiring grad), the teacher's (constants: no gradient), labels."""
    n_tokens, student_size, teacher_size, vocab = shape
    teacher = [_randn((n_tokens, teacher_size), dtype), _randn((vocab, teacher_size), dtype, 2 * teacher_size**-0.5)]
    student = [_randn((n_tokens, student_size), dtype), _randn((vocab, student_size), dtype, 2 * student_size**-0.5)]
    return [*student, *(t.detach() for t in teacher), _targets(n_tokens, vocab)]


def _preference_inputs(
    shape: Shape, dtype: torch.dtype, *, with_reference: bool = False, paired: bool = True
) -> list[object]:
    """B pairs of T positions: hidden (2B, T, H) (chosen rows, then rejected), the policy head, targets with the
    first quarter of each sequence (the prompt) ignored, and for DPO a frozen reference model (constants).
    Unpaired (KTO): B completions, (B, T, H), with desirable and undesirable labels in turn after the targets."""
    units, seq_len, hidden, vocab = shape
    n_sequences = 2 * units if paired else units
    target = _targets(n_sequences * seq_len, vocab).view(n_sequences, seq_len)
    target[:, : seq_len // 4] = -100
    inputs = [_randn((n_sequences, seq_len, hidden), dtype), _randn((vocab, hidden), dtype, hidden**-0.5), target]
    if not paired:
        inputs.append(torch.arange(n_sequences, device=runtime.DEVICE) % 2 == 0)
    if with_reference:
        reference_head = [_randn((n_sequences, seq_len, hidden), dtype), _randn((vocab, hidden), dtype, hidden**-0.5)]
        inputs += [t.detach() for t in reference_head]
    return inputs


def _grpo_inputs(shape: Shape, dtype: torch.dtype) -> list[object]:
    """B completions of T positions: hidden (B, T, H), the policy head, targets with the last quarter of every
    other completion padded, and one advantage per completion (float32 constants, as TRL's are)."""
    completions, seq_len, hidden, vocab = shape
    target = _targets(completions * seq_len, vocab).view(completions, seq_len)
    target[::2, seq_len - seq_len // 4 :] = -100
    advantages = torch.randn(completions, device=runtime.DEVICE)
    return [_randn((completions, seq_len, hidden), dtype), _randn((vocab, hidden), dtype, hidden**-0.5), target,
            advantages]  # fmt: skip


def _trl_head(*, entropy: bool) -> Callable[[], Callable[..., object]]:
    """A builder of TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``) called with this op's inputs: the
    log-probs, and the entropy too when asked (at TRL's own chunk of the vocabulary)."""

    def build() -> Callable[..., object]:
        from trl.kernels import ChunkedLogProbFunction

        outputs = ("entropy",) if entropy else ()

        def head(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> object:
            logp, ent, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, target, 1.0, 32768, None, 1.0, outputs)
            return (logp, ent) if entropy else logp

        return head

    return build


def _liger_module(class_name: str, adapt: Callable[..., Callable[..., object]], **options: object):
    """A builder of a Liger-Kernel chunked-loss module called with this op's inputs: ``adapt(module)`` reorders
    them and keeps the loss (the preference modules also return their log-probabilities)."""

    def build() -> Callable[..., object]:
        from liger_kernel import chunked_loss

        return adapt(getattr(chunked_loss, class_name)(**options))

    return build


def _liger_preference(class_name: str, **options: object):
    """Liger-Kernel's (weight, hidden, target, bias, reference hidden, reference weight) -> (loss, extras)."""
    return _liger_module(class_name, lambda module: lambda h, w, t, *ref: module(w, h, t, None, *ref)[0], **options)


_NORM = dict(bench_shape=(16384, 4096), quick_shape=(4096, 4096), check_shapes=((3, 37, 96), (4, 1024, 4096)))
_GLU = dict(bench_shape=(16384, 14336), quick_shape=(4096, 14336), check_shapes=((3, 33, 160), (2048, 14336)))
_IN_PLACE = {"in_place_backward": {"in_place_backward": True}}
# RoPE and M-RoPE rotate q and k, shapes (B, q heads, k heads, T, D): one read and one write of each.
_ROPE = dict(fwd_passes=2, full_passes=4, elements=lambda s: s[0] * (s[1] + s[2]) * s[3] * s[4])
# The unpaired losses over B completions of T positions, (B, T, hidden H, vocabulary V): V logits per token move.
# Neither is timed under a CUDA graph, and both carry their gradient in an autograd.Function.
_COMPLETIONS = dict(
    bench_shape=(8, 1024, 4096, 128256),
    quick_shape=(2, 1024, 4096, 128256),
    check_shapes=((3, 9, 16, 130), (4, 512, 4096, 128256)),
    elements=lambda s: s[0] * s[1] * s[3],
    graph_timing=False,
    registered_autograd=False,
)

OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            "rms_norm", _norm_inputs, ("x", "weight"), ("x", "weight"), **_NORM,
            operators=("rms_norm", "rms_norm_backward", "rms_norm_backward_"),
            fwd_passes=2, full_passes=5, variants=_IN_PLACE, liger=("liger_rms_norm", {"eps": 1e-6}),
        ),
        OpSpec(
            "add_rms_norm", _add_norm_inputs, ("x", "residual", "weight"), ("x", "residual", "weight"), **_NORM,
            operators=("add_rms_norm", "add_rms_norm_backward"),
            # Forward: read x and residual, write s and y (4). Backward: read dy, ds and s, write the one gradient
            # that x and residual share (4). An add then rms_norm moves 11: 3 + 2 forward, then 3 for the norm's
            # backward and 3 more for autograd's ds + (norm's dx).
            fwd_passes=4, full_passes=8,
            # Same arguments and outputs, (y, s); its default in_place=True writes dx over dy, as liger_rms_norm's.
            liger=("liger_fused_add_rms_norm", {"eps": 1e-6}),
        ),
        OpSpec(
            "layer_norm", _layer_norm_inputs, ("x", "weight", "bias"), ("x", "weight", "bias"), **_NORM,
            operators=("layer_norm", "layer_norm_backward"),
            fwd_passes=2, full_passes=5, liger=("liger_layer_norm", {"eps": 1e-5}),
            variants={"offset": {"offset": 1.0}},  # Nemotron's LayerNorm1P: the weight scales as 1 + w
        ),
        OpSpec(
            "rope", _rope_inputs, ("q", "k", "cos", "sin"), ("q", "k"),
            bench_shape=(4, 32, 8, 4096, 128), quick_shape=(1, 32, 8, 4096, 128),
            check_shapes=((2, 4, 2, 19, 32), (2, 32, 8, 1024, 128)),
            operators=("rope", "rope_backward"), **_ROPE, liger=("liger_rope", {}),
        ),
        OpSpec(
            "mrope", _mrope_inputs, ("q", "k", "cos", "sin", "mrope_section"), ("q", "k"),
            # Qwen2.5-VL-7B's attention: 28 query heads, 4 key heads of 128.
            bench_shape=(4, 28, 4, 4096, 128), quick_shape=(1, 28, 4, 4096, 128),
            check_shapes=((2, 4, 2, 19, 32), (2, 28, 4, 1024, 128)),
            operators=("mrope", "mrope_backward"), **_ROPE, liger=("liger_qwen2vl_mrope", {}),
        ),
        OpSpec(
            "partial_rope", _partial_rope_inputs, ("q", "k", "cos", "sin"), ("q", "k"),
            # (batch, q heads, k heads, seq_len, head_dim, rotary_dim): GLM-4-9B's attention, 32 query heads and 2
            # key heads of 128 features, the first 64 rotated.
            bench_shape=(4, 32, 2, 4096, 128, 64), quick_shape=(1, 32, 2, 4096, 128, 64),
            check_shapes=((2, 4, 2, 19, 32, 16), (2, 32, 2, 1024, 128, 64)),
            operators=("partial_rope", "partial_rope_backward"), **_ROPE,
            variants={"interleaved": {"interleaved": True}},
        ),
        OpSpec(
            "swiglu", _glu_inputs, ("gate", "up"), ("gate", "up"), **_GLU,
            operators=("glu", "glu_backward", "glu_backward_"),
            fwd_passes=3, full_passes=8, variants=_IN_PLACE, liger=("liger_swiglu", {}),
        ),
        OpSpec(
            "geglu", _glu_inputs, ("gate", "up"), ("gate", "up"), **_GLU,
            operators=("glu", "glu_backward", "glu_backward_"),
            fwd_passes=3, full_passes=8, variants=_IN_PLACE, liger=("liger_geglu", {}),
        ),
        OpSpec(
            "cross_entropy", _ce_inputs, ("logits", "target"), ("logits",),
            bench_shape=(8192, 128256), quick_shape=(2048, 128256), check_shapes=((67, 1000), (2048, 128256)),
            operators=("cross_entropy", "cross_entropy_", "scale_rows_"),
            fwd_passes=1, full_passes=3, variants=_IN_PLACE, liger=("liger_cross_entropy", {}),
            graph_timing=False, registered_autograd=False,
        ),
        OpSpec(
            "fused_linear_cross_entropy", _flce_inputs, ("hidden", "weight", "target"), ("hidden", "weight"),
            bench_shape=(8192, 4096, 128256), quick_shape=(2048, 4096, 128256),
            check_shapes=((67, 64, 1000), (2048, 4096, 128256)),
            operators=(
                "fused_linear_cross_entropy", "fused_linear_cross_entropy_", "fused_linear_cross_entropy_backward",
                "scale_rows", "scale_rows_",
            ),
            elements=lambda s: s[0] * s[2], flops=lambda s: 6.0 * s[0] * s[1] * s[2],
            variants=_IN_PLACE, liger=("liger_fused_linear_cross_entropy", {}), graph_timing=False,
            registered_autograd=False,
        ),
        OpSpec(
            "jsd", _jsd_inputs, ("student_logits", "teacher_logits", "target"), ("student_logits",),
            # Few rows and columns in the interpreter: each gradient entry is (Q - P) / T / (kept rows), and with
            # many rows in fp16 most entries fall below fp16's normal range, where rounding alone exceeds the
            # fp16 tolerance of `liger-lab check` (tests/test_jsd.py covers larger shapes).
            bench_shape=(8192, 128256), quick_shape=(2048, 128256), check_shapes=((9, 130), (2048, 128256)),
            operators=("jsd", "scale_rows_"),
            # Fewest bytes: read student and teacher once (the loss); also write the student's gradient.
            fwd_passes=2, full_passes=3, registered_autograd=False,
            # No peer: Liger-Kernel's liger_jsd takes log-probabilities (log_softmax done by the caller) and
            # has no temperature, so it is another function of these inputs, not the same loss.
            liger=None,
        ),
        OpSpec(
            "fused_linear_jsd", _fljsd_inputs,
            ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight", "target"),
            ("student_hidden", "student_weight"),
            # (tokens N, student hidden H_s, teacher hidden H_t, vocabulary V); H_t != H_s in the interpreter.
            bench_shape=(8192, 4096, 4096, 128256), quick_shape=(2048, 4096, 4096, 128256),
            check_shapes=((37, 24, 40, 130), (2048, 4096, 4096, 128256)),
            operators=("fused_linear_jsd", "scale_rows", "scale_rows_"),
            elements=lambda s: s[0] * s[3],
            # 6 N H_s V for the student's head (logits and both gradients), 2 N H_t V for the teacher's logits.
            flops=lambda s: 6.0 * s[0] * s[1] * s[3] + 2.0 * s[0] * s[2] * s[3],
            graph_timing=False, registered_autograd=False,
            # The logits are bf16 (each rounded by up to 2^-9 relative) and the JSD's gradient is a difference of
            # the student's and the mixture's nearby probabilities, which that rounding reaches in full: 1.0e-2
            # and 1.3e-2 (dh, dW) measured on the H200 at the GPU check shape.
            check_tolerances={torch.bfloat16: 3e-2},
            # Same loss and argument order (its jsd_beta is our beta; beta 0 and 1 are the forward and reverse KL).
            liger=("liger_fused_linear_jsd", {}),
            # Its chunked distillation loss, soft (JSD) term only; it weighs the same JSD of the same logits.
            liger_modules={"liger:chunked": _liger_module(
                "LigerFusedLinearJSDLoss", lambda module: module, weight_hard_loss=0.0, weight_soft_loss=1.0,
            )},
        ),
        *(
            OpSpec(
                f"fused_linear_{loss}",
                functools.partial(_preference_inputs, with_reference=loss == "dpo"),
                ("hidden", "weight", "target", *(("ref_hidden", "ref_weight") if loss == "dpo" else ())),
                ("hidden", "weight"),
                # (pairs B, positions T, hidden H, vocabulary V): 2B sequences of T positions.
                bench_shape=(4, 1024, 4096, 128256), quick_shape=(1, 1024, 4096, 128256),
                check_shapes=((2, 9, 16, 130), (2, 512, 4096, 128256)),
                operators=("fused_linear_preference", "scale_rows", "scale_rows_"),
                elements=lambda s: 2 * s[0] * s[1] * s[3],
                # 6 N H V for the trained head, plus 2 N H V for DPO's reference head.
                flops=lambda s, loss=loss: (8.0 if loss == "dpo" else 6.0) * 2 * s[0] * s[1] * s[2] * s[3],
                graph_timing=False, registered_autograd=False,
                # DPO's margin is the difference of four sums of about 400 token log-probabilities (each near
                # -log V): fp32's rounding of the sums, relative to their small difference, exceeds 1e-5 (3.3e-5
                # measured on the H200 at the GPU check shape). tests/test_preference.py bounds it the same way.
                check_tolerances={torch.float32: 1e-4} if loss == "dpo" else {},
                # Liger-Kernel's chunked modules, set to the same loss: DPO without an NLL term, ORPO with its
                # chosen NLL, SimPO without one (our SimPO has none) at our beta and gamma.
                liger_modules={"liger": _liger_preference(module, **options)},
            )
            for loss, module, options in (
                ("dpo", "LigerFusedLinearDPOLoss", {"beta": 0.1}),
                ("orpo", "LigerFusedLinearORPOLoss", {"beta": 0.1}),
                ("simpo", "LigerFusedLinearSimPOLoss", {"beta": 2.0, "gamma": 0.5, "compute_nll_loss": False}),
            )
        ),
        OpSpec(
            "fused_linear_kto", functools.partial(_preference_inputs, with_reference=True, paired=False),
            ("hidden", "weight", "target", "label", "ref_hidden", "ref_weight"),
            ("hidden", "weight"),
            # B unpaired sequences of T positions.
            **_COMPLETIONS, operators=("fused_linear_preference", "scale_rows", "scale_rows_"),
            # 6 N H V for the trained head, plus 2 N H V for the reference head.
            flops=lambda s: 8.0 * s[0] * s[1] * s[2] * s[3],
            # Like DPO's margin, the log-ratio logp - ref is a difference of two sums of hundreds of token
            # log-probabilities: fp32's rounding of the sums exceeds 1e-5 of it at the GPU check shape.
            check_tolerances={torch.float32: 1e-4},
        ),
        OpSpec(
            "fused_linear_cpo", _preference_inputs, ("hidden", "weight", "target"), ("hidden", "weight"),
            # (pairs B, positions T, hidden H, vocabulary V), as the other preference losses.
            bench_shape=(4, 1024, 4096, 128256), quick_shape=(1, 1024, 4096, 128256),
            check_shapes=((2, 9, 16, 130), (2, 512, 4096, 128256)),
            operators=("fused_linear_preference", "scale_rows", "scale_rows_"),
            elements=lambda s: 2 * s[0] * s[1] * s[3], flops=lambda s: 6.0 * 2 * s[0] * s[1] * s[2] * s[3],
            graph_timing=False, registered_autograd=False,
            # The sigmoid loss scores summed log-probabilities, as DPO does (see its tolerance).
            check_tolerances={torch.float32: 1e-4},
        ),
        OpSpec(
            "fused_linear_logprobs", _flce_inputs, ("hidden", "weight", "target"), ("hidden", "weight"),
            bench_shape=(8192, 4096, 128256), quick_shape=(2048, 4096, 128256),
            check_shapes=((67, 64, 1000), (2048, 4096, 128256)),
            operators=("fused_linear_logprobs", "fused_linear_logprobs_backward"),
            # The upstream gradients are known only in the backward, which recomputes the logits: 8 N H V FLOPs.
            elements=lambda s: s[0] * s[2], flops=lambda s: 8.0 * s[0] * s[1] * s[2],
            # The entropy as well (what TRL's fused head computes for GRPO), and every output TRL's head has with a
            # soft cap and a logit scale (what its SFT, DPO and KTO trainers ask of a Gemma 2): labelled rows.
            variants={"entropy": {"entropy": True},
                      "all_outputs": {"outputs": HEAD_OUTPUTS, "softcap": 30.0, "logit_scale": 0.5}},
            graph_timing=False,
            # TRL 1.16's fused LM head, the head its trainers run, for the same outputs.
            liger_modules={"trl": _trl_head(entropy=False), "trl:entropy": _trl_head(entropy=True)},
        ),
        OpSpec(
            "fused_linear_grpo", _grpo_inputs, ("hidden", "weight", "target", "advantages"), ("hidden", "weight"),
            # N = B T tokens, as the fused cross-entropy's.
            **_COMPLETIONS, operators=("fused_linear_grpo", "scale_rows", "scale_rows_"),
            # The default (token-level weights) makes its gradient in the forward: 6 N H V FLOPs.
            flops=lambda s: 6.0 * s[0] * s[1] * s[2] * s[3],
            # Liger-Kernel's chunked GRPO at our defaults (dapo, token level, no KL term, no old log-probabilities);
            # it takes the completion mask and in-range token ids, and returns (loss, metrics).
            liger_modules={"liger": _liger_module(
                "LigerFusedLinearGRPOLoss",
                lambda module: lambda h, w, t, a: module(h, w, t.clamp(min=0), (t != -100).long(), a)[0],
                beta=0.0, use_ref_model=False, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2,
            )},
        ),
    )
}  # fmt: skip
"""Every public op, by name."""
