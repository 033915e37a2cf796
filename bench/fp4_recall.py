"""Top-k recall of the indexer with fp8 and with MXFP4 keys (and MXFP4 queries) against the float64 top-k of the same
data (issue 37).

    python bench/fp4_recall.py --out benchmarks/results/cpu-fp4-recall.json

Accuracy, not speed: it runs anywhere (the torch backend on the CPU by default). Per data set, queries and keys in
bf16 (``H`` heads of ``D``, ``N`` keys, ``T`` query rows seeing every key); the truth is the float64 top-k of
``sum_h w[t, h] relu(q[t, h] . k[n])`` on those bf16 values. The queries go to fp8 as engines feed the indexer (a
scale per token and head, folded into the weights, ``quantize_index_k``); the keys to fp8 (one scale a token) or to
MXFP4 (``quantize_index_k(k, torch.float4_e2m1fn_x2, block=32)``), or both to MXFP4 (the queries a head a row,
their block scales given as ``q_scale``: what DeepGEMM's SM100 FP4 path takes); then ``mqa_logits`` and ``topk`` as an
engine calls them. Recall of a row: the share of the true top-k the quantized one keeps. Data sets: normal keys, keys
with a few outlier channels (a 20x scale on 4 of 128), as activations have, and the small model's indexer
(:mod:`indexcache.tools.model`, the ``v32-like`` preset with ``H`` index heads: random seeded weights, not a trained
model): its first sparse layer's queries, keys and head weights, computed as its forward computes them, from the
embeddings of a random prompt of ``N`` tokens (the queries are its last ``T`` positions).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

import indexcache
from indexcache.hal import fp4

E4M3 = torch.float8_e4m3fn
DATA = ("normal keys", "outlier channels (4 of 128 at 20x)", "small model's indexer (v32-like, first sparse layer)")
# The keys' format, and whether the queries are MXFP4 too (else fp8).
FORMATS = {"fp8 e4m3fn": (E4M3, False), "MXFP4": (fp4.FP4, False), "MXFP4, MXFP4 queries": (fp4.FP4, True)}


def inputs(data: str, tokens: int, keys: int, heads: int, dim: int, seed: int) -> dict[str, torch.Tensor]:
    """bf16 ``q [T, H, D]`` and ``k [N, D]``, float32 ``weights [T, H]``."""
    if data == DATA[2]:
        return model_inputs(tokens, keys, heads, seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(keys, dim, generator=gen)
    if data == DATA[1]:
        k[:, torch.randperm(dim, generator=gen)[:4]] *= 20
    weights = torch.randn(tokens, heads, generator=gen) / heads**0.5
    return dict(q=q.bfloat16(), k=k.bfloat16(), weights=weights)


def model_inputs(tokens: int, keys: int, heads: int, seed: int) -> dict[str, torch.Tensor]:
    """The small model's first sparse layer's indexer inputs (``DSAModel.index_queries`` / ``index_keys``, before
    the fp8 quantization) on a random prompt of ``keys`` tokens drawn from ``seed``: queries of its last ``tokens``."""
    import torch.nn.functional as F

    from indexcache.tools.model import DSAModel, preset

    model = DSAModel(preset("v32-like", index_heads=heads))
    c = model.config
    layer = c.sparse_layers[0]
    prompt = torch.randint(0, c.vocab, (keys,), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(keys)
    h = F.rms_norm(model.embedding[prompt], (c.hidden,))
    q, head = model.index_queries(layer, h, positions)
    return dict(q=q[-tokens:].bfloat16(), k=model.index_keys(layer, h, positions).bfloat16(),
                weights=(head * c.index_dim**-0.5)[-tokens:])


def true_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, top: int) -> torch.Tensor:
    """``[T, top]`` positions of the float64 top-k."""
    logits = (torch.einsum("thd,nd->thn", q.double(), k.double()).clamp_min(0) * weights.double()[..., None]).sum(1)
    return logits.topk(top, dim=1).indices


def quantized_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, top: int, fmt: torch.dtype,
                   backend: str, fp4_queries: bool = False) -> torch.Tensor:
    """``[T, top]`` positions the indexer selects with fp8 (or MXFP4) queries and ``fmt`` keys, through the public
    ops."""
    tokens, heads, dim = q.shape
    if fp4_queries:  # a head's D values a row, their block scales beside them
        values, scales = indexcache.quantize_index_k(q.reshape(-1, dim), fp4.FP4, backend=backend)
        queries = dict(q=values.view(tokens, heads, dim // 2), q_scale=scales.view(tokens, heads, dim // fp4.BLOCK))
        w = weights
    else:
        q8, q_scale = indexcache.quantize_index_k(q.reshape(-1, dim), E4M3, block=dim, backend=backend)
        queries = dict(q=q8.view(tokens, heads, dim))
        w = weights * q_scale.view(tokens, heads)  # the query's scale folded into its head weight
    if fmt == fp4.FP4:
        k_values, k_scale = indexcache.quantize_index_k(k, fmt, block=fp4.BLOCK, backend=backend)
    else:
        k_values, k_scale = indexcache.quantize_index_k(k, fmt, block=dim, backend=backend)
        k_scale = k_scale[:, 0]
    ks = torch.zeros(tokens, dtype=torch.int32)
    ke = torch.full((tokens,), k.shape[0], dtype=torch.int32)
    logits = indexcache.mqa_logits(queries["q"], k_values, k_scale, w, ks, ke, q_scale=queries.get("q_scale"),
                                   backend=backend)
    return indexcache.topk(logits, ke, top, backend=backend).long()


def recall(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    """Per row, the share of ``want``'s positions ``got`` holds."""
    return [len(set(g.tolist()) & set(w.tolist())) / want.shape[1] for g, w in zip(got, want, strict=True)]


def run(tokens: int, keys: int, heads: int, dim: int, top: int, seeds: int, backend: str) -> list[dict[str, Any]]:
    rows = []
    for data in DATA:
        found: dict[str, list[float]] = {name: [] for name in FORMATS}
        for seed in range(seeds):
            a = inputs(data, tokens, keys, heads, dim, seed)
            want = true_topk(a["q"], a["k"], a["weights"], top)
            for name, (fmt, fp4_queries) in FORMATS.items():
                found[name] += recall(quantized_topk(a["q"], a["k"], a["weights"], top, fmt, backend, fp4_queries),
                                      want)
        for name, values in found.items():
            rows.append(dict(data=data, keys=name, recall_mean=statistics.fmean(values), recall_min=min(values),
                             rows=len(values)))
            print(f"{data:<38} {name:<21} recall mean {rows[-1]['recall_mean']:.4f} min {rows[-1]['recall_min']:.4f}",
                  file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--tokens", type=int, default=32, help="query rows a data set and seed (default 32)")
    parser.add_argument("--keys", type=int, default=16384, help="keys every row sees (default 16384)")
    parser.add_argument("--heads", type=int, default=64, help="index heads (default 64)")
    parser.add_argument("--top", type=int, default=2048, help="k (default 2048)")
    parser.add_argument("--seeds", type=int, default=2, help="data sets drawn per kind (default 2)")
    parser.add_argument("--backend", default="torch", help="the backend running the ops (default torch)")
    args = parser.parse_args(argv)
    for name in ("tokens", "keys", "heads", "top", "seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    if args.top > args.keys:
        parser.error(f"--top: expected at most --keys ({args.keys}), got {args.top}")
    from indexcache.bench.output import write_json
    from indexcache.bench.provenance import checkout_commit, now, versions

    rows = run(args.tokens, args.keys, args.heads, 128, args.top, args.seeds, args.backend)
    report = {"device": f"CPU, {args.backend} backend (accuracy only)", "date": now(), "commit": checkout_commit(),
              **versions(), "params": dict(tokens=args.tokens, keys=args.keys, heads=args.heads, dim=128, top=args.top,
                                           seeds=args.seeds), "rows": rows}
    if args.out:
        write_json(report, args.out)
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
