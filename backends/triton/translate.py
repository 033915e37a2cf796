"""Page translation in Triton: logical token positions → physical KV slots.

One program handles ``BLOCK_R × BLOCK_K`` indices. Every guard of the contract is part of the load
mask, so the page-table read never leaves the table whatever ``raw`` holds; powers of two take the
shift path. Any strides are accepted; nothing is allocated and nothing syncs with the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import triton
import triton.language as tl

from indexcache.backends.triton import support
from indexcache.backends.triton.launcher import Launch, Launcher, Options, bound, launch_key_options
from indexcache.backends.triton.support import launch_options, next_power_of_2, on_target_device
from indexcache.backends.triton.target import Target
from indexcache.hal.contract import OpImpl


@triton.jit
def physical(x, ok, seq, table_row, tab_s1, pages, page_size, SHIFT: tl.constexpr):
    """Physical slots of logical positions ``x`` (int32), -1 wherever ``ok`` is false, ``x < 0``,
    ``x >= seq``, the page is beyond the table or its entry is < 0. ``table_row`` points at the row's
    page-table row; ``ok`` must already hold the batch-range guard (the read is masked by all guards).
    ``SHIFT`` is log2(page_size) for powers of two, else -1."""
    if SHIFT >= 0:
        page = x >> SHIFT
        offset = x & ((1 << SHIFT) - 1)
    else:
        page = x // page_size
        offset = x % page_size
    ok = ok & (x >= 0) & (x < seq) & (page < pages)
    entry = tl.load(table_row + page.to(tl.int64) * tab_s1, mask=ok, other=-1)
    if SHIFT >= 0:
        slot = (entry << SHIFT) + offset
    else:
        slot = entry * page_size + offset
    return tl.where(ok & (entry >= 0), slot, -1)


# The row count, the table's shape and row stride take no part in the variant, nor do the addresses of the table and of
# the lengths and requests (read an entry at a time; docs/kernels.md, "Kernel variants").
@triton.jit(do_not_specialize=("rows", "batches", "pages", "tab_s0"),
            do_not_specialize_on_alignment=("table_ptr", "seq_ptr", "r2b_ptr"))
def translate_kernel(
    raw_ptr, table_ptr, seq_ptr, r2b_ptr, out_ptr,
    rows, k, batches, pages, page_size,
    raw_s0, raw_s1, tab_s0, tab_s1, seq_s0, r2b_s0, out_s0, out_s1,
    HAS_R2B: tl.constexpr, SHIFT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = r < rows
    inside = r_ok[:, None] & (j < k)[None, :]
    r64 = r.to(tl.int64)
    j64 = j.to(tl.int64)
    x = tl.load(raw_ptr + r64[:, None] * raw_s0 + j64[None, :] * raw_s1, mask=inside, other=-1)
    seq = tl.load(seq_ptr + r64 * seq_s0, mask=r_ok, other=0)
    if HAS_R2B:
        b = tl.load(r2b_ptr + r64 * r2b_s0, mask=r_ok, other=-1)
    else:
        b = r
    b_ok = (b >= 0) & (b < batches)
    table_row = table_ptr + b.to(tl.int64)[:, None] * tab_s0
    phys = physical(x, inside & b_ok[:, None], seq[:, None], table_row, tab_s1, pages, page_size, SHIFT)
    tl.store(out_ptr + r64[:, None] * out_s0 + j64[None, :] * out_s1, phys, mask=inside)


def page_shift(page_size: int) -> int:
    """log2(page_size) for powers of two (the shift path of :func:`physical`), else -1."""
    return page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else -1


TRANSLATE = Launcher(translate_kernel)


def translate_launches(raw, page_table, seq_lens, page_size, row_to_batch, out, *, target: Target,
                       cfg: Mapping[str, Any], options: Options | None = None) -> list[Launch]:
    """The launches that fill ``out [R, K]`` int32 (contract: ``indexcache.translate``): one, none when it is empty,
    and one for each ``MAX_GRID_Y`` blocks of columns of a row wider than that (a grid's second dimension holds no
    more), each over its columns' views; ``options``: the launch options of ``cfg`` for ``target`` as
    :func:`~indexcache.backends.triton.launcher.launch_key_options` gives them (computed when None; the backend
    computes them once)."""
    rows, k = raw.shape
    if rows == 0 or k == 0:
        return []
    # A program's tile follows k (the model's), never the row count: fewer rows only leave rows of it masked.
    block_k = min(cfg["BLOCK_K"], next_power_of_2(k))
    block_r = max(1, cfg["ELEMS"] // block_k)
    options = options or launch_key_options(launch_options(target, cfg))
    r2b = row_to_batch if row_to_batch is not None else seq_lens
    width = support.MAX_GRID_Y * block_k
    parts = [(raw, out)] if k <= width else [(raw[:, c:c + width], out[:, c:c + width]) for c in range(0, k, width)]
    tab_s0, tab_s1 = page_table.stride()
    return [Launch(
        TRANSLATE, (-(-rows // block_r), -(-part.shape[1] // block_k)), options,
        (part, page_table, seq_lens, r2b, part_out,
         rows, part.shape[1], page_table.shape[0], page_table.shape[1], page_size,
         *part.stride(), tab_s0, tab_s1, seq_lens.stride(0), r2b.stride(0), *part_out.stride()),
        dict(HAS_R2B=row_to_batch is not None, SHIFT=page_shift(page_size), BLOCK_R=block_r, BLOCK_K=block_k),
    ) for part, part_out in parts]


def translate(raw, page_table, seq_lens, page_size, row_to_batch, out, *, target: Target, cfg: Mapping[str, Any],
              options: Options | None = None):
    """Fill ``out [R, K]`` int32 (contract: ``indexcache.translate``); arguments as :func:`translate_launches`."""
    for launch in translate_launches(raw, page_table, seq_lens, page_size, row_to_batch, out, target=target, cfg=cfg,
                                     options=options):
        launch()
    return out


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """The translate op of a GPU backend built for ``target`` with its tuning table."""
    cfg = tuning["translate"]
    options = launch_key_options(launch_options(target, cfg))

    def supports(raw, page_table, seq_lens, row_to_batch, out, **_):
        return on_target_device(target, raw=raw, page_table=page_table, seq_lens=seq_lens,
                                row_to_batch=row_to_batch, out=out)

    def run(**args):
        return translate(**args, target=target, cfg=cfg, options=options)

    def prepare(**args):
        return bound(translate_launches(**args, target=target, cfg=cfg, options=options))

    return {"translate": OpImpl(run, supports, prepare)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What :func:`translate` builds for ``target`` (cross-compile check): the table's full tile (a smaller k or
    fewer rows only shrink it) with and without ``row_to_batch``, on the shift and the division path, for
    contiguous tensors (unit strides are specialised to constants, as a launch does)."""
    from indexcache.backends.triton.crosscompile import KernelSpec

    cfg = tuning["translate"]
    tile = {"BLOCK_R": max(1, cfg["ELEMS"] // cfg["BLOCK_K"]), "BLOCK_K": cfg["BLOCK_K"]}
    unit = {"raw_s1": 1, "tab_s1": 1, "seq_s0": 1, "r2b_s0": 1, "out_s1": 1}
    ptrs = {name: "*i32" for name in ("raw_ptr", "table_ptr", "seq_ptr", "r2b_ptr", "out_ptr")}
    return [KernelSpec("translate", translate_kernel, ptrs, {"HAS_R2B": r2b, "SHIFT": shift, **tile, **unit},
                       launch_options(target, cfg), aligned=("raw_s0", "out_s0"))
            for r2b in (False, True) for shift in (page_shift(64), -1)]
