"""paged_topk_translate: :func:`indexcache.paged_mqa_logits` then :func:`indexcache.topk_translate` on its rows,
the producer step of decode in one op (contract: :func:`indexcache.paged_topk_translate`). Judged on the logits
(paged_mqa_logits' rule) and on the top-k of the logits the backend itself returned (topk_translate's rule), so
a near-tie the logits' rounding flips is no failure. Its record's ``bench``: paged_mqa_logits' shapes selecting
k 2048 (quick: 64) through a page-64 table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch, fp4
from indexcache.hal.checks import INDEX, check_k, check_page_size, check_tensor, check_workspace, output
from indexcache.hal.layout import split_packed_cache
from indexcache.hal.specs import mqa_logits, paged_mqa_logits, topk, topk_translate, translate
from indexcache.hal.specs.base import E4M3, I32, CaseList, OpSpec, Verdict, cpu, ints
from indexcache.hal.specs.bench import BASELINE, POISON, BenchCase, BenchSpec

# The arguments of the logits part, as paged_mqa_logits takes them (its page_table is the block_table here).
LOGITS_ARGS = ("q", "k_cache", "weights", "context_lens", "block_table", "max_context_len")


def check(q, k_cache, weights, context_lens, block_table, max_context_len: int, k: int, page_table, page_size: int,
          *, logits=None, out=None, out_raw=None, workspace=None, k_format: torch.dtype | None = None,
          row_to_batch=None, q_scale=None) -> dict[str, Any]:
    paged_mqa_logits.check_inputs(q, k_cache, weights, context_lens, block_table, max_context_len,
                                  table="block_table", k_format=k_format, row_to_batch=row_to_batch, q_scale=q_scale)
    batch, next_n = q.shape[:2]
    device = q.device
    check_k(k)
    check_tensor("page_table", page_table, (INDEX,), (batch if row_to_batch is None else None, None), device)
    check_page_size(page_size)
    inputs = dict(q=q, k_cache=k_cache, weights=weights, context_lens=context_lens, block_table=block_table,
                  page_table=page_table, row_to_batch=row_to_batch, q_scale=q_scale)
    logits = output("logits", logits, torch.float32, (batch * next_n, max_context_len), device,
                    dict(inputs, out=out, out_raw=out_raw))
    out = topk_translate.check_outputs(out, out_raw, (batch * next_n, k), device, dict(inputs, logits=logits))
    check_workspace(workspace, device, dict(inputs, logits=logits, out=out, out_raw=out_raw))
    return dict(q=q, k_cache=k_cache, weights=weights, context_lens=context_lens, block_table=block_table,
                max_context_len=max_context_len, k=k, page_table=page_table, page_size=page_size, logits=logits,
                out=out, out_raw=out_raw, workspace=workspace, k_format=k_format, row_to_batch=row_to_batch,
                q_scale=q_scale)


def rows_of(context_lens: torch.Tensor, next_n: int,
            row_to_batch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per logits row ``r = b * next_n + j``: its visible length ``context_lens[b] - next_n + 1 + j`` (int32,
    negative clamped to 0) and its request ``b`` (int32; None when ``next_n`` is 1: row r is request r). Ragged rows
    (``row_to_batch`` given): ``context_lens[r]`` clamped, and ``row_to_batch``."""
    if row_to_batch is not None:
        return context_lens.clamp_min(0).to(I32), row_to_batch
    row = torch.arange(context_lens.shape[0] * next_n, device=context_lens.device)
    lengths = (context_lens.long()[row // next_n] - next_n + 1 + row % next_n).clamp_min(0).to(I32)
    return lengths, None if next_n == 1 else (row // next_n).to(I32)


def needs_logits(context_lens: torch.Tensor, next_n: int, max_context_len: int, k: int,
                 row_to_batch: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows]`` bool: the logits rows a backend must write, those of a request (a ragged row) whose context clipped
    to ``[0, max_context_len]`` is longer than ``k`` (the others the top-k selects without reading: docs/ops.md,
    "Short rows")."""
    long = context_lens.long().clamp(0, max_context_len) > k
    return long if row_to_batch is not None else long.repeat_interleave(next_n)


def reference(q, k_cache, weights, context_lens, block_table, max_context_len, k, page_table, page_size,
              k_format=None, row_to_batch=None, q_scale=None):
    """``(physical, raw)`` as :func:`topk_translate.reference <indexcache.hal.specs.topk_translate.reference>`
    gives them for the paged logits, each row's visible length and its request's table row."""
    logits = paged_mqa_logits.reference(q, k_cache, weights, context_lens, block_table, max_context_len, k_format,
                                        row_to_batch, q_scale)
    lengths, rows = rows_of(cpu(context_lens), q.shape[1], cpu(row_to_batch))
    return topk_translate.reference(logits, lengths, k, page_table, page_size, row_to_batch=rows)


def _written(args: Mapping[str, Any], logits: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``logits`` with the rows a backend may leave unwritten (:func:`needs_logits`) taken from ``want``: only the
    others are judged (the top-k of a short row reads neither)."""
    skipped = ~needs_logits(cpu(args["context_lens"]), args["q"].shape[1], args["max_context_len"], args["k"],
                            args.get("row_to_batch"))
    if not skipped.any():
        return logits
    logits, skipped = logits.clone(), skipped.to(logits.device)
    logits[skipped] = want.to(logits.device)[skipped].to(logits.dtype)
    return logits


def judge(args: dict, got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor], accumulation: str) -> Verdict:
    """The ``logits`` buffer judged like :func:`indexcache.paged_mqa_logits` (the bound of its accumulation);
    ``out`` / ``out_raw`` like :func:`indexcache.topk_translate` against the reference top-k of *those* logits,
    not of the float64 ones in ``want`` (the bound lets a near-tie flip). Cases give ``logits``: it is read."""
    want_logits = paged_mqa_logits.reference(*(cpu(args[name]) for name in LOGITS_ARGS), args.get("k_format"),
                                             cpu(args.get("row_to_batch")), cpu(args.get("q_scale")))
    returned = _written(args, cpu(args["logits"]), want_logits)
    detail, err, bound = mqa_logits.judge_values(args, returned, want_logits, accumulation)
    if detail:
        return f"logits: {detail}", err, bound
    lengths, row_to_batch = rows_of(cpu(args["context_lens"]), args["q"].shape[1], cpu(args.get("row_to_batch")))
    page_table = cpu(args["page_table"])
    again = topk_translate.reference(returned, lengths, args["k"], page_table, args["page_size"],
                                     row_to_batch=row_to_batch)
    composed = dict(lengths=lengths, page_table=page_table, page_size=args["page_size"], row_to_batch=row_to_batch,
                    out=args.get("out"), out_raw=args.get("out_raw"))
    detail = topk_translate.judge(composed, got, again, accumulation)[0]
    return (f"top-k of the returned logits: {detail}" if detail else ""), err, bound


cases = CaseList("paged_topk_translate")


def _args(gen, dev, fp8, batch, next_n, index_page, context, k, page_size, *, raw=True, holes=False,
          pages_per_req=None, k_format=None):
    """paged_mqa_logits' inputs (``index_page`` tokens a cache page; ``k_format`` as there), a KV
    ``page_table [batch, *]`` of ``page_size`` with holes, a NaN-filled ``logits`` buffer, and ``out_raw`` when
    ``raw``."""
    args = paged_mqa_logits.args_of(gen, "cpu", batch, next_n, 16, index_page, context, dtype=fp8, holes=holes,
                                  pages_per_req=pages_per_req, k_format=k_format)
    args["block_table"] = args.pop("page_table")
    rows, cols = batch * next_n, args["max_context_len"]
    pages = -(-cols // page_size) + 1
    table = ints(gen, 0, 50 * pages, (batch, pages))
    table[:, 2::5] = -1
    args.update(k=k, page_table=table, page_size=page_size, logits=torch.full((rows, cols), float("nan")))
    if raw:
        args["out_raw"] = torch.full((rows, k), POISON, dtype=I32)
    return {name: v.to(dev) if isinstance(v, torch.Tensor) else v for name, v in args.items()}


@cases.add("decode, index page 64, KV page 64, out_raw, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return _args(gen, dev, fp8, 3, 1, 64, [300, 40, 257], 64, 64)


@cases.add("decode, KV page 1 (token table), no out_raw, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return _args(gen, dev, fp8, 3, 1, 64, [300, 1, 257], 50, 1, raw=False)


@cases.add("speculative verify next_n 2, index page 48, KV page 64, short rows, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return _args(gen, dev, fp8, 3, 2, 48, [200, 2, 70], 96, 64)


@cases.add("next_n 2, KV page 1, no out_raw, context length 0 and contexts beyond the table, native fp8",
           native_fp8=True)
def _(gen, dev, fp8):
    return _args(gen, dev, fp8, 3, 2, 64, [0, 10**6, 100], 40, 1, raw=False, pages_per_req=2)


@cases.add("block table with holes and entries beyond the cache, KV page 48, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return _args(gen, dev, fp8, 2, 2, 32, [250, 190], 70, 48, holes=True)


@cases.add("ties: constant weights and one key repeated, next_n 2, KV page 64, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = _args(gen, dev, fp8, 2, 2, 64, [180, 129], 33, 64)
    args["weights"].fill_(1 / 16)
    for part in split_packed_cache(args["k_cache"], 128, torch.uint8):  # every token of a page is its first
        part.copy_(part[:, :1].expand_as(part).clone())
    return args


@cases.add("MXFP4 cache (k_format), speculative verify next_n 2, index page 64 with holes, KV page 64, native fp8 q",
           native_fp8=True)
def _(gen, dev, fp8):
    return _args(gen, dev, fp8, 2, 2, 64, [250, 190], 70, 64, holes=True, k_format=fp4.FP4)


@cases.add("MXFP4 queries and cache, speculative verify next_n 2, index page 64 with holes, KV page 64")
def _(gen, dev):
    return paged_mqa_logits.with_mxfp4_queries(gen, _args(gen, dev, E4M3, 2, 2, 64, [250, 190], 70, 64, holes=True,
                                                          k_format=fp4.FP4))


@cases.add("MXFP4 queries and cache, short and long requests mixed (contexts at, past and below k), index page 17, "
           "next_n 2, KV page 48")
def _(gen, dev):
    return paged_mqa_logits.with_mxfp4_queries(gen, _args(gen, dev, E4M3, 4, 2, 17, [300, 64, 65, 5], 64, 48,
                                                          k_format=fp4.FP4))


def _ragged(gen, dev, fp8, drafts, context, k, page_size, *, stray=False, k_format=None):
    """paged_mqa_logits' ragged rows (:func:`paged_mqa_logits.ragged_args`), a KV ``page_table`` of a row a request
    with holes, a NaN-filled ``logits`` buffer and ``out_raw``."""
    args = paged_mqa_logits.ragged_args(gen, "cpu", fp8, drafts, context, k_format=k_format, stray=stray)
    args["block_table"] = args.pop("page_table")
    rows, cols = args["q"].shape[0], args["max_context_len"]
    pages = -(-cols // page_size) + 1
    table = ints(gen, 0, 50 * pages, (len(context), pages))
    table[:, 2::5] = -1
    args.update(k=k, page_table=table, page_size=page_size, logits=torch.full((rows, cols), float("nan")),
                out_raw=torch.full((rows, k), POISON, dtype=I32))
    return {name: v.to(dev) if isinstance(v, torch.Tensor) else v for name, v in args.items()}


cases.add("ragged rows: 1 to 8 draft tokens a request, shuffled, rows naming no request, KV page 64, native fp8",
          native_fp8=True)(
    lambda gen, dev, fp8: _ragged(gen, dev, fp8, [1, 8, 3, 2], [300, 9, 200, 64], 96, 64, stray=True))
cases.add("ragged rows on an MXFP4 cache, KV page 1, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: _ragged(gen, dev, fp8, [3, 1, 5], [150, 70, 130], 64, 1, k_format=fp4.FP4))

cases.add("short rows: every context at most k (max_context_len <= k), next_n 2, index page 64, KV page 48, "
          "native fp8", native_fp8=True)(
    lambda gen, dev, fp8: _args(gen, dev, fp8, 4, 2, 64, [96, 0, 57, 130], 192, 48))
cases.add("short and long requests mixed, k at a request's context and one past it, next_n 2, index page 32, "
          "KV page 64, native fp8", native_fp8=True)(
    lambda gen, dev, fp8: _args(gen, dev, fp8, 5, 2, 32, [300, 64, 65, 20, 190], 64, 64))
cases.add("ragged rows: 1 to 8 draft tokens, short and long requests mixed, KV page 48, native fp8",
          native_fp8=True)(
    lambda gen, dev, fp8: _ragged(gen, dev, fp8, [1, 8, 2, 5, 3], [300, 40, 130, 260, 97], 100, 48))
cases.add("ragged rows, every row at most k (max_context_len <= k), KV page 1, native fp8", native_fp8=True)(
    lambda gen, dev, fp8: _ragged(gen, dev, fp8, [2, 1, 3], [60, 5, 80], 128, 1))

# ----------------------------------------------------------------------------------------------- benchmark


def bench_cases(quick: bool) -> list[BenchCase]:
    """paged_mqa_logits' shapes, selecting k 2048 (quick: 64) through a page-64 KV table."""
    k = 64 if quick else 2048
    return [BenchCase(f"{c.name} k{k}", dict(c.params, k=k)) for c in paged_mqa_logits.bench_cases(quick)]


def bench_build(case: BenchCase, gen: torch.Generator) -> dict[str, Any]:
    """paged_mqa_logits' inputs with a fresh random scale for every token (its cache repeats a block of pages, so
    its logits would repeat every few thousand keys: a top-k over them sees a few thousand distinct values, each
    several times); a KV table of randomly permuted pages; outputs poisoned."""
    args = paged_mqa_logits.bench_build(case, gen)
    scales = split_packed_cache(args["k_cache"], case.params["dim"], E4M3)[1]
    scales.copy_(torch.rand(scales.shape, generator=gen) * 0.01 + 1e-3)
    p = case.params
    batch, rows, k = p["batch"], p["batch"] * p["next_n"], p["k"]
    pages = -(-p["context"] // p["page_size"])
    table = torch.randperm(batch * pages, generator=gen, dtype=torch.int32).view(batch, pages)
    return dict(args, block_table=args.pop("page_table"), logits=args.pop("out"), k=k, page_table=table,
                page_size=p["page_size"], out=torch.full((rows, k), POISON, dtype=I32),
                out_raw=torch.full((rows, k), POISON, dtype=I32))


def bench_bytes(case: BenchCase) -> int:
    """paged_mqa_logits' bytes, the logits read once more, raw and physical int32 results written and a table
    entry read for each."""
    p = case.params
    rows = p["batch"] * p["next_n"]
    return paged_mqa_logits.bench_bytes(case) + 4 * rows * p["context"] + 12 * rows * p["k"]


def bench_call(a: Mapping[str, Any], backend: str) -> tuple:
    args = check(*(a[name] for name in LOGITS_ARGS), a["k"], a["page_table"], a["page_size"], logits=a["logits"],
                 out=a["out"], out_raw=a["out_raw"])
    return dispatch.call("paged_topk_translate", args, backend), a["out_raw"], a


def same_paged_topk_translate(got: tuple, want: tuple, case: BenchCase) -> str:
    """The logits as :func:`mqa_logits.same_logits <indexcache.hal.specs.mqa_logits.same_logits>` against the
    torch backend's; ``out_raw`` the index sets the torch backend's topk selects from *these* logits, and
    ``out`` exactly ``translate(out_raw)`` (the torch backend's, itself checked exactly by conformance)."""
    phys, raw, a = got
    if detail := mqa_logits.same_logits(_written(a, a["logits"], want[2]["logits"]), want[2]["logits"], case):
        return f"logits: {detail}"
    lengths, row_to_batch = rows_of(a["context_lens"], a["q"].shape[1])
    again = dispatch.call("topk", topk.check(a["logits"], lengths, a["k"]), BASELINE)
    if detail := topk.same_topk(raw, again):
        return f"out_raw: {detail}"
    slots = dispatch.call("translate", translate.check(raw, a["page_table"], lengths, a["page_size"],
                                                       row_to_batch=row_to_batch), BASELINE)
    return "" if torch.equal(phys, slots) else "out is not translate(out_raw)"


SPEC = OpSpec("paged_topk_translate", check, reference, judge, tuple(cases),
              bench=BenchSpec("paged_topk_translate", bench_cases, bench_build, bench_call, bench_bytes,
                              same=same_paged_topk_translate), budgeted=True)
