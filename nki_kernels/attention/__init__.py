"""Decode attention: the fused NKI kernel, its torch reference and a functional entry that picks a backend.

`decode_attention(...)` takes torch tensors or NumPy arrays and runs one of:
  - "nki":    the kernel compiled by AWS's real `nki` (inputs must be device tensors the real `nki.jit` accepts);
  - "nkisim": the kernel on the nkisim CPU interpreter (when nkisim serves `import nki`);
  - "torch":  the torch reference (same semantics);
  - "auto":   "nki" when the real package serves `import nki`, else "nkisim".
It returns out [B*S_tkg, H] (the partial O-projection, before the TP all-reduce; bias_o is added iff add_bias_o, which
under TP must be True on exactly one rank of the group) and updates K_cache / V_cache in place. An fp8 cache
(float8_e4m3fn / float8_e4m3, contiguous or paged) takes k_scale / v_scale ([1] or [kv_heads] float32). position_ids
and block_table may be int64 (torch's default): they are checked on the host and passed to the kernel as int32.
"""

import numpy as np

from ..entry import BACKENDS, as_int32, distributed_world, resolve_backend, to_torch
from .decode_attention import P_MAX, argument_error, decode_attention_kernel, decode_attention_nki
from .decode_attention_torch import decode_attention_torch

__all__ = ["BACKENDS", "decode_attention", "decode_attention_kernel", "decode_attention_nki", "decode_attention_torch",
           "argument_error", "check_positions", "check_block_table"]

def check_positions(position_ids, s_max, context_len=None):
    """Host-side checks of the runtime positions (the kernel sees them only as data): in range and consecutive."""
    pos = np.asarray(position_ids.cpu() if hasattr(position_ids, "cpu") else position_ids).astype(np.int64)
    L = s_max if not context_len else int(context_len)
    if pos.ndim != 2:
        raise ValueError(f"position_ids must be [B, S_tkg], got shape {pos.shape}")
    if pos.size and (pos.min() < 0 or pos.max() >= L):
        raise ValueError(f"position_ids must be in [0, context_len={L}) (cache of S_max={s_max}); got "
                         f"[{pos.min()}, {pos.max()}]: the cache is too short for the positions")
    if pos.shape[1] > 1 and not (np.diff(pos, axis=1) == 1).all():
        raise ValueError("position_ids must be consecutive within each sequence (pos[b, s] = pos[b, 0] + s)")


def check_block_table(block_table, num_blocks, block_size, position_ids, context_len=None):
    """Host-side checks of a paged cache's block table (the kernel sees its entries only as data): every entry the
    kernel reads -- the first ceil((context_len - S_tkg) / u) * u / block_size columns, u = max(P_MAX, block_size),
    and the blocks of the new positions -- must be a valid block id in [0, num_blocks)."""
    bt = np.asarray(block_table.cpu() if hasattr(block_table, "cpu") else block_table).astype(np.int64)
    pos = np.asarray(position_ids.cpu() if hasattr(position_ids, "cpu") else position_ids).astype(np.int64)
    if bt.ndim != 2 or bt.shape[0] != pos.shape[0]:
        raise ValueError(f"block_table must be [B={pos.shape[0]}, max_blocks_per_seq], got shape {bt.shape}")
    s_max = bt.shape[1] * block_size
    L = s_max if not context_len else int(context_len)
    unit = max(P_MAX, block_size)     # the kernel's scan unit (_Config.unit)
    n_read = min(bt.shape[1], ((L - pos.shape[1] + unit - 1) // unit * unit) // block_size)
    used = np.concatenate([bt[:, :n_read].reshape(-1), bt[np.arange(bt.shape[0])[:, None], pos // block_size]
                           .reshape(-1)]) if pos.size else bt[:, :n_read].reshape(-1)
    if used.size and (used.min() < 0 or used.max() >= num_blocks):
        raise ValueError(f"block_table entries read by the kernel must be in [0, num_blocks={num_blocks}); got "
                         f"[{used.min()}, {used.max()}] (pad unused entries with any valid block id)")


def decode_attention(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma=None, bias_qkv=None, sinks=None,
                     bias_o=None, context_len=0, softmax_scale=0.0, eps=1e-5, hidden_actual=0, sliding_window=0,
                     block_table=None, backend="auto", lnc=1, add_bias_o=True, k_scale=None, v_scale=None,
                     attn_dp_groups=None, attn_dp_rank=0, K_cache_transposed=False):
    """Fused decode attention for one TP rank. See `decode_attention_kernel` for shapes and semantics.

    K_cache_transposed: K_cache is [B, kv_heads, d, S_max] (contiguous bf16 cache only; V_cache unchanged).

    attn_dp_groups / attn_dp_rank: attention DP with in-kernel all-to-alls (kernel backends only; every rank of the
    groups calls this at once). On "nkisim" inside torch.distributed workers each process is one rank of the kernel's
    world (nkisim.process_world over the default process group; group ranks = torch.distributed ranks)."""
    backend = resolve_backend("decode_attention", backend)
    if attn_dp_groups is not None and backend == "torch":
        raise ValueError("decode_attention: attn_dp_groups needs a kernel backend (the in-kernel all-to-alls); the "
                         "torch reference has no collectives (modules.models.attention_blocks runs attention DP in "
                         "torch)")
    if lnc not in (1, 2):
        raise ValueError(f"lnc={lnc} must be 1 or 2")
    if not isinstance(add_bias_o, bool):
        raise ValueError(f"add_bias_o={add_bias_o!r} must be a bool")
    # attention DP: a rank's W_qkv holds its share of the query heads (maybe fewer than the KV heads); the layout
    # check reads the column's width
    w_qkv = W_qkv if attn_dp_groups is None else _column_qkv(W_qkv, K_cache.shape[3], len(attn_dp_groups[0]),
                                                             K_cache.shape[1])
    if K_cache_transposed and attn_dp_groups is not None:
        raise ValueError("K_cache_transposed=True is not supported with attn_dp_groups (attention DP takes the "
                         "row-major K_cache [B, kv_heads, S_max, d])")
    err = argument_error(X, w_qkv, K_cache, V_cache, cos, sin, block_table, bool(K_cache_transposed))
    if err is not None:      # before the position checks, which read S_max from the cache's shape
        raise ValueError(err)
    position_ids = as_int32("position_ids", position_ids)
    block_table = as_int32("block_table", block_table)
    if block_table is None:
        check_positions(position_ids, V_cache.shape[2], context_len)
    else:
        check_positions(position_ids, block_table.shape[1] * K_cache.shape[2], context_len)
        check_block_table(block_table, K_cache.shape[0], K_cache.shape[2], position_ids, context_len)
    kwargs = dict(gamma=gamma, bias_qkv=bias_qkv, sinks=sinks, bias_o=bias_o, context_len=int(context_len),
                  softmax_scale=float(softmax_scale), eps=float(eps), hidden_actual=int(hidden_actual),
                  sliding_window=int(sliding_window), block_table=block_table, add_bias_o=add_bias_o,
                  k_scale=k_scale, v_scale=v_scale)
    if K_cache_transposed:      # only when set: the default call is unchanged
        kwargs["K_cache_transposed"] = True
    if attn_dp_groups is not None:
        kwargs.update(attn_dp_groups=tuple(tuple(int(r) for r in g) for g in attn_dp_groups),
                      attn_dp_rank=int(attn_dp_rank))
    args = (X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o)
    if backend == "torch":
        is_np = isinstance(X, np.ndarray)
        targs = [to_torch(a) for a in args]
        tkw = {k: (to_torch(v) if k in ("gamma", "bias_qkv", "sinks", "bias_o", "block_table", "k_scale", "v_scale")
                   else v)
               for k, v in kwargs.items()}
        tkw["context_len"] = tkw["context_len"] or None
        tkw["softmax_scale"] = tkw["softmax_scale"] or None
        out = decode_attention_torch(*targs, **tkw)
        if is_np:  # write the caches back into the caller's arrays
            for orig, t in ((K_cache, targs[2]), (V_cache, targs[3])):
                orig[...] = t.float().numpy().astype(orig.dtype)
            return out.float().numpy().astype(X.dtype)
        return out
    kernel = decode_attention_nki if lnc == 1 else decode_attention_nki[lnc]
    if attn_dp_groups is not None and backend == "nkisim":
        with distributed_world():
            return kernel(*args, **kwargs)
    return kernel(*args, **kwargs)


class _Shape:
    def __init__(self, shape):
        self.shape = tuple(shape)


def _column_qkv(W_qkv, d, a, nkv):
    """W_qkv's shape as the DP column sees it: attn_dp x this rank's query heads, then the K/V heads."""
    if len(W_qkv.shape) != 2 or d < 1 or W_qkv.shape[1] % d:
        return W_qkv
    nq_e = W_qkv.shape[1] // d - 2 * nkv
    return _Shape((W_qkv.shape[0], (a * nq_e + 2 * nkv) * d))
