"""Calibration dumps recorded from the small model (random seeded weights, **not a trained model**):
:func:`record_dump` (every sparse layer's top-k in one prefill) and :func:`calibrate_model` (``indexcache calibrate
--from-model``)."""

from __future__ import annotations

import contextlib
import os
from functools import partial

import numpy as np

from indexcache.hal import dispatch
from indexcache.plan import LayerPlan
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import IndexRecorder, TopkState
from indexcache.tools.calibrate.calibration import Calibration, calibrate_arrays, check_budget
from indexcache.tools.model.batch import Batch, random_prompts
from indexcache.tools.model.checks import backend_setup, check_fits, check_sizes
from indexcache.tools.model.config import ModelSettingError, preset
from indexcache.tools.model.dsa import DSAModel


def record_dump(
    name: str,
    *,
    backend: str | None = None,
    prompt_len: int = 512,
    batch: int = 2,
    topk: int = 128,
    seed: int = 0,
) -> tuple[list[int], list[np.ndarray]]:
    """A calibration dump from the small model: every sparse layer's top-k in one prefill.

    Builds preset ``name`` ("v32-like" or "v4-like"; random seeded weights, **not a trained model**)
    with top-k ``topk`` on ``backend`` (default: the automatic choice) and every sparse layer a
    producer, prefills ``batch`` random prompts of ``prompt_len`` tokens drawn from ``seed`` and records
    each sparse layer's raw indices (:class:`~indexcache.runtime.state.IndexRecorder`). Rows whose context is at
    most ``topk`` tokens are dropped: every layer selects all of them. Returns what
    :func:`indexcache.tools.calibrate.load_dump` returns: the sparse layer ids and one ``[rows, topk]`` int32 array
    each. The defaults are sizes for a CPU (seconds); the preset's own k (2048 / 512) and longer prompts suit
    a GPU. Bad sizes (top-k beyond :data:`~indexcache.plan.MAX_TOPK`, a seed beyond 64 bits, a run that needs more
    memory than the device has free: :func:`~indexcache.tools.model.checks.run_bytes`), an unknown preset or a
    backend that cannot run here raise :class:`ModelSettingError` before any work.
    """
    check_sizes(prompt_len=prompt_len, batch=batch, topk=topk, seed=seed)
    if prompt_len <= topk:
        raise ModelSettingError(
            f"prompt_len={prompt_len} must exceed topk={topk}: shorter contexts select every token"
        )
    _, avail, overrides = backend_setup(backend)
    config = preset(name, topk=topk, seed=seed, **overrides)
    check_fits(config, avail.device, batch=batch, prompt_len=prompt_len, record=True)
    with dispatch.use_backend(backend) if backend else contextlib.nullcontext():
        model = DSAModel(config, avail.device)
        runner = IndexerRunner(model.plan(1))
        cache = model.new_cache(batch, prompt_len, seed=seed)
        state = TopkState(batch * prompt_len, topk, model.device)
        recorder = IndexRecorder()
        state.recorder = recorder
        rows = Batch.prefill(random_prompts(config, batch, prompt_len, seed), cache.tables_for(range(batch)))
        model.run(rows, cache, runner, state)
    keep = (rows.lengths > topk).cpu()
    recorded = recorder.stacked()
    layers = config.sparse_layers
    return layers, [recorded[layer].cpu()[keep].numpy() for layer in layers]


def calibrate_model(
    name: str,
    out: str | os.PathLike[str],
    *,
    keep: float | None = None,
    producers: int | None = None,
    threads: int | None = None,
    plots: bool = True,
    backend: str | None = None,
    prompt_len: int | None = None,
    topk: int | None = None,
    seed: int | None = None,
) -> Calibration:
    """:func:`indexcache.tools.calibrate.calibrate_arrays` on a dump :func:`record_dump` records from preset ``name``.

    ``backend``, ``prompt_len``, ``topk`` and ``seed`` go to :func:`record_dump` (None: its default) and, when
    given, into ``report.json``; the ``index_topk_freq`` rule is compared on the preset's layers. A ``keep`` or
    ``producers`` the preset's sparse layers cannot take raises
    :class:`~indexcache.tools.calibrate.errors.CalibrationError` before the model runs.
    """
    config = preset(name)
    check_budget(len(config.sparse_layers), keep=keep, producers=producers)
    given = {"backend": backend, "prompt_len": prompt_len, "topk": topk, "seed": seed}
    given = {key: value for key, value in given.items() if value is not None}
    layers, arrays = record_dump(name, **given)
    return calibrate_arrays(
        layers, arrays, out, keep=keep, producers=producers,
        plan_for=partial(LayerPlan, config.num_layers, compress_ratios=config.compress_ratios),
        source=f"{name} model (random seeded weights, not a trained model), prefill",
        info={"model": name, "weights": "random seeded, not a trained model", **given}, threads=threads, plots=plots,
    )
