"""``indexcache conformance --jobs N``: a backend's cases dealt to N processes give the report one process gives,
in catalogue order; a shard that crashes is a failed result per case it held, never a silent gap."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from indexcache.conformance import suite, worker
from indexcache.tools.cli import main

KEYS = ("op", "case", "status", "error", "bound")


def _results(report):
    return [tuple(r[k] for k in KEYS) for r in report["results"]]


def test_sharded_cases_give_the_single_process_report():
    one = worker.run_backend("torch", "translate")
    three = worker.run_backend("torch", "translate", jobs=3)
    assert len(one["results"]) > 3
    assert _results(three) == _results(one)


def test_a_crashed_shard_fails_each_case_it_held(monkeypatch):
    real = subprocess.Popen

    def popen(cmd, **kwargs):  # shard 1 of 2 dies at start
        if "1/2" in cmd:
            cmd = [cmd[0], "-c", "raise SystemExit(3)"]
        return real(cmd, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    report = worker.run_backend("torch", "translate", jobs=2)
    statuses = [r["status"] for r in report["results"]]
    assert all(s == "failed" for s in statuses[1::2]) and "failed" not in statuses[0::2]
    assert report["results"][1]["detail"] == "conformance shard 1/2 crashed (exit 3)"


@pytest.mark.parametrize("jobs", [0, -1, True])
def test_jobs_below_one_are_refused(jobs):
    with pytest.raises(ValueError, match=f"jobs: expected an int >= 1, got {jobs!r}"):
        worker.run_backend("torch", "translate", jobs=jobs)


def test_cli_refuses_jobs_below_one(tmp_path, capsys):
    assert main(["conformance", "--backend", "torch", "--jobs", "0", "--out", str(tmp_path)]) == 2
    assert "--jobs: expected an int >= 1, got 0" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of ours that is not yet reaped is a zombie: dead for this purpose.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[-1][0] != "Z"


def test_a_backend_past_the_timeout_is_killed_with_its_shards(monkeypatch, tmp_path, capsys):
    """A backend whose process hangs (a kernel that never ends) held the suite for ever: with a timeout it and the
    shard it started are killed, the run is not ok and writes no report."""
    real = subprocess.Popen
    pids = tmp_path / "pids"
    hang = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pids)!r}, 'w').write(f'{{c.pid}}'); time.sleep(120)")

    def popen(cmd, **kwargs):
        if "indexcache.conformance.worker" in cmd:
            cmd = [sys.executable, "-c", hang]
        return real(cmd, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    start = time.monotonic()
    reports, ok = suite.run_all("torch", tmp_path / "out", "translate", timeout=3)
    assert time.monotonic() - start < 60
    assert reports == [] and not ok
    assert "conformance: backend torch did not finish within 3 s: killed" in capsys.readouterr().err
    assert not (tmp_path / "out" / "conformance-torch.json").exists()
    child = int(pids.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_timeout_without_process_groups_kills_the_backend(monkeypatch):
    """Where the platform has no process groups (Windows: no ``os.killpg``), the backend's process is killed alone
    (the kill of its group raised AttributeError there)."""
    monkeypatch.delattr(os, "killpg")
    start = time.monotonic()
    assert suite._run([sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ), 1) is None
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("timeout", [0, -1.0, True, "5"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout, tmp_path):
    with pytest.raises(ValueError, match="timeout: expected a number of seconds > 0 or None"):
        suite.run_all("torch", tmp_path, "translate", timeout=timeout)


@pytest.mark.parametrize("value", ["0", "-2", "nan"])
def test_cli_refuses_a_timeout_below_or_at_zero(value, tmp_path, capsys):
    assert main(["conformance", "--backend", "torch", "--timeout", value, "--out", str(tmp_path)]) == 2
    assert "--timeout: expected a number of seconds > 0" in capsys.readouterr().err


def test_the_worker_run_by_hand_refuses_jobs_below_one(tmp_path, capsys):
    """``python -m indexcache.conformance.worker --jobs 0`` ended in a traceback."""
    with pytest.raises(SystemExit) as exit_:
        worker.main(["--backend", "torch", "--out", str(tmp_path), "--jobs", "0"])
    assert exit_.value.code == 2
    assert "--jobs: expected an int >= 1, got 0" in capsys.readouterr().err
