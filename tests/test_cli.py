import dataclasses
import json
import math
import socket
from pathlib import Path

import nbformat
import pytest
import torch
from click.testing import CliRunner

import liger_lab
from liger_lab import cli, op_checks, reference, runtime
from liger_lab.op_table import OPS as TABLE

ROOT = Path(__file__).resolve().parents[1]
VERSION_KEYS = {"gpu", "torch", "triton", "liger_lab"}


def invoke(*args: str):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def test_help_names_every_command():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("check", "bench", "exercises"):
        assert command in result.output
    bench_help = invoke("bench", "--help").output
    assert "ops" in bench_help and "e2e" in bench_help


def test_check_passes_for_every_op_of_the_table():
    result = invoke("check")
    assert result.exit_code == 0, result.output
    rows = [
        line.split()
        for line in result.output.splitlines()
        if line.split()[:1] and line.split()[0] in op_checks.CHECK_OPS
    ]
    assert set(op_checks.CHECK_OPS) == set(TABLE)
    for op in op_checks.CHECK_OPS:
        statuses = {row[1]: row[-1] for row in rows if row[0] == op}
        assert statuses == {op_checks.DTYPE_NAMES[dtype]: "PASS" for dtype in op_checks.check_dtypes()}, (
            op,
            result.output,
        )
    assert f"{2 * len(TABLE)} passed, 0 failed" in result.output


def test_check_reports_worst_relative_error_of_all_comparisons():
    results = op_checks.run_checks(["rms_norm"], [torch.float32])
    (only,) = results
    assert only.status == "PASS" and 0 < only.worst_rel_error < 1e-5
    # three comparisons (output, grad x, grad weight): the worst is the largest printed figure (printed to 2 digits)
    figures = [float(line.split("rel L2 ")[1].split()[0]) for line in only.detail.splitlines()]
    assert len(figures) == 3 and f"{only.worst_rel_error:.1e}" == f"{max(figures):.1e}"


def test_an_ops_own_tolerance_reaches_its_check():
    assert op_checks.case_for("fused_linear_dpo", torch.float32).tol == 1e-4
    assert op_checks.case_for("rms_norm", torch.float32).tol is None  # checks.TOLERANCE's
    case = op_checks.case_for("rms_norm", torch.float32)
    wrong = dataclasses.replace(case, fn=lambda *args: 1.001 * case.fn(*args))
    assert op_checks.run_case(wrong).status == "FAIL"
    assert op_checks.run_case(dataclasses.replace(wrong, tol=1e-2)).status == "PASS"


def test_check_fails_with_exit_code_1_when_a_kernel_is_wrong(monkeypatch):
    monkeypatch.setattr(liger_lab, "rms_norm", lambda x, w, eps=1e-6: 1.01 * reference.rms_norm(x, w, eps))
    result = invoke("check", "--op", "rms_norm")
    assert result.exit_code == 1
    assert "FAIL rms_norm: output" in result.output
    assert "0 passed, 2 failed" in result.output


def test_a_kernel_that_raises_is_a_failure_not_a_crash(monkeypatch):
    def broken(x, w, eps=1e-6):
        raise ValueError("x has shape (3,): expected something else")

    monkeypatch.setattr(liger_lab, "rms_norm", broken)
    result = invoke("check", "--op", "rms_norm")
    assert result.exit_code == 1
    assert "ValueError: x has shape (3,)" in result.output


def test_unknown_op_is_a_usage_error():
    result = invoke("check", "--op", "softmax")
    assert result.exit_code == 2 and "softmax" in result.output


def _rows_are_valid(rows, op):
    assert rows and all(row["op"] == op for row in rows)
    for row in rows:
        assert VERSION_KEYS <= set(row)
        assert row["torch"] == torch.__version__ and row["liger_lab"] == liger_lab.__version__
        assert math.isfinite(row["fwd_ms"]) and row["fwd_ms"] > 0
        assert math.isfinite(row["full_ms"]) and row["full_ms"] > 0
        assert "peak_mib" in row and (row["peak_mib"] is None) == runtime.INTERPRET


def test_bench_ops_writes_json_rows_and_a_plot(tmp_path):
    json_path, plot_path = tmp_path / "out" / "ops.json", tmp_path / "ops.png"
    result = invoke("bench", "ops", "--op", "rms_norm", "--shape", "8x48", "--json", str(json_path),
                    "--plot", str(plot_path))  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(json_path.read_text())
    _rows_are_valid(rows, "rms_norm")
    assert {row["impl"] for row in rows} == set(cli.bench.OPS["rms_norm"].available())
    assert plot_path.stat().st_size > 0
    assert "fwd+bwd ms" in result.output
    # Each implementation's line is printed as it finishes, before the table (which starts with its timer).
    progress = [line.split()[:2] for line in result.output.split("timer:")[0].splitlines() if " fwd+bwd " in line]
    assert progress == [["rms_norm", impl] for impl in cli.bench.OPS["rms_norm"].available()]


def test_bench_ops_with_a_failing_kernel_still_measures_the_others(monkeypatch, tmp_path):
    def broken(x, w):
        raise ValueError("broken kernel")

    monkeypatch.setattr(liger_lab, "rms_norm", broken)
    json_path = tmp_path / "ops.json"
    result = invoke("bench", "ops", "--op", "rms_norm", "--impl", "liger_lab", "--impl", "eager", "--shape", "4x16",
                    "--json", str(json_path))  # fmt: skip
    assert result.exit_code == 1, result.output  # a failure is reported, and the other rows are written
    assert "FAILED rms_norm liger_lab" in result.output and "broken kernel" in result.output
    assert [row["impl"] for row in json.loads(json_path.read_text())] == ["eager"]


def test_bench_ops_rejects_a_bad_shape():
    result = invoke("bench", "ops", "--op", "rms_norm", "--shape", "8xfoo")
    assert result.exit_code == 2 and "expected sizes joined by x" in result.output


def test_bench_e2e_runs_a_tiny_model_in_a_fresh_process(tmp_path):
    json_path = tmp_path / "e2e.json"
    result = invoke("bench", "e2e", "--mode", "hf", "--model", "tiny", "--batch", "2", "--seq", "16", "--steps", "1",
                    "--warmup", "0", "--breakdown", "--lengths", "--json", str(json_path))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "analytic memory of one step, batch 2 x seq 16" in result.output
    row, lengths = json.loads(json_path.read_text())
    assert row["op"] == "e2e" and row["impl"] == "hf" and (row["batch"], row["seq"]) == (2, 16)
    assert row["tokens_per_s"] > 0 and math.isfinite(row["loss0"])
    assert row["host_ms_per_step"] > 0 and row["gpu_ms_per_step"] is None  # no GPU time in the interpreter
    assert VERSION_KEYS <= set(row)
    # --lengths: one more run per mode, over 10 new sequence lengths, with its table
    assert lengths["op"] == "e2e_lengths" and len(lengths["lengths"]) == len(set(lengths["lengths"])) == 10
    assert lengths["ms_per_step"] > 0 and lengths["host_ms_per_step"] > 0
    assert "over 10 new lengths, batch 2:" in result.output and "1st pass s" in result.output


def test_e2e_sizes_pair_up():
    assert cli._pair_sizes([8, 16], [2048, 4096]) == [(8, 2048), (16, 4096)]
    assert cli._pair_sizes([8], [1024, 2048]) == [(8, 1024), (8, 2048)]
    with pytest.raises(Exception, match="one --seq per --batch"):
        cli._pair_sizes([1, 2], [3, 4, 5])


def test_exercises_regenerates_chapters(tmp_path, monkeypatch):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("x = 1\n# BEGIN SOLUTION 1.1: add one\ny = x + 1\n# END SOLUTION\n")]
    (tmp_path / "solutions").mkdir()
    nbformat.write(notebook, tmp_path / "solutions" / "01_demo.ipynb")
    monkeypatch.chdir(tmp_path)
    result = invoke("exercises")
    assert result.exit_code == 0 and "01_demo.ipynb" in result.output
    source = "".join(nbformat.read(tmp_path / "chapters" / "01_demo.ipynb", as_version=4).cells[0].source)
    assert "y = x + 1" not in source and "EXERCISE 1.1: add one" in source


def test_benchmark_script_runs_at_tiny_sizes(tmp_path):
    from benchmarks import run as script

    assert script.main(["--op", "rms_norm", "--out", str(tmp_path), "--name", "t"]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())
    assert {"ceiling_copy", "ceiling_matmul_bf16", "rms_norm"} == {row["op"] for row in rows}
    assert all(VERSION_KEYS <= set(row) for row in rows)
    ops = [row for row in rows if row["op"] == "rms_norm" and "sweep" not in row]
    _rows_are_valid(ops, "rms_norm")
    sweep = [row for row in rows if row.get("sweep") == "norms"]
    hiddens, token_counts = script.sweep_sizes(quick=False)
    impls = set(cli.bench.OPS["rms_norm"].available())
    assert {(r["tokens"], r["hidden"], r["impl"]) for r in sweep} == {
        (t, h, i) for t in token_counts for h in hiddens for i in impls
    }
    assert len(script.winners(sweep)) == len(hiddens) * len(token_counts)
    assert (tmp_path / "t-ops.png").exists() and (tmp_path / "t-norms.png").exists()


def _workbook_launch(monkeypatch, tmp_path, args, *, euid, display):
    launched = {}
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: launched.update(path=path, argv=argv))
    monkeypatch.setattr(cli.os, "geteuid", lambda: euid)
    monkeypatch.setattr(cli.sys, "platform", "linux")
    monkeypatch.setattr(cli, "jupyterlab_installed", lambda: True)
    monkeypatch.setattr(cli, "port_is_free", lambda ip, port: True)
    for name in ("DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    if display:
        monkeypatch.setenv("DISPLAY", ":0")
    result = CliRunner().invoke(cli.main, ["workbook", "--folder", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    return launched["argv"], result.output


def test_workbook_as_root_without_display_is_headless_and_prints_its_url(monkeypatch, tmp_path):
    argv, output = _workbook_launch(monkeypatch, tmp_path, ["--ip", "0.0.0.0", "--port", "8890"], euid=0, display=False)
    assert argv[1:5] == ["-m", "jupyter", "lab", str(tmp_path)]
    assert {"--allow-root", "--no-browser", "--ServerApp.ip=0.0.0.0", "--ServerApp.port=8890"} <= set(argv)
    assert "--ServerApp.port_retries=0" in argv
    (token_option,) = [a for a in argv if a.startswith("--IdentityProvider.token=")]
    token = token_option.split("=", 1)[1]
    assert len(token) >= 32
    assert f"http://127.0.0.1:8890/lab?token={token}" in output


def test_workbook_as_a_user_with_a_display_opens_a_browser(monkeypatch, tmp_path):
    argv, output = _workbook_launch(monkeypatch, tmp_path, [], euid=1000, display=True)
    assert "--allow-root" not in argv and "--no-browser" not in argv
    assert "--ServerApp.ip=127.0.0.1" in argv and "--ServerApp.port=8888" in argv
    assert "http://127.0.0.1:8888/lab?token=" in output


def test_workbook_rejects_a_bad_port_before_starting(monkeypatch, tmp_path):
    monkeypatch.setattr(cli.os, "execv", lambda *a: pytest.fail("must not start"))
    result = CliRunner().invoke(cli.main, ["workbook", "--folder", str(tmp_path), "--port", "70000"])
    assert result.exit_code != 0 and "70000" in result.output


def test_workbook_checks_jupyterlab_and_the_port_before_it_prints_a_url(monkeypatch, tmp_path):
    monkeypatch.setattr(cli.os, "execv", lambda *a: pytest.fail("must not start"))
    monkeypatch.setattr(cli, "jupyterlab_installed", lambda: False)
    result = CliRunner().invoke(cli.main, ["workbook", "--folder", str(tmp_path)])
    assert result.exit_code != 0 and "JupyterLab is not installed" in result.output and "http" not in result.output
    monkeypatch.setattr(cli, "jupyterlab_installed", lambda: True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli.main, ["workbook", "--folder", str(tmp_path), "--port", str(port)])
    assert result.exit_code != 0 and f"port {port}" in result.output and "http" not in result.output
    assert cli.port_is_free("127.0.0.1", port)  # free again once released


def test_workbook_finds_the_chapters_from_any_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert cli.workbook_folder() == ROOT / "chapters"
    (tmp_path / "chapters").mkdir()
    assert cli.workbook_folder() == Path("chapters")


@pytest.mark.parametrize(
    "args, says",
    [
        (["bench", "e2e", "--batch", "0"], "--batch"),
        (["bench", "e2e", "--steps", "0"], "--steps"),
        (["bench", "e2e", "--seq", "-1"], "--seq"),
        (["bench", "ops", "--op", "rope", "--shape", "8x64"], "rope takes 5 sizes"),
        (["bench", "ops", "--op", "rms_norm", "--shape", "8xa"], "--shape"),
    ],
)
def test_bad_arguments_get_a_one_line_usage_error(args, says):
    result = CliRunner().invoke(cli.main, args)
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output and result.exception.__class__ is SystemExit


def test_an_implementation_that_cannot_run_here_says_why(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", True)
    result = CliRunner().invoke(cli.main, ["bench", "ops", "--op", "rms_norm", "--impl", "liger"])
    assert result.exit_code != 0
    assert "rms_norm liger: not measured: runs on a CUDA GPU only" in result.output
    assert "nothing was measured: see the reasons above" in result.output


def test_patch_reports_without_the_dry_run_flag():
    result = CliRunner().invoke(cli.main, ["patch", "llama"])
    assert result.exit_code == 0, result.output
    assert "fused      RMSNorm" in result.output


def test_patch_dry_run_reports_a_family():
    result = CliRunner().invoke(cli.main, ["patch", "mixtral", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "fused      RMSNorm" in result.output and "left alone router" in result.output
    assert "grouped_mm" in result.output  # transformers' default experts kernel, which stays as it is
    assert CliRunner().invoke(cli.main, ["patch", "bert", "--dry-run"]).exit_code != 0  # not a family


def test_patch_says_how_to_report_a_vision_language_family_or_encoder():
    result = CliRunner().invoke(cli.main, ["patch", "qwen2_5_vl"])
    assert result.exit_code == 2 and "vision-language family" in result.output and "patch_report" in result.output
    result = CliRunner().invoke(cli.main, ["patch", "pixtral"])
    assert result.exit_code == 2 and "vision encoder" in result.output and "patch_report" in result.output


def test_patch_without_a_family_lists_each_family_once():
    result = CliRunner().invoke(cli.main, ["patch"])
    assert result.exit_code == 2
    assert all(result.output.count(f"\t{model_type},") + result.output.count(f"\t{model_type}\n") == 1
               for model_type in liger_lab.hf.FAMILIES)  # fmt: skip
    assert "[OPTIONS] MODEL_TYPE" in result.output
