"""Attention output to the O-projection's layout (selection matmuls, LNC=2 o^T exchange) and the transposed
O-projection.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

from ...common.tiles import evict
from .config import BIAS_ROWS, P_MAX, PSUM_F, TRANSPOSE_GROUP, W_O_DMAS, X_ROW_S_MAX
from .planning import _oT_head_runs

# Token tiles of 33..64 rows are stored in this many column ranges, each once the O-projection has evicted it
# (_store_halves): the first ranges' stores overlap the last W_o loads instead of all following them (modelled trn2
# Llama-8B B=64 4K: 1 range 333.13 us, 2 332.43, 4 331.98, 8 331.95 with 512 B runs; 4 keeps >= 1 KiB runs).
STORE_RANGES = 4

# Innermost SBUF stride (bytes) up to which an engine / TensorE operand streams at full rate (nki-api.md §8.4)
SBUF_FAST_STRIDE_BYTES = 16


def _oT_token_major(cfg, n_k, itemsize):
    """Whether o^T is held token-major in SBUF ([128, tokens, K chunk], viewed [128, K chunk, tokens]): for the
    batch split's o^T exchange, whose per-partition runs are then a core's tokens x K chunks (contiguous) instead of
    one run of its tokens per K chunk (Llama-3.1-8B TP8 B=8: 8 B runs, 3 % DMA efficiency, 0.37 us on every DMA
    engine after the last W_o byte, modelled). Only while the O-projection's moving o^T (stride n_k elements) still
    streams at full rate. The batch split always takes the attention's direct o^T path (config._can_split_weights:
    d in 32 / 64 / 128, o^T in one PSUM bank), which allocates o^T in this layout (flash._attention_flash_decode)."""
    return cfg.wsplit and not cfg.split and not cfg.stride and n_k * itemsize <= SBUF_FAST_STRIDE_BYTES


def _exchange_oT(cfg, oT, b_lo, b_hi, per_core):
    """Split weights: o^T [128, K chunk, tokens] holds this core's sequences' columns; send them and receive the
    other core's (token ranges are static: core 0 has sequences [0, per_core), core 1 the rest). A token-major
    o^T (_oT_token_major) is exchanged in its memory order (whole runs of tokens x K chunks)."""
    S = cfg.S
    mine = (b_lo * S, b_hi * S)
    theirs = (per_core * S, cfg.B * S) if cfg.core == 0 else (0, per_core * S)
    if _oT_token_major(cfg, oT.shape[1], oT.dtype.itemsize):
        mem = oT.permute((0, 2, 1))       # [128, tokens, K chunk] in memory order
        nisa.sendrecv(src=mem[:, mine[0]:mine[1], :], dst=mem[:, theirs[0]:theirs[1], :], send_to_rank=1 - cfg.core,
                      recv_from_rank=1 - cfg.core, pipe_id=cfg.nkv + 1)
        return
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


def _sel_pairs(cfg, st, tile, p0, nb, n_k):
    """_Config.tail_halves (d = 64, S = 1, one KV head, the kernel's last pack in the full form): the PSUM columns
    [128, nb * G] after o^T's in the selection bank where _rows_to_oT writes, per batch j, all G heads at once:
    stationary = batch block j twice ([rows, 2, 64]: M = 128), moving = the G selection columns of its token, so
    column (j, h) holds head h on both partition halves; o^T takes the even heads' lower halves and the odd heads'
    upper halves (_copy_oT_pairs). One matmul per batch instead of one per batch and head parity (64-cycle
    minimum each). None where it does not apply."""
    if not (cfg.tail_halves and not st.pvt and 2 * cfg.d == P_MAX and cfg.S == 1 and cfg.nkv == 1 and cfg.group % 2 == 0
            and p0 + nb == tile.b0 + tile.nt and n_k * tile.nt + nb * cfg.group <= PSUM_F):
        return None
    c = n_k * tile.nt
    return st.ps_sel[:, c:c + nb * cfg.group]


def _copy_oT_pairs(cfg, oT, y, c0, nb):
    """o^T[:, :, c0:c0 + nb] from _sel_pairs' columns y [128, nb * G]: partitions 0..63 of chunk kk = head 2kk
    (column j * G + 2kk), 64..127 = head 2kk + 1; the two halves on VectorE and ScalarE at once."""
    half, G = P_MAX // 2, cfg.group
    y4 = y.reshape((P_MAX, nb, G // 2, 2))
    for u, eng in ((0, nisa.engine.vector), (1, nisa.engine.scalar)):
        nisa.tensor_copy(dst=oT[u * half:(u + 1) * half, :G // 2, c0:c0 + nb],
                         src=y4[u * half:(u + 1) * half, :, :, u].permute((0, 2, 1)), engine=eng)


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
                       on_true_tile=consts.ones[:rows, :c1 - c0].expand_dim(1).broadcast(1, G),
                       on_false_value=0.0, cmp_op=nl.equal, offset=0)
    # One matmul per o^T partition half u covers its heads (planning._oT_head_runs; moving stride dup heads).
    dup = P_MAX // d
    y = _sel_pairs(cfg, st, tile, p0, nb, n_k) if full else None
    if y is not None:
        for j in range(nb):
            nisa.nc_matmul(dst=y[:, j * G:(j + 1) * G],
                           stationary=o_rows[:rows, j * d:(j + 1) * d].expand_dim(1).broadcast(1, 2),
                           moving=sel[:rows, :, j], accumulate=False)
        return
    for u, h0, cnt, k0 in _oT_head_runs(cfg, g):
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


class _WoStream(nl.NKIObject):
    """W_o streamed (cfg.wo_chunk, config._weight_plan): a ring of cfg.wo_bufs buffers [128 (K rows), wo_chunk K
    chunks, this core's H columns], the K-chunk ranges of the stream, and its source."""

    def __init__(self, cfg, W_o):
        K = cfg.nq * cfg.d
        n_k = (K + P_MAX - 1) // P_MAX
        hc0, hc1 = cfg.hc
        self.src, self.K, self.hc0, self.hc1 = W_o, K, hc0, hc1
        self.ring = nl.ndarray((P_MAX, cfg.wo_bufs, cfg.wo_chunk, (hc1 - hc0) * P_MAX), dtype=W_o.dtype,
                               buffer=nl.sbuf)
        self.chunks = tuple((k0, min(k0 + cfg.wo_chunk, n_k)) for k0 in range(0, n_k, cfg.wo_chunk))


def _load_wo_chunk(ws, i):
    """The DMAs of W_o stream chunk i (one per 128-row K chunk: rows of this core's H columns, >= 4 KiB runs at the
    shapes that stream) into ring buffer i % bufs."""
    k0, k1 = ws.chunks[i]
    nbuf = ws.ring.shape[1]
    for k in range(k0, k1):
        kn = min(P_MAX, ws.K - k * P_MAX)
        nisa.dma_copy(dst=ws.ring[:kn, i % nbuf, k - k0, :],
                      src=ws.src[k * P_MAX:k * P_MAX + kn, ws.hc0 * P_MAX:ws.hc1 * P_MAX])


def _wo_pieces(cfg, W_o, tiles):
    """Column pieces [c0, c1) (128-column chunks) of this core's W_o, in load order.

    W_o arrives last: in column pieces (>= 3 KiB runs; shorter ones cost DMA efficiency: GPT-OSS's H = 3072 in two
    pieces, modelled trn2 B=64 4K -0.5 %, B=8 4K -0.3 %; with 4 KiB it was one), so the O-projection's first chunks
    start on the first pieces while the last one streams, instead of after the whole load. Issued column piece by
    column piece (all K chunks of a piece, then the next): an out^T chunk needs every K chunk, so the first half of
    the columns is computed once half of W_o has arrived, not 7/8 of it (K chunk outer).
    One token tile stored eviction by eviction (_early_store): two pieces, the last one half of the last eviction's
    columns (>= 1 KiB runs), so every other eviction is computed, stored or under way before W_o's last byte, and
    after it only that half's matmuls (modelled trn2 Llama-8B B=16 4K 110.51 -> 110.14 us, B=8 4K 71.17 -> 70.95)."""
    hc0, hc1 = cfg.hc
    if tiles is not None and len(tiles) == 1 and not cfg.wo_chunk and cfg.tail_halves:
        # _Config.tail_halves: the last piece is the last eviction group's columns, so after W_o's last byte only
        # that group's matmuls, eviction and store remain; before it the two halves' first half and the rest (one
        # piece of all of it: its longer transfers per DMA engine delay the last K/V loads; modelled GPT-OSS B=64
        # 16K 491.59 us)
        c0 = _eviction_groups(cfg, tiles[0].nt, split_last=True)[0][-1][0]
        mid = (hc0 + hc1) // 2
        if hc0 < mid < c0:
            return ((hc0, mid), (mid, c0), (c0, hc1))
    if tiles is not None and len(tiles) == 1 and not cfg.wo_chunk:
        packed, _cpt, ev = _out_groups(cfg, tiles[0].nt)
        last = ev // 2
        if _short_tail(cfg) and _early_store(cfg, packed, ev) and last * P_MAX * W_o.dtype.itemsize >= 1024:
            return ((hc0, hc1 - last), (hc1 - last, hc1))
    n_pc = max(1, min(W_O_DMAS, (hc1 - hc0) * P_MAX * W_o.dtype.itemsize // (3 * 1024)))
    return tuple((hc0 + i * (hc1 - hc0) // n_pc, hc0 + (i + 1) * (hc1 - hc0) // n_pc) for i in range(n_pc))


def _load_w_o(cfg, W_o, tiles=None):
    """W_o resident in SBUF as [128 (head, dim) rows, K chunk, this core's H columns]; one DMA per K chunk and
    column piece (_wo_pieces of the token tiles `tiles`; issued after the K/V loads, its arrival paces the
    O-projection, which therefore streams instead of running after the last load). Streamed (cfg.wo_chunk): a
    _WoStream whose first ring buffers' loads are issued here (they load under the attention); the O-projection
    issues the others as buffers free up."""
    if cfg.wo_chunk:
        ws = _WoStream(cfg, W_o)
        for i in range(min(cfg.wo_bufs, len(ws.chunks))):
            _load_wo_chunk(ws, i)
        return ws
    K = cfg.nq * cfg.d
    n_k = (K + P_MAX - 1) // P_MAX
    hc0, hc1 = cfg.hc                                  # this core's output chunks (all of H unless split)
    wo = nl.ndarray((P_MAX, n_k, (hc1 - hc0) * P_MAX), dtype=W_o.dtype, buffer=nl.sbuf)
    for c0, c1 in _wo_pieces(cfg, W_o, tiles):
        for k in range(n_k):
            kn = min(P_MAX, K - k * P_MAX)
            nisa.dma_copy(dst=wo[:kn, k, (c0 - hc0) * P_MAX:(c1 - hc0) * P_MAX],
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


def _out_groups(cfg, nt):
    """(packed, cpt, ev) of a token tile of nt tokens (see _OutLayout): whether out^T is held packed, chunks per
    packed group, out^T chunks per PSUM eviction."""
    hc0, hc1 = cfg.hc
    nr = hc1 - hc0
    per_bank = max(1, PSUM_F // P_MAX)                  # out^T chunks of [128, 128] fp32 per bank
    # chunks per packed group (<= 128 / tokens: whole banks, dividing the range when possible; otherwise the
    # last group is partial)
    cmax = P_MAX // nt // per_bank * per_bank
    if cfg.out_group_max:       # trn3 (_Config.out_group_max): smaller groups, a shorter tail after the last one
        cmax = min(cmax, cfg.out_group_max)
    cpt = cmax
    while cpt > 0 and nr % cpt != 0:
        cpt -= per_bank
    if cpt == 0 and cmax > 0:
        cpt = min(cmax, nr)
    # Chunks per eviction: a bank holds PSUM_F // nt chunks of [128, nt] (few tokens: many chunks per
    # eviction instead of one small eviction per 4 chunks, whose fixed costs paced the tail), but at most half
    # of the range, so two evictions alternate engines while TensorE works; packed: whole groups, and one group
    # per eviction where each eviction's groups are stored right after it (_early_store: d = 128 or 64; Llama-8B
    # B=16: 8 chunks instead of 16, so after W_o's last byte one group is evicted, transposed and stored, not two;
    # modelled trn2 B=16 4K 110.93 -> 110.51 us on its own, see _wo_pieces).
    ev = max(per_bank, min(PSUM_F // nt, (nr + 1) // 2))
    if cpt > 0:
        ev = cpt if _short_tail(cfg) and cpt < nr else max(cpt, ev // cpt * cpt)
    return cpt > 0, cpt, ev


# head dims whose packed token tiles store eviction by eviction (_early_store) and take the short tail (_short_tail)
TAIL_D = (P_MAX // 2, P_MAX)


def _short_tail(cfg):
    """d = 128 or 64, bf16 caches of <= X_ROW_S_MAX positions: one packed group per eviction and W_o's last piece
    half of the last eviction (_out_groups, _wo_pieces). Elsewhere (d = 128) they cost more than the shorter tail
    saves (modelled trn2: fp8 B=16 16K +0.6 %, fp8 paged B=16 4K +1.7 %, ragged B=16 (16K) +0.6 %, trn3 B=8 16K
    +0.3 %). d = 64 (GPT-OSS: 12 / 8 chunks per group at 8 / 16 tokens) gains on every row, trn3 too (modelled
    trn2 B=8 4K 49.83 -> 49.27 us, B=16 4K 54.61 -> 54.09; trn3 B=8 4K 40.78 -> 40.54)."""
    return cfg.d in TAIL_D and not cfg.fp8 and cfg.s_max <= X_ROW_S_MAX


def _early_store(cfg, packed, ev):
    """Whether a packed token tile of several evictions stores each eviction's groups right after it (d = 128 or 64;
    see _output_projection; d = 64 at any cache: modelled GPT-OSS B=16 16K trn2 144.89 -> 144.36 us, fp8 B=16 16K
    150.84 -> 150.32, every GPT-OSS row equal or faster)."""
    hc0, hc1 = cfg.hc
    return packed and ev < hc1 - hc0 and cfg.d in TAIL_D


class _OutLayout(nl.NKIObject):
    """How one token tile's out^T chunks are evicted and stored (see _output_projection): unpacked outT
    [128, H/128, tokens], or packed outP [128, group, token, chunk of the group] (cpt chunks per group, rem in the
    last), ev chunks per PSUM eviction (_out_groups)."""

    def __init__(self, cfg, nt, dtype, split_last=False):
        n_c = (cfg.H + P_MAX - 1) // P_MAX
        hc0, hc1 = cfg.hc                                        # this core's 128-column chunks of H
        self.outT = nl.ndarray((P_MAX, n_c, P_MAX), dtype=dtype, buffer=nl.sbuf)
        nr = hc1 - hc0
        packed, cpt, ev = _out_groups(cfg, nt)
        self.packed, self.cpt, self.outP, self.rem = packed, cpt, None, 0
        if self.packed:        # [128, group, token, chunk of the group] (groups relative to hc0): see _store_packed
            n_g = (nr + cpt - 1) // cpt
            self.rem = nr - (n_g - 1) * cpt
            self.outP = nl.ndarray((P_MAX, n_g, nt, cpt), dtype=dtype, buffer=nl.sbuf)
            if self.rem < cpt:     # the partial group's unused chunks: finite (they are transposed, never stored)
                nisa.memset(dst=self.outP[:, n_g - 1, :, self.rem:], value=0.0)
        self.ev = ev
        # Eviction groups (first chunk, chunks). split_last (bias_o in PSUM: the evictions are plain copies
        # alternating VectorE / ScalarE, _Config.bias_psum), unpacked: the last group is split in two, the second
        # at most half of it in whole banks, and the store ranges follow the groups when all hold an even chunk
        # count (_store_ranges), so what follows the last matmul is a smaller eviction and the last range alone
        # (modelled trn2 GPT-OSS B=64 16K 495.81 -> 495.23 us).
        self.groups, split = _eviction_groups(cfg, nt, split_last)
        self.ranges = None
        if split and all(k % 2 == 0 for _c, k in self.groups):
            self.ranges = tuple((c, c + k) for c, k in self.groups)


def _eviction_groups(cfg, nt, split_last=False):
    """(_OutLayout's eviction groups (first chunk, chunks) of a token tile of nt tokens, whether the last one was
    split (split_last: see there))."""
    hc0, hc1 = cfg.hc
    packed, _cpt, ev = _out_groups(cfg, nt)
    groups = [(c0, min(ev, hc1 - c0)) for c0 in range(hc0, hc1, ev)]
    per_bank = max(1, PSUM_F // P_MAX)                  # out^T chunks of [128, 128] fp32 per bank
    if not (split_last and not packed and groups[-1][1] >= 2 * per_bank):
        return groups, False
    c0, n = groups.pop()
    last = n // 2 // per_bank * per_bank
    return groups + [(c0, n - last), (c0 + n - last, last)], True


def _output_projection(cfg, consts, oTs, wo, bias_T, out, tiles, bias_row=None):
    """out[tokens, H] = o @ W_o (+ bias), computed transposed: out^T chunk c [128 (H), tokens] = sum over K chunks
    of matmul(stationary = W_o rows [K chunk, 128 H columns], moving = o^T [K chunk, tokens]) -- max(tokens, 64)
    cycles per matmul instead of 512 with W_o moving. The bias is a per-partition scalar of out^T (added by the
    eviction), or with bias_row (_Config.bias_psum: qkv._Inputs.bias_o_row) added in PSUM by a K = 1 matmul that
    opens each chunk's accumulation group (the evictions are then plain copies), then TensorE transposes bring
    [tokens, H] back for one contiguous store per token tile (few tokens: several chunks per transpose, see
    _store_packed). A streamed W_o (_WoStream): see _output_projection_streamed.
    """
    if cfg.wo_chunk:          # W_o streamed (wo is its _WoStream)
        _output_projection_streamed(cfg, oTs, wo, bias_T, out, tiles)
        return
    K = cfg.nq * cfg.d
    n_k = (K + P_MAX - 1) // P_MAX
    hc0, hc1 = cfg.hc                                        # this core's 128-column chunks of H
    for ti, tl in enumerate(tiles):
        t0, nt = tl.t0, tl.nt
        lay = _OutLayout(cfg, nt, out.dtype, split_last=bias_row is not None)
        # A packed tile of several evictions (d = 128 or 64): each eviction's groups are transposed and stored right
        # after it, under the next column piece's W_o transfer and matmuls, so after W_o's last byte only the last
        # eviction's groups are (modelled trn2 Llama-8B B=16 4K 112.67 -> 112.04 us, B=8 71.48 -> 71.17; DESIGN.md
        # "The Llama-8B 4K rows"; GPT-OSS with _short_tail: B=16 4K 54.61 -> 54.09, its LNC=2 / fp8 rows too).
        early = _early_store(cfg, lay.packed, lay.ev)
        for gi, (c0, ncb) in enumerate(lay.groups):
            ps = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
            pv = ps[:, :ncb * nt].reshape((P_MAX, ncb, nt))
            _accumulate_out_chunks(pv, c0, ncb, hc0, 0, n_k, K, oTs[ti], nt, wo, 0,
                                   None if bias_row is None else (bias_row, _bias_ones(consts, bias_row.dtype, nt)))
            _evict_group(cfg, lay, c0, ncb, nt, ps, bias_T, n_ev=gi)
            ps = None
            _store_evicted_ranges(cfg, lay, out, t0, nt, c0, ncb)
            if early:       # this eviction's whole groups (ev is a multiple of cpt), stored under the next ones
                _store_packed(cfg, lay.outP, out, t0, nt, lay.cpt, lay.rem, (c0 - hc0) // lay.cpt,
                              (c0 - hc0 + ncb + lay.cpt - 1) // lay.cpt)
        if not early:
            _store_tile(cfg, lay, out, t0, nt)


def _output_projection_streamed(cfg, oTs, ws, bias_T, out, tiles):
    """The O-projection with W_o streamed in 128-row K chunks (config._weight_plan): for each stream chunk (ring
    buffer i % bufs), every token tile's out^T groups accumulate that chunk's K rows in PSUM (one accumulation group
    per bank at a time, as resident), and the partial sums go to an fp32 SBUF accumulator per tile (the first chunk
    with the bias, the last one straight into the store layout: acc + PSUM). The next load into the buffer is
    issued after the chunk's matmuls (it waits for them), so the ring stays cfg.wo_bufs - 1 chunks ahead."""
    hc0, hc1 = ws.hc0, ws.hc1
    nr = hc1 - hc0
    lays = tuple(_OutLayout(cfg, tl.nt, out.dtype) for tl in tiles)
    n_s = len(ws.chunks)
    accs = ()
    if n_s > 1:
        accs = tuple(nl.ndarray((P_MAX, nr * tl.nt), dtype=nl.float32, buffer=nl.sbuf) for tl in tiles)
    nbuf = ws.ring.shape[1]
    n_ev = 0
    for i, (k0, k1) in enumerate(ws.chunks):
        for ti, tl in enumerate(tiles):
            nt, lay = tl.nt, lays[ti]
            for c0 in range(hc0, hc1, lay.ev):
                ncb = min(lay.ev, hc1 - c0)
                ps = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
                pv = ps[:, :ncb * nt].reshape((P_MAX, ncb, nt))
                _accumulate_out_chunks(pv, c0, ncb, hc0, k0, k1, ws.K, oTs[ti], nt, ws.ring[:, i % nbuf], k0)
                if i == n_s - 1:        # last chunk: into the store layout (the partial sums added)
                    _evict_group(cfg, lay, c0, ncb, nt, ps, bias_T if n_s == 1 else None,
                                 accs[ti] if n_s > 1 else None)
                    _store_evicted_ranges(cfg, lay, out, tl.t0, nt, c0, ncb)
                else:
                    a = accs[ti][:, (c0 - hc0) * nt:(c0 - hc0 + ncb) * nt].reshape((P_MAX, ncb, nt))
                    if i == 0:
                        _evict_out(n_ev, a, pv, bias_T, c0, ncb, nt)
                        n_ev += 1
                    else:
                        nisa.tensor_tensor(dst=a, data1=a, data2=pv, op=nl.add)
                ps = None
        if i + nbuf < n_s:
            _load_wo_chunk(ws, i + nbuf)
    for ti, tl in enumerate(tiles):
        _store_tile(cfg, lays[ti], out, tl.t0, tl.nt)


def _bias_ones(consts, dtype, nt):
    """The moving operands [1, nt] of ones on the partitions BIAS_ROWS (bias_o's chunks, qkv._load_small_inputs) of
    the K = 1 bias matmuls."""
    if dtype == nl.bfloat16:
        ones = consts.ones
    elif dtype == nl.float32:
        ones = consts.ones_f32
    else:
        ones = nl.ndarray((P_MAX, P_MAX), dtype=dtype, buffer=nl.sbuf)
        for p in BIAS_ROWS:
            nisa.memset(dst=ones[p:p + 1, :], value=1.0)
    return tuple(ones[p:p + 1, :nt] for p in BIAS_ROWS)


def _accumulate_out_chunks(pv, c0, ncb, hc0, k0, k1, K, oT, nt, w, kbase, bias=None):
    """out^T chunks [c0, c0 + ncb) of this core (pv [128, ncb, nt] in one PSUM bank, one accumulation group at a
    time) summed over the 128-row K chunks [k0, k1): stationary = the W_o rows of K chunk k held at w[:, k - kbase]
    (w: [128, K chunks, this core's H columns], resident W_o or one streamed ring buffer), the 128 columns of
    chunk c; moving = o^T [rows, nt]. bias (bias rows, their ones: _bias_ones): first a K = 1 matmul of chunk c's
    bias row (partition BIAS_ROWS[c % 2], column block c // 2) against ones, so the group holds out^T + bias; it
    waits for neither W_o nor o^T and runs whenever TensorE is free."""
    for c in range(c0, c0 + ncb):
        h0 = (c - hc0) * P_MAX
        if bias is not None:      # (bias rows, ones): chunk c's bias on partition BIAS_ROWS[c % 2]
            p, j = BIAS_ROWS[c % 2], c // 2
            nisa.nc_matmul(dst=pv[:, c - c0, :], stationary=bias[0][p:p + 1, j * P_MAX:(j + 1) * P_MAX],
                           moving=bias[1][c % 2], accumulate=False)
        for k in range(k0, k1):
            kn = min(P_MAX, K - k * P_MAX)
            nisa.nc_matmul(dst=pv[:, c - c0, :], stationary=w[:kn, k - kbase, h0:h0 + P_MAX], moving=oT[:kn, k, :nt],
                           accumulate=(k > k0 or bias is not None))


def _evict_group(cfg, lay, c0, ncb, nt, ps, bias_T, acc=None, n_ev=None):
    """out^T chunks [c0, c0 + ncb) from PSUM bank ps ([128, ncb * nt] used) into the tile's store layout (+ bias,
    or + the streamed O-projection's fp32 partial sums acc [128, (H/128 of this core) * nt], bias included)."""
    hc0 = cfg.hc[0]
    pv = ps[:, :ncb * nt].reshape((P_MAX, ncb, nt))
    n_ev = (c0 - hc0) // lay.ev if n_ev is None else n_ev

    def part_of(c, n, shape):
        return None if acc is None else acc[:, (c - hc0) * nt:(c - hc0 + n) * nt].reshape(shape)

    if not lay.packed:
        _evict_out(n_ev, lay.outT[:, c0:c0 + ncb, :nt], pv, bias_T, c0, ncb, nt,
                   acc=part_of(c0, ncb, (P_MAX, ncb, nt)))
        return
    # whole groups as [128, groups, chunk, token] views of both sides, then a partial group
    cpt = lay.cpt
    g0, nfull, part = (c0 - hc0) // cpt, ncb // cpt, ncb % cpt
    if nfull:
        _evict_out(n_ev, lay.outP[:, g0:g0 + nfull, :, :].permute((0, 1, 3, 2)),
                   ps[:, :nfull * cpt * nt].reshape((P_MAX, nfull, cpt, nt)), bias_T, c0, nfull * cpt, nt, cpt,
                   acc=part_of(c0, nfull * cpt, (P_MAX, nfull, cpt, nt)))
    if part:
        _evict_out(n_ev + 1, lay.outP[:, g0 + nfull, :, :part].permute((0, 2, 1)), pv[:, nfull * cpt:, :],
                   bias_T, c0 + nfull * cpt, part, nt, acc=part_of(c0 + nfull * cpt, part, (P_MAX, part, nt)))


def _store_ranges(cfg, lay):
    """The column ranges (out^T chunks of this core) _store_halves stores one at a time: the layout's eviction
    groups (_OutLayout.ranges), else STORE_RANGES equal ones."""
    if lay.ranges is not None:
        return lay.ranges
    hc0, hc1 = cfg.hc
    n_pc = STORE_RANGES
    return tuple((hc0 + i * (hc1 - hc0) // n_pc, hc0 + (i + 1) * (hc1 - hc0) // n_pc) for i in range(n_pc))


def _split_store(cfg, lay, nt):
    """Whether a token tile is stored by _store_halves (unpacked, 32 < nt <= 64, ranges of an even chunk count)."""
    return not lay.packed and 2 * nt <= P_MAX and all((hi - lo) % 2 == 0 for lo, hi in _store_ranges(cfg, lay))


def _store_evicted_ranges(cfg, lay, out, t0, nt, c0, ncb):
    """A tile stored a column range at a time (_split_store): the ranges that end in the out^T chunks [c0, c0 + ncb)
    just evicted into the store layout, stored now (under the remaining W_o loads and matmuls); every range ends in
    exactly one eviction group, so each is stored once. Both O-projection paths (resident and streamed W_o) call
    this after their final evictions, as _store_tile leaves such a tile to them."""
    if _split_store(cfg, lay, nt):
        for lo, hi in _store_ranges(cfg, lay):
            if c0 < hi <= c0 + ncb:
                _store_halves(cfg, lay, out, t0, nt, lo, hi)


def _store_tile(cfg, lay, out, t0, nt):
    """One token tile's out^T (lay) back to [tokens, H] rows of out: packed (_store_packed) or by TensorE transposes
    of 128-chunk groups and one contiguous store."""
    hc0, hc1 = cfg.hc
    if lay.packed:
        _store_packed(cfg, lay.outP, out, t0, nt, lay.cpt, lay.rem)
        return
    if _split_store(cfg, lay, nt):
        return      # stored by the O-projection, a column range at a time (_store_halves)
    res = nl.ndarray((P_MAX, cfg.H), dtype=out.dtype, buffer=nl.sbuf)
    for c0 in range(hc0, hc1, TRANSPOSE_GROUP):
        nc = min(TRANSPOSE_GROUP, hc1 - c0)
        pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=out.dtype, buffer=nl.psum)
        for c in range(nc):
            nisa.nc_transpose(dst=pt[:nt, c, :], data=lay.outT[:, c0 + c, :nt])
        evict((c0 - hc0) // TRANSPOSE_GROUP, res[:nt, c0 * P_MAX:(c0 + nc) * P_MAX].reshape((nt, nc, P_MAX)),
              pt[:nt, :nc, :])
        pt = None
    nisa.dma_copy(dst=out[t0:t0 + nt, hc0 * P_MAX:hc1 * P_MAX], src=res[:nt, hc0 * P_MAX:hc1 * P_MAX])


def _store_halves(cfg, lay, out, t0, nt, lo, hi):
    """_store_tile for 32 < nt <= 64 tokens, out^T chunks [lo, hi) (absolute, hi - lo even): each TensorE transpose
    takes chunks c and c + q of the range ([128, 2, nt], q = (hi - lo) / 2), so res partition h * nt + t holds token
    t's columns of half h of the range, stored as two DMAs from partitions 0..nt-1 and nt..2nt-1: twice the DMA
    engines of one store from nt partitions (8 of 16 at nt = 64), whose 512 KiB at B = 64 were the kernel's last
    ~4.3 us (modelled trn2 Llama-8B B=64 4K)."""
    q = (hi - lo) // 2
    n_c = lay.outT.shape[1]
    res = nl.ndarray((P_MAX, q * P_MAX), dtype=out.dtype, buffer=nl.sbuf)
    for c0 in range(0, q, TRANSPOSE_GROUP):
        nc = min(TRANSPOSE_GROUP, q - c0)
        pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=out.dtype, buffer=nl.psum)
        for c in range(nc):     # chunks lo + c0 + c and lo + q + c0 + c, each [128, nt]
            nisa.nc_transpose(dst=pt[:2 * nt, c, :], data=lay.outT.ap(
                [[n_c * P_MAX, P_MAX], [q * P_MAX, 2], [1, nt]], offset=(lo + c0 + c) * P_MAX))
        for e, (e0, e1) in enumerate(((0, nc // 2), (nc // 2, nc))):    # on VectorE and ScalarE at once
            if e1 > e0:
                evict(e, res[:2 * nt, (c0 + e0) * P_MAX:(c0 + e1) * P_MAX].reshape((2 * nt, e1 - e0, P_MAX)),
                      pt[:2 * nt, e0:e1, :])
        pt = None
        for h in range(2):
            a = (lo + h * q + c0) * P_MAX
            nisa.dma_copy(dst=out[t0:t0 + nt, a:a + nc * P_MAX],
                          src=res[h * nt:(h + 1) * nt, c0 * P_MAX:(c0 + nc) * P_MAX])


def _evict_out(i, dst, src, bias_T, c0, n, nt, cpt=0, acc=None):
    """out^T chunks [c0, c0 + n) from PSUM (src) to dst (+ the bias, a per-partition scalar of chunk c), viewed
    [128, n, nt], or [128, n / cpt, cpt, nt] when cpt > 0. acc (a streamed W_o's fp32 partial sums, same view as
    src, bias included): dst = src + acc instead."""
    if acc is not None:
        nisa.tensor_tensor(dst=dst, data1=src, data2=acc, op=nl.add)
        return
    if bias_T is None:
        evict(i, dst, src)
        return
    b = bias_T[:, c0:c0 + n]
    b = b.expand_dim(2).broadcast(2, nt) if cpt == 0 else b.reshape((P_MAX, n // cpt, cpt)).expand_dim(3).broadcast(
        3, nt)
    nisa.tensor_tensor(dst=dst, data1=src, data2=b, op=nl.add)


def _store_packed(cfg, outP, out, t0, nt, cpt, rem, qa=0, qb=None):
    """Few tokens (nt <= 32): out^T held as outP [128 (H), group q, token t, chunk c of the group] (cpt <= 128 / nt
    chunks per group, groups from hc0, the last one holding rem chunks) goes back to [tokens, H] with ONE TensorE
    transpose per group: partition t * cpt + c of group q holds out[t, (hc0 + q * cpt + c) * 128 + p]. The
    transposes and evictions handle 128 rows instead of nt; one store of every token's whole groups (256 B runs,
    spread over the DMA engines of the nt * cpt partitions) and per token one of the partial group.
    Groups [qa, qb) only (default: all): _output_projection stores the groups of an eviction right after it."""
    hc0 = cfg.hc[0]
    H = cfg.H
    n_g, rows = outP.shape[1], cpt * nt
    qb = n_g if qb is None else qb
    res = nl.ndarray((P_MAX, qb - qa, P_MAX), dtype=out.dtype, buffer=nl.sbuf)
    for q0 in range(qa, qb, TRANSPOSE_GROUP):
        qn = min(TRANSPOSE_GROUP, qb - q0)
        pt = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=out.dtype, buffer=nl.psum)
        for qi in range(qn):
            nisa.nc_transpose(dst=pt[:rows, qi, :], data=outP[:, q0 + qi, :, :].reshape((P_MAX, rows)))
        evict(q0 // TRANSPOSE_GROUP, res[:rows, q0 - qa:q0 - qa + qn, :], pt[:rows, :qn, :])
        pt = None
    n_full = (qb if rem == cpt or qb < n_g else n_g - 1) - qa
    if n_full:      # the whole groups of every token in one store (one DMA per engine: a token's cpt rows may
        # share an engine with the next token's, whose own store then queued behind; modelled GPT-OSS B=8 4K
        # 48.47 -> 48.38 us)
        nisa.dma_copy(dst=out.ap([[H, nt], [P_MAX, cpt], [cpt * P_MAX, n_full], [1, P_MAX]],
                                 offset=t0 * H + (hc0 + qa * cpt) * P_MAX),
                      src=res[:rows, :n_full, :])
    for t in range(nt):
        base = (t0 + t) * H + (hc0 + qa * cpt) * P_MAX
        if qa + n_full < qb:
            nisa.dma_copy(dst=out.ap([[P_MAX, rem], [1, P_MAX]], offset=base + n_full * cpt * P_MAX),
                          src=res[t * cpt:t * cpt + rem, n_full, :])
