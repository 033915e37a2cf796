"""NVIDIA tuning table: per op, the Triton block shapes and launch options, by architecture."""

from __future__ import annotations

from typing import Any

# translate is memory-bound: 2K indices a program, 1K contiguous along k, 4 warps (16-byte accesses).
_COMMON: dict[str, dict[str, Any]] = {
    "translate": {"BLOCK_K": 1024, "ELEMS": 2048, "num_warps": 4},
    # Logits (KERNELS.md recipe): keys on M, COLS = tokens × heads on N (2 tokens at H = 64), warps along keys.
    # One warpgroup a program, three resident a SM (≤ 168 registers, 40 KB shared) so epilogues overlap MMAs.
    "mqa_logits": {"KEYS_ON_M": True, "COLS": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                   "PROGRAMS_PER_SM": 3},
    # Paged decode is memory-bound: 64-key tiles (one page: a scalar table entry, contiguous rows and scales)
    # in a register software pipeline (PREFETCH: tile i + 1 in flight while tile i is multiplied; Triton's
    # own pipeliner off, num_stages 1), at most SPLIT keys and COLS dot columns (draft tokens × heads) a
    # program, at least WAVES programs a SM when the batch allows.
    "paged_mqa_logits": {"KEYS_ON_M": True, "COLS": 128, "BLOCK_KEYS": 64, "SPLIT": 2048, "WAVES": 4,
                         "PREFETCH": 1, "num_warps": 4, "num_stages": 1},
    "quantize_index_k": {"ELEMS": 4096, "num_warps": 4},  # also store_index_k: 4K values a program
    # Top-k (radix select): 2K-value tiles over 16 warps (4 values a thread: 8 spilled on sm90 at 8 warps or
    # 4K tiles), 256 coarse bins (quarter octaves); one resident program a SM for the persistent one-row-a-
    # program kernel (≤ 118 registers); rows split into ≥ 16K-column chunks, about 4 a SM, when rows are few;
    # a tie stash of max(4096, 4k) entries a row.
    "topk": {"TILE": 2048, "BITS": 8, "num_warps": 16, "PROGRAMS_PER_SM": 1, "CHUNKS_PER_SM": 4,
             "MIN_CHUNK": 16384, "PLAN_CHUNKS": 16, "STASH": 4096, "STASH_PER_K": 4},
}


def tuning(arch: str) -> dict[str, dict[str, Any]]:
    """The table for an NVIDIA architecture ("sm80", "sm90", …)."""
    return {op: dict(cfg) for op, cfg in _COMMON.items()}
