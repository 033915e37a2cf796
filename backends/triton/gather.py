"""``gather_index_k`` in Triton: the paged index-K cache → contiguous keys and scales in request order.

A program copies blocks of ``BLOCK_T`` tokens of one request (grid: requests × a bounded number of programs a request,
each walking every such program count'th block up to the request's length, read on the device, or to the outputs'
end). A request's first row is the sum of the earlier requests' lengths, which each program adds up itself, ``BLOCK_B``
lengths at a time. Every read is masked by the token's page entry (in the table, in the cache) and every write by its
row (below the outputs' rows), whatever the table and the lengths hold; nothing is allocated and nothing syncs with the
host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from indexcache.backends.triton.launcher import Launch, Launcher, Options, bound, launch_key_options
from indexcache.backends.triton.support import cdiv, grid_y, launch_options, next_power_of_2, on_target_device
from indexcache.backends.triton.target import Target
from indexcache.hal import fp4
from indexcache.hal.contract import OpImpl
from indexcache.hal.layout import cache_page_size, scale_bytes


# The batch, the cache's and the table's sizes, the output rows and the row strides of the table and the scales take no
# part in the variant, nor do the addresses of the lengths and the table (docs/kernels.md, "Kernel variants").
@triton.jit(do_not_specialize=("batch", "num_pages", "table_pages", "rows", "tab_s0", "scale_s0"),
            do_not_specialize_on_alignment=("ctx_ptr", "table_ptr"))
def gather_index_k_kernel(
    cache_ptr, ctx_ptr, table_ptr, keys_ptr, scale_ptr,
    batch, num_pages, table_pages, rows,
    ctx_s0, tab_s0, tab_s1, keys_s0, keys_s1, scale_s0, scale_s1,
    PAGE: tl.constexpr, VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, FLOAT_SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Request ``program_id(0)``'s tokens ``t`` of the blocks ``program_id(1), + num_programs(1), …``: its value
    bytes to ``keys`` row ``start + t``, its scale (``FLOAT_SCALE``: one float32, NaN for a hole; else
    ``SCALE_BYTES`` e8m0 bytes, 255 for a hole) to ``scale`` row ``start + t``."""
    b = tl.program_id(0)
    first = tl.program_id(1)
    step = tl.num_programs(1)
    bs = tl.arange(0, BLOCK_B)
    start = tl.zeros([], tl.int64)
    for b0 in range(0, b, BLOCK_B):
        lens = tl.load(ctx_ptr + (b0 + bs).to(tl.int64) * ctx_s0, mask=b0 + bs < b, other=0)
        start += tl.sum(tl.maximum(lens, 0).to(tl.int64), axis=0)
    n = tl.maximum(tl.load(ctx_ptr + b.to(tl.int64) * ctx_s0), 0)
    # Only the tokens that have a row below ``rows``: a length past the outputs (garbage in a padded batch) would walk
    # blocks that write nothing, up to 2^26 of them. The block count in int64: near 2^31 it overflowed int32.
    n = tl.minimum(n.to(tl.int64), tl.maximum(rows - start, 0)).to(tl.int32)
    page_bytes: tl.constexpr = PAGE * (VALUE_BYTES + SCALE_BYTES)
    vb = tl.arange(0, BLOCK_V)
    sb = tl.arange(0, BLOCK_S)
    for c in range(first, tl.cdiv(n.to(tl.int64), BLOCK_T).to(tl.int32), step):
        t = c * BLOCK_T + tl.arange(0, BLOCK_T)
        row = start + t
        live = (t >= 0) & (t < n) & (row < rows)  # t wraps past 2^31 - 1 in a last block only
        column = t // PAGE
        entry = tl.load(table_ptr + b.to(tl.int64) * tab_s0 + column.to(tl.int64) * tab_s1,
                        mask=live & (column < table_pages), other=-1)
        valid = live & (entry >= 0) & (entry < num_pages)
        at = entry.to(tl.int64) * page_bytes + t % PAGE * VALUE_BYTES
        values = tl.load(cache_ptr + at[:, None] + vb[None, :], mask=valid[:, None] & (vb < VALUE_BYTES)[None, :],
                         other=0)
        tl.store(keys_ptr + row[:, None] * keys_s0 + vb.to(tl.int64)[None, :] * keys_s1, values,
                 mask=live[:, None] & (vb < VALUE_BYTES)[None, :])
        at = entry.to(tl.int64) * page_bytes + PAGE * VALUE_BYTES + t % PAGE * SCALE_BYTES
        if FLOAT_SCALE:
            scale = tl.load(cache_ptr.to(tl.pointer_type(tl.float32)) + at // 4, mask=valid, other=0.0)
            tl.store(scale_ptr + row * scale_s0, tl.where(valid, scale, float("nan")), mask=live)
        else:
            scale = tl.load(cache_ptr + at[:, None] + sb[None, :], mask=valid[:, None] & (sb < SCALE_BYTES)[None, :],
                            other=0)
            scale = tl.where(valid[:, None], scale, 255)  # e8m0 NaN
            tl.store(scale_ptr + row[:, None] * scale_s0 + sb.to(tl.int64)[None, :] * scale_s1, scale,
                     mask=live[:, None] & (sb < SCALE_BYTES)[None, :])


GATHER = Launcher(gather_index_k_kernel)
BLOCK_B = 1024  # lengths a step of a program's running sum


def _programs(block_table: torch.Tensor, page: int, block_t: int) -> int:
    """Programs a request: its table's tokens in blocks (at least one; a longer request's program takes more)."""
    return grid_y(cdiv(block_table.shape[1] * page, block_t))


def gather_launch(k_cache, block_table, context_lens, dim, fp8_dtype, out_k, out_scale, *, target: Target,
                  cfg: Mapping[str, Any], options: Options | None = None) -> Launch | None:
    """The launch filling ``out_k`` / ``out_scale`` (contract: ``indexcache.gather_index_k``), None when there is
    nothing to write."""
    batch, rows = context_lens.shape[0], out_k.shape[0]
    if batch == 0 or rows == 0:
        return None
    mxfp4 = fp8_dtype == fp4.FP4
    value_bytes, s_bytes = dim // 2 if mxfp4 else dim, scale_bytes(dim, fp8_dtype)
    num_pages, page = k_cache.shape[0], cache_page_size(k_cache, dim, fp8_dtype)
    cache = k_cache.view(-1)
    keys = out_k.view(torch.uint8)
    scale = out_scale.view(torch.uint8) if mxfp4 else out_scale.view(rows, 1)
    block_t = cfg["BLOCK_T"]
    options = options or launch_key_options(launch_options(target, cfg))
    return Launch(
        GATHER, (batch, _programs(block_table, page, block_t)), options,
        (cache, context_lens, block_table, keys, scale,
         batch, num_pages, block_table.shape[1], rows,
         context_lens.stride(0), block_table.stride(0), block_table.stride(1), keys.stride(0), keys.stride(1),
         scale.stride(0), scale.stride(1)),
        dict(PAGE=page, VALUE_BYTES=value_bytes, SCALE_BYTES=s_bytes, FLOAT_SCALE=not mxfp4, BLOCK_T=block_t,
             BLOCK_V=next_power_of_2(value_bytes), BLOCK_S=next_power_of_2(s_bytes), BLOCK_B=BLOCK_B),
    )


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """``gather_index_k`` of a GPU backend built for ``target`` with its tuning table."""
    cfg = tuning["gather_index_k"]
    options = launch_key_options(launch_options(target, cfg))

    def supports(k_cache, block_table, context_lens, out_k, out_scale, **_):
        return on_target_device(target, k_cache=k_cache, block_table=block_table, context_lens=context_lens,
                                out_k=out_k, out_scale=out_scale)

    def run(**args):
        launch = gather_launch(**args, target=target, cfg=cfg, options=options)
        if launch is not None:
            launch()
        return args["out_k"], args["out_scale"]

    def prepare(**args):
        return bound([gather_launch(**args, target=target, cfg=cfg, options=options)])

    return {"gather_index_k": OpImpl(run, supports, prepare)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What :func:`gather_launch` builds for ``target`` (cross-compile check): 64-token pages of D = 128 keys, fp8 and
    MXFP4, contiguous outputs."""
    from indexcache.backends.triton.crosscompile import KernelSpec

    cfg = tuning["gather_index_k"]
    specs = []
    for mxfp4 in (False, True):
        value_bytes, s_bytes = (64, 4) if mxfp4 else (128, 4)
        ptrs = {"cache_ptr": "*u8", "ctx_ptr": "*i32", "table_ptr": "*i32", "keys_ptr": "*u8",
                "scale_ptr": "*u8" if mxfp4 else "*fp32"}
        specs.append(KernelSpec(
            "gather_index_k", gather_index_k_kernel, ptrs,
            {"PAGE": 64, "VALUE_BYTES": value_bytes, "SCALE_BYTES": s_bytes, "FLOAT_SCALE": not mxfp4,
             "BLOCK_T": cfg["BLOCK_T"], "BLOCK_V": value_bytes, "BLOCK_S": s_bytes, "BLOCK_B": BLOCK_B,
             "ctx_s0": 1, "tab_s1": 1, "keys_s1": 1, "scale_s1": 1},
            launch_options(target, cfg), aligned=("keys_s0",)))
    return specs
