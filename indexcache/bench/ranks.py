"""One process per rank for the multi-GPU scripts (``bench/cp_gpu.py``, ``bench/cp_model_gpu.py``).

:func:`spawn` starts the ranks (NCCL on one GPU each with NVLink multicast off, or gloo on CPU processes);
:func:`rank_group` gives a rank its device inside its process group; :func:`describe` and
:func:`run_header` say what ran, for the printed line and the JSON report rank 0 writes with
:func:`write_report`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import socket
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from indexcache.bench.output import write_json
from indexcache.bench.provenance import checkout_commit, device_name, now, versions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(rank_main: Callable[[int, int, argparse.Namespace], None], nproc: int, args: argparse.Namespace,
          name: str) -> None:
    """Run ``rank_main(rank, nproc, args)`` in ``nproc`` processes (``NCCL_NVLS_ENABLE=0``, a free local port);
    a rank that exits non-zero ends the script with a message naming ``name``."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    try:
        mp.spawn(rank_main, args=(nproc, args), nprocs=nproc)
    except mp.ProcessExitedException as exc:
        sys.exit(f"{name}: {exc} (a mismatch exits 1; see the report)")


@contextlib.contextmanager
def rank_group(rank: int, world: int, dist_backend: str) -> Iterator[torch.device]:
    """This rank's device (``cuda:rank`` with NCCL, else the CPU) inside its process group, destroyed on exit."""
    gpu = dist_backend == "nccl"
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(dist_backend, rank=rank, world_size=world, device_id=device if gpu else None)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def describe(device: torch.device, world: int, dist_backend: str) -> str:
    """``"2 x NVIDIA H200, nccl 2.28.9"`` or ``"2 x CPU (x86_64), gloo"``."""
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)}, {dist_backend} {_nccl()}"
    return f"{world} x CPU ({platform.processor() or platform.machine()}), {dist_backend}"


def _nccl() -> str:
    return ".".join(map(str, torch.cuda.nccl.version()))


def run_header(schema: str, device: torch.device, world: int) -> dict:
    """The report's first fields: schema, date, GPU, world size, versions and commit."""
    gpu = device.type == "cuda"
    v = versions()
    return {
        "schema": schema,
        "date": now(),
        "gpu": device_name(device),
        "gpu_run": gpu,
        "world_size": world,
        "versions": {"indexcache": v["indexcache"], "torch": v["torch"], "cuda": v["cuda"],
                     "nccl": _nccl() if gpu else None},
        "commit": checkout_commit(),
    }


def write_report(report: dict, out: str | None) -> None:
    """``report`` as indented JSON to ``out`` (nothing when None)."""
    if out:
        write_json(report, out)
        print(f"wrote {out}")
