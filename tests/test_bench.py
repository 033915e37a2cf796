"""``indexcache bench`` on the CPU: end to end on tiny shapes, honest labels, checks that can fail; the
benchmarking package's timer and tables; the ``bench/`` scripts' CPU paths."""

from __future__ import annotations

import contextlib
import cProfile
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from indexcache import bench
from indexcache.bench import ceilings, harness, output, timing
from indexcache.hal import ops
from indexcache.hal.dispatch import Availability, Backend, OpImpl
from indexcache.hal.specs import SPECS
from indexcache.hal.specs.bench import BenchCase, BenchSpec
from indexcache.tools import cli

ROOT = Path(__file__).resolve().parents[1]

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU labels; this machine has a GPU")


@pytest.fixture(scope="module")
def interpreted_run(tmp_path_factory):
    """One quick ``indexcache bench --op translate`` with the Triton backends interpreted: (stdout, report)."""
    path = tmp_path_factory.mktemp("bench") / "translate.json"
    env = {k: v for k, v in os.environ.items() if k != "INDEXCACHE_BACKEND"} | {"TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "indexcache.tools.cli", "bench", "--op", "translate", "--quick",
                           "--json", str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(path.read_text())


@no_gpu
def test_cpu_results_are_labelled_not_gpu(interpreted_run):
    stdout, report = interpreted_run
    assert report["gpu_run"] is False and report["gpu"] is None
    assert "not a GPU run" in report["notice"] and "NOTE: not a GPU run" in stdout
    rows = report["results"]
    assert {r["backend"] for r in rows} >= {"torch", "cuda", "rocm"}
    assert {r["mode"] for r in rows} == {"CPU", "interpreted"}
    assert report["ceilings"]["copy_bandwidth"]["mode"] == "CPU"
    assert report["ceilings"]["launch"]["mode"] == "interpreted"


@no_gpu
def test_every_backend_agrees_and_is_timed(interpreted_run):
    _, report = interpreted_run
    cases = {c.name for c in harness.OPS["translate"].cases(True)}
    assert {r["case"] for r in report["results"]} == cases
    for r in report["results"]:
        assert r["check"] == "ok", r
        assert r["eager_us"] > 0 and r["graph_us"] is None and r["sets"] >= harness.MIN_SETS
        assert r["bytes"] == 12 * r["params"]["requests"] * r["params"]["rows_per_request"] * r["params"]["k"]


@no_gpu
def test_derived_numbers_compare_one_mode_only(interpreted_run):
    _, report = interpreted_run
    for r in report["results"]:
        if r["backend"] == "torch":
            assert r["speedup_vs_torch"] == 1.0 and r["ceiling_fraction"] > 0 and r["launch_ratio"] is None
        else:
            assert r["speedup_vs_torch"] is None and r["ceiling_fraction"] is None and r["launch_ratio"] > 0


def test_json_has_what_the_table_shows(interpreted_run):
    stdout, report = interpreted_run
    for key in ("schema", "date", "gpu", "commit", "dirty", "settings", "ceilings", "results"):
        assert key in report
    assert {"torch", "triton"} <= set(report["versions"])
    assert {"copy_bandwidth", "launch"} <= set(report["ceilings"])
    for r in report["results"]:
        assert {key for _, key, _ in output.COLUMNS} <= set(r)
        line = next(x for x in stdout.splitlines() if x.startswith(r["case"]) and f" {r['backend']} " in x)
        assert r["mode"] in line and r["check"] in line
    assert "GB/s" in stdout and "% copy_bandwidth" in stdout


@no_gpu
def test_a_cpu_run_prints_no_ceiling_rate_or_roofline(interpreted_run):
    """issue 35 item 7: off a GPU the ceilings print as n/a (a CPU's fp8 matmul printed "0 TFLOP/s") and no CPU or
    interpreted row shows a rate, a floor, a share of a ceiling or a launch ratio (they printed "28313 %"); the
    same report with GPU rows prints the numbers."""
    stdout, report = interpreted_run
    assert "ceiling copy_bandwidth: n/a (CPU: not a GPU's ceiling)" in stdout
    assert "ceiling empty Triton launch: n/a (interpreted: not a GPU's ceiling)" in stdout
    for r in report["results"]:
        line = next(x for x in stdout.splitlines() if x.startswith(r["case"]) and f" {r['backend']} " in x)
        assert line.count("n/a") == len(output.GPU_ONLY) and "%" not in line, line
    as_gpu = {**report, "ceilings": {k: {**c, "mode": "GPU"} for k, c in report["ceilings"].items()},
              "results": [{**r, "mode": "GPU"} for r in report["results"]]}
    assert "n/a" not in output.format_table(as_gpu)


def _with_backend(dispatch, name: str, fn) -> None:
    dispatch.registry()[name] = Backend(name=name, priority=-1, probe=lambda: Availability(True, "test", mode="CPU"),
                                        ops={"translate": OpImpl(fn)})


def test_a_wrong_backend_fails_the_run(fresh_dispatch, capsys):
    def wrong(raw, page_table, seq_lens, page_size, row_to_batch, out):
        return out.fill_(7)

    _with_backend(fresh_dispatch, "wrong", wrong)
    report = bench.run(["translate"], ["wrong"], quick=True)
    assert {r["check"] for r in report["results"] if r["backend"] == "wrong"} == {"MISMATCH"}
    assert {r["check"] for r in report["results"] if r["backend"] == "torch"} == {"ok"}
    assert bench.failed(report) and all(r["backend"] == "wrong" for r in bench.failed(report))
    assert cli.main(["bench", "--op", "translate", "--backend", "wrong", "--quick"]) == 1
    assert "FAILED translate" in capsys.readouterr().err


def test_a_backend_that_leaves_slots_unwritten_fails(fresh_dispatch):
    def lazy(raw, page_table, seq_lens, page_size, row_to_batch, out):
        return out

    _with_backend(fresh_dispatch, "lazy", lazy)
    report = bench.run(["translate"], ["lazy"], quick=True)
    assert {r["check"] for r in report["results"] if r["backend"] == "lazy"} == {"MISMATCH"}


def test_a_crashing_backend_is_reported_and_the_rest_still_run(fresh_dispatch):
    def broken(**_):
        raise RuntimeError("kernel exploded")

    _with_backend(fresh_dispatch, "broken", broken)
    report = bench.run(["translate"], ["broken"], quick=True)
    rows = {r["backend"]: r for r in report["results"]}
    assert rows["broken"]["check"].startswith("error: RuntimeError: kernel exploded")
    assert rows["torch"]["eager_us"] > 0
    assert set(rows["broken"]) == set(rows["torch"]), "every row has the same JSON keys, timed or not"


def test_an_op_plugs_in_as_data(fresh_dispatch, monkeypatch):
    def build(case, gen):
        return {"x": torch.randn(case.params["n"], generator=gen), "out": torch.full((case.params["n"],), float("nan"))}

    op = BenchSpec(
        name="negate",
        cases=lambda quick: [BenchCase("n16", {"n": 16})],
        build=build,
        call=lambda a, backend: torch.neg(a["x"], out=a["out"]),
        bytes=lambda case: 8 * case.params["n"],
    )
    monkeypatch.setitem(harness.OPS, "negate", op)
    report = bench.run(["negate"], ["torch"], quick=True)
    (row,) = report["results"]
    assert (row["op"], row["case"], row["check"], row["bytes"], row["flops"]) == ("negate", "n16", "ok", 128, 0)
    assert row["rate"] > 0 and row["rate_unit"] == "GB/s"
    assert "op negate" in bench.format_table(report)


# Timed by bench/hisparse_gpu.py, not the harness: a plan's state moves on with every call, and a swap-in reads host
# memory, which the harness's inputs (each moved to the device) cannot hold.
UNBENCHED = tuple(cli.UNBENCHED)


def test_every_op_is_benchmarked_by_its_spec_record():
    assert list(harness.OPS) == [op for op in SPECS if op not in UNBENCHED]
    assert all(harness.OPS[name] is spec.bench and spec.bench.name == name for name, spec in SPECS.items()
               if name not in UNBENCHED)
    assert all(SPECS[op].bench is None for op in UNBENCHED)


def test_paged_topk_translate_is_checked_against_the_torch_backend():
    """Its logits like paged_mqa_logits', its top-k against the torch backend's top-k of the logits it returned."""
    report = bench.run(["paged_topk_translate"], ["torch"], quick=True)
    assert [row["check"] for row in report["results"]] == ["ok", "ok"]
    spec = harness.OPS["paged_topk_translate"]
    case = spec.cases(True)[1]
    want = spec.call(spec.build(case, torch.Generator().manual_seed(0)), "torch")
    phys, raw, args = spec.call(spec.build(case, torch.Generator().manual_seed(0)), "torch")
    assert spec.same((phys, raw, args), want, case) == ""
    raw[0, 0] = raw[0, 1]
    assert spec.same((phys, raw, args), want, case).startswith("out_raw:")
    args["logits"][0, 0] += 100
    assert spec.same((phys, raw, args), want, case).startswith("logits:")


def test_unknown_names_exit_2(capsys):
    assert cli.main(["bench", "--op", "nope", "--quick"]) == 2
    assert cli.main(["bench", "--backend", "nope", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--op: expected one of" in err and "backend: expected one of" in err


def test_an_op_named_twice_runs_once(fresh_dispatch):
    """`indexcache bench --op translate --op translate` times each case once (every row was there twice)."""
    report = bench.run(["translate", "translate"], ["torch", "torch"], quick=True)
    rows = [(row["case"], row["backend"]) for row in report["results"]]
    assert rows == [(case.name, "torch") for case in harness.OPS["translate"].cases(True)]


# ----------------------------------------------------------------------------------------------- logits and top-k

# Every op but translate (the section above) and paged_topk_translate (its own test above).
KERNEL_OPS = [op for op in SPECS if op not in ("translate", "paged_topk_translate", *UNBENCHED)]


@pytest.fixture(scope="module")
def kernel_ops_run():
    """The kernel ops, --quick, torch backend on the CPU (in process)."""
    return bench.run(KERNEL_OPS, ["torch"], quick=True)


@pytest.fixture(scope="module")
def kernel_ops_interpreted(tmp_path_factory):
    """The kernel ops, --quick, the cuda Triton backend interpreted against torch: (stdout, report)."""
    path = tmp_path_factory.mktemp("bench") / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "INDEXCACHE_BACKEND"} | {"TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "indexcache.tools.cli", "bench", "--quick", "--backend", "cuda", "--json",
               str(path)]
    for op in KERNEL_OPS:
        command += ["--op", op]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(path.read_text())


def test_only_the_ceilings_an_op_needs_are_measured(interpreted_run, kernel_ops_run):
    assert harness.needed_ceilings(["translate"]) == ["copy_bandwidth"]
    assert set(harness.needed_ceilings(["mqa_logits"])) == {"fp8_matmul", "bf16_matmul", "copy_bandwidth"}
    assert set(harness.needed_ceilings(["paged_mqa_logits"])) == {"fp8_matmul", "bf16_matmul", "copy_bandwidth"}
    assert harness.needed_ceilings(["topk", "topk_translate"]) == ["read_once"]
    assert harness.needed_ceilings(["quantize_index_k", "store_index_k"]) == ["copy_bandwidth"]
    assert "fp8_matmul" not in interpreted_run[1]["ceilings"] and "read_once" not in interpreted_run[1]["ceilings"]
    assert {"fp8_matmul", "bf16_matmul", "copy_bandwidth", "read_once", "launch"} == set(kernel_ops_run["ceilings"])


def test_matmul_ceilings_run_here():
    """torch._scaled_mm with unit tensor-wide scales (keywords scale_a / scale_b / out_dtype / use_fast_accum)."""
    timer = timing.Timer(torch.device("cpu"), 1, 2, 0)
    for measure in (ceilings.fp8_matmul, ceilings.bf16_matmul):
        rate, details = measure(timer, True)
        assert rate > 0 and details["n"] == 128


@no_gpu
def test_kernel_ops_cpu_rows_are_labelled_and_checked(kernel_ops_run):
    report = kernel_ops_run
    assert report["gpu_run"] is False and "not a GPU run" in report["notice"]
    assert {r["op"] for r in report["results"]} == set(KERNEL_OPS)
    for name in KERNEL_OPS:
        cases = {c.name for c in harness.OPS[name].cases(True)}
        assert {r["case"] for r in report["results"] if r["op"] == name} == cases
    for r in report["results"]:
        assert r["mode"] == "CPU" and r["check"] == "ok" and r["eager_us"] > 0 and r["graph_us"] is None, r
    for name in ("fp8_matmul", "bf16_matmul", "copy_bandwidth"):
        assert report["ceilings"][name]["mode"] == "CPU" and report["ceilings"][name]["rate"] > 0
    assert not bench.failed(report)


def test_logits_rows_count_in_window_pairs_and_cached_bytes(kernel_ops_run):
    for r in kernel_ops_run["results"]:
        p = r["params"]
        if r["op"] == "mqa_logits":
            args = harness.OPS["mqa_logits"].build(BenchCase(r["case"], p), torch.Generator().manual_seed(0))
            pairs = int((args["ke"].clamp(0, p["keys"]) - args["ks"]).clamp_min(0).sum())
            assert r["flops"] == 2 * p["heads"] * p["dim"] * pairs
            assert r["roofline"] == f"{p['kind']}_matmul" and r["rate_unit"] == "TFLOP/s"
            assert r["ceiling_fraction"] == pytest.approx(r["floor_us"] / r["device_us"])
        elif r["op"] == "paged_mqa_logits":
            assert r["bytes"] == 132 * p["batch"] * p["context"] + 4 * p["batch"] * p["next_n"] * p["context"]
            assert r["roofline"] == "copy_bandwidth" and r["rate_unit"] == "GB/s"


def test_topk_rows_have_torch_topk_and_the_read_once_floor(kernel_ops_run):
    rows = [r for r in kernel_ops_run["results"] if r["op"] == "topk"]
    assert [r["backend"] for r in rows] == ["torch", "torch.topk"] * len(harness.OPS["topk"].cases(True))
    for r in rows:
        assert r["extra"] == (r["backend"] == "torch.topk") and r["roofline"] == "read_once"
        assert r["floor_us"] > 0 and r["ceiling_fraction"] == pytest.approx(r["floor_us"] / r["device_us"])
        assert r["speedup_vs_torch"] > 0 and r["speedup_vs_extra"] > 0
    fused = [r for r in kernel_ops_run["results"] if r["op"] == "topk_translate"]
    assert fused and all(r["floor_us"] > 0 and r["speedup_vs_extra"] is None for r in fused)
    table = bench.format_table(kernel_ops_run)
    assert "× torch.topk" in table and "% read_once" in table and "% roofline" in table


@no_gpu
def test_kernel_ops_interpreted_agree_with_torch(kernel_ops_interpreted):
    stdout, report = kernel_ops_interpreted
    assert "NOTE: not a GPU run" in stdout
    for r in report["results"]:
        assert r["check"] == "ok", r
        assert r["mode"] == ("interpreted" if r["backend"] == "cuda" else "CPU"), r
        if r["backend"] == "cuda":  # an interpreted time is set against no CPU measurement
            assert r["speedup_vs_torch"] is None and r["ceiling_fraction"] is None and r["floor_us"] is None
    assert {r["backend"] for r in report["results"]} == {"torch", "cuda", "torch.topk"}


def _with_ops(dispatch, name: str, **fns) -> None:
    dispatch.registry()[name] = Backend(name=name, priority=-1, probe=lambda: Availability(True, "test", mode="CPU"),
                                        ops={op: OpImpl(fn) for op, fn in fns.items()})


def test_logits_checks_catch_unwritten_and_wrong_values(fresh_dispatch):
    from indexcache.backends.torch import logits

    def unwritten(q, k, k_scale, weights, ks, ke, out):
        logits.mqa_logits(q, k, k_scale, weights, ks, ke, out)
        return out.index_fill_(0, torch.tensor([3]), float("nan"))

    def off(q, k_cache, weights, context_lens, page_table, max_context_len, out):
        logits.paged_mqa_logits(q, k_cache, weights, context_lens, page_table, max_context_len, out)
        return out.mul_(1.01)

    _with_ops(fresh_dispatch, "bad", mqa_logits=unwritten, paged_mqa_logits=off)
    report = bench.run(["mqa_logits", "paged_mqa_logits"], ["bad"], quick=True)
    checks = {(r["op"], r["check"].split(":")[0]) for r in report["results"] if r["backend"] == "bad"}
    assert checks == {("mqa_logits", "MISMATCH"), ("paged_mqa_logits", "MISMATCH")}
    details = " ".join(r["check"] for r in report["results"] if r["backend"] == "bad")
    assert "NaN" in details and "relative RMS error" in details
    assert len(bench.failed(report)) == (len(harness.OPS["mqa_logits"].cases(True))
                                         + len(harness.OPS["paged_mqa_logits"].cases(True)))


def test_topk_checks_compare_index_sets(fresh_dispatch):
    from indexcache.backends.torch import topk

    def reversed_rows(scores, lengths, k, row_starts, out, sorted):
        return out.copy_(topk.topk(scores, lengths, k, row_starts, out, sorted).flip(1))

    def one_wrong(scores, lengths, k, row_starts, out, sorted):
        topk.topk(scores, lengths, k, row_starts, out, sorted)
        out[0, 0] = (out[0, 0] + 1) % scores.shape[1] if out[0, 0] + 1 not in out[0] else out[0, 1]
        return out

    _with_ops(fresh_dispatch, "reversed", topk=reversed_rows)
    _with_ops(fresh_dispatch, "wrong", topk=one_wrong)
    report = bench.run(["topk"], ["reversed", "wrong"], quick=True)
    checks = {r["backend"]: r["check"] for r in report["results"]}
    assert checks["reversed"] == "ok" and checks["torch.topk"] == "ok", checks
    assert checks["wrong"].startswith("MISMATCH: row 0"), checks


def test_torch_topk_row_is_checked_by_the_scores_it_picks():
    """torch.topk breaks ties its own way: a row of equal scores must still pass; a wrong pick must not."""
    topk = harness.OPS["topk"]
    case = topk.cases(True)[0]
    args = topk.build(case, torch.Generator().manual_seed(0))
    args["scores"][0] = 1.0
    base = ops.topk(args["scores"], args["lengths"], args["k"], backend="torch")
    assert topk.same(topk.extras["torch.topk"](args), base, case) == ""
    idx, scores = topk.extras["torch.topk"](args)
    idx = idx.clone()
    idx[1, 0] = scores[1].argmin()
    assert topk.same((idx, scores), base, case) != ""


def test_call_times_ms_counts_calls_between_its_bounds():
    """At least ``min_reps`` calls, at most ``max_reps``; host-clock milliseconds off the GPU; no warm-up call."""
    calls = []
    times = timing.call_times_ms(lambda: calls.append(1), torch.device("cpu"), 0.0, 3, 10)
    assert len(times) == len(calls) == 3 and all(t >= 0 for t in times)
    calls.clear()
    assert len(timing.call_times_ms(lambda: calls.append(1), torch.device("cpu"), 60.0, 1, 4)) == len(calls) == 4


# ----------------------------------------------------------------------------------------------- fp8 cache ops


def test_fp8_cache_rows_count_the_bytes_moved(kernel_ops_run):
    rows = [r for r in kernel_ops_run["results"] if r["op"] in ("quantize_index_k", "store_index_k")]
    assert {r["op"] for r in rows} == {"quantize_index_k", "store_index_k"}
    for r in rows:
        p = r["params"]
        elem = {"bf16": 2, "fp32": 4}[p["kind"]]
        if r["op"] == "quantize_index_k":  # k read; fp8 values and a float32 scale a block written
            assert r["bytes"] == p["tokens"] * p["dim"] * (elem + 1) + 4 * p["tokens"] * p["dim"] // p["block"]
        else:  # k and the slots read; D fp8 bytes and a float32 scale a token written
            assert r["bytes"] == p["tokens"] * (p["dim"] * elem + 4 + p["dim"] + 4)
        assert r["roofline"] == "copy_bandwidth" and r["rate_unit"] == "GB/s" and r["check"] == "ok"


def test_fp8_cache_cases_are_decode_and_prefill_at_d128():
    for op in (harness.OPS["quantize_index_k"], harness.OPS["store_index_k"]):
        cases = op.cases(False)
        assert {(c.params["tokens"], c.params["kind"]) for c in cases} == {(64, "bf16"), (64, "fp32"),
                                                                          (8192, "bf16"), (8192, "fp32")}
        assert all(c.params["dim"] == 128 for c in cases)
    store = harness.OPS["store_index_k"]
    for case in store.cases(False):
        p = case.params
        slots = store.build(case, torch.Generator().manual_seed(0))["slot_mapping"].long()
        assert slots.unique().numel() == p["tokens"] and 0 <= slots.min() and slots.max() < p["pages"] * p["page_size"]
        pages = (slots // p["page_size"]).unique().numel()
        assert pages == (p["tokens"] if p["decode"] else p["tokens"] // p["page_size"])


def test_fp8_cache_checks_catch_wrong_bytes(fresh_dispatch):
    def coarse(k, fp8_dtype, block, out, out_scale):
        ops.quantize_index_k(k, fp8_dtype, block=block, out=out, out_scale=out_scale, backend="torch")
        return out, out_scale.mul_(2)

    def skips_one(k, k_cache, slot_mapping, fp8_dtype):
        ops.store_index_k(k[1:], k_cache, slot_mapping[1:], fp8_dtype, backend="torch")

    _with_ops(fresh_dispatch, "bad", quantize_index_k=coarse, store_index_k=skips_one)
    report = bench.run(["quantize_index_k", "store_index_k"], ["bad"], quick=True)
    checks = {(r["op"], r["check"]) for r in report["results"] if r["backend"] == "bad"}
    assert checks == {("quantize_index_k", "MISMATCH: scales differ from the torch backend's"),
                      ("store_index_k", "MISMATCH: cache bytes differ from the torch backend's")}


# ----------------------------------------------------------------------------------------------- timer, tables


def test_timer_without_a_budget_makes_exactly_warmup_then_reps_calls():
    calls = []
    timer = timing.Timer(torch.device("cpu"), warmup=2, reps=5, graph_reps=0, budget_s=None)
    assert timer.eager_us(calls.append) >= 0 and calls == list(range(7))


class _FakeDevice:
    """A stand-in for ``torch.cuda`` in the timer's GPU path: events read a clock that each call advances by its
    cost, so the timer's counting and rotation run here without a GPU."""

    def __init__(self):
        self.now_ms = 0.0
        self.current = "another device"  # the current device, which a timer's own need not be
        self.recorded_on = set()  # the devices current when events were recorded
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                self.at = fake.now_ms
                fake.recorded_on.add(fake.current)

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.at - self.at

        self.Event = Event

    @contextlib.contextmanager
    def device(self, device):
        before, self.current = self.current, device
        try:
            yield
        finally:
            self.current = before

    def synchronize(self, device=None):
        pass


def test_the_timer_records_its_events_on_its_own_device(fake_gpu):
    """Events go on the stream of the device they are recorded on: the timer's, not whichever is current."""
    gpu = torch.device("cuda", 1)
    timer = timing.Timer(gpu, warmup=2, reps=5, graph_reps=0)
    timer.eager_us(lambda i: None)
    timing.call_times_ms(lambda: None, gpu, budget_s=0.0, min_reps=2, max_reps=2)
    assert fake_gpu.recorded_on == {gpu}


@pytest.fixture
def fake_gpu(monkeypatch):
    fake = _FakeDevice()
    monkeypatch.setattr(timing, "on_gpu", lambda device: True)
    monkeypatch.setattr(timing, "_module", lambda device: fake)
    return fake


@pytest.mark.parametrize("warmup", [1, 2, 3, 4, 10])
@pytest.mark.parametrize("cost_ms", [0.01, 1.0, 400.0])
def test_timer_on_a_gpu_never_gives_a_call_the_previous_calls_input_set(fake_gpu, warmup, cost_ms):
    """The rotation's promise (BENCHMARKS.md, "Inputs rotate"): no call finds its inputs in L2 from the previous
    one. The call estimating the timed calls' count and the first timed call took the same input set (both
    ``fn(warmup)``), so the first sample was timed on a warm L2; and where MIN_REPS raised the warm-up's count
    past ``warmup``, the last warm-up call and the estimate did too. Here a call on the previous call's set is 10x
    cheaper, as an L2 hit would be."""
    sets, calls = 4, []

    def fn(i):
        fake_gpu.now_ms += cost_ms / 10 if calls and calls[-1] % sets == i % sets else cost_ms
        calls.append(i)

    us = timing.Timer(torch.device("cuda"), warmup=warmup, reps=100, graph_reps=0).eager_us(fn)
    assert all(a % sets != b % sets for a, b in zip(calls, calls[1:], strict=False)), calls
    assert us == pytest.approx(cost_ms * 1e3)


def test_times_ms_warms_up_then_times_bursts():
    calls = []
    times = timing.times_ms(lambda: calls.append(1), torch.device("cpu"), 0.0, 3, 3, warmup=4, calls=10)
    assert len(times) == 3 and len(calls) == 4 + 3 * 10
    result, wall, cpu = timing.host_seconds(lambda: sum(range(1000)))
    assert result == 499500 and wall >= 0 and cpu >= 0


def test_print_rows_and_markdown_table(capsys):
    output.print_rows("title", [{"a": 1.23456, "b": None}], ["a", "b"], digits=3)
    output.print_rows("dashes", [{"a": None}], ["a"], cell=lambda column, value: "-" if value is None else str(value))
    assert capsys.readouterr().out == "\ntitle\n   a     b\n1.23  None\n\ndashes\na\n-\n"
    assert output.markdown_table(["x", "y"], [["1", "2"]]) == "| x | y |\n|---|---|\n| 1 | 2 |"


# ----------------------------------------------------------------------------------------------- bench/ scripts

SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))


def _script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "INDEXCACHE_BACKEND"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_bench_script_imports_and_parses(name, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # dataclasses look the module up there
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        script.main()
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_host_path_profile_leaves_out_the_profilers_own_call(monkeypatch):
    """bench/host_path.py ranks a step's functions without the profiler's ``disable()``, which every profiled step
    ends with (on a GPU host it ranked among the heaviest)."""
    spec = importlib.util.spec_from_file_location("bench_host_path", ROOT / "bench" / "host_path.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)
    spec.loader.exec_module(script)
    profile = cProfile.Profile()
    profile.enable()
    sum(range(10))
    profile.disable()
    assert [f["function"] for f in script._heaviest(profile, 1, 5)] == ["~:0(<built-in method builtins.sum>)"]


def _report_tables():
    spec = importlib.util.spec_from_file_location("bench_report_tables", ROOT / "bench" / "report_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_result_file_has_a_table_that_names_its_gpu_date_and_commit():
    tables = _report_tables()
    files = sorted(p.name for p in tables.RESULTS.glob("*"))
    assert files == sorted(tables.TABLES), "benchmarks/results/ and report_tables.TABLES must name the same files"
    for name in files:
        result = json.loads((tables.RESULTS / name).read_text())
        gpu = result.get("gpu") or result.get("device")
        assert re.fullmatch(r"[0-9a-f]{40}", result["commit"]), (name, result["commit"])
        # A measurement on one of the GPUs lent to the project (an H200, or an H100 where none came), or one labelled
        # a CPU measurement of accuracy (never of speed).
        assert re.match(r"\d{4}-\d{2}-\d{2}T", result["date"]) and gpu, name
        assert re.search(r"\bH(200|100)\b", gpu) or (gpu.startswith("CPU") and "accuracy only" in gpu), (name, gpu)
        assert name.startswith(("h200", "h100", "cpu")) and ("H100" in gpu) == name.startswith("h100"), (name, gpu)
        first_line = tables.table(name).splitlines()[0]
        assert first_line.startswith(f"{gpu} · {result['date'][:10]} · commit {result['commit'][:10]}"), first_line
        assert "|---|" in tables.table(name), name


def test_every_result_file_measured_a_commit_of_this_history_after_it_was_made():
    """A result's commit was only checked for its form: one from another history, or a mistyped one, passed. Each
    is a commit that this checkout's HEAD descends from, and the result is dated after it was committed."""
    git = ["git", "-C", str(ROOT)]
    shallow = subprocess.run([*git, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git checkout")
    tables = _report_tables()
    for name in sorted(tables.TABLES):
        result = json.loads((tables.RESULTS / name).read_text())
        ancestor = subprocess.run([*git, "merge-base", "--is-ancestor", result["commit"], "HEAD"], capture_output=True)
        assert ancestor.returncode == 0, (name, result["commit"], ancestor.stderr)
        committed = subprocess.run([*git, "show", "-s", "--format=%cI", result["commit"]], capture_output=True,
                                   text=True, check=True).stdout.strip()
        measured = datetime.datetime.fromisoformat(result["date"])
        measured = measured if measured.tzinfo else measured.replace(tzinfo=datetime.timezone.utc)
        assert measured >= datetime.datetime.fromisoformat(committed), (name, result["date"], committed)


def test_launch_overhead_writes_the_date_commit_and_versions_its_table_names(monkeypatch):
    """bench/launch_overhead_gpu.py wrote only the GPU, torch and Triton: no date, no commit (the published file's
    were added by hand), so its own output could not be published (report_tables reads both)."""
    path = ROOT / "bench" / "launch_overhead_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_launch_overhead_gpu", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)
    spec.loader.exec_module(script)
    monkeypatch.setenv("INDEXCACHE_COMMIT", "c" * 40)
    rows = [{"case": "translate", "checked_eager_us": 9.0, "eager_us": 8.0, "graph_us": 4.0, "overhead_us": 4.0,
             "target": "<= 1", "met": False}]
    report = script.report(torch.device("cpu"), {"empty": 5.0}, {"translate": {"spec check": 1.0, "dispatch": 2.0}},
                           5.0, 6.0, rows)
    assert report["commit"] == "c" * 40 and re.match(r"\d{4}-\d{2}-\d{2}T", report["date"])
    assert {"torch", "triton", "cuda", "python", "indexcache"} <= set(report)
    report["gpu"] = "NVIDIA H200"  # as on the GPU (device_name gives None off one)
    first = _report_tables().launch_overhead(report).splitlines()[0]
    assert first.startswith(f"NVIDIA H200 · {report['date'][:10]} · commit cccccccccc"), first


def test_logits_decode_speedup_sets_graph_against_graph(monkeypatch):
    """bench/logits_gpu.py's decode "x torch" divided the torch backend's eager time (its host cost included) by our
    graph replay's time; it compares like with like: graph against graph, else eager against eager."""
    spec = importlib.util.spec_from_file_location("bench_logits_gpu", ROOT / "bench" / "logits_gpu.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)
    spec.loader.exec_module(script)
    used = []
    monkeypatch.setattr(script.indexcache, "paged_mqa_logits", lambda *a, out, backend: used.append(backend))
    eager_ms, graph_ms = {"cuda": 0.2, "torch": 5.7}, {"cuda": 0.1, "torch": 5.3}

    def timed(fn, *args):
        fn()
        return eager_ms[used[-1]]

    def graph_timed(fn, *args):
        fn()
        if used[-1] == "torch" and not capturable[0]:
            raise RuntimeError("not capturable")
        return graph_ms[used[-1]]

    monkeypatch.setattr(script, "_timed", timed)
    monkeypatch.setattr(script, "_graph_timed", graph_timed)
    monkeypatch.setattr(script, "DECODE_CASES", [(2, 128, 1)])
    capturable = [True]
    for capturable[0], want in ((True, 5.3 / 0.1), (False, 5.7 / 0.2)):
        row, = script.decode(torch.device("cpu"), torch.float8_e4m3fn, {"copy_gbps": 1000.0})
        assert row["speedup"] == pytest.approx(want) and row["torch_ms"] == 5.7 and row["graph_ms"] == 0.1


def test_benchmarks_md_shows_the_tables_the_committed_results_give():
    _script("report_tables", "--check")


def test_report_tables_check_fails_on_a_table_edited_by_hand(tmp_path, monkeypatch):
    tables = _report_tables()
    text = tables.BENCHMARKS.read_text()
    edited = tmp_path / "BENCHMARKS.md"
    edited.write_text(text.replace("| 104 % |", "| 105 % |", 1))
    monkeypatch.setattr(tables, "BENCHMARKS", edited)
    assert edited.read_text() != text and tables.main(["--check"]) == 1
    assert tables.main(["--write"]) == 0 and edited.read_text() == text


def test_a_package_inside_another_repository_records_no_commit(tmp_path, monkeypatch):
    """indexcache installed or copied into another project's git work tree (its venv, a copied tree) records no
    commit, not that project's HEAD as the commit the benchmark measured; its own checkout records its HEAD."""
    from indexcache.bench import provenance

    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    mine = provenance.git_state()[0]
    assert mine is None or re.fullmatch(r"[0-9a-f]{40}", mine)
    outer = tmp_path / "project"
    (outer / "venv" / "indexcache" / "bench").mkdir(parents=True)
    git = ["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "another project"], check=True)
    monkeypatch.setattr(provenance, "__file__", str(outer / "venv" / "indexcache" / "bench" / "provenance.py"))
    assert provenance.git_state() == (None, None)


def test_report_tables_prints_a_bench_row_that_was_not_timed(tmp_path):
    """An ``indexcache bench --json`` report whose rows were not all timed (a backend skipped, unsupported or failed:
    no time, no fraction of the copy) and whose launch had no graph time gives "—" there: it raised a TypeError."""
    tables = _report_tables()
    d = json.loads((tables.RESULTS / "h200-translate.json").read_text())
    d["ceilings"]["launch"]["graph_us"] = None
    untimed = dict.fromkeys(("eager_us", "graph_us", "rate", "ceiling_fraction", "launch_ratio", "speedup_vs_torch"))
    d["results"].append({**d["results"][-1], "backend": "rocm", "check": "skipped: not available", **untimed})
    (tmp_path / "h200-translate.json").write_text(json.dumps(d))
    text = tables.table("h200-translate.json", tmp_path)
    assert "µs eager, — µs in a graph" in text.splitlines()[0]
    assert text.splitlines()[-1] == f"| {d['results'][-1]['case']} | rocm | — | — | — | — | — | — |"


def test_calibrate_overlap_runs_small():
    done = _script("calibrate_overlap", "--layers", "8", "--rows", "16", "--k", "64", "--context", "4096", "--pool",
                   "512")
    assert "max error 0.0e+00" in done.stdout


@no_gpu
def test_e2e_smoke_runs_on_the_cpu(tmp_path):
    _script("e2e_gpu", "--smoke", "--out", str(tmp_path / "e2e.json"))
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert {"schema", "date", "device", "torch", "triton", "python", "commit", "scenarios"} <= set(report)
    assert report["device"] == "cpu" and not report["errors"]
    small = report["small_model"]
    assert small["compiled_aot_eager_equal"] and small["compiled_aot_eager_logits_max_abs_diff"] == 0


@no_gpu
def test_peers_smoke_reports_absent_peers_and_checks_ours(tmp_path):
    """Off a GPU no peer imports: each is reported absent with its reason, and ours still runs every case (the
    fused top-k checked against the plain one through the table's inverse, the producer step against the best
    logits of its own logits)."""
    _script("peers_gpu", "--smoke", "--out", str(tmp_path / "peers.json"))
    report = json.loads((tmp_path / "peers.json").read_text())
    assert report["schema"] == "indexcache-peers/1" and not report["errors"]
    assert set(report["peers"]) == {"DeepGEMM", "FlashInfer", "SGLang"}
    assert all(state.startswith(("absent: ", "present ")) for state in report["peers"].values())
    assert [row["op"] for row in report["rows"]] == ["mqa_logits"] * 2 + ["paged_mqa_logits"] * 2 + \
        ["topk_translate"] * 2 + ["paged_topk_translate"]
    assert all(row["ours_fused_agrees"] for row in report["rows"] if row["op"] == "topk_translate")
    assert all(row["ours_agrees"] for row in report["rows"] if row["op"] == "paged_topk_translate")


@no_gpu
def test_peers_smoke_variants_without_a_kernel_target(tmp_path):
    """``--variants`` off a GPU: where Triton has no target (no GPU, no interpreter) each logits row says why its
    variants were not raced; under the interpreter each variant is first checked against ours. Never an error."""
    _script("peers_gpu", "--smoke", "--variants", "--only", "logits", "--out", str(tmp_path / "peers.json"))
    report = json.loads((tmp_path / "peers.json").read_text())
    assert not report["errors"]
    from indexcache.backends.triton.target import interpreting

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from peers_gpu import VARIANTS
    finally:
        sys.path.pop(0)
    for row in report["rows"]:
        if interpreting():
            assert all(f"ours {name} agrees" in row for name in VARIANTS[row["op"]]), row
        else:
            assert row["variants"].startswith("not raced: "), row


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_cp_gpu_runs_on_gloo_ranks(tmp_path):
    _script("cp_gpu", "--nproc", "2", "--dist-backend", "gloo", "--keys", "4096", "--rows", "8", "--k", "16",
            "--reps", "2", "--out", str(tmp_path / "cp.json"))
    report = json.loads((tmp_path / "cp.json").read_text())
    assert report["schema"] == "indexcache-cp-bench/1" and report["world_size"] == 2
    assert all(r["equal"] and r["cp_topk_us"] > 0 for r in report["results"])


def test_fp4_recall_writes_a_recall_per_data_set_and_key_format(tmp_path):
    """bench/fp4_recall.py on the CPU: one row per (data set, key format: MXFP4 keys with fp8 and with MXFP4
    queries), each recall a share in (0, 1], fp8 keys keeping more of the true top-k than MXFP4 ones on normal data."""
    out = tmp_path / "recall.json"
    _script("fp4_recall", "--tokens", "4", "--keys", "2048", "--top", "256", "--seeds", "1", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    data = ("normal keys", "outlier channels (4 of 128 at 20x)", "small model's indexer (v32-like, first sparse layer)")
    formats = ("fp8 e4m3fn", "MXFP4", "MXFP4, MXFP4 queries")
    assert [(r["data"], r["keys"]) for r in rows] == [(d, f) for d in data for f in formats]
    assert all(0 < r["recall_min"] <= r["recall_mean"] <= 1 and r["rows"] == 4 for r in rows)
    assert rows[0]["recall_mean"] > rows[1]["recall_mean"]


def test_host_path_smoke_counts_the_python_calls_of_a_step(tmp_path):
    """bench/host_path.py --smoke: the cuda backend's host path for sm90 with launches stubbed, on the CPU; with
    --profile, each shape's heaviest functions, the project's own among them."""
    _script("host_path", "--smoke", "--profile", "5", "--out", str(tmp_path / "host.json"))
    report = json.loads((tmp_path / "host.json").read_text())
    assert report["arch"] == "sm90" and "not a GPU timing" in report["host"] and report["device"] is None
    assert [r["kind"] for r in report["rows"]] == ["decode", "prefill"]
    assert report["cold_host"] is False
    for row in report["rows"]:
        assert row["first_us"] > 0 and row["new_us"] > 0 and row["kept_us"] > 0 and row["python_calls"] > 100
        profile = row["profile"]
        assert len(profile) == 5 and all(f["cumulative_us"] >= f["own_us"] > 0 and f["calls"] > 0 for f in profile)
        assert [f["own_us"] for f in profile] == sorted((f["own_us"] for f in profile), reverse=True)
        assert all(re.fullmatch(r".+:\d+\(.+\)", f["function"]) for f in profile)
        assert any(f["function"].startswith("indexcache/") for f in profile)  # the project's own, by its path
    from indexcache.plan import LayerPlan
    from indexcache.tools.warmup import decode_calls

    plan = LayerPlan.from_config(ROOT / "examples" / "configs" / "deepseek-v3.2.json")
    want = [op for op, _ in decode_calls(plan, plan.page_size, torch.float8_e4m3fn, *report["rows"][0]["shape"])]
    assert report["rows"][0]["ops"] == want  # the step warmup lists, as bench/coldstart_gpu.py runs it


@no_gpu
def test_fp4_decode_smoke_runs_on_the_cpu(tmp_path):
    """bench/fp4_decode_gpu.py --smoke: tiny shapes interpreted, both formats, the decode ops on both backends and the
    prefill logits on the cuda one, the checks."""
    _script("fp4_decode_gpu", "--smoke", "--out", str(tmp_path / "fp4.json"))
    report = json.loads((tmp_path / "fp4.json").read_text())
    assert {"date", "commit", "device", "torch", "triton", "rows", "ratios"} <= set(report)
    assert report["device"] == "cpu" and not report["errors"]
    assert {(r["backend"], r["op"]) for r in report["ratios"]} == {
        (b, op) for b in ("cuda", "torch") for op in ("paged_mqa_logits", "paged_topk_translate")} | {
        ("cuda", "mqa_logits")}


def test_ragged_smoke_runs_on_the_cpu(tmp_path):
    """bench/ragged_gpu.py --smoke: both forms of both paged ops on the same rows, interpreted, the ragged logits
    equal to the uniform ones."""
    _script("ragged_gpu", "--smoke", "--out", str(tmp_path / "ragged.json"))
    report = json.loads((tmp_path / "ragged.json").read_text())
    assert report["device"] == "cpu" and not report["errors"]
    assert [r["op"] for r in report["rows"]] == ["paged_mqa_logits", "paged_topk_translate"]
    assert all(r["uniform_us"] > 0 and r["ragged_us"] > 0 for r in report["rows"])


@pytest.mark.parametrize("keys", ["fp8", "mxfp4"])
def test_overlap_smoke_runs_on_the_cpu_with_either_key_format(tmp_path, keys):
    """bench/overlap_gpu.py --smoke (the torch backend, in order): the decode and prefill layer with the index cache
    in fp8 or in DeepSeek-V4's MXFP4 keys, every shape measured and the side's indices the same under a budget; the
    HBM yardstick (a plain copy beside the main work) timed in both modes."""
    _script("overlap_gpu", "--smoke", "--keys", keys, "--out", str(tmp_path / "overlap.json"))
    report = json.loads((tmp_path / "overlap.json").read_text())
    assert report["keys"] == keys and [r["phase"] for r in report["rows"]] == ["decode", "prefill"]
    assert all(r["keys"] == keys and r["budget_equal"] and "error" not in r for r in report["rows"])
    for r in report["rows"]:
        assert all(r[tag]["copy_us"] > 0 and r[tag]["copy_overlap"]["us"] > 0 for tag in ("graph", "eager"))
        assert "copy" not in r["graph"]["modes"] and "copy overlap" not in r["graph"]["modes"]


@no_gpu
def test_streams_race_smoke_labels_its_interpreted_timing(tmp_path, monkeypatch):
    """Its smoke run printed the interpreted CPU timing under the GPU target ("met False") with nothing saying it
    was not a GPU timing; the section and its printout now name the clock."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "streams-race.json"
    done = _script("streams_race_gpu", "--smoke", "--iters", "1", "--rounds", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and not report["errors"] and all(row["ok"] for row in report["race"])
    assert report["timing"]["clock"] == "host clock, interpreted on the CPU: not a GPU timing"
    assert f"; {report['timing']['clock']}), target ratio" in done.stdout


def test_short_rows_smoke_runs_on_the_cpu(tmp_path):
    """bench/short_rows_gpu.py --smoke: the four batches, the step against our two ops (the same selection) and, on
    the short batches, against translate alone; the prefill chunks against their two ops."""
    _script("short_rows_gpu", "--smoke", "--out", str(tmp_path / "short.json"))
    report = json.loads((tmp_path / "short.json").read_text())
    assert report["device"] == "cpu" and not report["errors"]
    assert [r["batch"] for r in report["rows"]] == ["short graph", "long graph", "mixed", "long"]
    assert all(r["step_us"] > 0 and r["two_ops_us"] > 0 for r in report["rows"])
    assert [("translate_us" in r) for r in report["rows"]] == [True, True, False, False]
    assert [r["chunk"] for r in report["prefill_rows"]] == ["2 prompts of 40", "one prompt of 48 (N <= k)"]
    assert all(r["step_us"] > 0 and r["two_ops_us"] > 0 for r in report["prefill_rows"])


def test_hisparse_swap_smoke_runs_on_the_cpu(tmp_path):
    """bench/hisparse_swap_gpu.py --smoke: the Triton swap-in interpreted and the copy engine's path on the CPU, each
    M's copies landing where the plan says; no host link off the GPU. ``--race``: the kernel under each override too,
    checked the same way."""
    _script("hisparse_swap_gpu", "--smoke", "--race", "--out", str(tmp_path))
    report = json.loads((tmp_path / "hisparse_swap.json").read_text())
    assert report["device"] == "cpu" and not report["errors"] and report["link"] is None
    assert [r["misses"] for r in report["rows"]] == [2, 8]
    assert all(r["kernel_us"] > 0 and r["engine_us"] > 0 and r["bytes"] == r["copies"] * 656 for r in report["rows"])
    assert [(r["config"], r["misses"]) for r in report["race"]] == [("HOST_CACHE=.cg", 2), ("HOST_CACHE=.cg", 8)]
    assert all(r["kernel_us"] > 0 and r["over_table"] > 0 for r in report["race"])


def test_hisparse_smoke_runs_on_the_cpu(tmp_path):
    """bench/hisparse_gpu.py --smoke (torch backend): the plan, the swap-in of a layer and of a group against a host
    copy, the 61-layer step at freq 1 and 4 (a swap-in a layer, and a group) with its plans alone; every selected
    position of the step read its own row, every group layer's copied rows their host rows."""
    _script("hisparse_gpu", "--smoke", "--out", str(tmp_path / "hs.json"))
    report = json.loads((tmp_path / "hs.json").read_text())
    assert report["device"] == "cpu" and not report["errors"]
    assert [r["what"] for r in report["rows"]][-3:] == ["61-layer step, freq 1 (61 plans)",
                                                        "61-layer step, freq 4 (16 plans)",
                                                        "61-layer step, freq 4 (16 plans), a swap-in a group"]
    swaps = [r for r in report["rows"] if r["what"].startswith("swap-in")]
    assert len(swaps) == 4 and all(r["misses"] > 0 for r in swaps)
    assert all(r["us"] > 0 for r in report["rows"])
    assert set(report["ratios"]) == {"plans_f4_per_f1", "step_f4_per_f1", "step_f4_grouped_per_f4"}


def test_prefill_producer_smoke_runs_on_the_cpu(tmp_path):
    """bench/prefill_producer_gpu.py --smoke: the one-op call at each bound against the two ops, the bounded call
    over more keys against them too, every result the same; no peers off the GPU. ``--topk-race``: the first shape's
    top-k and two decode-like cases' under the table and each override, the same index sets; ``--producer-race``:
    each shape's whole step under each override, the same index sets as the two ops (an error otherwise);
    ``--parts``: our two ops' halves apart (the peers' only where they load); the two ops in passes of the one op's
    rows too; ``--launches``: each launch of the one op (at the default bound and in one pass) and of the two ops
    timed, in order, with each list's sum."""
    _script("prefill_producer_gpu", "--smoke", "--topk-race", "--producer-race", "--parts", "--launches", "--out",
            str(tmp_path / "pp.json"))
    report = json.loads((tmp_path / "pp.json").read_text())
    assert report["device"] == "cpu" and not report["errors"]
    race_cases = list(dict.fromkeys(r["case"] for r in report["topk_race"]))
    assert race_cases == ["16x300 causal k16", "4x300 random k16", "8x1000 random k16"]
    for case in race_cases:
        assert [r["config"] for r in report["topk_race"] if r["case"] == case] == [
            "table", "BLOCK_SMEM=0", "BLOCK_SMEM=2", "AHEAD_SAMPLE_RANK=0"]
    cases = list(dict.fromkeys(r["case"] for r in report["rows"]))
    assert len(cases) == 2
    for case, tokens in zip(cases, (16, 24), strict=True):  # the smoke run's default bound holds either in one pass
        assert [r["call"] for r in report["rows"] if r["case"] == case] == [
            "ours, bound 2 GiB", *(f"ours, bound {b / 4096:g} GiB" for b in (0.5, 1, 4)),
            *(f"ours, top-k {c}" for c in ("BLOCK_SMEM=0", "BLOCK_SMEM=2", "AHEAD_SAMPLE_RANK=0")), "ours, two ops",
            f"ours, two ops in passes of {tokens}", "part: ours, logits", "part: ours, top-k"]
    assert report["million"]["same_as_two_ops"] and report["peers"]["FlashInfer"].startswith("absent")
    for case in cases:  # --launches: each list's launches in order, then their sum
        rows = [r for r in report["launches"] if r["case"] == case]
        calls = list(dict.fromkeys(r["call"] for r in rows))
        assert calls == ["ours, bound 2 GiB", "ours, one pass", "ours, two ops"]
        for call in calls:
            mine = [r for r in rows if r["call"] == call]
            assert [r["launch"] for r in mine] == [*range(len(mine) - 1), "all"] and all(r["us"] > 0 for r in mine)
            assert mine[-1]["us"] == pytest.approx(sum(r["us"] for r in mine[:-1]), abs=0.5 * len(mine))
        two_ops = [r["kernel"] for r in rows if r["call"] == "ours, two ops"][:-1]
        assert two_ops[0] == "mqa_logits_kernel" and two_ops[-1] == "topk_finish_kernel"


def test_alternating_graph_us_times_each_call_every_round_off_a_gpu():
    """Off a GPU: each call runs once a round, in turn, and gets the median of its host times (a smoke run)."""
    order = []
    medians = timing.alternating_graph_us({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                          torch.device("cpu"), rounds=3, burst=5)
    assert order == ["a", "b"] * 3
    assert set(medians) == {"a", "b"} and all(us > 0 for us in medians.values())


# ----------------------------------------------------------------------------------------------- bench/sass_loops.py

SASS_LISTING = """Function:k
--:-:-:-:1\tMOV R1, c[0x0][0x28];
LBB0:
--:-:-:-:4\tLDG.E R2, desc[UR4][R4.64];
--:-:-:-:2\tNOP;
LBB1:
--:-:-:-:1\tHGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24;
--:-:-:-:3\tPRMT R5, R6, 0x7610, R5;
--:-:-:-:5\t@P0 BRA LBB1;
--:-:-:-:1\tBAR.SYNC.DEFER_BLOCKING 0x0;
--:-:-:-:6\t@!P1 BRA LBB0;
--:-:-:-:5\tEXIT;
LBB2:
--:-:-:-:0\tBRA LBB2;
"""


@pytest.fixture
def sass_loops(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_sass_loops", ROOT / "bench" / "sass_loops.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look the module up there
    spec.loader.exec_module(module)
    return module


def test_sass_loops_of_a_listing_nested_with_stalls_and_classes(sass_loops):
    """Two loops (the inner one closed first), NOPs not counted, stall counts summed, opcode classes counted; the
    branch to itself after EXIT is no loop."""
    found = sass_loops.loops(SASS_LISTING)
    assert [(lp.label, lp.instructions, lp.stall_cycles, lp.inner) for lp in found] == [
        ("LBB0", 6, 4 + 1 + 3 + 5 + 1 + 6, False), ("LBB1", 3, 1 + 3 + 5, True)]
    assert found[1].classes == {"matrix": 1, "permute": 1, "branch": 1}
    assert found[0].classes == {"global": 1, "matrix": 1, "permute": 1, "branch": 2, "sync": 1}
    assert sass_loops.opcode("@!P0 BRA LBB3;") == "BRA"
    assert sass_loops.opcode("IMAD.WIDE.U32 R2, R3, 0x4, R4 ;") == "IMAD.WIDE.U32"


def test_sass_loops_of_a_real_build_for_sm90(sass_loops, tmp_path):
    """The top-k sample kernel cross-compiled for sm90 under a tuning override: its radix rounds are an inner loop
    with control codes read; an unknown kernel or a bad override is an error."""
    out = tmp_path / "loops.json"
    assert sass_loops.main(["--kernel", "topk_sample_kernel", "--where", "COUNTS=False", "--where",
                            "HAS_STARTS=False", "--tuning", "topk.SAMPLE_ROUNDS=3", "--out", str(out)]) == 0
    (build,) = json.loads(out.read_text())["builds"]
    assert build["config"]["ROUNDS"] == 3
    inner = [lp for lp in build["loops"] if lp["inner"]]
    assert inner and all(lp["instructions"] > 10 and lp["stall_cycles"] > 0 for lp in inner)
    assert sass_loops.main(["--kernel", "no_such_kernel"]) == 2
    with pytest.raises(SystemExit):
        sass_loops.main(["--kernel", "topk_sample_kernel", "--tuning", "nope.X=1"])


# ----------------------------------------------------------------------------------------------- bench/ncu_stalls.py

_NCU_HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier",'
               '"stall_long_sb","stall_long_sb (Not Issued)","stall_selected"')
NCU_SOURCE_CSV = f'''"Kernel Name","k_loop",
{_NCU_HEADER}
"0x10","  MOV R1, c[0x0][0x28]","2","100","0","2","2","0"
"0x20","  LDG.E R2, desc[UR4][R4.64]","30","4,000","0","24","24","6"
"0x30","  @P0 BRA 0x20","10","4,000","0","0","0","10"
"0x40","  NOP","58","50","58","0","0","0"
"Kernel Name","k_other",
{_NCU_HEADER}
"0x10","  EXIT","1","1","0","0","0","1"
'''


def test_ncu_stalls_reads_kernels_reasons_and_loop_groups(tmp_path, capsys):
    """Each kernel of the CSV apart; reasons as shares of the kernel's samples (not-issued twins left out, counts with
    thousands separators read); the code grouped by times run, the most sampled group first; a missing kernel exits
    2."""
    spec = importlib.util.spec_from_file_location("bench_ncu_stalls", ROOT / "bench" / "ncu_stalls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (first, rows), (second, _) = module.kernels(NCU_SOURCE_CSV)
    assert (first, second, len(rows)) == ("k_loop", "k_other", 4)
    s = module.summary(rows, top=2)
    assert s["total"] == 100 and s["reasons"] == {"barrier": 0.58, "long_sb": 0.26, "selected": 0.16}
    assert [(g["executed"], g["instructions"], g["share"]) for g in s["groups"]] == [(50, 1, 0.58), (4000, 2, 0.4),
                                                                                     (100, 1, 0.02)]
    assert s["groups"][1]["reasons"] == {"long_sb": 0.24, "selected": 0.16}
    assert [t["source"] for t in s["top"]] == ["NOP", "LDG.E R2, desc[UR4][R4.64]"]
    path = tmp_path / "rep.csv"
    path.write_text(NCU_SOURCE_CSV)
    out = tmp_path / "stalls.json"
    assert module.main([str(path), "--kernel", "loop", "--out", str(out)]) == 0
    assert [k["kernel"] for k in json.loads(out.read_text())] == ["k_loop"]
    assert module.main([str(path), "--kernel", "absent"]) == 2
    assert "no kernel named 'absent'" in capsys.readouterr().err


def test_bench_help_lists_the_ops_its_op_option_takes_and_names_the_scripts_of_the_others():
    """``--op``'s help named the HiSparse ops, which ``--op`` refuses (they have no bench record)."""
    from indexcache.hal.specs import OP_NAMES

    assert set(OP_NAMES) - set(cli.UNBENCHED) == set(harness.OPS)
    assert all((ROOT / script).is_file() for script in cli.UNBENCHED.values())
    text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["bench"].format_help().split())
    listed = text.split("an op to time: ")[1].split(" (repeatable")[0].split(", ")
    assert listed == [n for n in OP_NAMES if n in harness.OPS]


def test_bench_help_names_each_ops_ceiling_as_the_harness_sets_it():
    """The description named the ceilings of translate's, the logits' and the top-k's only: paged_topk_translate,
    mqa_topk_translate and the index-cache ops were timed against ceilings it never named."""
    text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["bench"].description.split())
    clauses = text.split("torch always runs, as the speed-up baseline). ")[1].split(". Off a GPU")[0].split(";")
    phrase = {"copy_bandwidth": ("copy bandwidth",), "read_once": ("one read of",),
              "fp8_matmul": ("the fp8 one", "matmul rate of its dtype"), "bf16_matmul": ("matmul rate of its dtype",)}
    for name, op in harness.OPS.items():
        clause, = (c for c in clauses if re.search(rf"(?<![\w.]){name}\b", c))
        for roofline in {op.roofline_of(case) for case in op.cases(False)}:
            assert any(p in clause for p in phrase[roofline]), (name, roofline, clause)
