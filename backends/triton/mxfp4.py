"""MXFP4 keys widened in registers for the fp8 matrix path (docs/fp4.md, "Plan for the kernels").

Every e2m1 value times a power of two in a window is an e4m3 value: code ``c`` (magnitude 0, 0.5, 1, 1.5, 2, 3, 4,
6) is byte 0 for ``c = 0``, else ``0x2C + 4c + 4·[c ≥ 2]`` (``0x30`` for 0.5 … ``0x4C`` for 6, e4m3fn), the sign in
bit 7. Times ``2 ** d`` the nonzero bytes are ``8d`` more while the result stays a normal e4m3 value no larger than
the format's maximum: for ``-5 ≤ d ≤ 5`` in both fp8 formats (e4m3fnuz's bias is one more: 8 more again on nonzero
bytes, never the byte 0x80, its NaN). So a key whose block scale bytes lie within :data:`SPREAD` of each other is
its values times ``2 ** (byte - R)`` in e4m3, exactly, and one scale ``2 ** (R - 127)`` a key
(``R = max(largest byte - 5, 1)``); a key with a block scale byte 255 (NaN) has scale NaN.

The widening works on 32-bit words, four nibbles at a time (one a byte) with byte-wise adds and a multiply that never
carry: the value bytes of a key are read as int32 words (eight elements each), and each word gives two words of e4m3
bytes, its even and its odd elements (:func:`permute`: the queries are put in the same order).

Where the target has a block-scaled matrix instruction the keys keep their block scales (``head_sum.scaled_dot``),
relative to each key's largest (:func:`from_top`, the largest applied after the dot): as e2m1 bytes, or widened here
with the lift of ``2 ** 0`` (the values as they are, exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

# How MXFP4 keys reach the matrix instruction, the logits kernels' ``MXFP4`` (0: no MXFP4 keys): widened to e4m3fn
# (1) or e4m3fnuz (2) with one scale a key (this module), or into a block-scaled instruction (``tl.dot_scaled``, the
# target's ``ScaledMma``) that applies each block's scale itself, as e2m1 (3) or widened to e4m3fn (4).
WIDEN_FN, WIDEN_FNUZ, SCALED_E2M1, SCALED_E4M3 = (tl.constexpr(m) for m in (1, 2, 3, 4))
SPREAD = tl.constexpr(10)  # largest difference of a key's block scale bytes that the one-scale-a-key path takes
TOP = tl.constexpr(5)  # a key's largest block is its values times 2 ** TOP in e4m3 (6 · 32 = 192: both fp8 formats)


@triton.jit
def _e4m3(c, sign, lift, FNUZ: tl.constexpr):
    """Four e2m1 codes (``c``: one a byte of uint32, 0-7) and their signs (``sign``: bit 7 of each byte) as four
    e4m3 bytes: 0 where the code is 0 (the sign kept in e4m3fn: -0; dropped in e4m3fnuz, whose 0x80 is NaN), else
    ``lift + 4c + 4·[c ≥ 2]`` with the sign. ``lift`` (4 .. 0x5C, so no byte's sum reaches bit 7; one for the
    word's four bytes) is ``0x2C + 8d`` (+ 8 for e4m3fnuz) for the values times ``2 ** d``."""
    nonzero = ((c + 0x07070707) >> 3) & 0x01010101  # 1 in a byte where c ≥ 1
    two = ((c + 0x06060606) >> 1) & 0x04040404  # 4 where c ≥ 2
    if FNUZ:
        sign = sign & (nonzero << 7)
    return (nonzero * lift + (c * 4 + two)) | sign


@triton.jit
def widen(words, lift, ROWS: tl.constexpr, D: tl.constexpr, FNUZ: tl.constexpr):
    """MXFP4 values ``words`` (uint32 ``[ROWS, D // 8]``: a key's bytes, little-endian, element ``2i`` in the low
    nibble of byte ``i``) as e4m3 bytes, four a word: uint32 ``[ROWS, D // 4]`` in the order of :func:`permute`
    (word ``2j`` the even elements of input word ``j``, word ``2j + 1`` its odd ones: a nibble mask apart, no
    shuffling). ``lift`` (uint32 ``[ROWS, D // 8]``, one of :func:`_e4m3`'s lifts a word) scales each word's values."""
    even = _e4m3(words & 0x07070707, (words << 4) & 0x80808080, lift, FNUZ)
    odd = _e4m3((words >> 4) & 0x07070707, words & 0x80808080, lift, FNUZ)
    return tl.reshape(tl.join(even, odd), (ROWS, D // 4))


@triton.jit
def permute(x, ROWS: tl.constexpr, D: tl.constexpr):
    """``x [ROWS, D]`` in :func:`widen`'s order of a key's elements: place ``8j + 4h + b`` holds element
    ``8j + 2b + h``. A dot over D is the same with both operands in this order, so the queries are put in it (once a
    request)."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS, D // 8, 4, 2)), (0, 1, 3, 2)), (ROWS, D))


@triton.jit
def unpermute(x, ROWS: tl.constexpr, D: tl.constexpr):
    """The inverse of :func:`permute`: ``x [ROWS, D]`` in :func:`widen`'s order back in the elements' own."""
    return tl.reshape(tl.permute(tl.reshape(x, (ROWS, D // 8, 2, 4)), (0, 1, 3, 2)), (ROWS, D))


@triton.jit
def e8m0(b):
    """Scale bytes (int32) as float32: ``2 ** (b - 127)``, 255 NaN (0, 2^-127, a subnormal)."""
    x = (b << 23).to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), tl.where(b == 0, 2.0 ** -127, x))


@triton.jit
def key_lifts(scales, ROWS: tl.constexpr, D: tl.constexpr, FNUZ: tl.constexpr):
    """For a tile's scale bytes ``scales`` (int32 ``[ROWS, D // 32]``): ``(lift uint32 [ROWS, D // 8], scale
    float32 [ROWS], one [ROWS])``: each word's :func:`widen` lift and the key's one scale, and whether the key
    takes them (its bytes within SPREAD, or a NaN block: scale NaN whatever the values)."""
    top = tl.max(scales, axis=1)
    ref = tl.maximum(top - TOP, 1)
    one = (top - tl.min(scales, axis=1) <= SPREAD) | (top == 255)
    lift = tl.minimum(tl.maximum(0x2C + 8 * FNUZ + 8 * (scales - ref[:, None]), 4), 0x5C).to(tl.uint32)
    lift = tl.reshape(tl.broadcast_to(lift[:, :, None], (ROWS, D // 32, 4)), (ROWS, D // 8))
    scale = tl.where(top == 255, float("nan"), (ref << 23).to(tl.float32, bitcast=True))
    return lift, scale, one


@triton.jit
def from_top(scales):
    """Rows' block scale bytes (int32 ``[ROWS, D // 32]``) relative to each row's largest, for a block-scaled
    instruction (``head_sum.scaled_dot``): ``byte - top + 127``, int32, the largest block at 2^0 (its values at most
    6, whatever the instruction does with a scale; the row's largest is applied after the dot, 255 NaN by the
    callers' rule). Below 0 for a block more than 2^127 below its row's largest, which no byte holds:
    :func:`drop_below` zeroes its values."""
    return scales - tl.max(scales, axis=1)[:, None] + 127


@triton.jit
def drop_below(words, rel, ROWS: tl.constexpr, D: tl.constexpr):
    """MXFP4 rows ``words`` (uint32 ``[ROWS, D // 8]``) with the values of each block whose byte relative to its
    row's largest (``rel``, :func:`from_top`) is below 0 zeroed: a block more than 2^127 below its row's largest is
    lost (the exact paths' limit, docs/fp4.md), where clamping its byte at 0 would take it at 2^-127."""
    below = tl.reshape(tl.broadcast_to((rel < 0)[:, :, None], (ROWS, D // 32, 4)), (ROWS, D // 8))
    return tl.where(below, 0, words)


@triton.jit
def ranks(scales, ROWS: tl.constexpr, D: tl.constexpr):
    """Each block's place among its key's blocks by scale byte, smallest first, ties by position: int32
    ``[ROWS, D // 32]``, a permutation of ``0 .. D / 32 - 1`` a key."""
    pos = tl.arange(0, D // 32)
    bj = scales[:, :, None]
    bi = scales[:, None, :]
    before = (bi < bj) | ((bi == bj) & (pos[None, None, :] < pos[None, :, None]))
    return tl.sum(before.to(tl.int32), axis=2)


@triton.jit
def pass_words(words, scales, order, p, ROWS: tl.constexpr, D: tl.constexpr, FNUZ: tl.constexpr):
    """Pass ``p`` over keys whose block scales are too far apart for one scale a key: each key's block of place
    ``p`` in ``order`` (:func:`ranks`) alone, ``(e4m3 words [ROWS, D // 4] with the key's other blocks zero, that
    block's scale byte int32 [ROWS])``: the values in units of their block's scale, exact."""
    place = tl.reshape(tl.broadcast_to(order[:, :, None], (ROWS, D // 32, 4)), (ROWS, D // 8))
    e4m3 = widen(tl.where(place == p, words, 0), (0x2C + 8 * FNUZ), ROWS, D, FNUZ)
    return e4m3, tl.sum(tl.where(order == p, scales, 0), axis=1)


@triton.jit
def pow2(e):
    """``2 ** e`` as float32 for int32 ``e`` ≤ 0 (0 below 2 ** -126: a part that small of an fp32 sum is gone)."""
    return tl.where(e < -126, 0.0, ((e + 127) << 23).to(tl.float32, bitcast=True))
