"""AMD tuning table: per op, Triton block shapes and launch options (wave64: num_warps ≤ 16;
``waves_per_eu`` sets occupancy), by architecture."""

from __future__ import annotations

from typing import Any

from indexcache.backends.rocm.arch import resolve

_COMMON: dict[str, dict[str, Any]] = {
    "translate": {"BLOCK_K": 1024, "ELEMS": 4096, "num_warps": 4, "waves_per_eu": 2},
    # Logits: one token of 64 heads a program block, 128-key steps, 4 waves, 2 stages, keys on M (the NVIDIA
    # orientation). Heads on M (aiter's) spilled 10 SGPRs on gfx942 and 12 on gfx950 (Triton 3.9: the persistent
    # loop's per-token window scalars, at 1 or 2 stages, 2 to 8 warps, 64- or 128-key steps); keys on M needs
    # 64-73 SGPRs and still multiplies with MFMA fp8 (v_mfma_f32_32x32x16_fp8_fp8, gfx950: ..._f8f6f4).
    "mqa_logits": {"KEYS_ON_M": True, "COLS": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2,
                   "waves_per_eu": 2, "PROGRAMS_PER_SM": 2},
    # Decode keeps keys on M: heads on M spilled on gfx950 at next_n = 2 (Triton 3.9) and used more VGPRs on gfx942.
    # Tile i + 1 prefetched in registers while tile i is multiplied (PREFETCH), so no stream pipelining; a
    # persistent grid of two four-wave programs a CU (waves_per_eu 2: two waves on each of its four SIMDs).
    "paged_mqa_logits": {"KEYS_ON_M": True, "COLS": 128, "BLOCK_KEYS": 64, "PROGRAMS_PER_SM": 2,
                         "num_warps": 4, "PREFETCH": 1, "num_stages": 1, "waves_per_eu": 2},
    "quantize_index_k": {"ELEMS": 4096, "num_warps": 4, "waves_per_eu": 2},  # also store_index_k
    "gather_index_k": {"BLOCK_T": 32, "num_warps": 4, "waves_per_eu": 2},
    # HiSparse swap-in: as on NVIDIA (8 copies a step, 16-byte vectors, about 8 programs a CU; not measured).
    "hisparse_swap_in": {"BLOCK_C": 8, "CHUNK_BYTES": 2048, "PROGRAMS_PER_SM": 8, "num_warps": 4, "waves_per_eu": 2},
    # HiSparse plan: as on NVIDIA (cuda/tuning.py) with 16 waves of 64 over 4096-slot blocks (4 a lane: 104-128
    # VGPRs, 14-25 SGPRs spilled into VGPR lanes on gfx942 with Triton 3.9 and global loads, up to 53 with buffer
    # loads: hisparse/plan.py, SGPR_SPILLS; 8 waves spilled 44 SGPRs at H 16384 with row_to_batch), 6-bit digits (64
    # bins, a lane each). The eviction keys read back, not kept in registers
    # (KEEP_KEYS spilled 44 SGPRs on gfx950 at H 4096 with a slot index).
    "hisparse_plan": {"BLOCK_H": 4096, "DIGIT": 6, "BLOCK_R": 1024, "BI": 64, "BJ": 64, "KEEP_KEYS": False,
                      "num_warps": 16},
    # Top-k: the 64-lane histogram ballots live in SGPRs, so one value a lane (256-value tiles, 4 waves) is
    # what leaves the fused kernel without SGPR spills (Triton 3.9, gfx942); 2 resident programs a CU. sorted=True:
    # one wave per SORT_PER_WARP keys (8 int64 a lane; from the cross-compiled register counts, not measured). Split
    # rows finished by one program a row (FINISH_TIES 0): the finish with a program a chunk spilled 99-115 SGPRs on
    # gfx942 and gfx950 (Triton 3.9), inlined or not.
    "topk": {"TILE": 256, "BITS": 8, "DIGIT": 6, "num_warps": 4, "waves_per_eu": 2, "PROGRAMS_PER_SM": 2,
             "CHUNKS_PER_SM": 4, "GATHER_CHUNKS": 16, "FINISH_BINS": 2048, "FINISH_TIES": 0, "MIN_CHUNK": 16384,
             "SAMPLE": 4096, "SAMPLE_RANK": 16, "STASH": 4096, "STASH_PER_K": 4, "STASH_COLS_SHIFT": 5,
             "SORT_PER_WARP": 512},
}


def tuning(arch: str) -> dict[str, dict[str, Any]]:
    """The table for an AMD architecture ("gfx942", "gfx950", …), with its record's capabilities under "arch" (shown
    by ``indexcache info``, as the cuda table's)."""
    return {**{op: dict(cfg) for op, cfg in _COMMON.items()}, "arch": resolve(arch).capabilities(arch)}
