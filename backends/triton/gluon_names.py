"""Gluon names that differ between the Triton versions the Hopper kernels build with (3.6 on the H200, 3.9 in CI),
resolved once: the block-wide barrier (``gl.thread_barrier`` → ``gl.barrier``) and the copy engine's load
(``tma.async_copy_global_to_shared`` → ``tma.async_load``, same arguments)."""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

block_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
