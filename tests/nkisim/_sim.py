"""Shared helpers of the nkisim conformance suite: a fresh default core per test, tiles from NumPy, read-back."""

import numpy as np
import pytest

import nkisim
from nkisim import dtypes as dt
from nkisim.runtime import CoreContext, set_current
from nkisim.tensor import read

nkisim.install()
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_core():
    """Every test runs on a fresh default (outside-kernel) core: empty SBUF/PSUM pools, no warn-once state."""
    ctx = CoreContext()
    ctx.is_default = True  # behaves like the outside-kernel default core (follows the target env var)
    prev = set_current(ctx)
    try:
        yield
    finally:
        set_current(prev)


@pytest.fixture
def on_target(monkeypatch):
    """on_target('trn3'): switch NEURON_PLATFORM_TARGET_OVERRIDE and start a fresh default core on that target."""
    def switch(name):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)
        set_current(CoreContext())
    return switch


def hbm(arr, dtype=None):
    """An HBM tensor holding `arr` (cast to `dtype` with NKI's rules when given)."""
    arr = np.asarray(arr)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    if arr.dtype == np.int64:
        arr = arr.astype(np.int32)
    return nl.shared_constant(arr, dtype=dtype)


def sb(arr, dtype=None, buffer=None):
    """An SBUF (or PSUM) tile holding `arr`, filled with a DMA (PSUM: DMA to SBUF, then tensor_copy)."""
    src = hbm(arr, dtype)
    t = nl.ndarray(src.shape, src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=src)
    if buffer is nl.psum:
        p = nl.ndarray(src.shape, src.dtype, buffer=nl.psum)
        nisa.tensor_copy(dst=p, src=t)
        return p
    return t


def tile(shape, dtype=nl.float32, buffer=None):
    return nl.ndarray(shape, dtype, buffer=buffer if buffer is not None else nl.sbuf)


def rd(t):
    """A NumPy copy of a tensor's values in its storage dtype."""
    return np.array(read(t))


def f32(t):
    return rd(t).astype(np.float32)


def ref_cast(values, dtype):
    """Reference engine write of fp32 `values` into `dtype` (NumPy/ml_dtypes RNE; saturating ints, NaN -> 0)."""
    d = dt.as_dtype(dtype)
    v = np.asarray(values, dtype=np.float64)
    if d.kind == "int":
        v = np.where(np.isnan(v), 0.0, np.rint(v))
        return np.clip(v, d.min, d.max).astype(d.np)
    return np.asarray(values, dtype=np.float32).astype(d.np)


def rng(seed=0):
    return np.random.default_rng(seed)
