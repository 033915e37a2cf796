"""What the top-k kernels (Triton and Gluon) read of a row and how they write its slots: the row's window, its
batch's page-table row, and a write of window positions (translated to physical slots when asked)."""

from __future__ import annotations

import triton
import triton.language as tl

from indexcache.backends.triton.translate import physical


@triton.jit
def window(lengths_ptr, starts_ptr, r, cols, len_s0, st_s0, HAS_STARTS: tl.constexpr):
    """``(start, clipped length, raw length)`` of row ``r``: the window clipped to the columns."""
    raw_len = tl.load(lengths_ptr + r * len_s0)
    if HAS_STARTS:
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + r * st_s0), 0), cols)
    else:
        start = 0
    return start, tl.minimum(tl.maximum(raw_len, 0), cols - start), raw_len


@triton.jit
def row_batch(r2b_ptr, r, r2b_s0, table_ptr, tab_s0, batches, HAS_R2B: tl.constexpr):
    """``(batch ok, page-table row pointer)`` of row ``r``."""
    if HAS_R2B:
        b = tl.load(r2b_ptr + r * r2b_s0)
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
    tl.store(out_row + pos * o_s1, val, mask=m)
    if HAS_RAW:
        tl.store(raw_row + pos * w_s1, raw, mask=m)
