"""``indexcache bench``: the machine's ceilings and every op per backend, measured in one run.

The ceilings come first, only those the requested ops need: device-to-device copy bandwidth (a
large copy, bytes read plus written), the fp8 (``torch._scaled_mm``) and bf16 matmul rates on 8192³
for the logits ops, and the time of an empty Triton kernel launch; top-k's roofline is per case (one
read of its scores). Then each case of each op runs on each backend:
checked against the torch backend on fresh inputs, then timed as the median of many calls after
warm-up (CUDA events on a GPU, the host clock elsewhere), rotating through enough input sets to
exceed four times the L2 cache. On a GPU each case is also timed as replays of one CUDA graph
holding one call per input set (the device time without the host's launch cost).

An op plugs in as data: a :class:`BenchOp` in :data:`OPS` (cases, an input builder, the bytes and
FLOPs a call must move and do, the call itself). Derived numbers (fraction of a ceiling, ratio to
the empty launch, speed-up over torch) only compare measurements of one mode: a CPU or
interpreted-Triton time is never set against a GPU one, nor reported as a speed.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import indexcache
from indexcache import dispatch, ops
from indexcache.conformance.check import BOUNDS, _check_logits, _check_topk
from indexcache.layout import new_packed_cache, split_packed_cache

SCHEMA = "indexcache-bench/1"
BASELINE = "torch"
POISON = -2  # never a valid translate output: shows slots a backend left unwritten
MIN_SETS, MAX_SETS = 2, 256
BUDGET_S = 0.5  # on a GPU, a timing stops after about this long (at least MIN_REPS calls): slow baselines stay cheap
MIN_REPS = 3
COMMIT_ENV = "INDEXCACHE_COMMIT"  # the commit to record where the checkout has no .git (e.g. a copied tree)


# ----------------------------------------------------------------------------------------------- ops as data


@dataclass(frozen=True)
class Case:
    """One shape of an op: its name in the table, the parameters the builder reads, and a note."""

    name: str
    params: Mapping[str, Any]
    note: str = ""


def _equal(a: Any, b: Any, case: Case | None = None) -> bool:
    return torch.equal(a.cpu(), b.cpu())


def _no_flops(case: Case) -> int:
    return 0


@dataclass(frozen=True)
class BenchOp:
    """An op as the harness sees it.

    ``cases(quick)`` gives the shapes; ``build(case, gen)`` one input set on the CPU (from the CPU
    generator ``gen``, so every device gets the same values), output buffers included and filled
    with a poison value; ``call(args, backend)`` runs it and returns the result; ``bytes`` and
    ``flops`` count the least memory traffic and arithmetic of one call; ``roofline`` names the
    :data:`CEILINGS` entry the achieved rate is a fraction of (or gives it per case, ``roofline(case)``);
    ``ceilings`` names more ceilings to measure in the same run; ``same(result, baseline, case)`` says
    whether a backend agrees with the torch backend (True, or ``""``; False or a string saying what differs).

    ``extras`` are more rows timed on the torch backend's device and inputs, e.g. a torch primitive to beat
    (``{"torch.topk": fn(args)}``); each is checked with ``same`` too, and every row's ``speedup_vs_extra``
    is over the first. ``floor(args)``, where given, is the op's roofline measured per case: its time on
    the same inputs (e.g. reading the scores once) is the least time a call can take, for a roofline
    :data:`CEILINGS` entry without a ``measure``.
    """

    name: str
    cases: Callable[[bool], Sequence[Case]]
    build: Callable[[Case, torch.Generator], dict[str, Any]]
    call: Callable[[Mapping[str, Any], str], Any]
    bytes: Callable[[Case], int]
    flops: Callable[[Case], int] = _no_flops
    roofline: str | Callable[[Case], str] = "copy_bandwidth"
    same: Callable[[Any, Any, Case], bool | str] = _equal
    ceilings: tuple[str, ...] = ()
    extras: Mapping[str, Callable[[Mapping[str, Any]], Any]] = dataclasses.field(default_factory=dict)
    floor: Callable[[Mapping[str, Any]], Any] | None = None

    def roofline_of(self, case: Case) -> str:
        return self.roofline(case) if callable(self.roofline) else self.roofline


def _translate_cases(quick: bool) -> list[Case]:
    r2b = "row_to_batch maps each query row to its request's table row (the table is not copied per row)"
    per_row = "one table row per query row (row_to_batch=None)"
    if quick:
        return [
            Case("prefill 2x8 rows k64 page4", dict(requests=2, rows_per_request=8, k=64, page_size=4, context=512),
                 r2b),
            Case("decode 4 rows k48 page3", dict(requests=4, rows_per_request=1, k=48, page_size=3, context=300),
                 per_row),
            Case("token table 4 rows k64 page1", dict(requests=4, rows_per_request=1, k=64, page_size=1,
                                                      context=1024), per_row),
        ]
    ctx = 128 * 1024
    return [
        Case("prefill 8x1024 rows k2048 page64 128K", dict(requests=8, rows_per_request=1024, k=2048, page_size=64,
                                                          context=ctx), r2b),
        Case("decode 64 rows k2048 page64 128K", dict(requests=64, rows_per_request=1, k=2048, page_size=64,
                                                     context=ctx), per_row),
        Case("decode 64 rows k512 page64 128K", dict(requests=64, rows_per_request=1, k=512, page_size=64,
                                                    context=ctx), per_row),
        Case("token table 64 rows k2048 page1 128K", dict(requests=64, rows_per_request=1, k=2048, page_size=1,
                                                         context=ctx), per_row),
    ]


def _translate_build(case: Case, gen: torch.Generator) -> dict[str, Any]:
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


def _translate_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    return ops.translate(a["raw"], a["page_table"], a["seq_lens"], a["page_size"], row_to_batch=a["row_to_batch"],
                         out=a["out"], backend=backend)


def _translate_bytes(case: Case) -> int:
    """12 bytes an index: the raw index read, its table entry read, the result written."""
    p = case.params
    return 12 * p["requests"] * p["rows_per_request"] * p["k"]


TRANSLATE = BenchOp("translate", _translate_cases, _translate_build, _translate_call, _translate_bytes)

# ----------------------------------------------------------------------------------------------- logits

E4M3 = torch.float8_e4m3fn
HEADS, DIM, LOGITS_PAGE = 64, 128, 64
TOKEN_BYTES = DIM + 4  # a cached token: D fp8 bytes and a float32 scale


def _same_logits(got: torch.Tensor, want: torch.Tensor, case: Case) -> str:
    """The conformance rule against the torch backend: -inf in the same places, no NaN, relative RMS error
    of the finite values within the tensor-core bound of the key dtype (fp8 1e-3, bf16 1e-2)."""
    bound = BOUNDS[(case.params.get("kind", "fp8"), "tensor-core")]
    return _check_logits(got, want.to(got.device), bound)[0]


def _mqa_cases(quick: bool) -> list[Case]:
    def case(tokens: int, keys: int, heads: int, kind: str, causal: bool) -> Case:
        size = f"{keys // 1024}K" if keys >= 1024 else str(keys)
        return Case(f"{kind} {tokens}x{size} {'causal' if causal else 'full'} H{heads}",
                    dict(tokens=tokens, keys=keys, heads=heads, dim=DIM, kind=kind, causal=causal))

    if quick:
        return [case(16, 200, 16, "fp8", True), case(16, 200, 16, "fp8", False), case(16, 200, 16, "bf16", True)]
    return [case(4096, 32768, HEADS, kind, causal) for kind in ("fp8", "bf16") for causal in (True, False)]


def _mqa_build(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """q, k random; fp8 keys quantized per token (torch backend), bf16 keys with a random scale; the causal
    window of query t is keys [0, keys - tokens + 1 + t), the full one every key."""
    p = case.params
    tokens, keys, heads, dim = p["tokens"], p["keys"], p["heads"], p["dim"]
    k_raw = torch.randn(keys, dim, generator=gen)
    if p["kind"] == "fp8":
        k, scale = ops.quantize_index_k(k_raw, E4M3, backend=BASELINE)
        k_scale = scale.reshape(keys).contiguous()
        q = (torch.randn(tokens, heads, dim, generator=gen) * 24).clamp(-400, 400).to(E4M3)
    else:
        k, k_scale = k_raw.bfloat16(), torch.rand(keys, generator=gen) + 0.5
        q = torch.randn(tokens, heads, dim, generator=gen).bfloat16()
    weights = torch.randn(tokens, heads, generator=gen) * heads**-0.5
    t = torch.arange(tokens, dtype=torch.int32)
    ke = keys - tokens + 1 + t if p["causal"] else torch.full_like(t, keys)
    return dict(q=q, k=k, k_scale=k_scale, weights=weights, ks=torch.zeros_like(t), ke=ke.int(),
                out=torch.full((tokens, keys), float("nan")))


def _mqa_pairs(case: Case) -> int:
    p = case.params
    tokens, keys = p["tokens"], p["keys"]
    if not p["causal"]:
        return tokens * keys
    return sum(max(0, min(keys, keys - tokens + 1 + t)) for t in range(tokens))


def _mqa_flops(case: Case) -> int:
    """2·H·D FLOPs an in-window (query, key) pair; pairs outside the window are not counted."""
    return 2 * case.params["heads"] * case.params["dim"] * _mqa_pairs(case)


def _mqa_bytes(case: Case) -> int:
    """q, k, scales, weights and windows read once; the [T, N] float32 logits written."""
    p = case.params
    elem = 1 if p["kind"] == "fp8" else 2
    tokens, keys, heads, dim = p["tokens"], p["keys"], p["heads"], p["dim"]
    return elem * (tokens * heads * dim + keys * dim) + 4 * keys + 4 * tokens * heads + 8 * tokens + 4 * tokens * keys


def _mqa_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    return ops.mqa_logits(a["q"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"], out=a["out"],
                          backend=backend)


def _paged_cases(quick: bool) -> list[Case]:
    def case(batch: int, context: int, next_n: int, heads: int, page: int) -> Case:
        size = f"{context // 1024}K" if context >= 1024 else str(context)
        return Case(f"{batch}x{size} next_n={next_n} page{page} H{heads}",
                    dict(batch=batch, context=context, next_n=next_n, heads=heads, dim=DIM, page_size=page,
                         kind="fp8"))

    if quick:
        return [case(2, 300, 1, 16, 64), case(2, 300, 2, 16, 64)]
    return [case(64, context, next_n, HEADS, LOGITS_PAGE) for context in (32768, 131072) for next_n in (1, 2)]


def _paged_build(case: Case, gen: torch.Generator) -> dict[str, Any]:
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


def _paged_bytes(case: Case) -> int:
    """132 bytes a cached token read (128 fp8 + a float32 scale), 4 bytes a logit written."""
    p = case.params
    return TOKEN_BYTES * p["batch"] * p["context"] + 4 * p["batch"] * p["next_n"] * p["context"]


def _paged_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    return ops.paged_mqa_logits(a["q"], a["k_cache"], a["weights"], a["context_lens"], a["page_table"],
                                a["max_context_len"], out=a["out"], backend=backend)


MQA_LOGITS = BenchOp("mqa_logits", _mqa_cases, _mqa_build, _mqa_call, _mqa_bytes, flops=_mqa_flops,
                     roofline=lambda case: f"{case.params['kind']}_matmul", same=_same_logits,
                     ceilings=("copy_bandwidth",))
PAGED_MQA_LOGITS = BenchOp("paged_mqa_logits", _paged_cases, _paged_build, _paged_call, _paged_bytes,
                           same=_same_logits, ceilings=("fp8_matmul", "bf16_matmul"))


# ----------------------------------------------------------------------------------------------- top-k

TOPK_PAGE = 64


def _topk_cases(quick: bool) -> list[Case]:
    def case(rows: int, cols: int, k: int) -> Case:
        size = f"{cols >> 20}M" if cols >= 1 << 20 else f"{cols >> 10}K" if cols >= 1024 else str(cols)
        return Case(f"{rows}x{size} k{k}", dict(rows=rows, cols=cols, k=k, page_size=TOPK_PAGE))

    if quick:
        return [case(4, 4096, 64), case(1, 16384, 512)]
    return [case(64, 131072, 2048), case(64, 131072, 512), case(1, 131072, 2048), case(1, 1 << 20, 2048),
            case(2048, 32768, 2048)]


def _topk_build(case: Case, gen: torch.Generator) -> dict[str, Any]:
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


def _topk_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    return ops.topk(a["scores"], a["lengths"], a["k"], out=a["out"], backend=backend)


def _topk_translate_call(a: Mapping[str, Any], backend: str) -> tuple:
    phys = ops.topk_translate(a["scores"], a["lengths"], a["k"], a["page_table"], a["page_size"], out=a["out"],
                              out_raw=a["out_raw"], backend=backend)
    return phys, a["out_raw"], a


def _torch_topk(a: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk's indices, with the scores: its tie rule is not ours, so it is checked by the scores it picks."""
    return torch.topk(a["scores"], a["k"], dim=1, sorted=False).indices, a["scores"]


def _read_once(a: Mapping[str, Any]) -> torch.Tensor:
    return a["scores"].sum()


def _topk_bytes(case: Case) -> int:
    """The scores read once, the int32 result written."""
    p = case.params
    return 4 * p["rows"] * p["cols"] + 4 * p["rows"] * p["k"]


def _topk_translate_bytes(case: Case) -> int:
    """The scores read once; raw and physical int32 results written, a table entry read for each."""
    p = case.params
    return 4 * p["rows"] * p["cols"] + 12 * p["rows"] * p["k"]


def _same_topk(got: torch.Tensor, want: torch.Tensor, case: Case | None = None) -> str:
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
    return _check_topk(got.cpu(), want.cpu(), False) or "differs"


def _same_topk_translate(got: tuple, want: tuple, case: Case) -> str:
    """``out_raw`` has each row's index set, and ``out`` is ``translate(out_raw)`` slot by slot (translate
    by the torch backend, itself checked exactly against the reference by the conformance suite)."""
    phys, raw, a = got
    if detail := _same_topk(raw, want[1]):
        return f"out_raw: {detail}"
    again = ops.translate(raw, a["page_table"], a["lengths"], a["page_size"], backend=BASELINE)
    return "" if torch.equal(phys, again) else "out is not translate(out_raw)"


TOPK = BenchOp("topk", _topk_cases, _topk_build, _topk_call, _topk_bytes, roofline="read_once", same=_same_topk,
               extras={"torch.topk": _torch_topk}, floor=_read_once)
TOPK_TRANSLATE = BenchOp("topk_translate", _topk_cases, _topk_build,
                         _topk_translate_call, _topk_translate_bytes, roofline="read_once",
                         same=_same_topk_translate, floor=_read_once)

OPS: dict[str, BenchOp] = {op.name: op for op in (TRANSLATE, MQA_LOGITS, PAGED_MQA_LOGITS, TOPK, TOPK_TRANSLATE)}


# ----------------------------------------------------------------------------------------------- timing


def _gpu(device: torch.device) -> bool:
    return device.type == "cuda"


class Timer:
    """Median time of one call, in µs: CUDA events on a GPU, the host clock on the CPU.

    ``fn(i)`` runs the call on input set ``i``; the timer passes 0, 1, 2, … and ``fn`` rotates. On a GPU
    one timed call first estimates the cost: warm-up and timed calls stop at about :data:`BUDGET_S` each
    (never fewer than :data:`MIN_REPS` timed), so a baseline 100× slower does not cost 100× the time.
    """

    def __init__(self, device: torch.device, warmup: int, reps: int, graph_reps: int):
        self.device, self.warmup, self.reps, self.graph_reps = device, warmup, reps, graph_reps

    def eager_us(self, fn: Callable[[int], Any]) -> float:
        """Each call timed on its own, after ``warmup`` untimed calls."""
        if _gpu(self.device):
            fn(0)  # compiles; then up to warmup - 1 more within the budget
            warm = self._fit(lambda: fn(1), self.warmup - 1)
            for i in range(2, warm + 1):
                fn(i)
        else:
            for i in range(self.warmup):
                fn(i)
        if not _gpu(self.device):
            times = []
            for i in range(self.reps):
                t0 = time.perf_counter()
                fn(self.warmup + i)
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        reps = self._fit(lambda: fn(self.warmup), self.reps)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (start, end) in enumerate(marks):
            start.record()
            fn(self.warmup + i)
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in marks) * 1e3

    def _fit(self, once: Callable[[], Any], wanted: int) -> int:
        """Time ``once()`` alone; how many of ``wanted`` calls fit in the budget (at least MIN_REPS)."""
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        torch.cuda.synchronize(self.device)
        return max(MIN_REPS, min(wanted, int(BUDGET_S * 1e3 / max(start.elapsed_time(end), 1e-3))))

    def graph_us(self, fn: Callable[[int], Any], calls: int) -> float:
        """One CUDA graph holding ``calls`` calls (``fn(0) .. fn(calls-1)``), replayed; per call."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for i in range(calls):
                fn(i)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        graph.replay()  # warm-up; the estimating replay is the second
        reps = self._fit(graph.replay, self.graph_reps)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in marks:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in marks) * 1e3 / calls


# ----------------------------------------------------------------------------------------------- ceilings


@dataclass(frozen=True)
class Ceiling:
    """A rate ceiling: ``measure(timer, quick) -> (rate per second, details)``; ``counts`` says whether
    an op's bytes or FLOPs are set against it; ``unit``/``scale`` are for display. Without ``measure`` the
    ceiling is per case: the op's ``floor`` timed on the case's inputs (``description`` says what it is)."""

    name: str
    counts: str
    unit: str
    scale: float
    measure: Callable[[Timer, bool], tuple[float, dict[str, Any]]] | None
    description: str = ""


def _copy_bandwidth(timer: Timer, quick: bool) -> tuple[float, dict[str, Any]]:
    """Bytes read plus written per second by one large ``copy_`` of random int32 data."""
    size = (64 if quick else 1024) * 2**20 if _gpu(timer.device) else (8 if quick else 64) * 2**20
    src = torch.randint(-(2**31), 2**31 - 1, (size // 4,), dtype=torch.int32, device=timer.device)
    dst = torch.empty_like(src)
    us = timer.eager_us(lambda i: dst.copy_(src))
    return 2 * size / (us * 1e-6), {"bytes_moved": 2 * size, "time_us": us}


def _fp8_dtype(device: torch.device) -> torch.dtype:
    """e4m3fnuz on the AMD GPUs that use it (gfx94x), e4m3fn elsewhere."""
    if _gpu(device) and getattr(torch.version, "hip", None):
        arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
        if "gfx94" in arch:
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def _matmul_size(timer: Timer, quick: bool) -> int:
    return (1024 if quick else 8192) if _gpu(timer.device) else (128 if quick else 512)


def _fp8_matmul(timer: Timer, quick: bool) -> tuple[float, dict[str, Any]]:
    """FLOP/s of ``torch._scaled_mm`` on n³ fp8 (n = 8192 on a GPU), unit tensor-wide scales, bf16 out: the
    faster of promoted and fast accumulation (the logits kernels use neither promotion)."""
    n = _matmul_size(timer, quick)
    fp8 = _fp8_dtype(timer.device)
    a = torch.randn(n, n, device=timer.device).to(fp8)
    b = torch.randn(n, n, device=timer.device).to(fp8).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=timer.device)
    times = {fast: timer.eager_us(lambda i, f=fast: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                                     out_dtype=torch.bfloat16, use_fast_accum=f))
             for fast in (False, True)}
    us = min(times.values())
    return 2 * n**3 / (us * 1e-6), {"n": n, "dtype": str(fp8), "time_us": us, "promoted_us": times[False],
                                    "fast_accum_us": times[True]}


def _bf16_matmul(timer: Timer, quick: bool) -> tuple[float, dict[str, Any]]:
    """FLOP/s of ``torch.matmul`` on n³ bfloat16 (n = 8192 on a GPU)."""
    n = _matmul_size(timer, quick)
    a = torch.randn(n, n, device=timer.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=timer.device, dtype=torch.bfloat16)
    us = timer.eager_us(lambda i: torch.matmul(a, b))
    return 2 * n**3 / (us * 1e-6), {"n": n, "time_us": us}


CEILINGS: dict[str, Ceiling] = {
    "copy_bandwidth": Ceiling("copy_bandwidth", "bytes", "GB/s", 1e9, _copy_bandwidth),
    "fp8_matmul": Ceiling("fp8_matmul", "flops", "TFLOP/s", 1e12, _fp8_matmul),
    "bf16_matmul": Ceiling("bf16_matmul", "flops", "TFLOP/s", 1e12, _bf16_matmul),
    "read_once": Ceiling("read_once", "bytes", "GB/s", 1e9, None,
                         "per case: one scores.sum() over the case's inputs, timed like the op (graph on a GPU)"),
}


@functools.cache
def _empty_kernel():
    import triton

    @triton.jit
    def empty(x_ptr):
        pass

    return empty


def _launch(device: torch.device, timer: Timer, graph_ok: bool) -> dict[str, Any]:
    """An empty Triton kernel launch: eager (host issue + device) and, on a GPU, inside a graph."""
    from indexcache.backends.triton.target import interpreting

    found: dict[str, Any] = {"mode": None, "reason": "", "eager_us": None, "graph_us": None, "graph_error": None}
    try:
        import triton  # noqa: F401
    except ImportError:
        return {**found, "reason": "Triton is not installed"}
    if interpreting():
        mode, where = "interpreted", torch.device("cpu")
    elif _gpu(device):
        mode, where = "GPU", device
    else:
        return {**found, "reason": "no GPU: compiled Triton cannot launch (TRITON_INTERPRET=1 interprets it)"}
    kernel = _empty_kernel()
    buf = torch.zeros(1, dtype=torch.int32, device=where)

    def launch(i: int) -> None:
        kernel[(1,)](buf)

    t = timer if where == timer.device else Timer(where, timer.warmup, timer.reps, timer.graph_reps)
    found.update(mode=mode, eager_us=t.eager_us(launch))
    if graph_ok and mode == "GPU":
        try:
            found["graph_us"] = t.graph_us(launch, 100)
        except Exception as exc:  # reported with the ceiling; the ops still run
            found["graph_error"] = f"{type(exc).__name__}: {exc}"
    return found


# ----------------------------------------------------------------------------------------------- running


def _backends(op: BenchOp, requested: Sequence[str] | None) -> list[str]:
    """The backends to run, the torch baseline first (it always runs: speed-ups are over it)."""
    if requested:
        names = list(requested)
    else:
        names = [n for n in dispatch.available_backends() if op.name in dispatch.ops_of(n)]
    return [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]


def _to(args: Mapping[str, Any], device: torch.device, copy: bool = False) -> dict[str, Any]:
    return {k: v.to(device, copy=copy) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _nbytes(args: Mapping[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in args.values() if isinstance(v, torch.Tensor))


def _input_sets(op: BenchOp, case: Case, device: torch.device, rotate_bytes: int,
                first: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Enough input sets that one pass over them exceeds ``rotate_bytes``: a copy of ``first`` (the seed-0
    set), then sets built from seeds 2, 3, …; at least MIN_SETS, so an input set larger than the rotation
    (the logits cases) is built only once more."""
    sets = [_to(first, device, copy=True)]
    count = min(MAX_SETS, max(MIN_SETS, math.ceil(rotate_bytes / max(1, _nbytes(sets[0])))))
    sets += [_to(op.build(case, torch.Generator().manual_seed(s)), device) for s in range(2, count + 1)]
    return sets


def _same_mode(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return a is not None and b is not None and a.get("mode") is not None and a["mode"] == b["mode"]


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


DERIVED = ("device_us", "device_timing", "rate", "rate_unit", "floor_us", "ceiling_fraction", "launch_ratio",
           "launch_ratio_graph", "speedup_vs_torch", "speedup_vs_extra")  # set by _derive for timed rows


def _verdict(op: BenchOp, result: Any, baseline: Any, case: Case) -> str:
    """"ok", or "MISMATCH" with what differs where ``same`` says."""
    found = op.same(result, baseline, case)
    if found is True or found == "":
        return "ok"
    return f"MISMATCH: {found}" if isinstance(found, str) else "MISMATCH"


def _new_row(op: BenchOp, case: Case, backend: str, mode: str | None, device: str, extra: bool) -> dict[str, Any]:
    return {"op": op.name, "case": case.name, "params": dict(case.params), "note": case.note, "backend": backend,
            "extra": extra, "mode": mode, "device": device, "roofline": op.roofline_of(case), "bytes": op.bytes(case),
            "flops": op.flops(case), "eager_us": None, "graph_us": None, "graph_error": None, "sets": None,
            **dict.fromkeys(DERIVED)}


def _time_row(row: dict[str, Any], fn: Callable[[Mapping[str, Any]], Any], sets: list, timer: Timer) -> None:
    """Eager time on rotating input sets; on a GPU also the graph time (a capture failure is recorded)."""
    row["sets"] = len(sets)
    row["eager_us"] = timer.eager_us(lambda i: fn(sets[i % len(sets)]))
    if _gpu(timer.device):
        try:
            row["graph_us"] = timer.graph_us(lambda i: fn(sets[i]), len(sets))
        except Exception as exc:  # a capture failure is a finding to report, not a crash
            row["graph_error"] = f"{type(exc).__name__}: {exc}"


def _run_case(op: BenchOp, case: Case, backend: str, timer_for: Callable[[torch.device], Timer], baseline: Any,
              sets_cache: dict[str, list], fresh: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """Check then time one backend on one case; returns the result row and the checked output.

    ``fresh`` is the seed-0 input set on the CPU, copied to the backend's device for its check."""
    avail = dispatch.availability(backend)
    row = _new_row(op, case, backend, avail.mode if avail.available else None, avail.device, False)
    if not avail.available:
        return {**row, "check": f"skipped: {avail.reason}"}, None
    device = torch.device(avail.device)
    try:
        result = op.call(_to(fresh, device, copy=True), backend)
        if baseline is None:
            row["check"] = "ok" if backend == BASELINE else "no baseline"
        else:
            row["check"] = _verdict(op, result, baseline, case)
        sets = sets_cache.get(avail.device)
        if sets is None:
            rotate = 4 * _l2_bytes(device) if _gpu(device) else 0
            sets = sets_cache[avail.device] = _input_sets(op, case, device, rotate, fresh)
        _time_row(row, lambda a: op.call(a, backend), sets, timer_for(device))
    except dispatch.BackendNotSupportedError as exc:
        return {**row, "check": f"unsupported: {exc}"}, None
    except Exception as exc:  # one failing backend must not hide the others' numbers
        return {**row, "check": f"error: {type(exc).__name__}: {exc}", "eager_us": None, "graph_us": None}, None
    return row, result


def _run_extra(op: BenchOp, case: Case, label: str, fn: Callable, base_row: dict[str, Any] | None, baseline: Any,
               timer_for: Callable[[torch.device], Timer], sets_cache: dict[str, list],
               fresh: Mapping[str, Any]) -> dict[str, Any]:
    """An extra row (e.g. torch.topk) on the torch backend's device and input sets, checked like a backend."""
    if base_row is None or base_row["eager_us"] is None:
        return {**_new_row(op, case, label, None, "", True), "check": "skipped: the torch backend did not run"}
    row = _new_row(op, case, label, base_row["mode"], base_row["device"], True)
    device = torch.device(base_row["device"])
    try:
        result = fn(_to(fresh, device, copy=True))
        row["check"] = "no baseline" if baseline is None else _verdict(op, result, baseline, case)
        _time_row(row, fn, sets_cache[base_row["device"]], timer_for(device))
    except Exception as exc:
        return {**row, "check": f"error: {type(exc).__name__}: {exc}", "eager_us": None, "graph_us": None}
    return row


def _floors(op: BenchOp, sets_cache: dict[str, list], timer_for: Callable[[torch.device], Timer]) -> dict[str, Any]:
    """Per device the op's per-case roofline: ``floor`` timed on the same input sets (graph on a GPU)."""
    found: dict[str, Any] = {}
    if op.floor is None:
        return found
    for where, sets in sets_cache.items():
        device = torch.device(where)
        row: dict[str, Any] = {"eager_us": None, "graph_us": None, "graph_error": None}
        try:
            _time_row(row, op.floor, sets, timer_for(device))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        graph = row["graph_us"] is not None
        found[where] = {"mode": "GPU" if _gpu(device) else "CPU", "us": row["graph_us"] if graph else row["eager_us"],
                        "timing": "graph" if graph else "eager", **row}
    return found


def _derive(row: dict[str, Any], ceiling: dict[str, Any] | None, floor: dict[str, Any] | None,
            launch: dict[str, Any], base: dict[str, Any] | None, extra: dict[str, Any] | None, spec: Ceiling) -> None:
    """Rate, the floor (the least time at the roofline) and the fraction of it, the ratio to the empty launch,
    speed-ups over torch and over the first extra row: only between measurements of one mode."""
    graph = row["graph_us"] is not None
    row["device_us"] = row["graph_us"] if graph else row["eager_us"]
    row["device_timing"] = "graph" if graph else "eager"
    work = row[spec.counts]
    row["rate"] = None if not row["device_us"] else work / (row["device_us"] * 1e-6) / spec.scale
    row["rate_unit"] = spec.unit
    if ceiling is not None and ceiling.get("rate") and _same_mode(row, ceiling):
        row["floor_us"] = work / ceiling["rate"] * 1e6
    elif floor is not None and floor["us"] and _same_mode(row, floor) and floor["timing"] == row["device_timing"]:
        row["floor_us"] = floor["us"]
    row["ceiling_fraction"] = _ratio(row["floor_us"], row["device_us"])
    same_launch = _same_mode(row, launch)
    row["launch_ratio"] = _ratio(row["eager_us"], launch.get("eager_us")) if same_launch else None
    row["launch_ratio_graph"] = _ratio(row["graph_us"], launch.get("graph_us")) if same_launch else None
    for key, other in (("speedup_vs_torch", base), ("speedup_vs_extra", extra)):
        comparable = _same_mode(row, other) and other.get("device_timing") == row["device_timing"]
        row[key] = _ratio(other["device_us"], row["device_us"]) if comparable else None


def _l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20


def checkout_commit() -> str | None:
    """``$INDEXCACHE_COMMIT`` when set (a copied tree: without .git, or inside another repository's checkout),
    else the git commit of this checkout, else None."""
    return _git()[0]


def _git() -> tuple[str | None, bool | None]:
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV], None
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10)
            return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return None, None


def _versions() -> dict[str, str | None]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"indexcache": indexcache.__version__, "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "python": platform.python_version()}


def needed_ceilings(names: Sequence[str], quick: bool = False) -> list[str]:
    """The ceilings the ops ``names`` are set against (each case's roofline) or ask for: only these are measured."""
    found = [OPS[n].roofline_of(c) for n in names for c in OPS[n].cases(quick)]
    return list(dict.fromkeys(found + [c for n in names for c in OPS[n].ceilings]))


def _run_op_case(op: BenchOp, case: Case, backends: Sequence[str] | None, timer_for: Callable[[torch.device], Timer],
                 ceilings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every backend, then the extra rows, on one case; the per-case floor; derived numbers. The rows."""
    spec = CEILINGS[op.roofline_of(case)]
    fresh = op.build(case, torch.Generator().manual_seed(0))
    baseline, base_row, sets_cache, rows = None, None, {}, []
    for backend in _backends(op, backends):
        row, result = _run_case(op, case, backend, timer_for, baseline, sets_cache, fresh)
        if backend == BASELINE and row["check"] == "ok":
            baseline, base_row = result, row
        rows.append(row)
    extras = [_run_extra(op, case, label, fn, base_row, baseline, timer_for, sets_cache, fresh)
              for label, fn in op.extras.items()]
    floors = _floors(op, sets_cache, timer_for)
    del sets_cache, baseline
    first_extra = extras[0] if extras else None
    # The baseline and the extras first (the others compare to them), the baseline again (now an extra exists).
    for row in [*rows[:1], *extras, *rows[1:], *rows[:1]]:
        if row["eager_us"] is not None:
            _derive(row, ceilings.get(spec.name), floors.get(row["device"]), ceilings["launch"],
                    base_row, first_extra, spec)
    return rows[:1] + extras + rows[1:]


def run(op_names: Sequence[str] | None = None, backends: Sequence[str] | None = None,
        quick: bool = False) -> dict[str, Any]:
    """Measure the ceilings, then every case of every op on every backend; returns the report (JSON-ready)."""
    names = list(op_names) if op_names else list(OPS)
    unknown = [n for n in names if n not in OPS]
    if unknown:
        raise ValueError(f"--op: expected one of {sorted(OPS)}, got {', '.join(map(repr, unknown))}")
    for backend in backends or ():
        dispatch.get(backend)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    warmup, reps, graph_reps = ((2, 5, 3) if quick else (10, 100, 20)) if gpu else ((1, 3, 0) if quick else (1, 5, 0))
    timers: dict[torch.device, Timer] = {}

    def timer_for(dev: torch.device) -> Timer:
        return timers.setdefault(dev, Timer(dev, warmup, reps, graph_reps))

    base_mode = "GPU" if gpu else "CPU"
    ceilings: dict[str, Any] = {}
    for spec in (CEILINGS[c] for c in needed_ceilings(names, quick)):
        entry = {"rate": None, "counts": spec.counts, "unit": spec.unit, "scale": spec.scale, "mode": None}
        if spec.measure is None:
            ceilings[spec.name] = {**entry, "per_case": True, "description": spec.description}
            continue
        try:
            rate, details = spec.measure(timer_for(device), quick)
            ceilings[spec.name] = {**entry, "rate": rate, "mode": base_mode, **details}
        except Exception as exc:  # e.g. no fp8 matmul here: the rows still run, without that fraction
            ceilings[spec.name] = {**entry, "error": f"{type(exc).__name__}: {exc}"}
    ceilings["launch"] = _launch(device, timer_for(device), graph_ok=gpu)
    results = []
    for name in names:
        op = OPS[name]
        for case in op.cases(quick):
            results += _run_op_case(op, case, backends, timer_for, ceilings)
            if gpu:
                torch.cuda.empty_cache()
    commit, dirty = _git()
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device) if gpu else None,
        "gpu_run": gpu,
        "notice": None if gpu else "not a GPU run: CPU and interpreted-Triton times, not speed measurements",
        "versions": _versions(),
        "commit": commit,
        "dirty": dirty,
        "settings": {"quick": quick, "warmup": warmup, "reps": reps, "graph_reps": graph_reps,
                     "rotate_bytes": 4 * _l2_bytes(device) if gpu else 0, "statistic": "median"},
        "ceilings": ceilings,
        "results": results,
    }


def failed(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Result rows whose backend disagreed with the torch baseline or could not be checked against it."""
    return [r for r in report["results"]
            if r["check"] == "no baseline" or r["check"].startswith(("MISMATCH", "error"))]


# ----------------------------------------------------------------------------------------------- output

# (header, result key, format): what the table shows, per op; the JSON rows carry every key. Headers name
# the op's roofline ceiling and its unit, and the op's first extra row (the column is left out without one).
COLUMNS = (
    ("case", "case", "{}"),
    ("backend", "backend", "{}"),
    ("mode", "mode", "{}"),
    ("eager µs", "eager_us", "{:.1f}"),
    ("graph µs", "graph_us", "{:.1f}"),
    ("{unit}", "rate", "{:.1f}"),
    ("floor µs", "floor_us", "{:.1f}"),
    ("% {ceiling}", "ceiling_fraction", "{:.0%}"),
    ("× launch", "launch_ratio", "{:.2f}"),
    ("× launch (graph)", "launch_ratio_graph", "{:.2f}"),
    ("× torch", "speedup_vs_torch", "{:.2f}"),
    ("× {extra}", "speedup_vs_extra", "{:.2f}"),
    ("check", "check", "{}"),
)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} µs"


def capture_graph(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one call on the capture's side stream (torch's warm-up);
    neither replayed nor synchronised here. For the GPU scripts under ``bench/``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def call_times_ms(fn: Callable[[], Any], device: torch.device, budget_s: float, min_reps: int,
                  max_reps: int) -> list[float]:
    """Milliseconds of each call of ``fn`` (no warm-up here): CUDA events around each call on a GPU, the
    host clock elsewhere; at least ``min_reps`` calls, then more until ``budget_s`` or ``max_reps``."""
    times: list[float] = []
    stop = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < stop):
        if device.type != "cuda":
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def print_rows(title: str, rows: list[dict], columns: list[str], digits: int = 4) -> None:
    """Print ``rows`` (dicts) as a right-aligned table of ``columns``, floats to ``digits`` significant digits."""
    cells = [[f"{r[c]:.{digits}g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in columns]
             for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print(f"\n{title}")
    for row in [columns] + cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def format_table(report: Mapping[str, Any]) -> str:
    """The report as text: a header (machine, versions, ceilings) and one table per op."""
    v = report["versions"]
    commit = (report["commit"] or "unknown")[:12] + (" (dirty)" if report["dirty"] else "")
    lines = [f"indexcache bench  {report['date']}  {report['gpu'] or platform.processor() or 'CPU'}  "
             f"torch {v['torch']}  triton {v['triton']}  commit {commit}"]
    if report["notice"]:
        lines.append(f"NOTE: {report['notice']}")
    for name, c in report["ceilings"].items():
        if name == "launch":
            if c["mode"] is None:
                lines.append(f"ceiling empty Triton launch: not measured ({c['reason']})")
            else:
                graph = f"graph capture failed: {c['graph_error']}" if c["graph_error"] else _us(c["graph_us"])
                lines.append(f"ceiling empty Triton launch ({c['mode']}): {_us(c['eager_us'])} eager, "
                             f"{graph} in a graph")
        elif c.get("per_case"):
            lines.append(f"ceiling {name}: {c['description']}")
        elif c["rate"] is None:
            lines.append(f"ceiling {name}: not measured ({c.get('error')})")
        else:
            lines.append(f"ceiling {name} ({c['mode']}): {c['rate'] / c['scale']:.0f} {c['unit']}")
    by_op: dict[str, list] = {}
    for row in report["results"]:
        by_op.setdefault(row["op"], []).append(row)
    for name, rows in by_op.items():
        op = OPS[name]
        roofs = list(dict.fromkeys(r["roofline"] for r in rows))
        spec = CEILINGS[roofs[0]]
        columns = [c for c in COLUMNS if c[1] != "speedup_vs_extra" or op.extras]
        headers = [h.format(unit=spec.unit, ceiling=roofs[0] if len(roofs) == 1 else "roofline",
                            extra=next(iter(op.extras), "")) for h, _, _ in columns]
        cells = [[_cell(row.get(key), fmt) for _, key, fmt in columns] for row in rows]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        lines += ["", f"op {name}: rate from graph time where measured, else eager"]
        lines.append("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)).rstrip() for cell in cells]
        notes = dict.fromkeys(f"{r['case']}: {r['note']}" for r in rows if r["note"])
        if len(roofs) > 1:
            notes.update(dict.fromkeys(f"{r['case']}: % of {r['roofline']}" for r in rows))
        if CEILINGS[roofs[0]].measure is None:
            notes[f"floor µs: {CEILINGS[roofs[0]].description}"] = None
        errors = [f"{r['case']} / {r['backend']}: graph capture failed: {r['graph_error']}" for r in rows
                  if r["graph_error"]]
        lines += [f"  {n}" for n in [*notes, *errors]]
    return "\n".join(lines)


def write_json(report: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write the report as JSON (parent folders created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2) + "\n")
