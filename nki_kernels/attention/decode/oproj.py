"""Attention output to the O-projection's layout (selection matmuls, LNC=2 o^T exchange) and the transposed
O-projection.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

from ...common.tiles import evict
from .config import P_MAX, PSUM_F, TRANSPOSE_GROUP, W_O_DMAS


def _exchange_oT(cfg, oT, b_lo, b_hi, per_core):
    """Split weights: o^T [128, K chunk, tokens] holds this core's sequences' columns; send them and receive the
    other core's (token ranges are static: core 0 has sequences [0, per_core), core 1 the rest)."""
    S = cfg.S
    mine = (b_lo * S, b_hi * S)
    theirs = (per_core * S, cfg.B * S) if cfg.core == 0 else (0, per_core * S)
    nisa.sendrecv(src=oT[:, :, mine[0]:mine[1]], dst=oT[:, :, theirs[0]:theirs[1]], send_to_rank=1 - cfg.core,
                  recv_from_rank=1 - cfg.core, pipe_id=cfg.nkv + 1)


def _rows_to_tokens(cfg, consts, st, o_rows, o_acc, tiles, g, p0, nb):
    """o_acc[tile][token, (g*G + h)*d + e] = o_rows[row(token, h), e] by selection matmuls: Sel_h[r, t] = 1 iff
    r = G*(t - base) + h (rows are (batch, token, head) = G*token + head), one matmul per head."""
    d, S, G = cfg.d, cfg.S, cfg.group
    rows = nb * cfg.R
    hg = max(1, PSUM_F // d)
    for ti, tl in enumerate(tiles):
        nt, tb0, tnb = tl.nt, tl.b0, tl.nb
        if max(p0, tb0) >= min(p0 + nb, tb0 + tnb):
            continue
        base_t = (p0 - tb0) * S
        sel = nl.ndarray((P_MAX, G, P_MAX), dtype=o_rows.dtype, buffer=nl.sbuf)
        nisa.affine_select(dst=sel[:rows, :, :nt], pattern=[[-1, G], [-G, nt]], channel_multiplier=1,
                           on_true_tile=consts.ones[:rows, :nt].expand_dim(1).broadcast(1, G), on_false_value=0.0,
                           cmp_op=nl.equal, offset=G * base_t)
        for h0 in range(0, G, hg):
            hn = min(hg, G - h0)
            for h in range(h0, h0 + hn):
                nisa.nc_matmul(dst=st.ps_sel[:nt, (h - h0) * d:(h - h0 + 1) * d], stationary=sel[:rows, h, :nt],
                               moving=o_rows[:rows, :d], accumulate=False)
            c0 = (g * G + h0) * d
            if p0 <= tb0:      # first pack of this tile: plain copy, later packs add (disjoint non-zero rows)
                nisa.tensor_copy(dst=o_acc[ti][:nt, c0:c0 + hn * d], src=st.ps_sel[:nt, :hn * d])
            else:
                nisa.tensor_tensor(dst=o_acc[ti][:nt, c0:c0 + hn * d], data1=o_acc[ti][:nt, c0:c0 + hn * d],
                                   data2=st.ps_sel[:nt, :hn * d], op=nl.add)


def _rows_to_oT(cfg, consts, st, o_rows, tile, g, p0, nb, full=False):
    """o^T[(hg*d + e) % 128, (hg*d + e) // 128, token] = o_rows[row(token, h), e] (hg = g*G + h) by selection
    matmuls written straight into the selection PSUM bank ([128, n_k, tokens] fp32): stationary o_rows [rows, d],
    moving Sel_h [rows, this pack's tokens] (Sel_h[r, t] = 1 iff r = G*(t - base) + h). Every (head, token) block
    is written once (by its pack), so the bank holds all of o^T after the last pack. full=True: o_rows is the
    normalised accumulator [rows, nb*d] with every batch block; one matmul per (batch j, head h) with stationary =
    block j and moving = Sel_h on batch j's tokens keeps only the row's own block (no block mask / reduction)."""
    d, S, G = cfg.d, cfg.S, cfg.group
    rows = nb * cfg.R
    nt, tb0 = tile.nt, tile.b0
    n_k = (cfg.nq * d + P_MAX - 1) // P_MAX
    ps = st.ps_sel[:, :n_k * nt].reshape((P_MAX, n_k, nt))
    c0, c1 = (p0 - tb0) * S, (p0 - tb0 + nb) * S      # this pack's token columns
    sel = nl.ndarray((P_MAX, G, P_MAX), dtype=o_rows.dtype, buffer=nl.sbuf)
    nisa.affine_select(dst=sel[:rows, :, :c1 - c0], pattern=[[-1, G], [-G, c1 - c0]], channel_multiplier=1,
                       on_true_tile=consts.ones[:rows, :c1 - c0].expand_dim(1).broadcast(1, G), on_false_value=0.0,
                       cmp_op=nl.equal, offset=0)
    # Heads h with (g*G + h) % dup == u land on partitions u*d.. of consecutive chunks: one matmul covers them all
    # (moving = their selection columns, stride dup heads).
    dup = P_MAX // d
    for u in range(dup):
        h0 = (u - g * G) % dup
        if h0 >= G:
            continue
        cnt = (G - h0 + dup - 1) // dup
        k0 = (g * G + h0) // dup
        if full:
            for j in range(nb):
                nisa.nc_matmul(dst=ps[u * d:(u + 1) * d, k0:k0 + cnt, c0 + j * S:c0 + (j + 1) * S],
                               stationary=o_rows[:rows, j * d:(j + 1) * d],
                               moving=sel[:rows, h0:h0 + (cnt - 1) * dup + 1:dup, j * S:(j + 1) * S], accumulate=False)
            continue
        per = max(1, PSUM_F // (c1 - c0))
        for i0 in range(0, cnt, per):
            i1 = min(cnt, i0 + per)
            nisa.nc_matmul(dst=ps[u * d:(u + 1) * d, k0 + i0:k0 + i1, c0:c1], stationary=o_rows[:rows, :d],
                           moving=sel[:rows, h0 + i0 * dup:h0 + (i1 - 1) * dup + 1:dup, :c1 - c0], accumulate=False)


def _load_w_o(cfg, W_o):
    """W_o resident in SBUF as [128 (head, dim) rows, K chunk, H]; one DMA per K chunk (issued after the K/V loads,
    its arrival paces the O-projection, which therefore streams instead of running after the last load)."""
    K = cfg.nq * cfg.d
    n_k = (K + P_MAX - 1) // P_MAX
    wo = nl.ndarray((P_MAX, n_k, cfg.H), dtype=W_o.dtype, buffer=nl.sbuf)
    hc0, hc1 = cfg.hc                                  # this core's output chunks (all of H unless split)
    # W_o arrives last: in column pieces (>= 4 KiB runs; shorter ones cost DMA efficiency), so the O-projection's
    # first chunks start on the first pieces while the last one streams, instead of after the whole load.
    n_pc = max(1, min(W_O_DMAS, (hc1 - hc0) * P_MAX * W_o.dtype.itemsize // (4 * 1024)))
    for k in range(n_k):
        kn = min(P_MAX, K - k * P_MAX)
        for i in range(n_pc):
            c0, c1 = hc0 + i * (hc1 - hc0) // n_pc, hc0 + (i + 1) * (hc1 - hc0) // n_pc
            nisa.dma_copy(dst=wo[:kn, k, c0 * P_MAX:c1 * P_MAX],
                          src=W_o[k * P_MAX:k * P_MAX + kn, c0 * P_MAX:c1 * P_MAX])
    return wo


def _transpose_o(cfg, o_tok, tiles):
    """oT[tile] = [128 (head, dim) rows, K chunk, tokens]: the stationaries of the O-projection."""
    K = cfg.nq * cfg.d
    n_k = (K + P_MAX - 1) // P_MAX
    oTs = []
    for ti, tl in enumerate(tiles):
        nt = tl.nt
        oT = nl.ndarray((P_MAX, n_k, P_MAX), dtype=o_tok[ti].dtype, buffer=nl.sbuf)
        for c0 in range(0, n_k, TRANSPOSE_GROUP):
            nc = min(TRANSPOSE_GROUP, n_k - c0)
            ps = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=o_tok[ti].dtype, buffer=nl.psum)
            kn_max = min(P_MAX, K - c0 * P_MAX)
            for c in range(nc):
                k0 = (c0 + c) * P_MAX
                kn = min(P_MAX, K - k0)
                nisa.nc_transpose(dst=ps[:kn, c, :nt], data=o_tok[ti][:nt, k0:k0 + kn])
            if K % P_MAX == 0 or c0 + nc < n_k:
                nisa.tensor_copy(dst=oT[:kn_max, c0:c0 + nc, :nt], src=ps[:kn_max, :nc, :nt])
            else:   # the last chunk is partial: copy it separately
                if nc > 1:
                    nisa.tensor_copy(dst=oT[:, c0:c0 + nc - 1, :nt], src=ps[:, :nc - 1, :nt])
                kl = K - (n_k - 1) * P_MAX
                nisa.tensor_copy(dst=oT[:kl, n_k - 1, :nt], src=ps[:kl, nc - 1, :nt])
        oTs.append(oT)
    return tuple(oTs)


def _output_projection(cfg, consts, oTs, wo, bias_T, out, tiles):
    """out[tokens, H] = o @ W_o (+ bias), computed transposed: out^T chunk c [128 (H), tokens] = sum over K chunks
    of matmul(stationary = W_o rows [K chunk, 128 H columns], moving = o^T [K chunk, tokens]) -- max(tokens, 64)
    cycles per matmul instead of 512 with W_o moving. The bias is a per-partition scalar of out^T (added by the
    eviction), then TensorE transposes bring [tokens, H] back for one contiguous store per token tile (few tokens:
    several chunks per transpose, see _store_packed).
    """
    K = cfg.nq * cfg.d
    n_k = (K + P_MAX - 1) // P_MAX
    n_c = (cfg.H + P_MAX - 1) // P_MAX
    hc0, hc1 = cfg.hc                                        # this core's 128-column chunks of H
    for ti, tl in enumerate(tiles):
        t0, nt = tl.t0, tl.nt
        per_bank = max(1, PSUM_F // P_MAX)                  # out^T chunks of [128, 128] fp32 per bank
        outT = nl.ndarray((P_MAX, n_c, P_MAX), dtype=out.dtype, buffer=nl.sbuf)
        nr = hc1 - hc0
        # chunks per packed group (<= 128 / tokens: whole banks, dividing the range when possible; otherwise the
        # last group is partial)
        cmax = P_MAX // nt // per_bank * per_bank
        cpt = cmax
        while cpt > 0 and nr % cpt != 0:
            cpt -= per_bank
        if cpt == 0 and cmax > 0:
            cpt = min(cmax, nr)
        packed = cpt > 0
        if packed:        # [128, group, token, chunk of the group] (groups relative to hc0): see _store_packed
            n_g = (nr + cpt - 1) // cpt
            rem = nr - (n_g - 1) * cpt
            outP = nl.ndarray((P_MAX, n_g, nt, cpt), dtype=out.dtype, buffer=nl.sbuf)
            if rem < cpt:     # the partial group's unused chunks: finite (they are transposed, never stored)
                nisa.memset(dst=outP[:, n_g - 1, :, rem:], value=0.0)
        # Chunks per eviction: a bank holds PSUM_F // nt chunks of [128, nt] (few tokens: many chunks per
        # eviction instead of one small eviction per 4 chunks, whose fixed costs paced the tail), but at most half
        # of the range, so two evictions alternate engines while TensorE works; packed: whole groups.
        ev = max(per_bank, min(PSUM_F // nt, (nr + 1) // 2))
        if packed:
            ev = max(cpt, ev // cpt * cpt)
        for c0 in range(hc0, hc1, ev):
            ncb = min(ev, hc1 - c0)
            ps = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
            pv = ps[:, :ncb * nt].reshape((P_MAX, ncb, nt))
            for c in range(c0, c0 + ncb):                   # one accumulation group at a time per bank
                for k in range(n_k):
                    kn = min(P_MAX, K - k * P_MAX)
                    nisa.nc_matmul(dst=pv[:, c - c0, :], stationary=wo[:kn, k, c * P_MAX:(c + 1) * P_MAX],
                                   moving=oTs[ti][:kn, k, :nt], accumulate=(k > 0))
            n_ev = (c0 - hc0) // ev
            if not packed:
                _evict_out(n_ev, outT[:, c0:c0 + ncb, :nt], pv, bias_T, c0, ncb, nt)
            else:     # whole groups as [128, groups, chunk, token] views of both sides, then a partial group
                g0, nfull, part = (c0 - hc0) // cpt, ncb // cpt, ncb % cpt
                if nfull:
                    _evict_out(n_ev, outP[:, g0:g0 + nfull, :, :].permute((0, 1, 3, 2)),
                               ps[:, :nfull * cpt * nt].reshape((P_MAX, nfull, cpt, nt)), bias_T, c0, nfull * cpt,
                               nt, cpt)
                if part:
                    _evict_out(n_ev + 1, outP[:, g0 + nfull, :, :part].permute((0, 2, 1)), pv[:, nfull * cpt:, :],
                               bias_T, c0 + nfull * cpt, part, nt)
            ps = None
        if packed:
            _store_packed(cfg, outP, out, t0, nt, cpt, rem)
            continue
        res = nl.ndarray((P_MAX, cfg.H), dtype=out.dtype, buffer=nl.sbuf)
        for c0 in range(hc0, hc1, TRANSPOSE_GROUP):
            nc = min(TRANSPOSE_GROUP, hc1 - c0)
            pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=out.dtype, buffer=nl.psum)
            for c in range(nc):
                nisa.nc_transpose(dst=pt[:nt, c, :], data=outT[:, c0 + c, :nt])
            evict((c0 - hc0) // TRANSPOSE_GROUP, res[:nt, c0 * P_MAX:(c0 + nc) * P_MAX].reshape((nt, nc, P_MAX)),
                   pt[:nt, :nc, :])
            pt = None
        nisa.dma_copy(dst=out[t0:t0 + nt, hc0 * P_MAX:hc1 * P_MAX], src=res[:nt, hc0 * P_MAX:hc1 * P_MAX])


def _evict_out(i, dst, src, bias_T, c0, n, nt, cpt=0):
    """out^T chunks [c0, c0 + n) from PSUM (src) to dst (+ the bias, a per-partition scalar of chunk c), viewed
    [128, n, nt], or [128, n / cpt, cpt, nt] when cpt > 0."""
    if bias_T is None:
        evict(i, dst, src)
        return
    b = bias_T[:, c0:c0 + n]
    b = b.expand_dim(2).broadcast(2, nt) if cpt == 0 else b.reshape((P_MAX, n // cpt, cpt)).expand_dim(3).broadcast(
        3, nt)
    nisa.tensor_tensor(dst=dst, data1=src, data2=b, op=nl.add)


def _store_packed(cfg, outP, out, t0, nt, cpt, rem):
    """Few tokens (nt <= 32): out^T held as outP [128 (H), group q, token t, chunk c of the group] (cpt <= 128 / nt
    chunks per group, groups from hc0, the last one holding rem chunks) goes back to [tokens, H] with ONE TensorE
    transpose per group: partition t * cpt + c of group q holds out[t, (hc0 + q * cpt + c) * 128 + p]. The
    transposes and evictions handle 128 rows instead of nt; per token one store of the whole groups and one of
    the partial group (disjoint rows, 256 B runs, spread over the DMA engines of cpt partitions each)."""
    hc0 = cfg.hc[0]
    H = cfg.H
    n_g, rows = outP.shape[1], cpt * nt
    res = nl.ndarray((P_MAX, n_g, P_MAX), dtype=out.dtype, buffer=nl.sbuf)
    for q0 in range(0, n_g, TRANSPOSE_GROUP):
        qn = min(TRANSPOSE_GROUP, n_g - q0)
        pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=out.dtype, buffer=nl.psum)
        for qi in range(qn):
            nisa.nc_transpose(dst=pt[:rows, qi, :], data=outP[:, q0 + qi, :, :].reshape((P_MAX, rows)))
        evict(q0 // TRANSPOSE_GROUP, res[:rows, q0:q0 + qn, :], pt[:rows, :qn, :])
        pt = None
    n_full = n_g if rem == cpt else n_g - 1
    for t in range(nt):
        base = (t0 + t) * H + hc0 * P_MAX
        if n_full:
            nisa.dma_copy(dst=out.ap([[P_MAX, cpt], [cpt * P_MAX, n_full], [1, P_MAX]], offset=base),
                          src=res[t * cpt:(t + 1) * cpt, :n_full, :])
        if n_full < n_g:
            nisa.dma_copy(dst=out.ap([[P_MAX, rem], [1, P_MAX]], offset=base + n_full * cpt * P_MAX),
                          src=res[t * cpt:t * cpt + rem, n_full, :])
