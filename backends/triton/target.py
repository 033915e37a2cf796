"""What a Triton kernel is built for: a GPU architecture as data, and the target that carries it.

Each vendor's package builds its records (``backends/cuda/arch.py``, ``backends/rocm/arch.py``): a
:class:`GpuVendor` for what its architectures share (how its GPUs are found, named and compiled for) and a
:class:`GpuArch` per architecture (warp size, shared memory, fp8 format, TMA, PDL, matrix unit, block-scaled
matrix instruction, Triton's target, caches torch does not report).
The shared kernels, the side-stream scheduler and the cross-compile check read these records; they do not branch
on vendor names (docs/architecture.md, "Architectures").
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

INTERPRET_ENV = "TRITON_INTERPRET"
# The torch a vendor's wheel index must give: a bare name takes the index's newest torch, however old (the import
# check's indexcache.hal.torch_version.TORCH_MINIMUM, which this layer does not import; tests/test_gpu_arch.py
# holds the two equal).
TORCH_REQUIREMENT = "torch>=2.11"


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_ENV, "") == "1"


@dataclass(frozen=True)
class GpuVendor:
    """What every architecture of one vendor shares: how its GPUs are found and named, and how Triton builds for
    them. ``resolve`` gives the :class:`GpuArch` of an architecture name ("sm90", "gfx942", ...)."""

    backend: str  # the indexcache backend serving it, also its pip extra: "cuda", "rocm"
    triton: str  # Triton's backend name, the first argument of its GPUTarget: "cuda", "hip"
    runtime: str  # the ``torch.version`` attribute a torch build for it sets: "cuda", "hip"
    runtime_name: str  # as users know that runtime: "CUDA", "ROCm/HIP"
    device_type: str  # torch's device type of its GPUs, also the torch module of its streams ("cuda" on ROCm too)
    arch_env: str  # the variable that overrides the architecture whose paths and tuning are used
    interpreted_arch: str  # the architecture an interpreted run (``TRITON_INTERPRET=1``) follows
    cross_compile: tuple[str, ...]  # the architectures the cross-compile check builds for
    launch_keys: tuple[str, ...]  # tuning entries Triton takes as launch options besides num_warps and num_stages
    asm: str  # the assembly Triton emits and inline assembly is written in: "ptx", "amdgcn"
    # whether a block's barrier (``tl.debug_barrier``) also waits for the threads' global memory operations: PTX's
    # bar.sync orders them; on gfx9 Triton emits a bare s_barrier (LLVM's memory model drops the wait of a
    # workgroup-scope fence outside threadgroup-split mode, holding that a workgroup's waves share one CU's L1 in
    # order). The HiSparse plan waits first all the same (``s_waitcnt vmcnt(0)``); the top-k kernels rely on LLVM's
    # model (untested on an AMD GPU either way).
    barrier_orders_memory: bool
    matrix_instructions: re.Pattern[str] = dataclasses.field(repr=False)  # the matrix instructions in that assembly
    arch_of: Callable[[Any], str] = dataclasses.field(repr=False)  # the architecture name of torch's device properties
    resolve: Callable[[str], GpuArch] = dataclasses.field(repr=False)  # the record of an architecture name
    # registers, spills, scratch and shared bytes of a kernel Triton compiled (the cross-compile check's rules)
    resources: Callable[[Any], dict[str, int]] = dataclasses.field(repr=False)
    # PyTorch's wheel index whose torch builds for this vendor bring the Triton it needs, where PyPI has none (ROCm's
    # pytorch-triton-rocm: PyPI's newest is 2.1.0); None: the pip extra ``backend`` brings Triton from PyPI
    torch_index: str | None = None

    def target(self, arch: str, interpreted: bool = False) -> Target:
        """The target of architecture ``arch`` (its record from :attr:`resolve`), on the GPU or interpreted."""
        return Target(self.resolve(arch), interpreted)

    def device_arch(self, device: torch.device) -> GpuArch | None:
        """The record of ``device``'s architecture where it is one of this vendor's GPUs (its device type, under a
        torch build carrying this vendor's runtime), else None. Queries the device's properties: no Triton needed."""
        if device.type != self.device_type or not getattr(torch.version, self.runtime, None):
            return None
        module = torch.get_device_module(device)
        index = device.index if device.index is not None else module.current_device()
        return self.resolve(self.arch_of(module.get_device_properties(index)))


@dataclass(frozen=True)
class ScaledMma:
    """A block-scaled matrix instruction that Triton emits for ``tl.dot_scaled`` (checked by cross-compiling with
    Triton 3.9; docs/fp4.md, "Scaled matrix instructions"). The MXFP4 logits kernels use it in place of widening the
    keys with one scale a key: the instruction applies each block's e8m0 scale itself."""

    keys: str  # the format MXFP4 keys enter it in beside e4m3 queries: "e2m1" (as stored), "e4m3" (widened, exact)
    rows: int  # key rows a tile needs (on M) for Triton to emit it; with fewer it widens both operands to bf16
    triton: tuple[int, int] = (0, 0)  # the oldest Triton (major, minor) that builds the kernels' use of it


def usable_scaled_mma(gpu: GpuArch) -> ScaledMma | None:
    """``gpu``'s block-scaled instruction (its ``scaled_mma``) where the installed Triton builds the kernels' use of it
    (its ``triton``), else None: the MXFP4 logits kernels then widen the keys, as where there is none."""
    scaled = gpu.scaled_mma
    if scaled is None or scaled.triton == (0, 0):
        return scaled
    found = triton_release()
    return scaled if found is None or found >= scaled.triton else None


@functools.cache
def triton_release() -> tuple[int, int] | None:
    """The installed Triton's (major, minor), None where none imports (then no kernel builds either)."""
    version = triton_import()[0]
    if version is None:
        return None
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", version).groups())
    return major, minor


@dataclass(frozen=True)
class GpuArch:
    """One GPU architecture, as its vendor's package records it (a typed record per architecture)."""

    vendor: GpuVendor
    name: str  # "sm80", "sm90", "sm100", ... (a suffix, as in "sm90a", names the same generation); "gfx942", ...
    warp_size: int  # threads a warp (NVIDIA) or wavefront (AMD)
    shared_per_block: int  # shared memory (LDS) bytes one block may use, static and dynamic
    shared_per_sm: int  # shared memory bytes of a multiprocessor (compute unit)
    fp8_dtype: torch.dtype  # the fp8 format its kernels compute in and its caches hold
    fp8_mma: bool  # fp8 matrix instructions and conversions; without them the kernels read fp8 as bytes
    tma: bool  # the tensor memory accelerator (bulk tensor copies)
    pdl: bool  # programmatic dependent launch
    mma: str  # the matrix instructions Triton emits: "mma.sync", "wgmma", "tcgen05", "mfma"
    triton_arch: int | str  # the architecture of Triton's GPUTarget: 90 (compute capability), "gfx942"
    scaled_mma: ScaledMma | None = None  # a block-scaled matrix instruction for MXFP4 keys and fp8 queries
    # Bytes of cache between the multiprocessors and memory where torch's ``L2_cache_size`` leaves some out, else None
    # (AMD: ROCm reports one XCD's L2, not the others' nor the Infinity Cache); what benchmark inputs rotate past.
    cache_bytes: int | None = None
    # Whether the automatic backend choice takes a GPU of this architecture (False: one its vendor's kernels were not
    # tuned or cross-compiled for, whose backend then runs only when chosen explicitly)
    auto_select: bool = True

    def capabilities(self, arch: str) -> dict[str, Any]:
        """The row a tuning table shows under "arch" (``indexcache info``): ``arch`` as asked for, and what this
        record has."""
        return {"name": arch, "shared_per_sm": self.shared_per_sm, "fp8_mma": self.fp8_mma, "tma": self.tma,
                "pdl": self.pdl, "mma": self.mma,
                "scaled_mma": (scaled := usable_scaled_mma(self)) and scaled.keys}

    def triton_target(self):
        """Triton's ``GPUTarget`` for this architecture (imports Triton's compiler)."""
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.vendor.triton, self.triton_arch, self.warp_size)


@dataclass(frozen=True)
class Target:
    """A GPU architecture's record and whether Triton interprets the kernels on the CPU (then ``gpu`` is the
    architecture whose tuning and fp8 policy the CPU run follows)."""

    gpu: GpuArch
    interpreted: bool = False

    @property
    def arch(self) -> str:
        """The architecture's name ("sm90", "gfx942", ...)."""
        return self.gpu.name

    @property
    def warp_size(self) -> int:
        """Threads a warp (wavefront) of the architecture."""
        return self.gpu.warp_size

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The fp8 format the architecture computes in."""
        return self.gpu.fp8_dtype

    @property
    def device_type(self) -> str:
        """The torch device type of tensors the kernels accept (the vendor's, "cuda" on NVIDIA and AMD; "cpu"
        interpreted)."""
        return "cpu" if self.interpreted else self.gpu.vendor.device_type


@functools.cache
def vendors() -> dict[str, GpuVendor]:
    """Each GPU backend's vendor record, by backend name: the :class:`GpuVendor` in the ``arch`` module of each
    package of indexcache.backends that has one (backends/README.md)."""
    import indexcache.backends as backends

    found = {}
    for package in pkgutil.iter_modules(backends.__path__):
        name = f"{backends.__name__}.{package.name}.arch"
        if package.ispkg and importlib.util.find_spec(name):
            found.update({v.backend: v for v in vars(importlib.import_module(name)).values()
                          if isinstance(v, GpuVendor)})
    return found


def device_gpu(device: torch.device) -> GpuArch | None:
    """The record of GPU ``device``'s architecture, from the vendor whose runtime this torch build carries (None:
    no vendor's)."""
    return next((gpu for vendor in vendors().values() if (gpu := vendor.device_arch(device)) is not None), None)


def triton_import() -> tuple[str | None, str]:
    """``(version, "")`` when Triton imports, else ``(None, why)``: not installed, or installed but its import failed
    (a broken or mismatched install: the error it raised, whatever its type, so that probing a Triton backend never
    breaks the torch backend)."""
    try:
        import triton
    except ModuleNotFoundError as exc:
        if exc.name == "triton":
            return None, "Triton is not installed"
        return None, _import_failed(exc)
    except Exception as exc:  # a Triton that fails to import may raise anything (OSError of its library, ...)
        return None, _import_failed(exc)
    return triton.__version__, ""


def _import_failed(exc: Exception) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"Triton failed to import: {type(exc).__name__}: {first}"


def detect(vendor: GpuVendor) -> tuple[bool, str, Target | None]:
    """Find a GPU of ``vendor`` for Triton: ``(available, reason, target)``.

    ``vendor.arch_env`` names the variable that overrides the architecture (for tests and forced paths; one its
    vendor does not know leaves the backend unavailable, the reason naming the variable); under ``TRITON_INTERPRET=1``
    the target is ``vendor.interpreted_arch`` unless overridden.
    """
    version, missing = triton_import()
    get_torch = f'pip install "{TORCH_REQUIREMENT}" --index-url {vendor.torch_index}'  # where torch_index is not None
    if version is None:
        install = (f"a {vendor.runtime_name} build of torch brings it: {get_torch}" if vendor.torch_index
                   else f"pip install 'indexcache[{vendor.backend}]'")
        return False, f"{missing} ({install})", None
    override = os.environ.get(vendor.arch_env)
    if override:
        try:
            vendor.resolve(override)
        except ValueError as exc:
            return False, f"{vendor.arch_env}: {str(exc).removeprefix('arch: ')}", None
    if interpreting():
        target = vendor.target(override or vendor.interpreted_arch, interpreted=True)
        return True, f"{INTERPRET_ENV}=1: Triton {version} runs the kernels on the CPU as for {target.arch}", target
    if not getattr(torch.version, vendor.runtime, None):
        hint = f"set {INTERPRET_ENV}=1 to run the kernels on the CPU"
        build = f" (a {vendor.runtime_name} build of torch: {get_torch})" if vendor.torch_index else ""
        return False, f"this torch build has no {vendor.runtime_name} support{build}; {hint}", None
    module = torch.get_device_module(vendor.device_type)
    if not module.is_available():
        return False, f"no GPU visible to torch; set {INTERPRET_ENV}=1 to run the kernels on the CPU", None
    detected = vendor.arch_of(module.get_device_properties(0))
    arch = override or detected
    forced = f" (forced by {vendor.arch_env})" if override else ""
    return True, f"{module.get_device_name(0)} ({detected}{forced}) with Triton {version}", vendor.target(arch)
