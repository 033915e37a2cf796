"""topk: per row, the k best positions of a window of scores (contract: :func:`indexcache.topk`). Its record's
``bench``: full rows of normal scores (shared with topk_translate), set against one read of the scores and
against ``torch.topk``, checked by each row's index set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch
from indexcache.hal.checks import INDEX, SCORE_DTYPES, check_bool, check_k, check_tensor, check_workspace, output
from indexcache.hal.specs.base import I32, CaseList, OpSpec, Verdict, cpu, ints, not_written
from indexcache.hal.specs.bench import POISON, BenchCase, BenchSpec


def check_inputs(scores, lengths, k, row_starts) -> None:
    """``scores [R, N]``, ``lengths [R]``, ``k`` and ``row_starts [R]`` (or None), as :func:`check` takes them."""
    check_tensor("scores", scores, SCORE_DTYPES, (None, None))
    check_tensor("lengths", lengths, (INDEX,), (scores.shape[0],), scores.device)
    check_k(k)
    if row_starts is not None:
        check_tensor("row_starts", row_starts, (INDEX,), (scores.shape[0],), scores.device)


def check(scores, lengths, k: int, *, row_starts=None, out=None, sorted: bool = False,
          workspace=None) -> dict[str, Any]:
    check_inputs(scores, lengths, k, row_starts)
    inputs = dict(scores=scores, lengths=lengths, row_starts=row_starts)
    out = output("out", out, INDEX, (scores.shape[0], k), scores.device, inputs)
    check_workspace(workspace, scores.device, dict(inputs, out=out))
    return dict(scores=scores, lengths=lengths, k=k, row_starts=row_starts, out=out,
                sorted=check_bool("sorted", sorted), workspace=workspace)


def _window(scores: torch.Tensor, start: int, length: int) -> tuple[int, int]:
    """The row's window ``[start, start + length)`` clipped to the columns; negative length is 0."""
    n = scores.shape[-1]
    start = min(max(start, 0), n)
    return start, min(max(length, 0), n - start)


def reference(scores, lengths, k, *, row_starts=None) -> torch.Tensor:
    """Per row the k best window positions, ``[R, k]`` int32, sorted by (score desc, index asc).

    Rows whose window holds ≤ k positions give ``0 .. len-1`` then -1 without looking at the
    scores. Otherwise -inf and NaN are never chosen (slots they would fill are -1) and among
    equal scores the lower index wins.
    """
    scores, lengths = cpu(scores).double(), cpu(lengths).long()
    rows = scores.shape[0]
    starts = torch.zeros(rows, dtype=torch.long) if row_starts is None else cpu(row_starts).long()
    out = torch.full((rows, k), -1, dtype=torch.int64)
    for r in range(rows):
        start, length = _window(scores, int(starts[r]), int(lengths[r]))
        if length <= k:
            out[r, :length] = torch.arange(length)
            continue
        row = scores[r, start : start + length].tolist()
        ranked = sorted((i for i in range(length) if row[i] == row[i] and row[i] != float("-inf")),
                        key=lambda i: (-row[i], i))[:k]
        out[r, : len(ranked)] = torch.tensor(ranked, dtype=torch.long)
    return out.int()


def check_topk(got: torch.Tensor, want: torch.Tensor, sort: bool) -> str:
    """What differs ("" when nothing does): per row the same set of positions as the reference (our tie rule
    is deterministic, so this is stricter than "the same multiset of scores"), no duplicates, -1 only in
    empty slots; the exact order when ``sort``."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if sort:
        bad = (got != want).any(1).nonzero().flatten()
        return f"rows {bad[:5].tolist()} differ from the sorted reference" if bad.numel() else ""
    for r, (g, w) in enumerate(zip(got.tolist(), want.tolist(), strict=True)):
        picked = [v for v in g if v != -1]
        if len(set(picked)) != len(picked):
            return f"row {r}: duplicate indices"
        if sorted(picked) != sorted(v for v in w if v != -1):
            missing = sorted(set(w) - set(g) - {-1})[:5]
            extra = sorted(set(g) - set(w) - {-1})[:5]
            return f"row {r}: index set differs (missing {missing}, extra {extra})"
    return ""


def judge(args: dict, got: torch.Tensor, want: torch.Tensor, accumulation: str) -> Verdict:
    """:func:`check_topk`, written into the given ``out``."""
    return not_written(args, {"out": got}) or check_topk(cpu(got), want, args.get("sorted", False)), None, None


cases = CaseList("topk")


def scores_of(gen, rows, cols, dtype=torch.float32, distinct=True) -> torch.Tensor:
    """``[rows, cols]`` scores: normal, or integers in [0, 8) when not ``distinct`` (rows full of ties)."""
    if distinct:
        s = torch.randn(rows, cols, generator=gen)
    else:
        s = torch.randint(0, 8, (rows, cols), generator=gen).float()
    return s.to(dtype)


def args_of(gen, dev, scores, k, lengths=None, starts=None, **extra) -> dict[str, Any]:
    """The op's arguments for ``scores`` on ``dev``; random lengths in [0, N] when none are given."""
    rows, cols = scores.shape
    if lengths is None:
        lengths = ints(gen, 0, cols + 1, (rows,))
    args = dict(scores=scores.to(dev), lengths=lengths.to(dev), k=k, **extra)
    if starts is not None:
        args["row_starts"] = starts.to(dev)
    return args


@cases.add("random rows, k 64")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 12, 3000), 64)


@cases.add("full rows, k 2048 of 20000")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 2, 20000), 2048, lengths=torch.tensor([20000, 15000], dtype=I32))


@cases.add("k 513, odd")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 4, 4000), 513, lengths=torch.tensor([4000, 514, 513, 3001], dtype=I32))


@cases.add("k 1")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 6, 700), 1)


@cases.add("rows full of ties (lower index wins)")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 6, 2500, distinct=False), 100)


@cases.add("ties in the k-th best's bin, past 32 a row (lower index wins)")
def _(gen, dev):
    return args_of(gen, dev, torch.randint(0, 16, (6, 2500), generator=gen).float(), 100)


@cases.add("k-th best below zero, candidates up to large positive scores (every octave between)")
def _(gen, dev):
    # An indexer's logits where most heads' weights are negative: in the second row the k-th best about -150, a
    # few thousand candidates within an octave of it and the best far above zero; the third's k-th best near zero.
    offsets = torch.tensor([-160.0, -300.0, -150.0, -10.0])[:, None]
    return args_of(gen, dev, torch.randn(4, 20000, generator=gen) * 100 + offsets, 2048,
                   lengths=torch.tensor([20000, 20000, 19000, 20000], dtype=I32))


@cases.add("all scores equal")
def _(gen, dev):
    return args_of(gen, dev, torch.ones(3, 1000), 37, lengths=torch.tensor([1000, 500, 38], dtype=I32))


@cases.add("-inf rows and NaN never selected")
def _(gen, dev):
    s = scores_of(gen, 5, 1200)
    s[0] = float("-inf")
    s[1, ::3] = float("nan")
    s[2] = float("nan")
    s[3, 10:] = float("-inf")
    s[4, :] = float("-inf")
    s[4, 5] = float("nan")
    s[4, 7] = float("inf")
    return args_of(gen, dev, s, 50, lengths=torch.full((5,), 1200, dtype=I32))


@cases.add("lengths 0, 1, k, k+1 and negative")
def _(gen, dev):
    k = 64
    lengths = torch.tensor([0, 1, k - 1, k, k + 1, -1, -(2**31), 2**31 - 1], dtype=I32)
    return args_of(gen, dev, scores_of(gen, 8, 1500), k, lengths=lengths)


@cases.add("row_starts windows (clipped to the columns)")
def _(gen, dev):
    starts = torch.tensor([0, 100, 1999, 2000, 1500, -7, 2**31 - 1, 300], dtype=I32)
    lengths = torch.tensor([2000, 900, 5, 10, 1000, 100, 100, 1700], dtype=I32)
    return args_of(gen, dev, scores_of(gen, 8, 2000), 128, lengths=lengths, starts=starts)


@cases.add("non-contiguous scores")
def _(gen, dev):
    args = args_of(gen, dev, scores_of(gen, 6, 5000), 200)
    args["scores"] = args["scores"][:, ::2]
    args["lengths"] = args["lengths"].clamp(max=2500)
    return args


@cases.add("bfloat16 scores")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 6, 3000, dtype=torch.bfloat16), 256)


@cases.add("sorted output")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 4, 1000, distinct=False), 90, sorted=True)


@cases.add("sorted output, -1 after the picks (short rows, -inf and NaN)")
def _(gen, dev):
    s = scores_of(gen, 4, 1000, distinct=False)
    s[2, 40:] = float("-inf")
    s[3, ::2] = float("nan")
    return args_of(gen, dev, s, 90, lengths=torch.tensor([50, 0, 1000, 150], dtype=I32), sorted=True)


@cases.add("k = 0")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 3, 100), 0)


@cases.add("rows = 0")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 0, 100), 16)


@cases.add("k larger than the columns")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 3, 40), 64)


@cases.add("preallocated out")
def _(gen, dev):
    return args_of(gen, dev, scores_of(gen, 5, 2000), 100, out=torch.full((5, 100), 777, dtype=I32, device=dev))

# ----------------------------------------------------------------------------------------------- benchmark

BENCH_PAGE = 64  # the page size of topk_translate's table


def bench_cases(quick: bool) -> list[BenchCase]:
    """Also topk_translate's shapes (``page_size`` is for its table)."""
    def case(rows: int, cols: int, k: int) -> BenchCase:
        size = f"{cols >> 20}M" if cols >= 1 << 20 else f"{cols >> 10}K" if cols >= 1024 else str(cols)
        return BenchCase(f"{rows}x{size} k{k}", dict(rows=rows, cols=cols, k=k, page_size=BENCH_PAGE))

    if quick:
        return [case(4, 4096, 64), case(1, 16384, 512)]
    return [case(64, 131072, 2048), case(64, 131072, 512), case(1, 131072, 2048), case(1, 1 << 20, 2048),
            case(2048, 32768, 2048)]


def bench_build(case: BenchCase, gen: torch.Generator) -> dict[str, Any]:
    """float32 normal scores, every row at full length (so torch.topk answers the same question); for the
    fused op a page table of randomly permuted pages."""
    p = case.params
    rows, cols, k, page = p["rows"], p["cols"], p["k"], p["page_size"]
    pages = -(-cols // page)
    return dict(scores=torch.randn(rows, cols, generator=gen), lengths=torch.full((rows,), cols, dtype=torch.int32),
                k=k, page_size=page,
                page_table=torch.randperm(rows * pages, generator=gen, dtype=torch.int32).view(rows, pages),
                out=torch.full((rows, k), POISON, dtype=torch.int32),
                out_raw=torch.full((rows, k), POISON, dtype=torch.int32))


def bench_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    return dispatch.call("topk", check(a["scores"], a["lengths"], a["k"], out=a["out"]), backend)


def torch_topk(a: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk's indices, with the scores: its tie rule is not ours, so it is checked by the scores it picks."""
    return torch.topk(a["scores"], a["k"], dim=1, sorted=False).indices, a["scores"]


def read_once(a: Mapping[str, Any]) -> torch.Tensor:
    """One read of the scores: the least time a top-k call can take."""
    return a["scores"].sum()


def bench_bytes(case: BenchCase) -> int:
    """The scores read once, the int32 result written."""
    p = case.params
    return 4 * p["rows"] * p["cols"] + 4 * p["rows"] * p["k"]


def same_topk(got: torch.Tensor, want: torch.Tensor, case: BenchCase | None = None) -> str:
    """Per row the same set of positions, no duplicates (order is unspecified): the conformance rule. Rows
    sorted and compared on the device first (equal sorted rows of a duplicate-free baseline are the same
    sets); the conformance check, row by row in Python, only says what differs.

    ``got`` as ``(indices, scores)`` (torch.topk, whose tie rule differs): per row the same multiset of
    selected scores."""
    if isinstance(got, tuple):
        idx, scores = got
        picked = scores.gather(1, idx.long()).sort(1).values
        same = torch.equal(picked, scores.gather(1, want.to(idx.device).long()).sort(1).values)
        return "" if same else "selected scores differ from the torch backend's"
    if got.shape == want.shape and torch.equal(got.long().sort(1).values, want.to(got.device).long().sort(1).values):
        return ""
    return check_topk(got.cpu(), want.cpu(), False) or "differs"


SPEC = OpSpec("topk", check, reference, judge, tuple(cases),
              bench=BenchSpec("topk", bench_cases, bench_build, bench_call, bench_bytes, roofline="read_once",
                              same=same_topk, extras={"torch.topk": torch_topk}, floor=read_once), budgeted=True)
