"""MoE kernels (router, TKG for decode, blockwise CTE for prefill) and their torch references."""

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

__all__ = ["ACTIVATIONS", "ROUTER_MODES", "activation_torch", "dense_affinities", "dequant_mxfp4",
           "expert_mlp_torch", "moe_experts_torch", "moe_torch", "rmsnorm_torch", "router_torch"]
