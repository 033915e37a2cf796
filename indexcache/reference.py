"""The float64 / int64 oracle for every op of DESIGN.md: short, obviously right, slow.

Every backend is judged against these functions. They run on the CPU, loop over rows where that
makes the rule plain, and return int32 indices (-1 for an empty slot) or float64 logits. Inputs
may live on any device; they are copied to the CPU first.
"""

from __future__ import annotations

import torch

from indexcache.layout import fp8_max, split_packed_cache


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu()


def translate(raw, page_table, seq_lens, page_size, *, row_to_batch=None) -> torch.Tensor:
    """Logical → physical slot, ``[R, K]`` int32; -1 wherever any guard of DESIGN.md fails."""
    raw, table, seq_lens = _cpu(raw).long(), _cpu(page_table).long(), _cpu(seq_lens).long()
    rows, k = raw.shape
    batches, pages = table.shape
    r2b = torch.arange(rows) if row_to_batch is None else _cpu(row_to_batch).long()
    out = torch.full((rows, k), -1, dtype=torch.int64)
    for r in range(rows):
        b = int(r2b[r])
        if not 0 <= b < batches:
            continue
        for j in range(k):
            x = int(raw[r, j])
            if x < 0 or x >= int(seq_lens[r]):
                continue
            page = x // page_size
            if page >= pages or int(table[b, page]) < 0:
                continue
            out[r, j] = int(table[b, page]) * page_size + x % page_size
    return out.int()


def _window(scores: torch.Tensor, start: int, length: int) -> tuple[int, int]:
    """The row's window ``[start, start + length)`` clipped to the columns; negative length is 0."""
    n = scores.shape[-1]
    start = min(max(start, 0), n)
    return start, min(max(length, 0), n - start)


def topk(scores, lengths, k, *, row_starts=None) -> torch.Tensor:
    """Per row the k best window positions, ``[R, k]`` int32, sorted by (score desc, index asc).

    Rows whose window holds ≤ k positions give ``0 .. len-1`` then -1 without looking at the
    scores. Otherwise -inf and NaN are never chosen (slots they would fill are -1) and among
    equal scores the lower index wins.
    """
    scores, lengths = _cpu(scores).double(), _cpu(lengths).long()
    rows = scores.shape[0]
    starts = torch.zeros(rows, dtype=torch.long) if row_starts is None else _cpu(row_starts).long()
    out = torch.full((rows, k), -1, dtype=torch.int64)
    for r in range(rows):
        start, length = _window(scores, int(starts[r]), int(lengths[r]))
        if length <= k:
            out[r, :length] = torch.arange(length)
            continue
        row = scores[r, start : start + length].tolist()
        ranked = sorted((i for i in range(length) if row[i] == row[i] and row[i] != float("-inf")),
                        key=lambda i: (-row[i], i))[:k]
        out[r, : len(ranked)] = torch.tensor(ranked, dtype=torch.long)
    return out.int()


def topk_translate(scores, lengths, k, page_table, page_size, *, row_starts=None, row_to_batch=None):
    """``(physical, raw)``: :func:`topk` then :func:`translate` through the page table by ``lengths``."""
    raw = topk(scores, lengths, k, row_starts=row_starts)
    return translate(raw, page_table, lengths, page_size, row_to_batch=row_to_batch), raw


def mqa_logits(q, k, k_scale, weights, ks, ke) -> torch.Tensor:
    """Ragged prefill logits ``[T, N]`` float64, -inf outside ``[ks[t], ke[t])``.

    ``out[t, n] = k_scale[n] * sum_h weights[t, h] * relu(q[t, h] . k[n])``.
    """
    q, k = _cpu(q).double(), _cpu(k).double()
    k_scale, weights = _cpu(k_scale).double(), _cpu(weights).double()
    ks, ke = _cpu(ks).long(), _cpu(ke).long()
    n = k.shape[0]
    logits = torch.einsum("thd,nd->thn", q, k).clamp_min(0)
    logits = (logits * weights[:, :, None]).sum(1) * k_scale[None, :]
    col = torch.arange(n)[None, :]
    inside = (col >= ks[:, None]) & (col < ke[:, None])
    return logits.masked_fill(~inside, float("-inf"))


def paged_mqa_logits(q, k_cache, weights, context_lens, page_table, max_context_len) -> torch.Tensor:
    """Paged decode logits ``[B * next_n, max_context_len]`` float64.

    Row ``b * next_n + j`` sees keys ``0 .. context_lens[b] - next_n + j``; keys past that, keys
    whose page lies beyond the table and keys whose table entry is < 0 or beyond the cache are -inf.
    """
    q = _cpu(q)
    batch, next_n, heads, dim = q.shape
    keys, scales = split_packed_cache(_cpu(k_cache), dim, q.dtype)
    num_pages, page_size = scales.shape
    table, context_lens = _cpu(page_table).long(), _cpu(context_lens).long()
    weights = _cpu(weights).double().view(batch, next_n, heads)
    out = torch.full((batch * next_n, max_context_len), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for j in range(next_n):
            visible = min(int(context_lens[b]) - next_n + j + 1, max_context_len)
            for s in range(max(visible, 0)):
                page = s // page_size
                if page >= table.shape[1] or not 0 <= int(table[b, page]) < num_pages:
                    continue
                slot = (int(table[b, page]), s % page_size)
                dots = (q[b, j].double() @ keys[slot].double()).clamp_min(0)
                out[b * next_n + j, s] = (dots * weights[b, j]).sum() * float(scales[slot])
    return out


def quantize_index_k(k, fp8_dtype=torch.float8_e4m3fn, block=128):
    """Block-``block`` fp8 with power-of-two scales: ``(k_fp8 [N, D], scale [N, D // block] float32)``.

    ``scale = 2 ** ceil(log2(max(amax, 1e-4) / fp8_max))`` so every ``k / scale`` fits the format; a block
    holding NaN or ±inf has scale NaN and zero values.
    """
    k = _cpu(k).double()
    n, d = k.shape
    blocks = k.view(n, d // block, block)
    finite = torch.isfinite(blocks).all(-1)
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / fp8_max(fp8_dtype)))).masked_fill(~finite, float("nan"))
    q = (blocks / scale[..., None]).masked_fill(~finite[..., None], 0.0).view(n, d).float().to(fp8_dtype)
    return q, scale.float()


def store_index_k(k, k_cache, slot_mapping, fp8_dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """A copy of the packed cache with ``k [N, D]`` quantized (one scale a token) into ``slot_mapping [N]``.

    Slot ``s`` is token ``s % page_size`` of page ``s // page_size``; slots < 0 or beyond the cache
    are skipped.
    """
    cache = _cpu(k_cache).clone()
    q, scale = quantize_index_k(k, fp8_dtype, block=k.shape[1])
    keys, scales = split_packed_cache(cache, k.shape[1], fp8_dtype)
    num_pages, page_size = scales.shape
    for i, slot in enumerate(_cpu(slot_mapping).tolist()):
        if 0 <= slot < num_pages * page_size:
            keys[slot // page_size, slot % page_size] = q[i]
            scales[slot // page_size, slot % page_size] = scale[i, 0]
    return cache
