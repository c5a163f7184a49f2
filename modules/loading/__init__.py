"""Sharded weight loading: pure loaders attached to parameters, and a lazy safetensors checkpoint."""

from modules.loading.checkpoint import LoadTimings, SafetensorsCheckpoint
from modules.loading.loaders import (
    ShardSpec,
    fused_qkv_weight_loader,
    gate_up_weight_loader,
    get_weight_loader,
    head_range_weight_loader,
    load_from_tensors,
    replicated_weight_loader,
    reshaped_weight_loader,
    set_weight_loader,
    sharding_weight_loader,
    transposed_weight_loader,
    with_rank_override,
)

__all__ = [
    "LoadTimings",
    "SafetensorsCheckpoint",
    "ShardSpec",
    "fused_qkv_weight_loader",
    "gate_up_weight_loader",
    "get_weight_loader",
    "head_range_weight_loader",
    "load_from_tensors",
    "replicated_weight_loader",
    "reshaped_weight_loader",
    "set_weight_loader",
    "sharding_weight_loader",
    "transposed_weight_loader",
    "with_rank_override",
]
