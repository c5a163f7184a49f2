"""ScalarE: activation (op(data * scale + bias)) with optional add-reduction into ScalarE's accumulators."""

import numpy as np

from .. import dtypes as dt
from .. import ops as alu_ops
from ..runtime import current
from ..tensor import NkiTensor
from ._common import as_pf, fail, fp32, free_size, on_chip, same_layout, scalar_operand
from ._common import store as _store
from .accum import scalar_accumulate
from .enums import reduce_cmd as RC


def _bias(op, bias, p):
    if bias is None:
        return np.float32(0.0)
    if isinstance(bias, NkiTensor):
        on_chip(op, "bias", bias)
        if bias.shape[0] != p or free_size(bias) != 1:
            fail(op, f"bias must be a ({p}, 1) tensor (free dim 1), got shape {bias.shape} (C11)")
        if bias.dtype is dt.tfloat32:
            fail(op, "bias cannot be tfloat32 (any other dtype is allowed) (C11)")
        return as_pf(fp32(bias), p)
    if current().target.nc_version < 3:
        fail(op, "a scalar bias requires NeuronCore-v3 or newer; pass a (P, 1) tensor (C19)")
    return scalar_operand(op, "bias", bias, p)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=RC.idle,
               name=None):
    opn = "activation"
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    same_layout(opn, "dst", dst, data=data)
    p = dst.shape[0]
    aname, fn = alu_ops.activation(op, opn)
    if aname == "reciprocal" and bias is not None and current().target.nc_version < 3:
        fail(opn, "op=nl.reciprocal does not support a bias on NeuronCore-v2 (AWS 'NKI Engine Selection') (C29)")
    if reduce_op is not None and alu_ops.op_name(reduce_op, f"{opn}: reduce_op") != "add":
        fail(opn, "reduce_op must be nl.add (C29)")
    if reduce_res is not None and reduce_op is None and reduce_cmd is not RC.idle:
        fail(opn, "reduce_res with a reduce_cmd needs reduce_op=nl.add (C28)")
    s = scalar_operand(opn, "scale", scale, p)
    b = _bias(opn, bias, p)
    x = as_pf(fp32(data), p) * s + b
    alu_ops.check_activation_range(aname, x, opn)
    y = alu_ops.apply_activation(fn, x)
    _store(opn, dst, y)
    if reduce_op is not None or reduce_res is not None:
        scalar_accumulate(opn, reduce_cmd, np.add, 0.0, y.sum(axis=1, dtype=np.float32), p, reduce_res)
    reads = (data,) + tuple(t for t in (bias, scale) if isinstance(t, NkiTensor))
    writes = (dst,) + ((reduce_res,) if reduce_res is not None else ())
    current().emit(opn, "scalar", reads, writes, p=p, n=free_size(dst), dtype=dst.dtype.name,
                   in_dtypes=(data.dtype.name,), op=aname, reduce=reduce_res is not None)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    """Legacy form of activation(..., reduce_cmd=reset_reduce, reduce_res=...)."""
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=RC.reset_reduce, name=name)
