"""Launch grids within the GPUs' limit: a grid's second dimension holds at most 65535 programs on NVIDIA and AMD GPUs,
so an op whose block count there grows with its input launches again for the blocks beyond it (interpreted on the
CPU, which has no such limit: the tests lower the cap to split small inputs)."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.backends.cuda.arch import NVIDIA
from indexcache.backends.cuda.tuning import tuning as cuda_tuning
from indexcache.backends.rocm.arch import AMD
from indexcache.backends.rocm.tuning import tuning as rocm_tuning
from indexcache.backends.triton import quantize, support, translate
from indexcache.hal import fp4, reference

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks; ci/gpu.sh runs them compiled"),
              pytest.mark.usefixtures("interpreted")]

FP8 = {"cuda": torch.float8_e4m3fn, "rocm": torch.float8_e4m3fnuz}
BACKENDS = ("cuda", "rocm")
I32 = torch.int32
# Each backend's interpreted target and its tuning table.
TARGETS = {"cuda": (NVIDIA.target("sm90", interpreted=True), cuda_tuning("sm90")),
           "rocm": (AMD.target("gfx942", interpreted=True), rocm_tuning("gfx942"))}


@pytest.mark.parametrize("backend", BACKENDS)
def test_launches_of_huge_widths_stay_within_the_grid_limit(backend):
    """One row of 70M indices to translate, one key of 70K columns quantized in blocks of 1: their column blocks
    (68,360 and 70,000) passed 65535 programs in the grid's second dimension, which a GPU refuses to launch. Now two
    launches each, over the columns' views."""
    target, tuning = TARGETS[backend]
    width = 70_000_000
    raw = torch.zeros(1, 1, dtype=I32).expand(1, width)
    out = torch.zeros(1, 1, dtype=I32).expand(1, width)
    launches = translate.translate_launches(raw, torch.zeros(1, 1, dtype=I32), torch.ones(1, dtype=I32), 64, None,
                                            out, target=target, cfg=tuning["translate"])
    assert [launch.grid[1] for launch in launches] == [support.MAX_GRID_Y, 68_360 - support.MAX_GRID_Y]
    keys = torch.zeros(1, 70_000)
    launches = quantize.quantize_launches(keys, FP8[backend], 1, torch.empty(1, 70_000, dtype=FP8[backend]),
                                          torch.empty(1, 70_000), target=target, cfg=tuning["quantize_index_k"])
    assert [launch.grid[1] for launch in launches] == [support.MAX_GRID_Y, 70_000 - support.MAX_GRID_Y]


@pytest.mark.parametrize("backend", BACKENDS)
def test_translate_takes_every_column_block_under_a_lowered_cap(backend, monkeypatch):
    """Five column blocks of 1024 with a grid of at most two: three launches over the columns' views, the output
    exact."""
    monkeypatch.setattr(support, "MAX_GRID_Y", 2)
    gen = torch.Generator().manual_seed(3)
    raw = torch.randint(-5, 600, (3, 5000), generator=gen, dtype=I32)
    table = torch.randint(-1, 50, (2, 10), generator=gen, dtype=I32)
    seq, r2b = torch.tensor([600, 300, 5000], dtype=I32), torch.tensor([1, 0, 1], dtype=I32)
    got = indexcache.translate(raw, table, seq, 64, row_to_batch=r2b, backend=backend)
    assert torch.equal(got, reference.translate(raw, table, seq, 64, row_to_batch=r2b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mxfp4", [False, True], ids=["fp8", "mxfp4"])
def test_quantize_takes_every_block_under_a_lowered_cap(backend, mxfp4, monkeypatch):
    """65 blocks of 2 columns (fp8) with a grid of at most two: 33 launches over the columns' views; the bytes
    exact (MXFP4's one launch a row block is not split)."""
    monkeypatch.setattr(support, "MAX_GRID_Y", 2)
    keys = torch.randn(5, 130 if not mxfp4 else 128, generator=torch.Generator().manual_seed(4)) * 3
    fmt, block = (fp4.FP4, fp4.BLOCK) if mxfp4 else (FP8[backend], 2)
    got = indexcache.quantize_index_k(keys, fmt, block=block, backend=backend)
    want = reference.quantize_index_k(keys, fmt, block=block)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
