"""`nki.isa.constants`: the ISA enums as a module of their own (`from nki.isa.constants import oob_mode`).

AWS's nki-library imports the enums from here as well as from `nki.isa`; both names are the same objects.
"""

from .enums import (  # noqa: F401
    dge_mode,
    dma_engine,
    engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
)
