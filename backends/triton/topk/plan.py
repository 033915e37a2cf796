"""Host launch planning of the top-k: how a call's rows are taken (fused rows, the Gluon block kernel or split
rows), the workspace it needs and its launches in order, from the shape, the target and the tuning only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from indexcache.backends.triton import workspace as workspaces
from indexcache.backends.triton.launcher import (
    Launch,
    Launcher,
    Options,
    launch_key_options,
    persistent_programs,
    planned_sms,
    sm_budget,
)
from indexcache.backends.triton.support import cdiv, launch_options, next_power_of_2, uses_pdl
from indexcache.backends.triton.target import Target
from indexcache.backends.triton.topk import block as topk_block
from indexcache.backends.triton.topk.kernels import (
    topk_filter_kernel,
    topk_finish_kernel,
    topk_rows_kernel,
    topk_sample_kernel,
    topk_sort_kernel,
)
from indexcache.backends.triton.translate import page_shift
from indexcache.hal.device import sm_count

# A finishing program reads its next FINISH_SKIM rows' counts at once, to pass over the rows the first launch finished
# (H200, 4096 rows of 32K all finished by the block kernel: the finishing launch 3.5 µs against 12.8 reading a row's
# count after another; docs/kernels.md, "Rows sampled ahead").
FINISH_SKIM = 32
ROWS, SAMPLE, FILTER = Launcher(topk_rows_kernel), Launcher(topk_sample_kernel), Launcher(topk_filter_kernel)
FINISH, SORT = Launcher(topk_finish_kernel), Launcher(topk_sort_kernel)


def multiprocessors(target: Target, device: torch.device) -> int:
    """Multiprocessors (CUs on AMD) of the device (of the planned one inside ``launcher.planning``); 1 when
    interpreted."""
    return 1 if target.interpreted else planned_sms() or sm_count(device.index if device.index is not None else 0)


def rows_options(target: Target, cfg: Mapping[str, Any]) -> Options:
    """Launch options of the fused rows kernel (with ``maxnreg`` on NVIDIA: ptxas otherwise spills a few cold values
    on some targets to fit two programs an SM)."""
    return launch_key_options(launch_options(target, cfg))


def own_options(target: Target, cfg: Mapping[str, Any], warps_key: str, maxnreg_key: str | None = None) -> Options:
    """Launch options of a kernel with warps of its own (``cfg[warps_key]``, the pass's warps by default) and no
    register cap but ``cfg[maxnreg_key]`` where that is given."""
    # Of the table's entries only those launch_options reads (not the whole table: every launch builds these).
    keys = ("num_warps", "num_stages", *target.gpu.vendor.launch_keys)
    own = {key: cfg[key] for key in keys if key in cfg and key != "maxnreg"}
    own["num_warps"] = cfg.get(warps_key, cfg["num_warps"])
    if maxnreg_key in cfg:
        own["maxnreg"] = cfg[maxnreg_key]
    return launch_key_options(launch_options(target, own))


def finish_shape(target: Target, cfg: Mapping[str, Any]) -> tuple[int, Options]:
    """Tile and launch options of the finishing kernel (``FINISH_TILE`` values over ``FINISH_WARPS`` warps; the
    pass tile and warps by default; ``FINISH_MAXNREG`` registers on NVIDIA, where ptxas otherwise caps itself at 128
    and spills; ``launch_pdl`` where :func:`uses_pdl`): a wide tile holds a typical stash in registers and cuts the
    serial L2 round trips of the rounds over it."""
    return (cfg.get("FINISH_TILE", cfg["TILE"]),
            with_pdl(own_options(target, cfg, "FINISH_WARPS", "FINISH_MAXNREG"), uses_pdl(target, cfg)))


def split_chunk(rows: int, cols: int, sms: int, cfg: Mapping[str, Any], budget: int | None = None) -> int:
    """Columns per chunk when rows are split across programs, or 0 to run the fused one-program-per-row kernel.

    From the shape, the multiprocessor count and the tuning only: rows get about ``CHUNKS_PER_SM`` chunks an
    SM in all, of at least ``MIN_CHUNK`` columns (``CHUNK`` > 0 forces a chunk length); a power of two, at least
    a tile (the filter's lanes own equal shares of it). Under an SM budget of ``budget`` programs a row takes at
    most ``budget // rows`` chunks (so the split launches run at most ``budget`` programs), and rows are not split
    where fewer than two fit."""
    per_row = cdiv(sms * cfg["CHUNKS_PER_SM"], max(rows, 1))
    if budget is not None:
        per_row = budget // max(rows, 1) if cfg.get("CHUNK", 0) else min(per_row, budget // max(rows, 1))
        if per_row <= 1:
            return 0
    if cfg.get("CHUNK", 0):
        chunk = cfg["CHUNK"] if budget is None else max(cfg["CHUNK"], cdiv(cols, per_row))
    else:
        if per_row <= 1:
            return 0
        chunk = max(cfg["MIN_CHUNK"], cdiv(cols, per_row))
    chunk = next_power_of_2(max(chunk, cfg["TILE"]))
    return chunk if chunk < cols else 0


def filter_shape(target: Target, chunk: int, cfg: Mapping[str, Any]) -> tuple[int, int, Options]:
    """``(lanes, pack, options)`` of the split filter: a lane a thread (``FILTER_WARPS`` warps, the pass's warps by
    default), pieces of ``FILTER_PACK`` reads of ``lanes`` adjacent columns, both cut to fit ``chunk``."""
    return (*filter_tile(target, chunk, cfg), own_options(target, cfg, "FILTER_WARPS"))


def filter_tile(target: Target, chunk: int, cfg: Mapping[str, Any]) -> tuple[int, int]:
    """``(lanes, pack)`` of :func:`filter_shape`."""
    lanes = min(target.warp_size * cfg.get("FILTER_WARPS", cfg["num_warps"]), chunk)
    return lanes, max(1, min(cfg.get("FILTER_PACK", 8), chunk // lanes))


def gather_chunks(chunks: int, cfg: Mapping[str, Any]) -> int:
    """Chunks the finish reads side by side (a power of two, at most ``GATHER_CHUNKS`` and the chunks of a row, so
    that few rows of its tile stand empty)."""
    return max(1, min(cfg["GATHER_CHUNKS"], 1 << (max(chunks, 1).bit_length() - 1)))


def stash_capacity(cols: int, k: int, cfg: Mapping[str, Any]) -> int:
    """Tie-stash entries a row: the most of ``STASH``, ``STASH_PER_K`` × k and columns >> ``STASH_COLS_SHIFT`` (a
    coarse bin holds more entries in longer rows), never more than the row holds (powers of two)."""
    width = next_power_of_2(max(cols, 1))
    want = max(cfg["STASH"], cfg["STASH_PER_K"] * next_power_of_2(k), width >> cfg["STASH_COLS_SHIFT"])
    return min(want, width)


def sample_size(cols: int, k: int, cfg: Mapping[str, Any], rank: int | None = None) -> int:
    """Entries sampled a row: enough that about ``SAMPLE_RANK`` (``rank`` where given) of them are expected at or
    above the k-th best of a full row, a power of two between 64 and ``SAMPLE`` (a longer row with a small k is
    sampled more thinly: the threshold's safety margin then keeps more candidates)."""
    want = next_power_of_2(cdiv((cfg["SAMPLE_RANK"] if rank is None else rank) * cols, max(k, 1)))
    return max(64, min(want, cfg["SAMPLE"]))


def ahead_samples(cols: int, k: int, block: Mapping[str, Any], cfg: Mapping[str, Any]) -> int:
    """Entries the sample launch takes a row sampled ahead of the block kernel: the block kernel's own sample (a
    power of two, at least one a thread of the block), or with ``AHEAD_SAMPLE_RANK`` > 0 :func:`sample_size` at
    that rank (fewer at short rows: the launch is not held to the block's threads)."""
    rank = cfg.get("AHEAD_SAMPLE_RANK", 0)
    return sample_size(cols, k, cfg, rank) if rank > 0 else topk_block.samples(block)


def ahead_warps_key(cfg: Mapping[str, Any]) -> str:
    """The tuning key of the sample launch's warps for rows sampled ahead: ``AHEAD_SAMPLE_WARPS`` where the table sets
    it (> 0), else ``SAMPLE_WARPS`` (the split rows' sample of up to ``SAMPLE`` entries keeps its own)."""
    return "AHEAD_SAMPLE_WARPS" if cfg.get("AHEAD_SAMPLE_WARPS", 0) > 0 else "SAMPLE_WARPS"


@dataclass(frozen=True)
class Settings:
    """What a call's launches take of the target and the top-k's tuning entry alone (:meth:`of`), worked out once: a
    backend's ops keep theirs, so that a call of a new shape reads them instead of working them out of the table
    again. The dicts are constexprs a launch takes beside the call's own (read, never changed)."""

    target: Target
    cfg: Mapping[str, Any]
    pdl: bool  # :func:`uses_pdl`
    block: bool  # the Gluon kernel takes the calls of a k up to ``topk_block.MAX_K`` (``topk_block.unavailable``)
    rows_options: Options  # :func:`rows_options`
    finish_options: Options  # :func:`finish_shape`'s
    sample_options: Options  # the split rows' sample launch (``SAMPLE_WARPS``), with ``launch_pdl`` where ``pdl``
    ahead_options: Options  # the sample launch of rows sampled ahead (:func:`ahead_warps_key`), likewise
    filter_options: Options  # the split filter's (:func:`filter_shape`), likewise
    block_options: Options  # the Gluon kernel's (``topk_block.options``; none where ``block`` is False)
    rows_named: dict[str, Any]  # the fused rows kernel's DIGIT, BITS and TILE
    finish_named: dict[str, Any]  # the finishing kernel's, but for BLOCK_S and SPREAD
    sample_named: dict[str, Any]  # the sample kernel's DIGIT, PDL and ROUNDS
    filter_named: dict[str, Any]  # the filter's BINS and PDL

    @classmethod
    def of(cls, target: Target, cfg: Mapping[str, Any]) -> Settings:
        """The settings of the top-k's tuning entry ``cfg`` on ``target``."""
        pdl = uses_pdl(target, cfg)
        block = not topk_block.unavailable(target, cfg)
        fin_tile, fin_opts = finish_shape(target, cfg)
        digit, bins = cfg["DIGIT"], cfg["FINISH_BINS"]
        return cls(target, cfg, pdl, block, rows_options(target, cfg), fin_opts,
                   with_pdl(own_options(target, cfg, "SAMPLE_WARPS"), pdl),
                   with_pdl(own_options(target, cfg, ahead_warps_key(cfg)), pdl),
                   with_pdl(own_options(target, cfg, "FILTER_WARPS"), pdl),
                   topk_block.options({"NUM_WARPS": cfg["BLOCK_WARPS"], "PDL": pdl}) if block else (),
                   {"DIGIT": digit, "BITS": cfg["BITS"], "TILE": cfg["TILE"]},
                   {"DIGIT": digit, "BITS": cfg["BITS"], "TILE": fin_tile, "BINS": bins, "PDL": pdl,
                    "TIES": cfg["FINISH_TIES"], "SKIM": FINISH_SKIM},
                   {"DIGIT": digit, "PDL": pdl, "ROUNDS": cfg.get("SAMPLE_ROUNDS", 0)},
                   {"BINS": bins, "PDL": pdl})


def _row_args(scores, lengths, row_starts, out, out_raw, page_table, page_size,
              row_to_batch) -> tuple[tuple, dict, dict]:
    """``((starts, raw, r2b, table), scan, args)``: the row kernels' tensors besides scores, lengths and out (an absent
    one stood in by a tensor of the call that is never read), then what the sample and filter kernels take of their
    strides and flags, then all of the strides, flags and the table's shape as the other kernels take them."""
    translate = page_table is not None
    s_s0, s_s1 = scores.stride()
    len_s0 = lengths.stride(0)
    o_s0, o_s1 = out.stride()
    scan = dict(s_s0=s_s0, s_s1=s_s1, len_s0=len_s0,
                st_s0=row_starts.stride(0) if row_starts is not None else len_s0, HAS_STARTS=row_starts is not None,
                CONTIG=s_s1 == 1)
    w_s0, w_s1 = out_raw.stride() if out_raw is not None else (o_s0, o_s1)
    tab_s0, tab_s1 = page_table.stride() if translate else (o_s0, o_s1)
    args = dict(
        scan, o_s0=o_s0, o_s1=o_s1, w_s0=w_s0, w_s1=w_s1,
        r2b_s0=row_to_batch.stride(0) if row_to_batch is not None else len_s0, tab_s0=tab_s0, tab_s1=tab_s1,
        HAS_R2B=row_to_batch is not None, TRANSLATE=translate, HAS_RAW=out_raw is not None,
        SHIFT=page_shift(page_size) if translate else 0, batches=page_table.shape[0] if translate else 0,
        pages=page_table.shape[1] if translate else 0, page_size=page_size if translate else 1,
    )
    tensors = (row_starts if row_starts is not None else lengths, out_raw if out_raw is not None else out,
               row_to_batch if row_to_batch is not None else lengths, page_table if translate else out)
    return tensors, scan, args


class _Plan(NamedTuple):
    """How a call's rows are taken, from the shape, the target and the tuning only: the Gluon kernel's shape (or
    None), the split rows' chunk (0: not split) and chunks a row, the stash entries a row, the programs of the row
    and finishing launches, and the workspace's pieces in int32 words (candidate regions, chunk counts, bin counts,
    stashes)."""

    block: dict[str, Any] | None
    chunk: int
    chunks: int
    cap: int
    row_programs: int
    finish_programs: int
    words: tuple[int, int, int, int]


def shape_plan(rows: int, cols: int, device: torch.device, k: int, target: Target, cfg: Mapping[str, Any],
               settings: Settings | None = None) -> _Plan:
    """:func:`call_plan` of scores ``[rows, cols]`` on ``device``, from the shape alone (a caller that sizes a
    workspace for scores it has yet to make, such as the prefill producer's passes); ``settings``: those of ``target``
    and ``cfg`` (worked out here when None)."""
    block_kernel = (settings or Settings.of(target, cfg)).block
    sms = multiprocessors(target, device)
    budget = sm_budget(sms)
    # The Gluon block-a-row kernel (block.py) takes rows of up to BLOCK_MAX_COLS columns: those the fused kernel
    # would, and, from BLOCK_MIN_ROWS rows on, those that would be split (unless CHUNK forces the split). Longer rows
    # it finishes slowly (H200, 1M columns: 8.3 ms for 480 rows against the fused kernel's 2.4, 16.5 against 9.1
    # for 2048; docs/kernels.md).
    block = (topk_block.shape(cols, k, sample_size(cols, k, cfg), cfg)
             if block_kernel and k <= topk_block.MAX_K and cols <= cfg.get("BLOCK_MAX_COLS", cols) else None)
    take_split = block and not cfg.get("CHUNK") and rows >= cfg["BLOCK_MIN_ROWS"]
    chunk = 0 if take_split else split_chunk(rows, cols, sms, cfg, budget)
    block = None if chunk else block
    if block and budget is None and rows >= cfg.get("BLOCK_SAMPLE_ROWS", rows + 1):
        # Many rows: sampled ahead by a launch of their own, a program a row (so not under an SM budget), the block
        # kernel reading each row's threshold (FLOORS; docs/kernels.md, "Rows sampled ahead").
        block = topk_block.sampled_ahead(block, cfg["BLOCK_FLOORS"])
    cap = topk_block.capacity(block) if block else stash_capacity(cols, k, cfg)
    chunks = cdiv(cols, chunk) if chunk else 1
    per_sm = cfg["BLOCK_PER_SM" if block else "PROGRAMS_PER_SM"]
    row_programs = 0 if chunk else min(rows, persistent_programs(sms, per_sm))
    finish_programs = min(rows, persistent_programs(sms, 1))
    per_program = max(2 * cap, topk_block.workspace(block) if block else 0)  # a stash (and bin counts) a program
    # Each piece a multiple of 16 words, so every piece starts 64-byte aligned where the workspace does: the
    # kernels keep their aligned accesses in one variant, whatever the shape.
    words = tuple(cdiv(n, 16) * 16 for n in (rows * chunks * 2 * chunk, rows * chunks,
                                              rows * (cfg["FINISH_BINS"] + 2) if chunk else
                                              2 * rows if block and block["FLOORS"] else 0,
                                              max(row_programs, finish_programs) * per_program))
    return _Plan(block, chunk, chunks, cap, row_programs, finish_programs, words)


def workspace_bytes(scores: torch.Tensor, k: int, *, target: Target, cfg: Mapping[str, Any],
                    settings: Settings | None = None) -> int:
    """The workspace bytes of a call selecting ``k`` of each row of ``scores [R, N]`` (``sorted`` or not): on split
    rows about twice the bytes of fp32 scores (candidates' keys kept beside their positions), else a stash a
    program; 0 when there are no rows or ``k`` is 0. ``settings`` as :func:`shape_plan`."""
    return shape_workspace_bytes(*scores.shape, scores.device, k, target=target, cfg=cfg, settings=settings)


def shape_workspace_bytes(rows: int, cols: int, device: torch.device, k: int, *, target: Target,
                          cfg: Mapping[str, Any], settings: Settings | None = None) -> int:
    """:func:`workspace_bytes` of scores ``[rows, cols]`` on ``device``, from the shape alone."""
    return 0 if rows == 0 or k == 0 else 4 * sum(shape_plan(rows, cols, device, k, target, cfg, settings).words)


def call_plan(scores: torch.Tensor, k: int, *, target: Target, cfg: Mapping[str, Any],
              settings: Settings | None = None) -> _Plan:
    """How an unsorted call over ``scores [R, N]`` (R and ``k`` above 0) is taken: the plan :func:`launches` follows,
    whose ``words`` are the call's workspace (4 bytes each). A caller that sizes the workspace first hands it to
    :func:`launches` (``plan=``), which then does not work it out again. ``settings`` as :func:`shape_plan`."""
    return shape_plan(*scores.shape, scores.device, k, target, cfg, settings)


def launches(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch, *, sorted=False,
             workspace: torch.Tensor | None = None, target: Target, cfg: Mapping[str, Any],
             plan: _Plan | None = None, settings: Settings | None = None) -> list[tuple[str, Launch]]:
    """The kernel launches of one call, in order, as ``(name, launch)``: the fused kernel (many rows) or the
    split rows' sample and filter, then the finishing kernel; with ``sorted``, those select raw positions
    (into ``out_raw`` when given, else ``out``) and a sort launch orders and translates them. Arguments as
    :func:`topk_translate` (``page_table`` None for plain top-k); the workspace (``workspace``, else the kept one
    of the calling thread's stream: :mod:`~indexcache.backends.triton.workspace`) is taken here, so launching needs
    no allocation (and a benchmark can time each launch alone). ``plan``: :func:`call_plan`'s for this call, where the
    caller has it (unsorted calls); ``settings``: those of ``target`` and ``cfg`` (worked out here when None)."""
    rows, cols = scores.shape
    if rows == 0 or k == 0:
        return []
    s = settings or Settings.of(target, cfg)
    if sorted:
        return _sorted_launches(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch,
                                workspace=workspace, settings=s)
    (starts, raw, r2b, table), scan, row_args = _row_args(scores, lengths, row_starts, out, out_raw, page_table,
                                                          page_size, row_to_batch)
    block, chunk, chunks, cap, row_programs, finish_programs, words = plan or shape_plan(rows, cols, scores.device, k,
                                                                                        target, cfg, s)
    ws = workspaces.words(scores, sum(words), workspace)
    a, b, c = words[0], words[0] + words[1], words[0] + words[1] + words[2]  # where the pieces end
    region, counts, hist, stash = ws[:a], ws[a:b], ws[b:c], ws[c:]
    # Split rows are finished by a program a chunk (the grid's second axis) where the table lets them (FINISH_TIES),
    # the others by one program a row.
    spread = chunk > 0 and cfg["FINISH_TIES"] > 0
    finish = ("finish", Launch(
        FINISH, (finish_programs, chunks) if spread else (finish_programs,), s.finish_options,
        (scores, lengths, starts, out, raw, r2b, table, region, counts, hist, stash, rows, cols, k, cap, chunks,
         chunk),
        {**row_args, **s.finish_named, "BLOCK_S": gather_chunks(chunks, cfg), "SPREAD": spread}))

    def sample(entries: int, shift_bins: int, with_counts: bool, options: Options) -> tuple[str, Launch]:
        # A program a row, its own warps and no register cap: the whole sample is held in registers.
        return ("sample", Launch(SAMPLE, (rows,), options, (scores, lengths, starts, hist, cols, k),
                                 {**scan, "SAMPLES": entries, "BINS": shift_bins, "COUNTS": with_counts,
                                  **s.sample_named}))

    if block:
        floors = ([sample(ahead_samples(cols, k, block, cfg), topk_block.BINS, False, s.ahead_options)]
                  if block["FLOORS"] else [])
        return floors + [("rows", topk_block.launch((scores, lengths, starts, out, raw, r2b, table, stash, counts, hist,
                                                     rows, cols, k),
                                                    {**row_args, "DIGIT": cfg["DIGIT"], "PDL": s.pdl, **block},
                                                    row_programs, s.block_options)),
                         finish]
    if not chunk:
        return [("rows", Launch(ROWS, (row_programs,), s.rows_options,
                                (scores, lengths, starts, out, raw, r2b, table, stash, counts, rows, cols, k, cap),
                                {**row_args, **s.rows_named, "SAMPLES": min(sample_size(cols, k, cfg),
                                                                            2 * cfg["TILE"])})),
                finish]
    lanes, pack = filter_tile(target, chunk, cfg)
    return [
        sample(sample_size(cols, k, cfg), cfg["FINISH_BINS"], True, s.sample_options),
        ("filter", Launch(FILTER, (rows, chunks), s.filter_options,
                          (scores, lengths, starts, hist, region, counts, cols, k, chunk),
                          {**scan, "LANES": lanes, "PACK": pack, **s.filter_named})),
        finish,
    ]


def with_pdl(options: Options, pdl: bool) -> Options:
    """``options`` with ``launch_pdl`` where the launch starts with programmatic dependent launch."""
    return launch_key_options({**dict(options), "launch_pdl": True}) if pdl else options


def _sorted_launches(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch, *,
                     workspace: torch.Tensor | None, settings: Settings) -> list[tuple[str, Launch]]:
    """``sorted=True``: the unsorted select's launches writing raw positions (to ``out_raw`` when given, else to
    ``out``), then ``topk_sort_kernel``, one program a row: one launch, or under an SM budget of n launches of n rows
    (a sort looping over rows spills scalar registers on AMD)."""
    target, cfg = settings.target, settings.cfg
    (starts, raw, r2b, table), _, row_args = _row_args(scores, lengths, row_starts, out, out_raw, page_table,
                                                       page_size, row_to_batch)
    width = max(16, next_power_of_2(k))
    opts = launch_key_options(launch_options(target, dict(cfg, num_warps=sort_warps(k, cfg))))
    steps = launches(scores, lengths, k, row_starts, raw, None, None, 1, None, workspace=workspace, target=target,
                     cfg=cfg, settings=settings)
    rows = scores.shape[0]
    step = sm_budget(multiprocessors(target, scores.device)) or rows
    return steps + [("sort", Launch(SORT, (min(step, rows - row0),), opts,
                                    (scores, lengths, starts, out, raw, r2b, table, row0, scores.shape[1], k),
                                    dict(row_args, K_P2=width))) for row0 in range(0, rows, step)]


def sort_warps(k: int, cfg: Mapping[str, Any]) -> int:
    """Warps (wavefronts) of the sort launch: ``SORT_PER_WARP`` keys a warp, at least 4, at most 16."""
    return max(4, min(16, next_power_of_2(k) // cfg["SORT_PER_WARP"]))


def _select(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch, sorted, workspace, *,
            target: Target, cfg: Mapping[str, Any], settings: Settings | None):
    for _, launch in launches(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch,
                              sorted=sorted, workspace=workspace, target=target, cfg=cfg, settings=settings):
        launch()
    return out


def topk(scores, lengths, k, row_starts, out, sorted, workspace=None, *, target: Target, cfg: Mapping[str, Any],
         settings: Settings | None = None):
    """Fill ``out [R, k]`` int32 (contract: ``indexcache.topk``); ``settings`` as :func:`launches`."""
    return _select(scores, lengths, k, row_starts, out, None, None, 1, None, sorted, workspace, target=target,
                   cfg=cfg, settings=settings)


def topk_translate(scores, lengths, k, page_table, page_size, row_starts, row_to_batch, out, out_raw, sorted,
                   workspace=None, *, target: Target, cfg: Mapping[str, Any], settings: Settings | None = None):
    """Fill ``out [R, k]`` with physical slots and ``out_raw`` (when given) with the raw window positions
    (contract: ``indexcache.topk_translate``); ``settings`` as :func:`launches`."""
    return _select(scores, lengths, k, row_starts, out, out_raw, page_table, page_size, row_to_batch, sorted,
                   workspace, target=target, cfg=cfg, settings=settings)
