"""Ours beside the kernels engines run today, on the same inputs, on one GPU (issues 17 and 18).

    python bench/peers_gpu.py --out out/peers.json     # ci/gpu.sh: the "peers" part

Peers are never dependencies: each is imported if it can be and reported "absent" (with the import error)
otherwise. ``ci/gpu.sh`` installs DeepGEMM from wheels in ``$PEER_WHEELS`` when that folder is given.

- DeepGEMM (``deep_gemm``): ``fp8_mqa_logits`` against :func:`indexcache.mqa_logits` (prefill 4096 queries
  over 32K keys, causal and full windows, H 64, D 128, fp8) and ``fp8_paged_mqa_logits`` against
  :func:`indexcache.paged_mqa_logits` (decode 64 × 32K and 128K, next_n 1 and 2, page 64), with its schedule
  (``get_paged_mqa_logits_metadata``, once a step in an engine) timed on its own and added in a second ratio.
- FlashInfer (``flashinfer``): ``top_k_page_table_transform`` against :func:`indexcache.topk_translate` with a
  token-level table (page 1, each row's table a random permutation), ``top_k`` against :func:`indexcache.topk`.
- SGLang (``sgl_kernel``): ``fast_topk_transform_fused`` against the same ``topk_translate`` (k 2048 only).
- The producer step of decode: :func:`indexcache.paged_topk_translate` (64 × 32K and 128K, next_n 1, k 2048,
  a token-level table) against DeepGEMM's ``fp8_paged_mqa_logits`` then FlashInfer's ``top_k_page_table_transform``,
  when both import; ours as two ops (``paged_mqa_logits`` then ``topk_translate``) beside it.

With ``--variants`` each logits case also races our kernel under the tuning overrides of ``VARIANTS`` (called
through the cuda backend's kernel function, each checked against the op first): how a tuning change is chosen,
beside the same peer.

Every contender of a case is first checked against ours (logits: the same -inf placement and relative RMS error
over the visible entries; top-k: per row the same multiset of selected scores, and for the fused forms the
same translated slots) and only then timed: each contender's CUDA graph of ``calls`` back-to-back calls is
replayed in turn, the order reversed every other round (the card is power-capped: never one after the
other), median µs a call. Copy bandwidth and the fp8 matmul rate are measured in the same run. Off a GPU
(``--smoke``, tiny shapes) the peers are absent and the host clock times ours: no figure means anything then.
Prints a table; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import indexcache
from indexcache.bench.ceilings import CEILINGS
from indexcache.bench.output import write_json
from indexcache.bench.provenance import checkout_commit, device_name, now, versions
from indexcache.bench.timing import Timer, capture_graph, on_gpu
from indexcache.hal.layout import new_packed_cache, split_packed_cache

PEERS = {"deep_gemm": "DeepGEMM", "flashinfer": "FlashInfer", "sgl_kernel": "SGLang"}
FP8 = torch.float8_e4m3fn
HEADS, DIM, PAGE = 64, 128, 64
TOKEN_BYTES = DIM + 4  # a cached token: D fp8 bytes and a float32 scale
# Overrides of the cuda table's logits entries raced beside it (--variants): the Triton kernels where the table takes
# the Hopper kernels in Gluon (sm90 with Triton 3.6), and those with another ring (decode 5 stages, prefill 8). Raced
# before and removed (docs/experiments.md): register caps and shallower pipelines of the Triton decode, tiles through
# TMA host descriptors, the scales read one tile ahead by hand, the scales staged by a loop-level pipeline, one dot a
# draft token in the Triton kernel, a Gluon decode whose math warps issue the copies, a Gluon decode with four math
# warp groups a program (DeepGEMM's arrangement); a 4-stage Triton prefill (within 1 %), Gluon prefills with one math
# warp group a program.
VARIANTS = {
    "mqa_logits": {
        "triton": {"KERNEL": "triton"},
        "tma-ws 2 stages": {"KERNEL": "tma-ws", "TMA_STAGES": 2},
    },
    "paged_mqa_logits": {
        "triton": {"KERNEL": "triton"},
        "tma-ws 5 stages": {"KERNEL": "tma-ws", "TMA_STAGES": 5},
    },
}


def size(n: int) -> str:
    """``32K``, ``1M``, or the count itself when small."""
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" if n >= 1024 else str(n)


def load_peers() -> tuple[dict[str, Any], dict[str, str]]:
    """``(modules, status)``: the peers that import, and per peer "present <version>" or "absent: <why>"."""
    found, status = {}, {}
    for name, label in PEERS.items():
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # any failure to load a peer (missing, wrong torch, missing .so) is "absent"
            status[label] = f"absent: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            continue
        found[name] = module
        status[label] = f"present {getattr(module, '__version__', '(no version)')}"
    return found, status


def as_torch(x: Any) -> torch.Tensor:
    """A peer's output as a torch tensor (DeepGEMM may return a DLPack-capable tensor of its own)."""
    return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


def race_us(fns: dict[str, Callable[[], Any]], dev: torch.device, calls: int, rounds: int) -> dict[str, float]:
    """Median µs a call of each function: on a GPU, one CUDA graph of ``calls`` calls per function, replayed in
    turn for ``rounds`` rounds, the order reversed every other round; off a GPU, the host clock, alternating."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    if on_gpu(dev):
        graphs = {name: capture_graph(lambda fn=fn: [fn() for _ in range(calls)], dev) for name, fn in fns.items()}
        for graph in graphs.values():
            graph.replay()
        for r in range(rounds):
            for name in (list(graphs) if r % 2 == 0 else list(reversed(graphs))):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs[name].replay()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) * 1e3 / calls)
        return {name: statistics.median(times) for name, times in samples.items()}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append((time.perf_counter() - t0) * 1e6)
    return {name: statistics.median(times) for name, times in samples.items()}


def attempt(row: dict, key: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None with ``row[key]`` set to the error (a peer's failure is reported, never fatal)."""
    try:
        return fn()
    except Exception as exc:  # a peer kernel that rejects an input or fails to build
        row[key] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None


# ----------------------------------------------------------------------------------------------- logits


def logits_agreement(got: torch.Tensor, ours: torch.Tensor, visible: torch.Tensor) -> dict[str, Any]:
    """Relative RMS difference over the visible entries and whether -inf lies where ours has it there."""
    g, o = got[visible].double(), ours[visible].double()
    finite = torch.isfinite(o)
    rms = float((g[finite] - o[finite]).pow(2).mean().sqrt() / o[finite].pow(2).mean().sqrt().clamp_min(1e-30))
    return {"relative_rms": rms, "same_non_finite": bool(torch.equal(torch.isfinite(g), finite)),
            "agrees": rms <= 1e-3 and bool(torch.equal(torch.isfinite(g), finite))}


def prefill_case(dg: Any, dev: torch.device, tokens: int, keys: int, causal: bool, ceil: dict, rounds: int,
                 variants: bool = False) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    k8, scale = indexcache.quantize_index_k(torch.randn(keys, DIM, device=dev, generator=gen), FP8)
    scale = scale[:, 0].contiguous()
    q = (torch.randn(tokens, HEADS, DIM, device=dev, generator=gen) * 24).clamp(-400, 400).to(FP8)
    w = torch.randn(tokens, HEADS, device=dev, generator=gen) * HEADS**-0.5
    t = torch.arange(tokens, device=dev, dtype=torch.int32)
    ks = torch.zeros(tokens, device=dev, dtype=torch.int32)
    ke = (keys - tokens + 1 + t).int() if causal else torch.full_like(t, keys)
    out = torch.empty(tokens, keys, device=dev)
    pairs = int((ke - ks).clamp_min(0).sum())
    row: dict = {"op": "mqa_logits", "case": f"prefill {tokens} x {size(keys)} {'causal' if causal else 'full'}",
                 "flops": 2 * HEADS * DIM * pairs}
    fns = {"ours": lambda: indexcache.mqa_logits(q, k8, scale, w, ks, ke, out=out)}
    fns["ours"]()
    if variants:
        fns.update(kernel_variants("mqa_logits", (q, k8, scale, w, ks, ke), out, row))
    if dg is not None:
        visible = torch.arange(keys, device=dev)[None, :] < ke[:, None]

        def deepgemm():
            return dg.fp8_mqa_logits(q, (k8, scale), w, ks, ke, True)

        got = attempt(row, "DeepGEMM", lambda: as_torch(deepgemm()))
        if got is not None:
            row["DeepGEMM_agreement"] = logits_agreement(got, out, visible)
            if row["DeepGEMM_agreement"]["agrees"]:
                fns["DeepGEMM"] = deepgemm
    row["us"] = race_us(fns, dev, calls=3, rounds=rounds)
    for name, us in row["us"].items():
        if ceil["fp8_matmul"]:
            row[f"{name}_fraction_of_fp8_matmul"] = row["flops"] / (us * 1e-6) / ceil["fp8_matmul"]
    if "DeepGEMM" in row["us"]:
        row["ours_over_DeepGEMM"] = row["us"]["ours"] / row["us"]["DeepGEMM"]
    return row


def kernel_variants(op: str, args: tuple, want: torch.Tensor, row: dict) -> dict[str, Callable[[], Any]]:
    """Our kernel for ``op`` under each of ``VARIANTS[op]``, checked against the op's output ``want`` first (within
    1e-5 relative, -inf in the same places: off a GPU the op may be the torch backend's)."""
    from indexcache.backends.cuda import tuning
    from indexcache.backends.cuda.arch import NVIDIA
    from indexcache.backends.triton import logits
    from indexcache.backends.triton.target import detect

    _, reason, target = detect(NVIDIA)
    if target is None:  # off a GPU without the interpreter: nothing to race
        row["variants"] = f"not raced: {reason}"
        return {}
    base, kernel = tuning(target.arch)[op], getattr(logits, op)
    fns = {}
    for name, override in VARIANTS[op].items():
        cfg, out = {**base, **override}, torch.empty_like(want)

        def run(cfg=cfg, out=out):
            return kernel(*args, out, target=target, cfg=cfg)

        if attempt(row, f"ours {name}", run) is not None:
            row[f"ours {name} agrees"] = bool(torch.allclose(out, want, rtol=1e-5, atol=1e-6, equal_nan=True))
            if row[f"ours {name} agrees"]:
                fns[f"ours {name}"] = run
    return fns


def decode_inputs(dev: torch.device, batch: int, context: int, next_n: int) -> tuple:
    """``(q, cache, weights, lens, table, seen)``: random fp8 keys in pages of 64 (a random permutation of the
    cache's pages as the table), every request ``context`` keys long; ``seen [batch, next_n]``: the keys each row
    sees (row j of request b sees keys < lens[b] - next_n + 1 + j, the contract of ours and DeepGEMM's)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    per_request = -(-context // PAGE)
    cache = new_packed_cache(batch * per_request, PAGE, DIM, device=dev)
    keys, scales = split_packed_cache(cache, DIM, FP8)
    keys.copy_((torch.randn(keys.shape, device=dev, generator=gen, dtype=torch.bfloat16) * 40).to(FP8))
    scales.copy_(torch.rand(scales.shape, device=dev, generator=gen) * 0.01 + 1e-3)
    table = torch.randperm(batch * per_request, device=dev, generator=gen, dtype=torch.int32).view(batch, per_request)
    lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    q = (torch.randn(batch, next_n, HEADS, DIM, device=dev, generator=gen) * 24).clamp(-400, 400).to(FP8)
    w = torch.randn(batch * next_n, HEADS, device=dev, generator=gen) * HEADS**-0.5
    seen = (lens[:, None] - next_n + 1 + torch.arange(next_n, device=dev, dtype=torch.int32)[None, :]).int()
    return q, cache, w, lens, table, seen


def decode_case(dg: Any, dev: torch.device, batch: int, context: int, next_n: int, ceil: dict, rounds: int,
                variants: bool = False) -> dict:
    q, cache, w, lens, table, seen = decode_inputs(dev, batch, context, next_n)
    out = torch.empty(batch * next_n, context, device=dev)
    moved = TOKEN_BYTES * batch * context + 4 * out.numel()
    row: dict = {"op": "paged_mqa_logits", "case": f"decode {batch} x {size(context)} next_n={next_n}",
                 "bytes": moved}
    fns = {"ours": lambda: indexcache.paged_mqa_logits(q, cache, w, lens, table, context, out=out)}
    fns["ours"]()
    if variants:
        fns.update(kernel_variants("paged_mqa_logits", (q, cache, w, lens, table, context), out, row))
    if dg is not None:
        visible = torch.arange(context, device=dev)[None, :] < seen.reshape(-1)[:, None]
        pages = cache.view(cache.shape[0], PAGE, 1, TOKEN_BYTES)
        sms = int(dg.get_num_sms())
        schedule = attempt(row, "DeepGEMM", lambda: as_torch(dg.get_paged_mqa_logits_metadata(seen, PAGE, sms)))
        if schedule is not None:
            def deepgemm():
                return dg.fp8_paged_mqa_logits(q, pages, w, seen, table, schedule, context, False)

            got = attempt(row, "DeepGEMM", lambda: as_torch(deepgemm()))
            if got is not None:
                row["DeepGEMM_agreement"] = logits_agreement(got, out, visible)
                if row["DeepGEMM_agreement"]["agrees"]:
                    fns["DeepGEMM"] = deepgemm
                    fns["DeepGEMM schedule"] = lambda: dg.get_paged_mqa_logits_metadata(seen, PAGE, sms)
    row["us"] = race_us(fns, dev, calls=8, rounds=rounds)
    for name in row["us"]:
        if name != "DeepGEMM schedule" and ceil["copy_bandwidth"]:
            row[f"{name}_fraction_of_copy"] = moved / (row["us"][name] * 1e-6) / ceil["copy_bandwidth"]
    if "DeepGEMM" in row["us"]:
        row["ours_over_DeepGEMM"] = row["us"]["ours"] / row["us"]["DeepGEMM"]
        row["ours_over_DeepGEMM_with_schedule"] = row["us"]["ours"] / (row["us"]["DeepGEMM"]
                                                                      + row["us"]["DeepGEMM schedule"])
    return row


# ----------------------------------------------------------------------------------------------- top-k


def selected_scores(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per row the selected scores, sorted descending (-1 slots as -inf): equal for any exact top-k."""
    picked = torch.where(idx >= 0, scores.gather(1, idx.clamp_min(0).long()), float("-inf"))
    return picked.sort(dim=1, descending=True).values


def token_table(rows: int, cols: int, gen: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, Callable]:
    """A token-level table (page 1), each row's own random permutation of the row's positions offset by the row,
    and the function taking translated slots back to positions (-1 stays)."""
    perm = torch.argsort(torch.rand(rows, cols, device=dev, generator=gen), dim=1).int()
    table = (perm + torch.arange(rows, device=dev, dtype=torch.int32)[:, None] * cols).contiguous()
    inverse = torch.argsort(perm, dim=1).int()
    offsets = torch.arange(rows, device=dev, dtype=torch.int32)[:, None] * cols

    def positions(slots: torch.Tensor) -> torch.Tensor:
        local = (slots - offsets).clamp(0, cols - 1).long()
        return torch.where(slots >= 0, inverse.gather(1, local), -1)

    return table, positions


def topk_case(peers: dict, dev: torch.device, rows: int, cols: int, k: int, label: str, causal: bool,
              ties: bool, rounds: int) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    scores = torch.randn(rows, cols, device=dev, generator=gen)
    if ties:
        scores = scores.bfloat16().float()  # bf16-rounded: many exact ties
    lengths = (cols - rows + 1 + torch.arange(rows, device=dev)).int() if causal else \
        torch.full((rows,), cols, device=dev, dtype=torch.int32)
    table, positions = token_table(rows, cols, gen, dev)
    out, out_plain = torch.empty(rows, k, device=dev, dtype=torch.int32), torch.empty(rows, k, device=dev,
                                                                                      dtype=torch.int32)
    row: dict = {"op": "topk_translate", "case": label, "read_once_bytes": scores.numel() * 4}
    fused = {"ours": lambda: indexcache.topk_translate(scores, lengths, k, table, 1, out=out)}
    plain = {"ours topk": lambda: indexcache.topk(scores, lengths, k, out=out_plain)}
    fused["ours"]()
    plain["ours topk"]()
    want = selected_scores(scores, out_plain)
    row["ours_fused_agrees"] = bool(torch.equal(selected_scores(scores, positions(out)), want))
    fi, sg = peers.get("flashinfer"), peers.get("sgl_kernel")
    if fi is not None:
        got = attempt(row, "FlashInfer fused", lambda: fi.top_k_page_table_transform(scores, table, lengths, k))
        if got is not None:
            row["FlashInfer fused agrees"] = bool(torch.equal(selected_scores(scores, positions(got)), want))
            if row["FlashInfer fused agrees"]:
                fused["FlashInfer fused"] = lambda: fi.top_k_page_table_transform(scores, table, lengths, k)
    if fi is not None and not causal:  # top_k takes no lengths: whole rows only
        got = attempt(row, "FlashInfer top_k", lambda: fi.top_k(scores, k)[1])
        if got is not None:
            row["FlashInfer top_k agrees"] = bool(torch.equal(selected_scores(scores, got), want))
            if row["FlashInfer top_k agrees"]:
                plain["FlashInfer top_k"] = lambda: fi.top_k(scores, k)
    if sg is not None and k == 2048:
        dst = torch.empty(rows, k, device=dev, dtype=torch.int32)
        starts = torch.arange(rows + 1, device=dev, dtype=torch.int32)  # one query row a request

        def sglang():
            return sg.fast_topk_transform_fused(scores, lengths, dst, table, starts)

        if attempt(row, "SGLang fused", lambda: sglang() or True):
            row["SGLang fused agrees"] = bool(torch.equal(selected_scores(scores, positions(dst)), want))
            if row["SGLang fused agrees"]:
                fused["SGLang fused"] = sglang
    plain["torch.topk"] = lambda: torch.topk(scores, k, dim=1)
    row["us"] = race_us({**fused, **plain}, dev, calls=4, rounds=rounds)
    peer_fused = [row["us"][name] for name in fused if name != "ours"]
    if peer_fused:
        row["ours_over_best_fused_peer"] = row["us"]["ours"] / min(peer_fused)
    return row


def topk_cases(quick: bool) -> list[tuple]:
    """``(rows, cols, k, label, causal lengths, bf16 ties)``: issue 18's table."""
    if quick:
        return [(4, 4096, 64, "decode 4 x 4K k64", False, False), (8, 2048, 64, "prefill 8 x 2K causal", True, False)]
    return [(64, 32768, 2048, "decode 64 x 32K", False, False), (64, 131072, 2048, "decode 64 x 128K", False, False),
            (64, 131072, 512, "decode 64 x 128K k512", False, False),
            (64, 131072, 2048, "decode 64 x 128K bf16 ties", False, True),
            (2048, 32768, 2048, "prefill 2048 x 32K causal", True, False), (1, 131072, 2048, "1 x 128K", False, False),
            (1, 1 << 20, 2048, "1 x 1M", False, False)]


# ----------------------------------------------------------------------------------------------- producer step


def producer_case(peers: dict, dev: torch.device, batch: int, context: int, k: int, rounds: int) -> dict:
    """The producer step of decode (next_n 1): ours in one op (:func:`indexcache.paged_topk_translate`) and as its
    two ops, beside DeepGEMM's logits then FlashInfer's ``top_k_page_table_transform`` (when both import), through a
    token-level table. Each checked first: the selected logits equal the best ones of the logits it computed."""
    q, cache, w, lens, blocks, seen = decode_inputs(dev, batch, context, 1)
    table, positions = token_table(batch, context, torch.Generator(device=dev).manual_seed(1), dev)
    logits, logits2 = torch.empty(batch, context, device=dev), torch.empty(batch, context, device=dev)
    out, out2 = torch.empty(batch, k, device=dev, dtype=torch.int32), torch.empty(batch, k, device=dev,
                                                                                   dtype=torch.int32)
    row: dict = {"op": "paged_topk_translate", "case": f"decode {batch} x {size(context)} k{k}"}

    def ours_unfused():
        indexcache.paged_mqa_logits(q, cache, w, lens, blocks, context, out=logits2)
        indexcache.topk_translate(logits2, lens, k, table, 1, out=out2)

    fns = {"ours": lambda: indexcache.paged_topk_translate(q, cache, w, lens, blocks, context, k, table, 1,
                                                           logits=logits, out=out),
           "ours, two ops": ours_unfused}
    for fn in fns.values():
        fn()
    best = selected_scores(logits, indexcache.topk(logits, lens, k, backend="torch"))
    row["ours_agrees"] = bool(torch.equal(selected_scores(logits, positions(out)), best))
    dg, fi = peers.get("deep_gemm"), peers.get("flashinfer")
    if dg is not None and fi is not None:
        pages = cache.view(cache.shape[0], PAGE, 1, TOKEN_BYTES)
        schedule = attempt(row, "DeepGEMM", lambda: as_torch(dg.get_paged_mqa_logits_metadata(seen, PAGE,
                                                                                              int(dg.get_num_sms()))))

        def peer():
            scores = dg.fp8_paged_mqa_logits(q, pages, w, seen, blocks, schedule, context, False)
            return scores, fi.top_k_page_table_transform(as_torch(scores), table, lens, k)

        got = attempt(row, "DeepGEMM + FlashInfer", peer) if schedule is not None else None
        if got is not None:
            scores = as_torch(got[0])
            row["DeepGEMM + FlashInfer agrees"] = bool(torch.equal(
                selected_scores(scores, positions(got[1])),
                selected_scores(scores, indexcache.topk(scores, lens, k, backend="torch"))))
            if row["DeepGEMM + FlashInfer agrees"]:
                fns["DeepGEMM + FlashInfer"] = peer
    row["us"] = race_us(fns, dev, calls=4, rounds=rounds)
    if "DeepGEMM + FlashInfer" in row["us"]:
        row["ours_over_best_fused_peer"] = row["us"]["ours"] / row["us"]["DeepGEMM + FlashInfer"]
    return row


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device: checks the script itself")
    parser.add_argument("--rounds", type=int, default=30, help="replay rounds a case (default 30)")
    parser.add_argument("--variants", action="store_true",
                        help="also race our logits kernels under each tuning override of VARIANTS")
    parser.add_argument("--only", choices=("logits", "topk", "producer"), help="run one family of cases")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU visible: this script compares GPU kernels (pass --smoke to check it on tiny CPU shapes)")
        return 2
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peers, status = load_peers()
    rounds = 3 if args.smoke else args.rounds
    timer = Timer(dev, warmup=3, reps=10, graph_reps=10)
    ceil = {}
    for name in ("copy_bandwidth", "fp8_matmul"):
        try:
            ceil[name] = CEILINGS[name].measure(timer, args.smoke)[0]
        except Exception as exc:  # e.g. no fp8 matmul on this device: the fractions are left out
            ceil[name] = None
            print(f"ceiling {name} not measured: {type(exc).__name__}: {exc}")
    report: dict = {"schema": "indexcache-peers/1", "date": now(), "device": device_name(dev) or "cpu",
                    "commit": checkout_commit(), **versions(), "peers": status, "ceilings": ceil, "rows": [],
                    "errors": {}}
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  "
          + "  ".join(f"{label}: {state}" for label, state in status.items()))
    dg = peers.get("deep_gemm")
    smoke = args.smoke
    cases: list[tuple[str, Callable[[], dict]]] = []
    for causal in (True, False) if args.only in (None, "logits") else ():
        shape = (64, 256) if smoke else (4096, 32768)
        cases.append((f"prefill {causal}", lambda c=causal, s=shape: prefill_case(dg, dev, *s, c, ceil, rounds,
                                                                                  args.variants)))
    for context in ((256,) if smoke else (32768, 131072)) if args.only in (None, "logits") else ():
        for next_n in (1, 2):
            cases.append((f"decode {context} {next_n}", lambda c=context, n=next_n: decode_case(
                dg, dev, 2 if smoke else 64, c, n, ceil, rounds, args.variants)))
    for rows, cols, k, label, causal, ties in topk_cases(smoke) if args.only in (None, "topk") else ():
        cases.append((label, lambda r=rows, c=cols, k=k, lb=label, ca=causal, t=ties: topk_case(
            peers, dev, r, c, k, lb, ca, t, rounds)))
    for context in ((256,) if smoke else (32768, 131072)) if args.only in (None, "producer") else ():
        cases.append((f"producer {context}", lambda c=context: producer_case(
            peers, dev, 2 if smoke else 64, c, 64 if smoke else 2048, rounds)))
    for name, run in cases:
        try:
            row = run()
        except Exception:
            report["errors"][name] = traceback.format_exc()
            print(f"{name} failed:\n{report['errors'][name]}", file=sys.stderr)
            continue
        report["rows"].append(row)
        ratio = next((f"{key} {row[key]:.2f}" for key in ("ours_over_DeepGEMM", "ours_over_best_fused_peer")
                      if key in row), "no peer timed")
        print(f"{row['op']:<17} {row['case']:<32} " + "  ".join(f"{n} {us:.1f} µs" for n, us in row["us"].items())
              + f"  | {ratio}")
        if on_gpu(dev):
            torch.cuda.empty_cache()
    if args.out:
        write_json(report, args.out, indent=1)
        print(f"results written to {args.out}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
