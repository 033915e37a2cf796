"""quantize_index_k: block fp8 quantization with power-of-two scales (contract: :func:`indexcache.quantize_index_k`)."""

from __future__ import annotations

from typing import Any

import torch

from indexcache.hal.checks import FLOAT_INPUTS, check_fp8, check_int, check_tensor
from indexcache.hal.specs.base import E4M3, E4M3_FNUZ, CaseList, OpSpec, Verdict, cpu
from indexcache.layout import fp8_max


def check(k, fp8_dtype=torch.float8_e4m3fn, *, block: int = 128) -> dict[str, Any]:
    check_tensor("k", k, FLOAT_INPUTS, (None, None))
    check_fp8(fp8_dtype)
    check_int("block", block, 1)
    if k.shape[1] % block:
        raise ValueError(f"k: expected a last dimension divisible by block={block}, got {k.shape[1]}")
    return dict(k=k, fp8_dtype=fp8_dtype, block=block)


def reference(k, fp8_dtype=torch.float8_e4m3fn, block=128):
    """Block-``block`` fp8 with power-of-two scales: ``(k_fp8 [N, D], scale [N, D // block] float32)``.

    ``scale = 2 ** ceil(log2(max(amax, 1e-4) / fp8_max))`` so every ``k / scale`` fits the format; a block
    holding NaN or ±inf has scale NaN and zero values.
    """
    k = cpu(k).double()
    n, d = k.shape
    blocks = k.view(n, d // block, block)
    finite = torch.isfinite(blocks).all(-1)
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / fp8_max(fp8_dtype)))).masked_fill(~finite, float("nan"))
    q = (blocks / scale[..., None]).masked_fill(~finite[..., None], 0.0).view(n, d).float().to(fp8_dtype)
    return q, scale.float()


def bytes_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape and the same bytes (NaN payloads included)."""
    if got.shape != want.shape:
        return False
    return torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def judge(args: dict, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
          accumulation: str) -> Verdict:
    """Scales equal (NaN where the reference has NaN), fp8 values byte-exact."""
    q, scale = got
    want_q, want_scale = want
    if not torch.equal(cpu(scale).nan_to_num(-1.0), want_scale.nan_to_num(-1.0)):  # scales are positive
        return "scales differ", None, None
    return ("" if bytes_equal(cpu(q), want_q) else "fp8 values differ"), None, None


cases = CaseList("quantize_index_k")

for _dt, _label in ((E4M3, "e4m3fn"), (E4M3_FNUZ, "e4m3fnuz")):
    cases.add(f"random bf16 keys, {_label}")(
        lambda gen, dev, dt=_dt: dict(k=(torch.randn(64, 256, generator=gen) * 10).to(torch.bfloat16).to(dev),
                                      fp8_dtype=dt))


@cases.add("extremes: zero rows, tiny and huge blocks, exact powers of two")
def _(gen, dev):
    k = torch.randn(6, 128, generator=gen)
    k[0] = 0
    k[1] *= 1e-7
    k[2] *= 1e5
    k[3, 0] = 448.0
    k[4, 0] = 896.0
    k[5] = -(2.0**-20)
    return dict(k=k.to(dev), fp8_dtype=E4M3)


@cases.add("blocks holding NaN, +inf or -inf: scale NaN, zero values, native fp8", native_fp8=True)
def _(gen, dev, fp8):
    k = torch.randn(4, 256, generator=gen)
    k[0, 5] = float("nan")
    k[1, 130] = float("inf")
    k[2, :128] = float("-inf")
    return dict(k=k.to(dev), fp8_dtype=fp8)


SPEC = OpSpec("quantize_index_k", check, reference, judge, tuple(cases))
