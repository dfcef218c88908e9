"""Regenerate the benchmark table in README.md from committed result JSON.

``python benchmarks/readme_table.py OPS_JSON [OPS_JSON ...] [--e2e FILE] [--section NAME] [--op OP ...]``
rewrites the part of README.md between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` (NAME: ``bench`` by
default, ``losses`` for the distillation and preference losses), listing every op of the files or those named by
``--op``. A row of a later ops file replaces the row of the same op and implementation in an earlier one. The
``liger_lab`` column is the public call with no options; an opt-in variant (``liger_lab:in_place_backward``) is a
row of its own under its op.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ["liger_lab", "liger", "liger:chunked", "torch_compile", "eager", "cce"]
HEADERS = {"liger_lab": "liger_lab", "liger": "Liger-Kernel", "liger:chunked": "Liger-Kernel (chunked loss)",
           "torch_compile": "torch.compile", "eager": "eager", "cce": "cut-cross-entropy"}  # fmt: skip
CLOCKS = {
    "cuda_graph": "CUDA-graph replay, the wall time of a call in brackets",
    "do_bench": "`do_bench` (CUDA events around each call)",
    "profiler": "the kernel sum under `torch.profiler`, the wall time of a call in brackets",
}


def _cell(row: dict | None) -> str:
    if row is None:
        return "–"
    peak, wall = row.get("peak_mib"), row.get("wall_ms")
    time = f"{row['full_ms']:.3f} ms" + (f" ({wall:.1f})" if wall is not None else "")
    return time + (f", {peak:.0f} MiB" if peak is not None else "")


def ops_table(all_rows: list[dict]) -> str:
    rows = [r for r in all_rows if "full_ms" in r and "sweep" not in r]  # the protocol shapes only
    ops = list(dict.fromkeys(r["op"] for r in rows))
    impls = [i for i in IMPLS if any(r.get("impl") == i for r in rows)]
    lines = ["| op (fwd+bwd) | " + " | ".join(HEADERS[i] for i in impls) + " | liger_lab vs Liger |"]
    lines.append("|---" * (len(impls) + 2) + "|")
    for op in ops:
        by_impl = {r["impl"]: r for r in rows if r["op"] == op}
        liger = by_impl.get("liger")
        for ours in ["liger_lab", *sorted(i for i in by_impl if i.startswith("liger_lab:"))]:
            if ours not in by_impl:
                continue
            ratio = f"{by_impl[ours]['full_ms'] / liger['full_ms']:.2f}x time" if liger else ""
            if ours == "liger_lab":
                cells = [_cell(by_impl.get(i)) for i in impls]
                lines.append(f"| {op} | " + " | ".join(cells) + f" | {ratio} |")
            else:  # a variant: its own row, in the liger_lab column
                variant = ours.split(":", 1)[1]
                cells = [_cell(by_impl[ours])] + [""] * (len(impls) - 1)
                lines.append(f"| {op}, `{variant}=True` | " + " | ".join(cells) + f" | {ratio} |")
    runs = list(dict.fromkeys(r.get("run") for r in all_rows if r["op"].startswith("ceiling")))
    for run in runs:  # one run, or several (a file's "run" field), each with the ceilings of its own process
        ceilings = {r["op"]: r for r in all_rows if r["op"].startswith("ceiling") and r.get("run") == run}
        copy, matmul = ceilings.get("ceiling_copy", {}), ceilings.get("ceiling_matmul_bf16", {})
        which = "the same run" if run is None else f"the {run} run"
        lines.append("")
        lines.append(
            f"Ceilings measured in {which}: copy {copy.get('gbs', 0):.0f} GB/s, bf16 matmul "
            f"{matmul.get('tflops', 0):.0f} TFLOP/s."
        )
    first = rows[0]
    versions = ", ".join(f"{k} {first[k]}" for k in ("torch", "triton", "liger_kernel") if k in first)
    by_clock: dict[str, list[str]] = {}
    for row in rows:  # an op whose rows used different clocks is named with its implementation
        mixed = len({r.get("timer") for r in rows if r["op"] == row["op"]}) > 1
        name = f"{row['op']} ({row['impl']})" if mixed else row["op"]
        ops_of_clock = by_clock.setdefault(row.get("timer", "do_bench"), [])
        ops_of_clock += [] if name in ops_of_clock else [name]
    clocks = "; ".join(f"{CLOCKS.get(timer, timer)} for {', '.join(ops)}" for timer, ops in by_clock.items())
    lines.append("")
    lines.append(
        f"{first.get('gpu', '?')}; {versions}. Median GPU time: {clocks}. Peak memory: MiB allocated above the "
        "inputs during one forward+backward."
    )
    return "\n".join(lines)


def e2e_table(rows: list[dict]) -> str:
    lines = ["| impl | batch x seq | tokens/s | peak GiB |", "|---|---|---|---|"]
    for r in rows:
        shape = f"{r.get('batch')} x {r.get('seq')}"
        if r.get("oom"):
            lines.append(f"| {r['impl']} | {shape} | out of memory | – |")
        else:
            lines.append(f"| {r['impl']} | {shape} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("ops_json", type=Path, nargs="+")
    parser.add_argument("--e2e", type=Path, default=None)
    parser.add_argument("--section", default="bench", help="the README's marked section to rewrite")
    parser.add_argument("--op", action="append", default=None, help="an op to list (repeatable; default: all)")
    args = parser.parse_args()
    rows: dict[tuple, dict] = {}
    for path in args.ops_json:
        for row in json.loads(path.read_text()):
            if args.op and row["op"] not in args.op and not row["op"].startswith("ceiling"):
                continue
            key = (row["op"], row.get("impl"), row.get("sweep"), row.get("tokens"), row.get("hidden"), row.get("run"))
            rows[key] = row
    text = ops_table(list(rows.values()))
    names = ", ".join(f"`{p.relative_to(ROOT) if p.is_absolute() else p}`" for p in args.ops_json)
    text += f"\n\nRaw rows: {names}."
    if args.e2e:
        text += "\n\nEnd to end (Llama-style 1.5B, AdamW, bf16):\n\n" + e2e_table(json.loads(args.e2e.read_text()))
    readme = ROOT / "README.md"
    content = readme.read_text()
    start, end = f"<!-- {args.section}:start -->", f"<!-- {args.section}:end -->"
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{text}\n{end}{tail}")


if __name__ == "__main__":
    main()
