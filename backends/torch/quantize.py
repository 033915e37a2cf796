"""Block fp8 quantization with power-of-two scales, and the packed-cache store, in plain torch."""

from __future__ import annotations

import torch

from indexcache.hal import fp4
from indexcache.hal.layout import fp8_max, split_packed_cache


def _pow2_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax <= limit * s`` (exact: products of powers of two)."""
    e = torch.ceil(torch.log2(amax / limit))
    e = e + (amax > limit * torch.exp2(e)).float()
    e = e - (amax <= limit * torch.exp2(e - 1)).float()
    return torch.exp2(e)


# e2m1's half-way points, each with the comparison that sends a value lying on it to the even code (docs/fp4.md)
_E2M1_STEPS = ((0.25, torch.gt), (0.75, torch.ge), (1.25, torch.gt), (1.75, torch.ge), (2.5, torch.gt),
               (3.5, torch.ge), (5.0, torch.gt))


def _mxfp4(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [N, D / 2] float4_e2m1fn_x2, scales [N, D / 32] float8_e8m0fnu)``: the steps each value passes are
    its code, on any device (every quotient of a value by a power of two is exact in float32)."""
    n, d = k.shape
    blocks = k.float().reshape(n, d // fp4.BLOCK, fp4.BLOCK)
    finite = torch.isfinite(blocks).all(-1)
    scale = _pow2_scale(blocks.abs().amax(-1).clamp_min(fp4.AMAX_FLOOR), fp4.E2M1_MAX).clamp(2.0**-126, 2.0**127)
    y = (blocks / scale[..., None]).masked_fill(~finite[..., None], 0.0)
    code = sum(step(y.abs(), at).to(torch.uint8) for at, step in _E2M1_STEPS)
    nibble = (code | ((y < 0) & (code > 0)).to(torch.uint8) << 3).reshape(n, d // 2, 2)
    values = nibble[..., 0] | nibble[..., 1] << 4
    exponent = torch.frexp(scale).exponent - 1 + 127  # scale = 2 ** (exponent - 127)
    scales = exponent.masked_fill(~finite, fp4.E8M0_NAN).to(torch.uint8)
    return values.view(fp4.FP4), scales.view(fp4.E8M0)


def _fp8(k: torch.Tensor, fp8_dtype: torch.dtype, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_fp8 [N, D] fp8_dtype, scale [N, D // block] float32)``: a power-of-two scale a block."""
    n, d = k.shape
    blocks = k.float().reshape(n, d // block, block)
    finite = torch.isfinite(blocks).all(-1)
    scale = _pow2_scale(blocks.abs().amax(-1).clamp_min(1e-4), fp8_max(fp8_dtype)).masked_fill(~finite, float("nan"))
    q = (blocks / scale[..., None]).masked_fill(~finite[..., None], 0.0)
    return q.reshape(n, d).to(fp8_dtype), scale


def quantize_index_k(k, fp8_dtype, block, out, out_scale):
    """Write ``out [N, D]`` (fp8) and ``out_scale [N, D // block]`` float32, or MXFP4's ``out [N, D / 2]`` and
    ``out_scale [N, D / 32]`` e8m0; returns them (contract: ``indexcache.quantize_index_k``)."""
    if fp8_dtype == fp4.FP4:  # copied as bytes (torch converts to and from neither format)
        values, scales = _mxfp4(k)
        out.view(torch.uint8).copy_(values.view(torch.uint8))
        out_scale.view(torch.uint8).copy_(scales.view(torch.uint8))
    else:
        values, scales = _fp8(k, fp8_dtype, block)
        out.copy_(values)
        out_scale.copy_(scales)
    return out, out_scale


def store_index_k(k, k_cache, slot_mapping, fp8_dtype):
    """Quantize ``k`` into the packed cache at ``slot_mapping`` (contract: ``indexcache.store_index_k``).

    Picking the valid slots syncs with the host: the torch backend's store is not for captured graphs.
    """
    keys, scales = split_packed_cache(k_cache, k.shape[1], fp8_dtype)
    if fp8_dtype == fp4.FP4:  # a token's value and scale bytes
        q, scale = (t.view(torch.uint8) for t in _mxfp4(k))
        keys, scales = keys.view(torch.uint8), scales.view(torch.uint8)
    else:
        q, scale = _fp8(k, fp8_dtype, k.shape[1])
        scale = scale[:, 0]
    num_pages, page_size = keys.shape[:2]
    slot = slot_mapping.long()
    rows = torch.nonzero((slot >= 0) & (slot < num_pages * page_size)).flatten()
    page, offset = slot[rows] // page_size, slot[rows] % page_size
    keys[page, offset] = q[rows]
    scales[page, offset] = scale[rows]
