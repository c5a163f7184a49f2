"""CostReport: modelled latency, engine busy times, critical path, roofline figures; text summary; Chrome trace."""

import json
import math

from .costs import COMPUTE_ENGINES

MODELLED = "modelled"
_ENGINES = COMPUTE_ENGINES + ("dma",)
_TRACK_ORDER = ("tensor", "vector", "scalar", "gpsimd", "sync")
_CHROME_PHASES = frozenset({"X", "M", "s", "f", "i", "C"})


def _union(intervals):
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _merge(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _intersection(a, b):
    a, b = _merge(a), _merge(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _fmt_t(s):
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3f} us"
    return f"{s * 1e9:.1f} ns"


def _fmt_b(b):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{int(b)} B"


class CostReport:
    """Everything the cost model says about one kernel run. Every number here is MODELLED, not measured.

    Times in seconds, bytes in bytes, rates in FLOP/s and B/s. `events` is the scheduled timeline.
    """

    modelled = True

    def __init__(self, platform, lnc, events, kernel_name="", order="ready"):
        self.platform = platform
        self.target = platform.name
        self.lnc = lnc
        self.kernel_name = kernel_name
        self.order = order
        self.events = events
        core = platform.core
        self.latency_s = max((e.end for e in events), default=0.0)      # kernel body
        self.launch_s = core.launch_overhead_s
        self.latency_with_launch_s = self.latency_s + self.launch_s
        # busy time per core and engine (union of intervals; DMA = any queue active)
        self.busy_by_core = []
        for c in range(lnc):
            d = {}
            for eng in _ENGINES:
                d[eng] = _union(self._intervals(c, eng))
            self.busy_by_core.append(d)
        self.busy_s = {eng: max((d[eng] for d in self.busy_by_core), default=0.0) for eng in _ENGINES}
        self.instructions = {eng: sum(1 for e in events if e.engine == eng) for eng in _ENGINES + ("sync",)}
        queue_s = sum((p[2] - p[1]) for e in events for p in e.pieces)
        self.dma_queue_utilization = (queue_s / (lnc * core.dma_engines * self.latency_s)) if self.latency_s else 0.0
        # work and traffic
        self.flops_issued = sum(e.cost.flops for e in events)
        self.flops = self.flops_issued          # useful FLOPs: issued unless the caller declares them
        self.hbm_read_bytes = sum(e.cost.hbm_read for e in events)
        self.hbm_write_bytes = sum(e.cost.hbm_write for e in events)
        self.hbm_bytes = self.hbm_read_bytes + self.hbm_write_bytes
        self.dma_bytes = sum(e.cost.dma_bytes for e in events)
        # roofs: time each resource needs at its (datasheet or modelled) throughput, per logical core
        lc = platform.logical_core(lnc)
        self.roofs_s = {
            "tensor": sum(e.cost.ideal_s for e in events) / lnc,
            "vector": sum(e.cost.busy_s for e in events if e.engine == "vector") / lnc,
            "scalar": sum(e.cost.busy_s for e in events if e.engine == "scalar") / lnc,
            "gpsimd": sum(e.cost.busy_s for e in events if e.engine == "gpsimd") / lnc,
            "memory": self.hbm_bytes / lc.memory_bytes_per_s,
        }
        self.compute_roof_s = max(self.roofs_s[k] for k in COMPUTE_ENGINES)
        self.memory_roof_s = self.roofs_s["memory"]
        self.roofline_s = max(self.compute_roof_s, self.memory_roof_s)
        if self.roofline_s <= 0:
            self.bound, self.bound_engine = "latency", "none"
        elif self.memory_roof_s >= self.compute_roof_s:
            self.bound = "memory"
            self.bound_engine = "hbm" if core.hbm_bytes_per_s <= core.dma_bytes_per_s else "dma"
        else:
            self.bound = "compute"
            self.bound_engine = max(COMPUTE_ENGINES, key=lambda k: self.roofs_s[k])
        self.roofline_fraction = self.roofline_s / self.latency_s if self.latency_s else 0.0
        dt = self._matmul_dtype()
        self.peak_flops = lnc * core.peak_flops(dt[0], double_row=dt[1])
        self.peak_dtype = dt[0] + (" double_row" if dt[1] else "")
        self.memory_bytes_per_s = lc.memory_bytes_per_s
        self.hbm_bytes_per_s = lc.hbm_bytes_per_s
        self.mfu = self.roofs_s["tensor"] / self.latency_s if self.latency_s else 0.0
        self.mbu = self.hbm_bytes / (self.latency_s * lc.hbm_bytes_per_s) if self.latency_s else 0.0
        self.arithmetic_intensity = self.flops / self.hbm_bytes if self.hbm_bytes else math.inf
        self.ridge_flops_per_byte = self.peak_flops / lc.memory_bytes_per_s
        self.critical_path = self._critical_path()
        self.critical_path_s = self._critical_breakdown()
        self.limiter = max(self.critical_path_s, key=self.critical_path_s.get) if self.critical_path_s else "none"

    def declare_useful_flops(self, flops):
        """Set the FLOPs the kernel is meant to do (padding, mask folding, selection matmuls excluded): MFU and
        arithmetic intensity are then computed from them; `flops_issued` keeps what TensorE executed."""
        if flops < 0:
            raise ValueError(f"declare_useful_flops: flops={flops} must be >= 0")
        self.flops = float(flops)
        ratio = self.flops / self.flops_issued if self.flops_issued else 0.0
        self.mfu = ratio * self.roofs_s["tensor"] / self.latency_s if self.latency_s else 0.0
        self.arithmetic_intensity = self.flops / self.hbm_bytes if self.hbm_bytes else math.inf
        return self

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _intervals(self, core, engine):
        if engine == "dma":
            return [(p[1], p[2]) for e in self.events if e.core == core for p in e.pieces]
        return [(e.start, e.end) for e in self.events if e.core == core and e.engine == engine and e.end > e.start]

    def _matmul_dtype(self):
        best, best_flops = ("bfloat16", False), -1.0
        acc = {}
        for e in self.events:
            if e.engine == "tensor" and e.cost.flops:
                key = (str(e.meta.get("dtype", "bfloat16")), bool(e.meta.get("double_row")))
                acc[key] = acc.get(key, 0.0) + e.cost.flops
        for k, v in sorted(acc.items()):
            if v > best_flops:
                best, best_flops = k, v
        return best

    def overlap_s(self, engine_a, engine_b, core=0):
        """Modelled time during which both engines (or 'dma' = any queue) are busy on `core`."""
        return _intersection(self._intervals(core, engine_a), self._intervals(core, engine_b))

    def _critical_path(self):
        if not self.events:
            return []
        ev = max(self.events, key=lambda e: (e.end, -e.idx))
        path, seen = [], set()
        while ev is not None and ev.idx not in seen:
            seen.add(ev.idx)
            path.append(ev)
            ev = self.events[ev.pred] if ev.pred is not None else None
        return path[::-1]

    def _critical_breakdown(self):
        out = {}
        prev_end = 0.0
        for e in self.critical_path:
            seg = max(0.0, e.end - prev_end)
            if e.engine == "dma":
                wait_in_queue = "ring" in e.reason or "queue" in e.reason
                lat = 0.0 if wait_in_queue else min(seg, e.cost.latency_s)
                if lat:
                    out["dma latency"] = out.get("dma latency", 0.0) + lat
                if seg - lat > 0:
                    out["dma"] = out.get("dma", 0.0) + seg - lat
            elif seg > 0:
                out[e.engine] = out.get(e.engine, 0.0) + seg
            prev_end = max(prev_end, e.end)
        return out

    # ---- output ------------------------------------------------------------------------------------------------
    def to_dict(self):
        return {
            "modelled": True, "target": self.target, "lnc": self.lnc, "kernel": self.kernel_name,
            "order": self.order, "latency_s": self.latency_s, "launch_s": self.launch_s,
            "latency_with_launch_s": self.latency_with_launch_s, "flops_issued": self.flops_issued,
            "busy_s": dict(self.busy_s), "busy_by_core": self.busy_by_core,
            "instructions": dict(self.instructions), "flops": self.flops, "hbm_read_bytes": self.hbm_read_bytes,
            "hbm_write_bytes": self.hbm_write_bytes, "dma_bytes": self.dma_bytes, "mfu": self.mfu, "mbu": self.mbu,
            "arithmetic_intensity": None if math.isinf(self.arithmetic_intensity) else self.arithmetic_intensity,
            "ridge_flops_per_byte": self.ridge_flops_per_byte, "peak_flops": self.peak_flops,
            "peak_dtype": self.peak_dtype, "memory_bytes_per_s": self.memory_bytes_per_s, "roofs_s": self.roofs_s,
            "roofline_s": self.roofline_s, "bound": self.bound, "bound_engine": self.bound_engine,
            "roofline_fraction": self.roofline_fraction, "limiter": self.limiter,
            "critical_path_s": self.critical_path_s, "critical_path_len": len(self.critical_path),
            "dma_queue_utilization": self.dma_queue_utilization,
        }

    def extra_info(self, prefix="modelled_"):
        """Flat dict of the headline figures with every key labelled as modelled (for pytest-benchmark)."""
        d = self.to_dict()
        keys = ("latency_s", "latency_with_launch_s", "flops", "flops_issued", "hbm_read_bytes", "hbm_write_bytes",
                "mfu", "mbu", "arithmetic_intensity", "bound", "bound_engine", "roofline_fraction", "limiter")
        out = {f"{prefix}{k}": d[k] for k in keys}
        out.update({f"{prefix}busy_{k}_s": v for k, v in self.busy_s.items()})
        out[f"{prefix}target"] = self.target
        return out

    def summary(self):
        core = self.platform.core
        name = f" {self.kernel_name}" if self.kernel_name else ""
        lines = [
            f"nkisim cost model{name} -- ALL FIGURES MODELLED (not measured; uncalibrated datasheet constants)",
            f"  target {self.target} ({core.name}), LNC={self.lnc}, "
            f"{sum(self.instructions.values())} instructions",
            f"  modelled latency        : {_fmt_t(self.latency_s)} kernel body, "
            f"{_fmt_t(self.latency_with_launch_s)} with launch ({_fmt_t(self.launch_s)} assumed); "
            f"issue order '{self.order}'",
            f"  modelled bound          : {self.bound} ({self.bound_engine}); roofline time "
            f"{_fmt_t(self.roofline_s)} = {100 * self.roofline_fraction:.1f}% of the modelled latency",
            f"  modelled limiter        : {self.limiter} (largest share of the critical path)",
            f"  TensorE FLOPs           : {self.flops / 1e9:.3f} GFLOP useful of {self.flops_issued / 1e9:.3f} "
            f"issued; modelled MFU {100 * self.mfu:.1f}% of "
            f"{self.peak_flops / 1e12:.1f} TFLOP/s ({self.peak_dtype})",
            f"  HBM read / write        : {_fmt_b(self.hbm_read_bytes)} / {_fmt_b(self.hbm_write_bytes)}; "
            f"modelled MBU {100 * self.mbu:.1f}% of {self.hbm_bytes_per_s / 1e9:.1f} GB/s",
        ]
        ai = "inf" if math.isinf(self.arithmetic_intensity) else f"{self.arithmetic_intensity:.1f}"
        lines.append(f"  arithmetic intensity    : {ai} FLOP/B (ridge {self.ridge_flops_per_byte:.1f} FLOP/B)")
        lines.append("  modelled engine busy    : " + ", ".join(
            f"{k} {_fmt_t(v)} ({100 * v / self.latency_s if self.latency_s else 0:.0f}%)"
            for k, v in self.busy_s.items() if v > 0)
            + f"; DMA queue utilisation {100 * self.dma_queue_utilization:.0f}%")
        lines.append("  modelled roofs          : " + ", ".join(f"{k} {_fmt_t(v)}" for k, v in self.roofs_s.items()
                                                                if v > 0))
        lines.append(f"  modelled critical path  : {len(self.critical_path)} instructions; " + ", ".join(
            f"{k} {_fmt_t(v)}" for k, v in sorted(self.critical_path_s.items(), key=lambda kv: -kv[1])))
        return "\n".join(lines)

    __str__ = summary

    def chrome_trace(self):
        """Chrome/Perfetto trace-event JSON object: one process per core, one thread per engine / DMA queue."""
        tev = []
        ncores = max([e.core for e in self.events] + [self.lnc - 1]) + 1
        qbase = len(_TRACK_ORDER)
        for c in range(ncores):
            tev.append({"ph": "M", "name": "process_name", "pid": c, "tid": 0,
                        "args": {"name": f"core {c} ({self.target}, modelled)"}})
            tev.append({"ph": "M", "name": "process_sort_index", "pid": c, "tid": 0, "args": {"sort_index": c}})
            for i, eng in enumerate(_TRACK_ORDER):
                tev.append({"ph": "M", "name": "thread_name", "pid": c, "tid": i, "args": {"name": eng}})
            for q in range(self.platform.core.dma_engines):
                tev.append({"ph": "M", "name": "thread_name", "pid": c, "tid": qbase + q,
                            "args": {"name": f"dma q{q}"}})
        anchors = {}
        for e in self.events:
            args = {"seq": e.seq, "modelled": True, "reason": e.reason}
            if e.cost.flops:
                args["flops"] = e.cost.flops
            if e.cost.dma_bytes:
                args["bytes"] = e.cost.dma_bytes
                args["efficiency"] = round(e.cost.efficiency, 4)
            if e.cost.note:
                args["note"] = e.cost.note
            if e.pieces:
                for q, s, t in e.pieces:
                    tev.append({"ph": "X", "name": e.op, "cat": "dma", "pid": e.core, "tid": qbase + q,
                                "ts": round(s * 1e6, 6), "dur": round((t - s) * 1e6, 6), "args": args})
                q, s, _ = e.pieces[0]
                anchors[e.idx] = (qbase + q, s)
            elif e.end > e.start:
                tid = _TRACK_ORDER.index(e.engine) if e.engine in _TRACK_ORDER else 0
                tev.append({"ph": "X", "name": e.op, "cat": e.engine, "pid": e.core, "tid": tid,
                            "ts": round(e.start * 1e6, 6), "dur": round((e.end - e.start) * 1e6, 6), "args": args})
                anchors[e.idx] = (tid, e.start)
        flow = 0
        for e in self.events:
            if e.peer is not None and e.idx < e.peer and e.idx in anchors and e.peer in anchors:
                other = self.events[e.peer]
                for a, b in ((e, other), (other, e)):
                    flow += 1
                    ta, sa = anchors[a.idx]
                    tb, sb = anchors[b.idx]
                    tev.append({"ph": "s", "name": f"{a.op} sync", "cat": "sync", "id": flow, "pid": a.core,
                                "tid": ta, "ts": round(sa * 1e6, 6)})
                    tev.append({"ph": "f", "bp": "e", "name": f"{a.op} sync", "cat": "sync", "id": flow,
                                "pid": b.core, "tid": tb, "ts": round(sb * 1e6, 6)})
        return {"traceEvents": tev, "displayTimeUnit": "ns",
                "otherData": {"modelled": True, "generator": "nkisim.cost", "target": self.target, "lnc": self.lnc,
                              "kernel": self.kernel_name, "latency_us": self.latency_s * 1e6}}

    def save_trace(self, path):
        """Write the Chrome/Perfetto trace JSON (open in https://ui.perfetto.dev or chrome://tracing)."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path


def check_chrome_trace(obj):
    """Raise ValueError unless `obj` is a well-formed Chrome trace-event object (JSON object format)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        raise ValueError("trace must be an object with a traceEvents list")
    for i, ev in enumerate(obj["traceEvents"]):
        ph = ev.get("ph")
        if ph not in _CHROME_PHASES:
            raise ValueError(f"event {i}: bad phase {ph!r}")
        if not isinstance(ev.get("name"), str) or not isinstance(ev.get("pid"), int) \
                or not isinstance(ev.get("tid"), int):
            raise ValueError(f"event {i}: name/pid/tid missing or mistyped")
        if ph != "M" and not isinstance(ev.get("ts"), (int, float)):
            raise ValueError(f"event {i}: ts missing")
        if ph == "X" and (not isinstance(ev.get("dur"), (int, float)) or ev["dur"] < 0):
            raise ValueError(f"event {i}: X event needs dur >= 0")
        if ph == "M" and not isinstance(ev.get("args"), dict):
            raise ValueError(f"event {i}: metadata event needs args")
        if ph in ("s", "f") and "id" not in ev:
            raise ValueError(f"event {i}: flow event needs id")
    json.dumps(obj)
    return True
