"""The torch reference of the block vision attention and the entry's argument checks (no kernel involved).

The reference is checked against an independent per-image computation: each image's rows are run alone through
torch's scaled_dot_product_attention, so the bounds masking of the packed block must reproduce unpacked attention.
"""

import pytest
import torch

import nki_kernels  # noqa: F401 - registers the nki layer
from nki_kernels.vision import vision_block_attention, vision_block_attention_torch
from nki_kernels.vision.inputs import make_inputs, packed_bounds


def _per_image(x, w_qkv, b_qkv, cos, sin, w_o, sizes, nh, d):
    """Unpacked reference: every image alone (rows [start, start + n)), same rounding points as the kernel."""
    S = x.shape[0]
    out = torch.zeros(S, w_o.shape[1])
    start = 0
    for n in sizes:
        rows = slice(start, start + n)
        qkv = (x[rows].float() @ w_qkv.float() + b_qkv.float()).bfloat16().float()
        q, k, v = (qkv[:, i * nh * d:(i + 1) * nh * d].reshape(n, nh, d).transpose(0, 1) for i in range(3))
        c, s = cos[rows][None], sin[rows][None]

        def rot(t, c=c, s=s):
            return (t * c + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * s).bfloat16().float()
        o = torch.nn.functional.scaled_dot_product_attention(rot(q), rot(k), v)
        out[rows] = o.transpose(0, 1).reshape(n, nh * d).bfloat16().float() @ w_o.float()
        start += n
    return out


@pytest.mark.parametrize("sizes", [(256,), (100, 156), (40, 60, 30, 50, 45)])
def test_reference_matches_unpacked_attention(sizes):
    S, H, nh, d = 256, 128, 2, 72
    args = make_inputs(S, H, nh, d, sizes)
    out = vision_block_attention_torch(*args, num_heads=nh, head_dim=d)
    want = _per_image(*args[:5], args[7], sizes, nh, d)
    n = sum(sizes)
    assert torch.allclose(out[:n].float(), want[:n], atol=2e-2, rtol=2e-2), (out[:n].float() - want[:n]).abs().max()
    assert not out.isnan().any()
    assert (out[n:] == 0).all()            # padding rows: empty range -> zero


def test_padding_rows_are_zero_not_nan():
    S, H, nh, d = 128, 128, 1, 8
    args = list(make_inputs(S, H, nh, d, (0,)))       # every row padding
    out = vision_block_attention(*args, num_heads=nh, head_dim=d, backend="torch")
    assert (out == 0).all()


def test_bounds_helper():
    lo, hi = packed_bounds((3, 2), 8)
    assert lo.tolist() == [0, 0, 0, 3, 3, 0, 0, 0] and hi.tolist() == [3, 3, 3, 5, 5, 0, 0, 0]


BAD = [
    (dict(num_heads=0), "num_heads=0 must be an int in 1..16"),
    (dict(head_dim=7), "head_dim=7 must be an even int"),
    (dict(S=200), "block size S=200 must be a multiple of 128 in 128..4096"),
    (dict(S=4224), "block size S=4224 must be a multiple of 128 in 128..4096"),
    (dict(H=200), "hidden size H=200 must be a multiple of 128"),
    (dict(x_dtype=torch.float32), "x must be bfloat16, got float32"),
    (dict(cos_dtype=torch.bfloat16), "cos must be float32, got bfloat16"),
    (dict(w_qkv_cols=100), "w_qkv must be [H=128, 3*num_heads*head_dim=48]"),
    (dict(bound_dtype=torch.float32), "bound_min must be int32 or int64, got float32"),
    (dict(bound_max_value=300), "bound_max values must be in [0, S=256]"),
    (dict(bound_min_value=-1), "bound_min values must be in [0, S=256]"),
    (dict(S=4096, H=1152, nh=16, d=72), "S=4096 x num_heads=16 x head_dim=72 (H=1152) needs"),
]


@pytest.mark.parametrize("bad,msg", BAD, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_arguments_raise_before_any_work(bad, msg):
    S, H, nh, d = bad.get("S", 256), bad.get("H", 128), bad.get("nh", 2), bad.get("d", 8)
    args = list(make_inputs(min(S, 256), min(H, 256), 1, 8, (10,)))
    x, w_qkv, b_qkv, cos, sin, lo, hi, w_o = args
    x = torch.zeros(S, H, dtype=bad.get("x_dtype", torch.bfloat16))
    w_qkv = torch.zeros(H, bad.get("w_qkv_cols", 3 * nh * d), dtype=torch.bfloat16)
    b_qkv = torch.zeros(3 * nh * d, dtype=torch.bfloat16)
    cos = torch.zeros(S, d, dtype=bad.get("cos_dtype", torch.float32))
    sin = torch.zeros(S, d)
    lo = torch.zeros(S, dtype=bad.get("bound_dtype", torch.int32))
    hi = torch.full((S,), 1, dtype=lo.dtype)
    if "bound_max_value" in bad:
        hi[0] = bad["bound_max_value"]
    if "bound_min_value" in bad:
        lo[0] = bad["bound_min_value"]
    w_o = torch.zeros(nh * d, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as e:
        vision_block_attention(x, w_qkv, b_qkv, cos, sin, lo, hi, w_o, num_heads=bad.get("num_heads", nh),
                               head_dim=bad.get("head_dim", d), backend="torch")
    assert msg in str(e.value)


def test_unknown_backend():
    args = make_inputs(128, 128, 1, 8, (128,))
    with pytest.raises(ValueError, match="backend='cuda' must be one of"):
        vision_block_attention(*args, num_heads=1, head_dim=8, backend="cuda")
