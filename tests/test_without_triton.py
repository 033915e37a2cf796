"""Where Triton is absent or fails to import (macOS, Windows, a CPU install without the ``cuda`` extra, a broken
wheel): the torch backend still runs every call, ``indexcache info`` says why cuda and rocm are unavailable, and the
commands that need Triton (compile-check, warmup, conformance of a Triton backend) refuse in one line instead of a
traceback. Each case runs in a subprocess whose ``PYTHONPATH`` puts a stand-in ``triton`` package first, one whose
import raises what a missing or broken Triton raises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

V32 = str(Path(__file__).resolve().parent.parent / "examples" / "configs" / "deepseek-v3.2.json")

# (the stand-in's import error, what the reason says)
TRITONS = {
    "absent": ('raise ModuleNotFoundError("No module named \'triton\'", name="triton")', "Triton is not installed"),
    "broken library": ('raise ImportError("libtriton.so: cannot open shared object file")',
                       "Triton failed to import: ImportError: libtriton.so: cannot open shared object file"),
    "broken otherwise": ('raise RuntimeError("driver mismatch")',
                         "Triton failed to import: RuntimeError: driver mismatch"),
}


def _environment(tmp_path: Path, raising: str | None = None) -> dict[str, str]:
    """This process's environment without a backend choice or interpretation; with ``raising``, a stand-in
    ``triton`` package (its ``__init__`` the statement ``raising``) first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "INDEXCACHE_BACKEND")}
    if raising is not None:
        (tmp_path / "shadow" / "triton").mkdir(parents=True)
        (tmp_path / "shadow" / "triton" / "__init__.py").write_text(raising + "\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "shadow"), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.fixture(params=list(TRITONS))
def no_triton(request, tmp_path):
    """``(environment, the reason expected)`` for a subprocess whose ``import triton`` fails as ``request.param``."""
    raising, reason = TRITONS[request.param]
    return _environment(tmp_path, raising), reason


def _cli(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "indexcache.tools.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_torch_backend_runs_and_info_says_why(no_triton):
    env, reason = no_triton
    code = (
        "import torch, indexcache\n"
        "from indexcache.hal import dispatch\n"
        "i32 = dict(dtype=torch.int32)\n"
        "out = indexcache.translate(torch.tensor([[0, 63, 64, -1]], **i32), torch.tensor([[10, 11]], **i32),\n"
        "                           torch.tensor([128], **i32), page_size=64)\n"
        "assert out.tolist() == [[640, 703, 704, -1]], out\n"
        "assert dispatch.get_backend() == 'torch' and dispatch.available_backends() == ['torch']\n"
        "from indexcache.bench.provenance import versions\n"
        "assert versions()['triton'] is None\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    info = _cli(env, "info")
    assert info.returncode == 0, info.stderr
    lines = info.stdout.splitlines()
    assert lines[0].startswith("selected backend: torch")
    # the cuda extra brings Triton from PyPI; ROCm's (pytorch-triton-rocm) comes with torch from PyTorch's ROCm index
    installs = {"cuda": "pip install 'indexcache[cuda]'",
                "rocm": "a ROCm/HIP build of torch brings it: pip install \"torch>=2.11\" --index-url "
                        "https://download.pytorch.org/whl/rocm6.4"}
    for name, install in installs.items():
        assert f"  {name:<8} not available: {reason} ({install})" in lines, info.stdout


def test_the_commands_that_need_triton_refuse_in_one_line(no_triton, tmp_path):
    env, reason = no_triton
    for args, what in ((["compile-check"], "the compile check"),
                       (["warmup", "--config", V32, "--arch", "sm90", "--list"], "warmup")):
        ran = _cli(env, *args)
        assert ran.returncode == 2, ran.stderr
        assert ran.stderr == f"indexcache {args[0]}: error: {what} needs Triton: {reason} (pip install triton)\n"
    ran = _cli(env, "conformance", "--backend", "cuda", "--op", "translate", "--out", str(tmp_path / "reports"))
    assert ran.returncode == 2
    assert ran.stderr == (f"indexcache conformance: error: backend 'cuda' cannot run here: {reason} "
                          "(pip install 'indexcache[cuda]')\n")
    assert not (tmp_path / "reports" / "conformance-cuda.json").exists()


def test_conformance_all_runs_the_torch_backend_and_says_why_the_others_are_left_out(tmp_path):
    """The README's quick-start command on a machine without Triton: the torch backend's cases, no crash."""
    raising, reason = TRITONS["absent"]
    ran = _cli(_environment(tmp_path, raising), "conformance", "--backend", "all", "--op", "translate",
               "--out", str(tmp_path / "reports"))
    assert ran.returncode == 0, ran.stderr
    for name in ("cuda", "rocm"):
        assert f"conformance: backend {name} left out: its Triton kernels cannot run here ({reason})" in ran.stderr
    assert "crashed" not in ran.stderr and "Traceback" not in ran.stderr
    assert [line.split()[:3] for line in ran.stdout.splitlines()[1:2]] == [["torch", "CPU", "translate"]]
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["conformance-torch.json",
                                                                        "conformance-torch.md"]


def test_conformance_all_refuses_a_bad_architecture_override_in_one_line(tmp_path):
    """Triton is here but the interpreted backend cannot run: the variable is named, before any backend runs."""
    pytest.importorskip("triton")
    env = {**_environment(tmp_path), "INDEXCACHE_CUDA_ARCH": "sm7x"}
    ran = _cli(env, "conformance", "--backend", "all", "--op", "translate", "--out", str(tmp_path / "reports"))
    assert ran.returncode == 2
    assert ran.stderr.startswith("indexcache conformance: error: backend 'cuda' cannot run here: "
                                 "INDEXCACHE_CUDA_ARCH: ")
    assert "running backend" not in ran.stderr
