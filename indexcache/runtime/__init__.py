"""The IndexCache runtime an engine's layers call: TopkState, IndexerRunner, overlap() and cp_topk; a decode
producer's ``scores`` may return a :class:`PagedLogits`."""

from indexcache.runtime.state import PagedLogits

__all__ = ["PagedLogits"]
