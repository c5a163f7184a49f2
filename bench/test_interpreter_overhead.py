"""Interpreter overhead of nkisim (CPU wall time of the interpreter itself — measured, not modelled).

Targets (issue #2): median dispatch <= 30 us per instruction on small tiles, and the 1024^3 bf16 tiled matmul
kernel within 5x of numpy.matmul of the same shapes (fp32 NumPy, the fastest NumPy path for these shapes).
"""

import ml_dtypes
import numpy as np
import pytest

import nkisim

nkisim.install()

import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

from tests.nkisim.examples.kernels import tiled_matmul  # noqa: E402

INSTRUCTIONS_PER_ROUND = 200
SMALL_TILE = (128, 8)


def _small_tiles():
    a = nl.ndarray(SMALL_TILE, nl.float32, nl.sbuf)
    b = nl.ndarray(SMALL_TILE, nl.float32, nl.sbuf)
    nisa.memset(a, 1.0)
    nisa.memset(b, 0.5)
    return a, b


_OPS = {
    "tensor_tensor": lambda a, b: nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.add),
    "tensor_scalar": lambda a, b: nisa.tensor_scalar(dst=a, data=b, op0=nl.multiply, operand0=0.5, op1=nl.add,
                                                     operand1=1.0),
    "activation": lambda a, b: nisa.activation(dst=a, op=nl.exp, data=b, scale=0.5),
    "tensor_copy": lambda a, b: nisa.tensor_copy(dst=a, src=b),
}


@pytest.mark.benchmark(group="nkisim-dispatch")
@pytest.mark.parametrize("op", sorted(_OPS))
def test_dispatch_per_instruction(benchmark, op):
    a, b = _small_tiles()
    fn = _OPS[op]

    def round_():
        for _ in range(INSTRUCTIONS_PER_ROUND):
            fn(a, b)
        nkisim.runtime.current().trace.clear()  # keep the default core's record from growing across rounds

    benchmark.pedantic(round_, rounds=15, iterations=1, warmup_rounds=2)
    per_instr_us = benchmark.stats.stats.median / INSTRUCTIONS_PER_ROUND * 1e6
    benchmark.extra_info.update({"measured": "CPU wall time", "instructions_per_round": INSTRUCTIONS_PER_ROUND,
                                 "median_us_per_instruction": round(per_instr_us, 2), "target_us": 30})


@pytest.fixture(scope="module")
def matmul_inputs():
    rng = np.random.default_rng(42)
    lhsT = rng.standard_normal((1024, 1024)).astype(ml_dtypes.bfloat16)
    rhs = rng.standard_normal((1024, 1024)).astype(ml_dtypes.bfloat16)
    return lhsT, rhs


_MATMUL_MEDIANS = {}


@pytest.mark.benchmark(group="nkisim-matmul-1024")
def test_numpy_matmul_1024(benchmark, matmul_inputs):
    lhsT, rhs = (x.astype(np.float32) for x in matmul_inputs)
    benchmark.pedantic(lambda: np.matmul(lhsT.T, rhs), rounds=10, iterations=1, warmup_rounds=2)
    _MATMUL_MEDIANS["numpy"] = benchmark.stats.stats.median
    benchmark.extra_info.update({"measured": "CPU wall time", "what": "numpy.matmul fp32 1024^3"})


@pytest.mark.benchmark(group="nkisim-matmul-1024")
def test_nkisim_tiled_matmul_1024(benchmark, matmul_inputs):
    run = nki.simulate(tiled_matmul)
    out = benchmark.pedantic(lambda: run(*matmul_inputs), rounds=5, iterations=1, warmup_rounds=1)
    ref = matmul_inputs[0].astype(np.float32).T @ matmul_inputs[1].astype(np.float32)
    assert np.abs(out.astype(np.float32) - ref).max() <= 1e-2 * np.abs(ref).max()
    info = {"measured": "CPU wall time", "what": "nkisim tiled bf16 matmul kernel 1024^3", "target_ratio": 5.0}
    if "numpy" in _MATMUL_MEDIANS:
        info["ratio_vs_numpy"] = round(benchmark.stats.stats.median / _MATMUL_MEDIANS["numpy"], 2)
    benchmark.extra_info.update(info)
