"""The GPU backends' producer step of prefill (``backends/triton/prefill_producer.py``), interpreted on the CPU: the
rows a pass takes under a bound (aligned, even, the workspace within the bound, refused below one row), a call in
many passes equal to the same call in one and to the torch backend's, the kept workspace no larger than the bound,
and a caller's workspace checked against what the call takes."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.backends.triton import prefill_producer, workspace

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks"),
              pytest.mark.usefixtures("interpreted", "one_thread")]

I32 = torch.int32


def _inputs(gen: torch.Generator, tokens: int, keys: int, k: int, heads: int = 4,
            fp8: torch.dtype = torch.float8_e4m3fn) -> dict:
    """One request's causal prefill of ``tokens`` queries over ``keys`` keys (random values), outputs given."""
    return dict(q=torch.randn(tokens, heads, 128, generator=gen).to(fp8),
                k=torch.randn(keys, 128, generator=gen).to(fp8),
                k_scale=torch.rand(keys, generator=gen) + 0.5, weights=torch.randn(tokens, heads, generator=gen),
                ks=torch.zeros(tokens, dtype=I32), ke=torch.arange(keys - tokens + 1, keys + 1, dtype=I32), topk=k,
                page_table=torch.randint(0, 1000, (1, keys // 16 + 1), generator=gen, dtype=I32), page_size=16,
                row_to_batch=torch.zeros(tokens, dtype=I32), out=torch.full((tokens, k), -7, dtype=I32),
                out_raw=torch.full((tokens, k), -7, dtype=I32))


def _target_and_tuning():
    """The interpreted cuda backend's target and its tuning table."""
    from indexcache.backends.cuda import NVIDIA
    from indexcache.backends.cuda.tuning import tuning
    from indexcache.backends.triton.target import detect

    target = detect(NVIDIA)[2]
    return target, tuning(target.arch)


def test_the_rows_of_a_pass_are_aligned_even_and_within_the_bound():
    target, table = _target_and_tuning()
    device = torch.device("cpu")
    tokens, keys, k = 1000, 5000, 64
    one_pass = prefill_producer.pass_rows(tokens, keys, device, k, 1 << 30, target=target, cfg=table["topk"])
    assert one_pass == tokens
    for limit in (40 * 4 * keys, 100 * 4 * keys, 333 * 4 * keys):
        rows = prefill_producer.pass_rows(tokens, keys, device, k, limit, target=target, cfg=table["topk"])
        assert rows % prefill_producer.ALIGN == 0 and 0 < rows < tokens
        passes = -(-tokens // rows)
        assert tokens - (passes - 1) * rows > rows - passes * prefill_producer.ALIGN  # the last pass not a sliver
        q, kk = torch.empty(tokens, 4, 128), torch.empty(keys, 128)
        assert prefill_producer.call_workspace_bytes(q, kk, kk[:, 0], q[:, :, 0], k, limit, target=target,
                                                     tuning=table) <= limit
    # Whole rounds of the logits launch where the bound holds one (else aligned rows).
    for quantum, limit in ((48, 100 * 4 * keys), (48, 333 * 4 * keys), (400, 333 * 4 * keys)):
        plain = prefill_producer.pass_rows(tokens, keys, device, k, limit, target=target, cfg=table["topk"])
        rows = prefill_producer.pass_rows(tokens, keys, device, k, limit, target=target, cfg=table["topk"],
                                          quantum=quantum)
        assert rows % quantum == 0 if plain >= quantum else rows == plain, (quantum, rows, plain)
    with pytest.raises(ValueError, match="workspace_bytes: expected at least .* bytes for 1000 queries over 5000 keys"):
        prefill_producer.pass_rows(tokens, keys, device, k, 4 * keys, target=target, cfg=table["topk"])


@pytest.mark.parametrize(("backend", "fp8"), [("cuda", torch.float8_e4m3fn), ("rocm", torch.float8_e4m3fnuz)])
def test_many_passes_equal_one_and_the_torch_backend(backend, fp8):
    gen = torch.Generator().manual_seed(0)
    args = _inputs(gen, 40, 300, 32, fp8=fp8)
    want = indexcache.mqa_topk_translate(**args, backend=backend).clone()
    want_raw = args["out_raw"].clone()
    args["out"].fill_(-7)
    args["out_raw"].fill_(-7)
    small = 16 * 4 * 300 + (32 << 10)  # about 16 rows a pass, a pass's top-k workspace and the windows
    got = indexcache.mqa_topk_translate(**args, workspace_bytes=small, backend=backend)
    assert torch.equal(got, want) and torch.equal(args["out_raw"], want_raw)
    ref = indexcache.mqa_topk_translate(**{**args, "out": None, "out_raw": None}, backend="torch")
    assert torch.equal(ref.sort(1).values, want.sort(1).values)


@pytest.mark.parametrize(("backend", "fp8"), [("cuda", torch.float8_e4m3fn), ("rocm", torch.float8_e4m3fnuz)])
def test_mxfp4_keys_widened_once_in_many_passes_equal_one_and_the_torch_backend(backend, fp8):
    """MXFP4 keys (every fifth with a block 2^20 below its others: one scale cannot hold it, its logits go by the exact
    path) widened in the first of many passes, inside the bound: the same selection as in one pass and on the torch
    backend."""
    from indexcache.hal import fp4

    gen = torch.Generator().manual_seed(1)
    args = _inputs(gen, 40, 300, 32, fp8=fp8)
    raw = torch.randn(300, 128, generator=gen) * 4
    raw[::5, :32] *= 2.0 ** -20
    args["k"], args["k_scale"] = fp4.quantize(raw)
    want = indexcache.mqa_topk_translate(**args, backend=backend).clone()
    args["out"].fill_(-7)
    small = 16 * 4 * 300 + 300 * 136 + (32 << 10)  # about 16 rows a pass, the keys widened, a pass's top-k, windows
    got = indexcache.mqa_topk_translate(**args, workspace_bytes=small, backend=backend)
    assert torch.equal(got, want)
    ref = indexcache.mqa_topk_translate(**{**args, "out": None, "out_raw": None}, backend="torch")
    assert torch.equal(ref.sort(1).values, want.sort(1).values)


def test_the_kept_workspace_stays_within_the_bound():
    gen = torch.Generator().manual_seed(1)
    args = _inputs(gen, 40, 300, 32)
    bound = 20 * 4 * 300 + (40 << 10)
    before = set(workspace.kept())
    indexcache.mqa_topk_translate(**args, workspace_bytes=bound, backend="cuda")
    grown = {key: buf for key, buf in workspace.kept().items() if key not in before}
    assert grown and all(4 * buf.numel() <= bound for buf in grown.values())


def test_a_callers_workspace_is_checked_and_used():
    gen = torch.Generator().manual_seed(2)
    args = _inputs(gen, 24, 200, 16)
    need = indexcache.workspace_bytes("mqa_topk_translate", **args, workspace_bytes=1 << 20, backend="cuda")
    assert 0 < need <= 1 << 20
    want = indexcache.mqa_topk_translate(**args, backend="cuda").clone()
    args["out"].fill_(-7)
    given = torch.zeros(need, dtype=torch.uint8)
    assert torch.equal(indexcache.mqa_topk_translate(**args, workspace=given, workspace_bytes=1 << 20,
                                                     backend="cuda"), want)
    assert given.any()  # the logits and windows went there
    with pytest.raises(ValueError, match="workspace"):
        indexcache.mqa_topk_translate(**args, workspace=given[:need - 64], workspace_bytes=1 << 20, backend="cuda")


def test_windows_all_short_take_one_launch_and_no_workspace():
    """No more keys than k: every window short, the call one launch with no scratch (even under a bound of one
    byte), equal to the torch backend's; windows short and long mixed equal it too (the short ones get no logits)."""
    from indexcache.backends.triton import producer

    target, table = _target_and_tuning()
    gen = torch.Generator().manual_seed(4)
    args = _inputs(gen, 30, 40, 48)
    args["ks"][::3] = -5  # windows clipped at both ends, one past the keys
    args["ke"][-1] = 90
    want = indexcache.mqa_topk_translate(**{**args, "out": None, "out_raw": None}, backend="torch")
    assert indexcache.workspace_bytes("mqa_topk_translate", **args, workspace_bytes=1, backend="cuda") == 0
    got = indexcache.mqa_topk_translate(**args, workspace_bytes=1, backend="cuda")
    assert torch.equal(got, want)
    launches = prefill_producer.launches(**{k: v for k, v in args.items() if k != "topk"}, topk_k=48,
                                         workspace_bytes_=1, target=target, tuning=table, options=None)
    assert [launch.launcher for launch in launches] == [producer.SHORT]
    mixed = _inputs(gen, 60, 200, 48)  # one request's causal prefill: the first windows at most k, the rest above
    mixed["ke"] = torch.arange(200 - 60 + 1, 201, dtype=I32) - torch.arange(60, dtype=I32).flip(0) * 2
    want = indexcache.mqa_topk_translate(**{**mixed, "out": None, "out_raw": None}, backend="torch")
    assert ((mixed["ke"] <= 48).any() and (mixed["ke"] > 48).any())
    assert torch.equal(indexcache.mqa_topk_translate(**mixed, backend="cuda").sort(1).values, want.sort(1).values)


def test_a_shorter_last_pass_under_an_sm_budget_stays_within_the_workspace(monkeypatch):
    """Planned as on a 132-multiprocessor GPU under a budget of 3: passes of 2 rows do not split (3 // 2 programs a
    row), a last pass of 1 row would (3), taking more scratch than a full pass, which was all the workspace held: its
    launches wrote through empty views (a segfault). The last pass now splits only where a full pass does; the
    workspace, exactly as large as asked, ends in a guard that stays untouched, and the selection is the torch
    backend's."""
    from indexcache.backends.triton.topk import plan

    monkeypatch.setattr(plan, "multiprocessors", lambda target, device: 132)
    monkeypatch.setattr(prefill_producer, "multiprocessors", lambda target, device: 132)
    args = _inputs(torch.Generator().manual_seed(0), 5, 5000, 64)
    target, table = _target_and_tuning()
    with indexcache.sm_budget(3):
        full = plan.shape_plan(2, 5000, torch.device("cpu"), 64, target, table["topk"])
        assert full.chunk == 0 and plan.shape_plan(1, 5000, torch.device("cpu"), 64, target, table["topk"]).chunk > 0
    bound = 4 * 2 * 16 + 4 * 2 * 5000 + 4 * sum(full.words)  # what a pass of 2 rows takes: passes of 2, 2 and 1
    named = dict(workspace_bytes=bound, sm_budget=3)
    n = indexcache.workspace_bytes("mqa_topk_translate", **args, **named, backend="cuda")
    buffer = torch.full((n + 4096,), 0x5A, dtype=torch.uint8)
    indexcache.mqa_topk_translate(**args, **named, workspace=buffer[:n], backend="cuda")
    assert buffer[n:].eq(0x5A).all()
    want = dict(args, out=torch.empty_like(args["out"]), out_raw=torch.empty_like(args["out_raw"]))
    indexcache.mqa_topk_translate(**want, backend="torch")
    assert torch.equal(args["out_raw"].sort(1).values, want["out_raw"].sort(1).values)
