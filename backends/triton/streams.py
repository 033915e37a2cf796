"""The GPU backends' ``overlap`` scheduler: side work on device streams, joined to the current stream.

``side_fn`` runs on a side stream (created on first use, per GPU) while ``main_fn`` runs on the current
stream; the current stream then waits for the side stream, so whatever follows sees both results, exactly
as if the two had run one after the other (side first). Tensors that ``side_fn`` returns are marked with
``record_stream`` for the current stream, so the caching allocator never hands their memory to the side
stream while the main stream may still read them. It uses the stream API of the torch module of the
backend's device type (``torch.cuda``: CUDA streams, HIP streams on a ROCm build). Fork and join are event
record/wait pairs, so the same code is valid under CUDA-graph capture, where they become graph edges; nothing
here allocates device memory or syncs with the host.
Create the streams before capturing (a first eager call does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from indexcache.backends.torch.streams import in_order
from indexcache.hal.contract import OpImpl

S = TypeVar("S")
M = TypeVar("M")


def _record(value: Any, stream: torch.Stream, device_type: str) -> None:
    """``record_stream`` every tensor on ``device_type`` in ``value`` (a tensor or nested tuples, lists and dict
    values)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == device_type:
            value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _record(item, stream, device_type)
    elif isinstance(value, dict):
        for item in value.values():
            _record(item, stream, device_type)


class DeviceStreams:
    """Scheduler over ``side_streams`` device streams per GPU of ``device_type`` (the backend's: "cuda" takes
    torch.cuda's streams), created on first use."""

    def __init__(self, side_streams: int, device_type: str) -> None:
        if isinstance(side_streams, bool) or not isinstance(side_streams, int) or side_streams < 1:
            raise ValueError(f"side_streams: expected an int >= 1, got {side_streams!r}")
        self.side_streams = side_streams
        self.device_type = device_type
        self._module = torch.get_device_module(device_type)
        self._streams: dict[int, list[torch.Stream]] = {}

    def stream(self, device: torch.device, side: int) -> torch.Stream:
        """Side stream ``side % side_streams`` of ``device``."""
        index = device.index if device.index is not None else self._module.current_device()
        pool = self._streams.get(index)
        if pool is None:
            pool = [self._module.Stream(device=index) for _ in range(self.side_streams)]
            self._streams[index] = pool
        return pool[side % self.side_streams]

    def __call__(self, side_fn: Callable[[], S], main_fn: Callable[[], M], side: int,
                 device: torch.device) -> tuple[S, M]:
        main = self._module.current_stream(device)
        stream = self.stream(device, side)
        stream.wait_stream(main)
        with self._module.stream(stream):
            side_out = side_fn()
        main_out = main_fn()
        main.wait_stream(stream)
        _record(side_out, main, self.device_type)
        return side_out, main_out

    def supports(self, device: torch.device, **_: Any) -> list[str]:
        """Why the scheduler declines a call (empty: it takes it): it needs tensors on its GPUs."""
        if device.type == self.device_type:
            return []
        return [f"device streams need GPU tensors, got device {device}"]


def device_overlap(device_type: str, side_streams: int) -> OpImpl:
    """The ``overlap`` op of a GPU backend whose tensors live on ``device_type`` (its vendor's: "cuda" on NVIDIA
    and AMD; "cpu" when its kernels are interpreted, which runs in order) and that allows ``side_streams`` side
    streams."""
    if device_type == "cpu":
        return OpImpl(in_order)
    scheduler = DeviceStreams(side_streams, device_type)
    return OpImpl(scheduler, scheduler.supports)
