"""Device timing of the decode-attention kernel on a trn instance (MEASURED; runs only with AWS's real `nki`).

Where nkisim serves `import nki` (any CPU machine) these benchmarks are skipped with that reason, and the modelled
figures come from bench/test_decode_attention.py instead. On a trn instance the same kernel file is called in NKI's
standalone mode (NumPy in/out): warm-up rounds, then synchronised rounds through `benchmark.pedantic`; the median
goes to `extra_info["device_latency_s"]` beside the analytic FLOPs and HBM bytes, so the report places it on the
roofline as a measured point.
"""


import numpy as np
import pytest
import torch

import nkisim

nkisim.install()

from modules.model_specs import GPT_OSS_20B, LLAMA_31_8B  # noqa: E402
from nki_kernels.attention.decode_attention import decode_attention_nki  # noqa: E402
from nki_kernels.attention.decode_inputs import make_inputs, rank_shard  # noqa: E402

pytestmark = pytest.mark.skipif(nkisim.active(), reason="no Trainium here: `nki` is served by nkisim, so device "
                                "timing is impossible (modelled figures: test_decode_attention.py)")

GPT_OSS_20B_TP8, LLAMA31_8B_TP8 = rank_shard(GPT_OSS_20B, 8), rank_shard(LLAMA_31_8B, 8)
SHAPES = {"gpt-oss-20b-tp8": GPT_OSS_20B_TP8, "llama-3.1-8b-tp8": LLAMA31_8B_TP8}
WARMUP_ROUNDS = 5
ROUNDS = 20


def _numpy(x):
    if not isinstance(x, torch.Tensor):
        return x
    if x.dtype == torch.bfloat16:
        import ml_dtypes
        return x.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def analytic_work(shape, B, ctx, S=1):
    """(FLOPs, HBM bytes) of one launch: projections, attention over ctx positions, weights + KV read once."""
    H, d, nkv, nq = shape["H"], shape["d"], shape["nkv"], shape["nq"]
    T = B * S
    C = (nq + 2 * nkv) * d
    flops = 2 * T * H * C + 2 * T * nq * d * H + 4 * T * nq * ctx * d
    bf16 = 2
    nbytes = bf16 * (H * C + nq * d * H + 2 * B * nkv * ctx * d + 2 * T * H + 2 * T * nkv * d)
    return flops, nbytes


@pytest.mark.parametrize("ctx", (1024, 4096, 16384))
@pytest.mark.parametrize("B", (1, 8, 64))
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_decode_attention_device(benchmark, model, B, ctx):
    shape = SHAPES[model]
    args, kw = make_inputs(B, 1, s_max=ctx, ctx=ctx, **shape)
    args = tuple(_numpy(a) for a in args)
    kw = {k: _numpy(v) for k, v in kw.items()}
    benchmark.pedantic(lambda: decode_attention_nki(*args, **kw), rounds=ROUNDS, iterations=1,
                       warmup_rounds=WARMUP_ROUNDS)
    flops, nbytes = analytic_work(shape, B, ctx)
    benchmark.extra_info.update({"measured": "device", "kernel": f"decode_attention · {model}",
                                 "bucket": f"B={B}, ctx={ctx}", "device_latency_s": benchmark.stats.stats.median,
                                 "flops": flops, "hbm_bytes": nbytes, "target": "trn2",
                                 "note": "includes host<->device transfer (NKI standalone mode)"})
    assert np.isfinite(benchmark.stats.stats.median)
