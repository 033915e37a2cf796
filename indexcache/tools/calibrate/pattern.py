"""Producer (F) / shared (S) patterns over the sparse layers: the two roles, how many
producers to keep, a pattern's check and the evenly spaced pattern."""

from __future__ import annotations

import math
from numbers import Integral, Real

from indexcache.tools.calibrate.errors import CalibrationError

PRODUCER = "F"
SHARED = "S"


def producer_budget(num_sparse: int, *, keep: float | None = None, producers: int | None = None) -> int:
    """How many producers to keep among ``num_sparse`` sparse layers: give exactly one of the two.

    ``keep`` is a fraction in (0, 1], rounded up (``keep=0.25`` of 61 layers keeps 16, as
    ``index_topk_freq=4`` does); ``producers`` is a count in 1..num_sparse (a numpy integer too, as layer ids are).
    """
    if (keep is None) == (producers is None):
        raise CalibrationError("give exactly one of keep (a fraction of the sparse layers) and producers (a count)")
    if producers is not None:
        if isinstance(producers, bool) or not isinstance(producers, Integral) or not 1 <= producers <= num_sparse:
            raise CalibrationError(
                f"producers={producers!r}: must be an integer in 1..{num_sparse} (the sparse layers)"
            )
        return int(producers)
    if isinstance(keep, bool) or not isinstance(keep, Real) or not 0 < keep <= 1:
        raise CalibrationError(f"keep={keep!r}: must be a fraction in (0, 1]; use producers= for a count")
    return max(1, math.ceil(keep * num_sparse - 1e-9))


def uniform_pattern(num_sparse: int, producers: int) -> str:
    """``producers`` producers spread evenly over ``num_sparse`` sparse layers, the first one included."""
    chosen = {i * num_sparse // producers for i in range(producers)}
    return "".join(PRODUCER if i in chosen else SHARED for i in range(num_sparse))


def check_pattern(pattern: str, num_sparse: int) -> None:
    """Raise :class:`CalibrationError` unless ``pattern`` is one ``F``/``S`` per sparse layer starting with ``F``."""
    if not isinstance(pattern, str) or len(pattern) != num_sparse or set(pattern) - {PRODUCER, SHARED}:
        raise CalibrationError(
            f"pattern {pattern!r}: must be {num_sparse} characters of 'F'/'S', one per sparse layer"
        )
    if pattern[0] != PRODUCER:
        raise CalibrationError(
            f"pattern {pattern!r}: the first sparse layer must be 'F' (shared layers need a producer)"
        )
