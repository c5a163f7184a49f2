"""DecodeAttention: one rank's shard of a decoder layer's attention for token generation, running the fused
decode-attention kernel (RMSNorm + QKV + RoPE + cache update + attention + partial O-projection) and all-reducing the
partial O-projection over the attention TP group."""

from __future__ import annotations

import torch
from torch import nn

from nki_kernels.attention import decode_attention


class DecodeAttention(nn.Module):
    """Holds this rank's shards in the kernel's layouts and runs the kernel, then `tp_group.all_reduce`.

    Args:
        hidden_size: H as the kernel sees it (padded to a multiple of 128); hidden_actual: real size for RMSNorm.
        num_heads / num_kv_heads: heads on THIS rank (q heads per KV head 1..16); head_dim: d.
        tp_group: anything with `.all_reduce(t)` and `.rank_in_group` (modules.parallel GroupCoordinator).
        bias / sinks / norm: optional QKV+O biases, per-head sinks, fused RMSNorm.
        sliding_window: 0 = full attention. backend: "auto" | "nki" | "nkisim" | "torch". lnc: 1 or 2.
    """

    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim, tp_group, hidden_actual=0, bias=False,
                 sinks=False, norm=True, eps=1e-5, sliding_window=0, softmax_scale=0.0, backend="auto", lnc=1,
                 dtype=torch.bfloat16):
        super().__init__()
        self.tp_group, self.backend, self.lnc = tp_group, backend, lnc
        self.hidden_actual, self.eps, self.sliding_window, self.softmax_scale = hidden_actual, eps, sliding_window, \
            softmax_scale
        cols = (num_heads + 2 * num_kv_heads) * head_dim

        def p(*shape, d=dtype):
            return nn.Parameter(torch.zeros(*shape, dtype=d), requires_grad=False)
        self.w_qkv = p(hidden_size, cols)                 # [H, (q | k | v) heads * d]
        self.w_o = p(num_heads * head_dim, hidden_size)   # [q heads * d, H]
        self.gamma = p(1, hidden_size) if norm else None
        self.b_qkv = p(1, cols) if bias else None
        self.b_o = p(1, hidden_size) if bias else None
        self.sinks = p(num_heads, d=torch.float32) if sinks else None

    def forward(self, x, k_cache, v_cache, position_ids, cos, sin, context_len=0, block_table=None):
        """x [B, S, H] -> [B, S, H] (all-reduced); k_cache / v_cache [B, kv, S_max, d] updated in place (paged:
        [num_blocks, kv, block_size, d] with block_table [B, max_blocks] int32)."""
        B, S, H = x.shape
        # The kernel's output is this rank's partial O-projection; the all-reduce sums the ranks' partials, so the
        # O bias is added by exactly one rank of the group (its first), fused into the kernel's eviction.
        partial = decode_attention(x, self.w_qkv.data, k_cache, v_cache, position_ids, cos, sin, self.w_o.data,
                                   gamma=None if self.gamma is None else self.gamma.data,
                                   bias_qkv=None if self.b_qkv is None else self.b_qkv.data,
                                   sinks=None if self.sinks is None else self.sinks.data,
                                   bias_o=None if self.b_o is None else self.b_o.data,
                                   add_bias_o=self.tp_group.rank_in_group == 0, context_len=context_len,
                                   softmax_scale=self.softmax_scale, eps=self.eps, hidden_actual=self.hidden_actual,
                                   sliding_window=self.sliding_window, block_table=block_table,
                                   backend=self.backend, lnc=self.lnc)
        return self.tp_group.all_reduce(partial.float()).to(x.dtype).view(B, S, H)
