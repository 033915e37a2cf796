"""The search objective: ``pattern -> float``, lower is better; the overlap proxy and a cache of values per pattern.

An objective takes a pattern of one ``F``/``S`` per sparse layer. The overlap proxy (:func:`overlap_objective`)
scores it from the overlap matrix alone; a user objective (calibration LM loss from an engine) can take its place.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from indexcache.tools.calibrate.errors import CalibrationError
from indexcache.tools.calibrate.pattern import PRODUCER, check_pattern

Objective = Callable[[str], float]


def overlap_objective(overlap: np.ndarray) -> Objective:
    """The overlap proxy: ``pattern -> mean over sparse layers of (1 - overlap[source, layer])``.

    ``overlap`` is ``[L, L]`` over the sparse layers in order; a shared layer's source is the nearest
    producer before it, a producer costs 0. Lower is better: 0 for all-F, and the fraction of a layer's
    own top-k it does not see, averaged over layers, otherwise.
    """
    matrix = np.asarray(overlap, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise CalibrationError(f"overlap: shape {matrix.shape}; expected a square [L, L] matrix")
    num = matrix.shape[0]

    def overlap_loss(pattern: str) -> float:
        check_pattern(pattern, num)
        loss, source = 0.0, 0
        for layer, role in enumerate(pattern):
            if role == PRODUCER:
                source = layer
            else:
                loss += 1.0 - float(matrix[source, layer])
        return loss / num

    return overlap_loss


class CachedObjective:
    """``objective(pattern) -> float`` (lower is better) evaluated once per distinct pattern.

    ``calls`` counts evaluations of the wrapped function; ``cache`` maps pattern to value. Reuse one
    instance across searches (other budgets, a re-run) to pay for each pattern once.
    """

    def __init__(self, objective: Objective, name: str | None = None) -> None:
        self.objective = objective
        self.name = name or getattr(objective, "__name__", type(objective).__name__)
        self.cache: dict[str, float] = {}
        self.calls = 0

    def __call__(self, pattern: str) -> float:
        if pattern not in self.cache:
            returned = self.objective(pattern)
            self.calls += 1
            try:
                value = float(returned)
            except (TypeError, ValueError):
                message = f"objective({pattern!r}) returned {returned!r}; it must return a finite number"
                raise TypeError(message) from None
            if not math.isfinite(value):
                raise ValueError(f"objective({pattern!r}) = {value}; it must return a finite number")
            self.cache[pattern] = value
        return self.cache[pattern]
