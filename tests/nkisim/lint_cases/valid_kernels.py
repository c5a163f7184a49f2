"""Realistic kernels that follow every NKI 0.6 language rule; the checker must report nothing for them."""

import enum
import math
from dataclasses import dataclass

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np
from nki import isa as isa_ops

from . import valid_helpers as vh


class Act(enum.Enum):
    RELU = 0
    GELU = 1


@dataclass
class Shapes(nl.NKIObject):
    m: int
    n: int


def _choose(act):
    if act == Act.RELU:
        return nl.relu
    return nl.gelu


def _copy_out(out, tile, row, rows):
    nisa.dma_copy(dst=out[nl.ds(row * rows, rows), :], src=tile)


@nki.jit
def matmul_kernel(lhsT, rhs):
    K, M = lhsT.shape
    _, N = rhs.shape
    TK, TM, TN = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TM):
        for n in nl.affine_range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TK):
                a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b, accumulate=(k > 0))
            res = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nki.isa.dma_copy(dst=out[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=res)
    return out


@nki.jit
def activation_kernel(x, act=Act.RELU, bias=None, scales=(1.0, 2.0)):
    rows, cols = x.shape
    shapes = Shapes(rows, cols)
    cfg = vh.TileConfig(nl.tile_size.pmax, cols)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    meta = {"rows": rows, "cols": cols, **{}}
    fn = _choose(act)
    for i in range(cfg.tiles(shapes.m)):
        rows_i = min(cfg.rows, rows - i * cfg.rows)
        tile = vh.load_tile(x[i * cfg.rows:i * cfg.rows + rows_i, :], rows_i, meta["cols"], dtype=nl.float32)
        y = nl.zeros((rows_i, cols), dtype=nl.float32, buffer=nl.sbuf)
        if bias != None:  # noqa: E711
            isa_ops.tensor_tensor(dst=y, data1=tile, data2=bias, op=nl.add)
        isa_ops.activation(dst=y, op=fn, data=tile, scale=scales[0])
        z = nl.exp(y, dtype=nl.bfloat16)
        flat = z.ap(pattern=[[cols, rows_i], [1, cols]], offset=0, dtype=nl.bfloat16)
        nisa.tensor_copy(dst=y, src=flat)
        _copy_out(out, y, i, rows_i)
    assert math.isfinite(scales[1]) and np.dtype("float32").itemsize == 4
    return out


@nki.jit
def nested_helper_kernel(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)

    def body(i, acc):
        class Acc(nl.NKIObject):
            pass

        t = nl.ndarray((128, 64), dtype=x.dtype, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        return acc + i

    total = 0
    for i in range(4):
        total = body(i, total)
    square = lambda v: v * v
    if x.shape[0] == square(2) or x.shape[0] != None:  # noqa: E711
        pass
    return out


class TileBase(nl.NKIObject):
    rows = 128


class TileConfig(TileBase):
    """Derives from nl.NKIObject only through another NKIObject class: fine under the parser as well."""

    cols = 512


@nki.jit
def inherited_config_kernel(a):
    cfg = TileConfig()
    return a[0:cfg.rows, 0:cfg.cols]
