"""NVIDIA tuning table: per op, the Triton block shapes and launch options, by architecture."""

from __future__ import annotations

from typing import Any

# translate is memory-bound: 2K indices a program, 1K contiguous along k, 4 warps (16-byte accesses).
_COMMON: dict[str, dict[str, Any]] = {
    "translate": {"BLOCK_K": 1024, "ELEMS": 2048, "num_warps": 4},
}


def tuning(arch: str) -> dict[str, dict[str, Any]]:
    """The table for an NVIDIA architecture ("sm80", "sm90", …)."""
    return {op: dict(cfg) for op, cfg in _COMMON.items()}
