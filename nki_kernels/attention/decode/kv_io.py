"""K/V cache I/O: contiguous, windowed, paged (block table) and fp8 slot loads, and the cache update.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

from ...common.tiles import run_gated as _run
from .config import P_MAX
from .planning import _packs, _plan, _slot_split, _v_parts


def _cast_pairs(cfg, kg, kT, w, nb, dtype, k, gates=None):
    """fp8 cache: K^T load groups kg [128, group, w] of fp8 pairs (2-byte elements; see _load_piece) -> the bf16
    stacks kT[:, 2 * group + half, :w] (half 0: the even dims, 1: the odd dims; see _Config.halves), one cast per
    group over all its batches. The cast is the one extra pass of the fp8 path (the DMA moves fp8 bytes only);
    GpSimd casts 16-bit lanes at twice its fp32 rate, ScalarE takes one group in four (k: the slot count; modelled
    trn2 GPT-OSS B=16 16K: one in three 168.6 us, one in two 170.4, all ScalarE 199.7, one in four 166.6).
    gates (ragged, see ragged._stack_gates): per group a runtime trip count, 0 when none of its sequences reaches
    the slot (its stacks are not read there)."""
    for jg in range((nb + cfg.kpp - 1) // cfg.kpp):
        kp = min(cfg.kpp, nb - jg * cfg.kpp) * cfg.kd
        pairs = kg[:kp, jg, :w].view(dtype).reshape((kp, w, 2)).permute((0, 2, 1))
        eng = nisa.engine.scalar if (k + jg) % 4 == 3 else nisa.engine.gpsimd
        _run(None if gates is None else gates[jg], lambda _i, kp=kp, jg=jg, pairs=pairs, eng=eng:
             nisa.tensor_copy(dst=kT[:kp, 2 * jg:2 * jg + 2, :w], src=pairs, engine=eng))


def _kt_cols(cfg, K_cache, b, g, a, size, scalar_offset=None):
    """K_cache_transposed ([B, nkv, d, S_max], bf16): the columns of positions [a, a + size) of (b, g), [d, size]
    (d partitions x size contiguous positions), as the K^T loads read them and the cache update writes them.
    scalar_offset: a register added to the positions (windowed scan, the new tokens' positions)."""
    s_max = cfg.s_max
    return K_cache.ap([[s_max, cfg.d], [1, size]], offset=(b * cfg.nkv + g) * cfg.d * s_max + a,
                      scalar_offset=scalar_offset, indirect_dim=3)


def _load_kT(cfg, K_cache, dst, b, g, a, size):
    """K^T of positions [a, a + size) of sequence b, KV head g -> dst [kd, size] (fp8: the 2-byte pairs, see
    _load_piece): a DMA transpose of the rows of the row-major cache, or (_Config.k_t) a plain copy of the
    transposed cache's columns into the same layout."""
    if cfg.k_t:
        nisa.dma_copy(dst=dst, src=_kt_cols(cfg, K_cache, b, g, a, size))
    else:
        rows = K_cache[b, g, a:a + size, :]
        nisa.dma_transpose(dst=dst, src=rows.view(nl.uint16) if cfg.fp8 else rows)


def _load_piece(cfg, K_cache, V_cache, kT, v, b, g, j, j0, w, a, size, lane=0, rot=False, parts="kv"):
    """Contiguous cache: K^T / V of positions [a, a + size) of the slot [j0, j0 + w) for batch j of the pack (the
    whole slot, or a piece of it: whole V partitions of the slot layout, or its remainder block). lane: the
    partition block of batch j's K^T in its stack, (j + lane) % kpp (see _Config.kt_alt). rot: batch j
    holds the slot rotated by half (planning._v_rotated: K^T column c / V partition q hold the plain layout's
    column (c + 64n) mod 128n / partition (q + 64) % 128; the remainder block is not rotated; with
    _Config.k_plain only V: the score matmuls read the plain K^T rotated).

    fp8 cache: K rows are read as 2-byte pairs [size, d / 2] (a DMA transpose moves 2-byte elements only), so
    kT (the load group tile, uint16) gets partition i <-> dims (2i, 2i + 1) of each position; _cast_pairs splits
    them into the even / odd stacks. V is cast to bf16 by its DMA (same layout as bf16).
    parts: "kv", or "k" / "v" for K^T / V alone (planning._whole_k)."""
    d, n = cfg.d, w // P_MAX
    u0, jj = ((j + lane) % cfg.kpp) * cfg.kd, j // cfg.kpp
    off = a - j0
    body = max(0, min(size, n * P_MAX - off))        # positions of the piece in the n-per-partition layout
    if "k" not in parts:
        pass
    elif rot and body and not cfg.k_plain:    # the body's columns in each half of the slot, each moved by half
        for p_s, p_e, p_d in _v_parts(off // n, (off + body) // n, rot):
            _load_kT(cfg, K_cache, kT[u0:u0 + cfg.kd, jj, p_d * n:p_e * n - p_s * n + p_d * n], b, g,
                     a + p_s * n - off, (p_e - p_s) * n)
        if size > body:
            _load_kT(cfg, K_cache, kT[u0:u0 + cfg.kd, jj, off + body:off + size], b, g, a + body, size - body)
    else:
        _load_kT(cfg, K_cache, kT[u0:u0 + cfg.kd, jj, off:off + size], b, g, a, size)
    if "v" not in parts:
        return
    if body:
        for p_s, p_e, p_d in _v_parts(off // n, (off + body) // n, rot):
            nisa.dma_copy(dst=v[p_d:p_d + p_e - p_s, j, :n, :],
                          src=V_cache[b, g, j0 + p_s * n:j0 + p_e * n, :].reshape((p_e - p_s, n * d)))
    rem = size - body
    if rem:
        nisa.dma_copy(dst=v[:rem, j, n, :], src=V_cache[b, g, a + body:a + size, :])


def _load_slot_window(cfg, start, K_cache, V_cache, kT, v, b, g, j0, w):
    """Contiguous cache, windowed scan: K^T / V of positions start + j0 .. start + j0 + w (start: a register).
    The windowed scan is whole 128-position tiles (scan_w, see _Config), so w = 128 * n."""
    d, s_max = cfg.d, cfg.s_max
    n = w // P_MAX
    base = ((b * cfg.nkv + g) * s_max + j0) * d
    kd, hv = cfg.kd, cfg.halves      # fp8: K rows as 2-byte pairs (see _load_piece)
    if cfg.k_t:     # the transposed cache's columns (see _load_kT)
        nisa.dma_copy(dst=kT, src=_kt_cols(cfg, K_cache, b, g, j0, w, scalar_offset=start))
    else:
        nisa.dma_transpose(dst=kT, src=K_cache.ap([[kd, w], [1, kd]], offset=base // hv, scalar_offset=start,
                                                  indirect_dim=2, dtype=nl.uint16 if cfg.fp8 else None))
    nisa.dma_copy(dst=v[:, :n, :], src=V_cache.ap([[n * d, P_MAX], [1, n * d]], offset=base, scalar_offset=start,
                                                 indirect_dim=2))


def _start_rows(cfg, p_first, rows, cols=1):
    """fp32 [rows, cols]: first scanned position of each sequence (windowed scan; see _Config), elementwise from
    its first new position p_first [rows, cols]."""
    x = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=x[:rows], data=p_first[:rows, :cols], op0=nl.add, operand0=1.0 - cfg.window,
                       op1=nl.maximum, operand1=0.0)
    if cfg.paged:
        m = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=m[:rows], data=x[:rows], op0=nl.mod, operand0=float(cfg.unit))
        x2 = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=x2[:rows], data1=x[:rows], data2=m[:rows], op=nl.subtract)
        x = x2
    out = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=out[:rows], data=x[:rows], op0=nl.minimum, operand0=float(cfg.cap - cfg.scan))
    return out


def _window_starts(cfg, position_ids, b_lo, b_hi):
    """Windowed scan: a register per sequence b with its first scanned position (paged: block), keyed b."""
    regs = {}
    if not cfg.dyn:
        return regs
    nbat = b_hi - b_lo
    p_i = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=p_i[:nbat], src=position_ids.ap([[cfg.S, nbat], [1, 1]], offset=b_lo * cfg.S))
    p_f = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=p_f[:nbat], src=p_i[:nbat])
    st = _start_rows(cfg, p_f, nbat)
    s_i = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=s_i[:nbat], data=st[:nbat], op0=nl.multiply, operand0=1.0 / cfg.bs if cfg.paged else 1.0)
    for j in range(nbat):
        r = nisa.register_alloc()
        nisa.register_load(dst=r, src=s_i[j:j + 1, 0:1])
        regs[b_lo + j] = r
    return regs


def _load_block_ids(cfg, block_table, b_lo, b_hi, starts=None):
    """Paged cache: SBUF tiles of block ids (uint32, one per partition: the gathers' vector offsets) for every
    (pack, slot) of the scan, keyed (first batch, slot start). Issued at the start of the kernel: the partition
    dim of these tiles walks block_table with 4-byte runs (slow DMAs), which then hide under the weight loads."""
    ids = {}
    if not cfg.paged:
        return ids
    slots, _steps = _plan(cfg)
    subs = {}
    for p0, nb in _packs(cfg, b_lo, b_hi):
        for j0, w in slots:
            b0, n, K = j0 // cfg.bs, w // P_MAX, _slot_split(cfg, w)
            # [t, batch, gather]: block b0 + t*ns + i (K = 1) or gathered row t = block b0 + t // sub, part t % sub
            ns = n // cfg.bs if K == 1 else 1
            t_n = P_MAX if K == 1 else P_MAX // K
            sub = 1 if K == 1 else cfg.bs // (K * n)      # gathered rows per block (> 1: sub-blocks)
            pat = [[ns, t_n]] if sub == 1 else [[1, t_n // sub], [0, sub]]    # each block id repeated sub times
            idx = nl.ndarray((P_MAX, cfg.pack, ns), dtype=nl.uint32, buffer=nl.sbuf)
            if cfg.dyn:
                for j in range(nb):
                    nisa.dma_copy(dst=idx[:t_n, j, :], src=block_table.ap(
                        pat + [[1, ns]], offset=(p0 + j) * cfg.mb + b0, scalar_offset=starts[p0 + j],
                        indirect_dim=1, dtype=nl.uint32))
            else:
                nisa.dma_copy(dst=idx[:t_n, :nb, :], src=block_table.ap(pat + [[cfg.mb, nb], [1, ns]],
                                                                        offset=p0 * cfg.mb + b0, dtype=nl.uint32))
            if sub > 1:
                # sub-block row id (rows of m = K * n positions of the cache): block * nkv * sub + part; the head's
                # part g * sub is the gathers' static offset. fp32 arithmetic is exact (< MAX_CACHE_ROWS).
                if sub not in subs:
                    q = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.iota(dst=q, pattern=[[0, 1]], offset=0, channel_multiplier=1)
                    part = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=part, data=q, op0=nl.mod, operand0=float(sub))
                    subs[sub] = part
                nisa.tensor_scalar(dst=idx[:t_n, :nb, 0], data=idx[:t_n, :nb, 0], op0=nl.multiply,
                                   operand0=float(cfg.nkv * sub), op1=nl.add, operand1=subs[sub][:t_n])
            ids[(p0, j0)] = idx
    return ids


def _load_slot_paged(cfg, st, K_cache, V_cache, kT, v, g, p0, nb, j0, w, gates, lane=0):
    """K^T / V of scan positions [j0, j0 + w) for every batch of the pack from a paged cache (indirect DMAs).

    K^T lands in the natural order of a DMA transpose (one contiguous range per partition), "i-major":
      K = 1: column i*128 + q holds position q*n + i;  K > 1: column r*n*T + i*T + t holds row r*n + i of block t.
    V: partition q' (q' = q, or r*T + t) holds the same positions, block i of the slot. The steps use the matching
    i-major score layout (see _plan), so score chunks read contiguous K^T columns and P^T blocks are contiguous.
      n >= bs: n/bs indirect gathers of 128 blocks each (block q*(n/bs) + i' on partition q);
      n < bs <= w: R = 128 / K gathered rows of m = K*n positions (whole blocks, or sub-blocks so that R >= 16, see
      _slot_split): K^T by one 3-D transpose [R, K*n, d] -> [d, K*n, R]; V by K gathers of R partitions.
    (w >= bs always: see _slot_bounds.)
    """
    n = w // P_MAX
    row = cfg.nkv * cfg.bs * cfg.d               # elements per block of the cache (the indexed rows)
    idx = st.block_ids[(p0, j0)]
    K = _slot_split(cfg, w)
    off = g * cfg.bs * cfg.d
    for j in range(nb):     # a sequence's gathers stop at its length (ragged contexts)
        _run(gates[j], lambda _i, j=j: _gather_batch(cfg, K_cache, V_cache, kT, v, idx, K, off, row, j, n, w,
                                                     lane))


def _gather_batch(cfg, K_cache, V_cache, kT, v, idx, K, off, row, j, n, w, lane=0):
    """The paged gathers of batch j of the pack for one slot (see _load_slot_paged). fp8 cache: the K rows are
    gathered as 2-byte pairs (`.ap(dtype=uint16)`, every K element count halved: the indirect transpose takes
    2-byte data only) into the load group tile, as in _load_piece; V is cast to bf16 by its gathers."""
    d, bs, hv = cfg.d, cfg.bs, cfg.halves
    kd = cfg.kd                                  # K elements per position in the gathers (d, or d / 2 pairs)
    swdge = nisa.dge_mode.swdge
    kdt = nl.uint16 if cfg.fp8 else None
    u0, jj = ((j + lane) % cfg.kpp) * kd, j // cfg.kpp     # lane: see _load_piece
    if K == 1:
        for i in range(n // bs):
            vo = idx[:, j, i]
            nisa.dma_transpose(dst=kT[u0:u0 + kd, jj, i * bs * P_MAX:(i + 1) * bs * P_MAX].reshape((kd, bs, P_MAX)),
                               src=K_cache.ap([[row // hv, P_MAX], [kd, bs], [1, kd]], offset=off // hv,
                                              vector_offset=vo, dtype=kdt),
                               dge_mode=swdge)
            nisa.dma_copy(dst=v[:, j, i * bs:(i + 1) * bs, :],
                          src=V_cache.ap([[row, P_MAX], [1, bs * d]], offset=off, vector_offset=vo),
                          dge_mode=swdge)
    else:
        T, m = P_MAX // K, K * n                 # gathered rows of m positions (see _slot_split)
        kc, vc, rm = K_cache, V_cache, row
        if m < bs:      # sub-blocks: the indexed rows are m positions of one head (ids from _load_block_ids)
            nsub = K_cache.shape[0] * cfg.nkv * (bs // m)
            kc, vc, rm = K_cache.reshape((nsub, m * d)), V_cache.reshape((nsub, m * d)), m * d
        vo = idx[:T, j, 0]
        # (K, n) merged into one level (stride d): a 4-D indirect transpose needs src.shape[1] or [2] == 1
        nisa.dma_transpose(dst=kT[u0:u0 + kd, jj, :w].reshape((kd, K * n, T)),
                           src=kc.ap([[rm // hv, T], [kd, K * n], [1, kd]], offset=off // hv, vector_offset=vo,
                                     dtype=kdt),
                           dge_mode=swdge)
        for r in range(K):
            nisa.dma_copy(dst=v[r * T:(r + 1) * T, j, :n, :],
                          src=vc.ap([[rm, T], [1, n * d]], offset=off + r * n * d, vector_offset=vo),
                          dge_mode=swdge)


def _paged_rows(cfg, position_ids, block_table, tiles):
    """Paged cache: per new token, a register with its cache row block_table[b, p // bs] * nkv * bs + p % bs
    (rows of [num_blocks * nkv * block_size, d]; + g * bs for KV head g). Issued early (tiny DMAs, off the
    critical path); the stores that use the registers come last. Returns per token tile a tuple of registers."""
    if not cfg.paged:
        return ()
    bs, S = cfg.bs, cfg.S
    pos2 = position_ids.reshape((cfg.B * cfg.S, 1))
    out = []
    for tl in tiles:
        t0, nt = tl.t0, tl.nt
        p_i = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=p_i[:nt], src=pos2[t0:t0 + nt, :])
        p_f = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=p_f[:nt], src=p_i[:nt])
        off = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)          # p % bs
        nisa.tensor_scalar(dst=off[:nt], data=p_f[:nt], op0=nl.mod, operand0=float(bs))
        col = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)            # p // bs (exact: bs = 2^k)
        nisa.tensor_scalar(dst=col[:nt], data=p_f[:nt], op0=nl.subtract, operand0=off[:nt], op1=nl.multiply,
                           operand1=1.0 / bs)
        blk = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)
        for t in range(nt):
            r = nisa.register_alloc()
            nisa.register_load(dst=r, src=col[t:t + 1, 0:1])
            nisa.dma_copy(dst=blk[t:t + 1, 0:1], src=block_table[(t0 + t) // S:(t0 + t) // S + 1, nl.ds(r, 1)])
        blk_f = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=blk_f[:nt], src=blk[:nt])
        lin = nl.ndarray((P_MAX, 1), dtype=nl.int32, buffer=nl.sbuf)            # blk * nkv * bs + p % bs
        nisa.scalar_tensor_tensor(dst=lin[:nt], data=blk_f[:nt], op0=nl.multiply, operand0=float(cfg.nkv * bs),
                                  op1=nl.add, operand1=off[:nt])
        regs = []
        for t in range(nt):
            r = nisa.register_alloc()
            nisa.register_load(dst=r, src=lin[t:t + 1, 0:1])
            regs.append(r)
        out.append(tuple(regs))
    return tuple(out)


def _load_positions(cfg, position_ids):
    """position_ids in SBUF [1, B * S] with one DMA at kernel start: a register load from HBM is a whole DMA on the
    sync engine (~1.3 us each, serial: 64 sequences cost 83 us at the tail), from SBUF one access."""
    pos = nl.ndarray((1, cfg.B * cfg.S), dtype=position_ids.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=pos, src=position_ids.reshape((1, cfg.B * cfg.S)))
    return pos


def _update_cache(cfg, qkv, K_cache, V_cache, pos, tiles, rows=(), qkT=None):
    """K/V rows of the new tokens -> cache[b, g, pos[b, 0] : pos[b, 0] + S] (dynamic start from a register); paged:
    one row per token, K_cache[rows[t] + g * bs] of the [num_blocks * nkv * bs, d] row view (see _paged_rows).
    pos: position_ids in SBUF (_load_positions). K_cache_transposed (_Config.k_t): the new tokens' K^T from qkT
    (qkv._transpose_qk: d partitions) -> K_cache[b, g, :, pos : pos + S], d
    partitions of S positions each (from qkv's rows every element would be its own 2-byte HBM run, ~1.5 us per
    (sequence, head) on one DMA ring, modelled).

    Issued after every cache read in program order (the attention used the new tokens from SBUF)."""
    d, nq, nkv, S = cfg.d, cfg.nq, cfg.nkv, cfg.S
    if cfg.paged:
        for ti, tl in enumerate(tiles):
            nt = tl.nt
            for t in range(nt):
                for g in range(nkv):
                    kc, vc = cfg.pad + (nq + g) * d, cfg.pad + (nq + nkv + g) * d
                    for cache, c in ((K_cache, kc), (V_cache, vc)):
                        nisa.dma_copy(dst=cache.ap([[d, 1], [1, d]], offset=g * cfg.bs * d, scalar_offset=rows[ti][t],
                                                   indirect_dim=2), src=qkv[ti][t:t + 1, c:c + d])
        return
    for ti, tl in enumerate(tiles):
        tb0, nb = tl.b0, tl.nb
        for bl in range(nb):
            b = tb0 + bl
            start = nisa.register_alloc()
            nisa.register_load(dst=start, src=pos[0:1, b * S:b * S + 1])
            r0 = bl * S
            for g in range(nkv):
                kc, vc = cfg.pad + (nq + g) * d, cfg.pad + (nq + nkv + g) * d
                if cfg.k_t:     # K_cache [B, nkv, d, S_max]: the S new columns (see above)
                    t0 = tl.t0 + r0 - tiles[0].t0
                    nisa.dma_copy(dst=_kt_cols(cfg, K_cache, b, g, 0, S, scalar_offset=start),
                                  src=qkT[0:d, 0, t0:t0 + S, nq + g, 0])
                else:
                    nisa.dma_copy(dst=K_cache[b, g, nl.ds(start, S), :], src=qkv[ti][r0:r0 + S, kc:kc + d])
                nisa.dma_copy(dst=V_cache[b, g, nl.ds(start, S), :], src=qkv[ti][r0:r0 + S, vc:vc + d])
