"""Trn3 MX ops (nisa.quantize_mx, nisa.nc_matmul_mx), the x4 packed formats and their NumPy form (nkisim.mx)."""

import ml_dtypes
import numpy as np
import pytest

import nkisim
from nkisim import mx
from nkisim.errors import NkiCapacityError, NkiValidationError

nkisim.install()
import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

from .._sim import hbm  # noqa: E402


@pytest.fixture
def target(monkeypatch):
    return lambda name: monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)


@nki.jit
def quantize_kernel(x, scale_at):
    p, f = x.shape
    src = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=src, src=x)
    data = nl.ndarray((p, f // 4), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    scale_tile = nl.ndarray((p + scale_at, f // 4), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.memset(dst=scale_tile, value=0)
    nisa.quantize_mx(dst=data, src=src, dst_scale=scale_tile[scale_at:scale_at + p, :])
    out_data = nl.ndarray((p, f // 4), dtype=nl.float8_e4m3fn_x4, buffer=nl.shared_hbm)
    out_scale = nl.ndarray((p, f // 4), dtype=nl.uint8, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out_data, src=data)
    nisa.dma_copy(dst=out_scale, src=scale_tile[scale_at:scale_at + p, :])
    return out_data, out_scale


def _grouped(p, f, values):
    """[p, f] array whose 8x4 group g (row-major over groups) holds values[g] everywhere (sign alternating)."""
    groups = np.asarray(values, np.float32).reshape(p // 8, f // 4)
    x = np.repeat(np.repeat(groups, 8, axis=0), 4, axis=1)
    return x * np.where(np.arange(f) % 2, -1.0, 1.0).astype(np.float32)


def test_quantize_mx_scales_and_data(target):
    target("trn3")
    p, f = 64, 8
    vals = np.array([3.0, 0.5, 1000.0, 1.0, 2.0 ** -10, 6.0, 448.0, 0.75, 5.0, 7.0, 9.0, 100.0, 1.5, 2.5, 12.0, 0.1])
    data, scale = quantize_kernel(_grouped(p, f, vals).astype(ml_dtypes.bfloat16), 0)
    assert isinstance(data, mx.PackedArray) and data.dtype == nl.float8_e4m3fn_x4
    # 3.0 has fp32 exponent field 128; e4m3fn's largest exponent is 8 -> scale byte 120, data 3 * 2**7 = 384
    rows = mx.scale_rows(p)
    assert scale[rows[0], 0] == 120
    expect = np.floor(np.log2(vals.astype(ml_dtypes.bfloat16).astype(np.float32))).astype(int) + 127 - 8
    assert np.array_equal(scale[rows].reshape(-1), expect)
    elems = mx.unpack(data)
    assert elems[0, 0] == 384.0 and elems[0, 1] == -384.0
    dequant = elems * np.exp2(np.repeat(np.repeat(scale[rows].astype(float), 8, 0), 4, 1) - 127)
    bf = _grouped(p, f, vals).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.allclose(dequant, bf, rtol=2 ** -3)  # e4m3: 3 mantissa bits
    # partitions outside q*32+0..3 are left as they were (memset 0 here)
    others = np.setdiff1d(np.arange(p), rows)
    assert not scale[others].any()


def test_quantize_mx_is_trn3_only(target):
    target("trn2")
    with pytest.raises(NkiValidationError, match="quantize_mx.*NeuronCore-v4"):
        quantize_kernel(np.ones((32, 8), ml_dtypes.bfloat16), 0)


def test_quantize_mx_scale_must_sit_in_first_16_partitions_of_a_quadrant(target):
    target("trn3")
    quantize_kernel(np.ones((32, 8), ml_dtypes.bfloat16), 8)      # partition 8: allowed
    with pytest.raises(NkiValidationError, match="dst_scale starts at partition 16"):
        quantize_kernel(np.ones((32, 8), ml_dtypes.bfloat16), 16)


@nki.jit
def mx_matmul_kernel(a, b, scale_dtype=nl.uint8, dst_dtype=nl.float32):
    """a [K, M], b [K, N] bf16 with K = 4 * P: quantize both on chip (scales in scale_dtype), one nc_matmul_mx into a
    dst_dtype PSUM tile -> [M, N] fp32."""
    p, m4 = a.shape
    _, n4 = b.shape
    tiles = []
    for x, f in ((a, m4), (b, n4)):
        src = nl.ndarray((p, f), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=src, src=x)
        q = nl.ndarray((p, f // 4), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        s = nl.ndarray((p, f // 4), dtype=scale_dtype, buffer=nl.sbuf)
        nisa.quantize_mx(dst=q, src=src, dst_scale=s)
        tiles.append((q, s))
    acc = nl.ndarray((m4 // 4, n4 // 4), dtype=dst_dtype, buffer=nl.psum)
    nisa.nc_matmul_mx(dst=acc, stationary=tiles[0][0], moving=tiles[1][0], stationary_scale=tiles[0][1],
                      moving_scale=tiles[1][1])
    res = nl.ndarray(acc.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc)
    out = nl.ndarray(acc.shape, dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=res)
    return out


def _dequantized(x):
    words, scales = mx.quantize(x.astype(np.float32), nl.float8_e4m3fn_x4)
    elems = mx.decode(words, nl.float8_e4m3fn_x4)
    return elems * np.exp2(np.repeat(np.repeat(scales.astype(float), 8, 0), 4, 1) - 127)


def test_nc_matmul_mx_contracts_partitions_and_x4_lanes(target):
    target("trn3")
    rng = np.random.default_rng(0)
    p, m, n = 64, 32, 16
    a = rng.standard_normal((p, 4 * m)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((p, 4 * n)).astype(ml_dtypes.bfloat16)
    out = mx_matmul_kernel(a, b)
    # logical operands: element (k, i, q) of the x4 layout is row k*4+q of a [4P, M] matrix
    da = _dequantized(a).reshape(p, m, 4).transpose(0, 2, 1).reshape(4 * p, m)
    db = _dequantized(b).reshape(p, n, 4).transpose(0, 2, 1).reshape(4 * p, n)
    assert np.allclose(out, da.T @ db, rtol=1e-5, atol=1e-4)
    exact = (a.astype(np.float32).reshape(p, m, 4).transpose(0, 2, 1).reshape(4 * p, m).T
             @ b.astype(np.float32).reshape(p, n, 4).transpose(0, 2, 1).reshape(4 * p, n))
    assert np.abs(out - exact).max() < 0.1 * np.abs(exact).max()  # MXFP8 error, not a scrambled contraction


def test_nc_matmul_mx_is_trn3_only(target):
    target("trn2")
    with pytest.raises(NkiValidationError, match="NeuronCore-v4"):
        mx_matmul_kernel(np.ones((32, 8), ml_dtypes.bfloat16), np.ones((32, 8), ml_dtypes.bfloat16))


@nki.jit
def fp8_matmul_mx_kernel(a):
    p, m = a.shape
    t = nl.ndarray((p, m), dtype=nl.float8_e4m3fn, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    s = nl.ndarray((p, m), dtype=nl.uint8, buffer=nl.sbuf)
    nisa.memset(dst=s, value=127)
    acc = nl.ndarray((m, m), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(dst=acc, stationary=t, moving=t, stationary_scale=s, moving_scale=s)
    return a


def test_nc_matmul_mx_needs_packed_data(target):
    target("trn3")
    with pytest.raises(NkiValidationError, match="stationary dtype must be one of float8_e5m2_x4"):
        fp8_matmul_mx_kernel(np.ones((32, 4), ml_dtypes.float8_e4m3fn))


@nki.jit
def copy_packed_kernel(x, out):
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_packed_arrays_cross_the_kernel_boundary_and_in_place_outputs_return():
    x = mx.pack(np.arange(-8, 8, dtype=np.float32).reshape(2, 8) / 2, nl.float4_e2m1fn_x4)
    out = mx.pack(np.zeros((2, 8)), nl.float4_e2m1fn_x4)
    res = copy_packed_kernel(x, out)          # returning an argument written in place is allowed
    assert res.dtype == nl.float4_e2m1fn_x4 and out.dtype == nl.float4_e2m1fn_x4
    assert np.array_equal(mx.unpack(res), mx.unpack(x)) and np.array_equal(mx.unpack(out), mx.unpack(x))


def test_packed_array_views_keep_or_drop_the_tag():
    a = mx.pack(np.ones((2, 8)), nl.float8_e5m2_x4)
    assert a.dtype == nl.float8_e5m2_x4 and a[0:1].dtype == nl.float8_e5m2_x4
    assert a.view(np.uint8).dtype == np.uint8 and a.astype(np.int64).dtype == np.int64
    assert mx.unpack(a).tolist() == np.ones((2, 8)).tolist()


def test_fp4_encoding_rounds_half_to_even_and_saturates():
    vals = np.array([0.25, 0.75, 1.25, 2.5, 5.0, 7.0, -100.0, -0.0], np.float32)
    assert mx.decode(mx.encode(vals, nl.float4_e2m1fn_x4), nl.float4_e2m1fn_x4).tolist() == \
        [0.0, 1.0, 1.0, 2.0, 4.0, 6.0, -6.0, -0.0]


def test_neuron_dtypes_static_cast():
    from nkisim import neuron_dtypes
    x = np.array([[1.0, 2.0, 3.0, 1.00390625]], np.float32)
    assert neuron_dtypes.static_cast(x, nl.bfloat16).dtype == ml_dtypes.bfloat16
    assert neuron_dtypes.static_cast(x, nl.bfloat16)[0, 3] == 1.0        # round to nearest even
    packed = neuron_dtypes.static_cast(x, nl.float8_e4m3fn_x4)
    assert packed.dtype == nl.float8_e4m3fn_x4 and packed.shape == (1, 1)
    assert mx.unpack(packed).tolist() == [[1.0, 2.0, 3.0, 1.0]]


def test_neuron_dtypes_static_cast_expands_packed_input():
    from nkisim import neuron_dtypes
    packed = mx.pack(np.array([[0.5, -1.0, 6.0, 0.0, 1.5, 2.0, -3.0, 4.0]], np.float32), nl.float4_e2m1fn_x4)
    out = neuron_dtypes.static_cast(packed, np.float32)
    assert out.dtype == np.float32 and out.tolist() == [[0.5, -1.0, 6.0, 0.0, 1.5, 2.0, -3.0, 4.0]]
    with pytest.raises(TypeError, match="unpack to a float dtype first"):
        neuron_dtypes.static_cast(packed, nl.float8_e4m3fn_x4)


def test_memset_packed_tile_with_float_zero():
    from nkisim.runtime import CoreContext, set_current
    prev = set_current(CoreContext())
    try:
        t = nl.ndarray((2, 4), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)   # the library zeroes MX weight padding with 0.0
        assert not np.asarray(nkisim.tensor.read(t)).any()
        with pytest.raises(NkiValidationError, match="only supports value=0"):
            nisa.memset(dst=t, value=1.0)
    finally:
        set_current(prev)


# ---- C33: MX ops take float8_e8m0fnu scales and the 8-bank moving size of the 2.32 pages ---------------------------

def test_c33_mx_scales_may_be_float8_e8m0fnu(target):
    target("trn3")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((32, 64)).astype(np.float32)
    b = rng.standard_normal((32, 32)).astype(np.float32)
    ab, bb = hbm(a, nl.bfloat16), hbm(b, nl.bfloat16)
    ref = mx_matmul_kernel(ab, bb, nl.uint8, nl.float32)
    np.testing.assert_array_equal(mx_matmul_kernel(ab, bb, nl.float8_e8m0fnu, nl.float32), ref)
    with pytest.raises(NkiValidationError, match=r"(stationary_scale|dst_scale) dtype must be float8_e8m0fnu or "
                                                  r"uint8, got int8 \(C33\)"):
        mx_matmul_kernel(ab, bb, nl.int8, nl.float32)


def test_c33_mx_moving_free_size_is_the_8_psum_banks(target):
    target("trn3")
    a = hbm(np.ones((32, 8), np.float32), nl.bfloat16)
    out = mx_matmul_kernel(a, hbm(np.ones((32, 4 * 2048), np.float32), nl.bfloat16), nl.uint8, nl.float32)
    np.testing.assert_allclose(out, 128.0)           # N = 2048 > the old 512 limit; K = 4 * 32
    # one more column than the 8 banks hold: the fp32 dst itself no longer fits PSUM
    with pytest.raises(NkiCapacityError, match=r"needs 16388 B/partition > PSUM size 16384 B \(C6\)"):
        mx_matmul_kernel(a, hbm(np.ones((32, 4 * 4097), np.float32), nl.bfloat16), nl.uint8, nl.float32)
