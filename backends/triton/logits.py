"""Indexer logits in Triton: ragged prefill (``mqa_logits``) and paged decode (``paged_mqa_logits``).

``out[t, n] = k_scale[n] · Σ_h w[t, h] · relu(q[t, h] · k[n])`` with one ``tl.dot`` a tile, fp32
accumulation, and the ReLU + weighted head sum in registers right after it.

Orientation (``KEYS_ON_M`` in the tuning table; the logits recipe of docs/kernels.md): on NVIDIA the dot is
flipped, ``dot(k [keys, D], trans(q [tokens·H, D]))``, so each thread holds whole head groups of a
key row and the head sum is in-thread adds plus shuffles; on AMD (MFMA keeps accumulator rows in
registers) the heads may stay on M, ``dot(q, trans(k))``. k_scale is applied once after the head
sum (it is positive, so it commutes with the ReLU).

Prefill: a persistent grid of ``SMs × PROGRAMS_PER_SM`` programs takes blocks of ``BLOCK_Q`` tokens
(``BLOCK_Q · H = COLS`` dot columns) round-robin, last block first (causal prefill: longest rows
first). A program loads its Q tile and weights once and walks the union of its rows' windows in
``BLOCK_N``-key tiles; a tile inside every row's window stores without a mask, a boundary tile
stores ``where(inside, s, -inf)``; the columns outside the union are filled with -inf afterwards.

Decode: a persistent grid of as many programs as stay resident (on NVIDIA counted from the compiled kernel's
registers and shared memory, elsewhere the table's ``PROGRAMS_PER_SM``). Every program computes the schedule itself
from the context lengths: the batch's key tiles (each request's context clipped to ``max_context_len``,
``BLOCK_KEYS`` keys a tile) in request order, cut into equal contiguous shares, so a program walks one request's
tiles or the end of one and the start of the next, whatever the lengths (no metadata kernel, nothing for the host to
know). For each request in its share a program loads Q ``[group · H, D]`` and the weights once, then walks the
tiles, each key row gathered through the page table from the packed cache (fp8 bytes, then the page's fp32 scales).
An MXFP4 cache (``MXFP4``) is read the same way, its value bytes as words and its block scale bytes, and
widened to the queries' fp8 format in registers (``mxfp4.py``; docs/fp4.md, "The Triton kernels"), or given with its
block scales to the target's block-scaled instruction ("Scaled matrix instructions"). MXFP4 prefill keys on a target
without one are widened once a call before the fp8 prefill (``prefill_fp4.py``).
A group is next_n padded to a power of two, at most ``COLS`` dot columns (next_n 3-4 at H = 64 take two programs,
adjacent in launch order so the second reads the keys from L2); rows that see fewer keys (causal inside the next_n
block) are masked at the store. The -inf past each context is written after, shared evenly over the ``batch ×
max_context_len`` grid.

Windows are clipped to ``[0, N)``; keys whose page is beyond the table, whose entry is < 0 or
beyond the cache, or beyond the context are -inf. Nothing outside the cache is read: a decode tile inside one
page reads it whole, without masks, from page 0 when the entry names no page of the cache. Nothing is
allocated, nothing syncs with the host, and the grid depends only on shapes and the compiled kernel.

fp8 keys must be the target's native format. On GPUs without fp8 matrix units or fp8 conversions
(sm80: the tuning table's ``FP8_DOT = "fp16"``) the kernels take the fp8 tensors as their bytes
(uint8; the cache layout is the same) and decode e4m3 to fp16 with integer bit arithmetic before an
fp16 dot (exact: fp16 holds every e4m3 value). Interpreted bf16 is widened to fp32 before the dot,
because the CPU interpreter has no bf16 ``tl.dot``: the interpreted check then covers everything
but the dot's input precision (bf16 × bf16 products are exact in fp32 anyway).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from indexcache.backends.triton import mxfp4, prefill_fp4
from indexcache.backends.triton import workspace as workspaces
from indexcache.backends.triton.head_sum import fp4_head_sum, fp4_queries, scale_keys, tile_head_sum, unpack_words
from indexcache.backends.triton.launcher import (
    Launch,
    Launcher,
    Options,
    bound,
    launch_key_options,
    persistent_programs,
    planned_sms,
)
from indexcache.backends.triton.support import cdiv, launch_options, next_power_of_2, on_target_device
from indexcache.backends.triton.target import Target, usable_scaled_mma
from indexcache.hal import fp4
from indexcache.hal.contract import OpImpl
from indexcache.hal.device import sm_count
from indexcache.hal.layout import FP8_DTYPES, cache_page_size, token_bytes

NEG_INF = tl.constexpr(float("-inf"))
INTERPRETED_SMS = 3  # programs of the persistent grid under the interpreter (exercises the round-robin)
BATCH_BLOCK = 256  # context lengths a step of the decode schedule reads


@triton.jit
def _pair(a, b, A_ON_ROWS: tl.constexpr):
    """``(a[:, None], b[None, :])`` or its transpose: the [keys, groups] / [groups, keys] tile shape."""
    if A_ON_ROWS:
        pair = a[:, None], b[None, :]
    else:
        pair = a[None, :], b[:, None]
    return pair


# The token count takes no part in the variant, nor do the addresses of the windows (read a token at a time;
# docs/kernels.md, "Kernel variants") and of MXFP4 queries' scale bytes. The key count does, as the logits' row stride
# (equal for contiguous logits): the boundary tiles' masks and the -inf fill keep 16-byte accesses where it is a
# multiple of 16.
@triton.jit(do_not_specialize=("T", "skip"), do_not_specialize_on_alignment=("ks_ptr", "ke_ptr", "qs_ptr"))
def mqa_logits_kernel(
    q_ptr, k_ptr, scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, qs_ptr,
    T, N, skip,
    q_s0, q_s1, q_s2, k_s0, k_s1, scale_s0, w_s0, w_s1, ks_s0, ke_s0, out_s0, out_s1, qs_s0, qs_s1,
    H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_ON_M: tl.constexpr,
    WIDEN: tl.constexpr, MXFP4: tl.constexpr = 0, FILL: tl.constexpr = 1, Q_FP4: tl.constexpr = 0,
):
    """``MXFP4`` (``mxfp4``'s modes; launched with the block-scaled ones, 3 and 4, or with MXFP4 queries: elsewhere
    MXFP4 keys come widened once, ``prefill_fp4``): ``k`` holds MXFP4 value bytes ``[N, D / 2]`` (rows at
    multiples of 4 bytes, read as words) and ``scale`` their e8m0 bytes ``[N, D / 32]`` (unit stride along a row),
    each tile's logits as the decode kernel's (:func:`fp4_head_sum`: its scales applied there). ``Q_FP4``: MXFP4
    queries, ``q`` their value bytes ``[T, H, D / 2]`` (read as words) and ``qs`` their scale bytes ``[T, H, D / 32]``
    (unused otherwise). ``skip``: rows whose clipped window holds at most this many keys get no logits (0: as the
    contract, only empty ones); ``FILL`` 0: nothing is written outside the union of a block's windows (the producer
    step reads only inside each row's window)."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(T, BLOCK_Q)
    rows = tl.arange(0, BLOCK_Q * H)
    dims = tl.arange(0, D)
    keys = tl.arange(0, BLOCK_N)
    for i in range(pid, blocks, tl.num_programs(0)):
        t0 = (blocks - 1 - i) * BLOCK_Q
        tok = t0 + tl.arange(0, BLOCK_Q)
        tok_ok = tok < T
        tok64 = tok.to(tl.int64)
        # Each row's window clipped to [0, N); missing rows and rows of at most ``skip`` keys (0: the empty ones)
        # become [N, 0) so they widen nothing.
        ks = tl.minimum(tl.maximum(tl.load(ks_ptr + tok64 * ks_s0, mask=tok_ok, other=0), 0), N)
        ke = tl.minimum(tl.maximum(tl.load(ke_ptr + tok64 * ke_s0, mask=tok_ok, other=0), 0), N)
        empty = (ke - ks <= skip) | ~tok_ok
        ks = tl.where(empty, N, ks)
        ke = tl.where(empty, 0, ke)
        lo = tl.min(ks, axis=0)
        hi = tl.max(ke, axis=0)
        clean_lo = tl.max(ks, axis=0)
        clean_hi = tl.min(ke, axis=0)
        start = (lo // BLOCK_N) * BLOCK_N
        tiles = tl.where(hi > lo, tl.cdiv(hi - start, BLOCK_N), 0)
        stop = start + tiles * BLOCK_N

        qrow = (t0 + rows // H).to(tl.int64) * q_s0 + (rows % H).to(tl.int64) * q_s1
        if Q_FP4:
            qsrow = (t0 + rows // H).to(tl.int64) * qs_s0 + (rows % H).to(tl.int64) * qs_s1
            q, q_scales = _fp4_queries(q_ptr, qs_ptr, qrow, qsrow, t0 + rows // H < T, D, MXFP4, WIDEN)
        else:
            q = tl.load(q_ptr + qrow[:, None] + dims.to(tl.int64)[None, :] * q_s2, mask=(t0 + rows // H < T)[:, None],
                        other=0.0)
            if MXFP4 and MXFP4 != mxfp4.SCALED_E2M1:  # in the order of the widened keys
                q = mxfp4.permute(q, BLOCK_Q * H, D)
            q_scales = 0
        w = tl.load(w_ptr + tok64[:, None] * w_s0 + tl.arange(0, H).to(tl.int64)[None, :] * w_s1, mask=tok_ok[:, None],
                    other=0.0)
        out_rows = tok64 * out_s0
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + keys
            n_ok = n < N
            if MXFP4:
                words = tl.load(k_ptr.to(tl.pointer_type(tl.uint32)) + (n.to(tl.int64) * (k_s0 // 4))[:, None]
                                + tl.arange(0, D // 8)[None, :], mask=n_ok[:, None], other=0)
                key_scales = tl.load(scale_ptr + (n.to(tl.int64) * scale_s0)[:, None]
                                     + tl.arange(0, D // 32)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
                s = fp4_head_sum(words, key_scales, n_ok, q, w, BLOCK_N, BLOCK_Q, H, D, KEYS_ON_M, WIDEN, MXFP4,
                                 q_scales, Q_FP4)
            else:
                k = tl.load(k_ptr + n.to(tl.int64)[:, None] * k_s0 + dims.to(tl.int64)[None, :] * k_s1,
                            mask=n_ok[:, None], other=0.0)
                s = tile_head_sum(k, q, w, BLOCK_N, BLOCK_Q, H, KEYS_ON_M, WIDEN)
                sc = tl.load(scale_ptr + n.to(tl.int64) * scale_s0, mask=n_ok, other=0.0)
                if KEYS_ON_M:
                    s = s * sc[:, None]
                else:
                    s = s * sc[None, :]
            col, row = _pair(n.to(tl.int64) * out_s1, out_rows, KEYS_ON_M)
            ptrs = out_ptr + col + row
            if (n0 >= clean_lo) & (n0 + BLOCK_N <= clean_hi):
                tl.store(ptrs, s)
            else:
                n2, ks2 = _pair(n, ks, KEYS_ON_M)
                n2, ke2 = _pair(n, ke, KEYS_ON_M)
                n_ok2, tok_ok2 = _pair(n_ok, tok_ok, KEYS_ON_M)
                tl.store(ptrs, tl.where((n2 >= ks2) & (n2 < ke2), s, NEG_INF), mask=n_ok2 & tok_ok2)
        if FILL:  # -inf outside the union of the rows' windows
            fill = tl.full((BLOCK_Q, BLOCK_N), NEG_INF, tl.float32)
            for n0 in range(0, start, BLOCK_N):
                n = n0 + keys
                tl.store(out_ptr + out_rows[:, None] + n.to(tl.int64)[None, :] * out_s1, fill, mask=tok_ok[:, None])
            for n0 in range(stop, N, BLOCK_N):
                n = n0 + keys
                tl.store(out_ptr + out_rows[:, None] + n.to(tl.int64)[None, :] * out_s1, fill,
                         mask=tok_ok[:, None] & (n < N)[None, :])


@triton.jit
def _fp4_queries(q_ptr, qs_ptr, qrow, qsrow, live, D: tl.constexpr, MXFP4: tl.constexpr, WIDEN: tl.constexpr):
    """MXFP4 query rows whose value bytes start at ``q_ptr + qrow`` (multiples of 4) and scale bytes at
    ``qs_ptr + qsrow`` (zero where not ``live``): ``(the values as the keys' mode multiplies them,
    :func:`fp4_queries`; int32 scale bytes [ROWS, D // 32])``."""
    words = tl.load(q_ptr.to(tl.pointer_type(tl.uint32)) + (qrow // 4)[:, None] + tl.arange(0, D // 8)[None, :],
                    mask=live[:, None], other=0)
    scales = tl.load(qs_ptr + qsrow[:, None] + tl.arange(0, D // 32)[None, :], mask=live[:, None], other=0)
    scales = scales.to(tl.int32)
    return fp4_queries(words, scales, qrow.shape[0], D, MXFP4, WIDEN), scales


@triton.jit
def _decode_entries(table_row, n0, kend, num_pages, table_pages, tab_s1, keys,
                    PAGE: tl.constexpr, BLOCK_KEYS: tl.constexpr):
    """Page-table entries of the tile at ``n0``: ``(entry, ok [BLOCK_KEYS])``.

    Tiles start at multiples of BLOCK_KEYS, so when PAGE is a multiple of BLOCK_KEYS a tile lies inside one
    page and reads its entry once, as a scalar; otherwise (pages smaller than a tile, or of any size that is
    not a multiple of it, e.g. 96) a tile may cross a page end and reads one entry a key (the same address
    for a page's keys: one L1 line). ``ok``: the key is before ``kend``, its page is in the table and its
    entry names a page of the cache. A scalar entry always names a page of the cache (page 0 where the table's
    does not), so that the tile's rows and scales are read without masks: every byte of a page is inside the
    cache, and the keys that are not ``ok`` store -inf (:func:`_decode_store`)."""
    s = n0 + keys
    if PAGE % BLOCK_KEYS == 0:
        page = n0 // PAGE
        entry = tl.load(table_row + tl.cast(page, tl.int64) * tab_s1, mask=(n0 < kend) & (page < table_pages), other=-1)
        entry_k = entry + 0 * keys  # the tile's keys share it (-1 when not read)
        ok = (s < kend) & (entry_k >= 0) & (entry_k < num_pages)
        entry = tl.where((entry >= 0) & (entry < num_pages), entry, 0)
    else:
        page = s // PAGE
        live = (s < kend) & (page < table_pages)
        entry = tl.load(table_row + page.to(tl.int64) * tab_s1, mask=live, other=-1)
        ok = live & (entry >= 0) & (entry < num_pages)
    return entry.to(tl.int64), ok


@triton.jit
def _fp4_gather(kv_ptr, entry, ok, n0, keys, PAGE: tl.constexpr, D: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                WORDS: tl.constexpr):
    """An MXFP4 tile: its value bytes as uint32 words ``[BLOCK_KEYS, D // 8]`` and its scale bytes as int32
    ``[BLOCK_KEYS, D // 32]`` (zero where not ``ok``, unless read unmasked). A page is ``PAGE · D / 2`` value bytes
    then ``PAGE · D / 32`` scale bytes; a tile inside one page (PAGE a multiple of BLOCK_KEYS) reads both as
    contiguous runs without masks. ``WORDS``: the cache's pages start at multiples of 4 bytes, so the values are
    read as words; else (odd layouts: D = 64 with odd pages, D = 32) each word is put together from its bytes."""
    page_bytes: tl.constexpr = PAGE * (D // 2 + D // 32)
    wdims = tl.arange(0, D // 8)
    sdims = tl.arange(0, D // 32)
    if PAGE % BLOCK_KEYS == 0:
        first = n0 % PAGE
        if WORDS and D % 128 == 0:  # a key's scale bytes as int32 words (4-byte loads: pipelined like the values)
            sw = tl.load(kv_ptr.to(tl.pointer_type(tl.int32)) + (entry * (page_bytes // 4) + PAGE * (D // 8)
                                                                  + first * (D // 128))
                         + (keys * (D // 128))[:, None] + tl.arange(0, D // 128)[None, :])
            sc = tl.reshape((sw[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF, (BLOCK_KEYS, D // 32))
        else:
            sc = tl.load(kv_ptr + (entry * page_bytes + PAGE * (D // 2) + first * (D // 32))
                         + (keys * (D // 32))[:, None] + sdims[None, :])
        if WORDS:
            v = tl.load(kv_ptr.to(tl.pointer_type(tl.uint32)) + (entry * (page_bytes // 4) + first * (D // 8))
                        + (keys * (D // 8))[:, None] + wdims[None, :])
        else:
            at = (entry * page_bytes + first * (D // 2)) + (keys * (D // 2))[:, None] + 4 * wdims[None, :]
            v = _word_of_bytes(kv_ptr, at, ok, False)
    else:
        off = (n0 + keys) % PAGE
        sc = tl.load(kv_ptr + (entry * page_bytes + PAGE * (D // 2) + off * (D // 32))[:, None] + sdims[None, :],
                     mask=ok[:, None], other=0)
        if WORDS:
            v = tl.load(kv_ptr.to(tl.pointer_type(tl.uint32)) + (entry * (page_bytes // 4) + off * (D // 8))[:, None]
                        + wdims[None, :], mask=ok[:, None], other=0)
        else:
            v = _word_of_bytes(kv_ptr, (entry * page_bytes + off * (D // 2))[:, None] + 4 * wdims[None, :],
                               ok[:, None], True)
    return v, sc.to(tl.int32)


@triton.jit
def _word_of_bytes(kv_ptr, at, ok, MASKED: tl.constexpr):
    """The little-endian uint32 of the four bytes at ``kv_ptr + at`` (with ``MASKED``, 0 where not ``ok``)."""
    v = tl.zeros(at.shape, tl.uint32)
    for i in tl.static_range(4):
        if MASKED:
            byte = tl.load(kv_ptr + at + i, mask=ok, other=0)
        else:
            byte = tl.load(kv_ptr + at + i)
        v |= byte.to(tl.uint32) << (8 * i)
    return v


@triton.jit
def _decode_gather(kv_ptr, kv_scale_ptr, entry, ok, n0, keys, dims, PAGE: tl.constexpr, D: tl.constexpr,
                   BLOCK_KEYS: tl.constexpr, WORDS: tl.constexpr, MXFP4: tl.constexpr = 0):
    """The tile's key rows and fp32 scales ``[BLOCK_KEYS]`` (zero where not ``ok``, unless read unmasked); an
    MXFP4 cache's (``MXFP4``): :func:`_fp4_gather`.

    Rows: fp8 ``[BLOCK_KEYS, D]``, or with ``WORDS`` the same bytes as int32 ``[BLOCK_KEYS, D // 4]`` (a tile
    carried across loop iterations as fp8 takes a register a byte; as words, one a 4 bytes). A tile inside one
    page (PAGE a multiple of BLOCK_KEYS, see :func:`_decode_entries`) has its rows as ``BLOCK_KEYS · D``
    contiguous bytes and its scales as ``BLOCK_KEYS`` contiguous words at the page's end."""
    page_words = PAGE * (D + 4) // 4
    if MXFP4:
        k, sc = _fp4_gather(kv_ptr, entry, ok, n0, keys, PAGE, D, BLOCK_KEYS, WORDS)
    elif PAGE % BLOCK_KEYS == 0:  # the entry names a page of the cache (_decode_entries): no masks
        first_key = n0 % PAGE
        sc = tl.load(kv_scale_ptr + (entry * page_words + (PAGE * D // 4) + first_key) + keys)
        if WORDS:
            wdims = tl.arange(0, D // 4)
            k = tl.load(kv_scale_ptr.to(tl.pointer_type(tl.int32)) + (entry * page_words + first_key * (D // 4))
                        + (keys * (D // 4))[:, None] + wdims[None, :])
        else:
            k = tl.load(kv_ptr + (entry * (PAGE * (D + 4)) + first_key * D) + (keys * D)[:, None] + dims[None, :])
    else:
        off = (n0 + keys) % PAGE
        sc = tl.load(kv_scale_ptr + entry * page_words + (PAGE * D // 4) + off, mask=ok, other=0.0)
        if WORDS:
            wdims = tl.arange(0, D // 4)
            k = tl.load(kv_scale_ptr.to(tl.pointer_type(tl.int32)) + (entry * page_words + off * (D // 4))[:, None]
                        + wdims[None, :], mask=ok[:, None], other=0)
        else:
            k = tl.load(kv_ptr + (entry * (PAGE * (D + 4)) + off * D)[:, None] + dims[None, :], mask=ok[:, None],
                        other=0.0)
    return k, sc


@triton.jit
def _decode_store(out_ptr, k, sc, ok, q, q_scales, w, n0, ctx, visible, last, out_rows, grp_ok, keys, out_s1,
                  GROUPS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                  KEYS_ON_M: tl.constexpr, WIDEN: tl.constexpr, WORDS: tl.constexpr, MXFP4: tl.constexpr,
                  Q_FP4: tl.constexpr):
    """Logits of one tile: the head sum scaled by the keys' scales, -inf where a row must not see the key (an MXFP4
    tile: ``MXFP4``, ``mxfp4``'s modes; MXFP4 queries: ``Q_FP4``, ``q_scales`` their scale bytes)."""
    s = n0 + keys
    if MXFP4:
        acc = fp4_head_sum(k, sc, ok, q, w, BLOCK_KEYS, GROUPS, H, D, KEYS_ON_M, WIDEN, MXFP4, q_scales, Q_FP4)
    else:
        if WORDS:
            k = unpack_words(k, q.dtype, BLOCK_KEYS, D)
        acc = scale_keys(tile_head_sum(k, q, w, BLOCK_KEYS, GROUPS, H, KEYS_ON_M, WIDEN), sc, KEYS_ON_M)
    seen_s, vis = _pair(tl.where(ok, s, ctx), visible, KEYS_ON_M)
    col, row = _pair(s.to(tl.int64) * out_s1, out_rows, KEYS_ON_M)
    s_ok, g_ok = _pair(s < last, grp_ok, KEYS_ON_M)
    tl.store(out_ptr + col + row, tl.where(seen_s < vis, acc, NEG_INF), mask=s_ok & g_ok)


@triton.jit
def _decode_span(q_ptr, qs_ptr, kv_ptr, kv_scale_ptr, w_ptr, table_row, out_ptr, ctx_ptr, b, j0, ctx, paired, first,
                 stop, max_ctx, num_pages, table_pages, q_s0, q_s1, q_s2, q_s3, qs_s0, qs_s1, qs_s2, w_s0, w_s1,
                 ctx_s0, tab_s1, out_s0, out_s1,
                 NEXT_N: tl.constexpr, GROUPS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_KEYS: tl.constexpr, KEYS_ON_M: tl.constexpr, WIDEN: tl.constexpr, PREFETCH: tl.constexpr,
                 WORDS: tl.constexpr, MXFP4: tl.constexpr, PAIRS: tl.constexpr, Q_FP4: tl.constexpr):
    """Logits of request ``b``'s keys ``[first, stop)`` (whole tiles of its context, ``ctx`` ≥ 0) for the draft
    tokens ``j0 .. j0 + GROUPS - 1``, its pages in ``table_row`` (``table_pages`` of them): Q and the weights loaded
    once, then the tiles in order. ``PAIRS`` (ragged rows two a program): the unit of rows ``b`` and, ``paired``,
    ``b + 1`` (:func:`_unit`), each its own token, length and logits row."""
    rows = tl.arange(0, GROUPS * H)
    dims = tl.arange(0, D)
    keys = tl.arange(0, BLOCK_KEYS)
    grp = j0 + tl.arange(0, GROUPS)
    if PAIRS:
        grp_ok = (grp == 0) | ((grp == 1) & paired)
        visible = tl.load(ctx_ptr + (b + grp).to(tl.int64) * ctx_s0, mask=grp_ok, other=0)
    else:
        grp_ok = grp < NEXT_N
        # Row j of the next_n block sees keys [0, ctx - NEXT_N + j + 1); no row sees past ctx.
        visible = ctx - NEXT_N + 1 + grp
    # Keys < kend are read, keys < last stored (a tile past ``stop`` in the paired variant stores nothing).
    kend = tl.minimum(ctx, stop)
    last = tl.minimum(stop, max_ctx)

    j = j0 + rows // H
    if Q_FP4:
        if PAIRS:
            q_live = (j == 0) | ((j == 1) & paired)
            qrow = (b + j).to(tl.int64) * q_s0 + (rows % H).to(tl.int64) * q_s2
            qsrow = (b + j).to(tl.int64) * qs_s0 + (rows % H).to(tl.int64) * qs_s2
        else:
            q_live = j < NEXT_N
            qrow = tl.cast(b, tl.int64) * q_s0 + j.to(tl.int64) * q_s1 + (rows % H).to(tl.int64) * q_s2
            qsrow = tl.cast(b, tl.int64) * qs_s0 + j.to(tl.int64) * qs_s1 + (rows % H).to(tl.int64) * qs_s2
        q, q_scales = _fp4_queries(q_ptr, qs_ptr, qrow, qsrow, q_live, D, MXFP4, WIDEN)
    else:
        if PAIRS:
            q = tl.load(q_ptr + ((b + j).to(tl.int64) * q_s0 + (rows % H).to(tl.int64) * q_s2)[:, None]
                        + dims.to(tl.int64)[None, :] * q_s3,
                        mask=((j == 0) | ((j == 1) & paired))[:, None], other=0.0)
        else:
            q = tl.load(q_ptr + tl.cast(b, tl.int64) * q_s0
                        + (j.to(tl.int64) * q_s1 + (rows % H).to(tl.int64) * q_s2)[:, None]
                        + dims.to(tl.int64)[None, :] * q_s3, mask=(j < NEXT_N)[:, None], other=0.0)
        if MXFP4 and MXFP4 != mxfp4.SCALED_E2M1:  # in the order of the widened keys
            q = mxfp4.permute(q, GROUPS * H, D)
        q_scales = 0
    if PAIRS:
        out_row = b + grp
    else:
        out_row = b * NEXT_N + grp
    w = tl.load(w_ptr + out_row.to(tl.int64)[:, None] * w_s0 + tl.arange(0, H).to(tl.int64)[None, :] * w_s1,
                mask=grp_ok[:, None], other=0.0)
    out_rows = out_row.to(tl.int64) * out_s0
    if PREFETCH == 2:
        # Two tiles in flight without register moves: tiles go in pairs (a, b) and each buffer is reloaded
        # right after it is multiplied, so tile i + 2 is read while tile i + 1 is multiplied (a tile past
        # ``stop`` is all masked: nothing read, nothing stored).
        entry, ok_a = _decode_entries(table_row, first, kend, num_pages, table_pages, tab_s1, keys, PAGE, BLOCK_KEYS)
        k_a, sc_a = _decode_gather(kv_ptr, kv_scale_ptr, entry, ok_a, first, keys, dims, PAGE, D, BLOCK_KEYS, WORDS,
                                   MXFP4)
        entry, ok_b = _decode_entries(table_row, first + BLOCK_KEYS, kend, num_pages, table_pages, tab_s1, keys,
                                      PAGE, BLOCK_KEYS)
        k_b, sc_b = _decode_gather(kv_ptr, kv_scale_ptr, entry, ok_b, first + BLOCK_KEYS, keys, dims, PAGE, D,
                                   BLOCK_KEYS, WORDS, MXFP4)
        for n0 in range(first, stop, 2 * BLOCK_KEYS):
            entry_a, ok_a2 = _decode_entries(table_row, n0 + 2 * BLOCK_KEYS, kend, num_pages, table_pages, tab_s1,
                                             keys, PAGE, BLOCK_KEYS)
            entry_b, ok_b2 = _decode_entries(table_row, n0 + 3 * BLOCK_KEYS, kend, num_pages, table_pages, tab_s1,
                                             keys, PAGE, BLOCK_KEYS)
            _decode_store(out_ptr, k_a, sc_a, ok_a, q, q_scales, w, n0, ctx, visible, last, out_rows, grp_ok, keys,
                          out_s1, GROUPS, H, D, BLOCK_KEYS, KEYS_ON_M, WIDEN, WORDS, MXFP4, Q_FP4)
            k_a, sc_a = _decode_gather(kv_ptr, kv_scale_ptr, entry_a, ok_a2, n0 + 2 * BLOCK_KEYS, keys, dims, PAGE, D,
                                       BLOCK_KEYS, WORDS, MXFP4)
            ok_a = ok_a2
            _decode_store(out_ptr, k_b, sc_b, ok_b, q, q_scales, w, n0 + BLOCK_KEYS, ctx, visible, last, out_rows,
                          grp_ok, keys, out_s1, GROUPS, H, D, BLOCK_KEYS, KEYS_ON_M, WIDEN, WORDS, MXFP4, Q_FP4)
            k_b, sc_b = _decode_gather(kv_ptr, kv_scale_ptr, entry_b, ok_b2, n0 + 3 * BLOCK_KEYS, keys, dims, PAGE, D,
                                       BLOCK_KEYS, WORDS, MXFP4)
            ok_b = ok_b2
    elif PREFETCH == 1:
        # Software pipeline in registers: while tile i is multiplied, tile i + 1's rows and scales and tile
        # i + 2's table entries are in flight (all masked beyond kend, so nothing past the context is read).
        entry, ok = _decode_entries(table_row, first, kend, num_pages, table_pages, tab_s1, keys, PAGE, BLOCK_KEYS)
        k, sc = _decode_gather(kv_ptr, kv_scale_ptr, entry, ok, first, keys, dims, PAGE, D, BLOCK_KEYS, WORDS,
                               MXFP4)
        entry_n, ok_n = _decode_entries(table_row, first + BLOCK_KEYS, kend, num_pages, table_pages, tab_s1, keys,
                                        PAGE, BLOCK_KEYS)
        for n0 in range(first, stop, BLOCK_KEYS):
            k_n, sc_n = _decode_gather(kv_ptr, kv_scale_ptr, entry_n, ok_n, n0 + BLOCK_KEYS, keys, dims, PAGE, D,
                                       BLOCK_KEYS, WORDS, MXFP4)
            entry_nn, ok_nn = _decode_entries(table_row, n0 + 2 * BLOCK_KEYS, kend, num_pages, table_pages, tab_s1,
                                              keys, PAGE, BLOCK_KEYS)
            _decode_store(out_ptr, k, sc, ok, q, q_scales, w, n0, ctx, visible, last, out_rows, grp_ok, keys, out_s1,
                          GROUPS, H, D, BLOCK_KEYS, KEYS_ON_M, WIDEN, WORDS, MXFP4, Q_FP4)
            k, sc, ok = k_n, sc_n, ok_n
            entry_n, ok_n = entry_nn, ok_nn
    else:
        # Loads in the iteration that uses them (Triton's pipeliner stages them when num_stages > 1).
        for n0 in range(first, stop, BLOCK_KEYS):
            entry, ok = _decode_entries(table_row, n0, kend, num_pages, table_pages, tab_s1, keys, PAGE, BLOCK_KEYS)
            k, sc = _decode_gather(kv_ptr, kv_scale_ptr, entry, ok, n0, keys, dims, PAGE, D, BLOCK_KEYS, WORDS,
                                   MXFP4)
            _decode_store(out_ptr, k, sc, ok, q, q_scales, w, n0, ctx, visible, last, out_rows, grp_ok, keys, out_s1,
                          GROUPS, H, D, BLOCK_KEYS, KEYS_ON_M, WIDEN, WORDS, MXFP4, Q_FP4)

@triton.jit
def _unit(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, PAIRS: tl.constexpr):
    """``(context, paired, live)`` of unit ``b`` (a scalar or a tensor; nothing past the batch): request ``b``, or
    with ``PAIRS`` (ragged rows two a program) rows ``b`` and ``b + 1`` where ``b`` is even and both name the same
    request (their longer length; ``paired``), else row ``b`` alone; ``live`` where the row starts a unit."""
    inside = b < batch
    b64 = tl.cast(b, tl.int64)
    ctx = tl.load(ctx_ptr + b64 * ctx_s0, mask=inside, other=0)
    paired = b < 0
    live = inside
    if PAIRS:
        req = tl.load(r2b_ptr + b64 * r2b_s0, mask=inside, other=-1)
        prev = tl.load(r2b_ptr + (b64 - 1) * r2b_s0, mask=inside & (b >= 1), other=-1)
        after = tl.load(r2b_ptr + (b64 + 1) * r2b_s0, mask=b + 1 < batch, other=-1)
        even = b % 2 == 0
        live = inside & (even | (req != prev))
        paired = even & (b + 1 < batch) & (after == req)
        ctx = tl.where(paired, tl.maximum(ctx, tl.load(ctx_ptr + (b64 + 1) * ctx_s0, mask=paired, other=0)), ctx)
    return ctx, paired, live


@triton.jit
def _context_tiles(ctx, max_ctx, skip, BLOCK_KEYS: tl.constexpr):
    """Tiles of a request's logits that read keys: its context clipped to ``[0, max_ctx]``, in tiles; none where
    that is at most ``skip`` (a request whose rows the caller's top-k selects without their logits)."""
    n = tl.minimum(tl.maximum(ctx, 0), max_ctx)
    return tl.where(n > skip, tl.cdiv(n, BLOCK_KEYS), 0)


@triton.jit
def _filled_tiles(ctx, max_ctx, skip, BLOCK_KEYS: tl.constexpr):
    """Tiles of a request's logits row that need no -inf fill: those :func:`_context_tiles` stores, or the whole
    row of a skipped request (left unwritten)."""
    n = tl.minimum(tl.maximum(ctx, 0), max_ctx)
    return tl.where(n > skip, tl.cdiv(n, BLOCK_KEYS), tl.cdiv(max_ctx, BLOCK_KEYS))


# The batch, the context, the cache's and the table's sizes and the row strides of the table and the logits take no
# part in the variant, nor do the addresses of the lengths and the table (read an entry at a time) and of MXFP4
# queries' scale bytes: a tile's stores are masked by the context and so never vectorized (docs/kernels.md, "Kernel
# variants").
@triton.jit(do_not_specialize=("batch", "max_ctx", "num_pages", "table_pages", "table_rows", "skip", "tab_s0",
                               "out_s0"),
            do_not_specialize_on_alignment=("ctx_ptr", "table_ptr", "r2b_ptr", "qs_ptr"))
def paged_mqa_logits_kernel(
    q_ptr, kv_ptr, kv_scale_ptr, w_ptr, ctx_ptr, table_ptr, r2b_ptr, out_ptr, qs_ptr,
    batch, max_ctx, num_pages, table_pages, table_rows, skip,
    q_s0, q_s1, q_s2, q_s3, w_s0, w_s1, ctx_s0, tab_s0, tab_s1, r2b_s0, out_s0, out_s1, qs_s0, qs_s1, qs_s2,
    NEXT_N: tl.constexpr, GROUPS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_KEYS: tl.constexpr, BLOCK_B: tl.constexpr, KEYS_ON_M: tl.constexpr, WIDEN: tl.constexpr,
    PREFETCH: tl.constexpr = 1, WORDS: tl.constexpr = 0, MXFP4: tl.constexpr = 0, HAS_R2B: tl.constexpr = 0,
    Q_FP4: tl.constexpr = 0,
):
    """``HAS_R2B``: ragged rows (next_n 1): row ``b``'s pages are table row ``r2b[b]``, none where that is not one of
    the ``table_rows`` rows; with ``GROUPS`` 2, two rows of one request at an even row and the next share a program
    and their key reads (:func:`_unit`). ``skip``: requests whose context clipped to ``max_ctx`` is at most this are
    neither computed nor filled (their rows left as they were; -1 skips none). ``Q_FP4``: MXFP4 queries on an MXFP4
    cache, ``q`` their value bytes ``[B, next_n, H, D / 2]`` (read as words) and ``qs`` their scale bytes
    ``[B, next_n, H, D / 32]`` (unused otherwise)."""
    PAIRS: tl.constexpr = HAS_R2B and GROUPS == 2
    j0 = tl.program_id(0) * GROUPS
    p = tl.program_id(1).to(tl.int64)
    programs = tl.num_programs(1)
    # The schedule, computed by every program from the context lengths (no metadata kernel): the batch's tiles
    # that read keys, in request order, cut into ``programs`` contiguous shares of equal size; a share spans
    # one request or the end of one and the start of the next, whatever the lengths.
    total = 0
    for b0 in range(0, batch, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        ctx, _, live = _unit(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, bs, batch, PAIRS)
        total += tl.sum(tl.where(live, _context_tiles(ctx, max_ctx, skip, BLOCK_KEYS), 0))
    t_begin = p * total // programs
    t_end = (p + 1) * total // programs
    # b_lo: the first request whose tiles end past t_begin, ``start`` its first tile; b_hi: requests starting
    # before t_end.
    b_lo = 0
    b_hi = 0
    start = t_begin * 0
    ran = 0
    for b0 in range(0, batch, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        ctx, _, live = _unit(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, bs, batch, PAIRS)
        tiles = tl.where(live, _context_tiles(ctx, max_ctx, skip, BLOCK_KEYS), 0)
        ends = ran + tl.cumsum(tiles, 0)
        before = ends <= t_begin
        b_lo += tl.sum(before.to(tl.int32))
        start += tl.sum(tl.where(before, tiles, 0))
        b_hi += tl.sum(((ends - tiles < t_end) & (bs < batch)).to(tl.int32))
        ran += tl.sum(tiles)
    for b in range(b_lo, b_hi):
        if PAIRS:
            ctx, paired, live = _unit(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, PAIRS)
            ctx = tl.maximum(ctx, 0)
            tiles = tl.where(live, _context_tiles(ctx, max_ctx, skip, BLOCK_KEYS), 0)
        else:
            ctx = tl.maximum(tl.load(ctx_ptr + tl.cast(b, tl.int64) * ctx_s0), 0)
            tiles = _context_tiles(ctx, max_ctx, skip, BLOCK_KEYS)
            paired = b < 0
        lo = tl.maximum(t_begin - start, 0)
        hi = tl.minimum(t_end - start, tiles)
        tb = b
        pages = table_pages
        if HAS_R2B:
            tb = tl.load(r2b_ptr + tl.cast(b, tl.int64) * r2b_s0)
            named = (tb >= 0) & (tb < table_rows)
            tb = tl.where(named, tb, 0)
            pages = tl.where(named, table_pages, 0)
        _decode_span(q_ptr, qs_ptr, kv_ptr, kv_scale_ptr, w_ptr, table_ptr + tl.cast(tb, tl.int64) * tab_s0, out_ptr,
                     ctx_ptr, b, j0, ctx, paired, (lo * BLOCK_KEYS).to(tl.int32), (hi * BLOCK_KEYS).to(tl.int32),
                     max_ctx, num_pages, pages, q_s0, q_s1, q_s2, q_s3, qs_s0, qs_s1, qs_s2, w_s0, w_s1, ctx_s0,
                     tab_s1, out_s0, out_s1, NEXT_N, GROUPS, H, D, PAGE, BLOCK_KEYS, KEYS_ON_M, WIDEN, PREFETCH, WORDS,
                     MXFP4, PAIRS, Q_FP4)
        start += tiles
    # -inf past each context (the keys no tile above stored; nothing in a skipped request's rows), shared out evenly
    # over the batch × max_ctx grid.
    grp = j0 + tl.arange(0, GROUPS)
    keys = tl.arange(0, BLOCK_KEYS)
    fill = tl.full((GROUPS, BLOCK_KEYS), NEG_INF, tl.float32)
    width = tl.cdiv(max_ctx, BLOCK_KEYS)
    f_begin = p * batch * width // programs
    f_end = (p + 1) * batch * width // programs
    for b in range(f_begin // width, tl.cdiv(f_end, width)):
        if PAIRS:
            ctx, paired, live = _unit(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, PAIRS)
            filled = tl.where(live, _filled_tiles(ctx, max_ctx, skip, BLOCK_KEYS), width)
            out_rows = (b + grp).to(tl.int64) * out_s0
            there = (grp == 0) | ((grp == 1) & paired)
        else:
            filled = _filled_tiles(tl.load(ctx_ptr + tl.cast(b, tl.int64) * ctx_s0), max_ctx, skip, BLOCK_KEYS)
            out_rows = (b * NEXT_N + grp).to(tl.int64) * out_s0
            there = grp < NEXT_N
        lo = tl.maximum(f_begin - b * width, filled)
        hi = tl.minimum(f_end - b * width, width)
        for n0 in range(lo * BLOCK_KEYS, hi * BLOCK_KEYS, BLOCK_KEYS):
            s = n0 + keys
            tl.store(out_ptr + out_rows[:, None] + s.to(tl.int64)[None, :] * out_s1, fill,
                     mask=there[:, None] & (s < max_ctx)[None, :])


PREFILL, DECODE = Launcher(mqa_logits_kernel), Launcher(paged_mqa_logits_kernel)


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _widen_mode(dtype: torch.dtype, target: Target, cfg: Mapping[str, Any] | None = None) -> int:
    """0: dot on the inputs as they are; 1 (e4m3fn) / 3 (e4m3fnuz): fp8 passed as bytes and decoded to fp16 in
    the kernel (the table's ``FP8_DOT`` is "fp16", or, without one, no fp8 matrix units); 2: widened to fp32
    (interpreted bf16)."""
    if dtype in FP8_DTYPES:
        dot = (cfg or {}).get("FP8_DOT") or ("fp8" if target.gpu.fp8_mma else "fp16")
        return 0 if dot == "fp8" else 3 if dtype == torch.float8_e4m3fnuz else 1
    return 2 if target.interpreted else 0


def _fp4_mode(dtype: torch.dtype, target: Target) -> int:
    """The kernels' ``MXFP4`` for fp8 queries of ``dtype`` on ``target`` (``mxfp4``'s modes): into the target's
    block-scaled instruction (its ``scaled_mma``, where the installed Triton builds it) with e4m3fn queries, else
    widened to ``dtype``'s e4m3 with one scale a key."""
    scaled = usable_scaled_mma(target.gpu)
    if scaled is not None and dtype == torch.float8_e4m3fn:
        return (mxfp4.SCALED_E2M1 if scaled.keys == "e2m1" else mxfp4.SCALED_E4M3).value
    return (mxfp4.WIDEN_FNUZ if dtype == torch.float8_e4m3fnuz else mxfp4.WIDEN_FN).value


def _columns(cfg: Mapping[str, Any], fp4_mode: int, q_fp4: bool) -> int:
    """Dot columns (query rows) a program of the logits kernels takes: the table's ``COLS``, half of it for MXFP4
    queries without a block-scaled instruction (``blockwise_dot`` holds a block's product beside the tile's sum)."""
    return cfg["COLS"] // 2 if q_fp4 and fp4_mode < mxfp4.SCALED_E2M1.value else cfg["COLS"]


def _fp4_matrix(mode: int, widen: int) -> str:
    """The matrix instructions an MXFP4 build in ``mode`` must use (the cross-compile check's ``matrix``)."""
    return "scaled" if mode >= mxfp4.SCALED_E2M1.value else "fp16" if widen in (1, 3) else "fp8"


def _fp4_tile(keys: int, mode: int, target: Target, keys_on_m: bool) -> int:
    """Keys a tile of an MXFP4 launch in ``mode``: the table's ``keys``, or on a block-scaled instruction with the keys
    on M at least the rows it needs (sm100: 128)."""
    if mode >= mxfp4.SCALED_E2M1.value and keys_on_m:
        return max(keys, usable_scaled_mma(target.gpu).rows)
    return keys


def _as_bytes(x: torch.Tensor, widen: int) -> torch.Tensor:
    """``x`` as the kernels take it: its bytes (uint8) when fp8 is decoded in the kernel."""
    return x.view(torch.uint8) if widen in (1, 3) else x


def _multiplied_in(q: torch.Tensor, target: Target) -> torch.dtype:
    """The fp8 format the kernels multiply ``q`` (and MXFP4 keys) in: ``q``'s own, MXFP4 queries the target's."""
    return target.fp8_dtype if q.dtype == fp4.FP4 else q.dtype


def _query_args(q: torch.Tensor, q_scale: torch.Tensor | None, widen: int) -> tuple:
    """The kernels' queries, their scales' pointer and its strides but the last: MXFP4 queries' bytes and scale bytes,
    else ``q`` as the kernels take it (:func:`_as_bytes`) for both pointers (the scales' unused) and zero strides."""
    if q_scale is not None:
        return q.view(torch.uint8), q_scale.view(torch.uint8), q_scale.stride()[:-1]
    queries = _as_bytes(q, widen)
    return queries, queries, (0,) * (q.dim() - 1)


def _programs(target: Target, device: torch.device) -> int:
    """Multiprocessors of the device (of the planned one inside ``launcher.planning``); ``INTERPRETED_SMS``
    interpreted."""
    return INTERPRETED_SMS if target.interpreted else planned_sms() or sm_count(device.index or 0)


def _check_dtype(name: str, dtype: torch.dtype, target: Target, bf16: bool) -> list[str]:
    if dtype in FP8_DTYPES:
        if dtype == target.fp8_dtype:
            return []
        return [f"{name} is {str(dtype).removeprefix('torch.')}, but {target.arch}'s native fp8 format is "
                f"{str(target.fp8_dtype).removeprefix('torch.')}"]
    if bf16 and dtype == torch.bfloat16:
        return []
    return [f"{name} dtype {dtype} is not handled by the Triton logits kernels"]


def format_options(target: Target, cfg: Mapping[str, Any], mxfp4: bool) -> dict[str, Any]:
    """The launch options of a logits kernel (prefill or decode, ``cfg`` its table entry) on fp8 / bf16 keys, or on
    MXFP4 keys with the table's ``FP4_NUM_WARPS`` and ``FP4_MAXNREG`` where it has them (NVIDIA: without a register
    cap ptxas aims at three programs a SM and spills the widening's registers on sm80 / sm89; sm100's 128-key tiles
    take 8 warps)."""
    options = launch_options(target, cfg)
    if mxfp4 and "FP4_NUM_WARPS" in cfg:
        options["num_warps"] = cfg["FP4_NUM_WARPS"]
    if mxfp4 and "FP4_MAXNREG" in cfg:
        options["maxnreg"] = cfg["FP4_MAXNREG"]
    return options


def _mxfp4_prefill(k: torch.Tensor, k_scale: torch.Tensor, target: Target) -> list[str]:
    """Why the prefill kernel cannot read these MXFP4 keys (empty: it can): a target with fp8 matrix instructions
    (without them the widened tile and the fp16 queries spill), the values' rows read as words, the scale bytes of a
    row adjacent. (Queries with MXFP4 keys are fp8 or MXFP4: the op's check refuses bf16 ones.)"""
    reasons = []
    if not target.gpu.fp8_mma:
        reasons.append(f"MXFP4 keys on {target.arch}: the Triton prefill takes them where there are fp8 matrix "
                       "instructions (the torch backend serves the others)")
    if k.stride(1) != 1 or k.stride(0) % 4 or k.data_ptr() % 4:
        reasons.append("MXFP4 k: the Triton prefill reads its rows as 4-byte words (unit stride along a row, rows "
                       "and the first one at multiples of 4 bytes)")
    if k_scale.stride(1) != 1:
        reasons.append("MXFP4 k_scale: the Triton prefill needs unit stride along a row")
    return reasons


def declined_shape(q: torch.Tensor) -> list[str]:
    """Why the Triton logits kernels decline queries ``q [..., H, D]`` (``D / 2`` packed for MXFP4) by their heads and
    head dim alone (empty: they take them); meta tensors too."""
    return _check_shape(q.shape[-2], fp4.head_dim(q))


def _check_shape(heads: int, dim: int) -> list[str]:
    reasons = []
    if not _is_pow2(heads):
        reasons.append(f"heads={heads}: the Triton logits kernels need a power of two")
    if not _is_pow2(dim) or not 32 <= dim <= 256:
        reasons.append(f"head dim {dim}: the Triton logits kernels need a power of two in [32, 256]")
    return reasons


def mqa_logits_launches(q, k, k_scale, weights, ks, ke, out, q_scale=None, *, target: Target,
                        cfg: Mapping[str, Any], options: Options | None = None, skip: int = 0, fill: bool = True,
                        workspace: torch.Tensor | None = None, keys_widened: bool = False) -> list[Launch]:
    """The launches that fill ``out [T, N]`` float32 (contract: ``indexcache.mqa_logits``), in order, none when ``out``
    is empty; ``q [T, H, D]``, ``k [N, D]``; ``options``: the launch options of ``cfg`` for ``target`` and the keys'
    format (:func:`format_options` as :func:`~indexcache.backends.triton.launcher.launch_key_options`; computed when
    None). For the producer step (``mqa_topk_translate``): ``skip`` its k, rows whose clipped window holds at most
    that many keys left unwritten (the top-k selects them without logits), and ``fill`` False, nothing written outside
    the union of a block's windows (the top-k reads only inside each row's).

    One launch, but for MXFP4 keys on a target without a block-scaled instruction: those are widened once a call into
    ``workspace`` (int32 words, :func:`prefill_fp4.workspace_words`; the calling stream's kept one when None) and go
    through the fp8 prefill (:mod:`prefill_fp4`); ``keys_widened``: ``workspace`` holds them already, widened by an
    earlier launch list of the same keys (the producer step's passes). MXFP4 queries (``q_scale`` given, with MXFP4
    keys): the Triton kernel reads both, on any target (:func:`fp4_head_sum`)."""
    tokens, heads, dim = *q.shape[:2], fp4.head_dim(q)
    n = k.shape[0]
    if out.numel() == 0:
        return []
    fp4_keys = k.dtype == fp4.FP4
    fp4_mode = _fp4_mode(_multiplied_in(q, target), target) if fp4_keys else 0
    words = prefill_workspace_words(q, k, q_scale, target=target)
    if words:  # MXFP4 keys widened once, then the fp8 prefill
        ws = workspace[:words] if workspace is not None else workspaces.words(q, words, None)
        fp8_options = launch_key_options(format_options(target, cfg, False))

        def fp8_launches(wide, wide_scale):
            return mqa_logits_launches(q, wide, wide_scale, weights, ks, ke, out, target=target, cfg=cfg,
                                       options=fp8_options, skip=skip, fill=fill)

        return prefill_fp4.launches(q, k, k_scale, weights, ks, ke, out, ws, cfg=cfg,
                                    far_options=options or launch_key_options(format_options(target, cfg, True)),
                                    fp8_launches=fp8_launches, skip=skip, programs=_programs(target, q.device),
                                    widen=not keys_widened)
    # The Hopper kernel in Gluon (prefill_sm90.py) where it takes the call (fp8 or bf16 queries)
    if cfg.get("KERNEL") == "tma-ws" and q_scale is None:
        from indexcache.backends.triton import prefill_sm90

        if not prefill_sm90.unsupported(q, k, k_scale, weights, out, target):
            return [prefill_sm90.launch(q, k, k_scale, weights, ks, ke, out, cfg=cfg,
                                        sms=persistent_programs(_programs(target, q.device), 1),
                                        skip=skip, fill=fill)]
    block_q = max(1, _columns(cfg, fp4_mode, q_scale is not None) // heads, 16 // heads)
    block_n = _fp4_tile(cfg["BLOCK_N"], fp4_mode, target, cfg["KEYS_ON_M"])
    blocks = cdiv(tokens, block_q)
    programs = min(blocks, persistent_programs(_programs(target, q.device), cfg.get("PROGRAMS_PER_SM", 1)))
    widen = _widen_mode(_multiplied_in(q, target), target, cfg)
    options = options or launch_key_options(format_options(target, cfg, fp4_keys))
    keys, scales = (k.view(torch.uint8), k_scale.view(torch.uint8)) if fp4_keys else (_as_bytes(k, widen), k_scale)
    queries, q_scales, qs_strides = _query_args(q, q_scale, widen)
    return [Launch(
        PREFILL, (programs,), options,
        (queries, keys, scales, weights, ks, ke, out, q_scales,
         tokens, n, skip,
         *q.stride(), *k.stride(), k_scale.stride(0), *weights.stride(), ks.stride(0), ke.stride(0), *out.stride(),
         *qs_strides),
        dict(H=heads, D=dim, BLOCK_Q=block_q, BLOCK_N=block_n, KEYS_ON_M=cfg["KEYS_ON_M"], WIDEN=widen,
             MXFP4=fp4_mode, FILL=fill, Q_FP4=int(q_scale is not None)),
    )]


def prefill_workspace_words(q, k, q_scale=None, *, target: Target) -> int:
    """int32 words of workspace a prefill (:func:`mqa_logits_launches`) on keys ``k`` takes: MXFP4 keys with fp8
    queries widened once on a target without a block-scaled instruction, else none (MXFP4 queries: none)."""
    if k.dtype != fp4.FP4 or q_scale is not None or _fp4_mode(q.dtype, target) >= mxfp4.SCALED_E2M1.value:
        return 0
    return prefill_fp4.workspace_words(k.shape[0], q.shape[2])


def prefill_round(q, k, k_scale, weights, q_scale=None, *, target: Target, cfg: Mapping[str, Any]) -> int:
    """Query rows one round of the prefill launch (:func:`mqa_logits_launches`) takes: its programs times the queries
    a program's block holds. A launch over a multiple of it leaves no program idle in its last round."""
    heads = q.shape[1]
    programs = _programs(target, q.device)
    if prefill_workspace_words(q, k, q_scale, target=target):  # MXFP4 keys widened once: the fp8 launch's round
        k = torch.empty((k.shape[0], q.shape[2]), dtype=q.dtype, device="meta")
        k_scale = torch.empty(k.shape[0], device="meta")
    if cfg.get("KERNEL") == "tma-ws" and q_scale is None:
        from indexcache.backends.triton import prefill_sm90

        # weights stands in for the logits: what the check reads of them is a unit stride along a row
        if not prefill_sm90.unsupported(q, k, k_scale, weights, weights, target):
            return persistent_programs(programs, 1) * max(1, prefill_sm90.COLS // heads)
    cols = _columns(cfg, _fp4_mode(_multiplied_in(q, target), target), q_scale is not None)
    return max(1, cols // heads, 16 // heads) * persistent_programs(programs, cfg.get("PROGRAMS_PER_SM", 1))


def mqa_logits(q, k, k_scale, weights, ks, ke, out, q_scale=None, *, target: Target, cfg: Mapping[str, Any],
               options: Options | None = None):
    """Fill ``out [T, N]`` float32 (contract: ``indexcache.mqa_logits``); arguments as :func:`mqa_logits_launches`."""
    for launch in mqa_logits_launches(q, k, k_scale, weights, ks, ke, out, q_scale, target=target, cfg=cfg,
                                      options=options):
        launch()
    return out


def paged_mqa_logits_launch(q, k_cache, weights, context_lens, page_table, max_context_len, out, k_format=None,
                            row_to_batch=None, q_scale=None, *, target: Target, cfg: Mapping[str, Any],
                            options: Options | None = None, skip: int = -1) -> Launch | None:
    """The launch that fills ``out [B * next_n, max_context_len]`` float32 (contract:
    ``indexcache.paged_mqa_logits``), None when ``out`` is empty; ``options`` as :func:`mqa_logits_launches`, for the
    cache's format (:func:`format_options`). ``skip``: the rows of a request whose context clipped to
    ``max_context_len`` is at most ``skip`` are left unwritten (the producer step's k: the top-k selects such rows
    without their logits); -1 writes every row.
    ``k_format`` is None: an fp8 cache in ``q``'s format; ``torch.float4_e2m1fn_x2``: an MXFP4 cache, read by the
    Triton kernel, or the Hopper Gluon kernel where it takes the call (both formats); ``row_to_batch``: ragged rows,
    two a program where the columns allow (both kernels); ``q_scale``: MXFP4 queries (on an MXFP4 cache), read by the
    Triton kernel."""
    batch, next_n, heads, dim = *q.shape[:3], fp4.head_dim(q)
    if out.numel() == 0:
        return None
    mxfp4 = k_format == fp4.FP4
    page = cache_page_size(k_cache, dim, fp4.FP4) if mxfp4 else cache_page_size(k_cache, dim)
    flat = k_cache.view(-1)
    fp8 = _multiplied_in(q, target)
    fp4_mode = _fp4_mode(fp8, target) if mxfp4 else 0
    block_keys = _fp4_tile(cfg["BLOCK_KEYS"], fp4_mode, target, cfg["KEYS_ON_M"])
    # Draft tokens a program: up to COLS dot columns (next_n 3-4 at H = 64 take two programs a key range, adjacent
    # in launch order so the second reads the keys from L2); ragged rows two a program where two draft tokens would
    # be (two rows of a request side by side share their key reads) and the table's RAGGED_PAIRS allows.
    pairs = row_to_batch is not None and cfg.get("RAGGED_PAIRS", True)
    cols = _columns(cfg, fp4_mode, q_scale is not None)
    groups = max(min(next_power_of_2(2 if pairs else next_n), max(1, cols // heads)), 16 // heads)
    # The Hopper kernel in Gluon (decode_sm90.py) where it takes the call (fp8 queries)
    if cfg.get("KERNEL") == "tma-ws" and q_scale is None:
        from indexcache.backends.triton import decode_sm90

        if not decode_sm90.unsupported(q, k_cache, weights, page_table, out, page, groups, target, k_format,
                                       context_lens, row_to_batch):
            return decode_sm90.launch(q, k_cache, weights, context_lens, page_table, max_context_len, out, page=page,
                                      groups=groups, target=target, cfg=cfg, sms=_programs(target, q.device),
                                      batch_block=BATCH_BLOCK, skip=skip, row_to_batch=row_to_batch,
                                      k_format=k_format)
    options = options or launch_key_options(format_options(target, cfg, mxfp4))
    widen = _widen_mode(fp8, target, cfg)
    if mxfp4:  # the cache's bytes for both pointers; value words where every page starts at a multiple of 4 bytes
        kv, kv_scale = flat, flat
        words = int(page * token_bytes(dim, fp4.FP4) % 4 == 0 and flat.data_ptr() % 4 == 0)
    else:
        kv, kv_scale = _as_bytes(flat.view(q.dtype), widen), flat.view(torch.float32)
        words = cfg.get("WORDS", 0)
    ctx_s0 = context_lens.stride(0)
    r2b, r2b_s0 = (context_lens, ctx_s0) if row_to_batch is None else (row_to_batch, row_to_batch.stride(0))
    queries, q_scales, qs_strides = _query_args(q, q_scale, widen)  # (r2b not read without ragged rows)
    args = (queries, kv, kv_scale, weights,
            context_lens, page_table, r2b, out, q_scales,
            batch, max_context_len, k_cache.shape[0], page_table.shape[1], page_table.shape[0], skip,
            *q.stride(), *weights.stride(), ctx_s0, *page_table.stride(), r2b_s0, *out.stride(), *qs_strides)
    named = dict(NEXT_N=next_n, GROUPS=groups, H=heads, D=dim, PAGE=page, BLOCK_KEYS=block_keys, BLOCK_B=BATCH_BLOCK,
                 KEYS_ON_M=cfg["KEYS_ON_M"], WIDEN=widen, PREFETCH=cfg.get("PREFETCH", 1), WORDS=words,
                 MXFP4=fp4_mode, HAS_R2B=row_to_batch is not None, Q_FP4=int(q_scale is not None))
    # A persistent grid of exactly the programs that stay resident (on NVIDIA counted from the compiled kernel's
    # registers and shared memory: a program more a SM would run as a second, mostly idle wave), never more than
    # there are tiles; the draft-token groups of a key range share the count.
    per_sm = DECODE.resident(options, *args, **named) or cfg["PROGRAMS_PER_SM"]
    programs = max(1, min(persistent_programs(_programs(target, q.device), per_sm) // cdiv(next_n, groups),
                          batch * cdiv(max_context_len, block_keys)))
    return Launch(DECODE, (cdiv(next_n, groups), programs), options, args, named)


def paged_mqa_logits(q, k_cache, weights, context_lens, page_table, max_context_len, out, k_format=None,
                     row_to_batch=None, q_scale=None, *, target: Target, cfg: Mapping[str, Any],
                     options: Options | None = None):
    """Fill ``out [B * next_n, max_context_len]`` float32 (contract: ``indexcache.paged_mqa_logits``); arguments
    as :func:`paged_mqa_logits_launch`."""
    launch = paged_mqa_logits_launch(q, k_cache, weights, context_lens, page_table, max_context_len, out, k_format,
                                     row_to_batch, q_scale, target=target, cfg=cfg, options=options)
    if launch is not None:
        launch()
    return out


def _mxfp4_queries(q: torch.Tensor, q_scale: torch.Tensor) -> list[str]:
    """Why the logits kernels cannot read these MXFP4 queries (empty: they can): their rows are read as 4-byte words
    and their scale bytes a row at a time."""
    reasons = []
    if q.stride(-1) != 1 or any(stride % 4 for stride in q.stride()[:-1]) or q.data_ptr() % 4:
        reasons.append("MXFP4 q: the Triton kernels read its rows as 4-byte words (unit stride along a row, rows and "
                       "the first one at multiples of 4 bytes)")
    if q_scale.stride(-1) != 1:
        reasons.append("MXFP4 q_scale: the Triton kernels need unit stride along a row")
    return reasons


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """``mqa_logits`` and ``paged_mqa_logits`` of a GPU backend built for ``target`` with its tuning table."""
    prefill, decode = tuning["mqa_logits"], tuning["paged_mqa_logits"]
    # The options by the keys' format (MXFP4 keys take the table's FP4_* entries).
    prefill_options = {mxfp4: launch_key_options(format_options(target, prefill, mxfp4)) for mxfp4 in (False, True)}
    decode_options = {mxfp4: launch_key_options(format_options(target, decode, mxfp4)) for mxfp4 in (False, True)}

    def supports_prefill(q, k, k_scale, weights, ks, ke, out, q_scale=None, **_):
        mxfp4 = _mxfp4_prefill(k, k_scale, target) if k.dtype == fp4.FP4 else []
        queries = (_check_dtype("q", q.dtype, target, bf16=True) if q_scale is None else
                   [*on_target_device(target, q_scale=q_scale), *_mxfp4_queries(q, q_scale)])
        return [*on_target_device(target, q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, out=out),
                *queries, *declined_shape(q), *mxfp4]

    def supports_decode(q, k_cache, weights, context_lens, page_table, out, row_to_batch=None, q_scale=None, **_):
        queries = (_check_dtype("q", q.dtype, target, bf16=False) if q_scale is None else
                   [*on_target_device(target, q_scale=q_scale), *_mxfp4_queries(q, q_scale)])
        # A tile inside one page reads the page its entry names, or page 0 where the entry names none, unmasked: a
        # cache of no pages has nothing to read (the torch backend serves it: every key -inf).
        empty = ["k_cache: a cache of no pages (the kernels read page 0 in place of a missing one)"] \
            if k_cache.shape[0] == 0 else []
        return [*on_target_device(target, q=q, k_cache=k_cache, weights=weights, context_lens=context_lens,
                                  page_table=page_table, out=out, row_to_batch=row_to_batch),
                *queries, *declined_shape(q), *empty]

    def run_prefill(**args):
        return mqa_logits(**args, target=target, cfg=prefill, options=prefill_options[args["k"].dtype == fp4.FP4])

    def prepare_prefill(**args):
        return bound(mqa_logits_launches(**args, target=target, cfg=prefill,
                                         options=prefill_options[args["k"].dtype == fp4.FP4]))

    def run_decode(**args):
        return paged_mqa_logits(**args, target=target, cfg=decode,
                                options=decode_options[args.get("k_format") == fp4.FP4])

    def prepare_decode(**args):
        return bound([paged_mqa_logits_launch(**args, target=target, cfg=decode,
                                              options=decode_options[args.get("k_format") == fp4.FP4])])

    return {"mqa_logits": OpImpl(run_prefill, supports_prefill, prepare_prefill),
            "paged_mqa_logits": OpImpl(run_decode, supports_decode, prepare_decode)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What the logits ops build for ``target`` (cross-compile check), at the indexer shape of the shipped
    models (H = 64, D = 128, 64-token pages), for contiguous tensors: prefill with the target's fp8 format, with
    bf16 and on MXFP4 keys, decode for next_n 1-4 (MTP drafts) on fp8 and on MXFP4 caches; the tile shapes and launch
    options are the table's."""
    from indexcache.backends.triton.crosscompile import KernelSpec, pointer

    heads, dim, page = 64, 128, 64
    prefill, decode = tuning["mqa_logits"], tuning["paged_mqa_logits"]
    specs = []
    for dtype in (target.fp8_dtype, torch.bfloat16):
        widen = _widen_mode(dtype, target, prefill)
        operand = "bf16" if dtype == torch.bfloat16 else "fp16" if widen in (1, 3) else "fp8"
        data = "*u8" if widen in (1, 3) else pointer(dtype)
        specs.append(KernelSpec(
            "mqa_logits", mqa_logits_kernel,
            {"q_ptr": data, "k_ptr": data, "scale_ptr": "*fp32", "w_ptr": "*fp32",
             "ks_ptr": "*i32", "ke_ptr": "*i32", "out_ptr": "*fp32", "qs_ptr": data},
            {"H": heads, "D": dim, "BLOCK_Q": max(1, prefill["COLS"] // heads, 16 // heads),
             "BLOCK_N": prefill["BLOCK_N"], "KEYS_ON_M": prefill["KEYS_ON_M"], "WIDEN": widen, "MXFP4": 0, "Q_FP4": 0,
             "q_s2": 1, "k_s1": 1, "scale_s0": 1, "w_s1": 1, "ks_s0": 1, "ke_s0": 1, "out_s1": 1},
            launch_options(target, prefill), matrix=operand,
            aligned=("q_s0", "q_s1", "k_s0", "w_s0", "qs_s0", "qs_s1")))
    # The prefill on MXFP4 keys (values [N, 64] and scales [N, 4] bytes), the target's fp8 queries, where the target
    # has fp8 matrix instructions (_mxfp4_prefill): on its block-scaled instruction where it has one (the matrix check
    # then asks for that instruction), else the keys widened once (prefill_fp4) for the fp8 prefill above.
    widen = _widen_mode(target.fp8_dtype, target, prefill)
    data = "*u8" if widen in (1, 3) else pointer(target.fp8_dtype)
    mode = _fp4_mode(target.fp8_dtype, target)
    if target.gpu.fp8_mma and mode < mxfp4.SCALED_E2M1.value:
        specs += prefill_fp4.compile_specs(target, prefill, heads, dim, format_options(target, prefill, mxfp4=True))
    specs += [] if not target.gpu.fp8_mma or mode < mxfp4.SCALED_E2M1.value else [KernelSpec(
        "mqa_logits", mqa_logits_kernel,
        {"q_ptr": data, "k_ptr": "*u8", "scale_ptr": "*u8", "w_ptr": "*fp32", "ks_ptr": "*i32", "ke_ptr": "*i32",
         "out_ptr": "*fp32", "qs_ptr": data},
        {"H": heads, "D": dim, "BLOCK_Q": max(1, prefill["COLS"] // heads, 16 // heads),
         "BLOCK_N": _fp4_tile(prefill["BLOCK_N"], mode, target, prefill["KEYS_ON_M"]),
         "KEYS_ON_M": prefill["KEYS_ON_M"], "WIDEN": widen, "MXFP4": mode, "Q_FP4": 0, "q_s2": 1, "k_s1": 1, "w_s1": 1,
         "ks_s0": 1, "ke_s0": 1, "out_s1": 1},
        format_options(target, prefill, mxfp4=True), matrix=_fp4_matrix(mode, widen),
        aligned=("q_s0", "q_s1", "k_s0", "scale_s0", "w_s0", "qs_s0", "qs_s1"))]
    # MXFP4 queries with MXFP4 keys (the values as words, the scales as bytes: [T, 64, 64] and [T, 64, 4]), where the
    # target has fp8 matrix instructions: on its block-scaled instruction, else block by block (blockwise_dot).
    specs += [] if not target.gpu.fp8_mma else [KernelSpec(
        "mqa_logits", mqa_logits_kernel,
        {"q_ptr": "*u8", "k_ptr": "*u8", "scale_ptr": "*u8", "w_ptr": "*fp32", "ks_ptr": "*i32", "ke_ptr": "*i32",
         "out_ptr": "*fp32", "qs_ptr": "*u8"},
        {"H": heads, "D": dim, "BLOCK_Q": max(1, _columns(prefill, mode, True) // heads, 16 // heads),
         "BLOCK_N": _fp4_tile(prefill["BLOCK_N"], mode, target, prefill["KEYS_ON_M"]),
         "KEYS_ON_M": prefill["KEYS_ON_M"], "WIDEN": widen, "MXFP4": mode, "Q_FP4": 1, "q_s2": 1, "k_s1": 1,
         "w_s1": 1, "ks_s0": 1, "ke_s0": 1, "out_s1": 1},
        format_options(target, prefill, mxfp4=True), matrix=_fp4_matrix(mode, widen),
        aligned=("q_s0", "q_s1", "k_s0", "scale_s0", "w_s0", "qs_s0", "qs_s1"))]
    widen = _widen_mode(target.fp8_dtype, target, decode)
    fp8 = "*u8" if widen in (1, 3) else pointer(target.fp8_dtype)
    for next_n, ragged in ((1, 0), (2, 0), (3, 0), (4, 0), (1, 1)):  # ragged: a row a token, its request named,
        # two a program
        pairs = ragged and decode.get("RAGGED_PAIRS", True)
        groups = max(min(next_power_of_2(2 if pairs else next_n), max(1, decode["COLS"] // heads)), 16 // heads)
        specs.append(KernelSpec(
            "paged_mqa_logits", paged_mqa_logits_kernel,
            {"q_ptr": fp8, "kv_ptr": fp8, "kv_scale_ptr": "*fp32", "w_ptr": "*fp32", "ctx_ptr": "*i32",
             "table_ptr": "*i32", "r2b_ptr": "*i32", "out_ptr": "*fp32", "qs_ptr": fp8},
            {"NEXT_N": next_n, "GROUPS": groups, "H": heads, "D": dim, "PAGE": page,
             "BLOCK_KEYS": decode["BLOCK_KEYS"], "BLOCK_B": BATCH_BLOCK, "KEYS_ON_M": decode["KEYS_ON_M"],
             "WIDEN": widen, "PREFETCH": decode.get("PREFETCH", 1), "WORDS": decode.get("WORDS", 0), "MXFP4": 0,
             "HAS_R2B": ragged, "Q_FP4": 0, "q_s3": 1, "w_s1": 1, "ctx_s0": 1, "tab_s1": 1, "r2b_s0": 1, "out_s1": 1},
            launch_options(target, decode), matrix="fp16" if widen in (1, 3) else "fp8",
            aligned=("q_s0", "q_s1", "q_s2", "w_s0")))
    # The MXFP4 decode (k_format float4_e2m1fn_x2): the same kernel reading the cache's bytes, widening to the
    # target's fp8 format or into its block-scaled instruction; the Triton kernel on every target (also where the
    # table's KERNEL is "tma-ws").
    mode = _fp4_mode(target.fp8_dtype, target)
    # MXFP4 queries on an MXFP4 cache (q_fp4: the queries' value bytes read as words, their scale bytes) at next_n 1
    # and 2 and ragged, the same kernel on any target (blockwise_dot where there is no block-scaled instruction).
    for next_n, ragged, q_fp4 in ((1, 0, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0), (1, 1, 0), (1, 0, 1), (2, 0, 1),
                                  (1, 1, 1)):
        pairs = ragged and decode.get("RAGGED_PAIRS", True)
        cols = _columns(decode, mode, q_fp4)
        groups = max(min(next_power_of_2(2 if pairs else next_n), max(1, cols // heads)), 16 // heads)
        queries = "*u8" if q_fp4 else fp8
        specs.append(KernelSpec(
            "paged_mqa_logits", paged_mqa_logits_kernel,
            {"q_ptr": queries, "kv_ptr": "*u8", "kv_scale_ptr": "*u8", "w_ptr": "*fp32", "ctx_ptr": "*i32",
             "table_ptr": "*i32", "r2b_ptr": "*i32", "out_ptr": "*fp32", "qs_ptr": queries},
            {"NEXT_N": next_n, "GROUPS": groups, "H": heads, "D": dim, "PAGE": page,
             "BLOCK_KEYS": _fp4_tile(decode["BLOCK_KEYS"], mode, target, decode["KEYS_ON_M"]), "BLOCK_B": BATCH_BLOCK,
             "KEYS_ON_M": decode["KEYS_ON_M"], "WIDEN": widen, "PREFETCH": decode.get("PREFETCH", 1), "WORDS": 1,
             "MXFP4": mode, "HAS_R2B": ragged, "Q_FP4": q_fp4, "q_s3": 1, "w_s1": 1, "ctx_s0": 1, "tab_s1": 1,
             "r2b_s0": 1, "out_s1": 1},
            format_options(target, decode, mxfp4=True), matrix=_fp4_matrix(mode, widen),
            aligned=("q_s0", "q_s1", "q_s2", "w_s0", "qs_s0", "qs_s1", "qs_s2")))
    if prefill.get("KERNEL") == "tma-ws":  # the Hopper prefill in Gluon (prefill_sm90.py) where the table takes it
        from indexcache.backends.triton import prefill_sm90

        specs += prefill_sm90.compile_specs(target, prefill, heads, dim)
    if "TMA_STAGES" in decode:  # the Hopper decode in Gluon (decode_sm90.py), built wherever it runs
        from indexcache.backends.triton import decode_sm90

        specs += decode_sm90.compile_specs(target, decode, heads, dim, page, BATCH_BLOCK)
    return specs
