"""AMD tuning table: per op, Triton block shapes and launch options (wave64: num_warps ≤ 16;
``waves_per_eu`` sets occupancy), by architecture."""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, dict[str, Any]] = {
    "translate": {"BLOCK_K": 1024, "ELEMS": 4096, "num_warps": 4, "waves_per_eu": 2},
}


def tuning(arch: str) -> dict[str, dict[str, Any]]:
    """The table for an AMD architecture ("gfx942", "gfx950", …)."""
    return {op: dict(cfg) for op, cfg in _COMMON.items()}
