"""nki-library's `moe_tkg` (core/moe/moe_tkg) as a side-by-side peer of our TKG kernel.

The library kernel is called unmodified (located through `bench.peers.nkilib`, NKILIB_SRC). It is the expert part
only: it takes the routing (expert_index [T, k], expert_affinities [T, E]) and the normalised hidden states as
inputs, so `inputs(...)` gives it what our kernel computes in-kernel before its experts — the RMSNorm output rounded to
the input dtype and the reference router's top-k (`moe_torch`), i.e. the same experts on the same tokens. Our kernel's
figures include its fused RMSNorm and router; the library's do not.

Its GPT-OSS configuration is the one vLLM-neuron / NxD pass (kernel-anchors.md §3.1): ActFnType.Swish
(x·sigmoid(1.702x)), POST_SCALE affinities, gate clamp ≤ 7, and the "+1" of (up + 1) folded into the up bias, so
the up clamp limits shift to [−6, 8]. Its mode follows NxD's rule (DEFAULT_SELECTIVE_LOADING_THRESHOLD):
all-expert iff T·k / E ≥ 1, else selective; the all-expert path takes affinities in bf16 and a rank_id, as its tests.
"""

import ml_dtypes
import numpy as np

from bench.peers import nkilib

KERNEL = "core.moe:moe_tkg"
BF16 = ml_dtypes.bfloat16


def nxd_mode(T, E, k):
    """NxD / vLLM-neuron's switch: all-expert iff T·k / E_local ≥ 1.0."""
    return "all" if T * k / E >= 1.0 else "selective"


def kernel():
    """The library kernel as an nki.jit kernel (index [2] for LNC=2, as its tests run it)."""
    import nki
    nkilib.activate()
    k = nkilib.load(KERNEL)
    return k if getattr(k, "_is_nki_kernel", False) else nki.jit(k)


def inputs(h, expert_index, affinities, w_gate_up, w_down, b_gate_up=None, b_down=None, mode="selective",
           activation="clamped_swiglu"):
    """The library kernel's keyword arguments for our experts: h [T, H] normalised hidden states (bf16), expert_index
    [T, k] and affinities [T, k] from the router, weights in the shared layout (torch, bf16)."""
    import nki.language as nl
    import torch

    nkilib.activate()
    types = nkilib.load("core.utils.common_types")

    def np16(t):
        return None if t is None else t.float().numpy().astype(BF16)

    T = h.shape[0]
    E = w_gate_up.shape[0]
    dense = torch.zeros(T, E).scatter_add(1, expert_index.long(), affinities.float())
    all_expert = mode == "all"
    clamped = activation == "clamped_swiglu"
    bgu = None
    if b_gate_up is not None:
        bgu = b_gate_up.float().clone()
        if clamped:
            bgu[:, 1] += 1.0                      # (up + 1): the library's Swish convention folds it into the bias
        bgu = bgu.numpy().astype(BF16)
    return dict(
        hidden_input=np16(h), expert_gate_up_weights=np16(w_gate_up), expert_down_weights=np16(w_down),
        expert_affinities=dense.numpy().astype(BF16 if all_expert else np.float32),
        expert_index=expert_index.numpy().astype(np.int32), is_all_expert=all_expert,
        rank_id=np.zeros((1, 1), np.uint32) if all_expert else None,
        expert_gate_up_bias=bgu, expert_down_bias=np16(b_down),
        expert_affinities_scaling_mode=types.ExpertAffinityScaleMode.POST_SCALE,
        activation_fn=types.ActFnType.Swish if clamped else types.ActFnType.SiLU, output_dtype=nl.bfloat16,
        gate_clamp_upper_limit=7.0 if clamped else None,
        up_clamp_upper_limit=8.0 if clamped else None, up_clamp_lower_limit=-6.0 if clamped else None)
