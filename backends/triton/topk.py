"""Top-k selection (and the fused producer step, top-k + page translation) in Triton.

A radix select that streams each row twice and never sorts it:

1. Pass A: a histogram of a coarse order-preserving key (the top ``BITS`` bits of the value rounded
   to fp16: sign, exponent and a few mantissa bits; monotone, so coarse order never contradicts the
   exact one) over the valid entries of the window. Its suffix sum gives the threshold bin ``b``:
   fewer than k entries lie above it, at least k at or above it.
2. Pass B: entries above ``b`` go straight to the output (compaction by ``tl.cumsum`` plus a running
   base); entries of bin ``b`` are appended in index order to a preallocated stash.
3. Finish: the exact 32-bit key of the ``need``-th best stash entry is radix-selected, one 8-bit digit
   a round, below the common prefix of the stash's min and max key (at most 4 rounds, none for pure
   ties); the entries above it and the first tied ones in index order are written, so the lower index
   wins ties deterministically. When bin ``b`` held more entries than the stash, the same rounds
   rescan the row instead (exact, slower).
   Slots that valid entries cannot fill get -1. When translating, the passes write raw positions (to
   ``out_raw`` when given, else to ``out``) and the finish translates the row's slots once at the end, so no
   page-table read sits in the streaming loops.

Keys: fp32 bits with negatives' magnitude bits flipped (a signed int32 order); -0.0 is made +0.0,
NaN and -inf become INT32_MIN and are never counted. bf16/fp16 scores are widened to fp32 first.

Launches: many rows run one fused kernel, a persistent grid over rows with one stash per program.
Few long rows are split into chunks fixed by the shape and the SM count (never by the data): a
histogram per chunk, a per-row plan (threshold bin, each chunk's output and stash base by chunk-order
prefix), classification per chunk, then a finishing program per row. Rows with ``len <= k`` give
``0..len-1`` then -1 without reading scores. The workspace is one int32 buffer per (device, size
bucket), allocated on first use and reused: no allocation after that, no host sync, grids from
shapes only. Calls sharing a device must not run concurrently on different streams.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from indexcache.backends.triton.support import launch_options, on_target_device
from indexcache.backends.triton.target import Target
from indexcache.backends.triton.translate import page_shift, physical
from indexcache.dispatch import OpImpl

INT_MIN = tl.constexpr(-2147483648)
INT_MAX = tl.constexpr(2147483647)
NEG_INF_BITS = tl.constexpr(-8388608)  # 0xFF800000
_MAX_COLS = 2**31 - 2**16  # int32 column arithmetic with a tile of headroom


@triton.jit
def _load(row_ptr, s1, col, m, CONTIG: tl.constexpr):
    """A tile of raw scores (-inf where masked)."""
    if CONTIG:
        x = tl.load(row_ptr + col, mask=m, other=float("-inf"))
    else:
        x = tl.load(row_ptr + col.to(tl.int64) * s1, mask=m, other=float("-inf"))
    return x


@triton.jit
def _keys(x, BITS: tl.constexpr):
    """Exact int32 keys (INT_MIN for NaN and -inf) and coarse bins of a tile of raw scores."""
    if x.dtype == tl.bfloat16:  # by its bits: exact for subnormals, which the interpreter's conversion is not
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    # Integer tests only, so a target that flushes subnormals in float compares still orders them exactly.
    bits = tl.where(bits == INT_MIN, 0, bits)  # -0.0 -> +0.0
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(((bits & 0x7FFFFFFF) > 0x7F800000) | (bits == NEG_INF_BITS), INT_MIN, key)  # NaN, -inf
    half = bits.to(tl.float32, bitcast=True).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    coarse = ((half ^ ((half >> 15) & 0x7FFF)) + 32768) >> (16 - BITS)
    return key, coarse


@triton.jit
def _load_keys(row_ptr, s1, col, m, CONTIG: tl.constexpr, BITS: tl.constexpr):
    """Exact int32 keys (INT_MIN for NaN, -inf and masked entries) and coarse bins of a tile."""
    return _keys(_load(row_ptr, s1, col, m, CONTIG), BITS)


@triton.jit
def _window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS: tl.constexpr):
    """``(start, clipped length, raw length)`` of row ``r``: the window clipped to the columns."""
    raw_len = tl.load(lengths_ptr + r * len_s0)
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + r * st_s0), 0), cols)
    else:
        start = 0
    return start, tl.minimum(tl.maximum(raw_len, 0), cols - start), raw_len


@triton.jit
def _row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B: tl.constexpr):
    """``(batch ok, page-table row pointer)`` of row ``r``."""
    if HAS_R2B:
        b = tl.load(r2b_ptr + r * r2b_s0)
    else:
        b = r
    return (b >= 0) & (b < batches), table_ptr + tl.cast(b, tl.int64) * tab_s0


@triton.jit
def _emit(out_row, o_s1, raw_row, w_s1, pos, raw, m, seq, b_ok, tab_row, tab_s1, pages, page_size,
          TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr):
    """Write window positions ``raw`` at slots ``pos`` of the row: physical slots to ``out`` when
    translating (raw ones to ``out_raw`` if given), else the raw positions."""
    if TRANSLATE:
        # The batch guard folds into the length (a scalar bool & tensor mask breaks the interpreter).
        val = physical(raw, m, tl.where(b_ok, seq, 0), tab_row, tab_s1, pages, page_size, SHIFT)
    else:
        val = raw
    tl.store(out_row + pos * o_s1, val, mask=m)
    if HAS_RAW:
        tl.store(raw_row + pos * w_s1, raw, mask=m)


@triton.jit
def _stage(out_row, o_s1, raw_row, w_s1, pos, raw, m, HAS_RAW: tl.constexpr):
    """Write window positions ``raw`` at slots ``pos``: to ``out_raw`` when given, else to ``out`` (translated
    in place by :func:`_translate` when translating), so no page-table read delays the passes."""
    if HAS_RAW:
        tl.store(raw_row + pos * w_s1, raw, mask=m)
    else:
        tl.store(out_row + pos * o_s1, raw, mask=m)


@triton.jit
def _translate(out_row, o_s1, raw_row, w_s1, n, seq, b_ok, tab_row, tab_s1, pages, page_size,
               TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr, TILE: tl.constexpr):
    """When translating: slots ``[0, n)`` staged by this program (and earlier launches) get their physical slots."""
    if TRANSLATE:
        tl.debug_barrier()  # the staged slots were written by other threads of this program
        for j0 in range(0, n, TILE):
            j = j0 + tl.arange(0, TILE)
            m = j < n
            if HAS_RAW:
                raw = tl.load(raw_row + j * w_s1, mask=m, other=-1)
            else:
                raw = tl.load(out_row + j * o_s1, mask=m, other=-1)
            # The batch guard folds into the length (a scalar bool & tensor mask breaks the interpreter).
            val = physical(raw, m, tl.where(b_ok, seq, 0), tab_row, tab_s1, pages, page_size, SHIFT)
            tl.store(out_row + j * o_s1, val, mask=m)


@triton.jit
def _fill(out_row, o_s1, raw_row, w_s1, lo, short, k, seq, b_ok, tab_row, tab_s1, pages, page_size,
          TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr, TILE: tl.constexpr):
    """Slots ``[lo, k)`` of a row: position j below ``short`` (a short row's length, else 0), then -1."""
    for j0 in range(lo // TILE * TILE, k, TILE):
        j = j0 + tl.arange(0, TILE)
        _emit(out_row, o_s1, raw_row, w_s1, j, tl.where(j < short, j, -1), (j >= lo) & (j < k), seq, b_ok, tab_row,
              tab_s1, pages, page_size, TRANSLATE, HAS_RAW, SHIFT)


@triton.jit
def _histogram(row_ptr, s1, lo, hi, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr):
    """Coarse-bin counts of the valid entries in columns ``[lo, hi)`` (pass A). The edge tiles are masked by
    the window; the whole tiles between them by a tile-aligned bound only (vector loads), each loaded while
    the one before it is counted (two tiles in flight: the pass is latency bound)."""
    t0 = lo // TILE * TILE
    t1 = hi // TILE * TILE
    col = t0 + tl.arange(0, TILE)
    key, coarse = _load_keys(row_ptr, s1, col, (col >= lo) & (col < hi), CONTIG, BITS)
    hist = tl.histogram(coarse, 1 << BITS, mask=key != INT_MIN)
    if CONTIG:  # strided rows load one tile at a time (64-bit addresses: no registers for a second tile)
        col = t0 + TILE + tl.arange(0, TILE)
        x = _load(row_ptr, s1, col, col < t1, CONTIG)
        for t in range(t0 + TILE, t1, TILE):
            nxt = t + TILE + tl.arange(0, TILE)
            x_next = _load(row_ptr, s1, nxt, nxt < t1, CONTIG)
            key, coarse = _keys(x, BITS)
            hist += tl.histogram(coarse, 1 << BITS, mask=key != INT_MIN)
            x = x_next
    else:
        for t in range(t0 + TILE, t1, TILE):
            col = t + tl.arange(0, TILE)
            key, coarse = _load_keys(row_ptr, s1, col, col < t1, CONTIG, BITS)
            hist += tl.histogram(coarse, 1 << BITS, mask=key != INT_MIN)
    if t1 > t0:
        col = t1 + tl.arange(0, TILE)
        key, coarse = _load_keys(row_ptr, s1, col, col < hi, CONTIG, BITS)
        hist += tl.histogram(coarse, 1 << BITS, mask=key != INT_MIN)
    return hist


@triton.jit
def _threshold_bin(hist, k, NB: tl.constexpr):
    """``(b, above, tied)``: the highest bin with at least k entries at or above it (-1 when the row has
    fewer than k valid entries), the count above it (< k) and the count in it."""
    at_or_above = tl.cumsum(hist, 0, reverse=True)
    b = tl.sum((at_or_above >= k).to(tl.int32), 0) - 1
    bins = tl.arange(0, NB)
    above = tl.sum(tl.where(bins > b, hist, 0), 0)
    tied = tl.sum(tl.where(bins == b, hist, 0), 0)
    return b, above, tied


@triton.jit
def _classify_tile(x, col, b, base_a, base_e, start, k, cap, stash_key, stash_idx,
                   out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size,
                   TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """One tile of pass B (raw scores ``x`` at columns ``col``, -inf where masked); returns the new bases."""
    key, coarse = _keys(x, BITS)
    valid = key != INT_MIN
    above = (valid & (coarse > b)).to(tl.int32)
    tied = (valid & (coarse == b)).to(tl.int32)
    ranks = tl.cumsum(above + (tied << 16), 0)
    slot = base_a + (ranks & 0xFFFF) - above
    entry = base_e + (ranks >> 16) - tied
    raw = col - start
    _stage(out_row, o_s1, raw_row, w_s1, slot, raw, (above != 0) & (slot < k), HAS_RAW)
    keep = (tied != 0) & (entry < cap)
    tl.store(stash_key + entry, key, mask=keep)
    tl.store(stash_idx + entry, raw, mask=keep)
    last = tl.max(ranks, 0)
    return base_a + (last & 0xFFFF), base_e + (last >> 16)


@triton.jit
def _classify(row_ptr, s1, lo, hi, start, b, base_a, base_e, k, cap, stash_key, stash_idx,
              out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size,
              TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr, CONTIG: tl.constexpr,
              BITS: tl.constexpr, TILE: tl.constexpr):
    """Pass B over columns ``[lo, hi)``: entries above bin ``b`` to output slots from ``base_a``, entries
    of bin ``b`` to stash slots from ``base_e`` (those past ``cap`` are dropped), both in index order. Tiles
    as in :func:`_histogram` (masked edges, vector loads between them, the next tile prefetched)."""
    base_a = tl.cast(base_a, tl.int32)
    base_e = tl.cast(base_e, tl.int32)
    t0 = lo // TILE * TILE
    t1 = hi // TILE * TILE
    col = t0 + tl.arange(0, TILE)
    x = _load(row_ptr, s1, col, (col >= lo) & (col < hi), CONTIG)
    base_a, base_e = _classify_tile(x, col, b, base_a, base_e, start, k, cap, stash_key, stash_idx, out_row, o_s1,
                                    raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size, TRANSLATE, HAS_RAW,
                                    SHIFT, BITS)
    if CONTIG:  # as in _histogram
        col = t0 + TILE + tl.arange(0, TILE)
        x = _load(row_ptr, s1, col, col < t1, CONTIG)
        for t in range(t0 + TILE, t1, TILE):
            col = t + tl.arange(0, TILE)
            nxt = col + TILE
            x_next = _load(row_ptr, s1, nxt, nxt < t1, CONTIG)
            base_a, base_e = _classify_tile(x, col, b, base_a, base_e, start, k, cap, stash_key, stash_idx, out_row,
                                            o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size,
                                            TRANSLATE, HAS_RAW, SHIFT, BITS)
            x = x_next
    else:
        for t in range(t0 + TILE, t1, TILE):
            col = t + tl.arange(0, TILE)
            x = _load(row_ptr, s1, col, col < t1, CONTIG)
            base_a, base_e = _classify_tile(x, col, b, base_a, base_e, start, k, cap, stash_key, stash_idx, out_row,
                                            o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size,
                                            TRANSLATE, HAS_RAW, SHIFT, BITS)
    if t1 > t0:
        col = t1 + tl.arange(0, TILE)
        x = _load(row_ptr, s1, col, col < hi, CONTIG)
        base_a, base_e = _classify_tile(x, col, b, base_a, base_e, start, k, cap, stash_key, stash_idx, out_row,
                                        o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size, TRANSLATE,
                                        HAS_RAW, SHIFT, BITS)


@triton.jit
def _source(t, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, count,
            CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr):
    """Tile ``t`` of the tie candidates: the stash, or (after a stash overflow) the row's bin-``b``
    entries. Returns keys (INT_MIN for slots that hold no candidate) and window positions, in index order."""
    pos = t + tl.arange(0, TILE)
    if from_row:
        key, coarse = _load_keys(row_ptr, s1, pos, (pos >= start) & (pos < hi), CONTIG, BITS)
        key = tl.where(coarse == b, key, INT_MIN)
        idx = pos - start
    else:
        key = tl.load(stash_key + pos, mask=pos < count, other=INT_MIN)
        idx = tl.load(stash_idx + pos, mask=pos < count, other=-1)
    return key, idx


@triton.jit
def _digit_histogram(lo, hi_mask, thr, key0, t_lo, t_hi, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx,
                     count, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr):
    """Counts of the 8-bit digit at bit ``lo`` (unsigned order) of the candidates whose bits under
    ``hi_mask`` equal ``thr``'s (the first tile is held in registers)."""
    u = key0 ^ INT_MIN
    m = (key0 != INT_MIN) & (((u ^ thr) & hi_mask) == 0)
    hist = tl.histogram((u >> lo) & 0xFF, 256, mask=m)
    for t in range(t_lo + TILE, t_hi, TILE):
        key, idx = _source(t, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, count, CONTIG, BITS, TILE)
        u = key ^ INT_MIN
        m = (key != INT_MIN) & (((u ^ thr) & hi_mask) == 0)
        hist += tl.histogram((u >> lo) & 0xFF, 256, mask=m)
    return hist


@triton.jit
def _finish(row_ptr, s1, start, length, b, above, tied, k, cap, stash_key, stash_idx,
            out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size,
            TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr, CONTIG: tl.constexpr,
            BITS: tl.constexpr, TILE: tl.constexpr):
    """Slots ``[above, above + need)`` of a long row: the best ``need`` tie candidates (exact key, then lower
    index). Returns ``above + need``, where the -1 fill starts (valid entries ran out)."""
    need = tl.minimum(k - above, tied)
    hi = start + length
    from_row = tied > cap
    t_lo = tl.where(from_row, start // TILE * TILE, 0)
    t_hi = tl.where(from_row, hi, tl.where(need > 0, tied, 0))
    key0, idx0 = _source(t_lo, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, tied, CONTIG, BITS, TILE)
    kmin = tl.min(tl.where(key0 != INT_MIN, key0, INT_MAX), 0)
    kmax = tl.max(key0, 0)
    for t in range(t_lo + TILE, t_hi, TILE):
        key, idx = _source(t, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, tied, CONTIG, BITS, TILE)
        kmin = tl.minimum(kmin, tl.min(tl.where(key != INT_MIN, key, INT_MAX), 0))
        kmax = tl.maximum(kmax, tl.max(key, 0))
    # The pivot (the need-th best key) shares the common prefix of kmin and kmax: radix-select the bits below
    # it, one 8-bit digit a round from the top, in the unsigned order (key ^ INT_MIN); digits wholly inside
    # the prefix are skipped. ``take`` ends as the number of pivot-equal candidates to keep.
    diff = kmin ^ kmax
    low = diff | (diff >> 1)
    low = low | (low >> 2)
    low = low | (low >> 4)
    low = low | (low >> 8)
    low = low | (low >> 16)
    low = tl.where(need > 0, low, 0)
    thr = (kmin ^ INT_MIN) & ~low
    take = need
    for r in range(4):
        lo = 24 - 8 * r
        if (low >> lo) != 0:
            hi_mask = (tl.cast(-(1 << (31 - 8 * r)), tl.int64) * 2).to(tl.int32)  # bits >= lo + 8; 0 when lo = 24
            hist = _digit_histogram(lo, hi_mask, thr, key0, t_lo, t_hi, from_row, row_ptr, s1,
                                    start, hi, b, stash_key, stash_idx, tied, CONTIG, BITS, TILE)
            digit, above_digit, in_digit = _threshold_bin(hist, take, 256)
            take -= above_digit
            thr = thr | (digit << lo)
    pivot = thr ^ INT_MIN
    # Candidates above the pivot all go; of those equal to it, the first ``take`` in index order.
    run_gt = 0
    run_eq = 0
    for t in range(t_lo, t_hi, TILE):
        key, idx = _source(t, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, tied, CONTIG, BITS, TILE)
        gt = (key > pivot).to(tl.int32)
        eq = (key == pivot).to(tl.int32)
        ranks = tl.cumsum(gt + (eq << 16), 0)
        n_gt = run_gt + (ranks & 0xFFFF) - gt
        n_eq = run_eq + (ranks >> 16) - eq
        slot = above + n_gt + tl.minimum(n_eq, take)
        chosen = (gt != 0) | ((eq != 0) & (n_eq < take))
        _stage(out_row, o_s1, raw_row, w_s1, slot, idx, chosen & (slot < k), HAS_RAW)
        last = tl.max(ranks, 0)
        run_gt += last & 0xFFFF
        run_eq += last >> 16
    return above + need


@triton.jit
def topk_rows_kernel(
    scores_ptr, lengths_ptr, starts_ptr, out_ptr, raw_ptr, r2b_ptr, table_ptr, stash_ptr,
    rows, cols, k, cap, batches, pages, page_size,
    s_s0, s_s1, len_s0, st_s0, o_s0, o_s1, w_s0, w_s1, r2b_s0, tab_s0, tab_s1,
    HAS_STARTS: tl.constexpr, HAS_R2B: tl.constexpr, TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr,
    SHIFT: tl.constexpr, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr,
):
    """One program per row at a time (persistent over rows), every pass fused; stash per program."""
    pid = tl.program_id(0)
    stash_key = stash_ptr + pid.to(tl.int64) * 2 * cap
    stash_idx = stash_key + cap
    for r in range(pid, rows, tl.num_programs(0)):
        start, length, seq = _window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
        b_ok, tab_row = _row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B)
        r64 = tl.cast(r, tl.int64)
        out_row = out_ptr + r64 * o_s0
        raw_row = raw_ptr + r64 * w_s0
        filled = 0
        if length > k:
            row_ptr = scores_ptr + r64 * s_s0
            hist = _histogram(row_ptr, s_s1, start, start + length, CONTIG, BITS, TILE)
            b, above, tied = _threshold_bin(hist, k, 1 << BITS)
            _classify(row_ptr, s_s1, start, start + length, start, b, 0, 0, k, cap, stash_key, stash_idx,
                      out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size,
                      TRANSLATE, HAS_RAW, SHIFT, CONTIG, BITS, TILE)
            filled = _finish(row_ptr, s_s1, start, length, b, above, tied, k, cap, stash_key, stash_idx,
                             out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size,
                             TRANSLATE, HAS_RAW, SHIFT, CONTIG, BITS, TILE)
            _translate(out_row, o_s1, raw_row, w_s1, filled, seq, b_ok, tab_row, tab_s1, pages, page_size,
                       TRANSLATE, HAS_RAW, SHIFT, TILE)
        _fill(out_row, o_s1, raw_row, w_s1, filled, tl.where(length > k, 0, length), k, seq, b_ok, tab_row, tab_s1,
              pages, page_size, TRANSLATE, HAS_RAW, SHIFT, TILE)


@triton.jit
def topk_hist_kernel(
    scores_ptr, lengths_ptr, starts_ptr, hist_ptr, cols, k, chunk, s_s0, s_s1, len_s0, st_s0,
    HAS_STARTS: tl.constexpr, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr,
):
    """Split rows, launch 1: the coarse histogram of chunk ``(r, s)`` (zeros for short rows)."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    start, length, seq = _window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
    lo = tl.maximum(start, s * chunk)
    hi = tl.minimum(start + length, s * chunk + chunk)
    hi = tl.where(length > k, hi, lo)
    hist = _histogram(scores_ptr + r.to(tl.int64) * s_s0, s_s1, lo, hi, CONTIG, BITS, TILE)
    nb = 1 << BITS
    tl.store(hist_ptr + (r.to(tl.int64) * tl.num_programs(1) + s) * nb + tl.arange(0, 1 << BITS), hist)


@triton.jit
def topk_plan_kernel(hist_ptr, plan_ptr, info_ptr, k, chunks, BITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Split rows, launch 2: the row's threshold bin, counts (``info[r] = b, above, tied``), and each
    chunk's output and stash bases by chunk-order prefix (``plan[r, s] = base_a, base_e``)."""
    r = tl.program_id(0)
    NB = 1 << BITS
    bins = tl.arange(0, 1 << BITS)
    hist_row = hist_ptr + r.to(tl.int64) * chunks * NB
    total = tl.zeros([1 << BITS], tl.int32)
    for s0 in range(0, chunks, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        total += tl.sum(tl.load(hist_row + s[:, None] * NB + bins[None, :], mask=(s < chunks)[:, None], other=0), 0)
    b, above, tied = _threshold_bin(total, k, 1 << BITS)
    run_a = 0
    run_e = 0
    plan_row = plan_ptr + r.to(tl.int64) * chunks * 2
    for s0 in range(0, chunks, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        h = tl.load(hist_row + s[:, None] * NB + bins[None, :], mask=(s < chunks)[:, None], other=0)
        a = tl.sum(tl.where(bins[None, :] > b, h, 0), 1)
        e = tl.sum(tl.where(bins[None, :] == b, h, 0), 1)
        tl.store(plan_row + s * 2, run_a + tl.cumsum(a, 0) - a, mask=s < chunks)
        tl.store(plan_row + s * 2 + 1, run_e + tl.cumsum(e, 0) - e, mask=s < chunks)
        run_a += tl.sum(a, 0)
        run_e += tl.sum(e, 0)
    info_row = info_ptr + r.to(tl.int64) * 4
    tl.store(info_row, b)
    tl.store(info_row + 1, above)
    tl.store(info_row + 2, tied)


@triton.jit
def topk_classify_kernel(
    scores_ptr, lengths_ptr, starts_ptr, out_ptr, raw_ptr, r2b_ptr, table_ptr, plan_ptr, info_ptr, stash_ptr,
    cols, k, chunk, cap, batches, pages, page_size,
    s_s0, s_s1, len_s0, st_s0, o_s0, o_s1, w_s0, w_s1, r2b_s0, tab_s0, tab_s1,
    HAS_STARTS: tl.constexpr, HAS_R2B: tl.constexpr, TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr,
    SHIFT: tl.constexpr, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr,
):
    """Split rows, launch 3: pass B over chunk ``(r, s)`` from the bases the plan gave it."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    start, length, seq = _window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
    if length > k:
        b_ok, tab_row = _row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B)
        r64 = tl.cast(r, tl.int64)
        lo = tl.maximum(start, s * chunk)
        hi = tl.minimum(start + length, s * chunk + chunk)
        plan = plan_ptr + (r64 * tl.num_programs(1) + s) * 2
        stash_key = stash_ptr + r64 * 2 * cap
        _classify(scores_ptr + r64 * s_s0, s_s1, lo, hi, start, tl.load(info_ptr + r64 * 4), tl.load(plan),
                  tl.load(plan + 1), k, cap, stash_key, stash_key + cap,
                  out_ptr + r64 * o_s0, o_s1, raw_ptr + r64 * w_s0, w_s1, seq, b_ok, tab_row, tab_s1, pages,
                  page_size, TRANSLATE, HAS_RAW, SHIFT, CONTIG, BITS, TILE)


@triton.jit
def topk_finish_kernel(
    scores_ptr, lengths_ptr, starts_ptr, out_ptr, raw_ptr, r2b_ptr, table_ptr, info_ptr, stash_ptr,
    cols, k, cap, batches, pages, page_size,
    s_s0, s_s1, len_s0, st_s0, o_s0, o_s1, w_s0, w_s1, r2b_s0, tab_s0, tab_s1,
    HAS_STARTS: tl.constexpr, HAS_R2B: tl.constexpr, TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr,
    SHIFT: tl.constexpr, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr,
):
    """Split rows, launch 4: the ties of long rows, then every row's tail (short rows: all of it)."""
    r = tl.program_id(0)
    start, length, seq = _window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
    b_ok, tab_row = _row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B)
    r64 = tl.cast(r, tl.int64)
    out_row = out_ptr + r64 * o_s0
    raw_row = raw_ptr + r64 * w_s0
    filled = 0
    if length > k:
        info = info_ptr + r64 * 4
        stash_key = stash_ptr + r64 * 2 * cap
        filled = _finish(scores_ptr + r64 * s_s0, s_s1, start, length, tl.load(info), tl.load(info + 1),
                         tl.load(info + 2), k, cap, stash_key, stash_key + cap, out_row, o_s1, raw_row, w_s1, seq,
                         b_ok, tab_row, tab_s1, pages, page_size, TRANSLATE, HAS_RAW, SHIFT, CONTIG, BITS, TILE)
        _translate(out_row, o_s1, raw_row, w_s1, filled, seq, b_ok, tab_row, tab_s1, pages, page_size,
                   TRANSLATE, HAS_RAW, SHIFT, TILE)
    _fill(out_row, o_s1, raw_row, w_s1, filled, tl.where(length > k, 0, length), k, seq, b_ok, tab_row, tab_s1, pages,
          page_size, TRANSLATE, HAS_RAW, SHIFT, TILE)


_SCRATCH: dict[tuple[torch.device, int], torch.Tensor] = {}


def _scratch(device: torch.device, numel: int) -> torch.Tensor:
    """An int32 workspace of at least ``numel`` entries, one per (device, power-of-two bucket), kept for
    the life of the process (graphs captured with it stay valid)."""
    size = triton.next_power_of_2(max(numel, 1))
    key = (device, size)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(size, dtype=torch.int32, device=device)
    return _SCRATCH[key]


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(target: Target, device: torch.device) -> int:
    """Multiprocessors (CUs on AMD) of the device; 1 when interpreted."""
    return 1 if target.interpreted else _sm_count(device.index if device.index is not None else 0)


def _options(target: Target, cfg: Mapping[str, Any]) -> dict:
    """Launch options; on NVIDIA also ``maxnreg`` (ptxas otherwise spills a few cold values on some targets
    to fit two programs an SM)."""
    opts = launch_options(target, cfg)
    if target.vendor == "cuda" and "maxnreg" in cfg:
        opts["maxnreg"] = cfg["maxnreg"]
    return opts


def _finish_shape(target: Target, cfg: Mapping[str, Any]) -> tuple[int, dict]:
    """Tile and launch options of the split path's finishing kernel (``FINISH_TILE`` values over ``FINISH_WARPS``
    warps; the pass tile and warps by default): one program a row walks the stash several times, so a wider
    tile holds a typical stash in registers and cuts the serial L2 round trips."""
    tile = cfg.get("FINISH_TILE", cfg["TILE"])
    opts = _options(target, dict(cfg, num_warps=cfg.get("FINISH_WARPS", cfg["num_warps"])))
    return tile, opts


def _plan_options(target: Target, cfg: Mapping[str, Any]) -> dict:
    """Launch options of the split path's plan kernel (``PLAN_WARPS`` warps, else the pass warps): it reads
    ``PLAN_CHUNKS`` chunk histograms a step, so a wide block takes a long row's chunks in few serial steps."""
    return _options(target, dict(cfg, num_warps=cfg.get("PLAN_WARPS", cfg["num_warps"])))


def split_chunk(rows: int, cols: int, sms: int, cfg: Mapping[str, Any]) -> int:
    """Columns per chunk when rows are split across programs, or 0 to run the fused one-program-per-row kernel.

    From the shape, the multiprocessor count and the tuning only: rows get about ``CHUNKS_PER_SM`` chunks an
    SM in all, of at least ``MIN_CHUNK`` columns (``CHUNK`` > 0 forces a chunk length)."""
    tile = cfg["TILE"]
    if cfg.get("CHUNK", 0):
        chunk = triton.cdiv(cfg["CHUNK"], tile) * tile
    else:
        per_row = triton.cdiv(sms * cfg["CHUNKS_PER_SM"], max(rows, 1))
        if per_row <= 1:
            return 0
        chunk = max(cfg["MIN_CHUNK"], triton.cdiv(triton.cdiv(cols, per_row), tile) * tile)
    return chunk if chunk < cols else 0


def stash_capacity(cols: int, k: int, cfg: Mapping[str, Any]) -> int:
    """Tie-stash entries a row: the most of ``STASH``, ``STASH_PER_K`` × k and columns >> ``STASH_COLS_SHIFT`` (a
    coarse bin holds more entries in longer rows), never more than the row holds (powers of two)."""
    width = triton.next_power_of_2(max(cols, 1))
    want = max(cfg["STASH"], cfg["STASH_PER_K"] * triton.next_power_of_2(k), width >> cfg["STASH_COLS_SHIFT"])
    return min(want, width)


def launches(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch, *, target: Target,
             cfg: Mapping[str, Any]) -> list[tuple[str, Callable[[], None]]]:
    """The kernel launches of one call, in order, as ``(name, launch)``: one fused launch, or the four of the
    split path. Arguments as :func:`topk_translate` (``page_table`` None for plain top-k); the workspace
    is taken here, so launching needs no allocation (and a benchmark can time each launch alone)."""
    rows, cols = scores.shape
    if rows == 0 or k == 0:
        return []
    device = scores.device
    tile, bits, cap = cfg["TILE"], cfg["BITS"], stash_capacity(cols, k, cfg)
    translate = page_table is not None
    table = page_table if translate else out
    r2b = row_to_batch if row_to_batch is not None else lengths
    starts = row_starts if row_starts is not None else lengths
    raw = out_raw if out_raw is not None else out
    opts = _options(target, cfg)
    fin_tile, fin_opts = _finish_shape(target, cfg)
    plan_opts = _plan_options(target, cfg)
    scan = dict(s_s0=scores.stride(0), s_s1=scores.stride(1), len_s0=lengths.stride(0), st_s0=starts.stride(0),
                HAS_STARTS=row_starts is not None, CONTIG=scores.stride(1) == 1, BITS=bits, TILE=tile, **opts)
    common = dict(
        o_s0=out.stride(0), o_s1=out.stride(1), w_s0=raw.stride(0), w_s1=raw.stride(1), r2b_s0=r2b.stride(0),
        tab_s0=table.stride(0), tab_s1=table.stride(1), HAS_R2B=row_to_batch is not None, TRANSLATE=translate,
        HAS_RAW=out_raw is not None, SHIFT=page_shift(page_size) if translate else 0,
        batches=table.shape[0] if translate else 0, pages=table.shape[1] if translate else 0,
        page_size=page_size if translate else 1, **scan,
    )
    sms = _sms(target, device)
    chunk = split_chunk(rows, cols, sms, cfg)
    if not chunk:
        programs = min(rows, sms * cfg["PROGRAMS_PER_SM"])
        stash = _scratch(device, programs * 2 * cap)
        return [("rows", lambda: topk_rows_kernel[(programs,)](
            scores, lengths, starts, out, raw, r2b, table, stash, rows, cols, k, cap, **common))]
    chunks = triton.cdiv(cols, chunk)
    hist_n, plan_n, info_n = rows * chunks * (1 << bits), rows * chunks * 2, rows * 4
    ws = _scratch(device, hist_n + plan_n + info_n + rows * 2 * cap)
    hist, plan = ws[:hist_n], ws[hist_n:hist_n + plan_n]
    info, stash = ws[hist_n + plan_n:hist_n + plan_n + info_n], ws[hist_n + plan_n + info_n:]
    return [
        ("hist", lambda: topk_hist_kernel[(rows, chunks)](scores, lengths, starts, hist, cols, k, chunk, **scan)),
        ("plan", lambda: topk_plan_kernel[(rows,)](hist, plan, info, k, chunks, BITS=bits,
                                                   BLOCK_S=cfg["PLAN_CHUNKS"], **plan_opts)),
        ("classify", lambda: topk_classify_kernel[(rows, chunks)](
            scores, lengths, starts, out, raw, r2b, table, plan, info, stash, cols, k, chunk, cap, **common)),
        ("finish", lambda: topk_finish_kernel[(rows,)](
            scores, lengths, starts, out, raw, r2b, table, info, stash, cols, k, cap,
            **dict(common, TILE=fin_tile, **fin_opts))),
    ]


def _select(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch, *,
            target: Target, cfg: Mapping[str, Any]):
    for _, launch in launches(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch,
                              target=target, cfg=cfg):
        launch()
    return out


def topk(scores, lengths, k, row_starts, out, sorted, *, target: Target, cfg: Mapping[str, Any]):
    """Fill ``out [R, k]`` int32 (contract: ``indexcache.topk``; ``sorted`` must be False)."""
    return _select(scores, lengths, k, row_starts, out, None, None, 1, None, target=target, cfg=cfg)


def topk_translate(scores, lengths, k, page_table, page_size, row_starts, row_to_batch, out, out_raw, sorted, *,
                   target: Target, cfg: Mapping[str, Any]):
    """Fill ``out [R, k]`` with physical slots and ``out_raw`` (when given) with the raw window positions
    (contract: ``indexcache.topk_translate``; ``sorted`` must be False)."""
    return _select(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch,
                   target=target, cfg=cfg)


def _supports(target: Target, scores, sorted, **tensors) -> tuple[bool, str]:
    if sorted:
        return False, "sorted=True is not implemented by the Triton top-k"
    if scores.shape[1] > _MAX_COLS:
        return False, f"rows longer than {_MAX_COLS} columns are not supported by the Triton top-k"
    return on_target_device(target, scores=scores, **tensors)


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """The topk and topk_translate ops of a GPU backend built for ``target`` with its tuning table."""
    cfg = tuning["topk"]

    def supports_topk(scores, lengths, row_starts, out, sorted, **_):
        return _supports(target, scores, sorted, lengths=lengths, row_starts=row_starts, out=out)

    def supports_translate(scores, lengths, row_starts, out, sorted, page_table, row_to_batch, out_raw, **_):
        return _supports(target, scores, sorted, lengths=lengths, row_starts=row_starts, out=out,
                         page_table=page_table, row_to_batch=row_to_batch, out_raw=out_raw)

    def run_topk(**args):
        return topk(**args, target=target, cfg=cfg)

    def run_translate(**args):
        return topk_translate(**args, target=target, cfg=cfg)

    return {"topk": OpImpl(run_topk, supports_topk), "topk_translate": OpImpl(run_translate, supports_translate)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What the top-k kernels build for ``target`` (cross-compile check), with the table's tile and histogram:
    plain fp32 topk; the producer step on bf16 with every option (row_starts, row_to_batch, out_raw, shift
    path); fp16 strided scores with row_starts and a non-power-of-two page size. Unit strides of the index
    tensors are specialised to constants, as a launch does."""
    from indexcache.backends.triton.crosscompile import KernelSpec, pointer

    cfg = tuning["topk"]
    opts = _options(target, cfg)
    fin_tile, fin_opts = _finish_shape(target, cfg)
    shape = {"BITS": cfg["BITS"], "TILE": cfg["TILE"]}
    unit = {"len_s0": 1, "st_s0": 1, "o_s1": 1, "w_s1": 1, "r2b_s0": 1, "tab_s1": 1}
    aligned = ("s_s0", "o_s0", "w_s0", "tab_s0")
    variants = (  # dtype, HAS_STARTS, HAS_R2B, TRANSLATE, HAS_RAW, SHIFT, CONTIG
        (torch.float32, False, False, False, False, 0, True),
        (torch.bfloat16, True, True, True, True, page_shift(64), True),
        (torch.float16, True, False, True, False, -1, False),
    )
    index_ptrs = {name: "*i32" for name in ("lengths_ptr", "starts_ptr", "out_ptr", "raw_ptr", "r2b_ptr", "table_ptr",
                                            "stash_ptr", "hist_ptr", "plan_ptr", "info_ptr")}
    specs = []
    for dtype, starts, r2b, translate, has_raw, shift, contig in variants:
        ptrs = {**index_ptrs, "scores_ptr": pointer(dtype)}
        flags = {"HAS_STARTS": starts, "CONTIG": contig, **shape, **({"s_s1": 1} if contig else {})}
        full = {**flags, "HAS_R2B": r2b, "TRANSLATE": translate, "HAS_RAW": has_raw, "SHIFT": shift, **unit}
        op = "topk_translate" if translate else "topk"
        specs.append(KernelSpec(op, topk_hist_kernel, ptrs, {**flags, "len_s0": 1, "st_s0": 1}, opts,
                                aligned=("s_s0",)))
        for kernel in (topk_rows_kernel, topk_classify_kernel):
            specs.append(KernelSpec(op, kernel, ptrs, full, opts, aligned=aligned))
        specs.append(KernelSpec(op, topk_finish_kernel, ptrs, dict(full, TILE=fin_tile), fin_opts, aligned=aligned))
    specs.append(KernelSpec("topk", topk_plan_kernel, index_ptrs, {"BITS": cfg["BITS"], "BLOCK_S": cfg["PLAN_CHUNKS"]},
                            _plan_options(target, cfg)))
    return specs
