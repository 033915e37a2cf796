"""Where the eager time of an indexcache call goes on a GPU, and the eager-path targets of issue 16.

1. Launch ladder (CUDA events around bursts of 200 back-to-back calls, so a host-bound call shows its host
   cost; the rows take turns, median of 15 rounds): an empty Triton kernel without and with translate's 18
   arguments through Triton's launch and through :class:`~indexcache.backends.triton.launcher.Launcher`, the
   translate kernel through Triton, the Launcher and a bound launch, the backend function, and the public op
   checked each call (the memo emptied first) and kept (:mod:`indexcache.hal.memo`).
2. Host cost of the Python layers (the host clock, nothing launched): each op's spec check and the dispatch.
3. Eager against graph, same inputs, preallocated outputs, timed as ``indexcache bench`` times (events around
   each call): translate decode 64 × 2048, top-k and its translating form at 64 × 128K k 2048, paged decode
   logits at 64 × 32K and 64 × 128K (next_n 1), each checked every call and kept. Each target is printed as met
   or missed: translate eager ≤ 1.3 × an empty Triton launch timed the same way; top-k and paged logits eager
   ≤ graph + 25 µs.

``--out`` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import indexcache
from indexcache.backends.cuda import tuning
from indexcache.backends.cuda.arch import NVIDIA
from indexcache.backends.triton import translate as tr
from indexcache.backends.triton.launcher import Launcher, launch_key_options
from indexcache.backends.triton.support import launch_options
from indexcache.backends.triton.target import detect
from indexcache.bench.output import write_json
from indexcache.bench.provenance import device_name, report_head, versions
from indexcache.bench.timing import Timer
from indexcache.hal import dispatch, memo
from indexcache.hal.specs import SPECS
from indexcache.hal.specs.bench import BenchCase


@triton.jit
def _empty():
    pass


@triton.jit
def _empty_args(a, b, c, d, e, r, k, bt, p, ps, s0, s1, s2, s3, s4, s5, s6, s7,
                HAS: tl.constexpr, SHIFT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    pass


def _host_us(fn, reps: int = 2000) -> float:
    """Median µs of ``fn()`` on the host clock, in 10 bursts of ``reps // 10`` calls (nothing launched)."""
    for _ in range(100):
        fn()
    burst = reps // 10
    samples = []
    for _ in range(10):
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / burst)
    return statistics.median(samples)


def _alternating_us(fns: dict, dev: torch.device, rounds: int = 15, calls: int = 200) -> dict[str, float]:
    """Per entry the median over ``rounds`` of the µs a call of a burst of ``calls`` back-to-back calls took
    (CUDA events around the burst); the entries take turns within each round (the card is power-capped)."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3 / calls)
    return {name: statistics.median(times) for name, times in samples.items()}


def _ladder(dev: torch.device) -> tuple[dict[str, float], Callable[[], None]]:
    """µs a call of each rung, and the bound translate launch (section 3 times it again)."""
    i32 = torch.int32
    rows, k, pages = 64, 2048, 2048
    raw = torch.randint(-1, pages * 64, (rows, k), dtype=i32, device=dev)
    table = torch.randint(0, 10**6, (rows, pages), dtype=i32, device=dev)
    seq = torch.full((rows,), pages * 64, dtype=i32, device=dev)
    out = torch.empty_like(raw)
    target = detect(NVIDIA)[2]
    cfg = tuning(target.arch)["translate"]
    opts = launch_options(target, cfg)
    key_opts = launch_key_options(opts)
    args = (raw, table, seq, seq, out, rows, k, rows, pages, 64, k, 1, pages, 1, 1, 1, k, 1)
    empty_args = Launcher(_empty_args)
    named = dict(HAS_R2B=False, SHIFT=6, BLOCK_R=2, BLOCK_K=1024)
    bound = tr.TRANSLATE.bind((32, 2), key_opts, *args, **named)

    def checked_each_call():
        memo.clear()
        indexcache.translate(raw, table, seq, 64, out=out, backend="cuda")

    return _alternating_us({
        "empty kernel, no arguments (Triton launch)": lambda: _empty[(1,)](),
        "empty kernel, 18 arguments (Triton launch)": lambda: _empty_args[(32, 2)](
            *args, HAS=False, SHIFT=6, BR=2, BK=1024, **opts),
        "empty kernel, 18 arguments (Launcher)": lambda: empty_args(
            (32, 2), key_opts, *args, HAS=False, SHIFT=6, BR=2, BK=1024),
        "translate kernel (Triton launch)": lambda: tr.translate_kernel[(32, 2)](*args, **named, **opts),
        "translate kernel (Launcher)": lambda: tr.TRANSLATE((32, 2), key_opts, *args, **named),
        "translate kernel (bound launch)": bound,
        "backend function": lambda: tr.translate(raw, table, seq, 64, None, out, target=target, cfg=cfg,
                                                 options=key_opts),
        "indexcache.translate(backend='cuda'), checked each call": checked_each_call,
        "indexcache.translate(backend='cuda'), kept call": lambda: indexcache.translate(raw, table, seq, 64, out=out,
                                                                                       backend="cuda"),
        "indexcache.translate() automatic, kept call": lambda: indexcache.translate(raw, table, seq, 64, out=out),
    }, dev), bound


def _inputs(op: str, case: BenchCase, dev: torch.device) -> dict:
    built = SPECS[op].bench.build(case, torch.Generator().manual_seed(1))
    return {name: v.to(dev) if isinstance(v, torch.Tensor) else v for name, v in built.items()}


def _calls(dev: torch.device) -> list[tuple[str, str, dict, object, object]]:
    """``(label, op, inputs, public call, spec check)`` of the eager-against-graph rows."""
    translate = _inputs("translate", BenchCase("decode", dict(requests=64, rows_per_request=1, k=2048, page_size=64,
                                                              context=131072)), dev)
    rows = []
    rows.append(("translate decode 64 x 2048", "translate", translate,
                 lambda a: indexcache.translate(a["raw"], a["page_table"], a["seq_lens"], a["page_size"],
                                                row_to_batch=a["row_to_batch"], out=a["out"]),
                 lambda a: SPECS["translate"].check(a["raw"], a["page_table"], a["seq_lens"], a["page_size"],
                                                    row_to_batch=a["row_to_batch"], out=a["out"])))
    scores = _inputs("topk", BenchCase("64x128K", dict(rows=64, cols=131072, k=2048, page_size=64)), dev)
    rows.append(("topk 64 x 128K k2048", "topk", scores,
                 lambda a: indexcache.topk(a["scores"], a["lengths"], a["k"], out=a["out"]),
                 lambda a: SPECS["topk"].check(a["scores"], a["lengths"], a["k"], out=a["out"])))
    rows.append(("topk_translate 64 x 128K k2048", "topk_translate", scores,
                 lambda a: indexcache.topk_translate(a["scores"], a["lengths"], a["k"], a["page_table"],
                                                     a["page_size"], out=a["out"]),
                 lambda a: SPECS["topk_translate"].check(a["scores"], a["lengths"], a["k"], a["page_table"],
                                                         a["page_size"], out=a["out"])))
    for context in (32768, 131072):
        case = BenchCase("decode", dict(batch=64, context=context, next_n=1, heads=64, dim=128, page_size=64,
                                        kind="fp8"))
        logits = _inputs("paged_mqa_logits", case, dev)
        rows.append((f"paged_mqa_logits 64 x {context // 1024}K next_n 1", "paged_mqa_logits", logits,
                     lambda a: indexcache.paged_mqa_logits(a["q"], a["k_cache"], a["weights"], a["context_lens"],
                                                           a["page_table"], a["max_context_len"], out=a["out"]),
                     lambda a: SPECS["paged_mqa_logits"].check(a["q"], a["k_cache"], a["weights"],
                                                               a["context_lens"], a["page_table"],
                                                               a["max_context_len"], out=a["out"])))
    return rows


def _measure(label: str, op: str, a: dict, call, check, timer: Timer, empty: float) -> tuple[str, dict, dict]:
    """The host cost of the check and the dispatch, and the eager (checked each call, and kept) and graph times
    of one row."""
    checked = check(a)
    host = {"spec check": _host_us(lambda: check(a)), "dispatch": _host_us(lambda: dispatch.resolve(op, checked))}

    def cold(i):
        memo.clear()
        call(a)

    checked_us = timer.eager_us(cold)
    eager = timer.eager_us(lambda i: call(a))
    graph = timer.graph_us(lambda i: call(a), 1)
    if op == "translate":
        goal, met = f"<= 1.3 x empty launch = {1.3 * empty:.1f}", eager <= 1.3 * empty
    else:
        goal, met = f"<= graph + 25 = {graph + 25:.1f}", eager <= graph + 25
    return label, host, {"case": label, "eager_us": eager, "checked_eager_us": checked_us, "graph_us": graph,
                         "overhead_us": eager - graph, "target": goal, "met": met}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gpu, v = device_name(dev), versions()
    print(f"{gpu}  torch {v['torch']}  triton {v['triton']}")
    ladder, bound = _ladder(dev)
    width = max(map(len, ladder))
    print("\n1. launch ladder, translate decode 64 x 2048 (bursts of 200 back-to-back calls, rows alternating)")
    empty_burst = ladder["empty kernel, no arguments (Triton launch)"]
    for name, us in ladder.items():
        print(f"{name:<{width}}  {us:8.1f} µs/call  {us / empty_burst:5.2f} x empty launch")

    timer = Timer(dev, warmup=20, reps=200, graph_reps=50)
    empty = timer.eager_us(lambda i: _empty[(1,)]())
    bound_launch = timer.eager_us(lambda i: bound())
    measured = [_measure(*row, timer, empty) for row in _calls(dev)]
    host = {label: parts for label, parts, _ in measured}
    rows = [row for _, _, row in measured]
    print("\n2. host cost of the Python layers (host clock, nothing launched; the kept call skips both)")
    for label, parts in host.items():
        print(f"{label:<36}  " + "  ".join(f"{name} {us:5.1f} µs" for name, us in parts.items()))
    print(f"\n3. eager (events around each call, as indexcache bench times) against graph, preallocated outputs; "
          f"empty Triton launch {empty:.1f} µs and the bound translate launch {bound_launch:.1f} µs timed the same way")
    print(f"{'case':<36}  {'checked µs':>10}  {'eager µs':>9}  {'graph µs':>9}  {'eager-graph':>11}  target")
    for r in rows:
        print(f"{r['case']:<36}  {r['checked_eager_us']:10.1f}  {r['eager_us']:9.1f}  {r['graph_us']:9.1f}  "
              f"{r['overhead_us']:11.1f}  {r['target']}: {'met' if r['met'] else 'MISSED'}")
    if args.out:
        write_json(report(dev, ladder, host, empty, bound_launch, rows), args.out)


def report(dev: torch.device, ladder: dict, host: dict, empty: float, bound_launch: float, rows: list) -> dict:
    """The JSON: what ran where (date, commit, GPU, versions: :func:`~indexcache.bench.provenance.report_head`),
    then the three sections."""
    return {**report_head(dev), "gpu": device_name(dev), "us_per_call": ladder, "host_us": host,
            "empty_launch_eager_us": empty, "bound_translate_launch_eager_us": bound_launch, "eager_vs_graph": rows}


if __name__ == "__main__":
    main()
