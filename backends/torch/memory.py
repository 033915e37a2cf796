"""The torch backend's temporary-memory budget: chunked ops keep their temporaries under it."""

from __future__ import annotations

import os

ENV_VAR = "INDEXCACHE_TORCH_MEMORY_BUDGET"
DEFAULT_BUDGET = 256 * 2**20

_budget: int | None = None


class MemoryBudgetError(ValueError):
    """A budget other than a positive number of bytes: ``INDEXCACHE_TORCH_MEMORY_BUDGET``'s or
    :func:`set_memory_budget`'s."""


def set_memory_budget(nbytes: int | None) -> None:
    """Set the budget in bytes for temporaries of one op call; None restores the default. Anything else than a
    positive int or None is a :class:`MemoryBudgetError`."""
    global _budget
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0):
        raise MemoryBudgetError(f"nbytes: expected a positive int or None, got {nbytes!r}")
    _budget = nbytes


def env_budget() -> int | None:
    """The budget ``INDEXCACHE_TORCH_MEMORY_BUDGET`` sets (None: unset or empty); :class:`MemoryBudgetError` naming the
    variable and its value when that is not a positive integer. Every process that runs ops may run this backend
    (the fallback of every other), so ``indexcache`` checks it before any work and before starting workers."""
    env = os.environ.get(ENV_VAR)
    if not env:
        return None
    text = env.strip()
    value = int(text) if text.isascii() and text.isdigit() and len(text) < 40 else 0
    if value <= 0:
        raise MemoryBudgetError(f"{ENV_VAR}: expected a positive number of bytes, got {env[:40]!r}")
    return value


def memory_budget() -> int:
    """The budget in force: :func:`set_memory_budget`, else ``INDEXCACHE_TORCH_MEMORY_BUDGET``, else 256 MiB."""
    if _budget is not None:
        return _budget
    from_env = env_budget()
    return DEFAULT_BUDGET if from_env is None else from_env


def rows_per_chunk(bytes_per_row: int, rows: int) -> int:
    """How many rows of ``bytes_per_row`` temporaries fit the budget (at least 1, at most ``rows``)."""
    return max(1, min(rows, memory_budget() // max(bytes_per_row, 1)))
