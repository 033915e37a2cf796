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

Host clock on this machine: not a GPU timing (a GPU host's warm path took about this machine's time, its launches,
stubbed here, more; docs/kernels.md, "The GPU host's profile"), and interpreted, never quoted as speed. ``--smoke``:
two shapes, few calls.

``--profile N``: per shape also the ``N`` functions with the most time of their own over ``--calls`` more
new-signature steps (``cProfile``, per step: what to work on first; the profiler's hooks inflate every time, so read
their order, not their size). ``--gpu``: on this machine's GPU instead (the default above is the CPU, interpreted),
the real launches after ``indexcache.warmup(plan)`` (nothing compiles during the sweep), each step's host time to
its last call's return and the device synchronized after it, untimed: what the stubbed launches hide here (the
launchers' keys, Triton's launcher call, the Hopper decode's launch building) shows there.
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


def _step(kind: str, dims: tuple[int, ...], plan, dev: torch.device) -> list:
    from indexcache.tools.warmup import decode_calls, prefill_calls

    fp8 = torch.float8_e4m3fn
    meta = (decode_calls(plan, plan.page_size, fp8, *dims) if kind == "decode"
            else prefill_calls(plan, plan.page_size, fp8, *dims))
    return materialize(kind, meta, dims, fp8, dev)


def _settle(dev: torch.device) -> None:
    """On a GPU, wait for the device: no step queues behind the one before."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(calls_of_step, dev: torch.device) -> float:
    """:func:`_run`, then :func:`_settle` (untimed)."""
    us = _run(calls_of_step)
    _settle(dev)
    return us


def _where(code: tuple[str, int, str]) -> str:
    """A profile entry's function as ``path:line(name)``, the path relative to the project where it lies in it."""
    file, line, name = code
    root = Path(__file__).resolve().parents[1]
    path = Path(file)
    return f"{path.relative_to(root) if path.is_relative_to(root) else path.name}:{line}({name})"


def _heaviest(profile: cProfile.Profile, steps: int, top: int) -> list[dict]:
    """The ``top`` functions of ``profile`` by time of their own, per step of ``steps``: calls and µs."""
    stats = pstats.Stats(profile).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, ...)}
    entries = [item for item in stats.items() if "_lsprof" not in item[0][2]]  # less the profiler's own disable()
    ranked = sorted(entries, key=lambda item: item[1][2], reverse=True)[:top]
    return [{"function": _where(code), "calls": n / steps, "own_us": own * 1e6 / steps,
             "cumulative_us": cum * 1e6 / steps} for code, (_, n, own, cum, _) in ranked]


def measure(kind: str, dims: tuple[int, ...], plan, calls: int, before: list | None, dev: torch.device,
            top: int = 0) -> tuple[dict, list]:
    """One shape's first, new-signature and kept step times (µs, host clock) and the Python calls of a new-signature
    step, and its step (the next shape's ``before``); ``before``: the step of the shape before, run
    :data:`REWARM_STEPS` times before the first step (None: not); ``top`` > 0: also the ``top`` functions with the
    most time of their own over ``calls`` more new-signature steps (``profile``). ``dev``: where the tensors live."""
    step = _step(kind, dims, plan, dev)
    for _ in range(REWARM_STEPS if before is not None else 0):
        _timed(before, dev)
    first = _timed(step, dev)
    kept = statistics.median(_timed(step, dev) for _ in range(calls + 2))
    # All alive: no new output lands where a kept call's did.
    alive = [renewed(step) for _ in range(calls + 1 + (calls if top else 0))]
    new = statistics.median(_timed(fresh, dev) for fresh in alive[:calls])
    profile = cProfile.Profile()
    profile.enable()
    _run(alive[calls])
    profile.disable()
    row = {"kind": kind, "shape": list(dims), "ops": [op for op, _ in step], "first_us": first, "new_us": new,
           "kept_us": kept, "first_over_kept": first / kept, "new_over_kept": new / kept,
           "python_calls": pstats.Stats(profile).total_calls}
    if top:
        profile = cProfile.Profile()
        for fresh in alive[calls + 1:]:
            profile.enable()
            _run(fresh)
            profile.disable()
            _settle(dev)
        row["profile"] = _heaviest(profile, calls, top)
    return row, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--arch", default="sm90", help="the NVIDIA target whose host path runs interpreted "
                        "(default sm90; with --gpu the GPU's own)")
    parser.add_argument("--config", default=CONFIG, help="the model config (default: DeepSeek-V3.2's example)")
    parser.add_argument("--calls", type=int, default=20, help="timed steps a shape for each median (default 20)")
    parser.add_argument("--smoke", action="store_true", help="two small shapes, few calls: checks the script")
    parser.add_argument("--cold-host", action="store_true", help="time each shape's first step right after its inputs "
                        "are built (default: after the shape before has run a few steps, as in an engine)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="also list, a shape, the N functions with "
                        "the most time of their own over --calls more new-signature steps")
    parser.add_argument("--gpu", action="store_true", help="on this machine's GPU: the real launches after "
                        "indexcache.warmup (default: interpreted on the CPU, launches stubbed)")
    args = parser.parse_args(argv)
    if args.gpu:
        if not torch.cuda.is_available():
            parser.error("--gpu: no GPU visible here")
        dev = torch.device("cuda")
        host = "this machine's GPU, the real launches after indexcache.warmup: host clock to each step's last return"
    else:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("run it as a script: Triton must be imported with TRITON_INTERPRET=1 here")
        # Before Triton is imported: the kernels as interpreted functions, the cuda backend for the target named.
        os.environ.update(TRITON_INTERPRET="1", INDEXCACHE_BACKEND="cuda", INDEXCACHE_CUDA_ARCH=args.arch)
        _stub_launches()
        dev = torch.device("cpu")
        host = "interpreted, launches stubbed: host clock of this machine, not a GPU timing"
    import indexcache
    from indexcache.bench.provenance import checkout_commit, device_name, now, versions
    from indexcache.plan import LayerPlan

    plan = LayerPlan.from_config(args.config)
    if args.gpu:
        warmed = indexcache.warmup(plan)
        arch = warmed.target
        print(f"indexcache.warmup: {len(warmed.variants)} variants for {arch} in {warmed.wall:.1f} s")
    else:
        arch = args.arch
    calls = 3 if args.smoke else args.calls
    rows, before = [], None
    for kind, dims in SMOKE if args.smoke else SHAPES:
        row, step = measure(kind, dims, plan, calls, before, dev, args.profile)
        before = None if args.cold_host else step
        rows.append(row)
    device = device_name(dev) if args.gpu else None
    print(f"host path of a step's calls, {device or f'{arch} host code, launches stubbed'}, this machine's host clock"
          f"{'' if args.gpu else ' (not a GPU timing)'}")
    for r in rows:
        print(f"  {r['kind']:7s} {str(tuple(r['shape'])):18s} first {r['first_us']:7.1f} us  new {r['new_us']:7.1f} us"
              f"  kept {r['kept_us']:6.1f} us  "
              f"first/kept {r['first_over_kept']:5.2f}  new/kept {r['new_over_kept']:5.2f}  python calls "
              f"{r['python_calls']}")
        for f in r.get("profile", []):
            print(f"      {f['own_us']:7.1f} us own {f['cumulative_us']:8.1f} us with callees {f['calls']:6.1f} calls  "
                  f"{f['function']}")
    if args.out:
        from indexcache.bench.output import write_json

        write_json({"what": "host_path", "date": now(), "commit": checkout_commit(), **versions(),
                    "arch": arch, "device": device,
                    "host": host, "cpus": os.cpu_count(), "smoke": args.smoke, "cold_host": args.cold_host,
                    "rows": rows}, args.out)
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
