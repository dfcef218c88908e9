"""TRL 1.16's training steps on a GPU, TRL alone against TRL on liger_lab, in one run (DESIGN's round-4 protocol).

    python -m benchmarks.trl_steps --json benchmarks/results/h200-trl-steps.json
    python -m benchmarks.trl_steps --trainers dpo --modes trl liger_lab_obj

The policy is the ``1.5b`` preset (Llama-style, random weights saved once to a folder, bf16 autocast, sdpa
attention), trained by TRL's own trainer as a user would: SFT at 4 x 2048 tokens, DPO and CPO (TRL's experimental
trainer) on 4 pairs of 512-token prompts and completions (8 x 1024 tokens a step), KTO on 8 unpaired 512-token
prompts and completions, half of them desirable (8 x 1024 tokens, and TRL's KL completions), GRPO on 4 prompts of
256 tokens with 2 completions of 128 each
(8 x 384 tokens a step; generation by transformers' ``generate``, excluded: it is timed apart and taken off the
step). Three ways, each in a fresh process, since patching is global:

* ``trl``: TRL alone, its fused head and its losses;
* ``liger_lab``: ``liger_lab.patch("llama")`` before TRL loads the model from its folder (the README's first way),
  then ``liger_lab.patch_trl()``;
* ``liger_lab_obj``: the model loaded, ``liger_lab.patch(model)``, handed to TRL, then ``liger_lab.patch_trl()``.

Each row: the median training step in ms and tokens/s over the steps after the warm-up, the peak memory, the first
and last logged losses (DPO's first is log 2 when policy and reference compute alike), and how many calls liger_lab's
head served and how many trainers it did not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

TOKENS_PER_STEP = {"sft": 4 * 2048, "dpo": 8 * 1024, "kto": 8 * 1024, "cpo": 8 * 1024, "grpo": 8 * (256 + 128)}
"""Tokens a step of each trainer the benchmark times (the module docstring says how they are made)."""
TRAINERS = tuple(TOKENS_PER_STEP)
MODES = ("trl", "liger_lab", "liger_lab_obj")
STEPS, WARMUP = 8, 3
MODEL_DIR = Path("/tmp/liger-lab-trl-1.5b")


def _tokenizer(vocab_size: int):
    """A word-level tokenizer over ``t0 .. t{V-1}``: any id sequence is a text, and no download is needed."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="t0", eos_token="t1", bos_token="t2", unk_token="t0"
    )


def _saved_model() -> str:
    """The 1.5B preset with random weights in bf16, saved once (TRL builds reference models from the path)."""
    import torch
    import transformers

    from liger_lab import e2e

    config = e2e.model_config("1.5b")
    config.update({"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": False})
    if not (MODEL_DIR / "config.json").exists():
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(MODEL_DIR)
        _tokenizer(config.vocab_size).save_pretrained(MODEL_DIR)
    return str(MODEL_DIR)


def _texts(count: int, words: int, vocab_size: int, seed: int) -> list[str]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (count, words), generator=generator)
    return [" ".join(f"t{int(i)}" for i in row) for row in ids]


def _trainer(kind: str, model, tokenizer, callbacks: list):
    import datasets
    import torch
    import transformers
    import trl

    vocab = tokenizer.vocab_size
    common = dict(output_dir=f"/tmp/liger-lab-trl-{kind}", max_steps=STEPS, report_to=[], logging_steps=1,
                  save_strategy="no", learning_rate=1e-5, bf16=True, dataloader_num_workers=0, seed=0,
                  use_cpu=not torch.cuda.is_available(),  # CPU: the trainers are built (tests), never timed
                  model_init_kwargs={"dtype": torch.bfloat16, "attn_implementation": "sdpa"})  # fmt: skip
    if kind == "sft":
        data = datasets.Dataset.from_dict({"text": _texts(4 * STEPS, 2047, vocab, 0)})
        args = trl.SFTConfig(**common, per_device_train_batch_size=4, max_length=2048, packing=False)
        return trl.SFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
    if kind in ("dpo", "cpo"):
        columns = {
            name: _texts(4 * STEPS, 512, vocab, seed) for seed, name in enumerate(("prompt", "chosen", "rejected"))
        }
        data = datasets.Dataset.from_dict(columns)
        if kind == "dpo":
            args = trl.DPOConfig(**common, per_device_train_batch_size=4, max_length=1024)
            return trl.DPOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        init = common.pop("model_init_kwargs")  # CPO's trainer takes a model, not a path, and refuses these with one
        if isinstance(model, str):
            model = transformers.AutoModelForCausalLM.from_pretrained(model, **init)
        args = CPOConfig(**common, per_device_train_batch_size=4, max_length=1024)
        return CPOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
    if kind == "kto":
        data = datasets.Dataset.from_dict({"prompt": _texts(8 * STEPS, 512, vocab, 0),
                                           "completion": _texts(8 * STEPS, 512, vocab, 1),
                                           "label": [i % 2 == 0 for i in range(8 * STEPS)]})  # fmt: skip
        args = trl.KTOConfig(**common, per_device_train_batch_size=8, max_length=1024)
        return trl.KTOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
    args = trl.GRPOConfig(**common, per_device_train_batch_size=8, num_generations=2, max_completion_length=128,
                          beta=0.04, loss_type="dapo")  # fmt: skip
    data = datasets.Dataset.from_dict({"prompt": _texts(4 * STEPS, 256, vocab, 0)})

    def length(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    return trl.GRPOTrainer(model, reward_funcs=length, args=args, train_dataset=data, processing_class=tokenizer,
                           callbacks=callbacks)  # fmt: skip


def step_row(kind: str, mode: str) -> dict:
    """Train ``kind`` for :data:`STEPS` steps in ``mode`` (this process only: patching is global)."""
    import torch
    import transformers

    path = _saved_model()
    head = None
    model: object = path
    if mode != "trl":
        import liger_lab

        if mode == "liger_lab":
            liger_lab.patch("llama")
        else:
            loaded = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.bfloat16, attn_implementation="sdpa"
            )
            model = liger_lab.patch(loaded.to("cuda"))
        head = liger_lab.patch_trl()
    steps: list[float] = []
    generation: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.start, self.generated = time.perf_counter(), len(generation)

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - self.start - sum(generation[self.generated :]))

    trainer = _trainer(kind, model, _tokenizer(128256), [Clock()])
    if kind == "grpo":  # generation is timed apart and taken off the step
        generate = trainer._generate_and_score_completions

        def timed_generate(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            torch.cuda.synchronize()
            generation.append(time.perf_counter() - start)
            return out

        trainer._generate_and_score_completions = timed_generate
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    timed = sorted(steps[WARMUP:])
    median = timed[len(timed) // 2]
    tokens = TOKENS_PER_STEP[kind]
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return {"op": "trl_step", "trainer": kind, "impl": mode, "model": "1.5b", "tokens_per_step": tokens,
            "ms_per_step": round(1e3 * median, 1), "tokens_per_s": round(tokens / median),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "generation_ms": round(1e3 * sum(generation) / len(generation), 1) if generation else None,
            "loss_first": round(losses[0], 5), "loss_last": round(losses[-1], 5),
            "loss_first_minus_log2": round(losses[0] - math.log(2), 6) if kind == "dpo" else None,
            "head_calls": getattr(head, "calls", None), "head_fallbacks": getattr(head, "fallbacks", None)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", nargs="*", default=list(TRAINERS), choices=TRAINERS)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--json", type=Path, help="write the rows here (a JSON list, rewritten as each row comes)")
    parser.add_argument("--child", nargs=2, metavar=("TRAINER", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(step_row(*args.child)), flush=True)
        return
    from benchmarks.wall_clock import environment
    from liger_lab.workbook import results

    shared, rows = environment(), []
    for kind in args.trainers:
        for mode in args.modes:
            command = [sys.executable, "-m", "benchmarks.trl_steps", "--child", kind, mode]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=os.environ)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                row = json.loads(lines[-1]) if lines else {"error": done.stderr[-800:]}
            except subprocess.TimeoutExpired:
                row = {"error": "timed out after 400 s"}
            row = {"op": "trl_step", "trainer": kind, "impl": mode, **row, "commit": shared["commit"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                results.write_rows(rows, args.json, environment=shared)


if __name__ == "__main__":
    main()
