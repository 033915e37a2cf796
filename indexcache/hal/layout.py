"""The packed index-K cache layout and the fp8 formats it holds.

Per page: ``page_size × D`` fp8 bytes (token-major), then ``page_size`` float32 scales — 132 bytes a
token at D = 128, the layout SGLang and vLLM keep and DeepGEMM reads. A cache is a uint8 tensor,
either DeepGEMM's view ``[num_pages, page_size, 1, D + 4]`` or flat ``[num_pages, page_size * (D + 4)]``.
Slot ``s`` of a cache is token ``s % page_size`` of page ``s // page_size``.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
SCALE_BYTES = 4


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 format (448 for e4m3fn, 240 for e4m3fnuz)."""
    return float(torch.finfo(dtype).max)


def new_packed_cache(num_pages: int, page_size: int, dim: int = 128, device="cpu") -> torch.Tensor:
    """A zeroed flat cache, uint8 ``[num_pages, page_size * (dim + 4)]``."""
    return torch.zeros(num_pages, page_size * (dim + SCALE_BYTES), dtype=torch.uint8, device=device)


def cache_page_size(k_cache: torch.Tensor, dim: int) -> int:
    """Tokens a page of ``k_cache`` holds, from its shape; raises ValueError if the shape does not fit."""
    if k_cache.dim() == 4:
        if k_cache.shape[2] != 1 or k_cache.shape[3] != dim + SCALE_BYTES:
            raise ValueError(
                f"k_cache: expected shape [num_pages, page_size, 1, {dim + SCALE_BYTES}], got {list(k_cache.shape)}"
            )
        if k_cache.shape[1] == 0:
            raise ValueError(f"k_cache: expected pages of at least one token, got shape {list(k_cache.shape)}")
        return int(k_cache.shape[1])
    if k_cache.dim() == 2:
        page_bytes = int(k_cache.shape[1])
        if page_bytes == 0 or page_bytes % (dim + SCALE_BYTES):
            raise ValueError(
                f"k_cache: expected flat pages of page_size * {dim + SCALE_BYTES} bytes, got {page_bytes} bytes a page"
            )
        return page_bytes // (dim + SCALE_BYTES)
    raise ValueError(f"k_cache: expected a 2-D or 4-D uint8 tensor, got {k_cache.dim()}-D")


def split_packed_cache(k_cache: torch.Tensor, dim: int, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(keys [num_pages, page_size, dim] fp8, scales [num_pages, page_size] float32)`` of a cache.

    Both share the cache's memory, so writing into them writes the cache.
    """
    page_size = cache_page_size(k_cache, dim)
    pages = k_cache.reshape(k_cache.shape[0], page_size * (dim + SCALE_BYTES))  # also for a cache of 0 pages
    keys = pages[:, : page_size * dim].view(fp8_dtype).view(-1, page_size, dim)
    scales = pages[:, page_size * dim :].view(torch.float32)
    return keys, scales
