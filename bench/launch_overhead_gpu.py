"""Where the eager time of a small translate call goes on a GPU: Python checks, dispatch, Triton's launcher.

Times (after 20 warm-up calls, the median of 15 CUDA-event-timed bursts of 200 back-to-back calls, per call, so
host-bound calls show their host cost):
an empty Triton kernel with no arguments, the same with translate's 18 arguments, the translate kernel
launched directly, the backend function, and the public op. Prints a table; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import indexcache
from indexcache.backends.cuda import ARCH_ENV, tuning
from indexcache.backends.triton import translate as tr
from indexcache.backends.triton.target import detect
from indexcache.bench.output import write_json
from indexcache.bench.provenance import device_name, versions
from indexcache.bench.timing import median_ms


@triton.jit
def _empty():
    pass


@triton.jit
def _empty_args(a, b, c, d, e, r, k, bt, p, ps, s0, s1, s2, s3, s4, s5, s6, s7,
                HAS: tl.constexpr, SHIFT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    i32 = torch.int32
    rows, k, pages = 64, 2048, 2048
    raw = torch.randint(-1, pages * 64, (rows, k), dtype=i32, device=dev)
    table = torch.randint(0, 10**6, (rows, pages), dtype=i32, device=dev)
    seq = torch.full((rows,), pages * 64, dtype=i32, device=dev)
    out = torch.empty_like(raw)
    target = detect("cuda", ARCH_ENV, "sm90")[2]
    cfg = tuning(target.arch)["translate"]
    opts = {"num_warps": cfg["num_warps"]}
    rows_ = [
        ("empty kernel, no arguments", lambda: _empty[(1,)]()),
        ("empty kernel, translate's 18 arguments", lambda: _empty_args[(64, 2)](
            raw, table, seq, seq, out, rows, k, rows, pages, 64, k, 1, pages, 1, 1, 1, k, 1,
            HAS=False, SHIFT=6, BR=2, BK=1024, **opts)),
        ("translate kernel launched directly", lambda: tr.translate_kernel[(32, 2)](
            raw, table, seq, seq, out, rows, k, rows, pages, 64, k, 1, pages, 1, 1, 1, k, 1,
            HAS_R2B=False, SHIFT=6, BLOCK_R=2, BLOCK_K=1024, **opts)),
        ("backend function (launcher)", lambda: tr.translate(raw, table, seq, 64, None, out, target=target, cfg=cfg)),
        ("indexcache.translate(backend='cuda')", lambda: indexcache.translate(raw, table, seq, 64, out=out,
                                                                              backend="cuda")),
        ("indexcache.translate() automatic", lambda: indexcache.translate(raw, table, seq, 64, out=out)),
    ]
    results = {name: 1e3 * median_ms(fn, dev, 0.0, 15, 15, warmup=20, calls=200) for name, fn in rows_}
    width = max(map(len, results))
    gpu, v = device_name(dev), versions()
    print(f"{gpu}  torch {v['torch']}  triton {v['triton']}")
    for name, us in results.items():
        print(f"{name:<{width}}  {us:8.1f} µs/call (eager, back to back)")
    if args.out:
        write_json({"gpu": gpu, "triton": v["triton"], "us_per_call": results}, args.out)


if __name__ == "__main__":
    main()
