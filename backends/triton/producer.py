"""The producer step of decode, ``paged_topk_translate`` (contract: ``indexcache.paged_topk_translate``): the paged
logits, then the top-k and translation of their rows, as the launches of ``paged_mqa_logits`` and
``topk_translate`` back to back (docs/kernels.md, "The producer step of decode": counting the logits for the top-k
as they are stored cost the logits kernel more than it saved the top-k).

The logits kernel leaves out the requests whose every row the top-k selects without logits (a visible length,
clipped to ``max_context_len``, of at most k: positions ``0 .. len - 1``), whatever the batch mix; when
``max_context_len <= k`` no row can need them, and one launch (:func:`short_rows_kernel`) writes the selection,
translated: the step of a short-context CUDA graph costs what a translation does (docs/ops.md, "Short rows").

With draft tokens (``next_n > 1``) a small launch first writes each row's length and request into the call's
workspace (:func:`draft_rows_kernel`), the top-k's ``lengths`` and ``row_to_batch``; the top-k's own workspace
follows them in it (:mod:`~indexcache.backends.triton.workspace`: the caller's ``workspace=`` or the kept one of the
calling thread's stream).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from indexcache.backends.triton import topk
from indexcache.backends.triton import workspace as workspaces
from indexcache.backends.triton.launcher import FOUR_WARPS, Launch, Launcher, Options, bound, launch_key_options
from indexcache.backends.triton.logits import format_options, paged_mqa_logits_launch
from indexcache.backends.triton.logits import ops as logits_ops
from indexcache.backends.triton.support import cdiv, next_power_of_2
from indexcache.backends.triton.target import Target
from indexcache.backends.triton.translate import page_shift, physical
from indexcache.hal import fp4
from indexcache.hal.contract import OpImpl

DRAFT_BLOCK = 256  # rows a program of draft_rows_kernel
SHORT_ROWS, SHORT_COLS = 4, 512  # the tile of a short_rows_kernel program


@triton.jit(do_not_specialize=("rows",), do_not_specialize_on_alignment=("ctx_ptr", "lengths_ptr", "r2b_ptr"))
def draft_rows_kernel(ctx_ptr, lengths_ptr, r2b_ptr, rows, ctx_s0, NEXT_N: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``r = b · NEXT_N + j``'s length, ``max(context_lens[b], 0) - NEXT_N + 1 + j`` (the keys it sees), and
    its request ``b``."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < rows
    b = r // NEXT_N
    ctx = tl.maximum(tl.load(ctx_ptr + b.to(tl.int64) * ctx_s0, mask=m, other=0), 0)
    tl.store(lengths_ptr + r, ctx - NEXT_N + 1 + r % NEXT_N, mask=m)
    tl.store(r2b_ptr + r, b, mask=m)


DRAFT_ROWS = Launcher(draft_rows_kernel)


# Nothing that varies per call takes part in the variant (docs/kernels.md, "Kernel variants").
@triton.jit(do_not_specialize=("rows", "cols", "k", "batches", "pages", "tab_s0", "out_s0", "raw_s0"),
            do_not_specialize_on_alignment=("ctx_ptr", "ke_ptr", "r2b_ptr", "table_ptr"))
def short_rows_kernel(ctx_ptr, ke_ptr, r2b_ptr, table_ptr, out_ptr, raw_ptr, rows, cols, k, batches, pages,
                      page_size, ctx_s0, ke_s0, r2b_s0, tab_s0, tab_s1, out_s0, out_s1, raw_s0, raw_s1,
                      NEXT_N: tl.constexpr, HAS_R2B: tl.constexpr, HAS_RAW: tl.constexpr, SHIFT: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, WINDOWS: tl.constexpr = 0):
    """Slots ``[0, k)`` of rows that are all short (``cols <= k``): position j where ``j`` is below the row's
    visible length clipped to ``[0, cols]``, else -1, into ``raw`` (``HAS_RAW``) and, through the row's page-table
    row, into ``out``. Row ``r``: request ``r // NEXT_N`` and length ``context_lens[b] - NEXT_N + 1 + r % NEXT_N``;
    ragged rows (``HAS_R2B``): request ``r2b[r]`` and length ``context_lens[r]``. ``WINDOWS`` (the prefill
    producer): ``ctx_ptr`` and ``ke_ptr`` hold each row's window ``[ks, ke)`` over ``cols`` keys, its length
    clipped to them; its table row ``r2b[r]`` (``HAS_R2B``) or ``r``."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = r < rows
    inside = r_ok[:, None] & (j < k)[None, :]
    r64 = r.to(tl.int64)
    if WINDOWS:
        start = tl.minimum(tl.maximum(tl.load(ctx_ptr + r64 * ctx_s0, mask=r_ok, other=0), 0), cols)
        seq = tl.maximum(tl.minimum(tl.load(ke_ptr + r64 * ke_s0, mask=r_ok, other=0), cols), start) - start
        if HAS_R2B:
            b = tl.load(r2b_ptr + r64 * r2b_s0, mask=r_ok, other=-1)
        else:
            b = r
    elif HAS_R2B:
        b = tl.load(r2b_ptr + r64 * r2b_s0, mask=r_ok, other=-1)
        seq = tl.load(ctx_ptr + r64 * ctx_s0, mask=r_ok, other=0)
    else:
        b = r // NEXT_N
        # the context clamped first: near -2^31 the row's length would wrap to a full row
        seq = tl.maximum(tl.load(ctx_ptr + b.to(tl.int64) * ctx_s0, mask=r_ok, other=0), 0) - NEXT_N + 1 + r % NEXT_N
    length = tl.minimum(tl.maximum(seq, 0), cols)
    x = tl.where(j[None, :] < length[:, None], j[None, :], -1)
    b_ok = (b >= 0) & (b < batches)
    table_row = table_ptr + b.to(tl.int64)[:, None] * tab_s0
    slots = physical(x, inside & b_ok[:, None], seq[:, None], table_row, tab_s1, pages, page_size, SHIFT)
    tl.store(out_ptr + r64[:, None] * out_s0 + j.to(tl.int64)[None, :] * out_s1, slots, mask=inside)
    if HAS_RAW:
        tl.store(raw_ptr + r64[:, None] * raw_s0 + j.to(tl.int64)[None, :] * raw_s1, x, mask=inside)


SHORT = Launcher(short_rows_kernel)


def short_launch(context_lens, next_n, row_to_batch, k, cols, page_table, page_size, out, out_raw,
                 window_ends=None) -> Launch | None:
    """The one launch of a call whose rows are all short (``cols <= k``; :func:`short_rows_kernel`), None when
    ``out`` is empty. ``window_ends`` (the prefill producer): ``context_lens`` holds the windows' starts, this their
    ends."""
    rows = out.shape[0]
    if rows == 0 or k == 0:
        return None
    raw = out_raw if out_raw is not None else out
    r2b = row_to_batch if row_to_batch is not None else context_lens
    ends = window_ends if window_ends is not None else context_lens
    block_k = min(SHORT_COLS, next_power_of_2(k))
    block_r = max(1, SHORT_ROWS * SHORT_COLS // block_k)
    return Launch(SHORT, (cdiv(rows, block_r), cdiv(k, block_k)), FOUR_WARPS,
                  (context_lens, ends, r2b, page_table, out, raw, rows, cols, k, page_table.shape[0],
                   page_table.shape[1], page_size, context_lens.stride(0), ends.stride(0), r2b.stride(0),
                   page_table.stride(0), page_table.stride(1), out.stride(0), out.stride(1), raw.stride(0),
                   raw.stride(1)),
                  dict(NEXT_N=next_n, HAS_R2B=row_to_batch is not None, HAS_RAW=out_raw is not None,
                       SHIFT=page_shift(page_size), BLOCK_R=block_r, BLOCK_K=block_k,
                       WINDOWS=window_ends is not None))


def _draft_words(q: torch.Tensor) -> int:
    """int32 words of the draft rows' lengths and requests (0 without draft tokens), rounded up to 4 (16 bytes) so
    the top-k's workspace after them stays aligned."""
    rows, next_n = q.shape[0] * q.shape[1], q.shape[1]
    return 0 if next_n == 1 or rows == 0 else 4 * cdiv(2 * rows, 4)


def _workspace(q: torch.Tensor, logits: torch.Tensor, k: int, *, target: Target,
               tuning: Mapping[str, Mapping[str, Any]], settings: topk.Settings | None = None) -> tuple[int, Any]:
    """``(int32 words, the top-k's plan)`` of a call: the draft rows' lengths and requests, then the top-k's over
    ``logits`` (its :func:`topk.call_plan`, None where it selects nothing); none when every row is short (``logits``
    no wider than ``k``). ``settings``: the top-k's (worked out when None)."""
    if logits.shape[1] <= k:
        return 0, None
    plan = (topk.call_plan(logits, k, target=target, cfg=tuning["topk"], settings=settings) if logits.shape[0] and k
            else None)
    return _draft_words(q) + (sum(plan.words) if plan else 0), plan


def workspace_bytes(q: torch.Tensor, logits: torch.Tensor, k: int, *, target: Target,
                    tuning: Mapping[str, Mapping[str, Any]], settings: topk.Settings | None = None) -> int:
    """The workspace bytes of a call (:func:`_workspace`)."""
    return 4 * _workspace(q, logits, k, target=target, tuning=tuning, settings=settings)[0]


def launches(q, k_cache, weights, context_lens, block_table, max_context_len, k, page_table, page_size, logits, out,
             out_raw, workspace=None, k_format=None, row_to_batch=None, q_scale=None, *, target: Target,
             tuning: Mapping[str, Mapping[str, Any]], options: Options | None = None,
             settings: topk.Settings | None = None) -> list[Launch | None]:
    """The launches of one call, in order (None: nothing to launch); arguments as
    ``indexcache.paged_topk_translate`` (``k_format`` None: an fp8 cache in ``q``'s format, else MXFP4;
    ``row_to_batch``: ragged rows; ``q_scale``: MXFP4 queries). ``options``: the logits launch's, as
    :func:`~indexcache.backends.triton.logits.paged_mqa_logits_launch` takes them, and ``settings``: the top-k's
    (:class:`topk.Settings <indexcache.backends.triton.topk.plan.Settings>`), both worked out when None (the backend
    keeps them)."""
    batch, next_n = q.shape[0], q.shape[1]
    rows = batch * next_n
    if max_context_len <= k:  # every row short: no logits, no top-k
        return [short_launch(context_lens, next_n, row_to_batch, k, max_context_len, page_table, page_size, out,
                             out_raw)]
    steps = [paged_mqa_logits_launch(q, k_cache, weights, context_lens, block_table, max_context_len, logits,
                                     k_format, row_to_batch, q_scale, target=target, cfg=tuning["paged_mqa_logits"],
                                     options=options, skip=k)]
    draft = _draft_words(q)
    settings = settings or topk.Settings.of(target, tuning["topk"])
    words, plan = _workspace(q, logits, k, target=target, tuning=tuning, settings=settings)  # the plan worked out once
    ws = workspaces.words(q, words, workspace)
    lengths, r2b = context_lens, row_to_batch  # next_n 1 (ragged rows: each row's own length and request)
    if draft:
        lengths, r2b = ws[:rows], ws[rows:2 * rows]
        steps.append(Launch(DRAFT_ROWS, (cdiv(rows, DRAFT_BLOCK),), FOUR_WARPS,
                            (context_lens, lengths, r2b, rows, context_lens.stride(0)),
                            dict(NEXT_N=next_n, BLOCK=DRAFT_BLOCK)))
    steps += [launch for _, launch in topk.launches(logits, lengths, k, None, out, out_raw, page_table, page_size,
                                                     r2b, workspace=ws[draft:].view(torch.uint8), target=target,
                                                     cfg=tuning["topk"], plan=plan, settings=settings)]
    return steps


def _parts(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The call's arguments as ``paged_mqa_logits``' and ``topk_translate``'s (lengths and requests stood in by
    ``context_lens``: what the checks read of them is their device)."""
    decode = dict(q=args["q"], k_cache=args["k_cache"], weights=args["weights"], context_lens=args["context_lens"],
                  page_table=args["block_table"], max_context_len=args["max_context_len"], out=args["logits"],
                  k_format=args.get("k_format"), row_to_batch=args.get("row_to_batch"), q_scale=args.get("q_scale"))
    select = dict(scores=args["logits"], lengths=args["context_lens"], k=args["k"], page_table=args["page_table"],
                  page_size=args["page_size"], row_starts=None, row_to_batch=args.get("row_to_batch"), out=args["out"],
                  out_raw=args["out_raw"], sorted=False, workspace=args["workspace"])
    return decode, select


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """``paged_topk_translate`` of a GPU backend built for ``target`` with its tuning table: served wherever both
    ``paged_mqa_logits`` and ``topk_translate`` are."""
    decode_op = logits_ops(target, tuning)["paged_mqa_logits"]
    select_op = topk.ops(target, tuning)["topk_translate"]
    # The logits launch's options by the cache's format (MXFP4 keys take the table's FP4_* entries).
    decode_options = {mxfp4: launch_key_options(format_options(target, tuning["paged_mqa_logits"], mxfp4))
                      for mxfp4 in (False, True)}
    settings = topk.Settings.of(target, tuning["topk"])

    def supports(**args):
        decode, select = _parts(args)
        return list(dict.fromkeys([*decode_op.supports(**decode), *select_op.supports(**select)]))

    def run(**args):
        for launch in launches(**args, target=target, tuning=tuning,
                               options=decode_options[args.get("k_format") == fp4.FP4], settings=settings):
            if launch is not None:
                launch()
        return args["out"]

    def prepare(**args):
        return bound(launches(**args, target=target, tuning=tuning,
                              options=decode_options[args.get("k_format") == fp4.FP4], settings=settings))

    def workspace_of(q, logits, k, **_):
        return workspace_bytes(q, logits, k, target=target, tuning=tuning, settings=settings)

    return {"paged_topk_translate": OpImpl(run, supports, prepare, workspace_of)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What this module builds for ``target`` itself (cross-compile check): :func:`draft_rows_kernel` for two draft
    tokens, and :func:`short_rows_kernel` at k 2048 for next_n 1 with and without ``out_raw``, next_n 2, ragged
    rows and the prefill producer's windows, on the shift and the division path (the logits and top-k launches are
    their own modules' builds)."""
    from indexcache.backends.triton.crosscompile import KernelSpec

    ptrs = {name: "*i32" for name in ("ctx_ptr", "ke_ptr", "r2b_ptr", "table_ptr", "out_ptr", "raw_ptr")}
    unit = {"ctx_s0": 1, "ke_s0": 1, "r2b_s0": 1, "tab_s1": 1, "out_s1": 1, "raw_s1": 1}
    tile = {"BLOCK_R": SHORT_ROWS, "BLOCK_K": SHORT_COLS}
    short = [KernelSpec("paged_topk_translate", short_rows_kernel, ptrs,
                        {"NEXT_N": next_n, "HAS_R2B": r2b, "HAS_RAW": raw, "SHIFT": shift, "WINDOWS": windows, **tile,
                         **unit}, {"num_warps": 4})
             for next_n, r2b, raw, shift, windows in ((1, 0, 1, page_shift(64), 0), (1, 0, 0, page_shift(64), 0),
                                                      (2, 0, 1, page_shift(64), 0), (1, 1, 1, page_shift(64), 0),
                                                      (1, 0, 1, -1, 0), (1, 1, 1, page_shift(64), 1))]
    return [KernelSpec("paged_topk_translate", draft_rows_kernel,
                       {name: "*i32" for name in ("ctx_ptr", "lengths_ptr", "r2b_ptr")},
                       {"NEXT_N": 2, "BLOCK": DRAFT_BLOCK, "ctx_s0": 1}, {"num_warps": 4}), *short]
