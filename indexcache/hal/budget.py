"""The SM budget: how many multiprocessors (compute units on AMD) the persistent kernels of a call may use.

A persistent kernel sizes its grid to fill the GPU (programs loop over the work), so beside it a kernel on another
stream finds no multiprocessor free and the two only interleave. Under a budget of ``n``, every persistent launch of
the ops whose spec records say ``budgeted`` (``library.BUDGETED_OPS``) runs at most ``n`` programs (one a
multiprocessor): however the hardware places them, they occupy at most ``n`` multiprocessors and leave the rest to
other streams (docs/streams.md). A budget at or above the device's count is the whole device (the launches are those
of no budget).

Set it for one call (the ``sm_budget=`` argument of those ops) or for a block (``with indexcache.sm_budget(n):``); the
argument wins. The block's setting is a context variable, like :func:`indexcache.use_backend`: it holds for the
calling thread (and asyncio task) whatever stream it enqueues on. Nested blocks replace the enclosing budget, except
:func:`indexcache.overlap`'s: it sets one for its side function and one for its main function within the budget in
force, so that ``with sm_budget(100): overlap(side, main, device=..., side_sms=40)`` keeps the pair to 100 (the side
under 40, the main under the other 60; the side's share at most one fewer than the enclosing budget, half of it where
none is given, in order under a budget of 1; docs/streams.md, "`overlap`: when and how"). The budget is read when a
call builds its launches, so a CUDA graph keeps the grids of its capture, and an eager call kept by its signature
(:mod:`indexcache.hal.memo`) is kept per budget. Launches sized by their work rather than by the device (translation,
the short-row fills, the prefill producer's windows, the MXFP4 prefill's key widening) are not persistent and run as
before; the torch backend has no persistent kernels and ignores it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from indexcache.hal.checks import check_int

# The largest budget taken (an int32; any count at or above the device's is the whole device).
MAX_SM_BUDGET = 2**31 - 1
_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar("indexcache_sm_budget", default=None)


def check(n: int | None, name: str = "sm_budget") -> int | None:
    """``n`` when it is a budget (an int in ``[1, MAX_SM_BUDGET]``) or None (no budget); else TypeError (not an int)
    or ValueError (out of range) naming ``name``."""
    return None if n is None else check_int(name, n, 1, MAX_SM_BUDGET, " (multiprocessors)")


@contextlib.contextmanager
def sm_budget(n: int | None) -> Iterator[None]:
    """Within the block, the persistent kernels of this thread's calls use at most ``n`` multiprocessors (compute
    units on AMD); None lifts an enclosing budget. Raises TypeError for anything but an int or None, ValueError for an
    int out of ``[1, MAX_SM_BUDGET]``."""
    token = _BUDGET.set(check(n))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def current() -> int | None:
    """The budget in force for this thread's calls (None: the whole device)."""
    return _BUDGET.get()


_UNSCOPED = contextlib.nullcontext()  # stateless: one serves every call (a generator's context costs every op call)


def scoped(n: int | None) -> contextlib.AbstractContextManager[None]:
    """A call's ``sm_budget=`` argument in force within the block (None: the enclosing setting stays)."""
    return _UNSCOPED if n is None else sm_budget(n)
