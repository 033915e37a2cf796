"""The Triton logits, quantize and store kernels of the cuda and rocm backends, interpreted on the CPU.

Each case compares with :mod:`indexcache.hal.reference` by the logits rule of docs/ops.md: -inf positions identical,
relative RMS error of the finite values ≤ 1e-5 for fp8 (fp32 accumulation) and bf16, no
NaN; quantize and store are bit-exact. Outputs are views into guarded buffers, so a write out of
bounds fails the test. Interpreted bf16 widens to fp32 before the dot (the interpreter has no bf16
``tl.dot``), so the bf16 cases check everything but the dot's input precision.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import indexcache
from indexcache.backends import cuda as cuda_backend
from indexcache.backends.cuda.arch import NVIDIA
from indexcache.backends.rocm.arch import AMD
from indexcache.backends.triton.head_sum import e4m3_bytes_to_fp16
from indexcache.backends.triton.target import detect
from indexcache.conformance.check import native_fp8
from indexcache.hal import dispatch, fp4, reference
from indexcache.hal.layout import new_packed_cache, split_packed_cache
from indexcache.hal.specs import mqa_logits as mqa_logits_spec
from indexcache.hal.specs import paged_mqa_logits as paged_mqa_logits_spec

from .far import far

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks; bench/logits_gpu.py is for GPUs"),
    pytest.mark.usefixtures("interpreted"),
]

FP8 = {"cuda": torch.float8_e4m3fn, "rocm": torch.float8_e4m3fnuz}
BACKENDS = ("cuda", "rocm")
GUARD = 3


def _guarded(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, out)``: ``out [rows, cols]`` float32 inside a buffer with NaN guard rows around it."""
    buf = torch.full((rows + 2 * GUARD, cols), float("nan"))
    return buf, buf[GUARD:GUARD + rows]


def _check_guards(buf: torch.Tensor) -> None:
    assert buf[:GUARD].isnan().all() and buf[-GUARD:].isnan().all(), "a kernel wrote outside its output"


def _assert_logits(out: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    assert not out.isnan().any()
    assert torch.equal(out == float("-inf"), ref == float("-inf")), "-inf placement differs"
    finite = torch.isfinite(ref)
    assert torch.isfinite(out[finite]).all()
    if finite.any() and ref[finite].norm() > 0:
        err = (out[finite].double() - ref[finite]).norm() / ref[finite].norm()
        assert err <= bound, f"relative RMS error {err:.3g} > {bound}"


def _fp8(shape, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape) * scale).clamp(-200, 200).to(dtype)


# ---------------------------------------------------------------- ragged prefill


def _prefill(backend, q, k, k_scale, w, ks, ke, bound):
    buf, out = _guarded(q.shape[0], k.shape[0])
    indexcache.mqa_logits(q, k, k_scale, w, ks, ke, out=out, backend=backend)
    _check_guards(buf)
    _assert_logits(out, reference.mqa_logits(q, k, k_scale, w, ks, ke), bound)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_prefill_windows(backend, kind):
    """Full, empty, inverted, CP-shaped (ks > 0), causal and out-of-range windows in one batch."""
    torch.manual_seed(1)
    t, n, h, d = 20, 200, 16, 64
    dtype = FP8[backend] if kind == "fp8" else torch.bfloat16
    q, k = _fp8((t, h, d), dtype, 4), _fp8((n, d), dtype, 4)
    k_scale, w = torch.rand(n) + 0.25, torch.randn(t, h)
    ks = torch.tensor([0, 0, 7, 9, 64, 150, -5, 0, 199, 100] + [30 + i for i in range(10)], dtype=torch.int32)
    ke = torch.tensor([200, 0, 7, 3, 128, 400, 20, 1, 200, 101] + [120 + 7 * i for i in range(10)], dtype=torch.int32)
    _prefill(backend, q, k, k_scale, w, ks, ke, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_full_windows_d128(backend):
    """Every row sees every key: the unmasked store path, with D = 128 and H = 8."""
    torch.manual_seed(2)
    t, n, h, d = 6, 150, 8, 128
    q, k = _fp8((t, h, d), FP8[backend]), _fp8((n, d), FP8[backend])
    ks, ke = torch.zeros(t, dtype=torch.int32), torch.full((t,), n, dtype=torch.int32)
    _prefill(backend, q, k, torch.rand(n) + 0.5, torch.randn(t, h), ks, ke, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_fp8_and_scale_extremes(backend):
    """fp8 max and subnormals in q and k, scales from 2^-40 to 2^40: finite, exact placement, no NaN."""
    dtype = FP8[backend]
    info = torch.finfo(dtype)
    t, n, h, d = 4, 70, 16, 64
    torch.manual_seed(3)
    q, k = _fp8((t, h, d), dtype), _fp8((n, d), dtype)
    q[0] = info.max
    q[1, :, ::2] = -info.max
    q[2] = info.smallest_normal / 8  # subnormal
    k[:10] = info.max
    k[10:20] = -info.max
    k[20:30] = info.smallest_normal / 4
    k_scale = torch.exp2(torch.linspace(-40, 40, n))
    ks, ke = torch.tensor([0, 3, 0, 69], dtype=torch.int32), torch.tensor([70, 60, 35, 70], dtype=torch.int32)
    _prefill(backend, q, k, k_scale, torch.randn(t, h), ks, ke, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_declines_with_reasons(backend):
    other = FP8["rocm" if backend == "cuda" else "cuda"]
    q, k = torch.zeros(2, 16, 64).to(other), torch.zeros(8, 64).to(other)
    args = (torch.ones(8), torch.ones(2, 16), torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    with pytest.raises(dispatch.BackendNotSupportedError, match="native fp8 format"):
        indexcache.mqa_logits(q, k, *args, backend=backend)
    q, k = torch.zeros(2, 12, 64).to(FP8[backend]), torch.zeros(8, 64).to(FP8[backend])
    with pytest.raises(dispatch.BackendNotSupportedError, match="heads=12"):
        indexcache.mqa_logits(q, k, args[0], torch.ones(2, 12), *args[2:], backend=backend)
    q, k = torch.zeros(2, 12, 64).to(other), torch.zeros(8, 64).to(other)
    with pytest.raises(dispatch.BackendNotSupportedError, match="native fp8 format .*; heads=12") as declined:
        indexcache.mqa_logits(q, k, args[0], torch.ones(2, 12), *args[2:], backend=backend)
    assert "head dim" not in str(declined.value)


# ---------------------------------------------------------------- paged decode


def _cache(num_pages, page_size, d, dtype, four_d=False):
    """A packed cache filled through the reference store, NaN-free, as the flat or DeepGEMM 4-D view."""
    cache = new_packed_cache(num_pages, page_size, d)
    keys = torch.randn(num_pages * page_size, d) * 3
    cache = reference.store_index_k(keys, cache, torch.arange(num_pages * page_size, dtype=torch.int32), dtype)
    return cache.view(num_pages, page_size, 1, d + 4) if four_d else cache


def _decode_case(backend, next_n, page_size, *, heads=16, d=64, seed=0):
    torch.manual_seed(seed)
    dtype = FP8[backend]
    batch, pages, table_pages = 4, 10, 5
    cache = _cache(pages, page_size, d, dtype, four_d=page_size == 64)
    q = _fp8((batch, next_n, heads, d), dtype, 3)
    w = torch.randn(batch * next_n, heads)
    table = torch.randint(0, pages, (batch, table_pages), dtype=torch.int32)
    table[0, 1] = -1  # a hole
    table[1, 2] = pages  # beyond the cache
    table[2, 0] = -7
    cap = table_pages * page_size
    context = torch.tensor([cap - 3, 0, cap + 9, next_n + 1], dtype=torch.int32)  # full, empty, past the table
    return q, cache, w, context, table, cap - page_size // 2  # max_context_len cuts the longest row


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("next_n", "page_size"), [(1, 16), (2, 32), (3, 64), (4, 128)])
def test_paged_decode(backend, next_n, page_size):
    args = _decode_case(backend, next_n, page_size)
    rows, max_len = args[0].shape[0] * next_n, args[-1]
    buf, out = _guarded(rows, max_len)
    indexcache.paged_mqa_logits(*args, out=out, backend=backend)
    _check_guards(buf)
    _assert_logits(out, reference.paged_mqa_logits(*args), 1e-5)


def test_paged_decode_split_draft_groups():
    """next_n = 3 over two programs a key range (COLS = 2 tokens × H), many programs a request, heads on M: same
    result."""
    from indexcache.backends.triton import logits

    target = detect(NVIDIA)[2]
    cfg = dict(cuda_backend.tuning(target.arch)["paged_mqa_logits"], COLS=32, PROGRAMS_PER_SM=5, BLOCK_KEYS=32,
               KEYS_ON_M=False)
    args = _decode_case("cuda", 3, 16, seed=4)
    buf, out = _guarded(args[0].shape[0] * 3, args[-1])
    logits.paged_mqa_logits(*args, out, target=target, cfg=cfg)
    _check_guards(buf)
    _assert_logits(out, reference.paged_mqa_logits(*args), 1e-5)


@pytest.mark.parametrize(("prefetch", "words", "block_keys", "page_size", "next_n"),
                         [(0, 0, 64, 16, 2), (2, 1, 64, 64, 1), (2, 0, 32, 128, 2), (1, 1, 128, 32, 1),
                          (0, 1, 32, 64, 3)])
def test_paged_decode_pipeline_variants(prefetch, words, block_keys, page_size, next_n):
    """The decode loop without a register pipeline (0) and with one (1) or two (2) tiles prefetched, rows
    carried as fp8 or as int32 words, tiles of several pages and tiles inside a page, shares of a few tiles (many
    programs start and end inside a request, some hold no tile; PREFETCH 2 runs pairs of tiles)."""
    from indexcache.backends.triton import logits

    target = detect(NVIDIA)[2]
    cfg = dict(cuda_backend.tuning(target.arch)["paged_mqa_logits"], PREFETCH=prefetch, WORDS=words,
               BLOCK_KEYS=block_keys, PROGRAMS_PER_SM=7)
    args = _decode_case("cuda", next_n, page_size, seed=5)
    buf, out = _guarded(args[0].shape[0] * next_n, args[-1])
    logits.paged_mqa_logits(*args, out, target=target, cfg=cfg)
    _check_guards(buf)
    _assert_logits(out, reference.paged_mqa_logits(*args), 1e-5)


def _pairs_kept(rows_to_batch: torch.Tensor, lengths: torch.Tensor, max_len: int, skip: int) -> torch.Tensor:
    """Per ragged row, whether the kernel writes it under ``skip``: its unit's (the row and, at an even row, the next
    of the same request) longer length, clipped to ``max_len``, above ``skip``."""
    unit = lengths.long().clamp(0, max_len)
    pair = (rows_to_batch[:-1] == rows_to_batch[1:]) & (torch.arange(rows_to_batch.shape[0] - 1) % 2 == 0)
    longer = torch.maximum(unit[:-1], unit[1:])
    unit[:-1] = torch.where(pair, longer, unit[:-1])
    unit[1:] = torch.where(pair, longer, unit[1:])
    return unit > skip


@pytest.mark.parametrize(("backend", "skip"), [("cuda", -1), ("cuda", 40), ("rocm", -1)])
def test_paged_decode_ragged_rows_two_a_program(backend, skip):
    """Ragged rows two a program (``GROUPS`` 2): the uniform next_n 2 call's rows as ragged rows (each request's pair
    at an even row) give its logits; runs starting at odd rows, rows naming no request and a request's three rows
    against the reference; with ``skip``, the rows of a unit whose longer row is at most ``skip`` left unwritten."""
    from indexcache.backends.triton import logits

    q, cache, w, context, table, max_len = _decode_case(backend, 2, 32, seed=6)
    batch = q.shape[0]
    rows = torch.arange(2 * batch)
    r2b = (rows // 2).to(torch.int32)
    lens = (context.long()[rows // 2] - 1 + rows % 2).to(torch.int32)
    ragged = q.view(2 * batch, 1, *q.shape[2:])
    cases = [(ragged, w, lens, r2b),
             (ragged[1:], w[1:], lens[1:], r2b[1:]),  # every pair now starts at an odd row
             (ragged, w, lens, torch.tensor([0, 0, 0, -1, 1, 1, 9, 3], dtype=torch.int32))]
    for i, (rq, rw, rl, rb) in enumerate(cases):
        buf, out = _guarded(rq.shape[0], max_len)
        if backend == "cuda":
            target = detect(NVIDIA)[2]
            launch = logits.paged_mqa_logits_launch(rq, cache, rw, rl, table, max_len, out, row_to_batch=rb,
                                                    target=target, skip=skip,
                                                    cfg=cuda_backend.tuning(target.arch)["paged_mqa_logits"])
            assert launch.named["GROUPS"] == 2 and launch.named["HAS_R2B"]
            launch()
        else:
            indexcache.paged_mqa_logits(rq, cache, rw, rl, table, max_len, out=out, row_to_batch=rb, backend=backend)
        _check_guards(buf)
        want = reference.paged_mqa_logits(rq, cache, rw, rl, table, max_len, row_to_batch=rb)
        if i == 0:
            want = reference.paged_mqa_logits(q, cache, w, context, table, max_len)
        kept = _pairs_kept(rb, rl, max_len, skip)
        assert out[~kept].isnan().all(), i
        _assert_logits(out[kept], want[kept], 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k_format", [None, torch.float4_e2m1fn_x2], ids=["fp8", "mxfp4"])
def test_a_cache_of_no_pages_is_declined_and_served_by_the_torch_backend(backend, k_format, monkeypatch):
    """A tile inside one page reads page 0 in place of a missing one, unmasked: with no pages there is none, so the
    Triton backends decline such a cache (naming it) and the automatic choice gives the torch backend's -inf logits,
    for the logits op and the producer step alike (it read through a null pointer)."""
    from indexcache.hal import fp4

    fmt = FP8[backend] if k_format is None else fp4.FP4
    cache = new_packed_cache(0, 64, 128, fp8_dtype=fmt)
    q = torch.zeros(2, 1, 4, 128).to(FP8[backend])
    args = (q, cache, torch.ones(2, 4), torch.tensor([10, 300], dtype=torch.int32),
            torch.tensor([[0], [1]], dtype=torch.int32), 300)
    with pytest.raises(dispatch.BackendNotSupportedError, match="k_cache: a cache of no pages"):
        indexcache.paged_mqa_logits(*args, k_format=k_format, backend=backend)
    monkeypatch.setattr(dispatch, "default_backend", lambda: (backend, "the automatic choice, here"))
    assert indexcache.paged_mqa_logits(*args, k_format=k_format).eq(float("-inf")).all()
    raw = torch.empty(2, 64, dtype=torch.int32)
    indexcache.paged_topk_translate(*args, 64, torch.tensor([[5], [6]], dtype=torch.int32), 64, out_raw=raw,
                                    k_format=k_format)
    assert torch.equal(raw[0], torch.tensor([*range(10), *[-1] * 54], dtype=torch.int32))
    assert raw[1].eq(-1).all()


def test_paged_decode_tma_choice_off_hopper_takes_the_triton_kernel():
    """A table choosing the Hopper kernel (``KERNEL="tma-ws"``) still gets the Triton kernel where that one cannot run
    (here: interpreted), with the same result."""
    from indexcache.backends.triton import logits

    target = detect(NVIDIA)[2]
    cfg = dict(cuda_backend.tuning(target.arch)["paged_mqa_logits"], KERNEL="tma-ws")
    args = _decode_case("cuda", 2, 64, seed=3)
    buf, out = _guarded(args[0].shape[0] * 2, args[-1])
    logits.paged_mqa_logits(*args, out, target=target, cfg=cfg)
    _check_guards(buf)
    _assert_logits(out, reference.paged_mqa_logits(*args), 1e-5)


def test_paged_decode_schedule_over_many_requests():
    """More requests than one step of the schedule reads (BATCH_BLOCK), ragged contexts (negative, empty, short,
    past max_context_len), more programs than some shares have tiles: every row equals the reference."""
    from indexcache.backends.triton import logits

    torch.manual_seed(6)
    target = detect(NVIDIA)[2]
    cfg = dict(cuda_backend.tuning(target.arch)["paged_mqa_logits"], BLOCK_KEYS=16, PROGRAMS_PER_SM=50)
    batch, page, table_pages, next_n = logits.BATCH_BLOCK + 44, 16, 3, 2
    cache = _cache(batch, page, 64, FP8["cuda"], four_d=False)
    q = _fp8((batch, next_n, 16, 64), FP8["cuda"], 3)
    w = torch.randn(batch * next_n, 16)
    table = torch.randint(0, batch, (batch, table_pages), dtype=torch.int32)
    context = torch.randint(-5, table_pages * page + 8, (batch,), dtype=torch.int32)
    context[:3] = torch.tensor([0, -1, 1], dtype=torch.int32)
    max_len = table_pages * page - 5
    buf, out = _guarded(batch * next_n, max_len)
    logits.paged_mqa_logits(q, cache, w, context, table, max_len, out, target=target, cfg=cfg)
    _check_guards(buf)
    _assert_logits(out, reference.paged_mqa_logits(q, cache, w, context, table, max_len), 1e-5)


# ---------------------------------------------------------------- quantize and store


def _inputs(dtype: torch.dtype, fp8: torch.dtype) -> torch.Tensor:
    """Rows over many magnitudes plus the edge rows: zeros, exact fp8_max · 2^k, subnormal quotients, -0."""
    torch.manual_seed(5)
    top = 8.0 if dtype == torch.float16 else 1e6
    k = torch.randn(24, 256) * torch.logspace(-6, torch.log10(torch.tensor(top)).item(), 24)[:, None]
    k[0] = 0
    k[1, 7] = torch.finfo(fp8).max * 4  # amax exactly fp8_max · 2^2
    k[2, :] = 1e-3
    k[2, 5] = 3.0  # most of the row ends up subnormal
    k[3, ::3] = -0.0
    return k.to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_is_exact(backend, dtype):
    fp8 = FP8[backend]
    k = _inputs(dtype, fp8)
    q, scale = indexcache.quantize_index_k(k, fp8, block=128, backend=backend)
    rq, rscale = reference.quantize_index_k(k, fp8, block=128)
    assert q.dtype == fp8 and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(scale, rscale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [16, 64])
def test_store_is_exact_and_skips_bad_slots(backend, page_size):
    fp8 = FP8[backend]
    k = _inputs(torch.bfloat16, fp8)[:, :128]
    cache = new_packed_cache(3, page_size, 128)
    capacity = 3 * page_size
    slots = torch.randperm(capacity)[: k.shape[0]].int()
    slots[::5] = -1
    slots[1] = capacity  # beyond the cache
    if page_size == 64:
        cache = cache.view(3, page_size, 1, 132)
    ref = reference.store_index_k(k, cache, slots, fp8)
    indexcache.store_index_k(k, cache, slots, fp8, backend=backend)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_declines_the_other_fp8(backend):
    other = FP8["rocm" if backend == "cuda" else "cuda"]
    with pytest.raises(dispatch.BackendNotSupportedError, match="native fp8 format"):
        indexcache.quantize_index_k(torch.ones(2, 128), other, backend=backend)
    with pytest.raises(dispatch.BackendNotSupportedError, match="native fp8 format"):
        indexcache.store_index_k(torch.ones(2, 128), new_packed_cache(1, 16), torch.zeros(2, dtype=torch.int32),
                                 other, backend=backend)
    with pytest.raises(dispatch.BackendNotSupportedError, match="native fp8 format .*; block=8192: .* at most 4096"):
        indexcache.quantize_index_k(torch.ones(1, 8192), other, block=8192, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stored_cache_read_back_by_both_logits_ops(backend):
    """store_index_k writes the packed cache; paged_mqa_logits and mqa_logits (on its views) read it."""
    torch.manual_seed(6)
    fp8, page_size, pages, d, h = FP8[backend], 32, 4, 128, 16
    cache = new_packed_cache(pages, page_size, d)
    tokens = torch.randn(pages * page_size, d) * 2
    order = torch.randperm(pages * page_size).int()
    indexcache.store_index_k(tokens, cache, order, fp8, backend=backend)
    keys, scales = split_packed_cache(cache, d, fp8)
    # Paged: one request whose table lists the pages in order; token s lives in slot order[s].
    q = _fp8((1, 2, h, d), fp8, 3)
    w = torch.randn(2, h)
    table = torch.arange(pages, dtype=torch.int32)[None]
    context = torch.tensor([pages * page_size - 5], dtype=torch.int32)
    paged = indexcache.paged_mqa_logits(q, cache, w, context, table, pages * page_size, backend=backend)
    _assert_logits(paged, reference.paged_mqa_logits(q, cache, w, context, table, pages * page_size), 1e-5)
    # Prefill over the same keys in slot order, through the views.
    k, k_scale = keys.reshape(-1, d), scales.reshape(-1)
    ks = torch.zeros(2, dtype=torch.int32)
    ke = torch.tensor([40, pages * page_size], dtype=torch.int32)
    prefill = indexcache.mqa_logits(q[0], k, k_scale, w, ks, ke, backend=backend)
    _assert_logits(prefill, reference.mqa_logits(q[0], k, k_scale, w, ks, ke), 1e-5)
    # Slot order[s] holds token s, quantized.
    rq, rscale = reference.quantize_index_k(tokens, fp8, block=d)
    assert torch.equal(k[order.long()].view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(k_scale[order.long()], rscale[:, 0])


# ---------------------------------------------------------------- sm80: fp8 as bytes (no fp8 instructions)

SM80 = NVIDIA.target("sm80", interpreted=True)


@triton.jit
def _decode_bytes_kernel(x_ptr, o_ptr, BIAS: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(o_ptr + i, e4m3_bytes_to_fp16(tl.load(x_ptr + i), BIAS))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_sm80_byte_decode_is_exact(fp8):
    """Every e4m3 byte decoded to fp16 with bit arithmetic equals torch's cast, NaN bytes included."""
    x = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256, dtype=torch.float16)
    _decode_bytes_kernel[(1,)](x, out, BIAS=7 if fp8 == torch.float8_e4m3fn else 8)
    ref = x.view(fp8).float()
    keep = ~ref.isnan()
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.float()[keep], ref[keep]) and torch.equal(out[keep].signbit(), ref[keep].signbit())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sm80_logits_quantize_store(backend):
    """The sm80 table (FP8_DOT fp16, FP8_CVT bits) on the interpreter: prefill and decode read fp8 as bytes, quantize
    and store write bytes; same results as the reference (bit-exact for quantize and store). The rocm case runs
    the same byte paths on e4m3fnuz (bias 8, no negative zero)."""
    from indexcache.backends.triton import logits, quantize

    table = cuda_backend.tuning("sm80")
    assert table["mqa_logits"]["FP8_DOT"] == "fp16" and table["quantize_index_k"]["FP8_CVT"] == "bits"
    fp8 = FP8[backend]
    torch.manual_seed(7)
    t, n, h, d = 5, 90, 16, 64
    q, k = _fp8((t, h, d), fp8, 4), _fp8((n, d), fp8, 4)
    k[:4] = torch.finfo(fp8).max
    k[4:8] = torch.finfo(fp8).smallest_normal / 4
    args = (q, k, torch.rand(n) + 0.25, torch.randn(t, h), torch.tensor([0, 3, 0, 89, 10], dtype=torch.int32),
            torch.tensor([90, 60, 35, 90, 10], dtype=torch.int32))
    buf, out = _guarded(t, n)
    logits.mqa_logits(*args, out, target=SM80, cfg=table["mqa_logits"])
    _check_guards(buf)
    _assert_logits(out, reference.mqa_logits(*args), 1e-5)
    args = _decode_case(backend, 2, 32, seed=8)
    buf, out = _guarded(args[0].shape[0] * 2, args[-1])
    logits.paged_mqa_logits(*args, out, target=SM80, cfg=table["paged_mqa_logits"])
    _check_guards(buf)
    _assert_logits(out, reference.paged_mqa_logits(*args), 1e-5)
    x = _inputs(torch.float32, fp8)
    qk, scale = torch.empty(x.shape, dtype=fp8), torch.empty(x.shape[0], x.shape[1] // 128)
    quantize.quantize_index_k(x, fp8, 128, qk, scale, target=SM80, cfg=table["quantize_index_k"])
    rq, rscale = reference.quantize_index_k(x, fp8, block=128)
    assert torch.equal(qk.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(scale, rscale)
    cache, slots = new_packed_cache(2, 16, 128), torch.randperm(32)[:24].int()
    slots[3] = -1
    ref = reference.store_index_k(x[:, :128], cache.clone(), slots, fp8)
    quantize.store_index_k(x[:, :128], cache, slots, fp8, target=SM80, cfg=table["quantize_index_k"])
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_minus_inf_fill_of_logits_of_a_huge_column_stride(backend):
    """Logits whose column offsets pass 2^31 elements (rows of a transposed buffer), short contexts and windows so that
    the -inf past them is the fill's (past the tiles that read keys): the fills of both kernels computed a column's
    offset in int32 and wrote far outside ``out`` (a segfault interpreted)."""
    g = torch.Generator().manual_seed(8)
    fp8, dim, heads, page = FP8[backend], 32, 16, 16
    cache = new_packed_cache(4, page, dim)
    cache.copy_(reference.store_index_k(torch.randn(4 * page, dim, generator=g), cache,
                                        torch.arange(4 * page, dtype=torch.int32), fp8))
    q = torch.randn(2, 1, heads, dim, generator=g).to(fp8)
    weights = torch.randn(2, heads, generator=g)
    args = (q, cache, weights, torch.tensor([5, 20], dtype=torch.int32),
            torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=torch.int32), 256)
    _assert_logits(indexcache.paged_mqa_logits(*args, out=far(torch.full((2, 256), 7.0), 1), backend=backend),
                   reference.paged_mqa_logits(*args), 1e-5)
    args = (q[:, 0], torch.randn(256, dim, generator=g).to(fp8), torch.rand(256, generator=g), weights,
            torch.tensor([0, 3], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32))
    _assert_logits(indexcache.mqa_logits(*args, out=far(torch.full((2, 256), 7.0), 1), backend=backend),
                   reference.mqa_logits(*args), 1e-5)


@pytest.mark.parametrize(("name", "dim"), [("q", 1), ("q", 2), ("k", 1), ("k_scale", 0), ("weights", 1)])
def test_prefill_reads_inputs_of_a_huge_stride(name, dim):
    """Prefill inputs whose offsets along one dimension pass 2^31 elements (a head's, a dim's, a key's scale, a head's
    weight): the kernel computed them in int32 and read far outside the input (a segfault interpreted)."""
    g = torch.Generator().manual_seed(9)
    fp8, t, n, heads, dim_ = FP8["cuda"], 3, 40, 16, 32
    args = dict(q=torch.randn(t, heads, dim_, generator=g).to(fp8), k=torch.randn(n, dim_, generator=g).to(fp8),
                k_scale=torch.rand(n, generator=g) + 0.25, weights=torch.randn(t, heads, generator=g),
                ks=torch.tensor([0, 5, 20], dtype=torch.int32), ke=torch.tensor([40, 33, 21], dtype=torch.int32))
    want = reference.mqa_logits(**args)
    args[name] = far(args[name], dim)
    _assert_logits(indexcache.mqa_logits(**args, backend="cuda"), want, 1e-5)


@pytest.mark.parametrize(("name", "dim"), [("q", 1), ("q", 2), ("q", 3), ("weights", 0), ("weights", 1),
                                           ("context_lens", 0), ("page_table", 1)])
def test_paged_decode_reads_inputs_of_a_huge_stride(name, dim):
    """Decode inputs whose offsets along one dimension pass 2^31 elements (a draft token's, a head's or a dim's query,
    a row's or a head's weight, a request's length, a page's table entry): the kernel computed them in int32 and read
    far outside the input (a segfault interpreted)."""
    args = dict(zip(("q", "k_cache", "weights", "context_lens", "page_table", "max_context_len"),
                    _decode_case("cuda", 2, 16, d=32, seed=10), strict=True))
    want = reference.paged_mqa_logits(**args)
    args[name] = far(args[name], dim)
    _assert_logits(indexcache.paged_mqa_logits(**args, backend="cuda"), want, 1e-5)


@pytest.mark.parametrize("name", ["context_lens", "row_to_batch"])
def test_paged_decode_ragged_rows_of_a_huge_stride(name):
    """Ragged rows (two a program) whose lengths or requests lie past 2^31 elements: the schedule and the rows read
    them at int32 offsets, far outside (a segfault interpreted)."""
    q, cache, w, context, table, max_len = _decode_case("cuda", 2, 32, d=32, seed=11)
    rows = torch.arange(2 * q.shape[0])
    args = dict(q=q.view(2 * q.shape[0], 1, *q.shape[2:]), k_cache=cache, weights=w,
                context_lens=(context.long()[rows // 2] - 1 + rows % 2).to(torch.int32), page_table=table,
                max_context_len=max_len, row_to_batch=(rows // 2).to(torch.int32))
    want = reference.paged_mqa_logits(**args)
    args[name] = far(args[name], 0)
    _assert_logits(indexcache.paged_mqa_logits(**args, backend="cuda"), want, 1e-5)


@pytest.mark.parametrize(("name", "dim"), [("q", 1), ("q", 2), ("weights", 1)])
def test_prefill_of_mxfp4_keys_reads_inputs_of_a_huge_stride(name, dim):
    """MXFP4 keys widened once, then the fp8 prefill and the far keys' logits (every seventh key's blocks 2^20
    apart), given queries or weights whose offsets along a head or a dim pass 2^31 elements: the far keys' kernel
    computed them in int32 and read far outside the input (a segfault interpreted). Same logits as contiguous."""
    g = torch.Generator().manual_seed(12)
    raw = torch.randn(40, 64, generator=g) * 3
    raw[::7] *= torch.exp2(torch.tensor([-14.0, 6.0])).repeat_interleave(32)
    keys, scales = fp4.quantize(raw)
    args = dict(q=torch.randn(3, 16, 64, generator=g).to(FP8["cuda"]), k=keys, k_scale=scales,
                weights=torch.randn(3, 16, generator=g), ks=torch.tensor([0, 5, 20], dtype=torch.int32),
                ke=torch.tensor([40, 33, 21], dtype=torch.int32))
    want = indexcache.mqa_logits(**args, backend="cuda")
    args[name] = far(args[name], dim)
    assert torch.equal(indexcache.mqa_logits(**args, backend="cuda"), want)


# ---------------------------------------------------------------- MXFP4 block scales at the top of e8m0

# The Triton targets: the table's (the widening and exact block-by-block paths), and as for each target with a
# block-scaled instruction (tl.dot_scaled).
_TARGETS = [("cuda", None), ("rocm", None), ("cuda", "sm100"), ("cuda", "sm120"), ("rocm", "gfx950")]


def _as_target(backend: str, arch: str | None, monkeypatch) -> None:
    """The ``backend``'s kernels as for ``arch`` (None: the table's interpreted target)."""
    if arch is not None:
        monkeypatch.setenv((NVIDIA if backend == "cuda" else AMD).arch_env, arch)


def _assert_inside_float32_logits(spec, args: dict, backend: str) -> None:
    """``spec``'s op on ``backend`` gives the reference's logits for ``args``, which are nonzero and well inside
    float32 (below 2^100), within the fp8 bound of fp32 accumulation."""
    want = spec.reference(**args)
    finite = torch.isfinite(want)
    assert (want[finite] != 0).any() and want[finite].abs().max() < 2.0**100
    got = getattr(indexcache, spec.__name__.rsplit(".", 1)[-1])(**args, backend=backend)
    _assert_logits(got, want, 1e-5)


@pytest.mark.parametrize(("backend", "arch"), _TARGETS)
@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("spec", [mqa_logits_spec, paged_mqa_logits_spec], ids=["mqa_logits", "paged_mqa_logits"])
def test_mxfp4_operands_at_the_top_of_e8m0_give_the_references_logits(backend, arch, spec, side, monkeypatch,
                                                                       fresh_dispatch):
    """MXFP4 queries with block scale byte 254 or 253 against keys of small scales, and the reverse, on the Triton
    kernels (``arch``: as for that target; the table's by default, the exact block-by-block path): the exact path
    applied the key's largest scale and then the query's, and overflowed to +inf where a key near 2^127 met a query
    far below 1. Its two scales are now one exponent, applied in two halves; the fp8 bound of fp32 accumulation.
    The block-scaled path (sm100, sm120, gfx950) gave ``tl.dot_scaled`` the operands at their own block scales,
    +inf interpreted (6 · 2^127); it now gives it the scales relative to each row's largest, each query's largest in
    its weight (relative to its token's largest head's) and the key's and token's largest after the heads.
    Inputs: the specs' ``top_of_e8m0_args``, one operand's (``side``) block scale bytes at 254 and 253 (beside 140
    in some rows), the other's 2^-100 smaller: logits well inside float32 from operands that are not."""
    _as_target(backend, arch, monkeypatch)
    args = spec.top_of_e8m0_args(torch.Generator().manual_seed(0), torch.device("cpu"), side)
    _assert_inside_float32_logits(spec, args, backend)


@pytest.mark.parametrize(("backend", "arch"), _TARGETS)
@pytest.mark.parametrize("spec", [mqa_logits_spec, paged_mqa_logits_spec], ids=["mqa_logits", "paged_mqa_logits"])
def test_fp8_queries_against_mxfp4_keys_at_the_top_of_e8m0_give_the_references_logits(backend, arch, spec,
                                                                                        monkeypatch, fresh_dispatch):
    """fp8 queries (the target's format) against MXFP4 keys with block scale bytes 254 and 253 (beside 140 in some
    rows; the specs' ``top_of_e8m0_fp8_args``): the queries small and the weights 2^-100, so that every product of a
    query and a key lies inside float32 and the logits well inside it, while a key decoded at its own block scales
    does not (6 · 2^127). On the block-scaled path (``arch`` sm100, sm120, gfx950) the keys entered ``tl.dot_scaled``
    at their own scales, +inf interpreted (NaN logits); now relative to each key's largest, that one applied after the
    heads. Elsewhere the one-scale widening and the exact path. The fp8 bound of fp32 accumulation."""
    _as_target(backend, arch, monkeypatch)
    args = spec.top_of_e8m0_fp8_args(torch.Generator().manual_seed(0), torch.device("cpu"), native_fp8(backend))
    _assert_inside_float32_logits(spec, args, backend)


@pytest.mark.parametrize(("backend", "arch"), _TARGETS)
@pytest.mark.parametrize("side", ["q", "k"])
def test_mxfp4_blocks_more_than_2_127_below_their_rows_largest_are_lost(backend, arch, side, monkeypatch,
                                                                        fresh_dispatch):
    """MXFP4 rows (the queries' or the keys', ``side``) with blocks 0 and 2 at byte 254 and blocks 1 and 3 at 130
    (2^124 below: kept) in even rows, at 120 (2^134 below: lost, docs/fp4.md) in odd rows, against the other operand
    zero on blocks 0 and 2, so that the small blocks give every product. The logits are the reference's of the same
    inputs with the lost blocks zero: on the block-scaled path (``arch`` sm100, sm120, gfx950) the bytes relative to
    the row's largest are below 0 there, and taken at byte 0 (2^-127) such a block counted 2^7 times its real value
    where it should count 0; the exact block-by-block path loses it too (a power of two below 2^-126)."""
    _as_target(backend, arch, monkeypatch)
    g = torch.Generator().manual_seed(3)
    tokens, keys, heads = 4, 24, 16
    k, k_scale = fp4.quantize(torch.randn(keys, 128, generator=g))
    q, q_scale = mqa_logits_spec.mxfp4_queries(torch.randn(tokens, heads, 128, generator=g))
    far, far_scale, near = (q, q_scale, k) if side == "q" else (k, k_scale, q)
    rows = far_scale.shape[:-1]
    odd = (torch.arange(rows.numel()) % 2 == 1).view(*rows, 1)
    block = torch.arange(4) % 2 == 1
    far_scale.view(torch.uint8).copy_(torch.where(block, torch.where(odd, 120, 130), 254))
    near.view(torch.uint8).view(*near.shape[:-1], 4, 16)[..., ~block, :] = 0
    args = dict(q=q, k=k, k_scale=k_scale, weights=torch.randn(tokens, heads, generator=g), q_scale=q_scale,
                ks=torch.zeros(tokens, dtype=torch.int32), ke=torch.full((tokens,), keys, dtype=torch.int32))
    kept = {name: t.clone() for name, t in args.items()}
    kept[side].view(torch.uint8).view(*rows, 4, 16).masked_fill_((odd & block)[..., None], 0)
    want = mqa_logits_spec.reference(**kept)
    assert (want != 0).any() and not torch.equal(want, mqa_logits_spec.reference(**args))
    got = indexcache.mqa_logits(**args, backend=backend)
    if side == "k":
        assert (got[:, 1::2] == 0).all()
    _assert_logits(got, want, 1e-5)
