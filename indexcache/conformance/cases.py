"""The case catalogue: every op on the same generated inputs, edge cases included.

A case builds the public op's keyword arguments on a device from a seeded generator, so every
backend sees identical inputs. Tensors are made on the CPU and moved; views that must stay
non-contiguous are taken after the move.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from indexcache import reference
from indexcache.layout import fp8_max, new_packed_cache

I32 = torch.int32
E4M3 = torch.float8_e4m3fn
E4M3_FNUZ = torch.float8_e4m3fnuz


@dataclass(frozen=True)
class Case:
    """One conformance case: ``build(gen, device)`` gives the op's keyword arguments; a ``native_fp8`` case's
    ``build(gen, device, fp8)`` takes the backend's own fp8 format, so every backend runs it."""

    op: str
    name: str
    build: Callable[..., dict[str, Any]]
    native_fp8: bool = False


CASES: list[Case] = []


def case(op: str, name: str, native_fp8: bool = False):
    def register(build):
        CASES.append(Case(op, name, build, native_fp8))
        return build

    return register


def _ints(gen, low, high, shape) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, dtype=I32)


# ---------------------------------------------------------------------------------------------- translate


def _translate_args(gen, dev, rows, k, batches, pages, page_size, r2b=False, strided=False):
    span = pages * page_size
    raw = _ints(gen, -3, span + page_size + 2, (rows, 2 * k if strided else k))
    table = _ints(gen, -2, 4 * pages + 8, (batches, 2 * pages if strided else pages))
    seq = _ints(gen, -2, span + 4, (rows,))
    args = dict(raw=raw.to(dev), page_table=table.to(dev), seq_lens=seq.to(dev), page_size=page_size)
    if strided:
        args["raw"], args["page_table"] = args["raw"][:, ::2], args["page_table"][:, ::2]
    if r2b:
        args["row_to_batch"] = _ints(gen, -1, batches + 1, (rows,)).to(dev)
    return args


@case("translate", "worked example, page 64 (REFERENCE)")
def _(gen, dev):
    return dict(raw=torch.tensor([[0, 63, 64, -1]], dtype=I32, device=dev),
                page_table=torch.tensor([[10, 11]], dtype=I32, device=dev),
                seq_lens=torch.tensor([128], dtype=I32, device=dev), page_size=64)


@case("translate", "worked example, holes and beyond seq_len (REFERENCE)")
def _(gen, dev):
    table = torch.tensor([[100, 101, 102, -1, 5, 6, 7, 8, 9]], dtype=I32, device=dev)
    return dict(raw=torch.tensor([[0, 63, 64, 127, 128, -1, 512]], dtype=I32, device=dev), page_table=table,
                seq_lens=torch.tensor([256], dtype=I32, device=dev), page_size=64)


for _ps in (1, 3, 16, 64, 65, 96, 100, 129, 200):
    case("translate", f"random guards, page {_ps}")(
        lambda gen, dev, ps=_ps: _translate_args(gen, dev, rows=24, k=67, batches=24, pages=9, page_size=ps))


@case("translate", "row_to_batch, prefill rows sharing a table, page 64")
def _(gen, dev):
    return _translate_args(gen, dev, rows=40, k=33, batches=3, pages=6, page_size=64, r2b=True)


@case("translate", "non-contiguous raw and table, page 32")
def _(gen, dev):
    return _translate_args(gen, dev, rows=16, k=40, batches=16, pages=5, page_size=32, strided=True)


@case("translate", "token-level table (page 1, req_to_token)")
def _(gen, dev):
    return _translate_args(gen, dev, rows=8, k=100, batches=8, pages=300, page_size=1)


@case("translate", "adversarial values (int32 extremes, huge lengths)")
def _(gen, dev):
    raw = torch.tensor([[2**31 - 1, -(2**31), -1, 0, 4095, 4096, 10**9]] * 3, dtype=I32)
    table = torch.tensor([[2**20, -(2**31), 2**31 - 1, 7]] * 2, dtype=I32)
    seq = torch.tensor([2**31 - 1, -5, 4096], dtype=I32)
    r2b = torch.tensor([0, 2**31 - 1, -(2**31)], dtype=I32)
    return dict(raw=raw.to(dev), page_table=table.to(dev), seq_lens=seq.to(dev), page_size=1024,
                row_to_batch=r2b.to(dev))


@case("translate", "k = 0")
def _(gen, dev):
    return _translate_args(gen, dev, rows=5, k=0, batches=5, pages=4, page_size=64)


@case("translate", "rows = 0")
def _(gen, dev):
    return _translate_args(gen, dev, rows=0, k=16, batches=2, pages=4, page_size=64)


@case("translate", "empty page table")
def _(gen, dev):
    return _translate_args(gen, dev, rows=4, k=8, batches=4, pages=0, page_size=64)


@case("translate", "preallocated out")
def _(gen, dev):
    args = _translate_args(gen, dev, rows=12, k=50, batches=12, pages=7, page_size=64)
    args["out"] = torch.full((12, 50), 12345, dtype=I32, device=dev)
    return args


# ---------------------------------------------------------------------------------------------- top-k


def _scores(gen, rows, cols, dtype=torch.float32, distinct=True):
    if distinct:
        s = torch.randn(rows, cols, generator=gen)
    else:
        s = torch.randint(0, 8, (rows, cols), generator=gen).float()
    return s.to(dtype)


def _topk_args(gen, dev, scores, k, lengths=None, starts=None, **extra):
    rows, cols = scores.shape
    if lengths is None:
        lengths = _ints(gen, 0, cols + 1, (rows,))
    args = dict(scores=scores.to(dev), lengths=lengths.to(dev), k=k, **extra)
    if starts is not None:
        args["row_starts"] = starts.to(dev)
    return args


@case("topk", "random rows, k 64")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 12, 3000), 64)


@case("topk", "full rows, k 2048 of 20000")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 2, 20000), 2048, lengths=torch.tensor([20000, 15000], dtype=I32))


@case("topk", "k 513, odd")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 4, 4000), 513, lengths=torch.tensor([4000, 514, 513, 3001], dtype=I32))


@case("topk", "k 1")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 6, 700), 1)


@case("topk", "rows full of ties (lower index wins)")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 6, 2500, distinct=False), 100)


@case("topk", "all scores equal")
def _(gen, dev):
    return _topk_args(gen, dev, torch.ones(3, 1000), 37, lengths=torch.tensor([1000, 500, 38], dtype=I32))


@case("topk", "-inf rows and NaN never selected")
def _(gen, dev):
    s = _scores(gen, 5, 1200)
    s[0] = float("-inf")
    s[1, ::3] = float("nan")
    s[2] = float("nan")
    s[3, 10:] = float("-inf")
    s[4, :] = float("-inf")
    s[4, 5] = float("nan")
    s[4, 7] = float("inf")
    return _topk_args(gen, dev, s, 50, lengths=torch.full((5,), 1200, dtype=I32))


@case("topk", "lengths 0, 1, k, k+1 and negative")
def _(gen, dev):
    k = 64
    lengths = torch.tensor([0, 1, k - 1, k, k + 1, -1, -(2**31), 2**31 - 1], dtype=I32)
    return _topk_args(gen, dev, _scores(gen, 8, 1500), k, lengths=lengths)


@case("topk", "row_starts windows (clipped to the columns)")
def _(gen, dev):
    starts = torch.tensor([0, 100, 1999, 2000, 1500, -7, 2**31 - 1, 300], dtype=I32)
    lengths = torch.tensor([2000, 900, 5, 10, 1000, 100, 100, 1700], dtype=I32)
    return _topk_args(gen, dev, _scores(gen, 8, 2000), 128, lengths=lengths, starts=starts)


@case("topk", "non-contiguous scores")
def _(gen, dev):
    args = _topk_args(gen, dev, _scores(gen, 6, 5000), 200)
    args["scores"] = args["scores"][:, ::2]
    args["lengths"] = args["lengths"].clamp(max=2500)
    return args


@case("topk", "bfloat16 scores")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 6, 3000, dtype=torch.bfloat16), 256)


@case("topk", "sorted output")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 4, 1000, distinct=False), 90, sorted=True)


@case("topk", "k = 0")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 3, 100), 0)


@case("topk", "rows = 0")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 0, 100), 16)


@case("topk", "k larger than the columns")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 3, 40), 64)


@case("topk", "preallocated out")
def _(gen, dev):
    return _topk_args(gen, dev, _scores(gen, 5, 2000), 100, out=torch.full((5, 100), 777, dtype=I32, device=dev))


def _producer_args(gen, dev, rows, cols, k, page_size, batches=None, dtype=torch.float32):
    args = _topk_args(gen, dev, _scores(gen, rows, cols, dtype=dtype), k)
    batches = batches or rows
    pages = -(-cols // page_size) + 1
    args["page_table"] = _ints(gen, -1, 50 * pages, (batches, pages)).to(dev)
    args["page_size"] = page_size
    if batches != rows:
        args["row_to_batch"] = _ints(gen, 0, batches, (rows,)).to(dev)
    return args


@case("topk_translate", "page 64 with out_raw")
def _(gen, dev):
    args = _producer_args(gen, dev, 8, 3000, 128, 64)
    args["out_raw"] = torch.full((8, 128), 999, dtype=I32, device=dev)
    return args


@case("topk_translate", "page 1 token table, no out_raw")
def _(gen, dev):
    return _producer_args(gen, dev, 6, 1500, 100, 1)


@case("topk_translate", "page 48 (not a power of two), row_to_batch, ties")
def _(gen, dev):
    args = _producer_args(gen, dev, 10, 2000, 77, 48, batches=3)
    args["scores"] = args["scores"].round()
    args["out_raw"] = torch.empty((10, 77), dtype=I32, device=dev)
    return args


# Page sizes that are not a multiple of a kernel's key tile (64): a tile crosses a page end.
ODD_PAGES = (65, 96, 100, 129, 200)

for _ps in ODD_PAGES:
    case("topk_translate", f"page {_ps} (not a multiple of the 64-key tile), out_raw")(
        lambda gen, dev, ps=_ps: dict(_producer_args(gen, dev, 4, 3 * ps + 5, 96, ps),
                                      out_raw=torch.empty((4, 96), dtype=I32, device=dev)))


@case("topk_translate", "bfloat16, row_starts, page 64")
def _(gen, dev):
    args = _producer_args(gen, dev, 6, 2500, 200, 64, dtype=torch.bfloat16)
    args["row_starts"] = _ints(gen, 0, 600, (6,)).to(dev)
    args["out_raw"] = torch.empty((6, 200), dtype=I32, device=dev)
    return args


@case("topk_translate", "sorted, page 64 with out_raw, ties")
def _(gen, dev):
    args = _producer_args(gen, dev, 8, 3000, 300, 64)
    args["scores"] = args["scores"].round()
    args["out_raw"] = torch.full((8, 300), 999, dtype=I32, device=dev)
    args["sorted"] = True
    return args


@case("topk_translate", "sorted, page 1, no out_raw, row_starts")
def _(gen, dev):
    args = _producer_args(gen, dev, 6, 2000, 128, 1)
    args["row_starts"] = _ints(gen, 0, 600, (6,)).to(dev)
    args["sorted"] = True
    return args


# ---------------------------------------------------------------------------------------------- logits


def _fp8(t: torch.Tensor, dtype) -> torch.Tensor:
    limit = float(torch.finfo(dtype).max)
    return t.clamp(-limit, limit).to(dtype)


def _mqa_args(gen, dev, tokens, keys, heads, dtype, ks=None, ke=None, dim=128, scale=4.0):
    q = torch.randn(tokens, heads, dim, generator=gen) * scale
    k = torch.randn(keys, dim, generator=gen) * scale
    if dtype == torch.bfloat16:
        q, k = q.to(dtype), k.to(dtype)
    else:
        q, k = _fp8(q, dtype), _fp8(k, dtype)
    if ks is None:  # causal prefill over a prefix of keys - tokens
        ke = torch.arange(keys - tokens + 1, keys + 1, dtype=I32).clamp(min=0)
        ks = torch.zeros(tokens, dtype=I32)
    k_scale = torch.exp2(torch.randint(-8, 2, (keys,), generator=gen).float())
    weights = torch.randn(tokens, heads, generator=gen) / heads
    return dict(q=q.to(dev), k=k.to(dev), k_scale=k_scale.to(dev), weights=weights.to(dev), ks=ks.to(dev),
                ke=ke.to(dev))


for _dt, _label in ((E4M3, "fp8 e4m3fn"), (E4M3_FNUZ, "fp8 e4m3fnuz"), (torch.bfloat16, "bf16")):
    case("mqa_logits", f"causal prefill, H 64, {_label}")(
        lambda gen, dev, dt=_dt: _mqa_args(gen, dev, 24, 300, 64, dt))


@case("mqa_logits", "full, empty and context-parallel windows, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    tokens, keys = 12, 257
    ks = torch.tensor([0, 0, 5, 100, 256, 257, 300, -4, 30, 0, 128, 64], dtype=I32)
    ke = torch.tensor([257, 0, 5, 200, 257, 257, 400, 10, 20, 1, 256, 2**31 - 1], dtype=I32)
    return _mqa_args(gen, dev, tokens, keys, 16, fp8, ks=ks, ke=ke)


@case("mqa_logits", "native fp8 extremes (max and subnormal values)", native_fp8=True)
def _(gen, dev, fp8):
    args = _mqa_args(gen, dev, 6, 130, 8, fp8)
    top = fp8_max(fp8)
    big = torch.tensor([top, -top, 2.0**-9, -(2.0**-9), 2.0**-7, 0.0])
    pick = torch.randint(0, 6, (130, 128), generator=gen)
    args["k"] = big[pick].to(fp8).to(dev)
    args["q"][0] = torch.full((8, 128), top).to(fp8).to(dev)
    return args


@case("mqa_logits", "scale extremes, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = _mqa_args(gen, dev, 8, 200, 16, fp8)
    args["k_scale"] = torch.exp2(torch.randint(-40, 40, (200,), generator=gen).float()).to(dev)
    return args


@case("mqa_logits", "no keys, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return _mqa_args(gen, dev, 4, 0, 8, fp8, ks=torch.zeros(4, dtype=I32), ke=torch.zeros(4, dtype=I32))


def _nan_logits_args(gen, dev, dtype):
    """NaN in weights and k_scale, and for bf16 also in q and k (the Triton interpreter decodes fp8 NaN bytes
    in a dot as 480, so fp8 NaN operands are left to the GPU tests)."""
    args = {name: t.cpu() for name, t in _mqa_args(gen, dev, 6, 130, 8, dtype).items()}
    nan = float("nan")
    args["weights"][3, 1] = nan
    args["k_scale"][20] = nan
    if dtype == torch.bfloat16:
        args["q"][1, 2, 5] = nan
        args["k"][7, 0] = nan
    return {name: t.to(dev) for name, t in args.items()}


case("mqa_logits", "NaN in weights and k_scale propagates, native fp8", native_fp8=True)(
    lambda gen, dev, fp8: _nan_logits_args(gen, dev, fp8))
case("mqa_logits", "NaN in q, k, weights and k_scale propagates, bf16")(
    lambda gen, dev: _nan_logits_args(gen, dev, torch.bfloat16))


def _paged_args(gen, dev, batch, next_n, heads, page_size, context, dtype=E4M3, holes=False, pages_per_req=None,
                last_page=False):
    """``last_page``: request 0's first table entry is the cache's last page, so a key tile that crosses that
    page's end inside the context reads past the tensor."""
    dim = 128
    pages_per_req = pages_per_req or max(1, -(-max(context) // page_size))
    num_pages = batch * pages_per_req + 3
    k = torch.randn(num_pages * page_size, dim, generator=gen) * 3
    cache = new_packed_cache(num_pages, page_size, dim)
    cache = reference.store_index_k(k, cache, torch.arange(num_pages * page_size, dtype=I32), dtype)
    table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_req].view(batch, pages_per_req).to(I32)
    if last_page:
        table[table == num_pages - 1] = table[0, 0].item()
        table[0, 0] = num_pages - 1
    if holes:
        table[:, 1::3] = -1
        table[0, 0] = num_pages + 5
    q = _fp8(torch.randn(batch, next_n, heads, dim, generator=gen) * 3, dtype)
    weights = torch.randn(batch * next_n, heads, generator=gen) / heads
    lens = torch.tensor(context, dtype=I32)
    max_len = pages_per_req * page_size
    return dict(q=q.to(dev), k_cache=cache.to(dev), weights=weights.to(dev), context_lens=lens.to(dev),
                page_table=table.to(dev), max_context_len=max_len)


for _ps in (16, 32, 64, 128):
    case("paged_mqa_logits", f"decode, page {_ps}, native fp8", native_fp8=True)(
        lambda gen, dev, fp8, ps=_ps: _paged_args(gen, dev, 3, 1, 32, ps, [300, 1, 257], dtype=fp8))

for _ps in ODD_PAGES:
    case("paged_mqa_logits", f"page {_ps} (not a multiple of the 64-key tile), the cache's last page first, next_n 2, "
         "native fp8", native_fp8=True)(
        lambda gen, dev, fp8, ps=_ps: _paged_args(gen, dev, 2, 2, 16, ps, [3 * ps, ps + 7], dtype=fp8,
                                                  last_page=True))

for _nn in (2, 3, 4):
    case("paged_mqa_logits", f"speculative verify, next_n {_nn}, page 64, native fp8", native_fp8=True)(
        lambda gen, dev, fp8, nn=_nn: _paged_args(gen, dev, 3, nn, 16, 64, [200, nn, 129], dtype=fp8))


@case("paged_mqa_logits", "page table with holes and entries beyond the cache, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return _paged_args(gen, dev, 2, 2, 16, 32, [250, 190], dtype=fp8, holes=True)


@case("paged_mqa_logits", "context length 0 and contexts beyond the table, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return _paged_args(gen, dev, 3, 1, 8, 64, [0, 10**6, 64], dtype=fp8, pages_per_req=2)


@case("paged_mqa_logits", "NaN key (scale NaN in the cache) and NaN weights propagate, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = {name: t.cpu() if isinstance(t, torch.Tensor) else t
            for name, t in _paged_args(gen, dev, 2, 2, 16, 64, [150, 100], dtype=fp8).items()}
    bad = torch.randn(2, 128, generator=gen)
    bad[0, 3], bad[1, 0] = float("nan"), float("inf")
    slots = (args["page_table"][:, 0].long() * 64 + torch.tensor([10, 70])).to(I32)  # position 10 of each request
    args["k_cache"] = reference.store_index_k(bad, args["k_cache"], slots, fp8)
    args["weights"][3, 0] = float("nan")
    return {name: t.to(dev) if isinstance(t, torch.Tensor) else t for name, t in args.items()}


@case("paged_mqa_logits", "fp8 e4m3fnuz cache, H 64")
def _(gen, dev):
    return _paged_args(gen, dev, 2, 1, 64, 64, [190, 64], dtype=E4M3_FNUZ)


@case("paged_mqa_logits", "DeepGEMM's 4-D cache view, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = _paged_args(gen, dev, 2, 1, 16, 64, [100, 128], dtype=fp8)
    args["k_cache"] = args["k_cache"].view(args["k_cache"].shape[0], 64, 1, 132)
    return args


# ---------------------------------------------------------------------------------------------- fp8 cache


for _dt, _label in ((E4M3, "e4m3fn"), (E4M3_FNUZ, "e4m3fnuz")):
    case("quantize_index_k", f"random bf16 keys, {_label}")(
        lambda gen, dev, dt=_dt: dict(k=(torch.randn(64, 256, generator=gen) * 10).to(torch.bfloat16).to(dev),
                                      fp8_dtype=dt))


@case("quantize_index_k", "extremes: zero rows, tiny and huge blocks, exact powers of two")
def _(gen, dev):
    k = torch.randn(6, 128, generator=gen)
    k[0] = 0
    k[1] *= 1e-7
    k[2] *= 1e5
    k[3, 0] = 448.0
    k[4, 0] = 896.0
    k[5] = -(2.0**-20)
    return dict(k=k.to(dev), fp8_dtype=E4M3)


@case("quantize_index_k", "blocks holding NaN, +inf or -inf: scale NaN, zero values, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    k = torch.randn(4, 256, generator=gen)
    k[0, 5] = float("nan")
    k[1, 130] = float("inf")
    k[2, :128] = float("-inf")
    return dict(k=k.to(dev), fp8_dtype=fp8)


@case("store_index_k", "tokens holding NaN, +inf or -inf: scale NaN, zero bytes, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    k = torch.randn(8, 128, generator=gen)
    k[1, 3], k[2, 0], k[3] = float("nan"), float("inf"), float("-inf")
    return dict(k=k.to(dev), k_cache=new_packed_cache(2, 64).to(dev), slot_mapping=torch.arange(8, dtype=I32).to(dev),
                fp8_dtype=fp8)


for _dt, _label in ((E4M3, "e4m3fn"), (E4M3_FNUZ, "e4m3fnuz")):
    @case("store_index_k", f"slots with -1 and beyond the cache, page 64, {_label}")
    def _(gen, dev, dt=_dt):
        slots = torch.randperm(6 * 64, generator=gen)[:50].to(I32)
        slots[::7] = -1
        slots[3] = 6 * 64
        slots[4] = 2**31 - 1
        return dict(k=(torch.randn(50, 128, generator=gen) * 5).to(dev), k_cache=new_packed_cache(6, 64).to(dev),
                    slot_mapping=slots.to(dev), fp8_dtype=dt)


for _ps in ODD_PAGES:
    @case("store_index_k", f"page {_ps} (not a multiple of the 64-key tile), the cache's last slots, native fp8",
          native_fp8=True)
    def _(gen, dev, fp8, ps=_ps):
        pages = 3
        slots = torch.randperm(pages * ps, generator=gen)[:40].to(I32)
        slots[:3] = torch.tensor([pages * ps - 1, pages * ps - 2, ps], dtype=I32)
        slots[5] = pages * ps
        return dict(k=(torch.randn(40, 128, generator=gen) * 5).to(dev), k_cache=new_packed_cache(pages, ps).to(dev),
                    slot_mapping=slots.to(dev), fp8_dtype=fp8)


def cases_for(op: str | None = None) -> list[Case]:
    """The catalogue, or the cases of one op."""
    return [c for c in CASES if op is None or c.op == op]
