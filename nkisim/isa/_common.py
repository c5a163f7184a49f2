"""Operand checks shared by the ISA implementations. Every failure names the op, the operand and the limit."""

import math

import numpy as np

from .. import dtypes as dt
from ..errors import NkiValidationError
from ..memory import psum, sbuf
from ..runtime import access_of, current
from ..tensor import NkiTensor, np_view, read, write
from .enums import engine, reduce_cmd

PMAX = 128


def fail(op, msg):
    raise NkiValidationError(f"{op}: {msg}")


def tensor(op, name, t):
    if not isinstance(t, NkiTensor):
        fail(op, f"{name} must be an NkiTensor, got {type(t).__name__}")
    return t


def on_chip(op, name, t, buffers=(sbuf, psum)):
    if not isinstance(t, NkiTensor):
        tensor(op, name, t)
    if t.alloc.buffer not in buffers:
        fail(op, f"{name} '{t.name}' is in {t.buffer.name}; allowed: {'/'.join(b.name for b in buffers)}")
    problem = t._chip
    if problem is None:      # a view's partition range never changes: checked once per view
        problem = t._chip = _partition_problem(t)
    if problem:
        fail(op, f"{name} {problem}")
    return t


def partition_row(t):
    """Elements (in t's dtype) per partition of t's allocation."""
    row = t.alloc.storage.size // t.alloc.shape[0] if t.alloc.shape[0] else 1
    return row * t.alloc.dtype.itemsize // t.dtype.itemsize


def start_partition(t):
    """First SBUF/PSUM partition a (direct) view touches."""
    row = partition_row(t)
    return t.offset // row if row else 0


def legal_starts(p):
    """C13: partitions an access of p partitions may start at."""
    return (0,) if p > 64 else (0, 64) if p > 32 else (0, 32, 64, 96)


def _partition_problem(t):
    """What is wrong with an on-chip view's partitions (C1, C13), or "" when nothing is."""
    p = t.shape[0]
    if p > PMAX:
        return f"partition dimension {p} exceeds maximum {PMAX} (C1)"
    # C13: compute engines access contiguous partitions starting at 0 (P>64), 0/64 (32<P<=64), 0/32/64/96 (P<=32).
    if t.gather is not None:
        return ""
    row = partition_row(t)
    start = t.offset // row if row else 0
    if p > 1 and t.strides[0] != row:
        return f"must occupy contiguous partitions (partition stride {t.strides[0]}, row {row}) (C13)"
    if start == 0:
        return ""
    if p > 64 or (p > 32 and start % 64) or (p <= 32 and start % 32):
        return (f"starts at partition {start} with {p} partitions; compute engines need start 0 for P>64, "
                "0/64 for 32<P<=64, 0/32/64/96 for P<=32 (C13)")
    return ""


def ew_operand(t):
    """Facts of an fp32 on-chip view for the elementwise fast paths, computed once per (immutable) view: (its [P, F]
    NumPy view, its Access, in PSUM, P, F) when t is a direct (not indirect) fp32 SBUF/PSUM view that passes
    `on_chip` (C1, C13) and whose NumPy view is 2-D; False otherwise (the op then takes its general path, which
    also raises any error). Callers check `t.__class__ is NkiTensor` first."""
    fx = t._ew
    if fx is None:
        fx = t._ew = _ew_facts(t)
    return fx


def _ew_facts(t):
    if t.gather is not None or t.dtype is not dt.float32 or t.alloc.buffer not in (sbuf, psum):
        return False
    problem = t._chip
    if problem is None:
        problem = t._chip = _partition_problem(t)
    if problem:
        return False
    try:
        v = np_view(t)
    except NkiValidationError:
        return False
    if v.ndim != 2 or v.dtype is not _F32:
        return False
    return (v, access_of(t), t.alloc.buffer is psum, t.shape[0], free_size(t))


def free_size(t):
    f = t._free
    if f is None:
        p = t.shape[0]
        f = t._free = math.prod(t.shape) // p if p else 0
    return f


def same_layout(op, ref_name, ref, **others):
    """C2: same partition count and elements per partition (shapes may differ)."""
    p, f = ref.shape[0], ref._free
    if f is None:
        f = free_size(ref)
    for name, t in others.items():
        if t is None:
            continue
        if t.shape[0] != p:
            fail(op, f"{name} has {t.shape[0]} partitions but {ref_name} has {p} (C2: partition counts must match)")
        if (t._free if t._free is not None else free_size(t)) != f:
            fail(op, f"{name} has {free_size(t)} elements per partition but {ref_name} has {f} (C2)")


def not_both_psum(op, a_name, a, b_name, b):
    if isinstance(a, NkiTensor) and isinstance(b, NkiTensor) and a.alloc.buffer is psum and b.alloc.buffer is psum:
        fail(op, f"{a_name} and {b_name} cannot both be in PSUM (C9)")


def emit(opname, engine, reads, writes, dst, **meta):
    """Record an on-chip op sized by its dst (p partitions x n elements); non-tensor operands are skipped."""
    # One pass per side (operands, their cached footprints, input dtypes): this runs once per instruction.
    rs, ra, names = [], [], []
    for t in reads:
        if isinstance(t, NkiTensor):
            rs.append(t)
            ra.append(t._access or access_of(t))
            names.append(t.dtype.name)
    ws, wa = [], []
    for t in writes:
        if isinstance(t, NkiTensor):
            ws.append(t)
            wa.append(t._access or access_of(t))
            names.append(t.dtype.name)
    if "int64" in names:
        _int64_operand(opname, rs + ws)
    names = names[:len(rs)]
    meta["p"] = dst.shape[0]
    meta["n"] = dst._free if dst._free is not None else free_size(dst)
    meta["dtype"] = dst.dtype.name
    meta["in_dtypes"] = tuple(names)
    current().emit_accesses(opname, engine, rs, ws, tuple(ra), tuple(wa), meta)


def _int64_operand(op, tensors):
    """AWS nki.isa.scalar_load: "Unlike the compute instructions, scalar_load accepts nl.int64" -- nl.int64 data
    moves by DMA and into NkiScalars, never through an engine's datapath."""
    t = next(t for t in tensors if t.dtype.name == "int64")
    fail(op, f"operand '{t.name}' is nl.int64; compute instructions do not accept 64-bit integers (only DMA and "
             "nisa.scalar_load / scalar_store do): keep the data in int32 or load it as an NkiScalar")


# Enum members as module constants: `engine.unknown` goes through the enum's descriptor on every access.
_UNKNOWN, _GPSIMD = engine.unknown, engine.gpsimd


def check_engine(op, eng, allowed):
    if eng is _UNKNOWN:
        return
    if not isinstance(eng, engine):
        fail(op, f"engine={eng!r} must be an nki.isa.engine value (raw ints are rejected) (C15)")
    if eng not in allowed:
        fail(op, f"engine={eng.name} is not supported; allowed: {', '.join(e.name for e in allowed)} (C29)")


def check_gpsimd_access(op, eng, **tensors):
    if eng is _GPSIMD:
        for name, t in tensors.items():
            if isinstance(t, NkiTensor) and t.buffer is psum:
                fail(op, f"{name} is in PSUM but GpSimd cannot access PSUM (C8)")


def check_reduce_cmd(op, cmd):
    if not isinstance(cmd, reduce_cmd):
        fail(op, f"reduce_cmd={cmd!r} must be an nki.isa.reduce_cmd value (C15)")


def nc_version():
    return current().target.nc_version


def require_version(op, minimum, feature=None):
    v = nc_version()
    if v < minimum:
        what = feature or op
        names = {3: "NeuronCore-v3 (trn2)", 4: "NeuronCore-v4 (trn3)"}
        fail(op, f"{what} requires {names[minimum]} or newer; target is {current().target.name} (C19)")


def as_pf(a, p):
    """View/copy an array of any shape as [P, F] (elements per partition flattened in row-major order)."""
    if a.ndim == 2 and a.shape[0] == p:     # already [P, F]
        return a
    return a.reshape(p, -1)


_F32 = np.dtype(np.float32)


def fp32(t):
    v = t._npv if t.gather is None else None
    if v is None:
        v = read(t)
    return v if v.dtype is _F32 or v.dtype == _F32 else v.astype(_F32)


def scalar_operand(op, name, x, p, fp32_only=True):
    """A compile-time scalar or a (P, 1) tensor broadcast along the free dim, as a NumPy array/float."""
    if x is None:
        return None
    if isinstance(x, NkiTensor):
        on_chip(op, name, x)
        if x.shape[0] != p or free_size(x) != 1:
            fail(op, f"{name} must be a scalar or a ({p}, 1) tensor, got shape {x.shape} (C11)")
        if fp32_only and x.dtype is not dt.float32:
            fail(op, f"{name} tensor must be float32, got {x.dtype.name} (C11)")
        return dt.to_fp32(read(x)).reshape(p, 1)
    if isinstance(x, (bool, int, float, np.integer, np.floating)):
        return np.float32(x)
    fail(op, f"{name} must be a Python/NumPy scalar or a (P, 1) tensor, got {type(x).__name__}")


def store(op, dst, values, from_matmul=False):
    """Cast fp32/int results to dst's dtype and write them; track PSUM written state."""
    alloc = dst.alloc
    st = alloc.flat(dst.dtype).dtype
    if values.__class__ is np.ndarray and values.dtype == st and dst.dtype is not dt.tfloat32:
        v = values           # already in the storage dtype (the common fp32 -> fp32 case): no cast pass
    else:
        v = dt.cast(values, dst.dtype, st)
    if v.shape != dst.shape:
        v = v.reshape(dst.shape)
    if dst.gather is None:
        alloc.written = True
        np_view(dst)[...] = v
    else:
        write(dst, v, op)
    if alloc.buffer is psum and not from_matmul:
        mark_psum(dst, 2)


def ufunc_into(op, dst, fn, *args):
    """dst = fn(*args) for fp32 results: a NumPy ufunc writes straight into an fp32 dst's storage when the dst view
    is [P, F] (the common case: no temporary, no cast pass; overlapping operands are handled by NumPy), anything
    else is computed and stored with the usual cast. The args are [P, F] fp32 arrays."""
    v = dst._npv if dst.gather is None else None
    if v is None and dst.gather is None:
        v = np_view(dst)
    if v is not None and v.ndim == 2 and dst.dtype is dt.float32 and v.dtype is _F32 and fn.__class__ is np.ufunc:
        fn(*args, out=v)
        alloc = dst.alloc
        alloc.written = True
        if alloc.buffer is psum:
            mark_psum(dst, 2)
        return
    store(op, dst, fn(*args))


def psum_state_view(dst):
    v = dst._psv
    if v is not None:
        return v
    a = dst.alloc
    if a.psum_state is None or dst.dtype is not a.dtype or dst.gather is not None:
        return None
    v = dst._psv = np.ndarray(dst.shape, dtype=np.int8, buffer=a.psum_state, offset=dst.offset,
                              strides=dst.strides)
    return v


def mark_psum(dst, state):
    v = psum_state_view(dst)
    if v is not None:
        v[...] = state


__all__ = ["np_view"]
