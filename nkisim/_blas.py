"""One BLAS thread for the interpreter's tile GEMMs.

nc_matmul multiplies tiles of at most [128 x 128] x [128 x 512]: too small for BLAS threads to pay off, and under
LNC=2 (or on a shared machine) OpenBLAS's spinning worker threads oversubscribe the cores -- measured on a loaded
2-core machine: 45 ms wall / 9.5 ms CPU per 128x128x512 sgemm with 2 threads vs 0.6 ms / 0.22 ms with one.
`single_thread()` drops NumPy's OpenBLAS to one thread while any core is inside a GEMM and restores the previous
count when the last one leaves (OpenBLAS's thread count is process-wide, hence the count under a lock). Where
NumPy's BLAS is not a bundled OpenBLAS exposing the setter, it does nothing.
"""

import ctypes
import glob
import os
import threading

import numpy as np


def _openblas_libs():
    """The OpenBLAS libraries bundled with NumPy that load (wheels: numpy.libs/ on Linux, .dylibs/ on macOS)."""
    base = os.path.dirname(np.__file__)
    for path in glob.glob(os.path.join(base, os.pardir, "numpy.libs", "*openblas*")) + \
            glob.glob(os.path.join(base, ".dylibs", "*openblas*")):
        try:
            yield ctypes.CDLL(path)
        except OSError:
            continue


def _openblas():
    """(set, get) of the OpenBLAS NumPy was built with, or None."""
    for lib in _openblas_libs():
        for prefix, suffix in (("scipy_openblas", "64_"), ("scipy_openblas", ""), ("openblas", "64_"),
                               ("openblas", "")):
            setter = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
            getter = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype = [ctypes.c_int], None
                getter.argtypes, getter.restype = [], ctypes.c_int
                return setter, getter
    return None


_API = _openblas()


def _openblas_sgemm():
    """NumPy's own OpenBLAS cblas_sgemm as (function, integer type), or None."""
    for lib in _openblas_libs():
        for name in ("scipy_cblas_sgemm64_", "cblas_sgemm64_", "scipy_cblas_sgemm", "cblas_sgemm"):
            fn = getattr(lib, name, None)
            if fn is None:
                continue
            integer = ctypes.c_int64 if name.endswith("64_") else ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer, integer, ctypes.c_float,
                           ctypes.c_void_p, integer, ctypes.c_void_p, integer, ctypes.c_float, ctypes.c_void_p,
                           integer]
            fn.restype = None
            return fn
    return None


_SGEMM = _openblas_sgemm()
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def gemm_accumulate(s, mv, c) -> bool:
    """c += s.T @ mv in one sgemm call (beta = 1) of the OpenBLAS NumPy uses, instead of a product into a temporary
    plus an add pass over c: the same sgemm NumPy's matmul calls for these shapes, its result added to c in the
    kernel's epilogue (one fp32 rounding, as the separate add). s [K, M], mv [K, N], c [M, N]: fp32, C-contiguous,
    M and N >= 2 (NumPy takes gemv for a single row or column). Returns False (nothing done) when that call is not
    available or the operands do not qualify; the caller then multiplies and adds itself."""
    if _SGEMM is None or s.dtype != np.float32 or mv.dtype != np.float32 or c.dtype != np.float32:
        return False
    if not (s.flags.c_contiguous and mv.flags.c_contiguous and c.flags.c_contiguous and c.flags.writeable):
        return False
    k, m = s.shape
    n = mv.shape[1]
    if m < 2 or n < 2 or mv.shape[0] != k or c.shape != (m, n):
        return False
    _SGEMM(_ROW_MAJOR, _TRANS, _NO_TRANS, m, n, k, 1.0, s.ctypes.data, m, mv.ctypes.data, n, 1.0, c.ctypes.data, n)
    return True
_LOCK = threading.Lock()
_users = 0          # threads inside a GEMM
_saved = 1          # NumPy's thread count before the first of them entered
_deferred = False   # one thread kept after the last GEMM left, until the kernel ends (restore())


_current = None


def _in_kernel():
    global _current
    if _current is None:
        from .runtime import current as _current
    return _current().in_kernel


class single_thread:
    """`with single_thread():` runs the block's BLAS calls on one OpenBLAS thread (see the module docstring).

    Inside a kernel the count is given back when the kernel ends (`restore`, called by runtime.set_current), not
    after every GEMM: raising OpenBLAS's thread count again costs tens of microseconds, a kernel runs many GEMMs."""

    __slots__ = ()

    def __enter__(self):
        global _users, _saved, _deferred
        if _API is None:
            return
        with _LOCK:
            if _users == 0 and not _deferred:
                _saved = _API[1]()
                if _saved != 1:
                    _API[0](1)
            _deferred = False
            _users += 1

    def __exit__(self, *exc):
        global _users, _deferred
        if _API is None:
            return
        with _LOCK:
            _users -= 1
            if _users == 0 and _saved != 1:
                if _in_kernel():
                    _deferred = True
                else:
                    _API[0](_saved)


def restore():
    """Give NumPy its BLAS thread count back if a kernel's GEMMs left it at one (called when a kernel ends)."""
    global _deferred
    if not _deferred:
        return
    with _LOCK:
        if _deferred and _users == 0:
            _API[0](_saved)
            _deferred = False


def available() -> bool:
    """True when NumPy's OpenBLAS thread count can be set (the GEMMs then run on one thread)."""
    return _API is not None


def num_threads() -> int:
    """OpenBLAS's current thread count (0 when unknown)."""
    return _API[1]() if _API is not None else 0
