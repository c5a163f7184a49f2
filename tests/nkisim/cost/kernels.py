"""Micro-kernels with analytically known modelled cost for the cost-model tests; the ones bench/test_cost_model.py
also profiles live in library code (nki_kernels/micro.py) and are re-exported here."""

import nki
import nki.isa as nisa
import nki.language as nl

from nki_kernels.micro import matmul_pipelined, stream_copy, tiled_matmul, vector_heavy  # noqa: F401

TK, TM, TN = 128, 128, 512


# The tiled matmul of nki-api.md §11 (fresh SBUF tiles each step: the model gives every allocation its own memory, so
# loads of step k+1 may overlap the matmul of step k).
matmul_nki11 = tiled_matmul


@nki.jit
def matmul_serial(lhsT, rhs):
    """Same tiling, written serially: one SBUF buffer per operand, reused every step (WAR: load k+1 waits for
    matmul k)."""
    K, M = lhsT.shape
    _, N = rhs.shape
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
    b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
    res = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
    for m in range(M // TM):
        for n in range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in range(K // TK):
                nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b, accumulate=(k > 0))
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=res)
    return out


@nki.jit
def lnc_swap(x, reps):
    """LNC=2: each core loads its half, core 1 does `reps` VectorE ops, both stage their half in shared HBM and meet
    at core_barrier on it, swap halves with sendrecv and store the half they received (out = x with the two row
    halves swapped)."""
    P, F = 128, x.shape[1]
    pid = nl.program_id(0)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    r = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid * P:(pid + 1) * P, :])
    if pid == 1:
        for _ in range(reps):
            nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.maximum)
    stage = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=stage[pid * P:(pid + 1) * P, :], src=t)
    nisa.core_barrier(data=stage, cores=(0, 1))  # data: the shared HBM tensor both cores wrote (C18)
    nisa.sendrecv(src=t, dst=r, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    nisa.dma_copy(dst=out[pid * P:(pid + 1) * P, :], src=r)
    return out
