"""The engines' per-partition accumulator registers (VectorE's shared set; ScalarE's own 128 lanes).

VectorE accumulation instructions (exponential, range_select, select_reduce, tensor_scalar_reduce,
tensor_scalar_cumulative) share one register set: a chain must start with reset/reset_reduce.
"""

import numpy as np

from ..runtime import current
from ._common import fail, on_chip, store
from .enums import reduce_cmd as RC


def _regs(kind):
    ctx = current()
    regs = getattr(ctx, f"_{kind}_acc", None)
    if regs is None:
        regs = np.zeros(128, dtype=np.float32)
        setattr(ctx, f"_{kind}_acc", regs)
    return regs


def accumulate(kind, op, cmd, fn, identity, partial, p, reduce_res, init=None, negate=False):
    """Apply reduce_cmd to the accumulators with this instruction's per-partition partial result."""
    if not isinstance(cmd, RC):
        fail(op, f"reduce_cmd={cmd!r} must be an nki.isa.reduce_cmd value (C15)")
    regs = _regs(kind)
    start = np.float32(identity if init is None else init)
    if cmd is RC.reset:
        regs[:p] = start
    elif cmd in (RC.reset_reduce, RC.load_reduce):
        regs[:p] = fn(np.full(p, start, np.float32), partial)
    elif cmd is RC.reduce:
        regs[:p] = fn(regs[:p], partial)
    if reduce_res is not None:
        on_chip(op, "reduce_res", reduce_res)
        if reduce_res.shape[0] != p or reduce_res.size != p:
            fail(op, f"reduce_res must be ({p}, 1), got {reduce_res.shape} (C30)")
        store(op, reduce_res, (-regs[:p] if negate else regs[:p]).reshape(p, 1))


def vector_accumulate(op, cmd, fn, identity, partial, p, reduce_res, init=None, negate=False):
    accumulate("vector", op, cmd, fn, identity, partial, p, reduce_res, init, negate)


def scalar_accumulate(op, cmd, fn, identity, partial, p, reduce_res):
    accumulate("scalar", op, cmd, fn, identity, partial, p, reduce_res)
