"""The host path of a serving step's calls, on any machine: new signature against kept, and the Python calls it makes
(issue 36; docs/kernels.md, "A first call is the host's, not the compiler's").

    python bench/host_path.py --out out/host_path.json

A first call of a new shape pays the public op's host path afresh: the spec check, the dispatch, the backend's
launch building and the launchers' keys. That is Python, so it can be measured and worked on without a GPU: this
script runs the cuda backend's host code for a GPU target (``--arch``, default sm90: its tuning table and kernel
choices, the Gluon ones excepted, which the interpreter does not take) on CPU tensors under ``TRITON_INTERPRET=1``,
with every kernel launch stubbed out, so nothing but the host path is timed. The steps are exactly those of
``indexcache warmup`` and ``bench/coldstart_gpu.py`` (:func:`indexcache.tools.warmup.decode_calls` /
``prefill_calls``). Per shape:

- ``new_us``: one step whose outputs are new tensors (a new signature for every call: checked, dispatched and built
  afresh), the median of ``--calls``; every such output is kept alive, so none lands at an address a kept call knows;
- ``kept_us``: the same step repeated with the same buffers (from its third call on: the kept launches of docs/ops.md,
  "Eager calls");
- ``first_us``: the shape's first step, timed after its inputs were built and the shape before had run
  (``REWARM_STEPS`` kept steps of it, as in ``bench/coldstart_gpu.py``: a serving engine's host has just run a step;
  ``--cold-host``: right after its inputs were built, which leaves the host's caches cold; the first shape has no
  shape before);
- ``python_calls``: the Python function calls of one new-signature step (``cProfile``'s count: the same on every
  machine, the number to drive down).

Host clock on this machine: not a GPU timing (the H200's host took about 3x this project's CPU machine's time for the
same path), and interpreted, never quoted as speed. ``--smoke``: two shapes, few calls.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from coldstart_gpu import CONFIG, REWARM_STEPS, materialize, renewed  # noqa: E402

SHAPES = [("decode", (1, 100, 1)), ("decode", (8, 4097, 1)), ("decode", (64, 32768, 1)), ("decode", (64, 32768, 2)),
          ("decode", (13, 100000, 2)), ("prefill", (128, 128)), ("prefill", (1000, 1000)), ("prefill", (2048, 8192))]
SMOKE = [("decode", (3, 300, 2)), ("prefill", (64, 200))]


def _stub_launches() -> None:
    """Every interpreted launch does nothing (the host path up to it runs as it would)."""
    from indexcache.backends.triton import launcher

    launcher._interpret = lambda *args, **kwargs: None


def _run(calls_of_step) -> float:
    """One step's public op calls, in order: µs, host clock."""
    import indexcache

    start = time.perf_counter()
    for op, args in calls_of_step:
        getattr(indexcache, op)(**args)
    return (time.perf_counter() - start) * 1e6


def _step(kind: str, dims: tuple[int, ...], plan) -> list:
    from indexcache.tools.warmup import decode_calls, prefill_calls

    fp8 = torch.float8_e4m3fn
    meta = (decode_calls(plan, plan.page_size, fp8, *dims) if kind == "decode"
            else prefill_calls(plan, plan.page_size, fp8, *dims))
    return materialize(kind, meta, dims, fp8, torch.device("cpu"))


def measure(kind: str, dims: tuple[int, ...], plan, calls: int, before: list | None = None) -> tuple[dict, list]:
    """One shape's first, new-signature and kept step times (µs, host clock) and the Python calls of a new-signature
    step, and its step (the next shape's ``before``); ``before``: the step of the shape before, run
    :data:`REWARM_STEPS` times before the first step (None: not)."""
    step = _step(kind, dims, plan)
    for _ in range(REWARM_STEPS if before is not None else 0):
        _run(before)
    first = _run(step)
    kept = statistics.median(_run(step) for _ in range(calls + 2))
    alive = [renewed(step) for _ in range(calls + 1)]  # all alive: no new output lands where a kept call's did
    new = statistics.median(_run(fresh) for fresh in alive[:-1])
    profile = cProfile.Profile()
    fresh = alive[-1]
    profile.enable()
    _run(fresh)
    profile.disable()
    python_calls = pstats.Stats(profile).total_calls
    return {"kind": kind, "shape": list(dims), "ops": [op for op, _ in step], "first_us": first, "new_us": new,
            "kept_us": kept, "first_over_kept": first / kept, "new_over_kept": new / kept,
            "python_calls": python_calls}, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--arch", default="sm90", help="the NVIDIA target whose host path runs (default sm90)")
    parser.add_argument("--config", default=CONFIG, help="the model config (default: DeepSeek-V3.2's example)")
    parser.add_argument("--calls", type=int, default=20, help="timed steps a shape for each median (default 20)")
    parser.add_argument("--smoke", action="store_true", help="two small shapes, few calls: checks the script")
    parser.add_argument("--cold-host", action="store_true", help="time each shape's first step right after its inputs "
                        "are built (default: after the shape before has run a few steps, as in an engine)")
    args = parser.parse_args(argv)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("run it as a script: Triton must be imported with TRITON_INTERPRET=1 here")
    # Before Triton is imported: the kernels as interpreted functions, the cuda backend for the target named.
    os.environ.update(TRITON_INTERPRET="1", INDEXCACHE_BACKEND="cuda", INDEXCACHE_CUDA_ARCH=args.arch)
    _stub_launches()
    from indexcache.bench.provenance import checkout_commit, now, versions
    from indexcache.plan import LayerPlan

    plan = LayerPlan.from_config(args.config)
    calls = 3 if args.smoke else args.calls
    rows, before = [], None
    for kind, dims in SMOKE if args.smoke else SHAPES:
        row, step = measure(kind, dims, plan, calls, before)
        before = None if args.cold_host else step
        rows.append(row)
    print(f"host path of a step's calls, {args.arch} host code, launches stubbed, this machine's host clock "
          f"(not a GPU timing)")
    for r in rows:
        print(f"  {r['kind']:7s} {str(tuple(r['shape'])):18s} first {r['first_us']:7.1f} us  new {r['new_us']:7.1f} us"
              f"  kept {r['kept_us']:6.1f} us  "
              f"first/kept {r['first_over_kept']:5.2f}  new/kept {r['new_over_kept']:5.2f}  python calls "
              f"{r['python_calls']}")
    if args.out:
        from indexcache.bench.output import write_json

        write_json({"what": "host_path", "date": now(), "commit": checkout_commit(), **versions(), "arch": args.arch,
                    "host": "interpreted, launches stubbed: host clock of this machine, not a GPU timing",
                    "cpus": os.cpu_count(), "smoke": args.smoke, "cold_host": args.cold_host, "rows": rows}, args.out)
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
