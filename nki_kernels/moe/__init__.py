"""MoE kernels (router, TKG for decode, blockwise CTE for prefill) and their torch references."""

from .blockwise import BlockwiseMapping, blockwise_mapping
from .cte import moe_cte
from .moe_cte_torch import moe_cte_torch
from .moe_tkg import moe_tkg
from .moe_torch import (
    ACTIVATIONS,
    ROUTER_MODES,
    activation_torch,
    dense_affinities,
    dequant_mxfp4,
    expert_mlp_torch,
    moe_experts_torch,
    moe_torch,
    rmsnorm_torch,
    router_torch,
)
from .router import router

__all__ = ["BlockwiseMapping", "blockwise_mapping", "moe_cte", "moe_cte_torch",
           "ACTIVATIONS", "ROUTER_MODES", "activation_torch", "dense_affinities", "dequant_mxfp4",
           "expert_mlp_torch", "moe_experts_torch", "moe_torch", "rmsnorm_torch", "router_torch",
           "moe_tkg", "router"]
