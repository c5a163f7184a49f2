"""Trn3 (NeuronCore-v4) microscaling ops: nisa.quantize_mx (VectorE) and nisa.nc_matmul_mx (TensorE).

Semantics and limits from AWS's nki.isa docs for both ops; the formats (x4 packing, E8M0 scales, the quadrant
layout of scale tiles) are in nkisim.mx. Numerics follow the OCP MX rule the library's hardware-tested golden
(nkilib core/utils/mx_torch_common.py) encodes: scale = largest fp32 exponent of the 8x4 group minus the element
format's largest exponent; data divided by 2**(scale-127), clamped, rounded to nearest even.
"""

import numpy as np

from .. import dtypes as dt
from .. import mx
from ..memory import psum, sbuf
from ..runtime import current
from ..tensor import read, write
from ._common import fail, free_size, on_chip, require_version, start_partition, tensor
from .tensor_engine import _accumulate, _product

_QUANT_SRC = ("bfloat16", "float16")
_QUANT_DST = ("float8_e5m2_x4", "float8_e4m3fn_x4")
_MATMUL_DATA = ("float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4")


def _check_scale_tile(op, name, scale, data_p, free):
    """A scale tile in quadrant layout: partitions q*32 + 0..3 of the view hold the scales of data quadrant q."""
    # Not the generic start-partition rule (C13): AWS places scale tiles in the first *or second* 8 partitions
    # of each quadrant, so a scale view may start at partition 8.
    tensor(op, name, scale)
    if scale.buffer is not sbuf:
        fail(op, f"{name} '{scale.name}' is in {scale.buffer.name}; it must be in sbuf (C33)")
    if scale.dtype not in (dt.uint8, dt.float8_e8m0fnu):
        # AWS (Neuron 2.32 pages of quantize_mx / nc_matmul_mx): float8_e8m0fnu (OCP MX) or uint8 (kept for
        # backward compatibility); both hold the biased exponent byte
        fail(op, f"{name} dtype must be float8_e8m0fnu or uint8, got {scale.dtype.name} (C33)")
    need = int(mx.scale_rows(data_p)[-1]) + 1
    if scale.shape[0] < need:
        fail(op, f"{name} has {scale.shape[0]} partitions; {data_p} data partitions keep their scales in partitions "
                 f"q*32+0..3 of each quadrant, so it needs at least {need} (C33)")
    if free_size(scale) != free:
        fail(op, f"{name} has {free_size(scale)} elements per partition, expected {free} (one per x4 data "
                 "element) (C33)")
    if start_partition(scale) % mx.QUADRANT >= 16:
        fail(op, f"{name} starts at partition {start_partition(scale)}; scales must sit in the first 16 partitions "
                 "of each SBUF quadrant (C33)")


def _exponent_bytes(scale):
    """The scale tile as its exponent bytes (a float8_e8m0fnu tile is reinterpreted as uint8)."""
    return scale if scale.dtype is dt.uint8 else scale.view(dt.uint8)


def _scales(scale, data_p):
    """Dense [P/8, F] uint8 scales read from a quadrant-layout scale tile."""
    s = np.asarray(read(_exponent_bytes(scale))).reshape(scale.shape[0], -1)
    return s[mx.scale_rows(data_p)].astype(np.int32)


def quantize_mx(dst, src, dst_scale, name=None):
    """Quantize bf16/fp16 `src` [P, F] to MXFP8: `dst` [P, F/4] x4 words and `dst_scale` in quadrant layout."""
    op = "quantize_mx"
    require_version(op, 4)
    for nm, t in (("src", src), ("dst", dst)):
        on_chip(op, nm, t, (sbuf,))
    if src.dtype.name not in _QUANT_SRC:
        fail(op, f"src dtype must be float16 or bfloat16, got {src.dtype.name} (C33)")
    if dst.dtype.name not in _QUANT_DST:
        fail(op, f"dst dtype must be float8_e5m2_x4 or float8_e4m3fn_x4, got {dst.dtype.name} (C33)")
    p, f = src.shape[0], free_size(src)
    if p % mx.QUADRANT:
        fail(op, f"src partition dimension {p} must be a multiple of 32 (and at most 128) (C33)")
    if f % mx.GROUP_F:
        fail(op, f"src free size {f} must be a multiple of 4 (C33)")
    if dst.shape[0] != p or free_size(dst) != f // mx.GROUP_F:
        fail(op, f"dst shape {dst.shape} must have {p} partitions and {f // mx.GROUP_F} elements per partition "
                 "(one x4 word per 4 src elements) (C33)")
    _check_scale_tile(op, "dst_scale", dst_scale, p, f // mx.GROUP_F)
    if start_partition(dst) // mx.QUADRANT != start_partition(dst_scale) // mx.QUADRANT:
        fail(op, f"dst (partition {start_partition(dst)}) and dst_scale (partition {start_partition(dst_scale)}) "
                 "must reside in the same SBUF quadrant(s) (C33)")
    values = dt.to_fp32(read(src)).reshape(p, f)
    words, dense = mx.quantize(values, dst.dtype)
    write(dst, words.reshape(dst.shape), op)
    bits = _exponent_bytes(dst_scale)
    scale_now = np.array(read(bits)).reshape(dst_scale.shape[0], -1)
    scale_now[mx.scale_rows(p)] = dense   # the other partitions of the scale tile are not written
    write(bits, scale_now.reshape(dst_scale.shape), op)
    current().emit(op, "vector", (src,), (dst, dst_scale), p=p, n=f, dtype=src.dtype.name,
                   in_dtypes=(src.dtype.name,))


def _check_row_tiling(op, tile_position, tile_size):
    if not tile_position and not tile_size:
        return 128
    if not tile_position or not tile_size:
        fail(op, "tile_position and tile_size must both be set to enable tiling mode (C33)")
    (r0, c0), (rs, cs) = tile_position, tile_size
    if cs != 128 or c0 != 0:
        fail(op, f"tile_size={tuple(tile_size)}, tile_position={tuple(tile_position)}: only row tiling is supported "
                 "(column_size must be 128 and start_column 0) (C33)")
    if rs not in (32, 64, 128) or r0 % rs or r0 + rs > 128:
        fail(op, f"tile_size row {rs} must be 32/64/128 and tile_position row {r0} a multiple of it inside 128 (C33)")
    return rs


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    """dst[M, N] (=|+=) sum over partitions k and the x4 lane q of dequantized stationary[k, M, q] * moving[k, N, q]."""
    op = "nc_matmul_mx"
    ctx = current()
    require_version(op, 4)
    on_chip(op, "stationary", stationary, (sbuf,))
    on_chip(op, "moving", moving, (sbuf,))
    on_chip(op, "dst", dst, (psum,))
    if accumulate not in (None, True, False):
        fail(op, f"accumulate={accumulate!r} must be None, True or False (C33)")
    for nm, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype.name not in _MATMUL_DATA:
            fail(op, f"{nm} dtype must be one of {', '.join(_MATMUL_DATA)}, got {t.dtype.name} (C33)")
    if dst.dtype.name not in ("float32", "bfloat16"):
        fail(op, f"dst dtype must be float32 or bfloat16, got {dst.dtype.name} (C33)")
    rs = _check_row_tiling(op, tile_position, tile_size)
    p = stationary.shape[0]
    if moving.shape[0] != p:
        fail(op, f"stationary and moving partition sizes differ ({p} vs {moving.shape[0]}) (C33)")
    if p % mx.QUADRANT or p > rs:
        fail(op, f"partition size {p} must be a multiple of 32 not exceeding {rs} (C33)")
    m, n = free_size(stationary), free_size(moving)
    if m % 2 or m > 128:
        fail(op, f"stationary free size {m} must be even and at most 128 (C33)")
    # AWS nc_matmul_mx (Neuron 2.32): up to 4096 (fp32 dst) / 8192 (bf16 dst), the 8 PSUM banks (older pages: 512);
    # a dst that large is already refused by PSUM capacity (C6), this names the matmul limit for strided dsts
    nmax = 8192 if dst.dtype is dt.bfloat16 else 4096
    if n > nmax:
        fail(op, f"moving free size {n} exceeds {nmax} for a {dst.dtype.name} dst (C33)")
    if dst.shape[0] != m or free_size(dst) != n:
        fail(op, f"dst shape {dst.shape} must be (M={m}, N={n}) (C33)")
    _check_scale_tile(op, "stationary_scale", stationary_scale, p, m)
    _check_scale_tile(op, "moving_scale", moving_scale, p, n)

    def dequant(data, scale, free):
        """[P, free] x4 words -> fp32 [4P, free]: row (q, k) is lane q of partition k, scaled by its group."""
        vals = mx.decode(np.asarray(read(data)).reshape(p, free), data.dtype).reshape(p, free, mx.GROUP_F)
        factor = np.exp2(np.repeat(_scales(scale, p), mx.GROUP_P, axis=0) - float(mx.SCALE_BIAS))
        vals = vals * factor[:, :, None].astype(np.float32)   # exact: a power of two times a <=4-bit mantissa
        return np.ascontiguousarray(vals.transpose(2, 0, 1)).reshape(mx.GROUP_F * p, free)

    s = dequant(stationary, stationary_scale, m)
    mv = dequant(moving, moving_scale, n)
    result = _product(op, s, mv)   # contraction over partitions and x4 lanes, as nc_matmul's (fp32 by default)
    _accumulate(op, ctx, dst, result.reshape(dst.shape), accumulate, ctx.target.nc_version)
    ctx.emit(op, "tensor", (stationary, moving, stationary_scale, moving_scale), (dst,), k=p, m=m, n=n,
             dtype=moving.dtype.name, stationary_dtype=stationary.dtype.name, double_row=False, transpose=False,
             onezero=False, tile=(rs, 128), mx=True)
