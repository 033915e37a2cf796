"""``hisparse_swap_in`` in Triton: the copies of a HiSparse plan, host rows into the device hot buffers of one layer
or of a producer group's layers in one launch (docs/hisparse.md, "One layer, or a group's layers"; the reference is
``indexcache.hal.hisparse.swap_in``).

Row ``r`` of the plan carries ``copy_count[r]`` copies (clamped to ``[0, k]``): host row ``copy_src[r, i]`` to device
row ``device_loc[b, copy_dst[r, i]]``, ``b = row_to_batch[r]`` (row ``r`` without it). A copy whose request, slot,
host row or device row lies outside its tensor is skipped; nothing else of ``device_kv`` is written.

The rows are copied as bytes (both KV tensors viewed as ``uint8`` rows of ``ROW_BYTES``), ``BLOCK_C`` copies a step
of a program: their indices, their device rows, then a ``[BLOCK_C, CHUNK]`` tile of bytes read and written at once.
A row's stride is passed in units of ``UNIT`` bytes (the largest power of two up to 16 dividing both strides), so
Triton knows every row start is ``UNIT``-aligned and moves 16-byte vectors where the row bytes and the tensors'
alignment allow (656-byte fp8 MLA rows and 1152-byte bf16 rows: 16; 6-byte rows: 2).

Grid: the rows of the plan × ``P`` programs a row, program ``(r, p)`` taking the row's blocks ``p, p + P, …`` up to
its count (read on the device), each block in every layer of the launch in turn (the copy lists read once for all).
``P`` is sized from the shape only (the GPU's multiprocessors times ``PROGRAMS_PER_SM``, spread over the rows, at
most the ``k / BLOCK_C`` blocks a row may have): a few rows with many copies still fill the GPU, and with many rows
each program walks a few blocks. Rows with fewer copies leave programs with nothing to do (they read the count and
end). What keeps the host link busy is the bytes in flight: every program's step reads ``BLOCK_C`` rows at once (5 KB
at 656-byte rows), and about ``SMs × PROGRAMS_PER_SM`` programs do so together.

A launch takes up to :data:`MAX_LAYERS` layers of a producer group whose host rows interleave: one allocation holding
a token's rows of the group together (token-major, SGLang's "page_first" host layout), so the group's reads of a
token fall on the same host pages. Each layer's two base addresses are arguments of their own (unused ones repeat
layer 0's), so a bound or graph-captured launch holds them as it holds any tensor's. Every other layer goes to a
launch of its own: measured on the H200, a group's reads spread over four host pools of their own ran at 0.42–0.45
of the link in one launch as in four (each token's rows in four places to translate), while four interleaved layers
in one launch reach 0.82 (docs/hisparse.md, "A group's layers on the H200").

The host KV may be a GPU tensor or pinned host memory: the kernel then reads the host memory directly, mapped into
the GPU's address space (unified addressing; Triton's launcher translates a pinned tensor's address with
``cuPointerGetAttribute`` / ``hipPointerGetAttribute``, and so does a bound launch of ours,
``launcher._address``). Interpreted, everything is on the CPU. Nothing is allocated and nothing syncs with the host;
the variant depends on the row bytes, the index dtypes and the tuning entry, not on the rows, requests, slots or
either tensor's length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from indexcache.backends.triton.launcher import Launch, Launcher, Options, bound, launch_key_options, planned_sms
from indexcache.backends.triton.support import cdiv, grid_y, launch_options, negated, next_power_of_2, on_target_device
from indexcache.backends.triton.target import Target
from indexcache.hal.contract import OpImpl

INTERPRETED_SMS = 3  # multiprocessors the grid is sized for under the interpreter
MAX_UNIT = 16  # the widest vector a thread moves, in bytes
MAX_LAYERS = 8  # layers a launch copies at most (each a host and a device address argument)


# The plan's width, the requests, slots, both tensors' rows and every stride that follows them take no part in the
# variant, nor do the addresses of the index tensors (docs/kernels.md, "Kernel variants").
@triton.jit(do_not_specialize=("k", "batch", "width", "host_rows", "dev_rows", "layers", "src_s0", "dst_s0",
                               "loc_s0", "host_su", "dev_su"),
            do_not_specialize_on_alignment=("src_ptr", "dst_ptr", "count_ptr", "loc_ptr", "r2b_ptr"))
def hisparse_swap_kernel(
    src_ptr, dst_ptr, count_ptr, loc_ptr, r2b_ptr,
    host0, host1, host2, host3, host4, host5, host6, host7, dev0, dev1, dev2, dev3, dev4, dev5, dev6, dev7,
    k, batch, width, host_rows, dev_rows, layers,
    src_s0, src_s1, dst_s0, dst_s1, count_s0, loc_s0, loc_s1, r2b_s0, host_su, dev_su,
    ROW_BYTES: tl.constexpr, CHUNK: tl.constexpr, UNIT: tl.constexpr, BLOCK_C: tl.constexpr, HAS_R2B: tl.constexpr,
    HOST_CACHE: tl.constexpr,
):
    """Row ``program_id(0)``'s copies in blocks ``program_id(1), + num_programs(1), …`` of ``BLOCK_C``, each block's
    in ``layers`` layers one after another (host ``host<g>``, device ``dev<g>``): host row ``src`` (``host_su * UNIT``
    bytes apart) to device row ``device_loc[b, slot]`` (``dev_su * UNIT`` apart), the ``ROW_BYTES`` bytes ``CHUNK`` at
    a time; every read and write masked by the copy's checks. ``HOST_CACHE``: the host reads' cache modifier (``""``
    the default, ``".cg"`` past L1, ``".cv"`` fetched again; the tuning table's ``HOST_CACHE``)."""
    r = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1)
    step = tl.num_programs(1)
    if HAS_R2B:
        b = tl.load(r2b_ptr + r * r2b_s0).to(tl.int64)
    else:
        b = r
    n = tl.minimum(tl.maximum(tl.load(count_ptr + r * count_s0), 0), k)
    n = tl.where((b >= 0) & (b < batch), n, 0)
    cs = tl.arange(0, BLOCK_C)
    bs = tl.arange(0, CHUNK)
    for c in range(first, tl.cdiv(n, BLOCK_C), step):
        i = (c * BLOCK_C + cs).to(tl.int64)
        live = i < n
        src = tl.load(src_ptr + r * src_s0 + i * src_s1, mask=live, other=-1).to(tl.int64)
        slot = tl.load(dst_ptr + r * dst_s0 + i * dst_s1, mask=live, other=-1).to(tl.int64)
        live = live & (slot >= 0) & (slot < width)
        row = tl.load(loc_ptr + b * loc_s0 + slot * loc_s1, mask=live, other=-1).to(tl.int64)
        ok = live & (src >= 0) & (src < host_rows) & (row >= 0) & (row < dev_rows)
        host_at = src * (host_su * UNIT)
        dev_at = row * (dev_su * UNIT)
        for g in range(layers):
            host_ptr = _layer(g, host0, host1, host2, host3, host4, host5, host6, host7)
            dev_ptr = _layer(g, dev0, dev1, dev2, dev3, dev4, dev5, dev6, dev7)
            for c0 in tl.static_range(0, ROW_BYTES, CHUNK):
                col = c0 + bs
                mask = ok[:, None] & (col < ROW_BYTES)[None, :]
                data = tl.load(host_ptr + host_at[:, None] + col[None, :], mask=mask, cache_modifier=HOST_CACHE)
                tl.store(dev_ptr + dev_at[:, None] + col[None, :], data, mask=mask)


@triton.jit
def _layer(g, p0, p1, p2, p3, p4, p5, p6, p7):
    """Pointer ``p<g>`` (``g`` in ``[0, MAX_LAYERS)``)."""
    p = tl.where(g == 1, p1, p0)
    p = tl.where(g == 2, p2, p)
    p = tl.where(g == 3, p3, p)
    p = tl.where(g == 4, p4, p)
    p = tl.where(g == 5, p5, p)
    p = tl.where(g == 6, p6, p)
    return tl.where(g == 7, p7, p)


SWAP = Launcher(hisparse_swap_kernel)


def as_rows(kv: torch.Tensor) -> torch.Tensor:
    """``kv [N, ...]`` as ``[N, row bytes]`` uint8 rows over the same memory (its rows must be contiguous)."""
    if not rows_contiguous(kv):
        raise ValueError(f"the KV rows must be contiguous (stride {tuple(kv.stride())})")
    row = 1
    for size in kv.shape[1:]:
        row *= size
    return kv.as_strided((kv.shape[0], row), (kv.stride(0), 1)).view(torch.uint8)


def rows_contiguous(kv: torch.Tensor) -> bool:
    """Whether each row ``kv[i]`` is contiguous (what :func:`as_rows` views as bytes without a copy)."""
    expected = 1
    for size, stride in reversed(list(zip(kv.shape[1:], kv.stride()[1:], strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def unit(*strides_bytes: int) -> int:
    """The largest power of two up to :data:`MAX_UNIT` dividing every row stride (in bytes)."""
    u = MAX_UNIT
    while u > 1 and any(s % u for s in strides_bytes):
        u //= 2
    return u


def _sms(target: Target, device: torch.device) -> int:
    """Multiprocessors the grid is sized for (the planned GPU's inside ``launcher.planning``)."""
    if target.interpreted:
        return INTERPRETED_SMS
    from indexcache.hal.device import sm_count

    return planned_sms() or sm_count(device.index or 0)


def programs_per_row(rows: int, k: int, sms: int, cfg: Mapping[str, Any]) -> int:
    """Programs a row: ``SMs × PROGRAMS_PER_SM`` over the rows, at least one, at most the row's blocks."""
    return grid_y(min(cdiv(sms * cfg["PROGRAMS_PER_SM"], rows), cdiv(k, cfg["BLOCK_C"])))


def layers(kv: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The layers of a swap-in's ``host_kv`` or ``device_kv``: one tensor, or each of a sequence."""
    return (kv,) if isinstance(kv, torch.Tensor) else tuple(kv)


def supports(target: Target, copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch=None,
             **_) -> list[str]:
    """Reasons this kernel cannot take the call (empty: none): the index tensors and every ``device_kv`` layer on the
    target's device; every ``host_kv`` layer there too or, on a GPU, in pinned host memory (read mapped); rows
    contiguous; none a negated view (:func:`~indexcache.backends.triton.support.negated`)."""
    reasons = on_target_device(target, copy_src=copy_src, copy_dst=copy_dst, copy_count=copy_count,
                               device_loc=device_loc, row_to_batch=row_to_batch)
    for g, (host, dev) in enumerate(zip(layers(host_kv), layers(device_kv), strict=True)):
        name = "" if isinstance(host_kv, torch.Tensor) else f"[{g}]"
        reasons += on_target_device(target, **{f"device_kv{name}": dev})
        if host.device.type == "cpu" and not target.interpreted:
            if not host.is_pinned():
                reasons.append(f"host_kv{name} is in pageable host memory: the kernel reads host memory only pinned "
                               "(tensor.pin_memory()), mapped into the GPU's address space")
            reasons += negated(**{f"host_kv{name}": host})
        else:
            reasons += on_target_device(target, **{f"host_kv{name}": host})
        for what, t in ((f"host_kv{name}", host), (f"device_kv{name}", dev)):
            if not rows_contiguous(t):
                reasons.append(f"{what}'s rows are not contiguous (stride {tuple(t.stride())})")
    return reasons


def _launch_groups(host: tuple[torch.Tensor, ...], dev: tuple[torch.Tensor, ...]) -> list[list[int]]:
    """The layers (byte rows, :func:`as_rows`) in launches: runs of up to :data:`MAX_LAYERS` consecutive layers whose
    host rows interleave (one row count and stride, and every layer's first row within the first layer's row stride:
    a token's rows of the group together in one host allocation) and whose device rows share one row count and
    stride; every other layer in a launch of its own."""

    def layout(g: int) -> tuple:
        return host[g].device, host[g].shape[0], host[g].stride(0), dev[g].shape[0], dev[g].stride(0)

    groups: list[list[int]] = []
    for g in range(len(host)):
        first = groups[-1][0] if groups else g
        gap = host[g].data_ptr() - host[first].data_ptr()
        if groups and len(groups[-1]) < MAX_LAYERS and layout(g) == layout(first) and 0 <= gap < host[first].stride(0):
            groups[-1].append(g)
        else:
            groups.append([g])
    return groups


def swap_launches(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch, *, target: Target,
                  cfg: Mapping[str, Any], options: Options | None = None) -> list[Launch]:
    """The launches doing the copies into every layer of ``device_kv`` (contract: module docstring), none where
    nothing could be copied."""
    rows, k = copy_src.shape
    batch, width = device_loc.shape
    host = tuple(as_rows(t) for t in layers(host_kv))
    dev = tuple(as_rows(t) for t in layers(device_kv))
    row_bytes = dev[0].shape[1]
    if 0 in (rows, k, batch, width, row_bytes):
        return []
    block_c = cfg["BLOCK_C"]
    chunk = min(next_power_of_2(row_bytes), cfg["CHUNK_BYTES"])
    r2b = copy_count if row_to_batch is None else row_to_batch
    options = options or launch_key_options(launch_options(target, cfg))
    sms = _sms(target, dev[0].device)
    launches = []
    programs = programs_per_row(rows, k, sms, cfg)
    for group in _launch_groups(host, dev):
        h0, d0 = host[group[0]], dev[group[0]]
        if 0 in (h0.shape[0], d0.shape[0]):
            continue
        u = unit(h0.stride(0), d0.stride(0))
        hosts = [host[g] for g in group] + [h0] * (MAX_LAYERS - len(group))
        devs = [dev[g] for g in group] + [d0] * (MAX_LAYERS - len(group))
        launches.append(Launch(
            SWAP, (rows, programs), options,
            (copy_src, copy_dst, copy_count, device_loc, r2b, *hosts, *devs,
             k, batch, width, h0.shape[0], d0.shape[0], len(group),
             copy_src.stride(0), copy_src.stride(1), copy_dst.stride(0), copy_dst.stride(1), copy_count.stride(0),
             device_loc.stride(0), device_loc.stride(1), r2b.stride(0), h0.stride(0) // u, d0.stride(0) // u),
            dict(ROW_BYTES=row_bytes, CHUNK=chunk, UNIT=u, BLOCK_C=block_c, HAS_R2B=row_to_batch is not None,
                 HOST_CACHE=cfg.get("HOST_CACHE", "")),
        ))
    return launches


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """``hisparse_swap_in(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch=None)`` of a
    GPU backend built for ``target``: every layer of ``device_kv`` written in place; returns ``device_kv``."""
    cfg = tuning["hisparse_swap_in"]
    options = launch_key_options(launch_options(target, cfg))

    def args_of(row_to_batch=None, **args):
        return dict(args, row_to_batch=row_to_batch)

    def run(**args):
        args = args_of(**args)
        for launch in swap_launches(**args, target=target, cfg=cfg, options=options):
            launch()
        return args["device_kv"]

    def prepare(**args):
        return bound(swap_launches(**args_of(**args), target=target, cfg=cfg, options=options))

    return {"hisparse_swap_in": OpImpl(run, lambda **args: supports(target, **args), prepare)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What :func:`swap_launches` builds for ``target`` (cross-compile check): DeepSeek's fp8 MLA rows (656 bytes:
    512 fp8 values, 4 fp32 scales, 64 bf16 rope values) and bf16 rows of 576 values (1152 bytes), contiguous KV
    tensors, an int32 and an int64 ``device_loc``, with and without ``row_to_batch``."""
    from indexcache.backends.triton.crosscompile import KernelSpec

    cfg = tuning["hisparse_swap_in"]
    specs = []
    for row_bytes, loc, has_r2b in ((656, "*i32", True), (656, "*i64", False), (1152, "*i32", False),
                                    (1152, "*i64", True)):
        ptrs = {"src_ptr": "*i64", "dst_ptr": "*i32", "count_ptr": "*i32", "loc_ptr": loc, "r2b_ptr": "*i32",
                **{f"{side}{g}": "*u8" for side in ("host", "dev") for g in range(MAX_LAYERS)}}
        specs.append(KernelSpec(
            "hisparse_swap_in", hisparse_swap_kernel, ptrs,
            {"ROW_BYTES": row_bytes, "CHUNK": min(next_power_of_2(row_bytes), cfg["CHUNK_BYTES"]),
             "UNIT": unit(row_bytes), "BLOCK_C": cfg["BLOCK_C"], "HAS_R2B": has_r2b,
             "HOST_CACHE": cfg.get("HOST_CACHE", ""),
             "src_s1": 1, "dst_s1": 1, "count_s0": 1, "loc_s1": 1, "r2b_s0": 1},
            launch_options(target, cfg)))
    return specs
