"""Bucket waste of block-level vision DP vs model-level DP (replicas per bucket), MODELLED (analytical model).

The vision seed's example: one small (256-patch) and one large (4096-patch) image. Block-level DP packs both into
one call, so both pay for the 4096-patch bucket; two independent replicas each pick their own image's bucket
(1024 for the small one). Per layout: the buckets used, patches processed vs real ones, each image's modelled
latency and the rank-seconds the workload occupies. See bench/model/vision_buckets.py for the model and its limits.
pytest-benchmark times only the formula; the figures go to ``extra_info`` and the console's "vision bucket waste"
table.
"""

import pytest

from bench.model.vision_buckets import LAYOUTS, bucket_waste_row

INSTANCES = ("trn2.48xlarge", "trn3-server")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"w{lay.world}-{lay.label().replace(' ', '')}")
@pytest.mark.parametrize("instance", INSTANCES)
def test_vision_bucket_waste(benchmark, instance, layout):
    benchmark.group = "vision-buckets"
    row = benchmark.pedantic(bucket_waste_row, args=(layout, instance), rounds=1, iterations=1)
    benchmark.extra_info.update(row)
    assert 0 < row["real_fraction"] <= 1
    # Block-level DP: both images finish together; replicas: the small image never waits for the large bucket.
    if layout.replicas == 1:
        assert row["modelled_small_image_latency_s"] == row["modelled_large_image_latency_s"]
    else:
        assert row["modelled_small_image_latency_s"] < row["modelled_large_image_latency_s"]
