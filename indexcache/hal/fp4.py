"""MXFP4 index keys: e2m1 values, two a byte, and one e8m0 scale a block of 32 (docs/fp4.md).

A row of D elements is D / 2 bytes of values (``torch.float4_e2m1fn_x2``: element ``2i`` in bits 0-3 of byte ``i``,
element ``2i + 1`` in bits 4-7; a nibble is ``sign << 3 | code``, ``code`` the index of its magnitude in
:data:`E2M1_GRID`) and D / 32 bytes of scales (``torch.float8_e8m0fnu``: byte ``b`` is ``2 ** (b - 127)``, 255 is
NaN), byte ``j`` scaling elements ``32j .. 32j + 31``. What DeepGEMM's ``fp8_fp4_*_mqa_logits``, SGLang and vLLM read.

The rule a writer follows, defined here once in float64 (:func:`quantize`) and decoded by :func:`dequantize`:

- scale ``2 ** ceil(log2(max(amax, 1e-4) / 6))`` per block (the fp8 keys' rule with 6, e2m1's largest value), its
  exponent clamped to [-126, 127] (bytes 1-254);
- each value ``x / scale`` to the nearest grid magnitude, ties to the even code, above 6 saturating to 6; a value
  rounding to 0 is +0 (nibble 0, never 8);
- a block holding NaN or ±inf: scale byte 255 (NaN) and zero values.
"""

from __future__ import annotations

import torch

FP4 = torch.float4_e2m1fn_x2
E8M0 = torch.float8_e8m0fnu
BLOCK = 32  # elements a scale
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes, by code
E2M1_MAX = 6.0
AMAX_FLOOR = 1e-4  # the amax of a block of zeros or tiny values, as the fp8 keys'
E8M0_NAN = 255


def head_dim(q: torch.Tensor) -> int:
    """The head dim D of queries ``q [..., D]`` in any format: MXFP4 ones hold ``[..., D / 2]`` (two values a byte)."""
    return 2 * q.shape[-1] if q.dtype == FP4 else q.shape[-1]


def quantize(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [N, D / 2] float4_e2m1fn_x2, scales [N, D / 32] float8_e8m0fnu)`` of ``k [N, D]`` (any float dtype,
    D a multiple of 32, on the CPU), by the module's rule, computed in float64."""
    n, d = k.shape
    blocks = k.double().reshape(n, d // BLOCK, BLOCK)
    finite = torch.isfinite(blocks).all(-1)
    amax = blocks.abs().amax(-1).clamp_min(AMAX_FLOOR)
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-126, 127)
    scale_bytes = (exponent + 127).masked_fill(~finite, E8M0_NAN).to(torch.uint8)
    y = (blocks / torch.exp2(exponent)[..., None]).masked_fill(~finite[..., None], 0.0)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    magnitude = y.abs().clamp_max(E2M1_MAX)
    below = (torch.searchsorted(grid, magnitude, right=True) - 1).clamp_max(len(E2M1_GRID) - 2)  # grid[below] <= m
    low, high = grid[below], grid[below + 1]
    up = (magnitude - low > high - magnitude) | ((magnitude - low == high - magnitude) & (below % 2 == 1))
    code = below + up.long()
    nibble = code + 8 * ((y < 0) & (code > 0)).long()
    nibble = nibble.reshape(n, d // 2, 2)
    values = (nibble[..., 0] | (nibble[..., 1] << 4)).to(torch.uint8)
    return values.view(FP4), scale_bytes.view(E8M0)


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` float64 of MXFP4 ``values [..., D / 2]`` and ``scales [..., D / 32]`` (any 1-byte dtypes holding
    the bytes; scale byte 255 decodes to NaN)."""
    packed = values.contiguous().view(torch.uint8).long()
    nibble = torch.stack((packed & 15, packed >> 4), -1).flatten(-2)
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64)
    x = grid[nibble & 7] * (1 - 2 * (nibble >> 3)).double()
    b = scales.contiguous().view(torch.uint8).double()
    scale = torch.exp2(b - 127).masked_fill(b == E8M0_NAN, float("nan"))
    return (x.unflatten(-1, (scale.shape[-1], BLOCK)) * scale[..., None]).flatten(-2)
