"""The SM budget (issue #41, :mod:`indexcache.hal.budget`): ``indexcache.sm_budget(n)`` and the ``sm_budget=`` argument
of the six ops with persistent kernels, checked and scoped per thread; the persistent launches of the Triton backends
built under a budget of n run at most n programs, read from the launched grids (built as data for sm90, sm80 and
gfx942 inside ``launcher.planning``: no GPU); the custom op carries the budget under ``torch.compile``; ``overlap``'s
``side_sms``, ``tokens`` and ``context`` and the scheduler's share. CPU; the interpreted kernels under a budget are in
tests/kernels/test_triton_budget.py."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

import indexcache  # noqa: E402
from indexcache.backends.cuda.tuning import tuning as cuda_tuning  # noqa: E402
from indexcache.backends.rocm.tuning import tuning as rocm_tuning  # noqa: E402

# Every kernel module imported now, at collection, before a test elsewhere sets TRITON_INTERPRET=1 (as test_warmup).
from indexcache.backends.triton import (  # noqa: E402, F401
    crosscompile,
    decode_sm90,
    logits,
    prefill_producer,
    prefill_sm90,
    producer,
    topk,
    variants,
)
from indexcache.backends.triton import streams as triton_streams  # noqa: E402
from indexcache.backends.triton.launcher import persistent_programs, planning  # noqa: E402
from indexcache.backends.triton.topk.plan import split_chunk  # noqa: E402
from indexcache.hal import budget, dispatch, library, memo  # noqa: E402
from indexcache.hal.contract import IN_ORDER  # noqa: E402
from indexcache.hal.library import BUDGETED_OPS  # noqa: E402
from indexcache.hal.specs import SPECS  # noqa: E402
from indexcache.plan import LayerPlan  # noqa: E402
from indexcache.runtime.streams import overlap  # noqa: E402
from indexcache.tools.warmup import decode_calls, prefill_calls  # noqa: E402

I32 = torch.int32
BAD = [0, -1, True, 1.5, "4", 2**31]


def _error(bad) -> type[Exception]:
    """What a bad int argument raises: TypeError for a value that is not an int (a bool is not), else ValueError."""
    return ValueError if isinstance(bad, int) and not isinstance(bad, bool) else TypeError
SIX = set(BUDGETED_OPS)  # the ops whose spec records say budgeted (the grid test checks each has persistent launches)


# ------------------------------------------------------------------------------------------------- indexcache.sm_budget

def test_the_package_exports_the_budget_block():
    assert indexcache.sm_budget is budget.sm_budget


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_budget_is_an_int_of_at_least_one(bad):
    with pytest.raises(_error(bad), match=r"^sm_budget: expected an int"):
        with indexcache.sm_budget(bad):
            pytest.fail("the block ran under a bad budget")
    assert budget.current() is None


def test_blocks_nest_none_lifts_the_enclosing_budget_and_each_is_restored():
    assert budget.current() is None
    with indexcache.sm_budget(8):
        assert budget.current() == 8
        with indexcache.sm_budget(3):
            assert budget.current() == 3
            with indexcache.sm_budget(None):
                assert budget.current() is None
            assert budget.current() == 3
        assert budget.current() == 8
        with indexcache.sm_budget(200):  # above any device: allowed (the whole device)
            assert budget.current() == 200
        assert budget.current() == 8
    assert budget.current() is None


def test_a_budget_is_restored_after_an_exception():
    with indexcache.sm_budget(6):
        with pytest.raises(RuntimeError, match="in the block"):
            with indexcache.sm_budget(2):
                raise RuntimeError("in the block")
        assert budget.current() == 6
        with pytest.raises(ValueError, match="sm_budget"):  # a bad inner budget leaves the outer one
            with indexcache.sm_budget(0):
                pass
        assert budget.current() == 6
    assert budget.current() is None


def test_a_budget_holds_for_its_own_thread_only():
    """Two threads, each in its own block at the same time: each sees its own budget, never the other's."""
    entered, leave = threading.Event(), threading.Event()
    seen = {}

    def other():
        seen["other before"] = budget.current()
        with indexcache.sm_budget(2):
            entered.set()
            leave.wait(10)
            seen["other inside"] = budget.current()
        seen["other after"] = budget.current()

    thread = threading.Thread(target=other)
    thread.start()
    with indexcache.sm_budget(7):
        assert entered.wait(10)
        seen["main while the other holds 2"] = budget.current()
        leave.set()
        thread.join(10)
        seen["main after the other left"] = budget.current()
    assert not thread.is_alive()
    assert seen == {"other before": None, "other inside": 2, "other after": None,
                    "main while the other holds 2": 7, "main after the other left": 7}
    assert budget.current() is None


# -------------------------------------------------------------------------------------------------- the ops' sm_budget=

def test_the_budgeted_ops_are_the_six_with_persistent_kernels_and_only_they_take_the_argument():
    assert len(SIX) == 6 and "translate" not in SIX and "hisparse_swap_in" not in SIX
    for op in SPECS:
        params = inspect.signature(getattr(indexcache, op)).parameters
        assert ("sm_budget" in params) == (op in SIX), op
        if op in SIX:
            assert params["sm_budget"].kind is inspect.Parameter.KEYWORD_ONLY and params["sm_budget"].default is None
    assert "sm_budget" in inspect.signature(indexcache.workspace_bytes).parameters


def _case(op: str) -> dict:
    """The public op's arguments of ``op``'s first conformance case (on the CPU; the same every call)."""
    case = SPECS[op].cases[0]
    gen = torch.Generator().manual_seed(0)
    return case.build(gen, "cpu", torch.float8_e4m3fn) if case.native_fp8 else case.build(gen, "cpu")


@pytest.mark.parametrize("bad", [0, True, "4", 2**63], ids=repr)
@pytest.mark.parametrize("op", sorted(SIX))
def test_a_calls_budget_is_checked(op, bad):
    with pytest.raises(_error(bad), match=r"^sm_budget: expected an int"):
        getattr(indexcache, op)(**_case(op), sm_budget=bad, backend="torch")


def test_a_calls_budget_is_checked_with_every_output_given_and_by_workspace_bytes():
    scores, lengths = torch.randn(2, 40), torch.tensor([40, 7], dtype=I32)
    out = torch.empty(2, 4, dtype=I32)
    for _ in range(3):  # a call with every output given (a memo signature), repeated
        indexcache.topk(scores, lengths, 4, out=out, backend="torch")
    with pytest.raises(
            ValueError, match=r"^sm_budget: expected an int in \[1, 2147483647\] \(multiprocessors\), got -1$"):
        indexcache.topk(scores, lengths, 4, out=out, sm_budget=-1, backend="torch")
    with pytest.raises(TypeError, match=r"^sm_budget: expected an int, got float 1.5"):
        indexcache.workspace_bytes("topk", scores, lengths, 4, sm_budget=1.5, backend="torch")
    assert indexcache.workspace_bytes("topk", scores, lengths, 4, sm_budget=3, backend="torch") == 0


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


@pytest.mark.parametrize("op", sorted(SIX))
def test_the_torch_backend_gives_the_same_results_under_a_budget(op):
    """The torch backend has no persistent kernels: the result and every tensor the call writes (``out_raw``,
    ``logits``) are those of the call without a budget, bit for bit, under the argument and under a block."""
    def run(**extra):
        args = _case(op)
        with contextlib.ExitStack() as stack:
            if "block" in extra:
                stack.enter_context(indexcache.sm_budget(extra.pop("block")))
            got = getattr(indexcache, op)(**args, **extra, backend="torch")
        return _tensors(got) + _tensors(args)

    want = run()
    for extra in (dict(sm_budget=1), dict(sm_budget=7), dict(block=3), dict(block=3, sm_budget=5)):
        got = run(**extra)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=f"{op} {extra}")


@pytest.fixture
def budgets_seen(monkeypatch):
    """The budget in force when the backend's implementation runs, and the budget in each memo signature, per call."""
    seen = collections.defaultdict(list)
    resolve, signature = dispatch.resolve_choice, memo.signature

    def resolving(op, args, chosen):
        name, impl = resolve(op, args, chosen)
        fn = impl.fn
        return name, dataclasses.replace(impl, fn=lambda **a: seen["run"].append(budget.current()) or fn(**a))

    def signing(op, choice, params):
        seen["key"].append(params[-1])
        return signature(op, choice, params)

    monkeypatch.setattr(dispatch, "resolve_choice", resolving)
    monkeypatch.setattr(memo, "signature", signing)
    return seen


def test_the_calls_budget_wins_over_the_block_and_is_in_force_where_the_backend_runs(budgets_seen):
    scores, lengths = torch.randn(2, 40), torch.tensor([40, 7], dtype=I32)
    out = torch.empty(2, 4, dtype=I32)

    def call(**extra):
        indexcache.topk(scores, lengths, 4, out=out, **extra, backend="torch")

    call()
    call(sm_budget=4)
    with indexcache.sm_budget(9):
        call()
        call(sm_budget=4)
        with indexcache.sm_budget(None):
            call()
    assert budget.current() is None
    assert budgets_seen["run"] == [None, 4, 9, 4, None]
    assert budgets_seen["key"] == [None, 4, 9, 4, None]  # the budget is the last part of the kept call's signature


# ------------------------------------------------------------------ the launched grids (Triton backends, built as data)

PLAN = LayerPlan.from_config(str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "deepseek-v3.2.json"))
PLAN_MXFP4 = LayerPlan.from_config(str(Path(__file__).resolve().parents[1] / "examples" / "configs" /
                                       "deepseek-v3.2.json"), index_dtype="float4_e2m1fn_x2")  # DeepSeek-V4's keys
SMS = {"sm90": 132, "sm80": 108, "gfx942": 304}  # H100 / H200, A100, MI300X
# Persistent launches: sized by the device (programs loop over the work), capped by the budget.
PERSISTENT = {"mqa_logits_kernel", "prefill_sm90_kernel", "paged_mqa_logits_kernel", "paged_decode_sm90_kernel",
              "topk_rows_kernel", "topk_block_kernel", "topk_sample_kernel", "topk_filter_kernel",
              "topk_finish_kernel", "topk_sort_kernel", "far_keys_kernel"}
# The decode kernels' grid is (draft-token groups, programs): a budget below the groups still runs one program each.
GROUPED = {"paged_mqa_logits_kernel", "paged_decode_sm90_kernel"}
# Persistent launches whose programs fill the budget: min(their programs without it, n).
FILLS = PERSISTENT - GROUPED - {"topk_sample_kernel", "topk_filter_kernel", "topk_sort_kernel"}
# The sort: a program a row in one launch, under a budget of n launches of n rows one after another.
SPLIT = "topk_sort_kernel"


def _merged(call: list) -> list:
    """A call's launches with consecutive sort launches as one ``(op, name, (their programs,))``."""
    merged = []
    for op, name, grid in call:
        if name == SPLIT and merged and merged[-1][1] == SPLIT:
            merged[-1] = (op, name, (merged[-1][2][0] + _product(grid),))
        else:
            merged.append((op, name, grid))
    return merged
# Launches of the six ops sized by their work, not by the device: not budgeted (budget.py's docstring).
EXEMPT = {
    "short_rows_kernel": "a short-row step's fill (producer.SHORT): a tile of rows and slots a program",
    "draft_rows_kernel": "the draft rows' lengths and requests (producer.DRAFT_ROWS): DRAFT_BLOCK rows a program",
    "windows_kernel": "the prefill producer's windows (prefill_producer.WINDOWS): WINDOW_BLOCK queries a program",
    "zero_kernel": "MXFP4 keys widened once a call (prefill_fp4.py): the far keys' count reset, one program",
    "widen_keys_kernel": "MXFP4 keys widened once a call (prefill_fp4.py): WIDEN_BLOCK keys a program",
}
# The launches of MXFP4 keys alone (the prefill widening them; the far keys' logits after the fp8 prefill).
MXFP4_ONLY = {"zero_kernel", "widen_keys_kernel", "far_keys_kernel"}
# (arch, the paged / prefill logits kernel): as the tuning table picks it with this Triton, and the Gluon Hopper
# kernels forced (the table picks them before Triton 3.7: cuda/tuning.py, _triton_before).
CONFIGS = [("sm90", "tuned"), ("sm90", "tma-ws"), ("sm80", "tuned"), ("gfx942", "tuned")]
CONFIG_IDS = [f"{arch}-{kernel}" for arch, kernel in CONFIGS]


def _setup(arch: str, kernel: str):
    backend = "rocm" if arch.startswith("gfx") else "cuda"
    table = (rocm_tuning if backend == "rocm" else cuda_tuning)(arch)
    if kernel == "tma-ws":
        table["paged_mqa_logits"]["KERNEL"] = "tma-ws"
        table["mqa_logits"].update(COLS=256, PROGRAMS_PER_SM=2, KERNEL="tma-ws")
    return crosscompile.gpu_target(backend, arch), table


def _gluon(table: dict, op: str) -> bool:
    """Whether the table picks ``op``'s Gluon Hopper kernel (where the call suits it: these calls do)."""
    return table[op].get("KERNEL") == "tma-ws"


def _meta(*shape: int, dtype: torch.dtype = I32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _calls(fp8: torch.dtype, plan: LayerPlan = PLAN) -> list[tuple[str, dict]]:
    """The budgeted ops' calls of decode steps and prefill chunks of the deployment ``plan`` (as ``indexcache
    warmup`` lists them), ``paged_mqa_logits`` of the decode steps alone, and top-k calls on rows few and many, short
    and long, unsorted and sorted."""
    calls = []
    # (batch, context, next_n): one request, a large batch, draft tokens (2 and 4), every row short.
    for batch, context, next_n in ((1, 65536, 1), (64, 65536, 1), (3, 131072, 2), (16, 20000, 4), (2, 100, 1)):
        for op, args in decode_calls(plan, 64, fp8, batch, context, next_n):
            if op == "paged_topk_translate":
                calls.append((op, args))
                calls.append(("paged_mqa_logits", dict(
                    q=args["q"], k_cache=args["k_cache"], weights=args["weights"], context_lens=args["context_lens"],
                    page_table=args["block_table"], max_context_len=args["max_context_len"], out=args["logits"],
                    **{name: args[name] for name in ("k_format", "q_scale") if name in args})))
    for tokens, keys in ((1, 65536), (300, 131072), (4096, 8192), (3, 300)):
        calls += [(op, args) for op, args in prefill_calls(plan, 64, fp8, tokens, keys) if op in SIX]
    for rows, cols, k in ((1, 65536, 2048), (4, 32768, 2048), (300, 4096, 512), (2048, 8192, 2048),
                          (1200, 300000, 2048)):
        for sorted_ in (False, True):
            calls.append(("topk", dict(scores=_meta(rows, cols, dtype=torch.float32), lengths=_meta(rows), k=k,
                                       out=_meta(rows, k), sorted=sorted_)))
    return calls


def _launches(arch: str, kernel: str, n: int | None,
              plan: LayerPlan = PLAN) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """Per call of :func:`_calls` (of ``plan``), its launches as ``(op, kernel, grid)``, built for ``arch`` under a
    budget of ``n`` (None: no budget)."""
    target, table = _setup(arch, kernel)
    found = []
    with planning(SMS[arch]), indexcache.sm_budget(n):
        for op, args in _calls(target.fp8_dtype, plan):
            found.append([(op, launch.launcher.__name__, tuple(launch.grid))
                          for launch in variants.op_launches(op, args, target, table)])
    return found


def _product(grid: tuple[int, ...]) -> int:
    out = 1
    for g in grid:
        out *= g
    return out


@pytest.mark.parametrize(("arch", "kernel"), CONFIGS, ids=CONFIG_IDS)
def test_every_launch_of_a_budgeted_op_is_persistent_or_listed_exempt(arch, kernel):
    """A new launch in the six ops must be named here: either persistent (and then checked against the budget below)
    or exempt with its reason, with fp8 keys and with MXFP4 ones. The calls reach every persistent kernel the
    configuration has."""
    names = {name for call in _launches(arch, kernel, None) for _, name, _ in call}
    assert names <= PERSISTENT | set(EXEMPT), names - PERSISTENT - set(EXEMPT)
    _, table = _setup(arch, kernel)
    decode = "paged_decode_sm90_kernel" if _gluon(table, "paged_mqa_logits") else "paged_mqa_logits_kernel"
    prefill = "prefill_sm90_kernel" if _gluon(table, "mqa_logits") else "mqa_logits_kernel"
    rows = {"topk_rows_kernel"} | ({"topk_block_kernel"} if arch.startswith("sm") else set())
    want = {decode, prefill, *rows, "topk_sample_kernel", "topk_filter_kernel", "topk_finish_kernel",
            "topk_sort_kernel", *EXEMPT}
    assert names == want - MXFP4_ONLY
    # MXFP4 keys (and queries): the keys widened for the fp8 prefill, but on sm80 (no fp8 matmul: the torch backend's)
    mxfp4 = {name for call in _launches(arch, kernel, None, PLAN_MXFP4) for _, name, _ in call}
    assert mxfp4 <= PERSISTENT | set(EXEMPT), mxfp4 - PERSISTENT - set(EXEMPT)
    assert (mxfp4 & MXFP4_ONLY) == (set() if arch == "sm80" else MXFP4_ONLY)


@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize(("arch", "kernel"), CONFIGS, ids=CONFIG_IDS)
def test_a_persistent_launch_under_a_budget_of_n_runs_at_most_n_programs(arch, kernel, n):
    """The issue's check, read from the launched grids: every persistent launch of every call runs at most n programs
    (the decode: at most n, or one a draft-token group where there are more groups than n); the launches that fill
    the device fill the budget instead (min(their programs without it, n)), the decode's programs n // groups."""
    free, capped = _launches(arch, kernel, None), _launches(arch, kernel, n)
    # Every budgeted op launches persistent kernels here.
    assert {op for call in free for op, name, _ in call if name in PERSISTENT} == SIX
    _check_budgeted(free, capped, n)


@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize(("arch", "kernel"), CONFIGS[:2] + CONFIGS[3:], ids=CONFIG_IDS[:2] + CONFIG_IDS[3:])
def test_with_mxfp4_keys_a_persistent_launch_under_a_budget_of_n_runs_at_most_n_programs(arch, kernel, n):
    """The same check with MXFP4 keys and queries (sm80 leaves the MXFP4 prefill to torch): the far keys' logits after
    the widened keys' fp8 prefill fill the budget too."""
    present = _check_budgeted(_launches(arch, kernel, None, PLAN_MXFP4), _launches(arch, kernel, n, PLAN_MXFP4), n)
    assert "far_keys_kernel" in present


def _check_budgeted(free: list, capped: list, n: int) -> set[str]:
    """Every persistent launch of ``capped`` (the calls' launches under a budget of ``n``) runs at most n programs
    (the decode: at most n, or one a draft-token group where there are more groups than n); paired with ``free`` (the
    same calls' launches without a budget), those that fill the device fill the budget instead. Returns the kernels
    that fill the device, each checked to have had more than n programs somewhere without the budget."""
    filled = collections.Counter()
    for call_free, call_capped in zip(free, capped, strict=True):
        for op, name, grid in call_capped:
            if name in EXEMPT:
                continue
            limit = max(n, grid[0]) if name in GROUPED else n
            assert _product(grid) <= limit, (op, name, grid, n)
        call_free, call_capped = _merged(call_free), _merged(call_capped)
        if [name for _, name, _ in call_free] != [name for _, name, _ in call_capped]:
            continue  # the budget changed the call's path (split rows no longer split): nothing to pair
        chunks = {name: grid for _, name, grid in call_capped if name == "topk_filter_kernel"}
        for (op, name, before), (_, _, after) in zip(call_free, call_capped, strict=True):
            if name == "topk_finish_kernel" and len(before) == 2:  # split rows: a program a chunk, as the filter
                assert after == chunks["topk_filter_kernel"], (op, name, before, after)
            elif name == SPLIT:  # every row sorted, n at a time
                assert after == before, (op, name, before, after)
                filled[name] += _product(before) > n
            elif name in FILLS:
                assert _product(after) == min(_product(before), n), (op, name, before, after)
                filled[name] += _product(before) > n
            elif name in GROUPED:
                assert after == (before[0], max(1, min(n // before[0], before[1]))), (op, name, before, after)
                filled[name] += _product(before) > n
    # Not vacuous: each kernel that fills the device had more than n programs somewhere without the budget.
    present = {name for call in free for _, name, _ in call} & (FILLS | GROUPED | {SPLIT})
    assert {name for name in present if filled[name]} == present, filled
    return present


@pytest.mark.parametrize(("arch", "kernel"), CONFIGS, ids=CONFIG_IDS)
def test_split_rows_take_at_most_the_budget_and_are_not_split_where_fewer_than_two_chunks_fit(arch, kernel):
    """One long row (65536 columns, k 2048) is split into chunks without a budget and under budgets of 7 and 33
    (at most n chunks: sample 1 program, filter (1, chunks)); under a budget of 1 it is not split."""
    def split(n):
        return [(name, grid) for call in _launches(arch, kernel, n)[:1] for op, name, grid in call
                if op == "paged_topk_translate" and name in ("topk_sample_kernel", "topk_filter_kernel")]

    assert [name for name, _ in split(None)] == ["topk_sample_kernel", "topk_filter_kernel"]
    for n in (7, 33):
        (_, sample), (_, filt) = split(n)
        assert sample == (1,) and filt[0] == 1 and 2 <= filt[1] <= n, (n, filt)
    assert split(1) == []


@pytest.mark.parametrize(("arch", "kernel"), CONFIGS, ids=CONFIG_IDS)
def test_without_a_budget_or_under_the_whole_device_the_grids_fill_the_device(arch, kernel):
    """A budget at or above the device's multiprocessors builds exactly the launches of no budget, and those are
    the device-filling grids of before the budget (the tuning table's programs a multiprocessor)."""
    sms = SMS[arch]
    free = _launches(arch, kernel, None)
    assert _launches(arch, kernel, sms) == free
    assert _launches(arch, kernel, 4 * sms) == free
    target, table = _setup(arch, kernel)
    calls = _calls(target.fp8_dtype)
    by_call = {(op, tuple(args["scores"].shape) if op == "topk" else None, args.get("sorted")): launches
               for (op, args), launches in zip(calls, free, strict=True)}
    many = by_call[("topk", (2048, 8192), True)]  # 2048 rows: a finishing program a multiprocessor, a sort one a row
    assert [(name, grid) for _, name, grid in many[-2:]] == [("topk_finish_kernel", (sms,)),
                                                            ("topk_sort_kernel", (2048,))]
    per_sm = table["topk"]["BLOCK_PER_SM" if arch.startswith("sm") else "PROGRAMS_PER_SM"]
    rows = [grid for _, name, grid in many if name in ("topk_block_kernel", "topk_rows_kernel")]
    assert rows == [(min(2048, sms * per_sm),)]
    if many[0][1] == "topk_sample_kernel":  # rows sampled ahead (cuda table's BLOCK_SAMPLE_ROWS): a program a row
        assert many[0][2] == (2048,) and 2048 >= table["topk"]["BLOCK_SAMPLE_ROWS"]
    # The decode of 64 requests of 65536 keys (calls[3]: paged_mqa_logits of the second step), one group: every
    # multiprocessor's programs, the Triton kernel's the table's programs a SM, the Gluon kernel's one a SM (what it
    # takes where the compiled kernel's residency is unknown, as inside planning).
    [(_, name, grid)] = free[3]
    per_sm = 1 if _gluon(table, "paged_mqa_logits") else table["paged_mqa_logits"]["PROGRAMS_PER_SM"]
    assert calls[3][0] == "paged_mqa_logits" and grid == (1, sms * per_sm), name
    # The prefill of 4096 queries: a program a block up to every multiprocessor's programs.
    prefill = [launches for (op, args), launches in zip(calls, free, strict=True)
               if op == "mqa_logits" and args["q"].shape[0] == 4096]
    [[(_, name, grid)]] = prefill
    assert grid == ((sms,) if _gluon(table, "mqa_logits") else (sms * table["mqa_logits"]["PROGRAMS_PER_SM"],)), name


def test_persistent_programs_are_the_budget_below_the_device_else_the_device_fill():
    assert persistent_programs(132, 3) == 396
    with indexcache.sm_budget(7):
        assert persistent_programs(132, 3) == 7
        assert persistent_programs(7, 3) == 21  # a budget of the whole device is no budget
        assert persistent_programs(6, 3) == 18
    with indexcache.sm_budget(131):
        assert persistent_programs(132, 1) == 131


def test_split_chunk_under_a_budget():
    """Rows take at most budget // rows chunks (the split launches run at most the budget), none split where fewer
    than two chunks fit; a forced ``CHUNK`` is widened to fit; no budget keeps the device's split."""
    cfg = dict(cuda_tuning("sm90")["topk"], CHUNK=0)
    cols = 65536
    assert split_chunk(1, cols, 132, cfg) == 4096  # 1056 chunks wanted, MIN_CHUNK 4096: 16 chunks
    for rows, n in ((1, 7), (1, 33), (3, 7), (2, 5)):
        chunk = split_chunk(rows, cols, 132, cfg, n)
        assert chunk and 2 <= -(-cols // chunk) <= n // rows, (rows, n, chunk)
    assert split_chunk(1, cols, 132, cfg, 1) == 0
    assert split_chunk(4, cols, 132, cfg, 7) == 0  # 7 // 4 = 1 chunk a row: not split
    forced = dict(cfg, CHUNK=4096)
    assert split_chunk(1, cols, 132, forced) == 4096
    assert split_chunk(1, cols, 132, forced, 7) == 16384  # 65536 / 7 -> 9363 -> a power of two: 4 chunks
    assert split_chunk(2, cols, 132, forced, 3) == 0


# ------------------------------------------------------------------------------------ the custom op under torch.compile

def test_the_custom_ops_of_the_budgeted_ops_take_an_optional_symint_sm_budget_after_backend():
    for op in SPECS:
        schema = getattr(torch.ops.indexcache, op).default._schema
        names = [a.name for a in schema.arguments]
        assert names[-1] == "e8m0", op
        if op in SIX:
            assert names[-3:-1] == ["backend", "sm_budget"], op
            assert "SymInt? sm_budget" in str(schema), op
        else:
            assert names[-2] == "backend" and "sm_budget" not in names, op
    assert "SymInt? sm_budget" in library.schema("topk")


def test_a_compiled_call_with_a_budget_runs_under_it(monkeypatch):
    """``torch.compile(fullgraph=True)`` of a call with ``sm_budget=4``: one graph whose custom op carries 4, run
    under that budget and equal to eager; a compiled call without one runs under the block in force when it runs."""
    torch._dynamo.reset()
    seen = []
    call = dispatch.call

    def spy(op, args, backend=None):
        seen.append((op, budget.current()))
        return call(op, args, backend)

    monkeypatch.setattr(dispatch, "call", spy)
    graphs = []

    def count(gm, inputs):
        graphs.append(gm)
        return gm.forward

    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([50, 10, 3], dtype=I32)
    f = torch.compile(lambda s, n: indexcache.topk(s, n, 4, sm_budget=4, backend="torch") + 1, fullgraph=True,
                      backend=count)
    got = f(scores, lengths)
    assert torch.equal(got, indexcache.topk(scores, lengths, 4, backend="torch") + 1)
    [graph] = graphs
    [node] = [n for n in graph.graph.nodes if n.target is torch.ops.indexcache.topk.default]
    assert node.args[-3:] == ("torch", 4, [])
    assert seen == [("topk", 4)]
    seen.clear()
    g = torch.compile(lambda s, n: indexcache.topk(s, n, 4, backend="torch"), fullgraph=True, backend="aot_eager")
    with indexcache.sm_budget(6):
        g(scores, lengths)
    g(scores, lengths)
    assert seen == [("topk", 6), ("topk", None)]
    with pytest.raises(Exception, match=r"sm_budget: expected an int in \[1, "):
        torch.compile(lambda s, n: indexcache.topk(s, n, 4, sm_budget=0, backend="torch"), fullgraph=True,
                      backend="aot_eager")(scores, lengths)


# -------------------------------------------------------------------------------------------------------------- overlap

@pytest.mark.parametrize("bad", [-1, True, 1.5], ids=repr)
def test_overlap_checks_side_sms(bad):
    with pytest.raises(_error(bad), match=r"^side_sms: expected an int"):
        overlap(lambda: 0, lambda: 0, side_sms=bad)


@pytest.mark.parametrize(("named", "message"), [
    (dict(tokens=4), r"^tokens and context: expected both or neither, got tokens=4, context=None"),
    (dict(context=4096), r"^tokens and context: expected both or neither, got tokens=None, context=4096"),
    (dict(tokens=-1, context=8), r"^tokens: expected an int >= 0, got -1"),
    (dict(tokens=4, context=True), r"^context: expected an int, got bool True"),
])
def test_overlap_takes_tokens_and_context_together(named, message):
    with pytest.raises(TypeError if "bool" in message else ValueError, match=message):
        overlap(lambda: 0, lambda: 0, **named)


@pytest.mark.parametrize(("device", "error", "message"), [
    ("gpu", ValueError, r"^device: expected a device torch knows .* got 'gpu'"),
    (1.5, TypeError, r"^device: expected a torch.device, a device string or None, got float 1.5"),
])
def test_overlap_checks_the_device(device, error, message):
    with pytest.raises(error, match=message):
        overlap(lambda: 0, lambda: 0, device=device)


@pytest.mark.parametrize(("named", "error", "message"), [
    (dict(tokens=4, context=8, k_format=torch.float8_e4m3fn), TypeError,
     r"^k_format: expected None \(fp8 keys\) or torch.float4_e2m1fn_x2 \(MXFP4 keys\), got torch.float8_e4m3fn"),
    (dict(tokens=4, context=8, k_format="mxfp4"), TypeError, r"^k_format: expected None .* got 'mxfp4'"),
    (dict(k_format=torch.float4_e2m1fn_x2), ValueError,
     r"^k_format: picks the rule for tokens and context: expected it with both, got neither"),
])
def test_overlap_checks_the_key_format(named, error, message):
    with pytest.raises(error, match=message):
        overlap(lambda: 0, lambda: 0, **named)


def test_overlap_on_the_cpu_runs_in_order_whatever_the_share():
    calls = []
    for named in (dict(side_sms=0), dict(side_sms=5), dict(tokens=4, context=4096),
                  dict(tokens=4, context=4096, k_format=torch.float4_e2m1fn_x2)):
        assert overlap(lambda: calls.append("side") or 1, lambda: calls.append("main") or 2, **named) == (1, 2)
    assert calls == ["side", "main"] * 4


BANDS = ((8, 0, 0.25), (64, 4096, 0.5), (512, 0, None), (1024, 0, 0.0))
EAGER = ((8, 0, None),)  # eagerly: small batches overlap with no budget, the rest in order


@pytest.mark.parametrize(("tokens", "context", "want"), [
    (4, 100, 33),      # the first band: a quarter of 132
    (8, 100, 33),      # max_tokens is inclusive
    (4, 8192, 33),     # the first band that holds wins (the second would give 66)
    (32, 4096, 66),    # min_context is inclusive: the second band
    (32, 4095, None),  # the third band: share None, overlap with no budget
    (600, 4095, 0),    # the fourth band: share 0, in order
    (1024, 10**6, 0),
    (1025, 10**6, 0),  # no band: in order
])
def test_the_side_budget_is_the_first_matching_bands_share(tokens, context, want):
    assert triton_streams.side_budget(tokens, context, 132, BANDS) == want


def test_the_side_budget_is_clamped_to_leave_the_main_function_a_multiprocessor():
    assert triton_streams.side_budget(1, 1, 132, ((8, 0, 1.0),)) == 131
    assert triton_streams.side_budget(1, 1, 132, ((8, 0, 5.0),)) == 131
    assert triton_streams.side_budget(1, 1, 132, ((8, 0, 0.001),)) == 1
    assert triton_streams.side_budget(1, 1, 132, ((8, 0, -0.5),)) == 0
    assert triton_streams.side_budget(1, 1, 132, ()) == 0


MXFP4_GRAPH = ((64, 131072, 0.75),)  # MXFP4 keys' own graph bands (no eager ones: the EAGER bands hold)


def test_mxfp4_keys_take_the_rules_own_bands_where_it_has_them():
    rule = {"GRAPH": BANDS, "EAGER": EAGER, "GRAPH_MXFP4": MXFP4_GRAPH}
    fp4 = torch.float4_e2m1fn_x2
    assert triton_streams.rule_bands(rule, True) is BANDS
    assert triton_streams.rule_bands(rule, True, fp4) is MXFP4_GRAPH
    assert triton_streams.rule_bands(rule, False, fp4) is EAGER
    assert triton_streams.rule_bands({"GRAPH": BANDS, "EAGER": EAGER}, True, fp4) is BANDS


def test_the_cuda_tables_mxfp4_rule_gives_128k_decode_a_larger_partition():
    rule = cuda_tuning("sm90")["overlap"]
    fp4 = torch.float4_e2m1fn_x2

    def share(tokens, context, k_format=None):
        return triton_streams.side_budget(tokens, context, 132, triton_streams.rule_bands(rule, True, k_format))

    assert share(64, 131072, fp4) == 79 and share(64, 131072) == 64  # measured: 42 % hidden on 79, 19 % on 64
    assert share(64, 32768, fp4) == share(64, 32768) == 64  # measured: 64 the best with MXFP4 too
    for tokens, context in ((8, 131072), (1024, 131072), (5000, 1)):  # unmeasured with MXFP4: as fp8
        assert share(tokens, context, fp4) == share(tokens, context)


def test_the_cuda_tables_rule_gives_an_h100_a_third_of_the_sms_and_other_models_the_h200s_bands():
    rule = cuda_tuning("sm90")["overlap"]
    fp4 = torch.float4_e2m1fn_x2

    def share(name, tokens, context, k_format=None):
        bands = triton_streams.rule_bands(triton_streams.device_rule(rule, name), True, k_format)
        return triton_streams.side_budget(tokens, context, 132, bands)

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert [share(h100, t, c) for t, c in ((64, 131072), (64, 32768), (8, 131072), (1, 131072))] == [44] * 4
    assert [share(h200, t, c) for t, c in ((64, 131072), (64, 32768), (8, 131072), (1, 131072))] == [64, 64, None, None]
    assert share(h100, 8, 32768) is share(h100, 64, 4096) is share(h100, 1024, 32768) is None  # as the H200
    assert share(h100, 64, 131072, fp4) == 79 and share(h100, 64, 32768, fp4) == 44
    assert share(h100, 8, 131072, fp4) is None
    assert share("NVIDIA H800", 64, 131072) == share("NVIDIA GH200 480GB", 64, 131072) == 64  # unmeasured: the H200's
    assert triton_streams.device_rule(None, h100) is None
    plain = {"GRAPH": BANDS, "EAGER": EAGER}
    assert triton_streams.device_rule(plain, h100) is plain


def test_the_scheduler_asks_the_gpus_name_only_where_the_rule_has_bands_by_model(scheduler, monkeypatch):
    streams, fake = scheduler
    names = []
    monkeypatch.setattr(triton_streams, "device_name", lambda index: names.append(index) or "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert streams.share(gpu, None, 64, 131072) == (66, 132, True) and names == []
    streams.rule = {"GRAPH": BANDS, "EAGER": EAGER, "DEVICES": (("H200", {"GRAPH": ((256, 0, 0.25),)}),
                                                                ("H100", {"GRAPH": ((256, 0, 0.75),)}))}
    assert streams.share(gpu, None, 64, 131072) == (99, 132, True) and names == [0]
    fake.capturing = False  # the model's bands replace the rule's GRAPH ones only: EAGER stays
    assert streams.share(gpu, None, 4, 100) == (None, 132, True)


class _FakeStreams:
    """``torch.cuda``'s stream calls as :class:`DeviceStreams` makes them, recorded: no GPU here."""

    def __init__(self):
        self.log = []
        self.capturing = True

    def current_stream(self, device):
        return SimpleNamespace(wait_stream=lambda other: self.log.append("main waits side"))

    def Stream(self, device):  # noqa: N802 (torch.cuda.Stream)
        return SimpleNamespace(wait_stream=lambda other: self.log.append("side waits main"))

    def current_device(self):
        return 0

    def is_current_stream_capturing(self):
        return self.capturing

    @contextlib.contextmanager
    def stream(self, stream):
        self.log.append("on side")
        yield
        self.log.append("off side")


@pytest.fixture
def scheduler(monkeypatch):
    """A scheduler of the cuda backend on a 132-multiprocessor GPU, its device streams recorded."""
    monkeypatch.setattr(triton_streams, "sm_count", lambda index: 132)
    streams = triton_streams.DeviceStreams(2, "cuda", rule={"GRAPH": BANDS, "EAGER": EAGER})
    fake = _FakeStreams()
    streams._module = fake
    return streams, fake


def test_the_share_is_side_sms_else_the_rule_else_none(scheduler):
    streams, fake = scheduler
    gpu = torch.device("cuda", 0)
    assert streams.share(gpu, 5, None, None) == (5, 132, False)
    assert streams.share(gpu, 0, None, None) == (0, 132, False)
    assert streams.share(gpu, 131, 4, 100) == (131, 132, False)  # side_sms wins over the rule
    assert streams.share(gpu, None, 4, 100) == (33, 132, True)
    assert streams.share(gpu, None, 5000, 100) == (0, 132, True)
    fake.capturing = False  # eagerly, the rule's EAGER bands
    assert streams.share(gpu, None, 4, 100) == (None, 132, True)
    assert streams.share(gpu, None, 32, 8192) == (0, 132, True)
    fake.capturing = True
    streams.rule = {"GRAPH": BANDS, "EAGER": EAGER, "GRAPH_MXFP4": MXFP4_GRAPH}
    assert streams.share(gpu, None, 64, 131072, k_format=torch.float4_e2m1fn_x2) == (99, 132, True)
    assert streams.share(gpu, None, 64, 131072) == (66, 132, True)
    assert streams.share(gpu, None, None, None) == (None, 132, False)
    assert triton_streams.DeviceStreams(1, "cuda").share(gpu, None, 4, 100) == (None, 132, False)  # no rule
    for bad in (132, 500):
        with pytest.raises(ValueError, match=rf"^side_sms: expected fewer than the 132 multiprocessors of cuda:0 "
                                             rf"\(0: in order\), got {bad}"):
            streams.share(gpu, bad, None, None)
    assert fake.log == []  # the share touches no stream


def test_without_partitions_side_sms_is_a_budget_and_the_rules_share_no_budget(scheduler, monkeypatch):
    streams, fake = scheduler
    monkeypatch.setattr(triton_streams, "partition_stream", lambda *a, **k: None)  # none to be had (no green contexts)
    gpu = torch.device("cuda", 0)

    def side():
        return "side", budget.current()

    def main():
        return "main", budget.current()

    assert streams(side, main, 0, gpu, side_sms=20) == (("side", 20), ("main", 112))
    assert fake.log == ["side waits main", "on side", "off side", "main waits side"]
    fake.log.clear()
    # torch's matmuls in each function held to the same share (the carveout leaves the others free), then restored
    carveout = torch._C._get_sm_carveout_experimental
    assert streams(lambda: carveout(), lambda: carveout(), 0, gpu, side_sms=20) == (112, 20)
    assert carveout() is None
    fake.log.clear()
    # the rule's share (0.5) was measured with partitions: without one the two overlap with no budget
    assert streams(side, main, 1, gpu, tokens=32, context=8192) == (("side", None), ("main", None))
    with indexcache.sm_budget(9):  # no share within a budget: the side half of it, the main the rest (never 9 + 9)
        assert streams(side, main, 1, gpu) == (("side", 4), ("main", 5))
        # a rule's share without a partition, held as a budget within the enclosing one (0.25 of 132: 33, at most 8)
        assert streams(side, main, 1, gpu, tokens=4, context=100) == (("side", 8), ("main", 1))
        assert streams.prepare(1, gpu).how == "budget"
    with indexcache.sm_budget(1):  # in order, each under it
        assert streams(side, main, 1, gpu) == (("side", 1), ("main", 1))
    with indexcache.sm_budget(500):  # at or above the device's count: the whole device, no split
        assert streams(side, main, 1, gpu) == (("side", 500), ("main", 500))
    assert len(fake.log) == 16
    fake.log.clear()
    for named in (dict(side_sms=0), dict(tokens=5000, context=1)):  # in order on the current stream
        assert streams(side, main, 0, gpu, **named) == (("side", None), ("main", None))
    assert fake.log == []
    assert budget.current() is None


class _FakePartitions:
    """:func:`~indexcache.backends.triton.partition.partition_stream` recorded: each (device, n, side) made once."""

    def __init__(self, log):
        self.log, self.made, self.calls = log, {}, []

    def __call__(self, index, n, side=0, *, make=True):
        self.calls.append((index, n, side, make))
        if (index, n, side) not in self.made and make:
            self.made[(index, n, side)] = SimpleNamespace(
                wait_stream=lambda other, n=n: self.log.append(f"partition {n} waits main"))
        return self.made.get((index, n, side))


def _entered_streams(fake) -> list:
    """The streams the scheduler enters (``fake.stream`` recorded), in order."""
    entered = []

    @contextlib.contextmanager
    def on(stream):
        entered.append(stream)
        yield

    fake.stream = on
    return entered


@pytest.mark.parametrize("raising", ["side", "main"])
def test_a_function_that_raises_still_joins_the_side_stream(scheduler, monkeypatch, raising):
    """The current stream waits for the side's work even where a function raised (it was left unordered)."""
    streams, fake = scheduler
    monkeypatch.setattr(triton_streams, "partition_stream", lambda *a, **k: None)

    def fn(name):
        def run():
            if name == raising:
                raise RuntimeError(f"{name} failed")
            return name
        return run

    with pytest.raises(RuntimeError, match=f"{raising} failed"):
        streams(fn("side"), fn("main"), 0, torch.device("cuda", 0), side_sms=20)
    assert fake.log[-1] == "main waits side" and budget.current() is None


def test_two_threads_budget_blocks_leave_torchs_carveout_as_it_was_whatever_their_order():
    """Thread A enters a side's block (8 of 132), thread B a main's (100 of 132), A leaves, then B: while both run the
    last entered holds the process-wide carveout; after both, it is what it was before (it was left at 124)."""
    carveout = torch._C._get_sm_carveout_experimental
    before = carveout()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with triton_streams._held_to(8, 132):
            a_in.set()
            b_in.wait()
        a_out.set()

    def b():
        a_in.wait()
        with triton_streams._held_to(100, 132):
            b_in.set()
            a_out.wait()
            seen["b alone"] = carveout()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"b alone": 32} and carveout() == before


def test_with_partitions_the_side_runs_on_one_unbudgeted_and_the_main_keeps_the_device(scheduler, monkeypatch):
    streams, fake = scheduler
    parts = _FakePartitions(fake.log)
    monkeypatch.setattr(triton_streams, "partition_stream", parts)
    gpu = torch.device("cuda", 0)
    entered = _entered_streams(fake)

    def side():
        return "side", budget.current(), torch._C._get_sm_carveout_experimental()

    def main():
        return "main", budget.current(), torch._C._get_sm_carveout_experimental()

    fake.capturing = False
    assert streams(side, main, 0, gpu, side_sms=20) == (("side", None, None), ("main", None, None))
    assert entered == [parts.made[(0, 20, 0)]]
    assert fake.log == ["partition 20 waits main", "main waits side"]
    fake.log.clear()
    # eagerly the rule's EAGER band runs in order (32 x 8192), but the partition its GRAPH band names (0.5: 66) is
    # made now, so that a capture finds it; captured, the share takes it (side 3 is side stream 3 % 2 = 1)
    assert streams(side, main, 3, gpu, tokens=32, context=8192) == (("side", None, None), ("main", None, None))
    assert (0, 66, 1) in parts.made and fake.log == []
    fake.capturing = True
    assert streams(side, main, 3, gpu, tokens=32, context=8192) == (("side", None, None), ("main", None, None))
    assert entered[-1] is parts.made[(0, 66, 1)] and parts.calls[-1] == (0, 66, 1, False)
    # captured, a share whose partition was never made is not made (no capture-unsafe call): no budget, as without
    assert streams(side, main, 0, gpu, tokens=4, context=100) == (("side", None, None), ("main", None, None))
    assert parts.calls[-1] == (0, 33, 0, False) and (0, 33, 0) not in parts.made
    assert budget.current() is None


def test_an_eager_call_makes_the_partition_the_mxfp4_graph_bands_name(scheduler, monkeypatch):
    streams, fake = scheduler
    streams.rule = {"GRAPH": BANDS, "EAGER": EAGER, "GRAPH_MXFP4": MXFP4_GRAPH}
    parts = _FakePartitions(fake.log)
    monkeypatch.setattr(triton_streams, "partition_stream", parts)
    gpu, fp4 = torch.device("cuda", 0), torch.float4_e2m1fn_x2
    fake.capturing = False  # eagerly in order (EAGER), the graph's partition made for a later capture: 0.75 of 132
    assert streams(lambda: "side", lambda: "main", 0, gpu, tokens=64, context=131072, k_format=fp4) == ("side", "main")
    assert list(parts.made) == [(0, 99, 0)]
    fake.capturing = True
    fake.stream = contextlib.nullcontext
    assert streams(lambda: "side", lambda: "main", 0, gpu, tokens=64, context=131072, k_format=fp4) == ("side", "main")
    assert parts.calls[-1] == (0, 99, 0, False)


def test_an_eager_call_the_rule_runs_in_order_makes_its_graph_partition_once(scheduler, monkeypatch):
    streams, fake = scheduler
    parts = _FakePartitions(fake.log)
    monkeypatch.setattr(triton_streams, "partition_stream", parts)
    monkeypatch.setattr(streams, "share", None)  # the rule's in-order case decides without the general path
    gpu = torch.device("cuda", 0)
    fake.capturing = False
    for side in (0, 2, 0):  # side streams 0, 0, 0 (of 2): the graph band's partition (0.5 of 132) made once
        assert streams(lambda: "side", lambda: "main", side, gpu, tokens=32, context=8192) == ("side", "main")
    assert parts.calls == [(0, 66, 0, True)] and fake.log == []
    assert streams(lambda: "side", lambda: "main", 1, gpu, tokens=1000, context=8192) == ("side", "main")
    assert parts.calls == [(0, 66, 0, True)]  # no graph band gives 1000 tokens a share: nothing made
    # 100 tokens: the graph band of no share: nothing to make on the whole device, half of an enclosing budget's 100
    assert streams(lambda: "side", lambda: "main", 0, gpu, tokens=100, context=8192) == ("side", "main")
    with indexcache.sm_budget(100):
        assert streams(lambda: "side", lambda: "main", 0, gpu, tokens=100, context=8192) == ("side", "main")
    assert parts.calls == [(0, 66, 0, True), (0, 50, 0, True)]


def test_an_eager_call_given_side_sms_makes_no_partition_for_the_rule(scheduler, monkeypatch):
    """``side_sms`` wins over the rule: an eager call given it and the shape makes the partition of its own share (none
    for 0: in order), never the one the rule's graph band names for the shape (0.5: 66), also where it is refused."""
    streams, fake = scheduler
    parts = _FakePartitions(fake.log)
    monkeypatch.setattr(triton_streams, "partition_stream", parts)
    gpu = torch.device("cuda", 0)
    fake.capturing = False
    fake.stream = lambda stream: contextlib.nullcontext()
    shape = dict(tokens=32, context=8192)
    assert streams.prepare(0, gpu, side_sms=0, **shape) is IN_ORDER
    assert streams(lambda: "side", lambda: "main", 0, gpu, side_sms=20, **shape) == ("side", "main")
    with pytest.raises(ValueError, match=r"^side_sms: expected fewer than the 132 multiprocessors"):
        streams.prepare(1, gpu, side_sms=132, **shape)
    assert list(parts.made) == [(0, 20, 0)]


def test_a_schedule_is_decided_once_and_runs_as_the_call_would_have(scheduler, monkeypatch):
    streams, fake = scheduler
    parts = _FakePartitions(fake.log)
    monkeypatch.setattr(triton_streams, "partition_stream", parts)
    gpu = torch.device("cuda", 0)

    def side():
        return "side", budget.current()

    def main():
        return "main", budget.current()

    fake.capturing = False
    assert streams.prepare(0, gpu, tokens=32, context=8192) is IN_ORDER  # the EAGER bands: in order
    assert list(parts.made) == [(0, 66, 0)]  # and the graph band's partition made for a later capture
    fake.capturing = True
    decided = {"partition": streams.prepare(0, gpu, tokens=32, context=8192),
               "overlap": streams.prepare(1, gpu, tokens=4, context=100)}  # captured: 33's partition never made
    monkeypatch.setattr(triton_streams, "partition_stream", lambda *a, **k: None)
    decided["budget"] = streams.prepare(0, gpu, side_sms=20)
    assert {how: (s.how, s.side_sms) for how, s in decided.items()} == {
        "partition": ("partition", 66), "overlap": ("overlap", None), "budget": ("budget", 20)}
    monkeypatch.setattr(streams, "share", None)  # nothing is decided again when a schedule runs
    monkeypatch.setattr(streams, "partition", None)
    fake.log.clear()
    for _ in range(2):
        assert decided["partition"](side, main) == (("side", None), ("main", None))
        assert decided["budget"](side, main) == (("side", 20), ("main", 112))
        assert decided["overlap"](side, main) == (("side", None), ("main", None))
    ran = ["waits main", "on side", "off side", "main waits side"]
    assert fake.log == [f"{who} {step}" if step == "waits main" else step for who in ("partition 66", "side", "side")
                        for step in ran] * 2
    assert budget.current() is None



@pytest.mark.parametrize(("n", "outer", "want"), [
    (40, None, (40, 132)),   # no enclosing budget: the device
    (40, 100, (40, 100)),    # the side's share within it, the main the other 60
    (99, 100, (99, 100)),
    (100, 100, (99, 100)),   # the side keeps one fewer than the budget: the main keeps one
    (120, 100, (99, 100)),
    (40, 132, (40, 132)),    # a budget at or above the device's count is the whole device
    (40, 500, (40, 132)),
    (5, 2, (1, 2)),
    (5, 1, (0, 1)),          # under a budget of 1: in order
    (None, 100, (50, 100)),  # no share within a budget: half of it, the main the other half
    (None, 101, (50, 101)),
    (None, 1, (0, 1)),
    (None, 132, (None, 132)),  # the whole device: no share stays none
    (None, None, (None, 132)),
    (0, 100, (0, 100)),
])
def test_an_enclosing_budget_holds_the_side_share_and_the_pair(n, outer, want):
    assert triton_streams.within_budget(n, 132, outer) == want


def test_without_partitions_an_enclosing_budget_holds_the_side_and_the_main(scheduler, monkeypatch):
    """``with sm_budget(100): overlap(side, main, side_sms=40)``: the side under 40, the main under the other 60 (not
    the device's other 92), torch's matmuls to the same shares; the enclosing budget again after."""
    streams, fake = scheduler
    monkeypatch.setattr(triton_streams, "partition_stream", lambda *a, **k: None)
    gpu = torch.device("cuda", 0)
    carveout = torch._C._get_sm_carveout_experimental

    def side():
        return "side", budget.current(), carveout()

    def main():
        return "main", budget.current(), carveout()

    with indexcache.sm_budget(100):
        assert streams(side, main, 0, gpu, side_sms=40) == (("side", 40, 92), ("main", 60, 72))
        assert streams(side, main, 0, gpu, side_sms=120) == (("side", 99, 33), ("main", 1, 131))
        decided = streams.prepare(0, gpu, side_sms=120)
        assert (decided.how, decided.side_sms) == ("budget", 99)
        assert budget.current() == 100 and carveout() is None
    with indexcache.sm_budget(500):  # the whole device: as without
        assert streams(side, main, 0, gpu, side_sms=40) == (("side", 40, 92), ("main", 92, 40))
    fake.log.clear()
    with indexcache.sm_budget(1):  # no room for two: in order on the current stream, each under the budget
        assert streams.prepare(0, gpu, side_sms=40) is IN_ORDER
        assert streams(side, main, 0, gpu, side_sms=40) == (("side", 1, None), ("main", 1, None))
    assert fake.log == [] and budget.current() is None


def test_with_partitions_an_enclosing_budget_holds_the_partition_and_the_main(scheduler, monkeypatch):
    """Within ``sm_budget(100)`` the side's partition is of its share within the budget and the main runs under the
    budget's others (without one it keeps the whole device); the partition an eager call makes for the rule's graph
    band is the one a capture under the same budget takes."""
    streams, fake = scheduler
    parts = _FakePartitions(fake.log)
    monkeypatch.setattr(triton_streams, "partition_stream", parts)
    gpu = torch.device("cuda", 0)
    entered = _entered_streams(fake)
    fake.capturing = False

    def side():
        return "side", budget.current()

    def main():
        return "main", budget.current()

    with indexcache.sm_budget(100):
        assert streams(side, main, 0, gpu, side_sms=40) == (("side", 100), ("main", 60))
        assert entered[-1] is parts.made[(0, 40, 0)]
        assert streams(side, main, 0, gpu, side_sms=120) == (("side", 100), ("main", 1))
        assert entered[-1] is parts.made[(0, 99, 0)]
    with indexcache.sm_budget(500):  # the whole device: the main keeps it, as without a budget
        assert streams(side, main, 0, gpu, side_sms=40) == (("side", 500), ("main", 500))
    with indexcache.sm_budget(50):
        # eagerly in order (EAGER bands), the graph band's partition (0.5 of 132: 66) made within the budget: 49
        assert streams(side, main, 0, gpu, tokens=32, context=8192) == (("side", 50), ("main", 50))
        assert (0, 49, 0) in parts.made and (0, 66, 0) not in parts.made
        fake.capturing = True
        decided = streams.prepare(0, gpu, tokens=32, context=8192)
        assert (decided.how, decided.side_sms) == ("partition", 49)
        assert decided(side, main) == (("side", 50), ("main", 1))
        assert entered[-1] is parts.made[(0, 49, 0)]
    assert budget.current() is None

def test_the_gpu_backends_hand_their_tables_overlap_rule_to_the_scheduler():
    rule = {"GRAPH": BANDS, "EAGER": EAGER}
    impl = triton_streams.device_overlap("cuda", side_streams=2, rule=rule)
    assert impl.fn.rule is rule
    assert triton_streams.device_overlap("cuda", side_streams=2).fn.rule is None
