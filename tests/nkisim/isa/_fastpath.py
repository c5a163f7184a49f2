"""Helpers of the fast-path equivalence tests: run one scenario on a fresh core and capture what it produced (values
bit for bit, PSUM written state, the instruction record with allocation ids normalised), so that a run through a
fast path can be compared with the same scenario forced through the general path."""

import numpy as np

from nkisim.runtime import CoreContext, set_current


def bits(a):
    """The raw bit pattern of an array (NaN payloads and signs included), as unsigned integers."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_array_equal(bits(got), bits(want))


def assert_same_values(got, want):
    """Equal bit for bit, except that a NaN may be any NaN (NumPy's SIMD and strided loops may pick another NaN
    operand to propagate): for references computed by NumPy on differently laid-out arrays."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(bits(np.where(nan, 0, got).astype(got.dtype)),
                                  bits(np.where(nan, 0, want).astype(want.dtype)))


def trace_signature(trace):
    """The instruction record with allocation ids renumbered by first appearance (ids are process-global)."""
    ids = {}

    def norm(alloc_id):
        return alloc_id if alloc_id < 0 else ids.setdefault(alloc_id, len(ids))

    def acc(a):
        return (norm(a.alloc_id), a.buffer, a.lo, a.hi, a.nbytes, a.partitions, a.run_bytes, a.box,
                a.stride_bytes, tuple(acc(d) for d in a.deps))

    return [(i.op, i.engine, tuple(acc(a) for a in i.reads), tuple(acc(a) for a in i.writes),
             tuple(sorted(i.meta.items())), tuple(acc(d) for d in i.deps)) for i in trace]


def run_fresh(scenario):
    """Run `scenario()` (returns a dict name -> array) on a fresh default core; (its result, trace signature)."""
    ctx = CoreContext()
    ctx.is_default = True
    prev = set_current(ctx)
    try:
        out = scenario()
        return {k: np.array(v) for k, v in out.items()}, trace_signature(ctx.trace)
    finally:
        set_current(prev)


def assert_same_run(a, b):
    """Two run_fresh results agree: every array bit for bit, and the instruction records."""
    (va, ta), (vb, tb) = a, b
    assert va.keys() == vb.keys()
    for k in va:
        assert_same_bits(va[k], vb[k])
    assert ta == tb
