"""``indexcache bench``: the machine's ceilings and every op per backend, measured in one run.

The ceilings come first, only those the requested ops need (:mod:`indexcache.bench.ceilings`); top-k's
roofline is per case (one read of its scores). Then each case of each op (:data:`OPS`: the ``bench`` field of
the ops' spec records, :mod:`indexcache.hal.specs`) runs
on each backend: checked against the torch backend on fresh inputs, then timed (:class:`Timer`) as the
median of many calls after warm-up (CUDA events on a GPU, the host clock elsewhere), rotating through
enough input sets to exceed four times the GPU's caches (the L2; on AMD also the Infinity Cache). On a GPU each case
is also timed as replays of one CUDA graph holding one call per input set (the device time without the host's launch
cost).

Derived numbers (fraction of a ceiling, ratio to the empty launch, speed-up over torch) only compare
measurements of one mode: a CPU or interpreted-Triton time is never set against a GPU one, nor reported as
a speed. The orchestration knows an op only by its :class:`~indexcache.hal.specs.bench.BenchSpec` fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from indexcache.bench.ceilings import CEILINGS, Ceiling, empty_launch
from indexcache.bench.output import SCHEMA
from indexcache.bench.provenance import device_name, git_state, now, versions
from indexcache.bench.timing import Timer, cache_bytes, on_gpu
from indexcache.hal import dispatch
from indexcache.hal.specs import SPECS
from indexcache.hal.specs.bench import BASELINE, BenchCase, BenchSpec

# The ops benchmarked, by name, in catalogue order.
OPS: dict[str, BenchSpec] = {name: spec.bench for name, spec in SPECS.items() if spec.bench}

MIN_SETS, MAX_SETS = 2, 256  # input sets a case rotates through


def _backends(op: BenchSpec, requested: Sequence[str] | None) -> list[str]:
    """The backends to run, the torch baseline first (it always runs: speed-ups are over it)."""
    if requested:
        names = list(requested)
    else:
        names = [n for n in dispatch.available_backends() if op.name in dispatch.ops_of(n)]
    return [BASELINE] + [n for n in dict.fromkeys(names) if n != BASELINE]


def _to(args: Mapping[str, Any], device: torch.device, copy: bool = False) -> dict[str, Any]:
    return {k: v.to(device, copy=copy) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _nbytes(args: Mapping[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in args.values() if isinstance(v, torch.Tensor))


def _input_sets(op: BenchSpec, case: BenchCase, device: torch.device, rotate_bytes: int,
                first: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Enough input sets that one pass over them exceeds ``rotate_bytes``: a copy of ``first`` (the seed-0
    set), then sets built from seeds 2, 3, …; at least MIN_SETS, so an input set larger than the rotation
    (the logits cases) is built only once more."""
    sets = [_to(first, device, copy=True)]
    count = min(MAX_SETS, max(MIN_SETS, math.ceil(rotate_bytes / max(1, _nbytes(sets[0])))))
    sets += [_to(op.build(case, torch.Generator().manual_seed(s)), device) for s in range(2, count + 1)]
    return sets


def _same_mode(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    return a is not None and b is not None and a.get("mode") is not None and a["mode"] == b["mode"]


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


DERIVED = ("device_us", "device_timing", "rate", "rate_unit", "floor_us", "ceiling_fraction", "launch_ratio",
           "launch_ratio_graph", "speedup_vs_torch", "speedup_vs_extra")  # set by _derive for timed rows


def _verdict(op: BenchSpec, result: Any, baseline: Any, case: BenchCase) -> str:
    """"ok", or "MISMATCH" with what differs where ``same`` says."""
    found = op.same(result, baseline, case)
    if found is True or found == "":
        return "ok"
    return f"MISMATCH: {found}" if isinstance(found, str) else "MISMATCH"


def _new_row(op: BenchSpec, case: BenchCase, backend: str, mode: str | None, device: str,
             extra: bool) -> dict[str, Any]:
    return {"op": op.name, "case": case.name, "params": dict(case.params), "note": case.note, "backend": backend,
            "extra": extra, "mode": mode, "device": device, "roofline": op.roofline_of(case), "bytes": op.bytes(case),
            "flops": op.flops(case), "eager_us": None, "graph_us": None, "graph_error": None, "sets": None,
            **dict.fromkeys(DERIVED)}


def _time_row(row: dict[str, Any], fn: Callable[[Mapping[str, Any]], Any], sets: list, timer: Timer) -> None:
    """Eager time on rotating input sets; on a GPU also the graph time (a capture failure is recorded)."""
    row["sets"] = len(sets)
    row["eager_us"] = timer.eager_us(lambda i: fn(sets[i % len(sets)]))
    if on_gpu(timer.device):
        try:
            row["graph_us"] = timer.graph_us(lambda i: fn(sets[i]), len(sets))
        except Exception as exc:  # a capture failure is a finding to report, not a crash
            row["graph_error"] = f"{type(exc).__name__}: {exc}"


def _run_case(op: BenchSpec, case: BenchCase, backend: str, timer_for: Callable[[torch.device], Timer], baseline: Any,
              sets_cache: dict[str, list], fresh: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """Check then time one backend on one case; returns the result row and the checked output.

    ``fresh`` is the seed-0 input set on the CPU, copied to the backend's device for its check."""
    avail = dispatch.availability(backend)
    row = _new_row(op, case, backend, avail.mode if avail.available else None, avail.device, False)
    if not avail.available:
        return {**row, "check": f"skipped: {avail.reason}"}, None
    device = torch.device(avail.device)
    try:
        result = op.call(_to(fresh, device, copy=True), backend)
        if baseline is None:
            row["check"] = "ok" if backend == BASELINE else "no baseline"
        else:
            row["check"] = _verdict(op, result, baseline, case)
        sets = sets_cache.get(avail.device)
        if sets is None:
            rotate = 4 * cache_bytes(device) if on_gpu(device) else 0
            sets = sets_cache[avail.device] = _input_sets(op, case, device, rotate, fresh)
        _time_row(row, lambda a: op.call(a, backend), sets, timer_for(device))
    except dispatch.BackendNotSupportedError as exc:
        return {**row, "check": f"unsupported: {exc}"}, None
    except Exception as exc:  # one failing backend must not hide the others' numbers
        return {**row, "check": f"error: {type(exc).__name__}: {exc}", "eager_us": None, "graph_us": None}, None
    return row, result


def _run_extra(op: BenchSpec, case: BenchCase, label: str, fn: Callable, base_row: dict[str, Any] | None, baseline: Any,
               timer_for: Callable[[torch.device], Timer], sets_cache: dict[str, list],
               fresh: Mapping[str, Any]) -> dict[str, Any]:
    """An extra row (e.g. torch.topk) on the torch backend's device and input sets, checked like a backend."""
    if base_row is None or base_row["eager_us"] is None:
        return {**_new_row(op, case, label, None, "", True), "check": "skipped: the torch backend did not run"}
    row = _new_row(op, case, label, base_row["mode"], base_row["device"], True)
    device = torch.device(base_row["device"])
    try:
        result = fn(_to(fresh, device, copy=True))
        row["check"] = "no baseline" if baseline is None else _verdict(op, result, baseline, case)
        _time_row(row, fn, sets_cache[base_row["device"]], timer_for(device))
    except Exception as exc:
        return {**row, "check": f"error: {type(exc).__name__}: {exc}", "eager_us": None, "graph_us": None}
    return row


def _floors(op: BenchSpec, sets_cache: dict[str, list], timer_for: Callable[[torch.device], Timer]) -> dict[str, Any]:
    """Per device the op's per-case roofline: ``floor`` timed on the same input sets (graph on a GPU)."""
    found: dict[str, Any] = {}
    if op.floor is None:
        return found
    for where, sets in sets_cache.items():
        device = torch.device(where)
        row: dict[str, Any] = {"eager_us": None, "graph_us": None, "graph_error": None}
        try:
            _time_row(row, op.floor, sets, timer_for(device))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        graph = row["graph_us"] is not None
        found[where] = {"mode": "GPU" if on_gpu(device) else "CPU", "us": row["graph_us"] if graph else row["eager_us"],
                        "timing": "graph" if graph else "eager", **row}
    return found


def _derive(row: dict[str, Any], ceiling: dict[str, Any] | None, floor: dict[str, Any] | None,
            launch: dict[str, Any], base: dict[str, Any] | None, extra: dict[str, Any] | None, spec: Ceiling) -> None:
    """Rate, the floor (the least time at the roofline) and the fraction of it, the ratio to the empty launch,
    speed-ups over torch and over the first extra row: only between measurements of one mode."""
    graph = row["graph_us"] is not None
    row["device_us"] = row["graph_us"] if graph else row["eager_us"]
    row["device_timing"] = "graph" if graph else "eager"
    work = row[spec.counts]
    row["rate"] = None if not row["device_us"] else work / (row["device_us"] * 1e-6) / spec.scale
    row["rate_unit"] = spec.unit
    if ceiling is not None and ceiling.get("rate") and _same_mode(row, ceiling):
        row["floor_us"] = work / ceiling["rate"] * 1e6
    elif floor is not None and floor["us"] and _same_mode(row, floor) and floor["timing"] == row["device_timing"]:
        row["floor_us"] = floor["us"]
    row["ceiling_fraction"] = _ratio(row["floor_us"], row["device_us"])
    same_launch = _same_mode(row, launch)
    row["launch_ratio"] = _ratio(row["eager_us"], launch.get("eager_us")) if same_launch else None
    row["launch_ratio_graph"] = _ratio(row["graph_us"], launch.get("graph_us")) if same_launch else None
    for key, other in (("speedup_vs_torch", base), ("speedup_vs_extra", extra)):
        comparable = _same_mode(row, other) and other.get("device_timing") == row["device_timing"]
        row[key] = _ratio(other["device_us"], row["device_us"]) if comparable else None


def needed_ceilings(names: Sequence[str], quick: bool = False) -> list[str]:
    """The ceilings the ops ``names`` are set against (each case's roofline) or ask for: only these are measured."""
    found = [OPS[n].roofline_of(c) for n in names for c in OPS[n].cases(quick)]
    return list(dict.fromkeys(found + [c for n in names for c in OPS[n].ceilings]))


def _run_op_case(op: BenchSpec, case: BenchCase, backends: Sequence[str] | None,
                 timer_for: Callable[[torch.device], Timer], ceilings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every backend, then the extra rows, on one case; the per-case floor; derived numbers. The rows."""
    spec = CEILINGS[op.roofline_of(case)]
    fresh = op.build(case, torch.Generator().manual_seed(0))
    baseline, base_row, sets_cache, rows = None, None, {}, []
    for backend in _backends(op, backends):
        row, result = _run_case(op, case, backend, timer_for, baseline, sets_cache, fresh)
        if backend == BASELINE and row["check"] == "ok":
            baseline, base_row = result, row
        rows.append(row)
    extras = [_run_extra(op, case, label, fn, base_row, baseline, timer_for, sets_cache, fresh)
              for label, fn in op.extras.items()]
    floors = _floors(op, sets_cache, timer_for)
    del sets_cache, baseline
    first_extra = extras[0] if extras else None
    # The baseline and the extras first (the others compare to them), the baseline again (now an extra exists).
    for row in [*rows[:1], *extras, *rows[1:], *rows[:1]]:
        if row["eager_us"] is not None:
            _derive(row, ceilings.get(spec.name), floors.get(row["device"]), ceilings["launch"],
                    base_row, first_extra, spec)
    return rows[:1] + extras + rows[1:]


def run(op_names: Sequence[str] | None = None, backends: Sequence[str] | None = None,
        quick: bool = False) -> dict[str, Any]:
    """Measure the ceilings, then every case of every op on every backend; returns the report (JSON-ready). An op
    or backend named twice runs once."""
    names = list(dict.fromkeys(op_names)) if op_names else list(OPS)
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
    for spec in (CEILINGS[c] for c in needed_ceilings(names, quick)):
        entry = {"rate": None, "counts": spec.counts, "unit": spec.unit, "scale": spec.scale, "mode": None}
        if spec.measure is None:
            ceilings[spec.name] = {**entry, "per_case": True, "description": spec.description}
            continue
        try:
            rate, details = spec.measure(timer_for(device), quick)
            ceilings[spec.name] = {**entry, "rate": rate, "mode": base_mode, **details}
        except Exception as exc:  # e.g. no fp8 matmul here: the rows still run, without that fraction
            ceilings[spec.name] = {**entry, "error": f"{type(exc).__name__}: {exc}"}
    ceilings["launch"] = empty_launch(device, timer_for(device), graph_ok=gpu)
    results = []
    for name in names:
        op = OPS[name]
        for case in op.cases(quick):
            results += _run_op_case(op, case, backends, timer_for, ceilings)
            if gpu:
                torch.cuda.empty_cache()
    commit, dirty = git_state()
    return {
        "schema": SCHEMA,
        "date": now(),
        "gpu": device_name(device),
        "gpu_run": gpu,
        "notice": None if gpu else "not a GPU run: CPU and interpreted-Triton times, not speed measurements",
        "versions": versions(),
        "commit": commit,
        "dirty": dirty,
        "settings": {"quick": quick, "warmup": warmup, "reps": reps, "graph_reps": graph_reps,
                     "rotate_bytes": 4 * cache_bytes(device) if gpu else 0, "statistic": "median"},
        "ceilings": ceilings,
        "results": results,
    }


def failed(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Result rows whose backend disagreed with the torch baseline or could not be checked against it."""
    return [r for r in report["results"]
            if r["check"] == "no baseline" or r["check"].startswith(("MISMATCH", "error"))]

