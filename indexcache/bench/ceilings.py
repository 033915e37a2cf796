"""The machine's ceilings: what the fastest possible op would achieve here, measured, not quoted.

Device-to-device copy bandwidth (one large ``copy_``, bytes read plus written), the fp8
(``torch._scaled_mm``) and bf16 (``torch.matmul``) matmul rates on n³ (n = 8192 on a GPU), and the time of an
empty Triton kernel launch. :data:`CEILINGS` names them for the ops' rooflines; an entry without ``measure``
is a per-case ceiling (the op's own ``floor`` timed on the case's inputs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from indexcache.backends.triton.target import device_gpu
from indexcache.bench.timing import Timer, on_gpu


@dataclass(frozen=True)
class Ceiling:
    """A rate ceiling: ``measure(timer, quick) -> (rate per second, details)``; ``counts`` says whether
    an op's bytes or FLOPs are set against it; ``unit``/``scale`` are for display. Without ``measure`` the
    ceiling is per case: the op's ``floor`` timed on the case's inputs (``description`` says what it is)."""

    name: str
    counts: str
    unit: str
    scale: float
    measure: Callable[[Timer, bool], tuple[float, dict[str, Any]]] | None
    description: str = ""


def copy_bandwidth(timer: Timer, quick: bool) -> tuple[float, dict[str, Any]]:
    """Bytes read plus written per second by one large ``copy_`` of random int32 data (1 GiB on a GPU)."""
    size = (64 if quick else 1024) * 2**20 if on_gpu(timer.device) else (8 if quick else 64) * 2**20
    src = torch.randint(-(2**31), 2**31 - 1, (size // 4,), dtype=torch.int32, device=timer.device)
    dst = torch.empty_like(src)
    us = timer.eager_us(lambda i: dst.copy_(src))
    return 2 * size / (us * 1e-6), {"bytes_moved": 2 * size, "time_us": us}


def _fp8_dtype(device: torch.device) -> torch.dtype:
    """The fp8 format of the device's architecture (its record's: e4m3fnuz on gfx94x); e4m3fn on the CPU."""
    gpu = device_gpu(device) if on_gpu(device) else None
    return gpu.fp8_dtype if gpu else torch.float8_e4m3fn


def _matmul_size(timer: Timer, quick: bool) -> int:
    return (1024 if quick else 8192) if on_gpu(timer.device) else (128 if quick else 512)


def fp8_matmul(timer: Timer, quick: bool) -> tuple[float, dict[str, Any]]:
    """FLOP/s of ``torch._scaled_mm`` on n³ fp8 (n = 8192 on a GPU), unit tensor-wide scales, bf16 out: the
    faster of promoted and fast accumulation (the logits kernels use neither promotion). The details hold
    both times (``promoted_us``, ``fast_accum_us``)."""
    n = _matmul_size(timer, quick)
    fp8 = _fp8_dtype(timer.device)
    a = torch.randn(n, n, device=timer.device).to(fp8)
    b = torch.randn(n, n, device=timer.device).to(fp8).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=timer.device)
    times = {fast: timer.eager_us(lambda i, f=fast: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                                     out_dtype=torch.bfloat16, use_fast_accum=f))
             for fast in (False, True)}
    us = min(times.values())
    return 2 * n**3 / (us * 1e-6), {"n": n, "dtype": str(fp8), "time_us": us, "promoted_us": times[False],
                                    "fast_accum_us": times[True]}


def bf16_matmul(timer: Timer, quick: bool) -> tuple[float, dict[str, Any]]:
    """FLOP/s of ``torch.matmul`` on n³ bfloat16 (n = 8192 on a GPU)."""
    n = _matmul_size(timer, quick)
    a = torch.randn(n, n, device=timer.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=timer.device, dtype=torch.bfloat16)
    us = timer.eager_us(lambda i: torch.matmul(a, b))
    return 2 * n**3 / (us * 1e-6), {"n": n, "time_us": us}


CEILINGS: dict[str, Ceiling] = {
    "copy_bandwidth": Ceiling("copy_bandwidth", "bytes", "GB/s", 1e9, copy_bandwidth),
    "fp8_matmul": Ceiling("fp8_matmul", "flops", "TFLOP/s", 1e12, fp8_matmul),
    "bf16_matmul": Ceiling("bf16_matmul", "flops", "TFLOP/s", 1e12, bf16_matmul),
    "read_once": Ceiling("read_once", "bytes", "GB/s", 1e9, None,
                         "per case: one scores.sum() over the case's inputs, timed like the op (graph on a GPU)"),
}


@functools.cache
def _empty_kernel():
    import triton

    @triton.jit
    def empty(x_ptr):
        pass

    return empty


def empty_launch(device: torch.device, timer: Timer, graph_ok: bool) -> dict[str, Any]:
    """An empty Triton kernel launch: eager (host issue + device) and, on a GPU, inside a graph of 100 launches.

    ``{"mode": "GPU" / "interpreted" / None, "reason", "eager_us", "graph_us", "graph_error"}``."""
    from indexcache.backends.triton.target import interpreting, triton_import

    found: dict[str, Any] = {"mode": None, "reason": "", "eager_us": None, "graph_us": None, "graph_error": None}
    version, missing = triton_import()
    if version is None:
        return {**found, "reason": missing}
    if interpreting():
        mode, where = "interpreted", torch.device("cpu")
    elif on_gpu(device):
        mode, where = "GPU", device
    else:
        return {**found, "reason": "no GPU: compiled Triton cannot launch (TRITON_INTERPRET=1 interprets it)"}
    kernel = _empty_kernel()
    buf = torch.zeros(1, dtype=torch.int32, device=where)

    def launch(i: int) -> None:
        kernel[(1,)](buf)

    t = timer if where == timer.device else Timer(where, timer.warmup, timer.reps, timer.graph_reps, timer.budget_s)
    found.update(mode=mode, eager_us=t.eager_us(launch))
    if graph_ok and mode == "GPU":
        try:
            found["graph_us"] = t.graph_us(launch, 100)
        except Exception as exc:  # reported with the ceiling; the ops still run
            found["graph_error"] = f"{type(exc).__name__}: {exc}"
    return found
