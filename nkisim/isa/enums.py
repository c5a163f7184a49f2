"""Enums of `nki.isa` (objects, never raw ints: the compiler rejects raw-int enums since NKI 0.3.0)."""

from enum import Enum, IntEnum


class engine(Enum):  # noqa: N801 - names follow the real nki.isa
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(Enum):  # noqa: N801
    none = 0
    double_row = 1


class nc_version(IntEnum):  # noqa: N801 - ordered, and comparable with ints (AWS's kernels write `>= 3`)
    gen2 = 2
    gen3 = 3
    gen4 = 4


class dma_engine(Enum):  # noqa: N801
    dma = 1
    gpsimd_dma = 2


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown
