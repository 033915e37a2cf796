"""The modules that moved into a layer keep their old import names, as the very same module objects."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from indexcache._moved import MOVED


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_old_name_is_the_new_module(old, new):
    module = importlib.import_module(old)
    assert module is importlib.import_module(new) and sys.modules[old] is module
    assert module.__name__ == new and module.__spec__.name == new
    package, _, child = old.rpartition(".")
    assert getattr(importlib.import_module(package), child) is module


def test_from_old_names():
    from indexcache.runtime.state import TopkState
    from indexcache.state import TopkState as OldTopkState

    assert OldTopkState is TopkState


def test_python_m_old_cli_name_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "indexcache.cli", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "usage: indexcache" in done.stdout, done.stderr
