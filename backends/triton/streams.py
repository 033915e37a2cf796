"""The GPU backends' ``overlap`` scheduler: side work on device streams, joined to the current stream.

``side_fn`` runs on a side stream (created on first use, per GPU) while ``main_fn`` runs on the current
stream; the current stream then waits for the side stream, so whatever follows sees both results, exactly
as if the two had run one after the other (side first). Tensors that ``side_fn`` returns are marked with
``record_stream`` for the current stream, so the caching allocator never hands their memory to the side
stream while the main stream may still read them. It uses the stream API of the torch module of the
backend's device type (``torch.cuda``: CUDA streams, HIP streams on a ROCm build). Fork and join are event
record/wait pairs, so the same code is valid under CUDA-graph capture, where they become graph edges; nothing
here allocates device memory or syncs with the host.
Create the streams before capturing (a first eager call does).

Sharing the GPU (docs/streams.md): the side function gets n multiprocessors, n from the call's ``side_sms`` or from
the tuning table's ``overlap`` rule (its ``GRAPH`` bands while a CUDA graph is captured, else its ``EAGER`` ones; for
MXFP4 keys its ``GRAPH_MXFP4`` / ``EAGER_MXFP4`` bands where it has them: :func:`rule_bands`) for the side work's
``tokens`` and ``context``; 0 runs the two in order on the current stream. Where the GPU and torch
have SM partitions (:mod:`~indexcache.backends.triton.partition`: CUDA green contexts) the side function runs on a
stream of a partition of n multiprocessors, every kernel of it placed there only, and the main function keeps the
whole device. Elsewhere an explicit ``side_sms`` runs the side under an SM budget of n (:mod:`indexcache.hal.budget`)
and the main under the device's others, torch's matmuls held to each share by torch's SM carveout where torch has
one; a share from the rule, measured with partitions, then overlaps with no budget. Without either (or without a rule
for the target) the two overlap with no budget. A partition is made at the first eager call that could use it (the
eager call also makes the one its shape's ``GRAPH`` band names), never during a capture: a capture that finds none
made falls back as where there are none. Within an enclosing SM budget (the one in force where the schedule is made)
the pair keeps to it (:func:`within_budget`): the side's share is at most one fewer than it (half of it where there is
no share), held by a partition or else by a budget (a rule's share too), and the main function runs under the
budget's other multiprocessors.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from indexcache.backends.torch.streams import in_order, in_order_schedule
from indexcache.backends.triton.partition import partition_stream
from indexcache.hal import budget, fp4
from indexcache.hal.contract import IN_ORDER, OpImpl, Schedule, side_then_main
from indexcache.hal.device import device_name, sm_count

S = TypeVar("S")
M = TypeVar("M")


def _record(value: Any, stream: torch.Stream, device_type: str) -> None:
    """``record_stream`` every tensor on ``device_type`` in ``value`` (a tensor or nested tuples, lists and dict
    values)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == device_type:
            value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _record(item, stream, device_type)
    elif isinstance(value, dict):
        for item in value.values():
            _record(item, stream, device_type)


def side_budget(tokens: int, context: int, sms: int, bands: Sequence[tuple[int, int, float | None]]) -> int | None:
    """The side work's SM budget by the rule ``bands``: the first ``(max_tokens, min_context, share)`` with
    ``tokens <= max_tokens`` and ``context >= min_context`` gives ``share`` of the ``sms`` multiprocessors (at least 1,
    fewer than ``sms``), None (overlap with no budget) where its share is None, 0 (in order) where it is 0 or no band
    holds the shape."""
    return share_sms(band_share(tokens, context, bands), sms)


def band_share(tokens: int, context: int, bands: Sequence[tuple[int, int, float | None]]) -> float | None:
    """The share of the first band of ``bands`` holding the shape (:func:`side_budget`): None (no budget), 0 (in order:
    a share of 0 or less, or no band) or a positive fraction of the multiprocessors."""
    for max_tokens, min_context, share in bands:
        if tokens <= max_tokens and context >= min_context:
            return share if share is None or share > 0 else 0
    return 0


def share_sms(share: float | None, sms: int) -> int | None:
    """A :func:`band_share` as multiprocessors of ``sms``: None and 0 as they are, else at least 1 and fewer than
    ``sms``."""
    return share if not share else min(sms - 1, max(1, round(share * sms)))


def within_budget(n: int | None, sms: int, outer: int | None) -> tuple[int | None, int]:
    """``(the side's share, the multiprocessors of the pair)`` for a side share ``n`` (None: no share, 0: in order) of a
    device of ``sms`` under the SM budget ``outer`` in force where the schedule is made (None: none): the pair keeps to
    ``min(outer, sms)``, and the side to fewer, so that the main function keeps at least one (in order under a budget
    of 1, where the two keep to it one after the other). No share under a budget below the device's count is half of
    it (the main function the other half): two functions each under the whole budget could hold twice it."""
    pair = sms if outer is None else min(outer, sms)
    if n is None:
        return (None if pair == sms else pair // 2), pair
    return (n if not n else min(n, pair - 1)), pair


def device_rule(rule: Mapping[str, Any] | None, name: str) -> Mapping[str, Any] | None:
    """``rule`` (a tuning table's ``overlap`` entry) for a GPU named ``name``: its bands, with those of the first of
    its ``DEVICES`` entries ``(model, bands)`` whose ``model`` is part of ``name`` in their place (bands measured on
    that GPU model: an architecture's models differ in memory bandwidth, which decides the share)."""
    if rule is None or "DEVICES" not in rule:
        return rule
    for model, bands in rule["DEVICES"]:
        if model in name:
            return {**rule, **bands}
    return rule


def rule_bands(rule: Mapping[str, Any], capturing: bool, k_format: torch.dtype | None = None) -> Sequence:
    """The bands of ``rule`` (a tuning table's ``overlap`` entry) for a captured graph (``capturing``) or an eager call,
    and for the side work's key format: ``GRAPH`` / ``EAGER``, or for MXFP4 keys (``k_format``
    ``torch.float4_e2m1fn_x2``) ``GRAPH_MXFP4`` / ``EAGER_MXFP4`` where the rule has them (measured apart: the MXFP4
    decode reads half the bytes and takes longer), else the same."""
    mode = "GRAPH" if capturing else "EAGER"
    if k_format == fp4.FP4:
        return rule.get(f"{mode}_MXFP4", rule[mode])
    return rule[mode]


class DeviceStreams:
    """Scheduler over ``side_streams`` device streams per GPU of ``device_type`` (the backend's: "cuda" takes
    torch.cuda's streams), created on first use; ``rule``: the tuning table's ``overlap`` entry (its ``GRAPH`` and
    ``EAGER`` bands, for :func:`side_budget`), None where the target has none."""

    def __init__(self, side_streams: int, device_type: str, rule: Mapping[str, Any] | None = None) -> None:
        if isinstance(side_streams, bool) or not isinstance(side_streams, int) or side_streams < 1:
            raise ValueError(f"side_streams: expected an int >= 1, got {side_streams!r}")
        self.side_streams = side_streams
        self.device_type = device_type
        self.rule = rule
        self._module = torch.get_device_module(device_type)
        self._streams: dict[int, list[torch.Stream]] = {}
        # (GPU, side stream, share, SM budget in force) of the graph partitions made
        self._graph_made: set[tuple[int, int, float, int | None]] = set()

    def _index(self, device: torch.device) -> int:
        return device.index if device.index is not None else self._module.current_device()

    def rule_for(self, device: torch.device) -> Mapping[str, Any] | None:
        """The rule for this GPU: :attr:`rule` with the bands measured on its model where the rule has them
        (:func:`device_rule`)."""
        rule = self.rule
        return rule if rule is None or "DEVICES" not in rule else device_rule(rule, device_name(self._index(device)))

    def stream(self, device: torch.device, side: int) -> torch.Stream:
        """Side stream ``side % side_streams`` of ``device``."""
        index = self._index(device)
        pool = self._streams.get(index)
        if pool is None:
            pool = [self._module.Stream(device=index) for _ in range(self.side_streams)]
            self._streams[index] = pool
        return pool[side % self.side_streams]

    def share(self, device: torch.device, side_sms: int | None, tokens: int | None, context: int | None,
              capturing: bool | None = None, k_format: torch.dtype | None = None) -> tuple[int | None, int, bool]:
        """``(side share, the device's multiprocessors, whether the rule gave it)``: ``side_sms`` (fewer than the
        device's, else ValueError), else the rule's for ``tokens``, ``context`` and ``k_format`` (its graph bands
        where ``capturing``, None: asked; :func:`rule_bands`), else None (no share); 0 runs in order."""
        sms = sm_count(self._index(device))
        if side_sms is not None:
            if side_sms >= sms:
                raise ValueError(f"side_sms: expected fewer than the {sms} multiprocessors of {device} (0: in order), "
                                 f"got {side_sms}")
            return side_sms, sms, False
        rule = self.rule_for(device)
        if tokens is None or rule is None:
            return None, sms, False
        if capturing is None:
            capturing = self._module.is_current_stream_capturing()
        return side_budget(tokens, context, sms, rule_bands(rule, capturing, k_format)), sms, True

    def partition(self, device: torch.device, n: int | None, side: int, capturing: bool) -> torch.Stream | None:
        """The stream of a partition of ``n`` multiprocessors for side stream ``side`` (None: no share, or none to be
        had here): made where missing, but during a capture (``capturing``) only looked up."""
        return partition_stream(self._index(device), n, side % self.side_streams, make=not capturing) if n else None

    def graph_partition(self, device: torch.device, side: int, share: float | None) -> None:
        """Make the partition of ``share`` (a graph band's; None: no share, which within an SM budget is half of it)
        for side stream ``side``, within the SM budget in force (:func:`within_budget`), so that a capture after this
        eager call under the same budget finds it; once: later calls find it noted."""
        if share == 0:
            return
        index = self._index(device)
        key = (index, side % self.side_streams, share, budget.current())
        if key not in self._graph_made:
            sms = sm_count(index)
            if n := within_budget(share_sms(share, sms), sms, key[3])[0]:
                partition_stream(index, n, key[1])
            self._graph_made.add(key)

    def prepare(self, side: int, device: torch.device, side_sms: int | None = None, tokens: int | None = None,
                context: int | None = None, k_format: torch.dtype | None = None) -> Schedule:
        """The schedule of a call with these arguments (``overlap``'s ``prepare``), decided now for the mode it is made
        in: eagerly, or for the capture in progress (a schedule made eagerly and run inside a capture stays valid, and
        so does the reverse: only the share may not be the one the rule gives that mode). Running it does what
        :meth:`__call__` would have done here."""
        capturing = self._module.is_current_stream_capturing()
        if side_sms is None and tokens is not None and self.rule is not None and not capturing:
            # An eager call the rule decides makes the partition its shape's graph band names, for a later capture
            # (given side_sms, the rule is not asked: a capture with the same side_sms takes that share); where the
            # rule runs it in order (its EAGER bands: an eager step's usual case) that is all it decides
            # (docs/streams.md, "The rule's eager path").
            rule = self.rule_for(device)
            self.graph_partition(device, side, band_share(tokens, context, rule_bands(rule, True, k_format)))
            if band_share(tokens, context, rule_bands(rule, False, k_format)) == 0:
                return IN_ORDER
        n, sms, ruled = self.share(device, side_sms, tokens, context, capturing, k_format)
        n, pair = within_budget(n, sms, budget.current())  # an enclosing budget holds the pair
        if n == 0:
            return IN_ORDER
        part = self.partition(device, n, side, capturing)
        # a rule's share was measured with partitions: without one the two overlap unbudgeted, but not within an
        # enclosing budget, which they keep as a split
        how = "partition" if part is not None else "overlap" if n is None or (ruled and pair == sms) else "budget"
        held = n if how == "budget" else None  # a partition holds the side itself; a rule's share needs one
        # the main function under the pair's others: beside a budget, and beside a partition within an enclosing
        # budget (else it keeps the whole device)
        rest = pair - n if how == "budget" or (how == "partition" and pair < sms) else None
        stream = part if part is not None else self.stream(device, side)
        return Schedule(functools.partial(self._run, stream, device, held, rest, sms), how,
                        None if how == "overlap" else n)

    def _run(self, stream: torch.Stream, device: torch.device, n: int | None, rest: int | None, sms: int,
             side_fn: Callable[[], S], main_fn: Callable[[], M]) -> tuple[S, M]:
        """``side_fn`` on ``stream`` (under a budget of ``n`` where given), ``main_fn`` on the current stream (under a
        budget of ``rest`` where given), joined: also where either raises (what the side enqueued is then ordered before
        whatever the caller does next on the current stream)."""
        if torch.compiler.is_compiling():  # Inductor traces no streams: in order, as the join makes it appear
            return side_then_main(side_fn, main_fn)
        main = self._module.current_stream(device)
        stream.wait_stream(main)
        try:
            if n is None and rest is None:
                with self._module.stream(stream):
                    side_out = side_fn()
                main_out = main_fn()
            else:
                with self._module.stream(stream), _held_to(n, sms):
                    side_out = side_fn()
                with _held_to(rest, sms):
                    main_out = main_fn()
        finally:
            main.wait_stream(stream)
        _record(side_out, main, self.device_type)
        return side_out, main_out

    def __call__(self, side_fn: Callable[[], S], main_fn: Callable[[], M], side: int, device: torch.device,
                 side_sms: int | None = None, tokens: int | None = None, context: int | None = None,
                 k_format: torch.dtype | None = None) -> tuple[S, M]:
        return self.prepare(side, device, side_sms, tokens, context, k_format)(side_fn, main_fn)

    def supports(self, device: torch.device, **_: Any) -> list[str]:
        """Why the scheduler declines a call (empty: it takes it): it needs tensors on its GPUs."""
        if device.type == self.device_type:
            return []
        return [f"device streams need GPU tensors, got device {device}"]


@contextlib.contextmanager
def _held_to(n: int | None, sms: int) -> Iterator[None]:
    """Within the block our persistent kernels (the SM budget) and torch's matmuls (:func:`_matmul_sms`) keep to ``n``
    of the ``sms`` multiprocessors; nothing changes where ``n`` is None."""
    with budget.scoped(n), _matmul_sms(n, sms):
        yield


# The carveouts of the _matmul_sms blocks in force, in the order they were entered (each under a token of its own),
# and the setting found before the first of them: torch's setting is the process's, so blocks of two threads may
# interleave and leave in any order.
_carveouts: list[tuple[object, int]] = []
_before_carveouts: list[int | None] = [None]
_carveouts_lock = threading.Lock()


@contextlib.contextmanager
def _matmul_sms(n: int | None, sms: int) -> Iterator[None]:
    """Within the block torch's matmuls (cuBLAS / cuBLASLt, where torch passes it an SM count target) use at most
    ``n`` of the ``sms`` multiprocessors, by torch's SM carveout (``torch._C._set_sm_carveout_experimental``: a
    process-wide setting, read when a matmul is launched or captured); nothing where ``n`` is None or this torch has no
    carveout. Blocks of several threads at once (docs/streams.md, "`overlap`: when and how"): the one entered last
    sets it while it lasts, and when the last one leaves the setting is what it was before the first."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if n is None or setter is None:
        yield
        return
    token = object()
    with _carveouts_lock:
        if not _carveouts:
            _before_carveouts[0] = torch._C._get_sm_carveout_experimental()
        _carveouts.append((token, sms - n))
        setter(sms - n)
    try:
        yield
    finally:
        with _carveouts_lock:
            _carveouts[:] = [entry for entry in _carveouts if entry[0] is not token]
            setter(_carveouts[-1][1] if _carveouts else _before_carveouts[0])


def device_overlap(device_type: str, side_streams: int, rule: Mapping[str, Any] | None = None) -> OpImpl:
    """The ``overlap`` op of a GPU backend whose tensors live on ``device_type`` (its vendor's: "cuda" on NVIDIA
    and AMD; "cpu" when its kernels are interpreted, which runs in order), that allows ``side_streams`` side
    streams, with the target's ``overlap`` rule (None: none)."""
    if device_type == "cpu":
        return OpImpl(in_order, prepare=in_order_schedule)
    scheduler = DeviceStreams(side_streams, device_type, rule)
    return OpImpl(scheduler, scheduler.supports, prepare=scheduler.prepare)
