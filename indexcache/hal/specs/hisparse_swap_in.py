"""hisparse_swap_in: the copies of a HiSparse plan, host KV rows → the device slots they were given, for one layer or
a producer group's layers (contract: :func:`indexcache.hisparse_swap_in`; the rules: :mod:`indexcache.hal.hisparse`,
docs/hisparse.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from indexcache.hal import hisparse
from indexcache.hal.checks import INDEX, check_output, check_tensor
from indexcache.hal.shown import dims, shown
from indexcache.hal.specs.base import I32, CaseList, OpSpec, Verdict, cpu, not_written
from indexcache.hal.specs.hisparse_plan import COPY_SRC, HOST_LOC_DTYPES, _evolved, _host_loc

DEVICE_LOC_DTYPES = HOST_LOC_DTYPES


def layers(name: str, kv) -> tuple[torch.Tensor, ...]:
    """``kv`` (``host_kv`` or ``device_kv``) as its layers: one tensor, or a non-empty list or tuple of them."""
    if isinstance(kv, torch.Tensor):
        return (kv,)
    if not isinstance(kv, (list, tuple)) or not kv or not all(isinstance(t, torch.Tensor) for t in kv):
        raise TypeError(f"{name}: expected a torch.Tensor or a non-empty list or tuple of them (a producer group's "
                        f"layers), got {kv!r}")
    return tuple(kv)


def check(copy_src, copy_dst, copy_count, host_kv: torch.Tensor | Sequence[torch.Tensor],
          device_kv: torch.Tensor | Sequence[torch.Tensor], device_loc, *, row_to_batch=None) -> dict[str, Any]:
    check_tensor("copy_count", copy_count, (INDEX,), (None,))
    device = copy_count.device
    rows = copy_count.shape[0]
    check_tensor("copy_src", copy_src, (COPY_SRC,), (rows, None), device)
    check_tensor("copy_dst", copy_dst, (INDEX,), tuple(copy_src.shape), device)
    check_tensor("device_loc", device_loc, DEVICE_LOC_DTYPES, (None, None), device)
    if row_to_batch is not None:
        check_tensor("row_to_batch", row_to_batch, (INDEX,), (rows,), device)
    elif rows != device_loc.shape[0]:
        raise ValueError(f"copy_count: expected one row a request ({shown(device_loc.shape[0])}, device_loc's rows) "
                         f"without row_to_batch, got {shown(rows)}")
    devs, hosts = layers("device_kv", device_kv), layers("host_kv", host_kv)
    grouped = not isinstance(device_kv, torch.Tensor)
    if grouped != (not isinstance(host_kv, torch.Tensor)) or len(hosts) != len(devs):
        want = f"a list of {len(devs)} layers" if grouped else "one tensor"
        got = "one tensor" if isinstance(host_kv, torch.Tensor) else f"a list of {len(hosts)}"
        raise TypeError(f"host_kv: expected {want}, as device_kv, got {got}")
    inputs = dict(copy_src=copy_src, copy_dst=copy_dst, copy_count=copy_count, device_loc=device_loc,
                  row_to_batch=row_to_batch)
    first = devs[0]
    # A layer is named by its index in a group of several only: one tensor and a list of one (what a call under
    # torch.compile passes the custom op for one tensor) name it alike.
    indexed = len(devs) > 1
    for g, (host, dev) in enumerate(zip(hosts, devs, strict=True)):
        at = f"[{g}]" if indexed else ""
        if dev.dim() < 1:
            raise TypeError(f"device_kv{at}: expected a torch.Tensor of at least one dimension, got {dev!r}")
        if dev.device != device:
            raise ValueError(f"device_kv{at}: expected a tensor on {device} (the plan's device), got {dev.device}")
        if dev.dtype != first.dtype or dev.shape[1:] != first.shape[1:]:
            raise TypeError(f"device_kv{at}: expected rows like device_kv[0]'s ({first.dtype} "
                            f"{dims(first.shape[1:])} a row), got {dev.dtype} {dims(dev.shape[1:])}")
        if host.dim() < 1:
            raise TypeError(f"host_kv{at}: expected a torch.Tensor of at least one dimension, got {host!r}")
        if host.dtype != dev.dtype or host.shape[1:] != dev.shape[1:]:
            raise TypeError(f"host_kv{at}: expected rows like device_kv{at}'s ({dev.dtype} {dims(dev.shape[1:])} a "
                            f"row), got {host.dtype} {dims(host.shape)}")
        if host.device != device and host.device.type != "cpu":
            raise ValueError(f"host_kv{at}: expected a tensor in host memory or on {device}, got {host.device}")
        for name, t in ((f"host_kv{at}", host), (f"device_kv{at}", dev)):
            if t.dim() > 1 and t.shape[0] and not t[0].is_contiguous():
                raise ValueError(f"{name}: expected each row contiguous, got strides {dims(t.stride())}")
        inputs[f"host_kv{at}"] = host
    for g, dev in enumerate(devs):
        at = f"[{g}]" if indexed else ""
        others = {f"device_kv[{o}]": t for o, t in enumerate(devs) if o != g}
        check_output(f"device_kv{at}", dev, {**inputs, **others})
    return dict(copy_src=copy_src, copy_dst=copy_dst, copy_count=copy_count, host_kv=host_kv, device_kv=device_kv,
                device_loc=device_loc, row_to_batch=row_to_batch)


def reference(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, *,
              row_to_batch=None) -> torch.Tensor | list[torch.Tensor]:
    """``device_kv`` after the swap-in (each layer's, for a group), by :func:`indexcache.hal.hisparse.swap_in`
    (counts taken in the lists' columns; a copy whose request, slot, device row or host row is out of range is
    skipped)."""
    copies = hisparse.Plan(torch.empty(0), copy_src, copy_dst, copy_count, torch.empty(0), torch.empty(0))
    return hisparse.swap_in(copies, host_kv, device_kv, device_loc, row_to_batch=row_to_batch)


def judge(args: dict, got, want, accumulation: str) -> Verdict:
    """Byte-exact: the copied rows and every other row as it was, in every layer, written in place (each layer the
    given tensor)."""
    if isinstance(want, torch.Tensor):
        return not_written(args, {"device_kv": got}) or _judge_layer("device_kv", got, want), None, None
    if isinstance(got, torch.Tensor) or len(got) != len(want):
        return f"device_kv: {type(got).__name__}, expected a list of {len(want)} layers", None, None
    given = {f"device_kv[{g}]": t for g, t in enumerate(args["device_kv"])}
    if detail := not_written(given, {name: got[g] for g, name in enumerate(given)}):
        return detail, None, None
    return "; ".join(filter(None, (_judge_layer(f"device_kv[{g}]", t, w)
                                   for g, (t, w) in enumerate(zip(got, want, strict=True))))), None, None


def _judge_layer(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    got = cpu(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"
    rows = got.view(got.shape[0], -1).view(torch.uint8) != want.view(want.shape[0], -1).view(torch.uint8)
    bad = rows.any(dim=1).nonzero().flatten().tolist()
    return f"{name} rows {bad[:8]} differ ({len(bad)} rows)" if bad else ""


# ------------------------------------------------------------------------------------------------------- cases

def _host(dev, t: torch.Tensor) -> torch.Tensor:
    """Host memory as a GPU kernel reads it: pinned when the device is a GPU."""
    return t.pin_memory() if torch.device(dev).type != "cpu" else t


def _kv(gen: torch.Generator, rows: int, row_bytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (rows, row_bytes), generator=gen, dtype=torch.uint8)


def _planned(gen, dev, lens, hot, k, row_bytes, steps=6, drift=6, dtype=torch.uint8, row_shape=None):
    """A step's plan (by the reference) for requests evolved ``steps`` steps, one layer's host KV, a device KV whose
    slots lie at random distinct rows, and ``device_loc``."""
    batches = len(lens)
    host_loc = _host_loc(gen, batches, max(lens))
    raw, tokens, ages = _evolved(gen, steps, lens, hot, k, host_loc, drift)
    p = hisparse.plan(raw, torch.tensor(lens, dtype=I32), host_loc, tokens, ages)
    device_rows = batches * (hot + 1) + 7
    device_loc = torch.randperm(device_rows, generator=gen)[:batches * (hot + 1)].view(batches, hot + 1).to(I32)
    host_kv = _kv(gen, batches * max(lens), row_bytes)
    device_kv = _kv(gen, device_rows, row_bytes)
    if dtype != torch.uint8:
        host_kv, device_kv = host_kv.view(dtype), device_kv.view(dtype)
    if row_shape is not None:
        host_kv, device_kv = host_kv.view(-1, *row_shape), device_kv.view(-1, *row_shape)
    return dict(copy_src=p.copy_src.to(dev), copy_dst=p.copy_dst.to(dev), copy_count=p.copy_count.to(dev),
                host_kv=_host(dev, host_kv), device_kv=device_kv.to(dev), device_loc=device_loc.to(dev))


def _shared_rows_plan(gen) -> tuple[hisparse.Plan, torch.Tensor, torch.Tensor]:
    """A plan of two requests (400 and 150 tokens, H 24, k 12) whose five rows share them, its ``row_to_batch`` and a
    ``device_loc`` among 60 device rows."""
    lens, hot, k = [400, 150], 24, 12
    host_loc = _host_loc(gen, 2, 400)
    _, tokens, ages = _evolved(gen, 3, lens, hot, k, host_loc, drift=4)
    r2b = torch.tensor([0, 0, 1, 1, 1], dtype=I32)
    raw = torch.stack([torch.randperm(n, generator=gen)[:k] for n in (400, 400, 150, 150, 150)]).to(I32)
    p = hisparse.plan(raw, torch.tensor(lens, dtype=I32), host_loc, tokens, ages, row_to_batch=r2b)
    return p, r2b, torch.randperm(60, generator=gen)[:2 * (hot + 1)].view(2, hot + 1).to(I32)


cases = CaseList("hisparse_swap_in")


@cases.add("a decode step's misses, 656-byte rows (DeepSeek's fp8 MLA KV), pinned host memory")
def _(gen, dev):
    return _planned(gen, dev, [300, 90, 1000, 40], 48, 16, 656)


@cases.add("bf16 rows [1, 576] (1152 bytes), int64 device rows")
def _(gen, dev):
    args = _planned(gen, dev, [200, 700], 32, 16, 1152, dtype=torch.bfloat16, row_shape=(1, 576))
    args["device_loc"] = args["device_loc"].long()
    return args


@cases.add("odd row bytes (6) and rows sharing a request")
def _(gen, dev):
    p, r2b, device_loc = _shared_rows_plan(gen)
    return dict(copy_src=p.copy_src.to(dev), copy_dst=p.copy_dst.to(dev), copy_count=p.copy_count.to(dev),
                host_kv=_host(dev, _kv(gen, 800, 6)), device_kv=_kv(gen, 60, 6).to(dev),
                device_loc=device_loc.to(dev), row_to_batch=r2b.to(dev))


@cases.add("adversarial copy lists: host rows negative and past host_kv, slots past device_loc, device rows -1 and "
           "past device_kv, counts below 0 and past k, rows naming no request")
def _(gen, dev):
    rows, k, batches, width = 6, 5, 3, 4
    copy_src = torch.randint(-3, 40, (rows, k), generator=gen, dtype=torch.int64)
    copy_src[0, 0], copy_src[1, 1] = 2**62, -2**62
    copy_dst = torch.randint(-2, width + 2, (rows, k), generator=gen, dtype=I32)
    copy_count = torch.tensor([5, 3, -4, 9, 2, 5], dtype=I32)
    device_loc = torch.randint(-1, 24, (batches, width), generator=gen, dtype=I32)
    device_loc[0, 0] = 2**31 - 1
    r2b = torch.tensor([0, 1, 2, 2, -1, 7], dtype=I32)
    return dict(copy_src=copy_src.to(dev), copy_dst=copy_dst.to(dev), copy_count=copy_count.to(dev),
                host_kv=_host(dev, _kv(gen, 30, 64)), device_kv=_kv(gen, 20, 64).to(dev),
                device_loc=device_loc.to(dev), row_to_batch=r2b.to(dev))


@cases.add("host KV already on the device")
def _(gen, dev):
    args = _planned(gen, dev, [300, 500], 40, 16, 128)
    args["host_kv"] = args["host_kv"].to(dev)
    return args


@cases.add("a producer group's four layers in one call (656-byte rows, pinned host memory holding a token's rows of "
           "the group together)")
def _(gen, dev):
    args = _planned(gen, dev, [300, 90, 1000, 40], 48, 16, 656)
    rows = args["host_kv"].shape[0]
    pool = _host(dev, _kv(gen, rows * 4, 656).view(rows, 4, 656))
    args["host_kv"] = [pool[:, g] for g in range(4)]
    args["device_kv"] = [args["device_kv"]] + [_kv(gen, *args["device_kv"].shape).to(dev) for _ in range(3)]
    return args


@cases.add("a group's layers in host pools of their own, of several lengths and strides (one with fewer host rows, "
           "one with none, rows in padded strides), rows sharing a request")
def _(gen, dev):
    p, r2b, device_loc = _shared_rows_plan(gen)
    host = [_kv(gen, 800, 24), _kv(gen, 500, 24), _kv(gen, 0, 24), _kv(gen, 800, 32)[:, :24], _kv(gen, 800, 24)]
    device = [_kv(gen, 60, 24), _kv(gen, 60, 24), _kv(gen, 60, 24), _kv(gen, 60, 24), _kv(gen, 70, 40)[:, 8:32]]
    return dict(copy_src=p.copy_src.to(dev), copy_dst=p.copy_dst.to(dev), copy_count=p.copy_count.to(dev),
                host_kv=[_host(dev, t.view(torch.int16)) for t in host],
                device_kv=[t.view(torch.int16).to(dev) for t in device], device_loc=device_loc.to(dev),
                row_to_batch=r2b.to(dev))


@cases.add("no copies")
def _(gen, dev):
    return dict(copy_src=torch.zeros(0, 4, dtype=torch.int64).to(dev), copy_dst=torch.zeros(0, 4, dtype=I32).to(dev),
                copy_count=torch.zeros(0, dtype=I32).to(dev), host_kv=_host(dev, _kv(gen, 3, 16)),
                device_kv=_kv(gen, 2, 16).to(dev), device_loc=torch.zeros(0, 5, dtype=I32).to(dev))


SPEC = OpSpec("hisparse_swap_in", check, reference, judge, tuple(cases))
