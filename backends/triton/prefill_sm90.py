"""Ragged prefill logits on Hopper (sm90) in Gluon: a copy warp brings Q and key tiles, four math warp groups the rest.

The cuda table's choice ``KERNEL = "tma-ws"`` for ``mqa_logits`` (the sm90 default with Triton 3.6); the Triton kernel
``mqa_logits_kernel`` (``logits.py``) takes every call :func:`unsupported` declines. Same contract and the same
persistent schedule: blocks of ``BLOCK_Q`` tokens (``BLOCK_Q · H`` = 128 matmul columns) taken round-robin, last block
first, each walking the union of its tokens' windows in 64-key tiles (the blocks of a last, partial round cut into
parts of their key span, :func:`tail_parts`, so that round ends on every multiprocessor at about the same time); a
tile inside every window stores without a mask, a boundary tile stores ``where(inside, s, -inf)``, the columns
outside the union get -inf afterwards.

One program a SM (DeepGEMM's arrangement; docs/kernels.md, "Prefill on Hopper"):

- A copy warp (its own partition, few registers) brings each block's Q ``[BLOCK_Q · H, D]`` into one of two slots and
  its keys ``STAGE_KEYS`` (256) at a time, with their scales, into a ring of ``STAGES`` slots through the copy engine
  (TMA: one copy of ``[256, D]`` keys and one of ``[1, 256]`` scales on one mbarrier a slot; rows past the end arrive
  as zeros), once the four math groups have freed the slot.
- Math warp group ``g`` of four takes the ``g``-th 64-key tile of every slot. For each it waits on the slot, reads the
  tile's 64 scales from shared memory, runs one matmul ``[64, D] × [D, BLOCK_Q · H]`` (keys on M), frees its part of
  the slot, and does the ReLU, weighted head sum and store from the matmul's register layout, viewed as
  ``[64, BLOCK_Q, H]``. A tile past the block's last one (the last slot of a block holds 1-4 tiles) is computed from
  the zeros or keys there and nothing of it is stored. The four groups' epilogues overlap each other's matmuls.

fp8 e4m3fn only (MXFP4 keys come widened: ``prefill_fp4``), D = 128, 64 or 128 heads, contiguous q and k, ``k_scale``
aligned to 16 bytes (the copy engine's). Gluon does not run under the interpreter: the CPU checks cover the host side
and the cross-compile check builds the kernel where the table takes it; ``tests/test_prefill_sm90.py`` compares it
with the Triton kernel on an sm90 GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from indexcache.backends.triton.launcher import Launch, Launcher, launch_key_options
from indexcache.backends.triton.sm90 import tma_load, twice_relu, unsupported_target
from indexcache.backends.triton.support import cdiv
from indexcache.backends.triton.target import Target

NEG_INF = gl.constexpr(float("-inf"))
BLOCK_N = 64  # keys a tile: M of one warpgroup's matmul
COLS = 128  # matmul columns: BLOCK_Q tokens × H heads
LOADER_REGS = 32  # the copy warp's registers
MATH = gl.constexpr(4)  # math warp groups a program (one program a SM): the four partitions of the kernel
STAGE_KEYS = MATH.value * BLOCK_N  # keys a ring slot: a tile for each math group, one copy and one barrier


def _rows(at):
    """Where Hopper's accumulator over four warps keeps its 64 rows (the keys): ``(register, lanes, warps)`` bases, row
    offset ``v`` placed at coordinate ``at(v)``. A thread holds rows ``16 warp + lane / 4 + {0, 8}``; lanes 0-1
    choose columns, not rows."""
    return at(8), [at(1), at(2), at(4)], [at(16), at(32)]


def _scales_row() -> gl.DistributedLinearLayout:
    """:data:`SCALES_ROW`."""
    reg, lanes, warps = _rows(lambda v: [0, v])
    return gl.DistributedLinearLayout([reg], [[0, 0], [0, 0]] + lanes, warps, [], [1, BLOCK_N])


# A tile's scales ``[1, BLOCK_N]`` where the accumulator has its keys, so that seen as ``[BLOCK_N]`` they scale the head
# sums in place.
SCALES_ROW = gl.constexpr(_scales_row())


@gluon.jit
def _windows(ks_ptr, ke_ptr, t0, T, N, ks_s0, ke_s0, skip, BLOCK_Q: gl.constexpr, layout: gl.constexpr):
    """``(tokens, valid, ks, ke)`` of the block at ``t0`` (``[BLOCK_Q]`` in ``layout``): windows clipped to
    ``[0, N)``, missing rows and rows of at most ``skip`` keys (0: the empty ones) ``[N, 0)`` so they widen nothing
    (and get no logits)."""
    tok = t0 + gl.arange(0, BLOCK_Q, layout=layout)
    ok = tok < T
    tok64 = tok.to(gl.int64)
    ks = gl.minimum(gl.maximum(gl.load(ks_ptr + tok64 * ks_s0, mask=ok, other=0), 0), N)
    ke = gl.minimum(gl.maximum(gl.load(ke_ptr + tok64 * ke_s0, mask=ok, other=0), 0), N)
    empty = (ke - ks <= skip) | ~ok
    return tok, ok, gl.where(empty, N, ks), gl.where(empty, 0, ke)


@gluon.jit
def _span(ks, ke, BLOCK_N: gl.constexpr):
    """``(start, tiles)``: the union of the windows as ``tiles`` key tiles from ``start``."""
    lo = gl.min(ks, axis=0)
    hi = gl.max(ke, axis=0)
    start = (lo // BLOCK_N) * BLOCK_N
    return start, gl.where(hi > lo, gl.cdiv(hi - start, BLOCK_N), 0)


@gluon.jit
def _item(it, full, parts, blocks, BLOCK_Q: gl.constexpr):
    """``(t0, part, parts of its block)`` of the program's work item ``it``: items below ``full`` (whole rounds of the
    programs) are whole blocks, last block first; the blocks after them (fewer than the programs) are cut into
    ``parts`` parts of their key span each, so that the last round's work spreads over every program."""
    tail = gl.maximum(it - full, 0)
    in_tail = it >= full
    blk = gl.where(in_tail, full + tail // parts, it)
    return (blocks - 1 - blk) * BLOCK_Q, gl.where(in_tail, tail % parts, 0), gl.where(in_tail, parts, 1)


@gluon.jit
def _part(tiles, part, of, MATH: gl.constexpr):
    """The ring slots ``[lo, hi)`` of part ``part`` of ``of`` of a block of ``tiles`` key tiles."""
    slots = gl.cdiv(tiles, MATH)
    return part * slots // of, (part + 1) * slots // of


@gluon.jit
def _phase(g, STAGES: gl.constexpr):
    """The phase of use ``g`` of the ring (slot ``g % STAGES``, ``STAGES`` a power of two): the bit above the slot's."""
    return ((g & STAGES) != 0).to(gl.int32)


@gluon.jit
def _copy_partition(keys_desc, scales_desc, q_desc, keys_smem, scales_smem, q_smem, ready, empty, q_ready, q_empty,
                    ks_ptr, ke_ptr, T, N, ks_s0, ke_s0, skip, items, full, parts, H: gl.constexpr,
                    BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The copy warp: each block's Q into one of two slots once the math warps are done with the one before, then
    its keys and their scales a ring slot (``MATH`` tiles) at a time once the slot is free (slot ``g % STAGES`` of
    the program's running count ``g``, phase :func:`_phase`)."""
    tok_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    blocks = gl.cdiv(T, BLOCK_Q)
    i = 0
    c = 0
    for it in range(gl.program_id(0), items, gl.num_programs(0)):
        t0, part, of = _item(it, full, parts, blocks, BLOCK_Q)
        qb = c % 2
        mbarrier.wait(q_empty.index(qb), ((c // 2) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes)
        tma_load(q_desc, [t0 * H, 0], q_ready.index(qb), q_smem.index(qb))
        _, _, ks, ke = _windows(ks_ptr, ke_ptr, t0, T, N, ks_s0, ke_s0, skip, BLOCK_Q, tok_l)
        start, tiles = _span(ks, ke, BLOCK_N)
        lo, hi = _part(tiles, part, of, MATH)
        for step in range(lo, hi):
            g = i + step - lo
            slot = g & (STAGES - 1)
            mbarrier.wait(empty.index(slot), _phase(g, STAGES) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, keys_desc.block_type.nbytes + scales_desc.block_type.nbytes)
            tma_load(keys_desc, [start + step * (MATH * BLOCK_N), 0], bar, keys_smem.index(slot))
            tma_load(scales_desc, [0, start + step * (MATH * BLOCK_N)], bar, scales_smem.index(slot))
        i += hi - lo
        c += 1


@gluon.jit
def _math_partition(w_ptr, ks_ptr, ke_ptr, out_ptr, keys_smem, scales_smem, q_smem, ready, empty, q_ready, q_empty,
                    T, N, w_s0, ks_s0, ke_s0, out_s0, skip, items, full, parts, WG: gl.constexpr, MATH: gl.constexpr,
                    H: gl.constexpr,
                    BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    view: gl.constexpr, FILL: gl.constexpr, quad_l: gl.constexpr):
    """Math warp group ``WG`` of ``MATH``: the ``WG``-th tile of each ring slot: matmul, head sum, store (nothing of a
    tile past the block's last one); and (``FILL``) its share of the block's -inf columns."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_Q * H, 32])
    pair_l: gl.constexpr = gl.SliceLayout(2, view)  # [keys, tokens]
    keys_l: gl.constexpr = gl.SliceLayout(1, pair_l)
    tok_l: gl.constexpr = gl.SliceLayout(0, pair_l)
    w_l: gl.constexpr = gl.SliceLayout(0, view)  # [tokens, heads]
    fill_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 4], [1, 0])
    keys = gl.arange(0, BLOCK_N, layout=keys_l)
    w_tok = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, w_l))
    w_heads = gl.arange(0, H, layout=gl.SliceLayout(0, w_l))
    fill_tok = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, fill_l))
    fill_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, fill_l))
    fill = gl.full([BLOCK_Q, BLOCK_N], NEG_INF, gl.float32, layout=fill_l)
    zero = gl.zeros([BLOCK_N, BLOCK_Q * H], gl.float32, layout=mma)
    quad: gl.constexpr = [BLOCK_N, BLOCK_Q, 4]
    blocks = gl.cdiv(T, BLOCK_Q)
    i = 0
    c = 0
    for it in range(gl.program_id(0), items, gl.num_programs(0)):
        t0, part, of = _item(it, full, parts, blocks, BLOCK_Q)
        tok, tok_ok, ks, ke = _windows(ks_ptr, ke_ptr, t0, T, N, ks_s0, ke_s0, skip, BLOCK_Q, tok_l)
        start, tiles = _span(ks, ke, BLOCK_N)
        clean_lo = gl.max(ks, axis=0)
        clean_hi = gl.min(ke, axis=0)
        out_rows = tok.to(gl.int64) * out_s0
        w = gl.load(w_ptr + (t0 + w_tok).to(gl.int64)[:, None] * w_s0 + w_heads[None, :],
                    mask=(t0 + w_tok < T)[:, None], other=0.0)
        qb = c % 2
        mbarrier.wait(q_ready.index(qb), (c // 2) & 1)
        q_tile = q_smem.index(qb).permute((1, 0))
        stop = start + tiles * BLOCK_N
        lim = gl.minimum(stop, N)
        lo, hi = _part(tiles, part, of, MATH)
        for step in range(lo, hi):
            g = i + step - lo
            slot = g & (STAGES - 1)
            n0 = start + (step * MATH + WG) * BLOCK_N
            n = n0 + keys
            mbarrier.wait(ready.index(slot), _phase(g, STAGES))
            sc = scales_smem.index(slot).slice(WG * BLOCK_N, BLOCK_N, dim=1).load(SCALES_ROW)
            sc = gl.convert_layout(gl.reshape(sc, [BLOCK_N]), keys_l)  # the same registers
            acc = warpgroup_mma(keys_smem.index(slot).slice(WG * BLOCK_N, BLOCK_N), q_tile, zero, use_acc=False,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(slot), count=1)
            acc3 = gl.convert_layout(gl.reshape(acc, [BLOCK_N, BLOCK_Q, H]), view)  # the same registers
            # Halved with the key's scale: exact for a normal scale (quantize_index_k's are powers of two from 2^-22).
            s = gl.sum(twice_relu(acc3) * w[None, :, :], axis=2)
            s = s * (sc * 0.5)[:, None]
            ptrs = out_ptr + out_rows[None, :] + n.to(gl.int64)[:, None]
            if (n0 >= clean_lo) & (n0 + BLOCK_N <= clean_hi):
                # A quad's four lanes hold the same sums: all four store them (the quad's lane an axis of the same
                # addresses), unmasked, where Triton would mask the copies off lane by lane (a divergent branch).
                s4 = gl.expand_dims(gl.convert_layout(s, gl.SliceLayout(2, quad_l)), 2).broadcast_to(quad)
                p4 = gl.expand_dims(gl.convert_layout(ptrs, gl.SliceLayout(2, quad_l)), 2).broadcast_to(quad)
                gl.store(p4, s4)
            else:  # a tile on a window's edge, or past the block's last tile (nothing stored there)
                inside = (n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :])
                gl.store(ptrs, gl.where(inside, s, NEG_INF), mask=(n < lim)[:, None] & tok_ok[None, :])
        mbarrier.arrive(q_empty.index(qb), count=1)  # this group's matmuls on the block's Q are done
        i += hi - lo
        c += 1
        if FILL:  # this group's share of the -inf outside the union of the block's windows, once a block
            fill_rows = (t0 + fill_tok).to(gl.int64) * out_s0
            fill_ok = (t0 + fill_tok < T)[:, None]
            first = part == 0  # a block's parts: the first fills
            for f0 in range(WG * BLOCK_N, gl.where(first, start, 0), MATH * BLOCK_N):
                gl.store(out_ptr + fill_rows[:, None] + (f0 + fill_cols)[None, :], fill, mask=fill_ok)
            for f0 in range(stop + WG * BLOCK_N, gl.where(first, N, 0), MATH * BLOCK_N):
                fc = f0 + fill_cols
                gl.store(out_ptr + fill_rows[:, None] + fc[None, :], fill, mask=fill_ok & (fc < N)[None, :])


# The token count takes no part in the variant, nor do the addresses of the windows (read a token at a time;
# docs/kernels.md, "Kernel variants"). The key count does, as the logits' row stride (equal for contiguous logits):
# the -inf fill keeps 16-byte stores where it is a multiple of 16.
@gluon.jit(do_not_specialize=("T", "skip", "items", "full", "parts"),
           do_not_specialize_on_alignment=("ks_ptr", "ke_ptr"))
def prefill_sm90_kernel(
    keys_desc, scales_desc, q_desc, w_ptr, ks_ptr, ke_ptr, out_ptr,
    T, N, w_s0, ks_s0, ke_s0, out_s0, skip, items, full, parts,
    H: gl.constexpr, D: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    MATH_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, view: gl.constexpr, quad_l: gl.constexpr,
    FILL: gl.constexpr = 1,
):
    """One copy warp (``LOADER_REGS`` registers) fills the slots; four math warp groups (``MATH_REGS``) free them
    through mbarriers; ``view``: the matmul's accumulator layout seen as ``[BLOCK_N, BLOCK_Q, H]``
    (:func:`accumulator_view`), ``quad_l`` its head sums with a quad's lane as an axis (:func:`quad_view`).
    ``skip``: rows whose clipped window holds at most this many keys get no logits (0: as the contract, only empty
    ones); ``FILL`` 0: nothing is written outside the union of a block's windows (the producer step reads only inside
    each row's window). ``items``, ``full``, ``parts``: the work items (:func:`_item`; :func:`tail_parts`)."""
    keys_smem = gl.allocate_shared_memory(keys_desc.dtype, [STAGES] + keys_desc.block_type.shape, keys_desc.layout)
    scales_smem = gl.allocate_shared_memory(scales_desc.dtype, [STAGES] + scales_desc.block_type.shape,
                                            scales_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=MATH)
    for st in gl.static_range(2):
        mbarrier.init(q_ready.index(st), count=1)
        mbarrier.init(q_empty.index(st), count=MATH)
    # The four math warp groups run the same function (a tuple built from another would lose ``view``'s constness).
    gl.warp_specialize([
        (_math_partition, (w_ptr, ks_ptr, ke_ptr, out_ptr, keys_smem, scales_smem, q_smem, ready, empty, q_ready,
                           q_empty, T, N, w_s0, ks_s0, ke_s0, out_s0, skip, items, full, parts, 0, MATH, H, BLOCK_Q,
                           BLOCK_N, STAGES, view, FILL, quad_l)),
        (_math_partition, (w_ptr, ks_ptr, ke_ptr, out_ptr, keys_smem, scales_smem, q_smem, ready, empty, q_ready,
                           q_empty, T, N, w_s0, ks_s0, ke_s0, out_s0, skip, items, full, parts, 1, MATH, H, BLOCK_Q,
                           BLOCK_N, STAGES, view, FILL, quad_l)),
        (_math_partition, (w_ptr, ks_ptr, ke_ptr, out_ptr, keys_smem, scales_smem, q_smem, ready, empty, q_ready,
                           q_empty, T, N, w_s0, ks_s0, ke_s0, out_s0, skip, items, full, parts, 2, MATH, H, BLOCK_Q,
                           BLOCK_N, STAGES, view, FILL, quad_l)),
        (_math_partition, (w_ptr, ks_ptr, ke_ptr, out_ptr, keys_smem, scales_smem, q_smem, ready, empty, q_ready,
                           q_empty, T, N, w_s0, ks_s0, ke_s0, out_s0, skip, items, full, parts, 3, MATH, H, BLOCK_Q,
                           BLOCK_N, STAGES, view, FILL, quad_l)),
        (_copy_partition, (keys_desc, scales_desc, q_desc, keys_smem, scales_smem, q_smem, ready, empty, q_ready,
                           q_empty, ks_ptr, ke_ptr, T, N, ks_s0, ke_s0, skip, items, full, parts, H, BLOCK_Q,
                           BLOCK_N, STAGES)),
    ], [4, 4, 4, 1], [MATH_REGS, MATH_REGS, MATH_REGS, LOADER_REGS])
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(st))
        mbarrier.invalidate(empty.index(st))
    for st in gl.static_range(2):
        mbarrier.invalidate(q_ready.index(st))
        mbarrier.invalidate(q_empty.index(st))


PREFILL = Launcher(prefill_sm90_kernel)
# Triton 3.6 (sm90, 64 heads, with the -inf fill) keeps two values computed above the partitions (the block count and a
# thread's accumulator row) in an 8-byte stack frame: each read once a partition and once a block, never in the tile
# loop.
STACK_BYTES = 8


def accumulator_view(block_q: int, heads: int) -> gl.DistributedLinearLayout:
    """Hopper's accumulator layout of a ``[64, block_q · heads]`` matmul over four warps (a thread holds column
    pairs ``8j + 2 (lane % 4) + {0, 1}`` of rows ``16 warp + lane / 4 + {0, 8}``), as ``[64, block_q, heads]``:
    the same registers, so the head sum is adds inside a thread plus shuffles within a quad."""
    cols = block_q * heads

    def col(v: int) -> list[int]:
        return [0, v // heads, 0] if v >= heads else [0, 0, v]

    reg, lanes, warps = _rows(lambda v: [v, 0, 0])
    regs = [col(1), reg] + [col(8 << b) for b in range((cols // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, [col(2), col(4)] + lanes, warps, [], [BLOCK_N, block_q, heads])


def quad_view(block_q: int) -> gl.DistributedLinearLayout:
    """``[64, block_q, 4]``: the head sums ``[64, block_q]`` where the accumulator's quads hold them (each lane of a
    quad all of the quad's), the quad's lane as the last axis: seen so, no element is a copy of another."""
    reg, lanes, warps = _rows(lambda v: [v, 0, 0])
    regs = ([[0, 1, 0]] if block_q == 2 else []) + [reg]
    return gl.DistributedLinearLayout(regs, [[0, 0, 1], [0, 0, 2]] + lanes, warps, [], [BLOCK_N, block_q, 4])


def unsupported(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                target: Target) -> list[str]:
    """Why this kernel cannot take a prefill call (empty: it can; the Triton kernel takes the others). Arguments as
    ``indexcache.mqa_logits``."""
    heads, dim = q.shape[1], q.shape[2]
    reasons = unsupported_target(q.dtype, target)
    if k.dtype != q.dtype:
        reasons.append(f"k dtype {k.dtype}: keys in q's fp8 format only (MXFP4 keys come widened, prefill_fp4)")
    if dim != 128 or heads not in (64, 128):  # fewer heads: more tokens a block, whose windows spill registers
        reasons.append(f"{heads} heads of dim {dim}: 64 or 128 heads of dim 128 only")
    if k.shape[0] == 0 or k.stride(1) != 1 or k.stride(0) != dim or k.data_ptr() % 16:
        reasons.append("k must be a non-empty contiguous [N, 128] tensor aligned to 16 bytes (the copy engine's)")
    if q.shape[0] == 0 or not q.is_contiguous() or q.data_ptr() % 16:
        reasons.append("q must be a non-empty contiguous tensor aligned to 16 bytes (the copy engine's)")
    if k_scale.stride(0) != 1 or weights.stride(1) != 1 or out.stride(1) != 1:
        reasons.append("k_scale, weights and out need unit strides along their last dimension")
    if k_scale.data_ptr() % 16:
        reasons.append("k_scale must be aligned to 16 bytes (the copy engine brings it with the keys)")
    return reasons


@functools.cache
def _views(heads: int) -> tuple[int, gl.DistributedLinearLayout, gl.DistributedLinearLayout]:
    """``(tokens a block, accumulator_view, quad_view)`` for ``heads`` heads, built once: a layout costs the host tens
    of µs to build (Gluon checks it), and a launch's constexprs are these same values at every call."""
    block_q = COLS // heads
    return block_q, accumulator_view(block_q, heads), quad_view(block_q)


def _named(heads: int, dim: int, cfg: Mapping[str, Any]) -> dict[str, Any]:
    block_q, view, quad = _views(heads)
    return dict(H=heads, D=dim, BLOCK_Q=block_q, BLOCK_N=BLOCK_N, STAGES=cfg["TMA_STAGES"],
                MATH_REGS=cfg["TMA_MATH_REGS"], LOADER_REGS=LOADER_REGS, view=view, quad_l=quad)


def _options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"num_warps": 4, "maxnreg": cfg["TMA_MAXNREG"]}


_SCALES_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@functools.cache
def _layouts(dim: int) -> tuple:
    """The shared layouts of a ring slot's keys ``[STAGE_KEYS, dim]`` and a block's Q ``[COLS, dim]`` (built once)."""
    return (gl.NVMMASharedLayout.get_default_for([STAGE_KEYS, dim], gl.float8e4nv),
            gl.NVMMASharedLayout.get_default_for([COLS, dim], gl.float8e4nv))


def launch(q, k, k_scale, weights, ks, ke, out, *, cfg: Mapping[str, Any], sms: int, skip: int = 0,
           fill: bool = True) -> Launch:
    """The launch filling ``out [T, N]`` (contract: ``indexcache.mqa_logits``) for a call :func:`unsupported`
    accepts. ``cfg``: the mqa_logits tuning entry (``TMA_STAGES``, a multiple of the four math groups, else
    ValueError; ``TMA_MAXNREG``, the kernel-wide register cap; ``TMA_MATH_REGS``, the math groups' share); ``sms``: the
    device's multiprocessors; ``skip`` and ``fill`` as the kernel's ``skip`` and ``FILL``. One program a SM (its 20
    warps take the register file), never more than there are blocks."""
    stages = cfg["TMA_STAGES"]
    if stages < 1 or stages & (stages - 1):
        raise ValueError(f"mqa_logits tuning entry TMA_STAGES={stages}: expected a power of two (ring slots of "
                         f"{STAGE_KEYS} keys, counted with bit masks)")
    tokens, heads, dim = q.shape
    n = k.shape[0]
    keys_layout, q_layout = _layouts(dim)
    keys_desc = TensorDescriptor(k, [n, dim], [dim, 1], [STAGE_KEYS, dim], keys_layout)
    # k_scale as one row of n float32 (the row stride is never used: any multiple of 16 bytes will do)
    scales_desc = TensorDescriptor(k_scale, [1, n], [4 * (n // 4 + 1), 1], [1, STAGE_KEYS], _SCALES_LAYOUT)
    rows = q.view(tokens * heads, dim)  # a block's Q: COLS rows from token t0's first
    q_desc = TensorDescriptor(rows, [tokens * heads, dim], [dim, 1], [COLS, dim], q_layout)
    options = launch_key_options(_options(cfg))
    named = dict(_named(heads, dim, cfg), FILL=fill)
    blocks = cdiv(tokens, named["BLOCK_Q"])
    programs = max(1, min(sms, blocks))
    full, parts = (blocks // programs) * programs, tail_parts(blocks % programs, programs)
    args = (keys_desc, scales_desc, q_desc, weights, ks, ke, out, tokens, n, weights.stride(0), ks.stride(0),
            ke.stride(0), out.stride(0), skip, full + (blocks - full) * parts, full, parts)
    return Launch(PREFILL, (programs,), options, args, named)


def tail_parts(tail: int, programs: int, most: int = 8) -> int:
    """Parts to cut each of the ``tail`` blocks of a last, partial round into (by their key span), so that the round's
    work spreads over the ``programs`` with the least work left on the busiest: the ``s`` of ``1 .. most`` that makes
    ``ceil(tail · s / programs) / s`` smallest (1 when the rounds are whole)."""
    if tail == 0:
        return 1
    return min(range(1, most + 1), key=lambda s: (-(-tail * s // programs)) / s)


def compile_specs(target: Target, cfg: Mapping[str, Any], heads: int, dim: int) -> list:
    """What the kernel builds for ``target`` (sm90 only, else nothing) at the given indexer shape with the
    ``mqa_logits`` entry ``cfg``, with the -inf fill (``mqa_logits``) and without (the producer step; cross-compile
    check)."""
    from indexcache.backends.triton.crosscompile import KernelSpec

    if target.gpu.mma != "wgmma":  # Hopper's warp-group MMA and TMA
        return []
    keys, q = _layouts(dim)
    types = {"keys_desc": f"tensordesc<fp8e4nv[{STAGE_KEYS}, {dim}],{keys!r}>",
             "scales_desc": f"tensordesc<fp32[1, {STAGE_KEYS}],{_SCALES_LAYOUT!r}>",
             "q_desc": f"tensordesc<fp8e4nv[{COLS}, {dim}],{q!r}>", "w_ptr": "*fp32",
             "ks_ptr": "*i32", "ke_ptr": "*i32", "out_ptr": "*fp32"}
    return [KernelSpec("mqa_logits", prefill_sm90_kernel, types,
                       {**_named(heads, dim, cfg), "FILL": fill, "ks_s0": 1, "ke_s0": 1}, _options(cfg),
                       matrix="fp8", aligned=("w_s0", "out_s0"), stack_bytes=STACK_BYTES * fill) for fill in (1, 0)]
