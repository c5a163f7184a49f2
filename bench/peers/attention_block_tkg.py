"""nki-library's `attention_block_tkg` (experimental/transformer) as a side-by-side peer of our decode kernel.

The library kernel is called unmodified (located through `bench.peers.nkilib`, NKILIB_SRC) by `launch`, a thin
launch kernel with HBM input and output (the configuration of the library's own tests without X_in_sb /
out_in_sb). `inputs(...)` builds its arguments for one shape from the same sequence positions our kernel gets, so the
two do the same attention: RMSNorm(X) -> QKV -> RoPE -> attention over the cache (one KV head, GQA) with the new
tokens -> O-projection -> cache update. The library takes its mask as a tensor, built by its own
`build_full_attention_mask` (causal over each sequence's cache length, active tokens included) as its tests do.
Layouts (from the library's test wrapper and kernel docstring): cos/sin [d/2, B, S_tkg], caches [B, 1, S_ctx, d],
kv_cache_update_idx [B, 1] uint32 = each sequence's first new position.
"""

import ml_dtypes
import numpy as np

from bench.peers import nkilib

KERNEL = "experimental.transformer.attention_block_tkg:attention_block_tkg"
BF16 = ml_dtypes.bfloat16


def launch(X, rmsnorm_X_gamma, W_qkv, cos, sin, K_cache, V_cache, attention_mask, kv_cache_update_idx, W_out,
           X_hidden_dim_actual, softmax_scale):
    """The library kernel with HBM in/out, every option our kernel has on (RMSNorm, RoPE, cache update, O-proj)
    and every one it lacks off (QK norms, quantisation, KV data parallelism)."""
    kernel = nkilib.load(KERNEL)
    qt = nkilib.load("core.utils.common_types").QuantizationType
    out, _, _ = kernel(
        X=X, X_hidden_dim_actual=X_hidden_dim_actual, rmsnorm_X_enabled=True, rmsnorm_X_eps=1e-5,
        rmsnorm_X_gamma=rmsnorm_X_gamma, W_qkv=W_qkv, bias_qkv=None, quantization_type_qkv=qt.NONE,
        weight_dequant_scale_qkv=None, input_dequant_scale_qkv=None, rmsnorm_QK_pre_rope_enabled=False,
        rmsnorm_QK_pre_rope_eps=1e-5, rmsnorm_QK_pre_rope_W_Q=None, rmsnorm_QK_pre_rope_W_K=None, cos=cos, sin=sin,
        rope_contiguous_layout=True, rmsnorm_QK_post_rope_enabled=False, rmsnorm_QK_post_rope_eps=1e-5,
        rmsnorm_QK_post_rope_W_Q=None, rmsnorm_QK_post_rope_W_K=None, skip_attention=False,
        K_cache_transposed=False, active_blocks_table=None, K_cache=K_cache, V_cache=V_cache,
        attention_mask=attention_mask, sink=None, softmax_scale=softmax_scale, enable_fa_s_prior_tiling=True,
        update_cache=True, kv_cache_update_idx=kv_cache_update_idx, k_scale=None, v_scale=None, W_out=W_out,
        bias_out=None, quantization_type_out=qt.NONE, weight_dequant_scale_out=None, input_dequant_scale_out=None,
        transposed_out=False, out_in_sb=False, sbm=None, KVDP=1, KVDP_replica_group=None)
    return out


def inputs(X, W_qkv, K_cache, V_cache, position_ids, cos, sin, W_o, gamma, hidden_actual=0, lnc=1,
           softmax_scale=0.0):
    """The library kernel's keyword arguments for the same attention as our kernel's arguments (NumPy or torch, bf16;
    caches [B, 1, S_ctx, d], position_ids [B, S_tkg], cos/sin [B, S_tkg, d/2], gamma [1, H])."""
    import torch

    def np16(t):
        return t.float().numpy().astype(BF16) if isinstance(t, torch.Tensor) else np.asarray(t).astype(BF16)

    B, S, H = X.shape
    d = K_cache.shape[3]
    q_heads = W_o.shape[0] // d
    s_ctx = K_cache.shape[2]
    pos = np.asarray(position_ids.numpy() if isinstance(position_ids, torch.Tensor) else position_ids)
    cache_len = pos[:, :1].astype(np.int64)          # cache rows before each sequence's first new token
    build = nkilib.load("core.attention.gen_mask_tkg_torch:build_full_attention_mask")
    mask = build(cache_lens=torch.from_numpy(cache_len.flatten().astype(np.float32)), batch=B, num_heads=q_heads,
                 s_active=S, s_ctx=s_ctx, lnc=lnc, block_len=0, include_active_mask=True, transposed=True,
                 enable_fa_s_prior_tiling=True, KVDP=1).numpy()
    return dict(X=np16(X), rmsnorm_X_gamma=np16(gamma), W_qkv=np16(W_qkv),
                cos=np.ascontiguousarray(np16(cos).transpose(2, 0, 1)),
                sin=np.ascontiguousarray(np16(sin).transpose(2, 0, 1)),
                K_cache=np16(K_cache), V_cache=np16(V_cache),
                attention_mask=np.ascontiguousarray(mask).astype(np.uint8),
                kv_cache_update_idx=cache_len.astype(np.uint32), W_out=np16(W_o),
                X_hidden_dim_actual=hidden_actual or H, softmax_scale=softmax_scale or 1.0 / d ** 0.5)
