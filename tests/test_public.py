"""The package root is the one public face (docs/architecture.md, "Public names"): exactly the documented names,
each loaded from its layer, no torch on ``import indexcache``, no second name for any module. The ops' names are
kept in one place, the spec records' ``OP_NAMES`` (docs/architecture.md, "Adding an op")."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import indexcache
from indexcache.hal import contract, ops, reference
from indexcache.hal.specs import OP_NAMES, SPECS

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(path for folder in ("indexcache", "backends", "bench", "tests", "ci")
                 for path in (ROOT / folder).rglob("*.py"))
SPECS_INIT = ROOT / "indexcache" / "hal" / "specs" / "__init__.py"
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
    assert indexcache.__all__ == sorted([*OP_NAMES, *names])


def test_each_public_name_resolves_to_its_layer():
    for name in indexcache.__all__:
        value = getattr(indexcache, name)
        assert name in dir(indexcache) and value.__name__ == name, name
        assert value.__module__.split(".")[1] in ("hal", "plan", "runtime", "tools"), (name, value.__module__)
    for op in OP_NAMES:
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
        "from indexcache.hal.specs import OP_NAMES\n"
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


def test_every_list_of_op_names_is_derived_from_the_spec_records():
    assert list(SPECS) == list(OP_NAMES)
    assert contract.OPS == (*OP_NAMES, "overlap")
    assert ops.__all__[-len(OP_NAMES):] == list(OP_NAMES) and all(callable(getattr(ops, op)) for op in OP_NAMES)
    assert reference.__all__ == list(OP_NAMES)
    assert all(getattr(reference, op) is SPECS[op].reference for op in OP_NAMES)


def test_no_hand_kept_list_of_op_names():
    """A literal list, tuple or set holding three or more op names (or such a run of names in a script or tox.ini)
    is a hand-kept copy of OP_NAMES: derive it from the spec records instead."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        itself = {id(node.value) for node in ast.walk(tree) if path == SPECS_INIT and isinstance(node, ast.Assign)
                  and [getattr(t, "id", None) for t in node.targets] == ["OP_NAMES"]}
        found += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and id(node) not in itself
                  and sum(isinstance(e, ast.Constant) and e.value in OP_NAMES for e in node.elts) >= 3]
    assert not found
    name = "|".join(OP_NAMES)
    run = re.compile(rf"\b(?:{name})\b(?:[\s,|/]+(?:{name})\b){{2,}}")
    scripts = [ROOT / "tox.ini", ROOT / "pyproject.toml", *(ROOT / "ci").glob("*.sh")]
    assert not [str(p.relative_to(ROOT)) for p in scripts if run.search(p.read_text())]


def test_backends_implement_only_ops_of_the_contract(interpreted):
    from indexcache.hal import dispatch

    served = {name: set(dispatch.ops_of(name)) for name in dispatch.available_backends()}
    assert {"torch", "cuda", "rocm"} <= set(served)
    assert all(names <= set(contract.OPS) for names in served.values()), served


def test_every_package_directory_is_installed():
    """pyproject.toml lists its packages by name: a subpackage missing from the list is absent from a wheel (a user's
    ``pip install``) while an editable install and the tests run from the checkout still find it."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    where = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    where.setdefault("indexcache", ROOT / "indexcache")
    found = set()
    for package, folder in where.items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(folder).parts]))
    assert found == set(setuptools["packages"])
