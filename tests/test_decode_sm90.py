"""The Hopper decode kernel in Gluon (``backends/triton/decode_sm90.py``): which calls it takes, and, on an sm90 GPU,
the same logits as the Triton kernel, bit for bit, with -inf in the same places.

Gluon kernels do not run under the interpreter: off Hopper only the host side is checked here (the kernel is built
for sm90 by the cross-compile check). ``ci/gpu.sh`` runs the GPU cases on the H200.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from indexcache.backends import cuda as cuda_backend  # noqa: E402
from indexcache.backends.cuda.arch import NVIDIA  # noqa: E402
from indexcache.backends.triton import decode_sm90, logits  # noqa: E402
from indexcache.backends.triton.target import detect  # noqa: E402
from indexcache.hal import fp4, reference  # noqa: E402
from indexcache.hal.layout import new_packed_cache, split_packed_cache  # noqa: E402

FP8 = torch.float8_e4m3fn
HOPPER = NVIDIA.target("sm90")


def _on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _args(batch=2, next_n=1, heads=64, dim=128, page=64, pages=8, table_pages=4):
    q = torch.zeros(batch, next_n, heads, dim, dtype=FP8)
    cache = new_packed_cache(pages, page, dim)
    w = torch.zeros(batch * next_n, heads)
    table = torch.zeros(batch, table_pages, dtype=torch.int32)
    out = torch.zeros(batch * next_n, table_pages * page)
    return q, cache, w, table, out


def test_takes_hopper_fp8_pages_of_64_keys_of_dim_128():
    q, cache, w, table, out = _args()
    assert decode_sm90.unsupported(q, cache, w, table, out, 64, 1, HOPPER) == []


def test_takes_an_mxfp4_cache_and_declines_other_formats():
    q, _, w, table, out = _args()
    cache = new_packed_cache(8, 64, 128, fp8_dtype=fp4.FP4)
    assert decode_sm90.unsupported(q, cache, w, table, out, 64, 2, HOPPER, fp4.FP4) == []
    reasons = decode_sm90.unsupported(q, cache, w, table, out, 64, 1, HOPPER, torch.bfloat16)
    assert any("k_format torch.bfloat16" in r for r in reasons), reasons


@pytest.mark.parametrize("k_format", [None, fp4.FP4])
def test_copy_views_read_the_cache_and_keep_its_memory_not_the_tensor(k_format):
    """The descriptors' views: the cache's bytes as a page's rows (keys, then scales) and as int32 words, sharing its
    memory at its offset, without holding the caller's tensor (which an entry of the views kept by cache outlives
    only while the tensor does)."""
    import gc
    import weakref

    pages, page, dim = 5, 64, 128
    fmt = FP8 if k_format is None else k_format
    width = new_packed_cache(1, page, dim, fp8_dtype=fmt).shape[1]
    whole = torch.randint(0, 256, (pages + 1, width), dtype=torch.uint8)
    cache = whole[1:]  # a view at an offset, as a layer's cache in a larger buffer is
    keys, scales, rows, words = decode_sm90._descriptors(cache, page, dim, k_format is not None)
    row_bytes = dim if k_format is None else dim // 2
    assert rows == width // row_bytes
    assert keys.base.data_ptr() == cache.data_ptr() == words.data_ptr()
    assert torch.equal(keys.base.view(torch.uint8).view(-1), cache.reshape(-1))
    assert torch.equal(words, cache.reshape(-1).view(torch.int32))
    assert scales.base.data_ptr() == cache.data_ptr() and scales.block_shape[0] == (rows - page if k_format else 2)
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the views are kept by cache on a GPU only")
def test_copy_views_are_kept_while_the_cache_lives():
    import gc

    cache = new_packed_cache(4, 64, 128, device="cuda")
    first = decode_sm90._cache_views(cache, 64, 128, False)
    assert decode_sm90._cache_views(cache, 64, 128, False) is first
    key = (cache.data_ptr(), cache.shape, cache.device, 64, 128, False)
    assert key in decode_sm90._VIEWS
    del cache, first
    gc.collect()
    assert key not in decode_sm90._VIEWS


@pytest.mark.parametrize(("change", "reason"), [
    ({"target": NVIDIA.target("sm100")}, "sm100: Hopper"),
    ({"target": NVIDIA.target("sm90", interpreted=True)}, "sm90 interpreted"),
    ({"dtype": torch.bfloat16}, "q dtype torch.bfloat16"),
    ({"page": 32}, "pages of 32 keys"),
    ({"dim": 64}, "of dim 64"),
    ({"heads": 48}, "48 heads"),
    ({"groups": 4}, "4 draft tokens"),
    ({"pages": 0}, "empty, non-contiguous or not 16-byte aligned cache"),
    ({"strided_out": True}, "unit strides"),
    ({"far": "context_lens"}, "offsets pass 2^31 elements"),
    ({"far": "row_to_batch"}, "offsets pass 2^31 elements"),
    ({"far": "q"}, "offsets pass 2^31 elements"),
])
def test_declines_with_the_reason(change, reason):
    q, cache, w, table, out = _args(heads=change.get("heads", 64), dim=change.get("dim", 128),
                                    page=change.get("page", 64), pages=change.get("pages", 8))
    if "dtype" in change:
        q = q.to(change["dtype"])
    if change.get("strided_out"):
        out = torch.zeros(out.shape[1], out.shape[0]).t()
    far = {}  # a view whose last element lies past 2^31 elements (an int32 stride): gigabytes virtual, none touched
    if change.get("far") == "q":
        head = 2**26  # 63 heads apart: past 2^31
        q = torch.empty(2 * 64 * head, dtype=FP8).as_strided(q.shape, (64 * head, 64 * head, head, 1))
    elif "far" in change:
        far[change["far"]] = torch.empty(2 * (2**30 + 1) + 1, dtype=torch.int32).as_strided((3,), (2**30 + 1,))
    reasons = decode_sm90.unsupported(q, cache, w, table, out, change.get("page", 64), change.get("groups", 1),
                                      change.get("target", HOPPER), **far)
    assert any(reason in r for r in reasons), reasons


def _case(batch, next_n, contexts, max_len, pages, table_pages, seed, heads=64):
    """Random fp8 keys through the reference store; the table has holes (-1) and an entry past the cache."""
    g = torch.Generator().manual_seed(seed)
    cache = reference.store_index_k(torch.randn(pages * 64, 128, generator=g) * 3, new_packed_cache(pages, 64, 128),
                                    torch.arange(pages * 64, dtype=torch.int32), FP8)
    q = (torch.randn(batch, next_n, heads, 128, generator=g) * 3).clamp(-200, 200).to(FP8)
    w = torch.randn(batch * next_n, heads, generator=g)
    table = torch.randint(0, pages, (batch, table_pages), dtype=torch.int32, generator=g)
    table.view(-1)[torch.randint(0, table.numel(), (max(1, table.numel() // 10),), generator=g)] = -1
    table.view(-1)[0] = pages
    return q, cache, w, torch.tensor(contexts, dtype=torch.int32), table, max_len


_CASES = [
    # (batch, next_n, contexts, max_len, pages, table_pages): short rows of every kind, many programs a request
    (4, 1, [317, 0, 329, 2], 288, 10, 5),
    (4, 2, [317, -3, 329, 3], 288, 10, 5),
    (4, 3, [317, 0, 329, 4], 288, 10, 5),
    (70, 1, list(range(-5, 3000, 43)), 3100, 400, 50),
    # More requests than the schedule reads at once (256): its second block, short requests in both.
    (300, 1, [i * 37 % 700 - 3 for i in range(300)], 640, 600, 11),
    # Few long requests: each program walks many pages, past request ends, over requests without keys.
    (16, 1, [60000, 41000, 999, 0, 59999, 12, 64, -4, 30000, 70000, 1, 65, 128, 2000, 45000, 7], 60000, 15000, 940),
    (16, 2, [60000, 41000, 999, 0, 59999, 12, 64, -4, 30000, 70000, 1, 65, 128, 2000, 45000, 7], 60000, 15000, 940),
]


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
@pytest.mark.parametrize("case", _CASES, ids=lambda c: f"b{c[0]}-n{c[1]}-ctx{max(c[2])}")
@pytest.mark.parametrize("stages", [2, 4])
def test_equals_the_triton_kernel_on_hopper(case, stages):
    target = detect(NVIDIA)[2]
    table_cfg = cuda_backend.tuning(target.arch)["paged_mqa_logits"]
    args = [a.cuda() if torch.is_tensor(a) else a for a in _case(*case, seed=len(_CASES) * stages)]
    outs = []
    for cfg in ({**table_cfg, "KERNEL": "triton"}, {**table_cfg, "KERNEL": "tma-ws", "TMA_STAGES": stages}):
        buf = torch.full((args[0].shape[0] * args[0].shape[1] + 2, args[-1]), float("nan"), device="cuda")
        logits.paged_mqa_logits(*args, buf[1:-1], target=target, cfg=cfg)
        assert buf[0].isnan().all() and buf[-1].isnan().all(), "a kernel wrote outside its output"
        outs.append(buf[1:-1])
    triton_out, tma_out = outs
    assert not tma_out.isnan().any()
    assert torch.equal(triton_out, tma_out)


def _both(args, skip=-1, row_to_batch=None, stages=4):
    """The logits of the Triton kernel and of this one on ``args`` (a NaN row on each side of the output: neither
    may write there)."""
    target = detect(NVIDIA)[2]
    table_cfg = cuda_backend.tuning(target.arch)["paged_mqa_logits"]
    q = args[0]
    outs = []
    for cfg in ({**table_cfg, "KERNEL": "triton"}, {**table_cfg, "KERNEL": "tma-ws", "TMA_STAGES": stages}):
        buf = torch.full((q.shape[0] * q.shape[1] + 2, args[-1]), float("nan"), device="cuda")
        launch = logits.paged_mqa_logits_launch(*args, buf[1:-1], row_to_batch=row_to_batch, target=target, cfg=cfg,
                                                skip=skip)
        assert launch.launcher is (logits.DECODE if cfg["KERNEL"] == "triton" else decode_sm90.TMA_DECODE)
        launch()
        assert buf[0].isnan().all() and buf[-1].isnan().all(), "a kernel wrote outside its output"
        outs.append(buf[1:-1])
    return outs


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
@pytest.mark.parametrize("case", [_CASES[1], _CASES[3], _CASES[6]], ids=lambda c: f"b{c[0]}-n{c[1]}-ctx{max(c[2])}")
def test_requests_at_most_skip_are_left_unwritten_as_the_triton_kernel_leaves_them(case):
    args = [a.cuda() if torch.is_tensor(a) else a for a in _case(*case, seed=5)]
    skip = 300
    triton_out, tma_out = _both(args, skip=skip)
    kept = (args[3].clamp(0, args[-1]) > skip).repeat_interleave(args[0].shape[1]).cuda()
    assert tma_out[~kept].isnan().all() and not tma_out[kept].isnan().any()
    assert torch.equal(triton_out.nan_to_num(7.0), tma_out.nan_to_num(7.0))


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
@pytest.mark.parametrize("skip", [-1, 200])
def test_ragged_rows_equal_the_triton_kernel_and_the_uniform_form(skip):
    """Ragged rows two a program: the uniform next_n 2 call's rows (each request's pair at an even row) give its
    logits bit for bit; rows in any order, runs starting at odd rows, rows naming no request, equal the Triton
    kernel's (one row a program)."""
    q, cache, w, ctx, table, max_len = [a.cuda() if torch.is_tensor(a) else a for a in _case(*_CASES[6], seed=9)]
    batch = q.shape[0]
    rows = torch.arange(2 * batch, device="cuda")
    r2b = (rows // 2).to(torch.int32)
    lens = (ctx.long()[rows // 2] - 1 + rows % 2).to(torch.int32)
    ragged = (q.view(2 * batch, 1, *q.shape[2:]), cache, w, lens, table, max_len)
    uniform_out = _both((q, cache, w, ctx, table, max_len), skip=skip)[1]
    triton_out, tma_out = _both(ragged, skip=skip, row_to_batch=r2b)
    assert torch.equal(tma_out.nan_to_num(7.0), uniform_out.nan_to_num(7.0))
    assert torch.equal(triton_out.nan_to_num(7.0), tma_out.nan_to_num(7.0))
    g = torch.Generator().manual_seed(3)
    odd = torch.cat([torch.tensor([0]), torch.randperm(2 * batch - 1, generator=g) + 1]).cuda()  # shuffled
    for order, names in ((odd, r2b[odd]), (rows.roll(1), r2b.roll(1)),  # runs starting at odd rows
                         (rows, torch.where(rows % 5 == 3, torch.where(rows % 2 == 0, -1, batch), r2b).int())):
        args = (ragged[0][order], cache, w[order], lens[order], table, max_len)
        triton_out, tma_out = _both(args, skip=skip, row_to_batch=names.to(torch.int32).contiguous())
        assert torch.equal(triton_out.nan_to_num(7.0), tma_out.nan_to_num(7.0))


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
def test_kept_call_and_graph_replay_on_hopper():
    """The op's kept call (``prepare``: the launch bound once) through this kernel equals a direct call, and so does
    its replay in a CUDA graph after the inputs change in place."""
    target = detect(NVIDIA)[2]
    table = cuda_backend.tuning(target.arch)
    cfg = {**table["paged_mqa_logits"], "KERNEL": "tma-ws"}
    impl = logits.ops(target, {**table, "paged_mqa_logits": cfg})["paged_mqa_logits"]
    q, cache, w, ctx, tab, max_len = [a.cuda() if torch.is_tensor(a) else a for a in _case(*_CASES[3], seed=11)]
    out = torch.full((q.shape[0] * q.shape[1], max_len), float("nan"), device="cuda")
    run = impl.prepare(q=q, k_cache=cache, weights=w, context_lens=ctx, page_table=tab, max_context_len=max_len,
                       out=out)
    run()
    assert torch.equal(out, logits.paged_mqa_logits(q, cache, w, ctx, tab, max_len, torch.empty_like(out),
                                                    target=target, cfg=cfg))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_((torch.randn(q.shape, device="cuda") * 3).to(FP8))
    w.copy_(torch.randn(w.shape, device="cuda"))
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, logits.paged_mqa_logits(q, cache, w, ctx, tab, max_len, torch.empty_like(out),
                                                    target=target, cfg=cfg))


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
def test_a_kept_call_keeps_no_cache_memory_alive_on_hopper():
    """The public op's kept call (given ``out``, from its second call) held the Hopper kernel's tensor descriptors,
    whose bases are views of the cache: freeing the cache freed nothing while the memo kept the call. Now the cache's
    memory goes when the caller's last reference does."""
    import gc

    import indexcache
    from indexcache.hal import dispatch

    if dispatch.get_backend() != "cuda":
        pytest.skip(f"the cuda backend is not the one in force here ({dispatch.get_backend()})")
    q, cache, w, ctx, tab, max_len = [a.cuda() if torch.is_tensor(a) else a for a in _case(*_CASES[3], seed=5)]
    out = torch.empty(q.shape[0] * q.shape[1], max_len, device="cuda")
    for _ in range(3):
        indexcache.paged_mqa_logits(q, cache, w, ctx, tab, max_len, out=out)
    torch.cuda.synchronize()
    size, before = cache.untyped_storage().nbytes(), torch.cuda.memory_allocated()
    del cache
    gc.collect()
    assert torch.cuda.memory_allocated() <= before - size


def _fp4_case(batch, next_n, contexts, max_len, pages, table_pages, seed, heads=64):
    """:func:`_case` on an MXFP4 cache written by the reference rule, with keys of every kind: most with block scales
    close together (one scale a key), every seventh with blocks 2^20 apart (the exact path), two with a NaN block
    scale (byte 255)."""
    q, _, w, ctx, table, max_len = _case(batch, next_n, contexts, max_len, pages, table_pages, seed, heads)
    g = torch.Generator().manual_seed(seed + 1)
    raw = torch.randn(pages * 64, 128, generator=g) * 3
    spread = torch.exp2(torch.tensor([-14.0, 0.0, 6.0, -3.0])).repeat_interleave(32)
    raw[::7] *= spread
    cache = reference.store_index_k(raw, new_packed_cache(pages, 64, 128, fp8_dtype=fp4.FP4),
                                    torch.arange(pages * 64, dtype=torch.int32), fp4.FP4)
    scales = split_packed_cache(cache, 128, fp4.FP4)[1].view(torch.uint8)  # [pages, 64, 4]
    scales[0, 5, 2] = scales[pages - 1, 55, 0] = 255
    bytes_ = scales.reshape(-1, 4).int()
    assert ((bytes_.amax(1) - bytes_.amin(1) > 10) & (bytes_.amax(1) < 255)).sum() > pages * 64 // 8
    return q, cache, w, ctx, table, max_len


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
@pytest.mark.parametrize("case", _CASES, ids=lambda c: f"b{c[0]}-n{c[1]}-ctx{max(c[2])}")
def test_mxfp4_cache_equals_the_triton_kernel_within_rounding(case):
    """An MXFP4 cache: the same -inf and NaN as the Triton kernel (which widens to the same e4m3 values in another
    order of the dims), the finite logits within the fp32 sums' rounding; keys with blocks far apart (the exact
    path) and NaN block scales among them; nothing written outside the output."""
    target = detect(NVIDIA)[2]
    table_cfg = cuda_backend.tuning(target.arch)["paged_mqa_logits"]
    args = [a.cuda() if torch.is_tensor(a) else a for a in _fp4_case(*case, seed=21)]
    q = args[0]
    outs = []
    for cfg in ({**table_cfg, "KERNEL": "triton"}, {**table_cfg, "KERNEL": "tma-ws"}):
        buf = torch.full((q.shape[0] * q.shape[1] + 2, args[-1]), 7.0, device="cuda")
        launch = logits.paged_mqa_logits_launch(*args, buf[1:-1], fp4.FP4, target=target, cfg=cfg)
        assert launch.launcher is (logits.DECODE if cfg["KERNEL"] == "triton" else decode_sm90.TMA_DECODE)
        launch()
        assert (buf[0] == 7).all() and (buf[-1] == 7).all(), "a kernel wrote outside its output"
        outs.append(buf[1:-1])
    triton_out, tma_out = outs
    assert (tma_out != 7).all(), "a logit left unwritten"
    assert torch.equal(triton_out.isnan(), tma_out.isnan())
    assert torch.equal(triton_out.isneginf(), tma_out.isneginf())
    finite = triton_out.isfinite()
    torch.testing.assert_close(tma_out[finite], triton_out[finite], rtol=1e-3,
                               atol=1e-4 * triton_out[finite].abs().max().item())


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
def test_mxfp4_cache_equals_the_reference_within_the_fp8_bound():
    """Against the float64 reference on a small case (the exact path's keys among them): the relative RMS error of
    each row within the bound the fp8 decode is judged by."""
    target = detect(NVIDIA)[2]
    cfg = {**cuda_backend.tuning(target.arch)["paged_mqa_logits"], "KERNEL": "tma-ws"}
    q, cache, w, ctx, table, max_len = _fp4_case(*_CASES[1], seed=4)
    want = reference.paged_mqa_logits(q, cache, w, ctx, table, max_len, k_format=fp4.FP4)
    got = logits.paged_mqa_logits(q.cuda(), cache.cuda(), w.cuda(), ctx.cuda(), table.cuda(), max_len,
                                  torch.empty(want.shape, device="cuda"), fp4.FP4, target=target, cfg=cfg).cpu()
    assert torch.equal(got.isneginf(), want.isneginf()) and torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    err = ((got.double() - want.double()).where(finite, 0.0).square().sum(1)
           / want.double().where(finite, 0.0).square().sum(1).clamp_min(1e-30)).sqrt()
    assert err.max() <= 1e-3, err.max()
