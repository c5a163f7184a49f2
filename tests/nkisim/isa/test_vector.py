"""tensor_tensor's fp32 fast path (facts cached per view by `_common.ew_operand`) against the general path.

Each scenario runs twice on a fresh core: as is (fp32 [P, F] SBUF/PSUM operands take the fast path) and with the
fast path's op table emptied (`vector._FAST_TT = {}`: every call takes the general path). Values (bit for bit, NaN
payloads included), PSUM written state and the instruction record must be the same, and equal to NumPy. Operands
the fast path must not take (3-D, bf16, illegal layouts, power, GpSimd) are checked against NumPy and for their
errors."""

import ml_dtypes
import numpy as np
import pytest

from nkisim.errors import NkiValidationError
from nkisim.isa import _common, vector

from .._sim import nisa, nl, rd, sb, tile
from ._fastpath import assert_same_bits, assert_same_run, assert_same_values, run_fresh

F32 = np.float32
FAST_OPS = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "mod", "fmod")
_REF = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": np.divide, "maximum": np.maximum,
        "minimum": np.minimum, "mod": np.mod, "fmod": np.fmod}
# IEEE specials, subnormals, signed zeros, extremes: rows 0..15 of the operands hold every ordered pair of them.
SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0, -1.0, 2.5,
                    -7.25, 3.0, -3.0], F32)
SPECIAL[1] = np.uint32(0xFFC00123).view(F32)     # a negative NaN with a payload


def _operands(p=64, f=256, seed=0):
    r = np.random.default_rng(seed)
    a = (r.standard_normal((p, f)) * 8).astype(F32)
    b = (r.standard_normal((p, f)) * 8).astype(F32)
    n = SPECIAL.size
    j = np.arange(min(f, n * n))
    for i in range(min(p, 16)):
        a[i, j] = SPECIAL[j % n]
        b[i, j] = SPECIAL[(j // n + i) % n]
    return a, b


def _ref(name, a, b):
    with np.errstate(all="ignore"):
        return _REF[name](a, b).astype(F32)


@pytest.fixture
def general_only(monkeypatch):
    """Returns a function that runs a scenario with tensor_tensor's fast path disabled."""
    def run(scenario):
        with monkeypatch.context() as m:
            m.setattr(vector, "_FAST_TT", {})
            return run_fresh(scenario)
    return run


@pytest.fixture
def fast_only(monkeypatch):
    """Returns a function that runs a scenario whose fp32 tensor_tensor calls must all take the fast path (the
    general path's fp32 write, ufunc_into, fails the test)."""
    def forbidden(*_):
        raise AssertionError("tensor_tensor took the general path")

    def run(scenario):
        with monkeypatch.context() as m:
            m.setattr(vector, "ufunc_into", forbidden)
            return run_fresh(scenario)
    return run


def _op(name):
    return getattr(nl, name)


@pytest.mark.parametrize("name", FAST_OPS)
def test_every_fast_op_matches_the_general_path_and_numpy_bit_for_bit(name, fast_only, general_only):
    a, b = _operands()

    def scenario():
        d = tile(a.shape)
        nisa.tensor_tensor(dst=d, data1=sb(a), data2=sb(b), op=_op(name))
        return {"d": rd(d)}

    fast = fast_only(scenario)
    assert_same_run(fast, general_only(scenario))
    assert_same_bits(fast[0]["d"], _ref(name, a, b))


def _layouts():
    """Scenarios on fp32 [P, F] views the fast path takes: PSUM operands, in-place, overlapping shifted views,
    partition offsets, strided and broadcast free dims."""
    a, b = _operands(64, 256, seed=1)

    def psum_dst_and_operand():
        pa = sb(a, buffer=nl.psum)
        d = tile(a.shape, buffer=nl.psum)
        nisa.tensor_tensor(dst=d, data1=pa, data2=sb(b), op=nl.subtract)
        nisa.tensor_tensor(dst=d, data1=sb(b), data2=d, op=nl.multiply)     # dst also an operand, in PSUM
        return {"d": rd(d), "state": d.alloc.psum_state, "pa_state": pa.alloc.psum_state}

    def in_place():
        t = sb(a)
        nisa.tensor_tensor(dst=t, data1=t, data2=sb(b), op=nl.add)
        nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.multiply)
        return {"t": rd(t)}

    def overlapping_shift():
        t = sb(a)
        nisa.tensor_tensor(dst=t[:, 1:129], data1=t[:, 0:128], data2=t[:, 2:130], op=nl.add)
        nisa.tensor_tensor(dst=t[:, 100:200], data1=t[:, 101:201], data2=t[:, 99:199], op=nl.maximum)
        return {"t": rd(t)}

    def partition_offsets():
        t, u = sb(a), sb(b)
        d = tile((64, 256))
        nisa.tensor_tensor(dst=d[0:32, :], data1=t[32:64, :], data2=u[0:32, :], op=nl.subtract)
        nisa.tensor_tensor(dst=d[32:64, :], data1=t[0:32, :], data2=u[32:64, :], op=nl.divide)
        return {"d": rd(d)}

    def strided_and_broadcast():
        t, u = sb(a), sb(b)
        d = tile((64, 128))
        nisa.tensor_tensor(dst=d, data1=t[:, ::2], data2=u[:, 1::2], op=nl.fmod)
        e = tile((64, 128))
        nisa.tensor_tensor(dst=e, data1=t[:, 0:128], data2=u[:, 5:6].broadcast(1, 128), op=nl.mod)
        return {"d": rd(d), "e": rd(e)}

    return {"psum": psum_dst_and_operand, "in_place": in_place, "overlap": overlapping_shift,
            "partition_offsets": partition_offsets, "strided_broadcast": strided_and_broadcast}


@pytest.mark.parametrize("case", sorted(_layouts()))
def test_fast_path_layouts_match_the_general_path(case, fast_only, general_only):
    scenario = _layouts()[case]
    assert_same_run(fast_only(scenario), general_only(scenario))


def test_fast_path_layouts_match_numpy():
    a, b = _operands(64, 256, seed=1)
    out, _ = run_fresh(_layouts()["strided_broadcast"])
    assert_same_values(out["d"], _ref("fmod", a[:, ::2], b[:, 1::2]))
    assert_same_values(out["e"], _ref("mod", a[:, :128], np.broadcast_to(b[:, 5:6], (64, 128))))

    out, _ = run_fresh(_layouts()["partition_offsets"])
    assert_same_values(out["d"][:32], _ref("subtract", a[32:], b[:32]))
    assert_same_values(out["d"][32:], _ref("divide", a[:32], b[32:]))

    out, _ = run_fresh(_layouts()["overlap"])
    t = a.copy()
    t[:, 1:129] = _ref("add", a[:, 0:128], a[:, 2:130])
    t[:, 100:200] = _ref("maximum", t[:, 101:201].copy(), t[:, 99:199].copy())
    assert_same_values(out["t"], t)

    out, _ = run_fresh(_layouts()["psum"])
    assert_same_values(out["d"], _ref("multiply", b, _ref("subtract", a, b)))
    assert (out["state"] == 2).all() and (out["pa_state"] == 2).all()   # written by a non-matmul engine (C16)


def test_views_at_other_offsets_and_later_data_are_not_served_from_a_stale_cache():
    """The per-view facts are the view's own (two views of one tile at other offsets differ) and alias the storage
    (a view used before and after its tile is rewritten sees the new data)."""
    a, b = _operands(32, 128, seed=2)
    t, u = sb(a), sb(b)
    lo, hi = t[:, 0:64], t[:, 64:128]
    d = tile((32, 64))
    nisa.tensor_tensor(dst=d, data1=lo, data2=u[:, 0:64], op=nl.add)
    assert_same_values(rd(d), _ref("add", a[:, :64], b[:, :64]))
    nisa.tensor_tensor(dst=d, data1=hi, data2=u[:, 0:64], op=nl.add)
    assert_same_values(rd(d), _ref("add", a[:, 64:], b[:, :64]))
    assert lo._ew and hi._ew and lo._ew[0].base is not None     # fast-path facts cached, as views of the storage
    with np.errstate(all="ignore"):
        a2 = (a * 3 + 1).astype(F32)
    nisa.dma_copy(dst=t, src=sb(a2))                            # rewrite the tile under the cached views
    nisa.tensor_tensor(dst=d, data1=lo, data2=u[:, 0:64], op=nl.add)
    assert_same_values(rd(d), _ref("add", a2[:, :64], b[:, :64]))


def test_tiles_reallocated_in_a_loop_compute_with_their_own_storage():
    """A tile allocated per iteration (PSUM at one explicit address: the storage is shared between iterations) is
    computed with the current iteration's data, never an earlier iteration's cached view."""
    a, b = _operands(32, 64, seed=3)
    for i in range(4):
        x = (a + i).astype(F32)
        p = nl.ndarray((32, 64), nl.float32, buffer=nl.psum, address=(0, 0))
        nisa.tensor_copy(dst=p, src=sb(x))
        s = tile((32, 64))
        nisa.tensor_tensor(dst=s, data1=p, data2=sb(b), op=nl.multiply)
        nisa.tensor_tensor(dst=p, data1=p, data2=s, op=nl.add)
        assert_same_values(rd(s), _ref("multiply", x, b))
        assert_same_values(rd(p), _ref("add", x, _ref("multiply", x, b)))


def _general_cases():
    """Scenarios the fast path must leave to the general path (and what NumPy says they compute)."""
    a, b = _operands(32, 64, seed=4)
    bf = ml_dtypes.bfloat16

    def three_d():
        d = tile((32, 8, 8))
        nisa.tensor_tensor(dst=d, data1=sb(a.reshape(32, 8, 8)), data2=sb(b.reshape(32, 8, 8)), op=nl.subtract)
        return {"d": rd(d).reshape(32, 64)}, _ref("subtract", a, b)

    def bf16_input():
        d = tile((32, 64))
        nisa.tensor_tensor(dst=d, data1=sb(a, nl.bfloat16), data2=sb(b), op=nl.add)
        return {"d": rd(d)}, _ref("add", a.astype(bf).astype(F32), b)

    def bf16_dst():
        d = tile((32, 64), nl.bfloat16)
        nisa.tensor_tensor(dst=d, data1=sb(a), data2=sb(b), op=nl.multiply)
        return {"d": rd(d)}, _ref("multiply", a, b).astype(bf)

    def power():
        d = tile((32, 64))
        x, y = np.abs(a) + 0.5, (b / 8).astype(F32)
        nisa.tensor_tensor(dst=d, data1=sb(x), data2=sb(y), op=nl.power)
        with np.errstate(all="ignore"):
            return {"d": rd(d)}, np.power(x, y).astype(F32)

    def gpsimd():
        d = tile((32, 64))
        nisa.tensor_tensor(dst=d, data1=sb(a), data2=sb(b), op=nl.maximum, engine=nisa.engine.gpsimd)
        return {"d": rd(d)}, _ref("maximum", a, b)

    def comparison():
        d = tile((32, 64))
        nisa.tensor_tensor(dst=d, data1=sb(a), data2=sb(b), op=nl.greater_equal)
        return {"d": rd(d)}, (a >= b).astype(F32)

    return {"3d": three_d, "bf16_input": bf16_input, "bf16_dst": bf16_dst, "power": power, "gpsimd": gpsimd,
            "comparison": comparison}


@pytest.mark.parametrize("case", sorted(_general_cases()))
def test_operands_outside_the_fast_path_match_numpy(case, monkeypatch):
    seen = []
    monkeypatch.setattr(vector, "ufunc_into", lambda *args: (seen.append(args[2]), _common.ufunc_into(*args)))
    ref = {}

    def scenario():
        out, ref["want"] = _general_cases()[case]()
        return out

    out, _ = run_fresh(scenario)
    assert_same_values(out["d"], ref["want"])
    if case not in ("power", "gpsimd"):      # GpSimd-run cases are not fp32 VectorE writes
        assert seen, "expected the general fp32 path"


_ERRORS = {
    "both_psum": (lambda a: dict(dst=tile((32, 64)), data1=sb(a, buffer=nl.psum), data2=sb(a, buffer=nl.psum),
                                 op=nl.add), r"data1 and data2 cannot both be in PSUM \(C9\)"),
    "partitions": (lambda a: dict(dst=tile((16, 64)), data1=sb(a)[0:16, :], data2=sb(a), op=nl.add),
                   r"data2 has 32 partitions but dst has 16"),
    "free_size": (lambda a: dict(dst=tile((32, 32)), data1=sb(a)[:, 0:32], data2=sb(a)[:, 0:48], op=nl.add),
                  r"data2 has 48 elements per partition but dst has 32"),
    "start_partition": (lambda a: dict(dst=tile((64, 64))[16:48, :], data1=sb(a), data2=sb(a), op=nl.add),
                        r"dst starts at partition 16 with 32 partitions"),
    "dst_in_hbm": (lambda a: dict(dst=nl.ndarray((32, 64), nl.float32, buffer=nl.shared_hbm), data1=sb(a),
                                  data2=sb(a), op=nl.add), r"dst '.*' is in shared_hbm"),
    "gpsimd_psum": (lambda a: dict(dst=tile((32, 64), buffer=nl.psum), data1=sb(a), data2=sb(a), op=nl.add,
                                   engine=nisa.engine.gpsimd), r"dst is in PSUM but GpSimd cannot access PSUM"),
    "abs_max_trn2": (lambda a: dict(dst=tile((32, 64)), data1=sb(a), data2=sb(a), op=nl.abs_max),
                     r"op=nl.abs_max requires NeuronCore-v4"),
    "scalar_engine": (lambda a: dict(dst=tile((32, 64)), data1=sb(a), data2=sb(a), op=nl.add,
                                     engine=nisa.engine.scalar), r"engine=scalar is not supported"),
}


@pytest.mark.parametrize("case", sorted(_ERRORS))
def test_errors_stay_errors_with_the_fast_path(case, monkeypatch):
    """Invalid fp32 operands raise the general path's error, with and without the fast path."""
    a = _operands(32, 64, seed=5)[0]
    make, msg = _ERRORS[case]
    with pytest.raises(NkiValidationError, match=msg):
        nisa.tensor_tensor(**make(a))
    monkeypatch.setattr(vector, "_FAST_TT", {})
    with pytest.raises(NkiValidationError, match=msg):
        nisa.tensor_tensor(**make(a))
