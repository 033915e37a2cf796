"""overlap() and overlap_schedule(): the scheduler each backend serves, in-order semantics, and (on a GPU) the event
join, record_stream protection and CUDA-graph capture."""

import pytest
import torch

from indexcache.backends.torch.streams import in_order
from indexcache.backends.triton.streams import DeviceStreams, device_overlap
from indexcache.hal import dispatch
from indexcache.hal.contract import IN_ORDER, OpImpl
from indexcache.runtime.streams import overlap, overlap_schedule

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
# About 50 ms on an H200 at ~1.9 GHz: far longer than any launch latency.
SLEEP_CYCLES = 100_000_000


def test_cpu_runs_side_then_main_and_returns_both():
    calls = []
    out = overlap(lambda: calls.append("side") or "s", lambda: calls.append("main") or "m")
    assert out == ("s", "m")
    assert calls == ["side", "main"]


def test_cpu_tensors_are_served_in_order_by_torch(fresh_dispatch):
    args = dict(side_fn=None, main_fn=None, side=0, device=torch.device("cpu"))
    name, impl = fresh_dispatch.resolve("overlap", args)
    assert name == "torch"
    assert impl.fn is in_order


def test_every_backend_available_here_serves_overlap(fresh_dispatch):
    for name in fresh_dispatch.available_backends():
        assert "overlap" in fresh_dispatch.ops_of(name), name


def test_gpu_scheduler_refuses_cpu_tensors_and_interpreted_backends_run_in_order():
    impl = device_overlap("cuda", side_streams=2)
    [reason] = impl.supports(side_fn=None, main_fn=None, side=0, device=torch.device("cpu"))
    assert "GPU" in reason
    assert impl.supports(side_fn=None, main_fn=None, side=0, device=torch.device("cuda")) == []
    assert device_overlap("cpu", side_streams=2).fn is in_order


@pytest.mark.parametrize("bad", [-1, 1.0, True])
def test_side_index_is_checked(bad):
    error = ValueError if bad == -1 else TypeError  # a bool is not an int here
    with pytest.raises(error, match="side"):
        overlap(lambda: 0, lambda: 0, side=bad)
    with pytest.raises(error, match=r"^side: expected an int"):
        overlap_schedule(side=bad)


@pytest.mark.parametrize("bad", ["side_fn", "main_fn"])
def test_functions_that_are_not_callable_are_named_before_either_runs(bad):
    """A function that is not callable gave Python's "'str' object is not callable", naming neither; on a GPU the
    side function had already run when a bad main_fn failed."""
    ran = []
    fns = {"side_fn": lambda: ran.append("side"), "main_fn": lambda: ran.append("main"), bad: "not a function"}
    with pytest.raises(TypeError, match=f"{bad}: expected a function of no arguments, got str"):
        overlap(fns["side_fn"], fns["main_fn"])
    assert ran == []


def test_a_schedule_on_the_cpu_runs_side_then_main_whatever_the_shape():
    schedule = overlap_schedule(device="cpu", tokens=64, context=32768)
    assert schedule is IN_ORDER and (schedule.how, schedule.side_sms) == ("in order", 0)
    calls = []
    for _ in range(2):  # decided once, run as often as a forward has layers
        assert schedule(lambda: calls.append("side") or "s", lambda: calls.append("main") or "m") == ("s", "m")
    assert calls == ["side", "main"] * 2


def test_a_schedule_checks_its_arguments_as_overlap_does():
    with pytest.raises(ValueError, match=r"^tokens and context: expected both or neither, got tokens=4, context=None"):
        overlap_schedule(tokens=4)
    with pytest.raises(TypeError, match=r"^k_format: expected None \(fp8 keys\) or torch.float4_e2m1fn_x2"):
        overlap_schedule(tokens=4, context=5, k_format=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^side_sms: expected an int >= 0"):
        overlap_schedule(side_sms=-1)


def test_a_scheduler_without_prepare_is_asked_at_each_call(fresh_dispatch, monkeypatch):
    seen = []

    def scheduler(side_fn, main_fn, side, device, side_sms=None, tokens=None, context=None):
        seen.append((side, device.type, tokens, context))
        return side_fn(), main_fn()

    monkeypatch.setattr(dispatch, "scheduler", lambda args, backend=None: ("mine", OpImpl(scheduler)))
    schedule = overlap_schedule(device="cpu", side=1, tokens=3, context=9)
    assert (schedule.how, schedule.side_sms) == ("per call", None) and seen == []
    assert schedule(lambda: "s", lambda: "m") == ("s", "m")
    assert schedule(lambda: 1, lambda: 2) == (1, 2)
    assert seen == [(1, "cpu", 3, 9)] * 2


def test_a_schedule_made_while_compiling_runs_in_order(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(dispatch, "scheduler", None)  # not asked
    assert overlap_schedule(device="cuda", side_sms=4) is IN_ORDER


@pytest.mark.parametrize("bad", [0, -2, 2.0])
def test_side_stream_count_is_checked(bad):
    with pytest.raises(ValueError, match="side_streams"):
        DeviceStreams(bad, "cuda")


@gpu
def test_join_main_reads_what_the_sleeping_side_stream_wrote():
    x = torch.zeros(1, device="cuda")

    def side():
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)

    overlap(side, lambda: None, device="cuda")
    seen = x.clone()  # enqueued on the main stream right after the join
    torch.cuda.synchronize()
    assert seen.item() == 1.0


@gpu
def test_without_the_join_main_would_read_too_early():
    """Control for the test above: the same side work with no join is still running when main reads."""
    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(1.0)
    seen = x.clone()
    torch.cuda.synchronize()
    assert seen.item() == 0.0


def _device_streams() -> DeviceStreams:
    """The scheduler serving GPU tensors here; skips unless it uses device streams."""
    args = dict(side_fn=None, main_fn=None, side=0, device=torch.device("cuda"))
    name, impl = dispatch.resolve("overlap", args)
    if not isinstance(impl.fn, DeviceStreams):
        pytest.skip(f"overlap on GPU tensors is served by {name!r}, which runs in order")
    return impl.fn


@gpu
def test_side_made_tensors_are_protected_with_record_stream():
    streams = _device_streams()
    n = 1 << 20

    def side():
        torch.cuda._sleep(SLEEP_CYCLES // 10)
        return torch.full((n,), 7.0, device="cuda")

    made, _ = overlap(side, lambda: None, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)  # main is busy, then reads the side-made tensor
    total = made.sum()
    del made
    # The side stream allocates the same size at once: without record_stream it would get the block
    # that main has yet to read, and zero it before main reads.
    with torch.cuda.stream(streams.stream(torch.device("cuda"), 0)):
        torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    assert total.item() == 7.0 * n


@gpu
def test_side_and_main_run_concurrently():
    _device_streams()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    overlap(lambda: torch.cuda._sleep(1000), lambda: None, device="cuda")  # creates the streams
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    torch.cuda.synchronize()
    alone = start.elapsed_time(end)
    start.record()
    overlap(lambda: torch.cuda._sleep(SLEEP_CYCLES), lambda: torch.cuda._sleep(SLEEP_CYCLES), device="cuda")
    end.record()
    torch.cuda.synchronize()
    assert start.elapsed_time(end) < 1.5 * alone


@gpu
@pytest.mark.parametrize("side_sms", [None, 16], ids=["no share", "a partition"])
@pytest.mark.parametrize("decided", ["per call", "once"])
def test_captured_overlap_replays_like_the_sequential_order(side_sms, decided):
    if side_sms is not None:
        _partitions()
    a = torch.zeros(4096, device="cuda")
    b = torch.zeros(4096, device="cuda")
    side_out = torch.empty_like(a)
    main_out = torch.empty_like(b)

    def step():
        side, main = lambda: side_out.copy_(a * 2 + 1), lambda: main_out.copy_(b.sin())
        if decided == "once":  # the forward's schedule, made inside the capture and run by two layers
            schedule = overlap_schedule(device="cuda", side_sms=side_sms)
            assert schedule.how == ("overlap" if side_sms is None else "partition")
            schedule(side, main)
            schedule(side, main)
        else:
            overlap(side, main, device="cuda", side_sms=side_sms)
        return side_out + main_out

    step()  # warm-up creates the side streams (and the partition, which a capture only looks up) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    for seed in range(5):
        g = torch.Generator(device="cuda").manual_seed(seed)
        a.copy_(torch.randn(a.shape, device="cuda", generator=g))
        b.copy_(torch.randn(b.shape, device="cuda", generator=g))
        graph.replay()
        torch.testing.assert_close(result, a * 2 + 1 + b.sin(), rtol=0, atol=0)


def _partitions() -> None:
    """Skips unless this GPU and torch make SM partitions (CUDA green contexts with streams)."""
    from indexcache.backends.triton import partition

    _device_streams()
    if not partition.available() or partition.partition_stream(torch.cuda.current_device(), 16) is None:
        pytest.skip("no SM partitions here (a ROCm build, or torch / the driver without green contexts)")


@gpu
def test_a_partition_holds_every_kernel_of_the_side_to_its_multiprocessors():
    import triton
    import triton.language as tl

    @triton.jit
    def where_kernel(out_ptr):
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), sm)

    _partitions()
    programs = 64 * torch.cuda.get_device_properties(0).multi_processor_count
    side_sms = torch.full((programs,), -1, device="cuda", dtype=torch.int32)
    main_sms = torch.full((programs,), -1, device="cuda", dtype=torch.int32)
    overlap(lambda: where_kernel[(programs,)](side_sms), lambda: where_kernel[(programs,)](main_sms), device="cuda",
            side_sms=16)
    torch.cuda.synchronize()
    assert side_sms.min().item() >= 0
    assert side_sms.unique().numel() <= 16 < main_sms.unique().numel()  # the main function keeps the whole device


def test_no_partition_without_a_cuda_gpu_or_green_contexts(monkeypatch):
    from indexcache.backends.triton import partition

    monkeypatch.setattr(partition, "_PARTITIONS", {})
    monkeypatch.setattr(partition, "available", lambda: False)
    assert partition.partition_stream(0, 64) is None
    assert partition.partition_stream(0, 64, make=False) is None  # remembered: asked once
    assert partition._PARTITIONS == {(0, 64, 0): None}


def test_the_scheduler_is_resolved_once_per_device_and_choice(fresh_dispatch, monkeypatch):
    resolved = []
    real = dispatch.resolve

    def counting(op, args, backend=None):
        resolved.append((op, backend))
        return real(op, args, backend)

    monkeypatch.setattr(dispatch, "resolve", counting)
    for _ in range(3):
        assert overlap(lambda: 1, lambda: 2, device="cpu") == (1, 2)
    assert resolved == [("overlap", None)]
    assert overlap(lambda: 1, lambda: 2, device="cpu", backend="torch") == (1, 2)  # another choice: resolved anew
    assert resolved == [("overlap", None), ("overlap", "torch")]
    dispatch.reset()  # forgets them
    overlap(lambda: 1, lambda: 2, device="cpu")
    assert len(resolved) == 3
