"""The committed solutions say nothing their own outputs could contradict.

Measured figures (times, bandwidths, throughputs) belong in code cells, computed by the run or read from a
committed results JSON that is named with its GPU and date (``liger_lab.results``), never typed into the
prose. And no committed output may show a failed check.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
MEASURED = re.compile(r"\d(?:[\d,.]*\d)?\s*(?:ms|µs|us|TB/s|GB/s|tokens/s|tok/s)\b")


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_markdown_quotes_no_measured_figure(path):
    quoted = [
        f"cell {index}: {match.group(0)!r} in {line.strip()[:100]!r}"
        for index, cell in enumerate(json.loads(path.read_text())["cells"])
        if cell["cell_type"] == "markdown"
        for line in "".join(cell["source"]).splitlines()
        for match in MEASURED.finditer(line)
    ]
    assert not quoted, "print these from a code cell instead:\n" + "\n".join(quoted)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_committed_outputs_show_no_failed_check(path):
    failed = [
        f"cell {index}: {line.strip()[:120]}"
        for index, cell in enumerate(json.loads(path.read_text())["cells"])
        if cell["cell_type"] == "code"
        for output in cell.get("outputs", [])
        for line in "".join(output.get("text", "")).splitlines()
        if line.startswith(("FAIL", "BUG HIDDEN")) or output.get("output_type") == "error"
    ]
    assert not failed, "\n".join(failed)
