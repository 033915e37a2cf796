"""Top-k selection (and the fused producer step, top-k + page translation) in Triton.

A sampled-threshold select that reads each row once, with an exact radix select as its fallback:

1. Sample: a few thousand entries spread over the window (one a segment, jittered), held in registers; the
   threshold ``T`` is the key of the sample's ``m``-th best, radix-selected (``DIGIT`` bits a round), with ``m`` set
   so that ``T`` lies below the row's k-th best score with overwhelming odds (``m = λ + 4·√λ + 2``, ``λ`` the
   sample entries expected above the k-th best).
2. Filter: every valid entry ``>= T`` is a candidate, kept with its position (and, on split rows, its key and
   a count in the row's bin of its key; see below): a compare or two an entry, no histogram over the row.
3. Finish: when the row gave ``k <= C <= cap`` candidates they hold the whole top-k (every entry at or
   above the k-th best candidate is ``>= T``), so the exact 32-bit key of the k-th best is radix-selected
   over them, ``DIGIT`` bits a round below the common prefix of their min and max key, stopping as soon
   as the pivot's digit holds exactly the entries still needed; the entries above it are written, and of
   those tied with it on every bit a second select over their positions keeps the lowest, so the lower index
   wins ties deterministically whatever order the candidates were kept in.
4. Fallback (``C < k``: the sample overshot; ``C > cap``: heavy ties or a threshold far too low), exact
   and slower: a histogram of the whole row gives the threshold bin ``b``; entries above it go straight to
   the output, those of bin ``b`` to the stash, and the finish above selects among them (rescanning the row
   when bin ``b`` held more than the stash).
   Slots that valid entries cannot fill get -1. When translating, the passes write raw positions (to
   ``out_raw`` when given, else to ``out``) and the finish translates the row's slots once at the end, so no
   page-table read sits in the streaming loops.

Keys: fp32 bits with negatives' magnitude bits flipped (a signed int32 order); -0.0 is made +0.0,
NaN and -inf become INT32_MIN and are never counted. bf16/fp16 scores are widened to fp32 first.

``sorted=True`` (k up to ``MAX_SORTED_K``): the select writes raw positions, then one program a row sorts its
``k`` slots in registers (a bitonic ``tl.sort`` of 64-bit keys: exact score key, then the position reversed, so
ties keep the lower index first and -1 slots go last) and translates them when asked.

Launches: many rows run one fused kernel, a persistent grid over rows with one stash per program (filled in index
order by a running ``tl.cumsum``), then a persistent finishing kernel that takes only the rows the first left to the
fallback. On NVIDIA the table's ``KERNEL = "block"`` puts the Gluon kernel of :mod:`.block` (a block a row) in
the fused kernel's place, and gives it the split rows' calls too from ``BLOCK_MIN_ROWS`` rows on. Few long rows are
split into chunks fixed by the shape and the SM count (never by the data): one program a row samples it (``T`` and
the shift of the row's candidate bins to the workspace, the bins zeroed); then each chunk program filters its
columns into its own region of the workspace, a lane a thread with a run of slots of its own (no scan while
streaming; the runs are packed at intervals), counting each candidate in its bin (``BINS`` bins of its key's
distance above ``T``, an atomic add); then the finish reads the bin counts, which give the bin holding the k-th
best. Where the table's ``FINISH_TIES`` allows (NVIDIA) and that bin holds at most that many candidates, a program a
chunk finishes the row: each sends its chunk's candidates above the bin out, after those of the chunks before it
(counted from their keys), and the first also ranks the bin's own by compares and sends the best ``k - above``.
Otherwise one program a row reads the candidates once (those in higher bins go straight out) and finishes among
that one bin's (or falls back). Rows with ``len <= k`` give ``0..len-1`` then -1 without reading scores. The output
order is deterministic but, on split rows, not by index. The workspace (on split rows about twice the size of fp32
scores, candidates' keys kept beside their positions) is the caller's ``workspace=`` or the kept one of the calling
thread's current stream (:mod:`~indexcache.backends.triton.workspace`), allocated on the first call of a new stream,
thread and size bucket and reused: no allocation after that, no host sync, grids from shapes only. Calls on different
streams or threads never share one; two CUDA graphs captured on one stream and replayed concurrently on two do,
unless each was captured with its own ``workspace=`` (docs/ops.md, "Workspace").

The modules: :mod:`.kernels` (the Triton kernels and their constants), :mod:`.block` (the Gluon kernel),
:mod:`.plan` (the host's launch planning: how a call's rows are taken, its workspace and its launches) and
:mod:`.specs` (what a GPU backend registers and builds: :func:`ops`, :func:`compile_specs`). This package exposes
what other modules use: the ops and compile specs (``KERNEL_MODULES``), the launches and workspace of a call, the
entry points, the sort's largest k and the Triton kernels (the cross-compile check's coverage reads them here).
"""

from __future__ import annotations

from indexcache.backends.triton.topk.kernels import (
    MAX_SORTED_K,
    topk_filter_kernel,
    topk_finish_kernel,
    topk_rows_kernel,
    topk_sample_kernel,
    topk_sort_kernel,
)
from indexcache.backends.triton.topk.plan import Settings, call_plan, launches, topk, topk_translate, workspace_bytes
from indexcache.backends.triton.topk.specs import compile_specs, ops

__all__ = [
    "MAX_SORTED_K",
    "Settings",
    "call_plan",
    "compile_specs",
    "launches",
    "ops",
    "topk",
    "topk_filter_kernel",
    "topk_finish_kernel",
    "topk_rows_kernel",
    "topk_sample_kernel",
    "topk_sort_kernel",
    "topk_translate",
    "workspace_bytes",
]
