"""The spec record of an op (:class:`OpSpec`) and its conformance cases (:class:`Case`).

An op's record says, in one place, how its arguments are checked, what its float64 reference computes,
how a backend's answer is judged against that reference, which inputs every backend is judged on, and
the shapes it is benchmarked at. :mod:`indexcache.hal.ops` runs the checks, the conformance suite runs the
cases and the judge, ``indexcache bench`` the benchmark definition (:mod:`indexcache.hal.specs.bench`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from indexcache.hal.specs.bench import BenchSpec

I32 = torch.int32
E4M3 = torch.float8_e4m3fn
E4M3_FNUZ = torch.float8_e4m3fnuz
# Page sizes that are not a multiple of a kernel's key tile (64): a tile crosses a page end.
ODD_PAGES = (65, 96, 100, 129, 200)

# A judge's answer: (what failed, "" when nothing did; the error measured or None; the bound it had or None).
Verdict = tuple[str, float | None, float | None]


@dataclass(frozen=True)
class Case:
    """One conformance case: ``build(gen, device)`` gives the op's keyword arguments; a ``native_fp8`` case's
    ``build(gen, device, fp8)`` takes the backend's own fp8 format, so every backend runs it."""

    op: str
    name: str
    build: Callable[..., dict[str, Any]]
    native_fp8: bool = False


class CaseList(list):
    """An op's cases in order; ``@cases.add(name)`` registers a builder."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def add(self, name: str, native_fp8: bool = False) -> Callable:
        def register(build):
            self.append(Case(self.op, name, build, native_fp8))
            return build

        return register


@dataclass(frozen=True)
class OpSpec:
    """Everything about one op but its kernels.

    - ``check(*args, **kwargs)``: takes the public op's arguments (all but ``backend``), raises the op's
      ``TypeError`` / ``ValueError`` for bad ones and returns the keyword arguments the backends get, with
      the output allocated when none was given;
    - ``reference(**args)``: the float64 / int64 oracle, on the CPU; it takes the op's arguments less its
      outputs (``out``, ``out_raw``, ``logits``) and ``sorted``;
    - ``judge(args, got, want, accumulation)``: compares the op's result ``got`` (``args`` as the op ran
      with them, outputs included) with the reference's ``want``; ``accumulation`` is "fp32" or
      "tensor-core" (the logits bound depends on it); returns a :data:`Verdict`;
    - ``cases``: the conformance cases, in catalogue order;
    - ``bench``: the benchmark definition (:class:`~indexcache.hal.specs.bench.BenchSpec`): the shapes
      ``indexcache bench`` times, an input builder, the bytes and FLOPs a call moves and does, the roofline it
      is set against and how a backend's result is checked against the torch backend's; None for an op that
      is not benchmarked;
    - ``budgeted``: whether its GPU backends launch persistent kernels, which an SM budget caps (the op takes
      ``sm_budget=``: :mod:`indexcache.hal.budget`).
    """

    name: str
    check: Callable[..., dict[str, Any]]
    reference: Callable[..., Any]
    judge: Callable[[dict[str, Any], Any, Any, str], Verdict]
    cases: tuple[Case, ...]
    bench: BenchSpec | None = None
    budgeted: bool = False


def cpu(x):
    """A tensor detached and on the CPU (the same tensor when it is there already), a list or tuple of tensors as a
    list of such; anything else as it is."""
    if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return [cpu(t) for t in x]
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def ints(gen: torch.Generator, low: int, high: int, shape) -> torch.Tensor:
    """Uniform int32 in ``[low, high)`` from ``gen``."""
    return torch.randint(low, high, shape, generator=gen, dtype=I32)


def to_fp8(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` clamped to the format's finite range, then cast."""
    limit = float(torch.finfo(dtype).max)
    return t.clamp(-limit, limit).to(dtype)


def not_written(args: dict[str, Any], returned: dict[str, Any]) -> str:
    """What a judge reports ("" when nothing) where an op given an output did not return that output: ``returned``
    maps an output argument's name to what the op returned for it; each one the case gave (a tensor in ``args``)
    must be that very memory (address, shape and strides), as every op's contract returns it, or its answer never
    reached the caller's tensor."""
    for name, got in returned.items():
        given = args.get(name)
        if isinstance(given, torch.Tensor) and not (
                isinstance(got, torch.Tensor) and got.data_ptr() == given.data_ptr() and got.dtype == given.dtype
                and got.shape == given.shape and got.stride() == given.stride()):
            return f"did not write into the given {name} (returned another tensor)"
    return ""
