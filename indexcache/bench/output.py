"""What a benchmark run gives back: the JSON it writes and the tables it prints.

:func:`format_table` renders an ``indexcache bench`` report (schema :data:`SCHEMA`; one row per case and
backend, every key of :data:`COLUMNS` among its keys) from the report alone; :func:`print_rows` and
:func:`markdown_table` are the plain tables of the ``bench/`` scripts and of ``bench/report_tables.py``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMA = "indexcache-bench/1"

# (header, result key, format): what the table shows, per op; the JSON rows carry every key. Headers name
# the op's roofline ceiling and its unit, and the op's first extra row (the column is left out without one).
COLUMNS = (
    ("case", "case", "{}"),
    ("backend", "backend", "{}"),
    ("mode", "mode", "{}"),
    ("eager µs", "eager_us", "{:.1f}"),
    ("graph µs", "graph_us", "{:.1f}"),
    ("{unit}", "rate", "{:.1f}"),
    ("floor µs", "floor_us", "{:.1f}"),
    ("% {ceiling}", "ceiling_fraction", "{:.0%}"),
    ("× launch", "launch_ratio", "{:.2f}"),
    ("× launch (graph)", "launch_ratio_graph", "{:.2f}"),
    ("× torch", "speedup_vs_torch", "{:.2f}"),
    ("× {extra}", "speedup_vs_extra", "{:.2f}"),
    ("check", "check", "{}"),
)
# The columns that read as a speed or a share of a ceiling: on a row not timed on a GPU (CPU, interpreted Triton)
# the table prints n/a there (the JSON keeps the numbers, with the row's mode).
GPU_ONLY = ("rate", "floor_us", "ceiling_fraction", "launch_ratio", "launch_ratio_graph")


def _cell(row: Mapping[str, Any], key: str, fmt: str) -> str:
    if key in GPU_ONLY and row.get("mode") != "GPU":
        return "n/a"
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} µs"


def format_table(report: Mapping[str, Any]) -> str:
    """The report as text: a header (machine, versions, ceilings) and one table per op."""
    v = report["versions"]
    commit = (report["commit"] or "unknown")[:12] + (" (dirty)" if report["dirty"] else "")
    lines = [f"indexcache bench  {report['date']}  {report['gpu'] or platform.processor() or 'CPU'}  "
             f"torch {v['torch']}  triton {v['triton']}  commit {commit}"]
    if report["notice"]:
        lines.append(f"NOTE: {report['notice']}")
    for name, c in report["ceilings"].items():
        if c.get("mode") not in (None, "GPU"):
            label = "empty Triton launch" if name == "launch" else name
            lines.append(f"ceiling {label}: n/a ({c['mode']}: not a GPU's ceiling)")
        elif name == "launch":
            if c["mode"] is None:
                lines.append(f"ceiling empty Triton launch: not measured ({c['reason']})")
            else:
                graph = f"graph capture failed: {c['graph_error']}" if c["graph_error"] else _us(c["graph_us"])
                lines.append(f"ceiling empty Triton launch ({c['mode']}): {_us(c['eager_us'])} eager, "
                             f"{graph} in a graph")
        elif c.get("per_case"):
            lines.append(f"ceiling {name}: {c['description']}")
        elif c["rate"] is None:
            lines.append(f"ceiling {name}: not measured ({c.get('error')})")
        else:
            lines.append(f"ceiling {name} ({c['mode']}): {c['rate'] / c['scale']:.0f} {c['unit']}")
    by_op: dict[str, list] = {}
    for row in report["results"]:
        by_op.setdefault(row["op"], []).append(row)
    for name, rows in by_op.items():
        roofs = list(dict.fromkeys(r["roofline"] for r in rows))
        roof = report["ceilings"][roofs[0]]
        extras = list(dict.fromkeys(r["backend"] for r in rows if r["extra"]))
        columns = [c for c in COLUMNS if c[1] != "speedup_vs_extra" or extras]
        headers = [h.format(unit=roof["unit"], ceiling=roofs[0] if len(roofs) == 1 else "roofline",
                            extra=extras[0] if extras else "") for h, _, _ in columns]
        cells = [[_cell(row, key, fmt) for _, key, fmt in columns] for row in rows]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        lines += ["", f"op {name}: rate from graph time where measured, else eager"]
        lines.append("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)).rstrip() for cell in cells]
        notes = dict.fromkeys(f"{r['case']}: {r['note']}" for r in rows if r["note"])
        if len(roofs) > 1:
            notes.update(dict.fromkeys(f"{r['case']}: % of {r['roofline']}" for r in rows))
        if roof.get("per_case"):
            notes[f"floor µs: {roof['description']}"] = None
        errors = [f"{r['case']} / {r['backend']}: graph capture failed: {r['graph_error']}" for r in rows
                  if r["graph_error"]]
        lines += [f"  {n}" for n in [*notes, *errors]]
    return "\n".join(lines)


def print_rows(title: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str], digits: int = 4,
               cell: Callable[[str, Any], str] | None = None) -> None:
    """Print ``rows`` (dicts) as a right-aligned table of ``columns`` under ``title``: floats to ``digits``
    significant digits, or each value as ``cell(column, value)`` says."""
    def text(column: str, value: Any) -> str:
        if cell is not None:
            return cell(column, value)
        return f"{value:.{digits}g}" if isinstance(value, float) else str(value)

    cells = [[text(c, r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print(f"\n{title}")
    for row in [list(columns)] + cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (for ``BENCHMARKS.md``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(report: Mapping[str, Any], path: str | os.PathLike, indent: int = 2) -> None:
    """Write the report as JSON (parent folders created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=indent) + "\n")


def finish(report: Mapping[str, Any], path: str | os.PathLike) -> int:
    """A GPU script's end: each of ``report["errors"]`` printed as a failed check, the report written as JSON to
    ``path``; returns the exit status (1 when a check failed)."""
    for error in report["errors"]:
        print("CHECK FAILED:", error)
    write_json(report, path)
    print(f"wrote {path}")
    return 1 if report["errors"] else 0


def run_sections(report: dict[str, Any], sections: Sequence[tuple[str, Callable[[], Any]]],
                 path: str | os.PathLike, after: Callable[[], None] | None = None) -> None:
    """Run a GPU script's sections in order, each result under its name in ``report``: a section that raises is
    recorded in ``report["errors"]`` (its traceback also on stderr) and the others still run; ``after`` runs after
    each (e.g. freeing the allocator's cache), and the report is written to ``path`` each time with the seconds so
    far, so that a run killed later keeps what it had."""
    start = time.perf_counter()
    for name, section in sections:
        print(f"== {name}", flush=True)
        try:
            report[name] = section()
        except Exception:  # a crashed section is reported, the others still run
            report["errors"].append({"section": name, "traceback": traceback.format_exc()})
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        if after is not None:
            after()
        report["seconds"] = round(time.perf_counter() - start, 1)
        write_json(report, path, indent=1)
