"""AMD architectures as data: the vendor's record and one record per architecture (docs/architecture.md,
"Architectures").

LDS is 64 KiB on MI300X / MI325X (gfx942) and 160 KiB on MI350X / MI355X (gfx950), all of it addressable by one
workgroup (ROCm "AMD GPU specifications", rocm.docs.amd.com/en/latest/reference/gpu-specs.html). Both multiply fp8
with MFMA: the MI300 generation (gfx94x) in e4m3fnuz, gfx950 in e4m3fn (OCP); Triton upcasts the other format to
fp16. An architecture without a record (gfx90a, RDNA's gfx11xx / gfx12xx, ...) takes the kernels' paths without fp8
matrix instructions (fp8 read as bytes) and its generation's fp8 format, and is never chosen automatically: the
tuning table is gfx942's and gfx950's (compiled for gfx1100 with Triton 3.9 the logits kernels spill 73-567 VGPRs and
use no matrix instructions), so on such a GPU the automatic choice is the torch backend and the rocm backend runs only
when named (``indexcache info`` says so).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from indexcache.backends.triton.target import GpuArch, GpuVendor, ScaledMma


def _arch_of(props: Any) -> str:
    """The ``gcnArchName`` before its feature flags ("gfx942" of "gfx942:sramecc+:xnack-")."""
    return props.gcnArchName.split(":")[0]


def _resources(compiled: Any) -> dict[str, int]:
    """From the AMDGPU metadata of the assembly."""
    fields = dict(re.findall(r"^\s*-?\s*\.(\w+_count|\w+_segment_fixed_size):\s+(\d+)\s*$", compiled.asm["amdgcn"],
                             re.M))
    return {"vgpr": int(fields["vgpr_count"]), "agpr": int(fields["agpr_count"]), "sgpr": int(fields["sgpr_count"]),
            "vgpr_spills": int(fields["vgpr_spill_count"]), "sgpr_spills": int(fields["sgpr_spill_count"]),
            "scratch_bytes": int(fields["private_segment_fixed_size"]),
            "shared_bytes": int(fields["group_segment_fixed_size"]) + compiled.metadata.shared}


def resolve(arch: str) -> GpuArch:
    """The record of ``arch`` ("gfx942", "gfx950", …, or a target ID with its feature flags, as torch's
    ``gcnArchName`` and rocminfo give it: "gfx942:sramecc+:xnack-" is gfx942); one without fp8 matrix instructions for
    an unlisted one."""
    name = arch.split(":")[0]
    if name in ARCHS:
        return ARCHS[name]
    if not re.fullmatch(r"gfx[0-9]{2,3}[0-9a-f]", name):
        raise ValueError(f"arch: expected an AMD architecture such as 'gfx942', got {arch!r}")
    fp8 = torch.float8_e4m3fnuz if name.startswith("gfx94") else torch.float8_e4m3fn
    # RDNA (gfx10xx-gfx12xx: four characters after "gfx") runs Triton's kernels in waves of 32, CDNA in waves of 64.
    return _arch(name, 64, fp8, fp8_mma=False, warp_size=32 if len(name) == 7 else 64, auto_select=False)


AMD = GpuVendor(
    backend="rocm", triton="hip", runtime="hip", runtime_name="ROCm/HIP", device_type="cuda",
    arch_env="INDEXCACHE_ROCM_ARCH", interpreted_arch="gfx942", cross_compile=("gfx942", "gfx950"),
    launch_keys=("waves_per_eu",),  # occupancy: waves a SIMD
    asm="amdgcn", barrier_orders_memory=False, matrix_instructions=re.compile(r"\bv_s?mfmac?_\w+"),
    arch_of=_arch_of, resolve=resolve, resources=_resources,
    torch_index="https://download.pytorch.org/whl/rocm6.4",  # README, "GPU backends"
)


def _arch(name: str, lds_kib: int, fp8_dtype: torch.dtype, fp8_mma: bool,
          scaled_mma: ScaledMma | None = None, cache_mib: int | None = None, warp_size: int = 64,
          auto_select: bool = True) -> GpuArch:
    return GpuArch(AMD, name, warp_size=warp_size, shared_per_block=lds_kib * 1024, shared_per_sm=lds_kib * 1024,
                   fp8_dtype=fp8_dtype, fp8_mma=fp8_mma, tma=False, pdl=False, mma="mfma", triton_arch=name,
                   scaled_mma=scaled_mma, cache_bytes=cache_mib and cache_mib * 2**20, auto_select=auto_select)


# The caches of the MI300 and MI350 series: a 4 MiB L2 on each of up to 8 XCDs and the 256 MiB Infinity Cache (ROCm
# "AMD GPU specifications"); ROCm's L2 size, which torch reports, is one XCD's (4 MiB on an MI300X).
_INSTINCT_CACHE_MIB = 8 * 4 + 256

ARCHS: dict[str, GpuArch] = {a.name: a for a in (
    _arch("gfx942", 64, torch.float8_e4m3fnuz, fp8_mma=True, cache_mib=_INSTINCT_CACHE_MIB),
    # Block-scaled MFMA (v_mfma_scale_f32_32x32x64_f8f6f4) takes e2m1 keys beside e4m3 queries (docs/fp4.md,
    # "Scaled matrix instructions").
    _arch("gfx950", 160, torch.float8_e4m3fn, fp8_mma=True, scaled_mma=ScaledMma("e2m1", rows=64),
          cache_mib=_INSTINCT_CACHE_MIB),
)}
