"""The torch backend's temporary-memory budget: chunked ops keep their temporaries under it."""

from __future__ import annotations

import os

ENV_VAR = "INDEXCACHE_TORCH_MEMORY_BUDGET"
DEFAULT_BUDGET = 256 * 2**20

_budget: int | None = None


def set_memory_budget(nbytes: int | None) -> None:
    """Set the budget in bytes for temporaries of one op call; None restores the default."""
    global _budget
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"nbytes: expected a positive int or None, got {nbytes!r}")
    _budget = nbytes


def memory_budget() -> int:
    """The budget in force: :func:`set_memory_budget`, else ``INDEXCACHE_TORCH_MEMORY_BUDGET``, else 256 MiB."""
    if _budget is not None:
        return _budget
    env = os.environ.get(ENV_VAR)
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{ENV_VAR}: expected a positive number of bytes, got {env!r}") from None
        if value > 0:
            return value
        raise ValueError(f"{ENV_VAR}: expected a positive number of bytes, got {env!r}")
    return DEFAULT_BUDGET


def rows_per_chunk(bytes_per_row: int, rows: int) -> int:
    """How many rows of ``bytes_per_row`` temporaries fit the budget (at least 1, at most ``rows``)."""
    return max(1, min(rows, memory_budget() // max(bytes_per_row, 1)))
