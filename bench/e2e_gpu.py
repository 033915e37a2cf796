"""IndexCache end to end on one GPU: a DeepSeek-V3.2-shaped indexer stack under freq 1, 2 and 4.

    pip install -e . && python bench/e2e_gpu.py --out out/e2e.json

The stack: 61 sparse layers, 64 index heads, head dim 128, top-k 2048, page 64, fp8 keys in the packed
132-byte-a-token cache, every layer with its own page table. One forward = for each layer, through
``IndexerRunner`` and ``TopkState``: a producer's logits (``paged_mqa_logits`` in decode,
``mqa_logits`` in prefill) then ``topk_translate`` into the state; a shared layer's ``translate`` of
the producer's indices through its own table. The q/k projections and the index-K store are not
timed (they are the same per producer and do not change the freq ratio much); one key set and one
query set serve every layer (the time is the same as with per-layer ones). Scenarios: decode batch 64
at 32K and 128K context (timed as CUDA-graph replays when the forward can be captured, else eager)
and a 4096-token prefill chunk at the end of a 32K context (eager).

Also measured: the overlap of the producer's indexer (decode 64 × 32K) on a side stream with an
equal-length main-stream bf16 GEMM workload, as the fraction of the indexer's time hidden; allocator
statistics across steady-state decode steps (graph replays and eager forwards). Which backend served
each op is recorded from ``indexcache.hal.dispatch.resolve`` during a warm-up forward. Prints tables,
writes JSON to ``--out``; about 1–3 minutes on an H200 (most of it in the torch fallback when the
Triton logits/top-k kernels are absent). ``--smoke`` runs tiny shapes, on the CPU too, to check the
script itself (its times mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import indexcache
from indexcache.bench.output import write_json
from indexcache.bench.provenance import checkout_commit, device_name, now, versions
from indexcache.bench.timing import capture_graph, times_ms
from indexcache.hal import dispatch
from indexcache.hal.layout import new_packed_cache, split_packed_cache
from indexcache.plan import LayerPlan
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import TopkState
from indexcache.runtime.streams import overlap

FREQS = (1, 2, 4)
TARGETS = {"freq4_ratio": 0.30, "overlap_hidden": 0.50, "steady_state_allocations": 0}


@dataclass(frozen=True)
class Shapes:
    layers: int
    heads: int
    dim: int
    topk: int
    page: int
    batch: int
    contexts: tuple[int, ...]
    prefill_tokens: int
    prefill_context: int
    gemm: int


FULL = Shapes(layers=61, heads=64, dim=128, topk=2048, page=64, batch=64, contexts=(32768, 131072),
              prefill_tokens=4096, prefill_context=32768, gemm=4096)
SMOKE = Shapes(layers=6, heads=4, dim=128, topk=64, page=16, batch=4, contexts=(512, 1024), prefill_tokens=64,
               prefill_context=512, gemm=256)


# ---------------------------------------------------------------- timing


def timed(fn: Callable[[], object], dev: torch.device) -> list[float]:
    """Milliseconds of each timed call of ``fn`` after one warm-up call (CUDA events on a GPU): 3 to 20 calls
    within 1 s."""
    return times_ms(fn, dev, 1.0, 3, 20)


def capture(fn: Callable[[], object], dev: torch.device) -> tuple[torch.cuda.CUDAGraph | None, str | None]:
    """``fn`` captured into a CUDA graph (after a warm-up call on a side stream), or ``(None, why not)``."""
    if dev.type != "cuda":
        return None, "no CUDA device"
    try:
        graph = capture_graph(fn)
        graph.replay()
        torch.cuda.synchronize()
        return graph, None
    except Exception as exc:  # an op that syncs or allocates on the host side: report, time eagerly
        torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]


# ---------------------------------------------------------------- the stack


@dataclass
class Stack:
    """Inputs of one scenario: what a producer's indexer reads, and every layer's page table."""

    name: str
    rows: int
    scores: Callable[[torch.Tensor], torch.Tensor]  # a producer's logits, given its layer's page table
    lengths: torch.Tensor
    tables: torch.Tensor
    row_to_batch: torch.Tensor | None


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _tables(layers: int, batch: int, pages: int, dev: torch.device) -> torch.Tensor:
    """``[layers, batch, pages]`` int32: each layer maps the requests' pages through its own permutation."""
    return torch.stack([torch.randperm(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
                        for _ in range(layers)])


def decode_stack(s: Shapes, context: int, dev: torch.device, fp8: torch.dtype) -> Stack:
    pages = -(-context // s.page)
    cache = new_packed_cache(s.batch * pages, s.page, s.dim, device=dev)
    keys, scales = split_packed_cache(cache, s.dim, fp8)
    for p0 in range(0, keys.shape[0], 4096):  # bounded temporaries
        chunk = keys[p0:p0 + 4096]
        chunk.copy_((torch.randn(chunk.shape, device=dev, dtype=torch.bfloat16) * 40).to(fp8))
    scales.copy_(torch.rand(scales.shape, device=dev) * 0.01 + 1e-3)
    q = (torch.randn(s.batch, 1, s.heads, s.dim, device=dev) * 24).clamp(-400, 400).to(fp8)
    weights = torch.randn(s.batch, s.heads, device=dev) * s.heads**-0.5
    lens = torch.full((s.batch,), context, dtype=torch.int32, device=dev)
    logits = torch.empty(s.batch, pages * s.page, device=dev)

    def scores(table: torch.Tensor) -> torch.Tensor:
        return indexcache.paged_mqa_logits(q, cache, weights, lens, table, pages * s.page, out=logits)

    return Stack(f"decode B{s.batch} ctx {_tokens(context)}", s.batch, scores, lens,
                 _tables(s.layers, s.batch, pages, dev), None)


def prefill_stack(s: Shapes, dev: torch.device, fp8: torch.dtype) -> Stack:
    t, n = s.prefill_tokens, s.prefill_context
    q = (torch.randn(t, s.heads, s.dim, device=dev) * 24).clamp(-400, 400).to(fp8)
    k = (torch.randn(n, s.dim, device=dev) * 40).to(fp8)
    k_scale = torch.rand(n, device=dev) * 0.01 + 1e-3
    weights = torch.randn(t, s.heads, device=dev) * s.heads**-0.5
    ks = torch.zeros(t, dtype=torch.int32, device=dev)
    ke = (n - t + 1 + torch.arange(t, device=dev)).to(torch.int32)  # causal: the chunk ends the context
    logits = torch.empty(t, n, device=dev)

    def scores(table: torch.Tensor) -> torch.Tensor:  # the keys are already gathered: the table is unused
        return indexcache.mqa_logits(q, k, k_scale, weights, ks, ke, out=logits)

    return Stack(f"prefill {_tokens(t)} at ctx {_tokens(n)}", t, scores, ke, _tables(s.layers, 1, -(-n // s.page), dev),
                 torch.zeros(t, dtype=torch.int32, device=dev))


def layer_fn(stack: Stack, runner: IndexerRunner, state: TopkState, layer: int) -> Callable[[], torch.Tensor | None]:
    """One layer's indexer part through the runner (its physical slots)."""
    table = stack.tables[layer]
    return lambda: runner.layer(layer, state, scores=lambda: stack.scores(table), lengths=stack.lengths,
                                page_table=table, row_to_batch=stack.row_to_batch)


def forward_fn(stack: Stack, runner: IndexerRunner, state: TopkState) -> Callable[[], None]:
    """One forward of the indexer part: every layer through the runner."""
    layers = [layer_fn(stack, runner, state, layer) for layer in runner.layers]

    def forward() -> None:
        runner.begin(state, stack.rows)
        for layer in layers:
            layer()

    return forward


def served_backends(fn: Callable[[], object]) -> dict[str, list[str]]:
    """Run ``fn`` once, recording which backend ``indexcache.hal.dispatch.resolve`` picked for each op."""
    seen: dict[str, set[str]] = {}
    real = dispatch.resolve

    def spy(op, args, backend=None):
        name, impl = real(op, args, backend)
        seen.setdefault(op, set()).add(name)
        return name, impl

    dispatch.resolve = spy
    try:
        fn()
    finally:
        dispatch.resolve = real
    return {op: sorted(names) for op, names in sorted(seen.items())}


# ---------------------------------------------------------------- sections


def run_scenario(stack: Stack, s: Shapes, dev: torch.device, graphs: bool, deadline: float) -> dict:
    """Per freq: producers, median ms per forward (graph replays when capturable), ratio to freq 1."""
    out: dict = {"scenario": stack.name, "freqs": {}, "backends": {}}
    state = TopkState(stack.rows, s.topk, dev)
    for freq in FREQS:
        if time.perf_counter() > deadline:
            out["freqs"][str(freq)] = {"skipped": "time budget spent"}
            continue
        plan = LayerPlan(s.layers, index_topk_freq=freq, index_topk=s.topk, page_size=s.page)
        runner = IndexerRunner(plan)
        forward = forward_fn(stack, runner, state)
        for op, names in served_backends(forward).items():
            out["backends"][op] = sorted(set(out["backends"].get(op, [])) | set(names))
        row: dict = {"producers": len(plan.producers), "mode": "eager"}
        graph, why = capture(forward, dev) if graphs else (None, "prefill is timed eagerly")
        if graph is not None:
            row["mode"] = "graph"
            times = timed(graph.replay, dev)
            del graph
        else:
            row["graph_error"] = why
            times = timed(forward, dev)
        row.update(ms=times, median_ms=statistics.median(times))
        out["freqs"][str(freq)] = row
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = out["freqs"].get("1", {}).get("median_ms")
    for row in out["freqs"].values():
        if base and "median_ms" in row:
            row["ratio"] = row["median_ms"] / base
    ratio = out["freqs"].get("4", {}).get("ratio")
    out["freq4_ratio"] = ratio
    out["ideal_freq4_ratio"] = out["freqs"].get("4", {}).get("producers", 0) / s.layers
    out["meets_target"] = ratio is not None and ratio <= TARGETS["freq4_ratio"]
    return out


def overlap_section(stack: Stack, s: Shapes, dev: torch.device) -> dict:
    """Hide the producer's indexer (one decode layer) behind an equal-length main-stream GEMM workload."""
    state = TopkState(stack.rows, s.topk, dev)
    plan = LayerPlan(s.layers, index_topk=s.topk, page_size=s.page)
    runner = IndexerRunner(plan)
    runner.begin(state, stack.rows)
    side = layer_fn(stack, runner, state, 0)
    a = torch.randn(s.gemm, s.gemm, device=dev, dtype=torch.bfloat16)
    b = torch.randn(s.gemm, s.gemm, device=dev, dtype=torch.bfloat16)
    c = torch.empty(s.gemm, s.gemm, device=dev, dtype=torch.bfloat16)
    side_ms = statistics.median(timed(side, dev))
    gemm_ms = statistics.median(timed(lambda: torch.matmul(a, b, out=c), dev))
    repeats = max(1, round(side_ms / gemm_ms))

    def main() -> None:
        for _ in range(repeats):
            torch.matmul(a, b, out=c)

    main_ms = statistics.median(timed(main, dev))

    def both() -> None:
        overlap(side, main, device=dev)

    name, impl = dispatch.resolve("overlap", dict(side_fn=side, main_fn=main, side=0, device=dev))
    result = {"scheduler_backend": name, "scheduler": getattr(impl.fn, "__name__", type(impl.fn).__name__),
              "side_ms": side_ms, "gemm_ms": gemm_ms, "gemm_repeats": repeats, "main_ms": main_ms}
    for mode in ("eager", "graph"):
        fn: Callable[[], object] = both
        if mode == "graph":
            graph, why = capture(both, dev)
            if graph is None:
                result["graph_error"] = why
                continue
            fn = graph.replay
        both_ms = statistics.median(timed(fn, dev))
        hidden = (side_ms + main_ms - both_ms) / side_ms
        result[mode] = {"both_ms": both_ms, "hidden_fraction": hidden,
                        "meets_target": hidden >= TARGETS["overlap_hidden"]}
    return result


def allocator_section(stack: Stack, s: Shapes, dev: torch.device, steps: int = 20) -> dict:
    """Allocator statistics across steady-state decode forwards (freq 4): graph replays and eager calls."""
    if dev.type != "cuda":
        return {"skipped": "no CUDA device"}
    state = TopkState(stack.rows, s.topk, dev)
    runner = IndexerRunner(LayerPlan(s.layers, index_topk_freq=4, index_topk=s.topk, page_size=s.page))
    forward = forward_fn(stack, runner, state)
    keys = ("allocation.all.allocated", "segment.all.allocated", "reserved_bytes.all.current")

    def stats() -> dict:
        all_stats = torch.cuda.memory_stats(dev)
        return {key: all_stats.get(key, 0) for key in keys}

    def delta(fn: Callable[[], object]) -> dict:
        fn()
        torch.cuda.synchronize()
        before = stats()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        after = stats()
        return {key: after[key] - before[key] for key in keys}

    result: dict = {"steps": steps, "eager": delta(forward)}
    graph, why = capture(forward, dev)
    if graph is None:
        result["graph_error"] = why
    else:
        result["graph"] = delta(graph.replay)
    graph = result.get("graph", {})
    result["meets_target"] = (graph.get("allocation.all.allocated") == TARGETS["steady_state_allocations"]
                              and graph.get("segment.all.allocated") == 0)
    return result


# ---------------------------------------------------------------- report


def small_model_section(dev: torch.device, smoke: bool) -> dict:
    """The small DSA model's decode step (:mod:`indexcache.tools.model`, v32-like, 4 layers, freq 2, 8 requests of
    2K tokens, top-k 256): eager; its ``forward`` under ``torch.compile`` (``aot_eager``, which runs the same
    kernels, and Inductor, which fuses the model's own float arithmetic; ``dynamic=False``; graph breaks allowed:
    the runner's plan lookups), and with Inductor also the forward with the producers' indexer left eager and the
    indexer alone compiled (to place a difference); and the eager step captured in a CUDA graph and replayed. ms
    a step (median), and whether each equals eager (the same top-k indices; logits within 1e-4): a difference is
    reported, not hidden (on the H200 Inductor's step differs from eager while the ops alone compile exactly:
    BENCHMARKS.md, "Eager calls")."""
    from indexcache.runtime.runner import IndexerRunner
    from indexcache.tools.model.config import preset
    from indexcache.tools.model.dsa import DSAModel
    from indexcache.tools.model.static_decode import StaticDecode

    cfg = preset("v32-like", num_layers=4, topk=16 if smoke else 256, page_size=16 if smoke else 64)
    requests, max_len = (2, 256) if smoke else (8, 2048)
    model = DSAModel(cfg, dev)
    runner = IndexerRunner(model.plan(2))
    cache = model.new_cache(requests, max_len)
    g = torch.Generator(device=dev).manual_seed(0)
    slots = cache.kv.shape[1] - 1
    cache.kv.copy_(torch.randn(cache.kv.shape, device=dev, generator=g))
    for k_cache in cache.index_k.values():  # a context's worth of index keys in every slot
        keys = torch.randn(slots, cfg.index_dim, device=dev, generator=g)
        indexcache.store_index_k(keys, k_cache, torch.arange(slots, dtype=torch.int32, device=dev), model.fp8)
    static = StaticDecode(model, cache, runner, requests)
    static.load(torch.randint(0, cfg.vocab, (requests,), device=dev, generator=g),
                torch.full((requests,), max_len - 1, dtype=torch.int32, device=dev),
                cache.tables_for(torch.arange(requests)))
    want_logits, want_raw = static.step().clone(), static.state.raw.clone()
    result: dict = {"config": {"layers": cfg.num_layers, "topk": cfg.topk, "requests": requests, "context": max_len,
                               "freq": 2}}

    def same(tag: str) -> None:
        result[f"{tag}_indices_equal"] = bool(torch.equal(static.state.raw, want_raw))
        result[f"{tag}_logits_max_abs_diff"] = float((static.logits - want_logits).abs().max())
        result[f"{tag}_equal"] = result[f"{tag}_indices_equal"] and bool(
            torch.allclose(static.logits, want_logits, rtol=1e-4, atol=1e-4))

    result["eager_ms"] = statistics.median(timed(static.step, dev))
    graph, why = capture(static.step, dev)
    if graph is not None:
        result["graph_ms"] = statistics.median(timed(graph.replay, dev))
        same("graph")
    else:
        result["graph_error"] = why
    forward, indexer = model.forward, model._index_scores
    # Where Inductor departs from eager, if it does: the whole forward; the forward with the producers' indexer
    # (projections, quantization, logits; the index keys are stored outside it) left eager; the indexer alone compiled.
    variants = {
        "compiled_aot_eager": (torch.compile(forward, backend="aot_eager", dynamic=False), indexer),
        "compiled_inductor": (torch.compile(forward, dynamic=False), indexer),
        "compiled_inductor_indexer_eager": (torch.compile(forward, dynamic=False), torch._dynamo.disable(indexer)),
        "compiled_inductor_indexer_only": (forward, torch.compile(indexer, dynamic=False)),
    }
    for tag, (model.forward, model._index_scores) in variants.items():
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=64):
            static.step()  # compiles
            same(tag)
            result[f"{tag}_ms"] = statistics.median(timed(static.step, dev))
    del model.forward, model._index_scores  # the class's methods again
    torch._dynamo.reset()
    return result


def _print_report(report: dict) -> None:
    print(f"{report['device']}, torch {report['torch']}, Triton {report['triton']}, commit {report['commit']}")
    print("\nindexer + translation per forward (ms, median)")
    print(f"{'scenario':<28}{'mode':>7}" + "".join(f"{f'freq {f}':>12}" for f in FREQS)
          + f"{'freq4/freq1':>13}{'ideal':>7}{'target':>8}")
    for sc in report.get("scenarios", []):
        freqs = sc["freqs"]
        modes = {row.get("mode", "-") for row in freqs.values()}
        cells = "".join(f"{freqs.get(str(f), {}).get('median_ms', float('nan')):>12.3f}" for f in FREQS)
        ratio = sc.get("freq4_ratio")
        ratio_s = f"{ratio:.3f}" if ratio is not None else "-"
        met = "met" if sc.get("meets_target") else "MISSED"
        print(f"{sc['scenario']:<28}{'/'.join(sorted(modes)):>7}{cells}{ratio_s:>13}"
              f"{sc['ideal_freq4_ratio']:>7.3f}{met:>8}")
    for sc in report.get("scenarios", []):
        served = ", ".join(f"{op}: {'/'.join(names)}" for op, names in sc.get("backends", {}).items())
        print(f"  {sc['scenario']}: served by {served}")
        errors = {row.get("graph_error") for row in sc["freqs"].values() if row.get("graph_error")}
        for err in errors:
            print(f"    not captured: {err}")
    ov = report.get("overlap")
    if ov:
        print(f"\noverlap ({ov['scheduler_backend']} scheduler): indexer {ov['side_ms']:.3f} ms on the side stream, "
              f"main {ov['main_ms']:.3f} ms ({ov['gemm_repeats']} bf16 GEMMs)")
        for mode in ("eager", "graph"):
            if mode in ov:
                r = ov[mode]
                print(f"  {mode:<6} together {r['both_ms']:.3f} ms: hides {r['hidden_fraction']:.1%} of the indexer "
                      f"(target ≥ {TARGETS['overlap_hidden']:.0%}: {'met' if r['meets_target'] else 'MISSED'})")
        if "graph_error" in ov:
            print(f"  graph: not captured: {ov['graph_error']}")
    al = report.get("allocator")
    if al:
        print(f"\nallocator over {al.get('steps', 0)} steady-state decode forwards (freq 4): "
              + "; ".join(f"{mode}: {al[mode]}" for mode in ("graph", "eager") if mode in al)
              + (f"; graph: not captured: {al['graph_error']}" if "graph_error" in al else "")
              + (f" ({al['skipped']})" if "skipped" in al else ""))
    sm = report.get("small_model")
    if sm:
        c = sm["config"]
        print(f"\nsmall model decode step ({c['layers']} layers, freq {c['freq']}, {c['requests']} x {c['context']}, "
              f"top-k {c['topk']}), ms: eager {sm['eager_ms']:.3f}")
        for tag in ("compiled_aot_eager", "compiled_inductor", "compiled_inductor_indexer_eager",
                    "compiled_inductor_indexer_only", "graph"):
            if f"{tag}_ms" in sm:
                print(f"  {tag:<31} {sm[f'{tag}_ms']:.3f}  equal to eager: {sm[f'{tag}_equal']} (indices equal "
                      f"{sm[f'{tag}_indices_equal']}, logits max |diff| {sm[f'{tag}_logits_max_abs_diff']:.2e})")
        if "graph_error" in sm:
            print(f"  graph not captured: {sm['graph_error']}")
    print(f"\ntotal {report['total_s']:.0f} s; errors in: {sorted(report['errors']) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (any device) to check the script itself")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop starting new measurements after this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU visible: this script measures a GPU (pass --smoke to check it on tiny CPU shapes)")
        return 2
    dispatch.reset()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SMOKE if args.smoke else FULL
    backend = dispatch.get_backend()
    fp8 = dispatch.get(backend).capabilities().fp8_dtype or torch.float8_e4m3fn
    v = versions()
    started = time.perf_counter()
    deadline = started + args.budget_s
    report: dict = {
        "schema": "indexcache-e2e-gpu/1", "date": now(), "device": device_name(dev) or "cpu", "torch": v["torch"],
        "triton": v["triton"], "python": v["python"], "commit": checkout_commit(),
        "smoke": args.smoke, "backend": backend, "fp8": str(fp8), "shapes": shapes.__dict__, "targets": TARGETS,
        "scenarios": [], "errors": {},
    }
    stacks: dict[str, Stack] = {}

    def section(name: str, run: Callable[[], object]) -> None:
        if time.perf_counter() > deadline:
            report["errors"][name] = "skipped: time budget spent"
            return
        try:
            result = run()
            if name.startswith("scenario"):
                report["scenarios"].append(result)
            else:
                report[name] = result
        except Exception:
            report["errors"][name] = traceback.format_exc()
            print(f"{name} failed:\n{report['errors'][name]}", file=sys.stderr)
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    for context in shapes.contexts:
        def decode(context: int = context) -> dict:
            stacks[f"decode{context}"] = decode_stack(shapes, context, dev, fp8)
            result = run_scenario(stacks[f"decode{context}"], shapes, dev, graphs=True, deadline=deadline)
            if context != shapes.contexts[0]:
                del stacks[f"decode{context}"]  # keep only the first for the sections below
            return result

        section(f"scenario decode {context}", decode)
    section("scenario prefill", lambda: run_scenario(prefill_stack(shapes, dev, fp8), shapes, dev, graphs=False,
                                                     deadline=deadline))
    section("small_model", lambda: small_model_section(dev, args.smoke))
    first = f"decode{shapes.contexts[0]}"
    if first in stacks:
        section("overlap", lambda: overlap_section(stacks[first], shapes, dev))
        section("allocator", lambda: allocator_section(stacks[first], shapes, dev))
    report["total_s"] = time.perf_counter() - started
    _print_report(report)
    write_json(report, args.out, indent=1)
    print(f"results written to {args.out}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
