"""The hardware abstraction layer: the public ops, their spec records, the backend contract and dispatch."""
