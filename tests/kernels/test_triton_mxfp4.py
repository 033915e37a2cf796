"""The MXFP4 widening of the Triton decode (backends/triton/mxfp4.py), interpreted on the CPU: every value byte at
every exponent offset of the one-scale-a-key window gives the e4m3 bytes of its exact values, in both fp8 formats,
and every scale byte decodes to its power of two (255 NaN)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from indexcache.backends.triton import mxfp4
from indexcache.hal import fp4

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted checks"),
    pytest.mark.usefixtures("interpreted"),
]


@triton.jit
def _widen_kernel(words_ptr, lift_ptr, out_ptr, ROWS: tl.constexpr, D: tl.constexpr, FNUZ: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None]
    words = tl.load(words_ptr + r * (D // 8) + tl.arange(0, D // 8)[None, :])
    lift = tl.load(lift_ptr + r * (D // 8) + tl.arange(0, D // 8)[None, :])
    tl.store(out_ptr + r * (D // 4) + tl.arange(0, D // 4)[None, :], mxfp4.widen(words, lift, ROWS, D, FNUZ))


@triton.jit
def _permute_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, D: tl.constexpr):
    i = tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(out_ptr + i, mxfp4.permute(tl.load(x_ptr + i), ROWS, D))


@triton.jit
def _e8m0_kernel(b_ptr, out_ptr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, mxfp4.e8m0(tl.load(b_ptr + i)))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_every_value_byte_at_every_offset_widens_exactly(fp8):
    """Rows of all 256 value bytes (two nibbles each), one row an offset d in [-5, 5]: the widened bytes are the
    fp8 bytes of ``dequantize(values) * 2 ** d`` (torch's cast of exact values; -0 stays -0 in e4m3fn and is +0 in
    e4m3fnuz), in the order of ``mxfp4.permute``."""
    fnuz = fp8 == torch.float8_e4m3fnuz
    offsets = torch.arange(-5, 6)
    values = torch.arange(256, dtype=torch.uint8).repeat(len(offsets), 1)  # [11, 256]: D = 512 elements a row
    rows, d = 16, 512
    words = torch.zeros(rows, d // 8, dtype=torch.int32)
    words[:len(offsets)] = values.view(torch.int32)
    lift = torch.zeros(rows, d // 8, dtype=torch.int32)
    lift[:len(offsets)] = (0x2C + 8 * fnuz + 8 * offsets)[:, None].to(torch.int32)
    out = torch.zeros(rows, d // 4, dtype=torch.int32)
    _widen_kernel[(1,)](words.view(torch.uint32), lift.view(torch.uint32), out.view(torch.uint32), ROWS=rows, D=d,
                        FNUZ=fnuz)
    got = out.view(torch.uint8).view(rows, d)[:len(offsets)]
    exact = fp4.dequantize(values.view(fp4.FP4), torch.full((len(offsets), d // 32), 127, dtype=torch.uint8))
    exact = (exact * torch.exp2(offsets.double())[:, None]).view(len(offsets), d // 8, 4, 2).transpose(2, 3)
    exact = exact.reshape(len(offsets), d)  # in the widened order: place 8j + 4h + b is element 8j + 2b + h
    want = exact.to(fp8).view(torch.uint8)
    if fnuz:
        want[exact == 0] = 0  # e4m3fnuz has no -0 (its byte 0x80 is NaN)
    assert torch.equal(got.view(fp8).double(), exact)
    assert torch.equal(got, want)


def test_permute_is_the_widened_order():
    """``mxfp4.permute`` puts a row's elements in the order the widened keys hold them: place ``8j + 4h + b`` holds
    element ``8j + 2b + h`` (so a dot over D of both is the dot of the rows as they are)."""
    rows, d = 2, 64
    x = torch.arange(rows * d, dtype=torch.int32).view(rows, d)
    out = torch.empty_like(x)
    _permute_kernel[(1,)](x, out, ROWS=rows, D=d)
    p = torch.arange(d)
    assert torch.equal(out, x[:, (p // 8) * 8 + (p % 4) * 2 + (p // 4) % 2])


def test_every_scale_byte_decodes_to_its_power_of_two():
    b = torch.arange(256, dtype=torch.int32)
    out = torch.empty(256)
    _e8m0_kernel[(1,)](b, out)
    want = b.to(torch.uint8).view(torch.float8_e8m0fnu).float()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[:255], want[:255]) and out[255].isnan()
