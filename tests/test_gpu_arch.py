"""GPU architectures as data (backends/cuda/arch.py, backends/rocm/arch.py, backends/triton/target.py): each
vendor's records, how a name resolves to one, how a GPU is found and named, and what the shared layer reads from
them (launch options, Triton's target, the fp8 path, PDL)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from indexcache.backends.cuda import tuning as cuda_tuning
from indexcache.backends.cuda.arch import NVIDIA, sm_version
from indexcache.backends.rocm.arch import AMD
from indexcache.backends.rocm.tuning import tuning as rocm_tuning
from indexcache.backends.triton import target as targets
from indexcache.backends.triton.support import launch_options, uses_pdl
from indexcache.backends.triton.target import GpuArch, detect, device_gpu, vendors
from indexcache.hal.torch_version import TORCH_MINIMUM

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def test_every_gpu_backend_has_its_vendor_record():
    assert vendors() == {"cuda": NVIDIA, "rocm": AMD}


@pytest.mark.parametrize("vendor", [NVIDIA, AMD], ids=lambda v: v.backend)
def test_each_cross_compile_target_has_a_record_of_its_own(vendor):
    for name in vendor.cross_compile:
        record = vendor.resolve(name)
        assert isinstance(record, GpuArch) and record.vendor is vendor and record.name == name
        assert 0 < record.shared_per_block <= record.shared_per_sm


@pytest.mark.parametrize(("arch", "number"), [("sm80", 80), ("sm89", 89), ("sm90a", 90), ("sm100f", 100),
                                              ("sm120", 120)])
def test_sm_version_reads_every_suffix(arch, number):
    assert sm_version(arch) == number


@pytest.mark.parametrize("arch", ["gfx942", "sm", "90", "smx90"])
def test_sm_version_refuses_what_is_not_an_nvidia_arch(arch):
    with pytest.raises(ValueError, match=rf"arch: expected an NVIDIA architecture such as 'sm90', got '{arch}'"):
        sm_version(arch)


@pytest.mark.parametrize(("vendor", "arch", "dtype"), [(AMD, "gfx942", FNUZ), (AMD, "gfx940", FNUZ),
                                                       (AMD, "gfx950", FN), (AMD, "gfx90a", FN), (NVIDIA, "sm90", FN),
                                                       (NVIDIA, "sm80", FN)])
def test_fp8_format_by_arch(vendor, arch, dtype):
    assert vendor.resolve(arch).fp8_dtype is dtype


@pytest.mark.parametrize(("vendor", "arch", "fp8_mma"), [
    (NVIDIA, "sm80", False), (NVIDIA, "sm86", False), (NVIDIA, "sm87", False), (NVIDIA, "sm89", True),
    (NVIDIA, "sm90a", True), (NVIDIA, "sm103", True), (NVIDIA, "sm121", True), (AMD, "gfx942", True),
    (AMD, "gfx950", True), (AMD, "gfx940", False), (AMD, "gfx90a", False)])
def test_fp8_matrix_instructions_from_sm89_and_on_the_listed_amd_targets(vendor, arch, fp8_mma):
    assert vendor.resolve(arch).fp8_mma is fp8_mma


@pytest.mark.parametrize(("vendor", "arch", "keys", "rows"), [
    (NVIDIA, "sm80", None, None), (NVIDIA, "sm89", None, None), (NVIDIA, "sm90a", None, None),
    (NVIDIA, "sm100", "e2m1", 128), (NVIDIA, "sm103", "e2m1", 128), (NVIDIA, "sm120", "e4m3", 64),
    (AMD, "gfx942", None, None), (AMD, "gfx950", "e2m1", 64), (AMD, "gfx90a", None, None)])
def test_block_scaled_matrix_instructions_where_triton_emits_them(vendor, arch, keys, rows):
    """sm100's tcgen05 and gfx950's MFMA take MXFP4 keys as e2m1, sm120's mma.sync widened to e4m3 (docs/fp4.md,
    "Scaled matrix instructions"); none before them."""
    scaled = vendor.resolve(arch).scaled_mma
    assert (scaled and (scaled.keys, scaled.rows)) == (keys and (keys, rows))


@pytest.mark.parametrize(("release", "scaled"), [((3, 6), False), ((3, 8), False), ((3, 9), True), ((3, 10), True),
                                                 (None, True)])
def test_sm100_takes_its_block_scaled_instruction_from_triton_3_9(monkeypatch, release, scaled):
    """Triton 3.6 and 3.8 fail to build the MXFP4 logits' tl.dot_scaled for sm100: there the keys are widened (the
    kernels' mode, the table's 8 warps for 128-key tiles and ``indexcache info``'s row follow); sm120's and gfx950's
    instructions need no newer Triton. None: no Triton imports (then no kernel builds), the record as it is."""
    from indexcache.backends.triton import logits, mxfp4

    monkeypatch.setattr(targets, "triton_release", lambda: release)
    sm100 = NVIDIA.resolve("sm100")
    assert (targets.usable_scaled_mma(sm100) is not None) == scaled
    assert targets.usable_scaled_mma(NVIDIA.resolve("sm120")) is not None
    assert targets.usable_scaled_mma(AMD.resolve("gfx950")) is not None
    mode = logits._fp4_mode(torch.float8_e4m3fn, types.SimpleNamespace(gpu=sm100))
    assert mode == (mxfp4.SCALED_E2M1 if scaled else mxfp4.WIDEN_FN).value
    table = cuda_tuning("sm100")
    assert ("FP4_NUM_WARPS" in table["paged_mqa_logits"]) == scaled
    assert (table["arch"]["scaled_mma"] == "e2m1") == scaled


@pytest.mark.parametrize(("arch", "row"), [("sm87", "sm86"), ("sm90a", "sm90"), ("sm103", "sm100"),
                                           ("sm121", "sm120"), ("sm75", "sm80")])
def test_an_unlisted_nvidia_arch_takes_the_nearest_row_below_under_its_own_name(arch, row):
    record, nearest = NVIDIA.resolve(arch), NVIDIA.resolve(row)
    assert (record.name, record.triton_arch) == (arch, sm_version(arch))
    assert (record.shared_per_sm, record.fp8_mma, record.tma, record.pdl, record.mma, record.scaled_mma) == (
        nearest.shared_per_sm, nearest.fp8_mma, nearest.tma, nearest.pdl, nearest.mma, nearest.scaled_mma)


def test_the_cuda_table_shows_the_record_it_was_chosen_by():
    assert cuda_tuning("sm90a")["arch"] == {"name": "sm90a", "shared_per_sm": 228 * 1024, "fp8_mma": True,
                                            "tma": True, "pdl": True, "mma": "wgmma", "scaled_mma": None}
    assert cuda_tuning("sm100")["arch"]["scaled_mma"] == "e2m1"
    sm80 = cuda_tuning("sm80")
    assert sm80["arch"]["fp8_mma"] is False and sm80["mqa_logits"]["FP8_DOT"] == "fp16"


def test_the_rocm_table_shows_the_record_it_was_chosen_by():
    """``indexcache info --json`` shows the capability row on an AMD GPU too (README, "Targets"; it had none)."""
    assert rocm_tuning("gfx942")["arch"] == {"name": "gfx942", "shared_per_sm": 64 * 1024, "fp8_mma": True,
                                             "tma": False, "pdl": False, "mma": "mfma", "scaled_mma": None}
    assert rocm_tuning("gfx950")["arch"]["scaled_mma"] == "e2m1"
    assert rocm_tuning("gfx90a")["arch"]["fp8_mma"] is False


@pytest.mark.parametrize(("target", "args"), [(NVIDIA.target("sm90a"), ("cuda", 90, 32)),
                                              (NVIDIA.target("sm120"), ("cuda", 120, 32)),
                                              (AMD.target("gfx950"), ("hip", "gfx950", 64))])
def test_triton_target_from_the_record(target, args):
    pytest.importorskip("triton")
    found = target.gpu.triton_target()
    assert (found.backend, found.arch, found.warp_size) == args


def test_launch_options_take_the_vendors_own_keys():
    cfg = {"num_warps": 4, "num_stages": 2, "waves_per_eu": 2, "maxnreg": 128, "TILE": 1024}
    assert launch_options(AMD.target("gfx942"), cfg) == {"num_warps": 4, "num_stages": 2, "waves_per_eu": 2}
    assert launch_options(NVIDIA.target("sm90"), cfg) == {"num_warps": 4, "num_stages": 2, "maxnreg": 128}


@pytest.mark.parametrize(("target", "pdl"), [(NVIDIA.target("sm90"), True), (NVIDIA.target("sm80"), False),
                                             (NVIDIA.target("sm90", interpreted=True), False),
                                             (AMD.target("gfx950"), False)])
def test_pdl_only_where_the_record_has_it(target, pdl):
    assert uses_pdl(target, {"PDL": True}) is pdl


def test_targets_live_on_the_vendors_device_type_or_the_cpu_interpreted():
    assert (NVIDIA.target("sm90").device_type, AMD.target("gfx942").device_type) == ("cuda", "cuda")
    assert AMD.target("gfx942", interpreted=True).device_type == "cpu"


def _fake_gpu(monkeypatch, runtime: str, props: types.SimpleNamespace) -> None:
    """A torch build for ``runtime`` ("cuda" or "hip") seeing one GPU with device properties ``props``."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for env in (NVIDIA.arch_env, AMD.arch_env):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8" if runtime == "cuda" else None)
    monkeypatch.setattr(torch.version, "hip", "6.4" if runtime == "hip" else None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "a fake GPU")


@pytest.mark.parametrize(("runtime", "props", "vendor", "arch"), [
    ("cuda", types.SimpleNamespace(major=8, minor=9), NVIDIA, "sm89"),
    ("hip", types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"), AMD, "gfx942"),
])
def test_a_gpu_is_found_and_named_by_its_vendor(monkeypatch, runtime, props, vendor, arch):
    pytest.importorskip("triton")
    _fake_gpu(monkeypatch, runtime, props)
    ok, reason, target = detect(vendor)
    assert ok and target == vendor.target(arch) and reason.startswith(f"a fake GPU ({arch}) with Triton")
    assert device_gpu(torch.device("cuda")) == vendor.resolve(arch)
    other = AMD if vendor is NVIDIA else NVIDIA
    ok, reason, target = detect(other)
    assert (ok, target) == (False, None)
    assert reason.startswith(f"this torch build has no {other.runtime_name} support")


def test_an_override_forces_the_architecture(monkeypatch):
    pytest.importorskip("triton")
    _fake_gpu(monkeypatch, "cuda", types.SimpleNamespace(major=9, minor=0))
    monkeypatch.setenv(NVIDIA.arch_env, "sm80")
    ok, reason, target = detect(NVIDIA)
    assert ok and target == NVIDIA.target("sm80") and "(sm90 (forced by INDEXCACHE_CUDA_ARCH))" in reason


@pytest.mark.parametrize(("runtime", "props", "cache"), [
    # ROCm reports one XCD's L2 of an MI300X (4 MiB); its 8 XCDs' L2 and the 256 MiB Infinity Cache hold 288 MiB.
    ("hip", types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-", L2_cache_size=4 * 2**20), 288 * 2**20),
    ("hip", types.SimpleNamespace(gcnArchName="gfx950:sramecc+:xnack-", L2_cache_size=4 * 2**20), 288 * 2**20),
    ("hip", types.SimpleNamespace(gcnArchName="gfx90a:sramecc+:xnack-", L2_cache_size=8 * 2**20), 8 * 2**20),
    ("cuda", types.SimpleNamespace(major=9, minor=0, L2_cache_size=50 * 2**20), 50 * 2**20),
])
def test_benchmark_inputs_rotate_past_every_cache_of_the_gpu(monkeypatch, runtime, props, cache):
    """The bench's rotation (:func:`indexcache.bench.timing.cache_bytes`) takes the record's caches where torch's L2
    size leaves some out (before: 4 MiB on an MI300X, so 16 MiB of inputs rotated inside its caches), else the L2."""
    from indexcache.bench.timing import cache_bytes
    from indexcache.hal import device

    _fake_gpu(monkeypatch, runtime, props)
    device.l2_bytes.cache_clear()
    try:
        assert cache_bytes(torch.device("cuda", 0)) == cache
    finally:
        device.l2_bytes.cache_clear()


@pytest.mark.parametrize("arch", ["gfx942:sramecc+:xnack-", "gfx950:sramecc+:xnack-", "gfx90a:xnack+"])
def test_an_amd_target_id_names_its_processors_record(arch):
    """torch's ``gcnArchName`` and rocminfo give the target ID with its feature flags; as an override or a warmup's
    ``--arch`` it is the processor's record (before: ValueError)."""
    assert AMD.resolve(arch) == AMD.resolve(arch.split(":")[0])


def test_an_amd_target_id_as_the_override_forces_its_architecture(monkeypatch):
    pytest.importorskip("triton")
    _fake_gpu(monkeypatch, "hip", types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"))
    monkeypatch.setenv(AMD.arch_env, "gfx950:sramecc+:xnack-")
    ok, reason, target = detect(AMD)
    assert ok and target == AMD.target("gfx950") and "(gfx942 (forced by INDEXCACHE_ROCM_ARCH))" in reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, reason, target = detect(AMD)
    assert ok and target == AMD.target("gfx950", interpreted=True) and reason.endswith("on the CPU as for gfx950")


@pytest.mark.parametrize(("vendor", "value"), [(AMD, "mi300"), (NVIDIA, "hopper")])
def test_an_override_naming_no_architecture_leaves_the_backend_unavailable(monkeypatch, vendor, value):
    """The reason names the variable; every other backend still runs (before: ValueError out of every op call's
    probe, the torch backend's calls too)."""
    pytest.importorskip("triton")
    _fake_gpu(monkeypatch, vendor.runtime, types.SimpleNamespace(gcnArchName="gfx942", major=9, minor=0))
    monkeypatch.setenv(vendor.arch_env, value)
    for interpreted in (False, True):
        if interpreted:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        ok, reason, target = detect(vendor)
        assert (ok, target) == (False, None)
        assert reason.startswith(f"{vendor.arch_env}: expected an ") and reason.endswith(f"got {value!r}")


@pytest.mark.parametrize("arch, warp", [("gfx1100", 32), ("gfx1201", 32), ("gfx1030", 32), ("gfx90a", 64),
                                        ("gfx940", 64), ("gfx942", 64), ("gfx950", 64)])
def test_an_amd_record_takes_its_wave_size(arch, warp):
    """RDNA (Radeon, gfx10xx-gfx12xx) runs Triton's kernels in waves of 32: an unlisted RDNA name got 64, so warmup
    compiled variants no launch there uses and the launch arithmetic sized wavefronts of 64."""
    assert AMD.resolve(arch).warp_size == warp


def test_without_a_rocm_torch_the_rocm_backend_names_the_index_its_triton_comes_from(monkeypatch):
    """pytorch-triton-rocm >= 3.6 is on PyTorch's ROCm wheel index only (PyPI's stops at 2.1.0): the reason names the
    README's command for a ROCm torch, which brings it; the cuda extra brings Triton from PyPI, no index named."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert targets.TORCH_REQUIREMENT == f"torch>={'.'.join(map(str, TORCH_MINIMUM))}"  # the import check's minimum
    command = f'pip install "{targets.TORCH_REQUIREMENT}" --index-url {AMD.torch_index}'  # its newest may be older
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())  # lines joined
    assert AMD.torch_index.startswith("https://download.pytorch.org/whl/rocm") and f"{command} && " in readme
    assert f'pip install -e ".[rocm]" --extra-index-url {AMD.torch_index}' in readme
    assert detect(AMD)[1] == (f"this torch build has no ROCm/HIP support (a ROCm/HIP build of torch: {command}); "
                              "set TRITON_INTERPRET=1 to run the kernels on the CPU")
    assert NVIDIA.torch_index is None
    assert detect(NVIDIA)[1] == ("this torch build has no CUDA support; set TRITON_INTERPRET=1 to run the kernels on "
                                 "the CPU")


@pytest.mark.parametrize(("arch", "auto"), [("gfx942:sramecc+:xnack-", True), ("gfx950", True), ("gfx90a", False),
                                            ("gfx1100", False), ("gfx1201", False)])
def test_an_amd_gpu_without_a_record_is_left_to_the_torch_backend(monkeypatch, fresh_dispatch, arch, auto):
    """The rocm table is gfx942's and gfx950's: on MI250 (gfx90a) or a Radeon (gfx11xx, gfx12xx) it was chosen
    automatically all the same (compiled for gfx1100 its logits kernels spill hundreds of VGPRs and use no matrix
    instructions). There the automatic choice is the torch backend, the reason says why, and naming rocm runs it."""
    triton = pytest.importorskip("triton")
    _fake_gpu(monkeypatch, "hip", types.SimpleNamespace(gcnArchName=arch))
    avail = fresh_dispatch.availability("rocm")
    assert (avail.available, avail.auto, avail.mode) == (True, auto, "GPU")
    assert fresh_dispatch.default_backend()[0] == ("rocm" if auto else "torch")
    name = arch.split(":")[0]
    note = (f"; not chosen automatically: {name} has no record in backends/rocm/arch.py (the kernels are tuned for "
            "gfx942, gfx950); backend='rocm', use_backend('rocm') or INDEXCACHE_BACKEND=rocm runs them")
    assert avail.reason == f"a fake GPU ({name}) with Triton {triton.__version__}" + ("" if auto else note)
    monkeypatch.setenv("INDEXCACHE_BACKEND", "rocm")
    assert fresh_dispatch.get_backend() == "rocm"
