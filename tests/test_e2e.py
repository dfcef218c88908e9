import math

import pytest
import torch

import liger_lab
from liger_lab import e2e, runtime

pytest.importorskip("transformers")

GIB = 2**30


@pytest.fixture(scope="module")
def tiny():
    return e2e.llama_config("tiny")


@pytest.fixture(scope="module")
def design():
    return e2e.llama_config("1.5b")


def test_parameter_count_matches_the_built_model(tiny):
    model = e2e.build_model(tiny)
    assert e2e.count_parameters(tiny) == sum(p.numel() for p in model.parameters())


def test_design_model_has_1498m_parameters(design):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(design)
    assert e2e.count_parameters(design) == sum(p.numel() for p in model.parameters()) == 1_498_482_688
    assert round(e2e.count_parameters(design) / 1e6) == 1498  # the params_M of the reference measurement


def test_breakdown_arithmetic(design):
    n, tokens, vocab, h = e2e.count_parameters(design), 8 * 2048, design.vocab_size, design.hidden_size
    bf16 = e2e.memory_breakdown(design, 8, 2048)
    assert bf16["weights"] == bf16["gradients"] == 2 * n
    assert bf16["AdamW states"] == 2 * 2 * n
    assert bf16["logits and loss"] == tokens * vocab * (2 + 4 + 4 + 4)
    per_layer = 6 * h + 2 * 512 + 3 * 8192  # fused: norms, projections' inputs, q k v, attention out, MLP
    eager_layer = 10 * h + 2 * 512 + 4 * 8192
    assert e2e.activation_elements_per_token(design, fused=True) == per_layer
    assert e2e.activation_elements_per_token(design, fused=False) == eager_layer
    assert bf16["activations"] == tokens * (16 * eager_layer + 4 * h) * 2
    fp32_states = e2e.memory_breakdown(design, 8, 2048, optimizer_dtype=torch.float32)
    assert fp32_states["AdamW states"] == 2 * 4 * n and fp32_states["weights"] == 2 * n
    fp32 = e2e.memory_breakdown(design, 8, 2048, dtype=torch.float32)
    assert fp32["weights"] == 4 * n and fp32["activations"] == 2 * bf16["activations"]
    assert e2e.estimated_peak(bf16) == sum(bf16.values()) - bf16["gradients"]


def test_fused_breakdown_holds_a_chunk_of_logits_not_all_of_them(design):
    fused = e2e.memory_breakdown(design, 8, 2048, fused=True, loss_chunk_tokens=512)
    h, vocab = design.hidden_size, design.vocab_size
    assert fused["logits and loss"] == vocab * h * 2 + 8 * 2048 * h * 2 + 2 * 512 * vocab * 4
    # by default a chunk of logits is about as big as the hidden states: 16384 * 2048 / 128256 -> 512 rows
    assert e2e.memory_breakdown(design, 8, 2048, fused=True)["logits and loss"] == fused["logits and loss"]
    # Four times the tokens: eager's logits grow four times, the fused loss stays a few GiB.
    eager, eager_long = (e2e.memory_breakdown(design, b, t)["logits and loss"] for b, t in ((8, 2048), (16, 4096)))
    assert eager_long == 4 * eager
    assert e2e.memory_breakdown(design, 16, 4096, fused=True)["logits and loss"] < eager / 10


def test_estimated_peaks_are_near_the_measured_anchors(design):
    # Reference H200 run: Hugging Face eager 62.6 GiB, Liger-Kernel 27.8 GiB at 8 x 2048 on one H200.
    eager = e2e.estimated_peak(e2e.memory_breakdown(design, 8, 2048)) / GIB
    fused = e2e.estimated_peak(e2e.memory_breakdown(design, 8, 2048, fused=True)) / GIB
    assert eager == pytest.approx(62.6, rel=0.05)
    assert fused == pytest.approx(27.8, rel=0.05)


def test_breakdown_table_lists_every_part(design):
    table = e2e.format_breakdown({"eager": e2e.memory_breakdown(design, 8, 2048)})
    for key in ("weights", "gradients", "AdamW states", "activations", "logits and loss", "estimated peak"):
        assert key in table
    assert " 2.79" in table  # 1498M bf16 weights in GiB


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda c: e2e.memory_breakdown(c, 0, 2048), "positive sizes"),
        (lambda c: e2e.llama_config("70b"), "expected one of"),
        (lambda c: e2e.llama_config("tiny", layers=0), "at least 1"),
        (lambda c: e2e.parse_shape("8by2048"), "BATCHxSEQ"),
        (lambda c: e2e.parse_shape("0x2048"), "positive"),
        (lambda c: e2e.train("hf", c, 1, 8, steps=0), "steps"),
        (lambda c: e2e.apply_mode(torch.nn.Linear(1, 1), "deepspeed"), "expected one of"),
    ],
)
def test_bad_input_is_a_value_error(tiny, call, message):
    with pytest.raises(ValueError, match=message):
        call(tiny)


def test_parse_shape():
    assert e2e.parse_shape("16x4096") == (16, 4096)


def test_train_tiny_model_in_process(tiny):
    row = e2e.train("hf", tiny, 2, 32, steps=2, warmup=1, lr=1e-3)
    assert row["op"] == "e2e" and row["impl"] == "hf" and (row["batch"], row["seq"]) == (2, 32)
    assert row["tokens_per_s"] > 0 and "oom" not in row
    # Random tokens: the first loss is about log(vocabulary); three steps on one batch lower it.
    assert row["loss0"] == pytest.approx(math.log(tiny.vocab_size), abs=0.5)
    assert row["loss_last"] < row["loss0"]
    assert (row["peak_gib"] is None) == runtime.INTERPRET
    assert row["params_M"] == round(e2e.count_parameters(tiny) / 1e6, 2) and row["layers"] == 2
    assert row["gpu"] and row["torch"] == torch.__version__


def test_out_of_memory_is_reported_not_raised(tiny, monkeypatch):
    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.83 GiB")

    monkeypatch.setattr(e2e, "_step", out_of_memory)
    row = e2e.train("hf", tiny, 16, 4096, steps=1, warmup=0)
    assert row["oom"] is True and "tokens_per_s" not in row
    assert (row["impl"], row["batch"], row["seq"]) == ("hf", 16, 4096)


def test_largest_fit_stops_at_the_first_size_out_of_memory(tiny, monkeypatch):
    step = e2e._step

    def limited(model, optimizer, tokens):
        if tokens.numel() > 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return step(model, optimizer, tokens)

    monkeypatch.setattr(e2e, "_step", limited)
    fit = e2e.largest_fit("hf", tiny, [(4, 32), (1, 16), (2, 32), (1, 32)])
    assert [(f["batch"], f["seq"]) for f in fit["fits"]] == [(1, 16), (1, 32), (2, 32)]
    assert fit["largest"] == [2, 32] and fit["oom_at"] == [4, 32]


def test_allocated_timeline_follows_allocations_and_completed_frees():
    trace = [
        {"action": "segment_alloc", "size": 1 << 20, "time_us": 1000},
        {"action": "alloc", "size": 100, "time_us": 1000},
        {"action": "alloc", "size": 50, "time_us": 1500},
        {"action": "free_requested", "size": 100, "time_us": 2000},
        {"action": "free_completed", "size": 100, "time_us": 2500},
    ]
    times, allocated = e2e.allocated_timeline(trace, start_bytes=10)
    assert allocated == [110, 160, 60]
    assert times == [0.0, 0.5, 1.5]
    times, _ = e2e.allocated_timeline([{k: v for k, v in e.items() if k != "time_us"} for e in trace])
    assert times == [1.0, 2.0, 4.0]  # event numbers when the trace has no times


def test_downsampling_keeps_the_peak():
    values = [i % 97 for i in range(10_000)]
    values[5_555] = 1_000
    times, kept = e2e.downsample_max(list(range(10_000)), values, points=100)
    assert len(kept) <= 100 and max(kept) == 1_000 and times[kept.index(1_000)] == 5_555


def test_memory_timeline_says_it_needs_a_gpu_on_cpu(tiny):
    if not runtime.INTERPRET:
        pytest.skip("on the GPU the timeline is recorded (see the e2e benchmark)")
    timeline = e2e.memory_timeline("hf", tiny, 1, 8)
    assert timeline["t_ms"] == [] and "CUDA GPU" in timeline["note"]
    e2e.plot_timelines([timeline])


def test_plot_runs_marks_out_of_memory():
    import matplotlib.pyplot as plt

    rows = [
        {"impl": "hf", "batch": 8, "seq": 2048, "tokens_per_s": 50000.0, "peak_gib": 62.6},
        {"impl": "hf", "batch": 16, "seq": 4096, "oom": True},
    ]
    fig = e2e.plot_runs(rows)
    assert any(t.get_text() == "OOM" for ax in fig.axes for t in ax.texts)
    plt.close(fig)


def test_isolated_run_matches_in_process_hf_losses(tiny):
    here = e2e.train("hf", tiny, 2, 16, steps=1, warmup=0)
    there = e2e.run_isolated("train", mode="hf", model="tiny", batch=2, seq=16, steps=1, warmup=0)
    assert "error" not in there, there.get("error")
    assert there["loss0"] == pytest.approx(here["loss0"], abs=1e-4)


def test_isolated_run_that_fails_returns_the_error():
    row = e2e.run_isolated("train", mode="megatron", model="tiny", batch=1, seq=8)
    assert "invalid choice" in row["error"]


@pytest.mark.skipif(not hasattr(liger_lab, "patch"), reason="liger_lab.patch is not in this install")
def test_patched_model_trains_like_the_eager_one(tiny):
    # Patching is global, so the patched run happens in a fresh process; fp32 on CPU, so the first
    # losses agree closely (same weights, same batch).
    eager = e2e.train("hf", tiny, 2, 16, steps=2, warmup=0, lr=1e-3)
    patched = e2e.run_isolated("train", mode="liger_lab", model="tiny", batch=2, seq=16, steps=2, warmup=0, lr=1e-3)
    assert "error" not in patched, patched.get("error")
    assert patched["loss0"] == pytest.approx(eager["loss0"], abs=runtime.pick(cpu=1e-3, gpu=2e-2))
    assert patched["loss_last"] == pytest.approx(eager["loss_last"], abs=runtime.pick(cpu=1e-2, gpu=5e-2))
    assert patched["tokens_per_s"] > 0
