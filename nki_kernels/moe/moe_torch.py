"""Torch references shared by the MoE kernels (router, expert activations, expert MLP, MXFP4 decoding).

These are the semantics every MoE kernel of `nki_kernels/moe/` and the MoE module agree on; each kernel's own
`*_torch.py` adds only its rounding points (e.g. CTE's per-block bf16 rounding) on top of them.

Weight layout (the kernels' and nki-library's `moe_tkg` layout; the checkpoint loader converts GPT-OSS's interleaved
`gate_up_proj` [E, H, 2I] into it):
    w_gate_up [E, H, 2, I]   index 0 of axis 2 is gate, 1 is up
    b_gate_up [E, 2, I]
    w_down    [E, I, H]
    b_down    [E, H]
Under tensor parallelism without EP, I is this rank's shard of the intermediate dimension and the output is a partial
sum for the all-reduce; the down-projection bias is then added on one rank only (`add_down_bias`).

Math is fp32 throughout from the given (bf16) values: router logits, softmax and the expert MLP.
"""

import torch

ROUTER_MODES = ("gpt_oss", "softmax_topk")
ACTIVATIONS = ("clamped_swiglu", "swiglu")

# GPT-OSS's clamped SwiGLU (config.json `swiglu_limit` 7.0; alpha 1.702 from the reference implementation).
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SWIGLU_ALPHA = 1.702

# OCP MX FP4 (E2M1) code points by nibble value; bit 3 is the sign.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK = 32          # elements sharing one E8M0 scale (OCP MX spec)
E8M0_BIAS = 127
E8M0_NAN = 0xFF        # the E8M0 code for NaN (OCP MX spec)


def router_torch(x, w_router, b_router=None, *, top_k, mode="gpt_oss", renormalize=False):
    """Top-k routing. x [T, H]; w_router [H, E]; b_router [E] or None.

    mode "gpt_oss": top-k on the logits, softmax over the k selected logits (GPT-OSS).
    mode "softmax_topk": softmax over all E logits, then top-k; `renormalize` divides the k probabilities by their sum.
    Ties are broken by the lower expert index first (a stable descending sort). torch.topk equals this whenever
    the selected values are distinct, but its tie order is implementation-defined (CPU: topk(zeros(6), 2) gives
    [3, 5]), so no kernel could match it; the hardware's max8 / nc_find_index8 give lowest-index-first, as here.
    Returns (logits [T, E] fp32, expert_index [T, k] int64, affinities [T, k] fp32), each token's experts in
    descending logit order.
    """
    if mode not in ROUTER_MODES:
        raise ValueError(f"router mode must be one of {ROUTER_MODES}, got {mode!r}")
    E = w_router.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    logits = x.float() @ w_router.float()
    if b_router is not None:
        logits = logits + b_router.float()
    if mode == "gpt_oss":
        top, index = _topk_stable(logits, top_k)
        return logits, index, torch.softmax(top, dim=-1)
    top, index = _topk_stable(torch.softmax(logits, dim=-1), top_k)
    if renormalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, index, top


def _topk_stable(values, k):
    """The k largest along the last axis, descending, equal values in ascending index order."""
    top, index = torch.sort(values, dim=-1, descending=True, stable=True)
    return top[..., :k], index[..., :k]


def dense_affinities(expert_index, affinities, num_experts):
    """[T, k] indices and affinities → [T, E] fp32 with zeros for the experts a token does not use (a repeated
    index sums its affinities, as the experts' outputs would)."""
    dense = torch.zeros(expert_index.shape[0], num_experts, dtype=torch.float32)
    return dense.scatter_add(1, expert_index.long(), affinities.float())


def activation_torch(gate, up, activation="clamped_swiglu", limit=GPT_OSS_SWIGLU_LIMIT, alpha=GPT_OSS_SWIGLU_ALPHA):
    """The gated activation on fp32 gate/up projections.

    clamped_swiglu (GPT-OSS): gate ≤ limit, −limit ≤ up ≤ limit, glu = gate·sigmoid(alpha·gate), out = (up + 1)·glu.
    swiglu: silu(gate)·up.
    """
    if activation == "clamped_swiglu":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1.0) * (gate * torch.sigmoid(alpha * gate))
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def expert_mlp_torch(x, w_gate_up, w_down, expert, b_gate_up=None, b_down=None, activation="clamped_swiglu"):
    """One expert's MLP on tokens x [T, H] → [T, H] fp32 (down bias included when b_down is given)."""
    x = x.float()
    gate = x @ w_gate_up[expert, :, 0, :].float()
    up = x @ w_gate_up[expert, :, 1, :].float()
    if b_gate_up is not None:
        gate = gate + b_gate_up[expert, 0].float()
        up = up + b_gate_up[expert, 1].float()
    out = activation_torch(gate, up, activation) @ w_down[expert].float()
    if b_down is not None:
        out = out + b_down[expert].float()
    return out


def expert_mlp_mx_torch(x, w_gate_up, w_down, expert, b_gate_up=None, b_down=None, activation="clamped_swiglu"):
    """expert_mlp_torch with MXFP4 weights on trn3's MX path: w_gate_up [E, H, 2, I] / w_down [E, I, H] are the
    dequantised MXFP4 values (mx_weights.dequantize); x and the activations (rounded to x's dtype first, as the
    kernel stores them) are MXFP8-quantised in 32-element blocks along the contraction (mx_weights.mx_quantize_torch)
    before each projection; products and sums in fp32."""
    from .mx_weights import mx_quantize_torch
    xq = mx_quantize_torch(x.float())
    gate = xq @ w_gate_up[expert, :, 0, :].float()
    up = xq @ w_gate_up[expert, :, 1, :].float()
    if b_gate_up is not None:
        gate = gate + b_gate_up[expert, 0].float()
        up = up + b_gate_up[expert, 1].float()
    act = mx_quantize_torch(activation_torch(gate, up, activation).to(x.dtype).float())
    out = act @ w_down[expert].float()
    if b_down is not None:
        out = out + b_down[expert].float()
    return out


def moe_experts_torch(x, expert_index, affinities, w_gate_up, w_down, b_gate_up=None, b_down=None,
                      activation="clamped_swiglu", add_down_bias=True, mx=False):
    """Σ_k affinity[t, k] · expert_{index[t, k]}(x[t]) → [T, H] fp32, the affinity applied after down-projection.

    x [T, H]; expert_index [T, k] (local expert ids); affinities [T, k]. With add_down_bias False the down bias is
    left out (the TP ranks that must not add it). mx: the weights are dequantised MXFP4 and each expert is
    expert_mlp_mx_torch (trn3's MX path: tokens and activations quantised to MXFP8).
    """
    mlp = expert_mlp_mx_torch if mx else expert_mlp_torch
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32)
    index = expert_index.long()
    for e in torch.unique(index).tolist():
        rows, slot = torch.nonzero(index == e, as_tuple=True)
        y = mlp(x[rows], w_gate_up, w_down, e, b_gate_up, b_down if add_down_bias else None, activation)
        out.index_add_(0, rows, affinities[rows, slot].float()[:, None] * y)
    return out


def rmsnorm_torch(x, gamma, eps=1e-5, hidden_actual=None):
    """RMSNorm over the first `hidden_actual` columns (padded H: the pad columns are zero and are not counted)."""
    x = x.float()
    n = hidden_actual or x.shape[-1]
    rms = torch.rsqrt((x[..., :n] ** 2).sum(-1, keepdim=True) / n + eps)
    return x * rms * gamma.float()


def moe_torch(x, w_router, w_gate_up, w_down, *, top_k, b_router=None, b_gate_up=None, b_down=None, gamma=None,
              eps=1e-5, hidden_actual=None, router_mode="gpt_oss", renormalize=False, activation="clamped_swiglu",
              add_down_bias=True, mx=False):
    """The whole MoE block: optional RMSNorm → router → experts. Returns (out [T, H] fp32, expert_index, affinities).
    mx: MXFP4 experts (moe_experts_torch's mx).

    The normalised activations are rounded to x's dtype before the router and the experts, as a kernel stores them.
    """
    h = x if gamma is None else rmsnorm_torch(x, gamma, eps, hidden_actual).to(x.dtype)
    _, index, aff = router_torch(h, w_router, b_router, top_k=top_k, mode=router_mode, renormalize=renormalize)
    out = moe_experts_torch(h, index, aff, w_gate_up, w_down, b_gate_up, b_down, activation, add_down_bias, mx)
    return out, index, aff


def _fp4_byte_pairs() -> torch.Tensor:
    """[256, 2] fp32: the two E2M1 values of every byte (low nibble first)."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1)


_FP4_BYTE_PAIRS = _fp4_byte_pairs()


def dequant_mxfp4(blocks, scales):
    """MXFP4 → fp32. blocks uint8 [..., G, 16] (two E2M1 nibbles per byte, low nibble first), scales uint8 [..., G]
    (E8M0: 2^(s − 127); 0xFF is NaN) → [..., G·32]. This is how GPT-OSS ships its expert weights (`*_blocks`,
    `*_scales`).

    One gather of a byte → value-pair table (a row lookup, several times faster than two nibble lookups through
    int64 indices) and one in-place multiply by the block scale, built on the 32× smaller scale tensor. The
    checkpoint loaders use a layout-aware variant (``modules.moe.loaders.dequant_mxfp4_rows_last``, tested bit for
    bit against this one)."""
    vals = torch.nn.functional.embedding(blocks.to(torch.int32), _FP4_BYTE_PAIRS).flatten(-2)   # [..., G, 32]
    exp = scales.to(torch.int32) - E8M0_BIAS
    scale = torch.ldexp(torch.ones(exp.shape, dtype=torch.float32), exp)                      # exact powers of two
    scale.masked_fill_(scales == E8M0_NAN, float("nan"))
    return vals.mul_(scale[..., None]).flatten(-2)
