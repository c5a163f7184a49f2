"""Stale cache rows excluded by selection (valid ranges per sequence, K^T / V scrubs gated at run time).

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

from .config import FA_SUB, P_MAX
from .kv_io import _start_rows
from .planning import _rot_batch, _slot_split


class _ValidRange(nl.NKIObject):
    """Scan positions holding data of each sequence of a pack: key k (scan coordinates: relative to the sequence's
    window start when the scan is windowed) is valid iff lo <= k < hi, hi = the first new position, lo = hi - W + 1
    (sliding window; None = no lower bound). fp32 per-partition tables in the two slot layouts: _k [128, stacks]
    (partition u*kd + e of load group jj <-> batch jj*kpp + u of the K^T slot) and _v [128, batches] (same on every
    partition)."""

    def __init__(self):
        self.hi_k, self.lo_k, self.hi_v, self.lo_v = None, None, None, None
        self.hi_k_sw, self.lo_k_sw = None, None     # _Config.kt_swap: hi_k / lo_k with each stack's halves
        # swapped (partition u*kd + e of load group jj <-> batch jj*kpp + 1 - u)
        self.max_hi = None                  # fp32 [1, 1]: the pack's largest hi (its longest sequence)
        self.step_regs, self.load_regs = None, {}   # runtime trip counts, shared by the KV heads
        self.stack_regs = None              # per step, per K^T load group (ragged, row-major: _stack_gates)
        self.scrub = {}                     # per slot start: fp32 [1, stacks * kpp] scrub flags (ragged)
        self.scrub_rel = {}                 # same, fresh ring buffer, per-group gates (ragged._stack_gates)
        self.scrub_ints = {}                # ("in" / "rel", j0): their trip-count tables (_flag_ints)
        self.slot_act = {}                  # per slot start (fp8 casts): per load group 1 iff it reaches the slot


def _valid_ranges(cfg, position_ids, p0, nb, tables=None):
    S, d, kpp = cfg.S, cfg.kd, cfg.kpp
    nst, npk = (nb + kpp - 1) // kpp, min(kpp, nb) * d
    pv = nl.ndarray((P_MAX, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
    if tables is not None:      # every batch of the core's, loaded once (flash._PackTables)
        c0 = p0 - tables.b0
        nisa.tensor_copy(dst=pv[:, :nb], src=tables.pos[:, c0:c0 + nb], engine=nisa.engine.gpsimd)
    else:
        nisa.dma_copy(dst=pv[:, :nb], src=position_ids.ap([[0, P_MAX], [S, nb]], offset=p0 * S))
    # NeuronCore-v4: the K^T layout's table is copied out of pv on chip (same partitions, strided columns) instead
    # of loaded: its DMAs of 4-byte runs cost 0.25-0.5 us of every DMA engine they used, ahead of the weights and
    # the K/V stream that paces trn3's B = 8 4K rows (modelled -0.2 .. -0.8 %). trn2 too since the gptoss round
    # (the GPT-OSS 4K rows are DMA-paced: -0.4 .. -1.4 %), except fp8 caches (Llama-8B fp8 B=16 16K +0.35 %).
    on_chip = nisa.get_nc_version() >= nisa.nc_version.gen4 or not cfg.fp8
    pk = nl.ndarray((P_MAX, cfg.ngroups), dtype=nl.float32, buffer=nl.sbuf)
    if cfg.kt_alt:     # one sequence, its K^T on either half of the stack (flash._kt_lanes): both halves hold it
        npk = kpp * d
        if on_chip:
            nisa.tensor_copy(dst=pk[:npk, :1], src=pv[:npk, :1], engine=nisa.engine.gpsimd)
        else:
            nisa.dma_copy(dst=pk[:npk, :1], src=position_ids.ap([[0, npk], [S, 1]], offset=p0 * S))
    elif nb % kpp:     # the last stack's missing batches: any finite value (their partitions are never read)
        nisa.memset(dst=pk[:npk, nst - 1:nst], value=0.0)
    for u in range(min(kpp, nb) if not cfg.kt_alt else 0):
        cnt = (nb - u + kpp - 1) // kpp
        if on_chip:
            nisa.tensor_copy(dst=pk[u * d:(u + 1) * d, :cnt],
                             src=pv[u * d:(u + 1) * d, u:u + kpp * (cnt - 1) + 1:kpp], engine=nisa.engine.gpsimd)
        else:
            nisa.dma_copy(dst=pk[u * d:(u + 1) * d, :cnt], src=position_ids.ap([[0, d], [kpp * S, cnt]],
                                                                               offset=(p0 + u) * S))
    vr = _ValidRange()
    vr.hi_v, vr.lo_v = _range_bounds(cfg, pv, P_MAX, nb)
    vr.hi_k, vr.lo_k = _range_bounds(cfg, pk, npk, nst)
    if cfg.kt_swap:     # the ring buffers with swapped halves (flash._kt_lanes): partition u*d + e <-> 2jj + 1 - u
        ps = nl.ndarray((P_MAX, cfg.ngroups), dtype=nl.float32, buffer=nl.sbuf)
        if nb % kpp:    # the last stack's missing batch: any finite value (never read)
            nisa.memset(dst=ps[:d, nst - 1:nst], value=0.0)
        for u in range(kpp):
            cnt = (nb - (1 - u) + kpp - 1) // kpp
            if cnt == 0:
                continue
            nisa.tensor_copy(dst=ps[u * d:(u + 1) * d, :cnt],
                             src=pv[u * d:(u + 1) * d, 1 - u:1 - u + kpp * (cnt - 1) + 1:kpp],
                             engine=nisa.engine.gpsimd)
        vr.hi_k_sw, vr.lo_k_sw = _range_bounds(cfg, ps, kpp * d, nst)
    vr.max_hi = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=vr.max_hi, op=nl.maximum, data=vr.hi_v[0:1, :nb], axis=(1,))
    return vr


def _range_bounds(cfg, p, rows, cols):
    """(hi, lo) of _ValidRange from the first new positions p [rows, cols] (fp32)."""
    hi = p
    if cfg.dyn:
        start = _start_rows(cfg, p, rows, cols)
        hi = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=hi[:rows], data1=p[:rows, :cols], data2=start[:rows], op=nl.subtract)
    lo = None
    if cfg.window > 0:
        lo = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=lo[:rows], data=hi[:rows, :cols], op0=nl.add, operand0=1.0 - cfg.window)
    return hi, lo


def _slot_rel(t, rows, cols, j0, sign=1.0, add=0.0):
    """sign * (t[:rows, :cols] - j0) + add (fp32): a _ValidRange bound in the key offsets of the slot at j0."""
    if t is None:
        return None
    r = nl.ndarray((P_MAX, cols), dtype=nl.float32, buffer=nl.sbuf)
    if add == 0.0:
        nisa.tensor_scalar(dst=r[:rows], data=t[:rows, :cols], op0=nl.add, operand0=-float(j0), op1=nl.multiply,
                           operand1=sign)
        return r
    # one instruction: sign * t + (add - sign * j0) (integers and halves below 2^23: exact in fp32, as two steps)
    nisa.tensor_scalar(dst=r[:rows], data=t[:rows, :cols], op0=nl.multiply, operand0=sign, op1=nl.add,
                       operand1=add - sign * float(j0))
    return r


def _k_ramp(cfg, st, w):
    """int16 [128, w] (exact: offsets < FA_TILE_MAX; half the GpSimd time of an fp32 iota on v3): key offset
    (position - slot start) of every K^T slot column (same on every partition):
    contiguous: the column; paged (i-major, see _load_slot_paged): K = 1 column i*128 + q <-> q*n + i, K > 1
    column r*n*T + i*T + t <-> t*m + r*n + i (T = 128 / K gathered rows of m = K*n positions, see _slot_split).
    One table at a time (the contiguous one serves every slot)."""
    n, K = w // P_MAX, _slot_split(cfg, w)
    if not cfg.imajor:
        key, width, pattern = "c", cfg.fa_tile, [[1, cfg.fa_tile]]
    elif K == 1:
        key, width, pattern = f"p{n}", w, [[1, n], [n, P_MAX]]
    else:
        key, width, pattern = f"p{n}_{K}", w, [[n, K], [1, n], [K * n, P_MAX // K]]
    if st.k_ramp[0] != key:
        t = nl.ndarray((P_MAX, cfg.fa_tile), dtype=nl.int16, buffer=nl.sbuf)
        nisa.iota(dst=t[:, :width], pattern=pattern, offset=0, channel_multiplier=0)
        st.k_ramp = (key, t)
    return st.k_ramp[1]


def _v_positions(cfg, st, w, rot=False):
    """fp32 [128, blocks]: key offset of V slot block i on partition q (see _issue_scores / _load_slot_paged):
    q*n + i (i < n), the remainder block n*128 + q; paged K > 1: partition r*T + t holds t*m + r*n + i
    (T = 128 / K gathered rows of m = K*n positions, see _slot_split). rot (planning._v_rotated): blocks i < n
    hold ((q + 64) % 128)*n + i = (q*n + i + 64n) mod 128n."""
    n, rem, K = w // P_MAX, w % P_MAX, _slot_split(cfg, w)
    key = (n, rem, K, rot)
    if key in st.ramps:
        return st.ramps[key]
    t = nl.ndarray((P_MAX, n + 1), dtype=nl.float32, buffer=nl.sbuf)
    if K == 1:
        if n > 0:
            nisa.iota(dst=t[:, :n], pattern=[[1, n]], offset=0, channel_multiplier=n)
            if rot:
                nisa.tensor_scalar(dst=t[:, :n], data=t[:, :n], op0=nl.add, operand0=float(P_MAX // 2 * n),
                                   op1=nl.mod, operand1=float(P_MAX * n))
        if rem:
            nisa.iota(dst=t[:, n:n + 1], pattern=[[0, 1]], offset=n * P_MAX, channel_multiplier=1)
    else:
        T, m = P_MAX // K, K * n
        q = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=q, pattern=[[0, 1]], offset=0, channel_multiplier=1)
        tt = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)            # t = q mod T
        nisa.tensor_scalar(dst=tt, data=q, op0=nl.mod, operand0=float(T))
        rn = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)            # r * n = (q - t) * n / T
        nisa.tensor_scalar(dst=rn, data=q, op0=nl.subtract, operand0=tt, op1=nl.multiply, operand1=float(n) / T)
        base = nl.ndarray((P_MAX, 1), dtype=nl.float32, buffer=nl.sbuf)          # t * m + r * n
        nisa.scalar_tensor_tensor(dst=base, data=tt, op0=nl.multiply, operand0=float(m), op1=nl.add,
                                  operand1=rn)
        i = nl.ndarray((P_MAX, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=i, pattern=[[1, n]], offset=0, channel_multiplier=0)
        nisa.tensor_scalar(dst=t[:, :n], data=i, op0=nl.add, operand0=base)
    st.ramps[key] = t
    return t


def _column_pieces(w, n):
    """Columns [0, w) in n near-equal pieces (c0, c1)."""
    cuts = [w * i // n for i in range(n + 1)]
    return tuple(zip(cuts[:-1], cuts[1:]))


def _scrub_slot(cfg, st, kT, j0, w, nb, fresh_ring=True, relaxed=False, v_mode=None, lane=0, rot=False):
    """Exclude, by selection, every K^T element of the slot [j0, j0 + w) whose position is outside its own
    sequence's valid range (st.cur_valid): rows past a sequence's length (a reused paged block's stale tail, which
    may hold NaN) and rows before a sliding window. Batch packing contracts other sequences' keys against zero
    queries and the PV matmul multiplies invalid values by zero probabilities; 0 * NaN = NaN, so invalid data must
    never reach a matmul. A bitwise AND of the bf16 bits with an int16 mask keeps a valid key exactly and leaves
    an invalid one finite (its score is masked anyway); never a multiply. Masks per stack on ScalarE, ANDs on
    GpSimd; V in _scrub_v. Each stack's / batch's scrub runs only when the slot holds one of its invalid rows (a
    runtime trip count, see _slot_gates). lane: a one-sequence pack's K^T on partitions kd..2kd (_Config.kt_alt;
    its valid-range table holds the sequence on both halves), or each stack's halves swapped (_Config.kt_swap:
    the swapped valid-range table, a last one-batch stack on partitions kd..2kd). rot: the pack's odd batches hold
    the slot rotated by half (planning._v_rotated): their partitions' masks use the rotated key offsets
    (_rot_ramp)."""
    vr = st.cur_valid
    d, kpp = cfg.kd, cfg.kpp       # kT: the load groups (fp8: the pairs before their cast)
    nst, npk = (nb + kpp - 1) // kpp, min(kpp, nb) * d
    if cfg.kt_swap and lane:    # swapped halves: the swapped tables, on every partition of the stacks
        hi_k, lo_k, n_rows = vr.hi_k_sw, vr.lo_k_sw, kpp * d
    else:                       # kt_alt: a one-sequence pack's table holds it on both halves
        hi_k, lo_k, n_rows = vr.hi_k, vr.lo_k, lane * d + npk
    # K^T mask = sign(key - hi + 1/2) as int16: 0xFFFF (-1) keeps a valid key's bits, 0x0001 (+1) leaves at most
    # the lowest mantissa bit of an invalid one (0 or a subnormal: finite, and masked anyway). On ScalarE (idle
    # here); windowed scans AND a second mask sign(lo - 1/2 - key).
    b_hi = _slot_rel(hi_k, n_rows, nst, j0, -1.0, 0.5)
    b_lo = _slot_rel(lo_k, n_rows, nst, j0, 1.0, -0.5)
    ramp = _k_ramp(cfg, st, w)
    st.gates = _slot_gates(cfg, vr, j0, w, nb, fresh_ring, relaxed, v_mode)
    # the rotated batches' key offsets (_Config.k_plain: their K^T is plain, only the score matmuls read it rotated)
    rramp = _rot_ramp(cfg, st, w, lane) if rot and not cfg.k_plain else None
    for jj in range(nst):
        kp = min(kpp, nb - jj * kpp) * d

        def stack(_i, jj=jj, kp=kp):
            for bias, sc in ((b_hi, 1.0), (b_lo, -1.0)):
                if bias is None:
                    continue
                m = nl.ndarray((P_MAX, cfg.fa_tile), dtype=nl.int16, buffer=nl.sbuf)
                q0 = lane * d if kp == d else 0     # a one-batch stack on the other half (kt_alt / kt_swap)
                ps = slice(q0, q0 + kp)
                # kpp even: the table holds each partition's own layout; kpp = 1: the odd stacks are rotated
                rp = rramp if rramp is not None and (cfg.kpp % 2 == 0 or jj % 2 == 1) else ramp
                # in column pieces (_Config.k_mask_pieces): a ready QKV eviction waits for one piece on ScalarE
                for a0, a1 in _column_pieces(w, cfg.k_mask_pieces):
                    nisa.activation(dst=m[ps, a0:a1], op=nl.sign, data=rp[ps, a0:a1], bias=bias[ps, jj:jj + 1],
                                    scale=sc)
                # the kernel's last pack (_Config.last_and_pieces): in column pieces, each score chunk waits for
                # its own
                for c0, c1 in _column_pieces(w, cfg.last_and_pieces if st.last_pack else 1):
                    _and_bits(kT[ps, jj, c0:c1], m[ps, c0:c1], vector=not _tail_rule(cfg, st) and jj % 2 == 1)
        nl.fori_loop(0, st.gates[0][jj], stack)    # runs only when a sequence of the stack has invalid rows here


def _rot_ramp(cfg, st, w, lane):
    """_k_ramp of the rotated batches (planning._v_rotated, _rot_batch: the odd batches) of a contiguous slot of w
    positions: key offset (c + 64n) mod 128n of column c < 128n (the remainder columns as the plain ramp). kpp
    even: only on the partitions of the odd batches (batch jj*kpp + (u + lane) % kpp on partitions u*kd.., see
    kv_io._load_piece), the plain ramp elsewhere; kpp = 1: every partition (the odd stacks use it). int16 (exact:
    offsets < FA_TILE_MAX), built once per (lane, n)."""
    n = w // P_MAX
    key = ("rot", n, lane if cfg.kpp % 2 == 0 else 0)
    if key in st.ramps:
        return st.ramps[key]
    hv = P_MAX // 2 * n
    t = nl.ndarray((P_MAX, cfg.fa_tile), dtype=nl.int16, buffer=nl.sbuf)
    nisa.iota(dst=t[:, :w], pattern=[[1, w]], offset=0, channel_multiplier=0)
    for u in range(cfg.kpp if cfg.kpp % 2 == 0 else 1):
        if cfg.kpp % 2 == 0 and (u + lane) % 2 == 0:
            continue     # an even batch's partitions: plain
        ps = slice(u * cfg.kd, (u + 1) * cfg.kd) if cfg.kpp % 2 == 0 else slice(0, P_MAX)
        nisa.iota(dst=t[ps, :hv], pattern=[[1, hv]], offset=hv, channel_multiplier=0)
        nisa.iota(dst=t[ps, hv:2 * hv], pattern=[[1, hv]], offset=0, channel_multiplier=0)
    st.ramps[key] = t
    return t


def _lane_flags(cfg, vr, j0, w, nb, fresh_ring, relaxed):
    """fp32 [1, stacks * kpp]: 1 for each lane (batch) of the slot [j0, j0 + w) to scrub."""
    kpp, nst = cfg.kpp, (nb + cfg.kpp - 1) // cfg.kpp
    if cfg.ragged and vr.lo_v is None and not fresh_ring:
        # precomputed at the pack's start (_load_gates): only lanes whose sequence ends inside the slot. A ring
        # buffer's use beyond the width it held so far (fresh_ring) scrubs every lane with invalid rows, loaded or
        # not, so from then on a lane whose load is skipped holds finite data (a scrubbed or valid earlier slot).
        return vr.scrub[j0]
    if relaxed:
        # a fresh ring buffer in a slot whose unreached load groups are not read (ragged._stack_gates): the lanes
        # with invalid rows of the groups reaching j0
        return vr.scrub_rel[j0]
    f = nl.ndarray((1, cfg.ngroups * kpp), dtype=nl.float32, buffer=nl.sbuf)
    if nb < nst * kpp:
        nisa.memset(dst=f[:, nb:nst * kpp], value=0.0)
    nisa.tensor_scalar(dst=f[:, :nb], data=vr.hi_v[0:1, :nb], op0=nl.less, operand0=float(j0 + w))
    if vr.lo_v is not None:
        g = nl.ndarray((1, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=g[:, :nb], data=vr.lo_v[0:1, :nb], op0=nl.greater, operand0=float(j0))
        nisa.tensor_tensor(dst=f[:, :nb], data1=f[:, :nb], data2=g[:, :nb], op=nl.maximum)
    return f


def _flag_ints(cfg, flags, ns, nb):
    """int32 trip-count tables of scrub flags fp32 [1, ns, ngroups * kpp] (per slot, per lane; 0 past nb): per K^T
    stack (the max of its lanes) [1, ns, ngroups] and per batch [1, ns, pack], two instructions for every slot."""
    kpp, nst = cfg.kpp, (nb + cfg.kpp - 1) // cfg.kpp
    iv = nl.ndarray((1, ns, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=iv[:, :, :nb], src=flags[:, :, :nb])
    ik = nl.ndarray((1, ns, cfg.ngroups), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=ik[:, :, :nst], op=nl.maximum,
                       data=flags.reshape((1, ns, cfg.ngroups, kpp))[:, :, :nst, :], axis=(3,))
    return ik, iv


def _lane_ints(cfg, vr, j0, w, nb, fresh_ring, relaxed):
    """(per K^T stack, per batch) int32 [1, n] scrub trip counts of the slot at j0 (see _lane_flags): the pack's
    precomputed tables for the ragged modes, else computed here."""
    if cfg.ragged and vr.lo_v is None and (not fresh_ring or relaxed):
        return vr.scrub_ints[("rel" if fresh_ring else "in", j0)]
    kpp, nst = cfg.kpp, (nb + cfg.kpp - 1) // cfg.kpp
    f = _lane_flags(cfg, vr, j0, w, nb, fresh_ring, relaxed)
    fv = nl.ndarray((1, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=fv[:, :nb], src=f[:, :nb])
    fk = nl.ndarray((1, cfg.ngroups), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=fk[:, :nst], op=nl.maximum, data=f[:, :nst * kpp].reshape((1, nst, kpp)), axis=(2,))
    return fk, fv


def _slot_gates(cfg, vr, j0, w, nb, fresh_ring=True, relaxed=False, v_mode=None):
    """Runtime trip counts (registers, 0 or 1) of the slot's scrub: per K^T stack and per batch, 1 iff one of its
    sequences has an invalid row in [j0, j0 + w): hi < j0 + w, or (window) lo > j0. A slot whose rows are all
    valid for its sequences (most of a long sequence's slots) is not touched. (fresh_ring, relaxed): the K^T
    buffer's state (see _lane_flags); v_mode: the V buffer's, when it differs (fp8 pairs: another ring)."""
    nst = (nb + cfg.kpp - 1) // cfg.kpp
    fk, fv = _lane_ints(cfg, vr, j0, w, nb, fresh_ring, relaxed)
    if v_mode is not None and v_mode != (fresh_ring, relaxed):
        fv = _lane_ints(cfg, vr, j0, w, nb, *v_mode)[1]
    regs = []
    for t, n in ((fk, nst), (fv, nb)):
        rs = []
        for i in range(n):
            r = nisa.register_alloc()
            nisa.register_load(dst=r, src=t[0:1, i:i + 1])
            rs.append(r)
        regs.append(tuple(rs))
    return tuple(regs)


def _v_positions_rot(cfg, st, w):
    """fp32 [128, pack, blocks]: _v_positions per batch of a pack, the rotated batches' rotated (_v_rotated,
    planning._rot_batch), built once per slot width."""
    n, rem = w // P_MAX, w % P_MAX
    key = ("vrot", n, rem)
    if key not in st.ramps:
        t = nl.ndarray((P_MAX, cfg.pack, n + 1), dtype=nl.float32, buffer=nl.sbuf)
        nblk = n + (1 if rem else 0)
        per = 2 * cfg.rot_unit      # the rotation's period in batches
        for j1 in range(min(per, cfg.pack)):
            cnt = (cfg.pack - j1 + per - 1) // per
            vp = _v_positions(cfg, st, w, _rot_batch(cfg, j1))[:, :nblk]
            nisa.tensor_copy(dst=t[:, j1:j1 + per * (cnt - 1) + 1:per, :nblk], src=vp.expand_dim(1).broadcast(1, cnt),
                             engine=nisa.engine.gpsimd)
        st.ramps[key] = t
    return st.ramps[key]


def _scrub_v(cfg, st, v, j0, w, nb, gates, defer=False, rot=False):
    """V half of _scrub_slot (issued after the first step's scores: PV needs it one step later): an int16 mask
    [128, batches, blocks] (-1 valid, 0 invalid; small, VectorE), ANDed on GpSimd. v4: a batch's V AND runs on
    the other engine than its K^T stack's (_scrub_slot alternates the stacks: even ones on GpSimd): VectorE as int32
    pairs, GpSimd as int16 (modelled trn3 B >= 8: with every V AND on VectorE, which also runs the softmax, VectorE
    paced the steps). defer: the masks now, the ANDs returned as a function to issue later (flash: inside the
    step that first reads the slot, after its statistics)."""
    vr = st.cur_valid
    d = cfg.d
    n, rem = w // P_MAX, w % P_MAX
    nblk = n + (1 if rem else 0)
    th_v, tl_v = _slot_rel(vr.hi_v, P_MAX, nb, j0), _slot_rel(vr.lo_v, P_MAX, nb, j0)
    vplain = _v_positions(cfg, st, w)[:, :nblk]
    vpos = vplain.expand_dim(1).broadcast(1, nb)
    mf = nl.ndarray((P_MAX, cfg.pack, nblk), dtype=nl.float32, buffer=nl.sbuf)
    if rot:      # the odd batches hold the slot rotated (planning._v_rotated): a per-batch table
        vb = _v_positions_rot(cfg, st, w)
        nisa.tensor_tensor(dst=mf[:, :nb, :], data1=vb[:, :nb, :nblk],
                           data2=th_v[:, :nb].expand_dim(2).broadcast(2, nblk), op=nl.less)
    else:
        nisa.tensor_tensor(dst=mf[:, :nb, :], data1=vpos, data2=th_v[:, :nb].expand_dim(2).broadcast(2, nblk),
                           op=nl.less)
    mv = nl.ndarray((P_MAX, cfg.pack, nblk), dtype=nl.int16, buffer=nl.sbuf)
    if tl_v is None:
        nisa.tensor_scalar(dst=mv[:, :nb, :], data=mf[:, :nb, :], op0=nl.multiply, operand0=-1.0)
    else:
        m2 = nl.ndarray((P_MAX, cfg.pack, nblk), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=m2[:, :nb, :], data1=vpos, data2=tl_v[:, :nb].expand_dim(2).broadcast(2, nblk),
                           op=nl.greater_equal)
        nisa.scalar_tensor_tensor(dst=mv[:, :nb, :], data=mf[:, :nb, :], op0=nl.multiply, operand0=-1.0,
                                  op1=nl.multiply, operand1=m2[:, :nb, :])
    v_pieces = max(1, n // (FA_SUB // P_MAX)) if cfg.last_and_split and st.last_pack else 1
    v4 = nisa.get_nc_version() >= nisa.nc_version.gen4
    if v4:      # see _and_bits: VectorE on int32 pairs
        mv32 = nl.ndarray((P_MAX, cfg.pack, nblk), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=mv32[:, :nb, :], src=mv[:, :nb, :])
    # _Config.pv_t: only the VectorE ANDs deferred; GpSimd's run as soon as V lands (the last slot's, deferred, were
    # the last PV's input on the tail)
    early = defer and v4 and st.pvt and not _tail_rule(cfg, st)

    def on_vector(j):
        return v4 and (_tail_rule(cfg, st) or (j // cfg.kpp) % 2 == 0)

    def ands(which=None):
        for j in range(nb):
            if which is not None and on_vector(j) != which:
                continue

            def batch(_i, j=j):
                # VectorE where the K^T stack ANDs on GpSimd (even stacks; every stack under _tail_rule)
                if on_vector(j):
                    v32 = v.view(nl.int32)
                    nisa.tensor_tensor(dst=v32[:, j, :nblk, :], data1=v32[:, j, :nblk, :],
                                       data2=mv32[:, j, :].expand_dim(2).broadcast(2, d // 2), op=nl.bitwise_and,
                                       engine=nisa.engine.vector)
                else:     # the last pack's per step's blocks (_Config.last_and_split; the remainder with the last)
                    for b0, b1 in _column_pieces(nblk, v_pieces):
                        _and_bits(v[:, j, b0:b1, :], mv[:, j, b0:b1].expand_dim(2).broadcast(2, d))
            nl.fori_loop(0, gates[j], batch)     # only a batch with invalid rows in this slot
    if early:
        ands(False)
        return lambda: ands(True)
    if defer:
        return ands
    ands()
    return None


def _tail_rule(cfg, st):
    """v4, one batch per K^T stack (d = 128), the kernel's last pack: every K^T AND on GpSimd and every V AND on
    VectorE (other packs alternate by stack). The last pack's steps run after the K/V stream has ended, with
    VectorE on the chain (row max, flushes); a K^T AND there queued ahead of the previous step's statistics on
    VectorE (program order) while GpSimd, which only builds the masks, had room. Modelled trn3 Llama-8B (µs):
    B=8 4K 53.39 -> 53.02, B=8 16K 118.58 -> 118.47, B=16 4K 86.96 -> 87.77, B=16 16K 202.98 -> 201.48."""
    return cfg.kpp == 1 and st.last_pack and nisa.get_nc_version() >= nisa.nc_version.gen4


def _and_bits(data, mask, vector=False):
    """data (bf16) &= mask (int16, same shape, contiguous): keeps data's bits where the mask is -1. GpSimd (int16
    lanes at twice its fp32 rate on NeuronCore-v3); vector=True on v4 (where GpSimd runs every dtype at the fp32
    rate): VectorE on int32 pairs (two adjacent values with their two mask halves: half the elements)."""
    if vector and nisa.get_nc_version() >= nisa.nc_version.gen4:
        d32, m32 = data.view(nl.int32), mask.view(nl.int32)
        nisa.tensor_tensor(dst=d32, data1=d32, data2=m32, op=nl.bitwise_and, engine=nisa.engine.vector)
    else:
        d16 = data.view(nl.int16)
        nisa.tensor_tensor(dst=d16, data1=d16, data2=mask, op=nl.bitwise_and, engine=nisa.engine.gpsimd)
