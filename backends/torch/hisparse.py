"""HiSparse in plain torch (docs/hisparse.md; the rules are ``indexcache.hal.hisparse``): the step's plan by sorts,
prefix sums and scatters over static shapes (no host sync, graph-capturable), and a layer's swap-in.

The plan, over the ``R * k`` selected positions grouped by request (rows stably sorted by request, so each request's
positions are in order of first appearance):

- a stable sort by ``(request, token)`` puts each token's occurrences together, its first appearance first;
- the state, cleaned (per request a stable sort of its tokens: the lower slot of a duplicate wins), sorted by
  ``(request, token)``, answers each token's hit by ``searchsorted``;
- a miss's rank among its request's misses is a prefix sum minus the one at the request's first position; the i-th
  miss takes the i-th free slot of a per-request stable sort by ``(taken, occupied, age)``;
- slots, copies (ranked again within their row of first appearance) and the new state are scattered, entries that
  write nothing going to a spare element past the end.
"""

from __future__ import annotations

import torch

SHIFT = 2**31  # tokens and positions are below 2**31: a (request, token) key is request * SHIFT + token
NONE = torch.iinfo(torch.int64).max  # the key of a position that selects nothing: sorts after every real key
AGE_MAX = 2**31 - 1
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # rows move as bits (fp8 has no index_copy_)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as the integer type of its element size (itself where there is none, e.g. complex128)."""
    wide = _BITS.get(x.element_size())
    return x if wide is None or x.dtype.is_complex else x.view(wide)


def hisparse_plan(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch, host_rows, out, out_copy_src,
                  out_copy_dst, out_copy_count, slot_index=None):
    """Fill ``out [R, k]`` (the slots), ``out_copy_src``, ``out_copy_dst`` and ``out_copy_count`` and update
    ``slot_token``, ``slot_age`` in place to the state after the step (contract: ``indexcache.hal.hisparse.plan``;
    ``slot_index``, a Triton kernel's hint, is neither read nor written).
    No host sync: every shape is fixed by the arguments' shapes. Returns ``(out, out_copy_src, out_copy_dst,
    out_copy_count)``."""
    rows, k = raw.shape
    batches, hot = slot_token.shape
    dev, i64 = raw.device, torch.int64
    if batches == 0:  # no request: every row names none
        out.fill_(-1)
        out_copy_src.fill_(-1)
        out_copy_dst.fill_(-1)
        out_copy_count.fill_(0)
        return out, out_copy_src, out_copy_dst, out_copy_count
    size, cells = rows * k, batches * hot
    seq, tok, age = seq_lens.long(), slot_token.long(), slot_age.long()
    pos = torch.arange(size, device=dev)

    # the positions grouped by request ("g" order), each request's in order of first appearance; rows naming no
    # request (request B here) last
    r2b = torch.arange(rows, device=dev) if row_to_batch is None else row_to_batch.long()
    r2b = torch.where((r2b >= 0) & (r2b < batches), r2b, batches)
    row_perm = torch.argsort(r2b, stable=True)
    row_g = row_perm[:, None].expand(rows, k).reshape(-1)
    b_g = r2b[row_g]
    bc_g = b_g.clamp(max=batches - 1)
    x_g = raw.long()[row_perm].reshape(-1)
    n_g = seq[bc_g]
    valid = (b_g < batches) & (x_g >= 0) & (x_g < n_g)
    long_g = n_g > hot
    newest_g = x_g == n_g - 1

    # each position's first appearance: a stable sort keeps a token's occurrences in g order
    key = torch.where(valid, b_g * SHIFT + x_g, NONE)
    skey, order = torch.sort(key, stable=True)
    start = torch.ones(size, dtype=torch.bool, device=dev)
    start[1:] = skey[1:] != skey[:-1]
    head = torch.cummax(torch.where(start, pos, 0), 0).values if size else pos
    rep = torch.empty_like(order).scatter_(0, order, order[head])  # the g index of each one's first appearance
    first = valid & (rep == pos)

    # the state cleaned: tokens outside [0, n - 1) or at or past max(L, H), and a token a lower slot holds, are emptied
    in_range = (tok >= 0) & (tok < (seq - 1)[:, None]) & (tok < max(host_loc.shape[1], hot))
    stok, sslot = torch.sort(torch.where(in_range, tok, NONE), dim=1, stable=True)
    again = torch.zeros_like(in_range)
    again[:, 1:] = stok[:, 1:] == stok[:, :-1]
    keep = in_range & ~torch.zeros_like(again).scatter_(1, sslot, again)
    clean = torch.where(keep, tok, -1)

    # hits: the cleaned state's (request, token) keys, sorted, looked up
    request = torch.arange(batches, device=dev)[:, None]
    held, held_at = torch.sort(torch.where(keep, request * SHIFT + tok, NONE).reshape(-1))
    found = torch.searchsorted(held, key).clamp(max=cells - 1)
    hit = valid & long_g & ~newest_g & (held[found] == key)
    hit_slot = held_at[found] % hot

    # misses on the host, ranked within their request in order of first appearance
    length = host_loc.shape[1]
    if length:
        src = host_loc[bc_g, x_g.clamp(0, length - 1)].long()
        on_host = (x_g < length) & (src >= 0)
        if host_rows is not None:
            on_host &= src < host_rows
    else:
        src, on_host = torch.full_like(x_g, -1), torch.zeros_like(valid)
    miss = first & long_g & ~newest_g & ~hit & on_host
    per_request = torch.zeros(batches + 1, dtype=i64, device=dev).index_add_(0, r2b, torch.ones_like(r2b))
    request_start = (per_request.cumsum(0) - per_request) * k  # the g index of each request's first position
    before = torch.cat([torch.zeros(1, dtype=i64, device=dev), miss.long().cumsum(0)])
    rank = before[:-1] - before[request_start[b_g]]

    # the free slots (not hit) in eviction order: empty first, then by age, ties by the lower slot (stable sort)
    taken = torch.zeros(cells + 1, dtype=torch.bool, device=dev)
    taken.index_fill_(0, torch.where(first & hit, bc_g * hot + hit_slot, cells), True)
    taken = taken[:cells].view(batches, hot)
    evict = (taken.long() << 34) | ((clean >= 0).long() << 33) | (age + SHIFT)
    eviction = torch.sort(evict, dim=1, stable=True).indices.reshape(-1)
    placed = miss & (rank < (~taken).sum(1)[bc_g])
    miss_slot = eviction[bc_g * hot + rank.clamp(0, hot - 1)]

    # each token's slot, decided at its first appearance and shared by its other occurrences
    decided = torch.where(~long_g, x_g, torch.where(newest_g, hot, torch.where(
        hit, hit_slot, torch.where(placed, miss_slot, -1))))
    decided = torch.where(first, decided, -1)
    flat = row_g * k + pos % k  # the flat index r * k + j of each g position
    slots = torch.empty(size, dtype=i64, device=dev).scatter_(0, flat, torch.where(valid, decided[rep], -1))
    out.copy_(slots.view(rows, k))

    # the copies, filed under their row of first appearance (a row is k consecutive g positions)
    before = torch.cat([torch.zeros(1, dtype=i64, device=dev), placed.long().cumsum(0)])
    at = torch.where(placed, row_g * k + before[:-1] - before[pos - pos % k], size)
    copy_src = torch.full((size + 1,), -1, dtype=i64, device=dev).scatter_(0, at, torch.where(placed, src, -1))
    copy_dst = torch.full((size + 1,), -1, dtype=i64, device=dev).scatter_(0, at, torch.where(placed, miss_slot, -1))
    out_copy_src.copy_(copy_src[:size].view(rows, k))
    out_copy_dst.copy_(copy_dst[:size].view(rows, k))
    count = torch.zeros(rows, dtype=i64, device=dev).index_copy_(0, row_perm, placed.view(rows, k).sum(1))
    out_copy_count.copy_(count)

    # the state: a short request's identity, a long one's cleaned state with its placed misses, the rest untouched
    named = (per_request[:batches] > 0)[:, None]
    long_b = (seq > hot)[:, None]
    slot = torch.arange(hot, device=dev)
    tokens = torch.where(named & long_b, clean, torch.where(named, torch.where(slot < seq[:, None], slot, -1), tok))
    tokens = torch.cat([tokens.reshape(-1), tokens.new_full((1,), -1)])
    tokens.scatter_(0, torch.where(placed, bc_g * hot + miss_slot, cells), torch.where(placed, x_g, -1))
    used = torch.zeros(cells + 1, dtype=torch.bool, device=dev)
    used.index_fill_(0, torch.where(first & (decided >= 0) & (decided < hot), bc_g * hot + decided, cells), True)
    now = (age.amax(1) + 1).clamp(max=AGE_MAX)
    slot_age.copy_(torch.where(used[:cells].view(batches, hot), now[:, None], age))
    slot_token.copy_(tokens[:cells].view(batches, hot))
    return out, out_copy_src, out_copy_dst, out_copy_count


def _copies(copy_src, copy_dst, copy_count, device_loc, row_to_batch, host_rows, device_rows):
    """The copy lists flattened: ``(src, dst, ok)`` over ``R * k`` entries in the reference's order (rows, then
    entries); ``ok`` where the entry is a copy inside every bound, ``src``, ``dst`` clamped inside elsewhere."""
    rows, k = copy_src.shape
    batches, width = device_loc.shape
    dev = copy_src.device
    b = torch.arange(rows, device=dev) if row_to_batch is None else row_to_batch.long()
    ok = (torch.arange(k, device=dev)[None, :] < copy_count.long().clamp(0, k)[:, None]) & (
        (b >= 0) & (b < batches))[:, None]
    slot = copy_dst.long()
    ok &= (slot >= 0) & (slot < width)
    if batches and width:
        dst = device_loc[b.clamp(0, batches - 1)[:, None], slot.clamp(0, width - 1)].long()
    else:
        dst = torch.full_like(slot, -1)
    src = copy_src.long()
    ok &= (dst >= 0) & (dst < device_rows) & (src >= 0) & (src < host_rows)
    return src.clamp(0, host_rows - 1).reshape(-1), dst.clamp(0, device_rows - 1).reshape(-1), ok.reshape(-1)


def _winners(dst, ok):
    """For each entry, the entry whose write its device row keeps (the reference copies in order: the last valid
    copy to a row wins). An entry that is not a copy counts as row 0 keeping its own value, behind every copy."""
    row = torch.where(ok, dst, 0)
    sorted_key, order = torch.sort(row * 2 + ok.long(), stable=True)  # (row, ok, entry order)
    size = row.shape[0]
    last = torch.ones(size, dtype=torch.bool, device=row.device)
    last[:-1] = (sorted_key[1:] >> 1) != (sorted_key[:-1] >> 1)
    at = torch.where(last, torch.arange(size, device=row.device), size)
    at = torch.flip(torch.cummin(torch.flip(at, [0]), 0).values, [0])  # each one's segment's last position
    return torch.empty_like(order).scatter_(0, order, order[at]), row


def hisparse_swap_in(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch):
    """Copy rows ``copy_src`` of ``host_kv`` to rows ``device_loc[b, copy_dst]`` of ``device_kv``, in place (contract:
    ``indexcache.hal.hisparse.swap_in``); copies outside any bound are skipped. Returns ``device_kv``. A group's layers
    (sequences of tensors) are copied one after another.

    With ``host_kv`` on ``device_kv``'s device: no host sync (each row's writes are made equal, the skipped ones
    rewrite row 0 with what it ends up holding). With ``host_kv`` on the CPU and ``device_kv`` on a GPU: the copy
    lists are read on the host (a sync), the rows gathered there and sent over; this path cannot be captured in a
    CUDA graph and raises RuntimeError inside a capture."""
    if not isinstance(device_kv, torch.Tensor):
        for host, device in zip(host_kv, device_kv, strict=True):
            hisparse_swap_in(copy_src, copy_dst, copy_count, host, device, device_loc, row_to_batch)
        return device_kv
    host_rows, device_rows = host_kv.shape[0], device_kv.shape[0]
    if copy_src.numel() == 0 or host_rows == 0 or device_rows == 0:
        return device_kv
    if host_kv.device != device_kv.device:
        return _swap_in_from_host(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch)
    src, dst, ok = _copies(copy_src, copy_dst, copy_count, device_loc, row_to_batch, host_rows, device_rows)
    win, row = _winners(dst, ok)
    host, device = _bits(host_kv), _bits(device_kv)
    shape = (-1,) + (1,) * (device_kv.dim() - 1)
    device.index_copy_(0, row, torch.where(ok[win].view(shape), host[src[win]], device[row[win]]))
    return device_kv


def _swap_in_from_host(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch):
    """:func:`hisparse_swap_in` from a CPU ``host_kv``: the winning copies selected and gathered on the host."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("hisparse_swap_in: host_kv is on the CPU and device_kv on a GPU: this path reads the copy "
                           "lists on the host and cannot be captured in a CUDA graph (put host_kv in memory a "
                           "device kernel can read, or swap in outside the capture)")
    cpu = torch.device("cpu")
    src, dst, ok = _copies(copy_src.to(cpu), copy_dst.to(cpu), copy_count.to(cpu), device_loc.to(cpu),
                           None if row_to_batch is None else row_to_batch.to(cpu), host_kv.shape[0],
                           device_kv.shape[0])
    win, _ = _winners(dst, ok)
    chosen = ok & (win == torch.arange(win.shape[0]))
    rows = _bits(host_kv)[src[chosen]]
    if device_kv.is_cuda:
        rows = rows.pin_memory()
    _bits(device_kv).index_copy_(0, dst[chosen].to(device_kv.device), rows.to(device_kv.device, non_blocking=True))
    return device_kv
