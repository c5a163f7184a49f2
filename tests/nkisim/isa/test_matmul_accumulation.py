"""nc_matmul accumulation modes: NumPy fp32 BLAS (default) vs NKISIM_MATMUL_ACC=fp64 (per-element, shape-independent
results as on TensorE, where an output element depends only on its own stationary column and moving column)."""

import ml_dtypes
import numpy as np
import pytest

from nkisim.errors import NkiValidationError

from .._sim import nisa, nl, rd, sb, tile

BF16 = ml_dtypes.bfloat16


def _operands(seed=3):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((128, 128)).astype(BF16).astype(np.float32)
    b = rng.standard_normal((128, 512)).astype(BF16).astype(np.float32)
    return a, b


def _matmul(a, b):
    d = tile((a.shape[1], b.shape[1]), buffer=nl.psum)
    nisa.nc_matmul(dst=d, stationary=sb(a, nl.bfloat16), moving=sb(b, nl.bfloat16), accumulate=False)
    return rd(d)


# Sub-tiles of the full [128, 128] x [128, 512] product at other positions and shapes (as when a batch is split).
_SUBS = [(0, 48, 0, 384), (48, 80, 128, 256), (16, 17, 0, 1), (0, 128, 500, 512), (77, 128, 3, 200)]


def test_fp64_accumulation_is_independent_of_the_tile_shape(monkeypatch):
    monkeypatch.setenv("NKISIM_MATMUL_ACC", "fp64")
    a, b = _operands()
    full = _matmul(a, b)
    exact = (a.astype(np.float64).T @ b.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(full, exact)
    for m0, m1, n0, n1 in _SUBS:
        np.testing.assert_array_equal(_matmul(a[:, m0:m1], b[:, n0:n1]), full[m0:m1, n0:n1])


def test_fp32_default_is_numpy_blas_and_close():
    """The default mode is NumPy's fp32 product (fast; last-bit differences between tile shapes are allowed)."""
    a, b = _operands()
    full = _matmul(a, b)
    np.testing.assert_allclose(full, a.T @ b, rtol=1e-6, atol=1e-5)
    for m0, m1, n0, n1 in _SUBS:
        sub = _matmul(a[:, m0:m1], b[:, n0:n1])
        np.testing.assert_allclose(sub, full[m0:m1, n0:n1], rtol=1e-5, atol=1e-4)


def test_unknown_accumulation_mode_is_rejected(monkeypatch):
    monkeypatch.setenv("NKISIM_MATMUL_ACC", "fp16")
    a, b = _operands()
    with pytest.raises(NkiValidationError, match="nc_matmul: NKISIM_MATMUL_ACC='fp16' must be"):
        _matmul(a[:, :4], b[:, :4])
