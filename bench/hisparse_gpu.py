"""HiSparse on one GPU (issue 40; docs/hisparse.md): the plan of a decode step, a layer's swap-in against the
host link, and a 61-layer step planned once per producer.

    pip install -e . && python bench/hisparse_gpu.py --out out/hisparse.json

``--requests`` requests of ``--context`` tokens each (longer than the hot buffer), top-k ``--k``, hot buffers of
``--hot`` slots, DeepSeek's fp8 MLA KV rows of 656 bytes in pinned host memory, a decode loop whose selections drift by
``--drift`` positions a request a step (a ring of ``--steps`` selections, the state warmed over it first):

- ``plan``: ``indexcache.hisparse_plan`` of one step (the ring's steps in one graph, the time per step), with a slot
  index kept over the ring (``slot_index=``) and without one (a state of its own, planned alike);
- ``swap-in``: ``indexcache.hisparse_swap_in`` of the ring's steps' misses for one layer, and for a producer group of
  ``--group`` layers in one call (each layer its own device buffer; in the host one pool holding a token's rows of
  the group together, or a pool a layer), their bytes per second against a contiguous pinned host → device copy of
  256 MiB in the same run (``h2d``: the link's bandwidth as the copy engine reaches it);
- a 61-layer decode step through ``IndexerRunner`` with the hot buffers attached (``layer(..., hot=)``, keeping a
  slot index a producer), at
  ``index_topk_freq`` 1 and 4: the whole HiSparse part of the step (each producer selects — a copy of the ring's
  next selection here —, plans and swaps in; each shared layer swaps in with its producer's plan; at freq 4 also
  with each producer swapping in its group's layers at once) and the plans alone as the runner issues them (one a
  producer).

Each contender is captured in a CUDA graph and the graphs are replayed in turns (``--rounds`` rounds of ``--burst``
replays); medians. Writes one JSON with the commit, device and versions. ``--smoke``: tiny shapes on the CPU with
the torch backend and the host clock: checks the script only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import indexcache
from indexcache.bench.output import finish, print_rows
from indexcache.bench.provenance import report_head
from indexcache.bench.timing import alternating_graph_us
from indexcache.hal.hisparse import empty_state
from indexcache.hal.slot_index import index_width
from indexcache.plan import LayerPlan
from indexcache.runtime.hot import HotBuffers, HotLayer
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import TopkState

ROW_BYTES = 656  # DeepSeek-V3.2's fp8 MLA KV row: 512 fp8 values, 16 bytes of scales, 64 bf16 RoPE values
LAYERS = 61
PAGE = 64
H2D_BYTES = 256 * 2**20


def ring(requests: int, context: int, k: int, steps: int, drift: int, gen: torch.Generator) -> torch.Tensor:
    """``[steps, requests, k]`` int32 selections of a decode loop: distinct positions below ``context - 1``, each
    step replacing ``drift`` of the last one's with fresh ones."""
    raw = torch.stack([torch.randperm(context - 1, generator=gen)[:k] for _ in range(requests)])
    out = []
    for _ in range(steps):
        fresh = torch.randint(0, context - 1, (requests, drift), generator=gen)
        at = torch.stack([torch.randperm(k, generator=gen)[:drift] for _ in range(requests)])
        raw = raw.scatter(1, at, fresh)
        out.append(raw)
    return torch.stack(out).to(torch.int32)


class RingTopk(TopkState):
    """A producer's selection taken from a ring of selections on the device, the next one at each call (a device
    counter: the graph replays walk the ring too), so every step plans real misses."""

    def __init__(self, selections: torch.Tensor, device: torch.device) -> None:
        steps, rows, k = selections.shape
        super().__init__(rows, k, device)
        self.selections = selections.to(device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)

    def select(self, scores, lengths, page_table, page_size, *, row_starts, row_to_batch, out, out_raw):
        at = self.counter.remainder(self.selections.shape[0])
        out_raw.copy_(self.selections.index_select(0, at)[0])
        self.counter.add_(1)
        return out


def check(name: str, state: TopkState, layer: HotLayer) -> list[str]:
    """The last layer of a step read what its producer selected: each selected position's device row holds its host
    row."""
    raw, rows = state.raw[:state.rows].cpu().long(), state.hot.device_rows[:state.rows].cpu().long()
    want = layer.host_kv[layer.host_loc.cpu().long().gather(1, raw.clamp_min(0))]
    got = layer.device_kv.cpu()[rows.clamp_min(0)]
    bad = ((raw >= 0) & ((rows < 0) | (got != want).any(-1))).sum()
    return [f"{name}: {int(bad)} selected positions read another row"] if bad else []


def check_group(copies, host_kv: list, device_kv: list, device_loc: torch.Tensor) -> list[str]:
    """After the group's swap-ins of the ring: each layer's device rows of the ring's copies hold their host rows (the
    last copy into a row wins, as every later step's copies overwrite earlier ones)."""
    errors = []
    loc = device_loc.cpu().long()
    final = {}
    for src, dst, count in copies:
        src, dst, count = src.cpu(), dst.cpu().long(), count.cpu()
        for r in range(count.shape[0]):
            n = int(count[r])
            for s, d in zip(src[r, :n].tolist(), loc[r, dst[r, :n]].tolist(), strict=True):
                final[d] = s
    rows = torch.tensor(list(final), dtype=torch.long), torch.tensor(list(final.values()), dtype=torch.long)
    for g, (host, device) in enumerate(zip(host_kv, device_kv, strict=True)):
        bad = (device.cpu()[rows[0]] != host[rows[1]]).any(-1).sum()
        if bad:
            errors.append(f"group layer {g}: {int(bad)} copied rows differ from their host rows")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="hisparse.json", help="the JSON report")
    parser.add_argument("--requests", type=int, default=64, help="requests (default 64)")
    parser.add_argument("--context", type=int, default=32768, help="tokens a request (default 32768)")
    parser.add_argument("--k", type=int, default=512, help="top-k (default 512)")
    parser.add_argument("--hot", type=int, default=4096, help="hot-buffer slots a request (default 4096)")
    parser.add_argument("--drift", type=int, default=64, help="new positions a request a step (default 64)")
    parser.add_argument("--steps", type=int, default=64, help="selections in the ring (default 64: with the drift, "
                        "more distinct tokens than the hot buffer holds, so every lap misses)")
    parser.add_argument("--group", type=int, default=4, help="layers of the group swap-in (default 4: freq 4)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of alternating graph replays")
    parser.add_argument("--burst", type=int, default=10, help="back-to-back replays a contender in a round")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU visible: this script times GPU kernels (pass --smoke to check it on tiny CPU shapes)")
        return 2
    if args.smoke:
        args.requests, args.context, args.k, args.hot, args.drift, args.steps = 3, 300, 16, 24, 8, 3
        args.rounds, args.burst = 1, 1
    with indexcache.use_backend("torch") if args.smoke else contextlib.nullcontext():
        return run(args)


def run(args: argparse.Namespace) -> int:
    """The measurements of :func:`main`'s arguments."""
    dev = torch.device("cpu" if args.smoke else "cuda")
    b, n, k, hot, steps = args.requests, args.context, args.k, args.hot, args.steps
    gen = torch.Generator().manual_seed(40)
    selections = ring(b, n, k, steps, args.drift, gen)
    seq_lens = torch.full((b,), n, dtype=torch.int32, device=dev)
    host_loc = (torch.arange(b * n, dtype=torch.int32).view(b, n)).to(dev)
    host_kv = torch.randint(0, 256, (b * n, ROW_BYTES), generator=gen, dtype=torch.uint8)
    host_kv = host_kv if args.smoke else host_kv.pin_memory()
    device_kv = torch.zeros(b * (hot + 1) + 1, ROW_BYTES, dtype=torch.uint8, device=dev)
    device_loc = torch.arange(b * (hot + 1), dtype=torch.int32, device=dev).view(b, hot + 1)
    raws = selections.to(dev)

    # One step's plan and one layer's swap-in, over the ring.
    tokens, ages = empty_state(b, hot, dev)
    plans = [dict(out=torch.empty(b, k, dtype=torch.int32, device=dev),
                  out_copy_src=torch.empty(b, k, dtype=torch.int64, device=dev),
                  out_copy_dst=torch.empty(b, k, dtype=torch.int32, device=dev),
                  out_copy_count=torch.empty(b, dtype=torch.int32, device=dev)) for _ in range(steps)]

    index = torch.empty(b, index_width(hot, n), dtype=torch.int32, device=dev)  # the slot index, kept over the ring
    plain_tokens, plain_ages = empty_state(b, hot, dev)

    def plan_ring() -> None:
        for s in range(steps):
            indexcache.hisparse_plan(raws[s], seq_lens, host_loc, tokens, ages, host_rows=b * n, slot_index=index,
                                     **plans[s])

    def plan_ring_plain() -> None:
        for s in range(steps):
            indexcache.hisparse_plan(raws[s], seq_lens, host_loc, plain_tokens, plain_ages, host_rows=b * n,
                                     **plans[s])

    for _ in range(2):  # fill the buffers, then one lap from a warm state
        plan_ring_plain()
        plan_ring()
    copies = [(p["out_copy_src"].clone(), p["out_copy_dst"].clone(), p["out_copy_count"].clone()) for p in plans]
    misses = sum(int(c[2].sum()) for c in copies)

    def swap_ring() -> None:
        for c in copies:
            indexcache.hisparse_swap_in(*c, host_kv, device_kv, device_loc)

    # A group's layers: each its own device buffer; in the host, one pool holding a token's rows of the group
    # together (token-major: one launch), or a pool a layer (a launch a layer). Every layer's rows equal host_kv's.
    pool = torch.empty(b * n, args.group, ROW_BYTES, dtype=torch.uint8, pin_memory=not args.smoke)
    for g in range(args.group):
        pool[:, g].copy_(host_kv)
    group_host = {"token-major": [pool[:, g] for g in range(args.group)],
                  "pools": [host_kv] + [host_kv.clone().pin_memory() if not args.smoke else host_kv.clone()
                                        for _ in range(args.group - 1)]}
    group_device = [device_kv] + [torch.zeros_like(device_kv) for _ in range(args.group - 1)]

    def swap_ring_group(layout: str = "token-major", layers: int = args.group) -> None:
        host, device = group_host[layout][:layers], group_device[:layers]
        for c in copies:
            indexcache.hisparse_swap_in(*c, host if layers > 1 else host[0], device if layers > 1 else device[0],
                                        device_loc)

    contiguous = host_kv.view(-1)[:min(H2D_BYTES, host_kv.numel())]
    landing = torch.empty_like(contiguous, device=dev)

    def h2d() -> None:
        landing.copy_(contiguous, non_blocking=True)

    # The 61-layer step at freq 1 and 4.
    step_calls, plan_counts, errors = {}, {}, []
    # Each layer its own device KV (the groups' buffers differ: a shared one would mix their slots); one host KV,
    # read by every layer alike.
    layer_kv = torch.zeros(LAYERS, *device_kv.shape, dtype=torch.uint8, device=dev)
    layers = [HotLayer(host_kv, layer_kv[i], device_loc, seq_lens, host_loc) for i in range(LAYERS)]
    table = torch.arange(b * -(-n // PAGE), dtype=torch.int32, device=dev).view(b, -1)
    dummy = torch.zeros(b, 1, device=dev)
    for freq, grouped in ((1, False), (4, False), (4, True)):
        plan = LayerPlan(LAYERS, index_topk_freq=freq, index_topk=k, page_size=PAGE)
        runner = IndexerRunner(plan)
        state = RingTopk(selections, dev)
        state.hot = HotBuffers(plan.producers, b, hot, b, k, dev, index_tokens=n)
        plan_counts[freq] = len(plan.producers)
        step_layers = layers
        if grouped:  # a producer swaps in its group's layers at once, its shared layers copy nothing
            groups = {p: [i for i in runner.layers if runner.source_of(i) == p] for p in plan.producers}
            step_layers = [HotLayer([host_kv] * len(groups[i]), [layer_kv[j] for j in groups[i]], device_loc,
                                    seq_lens, host_loc) if i in groups else
                           HotLayer(None, None, device_loc, seq_lens, host_loc) for i in range(LAYERS)]

        def step(runner=runner, state=state, step_layers=step_layers) -> None:
            runner.begin(state, b)
            for i in runner.layers:
                runner.layer(i, state, scores=lambda: dummy, lengths=seq_lens, page_table=table, hot=step_layers[i])

        def plans_only(runner=runner, state=state) -> None:
            for p in runner.plan.producers:
                state.hot.plan(p, state.raw[:b], layers[p])

        for _ in range(steps):
            step()
        name = f"f{freq}" + (" grouped" if grouped else "")
        errors += check(f"freq {name}", state, layers[-1])
        step_calls[f"step {name}"] = step
        if not grouped:
            step_calls[f"plans {name}"] = plans_only

    swap_calls = {"swap ring group": swap_ring_group,
                  "swap ring group pools": lambda: swap_ring_group("pools"),
                  "swap ring token-major layer": lambda: swap_ring_group(layers=1)}
    for layout in group_host:
        for layer in group_device:
            layer.zero_()
        swap_ring_group(layout)
        errors += check_group(copies, group_host[layout], group_device, device_loc)
    contenders = {"plan ring": plan_ring, "plan ring plain": plan_ring_plain, "swap ring": swap_ring, **swap_calls,
                  "h2d": h2d, **step_calls}
    times = alternating_graph_us(contenders, dev, args.rounds, args.burst)
    plan_us = times["plan ring"] / steps
    h2d_gbs = contiguous.numel() / (times["h2d"] * 1e3)

    def swap_row(what: str, us: float, layers: int) -> dict:
        gbs = layers * misses * ROW_BYTES / (us * 1e3)
        return dict(what=what, us=round(us / steps, 2), misses=round(layers * misses / steps, 1),
                    gb_per_s=round(gbs, 2), of_h2d=round(gbs / h2d_gbs, 3))

    rows = [dict(what="plan (a step)", us=round(plan_us, 2)),
            dict(what="plan without a slot index", us=round(times["plan ring plain"] / steps, 2)),
            swap_row("swap-in (a step, one layer)", times["swap ring"], 1),
            swap_row(f"swap-in (a step, a group of {args.group} layers in one call, token-major host pool)",
                     times["swap ring group"], args.group),
            swap_row(f"swap-in (a step, a group of {args.group} layers in one call, a host pool a layer)",
                     times["swap ring group pools"], args.group),
            swap_row("swap-in (a step, one layer of the token-major host pool)",
                     times["swap ring token-major layer"], 1),
            dict(what=f"h2d copy {contiguous.numel() >> 20} MiB", us=round(times["h2d"], 2),
                 gb_per_s=round(h2d_gbs, 2))]
    for freq in (1, 4):
        rows.append(dict(what=f"61-layer step, freq {freq} ({plan_counts[freq]} plans)",
                         us=round(times[f"step f{freq}"], 2), plans_us=round(times[f"plans f{freq}"], 2)))
    rows.append(dict(what=f"61-layer step, freq 4 ({plan_counts[4]} plans), a swap-in a group",
                     us=round(times["step f4 grouped"], 2)))
    ratio = dict(plans_f4_per_f1=round(times["plans f4"] / times["plans f1"], 3),
                 step_f4_per_f1=round(times["step f4"] / times["step f1"], 3),
                 step_f4_grouped_per_f4=round(times["step f4 grouped"] / times["step f4"], 3))
    report = {**report_head(dev), "rows": rows, "ratios": ratio, "errors": errors,
              "shape": dict(requests=b, context=n, k=k, hot=hot, drift=args.drift, ring=steps, row_bytes=ROW_BYTES,
                            layers=LAYERS)}
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  commit {report['commit']}")
    print_rows(f"HiSparse ({b} requests x {n} tokens, k {k}, H {hot}; median µs in a graph)", rows,
               ["what", "us", "misses", "gb_per_s", "of_h2d", "plans_us"])
    print(ratio)
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
