"""A Llama-style model under FSDP2 on several GPUs: tokens/s and peak memory per GPU, per patching mode.

    python -m benchmarks.dist --nproc 2 --modes hf,liger_lab --model 8b --seqs 8192,12288,16384,24576,32768 \
        --json benchmarks/results/h200x2-dist.json
    python -m benchmarks.dist --nproc 2 --modes hf,liger_lab --model tiny --seqs 16,32    # on CPU (gloo)

Each mode is one ``torchrun`` launch of this module with ``--worker`` (patching changes transformers for the whole
process). A worker builds the model (bf16 on the GPU), patches it for its mode, shards each decoder layer,
``lm_head`` (its own unit: the largest weight) and the root with ``fully_shard``, then, for each sequence length
from the shortest, times ``--steps`` AdamW steps at batch ``--batch`` per GPU after one warm-up step. Rank 0
prints a row per length as it finishes: tokens/s per GPU (wall clock, synchronised), the largest peak of any
GPU, the losses. The first length that runs out of memory ends the launch (longer ones would too), with a row
saying so; the largest length that fits is reported per mode.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import liger_lab  # noqa: F401  (chooses GPU or interpreter before triton is imported)
from liger_lab import distributed, runtime
from liger_lab.e2e.isolation import environment_of
from liger_lab.e2e.presets import MODEL_SIZES, llama_config
from liger_lab.e2e.training import (
    apply_mode,
    build_model,
    make_optimizer,
    peak_memory_gib,
    random_batch,
    reset_peak_memory,
    result_row,
    train_step,
)
from liger_lab.workbook import results

FSDP = "fully_shard: layers, lm_head, root"


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import fully_shard

    _, backend = distributed.join_processes(timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = llama_config(args.model)
    model = apply_mode(build_model(config, seed=0), args.mode)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    optimizer = make_optimizer(model, lr=1e-4)
    for seq in sorted(int(s) for s in args.seqs.split(",")):
        tokens = random_batch(config, args.batch, seq, seed=rank)
        reset_peak_memory()
        try:
            losses = [train_step(model, optimizer, tokens).item()]  # warm-up
            runtime.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                losses.append(train_step(model, optimizer, tokens).item())
            runtime.synchronize()
        except torch.OutOfMemoryError:
            if rank == 0:
                print(json.dumps({"impl": args.mode, "seq": seq, "gpus": world, "error": "out of memory", "oom": True}))
            break
        seconds = time.perf_counter() - start
        peak = torch.tensor([peak_memory_gib() or 0.0], device=runtime.DEVICE if backend == "nccl" else "cpu")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            row = result_row(args.mode, config, args.batch, seq, gpus=world, fsdp=FSDP,
                           tokens_per_s_per_gpu=round(args.batch * seq * args.steps / seconds),
                           peak_gib_max_gpu=None if runtime.INTERPRET else round(peak.item(), 2),
                           losses=[round(x, 4) for x in losses], timer="wall clock, synchronised")  # fmt: skip
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def launch(args: argparse.Namespace, mode: str) -> list[dict]:
    """One torchrun launch of the worker for ``mode``: its rows, printed as they come, and an error row if it
    ended otherwise than by running out of memory."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", "-m",
        __spec__.name, "--worker", "--mode", mode, "--model", args.model, "--seqs", args.seqs,
        "--batch", str(args.batch), "--steps", str(args.steps),
    ]  # fmt: skip
    rows, start = [], time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        for line in child.stdout:
            if line.startswith("{"):
                rows.append(json.loads(line))
                print(f"[{time.perf_counter() - start:5.0f} s] {line.strip()}", flush=True)
            if time.perf_counter() - start > args.timeout:
                child.kill()
                break
        child.wait(timeout=60)
        stderr = child.stderr.read()
    if child.returncode != 0 and not any(row.get("oom") for row in rows):
        # torchrun's own summary ends stderr; the ranks' exceptions come before it.
        causes = list(dict.fromkeys(line for line in stderr.splitlines() if "Error" in line and "torch/" not in line))
        error = "\n".join(causes[:10]) or stderr.strip()[-2000:] or f"exit {child.returncode}"
        rows.append({"impl": mode, "gpus": args.nproc, "error": error})
        print(f"{mode}: the launch failed: {rows[-1]['error'][-300:]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--modes", default="hf,liger_lab")
    parser.add_argument("--model", default="8b", choices=list(MODEL_SIZES))
    parser.add_argument("--seqs", default="4096", help="sequence lengths, comma-separated, tried from the shortest")
    parser.add_argument("--mode", default="liger_lab", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help="sequences per GPU")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for mode in args.modes.split(","):
        rows += launch(args, mode)
        fitting = [r["seq"] for r in rows if r.get("impl") == mode and "error" not in r]
        print(f"{mode}: largest sequence that trains at batch {args.batch} per GPU: {max(fitting, default=None)}")
        if args.json:  # after every mode, so a run cut short keeps what it measured
            results.write_rows(rows, args.json, environment=environment_of(rows))


if __name__ == "__main__":
    main()
