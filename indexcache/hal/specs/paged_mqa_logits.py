"""paged_mqa_logits: paged decode / speculative-verify indexer logits over the packed fp8 cache
(contract: :func:`indexcache.paged_mqa_logits`). Its record's ``bench``: 32K and 128K contexts, next_n 1 and 2,
132 bytes a cached token read, checked like mqa_logits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch
from indexcache.hal.checks import INDEX, check_cache, check_int, check_tensor, output
from indexcache.hal.layout import FP8_DTYPES, new_packed_cache, split_packed_cache
from indexcache.hal.specs import mqa_logits, store_index_k
from indexcache.hal.specs.base import E4M3, E4M3_FNUZ, I32, ODD_PAGES, CaseList, OpSpec, cpu, to_fp8
from indexcache.hal.specs.bench import DIM, HEADS, PAGE, BenchCase, BenchSpec


def check_inputs(q, k_cache, weights, context_lens, page_table, max_context_len, table: str = "page_table") -> None:
    """The inputs as :func:`check` takes them; ``table`` is the name errors give ``page_table`` (the index-K
    cache's table)."""
    check_tensor("q", q, FP8_DTYPES, (None, None, None, None))
    batch, next_n, heads, dim = q.shape
    device = q.device
    check_cache(k_cache, "q", dim, device)
    check_tensor("weights", weights, (torch.float32,), (batch * next_n, heads), device)
    check_tensor("context_lens", context_lens, (INDEX,), (batch,), device)
    check_tensor(table, page_table, (INDEX,), (batch, None), device)
    check_int("max_context_len", max_context_len, 0)


def check(q, k_cache, weights, context_lens, page_table, max_context_len: int, *, out=None) -> dict[str, Any]:
    check_inputs(q, k_cache, weights, context_lens, page_table, max_context_len)
    batch, next_n = q.shape[:2]
    device = q.device
    out = output("out", out, torch.float32, (batch * next_n, max_context_len), device,
                 dict(q=q, k_cache=k_cache, weights=weights, context_lens=context_lens, page_table=page_table))
    return dict(q=q, k_cache=k_cache, weights=weights, context_lens=context_lens, page_table=page_table,
                max_context_len=max_context_len, out=out)


def reference(q, k_cache, weights, context_lens, page_table, max_context_len) -> torch.Tensor:
    """Paged decode logits ``[B * next_n, max_context_len]`` float64.

    Row ``b * next_n + j`` sees keys ``0 .. context_lens[b] - next_n + j``; keys past that, keys
    whose page lies beyond the table and keys whose table entry is < 0 or beyond the cache are -inf.
    """
    q = cpu(q)
    batch, next_n, heads, dim = q.shape
    keys, scales = split_packed_cache(cpu(k_cache), dim, q.dtype)
    num_pages, page_size = scales.shape
    table, context_lens = cpu(page_table).long(), cpu(context_lens).long()
    weights = cpu(weights).double().view(batch, next_n, heads)
    out = torch.full((batch * next_n, max_context_len), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        for j in range(next_n):
            visible = min(int(context_lens[b]) - next_n + j + 1, max_context_len)
            for s in range(max(visible, 0)):
                page = s // page_size
                if page >= table.shape[1] or not 0 <= int(table[b, page]) < num_pages:
                    continue
                slot = (int(table[b, page]), s % page_size)
                dots = (q[b, j].double() @ keys[slot].double()).clamp_min(0)
                out[b * next_n + j, s] = (dots * weights[b, j]).sum() * float(scales[slot])
    return out


cases = CaseList("paged_mqa_logits")


def args_of(gen, dev, batch, next_n, heads, page_size, context, dtype=E4M3, holes=False, pages_per_req=None,
          last_page=False):
    """``last_page``: request 0's first table entry is the cache's last page, so a key tile that crosses that
    page's end inside the context reads past the tensor."""
    dim = 128
    pages_per_req = pages_per_req or max(1, -(-max(context) // page_size))
    num_pages = batch * pages_per_req + 3
    k = torch.randn(num_pages * page_size, dim, generator=gen) * 3
    cache = new_packed_cache(num_pages, page_size, dim)
    cache = store_index_k.reference(k, cache, torch.arange(num_pages * page_size, dtype=I32), dtype)
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
    return dict(q=q.to(dev), k_cache=cache.to(dev), weights=weights.to(dev), context_lens=lens.to(dev),
                page_table=table.to(dev), max_context_len=max_len)


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


@cases.add("context length 0 and contexts beyond the table, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return args_of(gen, dev, 3, 1, 8, 64, [0, 10**6, 64], dtype=fp8, pages_per_req=2)


@cases.add("NaN key (scale NaN in the cache) and NaN weights propagate, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = {name: t.cpu() if isinstance(t, torch.Tensor) else t
            for name, t in args_of(gen, dev, 2, 2, 16, 64, [150, 100], dtype=fp8).items()}
    bad = torch.randn(2, 128, generator=gen)
    bad[0, 3], bad[1, 0] = float("nan"), float("inf")
    slots = (args["page_table"][:, 0].long() * 64 + torch.tensor([10, 70])).to(I32)  # position 10 of each request
    args["k_cache"] = store_index_k.reference(bad, args["k_cache"], slots, fp8)
    args["weights"][3, 0] = float("nan")
    return {name: t.to(dev) if isinstance(t, torch.Tensor) else t for name, t in args.items()}


@cases.add("fp8 e4m3fnuz cache, H 64")
def _(gen, dev):
    return args_of(gen, dev, 2, 1, 64, 64, [190, 64], dtype=E4M3_FNUZ)


@cases.add("DeepGEMM's 4-D cache view, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = args_of(gen, dev, 2, 1, 16, 64, [100, 128], dtype=fp8)
    args["k_cache"] = args["k_cache"].view(args["k_cache"].shape[0], 64, 1, 132)
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
                              same=mqa_logits.same_logits, ceilings=("fp8_matmul", "bf16_matmul")))
