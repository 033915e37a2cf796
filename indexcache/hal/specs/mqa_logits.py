"""mqa_logits: ragged prefill indexer logits (contract: :func:`indexcache.mqa_logits`). Its record's ``bench``:
fp8 and bf16 keys, causal and full windows, FLOPs counted over in-window pairs and set against the matmul
ceiling of the key dtype; checked by :func:`same_logits` (also paged_mqa_logits' check)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch, fp4
from indexcache.hal.checks import INDEX, KEY_DTYPES, check_tensor, dtype_names, output
from indexcache.hal.layout import FP8_DTYPES, fp8_max
from indexcache.hal.shown import shown
from indexcache.hal.specs import quantize_index_k
from indexcache.hal.specs.base import E4M3, E4M3_FNUZ, I32, CaseList, OpSpec, Verdict, cpu, not_written, to_fp8
from indexcache.hal.specs.bench import BASELINE, DIM, HEADS, BenchCase, BenchSpec

# The logits' relative RMS error bound by (key dtype kind, accumulation). fp8 and bfloat16 inputs are exact values
# (the reference takes them as they are; their products are exact in fp32), so only the accumulation differs: 1e-5 in
# fp32 (CPU, interpreted, torch: about 1e-7 measured, fp8 and bf16 alike), 1e-3 for fp8 on tensor cores (Hopper's fp8
# MMA accumulates with reduced precision: a plain Triton kernel measured 1.2e-4 on the H200), and 1e-5 for bf16 there
# too: the bf16 MMA accumulates in fp32 (1.2e-7 to 1.4e-7 on an H100's tensor cores, 2026-12-07, every bf16 case).
BOUNDS = {("fp8", "fp32"): 1e-5, ("fp8", "tensor-core"): 1e-3, ("bf16", "fp32"): 1e-5, ("bf16", "tensor-core"): 1e-5}


def check_queries(q: torch.Tensor, q_scale, keys: torch.dtype) -> None:
    """``q`` (checked for its dtype already) in a format the keys of format ``keys`` take: MXFP4 queries only with
    MXFP4 keys and with their block scales ``q_scale [..., D / 32]`` float8_e8m0fnu; any other ``q`` without
    ``q_scale``."""
    if q.dtype != fp4.FP4:
        if q_scale is not None:
            raise ValueError(f"q_scale: only MXFP4 queries (torch.float4_e2m1fn_x2) take block scales, but q is "
                             f"{dtype_names([q.dtype])} (fold an fp8 query's scale into weights)")
        return
    if keys != fp4.FP4:
        raise TypeError(f"q: MXFP4 queries (float4_e2m1fn_x2) are taken with MXFP4 keys only, got keys of dtype "
                        f"{dtype_names([keys])}")
    dim = fp4.head_dim(q)
    if dim % fp4.BLOCK:
        raise ValueError(f"q: expected a head dim that is a multiple of {fp4.BLOCK} with MXFP4 queries, got "
                         f"{shown(dim)}")
    if q_scale is None:
        raise ValueError("q_scale: MXFP4 queries need their block scales, [..., D / 32] float8_e8m0fnu, got None")
    check_tensor("q_scale", q_scale, (fp4.E8M0,), (*q.shape[:-1], dim // fp4.BLOCK), q.device)


def query_values(q: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    """The queries as float64 ``[..., D]``: fp8 or bf16 values as they are, MXFP4 ones decoded with their block
    scales (:func:`fp4.dequantize`)."""
    if q.dtype == fp4.FP4:
        return fp4.dequantize(cpu(q), cpu(q_scale))
    return cpu(q).double()


def check_inputs(q, k, k_scale, weights, ks, ke, q_scale=None) -> None:
    """The inputs as :func:`check` takes them: ``q [T, H, D]`` (MXFP4: ``[T, H, D / 2]`` with ``q_scale
    [T, H, D / 32]``), ``k [N, D]`` (MXFP4: ``[N, D / 2]``), ``k_scale``, ``weights [T, H]``, ``ks`` and ``ke [T]``."""
    check_tensor("q", q, (*KEY_DTYPES, fp4.FP4), (None, None, None))
    tokens, heads = q.shape[:2]
    dim = fp4.head_dim(q)
    device = q.device
    mxfp4 = isinstance(k, torch.Tensor) and k.dtype == fp4.FP4
    if isinstance(k, torch.Tensor):
        check_queries(q, q_scale, k.dtype)
    if mxfp4:  # MXFP4 keys: fp8 or MXFP4 queries, a scale every 32 elements
        check_tensor("q", q, (*FP8_DTYPES, fp4.FP4), (None, None, None))
        if dim % fp4.BLOCK:
            raise ValueError(f"q: expected a head dim that is a multiple of {fp4.BLOCK} with MXFP4 keys, got "
                             f"{shown(dim)}")
        check_tensor("k", k, (fp4.FP4,), (None, dim // 2), device)
        check_tensor("k_scale", k_scale, (fp4.E8M0,), (k.shape[0], dim // fp4.BLOCK), device)
    else:
        check_tensor("k", k, (q.dtype,), (None, dim), device)
        check_tensor("k_scale", k_scale, (torch.float32,), (k.shape[0],), device)
    check_tensor("weights", weights, (torch.float32,), (tokens, heads), device)
    check_tensor("ks", ks, (INDEX,), (tokens,), device)
    check_tensor("ke", ke, (INDEX,), (tokens,), device)


def check(q, k, k_scale, weights, ks, ke, *, q_scale=None, out=None) -> dict[str, Any]:
    check_inputs(q, k, k_scale, weights, ks, ke, q_scale)
    out = output("out", out, torch.float32, (q.shape[0], k.shape[0]), q.device,
                 dict(q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, q_scale=q_scale))
    return dict(q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, q_scale=q_scale, out=out)


def reference(q, k, k_scale, weights, ks, ke, q_scale=None) -> torch.Tensor:
    """Ragged prefill logits ``[T, N]`` float64, -inf outside ``[ks[t], ke[t])``.

    ``out[t, n] = k_scale[n] * sum_h weights[t, h] * relu(q[t, h] . k[n])``; MXFP4 keys: ``k[n]`` decoded with its
    block scales (:func:`fp4.dequantize`) in place of ``k_scale[n] * k[n]``; MXFP4 queries decoded with ``q_scale``.
    """
    q = query_values(q, q_scale)
    if k.dtype == fp4.FP4:
        k, k_scale = fp4.dequantize(cpu(k), cpu(k_scale)), torch.ones(k.shape[0], dtype=torch.float64)
    k = cpu(k).double()
    k_scale, weights = cpu(k_scale).double(), cpu(weights).double()
    ks, ke = cpu(ks).long(), cpu(ke).long()
    n = k.shape[0]
    logits = torch.einsum("thd,nd->thn", q, k).clamp_min(0)
    logits = (logits * weights[:, :, None]).sum(1) * k_scale[None, :]
    col = torch.arange(n)[None, :]
    inside = (col >= ks[:, None]) & (col < ke[:, None])
    return logits.masked_fill(~inside, float("-inf"))


def check_logits(got: torch.Tensor, want: torch.Tensor, bound: float) -> tuple[str, float | None]:
    """``(what differs or "", relative RMS error)``: float32, NaN, -inf and +inf exactly where the reference has
    them (each judged by equality: NaN and +inf arise only where a non-finite input puts them), and the relative
    RMS error of each row's finite values, against that row's, within ``bound`` (the worst row's is returned: over
    the whole tensor a row of small logits, or of a few finite ones, could be wrong and pass). The error is None
    where none was measured (a wrong shape, dtype or placement), never inf: the reports are strict JSON."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}", None
    if got.dtype != torch.float32:
        return f"dtype {got.dtype}, expected float32", None
    for name, where in (("NaN", torch.isnan), ("-inf", torch.isneginf), ("+inf", torch.isposinf)):
        want_at, got_at = where(want), where(got)
        if not torch.equal(want_at, got_at):
            return f"{name} placement differs at {int((want_at != got_at).sum())} positions", None
    finite = torch.isfinite(want)
    rows = finite.any(-1)
    if not rows.any():
        return "", 0.0
    errs = (torch.where(finite, got.double() - want, 0.0).norm(dim=-1)[rows]
            / torch.where(finite, want, 0.0).norm(dim=-1)[rows].clamp_min(1e-300))
    err, at = errs.max(0)
    err, row = err.item(), rows.nonzero()[at].item()
    return ("" if err <= bound else f"relative RMS error {err:.3g} > {bound:g} (row {row})"), err


def judge_values(args: dict, got: torch.Tensor, want: torch.Tensor, accumulation: str) -> Verdict:
    """:func:`check_logits` within the bound of ``q``'s dtype and the accumulation (:data:`BOUNDS`)."""
    bound = BOUNDS[("bf16" if args["q"].dtype == torch.bfloat16 else "fp8", accumulation)]
    detail, err = check_logits(cpu(got), want, bound)
    return detail, err, bound


def judge(args: dict, got: torch.Tensor, want: torch.Tensor, accumulation: str) -> Verdict:
    """A given ``out`` returned (:func:`not_written`), then :func:`judge_values`; the paged logits' judge too."""
    if detail := not_written(args, {"out": got}):
        return detail, None, None
    return judge_values(args, got, want, accumulation)


cases = CaseList("mqa_logits")


def _args(gen, dev, tokens, keys, heads, dtype, ks=None, ke=None, dim=128, scale=4.0):
    q = torch.randn(tokens, heads, dim, generator=gen) * scale
    k = torch.randn(keys, dim, generator=gen) * scale
    if dtype == torch.bfloat16:
        q, k = q.to(dtype), k.to(dtype)
    else:
        q, k = to_fp8(q, dtype), to_fp8(k, dtype)
    if ks is None:  # causal prefill over a prefix of keys - tokens
        ke = torch.arange(keys - tokens + 1, keys + 1, dtype=I32).clamp(min=0)
        ks = torch.zeros(tokens, dtype=I32)
    k_scale = torch.exp2(torch.randint(-8, 2, (keys,), generator=gen).float())
    weights = torch.randn(tokens, heads, generator=gen) / heads
    return dict(q=q.to(dev), k=k.to(dev), k_scale=k_scale.to(dev), weights=weights.to(dev), ks=ks.to(dev),
                ke=ke.to(dev))


for _dt, _label in ((E4M3, "fp8 e4m3fn"), (E4M3_FNUZ, "fp8 e4m3fnuz"), (torch.bfloat16, "bf16")):
    cases.add(f"causal prefill, H 64, {_label}")(
        lambda gen, dev, dt=_dt: _args(gen, dev, 24, 300, 64, dt))


def _fp4_args(gen, dev, fp8, tokens=24, keys=300, heads=64, nan_block=False, spread=False):
    """MXFP4 keys (quantized by the reference rule from normal keys) and fp8 queries, causal windows; ``spread``:
    every third key's four blocks 2^8 apart (2^24 between the first and the last)."""
    args = _args(gen, dev, tokens, keys, heads, fp8)
    raw = torch.randn(keys, 128, generator=gen) * torch.exp2(torch.randint(-6, 6, (keys, 1), generator=gen).float())
    if nan_block:
        raw[7, 40] = float("nan")
    if spread:
        raw[::3] *= torch.exp2(8.0 * torch.arange(4).repeat_interleave(32) - 12)
    values, scales = quantize_index_k.reference(raw, fp4.FP4, block=fp4.BLOCK)
    return {**args, "k": values.to(dev), "k_scale": scales.to(dev)}


@cases.add("logits into a given out (NaN before), native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = _args(gen, dev, 12, 200, 16, fp8)
    return dict(args, out=torch.full((12, 200), float("nan"), device=dev))


cases.add("MXFP4 keys, causal prefill, H 64, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: _fp4_args(gen, dev, fp8))
cases.add("MXFP4 keys, a NaN block scale, H 16, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: _fp4_args(gen, dev, fp8, tokens=9, keys=70, heads=16, nan_block=True))
cases.add("MXFP4 keys with block scales up to 2^24 apart in every third key, H 32, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: _fp4_args(gen, dev, fp8, tokens=12, keys=200, heads=32, spread=True))


def mxfp4_queries(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [..., D / 2] float4_e2m1fn_x2, q_scale [..., D / 32] float8_e8m0fnu)``: queries ``raw [..., D]`` quantized
    by the MXFP4 rule, each head's D values a row (as an engine quantizes its MXFP4 queries)."""
    dim = raw.shape[-1]
    values, scales = quantize_index_k.reference(raw.reshape(-1, dim), fp4.FP4, block=fp4.BLOCK)
    return values.view(*raw.shape[:-1], dim // 2), scales.view(*raw.shape[:-1], dim // fp4.BLOCK)


def _fp4_query_args(gen, dev, tokens=24, keys=300, heads=64, spread=False, nan_block=False):
    """MXFP4 keys (:func:`_fp4_args`) and MXFP4 queries quantized from normal ones, each (token, head) scaled by
    its own power of two; ``spread``: every fourth head's blocks 2^10 apart (2^30 between the first and the last);
    ``nan_block``: a NaN in query 2's head 5 (its block scale NaN)."""
    args = _fp4_args(gen, dev, E4M3, tokens=tokens, keys=keys, heads=heads)
    raw = torch.randn(tokens, heads, 128, generator=gen) * torch.exp2(
        torch.randint(-8, 8, (tokens, heads, 1), generator=gen).float())
    if spread:
        raw[:, ::4] *= torch.exp2(10.0 * torch.arange(4).repeat_interleave(32) - 15)
    if nan_block:
        raw[2, 5, 70] = float("nan")
    q, q_scale = mxfp4_queries(raw)
    return {**args, "q": q.to(dev), "q_scale": q_scale.to(dev)}


# MXFP4 queries (an e8m0 scale every 32 elements, as DeepGEMM's SM100 FP4 path and vLLM take them) with MXFP4 keys:
# exact values, so the fp8 bounds hold.
cases.add("MXFP4 queries and keys, causal prefill, H 64")(lambda gen, dev: _fp4_query_args(gen, dev))
cases.add("MXFP4 queries with block scales up to 2^30 apart in every fourth head, MXFP4 keys, H 32")(
    lambda gen, dev: _fp4_query_args(gen, dev, tokens=10, keys=150, heads=32, spread=True))
cases.add("MXFP4 queries with a NaN block scale, MXFP4 keys, H 16")(
    lambda gen, dev: _fp4_query_args(gen, dev, tokens=6, keys=90, heads=16, nan_block=True))


def at_the_top_of_e8m0(values: torch.Tensor, scales: torch.Tensor, other_scales: torch.Tensor | None) -> None:
    """In place: MXFP4 rows (``values [..., D / 2]``, ``scales [..., D / 32]``; D a multiple of 64) with block scale
    bytes at the top of e8m0, by threes of rows: every block 254 (2^127), every block 253, and the even blocks 254
    beside odd ones at 140 (2^13) in a row (in every other such row the 254 blocks' values zero, so that the small
    blocks give its products); and the other operand's scale bytes ``other_scales`` 100 less (at least 0; the cases'
    are above 100; None: fp8 queries, made small by the caller), so that the logits lie well inside float32 while
    the rows decoded at their own scales do not (docs/fp4.md, "Queries")."""
    v, b = values.view(torch.uint8), scales.view(torch.uint8)  # views of the rows as they lie (a cache's too)
    row = torch.arange(b[..., 0].numel(), device=b.device).view(*b.shape[:-1], 1)
    even = torch.arange(b.shape[-1], device=b.device) % 2 == 0
    b.copy_(torch.where(row % 3 == 0, 254, torch.where(row % 3 == 1, 253, torch.where(even, 254, 140))))
    v.masked_fill_((row % 6 == 5) & even.repeat_interleave(fp4.BLOCK // 2), 0)
    if other_scales is not None:
        other = other_scales.view(torch.uint8)
        other.copy_((other.int() - 100).clamp_min(0))


def small_fp8_queries(gen: torch.Generator, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with its fp8 queries made small (normal ones times 2^-9, the smallest e4m3 subnormal of e4m3fn: many
    round to 0 or to a few subnormals) and its weights times 2^-100: against keys whose block scales are at the top
    of e8m0 (:func:`at_the_top_of_e8m0`) each product of a query and a key stays inside float32 (about 2^125 at most)
    and the logits well inside it."""
    q = args["q"]
    small = to_fp8(torch.randn(q.shape, generator=gen) * 2.0**-9, q.dtype)
    return dict(args, q=small.to(q.device), weights=args["weights"] * 2.0**-100)


def top_of_e8m0_args(gen: torch.Generator, dev: torch.device, side: str) -> dict[str, Any]:
    """:func:`_fp4_query_args` (6 tokens, 60 keys, H 16) with the queries' (``side`` "q") or the keys' ("k") block
    scales at the top of e8m0 (:func:`at_the_top_of_e8m0`)."""
    args = _fp4_query_args(gen, dev, tokens=6, keys=60, heads=16)
    if side == "q":
        at_the_top_of_e8m0(args["q"], args["q_scale"], args["k_scale"])
    else:
        at_the_top_of_e8m0(args["k"], args["k_scale"], args["q_scale"])
    return args


def top_of_e8m0_fp8_args(gen: torch.Generator, dev: torch.device, fp8: torch.dtype) -> dict[str, Any]:
    """:func:`_fp4_args` (6 tokens, 60 keys, H 16) with the keys' block scales at the top of e8m0
    (:func:`at_the_top_of_e8m0`) and fp8 queries of format ``fp8`` (:func:`small_fp8_queries`)."""
    args = _fp4_args(gen, dev, fp8, tokens=6, keys=60, heads=16)
    at_the_top_of_e8m0(args["k"], args["k_scale"], None)
    return small_fp8_queries(gen, args)


# Block scales 2^127 and 2^126, the top of e8m0, on one side and small ones on the other (or small fp8 queries): logits
# well inside float32 whose operands decoded at their own scales are not (6 at byte 254 is 1.5 · 2^129).
cases.add("MXFP4 queries with block scale bytes 254 and 253 (beside 140 in some rows), keys 2^-100 smaller")(
    lambda gen, dev: top_of_e8m0_args(gen, dev, "q"))
cases.add("MXFP4 keys with block scale bytes 254 and 253 (beside 140 in some rows), MXFP4 queries 2^-100 smaller")(
    lambda gen, dev: top_of_e8m0_args(gen, dev, "k"))
cases.add("MXFP4 keys with block scale bytes 254 and 253 (beside 140 in some rows), small native fp8 q, weights "
          "2^-100", native_fp8=True)(top_of_e8m0_fp8_args)


@cases.add("full, empty and context-parallel windows, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    tokens, keys = 12, 257
    ks = torch.tensor([0, 0, 5, 100, 256, 257, 300, -4, 30, 0, 128, 64], dtype=I32)
    ke = torch.tensor([257, 0, 5, 200, 257, 257, 400, 10, 20, 1, 256, 2**31 - 1], dtype=I32)
    return _args(gen, dev, tokens, keys, 16, fp8, ks=ks, ke=ke)


@cases.add("native fp8 extremes (max and subnormal values)", native_fp8=True)
def _(gen, dev, fp8):
    args = _args(gen, dev, 6, 130, 8, fp8)
    top = fp8_max(fp8)
    big = torch.tensor([top, -top, 2.0**-9, -(2.0**-9), 2.0**-7, 0.0])
    pick = torch.randint(0, 6, (130, 128), generator=gen)
    args["k"] = big[pick].to(fp8).to(dev)
    args["q"][0] = torch.full((8, 128), top).to(fp8).to(dev)
    return args


@cases.add("scale extremes, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = _args(gen, dev, 8, 200, 16, fp8)
    args["k_scale"] = torch.exp2(torch.randint(-40, 40, (200,), generator=gen).float()).to(dev)
    return args


@cases.add("no keys, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return _args(gen, dev, 4, 0, 8, fp8, ks=torch.zeros(4, dtype=I32), ke=torch.zeros(4, dtype=I32))


def _nan_args(gen, dev, dtype):
    """NaN in weights and k_scale, and for bf16 also in q and k (the Triton interpreter decodes fp8 NaN bytes
    in a dot as 480, so fp8 NaN operands are left to the GPU tests)."""
    args = {name: t.cpu() for name, t in _args(gen, dev, 6, 130, 8, dtype).items()}
    nan = float("nan")
    args["weights"][3, 1] = nan
    args["k_scale"][20] = nan
    if dtype == torch.bfloat16:
        args["q"][1, 2, 5] = nan
        args["k"][7, 0] = nan
    return {name: t.to(dev) for name, t in args.items()}


cases.add("NaN in weights and k_scale propagates, native fp8", native_fp8=True)(
    lambda gen, dev, fp8: _nan_args(gen, dev, fp8))
cases.add("NaN in q, k, weights and k_scale propagates, bf16")(
    lambda gen, dev: _nan_args(gen, dev, torch.bfloat16))


@cases.add("+inf and -inf keys, bf16: +inf, -inf and NaN logits inside the windows, 0 where relu takes -inf")
def _(gen, dev):
    """Key 20 holds +inf and key 40 -inf in dimension 0, which every query holds positive: q . k is +inf, resp. -inf
    (relu gives 0, so key 40's logits are finite). Token 1's weights are all positive (+inf at key 20), token 2's
    all negative (-inf there, inside its window), the others' of both signs (NaN: +inf - inf)."""
    args = {name: t.cpu() for name, t in _args(gen, dev, 6, 130, 8, torch.bfloat16).items()}
    args["q"][:, :, 0] = args["q"][:, :, 0].abs() + 1
    args["k"][20, 0] = float("inf")
    args["k"][40, 0] = float("-inf")
    args["weights"][1] = args["weights"][1].abs() + 0.1
    args["weights"][2] = -args["weights"][2].abs() - 0.1
    return {name: t.to(dev) for name, t in args.items()}


# ----------------------------------------------------------------------------------------------- benchmark


def same_logits(got: torch.Tensor, want: torch.Tensor, case: BenchCase) -> str:
    """The conformance rule against the torch backend: NaN, -inf and +inf in the same places, relative RMS error
    of the finite values within the tensor-core bound of the key dtype (fp8 1e-3, bf16 1e-5)."""
    bound = BOUNDS[(case.params.get("kind", "fp8"), "tensor-core")]
    return check_logits(got, want.to(got.device), bound)[0]


def bench_cases(quick: bool) -> list[BenchCase]:
    def case(tokens: int, keys: int, heads: int, kind: str, causal: bool) -> BenchCase:
        size = f"{keys // 1024}K" if keys >= 1024 else str(keys)
        return BenchCase(f"{kind} {tokens}x{size} {'causal' if causal else 'full'} H{heads}",
                         dict(tokens=tokens, keys=keys, heads=heads, dim=DIM, kind=kind, causal=causal))

    if quick:
        return [case(16, 200, 16, "fp8", True), case(16, 200, 16, "fp8", False), case(16, 200, 16, "bf16", True)]
    return [case(4096, 32768, HEADS, kind, causal) for kind in ("fp8", "bf16") for causal in (True, False)]


def bench_build(case: BenchCase, gen: torch.Generator) -> dict[str, Any]:
    """q, k random; fp8 keys quantized per token (torch backend), bf16 keys with a random scale; the causal
    window of query t is keys [0, keys - tokens + 1 + t), the full one every key."""
    p = case.params
    tokens, keys, heads, dim = p["tokens"], p["keys"], p["heads"], p["dim"]
    k_raw = torch.randn(keys, dim, generator=gen)
    if p["kind"] == "fp8":
        k, scale = dispatch.call("quantize_index_k", quantize_index_k.check(k_raw, E4M3), BASELINE)
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


def _pairs(case: BenchCase) -> int:
    p = case.params
    tokens, keys = p["tokens"], p["keys"]
    if not p["causal"]:
        return tokens * keys
    return sum(max(0, min(keys, keys - tokens + 1 + t)) for t in range(tokens))


def bench_flops(case: BenchCase) -> int:
    """2·H·D FLOPs an in-window (query, key) pair; pairs outside the window are not counted."""
    return 2 * case.params["heads"] * case.params["dim"] * _pairs(case)


def bench_bytes(case: BenchCase) -> int:
    """q, k, scales, weights and windows read once; the [T, N] float32 logits written."""
    p = case.params
    elem = 1 if p["kind"] == "fp8" else 2
    tokens, keys, heads, dim = p["tokens"], p["keys"], p["heads"], p["dim"]
    return elem * (tokens * heads * dim + keys * dim) + 4 * keys + 4 * tokens * heads + 8 * tokens + 4 * tokens * keys


def bench_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    args = check(a["q"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"], out=a["out"])
    return dispatch.call("mqa_logits", args, backend)


SPEC = OpSpec("mqa_logits", check, reference, judge, tuple(cases),
              bench=BenchSpec("mqa_logits", bench_cases, bench_build, bench_call, bench_bytes, flops=bench_flops,
                              roofline=lambda case: f"{case.params['kind']}_matmul", same=same_logits,
                              ceilings=("copy_bandwidth",)), budgeted=True)
