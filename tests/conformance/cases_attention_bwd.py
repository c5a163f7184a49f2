"""core/attention attention_bwd: shapes of test/integration/nkilib/core/attention/test_attention_bwd.py
(test_attention_bwd_fast: seq 2048, head_dim 128, 1 or 3 heads, batch 1 or 2, bf16/fp32, causal or not, 0 or 2
sinks; LNC=2 when batch*kv_heads is even), atol 1e-5 / rtol 2e-2. Forward o / lse come from the library's own
compute_o_lse (mixed precision), as the test builds them."""

import ml_dtypes
import numpy as np

from bench.peers import nkilib

from .harness import Case

SOURCE = "test/integration/nkilib/core/attention/test_attention_bwd.py::test_attention_bwd_fast"


def _case(batch, heads, dtype, causal, sinks, seq=2048, d=128, target="trn2"):
    def inputs():
        import torch
        rng = np.random.default_rng(batch * 10 + heads + sinks + causal)
        gen = lambda *shape: rng.standard_normal(shape).astype(np.float32).astype(dtype)  # noqa: E731
        q, k, v, dy = (gen(batch, heads, d, seq) for _ in range(4))
        sink = np.repeat(gen(1, heads, sinks), batch, axis=0) if sinks else None
        t = lambda a: torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731
        o, lse, _ = nkilib.load("core.attention.attention_bwd_torch:compute_o_lse")(
            t(q), t(k), t(v), causal, True, softmax_scale=1.0 if causal else None,
            sinks=None if sink is None else t(sink))
        return {"q_ref": q, "k_ref": k, "v_ref": v, "o_ref": o.float().numpy().astype(dtype), "dy_ref": dy,
                "lse_ref": lse.float().numpy(), "sinks_ref": sink, "use_causal_mask": causal,
                "mixed_precision": True, "softmax_scale": 1.0 if causal else None, "sliding_window": -1}

    name = "bf16" if dtype == ml_dtypes.bfloat16 else "fp32"
    return Case("core.attention.attention_bwd:attention_bwd",
                "core.attention.attention_bwd_torch:attention_bwd_torch_ref",
                f"b{batch}_h{heads}_s{seq}_d{d}_{name}{'_causal' if causal else ''}_sinks{sinks}", inputs,
                atol=1e-5, rtol=2e-2, source=SOURCE, target=target, lnc=2 if batch * heads % 2 == 0 else 1)


BF16 = ml_dtypes.bfloat16
CASES = [_case(1, 1, BF16, True, 0), _case(2, 1, BF16, False, 2), _case(1, 3, np.float32, True, 2),
         _case(2, 3, BF16, True, 0), _case(1, 3, BF16, False, 0), _case(1, 1, BF16, True, 0, target="trn3"),
         _case(2, 1, np.float32, False, 2, target="trn3")]
