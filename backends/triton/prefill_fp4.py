"""Prefill logits on MXFP4 keys where the target has no block-scaled matrix instruction: the keys widened once a call,
then the fp8 prefill (docs/fp4.md, "The prefill: keys widened once").

The prefill reads each key tile once for every block of queries (2 tokens at H = 64): widening the tile in the logits
kernel widens every key thousands of times (4096 queries: 2048 times). So a call widens its keys once, into a
workspace, and runs the fp8 prefill (the Hopper Gluon kernel or the Triton one, whichever takes the fp8 call) on
them; the few keys one scale cannot hold exactly get their logits again, exactly:

1. :func:`zero_kernel` clears the count of such keys.
2. :func:`widen_keys_kernel`: each key's values to the target's e4m3 format with one scale a key, exactly where its
   block scale bytes lie within ``mxfp4.SPREAD`` (or one is NaN: the key's scale is NaN), in the elements' order, and
   its scale ``2 ** (R - 127)`` as float32 (``mxfp4.key_lifts``); the other keys ("far") are listed.
3. The fp8 prefill (``logits.mqa_logits_launches``) on the widened keys and their scales: every logit, far keys'
   inexact.
4. :func:`far_keys_kernel`: the listed keys' logits again, exactly (``D / 32`` dots, smallest block scale first, the
   logits kernels' exact path, ``head_sum.exact_head_sum``), written inside each row's window only. With no far key
   its programs read the count and end.

The workspace (int32 words, :func:`workspace_words`): the widened keys ``[N, D]`` (e4m3), their scales ``[N]``, the
far keys' list ``[N]`` and its count. Nothing is allocated by the launches; graph-safe with the workspace given or
kept. The logits are the MXFP4 decode kernel's numbers (the same widening, the same exact path) but for the order of
the fp32 sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from indexcache.backends.triton import mxfp4
from indexcache.backends.triton.head_sum import exact_head_sum, unpack_words
from indexcache.backends.triton.launcher import FOUR_WARPS, Launch, Launcher, Options, persistent_programs
from indexcache.backends.triton.support import cdiv
from indexcache.backends.triton.target import Target

WIDEN_BLOCK = 64  # keys a program of the widening
FAR_BLOCK = 64  # far keys a step of the exact path (few a call: the tile that builds in the fewest registers)


@triton.jit
def zero_kernel(count_ptr):
    """The far keys' count to 0."""
    tl.store(count_ptr, 0)


# The key count takes no part in the variant (docs/kernels.md, "Kernel variants").
@triton.jit(do_not_specialize=("N", ))
def widen_keys_kernel(k_ptr, scale_ptr, wide_ptr, wide_scale_ptr, far_ptr, count_ptr, N, k_s0, scale_s0,
                      D: tl.constexpr, BLOCK: tl.constexpr, FNUZ: tl.constexpr):
    """Keys ``BLOCK · program .. + BLOCK`` of ``k`` (MXFP4 values ``[N, D / 2]``, rows at multiples of 4 bytes) and
    ``scale`` (e8m0 bytes ``[N, D / 32]``): their e4m3 bytes into ``wide [N, D]`` and scales into ``wide_scale [N]``
    (one scale a key, ``mxfp4.key_lifts``), the keys one scale cannot hold appended to ``far`` (``count`` of them)."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    n64 = n.to(tl.int64)
    words = tl.load(k_ptr.to(tl.pointer_type(tl.uint32)) + (n64 * (k_s0 // 4))[:, None]
                    + tl.arange(0, D // 8)[None, :], mask=ok[:, None], other=0)
    scales = tl.load(scale_ptr + (n64 * scale_s0)[:, None] + tl.arange(0, D // 32)[None, :], mask=ok[:, None],
                     other=0).to(tl.int32)
    lift, scale, one = mxfp4.key_lifts(scales, BLOCK, D, FNUZ)
    wide = unpack_words(mxfp4.widen(words, lift, BLOCK, D, FNUZ), tl.uint8, BLOCK, D)  # mxfp4.permute's order
    tl.store(wide_ptr + n64[:, None] * D + tl.arange(0, D)[None, :], mxfp4.unpermute(wide, BLOCK, D),
             mask=ok[:, None])
    tl.store(wide_scale_ptr + n, scale, mask=ok)
    far = ok & ~one
    taken = tl.sum(far.to(tl.int32), axis=0)
    if taken > 0:
        at = tl.atomic_add(count_ptr, taken) + tl.cumsum(far.to(tl.int32), axis=0) - 1
        tl.store(far_ptr + at, n, mask=far)


# The token and key counts take no part in the variant, nor do the logits' row stride (its stores are scattered) and
# the addresses of the windows (read a token at a time).
@triton.jit(do_not_specialize=("T", "N", "skip", "out_s0"), do_not_specialize_on_alignment=("ks_ptr", "ke_ptr"))
def far_keys_kernel(q_ptr, k_ptr, scale_ptr, w_ptr, ks_ptr, ke_ptr, far_ptr, count_ptr, out_ptr, T, N, skip,
                    q_s0, q_s1, q_s2, k_s0, scale_s0, w_s0, w_s1, ks_s0, ke_s0, out_s0, out_s1,
                    H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                    KEYS_ON_M: tl.constexpr, WIDEN: tl.constexpr, FNUZ: tl.constexpr):
    """The logits of the ``count`` keys listed in ``far`` (MXFP4 keys whose block scales lie too far apart for one
    scale), exactly, for blocks of ``BLOCK_Q`` queries taken round-robin: each row's inside its window clipped to
    ``[0, N)``, none in a row of at most ``skip`` keys (as the prefill kernels' ``skip``)."""
    count = tl.load(count_ptr)
    if count > 0:
        blocks = tl.cdiv(T, BLOCK_Q)
        rows = tl.arange(0, BLOCK_Q * H)
        dims = tl.arange(0, D)
        for i in range(tl.program_id(0), blocks, tl.num_programs(0)):
            tok = i * BLOCK_Q + tl.arange(0, BLOCK_Q)
            tok_ok = tok < T
            tok64 = tok.to(tl.int64)
            ks = tl.minimum(tl.maximum(tl.load(ks_ptr + tok64 * ks_s0, mask=tok_ok, other=0), 0), N)
            ke = tl.minimum(tl.maximum(tl.load(ke_ptr + tok64 * ke_s0, mask=tok_ok, other=0), 0), N)
            ke = tl.where((ke - ks <= skip) | ~tok_ok, ks, ke)  # no logits in a row of at most skip keys
            qrow = (i * BLOCK_Q + rows // H).to(tl.int64) * q_s0 + (rows % H).to(tl.int64) * q_s1
            q = tl.load(q_ptr + qrow[:, None] + dims.to(tl.int64)[None, :] * q_s2,
                        mask=(i * BLOCK_Q + rows // H < T)[:, None], other=0.0)
            q = mxfp4.permute(q, BLOCK_Q * H, D)
            w = tl.load(w_ptr + tok64[:, None] * w_s0 + tl.arange(0, H).to(tl.int64)[None, :] * w_s1,
                        mask=tok_ok[:, None], other=0.0)
            for f0 in range(0, count, BLOCK_N):
                f = f0 + tl.arange(0, BLOCK_N)
                listed = (f < count) & (f < N)  # (the list holds at most N keys: never read past it)
                n = tl.load(far_ptr + f, mask=listed, other=0).to(tl.int64)
                live = listed & (n >= 0) & (n < N)  # (a key of the cache, whatever the list holds)
                n = tl.where(live, n, 0)
                words = tl.load(k_ptr.to(tl.pointer_type(tl.uint32)) + (n * (k_s0 // 4))[:, None]
                                + tl.arange(0, D // 8)[None, :], mask=live[:, None], other=0)
                scales = tl.load(scale_ptr + (n * scale_s0)[:, None] + tl.arange(0, D // 32)[None, :],
                                 mask=live[:, None], other=0).to(tl.int32)
                s = exact_head_sum(words, scales, q, w, BLOCK_N, BLOCK_Q, H, D, KEYS_ON_M, WIDEN, FNUZ)
                if KEYS_ON_M:  # s [keys, tokens]
                    inside = live[:, None] & (n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :])
                    tl.store(out_ptr + n[:, None] * out_s1 + (tok64 * out_s0)[None, :], s, mask=inside)
                else:  # s [tokens, keys]
                    inside = live[None, :] & (n[None, :] >= ks[:, None]) & (n[None, :] < ke[:, None])
                    tl.store(out_ptr + (tok64 * out_s0)[:, None] + n[None, :] * out_s1, s, mask=inside)


ZERO, WIDEN_KEYS, FAR_KEYS = Launcher(zero_kernel), Launcher(widen_keys_kernel), Launcher(far_keys_kernel)


def workspace_words(keys: int, dim: int) -> int:
    """int32 words of the workspace of a call over ``keys`` MXFP4 keys of dim ``dim``: their e4m3 bytes, their
    scales, the far keys' list and its count."""
    return keys * dim // 4 + 2 * keys + 1


def pieces(ws: torch.Tensor, keys: int, dim: int, fp8: torch.dtype):
    """``(wide [keys, dim] fp8, wide_scale [keys] float32, far [keys] int32, count [1] int32)`` of the workspace
    ``ws`` (int32 words, :func:`workspace_words` of them)."""
    body = keys * dim // 4
    return (ws[:body].view(fp8).view(keys, dim), ws[body:body + keys].view(torch.float32),
            ws[body + keys:body + 2 * keys], ws[body + 2 * keys:body + 2 * keys + 1])


def launches(q, k, k_scale, weights, ks, ke, out, ws, *, cfg: Mapping[str, Any], far_options: Options, fp8_launches,
             skip: int = 0, programs: int, widen: bool = True) -> list[Launch]:
    """The launches of ``mqa_logits`` on MXFP4 keys ``k`` / ``k_scale`` widened once (module docstring), ``ws`` the
    workspace (int32 words), ``cfg`` the prefill's tuning entry and ``far_options`` the far keys' launch options,
    ``fp8_launches(wide_k, wide_scale)`` the fp8 prefill's launches on the widened keys, ``programs`` the
    multiprocessors the far keys' grid spans; ``widen`` False: ``ws`` holds these keys widened already (an earlier
    call's launches: the producer step's passes)."""
    tokens, heads, dim = q.shape
    keys = k.shape[0]
    fnuz = q.dtype == torch.float8_e4m3fnuz
    wide, wide_scale, far, count = pieces(ws, keys, dim, q.dtype)
    found = []
    if widen:
        found.append(Launch(ZERO, (1,), FOUR_WARPS, (count,), {}))
    if widen and keys:
        found.append(Launch(WIDEN_KEYS, (cdiv(keys, WIDEN_BLOCK),), FOUR_WARPS,
                            (k.view(torch.uint8), k_scale.view(torch.uint8), wide.view(torch.uint8), wide_scale, far,
                             count, keys,
                             k.stride(0), k_scale.stride(0)),
                            dict(D=dim, BLOCK=WIDEN_BLOCK, FNUZ=fnuz)))
    found += fp8_launches(wide, wide_scale)
    block_q = max(1, cfg["COLS"] // heads, 16 // heads)
    if keys and tokens:
        found.append(Launch(
            FAR_KEYS, (max(1, min(cdiv(tokens, block_q), persistent_programs(programs, 1))),), far_options,
            (q, k.view(torch.uint8), k_scale.view(torch.uint8), weights, ks, ke, far, count, out, tokens, keys, skip,
             *q.stride(), k.stride(0), k_scale.stride(0), *weights.stride(), ks.stride(0), ke.stride(0),
             *out.stride()),
            dict(H=heads, D=dim, BLOCK_Q=block_q, BLOCK_N=FAR_BLOCK, KEYS_ON_M=cfg["KEYS_ON_M"], WIDEN=0,
                 FNUZ=fnuz)))
    return found


def compile_specs(target: Target, cfg: Mapping[str, Any], heads: int, dim: int, far_options: Mapping[str, Any]) -> list:
    """What :func:`launches` builds for ``target`` besides the fp8 prefill (cross-compile check): the count's reset, the
    widening and the far keys' logits at the table's tile (``cfg``, the prefill's entry; ``far_options`` their launch
    options), the target's fp8 queries."""
    from indexcache.backends.triton.crosscompile import KernelSpec, pointer

    fnuz = target.fp8_dtype == torch.float8_e4m3fnuz
    return [
        KernelSpec("mqa_logits", zero_kernel, {"count_ptr": "*i32"}, {}, {"num_warps": 4}),
        KernelSpec("mqa_logits", widen_keys_kernel,
                   {"k_ptr": "*u8", "scale_ptr": "*u8", "wide_ptr": "*u8", "wide_scale_ptr": "*fp32", "far_ptr": "*i32",
                    "count_ptr": "*i32"},
                   {"D": dim, "BLOCK": WIDEN_BLOCK, "FNUZ": fnuz, "scale_s0": dim // 32}, {"num_warps": 4},
                   aligned=("k_s0",)),
        KernelSpec("mqa_logits", far_keys_kernel,
                   {"q_ptr": pointer(target.fp8_dtype), "k_ptr": "*u8", "scale_ptr": "*u8", "w_ptr": "*fp32",
                    "ks_ptr": "*i32", "ke_ptr": "*i32", "far_ptr": "*i32", "count_ptr": "*i32", "out_ptr": "*fp32"},
                   {"H": heads, "D": dim, "BLOCK_Q": max(1, cfg["COLS"] // heads, 16 // heads),
                    "BLOCK_N": FAR_BLOCK, "KEYS_ON_M": cfg["KEYS_ON_M"], "WIDEN": 0, "FNUZ": fnuz, "q_s2": 1,
                    "w_s1": 1, "ks_s0": 1, "ke_s0": 1, "out_s1": 1},
                   far_options, matrix="fp8", aligned=("q_s0", "q_s1", "k_s0", "w_s0")),
    ]
