"""Pattern calibration: how much the layers' top-k selections overlap, and which layers to keep as producers.

The IndexCache paper picks the producer (F) / shared (S) pattern greedily: start with every sparse layer
a producer, then repeatedly turn into a shared layer the producer whose loss costs least, until the
producer budget is met. This module measures the cross-layer overlap of top-k indices from a dump, runs
that search under an overlap proxy or a user objective (calibration LM loss from an engine), compares it
with the ``index_topk_freq`` rule, and writes the pattern, an ``index_topk_pattern`` config snippet, a
JSON report and two plots (:func:`calibrate_dump` does all of it for a dump directory). It only analyses
dumps: :func:`indexcache.tools.model.record_dump` records one from a prefill of the small random-weight model.

Dump format (one directory, one file per sparse layer, every layer's indexer run, i.e. all layers F)::

    layer_000.pt  layer_001.pt  ...   or   layer_2.npz  layer_4.npz  ...

- The file name gives the layer id: ``layer_<id>.pt`` or ``layer_<id>.npz``, leading zeros optional;
  other files are ignored. Only layers with an indexer belong in the dump (all layers of a
  DeepSeek-V3.2 / GLM-5 style model, the C4 layers of a DeepSeek-V4 one; no MTP layers).
- ``.pt``: a tensor saved with ``torch.save``. ``.npz``: one array, or several with one named
  ``indices``.
- The array holds raw (logical) top-k token positions, ``[rows, k]``, int32 preferred (any integer
  dtype is read; uint64 values must fit in int64); leading dimensions beyond two are flattened into
  rows. ``-1`` marks an empty slot (rows shorter than k); no other negative value is allowed. Order
  inside a row does not matter and a repeated index counts once.
- Row ``r`` must be the same query token in every layer's file, and every file has the same shape, with
  at least one row and ``k >= 1``.

A file that cannot be read (corrupt, truncated, empty, refused by ``torch.load(weights_only=True)``) or
that breaks these rules raises :class:`DumpError` naming the file.

Overlap of layers ``i`` and ``j``: per row, ``|T_i ∩ T_j| / n_r`` where ``T`` are the row's valid
indices and ``n_r`` is the largest valid count any layer has in that row (k for full rows, so this is
the paper's ``|T_i ∩ T_j| / k``, and a short row whose layers agree still scores 1); averaged over the
rows with ``n_r > 0``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from indexcache.plan import LayerPlan

PRODUCER = "F"
SHARED = "S"
_C4_RATIO = 4
_LAYER_FILE = re.compile(r"^layer_(\d+)\.(pt|npz)$")
# Rows are bitmapped over [0, max index]; this many table entries (int64) per batch keeps it in cache.
_TABLE_ENTRIES = 1 << 17
# When the largest index exceeds this many times L layers x k slots, each row's indices are renumbered densely
# first (_compact, a sort), so a row's table stays within that, whatever the index values. Below it the table
# is the faster of the two (the sort costs about what a table of 10-20 x L x k entries does).
_COMPACT_FACTOR = 16
# Rows whose bitsets are intersected together: L x (rows x union/64) words stays around a megabyte.
_BLOCK_ROWS = 8

IndexArray = np.ndarray | torch.Tensor
Objective = Callable[[str], float]


class CalibrationError(ValueError):
    """Bad input to a calibration: indices, a setting (``keep``, ``producers``, a pattern) or layers that break a
    rule; the message names it."""


class DumpError(CalibrationError):
    """A dump that cannot be read, breaks the dump format or does not fit the model; the message names the file."""


class OutputError(CalibrationError):
    """The calibration's files could not be written into its output folder; the message names the folder and the
    file, and nothing of this calibration was left there."""


# --------------------------------------------------------------------------------------------- loading


def load_dump(path: str | os.PathLike[str]) -> tuple[list[int], list[np.ndarray]]:
    """Read a dump directory: the layer ids (ascending) and one ``[rows, k]`` integer array per layer.

    See the module docstring for the format. Raises ``FileNotFoundError`` for a missing or empty
    directory and :class:`DumpError` (a ``ValueError``) for a duplicate layer id, an unreadable or bad
    file, or mismatched shapes.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory")
    files: dict[int, Path] = {}
    for file in sorted(directory.iterdir()):
        match = _LAYER_FILE.match(file.name)
        if match is None:
            continue
        layer = int(match.group(1))
        if layer in files:
            raise DumpError(f"{directory}: layer {layer} appears twice ({files[layer].name}, {file.name})")
        files[layer] = file
    if not files:
        raise FileNotFoundError(f"{directory}: no layer_<id>.pt or layer_<id>.npz files")
    layers = sorted(files)
    arrays = [_read_layer(files[layer]) for layer in layers]
    _check_shapes(arrays, [str(files[layer]) for layer in layers], DumpError)
    return layers, arrays


def _read_layer(file: Path) -> np.ndarray:
    """One dump file as ``[rows, k]``; every way it can be unreadable or malformed is a :class:`DumpError`."""
    if file.stat().st_size == 0:
        raise DumpError(f"{file}: empty file (0 bytes)")
    if file.suffix == ".pt":
        try:
            value = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise DumpError(
                f"{file}: torch.load(weights_only=True) refused it: corrupt, or it pickles objects other than "
                "tensors; save one tensor with torch.save"
            ) from None
        except Exception as exc:  # torch reports a damaged file with many exception types
            raise DumpError(f"{file}: not a readable torch.save file ({_reason(exc)})") from None
        if not isinstance(value, torch.Tensor):
            raise DumpError(f"{file}: holds a {type(value).__name__}, expected one tensor [rows, k]")
        rows = _as_rows(value, str(file), DumpError)
    else:
        try:
            with np.load(file) as npz:
                names = list(npz.files)
                chosen = names[0] if len(names) == 1 else "indices" if "indices" in names else None
                value = None if chosen is None else npz[chosen]
        except Exception as exc:  # numpy and zipfile report a damaged file with many exception types
            raise DumpError(f"{file}: not a readable .npz archive ({_reason(exc)})") from None
        if value is None:
            raise DumpError(f"{file}: holds arrays {names}; expected one array, or one named 'indices'")
        rows = _as_rows(value, str(file), DumpError)
    if rows.size == 0:
        raise DumpError(f"{file}: shape {rows.shape}; need at least one row and k >= 1")
    low = int(rows.min())
    if low < -1:
        raise DumpError(f"{file}: holds {low}; -1 marks an empty slot and no other negative value is valid")
    return rows


def _reason(exc: Exception) -> str:
    """The first sentence of ``exc``'s message on one line, for an error that names the file."""
    text = str(exc).strip().split("\n")[0].split(". ")[0][:160]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _as_rows(value: IndexArray, what: str, error: type[ValueError] = CalibrationError) -> np.ndarray:
    """``value`` as a ``[rows, k]`` integer numpy array (leading dimensions flattened, no copy if possible).

    uint64 becomes int64 when every value fits (other integer dtypes mix with int64 exactly); problems
    raise ``error`` naming ``what``.
    """
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if not np.issubdtype(array.dtype, np.integer):
        raise error(f"{what}: dtype {array.dtype}; top-k indices must be integers (int32)")
    if array.ndim < 2:
        raise error(f"{what}: shape {tuple(array.shape)}; expected [rows, k]")
    if array.dtype == np.uint64:
        if array.size and int(array.max()) > np.iinfo(np.int64).max:
            raise error(
                f"{what}: uint64 value {int(array.max())} is beyond int64; top-k indices are token positions "
                "(int32 preferred, -1 for an empty slot)"
            )
        array = array.astype(np.int64)
    return array.reshape(math.prod(array.shape[:-1]), array.shape[-1])


def _check_shapes(
    arrays: Sequence[np.ndarray], names: Sequence[str], error: type[ValueError] = CalibrationError
) -> None:
    shape = arrays[0].shape
    for array, name in zip(arrays, names, strict=True):
        if array.shape != shape:
            raise error(
                f"{name}: shape {array.shape}, but {names[0]} has {shape}; every layer must hold the "
                "same query rows with the same k"
            )
    if shape[0] == 0 or shape[1] == 0:
        raise error(f"{names[0]}: shape {shape}; need at least one row and k >= 1")


# --------------------------------------------------------------------------------------------- overlap


def overlap_matrix(indices: Sequence[IndexArray], *, threads: int | None = None) -> np.ndarray:
    """Mean top-k overlap of every pair of layers: ``[L, L]`` float64, symmetric.

    ``indices[l]`` is layer ``l``'s ``[rows, k]`` integer array (numpy or torch; -1 = empty slot); every
    layer has the same shape and row ``r`` is the same query everywhere. ``out[i, j]`` averages
    ``|T_i ∩ T_j| / n_r`` over rows with ``n_r > 0`` (see the module docstring); the diagonal is 1 when
    every layer fills the same number of slots.

    Vectorized: each row's union of indices is ranked once, every layer becomes a bitset over that
    union, and a pair's intersection is a popcount of an AND. ``threads`` row blocks run at once
    (default: the CPUs this process may use). Memory grows with rows, layers and k, not with the index
    values: when the largest index exceeds ``16 * L * k``, each row's indices are renumbered densely first.
    """
    arrays = [_as_rows(a, f"indices[{i}]") for i, a in enumerate(indices)]
    if not arrays:
        raise CalibrationError("indices: no layers")
    _check_shapes(arrays, [f"indices[{i}]" for i in range(len(arrays))])
    low = min(int(a.min()) for a in arrays)
    if low < -1:
        raise CalibrationError(f"indices hold {low}; -1 marks an empty slot and no other negative value is valid")
    num, (rows, k) = len(arrays), arrays[0].shape
    span = max(int(a.max()) for a in arrays) + 2  # column 0 of each row's table takes the -1 slots
    compact = span > _COMPACT_FACTOR * num * k + 1
    if compact:  # a row holds at most num * k distinct indices: renumbered, they are 0 .. num * k - 1
        span = num * k + 1
    batch = max(1, min(_TABLE_ENTRIES // span, rows))
    block = max(_BLOCK_ROWS, batch)
    if not hasattr(np, "bitwise_count"):
        raise ImportError(f"overlap_matrix needs numpy >= 2.0 (np.bitwise_count); this is numpy {np.__version__}")
    workers = threads if threads is not None else usable_cpus()
    total = np.zeros((num, num))
    counted = 0
    with ThreadPoolExecutor(max(1, workers)) as pool:
        jobs = [
            pool.submit(_block_counts, arrays, start, min(rows, start + block), span, batch, compact)
            for start in range(0, rows, block)
        ]
        for job in jobs:
            counts = job.result()  # [L, L, rows], upper triangle
            fill = counts[np.arange(num), np.arange(num)].max(axis=0)
            total += counts @ np.where(fill > 0, 1.0 / np.maximum(fill, 1), 0.0)
            counted += int(np.count_nonzero(fill))
    if counted == 0:
        raise CalibrationError("indices: every slot of every row is -1; nothing to compare")
    total = np.triu(total) + np.triu(total, 1).T
    return total / counted


def usable_cpus() -> int:
    """CPUs this process may run on (the default number of row blocks processed at once)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _block_counts(
    arrays: Sequence[np.ndarray], start: int, stop: int, span: int, batch: int, compact: bool
) -> np.ndarray:
    """Intersection sizes ``[L, L, stop - start]`` (uint32, upper triangle) of rows ``start:stop``; with
    ``compact``, each row's indices are renumbered densely first (:func:`_compact`)."""
    block = np.stack([array[start:stop] for array in arrays])  # [L, rows, k]
    if compact:
        block = _compact(block)
    num, k = len(arrays), block.shape[2]
    keys = np.empty((num, batch, k), np.int64)
    words, row_words = [], []
    offset = 0
    for first in range(0, stop - start, batch):
        count = min(batch, stop - start - first)
        bits, row_start = _bitsets(block[:, first : first + count], span, keys[:, :count])
        words.append(bits)
        row_words.append(row_start + offset)
        offset += bits.shape[1]
    bits = np.concatenate(words, axis=1)
    row_start = np.concatenate(row_words)
    counts = np.zeros((num, num, stop - start), np.uint32)
    both = np.empty_like(bits)
    ones = np.empty(bits.shape, np.uint8)
    for i in range(num):
        np.bitwise_and(bits[i], bits[i:], out=both[i:])
        np.bitwise_count(both[i:], out=ones[i:])
        counts[i, i:] = np.add.reduceat(ones[i:], row_start, axis=1, dtype=np.uint32)
    return counts


def _compact(block: np.ndarray) -> np.ndarray:
    """``block [L, rows, k]`` with each row's indices replaced by their rank among the row's distinct
    indices over all layers (0 .. at most L * k - 1); -1 stays -1. Intersections are unchanged."""
    num, count, k = block.shape
    flat = block.transpose(1, 0, 2).reshape(count, num * k)
    order = np.argsort(flat, axis=1)
    ordered = np.take_along_axis(flat, order, axis=1)
    first = np.empty(ordered.shape, bool)  # first of its value in the row, and not -1
    first[:, 0] = True
    np.not_equal(ordered[:, 1:], ordered[:, :-1], out=first[:, 1:])
    first &= ordered >= 0
    rank = np.cumsum(first, axis=1, dtype=np.int32 if num * k < 2**31 else np.int64)
    rank -= 1  # the -1 slots sort first and keep -1
    out = np.empty_like(rank)
    np.put_along_axis(out, order, rank, axis=1)
    return out.reshape(count, num, k).transpose(1, 0, 2)


def _bitsets(rows: np.ndarray, span: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, ``rows [L, count, k]`` as bitsets over each row's union of indices (``keys``: scratch).

    Returns ``bits [L, words]`` uint64 and ``row_start [count]``, the first word of each row. A row gets
    slot 0 (for its -1 entries, cleared) plus one slot per distinct index, rounded up to whole words.
    """
    num, count = rows.shape[:2]
    np.add(rows, (np.arange(count, dtype=np.int64) * span + 1)[:, None], out=keys)
    present = np.zeros(count * span, bool)
    present[keys] = True
    present[::span] = False
    rank = np.cumsum(present, dtype=np.int64).reshape(count, span)  # union members up to here
    before = rank[:, 0].copy()
    row_words = (rank[:, -1] - before + 64) // 64
    row_start = np.zeros(count, np.int64)
    np.cumsum(row_words[:-1], out=row_start[1:])
    width = int(row_words.sum()) * 64
    rank += (row_start * 64 - before)[:, None]  # index -> its bit within the chunk (slot 0 for -1)
    slots = rank.reshape(-1)[keys]
    slots += (np.arange(num, dtype=np.int64) * width)[:, None, None]
    flags = np.zeros((num, width), bool)
    flags.reshape(-1)[slots] = True
    flags[:, row_start * 64] = False
    return np.packbits(flags, axis=1, bitorder="little").view(np.uint64), row_start


# ---------------------------------------------------------------------------------------------- search


def c4_layers(compress_ratios: Sequence[int]) -> list[int]:
    """The sparse layers of a DeepSeek-V4 style model: those whose compression ratio is 4 (C4)."""
    return [layer for layer, ratio in enumerate(compress_ratios) if ratio == _C4_RATIO]


def producer_budget(num_sparse: int, *, keep: float | None = None, producers: int | None = None) -> int:
    """How many producers to keep among ``num_sparse`` sparse layers: give exactly one of the two.

    ``keep`` is a fraction in (0, 1], rounded up (``keep=0.25`` of 61 layers keeps 16, as
    ``index_topk_freq=4`` does); ``producers`` is a count in 1..num_sparse.
    """
    if (keep is None) == (producers is None):
        raise CalibrationError("give exactly one of keep (a fraction of the sparse layers) and producers (a count)")
    if producers is not None:
        if isinstance(producers, bool) or not isinstance(producers, int) or not 1 <= producers <= num_sparse:
            raise CalibrationError(
                f"producers={producers!r}: must be an integer in 1..{num_sparse} (the sparse layers)"
            )
        return producers
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
        raise CalibrationError(f"keep={keep!r}: must be a fraction in (0, 1]; use producers= for a count")
    return max(1, math.ceil(keep * num_sparse - 1e-9))


def uniform_pattern(num_sparse: int, producers: int) -> str:
    """``producers`` producers spread evenly over ``num_sparse`` sparse layers, the first one included."""
    chosen = {i * num_sparse // producers for i in range(producers)}
    return "".join(PRODUCER if i in chosen else SHARED for i in range(num_sparse))


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
            value = float(self.objective(pattern))
            self.calls += 1
            if not math.isfinite(value):
                raise ValueError(f"objective({pattern!r}) = {value}; it must return a finite number")
            self.cache[pattern] = value
        return self.cache[pattern]


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
    pattern (pass a :class:`CachedObjective` to share the cache). Costs about ``n * (n - producers)``
    evaluations for ``n`` sparse layers.
    """
    ids = [int(layer) for layer in layers]
    if not ids or ids != sorted(set(ids)) or ids[0] < 0:
        raise CalibrationError(f"layers={list(layers)!r}: must be distinct, ascending, non-negative layer ids")
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


# ----------------------------------------------------------------------------------------- a calibration

DEFAULT_KEEP = 0.25


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate_arrays` found and wrote.

    ``source`` says in words where the indices came from; ``layers`` are the sparse layer ids, each holding
    ``rows`` rows of ``k`` indices; ``overlap`` is their ``[L, L]`` overlap matrix, measured in
    ``overlap_seconds`` on the CPU; ``search`` is the greedy search down to the producer budget; ``freq_rule``
    the ``index_topk_freq`` baselines, or None when they could not be compared (the layers could not be placed
    in a model); ``paths`` the files written (see :func:`write_outputs`); ``removed`` an earlier calibration's plots
    this one removed from the folder because it drew none.
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
    """
    if keep is None and producers is None:
        keep = DEFAULT_KEEP
    budget = producer_budget(len(layers), keep=keep, producers=producers)
    start = time.perf_counter()
    overlap = overlap_matrix(indices, threads=threads)
    seconds = time.perf_counter() - start
    objective = CachedObjective(overlap_objective(overlap), "overlap loss")
    search = greedy_search(layers, objective, producers=budget)
    freq_rule = None if plan_for is None else freq_baselines(layers, objective, plan_for, min_producers=budget)
    rows, k = _as_rows(indices[0], "indices[0]").shape
    report = {**(info or {}), "rows": rows, "k": k, "keep": keep, "overlap_seconds": round(seconds, 3)}
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
    )


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
    0..n-1 is taken for a model whose every layer is sparse, and other layer ids leave the rule uncompared.
    """
    layers, arrays = load_dump(dump)
    if config is None:
        plan_for = partial(LayerPlan, len(layers)) if layers == list(range(len(layers))) else None
    else:
        plan = LayerPlan.from_config(config)
        main_layers = plan.num_layers - plan.num_mtp_layers
        expected = [layer for layer in plan.sparse_layers if layer < main_layers]
        if layers != expected:
            missing, extra = sorted(set(expected) - set(layers)), sorted(set(layers) - set(expected))
            named = config if isinstance(config, (str, os.PathLike)) else "the config"
            raise DumpError(
                f"dump {dump} does not hold the sparse layers of {named}: missing {missing}, unexpected {extra} "
                "(MTP layers always run their own indexer and do not belong in the dump)"
            )
        plan_for = partial(LayerPlan.from_config, config)
    return calibrate_arrays(
        layers, arrays, out, keep=keep, producers=producers, plan_for=plan_for, source=f"dump {dump}",
        info={"dump": str(dump)}, threads=threads, plots=plots,
    )


# --------------------------------------------------------------------------------------------- outputs


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
