"""CUDA graphs: ``translate(..., out=...)`` captured once, replayed with new inputs copied into the
static buffers, equals an eager call every time and (cuda backend) allocates nothing."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.hal import dispatch, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: graph capture and replay need a GPU")

REPLAYS = 1000
REFERENCE_EVERY = 50
ROWS, K, BATCHES, PAGES = 24, 300, 4, 40
POISON = -2
NAMES = ("raw", "page_table", "seq_lens", "row_to_batch")


def _gpu_backend(name: str) -> None:
    avail = dispatch.availability(name)
    if not (avail.available and avail.mode == "GPU"):
        pytest.skip(f"backend {name} does not run compiled on this GPU: {avail.reason}")


def _inputs(gen: torch.Generator, page_size: int, with_r2b: bool) -> dict[str, torch.Tensor | None]:
    """Random inputs around every bound: -1 and out-of-range raw, short rows, negative entries, bad batches."""
    span = PAGES * page_size

    def draw(low: int, high: int, shape: tuple) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=gen, device="cuda", dtype=torch.int32)

    return dict(raw=draw(-2, span + page_size + 2, (ROWS, K)), page_table=draw(-1, 50_000, (BATCHES, PAGES)),
                seq_lens=draw(-1, span + 2, (ROWS,)), row_to_batch=draw(-1, BATCHES + 1, (ROWS,)) if with_r2b else None)


def _allocations() -> int:
    return torch.cuda.memory_stats()["allocation.all.allocated"]


@pytest.mark.parametrize("backend", ["cuda", "torch"])
@pytest.mark.parametrize("page_size, with_r2b", [(64, True), (3, True), (1, False)])
def test_replays_equal_eager(backend, page_size, with_r2b):
    _gpu_backend(backend)
    gen = torch.Generator(device="cuda").manual_seed(page_size)
    static = _inputs(gen, page_size, with_r2b)
    out = torch.full((ROWS, K), POISON, dtype=torch.int32, device="cuda")

    def step():
        indexcache.translate(static["raw"], static["page_table"], static["seq_lens"], page_size,
                             row_to_batch=static["row_to_batch"], out=out, backend=backend)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    eager = torch.empty_like(out)
    mismatched, allocated = [], 0
    for i in range(REPLAYS):
        new = _inputs(gen, page_size, with_r2b)
        for name in NAMES:
            if new[name] is not None:
                static[name].copy_(new[name])
        out.fill_(POISON)
        before = _allocations()
        graph.replay()
        allocated += _allocations() - before
        indexcache.translate(new["raw"], new["page_table"], new["seq_lens"], page_size,
                             row_to_batch=new["row_to_batch"], out=eager, backend=backend)
        if not torch.equal(out, eager):
            mismatched.append(i)
        if i % REFERENCE_EVERY == 0:
            want = reference.translate(*(new[n] for n in NAMES[:3]), page_size, row_to_batch=new["row_to_batch"])
            assert torch.equal(out.cpu(), want), f"replay {i} differs from the reference"
    assert not mismatched, f"{len(mismatched)} of {REPLAYS} replays differ from eager, first {mismatched[:5]}"
    assert allocated == 0, f"{allocated} allocations during {REPLAYS} replays"


def test_cuda_backend_allocates_nothing_with_out():
    _gpu_backend("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    args = _inputs(gen, 64, True)
    out = torch.empty((ROWS, K), dtype=torch.int32, device="cuda")
    indexcache.translate(*(args[n] for n in NAMES[:3]), 64, row_to_batch=args["row_to_batch"], out=out,
                         backend="cuda")  # compile first
    torch.cuda.synchronize()
    before = _allocations()
    for _ in range(10):
        indexcache.translate(*(args[n] for n in NAMES[:3]), 64, row_to_batch=args["row_to_batch"], out=out,
                             backend="cuda")
    torch.cuda.synchronize()
    assert _allocations() == before
