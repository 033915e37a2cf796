"""The ops' ``workspace`` argument (docs/ops.md, "Workspace"): a caller's workspace that is not a 1-D contiguous
uint8 tensor on the op's device, 4-byte aligned and apart from the other arguments is refused with a named error
(every backend: the spec check); the torch backend takes none (``indexcache.workspace_bytes`` is 0) and ignores a
given one, eagerly and compiled. On a CUDA GPU, two streams calling the ops at once get exactly their one-stream
results, and a captured graph replays on its workspace without allocating. The interpreted Triton checks (threads,
sizes) are in tests/kernels/test_triton_workspace.py."""

from __future__ import annotations

import pytest
import torch

import indexcache
from indexcache.hal import library, ops
from indexcache.hal.layout import new_packed_cache
from indexcache.hal.specs import SPECS

I32 = torch.int32
PAGE = 64
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (ci/gpu.sh runs it there)")


def _paged(gen: torch.Generator, batch: int, next_n: int, ctx: int, k: int, device="cpu", dim: int = 128,
           heads: int = 4) -> dict:
    """paged_topk_translate's arguments, outputs given: ``ctx`` keys a request, every page of the cache filled."""
    pages = -(-ctx // PAGE)
    cache = new_packed_cache(num_pages=batch * pages, page_size=PAGE, dim=dim, device=device)
    slots = torch.arange(batch * pages * PAGE, dtype=I32, device=device)
    indexcache.store_index_k(torch.randn(slots.numel(), dim, generator=gen).to(device), cache, slots)
    rows = batch * next_n
    return dict(q=torch.randn(batch, next_n, heads, dim, generator=gen).to(device, torch.float8_e4m3fn),
                k_cache=cache, weights=torch.rand(rows, heads, generator=gen).to(device),
                context_lens=torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen, dtype=I32).to(device),
                block_table=torch.randperm(batch * pages, generator=gen).to(device, I32).view(batch, pages),
                max_context_len=ctx, k=k, page_size=PAGE,
                page_table=torch.randint(0, 1 << 20, (batch, pages), generator=gen, dtype=I32).to(device),
                logits=torch.empty(rows, ctx, device=device), out=torch.empty(rows, k, dtype=I32, device=device),
                out_raw=torch.empty(rows, k, dtype=I32, device=device))


def _prefill(gen: torch.Generator, tokens: int, keys: int, k: int, device="cpu", heads: int = 4) -> dict:
    """mqa_topk_translate's arguments, outputs given: one request's causal prefill over ``keys`` keys."""
    ke = torch.arange(keys - tokens + 1, keys + 1, dtype=I32)
    return dict(q=torch.randn(tokens, heads, 128, generator=gen).to(device, torch.float8_e4m3fn),
                k=torch.randn(keys, 128, generator=gen).to(device, torch.float8_e4m3fn),
                k_scale=torch.rand(keys, generator=gen).to(device),
                weights=torch.rand(tokens, heads, generator=gen).to(device),
                ks=torch.zeros(tokens, dtype=I32, device=device), ke=ke.to(device), topk=k,
                page_table=torch.randint(0, 1 << 20, (1, -(-keys // PAGE)), generator=gen, dtype=I32).to(device),
                page_size=PAGE, row_to_batch=torch.zeros(tokens, dtype=I32, device=device),
                out=torch.empty(tokens, k, dtype=I32, device=device), out_raw=torch.empty(tokens, k, dtype=I32,
                                                                                          device=device))


def _args(op: str, gen: torch.Generator, device="cpu") -> dict:
    """Small arguments of ``op``, outputs given."""
    if op == "paged_topk_translate":
        return _paged(gen, 2, 2, 100, 8, device, dim=32, heads=2)
    if op == "mqa_topk_translate":
        return _prefill(gen, 6, 200, 16, device)
    scores = torch.randn(3, 200, generator=gen).to(device)
    args = dict(scores=scores, lengths=torch.tensor([200, 150, 5], dtype=I32, device=device), k=16,
                out=torch.empty(3, 16, dtype=I32, device=device))
    if op == "topk_translate":
        args.update(page_table=torch.randint(0, 50, (3, 4), generator=gen, dtype=I32).to(device), page_size=PAGE,
                    out_raw=torch.empty(3, 16, dtype=I32, device=device))
    return args




def test_the_ops_that_take_a_workspace():
    assert " ".join(ops.WORKSPACE_OPS) == "topk topk_translate paged_topk_translate mqa_topk_translate"
    with pytest.raises(ValueError, match="op: expected one of topk, topk_translate, paged_topk_translate, "
                                         "mqa_topk_translate .*, got 'translate'"):
        indexcache.workspace_bytes("translate", torch.zeros(1, 1, dtype=I32), torch.zeros(1, 1, dtype=I32),
                                   torch.zeros(1, dtype=I32), 1)


@pytest.mark.parametrize("op", ops.WORKSPACE_OPS)
@pytest.mark.parametrize(("workspace", "error", "message"), [
    (lambda args: bytearray(64), TypeError, "workspace: expected a torch.Tensor or None, got bytearray"),
    (lambda args: torch.empty(16, dtype=I32), TypeError, "workspace: expected dtype uint8 .*, got int32"),
    (lambda args: torch.empty(64, dtype=torch.uint8, device="meta"), ValueError,
     "workspace: expected a tensor on cpu, got one on meta"),
    (lambda args: torch.empty(8, 8, dtype=torch.uint8), ValueError,
     r"workspace: expected a 1-D contiguous tensor, got shape \[8, 8\]"),
    (lambda args: torch.empty(128, dtype=torch.uint8)[::2], ValueError,
     r"workspace: expected a 1-D contiguous tensor, got shape \[64\] strides \[2\]"),
    (lambda args: torch.empty(68, dtype=torch.uint8)[2:], ValueError,
     "workspace: expected a view that starts at a multiple of 4 bytes .*, got storage offset 2"),
    (lambda args: args["out"].view(-1).view(torch.uint8), ValueError,
     "workspace: expected a tensor that shares no memory .*, got one that overlaps out"),
])
def test_a_bad_workspace_is_refused_naming_it(op, workspace, error, message):
    """On every backend alike: these come from the spec check, before a backend is chosen."""
    args = _args(op, torch.Generator().manual_seed(0))
    with pytest.raises(error, match=message):
        getattr(indexcache, op)(**args, workspace=workspace(args), backend="torch")


@pytest.mark.parametrize("op", ops.WORKSPACE_OPS)
def test_the_torch_backend_takes_no_workspace_and_ignores_one(op):
    args = _args(op, torch.Generator().manual_seed(1))
    assert indexcache.workspace_bytes(op, **args, backend="torch") == 0
    want = getattr(indexcache, op)(**args, backend="torch").clone()
    args["out"].fill_(-5)
    workspace = torch.full((256,), 7, dtype=torch.uint8)
    assert torch.equal(getattr(indexcache, op)(**args, workspace=workspace, backend="torch"), want)
    assert (workspace == 7).all()


def test_a_workspace_is_a_mutated_optional_argument_under_compile():
    """The custom op's schema holds ``workspace`` as ``Tensor(x!)?``; opcheck passes with one given, and a
    ``torch.compile(fullgraph=True)`` function passing one equals eager."""
    assert "Tensor(b!)? workspace" in library.schema("topk")
    args = _args("topk", torch.Generator().manual_seed(2))
    workspace = torch.zeros(64, dtype=torch.uint8)
    checked = SPECS["topk"].check(**args, workspace=workspace)
    torch.library.opcheck(library.OPS["topk"], (*(checked[n] for n in library.PARAMS["topk"]), "torch", None))

    def step(scores, lengths, out, workspace):
        return indexcache.topk(scores, lengths, 16, out=out, workspace=workspace, backend="torch") + 1

    torch._dynamo.reset()
    want = step(args["scores"], args["lengths"], args["out"], workspace).clone()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(args["scores"], args["lengths"], args["out"],
                                                                   workspace)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------------- CUDA GPU


def _gpu_calls(gen: torch.Generator, dev: torch.device) -> dict[str, tuple[str, dict]]:
    """Per name ``(op, args)``, outputs given: the decode step's top-k (64 × 32K, k 2048: the block kernel on sm90),
    a few rows of 128K (split into chunks), the translating form of each, and the producer step with draft tokens."""
    def select(rows: int, cols: int, translate: bool) -> tuple[str, dict]:
        args = dict(scores=torch.randn(rows, cols, generator=gen).to(dev),
                    lengths=torch.randint(cols // 2, cols + 1, (rows,), generator=gen, dtype=I32).to(dev), k=2048,
                    out=torch.empty(rows, 2048, dtype=I32, device=dev))
        if not translate:
            return "topk", args
        pages = cols // PAGE
        return "topk_translate", dict(args, page_table=torch.randint(0, 1 << 20, (rows, pages), generator=gen,
                                                                     dtype=I32).to(dev),
                                      page_size=PAGE, out_raw=torch.empty(rows, 2048, dtype=I32, device=dev))

    return {"topk 64x32K": select(64, 32768, False), "topk 2x128K": select(2, 131072, False),
            "topk_translate 64x32K": select(64, 32768, True), "topk_translate 2x128K": select(2, 131072, True),
            "paged_topk_translate 8x2 8K": ("paged_topk_translate", _paged(gen, 8, 2, 8192, 512, dev))}


def _outputs(op: str, args: dict) -> list[torch.Tensor]:
    return [args[n] for n in ("logits", "out", "out_raw") if args.get(n) is not None]


@gpu
def test_two_streams_get_their_one_stream_results():
    """Two streams each calling every op 50 times, the same shapes on different inputs, with nothing ordering one
    stream against the other: every result equals, exactly, the call made alone."""
    dev = torch.device("cuda")
    calls = [_gpu_calls(torch.Generator().manual_seed(seed), dev) for seed in (0, 1)]
    want = []
    for mine in calls:
        want.append({})
        for name, (op, args) in mine.items():
            getattr(indexcache, op)(**args, backend="cuda")
            want[-1][name] = [t.clone() for t in _outputs(op, args)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    wrong = [torch.zeros((), dtype=torch.int64, device=dev) for _ in streams]
    for _ in range(50):
        for s, mine, expected, bad in zip(streams, calls, want, wrong, strict=True):
            with torch.cuda.stream(s):
                for name, (op, args) in mine.items():
                    getattr(indexcache, op)(**args, backend="cuda")
                    for got, w in zip(_outputs(op, args), expected[name], strict=True):
                        bad += (got != w).sum() if got.dtype != torch.float32 else (got.view(I32) != w.view(I32)).sum()
    torch.cuda.synchronize()
    assert [int(b) for b in wrong] == [0, 0]


@gpu
def test_a_captured_graph_replays_on_its_workspace_without_allocating():
    """The producer step's top-k captured in a CUDA graph (on the default workspace, then on a caller's): replays on
    new scores equal eager calls exactly, and neither a replay nor a later eager call allocates."""
    from indexcache.backends.triton import workspace as workspaces
    from indexcache.bench import capture_graph

    dev = torch.device("cuda")
    op, args = _gpu_calls(torch.Generator().manual_seed(3), dev)["topk_translate 64x32K"]
    noise = torch.Generator(device=dev).manual_seed(4)
    got = [torch.empty_like(args["out"]), torch.empty_like(args["out_raw"])]
    for given in (None, torch.empty(indexcache.workspace_bytes(op, **args, backend="cuda"), dtype=torch.uint8,
                                    device=dev)):
        def call(given=given):
            indexcache.topk_translate(**args, workspace=given, backend="cuda")

        before = workspaces.kept()
        graph = capture_graph(call, dev)
        if given is not None:
            assert workspaces.kept().keys() == before.keys(), "a caller's workspace, yet one was kept"
        for _ in range(3):  # the eager call's own workspace taken, its launches kept
            call()
        kept, allocated = workspaces.kept(), 0
        for _ in range(5):
            args["scores"].normal_(generator=noise)
            before = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
            graph.replay()
            got[0].copy_(args["out"]), got[1].copy_(args["out_raw"])
            call()
            allocated += torch.cuda.memory_stats(dev)["allocation.all.allocated"] - before
            assert torch.equal(got[0], args["out"]) and torch.equal(got[1], args["out_raw"])
        assert allocated == 0, "a replay or a kept eager call allocated"
        assert workspaces.kept().keys() == kept.keys()
