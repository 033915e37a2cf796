"""The GPU backends' producer step of decode (``backends/triton/producer.py``), interpreted on the CPU: each draft
row's length and request as the top-k takes them, the step with three draft tokens (the conformance cases take
one and two) equal to the torch backend's, short requests left out of the logits whatever the batch mix, and a
step whose rows are all short in one launch."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.hal.layout import new_packed_cache

from .far import far

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks"),
              pytest.mark.usefixtures("interpreted")]


def test_each_draft_row_gets_its_length_and_request():
    from indexcache.backends.triton import producer
    from indexcache.backends.triton.launcher import Launch

    context_lens = torch.tensor([0, 1, 2, 700, -5], dtype=torch.int32)
    lengths, requests = (torch.full((15,), 99, dtype=torch.int32) for _ in range(2))
    Launch(producer.DRAFT_ROWS, (1,), (("num_warps", 4),), (context_lens, lengths, requests, 15, 1),
           dict(NEXT_N=3, BLOCK=producer.DRAFT_BLOCK))()
    assert lengths.tolist() == [-2, -1, 0, -1, 0, 1, 0, 1, 2, 698, 699, 700, -2, -1, 0]
    assert requests.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    # context_lens whose offsets pass 2^31 elements (an int32 stride): read at b * stride in int32 before, far outside
    # (a segfault interpreted)
    far_lens = far(context_lens, 0)
    lengths.fill_(99)
    Launch(producer.DRAFT_ROWS, (1,), (("num_warps", 4),), (far_lens, lengths, requests, 15, far_lens.stride(0)),
           dict(NEXT_N=3, BLOCK=producer.DRAFT_BLOCK))()
    assert lengths.tolist() == [-2, -1, 0, -1, 0, 1, 0, 1, 2, 698, 699, 700, -2, -1, 0]


def test_three_draft_tokens_select_from_their_logits():
    g = torch.Generator().manual_seed(3)
    cache = new_packed_cache(6, 64, 128)
    indexcache.store_index_k(torch.randn(6 * 64, 128, generator=g), cache, torch.arange(6 * 64, dtype=torch.int32),
                             backend="torch")
    q = torch.randn(2, 3, 16, 128, generator=g).to(torch.float8_e4m3fn)
    args = (q, cache, torch.randn(6, 16, generator=g), torch.tensor([150, 3], dtype=torch.int32),
            torch.tensor([[2, 0, 5], [1, 3, 4]], dtype=torch.int32), 192, 20,
            torch.tensor([[7, 1, -1, 9], [4, 4, 2, 0]], dtype=torch.int32), 64)
    got_raw, want_raw = (torch.empty(6, 20, dtype=torch.int32) for _ in range(2))
    got_logits = torch.full((6, 192), float("nan"))
    got = indexcache.paged_topk_translate(*args, logits=got_logits, out_raw=got_raw, backend="cuda")
    want_logits = indexcache.paged_mqa_logits(*args[:6], backend="torch")
    torch.testing.assert_close(got_logits[:3], want_logits[:3], rtol=1e-5, atol=1e-4)
    assert got_logits[3:].isnan().all()  # request 1 (3 keys, k 20): its rows need no logits and get none
    lengths = torch.tensor([148, 149, 150, 1, 2, 3], dtype=torch.int32)  # context - next_n + 1 + j
    want = indexcache.topk_translate(got_logits, lengths, 20, args[7], 64, out_raw=want_raw,
                                     row_to_batch=torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32), backend="torch")
    assert [sorted(r) for r in got_raw.tolist()] == [sorted(r) for r in want_raw.tolist()]
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want.tolist()]


def _paged(g: torch.Generator, batch: int, next_n: int, pages: int) -> tuple:
    """A cache of ``batch * pages`` random 64-key pages, fp8 queries ``[batch, next_n, 16, 128]``, weights, a block
    table of distinct pages and a KV page table of 16-token pages with holes."""
    cache = new_packed_cache(batch * pages, 64, 128)
    indexcache.store_index_k(torch.randn(batch * pages * 64, 128, generator=g), cache,
                             torch.arange(batch * pages * 64, dtype=torch.int32), backend="torch")
    q = torch.randn(batch, next_n, 16, 128, generator=g).to(torch.float8_e4m3fn)
    blocks = torch.randperm(batch * pages, generator=g).to(torch.int32).view(batch, pages)
    table = torch.randint(0, 500, (batch, 4 * pages + 1), generator=g, dtype=torch.int32)
    table[:, 3::7] = -1
    return cache, q, torch.randn(batch * next_n, 16, generator=g), blocks, table


@pytest.mark.parametrize("form", ["next_n 1", "next_n 2", "ragged"])
def test_short_requests_are_left_out_of_the_logits_whatever_the_mix(form):
    g = torch.Generator().manual_seed(39)
    k, pages = 40, 4
    context = torch.tensor([200, 40, 41, 0, 7, 256, 39], dtype=torch.int32)
    next_n = 2 if form == "next_n 2" else 1
    cache, q, weights, blocks, table = _paged(g, context.shape[0], next_n, pages)
    r2b = None
    if form == "ragged":  # a row a request, shuffled
        r2b = torch.randperm(context.shape[0], generator=g).to(torch.int32)
        context, q, weights = context[r2b.long()], q[r2b.long()], weights[r2b.long()]
    rows = q.shape[0] * next_n
    args = (q, cache, weights, context, blocks, pages * 64, k, table, 16)
    logits = torch.full((rows, pages * 64), float("nan"))
    got_raw, want_raw = (torch.full((rows, k), -7, dtype=torch.int32) for _ in range(2))
    got = indexcache.paged_topk_translate(*args, logits=logits, out_raw=got_raw, row_to_batch=r2b, backend="cuda")
    want = indexcache.paged_topk_translate(*args, out_raw=want_raw, row_to_batch=r2b, backend="torch")
    want_logits = indexcache.paged_mqa_logits(*args[:6], row_to_batch=r2b, backend="torch")
    long = (context.clamp(0, pages * 64) > k).repeat_interleave(next_n)
    assert logits[~long].isnan().all()  # never written, not even the -inf fill
    torch.testing.assert_close(logits[long], want_logits[long], rtol=1e-5, atol=1e-4)
    assert [sorted(r) for r in got_raw.tolist()] == [sorted(r) for r in want_raw.tolist()]
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want.tolist()]


@pytest.mark.parametrize("form", ["next_n 1", "next_n 2", "ragged"])
def test_rows_all_short_take_one_launch_and_no_logits(form):
    from indexcache.backends.cuda import NVIDIA
    from indexcache.backends.cuda.tuning import tuning
    from indexcache.backends.triton import producer
    from indexcache.backends.triton.target import detect

    g = torch.Generator().manual_seed(40)
    k, pages = 130, 2  # max_context_len 128 <= k
    # 300: clipped to the logits' 128 columns; -2^31 with two draft tokens wrapped to a full row
    context = torch.tensor([128, 0, 57, 300, -3, -2**31], dtype=torch.int32)
    next_n = 2 if form == "next_n 2" else 1
    cache, q, weights, blocks, table = _paged(g, context.shape[0], next_n, pages)
    r2b = None
    if form == "ragged":
        r2b = torch.tensor([4, 1, 2, 0, 7, 5], dtype=torch.int32)  # 7: a row naming no request
    rows = q.shape[0] * next_n
    args = (q, cache, weights, context, blocks, pages * 64, k, table, 16)
    logits = torch.full((rows, pages * 64), float("nan"))
    got_raw, want_raw = (torch.full((rows, k), -7, dtype=torch.int32) for _ in range(2))
    got = indexcache.paged_topk_translate(*args, logits=logits, out_raw=got_raw, row_to_batch=r2b, backend="cuda")
    want = indexcache.paged_topk_translate(*args, out_raw=want_raw, row_to_batch=r2b, backend="torch")
    assert torch.equal(got_raw, want_raw) and torch.equal(got, want)  # short rows: 0 .. len - 1 in order, then -1
    assert logits.isnan().all()
    target = detect(NVIDIA)[2]
    out = torch.empty(rows, k, dtype=torch.int32)
    launches = producer.launches(*args[:6], k, table, 16, logits, out, got_raw, row_to_batch=r2b, target=target,
                                 tuning=tuning(target.arch))
    assert [launch.launcher for launch in launches] == [producer.SHORT]
    assert indexcache.workspace_bytes("paged_topk_translate", *args, logits=logits, backend="cuda") == 0


def test_rows_all_short_write_outputs_of_a_huge_column_stride():
    """The one launch of a step whose rows are all short, into outputs whose column offsets pass 2^31 elements (rows
    of transposed buffers): it computed a slot's offset in int32 and wrote far outside ``out`` and ``out_raw`` (a
    segfault interpreted)."""
    g = torch.Generator().manual_seed(41)
    k, pages = 4, 1
    context = torch.tensor([3, 9, -2], dtype=torch.int32)
    cache, q, weights, blocks, table = _paged(g, context.shape[0], 1, pages)
    args = (q, cache, weights, context, blocks, k, k, table, 16)
    want_raw = torch.full((3, k), -7, dtype=torch.int32)
    want = indexcache.paged_topk_translate(*args, out_raw=want_raw, backend="torch")
    out, out_raw = (far(torch.full((3, k), -7, dtype=torch.int32), 1) for _ in range(2))
    indexcache.paged_topk_translate(*args, out=out, out_raw=out_raw, backend="cuda")
    assert torch.equal(out, want) and torch.equal(out_raw, want_raw)
    assert out_raw.tolist() == [[0, 1, 2, -1], [0, 1, 2, 3], [-1, -1, -1, -1]]
