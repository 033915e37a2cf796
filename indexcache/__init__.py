"""indexcache: cross-layer reuse of sparse-attention top-k indices (IndexCache) on any backend.

Importing touches no device and imports no torch: the public names below load their module at first use
(PEP 562), so ``import indexcache.plan`` stays pure Python. The backend is chosen at the first op call (see
:mod:`indexcache.hal.dispatch`).
"""

from __future__ import annotations

import importlib
from typing import Any

from indexcache import _moved

__version__ = "0.1.0"

_moved.install()  # the modules that moved into a layer keep their old names (indexcache.state, ...)

# Public name -> the module that defines it.
_PUBLIC = {
    "available_backends": "indexcache.hal.dispatch",
    "get_backend": "indexcache.hal.dispatch",
    "use_backend": "indexcache.hal.dispatch",
    "mqa_logits": "indexcache.hal.ops",
    "paged_mqa_logits": "indexcache.hal.ops",
    "paged_topk_translate": "indexcache.hal.ops",
    "quantize_index_k": "indexcache.hal.ops",
    "store_index_k": "indexcache.hal.ops",
    "topk": "indexcache.hal.ops",
    "topk_translate": "indexcache.hal.ops",
    "translate": "indexcache.hal.ops",
    "workspace_bytes": "indexcache.hal.ops",
}
# Submodules that ``import indexcache`` used to load, still reachable as attributes after it.
_SUBMODULES = ("dispatch", "layout", "ops")

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBMODULES})
