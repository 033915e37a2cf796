"""Where the eager time of an indexcache call goes on a GPU, and the eager-path targets of docs/kernels.md.

1. Launch ladder (CUDA events around each of 200 back-to-back calls, median of 15 bursts, per call, so a
   host-bound call shows its host cost): an empty Triton kernel without and with translate's 18 arguments
   through Triton's launch and through :class:`~indexcache.backends.triton.launcher.Launcher`, the translate
   kernel both ways, the backend function, and the public op (explicit and automatic backend).
2. Host cost of the Python layers (the host clock, nothing launched): each op's spec check and the dispatch.
3. Eager against graph, same inputs, preallocated outputs: translate decode 64 × 2048, top-k and its
   translating form at 64 × 128K k 2048, paged decode logits at 64 × 32K and 64 × 128K (next_n 1). Each target
   is printed as met or missed: translate eager ≤ 1.3 × the empty launch of row 1; top-k eager ≤ graph +
   25 µs; paged logits eager ≤ graph + 25 µs.

``--out`` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl

import indexcache
from indexcache.backends.cuda import ARCH_ENV, tuning
from indexcache.backends.triton import translate as tr
from indexcache.backends.triton.launcher import Launcher, launch_key_options
from indexcache.backends.triton.support import launch_options
from indexcache.backends.triton.target import detect
from indexcache.bench.output import write_json
from indexcache.bench.provenance import device_name, versions
from indexcache.bench.timing import Timer, median_ms
from indexcache.hal import dispatch
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


def _ladder(dev: torch.device) -> dict[str, float]:
    i32 = torch.int32
    rows, k, pages = 64, 2048, 2048
    raw = torch.randint(-1, pages * 64, (rows, k), dtype=i32, device=dev)
    table = torch.randint(0, 10**6, (rows, pages), dtype=i32, device=dev)
    seq = torch.full((rows,), pages * 64, dtype=i32, device=dev)
    out = torch.empty_like(raw)
    target = detect("cuda", ARCH_ENV, "sm90")[2]
    cfg = tuning(target.arch)["translate"]
    opts = launch_options(target, cfg)
    key_opts = launch_key_options(opts)
    args = (raw, table, seq, seq, out, rows, k, rows, pages, 64, k, 1, pages, 1, 1, 1, k, 1)
    empty_args = Launcher(_empty_args)
    rows_ = [
        ("empty kernel, no arguments (Triton launch)", lambda: _empty[(1,)]()),
        ("empty kernel, 18 arguments (Triton launch)", lambda: _empty_args[(32, 2)](
            *args, HAS=False, SHIFT=6, BR=2, BK=1024, **opts)),
        ("empty kernel, 18 arguments (Launcher)", lambda: empty_args(
            (32, 2), key_opts, *args, HAS=False, SHIFT=6, BR=2, BK=1024)),
        ("translate kernel (Triton launch)", lambda: tr.translate_kernel[(32, 2)](
            *args, HAS_R2B=False, SHIFT=6, BLOCK_R=2, BLOCK_K=1024, **opts)),
        ("translate kernel (Launcher)", lambda: tr.TRANSLATE(
            (32, 2), key_opts, *args, HAS_R2B=False, SHIFT=6, BLOCK_R=2, BLOCK_K=1024)),
        ("backend function", lambda: tr.translate(raw, table, seq, 64, None, out, target=target, cfg=cfg,
                                                  options=key_opts)),
        ("indexcache.translate(backend='cuda')", lambda: indexcache.translate(raw, table, seq, 64, out=out,
                                                                              backend="cuda")),
        ("indexcache.translate() automatic", lambda: indexcache.translate(raw, table, seq, 64, out=out)),
    ]
    return {name: 1e3 * median_ms(fn, dev, 0.0, 15, 15, warmup=20, calls=200) for name, fn in rows_}


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
    """The host cost of the check and the dispatch, and the eager and graph times of one row."""
    checked = check(a)
    host = {"spec check": _host_us(lambda: check(a)), "dispatch": _host_us(lambda: dispatch.resolve(op, checked))}
    eager = timer.eager_us(lambda i: call(a))
    graph = timer.graph_us(lambda i: call(a), 1)
    if op == "translate":
        goal, met = f"<= 1.3 x empty launch = {1.3 * empty:.1f}", eager <= 1.3 * empty
    else:
        goal, met = f"<= graph + 25 = {graph + 25:.1f}", eager <= graph + 25
    return label, host, {"case": label, "eager_us": eager, "graph_us": graph, "overhead_us": eager - graph,
                         "target": goal, "met": met}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gpu, v = device_name(dev), versions()
    print(f"{gpu}  torch {v['torch']}  triton {v['triton']}")
    ladder = _ladder(dev)
    width = max(map(len, ladder))
    print("\n1. launch ladder, translate decode 64 x 2048 (eager, back to back)")
    for name, us in ladder.items():
        print(f"{name:<{width}}  {us:8.1f} µs/call")
    empty = ladder["empty kernel, no arguments (Triton launch)"]

    timer = Timer(dev, warmup=20, reps=200, graph_reps=50)
    measured = [_measure(*row, timer, empty) for row in _calls(dev)]
    host = {label: parts for label, parts, _ in measured}
    rows = [row for _, _, row in measured]
    print("\n2. host cost of the Python layers (host clock, nothing launched)")
    for label, parts in host.items():
        print(f"{label:<36}  " + "  ".join(f"{name} {us:5.1f} µs" for name, us in parts.items()))
    print("\n3. eager against graph, preallocated outputs")
    print(f"{'case':<36}  {'eager µs':>9}  {'graph µs':>9}  {'eager-graph':>11}  target")
    for r in rows:
        print(f"{r['case']:<36}  {r['eager_us']:9.1f}  {r['graph_us']:9.1f}  {r['overhead_us']:11.1f}  "
              f"{r['target']}: {'met' if r['met'] else 'MISSED'}")
    if args.out:
        write_json({"gpu": gpu, "torch": v["torch"], "triton": v["triton"], "us_per_call": ladder, "host_us": host,
                    "eager_vs_graph": rows}, args.out)


if __name__ == "__main__":
    main()
