"""Kernel variants: the kernels a deployment's calls compile, listed without a GPU and compiled into Triton's cache.

A variant is one compiled kernel: the kernel, Triton's specialization of its arguments (each int's class, each
pointer's dtype and alignment, the constexpr values) and its launch options, which is what ``JITFunction.run`` keys
its cache on (docs/kernels.md, "Kernel variants"). :func:`op_launches` gives the launches one op call makes, from the
backend's own launch builders run inside :func:`~indexcache.backends.triton.launcher.planning` (meta tensors do:
nothing is allocated, compiled or launched); :func:`distinct` keeps one launch of each variant; :func:`warm`
compiles them into Triton's on-disk cache in worker processes, each through the kernel's own ``JITFunction.warmup``
under a driver that only names the target GPU, so that every entry is the one a launch on that GPU looks up (same
Triton, same ``TRITON_*`` environment) and no GPU is touched; :func:`load` then brings them into a process that will
launch them.
"""

from __future__ import annotations

import hashlib
import importlib
import multiprocessing
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from indexcache.backends.triton.target import Target
from indexcache.hal import fp4

if TYPE_CHECKING:  # Triton is imported only when launches are built or compiled
    from indexcache.backends.triton.launcher import Launch


def op_launches(op: str, args: Mapping[str, Any], target: Target,
                tuning: Mapping[str, Mapping[str, Any]]) -> list[Launch]:
    """The launches one call of ``op`` (a public op's name, its arguments as the op takes them, outputs given) makes
    on ``target`` with the backend's ``tuning`` table, in order."""
    from indexcache.backends.triton import gather, logits, prefill_producer, producer, quantize, topk, translate

    a = dict(args)
    if "q" in a and logits.declined_shape(a["q"]):  # the ops with queries start from the logits kernels
        found = []  # heads or a head dim the Triton logits decline: the torch backend's call, no kernel of ours
    elif op == "paged_topk_translate":
        found = producer.launches(**a, target=target, tuning=tuning)
    elif op in ("mqa_logits", "mqa_topk_translate") and a["k"].dtype == fp4.FP4 and not target.gpu.fp8_mma:
        found = []  # MXFP4 keys without fp8 matrix instructions: the torch backend's (the Triton prefill declines)
    elif op == "mqa_topk_translate":
        found = prefill_producer.op_launches(a, target=target, tuning=tuning)
    elif op in ("topk", "topk_translate"):
        found = [launch for _, launch in topk.launches(
            a["scores"], a["lengths"], a["k"], a.get("row_starts"), a["out"], a.get("out_raw"), a.get("page_table"),
            a.get("page_size", 1), a.get("row_to_batch"), sorted=a.get("sorted", False), target=target,
            cfg=tuning["topk"])]
    elif op == "mqa_logits":
        found = logits.mqa_logits_launches(**a, target=target, cfg=tuning["mqa_logits"])
    elif op == "paged_mqa_logits":
        found = [logits.paged_mqa_logits_launch(**a, target=target, cfg=tuning["paged_mqa_logits"])]
    elif op == "gather_index_k":
        found = [gather.gather_launch(**a, target=target, cfg=tuning["gather_index_k"])]
    elif op == "translate":
        found = translate.translate_launches(**a, target=target, cfg=tuning["translate"])
    elif op == "store_index_k":
        found = [quantize.store_index_k_launch(**a, target=target, cfg=tuning["quantize_index_k"])]
    elif op == "quantize_index_k":
        found = quantize.quantize_launches(**a, target=target, cfg=tuning["quantize_index_k"])
    else:
        raise ValueError(f"op: expected an op of the Triton kernels, got {op!r}")
    return [launch for launch in found if launch is not None]


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: ``kernel`` (its name), ``key`` (Triton's own cache key of the launch: its specialization
    and options), ``specialization`` (Triton's ``(type, class)`` of each parameter) and a representative ``launch``."""

    kernel: str
    key: str
    specialization: tuple
    launch: Launch

    def line(self) -> str:
        """One line: the kernel, its launch options, constexprs, the pointers' dtypes, the ints specialized to 1 or
        to multiples of 16 and any pointer specialized as not 16-byte aligned (every other int is of its plain type,
        every other pointer aligned or not specialized on it)."""
        fn = _jit(self.launch.launcher.fn)
        values = _values(self.launch)
        options = " ".join(f"{k}={v}" for k, v in self.launch.options)
        const, ones, sixteen, dtypes, unaligned = [], [], [], {}, []
        for param, value, (kind, spec) in zip(fn.params, values, self.specialization, strict=True):
            if param.is_constexpr:
                const.append(f"{param.name}={_short(value)}")
            elif kind == "constexpr":
                ones.append(param.name)
            elif kind.startswith("*"):
                dtypes[kind[1:]] = None
                if spec != "D" and not param.do_not_specialize_on_alignment:
                    unaligned.append(param.name)
            elif spec == "D":
                sixteen.append(param.name)
        parts = [f"{self.kernel} [{options}]", " ".join(const), f"dtypes {'/'.join(dtypes)}"]
        parts += [f"=1: {' '.join(ones)}"] if ones else []
        parts += [f"%16: {' '.join(sixteen)}"] if sixteen else []
        parts += [f"unaligned: {' '.join(unaligned)}"] if unaligned else []
        return " | ".join(p for p in parts if p)


def _short(value: Any) -> str:
    """``value`` as text, a long one (a layout) as its type and a digest of its text (the same in every run)."""
    text = str(value)
    return text if len(text) <= 40 else f"{type(value).__name__}#{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def _values(launch: Launch) -> tuple:
    names = launch.launcher.fn.arg_names
    return tuple(launch.args) + tuple(launch.named[n] for n in names[len(launch.args):])


_JITS: dict[Any, Any] = {}


def _jit(fn: Any) -> Any:
    """The ``JITFunction`` of the kernel ``fn``: itself, or for an ``InterpretedFunction`` (Triton decides at import,
    by TRITON_INTERPRET) one made of the same Python function with the same ``triton.jit`` options, which has the same
    parameters, so the same binder and keys; it is never run or compiled (its source hash, over the interpreted
    functions it calls, cannot be computed)."""
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    if fn not in _JITS:
        _JITS[fn] = JITFunction(fn.fn, **fn.kwargs)
    return _JITS[fn]


# By the kernel's id: a JITFunction hashes by its source hash, which a Gluon kernel (a JITFunction under
# TRITON_INTERPRET too) cannot compute over the interpreted functions it calls. Kernels live as long as their modules.
_BINDERS: dict[tuple[int, Any], Callable] = {}


def _binder(fn: Any, gpu: Any) -> Callable:
    """Triton's own argument binder of ``fn`` for the GPU target ``gpu``: what ``JITFunction.run`` specializes with."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    key = (id(fn), gpu)
    if key not in _BINDERS:
        jit = _jit(fn)
        _BINDERS[key] = create_function_from_signature(jit.signature, jit.params, make_backend(gpu))
    return _BINDERS[key]


def specialize(launch: Launch, gpu: Any) -> tuple[str, list]:
    """``(key, specialization)`` of ``launch`` on the GPU target ``gpu`` (``triton.backends.compiler.GPUTarget``):
    Triton's cache key, the string ``JITFunction.run`` looks its compiled kernels up by, and the ``(type, class)`` it
    gives each parameter."""
    from triton.runtime.jit import compute_cache_key

    _, specialization, options = _binder(launch.launcher.fn, gpu)(*launch.args, **launch.named,
                                                                    **dict(launch.options))
    return compute_cache_key({}, specialization, options), specialization


def distinct(launches: Iterable[Launch], gpu: Any) -> list[Variant]:
    """One :class:`Variant` per kernel and key of ``launches``, in the order first met."""
    found: dict[tuple[str, str], Variant] = {}
    for launch in launches:
        kernel = launch.launcher.__name__
        key, specialization = specialize(launch, gpu)
        if (kernel, key) not in found:
            found[(kernel, key)] = Variant(kernel, key, tuple(specialization), launch)
    return list(found.values())


class _TargetOnly:
    """A Triton driver that only names the GPU target: enough for ``JITFunction.warmup`` to compile (it asks the
    driver for the target, the current device and stream, and launches nothing)."""

    def __init__(self, gpu: Any):
        self.gpu = gpu

    def get_current_target(self) -> Any:
        return self.gpu

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _start_worker(gpu: Any) -> None:
    from triton.runtime.driver import driver

    driver.set_active(_TargetOnly(gpu))


def _compile(module: str, name: str, args: tuple, named: dict, options: tuple) -> float:
    """Compile one variant into Triton's cache through the kernel's own warmup, keyed as a launch keys it
    (``launcher.settle_cache_keys``); returns the seconds it took."""
    from indexcache.backends.triton.launcher import settle_cache_keys

    fn = getattr(importlib.import_module(module), name)
    start = time.perf_counter()
    settle_cache_keys()
    fn.warmup(*args, grid=(1,), **named, **dict(options))
    return time.perf_counter() - start


Progress = Callable[[int, int, Variant, float], None]


def warm(variants: Sequence[Variant], gpu: Any, jobs: int, progress: Progress | None = None) -> list[float]:
    """Compile ``variants`` for the GPU target ``gpu`` into Triton's cache (``TRITON_CACHE_DIR``, inherited by the
    workers) in ``jobs`` worker processes; ``progress(done, total, variant, seconds)`` after each. Returns each
    variant's compile seconds (a variant already in the cache takes milliseconds). The calling process's Triton
    driver is left alone."""
    if jobs < 1:
        raise ValueError(f"jobs: expected at least 1 worker process, got {jobs}")
    seconds = [0.0] * len(variants)
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA, Triton or torch threads
    with ProcessPoolExecutor(min(jobs, max(1, len(variants))), mp_context=context, initializer=_start_worker,
                             initargs=(gpu,)) as pool:
        futures = {}
        for i, v in enumerate(variants):
            fn = v.launch.launcher.fn
            futures[pool.submit(_compile, fn.__module__, fn.__name__, tuple(v.launch.args), dict(v.launch.named),
                                v.launch.options)] = i
        for done, future in enumerate(as_completed(futures), 1):
            i = futures[future]
            try:
                seconds[i] = future.result()
            except BrokenProcessPool as exc:
                raise RuntimeError(
                    "the compile workers ended before compiling (their output above says why). They are started "
                    "with 'spawn' and import the main script again: a script that warms up at its top level needs "
                    "the call under `if __name__ == '__main__':`") from exc
            if progress:
                progress(done, len(variants), variants[i], seconds[i])
    return seconds


def load(variants: Sequence[Variant]) -> None:
    """Each variant into this process, from the cache :func:`warm` filled: kept by its kernel's launcher and its
    module on the current GPU, so that its first launch here neither compiles, nor loads, nor goes through Triton's
    own launch path (a GPU only; ``Launcher.load``)."""
    for v in variants:
        v.launch.launcher.load(v.launch.options, *v.launch.args, **v.launch.named)
