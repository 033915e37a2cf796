"""The HiSparse swap-in on one GPU (issue 40, item 2): our Triton kernel reading pinned host memory against the copy
engine, and both against the host link's bandwidth.

    pip install -e . && python bench/hisparse_swap_gpu.py --out out/

One layer's host KV cache, pinned: ``--requests`` requests of ``--context`` tokens, one 656-byte row a token
(DeepSeek's fp8 MLA row: 512 fp8 values, 4 fp32 scales, 64 bf16 rope values; ``--row-bytes``), 5.5 GB at 64 × 128K.
Each request has a hot buffer of ``--hot`` + 1 device rows (``device_loc``, shuffled). For each M of ``--misses``
a plan's copy lists (``[requests, k]``, k ``--k``) carry M misses a request: random host rows of the request to
distinct random slots. Timed:

- ``kernel``: ``hisparse_swap_in``'s Triton kernel (``backends/triton/hisparse/swap.py``), reading the pinned rows
  through unified addressing, captured in a CUDA graph; the kernels of all M are replayed in turns (``--rounds``
  rounds of ``--burst`` replays; the card is power-capped), the median a call;
- ``engine``: what the copy engine needs, eager and not graph-safe: the copy lists to the host (one D2H copy and a
  synchronisation), the rows gathered on the host (``index_select`` into a pinned staging buffer), one H2D copy and a
  device scatter (``index_copy_``). Its parts are timed alone too (``engine_host_us``: to the host and the gather;
  ``engine_h2d_us``; ``engine_scatter_us``);
- ``link``: a large contiguous pinned → device ``copy_(non_blocking=True)`` (``--link-mb``), the host link's bandwidth
  in the same run; every row reports its GB/s and its share of it.

With ``--race`` the kernel is also built under each override of ``SWAP_RACE`` (the tuning entry's ``HOST_CACHE``: the
host reads past L1) and raced in the same turns as the table's, each checked the same way (the report's ``race``
rows: µs a call and the ratio to the table's at each M).

The kernel's result is checked against the rows it should hold (every device row a copy names). Writes
``hisparse_swap.json`` under ``--out`` with the commit, device and versions. ``--smoke``: tiny shapes interpreted on
the CPU (pageable memory, the host clock): checks the script only.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # before Triton is imported: the kernels run interpreted on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from indexcache.bench.output import finish, print_rows
from indexcache.bench.provenance import report_head
from indexcache.bench.timing import alternating_graph_us, median_ms, on_gpu

I32, I64 = torch.int32, torch.int64
# Overrides of the hisparse_swap_in tuning entry raced by --race (docs/hisparse.md, "The swap-in on the H200").
SWAP_RACE = [{"HOST_CACHE": ".cg"}]


def target_and_cfg(dev: torch.device):
    """The Triton target of ``dev`` (interpreted off a GPU) and its ``hisparse_swap_in`` tuning entry."""
    import importlib

    from indexcache.backends.triton.target import Target, device_gpu, vendors

    if on_gpu(dev):
        gpu = device_gpu(dev)
        target = Target(gpu)
    else:
        vendor = vendors()["cuda"]
        target = vendor.target(vendor.interpreted_arch, interpreted=True)
    tuning = importlib.import_module(f"indexcache.backends.{target.gpu.vendor.backend}.tuning").tuning(target.arch)
    return target, tuning["hisparse_swap_in"]


def host_rows(requests: int, context: int, row_bytes: int, dev: torch.device, gen: torch.Generator) -> torch.Tensor:
    """``[requests * context, row_bytes]`` uint8 of random bytes: pinned when ``dev`` is a GPU (filled from the GPU in
    chunks of about 256 MB, so that no CPU generator walks 5 GB)."""
    rows = requests * context
    if not on_gpu(dev):
        return torch.randint(0, 256, (rows, row_bytes), generator=gen, dtype=torch.uint8)
    host = torch.empty(rows, row_bytes, dtype=torch.uint8, pin_memory=True)
    step = max(1, (256 << 20) // row_bytes)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        host[start:start + n].copy_(torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, device=dev))
    torch.cuda.synchronize(dev)
    return host


def plan_lists(requests: int, context: int, hot: int, k: int, misses: int, dev: torch.device,
               gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A plan's copy lists with ``misses`` copies a request (one row a request): random host rows of the request
    (``b * context + token``) to distinct random slots below ``hot``; -1 past the count, as :func:`plan` leaves them."""
    src = torch.full((requests, k), -1, dtype=I64)
    dst = torch.full((requests, k), -1, dtype=I32)
    for b in range(requests):
        src[b, :misses] = b * context + torch.randperm(context, generator=gen)[:misses]
        dst[b, :misses] = torch.randperm(hot, generator=gen)[:misses].to(I32)
    count = torch.full((requests,), misses, dtype=I32)
    return {"copy_src": src.to(dev), "copy_dst": dst.to(dev), "copy_count": count.to(dev)}


def engine_call(lists: dict, host_kv: torch.Tensor, device_kv: torch.Tensor, device_loc: torch.Tensor,
                staging: torch.Tensor, staged: torch.Tensor) -> dict:
    """The copy engine's swap-in of ``lists`` as callables: ``whole()`` and its parts ``host()`` (the lists to the
    host, one sync, the valid copies' rows gathered into the pinned ``staging``), ``h2d()`` (staging → ``staged`` on
    the device) and ``scatter()`` (``staged`` into ``device_kv``). The parts share the state of the last ``host()``."""
    state: dict = {}

    def host() -> None:
        src, dst, count = (lists[n].to("cpu", non_blocking=False) for n in ("copy_src", "copy_dst", "copy_count"))
        k = src.shape[1]
        live = torch.arange(k)[None, :] < count.clamp(0, k)[:, None].long()
        rows = src[live]
        slots = dst[live].long()
        batch = torch.arange(src.shape[0])[:, None].expand_as(src)[live]
        n = rows.shape[0]
        torch.index_select(host_kv, 0, rows, out=staging[:n])
        state["n"] = n
        state["dst"] = device_loc[batch.to(device_loc.device), slots.to(device_loc.device)].long()

    def h2d() -> None:
        n = state["n"]
        staged[:n].copy_(staging[:n], non_blocking=True)

    def scatter() -> None:
        n = state["n"]
        device_kv.index_copy_(0, state["dst"], staged[:n])

    def whole() -> None:
        host()
        h2d()
        scatter()

    return {"whole": whole, "host": host, "h2d": h2d, "scatter": scatter}


def link_gbps(host_kv: torch.Tensor, megabytes: int, dev: torch.device) -> dict:
    """The host link's bandwidth: a contiguous pinned → device ``copy_(non_blocking=True)`` of ``megabytes`` MB."""
    flat = host_kv.view(-1)
    n = min(flat.numel(), megabytes << 20)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    ms = median_ms(lambda: dst.copy_(flat[:n], non_blocking=True), dev, 1.0, 5, 50, warmup=2)
    return {"bytes": n, "us": round(ms * 1e3, 2), "gbps": round(n / (ms * 1e-3) / 1e9, 2)}


def check(lists: dict, host_kv: torch.Tensor, device_kv: torch.Tensor, device_loc: torch.Tensor) -> str:
    """"" when every device row a copy names holds its host row (a request's slots are distinct), else what
    differs."""
    src, dst, count = (lists[n].cpu() for n in ("copy_src", "copy_dst", "copy_count"))
    live = torch.arange(src.shape[1])[None, :] < count[:, None].long()
    batch = torch.arange(src.shape[0])[:, None].expand_as(src)[live]
    rows = device_loc.cpu()[batch, dst[live].long()].long()
    got = device_kv[rows.to(device_kv.device)].cpu()
    want = host_kv[src[live]]
    bad = int((got != want).any(dim=1).sum())
    return f"{bad} of {rows.shape[0]} rows differ from their host rows" if bad else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out", help="the folder of the JSON report (hisparse_swap.json)")
    parser.add_argument("--requests", type=int, default=64, help="requests (default 64)")
    parser.add_argument("--context", type=int, default=131072, help="tokens a request on the host (default 128K)")
    parser.add_argument("--row-bytes", type=int, default=656, help="bytes a KV row (default 656: fp8 MLA)")
    parser.add_argument("--hot", type=int, default=4096, help="hot buffer slots a request (default 4096)")
    parser.add_argument("--k", type=int, default=2048, help="the copy lists' width, top-k (default 2048)")
    parser.add_argument("--misses", default="16,64,256,512", help="misses a request, comma-separated")
    parser.add_argument("--link-mb", type=int, default=1024, help="MB of the contiguous H2D copy (default 1024)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of alternating graph replays")
    parser.add_argument("--burst", type=int, default=20, help="back-to-back replays a call in a round")
    parser.add_argument("--race", action="store_true", help="also race the kernel under SWAP_RACE's overrides")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes interpreted on the CPU: checks the script")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU visible: this script times GPU kernels (pass --smoke to check it on tiny CPU shapes)")
        return 2
    from indexcache.backends.triton.hisparse.swap import swap_launches

    dev = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        requests, context, hot, k, misses, rounds, burst = 3, 64, 16, 8, [2, 8], 1, 1
    else:
        requests, context, hot, k = args.requests, args.context, args.hot, args.k
        misses, rounds, burst = [int(m) for m in args.misses.split(",")], args.rounds, args.burst
    if max(misses) > min(k, hot, context):
        parser.error(f"misses a request must be at most k, --hot and --context ({min(k, hot, context)})")
    gen = torch.Generator().manual_seed(40)
    target, cfg = target_and_cfg(dev)
    host_kv = host_rows(requests, context, args.row_bytes, dev, gen)
    device_kv = torch.zeros(requests * (hot + 1), args.row_bytes, dtype=torch.uint8, device=dev)
    device_loc = torch.randperm(device_kv.shape[0], generator=gen).to(I32).view(requests, hot + 1).to(dev)
    most = requests * max(misses)
    staging = torch.empty(most, args.row_bytes, dtype=torch.uint8, pin_memory=on_gpu(dev))
    staged = torch.empty(most, args.row_bytes, dtype=torch.uint8, device=dev)
    lists = {m: plan_lists(requests, context, hot, k, m, dev, gen) for m in misses}
    kernels = {}
    errors = []
    variants = [{}, *SWAP_RACE] if args.race else [{}]
    for overrides in variants:
        name = " ".join(f"{n}={v}" for n, v in overrides.items()) or "table"
        for m in misses:
            launch, = swap_launches(**lists[m], host_kv=host_kv, device_kv=device_kv, device_loc=device_loc,
                                    row_to_batch=None, target=target, cfg=dict(cfg, **overrides))
            device_kv.zero_()
            launch()
            problem = check(lists[m], host_kv, device_kv, device_loc)
            if problem:
                errors.append(f"kernel ({name}), {m} misses a request: {problem}")
            kernels[(name, m)] = launch.bind()
    kernel_us = alternating_graph_us(kernels, dev, rounds, burst)
    link = link_gbps(host_kv, args.link_mb, dev) if on_gpu(dev) else None
    rows = []
    for m in misses:
        calls = engine_call(lists[m], host_kv, device_kv, device_loc, staging, staged)
        device_kv.zero_()
        calls["whole"]()
        problem = check(lists[m], host_kv, device_kv, device_loc)
        if problem:
            errors.append(f"engine, {m} misses a request: {problem}")
        engine = {part: median_ms(fn, dev, 0.5, 5, 200, warmup=2) * 1e3 for part, fn in calls.items()}
        moved = requests * m * args.row_bytes
        row = dict(misses=m, copies=requests * m, bytes=moved, kernel_us=round(kernel_us["table", m], 2),
                   engine_us=round(engine["whole"], 2), engine_host_us=round(engine["host"], 2),
                   engine_h2d_us=round(engine["h2d"], 2), engine_scatter_us=round(engine["scatter"], 2),
                   kernel_gbps=round(moved / kernel_us["table", m] / 1e3, 2),
                   engine_gbps=round(moved / engine["whole"] / 1e3, 2),
                   engine_over_kernel=round(engine["whole"] / kernel_us["table", m], 3))
        if link:
            row.update(kernel_of_link=round(row["kernel_gbps"] / link["gbps"], 3),
                       engine_of_link=round(row["engine_gbps"] / link["gbps"], 3))
        rows.append(row)
    race = [dict(config=name, misses=m, kernel_us=round(us, 2), over_table=round(us / kernel_us["table", m], 3),
                 **({"kernel_of_link": round(requests * m * args.row_bytes / us / 1e3 / link["gbps"], 3)} if link
                    else {}))
            for (name, m), us in kernel_us.items() if name != "table"]
    report = {**report_head(dev), "rows": rows, "race": race, "link": link,
              "mode": "GPU" if on_gpu(dev) else "interpreted",
              "shape": dict(requests=requests, context=context, row_bytes=args.row_bytes, hot=hot, k=k,
                            host_bytes=host_kv.numel(), pinned=bool(on_gpu(dev) and host_kv.is_pinned())),
              "tuning": dict(cfg), "target": target.arch, "errors": errors,
              "median_of": dict(rounds=rounds, burst=burst)}
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  commit {report['commit']}")
    if link:
        print(f"host link: {link['gbps']} GB/s ({link['bytes'] >> 20} MB contiguous pinned -> device, "
              f"{link['us']} µs)")
    columns = ["misses", "copies", "kernel_us", "kernel_gbps", "engine_us", "engine_gbps", "engine_over_kernel",
               "engine_host_us", "engine_h2d_us", "engine_scatter_us"]
    if link:
        columns[4:4] = ["kernel_of_link"]
        columns.append("engine_of_link")
    print_rows(f"swap-in of {requests} requests x M misses, {args.row_bytes}-byte rows (median µs a call)", rows,
               columns)
    if race:
        print_rows("the kernel under SWAP_RACE's overrides (median µs a call)", race,
                   ["config", "misses", "kernel_us", "over_table", *(["kernel_of_link"] if link else [])])
    return finish(report, Path(args.out) / "hisparse_swap.json")


if __name__ == "__main__":
    sys.exit(main())
