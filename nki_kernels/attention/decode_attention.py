"""Fused decode attention block (token generation) for one tensor-parallel rank.

RMSNorm + QKV projection (+bias) + RoPE + flash-decoding attention over the KV cache (GQA, several KV heads per rank,
sinks, sliding window, in-kernel masks from positions) + partial O-projection + KV-cache update, everything kept in
SBUF between the hidden-state input and the O-projection output.
See DESIGN.md beside this file; the phases live in the `decode/` package, one module per job.
"""

import nki
import nki.language as nl

from .decode.common import _Constants
from .decode.config import (
    FA_SUB,
    FA_TILE_MAX,
    P_MAX,
    PSUM_F,
    _validate_inputs,
    argument_error,
)
from .decode.exchange import _decode_attention_dp, _validate_dp
from .decode.flash import _attention_flash_decode, _prefetch_packs
from .decode.kv_io import _load_block_ids, _load_positions, _paged_rows, _update_cache, _window_starts
from .decode.oproj import _exchange_oT, _output_projection
from .decode.planning import _token_tiles
from .decode.qkv import (
    _load_small_inputs,
    _qkv_projection,
    _quantize_kv,
    _rmsnorm,
    _rope,
    _transpose_bias_o,
    _transpose_qk,
)

__all__ = ["decode_attention_kernel", "decode_attention_nki", "P_MAX", "PSUM_F", "FA_SUB", "FA_TILE_MAX",
           "argument_error"]


def decode_attention_kernel(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma=None, bias_qkv=None,
                            sinks=None, bias_o=None, context_len=0, softmax_scale=0.0, eps=1e-5, hidden_actual=0,
                            sliding_window=0, block_table=None, add_bias_o=True, k_scale=None, v_scale=None,
                            attn_dp_groups=None, attn_dp_rank=0, K_cache_transposed=False):
    """Fused decode attention block: out = O_proj(Attn(RoPE(QKV(RMSNorm(X)))), with in-place KV-cache update.

    Dimensions:
        B: batch (1..64), S: new tokens per sequence S_tkg (1..8), H: hidden size (multiple of 128, padded),
        d: head dim (even, <= 128), nkv: KV heads on this rank, nq: query heads on this rank (nq = g * nkv,
        g = 1..16 query heads per KV head, g * S <= 128), S_max: cache length, L: scanned context length.

    Args:
        X ([B, S, H] @ HBM): hidden states (bf16).
        W_qkv ([H, (nq + 2*nkv) * d] @ HBM): fused QKV weight; columns [q heads | k heads | v heads].
        K_cache, V_cache ([B, nkv, S_max, d] @ HBM): caches, updated in place at the new positions. Paged layout
            (block_table given): [num_blocks, nkv, block_size, d]; position j of sequence b lives in block
            block_table[b, j // block_size] at row j % block_size (block_size a power of two in 16..512).
            K_cache_transposed=True: K_cache is [B, nkv, d, S_max] @ HBM (V_cache unchanged), read with plain DMA
            copies instead of DMA transposes, the new tokens' K written as columns.
        position_ids ([B, S] int32 @ HBM): position of each new token; consecutive within a sequence.
        cos, sin ([B, S, d/2] @ HBM): RoPE tables of the new positions, half-split layout (None: no RoPE).
        W_o ([nq * d, H] @ HBM): O-projection shard.
        gamma ([1, H] @ HBM): RMSNorm weight (None: no fused RMSNorm).
        bias_qkv ([1, (nq + 2*nkv) * d] @ HBM), bias_o ([1, H] @ HBM): optional biases.
        add_bias_o (bool): whether THIS rank adds bias_o. The output is a partial sum over the tensor-parallel
            ranks, so under TP pass True on exactly one rank of the group (e.g. rank 0) and False on the others
            (or bias_o=None and add the bias after the all-reduce); True for a single rank.
        attn_dp_groups (tuple of rank-lists), attn_dp_rank (int): attention data parallelism (decode/exchange.py):
            the DP columns as a replica group (each rank-list = the attn_dp world ranks of one column, in DP order) and
            this rank's index in its column. X is then the column's gathered batch [attn_dp * B_local, S, H]; W_qkv /
            bias_qkv / W_o hold this rank's nq_e query heads (interleaved effective rank) and its TP position's K/V
            heads; the caches, block_table, position_ids and cos / sin are this rank's own B_local sequences; sinks
            are the column's attn_dp * nq_e heads. Two in-kernel all_to_alls swap heads <-> sequences; out is the
            partial [attn_dp * B_local * S, H]. None = no attention DP. LNC=1.
        k_scale, v_scale ([1] or [nkv] fp32 @ HBM): fp8 KV cache (K_cache / V_cache float8_e4m3 or float8_e4m3fn,
            contiguous or paged layout): per-tensor or per-KV-head scales; a cached value means value * scale.
            Dequantised on load (K read as fp8 pairs and cast to bf16 on an engine, V cast by its DMA; k_scale
            folds into q, v_scale into the final 1/l); the new
            tokens' K/V are quantised (value / scale, rounded to fp8) before use, as the cache stores them.
        K_cache_transposed (bool): K_cache stored transposed, [B, nkv, d, S_max] (AWS nki-library's
            attention_block_tkg name); contiguous bf16 cache only (not with block_table, attn_dp_groups or an fp8
            cache: ValueError / assertion before any work).
        sinks ([nq] @ HBM): optional per-head sink logits (scaled-logit units); join the softmax denominator only.
        context_len (int): static number of cache positions scanned (L); 0 = S_max. Every position must be < L.
        softmax_scale (float): 0.0 = 1/sqrt(d). eps (float): RMSNorm epsilon.
        hidden_actual (int): real hidden size for the RMSNorm mean (e.g. 2880 of 3072); 0 = H.
        sliding_window (int): 0 = full attention, else keys j with p - W < j <= p.
        block_table ([B, max_blocks] int32 @ HBM): paged KV cache (vLLM style); None = contiguous cache. S_max is
            then max_blocks * block_size; every entry the scan touches (the first ceil(context_len / u) * u / block_size
            blocks, u = max(128, block_size)) must be a valid block id (pad unused entries with any valid id).

    Returns:
        out ([B * S, H] @ HBM, shared_hbm): partial O-projection (sum over ranks = full output; + bias_o iff
            add_bias_o), input dtype.

    Notes:
        - LNC=2 splits the batch between the two cores (each core owns whole sequences; with split weights and a
          scan >= 8K both cores attend every sequence over alternating slots, balanced whatever the runtime
          lengths, and merge their softmax states). With B = 1 the cores split the cache scan instead (and the
          QKV contraction over H, and the O-projection's H columns); the partial softmax states and QKV sums are
          exchanged with nisa.sendrecv.
        - Sliding window: only the W - 1 keys before each sequence's first new position are read (dynamic start).
        - Paged cache: blocks are gathered with indirect DMAs (.ap(vector_offset=...)), see DESIGN.md.
        - Masks are generated in-kernel from position_ids; no mask tensor in HBM.
        - The new tokens' K/V are used from SBUF (the "active" step); cache positions >= the first new position are
          masked, so the cache reads never wait for the cache update, which is written last.
        - Scores, softmax statistics and all accumulations are fp32; P is rounded to bf16 for the PV matmul.

    Pseudocode:
        xn = rmsnorm(X) ; qkv = xn @ W_qkv + b ; q, k = rope(q), rope(k)
        for kv head g, batch pack (batches whose g*S query rows share 128 partitions):
            active step: s = q k_new^T (causal among the new tokens) ; m = rowmax s ; p = exp(scale (s - m))
                         l = sum p ; acc = p v_new
            for context tile t (keys j < pos[b, 0]): s = q K_t^T + mask ; m' = max(m, rowmax s)
                         p = exp(scale (s - m')) ; l = l e^{scale(m - m')} + sum p ; acc = acc e^{scale(m - m')} + p V_t
            o = acc / (l + exp(sink - scale m))
        out = o @ W_o + b_o ; K_cache[b, :, pos[b]] = k ; V_cache[b, :, pos[b]] = v
    """
    if attn_dp_groups is not None:
        assert not K_cache_transposed, \
            "K_cache_transposed=True is not supported with attn_dp_groups (attention DP takes the row-major K_cache)"
        cfg, cfg_g, dp = _validate_dp(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma, bias_qkv, sinks,
                                      bias_o, context_len, softmax_scale, hidden_actual, sliding_window, block_table,
                                      add_bias_o, k_scale, v_scale, nl.num_programs(), attn_dp_groups, attn_dp_rank)
        out = nl.ndarray((cfg_g.B * cfg.S, cfg.H), dtype=X.dtype, buffer=nl.shared_hbm)
        _decode_attention_dp(cfg, cfg_g, dp, X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma, bias_qkv,
                             sinks, bias_o if add_bias_o else None, eps, block_table, out, k_scale, v_scale)
        return out
    cfg = _validate_inputs(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma, bias_qkv, sinks, bias_o,
                           context_len, softmax_scale, hidden_actual, sliding_window, block_table, add_bias_o,
                           k_scale, v_scale, nl.num_programs(), nl.program_id(0), K_cache_transposed)
    if not add_bias_o:
        bias_o = None       # another rank of the TP group adds it
    out = nl.ndarray((cfg.B * cfg.S, cfg.H), dtype=X.dtype, buffer=nl.shared_hbm)

    # This core's sequences (cfg.b_lo, cfg.b_hi; _Config decides the LNC split). Fewer sequences than cores: both
    # cores run every sequence and split the cache scan; the partial softmax states are exchanged with sendrecv and
    # combined, then each core computes half of the O-projection's H columns. Batch split with split weights: each
    # core loads half of W_qkv's rows and half of W_o's columns; QKV partial sums (all tokens) and the attention
    # outputs o^T (each core's sequences) are exchanged with sendrecv; at long scans (cfg.stride) both cores run
    # every sequence over alternating slots and merge their softmax states instead (both then hold all of o^T).
    # Core 0 alone writes the cache then.
    b_lo, b_hi = cfg.b_lo, cfg.b_hi
    if b_lo < b_hi:
        # DMA instructions issue in program order: small inputs first, then W_qkv, every K/V load of the attention,
        # W_o (its arrival paces the O-projection), and the stores last, so no load waits behind a store.
        # With split weights every phase but the attention covers all tokens (one token tile).
        tiles = _token_tiles(cfg, 0, cfg.B) if cfg.wsplit else _token_tiles(cfg, b_lo, b_hi)
        ins = _load_small_inputs(cfg, X, gamma, bias_qkv, bias_o, cos, sin, tiles, k_scale, v_scale)
        pos_sb = _load_positions(cfg, position_ids)      # register loads of the cache update read SBUF
        rows = _paged_rows(cfg, position_ids, block_table, tiles)
        starts = _window_starts(cfg, position_ids, b_lo, b_hi)
        block_ids = _load_block_ids(cfg, block_table, b_lo, b_hi, starts)
        pre = _prefetch_packs(cfg, position_ids, sinks, b_lo, b_hi)     # the packs' position tables, before W_qkv
        consts = _Constants(cfg, X.dtype)
        _transpose_bias_o(cfg, ins)
        xT = _rmsnorm(cfg, consts, ins, tiles, eps)
        qkv, qkT = _qkv_projection(cfg, consts, xT, W_qkv, ins.bias_qkv, tiles, ins)
        if qkT is None:     # else RoPE and q^T / k^T came from the transposed sums (_Config.rope_t)
            qkv = _rope(cfg, qkv, ins, tiles)
            if cfg.fp8:
                _quantize_kv(cfg, qkv, ins, tiles, K_cache.dtype)
                consts.vs = ins.vs
            qkT = _transpose_qk(cfg, qkv, tiles)
        oT, wo = _attention_flash_decode(cfg, consts, qkT, qkv, K_cache, V_cache, position_ids, sinks, tiles,
                                         b_lo, b_hi, W_o, block_ids, starts, pre)
        if cfg.wsplit and not cfg.split:
            _exchange_oT(cfg, oT[0], b_lo, b_hi, cfg.per_core)
        if cfg.core == 0:
            _update_cache(cfg, qkv, K_cache, V_cache, pos_sb, tiles, rows, qkT)
        _output_projection(cfg, consts, oT, wo, ins.bias_o, out, tiles, ins.bias_o_row)
    return out


decode_attention_nki = nki.jit(decode_attention_kernel)
