"""Block fp8 quantization with power-of-two scales, and the packed-cache store, in plain torch."""

from __future__ import annotations

import torch

from indexcache.hal.layout import fp8_max, split_packed_cache


def _pow2_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax <= limit * s`` (exact: products of powers of two)."""
    e = torch.ceil(torch.log2(amax / limit))
    e = e + (amax > limit * torch.exp2(e)).float()
    e = e - (amax <= limit * torch.exp2(e - 1)).float()
    return torch.exp2(e)


def quantize_index_k(k, fp8_dtype, block):
    """``(k_fp8 [N, D], scale [N, D // block] float32)`` (contract: ``indexcache.quantize_index_k``)."""
    n, d = k.shape
    blocks = k.float().reshape(n, d // block, block)
    finite = torch.isfinite(blocks).all(-1)
    scale = _pow2_scale(blocks.abs().amax(-1).clamp_min(1e-4), fp8_max(fp8_dtype)).masked_fill(~finite, float("nan"))
    q = (blocks / scale[..., None]).masked_fill(~finite[..., None], 0.0)
    return q.reshape(n, d).to(fp8_dtype), scale


def store_index_k(k, k_cache, slot_mapping, fp8_dtype):
    """Quantize ``k`` into the packed cache at ``slot_mapping`` (contract: ``indexcache.store_index_k``).

    Picking the valid slots syncs with the host: the torch backend's store is not for captured graphs.
    """
    q, scale = quantize_index_k(k, fp8_dtype, k.shape[1])
    keys, scales = split_packed_cache(k_cache, k.shape[1], fp8_dtype)
    num_pages, page_size = scales.shape
    slot = slot_mapping.long()
    rows = torch.nonzero((slot >= 0) & (slot < num_pages * page_size)).flatten()
    page, offset = slot[rows] // page_size, slot[rows] % page_size
    keys[page, offset] = q[rows]
    scales[page, offset] = scale[rows, 0]
