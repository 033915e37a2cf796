"""An op's benchmark definition (:class:`BenchSpec`, its shapes :class:`BenchCase`), the ``bench`` field of its
spec record, and what several ops' definitions share.

``indexcache bench`` (:mod:`indexcache.bench.harness`) knows an op only by these fields. A ``call`` runs the op
as the public op runs a call it does not keep, ``dispatch.call(op, check(...), backend)``: checked and dispatched
every time (the spec records cannot import the public ops, which are built on them; kept calls are timed by
``bench/launch_overhead_gpu.py``). The checks follow the conformance rules against the torch backend:
translate, quantize_index_k and store_index_k exactly; logits with -inf in the same places, no NaN and a
relative RMS error within the tensor-core bound of the key dtype; top-k by each row's index set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

BASELINE = "torch"  # the backend every other one is checked against and compared with
POISON = -2  # never a valid translate output: shows slots a backend left unwritten
# The benchmarks' indexer (DeepSeek-V3.2): 64 heads, key dimension 128, cache pages of 64 tokens.
HEADS, DIM, PAGE = 64, 128, 64


@dataclass(frozen=True)
class BenchCase:
    """One shape of an op: its name in the table, the parameters the builder reads, and a note."""

    name: str
    params: Mapping[str, Any]
    note: str = ""


def equal(a: Any, b: Any, case: BenchCase | None = None) -> bool:
    """Exact equality, on the CPU."""
    return torch.equal(a.cpu(), b.cpu())


def no_flops(case: BenchCase) -> int:
    """No arithmetic counted: an op that only moves data."""
    return 0


@dataclass(frozen=True)
class BenchSpec:
    """An op as the harness sees it.

    ``cases(quick)`` gives the shapes; ``build(case, gen)`` one input set on the CPU (from the CPU
    generator ``gen``, so every device gets the same values), output buffers included and filled
    with a poison value; ``call(args, backend)`` runs it and returns the result; ``bytes`` and
    ``flops`` count the least memory traffic and arithmetic of one call; ``roofline`` names the ceiling
    (:data:`indexcache.bench.ceilings.CEILINGS`) the achieved rate is a fraction of (or gives it per case,
    ``roofline(case)``);
    ``ceilings`` names more ceilings to measure in the same run; ``same(result, baseline, case)`` says
    whether a backend agrees with the torch backend (True, or ``""``; False or a string saying what differs).

    ``extras`` are more rows timed on the torch backend's device and inputs, e.g. a torch primitive to beat
    (``{"torch.topk": fn(args)}``); each is checked with ``same`` too, and every row's ``speedup_vs_extra``
    is over the first. ``floor(args)``, where given, is the op's roofline measured per case: its time on
    the same inputs (e.g. reading the scores once) is the least time a call can take, for a roofline
    ceiling without a ``measure``.
    """

    name: str
    cases: Callable[[bool], Sequence[BenchCase]]
    build: Callable[[BenchCase, torch.Generator], dict[str, Any]]
    call: Callable[[Mapping[str, Any], str], Any]
    bytes: Callable[[BenchCase], int]
    flops: Callable[[BenchCase], int] = no_flops
    roofline: str | Callable[[BenchCase], str] = "copy_bandwidth"
    same: Callable[[Any, Any, BenchCase], bool | str] = equal
    ceilings: tuple[str, ...] = ()
    extras: Mapping[str, Callable[[Mapping[str, Any]], Any]] = dataclasses.field(default_factory=dict)
    floor: Callable[[Mapping[str, Any]], Any] | None = None

    def roofline_of(self, case: BenchCase) -> str:
        return self.roofline(case) if callable(self.roofline) else self.roofline
