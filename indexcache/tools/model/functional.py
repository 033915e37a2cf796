"""The small model's stateless pieces: the Hadamard rotation, RoPE on half the index head dim, sparse attention."""

from __future__ import annotations

import math

import torch

ROPE_BASE = 10000.0
ATTENTION_CHUNK_BYTES = 64 * 2**20


def hadamard(dim: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix ``[dim, dim]`` float32 (``dim`` a power of two)."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"dim: expected a power of two, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


def rope_first_half(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on the first half of the last dim of ``x [R, ..., D]``; ``positions [R]``."""
    dim = x.shape[-1]
    quarter = dim // 4
    inv_freq = ROPE_BASE ** (-torch.arange(quarter, device=x.device, dtype=torch.float32) / quarter)
    angle = positions.float()[:, None] * inv_freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (quarter,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    x1, x2, rest = x[..., :quarter], x[..., quarter : 2 * quarter], x[..., 2 * quarter :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Attention of ``q [R, H, d]`` over the latents ``kv [S, d]`` at ``slots [R, k]`` int32 (-1 = empty).

    Keys and values are the latent. Rows with no valid slot give zeros. Returns ``[R, H * d]``; rows
    are processed in chunks so the gathered ``[rows, k, d]`` stays under ``ATTENTION_CHUNK_BYTES``.
    """
    rows, heads, dim = q.shape
    k = slots.shape[1]
    out = q.new_zeros(rows, heads, dim)
    if rows == 0 or k == 0:
        return out.view(rows, heads * dim)
    step = max(1, ATTENTION_CHUNK_BYTES // (k * (dim + heads) * 4))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        idx = slots[r0:r1]
        valid = (idx >= 0)[:, None, :]
        g = kv[idx.clamp_min(0).long()]
        s = torch.einsum("rhd,rkd->rhk", q[r0:r1], g) * dim**-0.5
        p = torch.softmax(s.masked_fill(~valid, float("-inf")), -1)
        p = torch.where(valid, p, 0.0)
        out[r0:r1] = torch.einsum("rhk,rkd->rhd", p, g)
    return out.view(rows, heads * dim)
