"""Reusable ``supports`` checks for Triton ops: each returns ``(ok, reason)``."""

from __future__ import annotations

import torch

from indexcache.backends.triton.target import Target


def on_target_device(target: Target, **tensors: torch.Tensor | None) -> tuple[bool, str]:
    """All given tensors live where the target's kernels run (a GPU, or the CPU when interpreted)."""
    for name, t in tensors.items():
        if t is not None and t.device.type != target.device_type:
            mode = "interpreted Triton runs on CPU tensors" if target.interpreted else "Triton kernels need GPU tensors"
            return False, f"{name} is on {t.device}: {mode}"
    return True, ""


def launch_options(target: Target, cfg) -> dict:
    """Triton launch options from a tuning entry: num_warps, num_stages, and waves_per_eu on AMD."""
    opts = {key: cfg[key] for key in ("num_warps", "num_stages") if key in cfg}
    if target.vendor == "hip" and "waves_per_eu" in cfg:
        opts["waves_per_eu"] = cfg["waves_per_eu"]
    return opts
