"""`neuron_dtypes` as nkisim serves it when AWS's package (part of the Neuron SDK, not on PyPI) is absent.

Only what reference code outside kernels calls: `static_cast(array, dtype)` converts a NumPy array to an NKI dtype
with the engines' rounding (round to nearest even; integers saturate), and to x4 packed MX dtypes by packing four
consecutive elements of the last dimension into one word (see nkisim.mx); from a packed array it expands each word
into its four elements first.
"""

import numpy as np

from . import dtypes as _dt
from . import mx as _mx


def static_cast(array, dtype):
    """`array` (NumPy) converted to `dtype` (an NKI, NumPy or ml_dtypes dtype); packed dtypes give a PackedArray."""
    d = _dt.as_dtype(dtype)
    packed_in = _mx.packed_dtype_of(array)
    if packed_in is not None:
        if _mx.is_packed(d):
            raise TypeError(f"static_cast from {packed_in.name} to {d.name}: unpack to a float dtype first")
        array = _mx.unpack(array)   # x4 words expand to their elements: [..., F] -> [..., 4F]
    a = np.asarray(array)
    if _mx.is_packed(d):
        return _mx.pack(a, d)
    if a.dtype.kind in "iub" or d.kind != "float":
        return _dt.cast(a, d, d.np)
    return a.astype(d.np)


# The packed MX dtypes under their neuron_dtypes names (reference code maps nl.<x4> to dt.<x4>); here they are the
# same objects as nl.<x4>, so `static_cast(a, dt.float8_e4m3fn_x4)` packs.
float8_e4m3fn_x4 = _dt.float8_e4m3fn_x4
float8_e5m2_x4 = _dt.float8_e5m2_x4
float4_e2m1fn_x4 = _dt.float4_e2m1fn_x4
