"""Context-parallel top-k on GPUs with NCCL: equality with single-GPU ``indexcache.topk`` and the merge's cost.

    python bench/cp_gpu.py --nproc 1 --out out/cp_topk-1gpu.json    # one H200 (issue 9)
    python bench/cp_gpu.py --nproc 2 --out out/cp_topk-2gpu.json    # two H200s (issue 10)

Spawns one process per GPU (NCCL, ``NCCL_NVLS_ENABLE=0``). Rank 0 draws the global scores ``[rows, keys]``
(bf16-rounded so equal scores straddle shard boundaries, 1 % -inf) and broadcasts them; causal lengths
with a short row (length k), an empty row and a row of k + 1. For contiguous and zigzag shards every
rank checks ``cp_topk`` against ``indexcache.topk(sorted=True)`` on the whole scores, then times (CUDA
events, median): single-GPU top-k of the whole row, the local step of ``cp_topk`` (windowed top-k and
candidate keys), the whole ``cp_topk``, the all-gather alone and, for scale, ``mqa_logits`` of the
rank's shard (H=64, D=128, fp8). Prints a table, writes JSON to ``--out`` and exits 1 on a mismatch.
``--dist-backend gloo`` runs the same on CPU processes (a smoke run; host-clock times, not GPU numbers).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import indexcache
from indexcache.bench.output import print_rows
from indexcache.bench.ranks import describe, rank_group, run_header, spawn, write_report
from indexcache.bench.timing import Timer
from indexcache.hal import dispatch
from indexcache.runtime.distributed import _all_gather, _local_candidates, _windows, cp_topk, zigzag_key_index

SCHEMA = "indexcache-cp-bench/1"
HEADS, DIM = 64, 128


def _shard(scores: torch.Tensor, layout: str, world: int, rank: int):
    """(local scores, key_offset) of this rank: its contiguous slice or zigzag chunks, in a buffer of its own."""
    keys = scores.shape[1]
    if layout == "contiguous":
        lo, hi = keys * rank // world, keys * (rank + 1) // world
        return scores[:, lo:hi].contiguous(), lo
    index = zigzag_key_index(keys, world, rank, device=scores.device)
    return scores[:, index.long()], index


def _logits_us(timer: Timer, rows: int, local_keys: int, device) -> tuple[float | None, str]:
    """Median time of ``mqa_logits`` over the rank's shard, and the backend that ran it (or the error)."""
    gen = torch.Generator(device=device).manual_seed(7)
    q = torch.randn(rows, HEADS, DIM, generator=gen, device=device).to(torch.float8_e4m3fn)
    k = torch.randn(local_keys, DIM, generator=gen, device=device).to(torch.float8_e4m3fn)
    k_scale = torch.rand(local_keys, generator=gen, device=device)
    weights = torch.rand(rows, HEADS, generator=gen, device=device)
    ks = torch.zeros(rows, dtype=torch.int32, device=device)
    ke = torch.full((rows,), local_keys, dtype=torch.int32, device=device)
    out = torch.empty(rows, local_keys, device=device)
    args = dict(q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, out=out)
    try:
        backend = dispatch.resolve("mqa_logits", args)[0]
        return timer.eager_us(lambda i: indexcache.mqa_logits(q, k, k_scale, weights, ks, ke, out=out)), backend
    except Exception as exc:  # the table still reports the top-k numbers when the logits kernel cannot run
        return None, f"error: {type(exc).__name__}: {exc}"


def _case(keys: int, layout: str, args, rank: int, world: int, device) -> dict:
    rows, k = args.rows, args.k
    gen = torch.Generator(device=device).manual_seed(keys)
    scores = torch.randn(rows, keys, generator=gen, device=device).bfloat16().float()
    scores = torch.where(torch.rand(rows, keys, generator=gen, device=device) < 0.01, float("-inf"), scores)
    dist.broadcast(scores, 0)
    lengths = torch.arange(keys - rows + 1, keys + 1, dtype=torch.int32, device=device)
    lengths[:3] = torch.tensor([k, 0, k + 1], dtype=torch.int32)
    want = indexcache.topk(scores, lengths, k, sorted=True)
    local, key_offset = _shard(scores, layout, world, rank)
    got = cp_topk(local, key_offset, lengths, k, num_keys=keys)
    mismatched = (got != want).any(1).sum().reshape(1)
    dist.all_reduce(mismatched)

    # Fixed numbers of calls (budget_s=None): cp_topk and the all-gather are collectives, so every rank must make
    # as many (a count fitted to each rank's own time could differ between ranks).
    timer = Timer(device, warmup=3, reps=args.reps, graph_reps=0, budget_s=None)
    start, length = _windows(lengths, None, keys)
    candidates = _local_candidates(local, key_offset, start, length, k, None).contiguous()
    gathered = torch.empty(world * rows, k, dtype=torch.long, device=device)
    topk_args = dict(scores=scores, lengths=lengths, k=k, row_starts=None, out=want, sorted=False)
    row = {
        "world_size": world, "keys": keys, "layout": layout, "rows": rows, "k": k,
        "local_keys": local.shape[1], "mismatched_rows": int(mismatched), "equal": int(mismatched) == 0,
        "topk_backend": dispatch.resolve("topk", topk_args)[0],
        "single_topk_us": timer.eager_us(lambda i: indexcache.topk(scores, lengths, k, out=want)),
        "local_topk_us": timer.eager_us(lambda i: _local_candidates(local, key_offset, start, length, k, None)),
        # The merge alone (an engine that checked its shapes once), then with the per-call agreement check (one
        # all-gather of five int64 and, on NCCL, a host sync).
        "cp_topk_us": timer.eager_us(lambda i: cp_topk(local, key_offset, lengths, k, num_keys=keys, out=got,
                                                       check_agreement=False)),
        "cp_topk_checked_us": timer.eager_us(lambda i: cp_topk(local, key_offset, lengths, k, num_keys=keys, out=got)),
        "all_gather_us": timer.eager_us(lambda i: _all_gather(gathered, candidates)),
        "comm_bytes_per_row": world * k * 8,
        "logits_bytes_per_row": keys * 4,
    }
    row["merge_us"] = row["cp_topk_us"] - row["local_topk_us"]
    row["comm_over_logits"] = row["comm_bytes_per_row"] / row["logits_bytes_per_row"]
    row["local_logits_us"], row["logits_backend"] = _logits_us(
        Timer(device, warmup=1, reps=3, graph_reps=0), rows, local.shape[1], device)
    return row


def _rank_main(rank: int, world: int, args) -> None:
    with rank_group(rank, world, args.dist_backend) as device:
        results = []
        for keys in args.keys:
            for layout in ("contiguous", "zigzag"):
                results.append(_case(keys, layout, args, rank, world, device))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if rank == 0:
            _report(results, args, world, device)
    if not all(r["equal"] for r in results):
        sys.exit(1)


COLUMNS = ("keys", "layout", "local_keys", "equal", "single_topk_us", "local_topk_us", "merge_us", "all_gather_us",
           "local_logits_us", "comm_bytes_per_row", "logits_bytes_per_row", "comm_over_logits")


def _cell(name: str, value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2e}" if name == "comm_over_logits" else f"{value:.1f}"
    return str(value)


def _report(results: list[dict], args, world: int, device) -> None:
    gpu = device.type == "cuda"
    print_rows(f"cp_topk: {describe(device, world, args.dist_backend)}"
               + f", rows={args.rows}, k={args.k}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}, times in µs"
               + ("" if gpu else " (host clock: CPU smoke run, not a GPU measurement)"), results, COLUMNS, cell=_cell)
    for r in results:
        print(f"{r['keys']} keys, {r['layout']}: top-k on {r['topk_backend']}, mqa_logits: {r['logits_backend']}")
    report = run_header(SCHEMA, device, world) | {
        "settings": {"dist_backend": args.dist_backend, "rows": args.rows, "k": args.k, "reps": args.reps,
                     "statistic": "median", "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
                     "logits": f"mqa_logits H={HEADS} D={DIM} float8_e4m3fn over the rank's keys"},
        "results": results,
    }
    write_report(report, args.out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1, help="ranks, one GPU each (default 1)")
    parser.add_argument("--keys", type=int, nargs="+", default=[131072, 1048576], help="global keys per row")
    parser.add_argument("--rows", type=int, default=128, help="query rows (default 128)")
    parser.add_argument("--k", type=int, default=2048, help="top-k (default 2048, DeepSeek-V3.2)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement (default 20)")
    parser.add_argument("--dist-backend", choices=("nccl", "gloo"), default="nccl",
                        help="nccl on GPUs (default); gloo runs the same on CPU processes (a smoke run)")
    parser.add_argument("--out", help="write the JSON report here")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()
    if args.dist_backend == "nccl" and not 1 <= args.nproc <= gpus:
        parser.error(f"--nproc: expected 1 .. {gpus} (the GPUs here) with nccl, got {args.nproc}")
    if args.nproc < 1:
        parser.error(f"--nproc: expected >= 1, got {args.nproc}")
    if args.rows < 3 or args.k < 1 or min(args.keys) <= max(args.rows, args.k):
        parser.error(f"expected --rows >= 3, --k >= 1 and every --keys > both, got {args.rows}, {args.k}, {args.keys}")
    spawn(_rank_main, args.nproc, args, "cp_gpu")


if __name__ == "__main__":
    main()
