"""Overlap the producer's indexer with the rest of a layer: ``overlap(side_fn, main_fn)``, or decided once a forward,
``overlap_schedule(...)(side_fn, main_fn)``.

``side_fn`` (the indexer: projections, logits, top-k) runs on a side stream while ``main_fn`` (the
layer's other preparation: query projection, KV store) runs on the current stream; the current stream
then waits for the side stream, so whatever follows sees both results, exactly as if the two had run
one after the other (side first). Tensors ``side_fn`` returns are safe to read on the current stream:
device schedulers mark them with ``record_stream`` so their memory is not reused before it has.

The scheduler is the ``overlap`` op of the backend :mod:`indexcache.hal.dispatch` picks, like any other op:
the cuda and rocm backends use device streams (``indexcache.backends.triton.streams``; safe under CUDA-graph
capture once a first eager call has created the streams) and declare how many side streams they allow;
the torch backend, and any backend whose tensors live on the CPU, runs the two functions in order
(``indexcache.backends.torch.streams``). Under ``torch.compile`` the two run in order on the current stream
(Inductor traces no streams), so a compiled model has no graph break here.

Sharing the GPU: our persistent kernels fill every multiprocessor, so beside them main-stream work only interleaves.
``overlap`` gives the side function a share of the multiprocessors, from ``side_sms`` or from the GPU backend's
measured rule for the side work's shape, which also runs the two in order where overlapping does not pay: an SM
partition (a CUDA green context) where the GPU and torch have them, the main function keeping the whole device, else
an SM budget (:mod:`indexcache.hal.budget`) with the main function under the rest; an enclosing SM budget holds the
pair (docs/streams.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from indexcache.hal import dispatch, fp4
from indexcache.hal.checks import check_int
from indexcache.hal.contract import IN_ORDER, Schedule

S = TypeVar("S")
M = TypeVar("M")


def overlap(side_fn: Callable[[], S], main_fn: Callable[[], M], *, device: torch.device | str | None = None,
            side: int = 0, side_sms: int | None = None, tokens: int | None = None, context: int | None = None,
            k_format: torch.dtype | None = None, backend: str | None = None) -> tuple[S, M]:
    """Run ``side_fn`` on side stream ``side`` while ``main_fn`` runs on the current stream; join.

    ``device`` is where the tensors of both functions live (None: the CPU, which runs them in order).
    ``side`` picks one of the backend's side streams (taken modulo how many it allows), so independent
    side work can use different streams. How the GPU is shared (docs/streams.md):

    - ``side_sms``: the side function's multiprocessors: a partition of that many where there are partitions (every
      kernel of the side held there, the main function keeping the whole device), else an SM budget
      (:func:`indexcache.sm_budget`) with the main function getting the device's other multiprocessors; 0 runs the two
      in order on the current stream (side first). Within an enclosing ``sm_budget(n)`` the pair keeps to ``n``: the
      side's share (a partition's too) at most ``n - 1`` (half of ``n`` with no share), the main function under the
      other multiprocessors of ``n``.
    - else ``tokens`` and ``context`` (the side work's query rows and keys a row, e.g. a decode batch's rows and its
      longest context): the backend's measured rule picks a partition, no share, or the order where overlapping does
      not pay. ``k_format``: the format of the index keys the side work reads, as the paged ops take it (None: fp8
      keys; ``torch.float4_e2m1fn_x2``: MXFP4 keys, whose decode reads half the bytes and wants its own share where
      the backend measured one).
    - else the two overlap with no share.

    Returns ``(side_fn(), main_fn())``; on return the current stream is ordered after everything both enqueued.
    Deciding costs host time at every call; a forward whose layers share one shape decides once with
    :func:`overlap_schedule`.
    """
    for name, fn in (("side_fn", side_fn), ("main_fn", main_fn)):  # before either runs
        if not callable(fn):
            raise TypeError(f"{name}: expected a function of no arguments, got {type(fn).__name__}")
    return overlap_schedule(device=device, side=side, side_sms=side_sms, tokens=tokens, context=context,
                            k_format=k_format, backend=backend)(side_fn, main_fn)


def overlap_schedule(*, device: torch.device | str | None = None, side: int = 0, side_sms: int | None = None,
                     tokens: int | None = None, context: int | None = None, k_format: torch.dtype | None = None,
                     backend: str | None = None) -> Schedule:
    """:func:`overlap`'s decision for these arguments, made once: ``schedule(side_fn, main_fn)`` runs any two functions
    as ``overlap(side_fn, main_fn, **these)`` would have run them when the schedule was made, with none of its checks
    and choices again (an eager layer step is host-bound: docs/streams.md, "Deciding once a forward").

    Make it where the forward runs, once per forward (every layer of a step has the same rows and context): eagerly
    for eager layers, inside the capture for a captured forward, since the backend's rule differs between the two
    (a schedule run in the other mode stays correct, only its share may not be that mode's). ``schedule.how`` and
    ``schedule.side_sms`` say what was decided (:class:`~indexcache.hal.contract.Schedule`). Under ``torch.compile``
    the schedule runs the two in order. Same arguments and errors as :func:`overlap`."""
    args = _checked(device, side, side_sms, tokens, context, k_format)
    if torch.compiler.is_compiling():
        # Inductor traces no streams (record_stream cannot be functionalized): in a compiled graph the two run in
        # order on the current stream, side first, as the join makes them appear anyway.
        return IN_ORDER
    impl = dispatch.scheduler(args, backend)[1]
    if impl.prepare is None:  # a scheduler that decides at each call
        return Schedule(functools.partial(_per_call, impl.fn, args), "per call", None)
    return impl.prepare(**args)


def _per_call(fn: Callable[..., tuple[S, M]], args: dict[str, Any], side_fn: Callable[[], S],
              main_fn: Callable[[], M]) -> tuple[S, M]:
    return fn(side_fn=side_fn, main_fn=main_fn, **args)


def _checked(device: torch.device | str | None, side: int, side_sms: int | None, tokens: int | None,
             context: int | None, k_format: torch.dtype | None) -> dict[str, Any]:
    """The scheduler's arguments (less the two functions), each checked: ValueError or TypeError naming a bad one."""
    if device is not None and not isinstance(device, (torch.device, str)):
        raise TypeError(f"device: expected a torch.device, a device string or None, got {type(device).__name__} "
                        f"{device!r}")
    try:
        dev = torch.device("cpu" if device is None else device)
    except RuntimeError as e:  # a string torch does not parse
        raise ValueError(f"device: expected a device torch knows ('cuda', 'cuda:1', 'cpu', ...), got {device!r}") from e
    check_int("side", side, 0)
    for name, value in (("side_sms", side_sms), ("tokens", tokens), ("context", context)):
        if value is not None:
            check_int(name, value, 0, None, " (0: in order)" if name == "side_sms" else "")
    if (tokens is None) != (context is None):
        raise ValueError(f"tokens and context: expected both or neither, got tokens={tokens!r}, context={context!r}")
    if k_format is not None:
        if not (isinstance(k_format, torch.dtype) and k_format == fp4.FP4):
            raise TypeError(f"k_format: expected None (fp8 keys) or torch.float4_e2m1fn_x2 (MXFP4 keys), got "
                            f"{k_format!r}")
        if tokens is None:
            raise ValueError("k_format: picks the rule for tokens and context: expected it with both, got neither")
    args: dict[str, Any] = dict(side=side, device=dev, side_sms=side_sms, tokens=tokens, context=context)
    if k_format is not None:  # only where given: schedulers written before it keep working
        args["k_format"] = k_format
    return args
