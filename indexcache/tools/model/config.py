"""The small model's settings: :class:`ModelConfig`, its presets, and the error for a setting that cannot be used.

Presets: ``"v32-like"`` (every layer sparse, k 2048) and ``"v4-like"`` (``compress_ratios``: only
ratio-4 layers have an indexer, k 512; KV compression itself is not modelled). Pass ``topk=`` to
scale k down for quick CPU runs; k only matters once contexts are longer than k.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class ModelSettingError(ValueError):
    """A setting of the small model or of a run of it (preset, sizes, backend) that cannot be used; the message
    names it."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and seeds of the small model (:mod:`indexcache.tools.model.dsa` says what each part does)."""

    num_layers: int = 12
    hidden: int = 256
    heads: int = 4
    head_dim: int = 64
    index_heads: int = 4
    index_dim: int = 128
    topk: int = 2048
    page_size: int = 64
    vocab: int = 1024
    window: int = 128
    compress_ratios: tuple[int, ...] | None = None
    block: int = 4
    block_share: float = 0.99
    global_share: float = 0.3
    residual_scale: float = 0.25
    index_dtype: str = "float8_e4m3fn"
    seed: int = 0

    @property
    def sparse_layers(self) -> list[int]:
        """Layers with an indexer: all, or the ratio-4 ones of ``compress_ratios``."""
        if self.compress_ratios is None:
            return list(range(self.num_layers))
        return [layer for layer, ratio in enumerate(self.compress_ratios) if ratio == 4]


_V4_RATIOS = (0, 0) + (4, 128) * 9

PRESETS: dict[str, ModelConfig] = {
    "v32-like": ModelConfig(),
    "v4-like": ModelConfig(num_layers=len(_V4_RATIOS), compress_ratios=_V4_RATIOS, topk=512),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The config of preset ``name`` ("v32-like" or "v4-like") with ``overrides`` (e.g. ``topk=64``)."""
    if name not in PRESETS:
        raise ModelSettingError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return dataclasses.replace(PRESETS[name], **overrides)
