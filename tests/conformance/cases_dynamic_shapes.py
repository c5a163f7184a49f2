"""experimental/dynamic_shapes dynamic_elementwise_add: shapes of
test/integration/nkilib/experimental/dynamic_shapes/test_dynamic_elementwise_add.py (M in 128/256/1024, H in
512/1024/2048, bf16; the tile count is a runtime value in HBM; default CompilerArgs = LNC=2), atol 1e-3 / rtol 1e-2;
golden = the library's torch reference in fp32, rounded to bf16 as the test does.

The kernel loops with `nl.dynamic_range` (deprecated in NKI 0.6, removed from the 0.7 tracer), so it runs under
the legacy parser frontend, NKI_COMPILER_FRONTEND=custom, as AWS's migration note prescribes for unmigrated
kernels."""

import ml_dtypes
import numpy as np

from bench.peers import nkilib

from .harness import Case

SOURCE = "test/integration/nkilib/experimental/dynamic_shapes/test_dynamic_elementwise_add.py"


def _reference(input_a, input_b, num_m_tiles):
    ref = nkilib.load("experimental.dynamic_shapes.dynamic_elementwise_add_torch:dynamic_elementwise_add_torch_ref")
    return {"result": ref(input_a.float(), input_b.float()).numpy().astype(ml_dtypes.bfloat16)}


def _case(m, h, target="trn2"):
    def inputs():
        rng = np.random.default_rng(m + h)
        a, b = (rng.standard_normal((m, h)).astype(np.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
        return {"input_a": a, "input_b": b, "num_m_tiles": np.array([[m // 128]], np.int32)}

    return Case("experimental.dynamic_shapes:dynamic_elementwise_add", _reference, f"m{m}_h{h}_bf16", inputs,
                atol=1e-3, rtol=1e-2, source=f"{SOURCE}::test_dynamic_elementwise_add_fast", target=target, lnc=2,
                env={"NKI_COMPILER_FRONTEND": "custom"})


CASES = [_case(128, 512), _case(256, 1024), _case(1024, 2048), _case(128, 2048), _case(1024, 512),
         _case(256, 1024, target="trn3")]
