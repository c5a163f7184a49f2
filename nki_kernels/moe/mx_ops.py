"""NKI-side helpers of the MXFP4 layout (mx_weights.py), shared by the CTE and TKG kernels' trn3 MX paths.

The layout (mx_weights.py's docstring): element j of a 512-element contraction chunk sits on partition
8 (j // 32) + j % 8, lane (j % 32) // 8, so each scale group (8 partitions x 4 lanes) is one 32-element MX block;
a scale tile holds group g of the 16 at partition 32 (g // 4) + g % 4 (nc_matmul_mx's quadrant layout). These two
functions are the only places the kernels spell that order out.
"""

import nki.isa as nisa

MX_CHUNK = 512         # contraction elements per nc_matmul_mx (128 partitions x 4 lanes); MXFP4 layout: mx_weights.py
MX_GROUPS = 16         # scale groups (8 partitions each) of a 128-partition MX tile: 4 per SBUF quadrant
MX_BLOCK = 32          # elements per scale group (one OCP MX block)
MX_LANES = 4           # x4 lanes per word
MX_ROWS = 8            # partitions per scale group


def lane_columns(t, pstride, nrows, offset, lane, groups=MX_GROUPS, per_quadrant=4):
    """The columns of lane `lane` of the 512-column chunk starting at `offset` of an SBUF tile t (nrows partitions,
    `pstride` elements per partition): {offset + 32 g + 8 lane + r | g < groups, r < 8}, in (g, r) order, i.e. the
    column whose contraction element sits on partition 8 g + r in the MX order. Transposing this set (tokens x H
    rows) gives an MX operand's lane; selecting it as a stationary (weights x N) puts output element 32 g + 8 lane + r
    on partition 8 g + r, the MX order of the next contraction.

    per_quadrant < 4 (groups = 16): the chunk's blocks spread over the four SBUF quadrants, `per_quadrant` blocks in
    the last group slots of each (block spq Q + i on slot 4 Q + (4 - spq) + i); the first slots take the columns
    before them (other blocks, or padding before `offset`: the caller's tile has 32 (4 - spq) columns there), whose
    results the caller discards."""
    if per_quadrant == 4:
        return t.ap([[pstride, nrows], [MX_BLOCK, groups], [1, MX_ROWS]], offset=offset + MX_ROWS * lane)
    spq = per_quadrant
    return t.ap([[pstride, nrows], [MX_BLOCK * spq, 4], [MX_BLOCK, 4], [1, MX_ROWS]],
                offset=offset + MX_ROWS * lane - MX_BLOCK * (4 - spq))


def load_mx_scales(dst, src_rows, dma_src, base=0, cols=None):
    """The 16 scale rows of a packed projection ([16, row] per expert in HBM, mx_weights.pack) into the quadrant
    layout of dst [128, row] (one DMA per quadrant: groups 4Q..4Q+3 -> partitions 32Q + base + 0..3; base 0 or 8,
    the matmul then takes the scale view from partition `base`). dma_src(pattern, offset) builds the HBM access
    pattern of this expert's scale rows (expert addressed by a constant or a register). cols = (c0, n): only those
    columns of each row (dst is then that column range)."""
    c0, n = (0, src_rows) if cols is None else cols
    for q in range(MX_GROUPS // 4):
        p0 = 32 * q + base
        nisa.dma_copy(dst=dst[p0:p0 + 4], src=dma_src([[src_rows, 4], [1, n]], 4 * q * src_rows + c0))


def load_spread_scales(dst, src_rows, dma_src, spq, cols):
    """Scale rows of a chunk whose blocks spread over the quadrants (lane_columns' per_quadrant = spq): block
    spq Q + i -> partition 32 Q + (4 - spq) + i, columns cols = (c0, n) of each row."""
    c0, n = cols
    for q in range(4):
        p0 = 32 * q + 4 - spq
        nisa.dma_copy(dst=dst[p0:p0 + spq], src=dma_src([[src_rows, spq], [1, n]], spq * q * src_rows + c0))
