"""Context-parallel top-k on 2 and 4 gloo ranks (forked by the tests) against the single-rank reference.

Every rank builds the same global scores from a seed, keeps its shard, runs ``cp_topk`` and checks the
answer against ``reference.topk`` on the whole scores. A failing rank raises, which fails the test. The
small model's context-parallel prefill (``bench/cp_model_gpu.py``'s check) runs the same way on 2 ranks.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from indexcache.hal import reference
from indexcache.runtime.distributed import cp_topk, cp_topk_translate, zigzag_key_index
from indexcache.tools.model import preset

I32 = torch.int32


def _spawn(world: int, tmp_path, check) -> None:
    """Run ``check(rank, world)`` on ``world`` forked gloo ranks; any rank's exception fails the caller."""
    mp.start_processes(_rank_main, args=(world, str(tmp_path / "store"), check), nprocs=world, start_method="fork")


def _rank_main(rank: int, world: int, store: str, check) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        check(rank, world)
    finally:
        dist.destroy_process_group()


def _layouts(num_keys: int, world: int, rank: int, gen: torch.Generator):
    """(name, key_offset, local column indices) for this rank under every sharding the tests use."""
    even = [num_keys * i // world for i in range(world + 1)]
    # Uneven contiguous cuts: rank 0 holds no keys, and with 4 ranks rank 2 neither.
    cuts = sorted(torch.randint(0, num_keys + 1, (world - 2,), generator=gen).tolist())
    uneven = [0, 0, *cuts, num_keys]
    if world > 2:
        uneven[3] = uneven[2]
    for name, bounds in (("even", even), ("uneven", uneven)):
        lo, hi = bounds[rank], bounds[rank + 1]
        yield name, lo, torch.arange(lo, hi)
    zigzag = zigzag_key_index(num_keys, world, rank)
    yield "zigzag", zigzag, zigzag.long()


def _case_scores(kind: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(rows, cols, generator=gen)
    if kind == "ties":  # three values only, and one constant row: ties straddle every shard boundary
        s = torch.randint(0, 3, (rows, cols), generator=gen).float()
        s[0] = 1.0
        return s
    if kind == "nonfinite":  # -inf and NaN mixed in, -0.0 beside +0.0, and one row with no finite score
        s = torch.randint(-2, 3, (rows, cols), generator=gen).float()
        u = torch.rand(rows, cols, generator=gen)
        s = torch.where(u < 0.3, float("-inf"), s)
        s = torch.where(u > 0.85, float("nan"), s)
        s = torch.where((u > 0.7) & (u < 0.78), -0.0, s)
        s[1, ::2] = float("nan")
        s[1, 1::2] = float("-inf")
        s[2, 5::7] = float("inf")
        return s
    raise ValueError(kind)


def _lengths(rows: int, num_keys: int, k: int, gen: torch.Generator, past_end: int = 0) -> torch.Tensor:
    """Lengths covering negative, zero, ≤ k, just over k and full rows (and ``past_end`` beyond N)."""
    fixed = [min(n, num_keys + past_end) for n in (-3, 0, 1, k, k + 1, num_keys + past_end)]
    rand = torch.randint(-2, num_keys + past_end + 1, (rows - len(fixed),), generator=gen).tolist()
    return torch.tensor(fixed + rand, dtype=I32)


def _check_topk(rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(1234 + world)
    rows = 14
    for kind, num_keys, k, dtype in (("random", 97, 8, torch.float32), ("ties", 61, 5, torch.float32),
                                     ("nonfinite", 53, 6, torch.float32), ("ties", 40, 7, torch.bfloat16),
                                     ("random", 37, 45, torch.float32), ("random", 3, 4, torch.float16)):
        scores = _case_scores(kind, rows, num_keys, gen).to(dtype)
        lengths = _lengths(rows, num_keys, k, gen)
        want = reference.topk(scores, lengths, k)
        for name, key_offset, cols in _layouts(num_keys, world, rank, gen):
            # A contiguous shard is a strided view of the global scores; a zigzag one a gathered copy.
            local = scores[:, cols] if isinstance(key_offset, torch.Tensor) else scores.narrow(1, key_offset, len(cols))
            got = cp_topk(local, key_offset, lengths, k)
            assert got.dtype == I32 and got.shape == (rows, k)
            assert torch.equal(got, want), f"{kind} {dtype} N={num_keys} k={k} {name} rank {rank}:\n{got}\n{want}"

        # Windows: row starts, lengths running past the global axis (clipped through num_keys), preallocated out.
        starts = torch.randint(-2, num_keys + 2, (rows,), generator=gen, dtype=I32)
        lengths = _lengths(rows, num_keys, k, gen, past_end=5)
        want = reference.topk(scores, lengths, k, row_starts=starts)
        for name, key_offset, cols in _layouts(num_keys, world, rank, gen):
            out = torch.full((rows, k), 77, dtype=I32)
            got = cp_topk(scores[:, cols].contiguous(), key_offset, lengths, k, row_starts=starts,
                          num_keys=num_keys, out=out)
            assert got is out
            assert torch.equal(out, want), f"window {kind} N={num_keys} k={k} {name} rank {rank}:\n{out}\n{want}"

    # k = 0 and no rows: nothing to gather, correct shapes.
    assert cp_topk(torch.zeros(3, 4), 4 * rank, torch.full((3,), 8, dtype=I32), 0).shape == (3, 0)
    assert cp_topk(torch.zeros(0, 4), 4 * rank, torch.zeros(0, dtype=I32), 5).shape == (0, 5)


def _check_translate(rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(99 + world)
    rows, num_keys, k, page_size = 10, 70, 6, 4
    scores = _case_scores("ties", rows, num_keys, gen)
    lengths = _lengths(rows, num_keys, k, gen)
    row_to_batch = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1, 5, -1], dtype=I32)  # 5 and -1: out of range
    pages = math.ceil(num_keys / page_size)
    page_table = torch.randperm(3 * pages, generator=gen).view(3, pages).to(I32)
    page_table[1, 3] = -1
    want_phys, want_raw = reference.topk_translate(scores, lengths, k, page_table, page_size,
                                                   row_to_batch=row_to_batch)
    for name, key_offset, cols in _layouts(num_keys, world, rank, gen):
        out, out_raw = torch.empty(rows, k, dtype=I32), torch.empty(rows, k, dtype=I32)
        got = cp_topk_translate(scores[:, cols].contiguous(), key_offset, lengths, k, page_table, page_size,
                                row_to_batch=row_to_batch, out=out, out_raw=out_raw)
        assert got is out
        assert torch.equal(out_raw, want_raw), f"raw {name} rank {rank}:\n{out_raw}\n{want_raw}"
        assert torch.equal(out, want_phys), f"physical {name} rank {rank}:\n{out}\n{want_phys}"


@pytest.mark.parametrize("world", [2, 4])
def test_cp_topk_equals_single_rank_topk(world, tmp_path):
    _spawn(world, tmp_path, _check_topk)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_topk_translate_equals_single_rank(world, tmp_path):
    _spawn(world, tmp_path, _check_translate)


def _check_model_prefill(rank: int, world: int, layout: str) -> None:
    path = Path(__file__).resolve().parents[1] / "bench" / "cp_model_gpu.py"
    spec = importlib.util.spec_from_file_location("cp_model_gpu", path)
    script = sys.modules["cp_model_gpu"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(script)
    config = preset("v32-like", num_layers=6, hidden=64, heads=2, head_dim=32, index_heads=2, topk=16, page_size=8,
                    vocab=64, window=16)
    # k = 16: below the two longer prompts, above the short one; plan FFSFSF (producers and shared layers).
    result, _, cp = script.check(rank, world, config, (48, 30, 9), 2, torch.device("cpu"), layout=layout)
    assert result["layout"] == layout and result["plan"] == "FFSFSF" and result["producers"] == [0, 1, 3, 5]
    assert isinstance(cp.model.key_offset, torch.Tensor) == (layout == "zigzag")
    assert result["sets_equal"], f"rank {rank}: mismatched rows by producer {result['mismatched_rows']}"
    assert result["logits_close"], f"rank {rank}: max abs diff {result['max_abs_diff']}"


@pytest.mark.skipif(not dist.is_gloo_available() or "fork" not in mp.get_all_start_methods(),
                    reason="needs torch.distributed with gloo and forked processes")
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_cp_model_prefill_equals_single_device(tmp_path, layout):
    _spawn(2, tmp_path, functools.partial(_check_model_prefill, layout=layout))


@pytest.mark.parametrize(("num_keys", "world"), [(100, 3), (5, 4), (0, 2), (8, 1)])
def test_zigzag_key_index_covers_every_key_once_balanced(num_keys, world):
    shards = [zigzag_key_index(num_keys, world, r) for r in range(world)]
    assert all(s.dtype == I32 and bool((s[1:] > s[:-1]).all()) for s in shards)
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(num_keys, dtype=I32))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 2
    if num_keys >= 2 * world:  # rank 0 holds the first and the last chunk
        assert int(shards[0][0]) == 0 and int(shards[0][-1]) == num_keys - 1


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(local_scores=torch.zeros(2, 3, dtype=torch.float64)), TypeError, "local_scores"),
    (dict(lengths=torch.zeros(2, dtype=torch.int64)), TypeError, "lengths"),
    (dict(lengths=torch.zeros(3, dtype=I32)), ValueError, "lengths"),
    (dict(k=-1), ValueError, "k"),
    (dict(k=2**16 + 1), ValueError, "MAX_TOPK"),  # checked by every rank, also one holding no keys
    (dict(key_offset=-1), ValueError, "key_offset"),
    (dict(key_offset=2**31 - 2), ValueError, "key_offset"),
    (dict(key_offset=1.0), TypeError, "key_offset"),
    (dict(key_offset=torch.arange(4, dtype=I32)), ValueError, "key_offset"),
    (dict(row_starts=torch.zeros(2, dtype=torch.int64)), TypeError, "row_starts"),
    (dict(num_keys=-1), ValueError, "num_keys"),
    (dict(out=torch.zeros(2, 3, dtype=I32)), ValueError, "out"),
    (dict(timeout=0.0), ValueError, "timeout"),
    (dict(timeout="60"), TypeError, "timeout"),
    # None or 0 skipped the check on this rank while its peers ran it (their collectives then do not match).
    (dict(check_agreement=None), TypeError, "check_agreement: expected a bool, got NoneType None"),
    (dict(check_agreement=0), TypeError, "check_agreement: expected a bool, got int 0"),
])
def test_cp_topk_rejects_bad_arguments_before_communicating(kwargs, error, match):
    # No process group exists here, so no agreement check runs: the rank's own checks raise, before any all-gather
    # (one that ran after it would fail differently). With a group, tests/adversarial/test_probe_distributed.py.
    args = dict(local_scores=torch.zeros(2, 3), key_offset=0, lengths=torch.zeros(2, dtype=I32), k=2)
    with pytest.raises(error, match=match):
        cp_topk(**{**args, **kwargs})


def test_cp_topk_translate_rejects_bad_page_table_before_communicating():
    with pytest.raises(TypeError, match="page_table"):
        cp_topk_translate(torch.zeros(2, 3), 0, torch.zeros(2, dtype=I32), 2, torch.zeros(2, 2), 4)


def test_key_counts_past_int32_are_refused_and_a_large_world_costs_nothing():
    """num_keys past int32 wrapped zigzag_key_index's indices negative, and passed cp_topk's check only to fail in
    the ranks' agreement (a peer then waited out the timeout); a world of 2**29 ranks built a list of 2**30 bounds."""
    with pytest.raises(ValueError, match=r"^num_keys: expected an int in \[0, 2147483648\] \(the keys' global "):
        zigzag_key_index(3 * 2**30, 2**20, 0)
    assert zigzag_key_index(2**31, 2**20, 0)[-1] == 2**31 - 1  # the last chunk of 1024 keys
    assert zigzag_key_index(10, 2**29, 5).numel() == 0
    scores, lengths = torch.randn(2, 8), torch.tensor([8, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^num_keys: expected an int in \[0, 2147483648\]"):
        cp_topk(scores, 0, lengths, 4, num_keys=2**70)
