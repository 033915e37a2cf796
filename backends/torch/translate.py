"""Page translation in plain torch: elementwise, no host sync, any device."""

from __future__ import annotations

import torch


def translate(raw, page_table, seq_lens, page_size, row_to_batch, out):
    """Fill ``out [R, K]`` int32 with the physical slots of ``raw`` (contract: ``indexcache.translate``)."""
    rows = raw.shape[0]
    batches, pages = page_table.shape
    if out.numel() == 0:
        return out
    if batches == 0 or pages == 0:
        return out.fill_(-1)
    b = torch.arange(rows, device=raw.device) if row_to_batch is None else row_to_batch.long()
    x = raw.long()
    page = torch.div(x, page_size, rounding_mode="floor")
    ok = (x >= 0) & (x < seq_lens.long()[:, None]) & (page < pages) & ((b >= 0) & (b < batches))[:, None]
    entry = page_table[b.clamp(0, batches - 1)[:, None], page.clamp(0, pages - 1)].long()
    ok &= entry >= 0
    out.copy_(torch.where(ok, entry * page_size + x.remainder(page_size), -1))
    return out
