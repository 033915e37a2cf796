"""A small DSA model with random seeded weights, to run IndexCache end to end on any backend.

**This is not a trained model**, and nothing it outputs means anything: it exists so that producers,
shared layers, per-layer page tables, pipeline carries, micro-batches, side streams and CUDA graphs can
be exercised and timed with the real ops. Its shapes follow DeepSeek-V3.2's indexer (RoPE on the
first half of the index head dim, a Hadamard rotation, block-128 fp8 with power-of-two scales in the
packed 132-byte-a-token cache written by ``indexcache.store_index_k``, the prefill producer's keys gathered by
``indexcache.gather_index_k`` and scored and selected by ``indexcache.mqa_topk_translate``, the decode producer's by
``indexcache.paged_topk_translate``) at small widths.

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
shared layer's translation matters. The producer's indexer runs on a side stream while the main stream projects the
queries and stores the KV latent, as the forward's schedule says (:func:`indexcache.overlap_schedule`, decided once a
forward).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import indexcache
from indexcache.hal import fp4
from indexcache.hal.checks import dtype_names
from indexcache.hal.contract import Schedule
from indexcache.hal.layout import FP8_DTYPES
from indexcache.hal.ops import INDEX
from indexcache.plan import COMPRESS_RATIOS, PRODUCER, LayerPlan
from indexcache.plan.jsontext import shown
from indexcache.runtime.hot import HotBuffers, HotLayer
from indexcache.runtime.runner import IndexerRunner
from indexcache.runtime.state import PagedLogits, PrefillLogits, Recorder, TopkState
from indexcache.runtime.streams import overlap_schedule
from indexcache.tools.model.batch import Batch
from indexcache.tools.model.cache import HotCache, PagedCache
from indexcache.tools.model.checks import MAX_SEED
from indexcache.tools.model.config import ModelConfig, ModelSettingError
from indexcache.tools.model.functional import hadamard, rope_first_half, sparse_attention


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class _Layer:
    wq: torch.Tensor
    wkv: torch.Tensor
    wo: torch.Tensor
    wq_index: torch.Tensor | None
    wk_index: torch.Tensor | None
    w_weights: torch.Tensor | None


# The config's sizes, each an integer >= 1 (index_dim also a power of two >= 4).
_SIZES = ("num_layers", "hidden", "heads", "head_dim", "index_heads", "topk", "page_size", "vocab", "block")
_INDEX_DTYPES = (*FP8_DTYPES, fp4.FP4)


def _check_config(c: ModelConfig) -> None:
    """Raise :class:`ModelSettingError` naming the first setting of ``c`` the model cannot be built with."""
    for name in _SIZES:
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelSettingError(f"{name}: expected an integer >= 1, got {value!r}")
    if c.index_dim % 4 or c.index_dim & (c.index_dim - 1):
        raise ModelSettingError(f"index_dim: expected a power of two >= 4, got {c.index_dim}")
    if not 0 <= c.global_share <= c.block_share <= 1:
        raise ModelSettingError(f"global_share, block_share: expected 0 <= global_share <= block_share <= 1, got "
                                f"{c.global_share!r}, {c.block_share!r}")
    if isinstance(c.seed, bool) or not isinstance(c.seed, int) or not 0 <= c.seed <= MAX_SEED:
        raise ModelSettingError(f"seed: expected an integer in 0..{MAX_SEED} (torch.Generator's 64 bits), got "
                                f"{c.seed!r}")
    if getattr(torch, str(c.index_dtype), None) not in _INDEX_DTYPES:
        raise ModelSettingError(f"index_dtype: expected {dtype_names(_INDEX_DTYPES)}, got {c.index_dtype!r}")
    ratios = c.compress_ratios
    if ratios is not None and (not isinstance(ratios, (tuple, list)) or len(ratios) != c.num_layers or any(
            isinstance(r, bool) or not isinstance(r, int) or r not in COMPRESS_RATIOS for r in ratios)):
        raise ModelSettingError(f"compress_ratios: expected {c.num_layers} ratios (one a layer, num_layers), each "
                                f"{', '.join(map(str, COMPRESS_RATIOS))}, got {shown(ratios)}")


class DSAModel:
    """The small DSA model on ``device`` (weights drawn from ``config.seed``; identical on every device)."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        _check_config(config)
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
                 tokens: torch.Tensor | None = None, recorder: Recorder | None = None, seed: int = 0,
                 hot: int | None = None) -> Generation:
        """Prefill ``prompts`` (int64 ``[n_b]`` each) together, then ``steps`` decode steps, greedy unless
        ``tokens [steps, B]`` forces the token fed at each step (to compare plans on the same inputs).

        The cache (page tables from ``seed``) holds index-K caches for the runner's producers only, as an
        engine would; ``recorder`` is attached for the decode steps. ``hot``: decode with HiSparse, hot buffers of
        that many slots a request in front of a host pool of every token's KV (:class:`HotCache`): the sparse layers
        attend over the rows the plan swapped in (the same tokens, so the same logits as without it).
        """
        batch_size = len(prompts)
        lengths = [int(p.shape[0]) for p in prompts]
        producers = [layer for layer in runner.layers if runner.role(layer) == "F"]
        cache = self.new_cache(batch_size, max(lengths) + steps, index_layers=producers, seed=seed)
        state = TopkState(max(sum(lengths), batch_size), runner.k, self.device)
        hot_cache = None
        if hot is not None:
            hot_cache = HotCache(self.config, batch_size, cache.max_len, hot, device=self.device)
            state.hot = HotBuffers(producers, batch_size, hot, batch_size, runner.k, self.device)
        tables = cache.tables_for(range(batch_size))
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1

        _sync(self.device)
        start = time.perf_counter()
        prefill_logits = self.run(Batch.prefill(prompts, tables), cache, runner, state, hot=hot_cache)[last]
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
            logits = self.run(Batch.decode_step(token, seq_lens, tables, cache.max_len), cache, runner, state,
                              hot=hot_cache)
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

    def run(self, batch: Batch, cache: PagedCache, runner: IndexerRunner, state: TopkState, *,
            hot: HotCache | None = None) -> torch.Tensor:
        """A whole forward: begin ``state`` for the batch, every layer of ``runner``, the head. Returns
        logits ``[R, vocab]``. ``hot``: HiSparse's caches (the state's hot buffers attached), used in decode."""
        runner.begin(state, batch.rows)
        return self.head(self.forward(self.embed(batch), batch, cache, runner, state, hot=hot))

    def forward(self, x: torch.Tensor, batch: Batch, cache: PagedCache, runner: IndexerRunner,
                state: TopkState, *, hot: HotCache | None = None) -> torch.Tensor:
        """Run ``runner.layers`` on hidden states ``x [R, hidden]`` (the state already begun, or loaded
        from a pipeline carry)."""
        schedule = self.schedule(batch)  # every layer's indexer has the same shape: decided once a forward
        for layer in runner.layers:
            x = self.layer(layer, x, batch, cache, runner, state, hot=hot, schedule=schedule)
        return x

    def schedule(self, batch: Batch) -> Schedule:
        """How this forward's layers run their indexer beside the rest: the backend's measured rule for the side work's
        shape (the batch's rows and its longest visible window), overlapped or in order where overlapping does not
        pay (:func:`indexcache.overlap_schedule`)."""
        context = batch.max_length if batch.max_length is not None else batch.max_context_len
        return overlap_schedule(device=self.device, tokens=batch.rows, context=context)

    def layer(self, layer: int, x: torch.Tensor, batch: Batch, cache: PagedCache, runner: IndexerRunner,
              state: TopkState, *, hot: HotCache | None = None, schedule: Schedule | None = None) -> torch.Tensor:
        """One layer on ``x [R, hidden]``; returns the new hidden states. With ``hot`` every token's latent also goes
        to the host pool (and its hot slot), and in decode a sparse layer attends over the hot buffer's rows.
        ``schedule``: the forward's (:meth:`schedule`; None: decided here)."""
        c = self.config
        w = self.layers[layer]
        table = batch.tables[layer]
        rows = batch.rows
        h = F.rms_norm(x, (c.hidden,))
        # Where each row's new token goes in this layer's caches (-1 for padding rows).
        new_slots = indexcache.translate(batch.positions[:, None], table, batch.lengths, c.page_size,
                                         row_to_batch=batch.row_to_batch).view(-1)

        role = runner.role(layer)
        hot_layer = None
        if hot is not None and batch.decode and role is not None:
            # The producer swaps in its whole group's KV at once; its shared layers then copy nothing.
            group = [i for i in runner.layers if runner.source_of(i) == layer] if role == PRODUCER else []
            host_kv = [hot.host[:, i] for i in group] if group else None
            device_kv = [hot.device_kv[i] for i in group] if group else None
            hot_layer = HotLayer(host_kv, device_kv, hot.device_loc, batch.seq_lens, hot.host_loc)

        def indexer() -> torch.Tensor:
            if role is None:
                return self._window_slots(batch, table)
            if role == PRODUCER:  # its index keys, stored whether or not the runner scores (short rows)
                self._store_index_k(layer, h, batch, cache, new_slots)
            return runner.layer(layer, state, scores=lambda: self._index_scores(layer, h, batch, cache),
                                lengths=batch.lengths, page_table=table, row_starts=batch.key_starts,
                                row_to_batch=batch.row_to_batch, max_length=batch.max_length, hot=hot_layer)

        def prepare() -> torch.Tensor:
            kv = cache.kv[layer]
            dump = torch.full_like(new_slots, kv.shape[0] - 1)
            latent = h @ w.wkv
            kv.index_copy_(0, torch.where(new_slots >= 0, new_slots, dump).long(), latent)
            if hot is not None:
                requests = batch.row_to_batch if batch.row_to_batch is not None else \
                    torch.arange(rows, dtype=INDEX, device=self.device)
                hot.store(layer, requests, batch.positions, batch.seq_lens[requests.long()], latent)
            return (h @ w.wq).view(rows, c.heads, c.head_dim)

        slots, q = (schedule or self.schedule(batch))(indexer, prepare)
        kv = hot.device_kv[layer] if hot_layer is not None else cache.kv[layer]
        return x + sparse_attention(q, kv, slots) @ w.wo

    def _window_slots(self, batch: Batch, table: torch.Tensor) -> torch.Tensor:
        """Physical slots of the last ``window`` tokens of each row (layers without an indexer)."""
        offsets = torch.arange(self.config.window, device=self.device, dtype=INDEX)
        raw = batch.positions[:, None] - offsets[None, :]
        return indexcache.translate(raw, table, batch.lengths, self.config.page_size, row_to_batch=batch.row_to_batch)

    def index_keys(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Sparse layer ``layer``'s index keys ``[R, index_dim]`` float32 of hidden states ``h [R, hidden]`` at
        ``positions [R]`` (RoPE, then the Hadamard rotation), before quantization."""
        k = rope_first_half(F.layer_norm(h @ self.layers[layer].wk_index, (self.config.index_dim,)), positions)
        return k @ self.hadamard

    def index_queries(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse layer ``layer``'s index queries ``[R, index_heads, index_dim]`` float32 and head weights
        ``[R, index_heads]`` (times ``index_heads ** -0.5``; the queries' fp8 scales and ``index_dim ** -0.5`` still to
        apply) of hidden states ``h [R, hidden]`` at ``positions [R]``."""
        c, w = self.config, self.layers[layer]
        q = rope_first_half((h @ w.wq_index).view(h.shape[0], c.index_heads, c.index_dim), positions) @ self.hadamard
        return q, (h @ w.w_weights) * c.index_heads**-0.5

    def _store_index_k(self, layer: int, h: torch.Tensor, batch: Batch, cache: PagedCache,
                       new_slots: torch.Tensor) -> None:
        """The producer's index keys of this forward's rows, into its index-K cache at ``new_slots``."""
        if layer not in cache.index_k:
            raise ValueError(f"layer {layer} runs its indexer but the cache has no index-K cache for it "
                             f"(index layers: {sorted(cache.index_k)})")
        indexcache.store_index_k(self.index_keys(layer, h, batch.positions), cache.index_k[layer],
                                 new_slots.to(INDEX), self.fp8)

    def _index_scores(self, layer: int, h: torch.Tensor, batch: Batch,
                      cache: PagedCache) -> torch.Tensor | PagedLogits | PrefillLogits:
        """The producer's indexer over its index-K cache (this forward's keys stored by :meth:`_store_index_k`): in
        prefill, what :meth:`_prefill_logits` gives of the keys gathered from the cache; in decode, the paged logits'
        inputs (:class:`~indexcache.runtime.state.PagedLogits`), which the runner scores and selects from in one op
        (``indexcache.paged_topk_translate``)."""
        c = self.config
        rows, heads, dim = batch.rows, c.index_heads, c.index_dim
        q, head = self.index_queries(layer, h, batch.positions)
        k_cache = cache.index_k[layer]
        q8, q_scale = indexcache.quantize_index_k(q.reshape(rows * heads, dim), self.fp8, block=dim)
        weights = head * q_scale.view(rows, heads) * dim**-0.5
        table = batch.tables[layer]
        if batch.decode:
            return PagedLogits(q8.view(rows, 1, heads, dim), k_cache, weights, batch.seq_lens, table,
                               batch.max_context_len)
        keys = batch.key_positions.shape[0]  # every request's keys, in request order
        k8, k_scale = indexcache.gather_index_k(k_cache, table, batch.seq_lens, dim=dim, fp8_dtype=self.fp8,
                                                out_k=torch.empty(keys, dim, dtype=self.fp8, device=self.device),
                                                out_scale=torch.empty(keys, device=self.device))
        ks = batch.key_starts
        return self._prefill_logits(layer, q8.view(rows, heads, dim), k8, k_scale, weights, ks, ks + batch.lengths)

    def _prefill_logits(self, layer: int, q8: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor,
                        weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor | PrefillLogits:
        """A prefill producer's indexer over the batch's ``N`` gathered keys (``q8 [R, H, D]``, ``k8 [N, D]`` fp8,
        ``k_scale [N]``, ``weights [R, H]``, window ``[ks, ke)`` int32 ``[R]``): those inputs as
        :class:`~indexcache.runtime.state.PrefillLogits`, which the runner scores and selects from in one op in
        bounded memory (``indexcache.mqa_topk_translate``). A subclass may return logits ``[R, N]`` float32 instead,
        e.g. of a shard of the keys (context parallel), which the runner selects from."""
        return PrefillLogits(q8, k8, k_scale, weights, ks, ke)


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
