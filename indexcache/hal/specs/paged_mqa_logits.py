"""paged_mqa_logits: paged decode / speculative-verify indexer logits over the packed fp8 or MXFP4 cache
(contract: :func:`indexcache.paged_mqa_logits`). Its record's ``bench``: 32K and 128K contexts, next_n 1 and 2,
132 bytes a cached token read, checked like mqa_logits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch, fp4
from indexcache.hal.checks import INDEX, check_cache, check_int, check_tensor, output
from indexcache.hal.layout import FP8_DTYPES, new_packed_cache, split_packed_cache
from indexcache.hal.shown import dims
from indexcache.hal.specs import mqa_logits, store_index_k
from indexcache.hal.specs.base import E4M3, E4M3_FNUZ, I32, ODD_PAGES, CaseList, OpSpec, cpu, to_fp8
from indexcache.hal.specs.bench import DIM, HEADS, PAGE, BenchCase, BenchSpec


def key_format(q: torch.Tensor, k_format: torch.dtype | None) -> torch.dtype:
    """The format of the cache's keys: ``q``'s fp8 format where ``k_format`` is None, else ``k_format`` (MXFP4)."""
    return q.dtype if k_format is None else k_format


def check_inputs(q, k_cache, weights, context_lens, page_table, max_context_len, table: str = "page_table",
                 k_format=None, row_to_batch=None, q_scale=None) -> None:
    """The inputs as :func:`check` takes them; ``table`` is the name errors give ``page_table`` (the index-K
    cache's table). With ``row_to_batch`` (ragged rows) ``q`` holds one token a row and the table any number of
    requests. MXFP4 queries (``q [B, next_n, H, D / 2]`` with ``q_scale [B, next_n, H, D / 32]``) take an MXFP4
    cache."""
    if k_format is not None and not (isinstance(k_format, torch.dtype) and k_format == fp4.FP4):
        raise TypeError(f"k_format: expected None (the cache holds q's fp8 format) or torch.float4_e2m1fn_x2 "
                        f"(MXFP4 keys), got {k_format!r}")
    check_tensor("q", q, (*FP8_DTYPES, fp4.FP4), (None, None, None, None))
    if q.dtype == fp4.FP4 and k_format is None:
        raise TypeError("k_format: MXFP4 queries (float4_e2m1fn_x2) read an MXFP4 cache only: expected "
                        "k_format=torch.float4_e2m1fn_x2, got None")
    keys = key_format(q, k_format)
    mqa_logits.check_queries(q, q_scale, keys)
    batch, next_n, heads = q.shape[:3]
    dim = fp4.head_dim(q)
    device = q.device
    check_cache(k_cache, "q", dim, device, keys)
    check_tensor("weights", weights, (torch.float32,), (batch * next_n, heads), device)
    check_tensor("context_lens", context_lens, (INDEX,), (batch,), device)
    if row_to_batch is None:
        check_tensor(table, page_table, (INDEX,), (batch, None), device)
    else:
        if next_n != 1:
            raise ValueError(f"q: expected one token a row, shape [R, 1, H, D], with row_to_batch (ragged rows), got "
                             f"shape {dims(q.shape)}")
        check_tensor(table, page_table, (INDEX,), (None, None), device)
        check_tensor("row_to_batch", row_to_batch, (INDEX,), (batch,), device)
    check_int("max_context_len", max_context_len, 0)


def check(q, k_cache, weights, context_lens, page_table, max_context_len: int, *, out=None,
          k_format: torch.dtype | None = None, row_to_batch=None, q_scale=None) -> dict[str, Any]:
    check_inputs(q, k_cache, weights, context_lens, page_table, max_context_len, k_format=k_format,
                 row_to_batch=row_to_batch, q_scale=q_scale)
    batch, next_n = q.shape[:2]
    device = q.device
    out = output("out", out, torch.float32, (batch * next_n, max_context_len), device,
                 dict(q=q, k_cache=k_cache, weights=weights, context_lens=context_lens, page_table=page_table,
                      row_to_batch=row_to_batch, q_scale=q_scale))
    return dict(q=q, k_cache=k_cache, weights=weights, context_lens=context_lens, page_table=page_table,
                max_context_len=max_context_len, out=out, k_format=k_format, row_to_batch=row_to_batch,
                q_scale=q_scale)


def reference(q, k_cache, weights, context_lens, page_table, max_context_len, k_format=None,
              row_to_batch=None, q_scale=None) -> torch.Tensor:
    """Paged decode logits ``[B * next_n, max_context_len]`` float64.

    Row ``b * next_n + j`` sees keys ``0 .. context_lens[b] - next_n + j`` of table row ``b``; ragged rows
    (``row_to_batch``, next_n 1): row ``r`` sees keys ``0 .. context_lens[r] - 1`` of table row ``row_to_batch[r]``
    (none where that is not a row of the table). Keys past that, keys whose page lies beyond the table and keys
    whose table entry is < 0 or beyond the cache are -inf. An MXFP4 cache's keys are decoded with their block
    scales (:func:`fp4.dequantize`), a scale of 1 a token; MXFP4 queries with ``q_scale``.
    """
    fmt = key_format(q, k_format)
    q = mqa_logits.query_values(q, q_scale)
    batch, next_n, heads, dim = q.shape
    keys, scales = split_packed_cache(cpu(k_cache), dim, fmt)
    num_pages, page_size = keys.shape[:2]
    if k_format is not None:
        keys = fp4.dequantize(keys.reshape(-1, dim // 2), scales.reshape(-1, dim // fp4.BLOCK))
        keys, scales = keys.view(num_pages, page_size, dim), torch.ones(num_pages, page_size, dtype=torch.float64)
    table, context_lens = cpu(page_table).long(), cpu(context_lens).long()
    weights = cpu(weights).double().view(batch, next_n, heads)
    out = torch.full((batch * next_n, max_context_len), float("-inf"), dtype=torch.float64)
    requests = cpu(row_to_batch).tolist() if row_to_batch is not None else range(batch)
    for b, tb in enumerate(requests):
        if not 0 <= tb < table.shape[0]:
            continue
        for j in range(next_n):
            visible = min(int(context_lens[b]) - next_n + j + 1, max_context_len)
            for s in range(max(visible, 0)):
                page = s // page_size
                if page >= table.shape[1] or not 0 <= int(table[tb, page]) < num_pages:
                    continue
                slot = (int(table[tb, page]), s % page_size)
                dots = (q[b, j] @ keys[slot].double()).clamp_min(0)
                out[b * next_n + j, s] = (dots * weights[b, j]).sum() * float(scales[slot])
    return out


cases = CaseList("paged_mqa_logits")


def args_of(gen, dev, batch, next_n, heads, page_size, context, dtype=E4M3, holes=False, pages_per_req=None,
          last_page=False, dim=128, k_format=None, block_spread=0):
    """``last_page``: request 0's first table entry is the cache's last page, so a key tile that crosses that
    page's end inside the context reads past the tensor. ``k_format`` MXFP4: the cache holds MXFP4 keys (each
    token's keys scaled by its own power of two first, so the block scales vary) and the arguments name it;
    ``block_spread``: besides, every fifth token of the cache's even pages has each block of 32 scaled by its own
    power of two up to ``2 ** ±block_spread`` (block scales far apart within a key)."""
    pages_per_req = pages_per_req or max(1, -(-max(context) // page_size))
    num_pages = batch * pages_per_req + 3
    k = torch.randn(num_pages * page_size, dim, generator=gen) * 3
    if k_format is not None:
        k *= torch.exp2(torch.randint(-6, 6, (k.shape[0], 1), generator=gen).float())
    if block_spread:
        token = torch.arange(k.shape[0])
        far = ((token // page_size) % 2 == 0) & (token % 5 == 0)
        blocks = torch.exp2(torch.randint(-block_spread, block_spread + 1, (k.shape[0], dim // 32), generator=gen))
        k = torch.where(far[:, None], (k.view(-1, dim // 32, 32) * blocks[..., None]).view(-1, dim), k)
    cache = new_packed_cache(num_pages, page_size, dim, fp8_dtype=k_format or dtype)
    cache = store_index_k.reference(k, cache, torch.arange(num_pages * page_size, dtype=I32), k_format or dtype)
    table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_req].view(batch, pages_per_req).to(I32)
    if last_page:
        table[table == num_pages - 1] = table[0, 0].item()
        table[0, 0] = num_pages - 1
    if holes:
        table[:, 1::3] = -1
        table[0, 0] = num_pages + 5
    q = to_fp8(torch.randn(batch, next_n, heads, dim, generator=gen) * 3, dtype)
    weights = torch.randn(batch * next_n, heads, generator=gen) / heads
    lens = torch.tensor(context, dtype=I32)
    max_len = pages_per_req * page_size
    args = dict(q=q.to(dev), k_cache=cache.to(dev), weights=weights.to(dev), context_lens=lens.to(dev),
                page_table=table.to(dev), max_context_len=max_len)
    return args if k_format is None else dict(args, k_format=k_format)


for _ps in (16, 32, 64, 128):
    cases.add(f"decode, page {_ps}, native fp8", native_fp8=True)(
        lambda gen, dev, fp8, ps=_ps: args_of(gen, dev, 3, 1, 32, ps, [300, 1, 257], dtype=fp8))

for _ps in ODD_PAGES:
    cases.add(f"page {_ps} (not a multiple of the 64-key tile), the cache's last page first, next_n 2, "
              "native fp8", native_fp8=True)(
        lambda gen, dev, fp8, ps=_ps: args_of(gen, dev, 2, 2, 16, ps, [3 * ps, ps + 7], dtype=fp8, last_page=True))

for _nn in (2, 3, 4):
    cases.add(f"speculative verify, next_n {_nn}, page 64, native fp8", native_fp8=True)(
        lambda gen, dev, fp8, nn=_nn: args_of(gen, dev, 3, nn, 16, 64, [200, nn, 129], dtype=fp8))


@cases.add("page table with holes and entries beyond the cache, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return args_of(gen, dev, 2, 2, 16, 32, [250, 190], dtype=fp8, holes=True)


@cases.add("logits into a given out (NaN before), next_n 2, page 64, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = args_of(gen, dev, 2, 2, 16, 64, [300, 130], dtype=fp8)
    return dict(args, out=torch.full((4, args["max_context_len"]), float("nan"), device=dev))


@cases.add("context length 0 and contexts beyond the table, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return args_of(gen, dev, 3, 1, 8, 64, [0, 10**6, 64], dtype=fp8, pages_per_req=2)


def _nan_args(gen, dev, fp8, k_format=None, block_spread=0):
    """Two requests, next_n 2, page 64: a NaN and an inf key at position 10 of each (the cache's scale NaN: the
    token's, or MXFP4 the block's) and a NaN weight."""
    args = {name: t.cpu() if isinstance(t, torch.Tensor) else t
            for name, t in args_of(gen, dev, 2, 2, 16, 64, [150, 100], dtype=fp8, k_format=k_format,
                                   block_spread=block_spread).items()}
    bad = torch.randn(2, 128, generator=gen)
    bad[0, 3], bad[1, 0] = float("nan"), float("inf")
    slots = (args["page_table"][:, 0].long() * 64 + 10).to(I32)  # position 10 of each request
    args["k_cache"] = store_index_k.reference(bad, args["k_cache"], slots, k_format or fp8)
    args["weights"][3, 0] = float("nan")
    return {name: t.to(dev) if isinstance(t, torch.Tensor) else t for name, t in args.items()}


cases.add("NaN key (scale NaN in the cache) and NaN weights propagate, native fp8", native_fp8=True)(_nan_args)


@cases.add("fp8 e4m3fnuz cache, H 64")
def _(gen, dev):
    return args_of(gen, dev, 2, 1, 64, 64, [190, 64], dtype=E4M3_FNUZ)


@cases.add("DeepGEMM's 4-D cache view, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = args_of(gen, dev, 2, 1, 16, 64, [100, 128], dtype=fp8)
    args["k_cache"] = args["k_cache"].view(args["k_cache"].shape[0], 64, 1, 132)
    return args


def ragged_args(gen, dev, fp8, drafts, context, page_size=64, heads=16, k_format=None, stray=False):
    """Ragged rows: request ``b`` (of ``context[b]`` keys) verifies ``drafts[b]`` tokens, row ``j`` of them seeing
    ``context[b] - drafts[b] + 1 + j`` keys; the rows shuffled, each naming its request (``row_to_batch``).
    ``stray``: besides, two rows name no request of the table (-1 and one past it)."""
    base = args_of(gen, dev, len(context), 1, heads, page_size, context, dtype=fp8, k_format=k_format)
    req = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(drafts)])
    seen = torch.cat([torch.arange(n) - n + 1 + c for n, c in zip(drafts, context, strict=True)])
    if stray:
        req, seen = torch.cat([req, torch.tensor([-1, len(context)])]), torch.cat([seen, torch.tensor([50, 50])])
    order = torch.randperm(req.shape[0], generator=gen)
    req, seen = req[order], seen[order]
    rows, dim = req.shape[0], base["q"].shape[3]
    q = to_fp8(torch.randn(rows, 1, heads, dim, generator=gen) * 3, base["q"].dtype)
    return dict(base, q=q.to(dev), weights=(torch.randn(rows, heads, generator=gen) / heads).to(dev),
                context_lens=seen.to(I32).to(dev), row_to_batch=req.to(I32).to(dev))


cases.add("ragged rows: 1 to 8 draft tokens a request, short and long, shuffled, page 64, native fp8",
          native_fp8=True)(
    lambda gen, dev, fp8: ragged_args(gen, dev, fp8, [1, 8, 3, 2, 5], [300, 9, 200, 64, 131]))
cases.add("ragged rows: page 48, rows naming no request (-1, past the table), native fp8", native_fp8=True)(
    lambda gen, dev, fp8: ragged_args(gen, dev, fp8, [2, 4, 1], [100, 50, 7], page_size=48, stray=True))
cases.add("ragged rows on an MXFP4 cache, 1 to 4 draft tokens, page 64, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: ragged_args(gen, dev, fp8, [4, 1, 3], [150, 70, 3], heads=32, k_format=fp4.FP4))

# MXFP4 caches (k_format float4_e2m1fn_x2, fp8 queries): the keys are exact values, so the fp8 bounds hold.
cases.add("MXFP4 cache, decode, page 64, D 128, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: args_of(gen, dev, 3, 1, 32, 64, [300, 1, 257], dtype=fp8, k_format=fp4.FP4))
cases.add("MXFP4 cache, page 17, D 64, the cache's last page first, next_n 2, short contexts, native fp8 q",
          native_fp8=True)(
    lambda gen, dev, fp8: args_of(gen, dev, 3, 2, 16, 17, [51, 24, 1], dtype=fp8, last_page=True, dim=64,
                                  k_format=fp4.FP4))
cases.add("MXFP4 cache, page table with holes and entries beyond the cache, next_n 2, native fp8 q",
          native_fp8=True)(
    lambda gen, dev, fp8: args_of(gen, dev, 2, 2, 16, 32, [250, 190], dtype=fp8, holes=True, k_format=fp4.FP4))
cases.add("MXFP4 cache, a NaN block scale and NaN weights propagate, next_n 2, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: _nan_args(gen, dev, fp8, k_format=fp4.FP4))

cases.add("MXFP4 cache, block scales up to 2^24 apart within a key in some pages, a NaN block, NaN weights, "
          "next_n 2, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: _nan_args(gen, dev, fp8, k_format=fp4.FP4, block_spread=24))
cases.add("MXFP4 cache, page 96 (tiles cross page ends), H 64, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: args_of(gen, dev, 2, 1, 64, 96, [300, 97], dtype=fp8, k_format=fp4.FP4))
cases.add("MXFP4 cache, speculative verify next_n 4, page 64, H 64, D 256, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: args_of(gen, dev, 2, 4, 64, 64, [200, 70], dtype=fp8, dim=256, k_format=fp4.FP4))
cases.add("MXFP4 cache, page 16, D 32 (a scale byte a token, pages of 272 bytes), next_n 3, native fp8 q",
          native_fp8=True)(
    lambda gen, dev, fp8: args_of(gen, dev, 3, 3, 16, 16, [40, 3, 33], dtype=fp8, dim=32, k_format=fp4.FP4))
cases.add("MXFP4 cache, page 5, D 32 (pages of 85 bytes: values read a byte at a time), native fp8 q",
          native_fp8=True)(
    lambda gen, dev, fp8: args_of(gen, dev, 2, 1, 16, 5, [23, 9], dtype=fp8, dim=32, last_page=True,
                                  k_format=fp4.FP4))


def with_mxfp4_queries(gen, args: dict, spread: bool = False) -> dict:
    """``args`` (on an MXFP4 cache) with MXFP4 queries in place of the fp8 ones, quantized from normal queries whose
    (token, head)s are each scaled by a power of two; ``spread``: every third head's blocks 2^9 apart."""
    q = args["q"]
    raw = torch.randn(*q.shape, generator=gen) * torch.exp2(
        torch.randint(-6, 6, (*q.shape[:-1], 1), generator=gen).float())
    if spread:
        raw[..., ::3, :] *= torch.exp2(9.0 * torch.arange(q.shape[-1] // 32).repeat_interleave(32) - 12)
    values, scales = mqa_logits.mxfp4_queries(raw)
    return dict(args, q=values.to(q.device), q_scale=scales.to(q.device))


cases.add("MXFP4 queries and cache, decode, page 64, H 32")(
    lambda gen, dev: with_mxfp4_queries(gen, args_of(gen, dev, 3, 1, 32, 64, [300, 1, 257], k_format=fp4.FP4)))
cases.add("MXFP4 queries (block scales up to 2^27 apart in some heads) and cache, next_n 2, page 48, holes")(
    lambda gen, dev: with_mxfp4_queries(gen, args_of(gen, dev, 2, 2, 16, 48, [250, 190], holes=True,
                                                     k_format=fp4.FP4), spread=True))
cases.add("MXFP4 queries and cache, ragged rows, 1 to 4 draft tokens, page 64")(
    lambda gen, dev: with_mxfp4_queries(gen, ragged_args(gen, dev, E4M3, [4, 1, 3], [150, 70, 3], heads=16,
                                                         k_format=fp4.FP4)))



def top_of_e8m0_args(gen: torch.Generator, dev: torch.device, side: str) -> dict[str, Any]:
    """MXFP4 queries and cache (2 requests, next_n 2, H 16, page 32) with the queries' (``side`` "q") or the cache's
    keys' ("k") block scales at the top of e8m0 (:func:`mqa_logits.at_the_top_of_e8m0`)."""
    args = with_mxfp4_queries(gen, args_of(gen, dev, 2, 2, 16, 32, [70, 45], k_format=fp4.FP4))
    values, scales = split_packed_cache(args["k_cache"], 128, fp4.FP4)
    if side == "q":
        mqa_logits.at_the_top_of_e8m0(args["q"], args["q_scale"], scales)
    else:
        mqa_logits.at_the_top_of_e8m0(values, scales, args["q_scale"])
    return args


def top_of_e8m0_fp8_args(gen: torch.Generator, dev: torch.device, fp8: torch.dtype) -> dict[str, Any]:
    """An MXFP4 cache (2 requests, next_n 2, H 16, page 32) whose keys' block scales are at the top of e8m0
    (:func:`mqa_logits.at_the_top_of_e8m0`), fp8 queries of format ``fp8`` (:func:`mqa_logits.small_fp8_queries`)."""
    args = args_of(gen, dev, 2, 2, 16, 32, [70, 45], dtype=fp8, k_format=fp4.FP4)
    values, scales = split_packed_cache(args["k_cache"], 128, fp4.FP4)
    mqa_logits.at_the_top_of_e8m0(values, scales, None)
    return mqa_logits.small_fp8_queries(gen, args)


# Block scales at the top of e8m0 on one side, small ones on the other (as mqa_logits' cases).
cases.add("MXFP4 queries with block scale bytes 254 and 253 (beside 140 in some rows), cache 2^-100 smaller")(
    lambda gen, dev: top_of_e8m0_args(gen, dev, "q"))
cases.add("MXFP4 cache with block scale bytes 254 and 253 (beside 140 in some rows), MXFP4 queries 2^-100 smaller")(
    lambda gen, dev: top_of_e8m0_args(gen, dev, "k"))
cases.add("MXFP4 cache with block scale bytes 254 and 253 (beside 140 in some rows), small native fp8 q, weights "
          "2^-100", native_fp8=True)(top_of_e8m0_fp8_args)


@cases.add("MXFP4 cache in DeepGEMM's 4-D view, context length 0 and contexts beyond the table, native fp8 q",
           native_fp8=True)
def _(gen, dev, fp8):
    args = args_of(gen, dev, 3, 1, 8, 64, [0, 10**6, 64], dtype=fp8, pages_per_req=2, k_format=fp4.FP4)
    args["k_cache"] = args["k_cache"].view(args["k_cache"].shape[0], 64, 1, 68)
    return args

# ----------------------------------------------------------------------------------------------- benchmark

TOKEN_BYTES = DIM + 4  # a cached token: D fp8 bytes and a float32 scale


def bench_cases(quick: bool) -> list[BenchCase]:
    def case(batch: int, context: int, next_n: int, heads: int, page: int) -> BenchCase:
        size = f"{context // 1024}K" if context >= 1024 else str(context)
        return BenchCase(f"{batch}x{size} next_n={next_n} page{page} H{heads}",
                         dict(batch=batch, context=context, next_n=next_n, heads=heads, dim=DIM, page_size=page,
                              kind="fp8"))

    if quick:
        return [case(2, 300, 1, 16, 64), case(2, 300, 2, 16, 64)]
    return [case(64, context, next_n, HEADS, PAGE) for context in (32768, 131072) for next_n in (1, 2)]


def bench_build(case: BenchCase, gen: torch.Generator) -> dict[str, Any]:
    """A packed fp8 cache of batch × context tokens in randomly permuted pages, every request at full length.
    The key bytes repeat a random block of up to 64 pages (finite e4m3 values, no NaN): building 1 GiB of
    distinct random values on the CPU would take longer than the whole measurement."""
    p = case.params
    batch, context, next_n, heads, dim, page = (p[n] for n in ("batch", "context", "next_n", "heads", "dim",
                                                               "page_size"))
    per_request = -(-context // page)
    pages = batch * per_request
    span = min(pages, 64)
    block = new_packed_cache(span, page, dim)
    keys, scales = split_packed_cache(block, dim, E4M3)
    draw = torch.randint(0, 0xE0, (span, page, dim), generator=gen, dtype=torch.uint8)
    keys.view(torch.uint8).copy_(draw + (draw >= 0x70).to(torch.uint8) * 0x10)  # 0x00-0x6f, 0x80-0xef: finite
    scales.copy_(torch.rand(span, page, generator=gen) * 0.01 + 1e-3)
    cache = block.repeat(-(-pages // span), 1)[:pages]
    table = torch.randperm(pages, generator=gen, dtype=torch.int32).view(batch, per_request)
    q = (torch.randn(batch, next_n, heads, dim, generator=gen) * 24).clamp(-400, 400).to(E4M3)
    weights = torch.randn(batch * next_n, heads, generator=gen) * heads**-0.5
    return dict(q=q, k_cache=cache, weights=weights, context_lens=torch.full((batch,), context, dtype=torch.int32),
                page_table=table, max_context_len=context, out=torch.full((batch * next_n, context), float("nan")))


def bench_bytes(case: BenchCase) -> int:
    """132 bytes a cached token read (128 fp8 + a float32 scale), 4 bytes a logit written."""
    p = case.params
    return TOKEN_BYTES * p["batch"] * p["context"] + 4 * p["batch"] * p["next_n"] * p["context"]


def bench_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    args = check(a["q"], a["k_cache"], a["weights"], a["context_lens"], a["page_table"], a["max_context_len"],
                 out=a["out"])
    return dispatch.call("paged_mqa_logits", args, backend)


# Judged and benchmark-checked like mqa_logits: the same rule and bounds.
SPEC = OpSpec("paged_mqa_logits", check, reference, mqa_logits.judge, tuple(cases),
              bench=BenchSpec("paged_mqa_logits", bench_cases, bench_build, bench_call, bench_bytes,
                              same=mqa_logits.same_logits, ceilings=("fp8_matmul", "bf16_matmul")), budgeted=True)
