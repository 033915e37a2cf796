"""Top-k selection in plain torch: torch.topk for the threshold, exact tie rule, bounded memory."""

from __future__ import annotations

import torch

from indexcache.backends.torch.memory import rows_per_chunk
from indexcache.backends.torch.translate import translate

# Temporaries a column costs per row: fp32 scores, three masks, int64 positions and ranks.
_BYTES_PER_COLUMN = 4 + 3 + 8 + 8 + 8


def _select(scores, lengths, k, row_starts, out, sort):
    rows, cols = scores.shape
    dev = scores.device
    col = torch.arange(cols, device=dev)
    kk = min(k, cols)
    step = rows_per_chunk(_BYTES_PER_COLUMN * max(cols, 1) + 16 * k, rows)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        o = out[r0:r1]
        start = (torch.zeros(r1 - r0, dtype=torch.long, device=dev) if row_starts is None
                 else row_starts[r0:r1].long().clamp(0, cols))
        length = torch.minimum(lengths[r0:r1].long().clamp_min(0), cols - start)
        short = torch.arange(k, device=dev)[None, :]
        short = torch.where(short < length[:, None], short, -1)
        if kk == 0 or cols == 0:
            o.copy_(short)
            continue
        rel = col[None, :] - start[:, None]
        s = scores[r0:r1].float()
        keep = (rel >= 0) & (rel < length[:, None]) & ~torch.isnan(s) & (s != float("-inf"))
        s = torch.where(keep, s, float("-inf"))
        kth = torch.topk(s, kk, dim=1, sorted=True).values[:, -1:]
        above = keep & (s > kth)
        tied = keep & (s == kth)
        need = kk - above.sum(1, keepdim=True)
        chosen = above | (tied & (tied.cumsum(1) <= need))
        # Scatter chosen positions, in column order, to their rank; the rest land in a dump column.
        rank = torch.where(chosen, chosen.cumsum(1) - 1, k)
        long = torch.full((r1 - r0, k + 1), -1, dtype=torch.long, device=dev)
        long.scatter_(1, rank, torch.where(chosen, rel, -1))
        long = long[:, :k]
        if sort:
            key = torch.where(long >= 0, s.gather(1, (long + start[:, None]).clamp(0, cols - 1)), float("-inf"))
            order = torch.sort(key, dim=1, descending=True, stable=True).indices
            long = long.gather(1, order)
        o.copy_(torch.where((length > k)[:, None], long, short))
    return out


def topk(scores, lengths, k, row_starts, out, sorted):
    """Fill ``out [R, k]`` int32 (contract: ``indexcache.topk``)."""
    return _select(scores, lengths, k, row_starts, out, sorted)


def topk_translate(scores, lengths, k, page_table, page_size, row_starts, row_to_batch, out, out_raw, sorted):
    """Fill ``out`` (physical) and ``out_raw`` (logical, when given) (contract: ``indexcache.topk_translate``)."""
    raw = out_raw if out_raw is not None else torch.empty_like(out)
    _select(scores, lengths, k, row_starts, raw, sorted)
    return translate(raw, page_table, lengths, page_size, row_to_batch, out)
