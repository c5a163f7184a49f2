"""SBUF constants and small helpers shared by every phase (evictions, runtime trip counts; runtime-gated blocks:
nki_kernels.common.tiles.run_gated).

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

from .config import MASK_NEG, P_MAX


class _Constants(nl.NKIObject):
    """SBUF constants: identity (selection matmuls), MASK_NEG * identity (mask folding), ones."""

    def __init__(self, cfg, dtype):
        self.vs = None     # fp8 cache: v_scale per KV head on every partition (set after the inputs are loaded)
        ones = nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        self.ones = ones
        self.ident = nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.affine_select(dst=self.ident, pattern=[[-1, P_MAX]], channel_multiplier=1, on_true_tile=ones,
                           on_false_value=0.0, cmp_op=nl.equal)
        fill = nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(dst=fill, value=MASK_NEG)
        self.neg_eye = nl.ndarray((P_MAX, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.affine_select(dst=self.neg_eye, pattern=[[-1, P_MAX]], channel_multiplier=1, on_true_tile=fill,
                           on_false_value=0.0, cmp_op=nl.equal)
        self.ones_f32 = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.ones_f32, value=1.0)
        # Masked stationaries of the attention (double-buffered over packs): stack jj of qm holds the queries of
        # the pack's batch j = jj*kpp + u on partitions u*d..(u+1)*d, columns j*R..(j+1)*R, zeros elsewhere;
        # accumulating qm_jj^T K_jj over the stacks yields a packed score tile where row block j only saw batch
        # j's keys. Zeroed once (early, while VectorE is idle); every pack rewrites the same blocks.
        width = cfg.pack * cfg.R
        self.qm = tuple(nl.ndarray((P_MAX, cfg.nst, width), dtype=dtype, buffer=nl.sbuf) for _ in range(2))
        # _Config.kt_swap: the same with the halves of each stack swapped (batch j on partitions ((j + 1) % 2)*d..)
        self.qm_sw = tuple(nl.ndarray((P_MAX, cfg.nst, width), dtype=dtype, buffer=nl.sbuf)
                           for _ in range(2)) if cfg.kt_swap else (None, None)
        for q in self.qm + (self.qm_sw if cfg.kt_swap else ()):
            nisa.memset(dst=q[:cfg.kpp * cfg.kd], value=0.0)


def _ones_row(consts, dtype, n):
    """[1, n] ones of `dtype` (stationary of a K=1 bias matmul)."""
    if dtype == nl.bfloat16:
        return consts.ones[:1, :n]
    t = nl.ndarray((1, P_MAX), dtype=dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    return t[:1, :n]


def _registers(t, n):
    """One register per element of the int32 row t[0:1, :n] (runtime trip counts)."""
    regs = []
    for i in range(n):
        r = nisa.register_alloc()
        nisa.register_load(dst=r, src=t[0:1, i:i + 1])
        regs.append(r)
    return tuple(regs)


def _const_row(t, values):
    """Write the constants `values` into the fp32 row t[0:1, :len(values)]. NeuronCore-v3: one GpSimd iota per
    maximal run of equally spaced values (integers below 2^24: exact) instead of one memset per value (the plan's
    step / slot / piece starts, built once: ~50 GpSimd instructions ahead of the first masks and scrubs). v4 keeps
    the memsets (modelled trn3 B=16 4K +1.2 % for both models with the runs)."""
    if nisa.get_nc_version() >= nisa.nc_version.gen4:
        for k, a in enumerate(values):
            nisa.memset(dst=t[0:1, k:k + 1], value=float(a), engine=nisa.engine.gpsimd)
        return
    k, n = 0, len(values)
    while k < n:
        e = k + 1
        if e < n:
            step = values[e] - values[k]
            while e < n and values[e] - values[e - 1] == step:
                e += 1
        else:
            step = 0
        nisa.iota(dst=t[0:1, k:e], pattern=[[int(step), e - k]], offset=int(values[k]), channel_multiplier=0)
        k = e


