"""Block fp8 quantization with power-of-two scales, and the store into the packed index-K cache, in Triton.

``scale = 2 ** ceil(log2(max(amax, 1e-4) / fp8_max))`` is found exactly: log2 gives a first
exponent and two exact comparisons against ``fp8_max · 2^e`` correct it; the power of two is built
from its exponent bits, and dividing by it is exact. The quotient is rounded to nearest-even on the
e4m3 grid with fp32 bit arithmetic, so the final cast is exact and the bytes match the reference bit
for bit on every target (the CPU interpreter's own fp8 downcast does not carry a rounded-up mantissa
into the exponent). On targets without fp8 conversions (sm80: the tuning table's ``FP8_CVT = "bits"``)
the output is taken as bytes (uint8) and the e4m3 byte is built from the rounded fp32 with integer bit
arithmetic, the same bytes. The store takes one scale a token (block = D) and writes the fp8 bytes and the fp32 scale of
each token to its slot; slots < 0 or beyond the cache are masked out on the device (no host sync,
safe inside a captured graph). A block holding NaN or ±inf gets scale NaN and zero bytes (the contract's
non-finite rule). Nothing is allocated beyond the op's own output. MXFP4 keys (``torch.float4_e2m1fn_x2``,
docs/fp4.md) go through :func:`mxfp4_kernel`, for both ops and on every target: bytes from bit arithmetic and
comparisons alone, equal to the reference's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from indexcache.backends.triton import support
from indexcache.backends.triton.launcher import Launch, Launcher, Options, bound, launch_key_options
from indexcache.backends.triton.support import cdiv, launch_options, next_power_of_2, on_target_device
from indexcache.backends.triton.target import Target
from indexcache.hal import fp4
from indexcache.hal.contract import OpImpl
from indexcache.hal.layout import cache_page_size, fp8_max


@triton.jit
def _pow2(e):
    """2^e as float32 for integer e in [-126, 127], built from the exponent bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(y, MIN_EXP: tl.constexpr):
    """fp32 ``y`` (|y| ≤ the format's max) rounded to nearest-even on the e4m3 grid (3 mantissa bits, normals
    from 2^MIN_EXP, subnormal step 2^(MIN_EXP - 3)), still in fp32: the cast to fp8 is then exact everywhere."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -0x100000
    magic: tl.constexpr = 2.0 ** (MIN_EXP + 20)  # adding it rounds to multiples of the subnormal step
    tiny = ((tl.abs(y) + magic) - magic).to(tl.int32, bitcast=True)
    mag = tl.where(mag >= (127 + MIN_EXP) << 23, normal, tiny)
    return (mag | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_out(y, ptr, MIN_EXP: tl.constexpr):
    """``y`` (fp32 on the e4m3 grid, |y| ≤ the format's max) as ``ptr``'s element type: an exact cast to the fp8
    type, or for a uint8 ``ptr`` the e4m3 byte from bit arithmetic (exponent bias 1 - MIN_EXP): a normal's fp32
    exponent rebiased above its top 3 mantissa bits, a subnormal's multiple of 2^(MIN_EXP - 3), the sign in
    bit 7. Never a -0 in e4m3fnuz, whose 0x80 is NaN (the native cast is not left to decide it)."""
    if ptr.dtype.element_ty == tl.uint8:
        STEP: tl.constexpr = 2.0 ** (3 - MIN_EXP)
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        normal = (mag >> 20) - ((126 + MIN_EXP) << 3)
        tiny = (tl.abs(y) * STEP).to(tl.int32)
        code = tl.where(mag >= (127 + MIN_EXP) << 23, normal, tiny)
        sign = (bits >> 24) & 0x80
        if MIN_EXP == -7:
            sign = tl.where(mag == 0, 0, sign)
        out = (code | sign).to(tl.uint8)
    else:
        if MIN_EXP == -7:  # e4m3fnuz has no -0 (0x80 is NaN): a value that rounded to -0.0 is cast as +0
            y = tl.where(y == 0.0, 0.0, y)
        out = y.to(ptr.dtype.element_ty)
    return out


@triton.jit
def _quantize_rows(x, LIMIT: tl.constexpr, MIN_EXP: tl.constexpr):
    """``(x / s, s)`` per row of fp32 ``x [R, C]``: the smallest power of two ``s`` with amax ≤ LIMIT · s;
    ``x / s`` already on the fp8 grid. A row holding NaN or ±inf gets ``s`` NaN and zeros."""
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1) > 0
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    e = tl.ceil(tl.log2(amax / LIMIT)).to(tl.int32)
    e = tl.where(amax > LIMIT * _pow2(e), e + 1, e)
    e = tl.where(amax <= LIMIT * _pow2(e - 1), e - 1, e)
    y = _round_e4m3(tl.where(bad[:, None], 0.0, x * _pow2(-e)[:, None]), MIN_EXP)
    return y, tl.where(bad, float("nan"), _pow2(e))


# The row count (and the cache's slots) take no part in a variant, nor does the address of the slots (read an entry at
# a time; docs/kernels.md, "Kernel variants").
@triton.jit(do_not_specialize=("rows",))
def quantize_kernel(
    k_ptr, q_ptr, s_ptr, rows, cols,
    k_s0, k_s1, q_s0, q_s1, s_s0, s_s1,
    LIMIT: tl.constexpr, MIN_EXP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_P2)
    blk = tl.program_id(1)
    col = blk * BLOCK + c
    ok = (r < rows)[:, None] & (c < BLOCK)[None, :]
    r64 = r.to(tl.int64)
    col64 = col.to(tl.int64)  # a column stride may be large (transposed keys): offsets in int64, as the rows'
    x = tl.load(k_ptr + r64[:, None] * k_s0 + col64[None, :] * k_s1, mask=ok, other=0.0).to(tl.float32)
    y, scale = _quantize_rows(x, LIMIT, MIN_EXP)
    tl.store(q_ptr + r64[:, None] * q_s0 + col64[None, :] * q_s1, _fp8_out(y, q_ptr, MIN_EXP), mask=ok)
    tl.store(s_ptr + r64 * s_s0 + blk.to(tl.int64) * s_s1, scale, mask=r < rows)  # a large stride: int64


@triton.jit(do_not_specialize=("rows", "slots"), do_not_specialize_on_alignment=("slot_ptr",))
def store_kernel(
    k_ptr, slot_ptr, kv_ptr, kv_scale_ptr, rows, slots,
    k_s0, k_s1, slot_s0,
    LIMIT: tl.constexpr, MIN_EXP: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, D_P2)
    r64 = r.to(tl.int64)
    slot = tl.load(slot_ptr + r64 * slot_s0, mask=r < rows, other=-1).to(tl.int64)
    live = (slot >= 0) & (slot < slots)
    ok = live[:, None] & (c < D)[None, :]
    x = tl.load(k_ptr + r64[:, None] * k_s0 + c.to(tl.int64)[None, :] * k_s1, mask=ok, other=0.0).to(tl.float32)
    y, scale = _quantize_rows(x, LIMIT, MIN_EXP)
    page = slot // PAGE
    off = slot % PAGE
    tl.store(kv_ptr + (page * (PAGE * (D + 4)) + off * D)[:, None] + c[None, :], _fp8_out(y, kv_ptr, MIN_EXP),
             mask=ok)
    tl.store(kv_scale_ptr + page * (PAGE * (D + 4) // 4) + PAGE * D // 4 + off, scale, mask=live)


QUANTIZE, STORE = Launcher(quantize_kernel), Launcher(store_kernel)


@triton.jit(do_not_specialize=("rows", "slots"), do_not_specialize_on_alignment=("slot_ptr",))
def mxfp4_kernel(
    k_ptr, slot_ptr, v_ptr, s_ptr, rows, slots,
    k_s0, k_s1, slot_s0, v_s0, s_s0,
    D: tl.constexpr, D_P2: tl.constexpr, PAGE: tl.constexpr, BLOCK_R: tl.constexpr, STORE: tl.constexpr,
):
    """MXFP4 keys (docs/fp4.md) of ``BLOCK_R`` rows of ``k``: to rows of ``v`` (``D / 2`` bytes) and ``s`` (``D / 32``
    e8m0 bytes), or with ``STORE`` into the MXFP4 paged cache (``v`` and ``s`` both the cache's bytes) at the rows'
    slots. Scale ``2 ** e``, ``e`` the exact ceil of ``log2(max(amax, 1e-4) / 6)``; a value's code counts the grid's
    half-way points it passes (``>=`` at those whose upper neighbour has the even code); NaN or ±inf in a block:
    scale byte 255 and zero values."""
    NB: tl.constexpr = D_P2 // 32
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = r.to(tl.int64)
    if STORE:
        slot = tl.load(slot_ptr + r64 * slot_s0, mask=r < rows, other=-1).to(tl.int64)
        live = (slot >= 0) & (slot < slots)
        page, off = slot // PAGE, slot % PAGE
        base_v = page * (PAGE * (D // 2 + D // 32)) + off * (D // 2)
        base_s = page * (PAGE * (D // 2 + D // 32)) + PAGE * (D // 2) + off * (D // 32)
    else:
        live = r < rows
        base_v = r64 * v_s0
        base_s = r64 * s_s0
    b = tl.arange(0, NB)
    col = b[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    ok = live[:, None, None] & (col < D)
    x = tl.load(k_ptr + r64[:, None, None] * k_s0 + col.to(tl.int64) * k_s1, mask=ok, other=0.0).to(tl.float32)
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=2) > 0
    amax = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-4)
    e = tl.ceil(tl.log2(amax / 6.0)).to(tl.int32)
    e = tl.where(amax > 6.0 * _pow2(e), e + 1, e)
    e = tl.where(amax <= 6.0 * _pow2(e - 1), e - 1, e)  # amax of a finite fp32 keeps e in [-15, 126]
    y = tl.where(bad[:, :, None], 0.0, x * _pow2(-e)[:, :, None])
    a = tl.abs(y)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    nibble = code | tl.where((y < 0) & (code > 0), 8, 0)
    low, high = tl.split(tl.reshape(nibble, (BLOCK_R, NB, 16, 2)))
    j = b[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    tl.store(v_ptr + base_v[:, None, None] + j, (low | (high << 4)).to(tl.uint8),
             mask=live[:, None, None] & (j < D // 2))
    tl.store(s_ptr + base_s[:, None] + b[None, :], tl.where(bad, 255, e + 127).to(tl.uint8),
             mask=live[:, None] & (b < D // 32)[None, :])


MXFP4 = Launcher(mxfp4_kernel)


def _min_exp(fp8_dtype: torch.dtype) -> int:
    """Exponent of the smallest normal of an fp8 format (-6 for e4m3fn, -7 for e4m3fnuz)."""
    return int(math.log2(torch.finfo(fp8_dtype).smallest_normal))


def _fp8_bits(cfg: Mapping[str, Any]) -> bool:
    """Whether the kernels write fp8 as bytes built with bit arithmetic (the table's ``FP8_CVT`` is "bits")."""
    return cfg.get("FP8_CVT", "native") == "bits"


def _fp8_quantize_launches(k, q, scale, fp8_dtype, block, *, target: Target, cfg: Mapping[str, Any],
                           options: Options | None = None) -> list[Launch]:
    """:func:`quantize_launches` to fp8: fill ``q [N, D]`` (fp8_dtype) and ``scale [N, D // block]`` float32 from ``k
    [N, D]``; none when they are empty, one more for each ``MAX_GRID_Y`` blocks a row past the first (a grid's second
    dimension holds no more), each over its columns' views."""
    rows, cols = k.shape
    if q.numel() == 0:
        return []
    block_p2 = next_power_of_2(block)
    block_r = max(1, cfg["ELEMS"] // block_p2)  # the tile follows the block, never the row count
    options = options or launch_key_options(launch_options(target, cfg))
    q = q.view(torch.uint8) if _fp8_bits(cfg) else q
    blocks = support.MAX_GRID_Y
    parts = [(k, q, scale)] if cols // block <= blocks else [
        (k[:, c:c + blocks * block], q[:, c:c + blocks * block], scale[:, c // block:c // block + blocks])
        for c in range(0, cols, blocks * block)]
    named = dict(LIMIT=fp8_max(fp8_dtype), MIN_EXP=_min_exp(fp8_dtype), BLOCK=block, BLOCK_P2=block_p2,
                 BLOCK_R=block_r)
    return [Launch(QUANTIZE, (cdiv(rows, block_r), part.shape[1] // block), options,
                   (part, part_q, part_scale, rows, part.shape[1], *part.stride(), *part_q.stride(),
                    *part_scale.stride()), named)
            for part, part_q, part_scale in parts]


def quantize_launches(k, fp8_dtype, block, out, out_scale, *, target: Target, cfg: Mapping[str, Any],
                      options: Options | None = None) -> list[Launch]:
    """The launches that write ``out`` and ``out_scale`` from ``k [N, D]`` (contract: ``indexcache.quantize_index_k``;
    MXFP4 through :func:`mxfp4_launch`): one, none when they are empty, more for rows of more than ``MAX_GRID_Y``
    fp8 blocks."""
    if fp8_dtype == fp4.FP4:
        launch = mxfp4_launch(k, None, out.view(torch.uint8), out_scale.view(torch.uint8), target=target, cfg=cfg,
                              options=options)
        return [] if launch is None else [launch]
    return _fp8_quantize_launches(k, out, out_scale, fp8_dtype, block, target=target, cfg=cfg, options=options)


def quantize_index_k(k, fp8_dtype, block, out, out_scale, *, target: Target, cfg: Mapping[str, Any],
                     options: Options | None = None):
    """Write ``out`` and ``out_scale`` (fp8's ``[N, D]`` and ``[N, D // block]`` float32, or MXFP4's values and
    scales); returns them (contract: ``indexcache.quantize_index_k``)."""
    for launch in quantize_launches(k, fp8_dtype, block, out, out_scale, target=target, cfg=cfg, options=options):
        launch()
    return out, out_scale


def _fp8_store_launch(k, k_cache, slot_mapping, fp8_dtype, *, target: Target, cfg: Mapping[str, Any],
                      options: Options | None = None) -> Launch | None:
    """:func:`store_index_k_launch` into an fp8 cache."""
    rows, dim = k.shape
    if rows == 0 or k_cache.numel() == 0:
        return None
    page = cache_page_size(k_cache, dim)
    flat = k_cache.view(-1)
    d_p2 = next_power_of_2(dim)
    block_r = max(1, cfg["ELEMS"] // d_p2)  # the tile follows the head dim, never the row count
    options = options or launch_key_options(launch_options(target, cfg))
    return Launch(
        STORE, (cdiv(rows, block_r),), options,
        (k, slot_mapping, flat.view(torch.uint8 if _fp8_bits(cfg) else fp8_dtype), flat.view(torch.float32), rows,
         k_cache.shape[0] * page,
         k.stride(0), k.stride(1), slot_mapping.stride(0)),
        dict(LIMIT=fp8_max(fp8_dtype), MIN_EXP=_min_exp(fp8_dtype), D=dim, D_P2=d_p2, PAGE=page, BLOCK_R=block_r),
    )


def mxfp4_launch(k, slot_mapping, values, scales, *, target: Target, cfg: Mapping[str, Any],
                 options: Options | None = None) -> Launch | None:
    """MXFP4 keys of ``k [N, D]``: into ``values [N, D / 2]`` and ``scales [N, D / 32]`` (bytes), or with a
    ``slot_mapping`` into the MXFP4 cache ``values`` at those slots (``scales`` None); None when nothing is written."""
    rows, dim = k.shape
    store = slot_mapping is not None
    if rows == 0 or values.numel() == 0:
        return None
    page = cache_page_size(values, dim, fp4.FP4) if store else 1
    out = values.view(-1).view(torch.uint8) if store else values.view(torch.uint8)
    s = out if store else scales.view(torch.uint8)
    d_p2 = next_power_of_2(dim)
    block_r = max(1, cfg["ELEMS"] // d_p2)  # the tile follows the head dim, never the row count
    options = options or launch_key_options(launch_options(target, cfg))
    return Launch(
        MXFP4, (cdiv(rows, block_r),), options,
        (k, slot_mapping if store else k, out, s, rows, values.shape[0] * page if store else 0,
         k.stride(0), k.stride(1), slot_mapping.stride(0) if store else 0, 0 if store else out.stride(0),
         0 if store else s.stride(0)),
        dict(D=dim, D_P2=d_p2, PAGE=page, BLOCK_R=block_r, STORE=store),
    )


def store_index_k(k, k_cache, slot_mapping, fp8_dtype, *, target: Target, cfg: Mapping[str, Any],
                  options: Options | None = None) -> None:
    """Quantize ``k [N, D]`` into the packed cache at ``slot_mapping [N]`` (contract: ``indexcache.store_index_k``)."""
    launch = store_index_k_launch(k, k_cache, slot_mapping, fp8_dtype, target=target, cfg=cfg, options=options)
    if launch is not None:
        launch()


def store_index_k_launch(k, k_cache, slot_mapping, fp8_dtype, *, target: Target, cfg: Mapping[str, Any],
                         options: Options | None = None) -> Launch | None:
    """The launch that quantizes ``k [N, D]`` into the packed cache at ``slot_mapping [N]`` (contract:
    ``indexcache.store_index_k``; an MXFP4 cache through :func:`mxfp4_launch`), None when there is nothing to
    store."""
    if fp8_dtype == fp4.FP4:
        return mxfp4_launch(k, slot_mapping, k_cache, None, target=target, cfg=cfg, options=options)
    return _fp8_store_launch(k, k_cache, slot_mapping, fp8_dtype, target=target, cfg=cfg, options=options)


def _fp8_policy(fp8_dtype: torch.dtype, target: Target) -> list[str]:
    if fp8_dtype == fp4.FP4:  # written by bit arithmetic alone, on every target
        return []
    if fp8_dtype != target.fp8_dtype:
        return [f"fp8_dtype is {str(fp8_dtype).removeprefix('torch.')}, but {target.arch}'s native fp8 format "
                f"is {str(target.fp8_dtype).removeprefix('torch.')}"]
    return []


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """``quantize_index_k`` and ``store_index_k`` of a GPU backend built for ``target`` with its tuning table."""
    cfg = tuning["quantize_index_k"]
    options = launch_key_options(launch_options(target, cfg))

    def supports_quantize(k, fp8_dtype, block, out, out_scale, **_):
        reasons = [*on_target_device(target, k=k, out=out, out_scale=out_scale), *_fp8_policy(fp8_dtype, target)]
        if block > cfg["ELEMS"]:
            reasons.append(f"block={block}: the Triton kernel holds one block in registers, at most {cfg['ELEMS']}")
        if fp8_dtype == fp4.FP4 and k.shape[1] > cfg["ELEMS"]:
            reasons.append(f"D={k.shape[1]}: the MXFP4 kernel holds one key in registers, at most {cfg['ELEMS']}")
        return reasons

    def supports_store(k, k_cache, slot_mapping, fp8_dtype, **_):
        reasons = [*on_target_device(target, k=k, k_cache=k_cache, slot_mapping=slot_mapping),
                   *_fp8_policy(fp8_dtype, target)]
        if k.shape[1] > cfg["ELEMS"]:
            reasons.append(f"D={k.shape[1]}: the Triton store holds one token in registers, at most {cfg['ELEMS']}")
        return reasons

    def run_quantize(**args):
        return quantize_index_k(**args, target=target, cfg=cfg, options=options)

    def prepare_quantize(**args):
        return bound(quantize_launches(**args, target=target, cfg=cfg, options=options))

    def run_store(**args):
        return store_index_k(**args, target=target, cfg=cfg, options=options)

    def prepare_store(**args):
        return bound([store_index_k_launch(**args, target=target, cfg=cfg, options=options)])

    return {"quantize_index_k": OpImpl(run_quantize, supports_quantize, prepare_quantize),
            "store_index_k": OpImpl(run_store, supports_store, prepare_store)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What quantize_index_k and store_index_k build for ``target`` (cross-compile check): the target's fp8
    format from fp32, bf16 and fp16 keys, at D = 128 (one 128-wide block a token, 64-token pages), and MXFP4 keys
    from bf16 ones, with the table's rows a program, for contiguous tensors."""
    from indexcache.backends.triton.crosscompile import KernelSpec, pointer

    cfg = tuning["quantize_index_k"]
    dim, page, fp8 = 128, 64, target.fp8_dtype
    out = "*u8" if _fp8_bits(cfg) else pointer(fp8)
    fmt = {"LIMIT": fp8_max(fp8), "MIN_EXP": _min_exp(fp8)}
    rows = max(1, cfg["ELEMS"] // dim)
    specs = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        specs.append(KernelSpec(
            "quantize_index_k", quantize_kernel, {"k_ptr": pointer(dtype), "q_ptr": out, "s_ptr": "*fp32"},
            {**fmt, "BLOCK": dim, "BLOCK_P2": dim, "BLOCK_R": rows, "k_s1": 1, "q_s1": 1, "s_s1": 1},
            launch_options(target, cfg), aligned=("k_s0", "q_s0")))
        specs.append(KernelSpec(
            "store_index_k", store_kernel,
            {"k_ptr": pointer(dtype), "slot_ptr": "*i32", "kv_ptr": out, "kv_scale_ptr": "*fp32"},
            {**fmt, "D": dim, "D_P2": dim, "PAGE": page, "BLOCK_R": rows, "k_s1": 1, "slot_s0": 1},
            launch_options(target, cfg), aligned=("k_s0",)))
    for store in (False, True):  # MXFP4 keys from bf16, into rows or into the cache (bit arithmetic, any target)
        specs.append(KernelSpec(
            "store_index_k" if store else "quantize_index_k", mxfp4_kernel,
            {"k_ptr": pointer(torch.bfloat16), "slot_ptr": "*i32" if store else pointer(torch.bfloat16),
             "v_ptr": "*u8", "s_ptr": "*u8"},
            {"D": dim, "D_P2": dim, "PAGE": page if store else 1, "BLOCK_R": rows, "STORE": store, "k_s1": 1,
             **({"slot_s0": 1} if store else {})},
            launch_options(target, cfg), aligned=("k_s0",) if store else ("k_s0", "v_s0", "s_s0")))
    return specs
