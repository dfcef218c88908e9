import json
import math
import re
import sys
import time
import types

import pytest
import torch

import liger_lab
from liger_lab import hf, runtime
from liger_lab.e2e import isolation, training
from liger_lab.e2e.isolation import child_row, environment_of, main, parse_shape
from liger_lab.e2e.memory import (
    activation_elements_per_token,
    allocated_timeline,
    count_parameters,
    downsample_max,
    estimated_peak,
    format_breakdown,
    live_at_peak,
    memory_breakdown,
)
from liger_lab.e2e.presets import BENCHMARK_FAMILIES, MODEL_SIZES, family_of, llama_config, model_config
from liger_lab.e2e.reports import (
    BF16_RTOL,
    check_targets,
    compare_losses,
    error_summary,
    format_comparison,
    format_losses,
    format_run,
    format_targets,
    plot_runs,
    plot_timelines,
)
from liger_lab.e2e.training import (
    MODES,
    apply_mode,
    available_modes,
    base_mode,
    build_model,
    compile_available,
    is_compiled,
    kernel_category,
    kernels_by_category,
    largest_fit,
    memory_timeline,
    timer_label,
    train,
    train_step,
)

transformers = pytest.importorskip("transformers")

GIB = 2**30
TINY_PRESETS = ("tiny", "tiny-qwen3", "tiny-gemma3")
needs_patch = pytest.mark.skipif(not hasattr(liger_lab, "patch"), reason="liger_lab.patch is not in this install")


@pytest.fixture(scope="module")
def tiny():
    return llama_config("tiny")


@pytest.fixture(scope="module")
def design():
    return llama_config("1.5b")


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_parameter_count_matches_the_built_model(preset):
    config = model_config(preset)
    model = build_model(config)
    assert type(model).__name__ == family_of(config).model_class
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "preset,family,vocab,tied,params",
    [
        ("1.5b", "llama", 128256, False, 1_498_482_688),
        ("qwen3-1.5b", "qwen3", 151936, True, 1_519_230_976),
        ("gemma3-1.5b", "gemma3_text", 262144, True, 1_543_645_184),
    ],
)
def test_benchmark_presets_hold_about_1_5b_parameters_behind_their_vocabulary(preset, family, vocab, tied, params):
    config = model_config(preset)
    assert (config.model_type, config.vocab_size, config.tie_word_embeddings) == (family, vocab, tied)
    assert count_parameters(config) == params
    # The count is linear in the layers: a model of two layers, built on the meta device, checks each term.
    few = model_config(preset, layers=2)
    with torch.device("meta"):
        model = getattr(transformers, family_of(few).model_class)(few)
    assert count_parameters(few) == sum(p.numel() for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_gemma_presets_soft_cap_their_logits_and_slide_their_window():
    config, tiny = model_config("gemma3-1.5b"), model_config("tiny-gemma3")
    assert config.final_logit_softcapping == tiny.final_logit_softcapping == 30.0
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 2
    assert tiny.sliding_window < 16  # shorter than the CPU tests' sequences: the sliding mask is exercised


def test_every_family_is_one_of_the_family_table_and_names_its_classes_from_it():
    # One family table: the benchmark keys its own columns by the table's model types, and takes the causal LM
    # class from the table.
    assert set(BENCHMARK_FAMILIES) <= set(hf.FAMILIES)
    assert all(key == family.model_type for key, family in BENCHMARK_FAMILIES.items())
    assert {preset.family for preset in MODEL_SIZES.values()} == set(BENCHMARK_FAMILIES)
    for model_type, family in BENCHMARK_FAMILIES.items():
        assert family.model_class == hf.FAMILIES[model_type].name("ForCausalLM")
        assert hasattr(transformers, family.model_class)
    for name in TINY_PRESETS:
        assert model_config(name).vocab_size <= 1000


@pytest.mark.parametrize(
    "preset,function,mlp",
    [
        ("tiny", "apply_liger_kernel_to_llama", "swiglu"),
        ("tiny-qwen3", "apply_liger_kernel_to_qwen3", "swiglu"),
        ("tiny-gemma3", "apply_liger_kernel_to_gemma3_text", "geglu"),
    ],
)
def test_liger_mode_calls_the_familys_liger_kernel_function_with_liger_labs_kernels(preset, function, mlp, monkeypatch):
    # Liger-Kernel needs a GPU: a stand-in module records the call. The function names and keywords are
    # those of Liger-Kernel 0.8.5's liger_kernel.transformers.
    calls = []
    fake = types.ModuleType("liger_kernel.transformers")
    setattr(fake, function, lambda **kwargs: calls.append(kwargs))
    package = types.ModuleType("liger_kernel")
    package.transformers = fake
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    model = build_model(model_config(preset))
    assert apply_mode(model, "liger") is model
    expected = dict(rope=True, rms_norm=True, fused_linear_cross_entropy=True, cross_entropy=False)
    assert calls == [dict(model=model, **expected, **{mlp: True})]


def test_design_model_has_1498m_parameters(design):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(design)
    assert count_parameters(design) == sum(p.numel() for p in model.parameters()) == 1_498_482_688
    assert round(count_parameters(design) / 1e6) == 1498  # the params_M of the reference measurement


def test_breakdown_arithmetic(design):
    n, tokens, vocab, h = count_parameters(design), 8 * 2048, design.vocab_size, design.hidden_size
    bf16 = memory_breakdown(design, 8, 2048)
    assert bf16["weights"] == bf16["gradients"] == 2 * n
    assert bf16["AdamW states"] == 2 * 2 * n
    assert bf16["logits and loss"] == tokens * vocab * (2 + 4 + 4 + 4)
    per_layer = 6 * h + 2 * 512 + 3 * 8192  # fused: norms, projections' inputs, q k v, attention out, MLP
    eager_layer = 10 * h + 2 * 512 + 4 * 8192
    assert activation_elements_per_token(design, fused=True) == per_layer
    assert activation_elements_per_token(design, fused=False) == eager_layer
    assert bf16["activations"] == tokens * (16 * eager_layer + 4 * h) * 2
    fp32_states = memory_breakdown(design, 8, 2048, optimizer_dtype=torch.float32)
    assert fp32_states["AdamW states"] == 2 * 4 * n and fp32_states["weights"] == 2 * n
    fp32 = memory_breakdown(design, 8, 2048, dtype=torch.float32)
    assert fp32["weights"] == 4 * n and fp32["activations"] == 2 * bf16["activations"]
    assert estimated_peak(bf16) == sum(bf16.values()) - bf16["gradients"]


def test_fused_breakdown_holds_a_chunk_of_logits_not_all_of_them(design):
    fused = memory_breakdown(design, 8, 2048, fused=True, loss_chunk_tokens=512)
    h, vocab = design.hidden_size, design.vocab_size
    assert fused["logits and loss"] == vocab * h * 2 + 8 * 2048 * h * 2 + 2 * 512 * vocab * 4
    # by default a chunk of logits is about as big as the hidden states: 16384 * 2048 / 128256 -> 512 rows
    assert memory_breakdown(design, 8, 2048, fused=True)["logits and loss"] == fused["logits and loss"]
    # Four times the tokens: eager's logits grow four times, the fused loss stays a few GiB.
    eager, eager_long = (memory_breakdown(design, b, t)["logits and loss"] for b, t in ((8, 2048), (16, 4096)))
    assert eager_long == 4 * eager
    assert memory_breakdown(design, 16, 4096, fused=True)["logits and loss"] < eager / 10


def test_estimated_peaks_are_near_the_measured_anchors(design):
    # Reference H200 run: Hugging Face eager 62.6 GiB, Liger-Kernel 27.8 GiB at 8 x 2048 on one H200.
    eager = estimated_peak(memory_breakdown(design, 8, 2048)) / GIB
    fused = estimated_peak(memory_breakdown(design, 8, 2048, fused=True)) / GIB
    assert eager == pytest.approx(62.6, rel=0.05)
    assert fused == pytest.approx(27.8, rel=0.05)


def test_breakdown_table_lists_every_part(design):
    table = format_breakdown({"eager": memory_breakdown(design, 8, 2048)})
    for key in ("weights", "gradients", "AdamW states", "activations", "logits and loss", "estimated peak"):
        assert key in table
    assert " 2.79" in table  # 1498M bf16 weights in GiB


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda c: memory_breakdown(c, 0, 2048), "positive sizes"),
        (lambda c: llama_config("70b"), "expected one of"),
        (lambda c: model_config("70b"), "expected one of"),
        (lambda c: llama_config("qwen3-1.5b"), "model_config builds it"),
        (lambda c: llama_config("tiny", layers=0), "at least 1"),
        (lambda c: parse_shape("8by2048"), "BATCHxSEQ"),
        (lambda c: parse_shape("0x2048"), "positive"),
        (lambda c: train("hf", c, 1, 8, steps=0), "steps"),
        (lambda c: apply_mode(torch.nn.Linear(1, 1), "deepspeed"), "expected one of"),
        (lambda c: apply_mode(torch.nn.Linear(1, 1), "liger", loss_chunk_tokens=64), "liger_lab's option"),
    ],
)
def test_bad_input_is_a_value_error(tiny, call, message):
    with pytest.raises(ValueError, match=message):
        call(tiny)


def test_parse_shape():
    assert parse_shape("16x4096") == (16, 4096)


def test_train_tiny_model_in_process(tiny):
    row = train("hf", tiny, 2, 32, steps=2, warmup=1, lr=1e-3)
    assert row["op"] == "e2e" and row["impl"] == "hf" and (row["batch"], row["seq"]) == (2, 32)
    assert row["tokens_per_s"] > 0 and "oom" not in row
    # Random tokens: the first loss is about log(vocabulary); three steps on one batch lower it.
    assert row["loss0"] == pytest.approx(math.log(tiny.vocab_size), abs=0.5)
    assert row["loss_last"] < row["loss0"]
    assert (row["peak_gib"] is None) == runtime.INTERPRET
    assert row["params_M"] == round(count_parameters(tiny) / 1e6, 2) and row["layers"] == 2
    assert row["gpu"] and row["torch"] == torch.__version__


def test_out_of_memory_is_reported_not_raised(tiny, monkeypatch):
    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.83 GiB")

    monkeypatch.setattr(training, "train_step", out_of_memory)
    row = train("hf", tiny, 16, 4096, steps=1, warmup=0)
    assert row["oom"] is True and "tokens_per_s" not in row
    assert (row["impl"], row["batch"], row["seq"]) == ("hf", 16, 4096)


def test_largest_fit_stops_at_the_first_size_out_of_memory(tiny, monkeypatch):
    def limited(model, optimizer, tokens):
        if tokens.numel() > 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return train_step(model, optimizer, tokens)

    monkeypatch.setattr(training, "train_step", limited)
    fit = largest_fit("hf", tiny, [(4, 32), (1, 16), (2, 32), (1, 32)])
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
    times, allocated = allocated_timeline(trace, start_bytes=10)
    assert allocated == [110, 160, 60]
    assert times == [0.0, 0.5, 1.5]
    times, _ = allocated_timeline([{k: v for k, v in e.items() if k != "time_us"} for e in trace])
    assert times == [1.0, 2.0, 4.0]  # event numbers when the trace has no times


def test_live_at_peak_lists_what_is_allocated_at_the_highest_point():
    def frames(*names):
        return [{"filename": f"/site-packages/{path}", "line": 1, "name": name} for path, name in names]

    loss = frames(("torch/autograd/function.py", "apply"), ("liger_lab/ops/chunked.py", "loss"))
    adam = frames(("torch/optim/adamw.py", "step"), ("liger_lab/e2e.py", "_step"))
    trace = [
        {"action": "alloc", "addr": 1, "size": 3 << 20, "frames": loss},
        {"action": "alloc", "addr": 2, "size": 1 << 20},
        {"action": "free_completed", "addr": 2, "size": 1 << 20},
        {"action": "alloc", "addr": 3, "size": 2 << 20, "frames": adam},  # 3 + 2 MiB
        {"action": "free_completed", "addr": 1, "size": 3 << 20},
        {"action": "alloc", "addr": 4, "size": 4 << 20},  # 2 + 4 MiB: the peak
        {"action": "free_completed", "addr": 4, "size": 4 << 20},
    ]
    assert [row["mib"] for row in live_at_peak(trace)] == [4.0, 2.0]
    # Cut before the 4 MiB block, the trace peaks at 5 MiB.
    assert live_at_peak(trace[:5]) == [
        {"mib": 3.0, "blocks": 1, "largest_mib": 3.0, "where": "chunked.py:1 loss"},  # torch's own frames left out
        {"mib": 2.0, "blocks": 1, "largest_mib": 2.0, "where": "adamw.py:1 step < e2e.py:1 _step"},  # but optimizers'
    ]
    assert live_at_peak(trace, top=1) == [{"mib": 4.0, "blocks": 1, "largest_mib": 4.0, "where": "?"}]


def test_live_at_peak_groups_blocks_allocated_at_one_place():
    layer = [{"filename": "/site-packages/transformers/modeling_x.py", "line": 7, "name": "forward"}]
    trace = [{"action": "alloc", "addr": i, "size": (1 + i % 2) << 20, "frames": layer} for i in range(4)]
    trace.append({"action": "alloc", "addr": 9, "size": 5 << 20})
    assert live_at_peak(trace) == [
        {"mib": 6.0, "blocks": 4, "largest_mib": 2.0, "where": "modeling_x.py:7 forward"},
        {"mib": 5.0, "blocks": 1, "largest_mib": 5.0, "where": "?"},
    ]


def test_downsampling_keeps_the_peak():
    values = [i % 97 for i in range(10_000)]
    values[5_555] = 1_000
    times, kept = downsample_max(list(range(10_000)), values, points=100)
    assert len(kept) <= 100 and max(kept) == 1_000 and times[kept.index(1_000)] == 5_555


def test_memory_timeline_says_it_needs_a_gpu_on_cpu(tiny):
    if not runtime.INTERPRET:
        pytest.skip("on the GPU the timeline is recorded (see the e2e benchmark)")
    timeline = memory_timeline("hf", tiny, 1, 8)
    assert timeline["t_ms"] == [] and "CUDA GPU" in timeline["note"]
    plot_timelines([timeline])


def test_plot_runs_marks_out_of_memory():
    import matplotlib.pyplot as plt

    rows = [
        {"impl": "hf", "batch": 8, "seq": 2048, "tokens_per_s": 50000.0, "peak_gib": 62.6},
        {"impl": "hf", "batch": 16, "seq": 4096, "oom": True},
    ]
    fig = plot_runs(rows)
    assert any(t.get_text() == "OOM" for ax in fig.axes for t in ax.texts)
    plt.close(fig)


def test_isolated_run_matches_in_process_hf_losses(tiny):
    here = train("hf", tiny, 2, 16, steps=1, warmup=0)
    there = isolation.run_isolated("train", mode="hf", model="tiny", batch=2, seq=16, steps=1, warmup=0)
    assert "error" not in there, there.get("error")
    assert there["loss0"] == pytest.approx(here["loss0"], abs=1e-4)


def test_isolated_run_that_fails_returns_the_error():
    row = isolation.run_isolated("train", mode="megatron", model="tiny", batch=1, seq=8)
    assert "invalid choice" in row["error"]


def test_child_still_running_after_its_timeout_is_killed_and_reported():
    start = time.perf_counter()
    row = child_row([sys.executable, "-c", "import time; time.sleep(60)"], {"impl": "hf"}, timeout_s=0.5)
    assert row["timeout"] is True and row["impl"] == "hf" and "0.5 s" in row["error"]
    assert time.perf_counter() - start < 30


def test_child_row_is_the_last_json_line_and_a_failure_says_why(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(
        "import json, sys\n"
        "if sys.argv[1] == 'broken':\n    sys.exit('no row for this mode')\n"
        "print('a line that is not a row')\n"
        "print(json.dumps({'mode': sys.argv[1], 'batch': 3}))\n"
    )
    assert child_row([sys.executable, str(script), "fine"], {"mode": "fine"}) == {"mode": "fine", "batch": 3}
    broken = child_row([sys.executable, str(script), "broken"], {"mode": "broken"})
    assert broken["mode"] == "broken" and "no row for this mode" in broken["error"]


def test_a_child_with_no_time_left_is_not_started(monkeypatch):
    monkeypatch.setattr(isolation.subprocess, "run", lambda *a, **k: pytest.fail("must not start a child"))
    row = isolation.run_isolated("fit", mode="hf", model="tiny", shapes=[(1, 16)], timeout_s=0)
    assert row == {"op": "e2e_fit", "impl": "hf", "model": "tiny", "shapes": [[1, 16]],
                   "error": "not run: no time left", "skipped": True}  # fmt: skip


def test_failed_rows_take_the_run_environment_from_the_rows_that_ran():
    rows = [{"impl": "hf", "error": "boom"}, {"impl": "liger_lab", "gpu": "NVIDIA H200", "torch": "2.11", "x": 1}]
    assert environment_of(rows) == {"gpu": "NVIDIA H200", "torch": "2.11", "timer": timer_label()}
    assert environment_of(rows[:1]) == {"timer": timer_label()}  # nothing ran: the parent asks no GPU


def test_kernel_times_add_up_by_kind_and_bound_what_fused_kernels_can_gain():
    kernels = {"sm90_xmma_gemm_bf16": 60.0, "flash_fwd_kernel": 10.0, "multi_tensor_apply_kernel": 5.0,
               "_rms_norm_backward_kernel": 8.0, "_swiglu_forward": 2.0, "Memcpy DtoD (Device -> Device)": 1.0,
               "void at::native::vectorized_elementwise_kernel": 4.0}  # fmt: skip
    assert [kernel_category(name) for name in kernels] == [
        "matmul", "attention", "optimizer", "fused (Triton)", "fused (Triton)", "copies", "other PyTorch"
    ]  # fmt: skip
    summary = kernels_by_category(kernels)
    assert summary["kernel_ms"] == 90.0 and list(summary["by_category_ms"])[0] == "matmul"
    assert summary["fused_kernels_ms"] == {"_rms_norm_backward_kernel": 8.0, "_swiglu_forward": 2.0}
    assert summary["bound_if_fused_took_zero"] == round(90 / 80, 4)


def test_profile_task_says_it_needs_a_gpu_on_cpu(tiny, capsys):
    if not runtime.INTERPRET:
        pytest.skip("on the GPU the step is profiled (benchmarks/profile_e2e.py)")
    main(["profile", "--mode", "hf", "--model", "tiny", "--batch", "1", "--seq", "8"])
    row = json.loads(capsys.readouterr().out)
    assert row == {"op": "e2e_profile", "impl": "hf", "batch": 1, "seq": 8, "note": "kernel profiles need a CUDA GPU",
                   "model": "tiny"}  # fmt: skip


@needs_patch
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_patched_model_trains_like_the_eager_one(preset):
    # Patching is global, so the patched run happens in a fresh process; fp32 on CPU, so the first
    # losses agree closely (same weights, same batch).
    eager = train("hf", model_config(preset), 2, 16, steps=2, warmup=0, lr=1e-3)
    patched = isolation.run_isolated(
        "train", mode="liger_lab", model=preset, batch=2, seq=16, steps=2, warmup=0, lr=1e-3
    )
    assert "error" not in patched, patched.get("error")
    assert patched["loss0"] == pytest.approx(eager["loss0"], abs=runtime.pick(cpu=1e-3, gpu=2e-2))
    assert patched["loss_last"] == pytest.approx(eager["loss_last"], abs=runtime.pick(cpu=1e-2, gpu=5e-2))
    assert patched["tokens_per_s"] > 0


# --------------------------------------------------------------------------------------------------
# torch.compile modes, loss curves, targets


def _curve_row(impl, losses, *, batch=8, seq=2048, warmup=2, **fields):
    return {"op": "e2e", "impl": impl, "batch": batch, "seq": seq, "warmup": warmup, "losses": losses,
            "loss0": losses[0], "loss_last": losses[-1], **fields}  # fmt: skip


def test_compile_modes_are_listed_after_their_eager_modes():
    assert {"hf+compile", "liger_lab+compile"} <= set(MODES)
    modes = available_modes()
    if not compile_available():
        pytest.skip("torch.compile cannot run here")
    assert "hf+compile" in modes
    assert ("liger_lab+compile" in modes) == ("liger_lab" in modes)
    assert all(modes.index(base_mode(m)) < modes.index(m) for m in modes if is_compiled(m))


def test_apply_mode_compiles_the_model_in_place(tiny):
    model = build_model(tiny)
    parameters = list(model.parameters())
    assert apply_mode(model, "hf+compile", compile_backend="eager") is model
    assert model._compiled_call_impl is not None  # model(...) now runs the compiled forward
    assert list(model.parameters()) == parameters  # the optimizer keeps training the same tensors


def test_apply_mode_passes_torch_compile_s_mode(tiny, monkeypatch):
    model = build_model(tiny)
    calls = []
    monkeypatch.setattr(model, "compile", lambda **options: calls.append(options))
    apply_mode(model, "hf+compile", compile_mode="reduce-overhead")
    apply_mode(model, "hf+compile")
    assert calls == [{"backend": "inductor", "mode": "reduce-overhead"}, {"backend": "inductor", "mode": None}]


def test_wall_clock_variants_train_both_compiled_models_under_reduce_overhead(monkeypatch):
    from benchmarks import wall_clock

    children = []
    monkeypatch.setattr(wall_clock, "run_child", lambda args: children.append(args) or {"args": args})
    wall_clock.e2e_rows(lambda row: None, variants=[], sizes=["8x512"])
    reduced = [args for args in children if "--compile-mode" in args]
    assert {args[args.index("--mode") + 1] for args in reduced} == {"hf+compile", "liger_lab+compile"}
    assert all(args[args.index("--compile-mode") + 1] == "reduce-overhead" for args in reduced)
    children.clear()
    wall_clock.e2e_rows(lambda row: None, variants=["reduce-overhead"], sizes=["8x512"], defaults=False)
    assert children == reduced


def test_loss_curves_that_agree_and_one_that_does_not_move():
    # The reference H200 run (anchors/h200-e2e-compile-2026-11-30.jsonl): hf 12.1574 -> 11.5362 in 7 steps;
    # liger_lab + torch.compile stayed at 12.1574.
    falling = [12.1574, 12.06, 11.95, 11.84, 11.74, 11.64, 11.5362]
    rows = [
        _curve_row("liger_lab", falling),
        _curve_row("liger_lab+compile", [v * (1 + 2e-4) for v in falling]),
        _curve_row("hf+compile", [12.1574] * 7),
    ]
    agree = compare_losses(rows, "liger_lab", "liger_lab+compile")
    assert agree["agree"] is True and agree["steps"] == 7 and (agree["batch"], agree["seq"]) == (8, 2048)
    flat = compare_losses(rows, "liger_lab", "hf+compile")
    assert flat["agree"] is False and "differ from step 1" in flat["detail"]
    assert "DISAGREE" in format_comparison(flat)
    # a tighter tolerance turns bf16-sized differences into a disagreement
    assert compare_losses(rows, "liger_lab", "liger_lab+compile", rtol=1e-5)["agree"] is False


def test_loss_curves_compare_the_steps_both_ran_at_the_same_size():
    rows = [
        _curve_row("hf", [7.0, 6.5], warmup=0, batch=2, seq=16),
        _curve_row("hf+compile", [7.0, 6.5, 6.1], warmup=1, batch=2, seq=16),
        _curve_row("hf+compile", [9.0, 9.0, 9.0], batch=4, seq=16),
    ]
    result = compare_losses(rows, "hf", "hf+compile", rtol=1e-6, batch=2, seq=16)
    assert result["agree"] is True and result["steps"] == 2
    missing = compare_losses(rows + [{"op": "e2e", "impl": "liger_lab", "batch": 2, "seq": 16, "error": "x"}])
    assert missing["agree"] is None and "no loss curve for liger_lab and liger_lab+compile" in missing["detail"]


def test_targets_of_the_compiled_patched_model():
    falling = [12.16, 12.0, 11.8]
    rows = [
        _curve_row("liger_lab", falling, tokens_per_s=68010.0, peak_gib=27.82),
        _curve_row("hf+compile", falling, tokens_per_s=59758.0, peak_gib=41.89),
        _curve_row("liger_lab+compile", falling, tokens_per_s=68500.0, peak_gib=31.37),
    ]
    results = check_targets(rows)
    assert [r["met"] for r in results] == [True, True, True, False]
    assert results[2]["bound"] == pytest.approx(1.12 * 59758.0) and "1.12x hf+compile" in results[2]["target"]
    table = format_targets(results)
    assert "MISSED" in table and "31.4 against 27.8" in table
    # no peak on CPU, no compiled row: nothing to compare rather than a verdict
    rows[2].update(peak_gib=None)
    assert check_targets(rows)[3]["met"] is None
    assert all(r["met"] is None for r in check_targets(rows[:2]))


def test_failed_compile_run_names_the_exception_not_the_advice():
    error = (
        "Traceback (most recent call last):\n  ...\ntorch._dynamo.exc.BackendCompilerFailed: backend='inductor' "
        "raised:\nAssertionError: Node getitem_23 was invalid, but is output\n\nSet TORCHDYNAMO_VERBOSE=1 for "
        "the internal stack trace"
    )
    line = format_run({"impl": "liger_lab+compile", "batch": 2, "seq": 16, "error": error})
    assert line.endswith("error: AssertionError: Node getitem_23 was invalid, but is output")
    assert "no losses (the run failed)" in format_losses({"impl": "x", "batch": 2, "seq": 16, "error": error})


needs_compile = pytest.mark.skipif(not compile_available(), reason="torch.compile cannot run here")


@needs_compile
def test_hf_compile_trains_like_eager_hf_and_times_no_compilation(tiny):
    # The default backend (inductor: C++ on CPU) in a fresh process, against eager in this one.
    eager = train("hf", tiny, 2, 16, steps=3, warmup=1, lr=1e-3)
    compiled = isolation.run_isolated(
        "train", mode="hf+compile", model="tiny", batch=2, seq=16, steps=3, warmup=0, lr=1e-3
    )
    assert "error" not in compiled, compiled.get("error")
    assert compiled["warmup"] == 1  # compilation always gets a warm-up step of its own
    assert compiled["compile_backend"] == "inductor" and compiled["compile_s"] > 0
    assert compiled["graphs"] >= 1 and compiled["timed_compiles"] == 0 and compiled["graph_breaks"] == 0
    assert len(compiled["losses"]) == len(eager["losses"]) == 4
    assert all(round(v, 5) == v for v in compiled["losses"])
    # fp32 on CPU: the compiled graph computes the same losses up to reassociation
    verdict = compare_losses([eager, compiled], "hf", "hf+compile", rtol=runtime.pick(cpu=1e-4, gpu=BF16_RTOL))
    assert verdict["agree"] is True, verdict["detail"]
    losses = compiled["losses"]
    # it learns the batch, step after step
    assert all(b < a for a, b in zip(losses[:-1], losses[1:], strict=True)), losses
    assert compiled["loss0"] == pytest.approx(math.log(tiny.vocab_size), abs=0.5)


@needs_compile
def test_bench_e2e_prints_each_run_the_loss_curves_and_the_verdict(tmp_path):
    from click.testing import CliRunner

    from liger_lab import cli

    json_path = tmp_path / "e2e.json"
    args = ["bench", "e2e", "--mode", "hf", "--mode", "hf+compile", "--model", "tiny", "--batch", "2", "--seq", "16",
            "--steps", "2", "--warmup", "1", "--compile-backend", "aot_eager", "--compile-mode", "reduce-overhead",
            "--json", str(json_path)]  # fmt: skip
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(json_path.read_text())
    assert [r["impl"] for r in rows] == ["hf", "hf+compile"]
    assert all(len(r["losses"]) == 3 for r in rows) and rows[1]["compile_backend"] == "aot_eager"
    assert rows[1]["compile_mode"] == "reduce-overhead" and "compile_mode" not in rows[0]  # the eager mode ignores it
    for row in rows:
        assert format_run(row, rows) in result.output
        assert format_losses(row) in result.output and " | " in format_losses(row)
    assert "losses hf+compile vs hf at 2x16: agree" in result.output
    assert "targets of" not in result.output  # only when liger_lab+compile ran


@needs_compile
@pytest.mark.skipif(not hasattr(liger_lab, "patch"), reason="liger_lab.patch is not in this install")
def test_liger_lab_compile_trains_like_eager_liger_lab():
    run = dict(model="tiny", batch=2, seq=16, steps=2, warmup=1, lr=1e-3)
    eager = isolation.run_isolated("train", mode="liger_lab", **run)
    compiled = isolation.run_isolated("train", mode="liger_lab+compile", compile_backend="aot_eager", **run)
    assert "error" not in eager, eager.get("error")
    assert "error" not in compiled, error_summary(compiled["error"])
    verdict = compare_losses([eager, compiled], rtol=runtime.pick(cpu=1e-4, gpu=BF16_RTOL))
    assert verdict["agree"] is True, verdict["detail"]
    assert compiled["losses"][-1] < compiled["losses"][0]
    assert compiled["timed_compiles"] == 0
    assert compiled["graph_breaks"] == 0  # every op is a custom operator: one graph for the whole model


# --------------------------------------------------------------------------------------------------
# liger-lab bench e2e over presets: each mode against a reference mode (Liger-Kernel) on three vocabularies


def _bench_e2e(*args: str):
    from click.testing import CliRunner

    from liger_lab import cli

    return CliRunner().invoke(cli.main, ["bench", "e2e", *args])


def _target_line(out: str, target: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(target))


def test_bench_e2e_offers_every_preset():
    from liger_lab import cli

    models = next(p for p in cli.bench_e2e.params if p.name == "models")
    assert list(models.type.choices) == sorted(MODEL_SIZES) and models.multiple


def test_bench_e2e_sets_each_preset_against_a_reference_mode(tmp_path, monkeypatch):
    # Children stand in for GPU runs: (tokens/s, peak GiB, largest batch at 4096) per mode; Liger-Kernel fails
    # on the Gemma preset.
    measured = {"hf": (40000.0, 62.6, 2), "liger": (66800.0, 27.8, 16), "liger_lab": (68000.0, 27.8, 12)}
    calls = []

    def run_isolated(task, *, mode, model, timeout_s, shapes=(), **sizes):
        calls.append((model, mode, task, timeout_s))
        if mode == "liger" and model == "gemma3-1.5b":
            return {"op": "e2e", "impl": mode, "model": model, "batch": 8, "seq": 2048, "error": "ImportError: no mod"}
        speed, peak, largest = measured[mode]
        if task == "fit":
            fits = [{"batch": b, "seq": t, "peak_gib": 100.0} for b, t in shapes if b <= largest]
            oom = next([b, t] for b, t in shapes if b > largest)
            return {"op": "e2e_fit", "impl": mode, "model": model, "fits": fits, "oom_at": oom,
                    "largest": [largest, 4096]}  # fmt: skip
        losses = [12.16, 12.0, 11.8]
        return {"op": "e2e", "impl": mode, "model": model, "batch": sizes["batch"], "seq": sizes["seq"], "warmup": 0,
                "tokens_per_s": speed, "peak_gib": peak, "losses": losses, "loss0": losses[0], "loss_last": losses[-1],
                "gpu": "NVIDIA H200"}  # fmt: skip

    from liger_lab import cli

    monkeypatch.setattr(cli, "run_isolated", run_isolated)
    monkeypatch.setattr(cli, "available_modes", lambda: list(MODES))
    json_path = tmp_path / "vocab.json"
    fit = ",".join(f"{b}x4096" for b in (1, 2, 4, 8, 12, 16, 24, 32))
    result = _bench_e2e("--model", "1.5b", "--model", "gemma3-1.5b", "--mode", "hf", "--mode", "liger", "--mode",
                        "liger_lab", "--batch", "8", "--seq", "2048", "--fit", fit, "--reference", "liger",
                        "--timeout-s", "120", "--json", str(json_path))  # fmt: skip
    out = result.output
    assert result.exit_code == 1, out  # Liger-Kernel failed
    assert [c[:3] for c in calls[:4]] == [("1.5b", m, "train") for m in ("hf", "liger", "liger_lab")] + [
        ("1.5b", "hf", "fit")
    ]  # fmt: skip
    assert len(calls) == 12 and all(c[3] == 120 for c in calls)
    rows = json.loads(json_path.read_text())
    # Every row names the GPU (a failed one takes it from those that ran), the clock and the commit.
    assert len(rows) == 12 and all(r["gpu"] == "NVIDIA H200" and r["timer"] and "commit" in r for r in rows)
    llama, gemma = out.split("\nmodel gemma3-1.5b: ")
    assert "model 1.5b: llama, 1,498,482,688 parameters, 16 layers, vocabulary 128256" in llama
    assert re.search(r"liger_lab\s+68000\s+1\.02x\s+27\.8\s+1\.00x\s+12\s+0\.75x", llama)
    assert "largest fit liger_lab         12x4096 trains, peak 100.0 GiB (first out of memory: 16x4096)" in llama
    assert " met " in _target_line(llama, "peak GiB <= liger") and " met " in _target_line(llama, "tokens/s >=")
    assert "MISSED   12.0 against 16.0" in _target_line(llama, "largest batch >= liger")
    assert "losses liger_lab vs hf at 8x2048: agree" in llama
    assert "gemma3_text, 1,543,645,184 parameters" in gemma
    assert all(" n/a " in _target_line(gemma, t) for t in ("peak GiB", "tokens/s", "largest batch"))
    assert "error: ImportError: no mod" in gemma


def test_bench_e2e_starts_nothing_past_its_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(isolation.subprocess, "run", lambda *a, **k: pytest.fail("must not start a child"))
    json_path = tmp_path / "e2e.json"
    result = _bench_e2e("--model", "tiny", "--mode", "hf", "--fit", "1x16", "--budget-s", "0", "--json", str(json_path))
    assert result.exit_code == 1, result.output
    rows = json.loads(json_path.read_text())
    assert [(r["op"], r["skipped"]) for r in rows] == [("e2e", True), ("e2e_fit", True)]
    assert "not run: no time left" in result.output


def test_bench_e2e_reference_must_be_a_mode_of_the_run():
    result = _bench_e2e("--model", "tiny", "--mode", "hf", "--reference", "liger")
    assert result.exit_code == 2 and "add --mode liger" in result.output


@pytest.mark.slow
@needs_patch
def test_bench_e2e_trains_a_tiny_preset_per_mode_against_a_reference_here(tmp_path):
    json_path = tmp_path / "vocab.json"
    result = _bench_e2e("--model", "tiny-gemma3", "--mode", "hf", "--mode", "liger_lab", "--batch", "1", "--seq", "16",
                        "--steps", "1", "--warmup", "1", "--fit", "1x16,2x16", "--reference", "hf",
                        "--json", str(json_path))  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(json_path.read_text())
    assert [(r["impl"], r["op"]) for r in rows] == [("hf", "e2e"), ("liger_lab", "e2e"), ("hf", "e2e_fit"),
                                                    ("liger_lab", "e2e_fit")]  # fmt: skip
    assert all(r["model"] == "tiny-gemma3" and r["family"] == "gemma3_text" and r["transformers"] for r in rows)
    assert all(r["largest"] == [2, 16] for r in rows if r["op"] == "e2e_fit")
    assert "losses liger_lab vs hf at 1x16: agree" in result.output
    assert " met " in _target_line(result.output, "largest batch >= hf")
