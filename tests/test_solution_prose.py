"""The committed solutions say nothing their own outputs could contradict.

Measured figures (times, bandwidths, throughputs) belong in code cells, computed by the run or read from a
committed results JSON that is named with its GPU and date (``liger_lab.results``), never typed into the
prose. No committed output may show a failed check or a measurement over its target, nor a warning on stderr:
the library silences, narrowly, the harmless warnings its own calls cause (tqdm's missing ipywidgets,
torch.profiler's cycle notice). And where a chapter states a claim its own cell demonstrates, the committed
output of that cell must show it.
"""

import json
import re
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from tqdm import TqdmWarning

from liger_lab import profiling, runtime

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
MEASURED = re.compile(r"\d(?:[\d,.]*\d)?\s*(?:ms|µs|us|TB/s|GB/s|tokens/s|tok/s)\b")
# A failed check (checks.check_close prints "FAIL <name>"), or a measurement over the target it was sized for.
FAILED = re.compile(r"\bFAIL\b|over the target")
# A tuning round ("round 4", a results file such as h200-sweep-tiles-round4-a.json): the history of how a kernel
# got its settings belongs in benchmarks/notes/<op>.md; a chapter keeps the choice and why it holds.
TUNING_ROUND = re.compile(r"\bround[ -]?\d", re.IGNORECASE)


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _output_text(output: dict) -> str:
    """What an output shows as text: a stream's text, or the plain-text form of a result."""
    if "text" in output:
        return "".join(output["text"])
    return "".join(output.get("data", {}).get("text/plain", ""))


def _output_line_sources(path: Path) -> list[tuple[int, dict, dict, str]]:
    """(cell index, cell, output, line) for every line a code cell printed."""
    return [
        (index, cell, output, line)
        for index, cell in enumerate(_cells(path))
        if cell["cell_type"] == "code"
        for output in cell.get("outputs", [])
        for line in _output_text(output).splitlines()
    ]


def _output_lines(path: Path) -> list[str]:
    return [line for *_, line in _output_line_sources(path)]


def _prose(path: Path) -> str:
    """Every markdown cell of a notebook, whitespace collapsed, so a phrase matches across line breaks."""
    text = " ".join("".join(cell["source"]) for cell in _cells(path) if cell["cell_type"] == "markdown")
    return " ".join(text.split())


def _shows_a_bug(cell: dict) -> bool:
    """A cell that runs a deliberately broken kernel: it reports through ``checks.show_bug``."""
    return "checks.show_bug(" in "".join(cell["source"])


def _ran_in_the_interpreter(path: Path) -> bool:
    """Whether the committed outputs come from Triton's interpreter: the first cell prints ``runtime.describe()``."""
    return any("interpreter on CPU" in line for line in _output_lines(path)[:3])


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_markdown_quotes_no_measured_figure(path):
    quoted = [
        f"cell {index}: {match.group(0)!r} in {line.strip()[:100]!r}"
        for index, cell in enumerate(_cells(path))
        if cell["cell_type"] == "markdown"
        for line in "".join(cell["source"]).splitlines()
        for match in MEASURED.finditer(line)
    ]
    assert not quoted, "print these from a code cell instead:\n" + "\n".join(quoted)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_markdown_tells_no_tuning_round(path):
    rounds = [
        f"cell {index}: ...{text[max(match.start() - 60, 0) : match.end() + 60]}..."
        for index, cell in enumerate(_cells(path))
        if cell["cell_type"] == "markdown"
        for text in [" ".join("".join(cell["source"]).split())]
        for match in TUNING_ROUND.finditer(text)
    ]
    assert not rounds, "move the history to benchmarks/notes/<op>.md:\n" + "\n".join(rounds)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_committed_outputs_show_no_failed_check(path):
    failed = [
        f"cell {index}: {line.strip()[:120]}"
        for index, cell, output, line in _output_line_sources(path)
        if (FAILED.search(line) and not _shows_a_bug(cell))
        or line.startswith("BUG HIDDEN")
        or output.get("output_type") == "error"
    ]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_committed_stderr_shows_no_warning(path):
    warned = [
        f"cell {index}: {line.strip()[:160]}"
        for index, _, output, line in _output_line_sources(path)
        if output.get("output_type") == "stream" and output.get("name") == "stderr" and "Warning" in line
    ]
    assert not warned, "fix the warning where it comes from, then re-run the notebook:\n" + "\n".join(warned)


@dataclass(frozen=True)
class Claim:
    """A sentence of a chapter's prose, and the output lines of its demonstration that must bear it out."""

    notebook: str
    prose: str
    shown_by: tuple[str, ...]


CLAIMS = [
    Claim(
        "05_cross_entropy.ipynb",
        "By default the caller's logits are never written",
        ("the default call: the caller's logits unchanged after the forward: True, after the backward: True",),
    ),
    Claim(
        "05_cross_entropy.ipynb",
        "the tensor `logits` holds $\\partial L/\\partial z$, not logits",
        ("in_place_backward=True: the caller's logits unchanged after the forward: False, after the backward: False",),
    ),
    Claim(
        "05_cross_entropy.ipynb",
        "logits that do **not require grad** (evaluation, `torch.no_grad()`) are only read, with or without the option",
        ("logits that do not require grad, in_place_backward=True: unchanged: True",),
    ),
]


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: f"{c.notebook}: {c.prose[:40]}")
def test_prose_claims_are_shown_by_their_outputs(claim):
    path = ROOT / "solutions" / claim.notebook
    assert claim.prose in _prose(path), f"{claim.notebook} no longer says {claim.prose!r}: update this claim"
    lines = {line.strip() for line in _output_lines(path)}
    missing = [line for line in claim.shown_by if line not in lines]
    assert not missing, f"{claim.notebook} says {claim.prose!r}, but its outputs lack:\n" + "\n".join(missing)


def test_chapter_0_times_an_unsynchronised_call_below_a_synchronised_one_on_a_gpu():
    """Chapter 0 teaches that a call without synchronisation times its launch alone on a GPU, and that the
    interpreter has no asynchrony: its committed timing must say the one that applies."""
    path = ROOT / "solutions" / "00_triton_primer.ipynb"
    lines = _output_lines(path)
    times = {}
    for label in ("no synchronisation", "synchronised"):
        found = [re.search(rf"(?:^|, ){label}\s*:\s*([\d.]+) ms", line) for line in lines]
        times[label] = [float(match.group(1)) for match in found if match]
    assert times["no synchronisation"] and times["synchronised"], "chapter 0 prints no synchronised timing"
    if _ran_in_the_interpreter(path):
        assert any("no asynchrony" in line for line in lines), "on CPU the timing cell must say there is no asynchrony"
    else:
        assert times["no synchronisation"][0] < times["synchronised"][0], (
            f"an unsynchronised call read {times['no synchronisation'][0]} ms, above the synchronised "
            f"{times['synchronised'][0]} ms: the prose says it is the launch alone"
        )


def test_tqdm_auto_imports_without_the_ipywidgets_warning_in_a_notebook(monkeypatch):
    # A Jupyter kernel without ipywidgets, as tqdm.autonotebook sees one; tqdm's modules imported afresh.
    kernel_shell = type("ZMQInteractiveShell", (), {})()
    fake_ipython = types.ModuleType("IPython")
    fake_ipython.get_ipython = lambda: kernel_shell
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython)
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    for name in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profiling._import_tqdm_auto_quietly()
    assert "tqdm.auto" in sys.modules
    assert not [w for w in caught if issubclass(w.category, TqdmWarning)]


def test_gpu_time_ms_silences_the_profiler_cycle_warning_and_nothing_else(monkeypatch):
    def kernel_sum_that_warns(fn):
        message = "Warning: Profiler clears events at the end of each cycle. Only events ..."
        warnings.warn(message, UserWarning, stacklevel=2)
        warnings.warn("a warning of the measured call", UserWarning, stacklevel=2)
        return 1.5

    monkeypatch.setattr(runtime, "measure_kernel_sum_ms", kernel_sum_that_warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert profiling.gpu_time_ms(lambda: None, graph=False) == (1.5, "profiler")
    assert [str(w.message) for w in caught] == ["a warning of the measured call"]
