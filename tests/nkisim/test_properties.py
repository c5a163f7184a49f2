"""Property tests (hypothesis): elementwise ops and casts against NumPy fp32 math cast to the dst dtype, and
dtypes.cast against an independent bit-level round-to-nearest-even / saturation reference."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from nkisim import dtypes as dt
from nkisim.runtime import CoreContext, set_current

from ._sim import fresh_core, hbm, nisa, nl, rd, tile  # noqa: F401

# fp32 results beyond fp16/bf16 range round to inf on write, as on hardware; NumPy's cast warning is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
DST = {"float32": (nl.float32, np.float32), "bfloat16": (nl.bfloat16, ml_dtypes.bfloat16),
       "float16": (nl.float16, np.float16)}

f32_finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)
shapes = st.tuples(st.integers(1, 8), st.integers(1, 16))


def arrays(shape, elements=f32_finite):
    return hnp.arrays(np.float32, shape, elements=elements)


def _load(x, dtype=None):
    src = hbm(x)
    t = nl.ndarray(x.shape, src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    return t


def _fresh():
    """A fresh core per hypothesis example (fresh_core restores the previous one after the test)."""
    ctx = CoreContext()
    ctx.is_default = True
    set_current(ctx)


def _same(got, want):
    got = np.ascontiguousarray(got)
    want = np.ascontiguousarray(want, dtype=got.dtype)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def _ref(values, np_dtype):
    with np.errstate(all="ignore"):
        return np.asarray(values, np.float32).astype(np_dtype)


BIN = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
       "minimum": np.minimum, "greater_equal": lambda a, b: np.greater_equal(a, b).astype(np.float32)}


@SETTINGS
@given(data=st.data(), shape=shapes, op=st.sampled_from(sorted(BIN)), dst=st.sampled_from(sorted(DST)))
def test_tensor_tensor_matches_numpy_fp32(data, shape, op, dst):
    _fresh()
    a = data.draw(arrays(shape))
    b = data.draw(arrays(shape))
    d_nl, d_np = DST[dst]
    out = tile(shape, d_nl)
    nisa.tensor_tensor(dst=out, data1=_load(a), data2=_load(b), op=getattr(nl, op))
    with np.errstate(all="ignore"):
        _same(rd(out), _ref(BIN[op](a, b), d_np))


@SETTINGS
@given(data=st.data(), shape=shapes, op0=st.sampled_from(["add", "multiply", "subtract", "maximum"]),
       op1=st.sampled_from(["add", "multiply", "minimum", None]), rev0=st.booleans(), rev1=st.booleans(),
       s0=f32_finite, s1=f32_finite, dst=st.sampled_from(sorted(DST)), in_dt=st.sampled_from(sorted(DST)))
def test_tensor_scalar_matches_numpy_fp32(data, shape, op0, op1, rev0, rev1, s0, s1, dst, in_dt):
    _fresh()
    x = data.draw(arrays(shape))
    x_in = _ref(x, DST[in_dt][1])
    d_nl, d_np = DST[dst]
    out = tile(shape, d_nl)
    src = tile(shape, DST[in_dt][0])
    nisa.dma_copy(dst=src, src=hbm(x))
    nisa.tensor_scalar(dst=out, data=src, op0=getattr(nl, op0), operand0=s0, reverse0=rev0,
                       op1=getattr(nl, op1) if op1 else None, operand1=s1 if op1 else None, reverse1=rev1)
    with np.errstate(all="ignore"):
        r = x_in.astype(np.float32)
        r = BIN[op0](np.float32(s0), r) if rev0 else BIN[op0](r, np.float32(s0))
        if op1:
            r = BIN[op1](np.float32(s1), r) if rev1 else BIN[op1](r, np.float32(s1))
    _same(rd(out), _ref(r, d_np))


ACT = {"copy": lambda x: x, "relu": lambda x: np.maximum(x, 0), "square": np.square, "tanh": np.tanh,
       "abs": np.abs, "exp": np.exp, "sigmoid": lambda x: 0.5 * (1 + np.tanh(0.5 * x))}


@SETTINGS
@given(data=st.data(), shape=shapes, op=st.sampled_from(sorted(ACT)), dst=st.sampled_from(sorted(DST)),
       scale=st.floats(-4, 4, width=32), bias=st.floats(-4, 4, width=32))
def test_activation_matches_numpy(data, shape, op, dst, scale, bias):
    _fresh()
    x = data.draw(arrays(shape, st.floats(-20, 20, width=32)))
    d_nl, d_np = DST[dst]
    out = tile(shape, d_nl)
    b = _load(np.full((shape[0], 1), bias, np.float32))
    nisa.activation(dst=out, op=getattr(nl, op), data=_load(x), bias=b, scale=float(scale))
    pre = x * np.float32(scale) + np.float32(bias)  # fp32 affine stage
    with np.errstate(all="ignore"):
        ref = ACT[op](pre.astype(np.float64)).astype(np.float32)
    got = rd(out).astype(np.float64)
    if op in ("copy", "relu", "abs", "square"):
        _same(rd(out), _ref(ref, d_np))
    else:  # transcendental: exact NumPy math, allow 1 ulp of the dst dtype
        eps = {"float32": 2e-7, "bfloat16": 8e-3, "float16": 1e-3}[dst]
        np.testing.assert_allclose(got, _ref(ref, d_np).astype(np.float64), rtol=eps, atol=1e-30)


# ---- dtypes.cast vs an independent reference -------------------------------------------------------------------------

def ref_rne_bits(x: np.ndarray, mant_bits: int) -> np.ndarray:
    """fp32 -> a float with `mant_bits` mantissa bits and fp32's exponent (bf16 = 7, tf32 = 10), by integer RNE."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - mant_bits
    half = np.uint64(1 << (drop - 1))
    lsb = (u >> np.uint64(drop)) & np.uint64(1)
    r = (u + half - np.uint64(1) + lsb) >> np.uint64(drop) << np.uint64(drop)
    out = (r & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), out, x)


@SETTINGS
@given(hnp.arrays(np.uint32, st.integers(1, 64)))
def test_bf16_cast_is_rne_on_random_bit_patterns(bits):
    x = bits.view(np.float32)
    finite = np.isfinite(x)
    got = dt.cast(x, nl.bfloat16)
    want = ref_rne_bits(x, 7)
    with np.errstate(all="ignore"):
        g = got.astype(np.float32)
    np.testing.assert_array_equal(g[finite & np.isfinite(want)], want[finite & np.isfinite(want)])
    assert np.isnan(g[np.isnan(x)]).all()


@SETTINGS
@given(hnp.arrays(np.uint32, st.integers(1, 64)))
def test_tf32_cast_is_rne_on_random_bit_patterns(bits):
    x = bits.view(np.float32)
    got = dt.cast(x, nl.tfloat32)
    want = ref_rne_bits(x, 10)
    ok = np.isfinite(x) & np.isfinite(want)
    np.testing.assert_array_equal(got[ok], want[ok])
    assert (got.view(np.uint32)[ok] & 0x1FFF == 0).all()


INTS = [nl.int8, nl.uint8, nl.int16, nl.uint16, nl.int32, nl.uint32]


def ref_float_to_int(x, d):
    out = []
    for v in x.astype(np.float64).tolist():
        if v != v:
            out.append(0)
            continue
        if v in (float("inf"), float("-inf")):
            out.append(d.max if v > 0 else d.min)
            continue
        f = np.floor(v)
        r = f + 1 if (v - f > 0.5 or (v - f == 0.5 and f % 2 == 1)) else f  # half to even
        out.append(int(min(max(r, d.min), d.max)))
    return np.array(out, dtype=d.np)


@SETTINGS
@given(x=hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32, allow_nan=True,
                                                                          allow_infinity=True)),
       d=st.sampled_from(INTS))
def test_float_to_int_cast_saturates_and_rounds_half_even(x, d):
    np.testing.assert_array_equal(dt.cast(x, d), ref_float_to_int(x, d))


@SETTINGS
@given(x=hnp.arrays(np.float32, st.integers(1, 32), elements=st.floats(-300, 300, width=32)),
       d=st.sampled_from(INTS))
def test_dma_cast_matches_cast(x, d):
    _fresh()
    t = tile((1, x.size), d)
    nisa.dma_copy(dst=t, src=hbm(x.reshape(1, -1)))
    np.testing.assert_array_equal(rd(t).reshape(-1), ref_float_to_int(x, d))


@SETTINGS
@given(x=hnp.arrays(np.int64, st.integers(1, 32), elements=st.integers(-(2 ** 40), 2 ** 40)),
       d=st.sampled_from(INTS))
def test_int_to_int_cast_saturates(x, d):
    np.testing.assert_array_equal(dt.cast(x, d), np.clip(x, d.min, d.max).astype(d.np))


@pytest.mark.parametrize("name", ["float16", "float8_e4m3", "float8_e4m3fn", "float8_e5m2"])
@SETTINGS
@given(x=hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(-200, 200, width=32)))
def test_small_float_casts_match_ml_dtypes(name, x):
    d = getattr(nl, name)
    np.testing.assert_array_equal(dt.cast(x, d).view(np.uint8), x.astype(d.np).view(np.uint8))
