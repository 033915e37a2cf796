"""The backend contract: what a backend module provides, as data, and what the dispatcher reads from it.

A backend is a :class:`Backend`: a name, a priority, a probe saying whether it can run on this machine
(:class:`Availability`), per op of :data:`OPS` an :class:`OpImpl`, and the typed facts of the target it
found (:class:`Capabilities`). ``OpImpl.supports(**args)`` returns the list of reasons it cannot serve a
call with exactly these arguments, every one of them; an empty list means it can. Backends import this
module (and ``indexcache.hal.device``, ``indexcache.hal.layout``), never the dispatcher or the runtime;
how to write one is in ``backends/README.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from indexcache.hal.specs import OP_NAMES

if TYPE_CHECKING:
    import torch

# The ops a backend may implement: those of the spec records, and the stream scheduler behind
# indexcache.runtime.streams.overlap (side work joined to the current stream).
OPS = (*OP_NAMES, "overlap")


def always(**_: Any) -> list[str]:
    """A ``supports`` check for implementations that take every valid argument: no reason to decline."""
    return []


def no_device_fp8(device: torch.device) -> None:
    """A ``device_fp8`` for backends that know no device's own fp8 format (the torch backend's: it takes either)."""
    return None


@dataclass(frozen=True)
class OpImpl:
    """One backend's implementation of one op: ``fn(**args)``, and ``supports(**args)`` returning every reason
    it cannot serve those arguments (empty: it can). Arguments arrive validated by the public op.

    ``prepare(**args)``, where a backend has it, does what ``fn(**args)`` does except running: it returns a
    callable that runs the call (its launches bound, nothing checked again), and that may be called again to
    repeat the call on whatever memory of the same layout lies at the same addresses. The public ops keep such
    callables for calls whose outputs are given (docs/ops.md, "Eager calls"). The scheduler ``overlap`` is the one
    exception: its ``prepare`` takes the call's arguments less the two functions and returns a :class:`Schedule`,
    the decision made once and run with any two functions (``indexcache.overlap_schedule``).

    ``workspace_bytes(**args)``, where a backend has it, is the bytes of device workspace the call takes (docs/ops.md,
    "Workspace"): its ``fn``, ``prepare`` and ``supports`` then get the op's ``workspace`` argument (None: the
    backend's own), a caller's checked to hold at least that many bytes. Without it the op takes no workspace on
    this backend: a given one is ignored, and the ``workspace`` argument never reaches the backend."""

    fn: Callable[..., Any]
    supports: Callable[..., list[str]] = always
    prepare: Callable[..., Callable[..., Any]] | None = None
    workspace_bytes: Callable[..., int] | None = None


def side_then_main(side_fn: Callable[[], Any], main_fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``(side_fn(), main_fn())`` on the current stream, side first: the in-order schedule's run."""
    side_out = side_fn()
    return side_out, main_fn()


@dataclass(frozen=True)
class Schedule:
    """How a scheduler runs side work beside main work, decided once (``overlap``'s ``prepare``):
    ``schedule(side_fn, main_fn)`` returns ``(side_fn(), main_fn())`` run that way, the current stream then ordered
    after both. ``how``: "in order" (``side_sms`` 0), "overlap" (no share: ``side_sms`` None), "partition" or
    "budget" (the side held to ``side_sms`` multiprocessors), or "per call" (a scheduler without ``prepare``: decided
    at each call, ``side_sms`` None)."""

    run: Callable[[Callable[[], Any], Callable[[], Any]], tuple[Any, Any]]
    how: str
    side_sms: int | None

    def __call__(self, side_fn: Callable[[], Any], main_fn: Callable[[], Any]) -> tuple[Any, Any]:
        return self.run(side_fn, main_fn)


IN_ORDER = Schedule(side_then_main, "in order", 0)


@dataclass(frozen=True)
class Availability:
    """What a backend's probe found on this machine.

    ``mode`` is "GPU", "interpreted" (Triton on the CPU) or "CPU"; ``device`` is where the backend
    runs its conformance cases; ``auto`` says whether auto-selection may pick it.
    """

    available: bool
    reason: str
    auto: bool = False
    mode: str = "CPU"
    device: str = "cpu"


@dataclass(frozen=True)
class Capabilities:
    """What an available backend computes with here (None: the backend has no such fact).

    ``fp8_dtype``: the fp8 format its kernels compute in (None: it takes either format as given);
    ``arch``: the architecture its kernels are built and tuned for ("sm90", "gfx942", ...);
    ``side_streams``: how many side streams its ``overlap`` scheduler may use on a GPU.
    """

    fp8_dtype: torch.dtype | None = None
    arch: str | None = None
    side_streams: int | None = None

    def as_info(self) -> dict[str, Any]:
        """The facts that are set, for display (``indexcache info``, conformance reports): dtypes as strings."""
        facts = {"arch": self.arch, "fp8_dtype": self.fp8_dtype, "side_streams": self.side_streams}
        return {k: str(v) if k == "fp8_dtype" else v for k, v in facts.items() if v is not None}


@dataclass(frozen=True)
class Backend:
    """A backend as data: ``ops`` maps op names of :data:`OPS` to implementations, or is a function
    building that map (called once, only when the probe found the backend available).

    ``capabilities()`` and ``details()`` are asked only of an available backend: the typed facts of its
    target, and further display-only data (tuning table, memory budget). ``device_fp8(device)`` is asked of any
    registered backend, available or not (no Triton needed): the fp8 format native to ``device`` where it is one of
    the backend's GPUs (from its architecture's record, or the forced architecture's: e4m3fnuz on an MI300), else
    None; the ops whose ``fp8_dtype`` is None take it (:func:`indexcache.hal.dispatch.native_fp8`).
    ``interpretable`` backends run their Triton kernels on the CPU when ``TRITON_INTERPRET=1``. ``fp8_tensor_core``
    says its fp8 logits accumulate on matrix units with reduced precision when run on a GPU (conformance then bounds
    their fp8 logits' relative RMS error by 1e-3 instead of fp32 accumulation's 1e-5; docs/ops.md).
    """

    name: str
    priority: int
    probe: Callable[[], Availability]
    ops: Mapping[str, OpImpl] | Callable[[], Mapping[str, OpImpl]] = field(default_factory=dict)
    capabilities: Callable[[], Capabilities] = Capabilities
    details: Callable[[], dict[str, Any]] = dict
    device_fp8: Callable[[torch.device], torch.dtype | None] = no_device_fp8
    interpretable: bool = False
    fp8_tensor_core: bool = False

    def info(self) -> dict[str, Any]:
        """What ``indexcache info`` shows of an available backend: its capabilities, then its details."""
        return {**self.capabilities().as_info(), **self.details()}
