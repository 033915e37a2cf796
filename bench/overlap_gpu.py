"""The producer's indexer beside a decode layer's main-stream work, with and without an SM budget (issue 41).

    pip install -e . && python bench/overlap_gpu.py --out out/overlap.json

One DeepSeek-V3.2-shaped layer on one GPU, bf16 weights, ``T`` rows of hidden states (a decode batch of ``T``
requests, or a prefill chunk of ``T`` tokens at the end of the context):

- **side** (the producer's indexer, what ``indexcache.tools.model.dsa.DSAModel.layer`` runs as ``indexer()``): the
  index query projection from the query latent (1536 → 64 × 128), the head weights (7168 → 64), the index key
  (7168 → 128) quantized and stored into the paged cache (``store_index_k``; fp8, or with ``--keys mxfp4``
  DeepSeek-V4's MXFP4 keys, half the bytes a key: the decode logits read 68 bytes a key instead of 132), the
  queries quantized (``quantize_index_k``), then the top-k 2048 with translation: ``paged_topk_translate`` in
  decode over every request's ``context`` keys; ``gather_index_k`` + ``mqa_topk_translate`` (causal) in prefill;
- **main** (the rest of the layer that does not wait for the indexer): the attention projections (q_a 7168 → 1536,
  q_b 1536 → 128 × 192, kv_a 7168 → 576, the absorbed W_UK 128 × (128 → 512)) and MoE-sized GEMMs (a shared expert
  and the 8 routed experts of every token as dense 7168 → 2 × 2048 → 7168 GEMMs, the work a GPU of an expert-parallel
  deployment does for the other micro-batch under two-batch overlap).

Modes, each captured in a CUDA graph and timed in alternating replays (the card is power-capped), and eagerly, the calls
alternating too: ``side`` and ``main`` alone (and ``side@n``, the side alone given n multiprocessors as
``overlap(side_sms=n)`` gives them: an SM partition where the GPU and torch have them, else an SM budget; without
partitions also ``main@n``, the main alone with its matmuls held to the other multiprocessors by torch's SM carveout),
``serial`` (one after the other on one stream), ``overlap`` (``indexcache.overlap`` with no share), ``overlap@n``
(``side_sms=n`` for each n of ``--budgets``, fractions of the SMs) and, where the backend has a rule, ``rule`` (the
schedule ``overlap_schedule(tokens=T, context=C)`` gives, with ``k_format`` for MXFP4 keys: the rule's MXFP4 bands; made
once before the eager rounds, as an eager forward makes it once for all its layers, and inside the capture for the
graph) and ``rule per call`` (``overlap(tokens=T, context=C)``: decided at every layer); ``schedule_us`` is the host
time of making the eager schedule (median of 200, host clock). The report says whether the shares were partitions
(``partitions``). ``in order again`` repeats ``serial`` in each round (the timing's own spread). Each overlapped mode
reports the fraction of the side's time hidden, ``(side + main - both) / side``, and ``both / serial`` (eagerly also
``vs_serial_paired``, the median over the rounds of its time over ``serial``'s in the same round); each shape checks
that the side's indices under the smallest budget equal the whole device's bit for bit. The HBM yardstick: ``copy``, a
plain device copy of half the index cache's bytes (as many bytes moved as the decode logits read), alone and beside the
main work (``overlap`` with no share): the fraction of a pure HBM stream the layer's main work lets hide
(``copy_overlap``), against which the indexer's is read. Writes JSON to ``--out``. ``--smoke``:
tiny shapes on the CPU (the torch backend, in order): checks the script only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import indexcache
from indexcache.backends.triton import partition
from indexcache.backends.triton.streams import _matmul_sms, rule_bands, side_budget
from indexcache.bench.output import write_json
from indexcache.bench.provenance import checkout_commit, device_name, now, versions
from indexcache.bench.timing import alternating_graph_us, times_ms, turns
from indexcache.hal import dispatch, fp4
from indexcache.hal.layout import new_packed_cache, split_packed_cache

HIDDEN, Q_LORA, HEADS, NOPE, ROPE, KV_LORA = 7168, 1536, 128, 128, 64, 512
INDEX_HEADS, INDEX_DIM, TOPK, PAGE, EXPERT, EXPERTS = 64, 128, 2048, 64, 2048, 9  # 8 routed + 1 shared


@dataclass(frozen=True)
class Shape:
    phase: str  # "decode" or "prefill"
    tokens: int
    context: int

    @property
    def name(self) -> str:
        return f"{self.phase} {self.tokens} x {self.context // 1024}K"


FULL = [Shape("decode", t, c) for t in (1, 8, 64) for c in (4096, 32768, 131072)] + \
       [Shape("prefill", t, 32768) for t in (1024, 4096)]
SMOKE = [Shape("decode", 2, 512), Shape("prefill", 64, 512)]


class Layer:
    """The weights and buffers of one layer at one shape (``small``: the smoke run's cut-down sizes)."""

    def __init__(self, shape: Shape, dev: torch.device, small: bool, keys: str = "fp8") -> None:
        g = torch.Generator(device=dev).manual_seed(0)
        cut = 16 if small else 1
        self.hidden, self.q_lora, self.heads, self.expert = HIDDEN // cut, Q_LORA // cut, HEADS // cut, EXPERT // cut
        self.topk = 64 if small else TOPK
        self.index_heads = 4 if small else INDEX_HEADS
        self.shape, self.dev = shape, dev
        bf16 = torch.bfloat16
        t, c = shape.tokens, shape.context

        def w(*size: int) -> torch.Tensor:
            return (torch.randn(*size, generator=g, device=dev) * size[0] ** -0.5).to(bf16)

        self.h = torch.randn(t, self.hidden, generator=g, device=dev).to(bf16)
        self.q_latent = torch.randn(t, self.q_lora, generator=g, device=dev).to(bf16)
        self.wq_index, self.w_weights = w(self.q_lora, self.index_heads * INDEX_DIM), w(self.hidden, self.index_heads)
        self.wk_index = w(self.hidden, INDEX_DIM)
        self.wq_a, self.wq_b = w(self.hidden, self.q_lora), w(self.q_lora, self.heads * (NOPE + ROPE))
        self.wkv_a, self.w_uk = w(self.hidden, KV_LORA + ROPE), w(self.heads, NOPE, KV_LORA)
        self.w_up = [w(self.hidden, 2 * self.expert) for _ in range(EXPERTS)]
        self.w_down = [w(self.expert, self.hidden) for _ in range(EXPERTS)]
        # The index-K cache: every request's context (decode: T requests; prefill: one request whose last T tokens
        # are the chunk), random keys, pages in a shuffled order.
        self.requests = t if shape.phase == "decode" else 1
        pages = -(-c // PAGE)
        self.fp8 = torch.float8_e4m3fn
        self.key_format = fp4.FP4 if keys == "mxfp4" else self.fp8  # what store_index_k writes, the cache holds
        self.k_format = fp4.FP4 if keys == "mxfp4" else None  # the paged ops' and overlap's name for it (None: fp8)
        self.cache = new_packed_cache(self.requests * pages, PAGE, INDEX_DIM, device=dev, fp8_dtype=self.key_format)
        self.cache.view(torch.uint8).copy_(torch.randint(0, 120, self.cache.shape, generator=g, device=dev,
                                                         dtype=torch.uint8))
        _, scales = split_packed_cache(self.cache, INDEX_DIM, self.key_format)
        if keys == "mxfp4":  # e8m0 block scales 2^-7 .. 2^0 (random bytes are any e2m1 values)
            scales.view(torch.uint8).copy_(torch.randint(120, 128, scales.shape, generator=g, device=dev,
                                                         dtype=torch.uint8))
        else:
            scales.copy_(torch.rand(scales.shape, generator=g, device=dev) * 0.01 + 1e-3)
        perm = torch.randperm(self.requests * pages, generator=g, device=dev).to(torch.int32)
        self.table = perm.view(self.requests, pages)
        self.lens = torch.full((self.requests,), c, dtype=torch.int32, device=dev)
        positions = torch.arange(c - t, c, device=dev, dtype=torch.int32)
        rows = torch.arange(t, device=dev, dtype=torch.int32)
        # Where the step's keys go: decode, each request's last token; prefill, the chunk's tokens.
        token_page = (positions // PAGE).long() if shape.phase == "prefill" else torch.full_like(rows, (c - 1) // PAGE)
        request = torch.zeros_like(rows) if shape.phase == "prefill" else rows
        slot_pos = positions if shape.phase == "prefill" else torch.full_like(rows, c - 1)
        self.slots = self.table[request.long(), token_page] * PAGE + slot_pos % PAGE
        self.out = torch.empty(t, self.topk, dtype=torch.int32, device=dev)
        # The HBM yardstick: a device copy of half the cache's bytes, reading and writing as many bytes in all as the
        # decode logits read.
        flat = self.cache.view(torch.uint8).reshape(-1)
        self.copy_src = flat[: flat.numel() // 2]
        self.copy_dst = torch.empty_like(self.copy_src)
        if shape.phase == "decode":
            self.logits = torch.empty(t, pages * PAGE, device=dev)
        else:
            if keys == "mxfp4":
                self.k8 = torch.empty(c, INDEX_DIM // 2, dtype=fp4.FP4, device=dev)
                self.k_scale = torch.empty(c, INDEX_DIM // fp4.BLOCK, dtype=torch.float8_e8m0fnu, device=dev)
            else:
                self.k8 = torch.empty(c, INDEX_DIM, dtype=self.fp8, device=dev)
                self.k_scale = torch.empty(c, device=dev)
            self.ks = torch.zeros(t, dtype=torch.int32, device=dev)
            self.ke = positions + 1  # causal: a query sees the keys up to its own
            self.r2b = torch.zeros(t, dtype=torch.int32, device=dev)

    def side(self) -> torch.Tensor:
        """The producer's indexer: projections, quantization, store, then the top-k with translation."""
        t, s = self.shape.tokens, self.shape
        q = (self.q_latent @ self.wq_index).float().view(t * self.index_heads, INDEX_DIM)
        weights = (self.h @ self.w_weights).float()
        k = (self.h @ self.wk_index).float()
        indexcache.store_index_k(k, self.cache, self.slots, self.key_format)
        q8, q_scale = indexcache.quantize_index_k(q, self.fp8, block=INDEX_DIM)
        weights = weights * q_scale.view(t, self.index_heads) * INDEX_DIM**-0.5
        if s.phase == "decode":
            return indexcache.paged_topk_translate(
                q8.view(t, 1, self.index_heads, INDEX_DIM), self.cache, weights, self.lens, self.table, s.context,
                self.topk, self.table, PAGE, logits=self.logits, out=self.out,
                k_format=self.k_format)
        k8, k_scale = indexcache.gather_index_k(self.cache, self.table, self.lens, dim=INDEX_DIM,
                                                fp8_dtype=self.key_format, out_k=self.k8, out_scale=self.k_scale)
        return indexcache.mqa_topk_translate(q8.view(t, self.index_heads, INDEX_DIM), k8, k_scale, weights, self.ks,
                                             self.ke, self.topk, self.table, PAGE, row_to_batch=self.r2b, out=self.out)

    def copy(self) -> torch.Tensor:
        """The HBM yardstick: the indexer's bytes moved by a plain device copy."""
        return self.copy_dst.copy_(self.copy_src)

    def main(self) -> torch.Tensor:
        """The layer's work that does not wait for the indexer: attention projections, MoE-sized GEMMs."""
        t = self.shape.tokens
        q = (self.h @ self.wq_a) @ self.wq_b
        q_nope = q.view(t, self.heads, NOPE + ROPE)[..., :NOPE].transpose(0, 1)
        absorbed = torch.bmm(q_nope, self.w_uk)
        kv = self.h @ self.wkv_a
        y = torch.zeros_like(self.h)
        for up, down in zip(self.w_up, self.w_down, strict=True):
            gate_up = self.h @ up
            y += (torch.nn.functional.silu(gate_up[:, :self.expert]) * gate_up[:, self.expert:]) @ down
        return y.sum() + absorbed.sum() + kv.sum()


def modes(layer: Layer, dev: torch.device, sms: int, budgets: list[int],
          rule: bool) -> dict[str, Callable[[], object]]:
    """Every way the step is run, by name."""
    calls: dict[str, Callable[[], object]] = {"side": layer.side, "main": layer.main}

    def serial() -> None:
        layer.side()
        layer.main()

    calls["serial"] = serial
    calls["overlap"] = lambda: indexcache.overlap(layer.side, layer.main, device=dev)
    for n in budgets:
        calls[f"overlap@{n}"] = lambda n=n: indexcache.overlap(layer.side, layer.main, device=dev, side_sms=n)

    def budgeted(n: int) -> Callable[[], object]:
        def side() -> object:  # the side alone, given n multiprocessors as overlap(side_sms=n) gives them
            return indexcache.overlap(layer.side, lambda: None, device=dev, side_sms=n)[0]
        return side

    def carved(n: int) -> Callable[[], object]:
        def main() -> object:
            with _matmul_sms(sms - n, sms):
                return layer.main()
        return main

    for n in budgets:
        calls[f"side@{n}"] = budgeted(n)
        if not partition.available():
            calls[f"main@{n}"] = carved(n)
    if rule:
        s = layer.shape
        shape = dict(device=dev, tokens=s.tokens, context=s.context, k_format=layer.k_format)
        eager = indexcache.overlap_schedule(**shape)  # an eager forward's, made once for its layers

        def ruled() -> object:
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():  # a captured forward's, made in it
                return indexcache.overlap_schedule(**shape)(layer.side, layer.main)
            return eager(layer.side, layer.main)

        calls["rule"] = ruled
        calls["rule per call"] = lambda: indexcache.overlap(layer.side, layer.main, **shape)
    calls["in order again"] = serial  # the same work as "serial", timed apart: how far two timings of it differ
    calls["copy"] = layer.copy
    calls["copy overlap"] = lambda: indexcache.overlap(layer.copy, layer.main, device=dev)
    return calls


def schedule_us(dev: torch.device, shape: Shape, k_format: torch.dtype | None, calls: int = 200) -> float:
    """The median host µs of making the eager schedule of ``shape`` (``indexcache.overlap_schedule``)."""
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        indexcache.overlap_schedule(device=dev, tokens=shape.tokens, context=shape.context, k_format=k_format)
        samples.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(samples)


def alternating_eager_us(calls: dict[str, Callable[[], object]], dev: torch.device,
                         rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per call the median µs of one eager call (events around it, synchronised before and after), over ``rounds``
    rounds in which the calls take turns: eager calls are host-bound, and timing them one after the other let the
    host's state drift between them (the same in-order work differed by 25 %). Each round takes the calls in a new
    random order (seeded), so no call always follows the same one: on the H200's host the same in-order step took
    1-3 % longer after some calls than after others (2026-12-04; in a fixed order, and in one merely rotated each
    round, which keeps every call's predecessor). Also, per call, the median over the rounds of its time over
    ``serial``'s in the same round (paired: what drifts between rounds cancels)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for order in turns(list(calls), rounds, shuffle_seed=0):
        for name in order:
            samples[name].append(1e3 * times_ms(calls[name], dev, 0.0, 1, 1, warmup=0)[0])
    paired = {name: statistics.median(a / b for a, b in zip(values, samples["serial"], strict=True))
              for name, values in samples.items()}
    return {name: statistics.median(values) for name, values in samples.items()}, paired


def overlapped(alone: float, main: float, both: float, serial: float) -> dict[str, float]:
    """A mode's µs, the fraction of ``alone`` (the side's time, or the copy's) hidden beside ``main``, and its ratio
    to running the two in order (``serial``)."""
    return {"us": both, "hidden": (alone + main - both) / alone, "vs_serial": both / serial}


def measure(shape: Shape, dev: torch.device, fractions: list[float], smoke: bool, rounds: int,
            keys: str = "fp8", eager_rounds: int | None = None) -> dict:
    layer = Layer(shape, dev, smoke, keys)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
    budgets = sorted({max(1, min(sms - 1, round(f * sms))) for f in fractions})
    _, impl = dispatch.resolve("overlap", dict(side_fn=layer.side, main_fn=layer.main, side=0, device=dev))
    has_rule = getattr(impl.fn, "rule", None) is not None
    calls = modes(layer, dev, sms, budgets, has_rule)
    row: dict = {"phase": shape.phase, "tokens": shape.tokens, "context": shape.context, "keys": keys, "sms": sms,
                 "budgets": budgets}
    if has_rule:  # what the rule picks in a captured graph and eagerly, and the host time of deciding it eagerly
        row["rule_budget"], row["rule_budget_eager"] = (
            side_budget(shape.tokens, shape.context, sms, rule_bands(impl.fn.rule_for(dev), capturing, layer.k_format))
            for capturing in (True, False))
        row["schedule_us"] = schedule_us(dev, shape, layer.k_format)
    for fn in calls.values():  # compile and warm every path once
        fn()
    # The indices under the smallest budget, those of the whole device (a row's order is unspecified: sorted).
    whole = layer.side().clone().sort(dim=1).values
    row["budget_equal"] = bool(torch.equal(whole, calls[f"side@{budgets[0]}"]().clone().sort(dim=1).values))
    graph = alternating_graph_us(calls, dev, rounds=rounds, burst=5, shuffle_seed=0)
    eager_rounds = 3 * rounds if eager_rounds is None else eager_rounds
    eager, paired = alternating_eager_us(calls, dev, rounds=eager_rounds)
    for tag, us in (("graph", graph), ("eager", eager)):
        side, main, serial_us = us["side"], us["main"], us["serial"]
        out = {"side_us": side, "main_us": main, "serial_us": serial_us, "modes": {},
               "copy_us": us["copy"], "copy_overlap": overlapped(us["copy"], main, us["copy overlap"],
                                                                  us["copy"] + main)}
        for name, both in us.items():
            if name in ("side", "main", "copy", "copy overlap"):
                continue
            if name.startswith(("side@", "main@")):
                out[name.replace("@", "_us@")] = both
                continue
            out["modes"][name] = overlapped(side, main, both, serial_us)
            if tag == "eager":
                out["modes"][name]["vs_serial_paired"] = paired[name]
        row[tag] = out
    del layer
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def print_row(row: dict) -> None:
    print(f"\n{row['phase']} {row['tokens']} x {row['context']} ({row['keys']} keys)  budgets {row['budgets']}"
          + (f"  rule -> {row['rule_budget']} (eager {row['rule_budget_eager']}, decided in "
             f"{row['schedule_us']:.1f} us)" if "rule_budget" in row else "")
          + f"  equal under a budget: {row['budget_equal']}")
    for tag in ("graph", "eager"):
        r = row[tag]
        cells = "  ".join(f"{name} {m['us']:.1f} ({m['hidden']:+.0%}, {m['vs_serial']:.3f}x"
                          + (f", paired {m['vs_serial_paired']:.3f}x)" if "vs_serial_paired" in m else ")")
                          for name, m in r["modes"].items())
        alone = {part: " ".join(f"{k.split('@')[1]}:{v:.1f}" for k, v in r.items() if k.startswith(f"{part}_us@"))
                 for part in ("side", "main")}
        c = r["copy_overlap"]
        print(f"  {tag}: side {r['side_us']:.1f} (budgeted {alone['side']}) main {r['main_us']:.1f} (the rest "
              f"{alone['main']}) | {cells} | copy {r['copy_us']:.1f}, beside main {c['us']:.1f} ({c['hidden']:+.0%}, "
              f"{c['vs_serial']:.3f}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON report path")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    p.add_argument("--budgets", default="0.25,0.33,0.485,0.6,0.75",
                   help="side budgets as fractions of the SMs (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=20, help="alternating graph rounds (default: %(default)s)")
    p.add_argument("--eager-rounds", type=int, default=None,
                   help="alternating eager rounds (default: three times --rounds)")
    p.add_argument("--only", default=None, help="phase to run (decode or prefill)")
    p.add_argument("--min-tokens", type=int, default=0, help="only shapes of at least this many tokens")
    p.add_argument("--min-context", type=int, default=0, help="only shapes of at least this context")
    p.add_argument("--keys", default="fp8", choices=("fp8", "mxfp4"),
                   help="the index cache's key format (default: %(default)s; mxfp4: DeepSeek-V4's)")
    p.add_argument("--blas", default=None, choices=("cublas", "cublaslt"),
                   help="torch's preferred BLAS library for the layer's matmuls (default: torch's choice)")
    args = p.parse_args(argv)
    dev = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if dev.type == "cpu" and not args.smoke:
        print("no GPU: run with --smoke to check the script", file=sys.stderr)
        return 2
    fractions = [float(f) for f in args.budgets.split(",")]
    shapes = [s for s in (SMOKE if args.smoke else FULL) if args.only in (None, s.phase)
              and s.tokens >= args.min_tokens and s.context >= args.min_context]
    if args.blas and dev.type == "cuda":
        torch.backends.cuda.preferred_blas_library(args.blas)
    report = {"what": "overlap_gpu", "date": now(), "commit": checkout_commit(), "device": device_name(dev),
              "versions": versions(), "smoke": args.smoke, "keys": args.keys, "blas": args.blas,
              "carveout": hasattr(torch._C, "_set_sm_carveout_experimental"),
              "partitions": dev.type == "cuda" and partition.available(), "rows": []}
    for shape in shapes:
        try:
            row = measure(shape, dev, fractions, args.smoke, 3 if args.smoke else args.rounds, args.keys,
                          3 if args.smoke else args.eager_rounds)
        except Exception as exc:  # noqa: BLE001  (report the shape that failed, go on with the rest)
            row = {"phase": shape.phase, "tokens": shape.tokens, "context": shape.context,
                   "error": f"{type(exc).__name__}: {exc}"}
            print(f"\n{shape.name}: {row['error']}")
        else:
            print_row(row)
        report["rows"].append(row)
        if args.out:
            write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
