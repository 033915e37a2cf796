"""The modules that moved into a layer (docs/architecture.md), importable under their old names.

``import indexcache.state`` gives the very module object ``indexcache.runtime.state`` (no copy, no
wrapper), so attributes, monkeypatching and ``isinstance`` behave as before. Installed by
``indexcache/__init__.py``; the new paths are the documented ones.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

MOVED = {
    "indexcache.dispatch": "indexcache.hal.dispatch",
    "indexcache.layout": "indexcache.hal.layout",
    "indexcache.ops": "indexcache.hal.ops",
    "indexcache.reference": "indexcache.hal.reference",
    "indexcache.descriptor": "indexcache.plan.descriptor",
    "indexcache.state": "indexcache.runtime.state",
    "indexcache.runner": "indexcache.runtime.runner",
    "indexcache.streams": "indexcache.runtime.streams",
    "indexcache.distributed": "indexcache.runtime.distributed",
    "indexcache.calibrate": "indexcache.tools.calibrate",
    "indexcache.model": "indexcache.tools.model",
    "indexcache.cli": "indexcache.tools.cli",
}


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs[module.__name__]  # the import system set the old name's spec on it

    def get_code(self, fullname: str):
        """The new module's code, so ``python -m indexcache.cli`` still runs the command."""
        spec = importlib.util.find_spec(MOVED[fullname])
        return spec.loader.get_code(spec.name)

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}


def install() -> None:
    """Register the finder once (idempotent)."""
    if not any(isinstance(f, _OldNames) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldNames())
