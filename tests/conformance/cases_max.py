"""core/max/cascaded_max: shapes of test/integration/nkilib/core/max/test_cascaded_max.py (test_cascaded_max_unit,
its "fast" params), its tolerance (atol = rtol = 1e-5); indices compared exactly."""

import numpy as np

from .harness import Case

SOURCE = "test/integration/nkilib/core/max/test_cascaded_max.py::test_cascaded_max_unit"


def _case(lnc, batch, seqlen, vocab, target):
    def inputs():
        rng = np.random.default_rng(batch * 100003 + seqlen * 101 + vocab)
        return {"input_tensor": rng.standard_normal((batch, seqlen, vocab)).astype(np.float32)}

    return Case("core.max.cascaded_max:cascaded_max", "core.max.cascaded_max_torch:cascaded_max_torch_ref",
                f"b{batch}_s{seqlen}_v{vocab}_fp32", inputs, atol=1e-5, rtol=1e-5, source=SOURCE,
                target=target, lnc=lnc, exact=("max_indices",))


# A spread of the library's list: model shapes (Llama 3 before/after the global gather), vocab extremes, the batch
# sizes that select each stage count, and the mixed seqlen cases; LNC=1 and 2, trn2 and trn3.
_PARAMS = [(1, 8, 5, 4058), (2, 5, 5, 4058), (2, 8, 5, 8192), (1, 1, 1, 3168), (2, 1, 1, 256), (2, 1, 1, 16000),
           (2, 7, 1, 3168), (2, 65, 1, 3168), (2, 256, 1, 3168), (2, 1, 127, 3999), (1, 1, 63, 3999)]
CASES = [_case(*p, target="trn2") for p in _PARAMS] + [_case(*p, target="trn3") for p in _PARAMS[:4]]
