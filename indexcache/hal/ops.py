"""The public ops. Each runs its spec record's checks (:mod:`indexcache.hal.specs`: metadata only, shapes,
dtypes, devices, never a device sync; the output allocated when none is given), then the backend that
:mod:`indexcache.hal.dispatch` picks.

All index tensors are int32 and -1 marks an empty slot, in inputs and outputs. Lengths that are
negative count as 0 (checking them would need a device sync). Bad arguments raise ``TypeError``
(wrong type or dtype) or ``ValueError`` (wrong shape, device or value) naming the argument, what
was expected and what came. ``k`` is at most :data:`MAX_TOPK` and ``page_size`` at most
:data:`MAX_PAGE_SIZE`; an ``out`` (or ``out_raw``) must not share memory with any input, with the
other output, or with itself (an expanded, stride-0 view, or any view whose elements overlap).

Non-finite values, the same on every backend: ``quantize_index_k`` / ``store_index_k`` give a block
(a token) holding NaN or ±inf the scale NaN and zero fp8 values; the logits propagate NaN (a NaN in
``q``, ``k``, ``k_scale``, ``weights`` or a cache scale makes the logits it enters NaN, the ReLU keeps
it) and follow IEEE arithmetic for ±inf; :func:`topk` never selects NaN or -inf. Positions outside a
row's window are -inf whatever the inputs hold.

Every op is also the ``torch.library`` custom op ``torch.ops.indexcache.<op>``
(:mod:`indexcache.hal.library`): in eager mode each function below runs its spec check and the backend
directly (the fast path, no custom-op machinery); under ``torch.compile`` it runs the check on the traced
tensors and calls the custom op, whose real implementation picks the backend when the graph runs.

Explicit backend choice (``backend=``, :func:`indexcache.use_backend`, ``INDEXCACHE_BACKEND``) that
cannot serve a call raises :class:`indexcache.hal.dispatch.BackendNotSupportedError` listing every reason.

:func:`topk`, :func:`topk_translate` and :func:`paged_topk_translate` take a device workspace: by default the
backend's own, kept for the calling thread's current stream; ``workspace=`` gives one of the caller's, of at least
:func:`workspace_bytes` bytes (docs/ops.md, "Workspace").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from indexcache.hal import budget, device, dispatch, hisparse, library, memo
from indexcache.hal.checks import FLOAT_INPUTS, INDEX, KEY_DTYPES, MAX_PAGE_SIZE, MAX_TOPK, SCORE_DTYPES
from indexcache.hal.specs import SPECS

# The checks' limits and dtypes, the workspace size query, then the ops: one function below per spec record.
__all__ = ["FLOAT_INPUTS", "INDEX", "KEY_DTYPES", "MAX_PAGE_SIZE", "MAX_TOPK", "SCORE_DTYPES", "workspace_bytes",
           *SPECS]
# The ops that take a device workspace (a ``workspace`` argument in their spec check).
WORKSPACE_OPS = tuple(op for op in SPECS if "workspace" in library.ARGS[op])
# The ops a call of which may run on the default workspace of its thread and stream (docs/ops.md, "Workspace"):
# those above when given none, and two that take no ``workspace=`` but may still scratch in it (``mqa_logits`` widening
# MXFP4 keys, ``hisparse_plan``). A kept call of these is kept per owner: replayed from another thread or stream it
# would share the first owner's scratch with that owner's own calls.
OWNED_OPS = frozenset((*WORKSPACE_OPS, "mqa_logits", "hisparse_plan"))


def _call(op: str, backend: str | None, keep: bool, args: tuple, named: dict, sm_budget: int | None = None):
    """One public call of ``op``: spec check ``SPECS[op].check(*args, **named)`` then the backend, under the call's
    ``sm_budget`` (:mod:`indexcache.hal.budget`; None: the setting in force).

    Eager, where ``keep`` (the caller gave every output), the call's signature (:mod:`indexcache.hal.memo`) is
    looked up first: the kept launches of an identical earlier call run instead (returning the given outputs,
    :func:`indexcache.hal.library.result`), and a call the backend can prepare is kept from the signature's second call
    on. A call on the backend's default workspace adds its owner (the calling thread and its current stream) to the
    signature: kept launches are bound to that owner's workspace; a budgeted op adds the budget in force. A call on
    a GPU other than the current one runs with that GPU current, as Triton launches on the current GPU. Under
    ``torch.compile``: the custom op ``torch.ops.indexcache.<op>``, which picks the backend when the graph runs."""
    if torch.compiler.is_compiling():
        if backend is not None and not isinstance(backend, str):  # the custom op's str? would fail on it unnamed
            raise dispatch.UnknownBackendError(f"backend: expected a backend's name (a str) or None, got "
                                               f"{type(backend).__name__} {backend!r}")
        return library.compiled_call(op, SPECS[op].check(*args, **named), backend, sm_budget)
    if (index := device.other_gpu(args[0])) is not None:  # the op's device: its first tensor's
        with torch.cuda.device(index):  # the launches, their streams and the default workspace are that GPU's
            return _call(op, backend, keep, args, named, sm_budget)
    budgeted = op in library.BUDGETED_OPS
    if budgeted:
        sm_budget = budget.check(sm_budget)
        if sm_budget is None:
            sm_budget = budget.current()
    key = None
    chosen = dispatch.explicit_choice(backend)
    if keep:
        params = (*args, *named.values())
        if op in OWNED_OPS and named.get("workspace") is None and isinstance(args[0], torch.Tensor):
            params += (device.workspace_owner(args[0]),)  # the default workspace: its owner is part of the key
        if budgeted:
            params += (sm_budget,)
        key = memo.signature(op, chosen, params)
    if key is not None and (launch := memo.get(key)) is not None:
        launch()
        return library.result(op, named)
    with budget.scoped(sm_budget if budgeted else None):
        checked = SPECS[op].check(*args, **named)
        name, impl = dispatch.resolve_choice(op, checked, chosen)
        dispatch.check_workspace_size(name, op, impl, checked)
        checked = dispatch.args_for(impl, checked)
        if key is None or impl.prepare is None or not memo.seen(key):
            return impl.fn(**checked)
        launch = impl.prepare(**checked)
    launch()
    memo.keep(key, launch)
    return library.result(op, checked)


def translate(raw, page_table, seq_lens, page_size: int, *, row_to_batch=None, out=None, backend=None):
    """Logical → physical KV slots through a page table.

    ``out[r, j] = page_table[b, raw // page_size] * page_size + raw % page_size`` with
    ``b = row_to_batch[r]``, and -1 wherever raw < 0, raw ≥ seq_lens[r], the page is beyond the
    table, the entry is < 0 or b is out of range. Never reads out of bounds, whatever the inputs hold.

    Parameters
    ----------
    raw : torch.Tensor
        ``[R, K]`` int32 logical token positions, -1 = empty (may be non-contiguous).
    page_table : torch.Tensor
        ``[B, P]`` int32 physical page of each logical page; entries < 0 are holes. A slot is an int32: an entry
        whose slots pass 2^31 - 1 (``entry * page_size``) wraps, on every backend as in the reference.
    seq_lens : torch.Tensor
        ``[R]`` int32, the visible length of each row.
    page_size : int
        Tokens a page, in ``[1, MAX_PAGE_SIZE]`` (``page_size=1`` with a token table is SGLang's
        ``req_to_token``).
    row_to_batch : torch.Tensor, optional
        ``[R]`` int32, the page-table row of each row (identity when None).
    out : torch.Tensor, optional
        ``[R, K]`` int32, written in place without allocating.
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    torch.Tensor
        ``[R, K]`` int32 physical slots (``out`` when given).

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, or an ``out`` sharing memory with an input.

    Examples
    --------
    >>> import torch, indexcache
    >>> raw = torch.tensor([[0, 63, 64, -1]], dtype=torch.int32)
    >>> table = torch.tensor([[10, 11]], dtype=torch.int32)
    >>> indexcache.translate(raw, table, torch.tensor([128], dtype=torch.int32), 64, backend="torch")
    tensor([[640, 703, 704,  -1]], dtype=torch.int32)
    """
    return _call("translate", backend, out is not None, (raw, page_table, seq_lens, page_size),
                 dict(row_to_batch=row_to_batch, out=out))


def topk(scores, lengths, k: int, *, row_starts=None, out=None, sorted: bool = False, workspace=None,
         sm_budget: int | None = None, backend=None):
    """Per row, the k best positions of the window ``[row_starts[r], row_starts[r] + lengths[r])``.

    Windows are clipped to the N columns start first: a window starts at ``row_starts[r]`` clamped to ``[0, N]`` and
    holds ``lengths[r]`` positions from there (a negative length none), as many as the columns left hold. A negative
    start therefore does not shorten the window: ``[-3, 5)`` is ``[0, 8)``, not the ``[0, 5)`` that :func:`mqa_logits`
    makes of a window ``[ks, ke) = [-3, 5)``; pass the clipped start and length (as :func:`mqa_topk_translate`
    does) to select within such a window. Rows with length ≤ k give ``0 .. len-1`` then -1 without
    looking at the scores; longer rows never select -inf or NaN (slots they would fill are -1); among
    equal scores the lower index wins. Order inside a row is unspecified unless ``sorted``.

    Parameters
    ----------
    scores : torch.Tensor
        ``[R, N]`` float32, bfloat16 or float16 (may be non-contiguous).
    lengths : torch.Tensor
        ``[R]`` int32 window lengths.
    k : int
        Positions a row, in ``[0, MAX_TOPK]``.
    row_starts : torch.Tensor, optional
        ``[R]`` int32 window starts (0 when None; negative counts as 0, past N as N).
    out : torch.Tensor, optional
        ``[R, k]`` int32, written in place without allocating.
    sorted : bool
        Order each row by score descending, then index ascending.
    workspace : torch.Tensor, optional
        1-D contiguous uint8 on the op's device, at least :func:`workspace_bytes` bytes, that the backend's kernels
        use as scratch (default: the backend's own, kept for the calling thread's current stream).
    sm_budget : int, optional
        Multiprocessors (compute units on AMD) its persistent kernels may use (default: the
        :func:`indexcache.sm_budget` setting in force, else the whole device; docs/streams.md).
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    torch.Tensor
        ``[R, k]`` int32 positions relative to the window start, -1 = empty (``out`` when given).

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, or an ``out`` sharing memory with an input.

    Examples
    --------
    >>> import torch, indexcache
    >>> scores = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.3, 0.2, 0.0, 0.0]])
    >>> indexcache.topk(scores, torch.tensor([4, 2], dtype=torch.int32), 2, sorted=True, backend="torch")
    tensor([[1, 3],
            [0, 1]], dtype=torch.int32)
    """
    return _call("topk", backend, out is not None, (scores, lengths, k),
                 dict(row_starts=row_starts, out=out, sorted=sorted, workspace=workspace), sm_budget=sm_budget)


def topk_translate(scores, lengths, k: int, page_table, page_size: int, *, row_starts=None, row_to_batch=None,
                   out=None, out_raw=None, sorted: bool = False, workspace=None, sm_budget: int | None = None,
                   backend=None):
    """The producer step: :func:`topk` and :func:`translate` in one pass.

    Equal to ``translate(topk(scores, lengths, k, row_starts=...), page_table, lengths, page_size,
    row_to_batch=...)``.

    Parameters
    ----------
    scores, lengths, k, row_starts, sorted
        As :func:`topk`.
    page_table, page_size, row_to_batch
        As :func:`translate`; ``lengths`` are the rows' visible lengths.
    out : torch.Tensor, optional
        ``[R, k]`` int32 for the physical slots, written in place without allocating.
    out_raw : torch.Tensor, optional
        ``[R, k]`` int32 that receives the raw logical indices (what shared layers reuse).
    workspace : torch.Tensor, optional
        1-D contiguous uint8 on the op's device, at least :func:`workspace_bytes` bytes, that the backend's kernels
        use as scratch (default: the backend's own, kept for the calling thread's current stream).
    sm_budget : int, optional
        Multiprocessors (compute units on AMD) its persistent kernels may use (default: the
        :func:`indexcache.sm_budget` setting in force, else the whole device; docs/streams.md).
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    torch.Tensor
        ``[R, k]`` int32 physical slots, -1 = empty (``out`` when given).

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, or an output sharing memory with an input or the other output.

    Examples
    --------
    >>> import torch, indexcache
    >>> scores = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.3, 0.2, 0.0, 0.0]])
    >>> table = torch.tensor([[5, 6], [7, 8]], dtype=torch.int32)
    >>> indexcache.topk_translate(scores, torch.tensor([4, 2], dtype=torch.int32), 2, table, 2, sorted=True,
    ...                           backend="torch")
    tensor([[11, 13],
            [14, 15]], dtype=torch.int32)
    """
    return _call("topk_translate", backend, out is not None, (scores, lengths, k, page_table, page_size),
                 dict(row_starts=row_starts, row_to_batch=row_to_batch, out=out, out_raw=out_raw, sorted=sorted,
                      workspace=workspace), sm_budget=sm_budget)


def mqa_logits(q, k, k_scale, weights, ks, ke, *, q_scale=None, out=None, sm_budget: int | None = None,
               backend=None):
    """Ragged prefill indexer logits.

    ``out[t, n] = k_scale[n] * sum_h weights[t, h] * relu(q[t, h] . k[n])`` inside the window
    ``[ks[t], ke[t])`` (clipped to ``[0, N)``) and -inf outside.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, H, D]`` float8_e4m3fn, float8_e4m3fnuz or bfloat16; with MXFP4 keys also MXFP4 queries ``[T, H, D / 2]``
        float4_e2m1fn_x2 (with ``q_scale``).
    k : torch.Tensor
        ``[N, D]`` of ``q``'s dtype, or MXFP4 keys ``[N, D / 2]`` float4_e2m1fn_x2 with fp8 or MXFP4 ``q`` (as
        :func:`quantize_index_k` returns them).
    k_scale : torch.Tensor
        ``[N]`` float32; with MXFP4 keys their scales, ``[N, D / 32]`` float8_e8m0fnu.
    weights : torch.Tensor
        ``[T, H]`` float32.
    ks, ke : torch.Tensor
        ``[T]`` int32, the key window of each query.
    q_scale : torch.Tensor, optional
        MXFP4 queries' block scales, ``[T, H, D / 32]`` float8_e8m0fnu (docs/fp4.md, "Queries"); None for any other
        ``q`` (an fp8 query's scale belongs in ``weights``).
    out : torch.Tensor, optional
        ``[T, N]`` float32, written in place without allocating.
    sm_budget : int, optional
        Multiprocessors (compute units on AMD) its persistent kernels may use (default: the
        :func:`indexcache.sm_budget` setting in force, else the whole device; docs/streams.md).
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    torch.Tensor
        ``[T, N]`` float32 logits (``out`` when given).

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, or an ``out`` sharing memory with an input.

    Examples
    --------
    >>> import torch, indexcache
    >>> q = torch.ones(1, 1, 4).to(torch.float8_e4m3fn)
    >>> k = torch.tensor([[1.0, 1, 1, 1], [-1, -1, -1, -1], [2, 0, 0, 0]]).to(torch.float8_e4m3fn)
    >>> window = torch.tensor([0], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    >>> indexcache.mqa_logits(q, k, torch.ones(3), torch.tensor([[2.0]]), *window, backend="torch")
    tensor([[8., 0., -inf]])
    """
    return _call("mqa_logits", backend, out is not None, (q, k, k_scale, weights, ks, ke),
                 dict(q_scale=q_scale, out=out), sm_budget=sm_budget)


def paged_mqa_logits(q, k_cache, weights, context_lens, page_table, max_context_len: int, *, out=None,
                     k_format=None, row_to_batch=None, q_scale=None, sm_budget: int | None = None, backend=None):
    """Paged decode / speculative-verify indexer logits over the packed fp8 or MXFP4 cache.

    Row ``b * next_n + j`` sees keys ``0 .. context_lens[b] - next_n + j`` of table row ``b``; later keys, keys
    whose page is beyond the table and keys whose table entry is < 0 or beyond the cache are -inf. Ragged rows
    (``row_to_batch`` given: any mix of draft tokens a request in one call): ``q`` holds one token a row, and row
    ``r`` sees keys ``0 .. context_lens[r] - 1`` of table row ``row_to_batch[r]`` (a row naming no table row sees
    none).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, next_n, H, D]`` float8_e4m3fn or float8_e4m3fnuz (the cache holds the same format unless
        ``k_format`` names another), or on an MXFP4 cache MXFP4 queries ``[B, next_n, H, D / 2]`` float4_e2m1fn_x2
        (with ``q_scale``); ragged rows: ``[R, 1, H, D]``, B standing for R below.
    k_cache : torch.Tensor
        The packed cache (:mod:`indexcache.hal.layout`): uint8, contiguous, ``[num_pages, page_size, 1, D + 4]``
        or ``[num_pages, page_size * (D + 4)]``; D a positive multiple of 4. MXFP4 keys: ``D / 2 + D / 32`` bytes
        a token in place of ``D + 4`` (docs/fp4.md), D a multiple of 32.
    weights : torch.Tensor
        ``[B * next_n, H]`` float32.
    context_lens : torch.Tensor
        ``[B]`` int32 (ragged rows: each row's own visible length).
    page_table : torch.Tensor
        ``[B, P]`` int32 (ragged rows: ``[requests, P]``).
    max_context_len : int
        The output's columns, ≥ 0.
    out : torch.Tensor, optional
        ``[B * next_n, max_context_len]`` float32, written in place without allocating.
    k_format : torch.dtype, optional
        The cache's key format: None, ``q``'s fp8 format; ``torch.float4_e2m1fn_x2``, MXFP4 keys (as
        :func:`store_index_k` writes them), each decoded with its block scales in place of ``scale · key``.
    row_to_batch : torch.Tensor, optional
        ``[R]`` int32, ragged rows: each row's table row (its request).
    q_scale : torch.Tensor, optional
        MXFP4 queries' block scales, ``[B, next_n, H, D / 32]`` float8_e8m0fnu (docs/fp4.md, "Queries"); None for
        fp8 queries.
    sm_budget : int, optional
        Multiprocessors (compute units on AMD) its persistent kernels may use (default: the
        :func:`indexcache.sm_budget` setting in force, else the whole device; docs/streams.md).
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    torch.Tensor
        ``[B * next_n, max_context_len]`` float32 logits (``out`` when given).

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, or an ``out`` sharing memory with an input.

    Examples
    --------
    >>> import torch, indexcache
    >>> from indexcache.hal.layout import new_packed_cache
    >>> cache = new_packed_cache(num_pages=2, page_size=4, dim=128)
    >>> indexcache.store_index_k(torch.full((1, 128), 3.0), cache, torch.tensor([5], dtype=torch.int32),
    ...                          backend="torch")
    >>> q = torch.ones(1, 1, 1, 128).to(torch.float8_e4m3fn)
    >>> table = torch.tensor([[1, 0]], dtype=torch.int32)
    >>> indexcache.paged_mqa_logits(q, cache, torch.ones(1, 1), torch.tensor([3], dtype=torch.int32), table, 4,
    ...                             backend="torch")
    tensor([[  0., 384.,   0., -inf]])
    """
    return _call("paged_mqa_logits", backend, out is not None,
                 (q, k_cache, weights, context_lens, page_table, max_context_len),
                 dict(out=out, k_format=k_format, row_to_batch=row_to_batch, q_scale=q_scale), sm_budget=sm_budget)


def paged_topk_translate(q, k_cache, weights, context_lens, block_table, max_context_len: int, k: int, page_table,
                         page_size: int, *, logits=None, out=None, out_raw=None, workspace=None, k_format=None,
                         row_to_batch=None, q_scale=None, sm_budget: int | None = None, backend=None):
    """The producer step of decode in one op: :func:`paged_mqa_logits` then :func:`topk_translate` on its rows.

    Equal to ``paged_mqa_logits(q, k_cache, weights, context_lens, block_table, max_context_len, out=logits)``,
    then ``topk_translate(logits, lengths, k, page_table, page_size, row_to_batch=...)`` where row
    ``r = b * next_n + j`` has the visible length ``lengths[r] = context_lens[b] - next_n + 1 + j`` (negative
    counts as 0) and the table row ``b`` (``row_to_batch`` is ``r // next_n``, None when ``next_n`` is 1). Ragged
    rows (``row_to_batch`` given, ``q [R, 1, H, D]``): row ``r``'s length is ``context_lens[r]`` and its table row,
    in both tables, ``row_to_batch[r]``.

    Parameters
    ----------
    q, k_cache, weights, context_lens, max_context_len
        As :func:`paged_mqa_logits`: ``q [B, next_n, H, D]`` fp8 (or MXFP4 with ``q_scale``), the packed cache,
        ``weights [B * next_n, H]`` float32, ``context_lens [B]`` int32.
    block_table : torch.Tensor
        ``[B, P]`` int32, the index-K cache's page table (:func:`paged_mqa_logits`' ``page_table``).
    k : int
        Positions a row, in ``[0, MAX_TOPK]``.
    page_table : torch.Tensor
        ``[B, P2]`` int32, the sparse attention's KV page table (the draft rows of a request share its row);
        entries < 0 are holes.
    page_size : int
        Tokens a KV page, in ``[1, MAX_PAGE_SIZE]``.
    logits : torch.Tensor, optional
        ``[B * next_n, max_context_len]`` float32 that receives the logits, written in place (allocated when None).
        Rows the top-k selects without logits may be left unwritten: those of a request (a ragged row) whose
        context clipped to ``max_context_len`` is at most ``k`` (each of its rows then selects ``0 .. len - 1``);
        with ``max_context_len <= k`` no row is written (docs/ops.md, "Short rows").
    out : torch.Tensor, optional
        ``[B * next_n, k]`` int32 for the physical slots, written in place without allocating.
    out_raw : torch.Tensor, optional
        ``[B * next_n, k]`` int32 that receives the logical positions (what shared layers reuse).
    workspace : torch.Tensor, optional
        1-D contiguous uint8 on the op's device, at least :func:`workspace_bytes` bytes, that the backend's kernels
        use as scratch (default: the backend's own, kept for the calling thread's current stream).
    k_format : torch.dtype, optional
        As :func:`paged_mqa_logits`: None (``q``'s fp8 format) or ``torch.float4_e2m1fn_x2`` (an MXFP4 cache).
    row_to_batch : torch.Tensor, optional
        ``[R]`` int32, ragged rows: each row's request, its row of ``block_table`` and ``page_table``.
    q_scale : torch.Tensor, optional
        As :func:`paged_mqa_logits`: MXFP4 queries' block scales (on an MXFP4 cache), else None.
    sm_budget : int, optional
        Multiprocessors (compute units on AMD) its persistent kernels may use (default: the
        :func:`indexcache.sm_budget` setting in force, else the whole device; docs/streams.md).
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    torch.Tensor
        ``[B * next_n, k]`` int32 physical slots, -1 = empty (``out`` when given).

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, or an output sharing memory with an input or another output.

    Examples
    --------
    >>> import torch, indexcache
    >>> from indexcache.hal.layout import new_packed_cache
    >>> cache = new_packed_cache(num_pages=2, page_size=4, dim=128)
    >>> keys = torch.tensor([[1.0], [3.0], [2.0]]).expand(3, 128)
    >>> indexcache.store_index_k(keys, cache, torch.tensor([4, 5, 6], dtype=torch.int32), backend="torch")
    >>> q = torch.ones(1, 1, 1, 128).to(torch.float8_e4m3fn)
    >>> block_table = torch.tensor([[1, 0]], dtype=torch.int32)  # the index keys: cache page 1
    >>> page_table = torch.tensor([[7, 8]], dtype=torch.int32)  # the KV cache's pages
    >>> logits = torch.empty(1, 4)
    >>> out = indexcache.paged_topk_translate(q, cache, torch.ones(1, 1), torch.tensor([3], dtype=torch.int32),
    ...                                       block_table, 4, 2, page_table, 4, logits=logits, backend="torch")
    >>> logits
    tensor([[128., 384., 256., -inf]])
    >>> out.sort().values  # positions 1 and 2 on KV page 7
    tensor([[29, 30]], dtype=torch.int32)
    """
    return _call("paged_topk_translate", backend, out is not None and logits is not None,
                 (q, k_cache, weights, context_lens, block_table, max_context_len, k, page_table, page_size),
                 dict(logits=logits, out=out, out_raw=out_raw, workspace=workspace, k_format=k_format,
                      row_to_batch=row_to_batch, q_scale=q_scale), sm_budget=sm_budget)


def mqa_topk_translate(q, k, k_scale, weights, ks, ke, topk: int, page_table, page_size: int, *, row_to_batch=None,
                       out=None, out_raw=None, workspace=None, workspace_bytes: int | None = None, q_scale=None,
                       sm_budget: int | None = None, backend=None):
    """The producer step of prefill in one op, in bounded memory: :func:`mqa_logits` then :func:`topk_translate` over
    each query's key window, the ``[T, N]`` logits never written whole.

    With each window ``[ks[t], ke[t])`` clipped to ``[0, N)`` as :func:`mqa_logits` clips it (``starts`` its clipped
    start, ``lengths`` its clipped length), equal to ``topk_translate(mqa_logits(q, k, k_scale, weights, ks, ke),
    lengths, topk, page_table, page_size, row_starts=starts, row_to_batch=row_to_batch)``, exactly: the positions are
    relative to the window's start (a ragged batch: the request's first key), ties go to the lower position, rows
    whose window holds ``topk`` keys or fewer give ``0 .. length - 1`` then -1. The backend takes the queries in
    passes of as many rows as ``workspace_bytes`` (default 2 GiB) holds of their scratch: their logits, the top-k's
    workspace and the windows (docs/ops.md, "The prefill producer step"). Rows whose window holds at most ``topk``
    keys need no logits and get none; with ``N <= topk`` the call takes no scratch at all (docs/ops.md, "Short
    rows").

    Parameters
    ----------
    q, k, k_scale, weights, ks, ke
        As :func:`mqa_logits`: ``q [T, H, D]`` fp8 or bfloat16 (or MXFP4 with ``q_scale``), ``k [N, D]`` (or MXFP4
        keys), ``k_scale``, ``weights [T, H]`` float32, ``ks`` and ``ke [T]`` int32.
    topk : int
        Positions a query, in ``[0, MAX_TOPK]``.
    page_table : torch.Tensor
        ``[B, P]`` int32, the sparse attention's KV page table; entries < 0 are holes.
    page_size : int
        Tokens a KV page, in ``[1, MAX_PAGE_SIZE]``.
    row_to_batch : torch.Tensor, optional
        ``[T]`` int32, each query's row of ``page_table`` (its request; query ``t`` is row ``t`` when None).
    out : torch.Tensor, optional
        ``[T, topk]`` int32 for the physical slots, written in place without allocating.
    out_raw : torch.Tensor, optional
        ``[T, topk]`` int32 that receives the positions in the window (what shared layers reuse).
    workspace : torch.Tensor, optional
        1-D contiguous uint8 on the op's device, at least :func:`workspace_bytes` bytes for this call (and this
        ``workspace_bytes``), that the backend's kernels use as scratch (default: the backend's own, kept for the
        calling thread's current stream, of at most ``workspace_bytes``).
    workspace_bytes : int, optional
        The most bytes of scratch the call may take (default 2 GiB), ≥ 1: at least one query row's (its ``4 N`` bytes
        of logits and its top-k's workspace) where ``N > topk``, else ``ValueError``.
    q_scale : torch.Tensor, optional
        As :func:`mqa_logits`: MXFP4 queries' block scales ``[T, H, D / 32]`` (with MXFP4 keys), else None.
    sm_budget : int, optional
        Multiprocessors (compute units on AMD) its persistent kernels may use (default: the
        :func:`indexcache.sm_budget` setting in force, else the whole device; docs/streams.md).
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    torch.Tensor
        ``[T, topk]`` int32 physical slots, -1 = empty (``out`` when given).

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, a bound that holds no query row, or an output sharing memory with an input
        or the other output.

    Examples
    --------
    >>> import torch, indexcache
    >>> q = torch.ones(2, 1, 4).to(torch.float8_e4m3fn)
    >>> k = torch.tensor([[1.0, 1, 1, 1], [3, 3, 3, 3], [2, 2, 2, 2]]).to(torch.float8_e4m3fn)
    >>> ks, ke = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32)
    >>> table = torch.tensor([[5, 6], [7, 8]], dtype=torch.int32)  # each query's KV pages of 2 tokens
    >>> raw = torch.empty(2, 1, dtype=torch.int32)
    >>> indexcache.mqa_topk_translate(q, k, torch.ones(3), torch.ones(2, 1), ks, ke, 1, table, 2, out_raw=raw,
    ...                               backend="torch")
    tensor([[11],
            [14]], dtype=torch.int32)
    >>> raw  # key 1 is the best of both windows: position 1 of [0, 3), position 0 of [1, 3)
    tensor([[1],
            [0]], dtype=torch.int32)
    """
    return _call("mqa_topk_translate", backend, out is not None,
                 (q, k, k_scale, weights, ks, ke, topk, page_table, page_size),
                 dict(row_to_batch=row_to_batch, out=out, out_raw=out_raw, workspace=workspace,
                      workspace_bytes=workspace_bytes, q_scale=q_scale), sm_budget=sm_budget)


def quantize_index_k(k, fp8_dtype: torch.dtype | None = None, *, block: int | None = None, out=None, out_scale=None,
                     backend=None):
    """Block-``block`` fp8 quantization with power-of-two scales, or MXFP4.

    ``scale = 2 ** ceil(log2(max(amax, 1e-4) / fp8_max))`` per block (fp8_max is 448 for e4m3fn, 240 for
    e4m3fnuz), so every ``k / scale`` fits the format. With ``fp8_dtype=torch.float4_e2m1fn_x2`` (MXFP4, ``block``
    32): the same rule with 6, values rounded to the nearest e2m1 value, ties to even (docs/fp4.md).

    Parameters
    ----------
    k : torch.Tensor
        ``[N, D]`` float32, bfloat16 or float16, D a multiple of ``block``.
    fp8_dtype : torch.dtype, optional
        ``torch.float8_e4m3fn``, ``torch.float8_e4m3fnuz`` or ``torch.float4_e2m1fn_x2``; None (the default): the
        format of ``out`` where it is given in one of these, else the native fp8 format of ``k``'s device, e4m3fnuz
        on an MI300 (gfx942), e4m3fn elsewhere (the CPU, NVIDIA, gfx950).
    block : int, optional
        Elements a scale, ≥ 1; default 128 for fp8, and for MXFP4 32, the only size it takes.
    out, out_scale : torch.Tensor, optional
        The outputs, written in place without allocating: ``[N, D]`` in ``fp8_dtype`` and ``[N, D // block]``
        float32 (MXFP4: ``[N, D // 2]`` float4_e2m1fn_x2 and ``[N, D // 32]`` float8_e8m0fnu), each row's elements
        contiguous (stride 1 in the last dimension; rows of a wider buffer are fine). With both given a repeated
        eager call is kept (docs/ops.md, "Eager calls"), and a captured graph allocates nothing; a missing one is
        allocated.
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    tuple of torch.Tensor
        ``(k_fp8 [N, D] fp8_dtype, scale [N, D // block] float32)``; MXFP4: ``(values [N, D // 2]
        float4_e2m1fn_x2, scales [N, D // 32] float8_e8m0fnu)``: ``out`` and ``out_scale`` when given.

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape or value, an output whose rows are not contiguous, or one sharing memory with ``k`` or the
        other output.

    Examples
    --------
    >>> import torch, indexcache
    >>> k_fp8, scale = indexcache.quantize_index_k(torch.full((2, 256), 3.0), backend="torch")
    >>> scale  # 3 / 448 rounded up to a power of two: 2 ** -7
    tensor([[0.0078, 0.0078],
            [0.0078, 0.0078]])
    >>> k_fp8[0, :3].float()
    tensor([384., 384., 384.])
    """
    return _call("quantize_index_k", backend, out is not None and out_scale is not None, (k, fp8_dtype),
                 dict(block=block, out=out, out_scale=out_scale))


def store_index_k(k, k_cache, slot_mapping, fp8_dtype: torch.dtype | None = None, *, backend=None) -> None:
    """Quantize ``k`` (one power-of-two scale a token, as :func:`quantize_index_k` with ``block = D``; MXFP4: a scale
    every 32 elements) into the packed cache, in place.

    Parameters
    ----------
    k : torch.Tensor
        ``[N, D]`` float32, bfloat16 or float16.
    k_cache : torch.Tensor
        The packed cache (:mod:`indexcache.hal.layout`) for keys of D elements, as :func:`paged_mqa_logits`
        takes it (MXFP4: D / 2 + D / 32 bytes a token, docs/fp4.md); it must not share memory with the other
        arguments.
    slot_mapping : torch.Tensor
        ``[N]`` int32: token ``i`` goes to slot ``slot_mapping[i]`` (page ``slot // page_size``, offset
        ``slot % page_size``); slots < 0 or beyond the cache are skipped. Tokens mapped to one slot leave one of
        them there, which one unspecified (the GPU backends write in parallel: a token's values and its scales may
        then come from different tokens).
    fp8_dtype : torch.dtype, optional
        ``torch.float8_e4m3fn``, ``torch.float8_e4m3fnuz`` or ``torch.float4_e2m1fn_x2`` (MXFP4, D a multiple of
        32); None (the default): the native fp8 format of ``k``'s device, e4m3fnuz on an MI300 (gfx942), e4m3fn
        elsewhere (the CPU, NVIDIA, gfx950).
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, or a cache sharing memory with an input.

    Examples
    --------
    >>> import torch, indexcache
    >>> from indexcache.hal.layout import new_packed_cache, split_packed_cache
    >>> cache = new_packed_cache(num_pages=2, page_size=4, dim=128)
    >>> indexcache.store_index_k(torch.full((1, 128), 3.0), cache, torch.tensor([5], dtype=torch.int32),
    ...                          backend="torch")
    >>> keys, scales = split_packed_cache(cache, 128, torch.float8_e4m3fn)
    >>> scales  # slot 5: page 1, token 1
    tensor([[0.0000, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.0078, 0.0000, 0.0000]])
    """
    _call("store_index_k", backend, True, (k, k_cache, slot_mapping, fp8_dtype), {})


def gather_index_k(k_cache, block_table, context_lens, *, dim: int = 128, fp8_dtype: torch.dtype | None = None,
                   out_k=None, out_scale=None, backend=None):
    """The paged index-K cache's keys of every request, contiguous and in request order: the ``k`` and ``k_scale``
    :func:`mqa_logits` takes.

    Request ``b``'s token ``t < context_lens[b]`` goes to row ``start_b + t``, ``start_b`` the sum of the earlier
    requests' lengths (negative lengths count as 0), from slot ``t % page_size`` of page
    ``block_table[b, t // page_size]``. A page entry < 0 or past the cache, or a token past the table's columns, gives
    zero key bytes and a NaN scale (MXFP4: scale bytes 255), so its logits are NaN, which :func:`topk` never selects.
    Never reads out of bounds, whatever the table and the lengths hold.

    Parameters
    ----------
    k_cache : torch.Tensor
        The packed cache (:mod:`indexcache.hal.layout`) of keys of ``dim`` elements in ``fp8_dtype``, as
        :func:`paged_mqa_logits` reads it.
    block_table : torch.Tensor
        ``[B, P]`` int32, the cache page of each request's logical page.
    context_lens : torch.Tensor
        ``[B]`` int32, each request's tokens.
    dim : int
        Elements a key (default 128).
    fp8_dtype : torch.dtype, optional
        The cache's format: ``torch.float8_e4m3fn``, ``torch.float8_e4m3fnuz`` or ``torch.float4_e2m1fn_x2``
        (MXFP4, docs/fp4.md); None (the default): the format of ``out_k`` where it is given in one of these, else
        the native fp8 format of the cache's device, e4m3fnuz on an MI300 (gfx942), e4m3fn elsewhere (the CPU,
        NVIDIA, gfx950), as :func:`store_index_k` writes it by default.
    out_k, out_scale : torch.Tensor, optional
        The outputs, written in place without allocating: ``[N, dim]`` in ``fp8_dtype`` and ``[N]`` float32 (MXFP4:
        ``[N, dim / 2]`` ``torch.float4_e2m1fn_x2`` and ``[N, dim / 32]`` ``torch.float8_e8m0fnu``). Rows at or past
        the total of the lengths are left as they are; tokens whose row would be ``N`` or more are not written.
        Without them the call allocates ``N = sum(max(context_lens, 0))`` rows, which reads the lengths on the host
        (a device sync; not under CUDA-graph capture or ``torch.compile``); with one of them given, the other is
        allocated with its rows.
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``(k, k_scale)``: ``out_k`` and ``out_scale`` when given.

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, or an output sharing memory with an input or the other output.

    Examples
    --------
    >>> import torch, indexcache
    >>> from indexcache.hal.layout import new_packed_cache
    >>> cache = new_packed_cache(num_pages=4, page_size=2, dim=128)
    >>> indexcache.store_index_k(torch.arange(8.0)[:, None].expand(8, 128), cache,
    ...                          torch.arange(8, dtype=torch.int32), backend="torch")
    >>> table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)  # request 0: pages 3, 0; request 1: pages 1, 2
    >>> k, k_scale = indexcache.gather_index_k(cache, table, torch.tensor([3, 2], dtype=torch.int32),
    ...                                        backend="torch")
    >>> (k.float() * k_scale[:, None])[:, 0]  # slots 6, 7, 0, then 2, 3
    tensor([6., 7., 0., 2., 3.])
    """
    return _call("gather_index_k", backend, out_k is not None and out_scale is not None,
                 (k_cache, block_table, context_lens), dict(dim=dim, fp8_dtype=fp8_dtype, out_k=out_k,
                                                            out_scale=out_scale))


def hisparse_plan(raw, seq_lens, host_loc, slot_token, slot_age, *, row_to_batch=None, host_rows: int | None = None,
                  slot_index=None, out=None, out_copy_src=None, out_copy_dst=None, out_copy_count=None,
                  backend=None) -> hisparse.Plan:
    """One decode step's HiSparse plan: which selected tokens the hot buffer holds (hits), which are copied in from
    the host (misses) into which slots (the least recently used), and each selected position's slot. Rules:
    docs/hisparse.md. The state ``slot_token`` / ``slot_age`` is updated in place. No host sync: capturable in a
    CUDA graph with the outputs given.

    A position ``x`` of a row is valid when ``0 <= x < seq_lens[b]`` (``b`` the row's request); only valid positions
    are looked up, placed or copied, every other one gets slot -1. A request of ``n <= H`` tokens has token ``t`` at
    slot ``t`` (no copy, the state becomes that identity). A longer one has its newest token at slot ``H``; a token a
    slot holds keeps it; the others, in order of first appearance (rows ascending, then columns), take the slots not
    used this step (empty ones first, then the oldest, ties by the lower slot), one copy each, when their host row
    is valid; a miss left without a slot or a host row gets -1. Never reads or writes out of bounds, whatever the
    inputs hold.

    Parameters
    ----------
    raw : torch.Tensor
        ``[R, k]`` int32, the selected logical positions (a producer's ``out_raw``); -1 none.
    seq_lens : torch.Tensor
        ``[B]`` int32, each request's length, the token being decoded included.
    host_loc : torch.Tensor
        ``[B, L]`` int32 or int64, the host KV row of each token (token ``t >= L`` or a value < 0: not on the host).
    slot_token, slot_age : torch.Tensor
        ``[B, H]`` int32, contiguous: the state (:func:`indexcache.hal.hisparse.empty_state` for new requests),
        written in place. A request no row names is left as it was.
    row_to_batch : torch.Tensor, optional
        ``[R]`` int32, each row's request (default: row ``r`` is request ``r``). Rows of one request share its
        buffer (speculative decoding's verify rows); a row naming no request in ``[0, B)`` selects nothing.
    host_rows : int, optional
        The host KV tensor's rows: a host row at or past it counts as not on the host.
    slot_index : torch.Tensor, optional
        ``[B, W]`` int32, contiguous, ``W >= H + max(L, H)``: kept by the caller beside the state, any contents
        before its first use (``torch.empty``), never written by the caller after. The Triton backends keep in it a
        check word a slot (``indexcache.hal.slot_index``) and the slot of each token the state holds; a step
        whose live slots all match their words (the state the last step wrote) resolves only the selected tokens, not
        every slot's (docs/hisparse.md, "The slot index"); any other rebuilds it. The torch backend neither reads nor
        writes it. One a state: ``4 B W`` bytes.
    out, out_copy_src, out_copy_dst, out_copy_count : torch.Tensor, optional
        The outputs, written in place without allocating: ``[R, k]`` int32 slots (in ``[0, H]``, -1 none), ``[R, k]``
        int64 host rows and ``[R, k]`` int32 slots of the copies (the first ``out_copy_count[r]`` entries of row
        ``r``, filed under the row where each token first appears; -1 after), ``[R]`` int32 counts.
    backend : str, optional
        The backend to run on (default: the dispatcher's choice).

    Returns
    -------
    indexcache.hal.hisparse.Plan
        ``(slots, copy_src, copy_dst, copy_count, slot_token, slot_age)``; ``plan.copies`` is what
        :func:`hisparse_swap_in` takes for each layer that reuses the plan.

    Raises
    ------
    TypeError
        A wrong type or dtype.
    ValueError
        A wrong shape, device or value, or an output or the state sharing memory with another argument.

    Examples
    --------
    >>> import torch, indexcache
    >>> from indexcache.hal.hisparse import empty_state
    >>> tokens, ages = empty_state(1, 4)  # one request, a hot buffer of 4 slots
    >>> host_loc = torch.arange(100, dtype=torch.int32)[None]  # token t at host row t
    >>> raw = torch.tensor([[7, 2, -1]], dtype=torch.int32)
    >>> p = indexcache.hisparse_plan(raw, torch.tensor([10], dtype=torch.int32), host_loc, tokens, ages,
    ...                              backend="torch")
    >>> p.slots  # two misses, copied into the empty slots 0 and 1
    tensor([[ 0,  1, -1]], dtype=torch.int32)
    >>> tokens  # the state, updated in place
    tensor([[ 7,  2, -1, -1]], dtype=torch.int32)
    """
    # The state by name: a kept call returns what the op writes from the named arguments (library.result).
    got = _call("hisparse_plan", backend, None not in (out, out_copy_src, out_copy_dst, out_copy_count),
                (raw, seq_lens, host_loc), dict(slot_token=slot_token, slot_age=slot_age, row_to_batch=row_to_batch,
                                                host_rows=host_rows, slot_index=slot_index, out=out,
                                                out_copy_src=out_copy_src,
                                                out_copy_dst=out_copy_dst, out_copy_count=out_copy_count))
    return hisparse.Plan(*got[:4], slot_token, slot_age)  # a backend returns the four outputs, a kept call all six


def hisparse_swap_in(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, *, row_to_batch=None,
                     backend=None) -> torch.Tensor | Sequence[torch.Tensor]:
    """A swap-in of a HiSparse plan's copies, for one layer or for a producer group's layers at once: host KV row
    ``copy_src[r, i]`` → device KV row ``device_loc[b, copy_dst[r, i]]`` for ``i < copy_count[r]`` (``b`` row ``r``'s
    request). A copy whose request, slot, device row or host row lies outside its tensor is skipped; counts are
    clamped to ``[0, k]``. Every layer reusing a producer's indices takes the same copies with its own KV tensors:
    each layer in a call of its own (``indexcache.hisparse_swap_in(*plan.copies, ...)``), or the group's layers in one
    call (lists of their tensors), which the GPU backends copy in one launch and so nearer the host link's bandwidth
    (docs/hisparse.md, "One layer, or a group's layers"). Never reads or writes out of bounds, whatever the inputs
    hold. Copies that land in one device row (``device_loc`` naming a row for two slots or requests, or a hand-made
    list naming a slot twice; a plan's copies never do) leave one of them there, which one unspecified: the GPU
    backends copy in parallel (the reference, and the torch backend, keep the last in row order).

    Parameters
    ----------
    copy_src, copy_dst, copy_count : torch.Tensor
        ``[R, k]`` int64, ``[R, k]`` int32 and ``[R]`` int32: a plan's copies (:func:`hisparse_plan`).
    host_kv : torch.Tensor or sequence of torch.Tensor
        ``[Nh, ...]`` the layer's KV rows in host memory (pinned, for a GPU kernel to read it) or on the device; or a
        list (tuple) of such, a layer each.
    device_kv : torch.Tensor or sequence of torch.Tensor
        ``[Nd, ...]`` the layer's device KV rows (``host_kv``'s dtype and row shape, each row contiguous), written in
        place; or a list (tuple) of such, as many as ``host_kv``'s and in its order, every layer's rows of one dtype
        and shape (the lengths and strides may differ: the GPU backends put the layers of one layout, up to 8, in a
        launch).
    device_loc : torch.Tensor
        ``[B, H + 1]`` int32 or int64, the device row of each slot of each request (slot ``H``: the newest token's),
        the same for every layer.
    row_to_batch : torch.Tensor, optional
        ``[R]`` int32, as given to :func:`hisparse_plan`.
    backend : str, optional
        The backend to run on (default: the dispatcher's choice). The torch backend reads host memory on the host:
        with ``host_kv`` in host memory and ``device_kv`` on a GPU it syncs and cannot be captured in a CUDA graph.

    Returns
    -------
    torch.Tensor or sequence of torch.Tensor
        ``device_kv``, as given.

    Raises
    ------
    TypeError
        A wrong type or dtype, KV tensors of different dtypes or row shapes, or ``host_kv`` and ``device_kv`` of
        different layer counts.
    ValueError
        A wrong shape or device, or a ``device_kv`` layer sharing memory with another argument or layer.

    Examples
    --------
    >>> import torch, indexcache
    >>> from indexcache.hal.hisparse import empty_state
    >>> tokens, ages = empty_state(1, 4)
    >>> p = indexcache.hisparse_plan(torch.tensor([[7, 2]], dtype=torch.int32), torch.tensor([10], dtype=torch.int32),
    ...                              torch.arange(10, dtype=torch.int32)[None], tokens, ages, backend="torch")
    >>> host_kv = torch.arange(10.0)[:, None].expand(10, 2).contiguous()  # token t's row holds t
    >>> device_kv = torch.zeros(5, 2)  # slots 0..3, then slot H (the newest token) at row 4
    >>> indexcache.hisparse_swap_in(*p.copies, host_kv, device_kv, torch.arange(5, dtype=torch.int32)[None],
    ...                             backend="torch")[:, 0]
    tensor([7., 2., 0., 0., 0.])
    """
    # device_kv by name: a kept call returns what the op writes from the named arguments (library.result).
    return _call("hisparse_swap_in", backend, True, (copy_src, copy_dst, copy_count, host_kv),
                 dict(device_kv=device_kv, device_loc=device_loc, row_to_batch=row_to_batch))


def workspace_bytes(op: str, *args, sm_budget: int | None = None, backend=None, **named) -> int:
    """The bytes of device workspace the call ``indexcache.<op>(*args, **named, backend=backend)`` takes on the
    backend it would run on: what a caller's ``workspace=`` must hold (docs/ops.md, "Workspace").

    Parameters
    ----------
    op : str
        One of :data:`WORKSPACE_OPS`: "topk", "topk_translate", "paged_topk_translate", "mqa_topk_translate".
    *args, **named
        The call's arguments, checked as the call checks them. An output the call would allocate (``out``,
        ``logits``) is allocated here too: pass the call's own, or ask once at setup.
    sm_budget : int, optional
        The call's SM budget (default: the setting in force): a call under a budget may take other bytes.
    backend : str, optional
        The backend the call runs on (default: the dispatcher's choice).

    Returns
    -------
    int
        Bytes (0 where the backend takes none, as the torch backend; it ignores a given ``workspace``). They depend
        on the shapes, ``k`` and the device, never on tensor contents.

    Raises
    ------
    ValueError
        ``op`` takes no workspace; or as the call raises for its arguments.
    TypeError
        As the call raises for its arguments.
    """
    if op not in WORKSPACE_OPS:
        raise ValueError(f"op: expected one of {', '.join(WORKSPACE_OPS)} (the ops that take a workspace), got {op!r}")
    with budget.scoped(budget.check(sm_budget)):
        checked = SPECS[op].check(*args, **named)
        _, impl = dispatch.resolve(op, checked, backend)
        return dispatch.workspace_bytes(impl, checked)
