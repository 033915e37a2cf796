"""The public ops of DESIGN.md. Each checks its arguments from metadata only (shapes, dtypes,
devices: never a device sync), allocates the output when none is given, and runs on the backend
that :mod:`indexcache.dispatch` picks.

All index tensors are int32 and -1 marks an empty slot, in inputs and outputs. Lengths that are
negative count as 0 (checking them would need a device sync). Bad arguments raise ``TypeError``
(wrong type or dtype) or ``ValueError`` (wrong shape, device or value) naming the argument, what
was expected and what came. ``k`` is at most :data:`MAX_TOPK` and ``page_size`` at most
:data:`MAX_PAGE_SIZE`; an ``out`` (or ``out_raw``) must not share memory with any input, with the
other output, or with itself (an expanded, stride-0 view).

Non-finite values, the same on every backend: ``quantize_index_k`` / ``store_index_k`` give a block
(a token) holding NaN or ±inf the scale NaN and zero fp8 values; the logits propagate NaN (a NaN in
``q``, ``k``, ``k_scale``, ``weights`` or a cache scale makes the logits it enters NaN, the ReLU keeps
it) and follow IEEE arithmetic for ±inf; :func:`topk` never selects NaN or -inf. Positions outside a
row's window are -inf whatever the inputs hold.
"""

from __future__ import annotations

import torch

from indexcache import dispatch
from indexcache.layout import FP8_DTYPES, cache_page_size

INDEX = torch.int32
SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KEY_DTYPES = (*FP8_DTYPES, torch.bfloat16)
FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
# The largest k: the shipped models select 512-2048; 65536 leaves room and bounds an output row at 256 KiB.
MAX_TOPK = 65536
# Slots are int32, so a page holds at most 2^31 - 1 tokens.
MAX_PAGE_SIZE = 2**31 - 1


def _names(dtypes) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def _tensor(name: str, t, dtypes, shape: tuple, device: torch.device | None = None) -> None:
    """Check ``t`` is a tensor of one of ``dtypes`` whose shape matches ``shape`` (None = any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_names(dtypes)}, got {_names([t.dtype])}")
    got = t.shape
    if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got, strict=True)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(got)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def _int(name: str, value, minimum: int, maximum: int | None = None, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}: expected an int {bounds}{why}, got {value}")
    return value


def _check_k(k) -> int:
    return _int("k", k, 0, MAX_TOPK, " (indexcache.ops.MAX_TOPK)")


def _check_page_size(page_size) -> int:
    return _int("page_size", page_size, 1, MAX_PAGE_SIZE, " (slots are int32)")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, end)`` a non-empty tensor's elements lie in."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' element ranges share memory (metadata only: never a device sync)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _check_output(name: str, out: torch.Tensor, inputs: dict) -> None:
    """``out`` must not write one element twice (a stride-0 view) nor share memory with any input."""
    if any(size > 1 and stride == 0 for size, stride in zip(out.shape, out.stride(), strict=True)):
        raise ValueError(f"{name}: expected a tensor whose elements have memory of their own, got an expanded view "
                         f"(shape {list(out.shape)}, strides {list(out.stride())})")
    for other, t in inputs.items():
        if isinstance(t, torch.Tensor) and _overlaps(out, t):
            raise ValueError(f"{name}: expected a tensor that shares no memory with the other tensor arguments, "
                             f"got one that overlaps {other}")


def _out(name: str, out, dtype, shape: tuple, device: torch.device, inputs: dict) -> torch.Tensor:
    """The output ``out`` checked (dtype, shape, device, no overlap with ``inputs``), or a new one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    _tensor(name, out, (dtype,), shape, device)
    _check_output(name, out, inputs)
    return out


def _check_cache(k_cache, dim_name: str, dim: int, device: torch.device) -> None:
    """The packed fp8 cache (:mod:`indexcache.layout`) for keys of ``dim`` elements (``dim_name``'s last
    dimension): uint8, on ``device``, a page shape that fits, contiguous, float32 scales 4-byte aligned."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dtype != torch.uint8:
        raise TypeError(f"k_cache: expected a uint8 torch.Tensor, got {getattr(k_cache, 'dtype', type(k_cache))}")
    if k_cache.device != device:
        raise ValueError(f"k_cache: expected a tensor on {device}, got one on {k_cache.device}")
    if dim == 0 or dim % 4:
        raise ValueError(f"{dim_name}: expected a last dimension that is a positive multiple of 4 (the packed "
                         f"cache keeps float32 scales after each page's keys), got {dim}")
    cache_page_size(k_cache, dim)
    if not k_cache.is_contiguous():
        raise ValueError("k_cache: expected a contiguous tensor, got a strided view")
    if k_cache.storage_offset() % 4:
        raise ValueError(f"k_cache: expected a view that starts at a multiple of 4 bytes (its scales are float32), "
                         f"got storage offset {k_cache.storage_offset()}")


def _check_translate_inputs(raw_shape, page_table, seq_lens, page_size, row_to_batch, device):
    rows = raw_shape[0]
    _tensor("page_table", page_table, (INDEX,), (None, None), device)
    _tensor("seq_lens", seq_lens, (INDEX,), (rows,), device)
    _check_page_size(page_size)
    if row_to_batch is not None:
        _tensor("row_to_batch", row_to_batch, (INDEX,), (rows,), device)


def translate(raw, page_table, seq_lens, page_size: int, *, row_to_batch=None, out=None, backend=None):
    """Logical → physical KV slots through a page table.

    ``raw [R, K]`` int32 logical token positions (-1 = empty); ``page_table [B, P]`` int32;
    ``seq_lens [R]`` int32, the visible length of each row; ``row_to_batch [R]`` int32 (identity
    when None). Returns ``out [R, K]`` int32 with
    ``out[r, j] = page_table[b, raw // page_size] * page_size + raw % page_size`` where
    ``b = row_to_batch[r]``, and -1 wherever raw < 0, raw ≥ seq_lens[r], the page is beyond the
    table, the entry is < 0 or b is out of range. With ``out`` given nothing new is returned.
    """
    _tensor("raw", raw, (INDEX,), (None, None))
    device = raw.device
    _check_translate_inputs(raw.shape, page_table, seq_lens, page_size, row_to_batch, device)
    inputs = dict(raw=raw, page_table=page_table, seq_lens=seq_lens, row_to_batch=row_to_batch)
    out = _out("out", out, INDEX, tuple(raw.shape), device, inputs)
    args = dict(raw=raw, page_table=page_table, seq_lens=seq_lens, page_size=page_size,
                row_to_batch=row_to_batch, out=out)
    return dispatch.call("translate", args, backend)


def _check_topk_inputs(scores, lengths, k, row_starts):
    _tensor("scores", scores, SCORE_DTYPES, (None, None))
    _tensor("lengths", lengths, (INDEX,), (scores.shape[0],), scores.device)
    _check_k(k)
    if row_starts is not None:
        _tensor("row_starts", row_starts, (INDEX,), (scores.shape[0],), scores.device)


def topk(scores, lengths, k: int, *, row_starts=None, out=None, sorted: bool = False, backend=None):
    """Per row, the k best positions of the window ``[row_starts[r], row_starts[r] + lengths[r])``.

    ``scores [R, N]`` float32/bfloat16/float16; ``lengths [R]`` int32; ``row_starts [R]`` int32
    (0 when None). Windows are clipped to the N columns. Returns ``out [R, k]`` int32, positions
    relative to the window start: rows with length ≤ k give ``0 .. len-1`` then -1 without looking
    at the scores; longer rows never select -inf or NaN (slots they would fill are -1); among
    equal scores the lower index wins. Order inside a row is unspecified unless ``sorted`` (score
    descending, then index ascending).
    """
    _check_topk_inputs(scores, lengths, k, row_starts)
    out = _out("out", out, INDEX, (scores.shape[0], k), scores.device,
               dict(scores=scores, lengths=lengths, row_starts=row_starts))
    args = dict(scores=scores, lengths=lengths, k=k, row_starts=row_starts, out=out, sorted=bool(sorted))
    return dispatch.call("topk", args, backend)


def topk_translate(scores, lengths, k: int, page_table, page_size: int, *, row_starts=None, row_to_batch=None,
                   out=None, out_raw=None, sorted: bool = False, backend=None):
    """The producer step: :func:`topk` and :func:`translate` in one pass.

    Returns ``out [R, k]`` int32 physical slots, equal to
    ``translate(topk(scores, lengths, k, row_starts=...), page_table, lengths, page_size,
    row_to_batch=...)``; when ``out_raw [R, k]`` int32 is given it receives the raw logical
    indices (what shared layers reuse).
    """
    _check_topk_inputs(scores, lengths, k, row_starts)
    device = scores.device
    _check_translate_inputs(scores.shape, page_table, lengths, page_size, row_to_batch, device)
    shape = (scores.shape[0], k)
    inputs = dict(scores=scores, lengths=lengths, page_table=page_table, row_starts=row_starts,
                  row_to_batch=row_to_batch)
    out = _out("out", out, INDEX, shape, device, dict(inputs, out_raw=out_raw))
    if out_raw is not None:
        _tensor("out_raw", out_raw, (INDEX,), shape, device)
        _check_output("out_raw", out_raw, inputs)
    args = dict(scores=scores, lengths=lengths, k=k, page_table=page_table, page_size=page_size,
                row_starts=row_starts, row_to_batch=row_to_batch, out=out, out_raw=out_raw, sorted=bool(sorted))
    return dispatch.call("topk_translate", args, backend)


def mqa_logits(q, k, k_scale, weights, ks, ke, *, out=None, backend=None):
    """Ragged prefill indexer logits.

    ``q [T, H, D]`` and ``k [N, D]`` of one dtype (float8_e4m3fn, float8_e4m3fnuz or bfloat16);
    ``k_scale [N]`` float32; ``weights [T, H]`` float32; ``ks, ke [T]`` int32, the key window of
    each query (clipped to ``[0, N)``). Returns ``out [T, N]`` float32 with
    ``out[t, n] = k_scale[n] * sum_h weights[t, h] * relu(q[t, h] . k[n])`` inside the window and
    -inf outside.
    """
    _tensor("q", q, KEY_DTYPES, (None, None, None))
    tokens, heads, dim = q.shape
    device = q.device
    _tensor("k", k, (q.dtype,), (None, dim), device)
    _tensor("k_scale", k_scale, (torch.float32,), (k.shape[0],), device)
    _tensor("weights", weights, (torch.float32,), (tokens, heads), device)
    _tensor("ks", ks, (INDEX,), (tokens,), device)
    _tensor("ke", ke, (INDEX,), (tokens,), device)
    out = _out("out", out, torch.float32, (tokens, k.shape[0]), device,
               dict(q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke))
    args = dict(q=q, k=k, k_scale=k_scale, weights=weights, ks=ks, ke=ke, out=out)
    return dispatch.call("mqa_logits", args, backend)


def paged_mqa_logits(q, k_cache, weights, context_lens, page_table, max_context_len: int, *, out=None,
                     backend=None):
    """Paged decode / speculative-verify indexer logits over the packed fp8 cache.

    ``q [B, next_n, H, D]`` float8_e4m3fn or float8_e4m3fnuz (the cache holds the same format);
    ``k_cache`` uint8, ``[num_pages, page_size, 1, D + 4]`` or ``[num_pages, page_size * (D + 4)]``
    (see :mod:`indexcache.layout`); ``weights [B * next_n, H]`` float32; ``context_lens [B]`` int32;
    ``page_table [B, P]`` int32. Returns ``out [B * next_n, max_context_len]`` float32: row
    ``b * next_n + j`` sees keys ``0 .. context_lens[b] - next_n + j``; later keys, keys whose page
    is beyond the table and keys whose table entry is < 0 or beyond the cache are -inf.
    """
    _tensor("q", q, FP8_DTYPES, (None, None, None, None))
    batch, next_n, heads, dim = q.shape
    device = q.device
    _check_cache(k_cache, "q", dim, device)
    _tensor("weights", weights, (torch.float32,), (batch * next_n, heads), device)
    _tensor("context_lens", context_lens, (INDEX,), (batch,), device)
    _tensor("page_table", page_table, (INDEX,), (batch, None), device)
    _int("max_context_len", max_context_len, 0)
    out = _out("out", out, torch.float32, (batch * next_n, max_context_len), device,
               dict(q=q, k_cache=k_cache, weights=weights, context_lens=context_lens, page_table=page_table))
    args = dict(q=q, k_cache=k_cache, weights=weights, context_lens=context_lens, page_table=page_table,
                max_context_len=max_context_len, out=out)
    return dispatch.call("paged_mqa_logits", args, backend)


def _check_fp8(fp8_dtype) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype: expected {_names(FP8_DTYPES)}, got {fp8_dtype}")


def quantize_index_k(k, fp8_dtype=torch.float8_e4m3fn, *, block: int = 128, backend=None):
    """Block-``block`` fp8 quantization with power-of-two scales.

    ``k [N, D]`` float32/bfloat16/float16 with D a multiple of ``block``. Returns
    ``(k_fp8 [N, D] fp8_dtype, scale [N, D // block] float32)`` with
    ``scale = 2 ** ceil(log2(max(amax, 1e-4) / fp8_max))`` per block (448 for e4m3fn, 240 for e4m3fnuz).
    """
    _tensor("k", k, FLOAT_INPUTS, (None, None))
    _check_fp8(fp8_dtype)
    _int("block", block, 1)
    if k.shape[1] % block:
        raise ValueError(f"k: expected a last dimension divisible by block={block}, got {k.shape[1]}")
    args = dict(k=k, fp8_dtype=fp8_dtype, block=block)
    return dispatch.call("quantize_index_k", args, backend)


def store_index_k(k, k_cache, slot_mapping, fp8_dtype=torch.float8_e4m3fn, *, backend=None) -> None:
    """Quantize ``k [N, D]`` (one power-of-two scale a token) into the packed cache, in place.

    ``slot_mapping [N]`` int32: token ``i`` goes to slot ``slot_mapping[i]`` (page
    ``slot // page_size``, offset ``slot % page_size``); slots < 0 or beyond the cache are skipped.
    """
    _tensor("k", k, FLOAT_INPUTS, (None, None))
    device = k.device
    _check_fp8(fp8_dtype)
    _check_cache(k_cache, "k", k.shape[1], device)
    _tensor("slot_mapping", slot_mapping, (INDEX,), (k.shape[0],), device)
    _check_output("k_cache", k_cache, dict(k=k, slot_mapping=slot_mapping))
    args = dict(k=k, k_cache=k_cache, slot_mapping=slot_mapping, fp8_dtype=fp8_dtype)
    dispatch.call("store_index_k", args, backend)
