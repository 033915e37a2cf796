"""The SM budget (issue #41) on the cuda backend's Triton kernels, interpreted on the CPU: under a budget the
persistent launches run fewer programs, each looping over more of the work (the top-k's rows and split chunks, the
logits' blocks and tiles; the sort in launches of n rows), and the results are those without it: the integer ops
equal the torch backend's, the logits the unbudgeted run's bit for bit.
A kept call (indexcache.hal.memo) is kept per budget.

Interpreted, the top-k sees one multiprocessor and the logits ``INTERPRETED_SMS``, so no budget is below them: the
fixture gives both 16, and the grids each call launched are recorded to show the budget of 3 took effect."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.hal import dispatch, memo
from indexcache.hal.layout import new_packed_cache

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks"),
              pytest.mark.usefixtures("interpreted")]

I32 = torch.int32
SMS = 16
BUDGET = 3


@pytest.fixture
def grids(monkeypatch):
    """A device of 16 multiprocessors for the interpreted kernels; the ``(kernel, grid)`` of each launch, in order."""
    from indexcache.backends.triton import launcher, logits, prefill_producer
    from indexcache.backends.triton.topk import plan

    monkeypatch.setattr(plan, "multiprocessors", lambda target, device: SMS)
    monkeypatch.setattr(prefill_producer, "multiprocessors", lambda target, device: SMS)
    monkeypatch.setattr(logits, "INTERPRETED_SMS", SMS)
    found = []
    interpret = launcher._interpret

    def recorded(fn, grid, options, args, named):
        found.append((fn.__name__, tuple(grid)))
        interpret(fn, grid, options, args, named)

    monkeypatch.setattr(launcher, "_interpret", recorded)
    return found


def _sets(out: torch.Tensor) -> list[list[int]]:
    """Each row's selection as a sorted list (an unsorted top-k's slot order is not part of the contract)."""
    return [sorted(row) for row in out.tolist()]


def _launched(grids: list, fn):
    grids.clear()
    got = fn()
    return got, list(grids)


@pytest.mark.parametrize(("rows", "cols", "free", "capped"), [
    # One long row split into 4096-column chunks over 16 multiprocessors (5 of them), finished by a program a chunk;
    # under 3, at most 3 chunks.
    (1, 20000, [("topk_sample_kernel", (1,)), ("topk_filter_kernel", (1, 5)), ("topk_finish_kernel", (1, 5))],
     [("topk_sample_kernel", (1,)), ("topk_filter_kernel", (1, 3)), ("topk_finish_kernel", (1, 3))]),
    # Six rows, a program each; under 3, each program takes two rows.
    (6, 3000, [("topk_rows_kernel", (6,)), ("topk_finish_kernel", (6,))],
     [("topk_rows_kernel", (3,)), ("topk_finish_kernel", (3,))]),
])
def test_topk_under_a_budget_selects_what_the_torch_backend_does(grids, rows, cols, free, capped):
    g = torch.Generator().manual_seed(rows)
    scores = torch.randn(rows, cols, generator=g)
    lengths = torch.randint(cols // 2, cols + 1, (rows,), generator=g, dtype=I32)
    want = _sets(indexcache.topk(scores, lengths, 64, backend="torch"))
    got, launched = _launched(grids, lambda: indexcache.topk(scores, lengths, 64, backend="cuda"))
    assert launched == free and _sets(got) == want
    got, launched = _launched(grids, lambda: indexcache.topk(scores, lengths, 64, sm_budget=BUDGET, backend="cuda"))
    assert launched == capped and _sets(got) == want
    with indexcache.sm_budget(BUDGET):  # the block's budget, as the argument's
        got, launched = _launched(grids, lambda: indexcache.topk(scores, lengths, 64, backend="cuda"))
    assert launched == capped and _sets(got) == want


def test_sorted_topk_translate_under_a_budget_sorts_and_translates_every_row(grids):
    """The sort under a budget of 3: launches of three, three and one programs over seven rows (rows of one request, a
    short row, an empty one, rows translated through their request's pages), slot for slot the torch backend's."""
    g = torch.Generator().manual_seed(5)
    rows, cols, k = 7, 3000, 32
    scores = torch.randn(rows, cols, generator=g)
    lengths = torch.tensor([3000, 2500, 20, 0, 1777, 3000, 40], dtype=I32)
    starts = torch.tensor([0, 300, 7, 0, 1000, 0, 2900], dtype=I32)
    table = torch.randint(0, 1000, (3, 3000 // 64 + 1), generator=g, dtype=I32)
    r2b = torch.tensor([0, 2, 1, 1, 0, 2, 0], dtype=I32)
    named = dict(row_starts=starts, row_to_batch=r2b, sorted=True)
    want_raw = torch.empty(rows, k, dtype=I32)
    want = indexcache.topk_translate(scores, lengths, k, table, 64, out_raw=want_raw, **named, backend="torch")
    got_raw = torch.empty(rows, k, dtype=I32)
    got, launched = _launched(grids, lambda: indexcache.topk_translate(
        scores, lengths, k, table, 64, out_raw=got_raw, **named, sm_budget=BUDGET, backend="cuda"))
    assert launched == [("topk_rows_kernel", (3,)), ("topk_finish_kernel", (3,)), ("topk_sort_kernel", (3,)),
                        ("topk_sort_kernel", (3,)), ("topk_sort_kernel", (1,))]
    assert torch.equal(got, want) and torch.equal(got_raw, want_raw)
    plain, launched = _launched(grids, lambda: indexcache.topk(scores, lengths, k, row_starts=starts, sorted=True,
                                                               sm_budget=BUDGET, backend="cuda"))
    assert launched[-3:] == [("topk_sort_kernel", (3,)), ("topk_sort_kernel", (3,)), ("topk_sort_kernel", (1,))]
    assert torch.equal(plain, indexcache.topk(scores, lengths, k, row_starts=starts, sorted=True, backend="torch"))


def _paged(g: torch.Generator, batch: int, next_n: int, pages: int) -> tuple:
    """A cache of ``batch * pages`` random 64-key pages, fp8 queries ``[batch, next_n, 16, 128]``, weights, a block
    table of distinct pages and a KV page table of 16-token pages."""
    cache = new_packed_cache(batch * pages, 64, 128)
    indexcache.store_index_k(torch.randn(batch * pages * 64, 128, generator=g), cache,
                             torch.arange(batch * pages * 64, dtype=I32), backend="torch")
    q = torch.randn(batch, next_n, 16, 128, generator=g).to(torch.float8_e4m3fn)
    blocks = torch.randperm(batch * pages, generator=g).to(I32).view(batch, pages)
    table = torch.randint(0, 500, (batch, 4 * pages + 1), generator=g, dtype=I32)
    return cache, q, torch.randn(batch * next_n, 16, generator=g), blocks, table


def test_the_decode_step_under_a_budget_gives_the_same_logits_and_selection(grids):
    """Three requests, two draft tokens each, 256 keys: the logits kernel's 12 tiles over 3 programs are the 12
    programs' logits bit for bit; the producer step selects what the torch backend does."""
    g = torch.Generator().manual_seed(11)
    cache, q, weights, blocks, table = _paged(g, 3, 2, 4)
    context = torch.tensor([256, 100, 200], dtype=I32)
    args = (q, cache, weights, context, blocks, 256)
    free, launched = _launched(grids, lambda: indexcache.paged_mqa_logits(*args, backend="cuda"))
    assert launched == [("paged_mqa_logits_kernel", (1, 12))]
    capped, launched = _launched(grids, lambda: indexcache.paged_mqa_logits(*args, sm_budget=BUDGET, backend="cuda"))
    assert launched == [("paged_mqa_logits_kernel", (1, 3))]
    assert torch.equal(capped, free)
    logits = torch.full((6, 256), float("nan"))
    step = (*args, 40, table, 16)
    got, launched = _launched(grids, lambda: indexcache.paged_topk_translate(*step, logits=logits, sm_budget=BUDGET,
                                                                             backend="cuda"))
    assert launched == [("paged_mqa_logits_kernel", (1, 3)), ("draft_rows_kernel", (1,)),
                        ("topk_rows_kernel", (3,)), ("topk_finish_kernel", (3,))]
    assert torch.equal(logits, free)  # every request is longer than k: every row written
    assert _sets(got) == _sets(indexcache.paged_topk_translate(*step, backend="torch"))


def test_mxfp4_queries_under_a_budget_give_the_same_logits(grids):
    """MXFP4 queries on an MXFP4 cache (the Triton kernel's ``Q_FP4``, block by block on sm90, at half the table's
    columns: at H = 64 a draft token a program): the two draft tokens' programs over the 12 tiles, under a budget of 3
    at most 3 in all, the same logits bit for bit, and the torch backend's within rounding."""
    g = torch.Generator().manual_seed(14)
    fp4 = torch.float4_e2m1fn_x2
    cache = new_packed_cache(12, 64, 128, fp8_dtype=fp4)
    indexcache.store_index_k(torch.randn(12 * 64, 128, generator=g), cache, torch.arange(12 * 64, dtype=I32), fp4,
                             backend="torch")
    values, scales = indexcache.quantize_index_k(torch.randn(3 * 2 * 64, 128, generator=g), fp4, backend="torch")
    q, q_scale = values.view(3, 2, 64, 64), scales.view(3, 2, 64, 4)
    blocks = torch.randperm(12, generator=g).to(I32).view(3, 4)
    args = (q, cache, torch.randn(6, 64, generator=g), torch.tensor([256, 100, 200], dtype=I32), blocks, 256)
    named = dict(k_format=fp4, q_scale=q_scale, backend="cuda")
    free, launched = _launched(grids, lambda: indexcache.paged_mqa_logits(*args, **named))
    assert launched == [("paged_mqa_logits_kernel", (2, 12))]  # a draft token a program, each over the 12 tiles
    capped, launched = _launched(grids, lambda: indexcache.paged_mqa_logits(*args, sm_budget=BUDGET, **named))
    assert launched == [("paged_mqa_logits_kernel", (2, 1))]  # the budget's 3 programs shared: one a draft token
    assert torch.equal(capped, free)
    torch.testing.assert_close(free, indexcache.paged_mqa_logits(*args, k_format=fp4, q_scale=q_scale,
                                                                 backend="torch"), rtol=1e-5, atol=1e-5)


def test_the_prefill_under_a_budget_gives_the_same_logits_and_selection(grids):
    g = torch.Generator().manual_seed(12)
    tokens, keys = 24, 400
    q = torch.randn(tokens, 16, 128, generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(keys, 128, generator=g).to(torch.float8_e4m3fn)
    ks = torch.randint(0, 100, (tokens,), generator=g, dtype=I32)
    ke = torch.minimum(ks + torch.randint(0, keys, (tokens,), generator=g, dtype=I32), torch.tensor(keys, dtype=I32))
    args = (q, k, torch.rand(keys, generator=g), torch.randn(tokens, 16, generator=g), ks, ke)
    free, launched = _launched(grids, lambda: indexcache.mqa_logits(*args, backend="cuda"))
    assert launched == [("mqa_logits_kernel", (3,))]  # 3 blocks of 8 queries: fewer than the 16 programs
    capped, launched = _launched(grids, lambda: indexcache.mqa_logits(*args, sm_budget=2, backend="cuda"))
    assert launched == [("mqa_logits_kernel", (2,))]
    assert torch.equal(capped, free)
    table = torch.randint(0, 500, (tokens, keys // 16 + 1), generator=g, dtype=I32)
    got, launched = _launched(grids, lambda: indexcache.mqa_topk_translate(*args, 32, table, 16, sm_budget=BUDGET,
                                                                           backend="cuda"))
    assert launched == [("windows_kernel", (1,)), ("mqa_logits_kernel", (3,)), ("topk_rows_kernel", (3,)),
                        ("topk_finish_kernel", (3,))]
    assert _sets(got) == _sets(indexcache.mqa_topk_translate(*args, 32, table, 16, backend="torch"))


def test_a_kept_call_is_kept_per_budget(grids):
    """A call with its output given is kept from its second call on; the same call under a budget is another
    signature (its key ends with the budget), bound under that budget, and each repeats its own launches."""
    dispatch.reset()
    g = torch.Generator().manual_seed(13)
    scores = torch.randn(6, 3000, generator=g)
    lengths = torch.randint(1500, 3001, (6,), generator=g, dtype=I32)
    want = _sets(indexcache.topk(scores, lengths, 64, backend="torch"))
    out = torch.empty(6, 64, dtype=I32)
    free = [("topk_rows_kernel", (6,)), ("topk_finish_kernel", (6,))]
    capped = [("topk_rows_kernel", (3,)), ("topk_finish_kernel", (3,))]

    def call(**extra):
        out.fill_(-7)
        _, launched = _launched(grids, lambda: indexcache.topk(scores, lengths, 64, out=out, **extra, backend="cuda"))
        assert _sets(out) == want
        return launched

    assert [call(), call(), call()] == [free] * 3
    assert memo.size() == 1
    assert call(sm_budget=BUDGET) == capped  # not the kept call of no budget
    with indexcache.sm_budget(BUDGET):
        assert call() == capped  # kept now, under the same signature as the argument's
    assert memo.size() == 2
    assert call(sm_budget=BUDGET) == capped and call() == free
    with pytest.raises(ValueError, match=r"^sm_budget: expected an int in \[1, "):  # checked before the memo is read
        indexcache.topk(scores, lengths, 64, out=out, sm_budget=0, backend="cuda")
    keys = [key for key, launch in memo._kept.items() if key[0] == "topk" and launch is not None]
    assert len(keys) == 2 and {key[-1] for key in keys} == {(int, BUDGET), (type(None), None)}
    dispatch.reset()


def test_the_workspace_of_a_call_under_a_budget_is_its_own(grids):
    """Split differently under a budget, a call takes other bytes: ``workspace_bytes`` with the call's budget gives
    them, and a workspace sized for the call without the budget is refused under it, naming the bytes it needs."""
    g = torch.Generator().manual_seed(14)
    scores = torch.randn(1, 20000, generator=g)
    lengths = torch.tensor([20000], dtype=I32)
    free = indexcache.workspace_bytes("topk", scores, lengths, 64, backend="cuda")
    capped = indexcache.workspace_bytes("topk", scores, lengths, 64, sm_budget=BUDGET, backend="cuda")
    with indexcache.sm_budget(BUDGET):
        assert indexcache.workspace_bytes("topk", scores, lengths, 64, backend="cuda") == capped
    assert capped > free > 0  # 3 chunks of 8192 columns against 5 of 4096: more candidate room
    want = _sets(indexcache.topk(scores, lengths, 64, backend="torch"))
    small = torch.empty(free, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"workspace: .*{capped}"):
        indexcache.topk(scores, lengths, 64, workspace=small, sm_budget=BUDGET, backend="cuda")
    got, launched = _launched(grids, lambda: indexcache.topk(
        scores, lengths, 64, workspace=torch.empty(capped, dtype=torch.uint8), sm_budget=BUDGET, backend="cuda"))
    assert launched[1] == ("topk_filter_kernel", (1, 3)) and _sets(got) == want
