"""`nisa.NkiScalar`, `nisa.scalar_load`, `nisa.scalar_store` (NKI 0.7, tracer frontend only).

An NkiScalar holds one integer computed on the device. Under the real tracer arithmetic on it is recorded, not
evaluated (`i * 4 + 1` yields a new scalar); the interpreter runs eagerly, so each scalar also carries its current
value, and each operator records a zero-time "scalar_op" instruction on the sync sequencer that reads the operands
and writes the result. That keeps the cost model's register dependencies: a DMA addressed by `i * 4 + 1` waits for
the scalar_load that produced `i`, as one addressed by the register itself does.

Facts from AWS's pages (nki.isa.NkiScalar, scalar_load, scalar_store, "NKI Scalar Values", v2.33):
- created by `scalar_load(src)` from a 1x1 int32/int64 tensor in SBUF or HBM; unsigned dtypes are not accepted;
- the width is fixed at creation: int32 arithmetic wraps (100000 * 100000 -> 1410065408), never widens;
- operands: a Python int or another NkiScalar of the same dtype; every operator returns a new NkiScalar;
- `+`, `-` (binary and unary), `*` at both widths; comparisons are traced at 32 bits "but the result cannot be
  used", rejected at 64 bits. Other operators are not documented and are refused here with that reason;
- usable as `scalar_offset` of an access pattern, as an nl.ds start, as an index, and as a fori_loop bound
  (32-bit only);
- `scalar_store(dst, value)`: dst a 1x1 SBUF/HBM tensor of the scalar's width; value must be an NkiScalar (a Python
  int is rejected: use nisa.memset for constants);
- both calls exist only under the tracer: "The parser frontend rejects the call".

It derives from `VirtualRegister` so every place that accepts a register as a dynamic offset (nl.ds, .ap
scalar_offset, integer indices, fori_loop bounds) and the cost model's register pseudo-allocations take it as is.
"""

import numpy as np

from .. import dtypes as dt
from ..frontend import parser_frontend
from ..runtime import current
from ..tensor import NkiTensor, VirtualRegister, read, write
from ._common import fail

_WIDTHS = {"int32": 32, "int64": 64}
_SCALAR_DTYPES = (dt.int32, dt.int64)


def _wrap(value, bits):
    span = 1 << bits
    return ((int(value) + (span >> 1)) % span) - (span >> 1)


class NkiScalar(VirtualRegister):
    """One device-computed integer (`nki.isa.NkiScalar(state, dtype=None, is_comparison=False)`)."""

    __slots__ = ("dtype", "is_comparison", "affine")

    def __init__(self, state=None, dtype=None, is_comparison=False):
        d = dt.int32 if dtype is None else dt.as_dtype(dtype)
        if d.name not in _WIDTHS:
            raise TypeError(f"NkiScalar: dtype must be nl.int32 or nl.int64, got {d.name}")
        super().__init__(0 if state is None else _wrap(state, _WIDTHS[d.name]), frozen=True)
        self.dtype = d
        self.is_comparison = bool(is_comparison)
        # (base scalar, constant offset): `r + 128` is (r, 128), so the slice t[r:r + 128] has a size known while
        # tracing (128). Any other operator starts a new base.
        self.affine = (self, 0)

    @property
    def bits(self):
        return _WIDTHS[self.dtype.name]

    def __repr__(self):
        kind = ", is_comparison=True" if self.is_comparison else ""
        return f"NkiScalar({self.value}, dtype=nl.{self.dtype.name}{kind})"

    # ---- Python control flow: the value exists only on the device ----------------------------------------------
    def __bool__(self):
        raise TypeError("NkiScalar in Python bool()/if/while: a scalar is computed on the device and has no value "
                        "while the kernel is traced; bound a loop with it (nl.fori_loop) or address with it "
                        "(scalar_offset, nl.ds)")

    def __index__(self):
        raise TypeError("NkiScalar in Python int()/range()/len(): a scalar is computed on the device and has no "
                        "value while the kernel is traced; use it as an nl.fori_loop bound, an nl.ds start, an "
                        "index or a scalar_offset")

    __int__ = __index__
    __hash__ = VirtualRegister.__hash__

    # ---- traced arithmetic -------------------------------------------------------------------------------------
    def _operand(self, other, op):
        if self.is_comparison or (isinstance(other, NkiScalar) and other.is_comparison):
            raise TypeError(f"NkiScalar {op}: the result of a comparison is traced but cannot be used")
        if isinstance(other, NkiScalar):
            if other.dtype is not self.dtype:
                raise TypeError(f"NkiScalar {op}: operand dtypes differ (nl.{self.dtype.name} vs "
                                f"nl.{other.dtype.name}); the width is fixed at creation")
            return other.value, (other,)
        if isinstance(other, VirtualRegister):
            raise TypeError(f"NkiScalar {op}: the other operand must be a Python int or an NkiScalar, not a "
                            "VirtualRegister")
        if isinstance(other, np.integer):
            other = int(other)        # a NumPy int (e.g. a shape entry) is a compile-time int like a Python one
        if isinstance(other, bool) or not isinstance(other, int):
            return None, None         # NotImplemented: Python raises TypeError for floats, tensors, ...
        lo, hi = -(1 << (self.bits - 1)), (1 << self.bits) - 1
        if not lo <= other <= hi:
            raise TypeError(f"NkiScalar {op}: Python int {other} does not fit the scalar's {self.bits} bits")
        return other, ()

    def _result(self, op, value, sources, is_comparison=False):
        out = NkiScalar(value, self.dtype, is_comparison)
        ctx = current()
        out.writer = ctx.seq
        ctx.emit("scalar_op", "sync", (self,) + sources, (out,), op=op)
        return out

    def _arith(self, other, op, fn, reflected=False):
        v, sources = self._operand(other, op)
        if sources is None:
            return NotImplemented
        a, b = (v, self.value) if reflected else (self.value, v)
        return self._result(op, fn(a, b), sources)

    def _offset(self, out, other, sign):
        if isinstance(out, NkiScalar) and not isinstance(other, NkiScalar):
            out.affine = (self.affine[0], self.affine[1] + sign * int(other))
        return out

    def __add__(self, other):
        return self._offset(self._arith(other, "+", lambda a, b: a + b), other, 1)

    def __radd__(self, other):
        return self._offset(self._arith(other, "+", lambda a, b: a + b, reflected=True), other, 1)

    def __sub__(self, other):
        return self._offset(self._arith(other, "-", lambda a, b: a - b), other, -1)

    def __rsub__(self, other):
        return self._arith(other, "-", lambda a, b: a - b, reflected=True)

    def __mul__(self, other):
        return self._arith(other, "*", lambda a, b: a * b)

    def __rmul__(self, other):
        return self._arith(other, "*", lambda a, b: a * b, reflected=True)

    def __neg__(self):
        self._operand(0, "unary -")
        return self._result("neg", -self.value, ())

    def __pos__(self):
        return self

    def _compare(self, other, op, fn):
        if self.bits == 64:
            raise TypeError(f"NkiScalar {op}: comparisons of nl.int64 scalars are rejected at compile time")
        v, sources = self._operand(other, op)
        if sources is None:
            return NotImplemented
        return self._result(op, int(fn(self.value, v)), sources, is_comparison=True)

    def __lt__(self, other):
        return self._compare(other, "<", lambda a, b: a < b)

    def __le__(self, other):
        return self._compare(other, "<=", lambda a, b: a <= b)

    def __gt__(self, other):
        return self._compare(other, ">", lambda a, b: a > b)

    def __ge__(self, other):
        return self._compare(other, ">=", lambda a, b: a >= b)

    def __eq__(self, other):
        return self._compare(other, "==", lambda a, b: a == b)

    def __ne__(self, other):
        return self._compare(other, "!=", lambda a, b: a != b)

    def _undocumented(self, *_):
        raise TypeError("NkiScalar supports +, - (binary and unary), * and comparisons (AWS nki.isa.NkiScalar); "
                        "other operators are not documented for scalars")

    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = _undocumented
    __pow__ = __rpow__ = __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _undocumented
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __invert__ = __abs__ = _undocumented


def check_usable(x, what):
    """Reject scalars that cannot be consumed (comparison results) where a scalar is used as a value."""
    if isinstance(x, NkiScalar) and x.is_comparison:
        raise TypeError(f"{what}: the result of an NkiScalar comparison is traced but cannot be used")


def _tracer_only(op):
    if parser_frontend():
        fail(op, "is supported only by the tracer frontend (NKI 0.7); the parser frontend "
                 "(NKI_COMPILER_FRONTEND=custom) rejects the call -- use nisa.register_load / register_store")


def _check_1x1(op, name, t):
    if not isinstance(t, NkiTensor):
        fail(op, f"{name} must be a 1x1 NkiTensor, got {type(t).__name__}")
    if t.size != 1:
        fail(op, f"{name} must be a 1x1 tensor, got shape {t.shape}")
    if t.buffer.name == "psum":
        fail(op, f"{name} must be in SBUF or HBM, got PSUM")
    if t.dtype not in _SCALAR_DTYPES:
        hint = " (unsigned dtypes are not accepted; use the signed dtype of the same width)" \
            if t.dtype.name.startswith("uint") else ""
        fail(op, f"{name} dtype must be nl.int32 or nl.int64, got nl.{t.dtype.name}{hint}")


def scalar_load(src):
    """Load a scalar from a 1x1 int32/int64 tensor in SBUF or HBM -> NkiScalar of the tensor's dtype."""
    op = "scalar_load"
    _tracer_only(op)
    _check_1x1(op, "src", src)
    value = int(np.asarray(read(src, op)).reshape(-1)[0])
    out = NkiScalar(value, src.dtype)
    ctx = current()
    out.writer = ctx.seq
    ctx.emit(op, "sync", (src,), (out,))
    return out


def scalar_store(dst, value):
    """Store an NkiScalar into a 1x1 tensor of the same width in SBUF or HBM."""
    op = "scalar_store"
    _tracer_only(op)
    _check_1x1(op, "dst", dst)
    if not isinstance(value, NkiScalar):
        fail(op, f"value must be an NkiScalar, got {type(value).__name__}; a Python int stores nothing on the "
                 "device -- write a compile-time constant with nisa.memset")
    check_usable(value, op)
    if dst.dtype is not value.dtype:
        fail(op, f"dst dtype nl.{dst.dtype.name} must have the width of value (nl.{value.dtype.name}); store at the "
                 "scalar's own width and convert in memory")
    write(dst, dt.cast(np.array([value.value]), dst.dtype).reshape(dst.shape), op)
    current().emit(op, "sync", (value,), (dst,))
