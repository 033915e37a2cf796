"""How much the sparse layers' top-k selections overlap: the ``[L, L]`` overlap matrix.

Overlap of layers ``i`` and ``j``: per row, ``|T_i ∩ T_j| / n_r`` where ``T`` are the row's valid
indices and ``n_r`` is the largest valid count any layer has in that row (k for full rows, so this is
the paper's ``|T_i ∩ T_j| / k``, and a short row whose layers agree still scores 1); averaged over the
rows with ``n_r > 0``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from indexcache.tools.calibrate.errors import CalibrationError
from indexcache.tools.calibrate.indices import IndexArray, as_rows, check_shapes

# Rows are bitmapped over [0, max index]; this many table entries (int64) per batch keeps it in cache.
_TABLE_ENTRIES = 1 << 17
# When the largest index exceeds this many times L layers x k slots, each row's indices are renumbered densely
# first (_compact, a sort), so a row's table stays within that, whatever the index values. Below it the table
# is the faster of the two (the sort costs about what a table of 10-20 x L x k entries does).
_COMPACT_FACTOR = 16
# Rows whose bitsets are intersected together: L x (rows x union/64) words stays around a megabyte.
_BLOCK_ROWS = 8


def overlap_matrix(indices: Sequence[IndexArray], *, threads: int | None = None) -> np.ndarray:
    """Mean top-k overlap of every pair of layers: ``[L, L]`` float64, symmetric.

    ``indices[l]`` is layer ``l``'s ``[rows, k]`` integer array (numpy or torch; -1 = empty slot); every
    layer has the same shape and row ``r`` is the same query everywhere. ``out[i, j]`` averages
    ``|T_i ∩ T_j| / n_r`` over rows with ``n_r > 0`` (see the module docstring); the diagonal is 1 when
    every layer fills the same number of slots.

    Vectorized: each row's union of indices is ranked once, every layer becomes a bitset over that
    union, and a pair's intersection is a popcount of an AND. ``threads`` row blocks run at once
    (default: the CPUs this process may use). Memory grows with rows, layers and k, not with the index
    values: when the largest index exceeds ``16 * L * k``, each row's indices are renumbered densely first.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise CalibrationError(f"threads={threads!r}: must be an integer >= 1 (row blocks at once) or None (every CPU)")
    arrays = [as_rows(a, f"indices[{i}]") for i, a in enumerate(indices)]
    if not arrays:
        raise CalibrationError("indices: no layers")
    check_shapes(arrays, [f"indices[{i}]" for i in range(len(arrays))])
    low = min(int(a.min()) for a in arrays)
    if low < -1:
        raise CalibrationError(f"indices hold {low}; -1 marks an empty slot and no other negative value is valid")
    num, (rows, k) = len(arrays), arrays[0].shape
    span = max(int(a.max()) for a in arrays) + 2  # column 0 of each row's table takes the -1 slots
    compact = span > _COMPACT_FACTOR * num * k + 1
    if compact:  # a row holds at most num * k distinct indices: renumbered, they are 0 .. num * k - 1
        span = num * k + 1
    batch = max(1, min(_TABLE_ENTRIES // span, rows))
    block = max(_BLOCK_ROWS, batch)
    if not hasattr(np, "bitwise_count"):
        raise ImportError(f"overlap_matrix needs numpy >= 2.0 (np.bitwise_count); this is numpy {np.__version__}")
    workers = threads if threads is not None else usable_cpus()
    total = np.zeros((num, num))
    counted = 0
    with ThreadPoolExecutor(workers) as pool:
        jobs = [
            pool.submit(_block_counts, arrays, start, min(rows, start + block), span, batch, compact)
            for start in range(0, rows, block)
        ]
        for job in jobs:
            counts = job.result()  # [L, L, rows], upper triangle
            fill = counts[np.arange(num), np.arange(num)].max(axis=0)
            total += counts @ np.where(fill > 0, 1.0 / np.maximum(fill, 1), 0.0)
            counted += int(np.count_nonzero(fill))
    if counted == 0:
        raise CalibrationError("indices: every slot of every row is -1; nothing to compare")
    total = np.triu(total) + np.triu(total, 1).T
    return total / counted


def usable_cpus() -> int:
    """CPUs this process may run on (the default number of row blocks processed at once)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _block_counts(
    arrays: Sequence[np.ndarray], start: int, stop: int, span: int, batch: int, compact: bool
) -> np.ndarray:
    """Intersection sizes ``[L, L, stop - start]`` (uint32, upper triangle) of rows ``start:stop``; with
    ``compact``, each row's indices are renumbered densely first (:func:`_compact`)."""
    block = np.stack([array[start:stop] for array in arrays])  # [L, rows, k]
    if compact:
        block = _compact(block)
    num, k = len(arrays), block.shape[2]
    keys = np.empty((num, batch, k), np.int64)
    words, row_words = [], []
    offset = 0
    for first in range(0, stop - start, batch):
        count = min(batch, stop - start - first)
        bits, row_start = _bitsets(block[:, first : first + count], span, keys[:, :count])
        words.append(bits)
        row_words.append(row_start + offset)
        offset += bits.shape[1]
    bits = np.concatenate(words, axis=1)
    row_start = np.concatenate(row_words)
    counts = np.zeros((num, num, stop - start), np.uint32)
    both = np.empty_like(bits)
    ones = np.empty(bits.shape, np.uint8)
    for i in range(num):
        np.bitwise_and(bits[i], bits[i:], out=both[i:])
        np.bitwise_count(both[i:], out=ones[i:])
        counts[i, i:] = np.add.reduceat(ones[i:], row_start, axis=1, dtype=np.uint32)
    return counts


def _compact(block: np.ndarray) -> np.ndarray:
    """``block [L, rows, k]`` with each row's indices replaced by their rank among the row's distinct
    indices over all layers (0 .. at most L * k - 1); -1 stays -1. Intersections are unchanged."""
    num, count, k = block.shape
    flat = block.transpose(1, 0, 2).reshape(count, num * k)
    order = np.argsort(flat, axis=1)
    ordered = np.take_along_axis(flat, order, axis=1)
    first = np.empty(ordered.shape, bool)  # first of its value in the row, and not -1
    first[:, 0] = True
    np.not_equal(ordered[:, 1:], ordered[:, :-1], out=first[:, 1:])
    first &= ordered >= 0
    rank = np.cumsum(first, axis=1, dtype=np.int32 if num * k < 2**31 else np.int64)
    rank -= 1  # the -1 slots sort first and keep -1
    out = np.empty_like(rank)
    np.put_along_axis(out, order, rank, axis=1)
    return out.reshape(count, num, k).transpose(1, 0, 2)


def _bitsets(rows: np.ndarray, span: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, ``rows [L, count, k]`` as bitsets over each row's union of indices (``keys``: scratch).

    Returns ``bits [L, words]`` uint64 and ``row_start [count]``, the first word of each row. A row gets
    slot 0 (for its -1 entries, cleared) plus one slot per distinct index, rounded up to whole words.
    """
    num, count = rows.shape[:2]
    np.add(rows, (np.arange(count, dtype=np.int64) * span + 1)[:, None], out=keys)
    present = np.zeros(count * span, bool)
    present[keys] = True
    present[::span] = False
    rank = np.cumsum(present, dtype=np.int64).reshape(count, span)  # union members up to here
    before = rank[:, 0].copy()
    row_words = (rank[:, -1] - before + 64) // 64
    row_start = np.zeros(count, np.int64)
    np.cumsum(row_words[:-1], out=row_start[1:])
    width = int(row_words.sum()) * 64
    rank += (row_start * 64 - before)[:, None]  # index -> its bit within the chunk (slot 0 for -1)
    slots = rank.reshape(-1)[keys]
    slots += (np.arange(num, dtype=np.int64) * width)[:, None, None]
    flags = np.zeros((num, width), bool)
    flags.reshape(-1)[slots] = True
    flags[:, row_start * 64] = False
    return np.packbits(flags, axis=1, bitorder="little").view(np.uint64), row_start
