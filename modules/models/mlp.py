"""Dense SwiGLU MLP (Llama-3) sharded over the intermediate dim of one TP group: fused [gate | up] column-parallel
(the gate_up loader), down row-parallel. Prefill: the MLP group is the plain TP group and the flow is sequence
parallel (all-gather → MLP → reduce-scatter). Decode: the group is the MLP component TP group (tp × mlp_dp ranks)
and the caller all-reduces ``partial`` over it (the TP and DP weight-shard partials in one collective)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modules.layers.linear import RowParallelLinear
from modules.layers.norm import RMSNorm
from modules.loading.loaders import gate_up_weight_loader, set_weight_loader, with_rank_override


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp_group, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        n = tp_group.world_size
        if intermediate % n:
            raise ValueError(f"DenseMLP: intermediate={intermediate} is not divisible by the MLP group size {n}")
        self.tp_group, self.per_rank = tp_group, intermediate // n
        self.norm = RMSNorm(hidden, eps, dtype=dtype)  # post_attention_layernorm (replicated)
        self.gate_up = nn.Parameter(torch.zeros(2 * self.per_rank, hidden, dtype=dtype), requires_grad=False)
        set_weight_loader(self.gate_up, with_rank_override(gate_up_weight_loader(intermediate, n),
                                                           tp_group.rank_in_group))
        self.down = RowParallelLinear(intermediate, hidden, tp_group, dtype=dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output for rows x [N, H] (norm included; no collective)."""
        gate, up = F.linear(self.norm(x), self.gate_up).split(self.per_rank, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(x.dtype)
        return F.linear(act, self.down.weight)

    def forward_sp(self, x_sp: torch.Tensor) -> torch.Tensor:
        """Prefill: [T/n, H] in SP layout → all-gather → partial → reduce-scatter → [T/n, H]."""
        x = self.tp_group.all_gather(self.norm(x_sp), dim=0)
        gate, up = F.linear(x, self.gate_up).split(self.per_rank, dim=-1)
        act = (F.silu(gate.float()) * up.float()).to(x.dtype)
        return self.tp_group.reduce_scatter(F.linear(act, self.down.weight), dim=0)
