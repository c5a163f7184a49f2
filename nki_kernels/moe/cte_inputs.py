"""Inputs of the blockwise CTE kernel: random bf16 tensors in `moe_cte(...)`'s argument layout with a chosen routing.
Shared by the kernel's tests and the bench (which must not import tests/); host-side only. Rank shapes come from
`tkg_inputs.tkg_shard` (one definition of a rank's MoE shard)."""

import torch

SKEWS = (None, "one", "half")


def make_cte_inputs(T, H, E, top_k, inter, seed=0, biases=True, skew=None, hidden_actual=None,
                    dtype=torch.bfloat16):
    """(x, expert_index, affinities, w_gate_up, w_down, b_gate_up, b_down). Scales keep every projection O(1) (gate/up
    ~ N(0, 1), so the clamped SwiGLU's limits are reached by a few percent of the entries).

    Routing: each token's top_k distinct experts uniformly at random, or skew "one" (expert 0 is every token's first
    choice, the rest random: one expert gets all T tokens) or "half" (only experts 0 .. E/2 - 1 are ever chosen:
    half the experts get no token). Affinities: a softmax over the k."""
    if skew not in SKEWS:
        raise ValueError(f"skew={skew!r} must be one of {SKEWS}")
    g = torch.Generator().manual_seed(seed)
    n = hidden_actual or H

    def r(*shape, sc=1.0):
        return (torch.randn(*shape, generator=g) * sc).to(dtype)

    x = r(T, H)
    if hidden_actual:
        x[:, hidden_actual:] = 0
    w_gu, w_d = r(E, H, 2, inter, sc=n ** -0.5), r(E, inter, H, sc=inter ** -0.5)
    b_gu = r(E, 2, inter, sc=0.5) if biases else None
    b_d = r(E, H, sc=0.5) if biases else None
    used = max(top_k, E // 2) if skew == "half" else E
    # k distinct experts per token: the k smallest of `used` random keys (argsort of random numbers, vectorised)
    idx = torch.argsort(torch.rand(T, used, generator=g), dim=-1)[:, :top_k]
    if skew == "one":
        rest = 1 + torch.argsort(torch.rand(T, E - 1, generator=g), dim=-1)[:, :top_k - 1]
        idx = torch.cat([torch.zeros(T, 1, dtype=torch.long), rest], dim=-1)
    aff = torch.softmax(torch.randn(T, top_k, generator=g), dim=-1)
    return x, idx, aff, w_gu, w_d, b_gu, b_d


def make_cte_mx_weights(E, H, inter, seed=0):
    """Random MXFP4 experts (mx_weights.random_mxfp4, O(1) projections) → (reference weights: w_gate_up [E, H, 2, I]
    and w_down [E, I, H] fp32, the dequantised values; kernel kwargs: the packed x4 words as float4_e2m1fn_x4 arrays
    and their scales, mx_weights.pack's layout)."""
    from nkisim import mx as nkmx  # the NumPy form of x4 packed arrays (what the interpreter's kernels take)

    from .mx_weights import dequantize, pack, random_mxfp4
    c_gu, s_gu = random_mxfp4(E, H, 2 * inter, seed)
    c_d, s_d = random_mxfp4(E, inter, H, seed + 1)
    w_gu = dequantize(c_gu, s_gu).reshape(E, H, 2, inter)
    w_d = dequantize(c_d, s_d)
    (wgu, sgu), (wd, sd) = pack(c_gu, s_gu), pack(c_d, s_d)
    fp4 = "float4_e2m1fn_x4"
    kw = dict(w_gate_up=nkmx.PackedArray(wgu, nkmx.dt.as_dtype(fp4)), w_gate_up_scale=sgu,
              w_down=nkmx.PackedArray(wd, nkmx.dt.as_dtype(fp4)), w_down_scale=sd)
    return w_gu, w_d, kw
