"""The key-cache ops' Triton kernels (``gather_index_k``, ``store_index_k``, ``quantize_index_k``) of the cuda and rocm
backends on hostile inputs, interpreted on the CPU (tox -e kernels-interpret)."""

from __future__ import annotations

import signal

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


class _Slow(Exception):
    pass


def _alarm(signum, frame):
    raise _Slow("the kernel ran past its time")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length", [2**31 - 1, 2**31 - 20, 10**9])
def test_gather_of_a_huge_length_into_few_rows(backend, length):
    """A request of ``length`` tokens (garbage lengths in a padded batch) gathered into 6 given rows, the next request's
    tokens past them: near 2^31 the kernel's block count overflowed int32 and the request's rows stayed as they were;
    at 10^9 it walked every 32-token block of the length, writing nothing (2^25 blocks: a hang compiled, for ever
    interpreted)."""
    fp8 = FP8[backend]
    cache = new_packed_cache(2, 64)
    keys = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) * 3
    cache.copy_(reference.store_index_k(keys, cache, torch.arange(128, dtype=I32), fp8))
    table, lens = torch.tensor([[1], [0]], dtype=I32), torch.tensor([length, 5], dtype=I32)
    out_k = torch.full((6, 128), 0x5A, dtype=torch.uint8).view(fp8)
    out_scale = torch.full((6,), 7.0)
    want = reference.gather_index_k(cache, table, lens, fp8_dtype=fp8, out_k=out_k, out_scale=out_scale)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        indexcache.gather_index_k(cache, table, lens, fp8_dtype=fp8, out_k=out_k, out_scale=out_scale, backend=backend)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert torch.equal(out_k.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(out_scale, want[1])
    assert (want[1] != 7.0).all()  # every row written
