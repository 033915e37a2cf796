"""The packed index-K cache layout and the key formats it holds.

Per page: ``page_size × D`` fp8 bytes (token-major), then ``page_size`` float32 scales — 132 bytes a
token at D = 128, the layout SGLang and vLLM keep and DeepGEMM reads. A cache is a uint8 tensor,
either DeepGEMM's view ``[num_pages, page_size, 1, D + 4]`` or flat ``[num_pages, page_size * (D + 4)]``.
Slot ``s`` of a cache is token ``s % page_size`` of page ``s // page_size``. MXFP4 keys
(``torch.float4_e2m1fn_x2``, :mod:`indexcache.hal.fp4`): the same order, ``page_size × D / 2`` value bytes then
``page_size × D / 32`` e8m0 scale bytes, 68 bytes a token at D = 128 (docs/fp4.md).
"""

from __future__ import annotations

import torch

from indexcache.hal import fp4
from indexcache.hal.shown import dims, shown

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
SCALE_BYTES = 4


def scale_bytes(dim: int, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> int:
    """Scale bytes a token of ``dim`` elements has in a cache of ``fp8_dtype`` keys: a float32, or MXFP4's e8m0s."""
    return dim // fp4.BLOCK if fp8_dtype == fp4.FP4 else SCALE_BYTES


def token_bytes(dim: int, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> int:
    """Bytes a token of ``dim`` elements takes in a cache of ``fp8_dtype`` keys (an fp8 format or MXFP4)."""
    return (dim // 2 if fp8_dtype == fp4.FP4 else dim) + scale_bytes(dim, fp8_dtype)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 format (448 for e4m3fn, 240 for e4m3fnuz)."""
    return float(torch.finfo(dtype).max)


def new_packed_cache(num_pages: int, page_size: int, dim: int = 128, device="cpu",
                     fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """A zeroed flat cache, uint8 ``[num_pages, page_size * token_bytes(dim, fp8_dtype)]``."""
    return torch.zeros(num_pages, page_size * token_bytes(dim, fp8_dtype), dtype=torch.uint8, device=device)


def _token(width: int, dim: int, fp8_dtype: torch.dtype) -> str:
    """``"36 bytes a token of D = 32 fp8 keys"``: a token's bytes as the cache's shape errors give them (D from the
    call). Formatted only when refusing: while Dynamo traces with dynamic shapes ``dim`` may be symbolic, and
    formatting it would specialize it (or, an int argument of the compiled function, fail to trace)."""
    return f"{shown(width)} bytes a token of D = {shown(dim)} {'MXFP4' if fp8_dtype == fp4.FP4 else 'fp8'} keys"


def cache_page_size(k_cache: torch.Tensor, dim: int, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> int:
    """Tokens a page of ``k_cache`` holds, from its shape; raises ValueError if the shape does not fit."""
    width = token_bytes(dim, fp8_dtype)
    if k_cache.dim() == 4:
        if k_cache.shape[2] != 1 or k_cache.shape[3] != width:
            raise ValueError(f"k_cache: expected shape [num_pages, page_size, 1, {shown(width)}] "
                             f"({_token(width, dim, fp8_dtype)}), got {dims(k_cache.shape)}")
        if k_cache.shape[1] == 0:
            raise ValueError(f"k_cache: expected pages of at least one token, got shape {dims(k_cache.shape)}")
        return k_cache.shape[1]
    if k_cache.dim() == 2:
        page_bytes = k_cache.shape[1]
        if page_bytes == 0 or page_bytes % width:
            raise ValueError(f"k_cache: expected flat pages of page_size * {shown(width)} bytes "
                             f"({_token(width, dim, fp8_dtype)}), got {shown(page_bytes)} bytes a page")
        return page_bytes // width
    raise ValueError(f"k_cache: expected a 2-D or 4-D uint8 tensor, got {k_cache.dim()}-D")


def split_packed_cache(k_cache: torch.Tensor, dim: int, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(keys [num_pages, page_size, dim] fp8, scales [num_pages, page_size] float32)`` of a cache; MXFP4:
    ``(values [num_pages, page_size, dim / 2] float4_e2m1fn_x2, scales [num_pages, page_size, dim / 32]
    float8_e8m0fnu)``.

    Both share the cache's memory, so writing into them writes the cache.
    """
    page_size = cache_page_size(k_cache, dim, fp8_dtype)
    pages = k_cache.reshape(k_cache.shape[0], page_size * token_bytes(dim, fp8_dtype))  # also for 0 pages
    if fp8_dtype == fp4.FP4:
        split = page_size * dim // 2
        values = pages[:, :split].view(fp4.FP4).view(-1, page_size, dim // 2)
        return values, pages[:, split:].view(fp4.E8M0).view(-1, page_size, dim // fp4.BLOCK)
    keys = pages[:, : page_size * dim].view(fp8_dtype).view(-1, page_size, dim)
    scales = pages[:, page_size * dim :].view(torch.float32)
    return keys, scales
