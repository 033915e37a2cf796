"""HiSparse in the runtime (issue 40, item 3): the hot buffers attached to a TopkState, a producer planning its
group's step and every sparse layer swapping in its own KV with that one plan; what each layer's attention reads is
the KV of the tokens its producer selected; stale plans are refused; the small model decodes with HiSparse exactly as
without it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import indexcache
from indexcache.hal import ops
from indexcache.hal.ops import INDEX
from indexcache.plan import LayerPlan
from indexcache.runtime.draft import DraftTopk
from indexcache.runtime.hot import HotBuffers, HotLayer
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import CarryHeader, IndexRecorder, MissingProducerError, TopkState
from indexcache.tools.model.config import preset
from indexcache.tools.model.dsa import DSAModel

pytestmark = pytest.mark.usefixtures("one_thread")

K, HOT, PAGE, LAYERS, REQUESTS, WIDTH = 8, 12, 4, 6, 3, 4


class Chosen(TopkState):
    """A producer whose selection is given (``self.next``) instead of scored."""

    next: torch.Tensor

    def select(self, scores, lengths, page_table, page_size, *, row_starts, row_to_batch, out, out_raw):
        out_raw.copy_(self.next)
        return out


def setup(seed=0, one_loc=False):
    """The plan, runner, state, each layer's tensors and a page table (``one_loc``: every layer's device rows at the
    same ``device_loc``, as a group's swap-in at once needs)."""
    g = torch.Generator().manual_seed(seed)
    plan = LayerPlan(LAYERS, index_topk_pattern="FSFSFS", index_topk=K, page_size=PAGE)  # producers 0, 2, 4
    runner = IndexerRunner(plan)
    state = Chosen(REQUESTS, K)
    state.hot = HotBuffers(plan.producers, REQUESTS, HOT, REQUESTS, K)
    max_len = 80
    host_loc = torch.randperm(REQUESTS * max_len, generator=g).view(REQUESTS, max_len).to(INDEX)
    rows = REQUESTS * (HOT + 1)
    locs = [torch.randperm(rows + 2, generator=g)[:rows].view(REQUESTS, HOT + 1).to(INDEX) for _ in range(LAYERS)]
    layers = [HotLayer(torch.randn(REQUESTS * max_len, WIDTH, generator=g), torch.zeros(rows + 2, WIDTH),
                       locs[0] if one_loc else locs[i], None, host_loc) for i in range(LAYERS)]
    table = torch.arange(REQUESTS * max_len // PAGE, dtype=INDEX).view(REQUESTS, -1)
    return g, plan, runner, state, layers, table


def prefill(layer, seq_lens):
    """The engine's side of the prefill for ``layer``: a request within H has token t at slot t."""
    for b, n in enumerate(seq_lens.tolist()):
        for t in range(n if n <= HOT else 0):
            layer.device_kv[layer.device_loc[b, t]] = layer.host_kv[layer.host_loc[b, t]]


def write_newest(layer, seq_lens):
    """The engine's side of a decode step for ``layer``: each request's newest token at its slot."""
    for b, n in enumerate(seq_lens.tolist()):
        slot = n - 1 if n <= HOT else HOT
        layer.device_kv[layer.device_loc[b, slot]] = layer.host_kv[layer.host_loc[b, n - 1]]


def first_decode_step(layers, prompt_lens):
    """The engine's side of a prefill of ``prompt_lens`` tokens and one decode token, for every layer; returns the
    requests' lengths after it."""
    for layer in layers:
        prefill(layer, prompt_lens)
    lens = prompt_lens + 1
    for layer in layers:
        write_newest(layer, lens)
    return lens


def step(runner, state, layers, table, seq_lens, raw, grouped=False):
    """One decode step through the runner; the engine's side first: each request's newest token at its slot. With
    ``grouped`` a producer swaps in its group's layers at once and the shared layers copy nothing."""
    state.next = raw
    runner.begin(state, REQUESTS)
    got = {}
    for i in runner.layers:
        own = layers[i]
        write_newest(own, seq_lens)
        host_kv, device_kv = own.host_kv, own.device_kv
        if grouped:
            group = [j for j in runner.layers if runner.source_of(j) == i]
            host_kv = [layers[j].host_kv for j in group] or None
            device_kv = [layers[j].device_kv for j in group] or None
        layer = HotLayer(host_kv, device_kv, own.device_loc, seq_lens, own.host_loc)
        got[i] = runner.layer(i, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=seq_lens, page_table=table,
                              hot=layer).clone()
    return got


@pytest.mark.parametrize("grouped", [False, True], ids=["a swap-in a layer", "a swap-in a group"])
def test_every_sparse_layer_reads_the_kv_of_its_producers_selection_over_steps_crossing_h(monkeypatch, grouped):
    g, plan, runner, state, layers, table = setup(one_loc=grouped)
    planned = []
    real = ops.hisparse_plan
    monkeypatch.setattr(ops, "hisparse_plan", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    swaps = []
    real_swap = ops.hisparse_swap_in
    monkeypatch.setattr(ops, "hisparse_swap_in", lambda *a, **kw: swaps.append(1) or real_swap(*a, **kw))
    lens = torch.tensor([5, 11, 30], dtype=INDEX)
    for layer in layers:
        prefill(layer, lens)
    raw = torch.stack([torch.randint(0, int(n), (K,), generator=g) for n in lens]).to(INDEX)
    for _ in range(16):  # request 1 crosses H = 12 on the way; the selections drift
        lens = lens + 1
        fresh = torch.stack([torch.randint(0, int(n), (K,), generator=g) for n in lens]).to(INDEX)
        raw = torch.where(torch.rand(REQUESTS, K, generator=g) < 0.3, fresh, raw)
        raw[0, -1] = -1
        planned.clear()
        swaps.clear()
        got = step(runner, state, layers, table, lens, raw, grouped)
        assert len(planned) == len(plan.producers)  # one plan a producer, none for a shared layer
        assert len(swaps) == len(plan.producers if grouped else plan.sparse_layers)
        for i, rows in got.items():
            reads_its_selection(layers[i], rows, raw)


def test_a_live_batch_smaller_than_max_requests_is_planned_without_row_to_batch():
    """Hot buffers for more requests than the step's rows (an engine's usual live batch): row r is request r without
    row_to_batch, exactly as with row_to_batch = 0 .. rows - 1; the requests past the rows are left alone; more rows
    than requests without row_to_batch are refused, naming it."""
    g, plan, runner, _, layers, table = setup()
    lens = first_decode_step(layers, torch.tensor([5, 20, 30], dtype=INDEX))
    seq_lens = torch.cat([lens, torch.zeros(1, dtype=INDEX)])  # [max_requests]: the fourth request idle
    host_loc = torch.cat([layers[0].host_loc, torch.full_like(layers[0].host_loc[:1], -1)])
    device_loc = [torch.cat([layer.device_loc, torch.full_like(layer.device_loc[:1], -1)]) for layer in layers]
    raw = torch.stack([torch.randint(0, int(n), (K,), generator=g) for n in lens]).to(INDEX)
    got = {}
    for requests in (None, torch.arange(REQUESTS, dtype=INDEX)):
        state = Chosen(REQUESTS, K)
        state.hot = HotBuffers(plan.producers, REQUESTS + 1, HOT, REQUESTS, K)
        state.next = raw
        runner.begin(state, REQUESTS)
        rows = [runner.layer(i, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table,
                             row_to_batch=requests, hot=HotLayer(layers[i].host_kv, layers[i].device_kv,
                                                              device_loc[i], seq_lens, host_loc)).clone()
                for i in runner.layers]
        got[requests is None] = rows, {p: [t.clone() for t in s] for p, s in state.hot.state.items()}
    assert all(torch.equal(a, b) for a, b in zip(got[True][0], got[False][0], strict=True))
    for p, (tokens, ages) in got[True][1].items():
        assert torch.equal(tokens, got[False][1][p][0]) and torch.equal(ages, got[False][1][p][1])
        assert (tokens[REQUESTS] == -1).all() and (ages[REQUESTS] == -1).all()
    for i, rows in enumerate(got[True][0]):
        for b in range(REQUESTS):
            for j in range(K):
                x, r = int(raw[b, j]), int(rows[b, j])
                assert torch.equal(layers[i].device_kv[r], layers[i].host_kv[layers[i].host_loc[b, x]]), (i, b, x)
    state = Chosen(REQUESTS, K)
    state.hot = HotBuffers(plan.producers, REQUESTS - 1, HOT, REQUESTS, K)
    state.next = raw
    runner.begin(state, REQUESTS)
    hot = HotLayer(layers[0].host_kv, layers[0].device_kv, layers[0].device_loc, lens[:-1], layers[0].host_loc[:-1])
    with pytest.raises(ValueError, match=r"row_to_batch: None .* 3 rows and the hot buffers hold 2 requests"):
        runner.layer(0, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=hot)


def test_a_shared_layer_needs_its_producers_plan_of_this_forward():
    _, _, runner, state, layers, table = setup()
    lens = torch.tensor([20, 20, 20], dtype=INDEX)
    state.next = torch.zeros(REQUESTS, K, dtype=INDEX)
    layer = HotLayer(layers[1].host_kv, layers[1].device_kv, layers[1].device_loc, lens, layers[1].host_loc)
    runner.begin(state, REQUESTS)
    runner.layer(0, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)
    runner.layer(1, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)
    runner.begin(state, REQUESTS)  # a new forward forgets the plan
    state.producer = 0  # even with indices from somewhere, the plan is stale
    with pytest.raises(MissingProducerError, match="hot buffers hold the plan of None"):
        runner.layer(1, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)
    runner.begin(state, REQUESTS)
    runner.layer(0, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)
    unswapped = HotLayer(None, None, layer.device_loc, lens, layer.host_loc)
    with pytest.raises(ValueError, match="producer 0 swapped in only its own layer"):
        runner.layer(1, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table,
                     hot=unswapped)
    half = HotLayer(layer.host_kv, None, layer.device_loc, lens, layer.host_loc)
    with pytest.raises(ValueError, match="host_kv and device_kv both given or both None"):
        runner.layer(1, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=half)
    plain = TopkState(REQUESTS, K)
    runner.begin(plain, REQUESTS)
    with pytest.raises(ValueError, match="hot: given, but the state has no hot buffers"):
        runner.layer(0, plain, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)


def test_states_sharing_hot_buffers_cannot_interleave_a_groups_layers():
    """Two states (micro-batches) sharing one HotBuffers: the buffers hold one plan, so B's producer planning between
    A's producer and A's shared layer would hand A's shared layer B's plan; it is refused by name, and A's producer
    planning again makes A's shared layer run."""
    _, _, runner, a, layers, table = setup()
    b = Chosen(REQUESTS, K)
    b.hot = a.hot
    lens = torch.tensor([20, 20, 20], dtype=INDEX)
    a.next = torch.zeros(REQUESTS, K, dtype=INDEX)
    b.next = torch.ones(REQUESTS, K, dtype=INDEX)
    layer = HotLayer(layers[1].host_kv, layers[1].device_kv, layers[1].device_loc, lens, layers[1].host_loc)
    for state in (a, b):
        runner.begin(state, REQUESTS)
        runner.layer(0, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)
    with pytest.raises(MissingProducerError, match="hold producer 0's plan for another state"):
        runner.layer(1, a, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)
    runner.layer(1, b, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)
    runner.layer(0, a, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)
    runner.layer(1, a, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=layer)


def test_buffers_check_their_sizes_and_reset_empties_a_requests_rows():
    with pytest.raises(ValueError, match="hot: expected an int >= 1"):
        HotBuffers([0], 2, 0, 2, 4)
    hot = HotBuffers([0, 2], 3, 4, 3, 4)
    for tokens, ages in hot.state.values():
        tokens.fill_(7)
        ages.fill_(3)
    hot.reset(torch.tensor([1, -1, 3, -4, 2**40]))  # -1 and the others outside the state's 3 rows: nothing
    for tokens, ages in hot.state.values():
        assert tokens[1].eq(-1).all() and ages[1].eq(-1).all() and tokens[0].eq(7).all() and tokens[2].eq(7).all()
        assert ages[0].eq(3).all() and ages[2].eq(3).all()
    hot.reset(torch.tensor([], dtype=torch.int64))
    hot.reset(torch.tensor([2, -7]))  # no more entries than rows: through the buffers kept for it, reused
    hot.reset(torch.tensor(3))  # a single entry outside the state
    for tokens, ages in hot.state.values():
        assert tokens[2].eq(-1).all() and ages[2].eq(-1).all() and tokens[0].eq(7).all() and ages[0].eq(3).all()
    for bad in (torch.tensor([1], dtype=INDEX), [1], torch.tensor([[1]])):
        with pytest.raises(TypeError, match="requests: expected an int64 tensor of the state rows to empty"):
            hot.reset(bad)
    with pytest.raises(ValueError, match="requests: expected a tensor on cpu .*got meta"):
        hot.reset(torch.tensor([1], device="meta"))
    with pytest.raises(KeyError, match="producer 1: no hot-buffer state"):
        hot.plan(1, torch.zeros(3, 4, dtype=INDEX),
                 HotLayer(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(3, 5, dtype=INDEX),
                          torch.ones(3, dtype=INDEX), torch.zeros(3, 1, dtype=INDEX)))


def test_a_producers_bad_hot_layer_is_named_before_the_state_changes():
    """A producer's host_kv that is no tensor or list of them is refused by name (not ``min()``'s or ``.shape``'s
    error); host_kv without device_kv, and an int64 device_loc (which the swap-in op takes but the device rows, int32,
    cannot), one of fewer than H + 1 columns (the newest token's slot H would read no row) and one of fewer rows than
    the buffers' requests (a request past them would be planned as holding tokens never copied), are refused before the
    plan, as is anything the producer's swap-in would refuse (KV of another dtype,
    a list beside one tensor): raised at the swap-in, they came after the state had taken the step's misses as copied
    (and the int64 one as the translation's ``page_table``)."""
    hot = HotBuffers([0], 2, 4, 2, 3)
    raw = torch.tensor([[1, 2, 8], [0, 1, 2]], dtype=INDEX)
    lens, host_loc = torch.tensor([9, 3], dtype=INDEX), torch.arange(40, dtype=INDEX).view(2, 20)
    loc = torch.arange(10, dtype=INDEX).view(2, 5)
    for bad in ([], [1]):
        with pytest.raises(TypeError, match="host_kv: expected a torch.Tensor or a non-empty list or tuple of them"):
            hot.plan(0, raw, HotLayer(bad, [torch.zeros(12, 2)], loc, lens, host_loc))
    host_kv, device_kv = torch.randn(40, 2), torch.zeros(12, 2)
    with pytest.raises(ValueError, match="host_kv and device_kv both given or both None"):
        hot.plan(0, raw, HotLayer(host_kv, None, loc, lens, host_loc))
    with pytest.raises(TypeError, match="hot: device_loc: expected an int32 tensor .*got torch.int64"):
        hot.plan(0, raw, HotLayer(host_kv, device_kv, loc.long(), lens, host_loc))
    with pytest.raises(ValueError, match=r"hot: device_loc: expected \[B, H \+ 1\] = \[B, 5\] .*got \[2, 4\]"):
        hot.plan(0, raw, HotLayer(host_kv, device_kv, loc[:, :4], lens, host_loc))  # slot H would read no row
    rows_of = r"hot: device_loc: expected 2 rows \(the hot buffers' max_requests, .*got \[1, 5\]"
    with pytest.raises(ValueError, match=rows_of):  # request 1 would hold tokens no swap-in copied
        hot.plan(0, raw[:1], HotLayer(host_kv, device_kv, loc[:1], lens, host_loc), row_to_batch=raw[:1, 0] * 0 + 1)
    with pytest.raises(TypeError, match="device_kv"):  # the swap-in's own check: another dtype than host_kv
        hot.plan(0, raw, HotLayer(host_kv, device_kv.half(), loc, lens, host_loc))
    with pytest.raises(TypeError, match="host_kv: expected one tensor, as device_kv, got a list of 1"):
        hot.plan(0, raw, HotLayer([host_kv], device_kv, loc, lens, host_loc))
    tokens, ages = hot.state[0]
    assert tokens.eq(-1).all() and ages.eq(-1).all() and hot.group is None  # nothing planned
    layer = HotLayer(host_kv, device_kv, loc, lens, host_loc)
    assert hot.plan(0, raw, layer).copy_count.tolist() == [2, 0]  # 8 is the newest: slot H
    with pytest.raises(TypeError, match="hot: device_loc: expected an int32 tensor .*got torch.int64"):
        hot.swap_in(0, HotLayer(host_kv, device_kv, loc.long(), lens, host_loc))
    with pytest.raises(ValueError, match=r"hot: device_loc: expected \[B, H \+ 1\]"):
        hot.swap_in(0, HotLayer(host_kv, device_kv, loc[:, :4], lens, host_loc))
    for kv in ((host_kv, device_kv), (None, None)):  # a layer of its own KV, or of its producer's group swap-in
        with pytest.raises(ValueError, match=rows_of):
            hot.swap_in(0, HotLayer(*kv, loc[:1], lens, host_loc))
    assert device_kv.eq(0).all()  # refused before any copy


def test_buffers_keep_a_slot_index_a_producer_and_pass_it_where_it_covers_host_loc(monkeypatch):
    with pytest.raises(ValueError, match="index_tokens: expected an int >= 0"):
        HotBuffers([0], 2, 4, 2, 4, index_tokens=-1)
    hot = HotBuffers([0, 2], 3, 4, 3, 4, index_tokens=10)
    assert {p: tuple(i.shape) for p, i in hot.index.items()} == {0: (3, 14), 2: (3, 14)}  # H + max(L, H)
    assert HotBuffers([0], 3, 4, 3, 4).index == {}
    given = []
    real = ops.hisparse_plan
    monkeypatch.setattr(ops, "hisparse_plan", lambda *a, **kw: given.append(kw["slot_index"]) or real(*a, **kw))
    for width in (10, 11):
        hot.plan(2, torch.zeros(3, 4, dtype=INDEX),
                 HotLayer(torch.zeros(40, 1), torch.zeros(20, 1), torch.zeros(3, 5, dtype=INDEX),
                          torch.full((3,), 9, dtype=INDEX), torch.zeros(3, width, dtype=INDEX)))
    assert given[0] is hot.index[2] and given[1] is None  # 11 host tokens: wider than the index covers


MODEL = preset("v32-like", num_layers=6, hidden=64, heads=2, head_dim=32, index_heads=2, topk=16, page_size=8,
               vocab=64, window=16)


@pytest.mark.parametrize("freq", [1, 3])
def test_the_small_model_decodes_with_hisparse_as_without_it(freq):
    """Prompts shorter and longer than the hot buffer (24 slots), 12 decode steps: with HiSparse every layer selects
    the same positions and the logits are equal, bit for bit (the attention reads the same latents)."""
    model = DSAModel(MODEL)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, MODEL.vocab, (n,), generator=g) for n in (10, 20, 40, 90)]
    want_rec, got_rec = IndexRecorder(), IndexRecorder()
    want = model.generate(prompts, 12, IndexerRunner(model.plan(freq)), recorder=want_rec)
    got = model.generate(prompts, 12, IndexerRunner(model.plan(freq)), recorder=got_rec, tokens=want.tokens, hot=24)
    assert torch.equal(got.decode_logits, want.decode_logits)
    for layer, raw in want_rec.stacked().items():
        assert torch.equal(got_rec.stacked()[layer], raw), layer


def test_the_public_ops_run_one_step_and_one_layer():
    """The docstring's shapes through the package root, on the default backend."""
    tokens, ages = indexcache.hal.hisparse.empty_state(2, 4)
    raw = torch.tensor([[7, 2, -1], [1, 0, 3]], dtype=INDEX)
    p = indexcache.hisparse_plan(raw, torch.tensor([10, 3], dtype=INDEX), torch.arange(20, dtype=INDEX).view(2, 10),
                                 tokens, ages)
    assert p.slots.tolist() == [[0, 1, -1], [1, 0, -1]] and p.copy_count.tolist() == [2, 0]
    assert p.slot_token is tokens and tokens.tolist() == [[7, 2, -1, -1], [0, 1, 2, -1]]
    host_kv = torch.arange(20.0)[:, None]
    device_kv = torch.zeros(10, 1)
    loc = torch.arange(10, dtype=INDEX).view(2, 5)
    assert indexcache.hisparse_swap_in(*p.copies, host_kv, device_kv, loc) is device_kv
    assert device_kv[:, 0].tolist() == [7, 2, 0, 0, 0, 0, 0, 0, 0, 0]


def test_a_producer_whose_hot_layer_is_refused_leaves_the_state_to_the_producer_before_it():
    """The runner selected first and checked the producer's HotLayer at the plan after: a refused one (KV without
    device KV, seq_lens of another dtype, a producer without hot-buffer state) had written its selection into ``raw``
    and named itself the state's producer, whose shared layers then met the previous group's plan. Now the HotLayer is
    checked as the plan and the swap-in check it before the selection: the state, the plan and the KV stay as they
    were, and the previous producer's shared layer still swaps in its own plan."""
    g, _, runner, state, layers, table = setup()
    seq_lens = torch.tensor([20, 9, 30], dtype=INDEX)
    state.next = torch.randint(0, 9, (REQUESTS, K), generator=g, dtype=INDEX)
    runner.begin(state, REQUESTS)
    own = [HotLayer(layer.host_kv, layer.device_kv, layer.device_loc, seq_lens, layer.host_loc) for layer in layers]
    runner.layer(0, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=seq_lens, page_table=table, hot=own[0])
    held, plan, kv = state.raw.clone(), state.hot.slots.clone(), layers[2].device_kv.clone()
    state.next = torch.randint(0, 9, (REQUESTS, K), generator=g, dtype=INDEX)
    bad = [
        (ValueError, "host_kv and device_kv both given or both None", dict(device_kv=None)),
        (TypeError, "seq_lens: expected dtype int32", dict(seq_lens=seq_lens.long())),
        (ValueError, r"seq_lens: expected shape \[3\]", dict(seq_lens=seq_lens[:2])),
    ]
    for error, message, change in bad:
        fields = dict(vars(own[2]), **change)
        with pytest.raises(error, match=message):
            runner.layer(2, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=seq_lens, page_table=table,
                         hot=HotLayer(**fields))
        assert state.producer == 0 and torch.equal(state.raw, held), message
        assert state.hot.group == 0 and torch.equal(state.hot.slots, plan) and torch.equal(layers[2].device_kv, kv)
    state.hot.state.pop(2)
    with pytest.raises(KeyError, match="producer 2: no hot-buffer state"):
        runner.layer(2, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=seq_lens, page_table=table,
                     hot=own[2])
    assert state.producer == 0 and torch.equal(state.raw, held)
    rows = runner.layer(1, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=seq_lens, page_table=table,
                        hot=own[1])
    assert torch.equal(rows, ops.translate(plan, layers[1].device_loc, torch.full((REQUESTS,), HOT + 1, dtype=INDEX),
                                           1))


@pytest.mark.parametrize(("producers", "message"), [
    ([0.5], r"^producers: expected layer ids \(ints >= 0\), got \[0.5\]"),
    (["12"], r"^producers: expected layer ids \(ints >= 0\), got \['12'\]"),
    ("015", r"^producers: expected layer ids \(ints >= 0\), got '015'"),
    ([True, 2], r"^producers: expected layer ids \(ints >= 0\), got \[True, 2\]"),
    ([-1], r"^producers: expected layer ids \(ints >= 0\), got \[-1\]"),
])
def test_buffers_refuse_producers_that_are_not_layer_ids(producers, message):
    """Each was taken through int(): 0.5 as producer 0, '12' as 12, '015' as producers 0, 1 and 5, -1 as a producer no
    layer is, so the buffers kept state for layers the engine never named."""
    with pytest.raises(ValueError, match=message):
        HotBuffers(producers, 2, 4, 2, 4)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5), st.lists(st.integers(-2**62, 2**62) | st.integers(-3, 8), max_size=14))
def test_reset_empties_exactly_the_rows_named_inside_the_state(max_requests, requests):
    """Any requests (duplicates, -1 padding, far outside, more entries than rows or fewer): the rows named in
    ``[0, max_requests)`` are emptied in every group and no other."""
    hot = HotBuffers([1, 4], max_requests, 3, 1, 2)
    for tokens, ages in hot.state.values():
        tokens.fill_(5)
        ages.fill_(2)
    hot.reset(torch.tensor(requests, dtype=torch.int64))
    hot.reset(torch.tensor(requests, dtype=torch.int64))  # the kept buffers used again: nothing left from before
    named = {r for r in requests if 0 <= r < max_requests}
    for tokens, ages in hot.state.values():
        for row in range(max_requests):
            want = (-1, -1) if row in named else (5, 2)
            assert (tokens[row].unique().tolist(), ages[row].unique().tolist()) == ([want[0]], [want[1]]), row


def pipeline(seed=1):
    """Producer 0's group split across two pipeline stages: producer 0 and shared layer 1 on stage A, shared layers 2
    and 3 on stage B, each stage with its own runner, state, hot buffers and KV tensors; one ``device_loc`` and
    ``host_loc`` for the group (as a group's swap-in at once needs). Short requests' prefill written at their slots."""
    g = torch.Generator().manual_seed(seed)
    plan = LayerPlan(4, index_topk_pattern="FSSS", index_topk=K, page_size=PAGE)
    runners = [IndexerRunner(plan, stage=stage) for stage in plan.split_stages([2])]
    states = [Chosen(REQUESTS, K), TopkState(REQUESTS, K)]
    for state in states:
        state.hot = HotBuffers([0], REQUESTS, HOT, REQUESTS, K)
    max_len = 40
    host_loc = torch.randperm(REQUESTS * max_len, generator=g).view(REQUESTS, max_len).to(INDEX)
    rows = REQUESTS * (HOT + 1)
    loc = torch.randperm(rows + 2, generator=g)[:rows].view(REQUESTS, HOT + 1).to(INDEX)
    layers = [HotLayer(torch.randn(REQUESTS * max_len, WIDTH, generator=g), torch.zeros(rows + 2, WIDTH), loc, None,
                       host_loc) for _ in range(4)]
    return g, runners, states, layers


def run(runner, state, layers, i, seq_lens, grouped=False):
    """Layer ``i`` of one decode step, the engine's side first; ``grouped``: the group's first layer on this stage
    swaps in the stage's layers of the group, the others copy nothing."""
    own = layers[i]
    write_newest(own, seq_lens)
    host_kv, device_kv = own.host_kv, own.device_kv
    if grouped:
        first = i == runner.layers.start
        host_kv = [layers[j].host_kv for j in runner.layers] if first else None
        device_kv = [layers[j].device_kv for j in runner.layers] if first else None
    table = torch.zeros(REQUESTS, 1, dtype=INDEX)  # not read: Chosen's producer selects without translating
    return runner.layer(i, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=seq_lens, page_table=table,
                        hot=HotLayer(host_kv, device_kv, own.device_loc, seq_lens, own.host_loc)).clone()


def reads_its_selection(layer, rows, raw):
    """Every selected position's device row holds that token's host row; -1 where nothing is selected."""
    for b in range(REQUESTS):
        for j in range(K):
            x = int(raw[b, j])
            if x < 0:
                assert rows[b, j] == -1
                continue
            assert rows[b, j] >= 0, (b, j)
            assert torch.equal(layer.device_kv[rows[b, j]], layer.host_kv[layer.host_loc[b, x]]), (b, x)


def plan_of(hot):
    """The buffers' plan and producer 0's state, copied."""
    rows = hot.rows
    return [t.clone() for t in (hot.slots[:rows], hot.copy_src[:rows], hot.copy_dst[:rows], hot.copy_count[:rows],
                                *hot.state[0])]


@pytest.mark.parametrize("grouped", [False, True], ids=["a swap-in a layer", "a swap-in a stage's group"])
def test_a_group_split_across_stages_plans_the_carried_selection_in_lockstep(monkeypatch, grouped):
    """Stage B loads stage A's carry; its first shared layer with hot= plans the group's step from the carried indices,
    its second only swaps in: over three steps (request 1 crossing H) stage B's plan and hot state equal stage A's,
    its device rows equal A's, and the KV rows it copied are each selected token's host rows."""
    g, (runner_a, runner_b), (a, b), layers = pipeline()
    planned = []
    real = ops.hisparse_plan
    monkeypatch.setattr(ops, "hisparse_plan", lambda *args, **kw: planned.append(1) or real(*args, **kw))
    lens = torch.tensor([5, 11, 30], dtype=INDEX)
    for layer in layers:
        prefill(layer, lens)
    for _ in range(3):  # lengths 6, 12, 31, then 7, 13, 32 (request 1 crosses H = 12), then 8, 14, 33
        lens = lens + 1
        raw = torch.stack([torch.randint(0, int(n), (K,), generator=g) for n in lens]).to(INDEX)
        raw[0, -1] = -1
        a.next = raw
        runner_a.begin(a, REQUESTS)
        got = {i: run(runner_a, a, layers, i, lens, grouped) for i in (0, 1)}
        want = plan_of(a.hot)
        b.load_carry(*a.to_carry())
        assert b.carried and b.hot.group is None  # loading plans nothing
        planned.clear()
        got.update({i: run(runner_b, b, layers, i, lens, grouped) for i in (2, 3)})
        assert len(planned) == 1 and not b.carried  # layer 2 planned, layer 3 only swapped in
        assert b.hot.copy_count[2] > 0  # the long request copied rows into stage B's own KV
        for x, y in zip(plan_of(b.hot), want, strict=True):
            assert torch.equal(x, y)
        for i, rows in got.items():
            assert torch.equal(rows, got[0]), i
            reads_its_selection(layers[i], rows, raw)
        n = int(lens[0])  # request 0 is short: token t at slot t, nothing copied
        assert b.hot.slots[0].tolist() == raw[0, :-1].tolist() + [-1] and b.hot.copy_count[0] == 0
        assert b.hot.state[0][0][0].tolist() == list(range(n)) + [-1] * (HOT - n)


def test_a_carried_selections_refused_hot_layer_leaves_the_hot_state_as_it_was():
    """After load_carry, the first shared layer with hot= plans; a HotLayer it cannot plan with (no host_kv, seq_lens
    of another shape), or no row_to_batch after a producer of next_n rows a request, is refused before the hot state
    changes, and the carry is still planned by the next call."""
    g, (_, runner_b), (_, b), layers = pipeline()
    lens = torch.tensor([20, 9, 30], dtype=INDEX)
    raw = torch.stack([torch.randint(0, int(n), (K,), generator=g) for n in lens]).to(INDEX)
    b.load_carry(raw, CarryHeader(producer=0, rows=REQUESTS, k=K))
    tokens, ages = (t.clone() for t in b.hot.state[0])
    table = torch.zeros(REQUESTS, 1, dtype=INDEX)
    layer = layers[2]
    prefill(layer, lens)
    kv = layer.device_kv.clone()
    for error, message, bad in (
        (ValueError, "HotLayer planning producer 0's group has no host_kv",
         HotLayer(None, None, layer.device_loc, lens, layer.host_loc)),
        (ValueError, r"seq_lens: expected shape \[3\]", HotLayer(layer.host_kv, layer.device_kv, layer.device_loc,
                                                                  lens[:2], layer.host_loc)),
    ):
        with pytest.raises(error, match=message):
            runner_b.layer(2, b, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=bad)
        assert b.carried and b.hot.group is None and b.hot.rows == 0, message
        assert torch.equal(b.hot.state[0][0], tokens) and torch.equal(b.hot.state[0][1], ages), message
        assert torch.equal(layer.device_kv, kv), message
    # a carry whose producer had next_n 3 rows a request (three rows, request 0's): no row_to_batch, refused unplanned
    b.load_carry(raw, CarryHeader(producer=0, rows=REQUESTS, k=K, layout=3))
    with pytest.raises(ValueError, match=r"producer 0's rows are next_n=3 rows a request .*layer 2 would plan"):
        runner_b.layer(2, b, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table,
                       hot=HotLayer(layer.host_kv, layer.device_kv, layer.device_loc, lens, layer.host_loc))
    assert b.carried and b.hot.group is None and b.hot.rows == 0
    assert torch.equal(b.hot.state[0][0], tokens) and torch.equal(layer.device_kv, kv)
    b.load_carry(raw, CarryHeader(producer=0, rows=REQUESTS, k=K))
    rows = run(runner_b, b, layers, 2, lens)
    assert b.hot.group == 0 and not b.carried
    reads_its_selection(layer, rows, raw)


def test_only_a_carried_selection_is_planned_by_a_shared_layer():
    """A producer run without hot= made no plan (its attention read page-table slots): its shared layer with hot=
    raises, after a carry of another producer too; begin() forgets a loaded carry; DraftTopk.serve without hot makes
    no plan either."""
    _, _, runner, state, layers, table = setup()
    lens = torch.tensor([20, 20, 20], dtype=INDEX)
    own = [HotLayer(layer.host_kv, layer.device_kv, layer.device_loc, lens, layer.host_loc) for layer in layers]
    state.next = torch.zeros(REQUESTS, K, dtype=INDEX)
    runner.begin(state, REQUESTS)
    runner.layer(0, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table)
    with pytest.raises(MissingProducerError, match="plan of None, not of producer 0: .*ran without hot="):
        runner.layer(1, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=own[1])
    state.load_carry(torch.zeros(REQUESTS, K, dtype=INDEX), CarryHeader(producer=0, rows=REQUESTS, k=K))
    runner.layer(2, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table)
    assert not state.carried  # producer 2 selected: the carry is no longer the state's selection
    with pytest.raises(MissingProducerError, match="plan of None, not of producer 2: .*ran without hot="):
        runner.layer(3, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=own[3])
    state.load_carry(torch.zeros(REQUESTS, K, dtype=INDEX), CarryHeader(producer=0, rows=REQUESTS, k=K))
    runner.begin(state, REQUESTS)
    state.producer = 0  # indices from somewhere, but no carry loaded in this forward
    with pytest.raises(MissingProducerError, match="plan of None, not of producer 0"):
        runner.layer(1, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=own[1])
    draft = DraftTopk([0], REQUESTS, K, 2)
    runner.begin(state, REQUESTS)
    runner.layer(0, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table)
    draft.keep(0, state)
    runner.begin(state, REQUESTS)
    draft.serve(0, state, 1, lens + 1, table, PAGE)
    with pytest.raises(MissingProducerError, match="plan of None, not of producer 0"):
        runner.layer(1, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens + 1, page_table=table,
                     hot=own[1])


def test_a_draft_step_served_with_hot_plans_and_swaps_in_as_the_ops_do():
    """DraftTopk.serve(hot=) on the served selection: the device rows, the KV copied and the hot state are those of
    hisparse_plan, hisparse_swap_in and the translation through device_loc run on it directly; the page-table slots
    still go to state.physical; the step's shared layer swaps in with the same plan. Refused: hot without hot
    buffers, a HotLayer without host_kv (before raw is written)."""
    g, _, runner, state, layers, table = setup()
    lens = torch.tensor([10, 13, 30], dtype=INDEX)
    own = [HotLayer(layer.host_kv, layer.device_kv, layer.device_loc, lens, layer.host_loc) for layer in layers]
    for layer in layers[:2]:
        prefill(layer, lens)
        write_newest(layer, lens)
    state.next = torch.stack([torch.randint(0, int(n), (K,), generator=g) for n in lens]).to(INDEX)
    runner.begin(state, REQUESTS)  # the draft extend, with HiSparse
    for i in (0, 1):
        runner.layer(i, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=lens, page_table=table, hot=own[i])
    draft = DraftTopk([0], REQUESTS, K, 3)
    draft.keep(0, state)
    span = torch.full((REQUESTS,), HOT + 1, dtype=INDEX)
    for step in (1, 2):
        seq_lens = lens + step
        hot = [HotLayer(layer.host_kv, layer.device_kv, layer.device_loc, seq_lens, layer.host_loc)
               for layer in layers]
        runner.begin(state, REQUESTS)
        for layer in layers[:2]:
            write_newest(layer, seq_lens)
        tokens, ages = (t.clone() for t in state.hot.state[0])
        kv = layers[0].device_kv.clone()
        rows = draft.serve(0, state, step, seq_lens, table, PAGE, hot=hot[0]).clone()
        served = state.raw[:REQUESTS].clone()
        # step 1: every kept token a hit, the newest at slot H; step 2: the long requests' one miss is step 1's newest
        assert state.hot.copy_count.tolist() == ([0, 0, 0] if step == 1 else [0, 1, 1])
        if step == 2:
            assert state.hot.copy_src[1:, 0].tolist() == [int(layers[0].host_loc[b, seq_lens[b] - 2]) for b in (1, 2)]
        assert served[:, -step:].tolist() == [[n - step + i for i in range(step)] for n in seq_lens.tolist()]
        plan = indexcache.hisparse_plan(served, seq_lens, layers[0].host_loc, tokens, ages)
        indexcache.hisparse_swap_in(*plan.copies, layers[0].host_kv, kv, layers[0].device_loc)
        assert torch.equal(rows, indexcache.translate(plan.slots, layers[0].device_loc, span, 1))
        assert torch.equal(layers[0].device_kv, kv)
        assert torch.equal(state.hot.state[0][0], tokens) and torch.equal(state.hot.state[0][1], ages)
        assert torch.equal(state.physical[:REQUESTS], indexcache.translate(served, table, seq_lens, PAGE))
        shared = runner.layer(1, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=seq_lens,
                              page_table=table, hot=hot[1])
        assert torch.equal(shared, indexcache.translate(plan.slots, layers[1].device_loc, span, 1))
        reads_its_selection(layers[1], shared, served)
    runner.begin(state, REQUESTS)
    held = state.raw.clone()
    with pytest.raises(ValueError, match="HotLayer planning producer 0's group has no host_kv"):
        draft.serve(0, state, 3, lens + 3, table, PAGE, hot=HotLayer(None, None, own[0].device_loc, lens + 3,
                                                                    own[0].host_loc))
    assert torch.equal(state.raw, held) and state.producer is None
    plain = TopkState(REQUESTS, K)
    plain.begin(REQUESTS)
    with pytest.raises(ValueError, match="hot: given, but the state has no hot buffers"):
        draft.serve(0, plain, 3, lens + 3, table, PAGE, hot=own[0])


@pytest.mark.parametrize("ragged", [False, True], ids=["next_n 2", "ragged rows"])
def test_a_producer_of_draft_rows_without_row_to_batch_is_refused_before_it_selects(ragged):
    """A decode producer's PagedLogits of next_n 2 (or ragged rows with their own row_to_batch) and no row_to_batch
    given to layer(): the HiSparse plan would take row r as request r, so the call is refused naming row_to_batch,
    before the state selects or plans (its selection and hot state as they were)."""
    from indexcache.runtime.state import PagedLogits

    _, plan, runner, _, layers, table = setup()
    rows = 2 * REQUESTS
    state = Chosen(rows, K)
    state.hot = HotBuffers(plan.producers, 4 * REQUESTS, HOT, rows, K)  # room for as many requests as rows: silent
    runner.begin(state, rows)
    before = state.raw.clone(), [t.clone() for s in state.hot.state.values() for t in s]
    q = torch.zeros(rows, 1, 1, 4) if ragged else torch.zeros(REQUESTS, 2, 1, 4)
    paged = PagedLogits(q=q, k_cache=torch.zeros(1, 8, dtype=torch.uint8), weights=torch.zeros(rows, 1),
                        context_lens=torch.full((rows if ragged else REQUESTS,), 10, dtype=INDEX), block_table=table,
                        max_context_len=10,
                        row_to_batch=torch.arange(rows, dtype=INDEX) // 2 if ragged else None)
    lens = torch.full((rows,), 10, dtype=INDEX)
    device_loc = layers[0].device_loc.repeat(4, 1)  # the layer's tensors for the buffers' requests
    hot = HotLayer(layers[0].host_kv, layers[0].device_kv, device_loc, lens.repeat(2), layers[0].host_loc.repeat(4, 1))
    layout, hint = ((r"ragged rows \(its own row_to_batch\)", "the PagedLogits' own row_to_batch") if ragged
                    else ("next_n=2 rows a request", "row r is request r // next_n"))
    with pytest.raises(ValueError, match=f"^row_to_batch: None, but layer 0's PagedLogits has {layout}: .*; give it "
                                         rf"\({hint}\)$"):
        runner.layer(0, state, scores=lambda: paged, lengths=lens, page_table=table, hot=hot)
    assert torch.equal(state.raw, before[0]) and state.hot.group is None
    assert all(torch.equal(a, b) for a, b in zip([t for s in state.hot.state.values() for t in s], before[1],
                                                  strict=True))


def test_a_shared_layer_without_the_row_to_batch_its_producer_planned_with_is_refused():
    """The producer planned its group with row_to_batch (rows not one a request in order); a shared layer of the
    group swapping in without it would take row r as request r (its misses copied and its rows read for the wrong
    requests), so it is refused naming row_to_batch; given it, the layer reads its producer's selection. A producer
    planned without row_to_batch leaves its shared layers free to give the same rows' requests (test above)."""
    g, plan, runner, _, layers, table = setup()
    lens = first_decode_step(layers, torch.tensor([5, 20, 30], dtype=INDEX))
    requests = torch.tensor([2, 0, 1], dtype=INDEX)  # row r is request requests[r]
    raw = torch.stack([torch.randint(0, int(lens[b]), (K,), generator=g) for b in requests.tolist()]).to(INDEX)
    state = Chosen(REQUESTS, K)
    state.hot = HotBuffers(plan.producers, REQUESTS, HOT, REQUESTS, K)
    state.next = raw
    runner.begin(state, REQUESTS)

    def hot(i):
        return HotLayer(layers[i].host_kv, layers[i].device_kv, layers[i].device_loc, lens, layers[i].host_loc)

    row_lens = lens[requests]
    runner.layer(0, state, scores=lambda: torch.zeros(REQUESTS, 1), lengths=row_lens, page_table=table,
                 row_to_batch=requests, hot=hot(0))
    with pytest.raises(ValueError, match=r"^row_to_batch: None, but producer 0 planned this step with a row_to_batch"):
        runner.layer(1, state, scores=None, lengths=row_lens, page_table=table, hot=hot(1))
    rows = runner.layer(1, state, scores=None, lengths=row_lens, page_table=table, row_to_batch=requests, hot=hot(1))
    for r, b in enumerate(requests.tolist()):
        for j in range(K):
            x, d = int(raw[r, j]), int(rows[r, j])
            assert torch.equal(layers[1].device_kv[d], layers[1].host_kv[layers[1].host_loc[b, x]]), (r, b, x)
