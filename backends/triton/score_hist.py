"""The rows' score histograms of the fused producer step (``paged_topk_translate`` on Hopper): the decode logits
kernel counts each row's logits as it stores them, and the block top-k reads from the counts where the row's k-th
best lies instead of sampling the row.

A row's histogram is ``ROW_WORDS`` int32 in global memory: ``COARSE`` coarse bins (the top 11 bits of the order
key, ``rows.order_key``, offset by ``COARSE_HALF`` so that bin ``c`` holds the keys ``k`` with ``k >> 21 == c -
COARSE_HALF``), then ``FINE`` fine bins, one per value of the top 16 bits of the keys ``>= 0`` (the bf16 values of
the positive floats: ``SUB`` fine bins under each coarse bin from ``COARSE_HALF`` on). NaN and -inf are not counted.
Given the coarse bin holding the k-th best and the fine bins under it, the k-th best's fine bin, the entries above
it and in it are known before the row is read.

The histograms are kept zero between calls (:func:`histograms` allocates them zeroed once a device and size): the
top-k clears each row it read (the coarse bins, and the fine bins under every non-empty coarse bin). The counts only
steer the top-k; its own count of what it kept decides what it may do, so stale counts cost time, never a wrong
result.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from indexcache.backends.triton.rows import INT_MIN, order_key
from indexcache.backends.triton.support import next_power_of_2

COARSE = gl.constexpr(2048)
COARSE_HALF = gl.constexpr(1024)
SUB = gl.constexpr(32)  # fine bins a coarse bin: 5 more bits of the key
FINE = gl.constexpr(32768)
ROW_WORDS = COARSE.value + FINE.value


@gluon.jit
def count(hist_row, logits, m, LEVELS: gl.constexpr = 3):
    """Count the logits ``logits`` (float32, any layout) where ``m`` into the row's histogram ``hist_row``: one
    relaxed atomic add into the coarse bin of each finite one and, for those >= 0, one into its fine bin."""
    key = order_key(logits.to(gl.int32, bitcast=True))
    m = m & (key != INT_MIN)
    one = gl.full_like(key, 1)
    if LEVELS & 1:
        gl.atomic_add(hist_row + ((key >> 21) + COARSE_HALF), one, mask=m, sem="relaxed")
    if LEVELS & 2:
        gl.atomic_add(hist_row + (COARSE + (key >> 16)), one, mask=m & (key >= 0), sem="relaxed")


@gluon.jit
def locate(hist_row, k, COARSE_L: gl.constexpr, SUB_L: gl.constexpr):
    """Where the row's k-th best lies, from its histogram: ``(coarse, edge, above, inside)``, the coarse bins as
    read (``COARSE_L``), the lower edge (an order key) of the fine bin holding the k-th best, and the counted entries
    above that bin and in it. ``edge`` is ``INT_MIN`` where no fine bin holds it (fewer than ``k`` counted, or the
    k-th best below 0)."""
    c = gl.arange(0, COARSE, layout=COARSE_L)
    coarse = gl.load(hist_row + c, cache_modifier=".cg")
    at_or_above = gl.associative_scan(coarse, 0, _add, reverse=True)
    p = gl.sum((at_or_above >= k).to(gl.int32), 0) - 1
    above = gl.sum(gl.where(c > p, coarse, 0), 0)
    s = gl.arange(0, SUB, layout=SUB_L)
    fine_ok = p >= COARSE_HALF
    fine = gl.load(hist_row + COARSE + (p - COARSE_HALF) * SUB + s, mask=fine_ok & (s >= 0), other=0,
                   cache_modifier=".cg")
    fine_above = gl.associative_scan(fine, 0, _add, reverse=True)
    f = gl.sum((above + fine_above >= k).to(gl.int32), 0) - 1
    above += gl.sum(gl.where(s > f, fine, 0), 0)
    inside = gl.sum(gl.where(s == f, fine, 0), 0)
    edge = gl.where(fine_ok & (f >= 0), ((p - COARSE_HALF) * SUB + f) << 16, INT_MIN)
    return coarse, edge, above, inside


@gluon.jit
def clear(hist_row, coarse, COARSE_L: gl.constexpr):
    """Zero the row's histogram, whose coarse bins ``coarse`` (``COARSE_L``) the caller read and every thread is
    done with: the coarse bins, and the fine bins under each non-empty coarse bin from ``COARSE_HALF`` on."""
    c = gl.arange(0, COARSE, layout=COARSE_L)
    zero = gl.zeros_like(coarse)
    gl.store(hist_row + c, zero)
    under = (coarse != 0) & (c >= COARSE_HALF)
    fine_row = hist_row + COARSE + (c - COARSE_HALF) * SUB
    for s in gl.static_range(SUB):
        gl.store(fine_row + s, zero, mask=under)


@gluon.jit
def _add(a, b):
    return a + b


_HISTOGRAMS: dict[tuple[torch.device, int], torch.Tensor] = {}


def histograms(device: torch.device, rows: int) -> torch.Tensor:
    """Zeroed histograms for at least ``rows`` rows, ``[rows', ROW_WORDS]`` int32, one buffer per (device,
    power-of-two bucket), kept for the life of the process (graphs captured with it stay valid) and kept zero by
    the top-k that reads them."""
    size = next_power_of_2(max(rows, 1))
    key = (device, size)
    if key not in _HISTOGRAMS:
        _HISTOGRAMS[key] = torch.zeros((size, ROW_WORDS), dtype=torch.int32, device=device)
    return _HISTOGRAMS[key]
