"""translate: logical token positions → physical KV slots through a page table
(contract: :func:`indexcache.translate`). Its record's ``bench``: prefill rows sharing a request's table
row, decode rows and a token-level table, 12 bytes an index, checked exactly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch
from indexcache.hal.checks import INDEX, check_tensor, check_translate_inputs, output
from indexcache.hal.specs.base import I32, CaseList, OpSpec, Verdict, cpu, ints, not_written
from indexcache.hal.specs.bench import POISON, BenchCase, BenchSpec


def check(raw, page_table, seq_lens, page_size: int, *, row_to_batch=None, out=None) -> dict[str, Any]:
    check_tensor("raw", raw, (INDEX,), (None, None))
    device = raw.device
    check_translate_inputs(raw.shape, page_table, seq_lens, page_size, row_to_batch, device)
    inputs = dict(raw=raw, page_table=page_table, seq_lens=seq_lens, row_to_batch=row_to_batch)
    out = output("out", out, INDEX, tuple(raw.shape), device, inputs)
    return dict(raw=raw, page_table=page_table, seq_lens=seq_lens, page_size=page_size, row_to_batch=row_to_batch,
                out=out)


def reference(raw, page_table, seq_lens, page_size, *, row_to_batch=None) -> torch.Tensor:
    """Logical → physical slot, ``[R, K]`` int32; -1 wherever raw < 0, raw ≥ seq_lens[r], the page is beyond
    the table, the entry is < 0 or the row's batch is out of range."""
    raw, table, seq_lens = cpu(raw).long(), cpu(page_table).long(), cpu(seq_lens).long()
    rows, k = raw.shape
    batches, pages = table.shape
    r2b = torch.arange(rows) if row_to_batch is None else cpu(row_to_batch).long()
    out = torch.full((rows, k), -1, dtype=torch.int64)
    for r in range(rows):
        b = int(r2b[r])
        if not 0 <= b < batches:
            continue
        for j in range(k):
            x = int(raw[r, j])
            if x < 0 or x >= int(seq_lens[r]):
                continue
            page = x // page_size
            if page >= pages or int(table[b, page]) < 0:
                continue
            out[r, j] = int(table[b, page]) * page_size + x % page_size
    return out.int()


def judge(args: dict, got: torch.Tensor, want: torch.Tensor, accumulation: str) -> Verdict:
    """Exact equality, written into the given ``out``."""
    if detail := not_written(args, {"out": got}):
        return detail, None, None
    got = cpu(got)
    return ("" if torch.equal(got, want) else f"{int((got != want).sum())} slots differ"), None, None


cases = CaseList("translate")


def _args(gen, dev, rows, k, batches, pages, page_size, r2b=False, strided=False):
    span = pages * page_size
    raw = ints(gen, -3, span + page_size + 2, (rows, 2 * k if strided else k))
    table = ints(gen, -2, 4 * pages + 8, (batches, 2 * pages if strided else pages))
    seq = ints(gen, -2, span + 4, (rows,))
    args = dict(raw=raw.to(dev), page_table=table.to(dev), seq_lens=seq.to(dev), page_size=page_size)
    if strided:
        args["raw"], args["page_table"] = args["raw"][:, ::2], args["page_table"][:, ::2]
    if r2b:
        args["row_to_batch"] = ints(gen, -1, batches + 1, (rows,)).to(dev)
    return args


@cases.add("worked example, page 64")
def _(gen, dev):
    return dict(raw=torch.tensor([[0, 63, 64, -1]], dtype=I32, device=dev),
                page_table=torch.tensor([[10, 11]], dtype=I32, device=dev),
                seq_lens=torch.tensor([128], dtype=I32, device=dev), page_size=64)


@cases.add("worked example, holes and beyond seq_len")
def _(gen, dev):
    table = torch.tensor([[100, 101, 102, -1, 5, 6, 7, 8, 9]], dtype=I32, device=dev)
    return dict(raw=torch.tensor([[0, 63, 64, 127, 128, -1, 512]], dtype=I32, device=dev), page_table=table,
                seq_lens=torch.tensor([256], dtype=I32, device=dev), page_size=64)


for _ps in (1, 3, 16, 64, 65, 96, 100, 129, 200):
    cases.add(f"random guards, page {_ps}")(
        lambda gen, dev, ps=_ps: _args(gen, dev, rows=24, k=67, batches=24, pages=9, page_size=ps))


@cases.add("row_to_batch, prefill rows sharing a table, page 64")
def _(gen, dev):
    return _args(gen, dev, rows=40, k=33, batches=3, pages=6, page_size=64, r2b=True)


@cases.add("non-contiguous raw and table, page 32")
def _(gen, dev):
    return _args(gen, dev, rows=16, k=40, batches=16, pages=5, page_size=32, strided=True)


@cases.add("token-level table (page 1, req_to_token)")
def _(gen, dev):
    return _args(gen, dev, rows=8, k=100, batches=8, pages=300, page_size=1)


@cases.add("adversarial values (int32 extremes, huge lengths)")
def _(gen, dev):
    raw = torch.tensor([[2**31 - 1, -(2**31), -1, 0, 4095, 4096, 10**9]] * 3, dtype=I32)
    table = torch.tensor([[2**20, -(2**31), 2**31 - 1, 7]] * 2, dtype=I32)
    seq = torch.tensor([2**31 - 1, -5, 4096], dtype=I32)
    r2b = torch.tensor([0, 2**31 - 1, -(2**31)], dtype=I32)
    return dict(raw=raw.to(dev), page_table=table.to(dev), seq_lens=seq.to(dev), page_size=1024,
                row_to_batch=r2b.to(dev))


@cases.add("k = 0")
def _(gen, dev):
    return _args(gen, dev, rows=5, k=0, batches=5, pages=4, page_size=64)


@cases.add("rows = 0")
def _(gen, dev):
    return _args(gen, dev, rows=0, k=16, batches=2, pages=4, page_size=64)


@cases.add("empty page table")
def _(gen, dev):
    return _args(gen, dev, rows=4, k=8, batches=4, pages=0, page_size=64)


@cases.add("preallocated out")
def _(gen, dev):
    args = _args(gen, dev, rows=12, k=50, batches=12, pages=7, page_size=64)
    args["out"] = torch.full((12, 50), 12345, dtype=I32, device=dev)
    return args


# ----------------------------------------------------------------------------------------------- benchmark


def bench_cases(quick: bool) -> list[BenchCase]:
    r2b = "row_to_batch maps each query row to its request's table row (the table is not copied per row)"
    per_row = "one table row per query row (row_to_batch=None)"
    if quick:
        return [
            BenchCase("prefill 2x8 rows k64 page4", dict(requests=2, rows_per_request=8, k=64, page_size=4,
                                                         context=512), r2b),
            BenchCase("decode 4 rows k48 page3", dict(requests=4, rows_per_request=1, k=48, page_size=3, context=300),
                      per_row),
            BenchCase("token table 4 rows k64 page1", dict(requests=4, rows_per_request=1, k=64, page_size=1,
                                                           context=1024), per_row),
        ]
    ctx = 128 * 1024
    return [
        BenchCase("prefill 8x1024 rows k2048 page64 128K", dict(requests=8, rows_per_request=1024, k=2048,
                                                                page_size=64, context=ctx), r2b),
        BenchCase("decode 64 rows k2048 page64 128K", dict(requests=64, rows_per_request=1, k=2048, page_size=64,
                                                          context=ctx), per_row),
        BenchCase("decode 64 rows k512 page64 128K", dict(requests=64, rows_per_request=1, k=512, page_size=64,
                                                         context=ctx), per_row),
        BenchCase("token table 64 rows k2048 page1 128K", dict(requests=64, rows_per_request=1, k=2048, page_size=1,
                                                              context=ctx), per_row),
    ]


def bench_build(case: BenchCase, gen: torch.Generator) -> dict[str, Any]:
    """Requests whose pages are a random permutation of one pool; query rows are the last
    ``rows_per_request`` tokens of each request (causal), so every raw index is visible and valid."""
    p = case.params
    requests, per_request, k, page_size, context = (p[n] for n in ("requests", "rows_per_request", "k", "page_size",
                                                                   "context"))
    rows, pages = requests * per_request, -(-context // page_size)
    table = torch.randperm(requests * pages, generator=gen, dtype=torch.int32).view(requests, pages)
    first_len = context - per_request + 1
    seq_lens = (first_len + torch.arange(per_request, dtype=torch.int32)).repeat(requests)
    raw = torch.randint(0, first_len, (rows, k), generator=gen, dtype=torch.int32)
    row_to_batch = torch.arange(rows, dtype=torch.int32) // per_request if per_request > 1 else None
    out = torch.full((rows, k), POISON, dtype=torch.int32)
    return dict(raw=raw, page_table=table, seq_lens=seq_lens, page_size=page_size, row_to_batch=row_to_batch,
                out=out)


def bench_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    args = check(a["raw"], a["page_table"], a["seq_lens"], a["page_size"], row_to_batch=a["row_to_batch"],
                 out=a["out"])
    return dispatch.call("translate", args, backend)


def bench_bytes(case: BenchCase) -> int:
    """12 bytes an index: the raw index read, its table entry read, the result written."""
    p = case.params
    return 12 * p["requests"] * p["rows_per_request"] * p["k"]


SPEC = OpSpec("translate", check, reference, judge, tuple(cases),
              bench=BenchSpec("translate", bench_cases, bench_build, bench_call, bench_bytes))
