"""``fp8_dtype=None``, the default of quantize_index_k, store_index_k and gather_index_k: the fp8 format native to the
input's device (:func:`indexcache.hal.dispatch.native_fp8`, from the GPU backends' architecture records), e4m3fnuz on
an MI300 (gfx942), e4m3fn elsewhere; given explicitly, a format is taken as it is."""

from __future__ import annotations

import inspect
import re
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import indexcache
from indexcache.backends.cuda.arch import NVIDIA
from indexcache.backends.rocm.arch import AMD
from indexcache.hal import dispatch, library
from indexcache.hal.checks import key_format
from indexcache.hal.layout import new_packed_cache
from indexcache.hal.specs import SPECS

FN, FNUZ, FP4 = torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float4_e2m1fn_x2
I32 = torch.int32
GPU = torch.device("cuda", 0)
# The ops that take ``fp8_dtype``: quantize_index_k, store_index_k and gather_index_k.
KEY_OPS = tuple(op for op in SPECS if "fp8_dtype" in library.PARAMS[op])


@pytest.fixture
def fake_gpu(monkeypatch, fresh_dispatch):
    """``fake_gpu(runtime, props)``: a torch build for ``runtime`` ("hip" or "cuda") seeing one GPU with device
    properties ``props``; returns the list of the GPU indices whose properties were read, growing as they are."""
    reads = []

    def install(runtime: str, props: types.SimpleNamespace) -> list:
        monkeypatch.setattr(torch.version, "cuda", "12.8" if runtime == "cuda" else None)
        monkeypatch.setattr(torch.version, "hip", "6.4" if runtime == "hip" else None, raising=False)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: reads.append(index) or props)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        return reads

    return install


def test_a_gpu_build_without_its_gpu_takes_e4m3fn(fake_gpu, monkeypatch):
    """A CUDA (or ROCm) build of torch on a machine without the GPU, asked about one of its devices (fake tensors
    traced for export): no record to read, so the default is e4m3fn, and no device query is made (it would raise)."""
    reads = fake_gpu("hip", AMD_GPU["gfx942"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert dispatch.native_fp8(GPU) == FN
    assert reads == []


# AMD GPUs' device properties, as a ROCm build of torch gives them (a target ID: the processor, then feature flags).
AMD_GPU = {arch: types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-")
           for arch in ("gfx942", "gfx950", "gfx90a")}


@pytest.mark.parametrize(("runtime", "props", "native"), [
    ("hip", AMD_GPU["gfx942"], FNUZ),  # MI300X / MI325X
    ("hip", AMD_GPU["gfx950"], FN),  # MI350X / MI355X: OCP fp8
    ("hip", AMD_GPU["gfx90a"], FN),  # no record: its generation's format (backends/rocm/arch.py)
    ("cuda", types.SimpleNamespace(major=9, minor=0), FN),
], ids=["gfx942", "gfx950", "gfx90a", "sm90"])
def test_a_gpus_native_fp8_is_its_architecture_records_format(fake_gpu, runtime, props, native):
    reads = fake_gpu(runtime, props)
    vendor = AMD if runtime == "hip" else NVIDIA
    assert vendor.device_arch(GPU).fp8_dtype == native
    assert dispatch.native_fp8(GPU) == native
    assert dispatch.native_fp8(GPU) == native and len(reads) == 2  # the record's read above, then one: kept
    assert key_format(None, GPU) == native


def test_an_mi300_takes_an_explicit_format_as_given(fake_gpu):
    fake_gpu("hip", AMD_GPU["gfx942"])
    assert [key_format(fmt, GPU) for fmt in (FN, FNUZ, FP4)] == [FN, FNUZ, FP4]


def test_the_cpu_is_e4m3fn_without_asking_a_gpu(fake_gpu):
    reads = fake_gpu("hip", AMD_GPU["gfx942"])
    assert dispatch.native_fp8(torch.device("cpu")) == FN
    assert key_format(None, torch.device("cpu")) == FN
    assert reads == []


def test_no_backend_claims_a_device_of_another_type(fake_gpu):
    fake_gpu("hip", AMD_GPU["gfx942"])
    assert dispatch.native_fp8(torch.device("meta")) == FN


def _op_args(device: str = "cpu", outputs: torch.dtype | None = None) -> dict[str, dict]:
    """Each op's arguments with ``fp8_dtype`` left out, on ``device``; gather_index_k's outputs given in ``outputs``
    (a format) where it is not None."""
    keys = torch.linspace(-40.0, 40.0, 8 * 128, device=device).view(8, 128)
    cache = new_packed_cache(2, 4, 128, device=device)
    gather = dict(k_cache=cache, block_table=torch.tensor([[1, 0]], dtype=I32, device=device),
                  context_lens=torch.tensor([7], dtype=I32, device=device))
    if outputs is not None:
        gather.update(out_k=torch.empty(7, 128, dtype=outputs, device=device), out_scale=torch.empty(7, device=device))
    return dict(quantize_index_k=dict(k=keys), gather_index_k=gather,
                store_index_k=dict(k=keys, k_cache=cache, slot_mapping=torch.arange(8, dtype=I32, device=device)))


@pytest.mark.parametrize("op", KEY_OPS)
def test_the_spec_check_gives_the_backends_an_mi300s_own_format(fake_gpu, op):
    fake_gpu("hip", AMD_GPU["gfx942"])
    with FakeTensorMode():  # tensors on a "cuda" device, on a machine without one
        for given, native in ((dict(), FNUZ), (dict(fp8_dtype=None), FNUZ), (dict(fp8_dtype=FN), FN)):
            args = _op_args("cuda", outputs=native)[op]
            assert SPECS[op].check(**args, **given)["fp8_dtype"] == native


def test_quantize_index_k_allocates_an_mi300s_format(fake_gpu):
    fake_gpu("hip", AMD_GPU["gfx942"])
    with FakeTensorMode():
        checked = SPECS["quantize_index_k"].check(torch.empty(4, 256, device="cuda"))
    assert (checked["out"].dtype, checked["block"]) == (FNUZ, 128)


@pytest.mark.parametrize("op", ["quantize_index_k", "gather_index_k"])
@pytest.mark.parametrize("outputs", [FN, FNUZ], ids=["e4m3fn out", "e4m3fnuz out"])
def test_a_given_keys_output_names_the_format_the_default_takes(fake_gpu, op, outputs):
    """On an MI300 a caller's keys output in e4m3fn (or on the CPU one in e4m3fnuz) is taken as the format with
    fp8_dtype left out, instead of the device's own format that its dtype would contradict."""
    args = _op_args(outputs=outputs)[op]
    if op == "quantize_index_k":
        args.update(out=torch.empty(8, 128, dtype=outputs), out_scale=torch.empty(8, 1))
    assert SPECS[op].check(**args)["fp8_dtype"] == outputs  # the CPU
    fake_gpu("hip", AMD_GPU["gfx942"])
    with FakeTensorMode():
        args = _op_args("cuda", outputs=outputs)[op]
        if op == "quantize_index_k":
            args.update(out=torch.empty(8, 128, dtype=outputs, device="cuda"),
                        out_scale=torch.empty(8, 1, device="cuda"))
        assert SPECS[op].check(**args)["fp8_dtype"] == outputs


def test_a_keys_output_given_on_the_cpu_gives_the_explicit_formats_result():
    args = _op_args()["quantize_index_k"]
    out = (torch.empty(8, 128, dtype=FNUZ), torch.empty(8, 1))
    got = indexcache.quantize_index_k(**args, out=out[0], out_scale=out[1])
    _same(got, indexcache.quantize_index_k(**args, fp8_dtype=FNUZ))


def _same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
    assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want, strict=True))


def test_on_the_cpu_quantize_index_k_gives_e4m3fn_by_default():
    args = _op_args()["quantize_index_k"]
    got = indexcache.quantize_index_k(**args)
    assert got[0].dtype == FN
    _same(got, indexcache.quantize_index_k(**args, fp8_dtype=FN))


def test_on_the_cpu_store_index_k_writes_e4m3fn_by_default():
    by_default, explicit = _op_args()["store_index_k"], _op_args()["store_index_k"]
    indexcache.store_index_k(**by_default)
    indexcache.store_index_k(**explicit, fp8_dtype=FN)
    assert by_default["k_cache"].any()
    _same((by_default["k_cache"],), (explicit["k_cache"],))


def test_on_the_cpu_gather_index_k_reads_e4m3fn_by_default():
    args = _op_args()
    indexcache.store_index_k(**args["store_index_k"], fp8_dtype=FN)  # the cache gather_index_k reads
    got = indexcache.gather_index_k(**args["gather_index_k"])
    assert got[0].dtype == FN and torch.isfinite(got[1]).all()
    _same(got, indexcache.gather_index_k(**args["gather_index_k"], fp8_dtype=FN))


@pytest.mark.parametrize("op", KEY_OPS)
@pytest.mark.parametrize("bad", ["float8_e4m3fn", torch.bfloat16, 8], ids=["a str", "bfloat16", "an int"])
def test_a_format_of_another_type_is_refused_naming_fp8_dtype(op, bad):
    want = (r"^fp8_dtype: expected None \(the device's native fp8 format\) or float8_e4m3fn or float8_e4m3fnuz or "
            rf"float4_e2m1fn_x2, got {re.escape(repr(bad))}$")
    with pytest.raises(TypeError, match=want):
        SPECS[op].check(**_op_args()[op], fp8_dtype=bad)
    with pytest.raises(TypeError, match=want):
        getattr(indexcache, op)(**_op_args()[op], fp8_dtype=bad)


def test_the_three_key_ops_take_fp8_dtype():
    assert len(KEY_OPS) == 3 and set(KEY_OPS) == set(_op_args())


@pytest.mark.parametrize("op", KEY_OPS)
def test_the_default_is_none_in_the_op_its_check_and_its_custom_op(op):
    assert inspect.signature(getattr(indexcache, op)).parameters["fp8_dtype"].default is None
    assert inspect.signature(SPECS[op].check).parameters["fp8_dtype"].default is None
    assert "ScalarType? fp8_dtype" in library.schema(op)


@pytest.mark.parametrize(("props", "forced", "native"), [
    (AMD_GPU["gfx942"], "gfx950", FN),  # an MI300 run as for gfx950: the rocm kernels then take e4m3fn only
    (AMD_GPU["gfx950"], "gfx942:sramecc+:xnack-", FNUZ),  # an MI355 run as for gfx942 (a target ID names it)
], ids=["gfx942 as gfx950", "gfx950 as gfx942"])
def test_a_forced_architecture_gives_its_own_format(fake_gpu, monkeypatch, props, forced, native):
    """INDEXCACHE_ROCM_ARCH overrides the architecture whose fp8 policy the rocm backend follows: the default is
    the forced architecture's format, the one the backend's kernels take, not the device's own."""
    fake_gpu("hip", props)
    monkeypatch.setenv(AMD.arch_env, forced)
    assert AMD.resolve(forced).fp8_dtype == native
    assert dispatch.native_fp8(GPU) == native
    assert key_format(None, GPU) == native


def test_an_architecture_no_vendor_knows_leaves_the_devices_format(fake_gpu, monkeypatch):
    """An override the vendor does not know (its backend then unavailable) is not the device's format: the device's
    record answers, and native_fp8 does not raise."""
    fake_gpu("hip", AMD_GPU["gfx942"])
    monkeypatch.setenv(AMD.arch_env, "sm90")  # not an AMD name: resolve refuses it
    with pytest.raises(ValueError, match="expected an AMD architecture"):
        AMD.resolve("sm90")
    assert dispatch.native_fp8(GPU) == FNUZ


def test_a_device_without_an_index_is_the_current_gpu_at_each_call(fake_gpu, monkeypatch):
    """``torch.device("cuda")`` means the current GPU, which torch.cuda.set_device changes: its format is not kept
    from the GPU that was current at the first call (an indexed device's is)."""
    fake_gpu("hip", AMD_GPU["gfx942"])
    props = {0: AMD_GPU["gfx942"], 1: AMD_GPU["gfx950"]}
    current = [0]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    assert dispatch.native_fp8(torch.device("cuda")) == FNUZ
    current[0] = 1
    assert dispatch.native_fp8(torch.device("cuda")) == FN
    assert [dispatch.native_fp8(torch.device("cuda", i)) for i in (0, 1)] == [FNUZ, FN]
