"""Run one case on one backend and judge it against the float64 reference, by its op's spec record.

Each op's judge rule and tolerance live in its record (:mod:`indexcache.hal.specs`): integer ops exact;
top-k the same set of positions per row (the exact order when sorted); logits -inf, +inf and NaN where the
reference has them and a relative RMS error within the bound of the input dtype and accumulation;
quantization and the cache store byte-exact.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from indexcache.hal import dispatch, library, ops
from indexcache.hal.specs import SPECS
from indexcache.hal.specs.base import Case, Verdict, cpu
from indexcache.hal.specs.mqa_logits import BOUNDS

__all__ = ["BOUNDS", "CaseResult", "native_fp8", "run_case"]

# Arguments the reference does not take: the outputs, and the order flag (it always sorts).
_NOT_FOR_REFERENCE = ("out", "out_raw", "logits", "sorted")


@dataclass
class CaseResult:
    """The outcome of one case: status "passed", "failed" or "declined" (the backend's ``supports`` says why it does
    not serve these arguments, or it lacks the op: ``detail`` holds the reasons; a decline that gives no reason is
    failed)."""

    op: str
    case: str
    status: str
    detail: str = ""
    error: float | None = None
    bound: float | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _judge(case: Case, args: dict, checked: dict, backend: str, accumulation: str) -> Verdict:
    """Run the case through the public op and judge it (``checked``: its spec check's arguments). The reference runs
    first, on the inputs moved to the CPU (the same tensors when they are there already): the op may write into one
    of them (``store_index_k``'s cache), and the reference never does. Every tensor argument the op's schema does
    not mark written (:func:`~indexcache.hal.library.mutated`) must hold the same bytes after the op: a backend that
    scribbles on its inputs fails, and a judge that reads them afterwards reads what the reference did."""
    spec = SPECS[case.op]
    given = {k: cpu(v) for k, v in args.items() if k not in _NOT_FOR_REFERENCE}
    if "fp8_dtype" in checked:  # the format the op runs in: a case leaving it out, the device's native one
        given["fp8_dtype"] = checked["fp8_dtype"]
    want = spec.reference(**given)
    expected = library.result(case.op, checked)  # the given outputs, or new ones of their form
    around = [(name, t, outside, _bytes(t).cpu().clone()) for name, t in _given_outputs(args, expected)
              if (outside := _outside(t)) is not None]
    written = library.mutated(case.op)
    inputs = [(name, t, _elements(t)) for name, t in _tensors(args) if name.partition("[")[0] not in written]
    got = getattr(ops, spec.name)(**args, backend=backend)
    for name, t, before in inputs:
        if not torch.equal(_elements(t), before):
            return f"wrote into its input {name} (an argument its contract only reads)", None, None
    if detail := _misshapen(got, expected):
        return detail, None, None
    for name, t, outside, before in around:
        if not torch.equal(_bytes(t).cpu()[outside], before[outside]):
            return f"wrote outside the given {name} (into the rest of the buffer it is a view of)", None, None
    return spec.judge(args, got, want, accumulation)


def _tensors(args: dict) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each tensor argument (a list argument's items named ``name[i]``)."""
    found = []
    for name, value in args.items():
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif isinstance(value, list):
            found += [(f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return found


def _given_outputs(args: dict, result) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each output the case gave: the tensors of the op's contract ``result`` that are its
    arguments."""
    named = {id(t): (name, t) for name, t in _tensors(args)}
    result = [result] if isinstance(result, torch.Tensor) else list(result or ())
    return [named[id(t)] for t in result if id(t) in named]


def _elements(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the bytes of ``t``'s elements (not of the rest of its storage), flat (uint8): compared as bytes,
    a NaN equals itself."""
    return t.detach().cpu().clone().reshape(-1).view(torch.uint8)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s whole storage, flat (uint8)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _outside(t: torch.Tensor) -> torch.Tensor | None:
    """A CPU mask of the bytes of ``t``'s storage that are not ``t``'s elements (None where it holds every byte): a
    given output that is a view of a wider buffer must leave the rest of it as it was."""
    size, total = t.element_size(), t.untyped_storage().nbytes()
    if t.numel() * size == total:
        return None
    first = torch.arange(total // size).as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1) * size
    outside = torch.ones(total, dtype=torch.bool)
    for byte in range(size):
        outside[first + byte] = False
    return outside


def _misshapen(got, expected) -> str:
    """What differs ("" when nothing) between the tensors the op returned and those its contract returns
    (``expected``: the outputs its spec check allocates, or the given ones) in dtype, shape or device: the judges
    compare values on the CPU, where an int64 or float index equals its int32 one and every device is the same."""
    if isinstance(expected, torch.Tensor):
        got, expected = [got], [expected]
    elif expected is None:
        return "" if got is None else f"returned a {type(got).__name__}, expected None"
    if not isinstance(got, (list, tuple)) or len(got) != len(expected):
        return f"returned a {type(got).__name__}, expected {len(expected)} tensors"
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if not isinstance(g, torch.Tensor):
            return f"result {i}: a {type(g).__name__}, expected a tensor"
        if (g.dtype, g.shape, g.device) != (e.dtype, e.shape, e.device):
            return (f"result {i}: {g.dtype} {list(g.shape)} on {g.device}, expected {e.dtype} {list(e.shape)} on "
                    f"{e.device}")
    return ""


def _declined(case: Case, checked: dict, backend: str) -> list[str] | None:
    """The reasons the backend gives for not serving the case (None when it serves it): the dispatcher's answer for
    the checked arguments ``checked``, before anything runs (the error's message where it carries no list: a
    ``supports`` that raised it). A :class:`~indexcache.hal.dispatch.BackendNotSupportedError` raised later, by a
    backend that took the call, is a failure like any other exception."""
    try:
        dispatch.resolve(case.op, checked, backend)
    except dispatch.BackendNotSupportedError as exc:
        return [str(exc)] if exc.reasons is None else exc.reasons
    return None


def _decline(case: Case, backend: str, reasons: list[str]) -> tuple[str, str]:
    """``(status, detail)`` of a case the backend declined with ``reasons``: declined with the reasons that say
    something, or failed where none does (a backend must say why it does not serve a case)."""
    said = [r for r in reasons if r.strip()]
    if not said:
        return "failed", (f"backend {backend!r} declined {case.op} case {case.name!r} without giving a reason: "
                          f"expected a non-blank reason, got {reasons!r}")
    return "declined", "; ".join(said)


def native_fp8(backend: str) -> torch.dtype:
    """The fp8 format a backend computes in (its capabilities' ``fp8_dtype``; e4m3fn when it takes either)."""
    return dispatch.get(backend).capabilities().fp8_dtype or torch.float8_e4m3fn


def run_case(case: Case, backend: str, seed: int = 0) -> CaseResult:
    """Build the case on the backend's device, run it there through the public op, judge it."""
    avail = dispatch.availability(backend)
    accumulation = "tensor-core" if dispatch.get(backend).fp8_tensor_core and avail.mode == "GPU" else "fp32"
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(avail.device)
    args = case.build(gen, device, native_fp8(backend)) if case.native_fp8 else case.build(gen, device)
    start = time.perf_counter()
    try:
        checked = SPECS[case.op].check(**args)
        if (reasons := _declined(case, checked, backend)) is not None:
            return CaseResult(case.op, case.name, *_decline(case, backend, reasons),
                              seconds=time.perf_counter() - start)
        detail, err, bound = _judge(case, args, checked, backend, accumulation)
    except Exception as exc:  # a crash is a failure of the backend, reported, not raised
        return CaseResult(case.op, case.name, "failed", f"{type(exc).__name__}: {exc}",
                          seconds=time.perf_counter() - start)
    status = "failed" if detail else "passed"
    return CaseResult(case.op, case.name, status, detail, err, bound, time.perf_counter() - start)
