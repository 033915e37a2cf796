"""The NVIDIA backend: Triton kernels, fp8 e4m3fn, tuning by architecture.

Available with a CUDA build of torch, a visible GPU and Triton (auto-selected then), or on any
machine with ``TRITON_INTERPRET=1`` (interpreted on the CPU, never auto-selected).
``INDEXCACHE_CUDA_ARCH`` (e.g. ``sm80``) overrides the architecture whose paths and tuning are used.
``overlap()`` may use 5 side streams. The architectures are records in ``arch.py``.
"""

from __future__ import annotations

from indexcache.backends.cuda.arch import NVIDIA
from indexcache.backends.cuda.tuning import tuning
from indexcache.backends.triton.backend import gpu_backend

BACKEND = gpu_backend(NVIDIA, priority=10, tuning=tuning, side_streams=5)
