"""Engine registers (`VirtualRegister`) for dynamic control flow and dynamic addressing.

Register instructions run on the "sync" sequencer (no time in the cost model) and record the register as a
pseudo-allocation they write (and, for register_move/register_store, read), so that instructions addressing memory
through a register wait for the register_load that set it, which itself waits for the producer of its source tile.
"""

import numpy as np

from .. import dtypes as dt
from ..runtime import current
from ..tensor import NkiTensor, VirtualRegister, read, write
from ._common import fail

_I32 = (-(2 ** 31), 2 ** 31 - 1)


def _clip32(v):
    v = int(v)
    if not _I32[0] <= v <= 2 ** 32 - 1:
        raise OverflowError(f"register value {v} does not fit in 32 bits")
    return v


def register_alloc(x=None):
    v = 0 if x is None else (x.value if isinstance(x, VirtualRegister) else _clip32(x))
    reg = VirtualRegister(v)
    _emit_write("register_alloc", reg, (x,) if isinstance(x, VirtualRegister) else ())
    return reg


def _emit_write(op, reg, reads):
    ctx = current()
    reg.writer = ctx.seq
    ctx.emit(op, "sync", reads, (reg,))


def register_move(dst, src):
    if not isinstance(dst, VirtualRegister):
        fail("register_move", f"dst must be a VirtualRegister, got {type(dst).__name__}")
    if dst.frozen:
        fail("register_move", "dst is a frozen loop-induction register and cannot be written")
    dst.value = src.value if isinstance(src, VirtualRegister) else _clip32(src)
    _emit_write("register_move", dst, (src,) if isinstance(src, VirtualRegister) else ())


def register_load(dst, src):
    op = "register_load"
    if not isinstance(dst, VirtualRegister):
        fail(op, f"dst must be a VirtualRegister, got {type(dst).__name__}")
    if not isinstance(src, NkiTensor) or src.size != 1:
        fail(op, "src must be a 1-element tensor in HBM or SBUF")
    if dst.frozen:
        fail(op, "dst is a frozen loop-induction register and cannot be written")
    val = np.asarray(read(src, op)).reshape(-1)[0]
    dst.value = int(val) if src.dtype.is_int else int(np.float32(val))
    _emit_write(op, dst, (src,))


def register_store(dst, src):
    op = "register_store"
    if not isinstance(dst, NkiTensor) or dst.size != 1:
        fail(op, "dst must be a 1-element tensor in HBM or SBUF")
    if not isinstance(src, VirtualRegister):
        fail(op, f"src must be a VirtualRegister, got {type(src).__name__}")
    write(dst, dt.cast(np.array([src.value]), dst.dtype).reshape(dst.shape), op)
    current().emit(op, "sync", (src,), (dst,))


def get_nc_version():
    from .enums import nc_version
    return nc_version(current().target.nc_version)


def get_nc_sub_version():
    return 0
