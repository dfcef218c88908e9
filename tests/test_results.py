import json
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from benchmarks import import_results, readme_table
from liger_lab.workbook import results

ROOT = Path(__file__).resolve().parents[1]


def test_every_committed_result_names_its_machine_and_date():
    for name in results.names():
        line = results.source(name)
        cpu_run = name.startswith("cpu-") and ", CPU), torch " in line
        assert (line.startswith("NVIDIA H200, ") or cpu_run) and line.endswith(f"({name})")
        assert "undated" not in line and ", ," not in line


def test_the_store_holds_every_committed_file_as_it_was_written():
    files = sorted(results.RESULTS_DIR.glob("*.json"))
    assert files and {path.name for path in files} <= set(results.names())
    for path in files:
        # The store stamps each row with the commit measured (a row that records none gets the file's last commit).
        stored = [{k: v for k, v in row.items() if k != "commit"} for row in results.load(path.name)]
        written = [{k: v for k, v in row.items() if k != "commit"} for row in import_results.file_rows(path)]
        assert stored == written, path.name
    assert all(row["commit"] for row in results.stored_rows())  # the commit measured, or the last that changed it


def test_the_committed_store_is_what_the_converter_makes_of_the_committed_files(tmp_path, capsys):
    store = tmp_path / "store.jsonl"
    import_results.main(["--store", str(store)])
    assert store.read_text() == results.STORE.read_text()
    assert capsys.readouterr().out.count("imported ") == len(results.names())


def test_row_finds_exactly_one_row_and_source_names_the_clock():
    row = results.row("h200-ops-round6.json", op="rms_norm", impl="liger_lab")
    assert row["timer"] == "cuda_graph" and row["full_ms"] > 0
    assert "CUDA-graph replay" in results.source("h200-ops-round6.json", row["timer"])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: results.load("no-such-file.json"), "no committed results named"),
        (lambda: results.row("h200-ops-round6.json", op="rms_norm"), "expected one row"),
        (lambda: results.latest(op="no_such_op"), "no stored measurement with op='no_such_op'"),
    ],
)
def test_bad_lookups_are_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _measured(date: str, ms: float, **fields) -> dict:
    return {"op": "rms_norm", "impl": "liger_lab", "shape": [8, 4], "date": date, "full_ms": ms, **fields}


def test_latest_is_the_newest_measurement_that_matches(tmp_path):
    store = tmp_path / "store.jsonl"
    results.append([_measured("2026-12-01", 3.0), _measured("2026-12-01", 9.0, shape=[16, 4])], "a.json", store=store)
    results.append([_measured("2026-11-30", 1.0), _measured("2026-12-01", 2.0)], "b.json", commit="abc", store=store)
    results.append([_measured("2026-12-02", 0.5, error="out of memory")], "c.json", store=store)
    newest = results.latest(op="rms_norm", impl="liger_lab", store=store, shape=[8, 4])
    assert (newest["full_ms"], newest["file"], newest["commit"]) == (2.0, "b.json", "abc")  # same date, appended later
    assert results.latest(op="rms_norm", store=store, file="a.json", shape=[8, 4])["full_ms"] == 3.0
    assert results.latest(op="rms_norm", store=store, shape=[16, 4])["full_ms"] == 9.0
    with pytest.raises(ValueError, match="a run is imported once"):
        results.append([_measured("2026-12-03", 1.0)], "a.json", store=store)


def test_the_committed_store_answers_latest():
    row = results.latest(op="rms_norm", impl="liger_lab", shape=[16384, 4096], gpu="NVIDIA H200")
    assert row["full_ms"] > 0 and row["file"] in results.names() and row["commit"]


def test_write_rows_adds_what_a_row_lacks_and_overwrites_nothing(tmp_path):
    path = tmp_path / "out" / "rows.json"
    results.write_rows([{"op": "x", "gpu": "its own"}, {"op": "y"}], path, environment={"gpu": "run's", "date": "d"})
    rows = json.loads(path.read_text())
    assert [r["gpu"] for r in rows] == ["its own", "run's"] and all(r["date"] == "d" for r in rows)
    assert all(r["commit"] == results.commit() for r in rows) and results.commit().startswith(
        subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
        .stdout.strip()
    )  # fmt: skip
    assert not list(path.parent.glob("*.partial"))


def test_importing_a_file_appends_its_rows_with_its_provenance(tmp_path):
    # A file git does not know: its rows keep the commit they recorded; a file of one object is one row.
    store = tmp_path / "store.jsonl"
    rows, single = tmp_path / "run.json", tmp_path / "single.json"
    rows.write_text(json.dumps([_measured("2026-12-05", 1.0, commit="0123abc"), _measured("2026-12-05", 2.0)]))
    single.write_text(json.dumps({"gpu": "NVIDIA H200", "date": "2026-12-05", "rows": [{"ms": 1.0}]}))
    assert import_results.import_files([single, rows], store) == ["run.json", "single.json"]
    assert [r.get("commit") for r in results.load("run.json", store)] == ["0123abc", None]
    assert results.load("single.json", store) == [json.loads(single.read_text())]


def test_the_store_is_package_data_and_reads_without_the_source_tree(tmp_path):
    # What a wheel installs: the package with its data, no clone around it (-S: no site-packages, so no editable
    # install either).
    package = tmp_path / "site" / "liger_lab"
    (package / "workbook").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "workbook" / "__init__.py").write_text("")
    shutil.copy(results.__file__, package / "workbook" / "results.py")
    shutil.copytree(results.STORE.parent, package / "workbook" / "data")
    code = ("from liger_lab.workbook import results; print(results.latest(op='ceiling_copy')['gbs'] > 0, "
            "results.RESULTS_DIR.exists(), results.commit())")  # fmt: skip
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path / "site")})  # fmt: skip
    assert done.stdout.split() == ["True", "False", "None"], done.stderr
    # ... and a wheel has the store: pyproject.toml names it as the package's data.
    pattern = "data/*.jsonl"
    assert f'"liger_lab.workbook" = ["{pattern}"]' in (ROOT / "pyproject.toml").read_text()
    assert fnmatch(results.STORE.relative_to(ROOT / "liger_lab" / "workbook").as_posix(), pattern)


def test_the_readme_and_notes_tables_are_the_stores():
    assert readme_table.main(["--check"]) == 0


def test_a_generated_table_replaces_only_its_section():
    text = "before\n<!-- t:start -->\nold\n<!-- t:end -->\nafter\n"
    assert readme_table.regenerated(text, "t", "new") == "before\n<!-- t:start -->\nnew\n<!-- t:end -->\nafter\n"
    with pytest.raises(ValueError, match="no <!-- u:start -->"):
        readme_table.regenerated(text, "u", "new")
