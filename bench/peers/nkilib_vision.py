"""nki-library's kernels on one block of packed image patches, under the same nkisim cost model as ours.

The library has no fused vision-attention kernel; its pieces for the same work are
  - `core.qkv.qkv:qkv` (CTE path: fused QKV projection with bias, no norm, BSD output),
  - `core.attention.attention_cte:attention_cte` with sequence packing (bound_min / bound_max, non-causal; the heads
    as its batch; the range_select path requires scale = 1.0, so Q comes pre-scaled by 1/sqrt(d)),
  - `core.output_projection.output_projection_cte:output_projection_cte` (attention in [b, heads, d, S] layout).
RoPE has no library kernel here: the pipeline leaves it out (in the library's favour). Each piece is profiled
trace-only (numerics=False: no control flow of these kernels depends on data) on the shapes of one rank's block.
Called the way tests/conformance/cases_{qkv,attention,output_projection}.py call them (after the library's tests).
"""

import ml_dtypes
import numpy as np

from . import nkilib

BF16 = ml_dtypes.bfloat16


def _jit(ref, lnc):
    import nki
    kernel = nkilib.load(ref)
    if not getattr(kernel, "_is_nki_kernel", False):
        kernel = nki.jit(kernel)
    return kernel[lnc] if lnc != 1 else kernel


def _profile(ref, lnc, target, useful_flops, **kwargs):
    import nkisim
    _, rep = nkisim.profile(_jit(ref, lnc), target=target, numerics=False, useful_flops=useful_flops, **kwargs)
    return rep


def attention_cte_packed(S, num_heads, head_dim, bound_min, bound_max, *, lnc=1, target="trn2", useful_flops=None):
    """attention_cte over one packed block: q [nh, S, d] (tp_q), k [nh, d, S], v [nh, S, d] bf16, bounds fp32
    [S, 1] as the library's test_attention_cte builds them. Returns the modelled CostReport."""
    nkilib.activate()
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((num_heads, S, head_dim)) * head_dim ** -0.5).astype(BF16)
    k = rng.standard_normal((num_heads, head_dim, S)).astype(BF16)
    v = rng.standard_normal((num_heads, S, head_dim)).astype(BF16)
    lo = np.asarray(bound_min, np.float32).reshape(S, 1)
    hi = np.asarray(bound_max, np.float32).reshape(S, 1)
    return _profile("core.attention.attention_cte:attention_cte", lnc, target, useful_flops, q=q, k=k, v=v,
                    scale=1.0, causal_mask=False, tp_q=True, tp_k=False, tp_out=False, bound_min=lo, bound_max=hi)


def qkv_cte(S, H, num_heads, head_dim, *, lnc=1, target="trn2"):
    """The library's QKV projection (CTE path, with bias, no norm) of one block: x [1, S, H] @ W [H, 3*nh*d]."""
    nkilib.activate()
    t = nkilib.load("core.utils.common_types")
    rng = np.random.default_rng(0)
    fused = 3 * num_heads * head_dim
    kw = {"input": rng.normal(size=(1, S, H)).astype(BF16),
          "fused_qkv_weights": (rng.normal(size=(H, fused)) * H ** -0.5).astype(BF16),
          "output_layout": t.QKVOutputLayout.BSD, "bias": rng.normal(size=(1, fused)).astype(BF16),
          "quantization_type": t.QuantizationType.NONE, "qkv_w_scale": None, "qkv_in_scale": None,
          "fused_residual_add": False, "mlp_prev": None, "attention_prev": None,
          "fused_norm_type": t.NormType.NO_NORM, "gamma_norm_weights": None, "layer_norm_bias": None,
          "norm_eps": 1e-6, "hidden_actual": None, "d_head": head_dim, "num_q_heads": num_heads,
          "num_kv_heads": num_heads, "store_output_in_sbuf": False, "sbm": None, "use_auto_allocation": False,
          "load_input_with_DMA_transpose": True, "weight_layout": t.QKVWeightLayout.CONTIGUOUS,
          "is_h_dim_4h_transposed": False}
    return _profile("core.qkv.qkv:qkv", lnc, target, 2.0 * S * H * fused, **kw)


def output_projection_cte(S, H, num_heads, head_dim, *, lnc=1, target="trn2"):
    """The library's O-projection (CTE path, no bias: the partial before the TP all-reduce, as ours) of one block:
    attention [1, nh, d, S] @ W_o [nh*d, H]."""
    nkilib.activate()
    t = nkilib.load("core.utils.common_types")
    rng = np.random.default_rng(0)
    kw = {"attention": rng.normal(size=(1, num_heads, head_dim, S)).astype(BF16),
          "weight": (rng.normal(size=(num_heads * head_dim, H)) * (num_heads * head_dim) ** -0.5).astype(BF16),
          "bias": None, "quantization_type": t.QuantizationType.NONE, "input_scales": None, "weight_scales": None}
    return _profile("core.output_projection.output_projection_cte:output_projection_cte", lnc, target,
                    2.0 * S * num_heads * head_dim * H, **kw)
