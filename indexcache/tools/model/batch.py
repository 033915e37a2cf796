"""The rows of one forward of the small model (:class:`Batch`), and the random prompts its runs feed it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from indexcache.hal.ops import INDEX
from indexcache.tools.model.config import ModelConfig


@dataclass(frozen=True)
class Batch:
    """The rows of one forward, on the model's device.

    ``tokens [R]`` int64; ``positions [R]`` int32, each row's position in its request; ``lengths [R]``
    int32, each row's visible length (0 for padding rows); ``row_to_batch [R]`` int32 request of each
    row (None: row r is request r); ``seq_lens [B]`` int32 context of each request after this forward;
    ``tables [L, B, P]`` int32 per-layer page tables. Prefill also has the keys of every request:
    ``key_positions, key_batch, key_lengths [N]`` int32 and ``key_starts [R]`` int32 (each row's key
    window starts there). Decode rows are one per request and read the paged index-K cache up to
    ``max_context_len``. ``max_length``: a host-side bound on every row's visible length (decode: the
    ``max_context_len``; prefill: the longest request), what lets a producer skip its indexer on short rows
    (``IndexerRunner.layer``'s ``max_length``).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    row_to_batch: torch.Tensor | None
    seq_lens: torch.Tensor
    tables: torch.Tensor
    decode: bool
    max_context_len: int = 0
    key_positions: torch.Tensor | None = None
    key_batch: torch.Tensor | None = None
    key_lengths: torch.Tensor | None = None
    key_starts: torch.Tensor | None = None
    max_length: int | None = None

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def decode_step(cls, tokens: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                    max_context_len: int) -> Batch:
        """One new token a request: ``tokens [B]`` int64, ``seq_lens [B]`` int32 (the context including
        the new token; 0 marks a padding row), ``tables [L, B, P]``. Device ops only: capturable."""
        return cls(tokens=tokens, positions=(seq_lens - 1).clamp_min(0), lengths=seq_lens, row_to_batch=None,
                   seq_lens=seq_lens, tables=tables, decode=True, max_context_len=max_context_len,
                   max_length=max_context_len)

    @classmethod
    def prefill(cls, tokens: Sequence[torch.Tensor], tables: torch.Tensor, prefix_lens: Sequence[int] | None = None
                ) -> Batch:
        """New tokens of B requests (``tokens[b]`` int64 ``[n_b]``) after ``prefix_lens[b]`` cached ones
        (0 by default: a prefill; more: a chunk of chunked prefill), with ``tables [L, B, P]``."""
        device = tables.device
        prefix = [0] * len(tokens) if prefix_lens is None else list(prefix_lens)
        if len(prefix) != len(tokens) or tables.shape[1] != len(tokens):
            raise ValueError(f"prefill: {len(tokens)} requests, {len(prefix)} prefix lengths, "
                             f"tables for {tables.shape[1]} requests")
        new = [int(t.shape[0]) for t in tokens]
        ctx = [p + n for p, n in zip(prefix, new, strict=True)]
        starts = [sum(ctx[:b]) for b in range(len(ctx))]

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=INDEX, device=device)

        positions = [p + i for p, n in zip(prefix, new, strict=True) for i in range(n)]
        rows_b = [b for b, n in enumerate(new) for _ in range(n)]
        keys_b = [b for b, c in enumerate(ctx) for _ in range(c)]
        return cls(
            tokens=torch.cat([t.to(device=device, dtype=torch.int64) for t in tokens]) if tokens
            else torch.zeros(0, dtype=torch.int64, device=device),
            positions=ints(positions),
            lengths=ints([p + 1 for p in positions]),
            row_to_batch=ints(rows_b),
            seq_lens=ints(ctx),
            tables=tables,
            decode=False,
            key_positions=ints([i for c in ctx for i in range(c)]),
            key_batch=ints(keys_b),
            key_lengths=ints([ctx[b] for b in keys_b]),
            key_starts=ints([starts[b] for b in rows_b]),
            max_length=max(ctx, default=0),
        )


def random_prompts(config: ModelConfig, batch: int, length: int, seed: int) -> list[torch.Tensor]:
    """``batch`` random prompts of ``length`` tokens (int64), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab, (length,), generator=generator) for _ in range(batch)]
