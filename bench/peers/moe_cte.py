"""nki-library's `moe_cte` (core/moe/moe_cte, the `shard_on_block` implementation that vllm-neuron runs for GPT-OSS
prefill) as a side-by-side peer of our blockwise CTE kernel.

The library kernel is called unmodified through its dispatcher `moe_cte(..., spec=MoECTESpec(shard_on_block))`
(located through `bench.peers.nkilib`, NKILIB_SRC). `inputs(...)` builds its arguments from the same routing and
the same blockwise mapping our kernel gets (blockwise.py: same block size, same blocks), in the configuration
vllm-neuron uses for GPT-OSS (kernel-anchors.md §3.2): skip_token (padding rows are -1), accumulating top-k
output, POST_SCALE affinities, bf16 compute, ActFnType.Swish (x·sigmoid(1.702x)) with the GPT-OSS clamps shifted
by the +1 the framework folds into the up bias (gate <= 7, -6 <= up + 1 <= 8). Library layouts (its kernel docstring
and tests): expert_affinities_masked [T·E, 1] (dense, zeros for unused experts), block_to_expert [N, 1] (padding
blocks on the last expert, as the library's test generator places them), I padded to a multiple of 16 (down rows,
gate/up columns, biases), N even (the two cores take alternate blocks). Its output is [T, 2, H]: one slot per core,
summed after the kernel (by the framework; not part of the modelled time), where ours returns the summed [T, H].
"""

import math

import ml_dtypes
import numpy as np

from bench.peers import nkilib

KERNEL = "core.moe.moe_cte.moe_cte"
BF16 = ml_dtypes.bfloat16
LIMIT = 7.0        # GPT-OSS swiglu_limit (nki_kernels/moe/moe_torch.py GPT_OSS_SWIGLU_LIMIT)
I_ALIGN = 16       # the library's tests pad the down projection's I rows to this multiple


def launch(**kw):
    """The library dispatcher with the shard_on_block spec (its debug prints silenced)."""
    import contextlib
    import io
    mod = nkilib.load(KERNEL)
    spec = mod.MoECTESpec(implementation=mod.MoECTEImplementation.shard_on_block,
                          shard_on_block=mod.ShardOnBlockConfig())
    with contextlib.redirect_stdout(io.StringIO()):
        return mod.moe_cte(spec=spec, **kw)


def inputs(x, expert_index, affinities, w_gate_up, w_down, b_gate_up, b_down, mapping, n_cores=2):
    """The library kernel's keyword arguments for the same MoE as ours (torch bf16 tensors, our mapping)."""
    import nki.language as nl
    import torch

    from nki_kernels.moe.moe_torch import dense_affinities

    utils = nkilib.load("core.moe.moe_cte.moe_cte_utils")
    types = nkilib.load("core.utils.common_types")

    def np16(t):
        return t.float().numpy().astype(BF16)

    E, _, _, inter = w_gate_up.shape
    B = mapping.block_size
    n_real = mapping.num_blocks
    N = n_cores * math.ceil(mapping.max_blocks / n_cores)
    block_to_expert = np.full(N, int(mapping.block_to_expert[n_real - 1]), np.int32)
    block_to_expert[:n_real] = mapping.block_to_expert[:n_real]
    positions = np.full(N * B, -1, np.int32)
    positions[:mapping.token_position_to_id.size] = mapping.token_position_to_id
    # I padded with zeros (gate 0 -> activation 0 -> nothing added), in every I-indexed tensor
    i_pad = math.ceil(inter / I_ALIGN) * I_ALIGN
    w_d = torch.zeros(E, i_pad, w_down.shape[2], dtype=w_down.dtype)
    w_d[:, :inter] = w_down
    w_gu = torch.zeros(E, w_gate_up.shape[1], 2, i_pad, dtype=w_gate_up.dtype)
    w_gu[..., :inter] = w_gate_up
    kw = dict(hidden_states=np16(x),
              expert_affinities_masked=np16(dense_affinities(expert_index, affinities, E)).reshape(-1, 1),
              gate_up_proj_weight=np16(w_gu), down_proj_weight=np16(w_d),
              token_position_to_id=positions, block_to_expert=block_to_expert.reshape(-1, 1), block_size=B,
              activation_function=types.ActFnType.Swish, skip_dma=utils.SkipMode(True, False),
              compute_dtype=nl.bfloat16, is_tensor_update_accumulating=expert_index.shape[1] > 1,
              expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE,
              gate_clamp_upper_limit=LIMIT, up_clamp_upper_limit=LIMIT + 1, up_clamp_lower_limit=-LIMIT + 1)
    if b_gate_up is not None:
        b = torch.zeros(E, 2, i_pad)
        b[..., :inter] = b_gate_up.float()
        b[:, 1, :inter] += 1.0   # "For Swiglu, up_bias = up_bias + 1" (the library's bwmm kernels)
        kw["gate_and_up_proj_bias"] = b.numpy().astype(BF16)
    if b_down is not None:
        kw["down_proj_bias"] = np16(b_down)
    return kw


def output_sum(out):
    """The library's [T, 2, H] per-core slots (accumulating mode) → [T, H] fp32, as the framework sums them."""
    a = np.asarray(out, np.float32)
    return a.sum(axis=1) if a.ndim == 3 else a
