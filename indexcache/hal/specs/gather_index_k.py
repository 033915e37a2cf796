"""gather_index_k: the paged index-K cache → contiguous keys and scales in request order, what ``mqa_logits`` takes
(contract: :func:`indexcache.gather_index_k`). Its record's ``bench``: a prefill chunk's keys gathered from randomly
placed pages, checked byte-exact; set against copy bandwidth."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch, fp4
from indexcache.hal.checks import INDEX, check_cache, check_int, check_tensor, key_format, output
from indexcache.hal.layout import new_packed_cache, scale_bytes, split_packed_cache, token_bytes
from indexcache.hal.specs import quantize_index_k
from indexcache.hal.specs.base import E4M3, E4M3_FNUZ, I32, ODD_PAGES, CaseList, OpSpec, Verdict, cpu, not_written
from indexcache.hal.specs.bench import DIM, PAGE, BenchCase, BenchSpec


def out_shapes(rows: int, dim: int, fp8_dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """``((shape, dtype) of the keys, (shape, dtype) of the scales)`` of ``rows`` gathered tokens."""
    if fp8_dtype == fp4.FP4:
        return ((rows, dim // 2), fp4.FP4), ((rows, dim // fp4.BLOCK), fp4.E8M0)
    return ((rows, dim), fp8_dtype), ((rows,), torch.float32)


def check(k_cache, block_table, context_lens, *, dim: int = 128, fp8_dtype: torch.dtype | None = None, out_k=None,
          out_scale=None) -> dict[str, Any]:
    check_tensor("context_lens", context_lens, (INDEX,), (None,))
    device = context_lens.device
    check_tensor("block_table", block_table, (INDEX,), (context_lens.shape[0], None), device)
    check_int("dim", dim, 1)
    fp8_dtype = key_format(fp8_dtype, device, given=out_k)
    check_cache(k_cache, "dim", dim, device, fp8_dtype)
    given = out_k if out_k is not None else out_scale
    if given is not None:
        if not isinstance(given, torch.Tensor) or given.dim() == 0:
            name = "out_k" if out_k is not None else "out_scale"
            raise TypeError(f"{name}: expected a torch.Tensor of at least one dimension, got {given!r}")
        rows = given.shape[0]
    elif torch.compiler.is_compiling() or context_lens.is_meta:
        raise ValueError("out_k, out_scale: expected one of them or both under torch.compile (their rows are the "
                         "gathered tokens, which the context lengths on the device decide; a missing one is "
                         "allocated with the given one's rows), got neither")
    else:
        rows = int(context_lens.clamp_min(0).sum())  # the one host sync of a call without outputs
    (k_shape, k_dtype), (s_shape, s_dtype) = out_shapes(rows, dim, fp8_dtype)
    inputs = dict(k_cache=k_cache, block_table=block_table, context_lens=context_lens)
    out_k = output("out_k", out_k, k_dtype, k_shape, device, inputs)
    out_scale = output("out_scale", out_scale, s_dtype, s_shape, device, {**inputs, "out_k": out_k})
    return dict(k_cache=k_cache, block_table=block_table, context_lens=context_lens, dim=dim, fp8_dtype=fp8_dtype,
                out_k=out_k, out_scale=out_scale)


def reference(k_cache, block_table, context_lens, *, dim=128, fp8_dtype=torch.float8_e4m3fn, out_k=None,
              out_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, scales)``: copies of ``out_k`` and ``out_scale`` (of ``N`` rows; a missing one zeros of the given
    one's rows, both of ``sum(max(len, 0))`` rows when neither is given) with request ``b``'s token ``t <
    context_lens[b]`` at row ``start_b + t``, ``start_b`` the sum of the earlier requests' lengths (negative ones
    count as 0). Token ``t`` lies at slot ``t % page_size`` of
    page ``block_table[b, t // page_size]``; a page entry < 0 or past the cache, or a token past the table's
    columns, gives zero key bytes and a NaN scale (MXFP4: scale bytes 255). Rows at or past the total stay as
    they are; tokens whose row would be N or more are not written."""
    keys, scales = split_packed_cache(cpu(k_cache), dim, fp8_dtype)
    num_pages, page_size = keys.shape[:2]
    keys = keys.view(torch.uint8)
    scales = scales.view(torch.uint8).reshape(num_pages, page_size, scale_bytes(dim, fp8_dtype))
    lens = cpu(context_lens).clamp_min(0).tolist()
    given = out_k if out_k is not None else out_scale
    (k_shape, k_dtype), (s_shape, s_dtype) = out_shapes(sum(lens) if given is None else given.shape[0], dim, fp8_dtype)
    # one-byte formats zeroed as bytes: torch fills no float4_e2m1fn_x2 tensor (NotImplementedError past a size)
    out_k, out_scale = (out if out is not None else torch.zeros(shape, dtype=torch.uint8).view(dtype)
                        if dtype.itemsize == 1 else torch.zeros(shape, dtype=dtype)
                        for out, shape, dtype in ((out_k, k_shape, k_dtype), (out_scale, s_shape, s_dtype)))
    got_k, got_scale = cpu(out_k).clone(), cpu(out_scale).clone()
    k_bytes = got_k.view(torch.uint8).view(got_k.shape[0], keys.shape[2])
    s_bytes = got_scale.view(torch.uint8).view(got_scale.shape[0], scales.shape[2])
    hole = torch.full((s_bytes.shape[1],), fp4.E8M0_NAN, dtype=torch.uint8) if fp8_dtype == fp4.FP4 else \
        torch.tensor([float("nan")]).view(torch.uint8)
    table = cpu(block_table)
    row = 0
    for b, length in enumerate(lens):
        for t in range(length):
            if row + t >= k_bytes.shape[0]:
                break
            column = t // page_size
            page = int(table[b, column]) if column < table.shape[1] else -1
            if 0 <= page < num_pages:
                k_bytes[row + t] = keys[page, t % page_size].reshape(-1)
                s_bytes[row + t] = scales[page, t % page_size]
            else:
                k_bytes[row + t] = 0
                s_bytes[row + t] = hole
        row += length
    return got_k, got_scale


def judge(args: dict, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
          accumulation: str) -> Verdict:
    """Keys and scales byte-exact (float32 scales: equal, NaN where the reference has NaN); written into the given
    outputs."""
    if detail := not_written(args, {"out_k": got[0], "out_scale": got[1]}):
        return detail, None, None
    got_k, got_scale = (cpu(t) for t in got)
    want_k, want_scale = want
    if got_k.dtype != want_k.dtype or got_scale.dtype != want_scale.dtype:
        return f"dtypes {got_k.dtype}, {got_scale.dtype}: expected {want_k.dtype}, {want_scale.dtype}", None, None
    if got_k.shape != want_k.shape or not torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8)):
        return "keys differ", None, None
    if want_scale.dtype == torch.float32:
        same = torch.equal(got_scale.nan_to_num(-1.0), want_scale.nan_to_num(-1.0))  # scales are positive
    else:
        same = torch.equal(got_scale.view(torch.uint8), want_scale.view(torch.uint8))
    return ("" if same else "scales differ"), None, None


def _cache(gen: torch.Generator, pages: int, page_size: int, dim: int, fmt: torch.dtype) -> torch.Tensor:
    """A cache of random bytes but for the scales: positive float32 ones (fp8), e8m0 bytes 100-150 (MXFP4)."""
    cache = torch.randint(0, 256, (pages, page_size * token_bytes(dim, fmt)), generator=gen, dtype=torch.uint8)
    keys, scales = split_packed_cache(cache, dim, fmt)
    if fmt == fp4.FP4:
        scales.view(torch.uint8).copy_(torch.randint(100, 151, scales.shape, generator=gen, dtype=torch.uint8))
    else:
        keys.view(torch.uint8).bitwise_and_(0x77)  # finite fp8 values in both formats
        scales.copy_(torch.rand(scales.shape, generator=gen) + 1e-3)
    return cache


def _outputs(rows: int, dim: int, fmt: torch.dtype, dev) -> dict[str, torch.Tensor]:
    """Given outputs of ``rows`` rows, filled with a sentinel (0x5A): rows the op leaves alone must keep it."""
    return {name: torch.full((math.prod(shape) * dtype.itemsize,), 0x5A, dtype=torch.uint8).view(dtype).view(shape)
            .to(dev) for name, (shape, dtype) in zip(("out_k", "out_scale"), out_shapes(rows, dim, fmt), strict=True)}


cases = CaseList("gather_index_k")

for _dt, _label in ((E4M3, "e4m3fn"), (E4M3_FNUZ, "e4m3fnuz")):
    @cases.add(f"requests of mixed lengths (0, partial and whole pages, negative), shuffled pages, {_label}")
    def _(gen, dev, dt=_dt):
        pages, page = 32, 64
        lens = torch.tensor([130, 0, 64, -5, 1, 300], dtype=I32)
        table = torch.randperm(pages, generator=gen)[:6 * 5].view(6, 5).to(I32)
        return dict(k_cache=_cache(gen, pages, page, 128, dt).to(dev), block_table=table.to(dev),
                    context_lens=lens.to(dev), dim=128, fp8_dtype=dt)


@cases.add("holes: page entries -1 and past the cache, tokens past the table's columns, native fp8",
           native_fp8=True)
def _(gen, dev, fp8):
    pages, page = 10, 16
    table = torch.tensor([[3, -1, 9, 10], [2**31 - 1, 0, 1, -7]], dtype=I32)
    lens = torch.tensor([70, 40], dtype=I32)  # 70 tokens: the 5th page lies past the 4 columns
    return dict(k_cache=_cache(gen, pages, page, 128, fp8).to(dev), block_table=table.to(dev),
                context_lens=lens.to(dev), dim=128, fp8_dtype=fp8)


@cases.add("given outputs: more rows than the tokens (the rest untouched), native fp8", native_fp8=True)
def _(gen, dev, fp8):
    table = torch.randperm(8, generator=gen).view(2, 4).to(I32)
    lens = torch.tensor([50, 77], dtype=I32)
    return dict(k_cache=_cache(gen, 8, 64, 128, fp8).to(dev), block_table=table.to(dev), context_lens=lens.to(dev),
                dim=128, fp8_dtype=fp8, **_outputs(200, 128, fp8, dev))


@cases.add("given outputs: fewer rows than the tokens (the rest dropped, nothing written past them), native fp8",
           native_fp8=True)
def _(gen, dev, fp8):
    table = torch.randperm(8, generator=gen).view(2, 4).to(I32)
    lens = torch.tensor([50, 77], dtype=I32)
    return dict(k_cache=_cache(gen, 8, 64, 128, fp8).to(dev), block_table=table.to(dev), context_lens=lens.to(dev),
                dim=128, fp8_dtype=fp8, **_outputs(90, 128, fp8, dev))


@cases.add("given outputs as strided views: every other row of wider buffers, every other float32 scale, native fp8",
           native_fp8=True)
def _(gen, dev, fp8):
    table = torch.randperm(8, generator=gen).view(2, 4).to(I32)
    table[0, 1] = -1
    lens = torch.tensor([70, 33], dtype=I32)
    wide = _outputs(2 * 110, 128, fp8, dev)
    return dict(k_cache=_cache(gen, 8, 64, 128, fp8).to(dev), block_table=table.to(dev), context_lens=lens.to(dev),
                dim=128, fp8_dtype=fp8, out_k=wide["out_k"][::2], out_scale=wide["out_scale"][1::2])


for _given in ("out_k", "out_scale"):
    @cases.add(f"only {_given} given (as many rows as the tokens): the other allocated with its rows, native fp8",
               native_fp8=True)
    def _(gen, dev, fp8, given=_given):
        table = torch.randperm(8, generator=gen).view(2, 4).to(I32)
        lens = torch.tensor([41, 64], dtype=I32)
        return dict(k_cache=_cache(gen, 8, 64, 128, fp8).to(dev), block_table=table.to(dev),
                    context_lens=lens.to(dev), dim=128, fp8_dtype=fp8, **{given: _outputs(105, 128, fp8, dev)[given]})


for _ps in ODD_PAGES:
    @cases.add(f"page {_ps}, D 64, DeepGEMM's 4-D view of the cache, native fp8", native_fp8=True)
    def _(gen, dev, fp8, ps=_ps):
        pages = 12
        cache = _cache(gen, pages, ps, 64, fp8).view(pages, ps, 1, 64 + 4)
        lens = torch.tensor([3 * ps + 1, ps, 2], dtype=I32)
        table = torch.randperm(pages, generator=gen)[:3 * 4].view(3, 4).to(I32)
        return dict(k_cache=cache.to(dev), block_table=table.to(dev), context_lens=lens.to(dev), dim=64,
                    fp8_dtype=fp8)


@cases.add("MXFP4: mixed lengths, a hole, page 64, given outputs")
def _(gen, dev):
    pages, page = 12, 64
    table = torch.randperm(pages, generator=gen)[:3 * 4].view(3, 4).to(I32)
    table[1, 1] = -1
    lens = torch.tensor([100, 200, 7], dtype=I32)
    return dict(k_cache=_cache(gen, pages, page, 128, fp4.FP4).to(dev), block_table=table.to(dev),
                context_lens=lens.to(dev), dim=128, fp8_dtype=fp4.FP4, **_outputs(310, 128, fp4.FP4, dev))


@cases.add("MXFP4: page 17, D 64, outputs allocated")
def _(gen, dev):
    pages, page = 9, 17
    table = torch.randperm(pages, generator=gen)[:2 * 4].view(2, 4).to(I32)
    lens = torch.tensor([60, 33], dtype=I32)
    return dict(k_cache=_cache(gen, pages, page, 64, fp4.FP4).to(dev), block_table=table.to(dev),
                context_lens=lens.to(dev), dim=64, fp8_dtype=fp4.FP4)


@cases.add("no requests and an empty cache")
def _(gen, dev):
    return dict(k_cache=new_packed_cache(0, 64).to(dev), block_table=torch.zeros(0, 3, dtype=I32).to(dev),
                context_lens=torch.zeros(0, dtype=I32).to(dev), dim=128, fp8_dtype=E4M3)

# ----------------------------------------------------------------------------------------------- benchmark

# The cache the keys come from: 32768 pages of 64 tokens (277 MB at D 128, past any L2); 256 when quick. The large
# cases move 138 MB each way, so the repeats do not find them in L2 either.
CACHE_PAGES = 32768


def bench_cases(quick: bool) -> list[BenchCase]:
    pages = 256 if quick else CACHE_PAGES
    shapes = ((1, 4096), (4, 2048)) if quick else ((1, 32768), (8, 131072), (64, 16384))
    return [BenchCase(f"{b} x {n} tokens D{DIM} fp8 page{PAGE}", dict(batch=b, tokens=n, pages=pages),
                      f"each request's pages drawn at random from a {pages}-page cache")
            for b, n in shapes if b * -(-n // PAGE) <= pages]


def bench_build(case: BenchCase, gen: torch.Generator) -> dict[str, Any]:
    p = case.params
    batch, tokens, pages = p["batch"], p["tokens"], p["pages"]
    columns = -(-tokens // PAGE)
    table = torch.randperm(pages, generator=gen)[:batch * columns].view(batch, columns).to(I32)
    rows = batch * tokens
    return dict(k_cache=_cache(gen, pages, PAGE, DIM, E4M3), block_table=table,
                context_lens=torch.full((batch,), tokens, dtype=I32),
                out_k=torch.empty(rows, DIM, dtype=E4M3), out_scale=torch.empty(rows, dtype=torch.float32))


def bench_call(a: Mapping[str, Any], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    checked = check(a["k_cache"], a["block_table"], a["context_lens"], dim=DIM, fp8_dtype=E4M3, out_k=a["out_k"],
                    out_scale=a["out_scale"])
    dispatch.call("gather_index_k", checked, backend)
    return a["out_k"], a["out_scale"]


def bench_bytes(case: BenchCase) -> int:
    """Per token its key and scale read and written once (the table and lengths are small)."""
    p = case.params
    return 2 * (DIM + 4) * p["batch"] * p["tokens"]


SPEC = OpSpec("gather_index_k", check, reference, judge, tuple(cases),
              bench=BenchSpec("gather_index_k", bench_cases, bench_build, bench_call, bench_bytes,
                               same=quantize_index_k.same_bytes))
