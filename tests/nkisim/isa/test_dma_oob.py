"""dma_copy with a dynamic start address (.ap(scalar_offset=...)) that leaves the allocation: oob_mode=skip moves only
the in-bounds elements (AWS nisa.dma_copy: dynamic addresses are bounds-checked at run time; skip silently skips);
oob_mode=error still fails. AWS's indexed_flatten relies on this with a -1e6 row offset for idle rows."""

import numpy as np
import pytest

from nkisim.errors import NkiValidationError
from nkisim.tensor import read

from .._sim import fresh_core, nisa, nl, sb  # noqa: F401


def _offset(v):
    return sb(np.array([[v]], np.int32))


def _dst():
    d = nl.ndarray((8, 4), nl.int32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=d, src=sb(np.full((8, 4), -1, np.int32)))
    return d


def test_dst_dynamic_offset_fully_out_of_bounds_is_skipped():
    d = _dst()
    src = sb(np.arange(8, dtype=np.int32).reshape(2, 4))
    nisa.dma_copy(dst=d.ap([[4, 2], [1, 4]], scalar_offset=_offset(-1000000)), src=src, oob_mode=nisa.oob_mode.skip)
    np.testing.assert_array_equal(read(d), -1)


def test_dst_dynamic_offset_partly_out_of_bounds_writes_the_in_bounds_rows():
    d = _dst()
    src = sb(np.arange(8, dtype=np.int32).reshape(2, 4))
    nisa.dma_copy(dst=d.ap([[4, 2], [1, 4]], scalar_offset=_offset(7)), src=src, oob_mode=nisa.oob_mode.skip)
    want = np.full((8, 4), -1)
    want[7] = [0, 1, 2, 3]  # row 8 is beyond the 8-row tensor: skipped
    np.testing.assert_array_equal(read(d), want)


def test_src_dynamic_offset_out_of_bounds_leaves_dst():
    h = nl.ndarray((4, 4), nl.int32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=h, src=sb(np.arange(16, dtype=np.int32).reshape(4, 4)))
    dst = sb(np.full((2, 4), 9, np.int32))
    nisa.dma_copy(dst=dst, src=h.ap([[4, 2], [1, 4]], scalar_offset=_offset(3)), oob_mode=nisa.oob_mode.skip)
    np.testing.assert_array_equal(read(dst), [[12, 13, 14, 15], [9, 9, 9, 9]])


def test_out_of_bounds_dynamic_offset_with_oob_error_fails():
    d = _dst()
    src = sb(np.arange(8, dtype=np.int32).reshape(2, 4))
    with pytest.raises(NkiValidationError, match=r"outside its allocation"):
        nisa.dma_copy(dst=d.ap([[4, 2], [1, 4]], scalar_offset=_offset(-5)), src=src)
