"""nkisim._blas: tile GEMMs on one OpenBLAS thread, the previous count restored after the last user leaves."""

import threading

import numpy as np
import pytest

from nkisim import _blas

pytestmark = pytest.mark.skipif(not _blas.available(), reason="NumPy's BLAS is not a bundled OpenBLAS with a setter")


def test_single_thread_inside_and_restored_after():
    before = _blas.num_threads()
    with _blas.single_thread():
        assert _blas.num_threads() == 1
        with _blas.single_thread():          # nested (another core's GEMM)
            assert _blas.num_threads() == 1
        assert _blas.num_threads() == 1      # still one user inside
    assert _blas.num_threads() == before


def test_overlapping_threads_restore_once_the_last_leaves():
    before = _blas.num_threads()
    inside, release = threading.Barrier(2), threading.Event()
    seen = []

    def core():
        with _blas.single_thread():
            inside.wait()
            seen.append(_blas.num_threads())
            release.wait()

    t = threading.Thread(target=core)
    t.start()
    with _blas.single_thread():
        inside.wait()
        release.set()
        t.join()
        seen.append(_blas.num_threads())    # the other thread has left; this one is still inside
    assert seen == [1, 1] and _blas.num_threads() == before


def test_results_unchanged():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((128, 128), np.float32), rng.standard_normal((128, 512), np.float32)
    with _blas.single_thread():
        got = a.T @ b
    np.testing.assert_allclose(got, a.T @ b, rtol=1e-5, atol=1e-4)


def test_kernel_gemms_keep_one_thread_until_the_kernel_ends():
    import ml_dtypes
    import nki

    from tests.nkisim.examples.kernels import tiled_matmul

    before = _blas.num_threads()
    a = np.ones((256, 256), ml_dtypes.bfloat16)
    b = np.ones((256, 512), ml_dtypes.bfloat16)
    out = nki.simulate(tiled_matmul)(a, b)
    assert float(out.astype(np.float32)[0, 0]) == 256.0
    assert _blas.num_threads() == before and not _blas._deferred
