"""The oldest torch indexcache runs on, checked once a process where indexcache first needs torch.

``import indexcache`` imports no torch (docs/architecture.md, "Public names"), so the check runs at the first public
name that needs it (the package root's lazy import) and before any ``indexcache`` command that runs ops; an older
torch then fails there with one ImportError naming both versions instead of an AttributeError deep inside (a torch
without ``torch.float4_e2m1fn_x2``). Importing a module of a layer directly skips it.
"""

from __future__ import annotations

import functools
import re

# pyproject.toml's ``torch>=2.11.0.dev0`` (tests/test_torch_version.py holds the two equal). A pre-release or local
# build of 2.11 ("2.11.0a0+git...", as NVIDIA's containers carry) counts as 2.11: only the release's major and minor
# are compared, as pyproject's lowest 2.11 version (its first dev release) lets pip keep such a torch.
TORCH_MINIMUM = (2, 11)


def check_version(version: str) -> None:
    """Nothing when ``version`` (a ``torch.__version__``) is at least :data:`TORCH_MINIMUM`; else ImportError naming
    it, the minimum and how to upgrade."""
    minimum = ".".join(map(str, TORCH_MINIMUM))
    found = re.match(r"(\d+)\.(\d+)", str(version))
    if found is not None and (int(found[1]), int(found[2])) >= TORCH_MINIMUM:
        return
    raise ImportError(
        f"indexcache needs torch >= {minimum}, but torch {version} is installed; upgrade it: "
        f"pip install --upgrade 'torch>={minimum}' (on a CPU machine add --index-url "
        "https://download.pytorch.org/whl/cpu, on AMD the ROCm index: README, \"Quick start\" and \"GPU backends\")")


@functools.cache
def require_torch() -> None:
    """Import torch and :func:`check_version` its version, once a process (a failure is raised again each call)."""
    import torch

    check_version(torch.__version__)
