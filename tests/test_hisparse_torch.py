"""The torch backend's HiSparse ops against the reference (indexcache.hal.hisparse): every output and the state after
the step equal on random and adversarial steps, a many-step sequence crossing H, no host sync (run on the meta
device, where any value-dependent op raises; under CUDA's sync debug mode and a graph capture where a GPU is), and the
swap-in on both of its paths."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from indexcache.backends.torch import hisparse as ops
from indexcache.hal import hisparse as ref
from indexcache.hal.hisparse import empty_state

I32, I64 = torch.int32, torch.int64
BIG = 2**31 - 1


def t(rows, dtype=I32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def run_plan(raw, seq, hl, tok, age, r2b=None, host_rows=None, device="cpu"):
    """The op on copies of the state (outputs pre-filled with garbage: every entry must be written)."""
    rows, k = raw.shape
    tok, age = tok.clone().to(device), age.clone().to(device)
    out = torch.full((rows, k), 77, dtype=I32, device=device)
    src = torch.full((rows, k), 77, dtype=I64, device=device)
    dst = torch.full((rows, k), 77, dtype=I32, device=device)
    count = torch.full((rows,), 77, dtype=I32, device=device)
    got = ops.hisparse_plan(raw.to(device), seq.to(device), hl.to(device), tok, age,
                            None if r2b is None else r2b.to(device), host_rows, out, src, dst, count)
    assert all(a is b for a, b in zip(got, (out, src, dst, count), strict=True))
    return ref.Plan(out, src, dst, count, tok, age)


def check_plan(raw, seq, hl, tok, age, r2b=None, host_rows=None) -> ref.Plan:
    want = ref.plan(raw, seq, hl, tok, age, row_to_batch=r2b, host_rows=host_rows)
    got = run_plan(raw, seq, hl, tok, age, r2b, host_rows)
    for name in ref.Plan._fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b), (name, raw, seq, hl, tok, age, r2b, host_rows, a, b)
    return want


def check_swap_in(p, host_kv, device_kv, device_loc, r2b=None, path=ops.hisparse_swap_in) -> None:
    """The op (given counts as they are) against the reference (given them clamped to [0, k], as the op's contract
    reads them)."""
    clamped = p._replace(copy_count=p.copy_count.clamp(0, p.copy_src.shape[1]))
    want = ref.swap_in(clamped, host_kv, device_kv, device_loc, row_to_batch=r2b)
    got = device_kv.clone()
    assert path(p.copy_src, p.copy_dst, p.copy_count, host_kv, got, device_loc, r2b) is got
    assert torch.equal(got, want)


# ---- hand-picked steps: each rule once ----------------------------------------------------------------------------

def test_each_rule_on_a_hand_picked_step():
    hl = (100 + torch.arange(10))[None, :].repeat(2, 1)
    # misses fill empty slots, duplicates once; hits keep their slots, the newest is slot H, oldest evicted
    check_plan(t([[2, 7, -1, 2]]), t([10]), hl[:1], *empty_state(1, 4))
    check_plan(t([[7, 8, 9, 4]]), t([10]), hl[:1], t([[2, 7, 3, 5]]), t([[4, 1, 2, 3]]))
    # empty slots before occupied ones; equal ages: the lower slot
    check_plan(t([[1, 2, 4]]), t([10]), hl[:1], t([[-1, 3, -1, 6]]), t([[7, 0, 5, 9]]))
    check_plan(t([[5]]), t([10]), hl[:1], t([[0, 1, 2, 3]]), t([[0, 0, 0, 0]]))
    # invalid positions; stale and duplicated state emptied (the lower slot wins)
    check_plan(t([[-5, 10, 11, BIG, -(2**31), 3, 9]]), t([10]), hl[:1], t([[3, -1, -1, -1]]), t([[0, -1, -1, -1]]))
    check_plan(t([[9, 3]]), t([10]), hl[:1], t([[9, 3, 3, 12]]), t([[5, 5, 5, 5]]))
    # misses not on the host take no slot; more distinct tokens than slots
    adv = t([[100, -1, 102, 2**40, 104, 105]], I64)
    check_plan(t([[1, 2, 3, 4, 7, 5]]), t([10]), adv, t([[1, -1, -1, -1]]), t([[0, -1, -1, -1]]), host_rows=1000)
    check_plan(t([[1, 3]]), t([10]), adv, *empty_state(1, 4))
    check_plan(t([[1, 2, 3, 2, 9]]), t([10]), hl[:1], *empty_state(1, 2))
    check_plan(t([[5, 1, 2]]), t([10]), hl[:1], t([[1, 2]]), t([[0, 0]]))
    # short requests: the identity, whatever the state; seq_len <= 0
    check_plan(t([[0, 2, 3, -1]]), t([3]), hl[:1], t([[7, 7, 7, 7]]), t([[2, 2, 2, 2]]))
    check_plan(t([[3, 0]]), t([4]), hl[:1], t([[7, 7, 7, 7]]), t([[2, 2, 2, 2]]))
    check_plan(t([[0, 1]]), t([-3]), hl[:1, :4], t([[0, 1]]), t([[0, 0]]))
    # rows sharing a request, rows naming no request, requests named by no row
    check_plan(t([[3, 5, -1], [5, 6, 3], [1, 1, 2]]), t([10, 10]), hl, *empty_state(2, 4), r2b=t([0, 0, 1]))
    check_plan(t([[1, 2], [0, 1]]), t([10, 2]), hl, t([[7, 8], [0, 1]]), t([[1, 2], [3, 4]]), r2b=t([5, -1]))
    # ages saturate at 2**31 - 1; the most negative age is the oldest
    check_plan(t([[1, 2]]), t([10]), hl[:1], t([[1, 5, 6]]), t([[BIG, -(2**31), BIG - 1]]))
    # no columns: a named request is still cleaned (long) or reset (short); no rows at all
    check_plan(torch.zeros(2, 0, dtype=I32), t([10, 2]), hl, t([[9, 3, 3], [5, 5, 5]]), t([[1, 2, 3], [4, 5, 6]]))
    check_plan(torch.zeros(0, 3, dtype=I32), t([10, 2]), hl, t([[9, 3, 3], [5, 5, 5]]), t([[1, 2, 3], [4, 5, 6]]),
               r2b=torch.zeros(0, dtype=I32))
    # no host columns at all
    check_plan(t([[1, 2, 9]]), t([10]), torch.zeros(1, 0, dtype=I64), t([[1, -1]]), t([[0, 0]]))


def test_positions_and_lengths_near_2_31_do_not_overflow_the_keys():
    seq = t([BIG, BIG - 1, 2**31 - 5])
    raw = t([[BIG - 1, BIG - 2, BIG - 3, BIG, -(2**31), 2**30], [BIG - 2, BIG - 2, BIG - 3, 5, 0, -1],
             [2**31 - 6, 3, 3, 2**31 - 7, 1, 2]])
    tok = t([[BIG - 2, BIG - 1, BIG, 2**30], [BIG - 3, BIG - 2, BIG - 3, 0], [1, 2, 2**31 - 7, 2**31 - 6]])
    age = t([[0, 1, 2, 3], [BIG, BIG, 0, -(2**31)], [-1, -1, -1, -1]])
    hl = t([[7, 8, 9], [2**40, -1, 3], [1, 2, 3]], I64)
    for r2b in (None, t([0, 0, 2]), t([2, 2, 2])):
        check_plan(raw, seq, hl, tok, age, r2b=r2b)


# ---- random steps -------------------------------------------------------------------------------------------------

def _random_case(rng: random.Random, hot_max: int = 7, k_max: int = 7):
    """A step drawn to hit every rule: small position ranges (duplicates, hits), seq_len around H, stale and
    duplicated state, host rows missing, rows sharing requests or naming none, extreme ages."""
    batches, hot = rng.randint(1, 4), rng.randint(1, hot_max)
    rows, k, length = rng.randint(0, 7), rng.randint(0, k_max), rng.randint(0, 3 * hot + 6)
    top = rng.choice([hot + 2, 2 * hot + 4, 3 * hot + 8])
    seq = t([rng.choice([rng.randint(-1, top), hot, hot + 1, top]) for _ in range(batches)])
    raw = t([[rng.randint(-3, top + 2) for _ in range(k)] for _ in range(rows)]).view(rows, k)
    tok = t([[rng.randint(-3, top + 1) if rng.random() < 0.8 else -1 for _ in range(hot)] for _ in range(batches)])
    age = t([[rng.choice([-1, 0, 1, 2, 3, 7, BIG - 1, BIG, -(2**31), rng.randint(-5, 20)]) for _ in range(hot)]
             for _ in range(batches)])
    wide = rng.choice([I32, I64])
    far = 2**40 if wide == I64 else BIG
    hl = t([[rng.randint(-2, 60) if rng.random() < 0.85 else rng.choice([-7, far]) for _ in range(length)]
            for _ in range(batches)], wide).view(batches, length)
    if rows == batches and rng.random() < 0.3:
        r2b = None
    else:
        r2b = t([rng.choice([rng.randint(0, batches - 1), rng.randint(0, batches - 1), -1, batches, 99])
                 for _ in range(rows)]).view(rows)
    return raw, seq, hl, tok, age, r2b, rng.choice([None, None, 40, 0])


@pytest.mark.parametrize("seed", range(8))
def test_random_steps_equal_the_reference(seed):
    rng = random.Random(seed)
    for _ in range(150):
        check_plan(*_random_case(rng))


@pytest.mark.parametrize("seed", range(3))
def test_random_steps_with_many_rows_a_request_and_k_past_h(seed):
    rng = random.Random(100 + seed)
    for _ in range(60):
        raw, seq, hl, tok, age, _, host_rows = _random_case(rng, hot_max=4, k_max=12)
        r2b = t([rng.randint(0, min(1, seq.shape[0] - 1)) for _ in range(raw.shape[0])]).view(raw.shape[0])
        check_plan(raw, seq, hl, tok, age, r2b=r2b, host_rows=host_rows)


@st.composite
def _steps(draw):
    batches, hot = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    rows, k = draw(st.integers(0, 5)), draw(st.integers(0, 6))
    length = draw(st.integers(0, 14))
    small = st.integers(-3, 16)
    raw = t(draw(st.lists(st.lists(small, min_size=k, max_size=k), min_size=rows, max_size=rows)) or [[]] * rows)
    seq = t(draw(st.lists(st.integers(-1, 14), min_size=batches, max_size=batches)))
    hl = t(draw(st.lists(st.lists(st.integers(-2, 40), min_size=length, max_size=length), min_size=batches,
                         max_size=batches)), I64).view(batches, length)
    tok = t(draw(st.lists(st.lists(small, min_size=hot, max_size=hot), min_size=batches, max_size=batches)))
    ages = st.one_of(st.integers(-1, 9), st.sampled_from([-(2**31), BIG - 1, BIG]))
    age = t(draw(st.lists(st.lists(ages, min_size=hot, max_size=hot), min_size=batches, max_size=batches)))
    if rows == batches and draw(st.booleans()):
        r2b = None
    else:
        r2b = t(draw(st.lists(st.integers(-1, batches), min_size=rows, max_size=rows))).view(rows)
    return raw.view(rows, k), seq, hl, tok, age, r2b, draw(st.sampled_from([None, 30]))


@settings(max_examples=150, deadline=None)
@given(_steps())
def test_property_every_output_and_the_state_equal_the_reference(case):
    check_plan(*case)


# ---- many steps: the state evolving ---------------------------------------------------------------------------------

def test_thirty_steps_crossing_h_with_rows_sharing_requests():
    rng = random.Random(7)
    batches, hot, k, per = 3, 6, 4, [1, 2, 3]
    r2b = t([b for b in range(batches) for _ in range(per[b])] + [batches])  # and a row naming no request
    hl = torch.arange(batches * 200, dtype=I64).view(batches, 200)
    hl[1, 5::7] = -1  # some tokens never reached the host
    tok, age = empty_state(batches, hot)
    mine_tok, mine_age = tok.clone(), age.clone()
    seq = [1, 3, 5]
    crossed = set()
    for step in range(30):
        seq = [n + rng.randint(0, 2) for n in seq]
        crossed |= {b for b in range(batches) if seq[b] > hot}
        raw = []
        for r in range(r2b.shape[0]):
            n = seq[int(r2b[r])] if int(r2b[r]) < batches else 10
            recent = range(max(0, n - 2 * hot), n)
            raw.append([rng.choice(recent) if rng.random() < 0.85 else rng.choice([-1, n, n + 3]) for _ in range(k)])
        raw, lens = t(raw), t(seq)
        if step == 17:  # a request left out of one step keeps its state
            r2b_step = torch.where(r2b == 1, batches, r2b).to(I32)
        else:
            r2b_step = r2b
        want = ref.plan(raw, lens, hl, tok, age, row_to_batch=r2b_step)
        got = run_plan(raw, lens, hl, mine_tok, mine_age, r2b_step)
        for name in ref.Plan._fields:
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
        tok, age = want.slot_token, want.slot_age
        mine_tok, mine_age = got.slot_token, got.slot_age
    assert crossed == {0, 1, 2} and int(age.max()) > 20


def test_the_state_is_updated_in_place():
    tok, age = t([[2, 7, 3, 5]]), t([[4, 1, 2, 3]])
    out, src = torch.empty(1, 4, dtype=I32), torch.empty(1, 4, dtype=I64)
    dst, count = torch.empty(1, 4, dtype=I32), torch.empty(1, dtype=I32)
    ops.hisparse_plan(t([[7, 8, 9, 4]]), t([10]), torch.arange(10)[None] + 100, tok, age, None, None, out, src, dst,
                      count)
    assert tok.tolist() == [[2, 7, 8, 4]] and age.tolist() == [[4, 5, 5, 5]]
    assert out.tolist() == [[1, 2, 4, 3]] and count.tolist() == [2]
    assert src.tolist() == [[108, 104, -1, -1]] and dst.tolist() == [[2, 3, -1, -1]]


# ---- no host sync ----------------------------------------------------------------------------------------------------

def test_the_plan_and_the_device_swap_in_run_on_the_meta_device():
    """Meta tensors hold no values: .item(), .tolist(), nonzero, masks, unique and copies to the host all raise, so
    a plan that runs here chose no shape from a value and read none back."""
    rng = random.Random(3)
    for _ in range(5):
        raw, seq, hl, tok, age, r2b, host_rows = _random_case(rng)
        rows, k = raw.shape
        meta = torch.device("meta")
        got = run_plan(raw, seq, hl, tok, age, r2b, host_rows, device=meta)
        assert [tuple(x.shape) for x in got] == [(rows, k), (rows, k), (rows, k), (rows,), tuple(tok.shape),
                                                 tuple(tok.shape)]
        device_kv = torch.zeros(20, 2, 3, dtype=torch.bfloat16, device=meta)
        ops.hisparse_swap_in(got.copy_src, got.copy_dst, got.copy_count, torch.zeros(30, 2, 3, dtype=torch.bfloat16,
                             device=meta), device_kv, torch.zeros(tok.shape[0], tok.shape[1] + 1, dtype=I64,
                             device=meta), None if r2b is None else r2b.to(meta))
    with pytest.raises((RuntimeError, NotImplementedError)):  # the check can fail: a value read back raises here
        torch.zeros(3, device="meta").nonzero()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_plan_syncs_nothing_and_captures_in_a_cuda_graph():
    rng = random.Random(5)
    raw, seq, hl, tok, age, r2b, host_rows = _random_case(rng)
    while raw.numel() == 0:
        raw, seq, hl, tok, age, r2b, host_rows = _random_case(rng)
    want = ref.plan(raw, seq, hl, tok, age, row_to_batch=r2b, host_rows=host_rows)
    cuda = torch.device("cuda")
    args = [x.to(cuda) if x is not None else None for x in (raw, seq, hl, tok.clone(), age.clone(), r2b)]
    rows, k = raw.shape
    outs = (torch.empty(rows, k, dtype=I32, device=cuda), torch.empty(rows, k, dtype=I64, device=cuda),
            torch.empty(rows, k, dtype=I32, device=cuda), torch.empty(rows, dtype=I32, device=cuda))
    state = (args[3].clone(), args[4].clone())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.hisparse_plan(*args, host_rows, *outs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    args[3].copy_(state[0])
    args[4].copy_(state[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.hisparse_plan(*args, host_rows, *outs)
    args[3].copy_(state[0])
    args[4].copy_(state[1])
    graph.replay()
    torch.cuda.synchronize()
    got = ref.Plan(*outs, args[3], args[4])
    for name in ref.Plan._fields:
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


# ---- swap-in ---------------------------------------------------------------------------------------------------------

def _random_copies(rng: random.Random, rows: int, k: int, batches: int, width: int, host_rows: int):
    """Copy lists with every kind of entry: in bounds, host or device row outside, slot outside, request outside,
    counts negative or past k, several copies to one device row."""
    src = t([[rng.randint(-2, host_rows + 1) for _ in range(k)] for _ in range(rows)], I64).view(rows, k)
    dst = t([[rng.randint(-1, width) for _ in range(k)] for _ in range(rows)]).view(rows, k)
    count = t([rng.randint(-1, k + 1) for _ in range(rows)]).view(rows)
    r2b = None if rows == batches and rng.random() < 0.3 else t(
        [rng.randint(-1, batches) for _ in range(rows)]).view(rows)
    return ref.Plan(t([[0] * k] * rows).view(rows, k), src, dst, count, t([[0]]), t([[0]])), r2b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("path", ["device", "host"])
def test_swap_in_equals_the_reference_on_random_copy_lists(dtype, path):
    rng = random.Random(11)
    fn = ops.hisparse_swap_in if path == "device" else ops._swap_in_from_host
    for _ in range(60):
        batches, width, rows, k = rng.randint(1, 3), rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 5)
        host_rows, device_rows = rng.randint(1, 12), rng.randint(1, 10)
        host_kv = torch.arange(host_rows * 6, dtype=torch.float32).view(host_rows, 2, 3).to(dtype)
        device_kv = (100 + torch.arange(device_rows * 6, dtype=torch.float32)).view(device_rows, 2, 3).to(dtype)
        device_loc = t([[rng.randint(-1, device_rows) for _ in range(width)] for _ in range(batches)],
                       rng.choice([I32, I64]))
        p, r2b = _random_copies(rng, rows, k, batches, width, host_rows)
        check_swap_in(p, host_kv, device_kv, device_loc, r2b, fn)


def test_swap_in_of_a_planned_step_and_empty_tensors():
    rng = random.Random(13)
    for _ in range(40):
        raw, seq, hl, tok, age, r2b, host_rows = _random_case(rng)
        p = run_plan(raw, seq, hl, tok, age, r2b, host_rows)
        host_kv = torch.arange(4 * 64, dtype=torch.float32).view(64, 4)
        device_loc = torch.arange(tok.shape[0] * (tok.shape[1] + 1), dtype=I32).view(tok.shape[0], -1)
        check_swap_in(p, host_kv, torch.zeros(device_loc.numel(), 4), device_loc, r2b)
        check_swap_in(p, host_kv, torch.zeros(device_loc.numel(), 4), device_loc, r2b, ops._swap_in_from_host)
    p, r2b = _random_copies(rng, 2, 3, 2, 3, 4)
    check_swap_in(p, torch.zeros(0, 2), torch.ones(5, 2), t([[0, 1, 2], [3, 4, 5]]), r2b)
    check_swap_in(p, torch.ones(4, 2), torch.zeros(0, 2), t([[0, 1, 2], [3, 4, 5]]), r2b)
    check_swap_in(p, torch.ones(4, 2), torch.zeros(3, 2), torch.zeros(2, 0, dtype=I32), r2b)


def test_the_host_path_refuses_a_cuda_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    p, r2b = _random_copies(random.Random(1), 2, 3, 2, 3, 4)
    with pytest.raises(RuntimeError, match="CUDA graph"):
        ops._swap_in_from_host(p.copy_src, p.copy_dst, p.copy_count, torch.ones(4, 2), torch.zeros(6, 2),
                               t([[0, 1, 2], [3, 4, 5]]), r2b)


# ---- the slot index: checked at the public op, ignored by the torch backend ------------------------------------------

def test_a_slot_index_is_checked_by_name_and_left_alone_by_the_torch_backend():
    import indexcache

    tok, age = empty_state(2, 4)
    raw, seq, hl = t([[3, 9], [1, 2]]), t([12, 3]), torch.arange(20).view(2, 10) + 100
    # H 4 check words, then max(L 10, H 4) entries: 14 words a request at least
    for bad, error in ((torch.zeros(2, 14, dtype=I64), TypeError), (torch.zeros(2, 13, dtype=I32), ValueError),
                       (torch.zeros(14, 2, dtype=I32).t(), ValueError), (torch.zeros(3, 14, dtype=I32), ValueError)):
        with pytest.raises(error, match="slot_index"):
            indexcache.hisparse_plan(raw, seq, hl, tok.clone(), age.clone(), slot_index=bad, backend="torch")
    memory = torch.zeros(36, dtype=I32)  # the index over the ages' second row
    with pytest.raises(ValueError, match="slot_index"):
        indexcache.hisparse_plan(raw, seq, hl, tok.clone(), memory[:8].view(2, 4), slot_index=memory[4:32].view(2, 14),
                                 backend="torch")
    index = torch.full((2, 15), 5, dtype=I32)
    want = indexcache.hisparse_plan(raw, seq, hl, tok.clone(), age.clone(), backend="torch")
    got = indexcache.hisparse_plan(raw, seq, hl, tok.clone(), age.clone(), slot_index=index, backend="torch")
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert (index == 5).all()
