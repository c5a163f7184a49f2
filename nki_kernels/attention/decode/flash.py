"""Flash-decoding over the cache: attention state, batch packs, the active step, software-pipelined steps, online
softmax.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

from ...common.tiles import run_gated as _run
from .common import _registers
from .config import (
    FA_SUB,
    K1_PREFIX,
    MASK_NEG,
    MAX_S_TKG,
    P_MAX,
    PAIR_BUFS,
    PMAJOR_ROWS,
    PSUM_F,
    PV_COLS,
    TRANSPOSE_GROUP,
)
from .isolation import _scrub_slot, _scrub_v, _valid_ranges
from .kv_io import _cast_pairs, _load_piece, _load_slot_paged, _load_slot_window, _start_rows
from .oproj import _copy_oT_pairs, _load_w_o, _oT_token_major, _rows_to_oT, _rows_to_tokens, _sel_pairs, _transpose_o
from .planning import (
    _kt_width,
    _load_pieces,
    _oT_head_runs,
    _packs,
    _pair_k,
    _piece_thresholds,
    _plan,
    _rot_batch,
    _slot_split,
    _v_rotated,
    _whole_k,
)
from .ragged import _load_gates, _pv_group, _stack_gates, _step_gates


class _AttnState(nl.NKIObject):
    """Buffers shared by every pack and step of the attention, multi-buffered explicitly (the cost model and the
    hardware both serialise on reuse): 2 score tiles of FA_SUB fp32 (4 PSUM banks), the PV output (2 banks), one
    transpose bank, one selection bank; KV_BUFS K/V load slots; 2 masked-query stationaries."""

    def __init__(self, cfg, dtype, qm):
        d, pack = cfg.d, cfg.pack
        self.ps_sc = tuple(nl.ndarray((P_MAX, FA_SUB), dtype=nl.float32, buffer=nl.psum) for _ in range(2))
        self.ps_o = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.psum)
        self.ps_t = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=dtype, buffer=nl.psum)
        self.ps_sel = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.psum)
        # K^T slots: bf16 stacks [128, stack, w]; fp8 cache whose dtype the matmul takes (fp8_mm): the fp8 pairs
        # of each load group as loaded (2-byte elements, see _load_piece), read by the score matmuls (_kview); each
        # stack as wide as the plan's widest slot (_kt_width: one-step slots only pack the stacks, see _pair_k)
        ktw = _kt_width(cfg, _plan(cfg)[0])
        kt_shape, kt_dtype = ((P_MAX, cfg.ngroups, ktw), nl.uint16) if cfg.fp8_mm else ((P_MAX, cfg.nst, ktw), dtype)
        self.kT = tuple(nl.ndarray(kt_shape, dtype=kt_dtype, buffer=nl.sbuf) for _ in range(cfg.kv_bufs))
        self.v = tuple(nl.ndarray((P_MAX, pack, cfg.fa_tile // P_MAX + 1, d), dtype=dtype, buffer=nl.sbuf)
                       for _ in range(cfg.kv_bufs))
        # fp8 cache cast to bf16: the K^T load groups as loaded, fp8 pairs (dims 2i, 2i + 1) in 2-byte elements,
        # scrubbed, then cast into the even / odd stacks of kT (_cast_pairs); otherwise the loads write kT directly
        self.kg = tuple(nl.ndarray((P_MAX, cfg.ngroups, ktw), dtype=nl.uint16, buffer=nl.sbuf)
                        for _ in range(PAIR_BUFS)) if cfg.fp8 and not cfg.fp8_mm else self.kT
        self.qm = qm
        self.qm_sw_bufs, self.qm_sw = (None, None), None   # _Config.kt_swap: swapped-half queries (this pack's)
        self.kt_lanes = _kt_lanes(cfg)     # per ring buffer: K^T on the stack's first or second half
        # per K^T load buffer (kg) and per V buffer: [positions scrubbed or loaded in every lane so far, (pack p0,
        # j0, w) of its last partial scrub (ragged, per-group gates: the lanes of the load groups reaching j0 are
        # finite up to w) or None]; see _ring_mode
        self.ring_k = [[0, None] for _ in self.kg]
        self.ring_v = [[0, None] for _ in self.v]
        self.n_scores, self.n_slots, self.n_packs = 0, 0, 0
        self.last_pack = True       # the pack being attended is the kernel's last (set per pack)
        self.block_ids, self.starts = None, None
        self.iotas = {}
        self.pre, self.cur_valid = {}, None       # per pack: _PackInputs; the current pack's _ValidRange
        self.ramps, self.k_ramp = {}, (None, None)  # scrub position tables (see _scrub_slot)
        self.pos0, self.slot0 = None, None          # fp32 [1, steps / slots]: their starts (_step_gates)
        self.pos0_run = None    # pos0 with step 0's start as -1 (it always runs), when > 0 (ragged._step_gates)
        self.k1_thr = self.k1_flags = None    # _Config.k1_prefixes: ragged._k1_prefix_gates' tables (built once)
        self.pf_cols = None     # position-major: fp32 [128, rows] first new position of each row, every partition
        self.rot_tabs = None    # _Config.v_rot: constant tables of _rot_thresholds (built once)
        self.pvt = False        # _Config.pv_t in use (every pack the full form, whole batch pairs): acc^T layout
        self.consts = None      # with pvt: the constants (identity, ones) of the alpha / 1/l broadcasts
        self.bc_dve = False     # _Config.last_half, the last two steps: their alpha broadcasts copied on VectorE

    def iota_pm(self, n, ni):
        """Position-major steps: fp32 [128, ni] key offsets q*n + il of score tile il on partition q (relative to
        the step's first position), built once per slot layout."""
        key = f"t{n}_{ni}"
        if key not in self.iotas:
            t = nl.ndarray((P_MAX, ni), dtype=nl.float32, buffer=nl.sbuf)
            nisa.iota(dst=t, pattern=[[1, ni]], offset=0, channel_multiplier=n)
            self.iotas[key] = t
        return self.iotas[key]

    def scores(self):
        buf = self.ps_sc[self.n_scores % 2]
        self.n_scores += 1
        return buf

    def iota(self, key, pattern, cols, dtype=nl.float32):
        """Constant [128, cols] key offsets (same on every partition), built once per layout and dtype (int16 for
        the cache steps' masks: see _step_thresholds)."""
        key = f"{key}_{dtype}"
        if key not in self.iotas:
            t = nl.ndarray((P_MAX, FA_SUB), dtype=dtype, buffer=nl.sbuf)
            nisa.iota(dst=t[:, :cols], pattern=pattern, offset=0, channel_multiplier=0)
            self.iotas[key] = t
        return self.iotas[key]


class _Softmax(nl.NKIObject):
    """Running statistics of one pack: max m, sum l (fp32 [rows, 1]) and the PV accumulator (fp32 [rows, nb*d])."""

    def __init__(self):
        self.m, self.l, self.acc, self.pending = None, None, None, None
        self.fin_gates = None   # ragged, per PV group: 1 iff its PV of the last step run is pending
        self.alt, self.alt_prev, self.alt_n = None, None, 0     # _Config.tail_halves: _alpha_bufs


class _PackInputs(nl.NKIObject):
    """Position-derived tables of one batch pack (fp32): each row's first new position (p_first [rows, 1]) and own
    position (q_pos), p_first per column on every partition (pf_cols [128, rows], position-major steps), the
    sequences' valid ranges (isolation) and the sink logits of each KV head's rows (sinks[g] [rows, 1])."""

    def __init__(self, cfg, position_ids, sinks, p0, nb, tables=None):
        S, G = cfg.S, cfg.group
        rows = nb * cfg.R
        self.p_first = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        self.valid = None
        if tables is not None:      # _Config.pack_tables: selected out of the core's _PackTables on chip
            self.valid = _valid_ranges(cfg, position_ids, p0, nb, tables)
            _own_position(cfg, self.p_first, tables.pos, p0 - tables.b0, nb)
        else:
            nisa.dma_copy(dst=self.p_first[:rows], src=position_ids.ap([[S, nb], [0, S], [0, G]], offset=p0 * S))
        self.pf_cols = None
        if cfg.pmajor:
            self.pf_cols = nl.ndarray((P_MAX, PMAJOR_ROWS), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=self.pf_cols[:, :rows].reshape((P_MAX, nb, S, G)),
                          src=position_ids.ap([[0, P_MAX], [S, nb], [0, S], [0, G]], offset=p0 * S))
        self.q_pos = self.p_first
        if S > 1 or cfg.window > 0:
            self.q_pos = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=self.q_pos[:rows], src=position_ids.ap([[S, nb], [1, S], [0, G]], offset=p0 * S))
        if tables is None:
            self.valid = _valid_ranges(cfg, position_ids, p0, nb)
        self.sinks = tables.sinks if tables is not None else _sink_rows(cfg, sinks, nb)


class _PackTables(nl.NKIObject):
    """_Config.pack_tables: the tables every pack of this core [b_lo, b_hi) shares, each loaded once instead of one
    DMA per pack (runs of 4 * pack bytes: ~0.1 us of every DMA engine each, modelled, which the K/V stream queued
    behind): pos [128, batches] fp32, each batch's first new position on every partition (batch b in column b - b0;
    one DMA of 4 * batches-byte runs at S = 1), and the sink rows of a pack of nb_max batches (_sink_rows)."""

    def __init__(self, cfg, position_ids, sinks, b_lo, b_hi, nb_max):
        self.b0 = b_lo
        self.pos = nl.ndarray((P_MAX, b_hi - b_lo), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=self.pos, src=position_ids.ap([[0, P_MAX], [cfg.S, b_hi - b_lo]], offset=b_lo * cfg.S))
        self.sinks = _sink_rows(cfg, sinks, nb_max)


def _own_position(cfg, dst, pos_all, c0, nb):
    """dst[r] = pos_all[r, c0 + r // R] (fp32 [rows, 1]): each attention row's first new position, selected on chip
    out of the batches' positions on every partition (_PackTables.pos) instead of a DMA of 4-byte runs per pack
    (~0.09 us of each of the 8 DMA engines of partitions 0..63, modelled). Exact: one position kept per row, zeros
    added."""
    rows = nb * cfg.R
    lo = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)     # r >= R * j
    nisa.affine_select(dst=lo[:rows, :nb], pattern=[[-cfg.R, nb]], channel_multiplier=1,
                       on_true_tile=pos_all[:rows, c0:c0 + nb], on_false_value=0.0, cmp_op=nl.greater_equal)
    own = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)    # and r < R * (j + 1)
    nisa.affine_select(dst=own[:rows, :nb], pattern=[[-cfg.R, nb]], channel_multiplier=1, on_true_tile=lo[:rows, :nb],
                       on_false_value=0.0, cmp_op=nl.less, offset=-cfg.R)
    nisa.tensor_reduce(dst=dst[:rows], op=nl.add, data=own[:rows, :nb], axis=(1,))


def _sink_rows(cfg, sinks, nb):
    """Each KV head's sink logits per attention row of a pack of nb batches (fp32 [rows, 1] per head): the same for
    every pack (row (batch, token, head) <- sinks[g * G + head]), so loaded once for all of them. Each of these 4-byte
    run DMAs cost the 8 DMA engines of partitions 0..63 ~0.09 us (modelled), which the K/V stream then waits for."""
    if sinks is None:
        return ()
    S, G = cfg.S, cfg.group
    sk = []
    for g in range(cfg.nkv):
        t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:nb * cfg.R], src=sinks.ap([[0, nb], [0, S], [1, G]], offset=g * G))
        sk.append(t)
    return tuple(sk)


def _prefetch_packs(cfg, position_ids, sinks, b_lo, b_hi):
    """_PackInputs of every pack of this core, keyed by its first batch. Called before the weights are loaded: the
    DMA engines serve transfers in program order, so these small loads (and the K/V loads' runtime gates computed
    from them) would otherwise wait behind W_qkv, and the cache stream would start late (B = 1: ~2 us)."""
    packs = _packs(cfg, b_lo, b_hi)
    tables = None
    if cfg.pack_tables:
        tables = _PackTables(cfg, position_ids, sinks, b_lo, b_hi, max(pk.nb for pk in packs))
    return {pk.p0: _PackInputs(cfg, position_ids, sinks, pk.p0, pk.nb, tables) for pk in packs}


def _attention_flash_decode(cfg, consts, qkT, qkv, K_cache, V_cache, position_ids, sinks, tiles, b_lo, b_hi, W_o,
                            block_ids=None, starts=None, pre=None):
    """Flash-decoding for every (KV head, batch pack); returns (oT[tile] = [128 (head, dim), K chunk, tokens] bf16,
    the O-projection's stationaries, and the resident W_o).

    Packs are balanced (ceil(batches / packs) each). W_o's load is issued after every K/V load (the K/V ring has
    enough slots that it does not stall the DMA queue on compute, so W_o only has to arrive before the O-projection).
    pre: the packs' _PackInputs (_prefetch_packs, issued before the weights); loaded here when None.
    """
    if pre is None:
        pre = _prefetch_packs(cfg, position_ids, sinks, b_lo, b_hi)
    st = _AttnState(cfg, qkT.dtype, consts.qm)
    st.qm_sw_bufs = consts.qm_sw
    st.pre = pre
    st.block_ids, st.starts = block_ids, starts
    n_k = (cfg.nq * cfg.d + P_MAX - 1) // P_MAX
    # Direct o^T (one token tile, heads on legal partition starts, all of o^T in one PSUM bank): the selection
    # matmuls write o^T straight into the selection bank (every element exactly once), one eviction at the end.
    # The last pack ends in the "full" form (_normalise_full): the selection matmuls also pick each row's own batch
    # block (one small matmul per batch), no block mask and block reduction over the pack's nb * d accumulator
    # columns on VectorE (two passes, one strided: ~1.9 us per pack for Llama-8B packs of 4). On NeuronCore-v4,
    # where VectorE is the busy engine of B >= 8, every pack does (modelled trn3 B=16 4K GPT-OSS -2.6 %, Llama-8B
    # -3.6 %). On trn2 it changes latencies by -6 .. +0.2 % but the DMA-paced GPT-OSS B=64 4K row keeps its latency
    # while its issued-work bound (the VectorE roof) falls 169 -> 158 us, x1.12 -> x1.18 of it: see DESIGN.md.
    direct = len(tiles) == 1 and cfg.d in (32, 64, 128) and n_k * tiles[0].nt <= PSUM_F
    full_all = direct and not cfg.stride and nisa.get_nc_version() >= nisa.nc_version.gen4
    bmask = None
    if not full_all:      # bmask[r, j] = 1.0 iff row r belongs to the pack's batch j (j*R <= r < (j+1)*R)
        lo = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        ones = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0)
        nisa.affine_select(dst=lo, pattern=[[-cfg.R, cfg.pack]], channel_multiplier=1, on_true_tile=ones,
                           on_false_value=0.0, cmp_op=nl.greater_equal)
        bmask = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.affine_select(dst=bmask, pattern=[[-cfg.R, cfg.pack]], channel_multiplier=1, on_true_tile=lo,
                           on_false_value=0.0, cmp_op=nl.less, offset=-cfg.R)
    o_acc = ()
    if not direct:
        o_acc = tuple(nl.ndarray((P_MAX, cfg.nq * cfg.d), dtype=nl.float32, buffer=nl.sbuf) for _ in tiles)
    packs = _packs(cfg, b_lo, b_hi)
    st.pvt = cfg.pv_t and full_all and all(pk.nb % _pv_group(cfg) == 0 for pk in packs)
    st.consts = consts
    oT = ps = None
    if direct:
        nt, K = tiles[0].nt, cfg.nq * cfg.d
        if _oT_token_major(cfg, n_k, qkT.dtype.itemsize):     # [128, tokens, K chunk] viewed [128, K chunk, tokens]
            oT = nl.ndarray((P_MAX, P_MAX, n_k), dtype=qkT.dtype, buffer=nl.sbuf).permute((0, 2, 1))
        else:
            oT = nl.ndarray((P_MAX, n_k, P_MAX), dtype=qkT.dtype, buffer=nl.sbuf)
        ps = st.ps_sel[:, :n_k * nt].reshape((P_MAX, n_k, nt))
    # _Config.tail_cuts: the other packs' token columns of o^T copied before the last pack, its own after it
    cuts = direct and cfg.tail_cuts and cfg.nkv == 1
    c_last = (packs[-1].p0 - tiles[0].b0) * cfg.S if cuts else 0      # 0: the last pack is the only one
    for g in range(cfg.nkv):
        for pi, pack in enumerate(packs):
            p0, nb = pack.p0, pack.nb
            st.last_pack = g == cfg.nkv - 1 and pi == len(packs) - 1      # isolation._tail_rule
            if st.last_pack and c_last:
                _copy_oT(oT, ps, K, n_k, 0, c_last)
            full = full_all or (direct and not cfg.stride and st.last_pack)
            o_rows = _attend_pack(cfg, consts, st, qkT, qkv, K_cache, V_cache, position_ids, sinks, tiles, g, p0,
                                  nb, bmask, full=full)
            if st.pvt:
                _accT_to_oT(cfg, consts, st, o_rows, tiles[0], g, p0, nb)
            elif direct:
                _rows_to_oT(cfg, consts, st, o_rows, tiles[0], g, p0, nb, full=full)
            else:
                _rows_to_tokens(cfg, consts, st, o_rows, o_acc, tiles, g, p0, nb)
    wo = _load_w_o(cfg, W_o, tiles) if W_o is not None else None    # attention DP loads its W_o shard itself
    if direct:
        y = _sel_pairs(cfg, st, tiles[0], packs[-1].p0, packs[-1].nb, n_k) if cuts else None
        if y is not None:
            _copy_oT_pairs(cfg, oT, y, c_last, packs[-1].nb)
        else:
            _copy_oT(oT, ps, K, n_k, c_last, nt)
        return (oT,), wo
    o_tok = []
    for ti, tl in enumerate(tiles):
        nt = tl.nt
        o = nl.ndarray((P_MAX, cfg.nq * cfg.d), dtype=qkT.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o[:nt], src=o_acc[ti][:nt])
        o_tok.append(o)
    st = None      # release the attention's PSUM banks before the transposes allocate theirs
    return _transpose_o(cfg, tuple(o_tok), tiles), wo


def _copy_oT(oT, ps, K, n_k, c0, c1):
    """o^T[:, :, c0:c1] = the selection bank's token columns c0:c1 (bf16; the last K chunk's rows only if partial)."""
    if K % P_MAX == 0:
        nisa.tensor_copy(dst=oT[:, :, c0:c1], src=ps[:, :, c0:c1])
        return
    if n_k > 1:
        nisa.tensor_copy(dst=oT[:, :n_k - 1, c0:c1], src=ps[:, :n_k - 1, c0:c1])
    kl = K - (n_k - 1) * P_MAX
    nisa.tensor_copy(dst=oT[:kl, n_k - 1, c0:c1], src=ps[:kl, n_k - 1, c0:c1])


def _attend_pack(cfg, consts, st, qkT, qkv, K_cache, V_cache, position_ids, sinks, tiles, g, p0, nb, bmask,
                 full=False):
    """One batch pack of KV head g: rows (batch j, token s, head h). Returns o_rows [rows, d] bf16 (normalised),
    or with full=True the normalised accumulator [rows, nb*d] bf16 (every batch block; see _rows_to_oT)."""
    d, S, R, G = cfg.d, cfg.S, cfg.R, cfg.group
    rows = nb * R
    base = tiles[0].t0
    qm = st.qm[st.n_packs % 2]
    st.qm_sw = st.qm_sw_bufs[st.n_packs % 2]
    st.n_packs += 1
    kact = nl.ndarray((P_MAX, cfg.nst, MAX_S_TKG), dtype=qkT.dtype, buffer=nl.sbuf)   # new keys, stacked
    kd = cfg.kd
    if cfg.q_par:       # one copy per stack half instead of per batch (halves == 1)
        _stack_queries(cfg, qm, kact, qkT, p0 * S - base, g, nb)
    for j in range(nb):
        t = (p0 + j) * S - base
        u = j % cfg.kpp
        u0 = u * kd
        for hf in range(0 if cfg.q_par else cfg.halves):     # stack (group, half): see _Config.halves
            jj = j // cfg.kpp * cfg.halves + hf
            nisa.tensor_copy(dst=qm[u0:u0 + kd, jj, j * R:(j + 1) * R].reshape((kd, S, G)),
                             src=qkT[u0:u0 + kd, u, t:t + S, g * G:(g + 1) * G, hf], engine=nisa.engine.gpsimd)
            nisa.tensor_copy(dst=kact[u0:u0 + kd, jj, :S], src=qkT[u0:u0 + kd, u, t:t + S, cfg.nq + g, hf],
                             engine=nisa.engine.gpsimd)
        if cfg.kt_alt:      # the slots on the stack's other half (_kt_lanes) contract against a copy there
            nisa.tensor_copy(dst=qm[kd:2 * kd, 0, :R].reshape((kd, S, G)),
                             src=qkT[kd:2 * kd, 1, t:t + S, g * G:(g + 1) * G, 0], engine=nisa.engine.gpsimd)
    if cfg.kt_swap:
        _swapped_queries(cfg, st.qm_sw, qkT, p0 * S - base, g, nb)
    # First new position of each row's sequence, and each row's own position (fp32, [rows, 1]).
    pk = st.pre[p0]
    p_first, q_pos, st.pf_cols = pk.p_first, pk.q_pos, pk.pf_cols
    sm = _Softmax()
    if cfg.core == 0 or not cfg.split:
        _active_step(cfg, consts, st, sm, qm, kact, qkv, tiles, g, p0, nb, p_first, q_pos)
    else:            # second core of a context split: empty state (m = MASK_NEG, l = 0, no accumulator yet)
        sm.m = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=sm.m[:rows], value=MASK_NEG)
        sm.l = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=sm.l[:rows], value=0.0)
    if cfg.dyn:      # windowed scan: key offsets are relative to each sequence's start
        start = _start_rows(cfg, p_first, rows)
        pf_rel = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=pf_rel[:rows], data1=p_first[:rows], data2=start[:rows], op=nl.subtract)
        qp_rel = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=qp_rel[:rows], data1=q_pos[:rows], data2=start[:rows], op=nl.subtract)
        p_first, q_pos = pf_rel, qp_rel
    st.cur_valid = pk.valid     # per pack, shared by the KV heads
    # _Config.tail_cuts, the kernel's last pack: the sink term joins l after the new tokens' step (e^(sink - scale m)
    # with that step's m), so every later alpha rescales it with l, instead of after the last step (exp on ScalarE
    # behind the last P^T copy, then an add, on the tail)
    # The same with st.pvt (_Config.pv_t): the tail's normalisation then needs only l (1 / l broadcast, _bcast_rows)
    sink_first = sinks is not None and ((cfg.tail_cuts and st.last_pack) or st.pvt) and not cfg.split
    if sink_first:
        _add_sink(cfg, sm, pk.sinks[g], rows, sm.l)
    _prior_steps(cfg, consts, st, sm, qm, K_cache, V_cache, g, p0, nb, p_first, q_pos)
    if cfg.split:
        _flush_acc(cfg, st, sm, rows, nb)
        if cfg.stride:      # runtime-balanced batch split: only each row's own batch block is merged
            _own_blocks(cfg, sm, rows, nb, bmask)
        _combine_cores(cfg, sm, rows, 1 if cfg.stride else nb, g)
    # Final normalisation; sinks join the denominator only.
    l_fin = sm.l
    if sinks is not None and not sink_first:
        l_fin = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        _add_sink(cfg, sm, pk.sinks[g], rows, l_fin)
    rinv = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=rinv[:rows], data=l_fin[:rows])
    if cfg.fp8:      # PV summed V in cache units: o = acc * v_scale / l
        nisa.tensor_scalar(dst=rinv[:rows], data=rinv[:rows], op0=nl.multiply, operand0=consts.vs[:rows, g:g + 1])
    if full:
        return _normalise_full(cfg, st, sm, rows, nb, rinv, qkT.dtype)
    if cfg.stride:      # merged own blocks [rows, d] (_own_blocks, _combine_cores)
        o_rows = nl.ndarray((P_MAX, d), dtype=qkT.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o_rows[:rows], data=sm.acc[:rows, :d], op0=nl.multiply, operand0=rinv[:rows])
        return o_rows
    # The last step's PV is flushed only now: the denominator chain above needs only m and l, so VectorE runs it
    # while TensorE finishes the last PV.
    _flush_acc(cfg, st, sm, rows, nb)
    # o = acc / l on the diagonal blocks only (others zeroed by bmask), then summed over the batch blocks:
    # o_rows[r, :] = the row's own batch block, rounded to bf16 (the reference's rounding point).
    o_m = nl.ndarray((P_MAX, cfg.pack, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=o_m[:rows, :nb, :], data=sm.acc[:rows, :nb * d].reshape((rows, nb, d)),
                              op0=nl.multiply, operand0=rinv[:rows], op1=nl.multiply,
                              operand1=bmask[:rows, :nb].expand_dim(2).broadcast(2, d))
    o_rows = nl.ndarray((P_MAX, d), dtype=qkT.dtype, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=o_rows[:rows], op=nl.add, data=o_m[:rows, :nb, :].permute((0, 2, 1)), axis=(2,))
    return o_rows


def _add_sink(cfg, sm, sk, rows, dst):
    """dst = l + e^(sink - scale * m) (the sinks join the softmax denominator only)."""
    nb_f = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nb_f[:rows], data=sm.m[:rows], op0=nl.multiply, operand0=-cfg.scale)
    e_sk = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=e_sk[:rows], op=nl.exp, data=sk[:rows], bias=nb_f[:rows], scale=1.0)
    nisa.tensor_tensor(dst=dst[:rows], data1=sm.l[:rows], data2=e_sk[:rows], op=nl.add)


def _normalise_full(cfg, st, sm, rows, nb, rinv, dtype):
    """o = (acc * alpha + PV) / l for every batch block (bf16), folding the pending flush into the normalisation:
    acc * alpha / l is formed while TensorE finishes the last PV, then one pass PV / l + that."""
    n = nb * cfg.d
    o_n = nl.ndarray((P_MAX, PV_COLS), dtype=dtype, buffer=nl.sbuf)
    if st.pvt:      # acc^T [(pair batch, dim), row] in PSUM (_pv_t): times 1 / l along the free axis
        bc = _bcast_rows(st, rinv, rows, cfg.last_half)
        nisa.tensor_tensor(dst=o_n[:, :rows], data1=st.ps_o[:, :rows], data2=bc, op=nl.multiply)
        sm.pending = None
        return o_n
    if sm.fin_gates is not None and sm.pending is not None and cfg.tail_cuts:
        # ragged, per-group PV, _Config.tail_cuts: the pending groups' flush folded into the normalisation as below
        # (acc * alpha / l while TensorE finishes the last PV), every group's acc / l first (ScalarE / VectorE
        # halves), the pending groups' then overwritten by PV / l + acc * alpha / l: one pass after the last PV
        a2 = _alpha_over_l(sm, rows, rinv)
        acc_s = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
        for G, gate in enumerate(sm.fin_gates):
            c0, c1, _b0, _b1 = _group_cols(cfg, G, nb)
            _run(gate, lambda _i, c0=c0, c1=c1: nisa.tensor_scalar(
                dst=acc_s[:rows, c0:c1], data=sm.acc[:rows, c0:c1], op0=nl.multiply, operand0=a2[:rows]))
        _acc_over_l(o_n, sm, rows, n // 2 // cfg.d * cfg.d, n, rinv)
        for G, gate in enumerate(sm.fin_gates):
            c0, c1, _b0, _b1 = _group_cols(cfg, G, nb)
            _run(gate, lambda _i, c0=c0, c1=c1: nisa.scalar_tensor_tensor(
                dst=o_n[:rows, c0:c1], data=st.ps_o[:rows, c0:c1], op0=nl.multiply, operand0=rinv[:rows],
                op1=nl.add, operand1=acc_s[:rows, c0:c1]))
        sm.pending = None
        return o_n
    if sm.fin_gates is not None:     # ragged, per-group PV: only the groups whose PV is pending (_flush_acc)
        _flush_acc(cfg, st, sm, rows, nb)
    if sm.pending is None:  # already flushed (context split, per-group PV)
        # trn2: the first half of the batch blocks on ScalarE (the same fp32 product), the rest on VectorE, at once
        # (the tail after the last step; modelled ragged GPT-OSS B=8 62.58 -> 62.10 us)
        _acc_over_l(o_n, sm, rows, n // 2 // cfg.d * cfg.d if cfg.rmax_split else 0, n, rinv)
        return o_n
    if sm.acc is None:  # only the active step
        nisa.activation(dst=o_n[:rows, :n], op=nl.copy, data=st.ps_o[:rows, :n], scale=rinv[:rows])
        return o_n
    a2 = _alpha_over_l(sm, rows, rinv)
    acc_s = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.sbuf)      # while TensorE finishes the PV
    nisa.tensor_scalar(dst=acc_s[:rows, :n], data=sm.acc[:rows, :n], op0=nl.multiply, operand0=a2[:rows])
    nisa.scalar_tensor_tensor(dst=o_n[:rows, :n], data=st.ps_o[:rows, :n], op0=nl.multiply, operand0=rinv[:rows],
                              op1=nl.add, operand1=acc_s[:rows, :n])
    sm.pending = None
    return o_n


def _alpha_over_l(sm, rows, rinv):
    """alpha / l [rows, 1] fp32: the factor of the pending flush's acc folded into the normalisation."""
    a2 = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=a2[:rows], data1=sm.pending[:rows], data2=rinv[:rows], op=nl.multiply)
    return a2


def _acc_over_l(o_n, sm, rows, h, n, rinv):
    """o_n[:, :n] = acc / l: columns h:n on VectorE, the first h (whole batch blocks; 0: none) on ScalarE at once
    (the same fp32 product)."""
    nisa.tensor_scalar(dst=o_n[:rows, h:n], data=sm.acc[:rows, h:n], op0=nl.multiply, operand0=rinv[:rows])
    if h:
        nisa.activation(dst=o_n[:rows, :h], op=nl.copy, data=sm.acc[:rows, :h], scale=rinv[:rows])


def _own_blocks(cfg, sm, rows, nb, bmask):
    """sm.acc [rows, nb * d] (every batch's PV side by side) -> [rows, d]: each row's own batch block (the others
    zeroed by bmask, then summed over the blocks, exactly; every block is finite: V is scrubbed)."""
    d = cfg.d
    o_m = nl.ndarray((P_MAX, cfg.pack, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=o_m[:rows, :nb, :], data1=sm.acc[:rows, :nb * d].reshape((rows, nb, d)),
                       data2=bmask[:rows, :nb].expand_dim(2).broadcast(2, d), op=nl.multiply)
    own = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=own[:rows, :d], op=nl.add, data=o_m[:rows, :nb, :].permute((0, 2, 1)), axis=(2,))
    sm.acc = own


def _combine_cores(cfg, sm, rows, nb, g):
    """Context split (LNC=2): exchange (m, l, acc) with the other core and merge the two partial softmax states:
    m = max(m0, m1), l = sum_c l_c e^{scale (m_c - m)}, acc likewise. Each core adds its own term and the other's
    (fp32 addition commutes), so both cores hold the same bits. A core whose half saw only masked keys has
    m_c <= MASK_NEG: its weight e^{scale (m_c - m)} is exactly 0."""
    n = nb * cfg.d
    mine = nl.ndarray((P_MAX, 2 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=mine[:rows, 0:1], src=sm.m[:rows])
    nisa.tensor_copy(dst=mine[:rows, 1:2], src=sm.l[:rows])
    nisa.tensor_copy(dst=mine[:rows, 2:2 + n], src=sm.acc[:rows, :n])
    other = nl.ndarray((P_MAX, 2 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    peer = 1 - cfg.core
    nisa.sendrecv(src=mine[:rows, :2 + n], dst=other[:rows, :2 + n], send_to_rank=peer, recv_from_rank=peer,
                  pipe_id=g)
    m = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=m[:rows], data1=mine[:rows, 0:1], data2=other[:rows, 0:1], op=nl.maximum)
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias[:rows], data=m[:rows], op0=nl.multiply, operand0=-cfg.scale)
    a_mine = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=a_mine[:rows], op=nl.exp, data=mine[:rows, 0:1], bias=nbias[:rows], scale=cfg.scale)
    a_other = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=a_other[:rows], op=nl.exp, data=other[:rows, 0:1], bias=nbias[:rows], scale=cfg.scale)
    # [l | acc] of each core scaled by its weight, then summed: (mine * a_mine) + (other * a_other)
    t_other = nl.ndarray((P_MAX, 1 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t_other[:rows, :1 + n], data=other[:rows, 1:2 + n], op0=nl.multiply,
                       operand0=a_other[:rows])
    t_mine = nl.ndarray((P_MAX, 1 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=t_mine[:rows, :1 + n], data=mine[:rows, 1:2 + n], op0=nl.multiply, operand0=a_mine[:rows])
    la = nl.ndarray((P_MAX, 1 + PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=la[:rows, :1 + n], data1=t_mine[:rows, :1 + n], data2=t_other[:rows, :1 + n], op=nl.add)
    sm.m, sm.l, sm.acc = m, la[:, 0:1], la[:, 1:1 + PV_COLS]


def _active_step(cfg, consts, st, sm, qm, kact, qkv, tiles, g, p0, nb, p_first, q_pos):
    """Scores of the S new tokens of each sequence, K^T/V straight from SBUF; causal among the new tokens.

    Initialises the running statistics: every row sees at least its own key, so m is finite from here on.
    """
    d, S, R = cfg.d, cfg.S, cfg.R
    rows = nb * R
    base = tiles[0].t0
    sc = st.scores()
    for jj in range(_stacks(cfg, nb)):
        kp = _stack_rows(cfg, jj, nb)
        nisa.nc_matmul(dst=sc[:rows, :S], stationary=qm[:kp, jj, :rows], moving=kact[:kp, jj, :S],
                       accumulate=(jj > 0))
    if S > 1:
        # key s' is invalid for the row of token s if s' > s, or (sliding window) s' <= s - W
        s_row = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=s_row[:rows], data1=q_pos[:rows], data2=p_first[:rows], op=nl.subtract)
        key = st.iota(f"a{S}", [[1, S]], S)
        _fold_mask(cfg, consts, sc, rows, ((0, S, 0),), key, s_row, nl.greater, 0.0)
        if 0 < cfg.window < S:
            _fold_mask(cfg, consts, sc, rows, ((0, S, 0),), key, s_row, nl.less_equal, -float(cfg.window))
    m0 = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m0[:rows], op=nl.maximum, data=sc[:rows, :S], axis=(1,))
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias[:rows], data=m0[:rows], op0=nl.multiply, operand0=-cfg.scale)
    p = nl.ndarray((P_MAX, MAX_S_TKG), dtype=kact.dtype, buffer=nl.sbuf)
    l0 = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p[:rows, :S], op=nl.exp, data=sc[:rows, :S], bias=nbias[:rows], scale=cfg.scale,
                    reduce_op=nl.add, reduce_res=l0[:rows], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.nc_transpose(dst=st.ps_t[:S, 0, :rows], data=p[:rows, :S])
    pT = nl.ndarray((P_MAX, P_MAX), dtype=kact.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=pT[:S, :rows], src=st.ps_t[:S, 0, :rows])
    # V of the new tokens as [token s', batch j * d]: selection matmuls (identity columns) out of the token layout.
    va = st.scores()
    vcol = cfg.pad + (cfg.nq + cfg.nkv + g) * d
    for j in range(nb):
        t = (p0 + j) * S
        ti = (t - base) // cfg.tile_tok
        r, nt = t - tiles[ti].t0, tiles[ti].nt
        nisa.nc_matmul(dst=va[:S, j * d:(j + 1) * d], stationary=consts.ident[:nt, r:r + S],
                       moving=qkv[ti][:nt, vcol:vcol + d], accumulate=False)
    v_new = nl.ndarray((P_MAX, PV_COLS), dtype=kact.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=v_new[:S, :nb * d], src=va[:S, :nb * d])
    half = max(1, PSUM_F // d)
    if st.pvt:      # acc^T: the pair's V stationary, its P^T columns moving (_pv_t)
        per = _pv_group(cfg)
        for b0 in range(0, nb, per):
            nisa.nc_matmul(dst=st.ps_o[:per * d, b0 * R:(b0 + per) * R], stationary=v_new[:S, b0 * d:(b0 + per) * d],
                           moving=pT[:S, b0 * R:(b0 + per) * R], accumulate=False)
    for h0 in range(0, 0 if st.pvt else nb, half):
        hn = min(half, nb - h0)
        nisa.nc_matmul(dst=st.ps_o[:rows, h0 * d:(h0 + hn) * d], stationary=pT[:S, :rows],
                       moving=v_new[:S, h0 * d:(h0 + hn) * d], accumulate=False)
    sm.m, sm.l, sm.pending = m0, l0, l0    # acc = PV, flushed after the next step's statistics


def _cols(t, rows, c0, c1, inner):
    """t[:rows, c0:c1], viewed [rows, (c1 - c0) / inner, inner] when inner > 0 (the score matmuls' dst shape; the
    mask matmuls must use the same view to continue the same PSUM accumulation group)."""
    if inner <= 0:
        return t[:rows, c0:c1]
    return t[:rows, c0:c1].reshape((rows, (c1 - c0) // inner, inner))


def _fold_mask(cfg, consts, sc, rows, chunks, key, thr_base, cmp, shift):
    """sc[:rows, chunks] += MASK_NEG where cmp(key offset, thr_base + shift) (key offsets per column, thresholds
    per row): the 0/1 mask is built on GpSimd and folded into the score PSUM by a matmul with MASK_NEG * I, one per
    score accumulation chunk (c0, c1, inner)."""
    m = _build_mask(cfg, rows, chunks[-1][1], key, thr_base, cmp, shift)
    for chunk in chunks:
        _fold_chunk(consts, sc, rows, m, chunk)


def _build_mask(cfg, rows, cols, key, thr_base, cmp, shift):
    """0/1 bf16 mask [rows, cols] = cmp(key offset, threshold + shift) (threshold a per-row scalar; _threshold_mask)."""
    thr = thr_base
    if shift != 0.0:
        thr = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=thr[:rows], data=thr_base[:rows], op0=nl.add, operand0=shift)
    return _threshold_mask(key, (thr,), cmp, rows, cols)


def _threshold_mask(key, thrs, cmp, rows, cols):
    """0/1 bf16 mask [rows, cols] = cmp(key offset, threshold), the columns in len(thrs) equal parts, part t against
    the per-row scalar thrs[t] (rotated slots: one threshold per half of the q columns). fp16 key offsets
    (_Config.mask_dve, fp32 thresholds) on VectorE as a tensor_scalar, one 16-bit input and output (perf mode: 4x
    the element rate), else on GpSimd as the two-input tensor_tensor against the broadcast threshold."""
    m = nl.ndarray((P_MAX, FA_SUB), dtype=nl.bfloat16, buffer=nl.sbuf)
    hc = cols // len(thrs)
    for t, thr in enumerate(thrs):
        c0, c1 = t * hc, (t + 1) * hc
        if key.dtype == nl.float16:
            nisa.tensor_scalar(dst=m[:rows, c0:c1], data=key[:rows, c0:c1], op0=cmp, operand0=thr[:rows])
        else:
            nisa.tensor_tensor(dst=m[:rows, c0:c1], data1=key[:rows, c0:c1], data2=thr[:rows].broadcast(1, hc),
                               op=cmp, engine=nisa.engine.gpsimd)
    return m


def _fold_chunk(consts, sc, rows, m, chunk, accumulate=True):
    """sc[:rows, chunk] += MASK_NEG * m (a matmul with MASK_NEG * I, continuing the chunk's accumulation group;
    accumulate=False: opening it)."""
    c0, c1, inner = chunk
    nisa.nc_matmul(dst=_cols(sc, rows, c0, c1, inner), stationary=consts.neg_eye[:rows, :rows],
                   moving=_cols(m, rows, c0, c1, inner), accumulate=accumulate)


def _prior_steps(cfg, consts, st, sm, qm, K_cache, V_cache, g, p0, nb, p_first, q_pos):
    """Cache keys j < pos[b, 0] (and > pos - W): K/V slots in a KV_BUFS ring, software-pipelined steps.

    Program order per step k: loads of the next slot when step k+1 starts one, scores + masks of step k+1, then the
    softmax / P^T / PV of step k, so TensorE computes the next scores while Vector/Scalar work on this step.
    """
    rows = nb * cfg.R
    slots, steps = _plan(cfg)
    if len(steps) == 0:
        return
    rot_thr = _rot_thresholds(cfg, st, slots, steps, p_first, rows)
    # Per-step mask thresholds (tiny, all issued up front so the GpSimd masks never wait for VectorE).
    for step in steps:
        if cfg.pmajor:      # per query row (free axis), the same on every partition
            step.thr_hi = nl.ndarray((P_MAX, PMAJOR_ROWS), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=step.thr_hi[:, :rows], data=st.pf_cols[:, :rows], op0=nl.add,
                               operand0=-1.0 - step.pos0)
            continue
        sl = slots[step.slot]
        if step.chunks[0][2] > 0 and _v_rotated(cfg, sl.j0, sl.w):
            # rotated batches (planning._v_rotated): their key offsets are key + 64n on the first half of the
            # columns and key - 64n on the second, i.e. thresholds shifted the other way on their rows
            k = steps.index(step)
            step.thr_rot = tuple(t[:, k:k + 1] for t in rot_thr)
            continue
        tdt = nl.float32 if cfg.mask_dve else nl.int16     # VectorE masks: fp32 scalar operands
        step.thr_hi = _step_threshold(p_first, rows, -1.0 - step.pos0, tdt)    # invalid if j > pos[b, 0] - 1
        if cfg.window > 0:                                                       # invalid if j <= pos - W
            step.thr_lo = _step_threshold(q_pos, rows, -float(cfg.window) - step.pos0, tdt)
    gates = _step_gates(cfg, st, steps) if cfg.ragged else (None,) * len(steps)
    st.load_gates = _load_gates(cfg, st, slots, nb) if cfg.ragged else None
    sgates, pv_gates, fin = (_stack_gates(cfg, st, steps, slots, nb) if cfg.ragged and not cfg.pmajor
                             else ((None,) * len(steps), (None,) * len(steps), None))
    for step, sg in zip(steps, sgates):
        step.stack_gates = sg
    _p128_steps(cfg, st, steps, rows)
    views = []
    _issue_scores(cfg, consts, st, qm, K_cache, V_cache, g, p0, nb, slots, steps[0], views, gates[0])
    # _Config.last_half: the last (half) step's loads and scrubs are issued with the previous step's, and its score
    # matmuls inside the step before that, after its exp and P^T transposes and before its PV (they write that
    # step's score buffer, free once its exp has read it): on TensorE they no longer wait behind that PV (modelled
    # trn3 GPT-OSS B=8 4K 35.44 -> 34.99 us). Skipped steps are a suffix (ragged._step_gates), so that step's runtime
    # gate holds whenever the last step's does.
    last = len(steps) - 1 if cfg.last_half and len(steps) >= 3 else -1
    for k in range(len(steps)):
        if k + 1 < len(steps) and k + 1 != last:
            _issue_scores(cfg, consts, st, qm, K_cache, V_cache, g, p0, nb, slots, steps[k + 1], views,
                          gates[k + 1])
        step = steps[k]
        if k + 2 == last:
            late = []
            _issue_scores(cfg, consts, st, qm, K_cache, V_cache, g, p0, nb, slots, steps[last], views, gates[last],
                          defer=late)
            step.pre_pv = _then(step.pre_pv, late[0])
        st.bc_dve = cfg.last_half and k >= len(steps) - 2
        if cfg.pmajor:
            _online_step_pm(cfg, consts, st, sm, step.sc, rows, nb, views[step.slot][1], step.blocks, gates[k],
                            step.pre_pv)
        else:
            split = tuple((c0, c1) for c0, c1, _i in step.chunks) if cfg.rmax_split and st.last_pack else None
            _online_step(cfg, st, sm, step.sc, rows, nb, step.cols, views[step.slot][1], step.blocks, gates[k],
                         pv_gates[k], pv_gates[k - 1] if k > 0 else None, step.pre_pv, split,
                         p128=step.halves is not None)
        step.pre_pv = None
        step.sc = None
        if k == 0 and cfg.ragged and sm.acc is None:
            # no accumulator yet (second core of a context split): a zero one, so every later flush is the same
            # in-place acc * alpha + PV whichever steps run
            sm.acc = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=sm.acc[:rows, :nb * cfg.d], value=0.0)
    if fin is not None:
        sm.fin_gates = fin
    if sm.alt is not None:      # _Config.tail_halves: m of the last step run is in one of two buffers (runtime)
        sm.m = None


def _rot_thresholds(cfg, st, slots, steps, p_first, rows):
    """Rotated batches (planning._v_rotated): int16 [rows, steps] mask thresholds of every step for the first and
    the second half of its columns, p_first - 1 - pos0 -/+ 64n on the rows of the pack's rotated batches (their key
    offsets are key +/- 64n there), in three instructions per pack (no per-step ones); None when no slot is
    rotated. Constant tables (built once): pos0 + 1 and 64n per step on every partition, 1.0 on the rotated rows."""
    if not any(_v_rotated(cfg, sl.j0, sl.w) for sl in slots):
        return None
    ns = len(steps)
    if st.rot_tabs is None:
        p1 = nl.ndarray((P_MAX, ns), dtype=nl.float32, buffer=nl.sbuf)
        hv = nl.ndarray((P_MAX, ns), dtype=nl.float32, buffer=nl.sbuf)
        # the rotated slots' body steps only (the other columns are never read): one iota and one memset per run
        # of consecutive slots of one width whose steps start at pos0 = j0 + i*ni (per-step memsets otherwise)
        runs = []       # [first column, j0, w, ni, steps per slot, slots]
        for si, sl in enumerate(slots):
            ks = [k for k, sp in enumerate(steps) if sp.slot == si and sp.chunks[0][2] > 0]
            if not ks or not _v_rotated(cfg, sl.j0, sl.w):
                continue
            ni, r = len(steps[ks[0]].blocks), runs[-1] if runs else None
            if ks != list(range(ks[0], ks[0] + len(ks))) or any(steps[k].pos0 != sl.j0 + i * ni
                                                                 for i, k in enumerate(ks)):
                for k in ks:
                    nisa.memset(dst=p1[:, k:k + 1], value=float(steps[k].pos0 + 1), engine=nisa.engine.gpsimd)
                    nisa.memset(dst=hv[:, k:k + 1], value=float(P_MAX // 2 * (sl.w // P_MAX)),
                                engine=nisa.engine.gpsimd)
            elif (r is not None and (r[2], r[3], r[4]) == (sl.w, ni, len(ks)) and r[0] + r[5] * r[4] == ks[0]
                  and r[1] + r[5] * r[2] == sl.j0):
                r[5] += 1
            else:
                runs.append([ks[0], sl.j0, sl.w, ni, len(ks), 1])
        for k0, j0, w, ni, per, nsl in runs:
            cols = nsl * per
            nisa.iota(dst=p1[:, k0:k0 + cols].reshape((P_MAX, nsl, per)), pattern=[[w, nsl], [ni, per]],
                      offset=j0 + 1, channel_multiplier=0)
            nisa.memset(dst=hv[:, k0:k0 + cols], value=float(P_MAX // 2 * (w // P_MAX)), engine=nisa.engine.gpsimd)
        r = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)      # row r of batch r // R: rotated batches
        nisa.iota(dst=r, pattern=[[0, 1]], offset=0, channel_multiplier=1)
        rr = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)      # (planning._rot_batch: rot_unit)
        ru = cfg.rot_unit * cfg.R
        nisa.tensor_scalar(dst=rr, data=r, op0=nl.mod, operand0=float(2 * ru), op1=nl.greater_equal,
                           operand1=float(ru))
        nrr = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=nrr, data=rr, op0=nl.multiply, operand0=-1.0)
        st.rot_tabs = (p1, hv, rr, nrr)
    p1, hv, rr, nrr = st.rot_tabs
    base = nl.ndarray((P_MAX, ns), dtype=nl.float32, buffer=nl.sbuf)      # p_first - pos0 - 1
    nisa.tensor_scalar(dst=base[:rows], data=p1[:rows], op0=nl.subtract, operand0=p_first[:rows], op1=nl.multiply,
                       operand1=-1.0)
    out = []
    for sgn in (nrr, rr):
        t = nl.ndarray((P_MAX, ns), dtype=nl.float32 if cfg.mask_dve else nl.int16, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=t[:rows], data=hv[:rows], op0=nl.multiply, operand0=sgn[:rows], op1=nl.add,
                                  operand1=base[:rows])
        out.append(t)
    return tuple(out)


def _step_threshold(base, rows, shift, dtype=nl.int16):
    """int16 [rows, 1] mask threshold base + shift of a cache step, clamped below to -1 (key offsets of a step are
    0 .. fa_tile - 1 < FA_TILE_MAX, so the clamp changes no comparison). Above, the fp32 -> int16 write saturates
    (nki-api.md: float -> int casts round to nearest even and saturate), and 32767 > every key offset compares
    like the exact value, so S_max >= 2^15 needs no second clamp (test: S_max 33024). With int16 key offsets
    (st.iota) the GpSimd mask compare streams 2-byte data: twice the fp32 rate on trn2's GpSimd (32 lanes per core
    instead of 16), where the per-step masks pace ragged batches. dtype fp32: the VectorE masks' scalar operand
    (_Config.mask_dve; exact, no saturation)."""
    thr = nl.ndarray((P_MAX, 1), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=thr[:rows], data=base[:rows], op0=nl.add, operand0=shift, op1=nl.maximum, operand1=-1.0)
    return thr


def _load_k_pair(cfg, K_cache, kT, b, g, j, j0, w, lane=0):
    """_Config.k_plain: K^T of the whole slot [j0, j0 + w) of batches j and j + kpp (sequences b, b + kpp: the same
    partitions of adjacent stacks of a full-width slot; kpp = 2: partition block (j + lane) % 2, see
    kv_io._load_piece) in one 4-D dma_transpose: [1, 2, w, d] -> [d, 2, w, 1], SBUF runs of 2w positions (8 KiB
    at w = 2048 bf16, 4 KiB at d = 64: DMA efficiency 0.87 / 0.85 instead of 0.85 / 0.80... for one batch's slot).
    Whole two-piece slots (planning._whole_k) and one-step slots as wide as the ring's stacks (planning._pair_k)."""
    kpp, kd = cfg.kpp, cfg.kd
    u0, jj = ((j + lane) % kpp) * kd, j // kpp
    if cfg.k_t:     # K_cache_transposed: both sequences' columns in one plain copy [d, 2, w]
        s_max = cfg.s_max
        nisa.dma_copy(dst=kT[u0:u0 + kd, jj:jj + 2, :w],
                      src=K_cache.ap([[s_max, kd], [kpp * cfg.nkv * kd * s_max, 2], [1, w]],
                                     offset=(b * cfg.nkv + g) * kd * s_max + j0))
        return
    nisa.dma_transpose(dst=kT[u0:u0 + kd, jj:jj + 2, :w].expand_dim(3),
                       src=K_cache[b:b + kpp + 1:kpp, g, j0:j0 + w, :].expand_dim(0))


def _load_v_pieces(cfg, st, K_cache, V_cache, kg, v, b, g, j, j0, w, lane, rot, pieces, kw, k1):
    """Ragged contiguous slot [j0, j0 + w) of batch j (sequence b): its load pieces (planning._load_pieces), each
    under its gate (a sequence's loads stop at its length): K^T and V, or V alone where the K^T goes by
    _load_k_alts (the pieces from kw on: planning._whole_k; k1: the one-piece slot's K^T by batch pairs)."""
    for k, (a, size) in enumerate(pieces):
        _run(st.load_gates[(a, size)][j], lambda _i, a=a, size=size, r=rot and _rot_batch(cfg, j),
             pt="v" if (kw is not None and k >= kw) or (k1 and k == len(pieces) - 1) else "kv":
             _load_piece(cfg, K_cache, V_cache, kg, v, b, g, j, j0, w, a, size, lane, r, pt))


def _load_k_alts(cfg, st, K_cache, V_cache, kg, v, b, g, j, j0, w, lane, rot, pieces, kw, k1):
    """K^T of batch j's slot [j0, j0 + w) where it is not loaded with V by piece (kw / k1, see _load_v_pieces): the
    first piece alone, or the whole slot (planning._whole_k; _pair_k: the whole one-piece slot), alone or with
    the partner's (batch j ^ kpp) in one transpose (_load_k_pair); shorter prefixes go by _load_v_pieces."""
    if kw is None and not k1:
        return
    f = st.load_gates[pieces[-1] if k1 else pieces[kw + 1]]
    nf = st.load_gates.get(("k2r", j0))
    if nf is None and ("k2n", j0) in st.load_gates:    # 1 - f (ragged._load_gates), registered at
        # the slot's first loads (once per pack: every KV head's loads of the slot reuse them)
        nf = st.load_gates[("k2r", j0)] = _registers(*st.load_gates[("k2n", j0)])
    pj = j ^ cfg.kpp     # the partner: the same partitions of the adjacent stack (ragged._load_gates)
    paired = nf is not None and pj < len(nf)
    if paired and j & cfg.kpp == 0:    # both sequences need the whole slot: one transpose
        _run(f[j], lambda _i: _run(f[pj], lambda _i2: _load_k_pair(cfg, K_cache, kg, b, g, j, j0, w, lane)))
    loads = [(j0, w, f[j], nf[pj] if paired else None)]    # alone: the partner does not need it
    k1p = None if k1 else st.load_gates.get(("k1p", j0))
    if k1p is not None:     # _Config.k1_prefixes: the first piece alone as its prefix alternatives
        _run(st.load_gates[("k1", j0)][j], lambda _i: _load_k1_prefixes(
            cfg, K_cache, V_cache, kg, v, b, g, j, j0, w, lane, pieces, kw, k1p))
    elif not k1:
        loads.insert(0, (j0, pieces[kw][1], st.load_gates[("k1", j0)][j], None))
    for a, size, gt, g2 in loads:
        _run(gt, lambda _i, a=a, size=size, g2=g2: _run(
            g2, lambda _i2: _load_piece(cfg, K_cache, V_cache, kg, v, b, g, j, j0, w, a, size, lane, False, "k")))


def _load_k1_prefixes(cfg, K_cache, V_cache, kg, v, b, g, j, j0, w, lane, pieces, kw, k1p):
    """_Config.k1_prefixes, inside batch j's first-piece-alone gate (its sequence ends inside the slot's first piece,
    pieces[kw]): K^T of [j0, j0 + m K1_PREFIX) for the one m whose alternative holds its rows (the one-hot gates of
    ragged._k1_prefix_gates, registered here: once per sequence). Alternatives no shorter than the gate's lower
    bound (the scan's first slot: the shorter prefix pieces hold those sequences) only."""
    gt, index, m_max = k1p
    size1 = pieces[kw][1]
    lo = _piece_thresholds(pieces)[kw][0] - j0     # the gate's hi > j0 + lo
    for m in range(1, m_max + 1):
        s = m * K1_PREFIX
        if s <= lo or s - K1_PREFIX >= size1:
            continue
        r = _registers(gt[0:1, index(j, m):index(j, m) + 1], 1)[0]
        _run(r, lambda _i, s=min(s, size1): _load_piece(cfg, K_cache, V_cache, kg, v, b, g, j, j0, w, j0, s, lane,
                                                         False, "k"))


def _ring_mode(st, ring, buf, p0, j0, w):
    """(fresh_ring, relaxed) of a use of ring buffer buf for the slot [j0, j0 + w) of pack p0 (see _issue_scores),
    and its state updated: fresh_ring unless every lane is finite up to w, or this pack's groups reaching j0 are
    (a partial scrub at j0_p <= j0 with w <= its width); relaxed: a fresh buffer scrubbed partially."""
    full, part = ring[buf]
    fresh = w > full and not (part is not None and part[0] == p0 and part[1] <= j0 and w <= part[2])
    relaxed = fresh and j0 in st.cur_valid.scrub_rel
    if relaxed:
        ring[buf][1] = (p0, j0, w)
    elif fresh:
        ring[buf][0] = max(full, w)
    return fresh, relaxed


def _issue_scores(cfg, consts, st, qm, K_cache, V_cache, g, p0, nb, slots, step, views, gate=None, defer=None):
    """Loads of the step's slot (when first needed), then its scores and masks into the next score buffer (inside
    the step's runtime gate when ragged contexts skip it). defer: a list the row-major scores are appended to (as a
    function) instead of being issued here (_prior_steps, _Config.last_half)."""
    rows = nb * cfg.R
    fresh = []
    while len(views) <= step.slot:
        j0, w = slots[len(views)].j0, slots[len(views)].w
        kT = st.kT[st.n_slots % cfg.kv_bufs]
        kg = st.kg[st.n_slots % len(st.kg)]     # = kT unless fp8
        v = st.v[st.n_slots % cfg.kv_bufs]
        lane = st.kt_lanes[st.n_slots % cfg.kv_bufs]
        rot = _v_rotated(cfg, j0, w)     # the pack's odd batches hold the slot rotated by half
        st.n_slots += 1
        if cfg.paged:
            lg = st.load_gates[(j0, w)] if cfg.ragged else (None,) * nb
            _load_slot_paged(cfg, st, K_cache, V_cache, kg, v, g, p0, nb, j0, w, lg, lane)
        else:
            for j in range(nb):
                b = p0 + j
                u0 = (j % cfg.kpp) * cfg.kd
                if cfg.dyn:     # windowed scan: positions start[b] + j0 .. (register-addressed)
                    _load_slot_window(cfg, st.starts[b], K_cache, V_cache, kg[u0:u0 + cfg.kd, j // cfg.kpp, :w],
                                      v[:, j], b, g, j0, w)
                    continue
                if not cfg.ragged:
                    _load_piece(cfg, K_cache, V_cache, kg, v, b, g, j, j0, w, j0, w, lane)
                    continue
                pieces = _load_pieces(cfg, j0, w)
                kw = None if rot and _rot_batch(cfg, j) and not cfg.k_plain else _whole_k(cfg, j0, w)
                k1 = kw is None and _pair_k(cfg, slots, j0, w)    # one piece, K^T of batch pairs (planning._pair_k)
                args = (cfg, st, K_cache, V_cache, kg, v, b, g, j, j0, w, lane, rot, pieces, kw, k1)
                # _Config.k_first: the batch's K^T loads ahead of its V pieces (the scores and K^T scrub need K^T
                # first; PV reads V a step later)
                for part in (_load_k_alts, _load_v_pieces) if cfg.k_first else (_load_v_pieces, _load_k_alts):
                    part(*args)
        # Ragged, per-group gated scores / PV (_stack_gates): a load group none of whose sequences reaches j0 is
        # neither loaded nor read in this slot (nor in any later slot of this pack), so a fresh ring buffer scrubs
        # the groups reaching j0 only; its other lanes keep their content. This pack's later uses of the buffer at
        # j0' >= j0 read a subset of those groups: they need only the lanes whose sequence ends inside. The K^T
        # buffers (kg: the fp8 pairs, a ring of their own) and the V buffers are tracked apart.
        k_mode = _ring_mode(st, st.ring_k, (st.n_slots - 1) % len(st.kg), p0, j0, w)
        v_mode = _ring_mode(st, st.ring_v, (st.n_slots - 1) % cfg.kv_bufs, p0, j0, w)
        _scrub_slot(cfg, st, kg, j0, w, nb, *k_mode, v_mode=v_mode, lane=lane, rot=rot)
        if cfg.fp8 and not cfg.fp8_mm:     # after the scrub: every lane cast (the groups reaching j0) is finite
            _cast_pairs(cfg, kg, kT, w, nb, K_cache.dtype, st.n_slots, st.cur_valid.slot_act.get(j0))
        views.append((kT, v, lane))
        fresh.append((v, j0, w, st.gates[1], rot))
    kT, lane = views[step.slot][0], views[step.slot][2]
    j0, w = slots[step.slot].j0, slots[step.slot].w
    sc = st.scores()
    if cfg.pmajor:
        key = st.iota_pm(w // P_MAX, len(step.blocks))
        _run(gate, lambda _i: _step_scores_pm(cfg, consts, qm, kT, sc, key, rows, nb, step, j0, w, lane))
    elif step.halves is not None:      # _Config.tail_halves: the two halves of the blocks on the two partition halves
        h = len(step.blocks) // 2
        key = st.iota(f"{step.key_id}_h", [[w // P_MAX, P_MAX], [1, h]], P_MAX * h,
                      nl.float16 if cfg.mask_dve else nl.int16)
        q = st.qm_sw if cfg.kt_swap and lane else qm
        _run(gate, lambda _i: _step_scores_p128(cfg, consts, q, kT, sc, key, rows, nb, step, j0, w, lane))
    else:
        kdt = nl.float16 if cfg.mask_dve else nl.int16
        key = st.iota(step.key_id, step.key_pattern, step.cols, kdt)
        q = st.qm_sw if cfg.kt_swap and lane else qm

        def scores():
            _run(gate, lambda _i: _step_scores(cfg, consts, q, kT, sc, key, rows, nb, step, j0, w, lane))
        if defer is None:
            scores()
        else:
            defer.append(scores)
    # V is needed by the step's PV: the slot's V scrub is issued inside the step that first reads the slot, after
    # its statistics (pre_pv), so on VectorE / GpSimd it queues behind that step's row max instead of ahead of it
    # (the last slot's ANDs, after the last K/V load, delayed the last step's chain)
    step.pre_pv = None
    for v, j0, w, gates, rot in fresh:
        ands = _scrub_v(cfg, st, v, j0, w, nb, gates, defer=j0 == slots[step.slot].j0, rot=rot)
        if ands is not None:
            step.pre_pv = ands
    step.sc = sc


def _then(first, second):
    """first() (when not None), then second()."""
    def both():
        if first is not None:
            first()
        second()
    return both


def _stack_queries(cfg, qm, kact, qkT, t0, g, nb):
    """_Config.q_par (halves == 1): the pack's queries into their stacks' masked stationaries (batch j = kpp*i + u:
    stack i, partitions u*kd.., columns j*R) and its new keys into kact (stack i, partitions u*kd..), one GpSimd
    copy each per stack half u instead of one per batch: the batches of a half are a regular access pattern on both
    sides (qm: stride qm.shape[2] + kpp*R per stack; qkT: kpp*S tokens, on the half's transposed copy qkT[:, u]).
    t0: the pack's first token in the tile."""
    kd, S, G, R, kpp = cfg.kd, cfg.S, cfg.group, cfg.R, cfg.kpp
    _, kq, n_tok, nh, halves = qkT.shape
    fq, fk, fa = qm.shape[1] * qm.shape[2], kq * n_tok * nh * halves, kact.shape[1] * kact.shape[2]
    for u in range(min(kpp, nb)):
        cnt, u0 = (nb - u + kpp - 1) // kpp, u * kd
        tok = (u * n_tok + t0 + u * S) * nh        # batch u's first token on the half's copy (head 0)
        dst = qm.ap([[fq, kd], [qm.shape[2] + kpp * R, cnt], [G, S], [1, G]], offset=u0 * fq + u * R)
        src = qkT.ap([[fk, kd], [kpp * S * nh * halves, cnt], [nh * halves, S], [halves, G]],
                     offset=u0 * fk + (tok + g * G) * halves)
        nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.gpsimd)
        dst = kact.ap([[fa, kd], [kact.shape[2], cnt], [1, S]], offset=u0 * fa)
        src = qkT.ap([[fk, kd], [kpp * S * nh * halves, cnt], [nh * halves, S]],
                     offset=u0 * fk + (tok + cfg.nq + g) * halves)
        nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.gpsimd)


def _swapped_queries(cfg, qm_sw, qkT, t0, g, nb):
    """_Config.kt_swap: the pack's queries with each stack's halves swapped (batch j on partitions
    ((j + 1) % 2) * kd.., block j of the columns; kpp = 2), for the ring buffers that swap them (_kt_lanes). One
    GpSimd copy per batch parity, not per batch (the copies queue on the pack's GpSimd work: modelled ragged
    GPT-OSS B=8 68.04 -> 67.54 us): the batches j = 2i + p are a regular access pattern on both sides (qm_sw stack
    i, columns (2i + p) * R: stride (pack + 2) * R; qkT tokens t0 + (2i + p) * S: stride 2S; the transposes hold
    every token on both halves, qkT[:, u]). t0: the pack's first token in the tile."""
    kd, S, G, R = cfg.kd, cfg.S, cfg.group, cfg.R
    _, kpp, n_tok, nh, halves = qkT.shape
    fq, fk = qm_sw.shape[1] * qm_sw.shape[2], kpp * n_tok * nh * halves    # free elements per partition
    for p in range(min(2, nb)):
        cnt, us = (nb - p + 1) // 2, (p + 1) % 2 * kd      # batches 2i + p, on the other half
        dst = qm_sw.ap([[fq, kd], [qm_sw.shape[2] + 2 * R, cnt], [G, S], [1, G]], offset=us * fq + p * R)
        src = qkT.ap([[fk, kd], [2 * S * nh * halves, cnt], [nh * halves, S], [halves, G]],
                     offset=us * fk + (((p + 1) % 2 * n_tok + t0 + p * S) * nh + g * G) * halves)
        nisa.tensor_copy(dst=dst, src=src, engine=nisa.engine.gpsimd)


def _kt_lanes(cfg):
    """Per K/V ring buffer, the partition block (0 or 1) of a one-sequence pack's K^T in it (see _Config.kt_alt;
    all 0 otherwise). Fixed per buffer, so the ring's scrub bookkeeping (_ring_mode) holds per buffer; chosen so
    that both halves receive about the same K bytes over the scan (greedy over the buffers' total widths in the
    first pack's slot sequence: GPT-OSS B=1 16K, buffers of 5120 / 4096 / 4096 / 3072 positions -> 8192 each).
    Several sequences per pack (_Config.kt_swap): 1 = the stack's halves swapped (batch j on (j + 1) % 2), on
    every other buffer, so consecutive slots alternate and each sequence's K bytes split between the halves
    within one slot whatever its (runtime) length. A swap stays inside a load group, so the group-level scrub
    bookkeeping (_ring_mode, ragged._stack_gates) is unchanged."""
    if cfg.kt_swap:
        return tuple(b % 2 for b in range(cfg.kv_bufs))
    if not cfg.kt_alt:
        return (0,) * cfg.kv_bufs
    width = [0] * cfg.kv_bufs
    for k, sl in enumerate(_plan(cfg)[0]):
        width[k % cfg.kv_bufs] += sl.w
    lanes, load = [0] * cfg.kv_bufs, [0, 0]
    for buf in sorted(range(cfg.kv_bufs), key=lambda b: (-width[b], b)):
        lane = 0 if load[0] <= load[1] else 1
        lanes[buf] = lane
        load[lane] += width[buf]
    return tuple(lanes)


def _step_scores(cfg, consts, qm, kT, sc, key, rows, nb, step, j0, w, lane=0):
    """Scores of one step (every K^T stack of the pack) with its masks folded in, chunk by chunk."""
    n = w // P_MAX
    if step.thr_rot is not None:    # rotated batches (planning._v_rotated): each half of the columns its thresholds
        masks = [_threshold_mask(key, step.thr_rot, nl.greater, rows, step.cols)]
    else:
        masks = [_build_mask(cfg, rows, step.cols, key, step.thr_hi, nl.greater, 0.0)]
    if step.thr_lo is not None:
        masks.append(_build_mask(cfg, rows, step.cols, key, step.thr_lo, nl.less_equal, 0.0))
    sg = step.stack_gates
    # _Config.k_plain: the rotated batches' (odd stacks') K^T is plain; their column block q reads plain block
    # (q + 64) % 128, so a chunk is read per half of the blocks (each a moving-operand offset)
    k_rot = cfg.k_plain and _v_rotated(cfg, j0, w)
    for c0, c1, inner in step.chunks:
        if sg is not None:      # ragged: the masks open the chunk's accumulation group, the stacks run gated
            for i, m in enumerate(masks):
                _fold_chunk(consts, sc, rows, m, (c0, c1, inner), accumulate=i > 0)
        for jj in range(_stacks(cfg, nb)):
            kp = _stack_rows(cfg, jj, nb)
            # a one-batch stack whose slot is on the stack's other half (_Config.kt_alt, or kt_swap's last stack
            # of an odd pack); a full stack with swapped halves contracts against the swapped queries (qm)
            b0 = lane * cfg.kd if kp == cfg.kd else 0
            if inner < 0:                   # paged, i-major: columns (il, q') of K^T, q' = r*T + t
                i0, K = step.pos0 - j0, _slot_split(cfg, w)
                il0, il1 = i0 + c0 // P_MAX, i0 + c1 // P_MAX
                if K == 1:
                    mov = _kview(cfg, kT, jj, kp, w, (kp, w), (slice(None), slice(il0 * P_MAX, il1 * P_MAX)), b0)
                else:
                    mov = _kview(cfg, kT, jj, kp, w, (kp, K, n, P_MAX // K),
                                 (slice(None), slice(None), slice(il0, il1), slice(None)), b0).permute((0, 2, 1, 3))
                mov = [((c0, c1, inner), mov)]
            elif inner > 0:
                i0 = step.pos0 - j0
                qa, qb = c0 // inner, c1 // inner
                parts = [(qa, qb, qa)]
                if k_rot and _rot_batch(cfg, jj * cfg.kpp):     # a rotated stack: plain block (q + 64) % 128
                    half = P_MAX // 2
                    parts = [(q0, q1, (q0 + half) % P_MAX) for q0, q1 in ((qa, min(qb, half)), (max(qa, half), qb))
                             if q0 < q1]
                mov = [((q0 * inner, q1 * inner, inner),
                        _kview(cfg, kT, jj, kp, n * P_MAX, (kp, P_MAX, n),
                               (slice(None), slice(qk, qk + q1 - q0), slice(i0, i0 + inner)), b0))
                       for q0, q1, qk in parts]
            else:
                mov = [((c0, c1, inner), _kview(cfg, kT, jj, kp, w, (kp, w), (slice(None), slice(n * P_MAX, w)), b0))]
            def scores(_i, jj=jj, kp=kp, mov=mov, b0=b0, acc=(sg is not None or jj > 0)):
                for c, mv in mov:
                    nisa.nc_matmul(dst=_cols(sc, rows, *c), stationary=qm[b0:b0 + kp, jj, :rows], moving=mv,
                                   accumulate=acc)
            if sg is not None:
                nl.fori_loop(0, sg[jj // cfg.halves], scores)
                continue
            scores(0)
        if sg is not None:
            continue
        for m in masks:          # each chunk's masks right after its scores: its row max can start early
            _fold_chunk(consts, sc, rows, m, (c0, c1, inner))


def _kview(cfg, kT, jj, kp, w, shape, index, b0=0):
    """Stack jj of a K^T slot, columns [0, w) viewed as `shape` ([kp, ...], splitting w) and indexed by `index`:
    kT[:kp, jj, :w] (bf16 stacks), or with fp8_mm the fp8 bytes of its half (jj % 2: 0 even dims, 1 odd dims) in
    the pairs of load group jj // 2, a 2-byte stride the matmul streams at its full rate."""
    if not cfg.fp8_mm:
        return kT[b0:b0 + kp, jj, :w].reshape(shape)[index]
    pairs = kT[:kp, jj // 2, :w].view(cfg.kv_dtype).reshape(tuple(shape) + (2,))
    return pairs[tuple(index) + (jj % 2,)]


def _stacks(cfg, nb):
    """K^T / query stacks holding the pack's nb batches: (load group, half) pairs, see _Config.halves."""
    return (nb + cfg.kpp - 1) // cfg.kpp * cfg.halves


def _stack_rows(cfg, jj, nb):
    """Partitions of stack jj holding data: kd per batch of its load group."""
    return min(cfg.kpp, nb - jj // cfg.halves * cfg.kpp) * cfg.kd


def _row_max(m_t, sc, rows, cols, split=None, chain=False):
    """m_t[:rows] = the row max of sc[:rows, :cols]; split (column ranges of the step's score chunks, _Config.
    rmax_split): one reduce per chunk, each as soon as its chunk's scores are done, then the max of the partial
    maxima (chain, _Config.rmax_chain: each chunk's reduce starts from the previous chunks' max instead)."""
    if split is None or len(split) < 2:
        nisa.tensor_reduce(dst=m_t[:rows], op=nl.maximum, data=sc[:rows, :cols], axis=(1,))
        return
    part = nl.ndarray((P_MAX, 4), dtype=nl.float32, buffer=nl.sbuf)
    if not chain:
        for i, (c0, c1) in enumerate(split):
            nisa.tensor_reduce(dst=part[:rows, i:i + 1], op=nl.maximum, data=sc[:rows, c0:c1], axis=(1,))
        nisa.tensor_reduce(dst=m_t[:rows], op=nl.maximum, data=part[:rows, :len(split)], axis=(1,))
        return
    c0, c1 = split[0]
    nisa.tensor_reduce(dst=part[:rows, 0:1], op=nl.maximum, data=sc[:rows, c0:c1], axis=(1,))
    # chain (_Config.rmax_chain): every later chunk's reduce continues the running max (load_reduce from the
    # previous chunks' max), so no separate max of the partial maxima; its elementwise output (x * 1) is unused
    junk = nl.ndarray((P_MAX, FA_SUB), dtype=nl.bfloat16, buffer=nl.sbuf)
    for i in range(1, len(split)):
        c0, c1 = split[i]
        res = m_t[:rows] if i == len(split) - 1 else part[:rows, i:i + 1]
        nisa.tensor_scalar_reduce(dst=junk[:rows, :c1 - c0], data=sc[:rows, c0:c1], op0=nl.multiply, operand0=1.0,
                                  reduce_op=nl.maximum, reduce_res=res, reduce_cmd=nisa.reduce_cmd.load_reduce,
                                  reduce_init=part[:rows, i - 1:i])


def _online_step(cfg, st, sm, sc, rows, nb, cols, v, blocks, gate=None, pv=None, prev=None, pre_pv=None, split=None,
                 p128=False):
    """One online-softmax update over the masked scores sc[:rows, :cols] + PV.

    blocks: (first column, column stride, positions K, V block index) of each P^T block.
    With a runtime gate (ragged contexts) the step runs inside a loop of 0 or 1 iterations, so it updates the
    state (m, l, the pending alpha, acc) in place: tensors allocated in a runtime loop do not outlive it.
    pre_pv: issued after the step's statistics, before the PV (the V scrub of a slot this step reads first).
    """
    if gate is not None:
        alt = _alpha_bufs(sm, rows) if split and cfg.tail_halves and not st.pvt else None
        if p128:
            nl.fori_loop(0, gate, lambda _i: _online_step_p128(cfg, st, sm, sc, rows, nb, v, blocks, pv, prev,
                                                               pre_pv, alt))
            return
        nl.fori_loop(0, gate, lambda _i: _online_step_inplace(cfg, st, sm, sc, rows, nb, cols, v, blocks, pv,
                                                              prev, pre_pv, split, alt))
        return
    scale = cfg.scale
    m_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    _row_max(m_t, sc, rows, cols, split, cfg.rmax_chain)
    m_new = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=m_new[:rows], data1=sm.m[:rows], data2=m_t[:rows], op=nl.maximum)
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias[:rows], data=m_new[:rows], op0=nl.multiply, operand0=-scale)
    alpha = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=alpha[:rows], op=nl.exp, data=sm.m[:rows], bias=nbias[:rows], scale=scale)
    if st.pvt:      # acc^T in PSUM (the new tokens' PV) times alpha, while ScalarE computes P
        _rescale_t(st, alpha, rows)
    p = nl.ndarray((P_MAX, FA_SUB), dtype=nl.bfloat16, buffer=nl.sbuf)
    l_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p[:rows, :cols], op=nl.exp, data=sc[:rows, :cols], bias=nbias[:rows], scale=scale,
                    reduce_op=nl.add, reduce_res=l_t[:rows], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    l_new = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=l_new[:rows], data=sm.l[:rows], op0=nl.multiply, operand0=alpha[:rows],
                              op1=nl.add, operand1=l_t[:rows])
    # P^T blocks [positions, rows] via TensorE transposes (one PSUM bank), then PV with every batch's V side by
    # side (only the diagonal blocks are used).
    pT = _p_transposes(st, p, rows, blocks)
    _pT_copy(st, pT, rows, blocks)
    if pre_pv is not None:
        pre_pv()
    if not st.pvt:
        _flush_acc(cfg, st, sm, rows, nb)     # previous step's PV, placed after this step's statistics on VectorE
    _pv(cfg, st, pT, v, rows, nb, blocks, pv)
    sm.m, sm.l, sm.pending = m_new, l_new, alpha


def _group_cols(cfg, G, nb):
    """Accumulator columns [c0, c1) and batches [b0, b1) of PV group G (ragged._pv_group batches of d columns)."""
    per = _pv_group(cfg)
    b0, b1 = G * per, min(nb, (G + 1) * per)
    return b0 * cfg.d, b1 * cfg.d, b0, b1


def _alpha_bufs(sm, rows):
    """(alpha of the previous step, this step's alpha buffer, m before this step, this step's m buffer): two buffers
    of each alternating by step (static parity: the steps are unrolled), the first previous ones step 0's. The m
    buffers hold m on both partition halves (rows + 64 .. as rows: _online_step_p128)."""
    if sm.alt is None:
        sm.alt = tuple(nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf) for _ in range(4))
        m0 = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        for h0 in (0, P_MAX // 2):
            nisa.tensor_copy(dst=m0[h0:h0 + rows], src=sm.m[:rows], engine=nisa.engine.gpsimd)
        sm.alt_prev = (sm.pending, m0)
    k = sm.alt_n % 2
    cur = (sm.alt[k], sm.alt[2 + k])
    prev = sm.alt_prev
    sm.alt_prev, sm.alt_n = cur, sm.alt_n + 1
    return prev[0], cur[0], prev[1], cur[1]


def _p128_steps(cfg, st, steps, rows):
    """_Config.tail_halves, the kernel's last pack of 64 rows: when every in-place step (k >= 1) has the row-major
    layout of ni blocks (P^T block il = the score columns il::ni over both 512-column chunks), each such step puts
    the scores of blocks il < ni / 2 on partitions 0..63 and the others on 64..127 ([128, 64 ni] in one PSUM bank),
    so its row max, exp and P^T transposes stream half the columns on all 128 partitions. Builds each step's mask
    thresholds for both halves (the upper half's key offsets start at ni / 2: thresholds - ni / 2)."""
    half = P_MAX // 2
    if not (cfg.tail_halves and st.last_pack and rows == half and not cfg.pmajor and not cfg.split and not st.pvt
            and len(steps) > 1):
        return
    for step in steps[1:]:
        ni = len(step.blocks)
        if not (step.thr_lo is None and ni % 2 == 0 and step.cols == P_MAX * ni and P_MAX * ni // 2 <= PSUM_F
                and step.chunks == ((0, half * ni, ni), (half * ni, P_MAX * ni, ni))
                and all(b[:3] == (i, ni, P_MAX) for i, b in enumerate(step.blocks))):
            return
    tdt = nl.float32 if cfg.mask_dve else nl.int16     # VectorE masks (mask_dve): fp32 thresholds
    for step in steps[1:]:
        h = len(step.blocks) // 2
        out = []
        for thr in (step.thr_rot if step.thr_rot is not None else (step.thr_hi,)):
            t2 = nl.ndarray((P_MAX, 1), dtype=tdt, buffer=nl.sbuf)
            nisa.tensor_copy(dst=t2[:half], src=thr[:half])
            nisa.tensor_scalar(dst=t2[half:], data=thr[:half], op0=nl.add, operand0=-h)
            out.append(t2)
        step.halves = tuple(out)


def _step_scores_p128(cfg, consts, qm, kT, sc, key, rows, nb, step, j0, w, lane=0):
    """_step_scores in the _Config.tail_halves layout: partition half e (rows e*64 ..) holds the scores of the blocks
    il = e*h .. e*h + h - 1 (h = ni / 2), column q*h + il - e*h <-> position q*n + i0 + il (one 512-column chunk per
    half); the masks are built over both halves at once (the upper half's thresholds shifted by -h). lane and qm as
    in _step_scores (a one-batch stack on its other half; kt_swap's buffers: the swapped queries)."""
    n, ni = w // P_MAX, len(step.blocks)
    h, half = ni // 2, P_MAX // 2
    cols = P_MAX * h
    m = _threshold_mask(key, step.halves, nl.greater, P_MAX, cols)     # rotated slots: a threshold per half of q
    sg = step.stack_gates
    k_rot = cfg.k_plain and _v_rotated(cfg, j0, w)
    i0 = step.pos0 - j0
    # one mask matmul (MASK_NEG * I, [128, 128]) for both halves; ragged: it opens both accumulation groups, the
    # stacks run gated
    fold = dict(dst=sc[:, :cols].reshape((P_MAX, P_MAX, h)), stationary=consts.neg_eye,
                moving=m[:, :cols].reshape((P_MAX, P_MAX, h)))
    if sg is not None:
        nisa.nc_matmul(**fold, accumulate=False)
    for e in range(2):
        pe = slice(e * half, e * half + rows)
        dst = sc[pe, :cols].reshape((rows, P_MAX, h))
        for jj in range(_stacks(cfg, nb)):
            kp = _stack_rows(cfg, jj, nb)
            b0 = lane * cfg.kd if kp == cfg.kd else 0
            parts = [(0, P_MAX, 0)]
            if k_rot and _rot_batch(cfg, jj * cfg.kpp):     # a rotated stack: plain block (q + 64) % 128
                parts = [(0, half, half), (half, P_MAX, 0)]
            mov = [((q0, q1), _kview(cfg, kT, jj, kp, n * P_MAX, (kp, P_MAX, n),
                                     (slice(None), slice(qk, qk + q1 - q0), slice(i0 + e * h, i0 + e * h + h)), b0))
                   for q0, q1, qk in parts]

            def scores(_i, jj=jj, kp=kp, mov=mov, dst=dst, b0=b0, acc=(sg is not None or jj > 0)):
                for (q0, q1), mv in mov:
                    nisa.nc_matmul(dst=dst[:, q0:q1, :], stationary=qm[b0:b0 + kp, jj, :rows], moving=mv,
                                   accumulate=acc)
            if sg is not None:
                nl.fori_loop(0, sg[jj // cfg.halves], scores)
                continue
            scores(0)
    if sg is None:
        nisa.nc_matmul(**fold, accumulate=True)


def _online_step_p128(cfg, st, sm, sc, rows, nb, v, blocks, pv, prev, pre_pv, alt):
    """_online_step_inplace for a _Config.tail_halves step (scores [128, 64 ni]: blocks il < h on partitions 0..63, the
    others on 64..127, h = ni / 2): one row max over both halves, then each row's max on both halves (a VectorE
    and a GpSimd max across the halves); m kept on both halves (_alpha_bufs); one exp over [128, 64 ni]; h
    transposes of [128, 128] (P^T blocks il and il + h side by side); l += both halves' sums."""
    scale = cfg.scale
    a_prev, a_cur, m_prev, m_cur = alt
    ni = len(blocks)
    h, half = ni // 2, P_MAX // 2
    cols = P_MAX * h
    part = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=part, op=nl.maximum, data=sc[:, :cols], axis=(1,))
    m_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=m_t[:half], data1=part[:half], data2=part[half:], op=nl.maximum)
    nisa.tensor_tensor(dst=m_t[half:], data1=part[half:], data2=part[:half], op=nl.maximum,
                       engine=nisa.engine.gpsimd)
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias, data=m_prev, op0=nl.maximum, operand0=m_t, op1=nl.multiply, operand1=-scale)
    nisa.tensor_tensor(dst=m_cur, data1=m_prev, data2=m_t, op=nl.maximum, engine=nisa.engine.gpsimd)
    p = nl.ndarray((P_MAX, FA_SUB // 2), dtype=nl.bfloat16, buffer=nl.sbuf)
    l_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p[:, :cols], op=nl.exp, data=sc[:, :cols], bias=nbias, scale=scale, reduce_op=nl.add,
                    reduce_res=l_t, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    pT = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
    for j in range(h):
        nisa.nc_transpose(dst=st.ps_t[:, j, :], data=p[:, j:j + (P_MAX - 1) * h + 1:h])
    _flush_inplace(cfg, st, sm, rows, nb, prev, a_prev)    # previous step's PV: acc = acc * alpha_prev + PV
    nisa.activation(dst=a_cur[:rows], op=nl.exp, data=m_prev[:rows], bias=nbias[:rows], scale=scale)  # alpha
    nisa.tensor_tensor(dst=sm.l[:rows], data1=sm.l[:rows], data2=a_cur[:rows], op=nl.multiply,
                       engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=sm.l[:rows], data1=sm.l[:rows], data2=l_t[:rows], op=nl.add, engine=nisa.engine.gpsimd)
    nisa.tensor_tensor(dst=sm.l[:rows], data1=sm.l[:rows], data2=l_t[half:half + rows], op=nl.add,
                       engine=nisa.engine.gpsimd)
    nisa.tensor_copy(dst=sm.pending[:rows], src=a_cur[:rows], engine=nisa.engine.gpsimd)
    nisa.activation(dst=pT[:, :h, :], op=nl.copy, data=st.ps_t[:, :h, :])   # ScalarE
    if pre_pv is not None:
        pre_pv()
    _pv(cfg, st, pT, v, rows, nb, blocks, pv, ph=h)


def _online_step_inplace(cfg, st, sm, sc, rows, nb, cols, v, blocks, pv=None, prev=None, pre_pv=None, split=None,
                         alt=None):
    """_online_step writing the state in place (after a first step gave it its buffers), with the same VectorE /
    ScalarE instruction counts: nbias = -scale * max(m, rowmax) in one op; the previous step's PV is flushed before
    alpha overwrites the pending one; then l and m are updated in place. pv / prev (ragged, see
    ragged._stack_gates): per PV group, runtime trip counts of this step's PV matmuls / of the flush of the previous
    step's PV."""
    scale = cfg.scale
    a_prev, a_cur, m_prev, m_cur = alt if alt is not None else (sm.pending, sm.pending, sm.m, sm.m)
    m_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    _row_max(m_t, sc, rows, cols, split, cfg.rmax_chain)
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=nbias[:rows], data=m_prev[:rows], op0=nl.maximum, operand0=m_t[:rows], op1=nl.multiply,
                       operand1=-scale)
    if alt is not None:
        nisa.tensor_tensor(dst=m_cur[:rows], data1=m_prev[:rows], data2=m_t[:rows], op=nl.maximum,
                           engine=nisa.engine.gpsimd)
    if st.pvt:      # alpha first: acc^T's rescale (_rescale_t) runs while ScalarE computes P
        nisa.activation(dst=sm.pending[:rows], op=nl.exp, data=sm.m[:rows], bias=nbias[:rows], scale=scale)
        _rescale_t(st, sm.pending, rows)
    p = nl.ndarray((P_MAX, FA_SUB), dtype=nl.bfloat16, buffer=nl.sbuf)
    l_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=p[:rows, :cols], op=nl.exp, data=sc[:rows, :cols], bias=nbias[:rows], scale=scale,
                    reduce_op=nl.add, reduce_res=l_t[:rows], reduce_cmd=nisa.reduce_cmd.reset_reduce)
    pT = _p_transposes(st, p, rows, blocks)
    # The state update before the P^T copy (which waits for the transposes on TensorE): alpha no longer queues
    # behind it on ScalarE, so this step's l / m updates, which the next step's row max follows on VectorE, start
    # after the exp (modelled: trn2 GPT-OSS fp8 B=16 16K 152.81 -> 152.47 us, trn3 B=16 4K -0.3 / -0.4 %).
    _flush_inplace(cfg, st, sm, rows, nb, prev, a_prev)    # previous step's PV: acc = acc * alpha_prev + PV
    if not st.pvt:
        nisa.activation(dst=a_cur[:rows], op=nl.exp, data=m_prev[:rows], bias=nbias[:rows], scale=scale)  # alpha
    if split and cfg.tail_cuts:     # the last pack: l's update on GpSimd too (two fp32 ops, the same rounding)
        nisa.tensor_tensor(dst=sm.l[:rows], data1=sm.l[:rows], data2=a_cur[:rows], op=nl.multiply,
                           engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(dst=sm.l[:rows], data1=sm.l[:rows], data2=l_t[:rows], op=nl.add, engine=nisa.engine.gpsimd)
        if alt is not None:
            nisa.tensor_copy(dst=sm.pending[:rows], src=a_cur[:rows], engine=nisa.engine.gpsimd)
    else:
        nisa.scalar_tensor_tensor(dst=sm.l[:rows], data=sm.l[:rows], op0=nl.multiply, operand0=sm.pending[:rows],
                                  op1=nl.add, operand1=l_t[:rows])
    # the last pack (split): m's update on GpSimd, idle by then, off the VectorE-paced step chain (modelled ragged
    # GPT-OSS B=8 64.94 -> 63.58 us); nothing on VectorE waits for it before the next step's nbias
    if alt is None:
        nisa.tensor_tensor(dst=sm.m[:rows], data1=sm.m[:rows], data2=m_t[:rows], op=nl.maximum,
                           engine=nisa.engine.gpsimd if split else nisa.engine.unknown)
    _pT_copy(st, pT, rows, blocks)
    if pre_pv is not None:
        pre_pv()
    _pv(cfg, st, pT, v, rows, nb, blocks, pv)


def _p_transposes(st, p, rows, blocks):
    """P^T blocks [positions, rows] of a step via TensorE transposes into one PSUM bank; returns the SBUF P^T it is
    copied to (_pT_copy)."""
    pT = nl.ndarray((P_MAX, TRANSPOSE_GROUP, P_MAX), dtype=nl.bfloat16, buffer=nl.sbuf)
    for i, (c0, stride, k, _vb) in enumerate(blocks):
        nisa.nc_transpose(dst=st.ps_t[:k, i, :rows], data=p[:rows, c0:c0 + (k - 1) * stride + 1:stride])
    return pT


def _pT_copy(st, pT, rows, blocks):
    """PSUM P^T -> SBUF on ScalarE."""
    nblk, kmax = len(blocks), blocks[0][2]
    nisa.activation(dst=pT[:kmax, :nblk, :rows], op=nl.copy, data=st.ps_t[:kmax, :nblk, :rows])   # ScalarE


def _pv_mms(pT, rows, blocks, ph=0):
    """(stationary, positions, V block) of a step's PV matmuls (ph: _Config.tail_halves, _pT_block)."""
    return tuple((_pT_block(pT, i, k, rows, ph), k, vb) for i, (_c0, _s, k, vb) in enumerate(blocks))


def _pv(cfg, st, pT, v, rows, nb, blocks, pv=None, ph=0):
    """PV of a step into ps_o [rows, nb * d] (every batch's V side by side; only the diagonal blocks are used).
    pv (ragged, see ragged._stack_gates): per PV group (ragged._pv_group batches) a runtime trip count; a group none
    of whose sequences reaches the step is skipped (its rows' probabilities are all 0 there), its columns keep an
    already flushed PV."""
    d = cfg.d
    if st.pvt:
        _pv_t(cfg, st, pT, v, nb, blocks, pv)
        return
    mms = _pv_mms(pT, rows, blocks, ph)
    if pv is not None:
        for G, gate in enumerate(pv):

            def group(_i, G=G):
                c0, c1, b0, b1 = _group_cols(cfg, G, nb)
                for i, (stat, k, vb) in enumerate(mms):
                    nisa.nc_matmul(dst=st.ps_o[:rows, c0:c1], stationary=stat, moving=v[:k, b0:b1, vb, :],
                                   accumulate=(i > 0))
            nl.fori_loop(0, gate, group)
        return
    half = max(1, PSUM_F // d)
    for h0 in range(0, nb, half):
        hn = min(half, nb - h0)
        for i, (stat, k, vb) in enumerate(mms):
            nisa.nc_matmul(dst=st.ps_o[:rows, h0 * d:(h0 + hn) * d], stationary=stat,
                           moving=v[:k, h0:h0 + hn, vb, :], accumulate=(i > 0))


def _pT_block(pT, i, k, rows, ph=0):
    """The PV stationary of P^T block i: pT[:k, i, :rows], or with ph (_Config.tail_halves) the rows of block i in slot
    i % ph, columns 64 * (i // ph) .."""
    if not ph:
        return pT[:k, i, :rows]
    c = i // ph * (P_MAX // 2)
    return pT[:k, i % ph, c:c + rows]


def _flush_inplace(cfg, st, sm, rows, nb, gates=None, alpha=None):
    """acc = acc * alpha + PV of the pending step, in place; with per-group gates (ragged, _stack_gates) only the
    groups whose PV is pending (the others' PSUM columns hold an already flushed PV). alpha: the pending step's
    alpha (default sm.pending)."""
    if st.pvt:      # acc^T stays in PSUM, rescaled before each step's PV (_rescale_t)
        return
    a = sm.pending if alpha is None else alpha
    if gates is None:
        n = nb * cfg.d
        nisa.scalar_tensor_tensor(dst=sm.acc[:rows, :n], data=sm.acc[:rows, :n], op0=nl.multiply,
                                  operand0=a[:rows], op1=nl.add, operand1=st.ps_o[:rows, :n])
        return
    for G, gate in enumerate(gates):

        def group(_i, G=G):
            c0, c1, _b0, _b1 = _group_cols(cfg, G, nb)
            nisa.scalar_tensor_tensor(dst=sm.acc[:rows, c0:c1], data=sm.acc[:rows, c0:c1], op0=nl.multiply,
                                      operand0=a[:rows], op1=nl.add, operand1=st.ps_o[:rows, c0:c1])
        nl.fori_loop(0, gate, group)


def _step_scores_pm(cfg, consts, qm, kT, sc, key, rows, nb, step, j0, w, lane=0):
    """Position-major scores of one step: tile il of sc [128, ni, rows] holds position q*n + i0 + il on partition q
    (V block i0 + il of the slot layout): matmul(stationary = the K^T columns of those positions (stride n),
    moving = the pack's queries), over every K^T stack; the causal mask (key > the row's first new position - 1,
    a per-column threshold here) is built on GpSimd and folded in by one MASK_NEG * I matmul over all tiles."""
    n, ni = w // P_MAX, len(step.blocks)
    i0 = step.pos0 - j0
    s3 = sc[:, :ni * rows].reshape((P_MAX, ni, rows))
    m = nl.ndarray((P_MAX, PSUM_F), dtype=nl.bfloat16, buffer=nl.sbuf)
    m3 = m[:, :ni * rows].reshape((P_MAX, ni, rows))
    nisa.tensor_tensor(dst=m3, data1=key[:, :ni].expand_dim(2).broadcast(2, rows),
                       data2=step.thr_hi[:, :rows].expand_dim(1).broadcast(1, ni), op=nl.greater,
                       engine=nisa.engine.gpsimd)
    p0 = lane * cfg.kd      # one-sequence pack with the slot on the stack's other half (_Config.kt_alt)
    for il in range(ni):
        for jj in range(_stacks(cfg, nb)):
            kp = _stack_rows(cfg, jj, nb)
            if p0:
                k3 = kT[p0:p0 + kp, jj, :n * P_MAX].reshape((kp, P_MAX, n))[:, :, i0 + il]
            else:
                k3 = _kview(cfg, kT, jj, kp, n * P_MAX, (kp, P_MAX, n), (slice(None), slice(None), i0 + il))
            nisa.nc_matmul(dst=s3[:, il, :], stationary=k3, moving=qm[p0:p0 + kp, jj, :rows],
                           accumulate=(jj > 0))
    # one fold for every tile of the step (ni * rows <= one PSUM bank; accumulation is per element)
    nisa.nc_matmul(dst=s3, stationary=consts.neg_eye, moving=m3, accumulate=True)


def _online_step_pm(cfg, consts, st, sm, sc, rows, nb, v, blocks, gate=None, pre_pv=None):
    """One online-softmax update over position-major scores sc [128 positions, ni tiles, rows] (see
    _step_scores_pm); the state (m, l [rows, 1], acc [rows, nb*d]) keeps the row layout. Row max: per-partition
    max over the tiles, one fp32 TensorE transpose, a max over the 128 columns. The row bias -scale*m is broadcast
    to every partition by one matmul (ones x diag(bias)); exp(scale*s + bias) is P^T itself (bf16), the row sums
    are a per-partition sum over the tiles and one ones-matmul, and PV uses P^T tiles directly. The second PSUM
    bank of the score buffer holds the transposed maxima, the broadcast bias and the row sums. With a runtime gate
    (ragged contexts) the state is updated in place, as in _online_step_inplace."""
    if gate is not None:
        nl.fori_loop(0, gate, lambda _i: _online_step_pm_body(cfg, consts, st, sm, sc, rows, nb, v, blocks, True,
                                                              pre_pv))
        return
    _online_step_pm_body(cfg, consts, st, sm, sc, rows, nb, v, blocks, False, pre_pv)


def _online_step_pm_body(cfg, consts, st, sm, sc, rows, nb, v, blocks, inplace, pre_pv=None):
    d, scale, ni = cfg.d, cfg.scale, len(blocks)
    s3 = sc[:, :ni * rows].reshape((P_MAX, ni, rows))
    aux = sc[:, PSUM_F:2 * PSUM_F]
    cmax = nl.ndarray((P_MAX, PMAJOR_ROWS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=cmax[:, :rows], op=nl.maximum, data=s3.permute((0, 2, 1)), axis=(2,))
    nisa.nc_transpose(dst=aux[:rows, :P_MAX], data=cmax[:, :rows])
    m_t = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=m_t[:rows], op=nl.maximum, data=aux[:rows, :P_MAX], axis=(1,))
    nbias = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
    if inplace:
        nisa.tensor_scalar(dst=nbias[:rows], data=sm.m[:rows], op0=nl.maximum, operand0=m_t[:rows],
                           op1=nl.multiply, operand1=-scale)
    else:
        m_new = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=m_new[:rows], data1=sm.m[:rows], data2=m_t[:rows], op=nl.maximum)
        nisa.tensor_scalar(dst=nbias[:rows], data=m_new[:rows], op0=nl.multiply, operand0=-scale)
        alpha = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=alpha[:rows], op=nl.exp, data=sm.m[:rows], bias=nbias[:rows], scale=scale)
    # bias broadcast: bT[q, r] = sum_k ones[k, q] * diag(nbias)[k, r] = nbias[r] on every partition q
    diag = nl.ndarray((P_MAX, PMAJOR_ROWS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=diag[:rows, :rows], data=consts.ident[:rows, :rows], op0=nl.multiply,
                       operand0=nbias[:rows])
    nisa.nc_matmul(dst=aux[:, P_MAX:P_MAX + rows], stationary=consts.ones_f32[:rows, :], moving=diag[:rows, :rows],
                   accumulate=False)
    bT = nl.ndarray((P_MAX, PMAJOR_ROWS), dtype=nl.float32, buffer=nl.sbuf)     # the scores are in PSUM too
    nisa.tensor_copy(dst=bT[:, :rows], src=aux[:, P_MAX:P_MAX + rows])
    t = nl.ndarray((P_MAX, PSUM_F), dtype=nl.float32, buffer=nl.sbuf)
    t3 = t[:, :ni * rows].reshape((P_MAX, ni, rows))
    nisa.scalar_tensor_tensor(dst=t3, data=s3, op0=nl.multiply, operand0=scale, op1=nl.add,
                              operand1=bT[:, :rows].expand_dim(1).broadcast(1, ni))
    pT = nl.ndarray((P_MAX, PSUM_F), dtype=nl.bfloat16, buffer=nl.sbuf)
    p3 = pT[:, :ni * rows].reshape((P_MAX, ni, rows))
    nisa.activation(dst=p3, op=nl.exp, data=t3)
    # row sums: the tiles summed per partition (fp32), then one ones-matmul over the partitions
    psum_q = nl.ndarray((P_MAX, PMAJOR_ROWS), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=psum_q[:, :rows], op=nl.add, data=p3.permute((0, 2, 1)), axis=(2,))
    l_t = aux[:rows, 2 * P_MAX:2 * P_MAX + 1]
    nisa.nc_matmul(dst=l_t, stationary=psum_q[:, :rows], moving=consts.ones_f32[:, :1], accumulate=False)
    if pre_pv is not None:
        pre_pv()
    n = nb * d
    if inplace:
        nisa.scalar_tensor_tensor(dst=sm.acc[:rows, :n], data=sm.acc[:rows, :n], op0=nl.multiply,
                                  operand0=sm.pending[:rows], op1=nl.add, operand1=st.ps_o[:rows, :n])
        nisa.activation(dst=sm.pending[:rows], op=nl.exp, data=sm.m[:rows], bias=nbias[:rows], scale=scale)
        nisa.scalar_tensor_tensor(dst=sm.l[:rows], data=sm.l[:rows], op0=nl.multiply, operand0=sm.pending[:rows],
                                  op1=nl.add, operand1=l_t)
        nisa.tensor_tensor(dst=sm.m[:rows], data1=sm.m[:rows], data2=m_t[:rows], op=nl.maximum)
    else:
        l_new = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=l_new[:rows], data=sm.l[:rows], op0=nl.multiply, operand0=alpha[:rows],
                                  op1=nl.add, operand1=l_t)
        _flush_acc(cfg, st, sm, rows, nb)
    half = max(1, PSUM_F // d)
    for h0 in range(0, nb, half):
        hn = min(half, nb - h0)
        for i, (_c0, _s, k, vb) in enumerate(blocks):
            nisa.nc_matmul(dst=st.ps_o[:rows, h0 * d:(h0 + hn) * d], stationary=p3[:k, i, :],
                           moving=v[:k, h0:h0 + hn, vb, :], accumulate=(i > 0))
    if not inplace:
        sm.m, sm.l, sm.pending = m_new, l_new, alpha


def _flush_acc(cfg, st, sm, rows, nb):
    """acc = acc * alpha + PV of the pending step (ps_o), or acc = PV for the first step."""
    if sm.pending is None:
        return
    if st.pvt:      # acc^T stays in PSUM, rescaled before each step's PV (_rescale_t)
        sm.pending = None
        return
    if sm.fin_gates is not None:    # ragged, per-group PV: the groups' pending PVs of the last step run
        _flush_inplace(cfg, st, sm, rows, nb, sm.fin_gates)
        sm.pending = None
        return
    acc = nl.ndarray((P_MAX, PV_COLS), dtype=nl.float32, buffer=nl.sbuf)
    n = nb * cfg.d
    if sm.acc is None:
        nisa.tensor_copy(dst=acc[:rows, :n], src=st.ps_o[:rows, :n])
    else:
        nisa.scalar_tensor_tensor(dst=acc[:rows, :n], data=sm.acc[:rows, :n], op0=nl.multiply,
                                  operand0=sm.pending[:rows], op1=nl.add, operand1=st.ps_o[:rows, :n])
    sm.acc, sm.pending = acc, None


# _Config.pv_t (st.pvt): PV with V stationary, the accumulator transposed. acc^T / ps_o hold [(b % 2, dim), row]:
# column r is query row r (batch r // R), partitions b%2 * d.. the dims of the pair's batch b; only the blocks with
# b = the row's batch are used (the others are finite: V is scrubbed). The broadcasts of a [rows, 1] vector along
# the free axis land in ps_o's second bank (the first holds the PV).
PVT_BC = PSUM_F


def _pv_t(cfg, st, pT, v, nb, blocks, pv=None):
    """PV of a step accumulated onto acc^T (ps_o[:, :rows], already rescaled by the step's alpha, _rescale_t): per
    batch pair (ragged._pv_group: a gated group when pv) and 128-position block one matmul, stationary = the
    pair's V [positions, 2 * d], moving = the pair's P^T columns (2R: the 64-cycle floor). A skipped pair keeps its
    columns (alpha = 1 on its rows: m did not change)."""
    d, R, per = cfg.d, cfg.R, _pv_group(cfg)
    for G, b0 in enumerate(range(0, nb, per)):

        def group(_i, b0=b0):
            for i, (_c0, _s, k, vb) in enumerate(blocks):
                nisa.nc_matmul(dst=st.ps_o[:per * d, b0 * R:(b0 + per) * R], stationary=v[:k, b0:b0 + per, vb, :],
                               moving=pT[:k, i, b0 * R:(b0 + per) * R], accumulate=True)
        _run(pv[G] if pv is not None else None, group)


def _bcast_rows(st, vec, rows, dve=False):
    """fp32 [128, rows]: column r = vec[r] on every partition, as ones x diag(vec) (the diagonal on VectorE, one fp32
    matmul into ps_o's second bank: exact), copied to SBUF on ScalarE (modelled trn3 GPT-OSS B=8 4K: the fastest of
    the diagonal / copy placements on GpSimd, ScalarE and VectorE, 38.06 against up to 38.50 us). dve: the copy on
    VectorE (_Config.last_half's last two steps and the normalisation: ScalarE computes the last exps then, and the
    copies queued behind them; modelled trn3 GPT-OSS B=8 4K 34.99 -> 34.66 us)."""
    diag = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=diag[:rows, :rows], data=st.consts.ident[:rows, :rows], op0=nl.multiply,
                       operand0=vec[:rows])
    bc_ps = st.ps_o[:, PVT_BC:PVT_BC + rows]
    nisa.nc_matmul(dst=bc_ps, stationary=st.consts.ones_f32[:rows, :], moving=diag[:rows, :rows], accumulate=False)
    bc = nl.ndarray((P_MAX, P_MAX), dtype=nl.float32, buffer=nl.sbuf)     # SBUF: acc^T is in PSUM (C9)
    if dve:
        nisa.tensor_copy(dst=bc[:, :rows], src=bc_ps, engine=nisa.engine.vector)
    else:
        nisa.activation(dst=bc[:, :rows], op=nl.copy, data=bc_ps)      # ScalarE
    return bc[:, :rows]


def _rescale_t(st, alpha, rows):
    """acc^T (ps_o[:, :rows], in PSUM) *= alpha along the free axis (column r: row r's alpha), in place."""
    bc = _bcast_rows(st, alpha, rows, st.bc_dve)
    nisa.tensor_tensor(dst=st.ps_o[:, :rows], data1=st.ps_o[:, :rows], data2=bc, op=nl.multiply)


def _accT_to_oT(cfg, consts, st, o_t, tile, g, p0, nb):
    """o^T[(hg*d + e) % 128, (hg*d + e) // 128, token] from the normalised acc^T o_t [(b % 2, e), row] (bf16): per
    (pair half bp, o^T half u) one matmul, stationary = the identity block of half bp, moving = the columns of the
    rows (batch j = 2i + bp, head h = u mod 2) in (head, batch) order, written to partitions u*d.. of the
    selection bank; only the diagonal blocks (the row's own batch) are read."""
    d, R, per = cfg.d, cfg.R, _pv_group(cfg)
    rows = nb * R
    nt, tb0 = tile.nt, tile.b0
    n_k = (cfg.nq * d + P_MAX - 1) // P_MAX
    ps = st.ps_sel[:, :n_k * nt].reshape((P_MAX, n_k, nt))
    c0 = p0 - tb0                        # this pack's first token column (S = 1)
    dup = P_MAX // d
    o4 = o_t[:, :rows].reshape((P_MAX, nb // per, per, R))
    for u, h0, cnt, k0 in _oT_head_runs(cfg, g):
        for bp in range(per):
            src = o4[bp * d:(bp + 1) * d, :, bp, h0:h0 + (cnt - 1) * dup + 1:dup].permute((0, 2, 1))
            nisa.nc_matmul(dst=ps[u * d:(u + 1) * d, k0:k0 + cnt, c0 + bp:c0 + nb:per],
                           stationary=consts.ident[bp * d:(bp + 1) * d, bp * d:(bp + 1) * d], moving=src,
                           accumulate=False)
