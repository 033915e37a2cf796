"""Top-k and the fused producer step (top-k + page translation) on one GPU: correctness, graph replays, speed.

    pip install -e . && python bench/topk_gpu.py --out out/topk.json

In one run: (a) checks on the GPU — the Triton backend's ``topk`` / ``topk_translate`` against the torch
backend (same contract, same tie rule: each row's index set must be equal) on the target shapes, against
the float64 reference on a few rows of each, and on adversarial rows (ties, -inf, NaN, short and negative
lengths, row_starts, bf16, strided scores, tie bins larger than the stash), and ``sorted=True`` slot by slot
against the torch backend's and the reference's order; (b) a CUDA graph of two
``topk_translate`` calls (the split-row and the one-program-a-row paths) with preallocated out/out_raw,
replayed 1000 times while scores and lengths change, each replay equal to eager, and no allocation by an
eager call with preallocated outputs; (c) timings — CUDA-graph replays, median, inputs rotated through more
than twice the caches (``indexcache.bench.timing.cache_bytes``) — of our topk, topk with sorted=True and
topk_translate, torch.topk, the torch backend (eager) and one read of the scores (a sum), on 64 × 128K (k 2048
and 512), 1 × 128K, 1 × 1M and 2048 × 32K fp32, with the issue's targets; (d) each kernel launch of a call
timed (the launches up to it less those before it), and a small sweep of tuning configurations. Prints tables,
writes JSON to ``--out``, exits 1 when a check fails. Uses no Triton API (Triton 3.6 and later); about three
minutes on an H200 (the sweep: per configuration, the call and each launch).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import indexcache
from indexcache.bench.output import print_rows, run_sections
from indexcache.bench.provenance import checkout_commit, device_name, now, versions
from indexcache.bench.timing import cache_bytes, capture_graph, median_ms
from indexcache.hal import dispatch, reference

CUDA = torch.device("cuda")
PAGE = 64
SHAPES = [(64, 131072, 2048), (64, 131072, 512), (1, 131072, 2048), (1, 1 << 20, 2048), (2048, 32768, 2048)]
SWEEP_SHAPES = [(64, 131072, 2048), (64, 131072, 512), (2048, 32768, 2048), (1, 131072, 2048)]
ADVERSARIAL = [(40000, 2048), (9000, 513)]  # columns, k
SWEEP = [  # tuning overrides on the table's entry (the first is the table itself); more were raced on the way
    # (docs/experiments.md, "Top-k"): the Triton kernels where the table runs the Gluon block kernel, and
    # the block kernel with 16 warps; split rows finished by one program a row, and without programmatic dependent
    # launch (docs/kernels.md, "Where it stands"); many rows sampled in the block kernel, or ahead with their bins
    # counted after the filter, each with and without the next row prefetched (docs/kernels.md, "Rows sampled ahead");
    # the sample launch of rows sampled ahead over 4 and 2 warps a row (more rows' samples in flight an SM), with its
    # radix select capped at 3 rounds, and taking the table's SAMPLE_RANK rather than the block kernel's count (not
    # yet raced)
    {}, {"KERNEL": "triton"}, {"BLOCK_WARPS": 16, "BLOCK_PIECE_J": 8}, {"SAMPLE_RANK": 64}, {"FINISH_BINS": 512},
    {"CHUNKS_PER_SM": 16}, {"FINISH_TIES": 0}, {"PDL": False}, {"BLOCK_FLOORS": 0}, {"BLOCK_FLOORS": 1},
    {"BLOCK_PREFETCH": 0}, {"BLOCK_FLOORS": 0, "BLOCK_PREFETCH": 0}, {"AHEAD_SAMPLE_WARPS": 4},
    {"AHEAD_SAMPLE_WARPS": 2}, {"SAMPLE_ROUNDS": 3}, {"AHEAD_SAMPLE_RANK": 32},
]
# Per-launch times: the many-rows kernel (Gluon block or Triton fused), or the split sample and filter, then the
# finishing kernel; CHUNK forces the split path.
BREAKDOWN = [(64, 131072, 2048, 0), (1, 1 << 20, 2048, 0), (2048, 32768, 2048, 0), (2048, 32768, 2048, 32768)]


def _case(rows: int, cols: int, k: int) -> str:
    size = f"{cols >> 20}M" if cols >= 1 << 20 else f"{cols >> 10}K"
    return f"{rows}x{size} k={k}"


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: the same index multiset (order free), as a bool tensor on the device."""
    return (a.sort(1).values == b.sort(1).values).all(1)


def _check(name: str, ok: bool, detail: str = "") -> dict:
    print(f"  [{'ok' if ok else 'FAILED'}] {name}{': ' + detail if detail else ''}", flush=True)
    return {"check": name, "ok": bool(ok), "detail": detail}


def _timed(fn: Callable[[int], object], sets: int, graph: bool, budget_s: float = 0.25) -> float:
    """Median microseconds of one ``fn(i)``: a CUDA graph of ``fn(0) … fn(sets - 1)`` (inputs rotated so L2 holds
    none of them) replayed, divided by ``sets``; or eager calls rotating through the sets when ``graph`` is False.
    One warm-up call (replay) first, then 5 to 200 timed within ``budget_s``."""
    if graph:
        replay = capture_graph(lambda: [fn(i) for i in range(sets)]).replay
        return 1000 * median_ms(replay, CUDA, budget_s, 5, 200) / sets
    state = {"i": 0}

    def step():
        fn(state["i"] % sets)
        state["i"] += 1

    return 1000 * median_ms(step, CUDA, budget_s, 5, 200)


def _table(page_size: int, rows: int, cols: int, dev) -> tuple[torch.Tensor, int]:
    pages = -(-cols // page_size)
    table = torch.randperm(rows * pages, device=dev).int().view(rows, pages)
    return table, page_size


# ---------------------------------------------------------------- (a) correctness


def check_shapes(dev) -> list[dict]:
    """Target shapes against the torch backend (every row) and the reference (a few rows)."""
    out = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for rows, cols, k in SHAPES:
        scores = torch.randn(rows, cols, device=dev, generator=gen)
        lengths = torch.full((rows,), cols, device=dev, dtype=torch.int32)
        lengths[1::3] = torch.randint(k // 2, cols, (len(range(1, rows, 3)),), device=dev, generator=gen).int()
        ours = indexcache.topk(scores, lengths, k, backend="cuda")
        torch_b = indexcache.topk(scores, lengths, k, backend="torch")
        bad = int((~_same_sets(ours, torch_b)).sum())
        pick = sorted({0, rows // 2, rows - 1})
        ref = reference.topk(scores[pick], lengths[pick], k)
        ref_bad = int((~_same_sets(ours[pick].cpu(), ref)).sum())
        table, page = _table(PAGE, rows, cols, dev)
        raw = torch.empty_like(ours)
        phys = indexcache.topk_translate(scores, lengths, k, table, page, out_raw=raw, backend="cuda")
        want = indexcache.translate(raw, table, lengths, page, backend="torch")
        fused_ok = torch.equal(raw, ours) and torch.equal(phys, want)
        out.append(_check(f"{_case(rows, cols, k)}: topk = torch backend on {rows} rows, reference on {len(pick)}; "
                          "topk_translate = translate(topk)", bad == 0 and ref_bad == 0 and fused_ok,
                          f"{bad} rows differ from torch, {ref_bad} from the reference, fused equal: {fused_ok}"))
        ours = indexcache.topk(scores, lengths, k, sorted=True, backend="cuda")
        torch_b = indexcache.topk(scores, lengths, k, sorted=True, backend="torch")
        bad = int((ours != torch_b).any(1).sum())
        ref_bad = int((ours[pick].cpu() != ref).any(1).sum())
        out.append(_check(f"{_case(rows, cols, k)}: sorted topk = torch backend's sorted rows slot by slot, reference "
                          f"on {len(pick)}", bad == 0 and ref_bad == 0,
                          f"{bad} rows differ from torch, {ref_bad} from the reference"))
        del scores, ours, torch_b, raw, phys, want
    return out


def _adversarial(dev, cols: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=dev).manual_seed(k)
    scores = torch.randn(10, cols, device=dev, generator=gen)
    scores[1] = 0.5  # one tie bin far larger than the stash
    scores[2] = torch.randint(0, 3, (cols,), device=dev, generator=gen).float()
    scores[3] = float("-inf")
    scores[4] = float("nan")
    scores[4, ::97] = torch.randn(len(range(0, cols, 97)), device=dev, generator=gen)
    scores[5] = 100.0 + 1e-3 * torch.randn(cols, device=dev, generator=gen)  # one coarse bin: the rescan path
    scores[6, ::2] = -0.0
    lengths = torch.tensor([cols, cols, cols - 5, cols, cols, cols, cols // 3, k, k + 1, -4], device=dev,
                           dtype=torch.int32)
    starts = torch.tensor([0, 0, 5, 0, 0, 0, 17, cols - k, 3, 0], device=dev, dtype=torch.int32)
    return scores, lengths, starts


def check_adversarial(dev) -> list[dict]:
    """Ties, -inf, NaN, ±0, short / negative lengths, row_starts, bf16, strided — against the reference."""
    out = []
    for cols, k in ADVERSARIAL:
        scores, lengths, starts = _adversarial(dev, cols, k)
        ref = reference.topk(scores, lengths, k, row_starts=starts)
        for label, s in (("fp32", scores), ("bf16", scores.bfloat16()), ("strided fp32", scores.t().contiguous().t())):
            want = ref if label != "bf16" else reference.topk(s, lengths, k, row_starts=starts)
            got = indexcache.topk(s, lengths, k, row_starts=starts, backend="cuda").cpu()
            bad = int((~_same_sets(got, want)).sum())
            out.append(_check(f"adversarial rows, {cols} columns, k={k}, {label}", bad == 0, f"{bad} rows differ"))
            got = indexcache.topk(s, lengths, k, row_starts=starts, sorted=True, backend="cuda").cpu()
            bad = int((got != want).any(1).sum())
            out.append(_check(f"adversarial rows, {cols} columns, k={k}, {label}, sorted", bad == 0,
                              f"{bad} rows differ from the sorted reference"))
    return out


# ---------------------------------------------------------------- (b) graphs


def check_graph(dev, replays: int = 1000) -> list[dict]:
    """Capture topk_translate twice (a split-row shape and a one-program-a-row shape) into one graph with
    preallocated out/out_raw, replay while scores and lengths change; every replay equals eager."""
    gen = torch.Generator(device=dev).manual_seed(7)
    shapes = [(48, 65536, 2048), (600, 8192, 512)]
    pool = 4
    static, eager = [], []
    for rows, cols, k in shapes:
        table, page = _table(PAGE, rows, cols, dev)
        inputs = []
        for _ in range(pool):
            scores = torch.randn(rows, cols, device=dev, generator=gen)
            scores[rows // 2] = 1.0  # a row of ties
            lengths = torch.randint(-2, cols + 1, (rows,), device=dev, generator=gen).int()
            lengths[::5] = cols
            lengths[1::7] = k  # short rows: their scores are never read
            inputs.append((scores, lengths))
        s, l0 = inputs[0][0].clone(), inputs[0][1].clone()
        out, raw = (torch.empty(rows, k, device=dev, dtype=torch.int32) for _ in range(2))
        ref = []
        for scores, lengths in inputs:
            p = indexcache.topk_translate(scores, lengths, k, table, page, backend="cuda")
            r = torch.empty_like(p)
            indexcache.topk_translate(scores, lengths, k, table, page, out_raw=r, backend="cuda")
            ref.append((p, r))
        static.append((s, l0, k, table, page, out, raw))
        eager.append((inputs, ref))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    for s, lengths, k, table, page, out, raw in static:
        indexcache.topk_translate(s, lengths, k, table, page, out=out, out_raw=raw, backend="cuda")
    torch.cuda.synchronize()
    grew = torch.cuda.memory_allocated(dev) - before

    def body():
        for s, lengths, k, table, page, out, raw in static:
            indexcache.topk_translate(s, lengths, k, table, page, out=out, out_raw=raw, backend="cuda")

    graph = capture_graph(body)
    torch.cuda.synchronize()
    mismatches = torch.zeros((), device=dev, dtype=torch.int64)
    for i in range(replays):
        j = (i * 7 + i // pool) % pool
        for (s, lengths, *_), (inputs, _) in zip(static, eager, strict=True):
            s.copy_(inputs[j][0])
            lengths.copy_(inputs[j][1])
        graph.replay()
        for (*_, out, raw), (_, ref) in zip(static, eager, strict=True):
            mismatches += (out != ref[j][0]).any() | (raw != ref[j][1]).any()
    torch.cuda.synchronize()
    bad = int(mismatches)
    del graph
    return [_check("an eager call with preallocated out/out_raw allocates nothing", grew == 0, f"{grew} bytes"),
            _check(f"CUDA graph: {replays} replays with changing scores and lengths equal eager", bad == 0,
                   f"{bad} replays differ")]


# ---------------------------------------------------------------- (c) timings


def _rotation(nbytes: int, dev) -> int:
    """Input sets that together hold more than twice the caches (the L2; on AMD also the Infinity Cache; 2 to 64)."""
    return max(2, min(64, -(-2 * cache_bytes(dev) // nbytes)))


def time_shapes(dev) -> list[dict]:
    rows_out = []
    for rows, cols, k in SHAPES:
        row = _time_shape(rows, cols, k, dev)
        rows_out.append(row)
        print(f"  {row['case']}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items() if k.endswith("_us")),
              flush=True)
    return rows_out


def _time_shape(rows: int, cols: int, k: int, dev) -> dict:
    sets = _rotation(rows * cols * 4, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    scores = [torch.randn(rows, cols, device=dev, generator=gen) for _ in range(sets)]
    lengths = torch.full((rows,), cols, device=dev, dtype=torch.int32)
    out, raw, phys = (torch.empty(rows, k, device=dev, dtype=torch.int32) for _ in range(3))
    table, page = _table(PAGE, rows, cols, dev)
    row = {"case": _case(rows, cols, k), "rows": rows, "cols": cols, "k": k, "bytes": rows * cols * 4}
    candidates = {
        "read_us": (lambda i: scores[i].sum(), True),
        "torch_topk_us": (lambda i: torch.topk(scores[i], k, dim=1, sorted=False), True),
        "topk_us": (lambda i: indexcache.topk(scores[i], lengths, k, out=out, backend="cuda"), True),
        "topk_translate_us": (lambda i: indexcache.topk_translate(scores[i], lengths, k, table, page, out=phys,
                                                                  out_raw=raw, backend="cuda"), True),
        "topk_sorted_us": (lambda i: indexcache.topk(scores[i], lengths, k, out=out, sorted=True, backend="cuda"),
                           True),
        "topk_eager_us": (lambda i: indexcache.topk(scores[i], lengths, k, out=out, backend="cuda"), False),
        "torch_backend_us": (lambda i: indexcache.topk(scores[i], lengths, k, out=out, backend="torch"), False),
    }
    for key, (fn, graph) in candidates.items():
        try:
            row[key] = _timed(fn, sets if graph else min(sets, 4), graph)
        except Exception as exc:  # one failing measurement must not hide the others
            row[key + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
    _derive(row)
    return row


def _derive(row: dict) -> None:
    """Ratios and the issue's targets for one timed shape."""
    t, read, torch_t = row.get("topk_us"), row.get("read_us"), row.get("torch_topk_us")
    if t and read:
        row["x_read"] = t / read
        row["read_gbps"] = row["bytes"] / read / 1e3
    if t and torch_t:
        row["speedup_vs_torch_topk"] = torch_t / t
    if t and row.get("torch_backend_us"):
        row["speedup_vs_torch_backend"] = row["torch_backend_us"] / t
    if t and row.get("topk_translate_us"):
        row["translate_over_topk"] = row["topk_translate_us"] / t
    if t and row.get("topk_sorted_us"):
        row["sorted_over_topk"] = row["topk_sorted_us"] / t
    rows, cols = row["rows"], row["cols"]
    goals = {"translate_over_topk": ("<=", 1.15)}
    if rows == 64:
        goals |= {"x_read": ("<=", 4.0), "speedup_vs_torch_topk": (">=", 5.0)}
    elif rows == 1:
        goals |= {"speedup_vs_torch_topk": (">=", 3.0)}
    elif rows == 2048 and cols == 32768:
        goals |= {"speedup_vs_torch_topk": (">=", 4.0)}
    row["targets"] = {name: {"goal": f"{op} {bound}", "value": row.get(name),
                             "met": row.get(name) is not None and (row[name] <= bound if op == "<=" else
                                                                   row[name] >= bound)}
                      for name, (op, bound) in goals.items()}


# ---------------------------------------------------------------- (d) sweep


def sweep(dev) -> list[dict]:
    """Tuning configurations called directly (each checked against the torch backend)."""
    from indexcache.backends.cuda import tuning
    from indexcache.backends.cuda.arch import NVIDIA
    from indexcache.backends.triton.target import detect

    target = detect(NVIDIA)[2]
    base = tuning(target.arch)["topk"]
    return [r for rows, cols, k in SWEEP_SHAPES for r in _sweep_shape(rows, cols, k, target, base, dev)]


def _sweep_shape(rows: int, cols: int, k: int, target, base: dict, dev) -> list[dict]:
    from indexcache.backends.triton import topk as kernels

    sets = _rotation(rows * cols * 4, dev)
    gen = torch.Generator(device=dev).manual_seed(2)
    scores = [torch.randn(rows, cols, device=dev, generator=gen) for _ in range(sets)]
    lengths = torch.full((rows,), cols, device=dev, dtype=torch.int32)
    out = torch.empty(rows, k, device=dev, dtype=torch.int32)
    want = indexcache.topk(scores[0], lengths, k, backend="torch")
    found = []
    for overrides in SWEEP:
        cfg = dict(base, **overrides)
        steps = kernels.launches(scores[0], lengths, k, None, out, None, None, 1, None, target=target, cfg=cfg)
        first = steps[0][1].launcher.fn.__name__ if steps else "none"
        row = {"case": _case(rows, cols, k), "config": " ".join(f"{n}={v}" for n, v in overrides.items()) or "table",
               "path": f"{first} ({len(steps)} launches)"}

        def run(i: int, c: dict = cfg) -> torch.Tensor:
            return kernels.topk(scores[i], lengths, k, None, out, False, target=target, cfg=c)

        try:
            run(0)
            row["equal_to_torch_backend"] = bool(_same_sets(out, want).all())
            row["us"] = _timed(run, sets, True, 0.15)
            steps = [kernels.launches(s, lengths, k, None, out, None, None, 1, None, target=target, cfg=cfg)
                     for s in scores]
            row.update(_launch_times(steps, sets, 0.1))
        except Exception as exc:  # a configuration that does not compile or fit is a result too
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        found.append(row)
    return found


def _launch_times(steps: list, sets: int, budget_s: float) -> dict[str, float]:
    """Each launch's µs: the graph replay time of the launches up to it minus that of those before it (over the
    rotated input sets). No launch is replayed alone: the split rows' finish reads the candidate counts that the
    sample zeroes and the filter adds to."""
    times, before = {}, 0.0
    for j, (name, _) in enumerate(steps[0]):
        upto = _timed(lambda i, j=j: [steps[i][q][1]() for q in range(j + 1)], sets, True, budget_s)
        times[name + "_us"] = upto - before
        before = upto
    return times


def breakdown(dev) -> list[dict]:
    """Each kernel launch of one call (:func:`_launch_times`)."""
    from indexcache.backends.cuda import tuning
    from indexcache.backends.cuda.arch import NVIDIA
    from indexcache.backends.triton.target import detect

    target = detect(NVIDIA)[2]
    base = tuning(target.arch)["topk"]
    return [_breakdown_shape(rows, cols, k, chunk, target, dict(base, CHUNK=chunk), dev)
            for rows, cols, k, chunk in BREAKDOWN]


def _breakdown_shape(rows: int, cols: int, k: int, chunk: int, target, cfg: dict, dev) -> dict:
    from indexcache.backends.triton import topk as kernels

    sets = _rotation(rows * cols * 4, dev)
    gen = torch.Generator(device=dev).manual_seed(3)
    scores = [torch.randn(rows, cols, device=dev, generator=gen) for _ in range(sets)]
    lengths = torch.full((rows,), cols, device=dev, dtype=torch.int32)
    out = torch.empty(rows, k, device=dev, dtype=torch.int32)
    steps = [kernels.launches(s, lengths, k, None, out, None, None, 1, None, target=target, cfg=cfg) for s in scores]
    row = {"case": _case(rows, cols, k) + (f" CHUNK={chunk}" if chunk else ""), "launches": [n for n, _ in steps[0]]}
    try:
        row.update(_launch_times(steps, sets, 0.15))
    except Exception as exc:  # one failing shape must not hide the others
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    print(f"  {row['case']}: " + ", ".join(f"{n} {v:.1f}" for n, v in row.items() if n.endswith("_us")), flush=True)
    return row


# ---------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    parser.add_argument("--no-sweep", action="store_true", help="skip the per-launch breakdown and the tuning sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU visible: this script measures a GPU "
              "(the interpreted checks are tests/kernels/test_triton_topk.py)")
        return 2
    dev = CUDA
    dispatch.reset()
    v = versions()
    report: dict = {
        "date": now(), "gpu": device_name(dev), "commit": checkout_commit(), "torch": v["torch"],
        "triton": v["triton"], "python": v["python"],
        "tuning": dispatch.get("cuda").info().get("tuning", {}).get("topk"), "errors": [],
    }
    sections: list[tuple[str, Callable[[], list[dict]]]] = [
        ("checks", lambda: check_shapes(dev) + check_adversarial(dev) + check_graph(dev)),
        ("timings", lambda: time_shapes(dev)),
    ]
    if not args.no_sweep:
        sections += [("breakdown", lambda: breakdown(dev)), ("sweep", lambda: sweep(dev))]
    run_sections(report, sections, args.out, after=torch.cuda.empty_cache)
    print_rows("timings (µs; graph replays, inputs rotated past L2; torch backend eager)", report.get("timings", []),
               ["case", "read_us", "torch_topk_us", "torch_backend_us", "topk_us", "topk_eager_us",
                "topk_translate_us", "topk_sorted_us", "x_read", "speedup_vs_torch_topk", "translate_over_topk",
                "sorted_over_topk"], digits=3)
    for row in report.get("timings", []):
        for name, t in row["targets"].items():
            value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
            print(f"  target {row['case']}: {name} {t['goal']}: {value} {'met' if t['met'] else 'NOT MET'}")
    if report.get("breakdown"):
        print_rows("per-launch (µs, graph replays)", report["breakdown"],
                   ["case", "rows_us", "sample_us", "filter_us", "finish_us"], digits=3)
    if report.get("sweep"):
        print_rows("sweep (µs, graph replays)", report["sweep"],
                   ["case", "config", "path", "us", "rows_us", "sample_us", "filter_us", "finish_us",
                    "equal_to_torch_backend", "error"], digits=3)
    print(f"\nwrote {args.out} ({report['seconds']} s)")
    failed = report["errors"] or not all(r["ok"] for r in report.get("checks", []))
    failed = failed or any(r.get("equal_to_torch_backend") is False for r in report.get("sweep", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
