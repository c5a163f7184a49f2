"""Per-instruction cost rules (nki-api.md §8.4) over the hardware table (nkisim.hardware).

`instruction_cost(ins, core_spec)` turns one recorded `Instruction` into an `OpCost`: which engine it occupies, for
how long, the DMA split over queues and fixed start latency, the TensorE FLOPs and their time at the datasheet
peak, and the HBM bytes it reads and writes. All figures are modelled.

Only `ins.reads` / `ins.writes` (the data operands) are costed; address dependencies (`Access.deps`: DMA index
tensors, offset registers) and control dependencies (`ins.deps`) only order instructions in the scheduler.
"""

import math
from dataclasses import dataclass

from .. import dtypes as _dt

HBM_BUFFERS = frozenset({"hbm", "shared_hbm", "private_hbm"})
ON_CHIP = frozenset({"sbuf", "psum"})
COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")
_LOWP = frozenset({"bfloat16", "float16"})
_FP8 = frozenset({"float8_e4m3", "float8_e5m2", "float8_e4m3fn"})
_FP32_MATMUL = frozenset({"float32"})
_SMALL_N = 128   # "compute engines typically require at least 128 elements/partition to be efficient" (perf guide)
# VectorE perf modes on NeuronCore-v3+ (nki-api.md §8.4): bf16/fp16, SBUF-only, contiguous operands.
_PERF_4X = frozenset({"tensor_copy", "tensor_scalar"})
_PERF_2X = frozenset({"tensor_tensor"})


@dataclass
class OpCost:
    engine: str                 # tensor | vector | scalar | gpsimd | dma | sync
    busy_s: float = 0.0         # engine occupancy (compute); for DMA the time of one queue piece
    latency_s: float = 0.0      # DMA fixed start latency (does not occupy a queue)
    pieces: int = 0             # DMA: number of queues the transfer is split over
    cycles: float = 0.0         # compute: engine cycles
    flops: float = 0.0          # TensorE multiply-accumulate FLOPs (2 x MAC)
    ideal_s: float = 0.0        # TensorE FLOPs at the datasheet peak for this dtype
    hbm_read: int = 0
    hbm_write: int = 0
    dma_bytes: int = 0
    efficiency: float = 1.0     # DMA efficiency from the contiguous chunk per partition
    note: str = ""
    rings: tuple = ()           # DMA: the DMA engines used (by SBUF partition), () = least-loaded `pieces` rings
    dep_overhead_s: float = 0.0  # compute: static overhead added when it reads the previous instruction's output


def _itemsize(name, default=4):
    """Bytes per element from nkisim.dtypes (the one dtype table); `default` for unknown / missing names."""
    d = _dt._BY_NAME.get(str(name))
    return d.itemsize if d is not None else default


def _per_partition(a):
    return a.nbytes // max(a.partitions, 1)


def _run(a):
    """Contiguous bytes per run; on-chip runs never cross a partition."""
    if a.buffer in ON_CHIP:
        return max(1, min(a.run_bytes, _per_partition(a)))
    return max(1, min(a.run_bytes, a.nbytes))


def _hbm_bytes(ins):
    rd = sum(a.nbytes for a in ins.reads if a.buffer in HBM_BUFFERS)
    wr = sum(a.nbytes for a in ins.writes if a.buffer in HBM_BUFFERS)
    return rd, wr


def dma_efficiency(run_bytes, core):
    """eff = run / (run + dma_overhead_bytes): per-DMA-buffer overhead (50% at 256 B, 89% at 2 KiB, 94% at 4 KiB)."""
    return run_bytes / (run_bytes + core.dma_overhead_bytes)


def _sbuf_partitions(accesses):
    """(first partition, partitions) of the SBUF side of a DMA, or None when neither side is in SBUF."""
    for a in accesses:
        if a.buffer == "sbuf":
            first = a.box[1] if a.box is not None else 0
            return first, max(1, a.partitions)
    return None


def dma_rings(first, parts, core):
    """DMA engines serving SBUF partitions [first, first + parts): each engine serves 8 consecutive partitions
    (128 partitions / 16 engines, nki-dma-overview)."""
    per = max(1, core.partitions // core.dma_engines)
    lo = (first // per) % core.dma_engines
    hi = min(core.dma_engines - 1, (first + parts - 1) // per)
    return tuple(range(lo, max(lo, hi) + 1))


def dma_cost(ins, core):
    rd, wr = _hbm_bytes(ins)
    writes = list(ins.writes)
    # dma_compute also reads its dst (read-modify-write): count that for HBM traffic, not as extra moved data
    reads = [a for a in ins.reads if not any(a.alloc_id == w.alloc_id and a.lo == w.lo and a.hi == w.hi
                                             for w in writes)]
    moved = max(sum(a.nbytes for a in reads), sum(a.nbytes for a in writes), 1)
    runs = [_run(a) for a in list(reads) + writes] or [moved]
    eff = dma_efficiency(min(runs), core)
    note = ""
    if ins.meta.get("transpose"):
        eff *= core.dma_transpose_efficiency
        note = "dma_transpose"
    if ins.meta.get("indirect"):
        note = "indirect"
    sb = _sbuf_partitions(writes) or _sbuf_partitions(reads)
    if sb is not None:
        rings = dma_rings(sb[0], sb[1], core)
        pieces = len(rings)
    else:   # HBM <-> HBM: the compiler splits the transfer over the engines (>= 2 KiB each)
        rings = ()
        pieces = min(core.dma_engines, max(1, math.ceil(moved / core.dma_min_efficient_bytes)))
    # Each engine moves its share at the engine rate, but HBM traffic of the core is capped at its HBM share.
    # A read-modify-write of an HBM dst (dma_compute accumulating into HBM) reads the dst from HBM as well as writing
    # it: that is a third HBM side sharing the same per-engine HBM bandwidth (the roofline counts both directions).
    rmw_hbm = any(a.buffer in HBM_BUFFERS for a in ins.reads if a not in reads)
    hbm_sides = (1 if any(a.buffer in HBM_BUFFERS for a in reads) else 0) + \
        (1 if any(a.buffer in HBM_BUFFERS for a in writes) else 0) + (1 if rmw_hbm else 0)
    bw = core.dma_engine_bytes_per_s
    if hbm_sides:
        bw = min(bw, core.hbm_bytes_per_s / core.dma_engines / hbm_sides)
    piece_s = core.dma_transfer_overhead_s + (moved / pieces) / (bw * eff)
    return OpCost("dma", busy_s=piece_s, latency_s=core.dma_start_latency_s, pieces=pieces, hbm_read=rd,
                  hbm_write=wr, dma_bytes=moved, efficiency=eff, note=note, rings=rings)


REGISTER_MEMORY_OPS = frozenset({"register_load", "scalar_load", "register_store", "scalar_store"})


def register_memory_cost(ins, core):
    """register_load / scalar_load read one value from HBM/SBUF into a sequencer register, register_store /
    scalar_store write one back: with HBM on the other side it is a DMA (start latency + one transfer) that the
    sequencer waits for; with SBUF one SBUF access (~60 cycles, [arch1])."""
    mem = (ins.reads if ins.op.endswith("load") else ins.writes) or ()
    a = next((x for x in mem if x.buffer != "reg"), None)
    rd, wr = _hbm_bytes(ins)
    if a is not None and a.buffer in HBM_BUFFERS:
        t = core.dma_start_latency_s + core.dma_transfer_overhead_s + a.nbytes / core.dma_engine_bytes_per_s
        return OpCost("sync", busy_s=t, hbm_read=rd, hbm_write=wr, dma_bytes=a.nbytes, note=f"{ins.op} HBM ~ DMA")
    cyc = core.sbuf_access_overhead_cycles
    return OpCost("sync", busy_s=cyc / core.scalar_clock_hz, cycles=cyc, note=f"{ins.op} SBUF access")


def _strided(a, core):
    """An SBUF operand whose innermost stride exceeds the full-bandwidth limit (>16 B, nki-api.md §8.4)."""
    return a.buffer == "sbuf" and a.stride_bytes > core.sbuf_fast_stride_bytes


def _stride_factor(ins, core):
    """Streaming-time factor of a compute instruction: 2x (half SBUF bandwidth) when any SBUF operand, read or
    written, streams with an innermost stride > 16 B. Per-partition scalars have no free-dim stride and never
    trigger it. Applied to the whole streaming part (an upper bound: "up to 2x")."""
    for a in ins.reads:
        if _strided(a, core):
            return core.sbuf_strided_factor
    for a in ins.writes:
        if _strided(a, core):
            return core.sbuf_strided_factor
    return 1.0


def _matmul_cost(ins, core):
    m = ins.meta
    k, mm, n = int(m.get("k", 128)), int(m.get("m", 128)), int(m.get("n", 1))
    if ins.op == "nc_transpose":
        # TensorE transpose = matmul with `data` [p, f] as stationary and a [p, p] identity as moving: the moving
        # free size is p (the data's partitions), not f
        n = int(m.get("p", n))
    dtypes = {str(m.get("dtype", "bfloat16")), str(m.get("stationary_dtype", m.get("dtype", "bfloat16")))}
    double_row = bool(m.get("double_row"))
    mx = ins.op.startswith("nc_matmul_mx") or bool(m.get("mx"))
    note = ""
    # the moving operand streams one column per cycle from SBUF: a >16 B innermost stride halves that rate
    stream = float(n)
    if ins.op != "nc_transpose" and len(ins.reads) > 1 and _strided(ins.reads[1], core):
        stream, note = n * core.sbuf_strided_factor, "strided moving"
    cycles = max(stream, core.matmul_min_cycles)
    if dtypes & _FP32_MATMUL:
        cycles *= 4
        note = "fp32 4x" + (", " + note if note else "")
    transpose = bool(m.get("transpose")) or ins.op == "nc_transpose"
    contraction = k * (2 if double_row else 1) * (4 if mx and core.nc_version >= 4 else 1)
    flops = 0.0 if transpose else 2.0 * contraction * mm * n
    if double_row:
        note = "double_row 2x" + (", " + note if note else "")
    dtype = "float32" if dtypes & _FP32_MATMUL else sorted(dtypes)[0]
    peak = core.peak_flops(dtype, double_row=double_row, mx=mx)
    return OpCost("tensor", busy_s=cycles / core.tensor_clock_hz, cycles=cycles, flops=flops,
                  ideal_s=flops / peak if flops else 0.0, note=note or ("transpose" if transpose else ""))


def _streaming(ins):
    """[(access, dtype)] of inputs streaming more than one element per partition (per-partition scalars are free)."""
    in_dtypes = ins.meta.get("in_dtypes") or ()
    out = []
    for i, a in enumerate(ins.reads):
        d = str(in_dtypes[i]) if i < len(in_dtypes) else ""
        if _per_partition(a) > _itemsize(d or None):
            out.append((a, d))
    return out


def _streaming_inputs(ins):
    return len(_streaming(ins))


def _all_dtypes(ins):
    """dst dtype and the dtypes of the streaming inputs."""
    return {d for _, d in _streaming(ins) if d} | {str(ins.meta.get("dtype", ""))}


def _vector_cost(ins, core):
    n = int(ins.meta.get("n", 1))
    inputs = max(1, _streaming_inputs(ins))
    sf = _stride_factor(ins, core)
    cycles = n * inputs * sf
    note = "strided SBUF 2x" if sf != 1.0 else ""
    if core.nc_version >= 3 and ins.engine == "vector":
        lowp = _LOWP | (_FP8 if core.nc_version >= 4 else frozenset())
        operands = [a for a, _ in _streaming(ins)] + list(ins.writes)
        sbuf_only = all(a.buffer == "sbuf" for a in operands)
        contiguous = all(a.run_bytes >= _per_partition(a) for a in operands)
        if sbuf_only and contiguous and _all_dtypes(ins) <= lowp:
            if ins.op in _PERF_4X:
                cycles, note = cycles / 4, "perf mode 4x"
            elif ins.op in _PERF_2X:
                cycles, note = cycles / 2, "perf mode 2x"
    return _with_static(OpCost("vector", cycles=cycles, note=note), n, core.static_instruction_cycles,
                        core.vector_clock_hz)


def _with_static(c, n, static_cycles, clock_hz):
    """Static instruction overhead, documented for 'N << 128' or 'every instruction depending on the output of the
    previous one' (trn1 arch guide, perf guide Opt #5a): always charged below 128 elements per partition, else
    left to the scheduler (`dep_overhead_s`, added only when the instruction reads its predecessor's output)."""
    if n < _SMALL_N:
        c.cycles += static_cycles
    else:
        c.dep_overhead_s = static_cycles / clock_hz
    c.busy_s = c.cycles / clock_hz
    return c


def _scalar_cost(ins, core):
    n = int(ins.meta.get("n", 1))
    lowp = _LOWP | _FP8
    width = core.scalar_elems_per_cycle_lowp if _all_dtypes(ins) <= lowp else core.scalar_elems_per_cycle
    sf = _stride_factor(ins, core)
    cycles = n * core.partitions / width * sf
    return _with_static(OpCost("scalar", cycles=cycles, note="strided SBUF 2x" if sf != 1.0 else ""), n,
                        core.scalar_fixed_cycles, core.scalar_clock_hz)


def _gpsimd_cost(ins, core):
    n = int(ins.meta.get("n", 1))
    inputs = max(1, _streaming_inputs(ins))
    sf = _stride_factor(ins, core)
    width = core.gpsimd_elems_per_cycle
    if core.nc_version <= 3:
        # v2/v3: 8 cores x 512-bit SIMD hold 16 fp32 / 32 fp16 / 64 int8 lanes each (nki-api.md §8.1)
        size = max([_itemsize(d) for d in _all_dtypes(ins) if d] or [4])
        width = width * 4 // min(4, max(1, size))
    cycles = n * inputs * core.partitions / width * sf
    return _with_static(OpCost("gpsimd", cycles=cycles, note="strided SBUF 2x" if sf != 1.0 else ""), n,
                        core.static_instruction_cycles, core.gpsimd_clock_hz)


def instruction_cost(ins, core) -> OpCost:
    """Modelled cost of one recorded instruction on `core` (a nkisim.hardware.CoreSpec)."""
    eng = ins.engine
    if ins.op in ("sendrecv",):
        c = dma_cost(ins, core)
        c.engine = "dma"
        return c
    if ins.op == "core_barrier":
        cyc = core.static_instruction_cycles
        return OpCost(eng if eng in COMPUTE_ENGINES else "gpsimd", busy_s=cyc / core.gpsimd_clock_hz, cycles=cyc,
                      note="barrier")
    if eng == "dma":
        return dma_cost(ins, core)
    if ins.op in REGISTER_MEMORY_OPS:
        return register_memory_cost(ins, core)
    if eng == "cc":     # nki.collectives: alpha-beta per algorithm on its own in-order queue (cost/collective.py)
        from .collective import collective_cost
        return collective_cost(ins, core)
    if eng == "tensor":
        return _matmul_cost(ins, core)
    if eng == "vector":
        return _vector_cost(ins, core)
    if eng == "scalar":
        return _scalar_cost(ins, core)
    if eng == "gpsimd":
        return _gpsimd_cost(ins, core)
    # sync-engine bookkeeping (registers, loop iterations): ordered but free in this model
    return OpCost("sync")
