"""A GPU backend as data: the Triton kernels built for a vendor's target with that vendor's tuning table."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from indexcache.backends.triton.target import GpuVendor, Target, detect
from indexcache.hal.contract import Availability, Backend, Capabilities, OpImpl


def gpu_backend(vendor: GpuVendor, priority: int, tuning: Callable[[str], Mapping[str, Mapping[str, Any]]],
                side_streams: int) -> Backend:
    """The ``Backend`` named ``vendor.backend`` for ``vendor``'s GPUs; ``side_streams`` is what ``overlap()`` may
    use."""
    name = vendor.backend

    def target() -> Target:
        _, reason, found = detect(vendor)
        if found is None:
            raise RuntimeError(f"backend {name!r} has no target: it is not available here ({reason})")
        return found

    def probe() -> Availability:
        ok, reason, found = detect(vendor)
        if not ok:
            return Availability(False, reason)
        if not found.interpreted and not found.gpu.auto_select:
            reason += (f"; not chosen automatically: {found.arch} has no record in backends/{name}/arch.py (the "
                       f"kernels are tuned for {', '.join(vendor.cross_compile)}); backend={name!r}, "
                       f"use_backend({name!r}) or INDEXCACHE_BACKEND={name} runs them")
        return Availability(True, reason, auto=not found.interpreted and found.gpu.auto_select,
                            mode="interpreted" if found.interpreted else "GPU", device=found.device_type)

    def ops() -> dict[str, OpImpl]:
        from indexcache.backends.triton import make_ops
        from indexcache.backends.triton.streams import device_overlap

        found = target()
        table = tuning(found.arch)
        overlap = device_overlap(found.device_type, side_streams=side_streams, rule=table.get("overlap"))
        return {**make_ops(found, table), "overlap": overlap}

    def capabilities() -> Capabilities:
        found = target()
        return Capabilities(fp8_dtype=found.fp8_dtype, arch=found.arch, side_streams=side_streams)

    def details() -> dict[str, Any]:
        return {"tuning": tuning(target().arch)}

    def device_fp8(device: torch.device) -> torch.dtype | None:
        # a device of this vendor's torch build on a machine without its GPU (fake tensors traced for export) has no
        # record to read: the properties query would raise
        if device.type != vendor.device_type or not torch.get_device_module(device).device_count():
            return None
        gpu = vendor.device_arch(device)
        if gpu is None:
            return None
        # the architecture forced by vendor.arch_env is the one whose fp8 policy the kernels follow (detect); one the
        # vendor does not know leaves the backend unavailable, and the device's own record answers
        if forced := os.environ.get(vendor.arch_env):
            try:
                gpu = vendor.resolve(forced)
            except ValueError:
                pass
        return gpu.fp8_dtype

    return Backend(name=name, priority=priority, probe=probe, ops=ops, capabilities=capabilities, details=details,
                   device_fp8=device_fp8, interpretable=True, fp8_tensor_core=True)
