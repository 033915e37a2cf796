"""BENCHMARKS.md's tables, printed from the measurements under benchmarks/results/ (one JSON a table).

    python bench/report_tables.py            # print every table
    python bench/report_tables.py --check    # exit 1 where BENCHMARKS.md's tables differ from what the JSON gives
    python bench/report_tables.py --write    # rewrite BENCHMARKS.md's tables from the JSON

Each result file records the GPU, the date and the commit it measured; every table's first line repeats them. In
BENCHMARKS.md a table stands between ``<!-- table NAME -->`` and ``<!-- end table -->``. To publish a new measurement,
copy the JSON a GPU run wrote (``ci/gpu.sh`` and the ``bench/*_gpu.py`` scripts write to ``out/``) over the file it
replaces, then run ``--write``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from indexcache.bench.output import markdown_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS = ROOT / "BENCHMARKS.md"
BLOCK = re.compile(r"^<!-- table (\S+) -->\n(.*?)^<!-- end table -->$", re.S | re.M)


def _f(x, fmt: str = ".1f") -> str:
    return "—" if x is None else format(x, fmt)


def _pct(x, fmt: str) -> str:
    """A fraction as a percentage; "—" where it was not measured (None)."""
    return "—" if x is None else format(100 * x, fmt) + " %"


def _head(d: dict, *more: str) -> str:
    """GPU · date · commit, then the versions where the file has them, then ``more``, then the result's ``note``
    (how the run differed from its commit) where it has one."""
    versions = d.get("versions", {})
    torch, triton = d.get("torch", versions.get("torch")), d.get("triton", versions.get("triton"))
    parts = [d.get("gpu") or d["device"], d["date"][:10], f"commit {d['commit'][:10]}"]
    parts += [f"torch {torch}"] * bool(torch) + [f"Triton {triton}"] * bool(triton)
    return " · ".join(parts + list(more) + ([d["note"]] if "note" in d else []))


def bench_op(d: dict) -> str:
    """An ``indexcache bench`` report of an op whose roofline is the copy bandwidth."""
    ceil = d["ceilings"]
    copy, launch = ceil["copy_bandwidth"]["rate"], ceil["launch"]
    copy = None if copy is None else copy / 1e9
    head = _head(d, f"copy {_f(copy, '.0f')} GB/s", f"empty Triton launch {_f(launch['eager_us'])} µs eager, "
                 f"{_f(launch['graph_us'], '.2f')} µs in a graph")
    rows = [[r["case"], r["backend"], _f(r["eager_us"]), _f(r["graph_us"]), _f(r["rate"], ".0f"),
             _pct(r["ceiling_fraction"], ".0f"), _f(r["launch_ratio"], ".2f"),
             _f(r["speedup_vs_torch"], ".1f")] for r in d["results"]]
    header = ["case", "backend", "eager µs", "graph µs", "GB/s", "% copy", "eager × empty launch", "× torch"]
    return head + "\n\n" + markdown_table(header, rows)


def launch_overhead(d: dict) -> str:
    """bench/launch_overhead_gpu.py: the ladder of a call's host cost, eager against graph, the layers' host cost."""
    calls = d["us_per_call"]
    empty = next(iter(calls.values()))
    ladder = [[path, _f(us), _f(us / empty, ".2f")] for path, us in calls.items()]
    eager = [[r["case"], _f(r["checked_eager_us"]), _f(r["eager_us"]), _f(r["graph_us"]), _f(r["overhead_us"], "+.1f"),
              r["target"], "yes" if r["met"] else "no"] for r in d["eager_vs_graph"]]
    host = [[case, _f(us["spec check"]), _f(us["dispatch"])] for case, us in d["host_us"].items()]
    return "\n\n".join([
        _head(d, "translate decode 64 × 2048 in bursts of back-to-back calls (the ladder); events around each call "
              f"(eager against graph: empty Triton launch {d['empty_launch_eager_us']:.1f} µs, bound translate launch "
              f"{d['bound_translate_launch_eager_us']:.1f} µs)"),
        markdown_table(["path", "µs a call", "× empty launch"], ladder),
        markdown_table(["case", "eager µs, checked", "eager µs, kept", "graph µs", "kept − graph µs", "target", "met"],
                       eager),
        markdown_table(["a first call's host cost (nothing launched)", "spec check µs", "dispatch µs"], host),
    ])


def _decode_speedup(r: dict) -> str:
    """A decode row's speed-up over the torch backend, like with like: the file's own where it says how it was timed
    (``speedup_timing``: graph against graph, else eager against eager); in older files, whose ``speedup`` divided
    torch's eager time by our graph time, eager against eager from their two eager times."""
    if "speedup_timing" in r:
        return f"{_f(r['speedup'], '.1f')} ({r['speedup_timing']})"
    return f"{_f(r['torch_ms'] / r['ms'], '.1f')} (eager)"


def logits(d: dict) -> str:
    """bench/logits_gpu.py: prefill against the matmul rate, decode against the copy bandwidth, both against torch."""
    c = d["ceilings"]
    head = _head(d, f"fp8 matmul {c['fp8_tflops']:.0f} TFLOP/s, bf16 {c['bf16_tflops']:.0f} TFLOP/s, copy "
                 f"{c['copy_gbps']:.0f} GB/s")
    pre = [[r["case"], _f(r["ms"], ".3f"), _f(r["tflops"], ".0f"), _pct(r["fraction"], ".1f"),
            _f(r["torch_ms"], ".1f"), _f(r["speedup"], ".1f")] for r in d["prefill"]]
    dec = [[r["case"], _f(r["ms"] * 1e3, ".0f"), _f(r.get("graph_ms", 0) * 1e3, ".0f"), _f(r["floor_ms"] * 1e3, ".0f"),
            _f(r["gbps"], ".0f"), _pct(r["fraction"], ".1f"), _decode_speedup(r)] for r in d["decode"]]
    return "\n\n".join([
        head,
        markdown_table(["prefill (mqa_logits)", "ms", "TFLOP/s (in-window)", "of matmul rate", "torch ms", "× torch"],
                       pre),
        markdown_table(["decode (paged_mqa_logits)", "eager µs", "graph µs", "floor µs", "GB/s (graph)", "of copy",
                        "× torch"], dec),
    ])


def logits_peers(d: dict) -> str:
    """bench/peers_gpu.py --only logits --variants: ours (the default kernel), the Triton kernel, DeepGEMM."""
    c = d["ceilings"]
    head = _head(d, f"DeepGEMM {d['peers']['DeepGEMM'].removeprefix('present ')}",
                 f"copy {c['copy_bandwidth'] / 1e9:.0f} GB/s, fp8 matmul {c['fp8_matmul'] / 1e12:.0f} TFLOP/s")
    rows = []
    for r in d["rows"]:
        us = r["us"]
        roof = next(k for k in r if k.startswith("ours_fraction_of_")).removeprefix("ours_fraction_of_")
        rows.append([r["case"], _f(us["ours"]), _f(us.get("ours triton")), _f(us["DeepGEMM"]),
                     _f(us.get("DeepGEMM schedule")), _f(r["ours_over_DeepGEMM"], ".2f"),
                     _pct(r["ours_fraction_of_" + roof], ".1f"),
                     _pct(r["DeepGEMM_fraction_of_" + roof], ".1f") + " " + roof.replace("_", " ")])
    return head + "\n\n" + markdown_table(
        ["case (H 64, D 128, fp8)", "ours µs", "Triton kernel µs", "DeepGEMM µs", "DeepGEMM's schedule µs",
         "ours / DeepGEMM", "ours, of roofline", "DeepGEMM, of roofline"], rows)


def producer_step(d: dict) -> str:
    """The producer step of decode (one op) against DeepGEMM's logits then FlashInfer's transform."""
    rows = []
    for r in d["rows"]:
        for graph, key in (("4 calls", "us"), ("1 call", "us_one_call_graphs")):
            us = r[key]
            rows.append([r["case"], graph, _f(us["step new"], ".2f"), _f(us["top-k new"], ".2f"),
                         _f(us["dg+fi"], ".2f"), _f(us["step new"] / us["dg+fi"], ".3f")])
    return _head(d, d["settings"]) + "\n\n" + markdown_table(
        ["case", "CUDA graph of", "ours µs", "its top-k alone µs", "DeepGEMM + FlashInfer µs", "ours / peers"], rows)


def producer_launches(d: dict) -> str:
    """The producer step launch by launch beside the peers' two kernels, and one long row's launches."""
    step, long = [], []
    for r in d["rows"]:
        us = r["us"]
        if "ours step" in us:
            step.append([r["case"], _f(us["ours step"]), _f(us["ours logits"]), _f(us["ours top-k"]),
                         f"{us['ours launch top-k rows']:.1f} / {us['ours launch top-k finish']:.1f}",
                         _f(us["fi transform on our logits"]), _f(us["dg logits"]), _f(us["dg+fi"])])
        else:
            long.append([r["case"], _f(us["ours"]), " / ".join(f"{us['ours launch ' + n]:.1f}" for n in r["launches"]),
                         _f(us["fi transform"]), _f(us["fi top_k"])])
    return "\n\n".join([
        _head(d, d["settings"]),
        markdown_table(["case", "our step µs", "our logits µs", "our top-k µs", "its rows launch / finishing launch "
                        "alone", "FlashInfer transform on our logits µs", "DeepGEMM logits µs",
                        "DeepGEMM + FlashInfer µs"], step),
        markdown_table(["one long row", "our topk_translate µs", "sample / filter / finish alone µs",
                        "FlashInfer transform µs", "FlashInfer top_k µs"], long),
    ])


def _peer(method: str) -> str:
    if method.startswith("sgl."):
        return "SGLang"
    mode = re.search(r"\[(.*)\]", method)
    return "FlashInfer " + (mode.group(1) if mode else "default")


def _best(methods: dict, fused: bool) -> tuple[str, float]:
    """The fastest peer method: FlashInfer's ``top_k_page_table_transform`` or SGLang's fused kernel (``fused``), else
    FlashInfer's ``top_k`` or SGLang's ``fast_topk_v2``; FlashInfer in any of its modes."""
    transform = ("fi.top_k_page_table_transform", "sgl.fast_topk_transform_fused")
    name = min((m for m in methods if m.startswith(("fi.", "sgl.")) and m.startswith(transform) == fused),
               key=lambda m: methods[m]["us"])
    return _peer(name), methods[name]["us"]


def topk_peers(d: dict) -> str:
    """The top-k peers harness: ours beside FlashInfer's and SGLang's top-k, plain and fused with the page transform."""
    rows = []
    for c in d["cases"]:
        m = c["methods"]
        read, torch_topk, topk, fused = (m[k]["us"] for k in ("read (sum)", "torch.topk", "ic.topk",
                                                              "ic.topk_translate"))
        (plain_name, plain), (fused_name, peer) = _best(m, fused=False), _best(m, fused=True)
        rows.append([c["case"], _f(read), _f(torch_topk), _f(topk), _f(topk / read, ".2f"),
                     _f(torch_topk / topk, ".2f"), f"{plain:.1f} ({plain_name})", _f(fused), _f(fused / topk, ".2f"),
                     f"{peer:.1f} ({fused_name})", _f(fused / peer, ".2f")])
    bad = sum(meth["bad_rows"] or 0 for c in d["cases"] for meth in c["methods"].values())
    return _head(d, f"FlashInfer {d['flashinfer']}", f"SGLang {d['sglang']}", d["settings"],
                 f"rows differing from torch.topk's picks: {bad}") + "\n\n" + markdown_table(
        ["case (k 2048 unless said)", "read once µs", "torch.topk µs", "topk µs", "× read",
         "× faster than torch.topk", "best plain peer µs", "topk_translate µs", "translate / topk",
         "best fused peer µs", "ours / fused peer"], rows)


def e2e(d: dict) -> str:
    """bench/e2e_gpu.py: the V3.2-shaped stack by index_topk_freq, the producer's overlap, allocations, small model."""
    layers = d["shapes"]["layers"]
    rows = []
    for s in d["scenarios"]:
        f = s["freqs"]
        rows.append([s["scenario"], f["1"]["mode"], *(_f(f[k]["median_ms"], ".3f") for k in ("1", "2", "4")),
                     _f(f["4"]["median_ms"] / f["1"]["median_ms"], ".3f")])
    ideal = d["scenarios"][0]["freqs"]["4"]["producers"]
    o, a, s = d["overlap"], d["allocator"], d["small_model"]
    cfg = s["config"]
    inductor = "equal to eager" if s["compiled_equal"] else \
        f"logits within {s['compiled_logits_max_abs_diff']:.3f} of eager"
    lines = [
        f"Overlap: the producer's indexer ({o['side_ms']:.3f} ms on a side stream) beside {o['main_ms']:.3f} ms of "
        f"main-stream GEMMs took {o['graph']['both_ms']:.3f} ms together in a CUDA graph "
        f"({100 * o['graph']['hidden_fraction']:.1f} % of the indexer hidden) and {o['eager']['both_ms']:.3f} ms eager "
        f"({100 * o['eager']['hidden_fraction']:.1f} %).",
        f"Allocations over {a['steps']} steady-state decode forwards: "
        f"{a['eager']['allocation.all.allocated']} eager, {a['graph']['allocation.all.allocated']} in a graph.",
        f"The small model ({cfg['layers']} layers, freq {cfg['freq']}, {cfg['requests']} × {cfg['context']}, top-k "
        f"{cfg['topk']}): eager {s['eager_ms']:.2f} ms; captured in a CUDA graph {s['graph_ms']:.2f} ms "
        f"({'equal to eager' if s['graph_equal'] else 'not equal to eager'}); compiled with Inductor "
        f"{s['compiled_ms']:.2f} ms ({inductor}).",
    ]
    return "\n\n".join([
        _head(d, f"{layers} sparse layers, H {d['shapes']['heads']}, D {d['shapes']['dim']}, k {d['shapes']['topk']}, "
              f"page {d['shapes']['page']}, {d['backend']} backend; median ms"),
        markdown_table(["scenario", "mode", "freq 1", "freq 2", "freq 4",
                        f"freq 4 / freq 1 (ideal {ideal}/{layers} = {ideal / layers:.3f})"], rows),
        *lines,
    ])


def _keys(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K"


def cp_topk(d: dict) -> str:
    """bench/cp_gpu.py: cp_topk over ranks against one GPU's top-k."""
    s = d["settings"]
    rows = [[_keys(r["keys"]), r["layout"], _f(r["single_topk_us"], ".0f"), _f(r["local_topk_us"], ".0f"),
             _f(r["all_gather_us"], ".0f"), _f(r["merge_us"], ".0f"), _f(r["cp_topk_us"], ".0f"),
             _f(r["local_logits_us"], ".0f"), _pct(r["comm_over_logits"], ".1f"),
             "yes" if r["equal"] else f"no ({r['mismatched_rows']} rows)"] for r in d["results"]]
    return _head(d, f"{d['world_size']} GPUs over {s['dist_backend'].upper()} {d['versions'].get('nccl', '')}".rstrip(),
                 f"{s['rows']} rows, k {s['k']}, {s['statistic']} of {s['reps']}") + "\n\n" + markdown_table(
        ["keys a row", "shards", "one GPU's topk µs", "local top-k µs", "all-gather µs", "merge µs", "cp_topk µs",
         "local logits µs", "gathered / logits bytes", "equals one GPU"], rows)


_FP4_GOALS = {"paged_mqa_logits": 0.6, "paged_topk_translate": 0.7, "mqa_logits": 1.1}  # issue 37's, MXFP4 / fp8


def fp4_decode(d: dict) -> str:
    """bench/fp4_decode_gpu.py: MXFP4 against fp8 keys, the decode step and a prefill chunk's logits."""
    torch_us = {(r["shape"], r["op"], r["format"]): r["us"] for r in d["rows"] if r["backend"] == "torch"}
    rows = []
    for r in d["ratios"]:
        if r["backend"] == "torch":  # the GPU backend's rows, the torch backend's beside them
            continue
        mine = torch_us.get((r["shape"], r["op"], "mxfp4"))
        rows.append([r["shape"], f"`{r['op']}`", _f(r["fp8_us"]), _f(r["mxfp4_us"]), _f(r["ratio"], ".3f"),
                     f"≤ {_FP4_GOALS[r['op']]}", _f(mine, ".0f") if mine else "—",
                     _f(r["mxfp4_us"] / mine, ".4f") if mine else "—"])
    s = d["shape"]
    torch_note = "torch: eager" if torch_us else "the torch backend not run"
    return _head(d, f"{s['batch']} requests, H {s['heads']}, D {s['dim']}, page {s['page']}, k {s['k']}, fp8 q e4m3fn; "
                 f"cuda: median of alternating CUDA-graph replays, {torch_note}") + "\n\n" + markdown_table(
        ["shape", "op", "fp8 µs", "MXFP4 µs", "MXFP4 / fp8", "goal", "torch MXFP4 µs", "cuda / torch (MXFP4)"], rows)


def fp4_recall(d: dict) -> str:
    """bench/fp4_recall.py: top-k recall of fp8 and MXFP4 keys (with fp8 or MXFP4 queries) against the float64 top-k
    (accuracy only)."""
    p = d["params"]
    rows = [[r["data"], r["keys"], _f(r["recall_mean"], ".4f"), _f(r["recall_min"], ".4f"), str(r["rows"])]
            for r in d["rows"]]
    return _head(d, f"{p['tokens']} rows × {p['seeds']} seeds, {p['keys']} keys, H {p['heads']}, D {p['dim']}, "
                 f"k {p['top']}") + "\n\n" + markdown_table(["data", "keys", "recall mean", "recall worst row", "rows"],
                                                             rows)


# Every file under benchmarks/results and the table it gives, in BENCHMARKS.md's order.
def prefill_producer(d: dict) -> str:
    """bench/prefill_producer_gpu.py: the prefill producer step in one op, at each scratch bound, beside our two ops
    and DeepGEMM + FlashInfer, and within 2 GiB at 1M keys."""
    gib = 1 << 30

    def mem(x):
        return _f(None if x is None else x / gib, ".2f")

    rows = [[r["case"], r["call"], _f(r["us"]), _f(r["over_two_ops"], ".3f"), _f(r["over_peers"], ".3f"),
             mem(r["scratch_bytes"])] for r in d["rows"]]
    m = d["million"]
    big = [[m["case"], mem(m["bound_bytes"]), mem(m["ours_scratch_bytes"]), _f(m["ours_us"] / 1e3),
            mem(m["two_ops_scratch_bytes"]), _f(m["two_ops_us"] / 1e3), _f(m["ours_over_two_ops"], ".3f"),
            "yes" if m["same_as_two_ops"] else "NO"]]
    return (_head(d, d["settings"]) + "\n\n"
            + markdown_table(["case", "call", "µs", "/ our two ops", "/ DeepGEMM + FlashInfer", "scratch GiB"], rows)
            + "\n\n" + markdown_table(["case", "bound GiB", "ours: scratch GiB", "ours ms", "two ops: scratch GiB",
                                        "two ops ms", "ours / two ops", "same selection"], big)
            + (_launch_sums(d["launches"]) if d.get("launches") else ""))


def _launch_sums(rows: list[dict]) -> str:
    """``--launches``: each call's eager launch times summed by kernel (its passes: the logits launches)."""
    kinds = {"logits": ("prefill_sm90_kernel", "mqa_logits_kernel"), "sample": ("topk_sample_kernel",),
             "top-k rows": ("topk_block_kernel", "topk_rows_kernel", "topk_filter_kernel"),
             "finish": ("topk_finish_kernel",)}
    calls = list(dict.fromkeys((r["case"], r["call"]) for r in rows))
    total = {key: next(r["us"] for r in rows if (r["case"], r["call"]) == key and r["launch"] == "all")
             for key in calls}
    table = []
    for case, call in calls:
        mine = [r for r in rows if (r["case"], r["call"]) == (case, call) and r["launch"] != "all"]
        sums = {kind: sum(r["us"] for r in mine if r["kernel"] in names) for kind, names in kinds.items()}
        table.append([case, call, str(sum(r["kernel"] in kinds["logits"] for r in mine)),
                      *(_f(v) for v in sums.values()), _f(total[case, call]),
                      _f(total[case, call] / total[case, "ours, two ops"], ".3f")])
    return "\n\n" + markdown_table(["case", "call (eager, each launch timed)", "passes", "logits µs", "sample µs",
                                     "top-k rows µs", "finish µs", "all µs", "/ our two ops"], table)


def short_rows(d: dict) -> str:
    """bench/short_rows_gpu.py: the decode producer step on batches of short rows, beside our two ops and translate;
    the prefill producer step on chunks of short prompts and a long one, beside its two ops."""
    p = d["shape"]
    rows = [[r["batch"], str(r["max_context_len"]), _f(r["step_us"], ".2f"), _f(r["two_ops_us"], ".2f"),
             _f(r["step_per_two_ops"], ".3f"), _f(r.get("translate_us"), ".2f"), _f(r.get("step_per_translate"), ".3f")]
            for r in d["rows"]]
    prefill = [[r["chunk"], str(r["tokens"]), _keys(r["keys"]) if r["keys"] % 1024 == 0 else str(r["keys"]),
                _f(r["step_us"]), _f(r["two_ops_us"]), _f(r["step_per_two_ops"], ".3f")] for r in d["prefill_rows"]]
    return (_head(d, f"{p['requests']} requests, short contexts {p['short_contexts'][0]}-{p['short_contexts'][1]}, "
                     f"long {p['long_context']}, H {p['heads']}, k {p['k']}, page {p['page']}, graph µs")
            + "\n\n" + markdown_table(["batch", "max_context_len", "step µs", "two ops µs", "step / two ops",
                                        "translate µs", "step / translate"], rows)
            + "\n\n" + markdown_table(["prefill chunk", "queries", "keys", "step µs", "two ops µs", "step / two ops"],
                                       prefill))


def ragged(d: dict) -> str:
    """bench/ragged_gpu.py: ragged verify rows against the uniform next_n call at the same rows."""
    p = d["shape"]
    rows = [[r["op"], _f(r["uniform_us"]), _f(r["ragged_us"]), _f(r["ratio"], ".3f")] for r in d["rows"]]
    return (_head(d, f"{p['requests']} × {_keys(p['context'])} keys, next_n {p['next_n']}, H {p['heads']}, "
                     f"k {p['k']}, graph µs")
            + "\n\n" + markdown_table(["op", "uniform µs", "ragged µs", "ragged / uniform"], rows))


def hisparse(d: dict) -> str:
    """bench/hisparse_gpu.py: a step's plan and one layer's swap-in against the host link; the 61-layer step at
    index_topk_freq 1 and 4, and its plans alone."""
    p = d["shape"]
    rows = [[r["what"], _f(r["us"]), _f(r.get("misses")), _f(r.get("gb_per_s"), ".2f"), _f(r.get("of_h2d"), ".3f"),
             _f(r.get("plans_us"))] for r in d["rows"]]
    ratios = ", ".join(f"{name.replace('_', ' ')} {value:.3f}" for name, value in d["ratios"].items())
    return (_head(d, f"{p['requests']} requests × {_keys(p['context'])} tokens, k {p['k']}, H {p['hot']}, "
                     f"{p['row_bytes']}-byte KV rows, a ring of {p['ring']} selections drifting by {p['drift']}, "
                     "graph µs")
            + "\n\n" + markdown_table(["what", "µs", "misses a step", "GB/s", "of the link", "its plans µs"], rows)
            + f"\n\n{ratios}")


def hisparse_swap(d: dict) -> str:
    """bench/hisparse_swap_gpu.py: the swap-in kernel reading pinned host memory against the copy engine's path."""
    p, link = d["shape"], d["link"]
    rows = [[str(r["misses"]), str(r["copies"]), _f(r["kernel_us"]), _f(r["kernel_gbps"], ".2f"),
             _f(r["kernel_of_link"], ".3f"), _f(r["engine_us"]), _f(r["engine_over_kernel"], ".1f")] for r in d["rows"]]
    return (_head(d, f"{p['requests']} requests × {_keys(p['context'])} tokens of {p['row_bytes']} bytes pinned, "
                     f"host link {link['gbps']:.2f} GB/s, kernel tuning "
                     + ", ".join(f"{k} {v}" if v != "" else f"{k} default" for k, v in d["tuning"].items())
                     + ", kernel graph µs, engine eager")
            + "\n\n" + markdown_table(["misses a request", "copies", "kernel µs", "GB/s", "of the link",
                                        "copy engine µs", "engine / kernel"], rows))


def _mode(m: dict | None) -> str:
    return "—" if m is None else f"{m['us']:.1f} ({m['hidden']:+.0%}, {m['vs_serial']:.3f}×)"


def _ratio(m: dict | None) -> str:
    """A mode's × in order, with its paired ratio where measured (eager runs since bec827e)."""
    if m is None:
        return "—"
    return f"{m['vs_serial']:.3f}×" + (f" ({m['vs_serial_paired']:.3f}×)" if "vs_serial_paired" in m else "")


def _choice(r: dict, key: str) -> str:
    if key not in r:
        return "—"
    n = r[key]
    return "no share" if n is None else "in order" if n == 0 else f"{n} SMs"


def overlap(d: dict) -> str:
    """bench/overlap_gpu.py: the producer's indexer on a side stream beside a V3.2 layer's main-stream work: alone,
    in order, overlapped with no budget, under the best side budget, and as the rule chooses; µs (the indexer's time
    hidden, × in order); eagerly the rule decided once (its schedule) and at every call, and the in-order step timed
    again, × in order (paired: the median of each round's ratio, where measured)."""
    rows = []
    for r in d["rows"]:
        if "error" in r:
            continue
        g, e = r["graph"], r["eager"]
        budgeted = {name: m for name, m in g["modes"].items() if name.startswith("overlap@")}
        best = min(budgeted, key=lambda name: budgeted[name]["us"])
        rows.append([f"{r['phase']} {r['tokens']} × {_keys(r['context'])}", _f(g["side_us"]), _f(g["main_us"]),
                     _f(g["serial_us"]), _mode(g["modes"]["overlap"]), f"{best.split('@')[1]}: {_mode(budgeted[best])}",
                     _choice(r, "rule_budget"), _mode(g["modes"].get("rule")), _f(e["serial_us"]),
                     _mode(e["modes"]["overlap"]), _choice(r, "rule_budget_eager"), _mode(e["modes"].get("rule")),
                     _ratio(e["modes"].get("rule")), _ratio(e["modes"].get("rule per call")),
                     _ratio(e["modes"].get("in order again"))])
    shares = "SM partitions (green contexts)" if d.get("partitions") else "SM budgets"
    return (_head(d, f"{d['rows'][0]['sms']} SMs, side shares {d['rows'][0]['budgets']} as {shares}, bf16 layer "
                     f"weights, BLAS {d.get('blas') or 'torch default'}")
            + "\n\n" + markdown_table(["shape", "side µs", "main µs", "in order µs", "overlap", "best share",
                                        "rule (graph)", "rule µs", "eager in order µs", "eager overlap",
                                        "rule (eager)", "eager rule µs", "eager rule ×", "eager rule per call ×",
                                        "eager in order again ×"], rows))


def coldstart(d: dict) -> str:
    """bench/coldstart_gpu.py: the serving sweep's compiles and first calls, cold, after ``indexcache warmup``, and
    DeepGEMM's JIT over the same shapes."""
    rows = []
    for phase in ("cold", "warm", "deepgemm"):
        r = d.get(phase)
        if r is None or "error" in r or "absent" in r:
            why = (r.get("error") or f"absent: {r.get('absent')}") if r else "not run"
            rows.append([phase] + ["—"] * 6 + [why, "—"])
            continue
        shapes = [s for s in r["shapes"] if "first_over_steady" in s]
        ratios = [s["first_over_steady"] for s in shapes]
        worst = max(shapes, key=lambda s: s["first_over_steady"])
        compiled = sum(s.get("compiled", s.get("cache_files_added", 0)) for s in r["shapes"])
        warm = r.get("warmup")
        new = [s["first_over_new_buffers"] for s in shapes if "first_over_new_buffers" in s]
        rows.append([phase, str(len(r["shapes"])), f"{compiled} {'JIT files' if phase == 'deepgemm' else 'kernels'}",
                     "—" if warm is None else f"{warm['seconds']:.1f} s ({warm['variants']} variants)",
                     _f(r.get("sweep_seconds")), _f(statistics.median(ratios), ".2f"),
                     _f(statistics.median(new), ".2f") if new else "—",
                     f"{worst['first_ms']:.2f} ms, {worst['first_over_steady']:.1f}× ({worst['kind']} "
                     f"{' × '.join(map(str, worst['shape']))})",
                     f"{sum(x <= 2 for x in ratios)} of {len(ratios)}"])
    return (_head(d, f"{d['cpus']} cores, " + ("first calls right after their inputs" if d.get("cold_host") else
                                               "first calls after three steps of the shape before"))
            + "\n\n" + markdown_table(["phase", "shapes", "compiled", "warmup", "sweep s", "first / steady, median",
                                        "first / new buffers, median", "worst first call (or why none)",
                                        "first ≤ 2× steady"], rows))


TABLES: dict[str, Callable[[dict], str]] = {
    "h200-translate.json": bench_op,
    "h200-launch-overhead.json": launch_overhead,
    "h200-coldstart.json": coldstart,
    "h100-coldstart.json": coldstart,
    "h200-logits.json": logits,
    "h200-logits-vs-deepgemm.json": logits_peers,
    "h200-producer-step.json": producer_step,
    "h200-producer-step-launches.json": producer_launches,
    "h200-prefill-producer.json": prefill_producer,
    "h100-prefill-producer.json": prefill_producer,
    "h200-paged-topk-translate.json": bench_op,
    "h200-short-rows.json": short_rows,
    "h200-ragged.json": ragged,
    "h200-hisparse.json": hisparse,
    "h200-hisparse-swap.json": hisparse_swap,
    "h100-hisparse.json": hisparse,
    "h100-hisparse-swap.json": hisparse_swap,
    "h200-topk-vs-peers.json": topk_peers,
    "h200-e2e.json": e2e,
    "h200-overlap.json": overlap,
    "h100-overlap.json": overlap,
    "h100-overlap-decode.json": overlap,
    "h200x2-cp-topk.json": cp_topk,
    "cpu-fp4-recall.json": fp4_recall,
    "h200-fp4-decode.json": fp4_decode,
    "h100-fp4-decode.json": fp4_decode,
}


def table(name: str, results: Path = RESULTS) -> str:
    """The Markdown of result file ``name`` (a key of :data:`TABLES`)."""
    return TABLES[name](json.loads((results / name).read_text()))


def rewrite(text: str, results: Path = RESULTS) -> str:
    """``text`` (BENCHMARKS.md) with every table block printed afresh; a block naming no known file is an error."""
    def block(m: re.Match) -> str:
        if m.group(1) not in TABLES:
            raise SystemExit(f"BENCHMARKS.md: table {m.group(1)!r} is not one of {sorted(TABLES)}")
        return f"<!-- table {m.group(1)} -->\n{table(m.group(1), results)}\n<!-- end table -->"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 where BENCHMARKS.md's tables differ from the JSON")
    mode.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's tables from the JSON")
    args = parser.parse_args(argv)
    if not (args.check or args.write):
        for name in TABLES:
            print(f"<!-- table {name} -->\n{table(name)}\n<!-- end table -->\n")
        return 0
    text = BENCHMARKS.read_text()
    found = [m.group(1) for m in BLOCK.finditer(text)]
    missing = [n for n in TABLES if found.count(n) != 1]
    if missing:
        print(f"BENCHMARKS.md: each table once; not so for {missing}", file=sys.stderr)
        return 1
    new = rewrite(text)
    if args.write:
        BENCHMARKS.write_text(new)
        return 0
    pairs = zip(BLOCK.finditer(text), BLOCK.finditer(new), strict=True)
    stale = [m.group(1) for m, n in pairs if m.group(2) != n.group(2)]
    if stale:
        print(f"BENCHMARKS.md differs from benchmarks/results/ in {stale}: python bench/report_tables.py --write",
              file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
