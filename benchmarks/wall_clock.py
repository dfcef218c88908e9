"""The user's wall clock, eager and compiled, beside the peers, in one run (GPU).

    python -m benchmarks.wall_clock ops --json benchmarks/results/h200-wall-clock-ops.json
    python -m benchmarks.wall_clock e2e --json benchmarks/results/h200-wall-clock-e2e.json
    python -m benchmarks.wall_clock lengths --json benchmarks/results/h200-wall-clock-lengths.json

``ops``: every row op of the table and the fused linear cross-entropy, at the protocol shape and at a host-bound
shape (the ``small`` preset's widths, 4096 tokens), each implementation in this one process: ``liger_lab`` (the
default call), Liger-Kernel and eager PyTorch of the reference formula, and the labelled variant
``liger_lab:triton_launch`` (every launch through ``kernel[grid]``, as before launches skipped Triton's launch
path). Per forward+backward call: the wall time of a loop of calls with one synchronisation at the end (what a user
without CUDA graphs waits), the host's CPU time per call in that loop (the median of 5 rounds, the implementations
of one shape taking turns round by round), and the GPU time (the profiler's kernel sum).

``e2e``: training steps of the ``small`` preset (DESIGN's round-4 protocol: Llama-style, hidden 768, 8 layers, vocab
32000, AdamW fused, bf16) at 4 x 1024 and 8 x 512 in every mode, each run in a fresh process: ms per step, tokens/s,
peak memory over the timed steps, host CPU time per step (every thread of the process) and GPU time per step (the
kernel sum of two profiled steps). ``lengths``: the compiled modes over 10 new sequence lengths (384..1536, batch 4,
each length met twice, the second pass timed) with the graphs Dynamo compiled. ``e2e --variants`` adds labelled rows:
``liger_lab+compile:kernels`` compiles every op as its operator (:func:`liger_lab.ops.operators.kernels_under_compile`),
``:chunk=N`` sets the fused loss's chunk of tokens, ``+compile:reduce-overhead`` compiles Hugging Face's model and the
patched one with ``mode="reduce-overhead"`` (the graphs replayed as CUDA graphs; ``cudagraph_skips`` counts the graphs
Inductor left out of them, whose reasons ``TORCH_LOGS=perf_hints`` prints). ``--variants LABEL ...`` runs only the
variants whose label contains a LABEL, ``--no-defaults`` leaves out the default modes' rows:

    python -m benchmarks.wall_clock e2e --variants reduce-overhead --no-defaults --json ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import liger_lab  # noqa: F401  (first: it chooses the GPU or the interpreter before triton is imported)
from liger_lab import bench, profiling, runtime
from liger_lab.e2e.isolation import run_isolated
from liger_lab.e2e.presets import model_config
from liger_lab.e2e.training import (
    MODES,
    apply_mode,
    build_model,
    make_optimizer,
    peak_memory_gib,
    random_batch,
    reset_peak_memory,
    train_step,
)
from liger_lab.ops import operators
from liger_lab.runtime import device
from liger_lab.workbook import results

HOST_BOUND_SHAPES = {
    "rms_norm": (4096, 768),
    "add_rms_norm": (4096, 768),
    "layer_norm": (4096, 768),
    "rope": (8, 12, 12, 512, 64),
    "swiglu": (4096, 3072),
    "geglu": (4096, 3072),
    "cross_entropy": (4096, 32000),
    "fused_linear_cross_entropy": (4096, 768, 32000),
}
"""A shape per op where the GPU's work is a few microseconds per kernel: the host's time decides the wall clock."""
Report = Callable[[dict], None]
IMPLS = ("liger_lab", "liger", "eager")
E2E_RUNS = tuple((mode, batch, seq, {}) for batch, seq in ((4, 1024), (8, 512)) for mode in MODES)
VARIANT_RUNS = (
    ("hf+compile", 4, 1024, {"compile_mode": "reduce-overhead"}),
    ("liger_lab+compile", 4, 1024, {"compile_mode": "reduce-overhead"}),
    ("hf+compile", 8, 512, {"compile_mode": "reduce-overhead"}),
    ("liger_lab+compile", 8, 512, {"compile_mode": "reduce-overhead"}),
    ("liger_lab+compile", 4, 1024, {"kernels": True}),
    ("liger_lab", 4, 1024, {"chunk": 1024}),
    ("liger_lab+compile", 4, 1024, {"chunk": 1024}),
    ("liger_lab", 4, 1024, {"chunk": 4096}),
)


def _grads(result: object, leaves: list[torch.Tensor], upstream: list[torch.Tensor]) -> None:
    outputs = [t for t in (result if isinstance(result, tuple) else (result,)) if t.requires_grad]
    torch.autograd.grad(outputs, leaves, upstream[: len(outputs)])


def time_calls(call: Callable[[], object], *, calls: int = 30, warmup: int = 5) -> tuple[float, float]:
    """(wall ms, host CPU us) per call of a loop of ``calls`` calls with one synchronisation at the end."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    cpu = time.process_time() - cpu
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls, cpu * 1e6 / calls


OP_ROUNDS = 5
"""Rounds of :func:`time_calls` per implementation and shape, the implementations taking turns round by round."""


def _op_call(spec, shape: tuple, build: Callable[[], Callable[..., object]]) -> Callable[[], None]:
    """One forward+backward call of an implementation on its own fresh inputs of ``shape`` (bf16)."""
    fn = build()
    inputs = spec.make_inputs(shape, torch.bfloat16)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    first = fn(*inputs)
    outputs = [o for o in (first if isinstance(first, tuple) else (first,)) if o.requires_grad]
    upstream = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outputs]
    del first, outputs
    return lambda: _grads(fn(*inputs), leaves, upstream)


@contextlib.contextmanager
def _launch_path(impl: str) -> Iterator[None]:
    """Within the block, launches take ``impl``'s path: the labelled variant goes through Triton's own launcher."""
    device._DIRECT_LAUNCHES = impl != "liger_lab:triton_launch"
    try:
        yield
    finally:
        device._DIRECT_LAUNCHES = True


def _timed(impl: str, call: Callable[[], object]) -> tuple[float, float]:
    with _launch_path(impl):
        return time_calls(call)


def _error(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error)[:300]}"


def op_rows(names: list[str], report: Report) -> None:
    """Per op and shape, every implementation's call built first, then timed in :data:`OP_ROUNDS` alternating rounds
    (so that a drift of the machine falls on all of them alike, not on whichever was timed first): the median round's
    wall and host time, and the GPU's kernel sum."""
    for name in names:
        spec = bench.OPS[name]
        for label, shape in (("protocol", spec.shape), ("host-bound", HOST_BOUND_SHAPES[name])):
            impls = {impl: build for impl, build in spec.impls.items() if impl in IMPLS}
            impls["liger_lab:triton_launch"] = impls["liger_lab"]
            base = {"op": "op_wall_clock", "of": name, "shape_kind": label, "shape": list(shape)}
            calls, rounds = {}, {}
            for impl, build in impls.items():
                if spec.unavailable_reason(impl.split(":")[0]) is not None:
                    continue
                try:
                    calls[impl] = _op_call(spec, shape, build)
                    _timed(impl, calls[impl])  # warm: compiles, autotunes, caches
                    rounds[impl] = []
                except Exception as error:  # one failing implementation must not hide the others' numbers
                    calls.pop(impl, None)
                    report({**base, "impl": impl, "error": _error(error)})
            for _ in range(OP_ROUNDS):
                for impl, call in list(calls.items()):
                    try:
                        rounds[impl].append(_timed(impl, call))
                    except Exception as error:
                        del calls[impl]
                        report({**base, "impl": impl, "error": _error(error)})
            for impl, call in calls.items():
                wall_ms, host_us = sorted(rounds[impl])[len(rounds[impl]) // 2]
                try:
                    with _launch_path(impl):
                        gpu_ms = runtime.measure_kernel_sum_ms(call, calls=3)
                except Exception as error:
                    report({**base, "impl": impl, "error": _error(error)})
                    continue
                report({**base, "impl": impl, "wall_ms": round(wall_ms, 4), "host_us": round(host_us, 1),
                        "gpu_ms": round(gpu_ms, 4), "rounds": OP_ROUNDS})  # fmt: skip
            del calls
            torch.cuda.empty_cache()


def step_row(
    mode: str, batch: int, seq: int, *, chunk: int | None, kernels: bool, compile_mode: str | None = None
) -> dict:
    """One training run of the small preset in ``mode`` (this process only: patching is global)."""
    from torch._dynamo.utils import counters

    config = model_config("small")
    label = variant_label(mode, kernels=kernels, chunk=chunk, compile_mode=compile_mode)
    row: dict = {"op": "e2e", "model": "small", "impl": label, "batch": batch}
    with operators.kernels_under_compile() if kernels else contextlib.nullcontext():
        model = build_model(config)
        apply_mode(model, mode, compile_mode=compile_mode, loss_chunk_tokens=chunk)
        optimizer = make_optimizer(model, 1e-4)
        tokens = random_batch(config, batch, seq, 0)
        losses = [train_step(model, optimizer, tokens) for _ in range(3)]
        torch.cuda.synchronize()
        graphs = counters["stats"]["unique_graphs"]
        reset_peak_memory()
        steps = 20
        start, cpu = time.perf_counter(), time.process_time()
        losses += [train_step(model, optimizer, tokens) for _ in range(steps)]
        cpu = time.process_time() - cpu
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        peak = peak_memory_gib()
        gpu_ms = runtime.measure_kernel_sum_ms(lambda: train_step(model, optimizer, tokens), calls=2)
    row.update(seq=seq, ms_per_step=round(1e3 * elapsed / steps, 2), tokens_per_s=round(batch * seq * steps / elapsed),
               peak_gib=peak, host_ms_per_step=round(1e3 * cpu / steps, 2), gpu_ms_per_step=round(gpu_ms, 2),
               graphs=graphs, timed_compiles=counters["stats"]["unique_graphs"] - graphs,
               loss0=round(losses[0].item(), 4), loss_last=round(losses[-1].item(), 4))  # fmt: skip
    if compile_mode == "reduce-overhead":
        row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
    return row


def run_child(args: list[str], timeout_s: float = 300) -> dict:
    command = [sys.executable, "-m", "benchmarks.wall_clock", "step", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"args": args, "error": f"timed out after {timeout_s} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"args": args, "error": done.stderr[-600:]}


def variant_label(
    mode: str, *, kernels: bool = False, chunk: int | None = None, compile_mode: str | None = None
) -> str:
    """The row label of a run: its mode, then its options (``liger_lab+compile:reduce-overhead``)."""
    label = mode + (":kernels" if kernels else "") + (f":chunk={chunk}" if chunk else "")
    return label + (f":{compile_mode}" if compile_mode else "")


def e2e_rows(
    report: Report, *, variants: list[str] | None = None, sizes: list[str] | None = None, defaults: bool = True
) -> None:
    """The default modes' rows (unless not ``defaults``), then the variants whose label contains one of ``variants``
    (every variant for an empty list, none for None)."""
    chosen = [
        run
        for run in VARIANT_RUNS
        if variants is not None and (not variants or any(v in variant_label(run[0], **run[3]) for v in variants))
    ]
    for mode, batch, seq, options in (E2E_RUNS if defaults else ()) + tuple(chosen):
        if sizes and f"{batch}x{seq}" not in sizes:
            continue
        if mode.startswith("liger+") or (mode == "liger" and not profiling.liger_kernel_installed()):
            continue
        args = ["--mode", mode, "--batch", str(batch), "--seq", str(seq)]
        args += ["--chunk", str(options["chunk"])] if "chunk" in options else []
        args += ["--kernels"] if options.get("kernels") else []
        args += ["--compile-mode", options["compile_mode"]] if "compile_mode" in options else []
        report(run_child(args))


def length_rows(report: Report, modes: list[str]) -> None:
    """The compiled modes over DESIGN's 10 new lengths (:func:`liger_lab.e2e.training.train_lengths`)."""
    for mode in modes:
        report(run_isolated("lengths", mode=mode, model="small", batch=4, seq=0, timeout_s=400))


def environment() -> dict:
    """What every row carries: versions, the GPU's clocks, the date and the commit measured (``LIGER_LAB_COMMIT``
    where the checkout is a copy without the repository's history, as on a lent GPU machine)."""
    import transformers

    clocks = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    commit = os.environ.get("LIGER_LAB_COMMIT") or results.commit()
    return {**profiling.environment(), "transformers": transformers.__version__, "clocks_sm_max_mem": clocks,
            "timer": "synchronized_loop",
            "time": time.strftime("%H:%M UTC", time.gmtime()), "commit": commit}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("ops", "e2e", "lengths", "step"))
    parser.add_argument("--json", type=Path, help="write the rows here (a JSON list, rewritten as each row comes)")
    parser.add_argument("--ops", nargs="*", default=list(HOST_BOUND_SHAPES))
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--chunk", type=int)
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--compile-mode", help="step: torch.compile's mode of a +compile mode (reduce-overhead)")
    parser.add_argument(
        "--variants",
        nargs="*",
        metavar="LABEL",
        help="e2e: also the rows behind the defaults' choices (with LABELs: those whose label contains one)",
    )
    parser.add_argument("--no-defaults", action="store_true", help="e2e: only the variants")
    parser.add_argument("--sizes", nargs="*", help="e2e: only these batch x seq sizes, e.g. 4x1024")
    parser.add_argument("--modes", nargs="*", default=["hf+compile", "liger_lab+compile"], help="lengths: the modes")
    args = parser.parse_args(argv)
    if runtime.INTERPRET:
        raise SystemExit("wall_clock.py measures a GPU's wall clock: run it on a machine with CUDA")
    if args.part == "step":
        row = step_row(
            args.mode, args.batch, args.seq, chunk=args.chunk, kernels=args.kernels, compile_mode=args.compile_mode
        )
        print(json.dumps(row), flush=True)
        return

    shared, rows = environment(), []

    def report(row: dict) -> None:  # each row as it comes: a run cut short keeps what it measured
        rows.append({**row, "commit": shared["commit"]})
        print(json.dumps(row), flush=True)
        if args.json:
            results.write_rows(rows, args.json, environment=shared)

    if args.part == "ops":
        op_rows(args.ops, report)
    elif args.part == "e2e":
        e2e_rows(report, variants=args.variants, sizes=args.sizes, defaults=not args.no_defaults)
    else:
        length_rows(report, args.modes)


if __name__ == "__main__":
    main()
