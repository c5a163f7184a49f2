"""Torch reference of the blockwise CTE (prefill) MoE kernel: moe_experts_torch's math, block by block, with the
kernel's rounding points.

The expert MLP is `expert_mlp_torch` (fp32 from the given bf16 values). What this file adds is the order and
rounding of the accumulation, as the kernel (and nki-library's `moe_cte_torch_ref`) does it on the hardware: blocks
in mapping order (experts in increasing id); each block's affinity-scaled output is rounded to the output dtype
(x's, bf16) before it is added; the output lives in that dtype, so every accumulation is a read-modify-write that
rounds again (the kernel's DMA scatter-add computes in fp32 and stores bf16).
"""

import torch

from .blockwise import blockwise_mapping
from .moe_torch import expert_mlp_mx_torch, expert_mlp_torch  # noqa: F401 (expert_mlp_mx_torch: re-exported)


def moe_cte_torch(x, expert_index, affinities, w_gate_up, w_down, b_gate_up=None, b_down=None,
                  activation="clamped_swiglu", add_down_bias=True, block_size=128, mapping=None, mx=False):
    """x [T, H]; expert_index / affinities [T, k]; weights as in moe_torch.py. Returns out [T, H] in x's dtype: the
    partial sum of this rank (down bias included iff add_down_bias and b_down is given). mx: the weights are
    dequantised MXFP4 and the MLP is expert_mlp_mx_torch (the kernel's trn3 MX path)."""
    E = w_gate_up.shape[0]
    if mapping is None:
        mapping = blockwise_mapping(expert_index, E, block_size)
    B = mapping.block_size
    aff = affinities.reshape(-1).float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    down_bias = b_down if add_down_bias else None
    for n in range(mapping.num_blocks):
        e = int(mapping.block_to_expert[n])
        slots = torch.from_numpy(mapping.token_position_to_slot[n * B:(n + 1) * B].astype("int64"))
        slots = slots[slots >= 0]
        tokens = slots // expert_index.shape[1]
        y = (expert_mlp_mx_torch if mx else expert_mlp_torch)(x[tokens], w_gate_up, w_down, e, b_gate_up, down_bias,
                                                              activation)
        scaled = (aff[slots][:, None] * y).to(x.dtype).float()
        out[tokens] = (out[tokens] + scaled).to(x.dtype).float()
    return out.to(x.dtype)
