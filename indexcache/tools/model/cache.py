"""The small model's paged caches: per layer, the KV latents, the packed fp8 index-K cache and its own page table."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from indexcache.hal.layout import new_packed_cache
from indexcache.hal.ops import INDEX
from indexcache.tools.model.config import ModelConfig


class PagedCache:
    """Per-layer paged caches of ``max_requests`` request slots of ``max_len`` tokens each.

    ``kv [L, slots + 1, head_dim]`` float32 holds the attention latents (the last slot takes writes of
    padding rows and is never read); ``index_k[layer]`` the packed fp8 index-K cache of each layer in
    ``index_layers`` (default: every sparse layer; an engine allocates it for producers only). Every
    layer maps request slot ``r``'s pages through its own random permutation: ``tables [L, max_requests,
    pages_per_request]`` int32.
    """

    def __init__(self, config: ModelConfig, max_requests: int, max_len: int, *,
                 index_layers: Sequence[int] | None = None, device: torch.device | str = "cpu", seed: int = 0) -> None:
        ps = config.page_size
        pages_per_request = -(-max_len // ps)
        num_pages = max_requests * pages_per_request
        gen = torch.Generator().manual_seed(seed)
        perms = [torch.randperm(num_pages, generator=gen) for _ in range(config.num_layers)]
        self.config = config
        self.max_len = pages_per_request * ps
        self.tables = torch.stack(perms).view(config.num_layers, max_requests, pages_per_request).to(device, INDEX)
        self.kv = torch.zeros(config.num_layers, num_pages * ps + 1, config.head_dim, device=device)
        layers = config.sparse_layers if index_layers is None else index_layers
        self.index_k = {layer: new_packed_cache(num_pages, ps, config.index_dim, device) for layer in layers}

    def tables_for(self, requests: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Per-layer page tables ``[L, B, P]`` of request slots ``requests``."""
        idx = torch.as_tensor(requests, dtype=torch.long, device=self.tables.device)
        return self.tables[:, idx]
