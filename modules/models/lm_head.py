"""LM head over a vocab-sharded group with on-device greedy sampling: no rank ever holds the full logits.

The vocab is split over the group (the plain TP group in prefill, the LM-head component TP group in decode); when
V is not a multiple of the group size the last shard is zero-padded. Padded columns are masked before the argmax
(they would score 0, which beats every real logit when all real logits are negative), and the compare is fp32
(bf16 logits cast up, so the per-shard maxima are compared at full precision and ids travel exactly).
"""

from __future__ import annotations

import torch
from torch import nn

from modules.layers.linear import ColumnParallelLinear
from modules.layers.sampling import sharded_greedy_sample


class ShardedLMHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, tp_group, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab, self.tp_group = vocab, tp_group
        self.proj = ColumnParallelLinear(hidden, vocab, tp_group, pad=True, dtype=dtype)
        start, rows = self.proj.output_start, self.proj.out_per_rank
        self.valid = max(0, min(rows, vocab - start))  # real (unpadded) columns of this rank's shard

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[N, V/n] fp32 logits of this rank's vocab shard (padded columns included)."""
        return self.proj(x).float()

    def sample(self, x: torch.Tensor, mask_padding: bool = True) -> torch.Tensor:
        """Greedy token ids [N] over the whole vocab. mask_padding=False exists only to show what the mask
        prevents (a padded column winning)."""
        return sharded_greedy_sample(self.local_logits(x), self.tp_group, self.proj.output_start,
                                     valid=self.valid if mask_padding else None)

    def gathered_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Full [N, V] fp32 logits by an all-gather over the group (for checking only; serving never calls it)."""
        return self.tp_group.all_gather(self.local_logits(x), dim=-1)[..., : self.vocab]
