"""Benchmarking: one timer, the machine's ceilings, provenance, output, and the ``indexcache bench`` harness.

- :mod:`~indexcache.bench.timing` — the one timer (:class:`~indexcache.bench.timing.Timer`,
  :func:`~indexcache.bench.timing.median_ms`, :func:`~indexcache.bench.timing.capture_graph`, ...);
- :mod:`~indexcache.bench.ceilings` — copy bandwidth, fp8 / bf16 matmul rates, the empty Triton launch;
- :mod:`~indexcache.bench.provenance` — commit, versions, device, date;
- :mod:`~indexcache.bench.output` — the JSON schema, the tables;
- :mod:`~indexcache.bench.harness` — ``indexcache bench``: :func:`run`, :func:`failed`, over each op's
  cases, inputs, bytes / FLOPs and check (the ``bench`` field of its spec record, :mod:`indexcache.hal.specs`);
- :mod:`~indexcache.bench.ranks` — one process per rank for the multi-GPU scripts.

The ``bench/*.py`` scripts and ``ci/gpu.sh`` use these; ``indexcache bench`` uses what is exported here, and the
peer harnesses of issues 17 and 18 (kept outside the repository) import the timer's and provenance's names below.
"""

from indexcache.bench.harness import failed, run
from indexcache.bench.output import format_table, write_json
from indexcache.bench.provenance import checkout_commit
from indexcache.bench.timing import call_times_ms, capture_graph

__all__ = ["call_times_ms", "capture_graph", "checkout_commit", "failed", "format_table", "run", "write_json"]
