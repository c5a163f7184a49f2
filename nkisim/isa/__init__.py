"""Implementations of `nki.isa`: every op takes `dst` first, has the exact NKI 0.6 signature, checks its
constraints (raising NkiValidationError naming op, operand and limit), computes with NumPy and records one
instruction for the cost model."""

from ..errors import NkiValidationError  # noqa: F401
from ..tensor import VirtualRegister  # noqa: F401
from . import constants  # noqa: F401 - `nki.isa.constants` (registered as a module by nkisim.install)
from .accum import accumulate as _accumulate  # noqa: F401
from .dma import core_barrier, dma_compute, dma_copy, dma_transpose, sendrecv  # noqa: F401
from .enums import (  # noqa: F401
    dge_mode,
    dma_engine,
    engine,
    gpsimd_engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
    scalar_engine,
    tensor_engine,
    unknown_engine,
    vector_engine,
)
from .gpsimd import affine_select, iota  # noqa: F401
from .mx import nc_matmul_mx, quantize_mx  # noqa: F401
from .registers import (  # noqa: F401
    get_nc_sub_version,
    get_nc_version,
    register_alloc,
    register_load,
    register_move,
    register_store,  # noqa: F401
)
from .scalar import activation, activation_reduce  # noqa: F401
from .scalars import NkiScalar, scalar_load, scalar_store  # noqa: F401 - NKI 0.7 (tracer frontend)
from .tensor_engine import nc_matmul, nc_transpose  # noqa: F401
from .vector import (  # noqa: F401
    bn_aggr,
    bn_stats,
    exponential,
    memset,
    reciprocal,
    scalar_tensor_tensor,
    tensor_copy,
    tensor_copy_predicated,
    tensor_reduce,
    tensor_scalar,
    tensor_tensor,
)

try:  # ops added by the extended module (rarer VectorE / GpSimd instructions)
    from .extended import *  # noqa: F401,F403
except ImportError as _e:  # pragma: no cover - only while the module is being written
    if "extended" not in str(_e):
        raise
