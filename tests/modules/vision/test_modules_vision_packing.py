"""Host-side packing of the Qwen3-VL vision inputs: position inputs vs HF's formulas, block layout and bounds,
unpack indices, num_blocks padding at the seed's three points, bucket selection and bad-input errors."""

import pytest
import torch
from vision_helpers import BLOCK, GRIDS, TINY, _pos_embed, _rotary, random_pixels

from modules.config import VisionNeuronConfig
from modules.parallel.coordinator import StaticGroup
from modules.vision import (
    ImageGrid,
    Qwen3VLVisionEncoder,
    VisionEncoderConfig,
    blocks_needed,
    pack_images,
    select_vision_bucket,
    warmup_shapes,
)
from modules.vision.positions import pos_embed_blend, rotary_cos_sin


@pytest.mark.parametrize("t,h,w", [(1, 8, 8), (2, 4, 6), (1, 10, 12), (1, 2, 2)])
def test_positions_match_hf_formulas(t, h, w):
    # Blend indices/weights applied to a random table == the point-by-point bilinear sample.
    table = torch.randn(TINY.num_position_embeddings, 5, dtype=torch.float64)
    idx, wt = pos_embed_blend(t, h, w, TINY.num_grid_per_side, TINY.spatial_merge_size)
    assert idx.shape == wt.shape == (t * h * w, 4) and wt.dtype == torch.float32
    torch.testing.assert_close(wt.sum(-1), torch.ones(t * h * w))
    got = (table[idx] * wt[..., None].double()).sum(-2)
    torch.testing.assert_close(got, _pos_embed(table, TINY.num_grid_per_side, t, h, w, 2).double(),
                               rtol=1e-6, atol=1e-6)
    cos, sin = rotary_cos_sin(t, h, w, TINY.head_dim, TINY.spatial_merge_size, TINY.rope_theta)
    ref_cos, ref_sin = _rotary(TINY, t, h, w)
    torch.testing.assert_close(cos, ref_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin, rtol=1e-5, atol=1e-5)


def test_block_layout_bounds_and_unpack():
    px = random_pixels(TINY, GRIDS)
    p = pack_images(px, GRIDS, TINY, BLOCK)
    # Frames 64, 24, 16, 16 (a 2-frame video), 120, 96 → first-fit decreasing: [120], [96, 24], [64, 16, 16].
    frames = [64, 24, 16, 16, 120, 96]
    assert p.num_real_blocks == 3 and p.num_blocks == 3
    used = (p.bound_max > p.bound_min).sum(1).tolist()
    assert sum(used) == sum(frames) and max(used) <= BLOCK
    # Every real row's pixels come from exactly one input row; bounds cover exactly its frame.
    flat_in = {tuple(r.tolist()): i for i, r in enumerate(px.float())}
    starts = [0]
    for n in frames:
        starts.append(starts[-1] + n)
    seen = []
    for b in range(p.num_blocks):
        for s in range(BLOCK):
            lo, hi = p.bound_min[b, s].item(), p.bound_max[b, s].item()
            if lo >= hi:
                assert (lo, hi) == (0, 0) and not p.pixel_values[b, s].any() and not p.cos[b, s].any()
                continue
            assert lo <= s < hi
            i = flat_in[tuple(p.pixel_values[b, s].float().tolist())]
            f = max(j for j in range(len(frames)) if starts[j] <= i)
            assert (hi - lo, s - lo) == (frames[f], i - starts[f])    # whole frame, same position inside it
            seen.append(i)
    assert sorted(seen) == list(range(sum(frames)))
    # unpack_indices: merged token j (HF order) lives where its first patch (input row 4j) was packed.
    row_of = {}
    for b in range(p.num_blocks):
        for s in range(0, BLOCK, 4):
            if p.bound_max[b, s] > p.bound_min[b, s]:
                row_of[flat_in[tuple(p.pixel_values[b, s].float().tolist())]] = b * (BLOCK // 4) + s // 4
    assert p.unpack_indices.tolist() == [row_of[4 * j] for j in range(sum(frames) // 4)]


def test_one_image_filling_a_block_and_dp_padding():
    grids = [ImageGrid(1, 8, 16)]
    p = pack_images(random_pixels(TINY, grids), grids, TINY, BLOCK, dp_size=4)
    assert (p.num_blocks, p.num_real_blocks) == (4, 1)
    assert (p.bound_min[0] == 0).all() and (p.bound_max[0] == BLOCK).all()
    assert not p.pixel_values[1:].any() and (p.bound_max[1:] == 0).all()
    assert p.unpack_indices.tolist() == list(range(BLOCK // 4))


def test_config_pads_buckets_point1():
    v = VisionNeuronConfig(tp_size=1, dp_size=4, buckets=((1024, 3), (4096, 1), (1024, 4)))
    assert v.buckets == ((1024, 4), (4096, 4))           # 3 and 4 both become 4: one bucket
    v = VisionNeuronConfig(tp_size=2, buckets=((2048, 5),))
    assert v.buckets == ((2048, 5),)                      # dp not known yet
    v.resolve_tp_dp(8)
    assert v.buckets == ((2048, 8),)                      # resolution writes dp back and pads


def test_select_vision_bucket_point2():
    small, large = ImageGrid(1, 16, 16), ImageGrid(1, 64, 64)      # 256 and 4096 patches
    buckets = [(1024, 1), (1024, 4), (4096, 1), (4096, 2)]
    assert select_vision_bucket([small], buckets) == (1024, 1)
    assert select_vision_bucket([small] * 5, buckets) == (1024, 4)         # 4 x 256 per block → 2 blocks
    # One large image forces every image of the call into 4096 blocks.
    assert select_vision_bucket([small, large], buckets) == (4096, 2)
    # Padding point 2: a configured count that is not a multiple of dp is padded at selection.
    assert select_vision_bucket([small], [(1024, 3)], dp_size=2) == (1024, 4)
    with pytest.raises(ValueError, match=r"no bucket .* fits 1 image\(s\) \(largest frame 4096 patches"):
        select_vision_bucket([large], [(1024, 8)])
    with pytest.raises(ValueError, match="no buckets configured"):
        select_vision_bucket([small], [])


def test_warmup_shapes_point3():
    v = VisionNeuronConfig(buckets=((128, 3), (256, 1)))
    v.resolve_tp_dp(2)                                     # full DP: tp 1, dp 2
    shapes = warmup_shapes(v, TINY)
    assert [s["pixel_values"] for s in shapes] == [(4, 128, TINY.patch_dim), (2, 256, TINY.patch_dim)]
    assert all(s["pixel_values"][0] % 2 == 0 for s in shapes)
    with pytest.raises(ValueError, match="resolve_tp_dp"):
        warmup_shapes(VisionNeuronConfig(buckets=((128, 3),)), TINY)


def test_qwen3vl_config_from_the_shape_table():
    from modules.model_specs import QWEN3_VL_VIT

    cfg = VisionEncoderConfig.from_spec(QWEN3_VL_VIT)
    assert (cfg.head_dim, cfg.patch_dim, cfg.merge_unit, cfg.num_grid_per_side) == (72, 1536, 4, 48)
    assert cfg.deepstack_visual_indexes == (8, 16, 24) and cfg.num_outputs == 4
    hf = {"depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304, "out_hidden_size": 4096,
          "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
          "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh"}
    assert VisionEncoderConfig.from_hf(hf) == cfg
    # Blocks of 1024 fit a 32 x 32 image; 2048 hold two; blocks_needed for a 4096-patch image at 4096 is one.
    assert blocks_needed([(1, 32, 32)] * 3, 2048) == 2 and blocks_needed([(1, 64, 64)], 4096) == 1
    for tp in (1, 2, 4, 8, 16):
        cfg.check_tp(tp)


# ---- bad input --------------------------------------------------------------------------------------------------
def test_bad_parallel_layout():
    with pytest.raises(ValueError, match=r"tp_size=3 must divide world_size=4"):
        VisionNeuronConfig(tp_size=3).resolve_tp_dp(4)
    with pytest.raises(ValueError, match=r"tp_size \* dp_size = 2 \* 4 = 8 != world_size=4"):
        VisionNeuronConfig(tp_size=2, dp_size=4).resolve_tp_dp(4)
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by vision tp_size=3"):
        Qwen3VLVisionEncoder(TINY, StaticGroup(3, 0), backend="torch")
    odd = VisionEncoderConfig(depth=1, hidden_size=128, num_heads=4, intermediate_size=202, out_hidden_size=64)
    with pytest.raises(ValueError, match=r"intermediate_size=202 is not divisible by vision tp_size=4"):
        Qwen3VLVisionEncoder(odd, StaticGroup(4, 0), backend="torch")
    with pytest.raises(ValueError, match=r"backend='cuda'"):
        Qwen3VLVisionEncoder(TINY, StaticGroup(), backend="cuda")


def test_bad_block_size():
    px = random_pixels(TINY, GRIDS)
    with pytest.raises(ValueError, match=r"block_size=192 must be a multiple of 128"):
        pack_images(px, GRIDS, TINY, 192)
    merge3 = VisionEncoderConfig(depth=1, hidden_size=144, num_heads=4, intermediate_size=64, out_hidden_size=8,
                                 patch_size=2, spatial_merge_size=3, num_position_embeddings=36)
    with pytest.raises(ValueError, match=r"block_size=128 must be a multiple of the merge unit 9"):
        merge3.check_block_size(128)
    with pytest.raises(ValueError, match=r"block_size=100 must be a multiple of 128"):
        VisionNeuronConfig(buckets=((100, 2),))
    with pytest.raises(ValueError, match=r"\(block_size, num_blocks\) pair"):
        VisionNeuronConfig(buckets=(128,))


def test_bad_images():
    with pytest.raises(ValueError, match=r"frame 0 has 144 patches, more than block_size=128"):
        pack_images(random_pixels(TINY, [ImageGrid(1, 12, 12)]), [(1, 12, 12)], TINY, BLOCK)
    with pytest.raises(ValueError, match=r"h=5, w=4 must be multiples of spatial_merge_size=2"):
        pack_images(torch.zeros(20, TINY.patch_dim), [(1, 5, 4)], TINY, BLOCK)
    with pytest.raises(ValueError, match=r"pixel_values shape \(10, 96\) != \(sum of t\*h\*w = 16"):
        pack_images(torch.zeros(10, TINY.patch_dim), [(1, 4, 4)], TINY, BLOCK)
    with pytest.raises(ValueError, match=r"need 3 blocks of 128 but the bucket has num_blocks=2"):
        pack_images(random_pixels(TINY, GRIDS), GRIDS, TINY, BLOCK, num_blocks=2)
    with pytest.raises(ValueError, match=r"num_blocks=3 is not a multiple of dp_size=2"):
        pack_images(random_pixels(TINY, GRIDS), GRIDS, TINY, BLOCK, num_blocks=3, dp_size=2)
    with pytest.raises(ValueError, match=r"ImageGrid.h must be a positive integer"):
        ImageGrid(1, 0, 4)


def test_encoder_rejects_unpadded_blocks_for_dp():
    # A 2-rank DP group stand-in: the check must fire before any collective is attempted.
    enc = Qwen3VLVisionEncoder(TINY, StaticGroup(), StaticGroup(2, 0), backend="torch")
    p = pack_images(random_pixels(TINY, GRIDS), GRIDS, TINY, BLOCK)
    with pytest.raises(ValueError, match=r"num_blocks=3 is not a multiple of vision dp_size=2"):
        enc(p)
