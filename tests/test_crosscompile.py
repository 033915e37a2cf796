"""The cross-compile check (indexcache.backends.triton.crosscompile): real kernels build for each vendor and use
the matrix units; broken configurations are caught with their reason; the CLI and the conformance report
carry the results. Compiles for GPUs this machine does not have; runs nothing."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from indexcache.backends.cuda.tuning import tuning as cuda_tuning
from indexcache.backends.rocm.tuning import tuning as rocm_tuning
from indexcache.backends.triton import crosscompile as cc
from indexcache.backends.triton import logits, translate
from indexcache.conformance.suite import table
from indexcache.conformance.worker import to_markdown
from indexcache.tools import cli

TUNING = {"cuda": cuda_tuning, "rocm": rocm_tuning}


def specs(module, backend: str, arch: str) -> list[cc.KernelSpec]:
    """The module's specs as ``backend`` declares them for ``arch``."""
    return module.compile_specs(cc.gpu_target(backend, arch), TUNING[backend](arch))


def decode_spec(backend: str, arch: str) -> cc.KernelSpec:
    """paged_mqa_logits with one draft token: an fp8 matrix kernel."""
    return next(s for s in specs(logits, backend, arch) if s.op == "paged_mqa_logits" and s.constexprs["NEXT_N"] == 1)


@pytest.fixture
def fresh(monkeypatch):
    """The check with an empty per-process cache, restored afterwards."""
    monkeypatch.setattr(cc, "_CACHE", {})
    return cc


@pytest.mark.parametrize(("backend", "arch"), [("rocm", "gfx942"), ("rocm", "gfx950"), ("cuda", "sm80"),
                                               ("cuda", "sm90")])
def test_translate_builds_without_spills(backend, arch):
    result = cc.compile_spec(specs(translate, backend, arch)[0], cc.gpu_target(backend, arch))
    assert result["status"] == "passed", result["reasons"]
    res = result["resources"]
    assert (res.get("regs") or res.get("vgpr")) > 0
    assert res["scratch_bytes"] == 0 and res["shared_bytes"] <= cc.gpu_target(backend, arch).gpu.shared_per_block
    assert result["matrix"] is None


@pytest.mark.parametrize(("backend", "arch", "instruction"), [
    ("rocm", "gfx942", "v_mfma_f32_32x32x16_fp8_fp8"),
    ("rocm", "gfx950", "v_mfma_f32_32x32x64_f8f6f4"),
    ("cuda", "sm89", "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"),
    ("cuda", "sm90", "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"),
    ("cuda", "sm100", "tcgen05.mma.cta_group::1.kind::f8f6f4"),
    ("cuda", "sm120", "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"),
])
def test_fp8_decode_uses_the_fp8_matrix_instructions(backend, arch, instruction):
    result = cc.compile_spec(decode_spec(backend, arch), cc.gpu_target(backend, arch))
    assert instruction in result["matrix_instructions"]
    assert not [r for r in result["reasons"] if "matrix" in r]


SM120_SCALED = "mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e4m3.f32.ue8m0"


@pytest.mark.parametrize(("backend", "arch", "instruction", "fp4_queries"), [
    ("rocm", "gfx950", "v_mfma_scale_f32_32x32x64_f8f6f4", "v_mfma_scale_f32_32x32x64_f8f6f4"),
    ("cuda", "sm100", "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32",
     "tcgen05.mma.cta_group::1.kind::mxf4.block_scale.block32"),
    ("cuda", "sm120", SM120_SCALED, SM120_SCALED),
])
def test_mxfp4_logits_use_the_block_scaled_matrix_instruction(backend, arch, instruction, fp4_queries):
    """On targets with a block-scaled MMA the MXFP4 decode and prefill ask for it (``matrix="scaled"``) and build it,
    without spills (docs/fp4.md, "Scaled matrix instructions"); with MXFP4 queries too (``Q_FP4``: sm100 then takes
    the all-FP4 instruction, ``kind::mxf4``)."""
    target = cc.gpu_target(backend, arch)
    built = [s for s in specs(logits, backend, arch) if s.constexprs.get("MXFP4")
             and (s.op == "mqa_logits" or s.constexprs.get("NEXT_N") == 1)]
    assert {(s.op, s.constexprs.get("Q_FP4")) for s in built} == {
        (op, q_fp4) for op in ("mqa_logits", "paged_mqa_logits") for q_fp4 in (0, 1)}
    for spec in built:
        assert spec.matrix == "scaled"
        result = cc.compile_spec(spec, target)
        assert result["status"] == "passed", result["reasons"]
        assert (fp4_queries if spec.constexprs.get("Q_FP4") else instruction) in result["matrix_instructions"]


def test_amd_builds_each_pointer_span_a_launch_can_have():
    """AMD's Triton builds a kernel apart for tensors under 2 GiB (buffer loads and stores) and larger ones (global
    ones), as a launch's tensors have them: the check builds both; NVIDIA's builds no such difference."""
    target = cc.gpu_target("rocm", "gfx942")
    assert cc.spans(target) == ("under 2 GiB", "2 GiB or more")
    assert cc.spans(cc.gpu_target("cuda", "sm90")) == (None,)
    spec = specs(translate, "rocm", "gfx942")[0]
    loads = {}
    for span in cc.spans(target):
        asm = cc.build(spec, target, span).asm["amdgcn"]
        loads[span] = ("buffer_load" in asm, "global_load" in asm)
    assert loads == {"under 2 GiB": (True, False), "2 GiB or more": (False, True)}


def test_the_check_lists_a_build_for_each_span(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "KERNEL_MODULES", ("translate",))
    results = fresh.check_target("rocm", "gfx942")
    assert [r["config"]["span"] for r in results] == ["under 2 GiB", "2 GiB or more"] * len(
        specs(translate, "rocm", "gfx942"))
    assert all("span" not in r["config"] for r in fresh.check_target("cuda", "sm90"))


@pytest.mark.parametrize(("allowed", "failed"), [(0, True), (64, False)])
def test_a_spec_may_allow_more_sgpr_spills(allowed, failed):
    spec = dataclasses.replace(specs(translate, "rocm", "gfx942")[0], sgpr_spills=allowed)
    res = {"vgpr": 64, "agpr": 0, "sgpr": 106, "vgpr_spills": 0, "sgpr_spills": 53, "scratch_bytes": 0,
           "shared_bytes": 0}
    reasons = cc._rules(spec, cc.gpu_target("rocm", "gfx942"), res, [], "")
    assert reasons == (["spills: 53 SGPRs (more than 32 into VGPR lanes)"] if failed else [])


def test_the_compiled_for_rules_say_a_kernel_may_allow_more_sgpr_spills():
    """The conformance report's "compiled for" section stated at most MAX_SGPR_SPILLS SGPR spills as the rule while
    the HiSparse plan's builds pass with up to its SGPR_SPILLS (more): the rule names the allowance."""
    from indexcache.backends.triton.hisparse import plan as hisparse_plan

    assert hisparse_plan.SGPR_SPILLS > cc.MAX_SGPR_SPILLS
    text = " ".join("\n".join(cc.markdown([])).split())
    assert (f"at most {cc.MAX_SGPR_SPILLS} SGPR spills (into VGPR lanes), or the more a kernel allows (its spec's "
            "sgpr_spills);") in text


def test_32_warps_on_a_wave64_target_is_caught():
    spec = specs(translate, "rocm", "gfx942")[0]
    result = cc.compile_spec(dataclasses.replace(spec, options={**spec.options, "num_warps": 32}),
                             cc.gpu_target("rocm", "gfx942"))
    assert result["status"] == "failed"
    assert any("2048 threads a block (32 warps of 64), above 1024" in r for r in result["reasons"])


@pytest.mark.parametrize(("backend", "arch", "why"), [("rocm", "gfx942", "spills: "),
                                                      ("cuda", "sm90", "stack frame in local memory")])
def test_a_tile_that_must_spill_is_caught(backend, arch, why):
    """4K indices a program held by one warp: more values a thread than registers."""
    spec = specs(translate, backend, arch)[0]
    big = dataclasses.replace(spec, constexprs={**spec.constexprs, "BLOCK_R": 4, "BLOCK_K": 1024},
                              options={"num_warps": 1})
    result = cc.compile_spec(big, cc.gpu_target(backend, arch))
    assert result["status"] == "failed"
    assert any(why in r for r in result["reasons"]), result["reasons"]


def test_fnuz_fp8_on_gfx950_is_caught():
    """gfx942's fp8 format (e4m3fnuz) fed to gfx950: Triton upcasts it to fp16, no fp8 MFMA."""
    result = cc.compile_spec(decode_spec("rocm", "gfx942"), cc.gpu_target("rocm", "gfx950"))
    assert result["status"] == "failed"
    assert any(r.startswith("gfx950 fed fnuz fp8") for r in result["reasons"])
    assert any(r.startswith("matrix kernel without fp8 matrix instructions") for r in result["reasons"])
    assert not any("fp8" in cc.operand_types(i) for i in result["matrix_instructions"])


def test_ocp_fp8_on_gfx942_lacks_the_fp8_matrix_instructions():
    """gfx950's fp8 format (e4m3fn) on gfx942 is emulated: the dot runs in fp16."""
    result = cc.compile_spec(decode_spec("rocm", "gfx950"), cc.gpu_target("rocm", "gfx942"))
    assert result["status"] == "failed"
    assert any(r.startswith("matrix kernel without fp8 matrix instructions (found: v_mfma_") for r in result["reasons"])


def test_shared_memory_beyond_the_block_limit_is_caught():
    spec = specs(translate, "cuda", "sm89")[0]
    target = cc.gpu_target("cuda", "sm89")
    within = {"regs": 32, "stack_bytes": 0, "scratch_bytes": 0, "shared_bytes": 99 * 1024}
    assert cc._rules(spec, target, within, [], "") == []
    reasons = cc._rules(spec, target, {**within, "shared_bytes": 99 * 1024 + 1}, [], "")
    assert reasons == ["shared memory: 101377 bytes, above sm89's 101376 a block"]


def test_a_stack_frame_passes_only_within_what_the_kernel_allows():
    spec = specs(translate, "cuda", "sm90")[0]
    target = cc.gpu_target("cuda", "sm90")
    res = {"regs": 64, "stack_bytes": 8, "scratch_bytes": 0, "shared_bytes": 0}
    assert cc._rules(spec, target, res, [], "") == ["spills: a 8-byte stack frame in local memory"]
    allowing = dataclasses.replace(spec, stack_bytes=8)
    assert cc._rules(allowing, target, res, [], "") == []
    assert cc._rules(allowing, target, {**res, "stack_bytes": 16}, [], "") == [
        "spills: a 16-byte stack frame in local memory (the kernel allows 8)"]


def test_the_help_says_which_spills_pass():
    """`indexcache compile-check --help` said it fails on any spill; up to MAX_SGPR_SPILLS AMD SGPR spills and the
    stack frame a kernel allows pass (and the more SGPR spills a kernel allows); AMD builds both pointer spans."""
    parser = cli.build_parser()._subparsers._group_actions[0].choices["compile-check"]
    help_text = " ".join(parser.format_help().split())
    assert (f"up to {cc.MAX_SGPR_SPILLS} AMD SGPR spills into VGPR lanes, or the more a kernel allows, and the stack "
            "frame a kernel allows, pass") in help_text
    assert "each for tensors under 2 GiB, buffer loads, and larger ones" in help_text


@pytest.mark.parametrize(("instruction", "types"), [
    ("v_mfma_f32_32x32x16_fp8_fp8", {"fp8"}),
    ("v_mfma_f32_32x32x64_f8f6f4", {"fp8"}),
    ("v_mfma_f32_32x32x8_bf16", {"bf16"}),
    ("v_mfma_f32_32x32x8_f16", {"fp16"}),
    ("v_mfma_f32_32x32x4_xf32", {"tf32"}),
    ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", {"bf16"}),
    ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", {"fp16"}),
    ("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32", {"fp8"}),
    ("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3", {"fp8"}),
    ("tcgen05.mma.cta_group::1.kind::f8f6f4", {"fp8"}),
    ("tcgen05.mma.cta_group::1.kind::f16", {"bf16", "fp16"}),
    ("tcgen05.mma.cta_group::1.kind::tf32", {"tf32"}),
    ("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32", {"fp8", "scaled"}),
    ("mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e4m3.f32.ue8m0",
     {"fp8", "scaled"}),
    ("v_mfma_scale_f32_32x32x64_f8f6f4", {"fp8", "scaled"}),
])
def test_operand_types_of_matrix_instructions(instruction, types):
    assert cc.operand_types(instruction) == types


def test_a_module_without_compile_specs_fails(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "KERNEL_MODULES", ("support",))
    [result] = fresh.check_target("rocm", "gfx942")
    assert (result["module"], result["status"], result["reasons"]) == ("support", "failed",
                                                                       ["no compile specs declared"])


def test_a_kernel_without_a_spec_fails(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "KERNEL_MODULES", ("translate",))
    monkeypatch.setattr(translate, "compile_specs", lambda target, tuning: [])
    [result] = fresh.check_target("cuda", "sm90")
    assert (result["kernel"], result["reasons"]) == ("translate_kernel", ["kernel has no compile spec"])


@pytest.mark.parametrize("backend", sorted(cc.TARGETS))
def test_every_kernel_module_covers_its_kernels(backend):
    for arch in cc.TARGETS[backend]:
        for module, declared, kernels in cc.declared(backend, arch):
            assert declared is not None, f"{module} declares no compile specs"
            assert set(kernels) <= {s.kernel for s in declared}, f"{module}: kernels without a spec on {arch}"


def test_a_kernel_package_covers_the_kernels_it_exposes():
    """topk is a package: its kernels live in topk.kernels, and the check covers those its face exposes."""
    kernels = {module: names for module, _, names in cc.declared("cuda", "sm90")}["topk"]
    assert kernels == ["topk_filter_kernel", "topk_finish_kernel", "topk_rows_kernel", "topk_sample_kernel",
                       "topk_sort_kernel"]


def test_specs_follow_the_backend_fp8_policy():
    for backend, arch, fp8 in (("rocm", "gfx942", torch.float8_e4m3fnuz), ("rocm", "gfx950", torch.float8_e4m3fn),
                               ("cuda", "sm90", torch.float8_e4m3fn)):
        assert decode_spec(backend, arch).types["q_ptr"] == cc.pointer(fp8)


def test_cli_writes_json_and_a_table(fresh, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(fresh, "KERNEL_MODULES", ("translate",))
    path = tmp_path / "compile.json"
    assert cli.main(["compile-check", "--backend", "rocm", "--target", "gfx942", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert len(results) == len(specs(translate, "rocm", "gfx942")) * len(cc.spans(cc.gpu_target("rocm", "gfx942")))
    assert {(r["backend"], r["target"], r["kernel"], r["status"]) for r in results} == {
        ("rocm", "gfx942", "translate_kernel", "passed")}
    out = capsys.readouterr().out
    assert "translate_kernel" in out and f"{len(results)} of {len(results)} kernel builds pass" in out


def test_cli_exits_1_on_a_broken_configuration(fresh, monkeypatch, capsys):
    monkeypatch.setattr(fresh, "KERNEL_MODULES", ("translate",))
    declared = translate.compile_specs

    def broken(target, tuning):
        return [dataclasses.replace(s, options={**s.options, "num_warps": 32}) for s in declared(target, tuning)[:1]]

    monkeypatch.setattr(translate, "compile_specs", broken)
    assert cli.main(["compile-check", "--backend", "rocm", "--target", "gfx950"]) == 1
    assert "FAILED rocm gfx950 translate_kernel: 2048 threads a block" in capsys.readouterr().err


def test_cli_rejects_an_unknown_target(capsys):
    assert cli.main(["compile-check", "--backend", "rocm", "--target", "sm90"]) == 2
    assert "--target: no target of --backend rocm is 'sm90'" in capsys.readouterr().err
    # a mistyped one beside one that matches is named too, not dropped (nothing compiled)
    assert cli.main(["compile-check", "--target", "sm90", "--target", "sm9O"]) == 2
    assert "--target: no target of --backend all is 'sm9O'" in capsys.readouterr().err
    assert cli.main(["compile-check", "--target", ""]) == 2  # an empty name is shown, not left invisible
    assert "--target: no target of --backend all is '' (known: " in capsys.readouterr().err
    assert cli.main(["compile-check", "--jobs", "0"]) == 2  # worded as conformance's --jobs
    assert "--jobs: expected an int >= 1, got 0" in capsys.readouterr().err


def test_conformance_report_has_a_compiled_for_section(fresh, monkeypatch):
    monkeypatch.setattr(fresh, "KERNEL_MODULES", ("translate",))
    results = fresh.check_target("rocm", "gfx942")
    report = {"backend": "rocm", "mode": "interpreted", "device": "cpu", "device_name": "cpu", "reason": "test",
              "date": "today", "torch": torch.__version__, "results": [], "compiled_for": results}
    text = to_markdown(report)
    assert "## Compiled for (cross-compiled, not run)" in text
    rows = [line for line in text.splitlines() if line.startswith("| gfx942 | translate_kernel |")]
    assert len(rows) == len(results) and all("| passed |" in row for row in rows)


def test_conformance_table_counts_kernel_builds():
    build = {"status": "passed"}
    report = {"backend": "rocm", "mode": "interpreted", "results": [],
              "compiled_for": [build, {**build, "status": "failed"}, build]}
    assert table([report]).splitlines()[-1].split() == ["rocm", "cross-compiled", "(compile)", "2", "1", "0", "-"]


@pytest.mark.parametrize(("vgpr", "sgpr", "scratch", "failed"), [(0, 12, 0, False), (3, 0, 0, True),
                                                                 (0, 12, 64, True), (0, 40, 0, True)])
def test_sgpr_spills_into_vgpr_lanes_pass_and_memory_spills_fail(vgpr, sgpr, scratch, failed):
    """A few AMD SGPR spills land in VGPR lanes (no memory traffic) and pass; many, VGPR spills or scratch fail."""
    spec = specs(translate, "rocm", "gfx942")[0]
    res = {"vgpr": 64, "agpr": 0, "sgpr": 106, "vgpr_spills": vgpr, "sgpr_spills": sgpr, "scratch_bytes": scratch,
           "shared_bytes": 0}
    reasons = cc._rules(spec, cc.gpu_target("rocm", "gfx942"), res, [], "")
    assert bool(reasons) is failed, reasons


def test_a_process_that_built_a_gluon_kernel_exits_without_a_leak_report(tmp_path):
    """issue 35 item 7: libtriton's nanobind teardown printed a leak report at the exit of every process that had
    built the Gluon block top-k (two in a green tox run: compile-check's two workers); such a process exits quiet,
    its results intact."""
    code = ("from indexcache.backends.cuda.tuning import tuning\n"
            "from indexcache.backends.triton import crosscompile as cc, topk\n"
            "target = cc.gpu_target('cuda', 'sm90')\n"
            "spec = next(s for s in topk.compile_specs(target, tuning('sm90')) if s.kernel == 'topk_block_kernel')\n"
            "print(cc.compile_spec(spec, target)['status'])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout == "passed\n", done.stdout + done.stderr
    assert "nanobind" not in done.stderr, done.stderr
