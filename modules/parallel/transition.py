"""Batch-state transitions between DP column groups (decode) and vision block scatter/gather (prefill).

A tensor "gathered at group G" holds, along ``dim``, the local batches of G.world_size consecutive DP
replicas in column order. Column groups of different sizes nest (a size-t column is an aligned sub-block of
a size-c column when t divides c), which is what makes the slice rule below correct.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _per_replica(x: torch.Tensor, dim: int, n: int, sizes: Sequence[int] | None, name: str) -> list[int]:
    if sizes is None:
        if x.shape[dim] % n:
            raise ValueError(f"dp_transition: x.shape[{dim}]={x.shape[dim]} is not divisible by {name}={n}; "
                             "pass sizes for ragged batches")
        return [x.shape[dim] // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or any(s < 0 for s in sizes):
        raise ValueError(f"dp_transition: sizes={sizes} must hold {name}={n} non-negative entries")
    return sizes


def dp_transition(x: torch.Tensor, current_group, target_group, dim: int = 0,
                  sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Move x from "gathered at current_group" to "gathered at target_group".

    Equal sizes: no-op. Down (current > target): keep this rank's aligned block of target-size replicas, no
    communication. Up: narrow to this rank's own replica first (so overlapping gathered states never
    duplicate rows), then one all-gather over target_group.

    sizes: optional per-replica row counts for ragged batches, for the replicas of the *larger* group in
    column order (current group when going down, target group when going up). Default: equal split.
    """
    cur, tgt = current_group.world_size, target_group.world_size
    if cur == tgt:
        return x
    dim = dim % max(x.dim(), 1)
    if cur > tgt:
        if cur % tgt:
            raise ValueError(f"dp_transition: target size {tgt} must divide current size {cur}")
        per = _per_replica(x, dim, cur, sizes, "current_group.world_size")
        if x.shape[dim] != sum(per):
            raise ValueError(f"dp_transition: x.shape[{dim}]={x.shape[dim]} != sum(sizes)={sum(per)}")
        first = (current_group.rank_in_group // tgt) * tgt
        start = sum(per[:first])
        return x.narrow(dim, start, sum(per[first:first + tgt]))
    if tgt % cur:
        raise ValueError(f"dp_transition: current size {cur} must divide target size {tgt}")
    if sizes is None:
        per = _per_replica(x, dim, cur, None, "current_group.world_size")
        local = x.narrow(dim, current_group.rank_in_group * per[0], per[0])
        return target_group.all_gather(local, dim=dim)
    per = _per_replica(x, dim, tgt, sizes, "target_group.world_size")
    # This rank's replica is target_group.rank_in_group; x holds the aligned block of cur replicas around it.
    me = target_group.rank_in_group
    first = (me // cur) * cur
    if x.shape[dim] != sum(per[first:first + cur]):
        raise ValueError(f"dp_transition: x.shape[{dim}]={x.shape[dim]} != rows of replicas "
                         f"{first}..{first + cur - 1} in sizes={per}")
    local = x.narrow(dim, sum(per[first:me]), per[me])
    return target_group.all_gatherv(local, per, dim=dim)


def dp_scatter_blocks(x: torch.Tensor, dp_group, dim: int = 0) -> torch.Tensor:
    """Vision DP step 0: keep this rank's num_blocks / dp_size blocks (pad num_blocks first)."""
    n = dp_group.world_size
    if x.shape[dim] % n:
        raise ValueError(f"dp_scatter_blocks: num_blocks={x.shape[dim]} is not divisible by dp_size={n}; "
                         "pad with pad_blocks first")
    per = x.shape[dim] // n
    return x.narrow(dim, dp_group.rank_in_group * per, per)


def dp_gather_blocks(x: torch.Tensor, dp_group, dim: int = 0) -> torch.Tensor:
    """Vision DP step 4: all-gather the merged blocks back to [num_blocks, ...] on every rank."""
    return dp_group.all_gather(x, dim=dim)
