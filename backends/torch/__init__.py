"""The pure-PyTorch backend: every op on any torch device (CPU, CUDA, ROCm), memory-bounded.

It is always available and is the fallback every other backend's unsupported calls land on. Set the
temporary-memory budget of the chunked ops with :func:`set_memory_budget` or
``INDEXCACHE_TORCH_MEMORY_BUDGET`` (bytes; default 256 MiB; a value that is not a positive integer raises
:class:`MemoryBudgetError`).
"""

from __future__ import annotations

import torch

from indexcache.backends.torch import gather, hisparse, logits, producer, quantize, topk, translate
from indexcache.backends.torch.memory import MemoryBudgetError, memory_budget, set_memory_budget
from indexcache.backends.torch.streams import in_order, in_order_schedule
from indexcache.hal.contract import Availability, Backend, OpImpl


def _probe() -> Availability:
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    return Availability(True, "pure PyTorch runs on every device", auto=True,
                        mode="GPU" if gpu else "CPU", device=device)


BACKEND = Backend(
    name="torch",
    priority=0,
    probe=_probe,
    ops={
        "translate": OpImpl(translate.translate),
        "topk": OpImpl(topk.topk),
        "topk_translate": OpImpl(topk.topk_translate),
        "mqa_logits": OpImpl(logits.mqa_logits),
        "paged_mqa_logits": OpImpl(logits.paged_mqa_logits),
        "paged_topk_translate": OpImpl(producer.paged_topk_translate),
        "mqa_topk_translate": OpImpl(producer.mqa_topk_translate),
        "quantize_index_k": OpImpl(quantize.quantize_index_k),
        "store_index_k": OpImpl(quantize.store_index_k),
        "gather_index_k": OpImpl(gather.gather_index_k),
        "hisparse_plan": OpImpl(hisparse.hisparse_plan),
        "hisparse_swap_in": OpImpl(hisparse.hisparse_swap_in),
        "overlap": OpImpl(in_order, prepare=in_order_schedule),
    },
    details=lambda: {"memory_budget_bytes": memory_budget()},
)

__all__ = ["BACKEND", "MemoryBudgetError", "memory_budget", "set_memory_budget"]
