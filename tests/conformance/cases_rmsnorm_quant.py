"""core/rmsnorm rmsnorm_quant_kernel on shapes of test/integration/nkilib/core/rmsnorm/test_rmsnorm_quant.py.

That test keeps its reference in the test file (a NumPy RMSNorm + FP8 row/static quantization) and checks the raw
output with a custom validator: the first H fp8 values of each row against the reference (max mode, rtol 0.072),
and for row quantization the trailing 4 bytes, read as one fp32 dequantization scale, against the reference scale
(rtol 0.007); atol is maxAllClose's default 1e-8. `_reference` below is ours, written from that description.
Shapes: test_rmsnorm_quant_lnc_unit (bf16 Gaussian, LNC=2) and test_rmsnorm_quant_vnc_unit (fp16 uniform(0, 10)).
"""

import ml_dtypes
import numpy as np

from bench.peers import nkilib

from .harness import Case

SOURCE = "test/integration/nkilib/core/rmsnorm/test_rmsnorm_quant.py"
FP8_MAX = 240.0  # Neuron float8_e4m3 range


def _np(t):
    return None if t is None else t.detach().cpu().numpy().astype(np.float32)


def _reference(hidden, ln_w, kargs, input_dequant_scale=None):
    """RMSNorm (unless NO_NORM) then FP8 quantization: per row by max|x| (optionally clipped to lower_bound), or
    by a static dequantization scale."""
    common = nkilib.load("core.utils.common_types")
    x, gamma = _np(hidden), _np(ln_w).reshape(-1)
    if kargs.norm_type != common.NormType.NO_NORM:
        rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
        x = x / (rms + kargs.eps) * gamma
    if kargs.quantization_type == common.QuantizationType.ROW:
        peak = np.abs(x).max(axis=-1, keepdims=True)
        if kargs.lower_bound > 0:
            peak = np.minimum(peak, kargs.lower_bound)
            x = np.clip(x, -kargs.lower_bound, kargs.lower_bound)
        scale = (peak / FP8_MAX).astype(np.float32)
        return {"values": (x / scale).astype(ml_dtypes.float8_e4m3).astype(np.float32), "scale": scale}
    q = np.clip(x / _np(input_dequant_scale)[0, 0], -FP8_MAX, FP8_MAX)
    return {"values": q.astype(ml_dtypes.float8_e4m3).astype(np.float32)}


def _split(h):
    def outputs(out, gold):
        raw = np.ascontiguousarray(np.asarray(out)).view(np.uint8)
        raw = raw.reshape(*raw.shape[:2], -1)
        named = {"values": raw[:, :, :h].view(ml_dtypes.float8_e4m3).astype(np.float32)}
        if "scale" in gold:
            named["scale"] = np.ascontiguousarray(raw[:, :, h:h + 4]).view(np.float32)
        return named
    return outputs


def _case(kind, seqlen, quant_only, row, lower_bound, lnc, hidden, fp16_uniform=False):
    def inputs():
        common = nkilib.load("core.utils.common_types")
        args = nkilib.load("core.rmsnorm.rmsnorm_quant:RmsNormQuantKernelArgs")
        rng = np.random.default_rng(0)
        dtype = np.float16 if fp16_uniform else ml_dtypes.bfloat16

        def gen(shape):
            return (rng.uniform(0, 10, shape) if fp16_uniform else rng.normal(size=shape)).astype(dtype)

        kw = {"hidden": gen((1, seqlen, hidden)), "ln_w": gen((1, hidden) if lnc > 1 else (hidden,)),
              "kargs": args(quantization_type=common.QuantizationType.ROW if row else common.QuantizationType.STATIC,
                            lower_bound=lower_bound,
                            norm_type=common.NormType.NO_NORM if quant_only else common.NormType.RMS_NORM, eps=1e-6)}
        if not row:
            kw["input_dequant_scale"] = np.full((128, 1), rng.normal(loc=0.5, scale=0.1), np.float32)
        return kw

    shape = (f"s{seqlen}_h{hidden}_{'row' if row else 'static'}{'_quantonly' if quant_only else ''}"
             f"{f'_lb{lower_bound}' if lower_bound else ''}{'_fp16' if fp16_uniform else ''}")
    return Case("core.rmsnorm.rmsnorm_quant:rmsnorm_quant_kernel", _reference, shape, inputs, atol=1e-8, rtol=0.072,
                source=f"{SOURCE}::{kind}", lnc=lnc, outputs=_split(hidden), tols={"scale": (1e-8, 0.007)})


LNC_UNIT = "test_rmsnorm_quant_lnc_unit"
VNC_UNIT = "test_rmsnorm_quant_vnc_unit"
CASES = [
    _case(LNC_UNIT, 2, True, True, 0.0, 2, 16384),
    _case(LNC_UNIT, 2, False, True, 0.5, 2, 16384),
    _case(LNC_UNIT, 160, False, True, 0.0, 2, 16384),
    _case(LNC_UNIT, 2, True, False, 0.0, 2, 16384),
    _case(LNC_UNIT, 160, False, False, 0.0, 2, 16384),
    _case(VNC_UNIT, 128, False, True, 0.0, 1, 16384, fp16_uniform=True),
    _case(VNC_UNIT, 256, False, True, 0.0, 2, 8192, fp16_uniform=True),
]
