"""The NVIDIA backend: Triton kernels, fp8 e4m3fn, tuning by architecture.

Available with a CUDA build of torch, a visible GPU and Triton (auto-selected then), or on any
machine with ``TRITON_INTERPRET=1`` (interpreted on the CPU, never auto-selected).
``INDEXCACHE_CUDA_ARCH`` (e.g. ``sm80``) overrides the architecture whose paths and tuning are used.
"""

from __future__ import annotations

import functools

from indexcache.backends.cuda.tuning import tuning
from indexcache.backends.triton.target import Target, detect

from indexcache.dispatch import Availability, Backend, OpImpl

ARCH_ENV = "INDEXCACHE_CUDA_ARCH"


@functools.cache
def _detected() -> tuple[bool, str, Target | None]:
    return detect("cuda", ARCH_ENV, interpreted_arch="sm90")


def _probe() -> Availability:
    ok, reason, target = _detected()
    if not ok:
        return Availability(False, reason)
    return Availability(True, reason, auto=not target.interpreted,
                        mode="interpreted" if target.interpreted else "GPU", device=target.device_type)


def _ops() -> dict[str, OpImpl]:
    from indexcache.backends.triton import make_ops
    from indexcache.streams import device_overlap

    target = _detected()[2]
    # CUDA side streams for overlap(): 5.
    return {**make_ops(target, tuning(target.arch)), "overlap": device_overlap(target.device_type, side_streams=5)}


def _info() -> dict:
    target = _detected()[2]
    return {"arch": target.arch, "fp8_dtype": str(target.fp8_dtype), "tuning": tuning(target.arch)}


BACKEND = Backend(name="cuda", priority=10, probe=_probe, ops=_ops, interpretable=True, fp8_tensor_core=True,
                  info=_info)
