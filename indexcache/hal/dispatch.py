"""The backend registry: which backend serves an op, and why.

A backend is plain data (:class:`~indexcache.hal.contract.Backend`, the contract backends implement): a
name, a priority, a probe that says whether it can run on this machine, and per op an
:class:`~indexcache.hal.contract.OpImpl` whose ``supports(**args)`` lists every reason it cannot serve the
exact arguments of a call (none: it can).

Choice, in order: the ``backend=`` argument of a call, then :func:`use_backend`, then the
``INDEXCACHE_BACKEND`` environment variable. Such an explicit choice of a name no backend registers
raises :class:`UnknownBackendError` listing the known ones; one that cannot serve a call raises
:class:`BackendNotSupportedError` listing every reason. With no explicit choice the default backend
is resolved lazily at first use (never at import): the available backend with ``auto`` set and the
highest priority (ROCm, then CUDA, then torch). When it cannot serve a call, the next available
backend that can does, and the reasons are logged once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any

import torch

# Backend, OpImpl and Availability stay importable from here for plugins written before the contract had a module.
from indexcache.hal import memo
from indexcache.hal.contract import Availability, Backend, OpImpl

logger = logging.getLogger("indexcache")

ENV_VAR = "INDEXCACHE_BACKEND"
ENTRY_POINT_GROUP = "indexcache.backends"
# Modules of the built-in backends, each exposing ``BACKEND``; importing them touches no device.
BUILTIN_MODULES = (
    "indexcache.backends.rocm",
    "indexcache.backends.cuda",
    "indexcache.backends.torch",
)


class BackendNotSupportedError(RuntimeError):
    """An explicitly chosen backend cannot serve a call; the message lists every reason, and ``reasons`` holds them
    as that backend gave them (None where no one backend's list is behind the error)."""

    def __init__(self, message: str, reasons: list[str] | None = None) -> None:
        super().__init__(message)
        self.reasons = reasons


class UnknownBackendError(ValueError):
    """A backend name that no built-in module or entry point registers."""


def _load_backends() -> dict[str, Backend]:
    found: dict[str, Backend] = {}
    for module in BUILTIN_MODULES:
        backend = importlib.import_module(module).BACKEND
        found[backend.name] = backend
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin must not break the library
            logger.warning("indexcache: backend entry point %r failed to load: %s", ep.name, exc)
            continue
        backend = obj() if callable(obj) and not isinstance(obj, Backend) else obj
        if not isinstance(backend, Backend):
            logger.warning("indexcache: entry point %r gave %r, not a Backend", ep.name, type(obj))
            continue
        if backend.name in found:
            logger.warning("indexcache: entry point %r redefines backend %r; ignored", ep.name, backend.name)
            continue
        found[backend.name] = backend
    return found


@functools.cache
def registry() -> dict[str, Backend]:
    """Every known backend by name, built-in and plugins (loaded once, lazily)."""
    return _load_backends()


@functools.cache
def availability(name: str) -> Availability:
    """The probe result of backend ``name`` (cached: probing may initialise a device)."""
    return get(name).probe()


@functools.cache
def ops_of(name: str) -> Mapping[str, OpImpl]:
    """The ops backend ``name`` implements here (empty when it is not available)."""
    backend = get(name)
    if not availability(name).available:
        return {}
    return backend.ops() if callable(backend.ops) else backend.ops


def get(name: str) -> Backend:
    """The backend registered as ``name``; raises :class:`UnknownBackendError` listing known names."""
    backends = registry()
    if name not in backends:
        raise UnknownBackendError(f"backend: expected one of {sorted(backends)}, got {name!r}")
    return backends[name]


def reset() -> None:
    """Forget registry, probes, the default choice, the devices' fp8 formats, the kept calls and the kept schedulers
    (for tests that change the environment)."""
    memo.clear()
    _schedulers.clear()
    registry.cache_clear()
    availability.cache_clear()
    ops_of.cache_clear()
    default_backend.cache_clear()
    _native_fp8s.clear()
    _logged.clear()


# Each device's native fp8 format, as native_fp8 found it (a dict: Dynamo would trace through a functools.cache).
_native_fp8s: dict[torch.device, torch.dtype] = {}


def native_fp8(device: torch.device) -> torch.dtype:
    """The fp8 format native to ``device``, what an op's ``fp8_dtype=None`` means: the first answer of the registered
    backends' ``device_fp8`` (highest priority first; the GPU backends read the architecture's record, or the one
    ``INDEXCACHE_CUDA_ARCH`` / ``INDEXCACHE_ROCM_ARCH`` forces: e4m3fnuz on gfx942, MI300), else
    ``torch.float8_e4m3fn`` (the CPU, and any device no backend claims). Asked once a device, then kept; a GPU device
    without an index (``cuda``: the current GPU, which ``torch.cuda.set_device`` changes) is asked at every call."""
    fp8 = _native_fp8s.get(device)
    if fp8 is None:
        answers = (b.device_fp8(device) for b in sorted(registry().values(), key=lambda b: -b.priority))
        fp8 = next((a for a in answers if a is not None), torch.float8_e4m3fn)
        if device.index is not None or device.type == "cpu":
            _native_fp8s[device] = fp8
    return fp8


# Under torch.compile Dynamo calls native_fp8 while tracing and keeps its answer as a constant of the graph, rather
# than tracing the backends' imports and device queries (a graph break). torch.compiler.assume_constant_result sets
# this mark, but imports torch._dynamo to do it, which imports Triton: at this module's import that made a broken
# Triton install fail every import of the dispatcher (the torch backend must run without Triton) and cost every
# process the import. tests/test_compile.py checks the mark still works (the default's fullgraph compile).
native_fp8._dynamo_marked_constant = True  # type: ignore[attr-defined]


def available_backends() -> list[str]:
    """Names of the backends usable on this machine, highest priority first."""
    names = [n for n in registry() if availability(n).available]
    return sorted(names, key=lambda n: -get(n).priority)


def prepare() -> str:
    """Do now what the first op call of a process does once: load the backends (built-in and plugins), probe each,
    make the automatic choice and build the ops of the backend calls will run on (the explicit choice in force, else
    the automatic one; on a GPU machine about a tenth of a second, most of it the backend's modules and tables).
    ``indexcache.warmup(plan)`` calls it, so an engine that warms at start pays none of it at its first call. Returns
    that backend's name."""
    default_backend()
    name = get_backend()
    ops_of(name)
    return name


@functools.cache
def default_backend() -> tuple[str, str]:
    """The automatic choice and why, as ``(name, reason)``; ignores explicit choices."""
    for name in available_backends():
        avail = availability(name)
        if avail.auto:
            return name, avail.reason
    raise RuntimeError("indexcache: no backend can run here (the torch backend should always be available)")


_context_choice: contextvars.ContextVar[str | None] = contextvars.ContextVar("indexcache_backend", default=None)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block, ops run on backend ``name`` (an explicit choice: it raises if it cannot serve)."""
    get(name)
    token = _context_choice.set(name)
    try:
        yield
    finally:
        _context_choice.reset(token)


def _environ_reader(name: str) -> Callable[[], str | None]:
    """A function returning ``os.environ.get(name)``, read at each call. Where ``os.environ`` keeps its mapping in
    ``_data`` (CPython, every version this package supports), read there: ``os.environ.get`` of a name that is not set
    raises and catches two KeyErrors, 1.3 µs on the CI machine, and every op call reads this variable."""
    environ = os.environ
    data, encode, decode = (getattr(environ, attr, None) for attr in ("_data", "encodekey", "decodevalue"))
    if not (isinstance(data, dict) and callable(encode) and callable(decode)):
        return lambda: environ.get(name)
    key = encode(name)

    def read() -> str | None:
        value = data.get(key)
        return None if value is None else decode(value)

    return read


_env_choice = _environ_reader(ENV_VAR)


def explicit_choice(backend: str | None = None) -> tuple[str, str] | None:
    """The explicit choice in force, as ``(name, where it came from)``, or None.

    A name in ``INDEXCACHE_BACKEND`` that no backend registers raises :class:`UnknownBackendError` naming the variable.
    """
    if backend is not None:
        return backend, "backend= argument"
    if (name := _context_choice.get()) is not None:
        return name, "use_backend()"
    if env := _env_choice():
        if env not in registry():
            raise UnknownBackendError(f"{ENV_VAR}: expected one of {sorted(registry())}, got {env!r}")
        return env, f"{ENV_VAR}={env}"
    return None


def get_backend() -> str:
    """The backend ops run on now: the explicit choice if any, else the automatic one."""
    chosen = explicit_choice()
    return chosen[0] if chosen else default_backend()[0]


def _why_not(name: str, op: str, args: Mapping[str, Any]) -> list[str]:
    """Every reason backend ``name`` cannot run ``op`` with ``args`` (empty when it can)."""
    avail = availability(name)
    if not avail.available:
        return [f"not available: {avail.reason}"]
    impl = ops_of(name).get(op)
    if impl is None:
        return [f"does not implement {op}"]
    reasons = impl.supports(**args_for(impl, args))
    if not isinstance(reasons, list):
        raise TypeError(f"backend {name!r}: supports() of {op} must return a list of reasons (empty: supported), "
                        f"got {type(reasons).__name__}")
    return reasons


_logged: set[tuple[str, str, str]] = set()


def resolve(op: str, args: Mapping[str, Any], backend: str | None = None) -> tuple[str, OpImpl]:
    """The backend name and implementation that serve ``op`` with these (validated) arguments."""
    return resolve_choice(op, args, explicit_choice(backend))


def resolve_choice(op: str, args: Mapping[str, Any], chosen: tuple[str, str] | None) -> tuple[str, OpImpl]:
    """:func:`resolve` under the explicit choice ``chosen`` (:func:`explicit_choice`'s answer, which a public call
    has already read for its signature)."""
    if chosen is not None:
        name, origin = chosen
        get(name)
        if why := _why_not(name, op, args):
            said = "; ".join(r for r in why if r.strip()) or "it gave no reason (its supports() must say why)"
            raise BackendNotSupportedError(f"backend {name!r} (chosen by {origin}) cannot run {op}: {said}", why)
        return name, ops_of(name)[op]
    first, _ = default_backend()
    if not (why := _why_not(first, op, args)):
        return first, ops_of(first)[op]
    skipped = [(first, "; ".join(why))]
    for name in available_backends():
        if name == first:
            continue
        if why := _why_not(name, op, args):
            skipped.append((name, "; ".join(why)))
            continue
        for prev, reason in skipped:
            if (op, prev, reason) not in _logged:
                _logged.add((op, prev, reason))
                logger.info("indexcache: %s falls back from %s to %s: %s", op, prev, name, reason)
        return name, ops_of(name)[op]
    raise BackendNotSupportedError(
        f"no backend can run {op} with these arguments: " + " | ".join(f"{n}: {why}" for n, why in skipped)
    )


_schedulers: dict[tuple, tuple[str, OpImpl]] = {}


def scheduler(args: Mapping[str, Any], backend: str | None = None) -> tuple[str, OpImpl]:
    """:func:`resolve` for ``overlap``, kept by the explicit choice in force and ``args["device"]``: a backend's
    ``overlap`` decides whether it serves a call by the device alone (``backends/README.md``), and an eager layer step
    then pays no dispatch for its overlap (docs/streams.md)."""
    key = (explicit_choice(backend), args["device"])
    found = _schedulers.get(key)
    if found is None:
        found = _schedulers[key] = resolve("overlap", args, backend)
    return found


def args_for(impl: OpImpl, args: Mapping[str, Any]) -> Mapping[str, Any]:
    """The arguments ``impl`` takes: all of them, less ``workspace`` where it declares no ``workspace_bytes`` (it
    takes no workspace), less the paged ops' ``k_format`` and ``row_to_batch`` where None (the cache in the
    queries' fp8 format, uniform rows: as before the paged ops had either), and less ``q_scale`` where None (fp8 or
    bf16 queries: as before the logits ops took MXFP4 ones): backends written before keep working."""
    drop = ["workspace"] if impl.workspace_bytes is None and "workspace" in args else []
    if "k_format" in args:  # a paged op
        drop += [name for name in ("k_format", "row_to_batch") if name in args and args[name] is None]
    if "q_scale" in args and args["q_scale"] is None:
        drop.append("q_scale")
    if not drop:
        return args
    taken = dict(args)  # a copy less a few names: cheaper than a comprehension over every argument
    for name in drop:
        del taken[name]
    return taken


def workspace_bytes(impl: OpImpl, args: Mapping[str, Any]) -> int:
    """The workspace bytes ``impl`` takes for these (validated) arguments: 0 where it declares none."""
    return impl.workspace_bytes(**args) if impl.workspace_bytes is not None else 0


def check_workspace_size(name: str, op: str, impl: OpImpl, args: Mapping[str, Any]) -> None:
    """A caller's ``workspace`` (if any) holds the bytes backend ``name``'s ``impl`` takes for this call of ``op``:
    else a ValueError naming what was expected and what came."""
    given = args.get("workspace")
    if given is not None and given.numel() < (need := workspace_bytes(impl, args)):
        raise ValueError(f"workspace: expected at least {need} bytes for this {op} call on backend {name!r} "
                         f"(indexcache.workspace_bytes), got {given.numel()}")


def call(op: str, args: Mapping[str, Any], backend: str | None = None) -> Any:
    """Run ``op`` on the backend :func:`resolve` picks (a caller's workspace checked to be large enough)."""
    name, impl = resolve(op, args, backend)
    check_workspace_size(name, op, impl, args)
    return impl.fn(**args_for(impl, args))
