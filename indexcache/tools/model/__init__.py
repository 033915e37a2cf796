"""A small DSA model with random seeded weights, to run IndexCache end to end on any backend.

**This is not a trained model**, and nothing it outputs means anything (:mod:`~indexcache.tools.model.dsa` says what
it is and why its indexers are correlated on purpose).

- :mod:`~indexcache.tools.model.config` — :class:`ModelConfig`, the presets, :class:`ModelSettingError`;
- :mod:`~indexcache.tools.model.functional` — Hadamard rotation, RoPE, sparse attention;
- :mod:`~indexcache.tools.model.batch` — the rows of a forward, random prompts;
- :mod:`~indexcache.tools.model.cache` — the per-layer paged KV and index-K caches;
- :mod:`~indexcache.tools.model.dsa` — :class:`DSAModel`: weights, forward, generation;
- :mod:`~indexcache.tools.model.static_decode` — a decode step for CUDA-graph capture;
- :mod:`~indexcache.tools.model.comparison` — a plan against every sparse layer a producer;
- :mod:`~indexcache.tools.model.checks` — sizes, backend and memory, checked before any work;
- :mod:`~indexcache.tools.model.demo`, :mod:`~indexcache.tools.model.calibration` — the runs of the whole model.

Runs of the whole model: :func:`run_demo` (``indexcache demo``: a plan against every sparse layer a producer),
:func:`record_dump` (every sparse layer's top-k, a calibration dump) and :func:`calibrate_model` (``indexcache
calibrate --from-model``). A setting they cannot use raises :class:`ModelSettingError`, before any work: a size out
of its range (top-k at most :data:`~indexcache.plan.MAX_TOPK`, seeds of 64 bits) and a run whose memory
(:func:`~indexcache.tools.model.checks.run_bytes`) exceeds what the device has free.
"""

from indexcache.tools.model.calibration import calibrate_model, record_dump
from indexcache.tools.model.config import ModelConfig, ModelSettingError, preset
from indexcache.tools.model.demo import Demo, plot_demo, run_demo
from indexcache.tools.model.dsa import DSAModel

__all__ = ["DSAModel", "Demo", "ModelConfig", "ModelSettingError", "calibrate_model", "plot_demo", "preset",
           "record_dump", "run_demo"]
