"""Reports of end-to-end rows: one line per run, loss curves compared, targets, a reference mode's table, plots.

Every row keeps the loss of every step (``losses``), so two modes can be checked to train the same way
(:func:`compare_losses`): same seed, same weights, same batch, so step i of one run is step i of the other.
:func:`check_targets` holds the throughput and memory targets of the compiled patched model;
:func:`format_reference` sets every mode against one reference mode (Liger-Kernel, say): tokens/s, peak memory, the
largest batch that trains, and liger_lab's targets against it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from liger_lab import runtime
from liger_lab.e2e.training import timer_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Two bf16 losses that differ by less than one bf16 step (2**-7 relative) are the same loss.
BF16_RTOL = 2.0**-7
OURS = "liger_lab"

RUN_HEADER = (
    f"{'mode':<18}{'batch x seq':>12}{'tokens/s':>11}{'vs hf':>9}{'peak GiB':>10}{'host ms':>9}{'GPU ms':>8}"
    f"{'1st step s':>12}{'loss0':>9}{'loss last':>11}"
)


def error_summary(error: str) -> str:
    """The line of a child's traceback that names the exception (the last line may be advice, as after a
    torch.compile failure), at most 80 characters."""
    lines = [line.strip() for line in error.splitlines() if line.strip()] or ["?"]
    named = [line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt)\b", line)]
    return (named or lines)[-1][:80]


def format_run(row: dict[str, Any], rows: Sequence[dict[str, Any]] = ()) -> str:
    """One line of :func:`format_runs`; the ratio to "hf" comes from the "hf" row of the same size in
    ``rows`` (none when it is not there yet)."""
    shape = f"{row['batch']}x{row['seq']}"
    if row.get("oom") or row.get("error"):
        problem = "out of memory" if row.get("oom") else "error: " + error_summary(row["error"])
        return f"{row['impl']:<18}{shape:>12}  {problem}"
    size = (row["batch"], row["seq"])
    hf = next((h for h in rows if h.get("impl") == "hf" and (h.get("batch"), h.get("seq")) == size), {})
    ratio = f"{row['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf.get("tokens_per_s") else ""
    peak = "n/a" if row.get("peak_gib") is None else f"{row['peak_gib']:.1f}"
    first = "" if row.get("compile_s") is None else f"{row['compile_s']:.2f}"
    host = "" if row.get("host_ms_per_step") is None else f"{row['host_ms_per_step']:.1f}"
    gpu = "n/a" if row.get("gpu_ms_per_step") is None else f"{row['gpu_ms_per_step']:.1f}"
    return (
        f"{row['impl']:<18}{shape:>12}{row['tokens_per_s']:>11.0f}{ratio:>9}{peak:>10}{host:>9}{gpu:>8}{first:>12}"
        f"{row['loss0']:>9.4f}{row['loss_last']:>11.4f}"
    )


def format_lengths(rows: Sequence[dict[str, Any]]) -> str:
    """The varying-lengths rows (:func:`liger_lab.e2e.training.train_lengths`): per mode, ms per step over the
    second pass, host ms per step, graphs compiled and the first pass's seconds."""
    lines = [f"{'mode':<18}{'ms/step':>9}{'host ms':>9}{'graphs':>8}{'1st pass s':>12}"]
    for row in rows:
        if row.get("error"):
            lines.append(f"{row['impl']:<18}  error: {error_summary(row['error'])}")
            continue
        graphs = "" if row.get("graphs") is None else row["graphs"]
        lines.append(f"{row['impl']:<18}{row['ms_per_step']:>9.2f}{row['host_ms_per_step']:>9.2f}{graphs:>8}"
                     f"{row['first_pass_s']:>12.1f}")  # fmt: skip
    return "\n".join(lines)


def format_runs(rows: Sequence[dict[str, Any]]) -> str:
    """A table of training rows: tokens/s (and the ratio to "hf" at the same size), peak GiB, host CPU and GPU
    milliseconds per step, the first step's wall time (torch.compile and Triton compile there), first and last loss."""
    return "\n".join([RUN_HEADER] + [format_run(r, rows) for r in rows])


def format_losses(row: dict[str, Any]) -> str:
    """The loss curve of one row on one line: warm-up steps, then ``|``, then the timed steps."""
    label = f"{row.get('impl', '?'):<18}{row.get('batch')}x{row.get('seq')}"
    losses = row.get("losses")
    if not losses:
        why = "out of memory" if row.get("oom") else "the run failed" if row.get("error") else "not recorded"
        return f"{label}  no losses ({why})"
    warmup = row.get("warmup", 0)
    text = " ".join(f"{v:.5f}" for v in losses[:warmup])
    timed = " ".join(f"{v:.5f}" for v in losses[warmup:])
    return f"{label}  " + (f"{text} | {timed}" if text else timed)


def _find_row(rows: Sequence[dict[str, Any]], mode: str, batch: int | None, seq: int | None) -> dict | None:
    return next(
        (r for r in rows if r.get("op") in (None, "e2e") and r.get("impl") == mode
         and (batch is None or r.get("batch") == batch) and (seq is None or r.get("seq") == seq)),
        None,
    )  # fmt: skip


def compare_losses(
    rows: Sequence[dict[str, Any]],
    reference: str = "liger_lab",
    other: str = "liger_lab+compile",
    *,
    rtol: float = BF16_RTOL,
    atol: float = 0.0,
    batch: int | None = None,
    seq: int | None = None,
) -> dict[str, Any]:
    """Whether the loss curves of two modes agree: at every step both ran, ``|other - reference| <= atol +
    rtol * |reference|``. The default rtol is one bf16 step (2**-7): two bf16 runs whose kernels round
    differently stay well inside it for a few steps (the reference runs differ by about 1e-4 relative),
    while a loss that does not move, or moves the wrong way, leaves it within a few steps. For fp32 runs
    pass a tighter rtol.

    Runs of the same seed see the same weights and batch, so step i of one is step i of the other
    whatever their warm-up split; steps only one ran are not compared. ``batch``/``seq`` pick the size
    (default: the first row of each mode). Returns {"reference", "other", "batch", "seq", "agree" (None
    when a curve is missing), "steps" compared, "max_diff", "worst_step", "rtol", "atol", "detail"}.
    """
    ref_row, other_row = _find_row(rows, reference, batch, seq), _find_row(rows, other, batch, seq)
    result: dict[str, Any] = {"reference": reference, "other": other, "batch": batch, "seq": seq, "agree": None,
                              "steps": 0, "max_diff": None, "worst_step": None, "rtol": rtol, "atol": atol}  # fmt: skip
    missing = [m for m, r in ((reference, ref_row), (other, other_row)) if not (r and r.get("losses"))]
    if missing:
        result["detail"] = "no loss curve for " + " and ".join(missing)
        return result
    result["batch"], result["seq"] = ref_row["batch"], ref_row["seq"]
    ref, oth = ref_row["losses"], other_row["losses"]
    steps = min(len(ref), len(oth))
    diffs = [abs(o - r) for r, o in zip(ref[:steps], oth[:steps], strict=True)]
    worst = max(range(steps), key=lambda i: diffs[i] - (atol + rtol * abs(ref[i])))
    bad = [i for i in range(steps) if not diffs[i] <= atol + rtol * abs(ref[i])]
    result.update(agree=not bad, steps=steps, max_diff=round(max(diffs), 6), worst_step=worst)
    if bad:
        first = bad[0]
        result["detail"] = (f"differ from step {first}: {oth[first]:.5f} against {ref[first]:.5f} (allowed "
                            f"{atol + rtol * abs(ref[first]):.2g}); {len(bad)} of {steps} steps outside")  # fmt: skip
    else:
        result["detail"] = (f"{steps} steps within rtol {rtol:.2g}: largest difference {max(diffs):.2g} "
                            f"(step {worst})")  # fmt: skip
    return result


def format_comparison(result: dict[str, Any]) -> str:
    """One line: the verdict of :func:`compare_losses`."""
    verdict = {True: "agree", False: "DISAGREE", None: "not compared"}[result["agree"]]
    size = f" at {result['batch']}x{result['seq']}" if result.get("batch") is not None else ""
    return f"losses {result['other']} vs {result['reference']}{size}: {verdict} ({result['detail']})"


# The targets of the compiled patched model, each (metric, comparison, reference mode, factor):
# compiled liger_lab at least as fast as eager liger_lab, 1.12x compiled Hugging Face, no more memory.
TARGET_MODE = "liger_lab+compile"
TARGETS = (
    ("tokens_per_s", ">=", "liger_lab", 1.0),
    ("tokens_per_s", ">=", "hf+compile", 1.12),
    ("peak_gib", "<=", "liger_lab", 1.0),
)


def check_targets(
    rows: Sequence[dict[str, Any]], *, batch: int | None = None, seq: int | None = None, rtol: float = BF16_RTOL
) -> list[dict[str, Any]]:
    """The targets of ``liger_lab+compile``: its loss curve agrees with eager liger_lab's (a fast run
    that does not train counts for nothing), its tokens/s are >= eager liger_lab's and >= 1.12x
    hf+compile's, and its peak memory is <= eager liger_lab's. One dict per target: {"target", "value",
    "bound", "met"}; met is None when a row or a number is missing (peak memory on CPU, a failed run).
    """
    losses = compare_losses(rows, "liger_lab", TARGET_MODE, rtol=rtol, batch=batch, seq=seq)
    results = [{"target": "loss curve agrees with liger_lab", "value": losses["max_diff"], "bound": None,
                "met": losses["agree"], "detail": losses["detail"]}]  # fmt: skip
    ours = _find_row(rows, TARGET_MODE, batch, seq) or {}
    for metric, comparison, reference, factor in TARGETS:
        base = (_find_row(rows, reference, batch, seq) or {}).get(metric)
        name = "tokens/s" if metric == "tokens_per_s" else "peak GiB"
        scale = f"{factor:g}x " if factor != 1 else ""
        bound = None if base is None else base * factor
        results.append(target(f"{name} {comparison} {scale}{reference}", ours.get(metric), comparison, bound))
    return results


def target(name: str, value: float | None, comparison: str, bound: float | None) -> dict[str, Any]:
    """One target for :func:`format_targets`: {"target": name, "value", "bound", "met"}, met when ``value
    comparison bound`` (">=" or "<="), None when either number is missing."""
    met = None if value is None or bound is None else (value >= bound if comparison == ">=" else value <= bound)
    return {"target": name, "value": value, "bound": bound, "met": met}


def format_targets(results: Sequence[dict[str, Any]]) -> str:
    """The targets of :func:`check_targets`, one line each: value, bound, met / MISSED / n/a."""
    lines = []
    for r in results:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[r["met"]]
        if r["value"] is None or r["bound"] is None:
            numbers = r.get("detail") or "(no number to compare)"
        else:
            numbers = f"{r['value']:,.1f} against {r['bound']:,.1f}"
        lines.append(f"  {r['target']:<34}{verdict:>7}   {numbers}")
    return "\n".join(lines)


def _fit_row(rows: Sequence[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    return next((r for r in rows if r.get("op") == "e2e_fit" and r.get("impl") == mode), None)


def largest_batch(fit: dict[str, Any] | None) -> int | None:
    """The largest batch a fit row (:func:`liger_lab.e2e.largest_fit`) trained, 0 when even the first size ran out
    of memory; None when the fit did not run."""
    if not fit or fit.get("error"):
        return None
    return fit["largest"][0] if fit.get("largest") else 0


def format_fit(row: dict[str, Any]) -> str:
    """One line of a fit row: the largest size that trains (with its peak) and the first that ran out of memory."""
    label = f"largest fit {row['impl']:<18}"
    if row.get("error"):
        return f"{label}error: {error_summary(row['error'])}"
    oom = "first out of memory: " + ("x".join(map(str, row["oom_at"])) if row.get("oom_at") else "none of those tried")
    if not row["fits"]:
        return f"{label}none trains ({oom})"
    largest = row["fits"][-1]
    peak = "" if largest["peak_gib"] is None else f", peak {largest['peak_gib']:.1f} GiB"
    return f"{label}{largest['batch']}x{largest['seq']} trains{peak} ({oom})"


def reference_targets(
    rows: Sequence[dict[str, Any]], reference: str, *, batch: int | None = None, seq: int | None = None
) -> list[dict[str, Any]]:
    """liger_lab's targets against ``reference`` (another mode, Liger-Kernel say) in the rows of one model:
    peak GiB and tokens/s at ``batch`` x ``seq`` (default: the first size of each mode), and the largest batch of
    the fit rows. One :func:`target` dict each."""
    ours, theirs = (_find_row(rows, mode, batch, seq) or {} for mode in (OURS, reference))
    return [
        target(f"peak GiB <= {reference}", ours.get("peak_gib"), "<=", theirs.get("peak_gib")),
        target(f"tokens/s >= {reference}", ours.get("tokens_per_s"), ">=", theirs.get("tokens_per_s")),
        target(f"largest batch >= {reference}", largest_batch(_fit_row(rows, OURS)), ">=",
               largest_batch(_fit_row(rows, reference))),
    ]  # fmt: skip


REFERENCE_HEADER = (
    f"{'mode':<18}{'tokens/s':>11}{'vs ref':>8}{'peak GiB':>10}{'vs ref':>8}{'largest batch':>15}{'vs ref':>8}"
)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else ""


def _number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_reference(
    rows: Sequence[dict[str, Any]], reference: str, modes: Sequence[str], *, batch: int, seq: int
) -> str:
    """The rows of one model against ``reference``: each mode's tokens/s and peak at ``batch`` x ``seq`` and the
    largest batch of its fit, each over the reference's; then liger_lab's targets (:func:`reference_targets`) and
    whether each mode's losses agree with Hugging Face's ("hf", when it ran)."""
    ref_train, ref_batch = _find_row(rows, reference, batch, seq) or {}, largest_batch(_fit_row(rows, reference))
    lines = [f"against {reference} at {batch}x{seq}:", REFERENCE_HEADER]
    for mode in modes:
        train = _find_row(rows, mode, batch, seq) or {}
        speed, peak, fitted = train.get("tokens_per_s"), train.get("peak_gib"), largest_batch(_fit_row(rows, mode))
        lines.append(
            f"{mode:<18}{_number(speed, '.0f'):>11}{_ratio(speed, ref_train.get('tokens_per_s')):>8}"
            f"{_number(peak, '.1f'):>10}{_ratio(peak, ref_train.get('peak_gib')):>8}"
            f"{_number(fitted, 'd'):>15}{_ratio(fitted, ref_batch):>8}"
        )
    if OURS in modes and reference != OURS:
        lines.append(f"targets of {OURS} [{timer_label()}]:")
        lines.append(format_targets(reference_targets(rows, reference, batch=batch, seq=seq)))
    if "hf" in modes:
        for mode in modes:
            if mode != "hf":
                lines.append(format_comparison(compare_losses(rows, "hf", mode, batch=batch, seq=seq)))
    return "\n".join(lines)


def plot_runs(rows: Sequence[dict[str, Any]]) -> Figure:
    """Bars of tokens/s and peak GiB, one per (mode, batch x seq, and preset when there are several); OOM runs are
    marked."""
    import matplotlib.pyplot as plt

    several = len({r.get("model") for r in rows}) > 1
    labels = [f"{r['impl']}\n{r['batch']}x{r['seq']}" + (f"\n{r.get('model')}" if several else "") for r in rows]
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 3.6))
    xs = list(range(len(rows)))
    speed = ax_speed.bar(xs, [r.get("tokens_per_s") or 0 for r in rows], color="tab:blue")
    ax_speed.bar_label(speed, [f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "" for r in rows], fontsize=8)
    peaks = [r.get("peak_gib") for r in rows]
    memory = ax_mem.bar(xs, [p or 0 for p in peaks], color="tab:green")
    ax_mem.bar_label(memory, [f"{p:.1f}" if p else "" for p in peaks], fontsize=8)
    for x, r in zip(xs, rows, strict=True):
        if r.get("oom") or r.get("error"):
            for ax in (ax_speed, ax_mem):
                ax.annotate("OOM" if r.get("oom") else "error", (x, 0), ha="center", va="bottom", color="red")
    if not any(peaks):
        ax_mem.text(0.5, 0.5, "peak memory is measured on a CUDA GPU", ha="center", transform=ax_mem.transAxes)
        ax_mem.set_yticks([])
    ax_speed.set_ylabel("tokens/s" + (" (CPU interpreter wall clock)" if runtime.INTERPRET else ""))
    ax_speed.set_title("training throughput (higher is better)")
    ax_mem.set_ylabel("GiB, weights and optimizer included")
    ax_mem.set_title("peak memory (lower is better)")
    for ax in (ax_speed, ax_mem):
        ax.set_xticks(xs, labels, fontsize=8)
    fig.tight_layout()
    return fig


def plot_timelines(timelines: Sequence[dict[str, Any]]) -> Figure:
    """Allocated memory over one training step, one line per mode (and preset, when there are several)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    drawn = [t for t in timelines if t.get("t_ms")]
    several = len({t.get("model") for t in drawn}) > 1
    for timeline in drawn:
        label = f"{timeline.get('model')} {timeline['impl']}" if several else timeline["impl"]
        ax.plot(timeline["t_ms"], timeline["allocated_gib"], label=label, lw=1)
    if drawn:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "memory timelines need a CUDA GPU", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_xlabel("time in one training step (ms)")
    ax.set_ylabel("allocated GiB")
    ax.set_title("forward (rising), backward (falling), optimizer step")
    fig.tight_layout()
    return fig
