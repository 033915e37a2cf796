"""The NVIDIA backend: Triton kernels, fp8 e4m3fn, tuning by architecture.

Available with a CUDA build of torch, a visible GPU and Triton (auto-selected then), or on any
machine with ``TRITON_INTERPRET=1`` (interpreted on the CPU, never auto-selected).
``INDEXCACHE_CUDA_ARCH`` (e.g. ``sm80``) overrides the architecture whose paths and tuning are used.
``overlap()`` may use 5 side streams.
"""

from __future__ import annotations

from indexcache.backends.cuda.tuning import tuning
from indexcache.backends.triton.backend import gpu_backend

ARCH_ENV = "INDEXCACHE_CUDA_ARCH"

BACKEND = gpu_backend("cuda", "cuda", priority=10, arch_env=ARCH_ENV, interpreted_arch="sm90", tuning=tuning,
                      side_streams=5)
