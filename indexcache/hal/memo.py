"""Eager calls repeated with the same arguments: the checked, dispatched and bound call, kept by its signature.

An engine calls an op with the same buffers step after step. A call with a new signature runs the spec check
and the dispatch as always, and its signature is noted; the second call with it, where the chosen backend can
prepare the call (:attr:`~indexcache.hal.contract.OpImpl.prepare`) and the call writes only into memory the
caller gave (``out=``, the cache of ``store_index_k``), binds its launches and keeps them under the signature
(calls whose signature never repeats pay only for the signature): the op,
the explicit backend choice in force, per tensor its address, shape, strides, dtype, device, negative and conjugate
bits (for a list of tensors, each one's), and every other argument's type and value. A later call with the same
signature runs the kept launches directly: the checks read nothing but this signature, so they would pass again, and
the dispatch would choose the same backend.

The kept launches hold addresses, not tensors (they keep no memory alive, interpreted too). At most :data:`MAX_ENTRIES`
signatures are held (kept or seen once); a new one beyond that drops the least recently used (a look-up, a second
sighting and keeping each count as a use), so an engine's repeated calls stay kept while calls of passing shapes come
and go (emptying the whole memo instead cost a stall of milliseconds and every kept call its check again).
``indexcache.hal.dispatch.reset()`` empties it. One memo serves the process's threads: each function below changes it
under one lock, so a thread's look-up never meets an entry another thread dropped half-way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

MAX_ENTRIES = 512

# None: seen once, not yet kept. Ordered by use: moving an entry to the end or dropping the first rehashes no key (a
# signature's tuple is hashed afresh at every look-up) and leaves no holes for the next drop to skip.
_kept: OrderedDict[tuple, Callable[[], None] | None] = OrderedDict()
_lock = threading.Lock()  # every change of _kept, and a look-up with the move it makes


def signature(op: str, choice: Any, params: tuple) -> tuple | None:
    """The key of a call of ``op`` with ``params`` under the explicit backend ``choice``; None where a tensor
    has no address to key on (a fake tensor). Any other argument is keyed by its type and value: ``True``, ``1.0``
    and ``numpy.int64(1)`` equal ``1`` in Python but not to the checks, so they must not find ``1``'s entry."""
    try:
        return (op, choice, *map(_key, params))
    except Exception:  # noqa: BLE001  (a tensor without storage: the call simply runs unkept)
        return None


def _key(p: Any) -> tuple:
    """One argument's part of a signature; a list or tuple of tensors (a group's layers) by each tensor's."""
    if isinstance(p, torch.Tensor):  # a negated or conjugated view of the same memory: the GPU backends decline it
        return p.data_ptr(), p.shape, p.stride(), p.dtype, p.device, p.is_neg(), p.is_conj()
    if isinstance(p, (list, tuple)) and p and all(isinstance(t, torch.Tensor) for t in p):
        return type(p), tuple(map(_key, p))
    return type(p), p


def get(key: tuple) -> Callable[[], None] | None:
    """The kept launches of the call with this signature (now the most recently used), or None (also for a key
    that cannot be hashed)."""
    try:
        with _lock:
            launch = _kept.get(key)
            if launch is not None:
                _kept.move_to_end(key)  # the dict's order is the order of use
    except TypeError:
        return None
    return launch


def _make_room() -> None:
    while len(_kept) >= MAX_ENTRIES:
        _kept.popitem(last=False)  # the least recently used


def seen(key: tuple) -> bool:
    """Whether a call with this signature came before (kept or not; now the most recently used); notes it if not."""
    try:
        with _lock:
            if key in _kept:
                _kept.move_to_end(key)
                return True
            _make_room()
            _kept[key] = None
    except TypeError:  # an argument that cannot be hashed: never kept
        return False
    return False


def keep(key: tuple, launch: Callable[[], None]) -> None:
    """Keep ``launch`` for later calls with this signature (now the most recently used)."""
    try:
        with _lock:
            if key not in _kept:
                _make_room()
            _kept[key] = launch
            _kept.move_to_end(key)
    except TypeError:  # an argument that cannot be hashed: not kept
        pass


def clear() -> None:
    """Forget every kept call."""
    with _lock:
        _kept.clear()


def size() -> int:
    """How many calls are kept (signatures seen once not counted)."""
    with _lock:
        return sum(launch is not None for launch in _kept.values())
