"""Context-parallel prefill of the small DSA model (the indexer's keys split across ranks) against one device.

    python bench/cp_model_gpu.py --nproc 2 --out out/cp_model-2gpu.json    # two GPUs (issue 10)
    python bench/cp_model_gpu.py --nproc 2 --dist-backend gloo                     # CPU smoke run

Spawns one process per rank (NCCL on ``cuda:rank`` with ``NCCL_NVLS_ENABLE=0``, or gloo on CPU processes
with the library's CPU backend choice). Every rank builds the same model (:class:`indexcache.tools.model.dsa.DSAModel`,
seeded) and the same prompts (three of different lengths: k is below the longer ones and above the
short one) and prefills them twice under a plan with producers and shared layers (``--freq``):

- the reference: the plain model on the whole key axis, its producers selecting with
  ``indexcache.topk_translate(sorted=True)`` (:class:`SortedTopkState`);
- context parallel: :class:`ShardedIndexerModel` computes each producer's logits on the rank's shard of the keys
  only (``--layouts``: contiguous, and zigzag, the load-balanced causal layout of
  :func:`indexcache.runtime.distributed.zigzag_key_index`), :class:`CPTopkState` merges the top-k across ranks
  with :func:`indexcache.runtime.distributed.cp_topk_translate`; shared layers reuse it, and everything else (KV
  cache, sparse attention) runs replicated, so every rank's output must equal the reference.

Why sorted: ``cp_topk`` orders a row's selection by score (then index), as ``topk(sorted=True)`` does,
while the plain :class:`~indexcache.runtime.state.TopkState` leaves the order to the backend. The order is the
order in which sparse attention sums the selected slots, so another order changes hidden states in
their last bits; the next producer's fp8-quantized indexer inputs then flip here and there and a few
rows select other tokens, more at every producer (on one H200, world size 1, against the plain state:
0, 1, 3, 10, 11, 20 and 34 of 6400 rows at producers 0 .. 11; logits 6e-3 apart). The sorted reference
is the same selection in the order the merge gives.

Checks on every rank: each producer's selected logical indices equal the reference's as sets per row
(both row-sorted; whether they are also equal in order is reported), and the final logits agree within
1e-4 of their largest magnitude (max abs difference and bitwise equality are reported). Timings, rank
0's, median of ``--reps``: the whole prefill forward on one device vs context parallel and, per
producer, ``mqa_logits`` of the rank's shard vs ``cp_topk`` (local top-k, all-gather, merge) on those
scores. Checks and timings are per layout. CUDA events on GPUs; with gloo they are host-clock smoke numbers,
not speeds. Prints tables, writes JSON to ``--out`` and exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import indexcache
from indexcache.bench.output import print_rows
from indexcache.bench.ranks import describe, rank_group, run_header, spawn, write_report
from indexcache.bench.timing import Timer
from indexcache.hal import dispatch
from indexcache.hal.ops import INDEX
from indexcache.runtime.distributed import cp_topk, cp_topk_translate, zigzag_key_index
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import IndexRecorder, TopkState
from indexcache.tools.model.batch import Batch
from indexcache.tools.model.cache import PagedCache
from indexcache.tools.model.config import ModelConfig, preset
from indexcache.tools.model.dsa import DSAModel

SCHEMA = "indexcache-cp-model-bench/2"  # 2: a run per key layout
LOGITS_TOLERANCE = 1e-4  # relative to the largest reference logit (at least 1)
# Defaults per --dist-backend: (k, prompt lengths, reps). GPUs: DeepSeek-V3.2's k 2048; CPU: small.
DEFAULTS = {"nccl": (2048, (3072, 2304, 1024), 10), "gloo": (128, (384, 200, 64), 3)}
LAYOUTS = ("contiguous", "zigzag")


class ShardedIndexerModel(DSAModel):
    """:class:`DSAModel` whose prefill indexer scores only this rank's shard of the keys.

    Of the N keys a prefill batch gathers, rank ``rank`` of ``world`` holds, with ``layout`` "contiguous",
    ``[key_offset, key_offset + n_local)`` with ``key_offset = N * rank // world``; with "zigzag", the keys of
    :func:`zigzag_key_index` (``key_offset`` is then that int32 index). A row's window is an interval of
    global keys, so its visible local keys are an interval too. :meth:`_prefill_logits` sets ``key_offset``,
    ``num_keys`` (N) and ``layer_scored`` on each call for :class:`CPTopkState`. When ``captured`` is a dict,
    each producer's ``mqa_logits`` arguments are kept there by layer (for timing).
    """

    def __init__(self, config: ModelConfig, device: torch.device | str, rank: int, world: int,
                 layout: str = "contiguous") -> None:
        super().__init__(config, device)
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        self.rank, self.world, self.layout = rank, world, layout
        self.key_offset: int | torch.Tensor = 0
        self.num_keys = 0
        self.layer_scored = -1
        self.captured: dict[int, tuple] | None = None

    def _prefill_logits(self, layer: int, q8: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor,
                        weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
        """``mqa_logits`` over the rank's keys only: local logits ``[R, n_local]`` float32 (-inf outside each
        row's window, mapped to the shard's local columns)."""
        n = k8.shape[0]
        self.num_keys, self.layer_scored = n, layer
        if self.layout == "contiguous":
            lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
            self.key_offset = lo
            args = (q8, k8[lo:hi], k_scale[lo:hi], weights, (ks - lo).clamp(0, hi - lo), (ke - lo).clamp(0, hi - lo))
        else:
            index = zigzag_key_index(n, self.world, self.rank, device=k8.device)
            self.key_offset = index
            local = index.long()
            args = (q8, k8[local], k_scale[local], weights, torch.searchsorted(index, ks).to(ks.dtype),
                    torch.searchsorted(index, ke).to(ke.dtype))
        if self.captured is not None:
            self.captured[layer] = args
        return indexcache.mqa_logits(*args)


class SortedTopkState(TopkState):
    """A :class:`TopkState` whose producers select with ``topk_translate(sorted=True)``: each row by score
    descending, then index ascending, as :func:`cp_topk` orders it."""

    def select(self, scores: torch.Tensor, lengths: torch.Tensor, page_table: torch.Tensor, page_size: int, *,
               row_starts: torch.Tensor | None, row_to_batch: torch.Tensor | None, out: torch.Tensor,
               out_raw: torch.Tensor) -> torch.Tensor:
        return indexcache.topk_translate(scores, lengths, self.k, page_table, page_size, row_starts=row_starts,
                                         row_to_batch=row_to_batch, out=out, out_raw=out_raw, sorted=True)


class CPTopkState(TopkState):
    """A :class:`TopkState` whose producers merge the top-k of ``model``'s key shards across ``group``.

    :meth:`select` takes the local scores ``[rows, n_local]`` of :class:`ShardedIndexerModel` and fills
    ``out_raw`` (global logical indices, -1 = empty) and ``out`` as :meth:`TopkState.select` does on the
    whole scores. When ``captured`` is a dict, each producer's :func:`cp_topk` arguments are kept there (by
    the producer layer the model scored last).
    """

    def __init__(self, max_rows: int, k: int, model: ShardedIndexerModel, group: dist.ProcessGroup | None = None
                 ) -> None:
        super().__init__(max_rows, k, model.device)
        self.model = model
        self.group = group
        self.captured: dict[int, dict] | None = None

    def select(self, scores: torch.Tensor, lengths: torch.Tensor, page_table: torch.Tensor, page_size: int, *,
               row_starts: torch.Tensor | None, row_to_batch: torch.Tensor | None, out: torch.Tensor,
               out_raw: torch.Tensor) -> torch.Tensor:
        shard = dict(local_scores=scores, key_offset=self.model.key_offset, lengths=lengths, k=self.k,
                     row_starts=row_starts, num_keys=self.model.num_keys)
        if self.captured is not None:
            self.captured[self.model.layer_scored] = shard
        return cp_topk_translate(**shard, page_table=page_table, page_size=page_size, group=self.group,
                                 row_to_batch=row_to_batch, out=out, out_raw=out_raw)


def prompts_of(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Prompts of ``lengths`` tokens (int64 ``[n]`` each), the same on every rank for one ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


@dataclasses.dataclass
class Prefill:
    """One model's prefill of the prompts, ready to run (again): ``run()`` returns logits ``[R, vocab]``."""

    model: DSAModel
    runner: IndexerRunner
    state: TopkState
    batch: Batch
    cache: PagedCache

    def run(self) -> torch.Tensor:
        return self.model.run(self.batch, self.cache, self.runner, self.state)


def setup(model: DSAModel, freq: int, prompts: Sequence[torch.Tensor], state_of: Callable[[int, int], TopkState]
          ) -> Prefill:
    """The prefill of ``prompts`` on ``model`` under ``model.plan(freq)``; ``state_of(rows, k)`` builds the
    state. The cache (page tables from seed 0) holds index-K caches for the producers only."""
    runner = IndexerRunner(model.plan(freq))
    producers = [layer for layer in runner.layers if runner.role(layer) == "F"]
    cache = model.new_cache(len(prompts), max(int(p.shape[0]) for p in prompts), index_layers=producers)
    batch = Batch.prefill(prompts, cache.tables_for(range(len(prompts))))
    return Prefill(model, runner, state_of(batch.rows, runner.k), batch, cache)


def check(rank: int, world: int, config: ModelConfig, prompt_lens: Sequence[int], freq: int,
          device: torch.device, group: dist.ProcessGroup | None = None, layout: str = "contiguous"
          ) -> tuple[dict, Prefill, Prefill]:
    """Prefill on one device and context parallel on this rank of ``group`` with the keys split by ``layout``;
    compare (see the module docstring).

    Returns the checks (agreed across ranks: mismatches summed, differences maxed) and both prefills.
    """
    prompts = prompts_of(prompt_lens, config.vocab)
    ref = setup(DSAModel(config, device), freq, prompts, lambda rows, k: SortedTopkState(rows, k, device))
    model = ShardedIndexerModel(config, device, rank, world, layout)
    cp = setup(model, freq, prompts, lambda rows, k: CPTopkState(rows, k, model, group))
    recorded = []
    for prefill in (ref, cp):
        prefill.state.recorder = recorder = IndexRecorder()
        logits = prefill.run()
        prefill.state.recorder = None
        recorded.append((logits, recorder.stacked()))
    (want, want_raw), (got, got_raw) = recorded
    producers = [layer for layer in ref.runner.layers if ref.runner.role(layer) == "F"]
    mismatched = torch.tensor([int((want_raw[layer].sort(1).values != got_raw[layer].sort(1).values).any(1).sum())
                               for layer in producers], dtype=torch.int64, device=device)
    reordered = any(not torch.equal(want_raw[layer], got_raw[layer]) for layer in producers)
    diff = torch.tensor([float((got - want).abs().max()), float(want.abs().max()), float((got != want).any()),
                         float(reordered)], device=device)
    dist.all_reduce(mismatched, group=group)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    max_abs_diff, max_abs_logit, differs, reordered = diff.tolist()
    result = {
        "layout": layout, "world_size": world, "rows": ref.batch.rows, "k": ref.runner.k,
        "plan": ref.runner.plan.roles, "producers": producers,
        "mismatched_rows": dict(zip(producers, mismatched.tolist(), strict=True)),
        "sets_equal": not bool(mismatched.any()), "order_equal": not reordered,
        "max_abs_diff": max_abs_diff, "max_abs_logit": max_abs_logit, "logits_bitwise_equal": not differs,
        "logits_close": max_abs_diff <= LOGITS_TOLERANCE * max(1.0, max_abs_logit),
    }
    result["equal"] = result["sets_equal"] and result["logits_close"]
    return result, ref, cp


def timings(ref: Prefill, cp: Prefill, device: torch.device, reps: int, group: dist.ProcessGroup | None = None
            ) -> tuple[dict, list[dict]]:
    """This rank's times (µs): the whole forward of both prefills, and per producer the shard's
    ``mqa_logits`` and ``cp_topk`` on its local scores (captured by one more context-parallel forward);
    also the backends that ran those two ops. The numbers of calls are fixed (``budget_s=None``): the calls
    hold collectives, so every rank must make as many."""
    model, state = cp.model, cp.state
    model.captured, state.captured = {}, {}
    cp.run()
    logits_args, topk_args = model.captured, state.captured
    model.captured = state.captured = None
    forwards = Timer(device, warmup=1, reps=reps, graph_reps=0, budget_s=None)
    op_calls = Timer(device, warmup=2, reps=reps, graph_reps=0, budget_s=None)
    dist.barrier(group=group)
    forward = {"single_forward_us": forwards.eager_us(lambda i: ref.run())}
    dist.barrier(group=group)
    forward["cp_forward_us"] = forwards.eager_us(lambda i: cp.run())
    layers = []
    for layer, args in logits_args.items():
        topk = topk_args[layer]
        out = torch.empty(topk["local_scores"].shape[0], state.k, dtype=INDEX, device=device)
        dist.barrier(group=group)
        layers.append({
            "layer": layer, "local_keys": args[1].shape[0],
            "local_logits_us": op_calls.eager_us(lambda i, a=args: indexcache.mqa_logits(*a)),
            "cp_topk_us": op_calls.eager_us(lambda i, t=topk, o=out: cp_topk(**t, group=group, out=o,
                                                                             check_agreement=False)),
        })
    args, topk = logits_args[layers[0]["layer"]], topk_args[layers[0]["layer"]]
    scores = topk["local_scores"]
    forward["logits_backend"] = dispatch.resolve(
        "mqa_logits", dict(zip(("q", "k", "k_scale", "weights", "ks", "ke"), args, strict=True), out=scores))[0]
    forward["topk_backend"] = dispatch.resolve("topk", dict(
        scores=scores, lengths=topk["lengths"], k=state.k, row_starts=topk["row_starts"],
        out=torch.empty(scores.shape[0], state.k, dtype=INDEX, device=device), sorted=False))[0]
    return forward, layers


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> None:
    runs = []
    with rank_group(rank, world, args.dist_backend) as device:
        config = preset("v32-like", topk=args.topk)
        for layout in args.layouts:
            result, ref, cp = check(rank, world, config, args.prompts, args.freq, device, layout=layout)
            forward, layers = timings(ref, cp, device, args.reps)
            runs.append({"layout": layout, "result": result, "forward": forward, "layers": layers})
            del ref, cp
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            _report(runs, config, args, world, device)
    if not all(run["result"]["equal"] for run in runs):
        sys.exit(1)


def _report(runs: list[dict], config: ModelConfig, args: argparse.Namespace, world: int, device: torch.device
            ) -> None:
    clock = "CUDA events" if device.type == "cuda" else "host clock: CPU smoke run, not a GPU measurement"
    first = runs[0]["result"]
    print(f"cp_model: {describe(device, world, args.dist_backend)}"
          + f", prompts {list(args.prompts)} ({first['rows']} rows and keys), k={first['k']}, "
          f"plan {first['plan']}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    for run in runs:
        result, forward, layers = run["result"], run["forward"], run["layers"]
        print(f"== keys split {run['layout']}")
        print(f"producer top-k sets equal: {result['sets_equal']} (mismatched rows by layer: "
              f"{result['mismatched_rows']}), in the same order: {result['order_equal']}")
        print(f"logits: max abs diff {result['max_abs_diff']:.3g} (largest logit {result['max_abs_logit']:.3g}, "
              f"tolerance {LOGITS_TOLERANCE:g} of it), close: {result['logits_close']}, "
              f"bitwise equal: {result['logits_bitwise_equal']}")
        print(f"mqa_logits on {forward['logits_backend']}, top-k on {forward['topk_backend']}")
        print_rows(f"prefill forward (µs, rank 0, median of {args.reps}; {clock})", [forward],
                   ["single_forward_us", "cp_forward_us"])
        print_rows(f"per producer (µs, rank 0; {clock})", layers,
                   ["layer", "local_keys", "local_logits_us", "cp_topk_us"])
    equal = all(run["result"]["equal"] for run in runs)
    print(f"cp_model: {'OK' if equal else 'MISMATCH'}")
    report = run_header(SCHEMA, device, world) | {
        "settings": {"dist_backend": args.dist_backend, "prompts": list(args.prompts), "freq": args.freq,
                     "reps": args.reps, "statistic": "median", "timed_on": "rank 0", "clock": clock,
                     "layouts": list(args.layouts), "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
                     "model": dataclasses.asdict(config),
                     "logits_tolerance": f"{LOGITS_TOLERANCE:g} x max(1, largest reference logit)"},
        "runs": runs,
    }
    write_report(report, args.out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, help="ranks, one GPU each with nccl (default 2, or the GPUs if fewer)")
    parser.add_argument("--dist-backend", choices=("nccl", "gloo"), default="nccl",
                        help="nccl on GPUs (default); gloo runs the same on CPU processes (a smoke run)")
    parser.add_argument("--prompts", type=int, nargs="+",
                        help=f"prompt lengths (default {DEFAULTS['nccl'][1]} with nccl, {DEFAULTS['gloo'][1]} gloo)")
    parser.add_argument("--topk", type=int, help="top-k (default 2048 with nccl, 128 with gloo)")
    parser.add_argument("--freq", type=int, default=2, help="index_topk_freq of the plan (default 2: FFSFSF...)")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                        help="how the keys are split across ranks (default: both, one after the other)")
    parser.add_argument("--reps", type=int, help="timed calls per measurement (default 10 with nccl, 3 with gloo)")
    parser.add_argument("--out", help="write the JSON report here")
    args = parser.parse_args(argv)
    gpu = args.dist_backend == "nccl"
    topk, prompts, reps = DEFAULTS[args.dist_backend]
    args.prompts = args.prompts or list(prompts)
    args.topk = args.topk or topk
    args.reps = args.reps or reps
    gpus = torch.cuda.device_count()
    if args.nproc is None:
        args.nproc = min(2, gpus) if gpu and gpus else 2
    if gpu and not 1 <= args.nproc <= gpus:
        parser.error(f"--nproc: expected 1 .. {gpus} (the GPUs here) with nccl, got {args.nproc}")
    if args.nproc < 1 or args.freq < 1 or args.topk < 1 or args.reps < 1 or min(args.prompts) < 1:
        parser.error("expected --nproc, --freq, --topk, --reps and every --prompts length >= 1")
    spawn(_rank_main, args.nproc, args, "cp_model_gpu")


if __name__ == "__main__":
    main()
