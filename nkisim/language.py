"""`nki.language` (nl): dtypes, buffers, tile sizes, allocation, loops, and the experimental convenience API.

The convenience functions (nl.add, nl.exp, nl.load, nl.matmul, ...) lower to the same ISA implementations a
kernel would call directly, so they are checked, recorded and costed exactly like hand-written ISA code.
"""

import builtins
import contextlib
import inspect
import os
import warnings

import numpy as np

from . import dtypes as _dt
from . import isa as _isa
from .dtypes import (  # noqa: F401 - re-exported as nl.<dtype>
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    int64,
    tfloat32,
    uint8,
    uint16,
    uint32,
)
from .errors import NkiValidationError
from .frontend import parser_frontend
from .grids import NkiBlockGrid, NkiGrid, NkiTileGrid, alloc_blocks, alloc_tiles, blocks, tiles  # noqa: F401 - 0.7
from .memory import Allocation, check_buffer, hbm, private_hbm, psum, sbuf, shared_hbm  # noqa: F401
from .ops import FP32_MIN  # noqa: F401 - nl.FP32_MIN
from .runtime import access_of, current
from .tensor import DynSlice, NkiTensor, VirtualRegister, contiguous_strides, ds, read  # noqa: F401


class _NKIObjectType(type):
    """Construction as the real NKIObject does it: a keyword naming a class-level attribute is set on the instance
    even when the class's own `__init__` does not take it. A `@dataclass` subclass whose attributes carry no
    annotations gets an `__init__()` without parameters, yet the nki-library builds one with keywords
    (`SectionParams(section_idx=..., ...)`, core/attention/attention_cte.py)."""

    def __call__(cls, *args, **kwargs):
        init = cls.__init__
        if kwargs and init is not NKIObject.__init__:
            try:
                params = inspect.signature(init).parameters
            except (TypeError, ValueError):
                params = {}
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in params and hasattr(cls, k)}
                obj = super().__call__(*args, **kwargs)
                for key, value in extra.items():
                    object.__setattr__(obj, key, value)
                return obj
        return super().__call__(*args, **kwargs)


class NKIObject(metaclass=_NKIObjectType):
    """Base class for user classes inside kernels (NKI accepts only classes derived from it).

    AWS's stub gives it `__init__(self, **kwargs)`: keyword arguments become attributes, so a plain annotated
    subclass without an `__init__` of its own is built as `Dims(T=..., H=...)`. Annotated fields left out of the call
    (and without a class default) read as None rather than raising. Dataclass subclasses use their generated
    `__init__`, whose fields default to None the same way (see __init_subclass__).
    """

    def __init_subclass__(cls, **kwargs):
        # Fields are optional as in the real NKIObject, dataclass subclasses included: an annotated field without a
        # class default gets None before @dataclass reads the class, so its generated __init__ accepts omitting it
        # (the nki-library builds MLPTKGConstantsDimensionSizes without `remainderIFused`, core/mlp/mlp_tkg).
        super().__init_subclass__(**kwargs)
        for field in cls.__dict__.get("__annotations__", {}):
            if not hasattr(cls, field):
                setattr(cls, field, None)

    def __init__(self, **kwargs):
        for cls in reversed(type(self).__mro__):
            for field in getattr(cls, "__annotations__", {}):
                if field not in kwargs and not hasattr(self, field):
                    object.__setattr__(self, field, None)
        for key, value in kwargs.items():
            object.__setattr__(self, key, value)

    def __eq__(self, other):
        # The 0.6 parser's equality is structural ("Equality in NKI is structural", 0.6 language guide); the 0.7
        # tracer follows Python (identity unless the class defines __eq__, e.g. a dataclass), the change AWS's
        # specialization announcement warns about.
        if parser_frontend():
            return type(self) is type(other) and vars(self) == vars(other)
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = object.__hash__


class MemoryRegion:
    sbuf, psum, private_hbm, shared_hbm = "sbuf", "psum", "private_hbm", "shared_hbm"


def is_hbm(buf):
    return check_buffer(buf).is_hbm


def is_on_chip(buf):
    return check_buffer(buf).on_chip


def is_psum(buf):
    return check_buffer(buf) is psum


def is_sbuf(buf):
    return check_buffer(buf) is sbuf


# ---- tile sizes ---------------------------------------------------------------------------------------------

class _TileSize:
    """`nl.tile_size`: hardware tile limits of the current target (nki-api.md §3.6), read from its Target (which
    derives them from nkisim.hardware)."""

    bn_stats_fmax = 512
    psum_min_align = 4         # bytes; undocumented upstream, fp32 element alignment assumed
    sbuf_min_align = 4

    @property
    def pmax(self):
        return current().target.pmax

    @property
    def gemm_stationary_fmax(self):
        return current().target.gemm_stationary_fmax

    @property
    def gemm_moving_fmax(self):
        return current().target.gemm_moving_fmax

    @property
    def psum_bank_fmax_bytes(self):
        return current().target.psum_bank_bytes

    @property
    def psum_bank_fmax(self):
        return current().target.psum_bank_bytes // 4

    @property
    def psum_fmax(self):       # deprecated alias of psum_bank_fmax
        return self.psum_bank_fmax

    @property
    def psum_num_banks(self):
        # bank 7 is reserved when DMA transposes are lowered to PE transposes on trn2+
        reserve = os.environ.get("NKI_DMA_TRANSPOSE_AS_PE_TRANSPOSE", "").lower() == "true"
        return current().target.psum_num_banks - (1 if reserve and current().target.nc_version >= 3 else 0)

    @property
    def sbuf_fmax_bytes(self):
        return current().target.sbuf_usable_bytes

    @property
    def sbuf_fmax(self):
        return current().target.sbuf_usable_bytes // 4

    @property
    def total_available_sbuf_size(self):  # deprecated 0.4.0: per-partition usable bytes
        return current().target.sbuf_usable_bytes

    @property
    def sbuf_size_bytes(self):
        return current().target.sbuf_physical_bytes * current().target.pmax


tile_size = _TileSize()


# ---- allocation -----------------------------------------------------------------------------------------------

def _shape(shape, what="shape"):
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise NkiValidationError(f"{what}={shape!r} must be a tuple of ints") from None
    if any(s < 0 for s in shape):
        raise NkiValidationError(f"{what}={shape} has a negative dimension")
    return shape


def ndarray(shape, dtype, buffer=None, name="", address=None):
    """Allocate an uninitialised tensor (filled with the NaN / 4 sentinel); buffer defaults to nl.sbuf."""
    shape = _shape(shape)
    d = _dt.as_dtype(dtype)
    buf = check_buffer(sbuf if buffer is None else buffer)
    if buf.on_chip and len(shape) < 2:
        raise NkiValidationError(f"nl.ndarray: on-chip ({buf.name}) tensors need >= 2 dims [partition, free...], "
                                 f"got shape {shape}")
    ctx = current()
    if buf is shared_hbm and ctx.shared is not None:
        alloc = _shared_allocation(ctx, shape, d, name)
    else:
        alloc = Allocation(shape, d, buf, name=name, pool=ctx.pool if buf.on_chip else None, address=address)
    if ctx.loop_scopes:
        ctx.loop_scopes[-1].append(alloc)   # lives only in this fori_loop / while_loop iteration
    return NkiTensor(alloc, shape, contiguous_strides(shape), 0, d)


def _shared_allocation(ctx, shape, d, name):
    """Under LNC=2 the k-th shared_hbm allocation of both cores is the same tensor (SPMD program order)."""
    k = ctx.shared_alloc_count
    ctx.shared_alloc_count += 1
    sh = ctx.shared
    with sh.lock:
        if k < len(sh.shared_allocs):
            alloc = sh.shared_allocs[k]
            if alloc.shape != shape or alloc.dtype is not d:
                raise NkiValidationError(
                    f"nl.ndarray: core {ctx.program_id} allocated shared_hbm tensor #{k} as {shape} {d.name} but the "
                    f"other core allocated {alloc.shape} {alloc.dtype.name}: control flow differs across cores (C18)")
            return alloc
        alloc = Allocation(shape, d, shared_hbm, name=name)
        sh.shared_allocs.append(alloc)
        return alloc


def _filled(shape, dtype, buffer, name, value):
    t = ndarray(shape, dtype, buffer, name)
    if t.buffer.on_chip:
        # Integer fills follow the engine write rule (round half to even, NaN -> 0, saturate), as the HBM branch
        # below does: a fill value must not depend on the buffer it lands in.
        v = int(_dt.cast(np.array(value), t.dtype)) if t.dtype.is_int else float(value)
        _isa.memset(t, v)
    else:
        t.alloc.storage[...] = _dt.cast(np.array(value), t.dtype)
    return t


def zeros(shape, dtype, buffer=None, name=""):
    return _filled(shape, dtype, buffer, name, 0)


def ones(shape, dtype, buffer=None, name=""):
    return _filled(shape, dtype, buffer, name, 1)


def full(shape, fill_value, dtype, buffer=None, name=""):
    return _filled(shape, dtype, buffer, name, fill_value)


def zeros_like(x, dtype=None, buffer=None, name=""):
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def ones_like(x, dtype=None, buffer=None, name=""):
    return ones(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def full_like(x, fill_value, dtype=None, buffer=None, name=""):
    return full(x.shape, fill_value, dtype or x.dtype, buffer or x.buffer, name)


_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def empty_like(x, dtype=None, buffer=None, name="", *, transpose_axes=None, address=None):
    """Uninitialised storage with x's geometry (NKI 0.7: x may be a tile / block grid, whose navigation shape, tile
    shape, block grouping and remainder extents are kept, the selected cells packed densely). `transpose_axes`
    shapes an SBUF destination for a later nisa.dma_transpose of a tensor."""
    dtype = dtype if dtype is not None else x.dtype
    buffer = buffer if buffer is not None else x.buffer
    if isinstance(x, NkiGrid):
        if transpose_axes is not None:
            raise NotImplementedError("nl.empty_like(grid, transpose_axes=...): not implemented by nkisim")
        from .grids import empty_like_grid
        return empty_like_grid(x, dtype, buffer, name, address)
    shape = tuple(x.shape)
    if transpose_axes is not None:
        axes = tuple(transpose_axes)
        if _TRANSPOSE_AXES.get(len(shape)) != axes:
            raise NkiValidationError(f"nl.empty_like: transpose_axes={axes} is not supported for a rank-{len(shape)} "
                                     "tensor (supported: (1, 0), (2, 1, 0), (3, 1, 2, 0))")
        shape = tuple(shape[a] for a in axes)
        if check_buffer(buffer) is not sbuf:
            raise NkiValidationError("nl.empty_like(transpose_axes=...) prepares an SBUF destination; buffer must be "
                                     "nl.sbuf")
        if shape[0] > 128:
            raise NkiValidationError(f"nl.empty_like: transpose_axes={axes} makes the source free extent {shape[0]} "
                                     "the partition extent; it must not exceed 128")
    return ndarray(shape, dtype, buffer, name, address=address)


def rand(shape, dtype, buffer=None, name=""):
    t = ndarray(shape, dtype, buffer, name)
    ctx = current()
    rng = getattr(ctx, "rng", None) or np.random.default_rng(0)
    ctx.rng = rng
    t.alloc.storage[...] = _dt.cast(rng.random(t.size, dtype=np.float32), t.dtype)
    ctx.emit("rand", "gpsimd", (), (t,), p=t.shape[0], n=t.size // builtins.max(t.shape[0], 1))
    return t


def random_seed(seed):
    if not isinstance(seed, NkiTensor) or seed.shape != (1, 1) or seed.buffer is not sbuf:
        raise NkiValidationError("nl.random_seed(seed): seed must be a [1, 1] SBUF tensor, not a Python int")
    current().rng = np.random.default_rng(int(np.asarray(read(seed)).reshape(-1)[0]))


def shared_constant(constant, dtype=None):
    """A shared_hbm tensor holding a NumPy array (or the contents of a .npy path)."""
    arr = np.load(constant) if isinstance(constant, (str, os.PathLike)) else np.asarray(constant)
    d = _dt.as_dtype(dtype if dtype is not None else arr.dtype)
    t = ndarray(arr.shape, d, shared_hbm)
    t.alloc.storage[...] = _dt.cast(arr, d).reshape(-1)
    return t


def shared_identity_matrix(n, dtype=uint8, dst=None):
    """An n x n identity in SBUF (AWS: "Create an identity matrix in SBUF"), or written into `dst` when given.

    The result is an on-chip operand as AWS's kernels use it (`nc_matmul(moving=identity[...])`, `.ap()` on it).
    """
    if dst is None:
        dst = ndarray((n, n), dtype, sbuf)
    eye = np.eye(n)
    if dst.buffer.on_chip:
        from .tensor import write
        write(dst, _dt.cast(eye, dst.dtype).reshape(dst.shape))
    else:
        dst.alloc.storage[...] = _dt.cast(eye, dst.dtype).reshape(-1)
    return dst


# ---- SPMD / LNC -----------------------------------------------------------------------------------------------

def program_id(axis=0):
    if axis != 0:
        raise NkiValidationError(f"nl.program_id(axis={axis}): only axis 0 exists under LNC launches")
    return current().program_id


def num_programs(axes=None):
    if axes not in (0, None):
        raise NkiValidationError(f"nl.num_programs(axes={axes}): only axis 0 exists under LNC launches")
    return current().num_programs


def program_ndim():
    return 1 if current().num_programs > 1 else 0


# ---- loops ------------------------------------------------------------------------------------------------------

def _deprecated_range(name):
    # NKI 0.7 ("NKI Loops" deep-dive): the static range iterators are deprecated and default to Python range.
    warnings.warn(f"nl.{name} is deprecated in NKI 0.7 and behaves as Python range; use range(...) (for runtime "
                  "loops, nl.fori_loop)", DeprecationWarning, stacklevel=3)


def affine_range(start, stop=None, step=1):
    _deprecated_range("affine_range")
    return range(start, stop, step)


def sequential_range(start, stop=None, step=1):
    _deprecated_range("sequential_range")
    return range(start, stop, step)


def static_range(start, stop=None, step=1):
    _deprecated_range("static_range")
    return range(start, stop, step)


def range(start, stop=None, step=1):  # noqa: A001 - NKI's name; used as `nl.range(...)`
    """`nl.range`: a Python range (NKI 0.7: the static range iterators "default to Python range")."""
    return builtins.range(start, stop, step) if stop is not None else builtins.range(start)


bool = bool_  # noqa: A001 - `nl.bool`, the same dtype as `nl.bool_`


def dynamic_range(start, stop=None, step=1):
    """0.6 runtime loop over register bounds. Removed from the 0.7 tracer; kept under NKI_COMPILER_FRONTEND=custom."""
    if not parser_frontend():
        raise TypeError("nl.dynamic_range is not supported by the NKI 0.7 tracer frontend (a register's value is not "
                        "known while the kernel is built): use nl.fori_loop(lower, upper, body_fun, step) -- or set "
                        "NKI_COMPILER_FRONTEND=custom for the deprecated 0.6 parser")
    if not isinstance(step, (int, np.integer)) or isinstance(step, VirtualRegister) or step <= 0:
        raise NkiValidationError(f"nl.dynamic_range: step={step!r} must be a compile-time positive int")
    lo, hi = (0, start) if stop is None else (start, stop)
    from .tensor import scalar_value
    return range(scalar_value(lo, "dynamic_range start"), scalar_value(hi, "dynamic_range stop"), step)


def _loop_bound(b, what):
    """Current value of a fori_loop bound: a compile-time int, a VirtualRegister or (tracer) a 32-bit NkiScalar."""
    from .isa.scalars import NkiScalar, check_usable
    from .tensor import scalar_value
    if isinstance(b, NkiTensor):
        raise NkiValidationError(f"nl.fori_loop: {what} is a tensor; a bound is an int, a VirtualRegister or an "
                                 "NkiScalar (read the tensor with nisa.scalar_load or nisa.register_load)")
    if isinstance(b, NkiScalar):
        check_usable(b, f"nl.fori_loop {what}")
        if b.bits != 32:
            raise NkiValidationError(f"nl.fori_loop: {what} is an nl.{b.dtype.name} NkiScalar; a bound must be 32-bit "
                                     "(the loop's trip-count comparison has no 64-bit form)")
    return scalar_value(b, f"fori_loop {what}")


@contextlib.contextmanager
def _iteration_scope(ctx, loop):
    """Allocations made while one iteration of a runtime loop runs; afterwards no instruction may use them."""
    ctx.loop_scopes.append([])
    try:
        yield
    finally:
        for alloc in ctx.loop_scopes.pop():
            ctx.dead_allocs[alloc.id] = loop


def fori_loop(lower, upper, body_fun, step=1):
    """Runtime loop: body_fun(i) for i in [lower, upper) step `step` (compile-time positive int).

    Under the 0.7 tracer `i` is an NkiScalar (arithmetic such as `i * 4 + 1` is allowed) unless a bound is a
    VirtualRegister, then a VirtualRegister; under the 0.6 parser it is a frozen VirtualRegister. Tensors allocated
    inside the body are not usable after the iteration that allocated them."""
    from .isa.scalars import NkiScalar
    ctx = current()
    if ctx.no_reorder_depth:
        raise NkiValidationError("nl.fori_loop is not allowed inside nl.no_reorder()")
    if isinstance(step, (VirtualRegister, builtins.bool)) or not isinstance(step, (int, np.integer)) or step <= 0:
        raise NkiValidationError(f"nl.fori_loop: step={step!r} must be a positive compile-time int")
    lo = _loop_bound(lower, "lower")
    hi = _loop_bound(upper, "upper")
    register_bound = any(isinstance(b, VirtualRegister) and not isinstance(b, NkiScalar) for b in (lower, upper))
    if parser_frontend() or register_bound:
        ivar = VirtualRegister(lo, frozen=True)
    else:
        ivar = NkiScalar(lo)
    # Cost model: with register / scalar bounds every instruction of the loop depends on their producers (control
    # dependency); the induction variable itself has no recorded writer (each engine steps its own copy).
    prev = ctx.ctrl
    dyn = tuple(access_of(b) for b in (lower, upper) if isinstance(b, VirtualRegister))
    if dyn:
        ctx.ctrl = prev + dyn
    try:
        for i in range(lo, hi, int(step)):
            ivar.value = i
            ctx.emit("loop_iter", "sync", (), ())
            with _iteration_scope(ctx, "nl.fori_loop"):
                if body_fun(ivar) is not None:
                    raise NkiValidationError("nl.fori_loop: body_fun must return None")
    finally:
        ctx.ctrl = prev


def while_loop(init, body_fun):
    """Runtime loop: r = init; while r != 0: r = body_fun(r). The body gets the current condition as a register
    passed by value (a copy it may overwrite and return) and returns the next condition register."""
    ctx = current()
    if ctx.no_reorder_depth:
        raise NkiValidationError("nl.while_loop is not allowed inside nl.no_reorder()")
    cond = init
    prev = ctx.ctrl
    try:
        while (cond.value if isinstance(cond, VirtualRegister) else int(cond)) != 0:
            # cost model: this iteration's instructions depend on the writer of the condition register
            ctx.ctrl = prev + (access_of(cond),) if isinstance(cond, VirtualRegister) else prev
            ctx.emit("loop_iter", "sync", (), ())
            cur = cond.value if isinstance(cond, VirtualRegister) else int(cond)
            with _iteration_scope(ctx, "nl.while_loop"):
                cond = body_fun(VirtualRegister(cur))
            if not isinstance(cond, (VirtualRegister, int, np.integer)):
                raise NkiValidationError("nl.while_loop: body_fun must return the next condition (a VirtualRegister)")
    finally:
        ctx.ctrl = prev


@contextlib.contextmanager
def no_reorder():
    ctx = current()
    ctx.no_reorder_depth += 1
    start = ctx.seq
    try:
        yield
    finally:
        ctx.no_reorder_depth -= 1
        if ctx.no_reorder_depth == 0 and ctx.seq > start:
            # the cost model chains the instructions recorded in [start, end) (nkisim.cost.schedule)
            spans = ctx.__dict__.setdefault("no_reorder_spans", [])
            spans.append((start, ctx.seq))


def device_print(print_prefix, tensor):
    if not isinstance(print_prefix, str):
        raise NkiValidationError("nl.device_print: print_prefix must be a constant string")
    if tensor.buffer is psum:
        raise NkiValidationError("nl.device_print: tensor must be in SBUF or HBM")
    ctx = current()
    print(f"{print_prefix} (core {ctx.program_id}) {tensor.shape} {tensor.dtype.name}:\n"
          f"{np.asarray(read(tensor)).astype(np.float32)}")


# ---- data movement and matmul wrappers ---------------------------------------------------------------------

def _out(shape, dtype, buffer=sbuf):
    shape = tuple(shape)
    if len(shape) < 2:
        shape = (shape[0] if shape else 1, 1)
    return ndarray(shape, dtype, buffer)


def load(src, dtype=None):
    t = _out(src.shape if len(src.shape) >= 2 else (1,) + tuple(src.shape), dtype or src.dtype)
    _isa.dma_copy(dst=t, src=src)
    return t


def store(dst, value):
    if value.buffer is psum:
        raise NkiValidationError("nl.store: value in PSUM is not supported; copy it to SBUF first")
    _isa.dma_copy(dst=dst, src=value)


def load_transpose2d(src, dtype=None):
    if src.ndim != 2:
        raise NkiValidationError(f"nl.load_transpose2d: src must be 2-D, got {src.shape}")
    t = _out((src.shape[1], src.shape[0]), src.dtype)
    _isa.dma_transpose(dst=t, src=src)
    if dtype is not None and _dt.as_dtype(dtype) is not t.dtype:
        return copy(t, dtype)
    return t


def copy(x, dtype=None):
    t = _out(x.shape, dtype or x.dtype)
    _isa.tensor_copy(dst=t, src=x)
    return t


copy._nki_op = "copy"  # also the identity activation: nisa.activation(op=nl.copy)


def matmul(x, y, transpose_x=False):
    """x [K, M] (transpose_x=True), y [K, N] in SBUF -> PSUM [M, N] fp32."""
    if not transpose_x:
        raise NkiValidationError("nl.matmul(transpose_x=False) is a known-broken path in NKI 0.6; pass x as [K, M] "
                                 "with transpose_x=True")
    t = ndarray((x.shape[1],) + tuple(y.shape[1:]), float32, psum)
    _isa.nc_matmul(dst=t, stationary=x, moving=y)
    return t


def transpose(x, dtype=None):
    if x.ndim != 2:
        raise NkiValidationError(f"nl.transpose: x must be 2-D, got {x.shape}")
    t = ndarray((x.shape[1], x.shape[0]), x.dtype, psum)
    _isa.nc_transpose(dst=t, data=x)
    if dtype is not None and _dt.as_dtype(dtype) is not t.dtype:
        return copy(t, dtype)  # nc_transpose keeps the input dtype (C5); honour dtype= with a cast, as load_transpose2d
    return t


def expand_dims(x, axis):
    return x.expand_dim(axis)


def broadcast_to(x, shape, dtype=None):
    shape = _shape(shape)
    v = x
    for d, (have, want) in enumerate(zip(x.shape, shape)):
        if have != want:
            v = v.broadcast(d, want)
    return copy(v, dtype) if x.buffer.on_chip else v


from ._nl_math import *  # noqa: E402,F401,F403 - the math API shares this namespace
from ._nl_math import __all__ as _math_all  # noqa: E402

__all__ = [n for n in dir() if not n.startswith("_")] + list(_math_all)
