"""core/cumsum: shapes of test/integration/nkilib/core/cumsum/test_cumsum.py (fast params), its tolerances."""

import ml_dtypes
import numpy as np

from .harness import Case

SOURCE = "test/integration/nkilib/core/cumsum/test_cumsum.py::test_cumsum_fast"


def _case(batch, hidden, ndim, seq_len, dtype, target):
    def inputs():
        np.random.seed(42)
        shape = (batch, seq_len, hidden) if ndim == 3 else (batch, hidden)
        return {"x": np.random.randn(*shape).astype(dtype)}

    bf16 = dtype == ml_dtypes.bfloat16
    return Case("core.cumsum:cumsum", "core.cumsum.cumsum_torch:cumsum_torch_ref",
                f"{batch}_{hidden}_{ndim}_{seq_len}_{np.dtype(dtype).name}", inputs,
                atol=1e-2 if hidden > 5000 else 1e-3, rtol=1e-2 if bf16 else 1e-3, source=SOURCE, target=target)


CASES = [_case(*p, target=t) for t in ("trn2", "trn3") for p in [
    (1, 256, 2, 1, np.float32), (64, 1024, 3, 4, ml_dtypes.bfloat16), (128, 2048, 2, 1, np.float32)]]
