"""The sweeps of benchmarks/ in their small --quick form: launch configs passed to the launchers, chunk sizes passed
as the op's keyword, and the shape sweep's rows, resume and plot; and an op's kernel-by-kernel time
(``liger-lab bench kernels``)."""

import json

import torch

from benchmarks import sweep_chunks, sweep_shapes, sweep_tiles
from liger_lab import bench, runtime
from liger_lab.ops import rms_norm

CLOCKS = ("cuda_graph", "profiler", "wall_clock")


def test_a_launcher_takes_its_config_and_never_asks_for_the_default(monkeypatch):
    x, weight = torch.randn(37, 96, device=runtime.DEVICE), torch.randn(96, device=runtime.DEVICE)
    expected, rstd = rms_norm.rms_norm_forward(x, weight, 1e-6, 0.0, "llama")
    dx, dw = rms_norm.rms_norm_backward(torch.ones_like(x), x, weight, rstd, 0.0)

    def no_default(*args, **kwargs):
        raise AssertionError("the default launch settings were consulted")

    monkeypatch.setattr(runtime, "row_launch", no_default)
    monkeypatch.setattr(runtime, "persistent_row_launch", no_default)
    tiled = runtime.RowLaunch(block_n=128, rows=4, num_warps=1, grid=10)
    y, _ = rms_norm.rms_norm_forward(x, weight, 1e-6, 0.0, "llama", launch=tiled)
    torch.testing.assert_close(y, expected)
    persistent = runtime.RowLaunch(block_n=128, rows=8, num_warps=1, grid=3)
    got_dx, got_dw = rms_norm.rms_norm_backward(torch.ones_like(x), x, weight, rstd, 0.0, launch=persistent)
    torch.testing.assert_close((got_dx, got_dw), (dx, dw))


def test_sweep_tiles_checks_each_setting_against_the_default_and_times_it(tmp_path, capsys):
    json_path = tmp_path / "tiles.json"
    sweep_tiles.main(["--quick", "--json", str(json_path)])
    rows = json.loads(json_path.read_text())
    kernels = {(r["op"], r["kernel"]) for r in rows}
    assert {("rms_norm", "backward"), ("add_rms_norm", "forward"), ("layer_norm", "backward")} <= kernels
    assert {("cross_entropy", "loss+gradient"), ("rope", "forward+backward"), ("swiglu", "forward+backward")} <= kernels
    assert {("jsd", "beta=0.5"), ("jsd", "beta=0"), ("jsd", "beta=1")} <= kernels  # each divergence of the JSD kernel
    for kernel in kernels:
        of_kernel = [r for r in rows if (r["op"], r["kernel"]) == kernel]
        assert sum(r["default"] for r in of_kernel) == 1 and len(of_kernel) == 2, of_kernel
    assert all("error" not in r and r["ms"] > 0 and r["timer"] in CLOCKS and r["commit"] for r in rows)
    assert "rope forward+backward: fastest" in capsys.readouterr().out


def test_sweep_tiles_sweeps_one_norm_alone():
    cases = sweep_tiles.cases_of(["layer_norm"], quick=True)
    assert {(case.op, case.kernel) for case in cases} == {("layer_norm", "forward"), ("layer_norm", "backward")}


def test_sweep_tiles_drops_a_setting_that_computes_something_else():
    shape, inputs = sweep_tiles.table_inputs("rms_norm", True, torch.float32)
    assert shape == (3, 37, 96)
    forward = sweep_tiles.norm_launchers("rms_norm", inputs).forward
    settings = [
        ("too few programs", runtime.RowLaunch(block_n=128, rows=8, num_warps=1, grid=1)),  # 8 rows of 111
        ("rows=4", runtime.RowLaunch(block_n=128, rows=4, num_warps=1, grid=28)),
    ]
    cases = sweep_tiles.setting_cases("rms_norm", "forward", forward, runtime.row_launch(111, 96), settings, 1)
    rows = sweep_tiles.run(cases)
    assert rows[0]["default"] and "error" in rows[1] and "ms" in rows[2]


def test_sweep_chunks_passes_each_size_as_the_keyword_with_a_variant_and_a_peer(tmp_path):
    json_path = tmp_path / "chunks.json"
    sweep_chunks.main(["fused_linear_cross_entropy", "chunk_tokens", "32", "--quick", "--peer", "eager",
                       "--variant", "in_place_backward", "--json", str(json_path)])  # fmt: skip
    rows = json.loads(json_path.read_text())
    assert [r["impl"] for r in rows] == ["eager", "liger_lab:in_place_backward",
                                         "liger_lab:in_place_backward,chunk_tokens=32", "eager"]  # fmt: skip
    assert [r.get("position") for r in rows] == ["before", None, None, "after"]
    assert all(r["shape"] == [67, 64, 1000] and r["full_ms"] > 0 for r in rows)


def test_sweep_chunks_rounds_take_turns(tmp_path):
    json_path = tmp_path / "chunks.json"
    sweep_chunks.main(["fused_linear_cross_entropy", "chunk_tokens", "32", "--quick", "--rounds", "2",
                       "--json", str(json_path)])  # fmt: skip
    rows = json.loads(json_path.read_text())
    assert [(r["impl"], r["position"]) for r in rows] == [
        ("liger_lab", "round 1"), ("liger_lab:chunk_tokens=32", "round 1"),
        ("liger_lab", "round 2"), ("liger_lab:chunk_tokens=32", "round 2"),
    ]  # fmt: skip


def test_sweep_shapes_prints_each_row_writes_json_resumes_and_plots(tmp_path, capsys):
    json_path, plot_path = tmp_path / "shapes.json", tmp_path / "shapes.png"
    common = ["--quick", "--impl", "liger_lab", "--impl", "eager", "--json", str(json_path)]
    ops = ["--op", "rms_norm", "--op", "cross_entropy", "--op", "fused_linear_cross_entropy"]
    # No shape fits a budget of 0 s: nothing is measured, and the run says so.
    assert sweep_shapes.main([*common, *ops, "--budget-s", "0"]) == 0
    assert json.loads(json_path.read_text()) == [] and "run again with" in capsys.readouterr().out

    assert sweep_shapes.main([*common, "--op", "rms_norm", "--op", "cross_entropy", "--memory-gib", "1e-5"]) == 0
    out = capsys.readouterr().out
    assert "skipped cross_entropy (32, 300)" in out and "every shape is done" in out
    first = json.loads(json_path.read_text())
    assert (32, 300) not in {tuple(r["shape"]) for r in first if r["op"] == "cross_entropy"}

    assert sweep_shapes.main([*common, *ops, "--resume", "--plot", str(plot_path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(json_path.read_text())
    assert rows[: len(first)] == first  # kept, not measured again
    points, _ = sweep_shapes.points(
        ["rms_norm", "cross_entropy", "fused_linear_cross_entropy"], sweep_shapes.QUICK_LADDER, 100
    )
    assert {(r["op"], tuple(r["shape"]), r["impl"]) for r in rows} == {
        (p.op, p.shape, impl) for p in points for impl in ("liger_lab", "eager")
    }
    for row in rows:
        assert {"op", "impl", "shape", "gpu_ms", "clock", "wall_ms", "peak_mib", "gpu", "torch", "date"} <= set(row)
        assert row["gpu_ms"] > 0 and row["clock"] in CLOCKS
        assert row["elements"] == bench.OPS[row["op"]].elements(tuple(row["shape"]))
    assert "fused_linear_cross_entropy" in out and "liger_lab at" in out  # a peer's line gives the ratio
    assert plot_path.stat().st_size > 0


def test_the_shape_ladder_matches_the_models_it_stands_for():
    todo, skipped = sweep_shapes.points(sweep_shapes.OPS, sweep_shapes.GPU_LADDER, 100)
    shapes = {(p.op, p.shape) for p in todo}
    assert ("rope", (1, 32, 8, 2048, 128)) in shapes and ("rope", (16, 64, 16, 4096, 128)) in shapes
    assert ("swiglu", (8192, 14336)) in shapes and ("fused_linear_cross_entropy", (8192, 4096, 262144)) in shapes
    assert {p.op for p in todo} == set(sweep_shapes.OPS)
    # 17.2e9 logits, drawn in fp32 and scaled: 128 GiB while they are made.
    assert [(p.op, p.shape) for p in skipped] == [("cross_entropy", (65536, 262144))]
    _, skipped = sweep_shapes.points(["cross_entropy"], sweep_shapes.GPU_LADDER, 60)
    assert [p.shape for p in skipped] == [(65536, 151936), (32768, 262144), (65536, 262144)]


def test_bench_kernels_lists_an_ops_largest_kernels_and_its_matmul_floor(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from liger_lab import cli, profiling

    runner = CliRunner()
    assert "needs a GPU" in runner.invoke(cli.main, ["bench", "kernels", "rms_norm"]).output
    # Past the GPU check, with the profile of a GPU standing in: the kernels, largest first, and the floor.
    monkeypatch.setattr(runtime, "INTERPRET", False)
    monkeypatch.setattr(profiling, "matmul_tflops", lambda: 700.0)
    monkeypatch.setattr(cli, "_kernel_times", lambda op, impl, calls: {"gemm": 30.0, "_loss_kernel": 10.0})
    monkeypatch.setattr(cli.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(profiling, "environment", lambda: {"gpu": "NVIDIA H200"})
    json_path = tmp_path / "kernels.json"
    result = runner.invoke(cli.main, ["bench", "kernels", "fused_linear_cross_entropy", "--json", str(json_path)])
    assert result.exit_code == 0, result.output
    floor = bench.OPS["fused_linear_cross_entropy"].flops((8192, 4096, 128256)) / 700e12 * 1e3
    assert f"kernels 40.00 ms, matmul floor {floor:.2f} ms" in result.output
    assert "30.000 ms  75.0%  gemm" in result.output
    (row,) = json.loads(json_path.read_text())
    assert row["kernels_ms"] == {"gemm": 30.0, "_loss_kernel": 10.0} and row["kernel_ms"] == 40.0
    assert row["gpu"] == "NVIDIA H200" and row["commit"]
