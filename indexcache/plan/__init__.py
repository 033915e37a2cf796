"""The layer plan: which layers compute top-k indices (producers, F), which reuse them (shared, S), and
which have no indexer at all.

Every schedule form that ships in model configs resolves here, with SGLang's precedence:
``indexer_types``, then ``cli_factor`` > 1, then ``index_topk_pattern``, then ``index_topk_freq`` with
``index_skip_topk_offset``. The schedule counts *sparse* layers (those with an indexer): every layer of
a DeepSeek-V3.2 / GLM-style model, only the ratio-4 (C4) layers of a DeepSeek-V4 ``compress_ratios``
model. MTP (NextN) layers come after the main layers and always compute their own top-k. Every
invalid input raises :class:`ConfigError` (a ``ValueError``) naming the key, the value and the rule; every
count is bounded by what a real model could have (``MAX_LAYERS`` and the other ``MAX_*`` below), and a config
file that is not UTF-8 JSON, is larger than ``jsontext.MAX_JSON_BYTES`` or nests deeper than the parser can
follow is a :class:`ConfigError` naming the file too.

A config may hold any other keys (real model configs have many), except keys that look like a
misspelt schedule key, which would otherwise leave the schedule unset without a word: a key that
starts with ``index_topk_`` or ``index_skip_`` (the schedule keys' own prefixes), or whose lower-cased
name is a near-miss of a schedule key (``difflib`` ratio >= 0.83: a letter or two dropped, added or
swapped, a plural, another case), is refused with the schedule key it resembles.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, pairwise
from typing import Any

from indexcache.plan.jsontext import read_json, shown

PRODUCER = "F"
SHARED = "S"
NO_INDEXER = "."

# The schedule keys, highest precedence first; the offset belongs to the freq rule.
SCHEDULE_KEYS = ("indexer_types", "cli_factor", "index_topk_pattern", "index_topk_freq")
_SCHEDULE_RANK = {**{key: i for i, key in enumerate(SCHEDULE_KEYS)}, "index_skip_topk_offset": 3}
_LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers")
# The optional keyword arguments of LayerPlan, which are also the config keys read.
CONFIG_KEYS = (
    "index_topk_freq",
    "index_skip_topk_offset",
    "index_topk_pattern",
    "indexer_types",
    "cli_factor",
    "compress_ratios",
    "num_nextn_predict_layers",
    "index_topk",
    "index_n_heads",
    "index_head_dim",
    "index_dtype",
    "page_size",
)
_C4_RATIO = 4
# DeepSeek-V4 compress_ratios values: 0 sliding window only, 4 compressed with an indexer (C4), 128 heavily
# compressed (HCA). Any other value is refused rather than taken as "no indexer".
COMPRESS_RATIOS = {0: "sliding window", _C4_RATIO: "C4, with an indexer", 128: "HCA"}
# The index-K cache dtypes a plan (and so a P/D descriptor) may name: torch dtype names, one spelling
# each, so that equal layouts give equal signatures.
INDEX_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz", "bfloat16", "float4_e2m1fn_x2")  # the last: MXFP4 (docs/fp4.md)
# Unknown config keys that are refused as misspelt schedule keys (see the module docstring).
_SCHEDULE_NAMES = (*SCHEDULE_KEYS, "index_skip_topk_offset")
_SCHEDULE_PREFIXES = ("index_topk_", "index_skip_")
_NEAR_MISS = 0.83
# A ratio of _NEAR_MISS needs 2 * matches / (len(a) + len(b)) >= 0.83, so no longer key can be a near-miss.
_LONGEST_NEAR_MISS = int(max(map(len, _SCHEDULE_NAMES)) * (2 - _NEAR_MISS) / _NEAR_MISS)
# Without an explicit offset the freq rule is the DSA one, skip(l) = max(l - 1, 0) % freq != 0 (offset
# 2) for V3.2 / GLM, and skip(r) = r % freq != 0 over C4 ranks (offset 1) for compress_ratios models.
_DEFAULT_OFFSET = 2
_DEFAULT_C4_OFFSET = 1

# What a config may hold, each bound a margin beyond any real model, so that a mistyped or hostile config is
# refused (ConfigError naming the key, the value and the bound) before it costs time or memory. README, "The
# layer plan", lists them; list lengths (patterns, indexer_types, compress_ratios) are bounded by the layers.
MAX_LAYERS = 4096  # released models have at most a few hundred layers (DeepNet trained 1,000)
MAX_MTP_LAYERS = 64  # released models' MTP (NextN) modules predict one to three tokens ahead
MAX_TOPK = 65536  # what the ops select at most (indexcache.hal.checks.MAX_TOPK); shipped models take 512-2048
MAX_INDEX_HEADS = 1024  # released indexers have 32-64 heads, and attention at most 128
MAX_INDEX_HEAD_DIM = 4096  # released index heads are 128 wide; 4096 is a whole hidden state of a large model
MAX_PAGE_SIZE = 2**20  # engines page their caches by 1-256 tokens; 2^20 holds a 1M-token context in one page
# A deployment's serving limits as `indexcache warmup` takes them (indexcache.tools.warmup): past them a step's shapes
# overflow what the ops and their workspace bound take (a query row over 2^28 keys needs more than the prefill
# producer's default 2 GiB), and each draft token a request adds its own kernel variants (next_n is a kernel constant).
SERVING_LIMITS = {"max_batch": 2**20, "max_context": 2**27, "max_next_n": 16, "max_prefill": 2**27}
MAX_CONFIG_KEYS = 4096  # a config.json has some tens of top-level keys; each is compared with the schedule keys
# index_topk_freq, index_skip_topk_offset and cli_factor are bounded by MAX_LAYERS: past the layer count a
# larger period or offset changes nothing.


class ConfigError(ValueError):
    """A model config, an override or a plan argument that breaks a rule; the message names the key, the value
    and the rule."""


def _check_int(key: str, value: Any, minimum: int, rule: str, maximum: int, bound: str) -> int:
    """``value`` if it is an int (not a bool) in ``minimum..maximum``; else :class:`ConfigError` giving ``rule``
    (below the minimum or not an int) or the bound named ``bound`` (above the maximum)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={shown(value)}: {rule}")
    if value > maximum:
        raise ConfigError(f"{key}={shown(value)}: must be at most {maximum} (indexcache.plan.{bound})")
    return value


def _positive(key: str, value: Any, maximum: int = MAX_LAYERS, bound: str = "MAX_LAYERS") -> int:
    return _check_int(key, value, 1, "must be an integer >= 1", maximum, bound)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: layers ``start .. stop - 1`` and what crosses its edges.

    ``carry_in`` is the producer whose indices the stage must receive from the previous stage (None
    when it needs none); ``carry_out`` the producer whose indices it must send to the next one (also
    when it only passes them through). ``promoted`` lists the shared layers this split turned into
    producers (mode "promote"): they need indexer weights and an index-K cache.
    """

    index: int
    start: int
    stop: int
    roles: str
    carry_in: int | None
    carry_out: int | None
    promoted: tuple[int, ...]

    @property
    def producers(self) -> list[int]:
        """Layer ids (model-wide) that compute top-k in this stage."""
        return [self.start + i for i, r in enumerate(self.roles) if r == PRODUCER]

    @property
    def shared(self) -> list[int]:
        """Layer ids (model-wide) that reuse top-k in this stage."""
        return [self.start + i for i, r in enumerate(self.roles) if r == SHARED]


class LayerPlan:
    """Per-layer roles of a DSA model under IndexCache.

    ``roles`` is a string with one character per layer (MTP layers last): ``F`` producer, ``S`` shared,
    ``.`` no indexer; ``schedule`` names the config key that decided it. Keyword arguments carry the
    config keys' own names, so an error names what the config says:
    ``LayerPlan(61, index_topk_freq=4)``. ``None`` means "not set" for every optional key. Besides the
    schedule, the plan keeps what a P/D descriptor needs: ``top_k``, ``index_n_heads``,
    ``index_head_dim``, ``index_dtype`` (one of :data:`INDEX_DTYPES`) and ``page_size`` (the index-K
    cache's tokens a page).
    """

    def __init__(
        self,
        num_hidden_layers: int,
        *,
        index_topk_freq: int | None = None,
        index_skip_topk_offset: int | None = None,
        index_topk_pattern: str | None = None,
        indexer_types: Sequence[str] | None = None,
        cli_factor: int | None = None,
        compress_ratios: Sequence[int] | None = None,
        num_nextn_predict_layers: int | None = None,
        index_topk: int | None = None,
        index_n_heads: int | None = None,
        index_head_dim: int | None = None,
        index_dtype: str | None = None,
        page_size: int | None = None,
    ) -> None:
        num_main = _positive("num_hidden_layers", num_hidden_layers)
        num_mtp = _check_int(
            "num_nextn_predict_layers",
            0 if num_nextn_predict_layers is None else num_nextn_predict_layers,
            0,
            "must be an integer >= 0",
            MAX_MTP_LAYERS,
            "MAX_MTP_LAYERS",
        )
        self.top_k = _positive("index_topk", 2048 if index_topk is None else index_topk, MAX_TOPK, "MAX_TOPK")
        self.index_n_heads = _positive(
            "index_n_heads", 64 if index_n_heads is None else index_n_heads, MAX_INDEX_HEADS, "MAX_INDEX_HEADS"
        )
        self.index_head_dim = _positive(
            "index_head_dim", 128 if index_head_dim is None else index_head_dim, MAX_INDEX_HEAD_DIM,
            "MAX_INDEX_HEAD_DIM",
        )
        self.page_size = _positive("page_size", 64 if page_size is None else page_size, MAX_PAGE_SIZE, "MAX_PAGE_SIZE")
        self.index_dtype = check_index_dtype("float8_e4m3fn" if index_dtype is None else index_dtype)
        self.num_mtp_layers = num_mtp

        sparse_flags = _sparse_flags(compress_ratios, num_main, num_mtp)
        main_sparse = [layer for layer in range(num_main) if sparse_flags[layer]]
        freq = _positive_or_default(
            "index_topk_freq",
            index_topk_freq,
            "must be an integer >= 1 (null means 1); bools and floats are rejected",
        )
        offset = _positive_or_default(
            "index_skip_topk_offset",
            index_skip_topk_offset,
            "must be an integer >= 1 (skip(l) = max(l - offset + 1, 0) % freq != 0)",
        )
        factor = _positive_or_default("cli_factor", cli_factor, "must be an integer >= 1")
        from_types = _per_sparse_layer(
            "indexer_types", indexer_types, {"full": False, "shared": True}, num_main, main_sparse
        )
        from_pattern = _per_sparse_layer(
            "index_topk_pattern", index_topk_pattern, {PRODUCER: False, SHARED: True}, num_main, main_sparse
        )
        if offset is None:
            offset = _DEFAULT_OFFSET if compress_ratios is None else _DEFAULT_C4_OFFSET
        freq = 1 if freq is None else freq

        if from_types is not None:
            self.schedule, skips = "indexer_types", from_types
        elif factor is not None and factor > 1:
            self.schedule, skips = "cli_factor", [rank % factor != 0 for rank in range(len(main_sparse))]
        elif from_pattern is not None:
            self.schedule, skips = "index_topk_pattern", from_pattern
        else:
            self.schedule = "index_topk_freq"
            skips = [max(rank - offset + 1, 0) % freq != 0 for rank in range(len(main_sparse))]

        roles = [NO_INDEXER if not flag else PRODUCER for flag in sparse_flags]
        for layer, skip in zip(main_sparse, skips, strict=True):
            roles[layer] = SHARED if skip else PRODUCER
        self.roles: str = "".join(roles)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any) -> LayerPlan:
        """A plan from a model config (a dict or the path of a ``config.json``).

        The layer count comes from ``num_hidden_layers`` or ``num_layers``; a config without one at its top level
        that holds a ``text_config`` object (a multimodal model's, as Hugging Face writes them) is read from that
        object, and one with a layer count beside a ``text_config`` holding keys this reads (``CONFIG_KEYS``) is
        refused as ambiguous, as is one that reads its layer count from ``text_config`` while its top level holds such
        keys (or a key that looks like a misspelt schedule key). ``overrides`` replace config keys (``None`` values
        are ignored); an override of a schedule key also drops the config's keys of higher precedence, so the
        override is the one that takes effect. A config key that looks like a misspelt schedule key raises
        :class:`ConfigError` (see the module docstring); other unknown keys are ignored. A file that cannot be opened
        raises ``OSError``; one that is not a UTF-8 JSON object of at most ``jsontext.MAX_JSON_BYTES`` raises
        :class:`ConfigError` naming it.
        """
        cfg = _language_model(dict(_load(config)))
        if len(cfg) > MAX_CONFIG_KEYS:
            raise ConfigError(
                f"config has {len(cfg)} top-level keys: must be at most {MAX_CONFIG_KEYS} "
                "(indexcache.plan.MAX_CONFIG_KEYS)"
            )
        _check_unknown_keys(cfg)
        given = {key: value for key, value in overrides.items() if value is not None}
        unknown = sorted(set(given) - set(CONFIG_KEYS))
        if unknown:
            raise ConfigError(f"overrides {unknown}: unknown keys; expected some of {list(CONFIG_KEYS)}")
        for key in given:
            if key in _SCHEDULE_RANK:
                for higher in SCHEDULE_KEYS[: _SCHEDULE_RANK[key]]:
                    if higher not in given:
                        cfg.pop(higher, None)
        cfg.update(given)
        count_key = next((key for key in _LAYER_COUNT_KEYS if cfg.get(key) is not None), None)
        if count_key is None:
            raise ConfigError("config has no layer count: expected num_hidden_layers or num_layers")
        num_layers = _positive(count_key, cfg[count_key])
        return cls(num_layers, **{key: cfg[key] for key in CONFIG_KEYS if cfg.get(key) is not None})

    def __repr__(self) -> str:
        return f"LayerPlan(roles={self.roles!r}, schedule={self.schedule!r})"

    @property
    def num_layers(self) -> int:
        """All layers, the MTP layers included."""
        return len(self.roles)

    @property
    def sparse_layers(self) -> list[int]:
        """Layers that have an indexer (producers and shared)."""
        return [layer for layer, r in enumerate(self.roles) if r != NO_INDEXER]

    @property
    def producers(self) -> list[int]:
        """Layers that run their indexer and compute top-k."""
        return [layer for layer, r in enumerate(self.roles) if r == PRODUCER]

    @property
    def shared(self) -> list[int]:
        """Layers that skip their indexer and reuse an earlier producer's top-k."""
        return [layer for layer, r in enumerate(self.roles) if r == SHARED]

    @property
    def sources(self) -> dict[int, int]:
        """Shared layer id → the producer whose indices it reuses."""
        return {layer: self.source_of(layer) for layer in self.shared}

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer!r} is not in 0..{self.num_layers - 1}")

    def role(self, layer: int) -> str | None:
        """``"F"``, ``"S"``, or None for a layer without an indexer."""
        self._check_layer(layer)
        r = self.roles[layer]
        return None if r == NO_INDEXER else r

    def source_of(self, layer: int) -> int | None:
        """The producer whose indices ``layer`` uses: itself for a producer, the nearest earlier producer
        for a shared layer, None for a layer without an indexer."""
        self._check_layer(layer)
        if self.roles[layer] == NO_INDEXER:
            return None
        return self.roles.rindex(PRODUCER, 0, layer + 1)

    def keeps_topk(self, layer: int) -> bool:
        """True when the next sparse layer after ``layer`` is shared, so the indices ``layer`` uses must
        outlive it (SGLang's ``next_skip_topk``)."""
        self._check_layer(layer)
        if self.roles[layer] == NO_INDEXER:
            return False
        following = self.roles[layer + 1 :].replace(NO_INDEXER, "")
        return following[:1] == SHARED

    def needs_index_k_cache(self, layer: int) -> bool:
        """Whether ``layer`` needs an index-K cache: only producers read their own keys."""
        return self.role(layer) == PRODUCER

    @property
    def index_k_cache_layers(self) -> frozenset[int]:
        """The layers that need an index-K cache (the producers); shared layers can skip allocating it."""
        return frozenset(self.producers)

    def split_stages(self, boundaries: Sequence[int], mode: str = "carry") -> list[Stage]:
        """Split into pipeline stages; each boundary is the first layer of a new stage.

        ``"carry"`` keeps every role: a stage whose first sparse layer is shared receives the producer's
        indices from the previous stage (``Stage.carry_in``). ``"promote"`` makes the first sparse layer
        of each stage a producer, so nothing crosses a boundary; it is refused for an ``indexer_types``
        plan, whose shared layers ship no indexer weights.
        """
        if mode not in ("carry", "promote"):
            raise ConfigError(f"mode={mode!r}: must be 'carry' or 'promote'")
        edges = [0, *_check_boundaries(boundaries, self.num_layers), self.num_layers]
        spans = list(pairwise(edges))
        roles = list(self.roles)
        promoted: set[int] = set()
        for start, stop in spans if mode == "promote" else ():
            first = next((layer for layer in range(start, stop) if roles[layer] != NO_INDEXER), None)
            if first is not None and roles[first] == SHARED:
                if self.schedule == "indexer_types":
                    raise ConfigError(
                        f"mode='promote': the stage starting at layer {start} would make layer {first} a "
                        "producer, but indexer_types marks it 'shared' and such layers ship no indexer "
                        "weights; use mode='carry'"
                    )
                roles[first] = PRODUCER
                promoted.add(first)
        split = "".join(roles)
        return [
            Stage(
                index=i,
                start=start,
                stop=stop,
                roles=split[start:stop],
                carry_in=_carried_into(split, start),
                carry_out=_carried_into(split, stop),
                promoted=tuple(sorted(layer for layer in promoted if start <= layer < stop)),
            )
            for i, (start, stop) in enumerate(spans)
        ]


    def for_stage(self, stage: Stage) -> LayerPlan:
        """This plan as pipeline ``stage`` runs it: the stage's roles over its layers (so a ``"promote"`` split's
        promoted layers are producers), the plan's roles elsewhere. :meth:`role` and :meth:`source_of` of the
        result answer for the stage's layers. A stage of another plan (another span, or roles that are not this
        plan's with at most shared layers promoted) raises :class:`ConfigError`."""
        if not isinstance(stage, Stage):
            raise TypeError(f"stage: expected a Stage (from split_stages), got {type(stage).__name__}")
        if not 0 <= stage.start < stage.stop <= self.num_layers or len(stage.roles) != stage.stop - stage.start:
            raise ConfigError(
                f"stage: layers {stage.start}..{stage.stop - 1} do not fit the plan's {self.num_layers} layers"
            )
        own = self.roles[stage.start : stage.stop]
        if any(r != o and (o, r) != (SHARED, PRODUCER) for r, o in zip(stage.roles, own, strict=True)):
            raise ConfigError(
                f"stage: roles {shown(stage.roles)} over layers {stage.start}..{stage.stop - 1} are not this plan's "
                f"({shown(own)}) with shared layers promoted; a stage of another plan?"
            )
        plan = copy.copy(self)
        plan.roles = self.roles[: stage.start] + stage.roles + self.roles[stage.stop :]
        return plan


def _carried_into(roles: str, start: int) -> int | None:
    """The producer before ``start`` whose indices layers from ``start`` on still reuse, if any."""
    following = roles[start:].replace(NO_INDEXER, "")
    if following[:1] != SHARED:
        return None
    return roles.rindex(PRODUCER, 0, start)


def _check_boundaries(boundaries: Sequence[int], num_layers: int) -> list[int]:
    if not isinstance(boundaries, Iterable):
        expected = f"expected a list of layer ids, got {type(boundaries).__name__}"
        raise TypeError(f"boundaries={shown(boundaries)}: {expected}")
    values = list(islice(boundaries, num_layers))  # more than num_layers - 1 cannot all be new stages
    ok = all(isinstance(b, int) and not isinstance(b, bool) and 0 < b < num_layers for b in values)
    if not ok or len(values) >= num_layers or any(a >= b for a, b in pairwise(values)):
        raise ConfigError(
            f"boundaries={shown(boundaries)}: must be strictly increasing layer ids in 1..{num_layers - 1}, "
            "each the first layer of a new stage"
        )
    return values


def check_index_dtype(value: Any) -> str:
    """``value`` if it is one of :data:`INDEX_DTYPES`; otherwise :class:`ConfigError` naming the accepted names."""
    if isinstance(value, str) and value in INDEX_DTYPES:
        return value
    close = []
    if isinstance(value, str) and len(value) <= 64:
        close = difflib.get_close_matches(value.lower().removeprefix("torch."), INDEX_DTYPES, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    names = ", ".join(map(repr, INDEX_DTYPES))
    raise ConfigError(f"index_dtype={shown(value)}: must be one of {names} (torch dtype names){hint}")


def _language_model(cfg: dict[str, Any]) -> dict[str, Any]:
    """The part of a config that describes the language model: ``cfg`` itself, or its ``text_config`` object when
    ``cfg`` has no layer count of its own (:meth:`LayerPlan.from_config`)."""
    sub = cfg.get("text_config")
    if not isinstance(sub, Mapping):
        return cfg
    if all(cfg.get(key) is None for key in _LAYER_COUNT_KEYS):
        # The language model is read from text_config: a key this reads at the top level would be dropped.
        outer = [key for key in CONFIG_KEYS if cfg.get(key) is not None]
        if outer:
            raise ConfigError(
                f"config has {', '.join(map(repr, outer))} at its top level and its layer count under text_config: "
                "ambiguous (the language model is read from text_config); move the keys into text_config"
            )
        _check_unknown_keys({key: value for key, value in cfg.items() if key != "text_config"})
        return dict(sub)
    nested = [key for key in CONFIG_KEYS if key in sub]
    if nested:
        raise ConfigError(
            f"config has a layer count at its top level and {', '.join(map(repr, nested))} under text_config: "
            "ambiguous; pass the language model's config alone (or without text_config)"
        )
    return cfg


def _check_unknown_keys(cfg: Mapping[str, Any]) -> None:
    """Refuse a config key that is not read but looks like a misspelt schedule key (module docstring)."""
    for key in cfg:
        if not isinstance(key, str) or key in CONFIG_KEYS or key in _LAYER_COUNT_KEYS:
            continue
        if len(key) > _LONGEST_NEAR_MISS and not key.lower().startswith(_SCHEDULE_PREFIXES):
            continue  # too long to be a near-miss: no need to compare it
        name = key.lower()
        close = difflib.get_close_matches(name, _SCHEDULE_NAMES, n=1, cutoff=_NEAR_MISS)
        if close or name.startswith(_SCHEDULE_PREFIXES):
            guess = close or difflib.get_close_matches(name, _SCHEDULE_NAMES, n=1, cutoff=0.0)
            raise ConfigError(
                f"config key {shown(key)}: not a key indexcache reads, and it looks like a misspelt schedule key; "
                f"did you mean {guess[0]!r}? (the schedule keys: {', '.join(_SCHEDULE_NAMES)})"
            )


def _positive_or_default(key: str, value: Any, rule: str) -> int | None:
    return None if value is None else _check_int(key, value, 1, rule, MAX_LAYERS, "MAX_LAYERS")


def _sparse_flags(compress_ratios: Sequence[int] | None, num_main: int, num_mtp: int) -> list[bool]:
    """Per layer (MTP included), whether it has an indexer."""
    if compress_ratios is None:
        return [True] * (num_main + num_mtp)
    if isinstance(compress_ratios, (str, bytes)) or not isinstance(compress_ratios, Sequence):
        raise ConfigError(f"compress_ratios={shown(compress_ratios)}: must be a list of integers, one per layer")
    if len(compress_ratios) not in (num_main, num_main + num_mtp):  # the length first: it bounds the work
        lengths = sorted({num_main, num_main + num_mtp})
        raise ConfigError(
            f"compress_ratios={shown(compress_ratios)}: has {len(compress_ratios)} entries; expected one per layer "
            f"({' or '.join(map(str, lengths))}, MTP layers optional)"
        )
    ratios = list(compress_ratios)
    for i, ratio in enumerate(ratios):
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio not in COMPRESS_RATIOS:
            allowed = ", ".join(f"{value} ({meaning})" for value, meaning in COMPRESS_RATIOS.items())
            raise ConfigError(
                f"compress_ratios[{i}]={shown(ratio)}: layer {i}'s compression ratio must be one of {allowed}"
            )
    # MTP layers the list does not cover run their own indexer.
    return [ratio == _C4_RATIO for ratio in ratios] + [True] * (num_main + num_mtp - len(ratios))


def _per_sparse_layer(
    key: str, value: Any, meaning: dict[str, bool], num_main: int, sparse: list[int]
) -> list[bool] | None:
    """Skip flags, one per sparse main layer, from a per-layer or per-sparse-layer value (None if unset)."""
    if value is None:
        return None
    allowed = " or ".join(map(repr, meaning))
    if key == "index_topk_pattern" and not isinstance(value, str):
        raise ConfigError(f"{key}={shown(value)}: must be a string of {allowed}, one per layer or per sparse layer")
    if key != "index_topk_pattern" and (isinstance(value, str) or not isinstance(value, Sequence)):
        raise ConfigError(f"{key}={shown(value)}: must be a list of {allowed}, one per layer or per sparse layer")
    expected = f"not the layer count ({num_main})"
    if len(sparse) != num_main:
        expected = f"neither the layer count ({num_main}) nor the sparse layer count ({len(sparse)})"
    if len(value) > num_main:  # too long whatever it holds: refused before its entries are read
        raise ConfigError(f"{key}={shown(value)}: has {len(value)} entries, {expected}")
    items = list(value)
    for i, item in enumerate(items):
        if not isinstance(item, str) or item not in meaning:
            raise ConfigError(f"{key}={shown(value)}: position {i} is {shown(item)}; only {allowed} are allowed")
    if len(items) == num_main:
        items = [items[layer] for layer in sparse]
    elif len(items) != len(sparse):
        raise ConfigError(f"{key}={shown(value)}: has {len(items)} entries, {expected}")
    skips = [meaning[item] for item in items]
    if skips and skips[0]:
        compute = next(name for name, skip in meaning.items() if not skip)
        raise ConfigError(
            f"{key}={shown(value)}: the first sparse layer (layer {sparse[0]}) is {items[0]!r}, but a shared "
            f"layer needs an earlier producer; it must be {compute!r}"
        )
    return skips


def _load(config: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    where = ""
    if isinstance(config, (str, os.PathLike)):
        where = f"{os.fspath(config)}: "
        config = read_json(config, ConfigError)
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where}config must be a JSON object (a dict), got {type(config).__name__}")
    return config
