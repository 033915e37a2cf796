"""indexcache: cross-layer reuse of sparse-attention top-k indices (IndexCache) on any backend.

Importing touches no device; the backend is chosen at the first op call (see
:mod:`indexcache.dispatch`).
"""

from indexcache.dispatch import available_backends, get_backend, use_backend
from indexcache.ops import (
    mqa_logits,
    paged_mqa_logits,
    quantize_index_k,
    store_index_k,
    topk,
    topk_translate,
    translate,
)

__version__ = "0.1.0"

__all__ = [
    "available_backends",
    "get_backend",
    "mqa_logits",
    "paged_mqa_logits",
    "quantize_index_k",
    "store_index_k",
    "topk",
    "topk_translate",
    "translate",
    "use_backend",
]
