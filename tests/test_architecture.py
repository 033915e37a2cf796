"""The layers of docs/architecture.md: each import points down the layer list (or inside its own layer),
backends know only the contract, device facts and the cache layout, and no import cycle exists.

Imports are read from the source (ast), module level and inside functions alike, so a deferred import
breaks the rules as much as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What each layer may import from indexcache, besides itself. Longest prefix wins.
ALLOWED = {
    "indexcache.backends": ("indexcache.hal.contract", "indexcache.hal.device", "indexcache.hal.layout",
                            "indexcache.hal.fp4", "indexcache.hal.budget", "indexcache.hal.slot_index"),
    "indexcache.hal": (),
    "indexcache.plan": (),
    "indexcache.runtime": ("indexcache.hal", "indexcache.plan"),
    "indexcache.conformance": ("indexcache.hal", "indexcache.backends"),
    "indexcache.bench": ("indexcache.hal", "indexcache.plan", "indexcache.runtime", "indexcache.backends"),
    "indexcache.tools": ("indexcache",),
}


def _modules() -> dict[str, Path]:
    found = {}
    for base, package in ((ROOT / "indexcache", "indexcache"), (ROOT / "backends", "indexcache.backends")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module an imported name lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module
            names = [f"{base}.{a.name}" if _resolve(f"{base}.{a.name}") != _resolve(base) else base for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("indexcache") and (target := _resolve(name)) and target != module:
                out.add(target)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> str | None:
    return max((p for p in ALLOWED if module == p or module.startswith(p + ".")), key=len, default=None)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m)))
def test_imports_follow_the_layers(module):
    layer = _layer(module)
    allowed = (layer, *ALLOWED[layer])
    # The package root is the public face (the ops, the plan and the runtime, loaded lazily), so importing it is
    # importing all of them: only the layers above the runtime may.
    root_ok = layer in ("indexcache.bench", "indexcache.tools")
    bad = sorted(t for t in GRAPH[module] if not (t == "indexcache" and root_ok)
                 and not any(t == a or t.startswith(a + ".") for a in allowed))
    assert not bad, f"{module} ({layer}) imports {bad}; it may import {allowed}"


def test_no_import_cycles():
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t in GRAPH and not state.get(t):
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if not state.get(m):
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
