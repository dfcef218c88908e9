"""A Llama-style model under FSDP2 on several GPUs: tokens/s and peak memory per GPU, per patching mode.

    python benchmarks/dist.py --nproc 2 --modes hf,liger_lab,liger --model 8b --seqs 4096,8192,16384,32768 \
        --json benchmarks/results/h200x2-fsdp2.json
    python benchmarks/dist.py --nproc 2 --modes hf,liger_lab --model tiny --seqs 16,32    # on CPU (gloo)

Each (mode, sequence length) is one ``torchrun`` launch of this script with ``--worker``: patching changes
transformers for the whole process, and a rank that runs out of memory ends the launch (torchrun stops the
other ranks) instead of leaving them waiting in a collective. A worker builds the model (bf16 on the GPU),
patches it for its mode, shards each decoder layer, ``lm_head`` (its own unit: the largest weight) and the
root with ``fully_shard``, then times ``--steps`` AdamW steps at batch ``--batch`` per GPU after one warm-up
step. Rank 0 prints the row: tokens/s per GPU (wall clock, synchronised), the largest peak of any GPU, the
losses. A launch that fails gives a row with its error (``oom`` when it ran out of memory); the largest
length that fits is reported per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import liger_lab  # noqa: F401  (chooses GPU or interpreter before triton is imported)
from liger_lab import e2e, runtime


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import fully_shard

    backend = "gloo" if runtime.INTERPRET else "nccl"
    if not runtime.INTERPRET:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = e2e.llama_config(args.model)
    model = e2e.apply_mode(e2e.build_model(config, seed=0), args.mode)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    optimizer = e2e._optimizer(model, lr=1e-4)
    tokens = e2e._batch(config, args.batch, args.seq, seed=rank)
    e2e._reset_peak()
    losses = [e2e._step(model, optimizer, tokens).item()]  # warm-up
    runtime.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        losses.append(e2e._step(model, optimizer, tokens).item())
    runtime.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.tensor([e2e._peak_gib() or 0.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        row = e2e._row(args.mode, config, args.batch, args.seq, gpus=world, fsdp="fully_shard: layers, lm_head, root",
                       tokens_per_s_per_gpu=round(args.batch * args.seq * args.steps / seconds),
                       peak_gib_max_gpu=None if runtime.INTERPRET else round(peak.item(), 2),
                       losses=[round(x, 4) for x in losses], timer="wall clock, synchronised")  # fmt: skip
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def launch(args: argparse.Namespace, mode: str, seq: int) -> dict:
    """One torchrun launch of the worker; its row, or an error row."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", __file__,
        "--worker", "--mode", mode, "--model", args.model, "--seq", str(seq), "--batch", str(args.batch),
        "--steps", str(args.steps),
    ]  # fmt: skip
    row = e2e.child_row(command, {"impl": mode, "seq": seq, "gpus": args.nproc}, timeout_s=args.timeout)
    if "error" in row and "OutOfMemoryError" in row["error"]:
        row["oom"] = True
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--modes", default="hf,liger_lab")
    parser.add_argument("--model", default="8b", choices=list(e2e.MODEL_SIZES))
    parser.add_argument("--seqs", default="4096")
    parser.add_argument("--seq", type=int, default=4096, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="liger_lab", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help="sequences per GPU")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for mode in args.modes.split(","):
        for seq in sorted(int(s) for s in args.seqs.split(",")):
            row = launch(args, mode, seq)
            failure = "out of memory" if row.get("oom") else row.get("error", "")[-300:]
            print(f"{mode} seq {seq}: {failure}" if "error" in row else json.dumps(row), flush=True)
            rows.append(row)
            if "error" in row:
                break  # longer sequences will not fit either
        fitting = [r["seq"] for r in rows if r.get("impl") == mode and "error" not in r]
        print(f"{mode}: largest sequence that trains at batch {args.batch} per GPU: {max(fitting, default=None)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
            out.write("\n")


if __name__ == "__main__":
    main()
