"""nkisim.profile on micro-kernels whose modelled cost is known analytically; scheduler rules; trace schema."""

import json

import ml_dtypes
import numpy as np
import pytest

import nkisim
from nkisim.cost import analyze, check_chrome_trace
from nkisim.cost.costs import dma_efficiency
from nkisim.hardware import HARDWARE

from . import kernels as K

BF16 = ml_dtypes.bfloat16
T2, T3 = HARDWARE["trn2"].core, HARDWARE["trn3"].core


def _rand(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _dma_piece_s(core, nbytes, run, hbm_sides=1, partitions=128):
    """Time on each DMA engine of a transfer of `nbytes` over `partitions` SBUF partitions with `run` contiguous bytes
    per partition and `hbm_sides` HBM sides: transfer overhead + its share at the engine rate and efficiency."""
    rings = -(-partitions // 8)          # one DMA engine per 8 SBUF partitions
    bw = min(core.dma_engine_bytes_per_s, core.hbm_bytes_per_s / core.dma_engines / hbm_sides)
    return core.dma_transfer_overhead_s + (nbytes / rings) / (bw * dma_efficiency(run, core))


@pytest.mark.parametrize("target,core", [("trn2", T2), ("trn3", T3)])
def test_single_tile_copy_is_latency_plus_transfer(target, core):
    x = _rand((128, 1024))
    out, rep = nkisim.profile(K.stream_copy, x, target=target)
    np.testing.assert_array_equal(out, x)
    piece = _dma_piece_s(core, x.nbytes, 4096)
    # load, then the store waits for it (RAW): 2 x (start latency + one queue piece)
    assert rep.latency_s == pytest.approx(2 * (core.dma_start_latency_s + piece), rel=1e-9)
    assert rep.hbm_read_bytes == rep.hbm_write_bytes == x.nbytes and rep.flops == 0
    assert [e.reason for e in rep.critical_path] == ["start", "RAW"]


def test_streaming_copy_lands_on_memory_bound():
    x = _rand((1024, 2048))
    rep2 = nkisim.profile(K.stream_copy, x, target="trn2").report
    rep3 = nkisim.profile(K.stream_copy, x, target="trn3").report
    for rep, core, eng in ((rep2, T2, "hbm"), (rep3, T3, "dma")):
        assert rep.bound == "memory" and rep.bound_engine == eng
        assert rep.memory_roof_s == pytest.approx(2 * x.nbytes / core.memory_bytes_per_s)
        assert rep.latency_s >= rep.roofline_s
        assert rep.roofline_fraction > 0.6          # latency of the first load and last store are not hidden
        assert rep.arithmetic_intensity == 0 and rep.mfu == 0
        assert rep.limiter == "dma"
    # trn3 has 528 GB/s of DMA per core against trn2's 362.5 GB/s of HBM share
    assert rep3.memory_roof_s / rep2.memory_roof_s == pytest.approx(T2.hbm_bytes_per_s / T3.dma_bytes_per_s)
    assert rep3.latency_s < rep2.latency_s


def _matmul_inputs(k=512, m=128, n=1024):
    return _rand((k, m), BF16, 1), _rand((k, n), BF16, 2)


def test_pipelined_matmul_overlaps_dma_and_tensor_serial_does_not():
    a, b = _matmul_inputs()
    ref = a.astype(np.float32).T @ b.astype(np.float32)
    reps = {}
    for kern in (K.matmul_serial, K.matmul_pipelined):
        out, rep = nkisim.profile(kern, a, b)
        np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-2 * np.abs(ref).max())
        reps[kern.func.__name__] = rep
    ser, pipe = reps["matmul_serial"], reps["matmul_pipelined"]
    assert ser.flops == pipe.flops == 2 * 512 * 128 * 1024
    assert ser.hbm_bytes == pipe.hbm_bytes
    assert ser.busy_s["tensor"] == pytest.approx(pipe.busy_s["tensor"])
    # in program order nothing overlaps; with reordering only the output store of one tile overlaps the next
    ser_prog = analyze(nkisim.run(K.matmul_serial, (a, b), {}, target="trn2"), order="program")
    assert ser_prog.overlap_s("tensor", "dma") == 0.0
    assert 0 < ser.overlap_s("tensor", "dma") < 0.25 * ser.busy_s["tensor"]
    # with 1.3 us DMA start latency and only two buffers, about a third of the TensorE time is covered by transfers
    assert pipe.overlap_s("tensor", "dma") > 0.3 * pipe.busy_s["tensor"]
    assert pipe.latency_s < 0.75 * ser.latency_s
    # serially, every load after the first waits for the matmul reading its buffer (WAR)
    assert any(e.reason == "WAR" and e.engine == "dma" for e in ser.critical_path)
    assert ser.limiter == "dma latency"


def test_vector_bound_kernel_is_reported_as_such():
    x = _rand((128, 2048))
    reps = 16
    out, rep = nkisim.profile(K.vector_heavy, x, reps, target="trn2")
    np.testing.assert_allclose(out, x * (reps + 1), rtol=1e-6)
    assert rep.bound == "compute" and rep.bound_engine == "vector" and rep.limiter == "vector"
    s = T2.static_instruction_cycles
    # tensor_tensor 2N, tensor_copy N; each add reads the previous add's output: + static overhead (dependent)
    expect = (reps * (2 * 2048 + s) + 2048) / T2.vector_clock_hz
    assert rep.busy_s["vector"] == pytest.approx(expect)
    assert rep.roofline_fraction > 0.85
    # the same kernel in bf16 gets the trn2 perf mode (tensor_tensor 2x, tensor_copy 4x)
    rep_bf = nkisim.profile(K.vector_heavy, x.astype(BF16), reps, target="trn2").report
    assert rep_bf.busy_s["vector"] == pytest.approx((reps * (2048 + s) + 512) / T2.vector_clock_hz)


def test_trn3_differs_from_trn2_where_tables_differ():
    x = _rand((128, 2048))
    v2 = nkisim.profile(K.vector_heavy, x, 8, target="trn2").report
    v3 = nkisim.profile(K.vector_heavy, x, 8, target="trn3").report
    assert v2.busy_s["vector"] / v3.busy_s["vector"] == pytest.approx(1.2 / 0.96)
    a, b = _matmul_inputs(256, 128, 512)
    m2 = nkisim.profile(K.matmul_nki11, a, b, target="trn2").report
    m3 = nkisim.profile(K.matmul_nki11, a, b, target="trn3").report
    assert m2.busy_s["tensor"] == pytest.approx(m3.busy_s["tensor"])           # same TensorE clock and width
    assert m3.busy_s["dma"] < m2.busy_s["dma"]                                  # faster DMA engines
    assert m3.ridge_flops_per_byte < m2.ridge_flops_per_byte
    assert m2.platform.core.sbuf_bytes < m3.platform.core.sbuf_bytes


def test_results_are_deterministic():
    a, b = _matmul_inputs(256, 128, 512)
    r1 = nkisim.profile(K.matmul_pipelined, a, b).report
    r2 = nkisim.profile(K.matmul_pipelined, a, b).report
    assert r1.to_dict() == r2.to_dict()
    assert json.dumps(r1.chrome_trace(), sort_keys=True) == json.dumps(r2.chrome_trace(), sort_keys=True)
    assert r1.summary() == r2.summary()


def _assert_chrome_schema(doc):
    """Independent check of the Chrome trace-event JSON object format."""
    assert set(doc) >= {"traceEvents"} and isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    tracks = {}
    names = {}
    for ev in doc["traceEvents"]:
        assert ev["ph"] in {"X", "M", "s", "f"}
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int) and isinstance(ev["name"], str)
        if ev["ph"] == "M":
            assert ev["name"] in {"process_name", "thread_name", "process_sort_index"}
            assert isinstance(ev["args"], dict)
            if ev["name"] != "process_sort_index":
                names[(ev["pid"], ev["tid"] if ev["name"] == "thread_name" else None)] = ev["args"]["name"]
        elif ev["ph"] == "X":
            assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
            assert ev["args"]["modelled"] is True
            tracks.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
        else:
            assert isinstance(ev["id"], int) and isinstance(ev["ts"], (int, float))
    for key, spans in tracks.items():         # one engine / queue never runs two things at once
        assert key in names
        spans.sort()
        assert all(e0 <= s1 + 1e-6 for (_, e0), (s1, _) in zip(spans, spans[1:])), key
    return names


def test_chrome_trace_file_is_valid(tmp_path):
    a, b = _matmul_inputs(256, 128, 512)
    rep = nkisim.profile(K.matmul_pipelined, a, b).report
    path = rep.save_trace(tmp_path / "mm.trace.json")
    doc = json.loads(path.read_text())
    names = _assert_chrome_schema(doc)
    assert check_chrome_trace(doc)
    assert "modelled" in names[(0, None)] and doc["otherData"]["modelled"] is True
    assert {"tensor", "vector", "dma q0"} <= set(names.values())
    with pytest.raises(ValueError):
        check_chrome_trace({"traceEvents": [{"ph": "X", "name": "x", "pid": 0, "tid": 0, "ts": 0}]})


def test_lnc2_cores_synchronise_at_barrier_and_sendrecv(tmp_path):
    x = _rand((256, 512))
    out, rep = nkisim.profile(K.lnc_swap[2], x, 4)
    np.testing.assert_array_equal(out, np.concatenate([x[128:], x[:128]]))
    assert rep.lnc == 2 and len(rep.busy_by_core) == 2
    by = {(e.core, e.op): e for e in rep.events if e.op in ("core_barrier", "sendrecv")}
    last_vec = max(e.end for e in rep.events if e.core == 1 and e.engine == "vector")
    staged = min(e.end for e in rep.events if e.core == 1 and e.op == "dma_copy" and e.start >= last_vec)
    # core 0 has nothing to do before the barrier, yet waits for core 1 to stage its VectorE result in shared HBM
    assert staged > last_vec
    assert by[(0, "core_barrier")].start == pytest.approx(staged)
    assert by[(0, "core_barrier")].reason == "sync wait for core 1"
    assert by[(0, "sendrecv")].peer == by[(1, "sendrecv")].idx
    assert rep.busy_by_core[0]["vector"] == 0 and rep.busy_by_core[1]["vector"] > 0
    # the staging DMA delays core 1's own sendrecv (same DMA queue), so the critical path now ends on core 1;
    # the cross-core wait shows as core 0's barrier reason above and as flow arrows in the trace below
    doc = json.loads(rep.save_trace(tmp_path / "lnc.json").read_text())
    names = _assert_chrome_schema(doc)
    assert {p for p, t in names if t is None} == {0, 1}
    flows = [ev for ev in doc["traceEvents"] if ev["ph"] in ("s", "f")]
    assert len(flows) == 8 and {ev["pid"] for ev in flows} == {0, 1}


def test_report_labels_every_figure_as_modelled():
    rep = nkisim.profile(K.vector_heavy, _rand((128, 512)), 2).report
    text = rep.summary()
    assert text.splitlines()[0].count("MODELLED") == 1
    for line in text.splitlines()[2:]:
        assert "modelled" in line or line.lstrip().startswith(("TensorE FLOPs", "HBM", "arithmetic")), line
    assert "modelled" in text.splitlines()[4] and rep.to_dict()["modelled"] is True
    assert all(k.startswith("modelled_") for k in rep.extra_info())


def test_analyze_existing_run_and_dependency_footprints():
    x = _rand((128, 1024))
    res = nkisim.run(K.stream_copy, (x,), {}, target="trn3")
    rep = analyze(res)
    assert rep.target == "trn3" and rep.latency_s > 0
    # disjoint column halves of one tile do not depend on each other; overlapping ranges do
    import nki.language as nl

    from nkisim.cost.schedule import overlaps
    from nkisim.runtime import access_of
    t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    left, right, top = access_of(t[:, 0:256]), access_of(t[:, 256:512]), access_of(t[0:64, :])
    assert left.box is not None and not overlaps(left, right)
    assert overlaps(left, top) and overlaps(right, top) and overlaps(left, left)
    h = nl.ndarray((64, 512), dtype=nl.float32, buffer=nl.hbm)
    assert not overlaps(access_of(h[0:32, 0:128]), access_of(h[0:32, 128:256]))
    assert overlaps(access_of(h[0:32, 0:129]), access_of(h[16:48, 128:256]))
    # a bitcast view (bf16 columns ANDed as int32 pairs) is boxed in bytes: disjoint column slices of one tile stay
    # independent whatever dtype each side views them as
    b = nl.ndarray((128, 2, 1024), dtype=nl.bfloat16, buffer=nl.sbuf)
    s0, s1 = access_of(b[:, 0, :].view(nl.int16)), access_of(b[:, 1, :].view(nl.int32))
    assert s1.box == (4096, 0, 127, 2048, 4096) and not overlaps(s0, s1)
    assert overlaps(access_of(b[0:64, 1, 0:2].view(nl.int32)), access_of(b[32:48, 1, 1:3]))
