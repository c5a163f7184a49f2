"""core/subkernels rmsnorm_tkg / layernorm_tkg as standalone kernels, on shapes of the library's tests.

Sources: test/integration/nkilib/core/subkernels/test_rmsnorm_tkg.py::test_rmsnorm_tkg_unit and
test_layernorm_tkg.py::test_layernorm_tkg_unit (fast lists): seeded randn fp16 input/gamma(/beta), the output
[128, B*S, H/128] written in place; reference = the LNC=2 layout variant at LNC=2 (rmsnorm: unless hidden_dim_tp;
layernorm: or shard_on_h), else the LNC=1 one; atol 1e-5, rtol 2e-2; trn2 (the tests' default platform).
"""

import numpy as np

from .harness import Case

SUB = "test/integration/nkilib/core/subkernels"


def _rmsnorm(lnc, b, s, h, h_actual, tp, shard_on_h):
    def inputs():
        np.random.seed(42)
        return {"input": np.random.randn(b, s, h).astype(np.float16),
                "gamma": np.random.randn(1, h).astype(np.float16),
                "output": np.zeros((128, b * s, h // 128), np.float16),
                "hidden_actual": h_actual, "hidden_dim_tp": tp, "shard_on_h": shard_on_h}

    ref = "rmsnorm_tkg_torch_ref" if lnc == 2 and not tp else "rmsnorm_tkg_torch_ref_lnc1"
    shape = f"b{b}_s{s}_h{h}" + (f"_ha{h_actual}" if h_actual else "") + ("_tp" if tp else "") + \
        ("_shardh" if shard_on_h else "")
    return Case("core.subkernels.rmsnorm_tkg:rmsnorm_tkg", f"core.subkernels.rmsnorm_torch:{ref}", shape, inputs,
                atol=1e-5, rtol=2e-2, source=f"{SUB}/test_rmsnorm_tkg.py::test_rmsnorm_tkg_unit", lnc=lnc,
                out_args=("output",))


def _layernorm(lnc, b, s, h, shard_on_h):
    def inputs():
        np.random.seed(42)
        return {"input": np.random.randn(b, s, h).astype(np.float16),
                "gamma": np.random.randn(1, h).astype(np.float16),
                "output": np.zeros((128, b * s, h // 128), np.float16),
                "beta": np.random.randn(1, h).astype(np.float16), "shard_on_h": shard_on_h}

    ref = "layernorm_tkg_torch_ref" if lnc == 2 or shard_on_h else "layernorm_tkg_torch_ref_lnc1"
    return Case("core.subkernels.layernorm_tkg:layernorm_tkg", f"core.subkernels.layernorm_torch:{ref}",
                f"b{b}_s{s}_h{h}" + ("_shardh" if shard_on_h else ""), inputs, atol=1e-5, rtol=2e-2,
                source=f"{SUB}/test_layernorm_tkg.py::test_layernorm_tkg_unit", lnc=lnc, out_args=("output",))


CASES = [
    _rmsnorm(1, 1, 1, 8192, None, False, False),
    _rmsnorm(1, 1, 8, 8192, None, False, False),
    _rmsnorm(1, 1, 4, 2048, 1920, False, False),
    _rmsnorm(1, 1, 1, 4096, 3072, True, False),
    _rmsnorm(2, 1, 1, 8192, None, False, False),
    _rmsnorm(2, 2, 8, 8192, None, False, False),
    _rmsnorm(2, 128, 5, 3072, None, False, False),
    _rmsnorm(2, 2, 8, 3072, 2880, True, False),
    _rmsnorm(2, 2, 8, 8192, None, False, True),
    _layernorm(1, 1, 1, 8192, False),
    _layernorm(1, 1, 8, 8192, False),
    _layernorm(2, 2, 8, 8192, False),
    _layernorm(2, 128, 5, 3072, False),
    _layernorm(2, 2, 8, 8192, True),
    _layernorm(2, 4, 1, 3072, True),
]
