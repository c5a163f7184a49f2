"""Tile helpers shared by the kernels: PSUM evictions spread over two engines, token-tile transposes, runtime-gated
blocks.

Plain NKI 0.7 helpers called from inside `@nki.jit` kernels (as nki-library's kernels call their utils).
"""

import nki.isa as nisa
import nki.language as nl

P_MAX = nl.tile_size.pmax                                           # partitions per tile
TRANSPOSE_GROUP = nl.tile_size.psum_bank_fmax_bytes // (P_MAX * 2)  # 128-column bf16 transposes per PSUM bank


def evict(i, dst, src, vector_every=2):
    """PSUM -> SBUF copy number `i`: every `vector_every`-th on VectorE, the others on ScalarE (both read PSUM), so
    evictions of independent banks overlap. The default alternates the two engines."""
    if i % vector_every == 0:
        nisa.tensor_copy(dst=dst, src=src)
    else:
        nisa.activation(dst=dst, op=nl.copy, data=src)


def transpose_tokens(x_sb, nt, KT):
    """x [nt, H] (tokens on partitions) -> xT [128, KT, nt] with H index p * KT + kt: TensorE transposes of the
    strided column sets x[:, kt::KT] (each partition's H rows contiguous in the matching weight layout),
    TRANSPOSE_GROUP per PSUM bank, one eviction per bank."""
    return transpose_token_groups(((x_sb[:nt], 0, nt),), nt, KT)


def transpose_token_groups(groups, nt, KT):
    """transpose_tokens over token rows loaded in groups ((rows view [m, H], first token, m), e.g. rows placed on
    chosen partitions for their DMA engines): each group's TensorE transposes write its tokens' columns of the same
    PSUM bank, one eviction per bank."""
    dtype = groups[0][0].dtype
    xT = nl.ndarray((P_MAX, KT, P_MAX), dtype=dtype, buffer=nl.sbuf)
    for c0 in range(0, KT, TRANSPOSE_GROUP):
        nc = min(TRANSPOSE_GROUP, KT - c0)
        ps = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=dtype, buffer=nl.psum)
        for c in range(nc):
            kt = c0 + c
            for xg, g0, m in groups:
                nisa.nc_transpose(dst=ps[:, c, g0:g0 + m], data=xg[:, kt:kt + (P_MAX - 1) * KT + 1:KT])
        nisa.tensor_copy(dst=xT[:, c0:c0 + nc, :nt], src=ps[:, :nc, :nt])
    return xT


def transpose_spread_rows(x_sb, nt, KT, stride):
    """transpose_tokens of nt token rows on partitions stride * t of x_sb [32 / 64 / 128, H] (the partitions between
    hold zeros: a TensorE transpose multiplies every partition by the identity): one transpose of the whole block
    per kt, TRANSPOSE_GROUP per PSUM bank, the eviction picks every stride-th column."""
    p = x_sb.shape[0]
    xT = nl.ndarray((P_MAX, KT, P_MAX), dtype=x_sb.dtype, buffer=nl.sbuf)
    for c0 in range(0, KT, TRANSPOSE_GROUP):
        nc = min(TRANSPOSE_GROUP, KT - c0)
        ps = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=x_sb.dtype, buffer=nl.psum)
        for c in range(nc):
            kt = c0 + c
            nisa.nc_transpose(dst=ps[:, c, :p], data=x_sb[:, kt:kt + (P_MAX - 1) * KT + 1:KT])
        nisa.tensor_copy(dst=xT[:, c0:c0 + nc, :nt], src=ps[:, :nc, 0:(nt - 1) * stride + 1:stride])
    return xT


def run_gated(gate, body):
    """body(0) at trace time when gate is None, else inside a runtime loop of gate (0 or 1) iterations (gate: a
    register or a 1x1 SBUF scalar of schedule data)."""
    if gate is None:
        body(0)
    else:
        nl.fori_loop(0, gate, body)
