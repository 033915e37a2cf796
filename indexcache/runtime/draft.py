"""DraftTopk: a producer's top-k from the draft-extend step, served to the draft decode steps that follow.

An MTP / EAGLE draft loop (chain drafts: one row a request at each draft step) runs the draft model's indexer at the
draft extend, over the tokens the last verification accepted, then at every draft decode step over the same context
plus the tokens drafted since. This is IndexCache along the time axis: the draft extend's producers select as usual
and :meth:`DraftTopk.keep` keeps each request's newest row of their selections; draft decode step ``i`` (``1 ..
max_steps``) skips the producer's indexer and :meth:`DraftTopk.serve` writes into the forward's
:class:`~indexcache.runtime.state.TopkState` the kept row plus the ``i`` positions drafted since, ``seq_len - i ..
seq_len - 1``; shared layers reuse that as any producer's selection. After verification (tokens accepted or rejected,
the context changes) the engine calls :meth:`DraftTopk.reset`, and the next draft extend selects afresh.

With HiSparse (the state's hot buffers attached, :mod:`indexcache.runtime.hot`), ``serve(..., hot=HotLayer(...))``
plans the producer group's step from the served selection, swaps in the producer's misses (or its group's) and
returns the device rows, as a producer run through the runner with ``hot=`` does; the draft step's shared layers then
swap in with that plan (``runner.layer(..., hot=...)``). Without ``hot`` the served selection makes no plan, and a
shared layer given ``hot`` raises :class:`~indexcache.runtime.state.MissingProducerError`.

**Which slots the drafted positions take.** Row ``r`` at step ``i``, of length ``seq_len`` (its extend length + i),
starts from the kept row and writes its ``i`` newest positions, in order, into the slots ``min(seq_len, k) - i ..
min(seq_len, k) - 1``:

- a row of at most ``k`` positions (``seq_len <= k``): the kept row is ``0 .. seq_len - i - 1`` then -1 (every
  producer op's rule for such rows) and the new positions fill the next ``i`` slots, so the served row is ``0 ..
  seq_len - 1`` then -1: **exactly** what recomputing the top-k selects, slot by slot;
- a longer row gives up the kept row's last ``i`` slots to its newest positions. Which picks those are is the
  producer's order: its ``i`` lowest-scored where it sorts (``indexcache.topk_translate(sorted=True)``, e.g. through
  :meth:`TopkState.select <indexcache.runtime.state.TopkState.select>`), otherwise whichever the op placed last (the
  order inside a row is unspecified: the torch backend's unsorted rows ascend by position, so there the newest picks).
  Everything else is the extend's selection for the extend's query: an approximation of what the draft step's own
  query would select, whose agreement ``tests/test_draft.py`` measures on the small model (``docs/draft.md``).

The newest ``i`` positions are always in the served row. ``seq_lens`` at step ``i`` must be each request's extend
length + ``i``, the same requests in the same rows as at :meth:`~DraftTopk.keep` (not checked: it would sync); a
padding row (``seq_len`` 0) gets no drafted position.

Graph-safe: the kept selections and the step's scratch are preallocated at construction; :meth:`~DraftTopk.keep`,
:meth:`~DraftTopk.serve` and :meth:`~DraftTopk.reset` only write into them and into the state's buffers, with device
ops, and check host-side metadata only (no host sync; no allocation besides the temporaries of the backend's
translate, which the torch backend has), so each can be captured in a CUDA graph.

The engine's draft loop, around :class:`~indexcache.runtime.runner.IndexerRunner` (``rows``: the draft extend's
rows; ``last_rows [B]``: the row of each request's newest token among them)::

    draft = DraftTopk(producers, max_requests, plan.top_k, max_steps, device)      # once, before graph capture

    runner.begin(state, rows)                                                       # the draft extend
    for layer in runner.layers:
        slots = runner.layer(layer, state, scores=..., lengths=..., page_table=tables[layer], ...)
        if runner.role(layer) == "F":
            draft.keep(layer, state, last_rows)
    for step in range(1, num_steps + 1):                                            # the draft decode steps
        runner.begin(state, B)
        for layer in runner.layers:
            if runner.role(layer) == "F":                                           # its index keys still stored
                slots = draft.serve(layer, state, step, seq_lens, tables[layer], runner.page_size)
            else:
                slots = runner.layer(layer, state, scores=..., lengths=seq_lens, page_table=tables[layer])
    ... verify ...
    draft.reset()                                                                   # accepted or rejected
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from indexcache.hal import ops
from indexcache.hal.ops import INDEX
from indexcache.runtime.hot import HotLayer
from indexcache.runtime.state import MissingProducerError, TopkState


def _size(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name}: expected an int {bound}, got {value!r}")


class DraftTopk:
    """The draft extend's selections of producers ``layers``, for up to ``max_rows`` requests of top-``k``, served to
    ``max_steps`` draft decode steps; buffers on ``device``, allocated once here."""

    def __init__(self, layers: Sequence[int], max_rows: int, k: int, max_steps: int,
                 device: torch.device | str = "cpu") -> None:
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
            raise ValueError(f"layers: expected a non-empty sequence of producer layers, got {layers!r}")
        for layer in layers:
            _size("layers", layer, 0)
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers: a layer is listed twice in {list(layers)}")
        _size("max_rows", max_rows, 0)
        _size("k", k, 1)
        _size("max_steps", max_steps, 1, k)
        self.layers = tuple(layers)
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        self.kept = torch.full((len(self.layers), max_rows, k), -1, dtype=INDEX, device=device)
        # Step i reads _ahead[:i] = 0 .. i - 1 and _back[-i:] = -i .. -1: tensors, not Python numbers, so that no
        # scalar is wrapped into a new tensor at each step.
        self._ahead = torch.arange(max_steps, dtype=torch.int64, device=device)
        self._back = torch.arange(-max_steps, 0, dtype=INDEX, device=device)
        self._start = torch.empty(max_rows, dtype=INDEX, device=device)  # each row's first drafted slot
        self._slots = torch.empty(max_rows * max_steps, dtype=torch.int64, device=device)
        self._positions = torch.empty(max_rows * max_steps, dtype=INDEX, device=device)
        self.rows = 0  # requests kept by this draft extend
        self._kept: set[int] = set()  # layers kept since the last reset
        self._served = False

    @property
    def max_rows(self) -> int:
        return self.kept.shape[1]

    @property
    def k(self) -> int:
        return self.kept.shape[2]

    @property
    def max_steps(self) -> int:
        return self._ahead.shape[0]

    def __repr__(self) -> str:
        return (f"DraftTopk(layers={list(self.layers)}, rows={self.rows}/{self.max_rows}, k={self.k}, "
                f"max_steps={self.max_steps}, kept={sorted(self._kept)})")

    def _check(self, layer: int, state: TopkState) -> int:
        if layer not in self._index:
            raise ValueError(f"layer: {layer!r} is not one of this DraftTopk's producers {list(self.layers)}")
        if state.k != self.k:
            raise ValueError(f"state: holds k={state.k}, but this DraftTopk keeps k={self.k}")
        return self._index[layer]

    def keep(self, layer: int, state: TopkState, last_rows: torch.Tensor | None = None) -> None:
        """At the draft extend, right after producer ``layer`` ran on ``state``: keep its selection of rows
        ``last_rows [B]`` (an integer tensor on the state's device: each request's newest row of the extend, e.g.
        ``cumsum(extend_lens) - 1``; None: the state's live rows, one a request). Kept rows past ``B`` are -1.

        Every producer of one draft extend keeps the same ``B``; a draft extend after served steps needs
        :meth:`reset` first (the verification changed the context)."""
        index = self._check(layer, state)
        if state.producer != layer:
            held = "no producer's" if state.producer is None else f"layer {state.producer}'s"
            raise MissingProducerError(f"keep(layer={layer}): the state holds {held} selection; call keep right "
                                       "after that producer ran on the state")
        if self._served:
            raise RuntimeError("keep(): draft steps were served since the last reset(); call reset() after "
                               "verification, before the next draft extend")
        if last_rows is None:
            rows = state.rows
        else:
            if not isinstance(last_rows, torch.Tensor) or last_rows.dim() != 1 or \
                    last_rows.dtype not in (torch.int32, torch.int64):
                raise ValueError("last_rows: expected a 1-D int32 or int64 tensor (each request's newest row of the "
                                 f"extend), got {getattr(last_rows, 'dtype', type(last_rows).__name__)} "
                                 f"{list(getattr(last_rows, 'shape', []))}")
            if last_rows.device != state.raw.device:
                raise ValueError(f"last_rows: on {last_rows.device}, the state on {state.raw.device}")
            rows = last_rows.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"last_rows: {rows} requests, but this DraftTopk holds at most {self.max_rows}")
        if self._kept and rows != self.rows:
            if layer in self._kept:
                raise ValueError(f"last_rows: {rows} requests, but layer {layer} was kept with {self.rows} since the "
                                 "last reset(); call reset() after verification, before the next draft extend")
            raise ValueError(f"last_rows: {rows} requests, but this draft extend's earlier producers kept "
                             f"{self.rows}")
        kept = self.kept[index]
        if last_rows is None:
            kept[:rows].copy_(state.raw[:rows])
        else:
            torch.index_select(state.raw[: state.rows], 0, last_rows, out=kept[:rows])
        kept[rows:].fill_(-1)
        self.rows = rows
        self._kept.add(layer)

    def serve(self, layer: int, state: TopkState, step: int, seq_lens: torch.Tensor, page_table: torch.Tensor,
              page_size: int, *, row_to_batch: torch.Tensor | None = None,
              hot: HotLayer | None = None) -> torch.Tensor:
        """Draft decode step ``step`` (1 .. ``max_steps``), producer ``layer`` without its indexer: the kept row plus
        the ``step`` newest positions into ``state.raw`` (module docstring: which slots), translated through this
        layer's ``page_table`` into ``state.physical``; ``state``'s producer becomes ``layer``. Returns the
        physical slots ``[B, k]`` int32 (-1 = empty), a view of ``state.physical``.

        ``state`` begun with the ``B`` rows :meth:`keep` kept (one a request, in the same order); ``seq_lens [B]``
        int32: each row's visible length, its extend length + ``step``; ``page_table``, ``page_size`` and
        ``row_to_batch`` as for :func:`indexcache.translate`.

        ``hot``: the producer's HiSparse tensors (:class:`~indexcache.runtime.hot.HotLayer`; ``state.hot`` must be
        attached), checked before ``state.raw`` is written. The served selection then plans ``layer``'s group's step
        into ``state.hot`` and the layer's misses (or its group's) are swapped in; returns the device rows ``[B, k]``
        int32 (``device_loc[b, slot]``, -1 none; a view of the hot buffers valid until the next layer) instead of the
        physical slots, which ``state.physical`` still receives."""
        index = self._check(layer, state)
        _size("step", step, 1, self.max_steps)
        if layer not in self._kept:
            raise MissingProducerError(f"layer {layer}: no selection kept since the last reset(); run the draft "
                                       "extend's producer and keep() it before the draft decode steps")
        rows = self.rows
        if state.rows != rows:
            raise ValueError(f"state: begun with {state.rows} rows, but the draft extend kept {rows} (one a request)")
        if not isinstance(seq_lens, torch.Tensor) or tuple(seq_lens.shape) != (rows,) or seq_lens.dtype != INDEX:
            raise ValueError(f"seq_lens: expected int32 [{rows}] (one a request kept by the draft extend), got "
                             f"{getattr(seq_lens, 'dtype', type(seq_lens).__name__)} "
                             f"{list(getattr(seq_lens, 'shape', []))}")
        if seq_lens.device != state.raw.device:
            raise ValueError(f"seq_lens: on {seq_lens.device}, the state on {state.raw.device}")
        state.check_translation("seq_lens", seq_lens, page_table, page_size, row_to_batch)  # before raw is written
        if hot is not None:
            if not isinstance(hot, HotLayer):
                raise TypeError(f"hot: expected a HotLayer (or None), got {type(hot).__name__}")
            if state.hot is None:
                raise ValueError("hot: given, but the state has no hot buffers (attach state.hot = HotBuffers(...))")
            state.hot.check(layer, state.raw[:rows], hot, row_to_batch=row_to_batch)
        raw = state.raw[:rows]
        raw.copy_(self.kept[index, :rows])
        back = self._back[self.max_steps - step:]  # -step .. -1
        start = self._start[:rows]
        torch.clamp(seq_lens, max=self.k, out=start)
        start.add_(back[0]).clamp_(min=0)  # min(seq_len, k) - step; a padding row (seq_len 0) writes -1 from slot 0
        slots = self._slots[: rows * step].view(rows, step)
        positions = self._positions[: rows * step].view(rows, step)
        torch.add(start[:, None], self._ahead[:step], out=slots)
        torch.add(seq_lens[:, None], back, out=positions)  # seq_len - step .. seq_len - 1
        raw.scatter_(1, slots, positions.clamp_(min=-1))
        out = ops.translate(raw, page_table, seq_lens, page_size, row_to_batch=row_to_batch,
                            out=state.physical[:rows])
        self._served = True
        state.produced(layer)
        if hot is None:
            return out
        state.hot.plan(layer, raw, hot, row_to_batch=row_to_batch, owner=state)
        return state.hot.swap_in(layer, hot, row_to_batch=row_to_batch, owner=state)

    def reset(self) -> None:
        """After verification: forget every kept selection (-1 in the buffers); the next draft extend keeps afresh."""
        self.kept.fill_(-1)
        self.rows = 0
        self._kept.clear()
        self._served = False
