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
    Also vr.slot_run[j0] = 1 iff the pack's steps reach the slot at j0."""
    vr = st.cur_valid
    if not vr.load_regs:
        starts = [a for j0, w in slots for a, _ in _load_pieces(cfg, j0, w)]
        ns, npc = len(slots), len(starts)
        if st.slot0 is None:      # the plan's slot and piece starts, built once (the same plan for every pack)
            st.slot0 = nl.ndarray((1, ns + npc), dtype=nl.float32, buffer=nl.sbuf)
            for k, a in enumerate([j0 for j0, _ in slots] + starts):
                nisa.memset(dst=st.slot0[:, k:k + 1], value=float(a), engine=nisa.engine.gpsimd)
        f = nl.ndarray((1, npc, cfg.pack), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=f[:, :, :nb], data1=vr.hi_v[0:1, :nb].expand_dim(1).broadcast(1, npc),
                           data2=st.slot0[:, ns:].expand_dim(2).broadcast(2, nb), op=nl.greater)
        fi = nl.ndarray((1, npc, cfg.pack), dtype=nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=fi[:, :, :nb], src=f[:, :, :nb])
        run = nl.ndarray((1, ns), dtype=nl.float32, buffer=nl.sbuf)     # 1 iff a sequence reaches the slot
        nisa.tensor_tensor(dst=run, data1=vr.max_hi.broadcast(1, ns), data2=st.slot0[:, :ns], op=nl.greater)
        for k, a in enumerate(starts):
            vr.load_regs[a] = _registers(fi[:, k, :], nb)
        for k, (j0, _w) in enumerate(slots):
            vr.slot_run[j0] = run[:, k:k + 1]
    return vr.load_regs
