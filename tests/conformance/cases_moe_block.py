"""core/moe_block (moe_block_tkg: RMSNorm + router top-k + expert MLPs): configurations of
test/integration/nkilib/core/moe_block/test_moe_block_tkg.py::test_moe_block_kernel (LNC=2; rtol 1e-2, or 5e-2 for
fp8 / MX weights; atol 1e-5). Our generator follows its recipe: uniform(-0.1, 0.1) input, gamma, router weights and
bias; standard normal expert weights and biases; clamps (7, -, 8, -6). MX weights (trn3) are passed as raw
uint16/uint32 words and reinterpreted inside our launch kernel, as the test does to mimic NxD; the reference gets
the packed arrays."""

import ml_dtypes
import numpy as np

from .cases_moe import _PADDING, _mx_down_layout, _mx_expert_weights
from .harness import Case

SOURCE = "test/integration/nkilib/core/moe_block/test_moe_block_tkg.py::test_moe_block_kernel"
_NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float8_e4m3": ml_dtypes.float8_e4m3}


def moe_block_tkg_mx_launch(**kwargs):
    """Our launch kernel: MX expert weights arrive as uint words and are reinterpreted as the packed MX dtype."""
    import nki.language as nl
    from nkilib_src.nkilib.core.moe_block.moe_block_tkg import moe_block_tkg
    from nkilib_src.nkilib.core.utils.tensor_view import TensorView
    mx_dtype = {nl.uint16: nl.float4_e2m1fn_x4, nl.uint32: nl.float8_e4m3fn_x4}[kwargs["expert_gate_up_weights"].dtype]
    for key in ("expert_gate_up_weights", "expert_down_weights"):
        kwargs[key] = TensorView(kwargs[key]).reinterpret_cast(mx_dtype)
    return moe_block_tkg(**kwargs)


def _case(all_expert, B, S, H, h_actual, inter, E_g, E_l, k, act, weight, in_dt, bias, clamp, pre_norm, norm_prob,
          target="trn2"):
    is_mx = weight.endswith("_x4")

    def inputs():
        import nki.language as nl
        from nkilib_src.nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode, RouterActFnType

        rng = np.random.default_rng(42)
        in_np = _NP[in_dt]
        uni = lambda *s: rng.uniform(-0.1, 0.1, size=s).astype(np.float32).astype(in_np)  # noqa: E731
        normal = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
        kw = {"inp": uni(B, S, H), "gamma": uni(1, H), "router_weights": uni(H, E_g)}
        if is_mx:
            mx_dtype = getattr(nl, weight)
            gu_w, gu_s, dn_w, dn_s = _mx_expert_weights(rng, E_l, H, inter, mx_dtype)
            i_p, n_i512 = _mx_down_layout(inter)
            kw.update(expert_gate_up_weights=gu_w, expert_down_weights=dn_w,   # raw words, as NxD passes them
                      expert_gate_up_weights_scale=gu_s, expert_down_weights_scale=dn_s)
            gu_b_shape = (E_l, i_p, 2, n_i512, 4)
        else:
            kw.update(expert_gate_up_weights=normal(E_l, H, 2, inter).astype(_NP[weight]),
                      expert_down_weights=normal(E_l, inter, H).astype(_NP[weight]))
            gu_b_shape = (E_l, 2, inter)
        kw["router_bias"] = uni(1, E_g) if bias else None
        kw["expert_gate_up_bias"] = normal(*gu_b_shape).astype(in_np) if bias else None
        kw["expert_down_bias"] = normal(E_l, H).astype(in_np) if bias else None
        kw.update(top_k=k, router_act_fn=RouterActFnType.SOFTMAX, router_pre_norm=pre_norm, norm_topk_prob=norm_prob,
                  expert_affinities_scaling_mode=ExpertAffinityScaleMode.POST_SCALE,
                  hidden_act_fn=getattr(ActFnType, act),
                  gate_clamp_upper_limit=7.0 if clamp else None, up_clamp_upper_limit=8.0 if clamp else None,
                  up_clamp_lower_limit=-6.0 if clamp else None, router_mm_dtype=getattr(nl, in_dt),
                  hidden_actual=h_actual, is_all_expert=all_expert,
                  rank_id=np.array([[rng.integers(0, E_g // E_l)]], np.uint32) if all_expert else None)
        return kw

    def ref_inputs(kw):
        if not is_mx:
            return kw
        import nki.language as nl

        from nkisim import mx
        mx_dtype = getattr(nl, weight)   # the reference reads the same words as packed MX arrays
        return {**kw, "expert_gate_up_weights": mx.PackedArray(kw["expert_gate_up_weights"], mx_dtype),
                "expert_down_weights": mx.PackedArray(kw["expert_down_weights"], mx_dtype)}

    low = is_mx or weight.startswith("float8")
    kind = "all" if all_expert else "sel"
    return Case(moe_block_tkg_mx_launch if is_mx else "core.moe_block.moe_block_tkg:moe_block_tkg",
                "core.moe_block.moe_block_tkg_torch:moe_block_tkg_torch_ref",
                f"{kind}_B{B}_S{S}_H{H}{'/' + str(h_actual) if h_actual else ''}_I{inter}_E{E_g}/{E_l}_k{k}_{weight}",
                inputs, atol=1e-5, rtol=5e-2 if low else 1e-2, source=SOURCE + (_PADDING if is_mx else ""),
                target=target, lnc=2, ref_inputs=ref_inputs, env={"NKISIM_UNINIT": "zero"} if is_mx else {})


# Kept small for the suite's budget: the selective configurations of the test all carry 128 local experts (up to
# 0.4 G weight elements, widened to fp32 for the reference); of those we run the smaller ones. Left out for time,
# not for failing (each passed when run: max error <= 1.5e-3 vs >= 5e-3): (B1 S1 H3072 I384 fp16), (B1 S1 H4096
# I384 k8 bf16 and fp8_e4m3), (B1 S1 H3072 I384 MXFP4).
CASES = [
    _case(False, 1, 5, 3072, None, 128, 128, 128, 4, "Swish", "float16", "float16", True, True, False, False,
          target="trn3"),
    _case(False, 4, 1, 3072, 2880, 192, 128, 128, 4, "Swish", "float16", "float16", True, True, False, False),
    # all-expert B19: its gate/up bias load calls dma_transpose(dge_mode=3 "none") on a direct transpose; AWS's page
    # lists only unknown/hwdge there, but this hardware-tested call is accepted (C21 refuses only swdge).
    _case(True, 19, 1, 3072, None, 128, 128, 1, 4, "Swish", "float16", "float16", True, True, False, False),
    _case(True, 16, 1, 4096, None, 384, 128, 8, 8, "SiLU", "float8_e4m3", "bfloat16", False, False, True, True),
    _case(False, 1, 4, 3072, 2880, 192, 128, 128, 4, "Swish", "float4_e2m1fn_x4", "float16", True, True, False,
          False, target="trn3"),
    _case(False, 1, 1, 3072, None, 384, 128, 128, 4, "Swish", "float8_e4m3fn_x4", "float16", True, True, False,
          False, target="trn3"),
]
