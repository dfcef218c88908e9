"""The host's cost of a patched training step, measured as ``benchmarks/host_time.py`` measures it: on CPU, every kernel
launch skipped (``runtime.skip_launches``), this thread's CPU time per step, the least of several short rounds in which
the patched and the unpatched model alternate.

Thread CPU time leaves out the time other processes held the CPU, alternating rounds put the machine's drift on both
sides alike, and the least round is the one the other hardware thread disturbed least: on a loaded two-core machine the
ratio of the two minima still moved between 0.994 and 1.031 over four runs of one tree (the tiny Llama patched without
its loss), which is the tolerance below.
"""

from __future__ import annotations

import copy

import pytest

import liger_lab
from benchmarks import host_time

TOLERANCE = 1.03
"""The spread of the ratio between runs of one tree on a loaded two-core machine (see the module docstring)."""


# Not strict: at 1.13x, one run in four on a loaded machine still measured the patched step under the tolerance, and
# a strict mark would turn that into a failure. Remove the mark once the target holds.
@pytest.mark.xfail(
    reason="not met yet: the patched step costs about 1.13x the unpatched step's host time, the fused loss's Python "
    "path above all (benchmarks/notes/host_time.md)",
)
def test_patched_eager_step_costs_the_host_no_more_than_the_unpatched_step():
    model, input_ids = host_time.tiny_llama()
    patched = liger_lab.patch(copy.deepcopy(model))
    with host_time.measuring_conditions():
        unpatched_us, patched_us = host_time.per_call_us(
            host_time.training_step(model, input_ids),
            host_time.training_step(patched, input_ids),
            rounds=15,
            round_s=0.03,
        )
    assert patched_us <= TOLERANCE * unpatched_us, (
        f"a patched training step costs the host {patched_us:.0f} us, the unpatched one {unpatched_us:.0f} us "
        f"({patched_us / unpatched_us:.2f}x)"
    )
