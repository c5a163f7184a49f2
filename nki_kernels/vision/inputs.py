"""Inputs of the block vision-attention tests and benchmarks: random rank-shard weights and a packed block of images
with its bounds and 2D rotary tables (shared by tests/ and bench/, which must not import each other)."""

import torch


def packed_bounds(sizes, S):
    """Images of `sizes` patches packed from row 0; rows after the last image are padding (empty range [0, 0))."""
    lo = torch.zeros(S, dtype=torch.int32)
    hi = torch.zeros(S, dtype=torch.int32)
    start = 0
    for n in sizes:
        lo[start:start + n], hi[start:start + n] = start, start + n
        start += n
    assert start <= S, f"images of {start} patches do not fit a block of {S}"
    return lo, hi


def rotary_tables(S, d, sizes, seed=0):
    """2D rotary tables as Qwen-VL builds them: per image a (row, col) grid; the first half of the frequencies
    rotate with the row, the second with the column, duplicated over the two halves (rotate-half layout)."""
    inv = 1.0 / (10000 ** (torch.arange(0, d // 2, 2).float() / (d // 2)))
    ang = torch.zeros(S, d // 2)
    start = 0
    for n in sizes:
        w = max(1, int(n ** 0.5))
        idx = torch.arange(n)
        r, c = (idx // w).float(), (idx % w).float()
        half = inv.numel()
        ang[start:start + n, :half] = r[:, None] * inv[None]
        ang[start:start + n, half:2 * half] = c[:, None] * inv[None][:, :d // 2 - half]
        start += n
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def make_inputs(S, H, nh, d, sizes, seed=0):
    """(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o) for one block of images of `sizes` patches."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16

    def r(*shape, sc=1.0):
        return (torch.randn(*shape, generator=g) * sc).to(bf)
    cos, sin = rotary_tables(S, d, sizes)
    lo, hi = packed_bounds(sizes, S)
    return (r(S, H), r(H, 3 * nh * d, sc=H ** -0.5), r(3 * nh * d, sc=0.1), cos, sin, lo, hi,
            r(nh * d, H, sc=(nh * d) ** -0.5))
