"""What a Triton kernel is built for: vendor, architecture, wave size, native fp8 format, mode."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from indexcache.hal.device import device_arch, fp8_format

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_ENV, "") == "1"


@dataclass(frozen=True)
class Target:
    """A GPU target. ``arch`` is "sm80", "sm90", … or "gfx942", "gfx950"; when ``interpreted`` it is
    the architecture whose tuning and fp8 policy the CPU run follows."""

    vendor: str  # "cuda" or "hip"
    arch: str
    warp_size: int
    fp8_dtype: torch.dtype
    interpreted: bool

    @property
    def device_type(self) -> str:
        """The torch device type of tensors the kernels accept ("cuda" on both vendors, "cpu" interpreted)."""
        return "cpu" if self.interpreted else "cuda"


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def detect(vendor: str, arch_env: str, interpreted_arch: str) -> tuple[bool, str, Target | None]:
    """Find a ``vendor`` ("cuda" or "hip") GPU for Triton: ``(available, reason, target)``.

    ``arch_env`` names the variable that overrides the architecture (for tests and forced paths);
    under ``TRITON_INTERPRET=1`` the target is ``interpreted_arch`` unless overridden.
    """
    version = _triton_version()
    extra = "cuda" if vendor == "cuda" else "rocm"
    if version is None:
        return False, f"Triton is not installed (pip install 'indexcache[{extra}]')", None
    override = os.environ.get(arch_env)
    if interpreting():
        arch = override or interpreted_arch
        return True, f"{INTERPRET_ENV}=1: Triton {version} runs the kernels on the CPU as for {arch}", _target(
            vendor, arch, interpreted=True)
    runtime = torch.version.cuda if vendor == "cuda" else getattr(torch.version, "hip", None)
    if not runtime:
        other = "ROCm/HIP" if vendor == "hip" else "CUDA"
        hint = f"set {INTERPRET_ENV}=1 to run the kernels on the CPU"
        return False, f"this torch build has no {other} support; {hint}", None
    if not torch.cuda.is_available():
        return False, f"no GPU visible to torch; set {INTERPRET_ENV}=1 to run the kernels on the CPU", None
    detected = device_arch(0)
    arch = override or detected
    forced = f" (forced by {arch_env})" if override else ""
    return True, f"{torch.cuda.get_device_name(0)} ({detected}{forced}) with Triton {version}", _target(
        vendor, arch, interpreted=False)


def _target(vendor: str, arch: str, interpreted: bool) -> Target:
    return Target(vendor, arch, 64 if vendor == "hip" else 32, fp8_format(arch), interpreted)
