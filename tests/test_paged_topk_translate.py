"""paged_topk_translate: equal to paged_mqa_logits then topk_translate of its rows (next_n 1 and 2, on the torch
backend), every output written in place, bad arguments named, and declined by a backend that lacks it."""

import pytest
import torch

import indexcache
from indexcache.hal import dispatch, reference
from indexcache.hal.dispatch import BackendNotSupportedError
from indexcache.hal.specs.paged_mqa_logits import args_of

pytestmark = pytest.mark.usefixtures("one_thread")

I32 = torch.int32
E4M3 = torch.float8_e4m3fn


def inputs(next_n, context=(60, 3, 0), page_size=16, seed=0):
    """paged_mqa_logits' arguments (block_table for its page_table) and a KV page table of 8-token pages."""
    g = torch.Generator().manual_seed(seed)
    args = args_of(g, "cpu", len(context), next_n, 4, page_size, list(context))
    args["block_table"] = args.pop("page_table")
    args["page_table"] = torch.randperm(30, generator=g).to(I32).view(len(context), 10)
    args["page_table"][0, 2] = -1
    return args


def composed(args, k, page_size=8):
    """paged_mqa_logits, then topk_translate with each row's length and request, on the torch backend."""
    logits = indexcache.paged_mqa_logits(args["q"], args["k_cache"], args["weights"], args["context_lens"],
                                         args["block_table"], args["max_context_len"], backend="torch")
    next_n = args["q"].shape[1]
    rows = torch.arange(logits.shape[0])
    lengths = (args["context_lens"][rows // next_n] - next_n + 1 + rows % next_n).clamp_min(0).to(I32)
    raw = torch.empty(logits.shape[0], k, dtype=I32)
    phys = indexcache.topk_translate(logits, lengths, k, args["page_table"], page_size,
                                     row_to_batch=(rows // next_n).to(I32), out_raw=raw, backend="torch")
    return logits, phys, raw


def call(args, k, page_size=8, **outputs):
    return indexcache.paged_topk_translate(args["q"], args["k_cache"], args["weights"], args["context_lens"],
                                           args["block_table"], args["max_context_len"], k, args["page_table"],
                                           page_size, backend="torch", **outputs)


@pytest.mark.parametrize("next_n", [1, 2])
def test_equals_paged_logits_then_topk_translate(next_n):
    args, k = inputs(next_n), 8
    want_logits, want_phys, want_raw = composed(args, k)
    rows = want_logits.shape[0]
    logits = torch.full_like(want_logits, float("nan"))
    out, raw = torch.full((rows, k), -7, dtype=I32), torch.full((rows, k), -7, dtype=I32)
    got = call(args, k, logits=logits, out=out, out_raw=raw)
    assert got is out
    assert torch.equal(logits, want_logits) and torch.equal(out, want_phys) and torch.equal(raw, want_raw)
    # Rows see context - next_n + 1 + j keys: request 2 (context 0) selects nothing, request 1 its first keys.
    assert (raw[rows - next_n:] == -1).all()
    assert raw[next_n].tolist() == [0, 1, 2, 3, 4, 5, 6, 7][: 4 - next_n] + [-1] * (4 + next_n)


def test_outputs_are_allocated_when_not_given():
    args, k = inputs(2), 8
    _, want_phys, _ = composed(args, k)
    assert torch.equal(call(args, k), want_phys)


def test_equals_the_reference_on_rows_without_near_ties():
    args, k = inputs(2), 8
    phys, raw = reference.paged_topk_translate(**args, k=k, page_size=8)
    _, got_phys, got_raw = composed(args, k)
    assert torch.equal(got_raw.sort(1).values, raw.sort(1).values)
    assert torch.equal(got_phys.sort(1).values, phys.sort(1).values)


@pytest.mark.parametrize(("change", "error", "message"), [
    (dict(block_table=torch.zeros(3, 5, dtype=torch.int64)), TypeError, "block_table: expected dtype int32"),
    (dict(page_table=torch.zeros(2, 5, dtype=I32)), ValueError, r"page_table: expected shape \[3, \*\]"),
    (dict(k=65537), ValueError, "k: expected an int in"),
    (dict(page_size=0), ValueError, "page_size: expected an int in"),
    (dict(out=torch.zeros(6, 7, dtype=I32)), ValueError, r"out: expected shape \[6, 8\]"),
    (dict(out_raw=torch.zeros(6, 8)), TypeError, "out_raw: expected dtype int32"),
    (dict(logits=torch.zeros(6, 5)), ValueError, r"logits: expected shape \[6, 64\]"),
])
def test_bad_arguments_are_named(change, error, message):
    args = {**inputs(2), "k": 8, "page_size": 8, **change}
    with pytest.raises(error, match=message):
        indexcache.paged_topk_translate(**args, backend="torch")


def test_outputs_may_not_overlap_each_other_or_the_inputs():
    args = inputs(2)
    both = torch.zeros(6, 8, dtype=I32)
    with pytest.raises(ValueError, match="out: expected a tensor that shares no memory .* overlaps out_raw"):
        call(args, 8, out=both, out_raw=both)
    logits = torch.zeros(6, 64)
    with pytest.raises(ValueError, match="logits: expected a tensor that shares no memory .* overlaps out"):
        call(args, 8, logits=logits, out=logits[:, :8].view(I32))
    with pytest.raises(ValueError, match="logits: expected a tensor that shares no memory .* overlaps out_raw"):
        call(args, 8, logits=logits, out_raw=logits[:, 8:16].view(I32))
    buffer = torch.zeros(6 * 64)
    args["weights"] = buffer[:24].view(6, 4).copy_(args["weights"])
    with pytest.raises(ValueError, match="logits: expected a tensor that shares no memory .* overlaps weights"):
        call(args, 8, logits=buffer.view(6, 64))


def test_a_backend_without_the_op_declines(monkeypatch):
    monkeypatch.delitem(dispatch.ops_of("torch"), "paged_topk_translate")
    with pytest.raises(BackendNotSupportedError, match="does not implement paged_topk_translate"):
        call(inputs(1), 8)

