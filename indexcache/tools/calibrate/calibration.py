"""A calibration: the overlap measured, the pattern searched, the freq rule compared and the files written.

:func:`calibrate_arrays` does it for top-k index arrays, :func:`calibrate_dump` for a dump directory
(:mod:`indexcache.tools.calibrate.dump`); :func:`indexcache.tools.model.calibration.calibrate_model` for a dump
recorded from the small model.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from indexcache.plan import SCHEDULE_KEYS, LayerPlan
from indexcache.tools.calibrate.dump import load_dump
from indexcache.tools.calibrate.errors import CalibrationError, DumpError
from indexcache.tools.calibrate.freq_rule import FreqBaseline, freq_baselines
from indexcache.tools.calibrate.indices import IndexArray, as_rows
from indexcache.tools.calibrate.objective import CachedObjective, overlap_objective
from indexcache.tools.calibrate.outputs import stale_plots, write_outputs
from indexcache.tools.calibrate.overlap import overlap_matrix
from indexcache.tools.calibrate.pattern import producer_budget
from indexcache.tools.calibrate.search import SearchResult, greedy_search

DEFAULT_KEEP = 0.25


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate_arrays` found and wrote.

    ``source`` says in words where the indices came from; ``layers`` are the sparse layer ids, each holding
    ``rows`` rows of ``k`` indices; ``overlap`` is their ``[L, L]`` overlap matrix, measured in
    ``overlap_seconds`` on the CPU; ``search`` is the greedy search down to the producer budget; ``freq_rule``
    the ``index_topk_freq`` baselines, or None when they could not be compared (the layers could not be placed
    in a model); ``paths`` the files written (see :func:`write_outputs`); ``removed`` an earlier calibration's plots
    this one removed from the folder because it drew none; ``overridden_by`` the schedule key of the model's config
    (:func:`calibrate_dump`'s ``config``) that takes precedence over ``index_topk_pattern`` (``indexer_types``, or
    ``cli_factor`` > 1), so that merging ``config.json`` into that config changes nothing until it is removed, else
    None; ``copies`` the layers whose indices equal the previous sparse layer's in every row (what a recording with
    those layers shared holds: their overlap of 1 makes sharing them look free, whatever their own indexer selects).
    """

    source: str
    layers: tuple[int, ...]
    rows: int
    k: int
    overlap: np.ndarray
    overlap_seconds: float
    search: SearchResult
    freq_rule: tuple[FreqBaseline, ...] | None
    paths: dict[str, Path]
    removed: tuple[Path, ...] = ()
    overridden_by: str | None = None
    copies: tuple[int, ...] = ()

    @property
    def adjacent_overlap(self) -> float:
        """Mean overlap of neighbouring sparse layers (1.0 for a single layer)."""
        adjacent = np.diag(self.overlap, 1)
        return float(sum(adjacent) / len(adjacent)) if len(adjacent) else 1.0


def calibrate_arrays(
    layers: Sequence[int],
    indices: Sequence[IndexArray],
    out: str | os.PathLike[str],
    *,
    keep: float | None = None,
    producers: int | None = None,
    plan_for: Callable[..., LayerPlan] | None = None,
    source: str = "indices",
    info: Mapping[str, Any] | None = None,
    threads: int | None = None,
    plots: bool = True,
) -> Calibration:
    """Calibrate the pattern of the sparse ``layers`` from their top-k ``indices`` and write the files into ``out``.

    ``indices[l]`` is layer ``layers[l]``'s ``[rows, k]`` integer array (-1 = empty slot). Keeps ``producers``
    producers, or the fraction ``keep`` of the sparse layers (default 0.25 when neither is given): measures the
    overlap (:func:`overlap_matrix`, ``threads`` row blocks at once), runs :func:`greedy_search` under the
    overlap proxy, compares the ``index_topk_freq`` rule when ``plan_for`` places the layers in a model (see
    :func:`freq_baselines`) and writes the outputs (:func:`write_outputs`; ``info`` and the sizes head
    ``report.json``; ``plots`` draws the PNGs). ``source`` says where the indices came from, for a summary.
    Layers that hold exactly the previous layer's indices are listed in :attr:`Calibration.copies` and in
    ``report.json``.
    """
    if len(layers) != len(indices):
        raise CalibrationError(
            f"layers: {len(layers)} layer ids, but indices holds {len(indices)} arrays; give one array per layer"
        )
    if keep is None and producers is None:
        keep = DEFAULT_KEEP
    budget = check_budget(len(layers), keep=keep, producers=producers)
    start = time.perf_counter()
    overlap = overlap_matrix(indices, threads=threads)
    seconds = time.perf_counter() - start
    objective = CachedObjective(overlap_objective(overlap), "overlap loss")
    search = greedy_search(layers, objective, producers=budget)
    freq_rule = None if plan_for is None else freq_baselines(layers, objective, plan_for, min_producers=budget)
    arrays = [as_rows(array, f"indices[{i}]") for i, array in enumerate(indices)]
    rows, k = arrays[0].shape
    copies = tuple(int(layers[i]) for i in range(1, len(arrays)) if _same(arrays[i - 1], arrays[i]))
    keep = None if keep is None else float(keep)  # a numpy float too, for report.json
    report = {**(info or {}), "rows": rows, "k": k, "keep": keep, "overlap_seconds": round(seconds, 3),
              "copies_of_previous_layer": list(copies)}
    removed = () if plots else stale_plots(out)
    paths = write_outputs(out, search, overlap, info=report, freq_rule=freq_rule or (), plots=plots)
    return Calibration(
        source=source,
        layers=search.layers,
        rows=rows,
        k=k,
        overlap=overlap,
        overlap_seconds=seconds,
        search=search,
        freq_rule=None if freq_rule is None else tuple(freq_rule),
        paths=paths,
        removed=removed,
        copies=copies,
    )


def _same(first: np.ndarray, second: np.ndarray) -> bool:
    """Whether two ``[rows, k]`` arrays are equal (the first row compared alone first: most pairs differ there)."""
    return np.array_equal(first[0], second[0]) and np.array_equal(first, second)


def check_budget(num_sparse: int, *, keep: float | None = None, producers: int | None = None) -> int:
    """The producers :func:`calibrate_arrays` keeps among ``num_sparse`` sparse layers: :func:`producer_budget`, the
    fraction ``DEFAULT_KEEP`` when neither ``keep`` nor ``producers`` is given; checked before any work."""
    if keep is None and producers is None:
        keep = DEFAULT_KEEP
    return producer_budget(num_sparse, keep=keep, producers=producers)


def calibrate_dump(
    dump: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    keep: float | None = None,
    producers: int | None = None,
    threads: int | None = None,
    plots: bool = True,
) -> Calibration:
    """:func:`calibrate_arrays` on the dump directory ``dump`` (:func:`load_dump`).

    With the model's ``config`` (a dict or the path of its ``config.json``) the dump must hold exactly the
    config's main sparse layers (:class:`DumpError` otherwise; MTP layers run their own indexer and are never
    dumped) and the ``index_topk_freq`` rule is compared under that config. Without one, a dump of layers
    0..n-1 is taken for a model whose every layer is sparse, and other layer ids leave the rule uncompared. A config
    whose schedule outranks ``index_topk_pattern`` is named in :attr:`Calibration.overridden_by`. A bad config, or
    with one a ``keep`` or ``producers`` its sparse layers cannot take, is refused before the dump is read.
    """
    plan = None if config is None else LayerPlan.from_config(config)
    expected = [] if plan is None else [layer for layer in plan.sparse_layers
                                        if layer < plan.num_layers - plan.num_mtp_layers]
    if plan is not None:
        check_budget(len(expected), keep=keep, producers=producers)
    layers, arrays = load_dump(dump)
    overridden_by = None
    if plan is None:
        plan_for = partial(LayerPlan, len(layers)) if layers == list(range(len(layers))) else None
    else:
        if layers != expected:
            missing, extra = sorted(set(expected) - set(layers)), sorted(set(layers) - set(expected))
            named = config if isinstance(config, (str, os.PathLike)) else "the config"
            raise DumpError(
                f"dump {dump} does not hold the sparse layers of {named}: missing {missing}, unexpected {extra} "
                "(MTP layers always run their own indexer and do not belong in the dump)"
            )
        plan_for = partial(LayerPlan.from_config, config)
        if SCHEDULE_KEYS.index(plan.schedule) < SCHEDULE_KEYS.index("index_topk_pattern"):
            overridden_by = plan.schedule
    found = calibrate_arrays(
        layers, arrays, out, keep=keep, producers=producers, plan_for=plan_for, source=f"dump {dump}",
        info={"dump": str(dump)}, threads=threads, plots=plots,
    )
    return dataclasses.replace(found, overridden_by=overridden_by)
