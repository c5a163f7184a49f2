"""core/moe/moe_cte (blockwise expert matmuls for context encoding): configurations of
test/integration/nkilib/core/moe/moe_cte/test_moe_cte.py::test_moe_blockwise_mm_kernel_lnc2 (LNC=2, bf16,
rtol 2e-2 / atol 1e-5) on its smaller shapes, against the library's moe_cte_torch_ref.

Our generator follows the test's recipe: each token routed to top_k distinct experts at random; experts' tokens
packed into blocks of `block_size` (ceil(count / B) blocks per expert, padding blocks on the last expert, the number
of blocks from the test's formula); unused slots point at the extra all-zero token T (or -1 with skip_token);
hidden states and affinities uniform [0, 1) masked by the routing, weights uniform(-0.1, 0.1), biases uniform."""

import math

import ml_dtypes
import numpy as np

from .harness import Case

SOURCE = "test/integration/nkilib/core/moe/moe_cte/test_moe_cte.py::test_moe_blockwise_mm_kernel_lnc2"
BF16 = ml_dtypes.bfloat16
_KERNELS = {"SHARD_ON_BLOCK": "core.moe.moe_cte.bwmm_shard_on_block:bwmm_shard_on_block",
            "SHARD_ON_INTERMEDIATE": "core.moe.moe_cte.bwmm_shard_on_I:blockwise_mm_baseline_shard_intermediate"}


def routing(rng, T, K, E, B, n_blocks, skip_token):
    """(token x expert mask, slot -> token id, block -> expert) for blocks of B slots grouped by expert."""
    mask = np.zeros((T, E), np.float32)
    for t in range(T):
        mask[t, rng.permutation(E)[:K]] = 1
    per_expert = np.ceil(mask.sum(0) / B).astype(np.int64)
    per_expert[-1] += n_blocks - per_expert.sum()
    block_to_expert = np.repeat(np.arange(E), per_expert).astype(np.int32)
    first_slot = np.concatenate([[0], np.cumsum(per_expert)[:-1]]) * B
    slot_to_token = np.full(n_blocks * B, -1 if skip_token else T, np.int32)
    rank = np.cumsum(mask, axis=0) - 1
    for t, e in zip(*np.nonzero(mask)):
        slot_to_token[first_slot[e] + int(rank[t, e])] = t
    return mask, slot_to_token, block_to_expert


def routed_tokens(rng, T, E, H, mask, skip_token):
    """(hidden [rows, H], affinities [rows, E]) fp32, uniform [0, 1) with the affinities masked by the routing; rows =
    T, plus the all-zero token T that unused slots point at unless skip_token."""
    rows = T if skip_token else T + 1
    hidden = rng.random((rows, H)).astype(np.float32)
    aff = rng.random((rows, E)).astype(np.float32)
    aff[:T] *= mask
    if not skip_token:
        hidden[T], aff[T] = 0, 0
    return hidden, aff


def n_blocks_dropless(T, K, E, B):
    """The library tests' block count: enough B-slot blocks for T * K routed slots with every expert's last block
    partly empty."""
    return math.ceil((T * K - (E - 1)) / B) + E - 1


def _case(func, H, T, E, B, K, inter, skip, bias, act, clamps=(None, None, None, None), target="trn2"):
    lnc = 2
    block_parallel = func == "SHARD_ON_BLOCK"
    per_iter = lnc if block_parallel else 1
    n_blocks = per_iter * math.ceil(n_blocks_dropless(T, K, E, B) / per_iter)
    skip_token, skip_weight = skip in (1, 3), skip in (2, 3)

    def inputs():
        from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_utils import SkipMode
        from nkilib_src.nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode
        rng = np.random.default_rng(0)
        mask, slot_to_token, block_to_expert = routing(rng, T, K, E, B, n_blocks, skip_token)
        hidden, aff = routed_tokens(rng, T, E, H, mask, skip_token)
        i_pad = math.ceil(inter / 16) * 16
        kw = {"hidden_states": hidden.astype(BF16), "expert_affinities_masked": aff.astype(BF16).reshape(-1, 1),
              "gate_up_proj_weight": rng.uniform(-0.1, 0.1, (E, H, 2, inter)).astype(BF16),
              "down_proj_weight": rng.uniform(-0.1, 0.1, (E, i_pad, H)).astype(BF16),
              "token_position_to_id": slot_to_token, "block_to_expert": block_to_expert, "block_size": B,
              "skip_dma": SkipMode(skip_token, skip_weight), "compute_dtype": _bf16(),
              "is_tensor_update_accumulating": K != 1,
              "expert_affinities_scaling_mode": ExpertAffinityScaleMode.POST_SCALE,
              "activation_function": getattr(ActFnType, act)}
        if bias:
            kw["gate_and_up_proj_bias"] = rng.uniform(-1, 1, (E, 2, inter)).astype(BF16)
            kw["down_proj_bias"] = rng.uniform(-1.632, 1.4375, (E, H)).astype(BF16)
        for name, value in zip(("gate_clamp_upper_limit", "gate_clamp_lower_limit", "up_clamp_upper_limit",
                                "up_clamp_lower_limit"), clamps):
            if value is not None:
                kw[name] = value
        if not block_parallel:
            kw.update(checkpoint_activation=False, expert_affinity_multiply_on_I=False)
        return kw

    def ref_inputs(kw):
        from test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common import BWMMFunc
        return {**kw, "bwmm_func": getattr(BWMMFunc, func), "lnc_degree": lnc, "top_k": K}

    return Case(_KERNELS[func], "core.moe.moe_cte.moe_cte_torch:moe_cte_torch_ref",
                f"{func.lower()}_H{H}_T{T}_E{E}_B{B}_k{K}_I{inter}_skip{skip}{'_bias' if bias else ''}_{act}",
                inputs, atol=1e-5, rtol=2e-2, source=SOURCE, target=target, lnc=lnc, ref_inputs=ref_inputs)


def _bf16():
    import nki.language as nl
    return nl.bfloat16


CASES = [
    _case("SHARD_ON_BLOCK", 3072, 1024, 8, 512, 4, 192, 1, True, "Swish", (7, None, 8, -9)),
    _case("SHARD_ON_BLOCK", 3072, 1024, 8, 256, 4, 192, 3, True, "Swish", (7, None, 8, -9), target="trn3"),
]

CASES += [
    _case("SHARD_ON_INTERMEDIATE", 3072, 1024, 8, 512, 4, 2048, 1, True, "Swish"),
]


# ---- experimental/moe forward: blockwise_mm_baseline_shard_hidden (H sharded over the LNC pair) --------------------

SRC_H = "test/integration/nkilib/experimental/moe/test_bwmm_shard_on_H.py"


def _shard_h_case(H, T, E, B, K, inter, skip, target="trn2"):
    """The test's golden sits in a module that needs AWS's metrics packages; the computation is the library's
    blockwise MoE (output[token] += affinity * down(silu(gate) * up) per block), which moe_cte_torch_ref implements
    for every blockwise variant, so it serves as the reference here (bwmm_func = SHARD_ON_HIDDEN)."""
    n_blocks = n_blocks_dropless(T, K, E, B)
    skip_token, skip_weight = skip in (1, 3), skip in (2, 3)

    def inputs():
        from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_utils import SkipMode
        from nkilib_src.nkilib.core.utils.common_types import ExpertAffinityScaleMode
        rng = np.random.default_rng(0)
        mask, slot_to_token, block_to_expert = routing(rng, T, K, E, B, n_blocks, skip_token)
        hidden, aff = routed_tokens(rng, T, E, H, mask, skip_token)
        return {"hidden_states": hidden.astype(BF16), "expert_affinities_masked": aff.astype(BF16).reshape(-1, 1),
                "gate_up_proj_weight": rng.uniform(-0.1, 0.1, (E, H, 2, inter)).astype(BF16),
                "down_proj_weight": rng.uniform(-0.1, 0.1, (E, math.ceil(inter / 16) * 16, H)).astype(BF16),
                "block_size": B, "token_position_to_id": slot_to_token,
                "block_to_expert": block_to_expert.reshape(-1, 1),
                "skip_dma": SkipMode(skip_token, skip_weight), "compute_dtype": _bf16(),
                "is_tensor_update_accumulating": K != 1,
                "expert_affinities_scaling_mode": ExpertAffinityScaleMode.POST_SCALE}

    def ref_inputs(kw):
        from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_utils import SkipMode
        from nkilib_src.nkilib.core.utils.common_types import ActFnType
        from test.integration.nkilib.core.moe.moe_cte.test_moe_cte_common import BWMMFunc
        return {**kw, "skip_dma": SkipMode(skip_token, skip_weight), "bwmm_func": BWMMFunc.SHARD_ON_HIDDEN,
                "lnc_degree": 2, "top_k": K, "activation_function": ActFnType.SiLU}

    return Case("experimental.moe.forward.bwmm_shard_on_H:blockwise_mm_baseline_shard_hidden",
                "core.moe.moe_cte.moe_cte_torch:moe_cte_torch_ref",
                f"H{H}_T{T}_E{E}_B{B}_k{K}_I{inter}_skip{skip}", inputs, atol=1e-5, rtol=2e-2, source=SRC_H,
                target=target, lnc=2, ref_inputs=ref_inputs)


CASES += [_shard_h_case(5120, 8192, 16, 256, 1, 128, 2)]


# ---- MX (trn3): blockwise_mm_shard_intermediate_mx, against the library test's MX golden -------------------------

SRC_MX = "test/integration/nkilib/core/moe/moe_cte/test_moe_bwmm_mx_cte.py (shard-on-I)"


def bwmm_mx_golden(**kw):
    """The library test's golden_moe_bwmm_mx_cte (its test tree, imported from NKILIB_SRC) on the kernel's inputs."""
    from test.integration.nkilib.core.moe.moe_cte.test_utils import golden_moe_bwmm_mx_cte
    inp = {k: (v.detach().numpy() if hasattr(v, "detach") else v) for k, v in kw.items() if k != "_n_blocks"}
    for k in ("hidden_states", "expert_affinities_masked", "gate_and_up_proj_bias", "down_proj_bias"):
        if inp.get(k) is not None:
            inp[k] = inp[k].astype(BF16)
    inp["_internal"] = {"N": kw["_n_blocks"]}
    return golden_moe_bwmm_mx_cte(inp, BF16, lnc_degree=2, is_shard_on_I=True)


def _mx_shard_i_case(H, T, inter, E, B, K, mx_name, skip, clamps=(7.0, None, 7.0, -7.0)):
    n_blocks = n_blocks_dropless(T, K, E, B)
    skip_token, skip_weight = skip in (1, 3), skip in (2, 3)

    def inputs():
        import nki.language as nl
        from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_utils import SkipMode
        from nkilib_src.nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode

        from nkisim import mx

        from .cases_moe import _mx_hidden, _stabilized_mx
        mx_dtype = getattr(nl, mx_name)
        rng = np.random.default_rng(0)
        mask, slot_to_token, block_to_expert = routing(rng, T, K, E, B, n_blocks, skip_token)
        rows = T if skip_token else T + 1
        n_h512 = H // 512
        n_i512, rem = divmod(inter, 512)
        i_par = 128
        if rem:
            n_i512, i_par = 1, rem // 4
        hidden = _mx_hidden(rng, rows, H, 5.0)
        aff = rng.random((rows, E)).astype(np.float32)
        aff[:T] *= mask
        if not skip_token:
            hidden[T], aff[T] = 0, 0
        gu_w, gu_s, _ = _stabilized_mx(rng, E * 128, 2 * n_h512 * inter, mx_dtype, 1.0)
        dn_w, dn_s, _ = _stabilized_mx(rng, E * i_par, n_i512 * H, mx_dtype, 1.0)
        kw = {"hidden_states": hidden.astype(BF16), "expert_affinities_masked": aff.astype(BF16).reshape(-1, 1),
              "gate_up_proj_weight": mx.PackedArray(gu_w.reshape(E, 128, 2, n_h512, inter), mx_dtype),
              "down_proj_weight": mx.PackedArray(dn_w.reshape(E, i_par, n_i512, H), mx_dtype),
              "token_position_to_id": slot_to_token, "block_to_expert": block_to_expert,
              "gate_and_up_proj_bias": rng.uniform(-2.0625, 0.52, (E, i_par, 2, n_i512, 4)).astype(BF16),
              "down_proj_bias": rng.uniform(-1.632, 1.4375, (E, H)).astype(BF16),
              "gate_up_proj_scale": gu_s.reshape(E, 16, 2, n_h512, inter),
              "down_proj_scale": dn_s.reshape(E, i_par // 8, n_i512, H),
              "block_size": B, "activation_function": ActFnType.Swish, "skip_dma": SkipMode(skip_token, skip_weight),
              "compute_dtype": nl.bfloat16, "weight_dtype": mx_dtype, "is_tensor_update_accumulating": K != 1,
              "expert_affinities_scaling_mode": ExpertAffinityScaleMode.POST_SCALE}
        for name, value in zip(("gate_clamp_upper_limit", "gate_clamp_lower_limit", "up_clamp_upper_limit",
                                "up_clamp_lower_limit"), clamps):
            if value is not None:
                kw[name] = value
        return kw

    return Case("core.moe.moe_cte.bwmm_shard_on_I_mx:blockwise_mm_shard_intermediate_mx", bwmm_mx_golden,
                f"mx_shard_on_I_H{H}_T{T}_I{inter}_E{E}_B{B}_k{K}_{mx_name.split('_')[0]}_skip{skip}", inputs,
                atol=1e-5, rtol=5e-2, source=SRC_MX, target="trn3", lnc=2,
                ref_inputs=lambda kw: {**kw, "_n_blocks": n_blocks})


# The smallest shard-on-I MX configuration of the library's test passes (max error 40 vs 164.8, rtol 5e-2) but takes
# ~280 s under nkisim on this machine (23 blocks of 256 tokens x H 3072 x I 2048), far beyond the suite's budget: it
# is kept out of CASES; run it with tests/conformance/cases_moe_cte.MX_CASES.
MX_CASES = [_mx_shard_i_case(3072, 1024, 2048, 8, 256, 4, "float4_e2m1fn_x4", 1)]
