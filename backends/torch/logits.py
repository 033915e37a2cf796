"""Indexer logits in plain torch, chunked so no ``[T, H, N]`` intermediate ever exists.

Inputs are widened to float32 (exact for fp8 and bf16) and multiplied in float32; each chunk's
``[tokens, heads, keys]`` product stays under the memory budget of :mod:`.memory`.
"""

from __future__ import annotations

import torch

from indexcache.backends.torch.memory import memory_budget
from indexcache.hal import fp4
from indexcache.hal.layout import split_packed_cache

KEY_CHUNK = 4096


def _e2m1(values: torch.Tensor) -> torch.Tensor:
    """MXFP4 values ``[..., D / 2]`` (two a byte) as float32 ``[..., D]``, their block scales not applied. A magnitude
    from its code ``c`` by arithmetic, so no table is copied to the device at each chunk: ``c / 2`` below 2, else
    ``2 ** (c // 2 - 1) * (1 + (c % 2) / 2)``."""
    packed = values.view(torch.uint8)
    nibble = torch.stack((packed & 15, packed >> 4), -1).flatten(-2)
    code = (nibble & 7).float()
    magnitude = torch.where(code < 2, code / 2, torch.exp2(torch.floor(code / 2) - 1) * (1 + (code % 2) / 2))
    return torch.where(nibble >= 8, -magnitude, magnitude)


def _mxfp4(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 rows (keys or queries) ``[..., D / 2]`` with their e8m0 scales ``[..., D / 32]`` as ``(float32 [..., D],
    float32 [...])``: the values in units of the row's largest block scale (each block times ``2 ** (its byte - the
    largest)``, at most 1: exact but for a block more than about 2^149 below the largest, which an fp32 sum in those
    units drops too) and that largest scale byte, NaN for a row with a NaN block (byte 255). Decoding each block at its
    own scale instead overflowed float32 for finite rows (6 at byte 254 is 1.5 · 2^129) and made their logits inf or
    NaN."""
    b = scales.view(torch.uint8).float()
    top = b.amax(-1)
    x = _e2m1(values).unflatten(-1, (b.shape[-1], -1)) * torch.exp2(b - top[..., None])[..., None]
    return x.flatten(-2), top.masked_fill(top == 255, float("nan"))


def _scale_products(prod: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``prod`` times ``2 ** exponent`` in place, ``exponent`` (float32 integers from -254 to 254, or NaN; broadcast to
    ``prod``, and consumed) a query's and a key's largest scale bytes less 254: as two powers of two of the same sign,
    each within float32 (2^-127 .. 2^127), so that a product that fits float32 is never out of it on the way (the two
    scales one after the other overflowed where a key near 2^127 met a query far below 1, or the reverse)."""
    half = exponent.div(2).floor_()
    return prod.mul_(exponent.sub_(half).exp2_()).mul_(half.exp2_())


def mqa_logits(q, k, k_scale, weights, ks, ke, out, q_scale=None):
    """Fill ``out [T, N]`` float32 (contract: ``indexcache.mqa_logits``; MXFP4 keys decoded a chunk of keys at a
    time, MXFP4 queries with ``q_scale`` a chunk of rows at a time)."""
    tokens, heads = q.shape[:2]
    dim = fp4.head_dim(q)
    n = k.shape[0]
    if out.numel() == 0:
        return out
    mxfp4 = k.dtype == fp4.FP4
    budget = memory_budget()
    # Per key of a chunk while its rows run: the key in float32, its scale and its column.
    key_bytes = 4 * dim + 16
    # Per query row of a chunk: the row's q in float32 (MXFP4 queries: their decode's temporaries besides, about 24
    # bytes an element in all), then per key of the chunk the row's product, its head sum, the where() result and
    # the window's masks (MXFP4 queries: each product's scale exponent and its half besides).
    row_bytes = (24 if q_scale is not None else 4) * heads * dim
    row_key_bytes = (12 if q_scale is not None else 4) * heads + 16
    # The key chunk leaves room for at least one row; decoding MXFP4 keys takes about 24 bytes an element, the rows
    # of the previous chunk released by then.
    key_chunk = max(1, min(n, KEY_CHUNK, (budget - row_bytes) // (key_bytes + row_key_bytes),
                           budget // (24 * dim + 16) if mxfp4 else n))
    # The row chunk from what the key chunk leaves (at least one row).
    step = max(1, min(tokens, (budget - key_chunk * key_bytes) // (row_bytes + row_key_bytes * key_chunk)))
    for n0 in range(0, n, key_chunk):
        _mqa_key_chunk(q, k, k_scale, weights, ks, ke, out, q_scale, n0, min(n, n0 + key_chunk), step, mxfp4)
    return out


def _mqa_key_chunk(q, k, k_scale, weights, ks, ke, out, q_scale, n0, n1, step, mxfp4):
    """Fill ``out[:, n0:n1]``, ``step`` rows at a time; each row chunk's temporaries die with its call, the key
    chunk's at return, so no two chunks' temporaries are alive at once."""
    if mxfp4:  # the chunk's keys in units of their largest block scale, that scale a key's (MXFP4 queries: its byte)
        kf, scale = _mxfp4(k[n0:n1], k_scale[n0:n1])
        if q_scale is None:
            scale = torch.exp2(scale - 127)
    else:
        kf, scale = k[n0:n1].float(), k_scale[n0:n1]
    col = torch.arange(n0, n1, device=q.device)[None, :]
    for t0 in range(0, q.shape[0], step):
        _mqa_rows(q, kf, scale, col, weights, ks, ke, out, q_scale, n0, n1, t0, min(q.shape[0], t0 + step))


def _mqa_rows(q, kf, scale, col, weights, ks, ke, out, q_scale, n0, n1, t0, t1):
    """Fill ``out[t0:t1, n0:n1]`` from the key chunk ``kf`` (float32) and its ``scale`` (MXFP4 queries: the keys'
    largest scale bytes, each product scaled by its query's and key's together before the ReLU)."""
    if q_scale is None:
        qf = q[t0:t1].float()
    else:
        qf, q_top = _mxfp4(q[t0:t1], q_scale[t0:t1])
    prod = torch.matmul(qf.reshape(-1, kf.shape[1]), kf.t()).view(t1 - t0, q.shape[1], n1 - n0)
    del qf
    if q_scale is not None:
        _scale_products(prod, q_top[:, :, None] + scale[None, None, :] - 254)
    prod.relu_().mul_(weights[t0:t1, :, None])
    logits = prod.sum(1)
    if q_scale is None:
        logits.mul_(scale[None, :])
    del prod
    inside = (col >= ks[t0:t1, None]) & (col < ke[t0:t1, None])
    out[t0:t1, n0:n1] = torch.where(inside, logits, float("-inf"))


def paged_mqa_logits(q, k_cache, weights, context_lens, page_table, max_context_len, out, k_format=None,
                     row_to_batch=None, q_scale=None):
    """Fill ``out [B * next_n, max_context_len]`` float32 (contract: ``indexcache.paged_mqa_logits``); an MXFP4
    cache (``k_format``) is decoded a chunk of keys at a time, MXFP4 queries once (with ``q_scale``); ragged rows
    (``row_to_batch``) read their requests' table rows (a row naming none reads nothing)."""
    batch, next_n, heads, dim = *q.shape[:3], fp4.head_dim(q)
    named = None
    if row_to_batch is not None:  # each row its own table row, gathered once (rows naming none: no pages)
        named = (row_to_batch >= 0) & (row_to_batch < page_table.shape[0])
        page_table = page_table[row_to_batch.long().clamp(0, max(page_table.shape[0] - 1, 0))] if \
            page_table.shape[0] else page_table.new_empty((batch, page_table.shape[1]))
    mxfp4 = k_format == fp4.FP4
    keys, scales = split_packed_cache(k_cache, dim, fp4.FP4 if mxfp4 else q.dtype)
    if mxfp4:  # their bytes: gathered like any uint8, then decoded
        keys, scales = keys.view(torch.uint8), scales.view(torch.uint8)
    cache_pages, page_size = keys.shape[:2]
    table_pages = page_table.shape[1]
    out.fill_(float("-inf"))
    if out.numel() == 0 or cache_pages == 0 or table_pages == 0:
        return out
    if q_scale is None:
        qf, q_top = q.float(), None
    else:  # in units of each (token, head)'s largest block scale, that scale's byte applied with the keys'
        qf, q_top = _mxfp4(q, q_scale)
        q_top = q_top.view(batch, 1, next_n, heads)
    qf = qf.reshape(batch, next_n * heads, dim)
    w = weights.view(batch, 1, next_n, heads)
    # Rows of the visible-key bound per (request, draft token): context - next_n + j + 1.
    visible = context_lens.long()[:, None] - next_n + 1 + torch.arange(next_n, device=q.device)[None, :]
    # What stays alive across chunks: the queries in float32 (MXFP4 ones: their decode's temporaries, about 24
    # bytes an element, died with it; their largest scale bytes), the visible-key bounds and a ragged call's gathered
    # table rows.
    held = qf.nbytes + visible.nbytes + (page_table.nbytes + named.nbytes if named is not None else 0) + \
        (q_top.nbytes if q_top is not None else 0)
    # Per key position of a chunk, per table row: its entry, mask and gathered key (MXFP4: the decode's int64 codes
    # and float32 values besides, about 24 bytes an element in all), the products, their head sums and masks (MXFP4
    # queries: each product's scale exponent and its half besides).
    per_key = batch * ((16 if q_top is not None else 8) * next_n * heads + (24 if mxfp4 else 4) * dim + 32)
    step = max(1, min(max_context_len, (memory_budget() - held) // per_key))
    view = out.view(batch, next_n, max_context_len)
    for s0 in range(0, max_context_len, step):
        _paged_chunk(qf, q_top, keys, scales, w, page_table, named, visible, view, s0,
                     min(max_context_len, s0 + step), mxfp4)
    return out


def _paged_chunk(qf, q_top, keys, scales, w, page_table, named, visible, view, s0, s1, mxfp4):
    """Fill ``view[:, :, s0:s1]`` (key positions ``s0 .. s1 - 1`` of every row); the chunk's temporaries die at
    return, so no two chunks' temporaries are alive at once. ``q_top``: MXFP4 queries' largest scale bytes
    ``[B, 1, next_n, H]``, each product scaled by its query's and key's together before the ReLU."""
    batch, next_n, heads = w.shape[0], w.shape[2], w.shape[3]
    cache_pages, page_size = keys.shape[:2]
    table_pages = page_table.shape[1]
    pos = torch.arange(s0, s1, device=qf.device)
    page = pos // page_size
    entry = page_table[:, page.clamp(max=table_pages - 1)].long()
    ok = (page < table_pages)[None, :] & (entry >= 0) & (entry < cache_pages)
    if named is not None:
        ok &= named[:, None]
    entry = entry.clamp(0, cache_pages - 1)
    slot = (pos % page_size)[None, :]
    if mxfp4:  # the keys in units of their largest block scale, that scale a key's (MXFP4 queries: its byte)
        kf, scale = _mxfp4(keys[entry, slot], scales[entry, slot])
        scale = scale[..., None] if q_top is not None else torch.exp2(scale[..., None] - 127)
    else:
        kf, scale = keys[entry, slot].float(), scales[entry, slot][..., None]
    del entry, slot
    prod = torch.bmm(kf, qf.transpose(1, 2)).view(batch, s1 - s0, next_n, heads)
    del kf
    if q_top is not None:
        _scale_products(prod, scale[..., None] + q_top - 254)
    logits = prod.relu_().mul_(w).sum(-1)
    if q_top is None:
        logits.mul_(scale)
    del prod, scale
    seen = ok[..., None] & (pos[None, :, None] < visible[:, None, :])
    del ok
    view[:, :, s0:s1] = torch.where(seen, logits, float("-inf")).transpose(1, 2)
