"""``indexcache bench`` on the CPU: end to end on tiny shapes, honest labels, checks that can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from indexcache import bench, cli
from indexcache.dispatch import Availability, Backend, OpImpl

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU labels; this machine has a GPU")


@pytest.fixture(scope="module")
def interpreted_run(tmp_path_factory):
    """One quick ``indexcache bench --op translate`` with the Triton backends interpreted: (stdout, report)."""
    path = tmp_path_factory.mktemp("bench") / "translate.json"
    env = {k: v for k, v in os.environ.items() if k != "INDEXCACHE_BACKEND"} | {"TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "indexcache.cli", "bench", "--op", "translate", "--quick", "--json",
                           str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(path.read_text())


@no_gpu
def test_cpu_results_are_labelled_not_gpu(interpreted_run):
    stdout, report = interpreted_run
    assert report["gpu_run"] is False and report["gpu"] is None
    assert "not a GPU run" in report["notice"] and "NOTE: not a GPU run" in stdout
    rows = report["results"]
    assert {r["backend"] for r in rows} >= {"torch", "cuda", "rocm"}
    assert {r["mode"] for r in rows} == {"CPU", "interpreted"}
    assert report["ceilings"]["copy_bandwidth"]["mode"] == "CPU"
    assert report["ceilings"]["launch"]["mode"] == "interpreted"


@no_gpu
def test_every_backend_agrees_and_is_timed(interpreted_run):
    _, report = interpreted_run
    cases = {c.name for c in bench.TRANSLATE.cases(True)}
    assert {r["case"] for r in report["results"]} == cases
    for r in report["results"]:
        assert r["check"] == "ok", r
        assert r["eager_us"] > 0 and r["graph_us"] is None and r["sets"] >= bench.MIN_SETS
        assert r["bytes"] == 12 * r["params"]["requests"] * r["params"]["rows_per_request"] * r["params"]["k"]


@no_gpu
def test_derived_numbers_compare_one_mode_only(interpreted_run):
    _, report = interpreted_run
    for r in report["results"]:
        if r["backend"] == "torch":
            assert r["speedup_vs_torch"] == 1.0 and r["ceiling_fraction"] > 0 and r["launch_ratio"] is None
        else:
            assert r["speedup_vs_torch"] is None and r["ceiling_fraction"] is None and r["launch_ratio"] > 0


def test_json_has_what_the_table_shows(interpreted_run):
    stdout, report = interpreted_run
    for key in ("schema", "date", "gpu", "commit", "dirty", "settings", "ceilings", "results"):
        assert key in report
    assert {"torch", "triton"} <= set(report["versions"])
    assert {"copy_bandwidth", "launch"} <= set(report["ceilings"])
    for r in report["results"]:
        assert {key for _, key, _ in bench.COLUMNS} <= set(r)
        line = next(x for x in stdout.splitlines() if x.startswith(r["case"]) and f" {r['backend']} " in x)
        assert r["mode"] in line and r["check"] in line
    assert "GB/s" in stdout and "% copy_bandwidth" in stdout


def _with_backend(dispatch, name: str, fn) -> None:
    dispatch.registry()[name] = Backend(name=name, priority=-1, probe=lambda: Availability(True, "test", mode="CPU"),
                                        ops={"translate": OpImpl(fn)})


def test_a_wrong_backend_fails_the_run(fresh_dispatch, capsys):
    def wrong(raw, page_table, seq_lens, page_size, row_to_batch, out):
        return out.fill_(7)

    _with_backend(fresh_dispatch, "wrong", wrong)
    report = bench.run(["translate"], ["wrong"], quick=True)
    assert {r["check"] for r in report["results"] if r["backend"] == "wrong"} == {"MISMATCH"}
    assert {r["check"] for r in report["results"] if r["backend"] == "torch"} == {"ok"}
    assert bench.failed(report) and all(r["backend"] == "wrong" for r in bench.failed(report))
    assert cli.main(["bench", "--op", "translate", "--backend", "wrong", "--quick"]) == 1
    assert "FAILED translate" in capsys.readouterr().err


def test_a_backend_that_leaves_slots_unwritten_fails(fresh_dispatch):
    def lazy(raw, page_table, seq_lens, page_size, row_to_batch, out):
        return out

    _with_backend(fresh_dispatch, "lazy", lazy)
    report = bench.run(["translate"], ["lazy"], quick=True)
    assert {r["check"] for r in report["results"] if r["backend"] == "lazy"} == {"MISMATCH"}


def test_a_crashing_backend_is_reported_and_the_rest_still_run(fresh_dispatch):
    def broken(**_):
        raise RuntimeError("kernel exploded")

    _with_backend(fresh_dispatch, "broken", broken)
    report = bench.run(["translate"], ["broken"], quick=True)
    rows = {r["backend"]: r for r in report["results"]}
    assert rows["broken"]["check"].startswith("error: RuntimeError: kernel exploded")
    assert rows["torch"]["eager_us"] > 0
    assert set(rows["broken"]) == set(rows["torch"]), "every row has the same JSON keys, timed or not"


def test_an_op_plugs_in_as_data(fresh_dispatch, monkeypatch):
    def build(case, gen):
        return {"x": torch.randn(case.params["n"], generator=gen), "out": torch.full((case.params["n"],), float("nan"))}

    op = bench.BenchOp(
        name="negate",
        cases=lambda quick: [bench.Case("n16", {"n": 16})],
        build=build,
        call=lambda a, backend: torch.neg(a["x"], out=a["out"]),
        bytes=lambda case: 8 * case.params["n"],
    )
    monkeypatch.setitem(bench.OPS, "negate", op)
    report = bench.run(["negate"], ["torch"], quick=True)
    (row,) = report["results"]
    assert (row["op"], row["case"], row["check"], row["bytes"], row["flops"]) == ("negate", "n16", "ok", 128, 0)
    assert row["rate"] > 0 and row["rate_unit"] == "GB/s"
    assert "op negate" in bench.format_table(report)


def test_unknown_names_exit_2(capsys):
    assert cli.main(["bench", "--op", "nope", "--quick"]) == 2
    assert cli.main(["bench", "--backend", "nope", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--op: expected one of" in err and "backend: expected one of" in err
