"""mqa_topk_translate: the prefill producer step, :func:`indexcache.mqa_logits` then :func:`indexcache.topk_translate`
over each query's key window, in bounded memory: the ``[T, N]`` logits are never written whole (contract:
:func:`indexcache.mqa_topk_translate`; docs/ops.md, "The prefill producer step").

Its cases give inputs whose logits every backend computes exactly (small integer queries and keys, power-of-two
key scales and weights: every product and sum fits the accumulators of fp32 and of fp8 tensor cores), so the top-k
is judged exactly against the float64 reference, its many ties included."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch, fp4
from indexcache.hal.checks import INDEX, MAX_TOPK, check_int, check_page_size, check_tensor, check_workspace
from indexcache.hal.specs import mqa_logits, quantize_index_k, topk_translate, translate
from indexcache.hal.specs.base import E4M3, I32, CaseList, OpSpec, Verdict, cpu, ints
from indexcache.hal.specs.bench import BASELINE, POISON, BenchCase, BenchSpec

# The bytes of scratch a call may take when the caller does not bound it (``workspace_bytes``): a query row of 1M
# keys' logits is 4 MiB, so this holds a few hundred of them.
DEFAULT_WORKSPACE_BYTES = 2 << 30


def check(q, k, k_scale, weights, ks, ke, topk: int, page_table, page_size: int, *, row_to_batch=None, out=None,
          out_raw=None, workspace=None, workspace_bytes: int | None = None, q_scale=None) -> dict[str, Any]:
    mqa_logits.check_inputs(q, k, k_scale, weights, ks, ke, q_scale)
    tokens, device = q.shape[0], q.device
    check_int("topk", topk, 0, MAX_TOPK, " (indexcache.hal.ops.MAX_TOPK)")
    check_tensor("page_table", page_table, (INDEX,), (None, None), device)
    check_page_size(page_size)
    if row_to_batch is not None:
        check_tensor("row_to_batch", row_to_batch, (INDEX,), (tokens,), device)
    inputs = dict(q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, page_table=page_table,
                  row_to_batch=row_to_batch, q_scale=q_scale)
    out = topk_translate.check_outputs(out, out_raw, (tokens, topk), device, inputs)
    check_workspace(workspace, device, dict(inputs, out=out, out_raw=out_raw))
    if workspace_bytes is not None:
        check_int("workspace_bytes", workspace_bytes, 1)
    bound = DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes  # the backends get it resolved
    return dict(q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, topk=topk, page_table=page_table,
                page_size=page_size, row_to_batch=row_to_batch, out=out, out_raw=out_raw, workspace=workspace,
                workspace_bytes=bound, q_scale=q_scale)


def windows(ks: torch.Tensor, ke: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, lengths)`` int32: each query's window ``[ks, ke)`` clipped to the ``keys`` columns, as
    :func:`indexcache.mqa_logits` clips it (an empty one starts at ``min(max(ks, 0), keys)``)."""
    starts = ks.long().clamp(0, keys)
    ends = torch.maximum(ke.long().clamp(max=keys), starts)
    return starts.to(I32), (ends - starts).to(I32)


def reference(q, k, k_scale, weights, ks, ke, topk, page_table, page_size, *, row_to_batch=None, workspace=None,
              workspace_bytes=None, q_scale=None):
    """``(physical, raw)``: :func:`topk_translate.reference <indexcache.hal.specs.topk_translate.reference>` of the
    float64 logits over each clipped window (its start the row start, its length the visible length); the workspace
    arguments change nothing."""
    logits = mqa_logits.reference(q, k, k_scale, weights, ks, ke, q_scale)
    starts, lengths = windows(cpu(ks), cpu(ke), k.shape[0])
    return topk_translate.reference(logits, lengths, topk, cpu(page_table), page_size, row_starts=starts,
                                    row_to_batch=cpu(row_to_batch))


def judge(args: dict, got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor], accumulation: str) -> Verdict:
    """As :func:`indexcache.topk_translate` is judged, exactly (the cases' logits are exact): ``out_raw`` the
    reference's index sets, ``out`` exactly ``translate(out_raw)``; without ``out_raw`` the physical sets."""
    _, lengths = windows(cpu(args["ks"]), cpu(args["ke"]), args["k"].shape[0])
    composed = dict(lengths=lengths, page_table=cpu(args["page_table"]), page_size=args["page_size"],
                    row_to_batch=cpu(args.get("row_to_batch")), out=args.get("out"), out_raw=args.get("out_raw"))
    return topk_translate.judge(composed, got, want, accumulation)


cases = CaseList("mqa_topk_translate")


def exact_inputs(gen: torch.Generator, dev, fp8: torch.dtype, tokens: int, keys: int, heads: int = 16,
                 dim: int = 128, mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """``q``, ``k``, ``k_scale`` and ``weights`` whose logits every backend computes exactly: integer queries in
    [-2, 2] and keys in [-3, 3] (``fp8``, bfloat16 or MXFP4 keys with unit block scales), key scales 2^-3 .. 2^2,
    weights ±2^-2 .. ±1."""
    q = ints(gen, -2, 3, (tokens, heads, dim)).float()
    raw = ints(gen, -3, 4, (keys, dim)).float()
    if mxfp4:
        raw[:, ::fp4.BLOCK] = 4.0  # each block's largest magnitude 4: its scale 2^0, every integer in [-3, 3] exact
        k, k_scale = quantize_index_k.reference(raw, fp4.FP4, block=fp4.BLOCK)
    else:
        k, k_scale = raw.to(fp8), torch.exp2(ints(gen, -3, 3, (keys,)).float())
    weights = torch.exp2(ints(gen, -2, 1, (tokens, heads)).float()) * (ints(gen, 0, 2, (tokens, heads)) * 2 - 1)
    found = dict(q=q.to(fp8), k=k, k_scale=k_scale, weights=weights)
    return {name: t.to(dev) for name, t in found.items()}


def _table(gen, batches: int, keys: int, page_size: int) -> torch.Tensor:
    """A KV page table of ``batches`` rows covering ``keys`` tokens and one page more, every fifth entry a hole."""
    pages = -(-max(keys, 1) // page_size) + 1
    table = ints(gen, 0, 50 * pages, (batches, pages))
    table[:, 2::5] = -1
    return table


def ragged_prefill(gen, dev, fp8, lengths: list[int], new: list[int], topk: int, page_size: int, *, heads: int = 16,
                   mxfp4: bool = False, raw: bool = True) -> dict[str, Any]:
    """A ragged causal prefill: request ``b`` holds ``lengths[b]`` keys (concatenated in request order), its last
    ``new[b]`` tokens are the queries; query ``t`` of a request sees its keys up to itself (``ks`` the request's
    first key, ``ke`` past its own); ``row_to_batch`` names the request, whose KV page table row translates."""
    starts = torch.tensor([0, *lengths]).cumsum(0)
    ks, ke, r2b = [], [], []
    for b, (length, count) in enumerate(zip(lengths, new, strict=True)):
        for j in range(count):
            ks.append(int(starts[b]))
            ke.append(int(starts[b]) + length - count + 1 + j)
            r2b.append(b)
    tokens, keys = len(ks), int(starts[-1])
    args = exact_inputs(gen, dev, fp8, tokens, keys, heads=heads, mxfp4=mxfp4)
    args.update(ks=torch.tensor(ks, dtype=I32).to(dev), ke=torch.tensor(ke, dtype=I32).to(dev), topk=topk,
                page_table=_table(gen, len(lengths), max(lengths), page_size).to(dev), page_size=page_size,
                row_to_batch=torch.tensor(r2b, dtype=I32).to(dev))
    if raw:
        args["out_raw"] = torch.full((tokens, topk), POISON, dtype=I32, device=dev)
    return args


cases.add("ragged causal prefill of three requests, row_to_batch, KV page 64, out_raw, native fp8", native_fp8=True)(
    lambda gen, dev, fp8: ragged_prefill(gen, dev, fp8, [300, 90, 257], [12, 9, 10], 64, 64))
cases.add("ragged causal prefill, KV page 1 (token table), k above the short windows, no out_raw, native fp8",
          native_fp8=True)(
    lambda gen, dev, fp8: ragged_prefill(gen, dev, fp8, [200, 40], [10, 40], 48, 1, raw=False))
cases.add("ragged causal prefill, KV page 100 (not a multiple of the 64-key tile), H 64, native fp8",
          native_fp8=True)(
    lambda gen, dev, fp8: ragged_prefill(gen, dev, fp8, [350, 129], [8, 6], 96, 100, heads=64))
cases.add("ragged causal prefill over MXFP4 keys, KV page 64, native fp8 q", native_fp8=True)(
    lambda gen, dev, fp8: ragged_prefill(gen, dev, fp8, [260, 100], [9, 7], 64, 64, mxfp4=True))


@cases.add("ragged causal prefill, MXFP4 queries and keys, KV page 64")
def _(gen, dev):
    args = ragged_prefill(gen, dev, E4M3, [260, 100], [9, 7], 64, 64, mxfp4=True)
    raw = ints(gen, -2, 3, tuple(args["q"].shape)).float()
    raw[..., ::fp4.BLOCK] = 4.0  # every block's scale 2^0: the integers in [-2, 2] exact, as the keys'
    q, q_scale = mqa_logits.mxfp4_queries(raw)
    return dict(args, q=q.to(dev), q_scale=q_scale.to(dev))


cases.add("ragged causal prefill, bf16, KV page 48")(
    lambda gen, dev: ragged_prefill(gen, dev, torch.bfloat16, [230, 70], [8, 8], 50, 48))


@cases.add("empty, negative, past-the-keys and context-parallel windows, a table row a query, page 64, native fp8",
           native_fp8=True)
def _(gen, dev, fp8):
    keys = 300
    ks = torch.tensor([0, 0, 5, 100, 299, 300, 310, -4, 30, 0, 128, 64, 150, -10**6], dtype=I32)
    ke = torch.tensor([300, 0, 5, 200, 300, 300, 400, 90, 20, 1, 256, 2**31 - 1, 280, 10**6], dtype=I32)
    args = exact_inputs(gen, dev, fp8, len(ks), keys)
    return dict(args, ks=ks.to(dev), ke=ke.to(dev), topk=40, page_table=_table(gen, len(ks), keys, 64).to(dev),
                page_size=64, out_raw=torch.full((len(ks), 40), POISON, dtype=I32, device=dev))


@cases.add("ties: one key repeated, constant weights, page 64, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = ragged_prefill(gen, dev, fp8, [280, 150], [6, 5], 70, 64)
    args["k"] = args["k"][:1].expand_as(args["k"]).contiguous()
    args["weights"] = torch.full_like(args["weights"], 0.25)
    return args


@cases.add("a workspace bound of a few query rows (many passes), page 64, out_raw, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = ragged_prefill(gen, dev, fp8, [300, 200], [12, 10], 64, 64)
    return dict(args, workspace_bytes=3 * 4 * 500 + (64 << 10))


cases.add("short prompts mixed with a long one (windows at most topk and above it), KV page 48, native fp8",
          native_fp8=True)(
    lambda gen, dev, fp8: ragged_prefill(gen, dev, fp8, [60, 200, 45, 7], [60, 50, 45, 7], 64, 48))


@cases.add("every window short (no more keys than topk): no scratch, even under a bound of 1 byte, page 64, "
           "native fp8", native_fp8=True)
def _(gen, dev, fp8):
    return dict(ragged_prefill(gen, dev, fp8, [40, 30, 1], [40, 12, 1], 80, 64), workspace_bytes=1)


@cases.add("no queries, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = exact_inputs(gen, dev, fp8, 0, 100)
    empty = torch.zeros(0, dtype=I32, device=dev)
    return dict(args, ks=empty, ke=empty, topk=16, page_table=_table(gen, 1, 100, 64).to(dev), page_size=64)


@cases.add("no keys, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    args = exact_inputs(gen, dev, fp8, 4, 0)
    zeros = torch.zeros(4, dtype=I32, device=dev)
    return dict(args, ks=zeros, ke=zeros + 5, topk=8, page_table=_table(gen, 4, 10, 64).to(dev), page_size=64,
                out_raw=torch.full((4, 8), POISON, dtype=I32, device=dev))

# ----------------------------------------------------------------------------------------------- benchmark


def bench_cases(quick: bool) -> list[BenchCase]:
    """mqa_logits' fp8 causal shapes, selecting k 2048 (quick: 16) through a page-64 table of one request."""
    k = 16 if quick else 2048
    return [BenchCase(f"{c.name} k{k}", dict(c.params, k=k)) for c in mqa_logits.bench_cases(quick)
            if c.params["kind"] == "fp8" and c.params["causal"]]


def bench_build(case: BenchCase, gen: torch.Generator) -> dict[str, Any]:
    """mqa_logits' inputs (one request: every query's table row 0, its pages a random permutation); outputs
    poisoned."""
    args = mqa_logits.bench_build(case, gen)
    del args["out"]
    tokens, keys, k = case.params["tokens"], case.params["keys"], case.params["k"]
    pages = -(-keys // 64)
    table = torch.randperm(pages, generator=gen, dtype=torch.int32)[None, :]
    return dict(args, topk=k, page_table=table, page_size=64, row_to_batch=torch.zeros(tokens, dtype=I32),
                out=torch.full((tokens, k), POISON, dtype=I32), out_raw=torch.full((tokens, k), POISON, dtype=I32))


def bench_bytes(case: BenchCase) -> int:
    """mqa_logits' inputs read once, raw and physical int32 results written and a table entry read for each: the
    logits are not counted (never written whole)."""
    p = case.params
    logits = 4 * p["tokens"] * p["keys"]
    return mqa_logits.bench_bytes(case) - logits + 12 * p["tokens"] * p["k"]


def bench_call(a: Mapping[str, Any], backend: str) -> tuple:
    args = check(a["q"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"], a["topk"], a["page_table"],
                 a["page_size"], row_to_batch=a["row_to_batch"], out=a["out"], out_raw=a["out_raw"])
    return dispatch.call("mqa_topk_translate", args, backend), a["out_raw"], a


def same_selection(got: tuple, want: tuple, case: BenchCase) -> str:
    """Per row the same number of positions, whose logits (the torch backend's) are, sorted, the torch backend's
    selection's within the tensor-core bound of fp8 logits (a near-tie the logits' rounding flips is no
    difference); ``out`` exactly ``translate(out_raw)`` (the torch backend's translate)."""
    phys, raw, a = got
    want_raw = want[1].to(raw.device)
    if not torch.equal((raw >= 0).sum(1), (want_raw >= 0).sum(1)):
        return "out_raw: rows select different numbers of positions"
    logits = dispatch.call("mqa_logits", mqa_logits.check(a["q"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"]),
                           BASELINE)
    starts, lengths = windows(a["ks"], a["ke"], a["k"].shape[0])

    def picked(idx: torch.Tensor) -> torch.Tensor:
        at = (starts[:, None] + idx.clamp_min(0)).long()
        return torch.where(idx >= 0, logits.gather(1, at), 0.0).double().sort(1).values

    mine, theirs = picked(raw), picked(want_raw)
    err = ((mine - theirs).norm() / theirs.norm().clamp_min(1e-300)).item()
    if err > mqa_logits.BOUNDS[("fp8", "tensor-core")]:
        return f"out_raw: the selected logits differ from the torch backend's by {err:.3g} (relative RMS)"
    slots = dispatch.call("translate", translate.check(raw, a["page_table"], lengths, a["page_size"],
                                                       row_to_batch=a["row_to_batch"]), BASELINE)
    return "" if torch.equal(phys, slots) else "out is not translate(out_raw)"


SPEC = OpSpec("mqa_topk_translate", check, reference, judge, tuple(cases),
              bench=BenchSpec("mqa_topk_translate", bench_cases, bench_build, bench_call, bench_bytes,
                              flops=mqa_logits.bench_flops, roofline="fp8_matmul", same=same_selection), budgeted=True)
