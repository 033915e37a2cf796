"""The decode producer step in plain torch: the paged logits, then top-k and translation of their rows."""

from __future__ import annotations

import torch

from indexcache.backends.torch.logits import paged_mqa_logits
from indexcache.backends.torch.topk import topk_translate


def paged_topk_translate(q, k_cache, weights, context_lens, block_table, max_context_len, k, page_table, page_size,
                         logits, out, out_raw, k_format=None, row_to_batch=None):
    """Fill ``logits``, ``out`` and ``out_raw`` (when given) (contract: ``indexcache.paged_topk_translate``).
    Each row's length and request are computed on the device (ragged rows: given): no host sync."""
    batch, next_n = q.shape[:2]
    paged_mqa_logits(q, k_cache, weights, context_lens, block_table, max_context_len, logits, k_format, row_to_batch)
    if row_to_batch is not None:
        return topk_translate(logits, context_lens.clamp_min(0), k, page_table, page_size, None, row_to_batch, out,
                              out_raw, False)
    row = torch.arange(batch * next_n, device=q.device)
    lengths = (context_lens.long()[row // next_n] - next_n + 1 + row % next_n).clamp_min(0).to(torch.int32)
    rows = None if next_n == 1 else (row // next_n).to(torch.int32)
    return topk_translate(logits, lengths, k, page_table, page_size, None, rows, out, out_raw, False)
