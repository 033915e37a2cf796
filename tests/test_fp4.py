"""The MXFP4 format (indexcache.hal.fp4, docs/fp4.md): nibble order and codes, the scale byte, the nearest grid point
with ties to the even code, saturation, -0, non-finite blocks; checked against brute force over the signed grid."""

from __future__ import annotations

import itertools

import pytest
import torch

import indexcache
from indexcache.hal import fp4

GRID = torch.tensor(fp4.E2M1_GRID, dtype=torch.float64)


def _bytes(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).flatten().tolist()


def test_bytes_of_a_known_row():
    """Scale 1 (the block holds 6): 1.0 is code 2 in the low nibble, -0.5 code 1 with the sign in the high one."""
    row = torch.zeros(1, 32)
    row[0, :4] = torch.tensor([1.0, -0.5, 6.0, -6.0])
    values, scales = fp4.quantize(row)
    assert values.dtype == fp4.FP4 and scales.dtype == fp4.E8M0
    assert values.shape == (1, 16) and scales.shape == (1, 1)
    assert _bytes(scales) == [127]
    assert _bytes(values)[:3] == [0x2 | 0x9 << 4, 0x7 | 0xF << 4, 0]


def _nearest(y: torch.Tensor) -> torch.Tensor:
    """Brute force: the grid magnitude nearest |y| (ties to the even code), with y's sign, saturating at 6."""
    distance = (y.abs().clamp_max(6.0)[..., None] - GRID).abs()
    best = distance.min(-1, keepdim=True).values
    codes = torch.arange(len(GRID))
    candidates = torch.where(distance == best, codes, 99)
    even = torch.where(candidates % 2 == 0, candidates, 99).min(-1).values
    code = torch.where(even < 99, even, candidates.min(-1).values)
    return GRID[code] * torch.where((y < 0) & (code > 0), -1.0, 1.0)


@pytest.mark.parametrize("scale_exp", [-12, 0, 3])
def test_every_value_is_its_nearest_grid_point_times_the_block_scale(scale_exp):
    gen = torch.Generator().manual_seed(scale_exp + 100)
    x = torch.randn(16, 128, generator=gen, dtype=torch.float64) * 2.0**scale_exp * 3
    halfway = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    block = torch.zeros(32, dtype=torch.float64)
    block[:7], block[7:14], block[14], block[15] = halfway, -halfway, 6.0, -0.0  # ties at scale 1: the block's 6
    x[0, :32] = block * 2.0**scale_exp  # ... and at scale 2 ** scale_exp
    values, scales = fp4.quantize(x.float())
    assert scales.view(torch.uint8)[0, 0] == 127 + scale_exp  # the ties are ties at the block's scale
    got = fp4.dequantize(values, scales)
    amax = x.float().double().abs().reshape(16, 4, 32).amax(-1).clamp_min(fp4.AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6)))
    want = _nearest(x.float().double().reshape(16, 4, 32) / scale[..., None]) * scale[..., None]
    assert torch.equal(got, want.reshape(16, 128))


def test_negative_values_that_round_to_zero_are_plus_zero():
    row = torch.full((1, 32), -0.1)
    row[0, 0] = 6.0
    values, _ = fp4.quantize(row)
    assert set(_bytes(values)[1:]) == {0}


def test_a_block_with_nan_or_inf_has_a_nan_scale_and_zero_values():
    row = torch.ones(1, 64)
    row[0, 3] = float("nan")
    row[0, 40] = float("-inf")
    values, scales = fp4.quantize(row)
    assert _bytes(scales) == [255, 255]
    assert set(_bytes(values)) == {0}
    assert torch.isnan(fp4.dequantize(values, scales)).all()


def test_the_amax_floor_and_the_exponent_clamp():
    zeros, _ = fp4.quantize(torch.zeros(1, 32))
    assert _bytes(fp4.quantize(torch.zeros(1, 32))[1]) == [127 - 15]  # 2 ** ceil(log2(1e-4 / 6)) = 2 ** -15
    assert set(_bytes(zeros)) == {0}
    huge = torch.full((1, 32), torch.finfo(torch.float32).max)
    assert _bytes(fp4.quantize(huge)[1]) == [127 + 126]


def test_dequantize_reads_every_nibble_and_scale_byte():
    codes = list(itertools.product(range(16), repeat=2))
    packed = torch.tensor([[lo | hi << 4 for lo, hi in codes[i:i + 16]] for i in range(0, 256, 16)], dtype=torch.uint8)
    scales = torch.full((16, 1), 130, dtype=torch.uint8)
    got = fp4.dequantize(packed, scales)
    signed = torch.cat([GRID, -GRID])
    want = torch.tensor([[signed[c] * 8 for pair in codes[i:i + 16] for c in pair] for i in range(0, 256, 16)],
                        dtype=torch.float64)
    assert torch.equal(got, want)


def test_the_rule_agrees_with_torchao_rceil_byte_for_byte():
    """torchao's MX quantization (``to_mx``, ``ScaleCalculationMode.RCEIL``: ``2 ** ceil(log2(amax / 6))``, values
    to nearest, ties to even) writes the same scale and value bytes as the reference wherever the two rules agree:
    finite blocks of amax above ``6 * 2 ** -16`` (the floor's scale), where torchao writes a negative value rounding
    to 0 as -0 (nibble 8) and the reference +0 (docs/fp4.md, "The write rule")."""
    pytest.importorskip("torchao", minversion="0.13", reason="the cross-check needs the test extra's torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    gen = torch.Generator().manual_seed(37)
    x = torch.randn(64, 128, generator=gen) * torch.exp2(torch.randint(-12, 12, (64, 4, 1), generator=gen)).repeat(
        1, 1, 32).view(64, 128)
    halfway = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x[0, :7], x[0, 7:14], x[0, 14] = halfway, -halfway, 6.0  # exact ties at scale 1 (the block's amax is 6)
    x[1, :32] = torch.linspace(-3.0, 3.0, 32) * 2.0**-10  # small values and ties at another scale
    values, scales = fp4.quantize(x)
    their_scales, their_values = to_mx(x, torch.float4_e2m1fn_x2, fp4.BLOCK, ScaleCalculationMode.RCEIL)
    assert _bytes(their_scales) == _bytes(scales)
    theirs = their_values.view(torch.uint8)
    nibbles = torch.stack((theirs & 15, theirs >> 4), -1)
    nibbles = nibbles.masked_fill(nibbles == 8, 0)  # -0 → +0, the one difference
    assert _bytes(nibbles[..., 0] | nibbles[..., 1] << 4) == _bytes(values)
    assert (theirs != values.view(torch.uint8)).any()  # the -0 difference exists in this input: the masking is needed
    # Under the amax floor: amax 9.9e-5 and just above 6 * 2^-16 give the floor's scale 2^-15 in both; at 6 * 2^-16
    # torchao's is 2^-16 (docs/fp4.md, "The write rule").
    tiny = torch.zeros(3, 32)
    tiny[:, 0] = torch.tensor([9.9e-5, 6 * 2.0**-16 * 1.0001, 6 * 2.0**-16])
    their_scales, _ = to_mx(tiny, torch.float4_e2m1fn_x2, fp4.BLOCK, ScaleCalculationMode.RCEIL)
    assert _bytes(fp4.quantize(tiny)[1]) == [127 - 15] * 3 and _bytes(their_scales) == [127 - 15] * 2 + [127 - 16]


def test_mxfp4_queries_in_deepgemms_packed_form_are_taken_by_views():
    """docs/fp4.md, "Queries": queries as DeepGEMM's SM100 FP4 path and vLLM hold them (values uint8 ``[T, H, D / 2]``,
    the four e8m0 bytes of a head packed into one int32 ``[T, H]``, block j in byte j) become ``q`` and ``q_scale`` by
    views alone, and give the logits of the unpacked ones."""
    g = torch.Generator().manual_seed(7)
    tokens, heads, dim = 3, 4, 128
    values, scales = indexcache.quantize_index_k(torch.randn(tokens * heads, dim, generator=g), fp4.FP4,
                                                 backend="torch")
    packed_values = values.view(torch.uint8).view(tokens, heads, dim // 2).clone()
    b = scales.view(torch.uint8).view(tokens, heads, 4).to(torch.int64)
    packed_scales = (b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24).to(torch.uint32).view(torch.int32)
    q = packed_values.view(fp4.FP4)
    q_scale = packed_scales.unsqueeze(-1).view(torch.uint8).view(fp4.E8M0)
    assert q_scale.shape == (tokens, heads, 4) and q_scale.data_ptr() == packed_scales.data_ptr()
    keys, key_scales = indexcache.quantize_index_k(torch.randn(50, dim, generator=g), fp4.FP4, backend="torch")
    window = torch.zeros(tokens, dtype=torch.int32), torch.full((tokens,), 50, dtype=torch.int32)
    weights = torch.randn(tokens, heads, generator=g)
    got = indexcache.mqa_logits(q, keys, key_scales, weights, *window, q_scale=q_scale, backend="torch")
    want = indexcache.mqa_logits(values.view(tokens, heads, dim // 2), keys, key_scales, weights, *window,
                                 q_scale=scales.view(tokens, heads, 4), backend="torch")
    assert torch.equal(got, want)


def test_the_torch_backend_gives_finite_logits_for_finite_keys_near_the_top_of_float32():
    """Keys quantized from finite values near 3e38 (block scale byte 253: 3e38 is 4 · 2^126, and 2^128 is past
    float32) made the torch backend's logits inf or NaN: it decoded each block at its own scale in float32. In units
    of the key's largest block scale it matches the float64 reference, on mqa_logits and paged_mqa_logits alike."""
    from indexcache.hal import reference
    from indexcache.hal.layout import new_packed_cache

    raw = torch.zeros(4, 64)
    raw[:, 0], raw[:, 1], raw[:, 32:] = 3.0e38, -1.0e38, 1.0
    keys, scales = indexcache.quantize_index_k(raw, fp4.FP4, block=32, backend="torch")
    assert scales.view(torch.uint8)[0].tolist() == [253, 125]  # 3e38 as 4 · 2^126: 2^128, past float32
    for first in (2.0**-6, 0.0):  # the big block read, or only the small one (0 x 6 · 2^127 was NaN)
        q = torch.zeros(2, 8, 64)
        q[..., 0], q[..., 32:] = first, 0.5
        q = q.to(torch.float8_e4m3fn)
        args = (q, keys, scales, torch.full((2, 8), 0.125), torch.zeros(2, dtype=torch.int32),
                torch.full((2,), 4, dtype=torch.int32))
        got, want = indexcache.mqa_logits(*args, backend="torch"), reference.mqa_logits(*args)
        assert torch.isfinite(want).all() and torch.allclose(got.double(), want, rtol=1e-6)
    cache = new_packed_cache(1, 4, 64, fp8_dtype=fp4.FP4)
    indexcache.store_index_k(raw, cache, torch.arange(4, dtype=torch.int32), fp8_dtype=fp4.FP4, backend="torch")
    paged = (q[:1, None].expand(1, 2, 8, 64).contiguous(), cache, torch.full((2, 8), 0.125),
             torch.tensor([4], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), 4)
    got = indexcache.paged_mqa_logits(*paged, k_format=fp4.FP4, backend="torch")
    want = reference.paged_mqa_logits(*paged, k_format=fp4.FP4)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.allclose(got[finite].double(), want[finite], rtol=1e-6)


@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("op", ["mqa_logits", "paged_mqa_logits"])
def test_mxfp4_operands_at_the_top_of_e8m0_give_the_references_logits_on_the_torch_backend(op, side):
    """MXFP4 queries with block scale byte 254 (2^127: 6 · 2^127 is past float32) or 253, alone and beside small bytes
    in a row, against keys of small scales, and the reverse: the torch backend decoded the queries at their own block
    scales in float32 (inf, and NaN in the dot) where the reference's logits lie well inside float32. Each product now
    takes its query's and key's largest scale together, as one power of two in two halves; within the fp8 bound of
    fp32 accumulation (inputs: the specs' ``top_of_e8m0_args``, one operand's block scale bytes at 254 and 253,
    beside 140 in some rows, the other's 2^-100 smaller)."""
    from indexcache.hal import specs
    from indexcache.hal.specs.mqa_logits import BOUNDS, check_logits

    spec = getattr(specs, op)
    args = spec.top_of_e8m0_args(torch.Generator().manual_seed(0), torch.device("cpu"), side)
    want = spec.reference(**args)
    finite = torch.isfinite(want)
    assert not torch.isnan(want).any() and (want[finite] != 0).any() and want[finite].abs().max() < 2.0**100
    got = getattr(indexcache, op)(**args, backend="torch")
    assert check_logits(got, want, BOUNDS[("fp8", "fp32")])[0] == ""


def test_the_gather_reference_makes_its_own_mxfp4_outputs_at_any_size():
    """Without given outputs it made them with torch.zeros, which fills no float4_e2m1fn_x2 tensor past a small size
    (NotImplementedError at 2000 keys of dim 64); against the torch backend's gather into given ones."""
    from indexcache.hal.layout import new_packed_cache
    from indexcache.hal.specs import gather_index_k

    cache = new_packed_cache(40, 64, 64, fp8_dtype=fp4.FP4)
    keys = torch.randn(2000, 64, generator=torch.Generator().manual_seed(0))
    indexcache.store_index_k(keys, cache, torch.arange(2000, dtype=torch.int32), fp8_dtype=fp4.FP4, backend="torch")
    table, lens = torch.arange(40, dtype=torch.int32)[None], torch.tensor([2000], dtype=torch.int32)
    got_k, got_scale = gather_index_k.reference(cache, table, lens, dim=64, fp8_dtype=fp4.FP4)
    want_k, want_scale = indexcache.gather_index_k(cache, table, lens, dim=64, fp8_dtype=fp4.FP4, backend="torch")
    assert got_k.dtype == fp4.FP4 and torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_scale.view(torch.uint8), want_scale.view(torch.uint8))


def test_the_conformance_case_of_ties_holds_them_at_its_block_scales():
    """The quantize_index_k case that judges each backend's ties: its rows' scales are their factors (a value past
    the block's 6 had doubled the first row's scale and halved every tie off the grid's half-way points), so each
    half-way point lands on a tie, in a block of each scale; and the bytes are the even codes, -0 written +0."""
    from indexcache.hal.specs import quantize_index_k

    case = next(c for c in quantize_index_k.cases if c.name.startswith("MXFP4: every tie of the grid"))
    k = case.build(torch.Generator().manual_seed(0), torch.device("cpu"))["k"]
    values, scales = fp4.quantize(k)
    assert _bytes(scales) == [127, 127 - 12, 127 + 40, 127 + 125, 127 - 15]  # 2^-20 · 6 is under the amax floor
    y = k.double() / torch.exp2(torch.tensor(_bytes(scales), dtype=torch.float64) - 127)[:, None]
    halfway = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
    for row in y[:4]:
        assert torch.isin(halfway, row).all() and torch.isin(-halfway, row).all()
    ties = [0x20, 0x42, 0x64, 0x06, 0xAA, 0xCC, 0xEE]  # 0.25 → 0, 0.75 → 1, 1.25 → 1, ... each sign's pair a byte
    assert all(_bytes(values[r])[:7] == ties for r in range(4)) and set(_bytes(values[4])) == {0}


def test_a_page_of_the_mxfp4_cache_holds_its_tokens_values_then_their_scales():
    """docs/ops.md and docs/fp4.md, "The paged cache": token ``t`` of a page has its D / 2 value bytes at byte
    ``t * D / 2`` and its D / 32 scale bytes at ``page_size * D / 2 + t * D / 32``; at D 96, page 5 (neither a power
    of two), written by the torch backend's store and read back by those offsets."""
    from indexcache.hal.layout import new_packed_cache

    dim, page, pages = 96, 5, 3
    keys = torch.randn(2 * page, dim, generator=torch.Generator().manual_seed(11)) * 8
    slots = torch.arange(page, 3 * page, dtype=torch.int32)  # pages 1 and 2, in full
    cache = new_packed_cache(pages, page, dim, fp8_dtype=fp4.FP4)
    assert cache.shape == (pages, page * (dim // 2 + dim // 32))
    indexcache.store_index_k(keys, cache, slots, fp8_dtype=fp4.FP4, backend="torch")
    values, scales = fp4.quantize(keys)
    assert set(_bytes(cache[0])) == {0}
    for i, slot in enumerate(slots.tolist()):
        p, t = divmod(slot, page)
        assert _bytes(cache[p, t * dim // 2:(t + 1) * dim // 2]) == _bytes(values[i])
        at = page * dim // 2 + t * dim // 32
        assert _bytes(cache[p, at:at + dim // 32]) == _bytes(scales[i])


@pytest.mark.parametrize("op", ["mqa_logits", "mqa_topk_translate"])
def test_bf16_queries_with_mxfp4_keys_are_refused_naming_q(op):
    """MXFP4 keys take fp8 or MXFP4 queries: the op's check refuses bf16 ones before any backend is asked."""
    keys, scales = indexcache.quantize_index_k(torch.randn(8, 64), fp4.FP4, backend="torch")
    args = (torch.randn(2, 4, 64).bfloat16(), keys, scales, torch.rand(2, 4), torch.zeros(2, dtype=torch.int32),
            torch.full((2,), 8, dtype=torch.int32))
    if op == "mqa_topk_translate":
        args += (4, torch.zeros(1, 4, dtype=torch.int32), 2)
    with pytest.raises(TypeError, match=r"^q: expected dtype float8_e4m3fn or float8_e4m3fnuz or float4_e2m1fn_x2, "
                                        r"got bfloat16$"):
        getattr(indexcache, op)(*args, backend="torch")
