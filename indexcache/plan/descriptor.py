"""The P/D descriptor: what a prefill engine and a decode engine must agree on before index state moves.

A descriptor is a signature plus the producer-layer set. The signature is a sha256 over a canonical
JSON of the layout both sides must share (schema version, layer count, which layers are sparse, top-k,
index heads, head dim, index dtype, page size). The schedule (freq, pattern) is left out on purpose:
decode may run a different plan as long as every decode producer is also a prefill producer, so the
index-K cache it needs was computed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from indexcache.plan import (
    MAX_INDEX_HEAD_DIM,
    MAX_INDEX_HEADS,
    MAX_LAYERS,
    MAX_MTP_LAYERS,
    MAX_PAGE_SIZE,
    MAX_TOPK,
    ConfigError,
    LayerPlan,
    check_index_dtype,
)
from indexcache.plan.jsontext import parse_json, shown

SCHEMA_VERSION = 1
SIGNED_FIELDS = (
    "schema_version",
    "num_layers",
    "sparse_layers",
    "top_k",
    "index_n_heads",
    "index_head_dim",
    "index_dtype",
    "page_size",
)
# The plan's bounds (indexcache.plan) on the counts a descriptor carries: its layers are a plan's, MTP included.
_BOUNDS = {
    "num_layers": (MAX_LAYERS + MAX_MTP_LAYERS, "MAX_LAYERS + MAX_MTP_LAYERS"),
    "top_k": (MAX_TOPK, "MAX_TOPK"),
    "index_n_heads": (MAX_INDEX_HEADS, "MAX_INDEX_HEADS"),
    "index_head_dim": (MAX_INDEX_HEAD_DIM, "MAX_INDEX_HEAD_DIM"),
    "page_size": (MAX_PAGE_SIZE, "MAX_PAGE_SIZE"),
}


class DescriptorError(ValueError):
    """A descriptor, a payload of one or the ranks' reports that break a rule; the message names the field."""


class PDIncompatibleError(DescriptorError):
    """Prefill and decode descriptors do not fit together.

    ``differences`` maps each differing signed field to ``(prefill value, decode value)``; ``uncovered``
    lists the decode producers that prefill does not compute.
    """

    def __init__(self, differences: dict[str, tuple[Any, Any]], uncovered: tuple[int, ...], message: str):
        super().__init__(message)
        self.differences = differences
        self.uncovered = uncovered


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Descriptor:
    """The layout a prefill/decode pair must share, and the layers that compute top-k."""

    num_layers: int
    sparse_layers: tuple[int, ...]
    top_k: int
    index_n_heads: int
    index_head_dim: int
    index_dtype: str
    page_size: int
    producers: tuple[int, ...]
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for name, (maximum, bound) in _BOUNDS.items():
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise DescriptorError(f"{name}={shown(value)}: must be an integer >= 1")
            if value > maximum:
                raise DescriptorError(f"{name}={shown(value)}: must be at most {maximum} (indexcache.plan.{bound})")
        if not _is_int(self.schema_version) or self.schema_version != SCHEMA_VERSION:
            raise DescriptorError(
                f"schema_version={shown(self.schema_version)}: must be the integer {SCHEMA_VERSION}, the version "
                "this indexcache reads"
            )
        try:
            check_index_dtype(self.index_dtype)
        except ConfigError as exc:
            raise DescriptorError(str(exc)) from None
        for name in ("sparse_layers", "producers"):
            layers = getattr(self, name)
            if (
                not isinstance(layers, tuple)
                or len(layers) > self.num_layers  # the length first: it bounds the work
                or not all(_is_int(x) for x in layers)
                or list(layers) != sorted(set(layers))
            ):
                raise DescriptorError(
                    f"{name}={shown(layers)}: must be a tuple of distinct layer ids in increasing order, at most "
                    f"num_layers ({self.num_layers})"
                )
        if self.sparse_layers and not 0 <= self.sparse_layers[0] <= self.sparse_layers[-1] < self.num_layers:
            raise DescriptorError(
                f"sparse_layers={shown(self.sparse_layers)}: layer ids must be in 0..{self.num_layers - 1}"
            )
        if not set(self.producers) <= set(self.sparse_layers):
            extra = sorted(set(self.producers) - set(self.sparse_layers))
            raise DescriptorError(f"producers={shown(self.producers)}: layers {shown(extra)} are not sparse layers")
        if self.sparse_layers and self.sparse_layers[0] not in self.producers:
            raise DescriptorError(
                f"producers={shown(self.producers)}: must include the first sparse layer ({self.sparse_layers[0]}), "
                "which has no earlier producer to reuse (every LayerPlan's is a producer)"
            )

    @classmethod
    def from_plan(cls, plan: LayerPlan) -> Descriptor:
        """The descriptor of an engine running ``plan``; anything but a :class:`LayerPlan` is a ``TypeError`` naming
        it. An engine whose pipeline stages promote layers (``split_stages(..., mode="promote")``) passes the plan its
        stages run, ``functools.reduce(LayerPlan.for_stage, stages, plan)``, on every rank: the plain plan leaves the
        promoted producers out, so :func:`check_pd_compatible` could not see that prefill never computed their keys."""
        if not isinstance(plan, LayerPlan):
            raise TypeError(
                f"plan: expected a LayerPlan (LayerPlan.from_config reads a config), got {type(plan).__name__}"
            )
        return cls(
            num_layers=plan.num_layers,
            sparse_layers=tuple(plan.sparse_layers),
            top_k=plan.top_k,
            index_n_heads=plan.index_n_heads,
            index_head_dim=plan.index_head_dim,
            index_dtype=plan.index_dtype,
            page_size=plan.page_size,
            producers=tuple(plan.producers),
        )

    def _signed(self) -> dict[str, Any]:
        return {name: list(v) if isinstance(v := getattr(self, name), tuple) else v for name in SIGNED_FIELDS}

    @property
    def signature(self) -> str:
        """sha256 (hex) of the canonical JSON of the signed fields; the producers are not part of it."""
        canonical = json.dumps(self._signed(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the signed fields, ``producers`` and ``signature``."""
        return {**self._signed(), "producers": list(self.producers), "signature": self.signature}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Descriptor:
        """The inverse of :meth:`to_dict`. The ``signature`` is required and must match the signed fields, so a
        payload whose layout was altered or truncated on the way is refused; the producers are not signed (the
        schedule may differ between the sides: :func:`check_pd_compatible` checks them against the other side's)."""
        if not isinstance(data, Mapping):
            raise DescriptorError(f"descriptor must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        missing = sorted((names | {"signature"}) - set(data))
        unknown = sorted(set(data) - names - {"signature"}, key=str)  # keys of any type, from Python
        if missing or unknown:
            raise DescriptorError(f"descriptor keys: missing {missing}, unknown {shown(unknown)}")
        values = {name: tuple(v) if isinstance(v := data[name], list) else v for name in names}
        descriptor = cls(**values)
        claimed = data["signature"]
        if claimed != descriptor.signature:
            raise DescriptorError(
                f"signature={shown(claimed)}: does not match the descriptor's fields, which give "
                f"{descriptor.signature!r}"
            )
        return descriptor

    def to_json(self) -> str:
        """Canonical JSON text (sorted keys) for a bootstrap payload."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Descriptor:
        """Parse :meth:`to_json` output (str, or UTF-8 bytes as received); anything else, malformed or hostile
        (not UTF-8, not JSON, too large, too deeply nested, a count beyond the plan's bounds) raises
        :class:`DescriptorError`."""
        return cls.from_dict(parse_json(text, "descriptor", DescriptorError))


def _check_descriptor(name: str, value: Any) -> None:
    if not isinstance(value, Descriptor):
        raise TypeError(
            f"{name}: expected a Descriptor (Descriptor.from_json reads a payload), got {type(value).__name__}"
        )


def _layer_difference(prefill: Sequence[int], decode: Sequence[int]) -> str:
    only_prefill = sorted(set(prefill) - set(decode))
    only_decode = sorted(set(decode) - set(prefill))
    return f"only prefill: {only_prefill}, only decode: {only_decode}"


def check_pd_compatible(prefill: Descriptor, decode: Descriptor) -> None:
    """Raise :class:`PDIncompatibleError` unless ``decode`` may consume ``prefill``'s state.

    The signed fields must be equal and every decode producer must be a prefill producer. The error
    names every differing field and every uncovered decode producer; an argument that is not a descriptor is a
    ``TypeError`` naming it.
    """
    for name, descriptor in (("prefill", prefill), ("decode", decode)):
        _check_descriptor(name, descriptor)
    differences = {
        name: (getattr(prefill, name), getattr(decode, name))
        for name in SIGNED_FIELDS
        if getattr(prefill, name) != getattr(decode, name)
    }
    uncovered = tuple(sorted(set(decode.producers) - set(prefill.producers)))
    if not differences and not uncovered:
        return
    problems = [
        f"{name} differs ({_layer_difference(*pair)})"
        if name == "sparse_layers"
        else f"{name} differs (prefill {pair[0]!r}, decode {pair[1]!r})"
        for name, pair in differences.items()
    ]
    if uncovered:
        problems.append(
            f"decode producers {list(uncovered)} are not prefill producers (prefill computes {list(prefill.producers)})"
        )
    raise PDIncompatibleError(
        differences, uncovered, "prefill and decode descriptors are incompatible: " + "; ".join(problems)
    )


def check_ranks_agree(reports: Sequence[Descriptor | None]) -> Descriptor | None:
    """The one descriptor all prefill ranks report, or None when none reports one.

    ``reports[i]`` is rank i's descriptor (None: it reported none). Raises :class:`DescriptorError` naming the
    ranks when some report one and some do not, or when they report different descriptors (then also each field
    that differs, with each group of ranks' value); a report that is neither a descriptor nor None is a
    ``TypeError`` naming its rank.
    """
    if not reports:
        raise DescriptorError("no prefill ranks reported")
    for rank, descriptor in enumerate(reports):
        if descriptor is not None:
            _check_descriptor(f"reports[{rank}]", descriptor)
    silent = [rank for rank, d in enumerate(reports) if d is None]
    if len(silent) == len(reports):
        return None
    if silent:
        reporting = [rank for rank, d in enumerate(reports) if d is not None]
        raise DescriptorError(f"prefill ranks {silent} report no descriptor while ranks {reporting} report one")
    groups: dict[Descriptor, list[int]] = {}
    for rank, descriptor in enumerate(reports):
        groups.setdefault(descriptor, []).append(rank)
    if len(groups) > 1:
        described = "; ".join(
            f"ranks {ranks}: signature {d.signature[:12]}…, producers {list(d.producers)}"
            for d, ranks in groups.items()
        )
        differing = "; ".join(
            f"{name} (" + ", ".join(f"ranks {ranks}: {shown(getattr(d, name))}" for d, ranks in groups.items()) + ")"
            for name in (*SIGNED_FIELDS, "producers")
            if len({getattr(d, name) for d in groups}) > 1
        )
        raise DescriptorError(
            f"prefill ranks report {len(groups)} different descriptors: {described}; they differ in {differing}"
        )
    return reports[0]
