"""What ran where: the commit, the versions, the device and the date a benchmark report records."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

import indexcache

COMMIT_ENV = "INDEXCACHE_COMMIT"  # the commit to record where the checkout has no .git (e.g. a copied tree)


def now() -> str:
    """The date and time in UTC, ISO 8601 to the second (``2026-11-29T10:31:02+00:00``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def checkout_commit() -> str | None:
    """``$INDEXCACHE_COMMIT`` when set (a copied tree: without .git, or inside another repository's checkout),
    else the git commit of this checkout, else None."""
    return git_state()[0]


def git_state() -> tuple[str | None, bool | None]:
    """``(commit, dirty)``: the commit as :func:`checkout_commit` finds it, and whether tracked files differ
    from it (None when unknown: taken from ``$INDEXCACHE_COMMIT``, or no git, or the package is not the top of its
    git work tree: installed or copied into another repository's, whose commit is not this code's)."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV], None
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        found = head.stdout.splitlines()
        if head.returncode == 0 and len(found) == 2 and Path(found[0]).resolve() == root:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10)
            return found[1], bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return None, None


def versions() -> dict[str, str | None]:
    """indexcache, torch, Triton (None when absent), CUDA, HIP and Python versions."""
    from indexcache.backends.triton.target import triton_import

    return {"indexcache": indexcache.__version__, "torch": torch.__version__, "triton": triton_import()[0],
            "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "python": platform.python_version()}


def device_name(device: torch.device) -> str | None:
    """The GPU's name (``"NVIDIA H200"``), or None off a GPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def report_head(device: torch.device) -> dict[str, Any]:
    """The fields every GPU script's JSON report starts with: schema 1, the date, the commit, the device ("cpu" off a
    GPU) and :func:`versions`."""
    return {"schema": 1, "date": now(), "commit": checkout_commit(), "device": device_name(device) or "cpu",
            **versions()}
