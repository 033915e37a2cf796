"""The prefill producer step, ``indexcache.mqa_topk_translate``, beyond its conformance cases: a bound that holds no
query row is refused naming ``workspace_bytes``; on a GPU, the call captured in a CUDA graph with the caller's
workspace (several passes) replays equal to an eager call on new inputs, and allocates nothing."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.bench.timing import capture_graph
from indexcache.hal import dispatch

I32 = torch.int32
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: graph capture needs a GPU")


def _inputs(gen: torch.Generator, tokens: int, keys: int, k: int, device="cpu", heads: int = 8) -> dict:
    """One request's causal prefill of ``tokens`` queries over ``keys`` keys (random values), outputs given."""
    return dict(q=torch.randn(tokens, heads, 128, generator=gen).to(device, torch.float8_e4m3fn),
                k=torch.randn(keys, 128, generator=gen).to(device, torch.float8_e4m3fn),
                k_scale=(torch.rand(keys, generator=gen) + 0.5).to(device),
                weights=torch.randn(tokens, heads, generator=gen).to(device),
                ks=torch.zeros(tokens, dtype=I32, device=device),
                ke=torch.arange(keys - tokens + 1, keys + 1, dtype=I32, device=device), topk=k,
                page_table=torch.randint(0, 1 << 20, (1, keys // 64 + 1), generator=gen, dtype=I32).to(device),
                page_size=64, row_to_batch=torch.zeros(tokens, dtype=I32, device=device),
                out=torch.full((tokens, k), -7, dtype=I32, device=device),
                out_raw=torch.full((tokens, k), -7, dtype=I32, device=device))


def test_a_bound_below_one_query_row_is_refused():
    args = _inputs(torch.Generator().manual_seed(0), 4, 300, 16)
    with pytest.raises(ValueError, match="workspace_bytes: expected at least 1200 bytes on the torch backend"):
        indexcache.mqa_topk_translate(**args, workspace_bytes=1199, backend="torch")
    with pytest.raises(ValueError, match="workspace_bytes: expected an int >= 1, got 0"):
        indexcache.mqa_topk_translate(**args, workspace_bytes=0, backend="torch")


@gpu
def test_graph_replays_equal_eager_without_allocating():
    avail = dispatch.availability("cuda")
    if not (avail.available and avail.mode == "GPU"):
        pytest.skip(f"backend cuda does not run on this GPU: {avail.reason}")
    gen = torch.Generator().manual_seed(1)
    tokens, keys, k = 600, 20000, 512
    args = _inputs(gen, tokens, keys, k, "cuda", heads=64)
    bound = 200 * 4 * keys + (8 << 20)  # three or four passes
    need = indexcache.workspace_bytes("mqa_topk_translate", **args, workspace_bytes=bound)
    workspace = torch.empty(need, dtype=torch.uint8, device="cuda")

    def step():
        indexcache.mqa_topk_translate(**args, workspace=workspace, workspace_bytes=bound, backend="cuda")

    graph = capture_graph(step)
    for seed in range(3):
        fresh = _inputs(torch.Generator().manual_seed(10 + seed), tokens, keys, k, "cuda", heads=64)
        for name in ("q", "k", "k_scale", "weights"):
            args[name].copy_(fresh[name])
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
        got, got_raw = args["out"].clone(), args["out_raw"].clone()
        # The same bound, so the same passes: a row's order is unspecified (docs/ops.md), and a pass's row count
        # decides how its top-k samples (many rows sampled ahead, few in the block), so another bound may order
        # the same sets otherwise.
        want = indexcache.mqa_topk_translate(**{**args, "out": None, "out_raw": fresh["out_raw"]},
                                             workspace_bytes=bound, backend="cuda")
        assert torch.equal(got, want) and torch.equal(got_raw, fresh["out_raw"])
