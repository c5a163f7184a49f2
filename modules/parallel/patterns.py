"""The decode-time decoder-layer flow of the component-DP seed, with the model's math passed in.

Models call this so that the transitions and collectives are in one place; tests and the benchmark model run
it with toy partial functions and count the log. ``attn_partial``/``mlp_partial`` compute this rank's partial
output (its TP and DP weight shard) on the gathered input; the component TP all-reduce sums the partials.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from modules.parallel.state import ComponentGroups
from modules.parallel.transition import dp_transition

Partial = Callable[[torch.Tensor], torch.Tensor]


def decoder_layer_decode(x: torch.Tensor, attention: ComponentGroups, mlp: ComponentGroups, attn_partial: Partial,
                         mlp_partial: Partial, dim: int = 0) -> torch.Tensor:
    """x arrives gathered at mlp_dp and leaves gathered at mlp_dp.

    Collectives: attention all-reduce + MLP all-reduce, plus one all-gather for whichever of the two
    transitions goes up when attn_dp != mlp_dp (the other goes down: a slice, no communication).
    """
    h = dp_transition(x, mlp.dp, attention.dp, dim=dim)
    h = h + attention.tp.all_reduce(attn_partial(h))  # residual add at attn_dp
    h = dp_transition(h, attention.dp, mlp.dp, dim=dim)
    return h + mlp.tp.all_reduce(mlp_partial(h))  # residual add at mlp_dp
