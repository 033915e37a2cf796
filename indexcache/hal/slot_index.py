"""The slot index of a HiSparse state (``indexcache.hisparse_plan``'s ``slot_index``; docs/hisparse.md, "The slot
index"): a hint the Triton plan keeps beside the state, no rule of the plan (:mod:`indexcache.hal.hisparse`).

A request's row: ``H`` check words, one a slot, then an entry a token a slot can hold (``max(L, H)``) naming the slot
that holds it. Slot ``s`` holding token ``t`` (-1 none) has the check word ``t XOR ((s + 1) * CHECK_MIX mod 2**31)``.
A row whose live slots all match their words is taken as the state the last plan left (no token held twice, the entry
at each held token naming its slot); any other row is rebuilt. So the caller must not write into a slot index once
it is in use (its contents before do not matter): a fill of -1 matches no live slot, one of zeros only a slot ``s``
holding the token ``(s + 1) * CHECK_MIX mod 2**31`` itself.
"""

from __future__ import annotations

import torch

CHECK_MIX = 0x9E3779B1


def index_width(hot: int, length: int) -> int:
    """Words a request's row of a slot index takes at least (``indexcache.hisparse_plan``'s ``slot_index``): ``H``
    check words, then an entry a token a slot can hold, ``max(L, H)`` (``length``: ``host_loc``'s width ``L``)."""
    return hot + max(length, hot)


def check_words(slot_token: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` int32: the check words a plan keeping a slot index writes beside the state ``slot_token [B, H]``
    (a row's first ``H`` words; module docstring)."""
    slots = torch.arange(1, slot_token.shape[1] + 1, dtype=torch.int64, device=slot_token.device)
    return (slot_token.long() ^ ((slots * CHECK_MIX) & 0x7FFFFFFF)).int()
