"""Column- and row-parallel linear layers (weights stored [out, in], as torch.nn.Linear)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from modules.loading.loaders import (
    replicated_weight_loader,
    set_weight_loader,
    sharding_weight_loader,
    with_rank_override,
)


class ColumnParallelLinear(nn.Module):
    """Y = X Aᵀ with A split along its output dim: this rank holds [out/n, in].

    sequence_parallel: the input is in SP layout [T/n, in] and is all-gathered along tokens first.
    gather_output: all-gather the output features (and drop padding) so every rank returns [.., out].
    pad: allow out % n != 0 by zero-padding the last shard (e.g. a vocab LM head).
    """

    def __init__(self, in_features: int, out_features: int, tp_group, bias: bool = False,
                 gather_output: bool = False, pad: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        n, rank = tp_group.world_size, tp_group.rank_in_group
        if out_features % n and not pad:
            raise ValueError(f"out_features={out_features} is not divisible by tp world_size={n}; pass pad=True")
        self.in_features, self.out_features, self.tp_group, self.gather_output = (
            in_features, out_features, tp_group, gather_output)
        self.out_per_rank = math.ceil(out_features / n)
        self.output_start = rank * self.out_per_rank
        self.weight = nn.Parameter(torch.zeros(self.out_per_rank, in_features, dtype=dtype), requires_grad=False)
        loader = with_rank_override(sharding_weight_loader(0, self.out_per_rank, n, pad=pad), rank)
        set_weight_loader(self.weight, loader)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_rank, dtype=dtype), requires_grad=False)
            set_weight_loader(self.bias, loader)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        if sequence_parallel:
            x = self.tp_group.all_gather(x, dim=0)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = self.tp_group.all_gather(y, dim=-1)[..., : self.out_features]
        return y


class RowParallelLinear(nn.Module):
    """Y = X Aᵀ with A split along its input dim: this rank holds [out, in/n] and its input is already
    feature-sharded. Partials are all-reduced, or reduce-scattered along tokens in SP; bias after the sum."""

    def __init__(self, in_features: int, out_features: int, tp_group, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        n, rank = tp_group.world_size, tp_group.rank_in_group
        if in_features % n:
            raise ValueError(f"in_features={in_features} is not divisible by tp world_size={n}")
        self.in_features, self.out_features, self.tp_group = in_features, out_features, tp_group
        self.in_per_rank = in_features // n
        self.weight = nn.Parameter(torch.zeros(out_features, self.in_per_rank, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, with_rank_override(sharding_weight_loader(1, self.in_per_rank, n), rank))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            set_weight_loader(self.bias, replicated_weight_loader())

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        y = self.tp_group.reduce_scatter(partial, dim=0) if sequence_parallel else self.tp_group.all_reduce(partial)
        return y if self.bias is None else y + self.bias
