"""The useful work of one decode-attention launch: FLOPs and HBM bytes the computation needs, whatever the kernel
issues (padding, mask folding, selection matmuls, whole tiles past a sequence's length are not useful work).

Host-side and pure (NumPy on the positions): the bench declares these FLOPs to the cost model
(`nkisim.profile(..., useful_flops=...)`) so MFU and arithmetic intensity come from useful work, and computes the
roofline bound of a ragged batch on its real lengths (`useful_bound_s`).

Counted (TensorE work only; RMSNorm, RoPE, softmax and the cache update are not matmul FLOPs):
  - QKV projection:  2 * T * H_actual * (nq + 2 * nkv) * d
  - QK^T and PV:     2 * 2 * d * g * keys(b, s) per KV head, summed over the tokens (b, s): every query head reads
                     the keys its token attends -- causal `p + 1` keys at position p, at most W with a window
  - O-projection:    2 * T * nq * d * H_actual
with T = B * S_tkg tokens. H_actual (not the padded H): padding columns are multiplied by zeros.
"""

import numpy as np


def attended_keys(position_ids, window=0):
    """[B, S] number of keys each new token attends: p + 1 (causal), capped at `window` when window > 0."""
    pos = np.asarray(position_ids.cpu() if hasattr(position_ids, "cpu") else position_ids).astype(np.int64)
    keys = pos + 1
    return np.minimum(keys, window) if window > 0 else keys


def useful_flops(position_ids, H, d, nq, nkv, window=0, hidden_actual=0):
    """Useful TensorE FLOPs of one launch (see the module docstring)."""
    keys = attended_keys(position_ids, window)
    tokens = keys.size
    h = hidden_actual or H
    qkv = 2 * tokens * h * (nq + 2 * nkv) * d
    attn = 2 * 2 * d * nq * int(keys.sum())        # QK^T and PV, every query head over its token's keys
    o_proj = 2 * tokens * nq * d * h
    return float(qkv + attn + o_proj)


def useful_hbm_bytes(position_ids, H, d, nq, nkv, window=0, itemsize=2, kv_itemsize=None):
    """HBM bytes the computation cannot avoid: both weights once, the X / out rows, and per sequence the cache rows
    it attends (before its first new position, within the window) plus the new rows it writes."""
    pos = np.asarray(position_ids.cpu() if hasattr(position_ids, "cpu") else position_ids).astype(np.int64)
    kv_itemsize = kv_itemsize or itemsize
    tokens = pos.size
    weights = (H * (nq + 2 * nkv) * d + nq * d * H) * itemsize
    acts = 2 * tokens * H * itemsize
    first = pos[:, 0]
    prior = np.minimum(first, window - 1) if window > 0 else first     # cache keys read (the new ones are in SBUF)
    cache_read = 2 * nkv * d * kv_itemsize * int(prior.sum())
    cache_write = 2 * nkv * d * kv_itemsize * tokens
    return float(weights + acts + cache_read + cache_write)


def useful_bound_s(position_ids, H, d, nq, nkv, target="trn2", window=0, hidden_actual=0, lnc=1, itemsize=2):
    """Roofline bound of the useful work: max(useful bytes / memory rate, useful FLOPs / bf16 TensorE peak) of one
    logical core (modelled hardware constants from nkisim.hardware)."""
    from nkisim.hardware import hardware
    hw = hardware(target)
    lc = hw.logical_core(lnc)
    flops = useful_flops(position_ids, H, d, nq, nkv, window, hidden_actual)
    nbytes = useful_hbm_bytes(position_ids, H, d, nq, nkv, window, itemsize)
    return max(nbytes / lc.memory_bytes_per_s, flops / (lnc * hw.core.peak_flops("bfloat16")))
