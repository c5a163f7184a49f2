"""Per-instruction cost rules (nki-api.md §8.4) on hand-built instructions: exact modelled cycle counts."""

import pytest

from nkisim.cost import instruction_cost
from nkisim.cost.costs import dma_efficiency
from nkisim.hardware import HARDWARE
from nkisim.runtime import Access, Instruction

T2, T3, T1 = HARDWARE["trn2"].core, HARDWARE["trn3"].core, HARDWARE["trn1"].core


def sb(alloc, p, f, isz, buffer="sbuf", run=None):
    n = p * f * isz
    return Access(alloc, buffer, 0, n, n, p, run if run is not None else n)


def hbm(alloc, nbytes, run):
    return Access(alloc, "hbm", 0, nbytes, nbytes, 1, run)


def mm(n, dtype="bfloat16", double_row=False, k=128, m=128):
    meta = dict(k=k, m=m, n=n, dtype=dtype, stationary_dtype=dtype, double_row=double_row, transpose=False,
                onezero=False, tile=(128, 128))
    return Instruction(0, 0, "nc_matmul", "tensor", (sb(1, k, m, 2), sb(2, k, n, 2)), (sb(3, m, n, 4, "psum"),),
                       meta)


def vec(op, n, dtypes, engine="vector", buffers=("sbuf", "sbuf", "sbuf"), scalar_operand=False):
    isz = {"float32": 4, "bfloat16": 2}
    reads = []
    for i, d in enumerate(dtypes[1:]):
        f = 1 if (scalar_operand and i == 1) else n
        reads.append(sb(10 + i, 128, f, isz[d], buffers[i + 1]))
    w = sb(9, 128, n, isz[dtypes[0]], buffers[0])
    meta = dict(p=128, n=n, dtype=dtypes[0], in_dtypes=tuple(dtypes[1:]), op="add")
    return Instruction(0, 0, op, engine, tuple(reads), (w,), meta)


def test_matmul_rules():
    c = instruction_cost(mm(512), T2)
    assert c.cycles == 512 and c.busy_s == pytest.approx(512 / 2.4e9)
    assert c.flops == 2 * 128 * 128 * 512 and c.ideal_s == pytest.approx(c.flops / 79e12)
    assert instruction_cost(mm(16), T2).cycles == 64                       # max(N, 64)
    assert instruction_cost(mm(512, "float32"), T2).cycles == 4 * 512       # fp32 4x slower
    dr = instruction_cost(mm(512, "float8_e4m3", double_row=True), T2)
    assert dr.cycles == 512 and dr.flops == 2 * c.flops                    # double_row: 2x FLOP/s
    assert dr.ideal_s == pytest.approx(dr.flops / 158e12)
    assert instruction_cost(mm(512), T3).busy_s == c.busy_s                 # same TensorE clock on trn3


def test_vector_rules_and_perf_modes():
    # N >= 128 per partition: no static overhead in the instruction itself (it is charged only when dependent)
    assert instruction_cost(vec("tensor_tensor", 2048, ("float32",) * 3), T2).cycles == 2 * 2048
    assert instruction_cost(vec("tensor_tensor", 2048, ("bfloat16",) * 3), T2).cycles == 2048     # 2x
    assert instruction_cost(vec("tensor_copy", 2048, ("bfloat16",) * 2), T2).cycles == 512        # 4x
    assert instruction_cost(vec("tensor_copy", 2048, ("float32",) * 2), T2).cycles == 2048
    # a per-partition scalar operand does not stream; bf16 tensor_scalar gets the 4x mode
    ts = vec("tensor_scalar", 2048, ("bfloat16", "bfloat16", "float32"), scalar_operand=True)
    assert instruction_cost(ts, T2).cycles == 512
    # no perf mode on PSUM operands, nor on trn1
    psum_src = vec("tensor_copy", 2048, ("bfloat16", "bfloat16"), buffers=("sbuf", "psum"))
    assert instruction_cost(psum_src, T2).cycles == 2048
    assert instruction_cost(vec("tensor_copy", 2048, ("bfloat16",) * 2), T1).cycles == 2048
    c2 = instruction_cost(vec("tensor_tensor", 2048, ("float32",) * 3), T2)
    c3 = instruction_cost(vec("tensor_tensor", 2048, ("float32",) * 3), T3)
    assert c2.busy_s / c3.busy_s == pytest.approx(1.2 / 0.96)             # VectorE clock differs


def test_static_overhead_only_for_small_or_dependent_instructions():
    s = T2.static_instruction_cycles
    small = instruction_cost(vec("tensor_copy", 64, ("float32",) * 2), T2)
    assert small.cycles == 64 + s and small.dep_overhead_s == 0          # N << 128: always charged
    big = instruction_cost(vec("tensor_copy", 1024, ("float32",) * 2), T2)
    assert big.cycles == 1024 and big.dep_overhead_s == pytest.approx(s / T2.vector_clock_hz)


def test_scalar_rules():
    act = vec("activation", 1024, ("float32", "float32"), engine="scalar")
    c = instruction_cost(act, T2)
    assert c.cycles == 1024 and c.dep_overhead_s == pytest.approx(T2.scalar_fixed_cycles / T2.scalar_clock_hz)
    lowp = vec("activation", 1024, ("bfloat16", "bfloat16"), engine="scalar")
    assert instruction_cost(lowp, T2).cycles == 1024
    assert instruction_cost(lowp, T3).cycles == 512            # trn3: 256 lowp elems/cycle
    tiny = vec("activation", 1, ("float32", "float32"), engine="scalar")
    assert instruction_cost(tiny, T2).cycles == 1 * 128 / 128 + T2.scalar_fixed_cycles


def test_gpsimd_width_per_dtype():
    f32 = instruction_cost(vec("tensor_copy", 1024, ("float32",) * 2, engine="gpsimd"), T2)
    b16 = instruction_cost(vec("tensor_copy", 1024, ("bfloat16",) * 2, engine="gpsimd"), T2)
    assert f32.cycles == 1024 and b16.cycles == 512            # 16 fp32 / 32 fp16 lanes per 512-bit SIMD core
    assert instruction_cost(vec("tensor_copy", 1024, ("bfloat16",) * 2, engine="gpsimd"), T3).cycles == 1024


def test_dma_rules():
    assert dma_efficiency(256, T2) == pytest.approx(0.5)
    assert dma_efficiency(2048, T2) > 0.88 and dma_efficiency(4096, T2) > 0.93
    big = Instruction(0, 0, "dma_copy", "dma", (hbm(1, 128 * 4096, 128 * 4096),), (sb(2, 128, 1024, 4),), {})
    c = instruction_cost(big, T2)
    assert c.pieces == 16 and c.rings == tuple(range(16)) and c.latency_s == 1.3e-6
    assert c.hbm_read == 128 * 4096 and c.hbm_write == 0
    per_queue = min(T2.dma_engine_bytes_per_s, T2.hbm_bytes_per_s / 16)
    assert c.busy_s == pytest.approx(T2.dma_transfer_overhead_s +
                                     128 * 4096 / 16 / (per_queue * dma_efficiency(4096, T2)))
    # small contiguous chunks per partition are slower per byte
    small = Instruction(0, 0, "dma_copy", "dma", (hbm(1, 128 * 4096, 128),), (sb(2, 128, 1024, 4),), {})
    assert instruction_cost(small, T2).busy_s > 2.2 * c.busy_s   # eff 1/3 vs 0.94
    tr = Instruction(0, 0, "dma_transpose", "dma", (hbm(1, 128 * 4096, 128 * 4096),), (sb(2, 128, 1024, 4),),
                     {"transpose": True})
    body = c.busy_s - T2.dma_transfer_overhead_s
    assert instruction_cost(tr, T2).busy_s == pytest.approx(T2.dma_transfer_overhead_s +
                                                           body / T2.dma_transpose_efficiency)
    # one DMA engine serves 8 SBUF partitions: 1 partition -> ring 0; 4 partitions -> still one engine
    tiny = Instruction(0, 0, "dma_copy", "dma", (hbm(1, 64, 64),), (sb(2, 1, 16, 4),), {})
    assert instruction_cost(tiny, T2).rings == (0,)
    four = Instruction(0, 0, "dma_copy", "dma", (hbm(1, 4 * 16384, 4 * 16384),), (sb(2, 4, 4096, 4),), {})
    assert instruction_cost(four, T2).rings == (0,)
    # HBM -> HBM: split by bytes over least-loaded engines
    h2h = Instruction(0, 0, "dma_copy", "dma", (hbm(1, 1 << 20, 1 << 20),), (hbm(2, 1 << 20, 1 << 20),), {})
    assert instruction_cost(h2h, T2).rings == () and instruction_cost(h2h, T2).pieces == 16


def test_dma_compute_accumulating_into_hbm_pays_the_dst_read():
    """A read-modify-write of an HBM dst reads it and writes it: the HBM share of each engine is split over both
    directions, so it takes longer than a plain SBUF -> HBM store of the same bytes (and never beats its roofline)."""
    n = 128 * 4096
    store = Instruction(0, 0, "dma_copy", "dma", (sb(2, 128, 2048, 2),), (hbm(1, n, 4096),), {})
    dst = hbm(1, n, 4096)
    rmw = Instruction(0, 0, "dma_compute", "dma", (dst, sb(2, 128, 2048, 2)), (hbm(1, n, 4096),), {})
    s, r = instruction_cost(store, T2), instruction_cost(rmw, T2)
    assert r.dma_bytes == s.dma_bytes == n and r.hbm_read == n and r.hbm_write == n
    per_queue = min(T2.dma_engine_bytes_per_s, T2.hbm_bytes_per_s / 16 / 2)
    assert r.busy_s == pytest.approx(T2.dma_transfer_overhead_s + n / 16 / (per_queue * dma_efficiency(4096, T2)))
    assert r.busy_s > s.busy_s


def test_register_load_from_hbm_costs_a_dma_round_trip():
    rl = Instruction(0, 0, "register_load", "sync", (hbm(1, 4, 4),), (Access(-1, "reg", 0, 4, 4, 1, 4),), {})
    c = instruction_cost(rl, T2)
    assert c.engine == "sync" and c.busy_s > T2.dma_start_latency_s and c.hbm_read == 4
    rs = Instruction(0, 0, "register_load", "sync", (sb(1, 1, 1, 4),), (Access(-1, "reg", 0, 4, 4, 1, 4),), {})
    assert instruction_cost(rs, T2).busy_s < 1e-7


def test_sbuf_innermost_stride_above_16_bytes_doubles_streaming_time():
    s, n = T2.static_instruction_cycles, 2048

    def strided(ins, which, stride, buffer="sbuf"):
        ops = list(ins.reads if which == "read" else ins.writes)
        a = ops[0]
        ops[0] = Access(a.alloc_id, buffer, a.lo, a.hi, a.nbytes, a.partitions, 4, stride_bytes=stride)
        if which == "read":
            ins.reads = tuple(ops)
        else:
            ins.writes = tuple(ops)
        return ins

    # VectorE: a strided input or output doubles the N-per-input streaming part, not the static overhead
    tt = strided(vec("tensor_tensor", n, ("float32",) * 3), "read", 32)
    assert instruction_cost(tt, T2).cycles == 2 * (2 * n)
    assert instruction_cost(strided(vec("tensor_copy", n, ("float32",) * 2), "write", 20), T2).cycles == 2 * n
    assert instruction_cost(strided(vec("tensor_copy", n, ("float32",) * 2), "read", 16), T2).cycles == n
    # bf16 strided: no perf mode (not contiguous) and the 2x
    assert instruction_cost(strided(vec("tensor_copy", n, ("bfloat16",) * 2), "read", 32), T2).cycles == 2 * n
    # PSUM operands are not subject to the SBUF rule
    ps = strided(vec("tensor_copy", n, ("float32",) * 2, buffers=("sbuf", "psum")), "read", 32, "psum")
    assert instruction_cost(ps, T2).cycles == n
    # ScalarE and GpSimd
    act = strided(vec("activation", 1024, ("float32", "float32"), engine="scalar"), "read", 64)
    assert instruction_cost(act, T2).cycles == 2 * 1024
    gp = strided(vec("tensor_tensor", 512, ("float32",) * 3, engine="gpsimd"), "write", 32)
    assert instruction_cost(gp, T2).cycles == 2 * (2 * 512)
    assert s > 0
    # TensorE: a strided moving operand streams N columns at half rate; max(2N, 64); stationary is not streamed
    m = mm(512)
    m.reads = (m.reads[0], Access(2, "sbuf", 0, 1, 1, 128, 2, stride_bytes=32))
    assert instruction_cost(m, T2).cycles == 1024 and "strided" in instruction_cost(m, T2).note
    m16 = mm(16)
    m16.reads = (m16.reads[0], Access(2, "sbuf", 0, 1, 1, 128, 2, stride_bytes=32))
    assert instruction_cost(m16, T2).cycles == 64
    m.meta = dict(m.meta, dtype="float32", stationary_dtype="float32")
    assert instruction_cost(m, T2).cycles == 4 * 1024
    st = mm(512)
    st.reads = (Access(1, "sbuf", 0, 1, 1, 128, 2, stride_bytes=32), st.reads[1])
    assert instruction_cost(st, T2).cycles == 512


def test_address_dependencies_are_not_costed():
    idx = Access(7, "sbuf", 0, 512, 512, 128, 4)
    base = hbm(1, 128 * 4096, 4096)
    gathered = Access(1, "hbm", 0, 128 * 4096, 128 * 4096, 1, 4096, deps=(idx,))
    dst = sb(2, 128, 1024, 4)
    plain = instruction_cost(Instruction(0, 0, "dma_copy", "dma", (base,), (dst,), {}), T2)
    ind = instruction_cost(Instruction(0, 0, "dma_copy", "dma", (gathered,), (dst,), {"indirect": True},
                                       deps=(idx,)), T2)
    assert ind.busy_s == plain.busy_s and ind.dma_bytes == plain.dma_bytes and ind.hbm_read == plain.hbm_read


def test_tensor_engine_transpose_streams_the_identity():
    # nc_transpose of data [p, f] on TensorE: data is stationary, a [p, p] identity is moving -> max(p, 64) cycles
    def tr(p, f):
        meta = dict(k=p, m=p, n=f, p=p, f=f, dtype="bfloat16", transpose=True)
        return Instruction(0, 0, "nc_transpose", "tensor", (sb(1, p, f, 2),), (sb(2, f, p, 2, "psum"),), meta)
    assert instruction_cost(tr(128, 32), T2).cycles == 128
    assert instruction_cost(tr(32, 128), T2).cycles == 64
    assert instruction_cost(tr(128, 128), T2).flops == 0


def test_register_store_and_scalar_ops_to_hbm_cost_a_dma():
    reg = Access(-1, "reg", 0, 4, 4, 1, 4)
    st = Instruction(0, 0, "register_store", "sync", (reg,), (hbm(1, 4, 4),), {})
    c = instruction_cost(st, T2)
    assert c.busy_s > T2.dma_start_latency_s and c.hbm_write == 4 and c.hbm_read == 0
    sl = Instruction(0, 0, "scalar_load", "sync", (hbm(1, 4, 4),), (reg,), {})
    assert instruction_cost(sl, T2).busy_s == pytest.approx(c.busy_s)
    ss = Instruction(0, 0, "scalar_store", "sync", (reg,), (sb(1, 1, 1, 4),), {})
    assert instruction_cost(ss, T2).busy_s < 1e-7
