"""The Triton top-k and fused top-k + translation of the cuda and rocm backends, interpreted on the CPU.

Every row is compared with :mod:`indexcache.hal.reference` by the top-k rule of docs/ops.md, tightened: our tie rule is
deterministic (lower index wins), so each row's index set must equal the reference's exactly, -1 slots
included; with ``sorted=True`` each row must equal the reference slot by slot. Outputs are views into
guarded buffers, so a write out of bounds fails the test. The split-row path and the stash-overflow
fallback are forced through a small tuning table passed to the kernel functions directly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import indexcache
from indexcache.backends.cuda.arch import NVIDIA
from indexcache.backends.triton.rows import sample_positions
from indexcache.backends.triton.topk.kernels import _bin, _bin_shift
from indexcache.hal import dispatch, reference

from .far import far

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks; bench/topk_gpu.py is for GPUs"),
              pytest.mark.usefixtures("interpreted")]

GUARD = 2
SENTINEL = -7
NEG_INF, NAN = float("-inf"), float("nan")
SM90 = NVIDIA.target("sm90", interpreted=True)  # the target the kernels are interpreted for
# 512-value tiles, 128 coarse bins, a stash of max(256, k) entries (overflows on purpose), auto split.
# Split rows finished by a program a chunk where their pivot bin holds at most 16 candidates.
SMALL = {"TILE": 512, "BITS": 7, "DIGIT": 5, "num_warps": 4, "PROGRAMS_PER_SM": 2, "CHUNKS_PER_SM": 4,
         "MIN_CHUNK": 1024, "GATHER_CHUNKS": 4, "FINISH_BINS": 256, "FINISH_TIES": 16, "SAMPLE": 256,
         "SAMPLE_RANK": 16, "STASH": 256, "STASH_PER_K": 1, "STASH_COLS_SHIFT": 16, "SORT_PER_WARP": 256}


def _kernels():
    """The kernel package, imported only once TRITON_INTERPRET=1 is set."""
    from indexcache.backends.triton import topk

    return topk


def _plan():
    """The kernels' launch planning, imported only once TRITON_INTERPRET=1 is set."""
    from indexcache.backends.triton.topk import plan

    return plan


def _guarded(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.full((rows + 2 * GUARD, k), SENTINEL, dtype=torch.int32)
    return buf, buf[GUARD:GUARD + rows]


def _check_guards(buf: torch.Tensor) -> None:
    assert (buf[:GUARD] == SENTINEL).all() and (buf[-GUARD:] == SENTINEL).all(), "a kernel wrote outside its output"


def _assert_rows(out: torch.Tensor, ref: torch.Tensor) -> None:
    for r in range(out.shape[0]):
        got, want = out[r].tolist(), ref[r].tolist()
        chosen = [i for i in got if i >= 0]
        assert len(chosen) == len(set(chosen)), f"row {r}: repeated indices"
        assert sorted(got) == sorted(want), f"row {r}: {sorted(got)[:10]}... != {sorted(want)[:10]}..."


def _public(backend, scores, lengths, k, row_starts=None):
    buf, out = _guarded(scores.shape[0], k)
    indexcache.topk(scores, lengths, k, row_starts=row_starts, out=out, backend=backend)
    _check_guards(buf)
    return out


def _direct(scores, lengths, k, cfg, row_starts=None, sorted=False):
    """The kernel function with a tuning table of the test's choosing (cuda target, interpreted)."""
    buf, out = _guarded(scores.shape[0], k)
    _kernels().topk(scores, lengths, k, row_starts, out, sorted, target=SM90, cfg=cfg)
    _check_guards(buf)
    return out


def _lengths(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _mixed_rows(cols: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that together cover the contract: random, random with a short window, all ties, few distinct
    values, all -inf, NaN and -inf with fewer than k finite values, lengths 0 / 1 / k / k + 1 / negative /
    past the columns, and ±0.0, ±inf mixed in."""
    scores = torch.randn(12, cols, generator=gen)
    scores[2] = 0.75
    scores[3] = torch.randint(0, 4, (cols,), generator=gen).float()
    scores[4] = NEG_INF
    scores[5, :] = NAN
    scores[5, ::7] = NEG_INF
    scores[5, 1 : k // 2 : 3] = torch.randn(len(range(1, k // 2, 3)), generator=gen)
    scores[11, ::5] = -0.0
    scores[11, 1::5] = 0.0
    scores[11, 7] = float("inf")
    scores[11, 8] = NEG_INF
    lengths = _lengths(cols, cols // 2 + 3, cols, cols, cols, cols, 0, 1, k, k + 1, -5, cols + 100)
    return scores, lengths


@pytest.mark.parametrize(("backend", "k"), [("cuda", 1), ("rocm", 64), ("cuda", 513)])
def test_topk_contract(backend, k):
    """Every kind of row in one batch, through the public op and the backend's own tuning table."""
    gen = torch.Generator().manual_seed(k)
    scores, lengths = _mixed_rows(1500, k, gen)
    out = _public(backend, scores, lengths, k)
    _assert_rows(out, reference.topk(scores, lengths, k))


def test_topk_k2048_row_starts_bf16():
    """GLM-size k on bf16 scores (many exact ties) with windows that start inside the row."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 2600, generator=gen).to(torch.bfloat16)
    lengths, starts = _lengths(2500, 2049, 2600), _lengths(100, 551, -3)
    out = _public("cuda", scores, lengths, 2048, row_starts=starts)
    _assert_rows(out, reference.topk(scores, lengths, 2048, row_starts=starts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_topk_strided_scores(dtype):
    """A non-contiguous (transposed) score view, with row_starts past the end and negative."""
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(1200, 4, generator=gen).to(dtype).t()
    lengths, starts = _lengths(1200, 700, 50, 900), _lengths(0, 400, 1300, -10)
    out = _public("rocm", scores, lengths, 100, row_starts=starts)
    _assert_rows(out, reference.topk(scores, lengths, 100, row_starts=starts))


@pytest.mark.parametrize(("chunk", "finish_tile"), [(0, 512), (1024, 512), (1000, 2048)])
def test_split_rows_and_stash_overflow(chunk, finish_tile):
    """Few long rows split into chunks (auto and forced; whole tiles, and chunks that straddle tiles), and tie
    bins larger than the stash; the finishing kernel on the pass tile and on a wider one."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 5000, generator=gen)
    scores[1] = torch.randint(0, 3, (5000,), generator=gen).float()
    scores[2, 4000:] = NEG_INF
    lengths, starts = _lengths(5000, 4700, 4990), _lengths(0, 300, 7)
    out = _direct(scores, lengths, 200, {**SMALL, "CHUNK": chunk, "FINISH_TILE": finish_tile}, row_starts=starts)
    _assert_rows(out, reference.topk(scores, lengths, 200, row_starts=starts))


def test_fused_stash_overflow_and_tiny_tiles():
    """One program a row: bins beyond the stash rescan the row; windows that straddle tiles; pivots that
    differ from their neighbours only in low mantissa bits, and subnormals of both signs (one fp16 bin)."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(4, 1800, generator=gen)
    scores[0] = 1.0
    scores[1] = (torch.randn(1800, generator=gen) * 1e-3 + 100.0)
    scores[2] = torch.randn(1800, generator=gen) * 1e-39
    scores[3] = -torch.rand(1800, generator=gen) * 1e-30
    lengths, starts = _lengths(1800, 1700, 1000, 1200), _lengths(0, 77, 513, 0)
    out = _direct(scores, lengths, 300, {**SMALL, "CHUNKS_PER_SM": 1, "MIN_CHUNK": 1 << 20}, row_starts=starts)
    _assert_rows(out, reference.topk(scores, lengths, 300, row_starts=starts))


@pytest.mark.parametrize(("backend", "page_size"), [("cuda", 64), ("rocm", 3)])
def test_topk_translate_equals_translate_of_topk(backend, page_size):
    """Physical and raw outputs of one pass equal translate(topk(...)); row_to_batch maps rows to tables with
    holes (-1 entries), short tables and an out-of-range batch."""
    gen = torch.Generator().manual_seed(page_size)
    rows, cols, k = 6, 1100, 96
    scores = torch.randn(rows, cols, generator=gen)
    lengths, starts = _lengths(1100, 900, 50, 0, 1000, -1), _lengths(0, 100, 7, 0, 50, 0)
    pages = cols // page_size + 1
    table = torch.randint(0, 500, (3, pages), generator=gen, dtype=torch.int32)
    table[0, 2] = -1
    table[2, pages // 2 :] = -1
    r2b = _lengths(0, 1, 2, 0, 5, 1)
    buf, out = _guarded(rows, k)
    raw_buf, raw = _guarded(rows, k)
    indexcache.topk_translate(scores, lengths, k, table, page_size, row_starts=starts, row_to_batch=r2b,
                              out=out, out_raw=raw, backend=backend)
    _check_guards(buf)
    _check_guards(raw_buf)
    want_raw = reference.topk(scores, lengths, k, row_starts=starts)
    _assert_rows(raw, want_raw)
    assert torch.equal(out, reference.translate(raw, table, lengths, page_size, row_to_batch=r2b))
    alone = indexcache.topk_translate(scores, lengths, k, table, page_size, row_starts=starts, row_to_batch=r2b,
                                      backend=backend)
    assert torch.equal(alone, out)


def test_topk_translate_split_path():
    """The fused producer step on split rows, identity row_to_batch, shift path."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 3000, generator=gen)
    lengths = _lengths(3000, 2100)
    table = torch.arange(2 * 47, dtype=torch.int32).view(2, 47).flip(1).contiguous()
    out, raw = torch.empty(2, 150, dtype=torch.int32), torch.empty(2, 150, dtype=torch.int32)
    _kernels().topk_translate(scores, lengths, 150, table, 64, None, None, out, raw, False,
                              target=SM90, cfg={**SMALL, "CHUNK": 1024})
    _assert_rows(raw, reference.topk(scores, lengths, 150))
    assert torch.equal(out, reference.translate(raw, table, lengths, 64))


def test_split_path_breaks_pivot_ties_by_position():
    """Split rows whose stash holds more candidates tied at the pivot than are needed (scores on a coarse grid):
    the chunks pack their candidates lane by lane, not in index order, so the finish's second select over the
    tied positions must still keep the lowest ones. The rows take the gathered stash, not the exact fallback
    (every chunk's count is within the stash)."""
    gen = torch.Generator().manual_seed(12)
    scores = (torch.randn(3, 6000, generator=gen) * 8).round() / 8
    scores[2, ::3] = 1.5  # a long run of one value: the pivot's ties spread over every lane and chunk
    lengths = _lengths(6000, 5100, 6000)
    cfg = {**SMALL, "CHUNK": 1024, "STASH": 4096}
    out = torch.full((3, 200), SENTINEL, dtype=torch.int32)
    steps = _kernels().launches(scores, lengths, 200, None, out, None, None, 1, None,
                                target=SM90, cfg=cfg)
    assert [name for name, _ in steps] == ["sample", "filter", "finish"]
    steps[0][1]()
    steps[1][1]()
    counts = steps[1][1].args[5][: 3 * 6].view(3, 6).sum(1)
    assert ((counts >= 200) & (counts <= _plan().stash_capacity(6000, 200, cfg))).all(), counts
    steps[2][1]()
    _assert_rows(out, reference.topk(scores, lengths, 200))


def _finish_alone(scores, lengths, k, cfg, parts, page_table=None, page_size=1, with_raw=False, row_to_batch=None):
    """The split rows' launches of a call, the finish run on only the first ``parts`` programs of each row (its
    grid's second axis; None: all): ``(out, raw)``, every slot not written still ``SENTINEL``."""
    rows = scores.shape[0]
    out = torch.full((rows, k), SENTINEL, dtype=torch.int32)
    raw = torch.full((rows, k), SENTINEL, dtype=torch.int32) if with_raw else None
    steps = _kernels().launches(scores, lengths, k, None, out, raw, page_table, page_size, row_to_batch, target=SM90,
                                cfg=cfg)
    assert [name for name, _ in steps] == ["sample", "filter", "finish"]
    sample, filt, finish = (launch for _, launch in steps)
    assert finish.grid[1] == filt.grid[1] > 1, "the finish has a program a chunk"
    sample()
    filt()
    dataclasses.replace(finish, grid=(finish.grid[0], parts or finish.grid[1]))()
    return out, raw


def test_split_rows_are_finished_by_a_program_a_chunk():
    """A split row with its k-th best in a bin of few candidates is finished by all its programs at once: the first
    alone writes only its own chunk's candidates above the bin and the bin's own (every other slot unwritten); all of
    them give the reference's set, translated and raw."""
    gen = torch.Generator().manual_seed(21)
    scores = torch.randn(2, 5000, generator=gen)
    lengths, k = _lengths(5000, 4321), 300
    cfg = {**SMALL, "CHUNK": 1024}
    out, _ = _finish_alone(scores, lengths, k, cfg, 1)
    assert ((out == SENTINEL).sum(1) > k // 2).all(), "program 0 of a row did more than its chunk"
    out, _ = _finish_alone(scores, lengths, k, cfg, None)
    _assert_rows(out, reference.topk(scores, lengths, k))
    table = torch.randperm(2 * 80, generator=gen).to(torch.int32).view(2, 80)
    table[1, 5] = -1
    out, raw = _finish_alone(scores, lengths, k, cfg, None, table, 64, with_raw=True)
    _assert_rows(raw, reference.topk(scores, lengths, k))
    assert torch.equal(out, reference.translate(raw, table, lengths, 64))
    r2b = _lengths(1, 7)  # the second row names no table row: every slot translates to -1
    out, raw = _finish_alone(scores, lengths, k, cfg, None, table, 64, with_raw=True, row_to_batch=r2b)
    _assert_rows(raw, reference.topk(scores, lengths, k))
    assert torch.equal(out, reference.translate(raw, table, lengths, 64, row_to_batch=r2b))
    assert (out[1] == -1).all() and (out[0] >= 0).any()


@pytest.mark.parametrize("ties", [4096, 1])
def test_split_rows_pivot_ties_by_position_spread_or_not(ties):
    """Scores on a coarse grid put many candidates in the pivot bin, spread over every chunk and lane: ranked by
    position across the chunks where the bin is within ``FINISH_TIES`` (the programs share the row), else left to
    the row's first program (which then finishes it alone)."""
    gen = torch.Generator().manual_seed(22)
    scores = (torch.randn(3, 6000, generator=gen) * 8).round() / 8
    scores[2, ::3] = 1.5
    lengths, k = _lengths(6000, 5100, 6000), 200
    cfg = {**SMALL, "CHUNK": 1024, "STASH": 4096, "FINISH_TIES": ties}
    alone, _ = _finish_alone(scores, lengths, k, cfg, 1)
    out, _ = _finish_alone(scores, lengths, k, cfg, None)
    want = reference.topk(scores, lengths, k)
    _assert_rows(out, want)
    if ties == 1:
        assert torch.equal(alone, out)
    else:
        assert (alone == SENTINEL).any(1).all()


def test_empty_shapes_and_workspace_reuse():
    """k = 0 and zero rows write nothing; a repeated call allocates no new workspace."""
    scores = torch.randn(2, 300)
    assert _public("cuda", scores, _lengths(300, 5), 0).shape == (2, 0)
    assert indexcache.topk(torch.randn(0, 300), _lengths(), 4, backend="cuda").shape == (0, 4)
    out = _public("cuda", scores, _lengths(300, 5), 10)
    from indexcache.backends.triton import workspace

    before = workspace.kept()
    assert torch.equal(_public("cuda", scores, _lengths(300, 5), 10), out)
    after = workspace.kept()
    assert after.keys() == before.keys()
    assert all(after[key] is before[key] for key in before)


@pytest.mark.parametrize(("backend", "k"), [("cuda", 1), ("rocm", 64), ("cuda", 513)])
def test_sorted_topk_equals_the_reference_slot_by_slot(backend, k):
    """sorted=True on every kind of row of test_topk_contract: score descending, the lower index first among
    ties, -1 last, short rows 0..len-1; nothing written outside ``out``."""
    gen = torch.Generator().manual_seed(k + 1)
    scores, lengths = _mixed_rows(1500, k, gen)
    buf, out = _guarded(scores.shape[0], k)
    indexcache.topk(scores, lengths, k, out=out, sorted=True, backend=backend)
    _check_guards(buf)
    assert torch.equal(out, reference.topk(scores, lengths, k))


@pytest.mark.parametrize("path", ["fused", "split"])
def test_sorted_on_both_paths_with_stash_overflow(path):
    """sorted=True after the fused and the split select, on rows that take the fallback (few distinct values:
    ties ordered by index) and on windows inside the row."""
    gen = torch.Generator().manual_seed(8)
    scores = torch.randn(3, 5000, generator=gen)
    scores[1] = torch.randint(0, 3, (5000,), generator=gen).float()
    scores[2, 4000:] = NEG_INF
    lengths, starts = _lengths(5000, 4700, 4990), _lengths(0, 300, 7)
    cfg = SMALL | ({"CHUNKS_PER_SM": 1, "MIN_CHUNK": 1 << 20} if path == "fused" else {"CHUNK": 1024})
    out = _direct(scores, lengths, 200, cfg, row_starts=starts, sorted=True)
    assert torch.equal(out, reference.topk(scores, lengths, 200, row_starts=starts))


@pytest.mark.parametrize(("backend", "page_size", "with_raw"), [("cuda", 64, True), ("rocm", 3, False)])
def test_sorted_topk_translate(backend, page_size, with_raw):
    """sorted=True through the page table: out_raw (when given) is the sorted reference, out its translation
    slot by slot; strided bf16 scores, row_starts, row_to_batch with holes and an out-of-range batch."""
    gen = torch.Generator().manual_seed(9)
    rows, cols, k = 6, 1100, 96
    scores = torch.randn(cols, rows, generator=gen).to(torch.bfloat16).t()
    lengths, starts = _lengths(1100, 900, 50, 0, 1000, -1), _lengths(0, 100, 7, 0, 50, 0)
    pages = cols // page_size + 1
    table = torch.randint(0, 500, (3, pages), generator=gen, dtype=torch.int32)
    table[0, 2] = -1
    r2b = _lengths(0, 1, 2, 0, 5, 1)
    buf, out = _guarded(rows, k)
    raw_buf, raw = _guarded(rows, k)
    indexcache.topk_translate(scores, lengths, k, table, page_size, row_starts=starts, row_to_batch=r2b, out=out,
                              out_raw=raw if with_raw else None, sorted=True, backend=backend)
    _check_guards(buf)
    _check_guards(raw_buf)
    want_phys, want_raw = reference.topk_translate(scores, lengths, k, table, page_size, row_starts=starts,
                                                   row_to_batch=r2b)
    assert torch.equal(out, want_phys)
    if with_raw:
        assert torch.equal(raw, want_raw)
    else:
        assert (raw == SENTINEL).all()


def test_sorted_beyond_its_largest_k_is_declined_with_a_reason():
    kernels = _kernels()
    scores = torch.randn(1, 50)
    with pytest.raises(dispatch.BackendNotSupportedError, match=f"k <= {kernels.MAX_SORTED_K}"):
        indexcache.topk(scores, _lengths(50), kernels.MAX_SORTED_K + 1, sorted=True, backend="cuda")


def test_split_chunk_depends_on_shape_only():
    """Chunks are powers of two of at least a tile, from the shape and the SM count alone; the finish reads at
    most a row's chunks side by side."""
    plan = _plan()
    cfg = {**SMALL, "TILE": 4096, "CHUNKS_PER_SM": 4, "MIN_CHUNK": 16384, "GATHER_CHUNKS": 64}
    assert plan.split_chunk(2048, 32768, 132, cfg) == 0
    chunk = plan.split_chunk(64, 131072, 132, cfg)
    assert chunk == 16384  # 9 chunks a row wanted: 14564 columns, rounded up to a power of two
    assert plan.split_chunk(1, 1 << 20, 132, cfg) == 16384
    assert plan.split_chunk(1, 1000, 132, cfg) == 0
    assert plan.split_chunk(1, 50000, 132, {**cfg, "CHUNK": 1000}) == 4096  # forced, then at least a tile
    assert [plan.gather_chunks(n, cfg) for n in (1, 3, 4, 16, 100, 4096)] == [1, 2, 4, 16, 64, 64]


def test_bf16_subnormals_and_signed_zeros():
    """bf16 subnormals keep their order (converted by their bits) and ±0.0 tie."""
    gen = torch.Generator().manual_seed(6)
    scores = (torch.randn(2, 1000, generator=gen) * 1e-39).to(torch.bfloat16)
    scores[1, ::2] = -0.0
    scores[1, 1::2] = 0.0
    scores[1, 500:520] = 1e-40
    lengths = _lengths(1000, 1000)
    out = _public("cuda", scores, lengths, 100)
    _assert_rows(out, reference.topk(scores, lengths, 100))


def test_sampled_threshold_finishes_random_rows_in_the_first_launch():
    """Random rows (normal, uniform, strongly skewed) are finished by the fused kernel alone: the sampled
    threshold kept their whole top-k in the stash. A row of ties overflows the stash, is left to the finishing
    launch (its slots untouched until then) and comes out exact from the fallback."""
    gen = torch.Generator().manual_seed(7)
    cols, k = 6000, 300
    scores = torch.randn(4, cols, generator=gen)
    scores[1] = torch.rand(cols, generator=gen)
    scores[2] = torch.randn(cols, generator=gen).exp() ** 3
    scores[3] = 0.5
    lengths = _lengths(cols, cols, 5000, cols)
    out = torch.full((4, k), SENTINEL, dtype=torch.int32)
    steps = _kernels().launches(scores, lengths, k, None, out, None, None, 1, None,
                                target=SM90, cfg=SMALL | {"STASH": 1024})
    assert [name for name, _ in steps] == ["rows", "finish"]
    steps[0][1]()
    want = reference.topk(scores, lengths, k)
    _assert_rows(out[:3], want[:3])
    assert (out[3] == SENTINEL).all()
    steps[1][1]()
    _assert_rows(out, want)


def test_one_finishing_program_takes_the_rows_left_among_many():
    """75 rows, one finishing program (interpreted: one multiprocessor) walking them all: the rows left to it (all
    ties: the stash overflows), first, middle and last, come out exact; the rows the first launch finished keep what
    it wrote."""
    gen = torch.Generator().manual_seed(9)
    cols, k, left = 2000, 100, [0, 33, 63, 64, 74]
    scores = torch.randn(75, cols, generator=gen)
    scores[left] = 0.5
    lengths = torch.full((75,), cols, dtype=torch.int32)
    out = torch.full((75, k), SENTINEL, dtype=torch.int32)
    steps = _kernels().launches(scores, lengths, k, None, out, None, None, 1, None, target=SM90,
                                cfg=SMALL | {"STASH": 1024})
    assert [name for name, _ in steps] == ["rows", "finish"] and steps[1][1].grid[0] == 1
    steps[0][1]()
    assert (out[left] == SENTINEL).all()
    first = out.clone()
    steps[1][1]()
    _assert_rows(out, reference.topk(scores, lengths, k))
    kept = [r for r in range(75) if r not in left]
    assert torch.equal(out[kept], first[kept])


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_and_distributions_match_the_reference(seed):
    """Random row counts, lengths, window starts, k and score distributions (normal, uniform, few distinct
    values, heavy right tail, bf16 with its many ties, ±0.0 and -inf mixed in), on the fused and the split
    path with small tiles and samples, and stashes small (the fallback) and large enough for a whole row (the
    sampled threshold also on rows of ties, where entries equal to the threshold must all be kept)."""
    gen = torch.Generator().manual_seed(100 + seed)
    rows = int(torch.randint(1, 6, (), generator=gen))
    cols = int(torch.randint(300, 4000, (), generator=gen))
    k = int(torch.randint(1, 400, (), generator=gen))
    kind = seed % 3
    scores = torch.randn(rows, cols, generator=gen)
    if kind == 1:
        scores = torch.rand(rows, cols, generator=gen).pow(8)
    elif kind == 2:
        scores = torch.randint(0, 7, (rows, cols), generator=gen).float() - 3.0
    scores[:, ::11] = -0.0
    scores[:, 5::13] = float("-inf")
    if seed % 2:
        scores = scores.to(torch.bfloat16)
    lengths = torch.randint(-2, cols + 50, (rows,), generator=gen, dtype=torch.int32)
    starts = torch.randint(-5, cols // 3, (rows,), generator=gen, dtype=torch.int32)
    want = reference.topk(scores, lengths, k, row_starts=starts)
    fused = SMALL | {"CHUNKS_PER_SM": 1, "MIN_CHUNK": 1 << 20}
    split = SMALL | {"CHUNK": 1024, "STASH": 4096}
    for cfg in (fused, fused | {"STASH": 4096}, SMALL | {"CHUNK": 1024}, split, split | {"FINISH_BINS": 1},
                split | {"FINISH_BINS": 2}, split | {"FINISH_BINS": 4096},  # the pivot bin: all candidates, or few
                split | {"FINISH_TIES": 1024},  # a program a chunk for any pivot bin of a stash's size
                SMALL | {"CHUNK": 1024, "FINISH_TIES": 1024}):  # ... but none beyond the stash
        _assert_rows(_direct(scores, lengths, k, cfg, row_starts=starts), want)
    assert torch.equal(_direct(scores, lengths, k, (fused, SMALL)[seed % 2], row_starts=starts, sorted=True), want)


@triton.jit
def _bin_shift_kernel(out_ptr, floor, best, BINS: tl.constexpr):
    shift = _bin_shift(floor, best, BINS)
    tl.store(out_ptr, shift)
    tl.store(out_ptr + 1, _bin(best, floor, shift, BINS))


@pytest.mark.parametrize("bins", [1, 2, 256, 2048])
@pytest.mark.parametrize(("floor", "best"), [(-2**31, 2**31 - 1), (-2**31, 0), (0, 5), (7, 7)])
def test_the_bin_shift_is_the_fewest_bits_below_the_key_width(bins, floor, best):
    """``_bin_shift``: the fewest low bits to drop so that the bins from ``floor`` reach ``best``, which falls in the
    last bin it reaches; never 32 or more (a 32-bit shift by that is undefined), even with one bin, whose shift may be
    anything below 32 (every key in it): a table's ``FINISH_BINS`` of 1 spans the whole key range at 31."""
    out = torch.empty(2, dtype=torch.int32)
    _bin_shift_kernel[(1,)](out, floor, best, BINS=bins)
    shift, last = out.tolist()
    span = max(best - floor, 0)
    fewest = next(s for s in range(33) if span >> s < bins)
    assert (shift, last) == ((min(fewest, 31), 0) if bins == 1 else (fewest, span >> fewest))


@triton.jit
def _sample_positions_kernel(out_ptr, start, length, SAMPLES: tl.constexpr):
    i = tl.arange(0, SAMPLES)
    tl.store(out_ptr + i, sample_positions(i, start, length, SAMPLES))


@pytest.mark.parametrize(("start", "length", "samples"), [(0, 32768, 1024), (7, 1000, 256), (3, 100, 256), (0, 1, 64)])
def test_sample_entries_one_a_segment_at_varied_offsets(start, length, samples):
    """The sample's positions (``rows.sample_positions``) lie in the window, one in each segment (up to one past its
    end, for float rounding), in order; at a power-of-two stride they do not all share a few offsets a page."""
    out = torch.empty(samples, dtype=torch.int32)
    _sample_positions_kernel[(1,)](out, start, length, SAMPLES=samples)
    pos = out.long() - start
    seg = torch.arange(samples)
    assert bool(((pos >= 0) & (pos < length)).all())
    assert bool((pos >= seg * length // samples).all()) and bool((pos <= (seg + 1) * length // samples).all())
    assert bool((pos[1:] >= pos[:-1]).all())
    if length >= 64 * samples // 2:  # several entries a 64-token page: their offsets in the page vary
        assert (pos % 64).unique().numel() > 32


def test_a_sample_record_without_counts_holds_the_split_rows_threshold_and_shift():
    """``topk_sample_kernel`` without ``COUNTS`` (the block kernel's rows sampled ahead: two words a row) writes the
    threshold and bin shift the split rows' record holds after its zeroed counts; short rows are left untouched."""
    from indexcache.backends.triton.launcher import Launch

    gen = torch.Generator().manual_seed(3)
    rows, cols, k, bins = 5, 3000, 100, 256
    scores = torch.randn(rows, cols, generator=gen) * 50 - 80  # k-th best below zero in some rows
    scores[1, ::7] = NEG_INF
    lengths = _lengths(cols, cols, 2000, k, 0)
    starts = _lengths(0, 0, 500, 0, 0)
    opts = _plan().own_options(SM90, SMALL, "SAMPLE_WARPS")
    named = dict(s_s0=cols, s_s1=1, len_s0=1, st_s0=1, HAS_STARTS=True, CONTIG=True, SAMPLES=256, DIGIT=5, BINS=bins,
                 PDL=False, ROUNDS=0)
    records = {}
    for counts, width in ((True, bins + 2), (False, 2)):
        record = torch.full((rows, width), SENTINEL, dtype=torch.int32)
        Launch(_plan().SAMPLE, (rows,), opts, (scores, lengths, starts, record, cols, k),
               dict(named, COUNTS=counts))()
        records[counts] = record
    assert (records[True][:, :bins] == 0).all()  # the split filter's counts, zeroed
    assert torch.equal(records[True][:3, bins:], records[False][:3])
    assert (records[False][3:] == SENTINEL).all() and (records[True][3:, bins:] == SENTINEL).all()
    assert (records[False][:3, 1] > 0).all()  # spans of these scores need a shift


@pytest.mark.parametrize("rounds", [1, 3])
def test_sample_rounds_capped_lower_the_floor_to_its_bin_and_keep_the_top_k(rounds):
    """``SAMPLE_ROUNDS``: the sample launch stops its radix select after that many rounds, so each row's floor is the
    bottom of the bin those rounds settled: at or below the uncapped floor (the m-th best sample key), sharing its
    settled top bits, lower on some row, and never below the key of the lowest finite float (scores near -FLT_MAX,
    whose bin after one round reaches down to NaN's keys); the split rows it thresholds still come out exact."""
    from indexcache.backends.triton.launcher import Launch
    from indexcache.backends.triton.rows import KEY_MIN_VALID

    gen = torch.Generator().manual_seed(11)
    rows, cols, k, bins = 7, 3000, 100, 256
    scores = torch.randn(rows, cols, generator=gen) * 50 - 20
    scores[1] = scores[1].abs() + 1  # one sign: the rounds start below a longer common prefix
    scores[2, ::5] = NEG_INF
    scores[6] = -3e38 * (0.5 + 0.5 * torch.rand(cols, generator=gen))  # the sample's m-th best among these ...
    scores[6, ::20] = 1.0  # ... below a few positives: no common prefix, one round leaves the whole bottom bin
    scores[6, 1::3] = NEG_INF
    lengths = _lengths(cols, cols, cols, 2000, k, 0, cols)
    starts = _lengths(0, 0, 0, 500, 0, 0, 0)
    sampled = [0, 1, 2, 3, 6]  # the rows longer than k
    opts = _plan().own_options(SM90, SMALL, "SAMPLE_WARPS")
    named = dict(s_s0=cols, s_s1=1, len_s0=1, st_s0=1, HAS_STARTS=True, CONTIG=True, SAMPLES=256, DIGIT=5, BINS=bins,
                 PDL=False, COUNTS=False)
    floors = {}
    for cap in (0, rounds):
        record = torch.full((rows, 2), SENTINEL, dtype=torch.int32)
        Launch(_plan().SAMPLE, (rows,), opts, (scores, lengths, starts, record, cols, k), dict(named, ROUNDS=cap))()
        floors[cap] = record[sampled, 0].long()
    settled = 32 - 5 * rounds  # at least the rounds' top bits: the first round may overlap the common prefix
    assert bool((floors[rounds] <= floors[0]).all()) and bool((floors[rounds] >= KEY_MIN_VALID.value).all())
    assert bool(((floors[rounds][:4] >> settled) == (floors[0][:4] >> settled)).all())
    assert bool((floors[rounds] < floors[0]).any()), "the cap changed no floor: the test sees nothing"
    cfg = SMALL | {"CHUNK": 1024, "STASH": 4096, "SAMPLE_ROUNDS": rounds}
    _assert_rows(_direct(scores, lengths, k, cfg, row_starts=starts), reference.topk(scores, lengths, k,
                                                                                      row_starts=starts))


@pytest.mark.parametrize("backend", ["cuda", "rocm"])
@pytest.mark.parametrize("sorted_", [False, True], ids=["unsorted", "sorted"])
def test_outputs_of_a_huge_column_stride(backend, sorted_):
    """Given outputs whose column offsets pass 2^31 elements (rows of transposed buffers), a long row, a short one and
    a row naming no batch: the kernels computed a slot's offset in int32 and wrote (and read back, translating) far
    outside ``out`` and ``out_raw`` (a segfault interpreted)."""
    scores = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([16, 3, 16], dtype=torch.int32)
    table, r2b = torch.arange(8, dtype=torch.int32).view(2, 4), torch.tensor([1, 0, 2], dtype=torch.int32)
    want_raw = reference.topk(scores, lengths, 4)  # sorted by (score desc, index asc)
    want = reference.translate(want_raw, table, lengths, 4, row_to_batch=r2b)
    for with_raw in (True, False):
        out = far(torch.full((3, 4), SENTINEL, dtype=torch.int32), 1)
        out_raw = far(torch.full((3, 4), SENTINEL, dtype=torch.int32), 1) if with_raw else None
        indexcache.topk_translate(scores, lengths, 4, table, 4, row_to_batch=r2b, out=out, out_raw=out_raw,
                                  sorted=sorted_, backend=backend)
        if sorted_:
            assert torch.equal(out, want)
        else:
            assert torch.equal(out.sort(1).values, want.sort(1).values)
        if with_raw:
            assert torch.equal(out_raw if sorted_ else out_raw.sort(1).values,
                               want_raw if sorted_ else want_raw.sort(1).values)


@pytest.mark.parametrize("cols", [16, 3000], ids=["fused", "split"])
@pytest.mark.parametrize("name", ["lengths", "row_starts", "row_to_batch"])
def test_row_metadata_of_a_huge_stride(name, cols):
    """Lengths, window starts or rows' requests whose offsets pass 2^31 elements (a column of a wide buffer), on the
    fused path (sorted) and the split one: the kernels read a row's at r * stride in int32, far outside (a segfault
    interpreted). Same slots as contiguous."""
    g = torch.Generator().manual_seed(13)
    k = 4 if cols == 16 else 150
    args = dict(scores=torch.randn(3, cols, generator=g), lengths=_lengths(cols, cols - 9, cols // 2),
                row_starts=_lengths(0, 5, 3), row_to_batch=_lengths(1, 0, 1))
    table = torch.arange(2 * 47, dtype=torch.int32).view(2, 47).flip(1).contiguous()

    def run(a):
        out, raw = torch.empty(3, k, dtype=torch.int32), torch.empty(3, k, dtype=torch.int32)
        _kernels().topk_translate(a["scores"], a["lengths"], k, table, 64, a["row_starts"], a["row_to_batch"], out,
                                  raw, cols == 16, target=SM90, cfg={**SMALL, "CHUNK": 1024})
        return out.sort(1).values, raw.sort(1).values

    want = run(args)
    args[name] = far(args[name], 0)
    got = run(args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
