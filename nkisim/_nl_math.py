"""Elementwise math, reductions, softmax, rms_norm and where of `nki.language`.

Each function doubles as an `op=` argument of the ISA (it carries `_nki_op`, the name `nkisim.ops` computes).
Called directly, it allocates an SBUF result (dtype defaults to the input dtype) and lowers to ISA ops. No
broadcasting between tensors (NKI 0.6): a (P, 1) operand goes through tensor_scalar, a Python scalar too.
"""

import builtins
import math

import numpy as np

from . import dtypes as _dt
from .errors import NkiValidationError
from .memory import sbuf
from .runtime import current
from .tensor import NkiTensor

__all__ = []


def _new(shape, dtype):
    from .language import ndarray
    shape = tuple(shape)
    if len(shape) < 2:
        shape = (shape[0] if shape else 1, 1)
    return ndarray(shape, dtype, sbuf)


def _binary(name):
    def fn(x, y, dtype=None):
        if not isinstance(x, NkiTensor):
            if isinstance(y, NkiTensor):
                out = _new(y.shape, dtype or y.dtype)
                _isa.tensor_scalar(dst=out, data=y, op0=fn, operand0=x, reverse0=True)
                return out
            raise NkiValidationError(f"nl.{name}: at least one operand must be a tensor")
        out = _new(x.shape, dtype or x.dtype)
        if isinstance(y, NkiTensor):
            if y.shape != x.shape:
                if y.shape[0] == x.shape[0] and y.size == y.shape[0]:
                    if y.dtype is not _dt.float32:
                        y = _cast_tile(y, _dt.float32)
                    _isa.tensor_scalar(dst=out, data=x, op0=fn, operand0=y)
                    return out
                raise NkiValidationError(f"nl.{name}: shapes {x.shape} and {y.shape} differ; NKI 0.6 binary ops do "
                                         "not broadcast (use a (P, 1) operand or nisa.tensor_scalar)")
            _isa.tensor_tensor(dst=out, data1=x, data2=y, op=fn)
        else:
            _isa.tensor_scalar(dst=out, data=x, op0=fn, operand0=y)
        return out
    fn.__name__ = fn.__qualname__ = name
    fn._nki_op = name
    fn.__doc__ = f"nl.{name}(x, y, dtype=None): elementwise {name}; also usable as an ISA op=."
    return fn


def _cast_tile(t, dtype):
    out = _new(t.shape, dtype)
    _isa.tensor_copy(dst=out, src=t)
    return out


def _unary(name):
    def fn(x, dtype=None):
        out = _new(x.shape, dtype or x.dtype)
        _isa.activation(dst=out, op=fn, data=x)
        return out
    fn.__name__ = fn.__qualname__ = name
    fn._nki_op = name
    fn.__doc__ = f"nl.{name}(x, dtype=None): elementwise {name} on ScalarE; also usable as an activation op=."
    return fn


_BINARY = ["add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "fmod", "mod", "equal",
           "not_equal", "greater", "greater_equal", "less", "less_equal", "logical_and", "logical_or",
           "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "abs_max",
           "abs_min"]
_UNARY = ["abs", "square", "negative", "sign", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tan",
          "arctan", "ceil", "floor", "trunc", "tanh", "sigmoid", "relu", "gelu", "gelu_apprx_sigmoid",
          "gelu_apprx_tanh", "gelu_dx", "gelu_apprx_sigmoid_dx", "silu", "silu_dx", "softplus", "mish", "erf",
          "erf_dx"]

for _n in _BINARY:
    globals()[_n] = _binary(_n)
    __all__.append(_n)
for _n in _UNARY:
    globals()[_n] = _unary(_n)
    __all__.append(_n)


# nl.sin's range reduction: x -> ((x + S) mod D) - S lands in [-S, S] inside ScalarE's valid [-pi, pi] (C20);
# D is the largest fp32 below 2*pi so that the fp32 result never exceeds pi.
_SIN_PERIOD = float(np.nextafter(np.float32(2 * math.pi), np.float32(0)))
_SIN_SHIFT = _SIN_PERIOD / 2


def sin(x, dtype=None):
    """nl.sin(x, dtype=None): as AWS documents, range-reduces the input to [-pi, pi] before the ScalarE sine, so it
    stays accurate over the full input domain (nisa.activation(op=nl.sin) does not). Also an activation op=."""
    t = _new(x.shape, _dt.float32)
    _isa.tensor_scalar(dst=t, data=x, op0=add, operand0=_SIN_SHIFT, op1=mod, operand1=_SIN_PERIOD)  # noqa: F821
    _isa.tensor_scalar(dst=t, data=t, op0=subtract, operand0=_SIN_SHIFT)  # noqa: F821
    out = _new(x.shape, dtype or x.dtype)
    _isa.activation(dst=out, op=sin, data=t)
    return out


sin._nki_op = "sin"


def rsqrt(x, dtype=None):
    """nl.rsqrt(x, dtype=None): 1/sqrt(x). Since NKI 0.5 it runs on GpSimd (tensor_scalar(op0=nl.rsqrt,
    engine=gpsimd), higher precision than ScalarE) and so no longer accepts PSUM input (C8; AWS migration guide
    0.4 -> 0.5); for PSUM input call nisa.activation(op=nl.rsqrt). Also usable as an activation / ALU op=."""
    if not isinstance(x, NkiTensor):
        raise NkiValidationError(f"nl.rsqrt: x must be a tile, got {type(x).__name__}")
    if x.buffer.name == "psum":
        raise NkiValidationError(f"nl.rsqrt: x '{x.name}' is in PSUM; nl.rsqrt runs on GpSimd, which "
                                 "cannot read PSUM (NKI 0.5+) — use nisa.activation(op=nl.rsqrt) for a PSUM input "
                                 "(C8)")
    out = _new(x.shape, dtype or x.dtype)
    _isa.tensor_scalar(dst=out, data=x, op0=rsqrt, operand0=0.0, engine=_isa.engine.gpsimd)
    return out


rsqrt._nki_op = "rsqrt"


def _marker(name, doc):
    def fn(*_a, **_k):
        raise NkiValidationError(f"nl.{name} is an activation/ALU selector, not a callable op here")
    fn.__name__ = name
    fn._nki_op = name
    fn.__doc__ = doc
    return fn


bypass = _marker("bypass", "No-op stage for activate2 (op0/op1/op=nl.bypass).")
identity = _marker("identity", "Identity activation.")
prelu = _marker("prelu", "Parametric ReLU (activate2 with relu_param).")
average = _marker("average", "Mean across partitions (nisa.tensor_partition_reduce(op=nl.average)).")
__all__ += ["bypass", "identity", "prelu", "average"]


def invert(x, dtype=None):
    out = _new(x.shape, dtype or x.dtype)
    _isa.tensor_scalar(dst=out, data=x, op0=bitwise_xor, operand0=-1)  # noqa: F821
    return out


def logical_not(x, dtype=None):
    out = _new(x.shape, dtype or x.dtype)
    _isa.tensor_scalar(dst=out, data=x, op0=equal, operand0=0.0)  # noqa: F821
    return out


__all__ += ["invert", "logical_not"]


# ---- reductions -------------------------------------------------------------------------------------------------

def _reduce_shape(x, axis, keepdims):
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(sorted(int(a) % x.ndim for a in axes))
    if keepdims:
        return tuple(1 if d in axes else n for d, n in enumerate(x.shape)), axes
    shape = tuple(n for d, n in enumerate(x.shape) if d not in axes)
    return shape, axes


def _reduce(opfn, x, axis, dtype, keepdims):
    shape, axes = _reduce_shape(x, axis, keepdims)
    out = _new(shape, dtype or x.dtype)
    _isa.tensor_reduce(dst=out, op=opfn, data=x, axis=axes, keepdims=keepdims)
    return out


def sum(x, axis, dtype=None, keepdims=False):  # noqa: A001 - NKI's name
    return _reduce(add, x, axis, dtype, keepdims)  # noqa: F821


def max(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(maximum, x, axis, dtype, keepdims)  # noqa: F821


def min(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(minimum, x, axis, dtype, keepdims)  # noqa: F821


def prod(x, axis, dtype=None, keepdims=False):
    return _reduce(multiply, x, axis, dtype, keepdims)  # noqa: F821


def all(x, axis, dtype=None):  # noqa: A001
    return _reduce(logical_and, x, axis, dtype, False)  # noqa: F821


def mean(x, axis, dtype=None, keepdims=False):
    s = _reduce(add, x, axis, _dt.float32, keepdims)  # noqa: F821
    _, axes = _reduce_shape(x, axis, keepdims)
    n = math.prod([x.shape[a] for a in axes])
    out = _new(s.shape, dtype or x.dtype)
    _isa.tensor_scalar(dst=out, data=s, op0=multiply, operand0=1.0 / n)  # noqa: F821
    return out


def var(x, axis, dtype=None, keepdims=False):
    """Population variance over trailing free axes; as AWS documents, keepdims is ignored and the result always has
    the keepdims=True shape."""
    shape, _ = _reduce_shape(x, axis, True)
    m = mean(x, axis, _dt.float32)
    sq = _new(x.shape, _dt.float32)
    _isa.activation(dst=sq, op=square, data=x)  # noqa: F821
    ms = mean(sq, axis, _dt.float32)
    out = _new(shape, dtype or x.dtype)
    m2 = _new(m.shape, _dt.float32)
    _isa.tensor_tensor(dst=m2, data1=m, data2=m, op=multiply)  # noqa: F821
    _isa.tensor_tensor(dst=out, data1=ms, data2=m2, op=subtract)  # noqa: F821
    return out


__all__ += ["sum", "max", "min", "prod", "all", "mean", "var"]


def softmax(x, axis=-1, dtype=None):
    """Softmax over trailing contiguous free axes (AWS: [1], [1,2], [1,2,3], [1,2,3,4]): max, exp(x - max), 1/sum.

    Over all free axes the max is a (P, 1) ScalarE bias and the sum comes from ScalarE's accumulators; over fewer,
    the per-row max and 1/sum are broadcast back along the reduced axes with stride-0 views."""
    kept, axes = _reduce_shape(x, axis, True)
    p = x.shape[0]
    if axes == tuple(range(1, x.ndim)):
        neg_max = _new((p, 1), _dt.float32)
        _isa.tensor_reduce(dst=neg_max, op=maximum, data=x, axis=axes, negate=True)  # noqa: F821
        e = _new(x.shape, _dt.float32)
        s = _new((p, 1), _dt.float32)
        _isa.activation(dst=e, op=exp, data=x, bias=neg_max, scale=1.0, reduce_op=add, reduce_res=s,  # noqa: F821
                        reduce_cmd=_isa.reduce_cmd.reset_reduce)
        r = _new((p, 1), _dt.float32)
        _isa.reciprocal(dst=r, data=s)
        out = _new(x.shape, dtype or x.dtype)
        _isa.tensor_scalar(dst=out, data=e, op0=multiply, operand0=r)  # noqa: F821
        return out
    m = _new(kept, _dt.float32)
    _isa.tensor_reduce(dst=m, op=maximum, data=x, axis=axes, keepdims=True)  # noqa: F821
    e = _new(x.shape, _dt.float32)
    _isa.tensor_tensor(dst=e, data1=x, data2=_spread(m, x.shape, axes), op=subtract)  # noqa: F821
    _isa.activation(dst=e, op=exp, data=e)  # noqa: F821
    s = _new(kept, _dt.float32)
    _isa.tensor_reduce(dst=s, op=add, data=e, axis=axes, keepdims=True)  # noqa: F821
    _isa.reciprocal(dst=s, data=s)
    out = _new(x.shape, dtype or x.dtype)
    _isa.tensor_tensor(dst=out, data1=e, data2=_spread(s, x.shape, axes), op=multiply)  # noqa: F821
    return out


def _spread(t, shape, axes):
    """A stride-0 view of a keepdims reduction result repeated along the reduced axes."""
    for a in axes:
        t = t.broadcast(a, shape[a])
    return t


def rms_norm(x, w, axis, n, epsilon=1e-6, dtype=None, compute_dtype=None):
    """x / sqrt(mean(x^2 over axis, divided by n) + epsilon) * w; x [P, F], w the same shape as x."""
    if x.ndim != 2 or axis not in (1, -1, (1,), [1]):
        raise NkiValidationError(f"nl.rms_norm: supports 2-D [P, F] tiles over axis 1, got {x.shape} axis={axis}")
    if compute_dtype is not None and _dt.as_dtype(compute_dtype) is not _dt.float32:
        raise NkiValidationError(f"nl.rms_norm: compute_dtype={compute_dtype!r} is not supported by nkisim (fp32 "
                                 "statistics only)")
    p = x.shape[0]
    sq = _new(x.shape, _dt.float32)
    ss = _new((p, 1), _dt.float32)
    _isa.activation(dst=sq, op=square, data=x, reduce_op=add, reduce_res=ss,  # noqa: F821
                    reduce_cmd=_isa.reduce_cmd.reset_reduce)
    rs = _new((p, 1), _dt.float32)
    _isa.tensor_scalar(dst=rs, data=ss, op0=multiply, operand0=1.0 / n, op1=add, operand1=float(epsilon))  # noqa: F821
    _isa.activation(dst=rs, op=rsqrt, data=rs)  # noqa: F821
    out = _new(x.shape, dtype or x.dtype)
    _isa.tensor_scalar(dst=out, data=x, op0=multiply, operand0=rs)  # noqa: F821
    if w is not None:
        if w.shape != x.shape:
            raise NkiValidationError(f"nl.rms_norm: w shape {w.shape} must equal x shape {x.shape} (no broadcasting)")
        _isa.tensor_tensor(dst=out, data1=out, data2=w, op=multiply)  # noqa: F821
    return out


def where(condition, x, y, dtype=None):
    """x where condition (float 1.0/0.0 or int) is non-zero, else y; x / y may be scalars."""
    ref = condition
    out = _new(ref.shape, dtype or (x.dtype if isinstance(x, NkiTensor) else
                                    y.dtype if isinstance(y, NkiTensor) else _dt.float32))
    pred = _new(ref.shape, _dt.uint8)
    _isa.tensor_scalar(dst=pred, data=condition, op0=not_equal, operand0=0.0)  # noqa: F821
    if isinstance(y, NkiTensor):
        _isa.tensor_copy(dst=out, src=y)
    else:
        _isa.memset(dst=out, value=int(y) if out.dtype.is_int else float(y))
    if isinstance(x, NkiTensor) and x.dtype is not out.dtype:
        x = _cast_tile(x, out.dtype)
    _isa.tensor_copy_predicated(dst=out, src=x, predicate=pred)
    return out


_TINY = float(np.finfo(np.float32).tiny)


def dropout(x, rate, dtype=None):
    """Zero elements with probability `rate` (seeded by nl.random_seed), scale the rest by 1/(1-rate); `rate` is a
    scalar or, as AWS documents, a (P, 1) tile of per-partition probabilities."""
    from .language import rand
    r = rand(x.shape, _dt.float32)
    keep = _new(x.shape, _dt.float32)
    if isinstance(rate, NkiTensor):
        p = x.shape[0]
        if rate.shape[0] != p or rate.size != p:
            raise NkiValidationError(f"nl.dropout: rate must be a scalar or a ({p}, 1) tile, got shape {rate.shape} "
                                     "(C11)")
        prob = _new((p, 1), _dt.float32)
        _isa.tensor_copy(dst=prob, src=rate)
        scale = _new((p, 1), _dt.float32)
        _isa.tensor_scalar(dst=scale, data=prob, op0=multiply, operand0=-1.0, op1=add, operand1=1.0)  # noqa: F821
        # rate 1.0 drops everything: keep 1/(1-rate) finite so that 0 * scale stays 0
        _isa.tensor_scalar(dst=scale, data=scale, op0=maximum, operand0=_TINY)  # noqa: F821
        _isa.reciprocal(dst=scale, data=scale)
        _isa.tensor_scalar(dst=keep, data=r, op0=greater_equal, operand0=prob,  # noqa: F821
                           op1=multiply, operand1=scale)  # noqa: F821
    else:
        _isa.tensor_scalar(dst=keep, data=r, op0=greater_equal, operand0=float(rate),  # noqa: F821
                           op1=multiply, operand1=1.0 / builtins.max(1.0 - float(rate), _TINY))  # noqa: F821
    out = _new(x.shape, dtype or x.dtype)
    _isa.tensor_tensor(dst=out, data1=x, data2=keep, op=multiply)  # noqa: F821
    return out


def gather_flattened(data, indices, axis=0, dtype=None):
    if axis != 0:
        raise NkiValidationError(f"nl.gather_flattened: axis={axis} is not supported (per-partition gather over the "
                                 "flattened free dims, axis=0)")
    out = _new(indices.shape, data.dtype)  # nc_n_gather keeps data's dtype; cast afterwards if asked
    _isa.nc_n_gather(dst=out, data=data, indices=indices)
    if dtype is not None and _dt.as_dtype(dtype) is not out.dtype:
        out = _cast_tile(out, _dt.as_dtype(dtype))
    return out


__all__ += ["softmax", "rms_norm", "where", "dropout", "gather_flattened"]
del current

# Imported last: nkisim.isa binds nl functions as defaults (range_select's reduce_op=nl.maximum, affine_select's
# cmp_op=nl.equal), so they must exist before isa is (re-)entered, whichever module is imported first.
from . import isa as _isa  # noqa: E402
