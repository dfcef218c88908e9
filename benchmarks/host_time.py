"""Host time of liger_lab's eager calls, on CPU, with every kernel launch skipped.

    python benchmarks/host_time.py --label after                  # measure, stored under "after" in the results
    python benchmarks/host_time.py --note benchmarks/notes/host_time.md   # its before/after table, from the results

Without CUDA graphs a GPU waits for the host between small kernels: what an eager call costs the host (argument
checks, allocations, the dispatcher, autograd, launch settings, Triton's launcher) bounds a small model's step.
``runtime.skip_launches()`` makes ``runtime.launch_kernel`` return at once, so every other line of the host path runs
as it would, on CPU tensors, and the outputs' values are garbage (never read: ``runtime.HOST_READS_WAIT`` is set as
on the GPU, where no check reads a value back). Per op of the table at a tiny shape, the microseconds per call
of the forward (inputs requiring grad, as in training) and of forward+backward (``torch.autograd.grad`` with a
fixed upstream gradient), and per training step of a tiny Llama patched by ``liger_lab.patch``, eager and compiled
(``aot_eager``: Dynamo and AOTAutograd without code generation); beside each, plain
PyTorch's eager op (``liger_lab.reference``, the unpatched model) on the same tensors, which computes for real:
at these shapes that is mostly its own host time, a scale for ours. One thread, its CPU time, the best of many short
rounds. What Triton's launcher costs is not in it (launches are skipped): on the GPU it adds its own share per
kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import liger_lab  # first: it chooses the GPU or Triton's interpreter before triton is imported
from liger_lab import runtime
from liger_lab.op_table import OPS, OpSpec

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "cpu-host-time.json"
TABLE_START, TABLE_END = "<!-- host_time.py table -->", "<!-- end of host_time.py table -->"
MAX_SIZE = 16
"""Every dimension of an op's interpreter check shape capped at this: the reference's own arithmetic stays small."""


def per_call_us(
    torch_fn: Callable[[], object], ours_fn: Callable[[], object], *, rounds: int = 31, round_s: float = 0.01
) -> tuple[float, float]:
    """(torch's, ours): the least over ``rounds`` rounds of the microseconds per call of each, each round
    ``round_s`` long or more, in this thread's CPU time, ``ours_fn`` with every launch skipped. With launches
    skipped the host never waits, so that is the call's wall time on an idle machine. The two sides alternate round
    by round: on a machine shared with other work its load drifts over seconds, and a side measured after the other
    would meet another machine. CPU time leaves out the time other processes held the CPU, and the least round is the
    one their caches and the other hardware thread disturbed least."""

    def calls_per_round(fn: Callable[[], object]) -> int:
        start, warmup_calls = time.thread_time(), 0
        while warmup_calls < 20 or time.thread_time() - start < round_s:  # first calls fill caches of every kind
            fn()
            warmup_calls += 1
        return max(1, int(round_s * warmup_calls / (time.thread_time() - start)))

    def one_round(fn: Callable[[], object], calls: int) -> float:
        start = time.thread_time()
        for _ in range(calls):
            fn()
        return (time.thread_time() - start) / calls * 1e6

    torch_calls = calls_per_round(torch_fn)
    with runtime.skip_launches():
        ours_calls = calls_per_round(ours_fn)
    torch_samples, ours_samples = [], []
    for _ in range(rounds):
        torch_samples.append(one_round(torch_fn, torch_calls))
        with runtime.skip_launches():
            ours_samples.append(one_round(ours_fn, ours_calls))
    return min(torch_samples), min(ours_samples)


def _outputs(result: object) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


@contextlib.contextmanager
def measuring_conditions() -> Iterator[None]:
    """Within the block, the conditions every figure here is measured under (restored after it): one thread, the
    GPU's host path (no check reads a value back), denormals flushed."""
    threads, reads_wait = torch.get_num_threads(), runtime.HOST_READS_WAIT
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # garbage outputs may hold denormals, which the reference's arithmetic meets
    runtime.HOST_READS_WAIT = True  # the GPU's path: no check reads a (garbage) value back
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
        runtime.HOST_READS_WAIT = reads_wait


def op_cases(spec: OpSpec) -> dict[str, Callable[[Callable[..., object]], Callable[[], object]]]:
    """call kind -> a builder of the timed call of an implementation on fresh inputs of ``spec``'s tiny shape."""
    shape = tuple(min(size, MAX_SIZE) for size in spec.check_shapes[0])
    inputs = spec.make_inputs(shape, torch.float32)
    named = dict(zip(spec.input_names, inputs, strict=True))
    leaves = [named[name] for name in spec.differentiable]
    upstream = [torch.ones_like(out) for out in _outputs(spec.function(*inputs))]

    def forward(fn: Callable[..., object]) -> Callable[[], object]:
        return lambda: fn(*inputs)

    def forward_backward(fn: Callable[..., object]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(_outputs(fn(*inputs)), leaves, upstream, allow_unused=True)

    return {"forward": forward, "forward+backward": forward_backward}


def tiny_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    """A two-layer Llama at a tiny width, and a batch of token ids (2 x 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(runtime.DEVICE).train()
    return model, torch.randint(0, config.vocab_size, (2, 16), device=runtime.DEVICE)


def training_step(model: torch.nn.Module, input_ids: torch.Tensor) -> Callable[[], object]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=input_ids, labels=input_ids).loss.backward()

    return step


def measure() -> list[dict]:
    """One row per op and call kind, then one for the patched model's training step."""
    rows = []
    for name, spec in OPS.items():
        for kind, build in op_cases(spec).items():
            torch_us, ours_us = per_call_us(build(spec.reference), build(spec.function))
            rows.append({"op": name, "call": kind, "liger_lab_us": round(ours_us, 1), "torch_us": round(torch_us, 1)})
            print(f"{name:<28} {kind:<17} liger_lab {ours_us:8.1f} us   torch {torch_us:8.1f} us", flush=True)
    for call, compile_backend in (("training step", None), ("training step, compiled (aot_eager)", "aot_eager")):
        model, input_ids = tiny_llama()
        patched = liger_lab.patch(copy.deepcopy(model))
        if compile_backend is not None:
            torch._dynamo.reset()
            model, patched = (torch.compile(m, backend=compile_backend) for m in (model, patched))
        torch_us, ours_us = per_call_us(
            training_step(model, input_ids), training_step(patched, input_ids), rounds=15, round_s=0.05
        )
        liger_lab.unpatch(patched)
        rows.append({"op": "llama (2 layers, patched)", "call": call, "liger_lab_us": round(ours_us, 1),
                     "torch_us": round(torch_us, 1)})  # fmt: skip
        print(f"llama {call}: liger_lab {ours_us:.1f} us, transformers {torch_us:.1f} us", flush=True)
    return rows


def machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "threads_used": 1, "python": platform.python_version(),
            "torch": torch.__version__, "triton": runtime.triton.__version__}  # fmt: skip


def commit() -> str:
    """The checked-out commit, ``-dirty`` when the tree has changes (a run before committing them)."""
    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def note_table(results: dict) -> str:
    """The markdown table of every run in ``results``, side by side (a dash where a run had no such row, an op added
    since), with the last run against the first."""
    labels = list(results["runs"])
    times = {
        label: {(r["op"], r["call"]): r["liger_lab_us"] for r in run["rows"]} for label, run in results["runs"].items()
    }
    lines = [
        f"| op | call | torch eager (us) | {' | '.join(f'liger_lab {label} (us)' for label in labels)} | "
        f"{labels[-1]} / {labels[0]} |",
        "|---|---|---|" + "---|" * len(labels) + "---|",
    ]
    for row in results["runs"][labels[-1]]["rows"]:
        key = row["op"], row["call"]
        ours = " | ".join(f"{times[label][key]:.0f}" if key in times[label] else "-" for label in labels)
        first = times[labels[0]].get(key)
        ratio = "-" if first is None else f"{row['liger_lab_us'] / first:.2f}"
        lines.append(f"| {row['op']} | {row['call']} | {row['torch_us']:.0f} | {ours} | {ratio} |")
    sources = "; ".join(f"{label}: {run['commit']}, {run['date']}" for label, run in results["runs"].items())
    info = results["machine"]
    lines.append("")
    lines.append(f"{info['cpu']} ({info['cores']} cores, {info['threads_used']} thread used), torch {info['torch']}, "
                 f"Triton {info['triton']}; runs {sources} (`{RESULTS.relative_to(ROOT)}`).")  # fmt: skip
    return "\n".join(lines)


def write_note(path: Path, results: dict) -> None:
    """Replace the table between the markers of ``path`` with :func:`note_table`'s (the prose around it stays)."""
    text = path.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    path.write_text(f"{text[:start]}\n{note_table(results)}\n{text[end:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", help="measure, and store the rows under this label (replacing a run of that name)")
    parser.add_argument("--json", type=Path, default=RESULTS, help="the results file (default: %(default)s)")
    parser.add_argument("--note", type=Path, help="rewrite the table of this note from the results file")
    args = parser.parse_args(argv)
    if not runtime.INTERPRET:
        raise SystemExit("host_time.py measures the host path on CPU: run it where kernels run in the interpreter")
    results = json.loads(args.json.read_text()) if args.json.exists() else {"machine": machine(), "runs": {}}
    if args.label:
        with measuring_conditions():
            rows = measure()
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        results["machine"] = machine()
        results["runs"][args.label] = {"commit": commit(), "date": date, "rows": rows}
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.note:
        write_note(args.note, results)


if __name__ == "__main__":
    main()
