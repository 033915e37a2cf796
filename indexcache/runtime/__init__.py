"""The IndexCache runtime an engine's layers call: TopkState, IndexerRunner, overlap(), cp_topk and DraftTopk (a draft
extend's top-k served to the draft decode steps); a producer's ``scores`` may return a :class:`PagedLogits` (decode)
or a :class:`PrefillLogits` (prefill)."""

from indexcache.runtime.state import PagedLogits, PrefillLogits

__all__ = ["PagedLogits", "PrefillLogits"]
