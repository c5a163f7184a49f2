"""List scheduler over the recorded instruction streams of one kernel run (one stream per physical core).

Rules (all modelled):
- each compute engine (tensor, vector, scalar, gpsimd) runs its instructions in program order, one at a time;
- an instruction starts when its engine is free and every producer of memory it reads has finished (RAW), every
  earlier reader of memory it overwrites has finished (WAR) and every earlier writer of it has finished (WAW);
  footprints are per allocation: a 2-D box [rows of dim 0] x [byte columns] when the view fits one, else the byte
  range; distinct allocations never alias (the allocator's address reuse is not modelled);
- DMA instructions are issued in program order (an instruction is not issued before the previous one) and, after
  the fixed start latency, split into pieces spread over the core's DMA queues, each piece going to the queue that
  frees first; queues transfer in FIFO order;
- address dependencies (`Access.deps`: the index tensor of an indirect DMA, the registers / 1-element tensors of
  a dynamic offset) and control dependencies (`Instruction.deps`: registers bounding an enclosing dynamic loop)
  are RAW dependencies of the instruction; index / offset tensors are also tracked as reads for WAR, registers
  (buffer "reg") are not (an engine reads a register when it issues the instruction);
- the sync engine (registers, loop bookkeeping) is ordered but takes no time;
- under LNC=2, the k-th sync instruction of each core (core_barrier / sendrecv on the same pipe) pair up: both
  start no earlier than the later of the two cores' ready times (sendrecv then moves its data like a DMA).
"""

from .costs import instruction_cost


class Event:
    """One scheduled instruction (times in seconds, modelled)."""

    __slots__ = ("idx", "core", "seq", "op", "engine", "start", "end", "cost", "pieces", "pred", "reason", "peer",
                 "meta", "ready")

    def __init__(self, idx, core, ins, cost):
        self.idx, self.core, self.seq, self.op = idx, core, ins.seq, ins.op
        self.engine, self.cost, self.meta = cost.engine, cost, ins.meta
        self.start = self.end = self.ready = 0.0
        self.pieces = []          # DMA: [(queue, start, end)]
        self.pred = None          # index of the event that bounded this one's start
        self.reason = "start"
        self.peer = None          # LNC=2 sync partner event index

    @property
    def duration(self):
        return self.end - self.start

    def __repr__(self):
        return (f"Event(core{self.core} #{self.seq} {self.op}@{self.engine} "
                f"{self.start * 1e6:.3f}-{self.end * 1e6:.3f}us {self.reason})")


def _box(a):
    return getattr(a, "box", None)


def overlaps(a, b):
    ba, bb = _box(a), _box(b)
    if ba is not None and bb is not None and ba[0] == bb[0]:
        return ba[1] <= bb[2] and bb[1] <= ba[2] and ba[3] < bb[4] and bb[3] < ba[4]
    return a.lo < b.hi and b.lo < a.hi


def covers(w, a):
    bw, ba = _box(w), _box(a)
    if bw is not None and ba is not None and bw[0] == ba[0]:
        return bw[1] <= ba[1] and ba[2] <= bw[2] and bw[3] <= ba[3] and ba[4] <= bw[4]
    return w.lo <= a.lo and a.hi <= w.hi


class _CoreState:
    def __init__(self, core_spec):
        self.spec = core_spec
        self.engine_free = {}          # engine -> (time, event idx)
        self.dma_issue = (0.0, None)   # last DMA issue time, event idx
        self.queues = [(0.0, None)] * core_spec.dma_engines
        self.writers = {}              # alloc_id -> [(access, end, idx)]
        self.readers = {}


class Scheduler:
    def __init__(self, core_spec):
        self.spec = core_spec
        self.events = []

    # ---- one instruction ------------------------------------------------------------------------------------
    def _ready(self, st, ins, cost):
        best = [0.0, None, "start"]

        def bump(t, idx, why):
            if t > best[0]:
                best[:] = [t, idx, why]

        for r in ins.reads:
            for a, end, idx in st.writers.get(r.alloc_id, ()):
                if overlaps(r, a):
                    bump(end, idx, "RAW")
        for r in _side_reads(ins):
            for a, end, idx in st.writers.get(r.alloc_id, ()):
                if overlaps(r, a):
                    bump(end, idx, "RAW register" if r.buffer == "reg" else "RAW address")
        for w in ins.writes:
            for a, end, idx in st.readers.get(w.alloc_id, ()):
                if overlaps(w, a):
                    bump(end, idx, "WAR")
            for a, end, idx in st.writers.get(w.alloc_id, ()):
                if overlaps(w, a):
                    bump(end, idx, "WAW")
        if cost.engine == "dma":
            t, idx = st.dma_issue
            bump(t, idx, "DMA issue order")
        else:
            t, idx = st.engine_free.get(cost.engine, (0.0, None))
            bump(t, idx, f"{cost.engine} busy")
        return tuple(best)

    def _place(self, st, core, ins, cost, ready):
        ev = Event(len(self.events), core, ins, cost)
        ev.ready, ev.pred, ev.reason = ready
        t = ev.ready
        if cost.engine == "dma":
            ev.start = t
            st.dma_issue = (t, ev.idx)
            t0 = t + cost.latency_s
            order = sorted(range(len(st.queues)), key=lambda q: (st.queues[q][0], q))[:cost.pieces]
            last_end, last_q = t0, None
            for q in order:
                qfree, qidx = st.queues[q]
                s = max(t0, qfree)
                e = s + cost.busy_s
                ev.pieces.append((q, s, e))
                st.queues[q] = (e, ev.idx)
                if e >= last_end:
                    last_end, last_q = e, (q, qfree, qidx)
            ev.end = last_end
            if last_q is not None and last_q[1] > t0 and last_q[2] is not None:
                ev.pred, ev.reason = last_q[2], f"DMA queue {last_q[0]} busy"
        else:
            ev.start = t
            ev.end = t + cost.busy_s
            st.engine_free[cost.engine] = (ev.end, ev.idx)
        self.events.append(ev)
        self._track(st, ins, ev)
        return ev

    @staticmethod
    def _track(st, ins, ev):
        for r in ins.reads:
            st.readers.setdefault(r.alloc_id, []).append((r, ev.end, ev.idx))
        for r in _side_reads(ins):
            if r.buffer != "reg":
                st.readers.setdefault(r.alloc_id, []).append((r, ev.end, ev.idx))
        for w in ins.writes:
            for table in (st.readers, st.writers):
                lst = table.get(w.alloc_id)
                if lst:
                    table[w.alloc_id] = [x for x in lst if not covers(w, x[0])]
            st.writers.setdefault(w.alloc_id, []).append((w, ev.end, ev.idx))

    # ---- all cores --------------------------------------------------------------------------------------------
    def run(self, traces):
        states = [_CoreState(self.spec) for _ in traces]
        ptr = [0] * len(traces)
        costs = [[None] * len(t) for t in traces]

        def cost_of(c):
            i = ptr[c]
            if costs[c][i] is None:
                costs[c][i] = instruction_cost(traces[c][i], self.spec)
            return costs[c][i]

        def step(c):
            ins = traces[c][ptr[c]]
            cost = cost_of(c)
            ev = self._place(states[c], c, ins, cost, self._ready(states[c], ins, cost))
            ptr[c] += 1
            return ev

        while True:
            for c, tr in enumerate(traces):
                while ptr[c] < len(tr) and not tr[ptr[c]].meta.get("sync"):
                    step(c)
            waiting = [c for c, tr in enumerate(traces) if ptr[c] < len(tr)]
            if not waiting:
                break
            if len(waiting) == 2 and _pairs(traces[0][ptr[0]], traces[1][ptr[1]]):
                ins = [traces[c][ptr[c]] for c in (0, 1)]
                cs = [cost_of(c) for c in (0, 1)]
                ready = [self._ready(states[c], ins[c], cs[c]) for c in (0, 1)]
                late = 0 if ready[0][0] >= ready[1][0] else 1
                evs = []
                for c in (0, 1):
                    r = ready[c]
                    if c != late and ready[late][0] > r[0]:
                        r = (ready[late][0], ready[late][1], f"sync wait for core {late}")
                    evs.append(self._place(states[c], c, ins[c], cs[c], r))
                    ptr[c] += 1
                evs[0].peer, evs[1].peer = evs[1].idx, evs[0].idx
            else:
                for c in waiting:   # unpaired (LNC=1 barrier, or mismatched streams): runs locally
                    step(c)
        return self.events


def _side_reads(ins):
    """Address and control dependencies of an instruction (not data it moves or computes on)."""
    out = list(ins.deps)
    for a in ins.reads:
        if a.deps:
            out.extend(a.deps)
    for a in ins.writes:
        if a.deps:
            out.extend(a.deps)
    return out


def _pairs(a, b):
    if a.op != b.op:
        return False
    if a.op == "sendrecv":
        return a.meta.get("pipe") == b.meta.get("pipe")
    return True
