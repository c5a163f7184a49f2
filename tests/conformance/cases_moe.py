"""core/moe (moe_tkg selective / all-expert): shapes of test/integration/nkilib/core/moe/moe_tkg/test_moe_tkg.py,
its tolerances (rtol 2e-2, atol 1e-5). Inputs are our own seeded generators following the test's recipe: expert
indices drawn without replacement (all-expert) or uniformly (selective), affinities normalised random weights placed
at those indices, weights/biases/hidden standard normal."""

import ml_dtypes
import numpy as np

from .harness import Case

SRC_TKG = "test/integration/nkilib/core/moe/moe_tkg/test_moe_tkg.py::test_moe_tkg"


def _moe_tkg_inputs(T, H, inter, E, K, act, all_expert, dtype, clamp, bias):
    def build():
        from nkilib_src.nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode
        rng = np.random.default_rng(1234)
        k = K if K is not None else E
        if all_expert:
            idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
        else:
            idx = rng.integers(0, E, size=(T, k)).astype(np.int32)
        weights = rng.random((T, k))
        weights /= weights.sum(axis=1, keepdims=True)
        aff_dtype = ml_dtypes.bfloat16 if all_expert else np.float32
        aff = np.zeros((T, E), np.float32)
        for t in range(T):
            aff[t, idx[t]] = weights[t]
        normal = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
        return {
            "hidden_input": normal(T, H),
            "expert_gate_up_weights": normal(E, H, 2, inter),
            "expert_down_weights": normal(E, inter, H),
            "expert_affinities": aff.astype(aff_dtype),
            "expert_index": idx,
            "is_all_expert": all_expert,
            "rank_id": np.zeros((1, 1), np.uint32) if all_expert else None,
            "expert_gate_up_bias": normal(E, 2, inter) if bias else None,
            "expert_down_bias": normal(E, H) if bias else None,
            "expert_affinities_scaling_mode": ExpertAffinityScaleMode.POST_SCALE,
            "activation_fn": getattr(ActFnType, act),
            "output_dtype": _nl_dtype(dtype),
            "gate_clamp_upper_limit": 7.0 if clamp else None,
            "up_clamp_upper_limit": 8.0 if clamp else None,
            "up_clamp_lower_limit": -6.0 if clamp else None,
        }
    return build


def _nl_dtype(dtype):
    import nki.language as nl
    return nl.float16 if np.dtype(dtype) == np.float16 else nl.bfloat16


def _tkg(T, H, inter, E, K, act, all_expert, target="trn2", dtype=np.float16, clamp=True, bias=False):
    kind = "all" if all_expert else "sel"
    return Case("core.moe:moe_tkg", "core.moe.moe_tkg.moe_tkg_torch:moe_tkg_torch_ref",
                f"{kind}_T{T}_H{H}_I{inter}_E{E}_K{K}_{act}{'_bias' if bias else ''}",
                _moe_tkg_inputs(T, H, inter, E, K, act, all_expert, dtype, clamp, bias),
                atol=1e-5, rtol=2e-2, source=SRC_TKG, target=target, lnc=2)


CASES = [
    _tkg(4, 3072, 64, 4, None, "Swish", True, bias=True),
    _tkg(2, 4096, 192, 8, None, "SiLU", True),
    _tkg(128, 256, 128, 2, None, "SiLU", True, target="trn3"),
    _tkg(2, 512, 128, 2, 1, "SiLU", False),
    _tkg(5, 512, 128, 4, 2, "Swish", False, bias=True),
    _tkg(4, 3072, 192, 128, 4, "Swish", False, bias=True, target="trn3"),
]
