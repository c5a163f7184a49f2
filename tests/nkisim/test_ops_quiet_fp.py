"""nkisim.ops.quiet_fp: NumPy floating-point errors ignored inside (IEEE results), the caller's state kept outside."""

import warnings

import numpy as np

from nkisim.ops import quiet_fp


def test_ignores_inside_and_restores_the_callers_state():
    big = np.array([3e38], np.float32)
    with np.errstate(over="raise"):
        with quiet_fp():
            assert np.isinf(big * np.float32(10))[0]
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert np.isnan(np.array([np.inf]) - np.array([np.inf]))[0]
        assert np.geterr()["over"] == "raise"
        try:
            big * np.float32(10)
        except FloatingPointError:
            pass
        else:
            raise AssertionError("the caller's errstate was not restored")


def test_restored_after_an_exception():
    before = np.geterr()
    try:
        with quiet_fp():
            raise KeyError("x")
    except KeyError:
        pass
    assert np.geterr() == before
