"""Ragged contexts: runtime trip counts that stop each sequence's loads and each pack's steps at its length.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

from .common import _const_row, _registers
from .config import K1_PREFIX, P_MAX
from .isolation import _flag_ints
from .planning import _load_pieces, _pair_k, _piece_thresholds, _rot_batch, _whole_k


def _step_gates(cfg, st, steps):
    """Ragged contexts: per step of the plan, a runtime trip count 1 iff the step starts before the pack's longest
    sequence ends (max hi > step.pos0), else 0: its scores, softmax and PV are skipped. Skipped steps are a suffix
    (pos0 grows), so the state's last update is the last step run. Step 0 always runs (None): it gives the state
    its persistent buffers (see _online_step)."""
    vr = st.cur_valid
    if vr.step_regs is None:
        ns = len(steps)
        if st.pos0 is None:       # the plan's step starts, built once (the plan is the same for every pack)
            st.pos0 = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)
            _const_row(st.pos0, [step.pos0 for step in steps])
        f = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=f, data1=vr.max_hi.broadcast(1, ns), data2=st.pos0, op=nl.greater)
        fi = nl.ndarray((1, ns), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=fi, src=f)
        vr.step_regs = (None,) + _registers(fi[:, 1:], ns - 1)
    return vr.step_regs


def _pv_group(cfg):
    """Batches per PV group (see flash._pv): the K^T load group's (kpp), at most 128 // d (128 PV columns: fp8
    pairs stack twice as many batches per load group as PV needs together)."""
    return max(1, min(cfg.kpp, P_MAX // cfg.d))


def _group_max(cfg, vr, nb, per):
    """fp32 [1, groups]: the largest hi of each group of `per` batches of the pack (0 past nb)."""
    ngr = (nb + per - 1) // per
    hs = nl.ndarray((1, cfg.pack + per), dtype=nl.float32, buffer=nl.sbuf)
    if nb < ngr * per:
        nisa.memset(dst=hs[:, nb:ngr * per], value=0.0)
    nisa.tensor_copy(dst=hs[:, :nb], src=vr.hi_v[0:1, :nb])
    hmax = nl.ndarray((1, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=hmax[:, :ngr], op=nl.maximum, data=hs[:, :ngr * per].reshape((1, ngr, per)), axis=(2,))
    return hmax, ngr


def _group_step_regs(cfg, st, vr, ns, hmax, ngr, pending=True, first=0):
    """Per step a tuple of registers, per group 1 iff its largest hi is past the step's start (hmax > pos0), and
    with `pending` per group 1 iff it reaches the last step run (whose PV is still pending after the loop, see
    _stack_gates). first: step 0's start."""
    f = nl.ndarray((1, ns, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=f[:, :, :ngr], data1=hmax[:, :ngr].expand_dim(1).broadcast(1, ns),
                       data2=st.pos0.expand_dim(2).broadcast(2, ngr), op=nl.greater)
    fi = nl.ndarray((1, ns, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=fi[:, :, :ngr], src=f[:, :, :ngr])
    regs = tuple(_registers(fi[:, k, :], ngr) for k in range(ns))
    if not pending:
        return regs, None
    # The last step run starts at L = max(pos0 of the steps with max hi > pos0) (step 0 at least): a group's PV of
    # that step is still pending after the loop iff the group reaches it (hmax > L).
    if first > 0 and st.pos0_run is None:
        # a core scanning from a later slot (config._split_stride): step 0 runs even when no sequence reaches it,
        # so the last step run starts at step 0's start or later: compare it as -1 (the table built once)
        st.pos0_run = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=st.pos0_run[:, 0:1], value=-1.0, engine=nisa.engine.gpsimd)
        if ns > 1:
            nisa.tensor_copy(dst=st.pos0_run[:, 1:], src=st.pos0[:, 1:], engine=nisa.engine.gpsimd)
    lst = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=lst, data1=vr.max_hi.broadcast(1, ns), data2=st.pos0 if st.pos0_run is None else
                       st.pos0_run, op=nl.greater)
    nisa.tensor_tensor(dst=lst, data1=lst, data2=st.pos0, op=nl.multiply)
    last = nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=last, op=nl.maximum, data=lst, axis=(1,))
    fin = nl.ndarray((1, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=fin[:, :ngr], data=hmax[:, :ngr], op0=nl.greater, operand0=last)
    return regs, _registers(fin[:, :ngr], ngr)


def _stack_gates(cfg, st, steps, slots, nb):
    """Ragged contexts, row-major steps of a pack with several K^T load groups: per step and load group, a runtime
    trip count 1 iff one of the group's sequences has a valid row at or past the step's start (max hi > pos0):
    the group's score matmuls are skipped otherwise (its rows' scores are then the mask fold's alone: every one of
    their keys is masked). Likewise per PV group (_pv_group batches: the load group's, or half of it) for its PV
    matmuls and the flush of that PV (its columns of the accumulator: its rows' alpha is 1 and their PV exactly 0
    there). Returns (per step the load groups' trip counts, per step the PV groups', per PV group 1 iff its PV of
    the last step run is still to flush after the loop), or ((None, ...), (None, ...), None) with one load group
    (nothing to gate). Issued after the load gates (a load never waits for these registers). Also, per slot, the
    lanes a fresh ring buffer must scrub (vr.scrub_rel, see flash._ring_mode) and with a cast fp8 cache the load
    groups reaching the slot (vr.slot_act, see kv_io._cast_pairs)."""
    vr = st.cur_valid
    ngr = (nb + cfg.kpp - 1) // cfg.kpp
    if ngr < 2:
        return (None,) * len(steps), (None,) * len(steps), None
    if vr.stack_regs is None:
        ns, kpp, per = len(steps), cfg.kpp, _pv_group(cfg)
        hmax, _ = _group_max(cfg, vr, nb, kpp)
        sregs, fin = _group_step_regs(cfg, st, vr, ns, hmax, ngr, pending=per == kpp, first=steps[0].pos0)
        if per == kpp:
            pregs = sregs
        else:
            hpv, npg = _group_max(cfg, vr, nb, per)
            pregs, fin = _group_step_regs(cfg, st, vr, ns, hpv, npg, first=steps[0].pos0)
        vr.stack_regs = (sregs, pregs, fin)
        # per slot: lanes with invalid rows (hi < j0 + w) whose load group reaches j0 (hmax > j0): what a fresh
        # ring buffer must scrub when the other groups are not read (isolation._slot_gates)
        nsl, w_pad = len(slots), cfg.ngroups * kpp
        j0s = st.slot0[:, :nsl].expand_dim(2).expand_dim(3).broadcast(2, ngr).broadcast(3, kpp)
        rel = nl.ndarray((1, nsl, w_pad), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=rel.reshape((1, nsl, cfg.ngroups, kpp))[:, :, :ngr, :],
                           data1=hmax[:, :ngr].expand_dim(1).expand_dim(3).broadcast(1, nsl).broadcast(3, kpp),
                           data2=j0s, op=nl.greater)
        if nb < w_pad:
            nisa.memset(dst=rel[:, :, nb:], value=0.0)
        below = nl.ndarray((1, nsl, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=below[:, :, :nb], data1=vr.hi_v[0:1, :nb].expand_dim(1).broadcast(1, nsl),
                           data2=st.slot0[:, nsl:2 * nsl].expand_dim(2).broadcast(2, nb), op=nl.less)
        nisa.tensor_tensor(dst=rel[:, :, :nb], data1=rel[:, :, :nb], data2=below[:, :, :nb], op=nl.multiply)
        ik, iv = _flag_ints(cfg, rel, nsl, nb)
        for k, (j0, _w) in enumerate(slots):
            vr.scrub_rel[j0] = rel[:, k, :]
            vr.scrub_ints[("rel", j0)] = (ik[:, k, :], iv[:, k, :])
        if cfg.fp8 and not cfg.fp8_mm:     # per slot and group: 1 iff the group reaches j0 (the K pairs' casts)
            act = nl.ndarray((1, nsl, cfg.ngroups), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=act[:, :, :ngr], data1=hmax[:, :ngr].expand_dim(1).broadcast(1, nsl),
                               data2=st.slot0[:, :nsl].expand_dim(2).broadcast(2, ngr), op=nl.greater)
            for k, (j0, _w) in enumerate(slots):
                vr.slot_act[j0] = _registers(act[:, k, :], ngr)
    return vr.stack_regs


def _load_gates(cfg, st, slots, nb):
    """Ragged contexts: per load piece (_load_pieces, keyed (start, size)) and batch of the pack, a runtime trip count
    1 iff its sequence has a valid row in the piece (hi > its start; the first piece's prefix alternatives: iff it
    is the shortest holding the sequence's rows, see planning._first_prefixes): loads past a sequence's length are
    skipped, so the HBM traffic follows the real lengths. What the skipped loads leave in the ring (another slot's
    rows, or uninitialised SBUF) is excluded like any other invalid row (_scrub_slot: the gate is 1 for such a
    batch). All computed at the pack's start: a load must never wait for a gate computed behind the attention's
    VectorE work.
    Also vr.scrub[j0]: per batch (fp32 [1, stacks * kpp]), 1 iff its sequence ends inside the slot (j0 < hi <
    j0 + w): only those lanes hold rows to exclude. A lane whose load was skipped (hi <= j0) keeps finite data (the
    ring starts zeroed, see _AttnState, and every load is scrubbed): its keys are masked, its probabilities exactly 0,
    and 0 * finite = 0; a slot past every sequence is not touched at all."""
    vr = st.cur_valid
    # NeuronCore-v3, d < 128 (two batches per K^T stack): these compares on GpSimd, whose work at the kernel's start
    # is light (the plan's constant rows by iota runs, see common._const_row) while VectorE runs RMSNorm, RoPE, the
    # QKV evictions and the other pack tables there (modelled trn2 GPT-OSS ragged B=16 94.55 -> 91.11 us, B=8
    # 67.29 -> 66.71). d = 128 (packs of 4, twice as many) keeps VectorE: there the move lowers the VectorE roof
    # of the B = 64 rows more than their latency (Llama-8B B=64 4K x1.143 -> x1.199 of its bound). v4: VectorE.
    v3 = nisa.get_nc_version() < nisa.nc_version.gen4
    eng = nisa.engine.gpsimd if v3 and cfg.d < P_MAX else nisa.engine.vector
    if not vr.load_regs:
        pieces = [pc for j0, w in slots for pc in _load_pieces(cfg, j0, w)]
        thr = _piece_thresholds(pieces)
        starts = [t for t, _ in thr]
        ns, npc = len(slots), len(starts)
        if st.slot0 is None:      # the plan's slot starts and ends and piece starts, built once (same plan per pack)
            st.slot0 = nl.ndarray((1, 2 * ns + npc), dtype=nl.float32, buffer=nl.sbuf)
            _const_row(st.slot0, [j0 for j0, _ in slots] + [j0 + w for j0, w in slots] + starts)
        f = nl.ndarray((1, npc, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=f[:, :, :nb], data1=vr.hi_v[0:1, :nb].expand_dim(1).broadcast(1, npc),
                           data2=st.slot0[:, 2 * ns:].expand_dim(2).broadcast(2, nb), op=nl.greater, engine=eng)
        fi = nl.ndarray((1, npc, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=fi[:, :, :nb], src=f[:, :, :nb], engine=eng)
        # 1 iff hi passes a piece's threshold and not the next piece's: the prefix alternatives' gates (planning.
        # _first_prefixes) and a first piece's alone (planning._whole_k), one instruction for every piece
        df = None
        if npc > 1 and (any(t[1] for t in thr) or any(_whole_k(cfg, j0, w) is not None for j0, w in slots)):
            df = nl.ndarray((1, npc - 1, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=df[:, :, :nb], data1=f[:, :npc - 1, :nb], data2=f[:, 1:, :nb], op=nl.subtract,
                               engine=eng)
        w_pad = cfg.ngroups * cfg.kpp
        hi = vr.hi_v[0:1, :nb].expand_dim(1).broadcast(1, ns)
        inside = nl.ndarray((1, ns, w_pad), dtype=nl.float32, buffer=nl.sbuf)   # j0 < hi < j0 + w
        if nb < w_pad:
            nisa.memset(dst=inside[:, :, nb:], value=0.0)
        nisa.tensor_tensor(dst=inside[:, :, :nb], data1=hi, data2=st.slot0[:, :ns].expand_dim(2).broadcast(2, nb),
                           op=nl.greater, engine=eng)
        below = nl.ndarray((1, ns, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=below[:, :, :nb], data1=hi,
                           data2=st.slot0[:, ns:2 * ns].expand_dim(2).broadcast(2, nb), op=nl.less, engine=eng)
        nisa.tensor_tensor(dst=inside[:, :, :nb], data1=inside[:, :, :nb], data2=below[:, :, :nb], op=nl.multiply,
                           engine=eng)
        for k, pc in enumerate(pieces):
            vr.load_regs[pc] = _registers((df if thr[k][1] else fi)[:, k, :], nb)
        # k_plain pairs: batch j and j ^ kpp (registers of 1 - f for batches 0 .. npr - 1)
        k0, npr, nf = 0, (2 * (nb // 2) if cfg.kpp == 1 else nb) if cfg.k_plain and nb > cfg.kpp else 0, None
        for j0, w in slots:     # unrotated (k_plain: all) batches: K^T of the first piece alone (planning._whole_k)
            kw = _whole_k(cfg, j0, w)
            if kw is not None:
                vr.load_regs[("k1", j0)] = tuple(
                    None if _rot_batch(cfg, j) and not cfg.k_plain else _registers(df[:, k0 + kw, j:j + 1], 1)[0]
                    for j in range(nb))
            if npr and ((kw is not None and w == cfg.fa_tile) or _pair_k(cfg, slots, j0, w)):
                # k_plain, whole slots: batches 2i, 2i + 1 both needing the whole slot's K^T (f = 1: the gate of
                # the slot's second piece) load it in one dma_transpose (adjacent stacks: 8 KiB SBUF runs), each
                # alone iff f = 1 and its partner's f = 0: nested runtime loops over f and 1 - f (flash._issue_scores)
                if nf is None:      # 1 - f of every piece, one instruction per pack
                    nf = nl.ndarray((1, npc, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=nf[:, :, :nb], data=fi[:, :, :nb], op0=nl.multiply, operand0=-1.0,
                                       op1=nl.add, operand1=1.0, engine=nisa.engine.vector)
                # registered at the slot's loads (28 more register loads at each pack's start, ahead of its first
                # loads, cost the ragged B=16 row 3.6 us)
                last = len(_load_pieces(cfg, j0, w)) - 1 if kw is None else kw + 1    # the whole slot's gate
                vr.load_regs[("k2n", j0)] = (nf[:, k0 + last, :], npr)
            k0 += len(_load_pieces(cfg, j0, w))
        if cfg.k1_prefixes:
            _k1_prefix_gates(cfg, st, vr, slots, nb, eng)
        ik, iv = _flag_ints(cfg, inside, ns, nb)
        for k, (j0, _w) in enumerate(slots):
            vr.scrub[j0] = inside[:, k, :]
            vr.scrub_ints[("in", j0)] = (ik[:, k, :], iv[:, k, :])
    return vr.load_regs


def _k1_prefix_gates(cfg, st, vr, slots, nb, eng):
    """_Config.k1_prefixes: per slot with a first-piece-alone K^T load (planning._whole_k) and batch j of the pack,
    vr.load_regs[("k1p", j0)] = (g, index): g[0:1, index(j, m)] (int32) is 1 iff the sequence's hi is in
    (j0 + (m - 1) P, j0 + m P] (P = K1_PREFIX, m = 1 .. M, M P >= the first piece): the one-hot gates of the prefix
    alternatives [j0, j0 + m P), meaningful inside the first-piece-alone gate (j0 < hi <= the piece's end), where
    flash._load_k_alts registers them (once per sequence: its last slot). Two instructions per pack (m-major, so
    the thresholds j0 + m P, built once, are one iota run per m; the flags' bounds 1 and 0 set once)."""
    ks = []
    for j0, w in slots:
        kw = _whole_k(cfg, j0, w)
        if kw is not None:
            ks.append((j0, _load_pieces(cfg, j0, w)[kw][1]))
    if not ks:
        return
    m_max, nsk, pk = max(size for _j0, size in ks) // K1_PREFIX, len(ks), cfg.pack
    if st.k1_thr is None:
        never = float(cfg.s_max + 1)
        st.k1_thr = nl.ndarray((1, max(1, m_max - 1) * nsk), dtype=nl.float32, buffer=nl.sbuf)
        if m_max > 1:
            _const_row(st.k1_thr, [float(j0 + m * K1_PREFIX) if m * K1_PREFIX < size else never
                                   for m in range(1, m_max) for j0, size in ks])
        # flags hi > j0 + m P for m = 0 .. M (1 and 0 at the ends: inside the gate), m-major
        st.k1_flags = nl.ndarray((1, (m_max + 1) * nsk * pk), dtype=nl.float32, buffer=nl.sbuf)
        fl = st.k1_flags.reshape((1, m_max + 1, nsk * pk))
        nisa.memset(dst=fl[:, 0, :], value=1.0, engine=nisa.engine.gpsimd)
        nisa.memset(dst=fl[:, m_max, :], value=0.0, engine=nisa.engine.gpsimd)
    e4 = st.k1_flags.reshape((1, m_max + 1, nsk, pk))
    if m_max > 1:
        hi = vr.hi_v[0:1, :nb].expand_dim(1).broadcast(1, nsk)
        nisa.tensor_tensor(dst=e4[:, 1:m_max, :, :nb], data1=hi.expand_dim(1).broadcast(1, m_max - 1),
                           data2=st.k1_thr.reshape((1, m_max - 1, nsk)).expand_dim(3).broadcast(3, nb),
                           op=nl.greater, engine=nisa.engine.gpsimd)
    g = nl.ndarray((1, m_max * nsk * pk), dtype=nl.int32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=g.reshape((1, m_max, nsk, pk))[:, :, :, :nb], data1=e4[:, :m_max, :, :nb],
                       data2=e4[:, 1:, :, :nb], op=nl.subtract, engine=nisa.engine.gpsimd)
    for k, (j0, _size) in enumerate(ks):
        vr.load_regs[("k1p", j0)] = (g, lambda j, m, k=k: ((m - 1) * nsk + k) * pk + j, m_max)
