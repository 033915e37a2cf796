"""A small DSA model with random seeded weights, to run IndexCache end to end on any backend.

**This is not a trained model**, and nothing it outputs means anything: it exists so that producers,
shared layers, per-layer page tables, pipeline carries, micro-batches, side streams and CUDA graphs can
be exercised and timed with the real ops. Its shapes follow DeepSeek-V3.2's indexer (RoPE on the
first half of the index head dim, a Hadamard rotation, block-128 fp8 with power-of-two scales in the
packed 132-byte-a-token cache written by ``indexcache.store_index_k``, logits from
``indexcache.mqa_logits`` in prefill and ``indexcache.paged_topk_translate`` in decode) at small widths.

Independent random indexers would share almost no top-k across layers, unlike trained models (70–100 %
between neighbours, in blocks). So the seeded indexer weights are correlated on purpose: sparse layers
come in blocks of ``ModelConfig.block``; an indexer's weights are a component shared by all layers,
one shared by its block and its own noise, with variances ``global_share``,
``block_share - global_share`` and ``1 - block_share``. Neighbours inside a block then select mostly
the same tokens, layers in different blocks fewer.

Each layer: RMSNorm; the indexer part through :class:`~indexcache.runtime.runner.IndexerRunner` (producer,
shared, or — for layers without an indexer — a sliding window of ``ModelConfig.window`` tokens); a
single-latent MQA attention (MLA-like: keys and values are one latent vector a token) over the selected
physical KV slots; a residual add. Every layer has its own page table into its own KV cache, so each
shared layer's translation matters. The producer's indexer runs on a side stream
(:func:`indexcache.runtime.streams.overlap`) while the main stream projects the queries and stores the KV latent.

Presets: ``"v32-like"`` (every layer sparse, k 2048) and ``"v4-like"`` (``compress_ratios``: only
ratio-4 layers have an indexer, k 512; KV compression itself is not modelled). Pass ``topk=`` to
scale k down for quick CPU runs; k only matters once contexts are longer than k.

Runs of the whole model: :func:`run_demo` (``indexcache demo``: a plan against every sparse layer a
producer), :func:`record_dump` (every sparse layer's top-k, a calibration dump) and :func:`calibrate_model`
(``indexcache calibrate --from-model``). A setting they cannot use raises :class:`ModelSettingError`, before any
work: a size out of its range (top-k at most :data:`MAX_TOPK`, seeds of 64 bits) and a run whose memory
(:func:`run_bytes`) exceeds what the device has free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import indexcache
from indexcache.hal import dispatch
from indexcache.hal.layout import new_packed_cache, split_packed_cache
from indexcache.hal.ops import INDEX
from indexcache.plan import MAX_LAYERS, MAX_TOPK, LayerPlan
from indexcache.plan.jsontext import shown
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import IndexRecorder, PagedLogits, Recorder, TopkState
from indexcache.runtime.streams import overlap
from indexcache.tools.calibrate.calibration import Calibration, calibrate_arrays
from indexcache.tools.calibrate.overlap import overlap_matrix

ROPE_BASE = 10000.0
ATTENTION_CHUNK_BYTES = 64 * 2**20
# torch.Generator.manual_seed takes 64 bits (a negative seed s is the seed 2^64 + s, so none is lost).
MAX_SEED = 2**64 - 1


class ModelSettingError(ValueError):
    """A setting of the small model or of a run of it (preset, sizes, backend) that cannot be used; the message
    names it."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and seeds of the small model (see the module docstring for what each part does)."""

    num_layers: int = 12
    hidden: int = 256
    heads: int = 4
    head_dim: int = 64
    index_heads: int = 4
    index_dim: int = 128
    topk: int = 2048
    page_size: int = 64
    vocab: int = 1024
    window: int = 128
    compress_ratios: tuple[int, ...] | None = None
    block: int = 4
    block_share: float = 0.99
    global_share: float = 0.3
    residual_scale: float = 0.25
    index_dtype: str = "float8_e4m3fn"
    seed: int = 0

    @property
    def sparse_layers(self) -> list[int]:
        """Layers with an indexer: all, or the ratio-4 ones of ``compress_ratios``."""
        if self.compress_ratios is None:
            return list(range(self.num_layers))
        return [layer for layer, ratio in enumerate(self.compress_ratios) if ratio == 4]


_V4_RATIOS = (0, 0) + (4, 128) * 9

PRESETS: dict[str, ModelConfig] = {
    "v32-like": ModelConfig(),
    "v4-like": ModelConfig(num_layers=len(_V4_RATIOS), compress_ratios=_V4_RATIOS, topk=512),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The config of preset ``name`` ("v32-like" or "v4-like") with ``overrides`` (e.g. ``topk=64``)."""
    if name not in PRESETS:
        raise ModelSettingError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return dataclasses.replace(PRESETS[name], **overrides)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hadamard(dim: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix ``[dim, dim]`` float32 (``dim`` a power of two)."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"dim: expected a power of two, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


def rope_first_half(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on the first half of the last dim of ``x [R, ..., D]``; ``positions [R]``."""
    dim = x.shape[-1]
    quarter = dim // 4
    inv_freq = ROPE_BASE ** (-torch.arange(quarter, device=x.device, dtype=torch.float32) / quarter)
    angle = positions.float()[:, None] * inv_freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (quarter,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    x1, x2, rest = x[..., :quarter], x[..., quarter : 2 * quarter], x[..., 2 * quarter :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Attention of ``q [R, H, d]`` over the latents ``kv [S, d]`` at ``slots [R, k]`` int32 (-1 = empty).

    Keys and values are the latent. Rows with no valid slot give zeros. Returns ``[R, H * d]``; rows
    are processed in chunks so the gathered ``[rows, k, d]`` stays under ``ATTENTION_CHUNK_BYTES``.
    """
    rows, heads, dim = q.shape
    k = slots.shape[1]
    out = q.new_zeros(rows, heads, dim)
    if rows == 0 or k == 0:
        return out.view(rows, heads * dim)
    step = max(1, ATTENTION_CHUNK_BYTES // (k * (dim + heads) * 4))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        idx = slots[r0:r1]
        valid = (idx >= 0)[:, None, :]
        g = kv[idx.clamp_min(0).long()]
        s = torch.einsum("rhd,rkd->rhk", q[r0:r1], g) * dim**-0.5
        p = torch.softmax(s.masked_fill(~valid, float("-inf")), -1)
        p = torch.where(valid, p, 0.0)
        out[r0:r1] = torch.einsum("rhk,rkd->rhd", p, g)
    return out.view(rows, heads * dim)


@dataclass(frozen=True)
class Batch:
    """The rows of one forward, on the model's device.

    ``tokens [R]`` int64; ``positions [R]`` int32, each row's position in its request; ``lengths [R]``
    int32, each row's visible length (0 for padding rows); ``row_to_batch [R]`` int32 request of each
    row (None: row r is request r); ``seq_lens [B]`` int32 context of each request after this forward;
    ``tables [L, B, P]`` int32 per-layer page tables. Prefill also has the keys of every request:
    ``key_positions, key_batch, key_lengths [N]`` int32 and ``key_starts [R]`` int32 (each row's key
    window starts there). Decode rows are one per request and read the paged index-K cache up to
    ``max_context_len``.
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

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def decode_step(cls, tokens: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor,
                    max_context_len: int) -> Batch:
        """One new token a request: ``tokens [B]`` int64, ``seq_lens [B]`` int32 (the context including
        the new token; 0 marks a padding row), ``tables [L, B, P]``. Device ops only: capturable."""
        return cls(tokens=tokens, positions=(seq_lens - 1).clamp_min(0), lengths=seq_lens, row_to_batch=None,
                   seq_lens=seq_lens, tables=tables, decode=True, max_context_len=max_context_len)

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
        )


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


@dataclass(frozen=True)
class _Layer:
    wq: torch.Tensor
    wkv: torch.Tensor
    wo: torch.Tensor
    wq_index: torch.Tensor | None
    wk_index: torch.Tensor | None
    w_weights: torch.Tensor | None


class DSAModel:
    """The small DSA model on ``device`` (weights drawn from ``config.seed``; identical on every device)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        if config.index_dim % 4 or config.index_dim & (config.index_dim - 1):
            raise ModelSettingError(f"index_dim: expected a power of two >= 4, got {config.index_dim}")
        self.config = config
        self.device = torch.device(device)
        self.fp8 = getattr(torch, config.index_dtype)
        gen = torch.Generator().manual_seed(config.seed)

        def normal(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        c = config
        d = c.hidden
        self.embedding = normal(c.vocab, d, std=1.0)
        sparse = c.sparse_layers
        blocks = -(-len(sparse) // c.block)
        index_shapes = {"q": (d, c.index_heads * c.index_dim), "k": (d, c.index_dim), "w": (d, c.index_heads)}
        common = {name: normal(*shape, std=d**-0.5) for name, shape in index_shapes.items()}
        per_block = [{name: normal(*shape, std=d**-0.5) for name, shape in index_shapes.items()} for _ in range(blocks)]
        a, b, n = math.sqrt(c.global_share), math.sqrt(c.block_share - c.global_share), math.sqrt(1 - c.block_share)
        layers = []
        for layer in range(c.num_layers):
            attn = dict(wq=normal(d, c.heads * c.head_dim, std=d**-0.5), wkv=normal(d, c.head_dim, std=d**-0.5),
                        wo=normal(c.heads * c.head_dim, d, std=c.residual_scale * (c.heads * c.head_dim) ** -0.5))
            index = dict(wq_index=None, wk_index=None, w_weights=None)
            if layer in sparse:
                blk = per_block[sparse.index(layer) // c.block]
                mix = {name: a * common[name] + b * blk[name] + n * normal(*shape, std=d**-0.5)
                       for name, shape in index_shapes.items()}
                index = dict(wq_index=mix["q"], wk_index=mix["k"], w_weights=mix["w"])
            layers.append(_Layer(**{k: None if v is None else v.to(self.device) for k, v in {**attn, **index}.items()}))
        self.layers = layers
        self.embedding = self.embedding.to(self.device)
        self.hadamard = hadamard(c.index_dim).to(self.device)

    def plan(self, freq: int | None = 1, pattern: str | None = None) -> LayerPlan:
        """The layer plan of this model under ``index_topk_freq=freq`` or ``index_topk_pattern=pattern``."""
        c = self.config
        return LayerPlan(c.num_layers, index_topk_freq=freq, index_topk_pattern=pattern,
                         compress_ratios=None if c.compress_ratios is None else list(c.compress_ratios),
                         index_topk=c.topk, index_n_heads=c.index_heads, index_head_dim=c.index_dim,
                         page_size=c.page_size)

    def new_cache(self, max_requests: int, max_len: int, *, index_layers: Sequence[int] | None = None,
                  seed: int = 0) -> PagedCache:
        """A :class:`PagedCache` on this model's device."""
        return PagedCache(self.config, max_requests, max_len, index_layers=index_layers, device=self.device,
                          seed=seed)

    def generate(self, prompts: Sequence[torch.Tensor], steps: int, runner: IndexerRunner, *,
                 tokens: torch.Tensor | None = None, recorder: Recorder | None = None, seed: int = 0) -> Generation:
        """Prefill ``prompts`` (int64 ``[n_b]`` each) together, then ``steps`` decode steps, greedy unless
        ``tokens [steps, B]`` forces the token fed at each step (to compare plans on the same inputs).

        The cache (page tables from ``seed``) holds index-K caches for the runner's producers only, as an
        engine would; ``recorder`` is attached for the decode steps.
        """
        batch_size = len(prompts)
        lengths = [int(p.shape[0]) for p in prompts]
        producers = [layer for layer in runner.layers if runner.role(layer) == "F"]
        cache = self.new_cache(batch_size, max(lengths) + steps, index_layers=producers, seed=seed)
        state = TopkState(max(sum(lengths), batch_size), runner.k, self.device)
        tables = cache.tables_for(range(batch_size))
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1

        _sync(self.device)
        start = time.perf_counter()
        prefill_logits = self.run(Batch.prefill(prompts, tables), cache, runner, state)[last]
        _sync(self.device)
        prefill_s = time.perf_counter() - start

        state.recorder = recorder
        seq_lens = torch.tensor(lengths, dtype=INDEX, device=self.device)
        logits, fed = prefill_logits, []
        decode_logits = []
        start = time.perf_counter()
        for step in range(steps):
            token = logits.argmax(-1) if tokens is None else tokens[step].to(self.device)
            seq_lens = seq_lens + 1
            logits = self.run(Batch.decode_step(token, seq_lens, tables, cache.max_len), cache, runner, state)
            fed.append(token)
            decode_logits.append(logits)
        _sync(self.device)
        decode_s = time.perf_counter() - start
        if not steps:
            return Generation(prefill_logits, prefill_logits.new_zeros(0, batch_size, self.config.vocab),
                              torch.zeros(0, batch_size, dtype=torch.int64, device=self.device), prefill_s, 0.0)
        return Generation(prefill_logits=prefill_logits, decode_logits=torch.stack(decode_logits),
                          tokens=torch.stack(fed), prefill_s=prefill_s, decode_s=decode_s)

    def embed(self, batch: Batch) -> torch.Tensor:
        """Hidden states ``[R, hidden]`` float32 of the batch's tokens."""
        return self.embedding[batch.tokens]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[R, vocab]`` float32 (tied to the embedding)."""
        return F.rms_norm(x, (x.shape[-1],)) @ self.embedding.t() * x.shape[-1] ** -0.5

    def run(self, batch: Batch, cache: PagedCache, runner: IndexerRunner, state: TopkState) -> torch.Tensor:
        """A whole forward: begin ``state`` for the batch, every layer of ``runner``, the head. Returns
        logits ``[R, vocab]``."""
        runner.begin(state, batch.rows)
        return self.head(self.forward(self.embed(batch), batch, cache, runner, state))

    def forward(self, x: torch.Tensor, batch: Batch, cache: PagedCache, runner: IndexerRunner,
                state: TopkState) -> torch.Tensor:
        """Run ``runner.layers`` on hidden states ``x [R, hidden]`` (the state already begun, or loaded
        from a pipeline carry)."""
        for layer in runner.layers:
            x = self.layer(layer, x, batch, cache, runner, state)
        return x

    def layer(self, layer: int, x: torch.Tensor, batch: Batch, cache: PagedCache, runner: IndexerRunner,
              state: TopkState) -> torch.Tensor:
        """One layer on ``x [R, hidden]``; returns the new hidden states."""
        c = self.config
        w = self.layers[layer]
        table = batch.tables[layer]
        rows = batch.rows
        h = F.rms_norm(x, (c.hidden,))
        # Where each row's new token goes in this layer's caches (-1 for padding rows).
        new_slots = indexcache.translate(batch.positions[:, None], table, batch.lengths, c.page_size,
                                         row_to_batch=batch.row_to_batch).view(-1)

        def indexer() -> torch.Tensor:
            if runner.role(layer) is None:
                return self._window_slots(batch, table)
            return runner.layer(layer, state, scores=lambda: self._index_scores(layer, h, batch, cache, new_slots),
                                lengths=batch.lengths, page_table=table, row_starts=batch.key_starts,
                                row_to_batch=batch.row_to_batch)

        def prepare() -> torch.Tensor:
            kv = cache.kv[layer]
            dump = torch.full_like(new_slots, kv.shape[0] - 1)
            kv.index_copy_(0, torch.where(new_slots >= 0, new_slots, dump).long(), h @ w.wkv)
            return (h @ w.wq).view(rows, c.heads, c.head_dim)

        slots, q = overlap(indexer, prepare, device=self.device)
        return x + sparse_attention(q, cache.kv[layer], slots) @ w.wo

    def _window_slots(self, batch: Batch, table: torch.Tensor) -> torch.Tensor:
        """Physical slots of the last ``window`` tokens of each row (layers without an indexer)."""
        offsets = torch.arange(self.config.window, device=self.device, dtype=INDEX)
        raw = batch.positions[:, None] - offsets[None, :]
        return indexcache.translate(raw, table, batch.lengths, self.config.page_size, row_to_batch=batch.row_to_batch)

    def _index_scores(self, layer: int, h: torch.Tensor, batch: Batch, cache: PagedCache,
                      new_slots: torch.Tensor) -> torch.Tensor | PagedLogits:
        """The producer's indexer: store this forward's index keys, then, in prefill, logits ``[R, N]`` float32;
        in decode, the paged logits' inputs (:class:`~indexcache.runtime.state.PagedLogits`), which the runner
        scores and selects from in one op (``indexcache.paged_topk_translate``)."""
        c = self.config
        if layer not in cache.index_k:
            raise ValueError(f"layer {layer} runs its indexer but the cache has no index-K cache for it "
                             f"(index layers: {sorted(cache.index_k)})")
        w = self.layers[layer]
        rows, heads, dim = batch.rows, c.index_heads, c.index_dim
        q = rope_first_half((h @ w.wq_index).view(rows, heads, dim), batch.positions) @ self.hadamard
        k = rope_first_half(F.layer_norm(h @ w.wk_index, (dim,)), batch.positions) @ self.hadamard
        k_cache = cache.index_k[layer]
        indexcache.store_index_k(k, k_cache, new_slots.to(INDEX), self.fp8)
        q8, q_scale = indexcache.quantize_index_k(q.reshape(rows * heads, dim), self.fp8, block=dim)
        weights = (h @ w.w_weights) * heads**-0.5 * q_scale.view(rows, heads) * dim**-0.5
        table = batch.tables[layer]
        if batch.decode:
            return PagedLogits(q8.view(rows, 1, heads, dim), k_cache, weights, batch.seq_lens, table,
                               batch.max_context_len)
        key_slots = indexcache.translate(batch.key_positions[:, None], table, batch.key_lengths, c.page_size,
                                         row_to_batch=batch.key_batch).view(-1).long()
        keys, scales = split_packed_cache(k_cache, dim, self.fp8)
        page, offset = key_slots // c.page_size, key_slots % c.page_size
        k8 = keys.view(torch.uint8)[page, offset].view(self.fp8)
        k_scale = scales[page, offset]
        ks = batch.key_starts
        return self._prefill_logits(layer, q8.view(rows, heads, dim), k8, k_scale, weights, ks, ks + batch.lengths)

    def _prefill_logits(self, layer: int, q8: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor,
                        weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
        """A prefill producer's logits ``[R, N]`` float32 over the batch's ``N`` gathered keys (``q8 [R, H, D]``,
        ``k8 [N, D]`` fp8, ``k_scale [N]``, ``weights [R, H]``, window ``[ks, ke)`` int32 ``[R]``):
        :func:`indexcache.mqa_logits`. A subclass may score a shard of the keys instead (context parallel)."""
        return indexcache.mqa_logits(q8, k8, k_scale, weights, ks, ke)


@dataclass(frozen=True)
class Generation:
    """What :meth:`DSAModel.generate` returns. ``prefill_logits [B, vocab]`` at each prompt's last token;
    ``decode_logits [steps, B, vocab]``; ``tokens [steps, B]`` int64 fed at each decode step; wall
    times of the two phases in seconds (device synchronized)."""

    prefill_logits: torch.Tensor
    decode_logits: torch.Tensor
    tokens: torch.Tensor
    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class PlanComparison:
    """A plan run against the all-producer baseline on the same prompts and decode inputs.

    ``overlap[layer]`` is the top-k overlap (``|T_layer ∩ T_source| / k``, as in
    :func:`indexcache.tools.calibrate.overlap.overlap_matrix`) between each sparse layer's own selection and that of
    the producer the plan makes it reuse (1 for producers), measured on the baseline's decode steps;
    ``adjacent[layer]`` the same against the previous sparse layer. Drifts are relative L2 distances
    of the logits from the baseline's; ``agreement`` the fraction of decode positions where both pick
    the same greedy token.
    """

    plan: LayerPlan
    baseline: Generation
    candidate: Generation
    overlap: dict[int, float]
    adjacent: dict[int, float]
    prefill_drift: float
    decode_drift: float
    agreement: float


def _drift(got: torch.Tensor, base: torch.Tensor) -> float:
    return float((got - base).norm() / base.norm().clamp_min(1e-30))


def compare_plans(model: DSAModel, plan: LayerPlan, prompts: Sequence[torch.Tensor], steps: int) -> PlanComparison:
    """Generate with every sparse layer a producer, then with ``plan`` fed the same tokens; compare."""
    recorder = IndexRecorder()
    baseline = model.generate(prompts, steps, IndexerRunner(model.plan(1)), recorder=recorder)
    candidate = model.generate(prompts, steps, IndexerRunner(plan), tokens=baseline.tokens)
    sparse = plan.sparse_layers
    overlap, adjacent = {}, {}
    if steps:
        recorded = recorder.stacked()
        matrix = overlap_matrix([recorded[layer] for layer in sparse])
        position = {layer: i for i, layer in enumerate(sparse)}
        overlap = {layer: float(matrix[i, position[plan.source_of(layer)]]) for i, layer in enumerate(sparse)}
        adjacent = {layer: float(matrix[i, i - 1]) for i, layer in enumerate(sparse) if i}
    agree = (candidate.decode_logits.argmax(-1) == baseline.decode_logits.argmax(-1)).float()
    return PlanComparison(plan=plan, baseline=baseline, candidate=candidate, overlap=overlap, adjacent=adjacent,
                          prefill_drift=_drift(candidate.prefill_logits, baseline.prefill_logits),
                          decode_drift=_drift(candidate.decode_logits, baseline.decode_logits) if steps else 0.0,
                          agreement=float(agree.mean()) if steps else 1.0)


# ------------------------------------------------------------------------------------------ runs of the model


# Token positions, slots and request ids are int32: no size of a run goes past 2^31 - 1 (memory refuses far less).
_INT32 = 2**31 - 1
_LARGEST = {"topk": MAX_TOPK, "freq": MAX_LAYERS, "seed": MAX_SEED, "batch": _INT32, "prompt_len": _INT32,
            "decode_steps": _INT32}


def _check_sizes(**sizes: int | None) -> None:
    """Raise :class:`ModelSettingError` unless every given size (None: the default) is an integer >= 1, ``topk`` at
    most :data:`MAX_TOPK`, ``freq`` at most the plan's ``MAX_LAYERS``, ``seed`` in ``0..MAX_SEED`` and the others at
    most 2^31 - 1."""
    for key, value in sizes.items():
        if value is None:
            continue
        low, high = 0 if key == "seed" else 1, _LARGEST.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ModelSettingError(f"{key}={shown(value)}: must be an integer >= {low}")
        if high is not None and value > high:
            raise ModelSettingError(f"{key}={shown(value)}: must be at most {high}")


def run_bytes(config: ModelConfig, *, batch: int, prompt_len: int, decode_steps: int = 0,
              record: bool = False) -> dict[str, int]:
    """A lower bound, in bytes, of the memory a run of ``config`` holds at once, by what holds it: ``batch`` prompts
    of ``prompt_len`` tokens prefilled together, ``decode_steps`` decode steps, with ``record`` every sparse layer's
    prefill top-k kept.

    Only what is certainly alive together when the last producer layer of the prefill scores (R = batch x
    prompt_len rows, as many keys): its logits ``[R, R]`` float32, the hidden states ``x`` and ``h`` of R rows, the
    paged caches of every layer, the top-k state, the decode logits and, with ``record``, the other sparse layers'
    recorded ``[R, k]`` int32. A run needs more (a forward's other activations, the ops' chunks): measured on a CPU
    (v32-like, k 128, record), a peak of 76 MB against this bound's 8 MB at 512 rows and 601 MB against 116 MB at
    4096; the logits grow fastest, so the bound closes in on large runs. A run refused on it could never fit.
    """
    c = config
    rows = batch * prompt_len
    sparse = len(c.sparse_layers)
    tokens = batch * -(-(prompt_len + decode_steps) // c.page_size) * c.page_size
    return {
        "prefill logits [batch x prompt_len]^2 float32": 4 * rows * rows,
        "hidden states": 2 * 4 * rows * c.hidden,
        "paged KV and index-K caches": tokens * (c.num_layers * 4 * c.head_dim + sparse * (c.index_dim + 4)),
        "top-k state": 2 * 4 * rows * c.topk,
        "decode logits [decode_steps, batch, vocab] float32": 4 * decode_steps * batch * c.vocab,
        "recorded top-k": 4 * (sparse - 1) * rows * c.topk if record else 0,
    }


def free_bytes(device: str) -> int | None:
    """Memory free for a run on ``device``: the GPU's free memory, or the host's available memory (Linux
    ``MemAvailable``; elsewhere the free physical pages); None where it cannot be told."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.mem_get_info(torch.device(device))[0]
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def _check_fits(config: ModelConfig, device: str, **sizes: int) -> None:
    """Raise :class:`ModelSettingError` when the run of ``sizes`` needs more memory (at least :func:`run_bytes`) than
    ``device`` has free: refused before anything is allocated."""
    terms = run_bytes(config, **sizes)
    need, free = sum(terms.values()), free_bytes(device)
    if free is not None and need > free:
        given = ", ".join(f"{key}={shown(value)}" for key, value in sizes.items() if key != "record")
        most = max(terms, key=terms.__getitem__)
        raise ModelSettingError(
            f"{given}, topk={config.topk}: the run needs at least {need / 2**30:.3g} GiB on {device}, most of it for "
            f"the {most}, more than the {free / 2**30:.3g} GiB free"
        )


def _backend_setup(backend: str | None) -> tuple[str, dispatch.Availability, dict[str, str]]:
    """``backend`` (None: the automatic choice), its availability here, and the config overrides it needs (the fp8
    format its kernels compute in). An unknown name raises ``UnknownBackendError``; one that cannot run here
    :class:`ModelSettingError`."""
    chosen = backend or dispatch.get_backend()
    avail = dispatch.availability(chosen)
    if not avail.available:
        raise ModelSettingError(f"backend {chosen!r} is not available here: {avail.reason}")
    fp8 = dispatch.get(chosen).capabilities().fp8_dtype
    return chosen, avail, ({"index_dtype": str(fp8).removeprefix("torch.")} if fp8 is not None else {})


def _prompts(config: ModelConfig, batch: int, length: int, seed: int) -> list[torch.Tensor]:
    """``batch`` random prompts of ``length`` tokens (int64), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab, (length,), generator=generator) for _ in range(batch)]


def record_dump(
    name: str,
    *,
    backend: str | None = None,
    prompt_len: int = 512,
    batch: int = 2,
    topk: int = 128,
    seed: int = 0,
) -> tuple[list[int], list[np.ndarray]]:
    """A calibration dump from the small model: every sparse layer's top-k in one prefill.

    Builds preset ``name`` ("v32-like" or "v4-like"; random seeded weights, **not a trained model**)
    with top-k ``topk`` on ``backend`` (default: the automatic choice) and every sparse layer a
    producer, prefills ``batch`` random prompts of ``prompt_len`` tokens drawn from ``seed`` and records
    each sparse layer's raw indices (:class:`~indexcache.runtime.state.IndexRecorder`). Rows whose context is at
    most ``topk`` tokens are dropped: every layer selects all of them. Returns what
    :func:`indexcache.tools.calibrate.load_dump` returns: the sparse layer ids and one ``[rows, topk]`` int32 array
    each. The defaults are sizes for a CPU (seconds); the preset's own k (2048 / 512) and longer prompts suit
    a GPU. Bad sizes (top-k beyond :data:`MAX_TOPK`, a seed beyond 64 bits, a run that needs more memory than
    the device has free: :func:`run_bytes`), an unknown preset or a backend that cannot run here raise
    :class:`ModelSettingError` before any work.
    """
    _check_sizes(prompt_len=prompt_len, batch=batch, topk=topk, seed=seed)
    if prompt_len <= topk:
        raise ModelSettingError(
            f"prompt_len={prompt_len} must exceed topk={topk}: shorter contexts select every token"
        )
    _, avail, overrides = _backend_setup(backend)
    config = preset(name, topk=topk, seed=seed, **overrides)
    _check_fits(config, avail.device, batch=batch, prompt_len=prompt_len, record=True)
    with dispatch.use_backend(backend) if backend else contextlib.nullcontext():
        model = DSAModel(config, avail.device)
        runner = IndexerRunner(model.plan(1))
        cache = model.new_cache(batch, prompt_len, seed=seed)
        state = TopkState(batch * prompt_len, topk, model.device)
        recorder = IndexRecorder()
        state.recorder = recorder
        rows = Batch.prefill(_prompts(config, batch, prompt_len, seed), cache.tables_for(range(batch)))
        model.run(rows, cache, runner, state)
    keep = (rows.lengths > topk).cpu()
    recorded = recorder.stacked()
    layers = config.sparse_layers
    return layers, [recorded[layer].cpu()[keep].numpy() for layer in layers]


def calibrate_model(
    name: str,
    out: str | os.PathLike[str],
    *,
    keep: float | None = None,
    producers: int | None = None,
    threads: int | None = None,
    plots: bool = True,
    backend: str | None = None,
    prompt_len: int | None = None,
    topk: int | None = None,
    seed: int | None = None,
) -> Calibration:
    """:func:`indexcache.tools.calibrate.calibrate_arrays` on a dump :func:`record_dump` records from preset ``name``.

    ``backend``, ``prompt_len``, ``topk`` and ``seed`` go to :func:`record_dump` (None: its default) and, when
    given, into ``report.json``; the ``index_topk_freq`` rule is compared on the preset's layers.
    """
    given = {"backend": backend, "prompt_len": prompt_len, "topk": topk, "seed": seed}
    given = {key: value for key, value in given.items() if value is not None}
    layers, arrays = record_dump(name, **given)
    config = preset(name)
    return calibrate_arrays(
        layers, arrays, out, keep=keep, producers=producers,
        plan_for=partial(LayerPlan, config.num_layers, compress_ratios=config.compress_ratios),
        source=f"{name} model (random seeded weights, not a trained model), prefill",
        info={"model": name, "weights": "random seeded, not a trained model", **given}, threads=threads, plots=plots,
    )


@dataclass(frozen=True)
class Demo:
    """What :func:`run_demo` ran: preset ``name`` at ``config`` on ``backend`` (``mode`` on ``device``), ``batch``
    prompts of ``prompt_len`` tokens then ``steps`` decode steps, and the ``comparison`` of the plan with every
    sparse layer a producer."""

    name: str
    config: ModelConfig
    backend: str
    mode: str
    device: str
    batch: int
    prompt_len: int
    steps: int
    comparison: PlanComparison


def run_demo(
    name: str = "v32-like",
    *,
    freq: int = 4,
    backend: str | None = None,
    batch: int = 2,
    prompt_len: int | None = None,
    decode_steps: int | None = None,
    topk: int | None = None,
    seed: int = 0,
) -> Demo:
    """Run preset ``name`` (random seeded weights, not a trained model) with every sparse layer a producer and
    with ``index_topk_freq=freq``, prefill then decode, on ``backend`` (None: the automatic choice): see
    :func:`compare_plans`.

    ``batch`` random prompts of ``prompt_len`` tokens (default 4096 on a GPU, 512 on a CPU), ``decode_steps``
    decode steps (default 32 on a GPU, 8 on a CPU), top-k ``topk`` (default: the preset's on a GPU, 128 on a
    CPU); weights and prompts from ``seed``. Bad sizes (as :func:`record_dump` says), an unknown preset or a
    backend that cannot run here raise :class:`ModelSettingError` before any work.
    """
    _check_sizes(freq=freq, batch=batch, prompt_len=prompt_len, decode_steps=decode_steps, topk=topk, seed=seed)
    chosen, avail, overrides = _backend_setup(backend)
    gpu = avail.device != "cpu"
    config = preset(name, topk=topk or (preset(name).topk if gpu else 128), seed=seed, **overrides)
    prompt_len = prompt_len or (4096 if gpu else 512)
    steps = decode_steps or (32 if gpu else 8)
    _check_fits(config, avail.device, batch=batch, prompt_len=prompt_len, decode_steps=steps)
    with dispatch.use_backend(backend) if backend else contextlib.nullcontext():
        model = DSAModel(config, avail.device)
        comparison = compare_plans(model, model.plan(freq), _prompts(config, batch, prompt_len, seed), steps)
    return Demo(name=name, config=config, backend=chosen, mode=avail.mode, device=avail.device, batch=batch,
                prompt_len=prompt_len, steps=steps, comparison=comparison)


def plot_demo(comparison: PlanComparison, path: str | os.PathLike[str]) -> Path:
    """A PNG at ``path`` of each sparse layer's top-k overlap with the producer it reuses (bars) and with the
    previous sparse layer (line), from :func:`compare_plans`; needs matplotlib."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    plan = comparison.plan
    layers = plan.sparse_layers
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.subplots()
    colors = ["tab:blue" if plan.role(layer) == "S" else "tab:gray" for layer in layers]
    axes.bar(layers, [comparison.overlap[layer] for layer in layers], color=colors)
    adjacent = sorted(comparison.adjacent)
    (line,) = axes.plot(adjacent, [comparison.adjacent[layer] for layer in adjacent], "o--", color="tab:orange",
                        label="vs the previous sparse layer")
    handles = [Patch(color="tab:blue", label="shared layer vs the producer it reuses"),
               Patch(color="tab:gray", label="producer (its own top-k)"), line]
    axes.set_ylim(0, 1.05)
    axes.set_xlabel("layer")
    axes.set_ylabel("top-k overlap (fraction of k)")
    axes.set_title(f"IndexCache demo, roles {plan.roles}: random-weight model, not a trained one")
    figure.legend(handles=handles, loc="outside lower center", ncols=3, fontsize="small")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return Path(path)


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
