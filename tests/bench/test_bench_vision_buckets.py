"""The vision bucket-waste model (bench/model/vision_buckets.py) and its console / HTML table."""

import pytest

from bench.model.vision_buckets import LARGE, SMALL, Layout, attended_pairs, bucket_waste_row
from bench.report import render_html
from bench.report.console import console_tables
from bench.report.data import split
from modules.vision import ImageGrid

REAL = SMALL.tokens + LARGE.tokens


def test_block_level_dp_pays_the_large_bucket_and_the_dp_padding():
    r = bucket_waste_row(Layout("block-level DP", 1, 4), "trn2.48xlarge")
    # Both images need 4096-patch blocks (the large one fills one); 2 real blocks padded to dp 4.
    assert r["buckets"] == "4x4096" and r["patches_processed"] == 4 * 4096
    assert r["real_fraction"] == pytest.approx(REAL / (4 * 4096))
    assert r["modelled_small_image_latency_s"] == r["modelled_large_image_latency_s"] > 0
    assert r["modelled_rank_seconds"] == pytest.approx(4 * r["modelled_large_image_latency_s"])


def test_replicas_pick_their_own_bucket():
    r = bucket_waste_row(Layout("model-level DP", 1, 1, replicas=2), "trn2.48xlarge")
    assert r["buckets"] == "1x1024 + 1x4096" and r["patches_processed"] == 1024 + 4096
    block = bucket_waste_row(Layout("block-level DP", 1, 2), "trn2.48xlarge")
    # Same two ranks: the small image is done sooner and the workload occupies fewer rank-seconds.
    assert r["modelled_small_image_latency_s"] < block["modelled_small_image_latency_s"] / 2
    assert r["modelled_rank_seconds"] < block["modelled_rank_seconds"]
    with pytest.raises(ValueError, match="3 replicas"):
        bucket_waste_row(Layout("model-level DP", 1, 1, replicas=3), "trn2.48xlarge")


def test_rows_reach_the_console_and_the_html_report():
    rows = [bucket_waste_row(lay, "trn2.48xlarge") for lay in (Layout("model-level DP", 1, 1, 2),
                                                              Layout("block-level DP", 1, 2))]
    data = {"benchmarks": [{"name": f"test_vision_bucket_waste[{i}]", "group": "vision-buckets", "params": {},
                            "stats": {"median": 1e-4}, "extra_info": r} for i, r in enumerate(rows)]}
    assert len(split(data)["vision_buckets"]) == 2 and not split(data)["other"]
    (table,) = [t for t in console_tables(data) if t["title"].startswith("vision bucket waste")]
    assert "MODELLED" in table["title"]
    assert [r[2] for r in table["rows"]] == ["block-level DP", "model-level DP"]     # block-level first per world
    assert table["rows"][1][5] == f"{REAL:,}/5,120 (85%)"
    html = render_html(data)
    assert '<section id="vision-buckets">' in html and "2 replicas x (tp1 dp1)" in html


def test_attended_pairs_follow_the_images_not_the_blocks():
    # One 4096-patch image fills a 4096 block: every tile. The 256-patch image alone in a 4096 block: 2 x 2 tiles.
    assert attended_pairs([LARGE], 4096, 1, 1) == 4096 * 4096
    assert attended_pairs([SMALL], 4096, 1, 1) == 256 * 256
    # Both at dp 2: the busiest rank is the large image's; at dp 1 one rank does both blocks.
    assert attended_pairs([SMALL, LARGE], 4096, 2, 2) == 4096 * 4096
    assert attended_pairs([SMALL, LARGE], 4096, 2, 1) == 4096 * 4096 + 256 * 256
    # Frames not aligned to tiles: 64-patch frames at offsets 0, 64: query tile 0 spans keys [0, 128) → 1 tile.
    two = [ImageGrid(1, 8, 8), ImageGrid(1, 8, 8)]
    assert attended_pairs(two, 1024, 1, 1) == 128 * 128
    # 96 + 96 patches: tile 0 holds rows of both frames (keys 0..192 → 2 tiles), tile 1 rows of the second.
    assert attended_pairs([ImageGrid(1, 8, 12)] * 2, 1024, 1, 1) == 2 * 128 * 128 + 2 * 128 * 128
