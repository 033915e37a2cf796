"""The logits of one key tile, the part the Triton logits kernels share (``logits.py``, ``prefill_fp4.py``): the dot of
the keys with the queries in the precision the target multiplies in, the ReLU and weighted head sum after it, the keys'
scales; and for MXFP4 keys (``mxfp4.py``'s modes) the widening with one scale a key and its exact path, or the
target's block-scaled instruction.

``out[key, token] = scale[key] · Σ_h w[token, h] · relu(q[token, h] · k[key])``, ``[keys, tokens]`` with the keys on M
(``KEYS_ON_M``), else ``[tokens, keys]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from indexcache.backends.triton import mxfp4


@triton.jit
def e4m3_bytes_to_fp16(x, BIAS: tl.constexpr):
    """e4m3 bytes (uint8; exponent bias 7: e4m3fn, 8: e4m3fnuz) as fp16, exactly, without fp8 instructions: the
    7 magnitude bits go to fp16's exponent and mantissa fields (2^(e - 15) · (1 + m/8), or m · 2^-17 when
    e = 0), the sign to bit 15, then one exact multiply by 2^(15 - BIAS) (every e4m3 value is an fp16 normal).
    The NaN bytes (0x7F / 0xFF in e4m3fn, 0x80 in e4m3fnuz) become NaN."""
    SCALE: tl.constexpr = 2.0 ** (15 - BIAS)
    b = x.to(tl.uint16)
    h = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True)
    if BIAS == 7:
        nan = (b & 0x7F) == 0x7F
    else:
        nan = b == 0x80
    return tl.where(nan, float("nan"), h * SCALE)


@triton.jit
def operand(x, WIDEN: tl.constexpr):
    """The dot operand in the precision the dot runs in (0: as is, 1: e4m3fn bytes decoded to fp16, 2: fp32,
    3: e4m3fnuz bytes decoded to fp16)."""
    if WIDEN == 1:
        x = e4m3_bytes_to_fp16(x, 7)
    elif WIDEN == 3:
        x = e4m3_bytes_to_fp16(x, 8)
    elif WIDEN == 2:
        x = x.to(tl.float32)
    return x


@triton.jit
def dot(k, q, KEYS_ON_M: tl.constexpr, WIDEN: tl.constexpr, acc=None):
    """``k [ROWS, D] · q [GROUPS · H, D]ᵀ`` in fp32: ``[ROWS, GROUPS · H]`` when ``KEYS_ON_M``, else transposed;
    added to ``acc`` when one is given."""
    precision: tl.constexpr = "ieee" if WIDEN == 2 else None
    if KEYS_ON_M:
        acc = tl.dot(operand(k, WIDEN), tl.trans(operand(q, WIDEN)), acc, input_precision=precision)
    else:
        acc = tl.dot(operand(q, WIDEN), tl.trans(operand(k, WIDEN)), acc, input_precision=precision)
    return acc


@triton.jit
def relu_head_sum(acc, w, ROWS: tl.constexpr, GROUPS: tl.constexpr, H: tl.constexpr, KEYS_ON_M: tl.constexpr):
    """Σ_h w · relu(acc) of a :func:`dot` result, ``w [GROUPS, H]``: fp32 ``[ROWS, GROUPS]`` when ``KEYS_ON_M``
    else ``[GROUPS, ROWS]``. The ReLU keeps NaN (the documented non-finite rule: a NaN product makes its logit NaN
    on every backend)."""
    if KEYS_ON_M:
        acc = tl.reshape(acc, (ROWS, GROUPS, H))
        s = tl.sum(tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :, :], axis=2)
    else:
        acc = tl.reshape(acc, (GROUPS, H, ROWS))
        s = tl.sum(tl.maximum(acc, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[:, :, None], axis=1)
    return s


@triton.jit
def tile_head_sum(k, q, w, ROWS: tl.constexpr, GROUPS: tl.constexpr, H: tl.constexpr, KEYS_ON_M: tl.constexpr,
              WIDEN: tl.constexpr):
    """Σ_h w · relu(q · k) for a key tile ``k [ROWS, D]`` and ``q [GROUPS · H, D]``, ``w [GROUPS, H]``
    (:func:`dot`, then :func:`relu_head_sum`)."""
    return relu_head_sum(dot(k, q, KEYS_ON_M, WIDEN), w, ROWS, GROUPS, H, KEYS_ON_M)


@triton.jit
def unpack_words(words, dtype: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr):
    """int32 ``[ROWS, D // 4]`` → its bytes as ``dtype`` ``[ROWS, D]`` (little-endian: byte 0 first)."""
    b0 = (words & 0xFF).to(tl.uint8)
    b1 = ((words >> 8) & 0xFF).to(tl.uint8)
    b2 = ((words >> 16) & 0xFF).to(tl.uint8)
    b3 = ((words >> 24) & 0xFF).to(tl.uint8)
    x = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [ROWS, D // 4, 2, 2]; [..., i, j] is byte 2 i + j
    return tl.reshape(x, (ROWS, D)).to(dtype, bitcast=True)


@triton.jit
def scale_keys(acc, sc, KEYS_ON_M: tl.constexpr):
    """``acc`` (``[keys, …]`` when ``KEYS_ON_M``, else ``[…, keys]``) times the keys' ``sc [keys]``."""
    if KEYS_ON_M:
        acc = acc * sc[:, None]
    else:
        acc = acc * sc[None, :]
    return acc


@triton.jit
def scale_tokens(acc, sc, KEYS_ON_M: tl.constexpr):
    """``acc`` (``[keys, tokens]`` when ``KEYS_ON_M``, else ``[tokens, keys]``; or query rows for tokens) times the
    tokens' ``sc [tokens]``."""
    if KEYS_ON_M:
        acc = acc * sc[None, :]
    else:
        acc = acc * sc[:, None]
    return acc


@triton.jit
def fp4_queries(words, scales, ROWS: tl.constexpr, D: tl.constexpr, MXFP4: tl.constexpr, WIDEN: tl.constexpr):
    """MXFP4 queries (uint32 words ``[ROWS, D // 8]`` of e2m1 values, int32 ``scales [ROWS, D // 32]`` their scale
    bytes) as the dot operand the keys' mode (``MXFP4``) multiplies them in, once a request: e2m1 bytes
    ``[ROWS, D // 2]`` for a block-scaled instruction taking e2m1 (``mxfp4.SCALED_E2M1``), else widened to e4m3 at
    their own block scale ``[ROWS, D]`` (exact, in ``mxfp4.permute``'s order, the widened keys' own: e4m3fn, or
    e4m3fnuz for ``mxfp4.WIDEN_FNUZ``; as bytes where the dot decodes them, ``WIDEN`` 1 or 3). For a block-scaled
    instruction the blocks more than 2^127 below their row's largest are zeroed (``mxfp4.drop_below``: the scales
    enter :func:`scaled_dot` relative to the row's largest)."""
    if MXFP4 >= mxfp4.SCALED_E2M1:
        words = mxfp4.drop_below(words, mxfp4.from_top(scales), ROWS, D)
    if MXFP4 == mxfp4.SCALED_E2M1:
        x = unpack_words(words, tl.uint8, ROWS, D // 2)
    else:
        FNUZ: tl.constexpr = MXFP4 == mxfp4.WIDEN_FNUZ
        ELEMENT: tl.constexpr = tl.uint8 if WIDEN == 1 or WIDEN == 3 else tl.float8e4b8 if FNUZ else tl.float8e4nv
        x = unpack_words(mxfp4.widen(words, 0x2C + 8 * FNUZ, ROWS, D, FNUZ), ELEMENT, ROWS, D)
    return x


@triton.jit
def scaled_dot(words, scales, q, ROWS: tl.constexpr, D: tl.constexpr, MXFP4: tl.constexpr, KEYS_ON_M: tl.constexpr,
               q_scales=0, Q_FP4: tl.constexpr = 0):
    """A tile's MXFP4 keys (``words`` uint32 ``[ROWS, D // 8]``, ``scales`` int32 e8m0 bytes ``[ROWS, D // 32]``) times
    e4m3fn queries ``q [COLS, D]`` on the target's block-scaled instruction, which applies each block's scale
    (``MXFP4`` ``mxfp4.SCALED_E2M1``: the keys as e2m1, ``q`` in the elements' order; ``mxfp4.SCALED_E4M3``: widened
    to e4m3fn, exact, ``q`` in ``mxfp4.permute``'s order): fp32 ``[ROWS, COLS]`` when ``KEYS_ON_M``, else
    ``[COLS, ROWS]``, in units of each key's largest block scale (``mxfp4.from_top``: the instruction takes the
    blocks' scales relative to it, so no operand it scales exceeds 6 · 2^0 whatever it does with a scale; a block
    more than 2^127 below is lost, ``mxfp4.drop_below``; the caller applies the largest, 255 NaN). ``Q_FP4``: MXFP4
    queries, ``q`` as :func:`fp4_queries` gives them and ``q_scales`` their int32 e8m0 bytes ``[COLS, D // 32]``,
    relative to each query's largest too (in units of both largest)."""
    rel = mxfp4.from_top(scales)
    words = mxfp4.drop_below(words, rel, ROWS, D)
    if MXFP4 == mxfp4.SCALED_E2M1:
        k = unpack_words(words, tl.uint8, ROWS, D // 2)
    else:
        k = unpack_words(mxfp4.widen(words, 0x2C, ROWS, D, False), tl.float8e4nv, ROWS, D)
    fmt: tl.constexpr = "e2m1" if MXFP4 == mxfp4.SCALED_E2M1 else "e4m3"
    k_scales = tl.maximum(rel, 0).to(tl.uint8)
    if Q_FP4:
        q_fmt: tl.constexpr = fmt
        q_units = tl.maximum(mxfp4.from_top(q_scales), 0).to(tl.uint8)  # the blocks below 0 zeroed by fp4_queries
    else:
        q_fmt: tl.constexpr = "e4m3"
        q_units = tl.full((q.shape[0], D // 32), 127, tl.uint8)  # the queries' block scales: 2 ** 0
    if KEYS_ON_M:
        acc = tl.dot_scaled(k, k_scales, fmt, tl.trans(q), q_units, q_fmt)
    else:
        acc = tl.dot_scaled(q, q_units, q_fmt, tl.trans(k), k_scales, fmt)
    return acc


@triton.jit
def blockwise_dot(words, scales, q, q_scales, ROWS: tl.constexpr, D: tl.constexpr, KEYS_ON_M: tl.constexpr,
                  WIDEN: tl.constexpr, FNUZ: tl.constexpr):
    """MXFP4 keys (``words`` uint32 ``[ROWS, D // 8]``, ``scales`` int32 ``[ROWS, D // 32]``) times MXFP4 queries
    (``q`` widened by :func:`fp4_queries` ``[COLS, D]``, ``q_scales`` int32 ``[COLS, D // 32]``) without a
    block-scaled instruction: D / 32 dots, the j-th taking block j of every key widened to e4m3 at its own scale (the
    other blocks zero: the queries' block j alone, an exact sum), each added in units of the key's and the query's
    largest block scale (a power of two ≤ 1 each, 0 below 2^-126, applied one after the other: a block more than 2^126
    below its row's largest is lost, and a product more than about 2^149 below the two largest together), then the two
    largest scales together (:func:`scale_pairs`; docs/fp4.md,
    "Queries": the limits of fp32 this leaves). fp32 ``[ROWS, COLS]`` when ``KEYS_ON_M``, else ``[COLS, ROWS]``."""
    COLS: tl.constexpr = q.shape[0]
    LIFT: tl.constexpr = 0x2C + 8 * FNUZ  # 2 ** 0: the values as they are
    block = tl.arange(0, D // 8) // 4  # a word's block of 32 elements
    at = tl.arange(0, D // 32)
    k_top = tl.max(scales, axis=1)
    q_top = tl.max(q_scales, axis=1)
    if KEYS_ON_M:
        acc = tl.zeros((ROWS, COLS), tl.float32)
    else:
        acc = tl.zeros((COLS, ROWS), tl.float32)
    for j in range(D // 32):  # a loop, not unrolled: one block's keys live at a time
        k = unpack_words(mxfp4.widen(tl.where(block[None, :] == j, words, 0), LIFT, ROWS, D, FNUZ), q.dtype, ROWS, D)
        part = scale_keys(dot(k, q, KEYS_ON_M, WIDEN),
                          mxfp4.pow2(tl.sum(tl.where(at[None, :] == j, scales, 0), axis=1) - k_top), KEYS_ON_M)
        acc += scale_tokens(part, mxfp4.pow2(tl.sum(tl.where(at[None, :] == j, q_scales, 0), axis=1) - q_top),
                            KEYS_ON_M)
    return scale_pairs(acc, k_top, q_top, KEYS_ON_M)


@triton.jit
def scale_pairs(acc, k_bytes, q_bytes, KEYS_ON_M: tl.constexpr):
    """``acc`` (``[keys, tokens]`` when ``KEYS_ON_M``, else ``[tokens, keys]``) times ``2 ** (k_bytes - 127)`` of its
    key and ``2 ** (q_bytes - 127)`` of its query row (int32 e8m0 bytes, 255 NaN): the two exponents added as integers
    and applied as two powers of two of the same sign (each 2^-127 .. 2^127), so that a product inside float32 stays
    inside it on the way (the two scales one after the other overflowed where a key near 2^127 met a query far below
    1, or the reverse). A byte 255 gives NaN here only beside 254 or 255: the callers make such logits NaN."""
    if KEYS_ON_M:
        e = k_bytes[:, None] + q_bytes[None, :] - 254
    else:
        e = q_bytes[:, None] + k_bytes[None, :] - 254
    half = e >> 1
    return acc * mxfp4.e8m0(half + 127) * mxfp4.e8m0(e - half + 127)


@triton.jit
def head_units(w, q_scales, GROUPS: tl.constexpr, H: tl.constexpr):
    """``(w [GROUPS, H] times 2 ** (top - T) of each head, T int32 [GROUPS])``: ``top`` a (token, head)'s largest
    MXFP4 query block scale byte (of ``q_scales`` int32 ``[GROUPS · H, D // 32]``) and ``T`` its token's largest,
    so that a head sum in units of each query's largest block scale (:func:`scaled_dot`) is one in units of its
    token's ``2 ** (T - 127)``: a power of two ≤ 1 a weight, 0 below 2^-126 (a head whose queries lie that far
    below its token's largest head's is lost)."""
    top = tl.reshape(tl.max(q_scales, axis=1), (GROUPS, H))
    tops = tl.max(top, axis=1)
    return w * mxfp4.pow2(top - tops[:, None]), tops


@triton.jit
def token_nan(q_scales, GROUPS: tl.constexpr, H: tl.constexpr):
    """``[GROUPS]`` float32: NaN for a token one of whose heads' MXFP4 queries has a NaN block scale (byte 255: its
    logits are NaN), else 1."""
    bad = tl.max(tl.reshape(tl.max(q_scales, axis=1), (GROUPS, H)), axis=1) == 255
    return tl.where(bad, float("nan"), 1.0)


@triton.jit
def fp4_head_sum(words, scales, ok, q, w, ROWS: tl.constexpr, GROUPS: tl.constexpr, H: tl.constexpr,
                  D: tl.constexpr, KEYS_ON_M: tl.constexpr, WIDEN: tl.constexpr, MXFP4: tl.constexpr,
                  q_scales=0, Q_FP4: tl.constexpr = 0):
    """:func:`tile_head_sum` of an MXFP4 tile (:func:`_fp4_gather`), its scales applied (``MXFP4``: how, ``mxfp4``'s
    modes): on a block-scaled instruction (:func:`scaled_dot`) one dot, each key's largest block scale after the
    heads (NaN for a key with a NaN block, byte 255: the instruction never sees that byte); else widened
    (:func:`widened_head_sum`). ``Q_FP4``: MXFP4 queries (``q`` as :func:`fp4_queries` gives them, ``q_scales`` their
    int32 scale bytes), NaN for a token with a NaN query block too: on a block-scaled instruction (:func:`scaled_dot`)
    each query's largest block scale in its weight, relative to its token's largest (:func:`head_units`), then the
    key's and the token's largest together after the heads (:func:`scale_pairs`, on ``[ROWS, GROUPS]``: one more
    multiply a logit, none an accumulator element, whose per-column factors spilled on sm100 and sm120); or block by
    block (:func:`blockwise_dot`)."""
    if Q_FP4:
        if MXFP4 >= mxfp4.SCALED_E2M1:
            w, tops = head_units(w, q_scales, GROUPS, H)
            s = relu_head_sum(scaled_dot(words, scales, q, ROWS, D, MXFP4, KEYS_ON_M, q_scales, Q_FP4), w, ROWS,
                              GROUPS, H, KEYS_ON_M)
            s = scale_pairs(s, tl.max(scales, axis=1), tops, KEYS_ON_M)
        else:
            s = relu_head_sum(blockwise_dot(words, scales, q, q_scales, ROWS, D, KEYS_ON_M, WIDEN,
                                            MXFP4 == mxfp4.WIDEN_FNUZ), w, ROWS, GROUPS, H, KEYS_ON_M)
        s = scale_keys(s, tl.where(tl.max(scales, axis=1) == 255, float("nan"), 1.0), KEYS_ON_M)
        s = scale_tokens(s, token_nan(q_scales, GROUPS, H), KEYS_ON_M)
    elif MXFP4 >= mxfp4.SCALED_E2M1:
        s = relu_head_sum(scaled_dot(words, scales, q, ROWS, D, MXFP4, KEYS_ON_M), w, ROWS, GROUPS, H, KEYS_ON_M)
        s = scale_keys(s, mxfp4.e8m0(tl.max(scales, axis=1)), KEYS_ON_M)
    else:
        s = widened_head_sum(words, scales, ok, q, w, ROWS, GROUPS, H, D, KEYS_ON_M, WIDEN,
                                  MXFP4 == mxfp4.WIDEN_FNUZ)
    return s


@triton.jit
def widened_head_sum(words, scales, ok, q, w, ROWS: tl.constexpr, GROUPS: tl.constexpr, H: tl.constexpr,
                     D: tl.constexpr, KEYS_ON_M: tl.constexpr, WIDEN: tl.constexpr, FNUZ: tl.constexpr):
    """:func:`fp4_head_sum` widened to e4m3 (e4m3fnuz with ``FNUZ``): where every key the tile reads (``ok``) has its
    block scales within ``mxfp4.SPREAD`` (or a NaN one), its values with one scale a key, one dot over D; else the
    exact path (:func:`exact_head_sum`)."""
    lift, scale, one = mxfp4.key_lifts(scales, ROWS, D, FNUZ)
    k = unpack_words(mxfp4.widen(words, lift, ROWS, D, FNUZ), q.dtype, ROWS, D)
    s = scale_keys(tile_head_sum(k, q, w, ROWS, GROUPS, H, KEYS_ON_M, WIDEN), scale, KEYS_ON_M)
    # The one-scale dot above is the loop's own (not under a branch: the compiler pipelines the tile's loads for it);
    # a tile with a key whose blocks are too far apart takes it again, exactly.
    if tl.max((ok & ~one).to(tl.int32), axis=0) != 0:
        s = exact_head_sum(words, scales, q, w, ROWS, GROUPS, H, D, KEYS_ON_M, WIDEN, FNUZ)
    return s


@triton.jit
def exact_head_sum(words, scales, q, w, ROWS: tl.constexpr, GROUPS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                   KEYS_ON_M: tl.constexpr, WIDEN: tl.constexpr, FNUZ: tl.constexpr):
    """:func:`fp4_head_sum` of MXFP4 keys whose block scales may lie any distance apart, exactly: D / 32 dots into one
    accumulator, each taking every key's next block by scale (the others zero) in units of that block's scale, the sum
    so far brought to those units first (a power of two ≤ 1), then the last unit's scale and the heads."""
    order = mxfp4.ranks(scales, ROWS, D)
    block, unit = mxfp4.pass_words(words, scales, order, 0, ROWS, D, FNUZ)
    acc = dot(unpack_words(block, q.dtype, ROWS, D), q, KEYS_ON_M, WIDEN)
    for p in range(1, D // 32):  # a loop, not unrolled: one pass live at a time
        block, to = mxfp4.pass_words(words, scales, order, p, ROWS, D, FNUZ)
        acc = dot(unpack_words(block, q.dtype, ROWS, D), q, KEYS_ON_M, WIDEN,
                  scale_keys(acc, mxfp4.pow2(unit - to), KEYS_ON_M))
        unit = to
    acc = scale_keys(acc, mxfp4.e8m0(unit), KEYS_ON_M)
    return relu_head_sum(acc, w, ROWS, GROUPS, H, KEYS_ON_M)
