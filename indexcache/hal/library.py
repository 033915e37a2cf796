"""The public ops as ``torch.library`` custom ops: ``torch.ops.indexcache.<op>``, so a model compiled with
``torch.compile`` (``fullgraph=True`` included) or captured in a CUDA graph calls them without a graph break.

Every op of :data:`~indexcache.hal.specs.SPECS` is registered here from its spec record: the schema's
arguments are the spec check's parameters in order (a tensor, an optional tensor where the default is None,
``SymInt`` / ``bool`` where the check annotates ``int`` / ``bool``, ``SymInt?`` for ``int | None`` (the prefill
producer's ``workspace_bytes``), ``Tensor[]`` for ``torch.Tensor | Sequence[torch.Tensor]`` (the HiSparse swap-in's
KV, one layer's or a group's: one tensor goes as a list of one), ``ScalarType?`` where it annotates
``torch.dtype | None``: the paged ops' ``k_format``, the key quantize, store and gather ops' ``fp8_dtype``), then
``str? backend``; no argument has a default (the wrapper passes them all). The outputs ``out`` / ``out_raw``
(and ``paged_topk_translate``'s ``logits``, ``gather_index_k``'s ``out_k`` and ``out_scale``, ``quantize_index_k``'s
``out_scale``), a caller's ``workspace`` and ``store_index_k``'s ``k_cache`` are mutated arguments (``Tensor(a!)``): a
custom op may not return an alias of an input, so the ops return nothing and the Python wrapper
(:mod:`indexcache.hal.ops`) returns ``out`` or the outputs :data:`RESULTS` names (:func:`result`); ``out``, ``logits``,
``out_k`` and ``out_scale`` are required arguments of the custom op (the wrapper allocates them from the spec check
when the caller gave none), ``out_raw`` and ``workspace`` stay optional (no ``workspace``: the backend's own, taken
when the graph runs). The per-op description below (:data:`WRITES`, :data:`RESULTS`) holds only what the spec's
signature does not say.

How a call runs:

- **Eager** (not compiling: ``torch.compiler.is_compiling()`` is False): the public wrapper runs the spec
  check (the overlap check included) and :func:`indexcache.hal.dispatch.call` directly, never through
  ``torch.ops``: the custom-op machinery costs Python time on every call, and engines call these ops eagerly
  in prefill, once per layer.
- **Traced by Dynamo**: the wrapper runs the spec check on the fake tensors (shapes, dtypes and devices; the
  memory-overlap check, which needs ``data_ptr()``, and the cache's storage-offset alignment, which Dynamo
  cannot trace, are skipped there) to raise the same errors and allocate
  ``out``, then calls ``torch.ops.indexcache.<op>``. The graph holds the custom op; its fake implementation
  runs the spec check too (on fake or meta tensors, all of it but the overlap check), so AOT tracing,
  ``torch.export`` and ``FakeTensorMode`` refuse what the real op refuses, with the same error, and it gives the
  shapes; its mutation annotations let AOTAutograd functionalize the in-place writes.
- **The compiled graph runs**: the custom op's real implementation runs the spec check again on the real
  tensors (the overlap check included) and then :func:`indexcache.hal.dispatch.call`, eagerly, outside
  anything Dynamo traced, with the tensors' GPU current as an eager call makes it. So the backend is chosen at run
  time, per call, exactly as in eager mode: the ``backend=`` string travels as an op argument, and
  :func:`indexcache.use_backend` (a ContextVar) or
  ``INDEXCACHE_BACKEND`` in force when the compiled function is *called* are honoured without recompiling.
  Nothing Dynamo traces reads the ContextVar. Functionalization (AOTAutograd: ``backend="aot_eager"``) may hand
  the op a copy of a tensor it writes, on which an overlap with the caller's other tensors cannot be seen; so the
  traced wrapper first calls ``torch.ops.indexcache.check_<op>`` (:data:`CHECKS`), the same spec check as a
  read-only op, which gets the graph's own tensors. A ``torch.ops.indexcache.<op>`` called directly under compile
  has no such check: functionalized, its overlap check sees the copy.

The stream scheduler :func:`indexcache.runtime.streams.overlap` is not a custom op: it takes Python callables and
schedules them on streams, which no operator schema can carry.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from indexcache.hal import budget, device, dispatch
from indexcache.hal.specs import SPECS

NAMESPACE = "indexcache"
# The ops whose GPU backends launch persistent kernels, and so take ``sm_budget=`` (their spec records say so).
BUDGETED_OPS = tuple(op for op, spec in SPECS.items() if spec.budgeted)
# Arguments every op that has them writes in place: mutated in the schema, never returned by the custom op.
OUTPUTS = ("logits", "out", "out_raw", "workspace", "out_k", "out_scale", "out_copy_src", "out_copy_dst",
           "out_copy_count")
# The mutated arguments that may be None in the custom op too.
OPTIONAL_OUTPUTS = ("out_raw", "workspace", "slot_index")
# What the spec records do not say, part 1: the ops that write an input in place (``paged_mqa_logits`` only reads
# its ``k_cache``).
WRITES: Mapping[str, tuple[str, ...]] = {"store_index_k": ("k_cache",),
                                         "hisparse_plan": ("slot_token", "slot_age", "slot_index"),
                                         "hisparse_swap_in": ("device_kv",)}


def mutated(op: str) -> tuple[str, ...]:
    """The arguments ``op`` writes in place, in schema order."""
    writes = (*OUTPUTS, *WRITES.get(op, ()))
    return tuple(n for n in inspect.signature(SPECS[op].check).parameters if n in writes)


# A spec check's annotation of an argument taking one tensor or a list of them (the HiSparse swap-in's KV of one layer
# or of a producer group's layers): ``Tensor[]`` in the schema, one tensor passed as a list of one.
LAYERS = "torch.Tensor | Sequence[torch.Tensor]"


# What the spec records do not say, part 2: the outputs a public op returns where they are not ``out`` alone (the
# quantized keys and their scales, ``gather_index_k``'s keys and scales; the HiSparse plan's slots, copies and state,
# which the public op wraps in a ``Plan``; the layer's KV a swap-in wrote).
RESULTS: Mapping[str, tuple[str, ...]] = {
    "quantize_index_k": ("out", "out_scale"),
    "gather_index_k": ("out_k", "out_scale"),
    "hisparse_plan": ("out", "out_copy_src", "out_copy_dst", "out_copy_count", "slot_token", "slot_age"),
    "hisparse_swap_in": ("device_kv",),
}


def result(op: str, args: Mapping[str, Any]) -> Any:
    """What the public op ``op`` returns after writing its outputs (``args``: its checked arguments): its
    :data:`RESULTS` (a tuple of several, the tensor of one), else ``out`` (None for an op without one)."""
    names = RESULTS.get(op)
    if not names:
        return args.get("out")
    return tuple(args[n] for n in names) if len(names) > 1 else args[names[0]]


def _arg_type(op: str, param: inspect.Parameter, alias: str) -> str:
    annotation = param.annotation if isinstance(param.annotation, str) else getattr(param.annotation, "__name__", "")
    if annotation == LAYERS:
        return f"Tensor({alias}!)[]" if alias else "Tensor[]"
    if alias:
        return f"Tensor({alias}!)" + ("?" if param.name in OPTIONAL_OUTPUTS else "")
    if annotation == "int":
        return "SymInt"
    if annotation == "int | None":
        return "SymInt?"
    if annotation == "bool":
        return "bool"
    if annotation == "torch.dtype | None":
        return "ScalarType?"
    if param.default is None:
        return "Tensor?"
    if param.default is inspect.Parameter.empty:
        return "Tensor"
    raise TypeError(f"indexcache.hal.library: no schema type for {op}'s argument {param.name!r}")


def arg_names(op: str) -> tuple[str, ...]:
    """The custom op's arguments in order: the spec check's parameters, then ``backend`` (and ``sm_budget`` for the
    ops of :data:`BUDGETED_OPS`), then ``e8m0``: the positions of the float8_e8m0fnu tensors passed as uint8 views
    (:func:`op_arguments`)."""
    return (*PARAMS[op], "backend", *_budget_arg(op), "e8m0")


def _budget_arg(op: str) -> tuple[str, ...]:
    return ("sm_budget",) if op in BUDGETED_OPS else ()


def _schema_args(op: str, aliases: Mapping[str, str]) -> list[str]:
    params = inspect.signature(SPECS[op].check).parameters.values()
    return [f"{_arg_type(op, p, aliases.get(p.name, ''))} {p.name}" for p in params]


def schema(op: str) -> str:
    """The ``torch.library`` schema of ``op`` (without its name), derived from its spec check's signature."""
    args = _schema_args(op, dict(zip(mutated(op), "abcdefgh", strict=False)))
    extra = ["str? backend", *(f"SymInt? {name}" for name in _budget_arg(op)), "int[] e8m0=[]"]
    return f"({', '.join([*args, *extra])}) -> ()"


def check_schema(op: str) -> str:
    """The schema of ``check_<op>``: the spec check's parameters, every one read-only, returning nothing."""
    return f"({', '.join(_schema_args(op, {}))}) -> ()"


# Inductor cannot lower an op that writes in place (an auto-functionalized custom op) one of whose tensors is
# float8_e8m0fnu (torch 2.13: "auto_functionalized_v2 was not removed"). So the MXFP4 block scales cross the custom
# op as uint8 views, and its last argument, ``e8m0``, gives their positions among the spec check's parameters: the op
# views them back before its check. A caller of ``torch.ops.indexcache.<op>`` may leave it out (no views). An e8m0
# tensor the op writes that is an input of the compiled graph (a given ``out_scale``) still fails there: Inductor
# writes it back with a kernel of that dtype, which it cannot generate (docs/ops.md, "Under torch.compile").

def _unpacked(op: str, args: tuple) -> dict[str, Any]:
    """The custom op's positional ``args`` by name, ``e8m0`` popped and the tensors it names viewed back as
    float8_e8m0fnu (the comment above); a caller that leaves ``e8m0`` out gives none."""
    kwargs = dict(zip(ARGS[op], args if len(args) == len(ARGS[op]) else (*args, ()), strict=True))
    for i in kwargs.pop("e8m0"):
        name = PARAMS[op][i]
        if not isinstance(kwargs[name], torch.Tensor) or kwargs[name].dtype != torch.uint8:
            raise TypeError(f"{op}: e8m0 names {name!r}, which must then come as a uint8 view of a float8_e8m0fnu "
                            f"tensor, got {getattr(kwargs[name], 'dtype', type(kwargs[name]).__name__)}")
        kwargs[name] = kwargs[name].view(torch.float8_e8m0fnu)
    return kwargs


_HERE = contextlib.nullcontext()  # stateless: one serves every call on the current GPU


def _real(op: str) -> Callable[..., Any]:
    check = SPECS[op].check

    def run(*args):
        kwargs = _unpacked(op, args)
        backend = kwargs.pop("backend")
        # The real tensors are here: the full check (the memory-overlap one included), then the backend that
        # dispatch picks now, at run time, under the call's SM budget (else the setting in force now), with the
        # tensors' GPU current, as an eager call runs (a graph run without Inductor's device guard, aot_eager, or
        # torch.ops.indexcache.<op> called directly, may come with another GPU current).
        index = device.other_gpu(args[0])
        with (_HERE if index is None else torch.cuda.device(index)), budget.scoped(kwargs.pop("sm_budget", None)):
            dispatch.call(op, check(**kwargs), backend)

    run.__name__ = f"{op}_impl"
    return run


def _fake(op: str) -> Callable[..., Any]:
    check = SPECS[op].check

    def fake(*args):
        kwargs = _unpacked(op, args)
        kwargs.pop("backend")
        kwargs.pop("sm_budget", None)
        # The spec check on fake tensors (metadata only): what tracing and torch.export see refused is what the
        # real implementation refuses, with the same error.
        check(**kwargs)

    fake.__name__ = f"{op}_fake"
    return fake


def _check_only(op: str) -> Callable[..., None]:
    names = PARAMS[op]
    check = SPECS[op].check

    def run(*args):
        check(**dict(zip(names, args, strict=True)))

    run.__name__ = f"check_{op}"
    return run


def _register() -> dict[str, Any]:
    ops = {}
    for op in SPECS:
        custom = torch.library.custom_op(f"{NAMESPACE}::{op}", _real(op), mutates_args=mutated(op), schema=schema(op))
        custom.register_fake(_fake(op))
        ops[op] = getattr(getattr(torch.ops, NAMESPACE), op).default
    return ops


def _register_checks() -> dict[str, Any]:
    # Defined through a Library rather than custom_op: a plain kernel, a third of custom_op's host cost per call.
    checks = {}
    for op in SPECS:
        if not mutated(op):
            continue
        name = f"check_{op}"
        _CHECKS_LIBRARY.define(name + check_schema(op))
        _CHECKS_LIBRARY.impl(name, _check_only(op), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _check_only(op), lib=_CHECKS_LIBRARY)
        checks[op] = getattr(getattr(torch.ops, NAMESPACE), name).default
        torch.fx.node.has_side_effect(checks[op])  # it returns nothing: dead-code elimination must keep it
    return checks


_CHECKS_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


# Each op's spec-check parameters (its arguments before ``backend``) and all its argument names, computed once
# (Dynamo traces :func:`compiled_call`; it must not run ``inspect``).
PARAMS: dict[str, tuple[str, ...]] = {op: tuple(inspect.signature(SPECS[op].check).parameters) for op in SPECS}
ARGS: dict[str, tuple[str, ...]] = {op: arg_names(op) for op in SPECS}
# Each op's parameters of type ``Tensor[]`` (:data:`LAYERS`).
LIST_PARAMS: dict[str, tuple[str, ...]] = {
    op: tuple(p.name for p in inspect.signature(SPECS[op].check).parameters.values() if p.annotation == LAYERS)
    for op in SPECS}
# The registered ops by name (``torch.ops.indexcache.<op>.default``).
OPS: dict[str, Any] = _register()
# Per op that writes in place, its read-only check op (``torch.ops.indexcache.check_<op>.default``).
CHECKS: dict[str, Any] = _register_checks()


def op_values(op: str, args: Mapping[str, Any]) -> list[Any]:
    """The spec check's parameters from its ``args``, in order, a tensor given for a ``Tensor[]`` parameter
    (:data:`LIST_PARAMS`) as a list of one: the arguments of ``check_<op>`` (:data:`CHECKS`)."""
    return [[args[n]] if n in LIST_PARAMS[op] and isinstance(args[n], torch.Tensor) else args[n] for n in PARAMS[op]]


def op_arguments(op: str, args: Mapping[str, Any], backend: str | None, sm_budget: int | None = None) -> list[Any]:
    """The custom op's arguments from the spec check's ``args``: :func:`op_values` with each float8_e8m0fnu tensor as
    a uint8 view, ``backend``, ``sm_budget`` for a budgeted op, and the positions of those views (``e8m0``)."""
    values = op_values(op, args)
    e8m0 = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.dtype == torch.float8_e8m0fnu]
    for i in e8m0:
        values[i] = values[i].view(torch.uint8)
    return [*values, backend, *([budget.check(sm_budget)] if op in BUDGETED_OPS else []), e8m0]


def compiled_call(op: str, args: Mapping[str, Any], backend: str | None, sm_budget: int | None = None) -> Any:
    """Call the custom op ``op`` with the spec check's ``args`` (what a traced wrapper does), ``backend`` and, for a
    budgeted op, ``sm_budget``; returns what the public op returns (:func:`result`): ``out`` for the ops that write one,
    the outputs :data:`RESULTS` names for the others, None for ``store_index_k``."""
    arguments = op_arguments(op, args, backend, sm_budget)
    if op in CHECKS:
        CHECKS[op](*op_values(op, args))
    OPS[op](*arguments)
    return result(op, args)
