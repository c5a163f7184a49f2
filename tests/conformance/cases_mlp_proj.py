"""core/mlp MXFP4 projection sub-kernels (gate_up_projection_mx_tp_shard_H, down_projection_mx_shard_H): shapes of
test/integration/nkilib/core/mlp/test_mlp_proj_mxfp4.py (trn3 only; rtol 2e-2, atol 1e-5) against the library's
gate_up_proj_mxfp4_torch_ref / down_proj_mxfp4_torch_ref. The sub-kernels take SBUF operands and a ProjConfig, so
each runs inside a launch kernel of ours that stages its inputs the way the sub-kernels document them (hidden and
its quadrant-layout scales in SBUF, the H shard of this program, bias tile zero-padded to 128 partitions) and
copies program 0's result out. Inputs: our stabilized MX generator (cases_moe), MXFP8-e5m2 activations, MXFP4
weights."""

import ml_dtypes
import nki.isa as nisa
import nki.language as nl
import numpy as np

from nkisim import mx

from .cases_moe import _mx_down_tiles, _stabilized_mx
from .harness import Case

SOURCE = "test/integration/nkilib/core/mlp/test_mlp_proj_mxfp4.py"
BF16 = ml_dtypes.bfloat16


def gate_up_proj_launch(hidden_qtz, hidden_scale, weight_qtz, weight_scale, bias, H, I, BxS):  # noqa: E741
    """Our launch kernel for gate_up_projection_mx_tp_shard_H: out [128, ceil(I/512), BxS, 4] bf16."""
    from nkilib_src.nkilib.core.mlp.mlp_tkg.gate_up_projection_mx_shard_H import gate_up_projection_mx_tp_shard_H
    from nkilib_src.nkilib.core.mlp.mlp_tkg.projection_mx_constants import ProjConfig
    from nkilib_src.nkilib.core.utils.tensor_view import TensorView
    n_prgs, prg = nl.num_programs(0), nl.program_id(0)
    n_i512 = -(-I // 512)
    tiles = H // 512 // n_prgs
    own = slice(prg * tiles, (prg + 1) * tiles)
    hid = nl.ndarray((128, tiles, BxS), dtype=hidden_qtz.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=hid, src=hidden_qtz[:, own, :])
    hid_scale = nl.ndarray((128, tiles, BxS), dtype=nl.uint8, buffer=nl.sbuf)
    for q in range(4):   # dense [16, ...] scales -> partitions q*32 + 0..3
        nisa.dma_copy(dst=hid_scale[q * 32:q * 32 + 4, :, :], src=hidden_scale[q * 4:q * 4 + 4, own, :])
    bias_sb = nl.ndarray((128, n_i512, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(dst=bias_sb, value=0.0)
    nisa.dma_copy(dst=bias_sb[:bias.shape[0], :, :], src=bias)
    res = gate_up_projection_mx_tp_shard_H(hidden_qtz_sb=TensorView(hid), hidden_scale_sb=TensorView(hid_scale),
                                          weight_qtz=TensorView(weight_qtz), weight_scale=TensorView(weight_scale),
                                          bias_sb=TensorView(bias_sb), cfg=ProjConfig(H, I, BxS, n_prgs, prg))
    out = nl.ndarray(res.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
    if prg == 0:
        nisa.dma_copy(dst=out, src=res)
        if I % 512:   # rows past I/4 of the last 512-tile hold no output (the reference has zeros there)
            pad = (512 - I % 512) // 4
            zeros = nl.ndarray((pad, 1, BxS, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
            nisa.memset(dst=zeros, value=0.0)
            nisa.dma_copy(dst=out[128 - pad:, I // 512:I // 512 + 1, :, :], src=zeros)
    return out


def down_proj_launch(inter, weight_qtz, weight_scale, bias, H, I, BxS, use_stream_shuffle_broadcast=True):  # noqa: E741
    """Our launch kernel for down_projection_mx_shard_H: out [BxS, H] bf16."""
    from nkilib_src.nkilib.core.mlp.mlp_tkg.down_projection_mx_shard_H import down_projection_mx_shard_H
    from nkilib_src.nkilib.core.mlp.mlp_tkg.projection_mx_constants import ProjConfig
    n_prgs, prg = nl.num_programs(0), nl.program_id(0)
    h_shard = H // n_prgs
    inter_sb = nl.ndarray(inter.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=inter_sb, src=inter)
    bias_sb = nl.ndarray((1, h_shard), dtype=bias.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=bias_sb, src=bias[:, prg * h_shard:(prg + 1) * h_shard])
    cfg = ProjConfig(H, I, BxS, n_prgs, prg, use_stream_shuffle_broadcast=use_stream_shuffle_broadcast)
    res = down_projection_mx_shard_H(inter_sb=inter_sb, weight=weight_qtz, weight_scale=weight_scale,
                                     bias_sb=bias_sb, cfg=cfg)
    out = nl.ndarray((BxS, H), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    if prg == 0:
        for t in range(-(-BxS // 128)):
            rows = min(128, BxS - t * 128)
            nisa.dma_copy(dst=out[t * 128:t * 128 + rows, :], src=res[:rows, t, :])
    return out


def _gate_up_case(BxS, H, inter, lnc=1):
    def inputs():
        rng = np.random.default_rng(42)
        hw, hs, _ = _stabilized_mx(rng, 128, H // 512 * BxS, nl.float8_e5m2_x4, 1.0)
        ww, ws, _ = _stabilized_mx(rng, 128, H // 512 * inter, nl.float4_e2m1fn_x4, 1.0)
        n_i512 = -(-inter // 512)
        bias = rng.random((128 if inter >= 512 else inter // 4, n_i512, 4)).astype(np.float32)
        if inter % 512 and inter > 512:
            bias[128 - (512 - inter % 512) // 4:, inter // 512, :] = 0
        return {"hidden_qtz": mx.PackedArray(hw.reshape(128, -1, BxS), nl.float8_e5m2_x4),
                "hidden_scale": hs.reshape(16, -1, BxS),
                "weight_qtz": mx.PackedArray(ww.reshape(128, -1, inter), nl.float4_e2m1fn_x4),
                "weight_scale": ws.reshape(16, -1, inter), "bias": bias.astype(BF16), "H": H, "I": inter,
                "BxS": BxS}

    return Case(gate_up_proj_launch, "core.mlp.mlp_tkg.mlp_proj_mxfp4_torch:gate_up_proj_mxfp4_torch_ref",
                f"gate_up_BxS{BxS}_H{H}_I{inter}", inputs, atol=1e-5, rtol=2e-2,
                source=SOURCE + "::test_mxfp4_gate_up_proj_unit", target="trn3", lnc=lnc)


def _down_case(BxS, H, inter, ssb, lnc=1):
    def inputs():
        rng = np.random.default_rng(42)
        n_i512 = -(-inter // 512)
        _, _, vals = _stabilized_mx(rng, inter // 4, BxS, nl.float8_e5m2_x4, 1.0)
        inter_vals = vals.reshape(inter // 4, BxS, 4)
        inter_kernel = np.full((128, n_i512, BxS, 4), 6767.0, np.float32)   # rows past I/4: never used
        for t in range(n_i512):
            rows = min(128, inter // 4 - t * 128)
            inter_kernel[:rows, t] = inter_vals[t * 128:t * 128 + rows]
        ww, ws, _ = _stabilized_mx(rng, inter // 4, H, nl.float4_e2m1fn_x4, 1.0)
        w, s = _mx_down_tiles(ww, ws, inter, H, nl.float4_e2m1fn_x4.storage)
        bias = rng.random((H // 128, 128)).astype(np.float32).T.reshape(1, H)
        return {"inter": inter_kernel.astype(BF16), "weight_qtz": mx.PackedArray(w, nl.float4_e2m1fn_x4),
                "weight_scale": s, "bias": bias.astype(BF16), "H": H, "I": inter, "BxS": BxS,
                "use_stream_shuffle_broadcast": ssb}

    return Case(down_proj_launch, "core.mlp.mlp_tkg.mlp_proj_mxfp4_torch:down_proj_mxfp4_torch_ref",
                f"down_BxS{BxS}_H{H}_I{inter}_ssb{int(ssb)}", inputs, atol=1e-5, rtol=2e-2,
                source=SOURCE + "::test_mxfp4_down_proj_unit", target="trn3", lnc=lnc)


CASES = [_gate_up_case(4, 3072, 192), _gate_up_case(4, 3072, 384), _gate_up_case(4, 3072, 768),
         _down_case(4, 3072, 192, True), _down_case(4, 3072, 384, False), _down_case(4, 3072, 768, True),
         # the vectors are the library's "LNC2" list: H sharded over the pair
         _gate_up_case(4, 3072, 384, lnc=2), _down_case(4, 3072, 384, True, lnc=2)]
