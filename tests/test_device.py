"""Device facts (indexcache.hal.device): how many blocks of a kernel an NVIDIA multiprocessor holds; a call on a GPU
other than the current one makes that GPU current, eagerly and as the custom op."""

import contextlib

import pytest
import torch

import indexcache
from indexcache.hal import device, dispatch, library
from indexcache.hal.device import resident_blocks
from indexcache.hal.specs import SPECS

H200 = (65536, 228 * 1024, 2048)  # registers, shared bytes and threads a multiprocessor


@pytest.mark.parametrize(("registers", "shared", "threads", "blocks"), [
    (78, 33_824, 128, 6),  # the decode kernel at next_n 1 (ncu on the H200: block limit 6 by both)
    (112, 33_824, 128, 4),  # the same, uncapped under the persistent schedule (ncu: 4 by registers)
    (145, 33_824, 128, 3),  # next_n 2 (ncu: 3 by registers)
    (184, 43_520, 128, 2),  # next_n 2 uncapped (ncu: 2 by registers)
    (96, 146_872, 640, 1),  # DeepGEMM's decode kernel (ncu: 1 by registers and by shared memory)
    (32, 0, 1024, 2),  # by threads
    (16, 0, 32, 32),  # at most 32 blocks
])
def test_resident_blocks_as_ncu_counts_them(registers, shared, threads, blocks):
    assert resident_blocks(registers, shared, threads, H200) == blocks


def test_a_call_on_another_gpu_runs_with_that_gpu_current_eagerly_and_as_the_custom_op(monkeypatch):
    """No second GPU here: ``device.other_gpu`` says the tensors are on GPU 1 while GPU 0 is current. The eager call
    and the custom op's real implementation (what a compiled graph without Inductor's device guard runs, or a direct
    ``torch.ops.indexcache.<op>`` call) both pick their backend with GPU 1 current, and leave GPU 0 current after."""
    current, seen = [0], []

    @contextlib.contextmanager
    def gpu(index):  # torch.cuda.device
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    def resolving(*args, **kwargs):
        seen.append(current[0])
        return resolve(*args, **kwargs)

    resolve = dispatch.resolve_choice
    monkeypatch.setattr(device, "other_gpu", lambda t: 1 if isinstance(t, torch.Tensor) and current[0] != 1 else None)
    monkeypatch.setattr(torch.cuda, "device", gpu)
    monkeypatch.setattr(dispatch, "resolve_choice", resolving)
    raw = torch.tensor([[0, 3, -1]], dtype=torch.int32)
    table, lens = torch.tensor([[5, 7]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    assert indexcache.translate(raw, table, lens, 2, backend="torch").tolist() == [[10, 15, -1]]
    assert seen == [1] and current == [0]
    out = torch.full((1, 3), -7, dtype=torch.int32)
    checked = SPECS["translate"].check(raw, table, lens, 2, out=out)
    library.OPS["translate"](*library.op_arguments("translate", checked, "torch"))
    assert out.tolist() == [[10, 15, -1]]
    assert seen == [1, 1] and current == [0]


def test_a_cpu_tensor_or_no_tensor_asks_for_no_gpu():
    assert device.other_gpu(torch.zeros(1)) is None
    assert device.other_gpu(None) is None
