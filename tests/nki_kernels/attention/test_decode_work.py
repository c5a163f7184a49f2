"""Useful work of a decode launch (nki_kernels/attention/decode_work.py): counted against explicit loops over the
tokens, and below what the kernel issues on the interpreter."""

import numpy as np
import pytest
import torch

import nkisim
from nki_kernels.attention.decode_attention import decode_attention_nki
from nki_kernels.attention.decode_inputs import make_inputs
from nki_kernels.attention.decode_work import attended_keys, useful_bound_s, useful_flops, useful_hbm_bytes

SMALL_D = dict(H=256, d=32, nkv=3, nq=6, gamma=False, bias=False, sinks=False)


def _loop_flops(pos, H, d, nq, nkv, window, h_act):
    """Per token, per query head: the dot products it really needs (one multiply-add = 2 FLOPs)."""
    total = 0
    for b in range(pos.shape[0]):
        for s in range(pos.shape[1]):
            p = int(pos[b, s])
            keys = [j for j in range(p + 1) if window == 0 or p - j < window]
            total += 2 * h_act * (nq + 2 * nkv) * d          # this token's q, k, v columns
            total += nq * len(keys) * 2 * d * 2               # q.k and p*v per key and query head
            total += 2 * nq * d * h_act                       # its O-projection row
    return total


@pytest.mark.parametrize("window", [0, 3, 100])
def test_useful_flops_matches_explicit_loops(window):
    pos = np.array([[5, 6, 7], [0, 1, 2], [40, 41, 42]], np.int32)
    got = useful_flops(pos, H=256, d=32, nq=6, nkv=3, window=window, hidden_actual=250)
    assert got == _loop_flops(pos, 256, 32, 6, 3, window, 250)
    assert attended_keys(torch.from_numpy(pos), window).tolist() == \
        [[len([j for j in range(p + 1) if window == 0 or p - j < window]) for p in row] for row in pos]


def test_useful_bytes_count_real_rows_only():
    pos = np.array([[10], [1000]], np.int32)      # two sequences: 10 and 1000 cache rows before the new token
    H, d, nq, nkv = 256, 32, 6, 3
    weights = (H * (nq + 2 * nkv) * d + nq * d * H) * 2
    assert useful_hbm_bytes(pos, H, d, nq, nkv) == weights + 2 * 2 * H * 2 + 2 * nkv * d * 2 * (1010 + 2)
    assert useful_hbm_bytes(pos, H, d, nq, nkv, window=8) == weights + 2 * 2 * H * 2 + 2 * nkv * d * 2 * (7 + 7 + 2)
    # the bound grows with the real lengths, not with the longest one
    assert useful_bound_s(np.array([[10], [10]]), H, d, nq, nkv) < useful_bound_s(pos, H, d, nq, nkv)


def test_declared_flops_below_issued_on_the_kernel():
    args, kw = make_inputs(2, 1, s_max=512, ctx=512, **SMALL_D)
    nq = args[7].shape[0] // SMALL_D["d"]
    flops = useful_flops(args[4], SMALL_D["H"], SMALL_D["d"], nq, SMALL_D["nkv"])
    _, rep = nkisim.profile(decode_attention_nki, *args, target="trn2", useful_flops=flops, **kw)
    assert rep.flops == flops < rep.flops_issued
    _, plain = nkisim.profile(decode_attention_nki, *args, target="trn2", **kw)
    assert rep.mfu == pytest.approx(plain.mfu * flops / plain.flops_issued)
