"""Issue 21 item 2: ``cp_topk`` when the ranks disagree on ``k``, the row count or whether to run at all.

Two forked gloo ranks on CPU, as in ``tests/test_distributed.py``. Every rank must raise a clear error within
seconds (no hang, no gloo abort, no garbage indices), and the group must still work afterwards. Each test is
bounded twice: the process group times out after ``PG_TIMEOUT`` seconds and the parent kills ranks still
running after ``LIMIT`` seconds, so a regression fails fast instead of blocking for gloo's 30 minutes.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from indexcache.hal import reference
from indexcache.hal.dispatch import UnknownBackendError
from indexcache.runtime.distributed import cp_topk, cp_topk_translate

I32 = torch.int32
WORLD = 2
NUM_KEYS = 40
PG_TIMEOUT = 15.0  # seconds; gloo's own bound on a collective a peer never joins
LIMIT = 60.0  # seconds the parent waits for all ranks of one test
PROMPT = 10.0  # seconds within which a rank must have raised


def _spawn(tmp_path, check) -> None:
    """Run ``check(rank)`` on two forked gloo ranks; a rank's exception, or ranks still running after
    ``LIMIT`` seconds (then killed), fail the caller."""
    ctx = mp.start_processes(_rank_main, args=(str(tmp_path / "store"), check), nprocs=WORLD, start_method="fork",
                             join=False)
    deadline = time.monotonic() + LIMIT
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"ranks still running after {LIMIT} s (hung in a collective)")


def _rank_main(rank: int, store: str, check) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    try:
        check(rank)
    except pytest.fail.Exception as exc:  # a BaseException, which the parent would report as a bare exit code
        raise AssertionError(f"rank {rank}: {exc}") from None
    finally:
        dist.destroy_process_group()


def _global(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded global scores ``[rows, NUM_KEYS]`` and lengths ``[rows]``, the same on every rank."""
    gen = torch.Generator().manual_seed(rows)
    return torch.randn(rows, NUM_KEYS, generator=gen), torch.randint(0, NUM_KEYS + 1, (rows,), generator=gen, dtype=I32)


def _args(rank: int, rows: int = 6, k: int = 4, **kwargs) -> dict:
    """This rank's ``cp_topk`` arguments: its contiguous shard of :func:`_global`'s scores."""
    scores, lengths = _global(rows)
    lo, hi = NUM_KEYS * rank // WORLD, NUM_KEYS * (rank + 1) // WORLD
    return dict(local_scores=scores[:, lo:hi], key_offset=lo, lengths=lengths, k=k, **kwargs)


def _group_still_works(rank: int) -> None:
    """After the error every rank's collectives are still in step: an agreeing call equals single-rank topk."""
    got = cp_topk(**_args(rank))
    assert torch.equal(got, reference.topk(*_global(6), 4)), f"rank {rank}: {got}"


def _raises_promptly(error, match: str, call) -> None:
    began = time.monotonic()
    with pytest.raises(error, match=match):
        call()
    assert time.monotonic() - began < PROMPT, f"raised only after {time.monotonic() - began:.1f} s"


# What each rank passes, and the error every rank must raise.
DISAGREEMENTS = {
    "k": (lambda rank: _args(rank, k=4 + rank), "k: rank 0 has 4, rank 1 has 5"),
    "rows": (lambda rank: _args(rank, rows=6 - rank), "rows: rank 0 has 6, rank 1 has 5"),
    "k = 0 on one rank": (lambda rank: _args(rank, k=0 if rank == 0 else 3), "k: rank 0 has 0, rank 1 has 3"),
    "no rows on one rank": (lambda rank: _args(rank, rows=0 if rank == 1 else 6), "rows: rank 0 has 6, rank 1 has 0"),
    "num_keys": (lambda rank: _args(rank, num_keys=None if rank == 0 else NUM_KEYS),
                 f"num_keys: rank 0 has -1, rank 1 has {NUM_KEYS}"),
    "row_starts": (lambda rank: _args(rank, row_starts=torch.zeros(6, dtype=I32) if rank == 1 else None),
                   "row_starts given: rank 0 has 0, rank 1 has 1"),
}


def _check_disagreement(case: str, rank: int) -> None:
    args, match = DISAGREEMENTS[case]
    _raises_promptly(ValueError, "ranks disagree.*" + match, lambda: cp_topk(**args(rank)))
    _group_still_works(rank)


@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_ranks_that_disagree_all_raise_value_error(case, tmp_path):
    """issue 21 item 2: ranks disagreeing on k, the row count, num_keys or row_starts (also k = 0 or no rows on one
    rank, which used to return early and leave its peer blocked) all raise a ValueError naming each rank's value,
    within seconds; nobody hangs, aborts in gloo or returns garbage, and the group still works afterwards."""
    _spawn(tmp_path, functools.partial(_check_disagreement, case))


def _bad_scores(rank: int) -> tuple[Callable[[], torch.Tensor], type[Exception], str]:
    """(the call, the error and message rank 1 raises): rank 1's local scores are float64."""
    args = _args(rank)
    if rank == 1:
        args["local_scores"] = args["local_scores"].double()
    return (lambda: cp_topk(**args)), TypeError, "local_scores"


def _bad_page_table(rank: int) -> tuple[Callable[[], torch.Tensor], type[Exception], str]:
    """Rank 1's page table is int64: only ``cp_topk_translate``'s own check rejects it."""
    page_table = torch.arange(NUM_KEYS, dtype=torch.int64 if rank == 1 else I32).view(1, NUM_KEYS)
    args = _args(rank)
    return (lambda: cp_topk_translate(**args, page_table=page_table, page_size=1)), TypeError, "page_table"


def _bad_backend(rank: int) -> tuple[Callable[[], torch.Tensor], type[Exception], str]:
    """Both ranks name a backend no module registers, and rank 0 holds no keys: it runs no local top-k, so only
    rank 1's check of the backend (before the all-gather) can reject it; rank 0 used to wait in the all-gather."""
    args = _args(rank, backend="nonesuch")
    if rank == 0:
        args["local_scores"] = args["local_scores"][:, :0]
    return (lambda: cp_topk(**args)), UnknownBackendError, "backend: expected one of .*got 'nonesuch'"


def _check_rejected(case, rank: int) -> None:
    call, error, match = case(rank)
    if rank == 1:  # the rank whose argument is wrong raises its own error
        _raises_promptly(error, match, call)
    else:
        _raises_promptly(ValueError, "rank 1 of 2 rejected its arguments", call)
    _group_still_works(rank)


@pytest.mark.parametrize("case", [_bad_scores, _bad_page_table, _bad_backend],
                         ids=["cp_topk dtype", "cp_topk_translate page_table", "backend, peer holding no keys"])
def test_one_rank_rejecting_its_arguments_fails_every_rank(case, tmp_path):
    """issue 21 item 2: a validation error on one rank (wrong dtype, a backend that cannot run the rank's top-k)
    used to leave its peer blocked in the all-gather; now that rank raises its own error and the other a ValueError
    naming it, within seconds."""
    _spawn(tmp_path, functools.partial(_check_rejected, case))


def _check_absent_peer(rank: int) -> None:
    if rank == 1:  # never calls cp_topk: stays out of every collective until rank 0 has given up
        time.sleep(3.0)
        return
    _raises_promptly(RuntimeError, "did not finish within 1 s", lambda: cp_topk(**_args(rank), timeout=1.0))


def _check_absent_peer_bad_arguments(rank: int) -> None:
    if rank == 1:  # never calls cp_topk; its exit (which ends rank 0's wait too) comes after rank 0's bound
        time.sleep(5.0)
        return
    args = _args(rank, timeout=1.0)
    args["local_scores"] = args["local_scores"].double()
    began = time.monotonic()
    with pytest.raises(TypeError, match="local_scores"):
        cp_topk(**args)
    assert time.monotonic() - began < 4.0, f"raised only after {time.monotonic() - began:.1f} s"


def test_rank_rejecting_its_arguments_waits_for_an_absent_peer_only_timeout(tmp_path):
    """A rank whose own arguments fail its check still tells its peers, waiting for them at most the ``timeout``
    it was given (1 s here; it waited the default 60 s), then raises its own error."""
    _spawn(tmp_path, _check_absent_peer_bad_arguments)


def test_peer_that_never_calls_is_bounded_by_timeout(tmp_path):
    """issue 21 item 2: a peer that never arrives blocks a rank for ``timeout`` (here 1 s), not for the
    process group's timeout (30 minutes by default): the rank raises a RuntimeError saying so."""
    _spawn(tmp_path, _check_absent_peer)


def _check_agreeing(rank: int) -> None:
    want = reference.topk(*_global(6), 4)
    for kwargs in (dict(timeout=datetime.timedelta(seconds=5)), dict(timeout=5.0), dict(check_agreement=False)):
        got = cp_topk(**_args(rank), **kwargs)
        assert torch.equal(got, want), f"rank {rank} {kwargs}: {got}"
    # k = 0 and no rows agree too: they pass the check on every rank and return the empty answer.
    assert cp_topk(**_args(rank, k=0), timeout=5.0).shape == (6, 0)
    assert cp_topk(**_args(rank, rows=0), timeout=5.0).shape == (0, 4)


def test_agreeing_ranks_still_equal_single_rank_topk(tmp_path):
    """issue 21 item 2: with the agreement check (either timeout form) and without it, agreeing ranks get
    exactly single-rank ``reference.topk``; k = 0 and zero rows still return the empty answer."""
    _spawn(tmp_path, _check_agreeing)
