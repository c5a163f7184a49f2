"""Block packing of vision inputs: images of different grids → [num_blocks, block_size, ...] tensors.

The attention unit is a *frame* (h*w patches of one image or one video frame): a query attends to the keys of its
own frame only (HF Qwen3-VL's cu_seqlens), so frames are what gets packed. Frames are placed first-fit decreasing
(largest first, ties in input order); inside a block they sit in input order, back to back. Every frame holds a
whole number of merge groups and every block size is a multiple of the merge unit, so the merger's groups of
``merge_unit`` consecutive rows never straddle a frame or a block.

Per packed row the host computes: the patch's pixels, its 4 position-embedding corner indices and blend weights,
rotary cos/sin and the attention bounds ``[bound_min, bound_max)`` (block-local; padding rows get the empty range
[0, 0)). ``unpack_indices[j]`` is the row of the flattened merged output [num_blocks * block_size / merge_unit, D]
holding the j-th merged token in HF's per-image order — the only rows the encoder returns, so padding never reaches
the output.

num_blocks padding to a multiple of vision dp (the seed's three points): point 1 is ``VisionNeuronConfig``
(compiled bucket shapes), point 2 is ``select_vision_bucket``, point 3 is ``warmup_shapes``; ``pack_images``
pads too when it chooses num_blocks itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch

from modules.config import VisionNeuronConfig, pad_num_blocks
from modules.vision.config import VisionEncoderConfig
from modules.vision.positions import pos_embed_blend, rotary_cos_sin


@dataclass(frozen=True)
class ImageGrid:
    """One image (t = 1) or video (t frames) as a grid of patches: t x h x w."""

    t: int
    h: int
    w: int

    def __post_init__(self) -> None:
        for name in ("t", "h", "w"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ImageGrid.{name} must be a positive integer, got {v!r}")

    @property
    def frame_tokens(self) -> int:
        return self.h * self.w

    @property
    def tokens(self) -> int:
        return self.t * self.h * self.w


def as_grids(grids: Iterable) -> list[ImageGrid]:
    """Accept ImageGrid objects, (t, h, w) triples or an HF ``image_grid_thw`` tensor [n, 3]."""
    if isinstance(grids, torch.Tensor):
        grids = grids.tolist()
    return [g if isinstance(g, ImageGrid) else ImageGrid(*(int(v) for v in g)) for g in grids]


def _check_grids(grids: Sequence[ImageGrid], merge: int) -> None:
    if not grids:
        raise ValueError("pack_images: no images")
    for i, g in enumerate(grids):
        if g.h % merge or g.w % merge:
            raise ValueError(f"image {i}: grid h={g.h}, w={g.w} must be multiples of spatial_merge_size={merge}")


def place_frames(frame_tokens: Sequence[int], block_size: int) -> list[tuple[int, int]]:
    """(block, offset) of each frame, first-fit decreasing. Raises if a frame exceeds block_size."""
    order = sorted(range(len(frame_tokens)), key=lambda i: (-frame_tokens[i], i))
    free: list[int] = []
    block_of = [0] * len(frame_tokens)
    for i in order:
        n = frame_tokens[i]
        if n > block_size:
            raise ValueError(f"frame {i} has {n} patches, more than block_size={block_size}: a frame must fit in "
                             "one block (its attention never crosses blocks); choose a larger bucket")
        b = next((b for b, f in enumerate(free) if f >= n), None)
        if b is None:
            b = len(free)
            free.append(block_size)
        free[b] -= n
        block_of[i] = b
    # Inside a block, frames in input order (deterministic layout, independent of the placement order).
    fill = [0] * len(free)
    out = []
    for i, n in enumerate(frame_tokens):
        b = block_of[i]
        out.append((b, fill[b]))
        fill[b] += n
    return out


def _frames(grids: Sequence[ImageGrid]) -> list[int]:
    return [g.frame_tokens for g in grids for _ in range(g.t)]


def blocks_needed(grids: Iterable, block_size: int) -> int:
    """Blocks the first-fit-decreasing packing of these images uses (before any dp padding)."""
    frames = _frames(as_grids(grids))
    return 1 + max(b for b, _ in place_frames(frames, block_size))


@dataclass
class PackedVision:
    """The encoder's per-call inputs (every tensor's dim 0 is num_blocks, except unpack_indices)."""

    pixel_values: torch.Tensor     # [num_blocks, block_size, patch_dim]
    pos_emb_idx: torch.Tensor      # [num_blocks, block_size, 4] int64: learned-table corners
    pos_emb_weight: torch.Tensor   # [num_blocks, block_size, 4] fp32: bilinear blend weights
    cos: torch.Tensor              # [num_blocks, block_size, head_dim] fp32
    sin: torch.Tensor              # [num_blocks, block_size, head_dim] fp32
    bound_min: torch.Tensor        # [num_blocks, block_size] int32
    bound_max: torch.Tensor        # [num_blocks, block_size] int32
    unpack_indices: torch.Tensor   # [merged_seq_len] int64 into the flattened merged blocks
    num_real_blocks: int           # blocks holding patches; the rest are zero padding

    BLOCK_FIELDS = ("pixel_values", "pos_emb_idx", "pos_emb_weight", "cos", "sin", "bound_min", "bound_max")

    @property
    def num_blocks(self) -> int:
        return self.pixel_values.shape[0]

    @property
    def block_size(self) -> int:
        return self.pixel_values.shape[1]

    def block_tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in self.BLOCK_FIELDS}

    def replace_blocks(self, **tensors: torch.Tensor) -> PackedVision:
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw.update(tensors)
        return PackedVision(**kw)


def pack_images(pixel_values: torch.Tensor, grids: Iterable, cfg: VisionEncoderConfig, block_size: int,
                num_blocks: int | None = None, dp_size: int = 1) -> PackedVision:
    """Pack HF-processor pixel values [sum(t*h*w), patch_dim] of the images ``grids`` into blocks.

    num_blocks: the bucket's block count (padding blocks are zeros); by default the blocks needed, padded to a
    multiple of dp_size.
    """
    grids = as_grids(grids)
    cfg.check_block_size(block_size)
    merge = cfg.spatial_merge_size
    _check_grids(grids, merge)
    total = sum(g.tokens for g in grids)
    if pixel_values.dim() != 2 or pixel_values.shape != (total, cfg.patch_dim):
        raise ValueError(f"pack_images: pixel_values shape {tuple(pixel_values.shape)} != (sum of t*h*w = {total}, "
                         f"patch_dim = {cfg.patch_dim})")
    frames = _frames(grids)
    where = place_frames(frames, block_size)
    needed = 1 + max(b for b, _ in where)
    if num_blocks is None:
        num_blocks = pad_num_blocks(needed, dp_size)
    elif needed > num_blocks:
        raise ValueError(f"pack_images: the images need {needed} blocks of {block_size} but the bucket has "
                         f"num_blocks={num_blocks}")
    elif num_blocks % dp_size:
        raise ValueError(f"pack_images: num_blocks={num_blocks} is not a multiple of dp_size={dp_size}")

    # Per-token host inputs in the flat (HF) order, then one scatter into the block layout.
    idx, wt, cos, sin, bmin, bmax, dst = [], [], [], [], [], [], []
    unpack = []
    frame = 0
    mbs = block_size // cfg.merge_unit
    for g in grids:
        i, w = pos_embed_blend(g.t, g.h, g.w, cfg.num_grid_per_side, merge)
        c, s = rotary_cos_sin(g.t, g.h, g.w, cfg.head_dim, merge, cfg.rope_theta)
        idx.append(i)
        wt.append(w)
        cos.append(c)
        sin.append(s)
        for _ in range(g.t):
            b, off = where[frame]
            n = g.frame_tokens
            rows = b * block_size + off + torch.arange(n)
            dst.append(rows)
            bmin.append(torch.full((n,), off, dtype=torch.int32))
            bmax.append(torch.full((n,), off + n, dtype=torch.int32))
            unpack.append(b * mbs + off // cfg.merge_unit + torch.arange(n // cfg.merge_unit))
            frame += 1
    dst = torch.cat(dst)
    rows = num_blocks * block_size

    def scatter(flat: torch.Tensor) -> torch.Tensor:
        out = flat.new_zeros((rows, *flat.shape[1:]))
        out[dst] = flat
        return out.reshape(num_blocks, block_size, *flat.shape[1:])

    return PackedVision(
        pixel_values=scatter(pixel_values), pos_emb_idx=scatter(torch.cat(idx)),
        pos_emb_weight=scatter(torch.cat(wt)), cos=scatter(torch.cat(cos)), sin=scatter(torch.cat(sin)),
        bound_min=scatter(torch.cat(bmin)), bound_max=scatter(torch.cat(bmax)),
        unpack_indices=torch.cat(unpack).long(), num_real_blocks=needed)


def select_vision_bucket(grids: Iterable, buckets: Iterable[tuple[int, int]], dp_size: int = 1) -> tuple[int, int]:
    """The cheapest compiled bucket (block_size, num_blocks) the images pack into; num_blocks padded to dp_size.

    Cost = block_size x padded num_blocks (rows every linear layer processes); ties go to the smaller block
    (less attention work). All images of one call share the bucket (block-level DP), so one large image forces a
    large block on every small one — the waste bench/test_vision_buckets.py measures.
    """
    grids = as_grids(grids)
    buckets = [(int(bs), int(n)) for bs, n in buckets]
    if not buckets:
        raise ValueError("select_vision_bucket: no buckets configured")
    frames = _frames(grids)
    best = None
    for bs, n in buckets:
        if max(frames) > bs:
            continue
        n = pad_num_blocks(n, dp_size)            # padding point 2: a bucket that was configured unpadded
        if 1 + max(b for b, _ in place_frames(frames, bs)) > n:
            continue
        key = (bs * n, bs)
        if best is None or key < best[0]:
            best = (key, (bs, n))
    if best is None:
        raise ValueError(f"select_vision_bucket: no bucket in {tuple(buckets)} fits {len(grids)} image(s) "
                         f"(largest frame {max(frames)} patches, {sum(frames)} patches in all)")
    return best[1]


def warmup_shapes(vision: VisionNeuronConfig, cfg: VisionEncoderConfig) -> list[dict[str, tuple[int, ...]]]:
    """Input shapes of every compiled bucket for warmup; num_blocks padded to vision dp (padding point 3)."""
    dp = vision._require_resolved()
    out = []
    for bs, n in vision.buckets:
        cfg.check_block_size(bs)
        n = pad_num_blocks(n, dp)
        out.append({"pixel_values": (n, bs, cfg.patch_dim), "pos_emb_idx": (n, bs, 4), "pos_emb_weight": (n, bs, 4),
                    "cos": (n, bs, cfg.head_dim), "sin": (n, bs, cfg.head_dim), "bound_min": (n, bs),
                    "bound_max": (n, bs)})
    return out
