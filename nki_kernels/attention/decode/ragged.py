"""Ragged contexts: runtime trip counts that stop each sequence's loads and each pack's steps at its length.

Part of the fused decode-attention kernel (see ../DESIGN.md and ../decode_attention.py)."""

import nki.isa as nisa
import nki.language as nl

from .common import _registers
from .planning import _load_pieces


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
            for k, step in enumerate(steps):
                nisa.memset(dst=st.pos0[:, k:k + 1], value=float(step.pos0), engine=nisa.engine.gpsimd)
        f = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=f, data1=vr.max_hi.broadcast(1, ns), data2=st.pos0, op=nl.greater)
        fi = nl.ndarray((1, ns), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=fi, src=f)
        vr.step_regs = (None,) + _registers(fi[:, 1:], ns - 1)
    return vr.step_regs


def _load_gates(cfg, st, slots, nb):
    """Ragged contexts: per load piece (_load_pieces) and batch of the pack, a runtime trip count 1 iff its
    sequence has a valid row in the piece (hi > its start): loads past a sequence's length are skipped, so the HBM
    traffic follows the real lengths. What the skipped loads leave in the ring (another slot's rows, or
    uninitialised SBUF) is excluded like any other invalid row (_scrub_slot: the gate is 1 for such a batch). All
    computed at the pack's start: a load must never wait for a gate computed behind the attention's VectorE work.
    Also vr.scrub[j0]: per batch (fp32 [1, stacks * kpp]), 1 iff its sequence ends inside the slot (j0 < hi <
    j0 + w): only those lanes hold rows to exclude. A lane whose load was skipped (hi <= j0) keeps finite data (the
    ring starts zeroed, see _AttnState, and every load is scrubbed): its keys are masked, its probabilities exactly 0,
    and 0 * finite = 0; a slot past every sequence is not touched at all."""
    vr = st.cur_valid
    if not vr.load_regs:
        starts = [a for j0, w in slots for a, _ in _load_pieces(cfg, j0, w)]
        ns, npc = len(slots), len(starts)
        if st.slot0 is None:      # the plan's slot starts and ends and piece starts, built once (same plan per pack)
            st.slot0 = nl.ndarray((1, 2 * ns + npc), dtype=nl.float32, buffer=nl.sbuf)
            for k, a in enumerate([j0 for j0, _ in slots] + [j0 + w for j0, w in slots] + starts):
                nisa.memset(dst=st.slot0[:, k:k + 1], value=float(a), engine=nisa.engine.gpsimd)
        f = nl.ndarray((1, npc, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=f[:, :, :nb], data1=vr.hi_v[0:1, :nb].expand_dim(1).broadcast(1, npc),
                           data2=st.slot0[:, 2 * ns:].expand_dim(2).broadcast(2, nb), op=nl.greater)
        fi = nl.ndarray((1, npc, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=fi[:, :, :nb], src=f[:, :, :nb])
        w_pad = cfg.ngroups * cfg.kpp
        hi = vr.hi_v[0:1, :nb].expand_dim(1).broadcast(1, ns)
        inside = nl.ndarray((1, ns, w_pad), dtype=nl.float32, buffer=nl.sbuf)   # j0 < hi < j0 + w
        if nb < w_pad:
            nisa.memset(dst=inside[:, :, nb:], value=0.0)
        nisa.tensor_tensor(dst=inside[:, :, :nb], data1=hi, data2=st.slot0[:, :ns].expand_dim(2).broadcast(2, nb),
                           op=nl.greater)
        below = nl.ndarray((1, ns, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=below[:, :, :nb], data1=hi,
                           data2=st.slot0[:, ns:2 * ns].expand_dim(2).broadcast(2, nb), op=nl.less)
        nisa.tensor_tensor(dst=inside[:, :, :nb], data1=inside[:, :, :nb], data2=below[:, :, :nb], op=nl.multiply)
        for k, a in enumerate(starts):
            vr.load_regs[a] = _registers(fi[:, k, :], nb)
        for k, (j0, _w) in enumerate(slots):
            vr.scrub[j0] = inside[:, k, :]
    return vr.load_regs
