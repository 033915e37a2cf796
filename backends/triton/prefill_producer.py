"""The producer step of prefill, ``mqa_topk_translate`` (contract: ``indexcache.mqa_topk_translate``), in bounded
memory: the queries in passes of as many rows as the call's scratch bound holds, each pass the launch of
``mqa_logits`` into the workspace then those of ``topk_translate`` over its rows (docs/ops.md, "The prefill producer
step").

The workspace (the caller's ``workspace=``, else a kept one of the calling thread's stream, at most the bound) holds,
in int32 words, each a piece starting 64 bytes aligned: every query's clipped window start and length (written by
:func:`windows_kernel`, what the top-k takes as ``row_starts`` and ``lengths``), MXFP4 keys widened once where the
target has no block-scaled instruction (``prefill_fp4``: in the first pass, for all), one pass's ``[rows, N]`` float32
logits, and the top-k's own workspace for a pass. A pass's rows are whole rounds of the logits launch (its programs
times the queries a program holds: 528 on the H200) where the bound allows, else a multiple of 16, the passes as even
as that leaves: no program idles through a pass's last round, and every pass's slices of the inputs keep their
alignment and its launches their variants. A pass of at least a row a multiprocessor never splits its rows across
programs in the top-k (the tuning table's split, for few long rows, keeps each row's candidates beside it: twice the
pass's logits in scratch, where a program a row reads a pass's rows in a fraction of the time its logits take).

Rows whose window holds at most k keys select their first positions without logits (docs/ops.md, "Short rows"): the
logits launch leaves them out (a block of queries whose windows are all short reads no keys) and writes nothing
outside the windows (the top-k reads nothing there); with no more keys than k every row is short, and the call is
one launch (:func:`~indexcache.backends.triton.producer.short_rows_kernel`) with no workspace.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from indexcache.backends.triton import topk
from indexcache.backends.triton import workspace as workspaces
from indexcache.backends.triton.launcher import (
    FOUR_WARPS,
    Launch,
    Launcher,
    bound,
    launch_key_options,
    persistent_programs,
)
from indexcache.backends.triton.logits import (
    format_options,
    mqa_logits_launches,
    prefill_round,
    prefill_workspace_words,
)
from indexcache.backends.triton.logits import ops as logits_ops
from indexcache.backends.triton.producer import short_launch
from indexcache.backends.triton.support import cdiv, on_target_device
from indexcache.backends.triton.target import Target
from indexcache.backends.triton.topk.kernels import MAX_COLS
from indexcache.backends.triton.topk.plan import Settings, multiprocessors, shape_plan
from indexcache.hal import fp4
from indexcache.hal.contract import OpImpl

WINDOW_BLOCK = 256  # queries a program of windows_kernel
ALIGN = 16  # a pass's rows a multiple of this where the bound allows (64-byte aligned int32 slices)


@triton.jit(do_not_specialize=("rows", "keys"),
            do_not_specialize_on_alignment=("ks_ptr", "ke_ptr", "starts_ptr", "lengths_ptr"))
def windows_kernel(ks_ptr, ke_ptr, starts_ptr, lengths_ptr, rows, keys, ks_s0, ke_s0, BLOCK: tl.constexpr):
    """Query ``t``'s window ``[ks, ke)`` clipped to ``[0, keys)``: its start ``min(max(ks, 0), keys)`` and its length
    ``max(min(ke, keys), start) - start``."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < rows
    t64 = t.to(tl.int64)
    start = tl.minimum(tl.maximum(tl.load(ks_ptr + t64 * ks_s0, mask=m, other=0), 0), keys)
    end = tl.maximum(tl.minimum(tl.load(ke_ptr + t64 * ke_s0, mask=m, other=0), keys), start)
    tl.store(starts_ptr + t, start, mask=m)
    tl.store(lengths_ptr + t, end - start, mask=m)


WINDOWS = Launcher(windows_kernel)


def _piece(words: int) -> int:
    """``words`` rounded up to 16 (64 bytes)."""
    return cdiv(words, 16) * 16


def _unsplit(rows: int, device: torch.device, target: Target) -> bool:
    """Whether the top-k of a pass of ``rows`` rows never splits its rows (its tuning entry with ``CHUNKS_PER_SM`` 0):
    from a row a multiprocessor (of the SM budget in force) on."""
    return rows >= persistent_programs(multiprocessors(target, device), 1)


def topk_settings(target: Target, cfg: Mapping[str, Any]) -> tuple[Settings, Settings]:
    """The top-k's settings (:class:`~indexcache.backends.triton.topk.plan.Settings`) of a pass, from its tuning entry
    ``cfg``: those of ``cfg`` itself, then those with rows never split (:func:`_unsplit`)."""
    return Settings.of(target, cfg), Settings.of(target, dict(cfg, CHUNKS_PER_SM=0))


def pass_rows(tokens: int, keys: int, device: torch.device, k: int, limit: int, *, target: Target,
              cfg: Mapping[str, Any], quantum: int = ALIGN, keys_words: int = 0,
              settings: tuple[Settings, Settings] | None = None) -> int:
    """Query rows a pass for a call of ``tokens`` queries over ``keys`` keys selecting ``k``, whose workspace may
    take ``limit`` bytes (``cfg``: the top-k's tuning entry); ``ValueError`` when not even one row fits. ``quantum``:
    the rows of one round of the logits launch; a pass takes a multiple of it where the bound allows. ``keys_words``:
    the keys' own workspace (MXFP4 keys widened once, ``logits.prefill_workspace_words``). ``settings``:
    :func:`topk_settings` of ``target`` and ``cfg`` (worked out when None)."""
    return _pass(tokens, keys, device, k, limit, target, settings or topk_settings(target, cfg), quantum,
                 keys_words)[0]


def _words(plan: Any) -> int:
    """The int32 words of a top-k plan's workspace (0 for none)."""
    return sum(plan.words) if plan else 0


def _pass(tokens: int, keys: int, device: torch.device, k: int, limit: int, target: Target,
          settings: tuple[Settings, Settings], quantum: int, keys_words: int) -> tuple[int, tuple, tuple]:
    """``(rows a pass, (settings, plan) of a full pass, (settings, plan) of the last, shorter one)`` (:func:`pass_rows`:
    ``settings`` those of :func:`topk_settings`; a plan None where the top-k selects nothing; the last pass's the full
    one's where the rows divide evenly). The last pass is planned afresh, and not split where that would take more
    scratch than a full pass (under an SM budget fewer rows can split where a full pass's do not); the workspace holds
    the larger of the two passes' top-k."""
    fixed = 4 * (2 * _piece(tokens) + _piece(keys_words))
    plans: dict[tuple[int, bool], tuple[Settings, Any]] = {}  # each pass size's top-k (split or not), worked out once

    def select(rows: int, split: bool = True) -> tuple[Settings, Any]:
        found = plans.get((rows, split))
        if found is None:
            chosen = settings[1] if not split or _unsplit(rows, device, target) else settings[0]
            plan = shape_plan(rows, keys, device, k, target, chosen.cfg, chosen) if rows and k else None
            found = plans[rows, split] = chosen, plan
        return found

    def both(rows: int) -> tuple[tuple[Settings, Any], tuple[Settings, Any]]:
        full = select(rows)
        if not tokens % rows:
            return full, full
        last = select(tokens % rows)
        if _words(last[1]) > _words(full[1]):  # split where a full pass is not: within a full pass's scratch unsplit
            last = select(tokens % rows, False)
        return full, last

    def need(rows: int) -> int:
        return fixed + 4 * _piece(rows * keys) + 4 * max(_words(plan) for _, plan in both(rows))

    if need(tokens) <= limit:
        return tokens, *both(tokens)
    rows = min(tokens, max(limit - fixed, 0) // (4 * keys))
    while rows > 0 and need(rows) > limit:  # the top-k's share grows about linearly with the rows
        rows = min(rows - 1, rows * (limit - fixed) // (need(rows) - fixed))
    if rows == 0:
        raise ValueError(f"workspace_bytes: expected at least {need(1)} bytes for {tokens} queries over {keys} keys "
                         f"(the windows, {'the keys widened, ' if keys_words else ''}a query row's float32 logits and "
                         f"its top-k's workspace), got a bound of {limit}")
    fits = rows
    step = math.lcm(ALIGN, quantum) if rows >= math.lcm(ALIGN, quantum) else ALIGN
    if rows >= step:  # whole rounds of the logits launch (else aligned rows), the passes as even as they then can be
        rows -= rows % step
        even = cdiv(cdiv(tokens, cdiv(tokens, rows)), step) * step
        rows = even if even <= rows else rows
    if need(rows) > limit:  # another last pass than the one that fitted: keep that one
        rows = fits
    return rows, *both(rows)


def _passes(q, k, k_scale, weights, topk_k: int, limit: int, q_scale=None, *, target: Target,
            tuning: Mapping[str, Mapping[str, Any]],
            settings: tuple[Settings, Settings] | None = None) -> tuple[int, tuple[int, int, int], int, tuple, tuple]:
    """``(rows a pass, the workspace's pieces, its bytes, (settings, plan) of a full pass's top-k, (settings, plan) of
    the last pass's)`` of a call
    with queries and a ``topk_k`` above 0 (:func:`pass_rows`, in whole rounds of its logits launch where the bound
    allows). The pieces, in int32 words: the windows' (two of the first size), the keys widened once (the second,
    ``logits.prefill_workspace_words``; 0 but for MXFP4 keys on a widening target) and a pass's logits (the third);
    the top-k's workspace follows them (:func:`topk.shape_plan <indexcache.backends.triton.topk.plan.shape_plan>`'s
    words, for the pass's settings). ``q_scale``: MXFP4 queries (the keys read as they are); ``settings``:
    :func:`topk_settings` (worked out when None)."""
    tokens, keys = q.shape[0], k.shape[0]
    quantum = prefill_round(q, k, k_scale, weights, q_scale, target=target, cfg=tuning["mqa_logits"])
    wide = prefill_workspace_words(q, k, q_scale, target=target)
    rows, full, last = _pass(tokens, keys, q.device, topk_k, limit, target,
                             settings or topk_settings(target, tuning["topk"]), quantum, wide)
    pieces = _piece(tokens), _piece(wide), _piece(rows * keys)
    words = max(_words(plan) for _, plan in (full, last))
    return rows, pieces, 4 * (2 * pieces[0] + pieces[1] + pieces[2] + words), full, last


def _rows(tensors: tuple[torch.Tensor | None, ...], t0: int, t1: int) -> list[torch.Tensor | None]:
    """Rows ``[t0, t1)`` of each of ``tensors`` (None: None); a tensor itself where that is all of it (the same view,
    without a slice's cost)."""
    return [t if t is None or (t0 == 0 and t1 == t.shape[0]) else t[t0:t1] for t in tensors]


def call_workspace_bytes(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor, topk_k: int,
                         limit: int, q_scale: torch.Tensor | None = None, *, target: Target,
                         tuning: Mapping[str, Mapping[str, Any]],
                         settings: tuple[Settings, Settings] | None = None) -> int:
    """The workspace bytes of a call (at most ``limit``): the windows, a pass's logits and its top-k's workspace;
    none when every row is short (no more keys than ``topk_k``). ``settings``: :func:`topk_settings` (worked out when
    None)."""
    if q.shape[0] == 0 or topk_k == 0 or k.shape[0] <= topk_k:
        return 0
    return _passes(q, k, k_scale, weights, topk_k, limit, q_scale, target=target, tuning=tuning,
                   settings=settings)[2]


def launches(q, k, k_scale, weights, ks, ke, topk_k, page_table, page_size, row_to_batch, out, out_raw,
             workspace_bytes_, workspace=None, q_scale=None, *, target: Target,
             tuning: Mapping[str, Mapping[str, Any]], options,
             settings: tuple[Settings, Settings] | None = None) -> list[Launch | None]:
    """The launches of one call, in order (None: nothing to launch); arguments as ``indexcache.mqa_topk_translate``
    (``topk_k`` its ``topk``, ``workspace_bytes_`` the resolved bound), ``options`` the prefill logits' launch
    options, ``settings`` :func:`topk_settings` (worked out when None)."""
    tokens, keys = q.shape[0], k.shape[0]
    if tokens == 0 or topk_k == 0:
        return []
    if keys <= topk_k:  # every window short: its first positions, translated, in one launch
        return [short_launch(ks, 1, row_to_batch, topk_k, keys, page_table, page_size, out, out_raw, window_ends=ke)]
    rows, (win, wide, part), total, full, last = _passes(q, k, k_scale, weights, topk_k, workspace_bytes_, q_scale,
                                                         target=target, tuning=tuning, settings=settings)
    ws = workspaces.words(q, total // 4, workspace, cap=workspace_bytes_ // 4)
    starts, lengths = ws[:tokens], ws[win:win + tokens]
    keys_ws = ws[2 * win:2 * win + wide]
    logits = ws[2 * win + wide:2 * win + wide + rows * keys].view(torch.float32).view(rows, keys)
    scratch = ws[2 * win + wide + part:].view(torch.uint8)
    steps: list[Launch | None] = [Launch(WINDOWS, (cdiv(tokens, WINDOW_BLOCK),), FOUR_WARPS,
                                         (ks, ke, starts, lengths, tokens, keys, ks.stride(0), ke.stride(0)),
                                         dict(BLOCK=WINDOW_BLOCK))]
    # Without row_to_batch, query t translates through table row t: the pass's rows of the table.
    per_row = page_table if row_to_batch is None else row_to_batch
    for t0 in range(0, tokens, rows):
        t1 = min(tokens, t0 + rows)
        scores = logits if t1 - t0 == rows else logits[:t1 - t0]
        q_, weights_, ks_, ke_, q_scale_, lengths_, starts_, out_, raw_, per_row_ = _rows(
            (q, weights, ks, ke, q_scale, lengths, starts, out, out_raw, per_row), t0, t1)
        # (MXFP4 keys widened once: in the first pass)
        steps += mqa_logits_launches(q_, k, k_scale, weights_, ks_, ke_, scores, q_scale_, target=target,
                                     cfg=tuning["mqa_logits"], options=options, skip=topk_k, fill=False,
                                     workspace=keys_ws, keys_widened=t0 > 0)
        r2b, table = (None, per_row_) if row_to_batch is None else (per_row_, page_table)
        select, plan = full if t1 - t0 == rows else last
        steps += [launch for _, launch in topk.launches(scores, lengths_, topk_k, starts_, out_, raw_, table, page_size,
                                                         r2b, workspace=scratch, target=target, cfg=select.cfg,
                                                         plan=plan, settings=select)]
    return steps


def op_launches(args: Mapping[str, Any], *, target: Target, tuning: Mapping[str, Mapping[str, Any]],
                options=None, settings: tuple[Settings, Settings] | None = None) -> list[Launch | None]:
    """:func:`launches` of a call given as the op's checked arguments (its ``workspace_bytes`` resolved); ``options``
    the prefill logits' launch options, ``settings`` :func:`topk_settings` (both worked out when None)."""
    named = dict(args)
    named["topk_k"], named["workspace_bytes_"] = named.pop("topk"), named.pop("workspace_bytes")
    options = options or launch_key_options(format_options(target, tuning["mqa_logits"], named["k"].dtype == fp4.FP4))
    return launches(**named, target=target, tuning=tuning, options=options, settings=settings)


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """``mqa_topk_translate`` of a GPU backend built for ``target`` with its tuning table: served wherever
    ``mqa_logits`` is, for windows of up to the top-k's columns."""
    logits_op = logits_ops(target, tuning)["mqa_logits"]
    # The prefill logits' options by the keys' format (MXFP4 keys take the table's FP4_* entries).
    options = {mxfp4: launch_key_options(format_options(target, tuning["mqa_logits"], mxfp4))
               for mxfp4 in (False, True)}
    settings = topk_settings(target, tuning["topk"])

    def supports(q, k, k_scale, weights, ks, ke, page_table, row_to_batch, out, out_raw, workspace=None, q_scale=None,
                 **_):
        reasons = logits_op.supports(q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, out=out,
                                     q_scale=q_scale)
        reasons += on_target_device(target, page_table=page_table, row_to_batch=row_to_batch, out_raw=out_raw,
                                    workspace=workspace)
        if k.shape[0] > MAX_COLS:
            reasons.append(f"more than {MAX_COLS} keys are not supported by the Triton top-k")
        return list(dict.fromkeys(reasons))

    def run(**args):
        for launch in op_launches(args, target=target, tuning=tuning, options=options[args["k"].dtype == fp4.FP4],
                                  settings=settings):
            if launch is not None:
                launch()
        return args["out"]

    def prepare(**args):
        return bound(op_launches(args, target=target, tuning=tuning, options=options[args["k"].dtype == fp4.FP4],
                                 settings=settings))

    def workspace_of(q, k, k_scale, weights, topk, workspace_bytes, q_scale=None, **_):
        return call_workspace_bytes(q, k, k_scale, weights, topk, workspace_bytes, q_scale, target=target,
                                    tuning=tuning, settings=settings)

    return {"mqa_topk_translate": OpImpl(run, supports, prepare, workspace_of)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What this module builds for ``target`` itself (cross-compile check): :func:`windows_kernel` (the logits and
    top-k launches are their own modules' builds)."""
    from indexcache.backends.triton.crosscompile import KernelSpec

    return [KernelSpec("mqa_topk_translate", windows_kernel,
                       {name: "*i32" for name in ("ks_ptr", "ke_ptr", "starts_ptr", "lengths_ptr")},
                       {"BLOCK": WINDOW_BLOCK, "ks_s0": 1, "ke_s0": 1}, {"num_warps": 4})]
