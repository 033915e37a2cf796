"""The Triton ``hisparse_plan`` kernel (``backends/triton/hisparse/plan.py``), interpreted on the CPU: every output
entry and the state after each step equal ``indexcache.hal.hisparse.plan``'s, on random inputs, on each edge of the
rules, over a 20-step sequence crossing H and on inputs that are garbage everywhere; small block sizes run the
kernel's chunked loops at small shapes."""

from __future__ import annotations

import random

import pytest
import torch

from indexcache.backends.cuda.arch import NVIDIA
from indexcache.backends.cuda.tuning import tuning
from indexcache.hal import hisparse
from indexcache.hal.slot_index import check_words, index_width

from .far import far

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks"),
              pytest.mark.usefixtures("interpreted")]

SM90 = NVIDIA.target("sm90", interpreted=True)
CFG = tuning("sm90")["hisparse_plan"]
# Every loop of the kernel taken several times at small shapes: 4 slots a block, 2-bit digits, 2 x 4 rank pairs.
SMALL = dict(CFG, BLOCK_H=4, DIGIT=2, BLOCK_R=2, BI=2, BJ=4)
I32 = torch.int32
FIELDS = ("slots", "copy_src", "copy_dst", "copy_count", "slot_token", "slot_age")


def _kernel():
    from indexcache.backends.triton.hisparse import plan as module

    return module


def run_kernel(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch=None, host_rows=None, cfg=CFG,
               workspace=None) -> hisparse.Plan:
    """The kernel's plan, the state updated in place on copies; outputs filled with garbage first."""
    rows, k = raw.shape
    out = torch.full((rows, k), -77, dtype=I32)
    src = torch.full((rows, k), -77, dtype=torch.int64)
    dst = torch.full((rows, k), -77, dtype=I32)
    count = torch.full((rows,), -77, dtype=I32)
    tok, age = slot_token.clone(), slot_age.clone()
    launch = _kernel().plan_launch(raw, seq_lens, host_loc, tok, age, row_to_batch, host_rows, out, src, dst, count,
                                   target=SM90, cfg=cfg, workspace_given=workspace)
    if launch is not None:
        launch()
    return hisparse.Plan(out, src, dst, count, tok, age)


def check(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch=None, host_rows=None, cfg=CFG,
          workspace=None) -> hisparse.Plan:
    """Run both and compare every field entry by entry; the reference's plan."""
    want = hisparse.plan(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch=row_to_batch,
                         host_rows=host_rows)
    got = run_kernel(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch, host_rows, cfg, workspace)
    for name, g, w in zip(FIELDS, got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name}:\n got {g.tolist()}\nwant {w.tolist()}"
    return want


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=I32)


def host(batches: int, length: int, base: int = 100) -> torch.Tensor:
    """Token j of request b at host row base + 1000 b + j."""
    return (base + 1000 * torch.arange(batches)[:, None] + torch.arange(length)[None, :]).to(torch.int64)


def random_case(rng: random.Random) -> dict:
    """A call mixing every hazard: invalid and duplicate positions, stray rows, short and long requests, corrupted
    state, misses off the host, saturated ages, int32 or int64 host rows, strided raw."""
    batches, hot, k = rng.randint(0, 5), rng.choice([1, 2, 3, 5, 8, 16, 33]), rng.choice([1, 2, 3, 4, 7, 16, 40])
    shared = rng.random() < 0.5
    rows = rng.randint(0, 8) if shared else batches
    span = 3 * hot + 12
    seq = t([rng.choice([rng.randint(-2, hot + 2), rng.randint(hot, span - 2), 0, hot, hot + 1])
             for _ in range(batches)])
    raw = torch.tensor([[rng.randint(-3, span) for _ in range(k)] for _ in range(rows)], dtype=I32).reshape(rows, k)
    if rng.random() < 0.3:
        raw = raw % rng.randint(1, 6)  # heavy duplicates
    if rng.random() < 0.3:
        raw = raw.t().contiguous().t()  # column-major
    length = rng.randint(0, span)
    host_loc = torch.tensor([[rng.choice([rng.randint(0, 500), -1, rng.randint(0, 20)]) for _ in range(length)]
                             for _ in range(batches)], dtype=rng.choice([torch.int32, torch.int64]))
    host_loc = host_loc.reshape(batches, length)
    tok = t([[rng.choice([-1, rng.randint(-3, span), rng.randint(0, 5)]) for _ in range(hot)]
             for _ in range(batches)]).reshape(batches, hot)
    mode = rng.random()
    age = t([[rng.choice([-1, rng.randint(-5, 12), 2**31 - 1 if mode < 0.2 else 3, -2**31 if mode < 0.1 else 4])
              for _ in range(hot)] for _ in range(batches)]).reshape(batches, hot)
    r2b = t([rng.choice([rng.randint(0, max(batches - 1, 0)), rng.randint(-2, batches + 2)])
             for _ in range(rows)]) if shared else None
    return dict(raw=raw, seq_lens=seq, host_loc=host_loc, slot_token=tok, slot_age=age, row_to_batch=r2b,
                host_rows=rng.choice([None, None, rng.randint(0, 400)]))


@pytest.mark.parametrize("seed", range(6))
def test_random_calls_equal_the_reference(seed):
    rng = random.Random(seed)
    for _ in range(25):
        check(**random_case(rng))


@pytest.mark.parametrize("seed", range(3))
def test_random_calls_with_small_blocks_equal_the_reference(seed):
    rng = random.Random(100 + seed)
    for _ in range(15):
        check(**random_case(rng), cfg=SMALL)


@pytest.mark.parametrize("cfg", [CFG, SMALL], ids=["tuned", "small blocks"])
def test_invalid_positions_and_duplicates_within_and_across_rows(cfg):
    tok, age = hisparse.empty_state(2, 4)
    raw = t([[2, 7, -1, 2, 99, 12], [7, 3, 2, -5, 11, 11], [5, 5, 0, 1, 2, 3]])
    p = check(raw, t([12, 30]), host(2, 20), tok, age, row_to_batch=t([0, 0, 1]), cfg=cfg)
    assert p.slots[:2].tolist() == [[0, 1, -1, 0, -1, -1], [1, 2, 0, -1, 4, 4]]  # 11, request 0's newest: slot H


@pytest.mark.parametrize("length", [0, 3, 6, 9])
def test_tokens_past_the_table_are_neither_held_nor_looked_up(length):
    """The token table holds max(L, H) tokens a request: a state token at or past it is emptied, a selected one is a
    miss off the host; a garbage workspace does not matter."""
    tok, age = t([[7, 5, 8, 1], [2, 6, 6, 9]]), t([[3, 2, 1, 0], [0, 1, 2, 3]])
    raw = t([[7, 5, 8, 2], [6, 9, 2, 2]])
    garbage = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32).view(torch.uint8)
    check(raw, t([10, 10]), host(2, length), tok, age, workspace=garbage)


def test_rows_naming_no_request_and_requests_named_by_none():
    tok = t([[5, 6, -1], [1, 2, 3], [7, 8, 9]])
    age = t([[3, 4, -1], [9, 9, 9], [1, 2, 3]])
    r2b = t([2, -1, 3, 2, 7])
    raw = t([[1, 2], [3, 4], [5, 6], [0, 9], [1, 1]])
    p = check(raw, t([40, 40, 40]), host(3, 40), tok, age, row_to_batch=r2b)
    assert p.slot_token[:2].tolist() == tok[:2].tolist() and p.slot_age[:2].tolist() == age[:2].tolist()
    assert p.slots[1].tolist() == [-1, -1] and p.copy_count[[1, 2, 4]].tolist() == [0, 0, 0]


@pytest.mark.parametrize("n", [-3, 0, 1, 5, 7, 8, 9, 10, 30])
def test_lengths_around_h(n):
    hot = 8
    g = torch.Generator().manual_seed(n + 10)
    raw = torch.randint(-2, 12, (3, 6), generator=g, dtype=I32)
    tok = torch.randint(-2, 12, (3, hot), generator=g, dtype=I32)
    age = torch.randint(-1, 5, (3, hot), generator=g, dtype=I32)
    check(raw, t([n, max(n - 1, 0), n + 1]), host(3, 40), tok, age)


def test_short_requests_take_the_identity_whatever_the_state():
    tok, age = t([[9, 9, 9, 9, 9, 9]]), t([[4, 0, 4, 1, 2, 3]])
    p = check(t([[3, 0, 3, -1, 4, 6]]), t([5]), host(1, 8), tok, age)
    assert p.slots.tolist() == [[3, 0, 3, -1, 4, -1]] and p.slot_token.tolist() == [[0, 1, 2, 3, 4, -1]]


@pytest.mark.parametrize("cfg", [CFG, SMALL], ids=["tuned", "small blocks"])
def test_corrupted_state_is_cleaned(cfg):
    # Tokens at or past the newest, negative, and held twice (the lower slot keeps it), hit or not.
    tok = t([[4, 30, 4, -7, 29, 6, 6, 8, 21, 4], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    age = t([[5, 1, 2, 3, 9, 0, 7, 7, 2, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    raw = t([[4, 6, 3, 12, 13, 29], [1, 2, 3, 4, 1, 5]])
    check(raw, t([30, 25]), host(2, 40), tok, age, cfg=cfg)


@pytest.mark.parametrize("cfg", [CFG, SMALL], ids=["tuned", "small blocks"])
def test_misses_off_the_host(cfg):
    tok, age = hisparse.empty_state(2, 4)
    host_loc = host(2, 12)
    host_loc[0, 3] = -1
    host_loc[1, 2] = 500
    raw = t([[3, 5, 11, 12, 5, 3], [2, 4, 6, 7, 1, 0]])
    for rows in (None, 450, 0):
        p = check(raw, t([14, 12]), host_loc, tok, age, host_rows=rows, cfg=cfg)
        assert p.slots[0, 0] == -1 and p.slots[0, 3] == -1  # host_loc < 0; t >= L


@pytest.mark.parametrize("cfg", [CFG, SMALL], ids=["tuned", "small blocks"])
def test_more_distinct_tokens_than_free_slots(cfg):
    tok, age = t([[3, 8, 1, 9]]), t([[2, 5, 1, 0]])
    raw = t([[3, 20, 21, 22, 23], [24, 8, 25, 26, 21], [27, 28, 3, 29, 30]])
    p = check(raw, t([40]), host(1, 40), tok, age, row_to_batch=t([0, 0, 0]), cfg=cfg)
    assert int(p.copy_count.sum()) == 2  # hits 3 and 8 keep two slots; two misses take the other two
    k_above_h = torch.arange(40, dtype=I32).view(1, 40)
    check(k_above_h, t([41]), host(1, 41), tok, age, cfg=cfg)


def test_ages_saturate():
    top = 2**31 - 1
    tok, age = t([[1, 2, 3, -1]]), t([[top, top - 5, top, -1]])
    p = check(t([[2, 7, 9]]), t([20]), host(1, 20), tok, age)
    assert int(p.slot_age.max()) == top
    check(t([[2, 7, 9]]), t([3]), host(1, 20), tok, age)  # short


def test_empty_shapes_and_single_slot():
    tok, age = hisparse.empty_state(0, 4)
    check(torch.zeros(0, 3, dtype=I32), torch.zeros(0, dtype=I32), torch.zeros(0, 5, dtype=torch.int64), tok, age)
    tok, age = hisparse.empty_state(2, 4)
    check(torch.zeros(0, 3, dtype=I32), t([9, 9]), host(2, 9), tok, age, row_to_batch=torch.zeros(0, dtype=I32))
    tok, age = hisparse.empty_state(2, 1)
    check(t([[0], [4]]), t([5, 6]), host(2, 6), tok, age)
    check(t([[2, 0, 2], [4, 5, 1]]), t([5, 1]), host(2, 3), t([[3], [0]]), t([[1], [2]]))


def test_many_steps_crossing_h_each_equal_the_reference():
    """20 decode steps of two requests (next_n 2 rows each, the second shuffled), the context growing from below H
    to past it; each step compared with the reference run from the same state, the state carried on."""
    g = torch.Generator().manual_seed(7)
    hot, k, batches = 16, 6, 2
    tok, age = hisparse.empty_state(batches, hot)
    seq = t([10, 3])
    host_loc = host(batches, 80)
    r2b = t([0, 1, 0, 1])
    for step in range(20):
        hot_pick = [torch.randint(0, int(seq[b]), (2, k), generator=g, dtype=I32) for b in range(batches)]
        raw = torch.stack([hot_pick[0][0], hot_pick[1][0], hot_pick[0][1], hot_pick[1][1]])
        raw[:, 0] = seq[r2b.long()] - 1  # the newest
        if step % 5 == 3:
            raw[1, 1:3] = -1
        cfg = SMALL if step % 2 else CFG
        p = check(raw, seq, host_loc, tok, age, row_to_batch=r2b, cfg=cfg)
        tok, age = p.slot_token, p.slot_age
        seq = seq + t([2, 3])
    assert int(seq.min()) > hot


def test_garbage_everywhere_stays_in_bounds_and_equals_the_reference():
    g = torch.Generator().manual_seed(11)
    batches, hot, k, rows = 3, 8, 5, 7
    huge = 2**31 - 1
    for case in range(8):
        raw = torch.randint(-huge - 1, huge, (rows, k), generator=g, dtype=I32)
        raw[:, :2] = torch.randint(-3, 40, (rows, 2), generator=g, dtype=I32)
        r2b = torch.randint(-huge - 1, huge, (rows,), generator=g, dtype=I32)
        r2b[: rows - 2] = torch.randint(-1, batches + 1, (rows - 2,), generator=g, dtype=I32)
        host_loc = torch.randint(-2**62, 2**62, (batches, 30), generator=g, dtype=torch.int64)
        host_loc[:, ::3] = torch.randint(0, 50, (batches, 10), generator=g)
        tok = torch.randint(-huge - 1, huge, (batches, hot), generator=g, dtype=I32)
        tok[:, ::2] = torch.randint(-2, 40, (batches, hot // 2), generator=g, dtype=I32)
        age = torch.randint(-huge - 1, huge, (batches, hot), generator=g, dtype=I32)
        seq = t([huge, -huge - 1, 35]) if case % 2 else t([38, 4, huge])
        check(raw, seq, host_loc, tok, age, row_to_batch=r2b, host_rows=None if case % 3 else 40,
              cfg=SMALL if case % 2 else CFG)


def test_a_garbage_workspace_is_cleared():
    rng = random.Random(5)
    case = random_case(rng)
    while case["slot_token"].shape[0] == 0:
        case = random_case(rng)
    batches, hot = case["slot_token"].shape
    words = _kernel().workspace_words(batches, hot, case["host_loc"].shape[1],
                                      0 if case["row_to_batch"] is None else case["raw"].shape[0])
    workspace = torch.randint(-2**31, 2**31 - 1, (words + 2,), dtype=torch.int32).view(torch.uint8)
    check(**case, workspace=workspace)


def test_a_full_size_request():
    """H 4096 with k 512 (two state blocks, the tables at their tuned size): a steady step after a first one."""
    g = torch.Generator().manual_seed(3)
    hot, k = 4096, 512
    tok, age = hisparse.empty_state(1, hot)
    seq = t([20000])
    host_loc = host(1, 20000)
    raw = torch.randperm(19999, generator=g)[:k].to(I32).view(1, k)
    p = check(raw, seq, host_loc, tok, age)
    raw = torch.cat([raw[:, 40:], torch.randperm(19999, generator=g)[:40].to(I32).view(1, 40)], 1)
    check(raw, seq + 1, host_loc, p.slot_token, p.slot_age)


def test_supports_names_what_it_declines():
    module = _kernel()
    raw = torch.zeros(2, 8, dtype=I32)
    tok = torch.zeros(2, 16, dtype=I32)
    assert module.supports(raw, tok) == []
    assert "slots" in module.supports(raw, torch.zeros(2, module.MAX_H + 1, dtype=I32))[0]
    assert "columns" in module.supports(torch.zeros(2, module.MAX_K + 1, dtype=I32), tok)[0]
    assert "contiguous" in module.supports(raw, tok, out=torch.zeros(8, 2, dtype=I32).t())[0]


@pytest.mark.parametrize("seed", range(4))
def test_a_kept_slot_index_gives_the_same_plans(seed):
    """Steps planned with the kernel's own state and a slot index kept across them (its first contents garbage, a
    duplicate put into the state behind its back at step 12, a request reset at step 18): every plan and state equal
    to the reference's, and after each step the index holds the state's check words and every slot of a long request
    at its token (what lets the next step resolve only the selected tokens)."""
    g = torch.Generator().manual_seed(seed)
    batches, hot, k, rows_per, length = 3, 16, 6, 1 + seed % 2, 80
    tok, age = hisparse.empty_state(batches, hot)
    index = torch.randint(-5, 20, (batches, index_width(hot, length) + seed), generator=g, dtype=I32)
    host_loc = host(batches, length)
    seq = t([5, 12, 20])
    r2b = torch.arange(batches).repeat_interleave(rows_per).to(I32) if rows_per > 1 else None
    rows = batches * rows_per
    cfg = SMALL if seed % 2 else CFG
    for step in range(25):
        if step == 12:
            tok[1, 3] = tok[1, 5]
        if step == 18:
            tok[2], age[2] = -1, -1
        raw = torch.stack([torch.randint(-1, int(seq[r // rows_per]) + 1, (k,), generator=g) for r in range(rows)])
        raw = raw.to(I32)
        want = hisparse.plan(raw, seq, host_loc, tok, age, row_to_batch=r2b)
        out, src = torch.full((rows, k), -7, dtype=I32), torch.full((rows, k), -7, dtype=torch.int64)
        dst, count = torch.full((rows, k), -7, dtype=I32), torch.full((rows,), -7, dtype=I32)
        _kernel().plan_launch(raw, seq, host_loc, tok, age, r2b, None, out, src, dst, count, index, target=SM90,
                              cfg=cfg)()
        for name, got, w in zip(FIELDS, (out, src, dst, count, tok, age), want, strict=True):
            assert torch.equal(got, w), f"step {step}, {name}:\n got {got.tolist()}\nwant {w.tolist()}"
        assert torch.equal(index[:, :hot], check_words(tok)), f"step {step}"
        for b in range(batches):
            if int(seq[b]) > hot:
                held = [(s, x) for s, x in enumerate(tok[b].tolist()) if x >= 0]
                assert all(int(index[b, hot + x]) == s for s, x in held), f"step {step}, request {b}"
        seq = seq + torch.randint(0, 3, (batches,), generator=g, dtype=I32)


@pytest.mark.parametrize("cfg", [CFG, SMALL], ids=["one block", "blocks of 4"])
def test_ages_spread_past_the_bins_take_the_radix_select(cfg):
    """Free slots whose ages lie far apart (the pivot beyond the histogram's bins from the lowest key): the radix
    select, from the keys in registers (one block) or read back, gives the reference's evictions."""
    g = torch.Generator().manual_seed(7)
    batches, hot, k, length = 3, 16, 8, 90
    tok = torch.stack([torch.randperm(60, generator=g)[:hot] for _ in range(batches)]).to(I32)
    age = torch.randint(0, 2**30, (batches, hot), generator=g, dtype=torch.int64).to(I32)
    raw = torch.stack([torch.randperm(length - 1, generator=g)[:k] + 0 for _ in range(batches)]).to(I32)
    seq, host_loc = t([length] * batches), host(batches, length)
    want = hisparse.plan(raw, seq, host_loc, tok, age)
    assert int(want.copy_count.sum()) > 0
    out, src = torch.full((batches, k), -7, dtype=I32), torch.full((batches, k), -7, dtype=torch.int64)
    dst, count = torch.full((batches, k), -7, dtype=I32), torch.full((batches,), -7, dtype=I32)
    _kernel().plan_launch(raw, seq, host_loc, tok, age, None, None, out, src, dst, count, target=SM90, cfg=cfg)()
    for name, got, w in zip(FIELDS, (out, src, dst, count, tok, age), want, strict=True):
        assert torch.equal(got, w), f"{name}:\n got {got.tolist()}\nwant {w.tolist()}"


@pytest.mark.parametrize("indexed", [False, True], ids=["table", "slot index"])
def test_raw_of_a_huge_column_stride(indexed):
    """Steps of a short and a long request whose selections' column offsets pass 2^31 elements (rows of a transposed
    buffer), with and without a slot index: the kernel read a selection's entry at cols * raw_s1 in int32, far outside
    ``raw`` (a segfault interpreted). Every plan and state equal to the reference's."""
    g = torch.Generator().manual_seed(21)
    batches, hot, k, length = 2, 8, 6, 40
    tok, age = hisparse.empty_state(batches, hot)
    index = torch.full((batches, index_width(hot, length)), -1, dtype=I32) if indexed else None
    host_loc, seq = host(batches, length), t([5, 30])
    for step in range(3):
        raw = torch.stack([torch.randint(-1, int(seq[r]) + 1, (k,), generator=g) for r in range(batches)]).to(I32)
        want = hisparse.plan(raw, seq, host_loc, tok, age)
        out, src = torch.full((batches, k), -7, dtype=I32), torch.full((batches, k), -7, dtype=torch.int64)
        dst, count = torch.full((batches, k), -7, dtype=I32), torch.full((batches,), -7, dtype=I32)
        _kernel().plan_launch(far(raw, 1), seq, host_loc, tok, age, None, None, out, src, dst, count, index,
                              target=SM90, cfg=SMALL)()
        for name, got, w in zip(FIELDS, (out, src, dst, count, tok, age), want, strict=True):
            assert torch.equal(got, w), f"step {step}, {name}:\n got {got.tolist()}\nwant {w.tolist()}"
        seq = seq + 1
