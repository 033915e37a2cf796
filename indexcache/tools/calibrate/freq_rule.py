"""The ``index_topk_freq`` rule engines ship, as baselines to set beside the searched pattern."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from indexcache.plan import LayerPlan
from indexcache.tools.calibrate.errors import CalibrationError
from indexcache.tools.calibrate.objective import Objective
from indexcache.tools.calibrate.pattern import PRODUCER


@dataclass(frozen=True)
class FreqBaseline:
    """The pattern the ``index_topk_freq`` rule gives at ``freq``, and its objective."""

    freq: int
    pattern: str
    objective: float

    @property
    def producers(self) -> int:
        """How many producers the rule keeps."""
        return self.pattern.count(PRODUCER)


def freq_baselines(
    layers: Sequence[int], objective: Objective, plan_for: Callable[..., LayerPlan], *, min_producers: int = 1
) -> list[FreqBaseline]:
    """The ``index_topk_freq`` rule's patterns over the sparse ``layers`` with their objective: the
    baseline engines ship, to set beside the searched pattern.

    ``plan_for(index_topk_freq=f)`` returns the model's :class:`~indexcache.plan.LayerPlan` under that
    freq (e.g. ``functools.partial(LayerPlan.from_config, path)``); its main sparse layers must be
    ``layers``. One baseline per producer count of at least ``min_producers``: the smallest freq in
    2 .. len(layers) that keeps that many.
    """
    ids = [int(layer) for layer in layers]
    baselines: list[FreqBaseline] = []
    counts: set[int] = set()
    for freq in range(2, len(ids) + 1):
        plan = plan_for(index_topk_freq=freq)
        main = [layer for layer in plan.sparse_layers if layer < plan.num_layers - plan.num_mtp_layers]
        if main != ids:
            raise CalibrationError(f"index_topk_freq={freq}: the plan's sparse layers {main} are not the dump's {ids}")
        pattern = "".join(plan.roles[layer] for layer in ids)
        count = pattern.count(PRODUCER)
        if count >= min_producers and count not in counts:
            counts.add(count)
            baselines.append(FreqBaseline(freq, pattern, float(objective(pattern))))
    return baselines
