"""Short rows in the producer step of decode, on one GPU (issue 39; docs/ops.md, "Short rows").

    pip install -e . && python bench/short_rows_gpu.py --out out/short_rows.json

``--requests`` requests (H = 64, D = 128, page 64, fp8, k 2048, next_n 1) in four batches:

- ``short graph``: every context drawn from 100-2048 and ``max_context_len`` 2048 (at most k: a short-context CUDA
  graph), where the step is one launch;
- ``long graph``: the same contexts in a graph captured for ``--context`` keys, where the logits kernel leaves the
  short requests out and the top-k fills their rows;
- ``mixed``: half of the requests short, half of ``--context`` keys;
- ``long``: every request of ``--context`` keys (nothing to leave out: the step must not be slower for it).

Each batch's producer step (``indexcache.paged_topk_translate``) is timed beside our two ops that it composes
(``paged_mqa_logits`` over every row, then ``topk_translate``: the step as it ran before short rows were left out)
and, on the short batches, ``translate`` alone of the step's selection (the least a step can cost).

Then the producer step of prefill (``indexcache.mqa_topk_translate``) beside its two ops (``mqa_logits`` over the
whole ``[T, N]``, then ``topk_translate`` with the windows' starts), causal ragged chunks: ``--prompts`` prompts of
``--prompt`` tokens (every window short, ``N`` their sum), one prompt of 3/4 k tokens (``N <= k``: one launch), and
one request's 4096-token chunk over 32K keys (no window short: nothing to leave out). The step's
selection is checked against the two ops' (the same index sets a row). Each call is captured in a CUDA graph and the
graphs are replayed in turns (``--rounds`` rounds of ``--burst`` replays; the card is power-capped); the median a
call is reported with the ratios step / two ops and step / translate. Writes one JSON with the commit, device and
versions. ``--smoke``: tiny shapes interpreted on the CPU, the host clock: checks the script only.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:  # before Triton is imported: the kernels run interpreted on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import torch

import indexcache
from indexcache.bench.output import finish, print_rows
from indexcache.bench.provenance import report_head
from indexcache.bench.timing import alternating_graph_us
from indexcache.hal.layout import new_packed_cache, split_packed_cache

H, D, PAGE, K = 64, 128, 64, 2048
FP8 = torch.float8_e4m3fn


def batch_inputs(contexts: torch.Tensor, max_context: int, k: int, dev: torch.device, gen: torch.Generator) -> dict:
    """A producer step's arguments for requests of ``contexts`` keys in logits of ``max_context`` columns (random
    keys and scales, a table of distinct pages, the KV table the index table), outputs and the two ops' buffers."""
    requests = contexts.shape[0]
    per = -(-max_context // PAGE)
    cache = new_packed_cache(requests * per, PAGE, D)
    keys, scales = split_packed_cache(cache, D, FP8)
    keys.copy_((torch.randn(keys.shape, generator=gen) * 2).to(FP8))
    scales.copy_(torch.rand(scales.shape, generator=gen) * 0.01 + 1e-3)
    built = dict(cache=cache, table=torch.randperm(requests * per, generator=gen).to(torch.int32).view(requests, per),
                 q=(torch.randn(requests, 1, H, D, generator=gen) * 3).to(FP8),
                 weights=torch.randn(requests, H, generator=gen) / H, lens=contexts.to(torch.int32),
                 logits=torch.empty(requests, max_context), two_logits=torch.empty(requests, max_context),
                 **{name: torch.empty(requests, k, dtype=torch.int32)
                    for name in ("out", "raw", "two_out", "two_raw", "slots")})
    built = {name: t.to(dev) for name, t in built.items()}
    built.update(workspace=torch.empty(max(1, indexcache.workspace_bytes(
        "topk_translate", built["two_logits"], built["lens"], k, built["table"], PAGE, out=built["two_out"],
        out_raw=built["two_raw"])), dtype=torch.uint8, device=dev), context=max_context, k=k)
    return built


def calls(a: dict, short: bool) -> dict[str, object]:
    """``{contender: call}``: the step, our two ops, and (``short``) translate of the step's selection."""
    def step() -> None:
        indexcache.paged_topk_translate(a["q"], a["cache"], a["weights"], a["lens"], a["table"], a["context"], a["k"],
                                        a["table"], PAGE, logits=a["logits"], out=a["out"], out_raw=a["raw"])

    def two_ops() -> None:
        indexcache.paged_mqa_logits(a["q"], a["cache"], a["weights"], a["lens"], a["table"], a["context"],
                                    out=a["two_logits"])
        indexcache.topk_translate(a["two_logits"], a["lens"], a["k"], a["table"], PAGE, out=a["two_out"],
                                  out_raw=a["two_raw"], workspace=a["workspace"])

    def translate() -> None:
        indexcache.translate(a["raw"], a["table"], a["lens"], PAGE, out=a["slots"])

    return {"step": step, "two_ops": two_ops, **({"translate": translate} if short else {})}


def prefill_inputs(prompts: list[int], new: list[int], k: int, dev: torch.device, gen: torch.Generator) -> dict:
    """A ragged causal prefill chunk: request ``b``'s last ``new[b]`` of ``prompts[b]`` keys are its queries, each
    seeing its request's keys up to itself; a KV table row a request; outputs and the two ops' buffers."""
    starts = torch.tensor([0, *prompts]).cumsum(0)
    ks = torch.cat([torch.full((n,), int(s)) for s, n in zip(starts[:-1], new, strict=True)])
    ke = torch.cat([s + p - n + 1 + torch.arange(n) for s, p, n in zip(starts[:-1], prompts, new, strict=True)])
    r2b = torch.cat([torch.full((n,), b) for b, n in enumerate(new)])
    tokens, keys = ks.shape[0], int(starts[-1])
    pages = -(-max(prompts) // PAGE)
    built = dict(q=(torch.randn(tokens, H, D, generator=gen) * 3).to(FP8),
                 k=(torch.randn(keys, D, generator=gen) * 2).to(FP8), k_scale=torch.rand(keys, generator=gen) + 0.1,
                 weights=torch.randn(tokens, H, generator=gen) / H, ks=ks.int(), ke=ke.int(), r2b=r2b.int(),
                 table=torch.randperm(len(prompts) * pages, generator=gen).int().view(len(prompts), pages),
                 lengths=(ke - ks).int(), logits=torch.empty(tokens, keys),
                 **{name: torch.empty(tokens, k, dtype=torch.int32) for name in ("raw", "out", "two_raw", "two_out")})
    built = {name: t.to(dev) for name, t in built.items()}
    built.update(workspace=torch.empty(max(1, indexcache.workspace_bytes(
        "topk_translate", built["logits"], built["lengths"], k, built["table"], PAGE, row_starts=built["ks"],
        row_to_batch=built["r2b"], out=built["two_out"], out_raw=built["two_raw"])), dtype=torch.uint8, device=dev),
        k_top=k)
    return built


def prefill_calls(a: dict) -> dict[str, object]:
    """``{contender: call}``: the prefill producer step and its two ops."""
    def step() -> None:
        indexcache.mqa_topk_translate(a["q"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"], a["k_top"],
                                      a["table"], PAGE, row_to_batch=a["r2b"], out=a["out"], out_raw=a["raw"])

    def two_ops() -> None:
        indexcache.mqa_logits(a["q"], a["k"], a["k_scale"], a["weights"], a["ks"], a["ke"], out=a["logits"])
        indexcache.topk_translate(a["logits"], a["lengths"], a["k_top"], a["table"], PAGE, row_starts=a["ks"],
                                  row_to_batch=a["r2b"], out=a["two_out"], out_raw=a["two_raw"],
                                  workspace=a["workspace"])

    return {"step": step, "two_ops": two_ops}


def check(name: str, a: dict) -> list[str]:
    """The step's selection against the two ops' (index sets a row), physical and raw."""
    errors = []
    for got, want in (("raw", "two_raw"), ("out", "two_out")):
        if not torch.equal(a[got].sort(dim=1).values, a[want].sort(dim=1).values):
            errors.append(f"{name}: the step's {got} differs from the two ops'")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="short_rows.json", help="the JSON report")
    parser.add_argument("--requests", type=int, default=64, help="requests a batch (default 64)")
    parser.add_argument("--context", type=int, default=32768, help="keys of a long request (default 32768)")
    parser.add_argument("--prompts", type=int, default=16, help="short prompts of a prefill chunk (default 16)")
    parser.add_argument("--prompt", type=int, default=512, help="tokens a short prompt (default 512)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of alternating graph replays")
    parser.add_argument("--burst", type=int, default=20, help="back-to-back replays a call in a round")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes interpreted on the CPU: checks the script")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU visible: this script times GPU kernels (pass --smoke to check it on tiny CPU shapes)")
        return 2
    dev = torch.device("cpu" if args.smoke else "cuda")
    requests, long, k, low, high = ((4, 320, 64, 10, 64) if args.smoke
                                    else (args.requests, args.context, K, 100, K))
    rounds, burst = (1, 1) if args.smoke else (args.rounds, args.burst)
    gen = torch.Generator().manual_seed(39)
    short = torch.randint(low, high + 1, (requests,), generator=gen)
    half = torch.where(torch.arange(requests) % 2 == 0, short, long)
    batches = {"short graph": (short, high), "long graph": (short, long), "mixed": (half, long),
               "long": (torch.full((requests,), long), long)}
    rows, errors = [], []
    for name, (contexts, max_context) in batches.items():
        a = batch_inputs(contexts, max_context, k, dev, gen)
        fns = calls(a, short=name.endswith("graph"))
        for fn in fns.values():
            fn()
        errors += check(name, a)
        times = alternating_graph_us(fns, dev, rounds, burst)
        row = dict(batch=name, max_context_len=max_context, step_us=round(times["step"], 2),
                   two_ops_us=round(times["two_ops"], 2), step_per_two_ops=round(times["step"] / times["two_ops"], 3))
        if "translate" in times:
            row.update(translate_us=round(times["translate"], 2),
                       step_per_translate=round(times["step"] / times["translate"], 3))
        rows.append(row)
    prefill_rows = []
    count, size = (2, 40) if args.smoke else (args.prompts, args.prompt)
    prefills = {f"{count} prompts of {size}": ([size] * count, [size] * count),
                f"one prompt of {3 * k // 4} (N <= k)": ([3 * k // 4], [3 * k // 4])}
    if not args.smoke:
        prefills[f"4096 x {long} causal"] = ([long], [4096])
    for name, (prompts, new) in prefills.items():
        a = prefill_inputs(prompts, new, k, dev, gen)
        fns = prefill_calls(a)
        for fn in fns.values():
            fn()
        errors += check(f"prefill {name}", a)
        times = alternating_graph_us(fns, dev, rounds, burst)
        prefill_rows.append(dict(chunk=name, tokens=a["q"].shape[0], keys=a["k"].shape[0],
                                 step_us=round(times["step"], 2), two_ops_us=round(times["two_ops"], 2),
                                 step_per_two_ops=round(times["step"] / times["two_ops"], 3)))
    report = {**report_head(dev), "rows": rows, "prefill_rows": prefill_rows, "errors": errors,
              "shape": dict(requests=requests, short_contexts=[low, high], long_context=long, heads=H, dim=D,
                            page=PAGE, k=k, next_n=1)}
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  commit {report['commit']}")
    print_rows(f"the producer step on short rows ({requests} requests, k {k}; median µs a call in a graph)", rows,
               ["batch", "max_context_len", "step_us", "two_ops_us", "step_per_two_ops", "translate_us",
                "step_per_translate"])
    print_rows(f"the producer step of prefill (k {k}; median µs a call in a graph)", prefill_rows,
               ["chunk", "tokens", "keys", "step_us", "two_ops_us", "step_per_two_ops"])
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
