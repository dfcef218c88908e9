import pytest

from liger_lab import results


def test_every_committed_result_names_its_gpu_and_date():
    for path in sorted(results.RESULTS_DIR.glob("*.json")):
        line = results.source(path.name)
        assert line.startswith("NVIDIA H200, ") and line.endswith(f"({path.name})")
        assert "undated" not in line and ", ," not in line


def test_row_finds_exactly_one_row_and_source_names_the_clock():
    row = results.row("h200-ops-default-calls.json", op="rms_norm", impl="liger_lab")
    assert row["timer"] == "cuda_graph" and row["full_ms"] > 0
    assert "CUDA-graph replay" in results.source("h200-ops-default-calls.json", row["timer"])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: results.load("no-such-file.json"), "no committed results named"),
        (lambda: results.row("h200-ops-default-calls.json", op="rms_norm"), "expected one row"),
    ],
)
def test_bad_lookups_are_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
