"""The producer step of decode, ``paged_topk_translate`` (contract: ``indexcache.paged_topk_translate``): the paged
logits, then the top-k and translation of their rows, as the launches of ``paged_mqa_logits`` and
``topk_translate`` back to back (docs/kernels.md, "The producer step of decode": counting the logits for the top-k
as they are stored cost the logits kernel more than it saved the top-k).

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
from indexcache.backends.triton.launcher import Launch, Launcher, bound, launch_key_options
from indexcache.backends.triton.logits import ops as logits_ops
from indexcache.backends.triton.logits import paged_mqa_logits_launch
from indexcache.backends.triton.support import cdiv
from indexcache.backends.triton.target import Target
from indexcache.hal.contract import OpImpl

DRAFT_BLOCK = 256  # rows a program of draft_rows_kernel


@triton.jit(do_not_specialize=("rows",), do_not_specialize_on_alignment=("ctx_ptr", "lengths_ptr", "r2b_ptr"))
def draft_rows_kernel(ctx_ptr, lengths_ptr, r2b_ptr, rows, ctx_s0, NEXT_N: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``r = b · NEXT_N + j``'s length, ``max(context_lens[b], 0) - NEXT_N + 1 + j`` (the keys it sees), and
    its request ``b``."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < rows
    b = r // NEXT_N
    ctx = tl.maximum(tl.load(ctx_ptr + b * ctx_s0, mask=m, other=0), 0)
    tl.store(lengths_ptr + r, ctx - NEXT_N + 1 + r % NEXT_N, mask=m)
    tl.store(r2b_ptr + r, b, mask=m)


DRAFT_ROWS = Launcher(draft_rows_kernel)


def _draft_words(q: torch.Tensor) -> int:
    """int32 words of the draft rows' lengths and requests (0 without draft tokens), rounded up to 4 (16 bytes) so
    the top-k's workspace after them stays aligned."""
    rows, next_n = q.shape[0] * q.shape[1], q.shape[1]
    return 0 if next_n == 1 or rows == 0 else 4 * cdiv(2 * rows, 4)


def workspace_bytes(q: torch.Tensor, logits: torch.Tensor, k: int, *, target: Target,
                    tuning: Mapping[str, Mapping[str, Any]]) -> int:
    """The workspace bytes of a call: the draft rows' lengths and requests, then the top-k's over ``logits``."""
    return 4 * _draft_words(q) + topk.workspace_bytes(logits, k, target=target, cfg=tuning["topk"])


def launches(q, k_cache, weights, context_lens, block_table, max_context_len, k, page_table, page_size, logits, out,
             out_raw, workspace=None, k_format=None, row_to_batch=None, *, target: Target,
             tuning: Mapping[str, Mapping[str, Any]]) -> list[Launch | None]:
    """The launches of one call, in order (None: nothing to launch); arguments as
    ``indexcache.paged_topk_translate`` (``k_format`` None: an fp8 cache in ``q``'s format, else MXFP4;
    ``row_to_batch``: ragged rows)."""
    batch, next_n = q.shape[0], q.shape[1]
    rows = batch * next_n
    steps = [paged_mqa_logits_launch(q, k_cache, weights, context_lens, block_table, max_context_len, logits,
                                     k_format, row_to_batch, target=target, cfg=tuning["paged_mqa_logits"])]
    draft = _draft_words(q)
    ws = workspaces.words(q, workspace_bytes(q, logits, k, target=target, tuning=tuning) // 4, workspace)
    lengths, r2b = context_lens, row_to_batch  # next_n 1 (ragged rows: each row's own length and request)
    if draft:
        lengths, r2b = ws[:rows], ws[rows:2 * rows]
        steps.append(Launch(DRAFT_ROWS, (cdiv(rows, DRAFT_BLOCK),), launch_key_options({"num_warps": 4}),
                            (context_lens, lengths, r2b, rows, context_lens.stride(0)),
                            dict(NEXT_N=next_n, BLOCK=DRAFT_BLOCK)))
    steps += [launch for _, launch in topk.launches(logits, lengths, k, None, out, out_raw, page_table, page_size,
                                                     r2b, workspace=ws[draft:].view(torch.uint8), target=target,
                                                     cfg=tuning["topk"])]
    return steps


def _parts(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The call's arguments as ``paged_mqa_logits``' and ``topk_translate``'s (lengths and requests stood in by
    ``context_lens``: what the checks read of them is their device)."""
    decode = dict(q=args["q"], k_cache=args["k_cache"], weights=args["weights"], context_lens=args["context_lens"],
                  page_table=args["block_table"], max_context_len=args["max_context_len"], out=args["logits"],
                  k_format=args.get("k_format"), row_to_batch=args.get("row_to_batch"))
    select = dict(scores=args["logits"], lengths=args["context_lens"], k=args["k"], page_table=args["page_table"],
                  page_size=args["page_size"], row_starts=None, row_to_batch=args.get("row_to_batch"), out=args["out"],
                  out_raw=args["out_raw"], sorted=False, workspace=args["workspace"])
    return decode, select


def ops(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> dict[str, OpImpl]:
    """``paged_topk_translate`` of a GPU backend built for ``target`` with its tuning table: served wherever both
    ``paged_mqa_logits`` and ``topk_translate`` are."""
    decode_op = logits_ops(target, tuning)["paged_mqa_logits"]
    select_op = topk.ops(target, tuning)["topk_translate"]

    def supports(**args):
        decode, select = _parts(args)
        return list(dict.fromkeys([*decode_op.supports(**decode), *select_op.supports(**select)]))

    def run(**args):
        for launch in launches(**args, target=target, tuning=tuning):
            if launch is not None:
                launch()
        return args["out"]

    def prepare(**args):
        return bound(launches(**args, target=target, tuning=tuning))

    def workspace_of(q, logits, k, **_):
        return workspace_bytes(q, logits, k, target=target, tuning=tuning)

    return {"paged_topk_translate": OpImpl(run, supports, prepare, workspace_of)}


def compile_specs(target: Target, tuning: Mapping[str, Mapping[str, Any]]) -> list:
    """What this module builds for ``target`` itself (cross-compile check): :func:`draft_rows_kernel` for two draft
    tokens (the logits and top-k launches are their own modules' builds)."""
    from indexcache.backends.triton.crosscompile import KernelSpec

    return [KernelSpec("paged_topk_translate", draft_rows_kernel,
                       {name: "*i32" for name in ("ctx_ptr", "lengths_ptr", "r2b_ptr")},
                       {"NEXT_N": 2, "BLOCK": DRAFT_BLOCK, "ctx_s0": 1}, {"num_warps": 4})]
