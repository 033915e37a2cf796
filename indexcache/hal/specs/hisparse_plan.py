"""hisparse_plan: one decode step's hot-buffer plan, the hits, misses and evictions of each request's device slots
(contract: :func:`indexcache.hisparse_plan`; the rules: :mod:`indexcache.hal.hisparse`, docs/hisparse.md)."""

from __future__ import annotations

from typing import Any

import torch

from indexcache.hal import hisparse
from indexcache.hal.checks import INDEX, MAX_TOPK, check_int, check_output, check_tensor, output
from indexcache.hal.shown import dims, shown
from indexcache.hal.slot_index import check_words, index_width
from indexcache.hal.specs.base import I32, CaseList, OpSpec, Verdict, cpu, not_written

HOST_LOC_DTYPES = (torch.int32, torch.int64)
# Where a plan's copies come from: int64 host rows (a host pool of a 61-layer model's tokens outgrows int32).
COPY_SRC = torch.int64


def check(raw, seq_lens, host_loc, slot_token, slot_age, *, row_to_batch=None, host_rows: int | None = None,
          slot_index=None, out=None, out_copy_src=None, out_copy_dst=None, out_copy_count=None) -> dict[str, Any]:
    check_tensor("slot_token", slot_token, (INDEX,), (None, None))
    device = slot_token.device
    batches, hot = slot_token.shape
    if hot < 1:
        raise ValueError("slot_token: expected at least one slot a request (H >= 1), got shape "
                         f"{dims(slot_token.shape)}")
    check_tensor("slot_age", slot_age, (INDEX,), (batches, hot), device)
    for name, state in (("slot_token", slot_token), ("slot_age", slot_age)):
        if not state.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (the op writes the state in place), got strides "
                             f"{dims(state.stride())}")
    check_output("slot_age", slot_age, {"slot_token": slot_token})
    check_tensor("raw", raw, (INDEX,), (None, None), device)
    rows, k = raw.shape
    if k > MAX_TOPK:
        raise ValueError(f"raw: expected at most {MAX_TOPK} columns, got {shown(k)}")
    check_tensor("seq_lens", seq_lens, (INDEX,), (batches,), device)
    check_tensor("host_loc", host_loc, HOST_LOC_DTYPES, (batches, None), device)
    if row_to_batch is None:
        if rows != batches:
            raise ValueError(f"raw: expected one row a request ({shown(batches)}, slot_token's rows) without "
                             f"row_to_batch, got {shown(rows)}")
    else:
        check_tensor("row_to_batch", row_to_batch, (INDEX,), (rows,), device)
    if host_rows is not None:
        check_int("host_rows", host_rows, 0, 2**63 - 1, " (host rows are int64)")
    reads = dict(raw=raw, seq_lens=seq_lens, host_loc=host_loc, row_to_batch=row_to_batch)
    state = dict(slot_token=slot_token, slot_age=slot_age)
    for name, t in state.items():
        check_output(name, t, reads)
    if slot_index is not None:
        width = index_width(hot, host_loc.shape[1])
        check_tensor("slot_index", slot_index, (INDEX,), (batches, None), device)
        if slot_index.shape[1] < width or not slot_index.is_contiguous():
            raise ValueError(f"slot_index: expected a contiguous [{shown(batches)}, >= {shown(width)}] tensor (a check "
                             f"word a slot, then a word a token a slot can hold: H + max(L, H)), got shape "
                             f"{dims(slot_index.shape)}, strides {dims(slot_index.stride())}")
        check_output("slot_index", slot_index, {**reads, **state})
        state["slot_index"] = slot_index
    taken = {**reads, **state}
    outs = {}
    for name, given, dtype, shape in (("out", out, INDEX, (rows, k)),
                                      ("out_copy_src", out_copy_src, COPY_SRC, (rows, k)),
                                      ("out_copy_dst", out_copy_dst, INDEX, (rows, k)),
                                      ("out_copy_count", out_copy_count, INDEX, (rows,))):
        outs[name] = output(name, given, dtype, shape, device, {**taken, **outs})
    return dict(raw=raw, seq_lens=seq_lens, host_loc=host_loc, slot_token=slot_token, slot_age=slot_age,
                row_to_batch=row_to_batch, host_rows=host_rows, slot_index=slot_index, **outs)


def reference(raw, seq_lens, host_loc, slot_token, slot_age, *, row_to_batch=None, host_rows=None,
              slot_index=None, out_copy_src=None, out_copy_dst=None, out_copy_count=None) -> hisparse.Plan:
    """The plan by the rules of :func:`indexcache.hal.hisparse.plan` (the given outputs and the slot index play no
    part)."""
    return hisparse.plan(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch=row_to_batch,
                         host_rows=host_rows)


def judge(args: dict, got: hisparse.Plan, want: hisparse.Plan, accumulation: str) -> Verdict:
    """Every field exact: the slots, the copy lists and counts (in the given outputs where the case gives them), the
    state after the step (the op returns the given state: its values are the backend's in-place update)."""
    if detail := not_written(args, {"out": got.slots, "out_copy_src": got.copy_src, "out_copy_dst": got.copy_dst,
                                    "out_copy_count": got.copy_count}):
        return detail, None, None
    for field in hisparse.Plan._fields:
        g, w = cpu(getattr(got, field)), getattr(want, field)
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{field}: {g.dtype} {list(g.shape)}, expected {w.dtype} {list(w.shape)}", None, None
        if not torch.equal(g, w):
            bad = (g != w).nonzero()[0].tolist()
            return (f"{field} differs at {bad}: {g[tuple(bad)].item()}, expected {w[tuple(bad)].item()} "
                    f"({int((g != w).sum())} entries differ)"), None, None
    return "", None, None


# ------------------------------------------------------------------------------------------------------- cases

def _positions(gen: torch.Generator, rows: int, k: int, lens: list[int], r2b: list[int]) -> torch.Tensor:
    """Distinct positions below each row's request length (a top-k row), -1 where the request has fewer."""
    raw = torch.full((rows, k), -1, dtype=I32)
    for r, b in enumerate(r2b):
        n = max(lens[b], 0) if 0 <= b < len(lens) else 0
        picked = torch.randperm(max(n, 1), generator=gen)[:min(k, n)].to(I32)
        raw[r, :picked.numel()] = picked
    return raw


def _host_loc(gen: torch.Generator, batches: int, width: int) -> torch.Tensor:
    """Each request's tokens at distinct host rows of one shared pool (a permutation)."""
    return torch.randperm(batches * width, generator=gen).view(batches, width).to(I32)


def _evolved(gen: torch.Generator, steps: int, lens: list[int], hot: int, k: int, host_loc: torch.Tensor,
             drift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A state after ``steps`` steps of the reference whose selections drift by ``drift`` positions a step (a long
    decode), and the step after's selection: ``(raw, slot_token, slot_age)``. Lengths grow by one a step."""
    batches = len(lens)
    tokens, ages = hisparse.empty_state(batches, hot)
    raw = _positions(gen, batches, k, lens, list(range(batches)))
    for step in range(steps + 1):
        now = [n - steps + step for n in lens]
        if step:
            fresh = _positions(gen, batches, k, now, list(range(batches)))
            raw = raw.clone()
            raw[:, :drift] = fresh[:, :drift]
            raw = torch.where(raw < torch.tensor(now, dtype=I32)[:, None], raw, fresh)
        if step == steps:
            return raw, tokens, ages
        p = hisparse.plan(raw, torch.tensor(now, dtype=I32), host_loc, tokens, ages)
        tokens, ages = p.slot_token, p.slot_age
    raise AssertionError("unreachable")


def _args(dev, raw, lens, host_loc, tokens, ages, **named) -> dict[str, Any]:
    moved = {n: v.to(dev) if isinstance(v, torch.Tensor) else v for n, v in named.items()}
    return dict(raw=raw.to(dev), seq_lens=torch.tensor(lens, dtype=I32).to(dev), host_loc=host_loc.to(dev),
                slot_token=tokens.to(dev), slot_age=ages.to(dev), **moved)


cases = CaseList("hisparse_plan")


@cases.add("short requests (seq_len <= H): each token at its own slot, the state rebuilt over garbage, no copy")
def _(gen, dev):
    hot, k, lens = 64, 16, [1, 10, 63, 64, 0]
    tokens = torch.randint(-5, 200, (5, hot), generator=gen, dtype=I32)
    ages = torch.randint(-1, 50, (5, hot), generator=gen, dtype=I32)
    raw = _positions(gen, 5, k, lens, list(range(5)))
    raw[1, 3], raw[2, 0], raw[2, 1] = -1, 70, -9  # -1, past the length, negative
    return _args(dev, raw, lens, _host_loc(gen, 5, 80), tokens, ages)


@cases.add("long requests after a drifting decode: hits keep their slots, misses evict the oldest, -1 and "
           "out-of-range positions get -1")
def _(gen, dev):
    hot, k, lens = 48, 16, [300, 90, 49, 1000]
    host_loc = _host_loc(gen, 4, 1000)
    raw, tokens, ages = _evolved(gen, 10, lens, hot, k, host_loc, drift=5)
    raw[0, 2], raw[1, 5], raw[3, 0], raw[3, 1] = -1, 90, 5000, -2**31
    return _args(dev, raw, lens, host_loc, tokens, ages)


@cases.add("seq_len around H (H - 1, H, H + 1, H + 2): the crossing keeps the identity's tokens as hits")
def _(gen, dev):
    hot, k, lens = 32, 12, [31, 32, 33, 34]
    host_loc = _host_loc(gen, 4, 40)
    raw, tokens, ages = _evolved(gen, 2, lens, hot, k, host_loc, drift=4)
    raw[:, 0] = torch.tensor(lens, dtype=I32) - 1  # the newest token: slot H once the request is longer than H
    raw[:, 1] = torch.tensor(lens, dtype=I32) - 2  # the token before: a hit, or (H + 2) a miss evicting the oldest
    return _args(dev, raw, lens, host_loc, tokens, ages)


@cases.add("rows sharing a request (next_n 3): duplicates across and within rows placed once, rows naming no "
           "request, a request no row names keeps its state")
def _(gen, dev):
    hot, k, lens = 40, 16, [200, 120, 500]
    host_loc = _host_loc(gen, 3, 500)
    _, tokens, ages = _evolved(gen, 6, lens, hot, k, host_loc, drift=6)
    r2b = [0, 0, 0, 2, 2, 2, -1, 3]
    raw = _positions(gen, 8, k, lens, r2b)
    raw[1, :8] = raw[0, :8]  # the next draft token selects much the same
    raw[2, 4] = raw[2, 5]  # a token twice in one row
    raw[6], raw[7] = torch.arange(k, dtype=I32), torch.arange(k, dtype=I32)  # rows of no request
    return _args(dev, raw, lens, host_loc, tokens, ages, row_to_batch=torch.tensor(r2b, dtype=I32))


@cases.add("misses not on the host: negative host rows, tokens past host_loc's width, rows past host_rows")
def _(gen, dev):
    hot, lens = 32, [400, 400]
    host_loc = _host_loc(gen, 2, 300)  # tokens 300..399 are past the width
    host_loc[0, ::7] = -1
    host_loc[1, ::5] = 590  # past host_rows
    raw, tokens, ages = _evolved(gen, 3, lens, hot, 16, torch.randperm(800, generator=gen).view(2, 400).to(I32),
                                 drift=8)
    raw = torch.cat([raw, _positions(gen, 2, 8, lens, [0, 1])], dim=1)
    return _args(dev, raw, lens, host_loc, tokens, ages, host_rows=590)


@cases.add("a corrupted state: tokens at and past the newest, negative garbage, one token in several slots")
def _(gen, dev):
    hot, k, lens = 32, 12, [100, 100]
    tokens = torch.randint(0, 100, (2, hot), generator=gen, dtype=I32)
    tokens[0, :4] = torch.tensor([99, 150, -7, 2**31 - 1], dtype=I32)
    tokens[1, 10:14] = tokens[1, 2]
    ages = torch.randint(0, 20, (2, hot), generator=gen, dtype=I32)
    raw = _positions(gen, 2, k, lens, [0, 1])
    raw[1, 0] = tokens[1, 2]
    return _args(dev, raw, lens, _host_loc(gen, 2, 100), tokens, ages)


@cases.add("more distinct tokens than slots (k > H, rows sharing a request): the misses past the free slots get -1")
def _(gen, dev):
    hot, k, lens = 16, 24, [500]
    host_loc = _host_loc(gen, 1, 500)
    _, tokens, ages = _evolved(gen, 2, lens, hot, 8, host_loc, drift=4)
    raw = _positions(gen, 2, k, lens, [0, 0])
    return _args(dev, raw, lens, host_loc, tokens, ages, row_to_batch=torch.zeros(2, dtype=I32))


@cases.add("ages at the int32 limit: now saturates, ties broken by the lower slot")
def _(gen, dev):
    hot, k, lens = 16, 8, [100]
    tokens = torch.randperm(99, generator=gen)[:hot].view(1, hot).to(I32)
    ages = torch.full((1, hot), 2**31 - 1, dtype=I32)
    ages[0, :4] = 2**31 - 2
    raw = _positions(gen, 1, k, lens, [0])
    return _args(dev, raw, lens, _host_loc(gen, 1, 100), tokens, ages)


@cases.add("DeepSeek-like: 4 requests x k 512, H 1024, 12 decode steps in, int64 host rows")
def _(gen, dev):
    hot, k, lens = 1024, 512, [4096, 1500, 1025, 9000]
    host_loc = _host_loc(gen, 4, 9000).long()
    raw, tokens, ages = _evolved(gen, 12, lens, hot, k, host_loc, drift=40)
    return _args(dev, raw, lens, host_loc, tokens, ages)


def _index_of(tokens: torch.Tensor, width: int, gen: torch.Generator) -> torch.Tensor:
    """A slot index of the state ``tokens`` (its check words, each slot at its token, garbage elsewhere): what the
    last step left."""
    hot = tokens.shape[1]
    index = torch.randint(-3, hot + 3, (tokens.shape[0], width), generator=gen, dtype=I32)
    index[:, :hot] = check_words(tokens)
    for b in range(tokens.shape[0]):
        held = tokens[b] >= 0
        index[b, hot + tokens[b][held].long()] = torch.arange(hot, dtype=I32)[held]
    return index


@cases.add("a slot index holding the state (the step after one that kept it): the same plan from the selected "
           "tokens alone; rows sharing a request, a token selected twice, the newest, -1")
def _(gen, dev):
    hot, k, lens = 64, 24, [900, 300, 65, 40]
    host_loc = _host_loc(gen, 4, 900)
    raw, tokens, ages = _evolved(gen, 8, lens, hot, k, host_loc, drift=6)
    raw = torch.cat([raw, raw[:, :k // 2].roll(1, 1).repeat(1, 2)])
    raw[0, 0], raw[1, 1], raw[5, 2] = lens[0] - 1, -1, raw[5, 3]
    r2b = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3], dtype=I32)
    return _args(dev, raw, lens, host_loc, tokens, ages, row_to_batch=r2b, slot_index=_index_of(tokens, 964, gen))


@cases.add("a slot index of garbage, wider than H + max(L, H), over a state holding a token twice: every slot resolved "
           "through the table")
def _(gen, dev):
    hot, k, lens = 32, 12, [300, 120]
    host_loc = _host_loc(gen, 2, 250)
    raw, tokens, ages = _evolved(gen, 4, lens, hot, k, host_loc, drift=4)
    tokens[1, 7] = tokens[1, 3]
    index = torch.randint(-2**31, 2**31 - 1, (2, 300), generator=gen, dtype=torch.int64).to(I32)
    return _args(dev, raw, lens, host_loc, tokens, ages, slot_index=index)


@cases.add("a slot index of the state before the caller changed it: one slot now holds another's token (held "
           "twice), one holds a token the last plan never put there (selected: a hit), the newest selected; every "
           "slot resolved through the table")
def _(gen, dev):
    hot, k, lens = 32, 12, [300, 120, 200]
    host_loc = _host_loc(gen, 3, 250)
    raw, tokens, ages = _evolved(gen, 4, lens, hot, k, host_loc, drift=4)
    index = _index_of(tokens, 282, gen)
    held = (tokens[0] >= 0).nonzero().flatten()
    tokens[0, held[5]] = tokens[0, held[2]]
    raw[0, :2] = tokens[0, held[2]]
    stranger = next(t for t in range(lens[2] - 1) if t not in tokens[2].tolist())
    tokens[2, 4], raw[2, 0], raw[2, 1] = stranger, lens[2] - 1, stranger
    return _args(dev, raw, lens, host_loc, tokens, ages, slot_index=index)


@cases.add("given outputs holding garbage: the plan written into the caller's slots, copy lists and counts")
def _(gen, dev):
    hot, k, lens = 32, 8, [100, 40, 20]
    host_loc = _host_loc(gen, 3, 100)
    raw, tokens, ages = _evolved(gen, 6, lens, hot, k, host_loc, drift=3)
    return _args(dev, raw, lens, host_loc, tokens, ages, out=torch.full((3, k), 77, dtype=I32),
                 out_copy_src=torch.full((3, k), 99, dtype=COPY_SRC), out_copy_dst=torch.full((3, k), 55, dtype=I32),
                 out_copy_count=torch.full((3,), 66, dtype=I32))


@cases.add("no rows and no requests")
def _(gen, dev):
    tokens, ages = hisparse.empty_state(0, 8)
    return _args(dev, torch.zeros(0, 4, dtype=I32), [], torch.zeros(0, 3, dtype=I32), tokens, ages)


SPEC = OpSpec("hisparse_plan", check, reference, judge, tuple(cases))
