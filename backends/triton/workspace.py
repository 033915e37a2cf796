"""The device workspaces of the Triton ops (the top-k's candidates and bin counts, the producer's draft rows).

A call's workspace is the caller's ``workspace=`` (uint8 bytes, at least what ``indexcache.workspace_bytes`` says;
the public op checked it) or, by default, a kept one: one int32 buffer per (device, owner, power-of-two size
bucket), the owner being the calling thread and its current stream on the device
(:func:`indexcache.hal.device.workspace_owner`; on the CPU, interpreted, the thread alone). Calls that share a
kept workspace are thus ordered: they come from one thread and run on one stream. A buffer is allocated on the
first call of a new (device, owner, bucket) and kept for the life of the process, so a CUDA graph captured with it
stays valid and a captured replay never allocates (docs/ops.md, "Workspace").

The limit: a graph holds the workspace of the stream and thread that captured it. Two graphs captured on one
stream by one thread and replayed concurrently on two streams share it; give each its own ``workspace=``. A
process that calls from ever new threads or streams keeps a buffer for each; give those calls ``workspace=`` too.
"""

from __future__ import annotations

import torch

from indexcache.backends.triton.support import next_power_of_2
from indexcache.hal.device import workspace_owner

_KEPT: dict[tuple[torch.device, tuple[int, int], int], torch.Tensor] = {}


def words(on: torch.Tensor, n: int, given: torch.Tensor | None, cap: int | None = None) -> torch.Tensor:
    """``n`` int32 words of the workspace of a call on ``on``'s device: the first ``4 n`` bytes of ``given`` (the
    caller's contiguous uint8 workspace, 4-byte aligned), else of the kept workspace of the calling thread's current
    stream (of the smallest bucket that holds them, a power of two; ``cap``, at least ``n``, bounds the bucket: a call
    bounded in memory keeps a buffer of at most ``cap`` words)."""
    if given is not None:
        if given.nbytes < 4 * n:  # the op checked its size: a plan past it is a bug here
            raise ValueError(f"workspace: expected at least {4 * n} bytes for this call's launches, got "
                             f"{given.nbytes}")
        return given[:4 * n].view(torch.int32)
    size = next_power_of_2(max(n, 1))
    if cap is not None:
        size = min(size, cap)
    device = on.device
    key = (device, workspace_owner(on), size)
    kept = _KEPT.get(key)
    if kept is None:  # the key holds the thread: no other thread creates it
        kept = _KEPT[key] = torch.empty(size, dtype=torch.int32, device=device)
    return kept[:n]


def kept() -> dict[tuple[torch.device, tuple[int, int], int], torch.Tensor]:
    """The kept workspaces by (device, owner, size bucket in int32 words) (a copy, for tests and reports)."""
    return dict(_KEPT)
