"""The IndexCache runtime an engine's layers call: TopkState, IndexerRunner, overlap() and cp_topk; a producer's
``scores`` may return a :class:`PagedLogits` (decode) or a :class:`PrefillLogits` (prefill)."""

from indexcache.runtime.state import PagedLogits, PrefillLogits

__all__ = ["PagedLogits", "PrefillLogits"]
