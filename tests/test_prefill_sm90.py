"""The Hopper prefill kernel in Gluon (``backends/triton/prefill_sm90.py``): which calls it takes, and, on an sm90 GPU,
the Triton kernel's logits (to fp32 rounding of the head sum) with -inf in the same places.

Gluon kernels do not run under the interpreter: off Hopper only the host side is checked here (the kernel is built
for sm90 by the cross-compile check). ``ci/gpu.sh`` runs the GPU cases on the H200.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from indexcache.backends import cuda as cuda_backend  # noqa: E402
from indexcache.backends.cuda.arch import NVIDIA  # noqa: E402
from indexcache.backends.triton import logits, prefill_fp4, prefill_sm90  # noqa: E402
from indexcache.backends.triton.target import detect  # noqa: E402
from indexcache.hal import fp4  # noqa: E402

FP8 = torch.float8_e4m3fn
HOPPER = NVIDIA.target("sm90")


def _on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _args(tokens=4, keys=256, heads=64, dim=128):
    q = torch.zeros(tokens, heads, dim, dtype=FP8)
    k = torch.zeros(keys, dim, dtype=FP8)
    return q, k, torch.ones(keys), torch.zeros(tokens, heads), torch.zeros(tokens, keys)


def test_takes_hopper_fp8_heads_of_dim_128():
    for heads in (64, 128):
        q, k, scale, w, out = _args(heads=heads)
        assert prefill_sm90.unsupported(q, k, scale, w, out, HOPPER) == []


@pytest.mark.parametrize(("change", "reason"), [
    ({"target": NVIDIA.target("sm100")}, "sm100: Hopper"),
    ({"target": NVIDIA.target("sm90", interpreted=True)}, "sm90 interpreted"),
    ({"dtype": torch.bfloat16}, "q dtype torch.bfloat16"),
    ({"dim": 64}, "of dim 64"),
    ({"heads": 32}, "32 heads"),
    ({"keys": 0}, "non-empty contiguous [N, 128]"),
    ({"strided_k": True}, "non-empty contiguous [N, 128]"),
    ({"strided_q": True}, "q must be a non-empty contiguous"),
    ({"strided_out": True}, "unit strides"),
    ({"mxfp4": True}, "keys in q's fp8 format only"),
    ({"scale_offset": 1}, "k_scale must be aligned to 16 bytes"),
])
def test_declines_with_the_reason(change, reason):
    q, k, scale, w, out = _args(heads=change.get("heads", 64), dim=change.get("dim", 128), keys=change.get("keys", 256))
    if "dtype" in change:
        q = q.to(change["dtype"])
    if change.get("strided_k"):
        k = torch.zeros(k.shape[0], 2 * k.shape[1], dtype=FP8)[:, ::2]
    if change.get("strided_q"):
        q = torch.zeros(q.shape[1], q.shape[0], q.shape[2], dtype=FP8).transpose(0, 1)
    if change.get("strided_out"):
        out = torch.zeros(out.shape[1], out.shape[0]).t()
    if change.get("mxfp4"):
        k, scale = fp4.quantize(torch.randn(k.shape[0], 128))
    if "scale_offset" in change:
        scale = torch.ones(k.shape[0] + 1)[change["scale_offset"]:]
    reasons = prefill_sm90.unsupported(q, k, scale, w, out, change.get("target", HOPPER))
    assert any(reason in r for r in reasons), reasons


def _case(tokens, keys, heads, windows, seed):
    """Random fp8 q and k, positive scales, signed weights; ``windows``: "causal" (each token sees the keys up to its
    own position in the last ``tokens`` of the keys) or "ragged" (random windows, empty, negative and past ``N``)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(tokens, heads, 128, generator=g) * 3).clamp(-200, 200).to(FP8)
    k = (torch.randn(keys, 128, generator=g) * 3).clamp(-200, 200).to(FP8)
    scale = torch.rand(keys, generator=g) + 0.1
    w = torch.randn(tokens, heads, generator=g)
    if windows == "causal":
        ke = torch.arange(keys - tokens + 1, keys + 1, dtype=torch.int32).clamp(min=0)
        ks = torch.zeros(tokens, dtype=torch.int32)
    else:
        ks = torch.randint(-20, keys + 20, (tokens,), dtype=torch.int32, generator=g)
        ke = ks + torch.randint(-30, keys, (tokens,), dtype=torch.int32, generator=g)
    return q, k, scale, w, ks, ke


_CASES = [
    # (tokens, keys, heads, windows): odd token counts (a partial last block), keys not a multiple of the tile
    (1, 1, 64, "ragged"),
    (3, 100, 64, "causal"),
    (130, 1000, 64, "ragged"),
    (257, 3000, 64, "causal"),
    (63, 700, 128, "causal"),
    (33, 700, 128, "ragged"),
    # More blocks than programs: each program walks several blocks, its ring index running on.
    (2048, 4100, 64, "causal"),
]


@pytest.mark.parametrize(("tail", "parts", "busiest"), [
    (0, 1, 0.0), (68, 7, 4 / 7), (100, 5, 4 / 5), (1, 8, 1 / 8), (131, 1, 1.0), (66, 2, 1 / 2)])
def test_a_last_partial_rounds_blocks_are_cut_so_every_program_ends_about_together(tail, parts, busiest):
    assert prefill_sm90.tail_parts(tail, 132) == parts
    assert -(-tail * parts // 132) / parts == pytest.approx(busiest)  # the busiest program's share of a block


def test_the_launch_takes_whole_rounds_then_the_last_rounds_parts():
    # 4096 tokens of 64 heads: 2048 blocks of two tokens over 132 programs, 15 whole rounds (1980 blocks) and 68
    # blocks cut into 7 parts each (the busiest program does 4/7 of a block there instead of a whole one).
    q, k, scale, w, out = _args(tokens=4096, keys=256)
    ks = ke = torch.zeros(4096, dtype=torch.int32)
    cfg = {**cuda_backend.tuning("sm90")["mqa_logits"], "TMA_STAGES": 4}
    launch = prefill_sm90.launch(q, k, scale, w, ks, ke, out, cfg=cfg, sms=132)
    assert launch.grid == (132,) and launch.args[-3:] == (1980 + 68 * 7, 1980, 7)
    small = prefill_sm90.launch(q[:200], k, scale, w[:200], ks[:200], ke[:200], out[:200], cfg=cfg, sms=132)
    assert small.grid == (100,) and small.args[-3:] == (100, 100, 1)  # fewer blocks than multiprocessors


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
@pytest.mark.parametrize("case", _CASES, ids=lambda c: f"t{c[0]}-n{c[1]}-h{c[2]}-{c[3]}")
@pytest.mark.parametrize("stages", [2, 4])
def test_equals_the_triton_kernel_on_hopper(case, stages):
    target = detect(NVIDIA)[2]
    table_cfg = cuda_backend.tuning(target.arch)["mqa_logits"]
    args = [a.cuda() for a in _case(*case, seed=len(_CASES) * stages)]
    outs = []
    for cfg in ({**table_cfg, "KERNEL": "triton"}, {**table_cfg, "KERNEL": "tma-ws", "TMA_STAGES": stages}):
        buf = torch.full((case[0] + 2, case[1]), float("nan"), device="cuda")
        logits.mqa_logits(*args, buf[1:-1], target=target, cfg=cfg)
        assert buf[0].isnan().all() and buf[-1].isnan().all(), "a kernel wrote outside its output"
        outs.append(buf[1:-1])
    triton_out, tma_out = outs
    assert not tma_out.isnan().any()
    finite = triton_out.isfinite()
    assert torch.equal(finite, tma_out.isfinite()) and torch.equal(triton_out[~finite], tma_out[~finite])
    # The same fp8 products and fp32 matmul; the head sums may add in another order.
    if finite.any():
        assert (triton_out[finite] - tma_out[finite]).abs().max() <= 1e-5 * triton_out[finite].abs().max()


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
@pytest.mark.parametrize("case", [_CASES[2], _CASES[3], _CASES[6]], ids=lambda c: f"t{c[0]}-n{c[1]}-{c[3]}")
def test_the_producers_short_rows_and_no_fill_as_the_triton_kernel(case):
    """The producer step's launch (``skip`` its k, ``fill`` off): inside every row's window longer than ``skip`` the
    logits are the full launch's, bit for bit, and near the Triton kernel's wherever both wrote a finite value."""
    target = detect(NVIDIA)[2]
    table_cfg = cuda_backend.tuning(target.arch)["mqa_logits"]
    q, k, scale, w, ks, ke = [a.cuda() for a in _case(*case, seed=3)]
    skip = 300
    outs = []
    for cfg in ({**table_cfg, "KERNEL": "triton"}, {**table_cfg, "KERNEL": "tma-ws"}):
        buf = torch.full((case[0] + 2, case[1]), float("nan"), device="cuda")
        for launch in logits.mqa_logits_launches(q, k, scale, w, ks, ke, buf[1:-1], target=target, cfg=cfg, skip=skip,
                                                 fill=False):
            launch()
        assert buf[0].isnan().all() and buf[-1].isnan().all(), "a kernel wrote outside its output"
        outs.append(buf[1:-1])
    triton_out, tma_out = outs
    start = ks.long().clamp(0, case[1])
    length = (torch.maximum(ke.long().clamp(max=case[1]), start) - start)
    cols = torch.arange(case[1], device="cuda")
    inside = (cols >= start[:, None]) & (cols < (start + length)[:, None]) & (length > skip)[:, None]
    assert inside.any() and not tma_out[inside].isnan().any()
    full = logits.mqa_logits(q, k, scale, w, ks, ke, torch.empty_like(tma_out), target=target,
                             cfg={**table_cfg, "KERNEL": "tma-ws"})
    assert torch.equal(tma_out[inside], full[inside])
    both = tma_out.isfinite() & triton_out.isfinite()
    assert (triton_out[both] - tma_out[both]).abs().max() <= 1e-5 * triton_out[both].abs().max()


def _fp4_case(tokens, keys, heads, windows, seed):
    """:func:`_case` with MXFP4 keys written by the reference rule: most with block scales close together (one scale a
    key), every seventh with blocks 2^20 apart (the exact path), one with a NaN block scale (byte 255)."""
    q, _, _, w, ks, ke = _case(tokens, keys, heads, windows, seed)
    g = torch.Generator().manual_seed(seed + 1)
    raw = torch.randn(keys, 128, generator=g) * 3
    raw[::7] *= torch.exp2(torch.tensor([-14.0, 0.0, 6.0, -3.0])).repeat_interleave(32)
    values, scales = fp4.quantize(raw)
    scales.view(torch.uint8)[keys // 2, 1] = 255
    return q, values, scales, w, ks, ke


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
@pytest.mark.parametrize("case", _CASES, ids=lambda c: f"t{c[0]}-n{c[1]}-h{c[2]}-{c[3]}")
def test_mxfp4_keys_equal_the_triton_kernel_within_rounding(case):
    """MXFP4 keys (widened once, then the fp8 prefill of either kernel, the far keys exactly after): -inf and NaN in
    the same places, the finite logits within the fp32 sums' rounding; nothing written outside the output."""
    target = detect(NVIDIA)[2]
    table_cfg = cuda_backend.tuning(target.arch)["mqa_logits"]
    args = [a.cuda() for a in _fp4_case(*case, seed=17)]
    outs = []
    for cfg in ({**table_cfg, "KERNEL": "triton"}, {**table_cfg, "KERNEL": "tma-ws"}):
        buf = torch.full((case[0] + 2, case[1]), 7.0, device="cuda")
        launches = logits.mqa_logits_launches(*args, buf[1:-1], target=target, cfg=cfg)
        fp8 = logits.PREFILL if cfg["KERNEL"] == "triton" else prefill_sm90.PREFILL
        assert [launch.launcher for launch in launches] == [prefill_fp4.ZERO, prefill_fp4.WIDEN_KEYS, fp8,
                                                            prefill_fp4.FAR_KEYS]
        for launch in launches:
            launch()
        assert (buf[0] == 7).all() and (buf[-1] == 7).all(), "a kernel wrote outside its output"
        outs.append(buf[1:-1])
    triton_out, tma_out = outs
    assert (tma_out != 7).all(), "a logit left unwritten"
    assert torch.equal(triton_out.isnan(), tma_out.isnan()) and torch.equal(triton_out.isneginf(), tma_out.isneginf())
    finite = triton_out.isfinite()
    if finite.any():
        torch.testing.assert_close(tma_out[finite], triton_out[finite], rtol=1e-3,
                                   atol=1e-4 * triton_out[finite].abs().max().item())


@pytest.mark.parametrize("stages", [0, 3, 6])
def test_a_ring_whose_size_is_not_a_power_of_two_is_refused(stages):
    q, k, scale, w, out = _args()
    ks = torch.zeros(q.shape[0], dtype=torch.int32)
    cfg = {**cuda_backend.tuning("sm90")["mqa_logits"], "TMA_STAGES": stages}
    with pytest.raises(ValueError, match=f"TMA_STAGES={stages}: expected a power of two"):
        prefill_sm90.launch(q, k, scale, w, ks, ks + k.shape[0], out, cfg=cfg, sms=1)


@pytest.mark.skipif(not _on_hopper(), reason="needs an sm90 GPU (Gluon kernels do not run interpreted)")
def test_kept_call_and_graph_replay_on_hopper():
    """The op's kept call (``prepare``: the launch bound once, tensor descriptors included) through this kernel equals
    a direct call, and so does its replay in a CUDA graph after the inputs change in place."""
    target = detect(NVIDIA)[2]
    table = cuda_backend.tuning(target.arch)
    cfg = {**table["mqa_logits"], "KERNEL": "tma-ws"}
    impl = logits.ops(target, {**table, "mqa_logits": cfg})["mqa_logits"]
    q, k, scale, w, ks, ke = [a.cuda() for a in _case(257, 3000, 64, "causal", seed=11)]
    out = torch.full((q.shape[0], k.shape[0]), float("nan"), device="cuda")
    run = impl.prepare(q=q, k=k, k_scale=scale, weights=w, ks=ks, ke=ke, out=out)
    run()
    assert torch.equal(out, logits.mqa_logits(q, k, scale, w, ks, ke, torch.empty_like(out), target=target, cfg=cfg))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_((torch.randn(q.shape, device="cuda") * 3).to(FP8))
    k.copy_((torch.randn(k.shape, device="cuda") * 3).to(FP8))
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, logits.mqa_logits(q, k, scale, w, ks, ke, torch.empty_like(out), target=target, cfg=cfg))
