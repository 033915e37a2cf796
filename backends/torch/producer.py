"""The producer steps in plain torch: decode's paged logits, then top-k and translation of their rows; prefill's
logits and top-k in passes of query rows."""

from __future__ import annotations

import torch

from indexcache.backends.torch.logits import mqa_logits, paged_mqa_logits
from indexcache.backends.torch.topk import topk_translate
from indexcache.backends.torch.translate import translate


def paged_topk_translate(q, k_cache, weights, context_lens, block_table, max_context_len, k, page_table, page_size,
                         logits, out, out_raw, k_format=None, row_to_batch=None, q_scale=None):
    """Fill ``logits``, ``out`` and ``out_raw`` (when given) (contract: ``indexcache.paged_topk_translate``).
    Each row's length and request are computed on the device (ragged rows: given): no host sync. With
    ``max_context_len <= k`` every row is short: the logits are left unwritten (the top-k does not read them)."""
    batch, next_n = q.shape[:2]
    if max_context_len > k:
        paged_mqa_logits(q, k_cache, weights, context_lens, block_table, max_context_len, logits, k_format,
                         row_to_batch, q_scale)
    if row_to_batch is not None:
        return topk_translate(logits, context_lens.clamp_min(0), k, page_table, page_size, None, row_to_batch, out,
                              out_raw, False)
    row = torch.arange(batch * next_n, device=q.device)
    lengths = (context_lens.long()[row // next_n] - next_n + 1 + row % next_n).clamp_min(0).to(torch.int32)
    rows = None if next_n == 1 else (row // next_n).to(torch.int32)
    return topk_translate(logits, lengths, k, page_table, page_size, None, rows, out, out_raw, False)


def mqa_topk_translate(q, k, k_scale, weights, ks, ke, topk, page_table, page_size, row_to_batch, out, out_raw,
                       workspace_bytes, q_scale=None):
    """Fill ``out`` and ``out_raw`` (when given) (contract: ``indexcache.mqa_topk_translate``): the queries in passes
    of as many rows as ``workspace_bytes`` holds of their ``[rows, N]`` float32 logits (the logits' own temporaries
    under the backend's memory budget, the top-k's its own), each pass's logits then its top-k and translation; with
    no more keys than ``topk`` every row is short, selected without logits or scratch."""
    tokens, keys = q.shape[0], k.shape[0]
    if tokens == 0 or topk == 0:
        return out
    starts = ks.long().clamp(0, keys)
    lengths = (torch.maximum(ke.long().clamp(max=keys), starts) - starts).to(torch.int32)
    starts = starts.to(torch.int32)
    if keys <= topk:  # every window short: its first positions, without logits
        positions = torch.arange(topk, device=q.device)
        raw = torch.where(positions < lengths[:, None], positions, -1).to(torch.int32)
        if out_raw is not None:
            out_raw.copy_(raw)
        return translate(raw, page_table, lengths, page_size, row_to_batch, out)
    step = min(tokens, workspace_bytes // (4 * keys))
    if step == 0:
        raise ValueError(f"workspace_bytes: expected at least {4 * keys} bytes on the torch backend (a query row's "
                         f"float32 logits over {keys} keys), got a bound of {workspace_bytes}")
    logits = torch.empty((step, keys), dtype=torch.float32, device=q.device)
    for t0 in range(0, tokens, step):
        t1 = min(tokens, t0 + step)
        part = logits[:t1 - t0]
        mqa_logits(q[t0:t1], k, k_scale, weights[t0:t1], ks[t0:t1], ke[t0:t1], part,
                   None if q_scale is None else q_scale[t0:t1])
        # Without row_to_batch, query t translates through table row t: the pass's rows of the table.
        r2b, table = (None, page_table[t0:t1]) if row_to_batch is None else (row_to_batch[t0:t1], page_table)
        topk_translate(part, lengths[t0:t1], topk, table, page_size, starts[t0:t1], r2b, out[t0:t1],
                       None if out_raw is None else out_raw[t0:t1], False)
    return out
