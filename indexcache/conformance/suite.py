"""``indexcache conformance``: each backend in its own process, then one table.

A backend that is not available natively but can be interpreted (the Triton backends on a machine
without their GPU) runs with ``TRITON_INTERPRET=1`` in its process, and its report says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from indexcache.backends.torch.memory import env_budget
from indexcache.backends.triton.target import INTERPRET_ENV, triton_import
from indexcache.conformance.worker import summarize, unchecked, unchecked_ops, worst_text
from indexcache.hal import dispatch
from indexcache.hal.contract import Availability


def plan_runs(which: str | None) -> list[tuple[str, dict[str, str]]]:
    """``(backend, extra environment)`` to run: ``None`` = the selected backend plus every other
    available one; ``"all"`` = also every interpretable backend that can be interpreted here; else the one named.
    A selected backend that is not available (``INDEXCACHE_BACKEND=cuda`` without a GPU) raises
    :class:`~indexcache.hal.dispatch.BackendNotSupportedError` with its reason; with ``"all"``, an interpretable one
    runs interpreted as the others do.

    An interpretable backend runs interpreted only where its probe under ``TRITON_INTERPRET=1`` finds it available:
    with ``"all"``, where Triton itself is absent or fails to import (a CPU, macOS or Windows install without it), the
    interpretable backends are left out and a line on stderr says why; any other reason (a bad architecture override)
    raises :class:`~indexcache.hal.dispatch.BackendNotSupportedError`, as it does for a named backend."""
    if which not in (None, "all"):
        dispatch.get(which)
        avail = dispatch.availability(which)
        if avail.available:
            return [(which, {})]
        if dispatch.get(which).interpretable:
            interpreted = _interpreted_probe(which)
            if interpreted.available:
                return [(which, {INTERPRET_ENV: "1"})]
            avail = interpreted
        raise dispatch.BackendNotSupportedError(f"backend {which!r} cannot run here: {avail.reason}")
    selected, available = dispatch.get_backend(), dispatch.available_backends()
    if selected not in available:  # only an explicit choice can be: its worker, run natively, would crash
        avail, chosen = dispatch.availability(selected), dispatch.explicit_choice()
        if which is None or not dispatch.get(selected).interpretable:
            raise dispatch.BackendNotSupportedError(f"backend {selected!r} (chosen by {chosen[1]}) cannot run here: "
                                                    f"{avail.reason}")
    names = [n for n in available if n == selected] + [n for n in available if n != selected]
    runs = [(n, {}) for n in names]
    if which == "all":
        version, missing = triton_import()
        for n, b in dispatch.registry().items():
            if n in names or not b.interpretable:
                continue
            if version is None:
                print(f"conformance: backend {n} left out: its Triton kernels cannot run here ({missing})",
                      file=sys.stderr, flush=True)
                continue
            interpreted = _interpreted_probe(n)
            if not interpreted.available:
                raise dispatch.BackendNotSupportedError(f"backend {n!r} cannot run here: {interpreted.reason}")
            runs.append((n, {INTERPRET_ENV: "1"}))
    return runs


def _interpreted_probe(name: str) -> Availability:
    """Backend ``name``'s probe as its worker process, started with ``TRITON_INTERPRET=1``, will find it."""
    saved = os.environ.get(INTERPRET_ENV)
    os.environ[INTERPRET_ENV] = "1"
    try:
        return dispatch.get(name).probe()
    finally:
        if saved is None:
            del os.environ[INTERPRET_ENV]
        else:
            os.environ[INTERPRET_ENV] = saved


def run_all(which: str | None, out_dir: Path, op: str | None = None,
            compile_check: bool = False, jobs: int = 1,
            timeout: float | None = None) -> tuple[list[dict[str, Any]], bool]:
    """Run each planned backend in a subprocess (``compile_check``: with the cross-compile check of cuda and rocm;
    ``jobs``: its cases dealt to that many processes, ``worker.run_backend``; ``timeout``: seconds a backend's
    processes may take, after which they are killed, None for no limit);
    return the reports this run wrote and whether every case passed and a case ran on every backend (its worker exits
    1 where one failed or none ran: :func:`~indexcache.conformance.worker.unchecked`). A backend whose process fails,
    runs past the timeout or writes no report counts as crashed: no report, not ok (a report left by an earlier run
    is deleted first, never read). A bad ``INDEXCACHE_TORCH_MEMORY_BUDGET`` raises ``MemoryBudgetError`` before any
    worker starts."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ValueError(f"timeout: expected a number of seconds > 0 or None, got {timeout!r}")
    env_budget()  # every worker may run the torch backend: a bad budget is one error here, not one per worker
    reports, ok = [], True
    for name, extra in plan_runs(which):
        path = out_dir / f"conformance-{name}.json"
        path.unlink(missing_ok=True)
        path.with_suffix(".md").unlink(missing_ok=True)
        env = {**os.environ, **extra}
        cmd = [sys.executable, "-m", "indexcache.conformance.worker", "--backend", name, "--out", str(out_dir)]
        if op:
            cmd += ["--op", op]
        if compile_check:
            cmd.append("--compile")
        if jobs > 1:
            cmd += ["--jobs", str(jobs)]
        mode = " (interpreted)" if extra else ""
        print(f"conformance: running backend {name}{mode} ...", file=sys.stderr, flush=True)
        returncode = _run(cmd, env, timeout)
        if returncode is None:
            print(f"conformance: backend {name} did not finish within {timeout:g} s: killed (its last case "
                  "reported above; no report written)", file=sys.stderr)
            ok = False
            continue
        if returncode not in (0, 1) or not path.exists():
            wrote = "" if path.exists() else ", no report written"
            print(f"conformance: backend {name} crashed (exit {returncode}{wrote})", file=sys.stderr)
            ok = False
            continue
        report = json.loads(path.read_text())
        reports.append(report)
        ok &= returncode == 0
    return reports, ok


def _run(cmd: list[str], env: dict[str, str], timeout: float | None) -> int | None:
    """``cmd``'s exit status, or None when it ran past ``timeout`` seconds: then it and every process it started
    (its shards) are killed, as they are when this process is interrupted while waiting (on Windows, which has no
    process groups, the backend's process alone)."""
    if timeout is None:
        return subprocess.run(cmd, env=env).returncode
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: a kill reaches the shards
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()


def table(reports: list[dict[str, Any]]) -> str:
    """Backend × op: cases passed/failed/declined, worst error against its bound, mode."""
    rows = [("backend", "mode", "op", "passed", "failed", "declined", "worst error / bound")]
    for report in reports:
        for op, s in summarize(report).items():
            rows.append((report["backend"], report["mode"], op, str(s["passed"]), str(s["failed"]),
                         str(s["declined"]), worst_text(s)))
        if "compiled_for" in report:  # kernel builds of the cross-compile check
            bad = sum(r["status"] == "failed" for r in report["compiled_for"])
            rows.append((report["backend"], "cross-compiled", "(compile)", str(len(report["compiled_for"]) - bad),
                         str(bad), "0", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def not_passed(reports: list[dict[str, Any]]) -> list[str]:
    """One line per case that did not pass: status, backend, op, case and the first line of why (a declined case's
    reason is the backend's own, e.g. the fp8 format it lacks; the report's .json has the whole detail)."""
    return [f"{r['status']} {report['backend']} {r['op']}: {r['case']}: {(r['detail'].splitlines() or [''])[0]}"
            for report in reports for r in report["results"] if r["status"] != "passed"]


def unchecked_lines(reports: list[dict[str, Any]]) -> list[str]:
    """One line per backend on which no case ran (its worker exited 1: the run fails), and per op of which no case
    ran on a backend that ran others' (every case of the op declined: a line, not a failure)."""
    lines = []
    for report in reports:
        if why := unchecked(report["results"]):
            lines.append(f"conformance: no case ran on backend {report['backend']}, nothing was checked: {why}")
        lines += [f"conformance: no case of {op} ran on backend {report['backend']} (its other ops ran): {why}"
                  for op, why in unchecked_ops(report).items()]
    return lines
