"""The benchmarks' one timer: how long a call takes, CUDA events on a GPU, the host clock elsewhere.

Two questions, two forms:

- :class:`Timer` — the device time of a call in a busy stream, on rotating input sets (``indexcache bench``,
  ``bench/cp_gpu.py``): ``eager_us(fn)`` records an event pair around each of many back-to-back calls and
  synchronises once; ``graph_us(fn, calls)`` replays one CUDA graph holding ``calls`` calls. On a GPU,
  warm-up and timed calls each stop after about ``budget_s`` (never fewer than :data:`MIN_REPS` timed);
  ``budget_s=None`` fixes every count (``warmup`` then ``reps`` calls: each rank of a collective calls as
  often).
- :func:`times_ms` / :func:`median_ms` — the time of a call on its own: the device is idle when each call
  starts (one synchronisation after each), so a host-bound call shows its host cost; ``calls`` > 1 times
  bursts of back-to-back calls instead (the per-call cost of a loop). :func:`call_times_ms` is their loop,
  without warm-up.

:func:`capture_graph` captures a call in a CUDA graph the way torch asks (one warm-up call on a side
stream first); time the graph with ``median_ms(graph.replay, ...)``. :func:`alternating_graph_us` times contenders
against each other on a power-capped card: each captured, their bursts of replays taking turns. :func:`host_seconds`
times one long CPU call (wall and process CPU time).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from indexcache.backends.triton.target import device_gpu
from indexcache.hal.device import l2_bytes as device_l2_bytes

BUDGET_S = 0.5  # on a GPU, a Timer's warm-up and timed calls each stop after about this long
MIN_REPS = 3  # ... but never fewer timed calls than this


def on_gpu(device: torch.device) -> bool:
    """Whether ``device`` is a GPU (CUDA or ROCm: torch names both "cuda")."""
    return device.type == "cuda"


def _module(device: torch.device) -> Any:
    """The torch module of ``device``'s events, streams and synchronisation (``torch.cuda`` on NVIDIA and AMD)."""
    return torch.get_device_module(device)


def cache_bytes(device: torch.device) -> int:
    """The caches of a GPU in bytes, which inputs rotate past: its L2 (:func:`indexcache.hal.device.l2_bytes`), or
    its architecture record's ``cache_bytes`` where torch's L2 size leaves caches out (an MI300X: 4 MiB reported, 288
    MiB of L2 and Infinity Cache)."""
    gpu = device_gpu(device)
    if gpu is not None and gpu.cache_bytes:
        return gpu.cache_bytes
    return device_l2_bytes(device.index if device.index is not None else _module(device).current_device())


def capture_graph(fn: Callable[[], Any], device: torch.device | None = None) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph on ``device`` (default: the current one), after one call on the
    capture's side stream (torch's warm-up); neither replayed nor synchronised here."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def call_times_ms(fn: Callable[[], Any], device: torch.device, budget_s: float, min_reps: int,
                  max_reps: int) -> list[float]:
    """Milliseconds of each call of ``fn`` (no warm-up here): CUDA events around each call, synchronised after
    it, on a GPU; the host clock elsewhere. At least ``min_reps`` calls, then more until ``budget_s`` or
    ``max_reps``."""
    times: list[float] = []
    stop = time.perf_counter() + budget_s
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < stop):
        if not on_gpu(device):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
            continue
        module = _module(device)
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        with module.device(device):  # events on this device, whichever is current
            start.record()
            fn()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def times_ms(fn: Callable[[], Any], device: torch.device, budget_s: float, min_reps: int, max_reps: int,
             warmup: int = 1, calls: int = 1) -> list[float]:
    """Milliseconds of one call of ``fn``, per sample: ``warmup`` untimed calls and a synchronisation, then
    :func:`call_times_ms` of ``calls`` back-to-back calls a sample, divided by ``calls``."""
    for _ in range(warmup):
        fn()
    if on_gpu(device):
        _module(device).synchronize(device)
    if calls == 1:
        return call_times_ms(fn, device, budget_s, min_reps, max_reps)

    def burst() -> None:
        for _ in range(calls):
            fn()

    return [t / calls for t in call_times_ms(burst, device, budget_s, min_reps, max_reps)]


def median_ms(fn: Callable[[], Any], device: torch.device, budget_s: float, min_reps: int, max_reps: int,
              warmup: int = 1, calls: int = 1) -> float:
    """The median of :func:`times_ms`."""
    return statistics.median(times_ms(fn, device, budget_s, min_reps, max_reps, warmup, calls))


def turns(items: list, rounds: int, shuffle_seed: int | None = None) -> Iterator[list]:
    """``items`` once a round for ``rounds`` rounds, in their order, or with ``shuffle_seed`` in a new random order
    each round from that seed (so that no item always follows the same one)."""
    order = list(items)
    shuffle = random.Random(shuffle_seed).shuffle if shuffle_seed is not None else None
    for _ in range(rounds):
        if shuffle:
            shuffle(order)
        yield order


def alternating_graph_us(calls: dict[Any, Callable[[], Any]], device: torch.device, rounds: int,
                         burst: int, shuffle_seed: int | None = None) -> dict[Any, float]:
    """Per call the median µs of a replay of its CUDA graph in a burst of ``burst`` back-to-back replays, over
    ``rounds`` rounds in which the calls take turns (a power-capped card: contenders alternate rather than run one
    after the other). With ``shuffle_seed`` each round takes them in a new random order from that seed, so that no
    call always follows the same one (on the power-capped card a light call before a heavy one lets the heavy one
    start at higher clocks). Off a GPU each call itself, host clock (a script's smoke run: not a speed)."""
    samples: dict[Any, list[float]] = {name: [] for name in calls}
    if not on_gpu(device):
        for _ in range(rounds):
            for name, fn in calls.items():
                start = time.perf_counter()
                fn()
                samples[name].append(1e6 * (time.perf_counter() - start))
        return {name: statistics.median(s) for name, s in samples.items()}
    graphs = {name: capture_graph(fn, device) for name, fn in calls.items()}
    for graph in graphs.values():
        for _ in range(3):
            graph.replay()
    module = _module(device)
    for order in turns(list(graphs), rounds, shuffle_seed):
        for name in order:
            graph = graphs[name]
            module.synchronize(device)
            start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
            with module.device(device):  # a replay runs on the current device's stream
                start.record()
                for _ in range(burst):
                    graph.replay()
                end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3 / burst)
    return {name: statistics.median(s) for name, s in samples.items()}


def host_seconds(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``(fn(), wall seconds, this process's CPU seconds)`` of one call: for long CPU work timed once."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


class Timer:
    """Median time of one call in µs, on rotating input sets: CUDA events on a GPU, the host clock elsewhere.

    ``fn(i)`` runs the call on input set ``i``; the timer passes 0, 1, 2, … and ``fn`` rotates. On a GPU one
    timed call first estimates the cost: warm-up and timed calls stop at about ``budget_s`` each (never fewer
    than :data:`MIN_REPS` timed), so a baseline 100× slower does not cost 100× the time. With ``budget_s=None``
    (or off a GPU) exactly ``warmup`` untimed then ``reps`` timed calls run (``graph_reps`` replays).
    """

    def __init__(self, device: torch.device, warmup: int, reps: int, graph_reps: int,
                 budget_s: float | None = BUDGET_S):
        self.device, self.warmup, self.reps, self.graph_reps = device, warmup, reps, graph_reps
        self.budget_s = budget_s

    def eager_us(self, fn: Callable[[int], Any]) -> float:
        """Each call between two CUDA events, back to back, after the warm-up; one synchronisation at the end."""
        fitted = on_gpu(self.device) and self.budget_s is not None
        if fitted:
            fn(0)  # compiles; then up to warmup - 1 more within the budget
            warm = self._fit(lambda: fn(1), self.warmup - 1)
            for i in range(2, warm + 1):
                fn(i)
            # Every call takes the next input set, the estimating one too: no call, timed or not, runs on the set
            # of the call before it (whose inputs could still be in L2).
            reps = self._fit(lambda: fn(warm + 1), self.reps)
            first = warm + 2
        else:
            for i in range(self.warmup):
                fn(i)
            reps, first = self.reps, self.warmup
        if not on_gpu(self.device):
            times = []
            for i in range(reps):
                t0 = time.perf_counter()
                fn(first + i)
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        return self._events_us(lambda i: fn(first + i), reps)

    def graph_us(self, fn: Callable[[int], Any], calls: int) -> float:
        """One CUDA graph holding ``calls`` calls (``fn(0) .. fn(calls-1)``), replayed; per call."""
        graph = capture_graph(lambda: [fn(i) for i in range(calls)], self.device)
        graph.replay()  # warm-up; the estimating replay is the second
        reps = self._fit(graph.replay, self.graph_reps) if self.budget_s is not None else self.graph_reps
        return self._events_us(lambda i: graph.replay(), reps) / calls

    def _events_us(self, fn: Callable[[int], Any], reps: int) -> float:
        """Median µs of ``fn(0) .. fn(reps-1)``, each between two events, synchronised once at the end."""
        module = _module(self.device)
        marks = [(module.Event(enable_timing=True), module.Event(enable_timing=True)) for _ in range(reps)]
        with module.device(self.device):  # events on this timer's device (a replay runs on the current one)
            for i, (start, end) in enumerate(marks):
                start.record()
                fn(i)
                end.record()
        module.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in marks) * 1e3

    def _fit(self, once: Callable[[], Any], wanted: int) -> int:
        """Time ``once()`` alone; how many of ``wanted`` calls fit in the budget (at least MIN_REPS)."""
        module = _module(self.device)
        module.synchronize(self.device)
        start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
        with module.device(self.device):
            start.record()
            once()
            end.record()
        module.synchronize(self.device)
        return max(MIN_REPS, min(wanted, int(self.budget_s * 1e3 / max(start.elapsed_time(end), 1e-3))))
