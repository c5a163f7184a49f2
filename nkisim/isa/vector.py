"""Elementwise, copy, reduction and normalisation-statistics ops on VectorE (some also on GpSimd / ScalarE).

All arithmetic runs in fp32 (inputs upcast, result cast to dst.dtype on write); bit-vector ops run on the integer
bit patterns. Operands must agree in partitions and elements per partition (shapes may differ, C2).
"""

import math

import numpy as np

from .. import dtypes as dt
from .. import ops as alu_ops
from ..memory import psum, sbuf
from ..runtime import current
from ..tensor import NkiTensor, np_view, read
from ._common import (
    as_pf,
    check_engine,
    check_gpsimd_access,
    ew_operand,
    fail,
    fp32,
    free_size,
    mark_psum,
    not_both_psum,
    on_chip,
    require_version,
    same_layout,
    scalar_operand,
    store,
    ufunc_into,
)
from ._common import (
    emit as _emit,
)
from .enums import engine as Engine
from .enums import reduce_cmd as _RC

_INT32S = ("int32", "uint32")


def _ints(t):
    return np.asarray(read(t)).astype(np.int64)


_VECTOR_GPSIMD = (Engine.vector, Engine.gpsimd)


_UNKNOWN, _VECTOR = Engine.unknown, Engine.vector
_FP_STATE, _FP_IGNORE = alu_ops._FP_STATE, getattr(alu_ops, "_FP_IGNORE", None)
# ALU ops the fp32 fast path of tensor_tensor computes with one NumPy ufunc into dst (no Trn3-only or GpSimd op).
_FAST_TT = {} if _FP_STATE is None else {
    name: fn for name, (fn, _, _) in alu_ops.ALU_ARITH.items()
    if fn.__class__ is np.ufunc and name != "power" and name not in alu_ops.TRN3_ONLY_ALU}


def tensor_tensor(dst, data1, data2, op, engine=Engine.unknown, name=None):
    if (engine is _UNKNOWN or engine is _VECTOR) and dst.__class__ is NkiTensor and data1.__class__ is NkiTensor \
            and data2.__class__ is NkiTensor:
        # Fast path (the common instruction: fp32 [P, F] SBUF/PSUM operands, an arithmetic ufunc on VectorE):
        # every check of the general path below is decided by facts cached on the views (ew_operand), so only the
        # layout / PSUM-pair comparisons and the op lookup remain; the result, PSUM state and record are the same.
        f0, f1, f2 = ew_operand(dst), ew_operand(data1), ew_operand(data2)
        fn = _FAST_TT.get(getattr(op, "_nki_op", None))
        if f0 and f1 and f2 and fn is not None and f1[3] == f0[3] == f2[3] and f1[4] == f0[4] == f2[4] \
                and not (f1[2] and f2[2]):
            token = _FP_STATE.set(_FP_IGNORE)     # alu_ops.quiet_fp, inline
            try:
                fn(f1[0], f2[0], out=f0[0])
            finally:
                _FP_STATE.reset(token)
            alloc = dst.alloc
            alloc.written = True
            if f0[2]:
                mark_psum(dst, 2)
            current().emit_accesses("tensor_tensor", "vector", (data1, data2), (dst,), (f1[1], f2[1]), (f0[1],),
                                    {"op": op._nki_op, "p": f0[3], "n": f0[4], "dtype": "float32",
                                     "in_dtypes": ("float32", "float32")})
            return
    opn = "tensor_tensor"
    check_engine(opn, engine, _VECTOR_GPSIMD)
    on_chip(opn, "dst", dst)
    on_chip(opn, "data1", data1)
    on_chip(opn, "data2", data2)
    same_layout(opn, "dst", dst, data1=data1, data2=data2)
    not_both_psum(opn, "data1", data1, "data2", data2)
    oname, fn, kind = alu_ops.alu(op, "op", opn)
    if oname in alu_ops.TRN3_ONLY_ALU:
        require_version(opn, 4, f"op=nl.{oname}")
    if oname == "power":
        # nl.power runs on GpSimd, which cannot access PSUM (AWS nki.isa.tensor_tensor; C8)
        for nm, t in (("dst", dst), ("data1", data1), ("data2", data2)):
            if t.buffer is psum:
                fail(opn, f"op=nl.power runs on GpSimd, which cannot access PSUM; {nm} is in PSUM (C8)")
        if engine is Engine.vector:
            fail(opn, "op=nl.power runs on GpSimd only; engine=vector is not allowed (C29)")
    all_int32 = dst.dtype.name in _INT32S and data1.dtype.name in _INT32S and data2.dtype.name in _INT32S
    if engine is Engine.unknown:
        engine = Engine.gpsimd if (oname == "power" or all_int32) and dst.buffer is sbuf \
            and psum not in (data1.buffer, data2.buffer) else Engine.vector
    if engine is Engine.gpsimd:
        check_gpsimd_access(opn, engine, dst=dst, data1=data1, data2=data2)
    p = dst.shape[0]
    if kind == "bitvec":
        for nm, t in (("data1", data1), ("data2", data2), ("dst", dst)):
            if not t.dtype.is_int:
                fail(opn, f"bit-vector op nl.{oname} needs integer dtypes; {nm} is {t.dtype.name} (C26)")
        res = fn(as_pf(_ints(data1), p), as_pf(_ints(data2), p))
    elif engine is Engine.gpsimd and all_int32 and oname in ("add", "subtract", "multiply", "maximum", "minimum"):
        # GpSimd does exact 32-bit integer SIMD arithmetic (wrapping), not the fp32 path.
        res = fn(as_pf(_ints(data1), p), as_pf(_ints(data2), p))
        bits = 32
        res = ((res + 2 ** (bits - 1)) % 2 ** bits) - 2 ** (bits - 1) if dst.dtype.name == "int32" else res % 2 ** 32
    else:
        with alu_ops.quiet_fp():
            ufunc_into(opn, dst, fn, as_pf(fp32(data1), p), as_pf(fp32(data2), p))
        _emit(opn, engine._name_, (data1, data2), (dst,), dst, op=oname)
        return
    store(opn, dst, res)
    _emit(opn, engine.name, (data1, data2), (dst,), dst, op=oname)


def _unary_alu(op):
    name = getattr(op, "_nki_op", None)
    return name if name in alu_ops.ALU_UNARY and name not in alu_ops.ALU_ARITH else None


def _apply_scalar_op(opn, which, op, operand, reverse, x, p):
    """One stage of tensor_scalar: (x op operand), operand order swapped by reverse."""
    uname = _unary_alu(op)
    if uname is not None and not (operand is None or (not isinstance(operand, NkiTensor) and operand == 0)):
        fail(opn, f"{which}=nl.{uname} is a unary operator; its operand must be None or 0, got "
                  f"{type(operand).__name__ if isinstance(operand, NkiTensor) else operand!r} (C29)")
    if uname is not None:
        if uname in alu_ops.TRN3_ONLY_UNARY:
            require_version(opn, 4, f"{which}=nl.{uname}")
        with alu_ops.quiet_fp():
            return alu_ops.ALU_UNARY[uname](x), uname, "arith"
    oname, fn, kind = alu_ops.alu(op, which, opn)
    if oname in alu_ops.TRN3_ONLY_ALU:
        require_version(opn, 4, f"{which}=nl.{oname}")
    if operand is None:
        fail(opn, f"{which}=nl.{oname} needs an operand (C29)")
    if kind == "bitvec":
        if isinstance(operand, NkiTensor):
            val = as_pf(_ints(operand), p)
        elif isinstance(operand, (int, np.integer)):
            val = int(operand)
        else:
            fail(opn, f"bit-vector {which}=nl.{oname} needs an integer operand, got {operand!r} (C26)")
    else:
        val = scalar_operand(opn, f"operand for {which}", operand, p)
    with alu_ops.quiet_fp():
        return (fn(val, x) if reverse else fn(x, val)), oname, kind


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=Engine.unknown, name=None):
    opn = "tensor_scalar"
    check_engine(opn, engine, (Engine.vector, Engine.scalar, Engine.gpsimd))
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    same_layout(opn, "dst", dst, data=data)
    p = dst.shape[0]
    if op1 is None and operand1 is not None:
        fail(opn, f"operand1={operand1!r} is set but op1 is None; op1 and operand1 must both be None when unused "
                  "(C29)")
    n0 = getattr(op0, "_nki_op", None)
    n1 = getattr(op1, "_nki_op", None) if op1 is not None else None
    bitvec = n0 in alu_ops.ALU_BITVEC
    if op1 is not None and (n1 in alu_ops.ALU_BITVEC) != bitvec:
        fail(opn, f"op0=nl.{n0} and op1=nl.{n1} must both be arithmetic or both bit-vector ops (C29)")
    if bitvec:
        if not (data.dtype.is_int and dst.dtype.is_int):
            fail(opn, f"bit-vector ops need integer data/dst, got {data.dtype.name} -> {dst.dtype.name} (C26)")
        if engine not in (Engine.unknown, Engine.vector):
            fail(opn, "bit-vector tensor_scalar runs on VectorE only (C29)")
        x = as_pf(_ints(data), p)
    else:
        x = as_pf(fp32(data), p)
    if engine is Engine.scalar:
        pair = (n0, n1)
        if current().target.nc_version <= 3 and pair not in (("multiply", "add"), ("multiply", None), ("add", None)):
            fail(opn, f"ScalarE on {current().target.name} supports (multiply, add), (multiply, None), (add, None); "
                      f"got {pair} (C29)")
    if engine is Engine.gpsimd and n0 != "rsqrt":
        fail(opn, "GpSimd tensor_scalar supports only op0=nl.rsqrt (C29)")
    check_gpsimd_access(opn, engine, dst=dst, data=data)
    res, n0, _ = _apply_scalar_op(opn, "op0", op0, operand0, reverse0, x, p)
    if op1 is not None:
        res, n1, _ = _apply_scalar_op(opn, "op1", op1, operand1, reverse1, res, p)
    store(opn, dst, res)
    if engine is Engine.unknown:
        engine = Engine.vector
    reads = (data,) + tuple(o for o in (operand0, operand1) if isinstance(o, NkiTensor))
    _emit(opn, engine.name, reads, (dst,), dst, op=(n0, n1))


def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    opn = "scalar_tensor_tensor"
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    on_chip(opn, "operand1", operand1)
    same_layout(opn, "dst", dst, data=data, operand1=operand1)
    not_both_psum(opn, "data", data, "operand1", operand1)
    p = dst.shape[0]
    n0, f0, k0 = alu_ops.alu(op0, "op0", opn)
    n1, f1, k1 = alu_ops.alu(op1, "op1", opn)
    if "bitvec" in (k0, k1):
        fail(opn, "scalar_tensor_tensor supports arithmetic ops only (C29)")
    # operand0 may be any dtype ("All input tiles can be any supported NKI data type", nki.isa.scalar_tensor_tensor)
    s = scalar_operand(opn, "operand0", operand0, p, fp32_only=False)
    x = as_pf(fp32(data), p)
    t = as_pf(fp32(operand1), p)
    with alu_ops.quiet_fp():
        r = f0(s, x) if reverse0 else f0(x, s)
        r = f1(t, r) if reverse1 else f1(r, t)
    store(opn, dst, r)
    reads = (data, operand1) + ((operand0,) if isinstance(operand0, NkiTensor) else ())
    _emit(opn, "vector", reads, (dst,), dst, op=(n0, n1))


def tensor_copy(dst, src, engine=Engine.unknown, name=None):
    opn = "tensor_copy"
    check_engine(opn, engine, (Engine.vector, Engine.scalar, Engine.gpsimd))
    on_chip(opn, "dst", dst)
    on_chip(opn, "src", src)
    same_layout(opn, "dst", dst, src=src)
    if engine is Engine.scalar and current().target.nc_version <= 2:
        fail(opn, "tensor_copy is not supported on ScalarE on NeuronCore-v2; use activation(op=nl.copy) (C29)")
    if engine is Engine.gpsimd:
        check_gpsimd_access(opn, engine, dst=dst, src=src)
    vals = read(src)
    if src.dtype is dst.dtype:
        store(opn, dst, vals)  # bit-exact (store reshapes to dst.shape)
    else:
        store(opn, dst, dt.to_fp32(vals))
    eng = engine if engine is not Engine.unknown else Engine.vector
    _emit(opn, eng.name, (src,), (dst,), dst)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    opn = "tensor_copy_predicated"
    on_chip(opn, "dst", dst)
    on_chip(opn, "predicate", predicate)
    same_layout(opn, "dst", dst, predicate=predicate)
    if predicate.dtype.name not in ("uint8", "uint16", "uint32"):
        fail(opn, f"predicate dtype must be uint8, uint16 or uint32, got {predicate.dtype.name} (C26)")
    if isinstance(src, NkiTensor):
        on_chip(opn, "src", src)
        same_layout(opn, "dst", dst, src=src)
        not_both_psum(opn, "src", src, "predicate", predicate)
        if src.dtype is not dst.dtype:
            fail(opn, f"src dtype {src.dtype.name} and dst dtype {dst.dtype.name} must match (C26)")
        vals = np.reshape(read(src), dst.shape)
    else:
        vals = dt.cast(np.full(dst.shape, src, dtype=np.float64), dst.dtype)
    mask = np.reshape(read(predicate), dst.shape) != 0
    if reverse_pred:
        mask = ~mask
    cur = np.array(np_view(dst))
    store(opn, dst, np.where(mask, vals, cur))
    reads = (predicate, dst) + ((src,) if isinstance(src, NkiTensor) else ())
    _emit(opn, "vector", reads, (dst,), dst)


def memset(dst, value, engine=Engine.unknown, name=None):
    opn = "memset"
    check_engine(opn, engine, (Engine.vector, Engine.gpsimd))
    on_chip(opn, "dst", dst)
    check_gpsimd_access(opn, engine, dst=dst)
    if isinstance(value, NkiTensor) or not isinstance(value, (bool, int, float, np.integer, np.floating)):
        fail(opn, f"value must be a compile-time scalar, got {type(value).__name__} (C11)")
    if dst.dtype.kind == "packed" and value != 0:
        fail(opn, f"x4 packed dtype {dst.dtype.name} only supports value=0 (C26)")
    # An integral float (0.0) fills an integer tile exactly; AWS's nki-library memsets uint8 MX-scale tiles with
    # 0.0 (core/moe/moe_tkg/gate_up_projection_mx.py). A fractional one has no exact integer fill.
    if dst.dtype.is_int and isinstance(value, (float, np.floating)) and not float(value).is_integer():
        fail(opn, f"value={value!r} is a fractional float but dst dtype is {dst.dtype.name}; the value type must "
                  "match the dst dtype (C34)")
    # x4 words hold bit patterns: value 0 (0 or 0.0) is the all-zero word
    store(opn, dst, np.zeros(dst.shape, dst.dtype.storage) if dst.dtype.kind == "packed" else np.full(dst.shape, value))
    eng = engine if engine is not Engine.unknown else Engine.vector
    _emit(opn, eng.name, (), (dst,), dst)


def _norm_axes(opn, axis, t):
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(int(a) % t.ndim for a in axes))
    if not axes:
        fail(opn, "axis must name at least one free axis (C12)")
    if 0 in axes:
        fail(opn, "axis 0 (the partition dim) cannot be reduced; transpose first or matmul with ones (C12)")
    if axes != tuple(range(t.ndim - len(axes), t.ndim)):
        fail(opn, f"axis={axes} must be trailing contiguous free axes of a {t.ndim}-D tensor, e.g. "
                  f"{tuple(range(t.ndim - len(axes), t.ndim))} (C12)")
    return axes


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    opn = "tensor_reduce"
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    axes = _norm_axes(opn, axis, data)
    oname, fn, kind = alu_ops.alu(op, "op", opn)
    if not alu_ops.is_reduction(oname):
        fail(opn, f"op=nl.{oname} is not a legal reduction (add, subtract, multiply, maximum, minimum, "
                  "logical/bitwise and/or/xor) (C29)")
    kept = data.shape[:data.ndim - len(axes)]
    kept_free = math.prod(kept[1:]) if len(kept) > 1 else 1
    if dst.shape[0] != data.shape[0] or free_size(dst) != kept_free:
        fail(opn, f"dst shape {dst.shape} must hold {data.shape[0]} partitions x {kept_free} elements (data "
                  f"{data.shape} reduced over axes {axes}) (C2)")
    if negate and kind == "bitvec":
        fail(opn, f"negate=True applies to arithmetic reductions only; op=nl.{oname} is a bit-vector op (C29)")
    p = data.shape[0]
    x = np.asarray(read(data)).reshape(p, kept_free, -1)
    if kind == "bitvec":
        res = getattr(np, oname).reduce(x.astype(np.int64), axis=-1)
    else:
        x = dt.to_fp32(x)
        with alu_ops.quiet_fp():
            if oname in alu_ops.REDUCE_UFUNCS:
                res = alu_ops.REDUCE_UFUNCS[oname].reduce(x, axis=-1, dtype=np.float32)
            else:
                res = x[..., 0]
                for j in range(1, x.shape[-1]):
                    res = fn(res, x[..., j])
        if negate:
            res = -res
    store(opn, dst, res)
    _emit(opn, "vector", (data,), (dst,), data, op=oname)


def reciprocal(dst, data, name=None):
    opn = "reciprocal"
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    same_layout(opn, "dst", dst, data=data)
    with np.errstate(divide="ignore"):
        store(opn, dst, np.reshape(np.float32(1.0) / fp32(data), dst.shape))
    _emit(opn, "vector", (data,), (dst,), dst)


BN_STATS_FMAX = 512  # nl.tile_size.bn_stats_fmax


def bn_stats(dst, data, name=None):
    """Per partition, over the even and the odd elements: (count, mean, count*variance) -> dst[P, 6]."""
    opn = "bn_stats"
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    p, f = data.shape[0], free_size(data)
    if f > BN_STATS_FMAX:
        fail(opn, f"data has {f} elements per partition; bn_stats takes at most {BN_STATS_FMAX} (bn_stats_fmax, C12)")
    if dst.shape[0] != p or free_size(dst) != 6:
        fail(opn, f"dst must be ({p}, 6), got {dst.shape} (C30)")
    x = fp32(data).reshape(p, f).astype(np.float64)
    out = np.zeros((p, 6))
    for j, part in enumerate((x[:, 0::2], x[:, 1::2])):
        cnt = part.shape[1]
        mean = part.mean(axis=1) if cnt else np.zeros(p)
        m2 = ((part - mean[:, None]) ** 2).sum(axis=1) if cnt else np.zeros(p)
        out[:, 3 * j:3 * j + 3] = np.stack([np.full(p, cnt), mean, m2], axis=1)
    store(opn, dst, out.astype(np.float32))
    _emit(opn, "vector", (data,), (dst,), data)


def bn_aggr(dst, data, name=None):
    """Combine k bn_stats groups [P, 3*k... as 6-tuples] into (mean, variance) -> dst[P, 2]."""
    opn = "bn_aggr"
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    p, f = data.shape[0], free_size(data)
    if f % 3:
        fail(opn, f"data must hold (count, mean, count*var) triples per partition; {f} elements is not a multiple "
                  "of 3 (C30)")
    if dst.shape[0] != p or free_size(dst) != 2:
        fail(opn, f"dst must be ({p}, 2), got {dst.shape} (C30)")
    g = fp32(data).reshape(p, -1, 3).astype(np.float64)
    cnt, mean, m2 = g[..., 0], g[..., 1], g[..., 2]
    total = cnt.sum(axis=1)
    safe = np.where(total > 0, total, 1.0)
    gmean = (cnt * mean).sum(axis=1) / safe
    gm2 = (m2 + cnt * (mean - gmean[:, None]) ** 2).sum(axis=1)
    store(opn, dst, np.stack([gmean, gm2 / safe], axis=1).astype(np.float32))
    _emit(opn, "vector", (data,), (dst,), data)


# nki.isa.exponential parameter docs: supported dtypes per operand, and reduce_cmd values.
_EXP_SRC_DTYPES = ("float8_e4m3", "float8_e5m2", "float16", "bfloat16", "float32", "int8", "int16", "int32", "uint8",
                   "uint16", "uint32")
_EXP_DST_DTYPES = ("float8_e4m3", "float8_e5m2", "float16", "bfloat16", "float32", "tfloat32", "int8", "int16",
                   "int32", "uint8", "uint16")
_EXP_RES_DTYPES = ("float8_e4m3", "float8_e5m2", "float16", "bfloat16", "float32", "tfloat32")
_EXP_CMDS = (_RC.idle, _RC.reset_reduce, _RC.reduce, _RC.load_reduce)


def _check_dtype(opn, name, t, allowed):
    if t.dtype.name not in allowed:
        fail(opn, f"{name} dtype {t.dtype.name} is not supported; allowed: {', '.join(allowed)} (C26)")


def exponential(dst, src, max_value=0.0, reduce_res=None, reduce_cmd=_RC.idle, reduce_init=0.0, name=None):
    """Trn3 VectorE exp(src - max_value) with optional running sum in the VectorE accumulators."""
    from .accum import vector_accumulate
    from .enums import reduce_cmd as RC
    opn = "exponential"
    require_version(opn, 4)
    reduce_cmd = RC.idle if reduce_cmd is None else reduce_cmd
    on_chip(opn, "dst", dst)
    on_chip(opn, "src", src)
    same_layout(opn, "dst", dst, src=src)
    for nm, t in (("src", src), ("dst", dst)):
        if t.ndim > 4:
            fail(opn, f"{nm} has {t.ndim} dims; at most 4 (C26)")
    _check_dtype(opn, "src", src, _EXP_SRC_DTYPES)
    _check_dtype(opn, "dst", dst, _EXP_DST_DTYPES)
    if reduce_res is not None:
        _check_dtype(opn, "reduce_res", reduce_res, _EXP_RES_DTYPES)
    if not isinstance(reduce_cmd, RC) or reduce_cmd not in _EXP_CMDS:
        shown = reduce_cmd.name if isinstance(reduce_cmd, RC) else repr(reduce_cmd)
        fail(opn, f"reduce_cmd={shown} is not supported; allowed: {', '.join(c.name for c in _EXP_CMDS)} (C28)")
    if reduce_cmd is not RC.load_reduce and not (reduce_init is None or (
            isinstance(reduce_init, (int, float, np.floating)) and reduce_init == 0.0)):
        fail(opn, f"reduce_init={reduce_init!r} must be unset or 0.0 unless reduce_cmd=load_reduce (got "
                  f"{reduce_cmd.name}) (C28)")
    p = dst.shape[0]
    m = scalar_operand(opn, "max_value", max_value, p)
    with alu_ops.quiet_fp():
        e = np.exp((as_pf(fp32(src), p) - m).astype(np.float64)).astype(np.float32)
    store(opn, dst, e)
    init = None
    if reduce_cmd is RC.load_reduce:
        init = np.asarray(scalar_operand(opn, "reduce_init", 0.0 if reduce_init is None else reduce_init, p),
                          np.float32).reshape(-1)
    vector_accumulate(opn, reduce_cmd, np.add, 0.0, e.sum(axis=1, dtype=np.float32), p, reduce_res,
                      init=init)
    _emit(opn, "vector", (src,), (dst,) + ((reduce_res,) if reduce_res is not None else ()), dst)
