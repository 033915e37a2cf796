"""The greedy pattern search of the IndexCache paper and its outcome.

Start with every sparse layer a producer, then repeatedly turn into a shared layer the producer whose loss costs
least, until the producer budget is met: :func:`greedy_search` gives a :class:`SearchResult`, the trajectory of
:class:`Step`s from all-F down to the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from indexcache.tools.calibrate.errors import CalibrationError
from indexcache.tools.calibrate.objective import CachedObjective, Objective
from indexcache.tools.calibrate.pattern import PRODUCER, SHARED, producer_budget, uniform_pattern


@dataclass(frozen=True)
class Step:
    """One point of the greedy trajectory: the pattern with ``producers`` producers and its objective.

    ``flipped`` is the layer id turned shared at this step (None at the all-F start);
    ``uniform_objective`` is the evenly spaced pattern's objective at the same budget.
    """

    producers: int
    pattern: str
    objective: float
    flipped: int | None
    uniform_objective: float


@dataclass(frozen=True)
class SearchResult:
    """The greedy search's outcome; ``steps`` run from all-F down to the budget."""

    layers: tuple[int, ...]
    steps: tuple[Step, ...]
    objective_name: str

    @property
    def pattern(self) -> str:
        """The chosen pattern, one ``F``/``S`` per sparse layer (an ``index_topk_pattern`` value)."""
        return self.steps[-1].pattern

    @property
    def producers(self) -> list[int]:
        """Layer ids of the chosen producers."""
        return [layer for layer, role in zip(self.layers, self.pattern, strict=True) if role == PRODUCER]

    def objective_at(self, producers: int) -> float | None:
        """The objective of the searched pattern with ``producers`` producers (None: the search never had that many)."""
        return next((step.objective for step in self.steps if step.producers == producers), None)

    def config(self) -> dict[str, str]:
        """The config snippet that selects this pattern: ``{"index_topk_pattern": ...}``."""
        return {"index_topk_pattern": self.pattern}

    def roles(self, num_layers: int) -> list[str | None]:
        """Per model layer: ``"F"``, ``"S"``, or None for a layer without an indexer."""
        if self.layers and self.layers[-1] >= num_layers:
            raise CalibrationError(f"num_layers={num_layers}: the sparse layers go up to {self.layers[-1]}")
        roles: list[str | None] = [None] * num_layers
        for layer, role in zip(self.layers, self.pattern, strict=True):
            roles[layer] = role
        return roles

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: pattern, config, producers, objective, uniform baseline, trajectory."""
        last = self.steps[-1]
        return {
            "sparse_layers": list(self.layers),
            "pattern": self.pattern,
            "config": self.config(),
            "producers": self.producers,
            "objective": self.objective_name,
            "objective_value": last.objective,
            "uniform": {
                "pattern": uniform_pattern(len(self.layers), last.producers),
                "objective_value": last.uniform_objective,
            },
            "trajectory": [vars(step) for step in self.steps],
        }


def greedy_search(
    layers: Sequence[int], objective: Objective, *, producers: int, name: str | None = None
) -> SearchResult:
    """The paper's greedy pattern search over the sparse layers ``layers`` (ascending layer ids).

    Starts with every sparse layer a producer and, while more than ``producers`` remain, turns into a
    shared layer the producer (never the first sparse layer) whose flip gives the lowest
    ``objective(pattern)``; ties go to the earliest layer. ``objective`` takes a pattern of one
    ``F``/``S`` per sparse layer and returns a float, lower is better (a loss); it is cached per
    pattern (pass a :class:`CachedObjective` to share the cache). The search costs ``1 + (n - producers) * (n +
    producers - 1) / 2`` evaluations for ``n`` sparse layers (about ``n * (n - 1) / 2`` for few producers), and each
    budget's evenly spaced pattern (:attr:`Step.uniform_objective`) one more where the search did not meet it: at
    most ``n - producers`` more.
    """
    ids = [int(layer) for layer in layers if isinstance(layer, Integral) and not isinstance(layer, bool)]
    if not ids or len(ids) != len(layers) or ids != sorted(set(ids)) or ids[0] < 0:
        raise CalibrationError(
            f"layers={list(layers)!r}: must be distinct, ascending, non-negative integer layer ids"
        )
    num = len(ids)
    budget = producer_budget(num, producers=producers)
    cached = objective if isinstance(objective, CachedObjective) else CachedObjective(objective, name)
    pattern = PRODUCER * num
    steps = [Step(num, pattern, cached(pattern), None, cached(uniform_pattern(num, num)))]
    for count in range(num - 1, budget - 1, -1):
        flippable = [position for position in range(1, num) if pattern[position] == PRODUCER]
        candidates = [pattern[:position] + SHARED + pattern[position + 1 :] for position in flippable]
        values = [cached(candidate) for candidate in candidates]
        best = min(range(len(candidates)), key=values.__getitem__)  # the first of equal values
        pattern = candidates[best]
        steps.append(Step(count, pattern, values[best], ids[flippable[best]], cached(uniform_pattern(num, count))))
    return SearchResult(tuple(ids), tuple(steps), name or cached.name)
