"""liger_lab's default call against Liger-Kernel (and torch.compile) over a ladder of shapes: where is it slower?

    python -m benchmarks.sweep_shapes --json shapes.json --plot shapes.png --resume   # again until every shape is done
    python -m benchmarks.sweep_shapes --op rms_norm --op cross_entropy --compile --json out.json
    python -m benchmarks.sweep_shapes --quick --impl liger_lab --impl eager    # tiny shapes: checks the script

Ops and shapes (bf16, forward+backward; tokens 2048, 8192, 32768 and 65536):

- rms_norm, add_rms_norm, layer_norm: tokens x hidden, hidden 2048, 4096 and 8192;
- rope: Llama's heads of 128 (hidden / 128 query heads, a quarter as many key heads), sequences of up to 4096
  positions, tokens / sequence length of them;
- swiglu, geglu: tokens x 3.5 hidden (Llama's MLP: 14336 at hidden 4096);
- cross_entropy: tokens x vocabulary, vocabularies 32000 (Llama 2), 151936 (Qwen) and 262144 (Gemma 3);
- fused_linear_cross_entropy: 8192 tokens, hidden 2048 and 4096, the same vocabularies.

A shape whose inputs would not fit in ``--memory-gib`` (100) while they are made is skipped. Each implementation is
measured by :mod:`liger_lab.bench`, on the protocol's clock (CUDA-graph replay where capture works, else the
kernel sum under ``torch.profiler``; wall time of a call beside it), and printed as it finishes; a peer's line
gives liger_lab's time over its own. ``--json`` is rewritten after every shape (rows with the GPU, versions, date
and commit, :func:`liger_lab.workbook.results.write_rows`), so a command stopped at its time limit keeps what it
measured; ``--resume`` keeps that file's rows and measures only what they lack (a failed measurement is not
retried). ``--budget-s`` starts no shape whose estimated time would end past it. ``--plot`` draws
:func:`liger_lab.bench.plot_shape_sweep` of the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # a script that writes files: never open a window

import liger_lab  # noqa: E402, F401  (chooses GPU or interpreter before triton is imported)
from liger_lab import bench, profiling, runtime  # noqa: E402
from liger_lab.workbook.results import write_rows  # noqa: E402

OPS = ("rms_norm", "add_rms_norm", "layer_norm", "rope", "swiglu", "geglu", "cross_entropy",
       "fused_linear_cross_entropy")  # fmt: skip
# The table draws inputs in fp32 and scales them (two fp32 tensors) before rounding them to bf16; bf16 inputs and
# their gradients take 4 bytes an element after that.
BYTES_PER_INPUT_ELEMENT = 8
# What one measurement costs, to plan a run against its time limit: graph capture and replays, profiler traces and
# the wall clock take a few seconds whatever the op, plus about this many calls of an op that runs long. The op's
# time is guessed from its fewest bytes or FLOPs at a little under an H200's measured ceilings.
SECONDS_PER_MEASUREMENT = 3.5
CALLS_PER_MEASUREMENT = 40
COMPILE_S = 30.0
NOMINAL_GBS, NOMINAL_TFLOPS = 3000.0, 500.0


@dataclass(frozen=True)
class Ladder:
    hiddens: tuple[int, ...]
    tokens: tuple[int, ...]
    vocabs: tuple[int, ...]
    loss_hiddens: tuple[int, ...]
    """Hidden sizes of the fused linear cross-entropy."""
    loss_tokens: int
    """Tokens of the fused linear cross-entropy."""
    head_dim: int
    max_seq: int
    """RoPE's sequence length: the tokens, up to this many positions per sequence."""


GPU_LADDER = Ladder(hiddens=(2048, 4096, 8192), tokens=(2048, 8192, 32768, 65536), vocabs=(32000, 151936, 262144),
                    loss_hiddens=(2048, 4096), loss_tokens=8192, head_dim=128, max_seq=4096)  # fmt: skip
QUICK_LADDER = Ladder(hiddens=(32, 64), tokens=(8, 32), vocabs=(100, 300), loss_hiddens=(32,), loss_tokens=16,
                      head_dim=16, max_seq=16)  # fmt: skip


@dataclass(frozen=True)
class Point:
    """One op at one shape."""

    op: str
    shape: tuple[int, ...]
    series: str
    """The plot's line this shape belongs to, e.g. "hidden 4096"."""

    @property
    def elements(self) -> int:
        return bench.OPS[self.op].elements(self.shape)

    def input_elements(self) -> int:
        """Elements of the inputs that get a gradient (targets and RoPE's tables are small)."""
        if self.op == "fused_linear_cross_entropy":
            tokens, hidden, vocab = self.shape
            return (tokens + vocab) * hidden
        inputs = {"add_rms_norm": 2, "swiglu": 2, "geglu": 2}.get(self.op, 1)
        return inputs * self.elements  # RoPE's elements are those of q and k

    def estimate_s(self, impl: str) -> float:
        """Seconds one implementation's measurement is expected to take on an H200."""
        op = bench.OPS[self.op]
        if op.flops is not None:
            op_s = op.flops(self.shape) / (NOMINAL_TFLOPS * 1e12)
        else:
            op_s = profiling.bytes_moved(self.elements, op.full_passes) / (NOMINAL_GBS * 1e9)
        compile_s = COMPILE_S if impl == "torch_compile" else 0.0
        return SECONDS_PER_MEASUREMENT + CALLS_PER_MEASUREMENT * op_s + compile_s


def points(ops: Sequence[str], ladder: Ladder, memory_gib: float) -> tuple[list[Point], list[Point]]:
    """(the shapes to measure, those skipped because their inputs would not fit in memory while they are made)."""
    made = []
    for op in ops:
        if op == "fused_linear_cross_entropy":
            pairs = [(hidden, vocab) for hidden in ladder.loss_hiddens for vocab in ladder.vocabs]
            made += [Point(op, (ladder.loss_tokens, hidden, vocab), f"hidden {hidden}") for hidden, vocab in pairs]
        elif op == "cross_entropy":
            pairs = [(vocab, tokens) for vocab in ladder.vocabs for tokens in ladder.tokens]
            made += [Point(op, (tokens, vocab), f"vocab {vocab}") for vocab, tokens in pairs]
        else:
            pairs = [(hidden, tokens) for hidden in ladder.hiddens for tokens in ladder.tokens]
            made += [Point(op, _shape(op, tokens, hidden, ladder), f"hidden {hidden}") for hidden, tokens in pairs]
    fits = [p for p in made if p.input_elements() * BYTES_PER_INPUT_ELEMENT <= memory_gib * 2**30]
    return fits, [p for p in made if p not in fits]


def _shape(op: str, tokens: int, hidden: int, ladder: Ladder) -> tuple[int, ...]:
    if op == "rope":
        seq = min(tokens, ladder.max_seq)
        q_heads = hidden // ladder.head_dim
        return tokens // seq, q_heads, max(1, q_heads // 4), seq, ladder.head_dim
    if op in ("swiglu", "geglu"):
        return tokens, 7 * hidden // 2
    return tokens, hidden


def row_of(point: Point, result: profiling.Result) -> dict:
    """The sweep's row: the op, its shape and line, the forward+backward GPU time and its clock, wall time, peak."""
    return {
        "op": point.op, "impl": result.impl, "shape": list(point.shape), "series": point.series,
        "elements": point.elements, "gpu_ms": round(result.full_ms, 4), "clock": result.timer,
        "wall_ms": None if result.wall_ms is None else round(result.wall_ms, 4),
        "peak_mib": None if result.peak_mib is None else round(result.peak_mib, 1), "fwd_ms": round(result.fwd_ms, 4),
        "full_gbs": result.full_gbs, "full_tflops": result.full_tflops, "sweep": "shapes",
    }  # fmt: skip


def progress_line(point: Point, result: profiling.Result, ours: profiling.Result | None) -> str:
    """The result's line, with liger_lab's time over this one's when ``ours`` (liger_lab at this shape) is given."""
    shape = "x".join(map(str, point.shape))
    line = f"{shape:<24}{profiling.result_line(result)}"
    if ours is None:
        return line
    mixed = ", clocks differ" if ours.timer != result.timer else ""
    return f"{line}  liger_lab at {ours.full_ms / result.full_ms:.2f}x its time{mixed}"


def measure_point(point: Point, impls: Sequence[str], environment: dict) -> list[dict]:
    """Each implementation at one shape, its row printed as it finishes (liger_lab first, so that each peer's line
    gives the ratio); a failure is a row with its error."""
    rows, ours = [], None
    for impl in sorted(impls, key=lambda impl: impl != "liger_lab"):
        results, failures = bench.run_op_benchmarks([point.op], impls=[impl], shapes={point.op: point.shape})
        for result in results:
            print(progress_line(point, result, ours), flush=True)
            rows.append({**row_of(point, result), **environment})
        ours = next((r for r in results if r.impl == "liger_lab"), ours)
        for failure in failures:
            print(f"FAILED {failure}", file=sys.stderr, flush=True)
            rows.append({"op": point.op, "impl": impl, "shape": list(point.shape), "series": point.series,
                         "error": failure, "sweep": "shapes", **environment})  # fmt: skip
    return rows


def lost_device(error: str) -> bool:
    """Whether an implementation's error left the CUDA context unusable (an illegal memory access is sticky: every
    later launch of the process fails); running out of memory is not such an error."""
    return "CUDA error" in error or "Triton Error [CUDA]" in error


def job_s(job: tuple[Point, Sequence[str]]) -> float:
    """Estimated seconds of measuring these implementations at this shape."""
    point, impls = job
    return sum(map(point.estimate_s, impls))


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", action="append", choices=OPS, help="op to sweep (repeatable; default all)")
    impl_names = list(dict.fromkeys(impl for op in OPS for impl in bench.OPS[op].impls))
    parser.add_argument("--impl", action="append", choices=impl_names, help="repeatable; default liger_lab, liger")
    parser.add_argument("--compile", action="store_true", help="also torch.compile of the reference")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the interpreter runs them in seconds)")
    parser.add_argument("--memory-gib", type=float, default=100.0, help="skip shapes whose inputs need more to be made")
    parser.add_argument(
        "--budget-s", type=float, default=540.0,
        help="start no shape whose estimated end is past this many seconds from the start (one command: 10 minutes)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the rows here, after every shape")
    parser.add_argument("--resume", action="store_true", help="keep the rows of --json and skip their shapes")
    parser.add_argument("--plot", type=Path, help="save the plot of the rows here (PNG)")
    args = parser.parse_args(argv)
    if runtime.INTERPRET and not args.quick:
        raise SystemExit("sweep_shapes times large shapes on a GPU; --quick runs tiny ones here")
    if args.resume and not args.json:
        parser.error("--resume reads the rows of --json")

    impls = list(dict.fromkeys([*(args.impl or ["liger_lab", "liger"]), *(["torch_compile"] if args.compile else [])]))
    ops = args.op or list(OPS)
    runs_here = {op: [impl for impl in impls if impl in bench.OPS[op].available()] for op in ops}
    unavailable = [impl for impl in impls if not any(impl in of_op for of_op in runs_here.values())]
    todo, skipped = points(ops, QUICK_LADDER if args.quick else GPU_LADDER, args.memory_gib)
    rows = json.loads(args.json.read_text()) if args.resume and args.json.exists() else []
    done = {(r["op"], tuple(r["shape"]), r["impl"]) for r in rows}
    # (shape, the implementations it still lacks), cheapest first: a run cut short by its budget covers every op.
    jobs = [(p, [impl for impl in runs_here[p.op] if (p.op, p.shape, impl) not in done]) for p in todo]
    jobs = sorted(((p, missing) for p, missing in jobs if missing), key=job_s)

    print(runtime.describe())
    print(f"timer: {runtime.timer_label()}")
    for impl in unavailable:
        print(f"{impl}: not available here, no rows")
    for point in skipped:
        print(f"skipped {point.op} {point.shape}: its inputs need over {args.memory_gib:g} GiB to be made")
    measurements = sum(len(missing) for _, missing in jobs)
    print(f"{len(jobs)} shapes, {measurements} measurements to go ({len(done)} rows already in {args.json}): about "
          f"{sum(map(job_s, jobs)):.0f} s on an H200, budget {args.budget_s:.0f} s", flush=True)  # fmt: skip

    environment = profiling.environment()
    left, new_rows = list(jobs), []
    # Measured over estimated time so far: a cold compile cache, or another GPU, scales every estimate alike.
    scale, spent, estimated = 1.0, 0.0, 0.0
    while left and time.monotonic() - started + scale * job_s(left[0]) <= args.budget_s:
        job, begun = left.pop(0), time.monotonic()
        new_rows += measure_point(*job, environment)
        spent, estimated = spent + time.monotonic() - begun, estimated + job_s(job)
        scale = spent / estimated
        if args.json:
            write_rows(rows + new_rows, args.json)
        if any(lost_device(r.get("error", "")) for r in new_rows):
            print("a CUDA error leaves this process's GPU unusable: stopping; --resume continues after that shape")
            break
    rows += new_rows
    elapsed = time.monotonic() - started
    if left:
        remaining = scale * sum(map(job_s, left))
        print(f"stopped after {elapsed:.0f} s: {len(left)} shapes left (about {remaining:.0f} s); run again with "
              "--resume to continue")  # fmt: skip
    else:
        print(f"every shape is done ({elapsed:.0f} s)")
    if args.json:
        write_rows(rows, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        bench.plot_shape_sweep(rows).savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    return 1 if any("error" in r for r in new_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
