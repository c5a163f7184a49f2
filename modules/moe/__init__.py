"""MoE with tensor parallelism without EP: shapes, router, layer (prefill SP / decode flows), GPT-OSS loaders."""

from modules.moe.layer import UNSELECTED, MoELayer
from modules.moe.loaders import gpt_oss_checkpoint_is_mxfp4, gpt_oss_moe_mappings
from modules.moe.router import MoERouter
from modules.moe.shape import MoEShape, mx_aligned_intermediate

__all__ = ["UNSELECTED", "MoELayer", "MoERouter", "MoEShape", "gpt_oss_checkpoint_is_mxfp4", "gpt_oss_moe_mappings",
           "mx_aligned_intermediate"]
