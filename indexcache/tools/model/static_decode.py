"""A decode step of the small model over static buffers, for CUDA-graph capture and replay."""

from __future__ import annotations

import torch

from indexcache.hal.ops import INDEX
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import TopkState
from indexcache.tools.model.batch import Batch
from indexcache.tools.model.cache import PagedCache
from indexcache.tools.model.dsa import DSAModel


class StaticDecode:
    """A decode step over static buffers of ``max_batch`` rows, for CUDA-graph capture and replay.

    :meth:`load` copies a batch into the buffers (padding rows: context 0, tables -1, so they select
    nothing and write only the dump slot); :meth:`step` runs one decode forward into ``logits
    [max_batch, vocab]``. Eager calls of :meth:`step` and replays of :meth:`capture`'s graph run the
    same code on the same buffers.
    """

    def __init__(self, model: DSAModel, cache: PagedCache, runner: IndexerRunner, max_batch: int) -> None:
        c = model.config
        dev = model.device
        self.model, self.cache, self.runner = model, cache, runner
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(max_batch, dtype=INDEX, device=dev)
        self.tables = torch.full((c.num_layers, max_batch, cache.tables.shape[2]), -1, dtype=INDEX, device=dev)
        self.state = TopkState(max_batch, runner.k, dev)
        self.logits = torch.zeros(max_batch, c.vocab, device=dev)

    def load(self, tokens: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor) -> None:
        """Copy ``tokens [B]``, ``seq_lens [B]`` and ``tables [L, B, P]`` (B ≤ max_batch) in; pad the rest."""
        b = tokens.shape[0]
        self.tokens[:b].copy_(tokens)
        self.tokens[b:].zero_()
        self.seq_lens[:b].copy_(seq_lens)
        self.seq_lens[b:].zero_()
        self.tables[:, :b].copy_(tables)
        self.tables[:, b:].fill_(-1)

    def step(self) -> torch.Tensor:
        """One decode forward on the buffers; returns ``logits`` (the static buffer)."""
        batch = Batch.decode_step(self.tokens, self.seq_lens, self.tables, self.cache.max_len)
        self.logits.copy_(self.model.run(batch, self.cache, self.runner, self.state))
        return self.logits

    def capture(self, warmup: int = 2) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (creates streams, autotunes), then capture :meth:`step` into a graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        return graph
