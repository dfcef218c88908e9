"""Launch settings of the norm, cross-entropy, RoPE and GLU kernels, each passed to the op's launcher as a config.

    python -m benchmarks.sweep_tiles [--only norms|cross_entropy|jsd|rope|glu ...] [--json FILE]
    python -m benchmarks.sweep_tiles --quick     # tiny shapes, one setting besides the default: runs on CPU too

At each op's protocol shape in bf16, what varies:

- norms (rms_norm, add_rms_norm, layer_norm): the forward's rows per program and warps, and the persistent
  backward's rows, warps, programs per SM and tiles in flight (Triton's software pipelining of its loop)
  (:class:`liger_lab.runtime.RowLaunch`), each kernel timed alone;
- cross_entropy: the streaming tile, columns per step and warps (a ``RowLaunch`` too), loss and gradient in one
  kernel;
- jsd: the same streaming tiles for the JSD kernel's loss and gradient, once per divergence (the mixture of
  beta 0.5 and both KL directions, beta 0 and 1);
- rope: rows (one head of one position) per program and warps (:class:`liger_lab.ops.rope.RopeTile`), forward+backward;
- glu (SwiGLU's kernels): block and warps (:class:`liger_lab.runtime.ElementwiseLaunch`), forward+backward.

Every setting's output is first compared with the default's (a setting that computes something else is reported
and not timed), then timed on the benchmark clock (:func:`liger_lab.profiling.gpu_time_ms`: CUDA-graph replay on
the GPU), with the bandwidth implied by the fewest bytes the op's table row says it moves. Each row is printed as
it finishes, then the fastest setting of each kernel against the default. The winners become the defaults in
``liger_lab/runtime.py``, ``liger_lab/ops/rope.py`` and ``liger_lab/ops/jsd.py``; ``benchmarks/notes/`` says what was
measured.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

import liger_lab  # noqa: F401  (chooses GPU or interpreter before triton is imported)
from liger_lab import formulas, profiling, runtime
from liger_lab.op_table import OPS as TABLE
from liger_lab.ops import cross_entropy, glu, jsd, layer_norm, rms_norm, rope
from liger_lab.workbook import results

triton = runtime.triton  # the module liger_lab.runtime imported once it had chosen GPU or interpreter

GROUPS = ("norms", "cross_entropy", "jsd", "rope", "glu")
NORMS = ("rms_norm", "add_rms_norm", "layer_norm")
EPS = 1e-6


@dataclass(frozen=True)
class Settings:
    """The settings tried for each kind of launch."""

    norm_forward: tuple[tuple[int, int], ...]
    """(rows per program, warps)"""
    norm_backward: tuple[tuple[int, int, int, int], ...]
    """(rows per tile, warps, programs per SM, tiles in flight per program)"""
    streaming: tuple[tuple[int, int, int], ...]
    """(columns per step, rows per program, warps)"""
    rope: tuple[tuple[int, int], ...]
    """(rows per program, warps)"""
    elementwise: tuple[tuple[int, int], ...]
    """(block, warps)"""


GPU_SETTINGS = Settings(
    norm_forward=tuple(itertools.product((1, 2, 4), (4, 8))),
    norm_backward=tuple(itertools.product((1, 2, 4), (4, 8, 16), (1, 2), (3, 4))),
    streaming=tuple(itertools.product((2048, 4096, 8192, 16384, 32768), (1,), (4, 8, 16, 32))),
    rope=tuple(itertools.product((4, 8, 16, 32, 64), (1, 2, 4, 8))),
    elementwise=tuple(itertools.product((1024, 2048, 4096, 8192, 16384), (4, 8, 16))),
)
# The interpreter ignores warps and pays per program: one setting besides the default, with few programs.
QUICK_SETTINGS = Settings(
    norm_forward=((8, 1),),
    norm_backward=((8, 1, 2, 2),),
    streaming=((256, 16, 1),),
    rope=((4, 1),),
    elementwise=((1024, 1),),
)


@dataclass(frozen=True)
class Case:
    """One kernel, or a forward+backward pair, launched with one setting."""

    op: str
    kernel: str
    setting: str
    config: dict
    call: Callable[[], Sequence[torch.Tensor]]
    min_bytes: int
    default: bool = False


def table_inputs(op: str, quick: bool, dtype: torch.dtype) -> tuple[tuple[int, ...], list]:
    """The op's shape (its check shape for the interpreter with --quick) and fresh inputs from its table row."""
    spec = TABLE[op]
    shape = spec.check_shapes[0] if quick else spec.bench_shape
    inputs = [v.detach() if isinstance(v, torch.Tensor) else v for v in spec.make_inputs(shape, dtype)]
    return shape, inputs


def _bytes(op: str, shape: tuple[int, ...], passes: float, dtype: torch.dtype) -> int:
    return profiling.bytes_moved(TABLE[op].elements(shape), passes, dtype)


Launcher = Callable[[object], Sequence[torch.Tensor]]
"""Launches a kernel (or a pair) with the config it is given; returns the tensors it wrote."""


class NormLaunchers(NamedTuple):
    """A norm's two kernels on 2-D rows, each launched with the config it is given, and the op's default configs."""

    forward: Launcher
    backward: Launcher
    forward_default: runtime.RowLaunch
    backward_default: runtime.RowLaunch


def norm_launchers(op: str, inputs: list) -> NormLaunchers:
    named = dict(zip(TABLE[op].input_names, inputs, strict=True))
    x, weight = named["x"].reshape(-1, named["x"].shape[-1]), named["weight"]
    dy = torch.randn_like(x)
    if op == "layer_norm":
        bias = named["bias"]
        _, mean, rstd = layer_norm.layer_norm_forward(x, weight, bias, EPS)
        return NormLaunchers(
            lambda launch: layer_norm.layer_norm_forward(x, weight, bias, EPS, launch=launch),
            lambda launch: layer_norm.layer_norm_backward(dy, x, weight, mean, rstd, launch=launch),
            layer_norm.forward_launch(*x.shape),
            layer_norm.backward_launch(dy, x),
        )
    if op == "add_rms_norm":
        residual, ds = named["residual"].reshape(x.shape), torch.randn_like(x)
        _, s, rstd = rms_norm.rms_norm_forward(x, weight, EPS, 0.0, "llama", residual=residual)
        return NormLaunchers(
            lambda launch: rms_norm.rms_norm_forward(x, weight, EPS, 0.0, "llama", residual=residual, launch=launch),
            lambda launch: rms_norm.rms_norm_backward(dy, s, weight, rstd, 0.0, ds=ds, launch=launch),
            runtime.row_launch(*x.shape),
            rms_norm.backward_launch(dy, s, ds),
        )
    _, rstd = rms_norm.rms_norm_forward(x, weight, EPS, 0.0, "llama")
    return NormLaunchers(
        lambda launch: rms_norm.rms_norm_forward(x, weight, EPS, 0.0, "llama", launch=launch),
        lambda launch: rms_norm.rms_norm_backward(dy, x, weight, rstd, 0.0, launch=launch),
        runtime.row_launch(*x.shape),
        rms_norm.backward_launch(dy, x),
    )


def norm_cases(op: str, settings: Settings, quick: bool, dtype: torch.dtype) -> list[Case]:
    shape, inputs = table_inputs(op, quick, dtype)
    n_rows, n_cols = math.prod(shape[:-1]), shape[-1]
    block_n = triton.next_power_of_2(n_cols)
    launchers = norm_launchers(op, inputs)
    spec = TABLE[op]
    fwd_bytes = _bytes(op, shape, spec.fwd_passes, dtype)
    bwd_bytes = _bytes(op, shape, spec.full_passes - spec.fwd_passes, dtype)
    tiled = [
        (f"rows={rows} warps={warps}", runtime.RowLaunch(block_n, rows, warps, triton.cdiv(n_rows, rows)))
        for rows, warps in settings.norm_forward
    ]
    persistent = [
        (
            f"rows={rows} warps={warps} per_sm={per_sm} stages={stages}",
            runtime.RowLaunch(
                block_n, rows, warps, min(triton.cdiv(n_rows, rows), per_sm * runtime.sm_count()), stages
            ),
        )
        for rows, warps, per_sm, stages in settings.norm_backward
    ]
    return [
        *setting_cases(op, "forward", launchers.forward, launchers.forward_default, tiled, fwd_bytes),
        *setting_cases(op, "backward", launchers.backward, launchers.backward_default, persistent, bwd_bytes),
    ]


def cross_entropy_cases(settings: Settings, quick: bool, dtype: torch.dtype) -> list[Case]:
    """The default call's kernel: loss and gradient into a fresh buffer, the mean's 1/n read on the GPU."""
    shape, (logits, target) = table_inputs("cross_entropy", quick, dtype)
    n_rows, vocab = shape
    options = formulas.LossOptions()
    counts = cross_entropy.count_targets(target, vocab, options.ignore_index)
    loss, grad = torch.empty(n_rows, device=logits.device), torch.empty_like(logits)

    def launch_with(launch: runtime.RowLaunch | None) -> tuple[torch.Tensor, torch.Tensor]:
        cross_entropy.cross_entropy_rows(
            logits, target, loss, options, grad=grad, counts=counts, divide_by_count=True, launch=launch
        )  # fmt: skip
        return loss, grad

    default = runtime.streaming_row_launch(n_rows, vocab)
    min_bytes = _bytes("cross_entropy", shape, TABLE["cross_entropy"].full_passes, dtype)
    return setting_cases("cross_entropy", "loss+gradient", launch_with, default, streaming_tiles(settings, *shape),
                         min_bytes)  # fmt: skip


def streaming_tiles(settings: Settings, n_rows: int, n_cols: int) -> list[tuple[str, runtime.RowLaunch]]:
    """The streaming settings (columns per step, rows, warps) as launches over rows of ``n_cols``."""
    full_row = triton.next_power_of_2(n_cols)
    return [
        (
            f"block_n={block_n} rows={rows} warps={warps}",
            runtime.RowLaunch(min(block_n, full_row), rows, warps, triton.cdiv(n_rows, rows)),
        )
        for block_n, rows, warps in settings.streaming
    ]


JSD_BETAS = (0.5, 0.0, 1.0)
"""The JSD kernel's three divergences: the mixture, KL(P||Q) and KL(Q||P)."""


def jsd_cases(settings: Settings, quick: bool, dtype: torch.dtype) -> list[Case]:
    """The JSD kernel per divergence: each row's loss and its gradient, scaled by a factor read on the GPU."""
    shape, (student, teacher, target) = table_inputs("jsd", quick, dtype)
    loss, grad = torch.empty(shape[0], device=student.device), torch.empty_like(student)
    scale = torch.ones((), device=student.device)
    default = runtime.streaming_row_launch(*shape, gpu_tile=jsd.GPU_TILE)
    cases = []
    for beta in JSD_BETAS:

        def launch_with(launch: runtime.RowLaunch, beta: float = beta) -> tuple[torch.Tensor, torch.Tensor]:
            options = formulas.JSDOptions(beta=beta)
            jsd.jsd_rows(student, teacher, target, loss, options, grad=grad, grad_scale=scale, launch=launch)
            return loss, grad

        # Fewest passes: read both inputs once (twice for the mixture, whose M needs both first) and write the grad.
        passes = 5 if 0.0 < beta < 1.0 else 3
        min_bytes = profiling.bytes_moved(student.numel(), passes, dtype)
        cases += setting_cases("jsd", f"beta={beta:g}", launch_with, default, streaming_tiles(settings, *shape),
                               min_bytes)  # fmt: skip
    return cases


def rope_cases(settings: Settings, quick: bool, dtype: torch.dtype) -> list[Case]:
    shape, (q, k, cos, sin) = table_inputs("rope", quick, dtype)
    head_dim = shape[-1]
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)

    def launch_with(tile: rope.RopeTile) -> tuple[torch.Tensor, ...]:
        q_out, k_out, dq, dk = (torch.empty_like(t) for t in (q, k, q, k))
        rope.rope_rotate(q, k, cos, sin, q_out, k_out, backward=False, tile=tile)
        rope.rope_rotate(dq_out, dk_out, cos, sin, dq, dk, backward=True, tile=tile)
        return q_out, k_out, dq, dk

    tiles = [
        (f"block_r={rows} warps={warps}", rope.rope_tile(head_dim, block_r=rows, num_warps=warps))
        for rows, warps in settings.rope
    ]
    min_bytes = _bytes("rope", shape, TABLE["rope"].full_passes, dtype)
    return setting_cases("rope", "forward+backward", launch_with, rope.rope_tile(head_dim), tiles, min_bytes)


def glu_cases(settings: Settings, quick: bool, dtype: torch.dtype) -> list[Case]:
    shape, (gate, up) = table_inputs("swiglu", quick, dtype)
    dout = torch.randn_like(gate)
    n = gate.numel()

    def launch_with(launch: runtime.ElementwiseLaunch) -> tuple[torch.Tensor, ...]:
        out = glu.glu_forward(gate, up, "silu", launch=launch)
        return out, *glu.glu_backward(dout, gate, up, "silu", in_place=False, launch=launch)

    blocks = [
        (f"block={block} warps={warps}", runtime.ElementwiseLaunch(block, warps, triton.cdiv(n, block)))
        for block, warps in settings.elementwise
    ]
    min_bytes = _bytes("swiglu", shape, TABLE["swiglu"].full_passes, dtype)
    return setting_cases("swiglu", "forward+backward", launch_with, runtime.elementwise_launch(n), blocks, min_bytes)


def setting_cases(
    op: str, kernel: str, launch_with: Launcher, default: object, variants: list[tuple[str, object]], min_bytes: int
) -> list[Case]:
    """The default setting first, then each variant (one equal to the default is not repeated)."""
    cases = [Case(op, kernel, "default", _as_dict(default), lambda: launch_with(default), min_bytes, default=True)]
    for setting, config in variants:
        if config != default:
            cases.append(Case(op, kernel, setting, _as_dict(config), lambda c=config: launch_with(c), min_bytes))
    return cases


def _as_dict(config: object) -> dict:
    return config._asdict() if isinstance(config, tuple) else asdict(config)


def same_output(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> bool:
    """Within 1% of each expected tensor's largest magnitude: a setting may only change the order of sums."""
    return all(
        bool((a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max())
        for a, b in zip(got, expected, strict=True)
    )


def wrong_settings(cases: Sequence[Case]) -> dict[int, str]:
    """Why a case is not timed, by index: its launch fails (a tile past the registers or shared memory), or its
    output differs from its kernel's default (which comes first).

    Every case runs once before any is timed: a timed launch would leave correct outputs in memory that a later
    launch may get back, hiding elements that launch never writes. Here every tensor a case allocates starts as NaN
    (PyTorch's ``fill_uninitialized_memory``), and each output is overwritten with NaN once copied, so such elements
    show whatever memory the allocator hands back."""
    with _uninitialized_memory_filled():
        return _wrong_settings(cases)


@contextlib.contextmanager
def _uninitialized_memory_filled() -> Iterator[None]:
    """``torch.empty`` and its kin fill what they allocate (NaN for floats) inside the block."""
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    filled = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)  # the switch fill_uninitialized_memory needs
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = filled
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


def _wrong_settings(cases: Sequence[Case]) -> dict[int, str]:
    expected, wrong = {}, {}
    for index, case in enumerate(cases):
        try:
            written = case.call()
        except Exception as error:  # a setting this GPU cannot launch is a result, not the end of the sweep
            wrong[index] = f"launch failed: {type(error).__name__}: {error}"
            continue
        output = [t.clone() for t in written]
        for tensor in written:
            tensor.fill_(math.nan)
        if case.default:
            expected[case.op, case.kernel] = output
        elif not same_output(output, expected[case.op, case.kernel]):
            wrong[index] = "output differs from the default setting's"
    return wrong


def run(cases: Sequence[Case]) -> list[dict]:
    """Time each setting that computes what its kernel's default does, printing each row as it finishes."""
    rows, wrong = [], wrong_settings(cases)
    for index, case in enumerate(cases):
        row = {"op": case.op, "kernel": case.kernel, "setting": case.setting, "config": case.config,
               "default": case.default}  # fmt: skip
        if index in wrong:
            print(f"{case.op:<14}{case.kernel:<18}{case.setting:<34} not timed: {wrong[index][:200]}", flush=True)
            rows.append({**row, "error": wrong[index]})
            continue
        ms, timer = profiling.gpu_time_ms(case.call)
        gbs = profiling.achieved_gbs(case.min_bytes, ms)
        rows.append({**row, "ms": round(ms, 4), "gbs": round(gbs, 1), "timer": timer})
        bandwidth = "" if runtime.INTERPRET else f"{gbs:7.0f} GB/s"
        mark = "  (default)" if case.default else ""
        print(f"{case.op:<14}{case.kernel:<18}{case.setting:<34}{ms:9.4f} ms {bandwidth}  {timer}{mark}", flush=True)
        torch.cuda.empty_cache() if not runtime.INTERPRET else None
    return rows


def fastest(rows: Sequence[dict]) -> list[str]:
    """Per kernel: the fastest setting and its time against the default's."""
    lines = []
    for op, kernel in dict.fromkeys((r["op"], r["kernel"]) for r in rows):
        timed = [r for r in rows if (r["op"], r["kernel"]) == (op, kernel) and "ms" in r]
        best = min(timed, key=lambda r: r["ms"])
        default = next(r for r in timed if r["default"])
        config = " ".join(f"{key}={value}" for key, value in best["config"].items())
        lines.append(f"{op} {kernel}: fastest {config} at {best['ms']:.4f} ms, "
                     f"{best['ms'] / default['ms']:.2f}x the default's {default['ms']:.4f} ms")  # fmt: skip
    return lines


def cases_of(groups: Sequence[str], quick: bool) -> list[Case]:
    settings = QUICK_SETTINGS if quick else GPU_SETTINGS
    dtype = runtime.pick(cpu=torch.float32, gpu=torch.bfloat16)  # bf16 on the GPU; fp32 on CPU, quicker
    cases = []
    for op in NORMS:
        cases += norm_cases(op, settings, quick, dtype) if "norms" in groups or op in groups else []
    builders = {"cross_entropy": cross_entropy_cases, "jsd": jsd_cases, "rope": rope_cases, "glu": glu_cases}
    for group, build in builders.items():
        cases += build(settings, quick, dtype) if group in groups else []
    return cases


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=GROUPS + NORMS, action="append",
                        help="kernels to sweep, a group or one norm (repeatable; default all)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one setting per kernel besides the default")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if runtime.INTERPRET and not args.quick:
        raise SystemExit("sweep_tiles times the protocol shapes on a GPU; --quick runs tiny ones here")
    print(runtime.describe(), flush=True)
    rows = run(cases_of(args.only or GROUPS, args.quick))
    print("\n".join(fastest(rows)))
    if args.json:
        results.write_rows(rows, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
