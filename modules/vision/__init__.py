"""Qwen3-VL vision encoder: host-side block packing and the TP/DP-parallel encoder (vision-encoder seed)."""

from modules.vision.config import VisionEncoderConfig
from modules.vision.encoder import HF_PREFIX, Qwen3VLVisionEncoder
from modules.vision.packing import (
    ImageGrid,
    PackedVision,
    blocks_needed,
    pack_images,
    select_vision_bucket,
    warmup_shapes,
)

__all__ = [
    "HF_PREFIX",
    "ImageGrid",
    "PackedVision",
    "Qwen3VLVisionEncoder",
    "VisionEncoderConfig",
    "blocks_needed",
    "pack_images",
    "select_vision_bucket",
    "warmup_shapes",
]
