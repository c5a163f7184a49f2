"""Micro-kernels whose modelled cost is known analytically: a tiled matmul (nki-api.md §11), its double-buffered
twin, an HBM stream copy and a VectorE-heavy loop.

Library code because two layers use them: the cost-model tests (tests/nkisim/cost, tests/nkisim/examples re-export
them) and the cost-model / interpreter-overhead benchmarks (bench/ must not import tests/). Sizes come from
nl.tile_size: contraction and stationary tiles of pmax (128) partitions, a moving tile of one fp32 PSUM bank (512).
"""

import nki
import nki.isa as nisa
import nki.language as nl

TK = nl.tile_size.pmax                       # contraction: the partition dim
TM = nl.tile_size.gemm_stationary_fmax       # stationary columns
TN = nl.tile_size.gemm_moving_fmax           # moving columns = one fp32 PSUM bank


@nki.jit
def tiled_matmul(lhsT, rhs):
    """out[M, N] = lhsT[K, M].T @ rhs[K, N]; K, M multiples of 128, N a multiple of 512; fresh SBUF tiles each
    step, so loads of step k+1 may overlap the matmul of step k."""
    K, M = lhsT.shape
    _, N = rhs.shape
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    for m in range(M // TM):
        for n in range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TK):
                a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b, accumulate=(k > 0))
            res = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=res)
    return out


@nki.jit
def matmul_pipelined(lhsT, rhs):
    """Double-buffered: two SBUF buffers per operand; the next step's dma_copy is issued before this matmul."""
    K, M = lhsT.shape
    _, N = rhs.shape
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    a0 = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
    a1 = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
    b0 = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
    b1 = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
    nk, nn, nm = K // TK, N // TN, M // TM
    total = nm * nn * nk
    nisa.dma_copy(dst=a0, src=lhsT[0:TK, 0:TM])
    nisa.dma_copy(dst=b0, src=rhs[0:TK, 0:TN])
    acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
    for i in range(total):
        m, n, k = i // (nn * nk), (i // nk) % nn, i % nk
        if i + 1 < total:
            m1, n1, k1 = (i + 1) // (nn * nk), ((i + 1) // nk) % nn, (i + 1) % nk
            nisa.dma_copy(dst=a1 if i % 2 == 0 else a0, src=lhsT[k1 * TK:(k1 + 1) * TK, m1 * TM:(m1 + 1) * TM])
            nisa.dma_copy(dst=b1 if i % 2 == 0 else b0, src=rhs[k1 * TK:(k1 + 1) * TK, n1 * TN:(n1 + 1) * TN])
        if k == 0:
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=acc, stationary=a0 if i % 2 == 0 else a1, moving=b0 if i % 2 == 0 else b1,
                       accumulate=(k > 0))
        if k == nk - 1:
            res = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=res)
    return out


@nki.jit
def stream_copy(x):
    """HBM -> SBUF -> HBM, one [128, F] tile at a time."""
    R, F = x.shape
    P = nl.tile_size.pmax
    out = nl.ndarray((R, F), dtype=x.dtype, buffer=nl.shared_hbm)
    for i in range(R // P):
        t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i * P:(i + 1) * P, :])
        nisa.dma_copy(dst=out[i * P:(i + 1) * P, :], src=t)
    return out


@nki.jit
def vector_heavy(x, reps):
    """Load one [128, F] tile, apply `reps` tensor_tensor adds on VectorE, store."""
    P, F = x.shape
    out = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    u = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_copy(dst=u, src=t)
    for _ in range(reps):
        nisa.tensor_tensor(dst=t, data1=t, data2=u, op=nl.add)
    nisa.dma_copy(dst=out, src=t)
    return out
