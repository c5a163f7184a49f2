"""Plain helper functions and classes imported by valid_kernels.py (a second user module)."""

import nki.isa as nisa
import nki.language as nl


class TileConfig(nl.NKIObject):
    def __init__(self, rows, cols):
        self.rows = rows
        self.cols = cols

    def tiles(self, n):
        return (n + self.rows - 1) // self.rows


def load_tile(src, rows, cols, *, dtype=None):
    """Keyword-only parameters are fine on helpers (only the kernel signature is restricted)."""
    tile = nl.ndarray((rows, cols), dtype=src.dtype if dtype == None else dtype, buffer=nl.sbuf)  # noqa: E711
    nisa.dma_copy(dst=tile, src=src)
    return tile
