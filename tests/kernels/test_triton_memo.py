"""Eager calls repeated with the same arguments run the kept launches (indexcache.hal.memo), on the cuda backend's
kernels interpreted on the CPU: a signature's second call binds and keeps its launches, later ones run them with
no check and no dispatch, reading the new contents of the same buffers; nothing is kept where the call allocates
its output, under another backend choice, or after ``dispatch.reset()``."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np
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
    for seed in range(4):
        new_raw, new_table, new_lens = _translate_inputs(seed)
        raw.copy_(new_raw), table.copy_(new_table), lens.copy_(new_lens)
        got = indexcache.translate(raw, table, lens, 64, out=out, backend="cuda")
        assert got is out
        assert torch.equal(out, reference.translate(raw, table, lens, 64))
        assert memo.size() == (0 if seed == 0 else 1)  # noted on the first call, kept on the second
    assert len(counted_checks) == 2  # checked twice, then run from the memo


def _twice(fn) -> None:
    fn()
    fn()


def test_calls_that_differ_are_kept_apart(counted_checks):
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    out, other = torch.empty_like(raw), torch.empty_like(raw)
    _twice(lambda: indexcache.translate(raw, table, lens, 64, out=out, backend="cuda"))
    _twice(lambda: indexcache.translate(raw, table, lens, 32, out=out, backend="cuda"))  # another page size
    _twice(lambda: indexcache.translate(raw, table, lens, 64, out=other, backend="cuda"))  # another output
    _twice(lambda: indexcache.translate(raw[:, :9], table, lens, 64, out=out[:, :9], backend="cuda"))  # a shape
    assert memo.size() == 4 and len(counted_checks) == 8
    indexcache.translate(raw, table, lens, 32, out=out, backend="cuda")
    assert len(counted_checks) == 8
    assert torch.equal(out, reference.translate(raw, table, lens, 32))


def test_allocated_outputs_and_the_torch_backend_are_not_kept(counted_checks):
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    out = torch.empty_like(raw)
    for _ in range(3):
        indexcache.translate(raw, table, lens, 64, backend="cuda")  # out allocated: nothing to keep
        indexcache.translate(raw, table, lens, 64, out=out, backend="torch")  # no prepare
    assert memo.size() == 0 and len(counted_checks) == 6


def test_the_backend_choice_is_part_of_the_signature(counted_checks):
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    out = torch.empty_like(raw)
    _twice(lambda: indexcache.translate(raw, table, lens, 64, out=out, backend="cuda"))
    with indexcache.use_backend("torch"):
        out.fill_(-5)
        indexcache.translate(raw, table, lens, 64, out=out)
    assert len(counted_checks) == 3
    assert torch.equal(out, reference.translate(raw, table, lens, 64))


def test_reset_forgets_kept_calls(counted_checks):
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    out = torch.empty_like(raw)
    _twice(lambda: indexcache.translate(raw, table, lens, 64, out=out, backend="cuda"))
    assert memo.size() == 1
    dispatch.reset()
    assert memo.size() == 0
    indexcache.translate(raw, table, lens, 64, out=out, backend="cuda")
    assert len(counted_checks) == 3


def test_a_full_memo_drops_the_least_recently_used(monkeypatch, counted_checks):
    """Three signatures in a memo of two: the one used least recently goes; the one repeated in between stays kept."""
    dispatch.reset()
    monkeypatch.setattr(memo, "MAX_ENTRIES", 2)
    raw, table, lens = _translate_inputs(0)
    outs = [torch.empty_like(raw) for _ in range(3)]

    def call(i):
        indexcache.translate(raw, table, lens, 64, out=outs[i], backend="cuda")

    _twice(lambda: call(0))
    _twice(lambda: call(1))
    call(0)  # from the memo: now the most recently used
    assert len(counted_checks) == 4
    _twice(lambda: call(2))  # takes the place of 1
    assert memo.size() == 2 and len(memo._kept) == 2
    call(0)
    assert len(counted_checks) == 6  # 0 still kept
    call(1)
    assert len(counted_checks) == 7  # 1 checked afresh


def test_every_op_with_given_outputs_is_kept_and_repeats_exactly():
    """topk (sorted and not), topk_translate, both logits ops, store_index_k and quantize_index_k: the second call binds
    and keeps, the third comes from the memo, and both equal the first."""
    dispatch.reset()
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 300, generator=g)
    lens = torch.tensor([300, 120, 5, 0], dtype=I32)
    table = torch.randint(0, 40, (4, 40), generator=g, dtype=I32)

    def thrice(call, result):
        first = call().clone()
        for _ in range(2):
            result.fill_(-3)
            assert torch.equal(call(), first)

    for sorted_ in (False, True):
        out, fused_raw = torch.empty(4, 16, dtype=I32), torch.empty(4, 16, dtype=I32)
        thrice(lambda out=out, s=sorted_: indexcache.topk(scores, lens, 16, out=out, sorted=s, backend="cuda"), out)
        thrice(lambda out=out, raw=fused_raw, s=sorted_: indexcache.topk_translate(
            scores, lens, 16, table, 8, out=out, out_raw=raw, sorted=s, backend="cuda"), out)
    keys = torch.randn(32, 64, generator=g)
    cache = new_packed_cache(num_pages=4, page_size=8, dim=64)
    slots = torch.randperm(32, generator=g).to(I32)

    def store():
        indexcache.store_index_k(keys, cache, slots, backend="cuda")
        return cache

    thrice(store, cache)
    q = torch.randn(2, 1, 4, 64, generator=g).to(torch.float8_e4m3fn)
    weights = torch.rand(2, 4, generator=g)
    ctx = torch.tensor([32, 20], dtype=I32)
    pages = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=I32)
    logits = torch.empty(2, 32)
    thrice(lambda: indexcache.paged_mqa_logits(q, cache, weights, ctx, pages, 32, out=logits, backend="cuda"), logits)
    for fmt, outputs in ((torch.float8_e4m3fn, (torch.empty(32, 64, dtype=torch.float8_e4m3fn), torch.empty(32, 1))),
                         (torch.float4_e2m1fn_x2, (torch.empty(32, 32, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
                                                   torch.empty(32, 2, dtype=torch.uint8).view(torch.float8_e8m0fnu)))):
        written = []
        for _ in range(3):  # the quantized keys and scales into given outputs: garbage in them before each call
            for t in outputs:
                t.view(torch.uint8).fill_(7)
            got = indexcache.quantize_index_k(keys, fmt, block=64 if fmt == torch.float8_e4m3fn else 32,
                                              out=outputs[0], out_scale=outputs[1], backend="cuda")
            assert got[0] is outputs[0] and got[1] is outputs[1]
            written.append([t.view(torch.uint8).clone() for t in outputs])
        want = reference.quantize_index_k(keys, fmt, block=64 if fmt == torch.float8_e4m3fn else 32)
        assert all(torch.equal(a, w.view(torch.uint8)) for got in written for a, w in zip(got, want, strict=True))
    k8, scale = indexcache.quantize_index_k(keys, block=64, backend="cuda")
    scale = scale[:, 0].contiguous()
    prefill = torch.empty(2, 32)
    ks, ke = torch.zeros(2, dtype=I32), torch.tensor([32, 10], dtype=I32)
    thrice(lambda: indexcache.mqa_logits(q[:, 0], k8, scale, weights, ks, ke, out=prefill, backend="cuda"), prefill)
    host_kv, device_kv = torch.randn(40, 3, generator=g), torch.zeros(12, 3)
    src = torch.tensor([[5, 39, -1], [7, 0, 2]])
    dst, count = torch.tensor([[0, 1, -1], [2, 0, 1]], dtype=I32), torch.tensor([2, 3], dtype=I32)
    loc = torch.randperm(12, generator=g)[:10].view(2, 5).to(I32)
    results = []
    for _ in range(3):  # the swap-in writes only the copied rows: the others start at 0 each time
        device_kv.zero_()
        results.append(indexcache.hisparse_swap_in(src, dst, count, host_kv, device_kv, loc, backend="cuda").clone())
    assert results[0].ne(0).any() and all(torch.equal(r, results[0]) for r in results)
    group = [torch.zeros(12, 3) for _ in range(3)]
    for _ in range(3):  # a group's layers (a list), kept like one tensor
        for layer in group:
            layer.zero_()
        got = indexcache.hisparse_swap_in(src, dst, count, [host_kv] * 3, group, loc, backend="cuda")
        assert got is group and all(torch.equal(layer, results[0]) for layer in group)
    tokens, ages = torch.randint(-1, 300, (2, 16), generator=g, dtype=I32), torch.randint(0, 9, (2, 16), generator=g,
                                                                                           dtype=I32)
    raw = torch.randint(-1, 300, (2, 8), generator=g, dtype=I32)
    lens, host_loc = torch.tensor([300, 12], dtype=I32), torch.arange(600, dtype=I32).view(2, 300)
    outs = dict(out=torch.empty(2, 8, dtype=I32), out_copy_src=torch.empty(2, 8, dtype=torch.int64),
                out_copy_dst=torch.empty(2, 8, dtype=I32), out_copy_count=torch.empty(2, dtype=I32))
    state = (torch.empty_like(tokens), torch.empty_like(ages))
    plans = []
    for _ in range(3):  # the plan moves the state on: each call starts from the same one
        state[0].copy_(tokens), state[1].copy_(ages)
        p = indexcache.hisparse_plan(raw, lens, host_loc, *state, backend="cuda", **outs)
        plans.append([t.clone() for t in p])
    want = reference.hisparse_plan(raw, lens, host_loc, tokens, ages)
    assert all(torch.equal(a, b) for p in plans for a, b in zip(p, want, strict=True))
    assert memo.size() == 12  # topk and topk_translate, sorted and not; store; quantize to fp8 and MXFP4; both logits
    # ops; the swap-ins (a layer, a group); the plan


def test_calls_with_mxfp4_queries_are_kept_with_their_scales():
    """MXFP4 queries (``q_scale``) on MXFP4 keys: the kept launches read the queries' values and scales anew, so new
    queries in the same buffers give the torch backend's logits again, from the memo."""
    dispatch.reset()
    g = torch.Generator().manual_seed(5)
    fp4 = torch.float4_e2m1fn_x2
    cache = new_packed_cache(num_pages=4, page_size=8, dim=64, fp8_dtype=fp4)
    indexcache.store_index_k(torch.randn(32, 64, generator=g), cache, torch.randperm(32, generator=g).to(I32), fp4,
                             backend="cuda")
    keys, key_scales = indexcache.quantize_index_k(torch.randn(40, 64, generator=g), fp4, backend="cuda")
    q, q_scale = (t.view(2, 1, 4, -1) for t in indexcache.quantize_index_k(torch.randn(8, 64), fp4, backend="cuda"))
    weights, ctx = torch.rand(2, 4, generator=g), torch.tensor([32, 20], dtype=I32)
    pages = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]], dtype=I32)
    ks, ke = torch.zeros(2, dtype=I32), torch.tensor([40, 9], dtype=I32)
    decode, prefill = torch.empty(2, 32), torch.empty(2, 40)
    for seed in range(3):
        values, scales = indexcache.quantize_index_k(torch.randn(8, 64, generator=g) * 4 ** seed, fp4, backend="cuda")
        q.view(torch.uint8).copy_(values.view(torch.uint8).view(q.shape))
        q_scale.view(torch.uint8).copy_(scales.view(torch.uint8).view(q_scale.shape))
        indexcache.paged_mqa_logits(q, cache, weights, ctx, pages, 32, out=decode, k_format=fp4, q_scale=q_scale,
                                    backend="cuda")
        indexcache.mqa_logits(q[:, 0], keys, key_scales, weights, ks, ke, q_scale=q_scale[:, 0], out=prefill,
                              backend="cuda")
        want = indexcache.paged_mqa_logits(q, cache, weights, ctx, pages, 32, k_format=fp4, q_scale=q_scale,
                                           backend="torch")
        torch.testing.assert_close(decode, want, rtol=1e-5, atol=1e-6)
        want = indexcache.mqa_logits(q[:, 0], keys, key_scales, weights, ks, ke, q_scale=q_scale[:, 0],
                                     backend="torch")
        torch.testing.assert_close(prefill, want, rtol=1e-5, atol=1e-6)
        assert memo.size() == (0 if seed == 0 else 2)


@pytest.mark.parametrize("call, bad", [
    ("topk", dict(k=True)),
    ("topk", dict(k=1.0)),
    ("topk", dict(k=np.int64(1))),
    ("translate", dict(page_size=64.0)),
    ("translate", dict(page_size=np.int32(64))),
])
def test_a_kept_call_does_not_take_an_argument_only_equal_in_python(call, bad):
    """``True == 1 == 1.0 == np.int64(1)``: an argument the checks refuse must not find a kept call's entry."""
    dispatch.reset()
    raw, table, lens = _translate_inputs(0)
    scores = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    out = torch.empty(3, 1, dtype=I32)
    out_t = torch.empty_like(raw)
    good = dict(k=1, sorted=False, page_size=64)
    run = {"topk": lambda k, sorted, **_: indexcache.topk(scores, lens, k, out=out, sorted=sorted, backend="cuda"),
           "translate": lambda page_size, **_: indexcache.translate(raw, table, lens, page_size, out=out_t,
                                                                    backend="cuda")}
    _twice(lambda: run[call](**good))
    assert memo.size() == 1
    with pytest.raises(TypeError, match=next(iter(bad))):
        run[call](**{**good, **bad})


def test_a_kept_call_keeps_no_tensor_alive():
    """What memo.py and docs/ops.md promise: the kept launches hold addresses, not tensors (interpreted too)."""
    dispatch.reset()
    scores = torch.randn(16, 4096)
    lens = torch.full((16,), 4096, dtype=I32)
    out = torch.empty(16, 8, dtype=I32)
    for _ in range(2):
        indexcache.topk(scores, lens, 8, out=out, backend="cuda")
    assert memo.size() == 1
    expected = reference.topk(scores, lens, 8)
    got = indexcache.topk(scores, lens, 8, out=out, sorted=False, backend="cuda")  # from the memo
    assert torch.equal(got.sort(dim=1).values, expected.sort(dim=1).values)
    freed = [weakref.ref(t) for t in (scores, lens, out)]
    del scores, lens, out, got
    gc.collect()
    assert [ref() for ref in freed] == [None, None, None]


def test_a_signature_seen_again_or_kept_becomes_the_most_recently_used(monkeypatch, counted_checks):
    """Three signatures in a memo of three, the first called again (kept now): a fourth drops the second, not it."""
    dispatch.reset()
    monkeypatch.setattr(memo, "MAX_ENTRIES", 3)
    raw, table, lens = _translate_inputs(0)
    outs = [torch.empty_like(raw) for _ in range(4)]

    def call(i):
        indexcache.translate(raw, table, lens, 64, out=outs[i], backend="cuda")

    for i in (0, 1, 2, 0, 3):  # 0's second call keeps it: the most recently used when 3 comes
        call(i)
    assert len(counted_checks) == 5 and memo.size() == 1
    call(0)
    assert len(counted_checks) == 5  # from the memo
    call(1)
    assert len(counted_checks) == 6  # dropped, checked afresh


def test_the_memo_is_safe_to_share_between_threads(monkeypatch):
    """An engine thread replaying its kept call while two others note passing signatures in a small memo: no look-up
    meets an entry dropped half-way (it raised KeyError when the look-up and its move were two steps)."""
    import sys
    import threading

    monkeypatch.setattr(memo, "MAX_ENTRIES", 4)
    switch = sys.getswitchinterval()
    memo.clear()
    errors, rounds = [], 20000
    key = ("op", None, (int, 1))

    def replaying():
        memo.keep(key, lambda: None)
        for _ in range(rounds):
            try:
                if memo.get(key) is None:
                    memo.keep(key, lambda: None)
            except Exception as e:  # noqa: BLE001  (what the test looks for)
                errors.append(repr(e))
                return

    def passing(t):
        for i in range(rounds):
            try:
                memo.seen(("op", None, (int, t * 10**7 + i)))
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                return

    threads = [threading.Thread(target=replaying)] + [threading.Thread(target=passing, args=(t,)) for t in (1, 2)]
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
        memo.clear()
    assert errors == []


def _in_live_threads(steps: list[int], fn) -> None:
    """``fn()`` run ``steps[i]`` times in thread i, one thread after another, every thread kept alive until all have
    run (so no thread id is reused)."""
    import threading

    done = threading.Event()

    def worker(n, ready):
        for _ in range(n):
            fn()
        ready.set()
        done.wait()

    threads = []
    for n in steps:
        ready = threading.Event()
        threads.append(threading.Thread(target=worker, args=(n, ready)))
        threads[-1].start()
        ready.wait()
    done.set()
    for t in threads:
        t.join()


@pytest.mark.parametrize("op", ["hisparse_plan", "mqa_logits"])
def test_ops_that_scratch_in_the_default_workspace_are_kept_per_thread(monkeypatch, op):
    """hisparse_plan and mqa_logits on MXFP4 keys take no ``workspace=`` but scratch in the calling thread's default
    workspace: a call kept by one thread runs afresh in another (checked again), never on the first one's scratch."""
    from indexcache.hal import fp4
    from indexcache.hal.hisparse import empty_state

    dispatch.reset()
    calls = []
    check = SPECS[op].check
    counted = dataclasses.replace(SPECS[op], check=lambda *a, **k: calls.append(1) or check(*a, **k))
    monkeypatch.setitem(SPECS, op, counted)
    g = torch.Generator().manual_seed(5)
    if op == "hisparse_plan":
        raw = torch.randint(-1, 300, (2, 8), generator=g, dtype=I32)
        lens, host_loc = torch.tensor([300, 12], dtype=I32), torch.arange(600, dtype=I32).view(2, 300)
        outs = dict(out=torch.empty(2, 8, dtype=I32), out_copy_src=torch.empty(2, 8, dtype=torch.int64),
                    out_copy_dst=torch.empty(2, 8, dtype=I32), out_copy_count=torch.empty(2, dtype=I32))
        state = empty_state(2, 16)

        def call():
            indexcache.hisparse_plan(raw, lens, host_loc, *state, backend="cuda", **outs)
    else:
        keys, scales = indexcache.quantize_index_k(torch.randn(48, 64, generator=g), fp4.FP4, block=32,
                                                   backend="torch")
        q = torch.randn(3, 4, 64, generator=g).to(torch.float8_e4m3fn)
        weights = torch.rand(3, 4, generator=g)
        ks, ke, out = torch.zeros(3, dtype=I32), torch.tensor([48, 20, 1], dtype=I32), torch.empty(3, 48)

        def call():
            indexcache.mqa_logits(q, keys, scales, weights, ks, ke, out=out, backend="cuda")

    _in_live_threads([2, 1], call)  # kept by the first thread (two checks); the second thread's call checked too
    assert len(calls) == 3


def _negated_call(op: str):
    """``(tensor, run, want)`` for a call of ``op`` taking float32 ``tensor`` (topk: its scores, an input;
    quantize_index_k: its scales, an output): ``run(t, backend)`` calls it with ``t`` in that place and gives what to
    compare, ``want(t)`` the reference of that."""
    g = torch.Generator().manual_seed(7)
    if op == "topk":
        lens, out = torch.tensor([300, 120, 5, 0], dtype=I32), torch.empty(4, 16, dtype=I32)

        def run(t, backend):
            return indexcache.topk(t, lens, 16, out=out, backend=backend).sort(dim=1).values

        return torch.randn(4, 300, generator=g), run, lambda t: reference.topk(t, lens, 16).sort(dim=1).values.to(I32)
    keys, values = torch.randn(32, 64, generator=g), torch.empty(32, 64, dtype=torch.float8_e4m3fn)

    def run(t, backend):
        return indexcache.quantize_index_k(keys, block=64, out=values, out_scale=t, backend=backend)[1].clone()

    return torch.empty(32, 1), run, lambda t: reference.quantize_index_k(keys, block=64)[1].float()


@pytest.mark.parametrize("op", ["topk", "quantize_index_k"])
def test_a_negated_view_is_declined_and_never_finds_the_call_kept_for_its_memory(op):
    """A view with the negative bit set (``torch._neg_view``; ``z.conj().imag`` of a complex ``z``) has the address,
    shape, strides and dtype of the memory it negates: the Triton kernels, which read and write memory as it lies, must
    decline it (they took it unnegated), and a call kept with the plain tensor must not be found by it. The torch
    backend reads and writes it negated."""
    dispatch.reset()
    plain, run, want = _negated_call(op)
    negated = torch._neg_view(plain)
    assert negated.is_neg() and negated.data_ptr() == plain.data_ptr()
    for _ in range(2):
        assert torch.equal(run(plain, "cuda"), want(plain))
    assert memo.size() == 1
    with pytest.raises(dispatch.BackendNotSupportedError, match="negative bit"):
        run(negated, "cuda")
    assert torch.equal(run(negated, "torch"), want(negated))


@pytest.mark.parametrize("which", ["host_kv", "device_kv"])
def test_a_conjugated_kv_view_is_declined_and_never_finds_the_call_kept_for_its_memory(which):
    """``hisparse_swap_in`` copies rows of any dtype, complex ones too: a conjugated view (``z.conj()``) has the
    address, shape, strides and dtype of the memory it conjugates. The Triton kernel, which copies bytes as they lie,
    failed on it with a bare RuntimeError (no byte view of a conjugated tensor), and a call kept with the plain tensor
    ran for it unchecked, copying unconjugated rows: it must decline it. The torch backend copies it conjugated."""
    dispatch.reset()
    copies = (torch.tensor([[1, 2], [4, -1]]), torch.tensor([[0, 1], [1, -1]], dtype=I32),
              torch.tensor([2, 1], dtype=I32))
    device_loc = torch.tensor([[5, 6, 7], [0, 1, 2]], dtype=I32)
    rows = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    host = torch.complex(rows, rows + 100)
    device = torch.zeros(8, 3, dtype=torch.complex64)
    want = torch.zeros(8, 3, dtype=torch.complex64)
    want[[5, 6, 1]] = host[[1, 2, 4]]

    def run(conjugated: bool, backend: str) -> torch.Tensor:
        device.zero_()
        kv = {"host_kv": host, "device_kv": device}
        if conjugated:
            kv[which] = kv[which].conj()  # either way the rows land conjugated in the device's memory
        indexcache.hisparse_swap_in(*copies, kv["host_kv"], kv["device_kv"], device_loc, backend=backend)
        return device.clone()

    for _ in range(2):
        assert torch.equal(run(False, "cuda"), want)
    assert memo.size() == 1
    with pytest.raises(dispatch.BackendNotSupportedError, match=f"{which}.*conjugate bit"):
        run(True, "cuda")
    assert torch.equal(run(True, "torch"), want.conj().resolve_conj())


def test_a_cache_off_a_4_byte_boundary_is_refused_by_its_address_whatever_its_storage_offset():
    """The cache check refuses a start off a 4-byte boundary by the address, which the signature holds: by the storage
    offset alone it took a storage that itself starts off one (``torch.frombuffer`` at a buffer's third byte), kept
    that call, and then a view of the same memory with a refused storage offset found the kept call unchecked."""
    import ctypes

    dispatch.reset()
    shape = new_packed_cache(num_pages=4, page_size=8, dim=64).shape
    n = shape.numel()
    buffer = torch.zeros(n + 64, dtype=torch.uint8)
    skip = (-buffer.data_ptr()) % 64 + 2
    sliced = buffer[skip:skip + n].view(shape)  # storage offset 2 mod 4
    fresh = torch.frombuffer((ctypes.c_byte * n).from_address(sliced.data_ptr()), dtype=torch.uint8).view(shape)
    assert fresh.storage_offset() == 0 and fresh.data_ptr() == sliced.data_ptr()
    keys, slots = torch.randn(32, 64), torch.arange(32, dtype=I32)
    for cache in (fresh, fresh, sliced):
        with pytest.raises(ValueError, match="k_cache: expected a view that starts at a multiple of 4 bytes"):
            indexcache.store_index_k(keys, cache, slots, backend="cuda")
    assert memo.size() == 0
