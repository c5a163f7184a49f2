"""VisionEncoderConfig: the Qwen3-VL vision tower's dimensions under its Hugging Face ``vision_config`` names.

Built from the shared shape table (``modules.model_specs.QWEN3_VL_VIT``) or from an HF ``vision_config`` dict; tests
build tiny ones directly. Only model dimensions live here; the parallel layout is ``modules.config.VisionNeuronConfig``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from modules.config import check_vision_block_size
from modules.model_specs import VisionModelSpec


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"VisionEncoderConfig.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class VisionEncoderConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10000.0      # HF Qwen3VLVisionRotaryEmbedding's default

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "in_channels",
                     "patch_size", "temporal_patch_size", "spatial_merge_size", "num_position_embeddings"):
            _positive(name, getattr(self, name))
        object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"VisionEncoderConfig: hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.head_dim % 4:
            # 2D rotary: half the rotary dims for rows, half for columns, each made of (cos, sin) pairs.
            raise ValueError(f"VisionEncoderConfig: head_dim={self.head_dim} must be a multiple of 4 (2D rotary)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"VisionEncoderConfig: num_position_embeddings={self.num_position_embeddings} must be "
                             "a square (a learned side x side grid)")
        for i in self.deepstack_visual_indexes:
            if not (isinstance(i, int) and 0 <= i < self.depth):
                raise ValueError(f"VisionEncoderConfig: deepstack index {i!r} is not a layer in [0, {self.depth})")
        if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ValueError(f"VisionEncoderConfig: duplicate deepstack indexes {self.deepstack_visual_indexes}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output token (a spatial_merge_size x spatial_merge_size square)."""
        return self.spatial_merge_size**2

    @property
    def merged_hidden(self) -> int:
        return self.hidden_size * self.merge_unit

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def num_outputs(self) -> int:
        """Feature sets in the fat output: the main merger plus one per deepstack layer."""
        return 1 + len(self.deepstack_visual_indexes)

    def check_block_size(self, block_size: int) -> int:
        return check_vision_block_size(block_size, self.merge_unit)

    def check_tp(self, tp_size: int) -> None:
        """Every sharded dimension must split evenly over the vision TP group."""
        for name, value in (("num_heads", self.num_heads), ("intermediate_size", self.intermediate_size),
                            ("merger hidden (hidden_size * spatial_merge_size**2)", self.merged_hidden)):
            if value % tp_size:
                raise ValueError(f"VisionEncoder: {name}={value} is not divisible by vision tp_size={tp_size}")

    @classmethod
    def from_spec(cls, spec: VisionModelSpec) -> VisionEncoderConfig:
        if len(spec.deepstack_indexes) != spec.deepstack_mergers:
            raise ValueError(f"{spec.name}: {spec.deepstack_mergers} deepstack mergers but indexes "
                             f"{spec.deepstack_indexes}")
        cfg = cls(depth=spec.layers, hidden_size=spec.hidden, num_heads=spec.heads,
                  intermediate_size=spec.intermediate, out_hidden_size=spec.out_hidden,
                  in_channels=spec.in_channels, patch_size=spec.patch_size,
                  temporal_patch_size=spec.temporal_patch_size, spatial_merge_size=spec.spatial_merge,
                  num_position_embeddings=spec.num_position_embeddings,
                  deepstack_visual_indexes=spec.deepstack_indexes, layer_norm_eps=spec.layer_norm_eps)
        if cfg.head_dim != spec.head_dim or cfg.patch_dim != spec.patch_dim:
            raise ValueError(f"{spec.name}: head_dim/patch_dim disagree with hidden/heads/patch sizes")
        return cfg

    @classmethod
    def from_hf(cls, vision_config: Mapping) -> VisionEncoderConfig:
        """From an HF Qwen3-VL ``vision_config`` (config.json); only gelu_pytorch_tanh MLPs are implemented."""
        act = vision_config.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"VisionEncoderConfig.from_hf: hidden_act={act!r} is not supported "
                             "(gelu_pytorch_tanh only)")
        keys = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "in_channels",
                "patch_size", "temporal_patch_size", "spatial_merge_size", "num_position_embeddings",
                "deepstack_visual_indexes")
        return cls(**{k: (tuple(vision_config[k]) if k == "deepstack_visual_indexes" else vision_config[k])
                      for k in keys if k in vision_config})
