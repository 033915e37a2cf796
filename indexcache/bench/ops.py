"""The ops as the benchmark harness sees them: per op its cases, an input builder, the bytes and FLOPs a
call must move and do, the call itself and how its result is checked against the torch backend.

An op plugs in as data: a :class:`BenchOp` in :data:`OPS`. The checks follow the conformance suite's rules
(its judge functions are imported here, and only here): translate, quantize_index_k and store_index_k
exactly; logits with -inf in the same places, no NaN and a relative RMS error within the tensor-core bound
of the key dtype; top-k by each row's index set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from indexcache import ops
from indexcache.hal.specs.mqa_logits import BOUNDS, check_logits
from indexcache.hal.specs.topk import check_topk
from indexcache.layout import new_packed_cache, split_packed_cache

BASELINE = "torch"  # the backend every other one is checked against and compared with
POISON = -2  # never a valid translate output: shows slots a backend left unwritten


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
    ``flops`` count the least memory traffic and arithmetic of one call; ``roofline`` names the ceiling
    (:data:`indexcache.bench.ceilings.CEILINGS`) the achieved rate is a fraction of (or gives it per case,
    ``roofline(case)``);
    ``ceilings`` names more ceilings to measure in the same run; ``same(result, baseline, case)`` says
    whether a backend agrees with the torch backend (True, or ``""``; False or a string saying what differs).

    ``extras`` are more rows timed on the torch backend's device and inputs, e.g. a torch primitive to beat
    (``{"torch.topk": fn(args)}``); each is checked with ``same`` too, and every row's ``speedup_vs_extra``
    is over the first. ``floor(args)``, where given, is the op's roofline measured per case: its time on
    the same inputs (e.g. reading the scores once) is the least time a call can take, for a roofline
    ceiling without a ``measure``.
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
    return check_logits(got, want.to(got.device), bound)[0]


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
    return check_topk(got.cpu(), want.cpu(), False) or "differs"


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

# ----------------------------------------------------------------------------------------------- fp8 cache

KEY_INPUTS = {"bf16": torch.bfloat16, "fp32": torch.float32}  # the dtypes the keys come to the fp8 ops in
CACHE_PAGES = 4096  # the packed cache store_index_k writes into: 4096 pages of 64 tokens (35 MB at D 128)


def _fp8_cases(quick: bool, cache: bool) -> list[Case]:
    """Decode (64 new tokens, one a request) and prefill (8K consecutive tokens) at D 128, bf16 and fp32 keys;
    with ``cache`` the packed cache they go to (page 64)."""
    def case(what: str, tokens: int, kind: str, pages: int) -> Case:
        size = f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)
        params: dict[str, Any] = dict(tokens=tokens, dim=DIM, kind=kind, block=DIM)
        if not cache:
            return Case(f"{what} {size} tokens D{DIM} {kind}", params)
        note = (f"one token a request, at a random slot of a page of its own ({pages}-page cache)" if what == "decode"
                else f"consecutive tokens filling randomly chosen whole pages of a {pages}-page cache")
        return Case(f"{what} {size} tokens D{DIM} {kind} page{LOGITS_PAGE}",
                    dict(params, page_size=LOGITS_PAGE, pages=pages, decode=what == "decode"), note)

    if quick:
        return [case("decode", 16, "bf16", 64), case("prefill", 256, "fp32", 64)]
    return [case(what, tokens, kind, CACHE_PAGES) for what, tokens in (("decode", 64), ("prefill", 8192))
            for kind in KEY_INPUTS]


def _keys(case: Case, gen: torch.Generator) -> torch.Tensor:
    p = case.params
    return torch.randn(p["tokens"], p["dim"], generator=gen).to(KEY_INPUTS[p["kind"]])


def _quantize_build(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """Normal keys ``[tokens, D]`` in the case's dtype, quantized to e4m3fn with one scale a token."""
    return dict(k=_keys(case, gen), fp8_dtype=E4M3, block=case.params["block"])


def _quantize_call(a: Mapping[str, Any], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.quantize_index_k(a["k"], a["fp8_dtype"], block=a["block"], backend=backend)


def _quantize_bytes(case: Case) -> int:
    """The keys read once; the fp8 values and a float32 scale a block written."""
    p = case.params
    values = p["tokens"] * p["dim"]
    return KEY_INPUTS[p["kind"]].itemsize * values + values + 4 * values // p["block"]


def _store_build(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """Normal keys ``[tokens, D]`` and a zeroed packed cache; decode slots one token a request, each at a
    random position of a page of its own; prefill slots consecutive, filling randomly chosen whole pages."""
    p = case.params
    tokens, page, pages = p["tokens"], p["page_size"], p["pages"]
    if p["decode"]:
        slots = torch.randperm(pages, generator=gen)[:tokens] * page + torch.randint(0, page, (tokens,), generator=gen)
    else:
        chosen = torch.randperm(pages, generator=gen)[:-(-tokens // page)]
        slots = (chosen[:, None] * page + torch.arange(page)).flatten()[:tokens]
    return dict(k=_keys(case, gen), k_cache=new_packed_cache(pages, page, p["dim"]),
                slot_mapping=slots.to(torch.int32), fp8_dtype=E4M3)


def _store_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    ops.store_index_k(a["k"], a["k_cache"], a["slot_mapping"], a["fp8_dtype"], backend=backend)
    return a["k_cache"]


def _store_bytes(case: Case) -> int:
    """The keys and slots read once; per token D fp8 bytes and a float32 scale written."""
    p = case.params
    return (KEY_INPUTS[p["kind"]].itemsize * p["dim"] + 4 + p["dim"] + 4) * p["tokens"]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def _same_bytes(got: Any, want: Any, case: Case) -> str:
    """Byte-exact, as the conformance suite judges quantize_index_k and store_index_k: the fp8 values and the
    scales (``(values, scales)``), or the packed cache."""
    if isinstance(got, tuple):
        named = list(zip(("fp8 values", "scales"), got, want, strict=True))
    else:
        named = [("cache bytes", got, want)]
    for name, g, w in named:
        if g.shape != w.shape or not torch.equal(_bytes_of(g), _bytes_of(w)):
            return f"{name} differ from the torch backend's"
    return ""


QUANTIZE_INDEX_K = BenchOp("quantize_index_k", lambda quick: _fp8_cases(quick, cache=False), _quantize_build,
                           _quantize_call, _quantize_bytes, same=_same_bytes)
STORE_INDEX_K = BenchOp("store_index_k", lambda quick: _fp8_cases(quick, cache=True), _store_build, _store_call,
                        _store_bytes, same=_same_bytes)

OPS: dict[str, BenchOp] = {op.name: op for op in (TRANSLATE, MQA_LOGITS, PAGED_MQA_LOGITS, TOPK, TOPK_TRANSLATE,
                                                  QUANTIZE_INDEX_K, STORE_INDEX_K)}
