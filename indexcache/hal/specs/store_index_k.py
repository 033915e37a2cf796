"""store_index_k: quantize keys (one power-of-two scale a token) into the packed fp8 cache, in place
(contract: :func:`indexcache.store_index_k`). Its record's ``bench``: quantize_index_k's decode and prefill
batches into a page-64 cache (decode one token a page, prefill whole pages), checked byte-exact."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch, fp4
from indexcache.hal.checks import FLOAT_INPUTS, INDEX, check_cache, check_output, check_tensor, key_format
from indexcache.hal.layout import new_packed_cache, split_packed_cache
from indexcache.hal.specs import quantize_index_k
from indexcache.hal.specs.base import E4M3, E4M3_FNUZ, I32, ODD_PAGES, CaseList, OpSpec, Verdict, cpu
from indexcache.hal.specs.bench import DIM, PAGE, BenchCase, BenchSpec


def check(k, k_cache, slot_mapping, fp8_dtype: torch.dtype | None = None) -> dict[str, Any]:
    check_tensor("k", k, FLOAT_INPUTS, (None, None))
    device = k.device
    fp8_dtype = key_format(fp8_dtype, device)
    check_cache(k_cache, "k", k.shape[1], device, fp8_dtype)
    check_tensor("slot_mapping", slot_mapping, (INDEX,), (k.shape[0],), device)
    check_output("k_cache", k_cache, dict(k=k, slot_mapping=slot_mapping))
    return dict(k=k, k_cache=k_cache, slot_mapping=slot_mapping, fp8_dtype=fp8_dtype)


def reference(k, k_cache, slot_mapping, fp8_dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """A copy of the packed cache with ``k [N, D]`` quantized (one scale a token; MXFP4: a scale every 32 elements)
    into ``slot_mapping [N]``.

    Slot ``s`` is token ``s % page_size`` of page ``s // page_size``; slots < 0 or beyond the cache
    are skipped.
    """
    cache = cpu(k_cache).clone()
    keys, scales = split_packed_cache(cache, k.shape[1], fp8_dtype)
    if fp8_dtype == fp4.FP4:  # a token's value and scale bytes
        q, scale = (t.view(torch.uint8) for t in quantize_index_k.reference(k, fp8_dtype, block=fp4.BLOCK))
        keys, scales = keys.view(torch.uint8), scales.view(torch.uint8)
    else:
        q, scale = quantize_index_k.reference(k, fp8_dtype, block=k.shape[1])
        scale = scale[:, 0]
    num_pages, page_size = keys.shape[:2]
    for i, slot in enumerate(cpu(slot_mapping).tolist()):
        if 0 <= slot < num_pages * page_size:
            keys[slot // page_size, slot % page_size] = q[i]
            scales[slot // page_size, slot % page_size] = scale[i]
    return cache


def judge(args: dict, got: None, want: torch.Tensor, accumulation: str) -> Verdict:
    """The cache, written in place, byte-exact."""
    return ("" if quantize_index_k.bytes_equal(cpu(args["k_cache"]), want) else "cache bytes differ"), None, None


cases = CaseList("store_index_k")


@cases.add("tokens holding NaN, +inf or -inf: scale NaN, zero bytes, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    k = torch.randn(8, 128, generator=gen)
    k[1, 3], k[2, 0], k[3] = float("nan"), float("inf"), float("-inf")
    return dict(k=k.to(dev), k_cache=new_packed_cache(2, 64).to(dev), slot_mapping=torch.arange(8, dtype=I32).to(dev),
                fp8_dtype=fp8)


for _dt, _label in ((E4M3, "e4m3fn"), (E4M3_FNUZ, "e4m3fnuz")):
    @cases.add(f"slots with -1 and beyond the cache, page 64, {_label}")
    def _(gen, dev, dt=_dt):
        slots = torch.randperm(6 * 64, generator=gen)[:50].to(I32)
        slots[::7] = -1
        slots[3] = 6 * 64
        slots[4] = 2**31 - 1
        return dict(k=(torch.randn(50, 128, generator=gen) * 5).to(dev), k_cache=new_packed_cache(6, 64).to(dev),
                    slot_mapping=slots.to(dev), fp8_dtype=dt)


for _ps in ODD_PAGES:
    @cases.add(f"page {_ps} (not a multiple of the 64-key tile), the cache's last slots, native fp8", native_fp8=True)
    def _(gen, dev, fp8, ps=_ps):
        pages = 3
        slots = torch.randperm(pages * ps, generator=gen)[:40].to(I32)
        slots[:3] = torch.tensor([pages * ps - 1, pages * ps - 2, ps], dtype=I32)
        slots[5] = pages * ps
        return dict(k=(torch.randn(40, 128, generator=gen) * 5).to(dev), k_cache=new_packed_cache(pages, ps).to(dev),
                    slot_mapping=slots.to(dev), fp8_dtype=fp8)

@cases.add("MXFP4: slots with -1 and beyond the cache, page 64")
def _(gen, dev):
    slots = torch.randperm(6 * 64, generator=gen)[:50].to(I32)
    slots[::7] = -1
    slots[3] = 6 * 64
    k = torch.randn(50, 128, generator=gen) * 5
    k[1, 3], k[2, 40], k[4] = float("nan"), float("inf"), 0.0
    return dict(k=k.to(torch.bfloat16).to(dev), k_cache=new_packed_cache(6, 64, fp8_dtype=fp4.FP4).to(dev),
                slot_mapping=slots.to(dev), fp8_dtype=fp4.FP4)


@cases.add("MXFP4: page 17, D 64, DeepGEMM's 4-D view of the cache")
def _(gen, dev):
    cache = new_packed_cache(3, 17, 64, fp8_dtype=fp4.FP4).view(3, 17, 1, 32 + 2)
    slots = torch.randperm(3 * 17, generator=gen)[:20].to(I32)
    return dict(k=torch.randn(20, 64, generator=gen).to(dev), k_cache=cache.to(dev), slot_mapping=slots.to(dev),
                fp8_dtype=fp4.FP4)

# ----------------------------------------------------------------------------------------------- benchmark

CACHE_PAGES = 4096  # the packed cache the keys go to: 4096 pages of 64 tokens (35 MB at D 128); 64 when quick


def bench_cases(quick: bool) -> list[BenchCase]:
    pages = 64 if quick else CACHE_PAGES
    found = []
    for what, tokens, kind in quantize_index_k.bench_shapes(quick):
        note = (f"one token a request, at a random slot of a page of its own ({pages}-page cache)" if what == "decode"
                else f"consecutive tokens filling randomly chosen whole pages of a {pages}-page cache")
        found.append(BenchCase(f"{what} {quantize_index_k.tokens_label(tokens)} tokens D{DIM} {kind} page{PAGE}",
                               dict(tokens=tokens, dim=DIM, kind=kind, block=DIM, page_size=PAGE, pages=pages,
                                    decode=what == "decode"), note))
    return found


def bench_build(case: BenchCase, gen: torch.Generator) -> dict[str, Any]:
    """Normal keys ``[tokens, D]`` and a zeroed packed cache; decode slots one token a request, each at a
    random position of a page of its own; prefill slots consecutive, filling randomly chosen whole pages."""
    p = case.params
    tokens, page, pages = p["tokens"], p["page_size"], p["pages"]
    if p["decode"]:
        slots = torch.randperm(pages, generator=gen)[:tokens] * page + torch.randint(0, page, (tokens,), generator=gen)
    else:
        chosen = torch.randperm(pages, generator=gen)[:-(-tokens // page)]
        slots = (chosen[:, None] * page + torch.arange(page)).flatten()[:tokens]
    return dict(k=quantize_index_k.bench_keys(case, gen), k_cache=new_packed_cache(pages, page, p["dim"]),
                slot_mapping=slots.to(torch.int32), fp8_dtype=E4M3)


def bench_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    dispatch.call("store_index_k", check(a["k"], a["k_cache"], a["slot_mapping"], a["fp8_dtype"]), backend)
    return a["k_cache"]


def bench_bytes(case: BenchCase) -> int:
    """The keys and slots read once; per token D fp8 bytes and a float32 scale written."""
    p = case.params
    return (quantize_index_k.KEY_INPUTS[p["kind"]].itemsize * p["dim"] + 4 + p["dim"] + 4) * p["tokens"]


SPEC = OpSpec("store_index_k", check, reference, judge, tuple(cases),
              bench=BenchSpec("store_index_k", bench_cases, bench_build, bench_call, bench_bytes,
                              same=quantize_index_k.same_bytes))
