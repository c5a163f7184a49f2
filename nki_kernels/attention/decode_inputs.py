"""Inputs of the decode-attention kernel at a rank shard's shapes: random bf16 tensors with the argument layout of
`decode_attention(...)`, a paged copy of a contiguous cache, and the shard of a model spec. Shared by the kernel's
tests and the bench (which must not import tests/); host-side only.
"""

import torch


def rank_shard(spec, tp, pad_to=512, **extra):
    """Keyword shape of one tensor-parallel rank of `spec` (a modules.model_specs.TextModelSpec, duck-typed: this
    layer does not import modules/): H = hidden padded to a multiple of `pad_to` (hidden_actual = the real one),
    d, KV heads per rank (replicated when tp > kv_heads), query heads per rank; RMSNorm always, biases and sinks as
    the model has them. `extra` overrides any key."""
    H = -(-spec.hidden // pad_to) * pad_to
    shard = dict(H=H, d=spec.head_dim, nkv=max(1, spec.kv_heads // tp), nq=spec.heads // tp,
                 hidden_actual=spec.hidden if H != spec.hidden else 0, gamma=True,
                 bias=spec.attention_bias, sinks=bool(spec.sliding_window))
    shard.update(extra)
    return shard


def make_inputs(B, S, H, d, nkv, nq, s_max, ctx, gamma=True, bias=True, sinks=True, hidden_actual=0, seed=0,
                rope=True):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16

    def r(*shape, sc=1.0):
        return (torch.randn(*shape, generator=g) * sc).to(bf)

    C = (nq + 2 * nkv) * d
    X = r(B, S, H)
    if hidden_actual:
        X[..., hidden_actual:] = 0
    start = torch.randint(0, ctx - S + 1, (B,), generator=g)
    start[0] = ctx - S                           # one sequence always reaches the end of the context
    pos = (start[:, None] + torch.arange(S)[None]).to(torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = pos.float()[..., None] * inv
    args = (X, r(H, C, sc=H ** -0.5), r(B, nkv, s_max, d), r(B, nkv, s_max, d), pos,
            ang.cos().to(bf) if rope else None, ang.sin().to(bf) if rope else None, r(nq * d, H, sc=(nq * d) ** -0.5))
    kw = dict(gamma=(1 + 0.1 * torch.randn(1, H, generator=g)).to(bf) if gamma else None,
              bias_qkv=r(1, C, sc=0.1) if bias else None,
              sinks=torch.randn(nq, generator=g).float() if sinks else None,
              bias_o=r(1, H, sc=0.1) if bias else None,
              context_len=ctx, hidden_actual=hidden_actual)
    return args, kw


def to_paged(args, kw, block_size, extra_blocks=3, seed=0):
    """Contiguous caches [B, nkv, S_max, d] -> paged caches [num_blocks, nkv, block_size, d] (blocks in a random
    order, extra blocks of noise) + block_table [B, S_max / block_size] int32 (vLLM layout)."""
    K, V = args[2], args[3]
    B, nkv, s_max, d = K.shape
    mb = s_max // block_size
    g = torch.Generator().manual_seed(seed + 7)
    n_blocks = B * mb + extra_blocks
    table = torch.randperm(n_blocks, generator=g)[:B * mb].reshape(B, mb).to(torch.int32)
    paged = []
    for c in (K, V):
        p = torch.randn(n_blocks, nkv, block_size, d, generator=g).to(c.dtype)
        p[table.reshape(-1).long()] = c.reshape(B, nkv, mb, block_size, d).permute(0, 2, 1, 3, 4).reshape(
            B * mb, nkv, block_size, d)
        paged.append(p)
    kw = dict(kw, block_table=table)
    return (args[0], args[1], paged[0], paged[1]) + tuple(args[4:]), kw


def dp_rank_inputs(args, kw, columns, rank):
    """Attention DP (attn_dp_groups): the kernel arguments of world rank `rank` from one column's whole-batch inputs
    (make_inputs with the column's query heads). Its DP index j in its rank-list of `columns` picks query heads
    j*nq_e.. (the interleaved effective rank's contiguous slice) of W_qkv / bias_qkv / W_o, the column's K/V heads,
    and sequences j*B_local.. for the caches, positions and RoPE tables; X stays the gathered batch; bias_o is
    added by DP index 0. Paged: every rank keeps the whole block pool and its own sequences' table rows.
    Returns (args, kwargs)."""
    X, W_qkv, K, V, pos, cos, sin, W_o = args
    col = next(c for c in columns if rank in c)
    a, j = len(col), col.index(rank)
    B, d, nkv = X.shape[0], K.shape[3], K.shape[1]
    nq = W_o.shape[0] // d
    qe, bl = nq // a * d, B // a
    own = slice(j * bl, (j + 1) * bl)
    cols = torch.cat([torch.arange(j * qe, (j + 1) * qe), torch.arange(nq * d, (nq + 2 * nkv) * d)])
    table = kw.get("block_table")
    rk = dict(kw, attn_dp_groups=tuple(tuple(c) for c in columns), attn_dp_rank=j, add_bias_o=j == 0,
              bias_qkv=None if kw.get("bias_qkv") is None else kw["bias_qkv"][:, cols].contiguous())
    if table is not None:
        rk["block_table"] = table[own].contiguous()
        caches = (K.clone(), V.clone())
    else:
        caches = (K[own].clone(), V[own].clone())
    rargs = (X.clone(), W_qkv[:, cols].contiguous(), *caches, pos[own].contiguous(),
             None if cos is None else cos[own].contiguous(), None if sin is None else sin[own].contiguous(),
             W_o[j * qe:(j + 1) * qe].contiguous())
    return rargs, rk
