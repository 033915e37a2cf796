"""``indexcache demo``: the small model (random seeded weights, not a trained model) run with every sparse layer a
producer and with ``index_topk_freq``, prefill then decode, compared (:func:`run_demo`), and its plot
(:func:`plot_demo`)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from indexcache.hal import dispatch
from indexcache.tools.model.batch import random_prompts
from indexcache.tools.model.checks import backend_setup, check_fits, check_sizes
from indexcache.tools.model.comparison import PlanComparison, compare_plans
from indexcache.tools.model.config import ModelConfig, ModelSettingError, preset
from indexcache.tools.model.dsa import DSAModel


@dataclass(frozen=True)
class Demo:
    """What :func:`run_demo` ran: preset ``name`` at ``config`` on ``backend`` (``mode`` on ``device``), ``batch``
    prompts of ``prompt_len`` tokens then ``steps`` decode steps, and the ``comparison`` of the plan with every
    sparse layer a producer."""

    name: str
    config: ModelConfig
    backend: str
    mode: str
    device: str
    batch: int
    prompt_len: int
    steps: int
    comparison: PlanComparison


def run_demo(
    name: str = "v32-like",
    *,
    freq: int = 4,
    backend: str | None = None,
    batch: int = 2,
    prompt_len: int | None = None,
    decode_steps: int | None = None,
    topk: int | None = None,
    seed: int = 0,
) -> Demo:
    """Run preset ``name`` (random seeded weights, not a trained model) with every sparse layer a producer and
    with ``index_topk_freq=freq``, prefill then decode, on ``backend`` (None: the automatic choice): see
    :func:`compare_plans`.

    ``batch`` random prompts of ``prompt_len`` tokens (default 4096 on a GPU, 512 on a CPU), ``decode_steps``
    decode steps (default 32 on a GPU, 8 on a CPU), top-k ``topk`` (default: the preset's on a GPU, 128 on a
    CPU); weights and prompts from ``seed``. Bad sizes (as :func:`~indexcache.tools.model.calibration.record_dump`
    says; a prompt shorter than top-k too: the overlaps are measured on decode steps, and a context of at most k
    tokens selects every token, so every layer would select the same), an unknown preset or a backend that cannot
    run here raise :class:`~indexcache.tools.model.config.ModelSettingError` before any work.
    """
    check_sizes(freq=freq, batch=batch, prompt_len=prompt_len, decode_steps=decode_steps, topk=topk, seed=seed)
    chosen, avail, overrides = backend_setup(backend)
    gpu = avail.device != "cpu"
    config = preset(name, topk=topk or (preset(name).topk if gpu else 128), seed=seed, **overrides)
    prompt_len = prompt_len or (4096 if gpu else 512)
    steps = decode_steps or (32 if gpu else 8)
    if prompt_len < config.topk:
        raise ModelSettingError(
            f"prompt_len={prompt_len} must be at least topk={config.topk}: the overlaps are measured on decode steps, "
            "and a context of at most k tokens selects every token (every layer the same top-k, no drift)"
        )
    check_fits(config, avail.device, batch=batch, prompt_len=prompt_len, decode_steps=steps)
    with dispatch.use_backend(backend) if backend else contextlib.nullcontext():
        model = DSAModel(config, avail.device)
        comparison = compare_plans(model, model.plan(freq), random_prompts(config, batch, prompt_len, seed), steps)
    return Demo(name=name, config=config, backend=chosen, mode=avail.mode, device=avail.device, batch=batch,
                prompt_len=prompt_len, steps=steps, comparison=comparison)


def plot_demo(comparison: PlanComparison, path: str | os.PathLike[str]) -> Path:
    """A PNG at ``path`` of each sparse layer's top-k overlap with the producer it reuses (bars) and with the
    previous sparse layer (line), from :func:`compare_plans`; needs matplotlib. A comparison of no decode steps has
    no overlaps to draw (they are measured on decode steps): ``ValueError``."""
    if comparison.plan.sparse_layers and not comparison.overlap:
        raise ValueError("comparison: compared no decode steps, so it has no overlaps to plot (compare_plans measures "
                         "them on decode steps; give it steps >= 1)")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    plan = comparison.plan
    layers = plan.sparse_layers
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.subplots()
    colors = ["tab:blue" if plan.role(layer) == "S" else "tab:gray" for layer in layers]
    axes.bar(layers, [comparison.overlap[layer] for layer in layers], color=colors)
    adjacent = sorted(comparison.adjacent)
    (line,) = axes.plot(adjacent, [comparison.adjacent[layer] for layer in adjacent], "o--", color="tab:orange",
                        label="vs the previous sparse layer")
    handles = [Patch(color="tab:blue", label="shared layer vs the producer it reuses"),
               Patch(color="tab:gray", label="producer (its own top-k)"), line]
    axes.set_ylim(0, 1.05)
    axes.set_xlabel("layer")
    axes.set_ylabel("top-k overlap (fraction of k)")
    axes.set_title(f"IndexCache demo, roles {plan.roles}: random-weight model, not a trained one")
    figure.legend(handles=handles, loc="outside lower center", ncols=3, fontsize="small")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return Path(path)
