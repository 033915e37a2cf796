"""The IndexCache runtime an engine's layers call: TopkState, IndexerRunner, overlap() and cp_topk."""
