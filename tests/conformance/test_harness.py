"""The harness's own comparison rule (runs without NKILIB_SRC)."""

import numpy as np
import pytest

from bench.peers import nkilib

from . import harness


def test_max_mode_uses_the_global_range():
    golden = np.array([100.0, 0.001], np.float32)
    # 0.5 off on the small element: per-element rtol would fail it, the library's max mode passes it.
    err, tol = harness.max_mode_error(np.array([100.0, 0.501], np.float32), golden, atol=0.0, rtol=1e-2)
    assert err == pytest.approx(0.5) and tol == pytest.approx(1.0) and err <= tol


def test_max_mode_fails_beyond_tolerance_and_on_nan():
    golden = np.ones((4, 4), np.float32)
    err, tol = harness.max_mode_error(golden + 0.1, golden, atol=1e-3, rtol=1e-2)
    assert err > tol
    bad = golden.copy()
    bad[1, 2] = np.nan
    assert harness.max_mode_error(bad, golden, 1.0, 1.0)[0] == float("inf")


def test_shape_mismatch_is_an_error():
    with pytest.raises(AssertionError, match="shape"):
        harness.max_mode_error(np.zeros(3), np.zeros(4), 0, 0)


def test_reference_inputs_widen_like_the_library():
    import ml_dtypes
    out = harness.torch_inputs({"x": np.ones(3, ml_dtypes.bfloat16), "i": np.arange(3, dtype=np.uint32), "k": 2})
    assert str(out["x"].dtype) == "torch.float32" and str(out["i"].dtype) == "torch.int32" and out["k"] == 2


def test_skip_reason_names_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(nkilib.ENV, raising=False)
    assert nkilib.ENV in nkilib.skip_reason()
    monkeypatch.setenv(nkilib.ENV, str(tmp_path))
    assert "not a checkout" in nkilib.skip_reason()


def test_pass_rate_tolerates_that_fraction_of_outliers():
    golden = np.zeros(100, np.float32)
    actual = golden.copy()
    actual[:1] = 5.0   # 1 % of the elements far off
    assert harness.max_mode_error(actual, golden, atol=0.1, rtol=0.0)[0] == 5.0
    err, tol = harness.max_mode_error(actual, golden, atol=0.1, rtol=0.0, pass_rate=0.99)
    assert err <= tol
    actual[:2] = 5.0   # 2 % off: fails at 99 %
    err, tol = harness.max_mode_error(actual, golden, atol=0.1, rtol=0.0, pass_rate=0.99)
    assert err > tol
