"""quantize_index_k: block fp8 quantization with power-of-two scales (contract: :func:`indexcache.quantize_index_k`).
Its record's ``bench``: decode and prefill batches of bf16 and fp32 keys at D 128 (shared with store_index_k),
checked byte-exact."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from indexcache.hal import dispatch, fp4
from indexcache.hal.checks import FLOAT_INPUTS, check_tensor, key_format, output
from indexcache.hal.layout import fp8_max
from indexcache.hal.shown import dims, shown
from indexcache.hal.specs.base import E4M3, E4M3_FNUZ, CaseList, OpSpec, Verdict, cpu, not_written
from indexcache.hal.specs.bench import DIM, BenchCase, BenchSpec

# Elements a scale of fp8 keys where the call names none (one scale a key at DeepSeek-V3.2's D = 128); MXFP4 keys
# take fp4.BLOCK, their only size.
FP8_BLOCK = 128


def out_shapes(rows: int, dim: int, fp8_dtype: torch.dtype, block: int) -> tuple[tuple, tuple]:
    """``((values shape, dtype), (scales shape, dtype))`` of ``rows`` keys of ``dim`` elements: ``[N, D]`` fp8 and ``[N,
    D / block]`` float32, or MXFP4's ``[N, D / 2]`` float4_e2m1fn_x2 and ``[N, D / 32]`` float8_e8m0fnu."""
    if fp8_dtype == fp4.FP4:
        return ((rows, dim // 2), fp4.FP4), ((rows, dim // block), fp4.E8M0)
    return ((rows, dim), fp8_dtype), ((rows, dim // block), torch.float32)


def check(k, fp8_dtype: torch.dtype | None = None, *, block: int | None = None, out=None,
          out_scale=None) -> dict[str, Any]:
    check_tensor("k", k, FLOAT_INPUTS, (None, None))
    fp8_dtype = key_format(fp8_dtype, k.device, block, given=out)
    if block is None:
        block = fp4.BLOCK if fp8_dtype == fp4.FP4 else FP8_BLOCK
    if k.shape[1] % block:
        raise ValueError(f"k: expected a last dimension divisible by block={shown(block)}, got {shown(k.shape[1])}")
    (q_shape, q_dtype), (s_shape, s_dtype) = out_shapes(k.shape[0], k.shape[1], fp8_dtype, block)
    out = output("out", out, q_dtype, q_shape, k.device, {"k": k})
    out_scale = output("out_scale", out_scale, s_dtype, s_shape, k.device, {"k": k, "out": out})
    for name, t in (("out", out), ("out_scale", out_scale)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: expected rows of contiguous elements (stride 1 in the last dimension), got "
                             f"strides {dims(t.stride())}")
    return dict(k=k, fp8_dtype=fp8_dtype, block=block, out=out, out_scale=out_scale)


def reference(k, fp8_dtype=torch.float8_e4m3fn, block=FP8_BLOCK, out=None, out_scale=None):
    """Block-``block`` fp8 with power-of-two scales: ``(k_fp8 [N, D], scale [N, D // block] float32)``, every entry of
    the outputs (``out``, ``out_scale``: where the call writes them, overwritten whole).

    ``scale = 2 ** ceil(log2(max(amax, 1e-4) / fp8_max))`` so every ``k / scale`` fits the format; a block
    holding NaN or ±inf has scale NaN and zero values. MXFP4 (``torch.float4_e2m1fn_x2``): :func:`fp4.quantize`.
    """
    if fp8_dtype == fp4.FP4:
        return fp4.quantize(cpu(k))
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
    """Scales equal (NaN where the reference has NaN), fp8 values byte-exact; written into the given outputs."""
    q, scale = got
    if detail := not_written(args, {"out": q, "out_scale": scale}):
        return detail, None, None
    want_q, want_scale = want
    if q.dtype != want_q.dtype or scale.dtype != want_scale.dtype:
        return f"dtypes {q.dtype}, {scale.dtype}: expected {want_q.dtype}, {want_scale.dtype}", None, None
    same = (bytes_equal(cpu(scale), want_scale) if scale.dtype == fp4.E8M0  # NaN: byte 255
            else torch.equal(cpu(scale).nan_to_num(-1.0), want_scale.nan_to_num(-1.0)))  # scales are positive
    if not same:
        return "scales differ", None, None
    return ("" if bytes_equal(cpu(q), want_q) else "quantized values differ"), None, None


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

def _fp4_ties(gen):
    """Rows of 32 at the block scales 2^0, 2^-12, 2^40 and 2^125 (each holds ±6, so its scale is its factor) and one
    under the amax floor (2^-20: scale 2^-15, every value to 0): every half-way point of the e2m1 grid, both signs
    (each tie must go to the even code), values beside them, values rounding to zero from either side, and -0 (all
    written +0)."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    near = [0.2, 0.3, 5.5, 5.99]
    row = torch.tensor([*ties, *(-t for t in ties), 6.0, -6.0, 0.1, -0.1, -0.0, 0.0, *near, *(-t for t in near), 1.0,
                        -1.0, 4.0, -4.0], dtype=torch.float64)
    return torch.stack([row * 2.0**e for e in (0, -12, 40, 125, -20)])


cases.add("MXFP4: random bf16 keys")(
    lambda gen, dev: dict(k=(torch.randn(64, 256, generator=gen) * 10).to(torch.bfloat16).to(dev), fp8_dtype=fp4.FP4,
                          block=fp4.BLOCK))
cases.add("MXFP4: every tie of the grid at four block scales up to 2^125, ±6, -0, a block under the amax floor")(
    lambda gen, dev: dict(k=_fp4_ties(gen).float().to(dev), fp8_dtype=fp4.FP4, block=fp4.BLOCK))


@cases.add("outputs given: rows of a wider buffer, garbage in them before", native_fp8=True)
def _(gen, dev, fp8):
    k = torch.randn(9, 256, generator=gen) * 3
    values = torch.randint(0, 256, (9, 384), dtype=torch.uint8, generator=gen).view(fp8)
    scales = torch.full((9, 5), 7.0)
    return dict(k=k.to(dev), fp8_dtype=fp8, out=values.to(dev)[:, 64:320], out_scale=scales.to(dev)[:, 1:3])


@cases.add("MXFP4: outputs given, rows of wider buffers")
def _(gen, dev):
    k = torch.randn(7, 128, generator=gen) * 5
    values = torch.randint(0, 256, (7, 80), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 256, (7, 6), dtype=torch.uint8, generator=gen)
    return dict(k=k.to(dev), fp8_dtype=fp4.FP4, block=fp4.BLOCK, out=values.to(dev)[:, 8:72].view(fp4.FP4),
                out_scale=scales.to(dev)[:, 1:5].view(fp4.E8M0))


@cases.add("MXFP4: zero rows, values under the amax floor, blocks holding NaN or ±inf")
def _(gen, dev):
    k = torch.randn(5, 128, generator=gen)
    k[0] = 0
    k[1] *= 1e-7
    k[2, 5] = float("nan")
    k[3, 40] = float("inf")
    k[4, 64:96] = float("-inf")
    return dict(k=k.to(dev), fp8_dtype=fp4.FP4, block=fp4.BLOCK)

# ----------------------------------------------------------------------------------------------- benchmark

KEY_INPUTS = {"bf16": torch.bfloat16, "fp32": torch.float32}  # the dtypes the keys come to the fp8 ops in


def bench_shapes(quick: bool) -> list[tuple[str, int, str]]:
    """``(what, tokens, kind)``: decode (64 new tokens, one a request) and prefill (8K consecutive tokens),
    bf16 and fp32 keys; also store_index_k's."""
    if quick:
        return [("decode", 16, "bf16"), ("prefill", 256, "fp32")]
    return [(what, tokens, kind) for what, tokens in (("decode", 64), ("prefill", 8192)) for kind in KEY_INPUTS]


def tokens_label(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)


def bench_cases(quick: bool) -> list[BenchCase]:
    return [BenchCase(f"{what} {tokens_label(tokens)} tokens D{DIM} {kind}",
                      dict(tokens=tokens, dim=DIM, kind=kind, block=DIM)) for what, tokens, kind in bench_shapes(quick)]


def bench_keys(case: BenchCase, gen: torch.Generator) -> torch.Tensor:
    """Normal keys ``[tokens, D]`` in the case's dtype."""
    p = case.params
    return torch.randn(p["tokens"], p["dim"], generator=gen).to(KEY_INPUTS[p["kind"]])


def bench_build(case: BenchCase, gen: torch.Generator) -> dict[str, Any]:
    """Normal keys ``[tokens, D]`` in the case's dtype, quantized to e4m3fn with one scale a token."""
    return dict(k=bench_keys(case, gen), fp8_dtype=E4M3, block=case.params["block"])


def bench_call(a: Mapping[str, Any], backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return dispatch.call("quantize_index_k", check(a["k"], a["fp8_dtype"], block=a["block"]), backend)


def bench_bytes(case: BenchCase) -> int:
    """The keys read once; the fp8 values and a float32 scale a block written."""
    p = case.params
    values = p["tokens"] * p["dim"]
    return KEY_INPUTS[p["kind"]].itemsize * values + values + 4 * values // p["block"]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def same_bytes(got: Any, want: Any, case: BenchCase) -> str:
    """Byte-exact, as the conformance suite judges quantize_index_k and store_index_k: the fp8 values and the
    scales (``(values, scales)``), or the packed cache."""
    if isinstance(got, tuple):
        named = list(zip(("fp8 values", "scales"), got, want, strict=True))
    else:
        named = [("cache bytes", got, want)]
    for name, g, w in named:
        if g.shape != w.shape or not torch.equal(_bytes_of(g), _bytes_of(w)):
            return f"{name} differ from the torch backend's"
    return ""


SPEC = OpSpec("quantize_index_k", check, reference, judge, tuple(cases),
              bench=BenchSpec("quantize_index_k", bench_cases, bench_build, bench_call, bench_bytes,
                              same=same_bytes))
