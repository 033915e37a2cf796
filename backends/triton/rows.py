"""What the top-k kernels (Triton and Gluon) read of a row and how they write its slots: the row's window, its
scores and their order keys (and the bits two keys leave unsettled), its batch's page-table row, and a write of
window positions (translated to physical slots when asked)."""

from __future__ import annotations

import triton
import triton.language as tl

from indexcache.backends.triton.translate import physical

# Order keys (order_key): INT_MIN marks NaN and -inf, every valid key lies at or above KEY_MIN_VALID.
INT_MIN = tl.constexpr(-2147483648)
INT_MAX = tl.constexpr(2147483647)
KEY_MIN_VALID = tl.constexpr(-2139095040)  # the key of -FLT_MAX (0x80800000)
NEG_INF_BITS = tl.constexpr(-8388608)  # 0xFF800000


@triton.jit
def window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS: tl.constexpr):
    """``(start, clipped length, raw length)`` of row ``r``: the window clipped to the columns."""
    raw_len = tl.load(lengths_ptr + tl.cast(r, tl.int64) * len_s0)
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + tl.cast(r, tl.int64) * st_s0), 0), cols)
    else:
        start = 0
    return start, tl.minimum(tl.maximum(raw_len, 0), cols - start), raw_len


@triton.jit
def sample_positions(i, start, length, SAMPLES: tl.constexpr):
    """Window positions of the sample entries ``i`` (``0 <= i < SAMPLES``) of a window ``[start, start + length)``
    (``length > 0``): one in each of ``SAMPLES`` equal segments, at an offset within it drawn from a hash of ``i``.
    Evenly spaced entries would all sit at the same few offsets of data that repeats with a power-of-two period (a
    cache of 64-token pages read twice a page), and a threshold from such a sample can miss the row's k-th best."""
    spread = (((i * 1540483477) >> 16) & 0xFFFF).to(tl.float32) * (1.0 / 65536)  # in [0, 1), int32 wrapping
    # In float32 (few registers): exact segments up to 2^24 columns, evenly spread past that.
    at = ((i.to(tl.float32) + spread) * (length.to(tl.float32) / SAMPLES)).to(tl.int32)
    return start + tl.minimum(at, length - 1)


@triton.jit
def row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B: tl.constexpr):
    """``(batch ok, page-table row pointer)`` of row ``r``."""
    if HAS_R2B:
        b = tl.load(r2b_ptr + tl.cast(r, tl.int64) * r2b_s0)
    else:
        b = r
    return (b >= 0) & (b < batches), table_ptr + tl.cast(b, tl.int64) * tab_s0


@triton.jit
def emit(out_row, o_s1, raw_row, w_s1, pos, raw, m, seq, b_ok, tab_row, tab_s1, pages, page_size,
          TRANSLATE: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr):
    """Write window positions ``raw`` at slots ``pos`` of the row: physical slots to ``out`` when
    translating (raw ones to ``out_raw`` if given), else the raw positions."""
    if TRANSLATE:
        # The batch guard folds into the length (a scalar bool & tensor mask breaks the interpreter).
        val = physical(raw, m, tl.where(b_ok, seq, 0), tab_row, tab_s1, pages, page_size, SHIFT)
    else:
        val = raw
    tl.store(out_row + pos.to(tl.int64) * o_s1, val, mask=m)
    if HAS_RAW:
        tl.store(raw_row + pos.to(tl.int64) * w_s1, raw, mask=m)


@triton.jit
def load(row_ptr, s1, col, m, CONTIG: tl.constexpr):
    """Raw scores at columns ``col`` (-inf where ``m`` is false)."""
    if CONTIG:
        x = tl.load(row_ptr + col, mask=m, other=float("-inf"))
    else:
        x = tl.load(row_ptr + col.to(tl.int64) * s1, mask=m, other=float("-inf"))
    return x


@triton.jit
def score_bits(x):
    """fp32 bits of raw scores as int32 (bf16 by its bits: exact for subnormals, which the interpreter's conversion
    is not)."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    return bits


@triton.jit
def order_key(bits):
    """Exact int32 order keys of fp32 bits (a signed int32 order): negatives' magnitude bits flipped, -0.0 as +0.0,
    INT_MIN for NaN and -inf. Integer tests only, so a target that flushes subnormals in float compares still orders
    them exactly."""
    canon = tl.where(bits == INT_MIN, 0, bits)
    key = canon ^ ((canon >> 31) & 0x7FFFFFFF)
    return tl.where(((bits & 0x7FFFFFFF) > 0x7F800000) | (bits == NEG_INF_BITS), INT_MIN, key)


@triton.jit
def below_common_prefix(kmin, kmax):
    """The bits of two keys below their common prefix (the highest differing bit and every bit under it): the bits
    a radix select over keys between them still has to settle."""
    diff = kmin ^ kmax
    low = diff | (diff >> 1)
    low = low | (low >> 2)
    low = low | (low >> 4)
    low = low | (low >> 8)
    return low | (low >> 16)
