"""Example kernels written as real NKI code, each against NumPy (nki-library tolerance conventions)."""

import ml_dtypes
import nki
import numpy as np
import pytest

from tests.nkisim.examples import kernels as K

BF16 = ml_dtypes.bfloat16


def assert_global_close(out, ref, rtol, atol=1e-5):
    """nki-library's maxAllClose: |a - b| <= atol + rtol * max|ref| over the whole tensor."""
    out = np.asarray(out, dtype=np.float32)
    ref = np.asarray(ref, dtype=np.float32)
    assert out.shape == ref.shape
    assert not np.isnan(out).any(), "NaN in output: a read of uninitialised memory (sentinel) reached it"
    err = np.abs(out - ref).max()
    assert err <= atol + rtol * np.abs(ref).max(), f"max error {err} vs tolerance {atol + rtol * np.abs(ref).max()}"


@pytest.mark.parametrize("K_,M,N", [(384, 256, 1024), (128, 128, 512)])
def test_tiled_matmul_bf16(K_, M, N):
    rng = np.random.default_rng(42)
    lhsT = rng.standard_normal((K_, M)).astype(BF16)
    rhs = rng.standard_normal((K_, N)).astype(BF16)
    out = nki.simulate(K.tiled_matmul)(lhsT, rhs)
    assert out.dtype == BF16
    ref = lhsT.astype(np.float32).T @ rhs.astype(np.float32)
    assert_global_close(out, ref, rtol=1e-2)


def test_row_softmax_with_ragged_last_tile():
    rng = np.random.default_rng(42)
    x = (rng.standard_normal((200, 384)) * 4).astype(np.float32)
    out = nki.simulate(K.row_softmax)(x)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    assert_global_close(out, e / e.sum(axis=1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (BF16, 1.5e-2)])
def test_rmsnorm_bn_stats(dtype, rtol):
    rng = np.random.default_rng(42)
    x = rng.standard_normal((96, 1200)).astype(dtype)   # 1200 = 2 full bn_stats chunks + a ragged one
    gamma = rng.standard_normal((1, 1200)).astype(np.float32)
    out = nki.simulate(K.rmsnorm_bn)(x, gamma, 1e-6)
    xf = x.astype(np.float32)
    ref = xf / np.sqrt((xf ** 2).mean(axis=1, keepdims=True) + 1e-6) * gamma
    assert out.dtype == dtype
    assert_global_close(out, ref, rtol=rtol)


def test_indirect_dma_gather():
    rng = np.random.default_rng(42)
    table = rng.standard_normal((1000, 64)).astype(np.float32)
    ids = rng.integers(0, 1000, size=(128, 1)).astype(np.uint32)
    out = nki.simulate(K.gather_rows)(table, ids)
    np.testing.assert_array_equal(out, table[ids[:, 0]])


def test_causal_mask_affine_select():
    rng = np.random.default_rng(42)
    s = rng.standard_normal((128, 256)).astype(np.float32)
    out = nki.simulate(K.causal_masked_scores)(s)
    q, k = np.meshgrid(np.arange(128), np.arange(256), indexing="ij")
    np.testing.assert_array_equal(out, np.where(k <= q, s, -30000.0))


def test_lnc2_split_by_program_id():
    rng = np.random.default_rng(42)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    b = rng.standard_normal((512, 256)).astype(np.float32)
    out = nki.simulate(K.lnc_scaled_add[2])(a, b, 0.5)
    np.testing.assert_allclose(out, a * 0.5 + b, rtol=1e-6)
    # the same kernel at LNC=1 does all rows on one core and agrees bit for bit
    np.testing.assert_array_equal(nki.simulate(K.lnc_scaled_add)(a, b, 0.5), out)
