"""NVIDIA architectures as data: the vendor's record and one record per compute capability (docs/architecture.md,
"Architectures").

What each compute capability has (CUDA C++ Programming Guide, compute capabilities; the matrix instruction is what
Triton 3.9 emits there): shared memory per SM, fp8 matrix instructions and fp8 conversions (from sm89), TMA and
programmatic dependent launch (from sm90), the MMA instruction (warp-group MMA only on sm90; tcgen05 on sm100) and
the block-scaled one (sm100, sm120).
Shared memory one block may use is the opt-in maximum of "Technical Specifications per Compute Capability":
163 KB (8.0), 99 KB (8.6, 8.9, 12.0), 227 KB (9.0, 10.0); the SM has 1 KB more (164 / 100 / 228 KB, Ampere and
Hopper tuning guides), which the system reserves for each block. Unlisted architectures take the nearest listed
one below them of the same major (sm87 → sm86, sm103 → sm100, sm121 → sm120).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tempfile
from typing import Any

import torch

from indexcache.backends.triton.target import GpuArch, GpuVendor, ScaledMma


def sm_version(arch: str) -> int:
    """The compute capability of an NVIDIA architecture as a number: 90 for "sm90" and "sm90a", 100 for "sm100f"."""
    digits = arch.removeprefix("sm").rstrip("af")
    if not arch.startswith("sm") or not digits.isdigit() or len(digits) < 2:
        raise ValueError(f"arch: expected an NVIDIA architecture such as 'sm90', got {arch!r}")
    return int(digits)


def _arch_of(props: Any) -> str:
    """"sm90" (``sm{major}{minor}``) from torch's device properties."""
    return f"sm{props.major}{props.minor}"


def _resources(compiled: Any) -> dict[str, int]:
    """From ``cuobjdump --dump-resource-usage`` of the cubin (ptxas puts spills in the stack frame)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin.name], check=True,
                             capture_output=True, text=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    return {"regs": usage["REG"], "stack_bytes": usage["STACK"], "scratch_bytes": usage["LOCAL"],
            "shared_bytes": usage["SHARED"] + compiled.metadata.shared}


def resolve(arch: str) -> GpuArch:
    """The record of ``arch`` ("sm80", "sm90a", …): its own, or the nearest listed one below it under its name."""
    number = sm_version(arch)
    known = [a for a in ARCHS if sm_version(a) <= number and sm_version(a) // 10 == number // 10]
    if not known:
        known = [a for a in ARCHS if sm_version(a) <= number] or ["sm80"]
    return dataclasses.replace(ARCHS[max(known, key=sm_version)], name=arch, triton_arch=number)


NVIDIA = GpuVendor(
    backend="cuda", triton="cuda", runtime="cuda", runtime_name="CUDA", device_type="cuda",
    arch_env="INDEXCACHE_CUDA_ARCH", interpreted_arch="sm90", cross_compile=("sm80", "sm89", "sm90", "sm100", "sm120"),
    launch_keys=("maxnreg",),  # a register cap a thread
    asm="ptx", barrier_orders_memory=True,
    matrix_instructions=re.compile(r"\b(?:mma\.sync|wgmma\.mma_async|tcgen05\.mma)[\w.:]*"),
    arch_of=_arch_of, resolve=resolve, resources=_resources,
)


def _arch(name: str, shared_per_block_kb: int, fp8_mma: bool, tma: bool, pdl: bool, mma: str,
          scaled_mma: ScaledMma | None = None) -> GpuArch:
    return GpuArch(NVIDIA, name, warp_size=32, shared_per_block=shared_per_block_kb * 1024,
                   shared_per_sm=(shared_per_block_kb + 1) * 1024, fp8_dtype=torch.float8_e4m3fn, fp8_mma=fp8_mma,
                   tma=tma, pdl=pdl, mma=mma, triton_arch=sm_version(name), scaled_mma=scaled_mma)


ARCHS: dict[str, GpuArch] = {a.name: a for a in (
    _arch("sm80", 163, fp8_mma=False, tma=False, pdl=False, mma="mma.sync"),
    _arch("sm86", 99, fp8_mma=False, tma=False, pdl=False, mma="mma.sync"),
    _arch("sm89", 99, fp8_mma=True, tma=False, pdl=False, mma="mma.sync"),
    _arch("sm90", 227, fp8_mma=True, tma=True, pdl=True, mma="wgmma"),
    # Block-scaled MMA (docs/fp4.md, "Scaled matrix instructions"): sm100's tcgen05 kind::mxf8f6f4 takes e2m1 keys
    # beside e4m3 queries at 128 rows on M; sm120's mma.sync kind::mxf8f6f4 takes them widened to e4m3 (its e2m1
    # form, kind::mxf4nvf4, wants e2m1 queries too).
    # Triton 3.6 and 3.8 fail to build the MXFP4 logits' tl.dot_scaled for sm100 ("PassManager::run failed",
    # cross-compiled 2026-12-07); 3.9 emits tcgen05 block_scale: before it sm100 widens the keys, as Hopper does.
    _arch("sm100", 227, fp8_mma=True, tma=True, pdl=True, mma="tcgen05",
          scaled_mma=ScaledMma("e2m1", rows=128, triton=(3, 9))),
    _arch("sm120", 99, fp8_mma=True, tma=True, pdl=True, mma="mma.sync", scaled_mma=ScaledMma("e4m3", rows=64)),
)}
