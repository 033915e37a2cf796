"""A layer plan run against the all-producer baseline on the same inputs: top-k overlap and drift of the logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from indexcache.plan import LayerPlan
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import IndexRecorder
from indexcache.tools.calibrate.overlap import overlap_matrix
from indexcache.tools.model.dsa import DSAModel, Generation


@dataclass(frozen=True)
class PlanComparison:
    """A plan run against the all-producer baseline on the same prompts and decode inputs.

    ``overlap[layer]`` is the top-k overlap (``|T_layer ∩ T_source| / k``, as in
    :func:`indexcache.tools.calibrate.overlap.overlap_matrix`) between each sparse layer's own selection and that of
    the producer the plan makes it reuse (1 for producers), measured on the baseline's decode steps;
    ``adjacent[layer]`` the same against the previous sparse layer. Drifts are relative L2 distances
    of the logits from the baseline's; ``agreement`` the fraction of decode positions where both pick
    the same greedy token.
    """

    plan: LayerPlan
    baseline: Generation
    candidate: Generation
    overlap: dict[int, float]
    adjacent: dict[int, float]
    prefill_drift: float
    decode_drift: float
    agreement: float


def _drift(got: torch.Tensor, base: torch.Tensor) -> float:
    return float((got - base).norm() / base.norm().clamp_min(1e-30))


def compare_plans(model: DSAModel, plan: LayerPlan, prompts: Sequence[torch.Tensor], steps: int) -> PlanComparison:
    """Generate with every sparse layer a producer, then with ``plan`` fed the same tokens; compare. Each plan runs
    once untimed first (the same prompts, at most one decode step), so that neither plan's times hold the kernels'
    compiles or first calls (on a GPU the plan timed first paid them: seconds against milliseconds)."""
    every = model.plan(1)
    for warming in (every, plan):
        model.generate(prompts, min(steps, 1), IndexerRunner(warming))
    recorder = IndexRecorder()
    baseline = model.generate(prompts, steps, IndexerRunner(every), recorder=recorder)
    candidate = model.generate(prompts, steps, IndexerRunner(plan), tokens=baseline.tokens)
    sparse = plan.sparse_layers
    overlap, adjacent = {}, {}
    if steps:
        recorded = recorder.stacked()
        matrix = overlap_matrix([recorded[layer] for layer in sparse])
        position = {layer: i for i, layer in enumerate(sparse)}
        overlap = {layer: float(matrix[i, position[plan.source_of(layer)]]) for i, layer in enumerate(sparse)}
        adjacent = {layer: float(matrix[i, i - 1]) for i, layer in enumerate(sparse) if i}
    agree = (candidate.decode_logits.argmax(-1) == baseline.decode_logits.argmax(-1)).float()
    return PlanComparison(plan=plan, baseline=baseline, candidate=candidate, overlap=overlap, adjacent=adjacent,
                          prefill_drift=_drift(candidate.prefill_logits, baseline.prefill_logits),
                          decode_drift=_drift(candidate.decode_logits, baseline.decode_logits) if steps else 0.0,
                          agreement=float(agree.mean()) if steps else 1.0)
