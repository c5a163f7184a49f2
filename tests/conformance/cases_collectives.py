"""experimental/collectives: the library's multi-rank kernels under nkisim's collective launch (nkisim.run_ranks).

Shapes, seeds, per-rank inputs and goldens as the library's tests build them
(test/integration/nkilib/experimental/collectives/test_{sb2sb_allgather,fg_allgather,fgcc}.py, enabled params only:
the library comments out the others for hardware timeouts). Goldens are NumPy (the tests' create_golden), compared
with the tests' tolerances in the harness's max mode. topk_reduce (a single-rank subkernel) is covered elsewhere.
"""

import functools

import ml_dtypes
import numpy as np

from .harness import Case

_T = "test/integration/nkilib/experimental/collectives/"
BF16 = ml_dtypes.bfloat16


@functools.lru_cache(maxsize=8)
def _global(shape, dtype, seed=42):
    np.random.seed(seed)
    return np.random.randn(*shape).astype(dtype)


def _reshaped(outs, gold):
    """The kernels return rank-major blocked layouts ([RANK_N, LNC_N, CHANNEL_N, m, K] ...); the library's validator
    reads the output buffer in the golden's shape."""
    seq = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    return {k: np.asarray(o).reshape(g.shape) for (k, g), o in zip(gold.items(), seq)}


def _sb2sb(m, k, dtype, tp, lnc=1, tiled=False):
    name = "allgather_sb2sb_tiled" if tiled else "allgather_sb2sb"
    out = "result" if tiled else "out"

    def x():
        return _global((tp, m, k), dtype)

    def inputs(r):
        from nki.collectives import ReplicaGroup  # imported when run: the harness installs nkisim as `nki` first
        return {"inp": x()[r], "replica_groups": ReplicaGroup([list(range(tp))]), "tp_degree": tp}

    return Case(f"experimental.collectives.sb2sb_allgather:{name}", lambda r: {out: np.concatenate(list(x()), axis=1)},
                f"m{m}_k{k}_{np.dtype(dtype).name}_tp{tp}", inputs, atol=1e-3, rtol=1e-3,
                source=_T + f"test_sb2sb_allgather.py::test_{name}", lnc=lnc, ranks=tp)


def _fg_allgather(m, K, dtype, tp, lnc, force_hbm_cc):
    def inputs(r):
        return {"lhs": _global((m * tp, K), dtype)[r * m:(r + 1) * m], "tp_degree": tp, "num_groups": 1,
                "force_hbm_cc": force_hbm_cc}

    return Case("experimental.collectives.fg_allgather:fine_grained_allgather",
                lambda r: {"result": _global((m * tp, K), dtype)}, f"m{m}_K{K}_{np.dtype(dtype).name}_tp{tp}", inputs,
                atol=1e-3, rtol=1e-3, source=_T + "test_fg_allgather.py::test_fine_grained_allgather", lnc=lnc,
                ranks=tp, outputs=_reshaped)


def _fgcc(m, K, N, dtype, tp, lnc, force_hbm_cc):
    @functools.lru_cache(maxsize=1)
    def data():
        np.random.seed(42)
        lhs = np.random.randn(m * tp, K).astype(dtype)
        rhs = np.random.randn(K, N).astype(dtype)
        return lhs, rhs, (lhs.astype(np.float32) @ rhs.astype(np.float32)).astype(dtype)

    n = N // tp

    def inputs(r):
        lhs, rhs, _ = data()
        return {"lhs": lhs[r * m:(r + 1) * m], "rhs": np.ascontiguousarray(rhs[:, r * n:(r + 1) * n]),
                "tp_degree": tp, "num_groups": 1, "force_hbm_cc": force_hbm_cc}

    return Case("experimental.collectives.fgcc:allgather_compute_matmul",
                lambda r: {"result": data()[2][:, r * n:(r + 1) * n]}, f"m{m}_K{K}_N{N}_{np.dtype(dtype).name}_tp{tp}",
                inputs, atol=1e-2, rtol=1e-2, source=_T + "test_fgcc.py::test_allgather_compute_matmul", lnc=lnc,
                ranks=tp, outputs=_reshaped, timeout_s=1800)   # 4 ranks x 34 GFLOP of bf16 matmul on the CPU


CASES = (
    [_sb2sb(*p) for p in [(128, 512, BF16, 8), (64, 1024, BF16, 8), (128, 2048, BF16, 8), (96, 512, BF16, 16),
                          (128, 512, np.float32, 8), (64, 1024, np.float16, 8), (128, 256, BF16, 64),
                          (128, 256, BF16, 32), (128, 384, BF16, 16)]]
    + [_sb2sb(*p, tiled=True) for p in [(128, 512, BF16, 4, 2), (64, 1024, BF16, 4, 2), (256, 512, BF16, 8, 1),
                                        (256, 512, BF16, 4, 2), (512, 1024, BF16, 8, 1), (512, 1024, BF16, 8, 2),
                                        (256, 512, np.float32, 8, 1), (512, 1024, np.float16, 4, 2),
                                        (256, 512, BF16, 8, 2)]]
    + [_fg_allgather(1024, 4096, BF16, 4, 2, False)]
    + [_fgcc(1024, 4096, 4096, BF16, 4, 2, False)]
)
