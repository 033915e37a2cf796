"""The calibration's plots: the overlap heatmap and the objective against the number of producers (matplotlib,
from the ``bench`` extra)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from indexcache.tools.calibrate.freq_rule import FreqBaseline
from indexcache.tools.calibrate.pattern import PRODUCER
from indexcache.tools.calibrate.search import SearchResult


def check_plotting() -> None:
    """Raise ``ImportError`` telling how to install matplotlib when the plots cannot be drawn."""
    _figure_class()


def _figure_class() -> type:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("the calibration plots need matplotlib: pip install 'indexcache[bench]'") from exc
    return Figure


def plot_overlap(
    overlap: np.ndarray,
    layers: Sequence[int],
    path: str | os.PathLike[str],
    *,
    result: SearchResult | None = None,
) -> Path:
    """Heatmap of the ``[L, L]`` overlap matrix, axes labelled with layer ids, saved as a PNG.

    With ``result``, producers are boxed on the diagonal and each shared layer's (source, layer) cell,
    the overlap the pattern relies on, is dotted.
    """
    figure = _figure_class()(figsize=(7.5, 6.5), layout="constrained")
    axes = figure.subplots()
    image = axes.imshow(overlap, vmin=0.0, vmax=1.0, cmap="viridis")
    figure.colorbar(image, ax=axes, label="mean |T_i ∩ T_j| / k over rows")
    ticks = list(range(0, len(layers), max(1, len(layers) // 16)))
    axes.set_xticks(ticks, [str(layers[t]) for t in ticks])
    axes.set_yticks(ticks, [str(layers[t]) for t in ticks])
    axes.set_xlabel("layer")
    axes.set_ylabel("layer")
    axes.set_title("Top-k overlap between sparse layers")
    if result is not None:
        sources, source = [], 0
        for position, role in enumerate(result.pattern):
            if role == PRODUCER:
                source = position
            else:
                sources.append((source, position))
        boxes = [position for position, role in enumerate(result.pattern) if role == PRODUCER]
        axes.scatter(
            boxes, boxes, marker="s", s=40, facecolors="none", edgecolors="red", label=f"producer ({len(boxes)})"
        )
        if sources:
            axes.scatter(
                [j for _, j in sources],
                [i for i, _ in sources],
                marker=".",
                s=12,
                color="white",
                label="shared layer's source cell",
            )
        axes.legend(loc="lower left", fontsize="small")
    figure.savefig(path, dpi=110)
    return Path(path)


def plot_objective(
    result: SearchResult, path: str | os.PathLike[str], *, freq_rule: Sequence[FreqBaseline] = ()
) -> Path:
    """The objective along the greedy trajectory against the number of producers, with the evenly
    spaced pattern at each budget and the ``freq_rule`` baselines for comparison, saved as a PNG."""
    figure = _figure_class()(figsize=(7.5, 4.5), layout="constrained")
    axes = figure.subplots()
    counts = [step.producers for step in result.steps]
    axes.plot(counts, [step.objective for step in result.steps], marker="o", markersize=3, label="greedy search")
    axes.plot(
        counts, [step.uniform_objective for step in result.steps], linestyle="--", label="evenly spaced producers"
    )
    shown = [baseline for baseline in freq_rule if counts[-1] <= baseline.producers <= counts[0]]
    if shown:
        axes.scatter(
            [baseline.producers for baseline in shown],
            [baseline.objective for baseline in shown],
            marker="^",
            color="tab:red",
            zorder=3,
            label="index_topk_freq rule",
        )
        for baseline in shown:
            axes.annotate(
                f"freq {baseline.freq}",
                (baseline.producers, baseline.objective),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize="small",
            )
    axes.axvline(counts[-1], color="gray", linestyle=":", label=f"budget: {counts[-1]} of {counts[0]}")
    axes.invert_xaxis()
    axes.margins(y=0.12)  # room for the freq labels
    axes.set_xlabel("producers (F layers)")
    axes.set_ylabel(f"{result.objective_name} (lower is better)")
    axes.set_title("Pattern search: objective as producers are turned into shared layers")
    axes.legend()
    figure.savefig(path, dpi=110)
    return Path(path)
