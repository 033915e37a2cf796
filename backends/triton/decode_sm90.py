"""Paged decode logits on Hopper (sm90) in Gluon: a copy warp brings whole pages, the math warps do the rest.

The cuda table's choice ``KERNEL = "tma-ws"`` (the sm90 default with Triton 3.6); the Triton kernel
``paged_mqa_logits_kernel`` (``logits.py``) takes every call :func:`unsupported` declines. Same contract, same
schedule and, on the same inputs, the same logits bit for bit, for fp8 e4m3fn, pages of 64 keys of dim 128, 16-128
heads and at most two draft tokens a program. docs/kernels.md ("Paged decode on Hopper") has the measurements.
Ragged rows (``row_to_batch``) are taken two a program, as two draft tokens: rows ``2i`` and ``2i + 1`` of one
request share their page reads, any other row is a unit of its own (:func:`_unit`; an engine laying out each
request's verify rows side by side from an even row shares them all). The schedule's units are then rows, not
requests. Where a unit's context (its longer row's) is at most the launch's ``skip``, it is left out: not read,
not stored, not filled. An MXFP4 cache (``MXFP4``) is read the same way, widened to e4m3fn by the math warps into
shared memory before the matmuls (:mod:`mxfp4_sm90`; docs/fp4.md, "The Hopper decode"), within rounding of the
Triton kernel's logits.

- A copy warp (its own partition, few registers) walks the program's pages and fills a ring of ``STAGES``
  shared-memory slots with each page's keys ``[PAGE, D]`` and scales through the copy engine (TMA): the cache is,
  for it, rows of ``D`` bytes, a page ``PAGE_ROWS`` of them, its keys the first ``PAGE`` and its scales the rest, as
  float32. An entry that names no page of the cache is copied from page 0 and its keys store -inf. On an MXFP4
  cache a record warp beside it works out each key's scales once the page is in (:func:`_records_partition`).
- The four math warps wait on a slot's mbarrier, issue one matmul a draft token ``[PAGE, D] × [D, H]`` (keys on M)
  asynchronously, so the second runs while the first one's ReLU and weighted head sum do, free the slot through a
  second mbarrier as soon as it is read, and store each logit from the matmul's register layout. No block barrier in
  their loop.

Gluon does not run under the interpreter: the CPU checks cover the host side and the cross-compile check builds the
kernel; ``tests/test_decode_sm90.py`` compares it with the Triton kernel on an sm90 GPU.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from indexcache.backends.triton import mxfp4_sm90
from indexcache.backends.triton.launcher import Launch, Launcher, launch_key_options, persistent_programs
from indexcache.backends.triton.sm90 import (
    block_barrier,
    grid_dependency_wait,
    launch_dependents,
    reinterpret,
    tma_load,
    twice_relu,
    unsupported_target,
)
from indexcache.backends.triton.support import cdiv
from indexcache.backends.triton.target import Target
from indexcache.hal import fp4

NEG_INF = gl.constexpr(float("-inf"))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _tiles(ctx, max_ctx, skip, PAGE: gl.constexpr):
    """Pages of a request's logits that read keys: its context clipped to ``[0, max_ctx]``, in pages; none where
    that is at most ``skip`` (a request whose rows the caller's top-k selects without their logits)."""
    n = gl.minimum(gl.maximum(ctx, 0), max_ctx)
    return gl.where(n > skip, gl.cdiv(n, PAGE), 0)


@gluon.jit
def _unit(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, RAGGED: gl.constexpr):
    """``(context, paired, live)`` of unit ``b`` (a scalar or a tensor; nothing past the batch). Uniform rows: unit
    ``b`` is request ``b``, its context. Ragged rows (``RAGGED``: ``batch`` rows, one token each): rows ``b`` and
    ``b + 1`` make one unit (``paired``) where ``b`` is even and both name the same request, its context the longer
    of their lengths; a row is ``live`` where it starts a unit (the second row of a pair is its pair's)."""
    inside = b < batch
    ctx = gl.load(ctx_ptr + b * ctx_s0, mask=inside, other=0)
    paired = b < 0
    live = inside
    if RAGGED:
        req = gl.load(r2b_ptr + b * r2b_s0, mask=inside, other=-1)
        prev = gl.load(r2b_ptr + (b - 1) * r2b_s0, mask=inside & (b >= 1), other=-1)
        after = gl.load(r2b_ptr + (b + 1) * r2b_s0, mask=b + 1 < batch, other=-1)
        even = b % 2 == 0
        live = inside & (even | (req != prev))
        paired = even & (b + 1 < batch) & (after == req)
        ctx = gl.where(paired, gl.maximum(ctx, gl.load(ctx_ptr + (b + 1) * ctx_s0, mask=paired, other=0)), ctx)
    return ctx, paired, live


@gluon.jit
def _request_tiles(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, max_ctx, skip, PAGE: gl.constexpr,
                   RAGGED: gl.constexpr):
    """:func:`_tiles` of unit ``b`` (:func:`_unit`; a scalar or a tensor of units; 0 for a row that starts none)."""
    ctx, _, live = _unit(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, RAGGED)
    return gl.where(live, _tiles(ctx, max_ctx, skip, PAGE), 0)


@gluon.jit
def _table_row(r2b_ptr, r2b_s0, b, batch, table_rows, RAGGED: gl.constexpr):
    """``(table row, whether it is one)`` of unit ``b``: ``b`` itself, or a ragged row's request (none where that
    is not one of the ``table_rows`` rows)."""
    if RAGGED:
        tb = gl.load(r2b_ptr + b * r2b_s0, mask=b < batch, other=-1)
        return tb, (tb >= 0) & (tb < table_rows)
    return b, b < batch


@gluon.jit
def _entry(table_ptr, tab_s0, tb, named, j, num_pages, table_pages):
    """``(page of the cache to copy, whether it is the request's)`` for page ``j`` of table row ``tb`` (page 0 and
    False where the row is not ``named`` or past the table)."""
    e = gl.load(table_ptr + tb.to(gl.int64) * tab_s0 + j, mask=(j < table_pages) & named, other=-1)
    ok = (e >= 0) & (e < num_pages)
    return gl.where(ok, e, 0), ok


@gluon.jit
def _next(b, j, tiles, ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, batch, max_ctx, skip, PAGE: gl.constexpr,
          RAGGED: gl.constexpr):
    """The tile after page ``j`` of unit ``b`` (``tiles`` pages): ``(b, j, tiles)``, skipping units without
    tiles; past the last unit, ``(batch, 0, 0)``."""
    j += 1
    if j >= tiles:
        j = 0
        b += 1
        tiles = _request_tiles(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, max_ctx, skip, PAGE, RAGGED)
        while (tiles == 0) & (b < batch):  # units without keys (or skipped, or no unit) have no tiles
            b += 1
            tiles = _request_tiles(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, max_ctx, skip, PAGE, RAGGED)
    return b, j, tiles


@gluon.jit
def _head_sum(acc, w):
    """``Σ_h w · relu(acc)`` over the columns of ``acc [PAGE, H]`` (NaN kept), ``w [H]``: the sum of
    :func:`~indexcache.backends.triton.sm90.twice_relu` terms, halved (the ALU pipe is the one the MXFP4 widening
    fills)."""
    return gl.sum(twice_relu(acc) * w[None, :], axis=1) * 0.5


@gluon.jit
def _place(tiles, bs, ran, t_begin, t_end, f_begin, f_end, width, batch):
    """One block of requests ``bs`` (``tiles`` each, ``ran`` tiles before them) against a program's shares:
    ``(done, before, started, short, tiles)``, the requests wholly before ``t_begin`` and their tiles, those starting
    before ``t_end``, those of the fill share ``[f_begin, f_end)`` (of ``batch × width`` pages) stopping short of
    it, and the block's tiles."""
    ends = ran + gl.associative_scan(tiles, 0, _add)
    done = ends <= t_begin
    started = (ends - tiles < t_end) & (bs < batch)
    row = bs.to(gl.int64) * width
    short = (row + width > f_begin) & (row + tiles < gl.minimum(f_end, row + width)) & (bs < batch)
    return (gl.sum(done.to(gl.int32), axis=0), gl.sum(gl.where(done, tiles, 0), axis=0),
            gl.sum(started.to(gl.int32), axis=0), gl.sum(short.to(gl.int32), axis=0), gl.sum(tiles, axis=0))


@gluon.jit
def _schedule(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, batch, max_ctx, skip, p, programs, PAGE: gl.constexpr,
              BLOCK_B: gl.constexpr, RAGGED: gl.constexpr):
    """Program ``p``'s share of the batch's tiles (as the Triton kernel's schedule: the tiles in request order cut
    into equal contiguous shares) and of the -inf fill (:func:`_fill`): ``(t_begin, t_end, b_first, b_end, before,
    f_begin, f_end, fill)``, its tiles, the requests that hold them, the tiles of the requests before ``b_first``,
    its share of the ``batch × ⌈max_ctx / PAGE⌉`` pages of the output and whether a request there stops short of
    ``max_ctx``. Every warp holds the whole block of ``BLOCK_B`` lengths (no block barrier); a batch of up to
    ``BLOCK_B`` requests is read once."""
    vec_l: gl.constexpr = gl.BlockedLayout([BLOCK_B // 32], [32], [4], [0])  # each warp a copy of the block
    bs = gl.arange(0, BLOCK_B, layout=vec_l)
    first = _request_tiles(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, bs, batch, max_ctx, skip, PAGE, RAGGED)
    total = gl.sum(first, axis=0)
    for b0 in range(BLOCK_B, batch, BLOCK_B):
        total += gl.sum(_request_tiles(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b0 + bs, batch, max_ctx, skip, PAGE, RAGGED),
                        axis=0)
    t_begin = p * total // programs
    t_end = (p + 1) * total // programs
    width = gl.cdiv(max_ctx, PAGE)
    f_begin = p * batch * width // programs
    f_end = (p + 1) * batch * width // programs
    b_first, before, b_end, fill, ran = _place(first, bs, 0, t_begin, t_end, f_begin, f_end, width, batch)
    for b0 in range(BLOCK_B, batch, BLOCK_B):
        tiles = _request_tiles(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b0 + bs, batch, max_ctx, skip, PAGE, RAGGED)
        done, below, started, short, block = _place(tiles, b0 + bs, ran, t_begin, t_end, f_begin, f_end, width, batch)
        b_first += done
        before += below
        b_end += started
        fill += short
        ran += block
    return t_begin, t_end, b_first, b_end, before, f_begin, f_end, fill


@gluon.jit
def _tokens(b, j0, paired, NEXT_N: gl.constexpr, RAGGED: gl.constexpr):
    """``(row, live0, live1)``: unit ``b``'s first logits row and whether its first and second token are there
    (uniform: request ``b``'s draft tokens ``j0`` and ``j0 + 1``; ragged: rows ``b`` and, ``paired``, ``b + 1``)."""
    if RAGGED:
        return b, b >= 0, paired
    return b * NEXT_N + j0, j0 < NEXT_N, j0 + 1 < NEXT_N


@gluon.jit
def _load_request(q_ptr, w_ptr, q_smem, b, j0, paired, q_s0, q_s1, q_s2, w_s0, NEXT_N: gl.constexpr,
                  GROUPS: gl.constexpr, H: gl.constexpr, D: gl.constexpr, heads_l: gl.constexpr,
                  RAGGED: gl.constexpr, PERMUTED: gl.constexpr = 0):
    """Unit ``b``'s Q ``[GROUPS, H, D]`` (:func:`_tokens`) into ``q_smem``, fenced for the matmul and all warps past
    it; returns the tokens' weights ``(w0, w1)`` ``[H]`` (zero for a token that is not there). The caller makes sure
    no matmul still reads the previous Q. ``PERMUTED``: the head dim in ``mxfp4_sm90.permuted`` order (the MXFP4 keys'
    register operand's)."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    rows = gl.arange(0, H, layout=gl.SliceLayout(1, q_l))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
    if PERMUTED:
        dims = mxfp4_sm90.permuted(dims, D)
    heads = gl.arange(0, H, layout=heads_l)
    row, live0, live1 = _tokens(b, j0, paired, NEXT_N, RAGGED)
    for g in gl.static_range(GROUPS):
        if RAGGED:  # a row a token
            at = (b + g).to(gl.int64) * q_s0
        else:
            at = b.to(gl.int64) * q_s0 + (j0 + g) * q_s1
        there = live0
        if g == 1:
            there = live1
        qg = gl.load(q_ptr + at + rows[:, None] * q_s2 + dims[None, :], mask=(rows[:, None] >= 0) & there, other=0.0)
        q_smem.index(g).store(qg)
    w0 = gl.load(w_ptr + row.to(gl.int64) * w_s0 + heads, mask=(heads >= 0) & live0, other=0.0)
    w1 = w0
    if GROUPS == 2:
        w1 = gl.load(w_ptr + (row + 1).to(gl.int64) * w_s0 + heads, mask=(heads >= 0) & live1, other=0.0)
    fence_async_shared()
    block_barrier()
    return w0, w1


@gluon.jit
def _store(out_ptr, row, n, logits, seen, visible, max_ctx, live):
    """One token's logits of a tile: ``logits`` where ``seen < visible``, -inf elsewhere, keys ``n < max_ctx``."""
    gl.store(out_ptr + row + n.to(gl.int64), gl.where(seen < visible, logits, NEG_INF), mask=(n < max_ctx) & live)


@gluon.jit
def _fill(out_ptr, ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, batch, max_ctx, skip, out_s0, f_begin, f_end, j0,
          NEXT_N: gl.constexpr, GROUPS: gl.constexpr, PAGE: gl.constexpr, RAGGED: gl.constexpr):
    """-inf past each context (the keys no tile stored) in the program's share ``[f_begin, f_end)`` of the
    batch × ⌈max_ctx / PAGE⌉ pages of the output, a unit's rows at a time (:func:`_unit`); nothing in a skipped
    unit's rows (:func:`_tiles`)."""
    fill_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 4], [1, 0])
    grp = gl.arange(0, GROUPS, layout=gl.SliceLayout(1, fill_l))
    cols = gl.arange(0, PAGE, layout=gl.SliceLayout(0, fill_l))
    fill = gl.full([GROUPS, PAGE], NEG_INF, gl.float32, layout=fill_l)
    width = gl.cdiv(max_ctx, PAGE)
    for fb in range(f_begin // width, gl.cdiv(f_end, width)):
        ctx, paired, live = _unit(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, fb, batch, RAGGED)
        n = gl.minimum(gl.maximum(ctx, 0), max_ctx)
        lo = gl.maximum(f_begin - fb * width, gl.where(live & (n > skip), gl.cdiv(n, PAGE), width))
        hi = gl.minimum(f_end - fb * width, width)
        row, live0, live1 = _tokens(fb, j0, paired, NEXT_N, RAGGED)
        out_rows = (row + grp).to(gl.int64) * out_s0
        there = gl.where(grp == 0, live0, live1)
        for n0 in range(lo * PAGE, hi * PAGE, PAGE):
            fc = n0 + cols
            gl.store(out_ptr + out_rows[:, None] + fc[None, :], fill,
                     mask=there[:, None] & (fc < max_ctx)[None, :])


@gluon.jit
def _copy_partition(keys_desc, scales_desc, keys_smem, scales_smem, ready, empty, ctx_ptr, r2b_ptr, table_ptr,
                    ctx_s0, r2b_s0, tab_s0, batch, max_ctx, skip, num_pages, table_pages, table_rows, b_first,
                    j_first, count, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, STAGES: gl.constexpr,
                    RAGGED: gl.constexpr):
    """The copy warp: for each tile of the program, once its slot is free, its page's keys and scales into it."""
    pb = b_first
    pj = j_first
    ptiles = _request_tiles(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, pb, batch, max_ctx, skip, PAGE, RAGGED)
    tb, named = _table_row(r2b_ptr, r2b_s0, pb, batch, table_rows, RAGGED)
    page, _ = _entry(table_ptr, tab_s0, tb, named, pj, num_pages, table_pages)
    for i in range(count):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        bar = ready.index(slot)
        mbarrier.expect(bar, keys_desc.block_type.nbytes + scales_desc.block_type.nbytes)
        tma_load(keys_desc, [page * PAGE_ROWS, 0], bar, keys_smem.index(slot))
        tma_load(scales_desc, [page * PAGE_ROWS + PAGE, 0], bar, scales_smem.index(slot))
        pb, pj, ptiles = _next(pb, pj, ptiles, ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, batch, max_ctx, skip, PAGE, RAGGED)
        tb, named = _table_row(r2b_ptr, r2b_s0, pb, batch, table_rows, RAGGED)
        page, _ = _entry(table_ptr, tab_s0, tb, named, pj, num_pages, table_pages)


@gluon.jit
def _mxfp4_scale_words(scales_smem, layout: gl.constexpr, PAGE: gl.constexpr):
    """A slot's scale bytes as one int32 word a key (``[PAGE]`` in ``layout``)."""
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    return reinterpret(scales_smem, gl.int32, [PAGE], flat).load(layout)


@gluon.jit
def _records_partition(scales_smem, steps_smem, scale_smem, ready, scaled, count, PAGE: gl.constexpr,
                       STAGES: gl.constexpr):
    """The record warp of an MXFP4 cache: for each tile, once its page is in its slot, each key's record
    (``mxfp4_sm90.key_records``) into the slot's ``steps_smem`` and ``scale_smem``, signalled on ``scaled``: the
    math warps read two words a key instead of working out its scales themselves."""
    keys_l: gl.constexpr = gl.BlockedLayout([PAGE // 32], [32], [1], [0])
    for i in range(count):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        steps, scale = mxfp4_sm90.key_records(_mxfp4_scale_words(scales_smem.index(slot), keys_l, PAGE))
        steps_smem.index(slot).store(steps)
        scale_smem.index(slot).store(scale)
        fence_async_shared()  # the scales were read through the generic proxy; the copy engine writes next
        mbarrier.arrive(scaled.index(slot), count=1)


@gluon.jit
def _mxfp4_exact(cache_ptr, out_ptr, wide_smem, q_tok, w, page, far, n, seen, visible, row, max_ctx,
                 H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, PAGE_WORDS: gl.constexpr, mma: gl.constexpr,
                 REG_A: gl.constexpr = 0):
    """One token's logits of a tile's keys whose block scales lie too far apart for one scale a key (``far``), read
    again from the cache: D / 32 matmuls into one accumulator, each taking every key's next block by scale in units
    of that block's scale, the sum so far brought to those units first (as the Triton kernel's exact path)."""
    words_l: gl.constexpr = mxfp4_sm90.WORDS_LAYOUT
    rows = gl.arange(0, PAGE, layout=gl.SliceLayout(1, words_l))
    cols = gl.arange(0, D // 8, layout=gl.SliceLayout(0, words_l))
    at = page.to(gl.int64) * PAGE_WORDS
    words = gl.load(cache_ptr + at + rows[:, None] * (D // 8) + cols[None, :])
    sw = gl.load(cache_ptr + at + PAGE * (D // 8) + rows)
    sw_m = gl.load(cache_ptr + at + PAGE * (D // 8) + gl.arange(0, PAGE, layout=gl.SliceLayout(1, mma)))
    if REG_A:
        acc, last = mxfp4_sm90.exact_registers(q_tok.permute((1, 0)), words, sw, cols, sw_m,
                                               gl.zeros([PAGE, H], gl.float32, layout=mma),
                                               gl.DotOperandLayout(0, mma, 4))
    else:
        acc, last = mxfp4_sm90.exact(wide_smem, q_tok.permute((1, 0)), words, sw, cols, sw_m,
                                     gl.zeros([PAGE, H], gl.float32, layout=mma))
    _store(out_ptr, row, n, _head_sum(acc, w) * mxfp4_sm90.e8m0(last), seen, visible, max_ctx, far)


@gluon.jit
def _span(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, max_ctx, skip, passed, t_begin, t_end, PAGE: gl.constexpr,
          RAGGED: gl.constexpr):
    """Unit ``b``'s part of the program's tiles, ``passed`` tiles of the schedule before it: ``(ctx, paired, tiles,
    lo, hi)``, its context, its tiles and the program's tiles ``[lo, hi)`` of them."""
    ctx, paired, live = _unit(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, RAGGED)
    ctx = gl.maximum(ctx, 0)
    tiles = gl.where(live, _tiles(ctx, max_ctx, skip, PAGE), 0)
    lo = gl.maximum(t_begin - passed, 0).to(gl.int32)
    hi = gl.minimum(t_end - passed, tiles).to(gl.int32)
    return ctx, paired, tiles, lo, hi


@gluon.jit
def _visible(ctx_ptr, ctx_s0, b, ctx, paired, j0, NEXT_N: gl.constexpr, RAGGED: gl.constexpr):
    """The keys unit ``b``'s two tokens see (:func:`_tokens`): ragged rows their own lengths, draft tokens the
    context less the drafts after them."""
    if RAGGED:
        return gl.load(ctx_ptr + b * ctx_s0), gl.load(ctx_ptr + (b + 1) * ctx_s0, mask=paired, other=0)
    return ctx - NEXT_N + 1 + j0, ctx - NEXT_N + 2 + j0


@gluon.jit
def _math_partition(q_ptr, w_ptr, ctx_ptr, r2b_ptr, table_ptr, out_ptr, cache_ptr, keys_smem, scales_smem, q_smem,
                    wide_smem, steps_smem, scale_smem, ready, empty, scaled, batch, max_ctx, skip, num_pages,
                    table_pages, table_rows, q_s0, q_s1, q_s2, w_s0, ctx_s0, r2b_s0, tab_s0, out_s0, j0, t_begin,
                    t_end, b_first, b_end, before,
                    NEXT_N: gl.constexpr, GROUPS: gl.constexpr, H: gl.constexpr, D: gl.constexpr,
                    PAGE: gl.constexpr, PAGE_WORDS: gl.constexpr, STAGES: gl.constexpr, RAGGED: gl.constexpr,
                    MXFP4: gl.constexpr, REG_A: gl.constexpr = 0):
    """The math warps: each tile's matmul, head sum and store, releasing the slot as soon as it is read. An MXFP4
    tile (``MXFP4``) is widened into shared memory first (both draft tokens' matmuls read it), or with ``REG_A`` into
    the matmul's register operand (``mxfp4_sm90.operand``; Q in its order); its keys whose blocks lie too far apart
    are left out, and taken again at the end by the exact path where there are any. An MXFP4 key's scales come worked
    out by the record warp (:func:`_records_partition`), two words a key."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H, 32])
    keys_l: gl.constexpr = gl.SliceLayout(1, mma)
    heads_l: gl.constexpr = gl.SliceLayout(0, mma)
    scales_l: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [2, 2], [1, 0])
    keys = gl.arange(0, PAGE, layout=keys_l)
    if MXFP4:
        words_l: gl.constexpr = mxfp4_sm90.WORDS_LAYOUT
        cols = gl.arange(0, D // 8, layout=gl.SliceLayout(0, words_l))
        far = gl.zeros([PAGE], gl.int32, layout=keys_l)  # keys left to the exact path, by place in a tile
    i = 0
    passed = before
    for b in range(b_first, b_end):
        ctx, paired, tiles, lo, hi = _span(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, max_ctx, skip, passed, t_begin,
                                           t_end, PAGE, RAGGED)
        passed += tiles
        block_barrier()  # every math warp is past its last matmul on the previous request's Q
        w0, w1 = _load_request(q_ptr, w_ptr, q_smem, b, j0, paired, q_s0, q_s1, q_s2, w_s0, NEXT_N, GROUPS, H, D,
                               heads_l, RAGGED, MXFP4 and REG_A)
        row, live0, live1 = _tokens(b, j0, paired, NEXT_N, RAGGED)
        row0 = row.to(gl.int64) * out_s0
        visible0, visible1 = _visible(ctx_ptr, ctx_s0, b, ctx, paired, j0, NEXT_N, RAGGED)
        tb, named = _table_row(r2b_ptr, r2b_s0, b, batch, table_rows, RAGGED)
        for step in range(0, hi - lo):  # (Triton 3.6 drops a loop-carried value used only as a loop bound)
            j = lo + step
            slot = i % STAGES
            _, ok = _entry(table_ptr, tab_s0, tb, named, j, num_pages, table_pages)
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            keep0 = live0
            keep1 = live1
            if MXFP4:
                words = keys_smem.index(slot).load(words_l)
                mbarrier.wait(scaled.index(slot), (i // STAGES) & 1)  # the keys' records
                steps = steps_smem.index(slot).load(gl.SliceLayout(1, words_l))
                sc = scale_smem.index(slot).load(keys_l).to(gl.float32, bitcast=True)
                fence_async_shared()  # read through the generic proxy; the copy engine writes next
                mbarrier.arrive(empty.index(slot), count=1)
                one = ~(sc < 0.0)  # a NaN scale (a NaN block) takes it
                word_lifts = mxfp4_sm90.record_lifts(steps, cols)
                if REG_A:  # the widened words are the matmul's registers: no shared memory, no barrier
                    k_tile = mxfp4_sm90.operand(words, word_lifts, gl.DotOperandLayout(0, mma, 4))
                else:
                    k_tile = wide_smem.index(i % 2)  # two buffers: a warp past this tile's barrier is past the
                    # matmuls of the tile before
                    mxfp4_sm90.stage(k_tile, words, word_lifts)
                far |= (ok & ~one).to(gl.int32)
                keep0 = (one | ~ok) & live0
                keep1 = (one | ~ok) & live1
            else:
                k_tile = keys_smem.index(slot)
            acc0 = warpgroup_mma(k_tile, q_smem.index(0).permute((1, 0)), gl.zeros([PAGE, H], gl.float32, layout=mma),
                                 use_acc=False, is_async=True)
            if GROUPS == 2:
                acc1 = warpgroup_mma(k_tile, q_smem.index(1).permute((1, 0)),
                                     gl.zeros([PAGE, H], gl.float32, layout=mma), use_acc=False, is_async=True)
            if not MXFP4:
                sc = gl.convert_layout(gl.reshape(scales_smem.index(slot).load(scales_l), [PAGE]), keys_l)
            n = j * PAGE + keys
            seen = gl.where(ok, n, ctx)
            if GROUPS == 2:
                acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, ))
                s0 = _head_sum(acc0, w0) * sc
                acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))
            else:
                acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, ))
            if not MXFP4:
                fence_async_shared()  # the scales were read through the generic proxy; the copy engine writes next
                mbarrier.arrive(empty.index(slot), count=1)
            if GROUPS == 1:
                s0 = _head_sum(acc0, w0) * sc
            _store(out_ptr, row0, n, s0, seen, visible0, max_ctx, keep0)
            if GROUPS == 2:
                _store(out_ptr, row0 + out_s0, n, _head_sum(acc1, w1) * sc, seen, visible1, max_ctx, keep1)
            i += 1
    if MXFP4:
        if gl.max(far, axis=0) != 0:  # keys too far apart for one scale: the program's tiles again, exactly
            passed = before
            for b in range(b_first, b_end):
                ctx, paired, tiles, lo, hi = _span(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, b, batch, max_ctx, skip, passed,
                                                   t_begin, t_end, PAGE, RAGGED)
                passed += tiles
                block_barrier()
                w0, w1 = _load_request(q_ptr, w_ptr, q_smem, b, j0, paired, q_s0, q_s1, q_s2, w_s0, NEXT_N, GROUPS,
                                       H, D, heads_l, RAGGED, REG_A)
                row, live0, live1 = _tokens(b, j0, paired, NEXT_N, RAGGED)
                visible0, visible1 = _visible(ctx_ptr, ctx_s0, b, ctx, paired, j0, NEXT_N, RAGGED)
                tb, named = _table_row(r2b_ptr, r2b_s0, b, batch, table_rows, RAGGED)
                for step in range(0, hi - lo):
                    j = lo + step
                    page, ok = _entry(table_ptr, tab_s0, tb, named, j, num_pages, table_pages)
                    sw_k = gl.load(cache_ptr + page.to(gl.int64) * PAGE_WORDS + PAGE * (D // 8) + keys)
                    _, _, one = mxfp4_sm90.key_scales(sw_k)
                    far_k = ok & ~one
                    if gl.max(far_k.to(gl.int32), axis=0) != 0:
                        n = j * PAGE + keys
                        seen = gl.where(ok, n, ctx)
                        row0 = row.to(gl.int64) * out_s0
                        _mxfp4_exact(cache_ptr, out_ptr, wide_smem.index(0), q_smem.index(0), w0, page, far_k & live0,
                                     n, seen, visible0, row0, max_ctx, H, D, PAGE, PAGE_WORDS, mma, REG_A)
                        if GROUPS == 2:
                            _mxfp4_exact(cache_ptr, out_ptr, wide_smem.index(0), q_smem.index(1), w1, page,
                                         far_k & live1, n, seen, visible1, row0 + out_s0, max_ctx, H, D, PAGE,
                                         PAGE_WORDS, mma, REG_A)


# The batch, the context, the cache's and the table's sizes and the row strides of the table and the logits take no
# part in the variant, nor do the addresses of the lengths and the table (docs/kernels.md, "Kernel variants"): the
# logits are stored from the matmul's layout, a key a thread, masked by the context.
@gluon.jit(do_not_specialize=("batch", "max_ctx", "skip", "num_pages", "table_pages", "table_rows", "tab_s0",
                              "out_s0"),
           do_not_specialize_on_alignment=("ctx_ptr", "r2b_ptr", "table_ptr"))
def paged_decode_sm90_kernel(
    q_ptr, keys_desc, scales_desc, w_ptr, ctx_ptr, r2b_ptr, table_ptr, out_ptr, cache_ptr,
    batch, max_ctx, skip, num_pages, table_pages, table_rows,
    q_s0, q_s1, q_s2, w_s0, ctx_s0, r2b_s0, tab_s0, out_s0,
    NEXT_N: gl.constexpr, GROUPS: gl.constexpr, H: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
    PAGE_ROWS: gl.constexpr, STAGES: gl.constexpr, BLOCK_B: gl.constexpr, LOADER_REGS: gl.constexpr,
    PDL: gl.constexpr, RAGGED: gl.constexpr = 0, MXFP4: gl.constexpr = 0, REG_A: gl.constexpr = 0,
):
    """One copy warp (``LOADER_REGS`` registers) fills the slots, the four math warps free them through mbarriers.
    ``PDL``: launched with programmatic dependent launch (its programs wait for the launch before it first). Every
    program being resident (a persistent grid), the next launch, where it uses programmatic dependent launch (the
    top-k's block kernel), may take the multiprocessors as they free and wait there for this kernel's end.
    ``skip``: requests whose context clipped to ``max_ctx`` is at most this are neither computed nor filled.
    ``RAGGED``: ``batch`` ragged rows (next_n 1), row ``r`` of request ``r2b[r]`` (its table row; none where that is
    not one of the ``table_rows`` rows) and length ``context_lens[r]``; two rows of one request at an even row and
    the next share their key reads, as two draft tokens of a request do (:func:`_unit`). ``MXFP4``: an MXFP4 cache
    (``keys_desc`` its value words ``[PAGE, D / 8]`` a page, ``scales_desc`` its scale words; ``cache_ptr`` the
    whole cache as int32, read by the exact path), widened to e4m3fn in the math warps (``REG_A``: straight into the
    matmul's register operand), each key's scales worked out once a page by a record warp with the copy warp's
    registers."""
    if PDL:
        grid_dependency_wait()
    launch_dependents()
    j0 = gl.program_id(0) * GROUPS
    p = gl.program_id(1).to(gl.int64)
    programs = gl.num_programs(1)
    t_begin, t_end, b_first, b_end, before, f_begin, f_end, fill = _schedule(ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, batch,
                                                                             max_ctx, skip, p, programs, PAGE, BLOCK_B,
                                                                             RAGGED)
    keys_smem = gl.allocate_shared_memory(keys_desc.dtype, [STAGES] + keys_desc.block_type.shape, keys_desc.layout)
    scales_smem = gl.allocate_shared_memory(scales_desc.dtype, [STAGES] + scales_desc.block_type.shape,
                                            scales_desc.layout)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, D], gl.float8e4nv)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [GROUPS, H, D], q_layout)
    if MXFP4 and not REG_A:  # the widened keys of the tile in the matmul and the next one's
        wide_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE, D], gl.float8e4nv)
        wide_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, PAGE, D], wide_layout)
    else:
        wide_smem = q_smem
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if MXFP4:  # each slot's key records: lift steps and scale bits, a word each a key
        records_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a slot's records: flat words
        steps_smem = gl.allocate_shared_memory(gl.int32, [STAGES, PAGE], records_layout)
        scale_smem = gl.allocate_shared_memory(gl.int32, [STAGES, PAGE], records_layout)
        scaled = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    else:
        steps_smem = scales_smem
        scale_smem = scales_smem
        scaled = ready
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
        if MXFP4:
            mbarrier.init(scaled.index(st), count=1)
    count = (t_end - t_begin).to(gl.int32)
    # The partitions spelled out for each format: a Gluon kernel can hold no partition's function in a variable.
    if MXFP4:
        gl.warp_specialize([
            (_math_partition, (q_ptr, w_ptr, ctx_ptr, r2b_ptr, table_ptr, out_ptr, cache_ptr, keys_smem, scales_smem,
                               q_smem, wide_smem, steps_smem, scale_smem, ready, empty, scaled, batch, max_ctx, skip,
                               num_pages, table_pages, table_rows, q_s0, q_s1, q_s2, w_s0, ctx_s0, r2b_s0, tab_s0,
                               out_s0, j0, t_begin, t_end, b_first, b_end, before, NEXT_N, GROUPS, H, D, PAGE,
                               PAGE * (D // 2 + D // 32) // 4, STAGES, RAGGED, MXFP4, REG_A)),
            (_copy_partition, (keys_desc, scales_desc, keys_smem, scales_smem, ready, empty, ctx_ptr, r2b_ptr,
                               table_ptr, ctx_s0, r2b_s0, tab_s0, batch, max_ctx, skip, num_pages, table_pages,
                               table_rows, b_first, (t_begin - before).to(gl.int32), count, PAGE, PAGE_ROWS, STAGES,
                               RAGGED)),
            (_records_partition, (scales_smem, steps_smem, scale_smem, ready, scaled, count, PAGE, STAGES)),
        ], [1, 1], [LOADER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_math_partition, (q_ptr, w_ptr, ctx_ptr, r2b_ptr, table_ptr, out_ptr, cache_ptr, keys_smem, scales_smem,
                               q_smem, wide_smem, steps_smem, scale_smem, ready, empty, scaled, batch, max_ctx, skip,
                               num_pages, table_pages, table_rows, q_s0, q_s1, q_s2, w_s0, ctx_s0, r2b_s0, tab_s0,
                               out_s0, j0, t_begin, t_end, b_first, b_end, before, NEXT_N, GROUPS, H, D, PAGE,
                               PAGE * (D // 2 + D // 32) // 4, STAGES, RAGGED, MXFP4, REG_A)),
            (_copy_partition, (keys_desc, scales_desc, keys_smem, scales_smem, ready, empty, ctx_ptr, r2b_ptr,
                               table_ptr, ctx_s0, r2b_s0, tab_s0, batch, max_ctx, skip, num_pages, table_pages,
                               table_rows, b_first, (t_begin - before).to(gl.int32), count, PAGE, PAGE_ROWS, STAGES,
                               RAGGED)),
        ], [1], [LOADER_REGS])
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(st))
        mbarrier.invalidate(empty.index(st))
        if MXFP4:
            mbarrier.invalidate(scaled.index(st))
    if fill > 0:  # only where a request of the share is shorter than max_ctx: no reads at the end otherwise
        _fill(out_ptr, ctx_ptr, r2b_ptr, ctx_s0, r2b_s0, batch, max_ctx, skip, out_s0, f_begin, f_end, j0, NEXT_N,
              GROUPS, PAGE, RAGGED)


TMA_DECODE = Launcher(paged_decode_sm90_kernel)
PAGE_KEYS = 64  # the tile: one page
LOADER_REGS = 40  # the copy warp's registers
# On an MXFP4 cache the copy warp keeps the fewest registers there are (it issues two copies a page), leaving the math
# warps 104 at the table's cap of 64: four programs a SM.
FP4_LOADER_REGS = 24
# What ptxas keeps on the stack of the MXFP4 kernel, by draft tokens a program, at the table's caps: at 64 (one token;
# Triton 3.6: 8 bytes, 3.9: 16) values of the program's schedule stored once before its tiles and read again after
# them, for the exact path, and one a request, none in the tile loop; at 80 (two; 32-72 bytes) the exact path's and
# three words a tile in the tile loop (two loads and a store: 5-6 % faster on the H200 than 96 without them, which
# leaves two programs a SM instead of three).
FP4_STACK_BYTES = (16, 72)


def _tuned(cfg: Mapping[str, Any], name: str, mxfp4: bool) -> Any:
    """The table's ``TMA_<name>``, or on an MXFP4 cache its ``TMA_FP4_<name>`` where the table has one."""
    return cfg[f"TMA_FP4_{name}" if mxfp4 and f"TMA_FP4_{name}" in cfg else f"TMA_{name}"]


def _format_constexprs(cfg: Mapping[str, Any], mxfp4: bool) -> dict[str, Any]:
    """The compile-time values the cache's format and the table decide: the pages in flight (``STAGES``), the copy
    warp's registers, programmatic dependent launch, and on an MXFP4 cache whether its keys go straight into the
    matmul's register operand (``REG_A``)."""
    return {"STAGES": _tuned(cfg, "STAGES", mxfp4), "LOADER_REGS": FP4_LOADER_REGS if mxfp4 else LOADER_REGS,
            "PDL": bool(cfg.get("PDL")), "MXFP4": int(mxfp4), "REG_A": int(mxfp4 and cfg.get("TMA_FP4_REG_A", 0))}


def _options(cfg: Mapping[str, Any], groups: int, mxfp4: bool = False) -> dict[str, Any]:
    """Launch options for ``groups`` draft tokens a program: four math warps, the table's register cap for that many
    (``TMA_MAXNREG``, or on an MXFP4 cache ``TMA_FP4_MAXNREG`` where the table has it; 0 for none), programmatic
    dependent launch where the table's ``PDL`` says."""
    cap = _tuned(cfg, "MAXNREG", mxfp4)[groups - 1]
    return {"num_warps": 4, **({"maxnreg": cap} if cap else {}), **({"launch_pdl": True} if cfg.get("PDL") else {})}


def unsupported(q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor, page_table: torch.Tensor,
                out: torch.Tensor, page: int, groups: int, target: Target, k_format: torch.dtype | None = None,
                context_lens: torch.Tensor | None = None, row_to_batch: torch.Tensor | None = None) -> list[str]:
    """Why this kernel cannot take a decode call (empty: it can; the Triton kernel takes the others). Arguments as
    ``indexcache.paged_mqa_logits``; ``page``: keys a page; ``groups``: draft tokens a program."""
    heads, dim = q.shape[2], q.shape[3]
    reasons = unsupported_target(q.dtype, target)
    if page != PAGE_KEYS or dim != 128:
        reasons.append(f"pages of {page} keys of dim {dim}: 64 keys of dim 128 only")
    if heads not in (16, 32, 64, 128) or groups > 2:
        reasons.append(f"{heads} heads, {groups} draft tokens a program: 16-128 heads, at most 2 tokens")
    if k_cache.shape[0] == 0 or not k_cache.is_contiguous() or k_cache.data_ptr() % 16:
        reasons.append("an empty, non-contiguous or not 16-byte aligned cache")
    if q.stride(3) != 1 or weights.stride(1) != 1 or page_table.stride(1) != 1 or out.stride(1) != 1:
        reasons.append("q, weights, page_table and out need unit strides along their last dimension")
    if k_format not in (None, fp4.FP4):
        reasons.append(f"k_format {k_format}: an fp8 or MXFP4 cache only")
    # a request's query, length and row read at int32 offsets (int64 would cost its schedule loop instructions)
    spans = [(q.shape[1] - 1) * q.stride(1) + (q.shape[2] - 1) * q.stride(2)]
    spans += [(t.shape[0] - 1) * t.stride(0) for t in (context_lens, row_to_batch) if t is not None]
    if max(spans) >= 2**31:
        reasons.append("q, context_lens or row_to_batch strides whose offsets pass 2^31 elements")
    return reasons


@functools.cache
def _shared_layout(block: tuple[int, int], dtype: Any) -> Any:
    """The copy engine's shared layout of a ``block`` of ``dtype`` (kept: building one costs a first call ~10 µs)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


# An MXFP4 page's scale words, read a key's word at a time: unswizzled.
_SCALE_WORDS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _over(k_cache: torch.Tensor, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    """The memory of ``k_cache`` (contiguous, starting at a multiple of ``dtype``'s size) as a ``dtype`` tensor of
    ``shape`` over the same storage that holds the memory but not ``k_cache`` itself (a view would: its base)."""
    view = torch.empty(0, dtype=dtype, device=k_cache.device)
    return view.set_(k_cache.untyped_storage(), k_cache.storage_offset() // dtype.itemsize, shape)


def _descriptors(k_cache: torch.Tensor, page: int, dim: int, mxfp4: bool) -> tuple[Any, Any, int, torch.Tensor]:
    """The copy engine's views of the cache: ``(keys, scales, rows a page, the cache as int32 words)``. An fp8 cache
    is rows of ``dim`` bytes (a page's keys its first ``page`` rows, its scales the rest, as float32); an MXFP4 cache
    rows of ``dim / 8`` int32 words (a page's value bytes its first ``page`` rows, its scale bytes the rest, a key's
    four one word)."""
    if mxfp4:
        width, dtype, gl_dtype = dim // 8, torch.int32, gl.int32
    else:
        width, dtype, gl_dtype = dim, torch.float8_e4m3fn, gl.float8e4nv
    pages = k_cache.shape[0]
    rows = k_cache.numel() // pages // (width * dtype.itemsize)  # a page as rows
    keys = _over(k_cache, dtype, (pages * rows, width))
    keys_desc = TensorDescriptor(keys, list(keys.shape), list(keys.stride()), [page, width],
                                 _shared_layout((page, width), gl_dtype))
    if mxfp4:
        scales_desc = TensorDescriptor(keys, list(keys.shape), list(keys.stride()), [rows - page, width],
                                       _SCALE_WORDS_LAYOUT)
    else:  # the cache as rows of dim / 4 float32, a page's scales its last rows
        words = _over(k_cache, torch.float32, (pages * rows, dim // 4))
        block = [page * 4 // dim, dim // 4]
        scales_desc = TensorDescriptor(words, list(words.shape), list(words.stride()), block,
                                       _shared_layout(tuple(block), gl.float32))
    return keys_desc, scales_desc, rows, _over(k_cache, torch.int32, (k_cache.numel() // 4,))


# The copy engine's views of the caches in use, by address, shape, device and format: an engine reads one cache step
# after step, and building them (the views and two tensor descriptors) cost the host about 20 µs a call. An entry
# holds the cache's memory, never the caller's tensor: it goes when that tensor does (weakref.finalize).
_VIEWS: dict[tuple, tuple[Any, Any, int, torch.Tensor]] = {}


def _cache_views(k_cache: torch.Tensor, page: int, dim: int, mxfp4: bool) -> tuple[Any, Any, int, torch.Tensor]:
    """:func:`_descriptors` of ``k_cache``, kept while ``k_cache`` lives (on a GPU; built afresh elsewhere: meta
    tensors, which ``indexcache warmup`` plans with, share one address)."""
    if not k_cache.is_cuda:
        return _descriptors(k_cache, page, dim, mxfp4)
    key = (k_cache.data_ptr(), k_cache.shape, k_cache.device, page, dim, mxfp4)
    found = _VIEWS.get(key)
    if found is None:
        found = _VIEWS[key] = _descriptors(k_cache, page, dim, mxfp4)
        weakref.finalize(k_cache, _VIEWS.pop, key, None)
    return found


def launch(q, k_cache, weights, context_lens, page_table, max_context_len, out, *, page: int, groups: int,
           target: Target, cfg: Mapping[str, Any], sms: int, batch_block: int, skip: int = -1,
           row_to_batch: torch.Tensor | None = None, k_format: torch.dtype | None = None) -> Launch:
    """The launch filling ``out`` (contract: ``indexcache.paged_mqa_logits``) for a call :func:`unsupported` accepts.
    ``cfg``: the paged_mqa_logits tuning entry (``TMA_STAGES``; ``TMA_MAXNREG``, the kernel-wide register cap by draft
    tokens a program, 0 for none); ``sms``: the device's multiprocessors (an SM budget in force
    caps the programs: ``launcher.persistent_programs``); ``batch_block``: context lengths a step of the
    schedule reads; ``skip``: requests whose clipped context is at most this are left unwritten (-1: none);
    ``row_to_batch``: ragged rows (``q [R, 1, H, D]``), two at a time where ``groups`` is 2; ``k_format``: the
    cache's (None: fp8, ``torch.float4_e2m1fn_x2``: MXFP4)."""
    batch, next_n, heads, dim = q.shape
    mxfp4 = k_format == fp4.FP4
    keys_desc, scales_desc, rows, words = _cache_views(k_cache, page, dim, mxfp4)
    options = launch_key_options(_options(cfg, groups, mxfp4))
    named = dict(NEXT_N=next_n, GROUPS=groups, H=heads, D=dim, PAGE=page, PAGE_ROWS=rows, BLOCK_B=batch_block,
                 RAGGED=row_to_batch is not None, **_format_constexprs(cfg, mxfp4))
    r2b = context_lens if row_to_batch is None else row_to_batch  # (not read without ragged rows)
    args = (q, keys_desc, scales_desc, weights, context_lens, r2b, page_table, out, words,
            batch, max_context_len, skip, k_cache.shape[0], page_table.shape[1], page_table.shape[0],
            q.stride(0), q.stride(1), q.stride(2), weights.stride(0), context_lens.stride(0), r2b.stride(0),
            page_table.stride(0), out.stride(0))
    per_sm = TMA_DECODE.resident(options, *args, **named) or 1
    programs = max(1, min(persistent_programs(sms, per_sm) // cdiv(next_n, groups),
                          batch * cdiv(max_context_len, page)))
    return Launch(TMA_DECODE, (cdiv(next_n, groups), programs), options, args, named)


def compile_specs(target: Target, cfg: Mapping[str, Any], heads: int, dim: int, page: int,
                  batch_block: int) -> list:
    """What the kernel builds for ``target`` (sm90 only, else nothing) at the given indexer shape, for next_n 1-2
    and ragged rows two a program, on fp8 and MXFP4 caches, with the ``paged_mqa_logits`` entry ``cfg``'s stages and
    register caps (cross-compile check)."""
    from indexcache.backends.triton.crosscompile import KernelSpec

    if target.gpu.mma != "wgmma":  # Hopper's warp-group MMA and TMA
        return []
    keys = gl.NVMMASharedLayout.get_default_for([page, dim], gl.float8e4nv)
    block = [page * 4 // dim, dim // 4]
    scales = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    words = gl.NVMMASharedLayout.get_default_for([page, dim // 8], gl.int32)
    fp4_rows = page * (dim // 2 + dim // 32) // (dim // 2)
    formats = (
        (0, page * (dim + 4) // dim, f"tensordesc<fp8e4nv[{page}, {dim}],{keys!r}>",
         f"tensordesc<fp32[{block[0]}, {block[1]}],{scales!r}>"),
        (1, fp4_rows, f"tensordesc<i32[{page}, {dim // 8}],{words!r}>",
         f"tensordesc<i32[{fp4_rows - page}, {dim // 8}],{_SCALE_WORDS_LAYOUT!r}>"),
    )
    specs = []
    for mxfp4, rows, keys_type, scales_type in formats:
        types = {"q_ptr": "*fp8e4nv", "keys_desc": keys_type, "scales_desc": scales_type, "w_ptr": "*fp32",
                 "ctx_ptr": "*i32", "r2b_ptr": "*i32", "table_ptr": "*i32", "out_ptr": "*fp32", "cache_ptr": "*i32"}
        for next_n, groups, ragged in ((1, 1, 0), (2, 2, 0), (1, 2, 1)):
            specs.append(KernelSpec(
                "paged_mqa_logits", paged_decode_sm90_kernel, types,
                {"NEXT_N": next_n, "GROUPS": groups, "H": heads, "D": dim, "PAGE": page, "PAGE_ROWS": rows,
                 "BLOCK_B": batch_block, "RAGGED": ragged, **_format_constexprs(cfg, bool(mxfp4)), "ctx_s0": 1,
                 "r2b_s0": 1},
                _options(cfg, groups, bool(mxfp4)), matrix="fp8",
                aligned=("q_s0", "q_s1", "q_s2", "w_s0"),
                stack_bytes=FP4_STACK_BYTES[groups - 1] if mxfp4 else 0))
    return specs
