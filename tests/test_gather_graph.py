"""CUDA graphs: ``gather_index_k(..., out_k=, out_scale=)`` captured once, replayed with new lengths and tables copied
into the static buffers, equals an eager call every time, on both backends that run on the GPU."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.bench.timing import capture_graph
from indexcache.hal import dispatch, fp4
from indexcache.hal.layout import new_packed_cache
from indexcache.hal.specs.gather_index_k import out_shapes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: graph capture and replay need a GPU")

REPLAYS = 50
REQUESTS, COLUMNS, PAGES, PAGE, DIM = 6, 8, 40, 16, 128


@pytest.mark.parametrize("backend", ["cuda", "torch"])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, fp4.FP4])
def test_replays_equal_eager(backend, fmt):
    avail = dispatch.availability(backend)
    if not (avail.available and avail.mode == "GPU"):
        pytest.skip(f"backend {backend} does not run on this GPU: {avail.reason}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = new_packed_cache(PAGES, PAGE, DIM, device="cuda", fp8_dtype=fmt)
    cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, device="cuda", dtype=torch.uint8))

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        lens = torch.randint(-2, COLUMNS * PAGE + 5, (REQUESTS,), generator=gen, device="cuda", dtype=torch.int32)
        table = torch.randint(-1, PAGES + 1, (REQUESTS, COLUMNS), generator=gen, device="cuda", dtype=torch.int32)
        return lens, table

    lens, table = draw()
    rows = REQUESTS * COLUMNS * PAGE // 2  # fewer rows than the longest draws: the op drops what does not fit
    (k_shape, k_dtype), (s_shape, s_dtype) = out_shapes(rows, DIM, fmt)
    out_k = torch.zeros(k_shape, dtype=torch.uint8, device="cuda").view(k_dtype)  # 1-byte formats
    out_scale = torch.zeros(s_shape, dtype=torch.float32 if s_dtype == torch.float32 else torch.uint8,
                            device="cuda").view(s_dtype)

    def step():
        indexcache.gather_index_k(cache, table, lens, dim=DIM, fp8_dtype=fmt, out_k=out_k, out_scale=out_scale,
                                  backend=backend)

    graph = capture_graph(step)  # compiled and warmed up on a side stream first
    eager_k, eager_scale = torch.empty_like(out_k), torch.empty_like(out_scale)
    for i in range(REPLAYS):
        new_lens, new_table = draw()
        lens.copy_(new_lens)
        table.copy_(new_table)
        out_k.view(torch.uint8).fill_(0x5A)
        out_scale.view(torch.uint8).fill_(0x5A)
        eager_k.view(torch.uint8).fill_(0x5A)
        eager_scale.view(torch.uint8).fill_(0x5A)
        graph.replay()
        indexcache.gather_index_k(cache, new_table, new_lens, dim=DIM, fp8_dtype=fmt, out_k=eager_k,
                                  out_scale=eager_scale, backend=backend)
        assert torch.equal(out_k.view(torch.uint8), eager_k.view(torch.uint8)), f"replay {i}: keys differ"
        assert torch.equal(out_scale.view(torch.uint8), eager_scale.view(torch.uint8)), f"replay {i}: scales differ"
