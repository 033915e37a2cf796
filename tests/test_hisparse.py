"""The HiSparse hot-buffer rules (indexcache.hal.hisparse, docs/hisparse.md): hand-worked steps, a request's state
over many steps with the engine's duties simulated, and the invariants on random inputs."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from indexcache.hal import hisparse, ops
from indexcache.hal.hisparse import EMPTY, empty_state, plan, swap_in
from indexcache.hal.slot_index import check_words, index_width

I32 = torch.int32


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=I32)


def host(batches: int, length: int, base: int = 100) -> torch.Tensor:
    """Token j of request b at host row base + 1000 b + j."""
    return (base + 1000 * torch.arange(batches)[:, None] + torch.arange(length)[None, :]).to(torch.int64)


def copies(p, r: int) -> list[tuple[int, int]]:
    n = int(p.copy_count[r])
    return list(zip(p.copy_src[r, :n].tolist(), p.copy_dst[r, :n].tolist(), strict=True))


# ---- hand-worked steps (H = 4 unless said) -------------------------------------------------------------------------

def test_misses_fill_empty_slots_in_order_and_duplicates_are_placed_once():
    tok, age = empty_state(1, 4)
    p = plan(t([[2, 7, -1, 2]]), t([10]), host(1, 10), tok, age)
    assert p.slots.tolist() == [[0, 1, -1, 0]]
    assert copies(p, 0) == [(102, 0), (107, 1)]
    assert p.slot_token.tolist() == [[2, 7, -1, -1]]
    assert p.slot_age.tolist() == [[0, 0, -1, -1]]  # now = max(-1) + 1 = 0
    assert p.copy_src[0, 2:].tolist() == [-1, -1] and p.copy_dst[0, 2:].tolist() == [-1, -1]


def test_hits_keep_their_slot_misses_evict_the_oldest_and_the_newest_is_slot_h():
    tok, age = t([[2, 7, 3, 5]]), t([[4, 1, 2, 3]])
    p = plan(t([[7, 8, 9, 4]]), t([10]), host(1, 10), tok, age)
    # 9 = seq_len - 1 is the newest: slot H = 4. 7 hits slot 1. Misses 8, 4 take the free slots by age: 2 (2), 3 (3).
    assert p.slots.tolist() == [[1, 2, 4, 3]]
    assert copies(p, 0) == [(108, 2), (104, 3)]
    assert p.slot_token.tolist() == [[2, 7, 8, 4]]
    assert p.slot_age.tolist() == [[4, 5, 5, 5]]  # now = 4 + 1; slot 0 untouched
    assert tok.tolist() == [[2, 7, 3, 5]] and age.tolist() == [[4, 1, 2, 3]]  # inputs unchanged


def test_equal_ages_evict_the_lowest_slot_and_empty_slots_go_first():
    p = plan(t([[5]]), t([10]), host(1, 10), t([[0, 1, 2, 3]]), t([[0, 0, 0, 0]]))
    assert p.slots.tolist() == [[0]] and p.slot_token.tolist() == [[5, 1, 2, 3]]
    # empty slots (any age) before occupied ones; occupied by (age, slot)
    p = plan(t([[1, 2, 4]]), t([10]), host(1, 10), t([[-1, 3, -1, 6]]), t([[7, 0, 5, 9]]))
    assert p.slots.tolist() == [[2, 0, 1]]  # empties 2 (age 5), 0 (age 7); then slot 1 (age 0)
    assert p.slot_token.tolist() == [[2, 4, 1, 6]]


def test_a_token_no_step_could_have_placed_is_emptied():
    # host_loc holds 6 tokens and H is 4: a slot can hold a token below max(6, 4) = 6 (placed from the host, or a short
    # request's own); 7 and 8 (below the newest, 9) cannot have come there, so their slots are emptied, and 7, selected,
    # is a miss off the host: no slot.
    p = plan(t([[7, 5]]), t([10]), host(1, 6), t([[7, 5, 8, 1]]), t([[3, 2, 1, 0]]))
    assert p.slots.tolist() == [[-1, 1]] and p.copy_count.tolist() == [0]
    assert p.slot_token.tolist() == [[-1, 5, -1, 1]] and p.slot_age.tolist() == [[3, 4, 1, 0]]


def test_minus_one_everywhere_places_nothing():
    tok, age = t([[4, 1, 2, 3]]), t([[3, 0, 1, 2]])
    p = plan(torch.full((1, 6), -1, dtype=I32), t([10]), host(1, 10), tok, age)
    assert p.slots.tolist() == [[-1] * 6] and int(p.copy_count[0]) == 0
    assert torch.equal(p.slot_token, tok) and torch.equal(p.slot_age, age)


def test_invalid_positions_are_never_looked_up_placed_or_copied():
    tok, age = t([[3, -1, -1, -1]]), t([[0, -1, -1, -1]])
    raw = t([[-5, 10, 11, 2**31 - 1, -(2**31), 3, 9]])
    p = plan(raw, t([10]), host(1, 10), tok, age)
    assert p.slots.tolist() == [[-1, -1, -1, -1, -1, 0, 4]]  # 3 hits, 9 is the newest
    assert int(p.copy_count[0]) == 0
    # a state slot holding a token at or past the newest, or a token an earlier slot holds, is emptied
    p = plan(t([[9, 3]]), t([10]), host(1, 10), t([[9, 3, 3, 12]]), t([[5, 5, 5, 5]]))
    assert p.slots.tolist() == [[4, 1]] and p.slot_token.tolist() == [[-1, 3, -1, -1]]


def test_adversarial_host_locations():
    hl = torch.tensor([[100, -1, 102, 2**40, 104, 105]], dtype=torch.int64)  # 6 tokens known; seq 10
    tok, age = t([[1, -1, -1, -1]]), t([[0, -1, -1, -1]])
    p = plan(t([[1, 2, 3, 4, 7, 5]]), t([10]), hl, tok, age, host_rows=1000)
    # 1 hits (its host row does not matter); 3 beyond host_rows and 7 beyond host_loc's width are not on the host:
    # no slot, no copy, and they take none of the free slots
    assert p.slots.tolist() == [[0, 1, -1, 2, -1, 3]]
    assert copies(p, 0) == [(102, 1), (104, 2), (105, 3)]
    p = plan(t([[1, 3]]), t([10]), hl, empty_state(1, 4)[0], empty_state(1, 4)[1])  # host_rows unknown: 2**40 is ok
    assert p.slots.tolist() == [[-1, 0]] and copies(p, 0) == [(2**40, 0)]


def test_more_distinct_tokens_than_slots_only_the_first_get_one():
    tok, age = empty_state(1, 2)
    p = plan(t([[1, 2, 3, 2, 9]]), t([10]), host(1, 10), tok, age)
    assert p.slots.tolist() == [[0, 1, -1, 1, 2]]  # 9 is the newest: slot H, outside the buffer
    assert copies(p, 0) == [(101, 0), (102, 1)]
    # hits first, whatever their column: the miss left over is the one without a slot
    p = plan(t([[5, 1, 2]]), t([10]), host(1, 10), t([[1, 2]]), t([[0, 0]]))
    assert p.slots.tolist() == [[-1, 0, 1]] and int(p.copy_count[0]) == 0


def test_seq_len_at_most_h_is_the_identity_and_the_state_follows_it():
    tok, age = t([[7, 7, 7, 7]]), t([[2, 2, 2, 2]])  # whatever was there
    p = plan(t([[0, 2, 3, -1]]), t([3]), host(1, 10), tok, age)
    assert p.slots.tolist() == [[0, 2, -1, -1]] and int(p.copy_count[0]) == 0
    assert p.slot_token.tolist() == [[0, 1, 2, -1]] and p.slot_age.tolist() == [[3, 2, 3, 2]]
    p = plan(t([[3, 0]]), t([4]), host(1, 10), p.slot_token, p.slot_age)  # seq_len == H: still the identity
    assert p.slots.tolist() == [[3, 0]] and p.slot_token.tolist() == [[0, 1, 2, 3]]
    assert p.slot_age.tolist() == [[4, 2, 3, 4]]
    p = plan(t([[4, 3, 1]]), t([5]), host(1, 10), p.slot_token, p.slot_age)  # past H: the identity's slots are hits
    assert p.slots.tolist() == [[4, 3, 1]] and int(p.copy_count[0]) == 0
    assert p.slot_age.tolist() == [[4, 5, 3, 5]]
    p = plan(t([[4, 5]]), t([6]), host(1, 10), p.slot_token, p.slot_age)  # 4 is no longer the newest: a miss
    assert p.slots.tolist() == [[2, 4]] and copies(p, 0) == [(104, 2)]  # slot 2, age 3, is the oldest
    assert p.slot_token.tolist() == [[0, 1, 4, 3]]


def test_zero_or_negative_seq_len_places_nothing_and_empties_the_state():
    p = plan(t([[0, 1]]), t([-3]), host(1, 4), t([[0, 1]]), t([[0, 0]]))
    assert p.slots.tolist() == [[-1, -1]] and p.slot_token.tolist() == [[-1, -1]]


def test_rows_sharing_a_request():
    tok, age = empty_state(2, 4)
    raw = t([[3, 5, -1], [5, 6, 3], [1, 1, 2]])
    p = plan(raw, t([10, 10]), host(2, 10), tok, age, row_to_batch=t([0, 0, 1]))
    assert p.slots.tolist() == [[0, 1, -1], [1, 2, 0], [0, 0, 1]]
    # each token copied once, filed under the row where it first appears
    assert copies(p, 0) == [(103, 0), (105, 1)] and copies(p, 1) == [(106, 2)] and copies(p, 2) == [(1101, 0),
                                                                                                  (1102, 1)]
    assert p.slot_token.tolist() == [[3, 5, 6, -1], [1, 2, -1, -1]]


def test_requests_without_rows_are_left_alone_and_rows_without_a_request_select_nothing():
    tok, age = t([[7, 8], [0, 1]]), t([[1, 2], [3, 4]])
    p = plan(t([[1, 2], [0, 1]]), t([10, 2]), host(2, 10), tok, age, row_to_batch=t([5, -1]))
    assert p.slots.tolist() == [[-1, -1], [-1, -1]] and p.copy_count.tolist() == [0, 0]
    assert torch.equal(p.slot_token, tok) and torch.equal(p.slot_age, age)


def test_swap_in_copies_each_planned_row_and_skips_rows_out_of_bounds():
    hot = 2
    host_kv = torch.arange(20, dtype=torch.float64)[:, None].repeat(1, 3)  # host row i holds i
    device_kv = torch.full((8, 3), -1.0, dtype=torch.float64)
    device_loc = t([[5, 6, 7], [0, 1, 2]])  # [B, H + 1]
    hl = torch.tensor([[10, 11, 12, 13, 14, 99], [0, 1, 2, 3, 4, 5]], dtype=torch.int64)
    tok, age = empty_state(2, hot)
    p = plan(t([[1, 5, 5], [3, -1, -1]]), t([6, 6]), hl, tok, age)
    assert p.slots.tolist() == [[0, 2, 2], [0, -1, -1]] and copies(p, 0) == [(11, 0)]
    out = swap_in(p, host_kv, device_kv, device_loc)
    assert out[5].tolist() == [11.0] * 3 and out[0].tolist() == [3.0] * 3
    assert (out[[1, 2, 3, 4, 6, 7]] == -1).all() and (device_kv == -1).all()  # a copy, the input untouched
    assert hisparse.device_rows(p.slots, device_loc).tolist() == [[5, 7, 7], [0, -1, -1]]
    holed = t([[-5, 6, 7], [0, 1, -3]])  # slots without a device row: -1, as translate over device_loc reads them
    assert hisparse.device_rows(p.slots, holed).tolist() == [[-1, 7, 7], [0, -1, -1]]
    assert ops.translate(p.slots, holed, t([hot + 1] * 2), 1, backend="torch").tolist() == [[-1, 7, 7], [0, -1, -1]]
    # a host row past host_kv, a device row past device_kv: skipped
    bad = p._replace(copy_src=torch.tensor([[99, -1, -1], [3, -1, -1]]))
    out = swap_in(bad, host_kv, device_kv, t([[5, 6, 7], [50, 1, 2]]))
    assert (out == -1).all()


def test_argument_errors_name_the_argument():
    tok, age = empty_state(2, 4)
    with pytest.raises(ValueError, match="raw"):
        plan(t([1, 2]), t([3, 3]), host(2, 4), tok, age)
    with pytest.raises(ValueError, match="slot_age"):
        plan(t([[1], [2]]), t([3, 3]), host(2, 4), tok, age[:, :2])
    with pytest.raises(ValueError, match="row_to_batch"):
        plan(t([[1], [2], [3]]), t([3, 3]), host(2, 4), tok, age)
    with pytest.raises(ValueError, match="seq_lens"):
        plan(t([[1], [2]]), t([3]), host(2, 4), tok, age)
    with pytest.raises(ValueError, match="host_loc"):
        plan(t([[1], [2]]), t([3, 3]), torch.zeros(2, 4), tok, age)


def test_the_public_ops_name_a_host_rows_past_int64_and_a_host_kv_of_no_dimension():
    """host_rows at 2**63 made every row look off the host (2**64: a bare OverflowError); a 0-d host_kv beside a 1-d
    device_kv passed the row check (both rows shaped ()) and failed inside the backend with an IndexError."""
    import indexcache

    tok, age = empty_state(1, 2)
    for host_rows in (2**63, 2**64):
        with pytest.raises(ValueError, match=r"^host_rows: expected an int in \[0, 9223372036854775807\] \(host rows"):
            indexcache.hisparse_plan(t([[1, 2]]), t([10]), host(1, 10), tok, age, host_rows=host_rows,
                                     backend="torch")
    assert indexcache.hisparse_plan(t([[1, 2]]), t([10]), host(1, 10), tok, age, host_rows=2**63 - 1,
                                    backend="torch").slots.tolist() == [[0, 1]]
    copy = (torch.tensor([[0]]), t([[0]]), t([1]))
    with pytest.raises(TypeError, match="^host_kv: expected a torch.Tensor of at least one dimension"):
        indexcache.hisparse_swap_in(*copy, torch.tensor(5.0), torch.zeros(3), t([[0, 1]]), backend="torch")


# ---- many steps: the engine's duties simulated, the device must hold what the plan says ----------------------------

def _simulate(seed: int, batches: int, hot: int, k: int, steps: int, rows_per_request: int, start_max: int) -> None:
    """Each request grows by 0-2 tokens a step. The engine's duties: a token produced while seq_len <= H is written at
    its own slot; the newest token of a longer request at slot H; every token is on the host. After plan and swap-in,
    every placed position must read its own token's KV, and with at most H distinct tokens a request every valid
    position is placed."""
    rng = random.Random(seed)
    hl = host(batches, 1000, base=0)  # host row = 1000 b + t, the token's KV value too
    host_kv = torch.zeros(int(hl.max()) + 1, 2, dtype=torch.float64)
    host_kv[hl.flatten()] = hl.flatten().double()[:, None]
    device_loc = torch.arange(batches * (hot + 1), dtype=I32).view(batches, hot + 1)
    device_kv = torch.full((batches * (hot + 1), 2), -1.0, dtype=torch.float64)
    tok, age = empty_state(batches, hot)
    seq = [rng.randint(1, start_max) for _ in range(batches)]
    for b, n in enumerate(seq):  # prefill: a short request's tokens at their own slots, a long one's newest at H
        if n <= hot:
            device_kv[device_loc[b, :n].long()] = host_kv[hl[b, :n]]
        else:
            device_kv[device_loc[b, hot]] = host_kv[hl[b, n - 1]]
    r2b = t([b for b in range(batches) for _ in range(rows_per_request)])
    for _ in range(steps):
        grow = [rng.randint(0, 2) for _ in range(batches)]
        for b in range(batches):
            for n in range(seq[b] + 1, seq[b] + grow[b] + 1):  # decode writes
                slot = n - 1 if n <= hot else hot
                device_kv[device_loc[b, slot]] = host_kv[hl[b, n - 1]]
            seq[b] += grow[b]
        raw = []
        for b in range(batches):
            recent = list(range(max(0, seq[b] - 3 * hot), seq[b]))  # a working set that drifts
            for _ in range(rows_per_request):
                raw.append([rng.choice(recent) if rng.random() < 0.85 else rng.choice([-1, seq[b], seq[b] + 7])
                            for _ in range(k)])
        raw = t(raw)
        p = plan(raw, t(seq), hl, tok, age, row_to_batch=r2b)
        device_kv = swap_in(p, host_kv, device_kv, device_loc, row_to_batch=r2b)
        tok, age = p.slot_token, p.slot_age
        rows = hisparse.device_rows(p.slots, device_loc, row_to_batch=r2b)
        for r in range(raw.shape[0]):
            b = int(r2b[r])
            valid = [(j, int(x)) for j, x in enumerate(raw[r].tolist()) if 0 <= x < seq[b]]
            distinct = {x for rr in range(raw.shape[0]) if int(r2b[rr]) == b for x in raw[rr].tolist()
                        if 0 <= x < seq[b] - (1 if seq[b] > hot else 0)}
            for j, x in valid:
                if len(distinct) <= hot:
                    assert int(p.slots[r, j]) >= 0, (r, j, x)
                if int(rows[r, j]) >= 0:
                    assert device_kv[int(rows[r, j])].tolist() == [float(hl[b, x])] * 2, (r, j, x)
            for j in set(range(k)) - {j for j, _ in valid}:
                assert int(p.slots[r, j]) == EMPTY


@pytest.mark.parametrize("seed, batches, hot, k, steps, rows, start_max", [
    (0, 3, 8, 4, 60, 1, 12),      # requests crossing H, then evicting
    (1, 2, 16, 6, 40, 2, 40),     # two rows a request (next_n 2), long prefills
    (2, 4, 4, 4, 50, 1, 3),       # k == H, every step near overflow
    (3, 2, 6, 5, 40, 3, 10),      # three rows of 5 over 6 slots: overflow steps
])
def test_many_steps_the_device_holds_what_the_plan_says(seed, batches, hot, k, steps, rows, start_max):
    _simulate(seed, batches, hot, k, steps, rows, start_max)


# ---- invariants on random inputs ------------------------------------------------------------------------------------

@st.composite
def _steps(draw):
    batches, hot = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    rows, k = draw(st.integers(0, 5)), draw(st.integers(0, 6))
    length = draw(st.integers(0, 14))
    small = st.integers(-3, 16)
    raw = t(draw(st.lists(st.lists(small, min_size=k, max_size=k), min_size=rows, max_size=rows)) or [[]] * rows)
    raw = raw.view(rows, k)
    seq = t(draw(st.lists(st.integers(-1, 14), min_size=batches, max_size=batches)))
    hl = torch.tensor(draw(st.lists(st.lists(st.integers(-2, 40), min_size=length, max_size=length),
                                    min_size=batches, max_size=batches)), dtype=torch.int64).view(batches, length)
    tok = t(draw(st.lists(st.lists(small, min_size=hot, max_size=hot), min_size=batches, max_size=batches)))
    age = t(draw(st.lists(st.lists(st.integers(-1, 9), min_size=hot, max_size=hot), min_size=batches,
                          max_size=batches)))
    r2b = t(draw(st.lists(st.integers(-1, batches), min_size=rows, max_size=rows))).view(rows)
    return raw, seq, hl, tok, age, r2b, draw(st.sampled_from([None, 30]))


@settings(max_examples=300, deadline=None)
@given(_steps())
def test_every_placed_token_is_in_its_slot_and_no_token_is_in_two(case):
    raw, seq, hl, tok, age, r2b, host_rows = case
    p = plan(raw, seq, hl, tok, age, row_to_batch=r2b, host_rows=host_rows)
    batches, hot = tok.shape
    for b in range(batches):
        own = [r for r in range(raw.shape[0]) if int(r2b[r]) == b]
        if not own:
            assert torch.equal(p.slot_token[b], tok[b]) and torch.equal(p.slot_age[b], age[b])
            continue
        n = int(seq[b])
        held = [x for x in p.slot_token[b].tolist() if x != EMPTY]
        assert len(held) == len(set(held)), "a token in two slots"
        assert all(0 <= x < max(n - (1 if n > hot else 0), 0) for x in held)
        now = min(int(age[b].max()) + 1, hisparse.AGE_MAX)
        used = set()
        for r in own:
            for j, x in enumerate(raw[r].tolist()):
                s = int(p.slots[r, j])
                if not 0 <= x < n:
                    assert s == EMPTY
                elif s == hot:
                    assert n > hot and x == n - 1
                elif s >= 0:
                    assert int(p.slot_token[b, s]) == x and (n > hot or s == x)
                    used.add(s)
        for s in range(hot):  # ages: now where selected, unchanged elsewhere
            assert int(p.slot_age[b, s]) == (now if s in used else int(age[b, s]))
        # copies: to the slots of their tokens, from those tokens' host rows, each slot once, only past H
        dst = [(int(p.copy_dst[r, i]), int(p.copy_src[r, i])) for r in own for i in range(int(p.copy_count[r]))]
        assert len({d for d, _ in dst}) == len(dst) and (n > hot or not dst)
        for d, src in dst:
            x = int(p.slot_token[b, d])
            assert x >= 0 and src == int(hl[b, x]) and src >= 0 and (host_rows is None or src < host_rows)
        # hits keep their slot (the lowest slot holding a token it can hold before: below the newest and below
        # max(L, H)) and cost no copy
        before: dict[int, int] = {}
        for s_, x in enumerate(tok[b].tolist()):
            if n > hot and 0 <= x < min(n - 1, max(hl.shape[1], hot)):
                before.setdefault(x, s_)
        assert all(int(p.slot_token[b, d]) not in before for d, _ in dst)
        for r in own:
            for j, x in enumerate(raw[r].tolist()):
                if x in before:
                    assert int(p.slots[r, j]) == before[x]
    for r in range(raw.shape[0]):
        if not 0 <= int(r2b[r]) < batches:
            assert (p.slots[r] == EMPTY).all() and int(p.copy_count[r]) == 0


def test_check_words_name_each_slot_s_token_and_no_live_token_in_a_constant_fill():
    tokens = torch.randint(-1, 1 << 17, (3, 4096), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    words = check_words(tokens)
    assert words.dtype == torch.int32 and words.shape == tokens.shape
    moved = tokens.clone()
    moved[1, 7] += 1
    assert (check_words(moved) != words).nonzero().tolist() == [[1, 7]]
    # a fill of -1 or of zeros is the check word of no token in [0, 128K) at any of the first 4,096 slots
    for fill in (-1, 0):
        assert not (words[tokens >= 0] == fill).any()
    mix = check_words(torch.zeros(1, 4096, dtype=torch.int32))
    assert (mix >= 1 << 17).all() and torch.equal(check_words(torch.full((1, 4096), -1)), ~mix)
    assert index_width(4096, 131072) == 4096 + 131072 and index_width(64, 10) == 128
