"""Ragged verify rows against the uniform ``next_n`` call at the same rows, on one GPU (issue 39).

    pip install -e . && python bench/ragged_gpu.py --out out/ragged.json

``--requests`` requests of ``--context`` keys verify ``--next-n`` draft tokens each (H = 64, D = 128, page 64, fp8,
k 2048): ``paged_mqa_logits`` and ``paged_topk_translate`` once in the uniform form (``q [B, next_n, H, D]``) and once
as ragged rows (``q [B * next_n, 1, H, D]``, ``row_to_batch``, each row's own length), the same rows and keys. First
the ragged logits are checked against the uniform ones (-inf placement equal, relative RMS error ≤ 1e-3); then each
call is captured in a CUDA graph and the graphs are replayed in turns (``--rounds`` rounds of ``--burst`` replays; the
card is power-capped), the median a call reported with the ratio ragged / uniform (the issue's goal: ≤ 1.05). Writes
one JSON with the commit, device and versions. ``--smoke``: tiny shapes interpreted on the CPU, the host clock: checks
the script only.
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
from indexcache.hal.specs.mqa_logits import check_logits

H, D, PAGE, K = 64, 128, 64, 2048
FP8 = torch.float8_e4m3fn
BOUND = 1e-3


def inputs(requests: int, context: int, next_n: int, dev: torch.device, gen: torch.Generator) -> dict:
    """The uniform call's arguments and the ragged rows' ``q``, ``context_lens`` and ``row_to_batch``."""
    per = -(-context // PAGE)
    cache = new_packed_cache(requests * per, PAGE, D)
    keys, scales = split_packed_cache(cache, D, FP8)
    keys.copy_((torch.randn(keys.shape, generator=gen) * 2).to(FP8))
    scales.copy_(torch.rand(scales.shape, generator=gen) * 0.01 + 1e-3)
    rows = requests * next_n
    built = dict(cache=cache, table=torch.randperm(requests * per, generator=gen).to(torch.int32).view(requests, per),
                 q=(torch.randn(requests, next_n, H, D, generator=gen) * 3).to(FP8),
                 weights=torch.randn(rows, H, generator=gen) / H,
                 lens=torch.full((requests,), context, dtype=torch.int32),
                 row_to_batch=torch.arange(requests).repeat_interleave(next_n).to(torch.int32),
                 row_lens=(context - next_n + 1 + torch.arange(next_n).repeat(requests)).to(torch.int32))
    built = {name: t.to(dev) for name, t in built.items()}
    k = min(K, context)
    built.update(rows=rows, context=context, k=k,
                 **{f"logits_{f}": torch.empty(rows, context, device=dev) for f in ("uniform", "ragged")},
                 **{f"out_{f}": torch.empty(rows, k, dtype=torch.int32, device=dev) for f in ("uniform", "ragged")})
    return built


def calls(a: dict) -> dict[tuple[str, str], object]:
    """``{(op, form): call}``: the uniform and the ragged form of both ops on the same rows and keys."""
    ragged_q = a["q"].view(a["rows"], 1, H, D)

    def logits(form: str) -> None:
        if form == "uniform":
            indexcache.paged_mqa_logits(a["q"], a["cache"], a["weights"], a["lens"], a["table"], a["context"],
                                        out=a["logits_uniform"])
        else:
            indexcache.paged_mqa_logits(ragged_q, a["cache"], a["weights"], a["row_lens"], a["table"], a["context"],
                                        out=a["logits_ragged"], row_to_batch=a["row_to_batch"])

    def producer(form: str) -> None:
        if form == "uniform":
            indexcache.paged_topk_translate(a["q"], a["cache"], a["weights"], a["lens"], a["table"], a["context"],
                                            a["k"], a["table"], PAGE, logits=a["logits_uniform"], out=a["out_uniform"])
        else:
            indexcache.paged_topk_translate(ragged_q, a["cache"], a["weights"], a["row_lens"], a["table"],
                                            a["context"], a["k"], a["table"], PAGE, logits=a["logits_ragged"],
                                            out=a["out_ragged"], row_to_batch=a["row_to_batch"])

    return {(op, form): (lambda fn=fn, form=form: fn(form)) for op, fn in (("paged_mqa_logits", logits),
                                                                           ("paged_topk_translate", producer))
            for form in ("uniform", "ragged")}


def check(a: dict) -> str:
    """"" when the ragged logits equal the uniform ones within BOUND (-inf placement equal), else what differs."""
    return check_logits(a["logits_ragged"], a["logits_uniform"], BOUND)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="ragged.json", help="the JSON report")
    parser.add_argument("--requests", type=int, default=64, help="requests (default 64)")
    parser.add_argument("--context", type=int, default=32768, help="keys a request (default 32768)")
    parser.add_argument("--next-n", type=int, default=2, help="draft tokens a request (default 2)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of alternating graph replays")
    parser.add_argument("--burst", type=int, default=20, help="back-to-back replays a call in a round")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes interpreted on the CPU: checks the script")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU visible: this script times GPU kernels (pass --smoke to check it on tiny CPU shapes)")
        return 2
    dev = torch.device("cpu" if args.smoke else "cuda")
    requests, context, next_n = (3, 150, 2) if args.smoke else (args.requests, args.context, args.next_n)
    rounds, burst = (1, 1) if args.smoke else (args.rounds, args.burst)
    a = inputs(requests, context, next_n, dev, torch.Generator().manual_seed(39))
    fns = calls(a)
    fns[("paged_mqa_logits", "uniform")]()
    fns[("paged_mqa_logits", "ragged")]()
    problem = check(a)
    times = alternating_graph_us(fns, dev, rounds, burst)
    rows = [dict(op=op, uniform_us=round(times[(op, "uniform")], 2), ragged_us=round(times[(op, "ragged")], 2),
                 ratio=round(times[(op, "ragged")] / times[(op, "uniform")], 3))
            for op in ("paged_mqa_logits", "paged_topk_translate")]
    report = {**report_head(dev), "rows": rows,
              "shape": dict(requests=requests, context=context, next_n=next_n, heads=H, dim=D, page=PAGE, k=a["k"]),
              "errors": [f"ragged logits against uniform: {problem}"] if problem else []}
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  commit {report['commit']}")
    print_rows(f"ragged rows / uniform next_n ({requests} x {context} keys, next_n {next_n}; median µs a call)", rows,
               ["op", "uniform_us", "ragged_us", "ratio"])
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
