"""MX primitives on trn3: nisa.quantize_mx against the library's `quantize_mx_golden` (core/utils/mx_torch_common.py),
shapes/dtypes/tolerances of test/integration/nkilib/core/utils/test_quantize_to_mx.py (rtol 2e-2, atol 1e-5; the
library runs it on trn3 only). The driving kernel is ours: HBM -> SBUF, one quantize_mx, SBUF -> HBM, as the test's.

quantize_mx writes the scales of data quadrant q into partitions q*32+0..3 of the scale tile and nothing else (AWS:
"not all partitions can be filled with scale values"); the library's golden shows zeros in the other partitions of
its fresh SBUF tile. Those partitions are undefined, so the comparison takes them from the golden.
"""

import ml_dtypes
import nki.isa as nisa
import nki.language as nl
import numpy as np

from nkisim import mx

from .harness import Case

SRC_Q = "test/integration/nkilib/core/utils/test_quantize_to_mx.py::test_quantize_mx_hw"


def quantize_mx_kernel(src_hbm, out_data_hbm, out_scale_hbm):
    """Our driver of nisa.quantize_mx: the output dtype comes from out_data_hbm (as the library test's)."""
    p, f = src_hbm.shape
    src = nl.ndarray((p, f), dtype=src_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=src_hbm)
    data = nl.ndarray((p, f // 4), dtype=out_data_hbm.dtype, buffer=nl.sbuf)
    scale = nl.ndarray((p, f // 4), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.quantize_mx(dst=data, src=src, dst_scale=scale)
    nisa.dma_copy(dst=out_data_hbm, src=data)
    nisa.dma_copy(dst=out_scale_hbm, src=scale)
    return out_data_hbm, out_scale_hbm


def _defined_scale_rows(outs, gold):
    data, scale = outs
    kept = np.array(gold["out_scale_hbm"])
    rows = mx.scale_rows(kept.shape[0])
    kept[rows] = np.asarray(scale)[rows]
    return {"out_data_hbm": data, "out_scale_hbm": kept}


def _quantize_case(p, f, out_dtype, in_dtype):
    def inputs():
        rng = np.random.default_rng(42)
        return {"src_hbm": rng.standard_normal((p, f)).astype(np.float32).astype(in_dtype),
                "out_data_hbm": mx.pack(np.zeros((p, f)), out_dtype),
                "out_scale_hbm": np.zeros((p, f // 4), np.uint8)}

    return Case(quantize_mx_kernel, "core.utils.mx_torch_common:quantize_mx_golden",
                f"{p}x{f}_{out_dtype.name}_{np.dtype(in_dtype).name}", inputs, atol=1e-5, rtol=2e-2,
                source=SRC_Q, target="trn3", outputs=_defined_scale_rows)


CASES = [_quantize_case(p, f, od, idt)
         for p, f in [(128, 512), (32, 512), (64, 256), (32, 4)]
         for od, idt in [(nl.float8_e4m3fn_x4, ml_dtypes.bfloat16), (nl.float8_e5m2_x4, np.float16)]]


# ---- experimental/mxfp_subkernels: swizzled load + MXFP8 quantize of a [128, K] bf16 tensor ------------------------

SRC_LOAD = "test/integration/nkilib/experimental/mxfp_subkernels/test_mxfp_load.py::test_mxfp_load_performance"


def mxfp_load_golden(tensor):
    """Our reference for the swizzled load, from the test's documented recipe (its golden lives in a test module that
    needs AWS's metrics packages): per 512-column block, [M, 512] -> [M, 128, 4] -> [128, M * 4], quantized with the
    library's own quantize_to_mx (core/utils/mx_torch_common.py); blocks side by side; the dense [16, M] scales of a
    block go to partitions q*32 + 0..3 as quantize_mx lays them out."""
    from nkilib_src.nkilib.core.utils.mx_torch_common import quantize_to_mx
    x = tensor.detach().numpy().astype(np.float32)
    m, k = x.shape
    words, scales = [], np.zeros((128, m * (k // 512)), np.uint8)
    for b in range(k // 512):
        swizzled = x[:, b * 512:(b + 1) * 512].reshape(m, 128, 4).transpose(1, 0, 2).reshape(128, m * 4)
        data, dense = quantize_to_mx(swizzled, nl.float8_e4m3fn_x4)
        words.append(np.asarray(data).view(np.ndarray))
        scales[mx.scale_rows(128), b * m:(b + 1) * m] = dense
    return {"out_data_hbm": mx.PackedArray(np.concatenate(words, axis=1), nl.float8_e4m3fn_x4),
            "out_scale_hbm": scales}


def _load_compare(named, gold, kwargs):
    """Scales only where quantize_mx writes them (partitions q*32+0..3); the rest is memory the kernel never writes."""
    data = gold["out_data_hbm"]
    scale = np.array(gold["out_scale_hbm"])
    rows = mx.scale_rows(scale.shape[0])
    kernel_scale = np.array(scale)
    kernel_scale[rows] = np.asarray(named["out_scale_hbm"])[rows]
    return ({"out_data_hbm": named["out_data_hbm"], "out_scale_hbm": kernel_scale},
            {"out_data_hbm": data, "out_scale_hbm": scale})


def _load_case(K):
    def inputs():
        rng = np.random.default_rng(42)
        return {"tensor": rng.standard_normal((128, K)).astype(np.float32).astype(ml_dtypes.bfloat16)}

    return Case("experimental.mxfp_subkernels.mxfp_load_utils:mxfp_load_performance_wrapper", mxfp_load_golden,
                f"M128_K{K}", inputs, atol=0.0, rtol=0.0, source=SRC_LOAD, target="trn3", compare=_load_compare)


CASES += [_load_case(k) for k in (1024, 2048, 4096)]
