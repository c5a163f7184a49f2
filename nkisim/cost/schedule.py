"""Scheduler over the recorded instruction streams of one kernel run (one stream per physical core).

Two passes. First a dependency graph in *program order* (what the compiler must preserve), then a timeline under one
of two issue policies. Every rule below is cited in the design note of `nkisim.cost` (module docstring there):

- dependencies (both policies): RAW / WAR / WAW on allocation footprints (a 2-D box [rows of dim 0] x [byte
  columns] when the view fits one, else the byte range; distinct allocations never alias), address dependencies
  (`Access.deps`: index tensors, offset registers) and control dependencies (`Instruction.deps`) as RAW; inside an
  `nl.no_reorder()` block every instruction also depends on the previous instruction of the block ("no_reorder":
  the compiler inserts a dependency edge between every pair of instructions of the block);
- each compute engine and the sync engine executes its own instruction stream in order, one instruction at a time;
- a DMA is triggered from a sequencer queue (the `engine=` of dma_copy, else the compiler's default queue); after
  the fixed start latency each DMA engine ("ring") it uses moves its share in FIFO order, one transfer at a time;
- ``order="ready"`` (default): the compiler's list scheduler may reorder independent instructions ("Without this
  directive [no_reorder], the compiler scheduler is free to reorder independent operations"), modelled by an
  event-driven list schedule with program order as the priority (each free stream / DMA engine takes the ready /
  arrived instruction earliest in program order);
  ``order="program"``: no reordering — every engine stream and every DMA queue issues in program order. The docs do
  not say how well the compiler reorders, so the two are reported as bounds (`nkisim.cost.bounds`);
- under LNC=2, the k-th sync instruction of each core (core_barrier / sendrecv on the same pipe) pair up: both start
  no earlier than the later of the two cores' ready times (sendrecv then moves its data like a DMA).
"""

import heapq

from .costs import instruction_cost

ORDERS = ("ready", "program")


class Event:
    """One scheduled instruction (times in seconds, modelled)."""

    __slots__ = ("idx", "core", "seq", "op", "engine", "start", "end", "cost", "pieces", "pred", "reason", "peer",
                 "meta", "ready", "queue")

    def __init__(self, idx, core, ins, cost):
        self.idx, self.core, self.seq, self.op = idx, core, ins.seq, ins.op
        self.engine, self.cost, self.meta = cost.engine, cost, ins.meta
        self.start = self.end = self.ready = 0.0
        self.pieces = []          # DMA: [(ring, start, end)]
        self.pred = None          # index of the event that bounded this one's start
        self.reason = "start"
        self.peer = None          # LNC=2 sync partner event index
        self.queue = None         # DMA: the trigger queue it was issued on

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


def _resource(ins, cost):
    """The in-order stream an instruction occupies: a compute engine, "sync", or ("dmaq", trigger queue)."""
    if cost.engine == "dma":
        return ("dmaq", str(ins.meta.get("trigger") or "default"))
    return cost.engine


def dependency_graph(trace, spec, spans=()):
    """[(cost, [(pred, reason)])] per instruction of one core's trace, in program order."""
    writers, readers = {}, {}
    spans = sorted(spans)
    si, prev_in_span = 0, None
    nodes = []
    for i, ins in enumerate(trace):
        cost = instruction_cost(ins, spec)
        preds = []
        for r in ins.reads:
            for a, j in writers.get(r.alloc_id, ()):
                if overlaps(r, a):
                    preds.append((j, "RAW"))
        side = _side_reads(ins)
        for r in side:
            for a, j in writers.get(r.alloc_id, ()):
                if overlaps(r, a):
                    preds.append((j, "RAW register" if r.buffer == "reg" else "RAW address"))
        for w in ins.writes:
            for a, j in readers.get(w.alloc_id, ()):
                if overlaps(w, a):
                    preds.append((j, "WAR"))
            for a, j in writers.get(w.alloc_id, ()):
                if overlaps(w, a):
                    preds.append((j, "WAW"))
        # no_reorder block: an edge from the previous instruction of the same block
        while si < len(spans) and spans[si][1] <= ins.seq:
            si, prev_in_span = si + 1, None
        if si < len(spans) and spans[si][0] <= ins.seq:
            if prev_in_span is not None:
                preds.append((prev_in_span, "no_reorder"))
            prev_in_span = i
        nodes.append((cost, preds))
        # footprint tables (program order): a write that covers an earlier access retires it
        for r in ins.reads:
            readers.setdefault(r.alloc_id, []).append((r, i))
        for r in side:
            if r.buffer != "reg":
                readers.setdefault(r.alloc_id, []).append((r, i))
        for w in ins.writes:
            for table in (readers, writers):
                lst = table.get(w.alloc_id)
                if lst:
                    table[w.alloc_id] = [x for x in lst if not covers(w, x[0])]
            writers.setdefault(w.alloc_id, []).append((w, i))
    return nodes


class _CoreState:
    def __init__(self, spec):
        self.free = {}                 # resource -> (time it frees / last issue, event idx)
        self.rings = [(0.0, None)] * spec.dma_engines


class Scheduler:
    def __init__(self, core_spec, order="ready", no_reorder=None):
        if order not in ORDERS:
            raise ValueError(f"Scheduler: order={order!r}; expected one of {ORDERS}")
        self.spec = core_spec
        self.order = order
        self.no_reorder = no_reorder or {}
        self.events = []

    # ---- placing one instruction -------------------------------------------------------------------------------
    def _place(self, st, ev, res, ready, raw_preds=()):
        """Start `ev` no earlier than `ready` = (time, pred, reason) and its stream's availability."""
        t, pred, reason = ready
        cost = ev.cost
        ft, fidx = st.free.get(res, (0.0, None))
        dependent = fidx is not None and fidx in raw_preds
        if ft > t:
            busy = f"DMA queue {res[1]} issue order" if isinstance(res, tuple) else f"{res} busy"
            t, pred, reason = ft, fidx, busy
        ev.ready, ev.pred, ev.reason = t, pred, reason
        ev.start = t
        if cost.engine == "dma":
            ev.queue = res[1]
            # program order (the only caller is _run_program): the next DMA of this queue issues no earlier
            st.free[res] = (t, ev.idx)
            t0 = t + cost.latency_s
            rings = cost.rings if cost.rings else sorted(range(len(st.rings)),
                                                         key=lambda q: (st.rings[q][0], q))[:cost.pieces]
            last_end, last_q = t0, None
            for q in rings:
                qfree, qidx = st.rings[q]
                s = max(t0, qfree)
                e = s + cost.busy_s
                ev.pieces.append((q, s, e))
                st.rings[q] = (e, ev.idx)
                if e >= last_end:
                    last_end, last_q = e, (q, qfree, qidx)
            ev.end = last_end
            if last_q is not None and last_q[1] > t0 and last_q[2] is not None:
                ev.pred, ev.reason = last_q[2], f"DMA ring {last_q[0]} busy"
        else:
            ev.end = t + cost.busy_s
            if dependent and cost.dep_overhead_s:
                # reads the output of the previous instruction on the same engine: the documented static
                # instruction overhead applies (it is hidden between independent instructions)
                ev.end += cost.dep_overhead_s
            st.free[res] = (ev.end, ev.idx)
        self.events[ev.idx] = ev

    # ---- all cores ---------------------------------------------------------------------------------------------
    def run(self, traces):
        n = len(traces)
        offs, total = [], 0
        for tr in traces:
            offs.append(total)
            total += len(tr)
        self.events = [None] * total
        graphs = [dependency_graph(tr, self.spec, self.no_reorder.get(c, ())) for c, tr in enumerate(traces)]
        states = [_CoreState(self.spec) for _ in traces]
        evs = [[Event(offs[c] + i, c, ins, graphs[c][i][0]) for i, ins in enumerate(tr)] for c, tr in enumerate(traces)]
        res = [[_resource(ins, graphs[c][i][0]) for i, ins in enumerate(tr)] for c, tr in enumerate(traces)]
        # LNC sync pairing: the k-th sync instruction of each core
        syncs = [[i for i, ins in enumerate(tr) if ins.meta.get("sync")] for tr in traces]
        partner = {}
        if n == 2:
            for a, b in zip(syncs[0], syncs[1]):
                if _pairs(traces[0][a], traces[1][b]):
                    partner[(0, a)], partner[(1, b)] = (1, b), (0, a)
        if self.order == "program":
            self._run_program(traces, graphs, states, evs, res, partner, offs)
        else:
            self._run_ready(traces, graphs, states, evs, res, partner, offs)
        return self.events

    @staticmethod
    def _raw(c, i, graphs, offs):
        return {offs[c] + j for j, why in graphs[c][i][1] if why == "RAW"}

    def _ready_of(self, c, i, graphs, evs, offs):
        best = [0.0, None, "start"]
        for j, why in graphs[c][i][1]:
            e = evs[c][j]
            if e.end > best[0]:
                best = [e.end, offs[c] + j, why]
        return tuple(best)

    def _place_pair(self, pair, states, evs, res, ready, raws=((), ())):
        (c0, i0), (c1, i1) = pair
        r = {c0: ready[0], c1: ready[1]}
        late = c0 if r[c0][0] >= r[c1][0] else c1
        placed = []
        for k, (c, i) in enumerate(pair):
            rr = r[c]
            if c != late and r[late][0] > rr[0]:
                rr = (r[late][0], r[late][1], f"sync wait for core {late}")
            ev = evs[c][i]
            self._place(states[c], ev, res[c][i], rr, raws[k])
            placed.append(ev)
        placed[0].peer, placed[1].peer = placed[1].idx, placed[0].idx

    def _run_program(self, traces, graphs, states, evs, res, partner, offs):
        ptr = [0] * len(traces)

        def step(c):
            i = ptr[c]
            self._place(states[c], evs[c][i], res[c][i], self._ready_of(c, i, graphs, evs, offs),
                        self._raw(c, i, graphs, offs))
            ptr[c] += 1

        while True:
            for c, tr in enumerate(traces):
                while ptr[c] < len(tr) and (c, ptr[c]) not in partner:
                    step(c)
            waiting = [c for c, tr in enumerate(traces) if ptr[c] < len(tr)]
            if not waiting:
                break
            if len(waiting) == 2 and partner.get((0, ptr[0])) == (1, ptr[1]):
                pair = ((0, ptr[0]), (1, ptr[1]))
                ready = [self._ready_of(c, i, graphs, evs, offs) for c, i in pair]
                self._place_pair(pair, states, evs, res, ready, [self._raw(c, i, graphs, offs) for c, i in pair])
                ptr[0] += 1
                ptr[1] += 1
            else:
                for c in waiting:   # partner never reached (mismatched streams): runs locally
                    step(c)

    def _run_ready(self, traces, graphs, states, evs, res, partner, offs):
        """Event-driven list schedule: an instruction becomes ready when its last dependency ends; each engine
        stream, when free, starts the ready instruction earliest in program order (the compiler's reordering keeps
        the kernel's order as its priority and only bypasses instructions still waiting); a DMA is issued when ready
        and, after its start latency, each DMA engine it uses serves arrived transfers earliest in program order."""
        npred, succs = [], []
        for g in graphs:
            cnt = [0] * len(g)
            sc = [[] for _ in g]
            for i, (_, preds) in enumerate(g):
                for j in {j for j, _ in preds}:
                    cnt[i] += 1
                    sc[j].append(i)
            npred.append(cnt)
            succs.append(sc)
        clock = []          # (time, tiebreak, kind, payload)
        tick = [0]

        def push(t, kind, payload):
            tick[0] += 1
            heapq.heappush(clock, (t, tick[0], kind, payload))

        streams = {}        # (core, resource) -> [free time, last event idx, ready heap of (seq idx, node)]
        rings = {}          # (core, ring) -> [free time, last event idx, pending heap of (node idx, node)]
        left = {}           # DMA node -> ring pieces not finished
        parked = {}

        def ready(c, i, t):
            ev = evs[c][i]
            ev.ready, ev.pred, ev.reason = self._ready_of(c, i, graphs, evs, offs)
            ev.ready = t
            p = partner.get((c, i))
            if p is not None:
                if p not in parked:
                    parked[(c, i)] = t
                    return
                tp = parked.pop(p)
                both = max(t, tp)
                late = (c, i) if t >= tp else p
                for node, other in (((c, i), p), (p, (c, i))):
                    e, lt = evs[node[0]][node[1]], evs[late[0]][late[1]]
                    e.peer = evs[other[0]][other[1]].idx
                    if node != late and both > e.ready:
                        e.pred, e.reason = lt.pred, f"sync wait for core {late[0]}"
                    enqueue(node[0], node[1], both)
                return
            enqueue(c, i, t)

        def enqueue(c, i, t):
            ev, cost = evs[c][i], evs[c][i].cost
            ev.ready = t
            if cost.engine == "dma":
                ev.start, ev.queue = t, res[c][i][1]
                arrive = t + cost.latency_s
                if cost.rings:
                    qs = cost.rings
                else:      # no SBUF side: the least-loaded engines at arrival
                    qs = sorted(range(self.spec.dma_engines),
                                key=lambda q: (rings.get((c, q), [0.0])[0], q))[:cost.pieces]
                left[(c, i)] = len(qs)
                ev.end = arrive
                for q in qs:
                    rings.setdefault((c, q), [0.0, None, []])
                    push(arrive, "arrive", (c, q, i))
                return
            st = streams.setdefault((c, res[c][i]), [0.0, None, []])
            heapq.heappush(st[2], (i, i))
            push(t, "stream", (c, res[c][i]))

        def finish(c, i, t):
            for s2 in succs[c][i]:
                npred[c][s2] -= 1
                if npred[c][s2] == 0:
                    ready(c, s2, t)

        for c, g in enumerate(graphs):
            for i in range(len(g)):
                if npred[c][i] == 0:
                    ready(c, i, 0.0)

        while clock or parked:
            if not clock:       # partners that can never pair (mismatched streams): run locally
                for (c, i), t in sorted(parked.items()):
                    enqueue(c, i, t)
                parked.clear()
                continue
            t, _, kind, payload = heapq.heappop(clock)
            if kind == "done":
                c, i = payload
                finish(c, i, t)
            elif kind == "stream":
                st = streams[payload]
                if st[0] > t or not st[2]:
                    continue
                _, i = heapq.heappop(st[2])
                c = payload[0]
                ev, cost = evs[c][i], evs[c][i].cost
                if t > ev.ready and st[1] is not None:
                    ev.pred, ev.reason = st[1], f"{cost.engine} busy"
                ev.start = t
                ev.end = t + cost.busy_s
                if cost.dep_overhead_s and st[1] is not None and st[1] in self._raw(c, i, graphs, offs):
                    ev.end += cost.dep_overhead_s
                st[0], st[1] = ev.end, ev.idx
                push(ev.end, "done", (c, i))
                push(ev.end, "stream", payload)
            else:   # a DMA engine: "arrive" queues a transfer on it, "ring" tries to start one
                if kind == "arrive":
                    c, q, i = payload
                    payload = (c, q)
                    heapq.heappush(rings[payload][2], i)
                c, q = payload
                r = rings[payload]
                if r[0] > t or not r[2]:
                    continue
                i = heapq.heappop(r[2])      # the arrived transfer earliest in program order
                ev, cost = evs[c][i], evs[c][i].cost
                arrive = ev.ready + cost.latency_s
                if t > arrive and r[1] is not None:
                    ev.pred, ev.reason = r[1], f"DMA ring {q} busy"
                e = t + cost.busy_s
                ev.pieces.append((q, t, e))
                r[0], r[1] = e, ev.idx
                ev.end = max(ev.end, e)
                left[(c, i)] -= 1
                if left[(c, i)] == 0:
                    push(ev.end, "done", (c, i))
                push(e, "ring", payload)
        for row in evs:
            for ev in row:
                self.events[ev.idx] = ev
