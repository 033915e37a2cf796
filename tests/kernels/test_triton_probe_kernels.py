"""Issue 21 on the Triton kernels of the cuda and rocm backends, interpreted on the CPU (tox -e
kernels-interpret): the paged logits kernel on pages that are not a multiple of its 64-key tile (item 1: it read
past the page, and past ``k_cache`` on the pool's last page) and the non-finite rule (item 7: quantize and store
gave finite scales to NaN / inf blocks, the logits dropped NaN in the ReLU)."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.hal import reference
from indexcache.hal.layout import new_packed_cache

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks; ci/gpu.sh runs them compiled"),
              pytest.mark.usefixtures("interpreted")]

FP8 = {"cuda": torch.float8_e4m3fn, "rocm": torch.float8_e4m3fnuz}
BACKENDS = ("cuda", "rocm")
I32 = torch.int32


def _cache_before_poison(pages: int, page_size: int, fp8: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A filled flat cache whose bytes are followed, in the same buffer, by 0x7F bytes (fp8 NaN, float32 ~3.4e38):
    a read past the cache's end gives NaN or huge logits instead of passing unnoticed."""
    page_bytes = page_size * 132
    buf = torch.full((pages * page_bytes + 4096,), 0x7F, dtype=torch.uint8)
    cache = buf[: pages * page_bytes].view(pages, page_bytes)
    keys = torch.randn(pages * page_size, 128, generator=gen) * 3
    cache.copy_(reference.store_index_k(keys, new_packed_cache(pages, page_size), torch.arange(pages * page_size,
                                                                                                 dtype=I32), fp8))
    return cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [65, 80, 96, 100, 127, 129, 160, 200])
def test_paged_logits_on_pages_that_are_not_a_multiple_of_the_tile(backend, page_size):
    """issue 21 item 1: page 96 gave logits 96-127 of 0.0 or inf (read past the page / past k_cache)."""
    gen = torch.Generator().manual_seed(page_size)
    fp8, pages = FP8[backend], 4
    cache = _cache_before_poison(pages, page_size, fp8, gen)
    q = (torch.randn(2, 1, 16, 128, generator=gen) * 3).to(fp8)
    weights = torch.randn(2, 16, generator=gen)
    table = torch.tensor([[3, 0, 1], [2, 3, -1]], dtype=I32)  # the pool's last page first: tiles cross its end
    context = torch.tensor([3 * page_size, 2 * page_size - 5], dtype=I32)
    args = (q, cache, weights, context, table, 3 * page_size)
    got = indexcache.paged_mqa_logits(*args, backend=backend)
    want = reference.paged_mqa_logits(*args)
    assert not got.isnan().any() and torch.equal(got.isneginf(), want.isneginf())
    finite = ~want.isneginf()
    err = (got[finite].double() - want[finite]).norm() / want[finite].norm()
    assert err <= 1e-5, f"relative RMS error {err:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_and_store_non_finite_like_the_torch_backend(backend):
    """issue 21 item 7: a block with NaN or all -inf got scale 0.0039 / 2.0 on cuda, nan / inf on torch; now NaN
    and zero bytes on both."""
    fp8 = FP8[backend]
    k = torch.randn(4, 256)
    k[0, 5], k[1, 130], k[2, :128] = float("nan"), float("inf"), float("-inf")
    got_q, got_scale = indexcache.quantize_index_k(k, fp8, backend=backend)
    want_q, want_scale = indexcache.quantize_index_k(k, fp8, backend="torch")
    assert torch.equal(got_scale.isnan(), torch.tensor([[1, 0], [0, 1], [1, 0], [0, 0]], dtype=torch.bool))
    assert torch.equal(got_scale.nan_to_num(-1), want_scale.nan_to_num(-1))
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    caches = [new_packed_cache(1, 8) for _ in range(2)]
    for cache, name in zip(caches, (backend, "torch"), strict=True):
        indexcache.store_index_k(k[:, :128], cache, torch.arange(4, dtype=I32), fp8, backend=name)
    assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_keep_nan(backend):
    """issue 21 item 7: cuda's mqa_logits dropped NaN in the ReLU where torch kept it."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(4, 16, 64, generator=gen) * 3).to(torch.bfloat16)
    k = (torch.randn(40, 64, generator=gen) * 3).to(torch.bfloat16)
    weights, k_scale = torch.randn(4, 16, generator=gen), torch.ones(40)
    q[1, 3, 7], k[9, 0], weights[2, 5] = float("nan"), float("nan"), float("nan")
    ks, ke = torch.zeros(4, dtype=I32), torch.tensor([40, 40, 40, 5], dtype=I32)
    got = indexcache.mqa_logits(q, k, k_scale, weights, ks, ke, backend=backend)
    want = indexcache.mqa_logits(q, k, k_scale, weights, ks, ke, backend="torch")
    assert torch.equal(got.isnan(), want.isnan()) and got[1].isnan().all() and got[:, 9][:3].isnan().all()
    assert torch.equal(got.isneginf(), want.isneginf())
