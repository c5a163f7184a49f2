"""Vocabulary-sharded embedding."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modules.loading.loaders import set_weight_loader, sharding_weight_loader, with_rank_override


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raise naming the first id outside [0, vocab_size). (A device build would skip this host sync.)"""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        value = int(ids[bad].flatten()[0])
        raise ValueError(f"token id {value} is out of range for vocab_size={vocab_size}")


class VocabDimShardedEmbedding(nn.Module):
    """Rank k holds vocab rows [k*V/n, (k+1)*V/n) (the last shard zero-padded if V % n != 0).

    Out-of-shard ids are masked to row 0 and their outputs zeroed; the partial lookups are then summed with an
    all-reduce (decode) or a reduce-scatter along tokens into the SP layout (prefill).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group, dtype: torch.dtype = torch.float32,
                 check_ids: bool = True) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp_group, self.check_ids = (
            num_embeddings, embedding_dim, tp_group, check_ids)
        n, rank = tp_group.world_size, tp_group.rank_in_group
        self.rows_per_rank = math.ceil(num_embeddings / n)
        self.vocab_start = min(rank * self.rows_per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, embedding_dim, dtype=dtype), requires_grad=False)
        # The loader uses this group's rank, whatever rank the model loader passes (component-TP groups).
        set_weight_loader(self.weight, with_rank_override(
            sharding_weight_loader(0, self.rows_per_rank, n, pad=True), rank))

    def forward(self, ids: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        if self.check_ids:
            check_token_ids(ids, self.num_embeddings)
        in_shard = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(in_shard, ids - self.vocab_start, torch.zeros_like(ids))
        partial = F.embedding(local, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        if sequence_parallel:
            return self.tp_group.reduce_scatter(partial, dim=0)
        return self.tp_group.all_reduce(partial)
