"""Triton kernels shared by the GPU backends (cuda, rocm).

Each kernel module exposes ``ops(target, tuning) -> {op name: OpImpl}``; :func:`make_ops` merges
them for a backend. Importing this package imports Triton, so backends import it only after their
probe found Triton.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from indexcache.backends.triton.target import Target
from indexcache.dispatch import OpImpl

KERNEL_MODULES = ("translate", "logits", "quantize", "topk")


def make_ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """Every op the Triton kernels implement, built for ``target`` with the backend's tuning table."""
    found: dict[str, OpImpl] = {}
    for name in KERNEL_MODULES:
        found.update(importlib.import_module(f"{__name__}.{name}").ops(target, tuning))
    return found
