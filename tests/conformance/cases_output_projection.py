"""core/output_projection: output_projection_tkg and output_projection_cte on shapes of the library's tests.

TKG: test/integration/nkilib/core/output_projection/test_output_proj_tkg.py::test_output_proj_tkg_unit — bf16
attention [d, B, N, S] and weight [N*d, H] (Gaussian; for STATIC/ROW uniform in [-1, 1) with fp8 weights scaled to
the fp8 range by one / per-column scale), bias ~ N(0, 100); CompilerArgs() = trn2, LNC=2; atol 1e-5, rtol 2e-2
(5e-2 when quantized).
CTE: test_output_proj_cte.py::test_output_proj_cte_bf16_unit / _static_fp8_unit — attention [B, N, d, S] and
weights uniform [0, 1) (fp8 weights uniform over the fp8 range with scales in [0, 1/256)); the tests take the
platform from the command line (trn2 and trn3), LNC=2; atol 1e-5, rtol 2e-2 (bf16) / 0.036 (static fp8); MXFP4
weights on trn3 (the library's MX test excludes trn1/trn2).
"""

import ml_dtypes
import numpy as np

from bench.peers import nkilib

from .harness import Case

OP = "test/integration/nkilib/core/output_projection"
BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3


def _quant(name):
    return getattr(nkilib.load("core.utils.common_types").QuantizationType, name)


def _tkg(b, n_heads, s, d_head, h, quant, bias, transpose_out):
    def inputs():
        rng = np.random.default_rng(0)
        if quant == "NONE":
            attention = rng.normal(size=(d_head, b, n_heads, s)).astype(BF16)
            weight = rng.normal(size=(d_head * n_heads, h)).astype(BF16)
            w_scale = in_scale = None
        else:
            attention = (2 * rng.random((d_head, b, n_heads, s)) - 1).astype(BF16)
            wf = (2 * rng.random((d_head * n_heads, h)) - 1).astype(BF16).astype(np.float32)
            if quant == "STATIC":
                scale = np.abs(wf).max() / 240.0
                w_scale = np.full((128, 1), scale, np.float32)
                peak = float(np.abs(attention.astype(np.float32)).max())
                in_scale = np.full((128, 1), peak / 240.0 * rng.uniform(0.995, 1.005), np.float32)
            else:
                scale = np.abs(wf).max(axis=0, keepdims=True) / 240.0
                w_scale = np.broadcast_to(scale, (128, h)).astype(np.float32)
                in_scale = None
            weight = (wf / scale).astype(FP8)
        return {"attention": attention, "weight": weight,
                "bias": (100 * rng.normal(size=(1, h))).astype(BF16) if bias else None,
                "quantization_type": _quant(quant), "weight_scale": w_scale, "input_scale": in_scale,
                "TRANSPOSE_OUT": transpose_out, "OUT_IN_SB": False}

    shape = (f"b{b}_nh{n_heads}_s{s}_dh{d_head}_h{h}_{quant.lower()}{'_bias' if bias else ''}"
             f"{'_tp' if transpose_out else ''}")
    return Case("core.output_projection.output_projection_tkg:output_projection_tkg",
                "core.output_projection.output_projection_tkg_torch:output_projection_tkg_torch_ref", shape, inputs,
                atol=1e-5, rtol=2e-2 if quant == "NONE" else 5e-2,
                source=f"{OP}/test_output_proj_tkg.py::test_output_proj_tkg_unit", lnc=2)


def _cte(b, s, h, n_head, d_head, bias, quant, target):
    def inputs():
        rng = np.random.default_rng(0)
        attention = rng.random((b, n_head, d_head, s)).astype(BF16)
        w_scale = in_scale = None
        if quant == "NONE":
            weight = rng.random((n_head * d_head, h)).astype(BF16)
        else:
            weight = (rng.random((n_head * d_head, h)) * 480.0 - 240.0).astype(FP8)
            w_scale = np.full((128, 1), rng.random() / 256.0, np.float32)
            in_scale = np.full((128, 1), rng.random() / 256.0, np.float32)
        return {"attention": attention, "weight": weight,
                "bias": (100 * rng.normal(size=(1, h))).astype(BF16) if bias else None,
                "quantization_type": _quant(quant), "input_scales": in_scale, "weight_scales": w_scale}

    test = "test_output_proj_cte_bf16_unit" if quant == "NONE" else "test_output_proj_cte_static_fp8_unit"
    return Case("core.output_projection.output_projection_cte:output_projection_cte",
                "core.output_projection.output_projection_cte.output_projection_cte_torch:"
                "output_projection_cte_torch_ref",
                f"b{b}_s{s}_h{h}_nh{n_head}_dh{d_head}_{quant.lower()}{'_bias' if bias else ''}", inputs,
                atol=1e-5, rtol=2e-2 if quant == "NONE" else 0.036, source=f"{OP}/test_output_proj_cte.py::{test}",
                lnc=2, target=target)


CASES = [
    _tkg(4, 8, 4, 32, 3072, "NONE", True, True),
    _tkg(4, 8, 4, 64, 5378, "NONE", False, False),
    _tkg(4, 2, 4, 64, 7168, "NONE", False, True),
    _tkg(4, 8, 4, 64, 3072, "NONE", True, False),
    _tkg(16, 8, 1, 128, 8192, "STATIC", True, True),
    _tkg(32, 8, 3, 128, 3072, "STATIC", False, False),
    _tkg(16, 8, 1, 128, 3072, "ROW", True, False),
    _tkg(128, 8, 1, 128, 3072, "ROW", True, True),
] + [c for t in ("trn2", "trn3") for c in (
    _cte(1, 16, 5120, 10, 128, True, "NONE", t),
    _cte(1, 128, 3072, 16, 10, True, "NONE", t),
    _cte(1, 512, 8192, 1, 128, False, "NONE", t),
    _cte(4, 256, 7168, 1, 128, False, "NONE", t),
    _cte(1, 192, 1024, 1, 128, False, "NONE", t),
    _cte(1, 128, 3072, 8, 32, True, "STATIC", t),
    _cte(1, 512, 8192, 1, 128, False, "STATIC", t),
)]


def _cte_mxfp4(b, s, h, n_head, d_head, bias):
    """test_output_proj_cte_mxfp4_unit (trn3 only): bf16 attention ~ N(0, 0.1) quantized online by the kernel, MXFP4
    weights: a float [N*d/4, 4*H] matrix in (-1, 1) through the library's quantize_to_mx (packed [N*d/4, H] words,
    scales [N*d/32, H]); reference output_projection_cte_mx_torch_ref; atol 1e-5, rtol 5e-2."""
    def inputs():
        import nki.language as nl
        to_mx = nkilib.load("core.utils.mx_torch_common:quantize_to_mx")
        rng = np.random.default_rng(42)
        w, w_scale = to_mx(rng.uniform(-1.0, 1.0, (n_head * d_head // 4, h * 4)).astype(np.float32),
                           nl.float4_e2m1fn_x4)
        return {"attention": (0.1 * rng.normal(size=(b, n_head, d_head, s))).astype(BF16), "weight": w,
                "bias": (100 * rng.normal(size=(1, h))).astype(BF16) if bias else None,
                "quantization_type": _quant("MX"), "input_scales": None, "weight_scales": w_scale}

    return Case("core.output_projection.output_projection_cte:output_projection_cte",
                "core.output_projection.output_projection_cte.output_projection_cte_torch:"
                "output_projection_cte_mx_torch_ref",
                f"b{b}_s{s}_h{h}_nh{n_head}_dh{d_head}_mxfp4{'_bias' if bias else ''}", inputs, atol=1e-5, rtol=5e-2,
                source=f"{OP}/test_output_proj_cte.py::test_output_proj_cte_mxfp4_unit", lnc=2, target="trn3")


CASES += [
    _cte_mxfp4(1, 128, 3072, 16, 64, True),
    _cte_mxfp4(4, 256, 7168, 1, 128, False),
]
