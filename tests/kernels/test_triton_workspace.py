"""The Triton ops' workspace (docs/ops.md, "Workspace"), interpreted on the CPU: threads calling topk,
topk_translate and paged_topk_translate at once get exactly their single-thread results (each thread has its own
kept workspace); a caller's ``workspace=`` gives the same results, is checked against what the call takes, and
``indexcache.workspace_bytes`` says what that is; a kept eager call is bound to its thread's workspace."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import pytest
import torch

import indexcache
from indexcache.hal import dispatch, memo
from indexcache.hal.layout import new_packed_cache

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks; tests/test_workspace.py and "
                                                                   "bench/streams_race_gpu.py are for GPUs"),
              pytest.mark.usefixtures("interpreted", "one_thread")]

I32 = torch.int32
PAGE = 64
THREADS = 3


def _paged(gen: torch.Generator, batch: int, next_n: int, ctx: int) -> dict:
    """paged_topk_translate's inputs: a cache of ``ctx`` keys a request, ``max_context_len = ctx``, k 16."""
    pages, dim, heads = -(-ctx // PAGE), 32, 2
    cache = new_packed_cache(num_pages=batch * pages, page_size=PAGE, dim=dim)
    slots = torch.arange(batch * pages * PAGE, dtype=I32)
    indexcache.store_index_k(torch.randn(slots.numel(), dim, generator=gen), cache, slots, backend="torch")
    return dict(q=torch.randn(batch, next_n, heads, dim, generator=gen).to(torch.float8_e4m3fn), k_cache=cache,
                weights=torch.rand(batch * next_n, heads, generator=gen),
                context_lens=torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen, dtype=I32),
                block_table=torch.randperm(batch * pages, generator=gen).to(I32).view(batch, pages),
                max_context_len=ctx, k=16, page_table=torch.randint(0, 500, (batch, pages), generator=gen, dtype=I32),
                page_size=PAGE)


@dataclass(frozen=True)
class Call:
    """A call of ``indexcache.<op>(**args, backend="cuda")`` writing given outputs (so kept from its second call),
    and the names of its outputs."""

    op: str
    args: dict
    outputs: tuple[str, ...]

    def __call__(self, **extra) -> list[torch.Tensor]:
        getattr(indexcache, self.op)(**self.args, **extra, backend="cuda")
        return [self.args[name].clone() for name in self.outputs]


def _calls(seed: int) -> dict[str, Call]:
    """One thread's calls. Shapes as the interpreted cuda backend takes them: a row of 4200 columns is split into
    chunks, rows of 600 run the fused kernel; paged_topk_translate with two draft tokens and with one."""
    gen = torch.Generator().manual_seed(seed)
    long_row, short_rows = torch.randn(1, 4200, generator=gen), torch.randn(2, 600, generator=gen)
    long_len, short_len = torch.tensor([4100], dtype=I32), torch.tensor([600, 450], dtype=I32)
    table = torch.randint(0, 500, (2, 70), generator=gen, dtype=I32)

    def outputs(rows: int, k: int) -> dict:
        return dict(out=torch.empty(rows, k, dtype=I32), out_raw=torch.empty(rows, k, dtype=I32))

    def topk(scores, lengths, k):
        return Call("topk", dict(scores=scores, lengths=lengths, k=k, out=torch.empty(scores.shape[0], k, dtype=I32)),
                    ("out",))

    def translate(scores, lengths, k):
        return Call("topk_translate", dict(scores=scores, lengths=lengths, k=k, page_table=table[:scores.shape[0]],
                                           page_size=PAGE, **outputs(scores.shape[0], k)), ("out", "out_raw"))

    def paged(args):
        rows = args["q"].shape[0] * args["q"].shape[1]
        return Call("paged_topk_translate", dict(args, logits=torch.empty(rows, args["max_context_len"]),
                                                 **outputs(rows, args["k"])), ("logits", "out", "out_raw"))

    return {"topk split": topk(long_row, long_len, 64), "topk fused": topk(short_rows, short_len, 32),
            "topk_translate split": translate(long_row, long_len, 64),
            "topk_translate fused": translate(short_rows, short_len, 32),
            "paged_topk_translate next_n 2": paged(_paged(gen, 1, 2, 600)),
            "paged_topk_translate next_n 1": paged(_paged(gen, 2, 1, 600))}


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_threads_get_their_single_thread_results():
    """Three threads, each with its own inputs of the same shapes (so of the same workspace sizes), call every op
    twice at once (thread switches made frequent); every result equals, exactly, that of the same call made alone."""
    dispatch.reset()
    calls = [_calls(seed) for seed in range(THREADS)]
    want = [{name: call() for name, call in mine.items()} for mine in calls]
    wrong: list[str] = []
    start = threading.Barrier(THREADS)

    def work(i: int) -> None:
        start.wait()
        try:
            for round_ in range(2):
                for name, call in calls[i].items():
                    if not _same(call(), want[i][name]):
                        wrong.append(f"thread {i}, round {round_}: {name}")
        except Exception as exc:  # noqa: BLE001  (reported below, with the thread it came from)
            wrong.append(f"thread {i}: {type(exc).__name__}: {exc}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, wrong


def test_a_kept_call_is_bound_to_its_threads_workspace():
    """The same call with the same buffers from another thread (after the first, not at once) is not the first
    thread's kept call: its signature holds the calling thread (and stream), so it binds launches of its own."""
    dispatch.reset()
    call = _calls(7)["topk split"]
    want = call()  # noted
    assert _same(call(), want) and memo.size() == 1  # kept, bound to this thread's workspace
    got: list[list[torch.Tensor]] = []
    other = threading.Thread(target=lambda: got.extend([call(), call(), call()]))
    other.start()
    other.join()
    assert memo.size() == 2, "the other thread ran the first thread's kept launches"
    assert len(got) == 3 and all(_same(g, want) for g in got)


@pytest.mark.parametrize("name", ["topk split", "topk fused", "topk_translate split", "paged_topk_translate next_n 2"])
def test_a_callers_workspace_of_workspace_bytes_gives_the_default_results(name):
    """``workspace=`` of exactly ``indexcache.workspace_bytes(op, ...)`` bytes (the call's arguments): the results
    of the default workspace, from the checked call and from the kept one (third call); no byte outside it written."""
    dispatch.reset()
    call = _calls(11)[name]
    want = call()
    need = indexcache.workspace_bytes(call.op, **call.args, backend="cuda")
    assert need > 0
    guard = 64
    buf = torch.full((need + 2 * guard,), 0xA5, dtype=torch.uint8)
    for _ in range(3):
        assert _same(call(workspace=buf[guard:guard + need]), want)
    assert (buf[:guard] == 0xA5).all() and (buf[-guard:] == 0xA5).all(), "a kernel wrote outside the workspace"


def test_a_workspace_too_small_is_refused_naming_the_bytes():
    gen = torch.Generator().manual_seed(0)
    scores, lengths = torch.randn(1, 4200, generator=gen), torch.tensor([4200], dtype=I32)
    need = indexcache.workspace_bytes("topk", scores, lengths, 64, backend="cuda")
    # The split row's candidates (keys and positions: two words a column of each chunk) take most of it.
    assert need >= 2 * 4 * 4200
    small = torch.empty(need - 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"workspace: expected at least {need} bytes .*'cuda'.*, got {need - 4}$"):
        indexcache.topk(scores, lengths, 64, workspace=small, backend="cuda")
    assert indexcache.workspace_bytes("topk", scores, lengths, 0, backend="cuda") == 0  # k 0: nothing to select
    assert indexcache.workspace_bytes("topk", scores[:0], lengths[:0], 64, backend="cuda") == 0
