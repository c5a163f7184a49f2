"""Address and control dependencies in the cost model: indirect-DMA index tensors, registers set by register_load
(nl.ds / .ap(scalar_offset=) / fori_loop bounds), and the >16 B SBUF-stride rule — with analytically derived
modelled times (trn2)."""

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

import nkisim
from nkisim.hardware import HARDWARE
from nkisim.runtime import access_of

from .test_profile import _dma_piece_s

T2 = HARDWARE["trn2"].core
L = T2.dma_start_latency_s
F = 1024                     # fp32 row of 4 KiB: one row per partition is one 4 KiB contiguous run
VEC_1 = (1 + T2.static_instruction_cycles) / T2.vector_clock_hz     # VectorE op on 1 element per partition


TILE = _dma_piece_s(T2, 128 * F * 4, F * 4)   # [128, F] fp32 HBM <-> SBUF
IDX = _dma_piece_s(T2, 128 * 4, 4)            # [128, 1] int32 HBM -> SBUF: 4 B per partition
ONE = _dma_piece_s(T2, 4, 4, partitions=1)    # [1, 1] int32 HBM -> SBUF
# register_load from SBUF: one SBUF access on the sync sequencer
RL = T2.sbuf_access_overhead_cycles / T2.scalar_clock_hz


def _ev(rep, op, k=0):
    return [e for e in rep.events if e.op == op][k]


# ---- 1. the index tensor of an indirect DMA ------------------------------------------------------------------------

@nki.jit
def gather_scatter(table, idx_in, scatter):
    """idx = copy(idx_in) on VectorE; gather table rows by idx (or scatter rows of table[0:128], loaded first, to
    out[idx])."""
    R = table.shape[0]
    out = nl.ndarray((R, F), dtype=table.dtype, buffer=nl.shared_hbm)
    raw = nl.ndarray((128, 1), dtype=nl.int32, buffer=nl.sbuf)
    idx = nl.ndarray((128, 1), dtype=nl.int32, buffer=nl.sbuf)
    rows = nl.ndarray((128, F), dtype=table.dtype, buffer=nl.sbuf)
    if scatter:
        nisa.dma_copy(dst=rows, src=table[0:128, :])
    nisa.dma_copy(dst=raw, src=idx_in)
    nisa.tensor_copy(dst=idx, src=raw)
    if scatter:
        nisa.dma_copy(dst=out.vector_select(0, idx), src=rows)
    else:
        nisa.dma_copy(dst=rows, src=table.ap([[F, 128], [1, F]], vector_offset=idx, indirect_dim=0))
        nisa.dma_copy(dst=out[0:128, :], src=rows)
    return out


def test_indirect_dma_waits_for_the_index_producer():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((256, F)).astype(np.float32)
    perm = rng.permutation(256)[:128].astype(np.int32).reshape(128, 1)
    out, rep = nkisim.profile(gather_scatter, table, perm, False)
    np.testing.assert_array_equal(out[:128], table[perm[:, 0]])
    gather = _ev(rep, "dma_copy", 1)
    # the gather starts when VectorE has written the indices (it used to start at t=0, as its table is an input)
    assert gather.reason == "RAW address" and rep.events[gather.pred].op == "tensor_copy"
    assert gather.start == pytest.approx(L + IDX + VEC_1, rel=1e-12)
    # the index tensor is not moved data: the gather costs what a plain [128, F] load costs
    assert gather.end - gather.start == pytest.approx(L + TILE, rel=1e-12)
    assert rep.latency_s == pytest.approx(L + IDX + VEC_1 + 2 * (L + TILE), rel=1e-12)
    assert rep.dma_bytes == 128 * 4 + 2 * 128 * F * 4


def test_indirect_scatter_waits_for_the_index_producer():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((256, F)).astype(np.float32)
    perm = rng.permutation(256)[:128].astype(np.int32).reshape(128, 1)
    out, rep = nkisim.profile(gather_scatter, table, perm, True)
    np.testing.assert_array_equal(out[perm[:, 0]], table[:128])
    # rows load on all 16 queues until L + TILE; the index load then queues behind it, VectorE copies the indices,
    # and the scatter waits for that copy (its data, loaded at L + TILE, was ready earlier)
    vec, scatter = _ev(rep, "tensor_copy"), _ev(rep, "dma_copy", 2)
    assert vec.start == pytest.approx(L + TILE + IDX, rel=1e-12)
    assert scatter.reason == "RAW address" and scatter.pred == vec.idx
    assert scatter.start == pytest.approx(L + TILE + IDX + VEC_1, rel=1e-12)
    assert rep.latency_s == pytest.approx(2 * (L + TILE) + IDX + VEC_1, rel=1e-12)


def test_index_tensor_is_an_address_dependency_of_the_view():
    t = nl.ndarray((256, 64), dtype=nl.float32, buffer=nl.hbm)
    idx = nl.ndarray((128, 1), dtype=nl.int32, buffer=nl.sbuf)
    for view in (t.ap([[64, 128], [1, 64]], vector_offset=idx, indirect_dim=0), t.vector_select(0, idx)):
        a = access_of(view)
        assert [d.alloc_id for d in a.deps] == [idx.alloc.id]
        assert a.nbytes == 128 * 64 * 4


# ---- 2. registers ------------------------------------------------------------------------------------------------

@nki.jit
def register_offset(x, off, mode):
    """o = off (DMA); r = register_load(o); load x[r:r+128] with nl.ds / .ap(scalar_offset=r); store it."""
    out = nl.ndarray((128, F), dtype=x.dtype, buffer=nl.shared_hbm)
    o = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    t = nl.ndarray((128, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=o, src=off)
    r = nisa.register_alloc()
    nisa.register_load(r, o)
    if mode == "ds":
        src = x[nl.ds(r, 128), :]
    else:                                   # scalar_offset counts rows (indirect_dim=0) of the base tensor
        src = x.ap([[F, 128], [1, F]], scalar_offset=r, indirect_dim=0)
    nisa.dma_copy(dst=t, src=src)
    nisa.dma_copy(dst=out, src=t)
    return out


@pytest.mark.parametrize("mode", ["ds", "scalar_offset"])
def test_dynamic_offset_dma_waits_for_register_load(mode):
    x = np.arange(300 * F, dtype=np.float32).reshape(300, F)
    out, rep = nkisim.profile(register_offset, x, np.array([[37]], np.int32), mode)
    np.testing.assert_array_equal(out, x[37:165])
    rl, load = _ev(rep, "register_load"), _ev(rep, "dma_copy", 1)
    # register_load waits for the DMA that wrote its source; from SBUF it is one SBUF access on the sync sequencer
    assert rl.reason == "RAW" and rl.start == pytest.approx(L + ONE, rel=1e-12)
    assert rl.end == pytest.approx(L + ONE + RL, rel=1e-12)
    assert load.reason == "RAW register" and load.pred == rl.idx and load.start == rl.end
    assert rep.latency_s == pytest.approx(L + ONE + RL + 2 * (L + TILE), rel=1e-12)
    assert [e.op for e in rep.critical_path] == ["dma_copy", "register_load", "dma_copy", "dma_copy"]


def test_register_writer_is_recorded_and_moves_propagate():
    ctx = nkisim.runtime.current()
    r = nisa.register_alloc()
    o = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.memset(o, 3)
    nisa.register_load(r, o)
    assert r.writer == ctx.seq - 1
    r2 = nisa.register_alloc()
    nisa.register_move(r2, r)                          # reads r, writes r2
    mv = ctx.trace[-1]
    assert [a.alloc_id for a in mv.reads] == [-r.id] and [a.alloc_id for a in mv.writes] == [-r2.id]
    t = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.sbuf)
    v = t[:, nl.ds(r2, 4)].permute((0, 1))              # derived views keep the register
    assert [d.alloc_id for d in access_of(v).deps] == [-r2.id]
    assert access_of(t[:, 0:4]).deps == ()
    assert [d.alloc_id for d in access_of(t[:, nl.ds(o, 4)]).deps] == [o.alloc.id]    # 1-element offset tensor


@nki.jit
def register_bound_loop(x, n_in):
    """n = n_in (DMA); r = register_load(n); fori_loop(0, r): memset + add on VectorE; store."""
    out = nl.ndarray((128, 1), dtype=x.dtype, buffer=nl.shared_hbm)
    n = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    acc = nl.ndarray((128, 1), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=n, src=n_in)
    nisa.memset(acc, 0.0)
    r = nisa.register_alloc()
    nisa.register_load(r, n)

    def body(i):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)

    nl.fori_loop(0, r, body)
    nisa.dma_copy(dst=out, src=acc)
    return out


def test_fori_loop_with_register_bound_waits_for_register_load():
    out, rep = nkisim.profile(register_bound_loop, np.zeros((128, 1), np.float32), np.array([[3]], np.int32))
    np.testing.assert_array_equal(out, np.full((128, 1), 3.0, np.float32))
    memset, adds = _ev(rep, "memset"), [e for e in rep.events if e.op == "tensor_scalar"]
    assert memset.start == 0.0 and len(adds) == 3
    # every loop instruction waits for the bound (control dependency); then VectorE runs them back to back
    assert adds[0].reason == "RAW register" and adds[0].start == pytest.approx(L + ONE + RL, rel=1e-12)
    assert adds[2].end == pytest.approx(L + ONE + RL + 3 * VEC_1, rel=1e-12)
    store = _ev(rep, "dma_copy", 1)
    assert rep.latency_s == pytest.approx(L + ONE + RL + 3 * VEC_1 + L + IDX, rel=1e-12)
    assert store.start == pytest.approx(adds[2].end)


# ---- 3. SBUF access stride ---------------------------------------------------------------------------------------

@nki.jit
def strided_copy(x, step):
    """t = x [128, 8F'] in SBUF; u[:, :] = t[:, ::step] on VectorE (fp32)."""
    P, W = x.shape
    t = nl.ndarray((P, W), dtype=x.dtype, buffer=nl.sbuf)
    u = nl.ndarray((P, W // 8), dtype=x.dtype, buffer=nl.sbuf)
    out = nl.ndarray((P, W // 8), dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_copy(dst=u, src=t[:, 0:(W // 8) * step:step])
    nisa.dma_copy(dst=out, src=u)
    return out


@pytest.mark.parametrize("step,factor", [(1, 1), (4, 1), (5, 2), (8, 2)])
def test_vector_copy_with_innermost_stride_above_16_bytes_costs_2x(step, factor):
    n = 256
    x = np.arange(128 * 8 * n, dtype=np.float32).reshape(128, 8 * n)
    out, rep = nkisim.profile(strided_copy, x, step)
    np.testing.assert_array_equal(out, x[:, 0:n * step:step])
    cp = _ev(rep, "tensor_copy")
    # fp32 tensor_copy: N cycles + static overhead; a 5 x 4 B = 20 B or 32 B stride streams at half bandwidth
    assert cp.cost.cycles == factor * n          # N >= 128 and independent: no static overhead
    assert ("strided" in cp.cost.note) == (factor == 2)


def test_stride_bytes_of_views():
    t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((128, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
    assert access_of(t).stride_bytes == 4 and access_of(t[:, ::4]).stride_bytes == 16
    assert access_of(t[:, ::8]).stride_bytes == 32 and access_of(b[:, ::8]).stride_bytes == 16
    assert access_of(t[:, 0:1]).stride_bytes == 4                       # per-partition scalar: no free stride
    assert access_of(t[:, 0:1].broadcast(1, 8)).stride_bytes == 0
    assert access_of(t.rearrange("p (a b)", "p b a", {"a": 8})).stride_bytes == 8 * 4
