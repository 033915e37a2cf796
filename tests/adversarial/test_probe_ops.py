"""Issue 21, the public ops and the runtime state on the torch backend: aliased outputs (item 3), stale
slots (item 6), non-finite inputs (item 7), bounds on k and page_size (item 8) and the internal errors that
leaked as raw RuntimeError / ZeroDivisionError (item 14). Each must fail with a named error, or give the
documented result."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.hal import reference
from indexcache.hal.layout import new_packed_cache
from indexcache.hal.ops import MAX_PAGE_SIZE, MAX_TOPK
from indexcache.runtime.state import TopkState

I32 = torch.int32
E4M3 = torch.float8_e4m3fn


def _producer(rows=4, cols=100, k=10):
    scores = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    lengths = torch.full((rows,), cols, dtype=I32)
    table = torch.arange(rows * 2, dtype=I32).view(rows, 2)
    return scores, lengths, table, k


def _paged(pages=3, page_size=64, batch=2, heads=4):
    q = torch.randn(batch, 1, heads, 128).to(E4M3)
    return dict(q=q, k_cache=new_packed_cache(pages, page_size), weights=torch.randn(batch, heads),
                context_lens=torch.full((batch,), 100, dtype=I32), page_table=torch.zeros(batch, 2, dtype=I32),
                max_context_len=128)


# ------------------------------------------------------------------------------------------------ item 3


def test_topk_translate_refuses_out_aliasing_out_raw():
    """issue 21 item 3: out and out_raw the same tensor (cuda wrote logical positions as slots)."""
    scores, lengths, table, k = _producer()
    both = torch.empty(4, k, dtype=I32)
    with pytest.raises(ValueError, match="out: .*shares no memory.*overlaps out_raw"):
        indexcache.topk_translate(scores, lengths, k, table, 64, out=both, out_raw=both, backend="torch")


def test_mqa_logits_refuses_out_aliasing_weights():
    """issue 21 item 3: the torch backend's mqa_logits wrote wrong logits with out aliasing weights."""
    q, kk = torch.randn(4, 4, 128).to(E4M3), torch.randn(4, 128).to(E4M3)
    weights = torch.randn(4, 4)
    ks, ke = torch.zeros(4, dtype=I32), torch.full((4,), 4, dtype=I32)
    with pytest.raises(ValueError, match="out: .*overlaps weights"):
        indexcache.mqa_logits(q, kk, torch.ones(4), weights, ks, ke, out=weights, backend="torch")


@pytest.mark.parametrize("where", ["raw", "raw's second half", "page_table"])
def test_translate_refuses_out_overlapping_an_input(where):
    """issue 21 item 3: any overlap with an input is refused, a partial one too."""
    buf = torch.zeros(2, 8, dtype=I32)
    raw, table = buf[:, :4], torch.zeros(2, 4, dtype=I32)
    out = {"raw": raw, "raw's second half": buf[:, 2:6], "page_table": table}[where]
    name = "page_table" if where == "page_table" else "raw"
    with pytest.raises(ValueError, match=f"out: .*overlaps {name}"):
        indexcache.translate(raw, table, torch.full((2,), 4, dtype=I32), 4, out=out, backend="torch")


def test_overlap_is_judged_by_memory_spans():
    """issue 21 item 3: the check is on the spans of memory (metadata only, no sync): interleaved column blocks
    of one buffer are refused, disjoint row blocks accepted."""
    buf = torch.full((2, 8), 5, dtype=I32)
    raw, out = buf[:, :4], buf[:, 4:]
    raw.copy_(torch.tensor([[0, 1, 2, 3]] * 2))
    # Row-major [2, 8]: raw's rows and out's rows interleave in memory, so their spans overlap: refused.
    with pytest.raises(ValueError, match="overlaps raw"):
        indexcache.translate(raw, torch.zeros(2, 1, dtype=I32), torch.full((2,), 4, dtype=I32), 4, out=out)
    flat = torch.full((16,), 5, dtype=I32)
    raw, out = flat[:8].view(2, 4), flat[8:].view(2, 4)
    raw.copy_(torch.tensor([[0, 1, 2, 3]] * 2))
    indexcache.translate(raw, torch.zeros(2, 1, dtype=I32), torch.full((2,), 4, dtype=I32), 4, out=out)
    assert out.tolist() == [[0, 1, 2, 3]] * 2


# ------------------------------------------------------------------------------------------------ item 6


def test_physical_slots_past_the_live_batch_are_cleared():
    """issue 21 item 6: after a 4-row forward then a 2-row one, physical[2:] held the first batch's slots."""
    scores, lengths, table, k = _producer(rows=4)
    state = TopkState(4, k)
    state.begin(4)
    state.produce(0, scores, lengths, table, 64)
    assert (state.physical >= 0).all()
    state.begin(2)
    state.produce(0, scores[:2], lengths[:2], table[:2], 64)
    assert (state.physical[2:] == -1).all() and (state.raw[2:] == -1).all()
    state.begin(0)
    assert (state.physical == -1).all() and (state.raw == -1).all()


def test_clear_resets_physical_too():
    """issue 21 item 6: clear() reset only raw."""
    scores, lengths, table, k = _producer(rows=3)
    state = TopkState(3, k)
    state.begin(3)
    state.produce(0, scores, lengths, table, 64)
    state.clear()
    assert (state.physical == -1).all() and (state.raw == -1).all() and state.producer is None


# ------------------------------------------------------------------------------------------------ item 7


def test_quantize_non_finite_blocks_are_nan_scaled_zeros():
    """issue 21 item 7: a block holding NaN or ±inf gets scale NaN and zero values (torch gave nan/inf scales)."""
    k = torch.randn(4, 256)
    k[0, 5], k[1, 130], k[2, :128] = float("nan"), float("inf"), float("-inf")
    q, scale = indexcache.quantize_index_k(k, backend="torch")
    bad = torch.tensor([[True, False], [False, True], [True, False], [False, False]])
    assert torch.equal(scale.isnan(), bad)
    assert (q.float().view(4, 2, 128)[bad] == 0).all()
    want_q, want_scale = reference.quantize_index_k(k)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale.nan_to_num(-1), want_scale.nan_to_num(-1))


def test_mqa_logits_nan_propagates_like_the_reference():
    """issue 21 item 7: NaN inputs give NaN logits inside the window, -inf outside, on the torch backend."""
    q, kk = torch.randn(3, 4, 128).to(torch.bfloat16), torch.randn(5, 128).to(torch.bfloat16)
    weights, k_scale = torch.randn(3, 4), torch.ones(5)
    q[0, 1, 2], weights[1, 0], k_scale[4] = float("nan"), float("nan"), float("nan")
    ks, ke = torch.zeros(3, dtype=I32), torch.tensor([5, 5, 3], dtype=I32)
    got = indexcache.mqa_logits(q, kk, k_scale, weights, ks, ke, backend="torch")
    want = reference.mqa_logits(q, kk, k_scale, weights, ks, ke)
    assert torch.equal(got.isnan(), want.isnan()) and got[0].isnan().all() and got[2, 3:].isneginf().all()


# ------------------------------------------------------------------------------------------------ item 8


@pytest.mark.parametrize("k", [MAX_TOPK + 1, 2**31])
def test_k_is_bounded(k):
    """issue 21 item 8: k = 2^31 allocated 8 GiB and never returned."""
    scores, lengths, table, _ = _producer(rows=1)
    with pytest.raises(ValueError, match=rf"k: expected an int in \[0, {MAX_TOPK}\]"):
        indexcache.topk(scores, lengths, k, backend="torch")
    with pytest.raises(ValueError, match="k: expected an int in"):
        indexcache.topk_translate(scores, lengths, k, table[:1], 64, backend="torch")


@pytest.mark.parametrize("page_size", [MAX_PAGE_SIZE + 1, 2**40, 2**70])
def test_page_size_is_bounded(page_size):
    """issue 21 item 8: page_size 2^40 hit a Triton int32 error, 2^70 an OverflowError."""
    raw = torch.zeros(2, 3, dtype=I32)
    with pytest.raises(ValueError, match=r"page_size: expected an int in \[1, 2147483647\] \(slots are int32\)"):
        indexcache.translate(raw, torch.zeros(2, 1, dtype=I32), torch.ones(2, dtype=I32), page_size)


# ------------------------------------------------------------------------------------------------ item 14


def test_cache_of_zero_pages():
    """issue 21 item 14: a 0-page cache raised a raw RuntimeError in the torch backend's reshape."""
    args = _paged()
    args["k_cache"] = new_packed_cache(0, 64)
    out = indexcache.paged_mqa_logits(**args, backend="torch")
    assert out.isneginf().all()
    cache = new_packed_cache(0, 64)
    indexcache.store_index_k(torch.randn(3, 128), cache, torch.arange(3, dtype=I32), backend="torch")
    assert cache.numel() == 0


def test_misaligned_cache_is_refused():
    """issue 21 item 14: a cache view starting off a 4-byte boundary raised a raw RuntimeError on .view(float32)."""
    flat = new_packed_cache(3, 64).view(-1)
    cache = flat[1 : 1 + 2 * 64 * 132].view(2, 64 * 132)
    with pytest.raises(ValueError, match="k_cache: expected a view that starts at a multiple of 4 bytes"):
        indexcache.store_index_k(torch.randn(3, 128), cache, torch.arange(3, dtype=I32), backend="torch")
    args = _paged()
    args["k_cache"] = cache
    with pytest.raises(ValueError, match=r"k_cache: expected a view that starts at a multiple of 4 bytes \(its "
                                         r"scales are float32\)"):
        indexcache.paged_mqa_logits(**args, backend="torch")
    fp4 = torch.float4_e2m1fn_x2  # MXFP4 scales are bytes: the reason is the kernels' word reads
    flat = new_packed_cache(3, 64, 128, fp8_dtype=fp4).view(-1)
    cache = flat[1 : 1 + 2 * 64 * 68].view(2, 64 * 68)
    with pytest.raises(ValueError, match=r"a multiple of 4 bytes \(the kernels read its keys and scales as 4-byte "
                                         r"words\), got storage offset 1"):
        indexcache.store_index_k(torch.randn(3, 128), cache, torch.arange(3, dtype=I32), fp4, backend="torch")


@pytest.mark.parametrize("dim", [0, 2, 6])
def test_store_key_dims_that_break_the_layout(dim):
    """issue 21 item 14: D = 0 raised ZeroDivisionError, D = 2 / 6 a RuntimeError on misaligned scales."""
    with pytest.raises(ValueError, match=f"k: expected a last dimension that is a positive multiple of 4.*got {dim}"):
        indexcache.store_index_k(torch.randn(3, dim), new_packed_cache(2, 5, dim), torch.arange(3, dtype=I32),
                                 backend="torch")


def test_expanded_out_is_refused():
    """issue 21 item 14: a stride-0 out raised a raw RuntimeError from torch's in-place write."""
    scores, lengths, table, k = _producer()
    out = torch.empty(1, 1, dtype=I32).expand(4, k)
    with pytest.raises(ValueError, match="out: expected a tensor whose elements have memory of their own"):
        indexcache.topk(scores, lengths, k, out=out, backend="torch")
    logits = torch.empty(1, 1).expand(2, 128)
    with pytest.raises(ValueError, match="out: expected a tensor whose elements have memory of their own"):
        indexcache.paged_mqa_logits(**_paged(), out=logits, backend="torch")


def test_an_out_whose_rows_overlap_is_refused_and_strided_views_that_do_not_are_taken():
    """An ``as_strided`` out whose rows share elements passed the stride-0 check and gave garbage (rows writing over
    each other); a column slice of a wider buffer, a transposed view and an empty one are fine."""
    from indexcache.hal.hisparse import empty_state

    raw = torch.tensor([[7, 2, 5], [1, 2, 3]], dtype=I32)
    args = (raw, torch.tensor([10, 10], dtype=I32), torch.arange(20, dtype=I32).view(2, 10), *empty_state(2, 4))
    overlapping = torch.zeros(4, dtype=I32).as_strided((2, 3), (1, 1))
    with pytest.raises(ValueError, match=r"^out: expected a tensor whose elements have memory of their own, got a "
                                         r"view whose elements overlap \(shape \[2, 3\], strides \[1, 1\]\)"):
        indexcache.hisparse_plan(*args, out=overlapping, backend="torch")
    table, lens = torch.tensor([[10, 11]], dtype=I32).expand(2, 2).contiguous(), torch.tensor([128, 128], dtype=I32)
    for out in (torch.empty(2, 8, dtype=I32)[:, 2:5], torch.empty(3, 2, dtype=I32).t(), torch.empty(0, 3, dtype=I32)):
        r = raw[:out.shape[0]]
        assert torch.equal(indexcache.translate(r, table[:out.shape[0]], lens[:out.shape[0]], 64, out=out,
                                                backend="torch"),
                           indexcache.translate(r, table[:out.shape[0]], lens[:out.shape[0]], 64, backend="torch"))


def test_page_of_zero_tokens_is_refused():
    """issue 21 item 14: a 4-D cache view with 0 tokens a page divided by zero."""
    args = _paged()
    args["k_cache"] = torch.zeros(3, 0, 1, 132, dtype=torch.uint8)
    with pytest.raises(ValueError, match="k_cache: expected pages of at least one token"):
        indexcache.paged_mqa_logits(**args, backend="torch")


@pytest.mark.parametrize("op", ["topk", "topk_translate"])
def test_sorted_must_be_a_bool(op):
    """sorted="no" was taken as True (bool("no")) and the call ran sorted."""
    scores, lengths, table, k = _producer()
    extra = (table, 64) if op == "topk_translate" else ()
    with pytest.raises(TypeError, match="^sorted: expected a bool, got str 'no'"):
        getattr(indexcache, op)(scores, lengths, k, *extra, sorted="no", backend="torch")
