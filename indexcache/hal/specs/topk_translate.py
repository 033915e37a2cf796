"""topk_translate: :func:`indexcache.topk` then :func:`indexcache.translate` in one pass, the producer step
(contract: :func:`indexcache.topk_translate`). Its record's ``bench``: topk's shapes through a page-64 table,
set against one read of the scores; ``out_raw`` checked by index set and ``out`` as ``translate(out_raw)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch
from indexcache.hal.checks import (
    INDEX,
    check_bool,
    check_output,
    check_tensor,
    check_translate_inputs,
    check_workspace,
    output,
)
from indexcache.hal.specs import topk, translate
from indexcache.hal.specs.base import I32, ODD_PAGES, CaseList, OpSpec, Verdict, cpu, ints, not_written
from indexcache.hal.specs.bench import BASELINE, BenchCase, BenchSpec


def check(scores, lengths, k: int, page_table, page_size: int, *, row_starts=None, row_to_batch=None, out=None,
          out_raw=None, sorted: bool = False, workspace=None) -> dict[str, Any]:
    topk.check_inputs(scores, lengths, k, row_starts)
    device = scores.device
    check_translate_inputs(scores.shape, page_table, lengths, page_size, row_to_batch, device)
    inputs = dict(scores=scores, lengths=lengths, page_table=page_table, row_starts=row_starts,
                  row_to_batch=row_to_batch)
    out = check_outputs(out, out_raw, (scores.shape[0], k), device, inputs)
    check_workspace(workspace, device, dict(inputs, out=out, out_raw=out_raw))
    return dict(scores=scores, lengths=lengths, k=k, page_table=page_table, page_size=page_size,
                row_starts=row_starts, row_to_batch=row_to_batch, out=out, out_raw=out_raw,
                sorted=check_bool("sorted", sorted), workspace=workspace)


def check_outputs(out, out_raw, shape: tuple[int, int], device: torch.device, inputs: dict) -> torch.Tensor:
    """``out`` (a new one when None) and ``out_raw`` (or None): int32 ``shape`` on ``device``, sharing no memory
    with ``inputs``, each other or themselves. Returns ``out``."""
    out = output("out", out, INDEX, shape, device, dict(inputs, out_raw=out_raw))
    if out_raw is not None:
        check_tensor("out_raw", out_raw, (INDEX,), shape, device)
        check_output("out_raw", out_raw, inputs)
    return out


def reference(scores, lengths, k, page_table, page_size, *, row_starts=None, row_to_batch=None):
    """``(physical, raw)``: :func:`topk` then :func:`translate` through the page table by ``lengths``."""
    raw = topk.reference(scores, lengths, k, row_starts=row_starts)
    return translate.reference(raw, page_table, lengths, page_size, row_to_batch=row_to_batch), raw


def _rows_as_sets(idx: torch.Tensor) -> list[list[int]]:
    """Each row's entries but -1 (empty slots), sorted: any other negative value stays, so it differs."""
    return [sorted(v for v in row if v != -1) for row in idx.tolist()]


def judge(args: dict, got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor], accumulation: str) -> Verdict:
    """With ``out_raw``: ``out_raw`` judged like :func:`indexcache.topk`, and ``out`` exactly
    ``translate(out_raw)``. Without: per row the same physical slots (in order when sorted). Written into the given
    ``out``."""
    if detail := not_written(args, {"out": got}):
        return detail, None, None
    got = cpu(got)
    want_phys, want_raw = want
    sort = args.get("sorted", False)
    if args.get("out_raw") is None:
        if sort:
            return topk.check_topk(got, want_phys, True), None, None
        # Order is unspecified: compare the physical sets row by row.
        if got.shape != want_phys.shape:
            return f"shape {list(got.shape)}, expected {list(want_phys.shape)}", None, None
        sets_got, sets_want = _rows_as_sets(got), _rows_as_sets(want_phys)
        bad = [r for r, (a, b) in enumerate(zip(sets_got, sets_want, strict=True)) if a != b]
        return (f"rows {bad[:5]} differ" if bad else ""), None, None
    raw = cpu(args["out_raw"])
    if detail := topk.check_topk(raw, want_raw, sort):
        return f"out_raw: {detail}", None, None
    again = translate.reference(raw, cpu(args["page_table"]), cpu(args["lengths"]), args["page_size"],
                                row_to_batch=cpu(args.get("row_to_batch")))
    return ("" if torch.equal(got, again) else "out is not translate(out_raw)"), None, None


cases = CaseList("topk_translate")


def _args(gen, dev, rows, cols, k, page_size, batches=None, dtype=torch.float32):
    args = topk.args_of(gen, dev, topk.scores_of(gen, rows, cols, dtype=dtype), k)
    batches = batches or rows
    pages = -(-cols // page_size) + 1
    args["page_table"] = ints(gen, -1, 50 * pages, (batches, pages)).to(dev)
    args["page_size"] = page_size
    if batches != rows:
        args["row_to_batch"] = ints(gen, 0, batches, (rows,)).to(dev)
    return args


@cases.add("page 64 with out_raw")
def _(gen, dev):
    args = _args(gen, dev, 8, 3000, 128, 64)
    args["out_raw"] = torch.full((8, 128), 999, dtype=I32, device=dev)
    return args


def _empty_slots(args: dict, lengths: list[int], pages: int, low_row: int, low: float) -> dict:
    """``args`` (page 1) with rows whose top-k holds -1: ``lengths`` (rows shorter than k), row ``low_row``'s scores
    below ``low`` -inf or NaN (fewer finite ones than k), and a table of ``pages`` entries a batch (positions past
    it have none) with entries < 0 (every 9th -1, every 13th from the 5th -5)."""
    dev = args["scores"].device
    scores = args["scores"].cpu()
    row = scores[low_row]
    scores[low_row] = row.masked_fill(row < low, float("-inf")).masked_fill(row < low - 2, float("nan"))
    table = args["page_table"].cpu()[:, :pages].clone()
    table[:, ::9] = -1
    table[:, 4::13] = -5
    return dict(args, scores=scores.to(dev), lengths=torch.tensor(lengths, dtype=I32, device=dev),
                page_table=table.to(dev))


@cases.add("page 1 token table, no out_raw, empty slots: rows shorter than k, -inf and NaN scores, entries < 0 "
           "and positions past the table")
def _(gen, dev):
    return _empty_slots(_args(gen, dev, 6, 1500, 100, 1), [777, 40, 0, 1500, 100, 362], 1200, 5, 1.5)


@cases.add("page 48 (not a power of two), row_to_batch, ties")
def _(gen, dev):
    args = _args(gen, dev, 10, 2000, 77, 48, batches=3)
    args["scores"] = args["scores"].round()
    args["out_raw"] = torch.empty((10, 77), dtype=I32, device=dev)
    return args


for _ps in ODD_PAGES:
    cases.add(f"page {_ps} (not a multiple of the 64-key tile), out_raw")(
        lambda gen, dev, ps=_ps: dict(_args(gen, dev, 4, 3 * ps + 5, 96, ps),
                                      out_raw=torch.empty((4, 96), dtype=I32, device=dev)))


@cases.add("bfloat16, row_starts, page 64")
def _(gen, dev):
    args = _args(gen, dev, 6, 2500, 200, 64, dtype=torch.bfloat16)
    args["row_starts"] = ints(gen, 0, 600, (6,)).to(dev)
    args["out_raw"] = torch.empty((6, 200), dtype=I32, device=dev)
    return args


@cases.add("sorted, page 64 with out_raw, ties")
def _(gen, dev):
    args = _args(gen, dev, 8, 3000, 300, 64)
    args["scores"] = args["scores"].round()
    args["out_raw"] = torch.full((8, 300), 999, dtype=I32, device=dev)
    args["sorted"] = True
    return args


@cases.add("sorted, page 1, no out_raw, row_starts, empty slots: rows shorter than k, -inf and NaN scores, entries "
           "< 0 and positions past the table")
def _(gen, dev):
    args = _empty_slots(_args(gen, dev, 6, 2000, 128, 1), [1492, 60, 0, 1400, 128, 725], 1300, 5, 1.5)
    args["row_starts"] = ints(gen, 0, 600, (6,)).to(dev)
    args["sorted"] = True
    return args

# ----------------------------------------------------------------------------------------------- benchmark


def bench_call(a: Mapping[str, Any], backend: str) -> tuple:
    args = check(a["scores"], a["lengths"], a["k"], a["page_table"], a["page_size"], out=a["out"],
                 out_raw=a["out_raw"])
    return dispatch.call("topk_translate", args, backend), a["out_raw"], a


def bench_bytes(case: BenchCase) -> int:
    """The scores read once; raw and physical int32 results written, a table entry read for each."""
    p = case.params
    return 4 * p["rows"] * p["cols"] + 12 * p["rows"] * p["k"]


def same_topk_translate(got: tuple, want: tuple, case: BenchCase) -> str:
    """``out_raw`` has each row's index set, and ``out`` is ``translate(out_raw)`` slot by slot (translate
    by the torch backend, itself checked exactly against the reference by the conformance suite)."""
    phys, raw, a = got
    if detail := topk.same_topk(raw, want[1]):
        return f"out_raw: {detail}"
    again = dispatch.call("translate", translate.check(raw, a["page_table"], a["lengths"], a["page_size"]), BASELINE)
    return "" if torch.equal(phys, again) else "out is not translate(out_raw)"


SPEC = OpSpec("topk_translate", check, reference, judge, tuple(cases),
              bench=BenchSpec("topk_translate", topk.bench_cases, topk.bench_build, bench_call, bench_bytes,
                              roofline="read_once", same=same_topk_translate, floor=topk.read_once), budgeted=True)
