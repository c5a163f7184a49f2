"""Attention data parallelism inside the megakernel: the head <-> sequence swaps (nki.collectives.all_to_all).

The component-DP decode flow (see modules/models/attention_blocks.py): a rank of the attention component TP group
sits at DP index `dp_rank` of its DP column (`attn_dp` ranks, one rank-list of `attn_dp_groups`); it receives the
hidden states of the whole column's batch (attn_dp x B_local sequences, replica j at rows j*B_local..), holds the
W_qkv / W_o shards of its own 1/attn_dp of the column's query heads (the interleaved effective rank) plus the K/V
heads of its TP position (replicated down the column), and the KV cache of its own B_local sequences only:

  1. RMSNorm and the QKV projection of every gathered token with this rank's shard (TensorE cost is set by the
     weight columns, not the <= 128 tokens, so projecting the whole column's batch costs about what one replica's
     does); K/V of the own tokens are rows of that result.
  2. all_to_all over the DP column (heads -> sequences): chunk j of the send buffer (replica j's tokens x my query
     heads) goes to DP index j; received chunk j = my tokens x DP index j's heads, i.e. every query head of the TP
     position in head order. The own tokens' q|k|v tile is then exactly a non-DP launch's tile with attn_dp x the
     query heads, and RoPE, the flash-decoding over the own cache and the cache update run unchanged on it.
  3. all_to_all back (sequences -> heads), in the O-projection's transposed layout: o^T of my tokens, rows = the
     column's (head, dim) index, chunk j = DP index j's heads; received chunk j = replica j's tokens x my heads,
     which side by side are the o^T stationaries of the gathered tokens for my W_o shard (no transpose needed).
  4. the O-projection shard gives this rank's partial [attn_dp * B_local * S, H]; the caller's one all-reduce over
     the attention component TP group sums the TP and DP partials.

The collectives stage through private HBM (all_to_all takes HBM tensors only, AWS's stub). An fp8 cache: the own
tokens' k / v are quantised after the swap, as in the plain launch. Limit of this path (checked in _validate_dp):
LNC=1. Not checkable here: that `attn_dp_rank` is this rank's position in its rank-list (the world rank is a runtime
register, ncc.rank_id), which the caller derives from the same groups (modules: the DP column's rank_in_group).
The new K/V need no exchange: every rank of a column holds the same K/V heads, so the own tokens' rows are local.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl

from .common import _Constants
from .config import MAX_BATCH, MAX_TOKENS, P_MAX, _Config, _validate_inputs
from .flash import _attention_flash_decode
from .kv_io import _load_block_ids, _load_positions, _paged_rows, _update_cache, _window_starts
from .oproj import _load_w_o, _output_projection
from .planning import _token_tiles
from .qkv import (
    _Inputs,
    _load_kv_scales,
    _load_small_inputs,
    _load_table_rows,
    _qkv_projection,
    _qkv_tile,
    _quantize_kv,
    _rmsnorm,
    _rope,
    _transpose_bias_o,
    _transpose_qk,
)


class _Shape(nl.NKIObject):
    """Shape and dtype of an argument as the own-sequence phases see it (column query heads, own batch): handed to
    the shared validation, never read."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


class _DP(nl.NKIObject):
    """This rank's place in attention DP: the DP columns' replica group, its DP index, the DP size, and the query
    columns of its own shard (qe = nq_e * d)."""

    def __init__(self, groups, rank, size, qe):
        self.group = ncc.ReplicaGroup([list(g) for g in groups])
        self.rank, self.size, self.qe = rank, size, qe


def _validate_dp(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma, bias_qkv, sinks, bias_o,
                 context_len, softmax_scale, hidden_actual, sliding_window, block_table, add_bias_o, k_scale, v_scale,
                 n_prog, groups, dp_rank):
    """(cfg of the own sequences with the column's query heads, cfg of the gathered tokens with this rank's query
    heads, _DP). Messages name the argument and the attention-DP limit; every other limit is the shared
    validation's, checked on the own-sequence view."""
    assert n_prog == 1, f"attn_dp_groups: attention DP runs at LNC=1 (this launch has LNC={n_prog})"
    lists = [list(g) for g in groups]
    a = len(lists[0]) if len(lists) > 0 else 0
    assert a >= 1 and all(len(g) == a for g in lists), \
        f"attn_dp_groups={groups}: one rank-list per DP column, all of one size (the attention DP size)"
    assert 0 <= dp_rank < a, f"attn_dp_rank={dp_rank} must be in 0..{a - 1} (position in its DP column)"
    assert len(X.shape) == 3 and X.shape[0] % a == 0, \
        f"X: gathered batch {X.shape[0] if len(X.shape) > 0 else X.shape} must be attn_dp={a} x B_local"
    B, S, H = X.shape
    bl = B // a
    assert B <= MAX_BATCH and B * S <= MAX_TOKENS, \
        f"X: gathered batch {B} x S_tkg {S} must be <= {MAX_BATCH} sequences and <= {MAX_TOKENS} tokens"
    assert len(K_cache.shape) == 4, f"K_cache must be 4-D, got shape {K_cache.shape}"
    nkv, d = K_cache.shape[1], K_cache.shape[3]
    if block_table is None:
        assert K_cache.shape[0] == bl, (f"K_cache: batch {K_cache.shape[0]} must be this rank's own B_local = "
                                        f"{B} / attn_dp={a} = {bl} sequences (attention DP keeps own caches)")
    assert len(W_qkv.shape) == 2 and W_qkv.shape[1] % d == 0 and W_qkv.shape[1] // d > 2 * nkv, \
        f"W_qkv must be [H, (nq_e + 2*kv_heads) * d] with this rank's nq_e >= 1 query heads, got {W_qkv.shape}"
    nq_e = W_qkv.shape[1] // d - 2 * nkv
    assert tuple(W_o.shape) == (nq_e * d, H), \
        f"W_o must be this rank's shard [nq_e*d={nq_e * d}, H={H}], got {W_o.shape}"
    if bias_qkv is not None:
        assert tuple(bias_qkv.shape) == (1, W_qkv.shape[1]), f"bias_qkv must be [1, {W_qkv.shape[1]}]"
    nq = a * nq_e                                   # the column's query heads, attended after the swap
    c_col = (nq + 2 * nkv) * d
    cfg = _validate_inputs(_Shape((bl, S, H), X.dtype), _Shape((H, c_col), W_qkv.dtype), K_cache, V_cache,
                           position_ids, cos, sin, _Shape((nq * d, H), W_o.dtype), gamma,
                           None if bias_qkv is None else _Shape((1, c_col), bias_qkv.dtype), sinks, bias_o,
                           context_len, softmax_scale, hidden_actual, sliding_window, block_table, add_bias_o,
                           k_scale, v_scale, 1, 0)
    cfg_g = _Config(B, S, H, d, nkv, nq_e, cfg.s_max, cfg.L, cfg.scale, cfg.h_actual, cfg.window, X.dtype.itemsize,
                    cfg.bs, cfg.mb, False, 1, 0)
    return cfg, cfg_g, _DP(lists, dp_rank, a, nq_e * d)


def _load_own_inputs(cfg, cos, sin, tiles, k_scale, v_scale):
    """_Inputs of the own tokens' phases: the RoPE tables and an fp8 cache's scales (the gathered phases need
    neither)."""
    ins = _Inputs()
    if cfg.fp8:
        _load_kv_scales(cfg, ins, k_scale, v_scale)
    if cos is None:
        return ins
    h2 = cfg.d // 2
    cos2, sin2 = cos.reshape((cfg.B * cfg.S, h2)), sin.reshape((cfg.B * cfg.S, h2))
    cs, sn = [], []
    for tl in tiles:
        cs.append(_load_table_rows(cfg, cos2[tl.t0:tl.t0 + tl.nt, :], tl.nt))
        sn.append(_load_table_rows(cfg, sin2[tl.t0:tl.t0 + tl.nt, :], tl.nt))
    ins.cos, ins.sin = tuple(cs), tuple(sn)
    return ins


def _swap_heads_for_sequences(cfg, cfg_g, dp, qkv_g, gath, own):
    """Gathered q|k|v tiles (every column token, my query heads) -> own q|k|v tiles (my tokens, every query head of
    the column in head order, then my tokens' k and v). See the module docstring, step 2."""
    pad, qe, a = cfg.pad, dp.qe, dp.size
    n_g, n_o = cfg_g.B * cfg.S, cfg.B * cfg.S                 # gathered / own tokens
    dtype = qkv_g[0].dtype
    send = nl.ndarray((n_g, qe), dtype=dtype, buffer=nl.private_hbm)
    recv = nl.ndarray((n_g, qe), dtype=dtype, buffer=nl.private_hbm)
    for ti, tl in enumerate(gath):
        nisa.dma_copy(dst=send[tl.t0:tl.t0 + tl.nt, :], src=qkv_g[ti][:tl.nt, pad:pad + qe])
    ncc.all_to_all(srcs=[send], dsts=[recv], replica_group=dp.group, collective_dim=0)
    qkv = []
    g0 = dp.rank * n_o                 # my tokens among the gathered ones
    for tl in own:
        t = _qkv_tile(cfg, dtype, tl.nt)
        # received chunk j (rows j*n_o..) holds DP index j's heads: column block j of the tile
        nisa.dma_copy(dst=t[:tl.nt, pad:pad + a * qe].reshape((tl.nt, a, qe)),
                      src=recv.ap([[qe, tl.nt], [n_o * qe, a], [1, qe]], offset=tl.t0 * qe))
        lo_t = g0 + tl.t0
        for gi, gt in enumerate(gath):     # my tokens' k | v, from the gathered tile(s) holding them
            lo, hi = max(lo_t, gt.t0), min(lo_t + tl.nt, gt.t0 + gt.nt)
            if lo < hi:
                nisa.dma_copy(dst=t[lo - lo_t:hi - lo_t, pad + a * qe:pad + cfg.C],
                              src=qkv_g[gi][lo - gt.t0:hi - gt.t0, pad + qe:pad + cfg_g.C])
        qkv.append(t)
    return tuple(qkv)


def _chunk_rows(k_rows):
    """(chunk, partitions) blocks of k_rows (head, dim) rows laid out row = chunk * 128 + partition."""
    return tuple((k, min(P_MAX, k_rows - k * P_MAX)) for k in range((k_rows + P_MAX - 1) // P_MAX))


def _swap_sequences_for_heads(cfg, cfg_g, dp, oT, own, gath):
    """o^T of my tokens ([128, chunk, token] per own tile, rows = the column's (head, dim) index) -> o^T of every
    gathered token for my heads, per gathered tile: the O-projection's stationaries. See the module docstring,
    step 3."""
    qe, a = dp.qe, dp.size
    n_o = cfg.B * cfg.S
    dtype = oT[0].dtype
    send = nl.ndarray((a * qe, n_o), dtype=dtype, buffer=nl.private_hbm)      # o^T: (head, dim) rows x my tokens
    recv = nl.ndarray((a * qe, n_o), dtype=dtype, buffer=nl.private_hbm)
    for ti, tl in enumerate(own):
        for k, kn in _chunk_rows(a * qe):
            nisa.dma_copy(dst=send[k * P_MAX:k * P_MAX + kn, tl.t0:tl.t0 + tl.nt], src=oT[ti][:kn, k, :tl.nt])
    ncc.all_to_all(srcs=[send], dsts=[recv], replica_group=dp.group, collective_dim=0)
    # received chunk j (rows j*qe..) = replica j's tokens (gathered tokens j*n_o..) x my heads
    n_k = (qe + P_MAX - 1) // P_MAX
    oTs = []
    for gt in gath:
        t = nl.ndarray((P_MAX, n_k, P_MAX), dtype=dtype, buffer=nl.sbuf)
        for j in range(a):
            lo, hi = max(gt.t0, j * n_o), min(gt.t0 + gt.nt, (j + 1) * n_o)
            if lo >= hi:
                continue
            for k, kn in _chunk_rows(qe):
                r0 = j * qe + k * P_MAX
                nisa.dma_copy(dst=t[:kn, k, lo - gt.t0:hi - gt.t0], src=recv[r0:r0 + kn, lo - j * n_o:hi - j * n_o])
        oTs.append(t)
    return tuple(oTs)


def _decode_attention_dp(cfg, cfg_g, dp, X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma, bias_qkv,
                         sinks, bias_o, eps, block_table, out, k_scale=None, v_scale=None):
    """The attention-DP launch (module docstring, steps 1-4): the phases of the fused kernel on the gathered tokens
    (cfg_g: this rank's query heads) and on the own sequences (cfg: the column's query heads), joined by the swaps."""
    gath, own = _token_tiles(cfg_g, 0, cfg_g.B), _token_tiles(cfg, 0, cfg.B)
    ins = _load_small_inputs(cfg_g, X, gamma, bias_qkv, bias_o, None, None, gath)
    own_ins = _load_own_inputs(cfg, cos, sin, own, k_scale, v_scale)
    pos_sb = _load_positions(cfg, position_ids)
    rows = _paged_rows(cfg, position_ids, block_table, own)
    starts = _window_starts(cfg, position_ids, 0, cfg.B)
    block_ids = _load_block_ids(cfg, block_table, 0, cfg.B, starts)
    consts = _Constants(cfg, X.dtype)
    _transpose_bias_o(cfg_g, ins)
    xT = _rmsnorm(cfg_g, consts, ins, gath, eps)
    qkv_g, _ = _qkv_projection(cfg_g, consts, xT, W_qkv, ins.bias_qkv, gath)
    qkv = _swap_heads_for_sequences(cfg, cfg_g, dp, qkv_g, gath, own)
    qkv = _rope(cfg, qkv, own_ins, own)
    if cfg.fp8:
        _quantize_kv(cfg, qkv, own_ins, own, K_cache.dtype)
        consts.vs = own_ins.vs
    qkT = _transpose_qk(cfg, qkv, own)
    oT, _ = _attention_flash_decode(cfg, consts, qkT, qkv, K_cache, V_cache, position_ids, sinks, own, 0, cfg.B,
                                    None, block_ids, starts)
    wo = _load_w_o(cfg_g, W_o)       # issued after every K/V load, as in the plain launch
    oT_g = _swap_sequences_for_heads(cfg, cfg_g, dp, oT, own, gath)
    _update_cache(cfg, qkv, K_cache, V_cache, pos_sb, own, rows)
    _output_projection(cfg_g, consts, oT_g, wo, ins.bias_o, out, gath, ins.bias_o_row)
