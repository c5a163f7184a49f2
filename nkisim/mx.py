"""OCP Microscaling (MX) formats as Trainium3 stores them: x4-packed FP8/FP4 words and 8-bit E8M0 block scales.

Packing (AWS nki.isa docs, "4-packed data types"): one `float8_e4m3fn_x4` / `float8_e5m2_x4` element is a 32-bit
word holding four contiguous FP8 values along the free dimension, value j in byte j (little-endian); one
`float4_e2m1fn_x4` element is a 16-bit word holding four FP4 (E2M1) values, value j in nibble j.

Block scaling (nisa.quantize_mx / nisa.nc_matmul_mx docs): one scale per group of 8 partitions x 4 elements; the
scale is an unsigned biased exponent (E8M0, value 2**(s - 127)). In SBUF the scales of the 32-partition quadrant q
of the data live in partitions q*32 + 0..3 of the scale tile (one partition per 8-partition group).

`PackedArray` is how packed data travels as NumPy outside a kernel: an ndarray of the 16/32-bit storage words whose
`.dtype` answers the NKI packed dtype, so kernels, references and comparisons can tell packed words from integers.
"""

import ml_dtypes
import numpy as np

from . import dtypes as dt

GROUP_P = 8         # partitions per MX group
GROUP_F = 4         # elements per partition per MX group (= the x4 packing)
QUADRANT = 32       # SBUF partitions per quadrant
SCALE_BIAS = 127    # E8M0 exponent bias

# element format of each packed dtype: (ml_dtypes element type or None for FP4, largest exponent, largest value)
_ELEM = {
    "float8_e4m3fn_x4": (ml_dtypes.float8_e4m3fn, 8, 448.0),
    "float8_e5m2_x4": (ml_dtypes.float8_e5m2, 15, 57344.0),
    "float4_e2m1fn_x4": (None, 2, 6.0),
}
# E2M1 code -> value (sign in bit 3; exponent bias 1; code 1 is the subnormal 0.5)
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)


def is_packed(d) -> bool:
    return isinstance(d, dt.DType) and d.kind == "packed"


def element_params(d: dt.DType):
    """(largest unbiased exponent, largest finite value) of the elements of packed dtype `d`."""
    _, emax, vmax = _ELEM[d.name]
    return emax, vmax


class PackedArray(np.ndarray):
    """Storage words of an x4 packed dtype; `.dtype` is the NKI packed dtype while the words are unchanged.

    Views and copies that keep the word type keep the tag; a conversion to another type (`astype(np.int32)`,
    `view(np.uint8)`) yields an ordinary array of that type.
    """

    def __new__(cls, words, packed: dt.DType):
        if not is_packed(packed):
            raise TypeError(f"{packed!r} is not an x4 packed dtype")
        arr = np.asarray(words)
        if arr.dtype != packed.storage:
            raise TypeError(f"{packed.name} words must be {packed.storage}, got {arr.dtype}")
        obj = arr.view(cls)
        obj._packed = packed
        return obj

    def __array_finalize__(self, obj):
        packed = getattr(obj, "_packed", None)
        self._packed = packed if packed is not None and np.ndarray.dtype.__get__(self) == packed.storage else None

    @property
    def dtype(self):
        words = np.ndarray.dtype.__get__(self)
        packed = self._packed
        return packed if packed is not None and words == packed.storage else words

    @dtype.setter
    def dtype(self, value):  # ndarray.view(type) sets .dtype on subclasses
        np.ndarray.dtype.__set__(self, np.dtype(value))
        if self._packed is not None and np.ndarray.dtype.__get__(self) != self._packed.storage:
            self._packed = None

    @property
    def words(self) -> np.ndarray:
        """The raw storage words as a plain ndarray (no copy)."""
        return self.view(np.ndarray)

    def __repr__(self):
        return f"PackedArray({self.words!r}, {self.dtype!r})" if self._packed else repr(self.words)


def packed_dtype_of(a):
    """The packed DType of a PackedArray (or of an NKI dtype), else None."""
    d = getattr(a, "dtype", a)
    return d if is_packed(d) else None


# ---- element encode / decode -----------------------------------------------------------------------------------

def _fp4_encode(values: np.ndarray) -> np.ndarray:
    """fp32 -> E2M1 codes, round to nearest even on the E2M1 grid, saturating at +-6 (finite-only format)."""
    v = np.asarray(values, dtype=np.float32)
    mag = np.minimum(np.abs(np.nan_to_num(v)), 6.0)
    grid = _FP4_VALUES[:8]
    # nearest grid point; ties go to the even code (mantissa bit 0)
    idx = np.searchsorted(grid, mag)
    idx = np.clip(idx, 1, 7)
    lo, hi = grid[idx - 1], grid[idx]
    pick_hi = (mag - lo > hi - mag) | ((mag - lo == hi - mag) & ((idx % 2) == 0))
    code = np.where(pick_hi, idx, idx - 1).astype(np.uint16)
    return code | (np.signbit(v).astype(np.uint16) << 3)


def encode(values, d: dt.DType) -> np.ndarray:
    """Elements [..., 4n] (any float) -> packed words [..., n] of `d` (RNE; FP4 and e4m3fn saturate)."""
    v = np.asarray(values, dtype=np.float32)
    if v.shape[-1] % GROUP_F:
        raise ValueError(f"{d.name}: the last dimension ({v.shape[-1]}) must be a multiple of 4 to pack")
    elem = _ELEM[d.name][0]
    if elem is None:
        codes = _fp4_encode(v).reshape(v.shape[:-1] + (-1, 4))
        shifts = np.arange(4, dtype=np.uint16) * 4
        return (codes << shifts).sum(axis=-1, dtype=np.uint16)
    codes = v.astype(elem).view(np.uint8).astype(np.uint32).reshape(v.shape[:-1] + (-1, 4))
    shifts = np.arange(4, dtype=np.uint32) * 8
    return (codes << shifts).sum(axis=-1, dtype=np.uint32)


def decode(words, d: dt.DType) -> np.ndarray:
    """Packed words [..., n] of `d` -> fp32 elements [..., 4n]."""
    w = np.asarray(words).view(d.storage) if np.asarray(words).dtype != d.storage else np.asarray(words)
    elem = _ELEM[d.name][0]
    if elem is None:
        nib = (w[..., None] >> (np.arange(4, dtype=np.uint16) * 4)) & 0xF
        return _FP4_VALUES[nib].reshape(w.shape[:-1] + (-1,))
    b = ((w[..., None] >> (np.arange(4, dtype=np.uint32) * 8)) & 0xFF).astype(np.uint8)
    return b.view(elem).astype(np.float32).reshape(w.shape[:-1] + (-1,))


def pack(values, d) -> PackedArray:
    """Elements -> a PackedArray of packed dtype `d` (the NumPy form of x4 data outside a kernel)."""
    d = dt.as_dtype(d)
    return PackedArray(encode(values, d), d)


def unpack(a) -> np.ndarray:
    """A PackedArray -> its fp32 elements (4x the last dimension)."""
    d = packed_dtype_of(a)
    if d is None:
        raise TypeError(f"unpack needs a PackedArray, got {type(a).__name__} of {getattr(a, 'dtype', None)}")
    return decode(np.asarray(a).view(np.ndarray), d)


# ---- block scaling ---------------------------------------------------------------------------------------------

def block_scales(values: np.ndarray, d: dt.DType) -> np.ndarray:
    """E8M0 scale per [8 partitions x 4 elements] group of fp32 `values` [P, F]: the group's largest fp32 exponent
    field minus the element format's largest exponent, clipped to [0, 255] (OCP MX shared-exponent rule)."""
    p, f = values.shape
    exp = ((np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 23) & 0xFF).astype(np.int32)
    top = exp.reshape(p // GROUP_P, GROUP_P, f // GROUP_F, GROUP_F).max(axis=(1, 3))
    emax, _ = element_params(d)
    return top - emax  # unclipped: the data is divided by this power of two before the clip of the stored byte


def quantize(values: np.ndarray, d: dt.DType):
    """fp32 [P, F] -> (packed words [P, F/4], dense uint8 scales [P/8, F/4]) per the OCP MX rule: divide each group
    by 2**(scale - 127), clamp to the element format's largest value, round to nearest even."""
    shared = block_scales(values, d)
    _, vmax = element_params(d)
    factor = np.exp2(np.repeat(np.repeat(shared, GROUP_P, axis=0), GROUP_F, axis=1).astype(np.float64) - SCALE_BIAS)
    scaled = np.clip(np.asarray(values, dtype=np.float64) / factor, -vmax, vmax).astype(np.float32)
    return encode(scaled, d), np.clip(shared, 0, 255).astype(np.uint8)


def scale_rows(p: int) -> np.ndarray:
    """Partitions of an SBUF scale tile holding the scales of P data partitions: q*32 + g for group g of quadrant q."""
    groups = np.arange(p // GROUP_P)
    return (groups // (QUADRANT // GROUP_P)) * QUADRANT + groups % (QUADRANT // GROUP_P)
