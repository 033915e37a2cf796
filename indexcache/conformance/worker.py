"""Run the catalogue on one backend and write ``conformance-<backend>.json`` and ``.md``.

``python -m indexcache.conformance.worker --backend NAME --out DIR`` is what ``indexcache
conformance`` starts, one process per backend, so interpreted and compiled Triton never mix.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from indexcache.backends.triton.target import vendors
from indexcache.conformance.cases import CASES, cases_for
from indexcache.conformance.check import CaseResult, run_case
from indexcache.hal import dispatch


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine() or "cpu"


def catalogue_ops() -> list[str]:
    """The ops the case catalogue has cases for, in catalogue order."""
    return list(dict.fromkeys(case.op for case in CASES))


def run_backend(name: str, op: str | None = None, progress=None) -> dict[str, Any]:
    """Every case (of ``op``, or all) on backend ``name``: a report dict with a ``results`` list."""
    if op is not None and op not in catalogue_ops():
        raise ValueError(f"op: expected one of {catalogue_ops()}, got {op!r}")
    avail = dispatch.availability(name)
    if not avail.available:
        raise dispatch.BackendNotSupportedError(f"backend {name!r} is not available here: {avail.reason}")
    results: list[CaseResult] = []
    cases = cases_for(op)
    for i, case in enumerate(cases):
        result = run_case(case, name)
        results.append(result)
        if progress:
            progress(f"[{name} {i + 1}/{len(cases)}] {result.status:<8} {case.op}: {case.name}")
    return {
        "backend": name,
        "mode": avail.mode,
        "device": avail.device,
        "device_name": _device_name(avail.device),
        "reason": avail.reason,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "info": dispatch.get(name).info(),
        "results": [r.as_dict() for r in results],
    }


def summarize(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per op: passed / failed / declined counts and the worst error against its bound."""
    ops: dict[str, dict[str, Any]] = {}
    for r in report["results"]:
        s = ops.setdefault(r["op"], {"passed": 0, "failed": 0, "declined": 0, "worst": None})
        s[r["status"]] += 1
        if r["error"] is not None and r["bound"]:
            ratio = r["error"] / r["bound"]
            if s["worst"] is None or ratio > s["worst"][0] / s["worst"][1]:
                s["worst"] = (r["error"], r["bound"])
    return ops


def to_markdown(report: dict[str, Any]) -> str:
    """The human report: header, per-op summary, then every case."""
    lines = [
        f"# Conformance: backend `{report['backend']}`",
        "",
        f"- mode: **{report['mode']}** on {report['device']} ({report['device_name']})",
        f"- why available: {report['reason']}",
        f"- date: {report['date']}, torch {report['torch']}",
        "",
        "| op | passed | failed | declined | worst error / bound |",
        "|---|---|---|---|---|",
    ]
    for op, s in summarize(report).items():
        worst = f"{s['worst'][0]:.2e} / {s['worst'][1]:.0e}" if s["worst"] else ("exact" if s["passed"] else "-")
        lines.append(f"| {op} | {s['passed']} | {s['failed']} | {s['declined']} | {worst} |")
    lines += ["", "| op | case | status | error | bound | detail |", "|---|---|---|---|---|---|"]
    for r in report["results"]:
        err = "" if r["error"] is None else f"{r['error']:.2e}"
        bound = "" if r["bound"] is None else f"{r['bound']:.0e}"
        detail = r["detail"].replace("|", "\\|")[:200]
        lines.append(f"| {r['op']} | {r['case']} | {r['status']} | {err} | {bound} | {detail} |")
    if "compiled_for" in report:
        from indexcache.backends.triton.crosscompile import markdown

        lines += ["", *markdown(report["compiled_for"])]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write ``conformance-<backend>.json`` and ``.md`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"conformance-{report['backend']}"
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(to_markdown(report))
    return json_path, md_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the conformance catalogue on one backend.")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--op", default=None, choices=catalogue_ops(), help="only the cases of this op")
    parser.add_argument("--compile", action="store_true", help="add the cross-compile check (cuda, rocm)")
    args = parser.parse_args(argv)
    # Triton's interpreter casts with numpy, which warns when the cases that feed NaN or inf on purpose cast them to
    # an integer or fp8 type; the verdict is the case's (as in pyproject.toml's pytest filter).
    warnings.filterwarnings("ignore", "invalid value encountered in cast", RuntimeWarning, "triton.runtime.interpreter")
    report = run_backend(args.backend, args.op, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.compile and args.backend in vendors():
        from indexcache.backends.triton.crosscompile import compiled_for

        report["compiled_for"] = compiled_for(args.backend)
    write_report(report, args.out)
    return 1 if any(r["status"] == "failed" for r in report["results"] + report.get("compiled_for", [])) else 0


if __name__ == "__main__":
    sys.exit(main())
