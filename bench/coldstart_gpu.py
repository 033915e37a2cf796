"""Cold start on a GPU: the kernels a serving sweep compiles, and its first calls against its steady state, cold, after
``indexcache warmup``, and DeepGEMM's JIT beside it (issue 36).

    pip install -e . && python bench/coldstart_gpu.py --out out/coldstart.json

The sweep is a serving engine's: decode steps of ``DECODE_BATCHES`` requests × ``DECODE_CONTEXTS`` keys × next_n 1-2,
then prefill chunks of ``PREFILL`` (tokens, keys), each step made of exactly the calls ``indexcache warmup`` lists
(:func:`indexcache.tools.warmup.decode_calls` / ``prefill_calls``: the index cache write, the producer's op, a shared
layer's translate; the prefill's key quantization), on real tensors of the same shapes, strides and aliasing. Per
shape: the kernels its first call compiled (Triton's compilation listener: compiles that missed the cache), the
first call's time, the steady state (the median of ``--calls`` more: from the third call on, the kept launches of
docs/ops.md, "Eager calls") and one call on new output buffers (a new signature: the host's checks, dispatch and
launch building afresh, every kernel loaded), host clock around the calls and a sync. A shape's inputs are built on
the host (up to about a gigabyte of random values); before its first call the shape before runs a few steps, untimed,
as a serving engine's host has just done when a new shape comes (``--cold-host``: not, the first call following the
building of its inputs, whose caches it finds cold).

1. **cold**: a child process with a fresh, empty Triton cache (``TRITON_CACHE_DIR``) runs the sweep.
2. **warm**: a child process with another fresh cache calls ``indexcache.warmup(plan)`` (the variants compiled in
   worker processes, then loaded here, as an engine would at start: its wall time and each variant's compile
   seconds), then runs the sweep: expect no compile, and first calls near the steady state.
3. **DeepGEMM** (where ``deep_gemm`` imports; a child with a fresh ``DG_JIT_CACHE_DIR``): ``fp8_paged_mqa_logits``
   with its schedule over the decode shapes and ``fp8_mqa_logits`` over the prefill ones, first call against steady
   state, and the files its JIT cache gained.

Writes one JSON (``--out``), again after each phase, and prints a table. Each first call is also split into its host
path (until it returned) and the device allocations it made. About six and a half minutes on an H100 machine (cold
228 s, warm 126 s, DeepGEMM 25 s; 2026-12-05).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "deepseek-v3.2.json")
DECODE_BATCHES = (1, 3, 8, 13, 32, 64)
DECODE_CONTEXTS = (100, 1000, 4097, 32768, 100000, 131072)
NEXT_N = (1, 2)
PREFILL = ((128, 128), (1000, 1000), (4096, 4096), (8192, 8192), (2048, 8192), (100, 131072))  # (tokens, keys)
SMOKE_DECODE = ((1, 100, 1), (3, 1000, 2))  # --smoke: two decode shapes and a prefill one, small
SMOKE_PREFILL = ((100, 300),)
CPU_NOTICE = "not a GPU run: host-clock times of the CPU backend, checks the script only, not speed measurements"
SMOKE_ARCH = "sm90"  # off a GPU the warm phase lists this target's variants (it compiles for a GPU only)
# What a step's calls write: new ones make every call's signature new.
OUTPUTS = ("out", "out_raw", "logits", "out_scale", "out_k")


def materialize(kind: str, calls: list[tuple[str, dict[str, Any]]], dims: tuple[int, ...], fp8: torch.dtype,
                dev: torch.device, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """The ``calls`` of :func:`indexcache.tools.warmup.decode_calls` (``kind`` "decode", ``dims`` = batch, context,
    next_n) or ``prefill_calls`` ("prefill", ``dims`` = tokens, keys) with a real tensor on ``dev`` for each meta one
    (one for each meta tensor, so that what the calls share stays shared), holding valid contents: full contexts
    (decode) or causal windows ending at the last key (prefill), tables of distinct cache pages, random scores
    and keys (``fp8`` the index cache's format)."""
    gen = torch.Generator().manual_seed(seed)
    made: dict[int, torch.Tensor] = {}
    if kind == "decode":
        batch, context, next_n = dims
        rows = batch * next_n
    else:
        tokens, keys = dims
        rows = tokens
    row = torch.arange(rows)

    def window_ends() -> torch.Tensor:  # prefill: token t sees keys [0, keys - tokens + 1 + t)
        return keys - tokens + 1 + row

    def content(name: str, t: torch.Tensor, page_size: int) -> torch.Tensor:
        shape, dtype = t.shape, t.dtype
        if dtype.is_floating_point and dtype.itemsize == 1:  # fp8 q / keys
            return (torch.randn(shape, generator=gen) * 2).to(dtype)
        if name in ("weights",):
            return torch.randn(shape, generator=gen) / shape[-1]
        if name in ("k_scale",):
            return torch.rand(shape, generator=gen) * 0.01 + 1e-3
        if name in ("k", "q") or dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(dtype)
        if name == "k_cache":  # the packed cache: fp8 keys, then each page's positive float32 scales
            from indexcache.hal.layout import split_packed_cache

            dim = shape[1] // page_size - 4
            cache = torch.zeros(shape, dtype=torch.uint8)
            keys_part, scales = split_packed_cache(cache, dim, fp8)
            keys_part.copy_((torch.randn(keys_part.shape, generator=gen) * 2).to(fp8))
            scales.copy_(torch.rand(scales.shape, generator=gen) * 0.01 + 1e-3)
            return cache
        if name in ("block_table", "page_table"):  # distinct pages of the cache (the last cache page spare)
            pages = shape[0] * shape[1]
            return torch.randperm(pages, generator=gen)[:pages].view(shape).to(dtype)
        if name == "slot_mapping":
            start = 0 if kind == "decode" else keys - tokens
            return (torch.arange(shape[0]) + start).to(dtype)
        if name in ("context_lens", "seq_lens") and kind == "decode":
            return torch.full(shape, context, dtype=dtype)
        if name == "context_lens":  # prefill: the request's keys, gathered from the cache
            return torch.full(shape, keys, dtype=dtype)
        if name == "row_to_batch":
            return (row // next_n if kind == "decode" else row * 0).to(dtype)
        if name == "raw":
            return torch.randint(0, min(context if kind == "decode" else tokens, 2**31 - 1), shape, generator=gen,
                                 dtype=dtype)
        if name in ("ks", "row_starts"):
            return torch.zeros(shape, dtype=dtype)
        if name in ("ke", "lengths", "seq_lens"):
            return window_ends().to(dtype)
        return torch.empty(shape, dtype=dtype)  # outputs: out, out_raw

    found = []
    for op, args in calls:
        page_size = args.get("page_size", 64)
        real = {}
        for name, value in args.items():
            if isinstance(value, torch.Tensor):
                if id(value) not in made:
                    made[id(value)] = content(name, value, page_size).to(dev)
                real[name] = made[id(value)]
            else:
                real[name] = value
        found.append((op, real))
    return found


def renewed(step: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """``step`` with new tensors for what its calls write (:data:`OUTPUTS`): every call's signature new."""
    return [(op, {n: torch.empty_like(v) if n in OUTPUTS and isinstance(v, torch.Tensor) else v
                  for n, v in args.items()}) for op, args in step]


def shapes(smoke: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The sweep: ``("decode", (batch, context, next_n))`` then ``("prefill", (tokens, keys))``."""
    if smoke:
        return [("decode", d) for d in SMOKE_DECODE] + [("prefill", p) for p in SMOKE_PREFILL]
    decode = [(b, c, n) for b in DECODE_BATCHES for c in DECODE_CONTEXTS for n in NEXT_N]
    return [("decode", d) for d in decode] + [("prefill", p) for p in PREFILL]


class _Compiles:
    """Triton's compilation listener: counts the compiles that missed the cache, and those that hit it."""

    def __init__(self):
        self.missed = self.hit = 0

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit):
        if cache_hit:
            self.hit += 1
        else:
            self.missed += 1


def _timed(fn: Callable[[], None], dev: torch.device) -> float:
    """Milliseconds of one call, host clock, the device synchronized on both sides."""
    return _timed_parts(fn, dev)[0]


def _timed_parts(fn: Callable[[], None], dev: torch.device) -> tuple[float, float, int]:
    """One call: its milliseconds (host clock, the device synchronized on both sides), the milliseconds until it
    returned to the host (its host path: checks, dispatch, launches), and the device allocations it made (the
    caching allocator's ``cudaMalloc`` calls; 0 off a GPU)."""
    def mallocs() -> int:
        return torch.cuda.memory_stats(dev).get("num_device_alloc", 0) if dev.type == "cuda" else 0

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    before = mallocs()
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - start) * 1e3, host * 1e3, mallocs() - before


def _runner(step: list[tuple[str, dict[str, Any]]]) -> Callable[[], None]:
    """One call of each of ``step``'s public ops, in order."""
    import indexcache

    def run() -> None:
        for op, args in step:
            getattr(indexcache, op)(**args)

    return run


# Steps of the shape before that run between building a shape's inputs and timing its first call (untimed): a serving
# engine's host has just run a step when a new shape comes, not built a gigabyte of random inputs (docs/kernels.md,
# "A first call is the host's, not the compiler's").
REWARM_STEPS = 3


def sweep(plan, dev: torch.device, calls: int, smoke: bool, cold_host: bool = False) -> list[dict[str, Any]]:
    """Each shape of :func:`shapes`: kernels compiled at its first call, first and steady milliseconds. Before a
    shape's first call the step of the shape before runs :data:`REWARM_STEPS` times (``cold_host``: not; the first
    call then follows the building of its inputs on the host)."""
    from indexcache.backends.triton.target import device_gpu
    from indexcache.tools.warmup import decode_calls, prefill_calls

    compiles = _Compiles()
    knobs = _triton_knobs()
    if knobs:
        knobs.compilation.listener = compiles
    gpu = device_gpu(dev) if dev.type == "cuda" else None
    fp8 = gpu.fp8_dtype if gpu is not None else torch.float8_e4m3fn  # the index cache's format on this GPU
    rows = []
    before = None  # the step of the shape before
    for kind, dims in shapes(smoke):
        meta = (decode_calls(plan, plan.page_size, fp8, *dims) if kind == "decode"
                else prefill_calls(plan, plan.page_size, fp8, *dims))
        step = materialize(kind, meta, dims, fp8, dev)
        run = _runner(step)
        rewarmed = before is not None and not cold_host
        for _ in range(REWARM_STEPS if rewarmed else 0):
            _timed(before, dev)

        missed, hit = compiles.missed, compiles.hit
        first, first_host, first_mallocs = _timed_parts(run, dev)
        row = {"kind": kind, "shape": list(dims), "compiled": compiles.missed - missed,
               "loaded": compiles.hit - hit, "first_ms": first, "first_host_ms": first_host,
               "first_device_allocs": first_mallocs, "host_rewarmed": rewarmed}
        steady = [_timed(run, dev) for _ in range(calls)]
        row["steady_ms"] = statistics.median(steady)
        row["first_over_steady"] = first / row["steady_ms"]
        # a new signature: checked, dispatched and built afresh
        row["new_buffers_ms"] = _timed(_runner(renewed(step)), dev)
        row["first_over_new_buffers"] = first / row["new_buffers_ms"]
        rows.append(row)
        before = run
        print(f"  {kind} {dims}: {row['compiled']} compiled, {row['loaded']} loaded, first {first:.1f} ms (host "
              f"{first_host:.1f}, {first_mallocs} device allocs), steady {row['steady_ms']:.3f} ms, new buffers "
              f"{row['new_buffers_ms']:.3f} ms", file=sys.stderr, flush=True)
    if knobs:
        knobs.compilation.listener = None
    return rows


def _triton_knobs():
    """Triton's knobs, or None without Triton (the torch backend then runs the sweep and nothing compiles)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs


def child(phase: str, config: str, calls: int, smoke: bool, jobs: int | None,
          cold_host: bool = False) -> dict[str, Any]:
    """One phase in this (child) process, its fresh caches set by the parent."""
    from indexcache.plan import LayerPlan

    plan = LayerPlan.from_config(config)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict[str, Any] = {"phase": phase}
    if phase == "deepgemm":
        return {**result, **deepgemm(dev, calls, smoke)}
    if phase == "warm":
        import indexcache

        start = time.perf_counter()
        if dev.type == "cuda":
            found = indexcache.warmup(plan, jobs=jobs)
            compiled = {"compile_seconds": {v.line(): s for v, s in zip(found.variants, found.seconds, strict=True)}}
        else:  # no GPU to compile for: the variants of SMOKE_ARCH listed, none compiled
            found = indexcache.warmup(plan, arch=SMOKE_ARCH, compile=False)
            compiled = {"listed_only": f"{SMOKE_ARCH}, no GPU here: listed, none compiled"}
        result["warmup"] = {"seconds": time.perf_counter() - start, "variants": len(found.variants), **compiled}
    start = time.perf_counter()
    result["shapes"] = sweep(plan, dev, calls, smoke, cold_host)
    result["sweep_seconds"] = time.perf_counter() - start
    result["compiled"] = sum(r["compiled"] for r in result["shapes"])
    return result


def deepgemm(dev: torch.device, calls: int, smoke: bool) -> dict[str, Any]:
    """DeepGEMM's paged decode logits (with its schedule) and prefill logits over the sweep's shapes, in a fresh
    JIT cache: first call against steady state, and the files the cache gained; ``absent`` where it does not
    import."""
    try:
        import deep_gemm as dg
    except Exception as exc:  # missing, or built for another torch / CUDA: absent
        return {"absent": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    from indexcache.hal.layout import new_packed_cache, split_packed_cache

    jit_cache = Path(os.environ["DG_JIT_CACHE_DIR"])
    page, heads, dim = 64, 64, 128
    sms = int(dg.get_num_sms())
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for kind, dims in shapes(smoke):
        if kind == "decode":  # the packed cache seen as DeepGEMM's pages, as bench/peers_gpu.py passes it
            batch, context, next_n = dims
            pages = -(-context // page)
            cache = new_packed_cache(batch * pages, page, dim, device=dev)
            keys_part, scales = split_packed_cache(cache, dim, torch.float8_e4m3fn)
            keys_part.copy_(torch.randn(keys_part.shape, device=dev, generator=gen).to(torch.float8_e4m3fn))
            scales.copy_(torch.rand(scales.shape, device=dev, generator=gen) * 0.01 + 1e-3)
            kv = cache.view(batch * pages, page, 1, dim + 4)
            q = torch.randn(batch, next_n, heads, dim, device=dev, generator=gen).to(torch.float8_e4m3fn)
            w = torch.randn(batch * next_n, heads, device=dev, generator=gen)
            seen = context - next_n + 1 + torch.arange(next_n, device=dev, dtype=torch.int32)[None, :].repeat(batch, 1)
            table = torch.arange(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)

            def run(q=q, kv=kv, w=w, seen=seen, table=table, context=context):
                schedule = dg.get_paged_mqa_logits_metadata(seen, page, sms)
                dg.fp8_paged_mqa_logits(q, kv, w, seen, table, schedule, context, False)
        else:
            tokens, keys = dims
            q = torch.randn(tokens, heads, dim, device=dev, generator=gen).to(torch.float8_e4m3fn)
            k = torch.randn(keys, dim, device=dev, generator=gen).to(torch.float8_e4m3fn)
            scale = torch.rand(keys, device=dev, generator=gen) * 0.01 + 1e-3
            w = torch.randn(tokens, heads, device=dev, generator=gen)
            ks = torch.zeros(tokens, device=dev, dtype=torch.int32)
            ke = keys - tokens + 1 + torch.arange(tokens, device=dev, dtype=torch.int32)

            def run(q=q, k=k, scale=scale, w=w, ks=ks, ke=ke):
                dg.fp8_mqa_logits(q, (k, scale), w, ks, ke, True)
        files = sum(1 for _ in jit_cache.rglob("*") if _.is_file())
        row: dict[str, Any] = {"kind": kind, "shape": list(dims)}
        try:
            row["first_ms"] = _timed(run, dev)
        except Exception as exc:  # a shape DeepGEMM does not take: recorded, not fatal
            rows.append({**row, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
            continue
        row["cache_files_added"] = sum(1 for _ in jit_cache.rglob("*") if _.is_file()) - files
        row["steady_ms"] = statistics.median(_timed(run, dev) for _ in range(calls))
        row["first_over_steady"] = row["first_ms"] / row["steady_ms"]
        rows.append(row)
    return {"version": getattr(dg, "__version__", None), "shapes": rows}


def _run_child(phase: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """:func:`child` in a fresh process with ``env`` added; its JSON result (an ``error`` entry when it failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--phase", phase, "--config", args.config, "--calls", str(args.calls),
               "--out", str(out), *(["--smoke"] if args.smoke else []), *(["--cold-host"] if args.cold_host else []),
               *(["--jobs", str(args.jobs)] if args.jobs else [])]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, **env})
        seconds = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            return {"phase": phase, "error": f"exit {proc.returncode}", "seconds": seconds}
        return {**json.loads(out.read_text()), "seconds": seconds}


def summary(report: dict[str, Any]) -> list[str]:
    """One line a phase: kernels compiled, the worst first-call ratio, the time taken."""
    lines = []
    for phase in ("cold", "warm", "deepgemm"):
        if phase not in report:
            continue
        r = report[phase]
        if "error" in r or "absent" in r:
            lines.append(f"{phase:<9} {r.get('error') or 'absent: ' + r['absent']}")
            continue
        rows = r.get("shapes", [])
        worst = max((s for s in rows if "first_over_steady" in s), key=lambda s: s["first_over_steady"], default=None)
        compiled = sum(s.get("compiled", s.get("cache_files_added", 0)) for s in rows)
        text = f"{phase:<9} {len(rows)} shapes, {compiled} {'kernels compiled' if phase != 'deepgemm' else 'JIT files'}"
        if worst:
            text += (f", worst first call {worst['first_ms']:.1f} ms = {worst['first_over_steady']:.1f}x steady "
                     f"({worst['kind']} {worst['shape']})")
        for key, against in (("first_over_steady", "steady"), ("first_over_new_buffers", "new buffers")):
            ratios = [s[key] for s in rows if key in s]
            if ratios:
                text += f"; first / {against} median {statistics.median(ratios):.2f}"
        if "listed_only" in r.get("warmup", {}):
            text += f"; warmup {r['warmup']['variants']} variants ({r['warmup']['listed_only']})"
        elif "warmup" in r:
            text += f"; warmup {r['warmup']['variants']} variants in {r['warmup']['seconds']:.1f} s"
        lines.append(f"{text}; {r.get('seconds', 0):.0f} s in all")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--config", default=CONFIG, help="the model config (default: DeepSeek-V3.2's example)")
    parser.add_argument("--calls", type=int, default=10, help="steady-state calls a shape (default 10)")
    parser.add_argument("--jobs", type=int, default=None, help="warmup's compile workers (default: the cores)")
    parser.add_argument("--smoke", action="store_true", help="three small shapes: checks the script itself (off a GPU: "
                        "on the CPU, the warm phase listing sm90's variants, none compiled)")
    parser.add_argument("--phases", default="cold,warm,deepgemm", help="which phases, comma-separated (default: "
                        "cold,warm,deepgemm)")
    parser.add_argument("--cold-host", action="store_true", help="time each shape's first call right after its "
                        "inputs are built on the host (default: after the shape before has run a few steps, as in an "
                        "engine)")
    parser.add_argument("--phase", choices=("cold", "warm", "deepgemm"), help=argparse.SUPPRESS)  # a child's
    args = parser.parse_args(argv)
    if args.phase:
        result = child(args.phase, args.config, args.calls, args.smoke, args.jobs, args.cold_host)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0
    from indexcache.bench.provenance import checkout_commit, device_name, now, versions

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        print("no GPU visible: this script measures a GPU (pass --smoke to check it on three small CPU shapes)")
        return 2
    report: dict[str, Any] = {"date": now(), "commit": checkout_commit(), **versions(), "gpu": device_name(dev),
                              "device": device_name(dev) or "cpu", "config": args.config, "cpus": os.cpu_count(),
                              "cold_host": args.cold_host}
    if dev.type != "cuda":
        report["notice"] = CPU_NOTICE
    phases = args.phases.split(",")
    unknown = sorted(set(phases) - {"cold", "warm", "deepgemm"})
    if unknown:
        parser.error(f"--phases: expected cold, warm or deepgemm, got {', '.join(unknown)}")
    from indexcache.bench.output import write_json

    for phase in phases:  # each in a child process with fresh caches of its own
        with tempfile.TemporaryDirectory() as cache:
            report[phase] = _run_child(phase, args, {"DG_JIT_CACHE_DIR" if phase == "deepgemm" else
                                                     "TRITON_CACHE_DIR": cache})
        if args.out:  # after each phase: a time limit later keeps what was measured
            write_json(report, args.out, indent=1)
    for line in ([report["notice"]] if "notice" in report else []) + summary(report):
        print(line)
    if args.out:
        print(f"results written to {args.out}")
    return 1 if any("error" in report[phase] for phase in phases if phase != "deepgemm") else 0


if __name__ == "__main__":
    sys.exit(main())
