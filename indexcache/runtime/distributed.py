"""Context-parallel top-k: the producer's top-k when the key axis is split across ranks.

Every rank of ``group`` holds the scores of the same query rows against its own shard of the keys.
:func:`cp_topk` runs the selected backend's :func:`indexcache.topk` on the rank's visible keys,
gathers k candidates per rank and row with one ``all_gather`` (8 bytes each: the fp32 score and the
global index packed into one int64 sort key) and merges them, on every rank, into exactly what
:func:`indexcache.topk` gives on the concatenated scores. Any ``torch.distributed`` backend works
(NCCL, RCCL, gloo): tensors stay on the device of ``local_scores`` and the top-k itself never syncs with
the host. Before it, every rank checks that the ranks agree on their arguments (one all-gather of five int64
per rank, with a bounded wait; see :func:`cp_topk`), so a rank never hangs on a peer that returned early or
merges candidates of another shape.

Shards (``key_offset``):

- contiguous: an ``int``, the global index of the rank's first local column;
- any other layout (zigzag load balancing, see :func:`zigzag_key_index`): an int32 tensor ``[N_local]``
  giving the global index of each local column, strictly increasing (not checked: that would sync).

All index tensors are int32 and -1 marks an empty slot.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from indexcache.hal import dispatch, ops
from indexcache.hal.checks import (
    INDEX,
    SCORE_DTYPES,
    check_bool,
    check_int,
    check_k,
    check_tensor,
    check_translate_inputs,
    output,
)
from indexcache.hal.specs import SPECS

DEFAULT_TIMEOUT = 60.0  # seconds a rank waits in the argument check for its peers

_INVALID = torch.iinfo(torch.int64).min  # the key of a candidate that must never be chosen
_INDEX_MAX = torch.iinfo(torch.int32).max
# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; 2.11 has only the old name.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# What every rank must agree on, as gathered (after a leading failed-check flag); -1 stands for None/unknown.
_AGREED = ("rows", "k", "num_keys", "row_starts given")
_T = TypeVar("_T")


def zigzag_key_index(num_keys: int, world_size: int, rank: int, *, device=None) -> torch.Tensor:
    """The load-balanced causal layout: ``[0, num_keys)`` cut into ``2 * world_size`` near-equal chunks,
    rank ``r`` holding chunks ``r`` and ``2 * world_size - 1 - r``. Returns the rank's global key
    indices ``[N_local]`` int32, increasing: the ``key_offset`` of :func:`cp_topk` for that layout.
    """
    check_int("num_keys", num_keys, 0, _INDEX_MAX + 1, " (the keys' global indices are int32)")
    check_int("world_size", world_size, 1)
    if not 0 <= check_int("rank", rank, 0) < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    chunks = 2 * world_size
    parts = [torch.arange(num_keys * c // chunks, num_keys * (c + 1) // chunks, device=device)
             for c in (rank, chunks - 1 - rank)]
    return torch.cat(parts).to(INDEX)


def _check(local_scores, key_offset, lengths, k, row_starts, num_keys, backend) -> None:
    check_tensor("local_scores", local_scores, SCORE_DTYPES, (None, None))
    rows, cols = local_scores.shape
    device = local_scores.device
    check_tensor("lengths", lengths, (INDEX,), (rows,), device)
    check_k(k)  # here, not first in the local top-k, which a rank holding no keys skips
    if isinstance(key_offset, torch.Tensor):
        check_tensor("key_offset", key_offset, (INDEX,), (cols,), device)
    elif check_int("key_offset", key_offset, 0) + cols > _INDEX_MAX:
        raise ValueError(f"key_offset: global indices must fit int32, got {key_offset} + {cols} columns")
    if row_starts is not None:
        check_tensor("row_starts", row_starts, (INDEX,), (rows,), device)
    if num_keys is not None:
        check_int("num_keys", num_keys, 0, _INDEX_MAX + 1, " (the keys' global indices are int32)")
    if cols:  # the backend of the shard's top-k, chosen before the all-gather (a rank holding no keys runs none)
        # lengths stands in for the call's row starts: an int32 [R] tensor on the same device.
        dispatch.resolve("topk", SPECS["topk"].check(local_scores, lengths, k, row_starts=lengths), backend)


def _timeout(timeout) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout: expected seconds (a float) or a datetime.timedelta, got {type(timeout).__name__}")
    if not seconds > 0:
        raise ValueError(f"timeout: expected a positive time, got {seconds} s")
    return datetime.timedelta(seconds=seconds)


def _agreed(name: str, local: Callable[[], _T], local_scores, k, row_starts, num_keys, group, check: bool,
            timeout) -> _T:
    """Run this rank's argument checks ``local()`` and return what it returns, after every rank of ``group``
    has heard whether the others' checks passed and that all agree on :data:`_AGREED`; otherwise raise on
    every rank. Skipped (the checks run and raise locally) when ``check`` is false, while the current CUDA
    stream is capturing, when ``torch.distributed`` is not initialized and on a group of one rank."""
    limit, result, error = datetime.timedelta(seconds=DEFAULT_TIMEOUT), None, None
    try:
        limit = _timeout(timeout)  # a rejected timeout leaves the default bound for telling the peers
        check_bool("check_agreement", check)  # one that is no bool takes part, so that the peers hear of it
        result = local()
    except Exception as exc:  # re-raised below, once the peers know this rank will not run the top-k
        error = exc
    # No capture can run before CUDA is initialized; asking first would initialize it (and break forked ranks).
    capturing = torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    if check is False or capturing or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return result
    if error is None:
        mine = [0, local_scores.shape[0], k, -1 if num_keys is None else num_keys, int(row_starts is not None)]
    else:
        mine = [1] + [-1] * len(_AGREED)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # gloo (alone or as the CPU half of a mixed group) gathers host memory; NCCL/RCCL need device tensors.
    if "cpu:" in dist.get_backend_config(group):
        device = torch.device("cpu")
    elif isinstance(local_scores, torch.Tensor) and local_scores.device.type != "cpu":
        device = local_scores.device
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    gathered = torch.empty(world, len(mine), dtype=torch.long, device=device)
    opts = AllgatherOptions()
    opts.timeout = limit  # gloo ends the collective itself; NCCL/RCCL keep the group's, and wait(limit) bounds the host
    pg = group if group is not None else dist.group.WORLD
    try:
        pg.allgather([list(gathered.unbind(0))], [torch.tensor(mine, device=device)], opts).wait(limit)
    except RuntimeError as exc:
        if error is not None:
            raise error from exc
        raise RuntimeError(f"{name}: rank {rank} of {world}: the all-gather that checks the ranks' arguments "
                           f"failed or did not finish within {limit.total_seconds():g} s (a peer that does not "
                           f"call {name}, or calls another collective, stalls it); the group may be unusable "
                           f"now: {exc}") from exc
    table = gathered.tolist()
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(table) if row[0]]
    if failed:
        raise ValueError(f"{name}: rank {', '.join(map(str, failed))} of {world} rejected its arguments (the error "
                         f"raised there says why), so no rank runs the top-k; rank {rank}'s arguments passed")
    wrong = [f"{field}: " + ", ".join(f"rank {r} has {row[i + 1]}" for r, row in enumerate(table))
             for i, field in enumerate(_AGREED) if len({row[i + 1] for row in table}) > 1]
    if wrong:
        raise ValueError(f"{name}: ranks disagree on arguments that must be equal on every rank (-1 = None): "
                         + "; ".join(wrong))
    return result


def _windows(lengths, row_starts, num_keys):
    """The global window ``[start, start + length)`` of each row (int64), clipped like :func:`indexcache.topk`
    clips to its columns when ``num_keys`` is known; negative lengths count as 0."""
    start = torch.zeros_like(lengths, dtype=torch.long) if row_starts is None else row_starts.long().clamp_min(0)
    length = lengths.long().clamp_min(0)
    if num_keys is not None:
        start = start.clamp_max(num_keys)
        length = torch.minimum(length, num_keys - start)
    return start, length


def _sort_key(scores: torch.Tensor, rel: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One int64 per candidate that orders like (score descending, index ascending): the fp32 bits
    mapped to a monotone int32 in the high word, ``INT32_MAX - index`` in the low word. Candidates
    that are not ``valid``, NaN or -inf get the smallest int64."""
    s = scores.float()
    bits = torch.where(s == 0, 0.0, s).view(torch.int32)  # -0.0 ties with +0.0
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()
    valid = valid & ~torch.isnan(s) & (s != float("-inf"))
    return torch.where(valid, (ordered << 32) | (_INDEX_MAX - rel), _INVALID)


def _local_candidates(local_scores, key_offset, start, length, k, backend) -> torch.Tensor:
    """``[R, k]`` int64 sort keys of this rank's best k visible keys (indices relative to ``start``)."""
    rows, cols = local_scores.shape
    if cols == 0:
        return torch.full((rows, k), _INVALID, dtype=torch.long, device=local_scores.device)
    end = start + length
    if isinstance(key_offset, torch.Tensor):
        global_index = key_offset.long()
        lo, hi = torch.searchsorted(global_index, start), torch.searchsorted(global_index, end)
    else:
        lo, hi = (start - key_offset).clamp(0, cols), (end - key_offset).clamp(0, cols)
    pos = ops.topk(local_scores, (hi - lo).to(INDEX), k, row_starts=lo.to(INDEX), backend=backend)
    col = (lo[:, None] + pos).clamp(0, cols - 1)
    index = global_index[col] if isinstance(key_offset, torch.Tensor) else col + key_offset
    return _sort_key(local_scores.gather(1, col), index - start[:, None], pos >= 0)


def cp_topk(local_scores, key_offset, lengths, k: int, group=None, *, row_starts=None, num_keys: int | None = None,
            out=None, backend=None, check_agreement: bool = True,
            timeout: datetime.timedelta | float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """Context-parallel :func:`indexcache.topk`: call it on every rank of ``group`` with the same rows.

    ``local_scores [R, N_local]`` float32/bfloat16/float16, this rank's columns of the global scores
    ``[R, N]``; ``key_offset`` an int (contiguous shard) or int32 ``[N_local]`` (global index of each
    column, increasing); ``lengths [R]`` int32, the GLOBAL visible length of each row (keys at or past
    it are invisible on every rank); ``row_starts [R]`` int32, the global window start (0 when None);
    ``num_keys`` the global key count N, used only to clip windows that run past it (windows are
    taken as given when None). ``R``, ``k``, ``lengths``, ``row_starts`` and ``num_keys`` must be the
    same on every rank; the score dtype may differ (candidates travel as fp32).

    Returns ``out [R, k]`` int32 on every rank, equal to ``indexcache.topk(scores, lengths, k,
    row_starts=row_starts, sorted=True)`` on the global scores: window-relative indices ordered by
    score descending then index ascending; rows with length ≤ k give ``0 .. len-1`` then -1 without
    looking at the scores; -inf and NaN are never chosen (their slots are -1); ties go to the lower
    global index. The top-k communicates ``world_size × R × k × 8`` bytes in one all-gather, enqueued on
    the communicator's stream like any other collective, without a host sync.

    Agreement check (on unless ``check_agreement=False``): first, even before returning early for ``R = 0``
    or ``k = 0``, every rank checks its own arguments (``backend`` too: a rank holding keys resolves the backend of
    its shard's top-k, so an unknown name or one that cannot run it fails the check, not the top-k after it) and
    all-gathers five int64 (pass/fail, ``R``, ``k``, ``num_keys`` or -1, whether ``row_starts`` is given). A rank
    whose checks failed raises its own error, the others a ValueError naming it; values that differ make every
    rank raise a ValueError listing each rank's value (``lengths`` and ``row_starts`` contents are not
    compared). A peer that never joins is
    waited for at most ``timeout`` (seconds or a timedelta), then a RuntimeError follows and the group may
    be unusable: gloo ends the collective itself; on NCCL/RCCL the host stops waiting (``Work.wait``) while
    the watchdog keeps the group's own timeout (``init_process_group(timeout=...)``). Groups with gloo (also
    a mixed ``cpu:gloo,cuda:nccl`` one) gather host memory; NCCL/RCCL-only groups gather device memory, and
    reading it SYNCS the host with the device. Skipped while the current CUDA stream is capturing (a graph
    cannot sync: an eager warm-up call of the same shapes checks them), on one rank and without an
    initialized ``torch.distributed``; ``check_agreement=False`` skips it too, e.g. in a loop checked once. Pass the
    same ``check_agreement`` on every rank: a rank that skips the check meets its peers' check with the top-k's
    all-gather, which fails, or, where the sizes match (``R × k = 5``), returns wrong indices without an error.
    """
    def local() -> torch.Tensor:
        _check(local_scores, key_offset, lengths, k, row_starts, num_keys, backend)
        inputs = dict(local_scores=local_scores, key_offset=key_offset, lengths=lengths, row_starts=row_starts)
        return output("out", out, INDEX, (local_scores.shape[0], k), local_scores.device, inputs)

    out = _agreed("cp_topk", local, local_scores, k, row_starts, num_keys, group, check_agreement, timeout)
    return _merged(local_scores, key_offset, lengths, k, group, row_starts, num_keys, out, backend)


def _merged(local_scores, key_offset, lengths, k, group, row_starts, num_keys, out, backend) -> torch.Tensor:
    """:func:`cp_topk` on checked (and agreed) arguments, into ``out``."""
    rows = local_scores.shape[0]
    device = local_scores.device
    if rows == 0 or k == 0:
        return out
    start, length = _windows(lengths, row_starts, num_keys)
    local = _local_candidates(local_scores, key_offset, start, length, k, backend).contiguous()
    world = dist.get_world_size(group)
    gathered = torch.empty((world * rows, k), dtype=torch.long, device=device)
    _all_gather(gathered, local, group=group)
    merged = gathered.view(world, rows, k).transpose(0, 1).reshape(rows, world * k)
    best = torch.topk(merged, k, dim=1).values
    long_rows = torch.where(best == _INVALID, -1, _INDEX_MAX - (best & 0xFFFFFFFF))
    slot = torch.arange(k, device=device)[None, :]
    short_rows = torch.where(slot < length[:, None], slot, -1)
    return out.copy_(torch.where((length > k)[:, None], long_rows, short_rows))


def cp_topk_translate(local_scores, key_offset, lengths, k: int, page_table, page_size: int, group=None, *,
                      row_starts=None, row_to_batch=None, num_keys: int | None = None, out=None, out_raw=None,
                      backend=None, check_agreement: bool = True,
                      timeout: datetime.timedelta | float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """Context-parallel :func:`indexcache.topk_translate`: :func:`cp_topk`, then each rank translates
    the global logical indices through ``page_table [B, P]`` int32 (``row_to_batch [R]`` int32).

    Returns ``out [R, k]`` int32 physical slots, equal to ``indexcache.translate(cp_topk(...),
    page_table, lengths, page_size, row_to_batch=...)`` (-1 where either gives -1); ``out_raw [R, k]``
    int32, when given, receives the logical indices the shared layers reuse. The agreement check
    (``check_agreement``, ``timeout``) is :func:`cp_topk`'s, run once, and it covers the translation's
    arguments too: a rank whose page table is rejected fails every rank.
    """
    def local() -> tuple[torch.Tensor, torch.Tensor]:
        _check(local_scores, key_offset, lengths, k, row_starts, num_keys, backend)
        shape = (local_scores.shape[0], k)
        device = local_scores.device
        check_translate_inputs(shape, page_table, lengths, page_size, row_to_batch, device)
        inputs = dict(local_scores=local_scores, key_offset=key_offset, lengths=lengths, page_table=page_table,
                      row_starts=row_starts, row_to_batch=row_to_batch)
        return (output("out", out, INDEX, shape, device, dict(inputs, out_raw=out_raw)),
                output("out_raw", out_raw, INDEX, shape, device, inputs))

    out, raw = _agreed("cp_topk_translate", local, local_scores, k, row_starts, num_keys, group, check_agreement,
                       timeout)
    _merged(local_scores, key_offset, lengths, k, group, row_starts, num_keys, raw, backend)
    return ops.translate(raw, page_table, lengths, page_size, row_to_batch=row_to_batch, out=out, backend=backend)
