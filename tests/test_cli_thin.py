"""The command line is a thin layer: only bad input exits 2 with one line, a bug surfaces with its traceback, and
``indexcache plan`` (pure config logic) never imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from indexcache.tools.cli import main

V32 = str(Path(__file__).resolve().parent.parent / "examples" / "configs" / "deepseek-v3.2.json")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _bug(*_, **__):
    raise ValueError("an internal bug, not bad input")


def _type_bug(*_, **__):
    raise TypeError("an internal bug, not bad input")


INTERNAL = [
    (["plan", "--config", V32], "indexcache.plan.descriptor.Descriptor.from_plan", _bug),
    (["plan", "--config", V32, "--json"], "indexcache.plan.LayerPlan.from_config", _type_bug),
    (["info"], "indexcache.tools.backend_status.backend_status", _bug),
    (["calibrate", "--dump", "DUMP", "--no-plots", "--out", "OUT"],
     "indexcache.tools.calibrate.calibration.overlap_matrix", _bug),
    (["calibrate", "--dump", "DUMP", "--no-plots", "--out", "OUT"],
     "indexcache.tools.calibrate.calibration.greedy_search", _type_bug),
    (["demo", "--backend", "torch", "--prompt-len", "40", "--topk", "16"], "indexcache.tools.model.demo.compare_plans",
     _bug),
]


@pytest.mark.parametrize(("argv", "target", "bug"), INTERNAL, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else v if isinstance(v, str) else None)
def test_an_internal_error_propagates_instead_of_exiting_2(tmp_path, monkeypatch, fresh_dispatch, argv, target, bug):
    """A ValueError / TypeError raised by a library call (a bug) is not taken for bad input: it propagates."""
    import numpy as np

    (tmp_path / "dump").mkdir()
    for layer in range(3):
        np.savez(tmp_path / "dump" / f"layer_{layer}.npz", np.arange(8, dtype=np.int32).reshape(2, 4) + layer)
    argv = [arg.replace("DUMP", str(tmp_path / "dump")).replace("OUT", str(tmp_path / "out")) for arg in argv]
    monkeypatch.setattr(target, bug)
    with pytest.raises((ValueError, TypeError), match="an internal bug"):
        main(argv)


def test_an_internal_error_prints_its_traceback():
    result = _python(
        "import indexcache.plan as plan\n"
        "def bug(*args, **kwargs): raise ValueError('an internal bug')\n"
        "plan.LayerPlan.from_config = bug\n"
        f"from indexcache.tools.cli import main; main(['plan', '--config', {V32!r}])"
    )
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "ValueError: an internal bug" in result.stderr
    assert "indexcache plan: error" not in result.stderr


def test_plan_never_imports_torch():
    """`indexcache plan` is pure config logic: neither the command (output or a usage error) nor
    ``import indexcache.plan`` / ``indexcache.plan.descriptor`` imports torch."""
    result = _python(
        "import sys\n"
        "import indexcache.plan, indexcache.plan.descriptor\n"
        "assert 'torch' not in sys.modules, 'import indexcache.plan imported torch'\n"
        "from indexcache.tools.cli import main\n"
        f"assert main(['plan', '--config', {V32!r}, '--json']) == 0\n"
        f"assert main(['plan', '--config', {V32!r}, '--pattern', 'FSX']) == 2\n"
        "assert main(['plan', '--config', '/nonexistent/config.json']) == 2\n"
        "loaded = sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.'))\n"
        "assert not loaded, loaded\n"
    )
    assert result.returncode == 0, result.stderr
    assert '"producers": [0, 1, 5,' in result.stdout



def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """``indexcache plan ... | head -1`` ended in a BrokenPipeError traceback (or 'Exception ignored ...'
    at exit) once head had its line; a shell tool stops quietly with SIGPIPE's status."""
    config = Path(__file__).parent.parent / "examples" / "configs" / "deepseek-v3.2.json"
    code = "import sys; from indexcache.tools.cli import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "plan", "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # no reader: the command's first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait() == 141, err
    assert "BrokenPipeError" not in err and "Traceback" not in err


def test_conformance_refuses_a_selected_backend_that_cannot_run_here(fresh_dispatch, monkeypatch, tmp_path, capsys):
    """``INDEXCACHE_BACKEND=cuda`` without a GPU: the selected backend's worker ran natively and crashed with a
    traceback (exit 1, the other backends run after it). Now one line naming the variable before any backend runs;
    ``--backend all`` runs it interpreted, as it runs the other interpretable backends."""
    import torch

    from indexcache.conformance import suite

    if torch.cuda.is_available():
        pytest.skip("cuda can run here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("INDEXCACHE_BACKEND", "cuda")
    assert main(["conformance", "--op", "translate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("indexcache conformance: error: backend 'cuda' (chosen by INDEXCACHE_BACKEND=cuda) cannot "
                          "run here: "), err
    assert err.count("\n") == 1
    assert not any(tmp_path.iterdir())
    pytest.importorskip("triton")
    assert ("cuda", {"TRITON_INTERPRET": "1"}) in suite.plan_runs("all")
    assert ("cuda", {}) not in suite.plan_runs("all")


def test_every_option_of_every_command_has_its_help():
    """``indexcache demo --help`` listed ``--preset`` with no word on what it chooses or its default."""
    import argparse

    from indexcache.tools.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    silent = [f"{name} {action.option_strings[0]}" for name, command in commands.items()
              for action in command._actions if action.option_strings and not (action.help or "").strip()]
    assert not silent


@pytest.mark.parametrize("backend", [[], ["--backend", "torch"]], ids=["default", "torch"])
def test_conformance_compile_without_a_triton_backend_is_refused(fresh_dispatch, monkeypatch, tmp_path, capsys,
                                                                 backend):
    """``--compile`` adds the cross-compile check to the cuda and rocm reports: on a CPU (the torch backend alone, by
    default or named) it was silently ignored, exit 0. Now refused before any backend runs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU backend runs here by default")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["conformance", "--compile", *backend, "--op", "translate", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == ("indexcache conformance: error: --compile: adds the cross-compile check to the cuda and rocm "
                   "reports, and this run has neither (backends: torch); add --backend all (interpreted where their "
                   "GPU is absent) or name one of them\n")
    assert not any(tmp_path.iterdir())
