import importlib
import json
import math

import pytest
import torch
from click.testing import CliRunner

import liger_lab
from liger_lab import cli, runtime
from liger_lab.e2e.training import random_batch
from liger_lab.hf import loss as hf_loss
from liger_lab.ops import rms_norm as rms_norm_ops

transformers = pytest.importorskip("transformers")
doctor = importlib.import_module("liger_lab.doctor")  # liger_lab.doctor is the function

# One decoder layer of a Llama small enough for Triton's interpreter: one doctor run takes a few seconds.
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
SIZES = ("--batch", "1", "--seq", "8", "--steps", "2", "--dtype", "fp32")
STAGES = [f"[{i}/5]" for i in range(1, 6)]
CPU_ONLY = pytest.mark.skipif(not runtime.INTERPRET, reason="refused in Triton's interpreter only")


def llama_dir(path, *, weights: bool = False, **overrides):
    config = transformers.LlamaConfig(**TINY, **overrides)
    if weights:
        torch.manual_seed(1)  # not the doctor's seed: its random weights would differ
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def invoke(*args):
    return CliRunner().invoke(cli.main, ["doctor", *map(str, args)], catch_exceptions=False)


def test_a_local_model_directory_end_to_end(tmp_path):
    model = llama_dir(tmp_path / "model", weights=True)
    json_path, plot_path = tmp_path / "out" / "doctor.json", tmp_path / "memory.png"
    result = invoke(model, *SIZES, "--json", json_path, "--plot", plot_path)
    assert result.exit_code == 0, result.output
    output = result.output
    assert [output.index(stage) for stage in STAGES] == sorted(output.index(stage) for stage in STAGES)
    assert "PASS: no check failed" in output
    assert ("not a GPU figure" in output) == ("no CUDA memory timeline on CPU" in output) == runtime.INTERPRET
    assert plot_path.exists() != runtime.INTERPRET

    data = json.loads(json_path.read_text())
    assert (data["model_type"], data["batch"], data["seq"], data["steps"], data["dtype"]) == ("llama", 1, 8, 2, "fp32")
    assert data["ok"] is True and data["weights"].startswith("weights from")
    # The weights were loaded: the first loss is the saved model's on the doctor's batch.
    saved = transformers.AutoModelForCausalLM.from_pretrained(model).to(runtime.DEVICE)
    tokens = random_batch(saved.config, 1, 8, doctor.SEED)
    assert data["unpatched"]["losses"][0] == round(saved(input_ids=tokens, labels=tokens).loss.item(), 5)

    profile = data["profile"]
    assert list(profile["by_category_ms"]) == list(doctor.CATEGORIES)
    assert math.isclose(sum(profile["by_category_ms"].values()), profile["wall_ms"], rel_tol=1e-3)
    for category in ("matmuls", "attention", "norms", "activations", "RoPE", "loss", "optimizer"):
        assert profile["by_category_ms"][category] > 0, category
    assert profile["bound_if_replaced_took_zero"] > 1 and data["patched_profile"]["by_category_ms"]["norms"] > 0
    assert data["patch"]["replaced"] == {"residual add into RMSNorm": 1, "attention (RoPE)": 1,
                                         "gated MLP (SwiGLU/GeGLU)": 1, "RMSNorm": 3,
                                         "loss (fused linear cross-entropy)": 1}  # fmt: skip
    checks = {c["module"]: c for c in data["checks"]}
    assert set(checks) == {"model.layers.0", "model.layers.0.self_attn", "model.layers.0.mlp", "model.norm", "loss",
                           "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"}  # fmt: skip
    for check in checks.values():
        assert check["status"] == "PASS" and check["rel_error"] < check["tol"] == 1e-5, check
        assert check["shape"] == "(1, 8, 32)" and check["original_rel_error"] is not None
    for run in ("unpatched", "patched"):
        assert len(data[run]["losses"]) == 2 and data[run]["tokens_per_s"] > 0
        assert (data[run]["peak_gib"] is None) == (data[run]["peak_phase"] is None) == runtime.INTERPRET  # CUDA only
    assert data["losses"]["agree"] is True and data["fallbacks"] == []
    assert [t["impl"] for t in data["timelines"]] == ([] if runtime.INTERPRET else ["unpatched", "patched"])
    host = [] if runtime.INTERPRET else ["host"]  # GPU kernel time against the step's: a GPU figure
    assert [row["what"] for row in data["verdict"]] == ["speed", "peak memory", *host, "module checks",
                                                        "loss curve", "fallbacks"]  # fmt: skip
    assert {"torch", "triton", "transformers", "liger_lab"} <= set(data["environment"])


def test_the_host_row_names_cuda_graphs_when_the_gpu_waits_on_the_host():
    def run(step_ms: float) -> doctor.TrainRun:
        return doctor.TrainRun("patched", [1.0], 1.0, step_ms, 1.0, None, host_ms=step_ms)

    profile = doctor.StepProfile(20.0, "cuda", {"matmuls": 6.0, "loss": 2.0, "host idle": 12.0})
    what, status, figures = doctor.host_row(run(16.0), profile)  # 8 ms of kernels in a 16 ms step
    assert (what, status) == ("host", "")
    assert figures.startswith("GPU kernels 8.0 ms of a 16.0 ms step, host CPU 16.0 ms: the GPU waits on the host 50%")
    assert 'mode="reduce-overhead"' in figures
    assert doctor.host_row(run(9.0), profile)[2] == "GPU kernels 8.0 ms of a 9.0 ms step, host CPU 9.0 ms"


def test_a_family_with_a_fallback_shows_it(tmp_path):
    config = llama_dir(tmp_path, hidden_act="relu") / "config.json"  # a config.json alone: random weights
    result = liger_lab.doctor(config, batch=1, seq=8, steps=2, progress=None)
    assert result.ok and result.weights == "random weights from its config"
    assert result.patch.left_alone["MLP"] == "activation 'relu' has no fused kernel"
    assert result.fallbacks == ["no fused kernel for the MLP activation 'relu': LlamaMLP stays as it is"]
    assert "model.layers.0.mlp" not in {c.module for c in result.checks}
    assert ("fallbacks", "", "1 fired (above)") in result.verdict()
    assert "fallbacks: 1 fired\n    no fused kernel for the MLP activation 'relu'" in str(result)


def test_a_fallback_warned_earlier_in_the_process_is_seen_again():
    hf_loss._REPORTED_FALLBACKS.add(("LlamaForCausalLM", "a reason"))
    found: list[str] = []
    with doctor._fallbacks_seen(found):
        hf_loss._report_fallback("LlamaForCausalLM", "a reason")
    assert found == ["liger_lab: LlamaForCausalLM's loss materialises the logits, the fused loss cannot run: a reason"]
    assert ("LlamaForCausalLM", "a reason") in hf_loss._REPORTED_FALLBACKS


def test_a_broken_kernel_fails_its_check_and_the_verdict(tmp_path, monkeypatch):
    fused = rms_norm_ops.rms_norm
    monkeypatch.setattr(rms_norm_ops, "rms_norm", lambda *args, **kwargs: 1.01 * fused(*args, **kwargs))
    json_path = tmp_path / "doctor.json"
    result = invoke(llama_dir(tmp_path), *SIZES, "--json", json_path)
    assert result.exit_code == 1, result.output
    data = json.loads(json_path.read_text())
    status = {c["module"]: c["status"] for c in data["checks"]}
    assert status["model.layers.0.input_layernorm"] == status["model.norm"] == "FAIL"
    assert status["model.layers.0.self_attn"] == status["loss"] == "PASS"  # the other kernels are fine
    worst = next(c for c in data["checks"] if c["module"] == "model.norm")
    assert worst["worst"] == "output" and 9e-3 < worst["rel_error"] < 1.1e-2  # 1% off, named
    assert data["ok"] is False
    assert {"what": "module checks", "result": "FAIL"}.items() <= data["verdict"][2].items()
    assert "FAIL model.norm: output" in result.output
    assert "module checks  FAIL  3 of 7 passed" in result.output
    assert "FAIL: check of model.layers.0, check of model.layers.0.input_layernorm" in result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["missing-model"], "does not exist"),
        (["{empty}"], "has no config.json"),
        (["{gpt2}"], "liger_lab.patch supports"),
        (["{llama}", "--steps", "1"], "1 is not in the range x>=2"),
        (["{llama}", "--batch", "0"], "0 is not in the range x>=1"),
        (["{llama}", "--dtype", "fp8"], "'fp8' is not one of"),
        pytest.param(["{llama}", "--dtype", "bf16"], "bf16 stores truncate", marks=CPU_ONLY),
        pytest.param(["{llama}", "--max-batch", "4"], "needs a CUDA GPU", marks=CPU_ONLY),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    transformers.GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    paths = {"empty": tmp_path / "empty", "gpt2": tmp_path / "gpt2", "llama": llama_dir(tmp_path / "llama")}
    result = invoke(*[arg.format(**paths) for arg in args])
    assert result.exit_code == 2 and "Traceback" not in result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and message in error[0], result.output


def test_bad_arguments_of_the_function_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="expected at least 2"):
        liger_lab.doctor(llama_dir(tmp_path), steps=1, progress=None)
    with pytest.raises(ValueError, match="expected a local model directory or a config.json"):
        liger_lab.doctor(tmp_path / "config.yaml", progress=None)
