"""HiSparse: each request's KV lives on the host; a hot buffer of H device slots holds the tokens top-k selects
(docs/hisparse.md). The rules, defined here once over CPU tensors and Python ints, slow and plain:

- **State** per request b: ``slot_token[b, s]`` the token slot ``s < H`` holds (-1 empty) and ``slot_age[b, s]`` when
  it was last selected. Slot ``H`` (one past the buffer) is the newest token's, outside the state.
- **A step** (:func:`plan`): rows of ``raw`` select logical positions of their request (``row_to_batch``); a position
  is valid when ``0 <= x < seq_lens[b]``, and only valid positions are looked up, placed or copied. The request's
  distinct valid tokens, in order of first appearance (rows ascending, then columns), are placed:
  - ``seq_len <= H``: token t is at slot t (the engine wrote it there); the state becomes exactly that; no copy;
  - ``seq_len > H``: the newest token ``seq_len - 1`` is at slot H (written by this step); the state's slots holding
    a token outside ``[0, seq_len - 1)``, a token no step could have put there (at or past ``max(L, H)``: neither on
    the host nor a short request's own) or a token an earlier slot holds are emptied; a token held by a slot is a
    hit and keeps it; every other token is a miss, placed if its host location is valid: misses take, in order, the
    slots not hit this step, empty ones first, then by (age, slot) ascending, one copy each; a miss finding no slot
    left (more than H distinct tokens) or no valid host location gets none (-1);
  - every slot holding a selected token gets age ``now = max(slot_age[b]) + 1``; other ages never change.
- **The result**: each selected position's slot (-1 for an invalid one or a token left without a slot), the copies
  (host row -> slot) filed under the row where each token first appears, and the state after the step.
- **A layer's swap-in** (:func:`swap_in`): each copy, host_kv row -> device_kv row ``device_loc[b, slot]``; a copy
  whose rows lie outside either tensor is skipped. A producer group's layers take the same copies, each its own
  tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

EMPTY = -1
AGE_MAX = 2**31 - 1  # ages are int32; ``now`` saturates here


class Plan(NamedTuple):
    """What :func:`plan` decides for one step. ``R, k = raw.shape``; ``B, H`` the state's shape."""

    slots: torch.Tensor  # [R, k] int32: the slot of each selected position, in [0, H]; -1 none
    copy_src: torch.Tensor  # [R, k] int64: the host rows to copy, the first copy_count[r] of row r; -1 after
    copy_dst: torch.Tensor  # [R, k] int32: the slots they go to, likewise
    copy_count: torch.Tensor  # [R] int32: how many copies row r carries
    slot_token: torch.Tensor  # [B, H] int32: the state after the step
    slot_age: torch.Tensor  # [B, H] int32

    @property
    def copies(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(copy_src, copy_dst, copy_count)``: what a layer's swap-in takes
        (``indexcache.hisparse_swap_in(*plan.copies, host_kv, device_kv, device_loc)``)."""
        return self.copy_src, self.copy_dst, self.copy_count


def empty_state(requests: int, hot: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_token, slot_age)`` of ``requests`` requests with ``hot`` empty slots each: every entry -1. A request
    starts (or is reset) with its rows so."""
    return (torch.full((requests, hot), EMPTY, dtype=torch.int32, device=device),
            torch.full((requests, hot), EMPTY, dtype=torch.int32, device=device))


def _check(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch) -> None:
    def need(name: str, t, dims: int) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a {dims}-d integer tensor")

    need("raw", raw, 2)
    need("seq_lens", seq_lens, 1)
    need("host_loc", host_loc, 2)
    need("slot_token", slot_token, 2)
    need("slot_age", slot_age, 2)
    batches = slot_token.shape[0]
    if slot_age.shape != slot_token.shape:
        raise ValueError(f"slot_age {tuple(slot_age.shape)} must have slot_token's shape {tuple(slot_token.shape)}")
    if slot_token.shape[1] < 1:
        raise ValueError("slot_token must have at least one slot (H >= 1)")
    if seq_lens.shape[0] != batches or host_loc.shape[0] != batches:
        raise ValueError(f"seq_lens and host_loc must have one row a request ({batches}, slot_token's rows)")
    if row_to_batch is None:
        if raw.shape[0] != batches:
            raise ValueError(f"raw has {raw.shape[0]} rows: without row_to_batch it needs one a request ({batches})")
    else:
        need("row_to_batch", row_to_batch, 1)
        if row_to_batch.shape[0] != raw.shape[0]:
            raise ValueError(f"row_to_batch must have one entry a row of raw ({raw.shape[0]})")


def plan(raw: torch.Tensor, seq_lens: torch.Tensor, host_loc: torch.Tensor, slot_token: torch.Tensor,
         slot_age: torch.Tensor, *, row_to_batch: torch.Tensor | None = None, host_rows: int | None = None) -> Plan:
    """One step's hot-buffer plan by the module's rules (the inputs are not modified).

    ``raw [R, k]`` logical positions (-1 none); ``seq_lens [B]`` each request's length, the newest token included;
    ``host_loc [B, L]`` the host row of token t of request b (t >= L or a value < 0, or >= ``host_rows`` when given:
    not on the host); ``slot_token``, ``slot_age [B, H]`` the state; ``row_to_batch [R]`` the request of each row
    (default: row r is request r; a row whose request is outside [0, B) selects nothing). A request no row names is
    left as it was.
    """
    _check(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch)
    raw = raw.cpu().long()
    rows, k = raw.shape
    tokens, ages = slot_token.cpu().long().clone(), slot_age.cpu().long().clone()
    batches, hot = tokens.shape
    seq_lens, host_loc = seq_lens.cpu().long(), host_loc.cpu().long()
    r2b = torch.arange(rows) if row_to_batch is None else row_to_batch.cpu().long()
    slots = torch.full((rows, k), EMPTY, dtype=torch.int64)
    copy_src = torch.full((rows, k), EMPTY, dtype=torch.int64)
    copy_dst = torch.full((rows, k), EMPTY, dtype=torch.int64)
    copy_count = torch.zeros(rows, dtype=torch.int64)

    def host_row(b: int, t: int) -> int:
        loc = int(host_loc[b, t]) if t < host_loc.shape[1] else EMPTY
        return loc if loc >= 0 and (host_rows is None or loc < host_rows) else EMPTY

    for b in range(batches):
        own = [r for r in range(rows) if int(r2b[r]) == b]
        if not own:
            continue
        n = int(seq_lens[b])
        first: dict[int, int] = {}  # token -> the row where it first appears; insertion order is appearance order
        for r in own:
            for j in range(k):
                x = int(raw[r, j])
                if 0 <= x < n:
                    first.setdefault(x, r)
        now = min(int(ages[b].max()) + 1, AGE_MAX)
        where: dict[int, int] = {}  # token -> its slot this step
        if n <= hot:
            tokens[b] = torch.where(torch.arange(hot) < n, torch.arange(hot), EMPTY)
            where = {t: t for t in first}
        else:
            newest, held = n - 1, {}
            for s in range(hot):
                t = int(tokens[b, s])
                if not 0 <= t < min(newest, max(host_loc.shape[1], hot)) or t in held:
                    tokens[b, s] = EMPTY
                else:
                    held[t] = s
            if newest in first:
                where[newest] = hot
            where.update({t: held[t] for t in first if t in held})
            taken = set(where.values())
            free = sorted((s for s in range(hot) if s not in taken),
                          key=lambda s: (int(tokens[b, s]) >= 0, int(ages[b, s]), s))
            misses = [t for t in first if t not in where and host_row(b, t) >= 0]
            for t, s in zip(misses, free, strict=False):  # misses past the free slots get none
                r, i = first[t], int(copy_count[first[t]])
                copy_src[r, i], copy_dst[r, i] = host_row(b, t), s
                copy_count[r] += 1
                tokens[b, s] = t
                where[t] = s
        for s in where.values():
            if s < hot:
                ages[b, s] = now
        for r in own:
            for j in range(k):
                slots[r, j] = where.get(int(raw[r, j]), EMPTY)
    return Plan(slots.int(), copy_src, copy_dst.int(), copy_count.int(), tokens.int(), ages.int())


def swap_in(p: Plan, host_kv: torch.Tensor | Sequence[torch.Tensor], device_kv: torch.Tensor | Sequence[torch.Tensor],
            device_loc: torch.Tensor, *, row_to_batch: torch.Tensor | None = None) -> torch.Tensor | list[torch.Tensor]:
    """``device_kv`` (a copy) after one layer's swap-in of ``p``'s copies: row ``copy_src`` of ``host_kv`` to row
    ``device_loc[b, copy_dst]`` of ``device_kv`` (``device_loc [B, H + 1]``: the device row of each slot of each
    request, slot H the newest token's; ``row_to_batch`` as given to :func:`plan`). A copy whose host or device row
    lies outside its tensor (or whose request or slot lies outside ``device_loc``) is skipped; a row's count is taken
    in ``[0, k]``. Sequences of tensors (a producer group's layers): each layer alike, a list of copies returned."""
    if not isinstance(device_kv, torch.Tensor):
        return [swap_in(p, h, d, device_loc, row_to_batch=row_to_batch)
                for h, d in zip(host_kv, device_kv, strict=True)]
    out = device_kv.clone()
    device_loc = device_loc.cpu().long()
    rows = p.copy_count.shape[0]
    r2b = torch.arange(rows) if row_to_batch is None else row_to_batch.cpu().long()
    for r in range(rows):
        b = int(r2b[r])
        count = min(int(p.copy_count[r]), p.copy_src.shape[1])  # a count past the lists' width copies them all
        for i in range(count if 0 <= b < device_loc.shape[0] else 0):
            src, slot = int(p.copy_src[r, i]), int(p.copy_dst[r, i])
            dst = int(device_loc[b, slot]) if 0 <= slot < device_loc.shape[1] else EMPTY
            if 0 <= src < host_kv.shape[0] and 0 <= dst < out.shape[0]:
                out[dst] = host_kv[src].to(out.device)
    return out


def device_rows(slots: torch.Tensor, device_loc: torch.Tensor, *,
                row_to_batch: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, k]`` int32: the device row each selected position is read from, ``device_loc[b, slot]``; -1 where the
    slot is -1, the row's request is outside ``device_loc`` or the entry is negative (no device row: what
    ``translate`` with a page size of 1 over ``device_loc`` gives, as the runtime reads it)."""
    slots, device_loc = slots.cpu().long(), device_loc.cpu().long()
    rows, k = slots.shape
    r2b = torch.arange(rows) if row_to_batch is None else row_to_batch.cpu().long()
    out = torch.full((rows, k), EMPTY, dtype=torch.int64)
    for r in range(rows):
        b = int(r2b[r])
        if not 0 <= b < device_loc.shape[0]:
            continue
        for j in range(k):
            s = int(slots[r, j])
            if 0 <= s < device_loc.shape[1]:
                out[r, j] = max(int(device_loc[b, s]), EMPTY)
    return out.int()
