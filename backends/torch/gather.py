"""``gather_index_k`` on any torch device (contract: ``indexcache.gather_index_k``): each output row's request and
token found on the device (a search over the lengths' running sums), so a call with its outputs given never syncs."""

from __future__ import annotations

import torch

from indexcache.hal import fp4
from indexcache.hal.layout import scale_bytes, split_packed_cache


def gather_index_k(k_cache, block_table, context_lens, dim, fp8_dtype, out_k, out_scale):
    """Write ``out_k`` / ``out_scale`` (``[N, ...]``) from the paged cache; returns them."""
    rows, requests = out_k.shape[0], context_lens.shape[0]
    if rows == 0 or requests == 0:
        return out_k, out_scale
    keys, scales = split_packed_cache(k_cache, dim, fp8_dtype)
    num_pages, page_size = keys.shape[:2]
    keys = keys.view(torch.uint8)
    scales = scales.view(torch.uint8).reshape(num_pages, page_size, scale_bytes(dim, fp8_dtype))
    device = out_k.device
    lengths = context_lens.clamp_min(0).long()
    ends = lengths.cumsum(0)
    row = torch.arange(rows, device=device)
    request = torch.searchsorted(ends, row, right=True)  # the request a row belongs to (requests: past the total)
    written = request < requests
    request = request.clamp_max(requests - 1)
    token = row - (ends[request] - lengths[request])
    column = torch.div(token, page_size, rounding_mode="floor")
    columns = block_table.shape[1]
    page = block_table[request, column.clamp(0, max(columns - 1, 0))].long() if columns else -torch.ones_like(row)
    hole = (column >= columns) | (page < 0) | (page >= num_pages)
    page, slot = page.clamp(0, max(num_pages - 1, 0)), token % page_size
    if num_pages:
        values, scale = keys[page, slot], scales[page, slot]
    else:
        values = torch.zeros(rows, keys.shape[2], dtype=torch.uint8, device=device)
        scale = torch.zeros(rows, scales.shape[2], dtype=torch.uint8, device=device)
    # A hole's scale bytes, made on the device (no copy from the host: capturable in a CUDA graph).
    nan = torch.full_like(scale, fp4.E8M0_NAN) if fp8_dtype == fp4.FP4 else \
        torch.full((1,), float("nan"), device=device).view(torch.uint8).expand_as(scale)
    values = torch.where(hole[:, None], 0, values)
    scale = torch.where(hole[:, None], nan, scale)
    k_bytes = out_k.view(torch.uint8).view(rows, -1)
    k_bytes.copy_(torch.where(written[:, None], values, k_bytes))
    if out_scale.dtype.itemsize == 1:  # MXFP4's e8m0 bytes
        s_bytes = out_scale.view(torch.uint8).view(rows, -1)
        s_bytes.copy_(torch.where(written[:, None], scale, s_bytes))
    else:  # float32 scales: a strided out_scale has no byte view, so the bytes are read back as float32
        out_scale.copy_(torch.where(written, scale.view(torch.float32).view(rows), out_scale))
    return out_k, out_scale
