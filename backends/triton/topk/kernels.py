"""The Triton kernels of the top-k (:mod:`indexcache.backends.triton.topk` describes the algorithm): the device
helpers, the fused many-rows kernel, the split rows' sample, filter and finish kernels and the sort of
``sorted=True``. Their launches are planned in :mod:`~indexcache.backends.triton.topk.plan`."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from indexcache.backends.triton.rows import (
    INT_MAX,
    INT_MIN,
    KEY_MIN_VALID,
    below_common_prefix,
    emit,
    load,
    order_key,
    row_batch,
    sample_positions,
    score_bits,
    window,
)
from indexcache.backends.triton.translate import physical

INT64_MIN = tl.constexpr(-9223372036854775808)
KEY_INF = tl.constexpr(2139095040)  # the key of +inf (0x7F800000); +NaN keys lie above it
MAX_COLS = 2**31 - 2**16  # int32 column arithmetic with a tile of headroom
MAX_SORTED_K = 4096  # sorted=True: a row's k int64 keys sorted in registers (8 a thread over 16 warps of 32)


@triton.jit
def _load_ahead(row_ptr, s1, col, lo, hi, CONTIG: tl.constexpr):
    """A step of raw scores at columns ``col`` (-inf outside ``[lo, hi)``)."""
    return load(row_ptr, s1, col, (col >= lo) & (col < hi), CONTIG)


@triton.jit
def _keys(x, BITS: tl.constexpr):
    """Exact int32 keys (INT_MIN for NaN and -inf) and coarse bins of a tile of raw scores."""
    bits = score_bits(x)
    key = order_key(bits)
    bits = tl.where(bits == INT_MIN, 0, bits)  # -0.0 -> +0.0: one coarse bin for both
    half = bits.to(tl.float32, bitcast=True).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    coarse = ((half ^ ((half >> 15) & 0x7FFF)) + 32768) >> (16 - BITS)
    return key, coarse


@triton.jit
def _load_keys(row_ptr, s1, col, m, CONTIG: tl.constexpr, BITS: tl.constexpr):
    """Exact int32 keys (INT_MIN for NaN, -inf and masked entries) and coarse bins of a tile."""
    return _keys(load(row_ptr, s1, col, m, CONTIG), BITS)


@triton.jit
def _stage(out_row, o_s1, raw_row, w_s1, pos, raw, m, HAS_RAW: tl.constexpr):
    """Write window positions ``raw`` at slots ``pos``: to ``out_raw`` when given, else to ``out`` (translated
    in place by :func:`_translate` when translating), so no page-table read delays the passes."""
    if HAS_RAW:
        tl.store(raw_row + pos.to(tl.int64) * w_s1, raw, mask=m)
    else:
        tl.store(out_row + pos.to(tl.int64) * o_s1, raw, mask=m)


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
                raw = tl.load(raw_row + j.to(tl.int64) * w_s1, mask=m, other=-1)
            else:
                raw = tl.load(out_row + j.to(tl.int64) * o_s1, mask=m, other=-1)
            # The batch guard folds into the length (a scalar bool & tensor mask breaks the interpreter).
            val = physical(raw, m, tl.where(b_ok, seq, 0), tab_row, tab_s1, pages, page_size, SHIFT)
            tl.store(out_row + j.to(tl.int64) * o_s1, val, mask=m)


@triton.jit
def _fill(out_row, o_s1, raw_row, w_s1, lo, short, k, seq, b_ok, tab_row, tab_s1, pages, page_size,
          TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr, TILE: tl.constexpr):
    """Slots ``[lo, k)`` of a row: position j below ``short`` (a short row's length, else 0), then -1."""
    for j0 in range(lo // TILE * TILE, k, TILE):
        j = j0 + tl.arange(0, TILE)
        emit(out_row, o_s1, raw_row, w_s1, j, tl.where(j < short, j, -1), (j >= lo) & (j < k), seq, b_ok, tab_row,
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
        x = load(row_ptr, s1, col, col < t1, CONTIG)
        for t in range(t0 + TILE, t1, TILE):
            nxt = t + TILE + tl.arange(0, TILE)
            x_next = load(row_ptr, s1, nxt, nxt < t1, CONTIG)
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
def _sample_floor(row_ptr, s1, start, length, k, CONTIG: tl.constexpr, SAMPLES: tl.constexpr, DIGIT: tl.constexpr,
                  ROUNDS: tl.constexpr):
    """``(floor, best)``: the filter threshold of a row (``length > 0``), as a key at or below the ``m``-th best
    of ``SAMPLES`` entries spread evenly over the window, ``m = λ + 4·√λ + 2`` with ``λ = SAMPLES·k/length`` the
    sample entries expected at or above the k-th best (so it lies below the k-th best unless the sample is off by
    more than four standard deviations): the ``m``-th best sample key itself, radix-selected over the sample held
    in registers (the lowest valid key when fewer than ``m`` are valid); with ``ROUNDS`` > 0 the select stops after
    that many rounds below the sample's common prefix, and the floor is the bottom of the bin they settled (at most
    ``2 ** -(DIGIT·ROUNDS - 9)`` of an octave below that key: a few more candidates, fewer rounds). -0.0 and +0.0
    stay tied: a threshold of +0.0 is lowered to take -0.0 in too. ``best``: the sample's largest key."""
    i = tl.arange(0, SAMPLES)
    pos = sample_positions(i, start, length, SAMPLES)
    key, coarse = _load_keys(row_ptr, s1, pos, i < SAMPLES, CONTIG, 8)
    valid = tl.sum((key != INT_MIN).to(tl.int32), 0)
    lam = (k * 1.0) * SAMPLES / length.to(tl.float32)  # k may arrive as a constexpr (Triton specialises 1)
    m = (lam + 4.0 * tl.sqrt(lam) + 3.0).to(tl.int32)  # >= ceil(λ + 4√λ + 2)
    thr, fixed, take, matched = _pivot(key, pos, tl.minimum(m, valid), valid, 0, 0, False, row_ptr, s1, start, 0, 0,
                                       row_ptr, row_ptr, 0, 0, 0, CONTIG, 8, SAMPLES, DIGIT, True, ROUNDS)
    floor = tl.where(valid >= m, thr ^ INT_MIN, KEY_MIN_VALID)
    if ROUNDS > 0:  # a bin's bottom after fewer than two rounds may lie below every finite key: never -inf's or NaN's
        floor = tl.maximum(floor, KEY_MIN_VALID)
    return tl.where(floor == 0, -1, floor), tl.max(key, 0)


@triton.jit
def _bin_shift(floor, best, BINS: tl.constexpr):
    """The fewest low key bits to drop so that ``BINS`` bins from ``floor`` reach the key ``best`` (:func:`_bin`),
    at most 31: a span below 2^32 needs no more from 2 bins on, and :func:`_bin`'s shift of a 32-bit distance must
    stay below 32 (one bin, the last, takes every key whatever the shift)."""
    span = tl.maximum(best.to(tl.int64) - floor.to(tl.int64), 0)
    shift = tl.zeros_like(floor)
    for _ in tl.static_range(31):
        shift += ((span >> shift.to(tl.int64)) >= BINS).to(tl.int32)
    return shift


@triton.jit
def _bin(key, floor, shift, BINS: tl.constexpr):
    """The bin of candidate keys (``>= floor``, -0.0 as +0.0): their distance above ``floor`` with the low
    ``shift`` bits dropped, the last bin taking every key beyond."""
    return tl.minimum((key - floor).to(tl.uint32, bitcast=True) >> shift.to(tl.uint32), BINS - 1).to(tl.int32)


@triton.jit
def _filter_tile(x, col, floor, base, start, cap, stash_key, stash_idx, STORE_KEY: tl.constexpr):
    """One tile of the filter: valid entries with key ``>= floor`` to stash slots from ``base`` (those past
    ``cap`` are dropped), in index order; returns the new base. The stash key is the raw order key (-0.0
    as -1; :func:`_source` makes it +0.0)."""
    key = score_bits(x)
    key = key ^ ((key >> 31) & 0x7FFFFFFF)
    cand = ((key >= floor) & (key <= KEY_INF)).to(tl.int32)  # floor > the key of -inf: NaN, -inf never pass
    ranks = tl.cumsum(cand, 0)
    entry = base + ranks - cand
    keep = (cand != 0) & (entry < cap)
    if STORE_KEY:
        tl.store(stash_key + entry, key, mask=keep)
    tl.store(stash_idx + entry, col - start, mask=keep)
    return base + tl.max(ranks, 0)


@triton.jit
def _filter(row_ptr, s1, lo, hi, start, floor, cap, stash_key, stash_idx,
            STORE_KEY: tl.constexpr, CONTIG: tl.constexpr, TILE: tl.constexpr):
    """The filter over columns ``[lo, hi)``: window positions of the valid entries ``>= floor`` to
    ``stash_idx`` (keys to ``stash_key`` when ``STORE_KEY``) from slot 0, in index order, at most ``cap``;
    returns how many there were (all of them, also past ``cap``). Tiles as in :func:`_histogram`."""
    t0 = lo // TILE * TILE
    t1 = hi // TILE * TILE
    col = t0 + tl.arange(0, TILE)
    x = load(row_ptr, s1, col, (col >= lo) & (col < hi), CONTIG)
    count = _filter_tile(x, col, floor, 0, start, cap, stash_key, stash_idx, STORE_KEY)
    if CONTIG:  # as in _histogram
        col = t0 + TILE + tl.arange(0, TILE)
        x = load(row_ptr, s1, col, col < t1, CONTIG)
        for t in range(t0 + TILE, t1, TILE):
            col = t + tl.arange(0, TILE)
            nxt = col + TILE
            x_next = load(row_ptr, s1, nxt, nxt < t1, CONTIG)
            count = _filter_tile(x, col, floor, count, start, cap, stash_key, stash_idx, STORE_KEY)
            x = x_next
    else:
        for t in range(t0 + TILE, t1, TILE):
            col = t + tl.arange(0, TILE)
            x = load(row_ptr, s1, col, col < t1, CONTIG)
            count = _filter_tile(x, col, floor, count, start, cap, stash_key, stash_idx, STORE_KEY)
    if t1 > t0:
        col = t1 + tl.arange(0, TILE)
        x = load(row_ptr, s1, col, col < hi, CONTIG)
        count = _filter_tile(x, col, floor, count, start, cap, stash_key, stash_idx, STORE_KEY)
    return count


@triton.jit
def _classify_tile(x, col, b, base_a, base_e, start, k, cap, stash_key, stash_idx,
                   out_row, o_s1, raw_row, w_s1, HAS_RAW: tl.constexpr, BITS: tl.constexpr):
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
def _classify(row_ptr, s1, lo, hi, start, b, k, cap, stash_key, stash_idx, out_row, o_s1, raw_row, w_s1,
              HAS_RAW: tl.constexpr, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr):
    """Pass B over columns ``[lo, hi)``: entries above bin ``b`` to output slots from 0, entries of bin ``b``
    to stash slots from 0 (those past ``cap`` are dropped), both in index order. Tiles as in
    :func:`_histogram` (masked edges, vector loads between them, the next tile prefetched)."""
    t0 = lo // TILE * TILE
    t1 = hi // TILE * TILE
    col = t0 + tl.arange(0, TILE)
    x = load(row_ptr, s1, col, (col >= lo) & (col < hi), CONTIG)
    base_a, base_e = _classify_tile(x, col, b, 0, 0, start, k, cap, stash_key, stash_idx, out_row, o_s1, raw_row,
                                    w_s1, HAS_RAW, BITS)
    if CONTIG:  # as in _histogram
        col = t0 + TILE + tl.arange(0, TILE)
        x = load(row_ptr, s1, col, col < t1, CONTIG)
        for t in range(t0 + TILE, t1, TILE):
            col = t + tl.arange(0, TILE)
            nxt = col + TILE
            x_next = load(row_ptr, s1, nxt, nxt < t1, CONTIG)
            base_a, base_e = _classify_tile(x, col, b, base_a, base_e, start, k, cap, stash_key, stash_idx, out_row,
                                            o_s1, raw_row, w_s1, HAS_RAW, BITS)
            x = x_next
    else:
        for t in range(t0 + TILE, t1, TILE):
            col = t + tl.arange(0, TILE)
            x = load(row_ptr, s1, col, col < t1, CONTIG)
            base_a, base_e = _classify_tile(x, col, b, base_a, base_e, start, k, cap, stash_key, stash_idx, out_row,
                                            o_s1, raw_row, w_s1, HAS_RAW, BITS)
    if t1 > t0:
        col = t1 + tl.arange(0, TILE)
        x = load(row_ptr, s1, col, col < hi, CONTIG)
        _classify_tile(x, col, b, base_a, base_e, start, k, cap, stash_key, stash_idx, out_row, o_s1, raw_row, w_s1,
                       HAS_RAW, BITS)


@triton.jit
def _source(t, from_row: tl.constexpr, row_ptr, s1, start, hi, b, stash_key, stash_idx, count,
            CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr):
    """Tile ``t`` of the candidates: the stash, or (after a stash overflow) the row's bin-``b`` entries.
    Returns keys (INT_MIN for slots that hold no candidate) and window positions, in index order."""
    pos = t + tl.arange(0, TILE)
    if from_row:
        key, coarse = _load_keys(row_ptr, s1, pos, (pos >= start) & (pos < hi), CONTIG, BITS)
        key = tl.where(coarse == b, key, INT_MIN)
        idx = pos - start
    else:
        key = tl.load(stash_key + pos, mask=pos < count, other=INT_MIN)
        key = tl.where(key == -1, 0, key)  # -0.0 as the filter stores it -> +0.0
        idx = tl.load(stash_idx + pos, mask=pos < count, other=-1)
    return key, idx


@triton.jit
def _select_key(key, idx, MODE: tl.constexpr, pk, pf):
    """The order a round selects in: the score key (``MODE`` 0), or (``MODE`` 1) the position reversed
    (``INT_MAX - position``: the lower position ranks higher) of the candidates whose key, under the settled bits
    ``pf``, equals the pivot ``pk``; INT_MIN for every other slot."""
    if MODE == 1:
        settled = ((key ^ INT_MIN) & pf) ^ INT_MIN
        key = tl.where((key != INT_MIN) & (settled == pk), idx ^ INT_MAX, INT_MIN)
    return key


@triton.jit
def _digit_histogram(lo, fixed, thr, key0, t_lo, t_hi, from_row: tl.constexpr, row_ptr, s1, start, hi, b,
                     stash_key, stash_idx, count, MODE: tl.constexpr, pk, pf, CONTIG: tl.constexpr,
                     BITS: tl.constexpr, TILE: tl.constexpr, DIGIT: tl.constexpr, ONE_TILE: tl.constexpr):
    """Counts of the ``DIGIT``-bit digit at bit ``lo`` (unsigned order) of the candidates whose bits under
    ``fixed`` equal ``thr``'s (the first tile's select keys are held in registers)."""
    u = key0 ^ INT_MIN
    m = (key0 != INT_MIN) & (((u ^ thr) & fixed) == 0)
    hist = tl.histogram((u >> lo) & ((1 << DIGIT) - 1), 1 << DIGIT, mask=m)
    if not ONE_TILE:
        for t in range(t_lo + TILE, t_hi, TILE):
            key, idx = _source(t, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, count, CONTIG, BITS,
                               TILE)
            key = _select_key(key, idx, MODE, pk, pf)
            u = key ^ INT_MIN
            m = (key != INT_MIN) & (((u ^ thr) & fixed) == 0)
            hist += tl.histogram((u >> lo) & ((1 << DIGIT) - 1), 1 << DIGIT, mask=m)
    return hist


@triton.jit
def _min_max(key):
    """The smallest valid key (INT_MAX when none) and the largest key of a tile."""
    return tl.min(tl.where(key != INT_MIN, key, INT_MAX), 0), tl.max(key, 0)


@triton.jit
def _pivot(key0, idx0, need, count, t_lo, t_hi, from_row: tl.constexpr, row_ptr, s1, start, hi, b, stash_key, stash_idx,
           MODE: tl.constexpr, pk, pf, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr,
           DIGIT: tl.constexpr, ONE_TILE: tl.constexpr, ROUNDS: tl.constexpr):
    """Radix select of the ``need``-th best select key (:func:`_select_key`) of the candidates: returns ``(thr,
    fixed, take, matched)``, the pivot's settled bits (unsigned order) and which bits are settled, how many
    candidates equal to the pivot under them are still needed, and how many there are (``take == matched``
    unless the select keys tie on every bit). The pivot shares the common prefix of the smallest and largest
    key, so the rounds, one ``DIGIT``-bit digit a round from the top, start below it; once the pivot's digit
    holds exactly the ``take`` candidates still needed, the rest are too. The last round overlaps bits already
    settled when DIGIT does not divide 32 (those bits match by construction). ``ONE_TILE``: the candidates are the
    first tile alone (no memory is read; the stash arguments are not used). ``ROUNDS`` > 0: at most that many
    rounds; the bits they leave unsettled are zero in ``thr`` (so ``take`` and ``matched`` are then not final)."""
    key0 = _select_key(key0, idx0, MODE, pk, pf)
    kmin, kmax = _min_max(key0)
    if not ONE_TILE:
        for t in range(t_lo + TILE, t_hi, TILE):
            key, idx = _source(t, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, count, CONTIG, BITS,
                               TILE)
            key = _select_key(key, idx, MODE, pk, pf)
            t_min, t_max = _min_max(key)
            kmin = tl.minimum(kmin, t_min)
            kmax = tl.maximum(kmax, t_max)
    low = tl.where(need > 0, below_common_prefix(kmin, kmax), 0)
    fixed = ~low
    thr = (kmin ^ INT_MIN) & fixed
    take = need
    matched = count
    done = (need <= 0).to(tl.int32)
    rounds = need * 0
    for r in range((32 + DIGIT - 1) // DIGIT):  # a loop, not unrolled: one copy of the round's code
        lo = tl.maximum(32 - DIGIT * (r + 1), 0)
        if (((~fixed) >> lo) != 0) & (done == 0):
            hist = _digit_histogram(lo, fixed, thr, key0, t_lo, t_hi, from_row, row_ptr, s1, start, hi, b, stash_key,
                                    stash_idx, count, MODE, pk, pf, CONTIG, BITS, TILE, DIGIT, ONE_TILE)
            digit, above_digit, in_digit = _threshold_bin(hist, take, 1 << DIGIT)
            take -= above_digit
            matched = in_digit
            thr = thr | (digit << lo)
            fixed = fixed | (tl.full((), (1 << DIGIT) - 1, tl.int32) << lo)
            done = (in_digit == take).to(tl.int32)  # the whole digit goes: no lower bit matters
            if ROUNDS > 0:
                rounds += 1
                done = done | (rounds >= ROUNDS).to(tl.int32)
    return thr, fixed, take, tl.where(need > 0, matched, 0)


@triton.jit
def _finish(row_ptr, s1, start, length, b, above, tied, k, cap, stash_key, stash_idx,
            out_row, o_s1, raw_row, w_s1, HAS_RAW: tl.constexpr, CONTIG: tl.constexpr, BITS: tl.constexpr,
            TILE: tl.constexpr, DIGIT: tl.constexpr, FROM_ROW: tl.constexpr):
    """Slots ``[above, above + need)`` of a long row: the best ``need`` of ``tied`` candidates (exact key, then
    lower position), from the stash, or (``FROM_ROW``: ``tied > cap``, the stash overflowed) from the row's
    bin-``b`` entries. Returns ``above + need``, where the -1 fill starts (valid entries ran out). (``FROM_ROW`` is
    a constant so that the stash path carries none of the rescan's code.)"""
    need = tl.minimum(k - above, tied)
    hi = start + length
    from_row: tl.constexpr = FROM_ROW
    if FROM_ROW:
        t_lo = start // TILE * TILE
        t_hi = hi
    else:
        t_lo = 0
        t_hi = tl.where(need > 0, tied, 0)
    key0, idx0 = _source(t_lo, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, tied, CONTIG, BITS, TILE)
    thr, fixed, take, matched = _pivot(key0, idx0, need, tied, t_lo, t_hi, from_row, row_ptr, s1, start, hi, b,
                                       stash_key, stash_idx, 0, 0, 0, CONTIG, BITS, TILE, DIGIT, False, 0)
    pivot = thr ^ INT_MIN
    # Candidates equal to the pivot on every bit (ties) beyond those needed: the lower positions win, so a second
    # select over the tied candidates' positions settles which (the stash is not in index order). Without ties
    # it sees no candidate (need 0, the first tile only) and every tied candidate stays in the pivot's class.
    tie = matched > take
    thr2, fixed2, take2, _ = _pivot(key0, idx0, tl.where(tie, take, 0), tied, t_lo, tl.where(tie, t_hi, t_lo),
                                    from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, 1, pivot, fixed,
                                    CONTIG, BITS, TILE, DIGIT, False, 0)
    pivot2 = tl.where(tie, thr2 ^ INT_MIN, INT_MIN)
    fixed2 = tl.where(tie, fixed2, 0)
    take2 = tl.where(tie, take2, take)
    # Candidates that beat the pivot (first on the key, then on the reversed position among key ties) all go; of
    # those equal to it on both, the first ``take2`` in stash order. (Unsettled bits are cleared before comparing,
    # in the signed order of the keys.)
    run_gt = 0
    run_eq = 0
    for t in range(t_lo, t_hi, TILE):
        key, idx = _source(t, from_row, row_ptr, s1, start, hi, b, stash_key, stash_idx, tied, CONTIG, BITS, TILE)
        settled = ((key ^ INT_MIN) & fixed) ^ INT_MIN
        key2 = _select_key(key, idx, 1, pivot, fixed)  # INT_MIN unless tied with the pivot
        settled2 = ((key2 ^ INT_MIN) & fixed2) ^ INT_MIN
        gt = (((key != INT_MIN) & (settled > pivot)) | ((key2 != INT_MIN) & (settled2 > pivot2))).to(tl.int32)
        eq = ((key2 != INT_MIN) & (settled2 == pivot2)).to(tl.int32)
        ranks = tl.cumsum(gt + (eq << 16), 0)
        n_gt = run_gt + (ranks & 0xFFFF) - gt
        n_eq = run_eq + (ranks >> 16) - eq
        slot = above + n_gt + tl.minimum(n_eq, take2)
        chosen = (gt != 0) | ((eq != 0) & (n_eq < take2))
        _stage(out_row, o_s1, raw_row, w_s1, slot, idx, chosen & (slot < k), HAS_RAW)
        last = tl.max(ranks, 0)
        run_gt += last & 0xFFFF
        run_eq += last >> 16
    return above + need


@triton.jit
def _fallback(row_ptr, s1, start, length, k, cap, stash_key, stash_idx,
              out_row, o_s1, raw_row, w_s1, HAS_RAW: tl.constexpr, CONTIG: tl.constexpr,
              BITS: tl.constexpr, TILE: tl.constexpr):
    """The exact path of a long row whose filter missed: a histogram of the whole window, its threshold bin
    ``b``, entries above it to the output and its entries to the stash. Returns ``(b, above, tied)`` for
    :func:`_finish`."""
    hist = _histogram(row_ptr, s1, start, start + length, CONTIG, BITS, TILE)
    b, above, tied = _threshold_bin(hist, k, 1 << BITS)
    _classify(row_ptr, s1, start, start + length, start, b, k, cap, stash_key, stash_idx, out_row, o_s1, raw_row, w_s1,
              HAS_RAW, CONTIG, BITS, TILE)
    return b, above, tied


# What varies per call takes no part in a kernel's variant (docs/kernels.md, "Kernel variants"): the row and column
# counts, the stash's size, the chunks a row, the page table's shape and row stride; nor the alignment of the index
# tensors (read an entry at a time) and of the workspace's pieces (views at offsets that follow the shape). The
# scores' row stride is left to every kernel. The split rows' kernels (sample, filter, finish) keep the scores' row
# stride and their workspace pieces' alignment too (every piece 64-byte aligned: plan._plan): without them, on the
# H200 (Triton 3.6), one row of 128K took 31.0 µs against 27.3 and one of 1M 47.2 against 41.0.
_PER_CALL = ("rows", "row0", "cols", "cap", "chunks", "batches", "pages", "tab_s0")
_INDEX = ("lengths_ptr", "starts_ptr", "r2b_ptr", "table_ptr")
_UNALIGNED = (*_INDEX, "stash_ptr", "counts_ptr", "hist_ptr", "region_ptr")  # the fused and sort kernels


@triton.jit(do_not_specialize=_PER_CALL, do_not_specialize_on_alignment=_UNALIGNED)
def topk_rows_kernel(
    scores_ptr, lengths_ptr, starts_ptr, out_ptr, raw_ptr, r2b_ptr, table_ptr, stash_ptr, counts_ptr,
    rows, cols, k, cap, batches, pages, page_size,
    s_s0, s_s1, len_s0, st_s0, o_s0, o_s1, w_s0, w_s1, r2b_s0, tab_s0, tab_s1,
    HAS_STARTS: tl.constexpr, HAS_R2B: tl.constexpr, TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr,
    SHIFT: tl.constexpr, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr, DIGIT: tl.constexpr,
    SAMPLES: tl.constexpr,
):
    """Many rows, launch 1: one program per row at a time (persistent over rows) samples, filters into the
    program's stash and, when ``k <= C <= cap``, finishes, translates and fills the row (short rows: fills),
    marking it done (``counts[r] = -1``); otherwise ``counts[r] = C`` leaves it to the finishing launch."""
    pid = tl.program_id(0)
    stash_key = stash_ptr + pid.to(tl.int64) * 2 * cap
    stash_idx = stash_key + cap
    for r in range(pid, rows, tl.num_programs(0)):
        start, length, seq = window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
        r64 = tl.cast(r, tl.int64)
        out_row = out_ptr + r64 * o_s0
        raw_row = raw_ptr + r64 * w_s0
        row_ptr = scores_ptr + r64 * s_s0
        count = tl.zeros_like(length) - 1
        if length > k:
            floor, _ = _sample_floor(row_ptr, s_s1, start, length, k, CONTIG, SAMPLES, DIGIT, 0)
            count = _filter(row_ptr, s_s1, start, start + length, start, floor, cap, stash_key, stash_idx,
                            True, CONTIG, TILE)
        if (length <= k) | ((count >= k) & (count <= cap)):
            filled = 0
            if length > k:
                tl.debug_barrier()  # the stash was written by other threads of this program
                filled = _finish(row_ptr, s_s1, start, length, -1, 0, count, k, cap, stash_key, stash_idx,
                                 out_row, o_s1, raw_row, w_s1, HAS_RAW, CONTIG, BITS, TILE, DIGIT, False)
            b_ok, tab_row = row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B)
            if length > k:
                _translate(out_row, o_s1, raw_row, w_s1, filled, seq, b_ok, tab_row, tab_s1, pages, page_size,
                           TRANSLATE, HAS_RAW, SHIFT, TILE)
            _fill(out_row, o_s1, raw_row, w_s1, filled, tl.where(length > k, 0, length), k, seq, b_ok, tab_row,
                  tab_s1, pages, page_size, TRANSLATE, HAS_RAW, SHIFT, TILE)
            count = tl.zeros_like(length) - 1
        tl.store(counts_ptr + r, count)
        tl.debug_barrier()  # the next row reuses the stash


@triton.jit(do_not_specialize=_PER_CALL, do_not_specialize_on_alignment=_INDEX)
def topk_sample_kernel(
    scores_ptr, lengths_ptr, starts_ptr, hist_ptr, cols, k, s_s0, s_s1, len_s0, st_s0,
    HAS_STARTS: tl.constexpr, CONTIG: tl.constexpr, SAMPLES: tl.constexpr, DIGIT: tl.constexpr, BINS: tl.constexpr,
    COUNTS: tl.constexpr, PDL: tl.constexpr, ROUNDS: tl.constexpr,
):
    """Row ``r``'s record in ``hist``: with ``COUNTS`` (split rows, launch 1) ``BINS + 2`` entries, the candidates'
    bin counts, zeroed here for the filter, then the filter threshold (a key) and the shift of ``BINS`` bins from it
    (short rows: counts only); without (the block kernel's rows sampled ahead, ``block.py``) those two alone.
    ``ROUNDS``: the sample's radix rounds, at most (0: until settled; :func:`_sample_floor`). ``PDL``: it waits for
    the launch before it, then lets the next start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0)
    start, length, seq = window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
    hist_row = hist_ptr + r.to(tl.int64) * (BINS * COUNTS + 2)
    if COUNTS:
        tl.store(hist_row + tl.arange(0, BINS), tl.zeros([BINS], tl.int32))
    if length > k:
        floor, best = _sample_floor(scores_ptr + r.to(tl.int64) * s_s0, s_s1, start, length, k, CONTIG, SAMPLES,
                                    DIGIT, ROUNDS)
        tl.store(hist_row + BINS * COUNTS, floor)
        tl.store(hist_row + BINS * COUNTS + 1, _bin_shift(floor, best, BINS))


@triton.jit(do_not_specialize=_PER_CALL, do_not_specialize_on_alignment=_INDEX)
def topk_filter_kernel(
    scores_ptr, lengths_ptr, starts_ptr, hist_ptr, region_ptr, counts_ptr, cols, k, chunk,
    s_s0, s_s1, len_s0, st_s0,
    HAS_STARTS: tl.constexpr, CONTIG: tl.constexpr, LANES: tl.constexpr, PACK: tl.constexpr, BINS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Split rows, launch 2: chunk ``(r, s)`` filters its ``chunk`` columns at the row's threshold into region
    ``(r, s)``: window positions in its first ``chunk`` slots, their keys (-0.0 as +0.0) in the next ``chunk``;
    ``counts[r, s]`` = how many (0 for short rows). Each candidate is also counted in the row's bin of its key
    (:func:`_bin`, an atomic add), so the finish knows which bin holds the k-th best before it reads a candidate.

    The chunk goes by pieces of ``LANES × PACK`` columns. In a piece, lane ``l`` takes columns ``l, l + LANES, …``
    (each step reads ``LANES`` adjacent columns) and appends its candidates to a run of ``PACK`` slots of its own
    (as many as it sees: never full) with a counter of its own, in the piece's own part of the region: no scan, no
    exchange between lanes while streaming. Then the runs are packed, lane after lane, behind the candidates of the
    pieces before (read whole into registers first, so none is overwritten before it is read; the packed end
    never passes the piece's start). The region is in lane order, not index order: the finish breaks ties by
    position itself. ``PDL``: it waits for the sample, then lets the finish start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0)
    s = tl.program_id(1)
    start, length, seq = window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
    slot = r.to(tl.int64) * tl.num_programs(1) + s
    count = 0
    if length > k:
        PIECE: tl.constexpr = LANES * PACK
        row_ptr = scores_ptr + r.to(tl.int64) * s_s0
        c0 = s * chunk
        lo = tl.maximum(start, c0)
        hi = tl.minimum(start + length, c0 + chunk)
        idx_region = region_ptr + slot * (2 * chunk)
        key_region = idx_region + chunk
        hist_row = hist_ptr + r.to(tl.int64) * (BINS + 2)
        floor = tl.load(hist_row + BINS)
        shift = tl.load(hist_row + BINS + 1)
        lane = tl.arange(0, LANES)
        c = tl.arange(0, PACK)
        first = c0 + (lo - c0) // PIECE * PIECE
        # Eight steps in flight: each step's read is issued eight steps ahead (across pieces too), since a step's
        # stores would otherwise keep the next read from being issued before them.
        x0 = _load_ahead(row_ptr, s_s1, first + lane, lo, hi, CONTIG)
        x1 = _load_ahead(row_ptr, s_s1, first + LANES + lane, lo, hi, CONTIG)
        x2 = _load_ahead(row_ptr, s_s1, first + 2 * LANES + lane, lo, hi, CONTIG)
        x3 = _load_ahead(row_ptr, s_s1, first + 3 * LANES + lane, lo, hi, CONTIG)
        x4 = _load_ahead(row_ptr, s_s1, first + 4 * LANES + lane, lo, hi, CONTIG)
        x5 = _load_ahead(row_ptr, s_s1, first + 5 * LANES + lane, lo, hi, CONTIG)
        x6 = _load_ahead(row_ptr, s_s1, first + 6 * LANES + lane, lo, hi, CONTIG)
        x7 = _load_ahead(row_ptr, s_s1, first + 7 * LANES + lane, lo, hi, CONTIG)
        for p0 in range(first, hi, PIECE):
            run = (p0 - c0) + lane * PACK
            held = tl.zeros([LANES], tl.int32)
            for j in tl.static_range(PACK):
                col = p0 + j * LANES + lane
                bits = score_bits(x0)
                x0, x1, x2, x3, x4, x5, x6 = x1, x2, x3, x4, x5, x6, x7
                x7 = _load_ahead(row_ptr, s_s1, col + 8 * LANES, lo, hi, CONTIG)
                key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
                cand = (key >= floor) & (key <= KEY_INF)  # floor > the key of -inf: NaN, -inf never pass
                key = tl.where(key == -1, 0, key)  # -0.0 -> +0.0
                tl.atomic_add(hist_row + _bin(key, floor, shift, BINS), 1, mask=cand, sem="relaxed")
                tl.store(idx_region + run + held, col - start, mask=cand)
                tl.store(key_region + run + held, key, mask=cand)
                held += cand.to(tl.int32)
            tl.debug_barrier()  # the runs were written by the lanes' own threads
            m = c[None, :] < held[:, None]
            idx = tl.load(idx_region + run[:, None] + c[None, :], mask=m)
            key = tl.load(key_region + run[:, None] + c[None, :], mask=m)
            tl.debug_barrier()  # every run is read before any is overwritten
            dest = count + (tl.cumsum(held, 0) - held)[:, None] + c[None, :]
            tl.store(idx_region + dest, idx, mask=m)
            tl.store(key_region + dest, key, mask=m)
            count += tl.sum(held, 0)
    tl.store(counts_ptr + slot, count)


@triton.jit
def _chunk_counts(counts_row, s0, end, BLOCK_S: tl.constexpr):
    """Chunks ``s0 .. s0 + BLOCK_S`` of a split row (those below ``end``) and their candidate counts (0 past it)."""
    s = s0 + tl.arange(0, BLOCK_S)
    return s, tl.load(counts_row + s, mask=s < end, other=0)


@triton.jit
def _chunk_slots(region_row, s, n, c0, chunk, BLOCK_C: tl.constexpr):
    """Slots ``c0 .. c0 + BLOCK_C`` of chunks ``s`` (``n`` candidates each) in a split row's regions: the addresses of
    their positions (their keys lie ``chunk`` further) and which slots hold a candidate."""
    c = c0 + tl.arange(0, BLOCK_C)
    return region_row + s[:, None].to(tl.int64) * (2 * chunk) + c[None, :], c[None, :] < n[:, None]


@triton.jit(noinline=True)  # a call of its own: inlined, it spills ~50 SGPRs on gfx942 (Triton 3.9)
def _split_pass(region_row, counts_row, chunks, chunk, hist_row, p, above, tied, k, stash_key, stash_idx, out_row,
                o_s1, raw_row, w_s1, HAS_RAW: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                BINS: tl.constexpr, PIVOT_GIVEN: tl.constexpr):
    """A split row's candidates (the chunks' regions: positions, then keys, ``chunk`` slots each), read once. The
    row's bin counts give the bin ``p`` holding the k-th best (:func:`_threshold_bin`: the caller's ``p, above,
    tied`` where ``PIVOT_GIVEN``, else found here); candidates in higher bins are in the top-k and go straight to
    output slots ``[0, above)``, those of bin ``p`` to the stash (``tied`` of them), from which the finish selects
    the rest. Returns ``(above, tied)``."""
    if not PIVOT_GIVEN:
        p, above, tied = _threshold_bin(tl.load(hist_row + tl.arange(0, BINS)), k, BINS)
    floor = tl.load(hist_row + BINS)
    shift = tl.load(hist_row + BINS + 1)
    run_gt = 0
    run_eq = 0
    for s0 in range(0, chunks, BLOCK_S):
        s, n = _chunk_counts(counts_row, s0, chunks, BLOCK_S)
        for c0 in range(0, tl.max(n, 0), BLOCK_C):
            src, m = _chunk_slots(region_row, s, n, c0, chunk, BLOCK_C)
            idx = tl.load(src, mask=m, other=0)
            key = tl.load(src + chunk, mask=m, other=0)
            bins = _bin(key, floor, shift, BINS)
            gt = (m & (bins > p)).to(tl.int32)
            eq = (m & (bins == p)).to(tl.int32)
            both = gt + (eq << 16)
            line = tl.sum(both, 1)
            rank = (tl.cumsum(line, 0) - line)[:, None] + tl.cumsum(both, 1) - both
            slot = run_gt + (rank & 0xFFFF)
            entry = run_eq + (rank >> 16)
            _stage(out_row, o_s1, raw_row, w_s1, slot, idx, (gt != 0) & (slot < k), HAS_RAW)
            tl.store(stash_key + entry, key, mask=eq != 0)
            tl.store(stash_idx + entry, idx, mask=eq != 0)
            last = tl.sum(line, 0)
            run_gt += last & 0xFFFF
            run_eq += last >> 16
    return above, tied


@triton.jit(noinline=True)  # a call of its own, as _split_pass
def _spread_above(region_row, counts_row, s, chunk, hist_row, p, out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row,
                  tab_s1, pages, page_size, TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, TILE: tl.constexpr, BINS: tl.constexpr):
    """Chunk ``s``'s part of a split row finished by many programs: its candidates above the pivot bin ``p`` go out,
    translated, at slots after those of the chunks before it (counted from their keys here: no program waits for
    another), in the order the filter packed them."""
    floor = tl.load(hist_row + BINS)
    shift = tl.load(hist_row + BINS + 1)
    before = 0
    for s0 in range(0, s, BLOCK_S):
        c, n = _chunk_counts(counts_row, s0, s, BLOCK_S)
        for c0 in range(0, tl.max(n, 0), BLOCK_C):
            src, m = _chunk_slots(region_row, c, n, c0, chunk, BLOCK_C)
            key = tl.load(src + chunk, mask=m, other=0)
            before += tl.sum(tl.sum((m & (_bin(key, floor, shift, BINS) > p)).to(tl.int32), 1), 0)
    own = region_row + s.to(tl.int64) * (2 * chunk)
    n_own = tl.load(counts_row + s)
    for c0 in range(0, n_own, TILE):
        j = c0 + tl.arange(0, TILE)
        m = j < n_own
        idx = tl.load(own + j, mask=m, other=0)
        key = tl.load(own + chunk + j, mask=m, other=0)
        gt = (m & (_bin(key, floor, shift, BINS) > p)).to(tl.int32)
        emit(out_row, o_s1, raw_row, w_s1, before + tl.cumsum(gt, 0) - gt, idx, gt != 0, seq, b_ok, tab_row, tab_s1,
             pages, page_size, TRANSLATE, HAS_RAW, SHIFT)
        before += tl.sum(gt, 0)


@triton.jit(noinline=True)
def _spread_ties(region_row, counts_row, chunks, chunk, hist_row, p, above, tied, k, stash_key, stash_idx, out_row,
                 o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size, TRANSLATE: tl.constexpr,
                 HAS_RAW: tl.constexpr, SHIFT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                 BINS: tl.constexpr, TIES: tl.constexpr, RANK: tl.constexpr):
    """The pivot bin's part of a split row finished by many programs (``tied <= TIES`` candidates): gathered into
    the stash, each ranked by how many are ahead of it (a higher key, or the same key at a lower position: the lower
    index wins), and the first ``k - above`` by rank go out at slots ``above + rank``, translated."""
    floor = tl.load(hist_row + BINS)
    shift = tl.load(hist_row + BINS + 1)
    run = 0
    for s0 in range(0, chunks, BLOCK_S):
        c, n = _chunk_counts(counts_row, s0, chunks, BLOCK_S)
        for c0 in range(0, tl.max(n, 0), BLOCK_C):
            src, m = _chunk_slots(region_row, c, n, c0, chunk, BLOCK_C)
            key = tl.load(src + chunk, mask=m, other=0)
            eq = (m & (_bin(key, floor, shift, BINS) == p)).to(tl.int32)
            line = tl.sum(eq, 1)
            entry = run + (tl.cumsum(line, 0) - line)[:, None] + tl.cumsum(eq, 1) - eq
            tl.store(stash_key + entry, key, mask=eq != 0)
            tl.store(stash_idx + entry, tl.load(src, mask=eq != 0, other=0), mask=eq != 0)
            run += tl.sum(line, 0)
    tl.debug_barrier()  # the stash was written by other threads of this program
    i = tl.arange(0, TIES)
    mi = i < tied
    key_i = tl.load(stash_key + i, mask=mi, other=INT_MIN)
    idx_i = tl.load(stash_idx + i, mask=mi, other=0)
    rank = tl.zeros([TIES], tl.int32)
    for j0 in range(0, tied, RANK):
        j = j0 + tl.arange(0, RANK)
        mj = j < tied
        key_j = tl.load(stash_key + j, mask=mj, other=INT_MIN)[None, :]
        idx_j = tl.load(stash_idx + j, mask=mj, other=0)[None, :]
        ahead = mj[None, :] & ((key_j > key_i[:, None]) | ((key_j == key_i[:, None]) & (idx_j < idx_i[:, None])))
        rank += tl.sum(ahead.to(tl.int32), 1)
    emit(out_row, o_s1, raw_row, w_s1, above + rank, idx_i, mi & (rank < k - above), seq, b_ok, tab_row, tab_s1,
         pages, page_size, TRANSLATE, HAS_RAW, SHIFT)


@triton.jit(do_not_specialize=_PER_CALL, do_not_specialize_on_alignment=_INDEX)
def topk_finish_kernel(
    scores_ptr, lengths_ptr, starts_ptr, out_ptr, raw_ptr, r2b_ptr, table_ptr, region_ptr, counts_ptr, hist_ptr,
    stash_ptr, rows, cols, k, cap, chunks, chunk, batches, pages, page_size,
    s_s0, s_s1, len_s0, st_s0, o_s0, o_s1, w_s0, w_s1, r2b_s0, tab_s0, tab_s1,
    HAS_STARTS: tl.constexpr, HAS_R2B: tl.constexpr, TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr,
    SHIFT: tl.constexpr, CONTIG: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr, DIGIT: tl.constexpr,
    BLOCK_S: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr, SPREAD: tl.constexpr, TIES: tl.constexpr,
    SKIM: tl.constexpr,
):
    """The last launch, one program per row at a time (persistent over rows, a stash per program): rows the
    first launch finished (a count of -1) are skipped (a program's next ``SKIM`` rows' counts read at once); a long
    split row whose chunks found ``k <= C <= cap`` candidates takes :func:`_split_pass` and selects the rest among
    its pivot bin's candidates, any other long row takes the exact fallback; then translate and fill (short rows:
    fill only).

    ``SPREAD`` (split rows; the grid's second axis has a program a chunk): a long row with at least ``k``
    candidates, at most ``TIES`` (and ``cap``) of them in the pivot bin, is finished by all of its programs at once,
    program ``s`` sending out chunk ``s``'s candidates above the bin (:func:`_spread_above`) and program 0 also the
    pivot bin's (:func:`_spread_ties`); every other row is program 0's alone, as above. ``PDL``: launched with
    programmatic dependent launch (it waits for the launch before it first), and lets the launch after it start
    (a launch that uses it waits there for this one's end)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    part = tl.program_id(1)
    stash_key = stash_ptr + pid.to(tl.int64) * 2 * cap
    stash_idx = stash_key + cap
    nprog = tl.num_programs(0)
    r = pid
    while r < rows:
        r64 = tl.cast(r, tl.int64)
        counts_row = counts_ptr + r64 * chunks
        count = 0
        for s0 in range(0, chunks, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            count += tl.sum(tl.load(counts_row + s, mask=s < chunks, other=0), 0)
        if count >= 0:
            start, length, seq = window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
            out_row = out_ptr + r64 * o_s0
            raw_row = raw_ptr + r64 * w_s0
            b_ok, tab_row = row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B)
            region_row = region_ptr + r64 * chunks * 2 * chunk
            hist_row = hist_ptr + r64 * (BINS + 2)
            block_c: tl.constexpr = TILE // BLOCK_S
            spread = 0
            p, above, tied = 0, 0, 0  # split rows' pivot bin: found below where SPREAD, else by _split_pass
            if SPREAD:
                p, above, tied = _threshold_bin(tl.load(hist_row + tl.arange(0, BINS)), k, BINS)
                spread = ((length > k) & (count >= k) & (tied <= TIES) & (tied <= cap)).to(tl.int32)
                if spread != 0:
                    _spread_above(region_row, counts_row, part, chunk, hist_row, p, out_row, o_s1, raw_row, w_s1,
                                  seq, b_ok, tab_row, tab_s1, pages, page_size, TRANSLATE, HAS_RAW, SHIFT, BLOCK_S,
                                  block_c, TILE, BINS)
                    if part == 0:
                        _spread_ties(region_row, counts_row, chunks, chunk, hist_row, p, above, tied, k, stash_key,
                                     stash_idx, out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages,
                                     page_size, TRANSLATE, HAS_RAW, SHIFT, BLOCK_S, block_c, BINS, TIES, 32)
            if (part == 0) & (spread == 0):
                filled = 0
                if length > k:
                    row_ptr = scores_ptr + r64 * s_s0
                    b = tl.zeros_like(count) - 1
                    if (count >= k) & (count <= cap):
                        # Without SPREAD the pass finds the pivot bin (in the kernel's body that spilled SGPRs on
                        # gfx942 and gfx950).
                        row_above, row_tied = _split_pass(region_row, counts_row, chunks, chunk, hist_row, p, above,
                                                          tied, k, stash_key, stash_idx, out_row, o_s1, raw_row, w_s1,
                                                          HAS_RAW, BLOCK_S, block_c, BINS, SPREAD)
                    else:
                        b, row_above, row_tied = _fallback(row_ptr, s_s1, start, length, k, cap, stash_key,
                                                           stash_idx, out_row, o_s1, raw_row, w_s1, HAS_RAW, CONTIG,
                                                           BITS, TILE)
                    tl.debug_barrier()  # the stash was written by other threads of this program
                    if row_tied > cap:
                        filled = _finish(row_ptr, s_s1, start, length, b, row_above, row_tied, k, cap, stash_key,
                                         stash_idx, out_row, o_s1, raw_row, w_s1, HAS_RAW, CONTIG, BITS, TILE, DIGIT,
                                         True)
                    else:
                        filled = _finish(row_ptr, s_s1, start, length, b, row_above, row_tied, k, cap, stash_key,
                                         stash_idx, out_row, o_s1, raw_row, w_s1, HAS_RAW, CONTIG, BITS, TILE, DIGIT,
                                         False)
                if length > k:
                    _translate(out_row, o_s1, raw_row, w_s1, filled, seq, b_ok, tab_row, tab_s1, pages, page_size,
                               TRANSLATE, HAS_RAW, SHIFT, TILE)
                _fill(out_row, o_s1, raw_row, w_s1, filled, tl.where(length > k, 0, length), k, seq, b_ok, tab_row,
                      tab_s1, pages, page_size, TRANSLATE, HAS_RAW, SHIFT, TILE)
            tl.debug_barrier()  # the next row reuses the stash
        # On to the program's next row left open (a chunk count >= 0), among its next SKIM rows in one load, not a
        # dependent load a finished row (plan.FINISH_SKIM).
        later = r + nprog * (1 + tl.arange(0, SKIM))
        left = tl.load(counts_ptr + later.to(tl.int64) * chunks, mask=later < rows, other=-1)
        r += nprog * (1 + tl.min(tl.where(left >= 0, tl.arange(0, SKIM), SKIM), 0))


@triton.jit(do_not_specialize=_PER_CALL, do_not_specialize_on_alignment=_UNALIGNED)
def topk_sort_kernel(
    scores_ptr, lengths_ptr, starts_ptr, out_ptr, raw_ptr, r2b_ptr, table_ptr,
    row0, cols, k, batches, pages, page_size,
    s_s0, s_s1, len_s0, st_s0, o_s0, o_s1, w_s0, w_s1, r2b_s0, tab_s0, tab_s1,
    HAS_STARTS: tl.constexpr, HAS_R2B: tl.constexpr, TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr,
    SHIFT: tl.constexpr, CONTIG: tl.constexpr, K_P2: tl.constexpr,
):
    """``sorted=True``, after the select wrote raw positions (to ``raw`` when ``HAS_RAW``, else to ``out``), one
    program a row, row ``row0 + program_id``: a long row's ``k`` slots are ordered by (score desc, position asc) with
    -1 last, by one bitonic sort of ``K_P2`` 64-bit keys (exact score key above, ``INT_MAX - position`` below); a
    short row keeps ``0..len-1``. When translating, the row's slots then get their physical slots in ``out``."""
    r = row0 + tl.program_id(0)
    r64 = tl.cast(r, tl.int64)
    start, length, seq = window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
    out_row = out_ptr + r64 * o_s0
    raw_row = raw_ptr + r64 * w_s0
    if length > k:
        j = tl.arange(0, K_P2)
        m = j < k
        if HAS_RAW:
            pos = tl.load(raw_row + j.to(tl.int64) * w_s1, mask=m, other=-1)
        else:
            pos = tl.load(out_row + j.to(tl.int64) * o_s1, mask=m, other=-1)
        ok = (pos >= 0) & (pos < length)
        key, _ = _load_keys(scores_ptr + r64 * s_s0, s_s1, start + pos, ok, CONTIG, 8)
        packed = (key.to(tl.int64) << 32) | (pos ^ INT_MAX).to(tl.int64)  # pos ^ INT_MAX = INT_MAX - pos
        packed = tl.sort(tl.where(ok, packed, INT64_MIN), descending=True)
        pos = tl.where(packed == INT64_MIN, -1, (packed & INT_MAX).to(tl.int32) ^ INT_MAX)
        tl.debug_barrier()  # every thread has read the row's slots before any is overwritten
        if HAS_RAW:
            tl.store(raw_row + j.to(tl.int64) * w_s1, pos, mask=m)
        else:
            tl.store(out_row + j.to(tl.int64) * o_s1, pos, mask=m)
    b_ok, tab_row = row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B)
    _translate(out_row, o_s1, raw_row, w_s1, k, seq, b_ok, tab_row, tab_s1, pages, page_size, TRANSLATE, HAS_RAW,
               SHIFT, K_P2)
