"""MXFP4 keys widened to e4m3fn for Hopper's fp8 matrix path, in Gluon, by byte permutes: the Hopper decode's
(docs/fp4.md, "The Hopper decode"; the prefill widens its keys once a call instead, "The prefill: keys widened once").

The same numbers as :mod:`indexcache.backends.triton.mxfp4` (its module docstring has the rule): a key whose block
scale bytes lie within ``SPREAD`` of each other is its values times ``2 ** (byte - R)`` in e4m3, exactly, with one
scale ``2 ** (R - 127)`` a key (``R = max(largest byte - 5, 1)``; NaN where a block's byte is 255). What differs is
how a word is widened: the eight magnitudes an e2m1 code can have, times the block's power of two, are the eight
bytes of two registers, so one ``prmt`` looks up four codes at once and two more put the four signs in (about 9
instructions for eight elements, against 22 for the shifts and adds of the portable widening). The output is in the
elements' own order (elements ``8j .. 8j + 3`` then ``8j + 4 .. 8j + 7`` of input word ``j``), so the queries are
not permuted.

The keys whose blocks lie further apart are taken by :func:`block_pass` ``D / 32`` times, each block in units of
its own scale, smallest scale first (the portable kernel's exact path: ``mxfp4.ranks``, ``mxfp4.pass_words``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from indexcache.backends.triton.sm90 import block_barrier, reinterpret

SPREAD = gl.constexpr(10)  # as mxfp4.SPREAD
TOP = gl.constexpr(5)  # as mxfp4.TOP
LIFT = gl.constexpr(0x2C)  # the e4m3fn byte of code 0's neighbour 0.5 is LIFT + 4: LIFT + 8d for values times 2 ** d

# A 64-key tile's value words [64, 16] (D = 128) in the math warps of the Hopper decode: a thread holds four words
# (one block of 32 elements) of two keys, the keys placed as the rows of a [64, N] matmul's accumulator (warp w rows
# 16w .. 16w + 15, a thread rows r and r + 8), so that a key's vectors (its scales, whether it takes one) are where its
# logits are.
WORDS_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16]))

# The widened tile [ROWS, D] fp8 in the matmul operand's shared layout (128-byte rows), seen as int32 words to store.
_WIDE_WORDS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))

# One input word (eight codes, element 2i in the low nibble of byte i) and its lift (LIFT + 8d) → two words of
# e4m3fn bytes: elements 0-3 ($0) and 4-7 ($1). The tables: codes 0-3 are 0, lift + 4, lift + 12, lift + 16, codes 4-7
# lift + 20 ... lift + 32 (0.5, 1, 1.5, 2, 3, 4, 6 times 2 ** d; a lift of at most 0x5C never carries into bit 7).
# The signs: bit 3 of nibble i is bit 7 of byte i of (w << 4) for even i and of w for odd i; prmt's sign mode (bit 3
# of a selector nibble) repeats the chosen byte's bit 7 over the output byte. The high half's selectors come down by
# mul.hi (an FMA-pipe IMAD.HI on sm90) rather than a shift (the ALU pipe, which the permutes and masks fill).
_WIDEN_ASM = gl.constexpr("""
{
.reg .b32 lo, hi, m, s, t;
mad.lo.u32 lo, $3, 0x01010100, 0x100C0400;
mad.lo.u32 hi, $3, 0x01010101, 0x201C1814;
and.b32 m, $2, 0x77777777;
prmt.b32 $0, lo, hi, m;
mul.hi.u32 m, m, 65536;
prmt.b32 $1, lo, hi, m;
shl.b32 s, $2, 4;
prmt.b32 t, $2, s, 0x9D8C;
and.b32 t, t, 0x80808080;
or.b32 $0, $0, t;
prmt.b32 t, $2, s, 0xBFAE;
and.b32 t, t, 0x80808080;
or.b32 $1, $1, t;
}
""")


@gluon.jit
def _widen_pair(words, lift):
    """:func:`widen`'s two halves: e4m3fn bytes of each word's elements 0-3 and 4-7, int32 ``[ROWS, W]`` each."""
    return gl.inline_asm_elementwise(_WIDEN_ASM, "=r,=r,r,r", [words, lift], dtype=(gl.int32, gl.int32),
                                     is_pure=True, pack=1)


@gluon.jit
def widen(words, lift):
    """MXFP4 value words (int32 ``[ROWS, W]``) and a lift a word (int32, the same shape and layout: ``LIFT + 8d``
    for values times ``2 ** d``) → e4m3fn bytes as int32 ``[ROWS, 2W]`` in the elements' order."""
    lo, hi = _widen_pair(words, lift)
    return gl.reshape(gl.join(lo, hi), [words.shape[0], 2 * words.shape[1]])


@gluon.jit
def _bytes(x):
    """int32 ``[..., 4]`` holding one word four times along its last dimension → e4m3fn ``[..., 4]``, element ``e`` the
    word's byte ``e`` (one register of four packed bytes: the move is the register itself)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def operand(words, lift, layout: gl.constexpr):
    """MXFP4 value words ``[ROWS, D / 8]`` in :data:`WORDS_LAYOUT` and their lifts (:func:`widen`'s) → the matmul's
    register operand: e4m3fn ``[ROWS, D]`` in ``layout`` (a ``DotOperandLayout`` of the accumulator's, ``k_width`` 4),
    the contraction in :func:`permuted` order: position ``4 (D / 32) m + 4 c + e`` holds element ``32 c + 4 m + e``.
    That is the order in which a thread of WORDS_LAYOUT holds its widened words (block ``c`` of its keys, words
    ``4c .. 4c + 3``, each two registers), so the widened registers are the operand's: no exchange between threads and
    no byte repacking (the queries are put in the same order once a request)."""
    ROWS: gl.constexpr = words.shape[0]
    C: gl.constexpr = words.shape[1] // 4
    lo, hi = _widen_pair(words, lift)
    x = gl.reshape(gl.join(lo, hi), [ROWS, C, 4, 2])  # [key, block c, word s, half p]
    x = gl.join(x, x)
    x = gl.reshape(gl.join(x, x), [ROWS, C, 4, 2, 4])  # each register four times along the bytes e
    a = gl.permute(_bytes(x), [0, 2, 3, 1, 4])  # [key, s, p, c, e]: position 16 (2 s + p) + 4 c + e at D = 128
    return gl.convert_layout(gl.reshape(a, [ROWS, 32 * C]), layout)


@gluon.jit
def permuted(k, D: gl.constexpr):
    """The element each contraction position ``k`` of :func:`operand`'s order holds (int32, ``k``'s shape)."""
    return 32 * ((k // 4) % (D // 32)) + 4 * (k // (D // 8)) + k % 4


@gluon.jit
def _byte(x, i):
    return (x >> (8 * i)) & 0xFF


@gluon.jit
def key_scales(sw):
    """A key's four block scale bytes as one int32 word each (``sw``, byte ``b`` block ``b``: D = 128) →
    ``(ref, scale, one)``: the key's reference byte (a block's lift is ``LIFT + 8 · (its byte - ref)``), its scale
    ``2 ** (ref - 127)`` (float32, NaN for a block byte 255), and whether the key takes them (its bytes within
    SPREAD, or a NaN one)."""
    b0 = _byte(sw, 0)
    b1 = _byte(sw, 1)
    b2 = _byte(sw, 2)
    b3 = _byte(sw, 3)
    top = gl.maximum(gl.maximum(b0, b1), gl.maximum(b2, b3))
    low = gl.minimum(gl.minimum(b0, b1), gl.minimum(b2, b3))
    ref = gl.maximum(top - TOP, 1)
    scale = gl.where(top == 255, float("nan"), (ref << 23).to(gl.float32, bitcast=True))
    return ref, scale, (top - low <= SPREAD) | (top == 255)


# A key record's lift steps: block b's lift is STEP0 + 8 · its step, its step its scale byte less the key's reference
# byte (key_scales) plus TOP, 0 to SPREAD for a key that takes one scale.
STEP0 = gl.constexpr(LIFT.value - 8 * TOP.value)


@gluon.jit
def key_records(sw):
    """A key's scale word (its four block scale bytes, int32 ``[ROWS]``) → the two words of its record, int32 each:
    ``(steps, scale)``, byte ``b`` of ``steps`` block ``b``'s lift step (:func:`record_lifts`), ``scale`` the bits of
    the key's float32 scale (:func:`key_scales`; NaN for a block byte 255), -1.0 for a key whose blocks lie too far
    apart for one scale. A key that takes one scale has every step in ``[0, SPREAD]``, so the bytes of ``steps`` are
    subtracted at once with no borrow; another key's may borrow, but its steps are never read (the exact path takes
    it, and a NaN block makes its logits NaN whatever its lifts)."""
    ref, scale, one = key_scales(sw)
    steps = sw - (ref - TOP) * 0x01010101
    return steps, gl.where(one, scale, -1.0).to(gl.int32, bitcast=True)


@gluon.jit
def record_lifts(steps, cols):
    """Each value word's lift (int32, ``[ROWS, W]``) from its key's record steps (``steps [ROWS]``,
    :func:`key_records`): ``LIFT + 8 · (its block's scale byte - ref)``, ``ref`` the key's (:func:`key_scales`)."""
    return STEP0 + 8 * ((steps[:, None] >> (8 * (cols[None, :] // 4))) & 0xFF)


@gluon.jit
def _rank(sw, i):
    """Block ``i``'s place among its key's four by scale byte, smallest first, ties by position (``[ROWS]``)."""
    bi = _byte(sw, i)
    r = gl.zeros_like(sw)
    for j in gl.static_range(4):
        if j != i:
            bj = _byte(sw, j)
            r += ((bj < bi) | ((bj == bi) & (j < i))).to(gl.int32)
    return r


@gluon.jit
def unit(sw, p):
    """The scale byte of each key's block of place ``p`` (:func:`_rank`; ``[ROWS]``)."""
    u = gl.zeros_like(sw)
    for i in gl.static_range(4):
        u += gl.where(_rank(sw, i) == p, _byte(sw, i), 0)
    return u


@gluon.jit
def _pass_words(words, sw, cols, p):
    """Pass ``p`` of the exact path's value words: each key's block of place ``p`` (:func:`_rank`), the others zero."""
    blk = cols[None, :] // 4
    place = gl.where(blk == 0, _rank(sw, 0)[:, None], gl.where(blk == 1, _rank(sw, 1)[:, None],
                     gl.where(blk == 2, _rank(sw, 2)[:, None], _rank(sw, 3)[:, None])))
    return gl.where(place == p, words, 0)


@gluon.jit
def block_pass(words, sw, cols, p):
    """Pass ``p`` of the exact path: e4m3fn words ``[ROWS, 2W]``, each key's block of place ``p`` (:func:`_rank`)
    in units of its scale (lift ``LIFT``: exact; :func:`unit` its scale byte), its other blocks zero."""
    return widen(_pass_words(words, sw, cols, p), gl.full(words.shape, LIFT, gl.int32, layout=words.type.layout))


@gluon.jit
def e8m0(b):
    """Scale bytes (int32) as float32: ``2 ** (b - 127)``, 255 NaN (0: 2^-127, a subnormal)."""
    x = (b << 23).to(gl.float32, bitcast=True)
    return gl.where(b == 255, float("nan"), gl.where(b == 0, 2.0 ** -127, x))


@gluon.jit
def pow2(e):
    """``2 ** e`` as float32 for int32 ``e`` ≤ 0 (0 below 2 ** -126: a part that small of an fp32 sum is gone)."""
    return gl.where(e < -126, 0.0, ((e + 127) << 23).to(gl.float32, bitcast=True))


@gluon.jit
def _store_operand(wide_smem, wide):
    """``wide`` (e4m3fn words ``[ROWS, D / 4]``) into ``wide_smem`` (fp8 ``[ROWS, D]``, a matmul's operand), fenced for
    the matmul and every warp of the warp group past the store."""
    reinterpret(wide_smem, gl.int32, wide.shape, _WIDE_WORDS).store(wide)
    fence_async_shared()
    block_barrier()


@gluon.jit
def stage(wide_smem, words, word_lifts):
    """A tile's value words ``[ROWS, D / 8]`` widened into ``wide_smem`` with one scale a key (``word_lifts`` each
    word's lift: :func:`record_lifts`)."""
    _store_operand(wide_smem, widen(words, word_lifts))


@gluon.jit
def exact_registers(q_tile, words, sw, cols, sw_m, acc, layout: gl.constexpr):
    """:func:`exact` with each pass's keys as the matmul's register operand (:func:`operand`, ``layout`` its
    layout; ``q_tile`` in :func:`permuted` order): no shared memory, no barrier."""
    lift = gl.full(words.shape, LIFT, gl.int32, layout=words.type.layout)
    u = unit(sw_m, 0)
    for p in range(words.shape[1] // 4):  # a loop, not unrolled
        to = unit(sw_m, p)
        acc = warpgroup_mma(operand(_pass_words(words, sw, cols, p), lift, layout), q_tile,
                            acc * pow2(u - to)[:, None])
        u = to
    return acc, u


@gluon.jit
def exact(wide_smem, q_tile, words, sw, cols, sw_m, acc):
    """The exact path's matmul of a tile (``q_tile`` the matmul's ``[D, N]`` operand, ``acc`` zeros in its
    accumulator layout): D / 32 matmuls into one accumulator, each taking every key's next block by scale
    (:func:`block_pass`) in units of that block's scale, the sum so far brought to those units first: ``(acc, last)``,
    the sum in units of the last block's scale byte ``last`` (:func:`e8m0` of it the factor to real units). ``sw``
    the keys' scale words in the rows of ``words``, ``sw_m`` in the accumulator's."""
    u = unit(sw_m, 0)
    for p in range(words.shape[1] // 4):  # a loop, not unrolled
        block_barrier()  # every warp of the group is past the matmul reading the last pass
        _store_operand(wide_smem, block_pass(words, sw, cols, p))
        to = unit(sw_m, p)
        acc = warpgroup_mma(wide_smem, q_tile, acc * pow2(u - to)[:, None])
        u = to
    return acc, u
