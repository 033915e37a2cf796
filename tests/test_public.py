"""The package root is the one public face (docs/architecture.md, "Public names"): exactly the documented names,
each loaded from its layer, no torch on ``import indexcache``, no second name for any module."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import indexcache
from indexcache.hal import ops
from indexcache.hal.specs import SPECS

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(path for folder in ("indexcache", "backends", "bench", "tests", "ci")
                 for path in (ROOT / folder).rglob("*.py"))
# The names the modules that moved into a layer had before (the layered paths are the only ones now).
OLD_NAMES = ("state", "runner", "streams", "distributed", "dispatch", "ops", "layout", "reference", "descriptor",
             "calibrate", "model", "cli")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _documented() -> tuple[list[str], list[str]]:
    """The bullets of docs/architecture.md's "Public names": (the one naming the ops, every other name listed)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Public names\n", 1)[1].split("\n## ", 1)[0]
    bullets = re.findall(r"^- (.*(?:\n  .*)*)", section, re.MULTILINE)
    op_bullets = [b for b in bullets if "`indexcache.<op>`" in b]
    names = [name for b in bullets if b not in op_bullets for name in re.findall(r"`(\w+)`", b)]
    return op_bullets, names


def test_the_root_offers_exactly_the_documented_names():
    op_bullets, names = _documented()
    assert len(op_bullets) == 1 and len(names) == len(set(names)) > 0, (op_bullets, names)
    assert indexcache.__all__ == sorted([*SPECS, *names])


def test_each_public_name_resolves_to_its_layer():
    for name in indexcache.__all__:
        value = getattr(indexcache, name)
        assert name in dir(indexcache) and value.__name__ == name, name
        assert value.__module__.split(".")[1] in ("hal", "plan", "runtime"), (name, value.__module__)
    for op in SPECS:
        assert getattr(indexcache, op) is getattr(ops, op)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        indexcache.no_such_name  # noqa: B018
    result = _python("from indexcache import *; print(' '.join(sorted(n for n in dir() if not n.startswith('_'))))")
    assert result.returncode == 0 and result.stdout.split() == indexcache.__all__, result.stderr


def test_import_indexcache_imports_no_torch():
    result = _python(
        "import sys\n"
        "import indexcache\n"
        "from indexcache import plan\n"
        "names = indexcache.__all__, dir(indexcache), indexcache.LayerPlan\n"
                "loaded = sorted(name for name in sys.modules if name == 'torch' or name.startswith('torch.'))\n"
        "assert not loaded, loaded\n"
        "indexcache.topk\n"
        "assert 'torch' in sys.modules\n"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("old", OLD_NAMES)
def test_old_module_names_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"indexcache.{old}")
    assert not hasattr(indexcache, old)


def test_nothing_touches_sys_meta_path():
    touching = [str(path.relative_to(ROOT)) for path in SOURCES
                if any(isinstance(node, ast.Attribute) and node.attr == "meta_path"
                       for node in ast.walk(ast.parse(path.read_text())))]
    assert not touching
