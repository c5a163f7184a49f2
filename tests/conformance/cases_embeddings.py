"""core/embeddings: RoPE and rope_hf on shapes of the library's tests, with their tolerances.

RoPE: test/integration/nkilib/core/embeddings/test_rope.py (fast "singles" params and a few manual shapes; its
CompilerArgs() default is trn2 with LNC=2; bf16 Gaussian inputs; atol 1e-3, rtol 2**-7).
rope_hf: test/integration/nkilib/core/embeddings/test_rope_hf.py::test_rope_hf_lnc and ::test_rope_hf_cache
(seeded randn inputs, reference in the input precision, atol = rtol = 1e-6; trn2, LNC 1 and 2).
"""

import ml_dtypes
import numpy as np

from .harness import Case

BF16 = ml_dtypes.bfloat16
ROPE_SOURCE = "test/integration/nkilib/core/embeddings/test_rope.py"
HF_SOURCE = "test/integration/nkilib/core/embeddings/test_rope_hf.py"


def _rope(d_head, b, n_heads, s, contiguous, relayout, kind):
    def inputs():
        rng = np.random.default_rng(0)
        half = d_head // 2
        return {"x_in": rng.standard_normal((d_head, b, n_heads, s)).astype(BF16),
                "cos": rng.standard_normal((half, b, s)).astype(BF16),
                "sin": rng.standard_normal((half, b, s)).astype(BF16),
                "lnc_shard": True, "contiguous_layout": contiguous, "relayout_in_sbuf": relayout}

    shape = f"dh{d_head}_b{b}_h{n_heads}_s{s}_{'contig' if contiguous else 'inter'}{'_relayout' if relayout else ''}"
    return Case("core.embeddings.rope:RoPE", "core.embeddings.rope_torch:rope_torch_ref", shape, inputs,
                atol=1e-3, rtol=2**-7, source=f"{ROPE_SOURCE}::{kind}", lnc=2)


def _rope_hf(batch, q_heads, kv_heads, seq, head_dim, dtype, backward, packed, lnc):
    def inputs():
        np.random.seed(42)
        q = np.random.randn(batch, q_heads, seq, head_dim).astype(dtype)
        k = np.random.randn(batch, kv_heads, seq, head_dim).astype(dtype)
        kw = {"q": q, "k": k, "q_out": np.zeros_like(q), "k_out": np.zeros_like(k), "backward": backward}
        if packed:
            kw["rope_cache"] = np.random.randn(seq, head_dim * 2).astype(dtype)
        else:
            kw["cos"] = np.random.randn(batch, seq, head_dim).astype(dtype)
            kw["sin"] = np.random.randn(batch, seq, head_dim).astype(dtype)
        return kw

    shape = (f"bs{batch}_qh{q_heads}_kvh{kv_heads}_sl{seq}_hd{head_dim}_{np.dtype(dtype).name}"
             f"{'_bwd' if backward else ''}{'_cache' if packed else ''}")
    test = "test_rope_hf_cache" if packed else "test_rope_hf_lnc"
    return Case("core.embeddings.rope_hf:rope_hf", "core.embeddings.rope_hf_torch:rope_hf_torch_ref", shape,
                inputs, atol=1e-6, rtol=1e-6, source=f"{HF_SOURCE}::{test}", lnc=lnc, ref_lower_precision=True)


CASES = [
    _rope(64, 1, 1, 16, True, False, "test_rope_fast"),
    _rope(128, 8, 8, 128, False, True, "test_rope_fast"),
    _rope(64, 64, 1, 128, True, True, "test_rope_fast"),
    _rope(128, 64, 8, 128, True, False, "test_rope_manual"),
    _rope(128, 32, 4, 64, False, False, "test_rope_manual"),
    _rope(64, 255, 8, 6, False, False, "test_rope_manual"),
    _rope_hf(1, 32, 8, 256, 128, BF16, False, False, 1),
    _rope_hf(1, 32, 8, 256, 128, BF16, False, False, 2),
    _rope_hf(1, 32, 8, 256, 128, np.float32, False, False, 2),
    _rope_hf(2, 16, 4, 512, 128, BF16, False, False, 2),
    _rope_hf(1, 32, 8, 512, 64, np.float32, False, False, 1),
    _rope_hf(1, 32, 8, 256, 128, np.float32, True, False, 2),
    _rope_hf(4, 1, 1, 512, 128, BF16, False, True, 2),
]
