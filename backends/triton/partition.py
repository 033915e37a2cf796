"""SM partitions: a stream whose kernels run on a share of an NVIDIA GPU's multiprocessors and on no other.

A CUDA green context holds a share of the device's multiprocessors; every kernel enqueued on one of its streams (ours,
torch's, cuBLAS's) runs there only, and each multiprocessor of the share holds as many programs as fit. That is what
``overlap`` needs for its side work (docs/streams.md, "Partitions"): an SM budget (:mod:`indexcache.hal.budget`) can
only cap a persistent kernel at one program a multiprocessor, since the hardware places programs where it likes, and
cannot keep torch's matmuls anywhere.

Torch makes them (``torch.cuda.green_contexts.GreenContext``: a CUDA build with CUDA 12.4 or later, a driver that has
them, and ``GreenContext.Stream``, torch 2.11 or later). Elsewhere (a ROCm build, an older torch or driver)
:func:`partition_stream` answers None and the caller falls back. A partition is made once per GPU, share and side, and
kept for the process (its green context with it): making one is not a stream operation, so it is never done while a
CUDA graph is being captured.
"""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger("indexcache")

_PARTITIONS: dict[tuple[int, int, int], tuple[object, torch.cuda.Stream] | None] = {}
_MAKING = threading.Lock()


def available() -> bool:
    """Whether this torch can make green contexts at all (a CUDA build whose ``GreenContext`` has ``Stream``)."""
    if torch.version.hip is not None or not torch.cuda.is_available():
        return False
    try:
        from torch.cuda import green_contexts
    except ImportError:
        return False
    return bool(getattr(green_contexts, "SUPPORTED", False)) and hasattr(green_contexts.GreenContext, "Stream")


def partition_stream(device_index: int, sms: int, side: int = 0, *, make: bool = True) -> torch.cuda.Stream | None:
    """A stream of a green context of ``sms`` multiprocessors of GPU ``device_index`` (the driver rounds the count up
    to its granularity, 8 on Hopper), one per ``side``; made on first use where ``make``, else only looked up. None
    where no partition can be had here (see the module docstring; why is logged once)."""
    key = (device_index, sms, side)
    if key not in _PARTITIONS:
        if not make:
            return None
        with _MAKING:
            if key not in _PARTITIONS:
                _PARTITIONS[key] = _make(device_index, sms)
    made = _PARTITIONS[key]
    return None if made is None else made[1]


def _make(device_index: int, sms: int) -> tuple[object, torch.cuda.Stream] | None:
    if not available():
        logger.info("indexcache: no SM partitions here (torch %s has no green contexts with streams, or no CUDA GPU)",
                    torch.__version__)
        return None
    from torch.cuda.green_contexts import GreenContext

    try:
        context = GreenContext.create(num_sms=sms, device_id=device_index)
        return context, context.Stream()
    except Exception as exc:  # noqa: BLE001  (a driver without them, a share it refuses: fall back, say why once)
        logger.info("indexcache: no SM partition of %d multiprocessors on cuda:%d: %s", sms, device_index, exc)
        return None
