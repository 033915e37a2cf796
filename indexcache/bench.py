"""``indexcache bench``: the machine's ceilings and every op per backend, measured in one run.

The ceilings come first: device-to-device copy bandwidth (a large copy, bytes read plus written)
and the time of an empty Triton kernel launch. Then each case of each op runs on each backend:
checked against the torch backend on fresh inputs, then timed as the median of many calls after
warm-up (CUDA events on a GPU, the host clock elsewhere), rotating through enough input sets to
exceed four times the L2 cache. On a GPU each case is also timed as replays of one CUDA graph
holding one call per input set (the device time without the host's launch cost).

An op plugs in as data: a :class:`BenchOp` in :data:`OPS` (cases, an input builder, the bytes and
FLOPs a call must move and do, the call itself). Derived numbers (fraction of a ceiling, ratio to
the empty launch, speed-up over torch) only compare measurements of one mode: a CPU or
interpreted-Triton time is never set against a GPU one, nor reported as a speed.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import indexcache
from indexcache import dispatch, ops

SCHEMA = "indexcache-bench/1"
BASELINE = "torch"
POISON = -2  # never a valid translate output: shows slots a backend left unwritten
MIN_SETS, MAX_SETS = 2, 256
COMMIT_ENV = "INDEXCACHE_COMMIT"  # the commit to record where the checkout has no .git (e.g. a copied tree)


# ----------------------------------------------------------------------------------------------- ops as data


@dataclass(frozen=True)
class Case:
    """One shape of an op: its name in the table, the parameters the builder reads, and a note."""

    name: str
    params: Mapping[str, Any]
    note: str = ""


def _equal(a: Any, b: Any) -> bool:
    return torch.equal(a.cpu(), b.cpu())


def _no_flops(case: Case) -> int:
    return 0


@dataclass(frozen=True)
class BenchOp:
    """An op as the harness sees it.

    ``cases(quick)`` gives the shapes; ``build(case, gen)`` one input set on the CPU (from the CPU
    generator ``gen``, so every device gets the same values), output buffers included and filled
    with a poison value; ``call(args, backend)`` runs it and returns the result; ``bytes`` and
    ``flops`` count the least memory traffic and arithmetic of one call; ``roofline`` names the
    :data:`CEILINGS` entry the achieved rate is a fraction of; ``same(result, baseline)`` says whether a
    backend agrees with the torch backend.
    """

    name: str
    cases: Callable[[bool], Sequence[Case]]
    build: Callable[[Case, torch.Generator], dict[str, Any]]
    call: Callable[[Mapping[str, Any], str], Any]
    bytes: Callable[[Case], int]
    flops: Callable[[Case], int] = _no_flops
    roofline: str = "copy_bandwidth"
    same: Callable[[Any, Any], bool] = _equal


def _translate_cases(quick: bool) -> list[Case]:
    r2b = "row_to_batch maps each query row to its request's table row (the table is not copied per row)"
    per_row = "one table row per query row (row_to_batch=None)"
    if quick:
        return [
            Case("prefill 2x8 rows k64 page4", dict(requests=2, rows_per_request=8, k=64, page_size=4, context=512),
                 r2b),
            Case("decode 4 rows k48 page3", dict(requests=4, rows_per_request=1, k=48, page_size=3, context=300),
                 per_row),
            Case("token table 4 rows k64 page1", dict(requests=4, rows_per_request=1, k=64, page_size=1,
                                                      context=1024), per_row),
        ]
    ctx = 128 * 1024
    return [
        Case("prefill 8x1024 rows k2048 page64 128K", dict(requests=8, rows_per_request=1024, k=2048, page_size=64,
                                                          context=ctx), r2b),
        Case("decode 64 rows k2048 page64 128K", dict(requests=64, rows_per_request=1, k=2048, page_size=64,
                                                     context=ctx), per_row),
        Case("decode 64 rows k512 page64 128K", dict(requests=64, rows_per_request=1, k=512, page_size=64,
                                                    context=ctx), per_row),
        Case("token table 64 rows k2048 page1 128K", dict(requests=64, rows_per_request=1, k=2048, page_size=1,
                                                         context=ctx), per_row),
    ]


def _translate_build(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """Requests whose pages are a random permutation of one pool; query rows are the last
    ``rows_per_request`` tokens of each request (causal), so every raw index is visible and valid."""
    p = case.params
    requests, per_request, k, page_size, context = (p[n] for n in ("requests", "rows_per_request", "k", "page_size",
                                                                   "context"))
    rows, pages = requests * per_request, -(-context // page_size)
    table = torch.randperm(requests * pages, generator=gen, dtype=torch.int32).view(requests, pages)
    first_len = context - per_request + 1
    seq_lens = (first_len + torch.arange(per_request, dtype=torch.int32)).repeat(requests)
    raw = torch.randint(0, first_len, (rows, k), generator=gen, dtype=torch.int32)
    row_to_batch = torch.arange(rows, dtype=torch.int32) // per_request if per_request > 1 else None
    out = torch.full((rows, k), POISON, dtype=torch.int32)
    return dict(raw=raw, page_table=table, seq_lens=seq_lens, page_size=page_size, row_to_batch=row_to_batch,
                out=out)


def _translate_call(a: Mapping[str, Any], backend: str) -> torch.Tensor:
    return ops.translate(a["raw"], a["page_table"], a["seq_lens"], a["page_size"], row_to_batch=a["row_to_batch"],
                         out=a["out"], backend=backend)


def _translate_bytes(case: Case) -> int:
    """12 bytes an index: the raw index read, its table entry read, the result written."""
    p = case.params
    return 12 * p["requests"] * p["rows_per_request"] * p["k"]


TRANSLATE = BenchOp("translate", _translate_cases, _translate_build, _translate_call, _translate_bytes)

OPS: dict[str, BenchOp] = {op.name: op for op in (TRANSLATE,)}


# ----------------------------------------------------------------------------------------------- timing


def _gpu(device: torch.device) -> bool:
    return device.type == "cuda"


class Timer:
    """Median time of one call, in µs: CUDA events on a GPU, the host clock on the CPU.

    ``fn(i)`` runs the call on input set ``i``; the timer passes 0, 1, 2, … and ``fn`` rotates.
    """

    def __init__(self, device: torch.device, warmup: int, reps: int, graph_reps: int):
        self.device, self.warmup, self.reps, self.graph_reps = device, warmup, reps, graph_reps

    def eager_us(self, fn: Callable[[int], Any]) -> float:
        """Each call timed on its own, after ``warmup`` untimed calls."""
        for i in range(self.warmup):
            fn(i)
        if not _gpu(self.device):
            times = []
            for i in range(self.reps):
                t0 = time.perf_counter()
                fn(self.warmup + i)
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        torch.cuda.synchronize(self.device)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.reps)]
        for i, (start, end) in enumerate(marks):
            start.record()
            fn(self.warmup + i)
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in marks) * 1e3

    def graph_us(self, fn: Callable[[int], Any], calls: int) -> float:
        """One CUDA graph holding ``calls`` calls (``fn(0) .. fn(calls-1)``), replayed; per call."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for i in range(calls):
                fn(i)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        for _ in range(max(1, self.warmup // 4)):
            graph.replay()
        torch.cuda.synchronize(self.device)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(self.graph_reps)]
        for start, end in marks:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in marks) * 1e3 / calls


# ----------------------------------------------------------------------------------------------- ceilings


@dataclass(frozen=True)
class Ceiling:
    """A rate ceiling: ``measure(timer, quick) -> (rate per second, details)``; ``counts`` says whether
    an op's bytes or FLOPs are set against it; ``unit``/``scale`` are for display."""

    name: str
    counts: str
    unit: str
    scale: float
    measure: Callable[[Timer, bool], tuple[float, dict[str, Any]]]


def _copy_bandwidth(timer: Timer, quick: bool) -> tuple[float, dict[str, Any]]:
    """Bytes read plus written per second by one large ``copy_`` of random int32 data."""
    size = (64 if quick else 1024) * 2**20 if _gpu(timer.device) else (8 if quick else 64) * 2**20
    src = torch.randint(-(2**31), 2**31 - 1, (size // 4,), dtype=torch.int32, device=timer.device)
    dst = torch.empty_like(src)
    us = timer.eager_us(lambda i: dst.copy_(src))
    return 2 * size / (us * 1e-6), {"bytes_moved": 2 * size, "time_us": us}


CEILINGS: dict[str, Ceiling] = {
    "copy_bandwidth": Ceiling("copy_bandwidth", "bytes", "GB/s", 1e9, _copy_bandwidth),
}


@functools.cache
def _empty_kernel():
    import triton

    @triton.jit
    def empty(x_ptr):
        pass

    return empty


def _launch(device: torch.device, timer: Timer, graph_ok: bool) -> dict[str, Any]:
    """An empty Triton kernel launch: eager (host issue + device) and, on a GPU, inside a graph."""
    from indexcache.backends.triton.target import interpreting

    found: dict[str, Any] = {"mode": None, "reason": "", "eager_us": None, "graph_us": None, "graph_error": None}
    try:
        import triton  # noqa: F401
    except ImportError:
        return {**found, "reason": "Triton is not installed"}
    if interpreting():
        mode, where = "interpreted", torch.device("cpu")
    elif _gpu(device):
        mode, where = "GPU", device
    else:
        return {**found, "reason": "no GPU: compiled Triton cannot launch (TRITON_INTERPRET=1 interprets it)"}
    kernel = _empty_kernel()
    buf = torch.zeros(1, dtype=torch.int32, device=where)

    def launch(i: int) -> None:
        kernel[(1,)](buf)

    t = timer if where == timer.device else Timer(where, timer.warmup, timer.reps, timer.graph_reps)
    found.update(mode=mode, eager_us=t.eager_us(launch))
    if graph_ok and mode == "GPU":
        try:
            found["graph_us"] = t.graph_us(launch, 100)
        except Exception as exc:  # reported with the ceiling; the ops still run
            found["graph_error"] = f"{type(exc).__name__}: {exc}"
    return found


# ----------------------------------------------------------------------------------------------- running


def _backends(op: BenchOp, requested: Sequence[str] | None) -> list[str]:
    """The backends to run, the torch baseline first (it always runs: speed-ups are over it)."""
    if requested:
        names = list(requested)
    else:
        names = [n for n in dispatch.available_backends() if op.name in dispatch.ops_of(n)]
    return [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]


def _to(args: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _nbytes(args: Mapping[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in args.values() if isinstance(v, torch.Tensor))


def _input_sets(op: BenchOp, case: Case, device: torch.device, rotate_bytes: int) -> list[dict[str, Any]]:
    """Enough input sets (built from seeds 1, 2, …) that one pass over them exceeds ``rotate_bytes``."""
    sets = [_to(op.build(case, torch.Generator().manual_seed(1)), device)]
    count = min(MAX_SETS, max(MIN_SETS, math.ceil(rotate_bytes / max(1, _nbytes(sets[0])))))
    sets += [_to(op.build(case, torch.Generator().manual_seed(s)), device) for s in range(2, count + 1)]
    return sets


def _same_mode(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return a is not None and b is not None and a.get("mode") is not None and a["mode"] == b["mode"]


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


DERIVED = ("device_us", "device_timing", "rate", "rate_unit", "ceiling_fraction", "launch_ratio", "launch_ratio_graph",
           "speedup_vs_torch")  # set by _derive for every timed row; None in the others


def _run_case(op: BenchOp, case: Case, backend: str, timer_for: Callable[[torch.device], Timer], baseline: Any,
              sets_cache: dict[str, list]) -> tuple[dict[str, Any], Any]:
    """Check then time one backend on one case; returns the result row and the checked output."""
    avail = dispatch.availability(backend)
    row: dict[str, Any] = {"op": op.name, "case": case.name, "params": dict(case.params), "note": case.note,
                           "backend": backend, "mode": avail.mode if avail.available else None,
                           "device": avail.device, "bytes": op.bytes(case), "flops": op.flops(case),
                           "eager_us": None, "graph_us": None, "graph_error": None, "sets": None,
                           **dict.fromkeys(DERIVED)}
    if not avail.available:
        return {**row, "check": f"skipped: {avail.reason}"}, None
    device = torch.device(avail.device)
    try:
        result = op.call(_to(op.build(case, torch.Generator().manual_seed(0)), device), backend)
        if baseline is None:
            row["check"] = "ok" if backend == BASELINE else "no baseline"
        else:
            row["check"] = "ok" if op.same(result, baseline) else "MISMATCH"
        sets = sets_cache.get(avail.device)
        if sets is None:
            rotate = 4 * _l2_bytes(device) if _gpu(device) else 0
            sets = sets_cache[avail.device] = _input_sets(op, case, device, rotate)
        row["sets"] = len(sets)
        row["eager_us"] = timer_for(device).eager_us(lambda i: op.call(sets[i % len(sets)], backend))
    except dispatch.BackendNotSupportedError as exc:
        return {**row, "check": f"unsupported: {exc}"}, None
    except Exception as exc:  # one failing backend must not hide the others' numbers
        return {**row, "check": f"error: {type(exc).__name__}: {exc}", "eager_us": None}, None
    if _gpu(device):
        try:
            row["graph_us"] = timer_for(device).graph_us(lambda i: op.call(sets[i], backend), len(sets))
        except Exception as exc:  # a capture failure is a finding to report, not a crash
            row["graph_error"] = f"{type(exc).__name__}: {exc}"
    return row, result


def _derive(row: dict[str, Any], ceiling: dict[str, Any], launch: dict[str, Any], base: dict[str, Any] | None,
            spec: Ceiling) -> None:
    """Rate, fraction of the ceiling, ratio to the empty launch and speed-up over torch (same mode only)."""
    graph = row["graph_us"] is not None
    row["device_us"] = row["graph_us"] if graph else row["eager_us"]
    row["device_timing"] = "graph" if graph else "eager"
    work = row[spec.counts]
    row["rate"] = None if not row["device_us"] else work / (row["device_us"] * 1e-6) / spec.scale
    row["rate_unit"] = spec.unit
    row["ceiling_fraction"] = _ratio(row["rate"], ceiling["rate"] / spec.scale) if _same_mode(row, ceiling) else None
    same_launch = _same_mode(row, launch)
    row["launch_ratio"] = _ratio(row["eager_us"], launch.get("eager_us")) if same_launch else None
    row["launch_ratio_graph"] = _ratio(row["graph_us"], launch.get("graph_us")) if same_launch else None
    comparable = _same_mode(row, base) and base["device_timing"] == row["device_timing"]
    row["speedup_vs_torch"] = _ratio(base["device_us"], row["device_us"]) if comparable else None


def _l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20


def checkout_commit() -> str | None:
    """The git commit of this checkout, else ``$INDEXCACHE_COMMIT`` (a copied tree without .git), else None."""
    return _git()[0]


def _git() -> tuple[str | None, bool | None]:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10)
            return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get(COMMIT_ENV) or None, None


def _versions() -> dict[str, str | None]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"indexcache": indexcache.__version__, "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "python": platform.python_version()}


def run(op_names: Sequence[str] | None = None, backends: Sequence[str] | None = None,
        quick: bool = False) -> dict[str, Any]:
    """Measure the ceilings, then every case of every op on every backend; returns the report (JSON-ready)."""
    names = list(op_names) if op_names else list(OPS)
    unknown = [n for n in names if n not in OPS]
    if unknown:
        raise ValueError(f"--op: expected one of {sorted(OPS)}, got {', '.join(map(repr, unknown))}")
    for backend in backends or ():
        dispatch.get(backend)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    warmup, reps, graph_reps = ((2, 5, 3) if quick else (10, 100, 20)) if gpu else ((1, 3, 0) if quick else (1, 5, 0))
    timers: dict[torch.device, Timer] = {}

    def timer_for(dev: torch.device) -> Timer:
        return timers.setdefault(dev, Timer(dev, warmup, reps, graph_reps))

    base_mode = "GPU" if gpu else "CPU"
    ceilings: dict[str, Any] = {}
    for spec in {OPS[n].roofline: CEILINGS[OPS[n].roofline] for n in names}.values():
        rate, details = spec.measure(timer_for(device), quick)
        ceilings[spec.name] = {"rate": rate, "counts": spec.counts, "unit": spec.unit, "scale": spec.scale,
                               "mode": base_mode, **details}
    ceilings["launch"] = _launch(device, timer_for(device), graph_ok=gpu)
    results = []
    for name in names:
        op = OPS[name]
        spec = CEILINGS[op.roofline]
        for case in op.cases(quick):
            baseline, base_row, sets_cache = None, None, {}
            for backend in _backends(op, backends):
                row, result = _run_case(op, case, backend, timer_for, baseline, sets_cache)
                if backend == BASELINE and row["check"] == "ok":
                    baseline, base_row = result, row
                if row["eager_us"] is not None:
                    _derive(row, ceilings[spec.name], ceilings["launch"], base_row, spec)
                results.append(row)
            del sets_cache
            if gpu:
                torch.cuda.empty_cache()
    commit, dirty = _git()
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device) if gpu else None,
        "gpu_run": gpu,
        "notice": None if gpu else "not a GPU run: CPU and interpreted-Triton times, not speed measurements",
        "versions": _versions(),
        "commit": commit,
        "dirty": dirty,
        "settings": {"quick": quick, "warmup": warmup, "reps": reps, "graph_reps": graph_reps,
                     "rotate_bytes": 4 * _l2_bytes(device) if gpu else 0, "statistic": "median"},
        "ceilings": ceilings,
        "results": results,
    }


def failed(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Result rows whose backend disagreed with the torch baseline or could not be checked against it."""
    return [r for r in report["results"] if r["check"] in ("MISMATCH", "no baseline") or r["check"].startswith("error")]


# ----------------------------------------------------------------------------------------------- output

# (header, result key, format): what the table shows, per op; the JSON rows carry every key. Headers name
# the op's roofline ceiling and its unit.
COLUMNS = (
    ("case", "case", "{}"),
    ("backend", "backend", "{}"),
    ("mode", "mode", "{}"),
    ("eager µs", "eager_us", "{:.1f}"),
    ("graph µs", "graph_us", "{:.1f}"),
    ("{unit}", "rate", "{:.1f}"),
    ("% {ceiling}", "ceiling_fraction", "{:.0%}"),
    ("× launch", "launch_ratio", "{:.2f}"),
    ("× launch (graph)", "launch_ratio_graph", "{:.2f}"),
    ("× torch", "speedup_vs_torch", "{:.2f}"),
    ("check", "check", "{}"),
)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} µs"


def format_table(report: Mapping[str, Any]) -> str:
    """The report as text: a header (machine, versions, ceilings) and one table per op."""
    v = report["versions"]
    commit = (report["commit"] or "unknown")[:12] + (" (dirty)" if report["dirty"] else "")
    lines = [f"indexcache bench  {report['date']}  {report['gpu'] or platform.processor() or 'CPU'}  "
             f"torch {v['torch']}  triton {v['triton']}  commit {commit}"]
    if report["notice"]:
        lines.append(f"NOTE: {report['notice']}")
    for name, c in report["ceilings"].items():
        if name == "launch":
            if c["mode"] is None:
                lines.append(f"ceiling empty Triton launch: not measured ({c['reason']})")
            else:
                graph = f"graph capture failed: {c['graph_error']}" if c["graph_error"] else _us(c["graph_us"])
                lines.append(f"ceiling empty Triton launch ({c['mode']}): {_us(c['eager_us'])} eager, "
                             f"{graph} in a graph")
        else:
            lines.append(f"ceiling {name} ({c['mode']}): {c['rate'] / c['scale']:.0f} {c['unit']}")
    by_op: dict[str, list] = {}
    for row in report["results"]:
        by_op.setdefault(row["op"], []).append(row)
    for name, rows in by_op.items():
        spec = CEILINGS[OPS[name].roofline]
        headers = [h.format(unit=spec.unit, ceiling=spec.name) for h, _, _ in COLUMNS]
        cells = [[_cell(row.get(key), fmt) for _, key, fmt in COLUMNS] for row in rows]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        lines += ["", f"op {name}: rate from graph time where measured, else eager"]
        lines.append("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)).rstrip() for cell in cells]
        notes = dict.fromkeys(f"{r['case']}: {r['note']}" for r in rows if r["note"])
        errors = [f"{r['case']} / {r['backend']}: graph capture failed: {r['graph_error']}" for r in rows
                  if r["graph_error"]]
        lines += [f"  {n}" for n in [*notes, *errors]]
    return "\n".join(lines)


def write_json(report: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write the report as JSON (parent folders created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2) + "\n")
