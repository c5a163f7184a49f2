"""The one hardware table: published Trainium numbers per NeuronCore, per chip, per instance, and collective constants.

Single source of truth for the nkisim cost model (`nkisim.cost`) and the benchmark harness (`bench/`). Nothing in
here is measured by us: every value is a published datasheet / architecture-guide figure or is derived from one, and
carries a `source` string beside it. Units are plain SI throughout: Hz, FLOP/s, bytes, bytes/s, seconds, cycles.

Access pattern::

    from nkisim.hardware import HARDWARE, hardware
    hw = HARDWARE["trn2"]                      # or hardware("trn2"); keys: "trn1", "trn2", "trn3"
    hw.core.tensor_bf16_flops                  # 79e12 FLOP/s per physical NeuronCore-v3
    hw.core.peak_flops("bfloat16")             # per-dtype TensorE peak (float32, float8_e4m3 + double_row, mxfp8 ...)
    hw.core.hbm_bytes_per_s                    # HBM bandwidth share of one physical core
    hw.chip.hbm_bytes_per_s, hw.chip.bf16_flops, hw.chip.cores
    hw.instance.chips, hw.instance.topology, hw.instance.link_bytes_per_s_per_chip   # trn2.48xlarge / Trn3 server
    hw.ultraserver.chips                       # Trn2 UltraServer / Trn3 Gen1 UltraServer
    hw.collective.hop_latency_s, hw.collective.mesh_max_bytes
    hw.logical_core(lnc=2).bf16_flops          # roofline peaks of one logical core (LNC=1 or 2)
    hw.core.source("hbm_bytes_per_s")          # the citation of any field; hw.core.sources is the full dict

Sources (tags as in /work/shared/docs/nki-api.md §8 and parallel-and-perf-model.md §2.6):
[SDK:arch1/2/3] NKI architecture guides for trn1/trn2/trn3; [SDK:hw2] `trainium2.rst`, `neuron-core-v3.rst`;
[SDK:hw3] `trainium3.rst`, `neuron-core-v4.rst`; [SDK:dma] DMA performance guide; [SDK:perf] NKI performance guide;
[SDK:lncfg] `logical-neuroncore-config.rst`; [SDK:trn2-arch] `trn2-arch.rst`; [SDK:trn3-arch] `trn3-arch.rst`;
[SDK:cc] `intranode-collective-comm.rst`.

Where sources disagree the table picks one value and names the other in the source string (grep "alt:").
Calibration status: none of these constants has been calibrated against a measurement on hardware (no Trainium is
available to this project); `CALIBRATION` below records that per group.
"""

from dataclasses import dataclass, field, fields

GIB = 1 << 30
MIB = 1 << 20
KIB = 1 << 10

CALIBRATION = {
    "core": "datasheet (uncalibrated)",
    "chip": "datasheet (uncalibrated)",
    "instance": "datasheet (uncalibrated)",
    "overheads": "documented approximations (uncalibrated); the DMA efficiency curve run/(run+256 B) is a fit to the "
                 "qualitative bands of [SDK:bw], not a documented formula; AWS's own measured points are in "
                 "DMA_MEASUREMENTS (one agrees within 6%, the 256 B-row one does not: see the cost design note)",
    "collective": "documented ranges (1-2 us per hop); midpoint chosen, uncalibrated",
}


class _Sourced:
    """Mixin: every dataclass field `x` has its citation in `self.sources["x"]`."""

    def source(self, name: str) -> str:
        return self.sources.get(name, "")

    def table(self):
        """[(field, value, source)] for reports and docs."""
        return [(f.name, getattr(self, f.name), self.sources.get(f.name, ""))
                for f in fields(self) if f.name != "sources"]


def _build(cls, **kv):
    """cls(**values, sources=...) from `name=(value, source)` pairs, keeping each source next to its value."""
    values = {k: (v[0] if isinstance(v, tuple) else v) for k, v in kv.items()}
    sources = {k: v[1] for k, v in kv.items() if isinstance(v, tuple)}
    return cls(**values, sources=sources)


@dataclass(frozen=True)
class CoreSpec(_Sourced):
    """One physical NeuronCore."""

    name: str                       # "NeuronCore-v3"
    nc_version: int
    # TensorE: 128x128 systolic array, one moving column per cycle
    tensor_clock_hz: float
    tensor_rows: int
    tensor_cols: int
    tensor_bf16_flops: float        # dense BF16/FP16/TF32
    tensor_fp8_flops: float         # dense FP8 (trn2: double_row perf mode; trn3: same 2x rule, see source)
    tensor_fp32_flops: float
    tensor_mxfp8_flops: float       # MXFP8/MXFP4 (nc_matmul_mx); equals fp8 where no MX path exists
    tensor_sparse_flops: float
    # VectorE / ScalarE / GpSimdE
    vector_clock_hz: float
    vector_elems_per_cycle: int     # non-perf-mode datasheet width (all partitions)
    vector_elems_per_cycle_perf: int  # BF16/FP16 perf mode datasheet width
    vector_fp32_flops: float
    scalar_clock_hz: float
    scalar_elems_per_cycle: int
    scalar_elems_per_cycle_lowp: int  # BF16/FP16/FP8 (v4 doubles it)
    scalar_fp32_flops: float
    gpsimd_clock_hz: float
    gpsimd_elems_per_cycle: int     # fp32 elements per cycle over the 8 cores
    # on-chip memory
    sbuf_bytes: int
    sbuf_partition_bytes: int
    psum_bytes: int
    psum_partition_bytes: int
    psum_banks: int
    partitions: int
    # DMA and HBM
    dma_engines: int                # queues / rings per core
    dma_engine_bytes_per_s: float
    dma_bytes_per_s: float          # aggregate of the core's DMA engines
    hbm_bytes_per_s: float          # this core's share of chip HBM bandwidth
    # fixed overheads
    dma_start_latency_s: float      # semaphore-to-start latency of one DMA transfer
    dma_issue_s: float              # HW-DGE descriptor generation per DMA instruction (hidden in start latency)
    dma_min_efficient_bytes: int    # contiguous bytes per partition to approach peak
    dma_full_efficiency_bytes: int
    dma_overhead_bytes: int         # below this per-partition chunk a DMA is severely overhead-bound
    dma_transpose_efficiency: float
    dma_transfer_overhead_s: float  # per DMA transfer, per DMA engine it uses (occupies the engine)
    launch_overhead_s: float        # one kernel (NEFF) launch: reported separately, never in the kernel body
    static_instruction_cycles: int  # VectorE/ScalarE/GpSimd per-instruction static overhead (engine cycles)
    scalar_fixed_cycles: int        # ScalarE per-instruction fixed cost (dependent-instruction II)
    matmul_min_cycles: int          # MultiplyMoving minimum initiation interval
    sbuf_access_overhead_cycles: int
    sbuf_fast_stride_bytes: int     # innermost-stride limit of full-bandwidth engine SBUF access
    sbuf_strided_factor: float      # streaming-time factor of an engine SBUF access above that stride
    sources: dict = field(default_factory=dict, compare=False, repr=False)

    def peak_flops(self, dtype: str = "bfloat16", double_row: bool = False, mx: bool = False) -> float:
        """Dense TensorE peak for matmul inputs of `dtype` (nki dtype name)."""
        d = str(dtype)
        if mx or d.startswith(("mxfp", "float4", "float8_e8m0")):
            return self.tensor_mxfp8_flops
        if d in ("float32",):
            return self.tensor_fp32_flops
        if d.startswith("float8") and double_row:
            return self.tensor_fp8_flops
        return self.tensor_bf16_flops

    @property
    def memory_bytes_per_s(self) -> float:
        """Roofline memory peak of one core: HBM share capped by the core's DMA engines."""
        return min(self.hbm_bytes_per_s, self.dma_bytes_per_s)


@dataclass(frozen=True)
class ChipSpec(_Sourced):
    name: str
    cores: int
    bf16_flops: float
    fp8_flops: float
    fp32_flops: float
    sparse_flops: float
    hbm_bytes: int
    hbm_bytes_per_s: float
    hbm_stacks: int
    cores_per_hbm_stack: int
    dma_engines: int
    dma_bytes_per_s: float
    sbuf_bytes: int
    link: str
    link_bytes_per_s: float         # chip-to-chip NeuronLink, per chip
    cc_cores: int
    sources: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class InstanceSpec(_Sourced):
    name: str
    chips: int
    topology: str
    link_bytes_per_s_per_chip: float   # intra-instance/server chip-to-chip bandwidth per chip
    inter_bytes_per_s_per_chip: float  # to the next instance/server (UltraServer) per chip
    fp8_flops: float
    bf16_flops: float
    fp32_flops: float
    hbm_bytes: int
    hbm_bytes_per_s: float
    efa_bits_per_s: float
    default_lnc: int
    sources: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class CollectiveSpec(_Sourced):
    hop_latency_s: float            # per-hop latency of Ring/KangaRing
    base_latency_s: float           # fixed latency term of one collective
    mesh_max_bytes: int             # Mesh algorithm below this size
    rdh_max_bytes: int              # recursive doubling/halving below this, KangaRing above
    sources: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class LogicalCore:
    """Roofline peaks of one logical core (LNC physical cores working as one)."""

    lnc: int
    bf16_flops: float
    fp8_flops: float
    fp32_flops: float
    hbm_bytes_per_s: float
    memory_bytes_per_s: float


@dataclass(frozen=True)
class Platform:
    name: str                       # "trn2"
    core: CoreSpec
    chip: ChipSpec
    instance: InstanceSpec | None
    ultraserver: InstanceSpec | None
    collective: CollectiveSpec

    def logical_core(self, lnc: int = 1) -> LogicalCore:
        c = self.core
        return LogicalCore(lnc, lnc * c.tensor_bf16_flops, lnc * c.tensor_fp8_flops, lnc * c.tensor_fp32_flops,
                           lnc * c.hbm_bytes_per_s, lnc * c.memory_bytes_per_s)


# ---- shared overhead constants (nki-api.md §8.4) ----------------------------------------------------------------

_DMA = "[SDK:dma] nki-api.md §8.4"
_COMMON_OVERHEADS = dict(
    dma_start_latency_s=(1.3e-6, f"{_DMA}: ~1300 ns semaphore-to-start cross-engine latency per transfer"),
    dma_min_efficient_bytes=(2 * KIB, f"{_DMA}: >=2 KiB contiguous per partition (min) to approach peak"),
    dma_full_efficiency_bytes=(4 * KIB, f"{_DMA}: >=4 KiB contiguous per partition for full efficiency"),
    dma_overhead_bytes=(256, f"{_DMA}, [SDK:bw] nki-dma-bandwidth-guide.rst: '< 256 B per partition: severely "
                             "overhead-bound', '>= 2 KiB approaches peak', '>= 4 KiB saturates'; used as the "
                             "half-efficiency point of eff = run/(run+256) (a FIT to those bands, no AWS formula: "
                             "50% @256 B, 89% @2 KiB, 94% @4 KiB; AWS's measured 8 x 256 B rows ran at 92%, "
                             "DMA_MEASUREMENTS)"),
    # Engine time per DMA transfer beyond its bytes: none, on every core. AWS lists the per-transfer overhead as
    # 'descriptor setup, synchronization, and semaphore-to-start latency (~1300 ns cross-engine)' ([SDK:bw]) —
    # charged as dma_start_latency_s, which does not occupy an engine — and the per-buffer overhead as the
    # efficiency curve (dma_overhead_bytes). Reading '32KiB per transfer for ideal bandwidth' ([SDK:perf]) as a
    # further 90%-at-32-KiB occupancy was tried and rejected: it made the trn2 tutorial's DMA-bound v2/v3 16-18%
    # slower than measured.
    dma_transfer_overhead_s=(0.0, "[SDK:bw] nki-dma-bandwidth-guide.rst: per-transfer overhead = the ~1300 ns "
                                  "start latency (dma_start_latency_s); no separate engine occupancy documented"),
    dma_transpose_efficiency=(0.9, "[SDK:arch2] nki-api.md §8.4: HBM2SBUF dma_transpose <=90% DMA efficiency "
                                   "(upper bound used as the factor; real transposes are often slower)"),
    static_instruction_cycles=(100, "[SDK:arch1] trainium_inferentia2_arch.rst VectorE cost model: 'static "
                                    "instruction overhead of 100 engine cycles' added only for back-to-back "
                                    "instructions with N << 128 or each depending on the previous output"),
    scalar_fixed_cycles=(264, "[SDK:perf] nki_perf_guide.rst Opt #5a: observed 189 ns (264 ScalarE cycles) "
                              "initiation interval of 1-element dependent ScalarE instructions (NC-v2 figure, "
                              "reused); charged only in that case (small or dependent)"),
    launch_overhead_s=(15e-6, "ASSUMPTION (no AWS figure found): per-launch NEFF/runtime overhead; reported only "
                              "as 'with launch', never in the kernel body"),
    matmul_min_cycles=(64, "[SDK:arch1]/[SDK:perf] nki-api.md §8.4: MultiplyMoving II ~ max(N, 64 cycles)"),
    sbuf_access_overhead_cycles=(60, "[SDK:arch1] nki-api.md §8.4: ~60 cycles per SBUF/PSUM access request (v2); "
                                     "folded into static_instruction_cycles by the cost model"),
    sbuf_fast_stride_bytes=(16, "[SDK] memory-hierarchy-overview.rst, [SDK:arch1] nki-api.md §8.4: engine SBUF "
                                "read/write 128 elems/cycle/interface; >16-byte innermost stride halves bandwidth"),
    sbuf_strided_factor=(2.0, "[SDK] memory-hierarchy-overview.rst nki-api.md §8.4: half bandwidth above "
                              "sbuf_fast_stride_bytes -> 2x the streaming time (upper bound, applied whole)"),
)


# ---- AWS's published DMA measurements (hardware profiles / figures), the points the efficiency rule is checked -----
# against (tests/nkisim/cost/test_dma_efficiency.py, cost design note "Calibration"). Not used by the model itself.
_OVR = "[SDK:dma] nki/get-started/about/nki-dma-overview.rst"
DMA_MEASUREMENTS = {
    # one dma_copy HBM -> SBUF on trn2 (one NeuronCore-v3); engine_s = the profiler's DMA-engine "Duration"
    "trn2_4x4096_bf16": dict(
        target="trn2", partitions=4, row_bytes=8 * KIB, engine_bytes=32 * KIB, engines=1, engine_s=1416e-9,
        source=f"{_OVR} Example 1 (A[4, 4096] bf16, HBM-contiguous): 'the first DMA engine takes 1416 ns to load "
               "32 KiB' (profile nki-dma-intro-3.png) = 23.1 B/ns, the documented 23 B/ns engine peak"),
    "trn2_128x128_bf16": dict(
        target="trn2", partitions=128, row_bytes=256, engine_bytes=2 * KIB, engines=16, engine_s=97e-9,
        source=f"{_OVR} Example 2 (A[128, 128] bf16, HBM-contiguous, 8 SBUF rows of 256 B per engine): tooltip "
               "'Duration: 97ns ... Transfer Size: 2KiB' (profile nki-dma-intro-5.png) = 21.1 B/ns = 92% of 23"),
}
# [SDK:dma] figure nki-dma-intro-1.jpg "DMA Throughput varying Bytes per Partition for p_dim = 128": one [128, B]
# transfer, throughput relative to the B = 32 KiB point, read off the plot by pixel (+-0.01; the y axis carries no
# values and the platform is not named). Throughput doubles with B up to 1 KiB (time per transfer constant), then
# time grows with bytes: max(fixed time, bytes / peak), not fixed time + bytes / peak.
DMA_THROUGHPUT_FIGURE = {32: 0.014, 64: 0.026, 128: 0.050, 256: 0.103, 512: 0.209, 1024: 0.42, 2048: 0.81,
                         4096: 0.97, 8192: 0.98, 16384: 0.99, 32768: 1.0}


def _core_v2():
    return _build(
        CoreSpec, name="NeuronCore-v2", nc_version=(2, "[SDK:arch1] nki-api.md §8.1 column NC-v2"),
        tensor_clock_hz=(2.8e9, "[SDK:arch1] nki-api.md §8.1"),
        tensor_rows=(128, "[SDK:arch1] 128x128 PE array"), tensor_cols=(128, "[SDK:arch1] 128x128 PE array"),
        tensor_bf16_flops=(92e12, "[SDK:arch1] nki-api.md §8.1: 92 BF16/FP16/TF32/cFP8 TFLOPS"),
        tensor_fp8_flops=(92e12, "[SDK:arch1] nki-api.md §8.1: cFP8 at the BF16 rate (no double_row on v2)"),
        tensor_fp32_flops=(23e12, "[SDK:arch1] nki-api.md §8.1"),
        tensor_mxfp8_flops=(92e12, "no MX path on v2; BF16 rate"),
        tensor_sparse_flops=(92e12, "no sparse path documented on v2; BF16 rate"),
        vector_clock_hz=(1.12e9, "[SDK:arch1] nki-api.md §8.1"),
        vector_elems_per_cycle=(128, "[SDK:arch1] nki-api.md §8.1"),
        vector_elems_per_cycle_perf=(128, "[SDK:arch1]: no perf mode on v2"),
        vector_fp32_flops=(1.12e9 * 128, "derived: clock x width"),
        scalar_clock_hz=(1.4e9, "[SDK:arch1] nki-api.md §8.1"),
        scalar_elems_per_cycle=(128, "[SDK:arch1] nki-api.md §8.1"),
        scalar_elems_per_cycle_lowp=(128, "[SDK:arch1] nki-api.md §8.1"),
        scalar_fp32_flops=(1.4e9 * 128, "derived: clock x width"),
        gpsimd_clock_hz=(1.4e9, "[SDK:arch1] nki-api.md §8.1"),
        gpsimd_elems_per_cycle=(128, "[SDK:arch1] nki-api.md §8.1: 8 cores x 512-bit SIMD = 8 x 16 fp32"),
        sbuf_bytes=(24 * MIB, "[SDK:arch1] nki-api.md §8.1: 24 MiB = 128 x 192 KiB"),
        sbuf_partition_bytes=(192 * KIB, "[SDK:arch1] nki-api.md §8.1"),
        psum_bytes=(2 * MIB, "[SDK:arch1] nki-api.md §8.1"), psum_partition_bytes=(16 * KIB, "[SDK:arch1]"),
        psum_banks=(8, "[SDK:arch1] 8 x 2 KiB banks"), partitions=(128, "[SDK:arch1]"),
        dma_engines=(16, "[SDK:dma] nki-api.md §8.1"),
        dma_engine_bytes_per_s=(17e9, "[SDK:dma] nki-api.md §8.1: 17 B/ns (alt: 27 GiB/s peak in [SDK:arch1])"),
        dma_bytes_per_s=(272e9, "[SDK:dma] nki-api.md §8.1: 16 x 17 B/ns"),
        hbm_bytes_per_s=(0.41e12, "derived: Trainium chip 0.82 TB/s / 2 cores (nki-api.md §8.2; alt: 0.8 TB/s)"),
        dma_issue_s=(0.0, "HW-DGE does not exist on v2"),
        **_COMMON_OVERHEADS,
    )


def _core_v3():
    return _build(
        CoreSpec, name="NeuronCore-v3", nc_version=(3, "[SDK:arch2] nki-api.md §8.1 column NC-v3"),
        tensor_clock_hz=(2.4e9, "[SDK:arch2] nki-api.md §8.1"),
        tensor_rows=(128, "[SDK:arch2] 128x128 PE array"), tensor_cols=(128, "[SDK:arch2] 128x128 PE array"),
        tensor_bf16_flops=(79e12, "[SDK:arch2]/[SDK:hw2] nki-api.md §8.1: 79 BF16/FP16/TF32 TFLOPS "
                                  "(cross-check 128x128x2x2.4 GHz = 78.6 TF)"),
        tensor_fp8_flops=(158e12, "[SDK:arch2] nki-api.md §8.1: 158 FP8 TFLOPS (4x128 FP8 in = double_row)"),
        tensor_fp32_flops=(20e12, "[SDK:arch2] nki-api.md §8.1"),
        tensor_mxfp8_flops=(158e12, "no MX path on v3; FP8 rate"),
        tensor_sparse_flops=(316e12, "[SDK:arch2] nki-api.md §8.1"),
        vector_clock_hz=(0.96e9, "[SDK:arch2] nki-api.md §8.1"),
        vector_elems_per_cycle=(256, "[SDK:arch2] nki-api.md §8.1 (cost model uses the per-instruction rule of "
                                     "§8.4 instead: N cycles per input, i.e. 128 elems/cycle)"),
        vector_elems_per_cycle_perf=(512, "[SDK:arch2] nki-api.md §8.1: 512 BF16/FP16 in perf mode"),
        vector_fp32_flops=(1.0e12, "[SDK:hw2] neuron-core-v3.rst: ~1 TFLOPS FP32"),
        scalar_clock_hz=(1.2e9, "[SDK:arch2] nki-api.md §8.1"),
        scalar_elems_per_cycle=(128, "[SDK:arch2] nki-api.md §8.1"),
        scalar_elems_per_cycle_lowp=(128, "[SDK:arch2] nki-api.md §8.1"),
        scalar_fp32_flops=(1.2e12, "[SDK:hw2] neuron-core-v3.rst: 1.2 TFLOPS FP32"),
        gpsimd_clock_hz=(1.2e9, "[SDK:arch2] nki-api.md §8.1"),
        gpsimd_elems_per_cycle=(128, "[SDK:arch2]: 8 cores x 512-bit SIMD = 8 x 16 fp32"),
        sbuf_bytes=(28 * MIB, "[SDK:arch2]/[SDK:hw2] nki-api.md §8.1: 28 MiB = 128 x 224 KiB"),
        sbuf_partition_bytes=(224 * KIB, "[SDK:arch2] nki-api.md §8.1"),
        psum_bytes=(2 * MIB, "[SDK:arch2] nki-api.md §8.1"), psum_partition_bytes=(16 * KIB, "[SDK:arch2]"),
        psum_banks=(8, "[SDK:arch2] 8 x 2 KiB banks"), partitions=(128, "[SDK:arch2]"),
        dma_engines=(16, "[SDK:dma] nki-api.md §8.1"),
        dma_engine_bytes_per_s=(23e9, "[SDK:dma] nki-api.md §8.1: 23 B/ns"),
        dma_bytes_per_s=(368e9, "[SDK:dma] nki-api.md §8.1: 16 x 23 B/ns"),
        hbm_bytes_per_s=(2.9e12 / 8, "derived: chip 2.9 TB/s / 8 cores = 0.3625 TB/s (nki-api.md §8.2; alt: 3 TB/s "
                                     "chip in [SDK:arch2] -> 0.375)"),
        dma_issue_s=(600e-9, "[SDK:arch2] nki-api.md §8.4: HW-DGE DMA instruction ~600 ns (hideable)"),
        **_COMMON_OVERHEADS,
    )


def _core_v4():
    return _build(
        CoreSpec, name="NeuronCore-v4", nc_version=(4, "[SDK:arch3] nki-api.md §8.1 column NC-v4"),
        tensor_clock_hz=(2.4e9, "[SDK:arch3] nki-api.md §8.1"),
        tensor_rows=(128, "[SDK:arch3] 128x128 PE array"), tensor_cols=(128, "[SDK:arch3] 128x128 PE array"),
        tensor_bf16_flops=(79e12, "[SDK:arch3]/[SDK:hw3] nki-api.md §8.1: 79 BF16/FP16/TF32 TFLOPS"),
        tensor_fp8_flops=(79e12, "[SDK:arch3] trainium3_arch.rst TensorE data-path width: '2x128 (non-MXFP8 dense "
                                 "input)' = the BF16 rate; only MXFP8/MXFP4 run faster (8x128)"),
        tensor_fp32_flops=(20e12, "[SDK:arch3] nki-api.md §8.1"),
        tensor_mxfp8_flops=(315e12, "[SDK:arch3] nki-api.md §8.1: 315 MXFP8/MXFP4 TFLOPS"),
        tensor_sparse_flops=(315e12, "[SDK:arch3] nki-api.md §8.1"),
        vector_clock_hz=(1.2e9, "[SDK:arch3] nki-api.md §8.1"),
        vector_elems_per_cycle=(256, "[SDK:arch3] nki-api.md §8.1 (cost model uses §8.4 per-instruction rule)"),
        vector_elems_per_cycle_perf=(512, "[SDK:arch3] nki-api.md §8.1: 512 BF16/FP16/FP8"),
        vector_fp32_flops=(1.2e12, "[SDK:hw3] nki-api.md §8.1: 1.2 TFLOPS FP32"),
        scalar_clock_hz=(1.2e9, "[SDK:arch3] nki-api.md §8.1"),
        scalar_elems_per_cycle=(128, "[SDK:arch3] nki-api.md §8.1"),
        scalar_elems_per_cycle_lowp=(256, "[SDK:arch3] nki-api.md §8.1: 256 BF16/FP16/FP8"),
        scalar_fp32_flops=(1.2e12, "[SDK:hw3] nki-api.md §8.1"),
        gpsimd_clock_hz=(1.2e9, "[SDK:arch3] nki-api.md §8.1"),
        gpsimd_elems_per_cycle=(128, "[SDK:arch3] nki-api.md §8.1: 128 elems/cycle all dtypes"),
        sbuf_bytes=(32 * MIB, "[SDK:arch3] nki-api.md §8.1: 32 MiB = 128 x 256 KiB"),
        sbuf_partition_bytes=(256 * KIB, "[SDK:arch3] nki-api.md §8.1"),
        psum_bytes=(2 * MIB, "[SDK:arch3] nki-api.md §8.1"), psum_partition_bytes=(16 * KIB, "[SDK:arch3]"),
        psum_banks=(8, "[SDK:arch3] 8 x 2 KiB banks"), partitions=(128, "[SDK:arch3]"),
        dma_engines=(16, "[SDK:dma] nki-api.md §8.1"),
        dma_engine_bytes_per_s=(33e9, "[SDK:dma] nki-api.md §8.1: 33 B/ns"),
        dma_bytes_per_s=(528e9, "[SDK:dma] nki-api.md §8.1: 16 x 33 B/ns"),
        hbm_bytes_per_s=(4.9e12 / 8, "derived: chip 4.9 TB/s / 8 cores = 0.6125 TB/s (nki-api.md §8.2; alt: "
                                     "4.7 TB/s chip in [SDK:arch3]); DMA engines cap a core at 0.528 TB/s"),
        dma_issue_s=(600e-9, "v3 figure reused (no v4 number documented)"),
        **_COMMON_OVERHEADS,
    )


_HW2 = "[SDK:hw2] trainium2.rst, nki-api.md §8.2, parallel-and-perf-model.md §2.6"
_HW3 = "[SDK:hw3] trainium3.rst, nki-api.md §8.2"

_TRN1_CHIP = _build(
    ChipSpec, name="Trainium", cores=(2, "[SDK] trainium.rst"),
    bf16_flops=(191e12, "[SDK:hw2] nki-api.md §8.2 (alt: 190; 2 x 92 = 184 per-core figure)"),
    fp8_flops=(191e12, "[SDK:hw2] nki-api.md §8.2"), fp32_flops=(48e12, "[SDK:hw2] nki-api.md §8.2"),
    sparse_flops=(191e12, "no sparse figure; BF16 rate"),
    hbm_bytes=(32 * GIB, "[SDK:hw2] nki-api.md §8.2"),
    hbm_bytes_per_s=(0.82e12, "[SDK:hw2] nki-api.md §8.2 (alt: 0.8 TB/s)"),
    hbm_stacks=(2, "[SDK:hw2] nki-api.md §8.2"), cores_per_hbm_stack=(1, "derived: 2 cores / 2 stacks"),
    dma_engines=(32, "[SDK:hw2] nki-api.md §8.2"), dma_bytes_per_s=(1e12, "[SDK:hw2] nki-api.md §8.2"),
    sbuf_bytes=(48 * MIB, "[SDK:hw2] nki-api.md §8.2"),
    link=("NeuronLink-v2", "[SDK:hw2]"), link_bytes_per_s=(384e9, "[SDK:hw2] nki-api.md §8.2"),
    cc_cores=(6, "[SDK:hw2] nki-api.md §8.2"),
)

_TRN2_CHIP = _build(
    ChipSpec, name="Trainium2", cores=(8, _HW2),
    bf16_flops=(667e12, f"{_HW2}: 667 BF16/FP16/TF32 (alt: 8 x 79 = 632 per-core; v2.21 docs 655)"),
    fp8_flops=(1299e12, f"{_HW2} (alt: 1,287 in v2.21 docs)"), fp32_flops=(181e12, _HW2),
    sparse_flops=(2563e12, f"{_HW2} (alt: 2,551)"),
    hbm_bytes=(96 * GIB, f"{_HW2}: 96 GiB = 4 x 24 GB stacks"),
    hbm_bytes_per_s=(2.9e12, f"{_HW2}: 2.9 TB/s (alt: 3 TB/s in [SDK:arch2])"),
    hbm_stacks=(4, _HW2), cores_per_hbm_stack=(2, "[SDK:lncfg]: each stack shared by 2 physical cores"),
    dma_engines=(128, _HW2), dma_bytes_per_s=(3.5e12, f"{_HW2}: 3.5 TB/s (inline compression)"),
    sbuf_bytes=(224 * MIB, _HW2),
    link=("NeuronLink-v3", _HW2), link_bytes_per_s=(1.28e12, f"{_HW2}: 1.28 TB/s per chip (4 links)"),
    cc_cores=(16, f"{_HW2} (alt: 20 in [SDK:arch2])"),
)

_TRN3_CHIP = _build(
    ChipSpec, name="Trainium3", cores=(8, _HW3),
    bf16_flops=(671e12, f"{_HW3}: 671 BF16/FP16/TF32"), fp8_flops=(2517e12, f"{_HW3}: 2,517 MXFP8/MXFP4"),
    fp32_flops=(183e12, _HW3), sparse_flops=(2517e12, _HW3),
    hbm_bytes=(144 * GIB, f"{_HW3}: 144 GiB (4 stacks)"),
    hbm_bytes_per_s=(4.9e12, f"{_HW3}: 4.9 TB/s (alt: 4.7 TB/s in [SDK:arch3])"),
    hbm_stacks=(4, _HW3), cores_per_hbm_stack=(2, "derived: 8 cores / 4 stacks (LNC=2 pairs, [SDK:lncfg])"),
    dma_engines=(128, _HW3), dma_bytes_per_s=(4.9e12, _HW3),
    sbuf_bytes=(256 * MIB, _HW3),
    link=("NeuronLink-v4", _HW3), link_bytes_per_s=(2.56e12, f"{_HW3}: 2.56 TB/s per chip"),
    cc_cores=(16, f"{_HW3} (alt: 20 in [SDK:arch3])"),
)

_T2A = "[SDK:trn2-arch] trn2-arch.rst, nki-api.md §8.3, parallel-and-perf-model.md §2.6"
_TRN2_INSTANCE = _build(
    InstanceSpec, name="trn2.48xlarge", chips=(16, _T2A), topology=("4x4 2D torus (NeuronLink-v3)", _T2A),
    link_bytes_per_s_per_chip=(1024e9, f"{_T2A}: intra-instance NeuronLink-v3 1,024 GB/s per chip "
                                       "(derived: 4 torus links x ~256 GB/s; direction not stated)"),
    inter_bytes_per_s_per_chip=(0.0, "single instance: no NeuronLink to other instances"),
    fp8_flops=(20.8e15, _T2A), bf16_flops=(10.7e15, _T2A), fp32_flops=(2.9e15, _T2A),
    hbm_bytes=(1536 * GIB, _T2A), hbm_bytes_per_s=(46.4e12, _T2A),
    efa_bits_per_s=(3200e9, f"{_T2A}: EFAv3 3.2 Tbps"),
    default_lnc=(2, "[SDK:lncfg]: LNC=2 default on Trn2 (64 logical cores per instance; LNC=1 -> 128)"),
)
_TRN2_ULTRA = _build(
    InstanceSpec, name="Trn2 UltraServer (4 x trn2u.48xlarge)", chips=(64, _T2A),
    topology=("4 x (4x4 2D torus); same-coordinate chips ringed across instances", _T2A),
    link_bytes_per_s_per_chip=(1024e9, _T2A),
    inter_bytes_per_s_per_chip=(256e9, f"{_T2A}: inter-instance NeuronLink 256 GB/s per chip"),
    fp8_flops=(83.2e15, _T2A), bf16_flops=(4 * 10.7e15, "derived: 4 x trn2.48xlarge"),
    fp32_flops=(4 * 2.9e15, "derived: 4 x trn2.48xlarge"),
    hbm_bytes=(6 * 1024 * GIB, _T2A), hbm_bytes_per_s=(185.6e12, _T2A),
    efa_bits_per_s=(4 * 3200e9, "derived: 4 x trn2.48xlarge"), default_lnc=(2, "[SDK:lncfg]"),
)

_T3A = "[SDK:trn3-arch] trn3-arch.rst, nki-api.md §8.3"
_TRN3_SERVER = _build(
    InstanceSpec, name="Trn3 server (Gen1 UltraServer member)", chips=(16, f"{_T3A}: Gen1 = 4 servers x 16 chips"),
    topology=("NeuronSwitch-v1 all-to-all (replaces the torus)", _T3A),
    link_bytes_per_s_per_chip=(256e9, f"{_T3A}: intra-server 256 GB/s per chip (PCIe Gen6 x8 links, bidirectional)"),
    inter_bytes_per_s_per_chip=(320e9, f"{_T3A}: inter-server 320 GB/s per chip (inter-rack 128 GB/s)"),
    fp8_flops=(161e15 / 4, "derived: Gen1 UltraServer 161 PF MXFP8 / 4 servers"),
    bf16_flops=(16 * 671e12, "derived: 16 x chip BF16"), fp32_flops=(16 * 183e12, "derived: 16 x chip FP32"),
    hbm_bytes=(16 * 144 * GIB, "derived: 16 x 144 GiB"), hbm_bytes_per_s=(313.6e12 / 4, "derived: 313.6 TB/s / 4"),
    efa_bits_per_s=(0.0, "not documented in our sources"),
    default_lnc=(2, "[SDK:lncfg]: LNC 1 or 2 applies to Trn3 (2 assumed default as on Trn2)"),
)
_TRN3_ULTRA = _build(
    InstanceSpec, name="Trn3 Gen1 UltraServer (4 servers x 16 chips)", chips=(64, _T3A),
    topology=("NeuronSwitch-v1 all-to-all; NeuronLink-v4 2,048 GiB/s per device", _T3A),
    link_bytes_per_s_per_chip=(256e9, _T3A), inter_bytes_per_s_per_chip=(320e9, _T3A),
    fp8_flops=(161e15, _T3A), bf16_flops=(64 * 671e12, "derived: 64 x chip BF16"),
    fp32_flops=(64 * 183e12, "derived: 64 x chip FP32"),
    hbm_bytes=(9 * 1024 * GIB, _T3A), hbm_bytes_per_s=(313.6e12, _T3A),
    efa_bits_per_s=(0.0, "not documented in our sources"), default_lnc=(2, "[SDK:lncfg]"),
)

_CC = "[SDK:cc] intranode-collective-comm.rst, parallel-and-perf-model.md §2.3/§2.6"
_COLLECTIVE = _build(
    CollectiveSpec,
    hop_latency_s=(1.5e-6, f"{_CC}: Ring/KangaRing per-hop latency about 1-2 us (midpoint; HBM-load dependent)"),
    base_latency_s=(5e-6, f"ASSUMPTION within {_CC}: latency term 1-10 us (GenZ ring AR uses 5 us base; "
                          "parallel-and-perf §3)"),
    mesh_max_bytes=(1 << 20, f"{_CC}: Mesh < 1 MB"),
    rdh_max_bytes=(56 << 20, f"{_CC}: RDH 1-56 MB, KangaRing > 56 MB"),
)

HARDWARE: dict[str, Platform] = {
    "trn1": Platform("trn1", _core_v2(), _TRN1_CHIP, None, None, _COLLECTIVE),
    "trn2": Platform("trn2", _core_v3(), _TRN2_CHIP, _TRN2_INSTANCE, _TRN2_ULTRA, _COLLECTIVE),
    "trn3": Platform("trn3", _core_v4(), _TRN3_CHIP, _TRN3_SERVER, _TRN3_ULTRA, _COLLECTIVE),
}

def hardware(name=None) -> Platform:
    """Platform by name ("trn2", "trn3", "trn1", gen aliases) or by an nkisim Target; default from the env/trn2."""
    if name is None or not isinstance(name, str):
        from .target import resolve_target
        name = getattr(name, "name", None) or resolve_target().name
    from .target import ALIASES
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in HARDWARE:
        raise KeyError(f"no hardware table for {name!r}; known: {sorted(HARDWARE)}")
    return HARDWARE[key]


# =====================================================================================================================
# Collective bus-bandwidth plateaus per algorithm: used by the cost of nki.collectives instructions
# (nkisim.cost.collective) and, through its own collective table (bench/model/_hw_source.collective_table, which
# labels each value documented / ASSUMPTION), by the bench. Modelled defaults, uncalibrated; replace with an
# nccom-test sweep on the target instance.
# =====================================================================================================================
_NCCOM = "nccom-test.rst example (parallel-and-perf-model.md §2.2)"
COLLECTIVE_BUSBW = {
    # bytes/s of bus bandwidth (nccl-tests convention) reached by each Neuron intra-node algorithm
    "trn2": {"Mesh": 50e9, "RDH": 100e9, "KangaRing": 100e9},
    "trn3": {"Mesh": 50e9, "RDH": 100e9, "KangaRing": 100e9},
}
COLLECTIVE_BUSBW_SOURCES = {
    "KangaRing": f"{_NCCOM}: 16-rank all-reduce KangaRing busbw 22.8 -> 103.9 GiB/s at 32-512 MiB; vllm-neuron "
                 "docs/kernel_ledger.md collective model uses 100 GB/s",
    "RDH": "assumed equal to the KangaRing plateau (the 2 MiB nccom-test RDH point, 5.7 GiB/s, is latency-dominated)",
    "Mesh": "assumed half the plateau: Mesh over-subscribes links ([SDK:cc] 'link over-subscription'); "
            "small messages are alpha-dominated so this barely matters",
    "trn3": "no Trn3 collective measurement found; the Trn2 anchors are reused",
}
