"""NKI data types, their NumPy storage, and the engine casting rules.

Storage: bf16/fp8 in `ml_dtypes` arrays (the official simulator's precise mode); `NKI_PRECISE_FP=0` stores every
low-precision float as fp32 instead (useful to separate algorithmic from precision error). Engines compute in fp32 and
cast on write: floats round to nearest even; float -> int rounds to nearest even and saturates (the simulator matches
hardware here since NKI 0.6); NaN -> int gives 0.
"""


import ml_dtypes
import numpy as np

from . import _env


class DType:
    """An NKI dtype (`nl.bfloat16`, ...). Compares equal to itself, its name and its NumPy dtype."""

    __slots__ = ("name", "np", "itemsize", "kind", "min", "max", "storage")

    def __init__(self, name, np_dtype, kind, storage=None):
        self.name = name
        self.np = np.dtype(np_dtype)
        self.itemsize = self.np.itemsize
        self.kind = kind  # "float" | "int" | "bool" | "packed"
        self.storage = np.dtype(storage) if storage is not None else self.np
        if kind == "int":
            info = np.iinfo(self.np)
            self.min, self.max = int(info.min), int(info.max)
        elif kind == "float":
            info = ml_dtypes.finfo(self.np)
            self.min, self.max = float(info.min), float(info.max)
        else:
            self.min, self.max = 0, 1

    @property
    def is_float(self):
        return self.kind == "float"

    @property
    def is_int(self):
        return self.kind in ("int", "bool")

    def __repr__(self):
        return f"nl.{self.name}"

    def __str__(self):
        # The real nl.<dtype> objects are the strings 'bfloat16', 'float32', ..., 'bool' (AWS's nki.language stub);
        # kernels compare `str(dtype) == str(nl.bfloat16)`.
        return "bool" if self is bool_ else self.name

    def __eq__(self, other):
        if isinstance(other, DType):
            return self.name == other.name
        if isinstance(other, str):
            return _BY_NAME.get(other) is self
        try:
            return self.name != "tfloat32" and as_dtype(other) is self
        except (TypeError, ValueError):
            return False

    def __hash__(self):
        return hash(self.name)


bool_ = DType("bool_", np.uint8, "bool")
int8 = DType("int8", np.int8, "int")
int16 = DType("int16", np.int16, "int")
int32 = DType("int32", np.int32, "int")
# NKI 0.7: nl.int64 exists for HBM/SBUF data, DMA and NkiScalar (nisa.scalar_load / scalar_store, 64-bit
# scalar_offset on HBM); compute instructions do not accept it (AWS nki.isa.scalar_load page, "Unlike the compute
# instructions, scalar_load accepts nl.int64") -- checked in nkisim.isa._common.emit.
int64 = DType("int64", np.int64, "int")
uint8 = DType("uint8", np.uint8, "int")
uint16 = DType("uint16", np.uint16, "int")
uint32 = DType("uint32", np.uint32, "int")
float16 = DType("float16", np.float16, "float")
bfloat16 = DType("bfloat16", ml_dtypes.bfloat16, "float")
tfloat32 = DType("tfloat32", np.float32, "float")  # 1S8E10M kept in 32 bits; mantissa rounded on write
float32 = DType("float32", np.float32, "float")
float8_e4m3 = DType("float8_e4m3", ml_dtypes.float8_e4m3, "float")      # Neuron cFP8, max 240
float8_e4m3fn = DType("float8_e4m3fn", ml_dtypes.float8_e4m3fn, "float")  # OCP, max 448
float8_e5m2 = DType("float8_e5m2", ml_dtypes.float8_e5m2, "float")
float8_e8m0fnu = DType("float8_e8m0fnu", ml_dtypes.float8_e8m0fnu, "float")
# Packed MX types are opaque 32/16-bit words to every engine but the Trn3 MX matmul.
float8_e4m3fn_x4 = DType("float8_e4m3fn_x4", np.uint32, "packed")
float8_e5m2_x4 = DType("float8_e5m2_x4", np.uint32, "packed")
float4_e2m1fn_x4 = DType("float4_e2m1fn_x4", np.uint16, "packed")

ALL = (bool_, int8, int16, int32, int64, uint8, uint16, uint32, float16, bfloat16, tfloat32, float32, float8_e4m3,
       float8_e4m3fn, float8_e5m2, float8_e8m0fnu, float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4)
_BY_NAME = {d.name: d for d in ALL}
_BY_NAME["bool"] = bool_  # the real nl.bool_ is the string 'bool'
_BY_NP = {}
for _d in ALL:
    if _d.kind in ("float", "int") and _d is not tfloat32:
        _BY_NP.setdefault(_d.np, _d)
_BY_NP[np.dtype(np.bool_)] = bool_
FP8 = (float8_e4m3, float8_e4m3fn, float8_e5m2)
LOW_PRECISION = (bfloat16, float16, *FP8, float8_e8m0fnu)


def as_dtype(x) -> DType:
    """DType from an NKI dtype, a NumPy/ml_dtypes dtype or type, or a torch dtype."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        if x in _BY_NAME:
            return _BY_NAME[x]
        raise TypeError(f"dtype {x!r} is not an NKI dtype (string dtypes are not accepted; use nl.<dtype>)")
    tname = getattr(x, "__module__", "") == "torch" and str(x)
    if tname:
        mapped = _TORCH_NAMES.get(tname)
        if mapped is None:
            raise TypeError(f"torch dtype {x} has no NKI equivalent (no 64-bit floating-point or unsigned types; "
                            "nl.int64 is the only 64-bit dtype)")
        return mapped
    try:
        npd = np.dtype(x)
    except TypeError:
        raise TypeError(f"dtype {x!r} is not an NKI dtype") from None
    d = _BY_NP.get(npd)
    if d is None:
        raise TypeError(f"dtype {npd} has no NKI equivalent (no 64-bit floating-point or unsigned types; nl.int64 "
                        "is the only 64-bit dtype; use float32/int32)")
    return d


_TORCH_NAMES = {
    "torch.float32": float32, "torch.float16": float16, "torch.bfloat16": bfloat16, "torch.int8": int8,
    "torch.int16": int16, "torch.int32": int32, "torch.int64": int64, "torch.uint8": uint8, "torch.uint16": uint16,
    "torch.uint32": uint32, "torch.bool": bool_, "torch.float8_e4m3fn": float8_e4m3fn,
    "torch.float8_e5m2": float8_e5m2, "torch.float8_e8m0fnu": float8_e8m0fnu,
}


def precise_fp() -> bool:
    return _env.get("NKI_PRECISE_FP", "1") != "0"


def storage_dtype(d: DType) -> np.dtype:
    """NumPy dtype that holds tensors of `d` (fp32 for low-precision floats when NKI_PRECISE_FP=0)."""
    if d.kind == "float" and d in LOW_PRECISION and not precise_fp():
        return np.dtype(np.float32)
    return d.storage


UNINIT_ENV = "NKISIM_UNINIT"


def sentinel(d: DType):
    """Fill value of a fresh allocation: NaN for floats, 4 for ints (as the official simulator; C17), so that results
    computed from memory nobody wrote show up. `NKISIM_UNINIT=zero` fills with zeros instead: hardware memory holds
    stale finite data, and kernels that compute on padding they never wrote and cancel it with zero weights (AWS's
    nki-library MX projections do) are then simulated as they behave on the device."""
    if _env.get(UNINIT_ENV, "nan").strip().lower() == "zero":
        return 0
    return np.nan if d.kind == "float" else 4


_UINT_OF_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_FILL_BITS = {}    # (storage dtype, kind, fill is 0) -> (unsigned dtype of its size, the fill's bit pattern) or None


def filled(n, d: DType) -> np.ndarray:
    """Fresh flat storage for n elements of `d`: `np.full(n, sentinel(d), dtype=storage_dtype(d))`, bit for bit.

    Fills through an unsigned-integer view with the sentinel's bit pattern (computed once per storage dtype):
    filling an ml_dtypes array with a Python float converts element by element, several times slower, and every
    nl.ndarray pays it."""
    st = storage_dtype(d)
    val = sentinel(d)
    key = (st, d.kind, val == 0)
    bits = _FILL_BITS.get(key, False)
    if bits is False:
        u = _UINT_OF_SIZE.get(st.itemsize)
        one = np.full(1, val, dtype=st)
        bits = _FILL_BITS[key] = (u, one.view(u)[0]) if u is not None and one.dtype == st else None
    if bits is None:
        return np.full(n, val, dtype=st)
    a = np.empty(n, dtype=st)
    a.view(bits[0]).fill(bits[1])
    return a


_F32 = np.dtype(np.float32)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_U16, _U32 = np.dtype(np.uint16), np.dtype(np.uint32)


def to_fp32(a: np.ndarray) -> np.ndarray:
    """Engine read: any stored array as fp32 (a no-copy pass-through when already fp32)."""
    dtype = a.dtype
    if dtype is _F32 or dtype == _F32:
        return a
    if dtype is _BF16 and a.__class__ is np.ndarray and a.size >= 4096:
        # bf16 -> fp32 is exact: the 16 bits become the high half of the fp32 word (NaN payloads and signs kept,
        # bit-identical to ml_dtypes' astype), done as an integer widen + shift at about half astype's cost.
        out = np.empty(a.shape, _U32)
        np.copyto(out, a.view(_U16))
        out <<= 16
        return out.view(_F32)
    return a.astype(np.float32)


def _round_tf32(a: np.ndarray) -> np.ndarray:
    # Round-to-nearest-even to 10 mantissa bits, keeping the fp32 container.
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & np.uint32(0xFFFFE000)
    finite = np.isfinite(a)
    return np.where(finite, rounded.view(np.float32), a)


def cast(values, d: DType, storage: np.dtype | None = None) -> np.ndarray:
    """Engine write: convert values (any NumPy array/scalar) to `d`'s storage with NKI's rounding rules."""
    st = storage if storage is not None else storage_dtype(d)
    a = np.asarray(values)
    if a.dtype == st and d is not tfloat32:
        return a
    if d.kind == "bool":
        return (a != 0).astype(np.uint8)
    if d.kind == "int":
        if a.dtype.kind in "iub":
            return np.clip(a.astype(np.int64), d.min, d.max).astype(st)
        f = a.astype(np.float64)
        f = np.where(np.isnan(f), 0.0, np.rint(f))  # rint is round-half-even
        return np.clip(f, d.min, d.max).astype(st)
    if d.kind == "packed":
        if a.dtype.kind not in "iu":
            raise TypeError(f"packed dtype {d.name} holds raw words; write integer bit patterns")
        return a.astype(st)
    if d is tfloat32:
        return _round_tf32(a.astype(np.float32))
    if a.dtype.kind in "iub" and st.itemsize < 4:
        a = a.astype(np.float32)
    return a.astype(st)
