"""Scheduling rules of the cost model (nkisim.cost design note): dependent vs independent DMAs under both issue
orders, a no_reorder block, DMA queue / ring assignment, launch overhead and declared useful FLOPs."""

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

import nkisim
from nkisim.cost import analyze, bounds
from nkisim.hardware import HARDWARE

T2 = HARDWARE["trn2"].core
F = 1024


@nki.jit
def dep_then_indep(x, y):
    """t = x; u = t (SBUF -> SBUF, depends on t); v = y (independent of both); out = u + v."""
    out = nl.ndarray((128, F), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((128, F), dtype=x.dtype, buffer=nl.sbuf)
    u = nl.ndarray((128, F), dtype=x.dtype, buffer=nl.sbuf)
    v = nl.ndarray((128, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.dma_copy(dst=u, src=t)
    nisa.dma_copy(dst=v, src=y)
    nisa.tensor_tensor(dst=t, data1=u, data2=v, op=nl.add)
    nisa.dma_copy(dst=out, src=t)
    return out


def _run(kernel, *args, target="trn2"):
    return nkisim.run(kernel, args, {}, target=target)


def _ev(rep, op, k=0):
    return [e for e in rep.events if e.op == op][k]


def test_dependent_dma_waits_independent_dma_only_waits_in_program_order():
    x = np.ones((128, F), np.float32)
    res = _run(dep_then_indep, x, 2 * x)
    np.testing.assert_array_equal(res.outputs, 3 * x)
    b = bounds(res)
    # the dependent copy waits for its producer in both orders
    for rep in b:
        dep = _ev(rep, "dma_copy", 1)
        assert dep.start == pytest.approx(_ev(rep, "dma_copy", 0).end)
    # the independent load: issued at t=0 when the compiler reorders, behind the dependent one in program order
    assert _ev(b.ready, "dma_copy", 2).start == 0.0
    prog = _ev(b.program, "dma_copy", 2)
    assert prog.start > 0 and prog.start == pytest.approx(_ev(b.program, "dma_copy", 1).start)
    assert b.ready.latency_s < b.program.latency_s
    assert b.ready.order == "ready" and b.program.order == "program"


@nki.jit
def three_loads(x, reorder):
    """Three independent [128, F] loads and three independent VectorE copies; optionally inside no_reorder."""
    out = nl.ndarray((128, 3 * F), dtype=x.dtype, buffer=nl.shared_hbm)
    ts = [nl.ndarray((128, F), dtype=x.dtype, buffer=nl.sbuf) for _ in range(3)]
    us = nl.ndarray((128, 3 * F), dtype=x.dtype, buffer=nl.sbuf)

    def body():
        for i in range(3):
            nisa.dma_copy(dst=ts[i], src=x[:, i * F:(i + 1) * F])
        for i in range(3):
            nisa.tensor_copy(dst=us[:, i * F:(i + 1) * F], src=ts[i])

    if reorder:
        body()
    else:
        with nl.no_reorder():
            body()
    nisa.dma_copy(dst=out, src=us)
    return out


def test_no_reorder_block_chains_every_instruction():
    x = np.arange(128 * 3 * F, dtype=np.float32).reshape(128, 3 * F)
    free = analyze(_run(three_loads, x, True))
    res = _run(three_loads, x, False)
    np.testing.assert_array_equal(res.outputs, x)
    pinned = analyze(res)
    loads = [e for e in pinned.events if e.op == "dma_copy"][:3]
    # inside no_reorder each instruction starts after the previous one of the block has finished
    assert loads[0].start == 0.0
    for a, b in zip(loads, loads[1:]):
        assert b.reason == "no_reorder" and b.start == pytest.approx(a.end)
    copies = [e for e in pinned.events if e.op == "tensor_copy"]
    assert copies[0].start == pytest.approx(loads[2].end)
    # outside the block the three loads are issued together and overlap on the DMA rings
    free_loads = [e for e in free.events if e.op == "dma_copy"][:3]
    assert all(e.start == 0.0 for e in free_loads)
    assert pinned.latency_s > free.latency_s + 2 * T2.dma_start_latency_s


@nki.jit
def partition_slices(x):
    """Loads into partitions [0, 8), [8, 16) and [0, 4): one DMA engine per 8 partitions."""
    out = nl.ndarray((16, F), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((16, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t[0:8, :], src=x[0:8, :])
    nisa.dma_copy(dst=t[8:16, :], src=x[8:16, :])
    nisa.dma_copy(dst=t[0:4, :], src=x[0:4, :])
    nisa.dma_copy(dst=out, src=t)
    return out


def test_dma_ring_assignment_follows_partitions():
    x = np.arange(16 * F, dtype=np.float32).reshape(16, F)
    rep = analyze(_run(partition_slices, x))
    d = [e for e in rep.events if e.op == "dma_copy"]
    assert [q for q, _, _ in d[0].pieces] == [0] and [q for q, _, _ in d[1].pieces] == [1]
    assert [q for q, _, _ in d[2].pieces] == [0]
    assert [q for q, _, _ in d[3].pieces] == [0, 1]
    # rings 0 and 1 work in parallel; the third load queues behind the first on ring 0 (WAW also orders it)
    assert d[0].pieces[0][1] == d[1].pieces[0][1]
    assert d[2].pieces[0][1] >= d[0].pieces[0][2]


@nki.jit
def triggered(x, eng, dge):
    out = nl.ndarray((128, F), dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((128, F), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x, engine=eng, dge_mode=dge)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_dma_queue_is_the_trigger_engine():
    x = np.ones((128, F), np.float32)
    rep = analyze(_run(triggered, x, nisa.engine.scalar, nisa.dge_mode.hwdge))
    d = [e for e in rep.events if e.op == "dma_copy"]
    assert d[0].queue == "scalar" and d[1].queue == "default"


def test_launch_overhead_is_reported_separately():
    x = np.ones((128, F), np.float32)
    rep = analyze(_run(triggered, x, nisa.engine.unknown, nisa.dge_mode.unknown))
    assert rep.launch_s == T2.launch_overhead_s > 0
    assert rep.latency_with_launch_s == pytest.approx(rep.latency_s + rep.launch_s)
    assert rep.latency_s == max(e.end for e in rep.events)        # the kernel body does not include it
    assert "with launch" in rep.summary()


def test_declared_useful_flops_drive_mfu_and_intensity():
    a = np.ones((128, 128), np.float32)
    b = np.ones((128, 512), np.float32)
    from tests.nkisim.cost import kernels as K
    rep = analyze(_run(K.matmul_nki11, a, b))
    issued, mfu = rep.flops_issued, rep.mfu
    rep.declare_useful_flops(issued / 4)
    assert rep.flops == issued / 4 and rep.flops_issued == issued
    assert rep.mfu == pytest.approx(mfu / 4)
    assert rep.arithmetic_intensity == pytest.approx(issued / 4 / rep.hbm_bytes)
    with pytest.raises(ValueError, match="declare_useful_flops"):
        rep.declare_useful_flops(-1)


def test_order_switch_is_validated():
    with pytest.raises(ValueError, match="order"):
        analyze(_run(triggered, np.ones((128, F), np.float32), nisa.engine.unknown, nisa.dge_mode.unknown),
                order="fifo")
