"""The Gluon block-a-row top-k (backends/triton/topk/block.py): what it takes, its shape, and which calls the launch
plan gives it; on an NVIDIA GPU, which rows it finishes itself. Gluon does not run under the interpreter: the
conformance suite runs the kernel on an NVIDIA GPU (``ci/gpu.sh``, which also runs this file there); the
cross-compile check builds it (tests/test_crosscompile.py, ``indexcache compile-check``)."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.backends.cuda import tuning
from indexcache.backends.cuda.arch import NVIDIA
from indexcache.backends.rocm.arch import AMD
from indexcache.backends.triton.support import uses_pdl
from indexcache.backends.triton.topk import block as topk_block
from indexcache.backends.triton.topk import plan

H200 = NVIDIA.target("sm90")
CFG = tuning("sm90")["topk"]


def test_takes_nvidia_calls_up_to_k_2048_when_the_table_says_block():
    assert topk_block.unsupported(2048, H200, CFG) == []
    interpreted = NVIDIA.target("sm90", interpreted=True)
    amd = AMD.target("gfx942")
    assert "NVIDIA GPUs only" in topk_block.unsupported(8, interpreted, CFG)[0]
    assert "NVIDIA GPUs only" in topk_block.unsupported(8, amd, CFG)[0]
    assert "KERNEL is 'triton'" in topk_block.unsupported(8, H200, {**CFG, "KERNEL": "triton"})[0]
    assert "k 2049: at most 2048" in topk_block.unsupported(2049, H200, CFG)[0]


def test_shape_holds_eight_k_candidates_at_most_8192_and_a_sample_entry_a_thread():
    cfg = {**CFG, "BLOCK_WARPS": 16, "BLOCK_PIECE_J": 8}
    shape = topk_block.shape(131072, 2048, 2048, cfg)
    assert shape == {"NUM_WARPS": 16, "PIECE_J": 8, "SAMPLE_J": 4, "STASH_J": 16, "BINS": 2048, "TIE_SLOTS": 256,
                     "FLOORS": 0, "PREFETCH": CFG["BLOCK_PREFETCH"], "SMEM": CFG["BLOCK_SMEM"]}
    assert topk_block.capacity(topk_block.shape(131072, 512, 4096, cfg)) == 4096  # 256 a warp
    assert topk_block.capacity(shape) == 8192
    assert topk_block.workspace(shape) == 2 * 8192 + 2048 + 16 + 2 * 256  # stash, bins, warps, the pivot bin
    small = topk_block.shape(4096, 1, 64, cfg)
    assert small["SAMPLE_J"] == 1 and small["STASH_J"] == 2  # at least two a thread: a warp's region holds 64


def _plan(monkeypatch, rows: int, cols: int, cfg: dict) -> list:
    """The launches of a plain top-k (k 2048) of ``rows`` full rows on an H200-sized GPU (132 SMs)."""
    monkeypatch.setattr(plan, "multiprocessors", lambda target, device: 132)
    scores = torch.empty(rows, cols)
    lengths = torch.full((rows,), cols, dtype=torch.int32)
    out = torch.empty(rows, 2048, dtype=torch.int32)
    return plan.launches(scores, lengths, 2048, None, out, None, None, 1, None, target=H200, cfg=cfg)


@pytest.mark.parametrize(("rows", "cols", "first"), [
    (64, 131072, "block"),  # decode rows that would be split: the block kernel from BLOCK_MIN_ROWS rows on
    (200, 32768, "block"),  # many rows (the fused kernel's calls)
    (1, 131072, "sample"),  # one long row: split
    (64, 1 << 20, "sample"),  # beyond BLOCK_MAX_COLS: split
])
def test_launch_plan_gives_the_block_kernel_its_calls(monkeypatch, rows, cols, first):
    steps = _plan(monkeypatch, rows, cols, CFG)
    names = [name for name, _ in steps]
    launcher = steps[0][1].launcher
    assert ("block" if launcher is topk_block.BLOCK else names[0]) == first
    assert names[-1] == "finish"  # rows the block kernel leaves (its sample missed, heavy ties) get the exact path
    if first == "block":
        assert steps[0][1].grid == (min(rows, 132),)
        assert steps[0][1].named["FLOORS"] == 0  # fewer rows than BLOCK_SAMPLE_ROWS: sampled in the block
        assert steps[-1][1].args[14] == topk_block.capacity(topk_block.shape(cols, 2048, 0, CFG))  # the finish's cap


@pytest.mark.parametrize("floors", [1, 2])
def test_many_rows_are_sampled_ahead_by_a_launch_a_row(monkeypatch, floors):
    cfg = {**CFG, "BLOCK_SAMPLE_ROWS": 1024, "BLOCK_FLOORS": floors, "AHEAD_SAMPLE_RANK": 0}
    steps = _plan(monkeypatch, 1024, 32768, cfg)
    assert [name for name, _ in steps] == ["sample", "rows", "finish"]
    (_, sample), (_, block) = steps[:2]
    assert block.launcher is topk_block.BLOCK and block.named["FLOORS"] == floors
    assert sample.launcher is plan.SAMPLE and sample.grid == (1024,)
    assert not sample.named["COUNTS"] and sample.named["BINS"] == topk_block.BINS
    assert sample.named["SAMPLES"] == topk_block.samples(block.named)  # the statistics of the block's own sample
    records = sample.args[3]
    assert block.args[9].data_ptr() == records.data_ptr() and records.numel() >= 2 * 1024  # two words a row
    assert sample.named["ROUNDS"] == CFG["SAMPLE_ROUNDS"]
    with indexcache.sm_budget(33):  # a launch a row is not persistent: under a budget the block samples itself
        steps = _plan(monkeypatch, 1024, 32768, cfg)
    assert [name for name, _ in steps] == ["rows", "finish"] and steps[0][1].named["FLOORS"] == 0


@pytest.mark.parametrize(("rank", "cols", "entries"), [(0, 32768, 1024), (32, 32768, 512), (16, 32768, 256),
                                                        (32, 131072, 2048), (16, 4096, 64)])
def test_rows_sampled_ahead_take_the_tables_sample_size_at_their_own_rank(monkeypatch, rank, cols, entries):
    """``AHEAD_SAMPLE_RANK``: the sample launch takes ``sample_size`` entries at that rank (at least 64), not the
    block kernel's one a thread; 0 keeps the block's own count. The radix rounds' cap goes with it."""
    cfg = {**CFG, "BLOCK_SAMPLE_ROWS": 256, "BLOCK_FLOORS": 2, "AHEAD_SAMPLE_RANK": rank, "SAMPLE_ROUNDS": 3}
    (_, sample), (_, block) = _plan(monkeypatch, 256, cols, cfg)[:2]
    assert sample.launcher is plan.SAMPLE and block.named["FLOORS"] == 2
    assert sample.named["SAMPLES"] == (entries if rank else topk_block.samples(block.named)) == entries
    assert sample.named["ROUNDS"] == 3


@pytest.mark.parametrize(("ahead", "warps"), [(0, CFG["SAMPLE_WARPS"]), (2, 2), (1, 1)])
def test_rows_sampled_ahead_take_their_own_warps_and_split_rows_keep_theirs(monkeypatch, ahead, warps):
    """``AHEAD_SAMPLE_WARPS``: the warps of the sample launch for rows sampled ahead (0: ``SAMPLE_WARPS``); the split
    rows' sample (one long row) keeps ``SAMPLE_WARPS`` whatever it is."""
    cfg = {**CFG, "BLOCK_SAMPLE_ROWS": 256, "BLOCK_FLOORS": 2, "AHEAD_SAMPLE_WARPS": ahead}
    (_, sample), _ = _plan(monkeypatch, 256, 32768, cfg)[:2]
    assert sample.launcher is plan.SAMPLE and dict(sample.options)["num_warps"] == warps
    (_, split), _ = _plan(monkeypatch, 1, 131072, cfg)[:2]
    assert split.launcher is plan.SAMPLE and split.named["COUNTS"]
    assert dict(split.options)["num_warps"] == CFG["SAMPLE_WARPS"]


def test_a_forced_chunk_keeps_the_split_path(monkeypatch):
    steps = _plan(monkeypatch, 64, 131072, {**CFG, "CHUNK": 16384})
    assert [name for name, _ in steps] == ["sample", "filter", "finish"]


def test_the_triton_table_keeps_the_triton_kernels(monkeypatch):
    assert _plan(monkeypatch, 2048, 32768, {**CFG, "KERNEL": "triton"})[0][1].launcher is plan.ROWS


@pytest.mark.parametrize(("arch", "pdl"), [("sm90", True), ("sm100", True), ("sm80", False), ("sm89", False)])
def test_block_and_finish_launches_use_programmatic_dependent_launch_from_sm90(monkeypatch, arch, pdl):
    target = NVIDIA.target(arch)
    cfg = tuning(arch)["topk"]
    monkeypatch.setattr(plan, "multiprocessors", lambda target, device: 132)
    scores = torch.empty(64, 32768)
    lengths = torch.full((64,), 32768, dtype=torch.int32)
    out = torch.empty(64, 2048, dtype=torch.int32)
    steps = plan.launches(scores, lengths, 2048, None, out, None, None, 1, None, target=target, cfg=cfg)
    for name, launch in steps:
        assert dict(launch.options).get("launch_pdl", False) is pdl, name
        assert launch.named["PDL"] is pdl, name
    no_pdl = plan.launches(scores, lengths, 2048, None, out, None, None, 1, None, target=target,
                           cfg={**cfg, "PDL": False})
    assert all("launch_pdl" not in dict(launch.options) and not launch.named["PDL"] for _, launch in no_pdl)


def test_interpreted_and_amd_launches_never_ask_for_programmatic_dependent_launch():
    for target in (NVIDIA.target("sm90", interpreted=True), AMD.target("gfx942")):
        assert not uses_pdl(target, {**CFG, "PDL": True})


@pytest.mark.parametrize("smem", [0, 1, 2])
def test_shared_words_are_declared_once_and_only_with_smem(smem):
    # A block-scoped .shared declaration that the compiler duplicated would be a second array, so threads could
    # count into different bins: the build must hold exactly one, and its shared memory all of it.
    from indexcache.backends.triton import crosscompile as cc

    table = tuning("sm90")
    table["topk"] = {**table["topk"], "BLOCK_SMEM": smem}
    target = cc.gpu_target("cuda", "sm90")
    spec = next(s for s in topk_block_specs(target, table) if s.constexprs.get("FLOORS") == 2)
    kernel = cc.build(spec, target)
    assert kernel.asm["ptx"].count(topk_block.SMEM_NAME + "[") == (1 if smem else 0)
    shared = target.gpu.vendor.resources(kernel)["shared_bytes"]
    assert shared >= 4 * topk_block.smem_words(smem) and (shared >= 4 * topk_block.smem_words(1)) == bool(smem)


def topk_block_specs(target, table) -> list:
    from indexcache.backends.triton.topk import specs

    return [s for s in specs.compile_specs(target, table) if s.fn is topk_block.topk_block_kernel]


def _on_nvidia_gpu() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() >= (8, 0)


@pytest.mark.skipif(not _on_nvidia_gpu(), reason="needs an NVIDIA GPU (Gluon kernels do not run interpreted)")
@pytest.mark.parametrize("smem", [0, 1, 2])
@pytest.mark.parametrize("floors", [0, 1, 2])
@pytest.mark.parametrize("offset", [-300.0, -150.0, -10.0])
def test_rows_whose_top_k_crosses_zero_are_finished_in_the_block(offset, floors, smem):
    # Scores of N(offset, 100): the k-th best about offset + 153, so at -300 and -150 a row's candidates run from
    # a negative k-th best (or one near zero) to large positive scores, every octave between. Such rows once went
    # to the finishing launch's exact fallback (a pivot bin of thousands); the block kernel bins them again.
    from indexcache.backends.triton.target import detect

    dev = torch.device("cuda")
    target = detect(NVIDIA)[2]
    gen = torch.Generator(device=dev).manual_seed(0)
    scores = torch.randn(64, 32768, device=dev, generator=gen) * 100 + offset
    lengths = torch.full((64,), 32768, dtype=torch.int32, device=dev)
    out = torch.full((64, 2048), -7, dtype=torch.int32, device=dev)
    cfg = {**tuning(target.arch)["topk"], "BLOCK_SAMPLE_ROWS": 64, "BLOCK_FLOORS": floors, "BLOCK_SMEM": smem}
    steps = plan.launches(scores, lengths, 2048, None, out, None, None, 1, None, target=target, cfg=cfg)
    *sampled, (_, block), _ = steps
    assert block.launcher is topk_block.BLOCK and block.named["FLOORS"] == floors and block.named["SMEM"] == smem
    for _, launch in sampled:
        launch()
    block()  # the block kernel alone: what it leaves, the finishing launch would take
    assert (block.args[8][:64] == -1).all()  # counts: -1 for every row finished here
    want = torch.topk(scores, 2048, dim=1).indices.sort(1).values
    assert torch.equal(out.sort(1).values.long(), want)


@pytest.mark.skipif(not _on_nvidia_gpu(), reason="needs an NVIDIA GPU (Gluon kernels do not run interpreted)")
@pytest.mark.parametrize("smem", [0, 1, 2])
def test_rows_sampled_ahead_give_each_windows_top_k_over_several_rows_a_program(smem):
    # More rows than programs, so each program takes several in turn; windows that start past 0, rows of at most k
    # between long ones, and a last row after which the program has none.
    from indexcache.backends.triton.target import detect

    dev = torch.device("cuda")
    target = detect(NVIDIA)[2]
    gen = torch.Generator(device=dev).manual_seed(1)
    rows, cols, k = 400, 8192, 2048
    scores = torch.randn(rows, cols, device=dev, generator=gen)
    starts = torch.randint(0, 2048, (rows,), device=dev, generator=gen, dtype=torch.int32)
    lengths = torch.randint(k + 1, cols - 2048, (rows,), device=dev, generator=gen, dtype=torch.int32)
    lengths[::7] = torch.randint(1, k + 1, (len(range(0, rows, 7)),), device=dev, generator=gen, dtype=torch.int32)
    out = torch.full((rows, k), -7, dtype=torch.int32, device=dev)
    cfg = {**tuning(target.arch)["topk"], "BLOCK_SAMPLE_ROWS": 256, "BLOCK_FLOORS": 2, "BLOCK_SMEM": smem}
    steps = plan.launches(scores, lengths, k, starts, out, None, None, 1, None, target=target, cfg=cfg)
    assert [name for name, _ in steps] == ["sample", "rows", "finish"]
    for _, launch in steps:
        launch()
    cols_ = torch.arange(cols, device=dev)
    inside = (cols_ >= starts[:, None]) & (cols_ < (starts + lengths)[:, None])
    masked = torch.where(inside, scores, float("-inf"))
    for r in range(rows):
        n = int(lengths[r])
        want = (torch.topk(masked[r], min(n, k)).indices - starts[r]).sort().values
        got = out[r][out[r] >= 0].sort().values.long()
        assert torch.equal(got, want), r
        assert int((out[r] >= 0).sum()) == min(n, k)
