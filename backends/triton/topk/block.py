"""Top-k with a block a row, in Gluon (NVIDIA): the row streams through registers once, the selection never
leaves the block.

The cuda table's choice ``KERNEL = "block"``: it takes the first launch of the many-rows path (``plan.py``, in
place of ``topk_rows_kernel``) where :func:`unsupported` says nothing, and the same finishing launch follows. One
program (``NUM_WARPS`` warps, ``NT`` threads) a row at a time, persistent over rows, a stash of ``CAP`` entries a
program in the workspace:

1. Sample: ``NT × SAMPLE_J`` entries spread over the window (one a segment, jittered), one to a few a thread;
   three radix rounds in registers (``DIGIT`` bits a round, one ``gl.histogram`` a round, a bin a lane) settle the
   top bits of the sample's ``m``-th best key below the sample's common prefix: the threshold ``floor`` (a float)
   lies at or below that key (``kernels.py``'s rule for ``m``: below the row's k-th best with overwhelming odds). The
   filter's first piece is read before the sample, so that its read overlaps the sample's rounds.
2. Filter: pieces of ``NT × PIECE_J`` columns as ``[NUM_WARPS, 32 × PIECE_J]`` tensors, a warp a row; thread ``t``
   reads columns ``t, t + NT, …`` (every read coalesced; constant offsets from one address), the next piece's read
   issued before the current one is filtered, one float compare an entry. Each warp compacts its candidates (fp32
   bits and window position) into a region of the stash of its own (``CAP / NUM_WARPS`` entries) by warp ballots:
   an entry's place is the candidates of lower lanes in its ballot (``popc`` under ``%lanemask_lt``) plus those of
   the thread's earlier ballots. No block barrier a piece; the stash is in warp order, not index order.
3. Select, when the row gave ``k <= C <= CAP`` candidates and no region overflowed: the stash back in registers;
   an atomic add a candidate into ``BINS`` bin counts (its key's distance above the smallest candidate) gives the
   bin holding the k-th best. One scan gives the output slots of the candidates above that bin (written at once,
   translated when asked) and the places where the bin's own candidates, at most ``TIE_SLOTS``, are gathered;
   those are ranked by compares (by key, then position: the lower index wins ties) and the first ``k - above``
   take the remaining slots. Block-wide scans (:func:`_block_scan`) go in two levels: within each warp, then over
   the warps' totals in one warp.
4. Otherwise (the sample missed: ``C < k``; heavy ties or a region full: ``C > CAP``; more than ``TIE_SLOTS`` in
   the pivot bin: ``CAP + 1``) ``counts[r]`` leaves the row to the finishing launch's exact fallback; rows this
   kernel finished get ``counts[r] = -1``. Rows with ``len <= k`` get ``0..len-1`` then -1 here.

With ``SMEM`` (the table's ``BLOCK_SMEM``) 1 the bin counts, the warps' counts and the pivot bin's gathered
candidates live in shared memory instead of the workspace, with 2 the stash's keys too (its positions stay in the
workspace: both would be 64 KB at 8192 entries, past the 48 KB a kernel may declare): an array declared in inline
PTX (:func:`smem_words` words, a program's), since Gluon has no store, load or atomic at computed places of its own
shared buffers. Each of those accesses is then a shared-memory one instead of an L2 round trip (docs/kernels.md,
"The select in shared memory").

Keys as in ``kernels.py`` (fp32 bits with negatives' magnitude flipped, -0.0 as +0.0, NaN and -inf below every
valid key, never selected in a long row). No allocation, no host sync; the grid depends on the shape only.

Gluon does not run under the interpreter: the CPU checks cover the host side and the cross-compile check builds
the kernel; the conformance suite runs it on an NVIDIA GPU. ROCm keeps the Triton kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from indexcache.backends.triton.launcher import Launch, Launcher, Options, launch_key_options
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
from indexcache.backends.triton.sm90 import block_barrier, grid_dependency_wait, launch_dependents
from indexcache.backends.triton.support import next_power_of_2
from indexcache.backends.triton.target import Target

WARP = 32
MAX_STASH = 8192  # stash entries a program: the select holds each one's key and position in registers
MAX_K = MAX_STASH // 4  # the largest k: a quarter of the largest stash
LOG_BINS = gl.constexpr(11)
BINS = 1 << LOG_BINS.value  # the candidates' bins (bin counts a program)
TIE_SLOTS = 256  # the most candidates the pivot bin may hold to be ranked here (more: the exact fallback)
# 32 warps leave 64 registers a thread. With Triton 3.9, ptxas keeps a stack frame of up to 16 bytes in some builds
# (8 on sm89 and sm90, 16 on sm120): program addresses stored once a program and loaded once a row; 24 on sm120 where
# the filter counts the bins (FLOORS 2; where it is loaded not yet read). The compile check allows that much.
# Triton 3.6's sm90 builds keep 48-56 bytes, stored and loaded once a row or once a radix round of the sample, never
# in the filter's loop. Under BLOCK_SMEM some strided-score builds keep 32 bytes with 3.9, stored and loaded once a row.
STACK_BYTES = 32
# SMEM: the program's shared words (bin counts, warp counts, the pivot bin's keys and positions; with 2 the stash's
# keys after them), declared once in the kernel's PTX (block-scoped: a second declaration would be a second array, so
# the kernel declares it once, at its start; a CPU test counts the declarations).
SMEM_NAME = "ic_topk_block_words"


def smem_words(smem: int) -> int:
    """int32 words a program declares in shared memory under ``BLOCK_SMEM`` = ``smem`` (0: none)."""
    return 0 if not smem else BINS + 32 + 2 * TIE_SLOTS + (MAX_STASH if smem == 2 else 0)


def _smem_decl(smem: int) -> gl.constexpr:
    """The PTX that declares the program's shared words under ``BLOCK_SMEM`` = ``smem`` and gives their address."""
    return gl.constexpr(f"{{ .shared .align 16 .b32 {SMEM_NAME}[{smem_words(smem)}]; mov.u32 $0, {SMEM_NAME}; }}")


_SMEM_DECL, _SMEM_DECL_STASH = _smem_decl(1), _smem_decl(2)
_SMEM_LOAD = gl.constexpr("ld.shared.b32 $0, [$1];")
_SMEM_STORE_ALL = gl.constexpr("st.shared.b32 [$1], $2; mov.u32 $0, 0;")
_SMEM_STORE = gl.constexpr("{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.shared.b32 [$1], $2; mov.u32 $0, 0; }")
_SMEM_ADD = gl.constexpr("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p red.shared.add.u32 [$1], 1; mov.u32 $0, 0; }")


@gluon.jit
def _smem_base(pid, STASH: gl.constexpr):
    """The shared address of the program's int32 words (:func:`smem_words`; ``STASH``: room for the stash's keys
    too; ``pid``: any scalar, for the shape)."""
    if STASH:
        return gl.inline_asm_elementwise(_SMEM_DECL_STASH, "=r,r", [pid], dtype=gl.int32, is_pure=False, pack=1)
    else:
        return gl.inline_asm_elementwise(_SMEM_DECL, "=r,r", [pid], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _get(buf, i, SMEM: gl.constexpr, m=None, other=0):
    """``buf[i]`` (where ``m``, else ``other``; None: every ``i``): int32 words in global memory (read past L1:
    other threads of the program wrote them) or, with ``SMEM``, at the shared address ``buf`` (``i`` taken as 0
    where not ``m``, so nothing outside the words is read)."""
    if SMEM:
        if m is None:
            v = gl.inline_asm_elementwise(_SMEM_LOAD, "=r,r", [buf + i * 4], dtype=gl.int32, is_pure=False, pack=1)
        else:
            v = gl.where(m, gl.inline_asm_elementwise(_SMEM_LOAD, "=r,r", [buf + gl.where(m, i, 0) * 4],
                                                      dtype=gl.int32, is_pure=False, pack=1), other)
    elif m is None:
        v = gl.load(buf + i, cache_modifier=".cg")
    else:
        v = gl.load(buf + i, mask=m, other=other, cache_modifier=".cg")
    return v


@gluon.jit
def _put(buf, i, v, SMEM: gl.constexpr, m=None):
    """``buf[i] = v`` (where ``m``; None: every ``i``) in global memory, or with ``SMEM`` the shared words at
    ``buf``."""
    if SMEM:
        if m is None:
            gl.inline_asm_elementwise(_SMEM_STORE_ALL, "=r,r,r", [buf + i * 4, v], dtype=gl.int32, is_pure=False,
                                      pack=1)
        else:
            gl.inline_asm_elementwise(_SMEM_STORE, "=r,r,r,r", [buf + gl.where(m, i, 0) * 4, v, m.to(gl.int32)],
                                      dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.store(buf + i, v, mask=m)


@gluon.jit
def _count(buf, i, m, SMEM: gl.constexpr):
    """``buf[i] += 1`` where ``m``, atomically (global memory, relaxed, or with ``SMEM`` the shared words)."""
    if SMEM:
        gl.inline_asm_elementwise(_SMEM_ADD, "=r,r,r", [buf + gl.where(m, i, 0) * 4, m.to(gl.int32)],
                                  dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.atomic_add(buf + i, gl.full_like(i, 1), mask=m, sem="relaxed")


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _min_max(a_min, a_max, b_min, b_max):
    return gl.minimum(a_min, b_min), gl.maximum(a_max, b_max)


@gluon.jit
def _max_sum(a_max, a_sum, b_max, b_sum):
    return gl.maximum(a_max, b_max), a_sum + b_sum


@gluon.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@gluon.jit
def _block_scan(x, J: gl.constexpr, NUM_WARPS: gl.constexpr, REVERSE: gl.constexpr):
    """Inclusive scan (``REVERSE``: from the end) of the int32 ``x`` laid out ``J`` entries a thread, each warp a
    contiguous ``32 × J`` of them: a scan within each warp, then one within a warp over the ``NUM_WARPS`` warp totals
    (through shared memory, two barriers), added back."""
    ROW_L: gl.constexpr = gl.BlockedLayout([1, J], [1, 32], [NUM_WARPS, 1], [1, 0])
    LANE_L: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    x2 = gl.convert_layout(gl.reshape(x, [NUM_WARPS, 32 * J]), ROW_L)
    inc = gl.associative_scan(x2, 1, _add, reverse=REVERSE)
    totals = gl.allocate_shared_memory(gl.int32, [NUM_WARPS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    offsets = gl.allocate_shared_memory(gl.int32, [NUM_WARPS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    totals.store(gl.sum(x2, 1))
    block_barrier()
    t = totals.load(LANE_L)
    offsets.store(gl.associative_scan(t, 0, _add, reverse=REVERSE) - t)
    block_barrier()
    out = inc + offsets.load(gl.SliceLayout(1, ROW_L))[:, None]
    return gl.convert_layout(gl.reshape(out, [NUM_WARPS * 32 * J]), x.type.layout)


@gluon.jit
def _select(key, need, count, DIGIT: gl.constexpr, HIST: gl.constexpr, ROUNDS: gl.constexpr):
    """Radix select of the ``need``-th largest of the order keys ``key`` (INT_MIN: no entry), ``count`` of them
    valid: the pivot's settled bits in the unsigned order (``key ^ INT_MIN``), its unsettled bits 0, so a key at or
    below the ``need``-th largest. The rounds start below the common prefix of the smallest and largest key and stop
    as soon as the pivot's digit holds exactly the entries still needed, or after ``ROUNDS``."""
    NB: gl.constexpr = 1 << DIGIT
    valid = key != INT_MIN
    kmin = gl.min(gl.where(valid, key, INT_MAX), 0)
    kmax = gl.max(key, 0)
    low = gl.where(need > 0, below_common_prefix(kmin, kmax), 0)
    fixed = ~low
    thr = (kmin ^ INT_MIN) & fixed
    u = key ^ INT_MIN
    bins = gl.arange(0, NB, layout=HIST)
    take = gl.to_tensor(need)  # k arrives as a constant when it is 1
    matched = gl.to_tensor(count)
    done = (take <= 0).to(gl.int32)
    for r in range(ROUNDS):  # a loop, not unrolled: one copy of the round's code
        lo = gl.maximum(32 - DIGIT * (r + 1), 0)
        if (((~fixed) >> lo) != 0) & (done == 0):
            m = valid & (((u ^ thr) & fixed) == 0)
            hist = gl.histogram((u >> lo) & (NB - 1), NB, mask=m, layout=HIST)
            at_or_above = gl.associative_scan(hist, 0, _add, reverse=True)
            digit = gl.sum((at_or_above >= take).to(gl.int32), 0) - 1
            above = gl.sum(gl.where(bins > digit, hist, 0), 0)
            matched = gl.sum(gl.where(bins == digit, hist, 0), 0)
            take -= above
            thr = thr | (digit << lo)
            fixed = fixed | ((NB - 1) << lo)
            done = (matched == take).to(gl.int32)
    return thr


@gluon.jit
def _sample_floor(row_ptr, s1, start, length, k, CONTIG: gl.constexpr, SAMPLES: gl.constexpr,
                  SAMPLE_L: gl.constexpr, DIGIT: gl.constexpr, HIST: gl.constexpr):
    """The filter threshold of a row (``length > 0``) as a float: at or below the key of the ``m``-th best of
    ``SAMPLES`` entries spread over the window (``rows.sample_positions``), ``m = λ + 4·√λ + 2`` with
    ``λ = SAMPLES·k/length`` (the lowest finite float when fewer than ``m`` are valid). Three rounds settle the
    key's top bits below the sample's common prefix (the threshold may lie up to a 64th of an octave below the
    ``m``-th best: a few more candidates, two fewer rounds)."""
    i = gl.arange(0, SAMPLES, layout=SAMPLE_L)
    pos = sample_positions(i, start, length, SAMPLES)
    key = order_key(score_bits(load(row_ptr, s1, pos, i < SAMPLES, CONTIG)))
    valid = gl.sum((key != INT_MIN).to(gl.int32), 0)
    lam = (k * 1.0) * SAMPLES / length.to(gl.float32)  # k may arrive as a constexpr (1 is specialised)
    m = (lam + 4.0 * gl.sqrt(lam) + 3.0).to(gl.int32)  # >= ceil(λ + 4√λ + 2)
    thr = _select(key, gl.minimum(m, valid), valid, DIGIT, HIST, 3)
    return _key_float(gl.where(valid >= m, thr ^ INT_MIN, KEY_MIN_VALID))


@gluon.jit
def _key_float(key):
    """The float whose order key is ``key`` (a valid key)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(gl.float32, bitcast=True)


@gluon.jit
def _piece(row_ptr, s1, c0, hi, across, along, CONTIG: gl.constexpr, FULL: gl.constexpr):
    """Raw scores of the piece at column ``c0``: thread ``t`` reads columns ``c0 + t + j·NT`` (``across``: the
    thread's offset, ``along``: each entry's), -inf at and past ``hi`` unless the piece is ``FULL``. The thread's
    address is formed once and each entry's is a constant offset from it."""
    if CONTIG:
        ptrs = ((row_ptr + c0) + across) + along
    else:
        ptrs = row_ptr + (c0 + across + along).to(gl.int64) * s1
    if FULL:
        x = gl.load(ptrs)
    else:
        x = gl.load(ptrs, mask=across + along < hi - c0, other=float("-inf"))
    return x


@gluon.jit
def _filter(x, row_ptr, s1, start, length, floor, stash_bits, stash_idx, warp_counts, across, along, hist, kmin,
            shift, CONTIG: gl.constexpr, PIECE: gl.constexpr, CAP: gl.constexpr, NUM_WARPS: gl.constexpr,
            COUNT: gl.constexpr, BINS: gl.constexpr, SMEM: gl.constexpr):
    """Entries of the window ``>= floor`` (a float: NaN, -inf and masked entries never pass; -0.0 passes with +0.0)
    to the stash (fp32 bits, window positions), piece by piece from the first, ``x`` (read by the caller before
    the sample, so that its read overlaps the sample's select), each piece's read issued before the one before it
    is filtered (whole pieces unmasked). The pieces are ``[NUM_WARPS, …]`` tensors, a warp a row: each warp compacts
    its candidates into a region of its own (``CAP / NUM_WARPS`` entries, in order) by a ballot an entry, so no
    piece waits on a block barrier, and writes its count to ``warp_counts``. Returns the candidates in all, or
    ``CAP + 1`` when a region overflowed. ``COUNT``: each stashed candidate also adds one to its bin in ``hist``
    (:func:`_level` of its key above ``kmin`` by ``shift``). ``SMEM``: ``hist`` and ``warp_counts`` are shared
    addresses, with 2 ``stash_bits`` too."""
    REGION: gl.constexpr = CAP // NUM_WARPS
    PJ: gl.constexpr = PIECE // (NUM_WARPS * 32)
    L3: gl.constexpr = gl.BlockedLayout([1, 1, PJ], [1, 32, 1], [NUM_WARPS, 1, 1], [2, 1, 0])
    hi = start + length
    w = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, across.type.layout))
    region = (w * REGION)[:, None]
    held = w * 0
    for c0 in range(start, hi, PIECE):
        nxt = c0 + PIECE
        if nxt + PIECE <= hi:
            x_next = _piece(row_ptr, s1, nxt, hi, across, along, CONTIG, True)
        else:
            x_next = _piece(row_ptr, s1, nxt, hi, across, along, CONTIG, False)
        cand = (x.to(gl.float32) >= floor).to(gl.int32)
        # Entry j of every lane: a ballot of the warp's candidates; its place is the candidates of lower lanes in the
        # same ballot plus those of the thread's ballots before j (the same in every lane).
        bal = gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $1, 0; vote.sync.ballot.b32 $0, p, 0xffffffff; }", "=r,r", [cand],
            dtype=gl.int32, is_pure=False, pack=1)
        below = gl.inline_asm_elementwise("{ .reg .b32 m; mov.u32 m, %lanemask_lt; and.b32 m, m, $1; popc.b32 $0, m; }",
                                          "=r,r", [bal], dtype=gl.int32, is_pure=True, pack=1)
        cnt = gl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [bal], dtype=gl.int32, is_pure=True, pack=1)
        cnt3 = gl.convert_layout(gl.reshape(cnt, [NUM_WARPS, 32, PJ]), L3)
        pre3 = gl.associative_scan(cnt3, 2, _add) - cnt3
        pre = gl.convert_layout(gl.reshape(pre3, [NUM_WARPS, 32 * PJ]), x.type.layout)
        entry = held[:, None] + pre + below
        keep = (cand != 0) & (entry < REGION)
        if SMEM == 2:
            _put(stash_bits, region + entry, score_bits(x), True, keep)
        else:  # the workspace's address formed as before SMEM (the same code as then)
            gl.store(stash_bits + region + entry, score_bits(x), mask=keep)
        gl.store(stash_idx + region + entry, (c0 - start) + (across + along), mask=keep)
        if COUNT:
            _count(hist, _level(order_key(score_bits(x)), kmin, shift, BINS), keep, SMEM)
        held += gl.convert_layout(gl.max(gl.sum(cnt3, 2), 1), held.type.layout)
        x = x_next
    _put(warp_counts, w, held, SMEM)
    most, total = gl.reduce((held, held), 0, _max_sum)  # one block-wide reduction for both
    return gl.where(most > REGION, CAP + 1, total)


@gluon.jit
def _prefetch_row(scores_ptr, lengths_ptr, starts_ptr, r, rows, cols, k, s_s0, len_s0, st_s0,
                  HAS_STARTS: gl.constexpr, NT: gl.constexpr, LINE_L: gl.constexpr):
    """Row ``r``'s window (contiguous scores), where it is a long row of this call, into L2 (``prefetch.global.L2``,
    a 32-entry stretch a thread a step: a hint, nothing read into registers), so that its filter reads L2 rather
    than DRAM: issued after the row before it was filtered, it arrives while that row is selected."""
    if r < rows:
        start, length, _ = window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
        if length > k:
            row_ptr = scores_ptr + r.to(gl.int64) * s_s0 + start
            t = gl.arange(0, NT, layout=LINE_L) * 32
            for c0 in range(0, length, NT * 32):
                gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                          [row_ptr + gl.minimum(c0 + t, length - 1)], dtype=gl.int32,
                                          is_pure=False, pack=1)


@gluon.jit
def _bin_counts(level, m, hist, need, BINS: gl.constexpr, BIN_L: gl.constexpr, NUM_WARPS: gl.constexpr,
                ADD: gl.constexpr, SMEM: gl.constexpr):
    """Counts of the candidates ``m`` by ``level`` (their bin, ``< BINS``) through ``hist`` (``BINS`` int32 in global
    memory, or with ``SMEM`` shared, zeroed; an atomic add a candidate, unless ``ADD`` is false: counted already):
    ``(p, above, in_p)``, the
    bin holding the ``need``-th best and the candidates above it and in it."""
    if ADD:
        _count(hist, level, m, SMEM)
    block_barrier()
    b = gl.arange(0, BINS, layout=BIN_L)
    counts = _get(hist, b, SMEM)
    at_or_above = _block_scan(counts, BINS // (32 * NUM_WARPS), NUM_WARPS, True)
    # The pivot is the one bin whose count at or above reaches need and whose count above does not (-1: none): its
    # index, the count above it and its own, in one block-wide reduction.
    pivot = (at_or_above >= need) & (at_or_above - counts < need)
    p1, above, in_p = gl.reduce((gl.where(pivot, b + 1, 0), gl.where(pivot, at_or_above - counts, 0),
                                 gl.where(pivot, counts, 0)), 0, _add3)
    return p1 - 1, above, in_p


@gluon.jit
def _zero(hist, BINS: gl.constexpr, BIN_L: gl.constexpr, SMEM: gl.constexpr):
    """Zero the ``BINS`` bin counts at ``hist`` (global, or with ``SMEM`` shared)."""
    b = gl.arange(0, BINS, layout=BIN_L)
    _put(hist, b, gl.zeros([BINS], gl.int32, layout=BIN_L), SMEM)


@gluon.jit
def _level(key, kmin, shift, BINS: gl.constexpr):
    """The first bins' level of keys at or above ``kmin``: their distance above it with the low ``shift`` bits
    dropped, the last of ``BINS`` bins taking every key beyond."""
    return gl.minimum(_distance(key, kmin) >> shift.to(gl.uint32), BINS - 1).to(gl.int32)


@gluon.jit
def _distance(key, kmin):
    """The order keys' distance above ``kmin`` (none below it), as uint32. :func:`_pivot_bin` computes it again where
    it needs it rather than keeping it: one subtraction an entry, against 8 more registers a thread live through the
    bin counts, at a cap of 64."""
    return (key - kmin).to(gl.uint32, bitcast=True)


@gluon.jit
def _pivot_bin(key, m, hist, k, kmin, shift, TIE_SLOTS: gl.constexpr, BINS: gl.constexpr, BIN_L: gl.constexpr,
               NUM_WARPS: gl.constexpr, GIVEN: gl.constexpr, COUNTED: gl.constexpr, SMEM: gl.constexpr):
    """The range of keys holding the k-th best of the candidates ``key`` (``m``: which slots hold one): ``BINS``
    bins over their distance above the smallest, low bits dropped so that the largest falls in the last, counted
    through ``hist`` (``BINS`` int32 in global memory, zeroed). While the pivot bin holds more than ``TIE_SLOTS``
    and has low bits left, its candidates are binned again by the next ``LOG_BINS`` bits (the bins are linear in the
    keys' bits: a row whose candidates run from a negative k-th best to large positive scores spans every octave
    between, and the first round puts thousands in the k-th best's bin). Returns ``(gt, inside, above, in_p)``: the
    slots above the range and in it, and how many of each. ``GIVEN``: the first bins start at ``kmin`` (at or below
    every candidate) and drop ``shift`` bits (the row's sample record), else they span the candidates exactly; a
    pivot bin that is the last of those (it may hold keys beyond its range) gives ``in_p = TIE_SLOTS + 1``.
    ``COUNTED``: the first bins were counted by the filter."""
    if not GIVEN:
        kmin, kmax = gl.reduce((gl.where(m, key, INT_MAX), gl.where(m, key, INT_MIN)), 0, _min_max)
        span = (kmax - kmin).to(gl.uint32, bitcast=True)
        # The fewest low bits to drop so that ``span >> shift < BINS``, from the float exponent of ``span`` (rounding
        # may drop one more).
        top = (span.to(gl.float32).to(gl.int32, bitcast=True) >> 23) - 127  # floor(log2(span)); -127 for 0
        shift = gl.maximum(top + 1 - LOG_BINS, 0)
    p, above, in_p = _bin_counts(_level(key, kmin, shift, BINS), m, hist, k, BINS, BIN_L, NUM_WARPS, not COUNTED,
                                 SMEM)
    if GIVEN:
        last = p == BINS - 1
        in_p = gl.where(last, TIE_SLOTS + 1, in_p)
        shift = gl.where(last, 0, shift)
    base = p.to(gl.uint32) << shift.to(gl.uint32)  # the pivot bin's smallest distance
    for _ in range(2):  # span < 2^32: a first shift of at most 22 bits, two rounds of LOG_BINS settle the rest
        if (in_p > TIE_SLOTS) & (shift > 0):
            d = _distance(key, kmin)
            inside = m & (d >= base) & (((d - base) >> shift.to(gl.uint32)) == 0)
            shift = gl.maximum(shift - LOG_BINS, 0)
            _zero(hist, BINS, BIN_L, SMEM)
            block_barrier()  # every thread has read the counts before, and zeroed its bins
            level = ((d - base) >> shift.to(gl.uint32)).to(gl.int32)
            p, more, in_p = _bin_counts(gl.where(inside, level, 0), inside, hist, k - above, BINS, BIN_L, NUM_WARPS,
                                        True, SMEM)
            above += more
            base += p.to(gl.uint32) << shift.to(gl.uint32)
    d = _distance(key, kmin)
    low = m & (d >= base)
    beyond = ((d - base) >> shift.to(gl.uint32)) != 0
    return low & beyond, low & ~beyond, above, in_p


@gluon.jit
def _rank_pivot_bin(bin_key, bin_idx, in_p, above, k, out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages,
                    page_size, TRANSLATE: gl.constexpr, HAS_RAW: gl.constexpr, SHIFT: gl.constexpr,
                    TIE_SLOTS: gl.constexpr, RANK_L: gl.constexpr, SMEM: gl.constexpr):
    """The pivot bin's ``in_p <= TIE_SLOTS`` candidates (order keys ``bin_key``, window positions ``bin_idx``, in
    global memory, or with ``SMEM`` shared) ranked by key, then position (the lower index wins ties): the first
    ``k - above`` go to slots ``above + rank``. A candidate's rank counts those ahead of it, 32 at a time
    (``RANK_L``: a ``[TIE_SLOTS, 32]`` tile, a candidate a row, those it is compared with a lane each)."""
    i = gl.arange(0, TIE_SLOTS, layout=gl.SliceLayout(1, RANK_L))
    key = _get(bin_key, i, SMEM, i < in_p, INT_MIN)
    idx = _get(bin_idx, i, SMEM, i < in_p, INT_MAX)
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, RANK_L))
    rank = i * 0
    for j0 in range(0, in_p, 32):  # slots past in_p hold (INT_MIN, INT_MAX): never ahead of a candidate
        j = j0 + lane
        key_j = _get(bin_key, j, SMEM, j < in_p, INT_MIN)[None, :]
        idx_j = _get(bin_idx, j, SMEM, j < in_p, INT_MAX)[None, :]
        ahead = (key_j > key[:, None]) | ((key_j == key[:, None]) & (idx_j < idx[:, None]))
        rank += gl.sum(ahead.to(gl.int32), 1)
    emit(out_row, o_s1, raw_row, w_s1, above + rank, idx, (i < in_p) & (rank < k - above), seq, b_ok, tab_row, tab_s1,
         pages, page_size, TRANSLATE, HAS_RAW, SHIFT)


@gluon.jit
def _select_row(stash_bits, stash_idx, hist, warp_counts, bin_key, bin_idx, k, kmin, shift, q, out_row, o_s1, raw_row,
                w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size, TRANSLATE: gl.constexpr, HAS_RAW: gl.constexpr,
                SHIFT: gl.constexpr, BINS: gl.constexpr, BIN_L: gl.constexpr, REGION: gl.constexpr,
                TIE_SLOTS: gl.constexpr, RANK_L: gl.constexpr, NUM_WARPS: gl.constexpr, STASH_J: gl.constexpr,
                FLOORS: gl.constexpr, SMEM: gl.constexpr):
    """The row's top-k among its stashed candidates (at least ``k``, the first ``warp_counts[w]`` of each warp's
    region of ``REGION`` slots; ``q``: the stash's slots in the tensor's order) to output slots ``[0, k)``: the
    candidates' bin counts give the bin holding the k-th best (:func:`_pivot_bin`, binned again where it holds
    too many); those above it go out, and those in it (gathered at ``bin_key`` / ``bin_idx``) are ranked
    (:func:`_rank_pivot_bin`). Returns whether it did: not when the pivot bin still holds more than ``TIE_SLOTS``
    (heavy ties: equal keys; the row is left to the exact fallback)."""
    m = (q % REGION) < _get(warp_counts, q // REGION, SMEM)  # each warp's region holds its candidates first
    if SMEM == 2:
        key = order_key(_get(stash_bits, q, True, m))
    else:  # read through L1 as before SMEM (the stash was written before the block barrier, by this SM)
        key = order_key(gl.load(stash_bits + q, mask=m, other=0))
    above_p, inside, above, in_p = _pivot_bin(key, m, hist, k, kmin, shift, TIE_SLOTS, BINS, BIN_L, NUM_WARPS,
                                              FLOORS > 0, FLOORS == 2, SMEM)
    done = in_p <= TIE_SLOTS
    if done:
        idx = gl.load(stash_idx + q, mask=m, other=-1)
        gt = above_p.to(gl.int32)
        both = gt + (inside.to(gl.int32) << 16)  # C <= 8192: both counts fit in 16 bits
        slots = _block_scan(both, STASH_J, NUM_WARPS, False) - both
        emit(out_row, o_s1, raw_row, w_s1, slots & 0xFFFF, idx, gt != 0, seq, b_ok, tab_row, tab_s1, pages, page_size,
             TRANSLATE, HAS_RAW, SHIFT)
        _put(bin_key, slots >> 16, key, SMEM, inside)
        _put(bin_idx, slots >> 16, idx, SMEM, inside)
        block_barrier()  # the pivot bin's candidates were gathered by other threads
        _rank_pivot_bin(bin_key, bin_idx, in_p, above, k, out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1,
                        pages, page_size, TRANSLATE, HAS_RAW, SHIFT, TIE_SLOTS, RANK_L, SMEM)
    return done


# Per call sizes and the index tensors' and workspace's addresses take no part in the variant (kernels.py says which);
# nor the scores' row stride: a thread's entries of a piece are a block's width apart, so no read is vectorized.
@gluon.jit(do_not_specialize=("rows", "cols", "batches", "pages", "s_s0", "tab_s0"),
           do_not_specialize_on_alignment=("lengths_ptr", "starts_ptr", "r2b_ptr", "table_ptr", "stash_ptr",
                                           "counts_ptr", "floors_ptr"))
def topk_block_kernel(
    scores_ptr, lengths_ptr, starts_ptr, out_ptr, raw_ptr, r2b_ptr, table_ptr, stash_ptr, counts_ptr, floors_ptr,
    rows, cols, k, batches, pages, page_size,
    s_s0, s_s1, len_s0, st_s0, o_s0, o_s1, w_s0, w_s1, r2b_s0, tab_s0, tab_s1,
    HAS_STARTS: gl.constexpr, HAS_R2B: gl.constexpr, TRANSLATE: gl.constexpr, HAS_RAW: gl.constexpr,
    SHIFT: gl.constexpr, CONTIG: gl.constexpr, DIGIT: gl.constexpr, PIECE_J: gl.constexpr, SAMPLE_J: gl.constexpr,
    STASH_J: gl.constexpr, NUM_WARPS: gl.constexpr, BINS: gl.constexpr, TIE_SLOTS: gl.constexpr, PDL: gl.constexpr,
    FLOORS: gl.constexpr, PREFETCH: gl.constexpr, SMEM: gl.constexpr,
):
    """One row at a time a program (persistent over rows; the pivot bin's gathered candidates, ``2 × TIE_SLOTS``
    int32, the program's stash, ``2 × CAP``, bin counts, ``BINS``, and warp counts, ``NUM_WARPS``, at
    ``stash_ptr``; with ``SMEM`` 1 all but the stash in shared memory, with 2 all but the stash's positions):
    sample, filter, select, translate and fill (module docstring); ``counts[r]`` -1 for rows
    finished here, else the count that sends the row to the finishing launch (its candidates, or ``CAP + 1``).
    ``PDL``: launched with programmatic dependent launch (it waits for the launch before it first, and lets the
    finishing launch's programs take the multiprocessors it leaves idle)."""
    if PDL:
        grid_dependency_wait()
        launch_dependents()
    NT: gl.constexpr = NUM_WARPS * 32
    CAP: gl.constexpr = NT * STASH_J
    PIECE_L: gl.constexpr = gl.BlockedLayout([1, PIECE_J], [1, 32], [NUM_WARPS, 1], [1, 0])  # a warp a row
    SAMPLE_L: gl.constexpr = gl.BlockedLayout([SAMPLE_J], [32], [NUM_WARPS], [0])
    STASH_L: gl.constexpr = gl.BlockedLayout([STASH_J], [32], [NUM_WARPS], [0])
    HIST: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])  # a bin a lane, in every warp
    BIN_L: gl.constexpr = gl.BlockedLayout([BINS // NT], [32], [NUM_WARPS], [0])
    RANK_L: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NUM_WARPS, 1], [1, 0])
    pid = gl.program_id(0)
    bin_key = stash_ptr + pid.to(gl.int64) * (2 * TIE_SLOTS + 2 * CAP + BINS + NUM_WARPS)
    bin_idx = bin_key + TIE_SLOTS
    stash_bits = bin_idx + TIE_SLOTS
    stash_idx = stash_bits + CAP
    if SMEM:  # the program's shared words: bin counts, warp counts, the pivot bin's keys and positions (and keys)
        hist = _smem_base(pid, SMEM == 2)
        warp_counts = hist + 4 * BINS
        bin_key = warp_counts + 4 * 32
        bin_idx = bin_key + 4 * TIE_SLOTS
        if SMEM == 2:
            stash_bits = bin_idx + 4 * TIE_SLOTS
    else:
        hist = stash_idx + CAP
        warp_counts = hist + BINS
    w = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, PIECE_L))[:, None]
    i = gl.arange(0, 32 * PIECE_J, layout=gl.SliceLayout(0, PIECE_L))[None, :]
    across = w * 32 + i // PIECE_J  # thread t's j-th entry of a piece: column t + j·NT
    along = (i % PIECE_J) * NT + w * 0
    q = gl.arange(0, CAP, layout=STASH_L)
    if FLOORS == 2:
        _zero(hist, BINS, BIN_L, SMEM)
        block_barrier()
    for r in range(pid, rows, gl.num_programs(0)):
        start, length, seq = window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS)
        r64 = r.to(gl.int64)
        out_row = out_ptr + r64 * o_s0
        raw_row = raw_ptr + r64 * w_s0
        b_ok, tab_row = row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B)
        count = length * 0 - 1
        if length > k:
            row_ptr = scores_ptr + r64 * s_s0
            if FLOORS != 2:
                _zero(hist, BINS, BIN_L, SMEM)
            first = _piece(row_ptr, s_s1, start, start + length, across, along, CONTIG, False)
            if FLOORS > 0:  # the row's sample record: its threshold's key and the first bins' shift
                kmin = gl.load(floors_ptr + 2 * r64)
                shift = gl.load(floors_ptr + 2 * r64 + 1)
                floor = _key_float(kmin)
            else:
                kmin = 0
                shift = 0
                floor = _sample_floor(row_ptr, s_s1, start, length, k, CONTIG, NT * SAMPLE_J, SAMPLE_L, DIGIT, HIST)
            count = _filter(first, row_ptr, s_s1, start, length, floor, stash_bits, stash_idx, warp_counts, across,
                            along, hist, kmin, shift, CONTIG, NT * PIECE_J, CAP, NUM_WARPS, FLOORS == 2, BINS, SMEM)
            if PREFETCH and CONTIG:  # the program's next row, while this one is selected
                _prefetch_row(scores_ptr, lengths_ptr, starts_ptr, r + gl.num_programs(0), rows, cols, k, s_s0, len_s0,
                              st_s0, HAS_STARTS, NT, HIST)
            if (count >= k) & (count <= CAP):
                block_barrier()  # the stash was written by other threads of this program
                done = _select_row(stash_bits, stash_idx, hist, warp_counts, bin_key, bin_idx, k, kmin, shift, q,
                                   out_row, o_s1, raw_row, w_s1, seq, b_ok, tab_row, tab_s1, pages, page_size,
                                   TRANSLATE, HAS_RAW, SHIFT, BINS, BIN_L, CAP // NUM_WARPS, TIE_SLOTS, RANK_L,
                                   NUM_WARPS, STASH_J, FLOORS, SMEM)
                count = gl.where(done, -1, CAP + 1)  # CAP + 1: the finishing launch's exact fallback
            if FLOORS == 2:  # for the next row's filter: after every thread's adds (a row the select skipped has
                block_barrier()  # had no barrier since its filter), before the final barrier below
                _zero(hist, BINS, BIN_L, SMEM)
        else:
            for j0 in range(0, k, CAP):  # a short row: 0 .. len-1, then -1
                j = j0 + q
                emit(out_row, o_s1, raw_row, w_s1, j, gl.where(j < length, j, -1), j < k, seq, b_ok, tab_row, tab_s1,
                     pages, page_size, TRANSLATE, HAS_RAW, SHIFT)
        gl.store(counts_ptr + r, count)
        block_barrier()  # the next row reuses the stash


BLOCK = Launcher(topk_block_kernel)


def shape(cols: int, k: int, samples: int, cfg: Mapping[str, Any]) -> dict[str, int]:
    """The kernel's shape for rows of ``cols`` columns and ``samples`` sample entries a row (``plan.sample_size``):
    ``NUM_WARPS`` (``BLOCK_WARPS``), ``PIECE_J`` columns a thread a piece (``BLOCK_PIECE_J``), ``PREFETCH`` (the
    program's next row into L2 while a row is selected: ``BLOCK_PREFETCH``), ``SAMPLE_J`` sample
    entries a thread (at least one), ``STASH_J`` stash entries a thread (room for ``8 × k`` candidates, at least two
    a thread, at most ``MAX_STASH`` in all: a row gives about 1.6–3 × k, and each warp's region must hold its share
    with room for the spread between warps), ``BINS``, ``TIE_SLOTS``, ``SMEM`` (``BLOCK_SMEM``: 1 the bin counts and the
    pivot bin's candidates in shared memory, 2 the stash's keys too)."""
    threads = cfg["BLOCK_WARPS"] * WARP
    return {"NUM_WARPS": cfg["BLOCK_WARPS"], "PIECE_J": cfg["BLOCK_PIECE_J"], "SAMPLE_J": max(1, samples // threads),
            "STASH_J": max(2, min(MAX_STASH, 8 * next_power_of_2(k)) // threads), "BINS": BINS,
            "TIE_SLOTS": TIE_SLOTS, "FLOORS": 0, "PREFETCH": cfg.get("BLOCK_PREFETCH", 0),
            "SMEM": cfg.get("BLOCK_SMEM", 0)}


def sampled_ahead(named: Mapping[str, int], floors: int) -> dict[str, int]:
    """The shape ``named`` for rows sampled ahead by the sample launch (``floors``: the table's ``BLOCK_FLOORS``): the
    block kernel reads each row's record, and no next row is prefetched (the rows' own filters were faster: H200,
    4096 x 32K, 719 µs against 744; docs/kernels.md, "Rows sampled ahead")."""
    return {**named, "FLOORS": floors, "PREFETCH": 0}


def samples(named: Mapping[str, int]) -> int:
    """Sample entries a row of a program of the given shape."""
    return named["NUM_WARPS"] * WARP * named["SAMPLE_J"]


def capacity(named: Mapping[str, int]) -> int:
    """Stash entries a program of the given shape."""
    return named["NUM_WARPS"] * WARP * named["STASH_J"]


def workspace(named: Mapping[str, int]) -> int:
    """int32 words of workspace a program of the given shape takes (its stash, bin counts, warp counts and the pivot
    bin's gathered candidates)."""
    return 2 * capacity(named) + named["BINS"] + named["NUM_WARPS"] + 2 * named["TIE_SLOTS"]


def options(named: Mapping[str, int]) -> Options:
    """Launch options of a program of the given shape (``PDL``: with programmatic dependent launch)."""
    return launch_key_options({"num_warps": named["NUM_WARPS"], **({"launch_pdl": True} if named["PDL"] else {})})


def builds_for(target: Target) -> bool:
    """Whether the kernel builds for ``target``: its warp ballots are inline PTX over 32-lane warps."""
    return target.gpu.vendor.asm == "ptx"


def unavailable(target: Target, cfg: Mapping[str, Any]) -> list[str]:
    """Why this kernel takes no call on ``target`` with the top-k's tuning entry ``cfg`` (empty: it takes those of a k
    up to :data:`MAX_K`)."""
    reasons = []
    if target.interpreted or not builds_for(target):
        reasons.append(f"{target.arch}{' interpreted' if target.interpreted else ''}: NVIDIA GPUs only (Gluon)")
    if cfg.get("KERNEL") != "block":
        reasons.append(f"the tuning table's KERNEL is {cfg.get('KERNEL')!r}, not 'block'")
    return reasons


def unsupported(k: int, target: Target, cfg: Mapping[str, Any]) -> list[str]:
    """Why this kernel cannot take a call (empty: it can; the Triton kernels take the others)."""
    reasons = unavailable(target, cfg)
    if k > MAX_K:
        reasons.append(f"k {k}: at most {MAX_K}, a quarter of the largest stash")
    return reasons


def launch(args: tuple, named: Mapping[str, Any], programs: int, launch_options: Options | None = None) -> Launch:
    """The launch of ``programs`` programs with ``topk_rows_kernel``'s arguments ``args`` (stash and counts in its
    places, then the rows' sample records, any int32 tensor when ``FLOORS`` is 0) and keyword arguments ``named``
    (its flags and strides, ``PDL``, and :func:`shape` with ``FLOORS``); ``launch_options``: :func:`options` of
    ``named`` (worked out here when None)."""
    return Launch(BLOCK, (programs,), launch_options or options(named), args, dict(named))
