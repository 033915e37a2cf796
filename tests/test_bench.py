"""``indexcache bench`` on the CPU: end to end on tiny shapes, honest labels, checks that can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from indexcache import bench, cli
from indexcache.dispatch import Availability, Backend, OpImpl

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU labels; this machine has a GPU")


@pytest.fixture(scope="module")
def interpreted_run(tmp_path_factory):
    """One quick ``indexcache bench --op translate`` with the Triton backends interpreted: (stdout, report)."""
    path = tmp_path_factory.mktemp("bench") / "translate.json"
    env = {k: v for k, v in os.environ.items() if k != "INDEXCACHE_BACKEND"} | {"TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "indexcache.cli", "bench", "--op", "translate", "--quick", "--json",
                           str(path)], capture_output=True, text=True, env=env, timeout=600)
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
    cases = {c.name for c in bench.TRANSLATE.cases(True)}
    assert {r["case"] for r in report["results"]} == cases
    for r in report["results"]:
        assert r["check"] == "ok", r
        assert r["eager_us"] > 0 and r["graph_us"] is None and r["sets"] >= bench.MIN_SETS
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
        assert {key for _, key, _ in bench.COLUMNS} <= set(r)
        line = next(x for x in stdout.splitlines() if x.startswith(r["case"]) and f" {r['backend']} " in x)
        assert r["mode"] in line and r["check"] in line
    assert "GB/s" in stdout and "% copy_bandwidth" in stdout


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

    op = bench.BenchOp(
        name="negate",
        cases=lambda quick: [bench.Case("n16", {"n": 16})],
        build=build,
        call=lambda a, backend: torch.neg(a["x"], out=a["out"]),
        bytes=lambda case: 8 * case.params["n"],
    )
    monkeypatch.setitem(bench.OPS, "negate", op)
    report = bench.run(["negate"], ["torch"], quick=True)
    (row,) = report["results"]
    assert (row["op"], row["case"], row["check"], row["bytes"], row["flops"]) == ("negate", "n16", "ok", 128, 0)
    assert row["rate"] > 0 and row["rate_unit"] == "GB/s"
    assert "op negate" in bench.format_table(report)


def test_unknown_names_exit_2(capsys):
    assert cli.main(["bench", "--op", "nope", "--quick"]) == 2
    assert cli.main(["bench", "--backend", "nope", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--op: expected one of" in err and "backend: expected one of" in err


# ----------------------------------------------------------------------------------------------- logits and top-k

KERNEL_OPS = ["mqa_logits", "paged_mqa_logits", "topk", "topk_translate"]


@pytest.fixture(scope="module")
def kernel_ops_run():
    """The four kernel ops, --quick, torch backend on the CPU (in process)."""
    return bench.run(KERNEL_OPS, ["torch"], quick=True)


@pytest.fixture(scope="module")
def kernel_ops_interpreted(tmp_path_factory):
    """The four kernel ops, --quick, the cuda Triton backend interpreted against torch: (stdout, report)."""
    path = tmp_path_factory.mktemp("bench") / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "INDEXCACHE_BACKEND"} | {"TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "indexcache.cli", "bench", "--quick", "--backend", "cuda", "--json", str(path)]
    for op in KERNEL_OPS:
        command += ["--op", op]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(path.read_text())


def test_only_the_ceilings_an_op_needs_are_measured(interpreted_run, kernel_ops_run):
    assert bench.needed_ceilings(["translate"]) == ["copy_bandwidth"]
    assert set(bench.needed_ceilings(["mqa_logits"])) == {"fp8_matmul", "bf16_matmul", "copy_bandwidth"}
    assert set(bench.needed_ceilings(["paged_mqa_logits"])) == {"fp8_matmul", "bf16_matmul", "copy_bandwidth"}
    assert bench.needed_ceilings(["topk", "topk_translate"]) == ["read_once"]
    assert "fp8_matmul" not in interpreted_run[1]["ceilings"] and "read_once" not in interpreted_run[1]["ceilings"]
    assert {"fp8_matmul", "bf16_matmul", "copy_bandwidth", "read_once", "launch"} == set(kernel_ops_run["ceilings"])


def test_matmul_ceilings_run_here():
    """torch._scaled_mm with unit tensor-wide scales (keywords scale_a / scale_b / out_dtype / use_fast_accum)."""
    timer = bench.Timer(torch.device("cpu"), 1, 2, 0)
    for measure in (bench._fp8_matmul, bench._bf16_matmul):
        rate, details = measure(timer, True)
        assert rate > 0 and details["n"] == 128


@no_gpu
def test_kernel_ops_cpu_rows_are_labelled_and_checked(kernel_ops_run):
    report = kernel_ops_run
    assert report["gpu_run"] is False and "not a GPU run" in report["notice"]
    assert {r["op"] for r in report["results"]} == set(KERNEL_OPS)
    for name in KERNEL_OPS:
        cases = {c.name for c in bench.OPS[name].cases(True)}
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
            args = bench.MQA_LOGITS.build(bench.Case(r["case"], p), torch.Generator().manual_seed(0))
            pairs = int((args["ke"].clamp(0, p["keys"]) - args["ks"]).clamp_min(0).sum())
            assert r["flops"] == 2 * p["heads"] * p["dim"] * pairs
            assert r["roofline"] == f"{p['kind']}_matmul" and r["rate_unit"] == "TFLOP/s"
            assert r["ceiling_fraction"] == pytest.approx(r["floor_us"] / r["device_us"])
        elif r["op"] == "paged_mqa_logits":
            assert r["bytes"] == 132 * p["batch"] * p["context"] + 4 * p["batch"] * p["next_n"] * p["context"]
            assert r["roofline"] == "copy_bandwidth" and r["rate_unit"] == "GB/s"


def test_topk_rows_have_torch_topk_and_the_read_once_floor(kernel_ops_run):
    rows = [r for r in kernel_ops_run["results"] if r["op"] == "topk"]
    assert [r["backend"] for r in rows] == ["torch", "torch.topk"] * len(bench.TOPK.cases(True))
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
    assert len(bench.failed(report)) == len(bench.MQA_LOGITS.cases(True)) + len(bench.PAGED_MQA_LOGITS.cases(True))


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
    case = bench.TOPK.cases(True)[0]
    args = bench.TOPK.build(case, torch.Generator().manual_seed(0))
    args["scores"][0] = 1.0
    base = bench.ops.topk(args["scores"], args["lengths"], args["k"], backend="torch")
    assert bench._same_topk(bench._torch_topk(args), base, case) == ""
    idx, scores = bench._torch_topk(args)
    idx = idx.clone()
    idx[1, 0] = scores[1].argmin()
    assert bench._same_topk((idx, scores), base, case) != ""


def test_call_times_ms_counts_calls_between_its_bounds():
    """At least ``min_reps`` calls, at most ``max_reps``; host-clock milliseconds off the GPU; no warm-up call."""
    from indexcache.bench import call_times_ms

    calls = []
    times = call_times_ms(lambda: calls.append(1), torch.device("cpu"), 0.0, 3, 10)
    assert len(times) == len(calls) == 3 and all(t >= 0 for t in times)
    calls.clear()
    assert len(call_times_ms(lambda: calls.append(1), torch.device("cpu"), 60.0, 1, 4)) == len(calls) == 4
