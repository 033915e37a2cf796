"""MXFP4 against fp8 index keys on one GPU: the decode step (``paged_mqa_logits``, ``paged_topk_translate``) and a
prefill chunk's logits (``mqa_logits``).

    pip install -e . && python bench/fp4_decode_gpu.py --out out/fp4_decode.json

Issue 37's decode shapes: 64 requests × 32K and × 128K keys, next_n 1 and 2, H = 64, D = 128, page 64, k = 2048 (the
producer's top-k), and a causal prefill chunk of 4096 tokens over 32K keys. The same keys' cache in both formats (fp8:
132 bytes a token, MXFP4: 68), the same fp8 queries (e4m3fn). On the cuda backend each call is captured in a CUDA
graph and the graphs are replayed in turns (``--rounds`` rounds, each a burst of back-to-back replays a call; the card
is power-capped, so the formats alternate rather than run one after the other), the median a call reported; the torch
backend's calls are timed in the same run (eager, median of a few calls) for reference. Before timing, the cuda
backend's MXFP4 logits are checked against the torch backend's on each shape (-inf placement equal, relative RMS error
≤ 1e-3).

Prints the times and the ratios MXFP4 / fp8 (issue 37's goals: decode logits ≤ 0.6, producer step ≤ 0.7, prefill
logits ≤ 1.1; the prefill on the cuda backend only, checked against the torch backend first) and writes
one JSON with the commit, device and versions (:mod:`indexcache.bench.provenance`); exits 1 when a check fails.
``--smoke``: tiny shapes interpreted on the CPU (TRITON_INTERPRET=1), the host clock: checks the script only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # before Triton is imported: the kernels run interpreted on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import torch

import indexcache
from indexcache.bench.output import finish, print_rows
from indexcache.bench.provenance import report_head
from indexcache.bench.timing import alternating_graph_us
from indexcache.hal import fp4
from indexcache.hal.layout import new_packed_cache, split_packed_cache
from indexcache.hal.specs.mqa_logits import check_logits

H, D, PAGE, K = 64, 128, 64, 2048
BATCH, CONTEXTS, NEXT_N = 64, (32768, 131072), (1, 2)
PREFILL = (4096, 32768)  # a causal prefill chunk: tokens, keys (issue 37's prefill shape)
SPAN = 64  # distinct pages of key bytes; the cache repeats them (building GBs of random keys would take minutes)
FP8 = torch.float8_e4m3fn
BOUND = 1e-3


def _caches(pages: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 cache, MXFP4 cache)`` of ``pages`` pages, both the same keys: random values quantized by the
    reference rule (the fp8 cache from the MXFP4 keys' exact values, so both formats hold the same numbers)."""
    span = min(pages, SPAN)
    raw = torch.randn(span * PAGE, D, generator=gen) * torch.exp2(torch.randint(-4, 4, (span * PAGE, 1),
                                                                                generator=gen).float())
    values, scales = fp4.quantize(raw)
    exact = fp4.dequantize(values, scales)
    block4 = new_packed_cache(span, PAGE, D, fp8_dtype=fp4.FP4)
    v, s = split_packed_cache(block4, D, fp4.FP4)
    v.view(torch.uint8).copy_(values.view(torch.uint8).view(span, PAGE, D // 2))
    s.view(torch.uint8).copy_(scales.view(torch.uint8).view(span, PAGE, D // fp4.BLOCK))
    block8 = new_packed_cache(span, PAGE, D)
    keys, kscale = split_packed_cache(block8, D, FP8)
    amax = exact.abs().amax(1).clamp_min(1e-4)
    kscale.copy_((amax / 448).view(span, PAGE))
    keys.copy_((exact / (amax / 448)[:, None]).to(FP8).view(span, PAGE, D))
    reps = -(-pages // span)
    return block8.repeat(reps, 1)[:pages], block4.repeat(reps, 1)[:pages]


def _inputs(batch: int, context: int, next_n: int, dev: torch.device, gen: torch.Generator) -> dict:
    per = -(-context // PAGE)
    fp8_cache, fp4_cache = _caches(batch * per, gen)
    table = torch.randperm(batch * per, generator=gen, dtype=torch.int32).view(batch, per)
    q = (torch.randn(batch, next_n, H, D, generator=gen) * 24).clamp(-400, 400).to(FP8)
    weights = torch.randn(batch * next_n, H, generator=gen) * H**-0.5
    built = dict(q=q, fp8_cache=fp8_cache, fp4_cache=fp4_cache, weights=weights, table=table,
                 lens=torch.full((batch,), context, dtype=torch.int32))
    built = {name: t.to(dev) for name, t in built.items()}
    rows = batch * next_n
    k = min(K, context)
    built.update(context=context, k=k, logits=torch.empty(rows, context, device=dev),
                 out=torch.empty(rows, k, dtype=torch.int32, device=dev))
    return built


def _calls(a: dict, backend: str) -> dict[tuple[str, str], object]:
    """``{(op, format): call}`` of one backend on one shape."""
    calls = {}
    for fmt, cache, k_format in (("fp8", a["fp8_cache"], None), ("mxfp4", a["fp4_cache"], fp4.FP4)):
        def logits(cache=cache, k_format=k_format):
            indexcache.paged_mqa_logits(a["q"], cache, a["weights"], a["lens"], a["table"], a["context"],
                                        out=a["logits"], k_format=k_format, backend=backend)

        def producer(cache=cache, k_format=k_format):
            indexcache.paged_topk_translate(a["q"], cache, a["weights"], a["lens"], a["table"], a["context"], a["k"],
                                            a["table"], PAGE, logits=a["logits"], out=a["out"], k_format=k_format,
                                            backend=backend)

        calls[("paged_mqa_logits", fmt)] = logits
        calls[("paged_topk_translate", fmt)] = producer
    return calls


def _prefill_inputs(tokens: int, keys: int, dev: torch.device, gen: torch.Generator) -> dict:
    """A causal prefill chunk: ``tokens`` fp8 queries over ``keys`` keys, the keys in both formats (the fp8 ones the
    MXFP4 keys' exact values), as :func:`_caches` builds them."""
    raw = torch.randn(keys, D, generator=gen) * torch.exp2(torch.randint(-4, 4, (keys, 1), generator=gen).float())
    values, scales = fp4.quantize(raw)
    exact = fp4.dequantize(values, scales)
    amax = exact.abs().amax(1).clamp_min(1e-4)
    built = dict(q=(torch.randn(tokens, H, D, generator=gen) * 24).clamp(-400, 400).to(FP8),
                 k8=(exact / (amax / 448)[:, None]).to(FP8), s8=(amax / 448).float(), k4=values, s4=scales,
                 weights=torch.randn(tokens, H, generator=gen) * H**-0.5,
                 ks=torch.zeros(tokens, dtype=torch.int32),
                 ke=(keys - tokens + 1 + torch.arange(tokens)).to(torch.int32))
    built = {name: t.to(dev) for name, t in built.items()}
    built["out"] = torch.empty(tokens, keys, device=dev)
    return built


def _prefill_calls(a: dict, backend: str) -> dict[tuple[str, str], object]:
    """``{("mqa_logits", format): call}`` of one backend on one prefill chunk."""
    calls = {}
    for fmt, k, scale in (("fp8", a["k8"], a["s8"]), ("mxfp4", a["k4"], a["s4"])):
        def logits(k=k, scale=scale):
            indexcache.mqa_logits(a["q"], k, scale, a["weights"], a["ks"], a["ke"], out=a["out"], backend=backend)

        calls[("mqa_logits", fmt)] = logits
    return calls


def _check(a: dict) -> str:
    """"" when the cuda backend's MXFP4 logits match the torch backend's, else what differs."""
    got = indexcache.paged_mqa_logits(a["q"], a["fp4_cache"], a["weights"], a["lens"], a["table"], a["context"],
                                      k_format=fp4.FP4, backend="cuda")
    want = indexcache.paged_mqa_logits(a["q"], a["fp4_cache"], a["weights"], a["lens"], a["table"], a["context"],
                                       k_format=fp4.FP4, backend="torch")
    return check_logits(got, want, BOUND)[0]


def _eager_us(calls: dict, dev: torch.device, reps: int) -> dict:
    """Per call the median µs of ``reps`` calls after one warm-up, each on an idle device."""
    times = {}
    for name, fn in calls.items():
        fn()
        samples = []
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            samples.append(1e6 * (time.perf_counter() - start))
        times[name] = statistics.median(samples)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="fp4_decode.json", help="the JSON report")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of alternating graph replays")
    parser.add_argument("--burst", type=int, default=20, help="back-to-back replays a call in a round")
    parser.add_argument("--no-torch", action="store_true", help="leave out the torch backend's rows")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes interpreted on the CPU: checks the script")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU visible: this script times GPU kernels (pass --smoke to check it on tiny CPU shapes)")
        return 2
    dev = torch.device("cpu" if args.smoke else "cuda")
    batch, contexts = (2, (128,)) if args.smoke else (BATCH, CONTEXTS)
    rounds, burst = (1, 1) if args.smoke else (args.rounds, args.burst)
    report = {**report_head(dev), "shape": dict(batch=batch, heads=H, dim=D, page=PAGE, k=K), "rows": [], "ratios": [],
              "errors": []}
    gen = torch.Generator().manual_seed(37)
    for context in contexts:
        for next_n in NEXT_N:
            shape = f"{batch}x{context // 1024}K next_n={next_n}" if context >= 1024 else f"{batch}x{context} " \
                f"next_n={next_n}"
            a = _inputs(batch, context, next_n, dev, gen)
            problem = _check(a)
            if problem:
                report["errors"].append(f"{shape}: MXFP4 logits, cuda against torch: {problem}")
            timed = alternating_graph_us(_calls(a, "cuda"), dev, rounds, burst)
            times = {("cuda", *key): us for key, us in timed.items()}
            if not args.no_torch:
                times.update({("torch", *key): us for key, us in _eager_us(_calls(a, "torch"), dev,
                                                                           1 if args.smoke else 3).items()})
            for (backend, op, fmt), us in times.items():
                report["rows"].append(dict(shape=shape, backend=backend, op=op, format=fmt, us=round(us, 2)))
            for backend in ("cuda", "torch"):
                for op in ("paged_mqa_logits", "paged_topk_translate"):
                    if (backend, op, "fp8") in times:
                        report["ratios"].append(dict(shape=shape, backend=backend, op=op, fp8_us=round(
                            times[(backend, op, "fp8")], 2), mxfp4_us=round(times[(backend, op, "mxfp4")], 2),
                            ratio=round(times[(backend, op, "mxfp4")] / times[(backend, op, "fp8")], 3)))
            del a
    tokens, keys = (16, 256) if args.smoke else PREFILL
    shape = f"prefill {tokens}x{keys // 1024}K" if keys >= 1024 else f"prefill {tokens}x{keys}"
    a = _prefill_inputs(tokens, keys, dev, gen)
    got = indexcache.mqa_logits(a["q"], a["k4"], a["s4"], a["weights"], a["ks"], a["ke"], backend="cuda")
    problem = check_logits(got, indexcache.mqa_logits(a["q"], a["k4"], a["s4"], a["weights"], a["ks"], a["ke"],
                                                       backend="torch"), BOUND)[0]
    if problem:
        report["errors"].append(f"{shape}: MXFP4 logits, cuda against torch: {problem}")
    del got
    times = alternating_graph_us(_prefill_calls(a, "cuda"), dev, rounds, max(1, burst // 4))
    for (op, fmt), us in times.items():
        report["rows"].append(dict(shape=shape, backend="cuda", op=op, format=fmt, us=round(us, 2)))
    fp8_us, mxfp4_us = times[("mqa_logits", "fp8")], times[("mqa_logits", "mxfp4")]
    report["ratios"].append(dict(shape=shape, backend="cuda", op="mqa_logits", fp8_us=round(fp8_us, 2),
                                 mxfp4_us=round(mxfp4_us, 2), ratio=round(mxfp4_us / fp8_us, 3)))
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  commit {report['commit']}")
    print_rows("MXFP4 / fp8 (median µs a call; cuda: alternating CUDA-graph replays, torch: eager)", report["ratios"],
               ["shape", "backend", "op", "fp8_us", "mxfp4_us", "ratio"])
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
