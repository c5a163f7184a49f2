"""MXFP4 weight layout and MX numerics of the CTE kernel's trn3 path (nki_kernels/moe/mx_weights.py)."""

import numpy as np
import torch

from nki_kernels.moe import mx_weights as mw
from nkisim import dtypes, mx


def test_pack_unpack_round_trip_with_padding():
    codes, scales = mw.random_mxfp4(2, 360, 6, seed=3)          # K = 360: the last block is 8 rows + padding
    words, sc = mw.pack(codes, scales)
    assert words.shape == (2, 128, 1, 6) and sc.shape == (2, 16, 1, 6)
    deq = mw.unpack(words, sc)
    assert torch.equal(deq[:, :360], mw.dequantize(codes, scales))
    assert not deq[:, 360:].any()


def test_pack_places_each_32_block_in_one_scale_group():
    """Element j of a 512-chunk: partition 8 (j // 32) + j % 8, lane (j % 32) // 8 (one scale group per block)."""
    codes = np.zeros((1, 512, 1), np.uint8)
    j = 32 * 5 + 8 * 2 + 3                  # block 5, lane 2, row 3
    codes[0, j, 0] = 7
    words, _ = mw.pack(codes, np.full((1, 16, 1), 127, np.uint8))
    k = 8 * 5 + 3
    assert words[0, k, 0, 0] == 7 << 8 and np.count_nonzero(words) == 1


def test_mx_quantize_torch_matches_nkisim_quantize():
    """The reference's MXFP8 rounding equals nkisim's quantize_mx rule (8 partitions x 4 elements = one block)."""
    x = (torch.randn(6, 64) * torch.logspace(-3, 3, 64)).to(torch.bfloat16)
    ref = mw.mx_quantize_torch(x)
    v = x.float().numpy().reshape(6, 2, 8, 4).transpose(2, 0, 1, 3).reshape(8, -1)   # a block on 8 x 4
    fp8 = dtypes.as_dtype("float8_e4m3fn_x4")
    words, s = mx.quantize(v, fp8)
    d = mx.decode(words, fp8) * np.exp2(np.repeat(s.astype(float), 4, 1) - 127)
    assert np.array_equal(d.reshape(8, 6, 2, 4).transpose(1, 2, 0, 3).reshape(6, 64), ref.numpy())
    assert (ref - x.float()).abs().max() > 0        # it does round
