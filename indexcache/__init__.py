"""indexcache: cross-layer reuse of sparse-attention top-k indices (IndexCache) on any backend.

The package root is the public face for engines (docs/architecture.md, "Public names"): the ops, backend
choice, the layer plan and the runtime, each loaded from its layer at first use (PEP 562), so ``import
indexcache`` touches no device and imports no torch, and ``import indexcache.plan`` stays pure Python. The
backend is chosen at the first op call (see :mod:`indexcache.hal.dispatch`). The first name that needs torch checks
its version (:mod:`indexcache.hal.torch_version`): an older torch than pyproject.toml's is an ImportError naming both.
"""

from __future__ import annotations

import importlib
from typing import Any

from indexcache.hal.specs import OP_NAMES
from indexcache.hal.torch_version import require_torch as _require_torch

__version__ = "0.1.0"

# Public name -> the module that defines it: every op of the spec records, then the rest.
_PUBLIC = {
    **dict.fromkeys(OP_NAMES, "indexcache.hal.ops"),
    "BackendNotSupportedError": "indexcache.hal.dispatch",
    "available_backends": "indexcache.hal.dispatch",
    "get_backend": "indexcache.hal.dispatch",
    "use_backend": "indexcache.hal.dispatch",
    "sm_budget": "indexcache.hal.budget",
    "LayerPlan": "indexcache.plan",
    "TopkState": "indexcache.runtime.state",
    "PagedLogits": "indexcache.runtime.state",
    "PrefillLogits": "indexcache.runtime.state",
    "IndexRecorder": "indexcache.runtime.state",
    "IndexerRunner": "indexcache.runtime.runner",
    "DraftTopk": "indexcache.runtime.draft",
    "HotBuffers": "indexcache.runtime.hot",
    "HotLayer": "indexcache.runtime.hot",
    "overlap": "indexcache.runtime.streams",
    "overlap_schedule": "indexcache.runtime.streams",
    "cp_topk": "indexcache.runtime.distributed",
    "cp_topk_translate": "indexcache.runtime.distributed",
    "zigzag_key_index": "indexcache.runtime.distributed",
    "workspace_bytes": "indexcache.hal.ops",
    "warmup": "indexcache.tools.warmup",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _PUBLIC[name] != "indexcache.plan":  # the plan is pure Python; every other layer needs torch
        _require_torch()
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
