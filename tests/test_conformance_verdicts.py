"""The conformance suite's verdicts can fail: a torch-backend op made to give a wrong answer is reported failed by the
cases that meet the wrong part, never passed; a decline without a reason is failed, and a run in which no case ran
(every case declined) fails."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from indexcache.conformance import worker
from indexcache.conformance.cases import cases_for
from indexcache.conformance.check import run_case
from indexcache.hal import hisparse, library
from indexcache.hal.specs import SPECS
from indexcache.tools.cli import main


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


_TOKEN_TABLE = ("page 1 token table, no out_raw, empty slots: rows shorter than k, -inf and NaN scores, entries < 0 "
                "and positions past the table")
_TOKEN_TABLE_SORTED = ("sorted, page 1, no out_raw, row_starts, empty slots: rows shorter than k, -inf and NaN scores, "
                       "entries < 0 and positions past the table")


@pytest.mark.parametrize(("case", "detail"), [
    (_TOKEN_TABLE, "rows [0, 1, 2, 3, 4] differ"),
    (_TOKEN_TABLE_SORTED, "rows [0, 1, 2, 3, 4] differ from the sorted reference"),
])
def test_topk_translate_without_out_raw_fails_garbage_in_an_empty_slot(wrong, case, detail):
    """The cases without out_raw have -1 slots in every row (short rows, -inf and NaN scores, entries < 0, positions
    past the table): a backend writing another value there fails, by set or slot by slot when sorted."""
    case = _case("topk_translate", case)
    assert run_case(case, "torch").status == "passed"
    wrong("topk_translate", _negative_padding)
    result = run_case(case, "torch")
    assert (result.status, result.detail) == ("failed", detail)


def test_topk_translate_without_out_raw_fails_a_wider_answer(wrong):
    """An extra column of -1 holds no slot, but the answer is not [R, k]."""
    def wider(fn):
        def run(**args):
            got = fn(**args)
            return torch.cat([got, torch.full_like(got[:, :1], -1)], 1)
        return run

    wrong("topk_translate", wider)
    result = run_case(_case("topk_translate", _TOKEN_TABLE), "torch")
    assert (result.status, result.detail) == ("failed", "result 0: torch.int32 [6, 101] on cpu, expected torch.int32 "
                                                        "[6, 100] on cpu")


def _into_a_copy(*names):
    """The op run on copies of its given outputs ``names``: the right answer, in tensors the caller never sees."""
    def wrap(fn):
        def run(**args):
            args = dict(args)
            for name in names:
                given = args[name]
                args[name] = [t.clone() for t in given] if isinstance(given, list) else given.clone()
            return fn(**args)
        return run
    return wrap


@pytest.mark.parametrize(("op", "case", "names", "detail"), [
    ("translate", "preallocated out", ("out",), "out"),
    ("topk", "preallocated out", ("out",), "out"),
    ("mqa_logits", "logits into a given out (NaN before), native fp8", ("out",), "out"),
    ("paged_mqa_logits", "logits into a given out (NaN before), next_n 2, page 64, native fp8", ("out",), "out"),
    ("quantize_index_k", "outputs given: rows of a wider buffer, garbage in them before", ("out", "out_scale"), "out"),
    ("gather_index_k", "given outputs: more rows than the tokens (the rest untouched), native fp8",
     ("out_k", "out_scale"), "out_k"),
    ("hisparse_swap_in", "odd row bytes (6) and rows sharing a request", ("device_kv",), "device_kv"),
    ("hisparse_swap_in", "a producer group's four layers in one call (656-byte rows, pinned host memory holding a "
     "token's rows of the group together)", ("device_kv",), "device_kv[0]"),
])
def test_an_answer_not_written_into_the_given_output_fails(wrong, op, case, names, detail):
    case = _case(op, case)
    assert run_case(case, "torch").status == "passed"
    wrong(op, _into_a_copy(*names))
    result = run_case(case, "torch")
    assert (result.status, result.detail) == ("failed", f"did not write into the given {detail} (returned another "
                                                        "tensor)")


@pytest.mark.parametrize("case", ["NaN key (scale NaN in the cache) and NaN weights propagate, native fp8",
                                  "MXFP4 cache, a NaN block scale and NaN weights propagate, next_n 2, native fp8 q"])
def test_the_inf_key_of_the_second_request_is_read(wrong, case):
    """The case puts a NaN key at position 10 of request 0 and an inf key at position 10 of request 1 (its scale NaN
    in the cache): a backend that reads request 1's key as finite fails (row 2 is request 1's first row)."""
    def finite_second_key(fn):
        def run(**args):
            got = fn(**args)
            got[2, 10] = 0.0
            return got
        return run

    wrong("paged_mqa_logits", finite_second_key)
    result = run_case(_case("paged_mqa_logits", case), "torch")
    assert result.status == "failed" and result.detail.startswith("NaN placement differs at 1 positions")


_INF_CASE = "+inf and -inf keys, bf16: +inf, -inf and NaN logits inside the windows, 0 where relu takes -inf"


@pytest.mark.parametrize(("at", "value", "detail"), [
    ((1, 20), torch.finfo(torch.float32).max, "+inf placement differs at 1 positions"),  # +inf in the reference
    ((1, 21), float("inf"), "+inf placement differs at 1 positions"),  # a finite logit
    ((2, 20), float("inf"), "-inf placement differs at 1 positions"),  # -inf inside the window
    ((1, 40), float("nan"), "NaN placement differs at 1 positions"),  # relu of a -inf dot is 0
])
def test_an_inf_logit_is_judged_by_equality(wrong, at, value, detail):
    """The reference's +inf (an inf key, relu, positive weights) is right only as +inf, as -inf and NaN are: the right
    answer passes; a finite value there, or +inf where the reference is finite, fails."""
    case = _case("mqa_logits", _INF_CASE)
    assert run_case(case, "torch").status == "passed"

    def poke(fn):
        def run(**args):
            got = fn(**args)
            got[at] = value
            return got
        return run

    wrong("mqa_logits", poke)
    result = run_case(case, "torch")
    assert (result.status, result.detail) == ("failed", detail)


@pytest.mark.parametrize("reasons", [["no pages"], [" ", "no pages", ""]])
def test_a_case_the_backend_does_not_support_is_declined(fresh_dispatch, monkeypatch, reasons):
    """Declined is the dispatcher's answer before the op runs (the backend's supports), with the reasons that say
    something."""
    ops = fresh_dispatch.ops_of("torch")
    monkeypatch.setitem(ops, "translate", dataclasses.replace(ops["translate"], supports=lambda **_: reasons))
    result = run_case(_case("translate", "preallocated out"), "torch")
    assert (result.status, result.detail) == ("declined", "no pages")


def _raises_not_supported(**_):
    from indexcache.hal import dispatch

    raise dispatch.BackendNotSupportedError("")


@pytest.mark.parametrize(("supports", "got"), [
    (lambda **_: [""], "['']"),
    (lambda **_: [" ", "\t\n"], "[' ', '\\t\\n']"),
    (_raises_not_supported, "['']"),  # a supports that raises the error itself, with no message
])
def test_a_decline_without_a_reason_fails(fresh_dispatch, monkeypatch, supports, got):
    """A backend must say why it declines a case: a decline whose reasons are all blank is a failed case."""
    ops = fresh_dispatch.ops_of("torch")
    monkeypatch.setitem(ops, "translate", dataclasses.replace(ops["translate"], supports=supports))
    result = run_case(_case("translate", "preallocated out"), "torch")
    assert (result.status, result.detail) == (
        "failed", f"backend 'torch' declined translate case 'preallocated out' without giving a reason: expected a "
                  f"non-blank reason, got {got}")


@pytest.mark.parametrize(("reasons", "outcome", "message"), [
    (["no pages"], pytest.skip.Exception, "torch declines: no pages"),
    ([" "], AssertionError, "backend 'torch' declined translate case 'preallocated out' without giving a reason"),
])
def test_the_pytest_entry_skips_a_decline_only_with_a_reason(fresh_dispatch, monkeypatch, reasons, outcome, message):
    """tests/conformance's test of a case: a decline with reasons is a skip naming them, one without a failure."""
    from conformance.test_conformance import test_case  # tests/ is on sys.path: pytest puts its conftest's dir there

    ops = fresh_dispatch.ops_of("torch")
    monkeypatch.setitem(ops, "translate", dataclasses.replace(ops["translate"], supports=lambda **_: reasons))
    with pytest.raises((pytest.skip.Exception, AssertionError)) as raised:
        test_case("torch", _case("translate", "preallocated out"))
    assert raised.type is outcome and str(raised.value).startswith(message)


def test_a_backend_raising_not_supported_while_it_runs_fails(wrong):
    """A backend that took the call and then raised BackendNotSupportedError (from a call of its own, say) failed it:
    it is not declined (a skip in tests/conformance)."""
    from indexcache.hal import dispatch

    def refuses(fn):
        def run(**args):
            raise dispatch.BackendNotSupportedError("no backend can run topk with these arguments")
        return run

    wrong("translate", refuses)
    result = run_case(_case("translate", "preallocated out"), "torch")
    assert (result.status, result.detail) == ("failed", "BackendNotSupportedError: no backend can run topk with these "
                                                        "arguments")


def test_sorted_top_k_with_the_empty_slots_first_fails(wrong):
    """sorted=True: the picks in order, then -1; a backend putting the -1 first fails the case that has some."""
    def empty_first(fn):
        def run(**args):
            got = fn(**args)
            key = (got != -1).int()  # 0 for -1: a stable sort puts them first, the picks in their order after
            return got.copy_(got.gather(1, key.sort(dim=1, stable=True).indices))
        return run

    wrong("topk", empty_first)
    result = run_case(_case("topk", "sorted output, -1 after the picks (short rows, -inf and NaN)"), "torch")
    assert result.status == "failed" and result.detail == "rows [0, 2, 3] differ from the sorted reference"


def test_bf16_logits_rounded_to_bf16_fail_with_fp32_accumulation(wrong):
    """bf16 inputs are exact, as fp8 ones are: with fp32 accumulation their logits are held to 1e-5, so an answer
    rounded through bf16 (relative error about 2e-3) fails."""
    def rounded(fn):
        def run(**args):
            got = fn(**args)
            return got.copy_(got.bfloat16().float())
        return run

    case = _case("mqa_logits", "causal prefill, H 64, bf16")
    assert run_case(case, "torch").error < 1e-6
    wrong("mqa_logits", rounded)
    result = run_case(case, "torch")
    assert result.status == "failed" and result.bound == 1e-5 and 1e-3 < result.error < 1e-2


def test_a_plan_answered_outside_the_given_outputs_fails(wrong):
    """hisparse_plan given its outputs must answer in them: the same plan in new tensors fails."""
    case = _case("hisparse_plan", "given outputs holding garbage: the plan written into the caller's slots, copy "
                                  "lists and counts")
    assert run_case(case, "torch").status == "passed"
    moved = []  # the field the wrong backend answers in a new tensor

    def elsewhere(fn):
        def run(**args):
            got = list(fn(**args))  # the backend's tuple, in Plan's order
            at = hisparse.Plan._fields.index(moved[-1])
            got[at] = got[at].clone()
            return tuple(got)
        return run

    wrong("hisparse_plan", elsewhere)
    for field, name in (("slots", "out"), ("copy_src", "out_copy_src"), ("copy_count", "out_copy_count")):
        moved.append(field)
        result = run_case(case, "torch")
        assert result.status == "failed" and result.detail == f"did not write into the given {name} (returned " \
                                                              "another tensor)"


def _returning(change):
    """The op's answer passed through ``change`` (the same values in another form)."""
    def wrap(fn):
        def run(**args):
            return change(fn(**args))
        return run
    return wrap


@pytest.mark.parametrize(("op", "case", "change", "detail"), [
    ("translate", "random guards, page 64", lambda t: t.long(),
     "result 0: torch.int64 [24, 67] on cpu, expected torch.int32 [24, 67] on cpu"),
    ("topk", "random rows, k 64", lambda t: t.float(),
     "result 0: torch.float32 [12, 64] on cpu, expected torch.int32 [12, 64] on cpu"),
    ("topk_translate", _TOKEN_TABLE, lambda t: t.long(),
     "result 0: torch.int64 [6, 100] on cpu, expected torch.int32 [6, 100] on cpu"),
    ("translate", "random guards, page 64", lambda t: t[:, :-1],
     "result 0: torch.int32 [24, 66] on cpu, expected torch.int32 [24, 67] on cpu"),
    ("translate", "random guards, page 64", lambda t: t.to("meta"),
     "result 0: torch.int32 [24, 67] on meta, expected torch.int32 [24, 67] on cpu"),
    ("gather_index_k", "MXFP4: page 17, D 64, outputs allocated", lambda t: t[:1],
     "returned a tuple, expected 2 tensors"),
])
def test_an_answer_of_the_wrong_dtype_shape_or_device_fails(wrong, op, case, change, detail):
    """The judges compare values on the CPU, where an int64 or float index equals its int32 one and a tensor on another
    device is moved: what the op returns must have its contract's dtype, shape and device (an index op asked for no
    ``out`` returns int32 on the inputs' device)."""
    case = _case(op, case)
    assert run_case(case, "torch").status == "passed"
    wrong(op, _returning(change))
    result = run_case(case, "torch")
    assert (result.status, result.detail) == ("failed", detail)


@pytest.mark.parametrize(("op", "case"), [
    ("mqa_logits", "full, empty and context-parallel windows, native fp8"),
    ("paged_mqa_logits", "MXFP4 cache, page 17, D 64, the cache's last page first, next_n 2, short contexts, "
                         "native fp8 q"),
])
def test_logits_of_a_small_row_are_held_to_that_row(wrong, op, case):
    """The relative RMS error is each row's against its own norm: the row of the smallest logits 0.1% off (100 times
    the bound) fails, though over the whole tensor its error is a few 1e-8."""
    def small_row_off(fn):
        def run(**args):
            got = fn(**args)
            norms = torch.where(got.isfinite(), got, 0.0).norm(dim=1)
            row = int(torch.where(norms > 0, norms, float("inf")).argmin())
            got[row] *= 1.001
            return got
        return run

    case = _case(op, case)
    assert run_case(case, "torch").status == "passed"
    wrong(op, small_row_off)
    result = run_case(case, "torch")
    assert result.status == "failed" and result.detail.startswith("relative RMS error 0.001 > 1e-05 (row ")


def _and_outside(name):
    """The op's answer, and then the first byte of the buffer its given output ``name`` is a view of changed (a byte
    outside the view: the cases put the view past the buffer's start)."""
    def wrap(fn):
        def run(**args):
            got = fn(**args)
            given = args[name][0] if isinstance(args[name], list) else args[name]
            flat = torch.empty(0, dtype=torch.uint8, device=given.device).set_(given.untyped_storage())
            flat[0] ^= 1
            return got
        return run
    return wrap


@pytest.mark.parametrize(("op", "case", "name", "detail"), [
    ("quantize_index_k", "outputs given: rows of a wider buffer, garbage in them before", "out", "out"),
    ("quantize_index_k", "MXFP4: outputs given, rows of wider buffers", "out_scale", "out_scale"),
])
def test_a_write_outside_a_given_view_fails(wrong, op, case, name, detail):
    """A given output that is a view of a wider buffer: the rest of the buffer must be left as it was (memcheck
    cannot see such a write: it stays inside the allocation)."""
    case = _case(op, case)
    assert run_case(case, "torch").status == "passed"
    wrong(op, _and_outside(name))
    result = run_case(case, "torch")
    assert (result.status, result.detail) == (
        "failed", f"wrote outside the given {detail} (into the rest of the buffer it is a view of)")


# A conformance worker whose torch backend declines every case of the ops named in its first argument.
_DECLINING_WORKER = """
import dataclasses, sys
from indexcache.conformance import worker
from indexcache.hal import dispatch
ops = dispatch.ops_of("torch")
for op in sys.argv[1].split(","):
    ops[op] = dataclasses.replace(ops[op], supports=lambda **_: ["declined on purpose"])
sys.exit(worker.main(sys.argv[2:]))
"""


@pytest.fixture
def declining(monkeypatch):
    """``declining(*ops)``: the workers ``indexcache conformance`` starts run a torch backend whose ``ops`` decline
    every case ("declined on purpose")."""
    real = subprocess.run

    def patch(*ops):
        def run(cmd, **kwargs):
            if cmd[1:3] == ["-m", "indexcache.conformance.worker"]:
                cmd = [cmd[0], "-c", _DECLINING_WORKER, ",".join(ops), *cmd[3:]]
            return real(cmd, **kwargs)

        monkeypatch.setattr(subprocess, "run", run)

    return patch


def _markdown(out) -> list[str]:
    return (out / "conformance-torch.md").read_text().splitlines()


def test_a_backend_declining_every_case_fails_the_run(declining, tmp_path, capsys):
    """A backend that declines every case checked nothing: exit 1 and one line saying so and why, not a green run."""
    declining(*worker.catalogue_ops())
    assert main(["conformance", "--backend", "torch", "--out", str(tmp_path)]) == 1
    why = f"every case was declined: declined on purpose ({len(cases_for())})"
    assert f"conformance: no case ran on backend torch, nothing was checked: {why}" in capsys.readouterr().out
    assert f"- **no case ran** (the run fails): {why}" in _markdown(tmp_path)
    report = json.loads((tmp_path / "conformance-torch.json").read_text())
    assert {r["status"] for r in report["results"]} == {"declined"}


def test_the_one_op_run_of_an_op_all_declined_fails(declining, tmp_path, capsys):
    """``--op`` selects the cases: every one of them declined checked nothing."""
    declining("translate")
    assert main(["conformance", "--backend", "torch", "--op", "translate", "--out", str(tmp_path)]) == 1
    line = (f"conformance: no case ran on backend torch, nothing was checked: every case was declined: declined on "
            f"purpose ({len(cases_for('translate'))})")
    assert line in capsys.readouterr().out.splitlines()


def test_an_op_all_declined_beside_others_run_is_a_line_not_a_failure(declining, tmp_path, capsys):
    declining("translate")
    assert main(["conformance", "--backend", "torch", "--out", str(tmp_path)]) == 0
    why = f"every case was declined: declined on purpose ({len(cases_for('translate'))})"
    out = capsys.readouterr().out
    assert f"conformance: no case of translate ran on backend torch (its other ops ran): {why}" in out.splitlines()
    assert "no case ran on backend" not in out
    assert f"- no case of `translate` ran: {why}" in _markdown(tmp_path)


def test_the_worker_run_by_hand_fails_when_no_case_ran(fresh_dispatch, monkeypatch, tmp_path):
    """``python -m indexcache.conformance.worker`` (the memcheck step of ci/gpu.sh runs it) exits 1 when every case
    was declined, or there was none, as when one fails."""
    ops = fresh_dispatch.ops_of("torch")
    monkeypatch.setitem(ops, "translate", dataclasses.replace(ops["translate"], supports=lambda **_: ["no pages"]))
    argv = ["--backend", "torch", "--op", "translate", "--out", str(tmp_path)]
    assert worker.main(argv) == 1
    assert f"- **no case ran** (the run fails): every case was declined: no pages ({len(cases_for('translate'))})" \
        in _markdown(tmp_path)
    monkeypatch.setattr(worker, "cases_for", lambda op: [])
    assert worker.main(argv) == 1
    assert "- **no case ran** (the run fails): there was no case to run" in _markdown(tmp_path)


def test_no_case_ran_names_the_three_most_common_reasons():
    results = [{"op": "topk", "status": "declined", "detail": why}
               for why in ["a", "b", "b", "c\n  d", "c d", "c d", "e", "f"]]
    assert worker.unchecked(results) == "every case was declined: c d (3); b (2); a (1); 2 other reasons"
    assert worker.unchecked([*results, {"op": "topk", "status": "failed", "detail": "x"}]) == ""


@pytest.mark.parametrize("op", [op for op in SPECS if "fp8_dtype" in library.PARAMS[op]])  # the key ops
def test_a_case_leaving_fp8_dtype_out_is_judged_in_the_devices_native_format(fresh_dispatch, monkeypatch, op):
    """A case without ``fp8_dtype`` runs the op in the device's native format (``fp8_dtype=None``): the reference
    is given that format, not its own default e4m3fn (here the CPU's native format made e4m3fnuz, as on an MI300)."""
    from indexcache.hal import dispatch
    from indexcache.hal.specs.base import Case

    monkeypatch.setattr(dispatch, "native_fp8", lambda device: torch.float8_e4m3fnuz)
    base = next(c for c in cases_for(op) if c.native_fp8 or "e4m3fnuz" in c.name)

    def build(gen, dev):
        args = base.build(gen, dev, torch.float8_e4m3fnuz) if base.native_fp8 else base.build(gen, dev)
        assert args.pop("fp8_dtype") == torch.float8_e4m3fnuz
        return args

    result = run_case(Case(op, f"{base.name}, fp8_dtype left out", build), "torch")
    assert (result.status, result.detail) == ("passed", "")


def _strict_json(text: str):
    """``text`` parsed as RFC 8259 JSON: NaN, Infinity and -Infinity (which Python's json writes by default and jq,
    JavaScript and Go refuse) raise."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_a_nan_logit_where_the_reference_is_finite_fails_with_no_error_measured(wrong, monkeypatch, tmp_path):
    """A placement failure measures no error: the case's error is None (not inf), so the report stays strict JSON and
    its tables show no error for it."""
    def nan_everywhere(fn):
        def run(**args):
            return fn(**args).fill_(float("nan"))
        return run

    wrong("mqa_logits", nan_everywhere)
    result = run_case(_case("mqa_logits", "causal prefill, H 64, bf16"), "torch")
    assert (result.status, result.detail, result.error, result.bound) == (
        "failed", "NaN placement differs at 7200 positions", None, 1e-5)
    monkeypatch.setattr(worker, "cases_for", lambda op: [_case("mqa_logits", "causal prefill, H 64, bf16")])
    assert worker.main(["--backend", "torch", "--op", "mqa_logits", "--out", str(tmp_path)]) == 1
    report = _strict_json((tmp_path / "conformance-torch.json").read_text())
    assert [(r["status"], r["error"]) for r in report["results"]] == [("failed", None)]
    assert "| mqa_logits | 0 | 1 | 0 | - |" in _markdown(tmp_path)


def _writing_input(name, before):
    """The op with its input ``name`` zeroed in place, ``before`` it computes (then its answer is of the zeroed
    input) or after."""
    def wrap(fn):
        def run(**args):
            if before:
                args[name].view(torch.uint8).zero_()
            got = fn(**args)
            if not before:
                args[name].view(torch.uint8).zero_()
            return got
        return run
    return wrap


@pytest.mark.parametrize(("op", "case", "name", "before"), [
    ("translate", "random guards, page 64", "page_table", False),
    ("topk", "random rows, k 64", "scores", False),
    ("mqa_logits", "causal prefill, H 64, bf16", "q", False),
    # its judge reads the inputs after the op: zeroed weights before, all-zero logits matched their own reference
    ("paged_topk_translate", "decode, index page 64, KV page 64, out_raw, native fp8", "weights", True),
])
def test_a_backend_writing_into_an_input_fails(wrong, op, case, name, before):
    """An argument the op's schema does not mark written must hold the same bytes after the op, whatever the answer
    (an engine reads its logits, tables and queries again)."""
    case = _case(op, case)
    assert run_case(case, "torch").status == "passed"
    wrong(op, _writing_input(name, before))
    result = run_case(case, "torch")
    assert (result.status, result.detail) == ("failed", f"wrote into its input {name} (an argument its contract only "
                                                        "reads)")


# A pytest plugin whose torch backend declines every case of translate.
_DECLINING_PLUGIN = """
import dataclasses
from indexcache.hal import dispatch
ops = dispatch.ops_of("torch")
ops["translate"] = dataclasses.replace(ops["translate"], supports=lambda **_: ["declined on purpose"])
"""


@pytest.mark.parametrize(("selected", "code"), [("translate and not topk", 1), ("translate", 0)])
def test_the_pytest_entry_fails_when_a_backend_declined_every_case(tmp_path, selected, code):
    """tox's conformance envs run tests/conformance with pytest, where a decline is a skip: a backend that declined
    every selected case checked nothing and fails the run (it exited 0 on skips alone), as `indexcache conformance`
    does; an op all declined beside cases that ran is not a failure."""
    (tmp_path / "declining_plugin.py").write_text(_DECLINING_PLUGIN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "INDEXCACHE_CONFORMANCE_BACKENDS": "torch"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "declining_plugin",
                          "tests/conformance", "-k", selected], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent)
    line = ("conformance: no case ran on backend torch, nothing was checked: every case was declined (the skips say "
            "why)")
    assert (run.returncode, line in run.stdout.splitlines()) == (code, code == 1), run.stdout


def test_the_console_table_and_the_markdown_show_the_same_worst_error():
    """A failing error just past its bound reads past it in both (the console table showed 1.04e-05 as 1.0e-05,
    at its bound, where the .md showed 1.04e-05)."""
    from indexcache.conformance.suite import table

    report = {"backend": "torch", "mode": "CPU", "device": "cpu", "device_name": "cpu", "reason": "", "date": "",
              "torch": "", "results": [
                  {"op": "mqa_logits", "case": "a", "status": "passed", "detail": "", "error": 2e-7, "bound": 1e-5},
                  {"op": "mqa_logits", "case": "b", "status": "failed", "detail": "relative RMS error 1.04e-05 > "
                   "1e-05 (row 0)", "error": 1.04e-5, "bound": 1e-5}]}
    assert table([report]).splitlines()[1].split() == ["torch", "CPU", "mqa_logits", "1", "1", "0", "1.04e-05", "/",
                                                       "1e-05"]
    assert "| mqa_logits | 1 | 1 | 0 | 1.04e-05 / 1e-05 |" in worker.to_markdown(report).splitlines()
