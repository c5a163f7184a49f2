"""TensorE: nc_matmul (dst[M, N] (=|+=) stationary[K, M].T @ moving[K, N]) and nc_transpose."""

import math

import numpy as np

from .. import _env
from .. import dtypes as dt
from .._blas import gemm_accumulate
from .._blas import single_thread as single_blas_thread
from ..errors import NkiUninitializedReadWarning
from ..memory import psum, sbuf
from ..runtime import current
from ..tensor import np_view, read, write
from ._common import check_engine, fail, free_size, mark_psum, on_chip, psum_state_view, store
from .enums import engine as Engine
from .enums import matmul_perf_mode

_MATMUL_INPUTS = {"float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32"}
_FP32_FAMILY = {"float32", "tfloat32"}
_FP8 = {"float8_e4m3", "float8_e5m2", "float8_e4m3fn"}
_TILE_SIZES = (32, 64, 128)


_MATMUL_INPUTS_V4 = _MATMUL_INPUTS | {"float8_e4m3fn"}


def _check_dtypes(op, stationary, moving, dst, v, double_row):
    allowed = _MATMUL_INPUTS_V4 if v >= 4 else _MATMUL_INPUTS
    for name, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype.name not in allowed:
            fail(op, f"{name} dtype {t.dtype.name} is not a matmul input dtype on NeuronCore-v{v} "
                     f"(allowed: {', '.join(sorted(allowed))}) (C4)")
        if double_row and t.dtype.name not in _FP8:
            fail(op, f"perf_mode=double_row needs fp8 inputs; {name} is {t.dtype.name} (C4)")
    s, m = stationary.dtype.name, moving.dtype.name
    if (s in _FP32_FAMILY) != (m in _FP32_FAMILY):
        fail(op, f"stationary {s} and moving {m}: float32/tfloat32 can only pair with float32/tfloat32 (C4)")
    if {s, m} == {"float8_e4m3", "float8_e4m3fn"}:
        fail(op, "float8_e4m3 and float8_e4m3fn cannot be mixed in one matmul (C4)")
    ok_dst = ("float32", "bfloat16") if v >= 4 else ("float32",)
    if dst.dtype.name not in ok_dst:
        fail(op, f"dst dtype {dst.dtype.name} must be {' or '.join(ok_dst)} on NeuronCore-v{v} (C4)")


def _check_tiling(op, tile_position, tile_size, v, double_row):
    if not tile_position and not tile_size:
        return 128, 128
    if not tile_position or not tile_size:
        fail(op, "tile_position and tile_size must both be set to enable tiling mode (C3)")
    (r0, c0), (rs, cs) = tile_position, tile_size
    sizes = _TILE_SIZES if v >= 3 else (64, 128)
    if rs not in sizes or cs not in sizes:
        fail(op, f"tile_size={tuple(tile_size)}: row/column tile sizes must be one of {sizes} on NeuronCore-v{v} (C3)")
    if r0 % rs or c0 % cs or r0 + rs > 128 or c0 + cs > 128:
        fail(op, f"tile_position={tuple(tile_position)} must be multiples of tile_size={tuple(tile_size)} inside "
                 "the 128x128 array (C3)")
    if double_row and cs != 128:
        fail(op, "perf_mode=double_row cannot be combined with column tiling (C4)")
    return rs, cs


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    op = "nc_matmul"
    ctx = current()
    v = ctx.target.nc_version
    on_chip(op, "stationary", stationary, (sbuf,))
    on_chip(op, "moving", moving, (sbuf,))
    on_chip(op, "dst", dst, (psum,))
    if not isinstance(perf_mode, matmul_perf_mode):
        fail(op, f"perf_mode={perf_mode!r} must be an nki.isa.matmul_perf_mode value (C15)")
    if accumulate not in (None, True, False):
        fail(op, f"accumulate={accumulate!r} must be None, True or False (C16)")
    double_row = perf_mode is matmul_perf_mode.double_row
    if double_row and v < 3:
        fail(op, "perf_mode=double_row requires NeuronCore-v3 or newer (C19)")
    if is_transpose and double_row:
        fail(op, "is_transpose cannot be combined with perf_mode=double_row (C4)")
    if not is_transpose:
        _check_dtypes(op, stationary, moving, dst, v, double_row)
    k = stationary.shape[0]
    if moving.shape[0] != k:
        fail(op, f"contraction (partition) sizes differ: stationary K={k}, moving K={moving.shape[0]} (C3)")
    if double_row:
        if stationary.ndim < 3 or moving.ndim < 3 or stationary.shape[1] != 2 or moving.shape[1] != 2:
            fail(op, f"perf_mode=double_row needs [K, 2, M] stationary and [K, 2, N] moving, got "
                     f"{stationary.shape} and {moving.shape} (C4)")
        m = free_size(stationary) // 2
        n_shape = moving.shape[2:]
    else:
        m = free_size(stationary)
        n_shape = moving.shape[1:]
    rs, cs = _check_tiling(op, tile_position, tile_size, v, double_row)
    if k > rs:
        fail(op, f"stationary partition (K) {k} exceeds {rs} (the row tile size; C3)")
    if m > cs:
        fail(op, f"stationary free size (M) {m} exceeds {cs} (the column tile size; C3)")
    n = math.prod(n_shape) if n_shape else 1
    nmax = (ctx.target.matmul_moving_fmax_bf16 if dst.dtype is dt.bfloat16 else ctx.target.matmul_moving_fmax_fp32)
    if n > nmax:
        fail(op, f"moving free size (N) {n} exceeds {nmax} for a {dst.dtype.name} dst on {ctx.target.name} (C3)")
    if dst.shape[0] != m or free_size(dst) != n:
        fail(op, f"dst shape {dst.shape} must be (M={m}, N={n}) = ({m}, *{tuple(n_shape)}) (C3)")
    _check_bank(op, ctx, dst)

    if not ctx.numerics:          # trace-only run: shapes and the instruction record only
        result = np.zeros((m, n), np.float32)
    elif is_transpose:
        result = _transpose_mode(op, stationary, moving, dst, v)
    else:
        s = dt.to_fp32(read(stationary)).reshape(k * (2 if double_row else 1), m)
        mv = dt.to_fp32(read(moving)).reshape(k * (2 if double_row else 1), n)
        if double_row:  # K split as partition x 2: rows (p, j) pair up identically in both operands
            s = s.reshape(k, 2, m).reshape(2 * k, m)
            mv = mv.reshape(k, 2, n).reshape(2 * k, n)
        view = dst._npv if dst.gather is None else None
        if view is None and dst.gather is None:
            view = np_view(dst)
        if (accumulate is False and view is not None and view.shape == (m, n) and dst.dtype is dt.float32
                and view.dtype == np.float32 and view.flags.c_contiguous):
            # A group's first step into a [M, N] fp32 tile: the GEMM writes the PSUM storage directly (what
            # _accumulate's store would copy there), no temporary.
            _product(op, s, mv, view)
            dst.alloc.written = True
            mark_psum(dst, 1)
            result = None
        elif (accumulate is not False and view is not None and view.shape == (m, n) and dst.dtype is dt.float32
              and _env.get("NKISIM_MATMUL_ACC", "fp32") == "fp32" and _all_matmul_written(dst)
              and _gemm_accumulate_once(s, mv, view)):
            # A later step of a group whose [M, N] fp32 tile holds matmul partial sums everywhere: the GEMM adds
            # into PSUM itself (what _accumulate's fast path adds from a temporary).
            dst.alloc.written = True
            result = None
        else:
            result = _product(op, s, mv, _scratch(ctx, m, n))
    if result is not None:
        _accumulate(op, ctx, dst, result.reshape(dst.shape), accumulate, v)
    ctx.emit(op, "tensor", (stationary, moving), (dst,), k=k, m=m, n=n,
             dtype=moving.dtype.name, stationary_dtype=stationary.dtype.name,
             double_row=double_row, transpose=bool(is_transpose),
             onezero=bool(is_stationary_onezero or is_moving_onezero), tile=(rs, cs))


def _all_matmul_written(dst):
    state = psum_state_view(dst)
    return state is not None and state.min() == 1


def _gemm_accumulate_once(s, mv, c):
    with single_blas_thread():
        return gemm_accumulate(s, mv, c)


def _scratch(ctx, m, n):
    """The core's reusable [M, N] fp32 GEMM output (a step's product is consumed by _accumulate before the next
    matmul of that core): saves allocating and first-touching a fresh product array per instruction."""
    buf = ctx.matmul_scratch.get((m, n))
    if buf is None:
        buf = ctx.matmul_scratch[(m, n)] = np.empty((m, n), np.float32)
    return buf


def _product(op, s, mv, out=None):
    """s.T @ mv in fp32.

    Default: NumPy's fp32 BLAS, whose summation order depends on the whole operand shapes (OpenBLAS picks kernels
    and blockings by M, N, K), so the same dot product can differ in the last bit between tiles of different sizes.
    On TensorE an output element's accumulation depends only on its own row and column, which is what makes e.g.
    a batch split bit-identical to the unsplit run. `NKISIM_MATMUL_ACC=fp64` models that: products (exact in fp64
    for bf16/fp8/fp32 inputs) are summed in fp64 and rounded once to fp32, so the result is a function of the
    element's own inputs only (up to fp64 rounding of sums whose terms span more than ~2^30) -- at several times
    the cost, hence opt-in.

    `out`: a C-contiguous [M, N] fp32 array to write the product into (returned), as `np.matmul(..., out=out)`:
    the same BLAS call as without it, so the same bits.
    """
    mode = _env.get("NKISIM_MATMUL_ACC", "fp32")
    with single_blas_thread():      # tile-sized GEMMs: BLAS threads only cost (nkisim/_blas.py)
        if mode == "fp32":
            return np.matmul(s.T, mv, out=out)
        if mode == "fp64":
            r = s.T.astype(np.float64) @ mv.astype(np.float64)
            if out is None:
                return r.astype(np.float32)
            np.copyto(out, r, casting="same_kind")
            return out
    fail(op, f"NKISIM_MATMUL_ACC={mode!r} must be 'fp32' (default) or 'fp64'")


def _transpose_mode(op, stationary, moving, dst, v):
    if v < 3:
        fail(op, "is_transpose=True (bit-accurate transpose) requires NeuronCore-v3 or newer (C19)")
    if dst.dtype is not stationary.dtype and not (stationary.dtype.itemsize == 1 and dst.dtype.itemsize == 2):
        fail(op, f"is_transpose: dst dtype {dst.dtype.name} must equal the input dtype {stationary.dtype.name} (C5)")
    ident = dt.to_fp32(read(moving)).reshape(moving.shape[0], -1)
    k, n = ident.shape
    if k != n or not np.array_equal(ident, np.eye(k, dtype=np.float32)):
        fail(op, "is_transpose=True expects moving to be a square identity matrix (C5)")
    s = np.asarray(read(stationary)).reshape(k, -1)
    return s.T  # bit-accurate: no arithmetic, NaN/Inf preserved


def _check_bank(op, ctx, dst):
    # C6: on v2/v3 one matmul writes within a single 2 KiB PSUM bank.
    a = dst.alloc
    if a.psum_addr is None or ctx.target.nc_version >= 4:
        return
    isz = dst.dtype.itemsize
    row = a.storage.size // a.shape[0]
    lo = hi = dst.offset % row
    for nn, s in zip(dst.shape[1:], dst.strides[1:]):
        if nn > 1:
            lo, hi = (lo + (nn - 1) * s, hi) if s < 0 else (lo, hi + (nn - 1) * s)
    bb = ctx.target.psum_bank_bytes
    first, last = (a.psum_addr + lo * isz) // bb, (a.psum_addr + (hi + 1) * isz - 1) // bb
    if first != last:
        fail(op, f"dst '{dst.name}' spans PSUM banks {first}..{last}; a matmul output must fit in one 2 KiB bank "
                 f"(512 fp32) on {ctx.target.name} (C6)")


def _accumulate(op, ctx, dst, result, accumulate, v):
    state = psum_state_view(dst)
    view = np_view(dst)
    if accumulate is False or state is None:
        store(op, dst, result, from_matmul=True)
        mark_psum(dst, 1)
        return
    if dst.dtype is dt.float32 and view.dtype == np.float32 and state.min() == 1:
        # Fast path of every K-loop step after the first: all locations hold matmul partial sums.
        view += result
        dst.alloc.written = True
        return
    written = state != 0
    if accumulate is True and not written.all():
        ctx.warn_once(("acc-uninit", dst.alloc.id), f"{op}: accumulate=True onto PSUM '{dst.name}' that was never "
                      "written by a matmul: undefined on hardware (C16); use accumulate=False for the first write",
                      NkiUninitializedReadWarning)
    if v <= 3 and (state == 2).any():
        ctx.warn_once(("acc-other", dst.alloc.id), f"{op}: accumulating onto PSUM '{dst.name}' initialised by a "
                      "non-matmul instruction (memset/tensor_copy) is undefined on NeuronCore-v2/v3 (C16)",
                      NkiUninitializedReadWarning)
    old = dt.to_fp32(view)
    if accumulate is True:
        new = np.where(written, old, 0.0) + result
    else:  # auto: first write to a location overwrites, later writes accumulate
        new = np.where(written, old + result, result)
    store(op, dst, new, from_matmul=True)
    mark_psum(dst, 1)


# Accumulation groups interleaving inside one PSUM bank (several groups open at different offsets of a bank) are
# not checked: AWS's docs define a group per PSUM bank for scheduling ("up to eight outstanding matmul accumulation
# groups" with 8 banks, trainium_inferentia2_arch.rst) but do not say interleaving gives wrong results, and AWS's
# nki-library interleaves groups in a bank with correct results. (An earlier warning claiming wrong results on trn2
# was dropped for want of a source.)


def nc_transpose(dst, data, engine=Engine.unknown, name=None):
    """2-D partition<->free transpose on TensorE (SBUF -> PSUM, <=128x128) or VectorE (<=32x32)."""
    op = "nc_transpose"
    ctx = current()
    check_engine(op, engine, (Engine.tensor, Engine.vector))
    on_chip(op, "data", data)
    on_chip(op, "dst", dst)
    p, f = data.shape[0], free_size(data)
    if engine is Engine.unknown:
        engine = Engine.vector if (p <= 32 and f <= 32 and dst.buffer is not psum) or data.buffer is psum \
            else Engine.tensor
    if dst.dtype is not data.dtype:
        fail(op, f"dst dtype {dst.dtype.name} must equal data dtype {data.dtype.name} (C5)")
    if dst.shape[0] != f or free_size(dst) != p:
        fail(op, f"dst shape {dst.shape} must be ({f}, {p}) for data of shape {data.shape} (C5)")
    if engine is Engine.tensor:
        if data.buffer is not sbuf or dst.buffer is not psum:
            fail(op, "the TensorE transpose reads SBUF and writes PSUM (C5)")
        if p > 128 or f > 128:
            fail(op, f"TensorE transpose is limited to [128, 128], got [{p}, {f}] (C5)")
    else:
        if p > 32 or f > 32:
            fail(op, f"VectorE transpose is limited to [32, 32], got [{p}, {f}] (C5)")
    vals = np.asarray(read(data)).reshape(p, f).T
    write(dst, vals.reshape(dst.shape), op)
    if dst.buffer is psum:
        mark_psum(dst, 1 if engine is Engine.tensor else 2)
    ctx.emit(op, engine.name, (data,), (dst,), k=p, m=p, n=f, p=p, f=f, dtype=data.dtype.name, transpose=True)
