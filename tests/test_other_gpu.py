"""A call on a GPU other than the current one: Triton launches on the current GPU, so the op makes the tensors' GPU
current for the call (a launch on the wrong one would read another device's memory). Needs two GPUs."""

from __future__ import annotations

import pytest
import torch

import indexcache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two GPUs")


def test_ops_on_the_second_gpu_run_there_and_leave_the_current_one():
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(8, 4096, generator=gen).to(dev)
    lengths = torch.full((8,), 4000, dtype=torch.int32, device=dev)
    table = torch.randperm(64, generator=gen).to(torch.int32).reshape(1, 64).expand(8, 64).contiguous().to(dev)
    want = indexcache.topk_translate(scores.cpu(), lengths.cpu(), 256, table.cpu(), 64, backend="torch")
    out = torch.empty(8, 256, dtype=torch.int32, device=dev)
    for _ in range(3):  # the first call, the signature's second (kept from here), a kept one
        out.fill_(-7)
        got = indexcache.topk_translate(scores, lengths, 256, table, 64, out=out)
        assert torch.cuda.current_device() == 0
        assert got.device == dev
        assert torch.equal(got.cpu().sort(dim=1).values, want.sort(dim=1).values)
    raw = torch.tensor([[0, 70, -1, 5000]], dtype=torch.int32, device=dev)
    got = indexcache.translate(raw, table[:1], torch.tensor([4096], dtype=torch.int32, device=dev), 64)
    assert got.cpu().tolist() == indexcache.translate(raw.cpu(), table[:1].cpu(),
                                                      torch.tensor([4096], dtype=torch.int32), 64).tolist()


def test_the_custom_op_on_the_second_gpu_runs_there_compiled_or_called_directly():
    """aot_eager runs the graph with no device guard, and a direct ``torch.ops.indexcache.<op>`` call has none: the op's
    real implementation makes the tensors' GPU current itself."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(8, 4096, generator=gen).to(dev)
    lengths = torch.full((8,), 4000, dtype=torch.int32, device=dev)
    want = indexcache.topk(scores.cpu(), lengths.cpu(), 256, backend="torch").sort(dim=1).values
    out = torch.empty(8, 256, dtype=torch.int32, device=dev)
    compiled = torch.compile(lambda s, n, o: indexcache.topk(s, n, 256, out=o), fullgraph=True, backend="aot_eager")
    for call in (lambda: compiled(scores, lengths, out),
                 lambda: torch.ops.indexcache.topk(scores, lengths, 256, None, out, False, None, None, None)):
        out.fill_(-7)
        call()
        assert torch.cuda.current_device() == 0
        assert torch.equal(out.cpu().sort(dim=1).values, want)
