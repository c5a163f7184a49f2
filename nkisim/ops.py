"""The math behind `op=` arguments: ALU operators and ScalarE activation functions, computed in fp32.

`nl.add`, `nl.exp`, ... are plain functions of the `nl` namespace (usable as `nl.add(x, y)`); each carries an
`_nki_op` name that the ISA implementations look up here. Activation functions are exact NumPy math (the hardware
uses piece-wise polynomials; the official simulator is exact too, except `sin` outside [-pi, pi]).
"""

import math

import numpy as np

from .errors import NkiValidationError

_f32 = np.float32

try:    # NumPy's floating-point error state (a context variable); see quiet_fp
    from numpy._core._ufunc_config import _extobj_contextvar as _FP_STATE
    from numpy._core._ufunc_config import _make_extobj
    _FP_IGNORE = _make_extobj(all="ignore")
except ImportError:     # another NumPy layout: quiet_fp falls back to np.errstate
    _FP_STATE = None


class quiet_fp:
    """`with quiet_fp():` is `with np.errstate(all="ignore"):` (IEEE results, no warnings; engines do not trap)
    at a third of the cost: the ignore-all state is built once and only swapped in, which matters because every
    instruction on a small tile pays it. Falls back to np.errstate where NumPy's internals differ."""

    __slots__ = ("_token",)

    def __enter__(self):
        if _FP_STATE is None:
            self._token = np.errstate(all="ignore")
            self._token.__enter__()
        else:
            self._token = _FP_STATE.set(_FP_IGNORE)

    def __exit__(self, *exc):
        if _FP_STATE is None:
            self._token.__exit__(*exc)
        else:
            _FP_STATE.reset(self._token)


def _cmp(fn):
    return lambda a, b: fn(a, b).astype(_f32)


def _abs_max(a, b):
    return np.maximum(np.abs(a), np.abs(b))


def _abs_min(a, b):
    return np.minimum(np.abs(a), np.abs(b))


# name -> (fn(a, b) on fp32 arrays, legal as a reduction, identity for reductions)
ALU_ARITH = {
    "add": (np.add, True, 0.0),
    "subtract": (np.subtract, True, 0.0),
    "multiply": (np.multiply, True, 1.0),
    "divide": (np.divide, False, None),
    "maximum": (np.maximum, True, -np.inf),
    "minimum": (np.minimum, True, np.inf),
    "power": (np.power, False, None),
    "mod": (np.mod, False, None),     # nl.mod: Python/numpy.mod, the sign of the divisor (nl.fmod: of the dividend)
    "fmod": (np.fmod, False, None),
    "equal": (_cmp(np.equal), False, None),
    "not_equal": (_cmp(np.not_equal), False, None),
    "greater": (_cmp(np.greater), False, None),
    "greater_equal": (_cmp(np.greater_equal), False, None),
    "less": (_cmp(np.less), False, None),
    "less_equal": (_cmp(np.less_equal), False, None),
    "logical_and": (_cmp(lambda a, b: (a != 0) & (b != 0)), True, 1.0),
    "logical_or": (_cmp(lambda a, b: (a != 0) | (b != 0)), True, 0.0),
    "logical_xor": (_cmp(lambda a, b: (a != 0) ^ (b != 0)), True, 0.0),
    "abs_max": (_abs_max, True, 0.0),
    "abs_min": (_abs_min, True, np.inf),
}
# Bit-vector ops work on the integer bit patterns (integer dtypes only).
ALU_BITVEC = {
    "bitwise_and": (np.bitwise_and, True),
    "bitwise_or": (np.bitwise_or, True),
    "bitwise_xor": (np.bitwise_xor, True),
    "left_shift": (np.left_shift, False),
    "right_shift": (np.right_shift, False),  # logical shift (arithmetic shift right unsupported)
}
TRN3_ONLY_ALU = {"abs_max", "abs_min"}
# Reductions NumPy can do in one ufunc call (.reduce / .accumulate / .at).
REDUCE_UFUNCS = {"add": np.add, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum}
FP32_MIN = float(np.finfo(np.float32).min)  # nl.fp32.min: range_select's fill value

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_dx(x):
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _gelu_sig(x):
    return x * _sigmoid(1.702 * x)


def _gelu_sig_dx(x):
    s = _sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1.0 - s)


def _silu_dx(x):
    s = _sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _softplus(x):
    return np.logaddexp(0.0, x)


# name -> fn(x) on float arrays (computed in float64 for transcendental accuracy, cast to fp32 on write)
ACTIVATIONS = {
    "copy": lambda x: x,
    "identity": lambda x: x,
    "bypass": lambda x: x,
    "square": np.square,
    "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": _gelu,
    "gelu_dx": _gelu_dx,
    "gelu_apprx_tanh": _gelu_tanh,
    "gelu_apprx_sigmoid": _gelu_sig,
    "gelu_apprx_sigmoid_dx": _gelu_sig_dx,
    "silu": lambda x: x * _sigmoid(x),
    "silu_dx": _silu_dx,
    "tanh": np.tanh,
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "erf": _erf,
    "erf_dx": lambda x: 2.0 / math.sqrt(math.pi) * np.exp(-x * x),
    "exp": np.exp,
    "log": np.log,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "arctan": np.arctan,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "reciprocal": lambda x: 1.0 / x,
    "sign": np.sign,
    "abs": np.abs,
    "negative": np.negative,
    "ceil": np.ceil,
    "floor": np.floor,
    "trunc": np.trunc,
}
# C20: valid input ranges of the ScalarE function approximations ([SDK:shared] "Supported Activation Functions");
# outside them the hardware returns garbage, so nkisim refuses the instruction. (lo, hi) on x, or on |x| if "abs".
ACTIVATION_RANGES = {
    "log": (2.0 ** -64, 2.0 ** 64, False),
    "sin": (-math.pi, math.pi, False),
    "arctan": (-math.pi / 2, math.pi / 2, False),
    "sqrt": (2.0 ** -116, 2.0 ** 118, False),
    "rsqrt": (2.0 ** -87, 2.0 ** 97, False),
    "reciprocal": (2.0 ** -42, 2.0 ** 42, True),
}


def check_activation_range(name, x, ctx_op):
    """Raise when a finite input lies outside the function's valid range (NaN propagates as on hardware)."""
    rng = ACTIVATION_RANGES.get(name)
    if rng is None or x.size == 0:
        return
    lo, hi, use_abs = rng
    v = np.abs(x) if use_abs else x
    with np.errstate(invalid="ignore"):
        bad = (v < lo) | (v > hi)
    if bad.any():
        first = x[bad].reshape(-1)[0]
        span = f"|x| in [{lo:.6g}, {hi:.6g}]" if use_abs else f"[{lo:.6g}, {hi:.6g}]"
        raise NkiValidationError(
            f"{ctx_op}: nl.{name} input {float(first):.6g} is outside the ScalarE valid range {span}; the hardware "
            f"returns invalid output there (C20). {int(bad.sum())} element(s) affected; use nisa.reciprocal / "
            "VectorE math or clamp the input")


# Unary ALU ops usable as tensor_scalar op0 with no operand (square / relu on Trn3 only).
ALU_UNARY = {"abs": np.abs, "rsqrt": ACTIVATIONS["rsqrt"], "reciprocal": ACTIVATIONS["reciprocal"],
             "square": np.square, "relu": ACTIVATIONS["relu"]}
TRN3_ONLY_UNARY = {"square", "relu"}


def op_name(op, what):
    """The registered name of an `op=` argument (an nl function), or a clear error."""
    name = getattr(op, "_nki_op", None)
    if name is None:
        raise NkiValidationError(f"{what}={op!r} is not an nki.language operator (pass e.g. nl.add, nl.exp)")
    return name


def alu(op, what, ctx_op):
    """(name, fn, kind) for an ALU operator; kind is 'arith' or 'bitvec'."""
    name = getattr(op, "_nki_op", None)
    arith = ALU_ARITH.get(name) if name is not None else None
    if arith is not None:        # the common case, without formatting the error context
        return name, arith[0], "arith"
    name = op_name(op, f"{ctx_op}: {what}")
    if name in ALU_ARITH:
        return name, ALU_ARITH[name][0], "arith"
    if name in ALU_BITVEC:
        return name, ALU_BITVEC[name][0], "bitvec"
    raise NkiValidationError(f"{ctx_op}: {what}=nl.{name} is not an ALU operator")


def reduce_identity(name):
    if name in ALU_ARITH:
        return ALU_ARITH[name][2]
    return {"bitwise_and": -1, "bitwise_or": 0, "bitwise_xor": 0}[name]


def is_reduction(name):
    if name in ALU_ARITH:
        return ALU_ARITH[name][1]
    return name in ALU_BITVEC and ALU_BITVEC[name][1]


def activation(op, ctx_op):
    name = op_name(op, f"{ctx_op}: op")
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise NkiValidationError(f"{ctx_op}: op=nl.{name} is not an activation function")
    return name, fn


def apply_activation(fn, x):
    with quiet_fp():
        return fn(x.astype(np.float64)).astype(_f32)
