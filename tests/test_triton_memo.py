"""Eager calls repeated with the same arguments run the kept launches (indexcache.hal.memo), on the cuda backend's
kernels interpreted on the CPU: no check, no dispatch, the new contents of the same buffers read, and nothing
kept where the call allocates its output, under another backend choice, or after ``dispatch.reset()``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import indexcache
from indexcache.hal import dispatch, memo, reference
from indexcache.hal.layout import new_packed_cache
from indexcache.hal.specs import SPECS

pytestmark = pytest.mark.usefixtures("interpreted")

I32 = torch.int32


def _translate_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-1, 300, (3, 17), generator=g, dtype=I32)
    table = torch.randint(-1, 50, (3, 5), generator=g, dtype=I32)
    lens = torch.randint(0, 320, (3,), generator=g, dtype=I32)
    return raw, table, lens


@pytest.fixture
def counted_checks(monkeypatch):
    """How often translate's spec check ran."""
    calls = []
    check = SPECS["translate"].check
    counted = dataclasses.replace(SPECS["translate"], check=lambda *a, **k: calls.append(1) or check(*a, **k))
    monkeypatch.setitem(SPECS, "translate", counted)
    return calls


def test_a_repeated_call_runs_the_kept_launch_on_the_buffers_new_contents(counted_checks):
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    out = torch.full_like(raw, -7)
    indexcache.translate(raw, table, lens, 64, out=out, backend="cuda")
    assert memo.size() == 1 and len(counted_checks) == 1
    for seed in (1, 2):
        new_raw, new_table, new_lens = _translate_inputs(seed)
        raw.copy_(new_raw), table.copy_(new_table), lens.copy_(new_lens)
        got = indexcache.translate(raw, table, lens, 64, out=out, backend="cuda")
        assert got is out
        assert torch.equal(out, reference.translate(raw, table, lens, 64))
    assert memo.size() == 1 and len(counted_checks) == 1  # checked once, then run from the memo


def test_calls_that_differ_are_kept_apart(counted_checks):
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    out, other = torch.empty_like(raw), torch.empty_like(raw)
    indexcache.translate(raw, table, lens, 64, out=out, backend="cuda")
    indexcache.translate(raw, table, lens, 32, out=out, backend="cuda")  # another page size
    indexcache.translate(raw, table, lens, 64, out=other, backend="cuda")  # another output
    indexcache.translate(raw[:, :9], table, lens, 64, out=out[:, :9], backend="cuda")  # another shape
    assert memo.size() == 4 and len(counted_checks) == 4
    assert torch.equal(out[:, :9], reference.translate(raw[:, :9], table, lens, 64))


def test_allocated_outputs_and_the_torch_backend_are_not_kept(counted_checks):
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    indexcache.translate(raw, table, lens, 64, backend="cuda")  # out allocated: nothing to keep
    indexcache.translate(raw, table, lens, 64, out=torch.empty_like(raw), backend="torch")  # no prepare
    assert memo.size() == 0 and len(counted_checks) == 2


def test_the_backend_choice_is_part_of_the_signature(counted_checks):
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    out = torch.empty_like(raw)
    indexcache.translate(raw, table, lens, 64, out=out, backend="cuda")
    with indexcache.use_backend("torch"):
        out.fill_(-5)
        indexcache.translate(raw, table, lens, 64, out=out)
    assert len(counted_checks) == 2
    assert torch.equal(out, reference.translate(raw, table, lens, 64))


def test_reset_forgets_kept_calls(counted_checks):
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    out = torch.empty_like(raw)
    indexcache.translate(raw, table, lens, 64, out=out, backend="cuda")
    dispatch.reset()
    assert memo.size() == 0
    indexcache.translate(raw, table, lens, 64, out=out, backend="cuda")
    assert len(counted_checks) == 2


def test_a_full_memo_is_emptied_before_it_grows(monkeypatch):
    dispatch.reset()
    monkeypatch.setattr(memo, "MAX_ENTRIES", 2)
    raw, table, lens = _translate_inputs(0)
    outs = [torch.empty_like(raw) for _ in range(3)]
    for out in outs:
        indexcache.translate(raw, table, lens, 64, out=out, backend="cuda")
    assert memo.size() == 1


def test_every_op_with_given_outputs_is_kept_and_repeats_exactly():
    """topk (sorted and not), topk_translate, both logits ops and store_index_k: the second call comes from the
    memo and equals the first."""
    dispatch.reset()
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 300, generator=g)
    lens = torch.tensor([300, 120, 5, 0], dtype=I32)
    table = torch.randint(0, 40, (4, 40), generator=g, dtype=I32)
    for sorted_ in (False, True):
        out = torch.empty(4, 16, dtype=I32)
        first = indexcache.topk(scores, lens, 16, out=out, sorted=sorted_, backend="cuda").clone()
        assert torch.equal(indexcache.topk(scores, lens, 16, out=out, sorted=sorted_, backend="cuda"), first)
        fused_raw = torch.empty(4, 16, dtype=I32)
        fused = indexcache.topk_translate(scores, lens, 16, table, 8, out=out, out_raw=fused_raw, sorted=sorted_,
                                          backend="cuda").clone()
        assert torch.equal(indexcache.topk_translate(scores, lens, 16, table, 8, out=out, out_raw=fused_raw,
                                                     sorted=sorted_, backend="cuda"), fused)
    keys = torch.randn(32, 64, generator=g)
    cache = new_packed_cache(num_pages=4, page_size=8, dim=64)
    slots = torch.randperm(32, generator=g).to(I32)
    indexcache.store_index_k(keys, cache, slots, backend="cuda")
    stored = cache.clone()
    cache.zero_()
    indexcache.store_index_k(keys, cache, slots, backend="cuda")
    assert torch.equal(cache, stored)
    q = torch.randn(2, 1, 4, 64, generator=g).to(torch.float8_e4m3fn)
    weights = torch.rand(2, 4, generator=g)
    ctx = torch.tensor([32, 20], dtype=I32)
    pages = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=I32)
    logits = torch.empty(2, 32)
    first = indexcache.paged_mqa_logits(q, cache, weights, ctx, pages, 32, out=logits, backend="cuda").clone()
    assert torch.equal(indexcache.paged_mqa_logits(q, cache, weights, ctx, pages, 32, out=logits, backend="cuda"),
                       first)
    k8, scale = indexcache.quantize_index_k(keys, block=64, backend="cuda")
    prefill = torch.empty(2, 32)
    ks, ke = torch.zeros(2, dtype=I32), torch.tensor([32, 10], dtype=I32)
    scale = scale[:, 0].contiguous()
    first = indexcache.mqa_logits(q[:, 0], k8, scale, weights, ks, ke, out=prefill, backend="cuda").clone()
    assert torch.equal(indexcache.mqa_logits(q[:, 0], k8, scale, weights, ks, ke, out=prefill, backend="cuda"), first)
    assert memo.size() == 7  # topk and topk_translate, sorted and not; store; both logits ops
