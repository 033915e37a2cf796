"""HiSparse in the runtime: the hot buffers' state of each producer group and the plan of the group whose indices
are current, so each sparse layer gets its device rows in one call (docs/hisparse.md, "In the runtime").

An engine keeping its KV in host memory attaches a :class:`HotBuffers` to its
:class:`~indexcache.runtime.state.TopkState` (``state.hot = HotBuffers(...)``, once, before any graph capture) and
passes each sparse layer's :class:`HotLayer` to
:meth:`IndexerRunner.layer <indexcache.runtime.runner.IndexerRunner.layer>` (``hot=``):

- a **producer** selects its top-k as before, then plans the step for its group (:func:`indexcache.hisparse_plan`
  over the state's logical indices, into the group's hot-buffer state) and swaps in its own layer's misses, or the
  whole group's at once (its :class:`HotLayer` holding lists of the group's KV tensors: one launch on a GPU, nearer
  the host link's bandwidth);
- a **shared** layer swaps in its own layer's KV rows with the same plan (:func:`indexcache.hisparse_swap_in`), no
  planning: the group's buffers move in lockstep; after a group swap-in it copies nothing (its ``HotLayer``'s KV
  None);
- both return the device rows the attention reads, ``device_loc[b, slot]`` (-1 for none), instead of page-table slots.

Two selections arrive without their producer running here, and are planned where they arrive:

- a pipeline stage's carry (:meth:`TopkState.load_carry <indexcache.runtime.state.TopkState.load_carry>`): the first
  of this stage's layers of the carried producer's group run with ``hot=`` plans the group's step and swaps in (its
  ``HotLayer`` bringing KV, its own layer's or this stage's group's), the later ones only swap in. The plan is a
  function of the indices, ``seq_lens``, ``host_loc`` and the group's state, so each stage's buffers for the group
  stay in lockstep as long as they saw the same steps;
- a draft decode step's selection (:meth:`DraftTopk.serve <indexcache.runtime.draft.DraftTopk.serve>` given
  ``hot=``): planned and swapped in as a producer's.

Every buffer is allocated at construction; a call only writes into them: valid under CUDA-graph capture.
:meth:`TopkState.begin <indexcache.runtime.state.TopkState.begin>` forgets the current plan, so a shared layer of the
next forward cannot swap in with a stale one (it raises :class:`~indexcache.runtime.state.MissingProducerError`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from indexcache.hal import hisparse, ops
from indexcache.hal.ops import INDEX
from indexcache.hal.slot_index import index_width
from indexcache.hal.specs import SPECS
from indexcache.hal.specs.hisparse_swap_in import layers
from indexcache.runtime.state import MissingProducerError


@dataclass(frozen=True)
class HotLayer:
    """One sparse layer's HiSparse tensors for a step.

    ``host_kv [Nh, ...]``: the layer's KV rows in host memory (pinned, for a GPU backend to read them);
    ``device_kv [Nd, ...]``: its device rows, the hot buffers among them; ``device_loc [B, H + 1]`` int32: the device
    row of each request's slot (slot ``H``: the newest token's); ``seq_lens [B]`` int32: each request's length, the
    token being decoded included; ``host_loc [B, L]`` int32 or int64: the host row of each token, the same for
    every layer of a producer group (each layer's host pool laid out alike); ``host_rows``: a bound on host rows
    (default the fewest of ``host_kv``'s layers). ``B`` is the :class:`HotBuffers`' ``max_requests`` (a live batch of
    fewer requests pads ``device_loc``, ``seq_lens`` and ``host_loc``); without ``row_to_batch``, row ``r`` of the
    step is request ``r``.

    A group swapped in at once: the producer's ``host_kv`` and ``device_kv`` are lists of the group's layers'
    tensors (any order, the same in both; every layer's slots at the same device rows, the producer's
    ``device_loc``), and each shared layer's are None (its rows came with the producer's). It pays where the host
    pool holds a token's rows of the group together (``host_kv[g] = pool[:, g]`` of a ``[tokens, layers, ...]``
    pool): a GPU backend then copies the group in one launch; layers in pools of their own are copied a launch each
    (docs/hisparse.md, "One layer, or a group's layers")."""

    host_kv: torch.Tensor | Sequence[torch.Tensor] | None
    device_kv: torch.Tensor | Sequence[torch.Tensor] | None
    device_loc: torch.Tensor
    seq_lens: torch.Tensor
    host_loc: torch.Tensor
    host_rows: int | None = None


class HotBuffers:
    """The hot-buffer state of ``max_requests`` requests with ``hot`` device slots each, one state per producer in
    ``producers`` (the layers sharing a producer's indices share its buffers' bookkeeping), and the buffers of one
    plan of up to ``max_rows`` rows of ``k`` positions on ``device``. ``index_tokens``: also keep a slot index per
    producer over that many tokens (``host_loc``'s width; ``indexcache.hisparse_plan``'s ``slot_index``, which lets
    a step resolve only its selected tokens): ``4 (hot + max(index_tokens, hot))`` bytes a request a producer."""

    def __init__(self, producers: Iterable[int], max_requests: int, hot: int, max_rows: int, k: int,
                 device: torch.device | str = "cpu", *, index_tokens: int | None = None) -> None:
        for name, value, low in (("max_requests", max_requests, 0), ("hot", hot, 1), ("max_rows", max_rows, 0),
                                 ("k", k, 1), ("index_tokens", 0 if index_tokens is None else index_tokens, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
        listed = None if isinstance(producers, (str, bytes)) or not isinstance(producers, Iterable) else list(producers)
        if listed is None or any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in listed):
            raise ValueError(f"producers: expected layer ids (ints >= 0), got {producers!r}")
        self.max_requests = max_requests
        self._hot = hot  # slots a request: device_loc holds H + 1
        self.state = {p: hisparse.empty_state(max_requests, hot, device) for p in listed}
        width = index_width(hot, index_tokens or 0)
        self.index = ({p: torch.empty(max_requests, width, dtype=INDEX, device=device) for p in self.state}
                      if index_tokens is not None else {})
        self.slots = torch.full((max_rows, k), -1, dtype=INDEX, device=device)
        self.copy_src = torch.full((max_rows, k), -1, dtype=torch.int64, device=device)
        self.copy_dst = torch.full((max_rows, k), -1, dtype=INDEX, device=device)
        self.copy_count = torch.zeros(max_rows, dtype=INDEX, device=device)
        self.device_rows = torch.full((max_rows, k), -1, dtype=INDEX, device=device)
        self._span = torch.full((max_rows,), hot + 1, dtype=INDEX, device=device)  # every slot 0..H is in range
        self._requests = torch.arange(max_rows, dtype=INDEX, device=device)  # row r is request r (_row_to_batch)
        self._emptied = torch.zeros(max_requests + 1, dtype=torch.bool, device=device)  # reset's rows, and row n
        self._reset_rows = torch.empty(max_requests, dtype=torch.int64, device=device)
        self.group: int | None = None  # the producer whose plan the buffers hold
        self.owner: object | None = None  # what planned it (the runner's TopkState), where given
        self.rows = 0
        self.grouped = False  # whether the producer swapped in its whole group
        self.mapped = False  # whether the plan took each row's request from a row_to_batch (swap-ins then need it)

    def __repr__(self) -> str:
        return f"HotBuffers(producers={sorted(self.state)}, plan of={self.group}, rows={self.rows})"

    def reset(self, requests: torch.Tensor) -> None:
        """Empty the state rows ``requests`` (``[N]`` int64 indices in ``[0, max_requests)``, on the device) in every
        group: what an engine does when it gives a request row to a new request. Entries outside that range (-1 for
        none, as a captured graph's fixed ``N`` pads) empty nothing. Graph-safe, and allocates nothing for ``N`` up to
        ``max_requests`` (more entries take a temporary of ``N``)."""
        device = self.slots.device
        if not isinstance(requests, torch.Tensor) or requests.dtype != torch.int64 or requests.dim() > 1:
            got = (f"{requests.dtype} of shape {list(requests.shape)}" if isinstance(requests, torch.Tensor)
                   else type(requests).__name__)
            raise TypeError(f"requests: expected an int64 tensor of the state rows to empty ([N]), got {got}")
        if requests.device != device:
            raise ValueError(f"requests: expected a tensor on {device} (the state's device), got {requests.device}")
        n, flat = self.max_requests, requests.reshape(-1)
        rows = self._reset_rows[: flat.shape[0]] if flat.shape[0] <= n else torch.empty_like(flat)
        # outside the state: row n, dropped below (index_fill_ would take -1 for the last row)
        torch.clamp(flat, -1, n, out=rows).remainder_(n + 1)
        emptied = self._emptied.zero_().index_fill_(0, rows, True)[:n, None]
        for tokens, ages in self.state.values():
            tokens.masked_fill_(emptied, hisparse.EMPTY)
            ages.masked_fill_(emptied, hisparse.EMPTY)

    def forget(self) -> None:
        """No plan is current (a new forward): a shared layer must wait for its producer's."""
        self.group = None
        self.owner = None
        self.rows = 0
        self.grouped = False
        self.mapped = False

    def check(self, producer: int, raw: torch.Tensor, layer: HotLayer, *,
              row_to_batch: torch.Tensor | None = None) -> None:
        """Raise what :meth:`plan` of ``producer``'s selection ``raw [rows, k]`` with ``layer`` would raise, and what
        the producer's swap-in would, without planning: the runner checks a producer's ``layer`` so before the
        producer selects into ``raw`` (and a carried selection's first layer before it plans, DraftTopk.serve its
        ``hot`` before it writes ``raw``), so that a refused one leaves the state as it was."""
        SPECS["hisparse_plan"].check(**self._args(producer, raw, layer, row_to_batch))

    def _row_to_batch(self, rows: int, row_to_batch: torch.Tensor | None) -> torch.Tensor | None:
        """``row_to_batch`` as the ops take it: None (row ``r`` is request ``r``) stands for the first ``rows`` of the
        ``max_requests`` requests, which the ops' None means only where ``rows`` is ``max_requests`` (the usual live
        batch is smaller)."""
        if row_to_batch is not None or rows == self.max_requests:
            return row_to_batch
        if rows > self.max_requests:
            raise ValueError(f"row_to_batch: None (row r is request r), but the step has {rows} rows and the hot "
                             f"buffers hold {self.max_requests} requests: give each row's request")
        return self._requests[:rows]

    def _args(self, producer: int, raw: torch.Tensor, layer: HotLayer, row_to_batch: torch.Tensor | None) -> dict:
        """The arguments of ``producer``'s :func:`indexcache.hisparse_plan` into the buffers (which the op checks),
        after the checks of the buffers' capacity and of the producer's swap-in."""
        if producer not in self.state:
            raise KeyError(f"producer {producer}: no hot-buffer state (producers {sorted(self.state)})")
        rows = raw.shape[0]
        if rows > self.slots.shape[0] or raw.shape[1] != self.slots.shape[1]:
            raise ValueError(f"raw: expected at most {self.slots.shape[0]} rows of {self.slots.shape[1]} positions "
                             f"(the buffers' capacity), got {list(raw.shape)}")
        row_to_batch = self._row_to_batch(rows, row_to_batch)
        # the layer refused before the state changes, not at its swap-in after
        if not _copies_kv(layer, self._hot, self.max_requests):
            raise ValueError(f"hot: the HotLayer planning producer {producer}'s group has no host_kv (the layer that "
                             "plans, a producer or a carried selection's first layer, swaps in its own layer or its "
                             "whole group)")
        # the producer's own swap-in checked before the state takes this step's misses as copied
        SPECS["hisparse_swap_in"].check(self.copy_src[:rows], self.copy_dst[:rows], self.copy_count[:rows],
                                        layer.host_kv, layer.device_kv, layer.device_loc, row_to_batch=row_to_batch)
        tokens, ages = self.state[producer]
        host_rows = layer.host_rows
        if host_rows is None:
            host_rows = min(t.shape[0] for t in layers("host_kv", layer.host_kv))
        index = self.index.get(producer)
        if index is not None and index.shape[1] < index_width(tokens.shape[1], layer.host_loc.shape[1]):
            index = None  # a host_loc wider than the index covers: planned without it
        return dict(raw=raw, seq_lens=layer.seq_lens, host_loc=layer.host_loc, slot_token=tokens, slot_age=ages,
                    row_to_batch=row_to_batch, host_rows=host_rows, slot_index=index, out=self.slots[:rows],
                    out_copy_src=self.copy_src[:rows], out_copy_dst=self.copy_dst[:rows],
                    out_copy_count=self.copy_count[:rows])

    def plan(self, producer: int, raw: torch.Tensor, layer: HotLayer, *,
             row_to_batch: torch.Tensor | None = None, owner: object | None = None) -> hisparse.Plan:
        """Plan the step of ``producer``'s group for its selection ``raw [rows, k]`` (logical positions, -1 none),
        into the buffers; returns the plan (views of the buffers). ``layer`` is checked as its swap-in will check it
        before the state changes: a refused swap-in would leave the state holding misses it never copied. ``owner``:
        what plans (the runner passes its :class:`~indexcache.runtime.state.TopkState`), so that a swap-in for another
        owner is refused: the buffers hold one plan at a time."""
        got = ops.hisparse_plan(**self._args(producer, raw, layer, row_to_batch))
        self.group, self.owner, self.rows = producer, owner, raw.shape[0]
        self.grouped = False
        self.mapped = row_to_batch is not None
        return got

    def swap_in(self, producer: int, layer: HotLayer, *, row_to_batch: torch.Tensor | None = None,
                owner: object | None = None) -> torch.Tensor:
        """Copy ``layer``'s misses of the current plan (``producer``'s, planned for ``owner``) into its device rows
        (every layer's of a group, given lists; none, given None after its producer's group swap-in); returns its
        device rows ``[rows, k]`` int32 of the selected positions (-1 none), a view valid until the next layer.
        ``row_to_batch`` None where the plan was made with one is refused (``ValueError``): row r is not request r."""
        if self.group != producer:
            raise MissingProducerError(f"the hot buffers hold the plan of {self.group}, not of producer {producer}: "
                                       "in this forward the producer has not run, or ran without hot= (its attention "
                                       "then read page-table slots); run it, or DraftTopk.serve, with hot= first (a "
                                       "carry loaded by TopkState.load_carry is planned by its group's first layer "
                                       "run with hot=)")
        if owner is not self.owner:  # two states sharing these buffers, their groups' layers interleaved
            raise MissingProducerError(f"the hot buffers hold producer {producer}'s plan for another state: they hold "
                                       "one plan at a time, so states sharing them (micro-batches) must run each "
                                       "producer group's layers without interleaving")
        if row_to_batch is None and self.mapped:  # row r would be taken as request r, not the plan's request
            raise ValueError(f"row_to_batch: None, but producer {producer} planned this step with a row_to_batch: "
                             "each layer's swap-in reads its rows' requests from it (give every layer of the group "
                             "the producer's)")
        rows = self.rows
        row_to_batch = self._row_to_batch(rows, row_to_batch)
        if _copies_kv(layer, self._hot, self.max_requests):
            ops.hisparse_swap_in(self.copy_src[:rows], self.copy_dst[:rows], self.copy_count[:rows], layer.host_kv,
                                 layer.device_kv, layer.device_loc, row_to_batch=row_to_batch)
            self.grouped |= not isinstance(layer.device_kv, torch.Tensor)
        elif not self.grouped:
            raise ValueError(f"hot: no KV given, but producer {producer} swapped in only its own layer (give the "
                             "producer's HotLayer lists of its group's KV tensors, or this layer its own)")
        return ops.translate(self.slots[:rows], layer.device_loc, self._span[:rows], 1, row_to_batch=row_to_batch,
                             out=self.device_rows[:rows])


def _copies_kv(layer: HotLayer, hot: int, requests: int) -> bool:
    """Whether ``layer`` brings KV tensors to swap in (not a layer of a group its producer swapped in); refuses
    ``host_kv`` without ``device_kv`` or the reverse, a ``device_loc`` that is not int32 (the device rows the
    attention reads are int32), one of fewer than ``hot + 1`` columns (slot ``hot``, the newest token's, would
    read no row) and one of other than ``requests`` rows (the buffers' ``max_requests``: a request past its rows would
    be planned as holding tokens no swap-in copied, and read no device row)."""
    if (layer.host_kv is None) != (layer.device_kv is None):
        raise ValueError("hot: expected host_kv and device_kv both given or both None (a layer swapped in with its "
                         f"producer's group), got host_kv {type(layer.host_kv).__name__} and device_kv "
                         f"{type(layer.device_kv).__name__}")
    if not isinstance(layer.device_loc, torch.Tensor) or layer.device_loc.dtype != INDEX:
        got = layer.device_loc.dtype if isinstance(layer.device_loc, torch.Tensor) else type(layer.device_loc)
        raise TypeError(f"hot: device_loc: expected an int32 tensor (its rows are the int32 device rows the attention "
                        f"reads), got {got}")
    if layer.device_loc.dim() != 2 or layer.device_loc.shape[1] < hot + 1:
        raise ValueError(f"hot: device_loc: expected [B, H + 1] = [B, {hot + 1}] (slot H holds the newest token), got "
                         f"{list(layer.device_loc.shape)}")
    if layer.device_loc.shape[0] != requests:
        raise ValueError(f"hot: device_loc: expected {requests} rows (the hot buffers' max_requests, as seq_lens and "
                         f"host_loc: a smaller live batch pads them), got {list(layer.device_loc.shape)}")
    return layer.host_kv is not None
