"""The producer step of decode on the GPU backends (``backends/triton/producer.py``): which calls count the logits
into the score histograms (``score_hist.py``), and, on an sm90 GPU, the counts themselves, the step's result against
``topk_translate`` of its own logits, and the histograms left zero.

Gluon kernels do not run under the interpreter: off Hopper only the host side is checked here; the conformance
suite runs the op on every backend (on the CPU, interpreted, through the unfused launches). ``ci/gpu.sh`` runs the
GPU cases on the H200.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import indexcache  # noqa: E402
from indexcache.backends import cuda as cuda_backend  # noqa: E402
from indexcache.backends.triton import decode_sm90, logits, producer, score_hist  # noqa: E402
from indexcache.backends.triton.target import Target  # noqa: E402
from indexcache.hal import reference  # noqa: E402
from indexcache.hal.layout import new_packed_cache  # noqa: E402

FP8 = torch.float8_e4m3fn
HOPPER = Target("cuda", "sm90", 32, FP8, interpreted=False)
on_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                               reason="the Gluon kernels need an sm90 GPU")


def _tuning():
    tuning = {op: dict(cfg) for op, cfg in cuda_backend.tuning("sm90").items()}
    tuning["paged_mqa_logits"]["KERNEL"] = "tma-ws"
    return tuning


def _case(batch, next_n, contexts, max_len, pages, seed, device="cpu", k=64, ties=False):
    """Random fp8 keys through the reference store, a block table with holes, a KV table of 64-token pages."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(pages * 64, 128, generator=g) * 3
    cache = reference.store_index_k(keys, new_packed_cache(pages, 64, 128), torch.arange(pages * 64, dtype=torch.int32),
                                    FP8)
    q = (torch.randn(batch, next_n, 64, 128, generator=g) * 3).clamp(-200, 200).to(FP8)
    w = torch.randn(batch * next_n, 64, generator=g)
    if ties:  # every logit a multiple of a large power of two: few distinct values, heavy ties
        w = w.sign() * 2.0**10
    table_pages = max(1, -(-max_len // 64))
    block_table = torch.randint(0, pages, (batch, table_pages), dtype=torch.int32, generator=g)
    block_table.view(-1)[torch.randint(0, block_table.numel(), (max(1, block_table.numel() // 20),), generator=g)] = -1
    page_table = torch.randint(0, 10 * pages, (batch, table_pages), dtype=torch.int32, generator=g)
    args = dict(q=q, k_cache=cache, weights=w, context_lens=torch.tensor(contexts, dtype=torch.int32),
                block_table=block_table, max_context_len=max_len, k=k, page_table=page_table, page_size=64)
    return {name: v.to(device) if isinstance(v, torch.Tensor) else v for name, v in args.items()}


def _outputs(args):
    rows = args["q"].shape[0] * args["q"].shape[1]
    dev = args["q"].device
    return dict(logits=torch.empty(rows, args["max_context_len"], device=dev),
                out=torch.empty(rows, args["k"], dtype=torch.int32, device=dev),
                out_raw=torch.empty(rows, args["k"], dtype=torch.int32, device=dev))


def _counted(args, outs):
    return producer.counts_logits(args["q"], args["k_cache"], args["weights"], args["block_table"], outs["logits"],
                                  args["k"], target=HOPPER, tuning=_tuning())


def test_counts_with_one_draft_token_only():
    args = _case(40, 1, [4096] * 40, 4096, 8, 0, device="meta")
    assert _counted(args, _outputs(args))
    drafts = _case(20, 2, [4096] * 20, 4096, 8, 0, device="meta")
    assert not _counted(drafts, _outputs(drafts))


@pytest.mark.parametrize(("change", "why"), [({"k": 0}, "k 0"), ({"max_len": 0}, "no columns"),
                                             ({"target": Target("cuda", "sm100", 32, FP8, interpreted=False)}, "sm100"),
                                             ({"k": 4096}, "k past the block top-k's")])
def test_counts_only_where_both_gluon_kernels_take_the_call(change, why):
    args = _case(40, 1, [4096] * 40, change.get("max_len", 4096), 8, 0, device="meta", k=change.get("k", 64))
    outs = _outputs(args)
    assert not producer.counts_logits(args["q"], args["k_cache"], args["weights"], args["block_table"], outs["logits"],
                                      args["k"], target=change.get("target", HOPPER), tuning=_tuning()), why


def test_histogram_needs_the_gluon_decode():
    args = _case(4, 1, [100] * 4, 128, 8, 0, device="meta")
    outs = _outputs(args)
    tuning = _tuning()
    tuning["paged_mqa_logits"]["KERNEL"] = "triton"
    with pytest.raises(ValueError, match="score_hist: only the Gluon decode"):
        logits.paged_mqa_logits_launch(args["q"], args["k_cache"], args["weights"], args["context_lens"],
                                       args["block_table"], 128, outs["logits"], target=HOPPER,
                                       cfg=tuning["paged_mqa_logits"], score_hist=torch.zeros(4, 4, device="meta"))


def test_two_draft_tokens_a_program_are_not_counted():
    args = _case(4, 2, [100] * 4, 128, 8, 0, device="meta")
    outs = _outputs(args)
    with pytest.raises(ValueError, match="hist: the logits are counted with one draft token"):
        decode_sm90.launch(args["q"], args["k_cache"], args["weights"], args["context_lens"], args["block_table"], 128,
                           outs["logits"], page=64, groups=2, target=HOPPER, cfg=_tuning()["paged_mqa_logits"],
                           sms=132, batch_block=128, hist=torch.zeros(8, score_hist.ROW_WORDS, device="meta"))


def _histogram(logits_rows: torch.Tensor) -> torch.Tensor:
    """What ``score_hist.count`` leaves for these logits (every finite one counted)."""
    bits = logits_rows.contiguous().view(torch.int32).to(torch.int64)
    bits = torch.where(bits == -(2**31), 0, bits)  # -0.0 as +0.0
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    finite = torch.isfinite(logits_rows)
    coarse, half, fine = score_hist.COARSE.value, score_hist.COARSE_HALF.value, score_hist.FINE.value
    hist = torch.zeros(logits_rows.shape[0], score_hist.ROW_WORDS, dtype=torch.int64)
    for r in range(logits_rows.shape[0]):
        kr = key[r][finite[r]]
        hist[r, :coarse] = torch.bincount((kr >> 21) + half, minlength=coarse)
        hist[r, coarse:] = torch.bincount(kr[kr >= 0] >> 16, minlength=fine)
    return hist


@on_hopper
def test_the_decode_kernel_counts_every_visible_finite_logit():
    args = _case(40, 1, [0, 1, 64, 65, 3000, 4096, -5] + [4000] * 33, 4096, 96, 1, device="cuda")
    outs = _outputs(args)
    hist = torch.zeros(40, score_hist.ROW_WORDS, dtype=torch.int32, device="cuda")
    launch = logits.paged_mqa_logits_launch(args["q"], args["k_cache"], args["weights"], args["context_lens"],
                                            args["block_table"], 4096, outs["logits"], target=HOPPER,
                                            cfg=_tuning()["paged_mqa_logits"], score_hist=hist)
    launch()
    torch.cuda.synchronize()
    assert torch.equal(hist.cpu().to(torch.int64), _histogram(outs["logits"].cpu()))


@on_hopper
@pytest.mark.parametrize(("batch", "max_len", "k", "ties"), [
    (64, 32768, 2048, False), (40, 8192, 512, False), (36, 4096, 64, True), (33, 3000, 2048, False),
])
def test_the_step_selects_from_its_logits_and_clears_the_histograms(batch, max_len, k, ties):
    g = torch.Generator().manual_seed(batch)
    contexts = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    contexts[:3] = [0, k, k + 1]  # no keys, exactly k, one more than k
    args = _case(batch, 1, contexts, max_len, max_len // 64 + 8, 2, device="cuda", k=k, ties=ties)
    outs = _outputs(args)
    stale = score_hist.histograms(torch.device("cuda"), batch)
    assert not stale.any()
    assert _counted(args, outs)
    indexcache.paged_topk_translate(**args, **outs, backend="cuda")
    want = _outputs(args)
    indexcache.topk_translate(outs["logits"], args["context_lens"], k, args["page_table"], 64, out=want["out"],
                              out_raw=want["out_raw"], backend="torch")
    same = [sorted(a) == sorted(b) for a, b in zip(outs["out_raw"].tolist(), want["out_raw"].tolist(), strict=True)]
    assert all(same), [r for r, ok in enumerate(same) if not ok][:5]
    again = indexcache.translate(outs["out_raw"], args["page_table"], args["context_lens"], 64, backend="torch")
    assert torch.equal(outs["out"], again)
    assert not stale.any()


@on_hopper
def test_stale_counts_cost_time_not_the_result():
    args = _case(48, 1, [8192] * 48, 8192, 136, 3, device="cuda", k=1024)
    outs = _outputs(args)
    hist = score_hist.histograms(torch.device("cuda"), 48)
    hist[:48, :score_hist.COARSE].random_(0, 500)  # counts that place the k-th best anywhere
    indexcache.paged_topk_translate(**args, **outs, backend="cuda")
    want = indexcache.topk(outs["logits"], args["context_lens"], 1024, backend="torch")
    assert [sorted(r) for r in outs["out_raw"].tolist()] == [sorted(r) for r in want.tolist()]
    hist.zero_()
