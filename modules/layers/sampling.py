"""Greedy sampling over TP-sharded logits without gathering the vocabulary."""

from __future__ import annotations

import torch


def sharded_greedy_sample(local_logits: torch.Tensor, tp_group, vocab_start: int,
                          valid: int | None = None) -> torch.Tensor:
    """Global argmax over the vocab from each rank's [.., V/n] slice: local (max, index) pairs are all-gathered
    (2 values per token per rank instead of V/n), then reduced locally. Ties go to the lowest token id, as
    torch.argmax does. valid: number of real (unpadded) columns in this shard."""
    if valid is not None:
        # A slice past the end would silently ignore a wrong `valid`; name the limit instead.
        if not 0 <= valid <= local_logits.shape[-1]:
            raise ValueError(f"valid={valid} must be in [0, {local_logits.shape[-1]}] (columns of this rank's shard)")
        local_logits = local_logits[..., :valid]
    if local_logits.shape[-1] == 0:
        vals = local_logits.new_full(local_logits.shape[:-1], float("-inf"))
        idx = torch.zeros(local_logits.shape[:-1], dtype=torch.long)
    else:
        idx = local_logits.argmax(dim=-1)  # first maximum, like a global torch.argmax
        vals = local_logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    # float64 carries both the logit and the token id exactly (ids < 2**53).
    pair = torch.stack([vals.double(), (idx + vocab_start).double()], dim=-1).unsqueeze(0)
    pairs = tp_group.all_gather(pair, dim=0)  # [n, .., 2]
    best = pairs[..., 0].argmax(dim=0, keepdim=True)  # first (lowest-rank → lowest id) max wins ties
    return pairs[..., 1].gather(0, best).squeeze(0).long()
