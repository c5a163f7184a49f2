"""Operand checks shared by the ISA implementations. Every failure names the op, the operand and the limit."""

import numpy as np

from .. import dtypes as dt
from ..errors import NkiValidationError
from ..memory import psum, sbuf
from ..runtime import current
from ..tensor import NkiTensor, np_view, read
from .enums import engine, reduce_cmd

PMAX = 128


def fail(op, msg):
    raise NkiValidationError(f"{op}: {msg}")


def tensor(op, name, t):
    if not isinstance(t, NkiTensor):
        fail(op, f"{name} must be an NkiTensor, got {type(t).__name__}")
    return t


def on_chip(op, name, t, buffers=(sbuf, psum)):
    tensor(op, name, t)
    if t.buffer not in buffers:
        fail(op, f"{name} '{t.name}' is in {t.buffer.name}; allowed: {'/'.join(b.name for b in buffers)}")
    if t.shape[0] > PMAX:
        fail(op, f"{name} partition dimension {t.shape[0]} exceeds maximum {PMAX} (C1)")
    _check_partition_start(op, name, t)
    return t


def _check_partition_start(op, name, t):
    # C13: compute engines access contiguous partitions starting at 0 (P>64), 0/64 (32<P<=64), 0/32/64/96 (P<=32).
    if t.gather is not None:
        return
    row = t.alloc.storage.size // t.alloc.shape[0] if t.alloc.shape[0] else 1
    row = row * t.alloc.dtype.itemsize // t.dtype.itemsize
    start = t.offset // row if row else 0
    p = t.shape[0]
    if p > 1 and t.strides[0] != row:
        fail(op, f"{name} must occupy contiguous partitions (partition stride {t.strides[0]}, row {row}) (C13)")
    if start == 0:
        return
    if p > 64 or (p > 32 and start % 64) or (p <= 32 and start % 32):
        fail(op, f"{name} starts at partition {start} with {p} partitions; compute engines need start 0 for P>64, "
                 "0/64 for 32<P<=64, 0/32/64/96 for P<=32 (C13)")


def free_size(t):
    return t.size // t.shape[0] if t.shape[0] else 0


def same_layout(op, ref_name, ref, **others):
    """C2: same partition count and elements per partition (shapes may differ)."""
    p, f = ref.shape[0], free_size(ref)
    for name, t in others.items():
        if t is None:
            continue
        if t.shape[0] != p:
            fail(op, f"{name} has {t.shape[0]} partitions but {ref_name} has {p} (C2: partition counts must match)")
        if free_size(t) != f:
            fail(op, f"{name} has {free_size(t)} elements per partition but {ref_name} has {f} (C2)")


def not_both_psum(op, a_name, a, b_name, b):
    if isinstance(a, NkiTensor) and isinstance(b, NkiTensor) and a.buffer is psum and b.buffer is psum:
        fail(op, f"{a_name} and {b_name} cannot both be in PSUM (C9)")


def emit(opname, engine, reads, writes, dst, **meta):
    """Record an on-chip op sized by its dst (p partitions x n elements); non-tensor operands are skipped."""
    reads = tuple(t for t in reads if isinstance(t, NkiTensor))
    writes = tuple(t for t in writes if isinstance(t, NkiTensor))
    current().emit(opname, engine, reads, writes, p=dst.shape[0], n=free_size(dst),
                   dtype=dst.dtype.name, in_dtypes=tuple(t.dtype.name for t in reads), **meta)


def check_engine(op, eng, allowed):
    if not isinstance(eng, engine):
        fail(op, f"engine={eng!r} must be an nki.isa.engine value (raw ints are rejected)")
    if eng is not engine.unknown and eng not in allowed:
        fail(op, f"engine={eng.name} is not supported; allowed: {', '.join(e.name for e in allowed)}")


def check_gpsimd_access(op, eng, **tensors):
    if eng is engine.gpsimd:
        for name, t in tensors.items():
            if isinstance(t, NkiTensor) and t.buffer is psum:
                fail(op, f"{name} is in PSUM but GpSimd cannot access PSUM (C8)")


def check_reduce_cmd(op, cmd):
    if not isinstance(cmd, reduce_cmd):
        fail(op, f"reduce_cmd={cmd!r} must be an nki.isa.reduce_cmd value")


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
    return a.reshape(p, -1)


def fp32(t):
    return dt.to_fp32(read(t))


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
    from ..tensor import write
    v = dt.cast(values, dst.dtype, dst.alloc.flat(dst.dtype).dtype)
    if v.shape != dst.shape:
        v = v.reshape(dst.shape)
    write(dst, v, op)
    if dst.buffer is psum and not from_matmul:
        mark_psum(dst, 2)


def psum_state_view(dst):
    a = dst.alloc
    if a.psum_state is None or dst.dtype is not a.dtype or dst.gather is not None:
        return None
    return np.ndarray(dst.shape, dtype=np.int8, buffer=a.psum_state, offset=dst.offset,
                      strides=dst.strides)


def mark_psum(dst, state):
    v = psum_state_view(dst)
    if v is not None:
        v[...] = state


__all__ = ["np_view"]
