"""experimental/benchmark find_nonzero_indices_with_count: shapes of
test/integration/nkilib/experimental/benchmark/test_find_nonzero_indices_with_count.py (T 32..2048, 0, 1/32, 5/32
or all nonzero), exact. The library's golden is test-only; ours: [indices of nonzeros..., -1 padding..., count]."""

import numpy as np

from bench.peers import nkilib

from .harness import Case

SOURCE = "test/integration/nkilib/experimental/benchmark/test_find_nonzero_indices_with_count.py"


def _reference(input_tensor):
    x = input_tensor.numpy()
    pad = nkilib.load("experimental.benchmark.find_nonzero_indices_with_count:PADDING_VALUE")
    idx = np.nonzero(x[0])[0]
    out = np.full((1, x.shape[-1] + 1), pad, dtype=np.int32)
    out[0, :idx.size] = idx
    out[0, -1] = idx.size
    return {"output": out}


def _case(T, frac, target="trn2"):
    def inputs():
        rng = np.random.default_rng(T + int(frac * 1000))
        x = np.zeros((1, T), np.float32)
        where = rng.choice(T, size=int(T * frac), replace=False)
        x[0, where] = rng.uniform(0.01, 1.0, size=where.size)
        return {"input_tensor": x}

    return Case("experimental.benchmark.find_nonzero_indices_with_count:find_nonzero_indices_with_count", _reference,
                f"T{T}_nz{frac:.3f}", inputs, atol=0.0, rtol=0.0, source=f"{SOURCE}::test_find_nonzero_indices_unit",
                target=target, exact=("output",))


CASES = ([_case(T, f) for T, f in [(32, 0.0), (2048, 0.0), (64, 1 / 32), (1024, 1 / 32), (128, 5 / 32),
                                   (2048, 5 / 32), (256, 1.0), (2048, 1.0)]]
         + [_case(512, 5 / 32, target="trn3"), _case(32, 1.0, target="trn3")])
