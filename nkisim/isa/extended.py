"""The rarer VectorE / ScalarE / GpSimd instructions: scans, accumulating reductions, selects, top-k helpers,
gathers, shuffles, cross-partition reduction and sequence bounds.

Same conventions as vector.py: operands are checked first (failures name op, operand and limit), arithmetic runs in
fp32, results are cast to dst.dtype on write, each call records exactly one instruction. VectorE accumulation
instructions share the VectorE accumulator registers (accum.py); activate2 uses ScalarE's own.
"""

import numpy as np

from .. import _nl_math as _nlm
from .. import dtypes as dt
from .. import ops as alu_ops
from ..memory import sbuf
from ..tensor import NkiTensor, np_view, read
from ._common import (
    as_pf,
    fail,
    fp32,
    free_size,
    legal_starts,
    not_both_psum,
    on_chip,
    require_version,
    same_layout,
    scalar_operand,
    start_partition,
    store,
)
from ._common import (
    emit as _emit,
)
from .accum import _regs, scalar_accumulate, vector_accumulate
from .enums import reduce_cmd as RC

__all__ = [
    "tensor_tensor_scan", "tensor_scalar_reduce", "tensor_scalar_cumulative", "activate2", "range_select",
    "select_reduce", "max8", "nc_find_index8", "nc_match_replace8", "topk", "nonzero_with_count",
    "nc_stream_shuffle", "nc_n_gather", "local_gather", "tensor_partition_reduce", "sequence_bounds",
]

MAX8_MIN, MAX8_MAX = 8, 16384          # elements per partition for max8 / nc_find_index8
LOCAL_GATHER_ELEMS = (1, 2, 4, 8, 16, 32)
LOCAL_GATHER_MAX_INDICES = 4096         # per GpSimd core
_REDUCE_FNS = {n: alu_ops.ALU_ARITH[n][0] for n in ("add", "multiply", "maximum", "minimum", "abs_max", "abs_min")}
_NL_REDUCTIONS = {"max": "maximum", "min": "minimum", "sum": "add", "prod": "multiply"}
FP32_MIN = alu_ops.FP32_MIN  # the only legal range_select on_false_value
_CMPS = ("equal", "less", "less_equal", "greater", "greater_equal")


def _arith(opn, which, op):
    """(name, fn) of an arithmetic (non bit-vector) ALU op."""
    oname, fn, kind = alu_ops.alu(op, which, opn)
    if kind == "bitvec":
        fail(opn, f"{which}=nl.{oname} is a bit-vector op; only arithmetic ops are supported (C29)")
    if oname in alu_ops.TRN3_ONLY_ALU:
        require_version(opn, 4, f"{which}=nl.{oname}")
    return oname, fn


def _reduce_name(opn, which, op, allowed):
    """Name of a reduction operator given as nl.add/nl.maximum/... (or nl.max/nl.min/nl.sum)."""
    name = getattr(op, "_nki_op", None)
    if name is None and getattr(op, "__module__", "") == _nlm.__name__:
        name = _NL_REDUCTIONS.get(getattr(op, "__name__", ""))
    if name not in allowed:
        shown = f"nl.{name}" if name else repr(op)
        fail(opn, f"{which}={shown} is not supported; allowed: {', '.join('nl.' + a for a in allowed)} (C29)")
    return name


def _check_cmd(opn, cmd, allowed):
    if not isinstance(cmd, RC):
        fail(opn, f"reduce_cmd={cmd!r} must be an nki.isa.reduce_cmd value (C15)")
    if cmd not in allowed:
        fail(opn, f"reduce_cmd={cmd.name} is not supported; allowed: {', '.join(c.name for c in allowed)} (C28)")


def _row_reduce(name, x):
    """Per-partition reduction of an fp32 [P, F] array."""
    with alu_ops.quiet_fp():
        if name in ("abs_max", "abs_min"):
            return (np.max if name == "abs_max" else np.min)(np.abs(x), axis=1)
        return alu_ops.REDUCE_UFUNCS[name].reduce(x, axis=1, dtype=np.float32)


def _vector_or_scalar(opn, name, x, p, fp32_only=True):
    """A scalar or (P, 1) operand as a [P, 1] fp32 array (or a 0-d float)."""
    v = scalar_operand(opn, name, x, p, fp32_only=fp32_only)
    if v is None:
        fail(opn, f"{name} is required (C11)")
    return v


# ---- scans and accumulating reductions (VectorE) ------------------------------------------------------------

def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition: r[:, 0] = op1(op0(data0[:, 0], initial), data1[:, 0]),
    r[:, i] = op1(op0(data0[:, i], r[:, i-1]), data1[:, i])."""
    opn = "tensor_tensor_scan"
    on_chip(opn, "dst", dst)
    on_chip(opn, "data0", data0)
    on_chip(opn, "data1", data1)
    same_layout(opn, "dst", dst, data0=data0, data1=data1)
    not_both_psum(opn, "data0", data0, "data1", data1)
    n0, f0 = _arith(opn, "op0", op0)
    n1, f1 = _arith(opn, "op1", op1)
    p = dst.shape[0]
    init = _vector_or_scalar(opn, "initial", initial, p, fp32_only=False)
    a = as_pf(fp32(data0), p)
    b = as_pf(fp32(data1), p)
    out = np.empty(a.shape, np.float32)
    prev = np.broadcast_to(np.asarray(init, np.float32).reshape(-1), (p,)).astype(np.float32)
    with alu_ops.quiet_fp():
        for i in range(a.shape[1]):
            t = f0(prev, a[:, i]) if reverse0 else f0(a[:, i], prev)
            prev = (f1(b[:, i], t) if reverse1 else f1(t, b[:, i])).astype(np.float32)
            out[:, i] = prev
    store(opn, dst, out)
    _emit(opn, "vector", (data0, data1, initial), (dst,), dst, op=(n0, n1))


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=RC.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """dst = data op0 operand0; the free-dim reduce_op of the result goes through the VectorE accumulators.

    reduce_cmd: reset_reduce (identity of reduce_op, then reduce), reduce (on top of the registers), load_reduce
    (reduce_init, then reduce). reduce_res=None leaves the result in the registers (chaining across tiles);
    reduce_res_negate writes -registers.
    """
    from .vector import _apply_scalar_op
    opn = "tensor_scalar_reduce"
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    same_layout(opn, "dst", dst, data=data)
    _check_cmd(opn, reduce_cmd, (RC.reset_reduce, RC.reduce, RC.load_reduce))
    if getattr(op0, "_nki_op", None) in alu_ops.ALU_BITVEC:
        fail(opn, f"op0=nl.{op0._nki_op} is a bit-vector op; only arithmetic ops are supported (C29)")
    if reverse0:
        fail(opn, "reverse0=True is not supported yet (NKI 0.6) (C29)")
    rname = _reduce_name(opn, "reduce_op", reduce_op, ("add", "multiply", "maximum", "minimum"))
    p = dst.shape[0]
    init = None
    if reduce_cmd is RC.load_reduce:
        if reduce_init is None:
            fail(opn, "reduce_cmd=load_reduce needs reduce_init (C28)")
        init = np.asarray(_vector_or_scalar(opn, "reduce_init", reduce_init, p), np.float32).reshape(-1)
    elif reduce_init is not None:
        fail(opn, f"reduce_init may only be set with reduce_cmd=load_reduce (got {reduce_cmd.name}) (C28)")
    res, n0, _ = _apply_scalar_op(opn, "op0", op0, operand0, False, as_pf(fp32(data), p), p)
    res = np.asarray(res, np.float32)
    store(opn, dst, res)
    vector_accumulate(opn, reduce_cmd, _REDUCE_FNS[rname], alu_ops.reduce_identity(rname), _row_reduce(rname, res),
                      p, reduce_res, init=init, negate=bool(reduce_res_negate))
    _emit(opn, "vector", (data, operand0, reduce_init), (dst, reduce_res), dst, op=(n0, rname))


# nki.isa.tensor_scalar_cumulative: "Input / output dtypes are restricted to BF16, FP16, FP32, FP8, UINT8, UINT16,
# INT8, INT16"
_CUMULATIVE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3", "float8_e5m2", "float8_e4m3fn", "uint8",
                      "uint16", "int8", "int16")


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=RC.reset_reduce, name=None):
    """Running scan in the VectorE accumulators: reg = op1(op0(x_i, imm0), reg); dst_i = reg.

    The register starts at op1's identity (reset_reduce), its current value (reduce) or imm1 (load_reduce); the
    free dims are scanned in row-major order and the final value stays in the registers.
    """
    opn = "tensor_scalar_cumulative"
    on_chip(opn, "dst", dst)
    on_chip(opn, "src", src)
    same_layout(opn, "dst", dst, src=src)
    for nm, t in (("src", src), ("dst", dst)):
        if t.dtype.name not in _CUMULATIVE_DTYPES:
            fail(opn, f"{nm} dtype {t.dtype.name} is not supported; allowed: {', '.join(_CUMULATIVE_DTYPES)} "
                      "(int32/uint32 are an ISA limitation) (C26)")
    _check_cmd(opn, reduce_cmd, (RC.reset_reduce, RC.reduce, RC.load_reduce))
    n0, f0 = _arith(opn, "op0", op0)
    n1 = _reduce_name(opn, "op1", op1, ("add", "subtract", "multiply", "maximum", "minimum"))
    p = dst.shape[0]
    a = _vector_or_scalar(opn, "imm0", imm0, p)
    regs = _regs("vector")
    if reduce_cmd is RC.load_reduce:
        if imm1 is None:
            fail(opn, "reduce_cmd=load_reduce needs imm1 (the initial accumulator value) (C28)")
        reg = np.broadcast_to(np.asarray(_vector_or_scalar(opn, "imm1", imm1, p), np.float32).reshape(-1), (p,))
    elif reduce_cmd is RC.reset_reduce:
        reg = np.full(p, alu_ops.reduce_identity(n1), np.float32)
    else:
        reg = regs[:p].copy()
    with alu_ops.quiet_fp():
        x = np.asarray(f0(as_pf(fp32(src), p), a), np.float32)
        if n1 == "subtract":
            out = np.empty_like(x)
            reg = reg.astype(np.float32)
            for i in range(x.shape[1]):
                reg = (x[:, i] - reg).astype(np.float32)
                out[:, i] = reg
        else:
            uf = alu_ops.REDUCE_UFUNCS[n1]
            out = uf.accumulate(np.concatenate([reg.reshape(p, 1).astype(np.float32), x], axis=1), axis=1,
                                dtype=np.float32)[:, 1:]
    if out.shape[1]:
        regs[:p] = out[:, -1]
    else:
        regs[:p] = reg
    store(opn, dst, out)
    _emit(opn, "vector", (src, imm0, imm1), (dst,), dst, op=(n0, n1))


# ---- ScalarE activate2 (Trn3) ----------------------------------------------------------------------------------

_ACT2_PAIRS = {("multiply", "add"), ("multiply", "subtract"), ("multiply", "bypass"), ("add", "bypass"),
               ("subtract", "bypass"), ("bypass", "bypass")}


def activate2(dst, op, data, imm0, imm1, op0, op1, relu_param=0.0, reverse0=False, reverse1=False, reduce_op=None,
              reduce_res=None, reduce_cmd=RC.idle, name=None):
    """Trn3 ScalarE: op((data op0 imm0) op1 imm1) with an optional free-dim reduction into ScalarE's registers."""
    opn = "activate2"
    require_version(opn, 4)
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    same_layout(opn, "dst", dst, data=data)
    p = dst.shape[0]
    n0 = "bypass" if op0 is None else alu_ops.op_name(op0, f"{opn}: op0")
    n1 = "bypass" if op1 is None else alu_ops.op_name(op1, f"{opn}: op1")
    if (n0, n1) not in _ACT2_PAIRS:
        fail(opn, f"(op0, op1)=(nl.{n0}, nl.{n1}) is not supported; allowed pairs: "
                  + ", ".join(f"({a}, {b})" for a, b in sorted(_ACT2_PAIRS)) + " (C29)")
    if reverse0 and n0 == "bypass":
        fail(opn, "reverse0 requires op0 to be set (not nl.bypass) (C29)")
    if reverse1 and n1 == "bypass":
        fail(opn, "reverse1 requires op1 to be set (not nl.bypass) (C29)")
    if isinstance(imm0, NkiTensor) and isinstance(imm1, NkiTensor) and imm0.dtype is not imm1.dtype:
        fail(opn, f"imm0 ({imm0.dtype.name}) and imm1 ({imm1.dtype.name}) tensors must have the same dtype (C26)")
    aname = alu_ops.op_name(op, f"{opn}: op")
    if aname != "prelu":
        aname, afn = alu_ops.activation(op, opn)
    x = as_pf(fp32(data), p)
    with alu_ops.quiet_fp():
        for nm, imm, rev, which in ((n0, imm0, reverse0, "imm0"), (n1, imm1, reverse1, "imm1")):
            if nm == "bypass":
                continue
            v = _vector_or_scalar(opn, which, imm, p, fp32_only=False)
            fn = alu_ops.ALU_ARITH[nm][0]
            x = np.asarray(fn(v, x) if rev else fn(x, v), np.float32)
        if aname == "prelu":
            alpha = _vector_or_scalar(opn, "relu_param", relu_param, p, fp32_only=False)
            y = np.where(x > 0, x, x * alpha).astype(np.float32)
        else:
            y = alu_ops.apply_activation(afn, x)
    store(opn, dst, y)
    if reduce_op is not None:
        rname = _reduce_name(opn, "reduce_op", reduce_op, ("add", "maximum", "minimum", "abs_max", "abs_min"))
    elif reduce_cmd in (RC.reduce, RC.reset_reduce, RC.load_reduce):
        fail(opn, f"reduce_cmd={reduce_cmd.name} needs reduce_op (C28)")
    else:
        rname = "add"
    if reduce_op is not None or reduce_res is not None or reduce_cmd is RC.reset:
        scalar_accumulate(opn, reduce_cmd, _REDUCE_FNS[rname], alu_ops.reduce_identity(rname),
                          _row_reduce(rname, y), p, reduce_res)
    _emit(opn, "scalar", (data, imm0, imm1, relu_param), (dst, reduce_res), dst, op=(n0, n1, aname))


# ---- selects with max-reduction (VectorE) --------------------------------------------------------------------

def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=RC.reset_reduce, reduce_res=None,
                 reduce_op=_nlm.maximum, range_start=0, on_false_value=FP32_MIN, name=None):
    """NC-v3+: keep element j where comp_op0(range_start+j, bound0) & comp_op1(range_start+j, bound1), else
    on_false_value (must be FP32_MIN); the row max goes through the VectorE accumulators."""
    opn = "range_select"
    require_version(opn, 3)
    on_chip(opn, "dst", dst)
    on_chip(opn, "on_true_tile", on_true_tile)
    same_layout(opn, "dst", dst, on_true_tile=on_true_tile)
    if not on_true_tile.dtype.is_float:
        fail(opn, f"on_true_tile must have a floating-point dtype, got {on_true_tile.dtype.name} (C26)")
    c0 = alu_ops.op_name(comp_op0, f"{opn}: comp_op0")
    c1 = alu_ops.op_name(comp_op1, f"{opn}: comp_op1")
    for which, c in (("comp_op0", c0), ("comp_op1", c1)):
        if c not in _CMPS:
            fail(opn, f"{which}=nl.{c} must be one of {', '.join('nl.' + x for x in _CMPS)} (C29)")
    _check_cmd(opn, reduce_cmd, (RC.idle, RC.reset, RC.reduce, RC.reset_reduce))
    _reduce_name(opn, "reduce_op", reduce_op, ("maximum",))
    # The value is an fp32 immediate: the literal -3.4028235e38 (the nki-library's _FLOAT32_MIN) is FP32_MIN once
    # rounded to fp32, although the Python doubles differ.
    if isinstance(on_false_value, NkiTensor) or np.float32(on_false_value) != np.float32(FP32_MIN):
        fail(opn, f"on_false_value={on_false_value!r} must be FP32_MIN (-3.4028235e38), a hardware constraint (C11)")
    if not isinstance(range_start, (int, np.integer)) or isinstance(range_start, bool):
        fail(opn, f"range_start={range_start!r} must be a compile-time integer (C11)")
    p, f = dst.shape[0], free_size(dst)
    if abs(int(range_start)) + f > 2 ** 24:
        fail(opn, f"range_start + free index reaches {abs(int(range_start)) + f}; must stay within 2^24 (compared "
                  "in fp32) (C11)")
    b0 = _vector_or_scalar(opn, "bound0", bound0, p)
    b1 = _vector_or_scalar(opn, "bound1", bound1, p)
    idx = (np.float32(range_start) + np.arange(f, dtype=np.float32)).reshape(1, f)
    mask = (alu_ops.ALU_ARITH[c0][0](idx, b0) != 0) & (alu_ops.ALU_ARITH[c1][0](idx, b1) != 0)
    out = np.where(mask, as_pf(fp32(on_true_tile), p), np.float32(FP32_MIN)).astype(np.float32)
    store(opn, dst, out)
    _vector_reduce_max(opn, reduce_cmd, out, p, reduce_res)
    _emit(opn, "vector", (on_true_tile, bound0, bound1), (dst, reduce_res), dst, op=(c0, c1))


def _vector_reduce_max(opn, cmd, out, p, reduce_res):
    if reduce_res is not None:
        if not reduce_res.dtype.is_float:
            fail(opn, f"reduce_res must have a floating-point dtype, got {reduce_res.dtype.name} (C26)")
        if cmd in (RC.idle, RC.reset):
            fail(opn, f"reduce_res with reduce_cmd={cmd.name}: the VectorE accumulators are not updated (state "
                      "unknown); use reset_reduce/reduce (C28)")
    vector_accumulate(opn, cmd, np.maximum, -np.inf, out.max(axis=1, initial=-np.inf), p, reduce_res)


_PRED_DTYPES = ("int8", "uint8", "int16", "uint16")


def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=RC.idle, reduce_op=_nlm.maximum,
                  reverse_pred=False, name=None):
    """dst = where(predicate, on_true, on_false) with an optional max-reduction through the VectorE accumulators."""
    opn = "select_reduce"
    on_chip(opn, "dst", dst)
    on_chip(opn, "predicate", predicate)
    on_chip(opn, "on_true", on_true)
    same_layout(opn, "dst", dst, predicate=predicate, on_true=on_true)
    not_both_psum(opn, "on_true", on_true, "predicate", predicate)
    if predicate.dtype.name not in _PRED_DTYPES:
        fail(opn, f"predicate dtype must be one of {', '.join(_PRED_DTYPES)}, got {predicate.dtype.name} (C26)")
    if on_true.dtype.name in ("tfloat32", "int32", "uint32"):
        fail(opn, f"on_true dtype {on_true.dtype.name} is not supported (tfloat32/int32/uint32) (C26)")
    _check_cmd(opn, reduce_cmd, (RC.idle, RC.reset, RC.reduce, RC.reset_reduce))
    _reduce_name(opn, "reduce_op", reduce_op, ("maximum",))
    p = dst.shape[0]
    fv = _vector_or_scalar(opn, "on_false", on_false, p, fp32_only=not isinstance(on_false, NkiTensor))
    mask = as_pf(np.asarray(read(predicate)), p) != 0
    if reverse_pred:
        mask = ~mask
    out = np.where(mask, as_pf(fp32(on_true), p), fv).astype(np.float32)
    store(opn, dst, out)
    if reduce_res is not None or reduce_cmd is not RC.idle:
        _vector_reduce_max(opn, reduce_cmd, out, p, reduce_res)
    _emit(opn, "vector", (predicate, on_true, on_false), (dst, reduce_res), dst)


# ---- top-k helpers (VectorE / GpSimd) -------------------------------------------------------------------------

def _max8_range(opn, name, t):
    f = free_size(t)
    if not MAX8_MIN <= f <= MAX8_MAX:
        fail(opn, f"{name} has {f} elements per partition; must be between {MAX8_MIN} and {MAX8_MAX} (C12)")
    if t.ndim > 4:
        fail(opn, f"{name} has {t.ndim} dims; at most 3-D plus the partition dim (C30)")


def _vals8(opn, vals, p):
    on_chip(opn, "vals", vals)
    if vals.shape[0] != p or free_size(vals) != 8:
        fail(opn, f"vals must hold exactly 8 elements per partition in {p} partitions, got shape {vals.shape} (C30)")
    return as_pf(fp32(vals), p)


def _index_dst(opn, name, t, p):
    on_chip(opn, name, t)
    if t.shape[0] != p or free_size(t) != 8:
        fail(opn, f"{name} must be ({p}, 8), got {t.shape} (C30)")
    if t.dtype.name not in ("uint16", "uint32"):
        fail(opn, f"{name} dtype must be uint16 or uint32, got {t.dtype.name} (C26)")


def max8(dst, src, name=None):
    """The 8 largest values per partition (fp32 compare), descending -> dst [P, 8]."""
    opn = "max8"
    on_chip(opn, "dst", dst)
    on_chip(opn, "src", src)
    _max8_range(opn, "src", src)
    p = src.shape[0]
    if dst.ndim != 2 or dst.shape != (p, 8):
        fail(opn, f"dst must be a 2-D ({p}, 8) tile, got {dst.shape} (C30)")
    x = as_pf(fp32(src), p)
    top = -np.sort(-x, axis=1, kind="stable")[:, :8]
    store(opn, dst, top)
    _emit(opn, "vector", (src,), (dst,), src)


def _find8(x, v):
    """Index of the k-th occurrence of each of the 8 values (k = earlier equal values in the list) or -1."""
    eq = x[:, None, :] == v[:, :, None]                                   # [P, 8, F]
    dup = (v[:, :, None] == v[:, None, :]) & np.tri(8, k=-1, dtype=bool)  # [P, 8, 8] earlier equal values
    occ = dup.sum(axis=2)                                                  # [P, 8]
    rank = np.cumsum(eq, axis=2)
    hit = eq & (rank == (occ + 1)[:, :, None])
    found = hit.any(axis=2)
    return np.where(found, hit.argmax(axis=2), -1)


def nc_find_index8(dst, data, vals, name=None):
    """Per partition, the index of the first occurrence of each of the 8 vals in data (duplicated vals advance
    through later occurrences; a value not found gives all-ones)."""
    opn = "nc_find_index8"
    on_chip(opn, "data", data)
    _max8_range(opn, "data", data)
    p = data.shape[0]
    _index_dst(opn, "dst", dst, p)
    v = _vals8(opn, vals, p)
    idx = _find8(as_pf(fp32(data), p), v)
    store(opn, dst, np.where(idx < 0, dst.dtype.max, idx))
    _emit(opn, "vector", (data, vals), (dst,), data)


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    """Replace the first occurrence of each of the 8 vals in data by imm (indices optionally to dst_idx)."""
    opn = "nc_match_replace8"
    on_chip(opn, "dst", dst)
    on_chip(opn, "data", data)
    same_layout(opn, "dst", dst, data=data)
    p = data.shape[0]
    if isinstance(imm, NkiTensor) or not isinstance(imm, (int, float, np.integer, np.floating)):
        fail(opn, f"imm must be a compile-time float scalar, got {type(imm).__name__} (C11)")
    if dst_idx is not None:
        _index_dst(opn, "dst_idx", dst_idx, p)
    v = _vals8(opn, vals, p)
    x = as_pf(fp32(data), p).copy()
    idx = _find8(x, v)
    rows = np.repeat(np.arange(p), 8).reshape(p, 8)
    ok = idx >= 0
    x[rows[ok], idx[ok]] = np.float32(imm)
    store(opn, dst, x)
    if dst_idx is not None:
        store(opn, dst_idx, np.where(ok, idx, dst_idx.dtype.max))
    _emit(opn, "vector", (data, vals), (dst, dst_idx), dst)


def topk(val_dst, idx_dst, src, n, name=None):
    """GpSimd top-k per 16-partition group. Each group's src is a snake (element e at partition e % 16, free
    position e // 16) with n active bf16 elements; k = val_dst's free size. The k largest values (ascending) and
    their snake indices are written in the same snake layout to val_dst / idx_dst."""
    opn = "topk"
    for nm, t in (("val_dst", val_dst), ("idx_dst", idx_dst), ("src", src)):
        on_chip(opn, nm, t, (sbuf,))
    p = src.shape[0]
    if p % 16:
        fail(opn, f"partition dim {p} must be a multiple of 16 (C30)")
    if src.dtype is not dt.bfloat16 or val_dst.dtype is not dt.bfloat16:
        fail(opn, f"src and val_dst must be bfloat16, got {src.dtype.name} / {val_dst.dtype.name} (C26)")
    if idx_dst.dtype is not dt.uint32:
        fail(opn, f"idx_dst must be uint32, got {idx_dst.dtype.name} (C26)")
    for nm, t in (("val_dst", val_dst), ("idx_dst", idx_dst)):
        if t.ndim != 2 or t.shape[0] != p:
            fail(opn, f"{nm} must be 2-D [{p}, k], got {t.shape} (C30)")
    k = val_dst.shape[1]
    if idx_dst.shape[1] != k:
        fail(opn, f"idx_dst free size {idx_dst.shape[1]} must equal val_dst's ({k}) (C30)")
    if not isinstance(n, (int, np.integer)) or not 8 <= n < 65536:
        fail(opn, f"n={n!r} must be an integer with 8 <= n < 65536 (C30)")
    if not 1 <= k < 32768 or k > n:
        fail(opn, f"k={k} (val_dst free size) must satisfy 1 <= k < 32768 and k <= n={n} (C30)")
    need = -(-int(n) // 16)
    if free_size(src) < need:
        fail(opn, f"src has {free_size(src)} elements per partition; n={n} needs at least ceil(n/16)={need} (C30)")
    x = as_pf(fp32(src), p)
    vals = np.array(np_view(val_dst))
    idxs = np.array(np_view(idx_dst))
    vf, idf = dt.to_fp32(vals), idxs.astype(np.int64)
    for g in range(p // 16):
        snake = x[16 * g:16 * g + 16].T.reshape(-1)[:n]       # element e = x[e % 16, e // 16]
        order = np.argsort(-snake, kind="stable")[:k][::-1]   # k largest, ascending
        for j, e in enumerate(order):
            vf[16 * g + j % 16, j // 16] = snake[e]
            idf[16 * g + j % 16, j // 16] = e
    store(opn, val_dst, vf)
    store(opn, idx_dst, idf)
    _emit(opn, "gpsimd", (src,), (val_dst, idx_dst), src, k=k, n_active=int(n))


def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """NC-v3+ GpSimd: on partitions 0, 16, ..., 112 only, dst = [indices of nonzeros + index_offset, padding...,
    count]; other partitions of dst are left unchanged."""
    opn = "nonzero_with_count"
    require_version(opn, 3)
    on_chip(opn, "dst", dst, (sbuf,))
    on_chip(opn, "src", src, (sbuf,))
    if src.dtype.name not in ("float32", "int32"):
        fail(opn, f"src dtype must be float32 or int32, got {src.dtype.name} (C26)")
    if dst.dtype is not dt.int32:
        fail(opn, f"dst dtype must be int32, got {dst.dtype.name} (C26)")
    p, f = src.shape[0], free_size(src)
    if dst.shape[0] != p:
        fail(opn, f"dst has {dst.shape[0]} partitions but src has {p} (C2)")
    if free_size(dst) != f + 1:
        fail(opn, f"dst must have exactly one more element per partition than src ({f + 1}), got "
                  f"{free_size(dst)} (C30)")
    for nm, v in (("index_offset", index_offset), ("padding_val", padding_val)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not -2 ** 31 <= v < 2 ** 31:
            fail(opn, f"{nm}={v!r} must be an int32 compile-time integer (C11)")
    x = as_pf(np.asarray(read(src)), p)
    out = as_pf(np.array(np_view(dst)), p).astype(np.int64)
    for r in range(0, p, 16):
        nz = np.flatnonzero(x[r] != 0)
        out[r, :] = padding_val
        out[r, :nz.size] = nz + int(index_offset)
        out[r, f] = nz.size
    store(opn, dst, out)
    _emit(opn, "gpsimd", (src,), (dst,), src)


# ---- data movement across / within partitions ---------------------------------------------------------------

def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """VectorE: within each 32-partition quadrant, dst partition i = src partition shuffle_mask[i] (255 = keep)."""
    opn = "nc_stream_shuffle"
    on_chip(opn, "dst", dst)
    on_chip(opn, "src", src)
    if dst.dtype is not src.dtype:
        fail(opn, f"dst dtype {dst.dtype.name} must equal src dtype {src.dtype.name} (C26)")
    if free_size(dst) != free_size(src):
        fail(opn, f"dst has {free_size(dst)} elements per partition but src has {free_size(src)} (C2)")
    mask = list(shuffle_mask) if isinstance(shuffle_mask, (list, tuple, np.ndarray)) else None
    if mask is None or len(mask) != 32:
        fail(opn, f"shuffle_mask must be a list of 32 ints, got {shuffle_mask!r} (C30)")
    for i, m in enumerate(mask):
        if not isinstance(m, (int, np.integer)) or not (0 <= m < 32 or m == 255):
            fail(opn, f"shuffle_mask[{i}]={m!r} must be a source partition 0..31 within the quadrant or 255 (C30)")
    ps, pd = src.shape[0], dst.shape[0]
    # C13 for the pair: the start partitions follow the number of active partitions of the shuffle
    active = -(-max(ps, pd) // 32) * 32
    for nm, t in (("src", src), ("dst", dst)):
        start = start_partition(t)
        if start not in legal_starts(active):
            fail(opn, f"{nm} starts at partition {start}; with {active} active partitions (max of src {ps} and dst "
                      f"{pd}, rounded up to 32) the start must be one of {legal_starts(active)} (C13)")
    vals = np.array(read(src)).reshape(ps, -1)            # copy first: in-place shuffles are allowed
    out = np.array(np_view(dst)).reshape(pd, -1)
    for d in range(pd):
        q, i = divmod(d, 32)
        if mask[i] == 255:
            continue
        s = 32 * q + int(mask[i])
        if s >= ps:
            fail(opn, f"shuffle_mask[{i}]={mask[i]} selects src partition {s} but src has {ps} partitions (C30)")
        out[d] = vals[s]
    store(opn, dst, out.reshape(dst.shape))
    _emit(opn, "vector", (src,), (dst,), dst)


def nc_n_gather(dst, data, indices, name=None):
    """GpSimd per-partition gather over the flattened free dims: dst[p, j] = data[p].flat[indices[p, j]]."""
    opn = "nc_n_gather"
    for nm, t in (("dst", dst), ("data", data), ("indices", indices)):
        on_chip(opn, nm, t, (sbuf,))
    if dst.dtype is not data.dtype:
        fail(opn, f"dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name} (C26)")
    if indices.dtype is not dt.uint32:
        fail(opn, f"indices dtype must be uint32, got {indices.dtype.name} (C26)")
    p = data.shape[0]
    same_layout(opn, "indices", indices, dst=dst)
    if indices.shape[0] != p:
        fail(opn, f"indices has {indices.shape[0]} partitions but data has {p} (C2)")
    f = free_size(data)
    idx = as_pf(np.asarray(read(indices)).astype(np.int64), p)
    if idx.size and (idx.min() < 0 or idx.max() >= f):
        fail(opn, f"index {int(idx.max())} is outside [0, {f}) (data elements per partition)")
    vals = np.take_along_axis(as_pf(np.asarray(read(data)), p), idx, axis=1)
    store(opn, dst, vals.reshape(dst.shape))
    _emit(opn, "gpsimd", (data, indices), (dst,), dst, groups=-(-free_size(dst) // 512))


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """GpSimd gather within each 16-partition core group: the group's indices (its 16 index partitions flattened
    partition-first, the first num_valid_indices of them) are element offsets into each partition's flattened free
    dims; every partition of the group reads num_elem_per_idx contiguous elements at each index."""
    opn = "local_gather"
    for nm, t in (("dst", dst), ("src_buffer", src_buffer), ("index", index)):
        on_chip(opn, nm, t, (sbuf,))
    if dst.dtype is not src_buffer.dtype:
        fail(opn, f"dst dtype {dst.dtype.name} must equal src_buffer dtype {src_buffer.dtype.name} (no casting) (C26)")
    if index.dtype is not dt.uint16:
        fail(opn, f"index dtype must be uint16, got {index.dtype.name} (C26)")
    p = src_buffer.shape[0]
    if index.shape[0] != p or p % 16:
        fail(opn, f"src_buffer and index must have the same partition count, a multiple of 16 (got {p} and "
                  f"{index.shape[0]}) (C30)")
    if dst.shape[0] != p:
        fail(opn, f"dst has {dst.shape[0]} partitions but src_buffer has {p} (C2)")
    if num_elem_per_idx not in LOCAL_GATHER_ELEMS:
        fail(opn, f"num_elem_per_idx={num_elem_per_idx!r} must be one of {list(LOCAL_GATHER_ELEMS)} (C30)")
    per_core = 16 * free_size(index)
    nvalid = per_core if num_valid_indices is None else num_valid_indices
    if not isinstance(nvalid, (int, np.integer)) or not 1 <= nvalid <= per_core:
        fail(opn, f"num_valid_indices={num_valid_indices!r} must be in [1, {per_core}] (index elements per core) (C30)")
    if nvalid > LOCAL_GATHER_MAX_INDICES:
        fail(opn, f"{nvalid} indices per core exceed the maximum of {LOCAL_GATHER_MAX_INDICES} (C30)")
    ne = int(num_elem_per_idx)
    if free_size(dst) != nvalid * ne:
        fail(opn, f"dst must hold num_valid_indices * num_elem_per_idx = {nvalid * ne} elements per partition, "
                  f"got {free_size(dst)} (C30)")
    f = free_size(src_buffer)
    src = as_pf(np.asarray(read(src_buffer)), p)
    ind = as_pf(np.asarray(read(index)).astype(np.int64), p)
    out = np.empty((p, nvalid * ne), dtype=src.dtype)
    span = np.arange(ne)
    for g in range(p // 16):
        idx = ind[16 * g:16 * g + 16].T.reshape(-1)[:nvalid]          # partition dimension first
        if idx.size and (idx.min() < 0 or idx.max() + ne > f):
            fail(opn, f"core {g}: index {int(idx.max())} + {ne} elements is outside the {f} elements per "
                      "partition of src_buffer (out-of-bounds gathers are undefined) (C30)")
        cols = (idx[:, None] + span[None, :]).reshape(-1)
        out[16 * g:16 * g + 16] = src[16 * g:16 * g + 16][:, cols]
    store(opn, dst, out.reshape(dst.shape))
    _emit(opn, "gpsimd", (src_buffer, index), (dst,), dst, indices=int(nvalid))


_PART_REDUCE = ("add", "average", "maximum", "bitwise_or", "bitwise_and")  # nki.isa.tensor_partition_reduce


def tensor_partition_reduce(dst, op, data, name=None):
    """GpSimd reduction across the partition dim: dst[0, ...] = op over data[:, ...] (add, average, max,
    bitwise_or/and)."""
    opn = "tensor_partition_reduce"
    on_chip(opn, "dst", dst, (sbuf,))
    on_chip(opn, "data", data, (sbuf,))
    oname = _reduce_name(opn, "op", op, _PART_REDUCE)
    p, f = data.shape[0], free_size(data)
    if dst.shape[0] != 1 or free_size(dst) != f:
        fail(opn, f"dst must have 1 partition and {f} elements per partition (data {data.shape}), got "
                  f"{dst.shape} (C30)")
    if oname.startswith("bitwise"):
        for nm, t in (("data", data), ("dst", dst)):
            if not t.dtype.is_int:
                fail(opn, f"bit-vector op nl.{oname} needs integer dtypes; {nm} is {t.dtype.name} (C26)")
        x = as_pf(np.asarray(read(data)).astype(np.int64), p)
        res = getattr(np, oname).reduce(x, axis=0)
    else:
        x = as_pf(fp32(data), p)
        with alu_ops.quiet_fp():
            res = (np.maximum if oname == "maximum" else np.add).reduce(x, axis=0, dtype=np.float32)
            if oname == "average":
                res = res / np.float32(p)
    store(opn, dst, res.reshape(dst.shape))
    _emit(opn, "gpsimd", (data,), (dst,), data, op=oname)


def sequence_bounds(dst, segment_ids, name=None):
    """GpSimd, P = 1: for each element, [start, end) of its run of equal segment ids -> dst (1, 2, N); padding
    (id 0) gets start N and end -1."""
    opn = "sequence_bounds"
    on_chip(opn, "dst", dst, (sbuf,))
    on_chip(opn, "segment_ids", segment_ids, (sbuf,))
    for nm, t in (("segment_ids", segment_ids), ("dst", dst)):
        if t.dtype.name not in ("float32", "int32"):
            fail(opn, f"{nm} dtype must be float32 or int32, got {t.dtype.name} (C26)")
    if segment_ids.shape[0] != 1 or dst.shape[0] != 1:
        fail(opn, f"the partition dimension must be 1 (segment_ids {segment_ids.shape}, dst {dst.shape}) (C30)")
    n = free_size(segment_ids)
    if free_size(dst) != 2 * n:
        fail(opn, f"dst must be (1, 2, {n}) for {n} segment ids, got {dst.shape} (C30)")
    s = fp32(segment_ids).reshape(-1)
    if n and (s < 0).any():
        fail(opn, "segment ids must be non-negative (C30)")
    pos = np.arange(n)
    new_run = np.ones(n, bool)
    new_run[1:] = s[1:] != s[:-1]
    end_run = np.ones(n, bool)
    end_run[:-1] = s[:-1] != s[1:]
    start = np.maximum.accumulate(np.where(new_run, pos, 0)) if n else pos
    end = (np.minimum.accumulate(np.where(end_run, pos + 1, n)[::-1])[::-1]) if n else pos
    pad = s == 0
    out = np.stack([np.where(pad, n, start), np.where(pad, -1, end)]).astype(np.float64)
    store(opn, dst, out.reshape(dst.shape))
    _emit(opn, "gpsimd", (segment_ids,), (dst,), dst)
