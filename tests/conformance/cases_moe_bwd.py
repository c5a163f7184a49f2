"""experimental/moe bwd (blockwise_mm_bwd: shard on H, affinity on H, dropless; LNC=2): configuration of
test/integration/nkilib/experimental/moe/test_bwmm_bwd.py (rtol 2e-2, atol 1e-5), against the test's torch reference
blockwise_mm_bwd_torch_ref (its test tree, imported from NKILIB_SRC at run time). Inputs are our seeded generator
with the test's recipe (routing as cases_moe_cte.routing; hidden / affinities uniform [0, 1) masked by the routing,
weights uniform(-0.1, 0.1), output gradient uniform(-1, 1)); the forward activation checkpoints the kernel consumes
come from the test tree's forward golden (_generate_fwd_golden) on those inputs."""


import ml_dtypes
import numpy as np

from .cases_moe_cte import n_blocks_dropless, routed_tokens, routing
from .harness import Case

SOURCE = ("test/integration/nkilib/experimental/moe/test_bwmm_bwd.py"
          "::test_moe_blockwise_mm_bwd_shardH_affinityH_dropless_lnc2")
BF16 = ml_dtypes.bfloat16


def bwd_reference(**kw):
    """The test's blockwise_mm_bwd_torch_ref (imported from the NKILIB_SRC test tree)."""
    from test.integration.nkilib.experimental.moe.test_bwmm_bwd_common import blockwise_mm_bwd_torch_ref
    return blockwise_mm_bwd_torch_ref(**kw)


def _bwd_case(H, T, E, B, K, inter, skip, clamps, bias, act, target="trn2"):
    n_blocks = n_blocks_dropless(T, K, E, B)
    skip_token = skip in (1, 3)

    def inputs():
        import nki.language as nl
        from nkilib_src.nkilib.core.moe.moe_cte.moe_cte_utils import SkipMode
        from nkilib_src.nkilib.experimental.moe.bwd.moe_bwd_parameters import ActFnType, ClampLimits
        from test.integration.nkilib.experimental.moe.test_bwmm_bwd_common import _generate_fwd_golden
        rng = np.random.default_rng(0)
        mask, slot_to_token, block_to_expert = routing(rng, T, K, E, B, n_blocks, skip_token)
        hidden, aff = routed_tokens(rng, T, E, H, mask, skip_token)
        grad = rng.uniform(-1, 1, (len(hidden), H)).astype(np.float32)
        if not skip_token:
            grad[T] = 0
        down = rng.uniform(-0.1, 0.1, (E, inter, H)).astype(BF16)
        gate_up = rng.uniform(-0.1, 0.1, (E, H, 2, inter)).astype(BF16)
        gu_b = rng.uniform(-0.1, 0.1, (E, 2, inter)).astype(BF16) if bias else None
        dn_b = rng.uniform(-0.1, 0.1, (E, H)).astype(BF16) if bias else None
        hidden, aff, grad = hidden.astype(BF16), aff.astype(BF16), grad.astype(BF16)
        limits, act_fn, skip_mode = ClampLimits(*clamps), getattr(ActFnType, act), SkipMode(skip_token, skip in (2, 3))
        _, gate_up_act_t, down_act = _generate_fwd_golden(aff, down, slot_to_token, block_to_expert, gate_up, hidden,
                                                          T, H, B, n_blocks, E, inter, BF16, skip_mode, act_fn,
                                                          gu_b, dn_b, limits)
        return {"hidden_states": hidden, "expert_affinities_masked": aff.reshape(-1, 1),
                "gate_up_proj_weight": gate_up, "down_proj_weight": down,
                "gate_up_proj_act_checkpoint_T": np.asarray(gate_up_act_t).astype(BF16),
                "down_proj_act_checkpoint": np.asarray(down_act).astype(BF16),
                "token_position_to_id": slot_to_token, "block_to_expert": block_to_expert,
                "output_hidden_states_grad": grad, "block_size": B, "skip_dma": skip_mode,
                "compute_dtype": nl.bfloat16, "is_tensor_update_accumulating": K != 1, "clamp_limits": limits,
                "bias": bias, "activation_type": act_fn}

    return Case("experimental.moe.bwd.blockwise_mm_backward:blockwise_mm_bwd", bwd_reference,
                f"H{H}_T{T}_E{E}_B{B}_k{K}_I{inter}_skip{skip}", inputs, atol=1e-5, rtol=2e-2, source=SOURCE,
                target=target, lnc=2)


CASES = [_bwd_case(6144, 4096, 1, 512, 1, 128, 0, (7, -7, 7, -7), False, "SiLU")]
