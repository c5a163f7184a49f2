"""nc_matmul's fast paths against the general path: a group's first product (accumulate=False into a C-contiguous
fp32 [M, N] PSUM view) is written by the GEMM straight into PSUM, every other step goes through the core's reused
product buffer (`CoreContext.matmul_scratch`) and `_accumulate`.

A first step with accumulate=None on never-written PSUM is the general path computing the same thing (auto mode
overwrites unwritten locations), so each scenario also runs with every accumulate=False replaced by None and must
give the same bits, PSUM state and record. With NKISIM_MATMUL_ACC=fp64 the product is exact per element (fp64 sum
rounded once), so groups are checked bit for bit against a NumPy reference: each step's product rounded to fp32,
then fp32 additions in step order."""

import warnings

import ml_dtypes
import numpy as np
import pytest

from nkisim.errors import NkiUninitializedReadWarning
from nkisim.isa import tensor_engine

from .._sim import nisa, nl, rd, sb, tile
from ._fastpath import assert_same_bits, assert_same_run, assert_same_values, run_fresh

F32 = np.float32
BF16 = ml_dtypes.bfloat16


def _bf16_exact(shape, rng):
    return rng.standard_normal(shape).astype(BF16).astype(F32)


def _product(a, b):
    """What NKISIM_MATMUL_ACC=fp64 computes for one step: a.T @ b summed in fp64, rounded once to fp32."""
    with np.errstate(all="ignore"):
        return (a.astype(np.float64).T @ b.astype(np.float64)).astype(F32)


def _chain(steps):
    """A PSUM accumulation group's result: the first product, then fp32 additions in order."""
    acc = _product(*steps[0])
    for a, b in steps[1:]:
        acc = (acc + _product(a, b)).astype(F32)
    return acc


@pytest.fixture(params=["fp32", "fp64"])
def acc_mode(request, monkeypatch):
    monkeypatch.setenv("NKISIM_MATMUL_ACC", request.param)
    return request.param


def _both(scenario):
    """(run with the fast first step, the same run with accumulate=False -> None: general path)."""
    return run_fresh(lambda: scenario(False)), run_fresh(lambda: scenario(None))


def _check(scenario, key=None, want=None, mode="fp64"):
    fast, general = _both(scenario)
    assert_same_run(fast, general)
    if key is not None and mode == "fp64":
        assert_same_bits(fast[0][key], want)
    return fast[0]


def test_first_step_written_into_psum_matches_the_general_path(acc_mode):
    rng = np.random.default_rng(0)
    a, b = _bf16_exact((128, 128), rng), _bf16_exact((128, 512), rng)

    def scenario(first):
        d = tile((128, 512), buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=sb(a, nl.bfloat16), moving=sb(b, nl.bfloat16), accumulate=first)
        return {"d": rd(d), "state": d.alloc.psum_state}

    out = _check(scenario, "d", _product(a, b), acc_mode)
    assert (out["state"] == 1).all()       # matmul-written: a following accumulate=True is defined (C16)


def test_fast_steps_are_taken_and_skip_accumulate(monkeypatch):
    """The first step writes PSUM directly; a later step onto all-matmul-written PSUM adds inside the GEMM."""
    calls = []
    real = tensor_engine._accumulate
    monkeypatch.setattr(tensor_engine, "_accumulate", lambda *args: (calls.append(args[4]), real(*args)))
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((32, 16)).astype(F32), rng.standard_normal((32, 64)).astype(F32)
    d = tile((16, 64), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=False)
    assert calls == []
    nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=True)
    want = np.matmul(a.T, b)
    want += np.matmul(a.T, b)
    if blas_gemm_accumulate_available():
        assert calls == []
    assert_same_values(rd(d), want)


def blas_gemm_accumulate_available():
    from nkisim import _blas
    return _blas._SGEMM is not None


def _group(rng, k, m, n, steps, special=False):
    out = []
    for _ in range(steps):
        a = (rng.standard_normal((k, m)) * rng.uniform(1e-3, 1e3)).astype(F32)
        b = rng.standard_normal((k, n)).astype(F32)
        if special:
            a[0, 0], b[1, -1], a[-1, -1] = np.inf, np.nan, -np.inf
        out.append((a, b))
    return out


@pytest.mark.parametrize("k,m,n,steps,special", [(128, 128, 512, 4, False), (128, 2, 2, 3, False),
                                                 (64, 37, 129, 5, False), (128, 128, 511, 2, True),
                                                 (1, 5, 7, 3, False)])
def test_gemm_accumulate_matches_product_then_add(monkeypatch, k, m, n, steps, special):
    """Later steps through one sgemm with beta = 1 give the bits of the product into the reused buffer plus the
    add pass (the path taken when that sgemm is unavailable), values and PSUM state alike."""
    rng = np.random.default_rng(k * 1000 + m + n)
    group = _group(rng, k, m, n, steps, special)

    def scenario():
        d = tile((m, n), buffer=nl.psum)
        for i, (a, b) in enumerate(group):
            nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=i > 0)
        return {"d": rd(d), "state": d.alloc.psum_state}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fast = run_fresh(scenario)
        monkeypatch.setattr(tensor_engine, "gemm_accumulate", lambda *args: False)
        general = run_fresh(scenario)
    assert_same_run(fast, general)


def test_gemm_accumulate_not_used_where_it_does_not_apply(monkeypatch):
    """A single row / column (NumPy's gemv), a column slice of a PSUM tile, partly unwritten PSUM and the fp64
    mode keep the product-then-add path."""
    used = []
    real = tensor_engine.gemm_accumulate
    monkeypatch.setattr(tensor_engine, "gemm_accumulate", lambda *args: used.append(1) or real(*args))
    rng = np.random.default_rng(5)
    for m, n in ((1, 64), (16, 1)):
        a, b = rng.standard_normal((32, m)).astype(F32), rng.standard_normal((32, n)).astype(F32)
        d = tile((m, n), buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=False)
        nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=True)
        assert_same_values(rd(d), np.matmul(a.T, b) + np.matmul(a.T, b))
    assert used == [1, 1]          # asked, and declined (M or N = 1): the results above are the add path's
    used.clear()
    a, b = rng.standard_normal((32, 16)).astype(F32), rng.standard_normal((32, 64)).astype(F32)
    d = tile((16, 128), buffer=nl.psum)
    nisa.nc_matmul(dst=d[:, 0:64], stationary=sb(a), moving=sb(b), accumulate=False)
    nisa.nc_matmul(dst=d[:, 0:64], stationary=sb(a), moving=sb(b), accumulate=True)   # strided view
    assert_same_values(rd(d)[:, 0:64], np.matmul(a.T, b) + np.matmul(a.T, b))
    d2 = tile((16, 64), buffer=nl.psum)
    nisa.nc_matmul(dst=d2[:, 0:32], stationary=sb(a), moving=sb(b[:, 0:32]), accumulate=False)
    nisa.nc_matmul(dst=d2, stationary=sb(a), moving=sb(b), accumulate=None)   # half written: auto mode
    want = np.matmul(a.T, b)
    want[:, 0:32] += np.matmul(a.T, b[:, 0:32])
    assert_same_values(rd(d2), want)
    assert used == [1]             # the strided view asks (and is declined: not C-contiguous); auto mode on
                                   # half-written PSUM never asks
    monkeypatch.setenv("NKISIM_MATMUL_ACC", "fp64")
    used.clear()
    d3 = tile((16, 64), buffer=nl.psum)
    nisa.nc_matmul(dst=d3, stationary=sb(a), moving=sb(b), accumulate=False)
    nisa.nc_matmul(dst=d3, stationary=sb(a), moving=sb(b), accumulate=True)
    assert used == []
    assert_same_bits(rd(d3), (_product(a, b) + _product(a, b)).astype(F32))


def test_partial_tiles_and_fp32_inputs(acc_mode):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((33, 17)).astype(F32), rng.standard_normal((33, 200)).astype(F32)

    def scenario(first):
        d = tile((17, 200), buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=first)
        return {"d": rd(d)}

    _check(scenario, "d", _product(a, b), acc_mode)


def test_accumulation_group_of_several_matmuls(acc_mode):
    rng = np.random.default_rng(3)
    steps = [(_bf16_exact((128, 96), rng), _bf16_exact((128, 384), rng)) for _ in range(4)]

    def scenario(first):
        d = tile((96, 384), buffer=nl.psum)
        for i, (a, b) in enumerate(steps):
            nisa.nc_matmul(dst=d, stationary=sb(a, nl.bfloat16), moving=sb(b, nl.bfloat16),
                           accumulate=first if i == 0 else (None if first is None else True))
        return {"d": rd(d)}

    _check(scenario, "d", _chain(steps), acc_mode)


def test_a_new_group_overwrites_the_previous_one(acc_mode):
    rng = np.random.default_rng(4)
    s1 = [(rng.standard_normal((64, 32)).astype(F32), rng.standard_normal((64, 128)).astype(F32)) for _ in range(2)]
    s2 = (rng.standard_normal((64, 32)).astype(F32), rng.standard_normal((64, 128)).astype(F32))
    d = tile((32, 128), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(s1[0][0]), moving=sb(s1[0][1]), accumulate=False)
    nisa.nc_matmul(dst=d, stationary=sb(s1[1][0]), moving=sb(s1[1][1]), accumulate=True)
    if acc_mode == "fp64":
        assert_same_bits(rd(d), _chain(s1))
    nisa.nc_matmul(dst=d, stationary=sb(s2[0]), moving=sb(s2[1]), accumulate=False)
    if acc_mode == "fp64":
        assert_same_bits(rd(d), _product(*s2))
    else:
        np.testing.assert_allclose(rd(d), s2[0].T @ s2[1], rtol=1e-5, atol=1e-5)


def test_interleaved_groups_share_the_product_buffer_correctly(acc_mode):
    """Two groups of the same [M, N] open at once: A in a contiguous tile (fast first step), B in a column slice of
    a wider tile (not C-contiguous: general path through the core's product buffer), C at partitions 64..127 of a
    tile (a fast first step at an offset view). Every step of each group sees its own partial sums only."""
    rng = np.random.default_rng(5)
    ga, gb, gc = ([(_bf16_exact((64, 64), rng), _bf16_exact((64, 128), rng)) for _ in range(3)] for _ in range(3))

    def scenario(first):
        ta = tile((64, 128), buffer=nl.psum)
        wide = tile((64, 256), buffer=nl.psum)
        tall = tile((128, 128), buffer=nl.psum)
        tb, tc = wide[:, 64:192], tall[64:128, :]
        for i in range(3):
            for t, g in ((ta, ga), (tb, gb), (tc, gc)):
                acc = (first if i == 0 else True) if first is not None else None
                nisa.nc_matmul(dst=t, stationary=sb(g[i][0], nl.bfloat16), moving=sb(g[i][1], nl.bfloat16),
                               accumulate=acc)
        return {"a": rd(ta), "b": rd(tb), "c": rd(tc), "wide": rd(wide), "wide_state": wide.alloc.psum_state,
                "tall_state": tall.alloc.psum_state}

    out = _check(scenario)
    if acc_mode == "fp64":
        assert_same_bits(out["a"], _chain(ga))
        assert_same_bits(out["b"], _chain(gb))
        assert_same_bits(out["c"], _chain(gc))
    assert np.isnan(out["wide"][:, :64]).all() and np.isnan(out["wide"][:, 192:]).all()   # untouched columns
    assert (out["wide_state"].reshape(64, 256)[:, 64:192] == 1).all()
    assert (out["wide_state"].reshape(64, 256)[:, :64] == 0).all()
    assert (out["tall_state"].reshape(128, 128)[:64] == 0).all()
    assert (out["tall_state"].reshape(128, 128)[64:] == 1).all()


def test_products_of_other_shapes_in_between_do_not_disturb_a_group(acc_mode):
    rng = np.random.default_rng(6)
    big = [(rng.standard_normal((32, 48)).astype(F32), rng.standard_normal((32, 96)).astype(F32)) for _ in range(3)]
    small = (rng.standard_normal((8, 5)).astype(F32), rng.standard_normal((8, 7)).astype(F32))

    def scenario(first):
        d = tile((48, 96), buffer=nl.psum)
        e = tile((5, 7), buffer=nl.psum)
        for i, (a, b) in enumerate(big):
            nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=first if i == 0 else True)
            nisa.nc_matmul(dst=e, stationary=sb(small[0]), moving=sb(small[1]), accumulate=None)
        return {"d": rd(d), "e": rd(e)}

    out = _check(scenario)
    if acc_mode == "fp64":
        assert_same_bits(out["d"], _chain(big))
        assert_same_bits(out["e"], _chain([small] * 3))     # auto mode accumulates once written


def test_three_d_dst_and_bf16_dst_take_the_general_path(on_target, monkeypatch):
    monkeypatch.setenv("NKISIM_MATMUL_ACC", "fp64")
    rng = np.random.default_rng(7)
    a, b = _bf16_exact((64, 32), rng), _bf16_exact((64, 4, 32), rng)
    d = tile((32, 4, 32), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a, nl.bfloat16), moving=sb(b, nl.bfloat16), accumulate=False)
    assert_same_bits(rd(d).reshape(32, 128), _product(a, b.reshape(64, 128)))
    on_target("trn3")                                  # a bf16 PSUM dst is NeuronCore-v4 only (C4)
    e = tile((32, 128), nl.bfloat16, buffer=nl.psum)
    nisa.nc_matmul(dst=e, stationary=sb(a, nl.bfloat16), moving=sb(b.reshape(64, 128), nl.bfloat16),
                   accumulate=False)
    assert_same_bits(rd(e), _product(a, b.reshape(64, 128)).astype(BF16))


def test_nan_and_inf_operands_propagate_the_same_way(acc_mode):
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((16, 8)).astype(F32), rng.standard_normal((16, 32)).astype(F32)
    a[3, 2], a[5, 4], b[7, 9], b[0, 30] = np.nan, np.inf, -np.inf, np.nan

    def scenario(first):
        d = tile((8, 32), buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=first)
        return {"d": rd(d)}

    out = _check(scenario)
    assert_same_values(np.isnan(out["d"]), np.isnan(_product(a, b)))
    if acc_mode == "fp64":
        assert_same_values(out["d"], _product(a, b))


def test_psum_state_after_a_fast_first_step_and_the_accumulate_warnings():
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((16, 8)).astype(F32), rng.standard_normal((16, 32)).astype(F32)
    d = tile((8, 32), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NkiUninitializedReadWarning)     # matmul-written: accumulating is defined
        nisa.nc_matmul(dst=d, stationary=sb(a), moving=sb(b), accumulate=True)
    fresh = tile((8, 32), buffer=nl.psum)
    with pytest.warns(NkiUninitializedReadWarning, match="never written by a matmul"):
        nisa.nc_matmul(dst=fresh, stationary=sb(a), moving=sb(b), accumulate=True)
    other = tile((8, 32), buffer=nl.psum)
    nisa.tensor_copy(dst=other, src=sb(np.ones((8, 32), F32)))
    with pytest.warns(NkiUninitializedReadWarning, match="initialised by a non-matmul instruction"):
        nisa.nc_matmul(dst=other, stationary=sb(a), moving=sb(b), accumulate=True)


def _loop_kernel(use_fori):
    import nki

    @nki.jit
    def kernel(a, b, c):
        n, k, m = a.shape
        out = nl.ndarray((n, m, b.shape[2]), nl.float32, buffer=nl.shared_hbm)

        def body(i):
            sa = nl.ndarray((k, m), nl.float32, buffer=nl.sbuf)
            sbt = nl.ndarray((k, b.shape[2]), nl.float32, buffer=nl.sbuf)
            sc = nl.ndarray((m, b.shape[2]), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=sa, src=a[i])
            nisa.dma_copy(dst=sbt, src=b[i])
            nisa.dma_copy(dst=sc, src=c[i])
            ps = nl.ndarray((m, b.shape[2]), nl.float32, buffer=nl.psum)
            h = k // 2
            nisa.nc_matmul(dst=ps, stationary=sa[0:h, :], moving=sbt[0:h, :], accumulate=False)
            nisa.nc_matmul(dst=ps, stationary=sa[h:k, :], moving=sbt[h:k, :], accumulate=True)
            res = nl.ndarray((m, b.shape[2]), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=res, data1=ps, data2=sc, op=nl.multiply)
            nisa.dma_copy(dst=out[i], src=res)

        if use_fori:
            nl.fori_loop(0, n, body)
        else:
            for i in range(n):
                body(i)
        return out

    return kernel


@pytest.mark.parametrize("use_fori", [False, True], ids=["python_loop", "fori_loop"])
def test_tiles_reallocated_every_iteration_of_a_kernel_loop(use_fori, monkeypatch):
    """Every iteration allocates its SBUF/PSUM tiles anew (in-kernel liveness reuses their space) and runs the fast
    paths on them (DMA in/out, a group's first matmul into PSUM, fp32 tensor_tensor): each iteration's output is its
    own, bit for bit."""
    monkeypatch.setenv("NKISIM_MATMUL_ACC", "fp64")
    rng = np.random.default_rng(10)
    n, k, m, nn = 5, 64, 32, 96
    a = rng.standard_normal((n, k, m)).astype(F32)
    b = rng.standard_normal((n, k, nn)).astype(F32)
    c = rng.standard_normal((n, m, nn)).astype(F32)
    out = _loop_kernel(use_fori)(a, b, c)
    for i in range(n):
        want = _chain([(a[i, :32], b[i, :32]), (a[i, 32:], b[i, 32:])]) * c[i]
        assert_same_bits(out[i], want.astype(F32))
