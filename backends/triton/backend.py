"""A GPU backend as data: the Triton kernels built for a vendor's target with that vendor's tuning table."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from indexcache.backends.triton.target import detect
from indexcache.dispatch import Availability, Backend, OpImpl


def gpu_backend(name: str, vendor: str, priority: int, arch_env: str, interpreted_arch: str,
                tuning: Callable[[str], Mapping[str, Mapping[str, Any]]], side_streams: int) -> Backend:
    """The ``Backend`` for ``vendor`` ("cuda" or "hip"); ``side_streams`` is what ``overlap()`` may use."""

    def probe() -> Availability:
        ok, reason, target = detect(vendor, arch_env, interpreted_arch)
        if not ok:
            return Availability(False, reason)
        return Availability(True, reason, auto=not target.interpreted,
                            mode="interpreted" if target.interpreted else "GPU", device=target.device_type)

    def ops() -> dict[str, OpImpl]:
        from indexcache.backends.triton import make_ops
        from indexcache.streams import device_overlap

        target = detect(vendor, arch_env, interpreted_arch)[2]
        overlap = device_overlap(target.device_type, side_streams=side_streams)
        return {**make_ops(target, tuning(target.arch)), "overlap": overlap}

    def info() -> dict[str, Any]:
        target = detect(vendor, arch_env, interpreted_arch)[2]
        return {"arch": target.arch, "fp8_dtype": str(target.fp8_dtype), "side_streams": side_streams,
                "tuning": tuning(target.arch)}

    return Backend(name=name, priority=priority, probe=probe, ops=ops, interpretable=True,
                   fp8_tensor_core=True, info=info)
