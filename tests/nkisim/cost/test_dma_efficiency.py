"""The DMA efficiency rule (cost design note rule 6) against what AWS documents: the bandwidth guide's bands, the
throughput of a stream of transfers, and AWS's measured single-transfer engine times (hardware.DMA_MEASUREMENTS)."""

import pytest

from nkisim.cost import instruction_cost
from nkisim.cost.costs import dma_efficiency
from nkisim.hardware import DMA_MEASUREMENTS, HARDWARE, KIB
from nkisim.runtime import Access, Instruction

CORES = [HARDWARE[t].core for t in ("trn1", "trn2", "trn3")]


def load(partitions, row_bytes, hbm_contiguous=True):
    """dma_copy HBM -> SBUF of `partitions` rows of `row_bytes` (HBM side one contiguous block, or rows apart)."""
    n = partitions * row_bytes
    src = Access(1, "hbm", 0, n, n, 1, n if hbm_contiguous else row_bytes)
    dst = Access(2, "sbuf", 0, n, n, partitions, row_bytes)
    return Instruction(0, 0, "dma_copy", "dma", (src,), (dst,), {})


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.name)
def test_efficiency_is_monotone_in_the_chunk_and_below_one(core):
    sizes = [2 ** i for i in range(0, 17)]
    effs = [dma_efficiency(s, core) for s in sizes]
    assert all(0 < e < 1 for e in effs)
    assert all(a < b for a, b in zip(effs, effs[1:]))


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.name)
def test_bandwidth_guide_bands(core):
    # nki-dma-bandwidth-guide.rst: "< 256 B per partition: severely overhead-bound"; "256 B - 2 KiB: improving but
    # still below peak"; ">= 2 KiB: approaches peak"; ">= 4 KiB: fully amortizes ... saturates".
    assert dma_efficiency(255, core) < 0.5 and dma_efficiency(32, core) < 0.15
    assert 0.5 <= dma_efficiency(256, core) < dma_efficiency(1024, core) < dma_efficiency(2048, core)
    assert dma_efficiency(2 * KIB, core) >= 0.88
    assert dma_efficiency(4 * KIB, core) >= 0.94
    assert dma_efficiency(32 * KIB, core) >= 0.99


@pytest.mark.parametrize("core", CORES, ids=lambda c: c.name)
def test_small_chunks_cost_more_engine_time_per_byte(core):
    # same bytes (128 partitions x 4 KiB) in 4 KiB rows vs 128 B rows on both sides
    big = instruction_cost(load(128, 4 * KIB), core)
    small_hbm = Instruction(0, 0, "dma_copy", "dma", (Access(1, "hbm", 0, 512 * KIB, 512 * KIB, 1, 128),),
                            (Access(2, "sbuf", 0, 512 * KIB, 512 * KIB, 128, 4 * KIB),), {})
    small = instruction_cost(small_hbm, core)
    assert small.efficiency == pytest.approx(dma_efficiency(128, core))
    assert small.busy_s / big.busy_s == pytest.approx(dma_efficiency(4 * KIB, core) / dma_efficiency(128, core))
    # the fixed start latency does not depend on the size
    assert small.latency_s == big.latency_s == core.dma_start_latency_s


def test_stream_of_4_kib_rows_saturates_and_128_b_rows_do_not():
    """Many independent [128, B] loads back to back: the start latency overlaps, the engines run at eff(B)."""
    import nki
    import nki.isa as nisa
    import nki.language as nl

    import nkisim

    @nki.jit
    def stream(x):
        out = nl.ndarray((128, 1), dtype=x.dtype, buffer=nl.shared_hbm)
        for i in range(x.shape[0] // 128):
            t = nl.ndarray((128, x.shape[1]), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x[i * 128:(i + 1) * 128, :])
        nisa.dma_copy(dst=out, src=t[:, 0:1])
        return out

    import numpy as np
    core = HARDWARE["trn2"].core
    peak = core.dma_engines * min(core.dma_engine_bytes_per_s, core.hbm_bytes_per_s / core.dma_engines)
    achieved = {}
    for row in (128, 4 * KIB):
        x = np.zeros((128 * 64, row // 4), np.float32)
        _, rep = nkisim.profile(stream, x, target="trn2", numerics=False)
        achieved[row] = x.nbytes / rep.latency_s / peak
    assert achieved[4 * KIB] > 0.9                       # ">= 4 KiB ... saturates the DMA engines"
    assert achieved[128] < 0.4                           # "< 256 B ... a small fraction of peak"
    assert achieved[4 * KIB] == pytest.approx(dma_efficiency(4 * KIB, core), rel=0.05)


def test_measured_single_engine_32_kib_transfer():
    """AWS's profile (nki-dma-overview Example 1): one engine moves 32 KiB in 8 KiB rows in 1416 ns."""
    m = DMA_MEASUREMENTS["trn2_4x4096_bf16"]
    c = instruction_cost(load(m["partitions"], m["row_bytes"]), HARDWARE[m["target"]].core)
    assert c.rings == (0,) and c.dma_bytes == m["engine_bytes"]
    assert c.busy_s == pytest.approx(m["engine_s"], rel=0.10)


@pytest.mark.xfail(strict=True, reason="known gap: the fitted curve charges 8 SBUF rows of 256 B at 50% (~181 ns); "
                                       "AWS's profile measured 97 ns (92%). Kept as a fit to the bandwidth guide's "
                                       "bands; see the cost design note 'Calibration'.")
def test_measured_256_byte_rows():
    m = DMA_MEASUREMENTS["trn2_128x128_bf16"]
    c = instruction_cost(load(m["partitions"], m["row_bytes"]), HARDWARE[m["target"]].core)
    assert c.pieces == m["engines"] and c.dma_bytes / c.pieces == m["engine_bytes"]
    assert c.busy_s == pytest.approx(m["engine_s"], rel=0.15)
