"""``indexcache warmup``: every Triton kernel variant a deployment of a model can launch, listed or compiled ahead.

A deployment is a :class:`~indexcache.plan.LayerPlan` (index heads, head dim, top-k, the index cache's key format,
fp8 or MXFP4, its page size) served on one GPU architecture: decode steps of 1 to ``max_batch`` requests with
contexts up to ``max_context`` and 1 to ``max_next_n`` tokens a request (MTP drafts), and prefill chunks of up to
``max_prefill`` tokens over up to ``max_context`` keys, through the calls :mod:`indexcache.runtime` makes
(``TopkState``):

- decode: ``store_index_k`` of the step's keys (bf16), ``paged_topk_translate`` (producers; ``out`` and ``out_raw``
  given, the logits buffer given), ``translate`` (shared layers; ``row_to_batch`` when next_n > 1);
- on an MXFP4 index cache, each producer's logits also with MXFP4 queries (``q_scale``: the form DeepGEMM's SM100
  FP4 path and vLLM's DeepSeek-V4 indexer take, docs/fp4.md "Queries");
- prefill: ``store_index_k`` of the chunk's keys, ``gather_index_k`` of the request's keys from the cache (the small
  model's way) or ``quantize_index_k`` of the keys it scores (an engine's own; one block a head dim, MXFP4: blocks of
  32), ``mqa_logits``, ``topk_translate`` (``row_starts``, ``row_to_batch``, ``out_raw`` given), the same in one op
  (``mqa_topk_translate``, in passes within its default scratch bound; the runtime's ``PrefillLogits``), ``translate``
  (``row_to_batch``).

Which variant a launch compiles depends on those facts and on a bounded set of shape classes, never on the exact
batch, context or token count (docs/kernels.md, "Kernel variants"). So each size takes a few values per power of two
(1, 2, 3, every power of two and the number one past it, and the limit), which meets every class the launch builders
tell apart, and the variants are what those shapes' launches compile, told apart by Triton's own key. Past the
classes the count does not grow with ``max_batch`` or ``max_context``. Contiguous tensors from allocations (16-byte
aligned) are assumed, as the runtime passes them; a view at an unaligned address is a variant of its own.

Compiling goes through each kernel's own ``JITFunction.warmup`` in worker processes (the backend's
``variants.warm``), into Triton's cache (``TRITON_CACHE_DIR``); :func:`warmup` then loads each kernel into the
calling process on this machine's GPU, so that an engine that warms at start, before capturing its CUDA graphs,
neither compiles nor loads at a first launch.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from indexcache.hal import fp4
from indexcache.hal.layout import token_bytes
from indexcache.hal.specs.mqa_topk_translate import DEFAULT_WORKSPACE_BYTES
from indexcache.plan import SERVING_LIMITS, LayerPlan

# Multiprocessors of each generation's largest data-center part (A100, A40, L40S, H100 SXM / H200, B200, RTX PRO
# 6000, MI300X / MI325X, MI355X): the top-k's split decision counts them; a GPU that is present gives its own.
DEFAULT_SMS = {"sm80": 108, "sm86": 84, "sm89": 142, "sm90": 132, "sm100": 148, "sm120": 188, "gfx942": 304,
               "gfx950": 256}
DEFAULTS = {"max_batch": 256, "max_context": 131072, "max_next_n": 2, "max_prefill": 8192}
K_DTYPE = torch.bfloat16  # the indexer's keys before quantization (the models' activations)


def shape_points(limit: int) -> list[int]:
    """The sizes tried up to ``limit``: 1, 2, 3, each power of two and the number one past it, and ``limit``."""
    if limit < 1:
        raise ValueError(f"limit: expected a size >= 1, got {limit}")
    found = {1, 2, 3, limit}
    p = 4
    while p <= limit:
        found |= {p, p + 1}
        p *= 2
    return sorted(n for n in found if n <= limit)


def _meta(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _cache_pages(pages: int, page_size: int) -> int:
    """Pages of the index cache a call sees: its own and one more, at most 2^30 tokens (a cache's token count, as
    the store's slot count, stays a 32-bit int)."""
    return min(pages + 1, 2**30 // page_size)


def _key_format(plan: LayerPlan, fp8: torch.dtype) -> torch.dtype:
    """The index cache's key format: MXFP4 where the plan says so, else the target's fp8 format ``fp8``."""
    return fp4.FP4 if plan.index_dtype == "float4_e2m1fn_x2" else fp8


def _fp4_queries(*rows: int) -> dict[str, torch.Tensor]:
    """MXFP4 queries ``[*rows, D / 2]`` and their scales ``[*rows, D / 32]`` (``rows`` ends with the heads and D)."""
    *lead, dim = rows
    return dict(q=_meta(*lead, dim // 2, dtype=fp4.FP4), q_scale=_meta(*lead, dim // fp4.BLOCK, dtype=fp4.E8M0))


def decode_calls(plan: LayerPlan, page_size: int, fp8: torch.dtype, batch: int, context: int,
                 next_n: int) -> list[tuple[str, dict[str, Any]]]:
    """The op calls of one decode step of ``batch`` requests of ``context`` keys, ``next_n`` tokens each (queries in
    ``fp8``; the cache in the plan's key format)."""
    heads, dim, k = plan.index_n_heads, plan.index_head_dim, plan.top_k
    rows, pages = batch * next_n, -(-context // page_size)
    keys = _key_format(plan, fp8)
    cache = _meta(_cache_pages(batch * pages, page_size), page_size * token_bytes(dim, keys), dtype=torch.uint8)
    table = _meta(batch, pages)
    producer = dict(q=_meta(batch, next_n, heads, dim, dtype=fp8), k_cache=cache,
                    weights=_meta(rows, heads, dtype=torch.float32), context_lens=_meta(batch), block_table=table,
                    max_context_len=context, k=k, page_table=table, page_size=page_size,
                    logits=_meta(rows, context, dtype=torch.float32), out=_meta(rows, k), out_raw=_meta(rows, k),
                    **({"k_format": keys} if keys == fp4.FP4 else {}))
    return [
        ("store_index_k", dict(k=_meta(rows, dim, dtype=K_DTYPE), k_cache=cache, slot_mapping=_meta(rows),
                               fp8_dtype=keys)),
        ("paged_topk_translate", producer),
        *([("paged_topk_translate", dict(producer, **_fp4_queries(batch, next_n, heads, dim)))]
          if keys == fp4.FP4 else []),
        ("translate", dict(raw=_meta(rows, k), page_table=table, seq_lens=_meta(rows), page_size=page_size,
                           row_to_batch=_meta(rows) if next_n > 1 else None, out=_meta(rows, k))),
    ]


def prefill_calls(plan: LayerPlan, page_size: int, fp8: torch.dtype, tokens: int,
                  keys: int) -> list[tuple[str, dict[str, Any]]]:
    """The op calls of one prefill chunk of ``tokens`` query tokens over ``keys`` keys (``keys >= tokens``; queries
    in ``fp8``, keys in the plan's key format)."""
    heads, dim, k = plan.index_n_heads, plan.index_head_dim, plan.top_k
    pages = -(-keys // page_size)
    fmt = _key_format(plan, fp8)
    cache = _meta(_cache_pages(pages, page_size), page_size * token_bytes(dim, fmt), dtype=torch.uint8)
    table = _meta(1, pages)
    ks, ke = _meta(tokens), _meta(tokens)
    scores = _meta(tokens, keys, dtype=torch.float32)
    if fmt == fp4.FP4:  # two values a byte, an e8m0 scale every 32
        k_keys, k_scale, block = _meta(keys, dim // 2, dtype=fmt), _meta(keys, dim // fp4.BLOCK, dtype=fp4.E8M0), 32
    else:
        k_keys, k_scale, block = _meta(keys, dim, dtype=fmt), _meta(keys, 1, dtype=torch.float32), dim
    gathered = dict(out_k=_meta(keys, dim // 2, dtype=fmt) if fmt == fp4.FP4 else _meta(keys, dim, dtype=fmt),
                    out_scale=k_scale if fmt == fp4.FP4 else _meta(keys, dtype=torch.float32))
    logits = dict(q=_meta(tokens, heads, dim, dtype=fp8), k=k_keys,
                  k_scale=k_scale if fmt == fp4.FP4 else _meta(keys, dtype=torch.float32),
                  weights=_meta(tokens, heads, dtype=torch.float32), ks=ks, ke=ke, out=scores)
    producer = dict(q=logits["q"], k=k_keys, k_scale=logits["k_scale"], weights=logits["weights"], ks=ks, ke=ke,
                    topk=k, page_table=table, page_size=page_size, row_to_batch=_meta(tokens), out=_meta(tokens, k),
                    out_raw=_meta(tokens, k), workspace_bytes=DEFAULT_WORKSPACE_BYTES)
    return [
        ("store_index_k", dict(k=_meta(tokens, dim, dtype=K_DTYPE), k_cache=cache, slot_mapping=_meta(tokens),
                               fp8_dtype=fmt)),
        ("gather_index_k", dict(k_cache=cache, block_table=table, context_lens=_meta(1), dim=dim, fp8_dtype=fmt,
                                **gathered)),
        ("quantize_index_k", dict(k=_meta(keys, dim, dtype=K_DTYPE), fp8_dtype=fmt, block=block, out=k_keys,
                                  out_scale=k_scale)),
        ("mqa_logits", logits),
        ("topk_translate", dict(scores=scores, lengths=_meta(tokens), k=k, page_table=table, page_size=page_size,
                                row_starts=ks, row_to_batch=_meta(tokens), out=_meta(tokens, k),
                                out_raw=_meta(tokens, k))),
        ("mqa_topk_translate", producer),
        *([("mqa_logits", dict(logits, **_fp4_queries(tokens, heads, dim))),
           ("mqa_topk_translate", dict(producer, **_fp4_queries(tokens, heads, dim)))] if fmt == fp4.FP4 else []),
        ("translate", dict(raw=_meta(tokens, k), page_table=table, seq_lens=_meta(tokens), page_size=page_size,
                           row_to_batch=_meta(tokens), out=_meta(tokens, k))),
    ]


def serving_calls(plan: LayerPlan, fp8: torch.dtype, *, page_size: int, max_batch: int, max_context: int,
                  max_next_n: int, max_prefill: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every op call of the deployment at the sizes of :func:`shape_points` (module docstring)."""
    contexts = shape_points(max_context)
    for batch in shape_points(max_batch):
        for context in contexts:
            for next_n in range(1, max_next_n + 1):
                yield from decode_calls(plan, page_size, fp8, batch, context, next_n)
    for tokens in shape_points(max_prefill):
        for keys in (n for n in contexts if n >= tokens):
            yield from prefill_calls(plan, page_size, fp8, tokens, keys)


@dataclass(frozen=True)
class Warmup:
    """What :func:`warmup` found: the ``target`` architecture, its ``variants``
    (``indexcache.backends.triton.variants.Variant``, one line each by ``line()``), each one's compile ``seconds``
    (None when only listed) and the ``wall`` seconds it all took."""

    target: str
    variants: list
    seconds: list[float] | None
    wall: float


def _device_arch() -> tuple[str, str]:
    """``(backend, arch)`` of this machine's GPU, as its backend detects it (``INDEXCACHE_*_ARCH`` honoured)."""
    from indexcache.backends.triton.target import detect, vendors

    for name, vendor in vendors().items():
        ok, _, found = detect(vendor)
        if ok and found is not None and not found.interpreted:
            return name, found.arch
    raise ValueError("arch: no GPU is visible here; name the target architecture (e.g. 'sm90' or 'gfx942')")


def _backend(arch: str) -> str:
    if arch.startswith("sm"):
        return "cuda"
    if arch.startswith("gfx"):
        return "rocm"
    raise ValueError(f"arch: expected an NVIDIA ('sm90', ...) or AMD ('gfx942', ...) architecture, got {arch!r}")


def _sms(arch: str, present: bool) -> int:
    from indexcache.hal.device import sm_count

    if present:
        return sm_count(0)
    generation = arch.rstrip("af")
    if generation not in DEFAULT_SMS:
        raise ValueError(f"sms: no default multiprocessor count for {arch!r} (known: {', '.join(DEFAULT_SMS)}); "
                         "give it")
    return DEFAULT_SMS[generation]


def _prepare_calls() -> None:
    """What the first public op call of a process does once, done now: the ops imported (their custom ops registered
    with torch.library) and the dispatch prepared."""
    import indexcache.hal.ops  # noqa: F401  (registers the custom ops)
    from indexcache.hal import dispatch

    dispatch.prepare()


def _check_cache_dir() -> None:
    """Raise ValueError unless Triton's cache directory (``TRITON_CACHE_DIR``) can be made and written: checked before
    the first compile, which would otherwise fail in a worker process part of the way through."""
    import tempfile

    from triton import knobs

    directory = knobs.cache.dir
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"TRITON_CACHE_DIR: Triton's cache directory {directory} cannot be written ({reason}); set "
                         "TRITON_CACHE_DIR to a writable directory") from None


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        high = SERVING_LIMITS.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (high and value > high):
            raise ValueError(f"{name}: expected an int {f'in [1, {high}]' if high else '>= 1'}, got {value!r}")


def warmup(plan: LayerPlan, *, arch: str | None = None, page_size: int | None = None,
           max_batch: int = DEFAULTS["max_batch"], max_context: int = DEFAULTS["max_context"],
           max_next_n: int = DEFAULTS["max_next_n"], max_prefill: int = DEFAULTS["max_prefill"],
           sms: int | None = None, compile: bool = True, load: bool = True, jobs: int | None = None,
           progress: Callable[[int, int, Any, float], None] | None = None) -> Warmup:
    """Every Triton kernel variant a deployment of ``plan`` can launch on ``arch`` (default: this machine's GPU),
    compiled into Triton's cache unless ``compile`` is False (listing needs no GPU, for any ``arch``, and runs under
    TRITON_INTERPRET=1 too; compiling does not).

    ``page_size``: the index cache's and the KV tables' tokens a page (default: the plan's); ``max_batch``,
    ``max_context``, ``max_next_n``, ``max_prefill``: the serving limits (module docstring); ``sms``: the GPU's
    multiprocessors (default: this GPU's, else :data:`DEFAULT_SMS`); ``load``: on this machine's GPU (no ``arch``
    given), also load each compiled kernel into this process and set up what a process's first op call sets up (the
    public ops registered, the backends probed and the chosen one's ops built:
    :func:`indexcache.hal.dispatch.prepare`), so that an engine's first calls neither compile, load nor set up;
    ``jobs``: compile worker processes (default: this machine's cores; started with ``spawn``, they import the main
    script again, so a script calling this at its top level needs ``if __name__ == "__main__":``);
    ``progress(done, total, variant, seconds)`` after each compile. Raises ValueError for a bad argument, for a
    plan whose index cache is bf16 (the paged decode ops read fp8 and MXFP4 caches only), and for compiling under
    TRITON_INTERPRET=1.
    """
    from indexcache.backends.triton import variants as kernel_variants
    from indexcache.backends.triton.crosscompile import gpu_target
    from indexcache.backends.triton.launcher import planning
    from indexcache.backends.triton.target import INTERPRET_ENV, interpreting

    if compile:
        if interpreting():
            raise ValueError(f"{INTERPRET_ENV}=1: Triton interprets the kernels here and compiles none; unset it "
                             "(listing them, compile=False or --list, takes it)")
        _check_cache_dir()
    start = time.perf_counter()
    page_size = plan.page_size if page_size is None else page_size
    _check_sizes(page_size=page_size, max_batch=max_batch, max_context=max_context, max_next_n=max_next_n,
                 max_prefill=max_prefill, **({} if sms is None else {"sms": sms}),
                 **({} if jobs is None else {"jobs": jobs}))
    if plan.index_dtype == "bfloat16":
        raise ValueError(f"plan: index_dtype {plan.index_dtype} is not handled: the paged decode ops read fp8 and "
                         "MXFP4 caches only")
    present = arch is None
    backend, arch = _device_arch() if present else (_backend(arch), arch)
    target = gpu_target(backend, arch)
    arch = target.arch  # its record's name: "gfx942" for the target ID "gfx942:sramecc+:xnack-"
    tuning = importlib.import_module(f"indexcache.backends.{backend}.tuning").tuning(arch)
    gpu = target.gpu.triton_target()
    if present:  # the driver's own target, as a launch here looks it up
        from triton.runtime.driver import driver

        gpu = driver.active.get_current_target()
    with planning(sms or _sms(arch, present)):
        launches = (launch for op, args in serving_calls(
            plan, target.fp8_dtype, page_size=page_size, max_batch=max_batch, max_context=max_context,
            max_next_n=max_next_n, max_prefill=max_prefill)
            for launch in kernel_variants.op_launches(op, args, target, tuning))
        found = kernel_variants.distinct(launches, gpu)
    seconds = None
    if compile:
        seconds = kernel_variants.warm(found, gpu, jobs or os.cpu_count() or 1, progress)
        if load and present:
            kernel_variants.load(found)
            _prepare_calls()
    return Warmup(arch, found, seconds, time.perf_counter() - start)
