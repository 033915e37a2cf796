"""Executes a :class:`~indexcache.plan.LayerPlan`'s indexer part, layer by layer.

Per layer, by its role: a **producer** (F) computes its indexer scores and selects top-k into the
forward's :class:`~indexcache.runtime.state.TopkState`; a **shared** layer (S) skips its indexer and
translates the producer's logical indices through its own page table; a layer **without an indexer**
returns None and leaves the state alone.

Integration in an engine's layer loop (the small model in :mod:`indexcache.tools.model.dsa` does exactly this)::

    plan = LayerPlan.from_config(config)                  # once
    runner = IndexerRunner(plan)                           # or IndexerRunner(plan, stage=stages[pp_rank])
    state = TopkState(max_rows, plan.top_k, device)        # once per micro-batch, before graph capture

    # each forward (rows = query tokens of this micro-batch):
    runner.begin(state, rows)                              # or state.load_carry(*received) on a stage with carry_in
    schedule = indexcache.overlap_schedule(device=device, tokens=rows, context=longest_window)  # optional
    for layer in runner.layers:
        ...
        def indexer():
            return runner.layer(layer, state,
                                scores=lambda: my_indexer_logits(layer, hidden),  # called by producers only
                                lengths=lengths,           # [rows] int32 visible length of each row
                                page_table=page_tables[layer],  # this layer's own table
                                row_starts=ks, row_to_batch=req_of_row)
        slots, q = schedule(indexer, lambda: my_query_projection(layer, hidden))  # or: slots = indexer()
        # slots: [rows, k] int32 physical KV slots (-1 = empty), or None for a layer without an indexer
        ...sparse attention over slots...
    if runner.stage is not None and runner.stage.carry_out is not None:
        send(*state.to_carry())                            # to the next pipeline stage

``scores`` is a callable so shared layers never compute logits; it returns ``[rows, N]`` scores
(``indexcache.mqa_logits`` / ``paged_mqa_logits`` output, -inf outside a row's window), or, in decode, a
:class:`~indexcache.runtime.state.PagedLogits` of ``paged_mqa_logits``' inputs: the producer then scores and
selects in one op (``indexcache.paged_topk_translate``), each row's length and table row following from
``context_lens`` and ``next_n``, or for ragged rows from ``context_lens`` and the ``PagedLogits``' own
``row_to_batch`` (``lengths`` and the ``row_to_batch`` given here then serve shared layers only, and with ``hot=``
the producer's HiSparse plan, which reads each row's request from the ``row_to_batch`` given here), or, in prefill, a
:class:`~indexcache.runtime.state.PrefillLogits` of ``mqa_logits``' inputs: the producer scores and selects in one
op in bounded memory (``indexcache.mqa_topk_translate``), each row's window from ``ks`` and ``ke``. To overlap
the producer's indexer with the rest of the layer, call ``runner.layer`` inside the side function of a schedule
made once a forward (:func:`indexcache.overlap_schedule`, above; :func:`indexcache.overlap` decides at each call).
Everything here is host-side bookkeeping around preallocated
buffers: valid under CUDA-graph capture.

**Short sequences.** A row that sees at most k keys selects all of them, whatever its logits: given a host-side
bound ``max_length`` on the rows' visible lengths (the longest request of the batch, which the engine's scheduler
knows), ``runner.layer(..., max_length=...)`` skips a producer's indexer (``scores()`` is not called: no projections,
no logits, no top-k) when the bound is at most k, and selects ``0 .. len - 1`` per row. The index keys of the step
must still be stored (``indexcache.store_index_k``) outside ``scores()``, since later, longer steps read them. An
engine that captures CUDA graphs captures two per batch size: a short graph (captured with ``max_length <= k``,
replayed while the batch's longest context is at most k) and a long one (``max_length=None`` or above k), and picks
one on the host before each replay; the short graph holds no indexer work at all. A bound the engine cannot keep
(a row longer than it promised) selects only that row's first k positions.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

from indexcache.hal import checks
from indexcache.plan import PRODUCER, LayerPlan, Stage
from indexcache.runtime.hot import HotLayer
from indexcache.runtime.state import PagedLogits, PrefillLogits, TopkState


class IndexerRunner:
    """The indexer part of ``plan`` (or of one pipeline ``stage`` of it, whose roles then apply).

    ``k`` and ``page_size`` default to the plan's ``top_k`` and ``page_size``; ``page_size`` is the
    KV page size of the page tables given to :meth:`layer`.
    """

    def __init__(self, plan: LayerPlan, *, stage: Stage | None = None, k: int | None = None,
                 page_size: int | None = None) -> None:
        if not isinstance(plan, LayerPlan):
            raise TypeError(f"plan: expected a LayerPlan (LayerPlan.from_config reads a config), got "
                            f"{type(plan).__name__}")
        self.plan = plan
        self.stage = stage
        self._run = plan if stage is None else plan.for_stage(stage)  # the roles as run here
        self.roles = self._run.roles
        self.k = plan.top_k if k is None else checks.check_int("k", k, 1, checks.MAX_TOPK)
        self.page_size = plan.page_size if page_size is None else checks.check_page_size(page_size)
        self.layers = range(stage.start, stage.stop) if stage is not None else range(plan.num_layers)

    def _check_layer(self, layer: int) -> int:
        """``layer``, checked to be run here. Traceable by Dynamo when the index or the runner's range is symbolic
        (``dynamic=True``, or automatic dynamic shapes at a second layer's call; ``in range`` is not): an int goes
        through ``operator.index``, which specializes it, one graph a layer (its role picks what is traced), and is
        compared with the range's ends."""
        if isinstance(layer, int) and not isinstance(layer, bool):
            layer = operator.index(layer)
            inside = self.layers.start <= layer < self.layers.stop
        else:
            inside = layer in self.layers
        if not inside:
            raise IndexError(f"layer {layer!r} is not run here (layers {self.layers.start}..{self.layers.stop - 1})")
        return layer

    def role(self, layer: int) -> str | None:
        """"F", "S" or None (no indexer) for ``layer`` as this runner executes it."""
        return self._run.role(self._check_layer(layer))

    def source_of(self, layer: int) -> int | None:
        """The producer whose indices ``layer`` uses (itself for a producer; None without an indexer)."""
        return self._run.source_of(self._check_layer(layer))

    def begin(self, state: TopkState, rows: int) -> None:
        """Start a forward of ``rows`` query rows on ``state`` (0 rows clears it)."""
        self._check_state(state)
        state.begin(rows)

    def _check_state(self, state: TopkState) -> None:
        if not isinstance(state, TopkState):
            raise TypeError(f"state: expected a TopkState, got {type(state).__name__}")
        if state.k != self.k:
            raise ValueError(f"state: holds k={state.k}, but this runner selects k={self.k}")

    def layer(self, layer: int, state: TopkState, *,
              scores: Callable[[], torch.Tensor | PagedLogits | PrefillLogits],
              lengths: torch.Tensor, page_table: torch.Tensor, row_starts: torch.Tensor | None = None,
              row_to_batch: torch.Tensor | None = None, max_length: int | None = None,
              hot: HotLayer | None = None) -> torch.Tensor | None:
        """Run ``layer``'s indexer part; returns its physical KV slots ``[rows, k]`` int32 (-1 = empty,
        a view of ``state.physical`` valid until the next sparse layer) or None without an indexer.

        ``scores()`` is called only for a producer: scores ``[rows, N]``, or a
        :class:`~indexcache.runtime.state.PagedLogits` (decode: :meth:`TopkState.produce_paged
        <indexcache.runtime.state.TopkState.produce_paged>`, which derives each row's length and table row from
        its ``context_lens``), or a :class:`~indexcache.runtime.state.PrefillLogits` (prefill:
        :meth:`TopkState.produce_prefill <indexcache.runtime.state.TopkState.produce_prefill>`, each row's window from
        its ``ks`` and ``ke``, its table row from ``row_to_batch``; the logits never written whole).
        ``lengths [rows]`` int32: each row's visible length (and, for a producer given scores, its window length in
        them); ``page_table [B, P]`` int32: this layer's own table;
        ``row_starts [rows]``: window starts in the scores; ``row_to_batch [rows]``: table row of each row
        (identity when None; a shared layer after a producer whose ``PagedLogits`` has ``next_n > 1`` or ragged rows
        refuses None with ``ValueError``, unless its ``page_table`` has one row a row, ``[rows, P]``). A shared layer
        whose producer has not run raises :class:`~indexcache.runtime.state.MissingProducerError`; a state of another k
        than the runner's (however it was begun: :meth:`begin`, or a stage's ``load_carry``) raises ``ValueError``.

        ``max_length``: a host-side bound on every row's visible length (``lengths``, or in decode the lengths
        ``context_lens`` gives), or None. Where it is at most k, a producer selects every visible position without
        scoring (:meth:`TopkState.produce_short <indexcache.runtime.state.TopkState.produce_short>`: ``0 .. len - 1``
        then -1, the selection the top-k makes of such rows) and ``scores()`` is not called: the engine still stores
        the step's index keys itself. A row longer than the bound it was promised selects only its first k
        positions. Module docstring: "Short sequences".

        ``hot``: the layer's HiSparse tensors (:class:`~indexcache.runtime.hot.HotLayer`; the state's
        :attr:`~indexcache.runtime.state.TopkState.hot` buffers must be attached). A producer then plans its group's
        step from its selection, every sparse layer swaps in its own misses (or the producer its whole group's, at once:
        ``HotLayer`` docstring), and the call returns the device rows ``[rows, k]`` int32 the attention reads
        (``device_loc[b, slot]``, -1 none) instead of page-table slots. The plan and the swap-ins take each row's
        request from the ``row_to_batch`` given here, a producer's too (not from a ``PagedLogits``' own): give it
        wherever rows are not one a request in order (``next_n > 1``, ragged rows), or rows would be planned as requests
        they are not. A producer whose ``PagedLogits`` has such rows is refused without it (``ValueError``, before it
        selects), and so is a layer swapping in without the ``row_to_batch`` its producer planned with, or the layer
        planning a carried selection whose producer had such rows (the carry's header says); scores given as a tensor
        do not say how their rows map to requests. A selection loaded by
        :meth:`TopkState.load_carry <indexcache.runtime.state.TopkState.load_carry>` (the producer ran on the previous
        pipeline stage) is planned by the first shared layer of its group called with ``hot``, whose ``HotLayer`` must
        then bring KV (its own layer's, or lists of this stage's layers of the group); the same indices and hot-buffer
        state give the same plan on every stage. A producer that ran without ``hot`` in this forward made no plan: its
        shared layers given ``hot`` raise :class:`~indexcache.runtime.state.MissingProducerError`.
        """
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 0):
            raise ValueError(f"max_length: expected an int >= 0 or None, got {max_length!r}")
        if hot is not None and not isinstance(hot, HotLayer):
            raise TypeError(f"hot: expected a HotLayer (or None), got {type(hot).__name__}")
        self._check_state(state)
        layer = self._check_layer(layer)
        role = self._run.role(layer)
        if role is None:
            return None
        if hot is None:
            return self._indices(layer, role, state, scores, lengths, page_table, row_starts, row_to_batch,
                                 max_length, planned=False)
        if state.hot is None:
            raise ValueError("hot: given, but the state has no hot buffers (attach state.hot = HotBuffers(...))")
        producer, raw = self._run.source_of(layer), state.raw[:state.rows]
        if role == PRODUCER:  # its HotLayer checked before it selects: a refused one leaves the state as it was
            state.hot.check(producer, raw, hot, row_to_batch=row_to_batch)
            self._indices(layer, role, state, scores, lengths, page_table, row_starts, row_to_batch, max_length,
                          planned=True)
            state.hot.plan(producer, raw, hot, row_to_batch=row_to_batch, owner=state)
        elif state.carried:  # the previous stage's producer: its group's step planned here, as the producer would
            state.check_rows_named(layer, row_to_batch, "plan and swap in row r as request r")
            state.hot.check(producer, raw, hot, row_to_batch=row_to_batch)
            state.reused(layer, source=producer)
            state.hot.plan(producer, raw, hot, row_to_batch=row_to_batch, owner=state)
            state.carried = False
        else:  # the producer's raw indices feed the swap-in: no translation through the page table
            state.reused(layer, source=producer)
        return state.hot.swap_in(producer, hot, row_to_batch=row_to_batch, owner=state)

    def _indices(self, layer: int, role: str, state: TopkState, scores, lengths, page_table, row_starts,
                 row_to_batch, max_length, *, planned: bool) -> torch.Tensor:
        """A producer's selection or a shared layer's translation into ``state`` (the page-table slots);
        ``planned``: a HiSparse plan follows the selection, reading each row's request from ``row_to_batch``."""
        if role == PRODUCER and max_length is not None and max_length <= self.k:
            return state.produce_short(layer, lengths, page_table, self.page_size, row_to_batch=row_to_batch)
        if role == PRODUCER:
            if not callable(scores):
                raise TypeError("scores: expected a function of no arguments returning the scores (called by "
                                f"producers only), got {type(scores).__name__}")
            got = scores()
            if isinstance(got, PagedLogits):
                if planned and row_to_batch is None and (got.q.shape[1] > 1 or got.row_to_batch is not None):
                    # refused before the state selects: the plan would take row r as request r
                    layout, hint = ((f"next_n={got.q.shape[1]} rows a request", "row r is request r // next_n")
                                    if got.row_to_batch is None else
                                    ("ragged rows (its own row_to_batch)", "the PagedLogits' own row_to_batch"))
                    raise ValueError(f"row_to_batch: None, but layer {layer}'s PagedLogits has {layout}: with hot= "
                                     "the HiSparse plan and every layer's swap-in read each row's request from the "
                                     "row_to_batch given to layer(), and would take row r as request r; give it "
                                     f"({hint})")
                return state.produce_paged(layer, got.q, got.k_cache, got.weights, got.context_lens,
                                           got.block_table, got.max_context_len, page_table, self.page_size,
                                           logits=got.logits, k_format=got.k_format, q_scale=got.q_scale,
                                           row_to_batch=got.row_to_batch)
            if isinstance(got, PrefillLogits):
                return state.produce_prefill(layer, got, page_table, self.page_size, row_to_batch=row_to_batch)
            if not isinstance(got, torch.Tensor):
                raise TypeError(f"scores: expected the callable to return scores [rows, N] (a torch.Tensor), a "
                                f"PagedLogits or a PrefillLogits, got {type(got).__name__}")
            return state.produce(layer, got, lengths, page_table, self.page_size, row_starts=row_starts,
                                 row_to_batch=row_to_batch)
        return state.reuse(layer, page_table, lengths, self.page_size, row_to_batch=row_to_batch,
                           source=self._run.source_of(layer))
