"""Torch reference of the block vision attention (`vision_block_attention_kernel`), same semantics as the kernel.

Numerics mirror the kernel's rounding points: bf16 matmul inputs, fp32 math. QKV (after the bias) and the rotary
output are rounded to x's dtype; scores, softmax and every accumulation are fp32 (the reference keeps the
probabilities in fp32, the kernel rounds them to bf16 for the PV matmul: inside the tolerance); the attention output
is rounded to x's dtype before the O-projection, whose fp32 sum is returned in x's dtype.
"""

import torch


def rotate_half(t):
    """[..., d] -> [-t2, t1] with t1, t2 the two halves of the last dim (HF's rotate_half)."""
    h = t.shape[-1] // 2
    return torch.cat([-t[..., h:], t[..., :h]], dim=-1)


def vision_block_attention_torch(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o, *, num_heads, head_dim):
    """Reference forward of one block for one TP rank: out [S, H] (x.dtype) = partial O-projection (no O bias).

    x [S, H]; w_qkv [H, 3*nh*d] (q | k | v, head-major inside each); b_qkv [3*nh*d]; cos, sin [S, d] fp32 (rotary
    tables per token, rotate-half layout); bound_min, bound_max [S] int; w_o [nh*d, H]. Query row i attends to the
    keys j with bound_min[i] <= j < bound_max[i]; an empty range (a padding row) gives a zero output row.
    """
    dt = x.dtype
    S = x.shape[0]
    nh, d = num_heads, head_dim
    qkv = (x.float() @ w_qkv.float() + b_qkv.float().reshape(1, -1)).to(dt).float()
    q, k, v = (qkv[:, i * nh * d:(i + 1) * nh * d].reshape(S, nh, d).transpose(0, 1) for i in range(3))
    c, s = cos.float()[None], sin.float()[None]
    q = (q * c + rotate_half(q) * s).to(dt).float()
    k = (k * c + rotate_half(k) * s).to(dt).float()
    j = torch.arange(S)
    lo, hi = bound_min.long()[:, None], bound_max.long()[:, None]
    visible = (j[None] >= lo) & (j[None] < hi)                       # [S queries, S keys]
    scores = (q @ k.transpose(1, 2)) * d ** -0.5                     # [nh, S, S] fp32
    scores = scores.masked_fill(~visible[None], float("-inf"))
    m = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)   # empty rows: finite max
    e = torch.exp(scores - m)                                        # masked: exp(-inf) = 0
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))          # empty rows: 0 / 1 = 0, never NaN
    o = (p @ v).transpose(0, 1).reshape(S, nh * d).to(dt).float()
    return (o @ w_o.float()).to(dt)
