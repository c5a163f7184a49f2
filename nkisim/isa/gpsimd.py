"""GpSimd: iota and affine_select (affine index expressions over partitions and free dims)."""

import math

import numpy as np

from .. import _nl_math as _nlm
from .. import dtypes as dt
from .. import ops as alu_ops
from ..memory import sbuf
from ..runtime import current
from ..tensor import NkiTensor, read
from ._common import as_pf, fail, free_size, on_chip, same_layout


def _affine(op, dst, pattern, offset, channel_multiplier):
    """int64 grid offset + c*channel_multiplier + sum(i_k * s_k) with shape [P, F]."""
    pattern = [[int(s), int(n)] for s, n in pattern]
    if len(pattern) > 4:
        fail(op, f"pattern has {len(pattern)} levels; at most 4 (C14)")
    count = math.prod([n for _, n in pattern]) if pattern else 1
    p, f = dst.shape[0], free_size(dst)
    if count != f:
        fail(op, f"pattern counts multiply to {count} but dst has {f} elements per partition (C14)")
    val = np.zeros([n for _, n in pattern] or [1], dtype=np.int64)
    for k, (s, n) in enumerate(pattern):
        shp = [1] * len(pattern)
        shp[k] = n
        val = val + (np.arange(n, dtype=np.int64) * s).reshape(shp)
    ch = (np.arange(p, dtype=np.int64) * int(channel_multiplier)).reshape(p, 1)
    return ch + int(offset) + val.reshape(1, -1)


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    op = "iota"
    on_chip(op, "dst", dst, (sbuf,))
    v = _affine(op, dst, pattern, offset, channel_multiplier)
    v = ((v + 2 ** 31) % 2 ** 32) - 2 ** 31  # int32 arithmetic
    from ._common import store
    store(op, dst, v)
    current().emit(op, "gpsimd", (), (dst,), p=dst.shape[0], n=free_size(dst), dtype=dst.dtype.name)


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=_nlm.equal, offset=0,
                  name=None):
    op = "affine_select"
    on_chip(op, "dst", dst, (sbuf,))
    on_chip(op, "on_true_tile", on_true_tile, (sbuf,))
    same_layout(op, "dst", dst, on_true_tile=on_true_tile)
    if isinstance(on_false_value, NkiTensor) or not isinstance(on_false_value, (int, float, np.floating,
                                                                                 np.integer)):
        fail(op, f"on_false_value must be an fp32 scalar, got {type(on_false_value).__name__} (C11)")
    cname = "equal" if cmp_op is None else alu_ops.op_name(cmp_op, f"{op}: cmp_op")
    if cname not in ("equal", "not_equal", "greater", "greater_equal", "less", "less_equal"):
        fail(op, f"cmp_op=nl.{cname} must be a comparison (C29)")
    p = dst.shape[0]
    v = _affine(op, dst, pattern, offset, channel_multiplier).astype(np.float64)
    pred = alu_ops.ALU_ARITH[cname][0](v, 0.0) != 0
    vals = read(on_true_tile)
    if on_true_tile.dtype is dst.dtype:
        out = np.where(pred, as_pf(np.asarray(vals), p), dt.cast(np.float32(on_false_value), dst.dtype))
    else:
        out = np.where(pred, as_pf(dt.to_fp32(vals), p), np.float32(on_false_value))
    from ._common import store
    store(op, dst, out)
    current().emit(op, "gpsimd", (on_true_tile,), (dst,), p=p, n=free_size(dst), dtype=dst.dtype.name)
