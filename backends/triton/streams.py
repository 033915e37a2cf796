"""The GPU backends' ``overlap`` scheduler: side work on device streams, joined to the current stream.

``side_fn`` runs on a side stream (created on first use, per GPU) while ``main_fn`` runs on the current
stream; the current stream then waits for the side stream, so whatever follows sees both results, exactly
as if the two had run one after the other (side first). Tensors that ``side_fn`` returns are marked with
``record_stream`` for the current stream, so the caching allocator never hands their memory to the side
stream while the main stream may still read them. It uses torch's stream API: CUDA streams, HIP streams on
a ROCm build. Fork and join are event record/wait pairs, so the same code is valid under CUDA-graph
capture, where they become graph edges; nothing here allocates device memory or syncs with the host.
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


def _record(value: Any, stream: torch.cuda.Stream) -> None:
    """``record_stream`` every tensor in ``value`` (a tensor or nested tuples, lists and dict values)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cuda":
            value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _record(item, stream)
    elif isinstance(value, dict):
        for item in value.values():
            _record(item, stream)


class DeviceStreams:
    """Scheduler over ``side_streams`` device streams per GPU, created on first use."""

    def __init__(self, side_streams: int) -> None:
        if isinstance(side_streams, bool) or not isinstance(side_streams, int) or side_streams < 1:
            raise ValueError(f"side_streams: expected an int >= 1, got {side_streams!r}")
        self.side_streams = side_streams
        self._streams: dict[int, list[torch.cuda.Stream]] = {}

    def stream(self, device: torch.device, side: int) -> torch.cuda.Stream:
        """Side stream ``side % side_streams`` of ``device``."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        pool = self._streams.get(index)
        if pool is None:
            pool = [torch.cuda.Stream(device=index) for _ in range(self.side_streams)]
            self._streams[index] = pool
        return pool[side % self.side_streams]

    def __call__(self, side_fn: Callable[[], S], main_fn: Callable[[], M], side: int,
                 device: torch.device) -> tuple[S, M]:
        main = torch.cuda.current_stream(device)
        stream = self.stream(device, side)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            side_out = side_fn()
        main_out = main_fn()
        main.wait_stream(stream)
        _record(side_out, main)
        return side_out, main_out


def _on_gpu(device: torch.device, **_: Any) -> list[str]:
    return [] if device.type == "cuda" else [f"device streams need GPU tensors, got device {device}"]


def device_overlap(device_type: str, side_streams: int) -> OpImpl:
    """The ``overlap`` op of a GPU backend whose tensors live on ``device_type`` ("cuda", or "cpu" when
    its kernels are interpreted, which runs in order) and that allows ``side_streams`` side streams."""
    if device_type == "cpu":
        return OpImpl(in_order)
    return OpImpl(DeviceStreams(side_streams), _on_gpu)
