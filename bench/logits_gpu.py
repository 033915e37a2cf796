"""Indexer logits on one GPU: correctness, the machine's ceilings, our Triton kernels against the torch backend.

    pip install -e . && python bench/logits_gpu.py --out out/logits.json

In one run: (a) checks on the GPU — small prefill and paged-decode cases against the float64
reference (-inf placement exact, relative RMS ≤ 1e-3 for fp8 on tensor cores, ≤ 1e-5 for bf16 (fp32 accumulation),
no NaN), the large cases against the torch backend, and fp8 quantize/store bit-exact; (b) the
ceilings — fp8 ``torch._scaled_mm`` and bf16 matmul rates on 8192³, device-to-device copy
bandwidth; (c) timings (CUDA events, median after warm-up) of ``indexcache.mqa_logits`` (4096
queries × 32K / 64K keys, causal and full windows, fp8 and bf16, H = 64, D = 128) and
``indexcache.paged_mqa_logits`` (64 requests × 32K / 128K context, page 64, next_n 1 and 2; plus 1 × 128K
and 8 × 128K, which must fill the GPU from few requests) on the Triton backend and the torch backend —
decode also as the replay of a captured CUDA graph (``graph_ms``, what an engine's decode step sees; the
eager ``ms`` adds Python dispatch and the launch), and judged on it; (d) a sweep of tile configurations
(decode: every ``DECODE_SWEEP`` entry on the four target shapes, graph-timed). TFLOP/s count in-window
pairs only (2·H·D FLOPs a pair); decode bandwidth counts 132 bytes a cached token read plus 4 bytes a
logit written. The report's ``commit`` is ``git rev-parse HEAD``, or ``$INDEXCACHE_COMMIT`` without git. The
ceilings are ``indexcache bench``'s (:mod:`indexcache.bench.ceilings`), measured the same way.
Prints a table, writes JSON to ``--out``, exits 1 when a check fails.
Uses no Triton API (runs with Triton 3.6 and later); about two to three minutes on an H200.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import indexcache
from indexcache.bench.ceilings import bf16_matmul, copy_bandwidth, fp8_matmul
from indexcache.bench.output import print_rows, write_json
from indexcache.bench.provenance import checkout_commit, now, versions
from indexcache.bench.timing import Timer, capture_graph, median_ms
from indexcache.hal import dispatch, reference
from indexcache.hal.device import sm_count
from indexcache.hal.layout import new_packed_cache, split_packed_cache

CUDA = torch.device("cuda")
H, D, PAGE = 64, 128, 64
PAIR_FLOPS = 2 * H * D
TOKEN_BYTES = D + 4
TARGETS = {"fp8": 0.60, "bf16": 0.50, "decode": 0.70, "speedup": 10.0}
TOKENS, PREFILL_KEYS = 4096, (32768, 65536)
BATCH, CONTEXTS = 64, (32768, 131072)
PREFILL_SWEEP = [  # (COLS, BLOCK_N, num_warps, num_stages, PROGRAMS_PER_SM)
    (128, 64, 4, 3, 3), (128, 64, 4, 2, 3), (128, 64, 4, 4, 2), (128, 64, 4, 3, 2),
    (128, 128, 8, 3, 1), (128, 128, 8, 2, 1), (128, 128, 4, 3, 2), (256, 64, 4, 3, 2), (64, 64, 4, 3, 4),
]
# (PREFETCH, WORDS, BLOCK_KEYS, num_warps, num_stages, SPLIT, WAVES). PREFETCH 0: loads in the iteration that
# uses them (Triton's pipeliner stages them when num_stages > 1); 1: tile i + 1's rows and scales in flight
# while tile i is multiplied (register software pipeline); 2: tiles in pairs, two in flight. WORDS 1 carries the
# prefetched rows as int32 words (fp8 carried across iterations takes a register a byte). Timed on 64 x 32K and
# 64 x 128K, next_n 1 and 2, as CUDA-graph replays.
DECODE_SWEEP = [
    (0, 0, 64, 4, 3, 2048, 4), (0, 0, 64, 4, 1, 2048, 4), (0, 0, 128, 4, 1, 2048, 4), (0, 0, 256, 8, 1, 4096, 4),
    (1, 0, 64, 4, 1, 2048, 4), (1, 0, 64, 4, 1, 4096, 4), (1, 0, 64, 4, 1, 1024, 8), (1, 0, 64, 8, 1, 2048, 4),
    (1, 0, 128, 4, 1, 2048, 4), (1, 1, 64, 4, 1, 2048, 4), (2, 1, 64, 4, 1, 2048, 4), (2, 1, 64, 4, 1, 4096, 4),
    (2, 1, 64, 8, 1, 2048, 4), (2, 0, 64, 8, 1, 2048, 4),
]
DECODE_CASES = [(BATCH, c, n) for c in CONTEXTS for n in (1, 2)] + [(1, CONTEXTS[-1], 1), (8, CONTEXTS[-1], 2)]


def _timed(fn: Callable[[], object], budget_s: float = 0.4, min_reps: int = 3, max_reps: int = 50) -> float:
    """Median milliseconds of ``fn`` (one warm-up call first), CUDA events around each call."""
    return median_ms(fn, CUDA, budget_s, min_reps, max_reps)


def _graph_timed(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph (what a decode engine sees: no
    Python dispatch, no per-kernel launch); 5 to 100 replays after one. ``fn`` is called once eagerly first
    (compiles, warms caches)."""
    fn()
    return median_ms(capture_graph(fn).replay, CUDA, budget_s, 5, 100)


def _err(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, str]:
    """The logits rule: ``(same -inf positions and no NaN, relative RMS error ‖out − ref‖ / ‖ref‖ of the finite
    values, what differs)``; the bound is the caller's (docs/ops.md, "How conformance judges a backend")."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if out.isnan().any():
        return False, float("nan"), "NaN in output"
    if not torch.equal(out == float("-inf"), ref == float("-inf")):
        return False, float("nan"), f"-inf placement differs at {(out == float('-inf')).ne(ref == float('-inf')).sum()}"
    finite = torch.isfinite(ref)
    norm = ref[finite].norm()
    err = float((out[finite] - ref[finite]).norm() / norm) if norm > 0 else 0.0
    return True, err, ""


# ---------------------------------------------------------------- inputs


def _prefill_inputs(tokens: int, keys: int, kind: str, causal: bool, dev, fp8: torch.dtype):
    k_raw = torch.randn(keys, D, device=dev)
    if kind == "fp8":
        k, scale = indexcache.quantize_index_k(k_raw, fp8)
        q = (torch.randn(tokens, H, D, device=dev) * 24).clamp(-400, 400).to(fp8)
        k_scale = scale[:, 0].contiguous()
    else:
        k, k_scale = k_raw.bfloat16(), torch.rand(keys, device=dev) + 0.5
        q = torch.randn(tokens, H, D, device=dev, dtype=torch.bfloat16)
    w = torch.randn(tokens, H, device=dev) * H ** -0.5
    t = torch.arange(tokens, device=dev, dtype=torch.int32)
    ks = torch.zeros(tokens, device=dev, dtype=torch.int32)
    ke = (keys - tokens + 1 + t) if causal else torch.full_like(t, keys)
    return q, k, k_scale, w, ks, ke.int()


def _prefill_case(kind: str, keys: int, causal: bool) -> str:
    return f"{kind} {TOKENS}x{keys // 1024}K {'causal' if causal else 'full'}"


def _pairs(ks: torch.Tensor, ke: torch.Tensor, keys: int) -> int:
    return int((ke.clamp(0, keys) - ks.clamp(0, keys)).clamp_min(0).sum())


def _decode_inputs(batch: int, context: int, next_n: int, dev, fp8: torch.dtype, holes: bool = False):
    pages_per = -(-context // PAGE)
    cache = new_packed_cache(batch * pages_per, PAGE, D, device=dev)
    keys, scales = split_packed_cache(cache, D, fp8)
    keys.copy_((torch.randn(keys.shape, device=dev, dtype=torch.bfloat16) * 40).to(fp8))
    scales.copy_(torch.rand(scales.shape, device=dev) * 0.01 + 1e-3)
    table = torch.randperm(batch * pages_per, device=dev, dtype=torch.int32).view(batch, pages_per)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    if holes:
        table[0, 1] = -1
        table[-1, 0] = batch * pages_per + 5
        lens[1] = 0
        lens[-1] = context // 3
    q = (torch.randn(batch, next_n, H, D, device=dev) * 24).clamp(-400, 400).to(fp8)
    w = torch.randn(batch * next_n, H, device=dev) * H ** -0.5
    return q, cache, w, lens, table, context


# ---------------------------------------------------------------- sections


def ceilings(dev) -> dict:
    """fp8 and bf16 matmul rates (8192³) and device-to-device copy bandwidth (1 GiB), measured now as
    ``indexcache bench`` measures them on a GPU (10 warm-up and up to 100 timed calls).

    The fp8 ceiling is the faster of ``_scaled_mm`` with and without fast accumulation (our kernels do not
    promote either)."""
    timer = Timer(dev, warmup=10, reps=100, graph_reps=0)
    fp8, f = fp8_matmul(timer, quick=False)
    flops = 2 * f["n"] ** 3
    return {"fp8_promoted_tflops": flops / f["promoted_us"] / 1e6,
            "fp8_fast_accum_tflops": flops / f["fast_accum_us"] / 1e6,
            "bf16_tflops": bf16_matmul(timer, quick=False)[0] / 1e12, "fp8_tflops": fp8 / 1e12,
            "copy_gbps": copy_bandwidth(timer, quick=False)[0] / 1e9}


def checks(dev, fp8: torch.dtype) -> list[dict]:
    """Small cases against the float64 reference, large ones against the torch backend, quantize/store exact."""
    rows: list[dict] = []

    def record(name, ok, err, bound, why=""):
        rows.append({"check": name, "ok": bool(ok and err <= bound), "error": err, "bound": bound, "detail": why})

    torch.manual_seed(0)
    for kind, bound in (("fp8", 1e-3), ("bf16", 1e-5)):
        q, k, k_scale, w, ks, ke = _prefill_inputs(96, 1000, kind, True, dev, fp8)
        ks[::7] = 300  # CP-shaped windows, some empty
        ke[5] = 0
        ke[6] = 5000
        out = indexcache.mqa_logits(q, k, k_scale, w, ks, ke, backend="cuda")
        record(f"prefill {kind} vs reference", *_err(out, reference.mqa_logits(q, k, k_scale, w, ks, ke))[:2], bound)
    for next_n in (1, 2, 4):
        args = _decode_inputs(3, 700, next_n, dev, fp8, holes=True)
        out = indexcache.paged_mqa_logits(*args, backend="cuda")
        ok, err, why = _err(out, reference.paged_mqa_logits(*args))
        record(f"decode next_n={next_n} vs reference", ok, err, 1e-3, why)
    for kind in ("fp8", "bf16"):
        args = _prefill_inputs(TOKENS, PREFILL_KEYS[0], kind, True, dev, fp8)
        ok, err, why = _err(indexcache.mqa_logits(*args, backend="cuda"), indexcache.mqa_logits(*args, backend="torch"))
        record(f"prefill {kind} {TOKENS}x{PREFILL_KEYS[0]} causal vs torch", ok, err, 1e-3 if kind == "fp8" else 1e-2,
               why)
    args = _decode_inputs(BATCH, CONTEXTS[0], 2, dev, fp8, holes=True)
    ok, err, why = _err(indexcache.paged_mqa_logits(*args, backend="cuda"),
                        indexcache.paged_mqa_logits(*args, backend="torch"))
    record(f"decode {BATCH}x{CONTEXTS[0]} next_n=2 vs torch", ok, err, 1e-3, why)
    k = torch.randn(500, D, device=dev) * torch.logspace(-4, 4, 500, device=dev)[:, None]
    qk, scale = indexcache.quantize_index_k(k, fp8, backend="cuda")
    rq, rscale = reference.quantize_index_k(k, fp8)
    same = torch.equal(qk.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(scale.cpu(), rscale)
    record("quantize_index_k bit-exact", same, 0.0, 0.0)
    cache = new_packed_cache(10, PAGE, D, device=dev)
    slots = torch.randperm(10 * PAGE, device=dev)[:500].int()
    slots[::9] = -1
    ref = reference.store_index_k(k, cache, slots, fp8)
    indexcache.store_index_k(k, cache, slots, fp8, backend="cuda")
    record("store_index_k bit-exact", torch.equal(cache.cpu(), ref), 0.0, 0.0)
    return rows


def prefill(dev, fp8: torch.dtype, ceil: dict) -> list[dict]:
    rows = []
    for kind in ("fp8", "bf16"):
        for keys in PREFILL_KEYS:
            for causal in (True, False):
                args = _prefill_inputs(TOKENS, keys, kind, causal, dev, fp8)
                out = torch.empty(TOKENS, keys, device=dev)
                flops = _pairs(args[4], args[5], keys) * PAIR_FLOPS
                ours = _timed(lambda a=args, o=out: indexcache.mqa_logits(*a, out=o, backend="cuda"))
                base = _timed(lambda a=args, o=out: indexcache.mqa_logits(*a, out=o, backend="torch"), 0, 1, 3)
                rate = flops / ours / 1e9
                frac = rate / ceil[f"{kind}_tflops"]
                rows.append({"op": "mqa_logits", "case": _prefill_case(kind, keys, causal),
                             "ms": ours, "torch_ms": base, "tflops": rate, "fraction": frac, "speedup": base / ours,
                             "meets_target": frac >= TARGETS[kind] and base / ours >= TARGETS["speedup"]})
                del args, out
    return rows


def decode(dev, fp8: torch.dtype, ceil: dict) -> list[dict]:
    """Eager time (``ms``: Python dispatch + launch + kernel) and CUDA-graph replay time (``graph_ms``: what an
    engine's captured decode step sees); bandwidth, fraction and the target are judged on the graph time. The
    speed-up over the torch backend compares like with like (``speedup_timing``): its graph replay
    (``torch_graph_ms``) against ours, or where either was not captured its eager time (``torch_ms``) against ours."""
    rows = []
    for batch, context, next_n in DECODE_CASES:
        args = _decode_inputs(batch, context, next_n, dev, fp8)
        out = torch.empty(batch * next_n, context, device=dev)
        moved = TOKEN_BYTES * int(args[3].sum()) + 4 * out.numel()
        call = lambda a=args, o=out: indexcache.paged_mqa_logits(*a, out=o, backend="cuda")  # noqa: E731
        ours = _timed(call)
        graph_error = None
        try:
            graph = _graph_timed(call)
        except Exception as exc:  # a capture failure is a finding; judge the eager time then
            graph, graph_error = None, f"{type(exc).__name__}: {exc}"[:300]
        def torch_call(a=args, o=out):
            return indexcache.paged_mqa_logits(*a, out=o, backend="torch")

        base = _timed(torch_call, 0, 1, 2)
        base_graph = None
        if graph is not None:
            try:
                base_graph = _graph_timed(torch_call, 0)
            except Exception:  # noqa: BLE001  (the torch backend not capturable here: both eager then)
                pass
        judged = graph or ours
        gbps = moved / judged / 1e6
        frac = gbps / ceil["copy_gbps"]
        # Graph against graph, else eager against eager: never the torch backend's eager time (its host cost
        # included) over our graph time.
        speedup = base_graph / graph if base_graph is not None else base / ours
        rows.append({"op": "paged_mqa_logits", "case": f"{batch}x{context // 1024}K next_n={next_n}", "ms": ours,
                     "graph_ms": graph, "floor_ms": moved / ceil["copy_gbps"] / 1e6, "torch_ms": base,
                     "torch_graph_ms": base_graph, "gbps": gbps, "fraction": frac, "speedup": speedup,
                     "speedup_timing": "graph" if base_graph is not None else "eager", "target": batch == BATCH,
                     "graph_error": graph_error,
                     "meets_target": (frac >= TARGETS["decode"] and speedup >= TARGETS["speedup"]
                                      if batch == BATCH else None)})
        del args, out
    return rows


def sweep(dev, fp8: torch.dtype, ceil: dict) -> list[dict]:
    """Tile configurations of both kernels, called directly with each configuration."""
    from indexcache.backends.cuda import tuning
    from indexcache.backends.cuda.arch import NVIDIA
    from indexcache.backends.triton import logits
    from indexcache.backends.triton.target import detect

    target = detect(NVIDIA)[2]
    table = tuning(target.arch)
    rows = []
    for kind, keys, causal in (("fp8", PREFILL_KEYS[0], True), ("fp8", PREFILL_KEYS[-1], False),
                               ("bf16", PREFILL_KEYS[0], True)):
        args = _prefill_inputs(TOKENS, keys, kind, causal, dev, fp8)
        out = torch.empty(TOKENS, keys, device=dev)
        flops = _pairs(args[4], args[5], keys) * PAIR_FLOPS
        configs = PREFILL_SWEEP if kind == "fp8" else PREFILL_SWEEP[:1] + PREFILL_SWEEP[4:7]
        for cols, block_n, warps, stages, per_sm in configs:
            cfg = dict(table["mqa_logits"], COLS=cols, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                       PROGRAMS_PER_SM=per_sm)
            name = f"COLS={cols} BLOCK_N={block_n} warps={warps} stages={stages} per_sm={per_sm}"
            row = {"op": "mqa_logits", "case": _prefill_case(kind, keys, causal), "config": name}
            try:
                ms = _timed(lambda c=cfg, a=args, o=out: logits.mqa_logits(*a, o, target=target, cfg=c), 0.2)
                row |= {"ms": ms, "tflops": flops / ms / 1e9, "fraction": flops / ms / 1e9 / ceil[f"{kind}_tflops"]}
            except Exception as exc:  # a configuration that does not compile or fit is a result too
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
        del args, out
    for context in CONTEXTS:
        for next_n in (1, 2):
            args = _decode_inputs(BATCH, context, next_n, dev, fp8)
            out = torch.empty(BATCH * next_n, context, device=dev)
            moved = TOKEN_BYTES * int(args[3].sum()) + 4 * out.numel()
            for prefetch, words, block_keys, warps, stages, split, waves in DECODE_SWEEP:
                cfg = dict(table["paged_mqa_logits"], PREFETCH=prefetch, WORDS=words, BLOCK_KEYS=block_keys,
                           num_warps=warps, num_stages=stages, SPLIT=split, WAVES=waves)
                row = {"op": "paged_mqa_logits", "case": f"{BATCH}x{context // 1024}K next_n={next_n} (graph)",
                       "config": f"PREFETCH={prefetch} WORDS={words} BLOCK_KEYS={block_keys} warps={warps} "
                                 f"stages={stages} SPLIT={split} WAVES={waves}"}
                try:
                    ms = _graph_timed(lambda c=cfg, a=args, o=out: logits.paged_mqa_logits(*a, o, target=target, cfg=c),
                                      0.1)
                    row |= {"ms": ms, "gbps": moved / ms / 1e6, "fraction": moved / ms / 1e6 / ceil["copy_gbps"]}
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
            del args, out
    return rows


# ---------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile-configuration sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU visible: this script measures a GPU "
              "(the interpreted checks are tests/kernels/test_triton_logits.py)")
        return 2
    dispatch.reset()
    dev = CUDA
    fp8 = torch.float8_e4m3fn
    props = torch.cuda.get_device_properties(dev)
    v = versions()
    report: dict = {"schema": "indexcache-logits-gpu/1", "date": now(), "gpu": props.name,
                    "sms": sm_count(dev.index or 0), "torch": v["torch"], "triton": v["triton"],
                    "python": v["python"], "commit": checkout_commit(), "targets": TARGETS, "errors": {}}
    started = time.perf_counter()
    sections = [("ceilings", lambda: ceilings(dev)), ("checks", lambda: checks(dev, fp8)),
                ("prefill", lambda: prefill(dev, fp8, report["ceilings"])),
                ("decode", lambda: decode(dev, fp8, report["ceilings"]))]
    if not args.no_sweep:
        sections.append(("sweep", lambda: sweep(dev, fp8, report["ceilings"])))
    for name, run in sections:
        t0 = time.perf_counter()
        try:
            report[name] = run()
        except Exception:
            report["errors"][name] = traceback.format_exc()
            print(f"{name} failed:\n{report['errors'][name]}", file=sys.stderr)
            if name == "ceilings":
                break
        report[f"{name}_s"] = time.perf_counter() - t0
        torch.cuda.empty_cache()
    report["total_s"] = time.perf_counter() - started

    print(f"{props.name}, torch {v['torch']}, Triton {v['triton']}, commit {report['commit']}")
    if "ceilings" in report:
        c = report["ceilings"]
        print(f"ceilings: fp8 {c['fp8_tflops']:.0f} TFLOP/s, bf16 {c['bf16_tflops']:.0f} TFLOP/s, "
              f"copy {c['copy_gbps']:.0f} GB/s")
    print_rows("checks", report.get("checks", []), ["check", "ok", "error", "bound", "detail"])
    print_rows("prefill (mqa_logits)", report.get("prefill", []),
                 ["case", "ms", "tflops", "fraction", "torch_ms", "speedup", "meets_target"])
    print_rows("decode (paged_mqa_logits)", report.get("decode", []),
                 ["case", "ms", "graph_ms", "floor_ms", "gbps", "fraction", "torch_ms", "speedup", "meets_target"])
    if report.get("sweep"):
        print_rows("sweep", report["sweep"], ["case", "config", "ms", "tflops", "gbps", "fraction", "error"])
        for op in ("mqa_logits", "paged_mqa_logits"):
            for case in dict.fromkeys(r["case"] for r in report["sweep"] if r["op"] == op):
                done = [r for r in report["sweep"] if r["case"] == case and r["op"] == op and "ms" in r]
                if done:
                    best = min(done, key=lambda r: r["ms"])
                    print(f"best {op} {case}: {best['config']} ({best['fraction']:.1%} of its ceiling)")
    print(f"total {report['total_s']:.0f} s; errors in: {sorted(report['errors']) or 'none'}")
    write_json(report, args.out, indent=1)
    failed = report["errors"] or not all(r["ok"] for r in report.get("checks", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
