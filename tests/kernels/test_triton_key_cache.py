"""The key-cache ops' Triton kernels (``gather_index_k``, ``store_index_k``, ``quantize_index_k``) of the cuda and rocm
backends on hostile inputs, interpreted on the CPU (tox -e kernels-interpret)."""

from __future__ import annotations

import signal

import pytest
import torch

import indexcache
from indexcache.hal import fp4, reference
from indexcache.hal.layout import new_packed_cache
from indexcache.hal.specs.gather_index_k import out_shapes

from .far import far

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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mxfp4", [False, True], ids=["fp8", "mxfp4"])
def test_quantize_and_store_read_keys_of_a_huge_column_stride(backend, mxfp4):
    """Transposed keys whose column offsets pass 2^31 elements: the kernels computed them in int32 and read far
    outside ``k`` (a segfault interpreted)."""
    fmt = fp4.FP4 if mxfp4 else FP8[backend]
    values = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).half() * 3
    k = far(values, 1)
    got = indexcache.quantize_index_k(k, fmt, backend=backend)
    want = reference.quantize_index_k(values, fmt, block=fp4.BLOCK if mxfp4 else 128)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    cache, slots = new_packed_cache(2, 4, fp8_dtype=fmt), torch.tensor([5, -1, 0], dtype=I32)
    indexcache.store_index_k(k, cache, slots, fmt, backend=backend)
    assert torch.equal(cache, reference.store_index_k(values, new_packed_cache(2, 4, fp8_dtype=fmt), slots, fmt))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mxfp4", [False, True], ids=["fp8", "mxfp4"])
def test_gather_writes_outputs_of_a_huge_column_stride(backend, mxfp4):
    """Given outputs whose column offsets pass 2^31 elements (rows of transposed buffers): the kernel computed them in
    int32 and wrote far outside ``out_k`` (a segfault interpreted)."""
    fmt = fp4.FP4 if mxfp4 else FP8[backend]
    cache = new_packed_cache(2, 4, fp8_dtype=fmt)
    keys = torch.randn(8, 128, generator=torch.Generator().manual_seed(2)) * 3
    cache.copy_(reference.store_index_k(keys, cache, torch.arange(8, dtype=I32), fmt))
    table, lens = torch.tensor([[1, 0]], dtype=I32), torch.tensor([6], dtype=I32)
    (k_shape, k_dtype), (s_shape, s_dtype) = out_shapes(6, 128, fmt)
    out_k = far(torch.empty(k_shape, dtype=torch.uint8).view(k_dtype), 1)
    out_k.view(torch.uint8).fill_(0x5A)
    out_scale = far(torch.empty(s_shape, dtype=torch.uint8).view(s_dtype), 1) if mxfp4 else torch.full(s_shape, 7.0)
    out_scale.view(torch.uint8).fill_(0x5A)
    want = reference.gather_index_k(cache, table, lens, fp8_dtype=fmt, out_k=out_k, out_scale=out_scale)
    indexcache.gather_index_k(cache, table, lens, fp8_dtype=fmt, out_k=out_k, out_scale=out_scale, backend=backend)
    assert torch.equal(out_k.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(out_scale.view(torch.uint8), want[1].view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_reads_context_lens_of_a_huge_stride(backend):
    """``context_lens`` whose offsets pass 2^31 elements (a column of a wide buffer): the kernel read a request's length
    at b * stride in int32, far outside (a segfault interpreted). Same keys as contiguous lengths."""
    fmt = FP8[backend]
    cache = new_packed_cache(3, 4, fp8_dtype=fmt)
    keys = torch.randn(12, 128, generator=torch.Generator().manual_seed(3)) * 3
    cache.copy_(reference.store_index_k(keys, cache, torch.arange(12, dtype=I32), fmt))
    table, lens = torch.tensor([[1, 0], [2, -1], [0, 1]], dtype=I32), torch.tensor([6, 3, 5], dtype=I32)
    want = indexcache.gather_index_k(cache, table, lens, fp8_dtype=fmt, backend=backend)
    got = indexcache.gather_index_k(cache, table, far(lens, 0), fp8_dtype=fmt, backend=backend)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mxfp4_keys_wider_than_a_program_holds_are_declined_by_name(backend):
    """The MXFP4 kernel holds a whole key in registers: a head dim past the table's ``ELEMS`` is declined, as the store
    declines it, not left to fail in the compiler."""
    k = torch.zeros(1, 8192)
    for call in (lambda: indexcache.quantize_index_k(k, fp4.FP4, backend=backend),
                 lambda: indexcache.store_index_k(k, new_packed_cache(1, 1, dim=8192, fp8_dtype=fp4.FP4),
                                                  torch.zeros(1, dtype=I32), fp4.FP4, backend=backend)):
        with pytest.raises(indexcache.hal.dispatch.BackendNotSupportedError,
                           match="D=8192: the (MXFP4 kernel holds one key|Triton store holds one token) in registers"):
            call()
