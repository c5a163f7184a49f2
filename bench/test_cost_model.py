"""Cost-model benchmark: wall time of `nkisim.profile` on small kernels (measured, CPU) plus the kernel's
MODELLED Trainium figures in `benchmark.extra_info` (every key prefixed `modelled_`; nothing here ran on Trainium).

    pytest bench/test_cost_model.py --benchmark-json=cost.json
"""

import ml_dtypes
import numpy as np
import pytest

import nkisim

nkisim.install()

from nki_kernels.micro import matmul_pipelined, stream_copy, vector_heavy  # noqa: E402
from nki_kernels.micro import tiled_matmul as matmul_nki11  # noqa: E402


def _mm_args():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((256, 128)).astype(ml_dtypes.bfloat16),
            rng.standard_normal((256, 1024)).astype(ml_dtypes.bfloat16))


CASES = {
    "matmul_nki11_256x128x1024_bf16": (matmul_nki11, _mm_args),
    "matmul_pipelined_256x128x1024_bf16": (matmul_pipelined, _mm_args),
    "stream_copy_512x1024_fp32": (stream_copy, lambda: (np.ones((512, 1024), np.float32),)),
    "vector_heavy_128x1024_fp32_x8": (vector_heavy, lambda: (np.ones((128, 1024), np.float32), 8)),
}


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_profile_cost_model(benchmark, case, target):
    kernel, make_args = CASES[case]
    args = make_args()
    benchmark.group = f"cost-model:{case}"
    prof = benchmark(nkisim.profile, kernel, *args, target=target)
    rep = prof.report
    benchmark.extra_info.update(rep.extra_info())
    benchmark.extra_info["modelled_note"] = "modelled by nkisim.cost (uncalibrated datasheet constants)"
    benchmark.extra_info["measured_note"] = "timing stats = CPU wall time of nkisim.profile (interpreter + model)"
    assert rep.latency_s > 0 and rep.latency_s >= rep.roofline_s
