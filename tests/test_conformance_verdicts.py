"""The conformance suite's verdicts can fail: a torch-backend op made to give a wrong answer is reported failed by the
cases that meet the wrong part, never passed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from indexcache.conformance.cases import cases_for
from indexcache.conformance.check import run_case


@pytest.fixture
def wrong(fresh_dispatch, monkeypatch):
    """``wrong(op, wrap)``: the torch backend's ``op`` replaced by ``wrap(its fn)`` (no kept launches) for the test."""
    ops = fresh_dispatch.ops_of("torch")

    def patch(op, wrap):
        monkeypatch.setitem(ops, op, dataclasses.replace(ops[op], fn=wrap(ops[op].fn), prepare=None))

    return patch


def _case(op: str, name: str):
    (case,) = [c for c in cases_for(op) if c.name == name]
    return case


def _negative_padding(fn):
    """The op's answer with each empty slot -7 instead of -1 (the garbage an unwritten slot may hold)."""
    def run(**args):
        got = fn(**args)
        return got.masked_fill_(got == -1, -7)
    return run


def test_physical_sets_fail_garbage_in_an_empty_slot(wrong):
    """Without out_raw the physical slots are judged as sets per row (topk_translate's rule): a negative value other
    than -1 is not an empty slot."""
    case = _case("paged_topk_translate", "decode, KV page 1 (token table), no out_raw, native fp8")
    assert run_case(case, "torch").status == "passed"
    wrong("paged_topk_translate", _negative_padding)
    result = run_case(case, "torch")
    assert result.status == "failed" and "differ" in result.detail


def test_topk_translate_without_out_raw_fails_a_wider_answer(wrong):
    """An extra column of -1 holds no slot, but the answer is not [R, k]."""
    def wider(fn):
        def run(**args):
            got = fn(**args)
            return torch.cat([got, torch.full_like(got[:, :1], -1)], 1)
        return run

    wrong("topk_translate", wider)
    result = run_case(_case("topk_translate", "page 1 token table, no out_raw"), "torch")
    assert result.status == "failed" and result.detail == "shape [6, 101], expected [6, 100]"
