"""Sharded layers (Megatron style): every layer takes its tp_group explicitly, never from a global."""

from modules.layers.attention import ParallelAttention, QKVParallelLinear
from modules.layers.embedding import VocabDimShardedEmbedding
from modules.layers.linear import ColumnParallelLinear, RowParallelLinear
from modules.layers.norm import LayerNorm, RMSNorm
from modules.layers.sampling import sharded_greedy_sample

__all__ = [
    "ColumnParallelLinear",
    "LayerNorm",
    "ParallelAttention",
    "QKVParallelLinear",
    "RMSNorm",
    "RowParallelLinear",
    "VocabDimShardedEmbedding",
    "sharded_greedy_sample",
]
