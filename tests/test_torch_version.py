"""The torch minimum (indexcache.hal.torch_version): pyproject.toml's, checked where indexcache first needs torch (the
package root's lazy names, the commands but ``plan``), once a process, with an ImportError naming both versions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import indexcache
from indexcache.hal.torch_version import TORCH_MINIMUM, check_version, require_torch
from indexcache.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
V32 = str(ROOT / "examples" / "configs" / "deepseek-v3.2.json")


@pytest.fixture
def torch_version(monkeypatch):
    """Set ``torch.__version__`` for the test, with the once-a-process check forgotten before and after."""
    require_torch.cache_clear()
    yield lambda version: monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.undo()
    require_torch.cache_clear()


NEW_ENOUGH = [torch.__version__, "2.11.0", "2.13.0+cpu", "2.11.0a0+git1234abc", "2.11.0.dev20260101+cu128",
              "2.11.0rc1", "2.12.0.dev20260101+cu128", "2.11", "3.0.0"]
TOO_OLD = ["2.10.0", "2.10.1+cu128", "2.9.0a0+gitabcdef", "1.13.1"]


def _pinned() -> str:
    (pinned,) = re.findall(r'"torch>=([^"]+)"', (ROOT / "pyproject.toml").read_text())
    return pinned


def test_the_minimum_is_pyprojects():
    assert _pinned() == ".".join(map(str, TORCH_MINIMUM)) + ".0.dev0"


@pytest.mark.parametrize("version", NEW_ENOUGH + TOO_OLD)
def test_pip_keeps_the_torch_the_check_accepts(version):
    """pip keeps an installed torch that pyproject's requirement admits and replaces the others: a torch the import
    check accepts, such as a container's "2.11.0a0+git...", must satisfy it (``torch>=2.11`` did not)."""
    specifiers = pytest.importorskip("packaging.specifiers", reason="PEP 440 comparison")
    admitted = specifiers.SpecifierSet(f">={_pinned()}").contains(version, prereleases=True)
    assert admitted == (version in NEW_ENOUGH), f"torch>={_pinned()} against torch {version}: {admitted}"


@pytest.mark.parametrize("version", NEW_ENOUGH)
def test_a_new_enough_torch_passes(version):
    check_version(version)


@pytest.mark.parametrize("version", [*TOO_OLD, "unknown"])
def test_an_older_torch_is_an_import_error_naming_both_versions(version):
    with pytest.raises(ImportError) as raised:
        check_version(version)
    message = str(raised.value)
    assert f"torch {version} is installed" in message and "needs torch >= 2.11" in message
    assert "pip install --upgrade 'torch>=2.11'" in message


def test_the_first_torch_name_of_the_package_root_checks_once(torch_version, monkeypatch):
    monkeypatch.delitem(indexcache.__dict__, "topk", raising=False)  # as before its first use
    torch_version("2.10.0")
    with pytest.raises(ImportError, match=r"needs torch >= 2\.11, but torch 2\.10\.0 is installed"):
        indexcache.topk  # noqa: B018
    assert indexcache.LayerPlan.__name__ == "LayerPlan"  # the plan is pure Python: no check
    torch_version("2.13.0+cpu")
    assert indexcache.topk.__name__ == "topk"
    torch_version("2.10.0")  # checked once a process: a passed check is not repeated
    require_torch()


def test_every_command_but_plan_refuses_an_older_torch(torch_version, capsys):
    torch_version("2.10.0")
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("indexcache info: error: indexcache needs torch >= 2.11, but torch 2.10.0 is installed")
    assert main(["plan", "--config", V32, "--json"]) == 0
