"""core/moe (moe_tkg selective / all-expert): shapes of test/integration/nkilib/core/moe/moe_tkg/test_moe_tkg.py,
its tolerances (rtol 2e-2, atol 1e-5). Inputs are our own seeded generators following the test's recipe: expert
indices drawn without replacement (all-expert) or uniformly (selective), affinities normalised random weights placed
at those indices, weights/biases/hidden standard normal."""

import ml_dtypes
import numpy as np

from .harness import Case

SRC_TKG = "test/integration/nkilib/core/moe/moe_tkg/test_moe_tkg.py::test_moe_tkg"


def _routing(rng, T, E, K, all_expert):
    """(expert index [T, k] int32, affinities [T, E] fp32): k = K (all E when K is None) experts per token, drawn
    without replacement (all-expert) or uniformly (selective), normalised random weights placed at those indices."""
    k = K if K is not None else E
    if all_expert:
        idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    else:
        idx = rng.integers(0, E, size=(T, k)).astype(np.int32)
    weights = rng.random((T, k))
    weights /= weights.sum(axis=1, keepdims=True)
    aff = np.zeros((T, E), np.float32)
    for t in range(T):
        aff[t, idx[t]] = weights[t]
    return idx, aff


def _moe_tkg_inputs(T, H, inter, E, K, act, all_expert, dtype, clamp, bias, fp8_row=False):
    def build():
        from nkilib_src.nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode
        rng = np.random.default_rng(1234)
        idx, aff = _routing(rng, T, E, K, all_expert)
        aff_dtype = ml_dtypes.bfloat16 if all_expert else np.float32
        normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(dtype)  # noqa: E731
        kw = {
            "hidden_input": normal(T, H),
            "expert_gate_up_weights": normal(E, H, 2, inter),
            "expert_down_weights": normal(E, inter, H),
            "expert_affinities": aff.astype(aff_dtype),
            "expert_index": idx,
            "is_all_expert": all_expert,
            "rank_id": np.zeros((1, 1), np.uint32) if all_expert else None,
            "expert_gate_up_bias": normal(E, 2, inter) if bias else None,
            "expert_down_bias": normal(E, H) if bias else None,
            "expert_affinities_scaling_mode": ExpertAffinityScaleMode.POST_SCALE,
            "activation_fn": getattr(ActFnType, act),
            "output_dtype": _nl_dtype(dtype),
            "gate_clamp_upper_limit": 7.0 if clamp else None,
            "up_clamp_upper_limit": 8.0 if clamp else None,
            "up_clamp_lower_limit": -6.0 if clamp else None,
        }
        if fp8_row:  # FP8 (cFP8 e4m3) weights with per-row fp32 dequant scales, as the test's ROW cases
            kw["expert_gate_up_weights"] = kw["expert_gate_up_weights"].astype(np.float32).astype(ml_dtypes.float8_e4m3)
            kw["expert_down_weights"] = kw["expert_down_weights"].astype(np.float32).astype(ml_dtypes.float8_e4m3)
            kw["expert_gate_up_weights_scale"] = rng.standard_normal((E, 2, inter)).astype(np.float32)
            kw["expert_down_weights_scale"] = rng.standard_normal((E, H)).astype(np.float32)
        return kw
    return build


def _nl_dtype(dtype):
    import nki.language as nl
    return nl.float16 if np.dtype(dtype) == np.float16 else nl.bfloat16


def _tkg(T, H, inter, E, K, act, all_expert, target="trn2", dtype=np.float16, clamp=True, bias=False, fp8_row=False):
    kind = "all" if all_expert else "sel"
    return Case("core.moe:moe_tkg", "core.moe.moe_tkg.moe_tkg_torch:moe_tkg_torch_ref",
                f"{kind}_T{T}_H{H}_I{inter}_E{E}_K{K}_{act}{'_bias' if bias else ''}{'_fp8row' if fp8_row else ''}",
                _moe_tkg_inputs(T, H, inter, E, K, act, all_expert, dtype, clamp, bias, fp8_row),
                atol=1e-5, rtol=2e-2, source=SRC_TKG, target=target, lnc=2)


CASES = [
    _tkg(4, 3072, 64, 4, None, "Swish", True, bias=True),
    _tkg(2, 4096, 192, 8, None, "SiLU", True),
    _tkg(128, 256, 128, 2, None, "SiLU", True, target="trn3"),
    _tkg(2, 512, 128, 2, 1, "SiLU", False),
    _tkg(5, 512, 128, 4, 2, "Swish", False, bias=True),
    _tkg(4, 3072, 192, 128, 4, "Swish", False, bias=True, target="trn3"),
    _tkg(4, 512, 64, 2, None, "SiLU", True, bias=True, fp8_row=True),
    _tkg(4, 1024, 128, 4, None, "SiLU", True, bias=True, fp8_row=True, target="trn3"),
    _tkg(4, 512, 64, 4, 2, "Swish", False, bias=True, fp8_row=True),
]


# ---- MX (trn3 only): weights quantized by us with the OCP MX rule, in the layouts test_moe_tkg.py documents --------

def _stabilized_mx(rng, rows, words, mx_dtype, val_range):
    """MX data as test_moe_tkg.py generates it (our code, its recipe): elements uniform over the element format's range
    with one element per 8x4 group at the format's largest exponent (so re-quantizing the dequantized values gives
    back the same scale), scales uniform over the 11 exponents below log2(val_range / largest value).
    Returns (packed words [rows, words], scales [rows/8, words], dequantized fp32 values [rows, 4 * words])."""
    from nkisim import mx
    emax, vmax = mx.element_params(mx_dtype)
    elems = rng.uniform(-vmax, vmax, size=(rows // 8, 8, words, 4))
    pick_p, pick_q = rng.integers(0, 8, size=(rows // 8, words)), rng.integers(0, 4, size=(rows // 8, words))
    g, w = np.meshgrid(np.arange(rows // 8), np.arange(words), indexing="ij")
    elems[g, pick_p, w, pick_q] = rng.choice([-1.0, 1.0], size=g.shape) * (1 + 0.5 * rng.random(g.shape)) * 2.0 ** emax
    elems = elems.reshape(rows, 4 * words).astype(np.float32)
    packed = mx.encode(elems, mx_dtype)
    top = min(255, int(np.log2(val_range / vmax)) + mx.SCALE_BIAS)
    scales = rng.integers(max(0, top - 10), top + 1, size=(rows // 8, words)).astype(np.uint8)
    values = mx.decode(packed, mx_dtype) * np.exp2(np.repeat(np.repeat(scales.astype(np.float64), 8, 0), 4, 1) - 127)
    return packed, scales, values


def _mx_weights(rng, n_rows, n_words, mx_dtype):
    rows8 = -(-n_rows // 8) * 8
    words, scales, _ = _stabilized_mx(rng, rows8, n_words, mx_dtype, 1.0)
    return words[:n_rows], scales[: -(-n_rows // 8)]


def _mx_down_layout(inter):
    """(partitions, 512-column tiles) of the MX down projection's I/4 rows: padded to a multiple of 8 below I = 512."""
    return (-(-inter // 4 // 8) * 8 if inter < 512 else 128), -(-inter // 512)


def _mx_expert_weights(rng, E, H, inter, mx_dtype):
    """Packed MX expert weights and uint8 scales in the tkg kernels' layout: gate/up [E, 128, 2, H/512, I] (scales
    [E, 16, ...]) and down [E, i_p, I/512 tiles, H] (scales [E, i_p/8, ...]); _mx_weights draws each projection."""
    n_h512 = H // 512
    i_p, n_i512 = _mx_down_layout(inter)
    gu_w = np.zeros((E, 128, 2, n_h512, inter), mx_dtype.storage)
    gu_s = np.zeros((E, 16, 2, n_h512, inter), np.uint8)
    dn_w = np.zeros((E, i_p, n_i512, H), mx_dtype.storage)
    dn_s = np.zeros((E, -(-i_p // 8), n_i512, H), np.uint8)
    for e in range(E):
        for g in range(2):
            w, s = _mx_weights(rng, 128, n_h512 * inter, mx_dtype)
            gu_w[e, :, g] = w.reshape(128, n_h512, inter)
            gu_s[e, :, g] = s.reshape(16, n_h512, inter)
        dn_w[e], dn_s[e] = _mx_down_tiles(*_mx_weights(rng, -(-inter // 4), H, mx_dtype), inter, H, mx_dtype.storage)
    return gu_w, gu_s, dn_w, dn_s


def _mx_down_tiles(words, scales, inter, H, storage):
    """The MX down projection's words [I/4, H] and scales [I/32, H] in the kernels' tile layout: words
    [i_p, I/512 tiles, H] (row t * 128 + p of the I/4 rows on partition p of tile t), scales [i_p/8, tiles, H];
    partitions past the last row stay zero."""
    i_p, n_i512 = _mx_down_layout(inter)
    w = np.zeros((i_p, n_i512, H), storage)
    s = np.zeros((-(-i_p // 8), n_i512, H), np.uint8)
    for t in range(n_i512):
        rows, srows = min(128, words.shape[0] - t * 128), min(16, scales.shape[0] - t * 16)
        w[:rows, t], s[:srows, t] = words[t * 128:t * 128 + rows], scales[t * 16:t * 16 + srows]
    return w, s


def _mx_hidden(rng, T, H, val_range):
    """Hidden states [T, H] (fp32 values, exact in bf16) exactly representable in MXFP8 (e4m3fn) in the kernels'
    quantization layout: H index q * H/4 + tile * 128 + p, groups of 8 partitions p x the 4 lanes q (as
    test_moe_tkg.py lays them out); MX scales below val_range (see _stabilized_mx)."""
    from nkisim import mx
    n512 = H // 512
    _, _, values = _stabilized_mx(rng, T * n512 * 128, 1, mx.dt.float8_e4m3fn_x4, val_range)
    return values.reshape(T, n512, 128, 4).transpose(0, 3, 1, 2).reshape(T, H)


def _moe_tkg_mx_inputs(T, H, inter, E, K, act, all_expert, mx_name, bias):
    def build():
        import nki.language as nl
        from nkilib_src.nkilib.core.utils.common_types import ActFnType, ExpertAffinityScaleMode

        from nkisim import mx
        mx_dtype = getattr(nl, mx_name)
        rng = np.random.default_rng(7)
        idx, aff = _routing(rng, T, E, K, all_expert)
        gu_w, gu_s, dn_w, dn_s = _mx_expert_weights(rng, E, H, inter, mx_dtype)
        i_p, n_i512 = _mx_down_layout(inter)
        bf16 = lambda *shape: rng.standard_normal(shape).astype(ml_dtypes.bfloat16)  # noqa: E731
        return {
            "hidden_input": _mx_hidden(rng, T, H, 5.0).astype(ml_dtypes.bfloat16),
            "expert_gate_up_weights": mx.PackedArray(gu_w, mx_dtype),
            "expert_down_weights": mx.PackedArray(dn_w, mx_dtype),
            "expert_affinities": aff.astype(ml_dtypes.bfloat16 if all_expert else np.float32),
            "expert_index": idx,
            "is_all_expert": all_expert,
            "rank_id": np.zeros((1, 1), np.uint32) if all_expert else None,
            "expert_gate_up_bias": bf16(E, i_p, 2, n_i512, 4) if bias else None,
            "expert_down_bias": bf16(E, H) if bias else None,
            "expert_gate_up_weights_scale": gu_s,
            "expert_down_weights_scale": dn_s,
            "expert_affinities_scaling_mode": ExpertAffinityScaleMode.POST_SCALE,
            "activation_fn": getattr(ActFnType, act),
            "output_dtype": nl.bfloat16,
            "gate_clamp_upper_limit": 7.0,
            "up_clamp_upper_limit": 8.0,
            "up_clamp_lower_limit": -6.0,
        }
    return build


_PADDING = (" (the MX projections quantize and multiply all 128 partitions, of which the ones past I/4 were"
            " never written, and cancel them with zero-padded weights: run with NKISIM_UNINIT=zero, stale finite"
            " memory as on the device, instead of nkisim's NaN fill)")


def _tkg_mx(T, H, inter, E, K, act, all_expert, mx_name="float4_e2m1fn_x4", bias=True):
    kind = "all" if all_expert else "sel"
    return Case("core.moe:moe_tkg", "core.moe.moe_tkg.moe_tkg_torch:moe_tkg_torch_ref",
                f"mx_{kind}_T{T}_H{H}_I{inter}_E{E}_K{K}_{act}_{mx_name.split('_')[0]}",
                _moe_tkg_mx_inputs(T, H, inter, E, K, act, all_expert, mx_name, bias),
                atol=1e-5, rtol=5e-2, source=SRC_TKG + "_mx" + _PADDING, target="trn3", lnc=2,
                env={"NKISIM_UNINIT": "zero"})


CASES += [
    _tkg_mx(1, 512, 64, 128, 2, "Swish", False),
    _tkg_mx(4, 3072, 192, 128, 4, "Swish", False),
    _tkg_mx(128, 3072, 192, 1, None, "Swish", True),
    _tkg_mx(128, 3072, 96, 1, None, "Swish", True),
]
