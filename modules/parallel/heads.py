"""Attention head sharding over a TP group, with KV-head replication when TP exceeds the KV head count."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSharding:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    q_heads_per_rank: int
    kv_heads_per_rank: int
    num_kv_replicas: int  # ranks sharing each KV head (1 = no replication)

    @property
    def q_size(self) -> int:
        return self.q_heads_per_rank * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads_per_rank * self.head_dim

    def q_head_start(self, rank: int) -> int:
        return rank * self.q_heads_per_rank

    def kv_head_start(self, rank: int) -> int:
        # Replicated: ranks [k*r, (k+1)*r) all hold KV head k (vLLM: shard_rank = tp_rank // num_kv_replicas).
        return (rank // self.num_kv_replicas) * self.kv_heads_per_rank


def shard_heads(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int) -> HeadSharding:
    """Q heads split evenly; KV heads split when tp <= num_kv_heads, else each KV head on tp/num_kv ranks.

    GPT-OSS (64 Q, 8 KV): TP=8 → 8 Q + 1 KV per rank; TP=16 → 4 Q + 1 KV per rank, each KV head on 2 ranks.
    """
    for name, v in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("tp_size", tp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if num_heads % tp_size:
        raise ValueError(f"num_heads={num_heads} must be divisible by tp_size={tp_size}")
    if tp_size >= num_kv_heads:
        if tp_size % num_kv_heads:
            raise ValueError(f"tp_size={tp_size} must be a multiple of num_kv_heads={num_kv_heads} to replicate KV")
        kv_per, replicas = 1, tp_size // num_kv_heads
    else:
        if num_kv_heads % tp_size:
            raise ValueError(f"num_kv_heads={num_kv_heads} must be divisible by tp_size={tp_size}")
        kv_per, replicas = num_kv_heads // tp_size, 1
    return HeadSharding(num_heads, num_kv_heads, head_dim, tp_size, num_heads // tp_size, kv_per, replicas)
