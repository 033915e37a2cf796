"""The AMD backend: Triton kernels, fp8 e4m3fnuz on gfx942 (MI300) and e4m3fn on gfx950 (MI355).

Available with a ROCm build of torch, a visible GPU and Triton (auto-selected then where ``arch.py`` has a record of
the GPU's architecture, gfx942 or gfx950), or on any machine with ``TRITON_INTERPRET=1`` (interpreted on the CPU as
gfx942, never auto-selected).
``INDEXCACHE_ROCM_ARCH`` (e.g. ``gfx950``) overrides the architecture whose paths and tuning are used.
``overlap()`` may use 2 side streams (SGLang overlaps only the compressors on ROCm). The architectures are records
in ``arch.py``.
"""

from __future__ import annotations

from indexcache.backends.rocm.arch import AMD
from indexcache.backends.rocm.tuning import tuning
from indexcache.backends.triton.backend import gpu_backend

BACKEND = gpu_backend(AMD, priority=20, tuning=tuning, side_streams=2)
