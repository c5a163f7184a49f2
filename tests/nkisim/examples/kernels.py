"""Example kernels written exactly as real NKI 0.6 code (they compile unchanged with AWS's compiler).

Used by the conformance tests (each matches NumPy) and by the interpreter-overhead benchmark.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from nki_kernels import micro as _micro

# Tile sizes of the TensorE: contraction on 128 partitions, 128 stationary columns, 512 moving columns
# (one fp32 PSUM bank).
TILE_K = 128
TILE_M = 128
TILE_N = 512


# The tiled matmul lives in library code (the interpreter-overhead and cost-model benchmarks use it too).
tiled_matmul = _micro.tiled_matmul


@nki.jit
def row_softmax(x):
    """Softmax over the last dim of x [R, F], rows on partitions in tiles of 128."""
    R, F = x.shape
    out = nl.ndarray((R, F), dtype=x.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    for r in range((R + P - 1) // P):
        rows = min(P, R - r * P)
        t = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:rows, :], src=x[r * P:r * P + rows, :])
        neg_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max[0:rows, :], op=nl.maximum, data=t[0:rows, :], axis=(1,), negate=True)
        e = nl.ndarray((P, F), dtype=nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e[0:rows, :], op=nl.exp, data=t[0:rows, :], bias=neg_max[0:rows, :], scale=1.0,
                        reduce_op=nl.add, reduce_res=s[0:rows, :], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        inv = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv[0:rows, :], data=s[0:rows, :])
        y = nl.ndarray((P, F), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y[0:rows, :], data=e[0:rows, :], op0=nl.multiply, operand0=inv[0:rows, :])
        nisa.dma_copy(dst=out[r * P:r * P + rows, :], src=y[0:rows, :])
    return out


@nki.jit
def rmsnorm_bn(x, gamma, eps):
    """y = x / sqrt(mean(x^2) + eps) * gamma for x [T <= 128, H]; statistics from bn_stats / bn_aggr."""
    T, H = x.shape
    CH = nl.tile_size.bn_stats_fmax
    out = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    xt = nl.ndarray((T, H), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x)
    g = nl.ndarray((T, H), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=g, src=gamma.ap(pattern=[[0, T], [1, H]], offset=0))  # broadcast the row to T partitions
    n_chunks = (H + CH - 1) // CH
    stats = nl.ndarray((T, 6 * n_chunks), dtype=nl.float32, buffer=nl.sbuf)
    for c in range(n_chunks):
        w = min(CH, H - c * CH)
        nisa.bn_stats(dst=stats[:, 6 * c:6 * c + 6], data=xt[:, c * CH:c * CH + w])
    mv = nl.ndarray((T, 2), dtype=nl.float32, buffer=nl.sbuf)
    nisa.bn_aggr(dst=mv, data=stats)
    # mean(x^2) = var + mean^2
    msq = nl.ndarray((T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=msq, data1=mv[:, 0:1], data2=mv[:, 0:1], op=nl.multiply)
    nisa.tensor_tensor(dst=msq, data1=msq, data2=mv[:, 1:2], op=nl.add)
    rstd = nl.ndarray((T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd, data=msq, op0=nl.add, operand0=eps)
    nisa.activation(dst=rstd, op=nl.rsqrt, data=rstd)
    y = nl.ndarray((T, H), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=y, data=xt, op0=nl.multiply, operand0=rstd, op1=nl.multiply, operand1=g)
    yo = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=yo, src=y)
    nisa.dma_copy(dst=out, src=yo)
    return out


@nki.jit
def gather_rows(table, ids):
    """out[i, :] = table[ids[i], :] for up to 128 ids (indirect DMA through vector_offset)."""
    V, D = table.shape
    P = ids.shape[0]
    out = nl.ndarray((P, D), dtype=table.dtype, buffer=nl.shared_hbm)
    idx = nl.ndarray((P, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=ids)
    rows = nl.ndarray((P, D), dtype=table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows, src=table.ap(pattern=[[D, P], [1, D]], vector_offset=idx, indirect_dim=0),
                  dge_mode=nisa.dge_mode.swdge)
    nisa.dma_copy(dst=out, src=rows)
    return out


@nki.jit
def causal_masked_scores(scores):
    """Keep scores[q, k] where k <= q, else -30000 (the causal mask built in-kernel with affine_select)."""
    Q, K = scores.shape
    out = nl.ndarray((Q, K), dtype=scores.dtype, buffer=nl.shared_hbm)
    s = nl.ndarray((Q, K), dtype=scores.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=scores)
    masked = nl.ndarray((Q, K), dtype=scores.dtype, buffer=nl.sbuf)
    # affine value = q * 1 + k * (-1); keep where q - k >= 0
    nisa.affine_select(dst=masked, pattern=[[-1, K]], channel_multiplier=1, on_true_tile=s,
                       on_false_value=-30000.0, cmp_op=nl.greater_equal, offset=0)
    nisa.dma_copy(dst=out, src=masked)
    return out


@nki.jit
def lnc_scaled_add(a, b, alpha):
    """out = a * alpha + b with rows split between the two cores of an LNC=2 launch by program_id."""
    R, F = a.shape
    out = nl.ndarray((R, F), dtype=a.dtype, buffer=nl.shared_hbm)
    n_cores = nl.num_programs()
    per_core = R // n_cores
    base = nl.program_id(0) * per_core
    P = nl.tile_size.pmax
    for r in range(per_core // P):
        rows = nl.ds(base + r * P, P)
        ta = nl.ndarray((P, F), dtype=a.dtype, buffer=nl.sbuf)
        tb = nl.ndarray((P, F), dtype=b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ta, src=a[rows, :])
        nisa.dma_copy(dst=tb, src=b[rows, :])
        y = nl.ndarray((P, F), dtype=a.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=y, data=ta, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=tb)
        nisa.dma_copy(dst=out[rows, :], src=y)
    return out
