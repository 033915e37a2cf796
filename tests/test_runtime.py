"""TopkState and IndexerRunner: producers, shared layers, layers without an indexer, stale rows, empty
batches, pipeline carries and the recorder hook, on small synthetic inputs (and, on a GPU, under
CUDA-graph capture)."""

import gc
import os
import sys
from collections import Counter

import pytest
import torch

import indexcache
from indexcache.hal import reference
from indexcache.hal.specs.paged_mqa_logits import args_of
from indexcache.plan import LayerPlan
from indexcache.runtime import PagedLogits, PrefillLogits
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import CarryError, CarryHeader, IndexRecorder, MissingProducerError, TopkState

pytestmark = pytest.mark.usefixtures("one_thread")

K = 4
PAGE = 4
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")


def inputs(rows, cols=24, seed=0, layers=8, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, cols, generator=g)
    lengths = torch.randint(0, cols + 1, (rows,), generator=g, dtype=torch.int32)
    pages = -(-cols // PAGE)
    tables = torch.stack([torch.randperm(rows * pages, generator=g).view(rows, pages) for _ in range(layers)])
    return scores.to(device), lengths.to(device), tables.to(device=device, dtype=torch.int32)


def expected(scores, lengths, table):
    raw = reference.topk(scores, lengths, K)
    return raw, reference.translate(raw, table, lengths, PAGE)


def same_sets(a, b):
    """Equal row by row as sets (the order inside a top-k row is unspecified)."""
    return torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)


def run(runner, state, scores, lengths, tables, layers=None, calls=None):
    out = {}
    for layer in runner.layers if layers is None else layers:
        def score_fn(layer=layer):
            if calls is not None:
                calls.append(layer)
            return scores
        got = runner.layer(layer, state, scores=score_fn, lengths=lengths, page_table=tables[layer])
        out[layer] = None if got is None else got.clone()
    return out


def test_producer_selects_and_shared_layers_translate_through_their_own_table():
    scores, lengths, tables = inputs(6)
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    assert runner.roles == "FFSSSFSS"
    state = TopkState(8, K)
    runner.begin(state, 6)
    calls = []
    out = run(runner, state, scores, lengths, tables, calls=calls)
    assert calls == [0, 1, 5]
    raw, _ = expected(scores, lengths, tables[0])
    for layer in range(8):
        assert same_sets(out[layer], reference.translate(raw, tables[layer], lengths, PAGE)), layer
    assert same_sets(state.raw[:6], raw)
    assert state.producer == 5
    assert not torch.equal(out[2], out[3]), "different page tables must give different physical slots"


def test_a_state_subclass_selects_for_every_producer_and_shared_layers_reuse_its_choice():
    """``TopkState.select`` is the producer's one selection step: an override (here: the worst k instead of
    the best) is what producers store and shared layers translate; the bookkeeping stays the state's."""

    class WorstK(TopkState):
        def select(self, scores, lengths, page_table, page_size, *, row_starts, row_to_batch, out, out_raw):
            return super().select(-scores, lengths, page_table, page_size, row_starts=row_starts,
                                  row_to_batch=row_to_batch, out=out, out_raw=out_raw)

    scores, lengths, tables = inputs(6)
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    state = WorstK(8, K)
    runner.begin(state, 6)
    out = run(runner, state, scores, lengths, tables)
    raw, _ = expected(-scores, lengths, tables[0])
    assert same_sets(state.raw[:6], raw) and (state.raw[6:] == -1).all()
    assert same_sets(out[2], reference.translate(raw, tables[2], lengths, PAGE))


@pytest.mark.parametrize("next_n", [1, 2])
def test_a_decode_producer_scores_and_selects_in_one_op_and_shared_layers_reuse_it(next_n):
    """A ``scores`` callable returning :class:`PagedLogits` makes the producer call ``paged_topk_translate``
    (``TopkState.produce_paged``): the same slots as ``paged_mqa_logits`` then ``produce``, the logits in the
    given buffer, the same bookkeeping (producer, recorder, rows past the batch -1)."""
    g = torch.Generator().manual_seed(0)
    paged = args_of(g, "cpu", 3, next_n, 4, PAGE, [20, 3, 0])
    rows, cols = 3 * next_n, paged["max_context_len"]
    tables = torch.stack([torch.randperm(18, generator=g).view(3, 6) for _ in range(4)]).to(torch.int32)
    seen = torch.arange(rows)
    lengths = (paged["context_lens"][seen // next_n] - next_n + 1 + seen % next_n).clamp_min(0).to(torch.int32)
    row_to_batch = (seen // next_n).to(torch.int32)
    runner = IndexerRunner(LayerPlan(4, index_topk_freq=2, index_topk=K, page_size=PAGE))
    logits = torch.full((rows, cols), float("nan"))
    decode = PagedLogits(paged["q"], paged["k_cache"], paged["weights"], paged["context_lens"], paged["page_table"],
                         cols, logits)
    state, recorder = TopkState(8, K), IndexRecorder()
    state.recorder = recorder
    runner.begin(state, rows)
    got = {layer: runner.layer(layer, state, scores=lambda: decode, lengths=lengths, page_table=tables[layer],
                               row_to_batch=row_to_batch).clone() for layer in range(4)}
    assert runner.roles == "FFSF" and state.producer == 3 and (state.raw[rows:] == -1).all()

    want_logits = indexcache.paged_mqa_logits(*(paged[n] for n in ("q", "k_cache", "weights", "context_lens",
                                                                    "page_table", "max_context_len")))
    assert torch.equal(logits, want_logits)
    plain = TopkState(8, K)
    plain.begin(rows)
    for layer in range(4):
        if runner.role(layer) == "F":
            want = plain.produce(layer, want_logits, lengths, tables[layer], PAGE, row_to_batch=row_to_batch)
            assert torch.equal(recorder.indices[layer][0], plain.raw[:rows])
        else:
            want = reference.translate(plain.raw[:rows], tables[layer], lengths, PAGE, row_to_batch=row_to_batch)
        assert torch.equal(got[layer], want), layer
    # Request 2 (context 0) selects nothing; request 1's first row sees its first 4 - next_n keys.
    assert (state.raw[rows - next_n:rows] == -1).all()
    assert state.raw[next_n].tolist() == list(range(4 - next_n)) + [-1] * (K - 4 + next_n)


def test_a_decode_producer_takes_ragged_rows_named_by_paged_logits():
    """``PagedLogits(row_to_batch=...)``: ragged speculative rows (a different number of draft tokens a request, each
    row its own length) score and select in one op, as ``paged_mqa_logits(..., row_to_batch=...)`` then ``produce``
    select, with both tables indexed by request; shared layers reuse the selection through ``row_to_batch``."""
    from indexcache.hal.specs.paged_mqa_logits import ragged_args

    g = torch.Generator().manual_seed(0)
    paged = ragged_args(g, "cpu", torch.float8_e4m3fn, [1, 3, 2], [30, 9, 3], page_size=PAGE, heads=4)
    rows, cols = paged["q"].shape[0], paged["max_context_len"]
    lengths, row_to_batch = paged["context_lens"], paged["row_to_batch"]
    tables = torch.stack([torch.randperm(30, generator=g).view(3, 10) for _ in range(3)]).to(torch.int32)
    decode = PagedLogits(paged["q"], paged["k_cache"], paged["weights"], lengths, paged["page_table"], cols,
                         row_to_batch=row_to_batch)
    runner = IndexerRunner(LayerPlan(3, index_topk_freq=2, index_topk=K, page_size=PAGE))
    state = TopkState(8, K)
    runner.begin(state, rows)
    got = {layer: runner.layer(layer, state, scores=lambda: decode, lengths=lengths, page_table=tables[layer],
                               row_to_batch=row_to_batch).clone() for layer in range(3)}
    assert runner.roles == "FFS"

    logits = indexcache.paged_mqa_logits(*(paged[n] for n in ("q", "k_cache", "weights", "context_lens",
                                                               "page_table", "max_context_len")),
                                         row_to_batch=row_to_batch)
    plain = TopkState(8, K)
    plain.begin(rows)
    want = plain.produce(1, logits, lengths, tables[1], PAGE, row_to_batch=row_to_batch)
    assert torch.equal(state.raw[:rows], plain.raw[:rows]) and torch.equal(got[1], want)
    assert torch.equal(got[2], reference.translate(plain.raw[:rows], tables[2], lengths, PAGE,
                                                   row_to_batch=row_to_batch))
    assert (state.raw[:rows] >= 0).sum() == lengths.clamp(0, K).sum()


def _produced_rows_a_request(g: torch.Generator, ragged: bool):
    """A plan "FFS" whose producers 0 and 1 ran a decode step of rows that are not one a request in order (three
    requests of next_n 2, or ragged rows of the ``PagedLogits``' own ``row_to_batch``): ``(runner, state, tables
    [3, 3, 10] of the three layers, lengths [rows], row_to_batch [rows])``."""
    from indexcache.hal.specs.paged_mqa_logits import ragged_args

    if ragged:
        paged = ragged_args(g, "cpu", torch.float8_e4m3fn, [1, 3, 2], [30, 9, 3], page_size=PAGE, heads=4)
        lengths, row_to_batch = paged["context_lens"], paged["row_to_batch"]
    else:
        paged = args_of(g, "cpu", 3, 2, 4, PAGE, [20, 13, 9])
        seen = torch.arange(6)
        lengths = (paged["context_lens"][seen // 2] - 1 + seen % 2).to(torch.int32)
        row_to_batch = (seen // 2).to(torch.int32)
    decode = PagedLogits(paged["q"], paged["k_cache"], paged["weights"], paged["context_lens"], paged["page_table"],
                         paged["max_context_len"], row_to_batch=paged.get("row_to_batch"))
    tables = torch.stack([torch.randperm(30, generator=g).view(3, 10) for _ in range(3)]).to(torch.int32)
    runner = IndexerRunner(LayerPlan(3, index_topk_freq=2, index_topk=K, page_size=PAGE))
    assert runner.roles == "FFS"
    state = TopkState(8, K)
    runner.begin(state, lengths.shape[0])
    for layer in (0, 1):
        runner.layer(layer, state, scores=lambda: decode, lengths=lengths, page_table=tables[layer])
    return runner, state, tables, lengths, row_to_batch


@pytest.mark.parametrize("ragged", [False, True], ids=["next_n 2", "ragged rows"])
def test_a_shared_layer_after_a_producer_of_rows_a_request_refuses_no_row_to_batch(ragged):
    """A decode producer's ``PagedLogits`` maps its rows to requests itself (``next_n`` rows a request, or its own
    ``row_to_batch``); a shared layer then given no ``row_to_batch`` would translate row r through page-table row r
    (another request's pages, or none): refused, naming the argument, the physical slots left as the producer's; a
    row_to_batch given, it translates; the next forward's producer of rows in order accepts None again."""
    g = torch.Generator().manual_seed(0)
    runner, state, tables, lengths, row_to_batch = _produced_rows_a_request(g, ragged)
    rows = lengths.shape[0]
    produced = state.physical.clone()
    with pytest.raises(ValueError, match=r"row_to_batch: None, but producer 1's rows are .*layer 2 would translate"):
        runner.layer(2, state, scores=_no_scores, lengths=lengths, page_table=tables[2])
    assert torch.equal(state.physical, produced)
    got = runner.layer(2, state, scores=_no_scores, lengths=lengths, page_table=tables[2], row_to_batch=row_to_batch)
    assert torch.equal(got, reference.translate(state.raw[:rows], tables[2], lengths, PAGE, row_to_batch=row_to_batch))

    # the next pipeline stage's shared layer, from the carry (its header, through the tensor transport): the same
    raw, header = state.to_carry()
    assert header.layout == (0 if ragged else 2)
    stage = TopkState.from_carry(raw.clone(), CarryHeader.from_tensor(header.to_tensor()), max_rows=8)
    with pytest.raises(ValueError, match=r"row_to_batch: None, but producer 1's rows are .*layer 2 would translate"):
        runner.layer(2, stage, scores=_no_scores, lengths=lengths, page_table=tables[2])
    got = runner.layer(2, stage, scores=_no_scores, lengths=lengths, page_table=tables[2], row_to_batch=row_to_batch)
    assert torch.equal(got, reference.translate(raw, tables[2], lengths, PAGE, row_to_batch=row_to_batch))

    one = args_of(g, "cpu", 3, 1, 4, PAGE, [20, 13, 9])
    in_order = PagedLogits(one["q"], one["k_cache"], one["weights"], one["context_lens"], one["page_table"],
                           one["max_context_len"])
    runner.begin(state, 3)
    for layer in (0, 1):
        runner.layer(layer, state, scores=lambda: in_order, lengths=one["context_lens"], page_table=tables[layer])
    got = runner.layer(2, state, scores=_no_scores, lengths=one["context_lens"], page_table=tables[2])
    assert torch.equal(got, reference.translate(state.raw[:3], tables[2], one["context_lens"], PAGE))
    assert state.to_carry()[1].layout == 1


@pytest.mark.parametrize("ragged", [False, True], ids=["next_n 2", "ragged rows"])
def test_a_shared_layer_with_a_page_table_of_one_row_a_row_needs_no_row_to_batch(ragged):
    """The refusal of ``row_to_batch`` None after a producer of ``next_n`` rows a request (or ragged rows) is for a
    table of one row a request: an engine that expands its shared layers' tables per row (``[rows, P]``, row r's
    request's pages at row r, as ``translate`` takes them without ``row_to_batch``) was refused too, on this stage
    and, through the carry, the next."""
    runner, state, tables, lengths, row_to_batch = _produced_rows_a_request(torch.Generator().manual_seed(1), ragged)
    rows = lengths.shape[0]
    per_row = tables[2][row_to_batch.long()]  # [rows, P]: row r holds its request's pages
    want = reference.translate(state.raw[:rows], tables[2], lengths, PAGE, row_to_batch=row_to_batch)
    assert torch.equal(runner.layer(2, state, scores=_no_scores, lengths=lengths, page_table=per_row), want)
    stage = TopkState.from_carry(*state.to_carry(), max_rows=8)
    assert torch.equal(runner.layer(2, stage, scores=_no_scores, lengths=lengths, page_table=per_row), want)
    with pytest.raises(ValueError, match=r"row_to_batch: None, but producer 1's rows are"):  # one row a request
        runner.layer(2, stage, scores=_no_scores, lengths=lengths, page_table=tables[2])


@pytest.mark.parametrize("mxfp4", [False, True], ids=["fp8", "MXFP4 queries and keys"])
def test_a_prefill_producer_scores_and_selects_in_one_op_and_shared_layers_reuse_it(mxfp4):
    """A ``scores`` callable returning :class:`PrefillLogits` makes the producer call ``mqa_topk_translate``
    (``TopkState.produce_prefill``): the same slots as ``mqa_logits`` then ``produce`` over each row's window, the
    same bookkeeping (producer, recorder, rows past the batch -1), whatever bound its scratch is given; MXFP4
    queries travel with their ``q_scale``."""
    g = torch.Generator().manual_seed(0)
    lengths_of = [30, 9]  # two requests' keys, concatenated; each prefills its last 5 tokens
    starts = [0, 30]
    ks = torch.tensor([starts[b] for b in (0, 1) for _ in range(5)], dtype=torch.int32)
    ke = torch.tensor([starts[b] + lengths_of[b] - 4 + j for b in (0, 1) for j in range(5)], dtype=torch.int32)
    row_to_batch = torch.tensor([0] * 5 + [1] * 5, dtype=torch.int32)
    keys = sum(lengths_of)
    q = torch.randn(10, 4, 32, generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(keys, 32, generator=g).to(torch.float8_e4m3fn)
    k_scale, weights = torch.rand(keys, generator=g) + 0.5, torch.randn(10, 4, generator=g)
    q_scale = None
    if mxfp4:
        q, q_scale = indexcache.quantize_index_k(torch.randn(40, 32, generator=g), torch.float4_e2m1fn_x2)
        q, q_scale = q.view(10, 4, 16), q_scale.view(10, 4, 1)
        k, k_scale = indexcache.quantize_index_k(torch.randn(keys, 32, generator=g), torch.float4_e2m1fn_x2)
    tables = torch.stack([torch.randperm(20, generator=g).view(2, 10) for _ in range(4)]).to(torch.int32)
    lengths = ke - ks
    runner = IndexerRunner(LayerPlan(4, index_topk_freq=2, index_topk=K, page_size=PAGE))
    prefill = PrefillLogits(q, k, k_scale, weights, ks, ke, workspace_bytes=2 * 4 * keys,  # two rows a pass
                            q_scale=q_scale)
    state, recorder = TopkState(12, K), IndexRecorder()
    state.recorder = recorder
    runner.begin(state, 10)
    got = {layer: runner.layer(layer, state, scores=lambda: prefill, lengths=lengths, page_table=tables[layer],
                               row_starts=ks, row_to_batch=row_to_batch).clone() for layer in range(4)}
    assert runner.roles == "FFSF" and state.producer == 3 and (state.raw[10:] == -1).all()

    logits = indexcache.mqa_logits(q, k, k_scale, weights, ks, ke, q_scale=q_scale)
    plain = TopkState(12, K)
    plain.begin(10)
    for layer in range(4):
        if runner.role(layer) == "F":
            want = plain.produce(layer, logits, lengths, tables[layer], PAGE, row_starts=ks, row_to_batch=row_to_batch)
            assert torch.equal(recorder.indices[layer][0], plain.raw[:10])
        else:
            want = reference.translate(plain.raw[:10], tables[layer], lengths, PAGE, row_to_batch=row_to_batch)
        assert torch.equal(got[layer], want), layer
    assert (state.raw[:10] < lengths[:, None]).all()  # positions within each row's window, from its start


@pytest.mark.parametrize("mxfp4_queries", [False, True], ids=["fp8 q", "MXFP4 q"])
def test_a_decode_producer_reads_an_mxfp4_cache_named_by_paged_logits(mxfp4_queries):
    """``PagedLogits(k_format=torch.float4_e2m1fn_x2)`` (and MXFP4 queries with their ``q_scale``): the producer
    selects from an MXFP4 cache what ``paged_mqa_logits(..., k_format=...)`` then ``produce`` select."""
    from indexcache.hal import fp4
    from indexcache.hal.layout import new_packed_cache

    g = torch.Generator().manual_seed(0)
    batch, pages, dim = 2, 5, 128
    cache = new_packed_cache(batch * pages, PAGE, dim, fp8_dtype=fp4.FP4)
    keys = torch.randn(batch * pages * PAGE, dim, generator=g)
    indexcache.store_index_k(keys, cache, torch.arange(len(keys), dtype=torch.int32), fp4.FP4)
    q, q_scale = torch.randn(batch, 1, 8, dim, generator=g).to(torch.float8_e4m3fn), None
    if mxfp4_queries:
        values, scales = indexcache.quantize_index_k(torch.randn(batch * 8, dim, generator=g), fp4.FP4)
        q, q_scale = values.view(batch, 1, 8, dim // 2), scales.view(batch, 1, 8, dim // fp4.BLOCK)
    weights = torch.randn(batch, 8, generator=g)
    context = torch.tensor([17, 9], dtype=torch.int32)
    block_table = torch.randperm(batch * pages, generator=g).view(batch, pages).to(torch.int32)
    page_table = torch.randperm(batch * pages, generator=g).view(batch, pages).to(torch.int32)
    max_len = pages * PAGE
    runner = IndexerRunner(LayerPlan(2, index_topk_freq=2, index_topk=K, page_size=PAGE))
    state = TopkState(batch, K)
    runner.begin(state, batch)
    decode = PagedLogits(q, cache, weights, context, block_table, max_len, k_format=fp4.FP4, q_scale=q_scale)
    got = runner.layer(0, state, scores=lambda: decode, lengths=context, page_table=page_table).clone()
    logits = indexcache.paged_mqa_logits(q, cache, weights, context, block_table, max_len, k_format=fp4.FP4,
                                         q_scale=q_scale)
    plain = TopkState(batch, K)
    plain.begin(batch)
    want = plain.produce(0, logits, context, page_table, PAGE)
    assert same_sets(got, want) and same_sets(state.raw[:batch], plain.raw[:batch])
    assert (got >= 0).all()


def test_produce_paged_checks_the_live_rows():
    g = torch.Generator().manual_seed(0)
    paged = args_of(g, "cpu", 2, 2, 4, PAGE, [9, 5])
    state = TopkState(8, K)
    state.begin(3)
    with pytest.raises(ValueError, match="weights: expected 3 rows"):
        state.produce_paged(0, *paged.values(), torch.zeros(2, 3, dtype=torch.int32), PAGE)


@pytest.mark.parametrize("returned", [None, (1, 2), {"q": 1}], ids=["None", "a tuple", "a dict"])
def test_a_scores_callable_returning_neither_scores_nor_logits_inputs_is_a_type_error_naming_scores(returned):
    runner = IndexerRunner(LayerPlan(2, index_topk_freq=2, index_topk=K, page_size=PAGE))
    state = TopkState(2, K)
    runner.begin(state, 2)
    lengths, table = torch.full((2,), 5, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match=f"scores: expected .* got {type(returned).__name__}"):
        runner.layer(0, state, scores=lambda: returned, lengths=lengths, page_table=table)
    assert state.producer is None and (state.raw == -1).all()


def test_layers_without_an_indexer_return_none_and_leave_the_state_alone():
    scores, lengths, tables = inputs(5, layers=6)
    plan = LayerPlan(6, compress_ratios=[0, 4, 128, 4, 0, 4], index_topk_freq=2, index_topk=K, page_size=PAGE)
    runner = IndexerRunner(plan)
    assert runner.roles == ".F.S.F"
    state = TopkState(5, K)
    runner.begin(state, 5)
    calls = []
    out = run(runner, state, scores, lengths, tables, layers=[0, 1, 2], calls=calls)
    before = state.raw.clone()
    assert out[0] is None and out[2] is None
    assert calls == [1]
    assert runner.layer(4, state, scores=lambda: pytest.fail("no indexer"), lengths=lengths,
                        page_table=tables[4]) is None
    assert torch.equal(state.raw, before) and state.producer == 1
    raw, _ = expected(scores, lengths, tables[1])
    assert same_sets(run(runner, state, scores, lengths, tables, layers=[3])[3],
                     reference.translate(raw, tables[3], lengths, PAGE))


def test_shared_layer_before_any_producer_raises():
    scores, lengths, tables = inputs(3)
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    state = TopkState(4, K)
    runner.begin(state, 3)
    with pytest.raises(MissingProducerError, match="layer 2 is shared but no producer"):
        runner.layer(2, state, scores=lambda: scores, lengths=lengths, page_table=tables[2])


def test_shared_layer_refuses_another_producers_indices():
    scores, lengths, tables = inputs(3)
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    state = TopkState(4, K)
    runner.begin(state, 3)
    run(runner, state, scores, lengths, tables, layers=[0, 1, 5])
    with pytest.raises(MissingProducerError, match="reuses layer 1's top-k, but the state holds layer 5's"):
        runner.layer(2, state, scores=lambda: scores, lengths=lengths, page_table=tables[2])


def test_rows_past_the_live_batch_are_minus_one_and_never_leak():
    scores, lengths, tables = inputs(8, seed=1)
    lengths.fill_(24)  # every row long: all slots valid in the big batch
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    state = TopkState(8, K)
    runner.begin(state, 8)
    run(runner, state, scores, lengths, tables)
    assert bool((state.raw >= 0).all())
    small = inputs(3, seed=2)
    runner.begin(state, 3)
    out = run(runner, state, *small)
    assert bool((state.raw[3:] == -1).all())
    fresh = TopkState(3, K)
    runner.begin(fresh, 3)
    assert all(torch.equal(out[layer], got) for layer, got in run(runner, fresh, *small).items())


def test_padding_rows_select_nothing():
    scores, lengths, tables = inputs(4)
    lengths[2] = 0
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    state = TopkState(4, K)
    runner.begin(state, 4)
    out = run(runner, state, scores, lengths, tables)
    assert all(bool((o[2] == -1).all()) for o in out.values())


def test_empty_batch_clears_the_state_and_runs():
    scores, lengths, tables = inputs(4)
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    state = TopkState(4, K)
    runner.begin(state, 4)
    run(runner, state, scores, lengths, tables)
    runner.begin(state, 0)
    assert state.producer is None and state.rows == 0 and bool((state.raw == -1).all())
    with pytest.raises(MissingProducerError):
        runner.layer(2, state, scores=lambda: scores, lengths=lengths[:0], page_table=tables[2])
    out = run(runner, state, scores[:0], lengths[:0], tables)
    assert all(o.shape == (0, K) for o in out.values())


def test_capacity_and_row_counts_are_checked():
    scores, lengths, tables = inputs(4)
    state = TopkState(4, K)
    with pytest.raises(ValueError, match="capacity"):
        state.begin(5)
    state.begin(3)
    with pytest.raises(ValueError, match="expected 3 rows"):
        state.produce(0, scores, lengths, tables[0], PAGE)
    with pytest.raises(ValueError, match="k=4"):
        IndexerRunner(LayerPlan(8, index_topk=8)).begin(state, 2)


def test_carry_round_trip_equals_the_unsplit_run():
    scores, lengths, tables = inputs(5)
    plan = LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE)
    whole = IndexerRunner(plan)
    state = TopkState(5, K)
    whole.begin(state, 5)
    unsplit = run(whole, state, scores, lengths, tables)

    first, second = plan.split_stages([3], mode="carry")
    assert second.carry_in == 1
    one, two = IndexerRunner(plan, stage=first), IndexerRunner(plan, stage=second)
    s1 = TopkState(8, K)
    one.begin(s1, 5)
    got = run(one, s1, scores, lengths, tables)
    raw, header = s1.to_carry()
    header = CarryHeader.from_tensor(header.to_tensor())  # what a tensor-only transport delivers
    s2 = TopkState(8, K)
    with pytest.raises(MissingProducerError):  # the stage without its carry
        two.begin(s2, 5)
        run(two, s2, scores, lengths, tables)
    s2.load_carry(raw.clone(), header)
    got.update(run(two, s2, scores, lengths, tables))
    assert got.keys() == unsplit.keys()
    assert all(torch.equal(got[layer], unsplit[layer]) for layer in unsplit)
    assert bool((s2.raw[5:] == -1).all())
    assert TopkState.from_carry(raw, header).producer == 1


def test_promote_runs_the_promoted_layers_indexer():
    scores, lengths, tables = inputs(5)
    plan = LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE)
    stage = plan.split_stages([3], mode="promote")[1]
    assert stage.promoted == (3,)
    runner = IndexerRunner(plan, stage=stage)
    state = TopkState(5, K)
    runner.begin(state, 5)
    calls = []
    run(runner, state, scores, lengths, tables, calls=calls)
    assert calls == [3, 5]


def test_carry_checks_its_header():
    state = TopkState(4, K)
    raw = torch.zeros(2, K, dtype=torch.int32)
    with pytest.raises(ValueError, match="k=8"):
        state.load_carry(raw, CarryHeader(producer=0, rows=2, k=8))
    with pytest.raises(ValueError, match="version"):
        state.load_carry(raw, CarryHeader(producer=0, rows=2, k=K, version=99))
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        state.load_carry(raw, CarryHeader(producer=0, rows=3, k=K))
    with pytest.raises(MissingProducerError):
        state.to_carry()


@pytest.mark.parametrize("header, match", [
    (torch.tensor([1.0, 0.7, 3.9, 4.2]), "integer tensor"),  # truncated to producer 0, rows 3, k 4 before
    (torch.tensor([1.0, 0.0, 2.0, 4.0]), "integer tensor"),
    (torch.tensor([True, False, True, True]), "integer tensor"),
    (torch.tensor([1, 0, 2]), r"shape \[5\]"),
    (torch.tensor([[1, 0], [2, 4]]), r"shape \[5\]"),
    (torch.tensor([2, -1, 2, 4, 1]), "producer: expected an int >= 0"),
    (torch.tensor([2, 0, -2, 4, 1]), "rows: expected an int >= 0"),
    (torch.tensor([2, 0, 2, 4, -1]), "layout: expected an int >= 0"),
    (torch.tensor([2, 0, 2, 4]), r"shape \[5\] .*got \[4\] of version 2"),  # a version 2 header cut to 4: no layout
    (torch.empty(4, dtype=torch.int64, device="meta"), "meta"),
    ([1, 0, 2, 4], "expected a tensor"),
])
def test_carry_header_from_tensor_refuses_what_is_not_the_format(header, match):
    with pytest.raises(CarryError, match=match):
        CarryHeader.from_tensor(header)


def test_carry_header_from_tensor_reads_any_integer_dtype():
    for dtype in (torch.int64, torch.int32, torch.int16):
        assert CarryHeader.from_tensor(torch.tensor([2, 3, 2, 4, 2], dtype=dtype)) == CarryHeader(3, 2, 4, layout=2)
    assert CarryHeader.from_tensor(CarryHeader(3, 2, 4, layout=0).to_tensor()) == CarryHeader(3, 2, 4, layout=0)


def test_a_version_1_header_is_refused_by_its_version():
    """A previous release's header (4 integers, no layout) is read, then refused by its version, not its shape."""
    header = CarryHeader.from_tensor(torch.tensor([1, 0, 2, 4]))
    assert header.version == 1
    with pytest.raises(CarryError, match="version 1, this library reads 2"):
        TopkState(4, 4).load_carry(torch.zeros(2, 4, dtype=torch.int32), header)


@pytest.mark.parametrize("fields, match", [
    (dict(producer=0, rows=2.0, k=K), "rows: expected an int >= 0, got 2.0"),
    (dict(producer=0, rows=True, k=K), "rows"),
    (dict(producer=0, rows=2, k=4.0), "k: expected"),
    (dict(producer=1.5, rows=2, k=K), "producer"),
    (dict(producer=None, rows=2, k=K), "producer"),
    (dict(producer="x", rows=2, k=K), "producer"),
    (dict(producer=-3, rows=2, k=K), "producer"),
    (dict(producer=0, rows=2, k=K, version="1"), "version"),
])
def test_carry_header_refuses_malformed_values(fields, match):
    with pytest.raises(CarryError, match=match):
        CarryHeader(**fields)


def test_from_carry_checks_the_header_against_the_tensor_before_allocating(monkeypatch):
    raw = torch.zeros(2, K, dtype=torch.int32)

    def allocate(*args, **kwargs):
        raise AssertionError("from_carry allocated a state before checking its carry")

    monkeypatch.setattr(TopkState, "__init__", allocate)
    for header, match in ((CarryHeader(producer=0, rows=2**40, k=2**30), r"int32 \[1099511627776, 1073741824\]"),
                          (CarryHeader(producer=0, rows=2, k=K, version=1), "version"),
                          (CarryHeader(producer=0, rows=3, k=K), r"\[3, 4\]")):
        with pytest.raises(CarryError, match=match):
            TopkState.from_carry(raw, header)
    with pytest.raises(CarryError, match="expected a CarryHeader"):
        TopkState.from_carry(raw, CarryHeader(producer=0, rows=2, k=K).to_tensor())
    # a capacity below the carry's rows: was allocated, then refused by load_carry
    with pytest.raises(CarryError, match=r"^carry header: rows=2, but this state holds at most 1"):
        TopkState.from_carry(raw, CarryHeader(producer=0, rows=2, k=K), max_rows=1)


def test_load_carry_refuses_a_meta_tensor_and_rows_past_capacity():
    state = TopkState(4, K)
    with pytest.raises(CarryError, match="meta"):
        state.load_carry(torch.empty(2, K, dtype=torch.int32, device="meta"), CarryHeader(producer=0, rows=2, k=K))
    with pytest.raises(CarryError, match="at most 4"):
        state.load_carry(torch.zeros(5, K, dtype=torch.int32), CarryHeader(producer=0, rows=5, k=K))
    assert state.rows == 0 and state.producer is None


def _c_calls(fn):
    """Names of the C functions (torch ops included) that ``fn`` calls, counted.

    The garbage collector is off while counting: a collection runs ``gc.callbacks``
    (hypothesis installs one that calls ``perf_counter``) at whatever call it lands on.
    """
    names = Counter()

    def profile(frame, event, arg):
        if event == "c_call":
            names[getattr(arg, "__name__", "?")] += 1

    gc_was_on = gc.isenabled()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        if gc_was_on:
            gc.enable()
    return names


def test_recorder_is_off_by_default_and_free_when_off():
    scores, lengths, tables = inputs(5)
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    state = TopkState(5, K)
    assert state.recorder is None

    def forward():
        runner.begin(state, 5)
        run(runner, state, scores, lengths, tables)

    forward()  # first-call initialisation (lazy imports, caches) is not what is compared
    off = _c_calls(forward)
    recorder = IndexRecorder()
    state.recorder = recorder
    on = _c_calls(forward)
    state.recorder = None
    assert _c_calls(forward) == off
    assert sorted(recorder.indices) == list(range(8))
    assert on - off == Counter(clone=8, setdefault=8, append=8), "recording is all the hook adds"
    assert not off - on
    for layer in range(8):
        source = runner.source_of(layer)
        assert torch.equal(recorder.indices[layer][0], recorder.indices[source][0])


@gpu
def test_captured_producer_and_shared_layers_replay_like_eager_without_allocating():
    replays = int(os.environ.get("INDEXCACHE_GRAPH_REPLAYS", "1000"))
    rows, cols = 16, 512
    plan = LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE)
    runner = IndexerRunner(plan)
    state = TopkState(rows, K, "cuda")
    scores, lengths, tables = (torch.zeros_like(t) for t in inputs(rows, cols, device="cuda"))
    outs = {layer: torch.empty(rows, K, dtype=torch.int32, device="cuda") for layer in range(8)}

    def step():
        runner.begin(state, rows)
        for layer, got in run(runner, state, scores, lengths, tables).items():
            outs[layer].copy_(got)

    def load(seed):
        new = inputs(rows, cols, seed=seed, device="cuda")
        new[1][seed % rows] = 0  # a padding row
        for dst, src in zip((scores, lengths, tables), new, strict=True):
            dst.copy_(src)

    load(0)
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    allocated = 0
    for seed in range(replays):
        load(seed)
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        graph.replay()
        allocated += torch.cuda.memory_stats()["allocation.all.allocated"] - before
        got = {layer: o.clone() for layer, o in outs.items()}
        step()
        assert all(torch.equal(got[layer], outs[layer]) for layer in outs), f"replay {seed}"
    assert allocated == 0


def test_recorded_indices_save_as_a_calibration_dump(tmp_path):
    from indexcache.tools.calibrate import load_dump

    scores, lengths, tables = inputs(5)
    runner = IndexerRunner(LayerPlan(4, index_topk=K, page_size=PAGE))
    state = TopkState(5, K)
    state.recorder = IndexRecorder()
    for _ in range(2):
        runner.begin(state, 5)
        run(runner, state, scores, lengths, tables)
    state.recorder.save(tmp_path)
    layers, arrays = load_dump(tmp_path)
    assert layers == [0, 1, 2, 3]
    assert all(a.shape == (10, K) and (a == state.recorder.stacked()[0].numpy()).all() for a in arrays)


class _Unscored(Exception):
    pass


def _no_scores():
    raise _Unscored("a producer under a short bound must not score")


def test_a_producer_under_a_short_bound_selects_every_visible_position_without_scoring():
    """``max_length <= k``: the producer selects ``0 .. len - 1`` then -1 (negative lengths: nothing; a row longer
    than the bound promised: its first k), translated through its table; shared layers reuse it as always."""
    _, _, tables = inputs(5)
    lengths = torch.tensor([3, 0, -2, 4, 6], dtype=torch.int32)
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    state = TopkState(8, K)
    runner.begin(state, 5)
    got = runner.layer(0, state, scores=_no_scores, lengths=lengths, page_table=tables[0], max_length=K)
    want_raw = torch.tensor([[0, 1, 2, -1], [-1] * 4, [-1] * 4, [0, 1, 2, 3], [0, 1, 2, 3]], dtype=torch.int32)
    assert torch.equal(state.raw[:5], want_raw) and (state.raw[5:] == -1).all()
    assert torch.equal(got, reference.translate(want_raw, tables[0], lengths, PAGE))
    runner.layer(1, state, scores=_no_scores, lengths=lengths, page_table=tables[1], max_length=K)  # "FFSS…"
    shared = runner.layer(2, state, scores=_no_scores, lengths=lengths, page_table=tables[2], max_length=K)
    assert torch.equal(shared, reference.translate(want_raw, tables[2], lengths, PAGE))


def test_the_short_bound_selects_what_the_top_k_selects_and_a_longer_bound_scores():
    scores, lengths, tables = inputs(6, cols=K)  # every row sees at most K keys
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    scored, gated = TopkState(8, K), TopkState(8, K)
    runner.begin(scored, 6)
    runner.begin(gated, 6)
    want = runner.layer(0, scored, scores=lambda: scores, lengths=lengths, page_table=tables[0], max_length=K + 1)
    got = runner.layer(0, gated, scores=_no_scores, lengths=lengths, page_table=tables[0], max_length=K)
    assert torch.equal(got, want) and torch.equal(gated.raw, scored.raw)
    with pytest.raises(_Unscored):
        runner.layer(0, gated, scores=_no_scores, lengths=lengths, page_table=tables[0], max_length=K + 1)


@pytest.mark.parametrize("bound", [-1, True, 2.0, "4"])
def test_max_length_must_be_a_size(bound):
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))
    state = TopkState(8, K)
    runner.begin(state, 2)
    _, lengths, tables = inputs(2)
    with pytest.raises(ValueError, match="max_length: expected an int >= 0 or None"):
        runner.layer(0, state, scores=_no_scores, lengths=lengths, page_table=tables[0], max_length=bound)


def test_a_refused_producer_leaves_the_state_to_the_producer_before_it():
    """A producer on the short path (runner, max_length <= k) or a draft step (DraftTopk.serve) wrote ``raw`` before
    translate checked its arguments: refused, it left the previous producer named over the new rows, and the next
    shared layer translated those. Now the arguments are checked first (and ``lengths`` is named as given)."""
    from indexcache.runtime.draft import DraftTopk
    from indexcache.runtime.runner import IndexerRunner
    from indexcache.runtime.state import TopkState

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 24, generator=g)
    lengths = torch.tensor([20, 16], dtype=torch.int32)
    tables = torch.stack([torch.randperm(12, generator=g).view(2, 6) for _ in range(8)]).to(torch.int32)
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=4, page_size=4))  # FFSSSFSS
    state = TopkState(2, 4)
    runner.begin(state, 2)
    for layer in (0, 1):
        runner.layer(layer, state, scores=lambda: scores, lengths=lengths, page_table=tables[layer])
    held = state.raw.clone()
    with pytest.raises(TypeError, match="^lengths: expected dtype int32, got int64"):
        runner.layer(5, state, scores=lambda: scores, lengths=lengths.long(), page_table=tables[5], max_length=4)
    assert state.producer == 1 and torch.equal(state.raw, held)
    got = runner.layer(2, state, scores=lambda: scores, lengths=lengths, page_table=tables[2])
    assert torch.equal(got, reference.translate(held, tables[2], lengths, 4))

    state = TopkState(2, 4)
    state.begin(2)
    draft = DraftTopk([0, 1], 2, 4, 1)
    state.produce(0, scores, lengths, tables[0], 4)
    draft.keep(0, state)
    state.produce(1, -scores, lengths, tables[1], 4)
    draft.keep(1, state)
    state.begin(2)
    draft.serve(0, state, 1, lengths + 1, tables[0], 4)
    held = state.raw.clone()
    with pytest.raises(TypeError, match="^page_table: expected dtype int32, got int64"):
        draft.serve(1, state, 1, lengths + 1, tables[1].long(), 4)
    assert state.producer == 0 and torch.equal(state.raw, held)


@pytest.mark.parametrize(("named", "error", "message"), [
    (dict(k="4"), TypeError, r"^k: expected an int, got str '4'"),
    (dict(k=4.0), TypeError, r"^k: expected an int, got float 4.0"),
    (dict(k=0), ValueError, r"^k: expected an int in \[1, 65536\]"),
    (dict(page_size=0), ValueError, r"^page_size: expected an int in \[1, 2147483647\]"),
])
def test_the_runner_checks_its_k_and_page_size(named, error, message):
    """k='4' was taken and met later as 'state: holds k=4, but this runner selects k=4'; page_size=0 at the first
    translation."""
    from indexcache.runtime.runner import IndexerRunner

    with pytest.raises(error, match=message):
        IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=4, page_size=4), **named)


def test_a_layer_refuses_a_state_of_another_k_however_it_was_begun():
    """A state begun without the runner (a pipeline stage's ``load_carry``, or ``state.begin``) of another k: the
    runner's short-row bound (``max_length <= k``) and the state's selection would disagree (here the producer would
    take the first 4 of 6 positions without scoring them), so every layer refuses it as ``begin`` does."""
    runner = IndexerRunner(LayerPlan(4, index_topk_freq=2, index_topk=8, page_size=PAGE))
    state = TopkState(2, K)
    state.load_carry(torch.zeros(2, K, dtype=torch.int32), CarryHeader(producer=1, rows=2, k=K))
    lengths, table = torch.full((2,), 6, dtype=torch.int32), torch.arange(4, dtype=torch.int32).expand(2, 4)
    assert runner.roles == "FFSF"
    for layer in (2, 3):  # shared, then producer
        with pytest.raises(ValueError, match=f"^state: holds k={K}, but this runner selects k=8"):
            runner.layer(layer, state, scores=lambda: torch.randn(2, 6), lengths=lengths, page_table=table,
                         max_length=6)
    assert state.producer == 1 and (state.raw[:2] == 0).all()


@pytest.mark.parametrize(("given", "error", "message"), [
    (torch.tensor(1.0), ValueError, r"^scores: expected \[2, \.\.\.\] \(2 rows: the live batch given to begin\(\)\), "
                                    r"got a 0-d tensor"),
    (None, TypeError, r"^scores: expected a torch.Tensor of 2 rows \(the live batch given to begin\(\)\), "
                      r"got NoneType"),
    (torch.randn(3, 8), ValueError, r"^scores: expected 2 rows \(the live batch given to begin\(\)\), got 3"),
])
def test_produce_names_scores_that_are_not_rows_of_the_live_batch(given, error, message):
    """A 0-d tensor was an IndexError ('tuple index out of range') and None an AttributeError, neither naming it."""
    state = TopkState(4, K)
    state.begin(2)
    lengths, table = torch.full((2,), 5, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(error, match=message):
        state.produce(0, given, lengths, table, PAGE)
    assert state.producer is None


@pytest.mark.parametrize("args, error, match", [
    ((-1, 8), ValueError, r"max_rows: expected an int >= 0, got -1"),
    ((4, 65537), ValueError, r"k: expected an int in \[0, 65536\]"),
    ((4.0, 8), TypeError, r"max_rows: expected an int, got float 4.0"),
    ((4, True), TypeError, r"k: expected an int, got bool True"),
])
def test_a_state_of_sizes_the_ops_cannot_fill_is_refused(args, error, match):
    """A k above what the ops select (MAX_TOPK) was allocated (max_rows x k) and failed only at the first producer."""
    with pytest.raises(error, match=match):
        TopkState(*args)


def test_the_runner_names_a_plan_a_state_a_scores_or_a_hot_of_the_wrong_kind():
    """Each was an AttributeError or "'Tensor' object is not callable" naming no argument; a producer given a hot that
    is no HotLayer had already written its selection and named itself the state's producer when it failed."""
    from indexcache.runtime.hot import HotBuffers

    with pytest.raises(TypeError, match=r"^plan: expected a LayerPlan .*got str"):
        IndexerRunner("FFSS")
    scores, lengths, tables = inputs(2)
    runner = IndexerRunner(LayerPlan(8, index_topk_freq=4, index_topk=K, page_size=PAGE))  # FFSSSFSS
    for call in (lambda bad: runner.begin(bad, 2),
                 lambda bad: runner.layer(0, bad, scores=lambda: scores, lengths=lengths, page_table=tables[0])):
        with pytest.raises(TypeError, match=r"^state: expected a TopkState, got NoneType"):
            call(None)
    state = TopkState(2, K)
    runner.begin(state, 2)
    with pytest.raises(TypeError, match=r"^scores: expected a function of no arguments returning the scores .*"
                                        r"got Tensor"):
        runner.layer(0, state, scores=scores, lengths=lengths, page_table=tables[0])
    assert state.producer is None
    runner.layer(0, state, scores=None, lengths=lengths, page_table=tables[0], max_length=K)  # short: not called
    assert state.producer == 0
    state.hot = HotBuffers([0, 1, 5], 2, 8, 2, K)
    held = state.raw.clone()
    for layer in (1, 2):  # a producer, a shared layer
        with pytest.raises(TypeError, match=r"^hot: expected a HotLayer \(or None\), got dict"):
            runner.layer(layer, state, scores=lambda: scores, lengths=lengths, page_table=tables[layer], hot={})
    assert state.producer == 0 and torch.equal(state.raw, held)
