"""Run the catalogue on one backend and write ``conformance-<backend>.json`` and ``.md``.

``python -m indexcache.conformance.worker --backend NAME --out DIR`` is what ``indexcache
conformance`` starts, one process per backend, so interpreted and compiled Triton never mix. It exits 1 if a case
fails or no case ran (every case declined, or none given: the run checked nothing), else 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import warnings
from collections import Counter
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


def run_backend(name: str, op: str | None = None, progress=None, jobs: int = 1,
                shard: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Every case (of ``op``, or all) on backend ``name``: a report dict with a ``results`` list, in catalogue order.

    ``jobs`` > 1: the cases are dealt round-robin to that many worker processes (``shard`` ``(i, n)``: this process
    runs cases ``i, i + n, ...``), so that the kernels the cases compile are compiled side by side: on a GPU with
    an empty Triton cache compiling is most of the run. A shard whose process fails is one failed result naming it."""
    if op is not None and op not in catalogue_ops():
        raise ValueError(f"op: expected one of {catalogue_ops()}, got {op!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected an int >= 1, got {jobs!r}")
    avail = dispatch.availability(name)
    if not avail.available:
        raise dispatch.BackendNotSupportedError(f"backend {name!r} is not available here: {avail.reason}")
    cases = cases_for(op)
    if jobs > 1:
        results = _sharded(name, op, min(jobs, len(cases)), progress)
    else:
        results = []
        index, count = shard
        for i in range(index, len(cases), count):
            result = run_case(cases[i], name)
            results.append(result.as_dict())
            if progress:
                progress(f"[{name} {i + 1}/{len(cases)}] {result.status:<8} {cases[i].op}: {cases[i].name}")
    return {
        "backend": name,
        "mode": avail.mode,
        "device": avail.device,
        "device_name": _device_name(avail.device),
        "reason": avail.reason,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "info": dispatch.get(name).info(),
        "results": results,
    }


def _sharded(name: str, op: str | None, jobs: int, progress) -> list[dict[str, Any]]:
    """The results of ``jobs`` worker processes, shard ``i`` running cases ``i, i + jobs, ...``, in catalogue
    order."""
    import subprocess
    import tempfile

    cases = cases_for(op)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(jobs):
            cmd = [sys.executable, "-m", "indexcache.conformance.worker", "--backend", name, "--out", f"{tmp}/{i}",
                   "--shard", f"{i}/{jobs}", *(["--op", op] if op else [])]
            procs.append(subprocess.Popen(cmd))
        found: dict[int, dict[str, Any]] = {}
        for i, proc in enumerate(procs):
            rc = proc.wait()
            path = Path(tmp) / str(i) / f"conformance-{name}.json"
            if rc in (0, 1) and path.exists():
                shard = json.loads(path.read_text())["results"]
                found.update(zip(range(i, len(cases), jobs), shard, strict=True))
                continue
            for j in range(i, len(cases), jobs):
                found[j] = CaseResult(cases[j].op, cases[j].name, "failed",
                                      f"conformance shard {i}/{jobs} crashed (exit {rc})").as_dict()
    if progress:
        counts = {status: sum(r["status"] == status for r in found.values()) for status in
                  ("passed", "failed", "declined")}
        progress(f"[{name}] {len(cases)} cases in {jobs} processes: "
                 + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return [found[j] for j in range(len(cases))]


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


def worst_text(summary: dict[str, Any]) -> str:
    """An op's summary's worst error against its bound, as the console table and the .md show it: three significant
    digits (fewer could show a failing 1.04e-05 as 1.0e-05, at its bound of 1e-05); "exact" where cases passed and
    none measured an error, "-" where none passed."""
    if summary["worst"]:
        return f"{summary['worst'][0]:.2e} / {summary['worst'][1]:.0e}"
    return "exact" if summary["passed"] else "-"


def unchecked(results: list[dict[str, Any]]) -> str:
    """Why no case of ``results`` ran ("" when one passed or failed): every case was declined, with the most common
    reasons (how many cases gave each), or there was no case."""
    if any(r["status"] != "declined" for r in results):
        return ""
    if not results:
        return "there was no case to run"
    reasons = Counter(" ".join(r["detail"].split()) for r in results).most_common()  # each on one line
    listed = "; ".join(f"{why} ({n})" for why, n in reasons[:3])
    others = f"; {len(reasons) - 3} other reasons" if len(reasons) > 3 else ""
    return f"every case was declined: {listed}{others}"


def unchecked_ops(report: dict[str, Any]) -> dict[str, str]:
    """Per op of which no case ran while another op's did: :func:`unchecked`'s why (empty when no case ran at all:
    the backend's own verdict says so). A line in the reports, not a failure."""
    if unchecked(report["results"]):
        return {}
    by_op: dict[str, list[dict[str, Any]]] = {}
    for r in report["results"]:
        by_op.setdefault(r["op"], []).append(r)
    return {op: why for op, results in by_op.items() if (why := unchecked(results))}


def to_markdown(report: dict[str, Any]) -> str:
    """The human report: header, per-op summary, then every case (its detail on one line, at most 200 characters;
    the .json has it whole)."""
    lines = [
        f"# Conformance: backend `{report['backend']}`",
        "",
        f"- mode: **{report['mode']}** on {report['device']} ({report['device_name']})",
        f"- why available: {report['reason']}",
        f"- date: {report['date']}, torch {report['torch']}",
    ]
    if why := unchecked(report["results"]):
        lines.append(f"- **no case ran** (the run fails): {why}")
    lines += [f"- no case of `{op}` ran: {why}" for op, why in unchecked_ops(report).items()]
    lines += [
        "",
        "| op | passed | failed | declined | worst error / bound |",
        "|---|---|---|---|---|",
    ]
    for op, s in summarize(report).items():
        lines.append(f"| {op} | {s['passed']} | {s['failed']} | {s['declined']} | {worst_text(s)} |")
    lines += ["", "| op | case | status | error | bound | detail |", "|---|---|---|---|---|---|"]
    for r in report["results"]:
        err = "" if r["error"] is None else f"{r['error']:.2e}"
        bound = "" if r["bound"] is None else f"{r['bound']:.0e}"
        detail = " ".join(r["detail"].splitlines()).replace("|", "\\|")[:200]  # one table row, whatever it holds
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
    parser.add_argument("--jobs", type=int, default=1, help="worker processes the cases are dealt to (default 1)")
    parser.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)  # i/n: a process of --jobs n
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs: expected an int >= 1, got {args.jobs}")
    index, count = (int(n) for n in args.shard.split("/"))
    # Triton's interpreter casts with numpy, which warns when the cases that feed NaN or inf on purpose cast them to
    # an integer or fp8 type; the verdict is the case's (as in pyproject.toml's pytest filter).
    warnings.filterwarnings("ignore", "invalid value encountered in cast", RuntimeWarning, "triton.runtime.interpreter")
    report = run_backend(args.backend, args.op, progress=lambda line: print(line, file=sys.stderr, flush=True),
                         jobs=args.jobs, shard=(index, count))
    if args.compile and args.backend in vendors():
        from indexcache.backends.triton.crosscompile import compiled_for

        report["compiled_for"] = compiled_for(args.backend)
    write_report(report, args.out)
    failed = any(r["status"] == "failed" for r in report["results"] + report.get("compiled_for", []))
    return 1 if failed or unchecked(report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
