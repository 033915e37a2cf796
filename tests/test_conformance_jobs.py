"""``indexcache conformance --jobs N``: a backend's cases dealt to N processes give the report one process gives,
in catalogue order; a shard that crashes is a failed result per case it held, never a silent gap."""

from __future__ import annotations

import subprocess

import pytest

from indexcache.conformance import worker
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
