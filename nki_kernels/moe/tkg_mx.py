"""MXFP4 experts of the TKG (decode) kernel on trn3 (nc_matmul_mx): the steps of one expert and the token operand.

Decode is bound by the weight stream, so the point is the bytes: an expert's MXFP4 words and scales are ~27 % of its
bf16 bytes. Weights come in mx_weights.py's packed layout (the CTE kernel's); the numerics are the CTE's reference
(moe_torch.expert_mlp_mx_torch): tokens and bf16 activations quantised to MXFP8 (e4m3) on chip by quantize_mx, every
projection an nc_matmul_mx, the affinity applied after the down projection. See DESIGN.md ("MXFP4 experts (trn3)"
in the TKG part).

Orientation (T <= 64 tokens): the weights are the stationary operand and the tokens the moving one (T columns per
matmul, as the bf16 path), so
- gate/up: per contraction chunk k (512 H elements) and output group, the stationary is one lane's column set of
  the chunk's weights (mx_ops.lane_columns): output element 32 g + 8 lane + r of I lands on partition 8 g + r (the
  last chunk's blocks spread over the quadrants, MxShape), i.e. the activation comes out in the MX order of the
  down projection's contraction, one lane per group, with no transposes. Partitions without a real element are
  zeroed (MxRing.valid), as the MX zero-padding of I requires (a nonzero there would change a block's shared
  exponent).
- down: stationary = 128 H columns of the down words (h = p * KT + kt, the bf16 path's out^T layout), moving = the
  quantised activations; per expert into PSUM, then acc += psum * affinity (per token) in fp32 SBUF: the affinity
  cannot go into the activations as in the bf16 path, since MXFP8 rounding of a * act is not a * rounding of act.
"""

import nki.isa as nisa
import nki.language as nl

from ..common.tiles import evict
from .moe_torch import GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT
from .mx_ops import MX_BLOCK, MX_CHUNK, MX_LANES, MX_ROWS, lane_columns, load_mx_scales, load_spread_scales

P_MAX = nl.tile_size.pmax
PSUM_F = nl.tile_size.psum_bank_fmax
FRONT = 3 * MX_BLOCK   # columns before the gate/up words: a spread chunk's first slots read up to 96 columns back
COL_PAD = 4 * MX_BLOCK  # columns after them: a lane's 16 slots reach < 128 columns past 2I


def expert_src(w, e, pattern, offset, stride):
    """Access pattern of expert e's rows of w: e is a Python int (all-expert mode) or a register (selective: the
    expert id read from the routing scales dim 0's stride)."""
    if isinstance(e, int):
        return w.ap(pattern, offset=offset + e * stride)
    return w.ap(pattern, offset=offset, scalar_offset=e, indirect_dim=0)


def hb_cols(t, kt, blocks):
    """The 128 columns of out^T tile kt in t [rows, H] when the H columns are in kt blocks: block (k0, g) holds
    kt in [k0, k0 + g) on columns [128 k0, 128 (k0 + g)), h = 128 k0 + p * g + (kt - k0). One block (0, KT) is
    h = p * KT + kt (h_cols); more blocks let a row's column range [128 k0, 128 (k0 + g)) -- a DMA of its own --
    feed exactly the g matmuls of its block."""
    for k0, g in blocks:
        if k0 <= kt < k0 + g:
            c = P_MAX * k0 + kt - k0
            return t[:, c:c + (P_MAX - 1) * g + 1:g]
    return None


def h_cols(t, kt, KT):
    """The 128 columns h = p * KT + kt (p = 0..127) of an SBUF tile t [rows, H]: out^T tile kt's H rows."""
    return hb_cols(t, kt, ((0, KT),))


class MxShape(nl.NKIObject):
    """Trace-time sizes of the MX path: contraction chunks, output groups, SBUF bytes of a weight slot.

    The last I chunk's real 32-blocks (12 at I = 360) are spread over the four quadrants, spq = ceil(blocks / 4) per
    quadrant in its last group slots (lane_columns' per_quadrant): a DMA engine serves 8 partitions (one block), so
    the down words then load through 4 spq engines spread over every quadrant, and the gate/up scale rows (partition
    32 Q + 0..3, the first slot's engine) share an engine with no down words when spq < 4. Contiguous blocks
    (spq = 4) would put 12 blocks' words on engines 0-11, the busiest of them also carrying both scale sets."""

    def __init__(self, H, inter, KDm, T):
        self.KC, self.KDm, self.I2 = H // MX_CHUNK, KDm, 2 * inter
        self.wgu_w = FRONT + self.KC * self.I2 + COL_PAD      # flat gate/up words (and scales) per partition
        self.chunks = tuple(min(MX_CHUNK, inter - c * MX_CHUNK) for c in range(KDm))   # real elements per chunk
        self.blocks_last = -(-self.chunks[-1] // MX_BLOCK)
        self.spq = -(-self.blocks_last // 4)          # last chunk: blocks per quadrant (4 = contiguous layout)
        self.n_acc = 2 * MX_LANES * KDm               # gate lane q of chunk c: group 4 c + q; up: 4 (KDm + c) + q
        # the down scales' partition base: 8 (other engines than the gate/up scales) in the contiguous layout, 0
        # when spread (slot 0 of each quadrant holds no down words then)
        self.base_d = 8 if self.spq == 4 else 0
        self.slot_bytes = 3 * self.wgu_w + 3 * KDm * H + 2 * (FRONT + self.I2 + COL_PAD)

    def per_quadrant(self, c):
        return self.spq if c == self.KDm - 1 else 4


class MxRing(nl.NKIObject):
    """The MX path's buffers, allocated once: nbuf weight slots (words, quadrant-layout scales, gate/up bias row),
    n_gu PSUM sets of gate/up accumulators (+ the broadcast affinities), and two sets of activations in MX order
    (zeroed once: the rows past a lane's real ones stay 0), their MXFP8 words and scales, affinity broadcasts."""

    def __init__(self, cfg):
        mx, GS, T = cfg.mxs, cfg.GS, cfg.T
        fp4 = nl.float4_e2m1fn_x4
        self.wgu = tuple(nl.ndarray((P_MAX, mx.wgu_w), dtype=fp4, buffer=nl.sbuf) for _ in range(cfg.nbuf))
        self.sgu = tuple(nl.ndarray((P_MAX, mx.wgu_w), dtype=nl.uint8, buffer=nl.sbuf) for _ in range(cfg.nbuf))
        self.wd = tuple(nl.ndarray((P_MAX, mx.KDm, cfg.H), dtype=fp4, buffer=nl.sbuf) for _ in range(cfg.nbuf))
        self.sd = tuple(nl.ndarray((P_MAX, mx.KDm, cfg.H), dtype=nl.uint8, buffer=nl.sbuf) for _ in range(cfg.nbuf))
        self.bgu = tuple(nl.ndarray((1, FRONT + mx.I2 + COL_PAD), dtype=cfg.dtype, buffer=nl.sbuf)
                         for _ in range(cfg.nbuf))
        for b in range(cfg.nbuf):
            # the columns a lane's slots may read before / past the words: defined values (zero, scale 2**0); their
            # results are discarded. Down words of slots without a real block are never loaded nor set: any E2M1
            # code is finite (no NaN / Inf codes) and their scales are 2**0 (padding blocks' scales, loaded: see
            # load_step), so they only multiply zero activations.
            for lo, hi in ((0, FRONT), (mx.wgu_w - COL_PAD, mx.wgu_w)):
                nisa.memset(dst=self.wgu[b][:, lo:hi], value=0, engine=nisa.engine.gpsimd)
                nisa.memset(dst=self.sgu[b][:, lo:hi], value=127, engine=nisa.engine.gpsimd)
            nisa.memset(dst=self.bgu[b][:, :FRONT], value=0.0, engine=nisa.engine.gpsimd)
            nisa.memset(dst=self.bgu[b][:, FRONT + mx.I2:], value=0.0, engine=nisa.engine.gpsimd)
        self.ps_gu = tuple(nl.ndarray((P_MAX, mx.n_acc + 1, GS), dtype=nl.float32, buffer=nl.psum)
                           for _ in range(cfg.n_gu))
        self.xa = tuple(nl.ndarray((P_MAX, mx.KDm, GS, MX_LANES), dtype=cfg.dtype, buffer=nl.sbuf) for _ in range(2))
        for t in self.xa:
            nisa.memset(dst=t[:, :, :T, :], value=0.0, engine=nisa.engine.gpsimd)
        self.valid = None
        self.aq = tuple(nl.ndarray((P_MAX, mx.KDm, GS), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf) for _ in range(2))
        self.as_ = tuple(nl.ndarray((P_MAX, mx.KDm, GS), dtype=nl.uint8, buffer=nl.sbuf) for _ in range(2))
        self.affb = tuple(nl.ndarray((P_MAX, GS), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2))
        self.tmp = tuple(tuple(nl.ndarray((P_MAX, MX_LANES, GS), dtype=nl.float32, buffer=nl.sbuf)
                               for _ in range(4)) for _ in range(2))
        self.sc = nl.ndarray((P_MAX, cfg.kt_bank, GS), dtype=nl.float32, buffer=nl.sbuf)
        self.n = 0

    def make_valid(self, cfg):
        """The last I chunk's validity mask (None when its blocks are all real): issued after the routing, so
        these small VectorE operations stay off the routing's path."""
        mx = cfg.mxs
        # valid[p, q] = 1 iff partition p, lane q of the last I chunk holds a real element: slot i = (p % 32) // 8
        # of quadrant Q = p // 32 holds block g = spq Q + i - (4 - spq) when i >= 4 - spq, and the element is
        # j = 32 g + 8 q + p % 8 < n_c. The activation of a chunk runs on all 128 partitions and lanes; this zeroes
        # the rest (a nonzero there would change its block's shared exponent or add a block twice).
        n_last, spq = mx.chunks[-1], mx.spq
        if n_last < MX_CHUNK:
            gp = nisa.engine.gpsimd
            f32 = nl.float32
            pf, r, p32, t = (nl.ndarray((P_MAX, 1), dtype=f32, buffer=nl.sbuf) for _ in range(4))
            nisa.iota(dst=pf, pattern=[[0, 1]], offset=0, channel_multiplier=1)
            nisa.tensor_scalar(dst=r, data=pf, op0=nl.mod, operand0=float(MX_ROWS))
            nisa.tensor_scalar(dst=p32, data=pf, op0=nl.mod, operand0=32.0)
            nisa.tensor_tensor(dst=pf, data1=pf, data2=p32, op=nl.subtract, engine=gp)          # 32 Q
            nisa.tensor_tensor(dst=p32, data1=p32, data2=r, op=nl.subtract, engine=gp)          # 8 i
            nisa.tensor_scalar(dst=pf, data=pf, op0=nl.multiply, operand0=float(spq))
            nisa.scalar_tensor_tensor(dst=pf, data=p32, op0=nl.multiply, operand0=4.0, op1=nl.add, operand1=pf)
            nisa.scalar_tensor_tensor(dst=pf, data=r, op0=nl.add, operand0=-float(MX_BLOCK * (4 - spq)),
                                      op1=nl.add, operand1=pf)                        # 32 g + p % 8
            # t = 1 iff the slot holds a block
            nisa.tensor_scalar(dst=t, data=p32, op0=nl.greater_equal, operand0=float(MX_ROWS * (4 - spq)))
            j = nl.ndarray((P_MAX, MX_LANES), dtype=f32, buffer=nl.sbuf)
            nisa.iota(dst=j, pattern=[[MX_ROWS, MX_LANES]], offset=0, channel_multiplier=0)
            self.valid = nl.ndarray((P_MAX, MX_LANES), dtype=f32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=j, data=j, op0=nl.add, operand0=pf, op1=nl.less, operand1=float(n_last))
            nisa.tensor_scalar(dst=self.valid, data=j, op0=nl.multiply, operand0=t)


def x_operand_step(cfg, x, gamma, rstd):
    """The tokens as the MX moving operand: xq [128, KC, T] MXFP8 words and xs their scales, x normalised as the
    bf16 path's hT (bf16(x * rstd * gamma), the same operations in the same order: the same bits).

    x's rows (+ gamma as one more row) are transposed by lane column sets (mx_ops.lane_columns: 4 TensorE transposes
    per 512-element chunk give the MX element order), then rstd (per token, broadcast on the partitions) and gamma
    (per element, now a per-partition column) are applied and each chunk is quantised (quantize_mx, VectorE)."""
    T, H, KC, GS = cfg.T, cfg.H, cfg.mxs.KC, cfg.GS
    n = T + (1 if gamma is not None else 0)
    rows = nl.ndarray((P_MAX, H), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows[:T, :], src=x)
    if gamma is not None:
        nisa.dma_copy(dst=rows[T:T + 1, :], src=gamma)
    xm = nl.ndarray((P_MAX, KC, GS, MX_LANES), dtype=x.dtype, buffer=nl.sbuf)
    xq = nl.ndarray((P_MAX, KC, GS), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    xs = nl.ndarray((P_MAX, KC, GS), dtype=nl.uint8, buffer=nl.sbuf)
    gm = nl.ndarray((P_MAX, KC, MX_LANES), dtype=x.dtype, buffer=nl.sbuf)
    xr = nl.ndarray((P_MAX, MX_LANES, GS), dtype=nl.float32, buffer=nl.sbuf)
    banks = tuple(nl.ndarray((P_MAX, MX_LANES, GS + 1), dtype=x.dtype, buffer=nl.psum) for _ in range(2))
    for c in range(KC):
        ps = banks[c % 2]
        for ln in range(MX_LANES):
            nisa.nc_transpose(dst=ps[:, ln, :n], data=lane_columns(rows, H, n, c * MX_CHUNK, ln))
        dst = xm[:, c, :T, :].permute((0, 2, 1))          # [128, lane, token]
        if gamma is None:
            evict(c, dst, ps[:, :, :T])
        else:
            nisa.activation(dst=gm[:, c, :], op=nl.copy, data=ps[:, :, T])
            if T == 1:
                nisa.scalar_tensor_tensor(dst=xm[:, c, 0, :], data=ps[:, :, 0], op0=nl.multiply,
                                          operand0=rstd[:, 0:1], op1=nl.multiply, operand1=gm[:, c, :])
            else:
                nisa.tensor_tensor(dst=xr[:, :, :T], data1=ps[:, :, :T],
                                   data2=rstd[:, :T].expand_dim(1).broadcast(1, MX_LANES), op=nl.multiply)
                nisa.tensor_tensor(dst=dst, data1=xr[:, :, :T], data2=gm[:, c, :].expand_dim(2).broadcast(2, T),
                                   op=nl.multiply)
        nisa.quantize_mx(dst=xq[:, c, :T], src=xm[:, c, :T, :], dst_scale=xs[:, c, :T])
    return xq, xs


def load_step(cfg, ring, b, e, w_gate_up, w_down, scales, b_gate_up):
    """Expert e's MXFP4 weights into slot b: gate/up words one contiguous run per partition (KC * 2I words), the
    down words of the real I blocks only (the last chunk's spread over the quadrants: MxShape), both projections'
    scale rows in the quadrant layout (mx_ops), the gate/up bias row."""
    mx, H = cfg.mxs, cfg.H
    row = mx.KC * mx.I2
    wgu = ring.wgu[b][:, FRONT:FRONT + row]
    nisa.dma_copy(dst=wgu, src=expert_src(w_gate_up, e, [[row, P_MAX], [1, row]], 0, P_MAX * row))
    load_mx_scales(ring.sgu[b][:, FRONT:FRONT + row], row,
                   lambda pat, off: expert_src(scales[0], e, pat, off, 16 * row))
    drow, KDm = mx.KDm * H, mx.KDm

    def d_src(pat, off):
        return expert_src(scales[1], e, pat, off, 16 * drow)

    if KDm > 1:
        nisa.dma_copy(dst=ring.wd[b][:, :KDm - 1, :],
                      src=expert_src(w_down, e, [[drow, P_MAX], [1, drow - H]], 0, P_MAX * drow))
    last = (KDm - 1) * H
    if mx.spq == 4:
        p_last = mx.blocks_last * MX_ROWS
        nisa.dma_copy(dst=ring.wd[b][:p_last, KDm - 1, :],
                      src=expert_src(w_down, e, [[drow, p_last], [1, H]], last, P_MAX * drow))
        load_mx_scales(ring.sd[b], drow, d_src, base=mx.base_d)
        return _load_bias(mx, ring, b, e, b_gate_up)
    rows = MX_ROWS * mx.spq          # block spq Q + i -> slot 4 Q + 4 - spq + i
    for q in range(4):
        p0 = 32 * q + 32 - rows
        nisa.dma_copy(dst=ring.wd[b][p0:p0 + rows, KDm - 1, :],
                      src=expert_src(w_down, e, [[drow, rows], [1, H]], q * rows * drow + last, P_MAX * drow))
    if KDm > 1:
        load_mx_scales(ring.sd[b][:, :KDm - 1, :], drow, d_src, base=mx.base_d, cols=(0, last))
    load_spread_scales(ring.sd[b][:, KDm - 1, :], drow, d_src, mx.spq, (last, H))
    if ring.n < cfg.nbuf:
        # the slot's first use: the empty slots' scale rows (4 - spq per quadrant, never loaded again) from this
        # expert's padding blocks (blocks_last.. : 2**0 in pack's layout; at least 4 (4 - spq) of them exist) -- a
        # DMA after the expert's own, where a GpSimd memset of the rows would cost ~2.5 us each
        d = 4 - mx.spq
        for q in range(4):
            nisa.dma_copy(dst=ring.sd[b][32 * q:32 * q + d, KDm - 1, :],
                          src=d_src([[drow, d], [1, H]], (mx.blocks_last + q * d) * drow + last))
    return _load_bias(mx, ring, b, e, b_gate_up)


def _load_bias(mx, ring, b, e, b_gate_up):
    if b_gate_up is not None:
        nisa.dma_copy(dst=ring.bgu[b][:, FRONT:FRONT + mx.I2],
                      src=expert_src(b_gate_up, e, [[mx.I2, 1], [1, mx.I2]], 0, mx.I2))


def gate_up_step(cfg, consts, ring, b, xq, xs, aff_col, has_bias):
    """gate / up per (I chunk, lane) group [rows, T] fp32 in PSUM: the lane's weight columns stationary, the tokens'
    MXFP8 words moving, contracted over the KC chunks; the bias row's columns close the group (a K=1 bf16 matmul).
    The slot's affinities broadcast to all partitions (a ones matmul over diag(aff): exact) go to ring.affb."""
    T, mx = cfg.T, cfg.mxs
    ps = ring.ps_gu[ring.n % cfg.n_gu]
    diag = ring.tmp[ring.n % 2][3][:, 0, :]
    nisa.tensor_scalar(dst=diag[:T, :T], data=consts.ident[:T, :T], op0=nl.multiply, operand0=aff_col)
    nisa.nc_matmul(dst=ps[:, mx.n_acc, :T], stationary=consts.ones_f32[:T, :], moving=diag[:T, :T],
                   accumulate=False)
    nisa.activation(dst=ring.affb[ring.n % 2][:, :T], op=nl.copy, data=ps[:, mx.n_acc, :T])
    inter = mx.I2 // 2
    groups = []
    for c in range(mx.KDm):
        for q in range(MX_LANES):
            for g, col in ((4 * c + q, c * MX_CHUNK), (4 * (mx.KDm + c) + q, inter + c * MX_CHUNK)):
                groups.append((g, FRONT + col, q, mx.per_quadrant(c)))
    for k in range(mx.KC):
        for g, col, q, spq in groups:
            off = k * mx.I2 + col
            nisa.nc_matmul_mx(dst=ps[:, g, :T],
                              stationary=lane_columns(ring.wgu[b], mx.wgu_w, P_MAX, off, q, per_quadrant=spq),
                              moving=xq[:, k, :T],
                              stationary_scale=lane_columns(ring.sgu[b], mx.wgu_w, P_MAX, off, q, per_quadrant=spq),
                              moving_scale=xs[:, k, :T], accumulate=k > 0)
    if has_bias:
        for g, col, q, spq in groups:
            nisa.nc_matmul(dst=ps[:, g, :T],
                           stationary=lane_columns(ring.bgu[b], FRONT + mx.I2 + COL_PAD, 1, col, q, per_quadrant=spq),
                           moving=consts.ones_bf[0:1, :T], accumulate=True)
    return ps


def activation_step(cfg, ring, ps):
    """act = activation(gate, up) (unscaled) rounded to bf16 straight into the MX order (partition 8 g + r, lane q),
    one instruction per step for all four lanes of an I chunk (the padding elements of the last block zeroed by
    ring.valid), then quantize_mx per chunk. clamped_swiglu: g = min(gate, L), act = (clip(up, -L, L) + 1) * g *
    sigmoid(alpha g); swiglu: silu(gate) * up (moe_torch.activation_torch)."""
    T, mx = cfg.T, cfg.mxs
    xa = ring.xa[ring.n % 2]
    g, sg, glu, u = ring.tmp[ring.n % 2]      # (u: the diag of gate_up_step, consumed by its matmul)
    R = P_MAX
    for c in range(mx.KDm):
        gate = ps[:R, 4 * c:4 * c + 4, :T]
        up = ps[:R, 4 * (mx.KDm + c):4 * (mx.KDm + c) + 4, :T]
        dst = xa[:R, c, :T, :].permute((0, 2, 1))        # [R, lane, token]
        masked = ring.valid is not None and c == mx.KDm - 1
        out = u[:R, :, :T] if masked else dst
        if cfg.activation == "clamped_swiglu":
            nisa.tensor_scalar(dst=g[:R, :, :T], data=gate, op0=nl.minimum, operand0=GPT_OSS_SWIGLU_LIMIT)
            nisa.activation(dst=sg[:R, :, :T], op=nl.sigmoid, data=g[:R, :, :T], scale=GPT_OSS_SWIGLU_ALPHA)
            nisa.tensor_tensor(dst=glu[:R, :, :T], data1=g[:R, :, :T], data2=sg[:R, :, :T], op=nl.multiply,
                               engine=nisa.engine.gpsimd)
            nisa.tensor_scalar(dst=u[:R, :, :T], data=up, op0=nl.maximum, operand0=-GPT_OSS_SWIGLU_LIMIT,
                               op1=nl.minimum, operand1=GPT_OSS_SWIGLU_LIMIT)
            nisa.scalar_tensor_tensor(dst=out, data=u[:R, :, :T], op0=nl.add, operand0=1.0, op1=nl.multiply,
                                      operand1=glu[:R, :, :T])
        else:
            nisa.activation(dst=sg[:R, :, :T], op=nl.silu, data=gate)
            nisa.tensor_tensor(dst=out, data1=sg[:R, :, :T], data2=up, op=nl.multiply)
        if masked:
            nisa.tensor_tensor(dst=dst, data1=out, data2=ring.valid[:R, :].expand_dim(2).broadcast(2, T),
                               op=nl.multiply)
    aq, as_ = ring.aq[ring.n % 2], ring.as_[ring.n % 2]
    for c in range(mx.KDm):
        nisa.quantize_mx(dst=aq[:, c, :T], src=xa[:, c, :T, :], dst_scale=as_[:, c, :T])
    return aq, as_


def down_step(cfg, ring, b, aq, as_, banks, acc):
    """acc [128, KT, T] fp32 (out^T, h = p * KT + kt) += affinity * (act @ W_down): per H tile kt the down words'
    columns h_cols stationary, the MXFP8 activations moving, over the KDm I chunks; then per PSUM bank one scaled
    add into acc (T = 1: one scalar_tensor_tensor, the affinity a per-partition scalar)."""
    T, KT, mx = cfg.T, cfg.KT, cfg.mxs
    affb = ring.affb[ring.n % 2]
    for kt in range(KT):
        bank = banks[kt // cfg.kt_bank]
        for c in range(mx.KDm):
            nisa.nc_matmul_mx(dst=bank[:, kt % cfg.kt_bank, :T], stationary=h_cols(ring.wd[b][:, c, :], kt, KT),
                              moving=aq[:, c, :T],
                              stationary_scale=h_cols(ring.sd[b][mx.base_d:, c, :], kt, KT),
                              moving_scale=as_[:, c, :T], accumulate=c > 0)
    for i, bank in enumerate(banks):
        k0 = i * cfg.kt_bank
        n = min(cfg.kt_bank, KT - k0)
        if T == 1:
            nisa.scalar_tensor_tensor(dst=acc[:, k0:k0 + n, 0], data=bank[:, :n, 0], op0=nl.multiply,
                                      operand0=affb[:, 0:1], op1=nl.add, operand1=acc[:, k0:k0 + n, 0])
        else:
            nisa.tensor_tensor(dst=ring.sc[:, :n, :T], data1=bank[:, :n, :T],
                               data2=affb[:, :T].expand_dim(1).broadcast(1, n), op=nl.multiply)
            # the add on GpSimd (SBUF operands only): VectorE carries the PSUM reads, the activation, quantize_mx
            nisa.tensor_tensor(dst=acc[:, k0:k0 + n, :T], data1=acc[:, k0:k0 + n, :T], data2=ring.sc[:, :n, :T],
                               op=nl.add, engine=nisa.engine.gpsimd)


def expert_step(cfg, consts, ring, e, aff_col, xq, xs, down_sets, acc, w_gate_up, w_down, scales, b_gate_up):
    """One expert on all T tokens (tokens that did not pick it have affinity 0): load, gate/up, activation, down."""
    b = ring.n % cfg.nbuf
    load_step(cfg, ring, b, e, w_gate_up, w_down, scales, b_gate_up)
    ps = gate_up_step(cfg, consts, ring, b, xq, xs, aff_col, b_gate_up is not None)
    aq, as_ = activation_step(cfg, ring, ps)
    down_step(cfg, ring, b, aq, as_, down_sets[ring.n % len(down_sets)], acc)
    ring.n += 1


def store_step(cfg, acc, out, bsum=None):
    """out[t, p * KT + kt] = acc[p, kt, t] (+ bsum [128, KT], T = 1's down biases) in out's dtype; each partition
    writes KT-element runs per token (the bf16 path's out^T store). LNC 2: core c sends the other core's kt half of
    its partial, adds the half it receives to its own (rounding straight to out's dtype) and stores that half."""
    T, KT, H = cfg.T, cfg.KT, cfg.H
    if cfg.ncores > 1:
        if bsum is not None:
            nisa.tensor_tensor(dst=acc[:, :, 0], data1=acc[:, :, 0], data2=bsum, op=nl.add)
        half = KT // 2
        lo, olo = cfg.core * half, (1 - cfg.core) * half
        other = nl.ndarray((P_MAX, half, cfg.GS), dtype=nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=acc[:, olo:olo + half, :T], dst=other[:, :, :T], send_to_rank=1 - cfg.core,
                      recv_from_rank=1 - cfg.core, pipe_id=1)
        o = nl.ndarray((P_MAX, cfg.GS, half), dtype=out.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o[:, :T, :].permute((0, 2, 1)), data1=acc[:, lo:lo + half, :T],
                           data2=other[:, :, :T], op=nl.add)
        nisa.dma_copy(dst=out.ap([[KT, P_MAX], [H, T], [1, half]], offset=lo), src=o[:, :T, :])
        return
    o = nl.ndarray((P_MAX, cfg.GS, KT), dtype=out.dtype, buffer=nl.sbuf)
    if bsum is None:
        nisa.tensor_copy(dst=o[:, :T, :].permute((0, 2, 1)), src=acc[:, :, :T])
    else:
        nisa.tensor_tensor(dst=o[:, 0, :], data1=acc[:, :, 0], data2=bsum, op=nl.add)
    nisa.dma_copy(dst=out.ap([[KT, P_MAX], [H, T], [1, KT]], offset=0), src=o[:, :T, :])
