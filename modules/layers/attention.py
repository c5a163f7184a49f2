"""Head-sharded attention: fused QKV column-parallel projection (KV replicated when TP > KV heads) and a
row-parallel O projection. RoPE and KV caches belong to the model; this is the sharding skeleton."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modules.layers.linear import RowParallelLinear
from modules.loading.loaders import fused_qkv_weight_loader, set_weight_loader, with_rank_override
from modules.parallel.heads import shard_heads


class QKVParallelLinear(nn.Module):
    """Fused [q | k | v] projection holding this rank's heads: weight [q_size + 2 kv_size, hidden]."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, tp_group,
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        n, rank = tp_group.world_size, tp_group.rank_in_group
        self.sharding = shard_heads(num_heads, num_kv_heads, head_dim, n)
        self.tp_group = tp_group
        q, kv = self.sharding.q_size, self.sharding.kv_size
        self.split_sizes = [q, kv, kv]
        self.weight = nn.Parameter(torch.zeros(q + 2 * kv, hidden_size, dtype=dtype), requires_grad=False)
        loader = with_rank_override(fused_qkv_weight_loader(num_heads, num_kv_heads, head_dim, n), rank)
        set_weight_loader(self.weight, loader)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(q + 2 * kv, dtype=dtype), requires_grad=False)
            set_weight_loader(self.bias, loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return F.linear(x, self.weight, self.bias).split(self.split_sizes, dim=-1)


class ParallelAttention(nn.Module):
    """Causal self-attention over [T, hidden] with heads sharded over tp_group.

    Prefill with sequence_parallel: input [T/n, H] is all-gathered, output reduce-scattered back to [T/n, H].
    Otherwise the O-projection partials are all-reduced.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, tp_group,
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.qkv_proj = QKVParallelLinear(hidden_size, num_heads, num_kv_heads, head_dim, tp_group, bias, dtype)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, tp_group, bias=bias, dtype=dtype)
        self.sharding = self.qkv_proj.sharding

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        if sequence_parallel:
            x = self.tp_group.all_gather(x, dim=0)
        s = self.sharding
        q, k, v = self.qkv_proj(x)
        t = x.shape[0]
        q = q.view(t, s.q_heads_per_rank, s.head_dim).transpose(0, 1)
        k = k.view(t, s.kv_heads_per_rank, s.head_dim).transpose(0, 1)
        v = v.view(t, s.kv_heads_per_rank, s.head_dim).transpose(0, 1)
        groups = s.q_heads_per_rank // s.kv_heads_per_rank  # GQA: local Q heads per local KV head
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(0, 1).reshape(t, s.q_size), sequence_parallel=sequence_parallel)
