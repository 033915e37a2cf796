"""HiSparse in Triton (docs/hisparse.md): the swap-in of a plan's copies (:mod:`.swap`). What other modules use: the
ops and compile specs (``KERNEL_MODULES``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from indexcache.backends.triton.hisparse import swap
from indexcache.backends.triton.target import Target
from indexcache.hal.contract import OpImpl

__all__ = ["compile_specs", "ops"]


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """The HiSparse ops of a GPU backend built for ``target`` with its tuning table."""
    return swap.ops(target, tuning)


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """Every HiSparse kernel variant the cross-compile check builds for ``target``."""
    return swap.compile_specs(target, tuning)
