"""The fp8 format native to a device (:func:`indexcache.hal.dispatch.native_fp8`, from the GPU backends' architecture
records): e4m3fnuz on an MI300 (gfx942), e4m3fn elsewhere."""

from __future__ import annotations

import types

import pytest
import torch

from indexcache.backends.cuda.arch import NVIDIA
from indexcache.backends.rocm.arch import AMD
from indexcache.hal import dispatch

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
GPU = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch, fresh_dispatch):
    """``fake_gpu(runtime, props)``: a torch build for ``runtime`` ("hip" or "cuda") seeing one GPU with device
    properties ``props``; returns the list of the GPU indices whose properties were read, growing as they are."""
    reads = []

    def install(runtime: str, props: types.SimpleNamespace) -> list:
        monkeypatch.setattr(torch.version, "cuda", "12.8" if runtime == "cuda" else None)
        monkeypatch.setattr(torch.version, "hip", "6.4" if runtime == "hip" else None, raising=False)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: reads.append(index) or props)
        return reads

    return install


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


def test_the_cpu_is_e4m3fn_without_asking_a_gpu(fake_gpu):
    reads = fake_gpu("hip", AMD_GPU["gfx942"])
    assert dispatch.native_fp8(torch.device("cpu")) == FN
    assert reads == []


def test_no_backend_claims_a_device_of_another_type(fake_gpu):
    fake_gpu("hip", AMD_GPU["gfx942"])
    assert dispatch.native_fp8(torch.device("meta")) == FN
