"""Reusable ``supports`` checks for Triton ops, each returning its reasons to decline (empty: none), the launch
options of a tuning entry (programmatic dependent launch among them), and the host arithmetic of launch shapes."""

from __future__ import annotations

import torch

from indexcache.backends.triton.target import Target

# Each device's type: ``device.type`` costs three times a look-up here, and every supports() asks it of each tensor.
_TYPES: dict[torch.device, str] = {}


def on_target_device(target: Target, **tensors: torch.Tensor | None) -> list[str]:
    """One reason per device other than where the target's kernels run (a GPU, or the CPU when interpreted),
    naming the given tensors (None: absent) that live there; and one naming those that are negated views
    (:func:`negated`)."""
    want = target.device_type
    away: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        if t is not None:
            device = t.device
            kind = _TYPES.get(device)
            if kind is None:
                kind = _TYPES[device] = device.type
            if kind != want:
                away.setdefault(device, []).append(name)
    mode = "interpreted Triton runs on CPU tensors" if target.interpreted else "Triton kernels need GPU tensors"
    return [*(f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} on {device}: {mode}"
              for device, names in away.items()), *negated(**tensors)]


def negated(**tensors: torch.Tensor | None) -> list[str]:
    """A reason naming the given tensors (None: absent) whose negative bit is set (lazily negated views, as
    ``z.conj().imag`` of a complex ``z`` gives; the torch backend reads them negated), and one naming those whose
    conjugate bit is set (``z.conj()``: complex KV rows ``hisparse_swap_in`` copies), else none: a kernel reads and
    writes memory as it lies, so it would take the values unnegated, unconjugated."""
    reasons = []
    for bit, lazy, resolve in (("negative", "negated", "resolve_neg"), ("conjugate", "conjugated", "resolve_conj")):
        names = [name for name, t in tensors.items()
                 if t is not None and (t.is_neg() if bit == "negative" else t.is_conj())]
        if names:
            reasons.append(f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} the {bit} bit set (a lazily "
                           f"{lazy} view): the Triton kernels read memory as it lies ({resolve}() gives the values "
                           f"{lazy} in memory)")
    return reasons


def launch_options(target: Target, cfg) -> dict:
    """Triton launch options from a tuning entry: num_warps, num_stages and the vendor's own (its record's
    ``launch_keys``: waves_per_eu on AMD, maxnreg, a register cap a thread, on NVIDIA)."""
    return {key: cfg[key] for key in ("num_warps", "num_stages", *target.gpu.vendor.launch_keys) if key in cfg}


def uses_pdl(target: Target, cfg) -> bool:
    """Whether a tuning entry's kernels start with programmatic dependent launch (its ``PDL``, on a GPU whose
    architecture has it): they wait for the launch before them (``griddepcontrol.wait``) before touching memory."""
    return bool(cfg.get("PDL")) and target.gpu.pdl and not target.interpreted


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of ints on the host: ``triton.cdiv`` is a constexpr function, whose wrapper costs about 3 µs a
    host call (a few per op call add up on the eager path)."""
    return -(-a // b)


# Programs a grid holds in its second and third dimensions (CUDA's and HIP's limit; the first holds 2^31 - 1).
MAX_GRID_Y = 65535


def grid_y(blocks: int) -> int:
    """Programs in a grid's second dimension for ``blocks`` blocks: at least 1, at most :data:`MAX_GRID_Y` (a
    kernel whose block count may pass it takes blocks ``program_id(1), + num_programs(1), …``)."""
    return max(1, min(blocks, MAX_GRID_Y))


def next_power_of_2(n: int) -> int:
    """The least power of two ≥ ``n`` (0 for 0), as ``triton.next_power_of_2`` without its host-call wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
