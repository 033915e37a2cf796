"""Issue 21 (adversarial probe), items 5, 9 and 13: the command line refuses bad input before any work, and
conformance never passes off an earlier run's report as this run's."""

from __future__ import annotations

import json
import os
import subprocess
import types

import pytest
import torch

import indexcache
from indexcache.conformance import suite, worker
from indexcache.conformance.cases import CASES
from indexcache.hal import dispatch
from indexcache.tools.cli import main

I32 = torch.int32


def _report(case: str) -> dict:
    """A minimal conformance report of backend torch with one passed translate case named ``case``."""
    result = {"op": "translate", "case": case, "status": "passed", "error": None, "bound": None, "detail": ""}
    return {"backend": "torch", "mode": "CPU", "device": "cpu", "results": [result]}


def _write_stale(out) -> None:
    out.mkdir(exist_ok=True)
    (out / "conformance-torch.json").write_text(json.dumps(_report("stale-from-an-earlier-run")))
    (out / "conformance-torch.md").write_text("# an earlier run\n")


def _fake_workers(monkeypatch, worker) -> list[list[str]]:
    """Replace the worker processes of the suite by ``worker(cmd) -> returncode``; returns the commands run."""
    commands = []

    def run(cmd, env=None):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, worker(cmd))

    monkeypatch.setattr(suite, "subprocess", types.SimpleNamespace(run=run))
    return commands


def _one_line_error(err: str, command: str, option: str) -> None:
    assert err.startswith(f"indexcache {command}: error: {option}"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_conformance_refuses_an_unknown_op_before_running(tmp_path, capsys, monkeypatch, fresh_dispatch):
    """issue 21 item 5: `conformance --op bogus` is a usage error naming the known ops; no worker runs and a
    good report already in --out is left as it was."""
    _write_stale(tmp_path)
    good = (tmp_path / "conformance-torch.json").read_text()
    commands = _fake_workers(monkeypatch, lambda cmd: pytest.fail(f"a worker ran: {cmd}"))
    assert main(["conformance", "--backend", "torch", "--op", "bogus", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and commands == []
    _one_line_error(err, "conformance", "--op")
    assert "'bogus'" in err and all(f"'{case.op}'" in err for case in CASES)
    assert (tmp_path / "conformance-torch.json").read_text() == good


def test_conformance_worker_refuses_an_unknown_op(tmp_path, capsys):
    """issue 21 item 5: the worker (python -m indexcache.conformance.worker) refuses --op bogus with exit 2
    instead of writing a report of zero cases."""
    with pytest.raises(SystemExit) as exc:
        worker.main(["--backend", "torch", "--out", str(tmp_path), "--op", "bogus"])
    assert exc.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("returncode", [0, 1, -9], ids=["exit-0", "exit-1", "killed"])
def test_conformance_worker_that_wrote_nothing_is_a_crash(tmp_path, capsys, monkeypatch, fresh_dispatch, returncode):
    """issue 21 item 5: a worker that exits without writing its report is a crash: exit 1, no "reports written",
    and the report an earlier run left in --out is neither shown nor kept."""
    _write_stale(tmp_path)
    _fake_workers(monkeypatch, lambda cmd: returncode)
    assert main(["conformance", "--backend", "torch", "--op", "translate", "--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "reports written" not in out and "stale-from-an-earlier-run" not in out
    assert f"backend torch crashed (exit {returncode}, no report written)" in err
    assert list(tmp_path.iterdir()) == []


def test_conformance_deletes_a_stale_report_before_the_worker_runs(tmp_path, capsys, monkeypatch, fresh_dispatch):
    """issue 21 item 5: the suite deletes an earlier run's report before starting the worker and reads only the
    report this run wrote."""
    _write_stale(tmp_path)
    seen = []

    def worker(cmd) -> int:
        seen.append(sorted(path.name for path in tmp_path.iterdir()))
        (tmp_path / "conformance-torch.json").write_text(json.dumps(_report("fresh-from-this-run")))
        return 0

    _fake_workers(monkeypatch, worker)
    assert main(["conformance", "--backend", "torch", "--op", "translate", "--out", str(tmp_path)]) == 0
    out, _ = capsys.readouterr()
    assert seen == [[]]
    assert "reports written" in out and "conformance-torch" in out
    assert json.loads((tmp_path / "conformance-torch.json").read_text())["results"][0]["case"] == "fresh-from-this-run"


def _ran(*_, **__):
    raise AssertionError("the computation ran before the output path was checked")


COMPUTATIONS = {
    "conformance": ["indexcache.conformance.suite.run_all"],
    "calibrate": ["indexcache.tools.calibrate.calibration.load_dump", "indexcache.tools.model.calibration.record_dump",
                  "indexcache.tools.calibrate.calibration.overlap_matrix"],
    "bench": ["indexcache.bench.run"],
    "demo": ["indexcache.tools.model.demo.DSAModel", "indexcache.tools.model.demo.compare_plans"],
    "compile-check": ["indexcache.backends.triton.crosscompile.check_targets"],
}
# (argv, the option named in the error, what the error says); FILE is an existing regular file, DIR a directory.
BAD_OUTPUTS = [
    (["conformance", "--backend", "torch", "--op", "translate", "--out", "FILE/sub"], "--out", "got a file"),
    (["conformance", "--backend", "torch", "--out", "FILE"], "--out", "expected a directory, got an existing file"),
    (["calibrate", "--from-model", "v32-like", "--out", "FILE/sub"], "--out", "got a file"),
    (["calibrate", "--dump", "DIR", "--no-plots", "--out", "FILE"], "--out", "got an existing file"),
    (["bench", "--op", "translate", "--quick", "--json", "FILE/sub/bench.json"], "--json", "got a file"),
    (["bench", "--op", "translate", "--json", "DIR"], "--json", "expected a file, got an existing directory"),
    (["demo", "--plot", "FILE/overlap.png"], "--plot", "got a file"),
    (["demo", "--plot", "DIR"], "--plot", "expected a file, got an existing directory"),
    (["compile-check", "--backend", "rocm", "--target", "gfx942", "--json", "FILE/cc.json"], "--json", "got a file"),
    (["compile-check", "--backend", "rocm", "--target", "gfx942", "--json", "DIR"], "--json", "existing directory"),
]


@pytest.mark.parametrize(("argv", "option", "message"), BAD_OUTPUTS, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else None)
def test_bad_output_path_is_refused_before_the_computation(tmp_path, capsys, monkeypatch, fresh_dispatch, argv, option,
                                                           message):
    """issue 21 item 9: an output path that cannot be written (a file where a folder is needed, a folder where a
    file is) is a one-line usage error (exit 2) naming the option, given before the computation starts."""
    if argv[0] == "compile-check":
        pytest.importorskip("triton")
    (tmp_path / "file").write_text("not a folder\n")
    (tmp_path / "dir").mkdir()
    argv = [arg.replace("FILE", str(tmp_path / "file")).replace("DIR", str(tmp_path / "dir")) for arg in argv]
    for target in COMPUTATIONS[argv[0]]:
        monkeypatch.setattr(target, _ran)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    _one_line_error(err, argv[0], option)
    assert message in err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes in a read-only folder")
def test_output_in_a_folder_without_write_permission_is_refused(tmp_path, capsys, monkeypatch):
    """issue 21 item 9: an output folder that cannot be created for lack of permission is a usage error too."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.setattr("indexcache.bench.run", _ran)
    assert main(["bench", "--op", "translate", "--quick", "--json", str(locked / "sub" / "bench.json")]) == 2
    _, err = capsys.readouterr()
    _one_line_error(err, "bench", "--json")
    assert "no write permission" in err


def test_info_with_an_unknown_backend_in_the_environment(capsys, monkeypatch, fresh_dispatch):
    """issue 21 item 13: `indexcache info` with INDEXCACHE_BACKEND=bogus exits 2 with one line naming the
    variable, the value and the known backends, rather than reporting "selected backend: bogus"."""
    monkeypatch.setenv(dispatch.ENV_VAR, "bogus")
    for argv in (["info"], ["info", "--json"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == ""
        _one_line_error(err, "info", f"{dispatch.ENV_VAR}: ")
        assert "'torch'" in err and "got 'bogus'" in err


def test_op_call_with_an_unknown_backend_in_the_environment(monkeypatch, fresh_dispatch):
    """issue 21 item 13: an op call (and get_backend) under INDEXCACHE_BACKEND=bogus raises UnknownBackendError
    naming the variable, the value and the known backends; it never falls back."""
    monkeypatch.setenv(dispatch.ENV_VAR, "bogus")
    expected = rf"{dispatch.ENV_VAR}: expected one of \[.*'torch'.*\], got 'bogus'"
    with pytest.raises(dispatch.UnknownBackendError, match=expected):
        indexcache.translate(torch.tensor([[0, 5]], dtype=I32), torch.tensor([[3]], dtype=I32),
                             torch.tensor([8], dtype=I32), 16)
    with pytest.raises(dispatch.UnknownBackendError, match=expected):
        dispatch.get_backend()


def test_conformance_prints_why_each_case_was_declined_or_failed(tmp_path, capsys, monkeypatch, fresh_dispatch):
    """issue 35 item 7: the terminal says why a case was declined (and why one failed), not only how many."""
    report = _report("passed one")
    report["results"] += [
        {"op": "mqa_logits", "case": "fp8 e4m3fnuz", "status": "declined", "error": None, "bound": None,
         "detail": "backend 'torch' cannot run mqa_logits: q is float8_e4m3fnuz"},
        {"op": "topk", "case": "ties", "status": "failed", "error": None, "bound": None,
         "detail": "row 3: index sets differ\nsecond line"},
    ]

    def worker(cmd) -> int:
        (tmp_path / "conformance-torch.json").write_text(json.dumps(report))
        return 1

    _fake_workers(monkeypatch, worker)
    assert main(["conformance", "--backend", "torch", "--out", str(tmp_path)]) == 1
    out, _ = capsys.readouterr()
    assert ("  declined torch mqa_logits: fp8 e4m3fnuz: backend 'torch' cannot run mqa_logits: q is float8_e4m3fnuz\n"
            "  failed torch topk: ties: row 3: index sets differ\n") in out
    assert "passed one" not in out and "second line" not in out


@pytest.mark.parametrize(("args", "message"), [
    (["--producers", "40", "--prompt-len", "64", "--topk", "16"],
     "--producers 40: must be an integer in 1..12 (the sparse layers)"),
])
def test_calibrate_errors_name_the_flag(tmp_path, capsys, args, message):
    """issue 35 item 7: an error of the calibration library names the command's flag, not the Python argument
    (it read "keep=0.0: ...; use producers= for a count"; a --keep out of (0, 1] is now refused as it is parsed,
    tests/test_calibrate.py)."""
    assert main(["calibrate", "--from-model", "v32-like", "--no-plots", "--out", str(tmp_path), *args]) == 2
    _, err = capsys.readouterr()
    assert err == f"indexcache calibrate: error: {message}\n"


def test_conformance_markdown_keeps_a_multi_line_detail_in_its_row():
    """A case's detail of several lines (a compiler's error, a judge's row list) stays one row of the .md's case
    table: its line breaks ended the row, and the lines after it were no table row at all."""
    report = {**_report("passed one"), "device_name": "cpu", "reason": "r", "date": "d", "torch": "t"}
    report["results"].append({"op": "topk", "case": "ties", "status": "failed", "error": None, "bound": None,
                              "detail": "row 3: index sets differ\r\nsecond line | with a pipe\nthird line"})
    lines = worker.to_markdown(report).splitlines()
    cases = lines[lines.index("| op | case | status | error | bound | detail |"):]
    assert len(cases) == 4 and all(line.startswith("|") and line.endswith("|") for line in cases), cases
    assert cases[-1] == ("| topk | ties | failed |  |  | row 3: index sets differ second line \\| with a pipe "
                         "third line |")


@pytest.mark.parametrize(("argv", "also"), [
    (["conformance", "--backend", "bogus", "--out", "OUT"], " or 'all'"),
    (["bench", "--backend", "bogus", "--op", "translate", "--quick"], ""),
    (["demo", "--backend", "bogus"], ""),
    (["calibrate", "--from-model", "v32-like", "--backend", "bogus", "--no-plots", "--out", "OUT"], ""),
], ids=lambda p: p[0] if isinstance(p, list) else None)
def test_an_unknown_backend_is_named_by_its_flag(tmp_path, capsys, fresh_dispatch, argv, also):
    """`--backend bogus` is one line naming the flag, as `--op bogus` is (it named the library's argument,
    "backend: expected ..."), and every value the flag takes (conformance's 'all' too: it listed the backends
    alone)."""
    argv = [arg.replace("OUT", str(tmp_path / "out")) for arg in argv]
    assert main(argv) == 2
    known = sorted(dispatch.registry())
    assert capsys.readouterr().err == (f"indexcache {argv[0]}: error: --backend: expected one of {known}{also}, got "
                                       "'bogus'\n")


def test_conformance_of_a_backend_that_cannot_run_here(tmp_path, capsys, monkeypatch, fresh_dispatch):
    """`conformance --backend mynpu` where the plug-in backend's probe finds no device and it cannot be interpreted
    is one line saying why (exit 2), before any worker starts: it was a BackendNotSupportedError traceback."""
    monkeypatch.setitem(dispatch.registry(), "mynpu", dispatch.Backend(
        name="mynpu", priority=-1, probe=lambda: dispatch.Availability(False, "no NPU here")))
    commands = _fake_workers(monkeypatch, lambda cmd: pytest.fail(f"a worker ran: {cmd}"))
    assert main(["conformance", "--backend", "mynpu", "--out", str(tmp_path)]) == 2
    assert commands == []
    assert capsys.readouterr().err == "indexcache conformance: error: backend 'mynpu' cannot run here: no NPU here\n"
