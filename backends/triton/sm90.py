"""What the Hopper (sm90) Gluon kernels share: the Gluon names that differ between the Triton versions they build with
(3.6 on the H200, 3.9 in CI), resolved once — the block-wide barrier (``gl.thread_barrier`` → ``gl.barrier``), the
copy engine's load (``tma.async_copy_global_to_shared`` → ``tma.async_load``, same arguments) and a shared buffer seen
as another type (``_reinterpret`` → ``reinterpret``) —, the grid dependency
control of programmatic dependent launch (sm90 on), and the reasons every one of them gives for a call it cannot
take."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from indexcache.backends.triton.target import Target

block_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

if hasattr(gl.shared_memory_descriptor, "reinterpret"):
    @gluon.jit
    def reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """``smem``'s bytes seen as ``dtype`` of ``shape`` in the shared ``layout``."""
        return smem.reinterpret(dtype, shape, layout)
else:
    @gluon.jit
    def reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """``smem``'s bytes seen as ``dtype`` of ``shape`` in the shared ``layout``."""
        return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def twice_relu(x):
    """``2 · relu(x)`` as ``x + |x|``: an add on the FMA pipe where ``max`` is an ALU instruction. Every product and
    partial sum built from it is exactly twice the plain form's, so halving the result (or a power-of-two factor
    applied to it) gives the same float (``x`` a finite matmul sum or NaN, NaN kept; never ±inf)."""
    return x + gl.abs(x)


@gluon.jit
def _grid_dependency(asm: gl.constexpr):
    gl.inline_asm_elementwise(asm + " // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def grid_dependency_wait():
    """Wait until the kernel launched before this one has finished and its writes are visible (a no-op unless this
    kernel was launched with ``launch_pdl``, which lets it start before then). sm90 and later."""
    _grid_dependency("griddepcontrol.wait;")


@gluon.jit
def launch_dependents():
    """Let the next kernel, where launched with ``launch_pdl``, start once every program of this one has got here or
    exited (a hint; its programs still wait for this kernel's end at :func:`grid_dependency_wait`). sm90 and
    later."""
    _grid_dependency("griddepcontrol.launch_dependents;")


def unsupported_target(dtype: torch.dtype, target: Target) -> list[str]:
    """Why no Hopper Gluon kernel takes a call with fp8 operands of ``dtype`` on ``target`` (empty: they may)."""
    reasons = []
    if target.interpreted or target.gpu.mma != "wgmma":  # Hopper's warp-group MMA and TMA
        reasons.append(f"{target.arch}{' interpreted' if target.interpreted else ''}: Hopper (sm90) only")
    if dtype != torch.float8_e4m3fn:
        reasons.append(f"q dtype {dtype}: float8_e4m3fn only")
    return reasons
