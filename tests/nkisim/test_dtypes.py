"""Data types (§3.1), engine numerics (§7: fp32 math, cast on write, RNE, saturation), NKI_PRECISE_FP, sentinels,
and the compile target (nl.tile_size, NEURON_PLATFORM_TARGET_OVERRIDE, nisa.get_nc_version)."""

import ml_dtypes
import nki
import numpy as np
import pytest

from nkisim import dtypes as dt
from nkisim.errors import NkiValidationError
from nkisim.runtime import set_current

from ._sim import fresh_core, hbm, nisa, nl, on_target, rd, ref_cast, sb, tile  # noqa: F401

BF16 = ml_dtypes.bfloat16

# name -> (storage dtype, kind)
DTYPES = {
    "bool_": (np.uint8, "bool"), "int8": (np.int8, "int"), "int16": (np.int16, "int"), "int32": (np.int32, "int"),
    "uint8": (np.uint8, "int"), "uint16": (np.uint16, "int"), "uint32": (np.uint32, "int"),
    "float16": (np.float16, "float"), "bfloat16": (BF16, "float"), "tfloat32": (np.float32, "float"),
    "float32": (np.float32, "float"), "float8_e4m3": (ml_dtypes.float8_e4m3, "float"),
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, "float"), "float8_e5m2": (ml_dtypes.float8_e5m2, "float"),
    "float8_e8m0fnu": (ml_dtypes.float8_e8m0fnu, "float"), "float8_e4m3fn_x4": (np.uint32, "packed"),
    "float8_e5m2_x4": (np.uint32, "packed"), "float4_e2m1fn_x4": (np.uint16, "packed"),
}


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_exists_with_its_storage(name):
    d = getattr(nl, name)
    storage, kind = DTYPES[name]
    assert d.name == name and d.kind == kind
    assert d.storage == np.dtype(storage)
    t = nl.ndarray((2, 4), d, buffer=nl.sbuf)
    assert rd(t).dtype == np.dtype(storage) and t.dtype == d
    assert t.itemsize == np.dtype(storage).itemsize


def test_fp8_ranges():
    assert nl.float8_e4m3.max == 240.0
    assert nl.float8_e4m3fn.max == 448.0
    assert nl.float8_e5m2.max == 57344.0


def test_as_dtype_mappings():
    assert dt.as_dtype(np.float32) is nl.float32
    assert dt.as_dtype(BF16) is nl.bfloat16
    assert dt.as_dtype(np.dtype(np.bool_)) is nl.bool_
    assert dt.as_dtype(ml_dtypes.float8_e5m2) is nl.float8_e5m2
    assert nl.bfloat16 == BF16 and nl.float32 == "float32" and nl.tfloat32 != np.float32
    torch = pytest.importorskip("torch")
    assert dt.as_dtype(torch.bfloat16) is nl.bfloat16
    assert dt.as_dtype(torch.float8_e4m3fn) is nl.float8_e4m3fn
    assert dt.as_dtype(np.int64) is nl.int64 and dt.as_dtype(torch.int64) is nl.int64   # NKI 0.7 nl.int64
    for bad in (np.float64, np.uint64, torch.float64):
        with pytest.raises(TypeError, match=r"64-bit"):
            dt.as_dtype(bad)


# ---- cast on write: RNE, saturation ---------------------------------------------------------------------------------

def _f32_bits(bits):
    return np.array(bits, np.uint32).view(np.float32)


def test_bf16_round_to_nearest_even_ties():
    one = 0x3F800000
    # 1 + half ulp (ties to even: down), 1 + 3 half ulps (ties to even: up), just above a tie (up)
    x = _f32_bits([one | 0x8000, one | 0x18000, one | 0x8001, 0xBF808000])
    got = dt.cast(x, nl.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), [0x3F80, 0x3F82, 0x3F81, 0xBF80])
    t = tile((1, 4), nl.bfloat16)
    nisa.dma_copy(dst=t, src=hbm(x.reshape(1, 4)))
    np.testing.assert_array_equal(rd(t).view(np.uint16), [[0x3F80, 0x3F82, 0x3F81, 0xBF80]])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_fp16_and_tf32_rne():
    x = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65520.0], np.float32)
    np.testing.assert_array_equal(dt.cast(x, nl.float16), np.array([1.0, 1 + 2.0 ** -9, np.inf], np.float16))
    tf = dt.cast(x, nl.tfloat32)
    assert tf.dtype == np.float32
    np.testing.assert_array_equal(tf, [1.0, 1 + 2.0 ** -9, 65536.0])


@pytest.mark.parametrize("d,vals,want", [
    (nl.int8, [2.5, 3.5, -2.5, -0.5, 127.5, 300.0, -300.0, np.nan, np.inf, -np.inf],
     [2, 4, -2, 0, 127, 127, -128, 0, 127, -128]),
    (nl.uint8, [-5.0, 255.5, 254.5, np.nan, 1e10], [0, 255, 254, 0, 255]),
    (nl.int32, [3e9, -3e9, 2.0 ** 31, np.nan], [2 ** 31 - 1, -(2 ** 31), 2 ** 31 - 1, 0]),
    (nl.uint16, [65535.4, 70000.0, -1.0], [65535, 65535, 0]),
    (nl.int16, [-32768.6, 1.5], [-32768, 2]),
])
def test_float_to_int_rounds_half_even_and_saturates(d, vals, want):
    x = np.array(vals, np.float32)
    np.testing.assert_array_equal(dt.cast(x, d), np.array(want, d.np))
    t = tile((1, len(vals)), d)
    nisa.tensor_copy(dst=t, src=sb(x.reshape(1, -1)))
    np.testing.assert_array_equal(rd(t), np.array([want], d.np))


def test_int_to_int_saturates_and_bool():
    np.testing.assert_array_equal(dt.cast(np.array([300, -300, 5], np.int32), nl.int8), [127, -128, 5])
    np.testing.assert_array_equal(dt.cast(np.array([0.0, 2.0, -0.5, np.nan], np.float32), nl.bool_), [0, 1, 1, 1])


def test_engine_math_is_fp32_with_one_cast_on_write():
    # bf16 in, bf16 out: (x * 3) + 1 is computed in fp32 and rounded once (not rounded after the multiply)
    x = np.array([[1.03125, 1.0703125, 1.1171875]], np.float32)  # exactly representable in bf16
    d = tile((1, 3), nl.bfloat16)
    nisa.tensor_scalar(dst=d, data=sb(x, nl.bfloat16), op0=nl.multiply, operand0=1.1, op1=nl.add, operand1=1.0)
    np.testing.assert_array_equal(rd(d), (x * np.float32(1.1) + np.float32(1)).astype(BF16))
    twice = ((x * np.float32(1.1)).astype(BF16).astype(np.float32) + 1).astype(BF16)
    assert (twice != (x * np.float32(1.1) + np.float32(1)).astype(BF16)).any()  # the test can tell them apart
    fp16 = tile((1, 3), nl.float16)
    nisa.tensor_tensor(dst=fp16, data1=sb(x, nl.bfloat16), data2=sb(x, nl.float16), op=nl.add)
    np.testing.assert_array_equal(rd(fp16), (x.astype(BF16).astype(np.float32) + x.astype(np.float16)
                                             .astype(np.float32)).astype(np.float16))


def test_int_engine_math_via_fp32():
    x = np.array([[7, -7, 100]], np.int32)
    d = tile((1, 3), nl.int8)
    nisa.tensor_scalar(dst=d, data=sb(x), op0=nl.divide, operand0=2.0)
    np.testing.assert_array_equal(rd(d), [[4, -4, 50]])  # 3.5 -> 4, -3.5 -> -4 (half to even)
    nisa.tensor_scalar(dst=d, data=sb(x), op0=nl.multiply, operand0=2.0)
    np.testing.assert_array_equal(rd(d), [[14, -14, 127]])


def test_fp8_casts_use_ml_dtypes_rne():
    x = np.array([[0.3, 17.0, 239.0, -1.1]], np.float32)
    for d, np_d in ((nl.float8_e4m3, ml_dtypes.float8_e4m3), (nl.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
                    (nl.float8_e5m2, ml_dtypes.float8_e5m2)):
        t = tile((1, 4), d)
        nisa.tensor_copy(dst=t, src=sb(x))
        np.testing.assert_array_equal(rd(t).view(np.uint8), x.astype(np_d).view(np.uint8))


def test_packed_dtypes_hold_raw_words():
    with pytest.raises(TypeError, match=r"raw words"):
        dt.cast(np.array([1.5], np.float32), nl.float8_e4m3fn_x4)
    np.testing.assert_array_equal(dt.cast(np.array([0x01020304]), nl.float8_e4m3fn_x4), [0x01020304])


# ---- NKI_PRECISE_FP=0 ------------------------------------------------------------------------------------------------

def test_precise_fp_off_stores_low_precision_as_fp32(monkeypatch):
    monkeypatch.setenv("NKI_PRECISE_FP", "0")
    x = np.array([[1.0 + 2.0 ** -12, 3.14159]], np.float32)
    t = tile((1, 2), nl.bfloat16)
    assert rd(t).dtype == np.float32 and t.dtype == nl.bfloat16
    nisa.dma_copy(dst=t, src=hbm(x))
    np.testing.assert_array_equal(rd(t), x)  # no bf16 rounding
    i = tile((1, 2), nl.int8)
    assert rd(i).dtype == np.int8  # only low-precision floats change
    with pytest.raises(NkiValidationError, match=r"NKI_PRECISE_FP=0"):
        t.view(nl.int16)


def test_precise_fp_off_kernel_outputs_keep_declared_dtype(monkeypatch):
    monkeypatch.setenv("NKI_PRECISE_FP", "0")

    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out

    out = k(np.array([[1.0 + 2.0 ** -12, 2.0]], np.float32))
    assert out.dtype == BF16


def test_precise_fp_default_rounds():
    t = tile((1, 1), nl.bfloat16)
    nisa.dma_copy(dst=t, src=hbm(np.array([[1.0 + 2.0 ** -12]], np.float32)))
    assert rd(t).dtype == BF16 and float(rd(t)[0, 0]) == 1.0


# ---- sentinel fill ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [nl.float32, nl.bfloat16, nl.float16, nl.float8_e5m2, nl.tfloat32])
def test_new_float_allocations_are_nan(d):
    for buf in (nl.sbuf, nl.psum, nl.shared_hbm):
        assert np.isnan(rd(nl.ndarray((2, 3), d, buffer=buf)).astype(np.float32)).all()


@pytest.mark.parametrize("d", [nl.int8, nl.uint8, nl.int16, nl.uint16, nl.int32, nl.uint32])
def test_new_int_allocations_are_four(d):
    assert (rd(nl.ndarray((2, 3), d, buffer=nl.sbuf)) == 4).all()


def test_uninitialised_sbuf_read_shows_nan_in_kernel_output():
    @nki.jit
    def k(x):
        t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:2, :], src=x[0:2, :])
        y = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.exp, data=t)
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=y)
        return out

    out = k(np.zeros((4, 4), np.float32))
    assert (out[0:2] == 1).all() and np.isnan(out[2:]).all()


# ---- target ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,sbuf,version", [("trn1", 180224, 2), ("trn2", 212984, 3), ("trn3", 245752, 4),
                                               ("gen3", 212984, 3), ("gen4", 245752, 4)])
def test_tile_size_per_target(on_target, name, sbuf, version):  # noqa: F811
    on_target(name)
    ts = nl.tile_size
    assert (ts.pmax, ts.gemm_stationary_fmax, ts.gemm_moving_fmax, ts.bn_stats_fmax) == (128, 128, 512, 512)
    assert (ts.psum_fmax, ts.psum_bank_fmax, ts.psum_bank_fmax_bytes, ts.psum_num_banks) == (512, 512, 2048, 8)
    assert ts.sbuf_fmax_bytes == sbuf and ts.total_available_sbuf_size == sbuf and ts.sbuf_fmax == sbuf // 4
    assert ts.sbuf_size_bytes % 128 == 0 and ts.sbuf_size_bytes > 128 * sbuf
    assert nisa.get_nc_version() == nisa.nc_version(version)


def test_psum_num_banks_reserved_for_pe_transposes(on_target, monkeypatch):  # noqa: F811
    monkeypatch.setenv("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "true")
    assert nl.tile_size.psum_num_banks == 7
    on_target("trn1")
    assert nl.tile_size.psum_num_banks == 8


def test_default_target_is_trn2(monkeypatch):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    set_current(None)  # the outside-kernel default core
    assert nisa.get_nc_version() is nisa.nc_version.gen3
    assert nl.tile_size.sbuf_fmax_bytes == 212984


def test_default_core_follows_env_changes(monkeypatch):
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    set_current(None)
    assert nisa.get_nc_version() is nisa.nc_version.gen3
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    assert nisa.get_nc_version() is nisa.nc_version.gen4


def test_unknown_target_rejected(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn9")
    with pytest.raises(ValueError, match=r"trn9"):
        set_current(None)
        nisa.get_nc_version()


def test_kernel_resolves_target_at_call_time(monkeypatch):
    @nki.jit
    def k(x):
        out = nl.ndarray((1, 2), nl.int32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t[:, 0:1], value=nisa.get_nc_version().value)
        nisa.memset(dst=t[:, 1:2], value=nl.tile_size.sbuf_fmax_bytes)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = np.zeros((1, 1), np.float32)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    np.testing.assert_array_equal(k(x), [[3, 212984]])
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    np.testing.assert_array_equal(k(x), [[4, 245752]])
    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE")
    np.testing.assert_array_equal(k(x), [[3, 212984]])


# ---- host fast paths: allocation fill through an unsigned view, bf16 -> fp32 by integer widening ------------------

def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


@pytest.mark.parametrize("precise", ["1", "0"])
@pytest.mark.parametrize("uninit", ["nan", "zero"])
@pytest.mark.parametrize("d", dt.ALL, ids=lambda d: d.name)
def test_filled_is_np_full_of_the_sentinel_bit_for_bit(d, uninit, precise, monkeypatch):
    monkeypatch.setenv("NKISIM_UNINIT", uninit)
    monkeypatch.setenv("NKI_PRECISE_FP", precise)
    for n in (0, 1, 4097):
        got = dt.filled(n, d)
        want = np.full(n, dt.sentinel(d), dtype=dt.storage_dtype(d))
        assert got.dtype == want.dtype and got.shape == (n,)
        np.testing.assert_array_equal(_bits(got), _bits(want))
    if d.kind == "float" and uninit == "nan":
        assert np.isnan(got.astype(np.float32)).all()
    elif d.kind == "float":
        if d is not nl.float8_e8m0fnu:     # e8m0 (a pure power of two) has no zero: NumPy's cast gives NaN
            assert (got.astype(np.float32) == 0).all()
    else:
        assert (got == (0 if uninit == "zero" else 4)).all()
    other = dt.filled(4097, d)
    assert not np.shares_memory(got, other)


def test_filled_follows_the_uninit_mode_changed_in_process(monkeypatch):
    """The cached fill patterns are keyed by the fill value: switching NKISIM_UNINIT back and forth is seen."""
    for mode, f, i in (("nan", None, 4), ("zero", 0.0, 0), ("nan", None, 4), ("zero", 0.0, 0)):
        monkeypatch.setenv("NKISIM_UNINIT", mode)
        for d in (nl.float32, nl.bfloat16, nl.float8_e4m3):
            v = dt.filled(16, d).astype(np.float32)
            assert (np.isnan(v).all() if f is None else (v == 0).all() and not np.signbit(v).any()), (mode, d)
        assert (dt.filled(16, nl.int32) == i).all() and (dt.filled(16, nl.uint8) == i).all()


@pytest.mark.parametrize("d", [d for d in dt.ALL if d.kind != "packed"], ids=lambda d: d.name)
def test_new_allocations_of_every_dtype_hold_the_sentinel_pattern(d):
    want = _bits(np.full(6, dt.sentinel(d), dtype=dt.storage_dtype(d))).reshape(2, 3)
    for buf in (nl.sbuf, nl.psum, nl.shared_hbm):
        np.testing.assert_array_equal(_bits(rd(nl.ndarray((2, 3), d, buffer=buf))), want)
    # an explicitly placed PSUM tile gets its (shared) storage from the pool's alias table
    np.testing.assert_array_equal(_bits(rd(nl.ndarray((2, 3), d, buffer=nl.psum, address=(0, 2048)))), want)


# Integer fills round half to even, NaN -> 0, saturate, in SBUF and in HBM alike (3.5 -> 4 and -2.7 -> -3 tell
# that apart from int()'s truncation, which the on-chip fill once used).
_FULL_CASES = [(d, v) for d in dt.ALL if d.kind in ("int", "float") and d is not nl.int64
               for v in (-3, -0.0, float("nan"), -2.0 ** 100, 2.5) + ((3.5, -2.7) if d.kind == "int" else ())]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("buf", [nl.sbuf, nl.shared_hbm], ids=["sbuf", "hbm"])
@pytest.mark.parametrize("d,value", _FULL_CASES, ids=[f"{d.name}-{v}" for d, v in _FULL_CASES])
def test_full_of_negative_and_nan_values(d, value, buf):
    """nl.full (memset on chip, a cast in HBM) over fresh sentinel-filled storage: the value cast to the dtype."""
    got = rd(nl.full((2, 3), value, d, buffer=buf))
    if d is nl.tfloat32:
        want = np.full((2, 3), value, np.float32)          # every value here is exact in tf32
    elif d.kind == "float":
        with np.errstate(all="ignore"):
            want = np.full((2, 3), value, np.float32).astype(d.np)
    else:
        want = ref_cast(np.full((2, 3), value), d)
    np.testing.assert_array_equal(_bits(got), _bits(want))


ALL_BF16 = np.arange(65536, dtype=np.uint16).view(BF16)


def _widened(a):
    """Independent reference of bf16 -> fp32: the 16 bits as the high half of the fp32 word."""
    return (np.asarray(a).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def test_to_fp32_widens_every_bf16_pattern_exactly():
    """NaNs (both signs, quiet and signalling payloads), infinities, subnormals and -0 keep their bits."""
    got = dt.to_fp32(ALL_BF16)
    assert got.dtype == np.float32 and got.shape == ALL_BF16.shape
    np.testing.assert_array_equal(_bits(got), _bits(_widened(ALL_BF16)))
    np.testing.assert_array_equal(_bits(got), _bits(ALL_BF16.astype(np.float32)))   # = ml_dtypes' astype


class _Sub(np.ndarray):
    pass


def _layouts():
    sq = ALL_BF16.reshape(256, 256)
    ro = sq.copy()
    ro.flags.writeable = False
    return {
        "transposed": sq.T, "reversed": sq[::-1, ::-2], "broadcast": np.broadcast_to(sq[:1], (64, 256)),
        "3d": ALL_BF16.reshape(16, 64, 64).transpose(1, 0, 2), "column_slice": sq[:, 3:200],
        "below_threshold": ALL_BF16[:4095], "at_threshold": ALL_BF16[7:4103], "small": sq[:3, :5],
        "read_only": ro, "subclass": sq.view(_Sub), "scalar_like": ALL_BF16[100:101].reshape(1, 1),
    }


@pytest.mark.parametrize("layout", sorted(_layouts()))
def test_to_fp32_of_any_bf16_layout_is_exact_and_a_fresh_array(layout):
    a = _layouts()[layout]
    before = a.copy()
    got = dt.to_fp32(a)
    assert got.dtype == np.float32 and got.shape == a.shape
    np.testing.assert_array_equal(_bits(got), _bits(_widened(a)))
    assert not np.shares_memory(got, a)
    if got.flags.writeable:
        got[...] = 1.0
    np.testing.assert_array_equal(_bits(a), _bits(before))   # the input is untouched


def test_to_fp32_of_other_dtypes():
    f = np.arange(10, dtype=np.float32)
    assert dt.to_fp32(f) is f                                    # fp32: no copy
    for arr in (np.array([1.5, -0.0, np.inf], np.float16), np.array([-3, 7], np.int8),
                np.array([0.5, -448.0], ml_dtypes.float8_e4m3fn), np.zeros((70, 70), np.float16)):
        got = dt.to_fp32(arr)
        np.testing.assert_array_equal(_bits(got), _bits(arr.astype(np.float32)))
