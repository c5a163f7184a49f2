"""Our NKI 0.7 versions of the four timed matmul kernels of AWS's tutorials: result = lhsT.T @ rhs, lhsT [K, M],
rhs [K, N], result in the input dtype. The same four appear in "Introduction to NKI kernel optimization" (trn2, fp32:
v2-v5; aws-neuron-sdk nki/guides/tutorials/kernel-optimization.rst) and in the matrix-multiplication tutorial (trn1,
bf16: original tiled, optimization 1-3; nki/guides/tutorials/matrix_multiplication.rst).

Written from the tutorial's description, not its code. Each keeps the tutorial version's data movement (which
tiles are loaded, how often, in what transfer shapes) and its instruction mix:
- v2 "tiled": for each (m, n) output tile, for each k: load a [128, 128] lhsT tile and a [128, 512] rhs tile, matmul
  into one PSUM tile; copy PSUM -> SBUF, store.
- v3 "hoisted loads": the K column of lhsT tiles is loaded once per m, the K column of rhs tiles once per (m, n).
- v4 "blocked free dims": as v3 with 2 x 2 output tiles per block (lhsT loaded once per 2 m-tiles, rhs once per 2
  n-tiles). The tutorial keeps all 2 x 64 rhs tiles of a block live (256 KiB/partition, more than SBUF holds; the
  compiler must spill); ours loads the rhs tiles of one n-tile of the block at a time — the same loads and bytes —
  so that the live set fits in SBUF.
- v5 "blocked K": output blocks of TILES_M x TILES_N tiles accumulate in SBUF over K blocks with tensor_tensor adds
  (PSUM holds one K block's partial sums) in the result dtype; rhs [128, BLOCK_N] and lhsT [128, BLOCK_M] rows per
  load, results packed per [128, BLOCK_N] row before one store. Block sizes are parameters (the tutorial's
  defaults: M 16, N 2, K 8 tiles).
"""

import nki
import nki.isa as nisa
import nki.language as nl


def _tiles():
    return nl.tile_size.gemm_stationary_fmax, nl.tile_size.pmax, nl.tile_size.gemm_moving_fmax


@nki.jit
def matmul_v2(lhsT, rhs):
    K, M = lhsT.shape
    _, N = rhs.shape
    TM, TK, TN = _tiles()
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TM):
        for n in range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TK):
                a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            res = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=res)
    return out


def _load_column(src, col, width, nk, tk, k0=0):
    """The nk [tk, width] tiles of columns [col, col + width) of src from row tile k0 on, one dma_copy each."""
    tiles = []
    for k in range(k0, k0 + nk):
        t = nl.ndarray((tk, width), dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src[k * tk:(k + 1) * tk, col:col + width])
        tiles.append(t)
    return tiles


def _output_tile(out, a_tiles, b_tiles, row, col, tm, tn):
    acc = nl.ndarray((tm, tn), dtype=nl.float32, buffer=nl.psum)
    for a, b in zip(a_tiles, b_tiles):
        nisa.nc_matmul(dst=acc, stationary=a, moving=b)
    res = nl.ndarray((tm, tn), dtype=out.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=res, src=acc)
    nisa.dma_copy(dst=out[row:row + tm, col:col + tn], src=res)


@nki.jit
def matmul_v3(lhsT, rhs):
    K, M = lhsT.shape
    _, N = rhs.shape
    TM, TK, TN = _tiles()
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TM):
        a_tiles = _load_column(lhsT, m * TM, TM, K // TK, TK)
        for n in range(N // TN):
            b_tiles = _load_column(rhs, n * TN, TN, K // TK, TK)
            _output_tile(out, a_tiles, b_tiles, m * TM, n * TN, TM, TN)
    return out


@nki.jit
def matmul_v4(lhsT, rhs):
    K, M = lhsT.shape
    _, N = rhs.shape
    TM, TK, TN = _tiles()
    BM, BN = 2, 2                      # tiles per block, as in the tutorial
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for mb in range(M // (BM * TM)):
        a_block = [_load_column(lhsT, (mb * BM + i) * TM, TM, K // TK, TK) for i in range(BM)]
        for nb in range(N // (BN * TN)):
            for j in range(BN):
                b_tiles = _load_column(rhs, (nb * BN + j) * TN, TN, K // TK, TK)
                for i in range(BM):
                    _output_tile(out, a_block[i], b_tiles, (mb * BM + i) * TM, (nb * BN + j) * TN, TM, TN)
    return out


@nki.jit
def matmul_v5(lhsT, rhs, tiles_m=16, tiles_n=2, tiles_k=8):
    K, M = lhsT.shape
    _, N = rhs.shape
    TM, TK, TN = _tiles()
    BM, BN, BK = TM * tiles_m, TN * tiles_n, TK * tiles_k
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for nb in range(N // BN):
        # SBUF accumulators of one column of output blocks: [M/BM][tiles_m][tiles_n] tiles [TM, TN]
        sums = []
        for _mb in range(M // BM):
            rows = []
            for _i in range(tiles_m):
                row = []
                for _j in range(tiles_n):
                    t = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
                    nisa.memset(dst=t, value=0.0)
                    row.append(t)
                rows.append(row)
            sums.append(rows)
        for kb in range(K // BK):
            b_rows = _load_column(rhs, nb * BN, BN, tiles_k, TK, k0=kb * tiles_k)
            for mb in range(M // BM):
                a_rows = _load_column(lhsT, mb * BM, BM, tiles_k, TK, k0=kb * tiles_k)
                for j in range(tiles_n):
                    for i in range(tiles_m):
                        acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
                        for kk in range(tiles_k):
                            nisa.nc_matmul(dst=acc, stationary=a_rows[kk][:, i * TM:(i + 1) * TM],
                                           moving=b_rows[kk][:, j * TN:(j + 1) * TN])
                        s = sums[mb][i][j]
                        nisa.tensor_tensor(dst=s, data1=s, data2=acc, op=nl.add)
        for mb in range(M // BM):
            for i in range(tiles_m):
                packed = nl.ndarray((TM, BN), dtype=out.dtype, buffer=nl.sbuf)
                for j in range(tiles_n):
                    nisa.tensor_copy(dst=packed[:, j * TN:(j + 1) * TN], src=sums[mb][i][j])
                nisa.dma_copy(dst=out[(mb * tiles_m + i) * TM:(mb * tiles_m + i + 1) * TM, nb * BN:(nb + 1) * BN],
                              src=packed)
    return out
