"""The GPU backends' HiSparse swap-in (``backends/triton/hisparse/swap.py``), interpreted on the CPU: the device KV
after the kernel equals ``indexcache.hal.hisparse.swap_in`` byte for byte, on the plans of a few steps from random
states and on hand-made copy lists that point everywhere they must not, for fp8, bf16 and odd row sizes; rows no
copy names, and the bytes between rows, stay as they were."""

from __future__ import annotations

import pytest
import torch

from indexcache.hal import hisparse as hs

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks"),
              pytest.mark.usefixtures("interpreted")]

I32, I64 = torch.int32, torch.int64


def _target_and_cfg(**override):
    """The interpreted cuda backend's target and its swap-in tuning entry (with ``override``)."""
    from indexcache.backends.cuda import NVIDIA
    from indexcache.backends.cuda.tuning import tuning
    from indexcache.backends.triton.target import detect

    target = detect(NVIDIA)[2]
    return target, {**tuning(target.arch)["hisparse_swap_in"], **override}


def _kv(g: torch.Generator, rows: int, dtype: torch.dtype, shape: tuple[int, ...], pad: int = 0) -> torch.Tensor:
    """``[rows, *shape]`` of ``dtype`` holding random bytes (fp8 NaNs included); with ``pad``, a view whose rows lie
    ``pad`` elements apart beyond their size, the gaps random too."""
    width = 1
    for n in shape:
        width *= n
    full = torch.randint(0, 256, (rows, (width + pad) * torch.empty((), dtype=dtype).element_size()), generator=g,
                         dtype=torch.uint8).view(dtype)
    return full[:, :width].unflatten(1, shape) if shape else full[:, 0]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of ``t``'s storage (gaps between rows included)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).clone()


def _u8(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, a row of them a row of ``t`` (rows of one element too)."""
    return t.unsqueeze(-1).view(torch.uint8)


def _swap(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch=None, **override):
    """The kernel's launch on ``device_kv`` (written in place)."""
    from indexcache.backends.triton.hisparse import swap

    target, cfg = _target_and_cfg(**override)
    assert swap.supports(target, copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch) == []
    for launch in swap.swap_launches(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch,
                                     target=target, cfg=cfg):
        launch()


def _check(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch=None, **override):
    """Runs the kernel on ``device_kv`` in place: the result equals the reference's byte for byte, and nothing
    between its rows was written. Returns the reference's result."""
    plan = hs.Plan(None, copy_src, copy_dst, copy_count, None, None)
    want = hs.swap_in(plan, host_kv, device_kv, device_loc, row_to_batch=row_to_batch)
    before = _bytes(device_kv)
    _swap(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch, **override)
    assert torch.equal(_u8(device_kv), _u8(want))
    changed = (_bytes(device_kv) != before).nonzero().flatten()
    row_bytes = device_kv[0].numel() * device_kv.element_size()
    stride = device_kv.stride(0) * device_kv.element_size()
    assert bool((changed % stride < row_bytes).all())  # nothing written between rows
    return want


ROWS = [(torch.uint8, (656,)), (torch.float8_e4m3fn, (656,)), (torch.bfloat16, (576,)), (torch.bfloat16, (2, 288)),
        (torch.uint8, (6,)), (torch.int16, (3,)), (torch.float32, ())]


@pytest.mark.parametrize(("dtype", "shape"), ROWS, ids=lambda v: str(v).removeprefix("torch."))
def test_the_plans_of_a_few_steps_equal_the_reference(dtype, shape):
    g = torch.Generator().manual_seed(40)
    batch, hot, k, length = 3, 8, 6, 40
    requests = torch.tensor([0, 2, 2, 1, 7], dtype=I32)  # two rows share request 2; 7: no request
    host_loc = torch.randperm(batch * length, generator=g).to(I32).view(batch, length)
    host_loc[0, 5] = -1  # a token not on the host
    host_kv = _kv(g, batch * length, dtype, shape)
    device_kv = _kv(g, batch * (hot + 1) + 3, dtype, shape, pad=1)  # rows one element apart: odd strides
    device_loc = torch.randperm(device_kv.shape[0], generator=g)[:batch * (hot + 1)].to(I32).view(batch, hot + 1)
    slot_token, slot_age = hs.empty_state(batch, hot)
    copies = 0
    for step in range(4):
        seq_lens = torch.tensor([20 + step, 6 + step, 30 + 2 * step], dtype=I32)  # request 1 short: no copies
        raw = torch.randint(-2, 32, (requests.shape[0], k), generator=g, dtype=I32)
        plan = hs.plan(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch=requests)
        slot_token, slot_age = plan.slot_token, plan.slot_age
        copies += int(plan.copy_count.sum())
        _check(plan.copy_src, plan.copy_dst, plan.copy_count, host_kv, device_kv, device_loc, requests)
    assert copies > 10


@pytest.mark.parametrize("loc_dtype", [I32, I64])
@pytest.mark.parametrize("with_r2b", [False, True])
def test_copies_pointing_outside_anything_are_skipped(loc_dtype, with_r2b):
    g = torch.Generator().manual_seed(41)
    rows, k, batch, width, nh, nd = 6, 7, 4, 5, 30, 12
    host_kv = _kv(g, nh, torch.float8_e4m3fn, (656,))
    device_kv = _kv(g, nd, torch.float8_e4m3fn, (656,))
    copy_src = torch.randint(0, nh, (rows, k), generator=g)
    copy_src[0, :4] = torch.tensor([-1, nh, 2**40, -(2**62)])  # negative and huge host rows
    copy_dst = torch.randint(0, width, (rows, k), generator=g, dtype=I32)
    copy_dst[1, :4] = torch.tensor([-1, width, 2**31 - 1, -(2**31)], dtype=I32)  # slots outside device_loc
    device_loc = torch.randint(0, nd, (batch, width), generator=g, dtype=loc_dtype)
    device_loc[:, 0] = -1  # an empty slot
    device_loc[:, 1] = nd  # past device_kv
    if loc_dtype == I64:
        device_loc[:, 2] = 2**40
    copy_count = torch.tensor([k, k, -3, k + 5, 2**31 - 1, 3], dtype=I32)  # negative and past k
    row_to_batch = torch.tensor([0, 3, 1, -1, 2, batch], dtype=I32) if with_r2b else None
    if not with_r2b:
        device_loc = torch.cat([device_loc, device_loc[:2]])  # a request a row
    before = device_kv.clone()
    _check(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch)
    assert not torch.equal(_u8(before), _u8(device_kv))  # some copies did land


def test_one_program_walks_many_blocks_of_a_row():
    """Few programs a row (one SM's worth, 2 copies a step) and long copy lists: each program strides its row."""
    g = torch.Generator().manual_seed(42)
    rows, k, nh, nd = 2, 40, 100, 90
    host_kv, device_kv = _kv(g, nh, torch.bfloat16, (576,)), _kv(g, nd, torch.bfloat16, (576,))
    copy_src = torch.randperm(nh, generator=g)[:rows * k].view(rows, k)
    copy_dst = torch.randperm(k, generator=g).to(I32).repeat(rows, 1)
    device_loc = torch.randperm(nd, generator=g)[:rows * k].to(I32).view(rows, k)
    copy_count = torch.tensor([k, 33], dtype=I32)
    before = device_kv.clone()
    _check(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, BLOCK_C=2, PROGRAMS_PER_SM=1)
    assert int((before.view(torch.int16) != device_kv.view(torch.int16)).any(dim=1).sum()) == k + 33


def _check_layers(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch=None):
    """A group's layers in the launches the kernel takes them in: each layer equals the reference's byte for byte,
    nothing between its rows written. Returns how many launches ran."""
    from indexcache.backends.triton.hisparse import swap

    plan = hs.Plan(None, copy_src, copy_dst, copy_count, None, None)
    want = hs.swap_in(plan, host_kv, device_kv, device_loc, row_to_batch=row_to_batch)
    before = [_bytes(d) for d in device_kv]
    target, cfg = _target_and_cfg()
    assert swap.supports(target, copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch) == []
    launches = swap.swap_launches(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc, row_to_batch,
                                  target=target, cfg=cfg)
    for launch in launches:
        launch()
    for d, w, b in zip(device_kv, want, before, strict=True):
        assert torch.equal(_u8(d), _u8(w))
        changed = (_bytes(d) != b).nonzero().flatten()
        row_bytes, stride = d[0].numel() * d.element_size(), d.stride(0) * d.element_size()
        assert bool((changed % stride < row_bytes).all())
    return len(launches)


def _group_plan(g, batch, hot, k, length):
    """A plan of two steps from an empty state (rows sharing requests), its ``device_loc`` and ``row_to_batch``."""
    requests = torch.tensor([0, 1, 1, 2], dtype=I32)
    host_loc = torch.randperm(batch * length, generator=g).to(I32).view(batch, length)
    slot_token, slot_age = hs.empty_state(batch, hot)
    seq_lens = torch.full((batch,), length, dtype=I32)
    for _ in range(2):
        raw = torch.randint(0, length, (requests.shape[0], k), generator=g, dtype=I32)
        plan = hs.plan(raw, seq_lens, host_loc, slot_token, slot_age, row_to_batch=requests)
        slot_token, slot_age = plan.slot_token, plan.slot_age
    device_loc = torch.randperm(batch * (hot + 1) + 5, generator=g)[:batch * (hot + 1)].to(I32).view(batch, hot + 1)
    return plan, device_loc, requests


def _token_major(g, rows, layers, dtype, shape):
    """``layers`` views of one allocation holding a token's rows of every layer together
    (``[rows, layers, *shape]``)."""
    pool = _kv(g, rows * layers, dtype, shape).view(rows, layers, *shape)
    return [pool[:, i] for i in range(layers)]


def test_a_groups_interleaved_layers_in_one_launch_equal_the_reference_layer_by_layer():
    g = torch.Generator().manual_seed(45)
    batch, hot, k, length = 3, 10, 8, 50
    plan, device_loc, requests = _group_plan(g, batch, hot, k, length)
    assert int(plan.copy_count.sum()) > 10
    host_kv = _token_major(g, batch * length, 4, torch.float8_e4m3fn, (656,))
    device_kv = [_kv(g, batch * (hot + 1) + 5, torch.float8_e4m3fn, (656,)) for _ in range(4)]
    assert _check_layers(*plan.copies, host_kv, device_kv, device_loc, requests) == 1


def test_layers_that_do_not_interleave_go_to_launches_of_their_own():
    g = torch.Generator().manual_seed(46)
    batch, hot, k, length = 3, 10, 8, 50
    plan, device_loc, requests = _group_plan(g, batch, hot, k, length)
    nh, nd = batch * length, batch * (hot + 1) + 5
    host_kv = _token_major(g, nh, 9, torch.bfloat16, (2, 5))  # 9 interleaved: 8 in a launch, 1 in the next
    host_kv.append(_kv(g, nh, torch.bfloat16, (2, 5), pad=3))  # pools of their own: a launch each
    host_kv.append(_kv(g, nh - 7, torch.bfloat16, (2, 5)))  # (fewer host rows: copies past them skipped)
    host_kv.append(_kv(g, 0, torch.bfloat16, (2, 5)))  # no host rows: no launch, the layer as it was
    host_kv += _token_major(g, nh, 2, torch.bfloat16, (2, 5))  # interleaved, but device rows of two strides
    device_kv = [_kv(g, nd, torch.bfloat16, (2, 5)) for _ in range(13)] + [_kv(g, nd, torch.bfloat16, (2, 5), pad=1)]
    assert _check_layers(*plan.copies, host_kv, device_kv, device_loc, requests) == 2 + 1 + 1 + 2


def test_one_host_tensor_read_by_every_layer_is_one_launch():
    from indexcache.backends.triton.hisparse import swap

    kv = [_kv(torch.Generator().manual_seed(0), 6, torch.uint8, (4,)) for _ in range(3)]
    assert swap._launch_groups((kv[0],) * 3, tuple(kv)) == [[0, 1, 2]]
    assert swap._launch_groups(tuple(kv), tuple(kv)) == [[0], [1], [2]]


def test_index_tensors_of_any_strides():
    g = torch.Generator().manual_seed(43)
    rows, k, nh, nd = 3, 5, 20, 16
    host_kv, device_kv = _kv(g, nh, torch.uint8, (6,), pad=3), _kv(g, nd, torch.uint8, (6,))
    copy_src = torch.randint(0, nh, (k, rows), generator=g).t()  # column-major
    copy_dst = torch.randint(0, 4, (rows, 2 * k), generator=g, dtype=I32)[:, ::2]
    copy_count = torch.tensor([5, 9, 2, 4, 1, 0], dtype=I32)[::2]
    device_loc = torch.randint(0, nd, (4, rows), generator=g, dtype=I64).t()
    _check(copy_src, copy_dst, copy_count, host_kv, device_kv, device_loc)


def test_nothing_to_copy_is_no_launch():
    from indexcache.backends.triton.hisparse import swap

    target, cfg = _target_and_cfg()
    kv = torch.zeros(4, 8, dtype=torch.uint8)
    empty = (torch.empty(0, 3, dtype=I64), torch.empty(0, 3, dtype=I32), torch.empty(0, dtype=I32))
    assert swap.swap_launches(*empty, kv, kv, torch.zeros(2, 3, dtype=I32), None, target=target, cfg=cfg) == []
    some = (torch.zeros(1, 3, dtype=I64), torch.zeros(1, 3, dtype=I32), torch.ones(1, dtype=I32))
    assert swap.swap_launches(*some, kv[:0], kv, torch.zeros(2, 3, dtype=I32), None, target=target, cfg=cfg) == []


def test_a_prepared_call_repeats_on_new_plans():
    """The op's ``prepare`` (bound launch, graph-style): the same addresses, new contents, the new copies."""
    from indexcache.backends.cuda.tuning import tuning
    from indexcache.backends.triton.hisparse import swap

    target, _ = _target_and_cfg()
    op = swap.ops(target, tuning(target.arch))["hisparse_swap_in"]
    g = torch.Generator().manual_seed(44)
    host_kv, device_kv = _kv(g, 20, torch.bfloat16, (576,)), _kv(g, 10, torch.bfloat16, (576,))
    copy_src, copy_dst = torch.zeros(2, 4, dtype=I64), torch.zeros(2, 4, dtype=I32)
    copy_count, device_loc = torch.zeros(2, dtype=I32), torch.randperm(10, generator=g).to(I32).view(2, 5)
    args = dict(copy_src=copy_src, copy_dst=copy_dst, copy_count=copy_count, host_kv=host_kv, device_kv=device_kv,
                device_loc=device_loc)
    run = op.prepare(**args)
    for _ in range(2):
        copy_src.copy_(torch.randint(0, 20, (2, 4), generator=g))
        copy_dst.copy_(torch.randint(0, 5, (2, 4), generator=g, dtype=I32))
        copy_count.copy_(torch.randint(0, 5, (2,), generator=g, dtype=I32))
        want = hs.swap_in(hs.Plan(None, copy_src, copy_dst, copy_count, None, None), host_kv, device_kv, device_loc)
        run()
        assert torch.equal(_u8(device_kv), _u8(want))
    assert op.fn(**args) is device_kv


def test_supports_names_what_it_cannot_read():
    from indexcache.backends.cuda import NVIDIA
    from indexcache.backends.triton.hisparse import swap

    interpreted, _ = _target_and_cfg()
    index = (torch.zeros(1, 2, dtype=I64), torch.zeros(1, 2, dtype=I32), torch.zeros(1, dtype=I32))
    kv, loc = torch.zeros(4, 2, 8), torch.zeros(1, 3, dtype=I32)
    assert swap.supports(interpreted, *index, kv, kv, loc) == []
    assert swap.supports(interpreted, *index, kv[:, :, ::2], kv, loc) == [
        "host_kv's rows are not contiguous (stride (16, 8, 2))"]
    gpu = NVIDIA.target("sm90")
    reasons = swap.supports(gpu, *index, kv, kv, loc)
    assert any(r.startswith("copy_src, copy_dst, copy_count, device_loc are on cpu") for r in reasons)
    assert any(r.startswith("device_kv is on cpu") for r in reasons)
    assert any(r.startswith("host_kv is in pageable host memory") for r in reasons)
    pinned = torch.zeros(4, 2, 8)
    with pytest.MonkeyPatch.context() as mp:  # no GPU here to pin memory with: a stand-in
        mp.setattr(torch.Tensor, "is_pinned", lambda t: t.data_ptr() == pinned.data_ptr())
        assert not any("host_kv" in r for r in swap.supports(gpu, *index, pinned, kv, loc))


def test_a_rows_byte_view_is_the_tensors_memory():
    from indexcache.backends.triton.hisparse import swap

    kv = torch.zeros(5, 2, 3, dtype=torch.bfloat16)[:, :, :]
    rows = swap.as_rows(kv[1:4])
    assert rows.shape == (3, 12) and rows.stride() == (12, 1) and rows.data_ptr() == kv[1].data_ptr()
    assert swap.as_rows(torch.zeros(7, 10)[:, 2:5]).stride() == (40, 1)
    with pytest.raises(ValueError, match="contiguous"):
        swap.as_rows(torch.zeros(4, 6)[:, ::2])
    assert [swap.unit(s) for s in (656, 1152, 6, 12, 4096)] == [16, 16, 2, 4, 16] and swap.unit(656, 6) == 2
