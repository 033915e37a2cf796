"""``hisparse_plan`` in Triton: one step's hot-buffer plan (docs/hisparse.md), equal entry for entry to
``indexcache.hal.hisparse.plan``.

One program a request (grid: ``max(B, R)``; program ``p`` also writes row ``p``'s outputs when its request lies
outside ``[0, B)``). A request's rows are linked once, each to its next, by a reverse scan of ``row_to_batch`` (the
workspace's first R words; without it row b is request b). Its tokens and the state's are *events*: state slot
``s`` (id ``s``) holding a token in ``[0, newest)`` and each selected position ``f = r * k + j`` holding one (id
``H + f``). Events are deduplicated over a token table in the workspace, an int64 entry a token a slot can hold:
``S = max(L, H)`` entries a request (a placed token is on the host, ``t < L``; a short request's token sits at its
own slot, ``t < H``; a slot holding one at or past ``S`` is emptied, the rules' own). Three passes, each ending at a
barrier: the entries at the events' tokens are emptied (nothing else of the table is read, so it is never cleared
whole); every event puts its id in its entry's low word with ``atomic_min`` (a selected one also marks the high
word); every event reads its entry back. The least id names the slot holding the token (a state id: the lowest slot,
so a higher one is a duplicate; for a selected event a hit) or its first appearance (a selected id: a miss), and the
mark tells a slot that its token is selected (a hit): the same pass cleans the state, ages the hits and writes the
free slots' eviction keys. No hashing, no rounds: each event is resolved by its own token's entry.
The selected events keep their result in ``out`` (a code an entry) until the last pass.

With a slot index (``slot_index``, the caller's ``[B, W]`` int32, kept across steps; its layout and check words:
``indexcache.hal.slot_index.check_words``): a row holds H check words, one a slot (the token the plan left there, mixed
with the slot), then each held token's slot at the token. The first pass also compares each live slot's token with
its check word (coalesced). When every live slot is as the last plan left it (so no token is held twice and the
index has each at its token), only the selected events go through the table (their first appearances), a selected
token's slot is the index's when the state says that slot holds it (a hit, marked for its slot), and a pass over the
state cleans it and writes the keys: no scattered pass over the state's slots. Otherwise (a first step, a state
changed elsewhere) every event goes through the table as above and the index is rebuilt; placed misses and short
requests' identities are written into it, and every slot's check word each step. The plan trusts an index whose
check words match (only a plan writes them or the entries): a check word that does not match only sends a step the
long way, but an entry changed behind matching check words is trusted (a held token it misnames is copied in again).

Misses on the host are numbered in order of first appearance (a row at a time, a running count and a cumsum). The free
slots' eviction keys ``(occupied, age)`` (then the slot) are written in the pass that resolves the state; the M-th
smallest, ``M = min(misses, free slots)``, is looked for among the ``2**DIGIT - 1`` keys from the lowest (one histogram:
a step's misses take the oldest slots, and a step ages its hits alike), else radix-selected (``DIGIT`` bits a pass, from
the keys' common prefix); the M slots at or below it are ranked among themselves (pairwise, ``BI x BJ`` a step) into the
list of the slots taken in order. Where the state is one block and the tuning's ``KEEP_KEYS`` says so, the pivot's and
the list's passes take the keys from registers, not read back. A last pass over the rows writes the slots, the copies
(filed under the row of first appearance) and the placed misses' state. ``PDL``: programmatic dependent launch.

Every read is masked to its tensor (positions by ``seq_len`` and ``L``, slots and rows by ``H`` and ``R``, whatever
``raw``, ``row_to_batch``, ``host_loc`` and the state hold); nothing is allocated at launch but the kept workspace
(:func:`workspace_words` int32 words, through ``backends/triton/workspace.py``); no host sync; an index read from the
workspace is masked to its buffer too. Phases meet at barriers (:func:`_sync`: on AMD after a wait for the wave's
memory operations); a pass that rewrites what it reads waits at one in between when anything but the thread's own
entries depends on the read: a block smaller than the program's threads is held by several of them (only one
stores), and a copy read after the rewrite would give that thread other counts (and the program diverging
barriers). The variant depends on ``H``, ``k``, whether ``row_to_batch`` is given, the dtype of ``host_loc`` and the
vendor only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from indexcache.backends.triton import workspace
from indexcache.backends.triton.launcher import Launch, Launcher, Options, launch_key_options
from indexcache.backends.triton.support import launch_options, next_power_of_2, uses_pdl
from indexcache.backends.triton.target import Target
from indexcache.hal.slot_index import CHECK_MIX as CHECK_MIX_VALUE

MAX_H = 65536  # slots a request at most: a slot takes 16 bits of the eviction key
MAX_K = 4096  # columns a row at most: a row is one block
MAX_IDS = 2**30  # H + R * k below this: event ids and miss codes are int32
SLOT_BITS = tl.constexpr(16)
SLOT_MASK = tl.constexpr(0xFFFF)
INT_MAX = tl.constexpr(2147483647)
PENDING = tl.constexpr(-2)  # a selected entry's code while its token is unresolved
CHECK_MIX = tl.constexpr(CHECK_MIX_VALUE)  # the slot index's check words (indexcache.hal.slot_index.check_words)
MISS = tl.constexpr(-4)  # codes <= MISS: a miss (first appearance f: MISS - f; then its number o: MISS - 2 o - first)


@triton.jit
def _sync(FENCE: tl.constexpr):
    """A barrier of the program's threads after which each sees the others' global writes. On AMD
    ``tl.debug_barrier`` is a bare ``s_barrier`` (gfx942 does not wait for memory at a barrier): ``FENCE`` first
    waits for this wave's own loads, stores and atomics (``s_waitcnt vmcnt(0)``; gfx9 counts stores there too)."""
    if FENCE:
        tl.inline_asm_elementwise("s_waitcnt vmcnt(0)", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _next_row(links, r, R, HAS_R2B: tl.constexpr):
    """The request's row after row ``r`` (``R``: none), from the links its program wrote."""
    if HAS_R2B:
        nxt = tl.load(links + r, mask=(r >= 0) & (r < R), other=R, cache_modifier=".cg")
        nxt = tl.where((nxt >= 0) & (nxt < R), nxt, R)  # whatever the workspace holds, a row or none
    else:
        nxt = R
    return nxt


@triton.jit
def _link_rows(r2b_ptr, r2b_s0, links, R, b, BLOCK_R: tl.constexpr):
    """``(rows, first)``: how many rows name request ``b`` and the first of them (``R``: none); each of them gets its
    next one (``R`` for the last) in ``links``. Blocks are scanned from the last: a suffix minimum of the positions
    after each one."""
    offs = tl.arange(0, BLOCK_R)
    after = R
    rows = 0
    blocks = tl.cdiv(R, BLOCK_R)
    for q in range(0, blocks):
        at = (blocks - 1 - q) * BLOCK_R + offs
        mine = tl.load(r2b_ptr + at.to(tl.int64) * r2b_s0, mask=at < R, other=-1) == b
        later = tl.load(r2b_ptr + (at + 1).to(tl.int64) * r2b_s0, mask=at + 1 < R, other=-1) == b
        nxt = tl.associative_scan(tl.where(later, at + 1, R), 0, _minimum, reverse=True)
        tl.store(links + at, tl.minimum(nxt, after), mask=mine)
        after = tl.minimum(after, tl.min(tl.where(mine, at, R), 0))
        rows += tl.sum(mine.to(tl.int32), 0)
    return rows, after


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def _tally(hits_a, low_a, high_a, hits_b, low_b, high_b):
    """One reduction of the state's hits (sum), lowest and highest free key."""
    return hits_a + hits_b, tl.minimum(low_a, low_b), tl.maximum(high_a, high_b)


@triton.jit
def _check_word(tok, s):
    """Slot ``s``'s check word in a slot index, the slot holding ``tok`` (-1: none): the token XOR a mix of the slot
    (``indexcache.hal.slot_index.check_words``)."""
    return tok ^ (((s.to(tl.int64) + 1) * CHECK_MIX) & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _top_stray(top_a, stray_a, top_b, stray_b):
    """One reduction of the state's largest age and its slots not matching their check words."""
    return tl.maximum(top_a, top_b), stray_a + stray_b


@triton.jit
def _hits_low(hits_a, low_a, hits_b, low_b):
    """One reduction of the state's hits (sum) and lowest free key."""
    return hits_a + hits_b, tl.minimum(low_a, low_b)


@triton.jit
def _now(top):
    """The step's clock: the largest age + 1, saturating at the int32 limit."""
    return tl.minimum(top.to(tl.int64) + 1, INT_MAX).to(tl.int32)


@triton.jit(do_not_specialize=("B", "R", "L", "host_rows"),
            do_not_specialize_on_alignment=("seq_ptr", "host_ptr", "r2b_ptr", "ws_ptr"))
def hisparse_plan_kernel(
    raw_ptr, seq_ptr, host_ptr, tok_ptr, age_ptr, r2b_ptr, ws_ptr, out_ptr, src_ptr, dst_ptr, cnt_ptr, idx_ptr,
    B, R, L, host_rows, raw_s0, raw_s1, seq_s0, host_s0, host_s1, r2b_s0, idx_s0,
    H: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, BLOCK_H: tl.constexpr, DIGIT: tl.constexpr,
    BLOCK_R: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, KEEP_KEYS: tl.constexpr,
    HAS_R2B: tl.constexpr, HAS_INDEX: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr,
):
    """Request ``program_id(0)``'s plan and state update; also that row's outputs when it names no request.
    ``PDL``: launched with programmatic dependent launch (its programs wait for the launch before it first, and let
    the next one start)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    cols = tl.arange(0, K_P2)
    in_row = cols < K
    none = tl.full([K_P2], -1, tl.int32)
    if HAS_R2B:
        if pid < R:
            rb = tl.load(r2b_ptr + pid.to(tl.int64) * r2b_s0)
            if (rb < 0) | (rb >= B):  # a row naming no request selects nothing
                tl.store(out_ptr + pid.to(tl.int64) * K + cols, none, mask=in_row)
                tl.store(src_ptr + pid.to(tl.int64) * K + cols, none.to(tl.int64), mask=in_row)
                tl.store(dst_ptr + pid.to(tl.int64) * K + cols, none, mask=in_row)
                tl.store(cnt_ptr + pid.to(tl.int64), 0)
    b = pid
    rows = 0
    row0 = b
    links = ws_ptr  # each row's next row of its request (R words), then the requests' workspaces
    if b < B:
        if HAS_R2B:
            rows, row0 = _link_rows(r2b_ptr, r2b_s0, links, R, b, BLOCK_R)
            _sync(FENCE)  # every thread's links stored before any is followed (_next_row), on AMD too
        else:
            rows = 1
    if rows > 0:  # a request no row names is left as it was
        b64 = b.to(tl.int64)
        tok_row = tok_ptr + b64 * H
        age_row = age_ptr + b64 * H
        host_row = host_ptr + b64 * host_s0
        checks = idx_ptr + b64 * idx_s0  # the request's row of the slot index (read and written only with one):
        index = checks + H  # H check words, then a token's slot at the token
        n = tl.load(seq_ptr + b64 * seq_s0)
        hs = tl.arange(0, BLOCK_H)
        if n <= H:
            # Short request: token t at slot t; the state becomes the identity.
            top = tl.full([], -2147483648, tl.int32)
            for h0 in range(0, H, BLOCK_H):
                age = tl.load(age_row + (h0 + hs), mask=h0 + hs < H, other=-2147483648)
                top = tl.maximum(top, tl.max(age, 0))
            now = _now(top)
            _sync(FENCE)  # every thread's reads of the ages before any is rewritten
            for h0 in range(0, H, BLOCK_H):
                s = h0 + hs
                tl.store(tok_row + s, tl.where(s < n, s, -1), mask=s < H)
                if HAS_INDEX:
                    tl.store(checks + s, _check_word(tl.where(s < n, s, -1), s), mask=s < H)
                    tl.store(index + s, s, mask=s < n)
            row = row0
            for _ in range(rows):
                r = row.to(tl.int64)
                row = _next_row(links, row, R, HAS_R2B)
                if r < R:  # always (the links name a row), whatever the workspace holds
                    x = tl.load(raw_ptr + r * raw_s0 + cols.to(tl.int64) * raw_s1, mask=in_row, other=-1)
                    valid = in_row & (x >= 0) & (x < n)
                    tl.store(out_ptr + r * K + cols, tl.where(valid, x, -1), mask=in_row)
                    tl.store(src_ptr + r * K + cols, none.to(tl.int64), mask=in_row)
                    tl.store(dst_ptr + r * K + cols, none, mask=in_row)
                    tl.store(cnt_ptr + r, 0)
                    tl.store(age_row + x.to(tl.int64), tl.full([K_P2], 0, tl.int32) + now, mask=valid)
        else:
            requests = ws_ptr
            if HAS_R2B:
                requests = ws_ptr + R + R % 2
            _long_request(raw_ptr, host_row, tok_row, age_row, links, requests, out_ptr, src_ptr, dst_ptr, cnt_ptr,
                          checks, index, b, R, L, host_rows, n, rows, row0, raw_s0, raw_s1, host_s1,
                          H, K, K_P2, BLOCK_H, DIGIT, BLOCK_R, BI, BJ, KEEP_KEYS, HAS_R2B, HAS_INDEX, FENCE)


@triton.jit
def _selected(raw_row, raw_s1, K: tl.constexpr, K_P2: tl.constexpr, n, newest, reach):
    """A row's selected positions and which of them are looked up in the table: valid (``[0, n)``), not the newest,
    below ``reach``."""
    cols = tl.arange(0, K_P2)
    x = tl.load(raw_row + cols.to(tl.int64) * raw_s1, mask=cols < K, other=-1)
    return x, (cols < K) & (x >= 0) & (x < n) & (x != newest) & (x < reach)


@triton.jit
def _state_keys(tok, age, s, m, holds, is_hit, keys, tok_row, age_row, checks, now, hits, low, high,
                CHECKS: tl.constexpr, HIGH: tl.constexpr):
    """A block of the state after the step: slots not holding their token first emptied, hits aged ``now``, the free
    slots' eviction keys ``(occupied, age)``, with ``CHECKS`` their check words in the slot index; the state's tallies
    so far (its hits, lowest free key and, with ``HIGH``, highest) with the block's, and the block's keys as stored
    (-1: not free)."""
    free = m & ~is_hit
    key = (holds.to(tl.int64) << 32) | (age.to(tl.int64) + 2147483648)
    stored = tl.where(free, key, -1)
    tl.store(keys + s, stored, mask=m)
    kept = tl.where(holds, tok, -1)
    tl.store(tok_row + s, kept, mask=m)
    if CHECKS:
        tl.store(checks + s, _check_word(kept, s), mask=m)
    tl.store(age_row + s, tl.zeros_like(age) + now, mask=is_hit)
    if HIGH:
        block_hits, block_low, block_high = tl.reduce(
            (is_hit.to(tl.int32), tl.where(free, key, 0x7FFFFFFFFFFFFFFF), stored), 0, _tally)
        hits, low, high = _tally(hits, low, high, block_hits, block_low, block_high)
    else:
        block_hits, block_low = tl.reduce((is_hit.to(tl.int32), tl.where(free, key, 0x7FFFFFFFFFFFFFFF)), 0,
                                          _hits_low)
        hits, low = _hits_low(hits, low, block_hits, block_low)
    return hits, low, high, stored


@triton.jit
def _keys(keys, s, H: tl.constexpr, block, ONE_BLOCK: tl.constexpr):
    """The free slots' keys at ``s`` (-1: none): ``block``, the state's kept in registers, where it is one block;
    else read back."""
    if ONE_BLOCK:
        key = block
    else:
        key = tl.load(keys + s, mask=s < H, other=-1, cache_modifier=".cg")
    return key


@triton.jit
def _state_pass(tok_row, age_row, keys, table, hit, checks, index, now, held_below, H: tl.constexpr,
                BLOCK_H: tl.constexpr, ONE_BLOCK: tl.constexpr, INDEXED: tl.constexpr, REBUILD: tl.constexpr):
    """The pass over the state after its events are resolved (:func:`_state_keys` a block): a live slot holds its
    token and is hit as marked in ``hit`` where ``INDEXED`` (the check words said no token is held twice), else where
    its token's entry in ``table`` has its own id least and the selected mark (``REBUILD``: each slot holding its
    token also written at it in ``index``). Check words are written where ``INDEXED`` or ``REBUILD``. Returns the
    state's hits, its lowest and highest free key and, with ``ONE_BLOCK``, its keys as stored."""
    hs = tl.arange(0, BLOCK_H)
    hits = 0
    low = tl.full([], 0x7FFFFFFFFFFFFFFF, tl.int64)
    high = tl.full([], -1, tl.int64)
    block = tl.full([BLOCK_H], -1, tl.int64)
    for h0 in range(0, H, BLOCK_H):
        s = h0 + hs
        m = s < H
        tok = tl.load(tok_row + s, mask=m, other=-1)
        age = tl.load(age_row + s, mask=m, other=0)
        live = m & (tok >= 0) & (tok < held_below)
        if INDEXED:
            holds = live
            is_hit = holds & (tl.load(hit + s, mask=m, other=0, cache_modifier=".cg") == 1)
        else:
            entry = tl.load(table + tok, mask=live, other=-1, cache_modifier=".cg")
            holds = live & (entry.to(tl.int32) == s)
            is_hit = holds & ((entry >> 32) != 0)
            if REBUILD:
                tl.store(index + tok, s, mask=holds)
        hits, low, high, stored = _state_keys(tok, age, s, m, holds, is_hit, keys, tok_row, age_row, checks, now, hits,
                                              low, high, INDEXED or REBUILD, not ONE_BLOCK)
        if ONE_BLOCK:
            block = stored
    return hits, low, high, block


@triton.jit
def _resolve_all(raw_ptr, tok_row, age_row, links, out_ptr, keys, table, words, checks, index, now, R, n, newest,
                 reach, held_below, rows, row0, raw_s0, raw_s1, H: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr,
                 BLOCK_H: tl.constexpr, ONE_BLOCK: tl.constexpr, HAS_R2B: tl.constexpr, FENCE: tl.constexpr,
                 REBUILD: tl.constexpr):
    """Every event through the table (the selected tokens' entries already emptied; the state's too unless
    ``REBUILD``): each id ``atomic_min``'d into its token's entry (a selected token marked), then read back. The
    least id names the slot holding the token (a state id: the lowest slot, so a higher one is a duplicate; for a
    selected entry a hit) or its first appearance (a selected id: a miss); the mark tells a slot its token is selected
    (a hit). ``REBUILD`` (the first pass checked the slot index instead of emptying the state's entries, and left
    the selected tokens the index held): empty them here, write each slot holding its token at it in ``index`` and
    every slot's check word. Returns the state's hits, its lowest and highest free key and, with ``ONE_BLOCK`` (the
    state one block), its keys as stored."""
    cols = tl.arange(0, K_P2)
    hs = tl.arange(0, BLOCK_H)
    empty = tl.full([], INT_MAX, tl.int64)  # no id, not selected
    if REBUILD:
        for h0 in range(0, H, BLOCK_H):
            s = h0 + hs
            tok = tl.load(tok_row + s, mask=s < H, other=-1)
            live = (s < H) & (tok >= 0) & (tok < held_below)
            tl.store(table + tok, tl.zeros([BLOCK_H], tl.int64) + empty, mask=live)
        row = row0
        for _ in range(rows):  # and the selected tokens' the first pass left, held where the index said
            r = row
            row = _next_row(links, row, R, HAS_R2B)
            if r < R:
                x, pending = _selected(raw_ptr + r.to(tl.int64) * raw_s0, raw_s1, K, K_P2, n, newest, reach)
                tl.store(table + x, tl.zeros([K_P2], tl.int64) + empty, mask=pending)
        _sync(FENCE)
    for h0 in range(0, H, BLOCK_H):
        s = h0 + hs
        tok = tl.load(tok_row + s, mask=s < H, other=-1)
        live = (s < H) & (tok >= 0) & (tok < held_below)
        tl.atomic_min(words + 2 * tok.to(tl.int64), s, mask=live, sem="relaxed")
    row = row0
    for _ in range(rows):
        r = row
        row = _next_row(links, row, R, HAS_R2B)
        if r < R:
            r64 = r.to(tl.int64)
            x, pending = _selected(raw_ptr + r64 * raw_s0, raw_s1, K, K_P2, n, newest, reach)
            at = words + 2 * x.to(tl.int64)
            tl.atomic_min(at, H + r * K + cols, mask=pending, sem="relaxed")
            tl.store(at + 1, tl.full([K_P2], 1, tl.int32), mask=pending)
    _sync(FENCE)
    row = row0
    for _ in range(rows):
        r = row
        row = _next_row(links, row, R, HAS_R2B)
        if r < R:
            r64 = r.to(tl.int64)
            x, pending = _selected(raw_ptr + r64 * raw_s0, raw_s1, K, K_P2, n, newest, reach)
            w = tl.load(words + 2 * x.to(tl.int64), mask=pending, other=-1, cache_modifier=".cg")
            ok = pending & (w >= 0) & (w <= H + r * K + cols)  # always, whatever the workspace held before the step
            tl.store(out_ptr + r64 * K + cols, tl.where(ok, tl.where(w < H, w, MISS - (w - H)), -1), mask=pending)
    hits, low, high, block = _state_pass(tok_row, age_row, keys, table, table, checks, index, now, held_below, H,
                                         BLOCK_H, ONE_BLOCK, False, REBUILD)  # (no hit marks: table stands in)
    _sync(FENCE)
    return hits, low, high, block


@triton.jit
def _number_row(out_ptr, at, code, x, pos, clear, host_row, host_s1, L, host_rows, misses, FENCE: tl.constexpr):
    """One row's misses numbered on from ``misses`` (returned with the row's): ``code`` its entries' codes so far (a
    selected token not held: ``MISS - f``, ``f`` its first appearance; ``pos`` each entry's own ``r * K + column``),
    ``x`` their tokens. A first appearance on the host gets ``MISS - 2 number - 1`` (a copy), one not on the host and
    each entry in ``clear`` -1, another appearance its first's number (``MISS - 2 number``) or -1."""
    first = code == MISS - pos
    again = (code <= MISS) & ~first & (MISS - code <= pos)
    loc = tl.load(host_row + x.to(tl.int64) * host_s1, mask=first & (x >= 0) & (x < L), other=-1)
    limit = tl.where(host_rows < 0, 0x7FFFFFFFFFFFFFFF, host_rows.to(tl.int64))  # host_rows < 0: none given
    on_host = first & (loc.to(tl.int64) >= 0) & (loc.to(tl.int64) < limit)
    number = misses + tl.cumsum(on_host.to(tl.int32), 0) - on_host.to(tl.int32)
    misses += tl.sum(on_host.to(tl.int32), 0)
    _sync(FENCE)  # every thread's reads of the row (its copies in other threads too) before it changes
    tl.store(at, tl.where(on_host, MISS - 2 * number - 1, -1), mask=first | clear)
    if tl.sum(again.to(tl.int32), 0) > 0:  # a token appearing again: it takes its first appearance's number
        _sync(FENCE)
        first_at = (-code + MISS).to(tl.int64)  # the first appearance, a position in out
        code0 = tl.load(out_ptr + first_at, mask=again, other=-1, cache_modifier=".cg")
        tl.store(at, tl.where(code0 == -1, -1, MISS - 2 * ((MISS - code0) >> 1)), mask=again)
    return misses


@triton.jit
def _row_codes(out_ptr, raw_ptr, r, raw_s0, raw_s1, K: tl.constexpr, K_P2: tl.constexpr):
    """Row ``r``'s entries: where its codes are in ``out``, the codes (-1 past ``k``) and its selected positions (-1
    past ``k``)."""
    cols = tl.arange(0, K_P2)
    r64 = r.to(tl.int64)
    at = out_ptr + r64 * K + cols
    code = tl.load(at, mask=cols < K, other=-1, cache_modifier=".cg")
    x = tl.load(raw_ptr + r64 * raw_s0 + cols.to(tl.int64) * raw_s1, mask=cols < K, other=-1)
    return at, code, x


@triton.jit
def _number_misses(raw_ptr, host_row, links, out_ptr, R, L, host_rows, rows, row0, raw_s0, raw_s1, host_s1,
                   K: tl.constexpr, K_P2: tl.constexpr, HAS_R2B: tl.constexpr, FENCE: tl.constexpr):
    """The request's misses on the host numbered in order of first appearance, a row at a time (:func:`_number_row`);
    returns how many."""
    cols = tl.arange(0, K_P2)
    misses = 0
    row = row0
    for _ in range(rows):
        r = row
        row = _next_row(links, row, R, HAS_R2B)
        if r < R:
            at, code, x = _row_codes(out_ptr, raw_ptr, r, raw_s0, raw_s1, K, K_P2)
            misses = _number_row(out_ptr, at, code, x, r * K + cols, cols < 0, host_row, host_s1, L, host_rows,
                                 misses, FENCE)
    return misses


@triton.jit
def _resolve_indexed(raw_ptr, tok_row, age_row, host_row, links, out_ptr, keys, words, checks, index, hit, now, R, n,
                     L, host_rows, newest, reach, held_below, rows, row0, raw_s0, raw_s1, host_s1, H: tl.constexpr,
                     K: tl.constexpr, K_P2: tl.constexpr, BLOCK_H: tl.constexpr, ONE_BLOCK: tl.constexpr,
                     NUMBER: tl.constexpr, HAS_R2B: tl.constexpr, FENCE: tl.constexpr):
    """The state's live slots all as the last plan left them (their check words), so none holds a token twice and
    ``index`` has each at its token: the first pass gave each selected entry held at the slot the index names that
    slot (a hit, marked here in ``hit``); only the others (``PENDING``) go through the table, their first appearances
    becoming their codes, with ``NUMBER`` numbered as they are read back (:func:`_number_row`). Returns what
    :func:`_resolve_all` does and (with ``NUMBER``) the misses on the host; ends without a barrier (the caller's
    next one orders the state's writes before anything reads them)."""
    cols = tl.arange(0, K_P2)
    row = row0
    for _ in range(rows):
        r = row
        row = _next_row(links, row, R, HAS_R2B)
        if r < R:
            r64 = r.to(tl.int64)
            code = tl.load(out_ptr + r64 * K + cols, mask=cols < K, other=-1, cache_modifier=".cg")
            x = tl.load(raw_ptr + r64 * raw_s0 + cols.to(tl.int64) * raw_s1, mask=(cols < K) & (code == PENDING),
                        other=0)
            tl.atomic_min(words + 2 * x.to(tl.int64), H + r * K + cols, mask=(cols < K) & (code == PENDING),
                          sem="relaxed")
            tl.store(hit + code, tl.full([K_P2], 1, tl.int32), mask=(cols < K) & (code >= 0) & (code < H))
    _sync(FENCE)
    misses = tl.full([], 0, tl.int32)
    row = row0
    for _ in range(rows):
        r = row
        row = _next_row(links, row, R, HAS_R2B)
        if r < R:
            at, code, x = _row_codes(out_ptr, raw_ptr, r, raw_s0, raw_s1, K, K_P2)
            pending = (cols < K) & (code == PENDING)
            w = tl.load(words + 2 * x.to(tl.int64), mask=pending, other=-1, cache_modifier=".cg")
            found = pending & (w >= H) & (w <= H + r * K + cols)  # always, whatever the workspace held
            code = tl.where(pending, tl.where(found, MISS - (w - H), -1), code)
            if NUMBER:
                misses = _number_row(out_ptr, at, code, x, r * K + cols, pending & ~found, host_row, host_s1, L,
                                     host_rows, misses, FENCE)
            else:
                tl.store(at, code, mask=pending)
    if not NUMBER:  # the codes read again by the numbering's pass (the state's pass below touches none of them)
        _sync(FENCE)
    hits, low, high, block = _state_pass(tok_row, age_row, keys, keys, hit, checks, index, now, held_below, H, BLOCK_H,
                                         ONE_BLOCK, True, False)  # (no table read: keys stands in)
    return hits, low, high, block, misses


@triton.jit
def _long_request(raw_ptr, host_row, tok_row, age_row, links, ws_ptr, out_ptr, src_ptr, dst_ptr, cnt_ptr, checks,
                  index, b, R, L, host_rows, n, rows, row0, raw_s0, raw_s1, host_s1,
                  H: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, BLOCK_H: tl.constexpr, DIGIT: tl.constexpr,
                  BLOCK_R: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, KEEP_KEYS: tl.constexpr,
                  HAS_R2B: tl.constexpr, HAS_INDEX: tl.constexpr, FENCE: tl.constexpr):
    """Request ``b`` of ``n > H`` tokens (``checks``, ``index``: its row of the slot index, where ``HAS_INDEX``): the
    events resolved, the misses' numbers, the eviction order, the outputs."""
    newest = n - 1
    reach = tl.maximum(L, H)  # the tokens a slot can hold: on the host (t < L) or a short request's own (t < H)
    held_below = tl.minimum(newest, reach)
    cols = tl.arange(0, K_P2)
    in_row = cols < K
    hs = tl.arange(0, BLOCK_H)
    # The request's workspace: int64 eviction keys and candidates, the slots taken in eviction order, the slots hit
    # (with an index), and the token table: an int64 a token below ``reach``, whose low word gets the least id of the
    # events at that token and whose high word whether a selected entry is one of them.
    ws = ws_ptr + b.to(tl.int64) * (6 * H + (H % 2) + 2 * reach)
    keys = ws.to(tl.pointer_type(tl.int64))
    cand = keys + H
    taken = ws + 4 * H
    hit = taken + H
    table = (hit + H + (H % 2)).to(tl.pointer_type(tl.int64))
    words = table.to(tl.pointer_type(tl.int32))  # token t's least id at word 2 t, whether it is selected at 2 t + 1
    empty = tl.full([], INT_MAX, tl.int64)  # no id, not selected

    # The step's clock (the largest age + 1); with an index, whether every live slot is as the last plan left it (its
    # check word; and no slot hit yet), else the table's entries at the state's tokens emptied; each selected entry's
    # first code (a token past ``reach`` is neither held nor on the host: none; with an index, one held at the slot
    # it names: that slot) and the other selected tokens' entries emptied (nothing else of the table is read).
    top = tl.full([], -2147483648, tl.int32)
    stray = 0
    for h0 in range(0, H, BLOCK_H):
        s = h0 + hs
        tok = tl.load(tok_row + s, mask=s < H, other=-1)
        age = tl.load(age_row + s, mask=s < H, other=-2147483648)
        live = (s < H) & (tok >= 0) & (tok < held_below)
        if HAS_INDEX:
            check = tl.load(checks + s, mask=s < H, other=0)
            block_top, block_stray = tl.reduce((age, (live & (check != _check_word(tok, s))).to(tl.int32)), 0,
                                               _top_stray)
            top, stray = _top_stray(top, stray, block_top, block_stray)
            tl.store(hit + s, tl.zeros([BLOCK_H], tl.int32), mask=s < H)
        else:
            top = tl.maximum(top, tl.max(age, 0))
            tl.store(table + tok, tl.zeros([BLOCK_H], tl.int64) + empty, mask=live)
    now = _now(top)
    row = row0
    for _ in range(rows):
        r = row
        row = _next_row(links, row, R, HAS_R2B)
        if r < R:
            r64 = r.to(tl.int64)
            x = tl.load(raw_ptr + r64 * raw_s0 + cols.to(tl.int64) * raw_s1, mask=in_row, other=-1)
            valid = in_row & (x >= 0) & (x < n)
            pending = valid & (x != newest) & (x < reach)
            code = tl.where(pending, PENDING, tl.where(valid & (x == newest), H, -1))
            if HAS_INDEX:  # held at the slot the index names: a hit, if the state turns out to be the plan's
                h = tl.load(index + x, mask=pending, other=-1, cache_modifier=".cg")
                held = pending & (h >= 0) & (h < H)
                held = held & (tl.load(tok_row + h, mask=held, other=-1) == x)
                code = tl.where(held, h, code)
                pending = pending & ~held
            tl.store(out_ptr + r64 * K + cols, code, mask=in_row)
            tl.store(table + x, tl.zeros([K_P2], tl.int64) + empty, mask=pending)
    _sync(FENCE)

    # Each selected entry's code (its hit slot, or its first appearance); the state cleaned (a slot not holding its
    # token first is emptied), its hits aged, the free slots' keys.
    # Then the misses on the host, numbered in order of first appearance (the other appearances take their number):
    # with an index, as their codes are read back where the state is one block (over more, that spilled on sm90,
    # gfx942 and gfx950 at H 16384 with row_to_batch), else in a pass of their own.
    ONE_BLOCK: tl.constexpr = KEEP_KEYS and H <= BLOCK_H  # the state's keys stay in registers for the eviction
    NUMBER: tl.constexpr = H <= BLOCK_H
    numbered = tl.full([], 0, tl.int32)
    misses = tl.full([], 0, tl.int32)
    if HAS_INDEX:
        if stray == 0:
            hits, low, high, block, misses = _resolve_indexed(
                raw_ptr, tok_row, age_row, host_row, links, out_ptr, keys, words, checks, index, hit, now, R, n, L,
                host_rows, newest, reach, held_below, rows, row0, raw_s0, raw_s1, host_s1, H, K, K_P2, BLOCK_H,
                ONE_BLOCK, NUMBER, HAS_R2B, FENCE)
            if NUMBER:
                numbered = tl.full([], 1, tl.int32)
        else:  # a slot's check word differs (first use, a state changed elsewhere): all events, the index rebuilt
            hits, low, high, block = _resolve_all(raw_ptr, tok_row, age_row, links, out_ptr, keys, table, words,
                                                  checks, index, now, R, n, newest, reach, held_below, rows, row0,
                                                  raw_s0, raw_s1, H, K, K_P2, BLOCK_H, ONE_BLOCK, HAS_R2B, FENCE,
                                                  True)
    else:
        hits, low, high, block = _resolve_all(raw_ptr, tok_row, age_row, links, out_ptr, keys, table, words, checks,
                                              index, now, R, n, newest, reach, held_below, rows, row0, raw_s0, raw_s1,
                                              H, K, K_P2, BLOCK_H, ONE_BLOCK, HAS_R2B, FENCE, False)
    if numbered == 0:
        misses = _number_misses(raw_ptr, host_row, links, out_ptr, R, L, host_rows, rows, row0, raw_s0, raw_s1,
                                host_s1, K, K_P2, HAS_R2B, FENCE)
    placed = tl.minimum(misses, H - hits)
    _sync(FENCE)  # the resolution's writes (codes, the state, its keys) before anything below reads them

    if placed > 0:
        # The placed-th smallest (occupied, age) among the free slots: first among the BINS - 1 keys from the
        # lowest (the common case: a step's misses take the oldest slots, and a step ages its hits alike), else by a
        # radix select from the keys' common prefix.
        need = placed
        BINS: tl.constexpr = 1 << DIGIT
        bins = tl.arange(0, BINS)
        count = tl.zeros([BINS], tl.int32)
        for h0 in range(0, H, BLOCK_H):
            s = h0 + hs
            key = _keys(keys, s, H, block, ONE_BLOCK)
            count += tl.histogram(tl.minimum(key - low, BINS - 1).to(tl.int32), BINS, mask=key >= 0)
        below = tl.cumsum(count, 0)
        if tl.sum(tl.where(bins == BINS - 2, below, 0), 0) >= need:
            pick = tl.sum((below < need).to(tl.int32), 0)
            need -= tl.sum(tl.where(bins < pick, count, 0), 0)
            prefix = low + pick
        else:
            if ONE_BLOCK:  # the highest free key, not tallied with the state's (only this select needs it)
                high = tl.max(block, 0)
            span = tl.full([], 0, tl.int64)
            while (low ^ high) >> span > 0:
                span += 1
            prefix = low >> span
            while span > 0:
                d = tl.minimum(span, DIGIT).to(tl.int64)
                span -= d
                count = tl.zeros([BINS], tl.int32)
                for h0 in range(0, H, BLOCK_H):
                    s = h0 + hs
                    key = _keys(keys, s, H, block, ONE_BLOCK)
                    inside = (key >= 0) & ((key >> (span + d)) == prefix)
                    count += tl.histogram(((key >> span) & ((tl.full([], 1, tl.int64) << d) - 1)).to(tl.int32),
                                          BINS, mask=inside)
                below = tl.cumsum(count, 0)
                pick = tl.sum((below < need).to(tl.int32), 0)
                need -= tl.sum(tl.where(bins < pick, count, 0), 0)
                prefix = (prefix << d) | pick
        # The slots taken: keys below the pivot, and the `need` lowest slots at it; their keys, in slot order.
        # One scan counts both in a word (a block's counts fit 16 bits): below in the low half, ties in the high.
        ties = 0
        found = 0
        for h0 in range(0, H, BLOCK_H):
            s = h0 + hs
            key = _keys(keys, s, H, block, ONE_BLOCK)
            under = (key >= 0) & (key < prefix)
            tie = (key >= 0) & (key == prefix)
            both = tl.cumsum(under.to(tl.int32) | (tie.to(tl.int32) << 16), 0)
            tied = ties + (both >> 16)  # the ties up to this one
            take = under | (tie & (tied <= need))
            # taken before this one: the keys below and the ties within the first ``need``
            where = (found + (both & 0xFFFF) - under.to(tl.int32) + tl.minimum(tied - tie.to(tl.int32), need)
                     - tl.minimum(ties, need))
            tl.store(cand + where, (key << SLOT_BITS) | s, mask=take & (where < H))
            if not ONE_BLOCK:  # the counts carried to the next block
                total = tl.max(both, 0)
                found += (total & 0xFFFF) + tl.minimum(total >> 16, tl.maximum(need - ties, 0))
                ties += total >> 16
        _sync(FENCE)
        # Each taken slot's place in eviction order: the taken keys below its own.
        bi = tl.arange(0, BI)
        bj = tl.arange(0, BJ)
        for i0 in range(0, placed, BI):
            mine = tl.load(cand + i0 + bi, mask=i0 + bi < placed, other=0, cache_modifier=".cg")
            rank = tl.zeros([BI], tl.int32)
            for j0 in range(0, placed, BJ):
                other = tl.load(cand + j0 + bj, mask=j0 + bj < placed, other=0x7FFFFFFFFFFFFFFF,
                                cache_modifier=".cg")
                rank += tl.sum((other[None, :] < mine[:, None]).to(tl.int32), 1)
            tl.store(taken + rank, (mine & SLOT_MASK).to(tl.int32), mask=(i0 + bi < placed) & (rank < H))
        _sync(FENCE)

    # The outputs: each entry's slot; the copies under the row of first appearance; the placed misses' state.
    row = row0
    for _ in range(rows):
        r = row
        row = _next_row(links, row, R, HAS_R2B)
        if r < R:
            r64 = r.to(tl.int64)
            at, code, x = _row_codes(out_ptr, raw_ptr, r, raw_s0, raw_s1, K, K_P2)
            number = (MISS - code) >> 1
            put = in_row & (code <= MISS) & (number < placed)
            slot = tl.load(taken + number, mask=put, other=-1, cache_modifier=".cg")
            slot = tl.where((slot >= 0) & (slot < H), slot, -1)  # whatever the workspace holds, a slot or none
            copy = put & (((MISS - code) & 1) == 1) & (x >= 0) & (x < L)
            where = tl.cumsum(copy.to(tl.int32), 0) - copy.to(tl.int32)
            copies = tl.sum(copy.to(tl.int32), 0)
            loc = tl.load(host_row + x.to(tl.int64) * host_s1, mask=copy, other=-1).to(tl.int64)
            tl.store(src_ptr + r64 * K + where, loc, mask=copy)
            tl.store(dst_ptr + r64 * K + where, slot, mask=copy)
            rest = in_row & (cols >= copies)
            tl.store(src_ptr + r64 * K + cols, tl.full([K_P2], -1, tl.int64), mask=rest)
            tl.store(dst_ptr + r64 * K + cols, tl.full([K_P2], -1, tl.int32), mask=rest)
            tl.store(cnt_ptr + r64, copies)
            _sync(FENCE)  # every thread's reads of the row's codes (copies included) before they become its slots
            tl.store(at, tl.where(code >= 0, code, slot), mask=in_row)
            tl.store(tok_row + slot.to(tl.int64), x, mask=copy & (slot >= 0))
            if HAS_INDEX:
                tl.store(checks + slot.to(tl.int64), _check_word(x, slot), mask=copy & (slot >= 0))
                tl.store(index + x, slot, mask=copy & (slot >= 0))
            tl.store(age_row + slot.to(tl.int64), tl.full([K_P2], 0, tl.int32) + now, mask=copy & (slot >= 0))


PLAN = Launcher(hisparse_plan_kernel)


def workspace_words(requests: int, hot: int, length: int, rows: int = 0) -> int:
    """int32 words of workspace a call takes: ``rows + rows % 2 + requests * (6 H + H % 2 + 2 S) + 1`` (``rows``:
    those of ``row_to_batch`` when given, else 0; ``S = max(length, H)`` the token table's int64 entries a request,
    ``length`` being ``host_loc``'s width; one word to align the int64 keys). At 64 requests, H 4096 and 128K host
    tokens a request: 70 MiB."""
    span = max(length, hot)
    return rows + rows % 2 + requests * (6 * hot + hot % 2 + 2 * span) + 1


def supports(raw: torch.Tensor, slot_token: torch.Tensor, slot_age: torch.Tensor | None = None,
             out: torch.Tensor | None = None, out_copy_src: torch.Tensor | None = None,
             out_copy_dst: torch.Tensor | None = None, out_copy_count: torch.Tensor | None = None, **_) -> list[str]:
    """Reasons this kernel declines a call (empty: it takes it): H above :data:`MAX_H`, k above :data:`MAX_K`,
    ``H + R * k`` from :data:`MAX_IDS` on, or a state or output tensor that is not contiguous (``raw``, ``seq_lens``,
    ``host_loc`` and ``row_to_batch`` may have any strides)."""
    reasons = []
    rows, k = raw.shape
    hot = slot_token.shape[1]
    if not 1 <= hot <= MAX_H:
        reasons.append(f"slot_token has {hot} slots a request: the Triton plan takes 1 to {MAX_H}")
    if not 1 <= k <= MAX_K:
        reasons.append(f"raw has {k} columns: the Triton plan takes 1 to {MAX_K}")
    if hot + rows * k >= MAX_IDS:
        reasons.append(f"H + R * k = {hot + rows * k}: the Triton plan numbers events in int32 (below {MAX_IDS})")
    tensors = dict(slot_token=slot_token, slot_age=slot_age, out=out, out_copy_src=out_copy_src,
                   out_copy_dst=out_copy_dst, out_copy_count=out_copy_count)
    loose = [name for name, t in tensors.items() if t is not None and not t.is_contiguous()]
    if loose:
        reasons.append(f"{', '.join(loose)} must be contiguous for the Triton plan")
    return reasons


def _fence(target: Target) -> bool:
    """Whether barriers need :func:`_sync`'s wait for memory first: where the vendor's barrier does not order memory."""
    return not target.interpreted and not target.gpu.vendor.barrier_orders_memory


def plan_options(target: Target, cfg: Mapping[str, Any]) -> Options:
    """The plan's launch options: the tuning entry's, and ``launch_pdl`` where :func:`uses_pdl`."""
    pdl = {"launch_pdl": True} if uses_pdl(target, cfg) else {}
    return launch_key_options({**launch_options(target, cfg), **pdl})


def plan_launch(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch, host_rows, out, out_copy_src,
                out_copy_dst, out_copy_count, slot_index=None, *, target: Target, cfg: Mapping[str, Any],
                options: Options | None = None, workspace_given: torch.Tensor | None = None) -> Launch | None:
    """The launch of one step's plan (contract: ``indexcache.hal.hisparse.plan``, the state updated in place; the
    slot index, where given, checked and kept), None when there is nothing to write (no rows and no requests)."""
    batch, hot = slot_token.shape
    rows, k = raw.shape
    programs = max(batch, rows)
    if programs == 0:
        return None
    n_words = workspace_words(batch, hot, host_loc.shape[1], 0 if row_to_batch is None else rows)
    ws = workspace.words(slot_token, n_words, workspace_given)
    if ws.data_ptr() % 8:  # the keys are int64
        ws = ws[1:]
    options = options or plan_options(target, cfg)
    r2b = row_to_batch if row_to_batch is not None else seq_lens
    index = slot_index if slot_index is not None else slot_token  # not read without one
    return Launch(
        PLAN, (programs,), options,
        (raw, seq_lens, host_loc, slot_token, slot_age, r2b, ws, out, out_copy_src, out_copy_dst, out_copy_count,
         index, batch, rows, host_loc.shape[1], -1 if host_rows is None else int(host_rows),
         raw.stride(0), raw.stride(1), seq_lens.stride(0), host_loc.stride(0), host_loc.stride(1), r2b.stride(0),
         index.stride(0)),
        dict(H=hot, K=k, K_P2=next_power_of_2(k), BLOCK_H=min(next_power_of_2(hot), cfg["BLOCK_H"]),
             DIGIT=cfg["DIGIT"], BLOCK_R=cfg["BLOCK_R"], BI=cfg["BI"], BJ=cfg["BJ"], KEEP_KEYS=cfg["KEEP_KEYS"],
             HAS_R2B=row_to_batch is not None, HAS_INDEX=slot_index is not None, FENCE=_fence(target),
             PDL=uses_pdl(target, cfg)),
    )


# AMD SGPR spills into VGPR lanes the cross-compile check allows the plan (its default is 32): with Triton 3.9 the
# builds for tensors under 2 GiB (buffer loads and stores) spill 33-35 at H 4096, k 2048 and 51-53 at H 16384, k 2048
# with row_to_batch on gfx942 and gfx950 (23-29 with global loads); no VGPR spill, no scratch. gfx942, H 16384: 53
# v_writelane and 187 v_readlane among about 6000 instructions, most in the passes' loops (VALU work, no memory
# traffic). Tried at that shape without getting under 32: BLOCK_H 2048, 8 warps, DIGIT 5, BLOCK_R 512 with BI and BJ
# 32, KEEP_KEYS, and the entry-at-a-time pointers (lengths, host_loc, row_to_batch, workspace) left to global loads
# (50).
SGPR_SPILLS = 64


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What :func:`plan_launch` builds for ``target`` (cross-compile check): H 4096 with k 512 and 2048, H 16384 with
    k 2048; int32 and int64 ``host_loc``; with and without ``row_to_batch``, with and without a slot index; unit
    column strides."""
    from indexcache.backends.triton.crosscompile import KernelSpec

    cfg = tuning["hisparse_plan"]
    specs = []
    for hot, k, host, r2b, index in ((4096, 512, "*i32", False, True), (4096, 512, "*i64", True, False),
                                     (4096, 2048, "*i64", False, False), (16384, 2048, "*i32", True, True)):
        ptrs = {"raw_ptr": "*i32", "seq_ptr": "*i32", "host_ptr": host, "tok_ptr": "*i32", "age_ptr": "*i32",
                "r2b_ptr": "*i32", "ws_ptr": "*i32", "out_ptr": "*i32", "src_ptr": "*i64", "dst_ptr": "*i32",
                "cnt_ptr": "*i32", "idx_ptr": "*i32"}
        specs.append(KernelSpec(
            "hisparse_plan", hisparse_plan_kernel, ptrs,
            {"H": hot, "K": k, "K_P2": next_power_of_2(k), "BLOCK_H": min(hot, cfg["BLOCK_H"]),
             "DIGIT": cfg["DIGIT"], "BLOCK_R": cfg["BLOCK_R"], "BI": cfg["BI"], "BJ": cfg["BJ"],
             "KEEP_KEYS": cfg["KEEP_KEYS"],
             "HAS_R2B": r2b, "HAS_INDEX": index, "FENCE": _fence(target), "PDL": uses_pdl(target, cfg),
             "raw_s1": 1, "seq_s0": 1, "host_s1": 1, "r2b_s0": 1},
            dict(plan_options(target, cfg)), aligned=("raw_s0", "host_s0", "idx_s0"), sgpr_spills=SGPR_SPILLS))
    return specs
