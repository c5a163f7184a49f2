"""The vision seed's bucket-waste comparison, modelled: block-level DP (one call, one bucket for every image) vs
model-level DP (independent encoder replicas, each picking the bucket of its own image).

Workload (the seed's example): one small image (16 x 16 = 256 patches) and one large image (64 x 64 = 4096 patches),
compiled buckets of 1024, 2048 and 4096-patch blocks. ``select_vision_bucket`` (modules/vision) picks each call's
bucket exactly as the encoder would; each call's latency is the analytical model's modelled step
(``evaluate_vision``: per-rank FLOPs/bytes roofs, TP all-reduces, the DP all-gather, padding blocks included).

Attention is charged for the 128 x 128 (query, key) tiles the images cover (``attended_pairs``: the block kernel
skips tiles outside every image), on the busiest DP rank; every linear layer (QKV, O, MLP, mergers) runs on every row
of every block, padded or not — that per-row work is the waste this table shows. All figures are modelled, none
measured.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from bench.model.analytical import Bucket, ParallelConfig, evaluate_vision
from bench.model.hardware import get_instance
from modules.model_specs import QWEN3_VL_VIT, VisionModelSpec
from modules.vision.packing import ImageGrid, place_frames, select_vision_bucket
from nki_kernels.vision.limits import P as TILE  # the kernel's query / key tile (SBUF partitions)

SMALL = ImageGrid(1, 16, 16)     # a 256 x 256 image at patch 16
LARGE = ImageGrid(1, 64, 64)     # a 1024 x 1024 image
# Compiled shapes (block_size, num_blocks); select_vision_bucket pads num_blocks to the call's dp.
BUCKETS = ((1024, 1), (1024, 2), (2048, 1), (2048, 2), (4096, 1), (4096, 2))


@dataclass(frozen=True)
class Layout:
    """How the world's ranks run the workload: ``replicas`` independent encoders of tp x dp ranks each."""

    mode: str        # "block-level DP" | "model-level DP"
    tp: int
    dp: int
    replicas: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.replicas

    def label(self) -> str:
        one = f"tp{self.tp} dp{self.dp}"
        return one if self.replicas == 1 else f"{self.replicas} replicas x ({one})"


# Worlds of 2 and 4 ranks: every block-level (tp, dp) split, and two replicas (one per image) of half the world.
LAYOUTS = (Layout("block-level DP", 1, 2), Layout("block-level DP", 2, 1), Layout("model-level DP", 1, 1, 2),
           Layout("block-level DP", 1, 4), Layout("block-level DP", 2, 2), Layout("block-level DP", 4, 1),
           Layout("model-level DP", 2, 1, 2))


def attended_pairs(images, block_size: int, num_blocks: int, dp: int) -> int:
    """(query, key) pairs per head the attention computes on the busiest of ``dp`` ranks: per query tile, the key
    tiles from its rows' lowest to highest bound, for the blocks select_vision_bucket/pack_images would lay out."""
    frames = [g.frame_tokens for g in images for _ in range(g.t)]
    spans = defaultdict(list)                       # block → [(start, end)] of its frames
    for (b, off), n in zip(place_frames(frames, block_size), frames):
        spans[b].append((off, off + n))
    per_block = [0] * num_blocks
    for b, sp in spans.items():
        for q0 in range(0, block_size, TILE):
            hit = [(lo, hi) for lo, hi in sp if lo < q0 + TILE and hi > q0]
            if hit:
                k_tiles = -(-max(hi for _, hi in hit) // TILE) - min(lo for lo, _ in hit) // TILE
                per_block[b] += k_tiles * TILE * TILE
    per = num_blocks // dp
    return max(sum(per_block[r * per:(r + 1) * per]) for r in range(dp))


def _call(spec: VisionModelSpec, instance: str, tp: int, dp: int, images) -> tuple[tuple[int, int], float]:
    block_size, num_blocks = select_vision_bucket(images, BUCKETS, dp)
    pairs = attended_pairs(images, block_size, num_blocks, dp)
    step = evaluate_vision(replace(spec, block_size=block_size), get_instance(instance), ParallelConfig(tp, dp),
                           Bucket("vision", vision_blocks=num_blocks, vision_attn_pairs=pairs))
    return (block_size, num_blocks), step.t_step


def bucket_waste_row(layout: Layout, instance: str, spec: VisionModelSpec = QWEN3_VL_VIT) -> dict:
    """One modelled row: buckets used, patches processed vs real, each image's latency, rank-seconds per workload."""
    real = SMALL.tokens + LARGE.tokens
    if layout.replicas == 1:
        bucket, t = _call(spec, instance, layout.tp, layout.dp, [SMALL, LARGE])
        buckets, rows = [bucket], bucket[0] * bucket[1]
        t_small = t_large = t
        rank_s = layout.world * t
    elif layout.replicas == 2:
        (b_small, t_small), (b_large, t_large) = (_call(spec, instance, layout.tp, layout.dp, [img])
                                                  for img in (SMALL, LARGE))
        buckets, rows = [b_small, b_large], sum(bs * n for bs, n in (b_small, b_large))
        rank_s = layout.tp * layout.dp * (t_small + t_large)
    else:
        raise ValueError(f"bucket_waste_row: {layout.replicas} replicas; the workload has 2 images (1 or 2 replicas)")
    return {"kind": "vision-buckets", "modelled": True, "model": spec.name, "instance": instance,
            "target": get_instance(instance).target, "mode": layout.mode, "layout": layout.label(),
            "world": layout.world, "tp": layout.tp, "dp": layout.dp, "replicas": layout.replicas,
            "buckets": " + ".join(f"{n}x{bs}" for bs, n in buckets), "patches_processed": rows,
            "patches_real": real, "real_fraction": real / rows,
            "modelled_small_image_latency_s": t_small, "modelled_large_image_latency_s": t_large,
            "modelled_rank_seconds": rank_s}
