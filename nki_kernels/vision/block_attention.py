"""Fused block vision attention for one tensor-parallel rank (Qwen3-VL vision encoder, packed image patches).

QKV projection (+bias) -> 2D rotary embedding (rotate-half) -> bidirectional attention restricted per query row to the
keys of its own image ([bound_min, bound_max)) with key tiles outside a query tile's range skipped at run time ->
partial O-projection (no O bias), everything kept in SBUF between the hidden-state input and the output.
See DESIGN.md beside this file.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from ..common.tiles import evict
from .limits import HEAD_GROUPS, KEY_PAD_TILES, SCORE_BUFFERS, argument_error

# ---- tile sizes and constants ---------------------------------------------------------------------------------
P_MAX = nl.tile_size.pmax                # partitions: query / key / token tile, contraction tile
PSUM_F = nl.tile_size.psum_bank_fmax     # fp32 elements per PSUM bank: one matmul's output row
# TensorE transposes of [128, 128] bf16 batched into one PSUM bank before one eviction
TRANSPOSE_GROUP = nl.tile_size.psum_bank_fmax_bytes // (P_MAX * 2)
# Key tiles per step of the runtime key loops, widest first: a query tile's range [klo, khi) is walked in 2048-key
# steps (4 PSUM banks of fp32 scores), then at most one 1024-key step, then 512-key steps (one bank) to the end. Wide
# steps pay the per-step work (state updates, fixed instruction costs) once per more keys; the narrow tail keeps
# the work following the image sizes (at most 3 key tiles past the range end).
STEPS = (4 * PSUM_F // P_MAX, 2 * PSUM_F // P_MAX, PSUM_F // P_MAX)
PAD_TILES = STEPS[-1] - 1                # zero key tiles after the block: a tail step may run past the range end
assert PAD_TILES == KEY_PAD_TILES, "limits.KEY_PAD_TILES (the SBUF budget) must match the narrowest key step"
REG_SETS = 4              # register sets for the key-loop bounds (4 x 4 of the sequencer's 64 registers)
EVICT_VECTOR_EVERY = 8    # PSUM evictions outside the attention: every 8th on VectorE, the rest on ScalarE
M_INIT = -1.0e30          # running max before any key: above the range_select fill, so exp(fill - max) = 0
FP32_MIN = -3.4028235e38  # range_select's fill for keys outside the range (a hardware constant, C11)
NO_KEY = float(1 << 20)   # lower bound of a padding row (empty range) when taking a tile's min: beyond any block
L_MIN = 2.0 ** -40        # row-sum floor: padding rows (sum 0, accumulator 0) give 0 * 2^40 = 0, never 0/0


class _Config(nl.NKIObject):
    """Static shapes of one launch."""

    def __init__(self, S, H, nh, d, n_prog, core):
        self.S, self.H, self.nh, self.d = S, H, nh, d
        self.hd = nh * d                        # q (or k, v) columns of this rank
        self.C = 3 * self.hd                    # fused QKV columns
        self.KT = H // P_MAX                    # contraction tiles of the QKV projection
        self.n_kt = S // P_MAX                  # token / query / key tiles
        self.n_pad = self.n_kt + PAD_TILES      # key tiles held, with the zero padding
        self.n_k = (self.hd + P_MAX - 1) // P_MAX   # contraction chunks of the O-projection
        self.scale = float(d) ** -0.5
        self.n_prog, self.core = n_prog, core
        # LNC=2: core c owns token / query tiles t with t % 2 == c (interleaved: images of different sizes load both
        # cores alike); it computes Q, K, V of its tiles and receives the other core's K and V.
        self.mine = tuple(range(core, self.n_kt, n_prog))
        self.gsz = (nh + HEAD_GROUPS - 1) // HEAD_GROUPS     # heads per group (see the kernel body)


def vision_block_attention_kernel(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o, num_heads, head_dim):
    """Block vision attention: out = O_proj(Attn_bounds(RoPE(x @ W_qkv + b_qkv))) for one rank's heads.

    Dimensions: S block size (multiple of 128, 128..4096), H hidden (multiple of 128), nh = num_heads on this rank,
    d = head_dim (even, <= 128).

    Args:
        x ([S, H] bf16 @ HBM): the block's patches (images packed from row 0, padding rows after them).
        w_qkv ([H, 3*nh*d] bf16): fused projection, columns [q heads | k heads | v heads], head-major in each.
        b_qkv ([3*nh*d] bf16 or fp32): its bias.
        cos, sin ([S, d] fp32): rotary tables per token, rotate-half layout (Qwen-VL 2D rope: row / column
            frequencies concatenated, duplicated over the two halves).
        bound_min, bound_max ([S] int32): query row i attends to keys j with bound_min[i] <= j < bound_max[i];
            bound_min[i] >= bound_max[i] marks a padding row (zero output).
        w_o ([nh*d, H] bf16): O-projection rows of this rank's heads.
        num_heads, head_dim (int): nh and d.

    Returns:
        out ([S, H] bf16 @ shared_hbm): partial O-projection of this rank's heads, without the O bias (added once
        after the tensor-parallel all-reduce).

    Pseudocode (per query tile qt of 128 rows, per head h):
        [klo, khi) = key tiles covering the union of the rows' ranges (padding rows excluded); m = -1e30, l = 0
        pass 1, for key step c in [klo, khi) (2048-key steps, then 1024, then 512): s = q_h k_h[c]^T (PSUM) ;
            sc[c] = range_select(s, rows' bounds) (SBUF, fp32) with row max mt ; m = max(m, mt)
        pass 2, for the same steps: p = exp(scale (sc[c] - m)) ; l += sum p ; acc += p v_h[c] (one PSUM tile)
        o[qt, h] = acc / max(l, 2^-40) ;   out[qt] = o[qt] @ W_o
    LNC=2: query tiles alternate between the cores; each core loads half of each weight and receives the other half,
    and each computes Q, K, V of its own tiles and receives the other core's K and V (nisa.sendrecv).
    """
    err = argument_error(x, w_qkv, b_qkv, cos, sin, bound_min, bound_max, w_o, num_heads, head_dim)
    if err is not None:
        raise ValueError(err)
    n_prog = nl.num_programs()
    S, H = x.shape
    if n_prog > 1 and (S // P_MAX) % n_prog:
        raise ValueError(f"x: block size S={S} must be a multiple of {P_MAX * n_prog} at LNC={n_prog} (query tiles "
                         "are split evenly between the cores)")
    cfg = _Config(S, H, num_heads, head_dim, n_prog, nl.program_id(0) if n_prog > 1 else 0)
    out = nl.ndarray((S, H), dtype=x.dtype, buffer=nl.shared_hbm)

    # DMAs issue in program order: W_qkv, then x (with them the first QKV can start), W_o last (used last)
    wq = _load_weights(cfg, w_qkv, cfg.H, cfg.C, 0)
    bias = nl.ndarray((1, cfg.C), dtype=b_qkv.dtype, buffer=nl.sbuf)   # added by a K=1 matmul (its own dtype)
    nisa.dma_copy(dst=bias, src=b_qkv.reshape((1, cfg.C)))
    # Heads in groups: the QKV projection of group g+1 (TensorE) runs while the attention of group g (VectorE,
    # ScalarE) does -- the attention of any head needs the K and V of the whole block first.
    o_all = nl.ndarray((P_MAX, len(cfg.mine), cfg.hd), dtype=x.dtype, buffer=nl.sbuf)
    xT = _x_transposed(cfg, x)
    rb0, kreg = _key_ranges(cfg, bound_min, bound_max)     # first used by the first attention step
    consts = _Consts(cfg, x.dtype)
    state = _State(cfg, rb0)
    # the masked scores of one (query tile, head) over its whole key range (absolute key tiles, with the padding a
    # tail step may reach), SCORE_BUFFERS of them round-robin so that one pair's pass 1 overlaps another's pass 2
    sc_bufs = tuple(nl.ndarray((P_MAX, cfg.n_pad, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
                    for _ in range(SCORE_BUFFERS))
    wo = _load_weights(cfg, w_o, cfg.hd, cfg.H, 64)
    # The key loops' bounds of a query tile live in registers (64 per engine sequencer): REG_SETS sets reused
    # round-robin, so the loops of REG_SETS consecutive query tiles can overlap.
    reg_sets = tuple(tuple(nisa.register_alloc() for _ in range(len(STEPS) + 1)) for _ in range(REG_SETS))
    for g0 in range(0, cfg.nh, cfg.gsz):
        g1 = min(cfg.nh, g0 + cfg.gsz)
        qkT, v = _qkv_rope(cfg, x, xT, wq, bias, cos, sin, g0, g1)
        if n_prog > 1:
            _exchange_kv(cfg, qkT, v, g1 - g0, g0)
        for i, qt in enumerate(cfg.mine):
            regs = reg_sets[i % REG_SETS]
            for j, r in enumerate(regs):
                nisa.register_load(dst=r, src=kreg[qt:qt + 1, j:j + 1])
            for h in range(g0, g1):
                sc = sc_bufs[(i * (g1 - g0) + h - g0) % SCORE_BUFFERS]
                _attend(cfg, qkT, v, state, consts, regs, i, h - g0, h, g1 - g0, o_all[:, i, h * cfg.d:(h + 1) * cfg.d],
                        sc)
            if g1 == cfg.nh:
                _project(cfg, o_all[:, i, :], wo, out, qt)
    return out


# ---- weights and key ranges -----------------------------------------------------------------------------------

def _load_weights(cfg, w, rows, cols, pipe):
    """A weight [rows, cols] resident as [128, ceil(rows/128), cols] (row k*128 + p on partition p), one DMA per
    128-row chunk. LNC=2: each core loads half of the columns and the cores swap halves with sendrecv (no weight
    read twice from HBM)."""
    n_r = (rows + P_MAX - 1) // P_MAX
    sb = nl.ndarray((P_MAX, n_r, cols), dtype=w.dtype, buffer=nl.sbuf)
    half = cols // cfg.n_prog
    c0 = cfg.core * half
    for k in range(n_r):
        kn = min(P_MAX, rows - k * P_MAX)
        nisa.dma_copy(dst=sb[:kn, k, c0:c0 + half], src=w[k * P_MAX:k * P_MAX + kn, c0:c0 + half])
    if cfg.n_prog > 1:
        other = 1 - cfg.core
        c1 = other * half
        for k in range(n_r):
            kn = min(P_MAX, rows - k * P_MAX)
            nisa.sendrecv(src=sb[:kn, k, c0:c0 + half], dst=sb[:kn, k, c1:c1 + half], send_to_rank=other,
                          recv_from_rank=other, pipe_id=pipe + k)
    return sb


def _key_ranges(cfg, bound_min, bound_max):
    """Per query tile the key tiles [klo, khi) covering its rows' ranges (padding rows excluded), and where each
    key loop of STEPS ends: b0 = klo, b[i+1] = b[i] + w_i * floor((khi - b[i]) / w_i), the last loop to khi:
    kreg [n_kt, len(STEPS) + 1] int32 = (klo, b1, ..., khi), loaded into registers per query tile (an all-padding
    tile gets klo = khi: no key step). rb0 [128, n_kt, 2] fp32: each row's
    bounds relative to key klo * 128, the range_select bounds of the first step."""
    n = cfg.n_kt
    f32 = nl.float32
    # [tile, row] layout: the per-tile min / max are free-axis reductions
    bt = []
    for src in (bound_min, bound_max):
        ti = nl.ndarray((n, P_MAX), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ti, src=src.reshape((n, P_MAX)))
        tf = nl.ndarray((n, P_MAX), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=tf, src=ti)
        bt.append(tf)
    lo_t, hi_t = bt
    empty = nl.ndarray((n, P_MAX), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=empty, data1=lo_t, data2=hi_t, op=nl.greater_equal)
    lo_eff = nl.ndarray((n, P_MAX), dtype=f32, buffer=nl.sbuf)           # padding rows: NO_KEY (ignored by min)
    nisa.scalar_tensor_tensor(dst=lo_eff, data=empty, op0=nl.multiply, operand0=NO_KEY, op1=nl.add, operand1=lo_t)
    hi_eff = nl.ndarray((n, P_MAX), dtype=f32, buffer=nl.sbuf)           # padding rows: 0 (ignored by max)
    nisa.scalar_tensor_tensor(dst=hi_eff, data=empty, op0=nl.subtract, operand0=1.0, op1=nl.multiply, operand1=hi_t)
    tmin = nl.ndarray((n, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=tmin, op=nl.minimum, data=lo_eff, axis=1)
    tmax = nl.ndarray((n, 1), dtype=f32, buffer=nl.sbuf)                 # = -max(hi_eff): hi_eff holds -(1-e)*hi
    nisa.tensor_reduce(dst=tmax, op=nl.minimum, data=hi_eff, axis=1)
    # klo = floor(tmin / 128); khi = ceil(-tmax / 128) = floor((127 - tmax) / 128); then the loop boundaries (below)
    ns = len(STEPS)
    kf = nl.ndarray((n, ns + 1), dtype=f32, buffer=nl.sbuf)     # (klo, loop boundaries..., khi)
    rem = nl.ndarray((n, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rem, data=tmin, op0=nl.mod, operand0=float(P_MAX))
    nisa.tensor_scalar(dst=kf[:, 0:1], data=tmin, op0=nl.subtract, operand0=rem, op1=nl.multiply,
                       operand1=1.0 / P_MAX)
    up = nl.ndarray((n, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=up, data=tmax, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=float(P_MAX - 1))
    nisa.tensor_scalar(dst=rem, data=up, op0=nl.mod, operand0=float(P_MAX))
    nisa.tensor_scalar(dst=kf[:, ns:ns + 1], data=up, op0=nl.subtract, operand0=rem, op1=nl.multiply,
                       operand1=1.0 / P_MAX)
    # an all-padding tile (klo from NO_KEY, khi = 0): klo = khi, so both key loops are empty
    nisa.tensor_tensor(dst=kf[:, 0:1], data1=kf[:, 0:1], data2=kf[:, ns:ns + 1], op=nl.minimum)
    span = nl.ndarray((n, 1), dtype=f32, buffer=nl.sbuf)
    for i, w in enumerate(STEPS[:-1]):    # b[i+1] = b[i] + w * floor((khi - b[i]) / w)
        nisa.tensor_tensor(dst=span, data1=kf[:, ns:ns + 1], data2=kf[:, i:i + 1], op=nl.subtract)
        nisa.tensor_scalar(dst=rem, data=span, op0=nl.mod, operand0=float(w))
        nisa.tensor_tensor(dst=span, data1=span, data2=rem, op=nl.subtract)
        nisa.tensor_tensor(dst=kf[:, i + 1:i + 2], data1=kf[:, i:i + 1], data2=span, op=nl.add)
    kreg = nl.ndarray((n, ns + 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=kreg, src=kf)
    # klo * 128 on every partition, [128, n]: ones[n, 128]^T @ diag(klo * 128) (fp32 matmul: exact)
    ident = nl.ndarray((n, n), dtype=f32, buffer=nl.sbuf)
    ones = nl.ndarray((n, P_MAX), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    nisa.affine_select(dst=ident, pattern=[[-1, n]], channel_multiplier=1, on_true_tile=ones[:, :n],
                       on_false_value=0.0, cmp_op=nl.equal, offset=0)
    diag = nl.ndarray((n, n), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=diag, data=ident, op0=nl.multiply, operand0=kf[:, 0:1], op1=nl.multiply,
                       operand1=float(P_MAX))
    base = nl.ndarray((P_MAX, n), dtype=f32, buffer=nl.psum)
    nisa.nc_matmul(dst=base, stationary=ones, moving=diag, accumulate=False)
    # [row, tile] layout of the bounds, relative to the tile's first key
    rb0 = nl.ndarray((P_MAX, n, 2), dtype=f32, buffer=nl.sbuf)
    for i, src in enumerate((bound_min, bound_max)):
        ci = nl.ndarray((P_MAX, n), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ci, src=src.ap([[1, P_MAX], [P_MAX, n]], offset=0))
        cf = nl.ndarray((P_MAX, n), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=cf, src=ci)
        nisa.tensor_tensor(dst=rb0[:, :, i], data1=cf, data2=base, op=nl.subtract)
    return rb0, kreg


# ---- QKV projection and rotary embedding ----------------------------------------------------------------------

def _evict(i, dst, src):
    """PSUM -> SBUF copies: one in EVICT_VECTOR_EVERY on VectorE, the others on ScalarE (VectorE carries the
    attention's range_select, the busiest stream)."""
    evict(i, dst, src, vector_every=EVICT_VECTOR_EVERY)


def _x_transposed(cfg, x):
    """x^T of this core's token tiles, [128 (H rows kt*128 + p), KT, tiles * 128] bf16 (the QKV projection's
    stationaries), by TensorE transposes, TRANSPOSE_GROUP per PSUM bank, evicted alternately by ScalarE and VectorE
    (both idle until the first attention step, which waits for these). Resident for all head groups."""
    # [128, tile, KT, 128]: each tile's x^T is one contiguous region (no false dependency between tiles' writes)
    xT = nl.ndarray((P_MAX, len(cfg.mine), cfg.KT, P_MAX), dtype=x.dtype, buffer=nl.sbuf)
    for i, t in enumerate(cfg.mine):
        xt = nl.ndarray((P_MAX, cfg.H), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=x[t * P_MAX:(t + 1) * P_MAX, :])
        for k0 in range(0, cfg.KT, TRANSPOSE_GROUP):
            kn = min(TRANSPOSE_GROUP, cfg.KT - k0)
            pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=x.dtype, buffer=nl.psum)
            for k in range(kn):
                nisa.nc_transpose(dst=pt[:, k, :], data=xt[:, (k0 + k) * P_MAX:(k0 + k + 1) * P_MAX])
            dst = xT[:, i, k0:k0 + kn, :]
            if i % 2 == 0:
                nisa.tensor_copy(dst=dst, src=pt[:, :kn, :])
            else:
                nisa.activation(dst=dst, op=nl.copy, data=pt[:, :kn, :])
    return xT


def _qkv_rope(cfg, x, xT, wq, bias, cos, sin, g0, g1):
    """Heads [g0, g1) (nh of them here), this core's token tiles: qkv = x @ W_qkv + b (bf16), RoPE on q and k, then
    qkT [128 (d used), n_pad, 2nh, 128] bf16 (token tile t, Q^T of head h at [:d, t, h], K^T at [:d, t, nh + h];
    each token tile's region contiguous, so the per-tile writes carry no false dependencies) and
    v [128 tokens, n_pad, nh*d] bf16; the PAD_TILES tiles after the block are zero."""
    d, nh = cfg.d, g1 - g0
    hd = nh * d
    h2 = d // 2
    qkT = nl.ndarray((P_MAX, cfg.n_pad, 2 * nh, P_MAX), dtype=x.dtype, buffer=nl.sbuf)
    v = nl.ndarray((P_MAX, cfg.n_pad, hd), dtype=x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=qkT[:d, cfg.n_kt:, nh:, :], value=0.0, engine=nisa.engine.gpsimd)
    nisa.memset(dst=v[:, cfg.n_kt:, :], value=0.0, engine=nisa.engine.gpsimd)
    ones = nl.ndarray((1, P_MAX), dtype=bias.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0, engine=nisa.engine.gpsimd)
    # RoPE engine: the first group's rotary is on the path to the first attention step: VectorE (nothing else to do
    # yet) and GpSimd take alternate tiles; later groups' run on GpSimd beside the attention (VectorE is then the
    # busiest engine).
    for i, t in enumerate(cfg.mine):
        gp = nisa.engine.vector if g0 == 0 and i % 2 == 0 else nisa.engine.gpsimd
        cs = nl.ndarray((P_MAX, 2, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=cs[:, 0, :], src=cos[t * P_MAX:(t + 1) * P_MAX, :])
        nisa.dma_copy(dst=cs[:, 1, :], src=sin[t * P_MAX:(t + 1) * P_MAX, :])
        # qkv [tokens, (q|k|v, head, dim)] = x @ W_qkv + b for the group's columns of each of q, k, v, one PSUM
        # bank at a time (the bias joins the accumulation as a K=1 matmul ones^T @ b: TensorE has slack, VectorE
        # has none)
        # Column runs of q, k, v are packed into PSUM banks in order (one accumulation group after the other in a
        # bank), and each bank is evicted once.
        qkv = nl.ndarray((P_MAX, 3, nh, d), dtype=x.dtype, buffer=nl.sbuf)
        flat = qkv.reshape((P_MAX, 3 * hd))
        runs = []                                   # (first column in the group's qkv, first column in W_qkv, n)
        for part in range(3):
            for c0 in range(0, hd, PSUM_F):
                runs.append((part * hd + c0, part * cfg.hd + g0 * d + c0, min(PSUM_F, hd - c0)))
        banks = [[]]
        for r in runs:
            if sum(n for _, _, n in banks[-1]) + r[2] > PSUM_F:
                banks.append([])
            banks[-1].append(r)
        for bi, bank in enumerate(banks):
            ps = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
            b0 = bank[0][0]
            for f0, w0, n in bank:
                o0 = f0 - b0
                for kt in range(cfg.KT):
                    nisa.nc_matmul(dst=ps[:, o0:o0 + n], stationary=xT[:, i, kt, :],
                                   moving=wq[:, kt, w0:w0 + n], accumulate=(kt > 0))
                nisa.nc_matmul(dst=ps[:, o0:o0 + n], stationary=ones, moving=bias[:, w0:w0 + n], accumulate=True)
            nb_cols = sum(n for _, _, n in bank)
            _evict(i + bi, flat[:, b0:b0 + nb_cols], ps[:, :nb_cols])
        nisa.tensor_copy(dst=v[:, t, :], src=qkv[:, 2].reshape((P_MAX, hd)), engine=nisa.engine.gpsimd)
        # RoPE on q and k: r = u * cos + rotate_half(u) * sin, rotate_half(u) = [-u2, u1]
        qk = qkv[:, 0:2].reshape((P_MAX, 2 * nh, d))
        cb = cs[:, 0, :].expand_dim(1).broadcast(1, 2 * nh)
        sb = cs[:, 1, :].expand_dim(1).broadcast(1, 2 * nh)
        uc = nl.ndarray((P_MAX, 2 * nh, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=uc, data1=qk, data2=cb, op=nl.multiply, engine=gp)
        us = nl.ndarray((P_MAX, 2 * nh, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=us[:, :, :h2], data1=qk[:, :, h2:], data2=sb[:, :, :h2], op=nl.multiply,
                           engine=gp)
        nisa.tensor_tensor(dst=us[:, :, h2:], data1=qk[:, :, :h2], data2=sb[:, :, h2:], op=nl.multiply,
                           engine=gp)
        rot = nl.ndarray((P_MAX, 2 * nh, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=rot[:, :, :h2], data1=uc[:, :, :h2], data2=us[:, :, :h2], op=nl.subtract, engine=gp)
        nisa.tensor_tensor(dst=rot[:, :, h2:], data1=uc[:, :, h2:], data2=us[:, :, h2:], op=nl.add, engine=gp)
        # Q^T, K^T per head by TensorE transposes ([128 tokens, d] -> [d, 128 tokens])
        for j0 in range(0, 2 * nh, TRANSPOSE_GROUP):
            jn = min(TRANSPOSE_GROUP, 2 * nh - j0)
            pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=x.dtype, buffer=nl.psum)
            for j in range(jn):
                nisa.nc_transpose(dst=pt[:d, j, :], data=rot[:, j0 + j, :])
            _evict(i + j0 + 1, qkT[:d, t, j0:j0 + jn, :], pt[:d, :jn, :])
    return qkT, v


def _exchange_kv(cfg, qkT, v, nh, g0):
    """LNC=2: send this core's K^T and V tiles of the head group (nh heads from g0) to the other core, receive
    its tiles (the attention of every query tile reads the keys of the whole block)."""
    d = cfg.d
    core, other = cfg.core, 1 - cfg.core
    n = cfg.n_kt
    nisa.sendrecv(src=qkT[:d, core:n:2, nh:, :], dst=qkT[:d, other:n:2, nh:, :], send_to_rank=other,
                  recv_from_rank=other, pipe_id=100 + 2 * g0)
    nisa.sendrecv(src=v[:, core:n:2, :], dst=v[:, other:n:2, :], send_to_rank=other, recv_from_rank=other,
                  pipe_id=101 + 2 * g0)


# ---- attention ------------------------------------------------------------------------------------------------

class _Consts(nl.NKIObject):
    """Constants of the attention's GpSimd state updates (GpSimd has no tensor_scalar) and of its PSUM start."""

    def __init__(self, cfg, dtype):
        # dec [128, i, :] = the key count of a step of STEPS[i] tiles (the bounds' decrement); dec[:, ns, :] =
        # (-scale, L_MIN); dec[:, ns + 1, 0] = 1 (the numerator of the row sum's reciprocal)
        ns = len(STEPS)
        self.dec = nl.ndarray((P_MAX, ns + 2, 2), dtype=nl.float32, buffer=nl.sbuf)
        for i, w in enumerate(STEPS):
            nisa.memset(dst=self.dec[:, i, :], value=float(w * P_MAX), engine=nisa.engine.gpsimd)
        nisa.memset(dst=self.dec[:, ns, 0:1], value=-cfg.scale, engine=nisa.engine.gpsimd)
        nisa.memset(dst=self.dec[:, ns, 1:2], value=L_MIN, engine=nisa.engine.gpsimd)
        nisa.memset(dst=self.dec[:, ns + 1, :], value=1.0, engine=nisa.engine.gpsimd)
        # a K=1 zero row: stationary [1, 128] and moving [1, d] of the matmul that zeroes an accumulator
        self.zero = nl.ndarray((1, P_MAX), dtype=dtype, buffer=nl.sbuf)
        nisa.memset(dst=self.zero, value=0.0, engine=nisa.engine.gpsimd)


class _State(nl.NKIObject):
    """The softmax state of every (query tile, head) pair of this core, initialised by three GpSimd instructions
    (one per pair each would queue hundreds of fixed-cost instructions ahead of the prologue's rotary work):
    m [128, tiles, nh] running row max, l the row sums, rb [128, tiles, nh, 2] each row's key bounds relative to
    the current step (range_select's bounds; moved by every step)."""

    def __init__(self, cfg, rb0):
        f32 = nl.float32
        n = len(cfg.mine)
        self.m = nl.ndarray((P_MAX, n, cfg.nh), dtype=f32, buffer=nl.sbuf)
        nisa.memset(dst=self.m, value=M_INIT, engine=nisa.engine.gpsimd)
        self.l = nl.ndarray((P_MAX, n, cfg.nh), dtype=f32, buffer=nl.sbuf)
        nisa.memset(dst=self.l, value=0.0, engine=nisa.engine.gpsimd)
        self.rb = nl.ndarray((P_MAX, n, cfg.nh, 2), dtype=f32, buffer=nl.sbuf)
        mine = rb0[:, cfg.core:cfg.n_kt:cfg.n_prog, :]
        nisa.tensor_copy(dst=self.rb, src=mine.expand_dim(2).broadcast(2, cfg.nh), engine=nisa.engine.gpsimd)


def _attend(cfg, qkT, v, state, consts, regs, i, h, hg, nh, o_h, sc):
    """o_h [128, d] = softmax-attention of this core's query tile i (qt), head h of a group of nh (hg of all heads;
    qkT, v from _qkv_rope) over the tile's key range, in two passes over runtime loops of STEPS key tiles per step:
    pass 1 writes the masked scores of the whole range to `sc` (SBUF, fp32) and takes the row max; pass 2
    exponentiates them against that final max and accumulates P V in one PSUM tile over the whole range. Against
    an online softmax this drops the per-step rescale of the accumulator (a VectorE op reading PSUM) and the per-step
    correction exponential: the row max is exact before the first exponential, so nothing needs rescaling."""
    d = cfg.d
    f32 = nl.float32
    gp = nisa.engine.gpsimd
    ns = len(STEPS)
    qt = cfg.mine[i]
    m, l_sum, rb = state.m[:, i, hg:hg + 1], state.l[:, i, hg:hg + 1], state.rb[:, i, hg, :]
    stat = qkT[:d, qt, h, :]

    def scores(width):
        def body(c):
            _score_step(cfg, stat, qkT, sc, m, rb, consts.dec, c, h, nh, width)
        return body
    for j, w in enumerate(STEPS):
        nl.fori_loop(regs[j], regs[j + 1], scores(w), step=w)
    nb = nl.ndarray((P_MAX, 1), dtype=f32, buffer=nl.sbuf)       # -scale * row max: the exponential's bias
    nisa.tensor_tensor(dst=nb, data1=m, data2=consts.dec[:, ns, 0:1], op=nl.multiply, engine=gp)
    # P V of every step accumulates into one PSUM tile; which loop runs first is known only at run time, so the
    # tile starts from a zero K=1 matmul (TensorE has slack) and every PV matmul accumulates
    po = nl.ndarray((P_MAX, d), dtype=f32, buffer=nl.psum)
    nisa.nc_matmul(dst=po, stationary=consts.zero, moving=consts.zero[:, :d], accumulate=False)
    st = (nb, l_sum)

    def probs(width):
        def body(c):
            _pv_step(cfg, st, sc, v, po, c, h, nh, width)
        return body
    for j, w in enumerate(STEPS):
        nl.fori_loop(regs[j], regs[j + 1], probs(w), step=w)
    # o = P V / max(l, 2^-40): padding rows have l = 0 and P V = 0, so 0, never 0 / 0
    lg = nl.ndarray((P_MAX, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lg, data1=l_sum, data2=consts.dec[:, ns, 1:2], op=nl.maximum, engine=gp)
    rl = nl.ndarray((P_MAX, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=rl, data1=consts.dec[:, ns + 1, 0:1], data2=lg, op=nl.divide, engine=gp)
    nisa.activation(dst=o_h, op=nl.copy, data=po, scale=rl)


def _window(cfg, t, c, width):
    """The [128, width, 128] window of key tiles [c, c + width) of a per-key-tile tensor t [128, n_pad, 128] (c: a
    runtime register)."""
    return t.ap([[cfg.n_pad * P_MAX, P_MAX], [P_MAX, width], [1, P_MAX]], offset=0, scalar_offset=c,
                indirect_dim=1)


def _score_step(cfg, stat, qkT, sc, m, rb, dec, c, h, nh, width):
    """Pass 1, key tiles [c, c + width): s = Q K^T (PSUM), masked to each row's [lo, hi) by range_select into sc
    with the step's row max in the same pass; m = max(m, step max); the bounds move to the next step."""
    d = cfg.d
    f32 = nl.float32
    gp = nisa.engine.gpsimd
    kb = PSUM_F // P_MAX                                          # key tiles per matmul (one PSUM bank)
    ps = nl.ndarray((P_MAX, width, P_MAX), dtype=f32, buffer=nl.psum)
    for b in range(width // kb):
        # K^T of head h, key tiles c + b*kb .. + kb (tile stride 2nh*128): the register c scales by a tile's
        # elements (indirect_dim=1)
        mv = qkT.ap([[cfg.n_pad * 2 * nh * P_MAX, d], [2 * nh * P_MAX, PSUM_F // P_MAX], [1, P_MAX]],
                    offset=(nh + h) * P_MAX + b * (PSUM_F // P_MAX) * 2 * nh * P_MAX, scalar_offset=c,
                    indirect_dim=1)
        nisa.nc_matmul(dst=ps[:, b * kb:(b + 1) * kb, :], stationary=stat, moving=mv, accumulate=False)
    mt = nl.ndarray((P_MAX, 1), dtype=f32, buffer=nl.sbuf)
    nisa.range_select(dst=_window(cfg, sc, c, width), on_true_tile=ps, comp_op0=nl.greater_equal,
                      comp_op1=nl.less, bound0=rb[:, 0:1], bound1=rb[:, 1:2],
                      reduce_cmd=nisa.reduce_cmd.reset_reduce, reduce_res=mt, reduce_op=nl.maximum, range_start=0,
                      on_false_value=FP32_MIN)
    # loop-carried state on GpSimd (idle otherwise)
    nisa.tensor_tensor(dst=m, data1=m, data2=mt, op=nl.maximum, engine=gp)
    nisa.tensor_tensor(dst=rb, data1=rb, data2=dec[:, STEPS.index(width), :], op=nl.subtract, engine=gp)


def _pv_step(cfg, st, sc, v, po, c, h, nh, width):
    """Pass 2, key tiles [c, c + width): p = exp(scale s - scale m) (ScalarE, bf16, fp32 row sum), l += row sum,
    P^T by a DMA transpose, po += P^T-stationary matmuls with V moving."""
    nb, l_sum = st
    d = cfg.d
    hd = nh * d
    f32 = nl.float32
    p = nl.ndarray((P_MAX, width, P_MAX), dtype=v.dtype, buffer=nl.sbuf)
    rs = nl.ndarray((P_MAX, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=p, op=nl.exp, data=_window(cfg, sc, c, width), bias=nb, scale=cfg.scale,
                    reduce_op=nl.add, reduce_res=rs, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.tensor_tensor(dst=l_sum, data1=l_sum, data2=rs, op=nl.add, engine=nisa.engine.gpsimd)
    # P^T by a DMA transpose (the DMA queues are idle during the attention; TensorE and VectorE are not)
    pT = nl.ndarray((P_MAX, width, P_MAX), dtype=v.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(dst=pT, src=p)
    for j in range(width):
        vj = v.ap([[cfg.n_pad * hd, P_MAX], [1, d]], offset=j * hd + h * d, scalar_offset=c, indirect_dim=1)
        nisa.nc_matmul(dst=po, stationary=pT[:, j, :], moving=vj, accumulate=True)


# ---- O-projection ---------------------------------------------------------------------------------------------

def _project(cfg, o_tok, wo, out, qt):
    """out[qt tile] = o_tok @ W_o: o^T chunks by TensorE transposes (stationary [k chunk, 128 queries]), W_o moving
    512 columns at a time."""
    H, hd = cfg.H, cfg.hd
    oT = nl.ndarray((P_MAX, cfg.n_k, P_MAX), dtype=o_tok.dtype, buffer=nl.sbuf)
    for k0 in range(0, cfg.n_k, TRANSPOSE_GROUP):
        kg = min(TRANSPOSE_GROUP, cfg.n_k - k0)
        pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=o_tok.dtype, buffer=nl.psum)
        for k in range(k0, k0 + kg):
            kn = min(P_MAX, hd - k * P_MAX)
            nisa.nc_transpose(dst=pt[:kn, k - k0, :], data=o_tok[:, k * P_MAX:k * P_MAX + kn])
        for k in range(k0, k0 + kg):     # per chunk: the last one may have fewer rows
            kn = min(P_MAX, hd - k * P_MAX)
            nisa.activation(dst=oT[:kn, k, :], op=nl.copy, data=pt[:kn, k - k0, :])
    res = nl.ndarray((P_MAX, H), dtype=out.dtype, buffer=nl.sbuf)
    for i, c0 in enumerate(range(0, H, PSUM_F)):
        n = min(PSUM_F, H - c0)
        ps = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
        for k in range(cfg.n_k):
            kn = min(P_MAX, hd - k * P_MAX)
            nisa.nc_matmul(dst=ps[:, :n], stationary=oT[:kn, k, :], moving=wo[:kn, k, c0:c0 + n],
                           accumulate=(k > 0))
        _evict(i + 1, res[:, c0:c0 + n], ps[:, :n])
    nisa.dma_copy(dst=out[qt * P_MAX:(qt + 1) * P_MAX, :], src=res)


vision_block_attention_nki = nki.jit(vision_block_attention_kernel)
