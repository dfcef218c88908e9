import io
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from liger_lab.ops import rope  # noqa: E402
from liger_lab.workbook import diagrams  # noqa: E402


def _check_draws(fig: Figure) -> None:
    assert isinstance(fig, Figure)
    assert fig.axes
    assert any(ax.texts or ax.lines or ax.patches for ax in fig.axes)
    fig.savefig(io.BytesIO(), format="png", dpi=40)  # layout and artists only fail when drawn
    plt.close(fig)


@pytest.mark.parametrize("name", sorted(diagrams.ALL))
def test_every_diagram_draws_with_defaults(name):
    _check_draws(diagrams.ALL[name]())


def test_default_logits_put_the_max_in_the_last_block():
    block = 4
    values = diagrams.sample_logits(block)
    top = max(range(len(values)), key=values.__getitem__)
    assert top // block == len(values) // block - 1
    assert diagrams.sample_logits(block) == values  # seeded


def test_online_logsumexp_steps_end_at_the_logsumexp():
    values = diagrams.sample_logits(4)
    expected = torch.logsumexp(torch.tensor(values, dtype=torch.float64), dim=0).item()
    m, s = diagrams.online_logsumexp_steps(values, 4)[-1]
    assert m == max(values)
    assert m + math.log(s) == pytest.approx(expected, rel=1e-12)
    # Without the rescale the sum keeps terms scaled to an older, smaller max: too large.
    m_wrong, s_wrong = diagrams.online_logsumexp_steps(values, 4, rescale=False)[-1]
    assert m_wrong + math.log(s_wrong) > expected + 0.1


def test_online_logsumexp_prints_the_computed_values():
    values = [0.5, -1.0, 2.0, 0.0, 1.5, 3.0]  # a short last block: two padded cells
    fig = diagrams.online_logsumexp(values, block=4)
    row_texts = [t.get_text() for t in fig.axes[0].texts]
    for m, s in diagrams.online_logsumexp_steps(values, 4):
        assert f"m = {m:.2f}\ns = {s:.2f}" in row_texts
    expected = torch.logsumexp(torch.tensor(values, dtype=torch.float64), dim=0).item()
    assert f"logsumexp(x) = {expected:.2f}" in fig.axes[1].get_legend_handles_labels()[1]
    _check_draws(fig)


def test_memory_timeline_draws_events():
    fig = diagrams.memory_timeline(events=[("a", 1.0), ("b", 2.0)])
    assert "schematic" not in fig.get_suptitle()
    _check_draws(fig)
    schematic = diagrams.memory_timeline()
    assert "schematic" in schematic.get_suptitle()
    plt.close(schematic)


def test_a_diagram_shows_itself_as_png_in_a_notebook():
    png = diagrams.program_grid()._repr_png_()
    assert png.startswith(b"\x89PNG")


def test_the_rope_figure_draws_the_kernels_own_tiling():
    # Rows in memory order, rows_per_program a program, q's programs before k's; the caption quotes rope_tile.
    fig = diagrams.rope_rotate_half(head_dim=8, rows_per_program=3)
    texts = [t.get_text() for t in fig.axes[1].texts]
    assert [t for t in texts if t.startswith("pid ")] == [f"pid {p}" for p in (0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4)]
    tile = rope.rope_tile(128)
    assert any(f"BLOCK_R = {tile.block_r} rows of BLOCK_D = {tile.block_d} pairs" in t for t in texts)
    _check_draws(fig)


def test_the_attention_figure_colours_one_row_and_one_column_of_tiles():
    # The forward's program walks its row up to the diagonal, the dK/dV program its column down from it.
    fig = diagrams.attention_tiles(n_blocks=5, query_block=3, key_block=1)
    steps = [[t.get_text() for t in ax.texts if t.get_text().startswith("step ")] for ax in fig.axes]
    assert steps == [[f"step {i}" for i in range(4)], [f"step {i}" for i in range(4)]]
    with pytest.raises(ValueError, match="query_block"):
        diagrams.attention_tiles(n_blocks=3, query_block=3)
    _check_draws(fig)
