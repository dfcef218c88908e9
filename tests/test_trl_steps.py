"""The TRL steps benchmark builds every trainer it times (on CPU: built, not trained; the timing needs a GPU)."""

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks import trl_steps  # noqa: E402


@pytest.mark.parametrize("kind", trl_steps.TRAINERS)
def test_every_trainer_of_the_benchmark_is_built(kind, monkeypatch, tmp_path):
    monkeypatch.setattr(trl_steps, "STEPS", 1)
    monkeypatch.chdir(tmp_path)
    vocab = 64
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    tokenizer = trl_steps._tokenizer(vocab)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")  # as the benchmark's "trl" mode: TRL loads the model from a folder
    trainer = trl_steps._trainer(kind, str(tmp_path / "model"), tokenizer, [])
    assert trainer.args.max_steps == 1 and len(trainer.train_dataset) > 0
    assert set(trl_steps.TOKENS_PER_STEP) == set(trl_steps.TRAINERS)
