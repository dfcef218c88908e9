"""Teaching diagrams for the notebooks, drawn by code so they stay in step with the library.

Each public function returns a :class:`Diagram`, a :class:`matplotlib.figure.Figure` built without pyplot
(no window, no global figure state, safe under the Agg backend) that a notebook displays as a PNG when a
cell ends with it from small keyword parameters, and draws the same picture
on every call: how Triton programs tile a tensor, how a persistent grid reduces dW, how RoPE pairs and
reuses cos/sin, how an online logsumexp rescales its running sum, how the fused linear cross-entropy
walks its chunks, and where a training step spends its memory. The numbers a diagram prints are computed
(:func:`online_logsumexp_steps` is the arithmetic behind :func:`online_logsumexp`), not typed in.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable, Sequence

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

_Color = str | tuple[float, ...]

_MASKED = "#dddddd"
_CODE_BOX = {"boxstyle": "round,pad=0.5", "facecolor": "#f6f6f6", "edgecolor": "#aaaaaa"}


def _colour(index: int, alpha: float = 0.55) -> tuple[float, float, float, float]:
    """The fill for program (or chunk, or half) ``index``: tab10, made light enough to write on."""
    r, g, b, _ = matplotlib.colormaps["tab10"](index % 10)
    return (r, g, b, alpha)


def _edge(index: int) -> tuple[float, float, float, float]:
    """The full-strength tab10 colour of ``index``, for text and arrows that belong to it."""
    return _colour(index, alpha=1.0)


class Diagram(Figure):
    """A pyplot-free figure that shows itself in a notebook as a PNG, whatever matplotlib backend is active."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()


def _figure(title: str, size: tuple[float, float]) -> Diagram:
    """A pyplot-free figure (nothing to close, no window) with constrained layout and a bold title."""
    fig = Diagram(figsize=size, layout="constrained")
    fig.suptitle(title, fontsize=12, fontweight="bold")
    return fig


def _diagram(ax: Axes, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
    """A box-and-arrow axes: equal aspect, no ticks, y growing downwards like the rows of a matrix."""
    ax.set_xlim(*x_range)
    ax.set_ylim(y_range[1], y_range[0])
    ax.set_aspect("equal")
    ax.axis("off")


def _rect(
    ax: Axes,
    x: float,
    y: float,
    w: float,
    h: float,
    face: _Color = "white",
    text: str = "",
    *,
    hatch: str | None = None,
    edge: _Color = "black",
    linestyle: str = "-",
    linewidth: float = 0.8,
    fontsize: float = 8,
) -> None:
    """A rectangle whose top-left corner is (x, y), with ``text`` centred in it."""
    ax.add_patch(
        Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, hatch=hatch, linestyle=linestyle, linewidth=linewidth)
    )
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _grid(
    ax: Axes,
    x: float,
    y: float,
    faces: Sequence[Sequence[_Color]],
    texts: Sequence[Sequence[str]] | None = None,
    *,
    masked: Sequence[Sequence[bool]] | None = None,
    fontsize: float = 8,
) -> None:
    """Unit cells from (x, y): ``faces[r][c]`` fills cell (r, c); masked cells are hatched grey."""
    for r, row in enumerate(faces):
        for c, face in enumerate(row):
            is_masked = masked is not None and masked[r][c]
            _rect(
                ax,
                x + c,
                y + r,
                1,
                1,
                _MASKED if is_masked else face,
                texts[r][c] if texts else "",
                hatch="///" if is_masked else None,
                edge="#888888" if is_masked else "black",
                fontsize=fontsize,
            )


def _arrow(
    ax: Axes,
    start: tuple[float, float],
    end: tuple[float, float],
    text: str = "",
    *,
    lift: float = 0.7,
    text_at: tuple[float, float] | None = None,
    color: _Color = "black",
    rad: float = 0.0,
    style: str = "-|>",
    linewidth: float = 1.3,
) -> None:
    """An arrow from ``start`` to ``end`` (curved by ``rad``), labelled ``lift`` above its middle or at ``text_at``."""
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops={
            "arrowstyle": style,
            "color": color,
            "linewidth": linewidth,
            "shrinkA": 1,
            "shrinkB": 1,
            "connectionstyle": f"arc3,rad={rad}",
        },
    )
    if text:
        tx, ty = text_at or ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 - lift)
        ax.text(tx, ty, text, ha="center", va="center", fontsize=9, color=color)


def _bracket(ax: Axes, x0: float, x1: float, y: float, text: str, *, color: _Color = "black") -> None:
    """A square bracket over columns [x0, x1] at height y, its ticks down toward the cells, ``text`` on top."""
    ax.plot([x0 + 0.05, x0 + 0.05, x1 - 0.05, x1 - 0.05], [y + 0.25, y, y, y + 0.25], color=color, linewidth=1)
    ax.text((x0 + x1) / 2, y - 0.1, text, ha="center", va="bottom", color=color)


def _code(ax: Axes, x: float, y: float, lines: Sequence[str], *, fontsize: float = 9, **kwargs: object) -> None:
    """A block of monospace code with its top-left corner at (x, y)."""
    ax.text(
        x, y, "\n".join(lines), family="monospace", fontsize=fontsize, ha="left", va="top", bbox=_CODE_BOX, **kwargs
    )


def program_grid(n_rows: int = 6, n_cols: int = 10, block: int = 4) -> Figure:
    """One Triton program per row, ``tl.arange(0, BLOCK)`` stepping over the columns, and the masked tail.

    Each cell holds the offset its lane loads (``row * stride + cols`` with contiguous rows); the lanes of
    the last block that fall past ``n_cols`` are masked off: they neither load nor store.
    """
    n_blocks = math.ceil(n_cols / block)
    width = n_blocks * block
    fig = _figure("One program per row; tl.arange(0, BLOCK) walks the columns block by block", (11, 4.2))
    ax, ax_code = fig.subplots(1, 2, width_ratios=[width + 4, 11])
    _diagram(ax, (-3.2, width + 0.3), (-3.2, n_rows + 2.6))

    faces = [[_colour(r) for _ in range(width)] for r in range(n_rows)]
    texts = [[str(r * n_cols + c) if c < n_cols else "" for c in range(width)] for r in range(n_rows)]
    masked = [[c >= n_cols for c in range(width)] for _ in range(n_rows)]
    _grid(ax, 0, 0, faces, texts, masked=masked, fontsize=7)
    for r in range(n_rows):
        ax.text(-0.2, r + 0.5, f"pid {r}", ha="right", va="center", fontsize=8, color=_edge(r), fontweight="bold")
    for b in range(n_blocks + 1):
        ax.plot([b * block, b * block], [-0.5, n_rows + 0.5], color="black", linewidth=2.2)
    for c in range(width):
        ax.text(c + 0.5, -0.25, str(c), ha="center", va="bottom", fontsize=7, color="black" if c < n_cols else "red")
        ax.text(c + 0.5, n_rows + 0.25, str(c % block), ha="center", va="top", fontsize=7, color="#555555")
    ax.text(-0.2, -0.45, "cols", ha="right", va="center", fontsize=8)
    ax.text(-0.2, n_rows + 0.45, "lane", ha="right", va="center", fontsize=8)
    for b in range(n_blocks):
        _bracket(ax, b * block, (b + 1) * block, -1.1, f"block {b}\nstart = {b * block}")
    ax.text(
        width / 2,
        n_rows + 1.3,
        f"hatched lanes: cols >= n_cols = {n_cols}, so mask = cols < n_cols is False (no load, no store)",
        ha="center",
        va="top",
        fontsize=8,
        color="red",
    )

    ax_code.axis("off")
    _code(
        ax_code,
        0.0,
        0.95,
        [
            "pid = tl.program_id(0)   # one program per row",
            "row = pid",
            "for start in range(0, n_cols, BLOCK):",
            "    cols = start + tl.arange(0, BLOCK)",
            "    mask = cols < n_cols",
            "    offsets = row * stride + cols",
            "    x = tl.load(x_ptr + offsets, mask=mask)",
            "",
            f"# n_rows = {n_rows} programs, BLOCK = {block}",
            f"# stride = n_cols = {n_cols} (contiguous rows)",
            "# numbers in cells: offsets",
        ],
        fontsize=8.5,
        transform=ax_code.transAxes,
    )
    return fig


def persistent_rows(n_rows: int = 12, n_programs: int = 3, rows_per_tile: int = 2, n_cols: int = 8) -> Figure:
    """A persistent grid reducing dW: P programs stride over the row tiles, then one small sum over programs.

    Program p handles tiles p, p + P, p + 2P, ... and keeps its dW contribution in fp32 registers; it
    writes one row of a P x n_cols buffer at the end, and ``sum(dim=0)`` over that buffer gives dW. No
    atomics, and no rounding to bf16 until the end.
    """
    n_tiles = math.ceil(n_rows / rows_per_tile)
    fig = _figure("dW in two stages: per-program partial sums, then one small sum", (11, 5.2))
    ax = fig.subplots()
    buffer_x = n_cols + 7
    final_x = buffer_x + n_cols + 7
    buffer_y = (n_rows - n_programs) / 2
    _diagram(ax, (-4.6, final_x + n_cols + 0.5), (-2.2, n_rows + 4.6))

    for t in range(n_tiles):
        p = t % n_programs
        first, last = t * rows_per_tile, min((t + 1) * rows_per_tile, n_rows)
        _grid(ax, 0, first, [[_colour(p)] * n_cols] * (last - first))
        ax.plot([0, n_cols], [first, first], color="black", linewidth=2)
        ax.text(-0.2, (first + last) / 2, f"tile {t}\n(pid {p})", ha="right", va="center", fontsize=8, color=_edge(p))
        _arrow(
            ax,
            (n_cols + 0.2, (first + last) / 2),
            (buffer_x - 0.2, buffer_y + p + 0.5),
            color=_edge(p),
            linewidth=0.8,
        )
    ax.text(n_cols / 2, -0.3, f"rows of dy * xhat\n({n_rows} rows, {rows_per_tile} per tile)", ha="center", va="bottom")

    _grid(ax, buffer_x, buffer_y, [[_colour(p)] * n_cols for p in range(n_programs)])
    for p in range(n_programs):
        ax.text(
            buffer_x + n_cols + 0.2, buffer_y + p + 0.5, f"pid {p}", ha="left", va="center", fontsize=8, color=_edge(p)
        )
    ax.text(
        buffer_x + n_cols / 2,
        buffer_y - 0.3,
        f"dW partials, fp32\n(P x n_cols = {n_programs} x {n_cols})",
        ha="center",
        va="bottom",
    )

    final_y = buffer_y + (n_programs - 1) / 2
    _grid(ax, final_x, final_y, [["#bbbbbb"] * n_cols])
    ax.text(final_x + n_cols / 2, final_y - 0.3, f"dW\n(n_cols = {n_cols})", ha="center", va="bottom")
    _arrow(
        ax,
        (buffer_x + n_cols + 2.2, final_y + 0.5),
        (final_x - 0.3, final_y + 0.5),
        "sum(dim=0)",
        lift=0.9,
        linewidth=2,
    )

    _code(
        ax,
        0,
        n_rows + 0.8,
        [
            f"pid = tl.program_id(0)              # P = {n_programs} programs",
            "acc = tl.zeros((BLOCK_N,), tl.float32)",
            f"for tile in range(pid, n_tiles, P):  # n_tiles = {n_tiles}",
            "    acc += tl.sum(dy * xhat, axis=0)",
            "tl.store(partial_ptr + pid * n_cols + cols, acc)",
        ],
        fontsize=8,
    )
    ax.text(
        buffer_x + 2,
        n_rows + 1.2,
        "each program loops over tiles pid, pid + P, pid + 2P, ...\n"
        "and keeps its running dW in fp32 registers;\n"
        "one store per program, then a tiny torch sum over P rows",
        ha="left",
        va="top",
        fontsize=9,
    )
    return fig


def rope_rotate_half(head_dim: int = 8, rows_per_program: int = 3, kernel_head_dim: int = 128) -> Figure:
    """RoPE's ``rotate_half`` pairing, and how liger_lab's kernel (``liger_lab.ops.rope``) tiles q and k.

    Left: element i pairs with i + d/2 and each pair is rotated by its own angle. Right: the kernel sees q and k as
    rows, one head of one position each, and each program rotates ``BLOCK_R`` consecutive rows in the order they
    lie in memory, q's programs first and k's after them, in one launch. Drawn for Hugging Face's layout, where
    the heads of a position are neighbours: each row reads the cos/sin row of its position, and the rows of one
    position read the same one one after another. The drawing uses ``rows_per_program`` rows; the caption gives
    the kernel's own tile for ``kernel_head_dim``, from :func:`liger_lab.ops.rope.rope_tile`.
    """
    from liger_lab import runtime
    from liger_lab.ops import rope

    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be even and positive, got {head_dim}")
    if rows_per_program < 1:
        raise ValueError(f"rows_per_program must be positive, got {rows_per_program}")
    half = head_dim // 2
    n_positions, n_q_heads, n_k_heads = 2, 4, 2
    fig = _figure("RoPE: rotate_half pairs i with i + d/2; the kernel rotates rows in memory order", (13, 5.6))
    ax_pair, ax_tile = fig.subplots(1, 2, width_ratios=[1, 1.25])

    _diagram(ax_pair, (-2.4, head_dim + 0.5), (-1.8, 9.6))
    ax_pair.set_title("rotate_half: element i pairs with i + d/2", fontsize=10)
    faces = [[_colour(0) if i < half else _colour(1) for i in range(head_dim)]]
    _grid(ax_pair, 0, 0, faces, [[f"$x_{{{i}}}$" for i in range(head_dim)]], fontsize=9)
    ax_pair.text(-0.2, 0.5, "x", ha="right", va="center", fontsize=10)
    _bracket(ax_pair, 0, half, -0.3, "x1 = x[:d/2]", color=_edge(0))
    _bracket(ax_pair, half, head_dim, -0.3, "x2 = x[d/2:]", color=_edge(1))
    for i in range(half):
        _arrow(
            ax_pair, (i + 0.5, 1.05), (i + half + 0.5, 1.05), color=_edge(i + 2), rad=min(0.35, 1.4 / half), style="<->"
        )
    ax_pair.text(head_dim / 2, 2.55, f"pair (i, i + {half}), rotated by angle $\\theta_i$", ha="center", fontsize=9)
    rotated = [[_colour(1) if i < half else _colour(0) for i in range(head_dim)]]
    labels = [[f"$-x_{{{i + half}}}$" if i < half else f"$x_{{{i - half}}}$" for i in range(head_dim)]]
    _grid(ax_pair, 0, 3.2, rotated, labels, fontsize=9)
    ax_pair.text(-0.2, 3.7, "rotate_half(x)", ha="right", va="center", fontsize=9)
    ax_pair.text(
        head_dim / 2,
        5.0,
        "$y_1 = x_1 \\cos\\theta - x_2 \\sin\\theta$\n"
        "$y_2 = x_2 \\cos\\theta + x_1 \\sin\\theta$\n"
        "$y = x \\cos\\theta + \\mathrm{rotate\\_half}(x) \\sin\\theta$\n"
        "$\\theta_i = t \\cdot \\mathrm{base}^{-2i/d}$ at position t",
        ha="center",
        va="top",
        fontsize=11,
        linespacing=1.6,
    )

    # Rows in memory order for (B, T, H, D) memory: position-major, heads inner; q's rows, then k's.
    rows = [("q", t, h) for t in range(n_positions) for h in range(n_q_heads)]
    rows += [("k", t, h) for t in range(n_positions) for h in range(n_k_heads)]
    q_programs = math.ceil(n_positions * n_q_heads / rows_per_program)
    _diagram(ax_tile, (-4.2, head_dim + 9.0), (-1.6, len(rows) + 4.6))
    ax_tile.set_title("liger_lab's kernel: BLOCK_R consecutive rows of q or k per program", fontsize=10)
    for r, (tensor, t, h) in enumerate(rows):
        first_k = n_positions * n_q_heads
        program = r // rows_per_program if tensor == "q" else q_programs + (r - first_k) // rows_per_program
        row_faces = [[_colour(program, 0.35 if i < half else 0.65) for i in range(head_dim)]]
        _grid(ax_tile, 0, r, row_faces, [["x1"] * half + ["x2"] * half], fontsize=7)
        ax_tile.text(-0.2, r + 0.5, f"{tensor}[t={t}, head {h}]", ha="right", va="center", fontsize=8)
        ax_tile.text(
            head_dim + 0.3, r + 0.5, f"pid {program}", ha="left", va="center", fontsize=8, color=_edge(program)
        )
        ax_tile.text(head_dim + 2.4, r + 0.5, f"cos[t={t}], sin[t={t}]", ha="left", va="center", fontsize=8)
        first_of_program = (r if tensor == "q" else r - first_k) % rows_per_program == 0
        if first_of_program or r == first_k:
            ax_tile.plot([-0.1, head_dim + 2.2], [r, r], color="black", linewidth=2)
    ax_tile.plot([-0.1, head_dim + 2.2], [len(rows), len(rows)], color="black", linewidth=2)
    _bracket(ax_tile, head_dim + 2.4, head_dim + 8.6, -0.3, "table row each row reads")
    tile = rope.rope_tile(kernel_head_dim)
    ax_tile.text(
        (head_dim + 4) / 2,
        len(rows) + 0.4,
        f"drawn: BLOCK_R = {rows_per_program} rows per program, q's {q_programs} programs first, then k's, one launch\n"
        f"the kernel here ({runtime.BACKEND}), head_dim {kernel_head_dim}: rope_tile gives\n"
        f"BLOCK_R = {tile.block_r} rows of BLOCK_D = {tile.block_d} pairs per program, {tile.num_warps} warp(s)\n"
        "the rows of one position, its heads, read one cos/sin row in turn (from cache after the first)",
        ha="center",
        va="top",
        fontsize=8,
        color="#333333",
        linespacing=1.5,
    )
    return fig


def sample_logits(block: int = 4, seed: int = 0, n_blocks: int = 4) -> list[float]:
    """The default logits of :func:`online_logsumexp`: seeded, with the row's maximum in the last block.

    A maximum that arrives late is the case a forgotten rescale gets wrong: every earlier partial sum was
    taken against a smaller running max.
    """
    rng = random.Random(seed)
    values = [rng.gauss(0.0, 2.0) for _ in range(block * n_blocks)]
    top = max(range(len(values)), key=values.__getitem__)
    last = len(values) - block + rng.randrange(block)
    values[top], values[last] = values[last], values[top]
    return values


def online_logsumexp_steps(values: Sequence[float], block: int, *, rescale: bool = True) -> list[tuple[float, float]]:
    """(running max m, running sum s) after each block of ``values``; ``m + log(s)`` is the logsumexp so far.

    Each block updates ``s <- s * exp(m_old - m_new) + sum(exp(x - m_new))``. With ``rescale=False`` the
    first factor is left out, the bug the diagram shows: the old sum stays scaled to the old max.
    """
    if block < 1 or not values:
        raise ValueError("need a positive block and at least one value")
    m, s = -math.inf, 0.0
    steps = []
    for start in range(0, len(values), block):
        chunk = values[start : start + block]
        m_new = max(m, *chunk)
        carried = s * math.exp(m - m_new) if rescale else s
        s = carried + sum(math.exp(x - m_new) for x in chunk)
        m = m_new
        steps.append((m, s))
    return steps


def online_logsumexp(values: Sequence[float] | None = None, block: int = 4, seed: int = 0) -> Figure:
    """Online logsumexp over a row in blocks: the running max and the rescaled running sum.

    Top: the logits, and (m, s) after each block. Bottom: ``m + log(s)`` climbs to the true logsumexp
    block by block; without the rescale factor it overshoots as soon as a block raises the max.
    """
    values = list(values) if values is not None else sample_logits(block, seed)
    steps = online_logsumexp_steps(values, block)
    wrong = online_logsumexp_steps(values, block, rescale=False)
    true_lse = steps[-1][0] + math.log(steps[-1][1])
    n_blocks = len(steps)
    width = n_blocks * block
    fig = _figure("Online logsumexp: one pass over the blocks, rescaling the running sum", (11, 6.6))
    ax_row, ax_plot = fig.subplots(2, 1, height_ratios=[1, 1.5])

    _diagram(ax_row, (-1.5, width + 0.5), (-2.0, 3.6))
    top = max(range(len(values)), key=values.__getitem__)
    faces = [[_colour(i // block) for i in range(width)]]
    texts = [[f"{v:.1f}" for v in values] + [""] * (width - len(values))]
    masked = [[i >= len(values) for i in range(width)]]
    _grid(ax_row, 0, 0, faces, texts, masked=masked)
    _rect(ax_row, top, 0, 1, 1, "none", edge="red", linewidth=2.5)
    ax_row.text(top + 0.5, 1.15, "max", ha="center", va="top", fontsize=8, color="red")
    ax_row.text(-0.2, 0.5, "x", ha="right", va="center", fontsize=10)
    for b, (m, s) in enumerate(steps):
        _bracket(ax_row, b * block, (b + 1) * block, -0.3, f"block {b}", color=_edge(b))
        ax_row.text(b * block + block / 2, 1.7, f"m = {m:.2f}\ns = {s:.2f}", ha="center", va="top", fontsize=9)
    ax_row.text(
        width / 2,
        -1.9,
        "$m_{new} = \\max(m, \\max_j x_j)$      "
        "$s \\leftarrow s \\cdot e^{m_{old} - m_{new}} + \\sum_j e^{x_j - m_{new}}$",
        ha="center",
        va="bottom",
        fontsize=11,
    )

    blocks = range(1, n_blocks + 1)
    ax_plot.plot(blocks, [m for m, _ in steps], "v-", color="#777777", label="running max m")
    ax_plot.plot(blocks, [m + math.log(s) for m, s in steps], "o-", color="tab:blue", label="m + log(s), rescaled")
    ax_plot.plot(
        blocks, [m + math.log(s) for m, s in wrong], "s--", color="tab:red", label="m + log(s), forgot to rescale"
    )
    ax_plot.axhline(true_lse, color="black", linestyle=":", linewidth=1.5, label=f"logsumexp(x) = {true_lse:.2f}")
    wrong_final = wrong[-1][0] + math.log(wrong[-1][1])
    ax_plot.annotate(
        f"forgot to rescale: {wrong_final:.2f}",
        xy=(n_blocks, wrong_final),
        xytext=(-12, 0),
        textcoords="offset points",
        ha="right",
        va="center",
        color="tab:red",
        fontsize=9,
    )
    ax_plot.margins(y=0.12)
    ax_plot.set_xticks(list(blocks))
    ax_plot.set_xlabel("blocks processed")
    ax_plot.set_ylabel("value")
    ax_plot.legend(loc="lower right", fontsize=8)
    ax_plot.grid(alpha=0.3)
    return fig


def flce_chunks(n_tokens: int = 12, n_chunks: int = 3, hidden: int = 4, vocab: int = 10) -> Figure:
    """The fused linear cross-entropy's chunk loop: only one C x V chunk of logits exists at a time.

    For each chunk of C tokens: ``z = h_c @ W^T``, the cross-entropy kernel writes dz over z in place,
    then ``dh_c = dz @ W`` and ``dW += dz^T @ h_c``. The N x V logits are never allocated.
    """
    chunk = math.ceil(n_tokens / n_chunks)
    active = min(1, n_chunks - 1)
    first, last = active * chunk, min((active + 1) * chunk, n_tokens)
    fig = _figure("Fused linear cross-entropy: one chunk of logits alive at a time", (12, 5.6))
    ax = fig.subplots()
    logits_x = hidden + 7
    dh_x = logits_x + vocab + 8
    dw_x = dh_x + hidden + 7
    _diagram(ax, (-2.5, dw_x + hidden + 2.5), (-3.4, n_tokens + 4.4))

    def chunk_faces(width: int, alive: Callable[[int], bool]) -> list[list[_Color]]:
        return [[_colour(r // chunk) if alive(r // chunk) else "white"] * width for r in range(n_tokens)]

    _grid(ax, 0, 0, chunk_faces(hidden, lambda c: True))
    for c in range(n_chunks):
        ax.text(-0.2, (c + 0.5) * chunk, f"chunk {c}", ha="right", va="center", fontsize=8, color=_edge(c))
        ax.plot([0, hidden], [c * chunk, c * chunk], color="black", linewidth=2)
    ax.text(hidden / 2, -0.3, "hidden h\nN x H", ha="center", va="bottom")

    _rect(ax, logits_x, 0, vocab, n_tokens, "none", edge="#999999", linestyle="--", linewidth=1.2)
    ax.text(
        logits_x + vocab / 2,
        -0.3,
        f"all logits N x V = {n_tokens * vocab}\nnever allocated",
        ha="center",
        va="bottom",
        color="#777777",
    )
    _rect(ax, logits_x, first, vocab, last - first, _colour(active), linewidth=1.5)
    ax.text(
        logits_x + vocab / 2,
        (first + last) / 2,
        "z = logits chunk, C x V\nthen dz written over z\n(in place)",
        ha="center",
        va="center",
        fontsize=8,
    )
    mid = (first + last) / 2
    _arrow(ax, (hidden + 0.2, mid), (logits_x - 0.2, mid), "z = h_c @ W$^T$")
    ax.text(
        logits_x + vocab / 2,
        n_tokens + 0.4,
        "cross-entropy kernel on z:\nloss_c, and dz = softmax(z) - onehot(y)",
        ha="center",
        va="top",
        fontsize=8,
    )

    _grid(ax, dh_x, 0, chunk_faces(hidden, lambda c: c <= active))
    ax.text(dh_x + hidden / 2, n_tokens + 0.4, "dh, N x H\n(rows done so far)", ha="center", va="top", fontsize=8)
    _arrow(ax, (logits_x + vocab + 0.2, mid), (dh_x - 0.2, mid), "dh_c = dz @ W")

    _rect(ax, dw_x, 1, hidden, vocab, "#bbbbbb", "dW\nV x H\n(+= every\nchunk)")
    _arrow(
        ax,
        (logits_x + vocab + 0.2, first + 0.2),
        (dw_x + hidden / 2, 0.8),
        "dW += dz$^T$ @ h_c",
        text_at=(dh_x + hidden / 2, -2.6),
        rad=-0.45,
    )

    ax.text(
        (dw_x + hidden) / 2,
        n_tokens + 2.2,
        f"peak logits memory: one chunk, C x V = {last - first} x {vocab} = {(last - first) * vocab} elements, "
        f"not N x V = {n_tokens} x {vocab} = {n_tokens * vocab} ({n_chunks} chunks reuse one buffer)",
        ha="center",
        va="top",
        fontsize=9.5,
        fontweight="bold",
    )
    return fig


# (phase, unfused GiB, fused GiB) at each step of the default timeline: weights and optimizer state sit at
# the bottom; activations pile up layer by layer, the loss adds the logits, the backward frees activations
# while the weight gradients build up, and the optimizer step needs a little scratch.
_SCHEMATIC: tuple[tuple[str, float, float], ...] = (
    ("forward", 6.0, 6.0),
    *(("forward", 6.0 + 1.5 * layer, 6.0 + 1.5 * layer) for layer in range(1, 7)),
    ("loss", 24.0, 15.6),
    ("loss", 19.0, 15.6),
    *(("backward", 15.0 - 1.5 * layer + 0.35 * layer, 15.0 - 1.5 * layer + 0.35 * layer) for layer in range(1, 7)),
    ("optimizer", 10.5, 10.5),
    ("optimizer", 8.1, 8.1),
)


def _held(ax: Axes, values: Sequence[float], **style: object) -> None:
    """A step curve where ``values[i]`` holds over [i, i + 1]: the last value keeps its width too."""
    ax.step(range(len(values) + 1), [*values, values[-1]], where="post", **style)
    ax.set_xlim(0, len(values))


def memory_timeline(events: Sequence[tuple[str, float]] | None = None) -> Figure:
    """Allocated memory through one training step: forward, loss, backward, optimizer.

    Activations pile up in the forward and are freed in the backward; the loss is where full logits
    (N x V, upcast to fp32) make the peak, and where a chunked fused loss removes it. ``events``, a
    sequence of (label, allocated GiB), draws a measured timeline instead of the schematic.
    """
    if events is not None:
        if not events:
            raise ValueError("events is empty: pass at least one (label, GiB) pair, or None for the schematic")
        fig = _figure("Allocated memory over one training step", (10, 4.4))
        ax = fig.subplots()
        ys = [gib for _, gib in events]
        _held(ax, ys, color="tab:blue", linewidth=2)
        ax.set_xticks([i + 0.5 for i in range(len(events))], [label for label, _ in events], rotation=30, ha="right")
        peak = max(range(len(ys)), key=ys.__getitem__)
        ax.annotate(
            f"peak {ys[peak]:.1f} GiB",
            xy=(peak + 0.5, ys[peak]),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize=9,
        )
        ax.set_ylim(0, max(ys) * 1.15)
        ax.set_xlabel("event")
    else:
        fig = _figure("Allocated memory over one training step (schematic)", (10, 4.6))
        ax = fig.subplots()
        _held(ax, [row[2] for row in _SCHEMATIC], color="tab:blue", linewidth=2.5, label="fused (chunked loss)")
        _held(
            ax,
            [row[1] for row in _SCHEMATIC],
            color="tab:red",
            linewidth=2,
            linestyle="--",
            label="unfused (full logits in fp32)",
        )
        phase_colours = {"forward": 0, "loss": 3, "backward": 2, "optimizer": 4}
        start = 0
        for phase, colour in phase_colours.items():
            end = start + sum(row[0] == phase for row in _SCHEMATIC)
            ax.axvspan(start, end, color=_colour(colour, 0.12), linewidth=0)
            ax.text((start + end) / 2, 26.5, phase, ha="center", va="center", fontsize=10, color=_edge(colour))
            start = end
        loss_x = sum(row[0] == "forward" for row in _SCHEMATIC)
        # The loss step in each timeline (column 1 of a row: unfused, 2: fused) and what makes its height there.
        peaks = ((1, "full N x V logits\n+ fp32 copy", 21.5, "tab:red"), (2, "one logits chunk", 17.5, "tab:blue"))
        for column, label, label_y, colour in peaks:
            ax.annotate(
                label,
                xy=(loss_x + 0.5, _SCHEMATIC[loss_x][column]),
                xytext=(loss_x + 3.5, label_y),
                arrowprops={"arrowstyle": "-|>", "color": colour},
                fontsize=9,
                color=colour,
            )
        ax.text(0.2, 5.6, "weights + optimizer state", va="top", fontsize=8, color="#555555")
        ax.set_ylim(0, 28)
        ax.set_xticks([])
        ax.set_xlabel("time through the step")
        ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.9), fontsize=9)
    ax.set_ylabel("allocated memory (GiB)")
    ax.grid(axis="y", alpha=0.3)
    return fig


def attention_tiles(n_blocks: int = 5, query_block: int = 3, key_block: int = 1) -> Figure:
    """Which tiles of causal attention's score matrix one program of each kernel reads.

    The score matrix S = Q K^T is cut into ``n_blocks`` x ``n_blocks`` tiles (query blocks down, key blocks across);
    tiles above the diagonal are masked by causality and never computed, and a diagonal tile is half masked. The
    forward program (and the dQ program) of query block ``query_block`` walks its row of tiles from key block 0 to
    the diagonal, reading that query block once and one K and V block per step; the dK/dV program of key block
    ``key_block`` walks its column down from the diagonal, reading one block of Q, dO, lse and delta per step.
    """
    if not 0 <= query_block < n_blocks or not 0 <= key_block < n_blocks:
        raise ValueError(f"query_block and key_block must be in [0, {n_blocks}), got {query_block}, {key_block}")
    fig = _figure("Causal attention: the score tiles one program computes, and the blocks it reads", (12, 5.4))
    panels = fig.subplots(1, 2)
    forward = [(query_block, c) for c in range(query_block + 1)]
    backward = [(r, key_block) for r in range(key_block, n_blocks)]
    titles = (
        f"forward (and dQ): program of query block {query_block}",
        f"dK and dV: program of key block {key_block}",
    )
    for index, (ax, tiles, title) in enumerate(zip(panels, (forward, backward), titles, strict=True)):
        _diagram(ax, (-2.6, n_blocks + 0.4), (-2.4, n_blocks + 1.6))
        ax.set_title(title, fontsize=10)
        for r in range(n_blocks):
            for c in range(n_blocks):
                if c > r:
                    _rect(ax, c, r, 1, 1, _MASKED, hatch="///", edge="#888888")
                    continue
                face = _colour(index) if (r, c) in tiles else "white"
                _rect(ax, c, r, 1, 1, face)
                if c == r:  # the diagonal tile: its part above the diagonal is masked inside the tile
                    ax.fill([c, c + 1, c + 1], [r, r, r + 1], facecolor=_MASKED, edgecolor="#888888", hatch="///")
        for step, (r, c) in enumerate(tiles):
            ax.text(c + 0.5, r + 0.5 + (0.2 if r == c else 0.0), f"step {step}", ha="center", va="center", fontsize=7)
        read_q = sorted({r for r, _ in tiles})
        read_k = sorted({c for _, c in tiles})
        for r in range(n_blocks):  # Q (and dO, lse, delta) blocks down the left
            _rect(ax, -1.4, r, 0.9, 1, _colour(index) if r in read_q else "white", f"Q{r}", fontsize=7)
        for c in range(n_blocks):  # K and V blocks across the top
            _rect(ax, c, -1.4, 1, 0.9, _colour(index) if c in read_k else "white", f"K{c} V{c}", fontsize=7)
        ax.text(-0.95, -0.95, "S = Q K^T", ha="center", va="center", fontsize=8)
        held, walked = (
            ("Q block, held", "K, V blocks, one a step")
            if index == 0
            else ("K, V block, held", "Q, dO blocks, one a step")
        )
        ax.text(
            n_blocks / 2, n_blocks + 0.6,
            f"reads: {held}; {walked}\n{len(tiles)} of {n_blocks} tiles in its {'row' if index == 0 else 'column'}; "
            "hatched: masked, never computed",
            ha="center", va="top", fontsize=8,
        )  # fmt: skip
    return fig


ALL: dict[str, Callable[[], Figure]] = {
    "program_grid": program_grid,
    "persistent_rows": persistent_rows,
    "rope_rotate_half": rope_rotate_half,
    "online_logsumexp": online_logsumexp,
    "flce_chunks": flce_chunks,
    "memory_timeline": memory_timeline,
    "attention_tiles": attention_tiles,
}
