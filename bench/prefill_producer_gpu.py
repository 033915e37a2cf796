"""The prefill producer step, ``indexcache.mqa_topk_translate``, on one GPU (issue 38): bounded memory at a million
keys, and its time beside our own two ops and beside DeepGEMM's logits then FlashInfer's top-k.

    pip install -e . && python bench/prefill_producer_gpu.py --out out/prefill_producer.json [--peers .peers/topk]

One request's causal prefill (the last ``T`` tokens of ``N``; H = 64, D = 128, fp8 e4m3fn, k 2048, a KV table of
64-token pages, every query its row ``row_to_batch`` 0):

- **1M**: ``T`` = 8192 over ``N`` = 1M keys within a 2 GiB scratch bound: its result against our two ops (``mqa_logits``
  into the whole 32 GiB ``[T, N]`` logits, then ``topk_translate``): the same index sets, exactly (the same kernels);
  each call's time (CUDA events around one call, median of ``--reps``) and the bytes the allocator handed out during it
  beyond its inputs and outputs (``torch.cuda.max_memory_allocated``; ours: its workspace).
- **peers**: 4096 × 32K and 8192 × 128K: ours in one op (default bound, 2 GiB; and each bound of ``--bounds``), ours as
  two ops, ours as two ops in passes of the one op's rows (the loop an engine writes to bound the logits itself), and
  DeepGEMM ``fp8_mqa_logits`` then FlashInfer ``top_k_page_table_transform`` (where both load: DeepGEMM
  from the ``deep_gemm`` package, FlashInfer from the peers harness folder ``--peers``, ``peers.py`` there), each
  checked first (ours: the same index sets as our two ops; the peers: the selected logits of DeepGEMM's, sorted, its
  best ones: a near-tie their rounding flips is no difference), then captured in a CUDA graph and replayed in turns,
  each round in a new order (``--rounds`` rounds; the card is power-capped), with each call's scratch bytes as above.

- **the step's race** (``--producer-race``): each shape's step in one op at the default bound under each override
  of ``TOPK_RACE`` as well (its launches built from the cuda table with the override, into outputs of its own; each
  checked against our two ops), raced with the contenders above: each override's step against the peers directly.
- **the halves** (``--parts``): each shape's two-op steps apart, raced with the contenders above: our ``mqa_logits``
  into the whole logits, our ``topk_translate`` of rows computed once, and with the peers DeepGEMM's ``fp8_mqa_logits``
  and FlashInfer's transform of DeepGEMM's rows computed once: which half a gap to the peers lies in.
- **top-k race** (``--topk-race``): the top-k of the first shape's rows alone (our logits of it, causal windows, the
  translation into the KV table), then of decode-like rows (``DECODE_ROWS``: random scores, a request a row), under
  the cuda table and under each override of ``TOPK_RACE`` (the levers of docs/kernels.md, "Rows sampled ahead"),
  raced in turns as above, a case at a time; each variant's index sets checked against the table's, and, where the
  call has a sample launch, that launch alone timed beside it (a contender of its own).
- **each launch** (``--launches``): each shape's step in one op at the default bound, in one op in a single pass (a
  bound it fits in whole) and as our two ops, run eagerly as their launch lists with CUDA events between the launches
  (the host kept ahead by a sleep first; median of ``--rounds`` runs): where the passes' seams cost, launch by launch.

Writes one JSON with the commit, device and versions, again as each section ends (the producer rows, the 1M
section, the top-k race), so a run stopped later keeps what it measured. ``--smoke``: tiny shapes interpreted on the
CPU, the host clock: checks the script only.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:  # before Triton is imported: the kernels run interpreted on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import torch

import indexcache
from indexcache.bench.output import finish, print_rows, run_sections
from indexcache.bench.provenance import report_head
from indexcache.bench.timing import alternating_graph_us, median_ms, on_gpu
from indexcache.hal.specs.mqa_topk_translate import DEFAULT_WORKSPACE_BYTES

H, D, PAGE, K = 64, 128, 64, 2048
FP8 = torch.float8_e4m3fn
GIB = 1 << 30


def inputs(tokens: int, keys: int, k: int, dev: torch.device, seed: int = 38) -> dict[str, Any]:
    """A causal prefill of the last ``tokens`` of ``keys`` keys: fp8 queries and keys (per-token power-of-two key
    scales), a random KV page table of one row, outputs allocated."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    k8, scale = indexcache.quantize_index_k(torch.randn(keys, D, device=dev, generator=gen), FP8)
    t = torch.arange(tokens, device=dev, dtype=torch.int32)
    pages = -(-keys // PAGE)
    return dict(q=(torch.randn(tokens, H, D, device=dev, generator=gen) * 24).clamp(-400, 400).to(FP8), k=k8,
                k_scale=scale[:, 0].contiguous(), weights=torch.randn(tokens, H, device=dev, generator=gen) * H**-0.5,
                ks=torch.zeros(tokens, device=dev, dtype=torch.int32), ke=(keys - tokens + 1 + t).int(), topk=k,
                page_table=torch.randperm(pages, device=dev, generator=gen, dtype=torch.int32)[None, :],
                page_size=PAGE, row_to_batch=torch.zeros(tokens, device=dev, dtype=torch.int32),
                out=torch.empty(tokens, k, device=dev, dtype=torch.int32),
                out_raw=torch.empty(tokens, k, device=dev, dtype=torch.int32))


LOGITS_ARGS = ("q", "k", "k_scale", "weights", "ks", "ke")
# Overrides of the cuda table's top-k entry raced by --topk-race (docs/kernels.md, "Rows sampled ahead", "The select
# in shared memory"): the table takes BLOCK_SMEM 1 (the block kernel's bin counts, warp counts and pivot bin in shared
# memory; 0.916x the top-k's time before it on an H100) and AHEAD_SAMPLE_RANK 32 (512 sample entries a row sampled
# ahead at 32K keys: 0.959x the top-k of the 4096 causal rows on the H200); 0 is the kernel before, 2 the stash's keys
# in shared memory too, rank 0 the block kernel's own sample size (1024 at 32K). The levers raced before (the sample
# launch's warps and rounds, a quarter of the entries, 8 columns a thread a piece, the next row's head read ahead)
# lost or stayed within 1 %.
TOPK_RACE = [{"BLOCK_SMEM": 0}, {"BLOCK_SMEM": 2}, {"AHEAD_SAMPLE_RANK": 0}]
# --topk-race's decode-like rows (rows, columns): a decode producer step's top-k, short of and past the rows that are
# sampled ahead (the cuda table's BLOCK_SAMPLE_ROWS, 256), where an override of the block kernel reaches too.
DECODE_ROWS = [(64, 32768), (64, 131072), (512, 32768)]


def ours(a: dict, bound: int | None, workspace: torch.Tensor | None = None) -> Callable[[], Any]:
    """Our one-op call into ``a``'s outputs (``bound``: its ``workspace_bytes``)."""
    def call():
        return indexcache.mqa_topk_translate(*(a[n] for n in LOGITS_ARGS), a["topk"], a["page_table"], a["page_size"],
                                             row_to_batch=a["row_to_batch"], out=a["out"], out_raw=a["out_raw"],
                                             workspace=workspace, workspace_bytes=bound)
    return call


def ours_two_ops(a: dict, logits: torch.Tensor | None) -> Callable[[], Any]:
    """``mqa_logits`` into ``logits`` (allocated by the call when None), then ``topk_translate`` of its rows."""
    out, raw = torch.empty_like(a["out"]), torch.empty_like(a["out_raw"])
    lengths = a["ke"] - a["ks"]

    def call():
        scores = indexcache.mqa_logits(*(a[n] for n in LOGITS_ARGS), out=logits)
        indexcache.topk_translate(scores, lengths, a["topk"], a["page_table"], a["page_size"], row_starts=a["ks"],
                                  row_to_batch=a["row_to_batch"], out=out, out_raw=raw)
        return out, raw
    return call


def op_pass_rows(a: dict, dev: torch.device) -> int:
    """The query rows a pass of our one-op call on ``a`` takes at the default bound (the cuda table's plan)."""
    from indexcache.backends.triton import prefill_producer
    from indexcache.backends.triton.logits import prefill_round

    target, table = cuda_table(dev)
    quantum = prefill_round(a["q"], a["k"], a["k_scale"], a["weights"], target=target, cfg=table["mqa_logits"])
    return prefill_producer.pass_rows(a["q"].shape[0], a["k"].shape[0], dev, a["topk"], DEFAULT_WORKSPACE_BYTES,
                                      target=target, cfg=table["topk"], quantum=quantum)


def ours_two_ops_in_passes(a: dict, rows: int, logits: torch.Tensor | None) -> Callable[[], Any]:
    """Our two ops over ``rows`` queries at a time, each pass's logits into ``logits [rows, N]`` (allocated by the
    call when None): the loop an engine writes to bound the logits' memory by hand, at the one op's pass rows."""
    out, raw = torch.empty_like(a["out"]), torch.empty_like(a["out_raw"])
    tokens, keys = a["q"].shape[0], a["k"].shape[0]
    lengths = a["ke"] - a["ks"]

    def call():
        scores_buf = logits if logits is not None else torch.empty(rows, keys, device=a["q"].device)
        for t0 in range(0, tokens, rows):
            t1 = min(tokens, t0 + rows)
            scores = indexcache.mqa_logits(a["q"][t0:t1], a["k"], a["k_scale"], a["weights"][t0:t1], a["ks"][t0:t1],
                                           a["ke"][t0:t1], out=scores_buf[:t1 - t0])
            indexcache.topk_translate(scores, lengths[t0:t1], a["topk"], a["page_table"], a["page_size"],
                                      row_starts=a["ks"][t0:t1], row_to_batch=a["row_to_batch"][t0:t1],
                                      out=out[t0:t1], out_raw=raw[t0:t1])
        return out, raw
    return call


def peer_logits(dg: Any, a: dict) -> torch.Tensor:
    """DeepGEMM's ``fp8_mqa_logits`` (-inf outside each window) as a torch tensor."""
    scores = dg.fp8_mqa_logits(a["q"], (a["k"], a["k_scale"]), a["weights"], a["ks"], a["ke"], True)
    return scores if isinstance(scores, torch.Tensor) else torch.from_dlpack(scores)


def peer_pair(dg: Any, fi: Any, a: dict) -> Callable[[], Any]:
    """DeepGEMM's ``fp8_mqa_logits`` (its -inf outside each window) then FlashInfer's ``top_k_page_table_transform``
    through the same table, ``row_to_batch`` and page size."""
    def call():
        return fi.flashinfer_top_k_page_table_transform(peer_logits(dg, a), a["page_table"], a["ke"], a["topk"],
                                                        row_to_batch=a["row_to_batch"], page_size=a["page_size"])
    return call


def scratch_bytes(fn: Callable[[], Any], dev: torch.device) -> int | None:
    """The most bytes the allocator held during ``fn()`` beyond what it held before (None off a GPU)."""
    if not on_gpu(dev):
        fn()
        return None
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    result = fn()
    torch.cuda.synchronize(dev)
    del result
    return torch.cuda.max_memory_allocated(dev) - before


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(1).values, b.sort(1).values)


def selected(scores: torch.Tensor, raw: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Per row the logits at the selected window positions, sorted descending (-1 slots as -inf)."""
    at = (starts[:, None] + raw.clamp_min(0)).long()
    return torch.where(raw >= 0, scores.gather(1, at), float("-inf")).sort(1, descending=True).values


def million(dev: torch.device, tokens: int, keys: int, k: int, bound: int, reps: int) -> dict[str, Any]:
    """The 1M section: ours within ``bound`` against our two ops over the whole logits."""
    a = inputs(tokens, keys, k, dev)
    workspace = torch.empty(indexcache.workspace_bytes("mqa_topk_translate", **a, workspace_bytes=bound),
                            dtype=torch.uint8, device=dev)
    row: dict[str, Any] = dict(case=f"{tokens}x{size(keys)} causal k{k}", bound_bytes=bound,
                               workspace_bytes=workspace.numel())
    one = ours(a, bound, workspace)
    row["ours_scratch_bytes"] = scratch_bytes(lambda: ours(a, bound, torch.empty_like(workspace))(), dev)
    row["ours_us"] = 1e3 * median_ms(one, dev, 0, reps, reps, warmup=0)
    got, got_raw = a["out"].clone(), a["out_raw"].clone()
    two = ours_two_ops(a, None)
    row["two_ops_scratch_bytes"] = scratch_bytes(two, dev)
    out, raw = two()
    row["same_as_two_ops"] = bool(same_sets(got_raw, raw) and same_sets(got, out))
    del out, raw
    row["two_ops_us"] = 1e3 * median_ms(two, dev, 0, max(1, reps // 2), max(1, reps // 2), warmup=0)
    row["ours_over_two_ops"] = row["ours_us"] / row["two_ops_us"]
    return row


def size(keys: int) -> str:
    return f"{keys >> 10}K" if keys >= 1024 else str(keys)


def override_name(overrides: dict[str, Any]) -> str:
    """``KEY=VALUE`` of each override, space-separated (empty for none)."""
    return " ".join(f"{n}={v}" for n, v in overrides.items())


def cuda_table(dev: torch.device) -> tuple[Any, dict[str, dict[str, Any]]]:
    """``(target, tuning table)`` of the cuda backend on ``dev`` (off a GPU: sm90's, interpreted)."""
    from indexcache.backends.cuda import tuning
    from indexcache.backends.cuda.arch import NVIDIA
    from indexcache.backends.triton.target import detect

    target = detect(NVIDIA)[2] if on_gpu(dev) else NVIDIA.target("sm90", interpreted=True)
    return target, tuning(target.arch)


def ours_with_topk(a: dict, dev: torch.device, overrides: dict[str, Any]) -> tuple[Callable[[], Any], torch.Tensor,
                                                                                     torch.Tensor]:
    """Our one-op call at the default bound with the cuda table's top-k entry overridden by ``overrides`` (its launches
    built here from the table, as the backend builds them), into outputs of its own: ``(call, out, out_raw)``."""
    target, base = cuda_table(dev)
    steps, out, raw = one_op_launches(a, dev, target, {**base, "topk": {**base["topk"], **overrides}},
                                      DEFAULT_WORKSPACE_BYTES)
    return (lambda: [launch() for launch in steps]), out, raw


def one_op_launches(a: dict, dev: torch.device, target: Any, table: dict[str, dict[str, Any]],
                    limit: int) -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    """The launches of our one-op call on ``a`` under the bound ``limit``, built from ``table`` for ``target`` as the
    backend builds them, into outputs and a workspace of their own: ``(launches, out, out_raw)``."""
    from indexcache.backends.triton import prefill_producer

    out, raw = torch.empty_like(a["out"]), torch.empty_like(a["out_raw"])
    args = {**{n: a[n] for n in (*LOGITS_ARGS, "topk", "page_table", "page_size", "row_to_batch")}, "out": out,
            "out_raw": raw, "workspace_bytes": limit}
    need = prefill_producer.call_workspace_bytes(a["q"], a["k"], a["k_scale"], a["weights"], a["topk"], limit,
                                                 target=target, tuning=table)
    args["workspace"] = torch.empty(need, dtype=torch.uint8, device=dev)
    return [s for s in prefill_producer.op_launches(args, target=target, tuning=table) if s is not None], out, raw


def parts(a: dict, logits: torch.Tensor, peers: tuple[Any, Any] | None) -> dict[str, Callable[[], Any]]:
    """The two halves of each two-op step, apart: our ``mqa_logits`` into ``logits``, our ``topk_translate`` of rows
    computed once, and (with the peers) DeepGEMM's logits and FlashInfer's transform of DeepGEMM's rows computed once
    (each top-k over its own library's logits, as in its pair)."""
    rows = indexcache.mqa_logits(*(a[n] for n in LOGITS_ARGS))
    out, raw = torch.empty_like(a["out"]), torch.empty_like(a["out_raw"])
    lengths = a["ke"] - a["ks"]
    found = {"part: ours, logits": lambda: indexcache.mqa_logits(*(a[n] for n in LOGITS_ARGS), out=logits),
             "part: ours, top-k": lambda: indexcache.topk_translate(
                 rows, lengths, a["topk"], a["page_table"], a["page_size"], row_starts=a["ks"],
                 row_to_batch=a["row_to_batch"], out=out, out_raw=raw)}
    if peers is not None:
        dg, fi = peers
        scores = peer_logits(dg, a)
        found["part: DeepGEMM logits"] = lambda: peer_logits(dg, a)
        found["part: FlashInfer top-k"] = lambda: fi.flashinfer_top_k_page_table_transform(
            scores, a["page_table"], a["ke"], a["topk"], row_to_batch=a["row_to_batch"], page_size=a["page_size"])
    return found


def race(dev: torch.device, tokens: int, keys: int, k: int, bounds: list[int], peers: tuple[Any, Any] | None,
         rounds: int, errors: list[str], topk_variants: list[dict[str, Any]] = (),
         with_parts: bool = False) -> list[dict[str, Any]]:
    """One shape: ours (default bound and each of ``bounds``; and at the default bound under each of
    ``topk_variants``, overrides of the top-k's tuning entry), ours as two ops and the peers, checked, raced; with
    ``with_parts`` each two-op step's halves too (:func:`parts`)."""
    a = inputs(tokens, keys, k, dev)
    case = f"{tokens}x{size(keys)} causal k{k}"
    logits = torch.empty(tokens, keys, device=dev)
    limits = {f"ours, bound {limit / GIB:g} GiB": limit for limit in [DEFAULT_WORKSPACE_BYTES, *bounds]}
    need = {name: indexcache.workspace_bytes("mqa_topk_translate", **a, workspace_bytes=limit)
            for name, limit in limits.items()}
    calls: dict[str, Callable[[], Any]] = {
        name: ours(a, limit, torch.empty(need[name], dtype=torch.uint8, device=dev)) for name, limit in limits.items()}
    variants = {}
    for overrides in topk_variants:
        name = f"ours, top-k {override_name(overrides)}"
        try:
            call, out, raw = ours_with_topk(a, dev, overrides)
            call()  # built and run once here: an override that does not build is reported, the others still race
        except Exception as exc:  # one contender's failure is a result, not the run's end
            errors.append(f"{case}: {name} failed: {type(exc).__name__}: {exc}")
            continue
        calls[name], variants[name] = call, (out, raw)
    calls["ours, two ops"] = ours_two_ops(a, logits)
    rows = op_pass_rows(a, dev)
    in_passes = f"ours, two ops in passes of {rows}"
    calls[in_passes] = ours_two_ops_in_passes(a, rows, logits[:rows])
    for fn in calls.values():
        fn()
    want_out, want_raw = calls["ours, two ops"]()
    calls[next(iter(calls))]()
    if not (same_sets(a["out_raw"], want_raw) and same_sets(a["out"], want_out)):
        errors.append(f"{case}: ours in one op differs from our two ops")
    if not all(same_sets(got, want) for got, want in zip(calls[in_passes](), (want_out, want_raw), strict=True)):
        errors.append(f"{case}: our two ops in passes differ from our two ops")
    for name, (out, raw) in variants.items():
        if not (same_sets(raw, want_raw) and same_sets(out, want_out)):
            errors.append(f"{case}: {name} differs from our two ops")
    if peers is not None:
        pair = peer_pair(*peers, a)
        try:
            slots, scores = pair(), peer_logits(peers[0], a)
            # The table is a permutation of pages: a slot back to its position through the inverse.
            inverse = torch.empty_like(a["page_table"][0])
            inverse[a["page_table"][0].long()] = torch.arange(inverse.numel(), device=dev, dtype=torch.int32)
            pos = torch.where(slots >= 0, inverse[(slots.clamp_min(0) // PAGE).long()] * PAGE + slots % PAGE, -1)
            if torch.equal(selected(scores, pos, a["ks"]), scores.topk(a["topk"], dim=1).values):
                calls["DeepGEMM + FlashInfer"] = pair
            else:
                errors.append(f"{case}: DeepGEMM + FlashInfer select other logits than the best of DeepGEMM's")
            del scores
        except Exception as exc:  # a peer that rejects the call is reported, never fatal
            errors.append(f"{case}: DeepGEMM + FlashInfer failed: {type(exc).__name__}: {exc}")
    if with_parts:
        try:
            calls.update(parts(a, logits, peers if "DeepGEMM + FlashInfer" in calls else None))
        except Exception as exc:  # a part that fails is reported, the race still runs
            errors.append(f"{case}: the parts failed: {type(exc).__name__}: {exc}")
    times = alternating_graph_us(calls, dev, rounds, 1, shuffle_seed=0)
    # Scratch: each call allocating its own (ours: a workspace of what the call takes; two ops: the logits).
    memory = {name: scratch_bytes(lambda name=name, limit=limit: ours(
        a, limit, torch.empty(need[name], dtype=torch.uint8, device=dev))(), dev) for name, limit in limits.items()}
    memory["ours, two ops"] = scratch_bytes(ours_two_ops(a, None), dev)
    memory[in_passes] = scratch_bytes(ours_two_ops_in_passes(a, rows, None), dev)
    if "DeepGEMM + FlashInfer" in calls:
        memory["DeepGEMM + FlashInfer"] = scratch_bytes(calls["DeepGEMM + FlashInfer"], dev)
    del logits
    base = times["ours, two ops"]
    peer = times.get("DeepGEMM + FlashInfer")
    return [dict(case=case, call=name, us=round(us, 1), over_two_ops=round(us / base, 3),
                 over_peers=round(us / peer, 3) if peer else None, scratch_bytes=memory.get(name))
            for name, us in times.items()]


def decode_rows(rows: int, cols: int, dev: torch.device, seed: int = 39) -> dict[str, Any]:
    """Decode-like rows: ``rows`` requests of ``cols`` random fp32 scores each, every row its own request's whole
    window, through a random KV table of its own (the rows a decode producer step's top-k selects from)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    pages = -(-cols // PAGE)
    table = torch.stack([torch.randperm(pages, device=dev, generator=gen, dtype=torch.int32) for _ in range(rows)])
    return dict(scores=torch.randn(rows, cols, device=dev, generator=gen),
                lengths=torch.full((rows,), cols, device=dev, dtype=torch.int32),
                starts=torch.zeros(rows, device=dev, dtype=torch.int32), page_table=table,
                row_to_batch=torch.arange(rows, device=dev, dtype=torch.int32))


def topk_race(dev: torch.device, tokens: int, keys: int, k: int, rounds: int, errors: list[str],
              decode: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """The top-k + translation of one shape's logits rows, and of each ``(rows, columns)`` of ``decode``
    (:func:`decode_rows`), under the table and each ``TOPK_RACE`` override, raced a case at a time."""
    a = inputs(tokens, keys, k, dev)
    causal = dict(scores=indexcache.mqa_logits(*(a[n] for n in LOGITS_ARGS)), lengths=a["ke"] - a["ks"],
                  starts=a["ks"], page_table=a["page_table"], row_to_batch=a["row_to_batch"])
    del a
    found = topk_race_case(dev, f"{tokens}x{size(keys)} causal k{k}", causal, k, rounds, errors)
    for rows, cols in decode:
        found += topk_race_case(dev, f"{rows}x{size(cols)} random k{k}", decode_rows(rows, cols, dev), k, rounds,
                                errors)
    return found


def topk_race_case(dev: torch.device, case: str, rows: dict[str, Any], k: int, rounds: int,
                   errors: list[str]) -> list[dict[str, Any]]:
    """One case of :func:`topk_race`: ``rows`` (scores, lengths, starts, page_table, row_to_batch) selected and
    translated under the table and each override; each override's index sets checked against the table's, and, where
    the call has a sample launch, that launch alone timed beside it."""
    from indexcache.backends.triton import topk as kernels

    target, table = cuda_table(dev)
    scores, shape = rows["scores"], (rows["scores"].shape[0], k)
    calls: dict[str, Callable[[], Any]] = {}
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for overrides in [{}, *TOPK_RACE]:
        name = override_name(overrides) or "table"
        cfg = dict(table["topk"], **overrides)
        out = torch.empty(shape, device=dev, dtype=torch.int32)
        raw = torch.empty_like(out)
        ws = torch.empty(kernels.workspace_bytes(scores, k, target=target, cfg=cfg) // 4 + 1, dtype=torch.int32,
                         device=dev)
        steps = kernels.launches(scores, rows["lengths"], k, rows["starts"], out, raw, rows["page_table"], PAGE,
                                 rows["row_to_batch"], workspace=ws, target=target, cfg=cfg)
        calls[name] = lambda steps=steps: [launch() for _, launch in steps]
        if steps and steps[0][0] == "sample":
            calls[f"{name}: sample launch"] = steps[0][1]
        outs[name] = out, raw
    for fn in calls.values():
        fn()
    for name, (out, raw) in outs.items():
        if not (same_sets(out, outs["table"][0]) and same_sets(raw, outs["table"][1])):
            errors.append(f"top-k race {case}: {name} selects other index sets than the table")
    times = alternating_graph_us(calls, dev, rounds, 1, shuffle_seed=0)
    return [dict(case=case, config=name, us=round(us, 1), over_table=round(us / times["table"], 3))
            for name, us in times.items()]


def launch_lists(a: dict, dev: torch.device) -> dict[str, list[Any]]:
    """The launches, in order, of our step on ``a`` in one op at the default bound and at a bound it fits in one pass,
    and of our two ops (``mqa_logits`` into the whole logits, ``topk_translate`` of its rows), each into outputs and a
    workspace of its own, built from the cuda table as the backend builds them."""
    from indexcache.backends.triton import topk as kernels
    from indexcache.backends.triton.logits import mqa_logits_launches

    target, table = cuda_table(dev)
    tokens, keys = a["q"].shape[0], a["k"].shape[0]
    whole = 4 * tokens * keys + 2 * GIB  # the logits whole and room for the top-k's and the windows' workspace
    found = {name: one_op_launches(a, dev, target, table, limit)[0]
             for name, limit in [(f"ours, bound {DEFAULT_WORKSPACE_BYTES / GIB:g} GiB", DEFAULT_WORKSPACE_BYTES),
                                 ("ours, one pass", whole)]}
    logits = torch.empty(tokens, keys, device=dev)
    scratch = torch.empty(kernels.workspace_bytes(logits, a["topk"], target=target, cfg=table["topk"]) // 4 + 1,
                          dtype=torch.int32, device=dev)
    found["ours, two ops"] = [
        *mqa_logits_launches(*(a[n] for n in LOGITS_ARGS), logits, target=target, cfg=table["mqa_logits"]),
        *(launch for _, launch in kernels.launches(logits, a["ke"] - a["ks"], a["topk"], a["ks"],
                                                   torch.empty_like(a["out"]), torch.empty_like(a["out_raw"]),
                                                   a["page_table"], a["page_size"], a["row_to_batch"],
                                                   workspace=scratch, target=target, cfg=table["topk"]))]
    return found


def launch_us(steps: list[Any], dev: torch.device, reps: int) -> list[float]:
    """Each of ``steps``' median µs over ``reps`` eager runs of the list in order (after one more, untimed): CUDA
    events between the launches, the card first held by a sleep so that the host enqueues ahead of it (off a GPU: the
    host clock, a smoke run)."""
    binds = [step.bind() for step in steps]
    samples: list[list[float]] = [[] for _ in steps]
    for rep in range(reps + 1):
        if on_gpu(dev):
            torch.cuda.synchronize(dev)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(binds) + 1)]
            torch.cuda._sleep(40_000_000)  # about 20 ms: the launches enqueued before the card reaches them
            marks[0].record()
            for fn, mark in zip(binds, marks[1:], strict=True):
                fn()
                mark.record()
            torch.cuda.synchronize(dev)
            spans = [1e3 * a.elapsed_time(b) for a, b in zip(marks[:-1], marks[1:], strict=True)]
        else:
            spans = []
            for fn in binds:
                start = time.perf_counter()
                fn()
                spans.append(1e6 * (time.perf_counter() - start))
        if rep:
            for sample, us in zip(samples, spans, strict=True):
                sample.append(us)
    return [statistics.median(sample) for sample in samples]


def launch_rows(dev: torch.device, tokens: int, keys: int, k: int, reps: int) -> list[dict[str, Any]]:
    """One shape's :func:`launch_lists`, each launch timed (:func:`launch_us`): a row a launch (its kernel and grid),
    then a row of each list's sum."""
    a = inputs(tokens, keys, k, dev)
    case = f"{tokens}x{size(keys)} causal k{k}"
    found = []
    for call, steps in launch_lists(a, dev).items():
        times = launch_us(steps, dev, reps)
        found += [dict(case=case, call=call, launch=i, kernel=step.launcher.__name__, grid=list(step.grid),
                       us=round(us, 1)) for i, (step, us) in enumerate(zip(steps, times, strict=True))]
        found.append(dict(case=case, call=call, launch="all", kernel="", grid=[], us=round(sum(times), 1)))
    return found


def load_peers(folder: str | None) -> tuple[tuple[Any, Any] | None, dict[str, str]]:
    """``((deep_gemm, peers harness module), status)``, or None where either does not load."""
    status: dict[str, str] = {}
    dg = fi = None
    try:
        dg = importlib.import_module("deep_gemm")
        status["DeepGEMM"] = f"present {getattr(dg, '__version__', '')}".strip()
    except Exception as exc:  # a missing or broken peer is reported, never fatal
        status["DeepGEMM"] = f"absent: {type(exc).__name__}: {exc}"
    if folder:
        try:
            sys.path.insert(0, str(Path(folder).resolve()))
            fi = importlib.import_module("peers")
            status["FlashInfer"] = f"present (peers harness {folder})"
        except Exception as exc:  # as above
            status["FlashInfer"] = f"absent: {type(exc).__name__}: {exc}"
    else:
        status["FlashInfer"] = "absent: no --peers folder"
    return ((dg, fi) if dg is not None and fi is not None else None), status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="prefill_producer.json", help="the JSON report")
    parser.add_argument("--peers", default=None, help="the peers harness' topk folder (its peers.py: FlashInfer)")
    parser.add_argument("--bounds", default="0.5,1,4", help="more scratch bounds to race, GiB (default 0.5,1,4)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of alternating graph replays")
    parser.add_argument("--reps", type=int, default=3, help="eager calls timed in the 1M section")
    parser.add_argument("--skip-million", action="store_true", help="leave out the 1M section")
    parser.add_argument("--topk-race", action="store_true",
                        help="also race the top-k of the first shape's rows and of decode-like rows under the table "
                        "and TOPK_RACE's overrides")
    parser.add_argument("--producer-race", action="store_true",
                        help="also race the whole step of each shape under each of TOPK_RACE's overrides, beside the "
                        "peers")
    parser.add_argument("--parts", action="store_true",
                        help="also race each two-op step's halves apart: our logits, our top-k, DeepGEMM's logits, "
                        "FlashInfer's top-k")
    parser.add_argument("--launches", action="store_true",
                        help="also time each launch of each shape's step (one op at the default bound, one op in one "
                        "pass, two ops) eagerly, by CUDA events between them")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes interpreted on the CPU: checks the script")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU visible: this script times GPU kernels (pass --smoke to check it on tiny CPU shapes)")
        return 2
    dev = torch.device("cpu" if args.smoke else "cuda")
    scale = 1 / 4096 if args.smoke else 1.0  # the smoke run's bounds in bytes: a few rows a pass
    bounds = [int(float(b) * GIB * scale) for b in args.bounds.split(",") if b]
    peers, status = load_peers(args.peers)
    errors: list[str] = []
    report: dict[str, Any] = {**report_head(dev), "peers": status,
                              "settings": f"causal prefill of one request, H {H}, D {D}, fp8 e4m3fn, k {K}, KV page "
                              f"{PAGE}; raced alternately in CUDA graphs, {args.rounds} rounds; median µs a call; "
                              "scratch: allocator bytes during a call beyond its inputs/outputs"}
    shapes = [(16, 300), (24, 1000)] if args.smoke else [(4096, 32768), (8192, 131072)]
    decode = [(4, 300), (8, 1000)] if args.smoke else DECODE_ROWS
    k = 16 if args.smoke else K
    report["errors"] = errors
    rounds = 1 if args.smoke else args.rounds
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  commit {report['commit']}")
    print("peers:", status)

    def rows() -> list[dict[str, Any]]:
        found = [row for tokens, keys in shapes
                 for row in race(dev, tokens, keys, k, bounds, peers, rounds, errors,
                                 TOPK_RACE if args.producer_race else (), args.parts)]
        print_rows("the prefill producer step (median µs a call)", found,
                   ["case", "call", "us", "over_two_ops", "over_peers", "scratch_bytes"])
        return found

    def topk_rows() -> list[dict[str, Any]]:
        found = topk_race(dev, *shapes[0], k, rounds, errors, decode)
        print_rows("the top-k of the first shape's rows and of decode-like rows (median µs a call)", found,
                   ["case", "config", "us", "over_table"])
        return found

    def launches() -> list[dict[str, Any]]:
        found = [row for tokens, keys in shapes for row in launch_rows(dev, tokens, keys, k, rounds)]
        print_rows("each launch of the step (eager, median µs)", found, ["case", "call", "launch", "kernel", "grid",
                                                                          "us"])
        return found

    def within_bound() -> dict[str, Any]:
        tokens, keys, bound = (32, 5000, 4 * 5000 * 8 + (64 << 10)) if args.smoke else (8192, 1 << 20, 2 * GIB)
        found = million(dev, tokens, keys, k, bound, args.reps)
        if not found["same_as_two_ops"]:
            errors.append("1M: ours in one op differs from our two ops")
        print_rows("within a scratch bound", [found],
                   ["case", "bound_bytes", "workspace_bytes", "ours_scratch_bytes", "ours_us", "two_ops_scratch_bytes",
                    "two_ops_us", "ours_over_two_ops", "same_as_two_ops"])
        return found

    # Each section's result written as it ends (a crash or a time limit later keeps what was measured).
    run_sections(report, [("rows", rows), *([] if args.skip_million else [("million", within_bound)]),
                          *([("topk_race", topk_rows)] if args.topk_race else []),
                          *([("launches", launches)] if args.launches else [])], args.out,
                 after=torch.cuda.empty_cache if on_gpu(dev) else None)
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
