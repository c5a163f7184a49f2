"""Our NKI 0.7 version of `mamba_v1` from AWS's fused Mamba tutorial (aws-neuron-sdk
nki/guides/tutorials/fused_mamba.rst), the selective-scan core of a Mamba layer, written from the tutorial's
description: out[b, c, t] = sum_s C[b, s, t] * h_s[c, t], h_s[c, t] = exp(delta[b, c, t] * A[c, s]) * h_s[c, t-1]
+ delta[b, c, t] * u[b, c, t] * B[b, s, t].

Data movement and instruction mix of mamba_v1: channels on partitions (128 per tile), seq_len on the free dim; for
every (batch, channel tile, state): load delta and u tiles [128, seq] and the A column [128, 1], B and C rows
[1, seq]; ScalarE exp(delta * A); VectorE delta * u, * B, the associative scan over seq
(tensor_tensor_scan), * C, and accumulation over states; one store per (batch, channel tile).
Deviation: the tutorial's compute instructions read the B / C rows broadcast across partitions in SBUF; NKI 0.7
does not broadcast across partitions, so ours loads each row broadcast to [128, seq] by DMA (128x the bytes of
those two small loads; the VectorE work is the same).
"""

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def mamba_v1(delta, u, A, B, C):
    batch, channels, seq = delta.shape
    _, states = A.shape
    P = nl.tile_size.pmax
    out = nl.ndarray((batch, channels, seq), dtype=delta.dtype, buffer=nl.shared_hbm)
    for b in range(batch):
        for ct in range(channels // P):
            c0 = ct * P
            acc = nl.ndarray((P, seq), dtype=delta.dtype, buffer=nl.sbuf)
            nisa.memset(dst=acc, value=0.0)
            for s in range(states):
                d = nl.ndarray((P, seq), dtype=delta.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=d, src=delta[b, c0:c0 + P, :])
                a = nl.ndarray((P, 1), dtype=A.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=A[c0:c0 + P, s:s + 1])
                decay = nl.ndarray((P, seq), dtype=delta.dtype, buffer=nl.sbuf)
                nisa.activation(dst=decay, op=nl.exp, data=d, scale=a)
                x = nl.ndarray((P, seq), dtype=u.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x, src=u[b, c0:c0 + P, :])
                b_row = nl.ndarray((P, seq), dtype=B.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=b_row, src=B[b, s:s + 1, :].broadcast(0, P))
                du = nl.ndarray((P, seq), dtype=delta.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=du, data1=d, data2=x, op=nl.multiply)
                dbu = nl.ndarray((P, seq), dtype=delta.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=dbu, data1=du, data2=b_row, op=nl.multiply)
                h = nl.ndarray((P, seq), dtype=delta.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor_scan(dst=h, data0=decay, data1=dbu, initial=0.0, op0=nl.multiply, op1=nl.add)
                c_row = nl.ndarray((P, seq), dtype=C.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=c_row, src=C[b, s:s + 1, :].broadcast(0, P))
                y = nl.ndarray((P, seq), dtype=delta.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=y, data1=h, data2=c_row, op=nl.multiply)
                nisa.tensor_tensor(dst=acc, data1=acc, data2=y, op=nl.add)
            nisa.dma_copy(dst=out[b, c0:c0 + P, :], src=acc)
    return out


def mamba_reference(delta, u, A, B, C):
    """NumPy reference (fp64) of the same computation, for the correctness check of the small case."""
    import numpy as np
    delta, u, A, B, C = (np.asarray(x, np.float64) for x in (delta, u, A, B, C))
    batch, channels, seq = delta.shape
    out = np.zeros((batch, channels, seq))
    for b in range(batch):
        for s in range(A.shape[1]):
            decay = np.exp(delta[b] * A[:, s:s + 1])
            drive = delta[b] * u[b] * B[b, s][None, :]
            h = np.zeros(channels)
            for t in range(seq):
                h = decay[:, t] * h + drive[:, t]
                out[b, :, t] += C[b, s, t] * h
    return out
