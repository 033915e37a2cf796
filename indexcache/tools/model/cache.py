"""The small model's paged caches: per layer, the KV latents, the packed fp8 index-K cache and its own page table; and
HiSparse's host pool and hot buffers (:class:`HotCache`)."""

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


class HotCache:
    """HiSparse's side of the small model's caches (docs/hisparse.md): per layer, the KV latents in a host pool
    (request ``b``'s token ``t`` at row ``b * max_len + t``, laid out alike in every layer, as HiSparse needs) and a
    hot buffer of ``hot + 1`` device slots a request.

    ``host [max_requests * max_len, L, head_dim]`` float32 in host memory (pinned when ``device`` is a GPU), a token's
    rows of every layer together (so a producer group's swap-in reads them in one launch), layer ``l``'s rows
    ``host[:, l]``;
    ``device_kv [L, max_requests * (hot + 1) + 1, head_dim]`` on ``device`` (the last row takes padding rows'
    writes); ``device_loc [max_requests, hot + 1]`` int32, the device row of each slot; ``host_loc [max_requests,
    max_len]`` int32, the host row of each token.
    """

    def __init__(self, config: ModelConfig, max_requests: int, max_len: int, hot: int, *,
                 device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        host = torch.zeros(max_requests * max_len, config.num_layers, config.head_dim)
        self.host = host.pin_memory() if device.type != "cpu" else host
        self.device_kv = torch.zeros(config.num_layers, max_requests * (hot + 1) + 1, config.head_dim, device=device)
        self.device_loc = torch.arange(max_requests * (hot + 1), dtype=INDEX, device=device).view(max_requests, -1)
        self.host_loc = torch.arange(max_requests * max_len, dtype=INDEX, device=device).view(max_requests, -1)
        self.hot = hot
        self.max_len = max_len

    def store(self, layer: int, requests: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
              kv: torch.Tensor) -> None:
        """Token ``positions[r]`` of request ``requests[r]`` (``[R]`` int32; a request of ``seq_lens[r]`` tokens after
        this forward; 0 marks a padding row), latents ``kv [R, head_dim]``: to its host row, and to its hot slot where
        the engine's side of the contract puts it (slot ``t`` while the request is at most ``hot`` long, else the
        newest token's slot ``hot``; an older token of a longer request only on the host). The host write reads the
        rows' places on the host (a sync on a GPU: the small model's store is not captured)."""
        live = seq_lens > 0
        host_rows = (requests.long() * self.max_len + positions.long()).cpu()
        keep = live.cpu()
        self.host[:, layer].index_copy_(0, host_rows[keep], kv[live].to(self.host.device))
        slot = torch.where(seq_lens <= self.hot, positions, self.hot).long()
        placed = live & ((seq_lens <= self.hot) | (positions == seq_lens - 1))
        rows = self.device_loc[requests.long().clamp_min(0), slot.clamp_max(self.hot)].long()
        dump = torch.full_like(rows, self.device_kv.shape[1] - 1)
        self.device_kv[layer].index_copy_(0, torch.where(placed, rows, dump), kv)
