"""What the GPU backends register and build of the top-k: the ``topk`` and ``topk_translate`` ops
(:func:`ops`) and the kernels' configurations for the cross-compile check (:func:`compile_specs`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.backends.triton.launcher import bound
from indexcache.backends.triton.support import launch_options, on_target_device, uses_pdl
from indexcache.backends.triton.target import Target
from indexcache.backends.triton.topk import block as topk_block
from indexcache.backends.triton.topk.kernels import (
    MAX_COLS,
    MAX_SORTED_K,
    topk_filter_kernel,
    topk_finish_kernel,
    topk_rows_kernel,
    topk_sample_kernel,
    topk_sort_kernel,
)
from indexcache.backends.triton.topk.plan import (
    FINISH_SKIM,
    Settings,
    ahead_samples,
    ahead_warps_key,
    filter_shape,
    finish_shape,
    launches,
    own_options,
    rows_options,
    sample_size,
    sort_warps,
    split_chunk,
    topk,
    topk_translate,
    with_pdl,
    workspace_bytes,
)
from indexcache.backends.triton.translate import page_shift
from indexcache.hal.contract import OpImpl

# AMD SGPRs the finishing kernel may spill into VGPR lanes (crosscompile.MAX_SGPR_SPILLS passes 32): built by Triton 3.6
# (torch 2.11's) for gfx942, bf16 scores translated through a table with row_to_batch spill 33-34 (both pointer spans,
# 2026-12-07; no scratch, no VGPR spill), where Triton 3.9 spills 11-18.
FINISH_SGPR_SPILLS = 40


def _supports(target: Target, scores, k, sorted, **tensors) -> list[str]:
    reasons = on_target_device(target, scores=scores, **tensors)
    if sorted and k > MAX_SORTED_K:
        reasons.append(f"sorted=True takes k <= {MAX_SORTED_K} in the Triton top-k (a row sorted in registers), "
                       f"got {k}")
    if scores.shape[1] > MAX_COLS:
        reasons.append(f"rows longer than {MAX_COLS} columns are not supported by the Triton top-k")
    return reasons


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """The topk and topk_translate ops of a GPU backend built for ``target`` with its tuning table."""
    cfg = tuning["topk"]
    settings = Settings.of(target, cfg)

    def supports_topk(scores, lengths, k, row_starts, out, sorted, **_):
        return _supports(target, scores, k, sorted, lengths=lengths, row_starts=row_starts, out=out)

    def supports_translate(scores, lengths, k, row_starts, out, sorted, page_table, row_to_batch, out_raw, **_):
        return _supports(target, scores, k, sorted, lengths=lengths, row_starts=row_starts, out=out,
                         page_table=page_table, row_to_batch=row_to_batch, out_raw=out_raw)

    def run_topk(**args):
        return topk(**args, target=target, cfg=cfg, settings=settings)

    def run_translate(**args):
        return topk_translate(**args, target=target, cfg=cfg, settings=settings)

    def prepare_topk(scores, lengths, k, row_starts, out, sorted, workspace=None):
        return bound([launch for _, launch in launches(scores, lengths, k, row_starts, out, None, None, 1, None,
                                                       sorted=sorted, workspace=workspace, target=target, cfg=cfg,
                                                       settings=settings)])

    def prepare_translate(scores, lengths, k, page_table, page_size, row_starts, row_to_batch, out, out_raw, sorted,
                          workspace=None):
        return bound([launch for _, launch in launches(scores, lengths, k, row_starts, out, out_raw, page_table,
                                                       page_size, row_to_batch, sorted=sorted, workspace=workspace,
                                                       target=target, cfg=cfg, settings=settings)])

    def workspace_of(scores, k, **_):
        return workspace_bytes(scores, k, target=target, cfg=cfg, settings=settings)

    return {"topk": OpImpl(run_topk, supports_topk, prepare_topk, workspace_of),
            "topk_translate": OpImpl(run_translate, supports_translate, prepare_translate, workspace_of)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What the top-k kernels build for ``target`` (cross-compile check), with the table's tile and histogram:
    plain fp32 topk with k = 1 (an int argument of 1 arrives as a constant, as a launch specialises it); the
    producer step on bf16 with every option (row_starts, row_to_batch, out_raw, shift path); fp16 strided
    scores with row_starts and a non-power-of-two page size; the sort of ``sorted=True`` on each, at k 2048 and
    (fp32) at its largest k. Unit strides of the index tensors are specialised to constants, as a launch does."""
    from indexcache.backends.triton.crosscompile import KernelSpec, pointer

    cfg = tuning["topk"]
    opts = dict(rows_options(target, cfg))
    fin_tile, fin_opts = finish_shape(target, cfg)
    fin_opts = dict(fin_opts)
    pdl = uses_pdl(target, cfg)
    chunk = split_chunk(64, 1 << 17, 132, cfg)  # decode's 64 rows of 128K keys on an H200-sized GPU
    lanes, pack, filter_opts = filter_shape(target, chunk, cfg)
    shape = {"BITS": cfg["BITS"], "TILE": cfg["TILE"]}
    unit = {"len_s0": 1, "st_s0": 1, "o_s1": 1, "w_s1": 1, "r2b_s0": 1, "tab_s1": 1}
    aligned = ("s_s0", "o_s0", "w_s0")  # tab_s0, as every size of a call, is not specialized
    variants = (  # dtype, HAS_STARTS, HAS_R2B, TRANSLATE, HAS_RAW, SHIFT, CONTIG
        (torch.float32, False, False, False, False, 0, True),
        (torch.bfloat16, True, True, True, True, page_shift(64), True),
        (torch.float16, True, False, True, False, -1, False),
    )
    index_ptrs = {name: "*i32" for name in ("lengths_ptr", "starts_ptr", "out_ptr", "raw_ptr", "r2b_ptr", "table_ptr",
                                            "stash_ptr", "region_ptr", "counts_ptr",
                                            "hist_ptr")}
    specs = []
    for dtype, starts, r2b, translate, has_raw, shift, contig in variants:
        ptrs = {**index_ptrs, "scores_ptr": pointer(dtype)}
        flags = {"HAS_STARTS": starts, "CONTIG": contig, **shape, **({"s_s1": 1} if contig else {})}
        k_one = {} if translate else {"k": 1}
        full = {**flags, "HAS_R2B": r2b, "TRANSLATE": translate, "HAS_RAW": has_raw, "SHIFT": shift,
                "DIGIT": cfg["DIGIT"], **unit, **k_one}
        op = "topk_translate" if translate else "topk"
        scan = {**{n: v for n, v in flags.items() if n not in ("BITS", "TILE")}, "len_s0": 1, "st_s0": 1,
                "DIGIT": cfg["DIGIT"], "PDL": pdl, **k_one}
        sampled = {**scan, "ROUNDS": cfg.get("SAMPLE_ROUNDS", 0)}  # the sample launch's own arguments
        sample_opts = dict(with_pdl(own_options(target, cfg, "SAMPLE_WARPS"), pdl))
        specs.append(KernelSpec(op, topk_sample_kernel, ptrs,
                                {**sampled, "SAMPLES": cfg["SAMPLE"], "BINS": cfg["FINISH_BINS"], "COUNTS": True},
                                sample_opts, aligned=("s_s0",)))
        specs.append(KernelSpec(op, topk_filter_kernel, ptrs,
                                {**{n: v for n, v in flags.items() if n not in ("BITS", "TILE")}, "LANES": lanes,
                                 "PACK": pack, "BINS": cfg["FINISH_BINS"], "len_s0": 1, "st_s0": 1, "PDL": pdl,
                                 **k_one},
                                dict(with_pdl(filter_opts, pdl)), aligned=("s_s0", "chunk")))
        specs.append(KernelSpec(op, topk_rows_kernel, ptrs, {**full, "SAMPLES": min(cfg["SAMPLE"], 2 * cfg["TILE"])},
                                opts, aligned=aligned))
        # After the fused rows or the block kernel; after the split rows' filter where the table spreads its finish.
        for spread in (False, True) if cfg["FINISH_TIES"] else (False,):
            specs.append(KernelSpec(op, topk_finish_kernel, ptrs,
                                    dict(full, TILE=fin_tile, BLOCK_S=cfg["GATHER_CHUNKS"], BINS=cfg["FINISH_BINS"],
                                         PDL=pdl, SPREAD=spread, TIES=cfg["FINISH_TIES"], SKIM=FINISH_SKIM), fin_opts,
                                    aligned=aligned, sgpr_spills=FINISH_SGPR_SPILLS))
        width = MAX_SORTED_K if dtype == torch.float32 else 2048  # sorted=True at its largest k and at DSA's
        sort = {n: v for n, v in full.items() if n not in ("BITS", "TILE", "DIGIT", "k")}
        specs.append(KernelSpec(op, topk_sort_kernel, ptrs, dict(sort, K_P2=width),
                                launch_options(target, dict(cfg, num_warps=sort_warps(width, cfg))), aligned=aligned))
        if cfg.get("KERNEL") == "block" and topk_block.builds_for(target):  # the Gluon kernel at decode's 128K
            block = topk_block.shape(1 << 17, 2048, sample_size(1 << 17, 2048, cfg), cfg)
            flags = {name: value for name, value in full.items() if name not in ("BITS", "TILE")}
            # Sampling in the block (decode's rows), and reading the rows' records (many rows) after the sample
            # launch without counts.
            for floors in dict.fromkeys((0, cfg.get("BLOCK_FLOORS", 0))):
                specs.append(KernelSpec(op, topk_block.topk_block_kernel, {**ptrs, "floors_ptr": "*i32"},
                                        {**flags, **(topk_block.sampled_ahead(block, floors) if floors else block),
                                         "PDL": pdl},
                                        dict(topk_block.options({**block, "PDL": pdl})), aligned=aligned,
                                        stack_bytes=topk_block.STACK_BYTES))
            if cfg.get("BLOCK_FLOORS", 0):
                specs.append(KernelSpec(op, topk_sample_kernel, ptrs,
                                        {**sampled, "SAMPLES": ahead_samples(1 << 17, 2048, block, cfg),
                                         "BINS": topk_block.BINS, "COUNTS": False},
                                        dict(with_pdl(own_options(target, cfg, ahead_warps_key(cfg)), pdl)),
                                        aligned=("s_s0",)))
    return specs
