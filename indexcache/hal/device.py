"""Device facts, in one place: the GPU's name, multiprocessor count, L2 size and a multiprocessor's limits (queried
once per device and cached), and how many blocks of a kernel an NVIDIA multiprocessor holds.

What an architecture has (warp size, shared memory, fp8 format, TMA, ...) is not here: each GPU backend's vendor
package records it (docs/architecture.md, "Architectures"). :func:`workspace_owner` names who owns a call's default
workspace (the calling thread and its current stream); :func:`other_gpu` says when a call must make its tensors' GPU
current. Nothing here touches a device until a function that queries one is called.
"""

from __future__ import annotations

import functools
import threading

import torch


def workspace_owner(t: torch.Tensor) -> tuple[int, int]:
    """Who owns the default workspace of a call on ``t``'s device (docs/ops.md, "Workspace"): ``(stream, thread)``,
    the raw handle of the device's current stream on a CUDA/HIP device (0 elsewhere: kernels there, interpreted, run
    synchronously in the calling thread) and the calling thread's id. The thread counts on a GPU too: two threads
    enqueueing on one stream interleave their launches. Read on every kept eager call: well under a microsecond
    (``t.is_cuda``, not ``t.device.type``, which costs more than the rest together)."""
    if t.is_cuda:  # the raw handle, as Triton's launcher reads it: no Stream object
        return torch._C._cuda_getCurrentRawStream(t.get_device()), threading.get_ident()
    return 0, threading.get_ident()


def other_gpu(t: object) -> int | None:
    """The index of the GPU tensor ``t`` lives on where another GPU is current, else None (not a GPU tensor, or on
    the current GPU). A call on it runs with that GPU current: Triton launches on the current GPU, whose streams and
    default workspace the call would otherwise take (docs/ops.md, "Conventions shared by every op")."""
    if isinstance(t, torch.Tensor) and t.is_cuda and (index := t.get_device()) != torch._C._cuda_getDevice():
        return index  # CUDA is up: a CUDA tensor exists
    return None


@functools.cache
def sm_count(index: int = 0) -> int:
    """Streaming multiprocessors (compute units on AMD) of GPU ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def device_name(index: int = 0) -> str:
    """The name of GPU ``index`` as its driver gives it ("NVIDIA H100 80GB HBM3", "NVIDIA H200", ...)."""
    return torch.cuda.get_device_name(index)


@functools.cache
def l2_bytes(index: int = 0) -> int:
    """The L2 cache of GPU ``index`` in bytes (64 MiB where torch does not report it)."""
    return getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or 64 * 2**20


@functools.cache
def sm_limits(index: int = 0) -> tuple[int, int, int]:
    """Registers, shared memory bytes and threads a multiprocessor of NVIDIA GPU ``index`` holds (H100/H200 values
    where torch does not report one)."""
    props = torch.cuda.get_device_properties(index)
    return (getattr(props, "regs_per_multiprocessor", 0) or 65536,
            getattr(props, "shared_memory_per_multiprocessor", 0) or 228 * 1024,
            getattr(props, "max_threads_per_multi_processor", 0) or 2048)


def resident_blocks(registers: int, shared: int, threads: int, limits: tuple[int, int, int]) -> int:
    """Thread blocks of one kernel that an NVIDIA multiprocessor with ``limits`` (:func:`sm_limits`) holds at once,
    given a thread's ``registers``, a block's dynamic ``shared`` bytes and its ``threads`` (at least 1). Registers
    go to warps in 256s from each of the four schedulers' quarter of the file; the driver keeps 1 KiB of shared
    memory a block."""
    regs, smem, max_threads = limits
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256
    by_regs = 4 * ((regs // 4) // per_warp) // warps if per_warp else 32
    by_smem = smem // (shared + 1024)
    return max(1, min(by_regs, by_smem, max_threads // threads, 32))
