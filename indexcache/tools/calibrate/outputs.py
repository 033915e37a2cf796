"""The files a calibration writes into its output folder: the pattern, its config snippet, a JSON report and two
plots, moved into place together so the folder always holds one calibration."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from indexcache.tools.calibrate.errors import OutputError
from indexcache.tools.calibrate.freq_rule import FreqBaseline
from indexcache.tools.calibrate.plots import check_plotting, plot_objective, plot_overlap
from indexcache.tools.calibrate.search import SearchResult

FILES = ("pattern.txt", "config.json", "report.json")
PLOTS = ("overlap.png", "objective.png")


def write_outputs(
    out: str | os.PathLike[str],
    result: SearchResult,
    overlap: np.ndarray,
    *,
    info: Mapping[str, Any] | None = None,
    freq_rule: Sequence[FreqBaseline] = (),
    plots: bool = True,
) -> dict[str, Path]:
    """Write the calibration's files into ``out`` (created if needed); returns ``{name: path}``.

    ``pattern.txt`` (the pattern and a newline), ``config.json`` (``{"index_topk_pattern": ...}``),
    ``report.json`` (``info``, the search summary of :meth:`SearchResult.to_dict`, the ``freq_rule``
    baselines beside the search's objective at their producer count, the overlap matrix) and, with
    ``plots``, ``overlap.png`` (heatmap) and ``objective.png`` (objective vs producers).

    The folder holds one calibration: every file is written into a scratch folder inside ``out`` and moved into
    place once all are written, and without ``plots`` an earlier calibration's plots are removed
    (:func:`stale_plots`), so they never sit beside results they do not show. A file that cannot be written raises
    :class:`OutputError` and leaves ``out`` as it was.
    """
    if plots:
        check_plotting()  # fail before writing anything
    directory = Path(out)
    names = [*FILES, *(PLOTS if plots else ())]
    for name in names:  # a folder in a file's place would stop the moves halfway
        if (directory / name).is_dir():
            raise OutputError(f"{directory}: cannot write {name}: a directory of that name is in the way")
    made = [folder for folder in (directory, *directory.parents) if not folder.exists()]  # deepest first
    try:
        directory.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".calibrate-", dir=directory))
    except OSError as exc:
        raise OutputError(f"{directory}: cannot write the calibration there ({exc.strerror or exc})") from None
    moved: list[str] = []
    try:
        _write_files(scratch, result, overlap, info, freq_rule, plots)
        for name in names:
            os.replace(scratch / name, directory / name)
            moved.append(name)
        for stale in () if plots else stale_plots(directory):
            stale.unlink()
    except OSError as exc:
        name = Path(exc.filename).name if exc.filename else "its files"
        left = f"only {', '.join(moved)} replaced" if moved else "nothing was written"
        raise OutputError(f"{directory}: cannot write {name} ({exc.strerror or exc}); {left}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for folder in made if len(moved) < len(names) else ():  # the folders made for a calibration that failed
            with contextlib.suppress(OSError):
                folder.rmdir()
    return {name: directory / name for name in names}


def stale_plots(out: str | os.PathLike[str]) -> tuple[Path, ...]:
    """The plots of an earlier calibration in ``out``, which one without plots removes (:func:`write_outputs`)."""
    return tuple(path for name in PLOTS if (path := Path(out) / name).is_file())


def _write_files(directory: Path, result: SearchResult, overlap: np.ndarray, info: Mapping[str, Any] | None,
                 freq_rule: Sequence[FreqBaseline], plots: bool) -> None:
    """The files of :func:`write_outputs`, written into ``directory``."""
    matrix = np.asarray(overlap, dtype=np.float64)
    (directory / "pattern.txt").write_text(result.pattern + "\n")
    (directory / "config.json").write_text(json.dumps(result.config(), indent=2) + "\n")
    report = {
        **(info or {}),
        **result.to_dict(),
        "freq_rule": [
            {
                "index_topk_freq": baseline.freq,
                "pattern": baseline.pattern,
                "producers": baseline.producers,
                "objective_value": baseline.objective,
                "search_objective_value": result.objective_at(baseline.producers),
            }
            for baseline in freq_rule
        ],
        "adjacent_overlap": [round(float(matrix[i, i + 1]), 6) for i in range(len(matrix) - 1)],
        "overlap": np.round(matrix, 6).tolist(),
    }
    (directory / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if plots:
        plot_overlap(matrix, result.layers, directory / "overlap.png", result=result)
        plot_objective(result, directory / "objective.png", freq_rule=freq_rule)
