"""The torch backend against the reference: property tests, argument checks, the memory budget."""

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import indexcache
from indexcache.hal import reference
from indexcache.hal.specs.topk import check_topk

I32 = torch.int32
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def translate_inputs(draw):
    rows, k = draw(st.integers(0, 9)), draw(st.integers(0, 20))
    batches, pages = draw(st.integers(0, 5)), draw(st.integers(0, 6))
    page_size = draw(st.sampled_from([1, 2, 3, 7, 16, 64]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    span = max(pages * page_size, 1)
    raw = torch.randint(-2, span + 3, (rows, 2 * k), generator=g, dtype=I32)
    if draw(st.booleans()):
        raw = raw[:, ::2]  # non-contiguous
    else:
        raw = raw[:, :k]
    table = torch.randint(-2, 40, (batches, pages), generator=g, dtype=I32)
    seq = torch.randint(-2, span + 3, (rows,), generator=g, dtype=I32)
    r2b = torch.randint(-1, batches + 2, (rows,), generator=g, dtype=I32) if draw(st.booleans()) else None
    return raw, table, seq, page_size, r2b


@SETTINGS
@given(translate_inputs())
def test_translate_matches_reference(inputs):
    raw, table, seq, page_size, r2b = inputs
    got = indexcache.translate(raw, table, seq, page_size, row_to_batch=r2b, backend="torch")
    assert torch.equal(got, reference.translate(raw, table, seq, page_size, row_to_batch=r2b))


@st.composite
def topk_inputs(draw):
    rows, cols, k = draw(st.integers(0, 6)), draw(st.integers(0, 300)), draw(st.integers(0, 70))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["distinct", "ties", "special"]))
    if kind == "distinct":
        scores = torch.randn(rows, cols, generator=g)
    else:
        scores = torch.randint(0, 4, (rows, cols), generator=g).float()
    if kind == "special" and cols:
        pick = torch.randint(0, 4, (rows, cols), generator=g)
        scores[pick == 0] = float("-inf")
        scores[pick == 1] = float("nan")
    if draw(st.booleans()):
        scores = scores.to(torch.bfloat16)
    lengths = torch.randint(-3, cols + 5, (rows,), generator=g, dtype=I32)
    starts = torch.randint(-2, cols + 2, (rows,), generator=g, dtype=I32) if draw(st.booleans()) else None
    return scores, lengths, k, starts


@SETTINGS
@given(topk_inputs(), st.booleans())
def test_topk_matches_reference(inputs, sort):
    scores, lengths, k, starts = inputs
    got = indexcache.topk(scores, lengths, k, row_starts=starts, sorted=sort, backend="torch")
    assert check_topk(got, reference.topk(scores, lengths, k, row_starts=starts), sort) == ""


@SETTINGS
@given(topk_inputs(), st.sampled_from([1, 5, 16]))
def test_topk_translate_is_translate_of_topk(inputs, page_size):
    scores, lengths, k, starts = inputs
    rows = scores.shape[0]
    table = torch.randint(-1, 30, (rows, 8), dtype=I32)
    raw = torch.empty((rows, k), dtype=I32)
    phys = indexcache.topk_translate(scores, lengths, k, table, page_size, row_starts=starts, out_raw=raw,
                                     backend="torch")
    assert check_topk(raw, reference.topk(scores, lengths, k, row_starts=starts), False) == ""
    assert torch.equal(phys, reference.translate(raw, table, lengths, page_size))


def test_a_negative_window_start_counts_as_zero_and_keeps_the_windows_length():
    # docs/ops.md, topk: [-3, 5) is [0, 8) (where mqa_logits makes [0, 5) of the window [ks, ke) = [-3, 5)).
    scores = torch.arange(10, dtype=torch.float32)[None].repeat(2, 1)
    lengths, starts = torch.tensor([8, 8], dtype=I32), torch.tensor([-3, 0], dtype=I32)
    short = indexcache.topk(scores, lengths, 8, row_starts=starts, backend="torch")  # 8 positions: a short row
    assert short.tolist() == [list(range(8))] * 2
    best = indexcache.topk(scores, lengths, 2, row_starts=starts, sorted=True, backend="torch")
    assert best.tolist() == [[7, 6], [7, 6]]
    assert torch.equal(best, reference.topk(scores, lengths, 2, row_starts=starts))


FP4_SCALE = torch.float8_e8m0fnu


def _fp4_prefill(q_fp4: bool, k_fp4: bool = True) -> tuple:
    """``mqa_logits``' arguments for 2 queries of 4 heads over 3 keys of D 128, then ``q``'s block scales: the queries
    (and the keys) MXFP4 or fp8."""
    q = torch.zeros(2, 4, 64, dtype=torch.uint8).view(torch.float4_e2m1fn_x2) if q_fp4 else \
        torch.zeros(2, 4, 128).to(torch.float8_e4m3fn)
    k, k_scale = (torch.zeros(3, 64, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
                  torch.zeros(3, 4).to(FP4_SCALE)) if k_fp4 else (torch.zeros(3, 128).to(torch.float8_e4m3fn),
                                                                   torch.ones(3))
    window = torch.zeros(2, dtype=I32)
    return q, k, k_scale, torch.zeros(2, 4), window, window, torch.zeros(2, 4, 4).to(FP4_SCALE)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: indexcache.translate(torch.zeros(2, 3), torch.zeros(1, 1, dtype=I32), torch.zeros(2, dtype=I32), 4),
         r"raw: expected dtype int32, got float32"),
        (lambda: indexcache.translate(torch.zeros(2, 3, dtype=I32), torch.zeros(1, 1, dtype=I32),
                                      torch.zeros(3, dtype=I32), 4),
         r"seq_lens: expected shape \[2\], got \[3\]"),
        (lambda: indexcache.translate(torch.zeros(2, 3, dtype=I32), torch.zeros(1, 1, dtype=I32),
                                      torch.zeros(2, dtype=I32), 0),
         r"page_size: expected an int in \[1, 2147483647\] \(slots are int32\), got 0"),
        (lambda: indexcache.translate(torch.zeros(2, 3, dtype=I32), torch.zeros(1, 1, dtype=I32),
                                      torch.zeros(2, dtype=I32), True),
         r"page_size: expected an int, got bool"),
        (lambda: indexcache.topk(torch.zeros(2, 5), torch.zeros(2, dtype=I32), -1),
         r"k: expected an int in \[0, 65536\] \(indexcache.hal.ops.MAX_TOPK\), got -1"),
        (lambda: indexcache.topk(torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, dtype=I32), 1),
         r"scores: expected dtype float32 or bfloat16 or float16, got float64"),
        (lambda: indexcache.topk(torch.zeros(2, 5), torch.zeros(2, dtype=I32), 3, out=torch.zeros(2, 4, dtype=I32)),
         r"out: expected shape \[2, 3\], got \[2, 4\]"),
        (lambda: indexcache.mqa_logits(torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(3, 8),
                                       torch.zeros(3), torch.zeros(2, 4), torch.zeros(2, dtype=I32),
                                       torch.zeros(2, dtype=I32)),
         r"k: expected dtype bfloat16, got float32"),
        (lambda: indexcache.paged_mqa_logits(torch.zeros(1, 1, 4, 128).to(torch.float8_e4m3fn),
                                             torch.zeros(2, 64 * 130, dtype=torch.uint8), torch.zeros(1, 4),
                                             torch.zeros(1, dtype=I32), torch.zeros(1, 2, dtype=I32), 128),
         r"k_cache: expected flat pages of page_size \* 132 bytes \(132 bytes a token of D = 128 fp8 keys\), got 8320 "
         r"bytes a page"),
        (lambda: indexcache.paged_mqa_logits(torch.zeros(1, 1, 4, 128).to(torch.float8_e4m3fn),
                                             torch.zeros(2, 64 * 132, dtype=torch.uint8), torch.zeros(1, 4),
                                             torch.zeros(1, dtype=I32), torch.zeros(1, 2, dtype=I32), 128,
                                             k_format=torch.float8_e4m3fn),
         r"k_format: expected None \(the cache holds q's fp8 format\) or torch.float4_e2m1fn_x2 \(MXFP4 keys\), "
         r"got torch.float8_e4m3fn"),
        (lambda: indexcache.paged_mqa_logits(torch.zeros(1, 1, 4, 128).to(torch.float8_e4m3fn),
                                             torch.zeros(2, 64 * 132, dtype=torch.uint8), torch.zeros(1, 4),
                                             torch.zeros(1, dtype=I32), torch.zeros(1, 2, dtype=I32), 128,
                                             k_format=torch.float4_e2m1fn_x2),
         r"k_cache: expected flat pages of page_size \* 68 bytes \(68 bytes a token of D = 128 MXFP4 keys\), got 8448 "
         r"bytes a page"),
        (lambda: indexcache.paged_mqa_logits(torch.zeros(1, 1, 4, 64).to(torch.float8_e4m3fn),  # q of D 64, cache 128
                                             torch.zeros(2, 64 * 132, dtype=torch.uint8), torch.zeros(1, 4),
                                             torch.zeros(1, dtype=I32), torch.zeros(1, 2, dtype=I32), 128),
         r"k_cache: expected flat pages of page_size \* 68 bytes \(68 bytes a token of D = 64 fp8 keys\), got 8448 "
         r"bytes a page"),
        (lambda: indexcache.gather_index_k(torch.zeros(2, 64, 1, 68, dtype=torch.uint8), torch.zeros(1, 2, dtype=I32),
                                           torch.zeros(1, dtype=I32)),  # a cache of D 64, dim left at 128
         r"k_cache: expected shape \[num_pages, page_size, 1, 132\] \(132 bytes a token of D = 128 fp8 keys\), got "
         r"\[2, 64, 1, 68\]"),
        (lambda: indexcache.paged_mqa_logits(torch.zeros(1, 1, 4, 48).to(torch.float8_e4m3fn),
                                             torch.zeros(2, 64 * 51, dtype=torch.uint8), torch.zeros(1, 4),
                                             torch.zeros(1, dtype=I32), torch.zeros(1, 2, dtype=I32), 128,
                                             k_format=torch.float4_e2m1fn_x2),
         r"q: expected a last dimension that is a positive multiple of 32 \(MXFP4 keys"),
        (lambda: indexcache.paged_topk_translate(torch.zeros(1, 1, 4, 128).to(torch.float8_e4m3fn),
                                                 torch.zeros(2, 64 * 68, dtype=torch.uint8), torch.zeros(1, 4),
                                                 torch.zeros(1, dtype=I32), torch.zeros(1, 2, dtype=I32), 128, 8,
                                                 torch.zeros(1, 2, dtype=I32), 64, k_format="mxfp4"),
         r"k_format: expected None .* got 'mxfp4'"),
        (lambda: indexcache.mqa_logits(*_fp4_prefill(q_fp4=True, k_fp4=False)[:6], q_scale=_fp4_prefill(True)[6]),
         r"q: MXFP4 queries \(float4_e2m1fn_x2\) are taken with MXFP4 keys only, got keys of dtype float8_e4m3fn"),
        (lambda: indexcache.mqa_logits(*_fp4_prefill(q_fp4=True)[:6]),
         r"q_scale: MXFP4 queries need their block scales, \[\.\.\., D / 32\] float8_e8m0fnu, got None"),
        (lambda: indexcache.mqa_logits(*_fp4_prefill(q_fp4=True)[:6], q_scale=torch.zeros(2, 4, 2).to(FP4_SCALE)),
         r"q_scale: expected shape \[2, 4, 4\], got \[2, 4, 2\]"),
        (lambda: indexcache.mqa_logits(*_fp4_prefill(q_fp4=False)[:6], q_scale=torch.zeros(2, 4, 4).to(FP4_SCALE)),
         r"q_scale: only MXFP4 queries \(torch.float4_e2m1fn_x2\) take block scales, but q is float8_e4m3fn"),
        (lambda: indexcache.paged_mqa_logits(torch.zeros(1, 1, 4, 64, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
                                             torch.zeros(2, 64 * 68, dtype=torch.uint8), torch.zeros(1, 4),
                                             torch.zeros(1, dtype=I32), torch.zeros(1, 2, dtype=I32), 128,
                                             q_scale=torch.zeros(1, 1, 4, 4).to(FP4_SCALE)),
         r"k_format: MXFP4 queries \(float4_e2m1fn_x2\) read an MXFP4 cache only: expected "
         r"k_format=torch.float4_e2m1fn_x2, got None"),
        (lambda: indexcache.quantize_index_k(torch.zeros(2, 100)),
         r"k: expected a last dimension divisible by block=128"),
        (lambda: indexcache.quantize_index_k(torch.zeros(2, 128), torch.bfloat16),
         r"fp8_dtype: expected None \(the device's native fp8 format\) or float8_e4m3fn or float8_e4m3fnuz or "
         r"float4_e2m1fn_x2, got torch.bfloat16"),
        (lambda: indexcache.quantize_index_k(torch.zeros(2, 128), torch.float4_e2m1fn_x2, block=128),
         r"block: MXFP4 keys take a scale every 32 elements, got block=128"),
        (lambda: indexcache.quantize_index_k(torch.zeros(2, 128), torch.float4_e2m1fn_x2, block=32.0),
         r"block: expected an int"),
        (lambda: indexcache.quantize_index_k(torch.zeros(2, 256), out=torch.zeros(2, 256)),
         r"out: expected dtype float8_e4m3fn, got float32"),
        (lambda: indexcache.quantize_index_k(torch.zeros(2, 256), out_scale=torch.zeros(2, 1)),
         r"out_scale: expected shape \[2, 2\], got \[2, 1\]"),
        (lambda: indexcache.quantize_index_k(torch.zeros(2, 128), torch.float4_e2m1fn_x2,
                                             out=torch.zeros(2, 64, dtype=torch.float8_e4m3fn)),
         r"out: expected dtype float4_e2m1fn_x2, got float8_e4m3fn"),
        (lambda: indexcache.quantize_index_k(torch.zeros(2, 256), out_scale=torch.zeros(2, 2).t().contiguous().t()),
         r"out_scale: expected rows of contiguous elements \(stride 1 in the last dimension\), got strides \[1, 2\]"),
        (lambda: indexcache.quantize_index_k(_k := torch.zeros(2, 256), out_scale=_k.view(-1)[:4].view(2, 2)),
         r"out_scale: expected a tensor that shares no memory"),
    ],
)
def test_bad_input_names_argument(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()


@pytest.mark.parametrize("fp8_dtype, block", [(torch.float8_e4m3fn, 128), (torch.float4_e2m1fn_x2, 32)])
def test_quantize_default_block_is_the_formats(fp8_dtype, block):
    """No ``block``: a scale every 128 elements for fp8 keys, every 32 (MXFP4's only size) for MXFP4 keys; the same
    bytes as naming it."""
    k = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    values, scales = indexcache.quantize_index_k(k, fp8_dtype, backend="torch")
    named = indexcache.quantize_index_k(k, fp8_dtype, block=block, backend="torch")
    assert scales.shape == (3, 256 // block)
    assert torch.equal(values.view(torch.uint8), named[0].view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), named[1].view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype, block", [(torch.float8_e4m3fn, 64), (torch.float4_e2m1fn_x2, 32)])
def test_quantize_writes_into_given_outputs_and_returns_them(fp8_dtype, block):
    """Given outputs (rows of wider buffers) get the same bytes a call that allocates returns, and are returned."""
    k = torch.randn(5, 128, generator=torch.Generator().manual_seed(6)) * 4
    want = indexcache.quantize_index_k(k, fp8_dtype, block=block, backend="torch")
    values = torch.full((5, want[0].shape[1] + 16), 9, dtype=torch.uint8)[:, 8:-8].view(want[0].dtype)
    scales = torch.full((5, 128 // block + 3), 9, dtype=torch.uint8 if fp8_dtype == torch.float4_e2m1fn_x2
                        else torch.float32)[:, 1:-2].view(want[1].dtype)
    got = indexcache.quantize_index_k(k, fp8_dtype, block=block, out=values, out_scale=scales, backend="torch")
    assert got[0] is values and got[1] is scales
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                           if b.element_size() == 1 else b)


def test_translate_writes_into_out():
    raw, table = torch.tensor([[0, 70]], dtype=I32), torch.tensor([[2, 3]], dtype=I32)
    seq = torch.tensor([80], dtype=I32)
    out = torch.full((1, 2), 5, dtype=I32)
    assert indexcache.translate(raw, table, seq, 64, out=out, backend="torch") is out
    assert out.tolist() == [[128, 198]]


BUDGET_SCRIPT = """
import resource, torch, indexcache
from indexcache.backends.torch import set_memory_budget
torch.manual_seed(0)
T, H, N, D = 64, 64, 131072, 16   # an unchunked [T, H, N] float32 product would be 2 GiB
q = torch.randn(T, H, D).to(torch.float8_e4m3fn)
k = torch.randn(N, D).to(torch.float8_e4m3fn)
args = (torch.ones(N), torch.randn(T, H), torch.zeros(T, dtype=torch.int32), torch.full((T,), N, dtype=torch.int32))
out = torch.empty(T, N)
set_memory_budget(32 * 2**20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
indexcache.mqa_logits(q, k, *args, out=out, backend="torch")
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(grown)
"""


def test_logits_stay_under_memory_budget():
    """With a 32 MiB budget the peak grows by well under the 2 GiB an unchunked product needs."""
    proc = subprocess.run([sys.executable, "-c", BUDGET_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grown = int(proc.stdout.strip())
    assert grown < 128 * 2**20, f"peak memory grew by {grown / 2**20:.0f} MiB"


MXFP4_BUDGET_SCRIPT = """
import resource, torch, indexcache
from indexcache.backends.torch import set_memory_budget
from indexcache.hal import fp4
torch.manual_seed(0)
T, H, N, D = 4, 8, 131072, 128   # all N MXFP4 keys decoded at once: about N * D * 24 bytes, 384 MiB
q = torch.randn(T, H, D).to(torch.float8_e4m3fn)
k = torch.randint(0, 256, (N, D // 2), dtype=torch.uint8).view(fp4.FP4)
k_scale = torch.randint(120, 135, (N, D // 32), dtype=torch.uint8).view(fp4.E8M0)
args = (torch.randn(T, H), torch.zeros(T, dtype=torch.int32), torch.full((T,), N, dtype=torch.int32))
out = torch.empty(T, N)
set_memory_budget(32 * 2**20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
indexcache.mqa_logits(q, k, k_scale, *args, out=out, backend="torch")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_mxfp4_key_logits_stay_under_memory_budget():
    """MXFP4 keys are decoded a chunk at a time: with a 32 MiB budget the peak grows by well under the 384 MiB that
    decoding all 131072 keys at once takes."""
    proc = subprocess.run([sys.executable, "-c", MXFP4_BUDGET_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grown = int(proc.stdout.strip())
    assert grown < 128 * 2**20, f"peak memory grew by {grown / 2**20:.0f} MiB"


def test_memory_budget_setting(monkeypatch):
    from indexcache.backends.torch import memory

    monkeypatch.setenv(memory.ENV_VAR, "1000")
    assert memory.memory_budget() == 1000
    memory.set_memory_budget(2048)
    try:
        assert memory.memory_budget() == 2048
    finally:
        memory.set_memory_budget(None)
    monkeypatch.setenv(memory.ENV_VAR, "lots")
    with pytest.raises(ValueError, match="INDEXCACHE_TORCH_MEMORY_BUDGET: expected a positive number of bytes"):
        memory.memory_budget()
    for bad in (0, -1, 1.5, True, "1024"):  # the README: not a positive integer is a MemoryBudgetError, either way
        with pytest.raises(memory.MemoryBudgetError, match=f"nbytes: expected a positive int or None, got {bad!r}"):
            memory.set_memory_budget(bad)


def _peak_temporaries(fn) -> int:
    """The most bytes ``fn`` holds at once on the CPU: the profiler's allocations and frees in time order (an op's
    own net bytes at its start, frees between ops as they come), so a storage counts from its allocation to its
    free; what existed before the call (inputs, ``out``) never counts. Exact up to scalar temporaries of a few bytes:
    ``a = empty(2**20); b = a * 2; del a; c = b + 1`` peaks at 8 MiB and 8 bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = top = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        top = max(top, live)
    return top


def test_peak_temporaries_counts_exactly():
    def three():
        a = torch.empty(2**20)
        b = a * 2
        del a
        return b + 1

    assert 8 * 2**20 <= _peak_temporaries(three) <= 8 * 2**20 + 64


def _mqa_args(k_fp4: bool):
    """``mqa_logits``' arguments: 64 queries of 16 heads over 8192 keys of D 128, fp8 or MXFP4 keys, ragged
    windows."""
    from indexcache.hal import fp4

    g = torch.Generator().manual_seed(0)
    tokens, heads, n, dim = 64, 16, 8192, 128
    q = torch.randn(tokens, heads, dim, generator=g).to(torch.float8_e4m3fn)
    if k_fp4:
        k = torch.randint(0, 256, (n, dim // 2), generator=g, dtype=torch.uint8).view(fp4.FP4)
        k_scale = torch.randint(120, 135, (n, dim // 32), generator=g, dtype=torch.uint8).view(fp4.E8M0)
    else:
        k, k_scale = torch.randn(n, dim, generator=g).to(torch.float8_e4m3fn), torch.rand(n, generator=g)
    ks = torch.randint(0, n // 2, (tokens,), generator=g, dtype=I32)
    ke = torch.randint(n // 2, n + 1, (tokens,), generator=g, dtype=I32)
    return q, k, k_scale, torch.randn(tokens, heads, generator=g), ks, ke, torch.empty(tokens, n)


def _paged_args(k_fp4: bool):
    """``paged_mqa_logits``' arguments: 4 requests of 2 draft tokens, 16 heads, D 128, over 64 pages of 64 keys
    (fp8 or MXFP4), 2048 key positions, table entries from -1."""
    from indexcache.hal import fp4

    g = torch.Generator().manual_seed(0)
    batch, next_n, heads, dim, pages, page_size = 4, 2, 16, 128, 64, 64
    q = torch.randn(batch, next_n, heads, dim, generator=g).to(torch.float8_e4m3fn)
    if k_fp4:
        cache = torch.cat([torch.randint(0, 256, (pages, page_size * dim // 2), generator=g, dtype=torch.uint8),
                           torch.randint(120, 135, (pages, page_size * dim // 32), generator=g, dtype=torch.uint8)], 1)
    else:
        cache = torch.cat([torch.randn(pages, page_size * dim, generator=g).to(torch.float8_e4m3fn).view(torch.uint8),
                           torch.rand(pages, page_size, generator=g).view(torch.uint8).reshape(pages, -1)], 1)
    max_len = pages * page_size // 2
    table = torch.randint(-1, pages, (batch, max_len // page_size + 1), generator=g, dtype=I32)
    lens = torch.randint(next_n, max_len + 1, (batch,), generator=g, dtype=I32)
    return (q, cache, torch.randn(batch * next_n, heads, generator=g), lens, table, max_len,
            torch.empty(batch * next_n, max_len), fp4.FP4 if k_fp4 else None)


@pytest.mark.parametrize("budget_mib", [1, 2, 4])
@pytest.mark.parametrize("k_fp4", [False, True], ids=["fp8", "mxfp4"])
@pytest.mark.parametrize("op", ["mqa_logits", "paged_mqa_logits"])
def test_logits_temporaries_peak_under_budget(op, k_fp4, budget_mib):
    """The README's promise, counted byte for byte: no two chunks' temporaries alive at once, and mqa_logits' row
    chunk sized from what its key chunk leaves. The slack is 4 KiB of scalars and small index tensors (a chunk's
    column numbers and window bounds), well under one key's or one row's bytes."""
    from indexcache.backends.torch import logits, set_memory_budget

    args = _mqa_args(k_fp4) if op == "mqa_logits" else _paged_args(k_fp4)
    expected = getattr(logits, op)(*args).clone()
    set_memory_budget(budget_mib * 2**20)
    try:
        top = _peak_temporaries(lambda: getattr(logits, op)(*args))
        chunked = args[6].clone()
    finally:
        set_memory_budget(None)
    assert top <= budget_mib * 2**20 + 4096, f"{top / 2**20:.3f} MiB of temporaries under a {budget_mib} MiB budget"
    if op == "paged_mqa_logits":  # one key position a product: any chunking gives the same bits
        assert torch.equal(chunked, expected)
    else:  # fp32 matmuls of other shapes may round otherwise: within the reference's tolerance
        torch.testing.assert_close(chunked, expected, rtol=1e-5, atol=1e-3)
