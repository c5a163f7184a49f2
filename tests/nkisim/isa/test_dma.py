"""dma_copy's fast path (equal-shape, same-dtype direct views, default modes) against the general path.

`dge_mode=0` is the raw integer of dge_mode.unknown: the general path accepts it and copies and records exactly what
the default does, but the fast path (which wants the enum member) is skipped. Every scenario runs both ways and must
give the same bits and instruction record; copies that change dtype or shape must keep going through the general
path, and invalid copies must still fail."""

import ml_dtypes
import numpy as np
import pytest

from nkisim import dtypes as dt
from nkisim.errors import NkiValidationError
from nkisim.isa import dma

from .._sim import hbm, nisa, nl, rd, sb, tile
from ._fastpath import assert_same_bits, assert_same_run, bits, run_fresh

F32 = np.float32
BF16 = ml_dtypes.bfloat16
ALL_BF16 = np.arange(65536, dtype=np.uint16).view(BF16).reshape(128, 512)   # every bf16 bit pattern


@pytest.fixture
def spy(monkeypatch):
    """Counts the copies that went through the general path (its first step checks the dst operand)."""
    calls = []
    real = dma._check_dma_operand
    monkeypatch.setattr(dma, "_check_dma_operand", lambda op, name, t: (calls.append(name), real(op, name, t)))
    return calls


def _copy(general, **kw):
    if general:
        kw["dge_mode"] = 0
    nisa.dma_copy(**kw)


def _scenarios():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 64)).astype(F32)
    x[0, :4] = [np.nan, -0.0, np.inf, 1e-40]
    ints = rng.integers(-2 ** 31, 2 ** 31, (16, 24), dtype=np.int64)
    small = rng.integers(-128, 128, (64, 32)).astype(np.int8)

    def hbm_sbuf_hbm(g):
        t = tile((128, 64))
        _copy(g, dst=t, src=hbm(x))
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        _copy(g, dst=out, src=t)
        return {"t": rd(t), "out": rd(out)}

    def all_bf16_patterns(g):
        t = tile((128, 512), nl.bfloat16)
        _copy(g, dst=t, src=hbm(ALL_BF16, nl.bfloat16))
        return {"t": rd(t)}

    def sbuf_partition_offsets(g):
        src = sb(small, nl.int8)
        d = tile((128, 32), nl.int8)
        _copy(g, dst=d[64:128, :], src=src)
        _copy(g, dst=d[0:32, :], src=src[32:64, :])
        return {"d": rd(d)}

    def other_dtypes(g):
        out = {}
        for name, arr in (("int64", ints), ("uint16", ints.astype(np.uint16)), ("bool_", (ints & 1).astype(bool)),
                          ("float8_e4m3", x[:16, :24].astype(ml_dtypes.float8_e4m3)),
                          ("float8_e4m3fn_x4", ints.astype(np.uint32))):
            d = nl.ndarray(arr.shape, getattr(nl, name), buffer=nl.shared_hbm)
            _copy(g, dst=d, src=hbm(arr, getattr(nl, name)))
            out[name] = rd(d)
        return out

    def strided_broadcast_views(g):
        t = sb(x)
        d = tile((128, 32))
        _copy(g, dst=d, src=t[:, 1::2])
        e = nl.ndarray((128, 16), nl.float32, buffer=nl.shared_hbm)
        _copy(g, dst=e, src=t[:, 7:8].broadcast(1, 16))
        f = nl.ndarray((16, 128), nl.float32, buffer=nl.shared_hbm)
        _copy(g, dst=f, src=hbm(x).ap([[1, 16], [64, 128]]))     # a transposing HBM access pattern
        return {"d": rd(d), "e": rd(e), "f": rd(f)}

    def overlapping_in_one_tensor(g):
        h = hbm(x[:16])
        _copy(g, dst=h[1:16, :], src=h[0:15, :])        # shift down one row in place
        _copy(g, dst=h[:, 0:60], src=h[:, 4:64])        # and left four columns
        return {"h": rd(h)}

    def dynamic_offset(g):
        h = hbm(x)
        off = sb(np.array([[3]], np.int32))                  # in rows of the pattern's first dim
        d = tile((2, 64))
        _copy(g, dst=d, src=h.ap([[64, 2], [1, 64]], scalar_offset=off))
        return {"d": rd(d)}

    return {"hbm_sbuf_hbm": hbm_sbuf_hbm, "all_bf16": all_bf16_patterns, "partitions": sbuf_partition_offsets,
            "dtypes": other_dtypes, "views": strided_broadcast_views, "overlap": overlapping_in_one_tensor,
            "dynamic": dynamic_offset}, x, ints


@pytest.mark.parametrize("case", sorted(_scenarios()[0]))
def test_fast_copies_match_the_general_path(case, spy):
    scenario = _scenarios()[0][case]
    fast = run_fresh(lambda: scenario(False))
    assert "dst" not in spy, "expected the fast path"
    general = run_fresh(lambda: scenario(True))
    assert "dst" in spy
    assert_same_run(fast, general)


def test_fast_copies_match_numpy():
    cases, x, ints = _scenarios()
    out, _ = run_fresh(lambda: cases["hbm_sbuf_hbm"](False))
    assert_same_bits(out["t"], x)
    assert_same_bits(out["out"], x)
    out, _ = run_fresh(lambda: cases["all_bf16"](False))
    assert_same_bits(out["t"], ALL_BF16)
    out, _ = run_fresh(lambda: cases["dtypes"](False))
    assert_same_bits(out["int64"], ints)
    assert_same_bits(out["uint16"], ints.astype(np.uint16))
    assert_same_bits(out["bool_"], (ints & 1).astype(np.uint8))
    assert_same_bits(out["float8_e4m3"], x[:16, :24].astype(ml_dtypes.float8_e4m3))
    assert_same_bits(out["float8_e4m3fn_x4"], ints.astype(np.uint32))
    out, _ = run_fresh(lambda: cases["views"](False))
    assert_same_bits(out["d"], x[:, 1::2])
    assert_same_bits(out["e"], np.broadcast_to(x[:, 7:8], (128, 16)))
    assert_same_bits(out["f"], x[:, :16].T)
    out, _ = run_fresh(lambda: cases["overlap"](False))
    h = x[:16].copy()
    h[1:16] = h[0:15].copy()
    h[:, 0:60] = h[:, 4:64].copy()
    assert_same_bits(out["h"], h)
    out, _ = run_fresh(lambda: cases["dynamic"](False))
    assert_same_bits(out["d"], x[3:5])


def test_dtype_changes_go_through_the_general_path_and_cast(spy):
    x = np.random.default_rng(1).standard_normal((128, 64)).astype(F32) * 1000
    x[0, :5] = [np.nan, -np.nan, np.inf, -0.0, 2.5]
    b = tile((128, 64), nl.bfloat16)
    nisa.dma_copy(dst=b, src=hbm(x))
    assert spy == ["dst", "src"]
    assert_same_bits(rd(b)[0, 2:], x[0, 2:].astype(BF16))            # RNE; NaN stays NaN
    assert np.isnan(rd(b)[0, :2].astype(F32)).all()
    assert_same_bits(rd(b)[1:], x[1:].astype(BF16))
    i = tile((128, 64), nl.int32)
    nisa.dma_copy(dst=i, src=hbm(x))
    want = np.clip(np.rint(np.where(np.isnan(x), 0, x).astype(np.float64)), -2 ** 31, 2 ** 31 - 1)
    assert_same_bits(rd(i), want.astype(np.int32))                   # NaN -> 0, half-even, saturating


def test_bf16_to_fp32_copy_widens_every_pattern_exactly(spy):
    """bf16 -> fp32 (general path: dtype change) widens by placing the 16 bits in the high half: NaN payloads and
    signs, infinities, subnormals and -0 are kept (the tile is large enough for to_fp32's integer widening)."""
    f = tile((128, 512))
    nisa.dma_copy(dst=f, src=hbm(ALL_BF16, nl.bfloat16))
    assert spy == ["dst", "src"]
    np.testing.assert_array_equal(bits(rd(f)), ALL_BF16.view(np.uint16).astype(np.uint32) << 16)


def test_shape_changes_go_through_the_general_path(spy):
    x = np.arange(8 * 16, dtype=F32).reshape(8, 16)
    d = nl.ndarray((16, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=d, src=hbm(x))
    assert spy == ["dst", "src"]
    assert_same_bits(rd(d), x.reshape(16, 8))
    e = tile((4, 2, 16))
    nisa.dma_copy(dst=e, src=hbm(x))
    assert_same_bits(rd(e), x.reshape(4, 2, 16))


def test_non_default_modes_go_through_the_general_path(spy):
    x = np.arange(64, dtype=F32).reshape(4, 16)
    for kw in ({"oob_mode": nisa.oob_mode.skip}, {"dge_mode": nisa.dge_mode.swdge}, {"dge_mode": nisa.dge_mode.hwdge}):
        spy.clear()
        d = tile((4, 16))
        nisa.dma_copy(dst=d, src=hbm(x), **kw)
        assert spy == ["dst", "src"], kw
        assert_same_bits(rd(d), x)


def _psum(shape):
    return tile(shape, buffer=nl.psum)


_ERRORS = {
    "psum_dst": (lambda: dict(dst=_psum((4, 16)), src=hbm(np.zeros((4, 16), F32))), r"dst '.*' is in PSUM"),
    "psum_src": (lambda: dict(dst=tile((4, 16)), src=_psum((4, 16))), r"src '.*' is in PSUM"),
    "size": (lambda: dict(dst=tile((4, 16)), src=hbm(np.zeros((4, 8), F32))), r"element counts differ"),
    "packed_cast": (lambda: dict(dst=nl.ndarray((4, 4), nl.float8_e4m3fn_x4, buffer=nl.shared_hbm),
                                 src=hbm(np.zeros((4, 4), np.int32))), r"DMA casting is not supported"),
    "hwdge_cast": (lambda: dict(dst=tile((4, 16), nl.bfloat16), src=hbm(np.zeros((4, 16), F32)),
                                dge_mode=nisa.dge_mode.hwdge), r"dge_mode=hwdge requires equal dtypes"),
    "priority_trn2": (lambda: dict(dst=tile((4, 16)), src=hbm(np.zeros((4, 16), F32)), priority=1),
                      r"priority requires NeuronCore-v4"),
    "not_a_tensor": (lambda: dict(dst=np.zeros((4, 16), F32), src=hbm(np.zeros((4, 16), F32))),
                     r"dst must be an NkiTensor"),
    "view_outside": (lambda: dict(dst=tile((2, 4)), src=hbm(np.zeros((4, 4), F32)).ap([[4, 2], [1, 4]], offset=12)),
                     r"outside its allocation"),
}


@pytest.mark.parametrize("case", sorted(_ERRORS))
def test_errors_stay_errors(case):
    make, msg = _ERRORS[case]
    with pytest.raises(NkiValidationError, match=msg):
        nisa.dma_copy(**make())


def test_fast_copy_into_a_fresh_allocation_marks_it_written():
    d = tile((4, 16))
    assert not d.alloc.written
    nisa.dma_copy(dst=d, src=hbm(np.ones((4, 16), F32)))
    assert d.alloc.written
    assert dt.to_fp32(rd(d)).sum() == 64
