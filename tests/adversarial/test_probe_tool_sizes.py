"""Issue 34 (adversarial probe), items 3 and 9: the tools refuse what they cannot run before any work.

`indexcache demo` and `calibrate --from-model` take sizes in their ranges only (argparse's one-line error, exit 2)
and refuse a run that needs more memory than the device has free before allocating anything; a bad
INDEXCACHE_TORCH_MEMORY_BUDGET is one line from the parent, before any worker starts; `calibrate --out` is tried for
writing before the run, a write that fails at the end is one line and leaves the folder as it was, and --no-plots
removes an earlier run's plots (and says so) instead of leaving them beside the new results.

The rows of SIZES and every other test broke on 29aceca (a traceback, the whole run, or a stale or half-written
folder); GUARD_SIZES held already and stay as guards.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from indexcache.conformance import suite
from indexcache.tools.cli import main
from indexcache.tools.model import checks
from indexcache.tools.model.calibration import record_dump
from indexcache.tools.model.config import ModelSettingError, preset
from indexcache.tools.model.demo import run_demo

SECONDS = 5.0  # the refusal comes before any work; the runs refused here would take minutes to hours
BUDGET_VAR = "INDEXCACHE_TORCH_MEMORY_BUDGET"
COMPUTATIONS = ("indexcache.tools.model.demo.DSAModel", "indexcache.tools.model.calibration.DSAModel",
                "indexcache.tools.model.demo.compare_plans", "indexcache.tools.calibrate.calibration.overlap_matrix",
                "indexcache.tools.calibrate.calibration.load_dump")


def _ran(*_, **__):
    raise AssertionError("the computation ran before the bad input was refused")


@pytest.fixture
def no_work(monkeypatch, fresh_dispatch):
    """Every computation of demo and calibrate fails the test if it starts."""
    for target in COMPUTATIONS:
        monkeypatch.setattr(target, _ran)


def _run(argv: list[str]) -> tuple[int, float]:
    """Exit status of `indexcache ARGV` (argparse's SystemExit or main's return) and the seconds it took."""
    start = time.perf_counter()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, time.perf_counter() - start


def _one_line_error(err: str, command: str, says: str) -> None:
    """stderr ends with one line `indexcache COMMAND: error: ...` saying ``says`` (argparse puts its usage above)."""
    assert "Traceback" not in err, err
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith(f"indexcache {command}: error: ") and says in last, err
    assert all(line.startswith(("usage:", " ")) for line in err.rstrip("\n").split("\n")[:-1]), err


CAL = ["calibrate", "--from-model", "v32-like", "--no-plots", "--out", "OUT"]
# (argv, what the one line says)
SIZES = [
    (["demo", "--topk", "100000"], "argument --topk: expected an integer in 1..65536, got 100000"),
    (["demo", "--freq", "5000"], "argument --freq: expected an integer in 1..4096, got 5000"),
    (["demo", "--seed", "-1"], "argument --seed: expected an integer >= 0, got -1"),
    (["demo", "--seed", str(2**64)], f"--seed {2**64}: must be at most {2**64 - 1}"),
    (["demo", "--prompt-len", "100000000"], "the run needs at least"),
    (["demo", "--batch", "100000000"], "the run needs at least"),
    (["demo", "--decode-steps", "1000000000"], "the run needs at least"),
    (["demo", "--batch", "9" * 5000], "argument --batch: expected an integer >= 1, got 9999"),
    ([*CAL, "--prompt-len", "200000", "--topk", "100000"], "argument --topk: expected an integer in 1..65536, got "),
    ([*CAL, "--prompt-len", "100000000"], "the run needs at least"),
    ([*CAL, "--seed", "-5"], "argument --seed: expected an integer >= 0, got -5"),
    ([*CAL, "--threads", "0"], "argument --threads: expected an integer >= 1, got 0"),
    ([*CAL, "--producers", "0"], "argument --producers: expected an integer >= 1, got 0"),
]
GUARD_SIZES = [
    (["demo", "--topk", "0"], "--topk"),
    (["demo", "--batch", "0"], "--batch"),
    (["demo", "--prompt-len", "-3"], "--prompt-len"),
    (["demo", "--decode-steps", "0"], "--decode-steps"),
    (["demo", "--batch", "2.5"], "--batch"),
    ([*CAL, "--prompt-len", "0"], "len"),
    ([*CAL, "--prompt-len", "64", "--topk", "64"], "--prompt-len 64 must exceed --topk 64"),
]


def _argv(argv: list[str], tmp_path: Path) -> list[str]:
    return [str(tmp_path / "out") if arg == "OUT" else arg for arg in argv]


@pytest.mark.parametrize(("argv", "says"), SIZES, ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else None)
def test_a_size_the_tools_cannot_run_is_refused_before_any_work(tmp_path, capsys, no_work, argv, says):
    """item 3: a size out of range or a run that cannot fit in memory is one error line with exit status 2, within
    seconds and before the model is built; 29aceca ran them (a traceback at top-k 100000 or seed 2^64, 614 GB asked
    for, 90 s at 7.3 GB)."""
    code, seconds = _run(_argv(argv, tmp_path))
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    _one_line_error(err, argv[0], says)
    assert seconds < SECONDS
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "says"), GUARD_SIZES, ids=lambda v: " ".join(v)[:60] if isinstance(v, list)
                         else None)
def test_sizes_refused_already(tmp_path, capsys, no_work, argv, says):
    """item 3 (guards, held on 29aceca): sizes below 1, and a prompt no longer than k, are one error line too."""
    code, seconds = _run(_argv(argv, tmp_path))
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    _one_line_error(err, argv[0], says)
    assert seconds < SECONDS


def test_a_run_beyond_free_memory_is_refused_by_the_library(monkeypatch):
    """item 3: run_demo and record_dump refuse, before building the model, a run whose lower bound of memory
    (checks.run_bytes) exceeds what the device has free, naming what takes most of it."""
    monkeypatch.setattr(checks, "free_bytes", lambda device: 2**20)
    monkeypatch.setattr("indexcache.tools.model.demo.DSAModel", _ran)
    monkeypatch.setattr("indexcache.tools.model.calibration.DSAModel", _ran)
    with pytest.raises(ModelSettingError, match=r"batch=1, prompt_len=4096, decode_steps=2, topk=16: the run "
                       r"needs at least .* GiB on cpu, most of it for the prefill logits"):
        run_demo(backend="torch", batch=1, prompt_len=4096, decode_steps=2, topk=16)
    with pytest.raises(ModelSettingError, match="more than the 0.000977 GiB free"):
        record_dump("v32-like", backend="torch", batch=1, prompt_len=4096, topk=16)
    with pytest.raises(ModelSettingError, match=r"batch=<an integer of about 5001 digits>: must be at most "
                       r"2147483647"):  # int32 request ids; and the message survives Python's int/str digit limit
        run_demo(backend="torch", batch=10**5000)
    config = preset("v32-like", topk=16)
    bound = checks.run_bytes(config, batch=2, prompt_len=512, decode_steps=8)
    assert bound["prefill logits [batch x prompt_len]^2 float32"] == 4 * 1024 * 1024
    assert sum(bound.values()) < 2**30  # the CPU default run is never refused on a machine with a GiB free


# --- INDEXCACHE_TORCH_MEMORY_BUDGET -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["lots", "0", "-5", "1e9", "9" * 5000, "²"])
def test_a_bad_memory_budget_is_refused_before_any_worker(tmp_path, capsys, monkeypatch, fresh_dispatch, value):
    """item 9: `conformance` with a bad INDEXCACHE_TORCH_MEMORY_BUDGET is one line naming the variable, from the
    parent, and no worker starts; 29aceca started each worker, which printed a 40-line traceback."""
    monkeypatch.setenv(BUDGET_VAR, value)
    monkeypatch.setattr(suite, "subprocess", types.SimpleNamespace(run=lambda *a, **k: pytest.fail("a worker ran")))
    code, _ = _run(["conformance", "--backend", "torch", "--op", "translate", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    _one_line_error(err, "conformance", f"{BUDGET_VAR}: expected a positive number of bytes, got ")
    with pytest.raises(ValueError, match=BUDGET_VAR):  # the library's run_all refuses it before spawning too
        suite.run_all("torch", tmp_path, "translate")


@pytest.mark.parametrize("argv", [["info"], ["info", "--json"], ["bench", "--op", "translate", "--quick"],
                                  ["demo", "--prompt-len", "40", "--topk", "16"], CAL])
def test_a_bad_memory_budget_is_one_line_from_every_command_that_runs_ops(tmp_path, capsys, monkeypatch, no_work,
                                                                          argv):
    """item 9: info, bench, demo and calibrate --from-model refuse a bad budget in one line before any work;
    29aceca gave a traceback (info), a FAILED line per case (bench) or failed mid-run."""
    monkeypatch.setenv(BUDGET_VAR, "lots")
    monkeypatch.setattr("indexcache.bench.run", _ran)
    code, _ = _run(_argv(argv, tmp_path))
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    _one_line_error(err, argv[0], f"{BUDGET_VAR}: expected a positive number of bytes, got 'lots'")


def test_conformance_console_script_with_a_bad_budget_prints_one_line(tmp_path):
    """item 9, end to end: the console script prints one line and exits 2 (29aceca: the worker's traceback)."""
    script = Path(sys.executable).with_name("indexcache")
    result = subprocess.run([str(script), "conformance", "--backend", "torch", "--op", "translate", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, BUDGET_VAR: "lots"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"indexcache conformance: error: {BUDGET_VAR}: expected a positive number of bytes, "
                             "got 'lots'\n")


# --- calibrate --out -----------------------------------------------------------------------------------------------


def _dump(tmp_path: Path) -> Path:
    dump = tmp_path / "dump"
    dump.mkdir()
    rng = np.random.default_rng(0)
    for layer in range(6):
        np.savez(dump / f"layer_{layer}.npz", rng.integers(-1, 40, (16, 8)).astype(np.int32))
    return dump


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc, where nobody (root included) creates files")
def test_calibrate_out_where_nothing_can_be_written_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    """item 9: an --out that cannot be created (here under /proc, which permission bits do not describe, so root
    passed os.access) is one line before the run; 29aceca ran the whole calibration, then gave a traceback."""
    dump = _dump(tmp_path)
    monkeypatch.setattr("indexcache.tools.calibrate.calibration.overlap_matrix", _ran)
    code, _ = _run(["calibrate", "--dump", str(dump), "--no-plots", "--out", "/proc/indexcache-out/run"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    _one_line_error(err, "calibrate", "--out /proc/indexcache-out/run: cannot ")  # write there, or create it


def test_calibrate_output_check_leaves_no_folder_behind(tmp_path, capsys):
    """item 9 (guard of the check above): trying --out for writing makes its missing folders and removes them again,
    so a run refused later leaves nothing behind."""
    code, _ = _run(["calibrate", "--dump", str(tmp_path / "missing"), "--no-plots", "--out", str(tmp_path / "a/b/c")])
    assert code == 2 and "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def _snapshot(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


def test_calibrate_write_that_fails_at_the_end_is_one_line_and_leaves_the_folder_as_it_was(tmp_path, capsys,
                                                                                           monkeypatch):
    """item 9: the disk filling while the last file is written is one line naming the folder and the file, exit 2,
    and --out still holds the earlier run's files, unchanged, and nothing else; 29aceca gave a traceback and left
    the new pattern, config and report beside the earlier run's plots."""
    pytest.importorskip("matplotlib")
    dump, out = _dump(tmp_path), tmp_path / "out"
    assert main(["calibrate", "--dump", str(dump), "--producers", "3", "--out", str(out)]) == 0
    before = _snapshot(out)
    capsys.readouterr()

    def full(result, path, **_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr("indexcache.tools.calibrate.outputs.plot_objective", full)
    code, _ = _run(["calibrate", "--dump", str(dump), "--producers", "2", "--out", str(out)])
    out_text, err = capsys.readouterr()
    assert code == 2 and "wrote:" not in out_text
    _one_line_error(err, "calibrate", f"{out}: cannot write objective.png (No space left on device); nothing was "
                    "written")
    assert _snapshot(out) == before


def test_calibrate_no_plots_removes_an_earlier_runs_plots_and_says_so(tmp_path, capsys):
    """item 9: --no-plots into a folder an earlier run drew plots in removes those plots and lists them on a
    `removed:` line, so the folder holds one run's results; 29aceca left them beside the new results, silently."""
    pytest.importorskip("matplotlib")
    dump, out = _dump(tmp_path), tmp_path / "out"
    assert main(["calibrate", "--dump", str(dump), "--producers", "3", "--out", str(out)]) == 0
    assert {"overlap.png", "objective.png"} <= set(os.listdir(out))
    capsys.readouterr()
    assert main(["calibrate", "--dump", str(dump), "--producers", "2", "--no-plots", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.json", "pattern.txt", "report.json"]
    assert f"removed:   {out / 'overlap.png'}, {out / 'objective.png'} (an earlier run's plots" in text
    assert main(["calibrate", "--dump", str(dump), "--producers", "2", "--no-plots", "--out", str(out)]) == 0
    assert "removed:" not in capsys.readouterr().out
