"""The ``liger-lab`` command line: check the kernels, benchmark them, regenerate the exercises.

The ops come from the one table, :data:`liger_lab.op_table.OPS`; the functions behind the commands
(:func:`liger_lab.op_checks.run_checks`, :func:`liger_lab.bench.run_op_benchmarks`) are importable too.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import click
import torch

from liger_lab import bench, profiling, runtime
from liger_lab.e2e import DTYPES
from liger_lab.e2e.isolation import environment_of, parse_shape, parse_sizes, run_isolated
from liger_lab.e2e.memory import count_parameters, format_breakdown, memory_breakdown
from liger_lab.e2e.presets import MODEL_SIZES, default_dtype, model_config
from liger_lab.e2e.reports import (
    RUN_HEADER,
    TARGET_MODE,
    check_targets,
    compare_losses,
    format_comparison,
    format_fit,
    format_lengths,
    format_losses,
    format_reference,
    format_run,
    format_targets,
    plot_runs,
    plot_timelines,
)
from liger_lab.e2e.training import MODES, available_modes, base_mode, is_compiled, timer_label, varying_lengths
from liger_lab.hf import FAMILIES
from liger_lab.op_checks import CHECK_OPS, format_checks, run_checks
from liger_lab.workbook.results import write_rows

IMPLS = list(dict.fromkeys(impl for op in bench.OPS.values() for impl in op.impls))


def _repeatable(flag: str, name: str, choices: click.ParamType, help_text: str) -> Callable[[Callable], Callable]:
    """A click option that may be given several times: the command receives the tuple ``name`` of its values
    (empty when it is not given, which each command reads as its default set)."""
    return click.option(flag, name, multiple=True, type=choices, help=help_text)


# --------------------------------------------------------------------------------------------------
# bench ops


# --------------------------------------------------------------------------------------------------
# commands


EXAMPLES = """Examples:

\b
  liger-lab check                              every kernel against float64
  liger-lab check --op rms_norm -v             one op, every comparison printed
  liger-lab bench ops --op rms_norm --json rms.json --plot rms.png
  liger-lab bench e2e --breakdown              train the 1.5B model per mode
  liger-lab bench e2e --batch 16 --seq 4096 --fit 8x2048,16x4096,32x4096
  liger-lab bench e2e --model qwen3-1.5b --model gemma3-1.5b --mode hf --mode liger --mode liger_lab --reference liger
  liger-lab bench kernels fused_linear_jsd --impl liger   kernel by kernel (GPU)
  liger-lab exercises                          regenerate chapters/
  liger-lab workbook --ip 0.0.0.0 --port 8890  serve chapters/ (prints the URL with its token)
"""


@click.group(epilog=EXAMPLES)
@click.version_option(package_name="liger-lab")
def main() -> None:
    """Fused Triton kernels for LLM training: check them, benchmark them, regenerate the exercises.

    Without a CUDA GPU every kernel runs in Triton's interpreter on CPU tensors (exact but slow), and
    the commands pick small shapes.
    """


@main.command(short_help="Check every kernel and its gradients against float64.")
@_repeatable("--op", "ops", click.Choice(CHECK_OPS), "Op to check (repeatable; default: all).")
@click.option("-v", "--verbose", is_flag=True, help="Print every output and gradient comparison.")
def check(ops: tuple[str, ...], verbose: bool) -> None:
    """Check every kernel and its gradients against the float64 reference on this machine.

    Small shapes in fp32 and fp16 in the interpreter; larger shapes in fp32 and bf16 on the GPU.
    Exit code 1 when any check fails.
    """
    click.echo(runtime.describe())
    results = run_checks(ops or CHECK_OPS)
    click.echo(format_checks(results))
    failed = [r for r in results if r.status == "FAIL"]
    for r in results:
        if r.status == "FAIL" or (verbose and r.status == "PASS"):
            click.echo(f"\n{r.op} {r.dtype}:\n{r.detail}")
    click.echo(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    if failed:
        sys.exit(1)


@main.command(name="patch", short_help="What liger_lab.patch fuses in a model family, and what it leaves alone.")
@click.argument("model_type", type=click.Choice(sorted(FAMILIES)), metavar="MODEL_TYPE")
@click.option("--dry-run", is_flag=True, help="Accepted for older scripts: the command only ever reports.")
def patch_command(model_type: str, dry_run: bool) -> None:
    """Build a tiny random MODEL_TYPE model (nothing downloaded), patch it and print what was fused, per kind
    and count, and what was left alone and why. A family whose transformers classes no longer match fails
    here with the error patching would raise. Nothing is patched outside this command's own process."""
    import transformers

    import liger_lab

    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    if hasattr(config, "vision_config") or FAMILIES[model_type].vision_encoder:
        # A vision tower's default config is full size (hundreds of millions of parameters), and its tiny sizes
        # differ per family: no one set of sizes builds them all small.
        kind = "vision encoder" if FAMILIES[model_type].vision_encoder else "vision-language family"
        raise click.UsageError(
            f"{model_type} is a {kind}: this command builds tiny text models only. In Python, "
            "build the model from a config with a small vision tower and print "
            "liger_lab.patch_report(liger_lab.patch(model))."
        )
    model = transformers.AutoModelForCausalLM.from_config(config)
    click.echo(liger_lab.patch_report(liger_lab.patch(model)))


@main.command(name="doctor", short_help="Before a full run: profile, patch, check and train your model at your shapes.")
@click.argument("model", type=click.Path(exists=True, path_type=Path))
@click.option("--batch", type=click.IntRange(min=1), help="Batch size [default: 8 on GPU, 1 on CPU].")
@click.option("--seq", type=click.IntRange(min=1), help="Sequence length [default: 2048 on GPU, 16 on CPU].")
@click.option("--dtype", type=click.Choice(list(DTYPES)), help="[default: bf16 on GPU, fp32 on CPU]")
@click.option(
    "--steps", type=click.IntRange(min=2), help="Training steps per model, the first untimed [default: 6 GPU, 3 CPU]."
)
@click.option("--max-batch", type=click.IntRange(min=1), help="Also find the largest batch up to this that fits (GPU).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write everything here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="Plot memory here (GPU).")
def doctor_command(model, batch, seq, dtype, steps, max_batch, json_path, plot_path) -> None:
    """Check liger_lab on MODEL (a local model directory, whose weights are loaded when it has any, or a
    config.json: random weights) at the run's own batch, sequence length and dtype, before a full run.
    Nothing is downloaded; the data are random tokens.

    \b
    1. the unpatched training step profiled: time per category, each replaceable op's share, peak memory by phase;
    2. what liger_lab.patch replaces and what it leaves alone, and why;
    3. every replaced module (and the loss) against transformers' in float64, on its inputs of one forward;
    4. the patched step: tokens/s, peak memory, every step's loss against the unpatched model's, fallbacks;
    5. the verdict. Exit code 1 when a check failed or the loss curves disagree.
    """
    from liger_lab.doctor import prepare, run

    try:
        plan = prepare(
            model,
            batch=batch,
            seq=seq,
            dtype=dtype,
            steps=steps,
            max_batch=max_batch,
            json_path=json_path,
            plot_path=plot_path,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    if not run(plan, progress=click.echo).ok:
        sys.exit(1)


@main.group(name="bench", short_help="Benchmark single ops or end-to-end training.")
def bench_group() -> None:
    """Benchmarks: single ops (the benchmark protocol) and end-to-end training."""


def _op_shape(op: str, text: str) -> tuple[int, ...]:
    """--shape for ``op``: as many sizes as its protocol shape has."""
    try:
        sizes = parse_sizes(text)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--shape") from None
    expected = bench.OPS[op].shape
    if len(sizes) != len(expected):
        example = "x".join(map(str, expected))
        raise click.BadParameter(
            f"{op} takes {len(expected)} sizes like its protocol shape {example}, got {text!r}", param_hint="--shape"
        )
    return sizes


@bench_group.command("ops", short_help="Time and measure every op, every implementation.")
@_repeatable("--op", "ops", click.Choice(list(bench.OPS)), "Op (repeatable; default: all).")
@_repeatable("--impl", "impls", click.Choice(IMPLS), "Implementation (repeatable; default: every one available here).")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="bf16", show_default=True)
@click.option("--small", is_flag=True, help="Small shapes even on the GPU (always small in the interpreter).")
@click.option("--shape", metavar="AxBx...", help="One shape for every op chosen, e.g. 8192x4096 for a norm.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write result rows here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="Save a plot here.")
def bench_ops(ops, impls, dtype, small, shape, json_path, plot_path) -> None:
    """Time forward and forward+backward and measure peak memory of each op, every implementation.

    On the GPU: the protocol shapes (norms 16384 x 4096, ...), GPU time by CUDA-graph replay or the kernel sum
    under torch.profiler, with the wall time of a call beside it. In the interpreter: small shapes and a CPU wall
    clock that says nothing about GPU speed. Each implementation is printed as it finishes, then the table.
    """
    ops = ops or list(bench.OPS)
    shapes = {name: _op_shape(name, shape) for name in ops} if shape else None
    click.echo(runtime.describe())
    results, failures = bench.run_op_benchmarks(
        ops, impls=impls, dtype=DTYPES[dtype], shapes=shapes, small=small,
        report=lambda result: click.echo(profiling.result_line(result)),
    )  # fmt: skip
    click.echo()
    for line in failures:
        click.echo(f"FAILED {line}", err=True)
    if not results:
        raise click.ClickException("nothing was measured" + (": see the reasons above" if failures else ""))
    profiling.print_table(results)
    if json_path:
        write_rows([{**r.as_row(), "dtype": dtype} for r in results], json_path)
        click.echo(f"wrote {json_path}")
    if plot_path:
        bench.plot_ops(results).savefig(plot_path, dpi=120, bbox_inches="tight")
        click.echo(f"wrote {plot_path}")
    if failures:
        sys.exit(1)


def _pair_sizes(batches: Sequence[int], seqs: Sequence[int]) -> list[tuple[int, int]]:
    """--batch 8 --seq 2048 --batch 16 --seq 4096 -> [(8, 2048), (16, 4096)]; a single value pairs with all."""
    batches = list(batches) * (len(seqs) if len(batches) == 1 else 1)
    seqs = list(seqs) * (len(batches) if len(seqs) == 1 else 1)
    if len(batches) != len(seqs):
        raise click.BadParameter("give one --seq per --batch (or a single one of either)")
    return list(zip(batches, seqs, strict=True))


class _Children:
    """The e2e command's child processes: each row kept (and written to --json as it comes, so a run cut short keeps
    what it measured), each child killed at --timeout-s or at the end of --budget-s, none started past the budget."""

    def __init__(self, timeout_s: float | None, budget_s: float | None, json_path: Path | None) -> None:
        self.timeout_s, self.json_path = timeout_s, json_path
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.rows: list[dict] = []

    def run(self, task: str, **options: object) -> dict:
        timeout_s = self.timeout_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            timeout_s = left if timeout_s is None else min(timeout_s, left)
        row = run_isolated(task, timeout_s=timeout_s, **options)
        self.rows.append(row)
        if self.json_path:
            write_rows(self.rows, self.json_path, environment=environment_of(self.rows))
        return row


@bench_group.command("e2e", short_help="Train model presets per mode: tokens/s, peak memory, the loss of every step.")
@_repeatable(
    "--mode",
    "modes",
    click.Choice(list(MODES)),
    "Training mode (repeatable; default: every one available here). +compile: then torch.compile the model.",
)
@_repeatable(
    "--model",
    "models",
    click.Choice(sorted(MODEL_SIZES)),
    "Model preset (repeatable) [default: 1.5b on GPU, tiny on CPU].",
)
@click.option("--layers", type=click.IntRange(min=1), help="Override the number of decoder layers.")
@_repeatable("--batch", "batches", click.IntRange(min=1), "Batch size [default: 8 on GPU, 2 on CPU].")
@_repeatable(
    "--seq",
    "seqs",
    click.IntRange(min=1),
    "Sequence length [default: 2048 on GPU, 16 on CPU]. Repeat --batch and --seq for several sizes.",
)
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True, help="Timed steps.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed steps first.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), help="[default: bf16 on GPU, fp32 on CPU]")
@click.option("--breakdown", is_flag=True, help="First print the analytic memory breakdown.")
@click.option(
    "--fit",
    "fit_sizes",
    default="",
    metavar="BxT,BxT,...",
    help="Also find, per mode, the largest of these sizes that trains without running out of memory.",
)
@click.option(
    "--reference",
    type=click.Choice(list(MODES)),
    help="Also set every mode against this one (e.g. liger): tokens/s, peak, largest fit, liger_lab's targets.",
)
@click.option(
    "--timeout-s", type=click.FloatRange(min=0, min_open=True), help="Kill a run still going after this many seconds."
)
@click.option(
    "--budget-s",
    type=click.FloatRange(min=0),
    help="Seconds for the whole command: no run starts past them, and the one running then is killed.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write result rows here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), help="Save a plot here.")
@click.option(
    "--timeline",
    "timeline_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Record allocated memory through one step per mode and plot it here (GPU).",
)
@click.option(
    "--compile-backend",
    default="inductor",
    show_default=True,
    help="torch.compile backend of the +compile modes (aot_eager: trace without generating code).",
)
@click.option(
    "--compile-mode",
    type=click.Choice(["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]),
    default="default",
    show_default=True,
    help="torch.compile mode of the +compile modes (reduce-overhead: replay the compiled graphs as CUDA graphs).",
)
@click.option(
    "--lengths",
    is_flag=True,
    help="Also train each mode over 10 new sequence lengths (384..1536 on a GPU) at the first --batch: ms per "
    "step, host time and the graphs compiled.",
)
def bench_e2e(
    modes,
    models,
    layers,
    batches,
    seqs,
    steps,
    warmup,
    dtype,
    breakdown,
    fit_sizes,
    reference,
    timeout_s,
    budget_s,
    json_path,
    plot_path,
    timeline_path,
    compile_backend,
    compile_mode,
    lengths,
) -> None:
    """Train each model preset a few steps per mode, each run in a fresh process: tokens/s, peak memory, loss.

    The default model is the benchmark one: Llama-style, 1498M parameters, bf16, AdamW, 8 x 2048 tokens per step;
    qwen3-1.5b and gemma3-1.5b put about as many parameters behind larger vocabularies. Per preset, each row is
    printed as its run finishes; then the loss of every step per run, whether each compiled mode trains like its
    eager one, and the targets of liger_lab+compile. A +compile mode compiles in its first warm-up step (at least
    one), which tokens/s never counts. Exit code 1 when a run failed (running out of memory is a result).
    """
    models = models or (runtime.pick(cpu="tiny", gpu="1.5b"),)
    sizes = _pair_sizes(batches or [runtime.pick(cpu=2, gpu=8)], seqs or [runtime.pick(cpu=16, gpu=2048)])
    try:
        candidates = [parse_shape(s) for s in fit_sizes.split(",") if s]
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--fit") from None
    missing = [m for m in modes if m not in available_modes()]
    if missing:
        raise click.BadParameter(f"not available in this install: {', '.join(missing)}", param_hint="--mode")
    modes = modes or tuple(available_modes())
    if reference is not None and reference not in modes:
        hint = f"{reference} is not a mode of this run: add --mode {reference}"
        raise click.BadParameter(hint, param_hint="--reference")
    click.echo(runtime.describe())
    children = _Children(timeout_s, budget_s, json_path)
    common = dict(layers=layers, dtype=dtype, steps=steps, warmup=warmup, compile_backend=compile_backend,
                  compile_mode=None if compile_mode == "default" else compile_mode)  # fmt: skip
    for model in models:
        config = model_config(model, layers=layers)
        click.echo(
            f"\nmodel {model}: {config.model_type}, {count_parameters(config):,} parameters, "
            f"{config.num_hidden_layers} layers, vocabulary {config.vocab_size}"
        )
        if breakdown:
            _print_breakdown(config, sizes, DTYPES[dtype] if dtype else default_dtype())
        first = len(children.rows)
        _train_model(children, model, modes, sizes, common)
        if candidates:
            for mode in modes:
                click.echo(format_fit(children.run("fit", mode=mode, model=model, shapes=candidates, **common)))
        if lengths:
            batch = sizes[0][0]
            runs = [children.run("lengths", mode=mode, model=model, batch=batch, seq=0, **common) for mode in modes]
            click.echo(f"\nover {len(varying_lengths())} new lengths, batch {batch}:\n{format_lengths(runs)}")
        if timeline_path:
            batch, seq = sizes[0]
            for mode in modes:
                children.run("timeline", mode=mode, model=model, batch=batch, seq=seq, **common)
        if reference is not None:
            for batch, seq in sizes:
                click.echo(format_reference(children.rows[first:], reference, modes, batch=batch, seq=seq))
    if timeline_path:
        timelines = [r for r in children.rows if r.get("op") == "e2e_timeline"]
        plot_timelines(timelines).savefig(timeline_path, dpi=120, bbox_inches="tight")
        click.echo(f"wrote {timeline_path}" + ("" if any(t.get("t_ms") for t in timelines) else " (empty: GPU only)"))
    if json_path:
        click.echo(f"wrote {json_path}")
    if plot_path:
        trained = [r for r in children.rows if r.get("op") == "e2e"]
        plot_runs(trained).savefig(plot_path, dpi=120, bbox_inches="tight")
        click.echo(f"wrote {plot_path}")
    if any(r.get("error") for r in children.rows):
        sys.exit(1)


def _print_breakdown(config, sizes: Sequence[tuple[int, int]], dtype: torch.dtype) -> None:
    for batch, seq in sizes:
        columns = {
            "eager": memory_breakdown(config, batch, seq, dtype=dtype),
            "fused": memory_breakdown(config, batch, seq, dtype=dtype, fused=True),
        }
        click.echo(f"\nanalytic memory of one step, batch {batch} x seq {seq}:\n{format_breakdown(columns)}\n")


def _train_model(
    children: _Children, model: str, modes: Sequence[str], sizes: Sequence[tuple[int, int]], common: dict
) -> None:
    """Every mode at every size of one preset, each row printed as it comes; then every loss curve, each compiled
    mode against its eager one and the targets of liger_lab+compile."""
    runs = [(mode, batch, seq) for batch, seq in sizes for mode in modes]
    click.echo(f"\ntraining: {len(runs)} runs, each in a fresh process [{timer_label()}]")
    click.echo(RUN_HEADER)
    rows = []
    for mode, batch, seq in runs:
        rows.append(children.run("train", mode=mode, model=model, batch=batch, seq=seq, **common))
        if rows[-1].get("error"):
            click.echo(f"{mode} {batch}x{seq} failed:\n{rows[-1]['error']}", err=True)
        click.echo(format_run(rows[-1], rows))
    click.echo("\nloss per step (warm-up | timed):")
    for row in rows:
        click.echo(format_losses(row))
    for batch, seq in sizes:
        pairs = [(base_mode(m), m) for m in modes if is_compiled(m) and base_mode(m) in modes]
        for eager_mode, compiled_mode in pairs:
            verdict = compare_losses(rows, eager_mode, compiled_mode, batch=batch, seq=seq)
            click.echo(format_comparison(verdict))
        if TARGET_MODE in modes:
            click.echo(f"targets of {TARGET_MODE} at {batch}x{seq} [{timer_label()}]:")
            click.echo(format_targets(check_targets(rows, batch=batch, seq=seq)))


def _kernel_times(op: bench.OpBench, impl: str, calls: int) -> dict[str, float]:
    """Kernel times of one forward+backward of ``impl`` at the op's protocol shape in bf16 (inputs freed on return)."""
    fn = op.impls[impl]()
    inputs = list(op.make_inputs(op.shape, torch.bfloat16))
    return runtime.kernel_times_ms(profiling.forward_backward_of(fn, inputs), calls=calls)


@bench_group.command("kernels", short_help="Where an op's forward+backward spends its GPU time, kernel by kernel.")
@click.argument("ops", nargs=-1, required=True, type=click.Choice(list(bench.OPS)))
@click.option("--impl", default="liger_lab", show_default=True, type=click.Choice(IMPLS), help="Implementation.")
@click.option("--calls", default=3, show_default=True, type=click.IntRange(min=1), help="Profiled calls per op.")
@click.option("--top", default=12, show_default=True, type=click.IntRange(min=1), help="Kernels printed per op.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write result rows here.")
def bench_kernels(ops, impl, calls, top, json_path) -> None:
    """For each of OPS at its protocol shape in bf16, one forward+backward profiled CALLS times under torch.profiler,
    every kernel, copy and fill summed by name (liger_lab.runtime.kernel_times_ms): the largest with their share of
    the op's time, and the matmul floor (FLOPs at the measured bf16 rate) when the op has one. GPU only."""
    if runtime.INTERPRET:
        raise click.ClickException("bench kernels needs a GPU: the interpreter runs no kernels to profile")
    rate = profiling.matmul_tflops()
    rows = []
    for name in ops:
        op = bench.OPS[name]
        reason = op.unavailable_reason(impl)
        if reason is not None:
            raise click.ClickException(f"{name} {impl}: {reason}")
        times = _kernel_times(op, impl, calls)
        total = sum(times.values())
        floor = op.flops(op.shape) / (rate * 1e12) * 1e3 if op.flops else None
        floor_text = f", matmul floor {floor:.2f} ms" if floor else ""
        click.echo(f"\n{name} {impl} {op.shape}: kernels {total:.2f} ms{floor_text}")
        for kernel, ms in list(times.items())[:top]:
            click.echo(f"  {ms:8.3f} ms  {ms / total:5.1%}  {kernel[:90]}")
        rows.append({"op": name, "impl": impl, "shape": list(op.shape), "dtype": "bf16", "kernel_ms": round(total, 3),
                     "floor_ms": floor, "kernels_ms": {k: round(v, 3) for k, v in times.items()},
                     "timer": "profiler"})  # fmt: skip
        torch.cuda.empty_cache()  # this op's inputs are gone: their blocks back for the next op
    if json_path:
        write_rows(rows, json_path)
        click.echo(f"wrote {json_path}")


@main.command()
def exercises() -> None:
    """Regenerate chapters/ (exercise notebooks) from solutions/."""
    from liger_lab.workbook.chapters import generate

    for path in generate():
        click.echo(f"wrote {path}")


def jupyter_lab_command(
    folder: Path, *, ip: str, port: int, token: str, open_browser: bool, as_root: bool
) -> list[str]:
    """The JupyterLab command line for the workbook: a fixed port (fail rather than drift, so the printed
    URL stays right), our token, no browser where there is no display, and ``--allow-root`` for root."""
    command = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        str(folder),
        f"--ServerApp.ip={ip}",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
    ]
    if not open_browser:
        command.append("--no-browser")
    if as_root:
        command.append("--allow-root")
    return command


def workbook_folder() -> Path:
    """The exercise chapters: ./chapters, else those of the clone this package is installed from (editable)."""
    for folder in (Path("chapters"), Path(__file__).resolve().parent.parent / "chapters"):
        if folder.is_dir():
            return folder
    raise click.ClickException(
        "no chapters/ folder here, and this liger_lab is not installed from a clone: run from a clone of "
        "liger-lab or pass --folder"
    )


def jupyterlab_installed() -> bool:
    return importlib.util.find_spec("jupyterlab") is not None


def port_is_free(ip: str, port: int) -> bool:
    """Whether JupyterLab could listen on ``ip:port`` now (it is started with no port retries)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
        except OSError:
            return False
    return True


def workbook_urls(ip: str, port: int, token: str) -> list[str]:
    """Where to point a browser; a server listening on every address is reached through this host's name."""
    hosts = [socket.gethostname(), "127.0.0.1"] if ip in ("0.0.0.0", "::", "") else [ip]
    return [f"http://{host}:{port}/lab?token={token}" for host in hosts]


@main.command(short_help="Open the workbook (chapters/) in JupyterLab, as root and headless too.")
@click.option("--ip", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option("--port", default=8888, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option(
    "--browser/--no-browser",
    default=None,
    help="Open a browser (default: only when a display is available).",
)
@click.option(
    "--folder",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Folder to open [default: ./chapters, else the chapters/ of the clone liger_lab runs from].",
)
def workbook(ip: str, port: int, browser: bool | None, folder: Path | None) -> None:
    """Start JupyterLab on the exercise chapters and print the URL to open, with its token.

    Works as root (containers, cloud GPU images) and on a machine without a display (a remote GPU: forward
    the port, e.g. ``ssh -L 8888:localhost:8888 gpu-host``, then open the printed 127.0.0.1 URL). Before it
    prints anything it checks that JupyterLab is installed and that the port is free."""
    folder = folder or workbook_folder()
    if not jupyterlab_installed():
        raise click.ClickException("JupyterLab is not installed: pip install 'liger-lab[notebooks]' (or make workbook)")
    if not port_is_free(ip, port):
        raise click.ClickException(f"port {port} on {ip} is in use: pass another with --port")
    token = secrets.token_hex(24)
    has_display = bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) or sys.platform == "darwin"
    command = jupyter_lab_command(
        folder,
        ip=ip,
        port=port,
        token=token,
        open_browser=has_display if browser is None else browser,
        as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
    )
    click.echo("The workbook will be served at:")
    for url in workbook_urls(ip, port, token):
        click.echo(f"    {url}")
    click.echo("(Ctrl-C twice stops the server.)", err=True)
    sys.stdout.flush()
    os.execv(command[0], command)
