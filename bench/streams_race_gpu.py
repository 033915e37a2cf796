"""Two streams calling the top-k ops at once get exactly their one-stream results; the producer step's time on the
default per-stream workspace against a caller's (docs/ops.md, "Workspace").

    pip install -e . && python bench/streams_race_gpu.py --out out/streams-race.json
    compute-sanitizer --tool racecheck python bench/streams_race_gpu.py --iters 2 --no-timing --out race.json

1. Race: two lanes, each a stream with inputs of its own of the same shapes — ``topk`` and ``topk_translate`` on
   the decode step's 64 × 32K rows (the many-rows kernel) and on 2 × 128K rows (split into chunks), k 2048, and
   ``paged_topk_translate`` at 64 × 32K with next_n 1 and 2 (the decode producer step) — call every op ``--iters``
   times (default 1000) with given outputs (so the kept eager calls) and the default workspace, nothing ordering
   one stream against the other; each result is compared on the device, exactly, with the same call made alone
   first. On the CPU (``--smoke``, Triton interpreted) the lanes are threads: the default workspace belongs to the
   calling thread there.
2. Timing (skipped with ``--no-timing``): the 64 × 32K producer step (``paged_topk_translate``, next_n 1, k 2048)
   on the default per-stream workspace and on a caller's ``workspace=`` of ``indexcache.workspace_bytes`` bytes,
   as a kept eager call (bursts of back-to-back calls, CUDA events) and as a CUDA graph replay, the two taking turns
   in each of ``--rounds`` rounds; medians, and their ratio default / caller (target: at most 1.03).

Writes one JSON to ``--out``; exits 1 when a result differs or a section fails (a missed timing target is
printed, not failed: the two run the same kernels).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import indexcache
from indexcache.bench.output import print_rows, run_sections
from indexcache.bench.provenance import checkout_commit, device_name, now, versions
from indexcache.bench.timing import capture_graph, median_ms, on_gpu
from indexcache.hal import dispatch
from indexcache.hal.specs import SPECS
from indexcache.hal.specs.bench import BenchCase

PAGE = 64
K = 2048
RATIO_TARGET = 1.03
I32 = torch.int32
OUTPUTS = ("logits", "out", "out_raw")


@dataclass(frozen=True)
class Shapes:
    """The race's shapes: many rows and split rows of the top-k ops, and the producer step's batch and context."""

    many: tuple[int, int]
    split: tuple[int, int]
    k: int
    batch: int
    context: int
    heads: int
    dim: int


FULL = Shapes(many=(64, 32768), split=(2, 131072), k=K, batch=64, context=32768, heads=64, dim=128)
# Interpreted on the CPU: the same paths (rows of 600 take the fused kernel, a row of 4200 is split in two chunks).
SMOKE = Shapes(many=(2, 600), split=(1, 4200), k=16, batch=1, context=600, heads=2, dim=32)


def producer_args(shapes: Shapes, next_n: int, gen: torch.Generator, dev: torch.device) -> dict[str, Any]:
    """``paged_topk_translate``'s arguments, outputs given, as ``indexcache bench`` builds them."""
    case = BenchCase("race", dict(batch=shapes.batch, context=shapes.context, next_n=next_n, heads=shapes.heads,
                                  dim=shapes.dim, page_size=PAGE, kind="fp8", k=shapes.k))
    args = SPECS["paged_topk_translate"].bench.build(case, gen)
    return {n: v.to(dev) if isinstance(v, torch.Tensor) else v for n, v in args.items()}


def calls(shapes: Shapes, gen: torch.Generator, dev: torch.device) -> dict[str, tuple[str, dict[str, Any]]]:
    """A lane's calls by name, as ``(op, arguments)`` with outputs given."""
    def select(rows: int, cols: int, translate: bool) -> tuple[str, dict[str, Any]]:
        args = dict(scores=torch.randn(rows, cols, generator=gen).to(dev),
                    lengths=torch.randint(cols // 2, cols + 1, (rows,), generator=gen, dtype=I32).to(dev), k=shapes.k,
                    out=torch.empty(rows, shapes.k, dtype=I32, device=dev))
        if not translate:
            return "topk", args
        table = torch.randperm(rows * (cols // PAGE + 1), generator=gen, dtype=I32).view(rows, -1)
        return "topk_translate", dict(args, page_table=table.to(dev), page_size=PAGE,
                                      out_raw=torch.empty(rows, shapes.k, dtype=I32, device=dev))

    many, split = shapes.many, shapes.split
    return {f"topk {many[0]}x{many[1]}": select(*many, False), f"topk {split[0]}x{split[1]}": select(*split, False),
            f"topk_translate {many[0]}x{many[1]}": select(*many, True),
            f"topk_translate {split[0]}x{split[1]}": select(*split, True),
            f"paged_topk_translate {shapes.batch}x{shapes.context} next_n 1": (
                "paged_topk_translate", producer_args(shapes, 1, gen, dev)),
            f"paged_topk_translate {shapes.batch}x{shapes.context} next_n 2": (
                "paged_topk_translate", producer_args(shapes, 2, gen, dev))}


def outputs(args: dict[str, Any]) -> list[torch.Tensor]:
    """A call's outputs, as int32 bits (float logits compared bit for bit)."""
    return [args[n].view(I32) if args[n].dtype == torch.float32 else args[n] for n in OUTPUTS
            if args.get(n) is not None]


@dataclass
class Lane:
    """One stream's (on the CPU: one thread's) calls on ``backend``, their one-lane results and a count of differing
    elements per call, kept on the device (no sync while racing); ``error``: what a thread of it raised."""

    calls: dict[str, tuple[str, dict[str, Any]]]
    backend: str
    stream: Any = None
    want: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    wrong: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str | None = None

    def alone(self) -> None:
        """Each call once, its results kept as the reference."""
        for name, (op, args) in self.calls.items():
            getattr(indexcache, op)(**args, backend=self.backend)
            self.want[name] = [t.clone() for t in outputs(args)]
            self.wrong[name] = torch.zeros((), dtype=torch.int64, device=self.want[name][0].device)

    def step(self) -> None:
        """Each call once, its results compared with the reference on the device."""
        for name, (op, args) in self.calls.items():
            getattr(indexcache, op)(**args, backend=self.backend)
            for got, want in zip(outputs(args), self.want[name], strict=True):
                self.wrong[name] += (got != want).sum()

    def steps(self, iters: int) -> None:
        """``iters`` steps, what they raise kept in ``error`` (a thread's exception would otherwise be lost)."""
        try:
            for _ in range(iters):
                self.step()
        except Exception:  # noqa: BLE001  (reported by race_section)
            self.error = traceback.format_exc()


def race(lanes: list[Lane], iters: int, dev: torch.device) -> None:
    """``iters`` steps of every lane, the lanes at once: on a GPU from one thread, each lane on its own stream with
    nothing ordering them; on the CPU one thread a lane."""
    if not on_gpu(dev):
        threads = [threading.Thread(target=lane.steps, args=(iters,)) for lane in lanes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return
    for lane in lanes:
        lane.stream = torch.cuda.Stream(dev)
        lane.stream.wait_stream(torch.cuda.current_stream(dev))
    for _ in range(iters):
        for lane in lanes:
            with torch.cuda.stream(lane.stream):
                lane.step()
    for lane in lanes:
        torch.cuda.current_stream(dev).wait_stream(lane.stream)
    torch.cuda.synchronize(dev)


def race_section(shapes: Shapes, iters: int, backend: str, dev: torch.device) -> list[dict[str, Any]]:
    """Rows ``{lane, call, iters, differing, ok}``: elements that differed from the one-lane result, summed over
    the iterations."""
    lanes = [Lane(calls(shapes, torch.Generator().manual_seed(seed), dev), backend) for seed in (0, 1)]
    for lane in lanes:
        lane.alone()
    race(lanes, iters, dev)
    if errors := [lane.error for lane in lanes if lane.error]:
        raise RuntimeError("a lane raised:\n" + "\n".join(errors))
    return [{"lane": i, "call": name, "iters": iters, "differing": int(bad), "ok": int(bad) == 0}
            for i, lane in enumerate(lanes) for name, bad in lane.wrong.items()]


def timing_section(shapes: Shapes, rounds: int, backend: str, dev: torch.device) -> dict[str, Any]:
    """The producer step (next_n 1) on the default workspace and on a caller's, eager (kept) and as graph replays,
    taking turns each round: per form the median µs over the rounds and the ratio default / caller."""
    args = producer_args(shapes, 1, torch.Generator().manual_seed(2), dev)
    given = torch.empty(indexcache.workspace_bytes("paged_topk_translate", **args, backend=backend),
                        dtype=torch.uint8, device=dev)
    step: dict[str, Callable[[], Any]] = {
        "default": lambda: indexcache.paged_topk_translate(**args, backend=backend),
        "caller": lambda: indexcache.paged_topk_translate(**args, workspace=given, backend=backend),
    }
    forms: dict[str, dict[str, Callable[[], Any]]] = {"eager": step}
    if on_gpu(dev):
        forms["graph"] = {name: capture_graph(fn, dev).replay for name, fn in step.items()}
    # On a GPU bursts of 20 back-to-back calls (an eager call's host cost shows); interpreted, one call.
    calls, reps = (20, (5, 50)) if on_gpu(dev) else (1, (1, 1))
    samples: dict[str, dict[str, list[float]]] = {form: {name: [] for name in step} for form in forms}
    for _ in range(rounds):
        for form, fns in forms.items():
            for name, fn in fns.items():
                ms = median_ms(fn, dev, budget_s=0.05, min_reps=reps[0], max_reps=reps[1], warmup=2, calls=calls)
                samples[form][name].append(1e3 * ms)
    result: dict[str, Any] = {"case": f"{shapes.batch}x{shapes.context} next_n 1 k{shapes.k}", "rounds": rounds,
                              "workspace_bytes": given.numel(), "target_ratio": RATIO_TARGET,
                              "clock": "CUDA events" if on_gpu(dev) else "host clock, interpreted on the CPU: not a "
                                                                          "GPU timing"}
    for form, by_name in samples.items():
        us = {name: statistics.median(v) for name, v in by_name.items()}
        ratio = us["default"] / us["caller"]
        result[form] = {"default_us": us["default"], "caller_us": us["caller"], "ratio": ratio,
                        "met": ratio <= RATIO_TARGET}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    parser.add_argument("--iters", type=int, default=1000, help="race iterations a lane (default 1000; a few under "
                                                                "compute-sanitizer)")
    parser.add_argument("--rounds", type=int, default=15, help="timing rounds, the two workspaces taking turns")
    parser.add_argument("--no-timing", action="store_true", help="the race only (e.g. under compute-sanitizer)")
    parser.add_argument("--backend", default="cuda", help="the backend raced and timed (default cuda)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, on the CPU with TRITON_INTERPRET=1 (the lanes are threads): checks the "
                             "script itself")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU visible: this script measures a GPU (pass --smoke with TRITON_INTERPRET=1 to check it on the "
              "CPU; the interpreted checks are tests/kernels/test_triton_workspace.py)")
        return 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SMOKE if args.smoke else FULL
    dispatch.reset()
    v = versions()
    report: dict[str, Any] = {
        "schema": "indexcache-streams-race/1", "date": now(), "device": device_name(dev) or "cpu",
        "commit": checkout_commit(), "torch": v["torch"], "triton": v["triton"], "backend": args.backend,
        "smoke": args.smoke, "shapes": shapes.__dict__, "errors": [],
    }
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("race", lambda: race_section(shapes, args.iters, args.backend, dev))]
    if not args.no_timing:
        sections.append(("timing", lambda: timing_section(shapes, args.rounds, args.backend, dev)))
    run_sections(report, sections, args.out, after=torch.cuda.empty_cache if on_gpu(dev) else None)
    print_rows(f"race: elements differing from the one-stream results over {args.iters} iterations",
               report.get("race", []), ["lane", "call", "differing", "ok"])
    if timing := report.get("timing"):
        rows = [{"form": form, **timing[form]} for form in ("eager", "graph") if form in timing]
        print_rows(f"timing: {timing['case']}, µs (medians of {timing['rounds']} rounds; {timing['clock']}), "
                   f"target ratio <= {RATIO_TARGET}", rows, ["form", "default_us", "caller_us", "ratio", "met"])
    print(f"\nwrote {args.out} ({report['seconds']} s)")
    failed = report["errors"] or "race" not in report or not all(row["ok"] for row in report["race"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
