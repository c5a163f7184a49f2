"""Small inputs, RMSNorm, the QKV projection (LNC=2: split contraction), RoPE, fp8 quantisation of the new K/V and the
q/k transposes.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

from ...common.tiles import evict, transpose_spread_rows, transpose_token_groups, transpose_tokens
from .common import _ones_row
from .config import (
    BIAS_ROWS,
    P_MAX,
    PSUM_F,
    QKV_BANKS,
    SMALL_ROWS_MAX,
    TRANSPOSE_GROUP,
    W_QKV_DMAS,
    X_ROW_S_MAX,
    XT_DIRECT_TOKENS,
    x_row_groups,
)


class _Inputs(nl.NKIObject):
    """Small per-launch inputs in SBUF (loaded before the weights so they never queue behind them)."""

    def __init__(self):
        self.x, self.cos, self.sin = (), (), ()
        self.gamma, self.bias_qkv, self.bias_o, self.bias_o_rows = None, None, None, None
        self.bias_o_row = None      # _Config.bias_psum: bias_o's chunks on partitions BIAS_ROWS
        self.ks, self.vs, self.ks_inv, self.vs_inv = None, None, None, None   # fp8 cache scales [128, nkv] fp32


def _load_kv_scales(cfg, ins, k_scale, v_scale):
    """fp8 cache: ins.ks / ins.vs = the KV heads' scales on every partition (per tensor: one value repeated) and
    ins.ks_inv / ins.vs_inv = 1 / scale, [128, nkv] fp32."""
    for name, t in (("ks", k_scale), ("vs", v_scale)):
        sc = nl.ndarray((P_MAX, cfg.nkv), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=sc, src=t.ap([[0, P_MAX], [1 if t.shape[0] == cfg.nkv else 0, cfg.nkv]]))
        inv = nl.ndarray((P_MAX, cfg.nkv), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=sc)
        setattr(ins, name, sc)
        setattr(ins, name + "_inv", inv)


def _load_small_inputs(cfg, X, gamma, bias_qkv, bias_o, cos, sin, tiles, k_scale=None, v_scale=None):
    ins = _Inputs()
    if cfg.fp8:
        _load_kv_scales(cfg, ins, k_scale, v_scale)
    X2 = X.reshape((cfg.B * cfg.S, cfg.H))
    xs = []
    for tl in tiles:
        t0, nt = tl.t0, tl.nt
        parts = x_row_groups(cfg, nt)
        if parts:       # rows in len(parts) groups, each on its own partitions (see X_ROW_PARTS)
            x = nl.ndarray((P_MAX, cfg.H), dtype=X.dtype, buffer=nl.sbuf)
            groups, g0 = [], 0
            for p0, cap in parts:
                m = min(cap, nt - g0)
                if m > 0:
                    nisa.dma_copy(dst=x[p0:p0 + m], src=X2[t0 + g0:t0 + g0 + m, :])
                    groups.append((x[p0:p0 + m], g0, m))
                g0 += m
            xs.append(tuple(groups))
            continue
        if cfg.x_spread:    # rows on partitions x_spread * t (one DMA engine each), zeros between (X_SPREAD_TOKENS)
            sp = cfg.x_spread
            blk = 32 if (nt - 1) * sp < 32 else 64
            x = nl.ndarray((P_MAX, cfg.H), dtype=X.dtype, buffer=nl.sbuf)
            x = x[P_MAX - blk:] if cfg.s_max <= X_ROW_S_MAX else x[:blk]
            h2 = cfg.H // 2
            nisa.memset(dst=x[:, :h2], value=0.0, engine=nisa.engine.gpsimd)
            nisa.memset(dst=x[:, h2:], value=0.0, engine=nisa.engine.vector)
            for t in range(nt):
                nisa.dma_copy(dst=x[t * sp:t * sp + 1, :], src=X2[t0 + t:t0 + t + 1, :])
            xs.append(x)
            continue
        if nt <= XT_DIRECT_TOKENS:      # transposed on load: [128, tokens, KT] (see XT_DIRECT_TOKENS)
            x = nl.ndarray((P_MAX, XT_DIRECT_TOKENS, cfg.KT), dtype=X.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x[:, :nt, :], src=X.ap([[cfg.KT, P_MAX], [cfg.H, nt], [1, cfg.KT]], offset=t0 * cfg.H))
        else:
            x = nl.ndarray((P_MAX, cfg.H), dtype=X.dtype, buffer=nl.sbuf)
            # at most 64 tokens: the rows on partitions 64.. (DMA engines 8..15), as the pack tables of per-row
            # positions occupy engines 0..7 (modelled GPT-OSS B=64 16K: rings 0..7 busy 6.6 us longer)
            x0 = P_MAX // 2 if 2 * nt <= P_MAX else 0
            nisa.dma_copy(dst=x[x0:x0 + nt], src=X2[t0:t0 + nt, :])
            x = x[x0:]
        xs.append(x)
    ins.x = tuple(xs)
    if gamma is not None:
        # gamma[p * KT + kt] on partition p, column kt: the H layout of the transposed activations and of W_qkv.
        ins.gamma = nl.ndarray((P_MAX, cfg.KT), dtype=gamma.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ins.gamma, src=gamma.reshape((P_MAX, cfg.KT)))
    if bias_qkv is not None:
        ins.bias_qkv = nl.ndarray((1, cfg.C), dtype=bias_qkv.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=ins.bias_qkv, src=bias_qkv)
    if bias_o is not None and cfg.bias_psum:
        # the stationaries of the K = 1 bias matmuls opening each out^T chunk's PSUM accumulation group
        # (oproj._accumulate_out_chunks): chunk c's 128 values on partition BIAS_ROWS[c % 2], columns
        # (c // 2) * 128.. (two 1-partition rows at quadrant starts, C13; DMA engines 8 and 12, away from the pack
        # tables' 0..7; H / 2 elements per partition instead of H)
        n_c = cfg.H // P_MAX
        row = nl.ndarray((P_MAX, (n_c + 1) // 2 * P_MAX), dtype=bias_o.dtype, buffer=nl.sbuf)
        for h, p in enumerate(BIAS_ROWS):
            nh = (n_c - h + 1) // 2
            nisa.dma_copy(dst=row[p:p + 1, :nh * P_MAX].reshape((1, nh, P_MAX)),
                          src=bias_o.ap([[cfg.H, 1], [2 * P_MAX, nh], [1, P_MAX]], offset=h * P_MAX))
        ins.bias_o_row = row
    elif bias_o is not None:
        # bias_o[c * 128 + p] on partition p, column c (a per-partition scalar of the transposed O-projection):
        # a contiguous [H/128, 128] load and one TensorE transpose.
        n_c = cfg.H // P_MAX
        b_rows = nl.ndarray((P_MAX, P_MAX), dtype=bias_o.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b_rows[:n_c, :], src=bias_o.reshape((n_c, P_MAX)))
        ins.bias_o_rows = b_rows
    if cos is not None:
        h2 = cfg.d // 2
        cos2 = cos.reshape((cfg.B * cfg.S, h2))
        sin2 = sin.reshape((cfg.B * cfg.S, h2))
        cs, sn = [], []
        for tl in tiles:
            t0, nt = tl.t0, tl.nt
            cs.append(_load_table_rows(cfg, cos2[t0:t0 + nt, :], nt))
            sn.append(_load_table_rows(cfg, sin2[t0:t0 + nt, :], nt))
        ins.cos, ins.sin = tuple(cs), tuple(sn)
    return ins


def _load_table_rows(cfg, src, nt):
    """A token tile's RoPE table rows src [nt, d / 2] in SBUF; returns their [nt, d / 2] view. On partitions
    cfg.small_p0 .. + nt when the tile has at most 32 rows (off DMA engine 0, see SMALL_P0; the RoPE products read
    them there, a legal quadrant start), else 0 .. nt - 1."""
    p0 = cfg.small_p0 if nt <= SMALL_ROWS_MAX else 0
    t = nl.ndarray((P_MAX, cfg.d // 2), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[p0:p0 + nt], src=src)
    return t[p0:p0 + nt]


def _quantize_kv(cfg, qkv, ins, tiles, cache_dtype):
    """fp8 cache: the new tokens' k and v columns become value / scale rounded to the cache dtype (held in bf16:
    exactly what the cache stores, so the active step, the cached keys and the cache update agree), and q is
    multiplied by its KV head's k_scale (scores = q k). v_scale is applied to the final 1 / l."""
    d, nq, nkv, G = cfg.d, cfg.nq, cfg.nkv, cfg.group
    for ti, tl in enumerate(tiles):
        nt = tl.nt
        t = qkv[ti]
        q = t[:nt, cfg.pad:cfg.pad + nq * d].reshape((nt, nkv, G * d))
        nisa.tensor_tensor(dst=q, data1=q, data2=ins.ks[:nt, :].expand_dim(2).broadcast(2, G * d), op=nl.multiply)
        for c0, inv in ((nq * d, ins.ks_inv), ((nq + nkv) * d, ins.vs_inv)):
            kv = t[:nt, cfg.pad + c0:cfg.pad + c0 + nkv * d].reshape((nt, nkv, d))
            q8 = nl.ndarray((P_MAX, nkv, d), dtype=cache_dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=q8[:nt], data1=kv, data2=inv[:nt, :].expand_dim(2).broadcast(2, d),
                               op=nl.multiply)
            nisa.tensor_copy(dst=kv, src=q8[:nt])


def _transpose_bias_o(cfg, ins):
    """ins.bias_o = [128, H/128] fp32 from the [H/128, 128] rows (H/128 <= 128 chunks per transpose)."""
    if ins.bias_o_rows is None:
        return
    n_c = cfg.H // P_MAX
    ins.bias_o = nl.ndarray((P_MAX, n_c), dtype=nl.float32, buffer=nl.sbuf)
    for c0 in range(0, n_c, P_MAX):
        nc = min(P_MAX, n_c - c0)
        ps = nl.ndarray((P_MAX, P_MAX), dtype=ins.bias_o_rows.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ps[:, :nc], data=ins.bias_o_rows[c0:c0 + nc, :])
        nisa.tensor_copy(dst=ins.bias_o[:, c0:c0 + nc], src=ps[:, :nc])


def _rmsnorm(cfg, consts, ins, tiles, eps):
    """xT[tile] = [128 (H), KT, tokens] bf16 with H index p * KT + kt: rmsnorm(x) transposed.

    x^T is x as loaded (few tokens: already [128, tokens, KT], see XT_DIRECT_TOKENS) or comes from TensorE
    transposes of strided column sets of x; the sum of squares is a ones-matmul over the partitions (broadcast to
    all 128), so every elementwise step runs on KT * tokens elements instead of H.
    """
    KT = cfg.KT
    xTs = []
    for ti, tl in enumerate(tiles):
        nt = tl.nt
        x = ins.x[ti]
        if cfg.x_spread:                # rows on every x_spread-th partition (X_SPREAD_TOKENS)
            xT = transpose_spread_rows(x, nt, KT, cfg.x_spread)
            if ins.gamma is None:
                xTs.append(xT)
                continue
            xT = xT[:, :, :nt]
        elif isinstance(x, tuple):        # rows in groups (X_ROW_PARTS)
            xT = transpose_token_groups(x, nt, KT)
            if ins.gamma is None:
                xTs.append(xT)
                continue
            xT = xT[:, :, :nt]
        elif nt <= XT_DIRECT_TOKENS:
            xT = x[:, :nt, :].permute((0, 2, 1))        # [128, KT, nt] view of the transposed load
            if ins.gamma is None:                       # the QKV stationaries want the tokens contiguous
                xc = nl.ndarray((P_MAX, KT, P_MAX), dtype=x.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=xc[:, :, :nt], src=xT)
                xTs.append(xc)
                continue
        else:
            xT = transpose_tokens(x, nt, KT)
            if ins.gamma is None:
                xTs.append(xT)
                continue
            xT = xT[:, :, :nt]
        sq = nl.ndarray((P_MAX, KT, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=sq[:, :, :nt], op=nl.square, data=xT)
        ss = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.psum)
        first = True
        for kt in range(KT):
            n_p = min(P_MAX, max(0, (cfg.h_actual - kt + KT - 1) // KT))   # partitions p with p*KT + kt < H_actual
            if n_p > 0:
                nisa.nc_matmul(dst=ss[:, :nt], stationary=consts.ones_f32[:n_p, :], moving=sq[:n_p, kt, :nt],
                               accumulate=not first)
                first = False
        ms = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ms[:, :nt], data=ss[:, :nt], op0=nl.multiply, operand0=1.0 / cfg.h_actual,
                           op1=nl.add, operand1=eps)
        rstd = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=rstd[:, :nt], op=nl.rsqrt, data=ms[:, :nt])
        xr = nl.ndarray((P_MAX, KT, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=xr[:, :, :nt], data1=xT, data2=rstd[:, :nt].expand_dim(1).broadcast(1, KT),
                           op=nl.multiply)
        xn = nl.ndarray((P_MAX, KT, P_MAX), dtype=xT.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=xn[:, :, :nt], data1=xr[:, :, :nt], data2=ins.gamma.expand_dim(2).broadcast(2, nt),
                           op=nl.multiply)
        xTs.append(xn)
    return tuple(xTs)


def _qkv_projection(cfg, consts, xT, W_qkv, bias, tiles, ins=None):
    """qkv[tile] = [tokens, C] bf16 = xn @ W_qkv (+ bias), fp32 accumulation in PSUM over H/128 tiles.

    W_qkv is resident in SBUF as [128, KT, C] (row p * KT + kt on partition p: KT * C contiguous elements per
    partition), loaded in W_QKV_DMAS large DMAs so the first accumulation group starts on the first part; or, when
    this core's share does not fit (cfg.wq_chunk, config._weight_plan), streamed through a ring of cfg.wq_bufs
    buffers of cfg.wq_chunk tiles (see _qkv_streamed). The bias is one more K=1 matmul (ones x bias) into the same
    accumulator.
    Context split (LNC=2, B < 2): each core contracts half of the KT tiles (and loads only those rows of W_qkv);
    the fp32 partial sums are exchanged with sendrecv and added (same bits on both cores; bias on core 0's part).
    Returns (qkv, qkT): qkT is None unless RoPE and the q / k transposes ran on the transposed sums
    (_Config.rope_t, _rope_transposed; ins: the RoPE tables), else the caller applies _rope and _transpose_qk.
    """
    KT, C = cfg.KT, cfg.C
    qsplit = cfg.wsplit and KT >= 2
    kt0, kt1 = (0, KT) if not qsplit else ((0, KT // 2) if cfg.core == 0 else (KT // 2, KT))
    if qsplit and cfg.core == 1:
        bias = None
    w3 = W_qkv.reshape((P_MAX, KT, C))
    wq = None
    if not cfg.wq_chunk:
        wq = nl.ndarray((P_MAX, kt1 - kt0, C), dtype=W_qkv.dtype, buffer=nl.sbuf)     # this core's rows only
        n_dma = min(W_QKV_DMAS, kt1 - kt0)
        for i in range(n_dma):
            k0, k1 = kt0 + i * (kt1 - kt0) // n_dma, kt0 + (i + 1) * (kt1 - kt0) // n_dma
            nisa.dma_copy(dst=wq[:, k0 - kt0:k1 - kt0, :], src=w3[:, k0:k1, :])
    qkv = tuple(_qkv_tile(cfg, W_qkv.dtype, tiles[ti].nt) for ti in range(len(tiles)))
    n_cc = (C + P_MAX - 1) // P_MAX
    if (qsplit or cfg.qkv_t) and not cfg.wq_chunk and len(tiles) == 1 and n_cc * tiles[0].nt <= PSUM_F:
        rope = ins if cfg.rope_t else None      # the RoPE tables' presence and dtype: _Config.rope_t
        qkT = _qkv_split_transposed(cfg, consts, xT[0], wq, bias, tiles[0].nt, kt0, kt1, qkv[0], rope)
        return qkv, qkT
    part = ()
    if qsplit:
        part = tuple(nl.ndarray((P_MAX, C), dtype=nl.float32, buffer=nl.sbuf) for _ in tiles)
    n_chunks = (C + PSUM_F - 1) // PSUM_F
    pairs = [(ti, ch) for ch in range(n_chunks) for ti in range(len(tiles))]
    # streamed: groups of whole column chunks (every token tile), as many as the PSUM banks hold, so each weight
    # column is loaded once (one group: whole rows of W_qkv per DMA)
    per = QKV_BANKS if not cfg.wq_chunk else max(1, nl.tile_size.psum_num_banks // len(tiles)) * len(tiles)
    n_ev = 0
    for g0 in range(0, len(pairs), per):
        group = pairs[g0:g0 + per]
        accs = [nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum) for _ in group]
        if bias is not None:
            for i, (ti, ch) in enumerate(group):
                nt, c0, cw = tiles[ti].nt, ch * PSUM_F, min(PSUM_F, C - ch * PSUM_F)
                nisa.nc_matmul(dst=accs[i][:nt, :cw], stationary=_ones_row(consts, bias.dtype, nt),
                               moving=bias[:1, c0:c0 + cw], accumulate=False)
        if cfg.wq_chunk:
            _qkv_streamed(cfg, xT, w3, tiles, group, accs, kt0, kt1, bias is not None)
        else:
            _accumulate_qkv(cfg, xT, tiles, group, accs, kt0, kt1, wq, kt0, 0, kt0, bias is not None)
        for i, (ti, ch) in enumerate(group):
            nt, c0, cw = tiles[ti].nt, ch * PSUM_F, min(PSUM_F, C - ch * PSUM_F)
            if qsplit:
                evict(n_ev, part[ti][:nt, c0:c0 + cw], accs[i][:nt, :cw])
            else:
                evict(n_ev, qkv[ti][:nt, cfg.pad + c0:cfg.pad + c0 + cw], accs[i][:nt, :cw])
            n_ev += 1
        accs = None    # release the banks before the next group allocates
    for ti in range(len(part)):
        nt = tiles[ti].nt
        other = nl.ndarray((P_MAX, C), dtype=nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=part[ti][:nt, :], dst=other[:nt, :], send_to_rank=1 - cfg.core, recv_from_rank=1 - cfg.core,
                      pipe_id=cfg.nkv + ti)
        nisa.tensor_tensor(dst=qkv[ti][:nt, cfg.pad:cfg.pad + C], data1=part[ti][:nt, :], data2=other[:nt, :],
                           op=nl.add)
    return qkv, None


def _qkv_split_transposed(cfg, consts, xT, wq, bias, nt, kt0, kt1, dst, rope=None):
    """Also with one core (_Config.qkv_t, trn3: the sums not exchanged, evicted to bf16 directly).
    LNC=2 split contraction (one token tile, resident W_qkv share wq = rows [kt0, kt1)): this core's partial sums
    computed transposed, partT [128 (C rows of chunk j), chunk j, tokens] fp32 in one PSUM bank (stationary = a
    128-column block of W_qkv, moving = x^T: max(tokens, 64) cycles per matmul instead of 512 with W_qkv moving),
    exchanged with the other core in that layout and added; the bf16 sum goes back to the token layout dst
    [tokens, pad | C | pad] by TensorE transposes.
    Why transposed: the token layout holds the partial sums on `tokens` partitions, i.e. on ONE DMA engine (8
    partitions each) for up to 8 tokens, so the exchange (tokens x C x 4 bytes) queued on that engine ahead of
    its K/V shares (modelled, Llama-3.1-8B TP8 B=8 4K LNC=2: engine 0 1.2 us busier than the others); [128, ...]
    spreads it over all 16. Same sums (the same products accumulated over the same H tiles), same bf16 rounding
    of fp32 own + other (fp32 addition commutes: both cores hold the same bits); bias on core 0's part.
    rope (the inputs' RoPE tables, _Config.rope_t): RoPE and q^T / k^T from the transposed sums
    (_rope_transposed), only the k / v chunks back to the token layout; returns qkT (else None)."""
    C = cfg.C
    n_cc = (C + P_MAX - 1) // P_MAX
    nf = C // P_MAX                     # full 128-row chunks; a last partial one holds cl rows
    cl = C - nf * P_MAX
    ps = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
    pv = ps[:, :n_cc * nt].reshape((P_MAX, n_cc, nt))
    # accumulation groups interleaved in one bank (one per chunk), H tiles outer: each W_qkv DMA's tiles are
    # used as they arrive
    if bias is not None:
        for j in range(n_cc):
            cw = min(P_MAX, C - j * P_MAX)
            nisa.nc_matmul(dst=pv[:cw, j, :], stationary=bias[:1, j * P_MAX:j * P_MAX + cw],
                           moving=_ones_row(consts, bias.dtype, nt), accumulate=False)
    for kt in range(kt0, kt1):
        for j in range(n_cc):
            cw = min(P_MAX, C - j * P_MAX)
            nisa.nc_matmul(dst=pv[:cw, j, :], stationary=wq[:, kt - kt0, j * P_MAX:j * P_MAX + cw],
                           moving=xT[:, kt, :nt], accumulate=(kt > kt0 or bias is not None))
    exchange = cfg.wsplit and cfg.KT >= 2
    # LNC=2: this core's fp32 partial sums, exchanged and added (bf16 sum); one core (_Config.qkv_t): the sums
    # evicted to bf16 directly (the row form's rounding point)
    part = nl.ndarray((P_MAX, n_cc, nt), dtype=nl.float32 if exchange else dst.dtype, buffer=nl.sbuf)
    if cl:          # the partial chunk's unused rows: zeros (exchanged and added / transposed, never read back)
        nisa.memset(dst=part[:, nf, :], value=0.0, engine=nisa.engine.gpsimd)
    if nf:
        evict(0, part[:, :nf, :], pv[:, :nf, :])
    if cl:
        evict(1, part[:cl, nf, :], pv[:cl, nf, :])
    sT = part
    if exchange:
        other = nl.ndarray((P_MAX, n_cc, nt), dtype=nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=part, dst=other, send_to_rank=1 - cfg.core, recv_from_rank=1 - cfg.core,
                      pipe_id=cfg.nkv)
        sT = nl.ndarray((P_MAX, n_cc, nt), dtype=dst.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=sT, data1=part, data2=other, op=nl.add)
    qkT, c_lo = None, 0
    if rope is not None:
        sT, qkT = _rope_transposed(cfg, consts, rope, sT, nt)
        c_lo = cfg.nq * cfg.d // P_MAX      # the q columns of the token layout are not read (q^T is in qkT)
    pad = cfg.pad
    for j0 in range(c_lo, n_cc, TRANSPOSE_GROUP):
        n = min(TRANSPOSE_GROUP, n_cc - j0)
        pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=dst.dtype, buffer=nl.psum)
        for j in range(j0, j0 + n):
            nisa.nc_transpose(dst=pt[:nt, j - j0, :], data=sT[:, j, :nt])
        w = min(C, (j0 + n) * P_MAX) - j0 * P_MAX       # the partial chunk's zero columns are not copied
        nisa.tensor_copy(dst=dst[:nt, pad + j0 * P_MAX:pad + j0 * P_MAX + w],
                         src=pt[:nt, :n, :].reshape((nt, n * P_MAX))[:, :w])
        pt = None
    return qkT


def _rope_transposed(cfg, consts, ins, sT, nt):
    """Half-split RoPE on the transposed QKV sums sT [128 (rows of C chunk j), chunk j, tokens] (bf16, one token
    tile; _Config.rope_t) and q^T / k^T from them. Returns (roped [128, chunk, tokens] bf16, qkT as _transpose_qk's).
    With 128 % d == 0 each chunk holds whole heads, so the rotate-half partner of row r (r -+ d/2 within its head)
    is in the same chunk: xr = R sT by one matmul with a permutation stationary (exact). With the tables transposed
    once (cos^T [128, tokens]: row r holds cos[t, r % (d/2)]; sin^T signed -sin on each head's first half, +sin on
    its second) roped = sT * cos^T + xr * sin^T: the products and the one rounding of _rope (x1 c - x2 s, x2 c + x1 s
    in fp32, bf16 result), so the same bits. The v rows (flat C index >= (nq + nkv) d) take cos 1, sin 0.
    q^T / k^T: kpp = 1 (d = 128): head h is chunk h. kpp = 2 (d = 64): chunk j holds heads 2j (rows 0..63) and
    2j + 1 (rows 64..127); the other partition half of each (qkT's u = 1 / u = 0 copies) by a second permutation
    matmul (swap the halves)."""
    d, h2, kpp = cfg.d, cfg.d // 2, cfg.kpp
    n_cc = (cfg.C + P_MAX - 1) // P_MAX
    nqk = (cfg.nq + cfg.nkv) * d
    cdt = ins.cos[0].dtype
    # token-layout tables [tokens, 128]: cos repeated per d/2 columns; sin signed per head half
    nb = P_MAX // d
    c4 = nl.ndarray((P_MAX, P_MAX), dtype=cdt, buffer=nl.sbuf)
    s4 = nl.ndarray((P_MAX, P_MAX), dtype=cdt, buffer=nl.sbuf)
    cos, sin = ins.cos[0], ins.sin[0]
    p0 = cfg.small_p0 if nt <= SMALL_ROWS_MAX else 0        # the tables' partitions (_load_table_rows)
    nisa.tensor_copy(dst=c4[p0:p0 + nt, :].reshape((nt, 2 * nb, h2)),
                     src=cos.expand_dim(1).broadcast(1, 2 * nb))
    s4v = s4[p0:p0 + nt, :].reshape((nt, nb, 2, h2))
    sb = sin.expand_dim(1).broadcast(1, nb)
    nisa.tensor_scalar(dst=s4v[:, :, 0, :], data=sb, op0=nl.multiply, operand0=-1.0)
    nisa.tensor_copy(dst=s4v[:, :, 1, :], src=sb)
    tab = nl.ndarray((P_MAX, 2, P_MAX), dtype=cdt, buffer=nl.psum)
    nisa.nc_transpose(dst=tab[:, 0, :nt], data=c4[p0:p0 + nt, :])
    nisa.nc_transpose(dst=tab[:, 1, :nt], data=s4[p0:p0 + nt, :])
    ct = nl.ndarray((P_MAX, n_cc, nt), dtype=cdt, buffer=nl.sbuf)
    st = nl.ndarray((P_MAX, n_cc, nt), dtype=cdt, buffer=nl.sbuf)
    nisa.tensor_copy(dst=ct, src=tab[:, 0, :nt].expand_dim(1).broadcast(1, n_cc))
    nisa.tensor_copy(dst=st, src=tab[:, 1, :nt].expand_dim(1).broadcast(1, n_cc))
    jv, rv = nqk // P_MAX, nqk % P_MAX      # the v rows (and a partial chunk's zero rows): cos 1, sin 0
    if rv:
        nisa.memset(dst=ct[rv:, jv, :], value=1.0)
        nisa.memset(dst=st[rv:, jv, :], value=0.0)
        jv += 1
    if jv < n_cc:
        nisa.memset(dst=ct[:, jv:, :], value=1.0)
        nisa.memset(dst=st[:, jv:, :], value=0.0)
    # permutation stationaries (matmul dst[m] = sum_k stat[k, m] mov[k]): R (row r <- its partner r -+ d/2) and,
    # kpp = 2, W (row r <- r -+ 64: the other half of the partitions)
    ident = consts.ident
    rm = nl.ndarray((P_MAX, P_MAX), dtype=ident.dtype, buffer=nl.sbuf)
    iv, rmv = ident.reshape((P_MAX, nb, 2, h2)), rm.reshape((P_MAX, nb, 2, h2))
    nisa.tensor_copy(dst=rmv[:, :, 0, :], src=iv[:, :, 1, :])
    nisa.tensor_copy(dst=rmv[:, :, 1, :], src=iv[:, :, 0, :])
    mv = sT.reshape((P_MAX, n_cc * nt))
    xr = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=xr[:, :n_cc * nt], stationary=rm, moving=mv)
    a = nl.ndarray((P_MAX, n_cc, nt), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((P_MAX, n_cc, nt), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=a, data1=sT, data2=ct, op=nl.multiply, engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=b, data1=xr[:, :n_cc * nt].reshape((P_MAX, n_cc, nt)), data2=st, op=nl.multiply)
    roped = nl.ndarray((P_MAX, n_cc, nt), dtype=sT.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=roped, data1=a, data2=b, op=nl.add)
    nh = cfg.nq + cfg.nkv
    qkT = nl.ndarray((P_MAX, kpp, nt, kpp * n_cc, 1), dtype=sT.dtype, buffer=nl.sbuf)   # >= nh head slots
    if kpp == 1:
        nisa.tensor_copy(dst=qkT[:, 0, :, :n_cc, 0].permute((0, 2, 1)), src=roped)
        return roped, qkT
    assert kpp == 2 and nh <= 2 * n_cc
    wm = nl.ndarray((P_MAX, P_MAX), dtype=ident.dtype, buffer=nl.sbuf)
    half = P_MAX // 2
    nisa.tensor_copy(dst=wm[:, :half], src=ident[:, half:])
    nisa.tensor_copy(dst=wm[:, half:], src=ident[:, :half])
    sw = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=sw[:, :n_cc * nt], stationary=wm, moving=roped.reshape((P_MAX, n_cc * nt)))
    swv = sw[:, :n_cc * nt].reshape((P_MAX, n_cc, nt))

    def heads(u, e):     # qkT[u*64 .. +64, u, token, head 2j + e] as [64, chunk j, token]
        return qkT[u * half:(u + 1) * half, u, :, :, 0].reshape((half, nt, n_cc, 2))[:, :, :, e].permute((0, 2, 1))

    nisa.tensor_copy(dst=heads(0, 0), src=roped[:half], engine=nisa.engine.gpsimd)
    nisa.tensor_copy(dst=heads(1, 1), src=roped[half:], engine=nisa.engine.gpsimd)
    nisa.tensor_copy(dst=heads(0, 1), src=swv[:half])
    nisa.tensor_copy(dst=heads(1, 0), src=swv[half:])
    return roped, qkT


def _accumulate_qkv(cfg, xT, tiles, group, accs, k0, k1, w, kbase, cbase, kt_first, opened):
    """The matmuls of H tiles [k0, k1) into one group of (tile, column chunk) accumulators: stationary = x^T of the
    tile, moving = W_qkv rows of H tile kt held at w[:, kt - kbase] (w: [128, H tiles, columns from cbase]:
    resident W_qkv or one streamed ring buffer); an accumulator opens at H tile kt_first unless opened (it holds the
    bias)."""
    for kt in range(k0, k1):
        for a, (ti, ch) in enumerate(group):
            nt, c0, cw = tiles[ti].nt, ch * PSUM_F, min(PSUM_F, cfg.C - ch * PSUM_F)
            nisa.nc_matmul(dst=accs[a][:nt, :cw], stationary=xT[ti][:, kt, :nt],
                           moving=w[:, kt - kbase, c0 - cbase:c0 - cbase + cw], accumulate=(kt > kt_first or opened))


def _qkv_streamed(cfg, xT, w3, tiles, group, accs, kt0, kt1, opened):
    """The matmuls of one group of (tile, column chunk) accumulators over this core's H tiles [kt0, kt1), with W_qkv
    (w3 = [128, KT, C] view of HBM) streamed through a ring of cfg.wq_bufs buffers of cfg.wq_chunk tiles and the
    group's columns: the first buffers' loads are issued up front, each later one right after the matmuls of the
    chunk whose buffer it reuses (the DMA waits for them), so the loads run ahead of TensorE by the ring's depth.
    opened: the accumulators already hold the bias (every matmul accumulates)."""
    kc, nbuf = cfg.wq_chunk, cfg.wq_bufs
    c_lo = group[0][1] * PSUM_F
    c_hi = min(cfg.C, (group[-1][1] + 1) * PSUM_F)
    ring = nl.ndarray((P_MAX, nbuf, kc, c_hi - c_lo), dtype=w3.dtype, buffer=nl.sbuf)
    chunks = tuple((k0, min(k0 + kc, kt1)) for k0 in range(kt0, kt1, kc))

    def load(i):
        k0, k1 = chunks[i]
        nisa.dma_copy(dst=ring[:, i % nbuf, :k1 - k0, :], src=w3[:, k0:k1, c_lo:c_hi])

    for i in range(min(nbuf, len(chunks))):
        load(i)
    for i, (k0, k1) in enumerate(chunks):
        _accumulate_qkv(cfg, xT, tiles, group, accs, k0, k1, ring[:, i % nbuf], k0, c_lo, kt0, opened)
        if i + nbuf < len(chunks):
            load(i + nbuf)


def _qkv_tile(cfg, dtype, nt):
    """[128, pad | C | pad] token-layout q/k/v tile; the zeroed pads let every head be transposed from a 128-column
    window that puts it on partitions u*d (the stacked layout, see _transpose_qk)."""
    t = nl.ndarray((P_MAX, cfg.C + 2 * cfg.pad), dtype=dtype, buffer=nl.sbuf)
    if cfg.pad > 0:
        nisa.memset(dst=t[:nt, :cfg.pad], value=0.0, engine=nisa.engine.gpsimd)
        nisa.memset(dst=t[:nt, cfg.pad + cfg.C:], value=0.0, engine=nisa.engine.gpsimd)
    return t


def _rope(cfg, qkv, ins, tiles):
    """Half-split RoPE on the q and k heads of each token tile (fp32 math, bf16 result); v columns copied."""
    if len(ins.cos) == 0:
        return qkv
    d, h2 = cfg.d, cfg.d // 2
    nh = cfg.nq + cfg.nkv
    out = []
    for ti, tl in enumerate(tiles):
        nt = tl.nt
        src = qkv[ti]
        cb = ins.cos[ti][:nt].expand_dim(1).broadcast(1, nh)
        sb = ins.sin[ti][:nt].expand_dim(1).broadcast(1, nh)
        pad = cfg.pad
        heads = src[:nt, pad:pad + nh * d].reshape((nt, nh, d))
        x1, x2 = heads[:, :, :h2], heads[:, :, h2:]
        dst = _qkv_tile(cfg, src.dtype, nt)
        rot = dst[:nt, pad:pad + nh * d].reshape((nt, nh, d))
        ta = nl.ndarray((P_MAX, nh, h2), dtype=nl.float32, buffer=nl.sbuf)
        tb = nl.ndarray((P_MAX, nh, h2), dtype=nl.float32, buffer=nl.sbuf)
        tc = nl.ndarray((P_MAX, nh, h2), dtype=nl.float32, buffer=nl.sbuf)
        td = nl.ndarray((P_MAX, nh, h2), dtype=nl.float32, buffer=nl.sbuf)
        # The four products are independent: two on VectorE, two on GpSimd.
        nisa.tensor_tensor(dst=ta[:nt], data1=x1, data2=cb, op=nl.multiply)
        nisa.tensor_tensor(dst=tb[:nt], data1=x2, data2=sb, op=nl.multiply, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=tc[:nt], data1=x2, data2=cb, op=nl.multiply)
        nisa.tensor_tensor(dst=td[:nt], data1=x1, data2=sb, op=nl.multiply, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=rot[:, :, :h2], data1=ta[:nt], data2=tb[:nt], op=nl.subtract)
        nisa.tensor_tensor(dst=rot[:, :, h2:], data1=tc[:nt], data2=td[:nt], op=nl.add)
        nisa.tensor_copy(dst=dst[:nt, pad + nh * d:pad + cfg.C], src=src[:nt, pad + nh * d:pad + cfg.C],
                         engine=nisa.engine.gpsimd)
        out.append(dst)
    return tuple(out)


def _transpose_qk(cfg, qkv, tiles):
    """qkT[:, u, token, head, half] = head^T on partitions u*kd..(u+1)*kd (u < kpp; dims on partitions for QK^T),
    for the q heads 0..nq-1 and k heads nq..nq+nkv-1: TensorE transposes of 128-column windows (d columns when
    kpp = 1). bf16 cache: one half, all d dims in order. fp8 cache (see _Config.halves): half 0 holds the even
    dims, half 1 the odd dims (the layout of the K^T stacks, see _cast_pairs), transposed from a copy of the
    q / k columns with each head's dims reordered [even | odd] and 128 - kd zero columns on both sides."""
    d, kd, kpp, halves = cfg.d, cfg.kd, cfg.kpp, cfg.halves
    n_tok = tiles[-1].t0 + tiles[-1].nt - tiles[0].t0
    nh = cfg.nq + cfg.nkv
    width = kd if kpp == 1 else P_MAX
    qkT = nl.ndarray((P_MAX, kpp, n_tok, nh, halves), dtype=qkv[0].dtype, buffer=nl.sbuf)
    base = tiles[0].t0
    for ti, tl in enumerate(tiles):
        t0, nt = tl.t0, tl.nt
        src, pad = qkv[ti], cfg.pad
        if halves == 2:
            pad = P_MAX - kd
            src = nl.ndarray((P_MAX, 2 * pad + nh * d), dtype=qkv[ti].dtype, buffer=nl.sbuf)
            nisa.memset(dst=src[:nt, :pad], value=0.0)
            nisa.memset(dst=src[:nt, pad + nh * d:], value=0.0)
            heads = qkv[ti][:nt, cfg.pad:cfg.pad + nh * d].reshape((nt, nh, kd, 2))
            nisa.tensor_copy(dst=src[:nt, pad:pad + nh * d].reshape((nt, nh, 2, kd)), src=heads.permute((0, 1, 3, 2)))
        for u in range(kpp):
            for hf in range(halves):
                for h0 in range(0, nh, TRANSPOSE_GROUP):
                    n = min(TRANSPOSE_GROUP, nh - h0)
                    ps = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=qkv[ti].dtype, buffer=nl.psum)
                    for h in range(n):
                        c0 = pad + (h0 + h) * d + hf * kd - u * kd
                        nisa.nc_transpose(dst=ps[:width, h, :nt], data=src[:nt, c0:c0 + width])
                    nisa.tensor_copy(dst=qkT[u * kd:(u + 1) * kd, u, t0 - base:t0 - base + nt, h0:h0 + n, hf]
                                     .permute((0, 2, 1)), src=ps[u * kd:(u + 1) * kd, :n, :nt])
    return qkT
