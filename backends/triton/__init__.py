"""Triton kernels shared by the GPU backends (cuda, rocm).

Each kernel module exposes ``ops(target, tuning) -> {op name: OpImpl}``; :func:`make_ops` merges
them for a backend. The kernel modules import Triton, so backends call :func:`make_ops` only after
their probe found it; importing this package does not.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from indexcache.backends.triton.target import Target
from indexcache.hal.contract import OpImpl

KERNEL_MODULES = ("translate", "logits", "quantize", "topk", "producer", "prefill_producer", "gather", "hisparse")


def make_ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """Every op the Triton kernels implement, built for ``target`` with the backend's tuning table."""
    found: dict[str, OpImpl] = {}
    for name in KERNEL_MODULES:
        found.update(importlib.import_module(f"{__name__}.{name}").ops(target, tuning))
    return found
