"""Torch reference of the fused decode-attention block (`decode_attention_kernel`), same semantics as the kernel.

Numerics mirror the kernel's rounding points: bf16 storage, fp32 math. RMSNorm output, QKV, RoPE output and the
attention output are rounded to the input dtype; scores, softmax and every accumulation are fp32. Sinks join the
softmax denominator only.
"""

import torch


def decode_attention_torch(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma=None, bias_qkv=None,
                           sinks=None, bias_o=None, context_len=None, softmax_scale=None, eps=1e-5,
                           hidden_actual=0, sliding_window=0, block_table=None, add_bias_o=True, k_scale=None,
                           v_scale=None, K_cache_transposed=False):
    """Reference forward. Updates K_cache / V_cache in place at `position_ids` and returns out [B*S_tkg, H].

    Shapes: X [B, S, H]; W_qkv [H, (nq + 2*nkv)*d]; K_cache/V_cache [B, nkv, S_max, d]; position_ids [B, S] int;
    cos/sin [B, S, d/2] (half-split RoPE; None = no RoPE); W_o [nq*d, H]; gamma [1, H] (None = no RMSNorm);
    bias_qkv [1, (nq+2nkv)*d]; sinks [nq] (per q head, logit units after scaling); bias_o [1, H], added iff
    add_bias_o (under tensor parallelism: on one rank of the group only, see decode_attention_kernel).
    Key j is visible to a query at position p iff j <= p and (sliding_window == 0 or j > p - sliding_window), and
    j < context_len. Cache rows a query does not see never affect it (stale rows may hold NaN).
    fp8 cache (K_cache / V_cache of a float8 dtype): k_scale / v_scale [1] or [nkv]; a cached value means
    value * scale, the new tokens' k / v are stored as (value / scale) rounded to the cache dtype and read back
    from the cache like every other row.
    Paged layout (block_table [B, max_blocks] int): K_cache/V_cache [num_blocks, nkv, block_size, d]; position j of
    sequence b is row j % block_size of block block_table[b, j // block_size]; S_max = max_blocks * block_size.
    K_cache_transposed: K_cache is [B, nkv, d, S_max] (contiguous only); read and updated through a transposed view.
    """
    if K_cache_transposed:
        K_cache = K_cache.transpose(2, 3)       # a view: the in-place update writes the caller's tensor
    dt = X.dtype
    B, S, H = X.shape
    if block_table is not None:
        _, nkv, bs, d = K_cache.shape
        bt = block_table.long()
        s_max = bt.shape[1] * bs
    else:
        _, nkv, s_max, d = K_cache.shape
    nq = W_qkv.shape[1] // d - 2 * nkv
    g_sz = nq // nkv
    L = s_max if context_len is None else int(context_len)
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    x = X.reshape(B * S, H).float()
    if gamma is not None:
        ha = hidden_actual or H
        ms = (x[:, :ha] ** 2).sum(-1, keepdim=True) / ha
        x = (x * torch.rsqrt(ms + eps) * gamma.float().reshape(1, H)).to(dt).float()
    qkv = x @ W_qkv.float()
    if bias_qkv is not None:
        qkv = qkv + bias_qkv.float().reshape(1, -1)
    qkv = qkv.to(dt).float()
    q = qkv[:, :nq * d].reshape(B * S, nq, d)
    k = qkv[:, nq * d:(nq + nkv) * d].reshape(B * S, nkv, d)
    v = qkv[:, (nq + nkv) * d:].reshape(B * S, nkv, d)
    if cos is not None:
        c = cos.float().reshape(B * S, 1, d // 2)
        s_ = sin.float().reshape(B * S, 1, d // 2)

        def rope(t):
            t1, t2 = t[..., :d // 2], t[..., d // 2:]
            return torch.cat([t1 * c - t2 * s_, t2 * c + t1 * s_], dim=-1).to(dt).float()
        q, k = rope(q), rope(k)
    pos = position_ids.reshape(B, S).long()
    fp8 = K_cache.dtype.is_floating_point and K_cache.dtype.itemsize == 1
    ks = k_scale.float().reshape(-1).expand(nkv) if fp8 else torch.ones(nkv)
    vs = v_scale.float().reshape(-1).expand(nkv) if fp8 else torch.ones(nkv)
    k, v = k / ks[None, :, None], v / vs[None, :, None]      # cache units (identity without fp8)
    for b in range(B):
        for s in range(S):
            p = int(pos[b, s])
            if block_table is not None:
                K_cache[bt[b, p // bs], :, p % bs] = k[b * S + s].to(K_cache.dtype)
                V_cache[bt[b, p // bs], :, p % bs] = v[b * S + s].to(V_cache.dtype)
            else:
                K_cache[b, :, p] = k[b * S + s].to(K_cache.dtype)
                V_cache[b, :, p] = v[b * S + s].to(V_cache.dtype)
    if block_table is not None:   # logical [B, nkv, S_max, d] views of the blocks each sequence uses
        nb_l = (L + bs - 1) // bs
        kc = K_cache[bt[:, :nb_l]].permute(0, 2, 1, 3, 4).reshape(B, nkv, nb_l * bs, d)[:, :, :L].float()
        vc = V_cache[bt[:, :nb_l]].permute(0, 2, 1, 3, 4).reshape(B, nkv, nb_l * bs, d)[:, :, :L].float()
    else:
        kc = K_cache[:, :, :L].float()
        vc = V_cache[:, :, :L].float()
    kc, vc = kc * ks[None, :, None, None], vc * vs[None, :, None, None]     # dequantised
    j = torch.arange(L)
    out = torch.empty(B * S, nq, d)
    for b in range(B):
        for s in range(S):
            p = int(pos[b, s])
            valid = j <= p
            if sliding_window:
                valid &= j > p - sliding_window
            for h in range(nq):
                g = h // g_sz
                sc = (kc[b, g] @ q[b * S + s, h]) * scale
                sc = torch.where(valid, sc, torch.tensor(float("-inf")))
                m = sc.max()
                if sinks is not None:
                    m = torch.maximum(m, sinks[h].float())
                e = torch.exp(sc - m)
                den = e.sum()
                if sinks is not None:
                    den = den + torch.exp(sinks[h].float() - m)
                # invalid rows are excluded by selection: 0 * (a stale NaN) would be NaN
                out[b * S + s, h] = (e / den) @ torch.where(valid[:, None], vc[b, g], 0.0)
    attn = out.reshape(B * S, nq * d).to(dt).float()
    o = attn @ W_o.float()
    if bias_o is not None and add_bias_o:
        o = o + bias_o.float().reshape(1, -1)
    return o.to(dt)
