"""TopkState: the producer's top-k indices, carried across the layers of one forward.

One state per forward in flight (one per micro-batch, so two-batch overlap keeps them apart). It owns
two int32 buffers of a fixed capacity ``[max_rows, k]``, allocated once at construction (before any
CUDA-graph capture):

- ``raw``: the raw *logical* token positions the last producer selected, -1 in empty slots. A
  producer writes them through ``indexcache.topk_translate(..., out_raw=...)`` from its scores
  (:meth:`TopkState.produce`), or in decode through ``indexcache.paged_topk_translate(..., out_raw=...)``
  from its paged indexer inputs (:meth:`TopkState.produce_paged`, :class:`PagedLogits`), or in prefill through
  ``indexcache.mqa_topk_translate(..., out_raw=...)`` (:meth:`TopkState.produce_prefill`, :class:`PrefillLogits`);
  rows past the live batch are set to -1 every time, so one request never sees another's stale rows.
- ``physical``: the physical KV slots of the sparse layer being run, through *that layer's* page
  table (a producer's from its selection, a shared layer's from ``indexcache.translate`` of
  ``raw``); valid until the next sparse layer runs.

All checks are on host-side metadata (row counts, which layer produced), so nothing here syncs with
the device, and every write goes into the preallocated buffers. A shared layer with no producer output
in this forward raises :class:`MissingProducerError` instead of reading whatever the buffer holds; an
empty batch clears the state. Across a pipeline-stage boundary the state travels as a tensor plus a
:class:`CarryHeader` (:meth:`TopkState.to_carry` / :meth:`TopkState.load_carry`; a malformed carry, or one that does
not match its tensor or the state, raises :class:`CarryError` before anything is allocated or written). A recorder hook
(:attr:`TopkState.recorder`, None by default: then it costs one attribute test per layer) sees every
sparse layer's logical indices, reused ones included.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from indexcache.hal import checks, ops
from indexcache.hal.ops import INDEX

CARRY_VERSION = 2  # 2: the header holds the producer's rows a request (``CarryHeader.layout``)
IN_ORDER, RAGGED = 1, 0  # CarryHeader.layout: rows one a request in order; rows of the producer's own row_to_batch


class MissingProducerError(RuntimeError):
    """A shared layer ran with no producer output in its forward's state."""


class CarryError(ValueError):
    """A carry (header or carried tensor) that is malformed or does not match the state receiving it."""


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CarryError(f"carry header: {name}: expected an int >= 0, got {value!r}")


@dataclass(frozen=True)
class CarryHeader:
    """What travels with the carried ``raw [rows, k]`` int32 tensor across a pipeline-stage boundary: the
    producer layer, the live rows and k, how the producer's rows map to requests (``layout``: ``IN_ORDER`` 1, one a
    request in order, also where the producer could not tell, scores given as a tensor; ``n >= 2``, next_n rows a
    request, row ``r`` request ``r // n``; ``RAGGED`` 0, rows of the producer's own ``row_to_batch``), each an int >=
    0, and the format's version (:class:`CarryError` otherwise). A shared layer of the next stage given no
    ``row_to_batch`` after a producer whose rows are not in order is refused, as on the producer's own stage
    (:meth:`TopkState.reuse`: unless its page table has one row a row)."""

    producer: int
    rows: int
    k: int
    layout: int = IN_ORDER
    version: int = CARRY_VERSION

    def __post_init__(self) -> None:
        for name in ("version", "producer", "rows", "k", "layout"):
            _check_count(name, getattr(self, name))

    def to_tensor(self) -> torch.Tensor:
        """The header as int64 ``[5]`` (version, producer, rows, k, layout), for tensor-only transports."""
        return torch.tensor([self.version, self.producer, self.rows, self.k, self.layout], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> CarryHeader:
        """Inverse of :meth:`to_tensor`: ``t`` holds 5 integers (any integer dtype, as the format is int64; a
        float tensor is refused rather than rounded); a device tensor is copied to the host. A version 1 header
        (4 integers, no layout) is read as such, for :meth:`check` to refuse by its version."""
        if not isinstance(t, torch.Tensor):
            raise CarryError(f"carry header: expected a tensor, got {type(t).__name__}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise CarryError(f"carry header: expected an integer tensor (int64 [5]), got {t.dtype}")
        if tuple(t.shape) not in ((5,), (4,)):
            raise CarryError("carry header: expected shape [5] (version, producer, rows, k, layout), got "
                             f"{list(t.shape)}")
        if t.is_meta:
            raise CarryError("carry header: a meta tensor holds no values")
        version, producer, rows, k, *layout = t.tolist()
        if not layout and version != 1:  # 4 integers are only version 1's format: a later one's lost its layout
            raise CarryError(f"carry header: expected shape [5] (version, producer, rows, k, layout), got [4] of "
                             f"version {version!r}")
        return cls(producer=producer, rows=rows, k=k, layout=layout[0] if layout else IN_ORDER, version=version)

    def layout_text(self) -> str | None:
        """How the producer's rows map to requests, in words, where they are not one a request in order; else
        None."""
        return _layout_text(self.layout)

    def check(self, raw: torch.Tensor) -> None:
        """Raise :class:`CarryError` unless this header's format version is the library's and ``raw`` is the
        int32 ``[rows, k]`` tensor with data that it describes."""
        if self.version != CARRY_VERSION:
            raise CarryError(f"carry header: version {self.version}, this library reads {CARRY_VERSION}")
        if not isinstance(raw, torch.Tensor):
            raise CarryError(f"carry: expected a tensor, got {type(raw).__name__}")
        if tuple(raw.shape) != (self.rows, self.k) or raw.dtype != INDEX:
            raise CarryError(f"carry: expected int32 [{self.rows}, {self.k}], got {raw.dtype} {list(raw.shape)}")
        if raw.is_meta:
            raise CarryError("carry: raw is a meta tensor, which holds no indices to carry")


Recorder = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class PagedLogits:
    """A decode producer's indexer inputs, as :func:`indexcache.paged_mqa_logits` takes them, for
    :meth:`TopkState.produce_paged` to score and select in one op (:func:`indexcache.paged_topk_translate`).

    ``q [B, next_n, H, D]`` fp8; ``k_cache`` the packed index-K cache; ``weights [B * next_n, H]`` float32;
    ``context_lens [B]`` int32; ``block_table [B, P]`` int32, the index-K cache's page table; ``logits``: an
    optional ``[B * next_n, max_context_len]`` float32 buffer for the logits (allocated when None); ``k_format``:
    None for a cache in ``q``'s fp8 format, ``torch.float4_e2m1fn_x2`` for an MXFP4 one (docs/fp4.md); ``q_scale``:
    MXFP4 queries' block scales (``q [B, next_n, H, D / 2]`` float4_e2m1fn_x2 on an MXFP4 cache), else None;
    ``row_to_batch``: ragged rows (any number of draft tokens a request), ``[R]`` int32, each row's request, its row
    of ``block_table`` and of the layer's page table, with ``q [R, 1, H, D]``, ``weights [R, H]`` and
    ``context_lens [R]`` each row's own visible length (:func:`indexcache.paged_topk_translate`); None: the uniform
    ``next_n`` layout.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    weights: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    max_context_len: int
    logits: torch.Tensor | None = None
    k_format: torch.dtype | None = None
    q_scale: torch.Tensor | None = None
    row_to_batch: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillLogits:
    """A prefill producer's indexer inputs, as :func:`indexcache.mqa_logits` takes them, for
    :meth:`TopkState.produce_prefill` to score and select in one op in bounded memory
    (:func:`indexcache.mqa_topk_translate`: the ``[rows, N]`` logits are never written whole).

    ``q [rows, H, D]`` fp8 or bfloat16 (or MXFP4 with ``q_scale``, on MXFP4 keys); ``k [N, D]`` (or MXFP4 keys) and
    ``k_scale``, e.g. from :func:`indexcache.gather_index_k`; ``weights [rows, H]`` float32; ``ks``, ``ke [rows]``
    int32, each row's key window (its start is where the row's positions count from); ``workspace`` /
    ``workspace_bytes``: the op's scratch and its bound (None: the backend's own, 2 GiB at most).
    """

    q: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    weights: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor
    workspace: torch.Tensor | None = None
    workspace_bytes: int | None = None
    q_scale: torch.Tensor | None = None


class TopkState:
    """Per-forward top-k state with buffers of capacity ``[max_rows, k]`` int32 on ``device``."""

    def __init__(self, max_rows: int, k: int, device: torch.device | str = "cpu") -> None:
        checks.check_int("max_rows", max_rows, 0)
        checks.check_k(k)  # what the ops select at most: a state of more could never be filled
        self.raw = torch.full((max_rows, k), -1, dtype=INDEX, device=device)
        self.physical = torch.full((max_rows, k), -1, dtype=INDEX, device=device)
        self._positions = torch.arange(k, dtype=INDEX, device=device)  # what a short row selects (produce_short)
        self._beyond = torch.empty((max_rows, k), dtype=torch.bool, device=device)
        self.producer: int | None = None
        self.rows = 0
        self.recorder: Recorder | None = None
        self.hot = None  # HiSparse's hot buffers (indexcache.runtime.hot.HotBuffers), where the engine attaches them
        self.carried = False  # raw loaded by load_carry and not yet planned for HiSparse (the runner plans it late)
        # The producer's rows are not one a request in order (a PagedLogits of next_n > 1 rows a request, or ragged
        # rows of its own row_to_batch): what layout, for reuse's refusal of a row_to_batch None; None otherwise.
        self._layout = IN_ORDER  # the producer's rows a request (CarryHeader.layout), for reuse's row_to_batch check

    @property
    def max_rows(self) -> int:
        return self.raw.shape[0]

    @property
    def k(self) -> int:
        return self.raw.shape[1]

    def __repr__(self) -> str:
        return f"TopkState(rows={self.rows}/{self.max_rows}, k={self.k}, producer={self.producer})"

    def begin(self, rows: int) -> None:
        """Start a forward of ``rows`` live rows (query tokens): no producer yet (and no HiSparse plan, where
        :attr:`hot` is attached); rows past the live batch are -1 in both buffers (an engine reading the whole buffer
        never sees an earlier batch's slots); 0 rows clears the state."""
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= self.max_rows:
            raise ValueError(f"rows: expected an int in 0..{self.max_rows} (the state's capacity), got {rows!r}")
        self.raw[rows:].fill_(-1)
        self.physical[rows:].fill_(-1)
        self.rows = rows
        self.producer = None
        self.carried = False
        self._layout = IN_ORDER
        if self.hot is not None:
            self.hot.forget()

    def clear(self) -> None:
        """Forget the producer and set every raw index and physical slot to -1."""
        self.begin(0)

    def _check_rows(self, name: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor of {self.rows} rows (the live batch given to begin()), "
                            f"got {type(t).__name__}")
        if t.dim() == 0:
            raise ValueError(f"{name}: expected [{self.rows}, ...] ({self.rows} rows: the live batch given to "
                             "begin()), got a 0-d tensor")
        if t.shape[0] != self.rows:
            raise ValueError(f"{name}: expected {self.rows} rows (the live batch given to begin()), got {t.shape[0]}")

    def check_translation(self, lengths_name: str, lengths, page_table, page_size, row_to_batch) -> None:
        """The arguments of a translation of the live rows (``lengths`` named ``lengths_name``), checked as
        :func:`indexcache.translate` checks them, before a producer writes ``raw``: a refused call leaves the state as
        it was (shared layers keep reusing the producer before it). Metadata only: valid under CUDA-graph capture."""
        checks.check_tensor(lengths_name, lengths, (INDEX,), (self.rows,), self.raw.device)
        checks.check_translate_inputs((self.rows, self.k), page_table, lengths, page_size, row_to_batch,
                                      self.raw.device)

    def produce(self, layer: int, scores: torch.Tensor, lengths: torch.Tensor, page_table: torch.Tensor,
                page_size: int, *, row_starts: torch.Tensor | None = None,
                row_to_batch: torch.Tensor | None = None) -> torch.Tensor:
        """Producer ``layer``: top-k of ``scores [rows, N]`` into ``raw`` and ``physical``; returns the
        physical slots ``[rows, k]`` int32 (-1 = empty) through ``page_table``.

        Arguments as for :func:`indexcache.topk_translate`: ``lengths [rows]`` int32 is each row's
        window length and visible length, ``row_starts [rows]`` its window start in ``scores``.
        """
        self._check_rows("scores", scores)
        rows = self.rows
        out = self.select(scores, lengths, page_table, page_size, row_starts=row_starts, row_to_batch=row_to_batch,
                          out=self.physical[:rows], out_raw=self.raw[:rows])
        self.produced(layer)
        return out

    def select(self, scores: torch.Tensor, lengths: torch.Tensor, page_table: torch.Tensor, page_size: int, *,
               row_starts: torch.Tensor | None, row_to_batch: torch.Tensor | None, out: torch.Tensor,
               out_raw: torch.Tensor) -> torch.Tensor:
        """The producer's selection, into ``out`` (physical) and ``out_raw`` (logical) ``[rows, k]`` int32:
        :func:`indexcache.topk_translate`. A subclass may select otherwise with the same result contract
        (sorted rows, or the context-parallel merge of ``bench/cp_model_gpu.py``)."""
        return ops.topk_translate(scores, lengths, self.k, page_table, page_size, row_starts=row_starts,
                                         row_to_batch=row_to_batch, out=out, out_raw=out_raw)

    def produce_paged(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor,
                      context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                      page_table: torch.Tensor, page_size: int, *, logits: torch.Tensor | None = None,
                      k_format: torch.dtype | None = None, q_scale: torch.Tensor | None = None,
                      row_to_batch: torch.Tensor | None = None) -> torch.Tensor:
        """Decode producer ``layer``: its paged indexer logits and their top-k into ``raw`` and ``physical`` in
        one op; returns the physical slots ``[rows, k]`` int32 (-1 = empty) through ``page_table``.

        Arguments as for :func:`indexcache.paged_topk_translate` (``rows = B * next_n``): row ``b * next_n + j``
        sees ``context_lens[b] - next_n + 1 + j`` keys and uses ``page_table`` row ``b``; ``logits``, when
        given, receives the logits; ``k_format`` names an MXFP4 cache, ``q_scale`` MXFP4 queries' block scales;
        ``row_to_batch [R]`` ragged rows (``q [R, 1, H, D]``): row ``r`` sees ``context_lens[r]`` keys and uses
        row ``row_to_batch[r]`` of both tables.
        """
        self._check_rows("weights", weights)
        rows = self.rows
        # A subclass written before these keeps working: the arguments it did not know are passed only when given.
        more = {name: value for name, value in (("k_format", k_format), ("q_scale", q_scale),
                                                ("row_to_batch", row_to_batch)) if value is not None}
        out = self.select_paged(q, k_cache, weights, context_lens, block_table, max_context_len, page_table,
                                page_size, logits=logits, out=self.physical[:rows], out_raw=self.raw[:rows], **more)
        self.produced(layer)
        self._layout = RAGGED if row_to_batch is not None else q.shape[1]
        return out

    def produce_prefill(self, layer: int, inputs: PrefillLogits, page_table: torch.Tensor, page_size: int, *,
                        row_to_batch: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill producer ``layer``: its indexer logits and their top-k into ``raw`` and ``physical`` in one op, in
        bounded memory; returns the physical slots ``[rows, k]`` int32 (-1 = empty) through ``page_table``.

        Arguments as for :func:`indexcache.mqa_topk_translate`: row ``t`` selects among the keys of its window
        ``[ks[t], ke[t])`` (clipped to the keys), its positions counted from the window's start, and translates them
        through ``page_table`` row ``row_to_batch[t]`` (row ``t`` when None).
        """
        self._check_rows("weights", inputs.weights)
        rows = self.rows
        out = self.select_prefill(inputs, page_table, page_size, row_to_batch=row_to_batch,
                                  out=self.physical[:rows], out_raw=self.raw[:rows])
        self.produced(layer)
        return out

    def select_prefill(self, inputs: PrefillLogits, page_table: torch.Tensor, page_size: int, *,
                       row_to_batch: torch.Tensor | None, out: torch.Tensor, out_raw: torch.Tensor) -> torch.Tensor:
        """The prefill producer's scoring and selection, into ``out`` (physical) and ``out_raw`` (logical)
        ``[rows, k]`` int32: :func:`indexcache.mqa_topk_translate`. A subclass may select otherwise with the same
        result contract, as for :meth:`select`."""
        return ops.mqa_topk_translate(inputs.q, inputs.k, inputs.k_scale, inputs.weights, inputs.ks, inputs.ke,
                                      self.k, page_table, page_size, row_to_batch=row_to_batch, out=out,
                                      out_raw=out_raw, workspace=inputs.workspace,
                                      workspace_bytes=inputs.workspace_bytes, q_scale=inputs.q_scale)

    def produce_short(self, layer: int, lengths: torch.Tensor, page_table: torch.Tensor, page_size: int, *,
                      row_to_batch: torch.Tensor | None = None) -> torch.Tensor:
        """Producer ``layer`` on rows no longer than k, without scores: row ``r`` selects ``0 .. lengths[r] - 1``
        then -1 (what :func:`indexcache.topk` selects for such a row, whatever its scores), into ``raw``, and those
        positions through ``page_table`` into ``physical`` (:func:`indexcache.translate`); returns the physical
        slots ``[rows, k]`` int32 (-1 = empty).

        ``lengths [rows]`` int32: each row's visible length (negative counts as 0; a row longer than k selects its
        first k positions); ``row_to_batch [rows]``: its table row (identity when None). Writes only into the
        state's buffers: valid under CUDA-graph capture."""
        self.check_translation("lengths", lengths, page_table, page_size, row_to_batch)
        rows = self.rows
        raw, beyond = self.raw[:rows], self._beyond[:rows]
        torch.ge(self._positions, lengths[:, None], out=beyond)
        raw.copy_(self._positions.expand(rows, -1)).masked_fill_(beyond, -1)
        out = ops.translate(raw, page_table, lengths, page_size, row_to_batch=row_to_batch, out=self.physical[:rows])
        self.produced(layer)
        return out

    def produced(self, layer: int) -> None:
        """Producer ``layer`` wrote ``raw`` (the live rows): shared layers reuse it from now on; the recorder sees it.
        The ``produce*`` methods call it; so does a companion that fills ``raw`` and ``physical`` itself
        (:meth:`indexcache.runtime.draft.DraftTopk.serve`)."""
        self.producer = layer
        self.carried = False
        self._layout = IN_ORDER
        if self.recorder is not None:
            self.recorder(layer, self.raw[: self.rows])

    def select_paged(self, q: torch.Tensor, k_cache: torch.Tensor, weights: torch.Tensor,
                     context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                     page_table: torch.Tensor, page_size: int, *, logits: torch.Tensor | None, out: torch.Tensor,
                     out_raw: torch.Tensor, k_format: torch.dtype | None = None,
                     q_scale: torch.Tensor | None = None, row_to_batch: torch.Tensor | None = None) -> torch.Tensor:
        """The decode producer's scoring and selection, into ``out`` (physical) and ``out_raw`` (logical)
        ``[rows, k]`` int32: :func:`indexcache.paged_topk_translate`. A subclass may select otherwise with the
        same result contract, as for :meth:`select`."""
        return ops.paged_topk_translate(q, k_cache, weights, context_lens, block_table, max_context_len,
                                               self.k, page_table, page_size, logits=logits, out=out,
                                               out_raw=out_raw, k_format=k_format, q_scale=q_scale,
                                               row_to_batch=row_to_batch)

    def reuse(self, layer: int, page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, *,
              row_to_batch: torch.Tensor | None = None, source: int | None = None) -> torch.Tensor:
        """Shared ``layer``: the producer's raw indices through this layer's own ``page_table``; returns
        the physical slots ``[rows, k]`` int32 (-1 = empty).

        ``seq_lens [rows]`` int32 is each row's visible length. ``source`` (the producer the plan says
        this layer reuses) is checked against the producer that wrote the state. After a decode producer whose rows
        are not one a request in order (:meth:`produce_paged` with ``next_n > 1`` or ragged rows), ``row_to_batch``
        None is refused (``ValueError``) unless ``page_table`` has one row a row (a table the engine already expanded
        per row, ``[rows, P]``): row ``r`` would read page-table row ``r``, another request's pages.
        """
        self._check_source(layer, source)
        self._check_rows("seq_lens", seq_lens)
        if not (isinstance(page_table, torch.Tensor) and page_table.dim() == 2 and page_table.shape[0] == self.rows):
            self.check_rows_named(layer, row_to_batch, "translate row r through page-table row r, another request's "
                                  "pages; give each row's page-table row (or a page table of one row a row)")
        rows = self.rows
        out = ops.translate(self.raw[:rows], page_table, seq_lens, page_size, row_to_batch=row_to_batch,
                                   out=self.physical[:rows])
        if self.recorder is not None:
            self.recorder(layer, self.raw[:rows])
        return out

    def reused(self, layer: int, *, source: int | None = None) -> None:
        """Shared ``layer`` takes the producer's raw indices as they are, untranslated (HiSparse's device rows come
        from the hot buffers, :mod:`indexcache.runtime.hot`): ``source`` checked as by :meth:`reuse`, the recorder
        told."""
        self._check_source(layer, source)
        if self.recorder is not None:
            self.recorder(layer, self.raw[: self.rows])

    def _check_source(self, layer: int, source: int | None) -> None:
        if self.producer is None:
            raise MissingProducerError(
                f"layer {layer} is shared but no producer wrote top-k indices in this forward (the state was "
                "cleared or just begun): run the producer first, or, on a pipeline stage that starts on a "
                "shared layer, load the previous stage's carry (TopkState.load_carry) or promote the layer"
            )
        if source is not None and source != self.producer:
            raise MissingProducerError(
                f"layer {layer} reuses layer {source}'s top-k, but the state holds layer {self.producer}'s"
            )

    def check_rows_named(self, layer: int, row_to_batch: torch.Tensor | None, would: str) -> None:
        """Refuse (``ValueError``) a ``row_to_batch`` None given to ``layer`` after a producer whose rows are not one
        a request in order (``next_n > 1``, ragged rows; on this stage or the one that sent the carry): ``would``
        says what the layer would do with row ``r`` taken as request ``r``."""
        if row_to_batch is None and (layout := _layout_text(self._layout)) is not None:
            raise ValueError(f"row_to_batch: None, but producer {self.producer}'s rows are {layout}: layer {layer} "
                             f"would {would}")

    def to_carry(self) -> tuple[torch.Tensor, CarryHeader]:
        """``(raw [rows, k] int32, header)`` to send to the next pipeline stage (a view: send it before
        the next forward reuses this state)."""
        if self.producer is None:
            raise MissingProducerError("to_carry(): no producer wrote top-k indices in this forward")
        return self.raw[: self.rows], CarryHeader(producer=self.producer, rows=self.rows, k=self.k, layout=self._layout)

    def load_carry(self, raw: torch.Tensor, header: CarryHeader) -> None:
        """Begin a forward from the previous stage's carry: ``raw [header.rows, k]`` int32 is copied in
        and ``header.producer`` becomes the producer shared layers reuse. A header or tensor that does not
        match (:meth:`CarryHeader.check`), or a k or row count this state cannot hold, raises
        :class:`CarryError` and leaves the state as it was.

        With HiSparse (:attr:`hot` attached) no plan is made here: :attr:`carried` is set, and the first of this
        stage's layers of the producer's group run with ``hot=`` plans the group's step from ``raw`` into :attr:`hot`
        (as the producer did on its own stage), the later ones only swap in
        (:meth:`IndexerRunner.layer <indexcache.runtime.runner.IndexerRunner.layer>`)."""
        _check_header(header)
        if header.k != self.k:
            raise CarryError(f"carry header: k={header.k}, but this state holds k={self.k}")
        header.check(raw)
        if header.rows > self.max_rows:
            raise CarryError(f"carry header: rows={header.rows}, but this state holds at most {self.max_rows}")
        self.begin(header.rows)
        self.raw[: header.rows].copy_(raw)
        self.physical[: header.rows].fill_(-1)  # this stage's slots come from its own layers' page tables
        self.producer = header.producer
        self._layout = header.layout
        self.carried = True

    @classmethod
    def from_carry(cls, raw: torch.Tensor, header: CarryHeader, max_rows: int | None = None) -> TopkState:
        """A new state on ``raw.device`` (capacity ``max_rows``, default ``header.rows``) loaded from a carry;
        the carry is checked (:meth:`CarryHeader.check`), and against ``max_rows``, before any buffer is allocated."""
        _check_header(header)
        header.check(raw)
        if isinstance(max_rows, int) and not isinstance(max_rows, bool) and max_rows < header.rows:
            raise CarryError(f"carry header: rows={header.rows}, but this state holds at most {max_rows}")
        state = cls(header.rows if max_rows is None else max_rows, header.k, raw.device)
        state.load_carry(raw, header)
        return state


def _layout_text(layout: int) -> str | None:
    """:attr:`CarryHeader.layout` in words where rows are not one a request in order; else None."""
    if layout == RAGGED:
        return "ragged rows (its PagedLogits' own row_to_batch)"
    return f"next_n={layout} rows a request (row r is request r // {layout})" if layout > IN_ORDER else None


def _check_header(header: object) -> None:
    if not isinstance(header, CarryHeader):
        raise CarryError(f"carry header: expected a CarryHeader (CarryHeader.from_tensor reads a tensor), "
                         f"got {type(header).__name__}")


class IndexRecorder:
    """A :attr:`TopkState.recorder`: keeps a copy of every sparse layer's logical indices.

    ``indices[layer]`` lists ``[rows, k]`` int32 tensors, one per forward, in call order (a shared layer
    records the indices it reused). Recording copies, so it must not run inside a CUDA-graph capture.
    """

    def __init__(self) -> None:
        self.indices: dict[int, list[torch.Tensor]] = {}

    def __call__(self, layer: int, raw: torch.Tensor) -> None:
        if raw.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("IndexRecorder: recording copies tensors and cannot run inside a CUDA-graph capture")
        self.indices.setdefault(layer, []).append(raw.clone())

    def stacked(self) -> dict[int, torch.Tensor]:
        """Per layer, every recorded forward's rows in one ``[total_rows, k]`` int32 tensor."""
        return {layer: torch.cat(chunks) for layer, chunks in sorted(self.indices.items())}

    def save(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write :meth:`stacked` as ``layer_<id>.pt`` files, the dump :mod:`indexcache.tools.calibrate.dump` reads
        (record an all-producer run so every layer's rows are its own)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for layer, rows in self.stacked().items():
            paths.append(out / f"layer_{layer:03d}.pt")
            torch.save(rows.cpu(), paths[-1])
        return paths
